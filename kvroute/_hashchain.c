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

PyDoc_STRVAR(chain_doc,
"chain(ids, block_size, head, parent, digest, tails=None) -> list[bytes]\n\n"
"Digests of the full blocks of ``ids``, chained from ``parent``.\n\n"
"ids: a C-contiguous buffer of native unsigned ints (format B, H, I, L or Q); a trailing partial\n"
"block is ignored. block_size: tokens per block (>= 1). head: bytes written before each parent.\n"
"parent: the digest preceding block 0. digest: None for libcrypto's SHA-256 (HAVE_SHA256 must be\n"
"True), else a callable bytes -> bytes returning digests of len(parent) bytes. tails: None (every\n"
"block ends with CBOR null) or one bytes per block, the CBOR of its extra keys.\n\n"
"Raises ValueError (bad buffer format, block_size, digest length, tails length), TypeError, and\n"
"whatever the digest callable raises.");

static PyObject *chain(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"ids", "block_size", "head", "parent", "digest", "tails", NULL};
    Py_buffer ids, head, parent0;
    Py_ssize_t block_size;
    PyObject *digest, *tails = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*ny*y*O|O", kwlist, &ids, &block_size, &head,
                                     &parent0, &digest, &tails))
        return NULL;
    PyObject *out = NULL, *tails_fast = NULL;
    unsigned char *buf = NULL;
    Py_buffer typed = {0};
    int have_typed = 0;

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
    /* Re-request the ids buffer with its format to learn the item type ("y*" gives bytes only). */
    if (PyObject_GetBuffer(ids.obj, &typed, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
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
    Py_ssize_t n_ids = typed.len / typed.itemsize;
    Py_ssize_t num_blocks = n_ids / block_size;
    Py_ssize_t plen = parent0.len;
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
        goto done;
    }
    memcpy(buf, head.buf, head.len);
    unsigned char *parent_at = buf + head.len;
    memcpy(parent_at, parent0.buf, plen);
    unsigned char *body = parent_at + plen;
    size_t arr = cbor_head(body, 4, (uint64_t)block_size);
    const char *base = typed.buf;
    for (Py_ssize_t b = 0; b < num_blocks; b++) {
        unsigned char *p = body + arr;
        for (Py_ssize_t k = 0; k < block_size; k++)
            p += cbor_head(p, 0, read_uint(base, b * block_size + k, typed.itemsize));
        if (tails_fast) {
            PyObject *t = PySequence_Fast_GET_ITEM(tails_fast, b);
            memcpy(p, PyBytes_AS_STRING(t), PyBytes_GET_SIZE(t));
            p += PyBytes_GET_SIZE(t);
        } else {
            *p++ = 0xf6;
        }
        PyObject *d;
        if (digest == Py_None) {
            d = PyBytes_FromStringAndSize(NULL, 32);
            if (d == NULL)
                goto fail;
            if (plen != 32 || !sha256(buf, (size_t)(p - buf), (unsigned char *)PyBytes_AS_STRING(d))) {
                Py_DECREF(d);
                PyErr_SetString(PyExc_ValueError, "parent: libcrypto SHA-256 failed or parent is not 32 bytes");
                goto fail;
            }
        } else {
            PyObject *input = PyBytes_FromStringAndSize((const char *)buf, p - buf);
            if (input == NULL)
                goto fail;
            d = PyObject_CallOneArg(digest, input);
            Py_DECREF(input);
            if (d == NULL)
                goto fail;
            if (!PyBytes_Check(d) || PyBytes_GET_SIZE(d) != plen) {
                Py_DECREF(d);
                PyErr_Format(PyExc_ValueError, "digest: must return bytes of len(parent) = %zd", plen);
                goto fail;
            }
        }
        memcpy(parent_at, PyBytes_AS_STRING(d), plen);
        PyList_SET_ITEM(out, b, d);
    }
    goto done;
fail:
    Py_CLEAR(out);
done:
    PyMem_Free(buf);
    Py_XDECREF(tails_fast);
    if (have_typed)
        PyBuffer_Release(&typed);
    PyBuffer_Release(&ids);
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
