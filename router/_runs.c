/* The router index's hot loop (router/index.py, BlockIndex.lookup): how far each replica's run of
 * consecutive held blocks reaches along a request's hash chain.
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

static PyMethodDef methods[] = {
    {"run_ends", run_ends, METH_VARARGS, run_ends_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "router._runs", "The router index's run-length walk in C (see router/index.py).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__runs(void) { return PyModule_Create(&module_def); }
