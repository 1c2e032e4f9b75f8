/* Compiled block-hash chain for kvroute.hashing (DESIGN.md §2): the hot path of every routing
 * decision and of every prefix-cache lookup.
 *
 * For each full block i of a prompt it assembles, in one reused buffer,
 *
 *     head | parent | CBOR array head(block_size) | CBOR uint per token | tail_i
 *
 * which is byte for byte cbor2.dumps((parent, tuple(block), extra_i), canonical=True) when
 * ``head`` is 0x83 followed by the byte-string head of the digest length and ``tail_i`` is the
 * canonical CBOR of extra_i (0xf6 for None), and digests it; the digest is the next block's parent.
 * Unsigned ints take the shortest form of RFC 8949 §3.
 *
 * The digest is SHA-256 through OpenSSL's libcrypto (the library CPython's hashlib already loaded,
 * its low-level SHA256_Init/Update/Final: no EVP context per call), or any Python callable
 * bytes -> bytes (xxhash.xxh3_128_digest, or hashlib's sha256 when libcrypto's symbols are not
 * found). kvroute/hashing.py falls back to its numpy path when this module is not built, and the
 * tests check all paths against a plain cbor2 + hashlib loop.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <stdint.h>
#include <string.h>

typedef int (*sha256_init_fn)(void *);
typedef int (*sha256_update_fn)(void *, const void *, size_t);
typedef int (*sha256_final_fn)(unsigned char *, void *);

static sha256_init_fn p_init;
static sha256_update_fn p_update;
static sha256_final_fn p_final;

/* SHA256_CTX is 112 bytes in OpenSSL 1.1 and 3.x; a larger aligned buffer leaves room. */
typedef union {
    unsigned char bytes[512];
    uint64_t align;
} sha_ctx;

static int sha256(const unsigned char *data, size_t n, unsigned char *out) {
    sha_ctx ctx;
    return p_init(&ctx) == 1 && p_update(&ctx, data, n) == 1 && p_final(out, &ctx) == 1;
}

/* Resolve libcrypto's SHA-256 from an already loaded (or loadable) libcrypto, then check it
 * against the FIPS 180-2 vector for "abc"; on any failure the module reports HAVE_SHA256 False. */
static int load_sha256(const char *path) {
    void *lib = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    if (lib == NULL)
        lib = dlopen(path, RTLD_NOW);
    if (lib == NULL)
        return 0;
    p_init = (sha256_init_fn)dlsym(lib, "SHA256_Init");
    p_update = (sha256_update_fn)dlsym(lib, "SHA256_Update");
    p_final = (sha256_final_fn)dlsym(lib, "SHA256_Final");
    if (!p_init || !p_update || !p_final) {
        p_init = NULL;
        return 0;
    }
    static const unsigned char abc[32] = {
        0xba, 0x78, 0x16, 0xbf, 0x8f, 0x01, 0xcf, 0xea, 0x41, 0x41, 0x40, 0xde, 0x5d, 0xae, 0x22, 0x23,
        0xb0, 0x03, 0x61, 0xa3, 0x96, 0x17, 0x7a, 0x9c, 0xb4, 0x10, 0xff, 0x61, 0xf2, 0x00, 0x15, 0xad};
    unsigned char out[32];
    if (!sha256((const unsigned char *)"abc", 3, out) || memcmp(out, abc, 32) != 0) {
        p_init = NULL;
        return 0;
    }
    return 1;
}

/* The shortest CBOR head of major type ``major`` with argument n; returns bytes written (<= 9). */
static inline size_t cbor_head(unsigned char *p, unsigned major, uint64_t n) {
    unsigned char m = (unsigned char)(major << 5);
    if (n < 24) {
        p[0] = m | (unsigned char)n;
        return 1;
    }
    if (n < 0x100) {
        p[0] = m | 24;
        p[1] = (unsigned char)n;
        return 2;
    }
    if (n < 0x10000) {
        p[0] = m | 25;
        p[1] = (unsigned char)(n >> 8);
        p[2] = (unsigned char)n;
        return 3;
    }
    if (n < 0x100000000ULL) {
        p[0] = m | 26;
        p[1] = (unsigned char)(n >> 24);
        p[2] = (unsigned char)(n >> 16);
        p[3] = (unsigned char)(n >> 8);
        p[4] = (unsigned char)n;
        return 5;
    }
    p[0] = m | 27;
    for (int k = 0; k < 8; k++)
        p[1 + k] = (unsigned char)(n >> (56 - 8 * k));
    return 9;
}

static inline uint64_t read_uint(const char *base, Py_ssize_t i, Py_ssize_t itemsize) {
    switch (itemsize) {
    case 1:
        return ((const uint8_t *)base)[i];
    case 2:
        return ((const uint16_t *)base)[i];
    case 4:
        return ((const uint32_t *)base)[i];
    default:
        return ((const uint64_t *)base)[i];
    }
}

/* An exact int of one machine digit (every token id): *out, and 1; else 0 and the caller converts
 * it. Read in place: a call to PyLong_AsUnsignedLongLong per token was a quarter of hashing an
 * 8k-token prompt. */
static inline int small_uint(PyObject *v, uint64_t *out) {
    if (!PyLong_CheckExact(v))
        return 0;
#if PY_VERSION_HEX >= 0x030C0000
    if (!PyUnstable_Long_IsCompact((PyLongObject *)v))
        return 0;
    Py_ssize_t x = PyUnstable_Long_CompactValue((PyLongObject *)v);
    if (x < 0)
        return 0;
    *out = (uint64_t)x;
    return 1;
#else
    Py_ssize_t size = Py_SIZE(v);
    if (size != 0 && size != 1)
        return 0;
    *out = size ? ((PyLongObject *)v)->ob_digit[0] : 0;
    return 1;
#endif
}

/* A list or tuple of ints as a fresh uint64 array of its first n items (PyMem_Free it), or NULL
 * with ValueError naming the first bad item: not an integer, negative, or 2**64 and above. */
static uint64_t *ids_from_sequence(PyObject *seq, Py_ssize_t n) {
    uint64_t *out = PyMem_Malloc(n > 0 ? n * sizeof(uint64_t) : 1);
    if (out == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = items[i];
        unsigned long long v;
        if (small_uint(item, &out[i]))
            continue;
        if (PyLong_Check(item)) {
            v = PyLong_AsUnsignedLongLong(item);
        } else {
            PyObject *index = PyNumber_Index(item); /* numpy integer scalars */
            if (index == NULL) {
                PyErr_Format(PyExc_ValueError, "token_ids[%zd]: expected integers, got %.80s", i,
                             Py_TYPE(item)->tp_name);
                PyMem_Free(out);
                return NULL;
            }
            v = PyLong_AsUnsignedLongLong(index);
            Py_DECREF(index);
        }
        if (v == (unsigned long long)-1 && PyErr_Occurred()) {
            PyErr_Format(PyExc_ValueError, "token_ids[%zd]: token ids must be integers in [0, 2**64)", i);
            PyMem_Free(out);
            return NULL;
        }
        out[i] = v;
    }
    return out;
}

PyDoc_STRVAR(chain_doc,
"chain(ids, block_size, head, parent, digest, tails=None, event_ints=False) -> list\n\n"
"Digests of the full blocks of ``ids``, chained from ``parent`` (or, with event_ints, each\n"
"digest's last 8 bytes as a big-endian unsigned int: the router's index keys).\n\n"
"ids: a list or tuple of ints, or a C-contiguous buffer of native unsigned ints (format B, H, I, L\n"
"or Q); a trailing partial block is ignored. block_size: tokens per block (>= 1). head: bytes\n"
"written before each parent.\n"
"parent: the digest preceding block 0. digest: None for libcrypto's SHA-256 (HAVE_SHA256 must be\n"
"True), else a callable bytes -> bytes returning digests of len(parent) bytes. tails: None (every\n"
"block ends with CBOR null) or one bytes per block, the CBOR of its extra keys.\n\n"
"Raises ValueError (a token id that is not an int in [0, 2**64), bad buffer format, block_size,\n"
"digest length, tails length), TypeError, and whatever the digest callable raises.");

static PyObject *chain(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"ids", "block_size", "head", "parent", "digest", "tails", "event_ints", NULL};
    PyObject *ids_obj;
    Py_buffer head, parent0;
    Py_ssize_t block_size;
    PyObject *digest, *tails = Py_None;
    int event_ints = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "Ony*y*O|Op", kwlist, &ids_obj, &block_size, &head, &parent0,
                                     &digest, &tails, &event_ints))
        return NULL;
    PyObject *out = NULL, *tails_fast = NULL, *seq = NULL;
    unsigned char *buf = NULL;
    uint64_t *owned = NULL; /* ids copied out of a list or tuple */
    Py_buffer typed = {0};
    int have_typed = 0;
    const char *base;
    Py_ssize_t itemsize, n_ids;

    if (block_size < 1) {
        PyErr_Format(PyExc_ValueError, "block_size: must be >= 1, got %zd", block_size);
        goto done;
    }
    if (digest == Py_None && p_init == NULL) {
        PyErr_SetString(PyExc_ValueError, "digest: None needs libcrypto's SHA-256 (HAVE_SHA256 is False)");
        goto done;
    }
    if (digest != Py_None && !PyCallable_Check(digest)) {
        PyErr_SetString(PyExc_TypeError, "digest: expected None or a callable");
        goto done;
    }
    if (PyList_CheckExact(ids_obj) || PyTuple_CheckExact(ids_obj)) {
        seq = PySequence_Fast(ids_obj, "ids");
        if (seq == NULL)
            goto done;
        n_ids = PySequence_Fast_GET_SIZE(seq);
        n_ids -= n_ids % block_size; /* only full blocks are read (and validated) */
        owned = ids_from_sequence(seq, n_ids);
        if (owned == NULL)
            goto done;
        base = (const char *)owned;
        itemsize = 8;
    } else {
        if (PyObject_GetBuffer(ids_obj, &typed, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
            goto done;
        have_typed = 1;
        const char *fmt = typed.format ? typed.format : "B";
        if (*fmt == '@' || *fmt == '=' || *fmt == '<')
            fmt++;
        if (strlen(fmt) != 1 || strchr("BHILQ", fmt[0]) == NULL ||
            !(typed.itemsize == 1 || typed.itemsize == 2 || typed.itemsize == 4 || typed.itemsize == 8)) {
            PyErr_Format(PyExc_ValueError, "ids: expected a buffer of unsigned ints (format B, H, I, L or Q), got %s",
                         typed.format ? typed.format : "B");
            goto done;
        }
        base = typed.buf;
        itemsize = typed.itemsize;
        n_ids = typed.len / itemsize;
    }
    Py_ssize_t num_blocks = n_ids / block_size;
    Py_ssize_t plen = parent0.len;
    if (event_ints && plen < 8) {
        PyErr_SetString(PyExc_ValueError, "parent: event_ints needs digests of at least 8 bytes");
        goto done;
    }
    if (tails != Py_None) {
        tails_fast = PySequence_Fast(tails, "tails: expected a sequence of bytes");
        if (tails_fast == NULL)
            goto done;
        if (PySequence_Fast_GET_SIZE(tails_fast) != num_blocks) {
            PyErr_Format(PyExc_ValueError, "tails: expected %zd items (one per full block), got %zd", num_blocks,
                         PySequence_Fast_GET_SIZE(tails_fast));
            goto done;
        }
    }
    Py_ssize_t max_tail = 1;
    for (Py_ssize_t i = 0; tails_fast && i < num_blocks; i++) {
        PyObject *t = PySequence_Fast_GET_ITEM(tails_fast, i);
        if (!PyBytes_Check(t)) {
            PyErr_Format(PyExc_TypeError, "tails[%zd]: expected bytes", i);
            goto done;
        }
        if (PyBytes_GET_SIZE(t) > max_tail)
            max_tail = PyBytes_GET_SIZE(t);
    }
    buf = PyMem_Malloc(head.len + plen + 9 + 9 * block_size + max_tail);
    out = PyList_New(num_blocks);
    if (buf == NULL || out == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    memcpy(buf, head.buf, head.len);
    unsigned char *parent_at = buf + head.len;
    memcpy(parent_at, parent0.buf, plen);
    unsigned char *body = parent_at + plen;
    size_t arr = cbor_head(body, 4, (uint64_t)block_size);
    for (Py_ssize_t b = 0; b < num_blocks; b++) {
        unsigned char *p = body + arr;
        for (Py_ssize_t k = 0; k < block_size; k++)
            p += cbor_head(p, 0, read_uint(base, b * block_size + k, itemsize));
        if (tails_fast) {
            PyObject *t = PySequence_Fast_GET_ITEM(tails_fast, b);
            memcpy(p, PyBytes_AS_STRING(t), PyBytes_GET_SIZE(t));
            p += PyBytes_GET_SIZE(t);
        } else {
            *p++ = 0xf6;
        }
        if (digest == Py_None) {
            /* The digest lands straight in the next block's parent slot. */
            if (plen != 32 || !sha256(buf, (size_t)(p - buf), parent_at)) {
                PyErr_SetString(PyExc_ValueError, "parent: libcrypto SHA-256 failed or parent is not 32 bytes");
                goto fail;
            }
        } else {
            PyObject *input = PyBytes_FromStringAndSize((const char *)buf, p - buf);
            if (input == NULL)
                goto fail;
            PyObject *d = PyObject_CallOneArg(digest, input);
            Py_DECREF(input);
            if (d == NULL)
                goto fail;
            if (!PyBytes_Check(d) || PyBytes_GET_SIZE(d) != plen) {
                Py_DECREF(d);
                PyErr_Format(PyExc_ValueError, "digest: must return bytes of len(parent) = %zd", plen);
                goto fail;
            }
            memcpy(parent_at, PyBytes_AS_STRING(d), plen);
            Py_DECREF(d);
        }
        PyObject *item;
        if (event_ints) {
            uint64_t v = 0;
            for (int k = 0; k < 8; k++)
                v = (v << 8) | parent_at[plen - 8 + k];
            item = PyLong_FromUnsignedLongLong(v);
        } else {
            item = PyBytes_FromStringAndSize((const char *)parent_at, plen);
        }
        if (item == NULL)
            goto fail;
        PyList_SET_ITEM(out, b, item);
    }
    goto done;
fail:
    Py_CLEAR(out);
done:
    PyMem_Free(buf);
    PyMem_Free(owned);
    Py_XDECREF(seq);
    Py_XDECREF(tails_fast);
    if (have_typed)
        PyBuffer_Release(&typed);
    PyBuffer_Release(&head);
    PyBuffer_Release(&parent0);
    return out;
}

PyDoc_STRVAR(load_doc,
"load_sha256(path) -> bool\n\n"
"Use SHA256_Init/Update/Final from the libcrypto at ``path`` (a soname or a file path), checked\n"
"against the FIPS 180-2 vector for 'abc'. Returns True when they are usable; sets HAVE_SHA256.");

static PyObject *py_load_sha256(PyObject *module, PyObject *arg) {
    const char *path = PyUnicode_AsUTF8(arg);
    if (path == NULL)
        return NULL;
    int ok = p_init != NULL || load_sha256(path);
    if (PyModule_AddObjectRef(module, "HAVE_SHA256", ok ? Py_True : Py_False) < 0)
        return NULL;
    return PyBool_FromLong(ok);
}

static PyMethodDef methods[] = {
    {"chain", (PyCFunction)(void (*)(void))chain, METH_VARARGS | METH_KEYWORDS, chain_doc},
    {"load_sha256", py_load_sha256, METH_O, load_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "kvroute._hashchain",
    "Compiled CBOR block-hash chain (see kvroute/hashing.py and DESIGN.md §2).", -1, methods,
};

PyMODINIT_FUNC PyInit__hashchain(void) {
    PyObject *m = PyModule_Create(&module_def);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "HAVE_SHA256", Py_False) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
