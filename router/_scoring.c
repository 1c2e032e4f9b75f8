/* The default cost model (router/scoring.py) over every candidate of one decision, in C: what
 * router.scoring.default_costs computes in Python for a CandidateTable, one pass over the
 * registry's records without a Candidate object per replica (at 1,024 replicas those objects and
 * their attribute reads were most of a decision).
 *
 * Bit for bit the Python sum: the same float operations in the same order (ints converted as
 * Python converts them, through float()), compiled without contraction into fused multiply-adds
 * (setup.py: -ffp-contract=off); tests compare the two.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdlib.h>

static PyObject *zero; /* the int 0 */
static PyObject *s_replica_id, *s_queued, *s_running, *s_waiting, *s_usage, *s_gpu, *s_cpu, *s_prefill, *s_decode;

/* A record's fields are read from its instance dict when that is what getattr would do: its type
 * looks attributes up the plain way and has no data descriptor of those names (a dataclass's
 * fields). One dict probe per field instead of a look through the type first: at 1,024 replicas
 * the reads were most of the pass. */
typedef struct {
    PyTypeObject *type; /* the last record's type (this call's records only) */
    int plain;
} kind_t;

static int plain_type(PyTypeObject *tp, PyObject *const *names, int n) {
    if (tp->tp_getattro != PyObject_GenericGetAttr)
        return 0;
    for (int k = 0; k < n; k++) {
        PyObject *d = _PyType_Lookup(tp, names[k]); /* borrowed */
        if (d != NULL && Py_TYPE(d)->tp_descr_set != NULL)
            return 0;
    }
    return 1;
}

/* obj's instance dict (a new reference) when reading fields from it is getattr; else NULL. */
static PyObject *record_dict(PyObject *obj, kind_t *kind, PyObject *const *names, int n) {
    if (Py_TYPE(obj) != kind->type) {
        kind->type = Py_TYPE(obj);
        kind->plain = plain_type(kind->type, names, n);
    }
    if (!kind->plain)
        return NULL;
    PyObject *d = PyObject_GenericGetDict(obj, NULL);
    if (d == NULL)
        PyErr_Clear();
    return d;
}

/* getattr(obj, name) as a new reference; d: record_dict(obj) or NULL. */
static PyObject *get_field(PyObject *obj, PyObject *d, PyObject *name) {
    if (d != NULL) {
        PyObject *v = PyDict_GetItemWithError(d, name);
        if (v != NULL)
            return Py_NewRef(v);
        if (PyErr_Occurred())
            return NULL;
    }
    return PyObject_GetAttr(obj, name);
}

/* float(getattr(obj, name)); -1 with an exception set on failure. */
static int attr_double(PyObject *obj, PyObject *d, PyObject *name, double *out) {
    PyObject *v = get_field(obj, d, name);
    if (v == NULL)
        return -1;
    *out = PyFloat_AsDouble(v);
    Py_DECREF(v);
    return *out == -1.0 && PyErr_Occurred() ? -1 : 0;
}

/* float(d.get(key, 0)) */
static int get_double(PyObject *d, PyObject *key, double *out) {
    PyObject *v = PyDict_GetItemWithError(d, key); /* borrowed */
    if (v == NULL) {
        *out = 0.0;
        return PyErr_Occurred() ? -1 : 0;
    }
    *out = PyFloat_AsDouble(v);
    return *out == -1.0 && PyErr_Occurred() ? -1 : 0;
}

PyDoc_STRVAR(costs_doc,
"costs(infos, matches, in_flight, pending, prompt_tokens, block_size, rate, step_s, weights) -> list[float]\n\n"
"Every candidate's default cost, in the order of ``infos`` (the registry's records: replica_id,\n"
"queued_prefill_tokens, running, waiting, usage), ``matches`` {replica_id: Match} (absent: none),\n"
"``in_flight`` / ``pending`` {replica_id: int} (absent: 0), the prefill rate and decode seconds per\n"
"running sequence charged to all, and ``weights`` (prefill_work, backlog_work, cpu_match,\n"
"kv_footprint, kv_usage, in_flight) as floats. Equal to router.scoring.default_costs.");

static PyObject *costs(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *infos, *matches, *in_flight, *pending;
    Py_ssize_t prompt_i, block_i;
    double rate, step_s, work_w, backlog_w, cpu_w, footprint_w, kv_w, flight_w;
    if (!PyArg_ParseTuple(args, "O!O!O!O!nndd(dddddd)", &PyList_Type, &infos, &PyDict_Type, &matches, &PyDict_Type,
                          &in_flight, &PyDict_Type, &pending, &prompt_i, &block_i, &rate, &step_s, &work_w, &backlog_w,
                          &cpu_w, &footprint_w, &kv_w, &flight_w))
        return NULL;
    double prompt = (double)prompt_i, block = (double)block_i;
    Py_ssize_t n = PyList_GET_SIZE(infos);
    PyObject *out = PyList_New(n);
    if (out == NULL)
        return NULL;
    PyObject *const fields[] = {s_replica_id, s_running, s_waiting, s_usage, s_queued};
    kind_t kind = {NULL, 0}, mkind = {NULL, 0};
    PyObject *const mfields[] = {s_gpu, s_cpu};
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *info = PyList_GET_ITEM(infos, i), *d = record_dict(info, &kind, fields, 5);
        PyObject *rid = get_field(info, d, s_replica_id);
        if (rid == NULL) {
            Py_XDECREF(d);
            goto fail;
        }
        double running, waiting, kv, flight, gpu = 0.0, cpu = 0.0, queued;
        int rc = attr_double(info, d, s_running, &running) || attr_double(info, d, s_waiting, &waiting)
                 || attr_double(info, d, s_usage, &kv) || get_double(in_flight, rid, &flight);
        /* queued = max(info.queued_prefill_tokens, pending.get(rid, 0)), compared as Python compares */
        PyObject *q = rc ? NULL : get_field(info, d, s_queued), *p = NULL;
        Py_XDECREF(d);
        if (q != NULL) {
            p = PyDict_GetItemWithError(pending, rid);
            if (p == NULL && PyErr_Occurred()) {
                rc = -1;
            } else {
                PyObject *b = p == NULL ? zero : p;
                int more = PyObject_RichCompareBool(b, q, Py_GT);
                queued = more < 0 ? -1.0 : PyFloat_AsDouble(more ? b : q);
                rc = more < 0 || (queued == -1.0 && PyErr_Occurred());
            }
            Py_DECREF(q);
        } else {
            rc = -1;
        }
        PyObject *m = rc ? NULL : PyDict_GetItemWithError(matches, rid); /* borrowed */
        if (m != NULL) {
            PyObject *md = record_dict(m, &mkind, mfields, 2);
            rc = attr_double(m, md, s_gpu, &gpu) || attr_double(m, md, s_cpu, &cpu);
            Py_XDECREF(md);
        }
        else if (!rc && PyErr_Occurred())
            rc = -1;
        Py_DECREF(rid);
        if (rc)
            goto fail;
        /* router.scoring.default_costs, term for term */
        double x = prompt - block * (gpu + cpu_w * cpu);
        double u = 1.0 > x ? 1.0 : x; /* max(x, 1.0) */
        double cost = 0.0 + (queued + u) / rate + running * step_s + (work_w + backlog_w * waiting) * u / rate
                      + footprint_w * kv * prompt / rate + kv * kv_w + flight * flight_w;
        PyObject *f = PyFloat_FromDouble(cost);
        if (f == NULL)
            goto fail;
        PyList_SET_ITEM(out, i, f);
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

typedef struct {
    double v;
    PyObject *obj; /* owned by the list ``values`` of pool_rates */
} rate_t;

/* Rearranges r[0..n) so that r[k] is the one a sort would put there (smaller ones before it). */
static void select_kth(rate_t *r, Py_ssize_t n, Py_ssize_t k) {
    Py_ssize_t lo = 0, hi = n - 1;
    while (lo < hi) {
        double pivot = r[lo + (hi - lo) / 2].v;
        Py_ssize_t i = lo, j = hi;
        while (i <= j) {
            while (r[i].v < pivot)
                i++;
            while (r[j].v > pivot)
                j--;
            if (i <= j) {
                rate_t t = r[i];
                r[i++] = r[j];
                r[j--] = t;
            }
        }
        if (k <= j)
            hi = j;
        else if (k >= i)
            lo = i;
        else
            return;
    }
}

/* statistics.median of the values > 0 (0.0 when none is): the middle one, or the mean of the two
 * middle ones, found by selection (a sort per decision was a tenth of it at 1,024 replicas). */
static PyObject *median(rate_t *r, Py_ssize_t k) {
    if (k == 0)
        return PyFloat_FromDouble(0.0);
    select_kth(r, k, k / 2);
    if (k % 2)
        return Py_NewRef(r[k / 2].obj);
    Py_ssize_t below = 0; /* the largest of r[0 .. k/2): the other middle one */
    for (Py_ssize_t i = 1; i < k / 2; i++)
        if (r[i].v > r[below].v)
            below = i;
    PyObject *two = PyLong_FromLong(2), *sum = PyNumber_Add(r[below].obj, r[k / 2].obj);
    PyObject *mid = two && sum ? PyNumber_TrueDivide(sum, two) : NULL;
    Py_XDECREF(two);
    Py_XDECREF(sum);
    return mid;
}

/* v > 0 as Python says it (1, 0, -1 with an exception), without the generic comparison for the
 * exact floats a heartbeat holds. */
static int positive(PyObject *v) {
    if (PyFloat_CheckExact(v))
        return PyFloat_AS_DOUBLE(v) > 0.0;
    return PyObject_RichCompareBool(v, zero, Py_GT);
}

PyDoc_STRVAR(pool_rates_doc,
"pool_rates(infos) -> (prefill_tokens_per_s, decode_seconds_per_running)\n\n"
"router.scoring.pool_rate of each over the records ``infos``: the median of the values > 0.");

static PyObject *pool_rates(PyObject *self, PyObject *arg) {
    (void)self;
    if (!PyList_Check(arg))
        return PyErr_Format(PyExc_TypeError, "infos: expected a list");
    Py_ssize_t n = PyList_GET_SIZE(arg), k[2] = {0, 0};
    PyObject *values = PyList_New(0), *result = NULL, *med[2] = {NULL, NULL};
    rate_t *r = malloc((n ? 2 * n : 1) * sizeof(rate_t)); /* prefill ones first, decode ones from n */
    if (values == NULL || r == NULL)
        goto done;
    PyObject *const names[2] = {s_prefill, s_decode};
    kind_t kind = {NULL, 0};
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *info = PyList_GET_ITEM(arg, i), *rd = record_dict(info, &kind, names, 2);
        for (int which = 0; which < 2; which++) {
            PyObject *v = get_field(info, rd, names[which]);
            int pos = v == NULL ? -1 : positive(v);
            double d = pos > 0 ? PyFloat_AsDouble(v) : 0.0;
            int rc = pos < 0 || (d == -1.0 && PyErr_Occurred()) || (pos > 0 && PyList_Append(values, v) < 0);
            Py_XDECREF(v); /* values keeps the ones that count */
            if (rc) {
                Py_XDECREF(rd);
                goto done;
            }
            if (pos > 0)
                r[which * n + k[which]++] = (rate_t){d, PyList_GET_ITEM(values, PyList_GET_SIZE(values) - 1)};
        }
        Py_XDECREF(rd);
    }
    if ((med[0] = median(r, k[0])) == NULL || (med[1] = median(r + n, k[1])) == NULL)
        goto done;
    result = PyTuple_Pack(2, med[0], med[1]);
done:
    Py_XDECREF(med[0]);
    Py_XDECREF(med[1]);
    Py_XDECREF(values);
    free(r);
    return result;
}

static PyMethodDef methods[] = {
    {"costs", costs, METH_VARARGS, costs_doc},
    {"pool_rates", pool_rates, METH_O, pool_rates_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "router._scoring", "The default cost over a decision's candidates in C (see router/scoring.py).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__scoring(void) {
    struct { PyObject **slot; const char *name; } names[] = {
        {&s_replica_id, "replica_id"}, {&s_queued, "queued_prefill_tokens"}, {&s_running, "running"},
        {&s_waiting, "waiting"}, {&s_usage, "usage"}, {&s_gpu, "gpu"}, {&s_cpu, "cpu"},
        {&s_prefill, "prefill_tokens_per_s"}, {&s_decode, "decode_seconds_per_running"},
    };
    if (zero == NULL && (zero = PyLong_FromLong(0)) == NULL)
        return NULL;
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
        if (*names[i].slot == NULL && (*names[i].slot = PyUnicode_InternFromString(names[i].name)) == NULL)
            return NULL;
    return PyModule_Create(&module_def);
}
