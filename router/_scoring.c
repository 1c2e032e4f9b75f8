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

/* float(getattr(obj, name)); -1 with an exception set on failure. */
static int attr_double(PyObject *obj, PyObject *name, double *out) {
    PyObject *v = PyObject_GetAttr(obj, name);
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
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *info = PyList_GET_ITEM(infos, i), *rid = PyObject_GetAttr(info, s_replica_id);
        if (rid == NULL)
            goto fail;
        double running, waiting, kv, flight, gpu = 0.0, cpu = 0.0, queued;
        int rc = attr_double(info, s_running, &running) || attr_double(info, s_waiting, &waiting)
                 || attr_double(info, s_usage, &kv) || get_double(in_flight, rid, &flight);
        /* queued = max(info.queued_prefill_tokens, pending.get(rid, 0)), compared as Python compares */
        PyObject *q = rc ? NULL : PyObject_GetAttr(info, s_queued), *p = NULL;
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
        if (m != NULL)
            rc = attr_double(m, s_gpu, &gpu) || attr_double(m, s_cpu, &cpu);
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
    PyObject *obj; /* borrowed from the list being built */
} rate_t;

static int cmp_rate(const void *a, const void *b) {
    double x = ((const rate_t *)a)->v, y = ((const rate_t *)b)->v;
    return (x > y) - (x < y);
}

/* statistics.median of the values > 0 (0.0 when none is): the middle one, or the mean of two. */
static PyObject *median(rate_t *r, Py_ssize_t k) {
    if (k == 0)
        return PyFloat_FromDouble(0.0);
    qsort(r, k, sizeof(rate_t), cmp_rate);
    if (k % 2)
        return Py_NewRef(r[k / 2].obj);
    PyObject *two = PyLong_FromLong(2), *sum = PyNumber_Add(r[k / 2 - 1].obj, r[k / 2].obj);
    PyObject *mid = two && sum ? PyNumber_TrueDivide(sum, two) : NULL;
    Py_XDECREF(two);
    Py_XDECREF(sum);
    return mid;
}

PyDoc_STRVAR(pool_rates_doc,
"pool_rates(infos) -> (prefill_tokens_per_s, decode_seconds_per_running)\n\n"
"router.scoring.pool_rate of each over the records ``infos``: the median of the values > 0.");

static PyObject *pool_rates(PyObject *self, PyObject *arg) {
    (void)self;
    if (!PyList_Check(arg))
        return PyErr_Format(PyExc_TypeError, "infos: expected a list");
    Py_ssize_t n = PyList_GET_SIZE(arg);
    PyObject *values = PyList_New(0), *result = NULL, *med[2] = {NULL, NULL};
    rate_t *r = malloc((n ? n : 1) * sizeof(rate_t));
    if (values == NULL || r == NULL)
        goto done;
    PyObject *names[2] = {s_prefill, s_decode};
    for (int which = 0; which < 2; which++) {
        Py_ssize_t k = 0;
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *v = PyObject_GetAttr(PyList_GET_ITEM(arg, i), names[which]);
            if (v == NULL)
                goto done;
            int positive = PyObject_RichCompareBool(v, zero, Py_GT);
            double d = positive > 0 ? PyFloat_AsDouble(v) : 0.0;
            int rc = positive < 0 || (d == -1.0 && PyErr_Occurred()) || (positive > 0 && PyList_Append(values, v) < 0);
            Py_DECREF(v); /* values keeps the ones that count */
            if (rc)
                goto done;
            if (positive > 0)
                r[k++] = (rate_t){d, PyList_GET_ITEM(values, PyList_GET_SIZE(values) - 1)};
        }
        if ((med[which] = median(r, k)) == NULL)
            goto done;
    }
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
