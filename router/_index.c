/* The router index's hot loops (router/index.py, BlockIndex): event ingest (add_copies,
 * remove_copies) and the lookup's walk (run_ends): how far each replica's run of consecutive held
 * blocks reaches along a request's hash chain.
 *
 * Each replica owns one bit; the index keeps, per medium, a dict {block hash: mask of the
 * replicas holding it}. For the chain h_start, h_start+1, ... the run mask
 *
 *     run_k = mask & held(h_start) & ... & held(h_start+k-1),   held(h) = OR over dicts of d.get(h, 0)
 *
 * only loses bits; a bit's run ends at the first index whose mask lacks it. One pass, one dict
 * probe per block per dict, stopping as soon as no bit is left: the same answer as the Python
 * accumulate + bisection in router/index.py (_run_ends), which stays as the fallback when this module
 * is not built or a mask is wider than 64 bits (more than 64 replicas ever indexed).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* A dict value as a 64-bit mask; -1 with OverflowError set when it does not fit. */
static int as_mask(PyObject *v, uint64_t *out) {
    unsigned long long m = PyLong_AsUnsignedLongLong(v);
    if (m == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    *out = m;
    return 0;
}

/* ends[bit] = end for every bit of ``bits``; -1 with an exception set on failure. */
static int set_ends(PyObject *ends, uint64_t bits, Py_ssize_t end) {
    PyObject *e = PyLong_FromSsize_t(end);
    if (e == NULL)
        return -1;
    int rc = 0;
    while (bits && rc == 0) {
        uint64_t low = bits & (~bits + 1);
        PyObject *k = PyLong_FromUnsignedLongLong(low);
        rc = k ? PyDict_SetItem(ends, k, e) : -1;
        Py_XDECREF(k);
        bits ^= low;
    }
    Py_DECREF(e);
    return rc;
}

PyDoc_STRVAR(run_ends_doc,
"run_ends(hashes, dicts, start, mask) -> dict[int, int]\n\n"
"For each bit of ``mask`` (an int below 2**64): the index one past the last of the consecutive\n"
"chain entries from ``start`` on whose held mask (the OR of ``d.get(h, 0)`` over ``dicts``)\n"
"carries the bit; ``start`` itself when the entry at ``start`` lacks it. Keys are the single-bit\n"
"ints of ``mask``.\n\n"
"hashes: a list of ints. dicts: a tuple of dicts {hash: mask}.\n"
"Raises OverflowError when ``mask`` or a dict value does not fit in 64 bits (the caller falls\n"
"back to its Python version), TypeError for other argument types.");

static PyObject *run_ends(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *hashes, *dicts, *mask_obj;
    Py_ssize_t start;
    if (!PyArg_ParseTuple(args, "O!O!nO", &PyList_Type, &hashes, &PyTuple_Type, &dicts, &start, &mask_obj))
        return NULL;
    uint64_t run;
    if (as_mask(mask_obj, &run) < 0)
        return NULL;
    Py_ssize_t nd = PyTuple_GET_SIZE(dicts);
    for (Py_ssize_t j = 0; j < nd; j++)
        if (!PyDict_CheckExact(PyTuple_GET_ITEM(dicts, j))) {
            PyErr_Format(PyExc_TypeError, "dicts[%zd]: expected a dict", j);
            return NULL;
        }
    Py_ssize_t n = PyList_GET_SIZE(hashes);
    if (start < 0)
        start = 0;
    PyObject *ends = PyDict_New();
    if (ends == NULL)
        return NULL;
    Py_ssize_t i = start;
    for (; i < n && run; i++) {
        PyObject *h = PyList_GET_ITEM(hashes, i);
        uint64_t held = 0;
        for (Py_ssize_t j = 0; j < nd; j++) {
            PyObject *v = PyDict_GetItemWithError(PyTuple_GET_ITEM(dicts, j), h); /* borrowed */
            if (v == NULL) {
                if (PyErr_Occurred())
                    goto fail;
                continue;
            }
            uint64_t m;
            if (as_mask(v, &m) < 0)
                goto fail;
            held |= m;
        }
        if ((run & ~held) && set_ends(ends, run & ~held, i) < 0)
            goto fail;
        run &= held;
    }
    if (set_ends(ends, run, i) < 0) /* bits held to the end of the chain */
        goto fail;
    return ends;
fail:
    Py_DECREF(ends);
    return NULL;
}

/* (counts, mask, hashes, bit) of add_copies / remove_copies: the hashes as a new list or tuple
 * reference, the rest borrowed; NULL with TypeError on bad types. */
static PyObject *event_args(PyObject *args, PyObject **counts, PyObject **mask, PyObject **bit) {
    PyObject *hashes;
    if (!PyArg_ParseTuple(args, "O!O!OO!", &PyDict_Type, counts, &PyDict_Type, mask, &hashes, &PyLong_Type, bit))
        return NULL;
    return PySequence_Fast(hashes, "hashes: expected an iterable of ints");
}

PyDoc_STRVAR(add_doc,
"add_copies(counts, mask, hashes, bit) -> None\n\n"
"BlockStored on one (replica, medium): counts[h] += 1 for each h of ``hashes`` (an iterable of\n"
"ints); a hash new to the replica gets ``bit`` OR-ed into mask[h]. Same as BlockIndex.add's loop.");

static PyObject *add_copies(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *counts, *mask, *bit, *seq = event_args(args, &counts, &mask, &bit);
    if (seq == NULL)
        return NULL;
    PyObject *one = PyLong_FromLong(1);
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    for (Py_ssize_t i = 0; i < n && one; i++) {
        PyObject *h = PySequence_Fast_GET_ITEM(seq, i);
        PyObject *c = PyDict_GetItemWithError(counts, h); /* borrowed */
        int rc;
        if (c != NULL) {
            long v = PyLong_AsLong(c);
            PyObject *next = (v == -1 && PyErr_Occurred()) ? NULL : PyLong_FromLong(v + 1);
            rc = next ? PyDict_SetItem(counts, h, next) : -1;
            Py_XDECREF(next);
        } else if (PyErr_Occurred()) {
            rc = -1;
        } else if ((rc = PyDict_SetItem(counts, h, one)) == 0) {
            PyObject *m = PyDict_GetItemWithError(mask, h);
            PyObject *merged = m ? PyNumber_Or(m, bit) : (PyErr_Occurred() ? NULL : Py_NewRef(bit));
            rc = merged ? PyDict_SetItem(mask, h, merged) : -1;
            Py_XDECREF(merged);
        }
        if (rc < 0)
            Py_CLEAR(one);
    }
    Py_DECREF(seq);
    if (one == NULL)
        return NULL;
    Py_DECREF(one);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(remove_doc,
"remove_copies(counts, mask, hashes, bit) -> int\n\n"
"BlockRemoved on one (replica, medium): counts[h] -= 1 for each h of ``hashes``; at zero the\n"
"entry goes and ``bit`` leaves mask[h] (the entry goes with the last bit). Returns how many\n"
"hashes were not indexed. Same as BlockIndex.remove's loop.");

static PyObject *remove_copies(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *counts, *mask, *bit, *seq = event_args(args, &counts, &mask, &bit);
    if (seq == NULL)
        return NULL;
    PyObject *keep = PyNumber_Invert(bit);
    Py_ssize_t missing = 0, n = PySequence_Fast_GET_SIZE(seq);
    int rc = keep ? 0 : -1;
    for (Py_ssize_t i = 0; i < n && rc == 0; i++) {
        PyObject *h = PySequence_Fast_GET_ITEM(seq, i);
        PyObject *c = PyDict_GetItemWithError(counts, h); /* borrowed */
        if (c == NULL) {
            if (PyErr_Occurred())
                rc = -1;
            else
                missing++;
            continue;
        }
        long v = PyLong_AsLong(c);
        if (v == -1 && PyErr_Occurred()) {
            rc = -1;
        } else if (v > 1) {
            PyObject *next = PyLong_FromLong(v - 1);
            rc = next ? PyDict_SetItem(counts, h, next) : -1;
            Py_XDECREF(next);
        } else if ((rc = PyDict_DelItem(counts, h)) == 0) {
            PyObject *m = PyDict_GetItemWithError(mask, h);
            if (m == NULL) {
                rc = PyErr_Occurred() ? -1 : 0;
                continue;
            }
            PyObject *left = PyNumber_And(m, keep);
            if (left == NULL)
                rc = -1;
            else if (PyObject_IsTrue(left))
                rc = PyDict_SetItem(mask, h, left);
            else
                rc = PyDict_DelItem(mask, h);
            Py_XDECREF(left);
        }
    }
    Py_XDECREF(keep);
    Py_DECREF(seq);
    if (rc < 0)
        return NULL;
    return PyLong_FromSsize_t(missing);
}

static PyMethodDef methods[] = {
    {"run_ends", run_ends, METH_VARARGS, run_ends_doc},
    {"add_copies", add_copies, METH_VARARGS, add_doc},
    {"remove_copies", remove_copies, METH_VARARGS, remove_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "router._index", "The router index's hot loops in C (see router/index.py).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__index(void) { return PyModule_Create(&module_def); }
