/* The router index's storage and its lookup walk (router/index.py, BlockIndex), in C.
 *
 * One Table per medium holds every replica's cached blocks of that medium:
 *
 *     slots     block hash (u64) -> the set of replica ids holding >= 1 copy   (open addressing)
 *     extras    (block hash, replica id) -> copies beyond the first            (open addressing)
 *     replicas  replica id -> the hashes it was given, for clearing it         (a vector each)
 *
 * A slot is 16 bytes: the hash, and its replica set in one word, either inline (up to three ids of
 * 20 bits, the common case: most blocks are cached on one replica) or a pointer to a sorted id
 * array (a prefix shared by many replicas). Copy counts live apart because almost every count is
 * one: the extras table holds only the duplicates (the same hash cached in two blocks of one
 * replica), so a BlockRemoved of one copy leaves the other. Tables use linear probing with
 * backward-shift deletion (no tombstones, so a table that churns does not slow down) and grow at
 * 3/4 full.
 *
 * A replica's vector lists the hashes it was given, for clear(): without it, clearing one replica
 * (a new epoch, AllBlocksCleared, a replica gone) would scan every slot of the table. Removals
 * leave their hash in the vector (finding it would cost a search); when stale hashes outnumber
 * live ones the vector is rebuilt from the live ones.
 *
 * walk() is the lookup: for a request's hash chain, how far each replica's run of consecutive
 * held blocks reaches from block 0 on the GPU (with the speculative entries, a dict
 * {hash: bitmask of replica ids} from router/speculative.py), how much of it is speculative, and
 * how far its CPU-tier run reaches after that. One pass per tier, run sets as bitsets over replica
 * ids, stopping when no replica is left. The pure-Python storage and walk in router/index.py give
 * the same answers (tests compare them).
 *
 * Memory is counted by the tables themselves (nbytes): every allocation at the size glibc's
 * malloc gives it (the request plus its 8-byte header, rounded up to 16, at least 32), since
 * tracemalloc does not see C allocations.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#define RID_BITS 20
#define RID_MAX ((1u << RID_BITS) - 1)
#define INLINE_MAX 3
#define MIN_CAP 64

/* For each set bit of word (bit b: r = base + b). */
#define FOR_BITS(word, base, r) for (uint64_t _d = (word); _d && ((r) = (uint32_t)((base) + __builtin_ctzll(_d)), 1); _d &= _d - 1)

/* What an allocation of n bytes takes from glibc's malloc. */
static size_t chunk(size_t n) {
    size_t c = (n + 8 + 15) & ~(size_t)15;
    return c < 32 ? 32 : c;
}

static inline uint64_t mix64(uint64_t x) { /* MurmurHash3's finalizer: tests use small hashes */
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    x ^= x >> 33;
    return x;
}

/* An int in [0, 2**64) as a u64: 0, or -1 with OverflowError / TypeError set. On CPython 3.11
 * an exact int's 30-bit digits are read in place: PyLong_AsUnsignedLongLong goes through
 * _PyLong_AsByteArray for anything past one digit, which was a sizeable share of a walk. */
static inline int as_u64(PyObject *v, uint64_t *out) {
#if PY_VERSION_HEX < 0x030C0000 && PYLONG_BITS_IN_DIGIT == 30
    if (PyLong_CheckExact(v)) {
        const digit *d = ((PyLongObject *)v)->ob_digit;
        switch (Py_SIZE(v)) {
        case 0:
            *out = 0;
            return 0;
        case 1:
            *out = d[0];
            return 0;
        case 2:
            *out = (uint64_t)d[0] | (uint64_t)d[1] << 30;
            return 0;
        case 3:
            if (d[2] < 16) {
                *out = (uint64_t)d[0] | (uint64_t)d[1] << 30 | (uint64_t)d[2] << 60;
                return 0;
            }
        }
    }
#endif
    uint64_t x = PyLong_AsUnsignedLongLong(v);
    if (x == (uint64_t)-1 && PyErr_Occurred())
        return -1;
    *out = x;
    return 0;
}

/* as_u64, with a value that is no u64 taken as one no table holds: 1 for a u64, 0 for that
 * (its error cleared), -1 for another error. */
static inline int as_block_hash(PyObject *v, uint64_t *out) {
    if (as_u64(v, out) == 0)
        return 1;
    if (!PyErr_ExceptionMatches(PyExc_OverflowError) && !PyErr_ExceptionMatches(PyExc_TypeError))
        return -1;
    PyErr_Clear();
    return 0;
}

/* -- replica sets --------------------------------------------------------------------------------
 * A set word: 0 = no replica (an empty slot); low bit 1 = inline, bits 1-2 the count (1-3), ids
 * at bits 4, 24, 44; low bit 0 = a wide_t pointer (malloc aligns to 16): a sorted id array, or,
 * once the ids are dense enough that a bitset over them is no larger (a prefix cached on many
 * replicas), a bitset, which a walk intersects a word at a time instead of an id at a time. */
#define BITSET 0x80000000u /* in wide_t.cap: the data is a bitset of (cap & ~BITSET) words */

typedef struct {
    uint32_t n, cap;
    uint32_t rid[]; /* ascending; or, with BITSET, the bitset's words (8-aligned: the header is 8) */
} wide_t;

static inline int is_inline(uint64_t s) { return (int)(s & 1); }
static inline unsigned inline_n(uint64_t s) { return (unsigned)((s >> 1) & 3); }
static inline uint32_t inline_rid(uint64_t s, unsigned k) { return (uint32_t)(s >> (4 + RID_BITS * k)) & RID_MAX; }
static inline int is_bits(const wide_t *w) { return (w->cap & BITSET) != 0; }
static inline uint32_t nwords(const wide_t *w) { return w->cap & ~BITSET; }
static inline uint64_t *words_of(wide_t *w) { return (uint64_t *)(void *)w->rid; }
static inline size_t wide_size(const wide_t *w) {
    return sizeof(wide_t) + (is_bits(w) ? (size_t)nwords(w) * 8 : (size_t)w->cap * 4);
}

/* The bitset of set word s, NULL when s is inline or an array (*nw: its words). */
static inline const uint64_t *set_bits(uint64_t s, uint32_t *nw) {
    if (is_inline(s))
        return NULL;
    wide_t *w = (wide_t *)(uintptr_t)s;
    if (!is_bits(w))
        return NULL;
    *nw = nwords(w);
    return words_of(w);
}

static uint64_t make_inline(const uint32_t *rids, unsigned n) {
    uint64_t s = 1 | ((uint64_t)n << 1);
    for (unsigned k = 0; k < n; k++)
        s |= (uint64_t)rids[k] << (4 + RID_BITS * k);
    return s;
}

/* The members of set word s (inline or an array, not a bitset): into buf (inline) or a pointer
 * to the array; returns the count. */
static inline uint32_t members(uint64_t s, uint32_t *buf, const uint32_t **out) {
    if (is_inline(s)) {
        unsigned n = inline_n(s);
        for (unsigned k = 0; k < n; k++)
            buf[k] = inline_rid(s, k);
        *out = buf;
        return n;
    }
    wide_t *w = (wide_t *)(uintptr_t)s;
    *out = w->rid;
    return w->n;
}

/* Position of rid in the ascending array a[0..n), or where it would go (*found says which). */
static inline uint32_t search(const uint32_t *a, uint32_t n, uint32_t rid, int *found) {
    uint32_t lo = 0, hi = n;
    while (lo < hi) {
        uint32_t mid = (lo + hi) / 2;
        if (a[mid] < rid)
            lo = mid + 1;
        else
            hi = mid;
    }
    *found = lo < n && a[lo] == rid;
    return lo;
}

static int set_has(uint64_t s, uint32_t rid) {
    if (is_inline(s)) {
        for (unsigned k = 0, n = inline_n(s); k < n; k++)
            if (inline_rid(s, k) == rid)
                return 1;
        return 0;
    }
    wide_t *w = (wide_t *)(uintptr_t)s;
    if (is_bits(w))
        return rid / 64 < nwords(w) && (words_of(w)[rid / 64] >> (rid % 64) & 1);
    int found;
    search(w->rid, w->n, rid, &found);
    return found;
}

typedef struct {
    uint64_t hash, set;
} slot_t;

typedef struct {
    uint64_t hash;
    uint32_t rid, extra; /* extra == 0: an empty slot */
} extra_t;

typedef struct {
    uint64_t *h; /* the hashes given to the replica, some stale (see the top) */
    uint32_t len, cap;
    uint64_t live; /* distinct hashes it holds */
} rep_t;

typedef struct {
    PyObject_HEAD
    slot_t *slots;
    size_t cap, used;
    extra_t *extras;
    size_t xcap, xused;
    rep_t *reps;
    uint32_t nreps;
    uint64_t entries; /* (replica, hash) pairs */
    size_t wide_bytes;
} Table;

static wide_t *wide_alloc(Table *t, uint32_t n, uint32_t cap) {
    wide_t *w = malloc(sizeof(wide_t) + ((cap & BITSET) ? (size_t)(cap & ~BITSET) * 8 : (size_t)cap * 4));
    if (w == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    w->n = n;
    w->cap = cap;
    t->wide_bytes += chunk(wide_size(w));
    return w;
}

static void wide_free(Table *t, wide_t *w) {
    t->wide_bytes -= chunk(wide_size(w));
    free(w);
}

/* The ids of rids[0..n) (ascending, the largest max) as a bitset, when one is no larger than
 * the array would be; else NULL (no exception). -1 in *err with MemoryError. */
static wide_t *to_bits(Table *t, const uint32_t *rids, uint32_t n, uint32_t max, int *err) {
    uint32_t nw = max / 64 + 1;
    *err = 0;
    if ((size_t)n < 2 * (size_t)nw || n <= INLINE_MAX)
        return NULL;
    wide_t *b = wide_alloc(t, n, BITSET | nw);
    if (b == NULL) {
        *err = -1;
        return NULL;
    }
    uint64_t *bits = words_of(b);
    memset(bits, 0, (size_t)nw * 8);
    for (uint32_t k = 0; k < n; k++)
        bits[rids[k] / 64] |= (uint64_t)1 << (rids[k] % 64);
    return b;
}

/* A bitset's ids as a sorted array of capacity cap (>= its count); NULL with MemoryError. */
static wide_t *to_array(Table *t, wide_t *b, uint32_t cap) {
    wide_t *a = wide_alloc(t, b->n, cap);
    if (a == NULL)
        return NULL;
    uint32_t m = 0;
    const uint64_t *bits = words_of(b);
    for (uint32_t w = 0; w < nwords(b); w++)
        for (uint64_t d = bits[w]; d; d &= d - 1)
            a->rid[m++] = w * 64 + (uint32_t)__builtin_ctzll(d);
    return a;
}

/* Adds rid to set word *s (not in it yet); -1 with MemoryError. */
static int set_add(Table *t, uint64_t *s, uint32_t rid) {
    if (is_inline(*s)) {
        uint32_t buf[INLINE_MAX + 1];
        unsigned n = inline_n(*s);
        for (unsigned k = 0; k < n; k++)
            buf[k] = inline_rid(*s, k);
        if (n < INLINE_MAX) {
            buf[n] = rid;
            *s = make_inline(buf, n + 1);
            return 0;
        }
        wide_t *w = wide_alloc(t, n + 1, 8);
        if (w == NULL)
            return -1;
        buf[n++] = rid;
        for (unsigned a = 1; a < n; a++) /* insertion sort of four */
            for (unsigned b = a; b > 0 && buf[b - 1] > buf[b]; b--) {
                uint32_t x = buf[b];
                buf[b] = buf[b - 1];
                buf[b - 1] = x;
            }
        memcpy(w->rid, buf, n * sizeof(uint32_t));
        *s = (uint64_t)(uintptr_t)w;
        return 0;
    }
    wide_t *w = (wide_t *)(uintptr_t)*s;
    if (is_bits(w)) {
        if (rid / 64 >= nwords(w)) { /* past its words: grow it, or back to an array if that is smaller */
            uint32_t nw = rid / 64 + 1;
            wide_t *g;
            if ((size_t)(w->n + 1) < 2 * (size_t)nw) {
                uint32_t cap = 8;
                while (cap < w->n + 1)
                    cap *= 2;
                if ((g = to_array(t, w, cap)) == NULL)
                    return -1;
                g->rid[g->n++] = rid; /* the largest id */
            } else {
                if ((g = wide_alloc(t, w->n + 1, BITSET | nw)) == NULL)
                    return -1;
                memset(words_of(g), 0, (size_t)nw * 8);
                memcpy(words_of(g), words_of(w), (size_t)nwords(w) * 8);
                words_of(g)[rid / 64] |= (uint64_t)1 << (rid % 64);
            }
            wide_free(t, w);
            *s = (uint64_t)(uintptr_t)g;
            return 0;
        }
        words_of(w)[rid / 64] |= (uint64_t)1 << (rid % 64);
        w->n++;
        return 0;
    }
    int found, err;
    uint32_t at = search(w->rid, w->n, rid, &found);
    if (w->n == w->cap) {
        uint32_t cap = w->cap * 2;
        size_t before = chunk(wide_size(w));
        wide_t *g = realloc(w, sizeof(wide_t) + cap * sizeof(uint32_t));
        if (g == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        g->cap = cap;
        t->wide_bytes += chunk(wide_size(g)) - before;
        w = g;
        *s = (uint64_t)(uintptr_t)w;
    }
    memmove(w->rid + at + 1, w->rid + at, (w->n - at) * sizeof(uint32_t));
    w->rid[at] = rid;
    w->n++;
    wide_t *b = to_bits(t, w->rid, w->n, w->rid[w->n - 1], &err);
    if (err < 0)
        return -1;
    if (b != NULL) {
        wide_free(t, w);
        *s = (uint64_t)(uintptr_t)b;
    }
    return 0;
}

/* Removes rid from set word *s (which holds it); *s becomes 0 with its last member. Out of
 * memory to turn a sparse bitset back into an array, it stays a bitset. */
static void set_del(Table *t, uint64_t *s, uint32_t rid) {
    if (is_inline(*s)) {
        uint32_t buf[INLINE_MAX];
        unsigned n = inline_n(*s), m = 0;
        for (unsigned k = 0; k < n; k++)
            if (inline_rid(*s, k) != rid)
                buf[m++] = inline_rid(*s, k);
        *s = m ? make_inline(buf, m) : 0;
        return;
    }
    wide_t *w = (wide_t *)(uintptr_t)*s;
    if (is_bits(w)) {
        words_of(w)[rid / 64] &= ~((uint64_t)1 << (rid % 64));
        w->n--;
        if (w->n >= nwords(w) && w->n > INLINE_MAX)
            return;
        uint32_t cap = 8; /* sparse now (half the array's size or less): back to an array */
        while (cap < w->n)
            cap *= 2;
        wide_t *a = to_array(t, w, cap);
        if (a == NULL) {
            PyErr_Clear();
            return;
        }
        wide_free(t, w);
        w = a;
        *s = (uint64_t)(uintptr_t)w;
    } else {
        int found;
        uint32_t at = search(w->rid, w->n, rid, &found);
        memmove(w->rid + at, w->rid + at + 1, (w->n - at - 1) * sizeof(uint32_t));
        w->n--;
    }
    if (w->n <= INLINE_MAX) { /* back inline */
        *s = make_inline(w->rid, w->n);
        wide_free(t, w);
    }
}

static void set_free(Table *t, uint64_t s) {
    if (s && !is_inline(s))
        wide_free(t, (wide_t *)(uintptr_t)s);
}

/* -- the slots: block hash -> replica set --------------------------------------------------------- */
#define NONE ((size_t)-1)

static inline size_t slot_find(const Table *t, uint64_t h) {
    if (t->cap == 0)
        return NONE;
    size_t mask = t->cap - 1, i = mix64(h) & mask;
    while (t->slots[i].set) {
        if (t->slots[i].hash == h)
            return i;
        i = (i + 1) & mask;
    }
    return NONE;
}

/* Lookups are made CHUNK blocks at a time: every slot of the chunk is prefetched before the first
 * is read, then every wide set, so that their cache misses overlap instead of adding up (a chain's
 * hashes are random over a table far larger than the caches: each probe is a miss). */
#define CHUNK 32

/* sets[j] = the set word of chain[j] in t (0: not there, or valid[j] 0), for j in [lo, hi). */
static void probe_chunk(const Table *t, const uint64_t *chain, const unsigned char *valid, Py_ssize_t lo,
                        Py_ssize_t hi, uint64_t *sets) {
    if (t->cap == 0) {
        memset(sets + lo, 0, (hi - lo) * sizeof(uint64_t));
        return;
    }
    size_t mask = t->cap - 1, home[CHUNK];
    for (Py_ssize_t j = lo; j < hi; j++) {
        home[j - lo] = mix64(chain[j]) & mask;
        __builtin_prefetch(&t->slots[home[j - lo]]);
    }
    for (Py_ssize_t j = lo; j < hi; j++) {
        uint64_t s = 0;
        if (valid[j])
            for (size_t i = home[j - lo]; t->slots[i].set; i = (i + 1) & mask)
                if (t->slots[i].hash == chain[j]) {
                    s = t->slots[i].set;
                    if (!is_inline(s))
                        __builtin_prefetch((const void *)(uintptr_t)s);
                    break;
                }
        sets[j] = s;
    }
}

/* Slot arrays of 2 MiB and more are mapped on their own and asked for transparent huge pages:
 * a walk's probes are random over the whole array, and with 4 KiB pages most of them also miss
 * the TLB. Smaller ones come from calloc. */
#define HUGE ((size_t)2 << 20)

static size_t slots_bytes(size_t cap) {
    size_t n = cap * sizeof(slot_t);
#if defined(MAP_ANONYMOUS) && defined(MADV_HUGEPAGE)
    if (n >= HUGE)
        return (n + HUGE - 1) & ~(HUGE - 1);
#endif
    return chunk(n);
}

static slot_t *slots_alloc(size_t cap) {
#if defined(MAP_ANONYMOUS) && defined(MADV_HUGEPAGE)
    size_t n = slots_bytes(cap);
    if (n >= HUGE) {
        void *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED)
            return NULL;
        madvise(p, n, MADV_HUGEPAGE); /* a hint: without it, 4 KiB pages */
        return p;                      /* zero-filled */
    }
#endif
    return calloc(cap, sizeof(slot_t));
}

static void slots_free(slot_t *s, size_t cap) {
    if (s == NULL)
        return;
#if defined(MAP_ANONYMOUS) && defined(MADV_HUGEPAGE)
    if (slots_bytes(cap) >= HUGE) {
        munmap(s, slots_bytes(cap));
        return;
    }
#endif
    free(s);
}

static int slots_resize(Table *t, size_t cap) {
    slot_t *fresh = slots_alloc(cap);
    if (fresh == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    size_t mask = cap - 1;
    for (size_t j = 0; j < t->cap; j++) {
        if (!t->slots[j].set)
            continue;
        size_t i = mix64(t->slots[j].hash) & mask;
        while (fresh[i].set)
            i = (i + 1) & mask;
        fresh[i] = t->slots[j];
    }
    slots_free(t->slots, t->cap);
    t->slots = fresh;
    t->cap = cap;
    return 0;
}

/* The slot of h, claimed (hash set, set word 0) if it was not there; NONE with MemoryError. */
static size_t slot_claim(Table *t, uint64_t h, int *fresh) {
    if ((t->used + 1) * 4 > t->cap * 3 && slots_resize(t, t->cap ? t->cap * 2 : MIN_CAP) < 0)
        return NONE;
    size_t mask = t->cap - 1, i = mix64(h) & mask;
    while (t->slots[i].set) {
        if (t->slots[i].hash == h) {
            *fresh = 0;
            return i;
        }
        i = (i + 1) & mask;
    }
    t->slots[i].hash = h;
    *fresh = 1;
    return i;
}

/* Empties slot i (its set word already 0 or freed), shifting back the run after it. */
static void slot_delete(Table *t, size_t i) {
    size_t mask = t->cap - 1, j = i;
    for (;;) {
        j = (j + 1) & mask;
        if (!t->slots[j].set)
            break;
        size_t home = mix64(t->slots[j].hash) & mask;
        /* slot j may move to i when its home is not cyclically in (i, j] */
        if (((j - home) & mask) >= ((j - i) & mask)) {
            t->slots[i] = t->slots[j];
            i = j;
        }
    }
    t->slots[i].set = 0;
    t->used--;
}

/* The capacity a table of cap slots holding used shrinks to (cap itself: it stays): below 1/8
 * full, the smallest that is at most half full, so that the next insertions do not grow it. */
static size_t shrunk(size_t cap, size_t used) {
    if (cap <= MIN_CAP || used * 8 >= cap)
        return cap;
    while (cap > MIN_CAP && used * 2 <= cap / 2)
        cap /= 2;
    return cap;
}

static int extras_resize(Table *t, size_t cap);

static void maybe_shrink(Table *t) {
    size_t cap = shrunk(t->cap, t->used), xcap = shrunk(t->xcap, t->xused);
    if ((cap != t->cap && slots_resize(t, cap) < 0) || (xcap != t->xcap && extras_resize(t, xcap) < 0))
        PyErr_Clear(); /* out of memory: keep the larger table */
}

/* -- extras: (hash, rid) -> copies beyond the first ------------------------------------------------ */
static inline size_t extra_home(uint64_t h, uint32_t rid, size_t mask) {
    return mix64(h ^ ((uint64_t)rid * 0x9e3779b97f4a7c15ULL)) & mask;
}

static size_t extra_find(const Table *t, uint64_t h, uint32_t rid) {
    if (t->xused == 0)
        return NONE;
    size_t mask = t->xcap - 1, i = extra_home(h, rid, mask);
    while (t->extras[i].extra) {
        if (t->extras[i].hash == h && t->extras[i].rid == rid)
            return i;
        i = (i + 1) & mask;
    }
    return NONE;
}

static int extras_resize(Table *t, size_t cap) {
    extra_t *fresh = calloc(cap, sizeof(extra_t));
    if (fresh == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    size_t mask = cap - 1;
    for (size_t j = 0; j < t->xcap; j++) {
        if (!t->extras[j].extra)
            continue;
        size_t i = extra_home(t->extras[j].hash, t->extras[j].rid, mask);
        while (fresh[i].extra)
            i = (i + 1) & mask;
        fresh[i] = t->extras[j];
    }
    free(t->extras);
    t->extras = fresh;
    t->xcap = cap;
    return 0;
}

static int extra_inc(Table *t, uint64_t h, uint32_t rid) {
    size_t i = extra_find(t, h, rid);
    if (i != NONE) {
        if (t->extras[i].extra == UINT32_MAX) {
            PyErr_SetString(PyExc_OverflowError, "more than 2**32 copies of one block on one replica");
            return -1;
        }
        t->extras[i].extra++;
        return 0;
    }
    if ((t->xused + 1) * 4 > t->xcap * 3 && extras_resize(t, t->xcap ? t->xcap * 2 : MIN_CAP) < 0)
        return -1;
    size_t mask = t->xcap - 1;
    i = extra_home(h, rid, mask);
    while (t->extras[i].extra)
        i = (i + 1) & mask;
    t->extras[i] = (extra_t){h, rid, 1};
    t->xused++;
    return 0;
}

static void extra_delete(Table *t, size_t i) {
    size_t mask = t->xcap - 1, j = i;
    for (;;) {
        j = (j + 1) & mask;
        if (!t->extras[j].extra)
            break;
        size_t home = extra_home(t->extras[j].hash, t->extras[j].rid, mask);
        if (((j - home) & mask) >= ((j - i) & mask)) {
            t->extras[i] = t->extras[j];
            i = j;
        }
    }
    t->extras[i].extra = 0;
    t->xused--;
}

/* One extra copy fewer; 0 when there was none (the last copy is the caller's to drop). */
static int extra_dec(Table *t, uint64_t h, uint32_t rid) {
    size_t i = extra_find(t, h, rid);
    if (i == NONE)
        return 0;
    if (--t->extras[i].extra == 0)
        extra_delete(t, i);
    return 1;
}

static void extra_drop(Table *t, uint64_t h, uint32_t rid) {
    size_t i = extra_find(t, h, rid);
    if (i != NONE)
        extra_delete(t, i);
}

/* -- per replica ------------------------------------------------------------------------------------ */
static rep_t *rep_of(Table *t, uint32_t rid) {
    if (rid >= t->nreps) {
        uint32_t n = t->nreps ? t->nreps : 8;
        while (n <= rid)
            n *= 2;
        rep_t *r = realloc(t->reps, n * sizeof(rep_t));
        if (r == NULL) {
            PyErr_NoMemory();
            return NULL;
        }
        memset(r + t->nreps, 0, (n - t->nreps) * sizeof(rep_t));
        t->reps = r;
        t->nreps = n;
    }
    return &t->reps[rid];
}

static int rep_push(rep_t *r, uint64_t h) {
    if (r->len == r->cap) {
        uint32_t cap = r->cap ? r->cap * 2 : 8;
        uint64_t *g = realloc(r->h, (size_t)cap * sizeof(uint64_t));
        if (g == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        r->h = g;
        r->cap = cap;
    }
    r->h[r->len++] = h;
    return 0;
}

static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

static inline int holds(const Table *t, uint64_t h, uint32_t rid) {
    size_t i = slot_find(t, h);
    return i != NONE && set_has(t->slots[i].set, rid);
}

/* Rebuilds rid's vector from the hashes it still holds, once per duplicate. */
static void rep_compact(Table *t, uint32_t rid) {
    rep_t *r = &t->reps[rid];
    qsort(r->h, r->len, sizeof(uint64_t), cmp_u64);
    uint32_t m = 0;
    for (uint32_t k = 0; k < r->len; k++)
        if ((k == 0 || r->h[k] != r->h[k - 1]) && holds(t, r->h[k], rid))
            r->h[m++] = r->h[k];
    r->len = m;
    uint32_t cap = m < 8 ? 8 : m;
    uint64_t *g = realloc(r->h, (size_t)cap * sizeof(uint64_t));
    if (g != NULL) {
        r->h = g;
        r->cap = cap;
    }
}

/* -- the Table type --------------------------------------------------------------------------------- */
static void table_free_all(Table *t) {
    for (size_t j = 0; j < t->cap; j++)
        set_free(t, t->slots[j].set);
    slots_free(t->slots, t->cap);
    free(t->extras);
    for (uint32_t k = 0; k < t->nreps; k++)
        free(t->reps[k].h);
    free(t->reps);
    t->slots = NULL;
    t->extras = NULL;
    t->reps = NULL;
    t->cap = t->used = t->xcap = t->xused = 0;
    t->nreps = 0;
    t->entries = 0;
    t->wide_bytes = 0;
}

static void Table_dealloc(Table *t) {
    table_free_all(t);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static int as_rid(PyObject *v, uint32_t *out) {
    unsigned long r = PyLong_AsUnsignedLong(v);
    if (r == (unsigned long)-1 && PyErr_Occurred())
        return -1;
    if (r > RID_MAX) {
        PyErr_Format(PyExc_OverflowError, "replica id %lu past %u", r, RID_MAX);
        return -1;
    }
    *out = (uint32_t)r;
    return 0;
}

/* -- Hashes: block hashes as u64s ---------------------------------------------------------------
 * What decode_batch gives the index for an event: a read-only sequence of ints backed by an array
 * of u64s (len, items, iteration, the buffer protocol as "Q"), which Table.add / remove read
 * without an int object per hash. */
typedef struct {
    PyObject_VAR_HEAD
    uint64_t h[1];
} Hashes;

static PyTypeObject HashesType;

static Hashes *hashes_new(Py_ssize_t n) {
    Hashes *o = PyObject_NewVar(Hashes, &HashesType, n);
    return o;
}

static Py_ssize_t Hashes_len(Hashes *o) { return Py_SIZE(o); }

static PyObject *Hashes_item(Hashes *o, Py_ssize_t i) {
    if (i < 0 || i >= Py_SIZE(o)) {
        PyErr_SetString(PyExc_IndexError, "Hashes index out of range");
        return NULL;
    }
    return PyLong_FromUnsignedLongLong(o->h[i]);
}

static int Hashes_getbuffer(Hashes *o, Py_buffer *view, int flags) {
    if (flags & PyBUF_WRITABLE) {
        PyErr_SetString(PyExc_BufferError, "Hashes is read-only");
        return -1;
    }
    int rc = PyBuffer_FillInfo(view, (PyObject *)o, o->h, Py_SIZE(o) * (Py_ssize_t)sizeof(uint64_t), 1, flags);
    if (rc == 0 && (flags & PyBUF_FORMAT) == PyBUF_FORMAT)
        view->format = "Q";
    if (rc == 0) {
        view->itemsize = sizeof(uint64_t);
        if ((flags & PyBUF_ND) == PyBUF_ND) {
            view->ndim = 1;
            view->shape = &((PyVarObject *)o)->ob_size;
        }
    }
    return rc;
}

static PySequenceMethods Hashes_as_sequence = {.sq_length = (lenfunc)Hashes_len, .sq_item = (ssizeargfunc)Hashes_item};
static PyBufferProcs Hashes_as_buffer = {.bf_getbuffer = (getbufferproc)Hashes_getbuffer};

static PyTypeObject HashesType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "router._index.Hashes",
    .tp_basicsize = offsetof(Hashes, h),
    .tp_itemsize = sizeof(uint64_t),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "An event's block hashes as u64s (decode_batch): a read-only sequence of ints.",
    .tp_as_sequence = &Hashes_as_sequence,
    .tp_as_buffer = &Hashes_as_buffer,
};

/* -- add / remove ------------------------------------------------------------------------------- */
/* Parses (rid, hashes): rid, and the hashes as a Hashes (borrowed: *raw, *n) or a new reference to
 * a list or tuple (returned). NULL with an exception set, or NULL with *raw set for a Hashes. */
static PyObject *rid_and_hashes(PyObject *args, uint32_t *rid, const uint64_t **raw, Py_ssize_t *n) {
    PyObject *rid_obj, *hashes;
    *raw = NULL;
    if (!PyArg_ParseTuple(args, "OO", &rid_obj, &hashes) || as_rid(rid_obj, rid) < 0)
        return NULL;
    if (Py_IS_TYPE(hashes, &HashesType)) {
        *raw = ((Hashes *)hashes)->h;
        *n = Py_SIZE(hashes);
        return NULL;
    }
    PyObject *seq = PySequence_Fast(hashes, "hashes: expected an iterable of ints");
    if (seq != NULL)
        *n = PySequence_Fast_GET_SIZE(seq);
    return seq;
}

/* Room for n more hashes without growing, so that a chunk's prefetched homes stay valid. */
static int reserve(Table *t, size_t n) {
    size_t cap = t->cap ? t->cap : MIN_CAP;
    while ((t->used + n) * 4 > cap * 3)
        cap *= 2;
    return cap == t->cap ? 0 : slots_resize(t, cap);
}

/* One more copy of each of hs[0..m) on rid (m <= CHUNK; its vector exists): their slots
 * prefetched first, then each added. -1 with an exception set. */
static int add_chunk(Table *t, uint32_t rid, const uint64_t *hs, Py_ssize_t m) {
    if (reserve(t, (size_t)m) < 0)
        return -1;
    for (Py_ssize_t j = 0; j < m; j++)
        __builtin_prefetch(&t->slots[mix64(hs[j]) & (t->cap - 1)]);
    rep_t *r = &t->reps[rid];
    for (Py_ssize_t j = 0; j < m; j++) {
        int fresh, err = 0;
        size_t i = slot_claim(t, hs[j], &fresh); /* no growth: reserved */
        slot_t *s = &t->slots[i];
        if (fresh) {
            s->set = make_inline(&rid, 1);
            t->used++;
        } else if (set_has(s->set, rid)) {
            if (extra_inc(t, hs[j], rid) < 0)
                return -1;
            continue;
        } else {
            err = set_add(t, &s->set, rid);
        }
        if (err < 0 || rep_push(r, hs[j]) < 0) {
            if (fresh)
                slot_delete(t, i);
            return -1;
        }
        r->live++;
        t->entries++;
    }
    return 0;
}

PyDoc_STRVAR(add_doc,
"add(rid, hashes) -> None\n\n"
"BlockStored: one more copy of each hash (ints in [0, 2**64), or a Hashes) on replica ``rid``. A\n"
"hash that is not such an int raises (OverflowError, TypeError) after the ones before it were added.");

static PyObject *Table_add(Table *t, PyObject *args) {
    uint32_t rid;
    const uint64_t *raw;
    Py_ssize_t n;
    PyObject *seq = rid_and_hashes(args, &rid, &raw, &n);
    if (seq == NULL && raw == NULL)
        return NULL;
    int rc = rep_of(t, rid) ? 0 : -1;
    PyObject **items = seq ? PySequence_Fast_ITEMS(seq) : NULL;
    for (Py_ssize_t lo = 0; lo < n && rc == 0; lo += CHUNK) {
        Py_ssize_t hi = lo + CHUNK < n ? lo + CHUNK : n;
        if (raw != NULL) {
            rc = add_chunk(t, rid, raw + lo, hi - lo);
            continue;
        }
        uint64_t hs[CHUNK];
        Py_ssize_t m = 0;
        while (lo + m < hi && as_u64(items[lo + m], &hs[m]) == 0)
            m++;
        if (lo + m == hi) {
            rc = add_chunk(t, rid, hs, m);
            continue;
        }
        PyObject *et, *ev, *tb; /* add up to the hash that is none, then raise */
        PyErr_Fetch(&et, &ev, &tb);
        if (add_chunk(t, rid, hs, m) < 0) {
            Py_XDECREF(et), Py_XDECREF(ev), Py_XDECREF(tb);
        } else {
            PyErr_Restore(et, ev, tb);
        }
        rc = -1;
    }
    Py_XDECREF(seq);
    if (rc < 0)
        return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(remove_doc,
"remove(rid, hashes) -> int\n\n"
"BlockRemoved: one copy fewer of each hash on replica ``rid``; the replica leaves the hash's set\n"
"with its last copy. Returns how many hashes it did not hold (a value that is no u64 included).");

/* One copy fewer of h on rid; 1 when it held none. */
static int remove_one(Table *t, uint32_t rid, uint64_t h) {
    size_t i = slot_find(t, h);
    if (i == NONE || !set_has(t->slots[i].set, rid))
        return 1;
    if (extra_dec(t, h, rid))
        return 0;
    set_del(t, &t->slots[i].set, rid);
    if (!t->slots[i].set)
        slot_delete(t, i);
    t->reps[rid].live--;
    t->entries--;
    return 0;
}

static PyObject *Table_remove(Table *t, PyObject *args) {
    uint32_t rid;
    const uint64_t *raw;
    Py_ssize_t n, missing = 0;
    PyObject *seq = rid_and_hashes(args, &rid, &raw, &n);
    if (seq == NULL && raw == NULL)
        return NULL;
    PyObject **items = seq ? PySequence_Fast_ITEMS(seq) : NULL;
    for (Py_ssize_t lo = 0; lo < n; lo += CHUNK) {
        Py_ssize_t hi = lo + CHUNK < n ? lo + CHUNK : n, m = 0;
        uint64_t buf[CHUNK];
        const uint64_t *hs = raw ? raw + lo : buf;
        if (raw == NULL) {
            for (Py_ssize_t k = lo; k < hi; k++) {
                int ok = as_block_hash(items[k], &buf[m]);
                if (ok < 0) {
                    Py_DECREF(seq);
                    return NULL;
                }
                if (ok)
                    m++;
                else
                    missing++; /* not a block hash: not indexed */
            }
        } else {
            m = hi - lo;
        }
        if (t->cap)
            for (Py_ssize_t j = 0; j < m; j++)
                __builtin_prefetch(&t->slots[mix64(hs[j]) & (t->cap - 1)]);
        for (Py_ssize_t j = 0; j < m; j++)
            missing += remove_one(t, rid, hs[j]);
    }
    Py_XDECREF(seq);
    if (rid < t->nreps) {
        rep_t *r = &t->reps[rid];
        if (r->len > 2 * r->live + 32)
            rep_compact(t, rid);
    }
    maybe_shrink(t);
    return PyLong_FromSsize_t(missing);
}

PyDoc_STRVAR(clear_doc, "clear(rid) -> None\n\nDrop every entry of replica ``rid``.");

static PyObject *Table_clear(Table *t, PyObject *arg) {
    uint32_t rid;
    if (as_rid(arg, &rid) < 0)
        return NULL;
    if (rid >= t->nreps)
        Py_RETURN_NONE;
    rep_t *r = &t->reps[rid];
    for (uint32_t k = 0; k < r->len && r->live; k++) {
        uint64_t h = r->h[k];
        size_t i = slot_find(t, h);
        if (i == NONE || !set_has(t->slots[i].set, rid))
            continue; /* stale, or a duplicate already cleared */
        extra_drop(t, h, rid);
        set_del(t, &t->slots[i].set, rid);
        if (!t->slots[i].set)
            slot_delete(t, i);
        r->live--;
        t->entries--;
    }
    free(r->h);
    *r = (rep_t){0};
    maybe_shrink(t);
    Py_RETURN_NONE;
}

static PyObject *Table_count(Table *t, PyObject *arg) {
    uint32_t rid;
    if (as_rid(arg, &rid) < 0)
        return NULL;
    return PyLong_FromUnsignedLongLong(rid < t->nreps ? t->reps[rid].live : 0);
}

/* Copies of h on rid (0 when it holds none). */
static uint64_t copies_of(const Table *t, uint64_t h, uint32_t rid) {
    if (!holds(t, h, rid))
        return 0;
    size_t x = extra_find(t, h, rid);
    return 1 + (x == NONE ? 0 : t->extras[x].extra);
}

static PyObject *Table_copies(Table *t, PyObject *args) {
    PyObject *rid_obj, *h_obj;
    uint32_t rid;
    if (!PyArg_ParseTuple(args, "OO", &rid_obj, &h_obj) || as_rid(rid_obj, &rid) < 0)
        return NULL;
    uint64_t h;
    int ok = as_block_hash(h_obj, &h);
    if (ok < 0)
        return NULL;
    return PyLong_FromUnsignedLongLong(ok ? copies_of(t, h, rid) : 0);
}

static PyObject *Table_items(Table *t, PyObject *arg) {
    uint32_t rid;
    if (as_rid(arg, &rid) < 0)
        return NULL;
    PyObject *out = PyDict_New();
    if (out == NULL || rid >= t->nreps)
        return out;
    rep_t *r = &t->reps[rid];
    for (uint32_t k = 0; k < r->len; k++) {
        uint64_t c = copies_of(t, r->h[k], rid);
        if (c == 0)
            continue;
        PyObject *key = PyLong_FromUnsignedLongLong(r->h[k]), *val = PyLong_FromUnsignedLongLong(c);
        int rc = key && val ? PyDict_SetItem(out, key, val) : -1;
        Py_XDECREF(key);
        Py_XDECREF(val);
        if (rc < 0) {
            Py_DECREF(out);
            return NULL;
        }
    }
    return out;
}

static PyObject *Table_holders(Table *t, PyObject *arg) {
    uint64_t h;
    if (as_u64(arg, &h) < 0)
        return NULL;
    size_t i = slot_find(t, h);
    PyObject *out = PyList_New(0);
    if (out == NULL || i == NONE)
        return out;
    uint32_t buf[INLINE_MAX], bw, n;
    const uint32_t *m;
    const uint64_t *bits = set_bits(t->slots[i].set, &bw);
    for (uint32_t w = 0; bits && w < bw; w++) {
        uint32_t r;
        FOR_BITS(bits[w], w * 64, r) {
            PyObject *v = PyLong_FromUnsignedLong(r);
            if (v == NULL || PyList_Append(out, v) < 0) {
                Py_XDECREF(v);
                Py_DECREF(out);
                return NULL;
            }
            Py_DECREF(v);
        }
    }
    n = bits ? 0 : members(t->slots[i].set, buf, &m);
    for (uint32_t k = 0; k < n; k++) {
        PyObject *v = PyLong_FromUnsignedLong(m[k]);
        if (v == NULL || PyList_Append(out, v) < 0) {
            Py_XDECREF(v);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(v);
    }
    return out;
}

static size_t table_nbytes(const Table *t) {
    size_t n = (t->cap ? slots_bytes(t->cap) : 0) + (t->xcap ? chunk(t->xcap * sizeof(extra_t)) : 0)
               + (t->nreps ? chunk(t->nreps * sizeof(rep_t)) : 0) + t->wide_bytes;
    for (uint32_t k = 0; k < t->nreps; k++)
        if (t->reps[k].cap)
            n += chunk(t->reps[k].cap * sizeof(uint64_t));
    return n;
}

static PyObject *Table_get_nbytes(Table *t, void *closure) {
    (void)closure;
    return PyLong_FromSize_t(table_nbytes(t));
}

static PyObject *Table_get_entries(Table *t, void *closure) {
    (void)closure;
    return PyLong_FromUnsignedLongLong(t->entries);
}

static Py_ssize_t Table_len(Table *t) { return (Py_ssize_t)t->used; }

static PyMethodDef Table_methods[] = {
    {"add", (PyCFunction)Table_add, METH_VARARGS, add_doc},
    {"remove", (PyCFunction)Table_remove, METH_VARARGS, remove_doc},
    {"clear", (PyCFunction)Table_clear, METH_O, clear_doc},
    {"count", (PyCFunction)Table_count, METH_O, "count(rid) -> int: distinct hashes replica ``rid`` holds."},
    {"copies", (PyCFunction)Table_copies, METH_VARARGS, "copies(rid, hash) -> int: its copies of ``hash`` (0: none)."},
    {"items", (PyCFunction)Table_items, METH_O, "items(rid) -> dict: {hash: copies} of replica ``rid``."},
    {"holders", (PyCFunction)Table_holders, METH_O, "holders(hash) -> list: the replica ids holding ``hash``."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Table_getset[] = {
    {"nbytes", (getter)Table_get_nbytes, NULL, "bytes the table holds (see router/_index.c)", NULL},
    {"entries", (getter)Table_get_entries, NULL, "(replica, hash) entries", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods Table_as_sequence = {.sq_length = (lenfunc)Table_len};

static PyTypeObject TableType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "router._index.Table",
    .tp_basicsize = sizeof(Table),
    .tp_dealloc = (destructor)Table_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One medium's cached blocks of every replica: hash -> replica ids, copy counts (router/_index.c).",
    .tp_methods = Table_methods,
    .tp_getset = Table_getset,
    .tp_as_sequence = &Table_as_sequence,
    .tp_new = PyType_GenericNew,
};

/* -- the walk -------------------------------------------------------------------------------------- */
static inline int bit_test(const uint64_t *b, uint32_t r) { return (int)((b[r >> 6] >> (r & 63)) & 1); }
static inline void bit_set(uint64_t *b, uint32_t r) { b[r >> 6] |= (uint64_t)1 << (r & 63); }

/* The bits of a speculative mask (a non-negative int) into words[0..nw), zero-filled. */
static int mask_words(PyObject *v, uint64_t *words, Py_ssize_t nw, unsigned char *scratch) {
    int overflow;
    long long small = PyLong_AsLongLongAndOverflow(v, &overflow);
    memset(words, 0, nw * sizeof(uint64_t));
    if (small == -1 && PyErr_Occurred())
        return -1;
    if (!overflow) {
        if (small < 0) {
            PyErr_SetString(PyExc_ValueError, "a negative speculative mask");
            return -1;
        }
        words[0] = (uint64_t)small; /* nw >= 1 */
        return 0;
    }
    /* Wider than 63 bits: its little-endian bytes (at most nw words: ids are below nbits). */
    if (_PyLong_AsByteArray((PyLongObject *)v, scratch, (size_t)nw * 8, 1, 0) < 0)
        return -1;
    for (Py_ssize_t w = 0; w < nw; w++) {
        uint64_t x = 0;
        for (int k = 7; k >= 0; k--)
            x = (x << 8) | scratch[w * 8 + k];
        words[w] = x;
    }
    return 0;
}

static int emit(PyObject *out, uint32_t rid, long gpu, long cpu, long spec) {
    PyObject *k = PyLong_FromUnsignedLong(rid), *v = Py_BuildValue("(lll)", gpu, cpu, spec);
    int rc = k && v ? PyDict_SetItem(out, k, v) : -1;
    Py_XDECREF(k);
    Py_XDECREF(v);
    return rc;
}

PyDoc_STRVAR(walk_doc,
"walk(hashes, gpu, spec, cpu, nbits) -> dict[int, tuple[int, int, int]]\n\n"
"For each replica id below ``nbits`` with a match: (gpu, cpu, speculative) blocks, as\n"
"BlockIndex.lookup's Match: the leading run of ``hashes`` held in ``gpu`` (a Table) or ``spec``\n"
"(a dict {hash: bitmask of replica ids}, or None), how many of that run's blocks are past the\n"
"replica's first block not really in ``gpu``, then the run after it in ``cpu`` (a Table, or None).\n"
"Replicas that match nothing are left out. hashes: a list; a hash that is not an int in\n"
"[0, 2**64) is held by no table (the spec dict is still asked).");

/* Scratch of one walk: the chain as u64s (and which entries are block hashes), run bitsets over
 * replica ids, and per replica id its GPU run end, real-GPU run end, CPU run start and length. */
typedef struct {
    Py_ssize_t n, nw, nbits;
    uint64_t *chain, *sets, *R, *N, *Rr, *Nr, *R0, *S, *C, *Cdone;
    int32_t *gend, *rend, *cstart, *clen;
    uint64_t *order; /* (GPU run end << 32 | id) of R0's replicas, ascending, for the CPU pass */
    unsigned char *valid, *scratch;
} walk_t;

static char *walk_alloc(walk_t *k, Py_ssize_t n, Py_ssize_t nbits) {
    Py_ssize_t nw = (nbits + 63) / 64;
    size_t sz = (8 * (size_t)nw + 2 * (size_t)n) * sizeof(uint64_t) + 4 * (size_t)nbits * sizeof(int32_t)
                + (size_t)nbits * sizeof(uint64_t) + (size_t)n
                + (size_t)nw * 8;
    char *mem = malloc(sz);
    if (mem == NULL)
        return NULL;
    uint64_t *b = (uint64_t *)mem;
    memset(b, 0, 8 * (size_t)nw * sizeof(uint64_t));
    k->n = n;
    k->nw = nw;
    k->nbits = nbits;
    k->R = b, k->N = b + nw, k->Rr = b + 2 * nw, k->Nr = b + 3 * nw, k->R0 = b + 4 * nw, k->S = b + 5 * nw;
    k->C = b + 6 * nw, k->Cdone = b + 7 * nw, k->chain = b + 8 * nw, k->sets = k->chain + n;
    k->gend = (int32_t *)(k->sets + n), k->rend = k->gend + nbits, k->cstart = k->rend + nbits;
    k->clen = k->cstart + nbits, k->order = (uint64_t *)(k->clen + nbits);
    k->valid = (unsigned char *)(k->order + nbits), k->scratch = k->valid + n;
    return mem;
}


/* Sets the bits of N (and of Nr, for those in Rr) of the members of set word s that are in R. */
static inline void intersect(uint64_t s, const uint64_t *R, const uint64_t *Rr, uint64_t *N, uint64_t *Nr,
                             Py_ssize_t nbits, Py_ssize_t nw) {
    uint32_t buf[INLINE_MAX], bw;
    const uint64_t *bits = set_bits(s, &bw);
    if (bits != NULL) { /* a word at a time (R has no id past nbits) */
        for (Py_ssize_t w = 0; w < nw && w < (Py_ssize_t)bw; w++) {
            N[w] |= R[w] & bits[w];
            Nr[w] |= Rr[w] & bits[w];
        }
        return;
    }
    const uint32_t *m;
    uint32_t cnt = members(s, buf, &m);
    for (uint32_t j = 0; j < cnt; j++) {
        uint32_t r = m[j];
        if (r < nbits && bit_test(R, r)) {
            bit_set(N, r);
            if (bit_test(Rr, r))
                bit_set(Nr, r);
        }
    }
}

/* The GPU pass: gend / rend of every replica in R0 (block 0 held on the GPU or speculatively).
 * R starts as every id: block 0 makes it R0. */
static int walk_gpu(walk_t *k, Table *gpu, PyObject *hashes, PyObject *spec) {
    Py_ssize_t n = k->n, nw = k->nw, i = 0;
    uint64_t *R = k->R, *N = k->N, *Rr = k->Rr, *Nr = k->Nr, *sets = k->sets;
    uint32_t r;
    for (Py_ssize_t w = 0; w < nw; w++)
        R[w] = Rr[w] = w == nw - 1 && k->nbits % 64 ? ((uint64_t)1 << (k->nbits % 64)) - 1 : ~(uint64_t)0;
    int alive = 1;
    for (Py_ssize_t lo = 0; lo < n && alive; lo += CHUNK) {
        Py_ssize_t hi = lo + CHUNK < n ? lo + CHUNK : n;
        probe_chunk(gpu, k->chain, k->valid, lo, hi, sets);
        for (i = lo; i < hi; i++) {
            for (Py_ssize_t w = 0; w < nw; w++)
                N[w] = Nr[w] = 0;
            if (sets[i])
                intersect(sets[i], R, Rr, N, Nr, k->nbits, nw);
            if (spec != NULL) {
                PyObject *v = PyDict_GetItemWithError(spec, PyList_GET_ITEM(hashes, i)); /* borrowed */
                if (v == NULL && PyErr_Occurred())
                    return -1;
                if (v != NULL) {
                    if (mask_words(v, k->S, nw, k->scratch) < 0)
                        return -1;
                    for (Py_ssize_t w = 0; w < nw; w++)
                        N[w] |= k->S[w] & R[w];
                }
            }
            uint64_t any = 0;
            for (Py_ssize_t w = 0; w < nw; w++) {
                if (i == 0) {
                    k->R0[w] = N[w];
                    FOR_BITS(N[w] & ~Nr[w], w * 64, r) /* block 0 only speculative: no real run */
                        k->rend[r] = 0;
                } else {
                    FOR_BITS(R[w] & ~N[w], w * 64, r)
                        k->gend[r] = (int32_t)i;
                    FOR_BITS(Rr[w] & ~Nr[w], w * 64, r)
                        k->rend[r] = (int32_t)i;
                }
                R[w] = N[w];
                Rr[w] = Nr[w];
                any |= N[w];
            }
            if (!any) {
                alive = 0;
                break;
            }
        }
    }
    for (Py_ssize_t w = 0; w < nw; w++) { /* the runs that reach the end of the chain */
        FOR_BITS(R[w], w * 64, r)
            k->gend[r] = (int32_t)n;
        FOR_BITS(Rr[w], w * 64, r)
            k->rend[r] = (int32_t)n;
    }
    return 0;
}

/* The CPU pass: each replica's CPU run starts where its GPU run ended (block 0 for those not in
 * R0). One pass along the chain: replicas join at their start block if they hold it on the CPU
 * tier, and leave at their first miss (clen, marked in Cdone). */
static void walk_cpu(walk_t *k, Table *cpu) {
    Py_ssize_t n = k->n, nw = k->nw, norder = 0, p = 0, probed = 0;
    uint64_t *C = k->C, *N = k->N, *S = k->S;
    uint32_t buf[INLINE_MAX], r;
    const uint32_t *m;
    for (Py_ssize_t w = 0; w < nw; w++)
        FOR_BITS(k->R0[w], w * 64, r)
            if (k->gend[r] < n)
                k->order[norder++] = (uint64_t)k->gend[r] << 32 | r;
    qsort(k->order, norder, sizeof(uint64_t), cmp_u64);
    int alive = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int starters = 0;
        memset(S, 0, nw * sizeof(uint64_t));
        if (i == 0) {
            for (Py_ssize_t w = 0; w < nw; w++)
                S[w] = ~k->R0[w];
            if (k->nbits % 64)
                S[nw - 1] &= ((uint64_t)1 << (k->nbits % 64)) - 1;
            starters = 1;
        }
        for (; p < norder && (Py_ssize_t)(k->order[p] >> 32) == i; p++) {
            bit_set(S, (uint32_t)k->order[p]);
            starters = 1;
        }
        if (!alive && !starters) {
            if (p == norder)
                break;
            i = (Py_ssize_t)(k->order[p] >> 32) - 1; /* nothing to walk until the next start */
            continue;
        }
        if (i >= probed) { /* the next chunk's CPU sets (jumps skip whole chunks unprobed) */
            probed = i + CHUNK < n ? i + CHUNK : n;
            probe_chunk(cpu, k->chain, k->valid, i, probed, k->sets);
        }
        uint32_t bw, cnt = 0;
        const uint64_t *bits = k->sets[i] ? set_bits(k->sets[i], &bw) : NULL;
        memset(N, 0, nw * sizeof(uint64_t));
        if (bits != NULL) { /* starters and runners are disjoint */
            for (Py_ssize_t w = 0; w < nw && w < (Py_ssize_t)bw; w++) {
                N[w] = (S[w] | C[w]) & bits[w];
                FOR_BITS(S[w] & bits[w], w * 64, r)
                    k->cstart[r] = (int32_t)i;
            }
        } else if (k->sets[i]) {
            cnt = members(k->sets[i], buf, &m);
        }
        for (uint32_t j = 0; j < cnt; j++) {
            r = m[j];
            if (r >= k->nbits)
                continue;
            if (bit_test(S, r)) {
                bit_set(N, r);
                k->cstart[r] = (int32_t)i;
            } else if (bit_test(C, r)) {
                bit_set(N, r);
            }
        }
        alive = 0;
        for (Py_ssize_t w = 0; w < nw; w++) {
            FOR_BITS(C[w] & ~N[w], w * 64, r) {
                k->clen[r] = (int32_t)(i - k->cstart[r]);
                bit_set(k->Cdone, r);
            }
            C[w] = N[w];
            alive |= N[w] != 0;
        }
    }
    for (Py_ssize_t w = 0; w < nw; w++)
        FOR_BITS(C[w], w * 64, r) {
            k->clen[r] = (int32_t)(n - k->cstart[r]);
            bit_set(k->Cdone, r);
        }
}

static PyObject *walk(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *hashes, *spec, *cpu_obj;
    Table *gpu;
    Py_ssize_t nbits;
    if (!PyArg_ParseTuple(args, "O!O!OOn", &PyList_Type, &hashes, &TableType, &gpu, &spec, &cpu_obj, &nbits))
        return NULL;
    if (spec != Py_None && !PyDict_CheckExact(spec))
        return PyErr_Format(PyExc_TypeError, "spec: expected a dict or None");
    if (cpu_obj != Py_None && !PyObject_TypeCheck(cpu_obj, &TableType))
        return PyErr_Format(PyExc_TypeError, "cpu: expected a Table or None");
    if (nbits < 0 || nbits > (Py_ssize_t)RID_MAX + 1)
        return PyErr_Format(PyExc_ValueError, "nbits %zd out of range", nbits);
    Table *cpu = cpu_obj == Py_None || ((Table *)cpu_obj)->used == 0 ? NULL : (Table *)cpu_obj;
    PyObject *sp = spec == Py_None || PyDict_GET_SIZE(spec) == 0 ? NULL : spec;
    Py_ssize_t n = PyList_GET_SIZE(hashes);
    PyObject *out = PyDict_New();
    if (out == NULL || n == 0 || nbits == 0 || (gpu->used == 0 && sp == NULL && cpu == NULL))
        return out;
    walk_t k;
    char *mem = walk_alloc(&k, n, nbits);
    if (mem == NULL) {
        Py_DECREF(out);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int ok = as_block_hash(PyList_GET_ITEM(hashes, i), &k.chain[i]); /* not one: held nowhere */
        if (ok < 0)
            goto fail;
        k.valid[i] = (unsigned char)ok;
    }
    if (walk_gpu(&k, gpu, hashes, sp) < 0)
        goto fail;
    if (cpu != NULL)
        walk_cpu(&k, cpu);
    for (Py_ssize_t w = 0; w < k.nw; w++) {
        uint32_t r;
        FOR_BITS(k.R0[w] | k.Cdone[w], w * 64, r) {
            int in_gpu = bit_test(k.R0, r);
            long g = in_gpu ? k.gend[r] : 0, real = in_gpu ? k.rend[r] : 0;
            long c = bit_test(k.Cdone, r) ? k.clen[r] : 0;
            if (emit(out, r, g, c, g - real) < 0)
                goto fail;
        }
    }
    free(mem);
    return out;
fail:
    free(mem);
    Py_DECREF(out);
    return NULL;
}

/* -- decode_batch: a KVEventBatch's wire bytes into what the index applies -------------------------
 * kvroute/v1/events.proto's KVEventBatch, decoded for the consumer's apply path: per event its
 * kind, medium and hashes (a Hashes), without an int object per hash or a token id decoded (a
 * batch carries 16 token ids per block, which upb turned into a repeated field the router never
 * reads). Only the form replicas write is taken, and only when the batch passes
 * kvroute.events.batch_problem's checks; anything else (a field this reader does not know, a
 * repeated scalar not packed, an event with two of its oneof's fields, a malformed or truncated
 * message, a string that is not UTF-8, a problem) gives None, and the caller parses it with upb
 * as before, which decides what it is. */
typedef struct {
    const uint8_t *p, *end;
} rd_t;

static int rd_varint(rd_t *r, uint64_t *v) {
    uint64_t x = 0;
    for (int k = 0; k < 10; k++) {
        if (r->p == r->end)
            return -1;
        uint8_t b = *r->p++;
        if (k == 9 && b > 1)
            return -1; /* past 64 bits */
        x |= (uint64_t)(b & 0x7f) << (7 * k);
        if (!(b & 0x80)) {
            *v = x;
            return 0;
        }
    }
    return -1;
}

/* The next field's number and wire type; 0 at the end, -1 when malformed. */
static int rd_key(rd_t *r, uint32_t *field, int *wt) {
    uint64_t k;
    if (r->p == r->end)
        return 0;
    if (rd_varint(r, &k) < 0 || (k >> 3) == 0 || (k >> 3) > 0x1fffffff)
        return -1;
    *field = (uint32_t)(k >> 3);
    *wt = (int)(k & 7);
    return 1;
}

static int rd_len(rd_t *r, rd_t *sub) {
    uint64_t n;
    if (rd_varint(r, &n) < 0 || n > (uint64_t)(r->end - r->p))
        return -1;
    sub->p = r->p;
    sub->end = r->p + n;
    r->p += n;
    return 0;
}

/* Well-formed UTF-8 (Unicode's table 3-7: no overlong forms, surrogates or code points past
 * U+10FFFF), as upb requires of a proto3 string. */
static int utf8_ok(const uint8_t *s, const uint8_t *end) {
    while (s < end) {
        uint8_t c = *s;
        if (c < 0x80) {
            s++;
            continue;
        }
        int n;
        uint8_t lo = 0x80, hi = 0xbf;
        if (c >= 0xc2 && c <= 0xdf)
            n = 1;
        else if (c >= 0xe0 && c <= 0xef) {
            n = 2;
            if (c == 0xe0)
                lo = 0xa0;
            else if (c == 0xed)
                hi = 0x9f;
        } else if (c >= 0xf0 && c <= 0xf4) {
            n = 3;
            if (c == 0xf0)
                lo = 0x90;
            else if (c == 0xf4)
                hi = 0x8f;
        } else
            return 0;
        if (end - s <= n || s[1] < lo || s[1] > hi)
            return 0;
        for (int k = 2; k <= n; k++)
            if (s[k] < 0x80 || s[k] > 0xbf)
                return 0;
        s += n + 1;
    }
    return 1;
}

/* Packed varints of r: their count, the values into out (when not NULL); -1 when malformed. */
static Py_ssize_t packed(rd_t r, uint64_t *out) {
    Py_ssize_t n = 0;
    while (r.p < r.end) {
        uint64_t v;
        if (rd_varint(&r, &v) < 0)
            return -1;
        if (out)
            out[n] = v;
        n++;
    }
    return n;
}

/* The number of varints in the packed run r, -1 when malformed (one of more than 10 bytes, or the
 * last unterminated): 8 bytes at a time, as a count of the bytes that end a varint (token ids are
 * most of a batch's bytes and are only counted). */
static Py_ssize_t count_varints(rd_t r) {
    const uint8_t *p = r.p, *end = r.end;
    if (p == end)
        return 0;
    if (end[-1] & 0x80)
        return -1;
    Py_ssize_t n = 0;
    int run = 0; /* continuation bytes since the last end of a varint */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    for (; end - p >= 8; p += 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        uint64_t stops = ~w & 0x8080808080808080ULL;
        if (stops == 0) {
            if ((run += 8) > 9)
                return -1;
            continue;
        }
        if (run + __builtin_ctzll(stops) / 8 > 9) /* little-endian: the first byte is the lowest */
            return -1;
        n += __builtin_popcountll(stops);
        run = 7 - (63 - __builtin_clzll(stops)) / 8;
    }
#endif
    for (; p < end; p++) {
        if (*p & 0x80) {
            if (++run > 9)
                return -1;
        } else {
            n++;
            run = 0;
        }
    }
    return n;
}

/* A message of strings (field numbers in ``strings``), int64s (``ints``) and sub-messages checked
 * by ``sub`` (field number ``sub_field``; one level per call): 0 when well-formed, -1 otherwise.
 * For the extra keys, which the index does not read but upb checks. */
static int check_keys(rd_t r, int depth);

static int check_fields(rd_t r, uint32_t strings, uint32_t ints, uint32_t subs, int depth) {
    uint32_t f;
    int wt, rc;
    while ((rc = rd_key(&r, &f, &wt)) == 1) {
        if (f >= 32)
            return -1;
        uint32_t bit = (uint32_t)1 << f;
        if ((strings | subs) & bit) {
            rd_t s;
            if (wt != 2 || rd_len(&r, &s) < 0)
                return -1;
            if ((strings & bit) ? !utf8_ok(s.p, s.end) : check_keys(s, depth + 1) < 0)
                return -1;
        } else if (ints & bit) {
            uint64_t v;
            if (wt != 0 || rd_varint(&r, &v) < 0)
                return -1;
        } else {
            return -1;
        }
    }
    return rc;
}

/* depth 1: BlockExtraKeys {ExtraKey keys = 1}; 2: ExtraKey {LoraKey 1, MultiModalKey 2, string 3};
 * 3: LoraKey {string 1, 2} or MultiModalKey {string 1, int64 2}. */
static int check_keys(rd_t r, int depth) {
    if (depth == 1)
        return check_fields(r, 0, 0, 1u << 1, 1);
    if (depth == 2)
        return check_fields(r, 1u << 3, 0, (1u << 1) | (1u << 2), 2);
    /* LoraKey and MultiModalKey share field 1 (a string); field 2 is a string or an int64 */
    uint32_t f;
    int wt, rc;
    while ((rc = rd_key(&r, &f, &wt)) == 1) {
        rd_t s;
        uint64_t v;
        if (f == 1 || (f == 2 && wt == 2)) {
            if (wt != 2 || rd_len(&r, &s) < 0 || !utf8_ok(s.p, s.end))
                return -1;
        } else if (f == 2 && wt == 0) {
            if (rd_varint(&r, &v) < 0)
                return -1;
        } else {
            return -1;
        }
    }
    return rc;
}

/* Hashes of the packed runs runs[0..nruns) (a repeated field may come in several runs). */
static PyObject *hashes_of(const rd_t *runs, int nruns, Py_ssize_t total) {
    Hashes *h = hashes_new(total);
    if (h == NULL)
        return NULL;
    Py_ssize_t at = 0;
    for (int k = 0; k < nruns; k++)
        at += packed(runs[k], h->h + at);
    return (PyObject *)h;
}

#define MAX_RUNS 8

static PyObject *s_stored, *s_removed, *s_cleared, *s_empty, *empty_tuple;

/* One KVEvent: its (kind, medium, hashes) tuple, Py_None for "not this reader's" (no exception),
 * NULL with an exception. */
static PyObject *decode_event(rd_t ev, long block_size, long max_hashes) {
    uint32_t f;
    int wt, rc = rd_key(&ev, &f, &wt);
    if (rc == 0) /* no field of the oneof set */
        return Py_BuildValue("(OOO)", Py_None, s_empty, empty_tuple);
    rd_t body;
    if (rc < 0 || f < 1 || f > 3 || wt != 2 || rd_len(&ev, &body) < 0 || ev.p != ev.end)
        Py_RETURN_NONE; /* malformed, or more than one field: upb's merge rules decide */
    rd_t runs[MAX_RUNS], medium = {NULL, NULL};
    int nruns = 0;
    Py_ssize_t nhashes = 0, ntokens = 0;
    uint64_t bsize = 0;
    uint32_t hf = f == 3 ? 0 : 1, mf = f == 1 ? 6 : f == 2 ? 2 : 1;
    while ((rc = rd_key(&body, &f, &wt)) == 1) {
        rd_t s;
        uint64_t v;
        if (f == hf && wt == 2) {
            if (rd_len(&body, &s) < 0 || nruns == MAX_RUNS)
                Py_RETURN_NONE;
            Py_ssize_t k = packed(s, NULL);
            if (k < 0)
                Py_RETURN_NONE;
            runs[nruns++] = s;
            nhashes += k;
        } else if (f == mf && wt == 2) {
            if (rd_len(&body, &medium) < 0 || !utf8_ok(medium.p, medium.end))
                Py_RETURN_NONE;
        } else if (hf && mf == 6 && (f == 2 || f == 4) && wt == 0) { /* parent_block_hash, block_size */
            if (rd_varint(&body, &v) < 0)
                Py_RETURN_NONE;
            if (f == 4)
                bsize = (uint32_t)v; /* a uint32 field keeps the low 32 bits */
        } else if (mf == 6 && f == 3 && wt == 2) { /* token_ids: counted, not kept */
            Py_ssize_t k;
            if (rd_len(&body, &s) < 0 || (k = count_varints(s)) < 0)
                Py_RETURN_NONE;
            ntokens += k;
        } else if (mf == 6 && f == 5 && wt == 2) { /* lora_name */
            if (rd_len(&body, &s) < 0 || !utf8_ok(s.p, s.end))
                Py_RETURN_NONE;
        } else if (mf == 6 && f == 7 && wt == 2) { /* extra_keys: checked, not kept */
            if (rd_len(&body, &s) < 0 || check_keys(s, 1) < 0)
                Py_RETURN_NONE;
        } else {
            Py_RETURN_NONE;
        }
    }
    if (rc < 0)
        Py_RETURN_NONE;
    /* kvroute.events.batch_problem's checks: a batch with a problem is upb's to report */
    if (hf && nhashes > max_hashes)
        Py_RETURN_NONE;
    if (mf == 6 && ((bsize != 0 && bsize != (uint64_t)block_size) || ntokens > nhashes * (Py_ssize_t)block_size))
        Py_RETURN_NONE;
    PyObject *med = medium.p ? PyUnicode_DecodeUTF8((const char *)medium.p, medium.end - medium.p, NULL)
                             : Py_NewRef(s_empty);
    PyObject *hs = hf ? hashes_of(runs, nruns, nhashes) : Py_NewRef(empty_tuple);
    PyObject *out = med && hs ? PyTuple_Pack(3, mf == 6 ? s_stored : hf ? s_removed : s_cleared, med, hs) : NULL;
    Py_XDECREF(med);
    Py_XDECREF(hs);
    return out;
}

PyDoc_STRVAR(decode_doc,
"decode_batch(data, block_size, max_hashes) -> (ts, events) | None\n\n"
"A KVEventBatch's bytes as ``(ts, [(kind, medium, hashes), ...])``: kind the event's oneof field\n"
"name (None for an event with none), medium its medium field ('' when unset), hashes a Hashes\n"
"(() for all_blocks_cleared). None when the bytes are not in the form this reader takes or the batch\n"
"has a problem (kvroute.events.batch_problem with ``block_size``, ``max_hashes``): parse those with\n"
"upb.");

static PyObject *decode_batch(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer data;
    long block_size, max_hashes;
    if (!PyArg_ParseTuple(args, "y*ll", &data, &block_size, &max_hashes))
        return NULL;
    rd_t r = {data.buf, (const uint8_t *)data.buf + data.len};
    double ts = 0.0;
    PyObject *events = PyList_New(0), *out = NULL;
    uint32_t f;
    int wt, rc;
    while (events && (rc = rd_key(&r, &f, &wt)) == 1) {
        if (f == 1 && wt == 1 && r.end - r.p >= 8) {
            uint64_t bits = 0;
            for (int k = 7; k >= 0; k--)
                bits = (bits << 8) | r.p[k];
            memcpy(&ts, &bits, sizeof ts);
            r.p += 8;
            continue;
        }
        rd_t ev;
        if (f != 2 || wt != 2 || rd_len(&r, &ev) < 0)
            goto other;
        PyObject *e = decode_event(ev, block_size, max_hashes);
        if (e == NULL)
            goto done;
        if (e == Py_None) {
            Py_DECREF(e);
            goto other;
        }
        rc = PyList_Append(events, e);
        Py_DECREF(e);
        if (rc < 0)
            goto done;
    }
    if (events == NULL || rc < 0)
        goto other;
    out = Py_BuildValue("(dO)", ts, events);
    goto done;
other:
    out = events ? Py_NewRef(Py_None) : NULL;
done:
    Py_XDECREF(events);
    PyBuffer_Release(&data);
    return out;
}

static PyMethodDef methods[] = {
    {"walk", walk, METH_VARARGS, walk_doc},
    {"decode_batch", decode_batch, METH_VARARGS, decode_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "router._index", "The router index's storage and lookup walk in C (see router/index.py).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__index(void) {
    if (PyType_Ready(&TableType) < 0 || PyType_Ready(&HashesType) < 0)
        return NULL;
    if (s_stored == NULL && (!(s_stored = PyUnicode_InternFromString("block_stored"))
                             || !(s_removed = PyUnicode_InternFromString("block_removed"))
                             || !(s_cleared = PyUnicode_InternFromString("all_blocks_cleared"))
                             || !(s_empty = PyUnicode_InternFromString("")) || !(empty_tuple = PyTuple_New(0))))
        return NULL;
    PyObject *mod = PyModule_Create(&module_def);
    if (mod == NULL)
        return NULL;
    Py_INCREF(&TableType);
    if (PyModule_AddObject(mod, "Table", (PyObject *)&TableType) < 0) {
        Py_DECREF(&TableType);
        Py_DECREF(mod);
        return NULL;
    }
    Py_INCREF(&HashesType);
    if (PyModule_AddObject(mod, "Hashes", (PyObject *)&HashesType) < 0) {
        Py_DECREF(&HashesType);
        Py_DECREF(mod);
        return NULL;
    }
    return mod;
}
