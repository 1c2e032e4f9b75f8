/* Paged decode attention on the CPU, reading K/V blocks in place through the block table.
 *
 * For each decode d (one query token of request r = reqs[d], at query row rows[d]) and each query
 * head h of KV head g = h / (H / Hkv) (grouped-query attention, Ainslie et al. 2023):
 *
 *     s_t = scale * <q[row, h], K[block_table[r, t / B], t % B, g]>      t = 0 .. seq_lens[r] - 1
 *     out[row, h] = sum_t softmax(s)_t * V[block_table[r, t / B], t % B, g]
 *
 * with kv_cache laid out (2, num_blocks, B, Hkv, D) as in DESIGN.md §3.2 (float32, contiguous).
 * The softmax is the two-pass one: max, then exp and sum. Positions are walked in order, each
 * position's K (then V) row of every KV head read once, contiguously, for all query heads. This is what vLLM's CPU backend and flash-attn's paged
 * kernels do instead of gathering the blocks into a dense copy first (the torch backend's path,
 * which copies every K/V byte once more per layer).
 *
 * Every index is checked against the buffers' sizes (ValueError, nothing written) before any work.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <ctype.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__GNUC__)
#define ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define ALWAYS_INLINE inline
#endif

#if defined(__GNUC__)
/* Eight floats as one value: AVX on x86-64-v3, two SSE registers on the baseline. */
typedef float v8f __attribute__((vector_size(32)));

/* <a, b> over n floats, eight lanes at a time (unaligned loads through memcpy). */
static ALWAYS_INLINE float dot(const float *restrict a, const float *restrict b, Py_ssize_t n) {
    v8f acc = {0, 0, 0, 0, 0, 0, 0, 0};
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        v8f x, y;
        memcpy(&x, a + i, sizeof x);
        memcpy(&y, b + i, sizeof y);
        acc += x * y;
    }
    float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; i < n; i++)
        s += a[i] * b[i];
    return s;
}
#else
static ALWAYS_INLINE float dot(const float *restrict a, const float *restrict b, Py_ssize_t n) {
    float s = 0;
    for (Py_ssize_t i = 0; i < n; i++)
        s += a[i] * b[i];
    return s;
}
#endif

#define ATTEND_ARGS                                                                                                  \
    float *O, const float *Q, const float *K, const float *V, const int32_t *tab, const int32_t *sl,              \
        const int64_t *rw, const int64_t *rq, Py_ssize_t n, Py_ssize_t H, Py_ssize_t Hkv, Py_ssize_t B,          \
        Py_ssize_t max_blocks, Py_ssize_t max_len, float fscale, float *scratch
#define ATTEND_PASS O, Q, K, V, tab, sl, rw, rq, n, H, Hkv, B, max_blocks, max_len, fscale, scratch

/* The attention itself (arguments checked by paged_decode), inlined into ``attend`` once per
 * common head_dim so that the inner loops have a constant trip count the compiler unrolls. */
static ALWAYS_INLINE void attend_body(ATTEND_ARGS, const Py_ssize_t D) {
    const Py_ssize_t group = H / Hkv, row_floats = H * D;
    const Py_ssize_t pos_floats = Hkv * D; /* one position's K (or V) row: every KV head, contiguous */
    for (Py_ssize_t d = 0; d < n; d++) {
        const Py_ssize_t L = sl[rq[d]];
        const int32_t *row = tab + rq[d] * max_blocks;
        const float *qd = Q + rw[d] * row_floats;
        float *restrict s = scratch, *restrict acc = scratch + H * max_len;
        /* Pass 1, positions in order (each K row read once, sequentially within a block):
         * s[t][h] = scale * <q_h, k_t[h / group]>. */
        for (Py_ssize_t t = 0; t < L; t++) {
            const Py_ssize_t blk = row[t / B];
            const float *k = K + (blk * B + (t - (t / B) * B)) * pos_floats;
            float *st = s + t * H;
            for (Py_ssize_t g = 0, h = 0; g < Hkv; g++, k += D)
                for (Py_ssize_t j = 0; j < group; j++, h++)
                    st[h] = fscale * dot(qd + h * D, k, D);
        }
        /* Softmax per head (two-pass: max, then exp and sum, then scaled by 1 / sum). */
        for (Py_ssize_t h = 0; h < H; h++) {
            float m = s[h], sum = 0;
            for (Py_ssize_t t = 1; t < L; t++)
                m = s[t * H + h] > m ? s[t * H + h] : m;
            for (Py_ssize_t t = 0; t < L; t++) {
                const float e = expf(s[t * H + h] - m);
                s[t * H + h] = e;
                sum += e;
            }
            const float r = 1.0f / sum;
            for (Py_ssize_t t = 0; t < L; t++)
                s[t * H + h] *= r;
        }
        /* Pass 2, positions in order: acc[h] += p[h][t] * v_t[h / group]. */
        memset(acc, 0, (size_t)(H * D) * sizeof(float));
        for (Py_ssize_t t = 0; t < L; t++) {
            const Py_ssize_t blk = row[t / B];
            const float *restrict vh = V + (blk * B + (t - (t / B) * B)) * pos_floats;
            const float *p = s + t * H;
            float *restrict a = acc;
            for (Py_ssize_t g = 0; g < Hkv; g++, vh += D)
                for (Py_ssize_t j = 0; j < group; j++, p++, a += D)
                    for (Py_ssize_t e = 0; e < D; e++)
                        a[e] += *p * vh[e];
        }
        memcpy(O + rw[d] * row_floats, acc, (size_t)(H * D) * sizeof(float));
    }
}

/* Compiled twice on x86-64 with GCC: for x86-64-v3 (AVX2 + FMA, chosen at load time when the CPU
 * has it) and for the baseline. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
__attribute__((target_clones("arch=x86-64-v3", "default")))
#endif
static void attend(ATTEND_ARGS, Py_ssize_t D) {
    switch (D) {
    case 32:
        attend_body(ATTEND_PASS, 32);
        break;
    case 64:
        attend_body(ATTEND_PASS, 64);
        break;
    case 128:
        attend_body(ATTEND_PASS, 128);
        break;
    default:
        attend_body(ATTEND_PASS, D);
    }
}

static int get_buffer(PyObject *obj, Py_buffer *view, const char *name, char kind, Py_ssize_t itemsize, int writable) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0)
        return -1;
    const char *fmt = view->format ? view->format : "B";
    if (*fmt == '@' || *fmt == '=' || *fmt == '<')
        fmt++;
    int ok = view->itemsize == itemsize &&
             (kind == 'f' ? fmt[0] == 'f' : (strchr("iIlLqQ", fmt[0]) != NULL && islower(fmt[0]) != 0)) &&
             fmt[1] == '\0';
    if (!ok) {
        PyErr_Format(PyExc_ValueError, "%s: expected a C-contiguous %s array of %zd-byte items, got format %s",
                     name, kind == 'f' ? "float" : "signed int", itemsize, view->format ? view->format : "B");
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(decode_doc,
"paged_decode(out, query, kv_cache, block_table, seq_lens, rows, reqs, num_heads, num_kv_heads,\n"
"             head_dim, block_size, scale) -> None\n\n"
"Decode attention over paged K/V, written into ``out`` rows ``rows``.\n\n"
"out, query: float32 [T, num_heads, head_dim]; kv_cache: float32 (2, num_blocks, block_size,\n"
"num_kv_heads, head_dim); block_table: int32 [R, max_blocks]; seq_lens: int32 [R]; rows, reqs:\n"
"int64 [n], the query row and the request of each decode. All C-contiguous, on the CPU (numpy\n"
"views of torch tensors). num_heads must be a multiple of num_kv_heads.\n\n"
"Raises ValueError naming the argument when a shape, format, row, request, sequence length or\n"
"block id is out of range (checked before anything is written).");

static PyObject *paged_decode(PyObject *self, PyObject *args) {
    PyObject *o_out, *o_q, *o_kv, *o_table, *o_lens, *o_rows, *o_reqs;
    Py_ssize_t H, Hkv, D, B;
    double scale;
    if (!PyArg_ParseTuple(args, "OOOOOOOnnnnd", &o_out, &o_q, &o_kv, &o_table, &o_lens, &o_rows, &o_reqs, &H, &Hkv,
                          &D, &B, &scale))
        return NULL;
    Py_buffer out = {0}, q = {0}, kv = {0}, table = {0}, lens = {0}, rows = {0}, reqs = {0};
    PyObject *result = NULL;
    float *scratch = NULL;
    if (get_buffer(o_out, &out, "out", 'f', 4, 1) < 0 || get_buffer(o_q, &q, "query", 'f', 4, 0) < 0 ||
        get_buffer(o_kv, &kv, "kv_cache", 'f', 4, 0) < 0 || get_buffer(o_table, &table, "block_table", 'i', 4, 0) < 0 ||
        get_buffer(o_lens, &lens, "seq_lens", 'i', 4, 0) < 0 || get_buffer(o_rows, &rows, "rows", 'i', 8, 0) < 0 ||
        get_buffer(o_reqs, &reqs, "reqs", 'i', 8, 0) < 0)
        goto done;
    if (H < 1 || Hkv < 1 || D < 1 || B < 1 || H % Hkv != 0) {
        PyErr_Format(PyExc_ValueError, "num_heads %zd, num_kv_heads %zd, head_dim %zd, block_size %zd: need all >= 1 "
                     "and num_heads a multiple of num_kv_heads", H, Hkv, D, B);
        goto done;
    }
    Py_ssize_t row_floats = H * D;
    Py_ssize_t T = q.len / 4 / row_floats;
    if (q.len / 4 != T * row_floats || out.len != q.len) {
        PyErr_SetString(PyExc_ValueError, "query, out: expected the same [T, num_heads, head_dim] shape");
        goto done;
    }
    Py_ssize_t block_floats = B * Hkv * D;
    Py_ssize_t num_blocks = kv.len / 4 / (2 * block_floats);
    if (kv.len / 4 != 2 * num_blocks * block_floats) {
        PyErr_SetString(PyExc_ValueError, "kv_cache: expected (2, num_blocks, block_size, num_kv_heads, head_dim)");
        goto done;
    }
    Py_ssize_t R = lens.len / 4;
    Py_ssize_t max_blocks = R ? table.len / 4 / R : 0;
    if (R == 0 || table.len / 4 != R * max_blocks) {
        PyErr_SetString(PyExc_ValueError, "block_table: expected [len(seq_lens), max_blocks]");
        goto done;
    }
    Py_ssize_t n = rows.len / 8;
    if (reqs.len / 8 != n) {
        PyErr_SetString(PyExc_ValueError, "rows, reqs: expected the same length");
        goto done;
    }
    const int32_t *tab = table.buf, *sl = lens.buf;
    const int64_t *rw = rows.buf, *rq = reqs.buf;
    Py_ssize_t max_len = 0;
    for (Py_ssize_t d = 0; d < n; d++) {
        if (rw[d] < 0 || rw[d] >= T) {
            PyErr_Format(PyExc_ValueError, "rows[%zd] = %lld: outside [0, %zd)", d, (long long)rw[d], T);
            goto done;
        }
        if (rq[d] < 0 || rq[d] >= R) {
            PyErr_Format(PyExc_ValueError, "reqs[%zd] = %lld: outside [0, %zd)", d, (long long)rq[d], R);
            goto done;
        }
        Py_ssize_t L = sl[rq[d]];
        if (L < 1 || L > max_blocks * B) {
            PyErr_Format(PyExc_ValueError, "seq_lens[%lld] = %zd: outside [1, %zd]", (long long)rq[d], L, max_blocks * B);
            goto done;
        }
        const int32_t *row = tab + rq[d] * max_blocks;
        for (Py_ssize_t b = 0; b < (L + B - 1) / B; b++)
            if (row[b] < 0 || row[b] >= num_blocks) {
                PyErr_Format(PyExc_ValueError, "block_table[%lld, %zd] = %d: outside [0, %zd)", (long long)rq[d], b,
                             row[b], num_blocks);
                goto done;
            }
        if (L > max_len)
            max_len = L;
    }
    /* scores [max_len][H], then the output accumulator [H][D] */
    scratch = PyMem_Malloc((size_t)(H * max_len + H * D + 1) * sizeof(float));
    if (scratch == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    attend(out.buf, q.buf, kv.buf, (const float *)kv.buf + num_blocks * block_floats, tab, sl, rw, rq, n, H, Hkv, B,
           max_blocks, max_len, (float)scale, scratch, D);
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    PyMem_Free(scratch);
    Py_buffer *views[] = {&out, &q, &kv, &table, &lens, &rows, &reqs};
    for (int i = 0; i < 7; i++)
        if (views[i]->obj != NULL)
            PyBuffer_Release(views[i]);
    return result;
}

static PyMethodDef methods[] = {
    {"paged_decode", paged_decode, METH_VARARGS, decode_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "replica.attention._cpu_paged",
    "Paged decode attention on the CPU over the block table, K/V read in place (see torch_backend.py).", -1,
    methods,
};

PyMODINIT_FUNC PyInit__cpu_paged(void) { return PyModule_Create(&module_def); }
