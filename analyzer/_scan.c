/* The float32, bfloat16 and float16 range scan of `analyzer inspect` in one read of memory: optional, with a numpy
 * fallback.
 *
 * scan_f32(buffer, fp16_overflow, fp16_flush, bf16_overflow, bf16_flush) -> 9 ints
 *   buffer: C-contiguous float32 data (any object with the buffer protocol: a numpy array, a memoryview);
 *   the four thresholds: the float32 bit patterns of the magnitudes in analyzer/_rangestats.py.
 * Returns (hi, lo, nan, inf, zeros, fp16_overflow, fp16_flush, bf16_overflow, bf16_flush):
 *   hi: the float32 bit pattern of the greatest finite magnitude, -1 when no element is finite;
 *   lo: the float32 bit pattern of the least non-zero finite magnitude, -1 when there is none;
 *   the counts as _rangestats.TensorStats defines them (overflows count finite values only).
 * scan_bf16(buffer, ...) is the same for bfloat16 data (2-byte items, e.g. an int16 view), which is the top
 * half of a float32: each block is widened to float32 bit patterns in L1 first, so every number is as
 * the float32 scan of the exactly converted values gives it. scan_f16(buffer, ...) likewise for float16.
 *
 * Every comparison is on magnitudes as int32 bit patterns (sign bit cleared), whose order is the order of
 * the magnitudes, with inf (0x7F800000) and NaN above every finite value. The data is read in blocks of
 * BLOCK elements: one pass takes each block's extremes, and only a block whose extremes cross a threshold
 * (a zero, NaN/Inf, an overflow, a value that flushes) is counted again, while it is still in L1.
 * The GIL is released for the scan, so callers can split a tensor between threads.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* One copy of each loop per instruction set, picked at load time (GCC; clang from 14). AVX-512 doubled the
 * in-cache speed of the extremes pass on this project's Zen 4 machine; from memory it is what lets the
 * pass keep up with a plain sum. Elsewhere the loops are compiled for the baseline (SSE2).
 * -DAMP_AUTOPSY_NO_CLONES builds one copy for the flags given (the tests build the SSE2 and AVX2 ones). */
#if !defined(AMP_AUTOPSY_NO_CLONES) && defined(__x86_64__) && !defined(__APPLE__) && defined(__GNUC__) && \
    !defined(__clang__) && __GNUC__ >= 11
/* x86-64-v4 adds AVX-512BW to AVX-512F: the 16-bit (bf16/fp16) loops need it for 512-bit vectors */
#define VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#elif !defined(AMP_AUTOPSY_NO_CLONES) && defined(__x86_64__) && !defined(__APPLE__) && \
    ((defined(__GNUC__) && !defined(__clang__)) || (defined(__clang__) && __clang_major__ >= 14))
#define VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define VECTOR_CLONES
#endif

#if defined(__GNUC__) || defined(__clang__)
#define ALWAYS_INLINE static inline __attribute__((always_inline))
#else
#define ALWAYS_INLINE static inline
#endif

#define MAG 0x7FFFFFFF
#define INF_BITS 0x7F800000
#define BLOCK 8192 /* 32 KiB: a recount stays in L1; 4K..32K measured level */

typedef struct {
    int32_t hi, lo;  /* lo: least non-zero magnitude, MAG when none */
    uint64_t nan, inf, zeros, o16, f16, obf, fbf;
} acc_t;

/* The greatest magnitude (*hi), whether there is a zero (*mn: 0, else the least magnitude), and the least
 * non-zero magnitude minus 1 (*nz; MAG when all are zero); with `t` >= 0 also the number of magnitudes
 * <= t, counted in the same pass (t < 0: not counted). The pass keeps 2 extremes, of m and of m - 1:
 * a zero makes the second -1, and only then does a second look (in L1) find the least non-zero one. */
#define LANES 32 /* independent accumulators (4 AVX2 or 2 AVX-512 registers each): no chain of dependent
                     max/min; 1.7x faster in cache than one accumulator, 64 lanes measured level */
/* One pass over b[0:full] (full: a multiple of LANES) into per-lane extremes and counts. `count` is a
 * constant at each call site, so inlining compiles a loop with the count and one without. */
ALWAYS_INLINE void
lane_pass(const uint32_t *b, size_t full, int32_t t, int count, int32_t *h, int32_t *z, int32_t *c)
{
    for (size_t i = 0; i < full; i += LANES)
        for (size_t j = 0; j < LANES; j++) {
            int32_t m = (int32_t)(b[i + j] & MAG);
            int32_t d = m - 1;
            h[j] = m > h[j] ? m : h[j];
            z[j] = d < z[j] ? d : z[j];
            if (count)
                c[j] += m <= t;
        }
}

VECTOR_CLONES static int32_t
extremes(const uint32_t *b, int32_t n, int32_t t, int32_t *hi, int32_t *mn, int32_t *nz)
{
    int32_t h[LANES], z[LANES], c[LANES];
    for (int j = 0; j < LANES; j++) {
        h[j] = 0;
        z[j] = MAG;
        c[j] = 0;
    }
    /* NB: unsigned size_t indices. Python builds extensions with -fwrapv, under which GCC cannot prove that
     * an int32 `i + j` does not wrap, and then does not vectorize these loops at all (15 GB/s, not 200) */
    const size_t full = (size_t)n - (size_t)n % LANES;
    if (t < 0)
        lane_pass(b, full, t, 0, h, z, c);
    else
        lane_pass(b, full, t, 1, h, z, c);
    size_t i = full;
    for (; i < (size_t)n; i++) {  /* the ragged tail, into lane 0 */
        int32_t m = (int32_t)(b[i] & MAG);
        int32_t d = m - 1;
        h[0] = m > h[0] ? m : h[0];
        z[0] = d < z[0] ? d : z[0];
        c[0] += t >= 0 && m <= t;
    }
    int32_t hh = 0, zz = MAG, cc = 0;
    for (int j = 0; j < LANES; j++) {
        hh = h[j] > hh ? h[j] : hh;
        zz = z[j] < zz ? z[j] : zz;
        cc += c[j];
    }
    *hi = hh;
    if (zz < 0) {  /* a zero: the least non-zero magnitude takes a second look, in L1 */
        int32_t z2 = MAG;
        for (int32_t k = 0; k < n; k++) {
            int32_t d = (int32_t)(((b[k] & MAG) - 1) & MAG);
            z2 = d < z2 ? d : z2;
        }
        *mn = 0;
        *nz = z2;
    } else {
        *mn = zz + 1;
        *nz = zz;
    }
    return cc;
}

VECTOR_CLONES static int32_t
count_le(const uint32_t *b, int32_t n, int32_t t)
{
    int32_t c = 0;
    for (int32_t i = 0; i < n; i++)
        c += (int32_t)(b[i] & MAG) <= t;
    return c;
}

VECTOR_CLONES static int32_t
count_ge(const uint32_t *b, int32_t n, int32_t t)
{
    int32_t c = 0;
    for (int32_t i = 0; i < n; i++)
        c += (int32_t)(b[i] & MAG) >= t;
    return c;
}

/* The greatest finite magnitude, -1 when every element is NaN or inf. */
VECTOR_CLONES static int32_t
max_finite(const uint32_t *b, int32_t n)
{
    int32_t h = -1;
    for (int32_t i = 0; i < n; i++) {
        int32_t m = (int32_t)(b[i] & MAG);
        m = m < INF_BITS ? m : -1;
        h = m > h ? m : h;
    }
    return h;
}

/* Fold one block into `a`. `fused`: count FP16 flushes in the extremes pass, because the previous block
 * had some (Adam's first moments have them in every block); returns whether this block had some. */
static int
scan_block(const uint32_t *b, int32_t k, const int32_t lim[4], int fused, acc_t *a)
{
    int32_t hi, mn, nz;
    int32_t c16 = extremes(b, k, fused ? lim[1] : -1, &hi, &mn, &nz);
    int32_t zeros = mn == 0 ? count_le(b, k, 0) : 0;
    int32_t nonfinite = 0;
    if (hi >= INF_BITS) {
        int32_t nan = count_ge(b, k, INF_BITS + 1);
        nonfinite = count_ge(b, k, INF_BITS);
        a->nan += nan;
        a->inf += nonfinite - nan;
        hi = max_finite(b, k);
    }
    a->zeros += zeros;
    a->hi = hi > a->hi ? hi : a->hi;
    if (nz != MAG && nz + 1 < INF_BITS && nz + 1 < a->lo)
        a->lo = nz + 1;
    if (hi >= lim[0]) {
        a->o16 += count_ge(b, k, lim[0]) - nonfinite;
        if (hi >= lim[2])
            a->obf += count_ge(b, k, lim[2]) - nonfinite;
    }
    /* nz < t: the least non-zero magnitude is <= t, so something flushes. When even the greatest finite
     * one is <= t and nothing is NaN/inf, every non-zero element flushes: no count needed. */
    for (int j = 1; j <= 3; j += 2) {
        int32_t t = lim[j];
        if (nz >= t)
            continue;
        int32_t le = (hi <= t && nonfinite == 0) ? k : (j == 1 && fused) ? c16 : count_le(b, k, t);
        uint64_t n = (uint64_t)(le - zeros);
        if (j == 1)
            a->f16 += n;
        else
            a->fbf += n;
    }
    return nz < lim[1];
}

/* bf16 is the top half of a float32: its magnitude m16 as a float32 pattern is m16 << 16, so m16 <= T >> 16
 * exactly when (m16 << 16) <= T. Its extremes pass runs on 16-bit magnitudes, twice the elements per
 * instruction; only a block that needs a count other than FP16 flushes (a zero, NaN/inf, an overflow, a
 * BF16 flush) is widened into float32 patterns (in L1) and takes the float32 path. */
#define LANES16 64 /* 16-bit lanes; a lane counts at most BLOCK / LANES16 + LANES16 values: fits int16 */

ALWAYS_INLINE void
lane_pass16(const uint16_t *b, size_t full, int16_t t, int count, int16_t *h, int16_t *z, int16_t *c)
{
    for (size_t i = 0; i < full; i += LANES16)
        for (size_t j = 0; j < LANES16; j++) {
            int16_t m = (int16_t)(b[i + j] & 0x7FFF);
            int16_t d = (int16_t)(m - 1);
            h[j] = m > h[j] ? m : h[j];
            z[j] = d < z[j] ? d : z[j];
            if (count)
                c[j] = (int16_t)(c[j] + (m <= t));
        }
}

/* extremes() for bf16 and fp16 data, in 16-bit magnitudes (t: a 16-bit threshold, < 0 for no count). */
VECTOR_CLONES static int32_t
extremes16(const uint16_t *b, int32_t n, int32_t t, int32_t *hi, int32_t *mn, int32_t *nz)
{
    int16_t h[LANES16], z[LANES16], c[LANES16];
    for (int j = 0; j < LANES16; j++) {
        h[j] = 0;
        z[j] = 0x7FFF;
        c[j] = 0;
    }
    const size_t full = (size_t)n - (size_t)n % LANES16; /* size_t: see extremes() */
    if (t < 0)
        lane_pass16(b, full, 0, 0, h, z, c);
    else
        lane_pass16(b, full, (int16_t)t, 1, h, z, c);
    for (size_t i = full; i < (size_t)n; i++) {
        int16_t m = (int16_t)(b[i] & 0x7FFF);
        int16_t d = (int16_t)(m - 1);
        h[0] = m > h[0] ? m : h[0];
        z[0] = d < z[0] ? d : z[0];
        c[0] = (int16_t)(c[0] + (t >= 0 && m <= t));
    }
    int32_t hh = 0, zz = 0x7FFF, cc = 0;
    for (int j = 0; j < LANES16; j++) {
        hh = h[j] > hh ? h[j] : hh;
        zz = z[j] < zz ? z[j] : zz;
        cc += c[j];
    }
    *hi = hh;
    *mn = zz < 0 ? 0 : zz + 1;
    *nz = zz;
    return cc;
}

VECTOR_CLONES static void
widen_bf16(const uint16_t *s, int32_t n, uint32_t *d)
{
    for (int32_t i = 0; i < n; i++)
        d[i] = (uint32_t)s[i] << 16;
}

/* One bf16 block; returns scan_block's `fused` flag (this block had FP16 flushes). */
static int
scan_block_bf16(const uint16_t *s, int32_t k, const int32_t lim[4], int fused, uint32_t *wide, acc_t *a)
{
    int32_t hi, mn, nz;
    int32_t c16 = extremes16(s, k, fused ? lim[1] >> 16 : -1, &hi, &mn, &nz);
    int32_t hi32 = hi << 16, lo32 = (nz + 1) << 16; /* the float32 patterns of those magnitudes */
    int f16 = lo32 <= lim[1], fbf = lo32 <= lim[3];
    /* lim[0] < inf, so hi32 < lim[0] also means finite; a BF16 flush is counted only when all flush */
    if (mn == 0 || hi32 >= lim[0] || (fbf && hi32 > lim[3]) || (f16 && hi32 > lim[1] && !fused)) {
        widen_bf16(s, k, wide);
        return scan_block(wide, k, lim, fused, a);
    }
    a->hi = hi32 > a->hi ? hi32 : a->hi;
    a->lo = lo32 < a->lo ? lo32 : a->lo;
    if (f16)
        a->f16 += (uint64_t)(hi32 <= lim[1] ? k : c16);
    if (fbf)
        a->fbf += (uint64_t)k;
    return f16;
}

/* float16 data cannot overflow FP16 (its finite values are <= 65504) or BF16, and cannot flush in either
 * (its least non-zero magnitude, 2**-24, is above both flush points), so only NaN/inf, zeros and the
 * extremes are left to find: the 16-bit extremes settle a block without a zero or NaN/inf; one with them
 * is counted by rare16(). The magnitudes' bit order is their order, inf is 0x7C00, NaN above it. */
#define F16_INF 0x7C00

/* The float32 bit pattern of a finite float16 magnitude pattern h (exact: float32 holds every float16). */
static int32_t
f16_bits_to_f32(int32_t h)
{
    int32_t e = h >> 10, m = h & 0x3FF;
    if (h == 0)
        return 0;
    if (e == 0) { /* subnormal, m * 2**-24: normalise the mantissa */
        e = 1;
        while (!(m & 0x400)) {
            m <<= 1;
            e--;
        }
        m &= 0x3FF;
    }
    return ((e + 112) << 23) | (m << 13);
}

/* A float16 block with a zero or NaN/inf: every count, branch-free, in 16-bit lanes like extremes16(). */
VECTOR_CLONES static void
rare16(const uint16_t *b, int32_t n, int32_t *zeros, int32_t *nan, int32_t *inf, int32_t *hi, int32_t *lo)
{
    int16_t z[LANES16], na[LANES16], in[LANES16], h[LANES16], l[LANES16];
    for (int j = 0; j < LANES16; j++) {
        z[j] = na[j] = in[j] = 0;
        h[j] = -1;
        l[j] = 0x7FFF;
    }
    const size_t full = (size_t)n - (size_t)n % LANES16;
    for (size_t i = 0; i < (size_t)n; i += LANES16) {
        size_t w = i < full ? LANES16 : (size_t)n - i; /* the ragged tail: one partial group, its own loop */
        for (size_t j = 0; j < w; j++) {
            int16_t m = (int16_t)(b[i + j] & 0x7FFF);
            int16_t fh = m < F16_INF ? m : -1;                          /* candidates for the finite max */
            int16_t fl = (m != 0 && m < F16_INF) ? m : (int16_t)0x7FFF; /* and the least non-zero finite */
            z[j] = (int16_t)(z[j] + (m == 0));
            na[j] = (int16_t)(na[j] + (m > F16_INF));
            in[j] = (int16_t)(in[j] + (m == F16_INF));
            h[j] = fh > h[j] ? fh : h[j];
            l[j] = fl < l[j] ? fl : l[j];
        }
    }
    int32_t zz = 0, nn = 0, ii = 0, hh = -1, ll = 0x7FFF;
    for (int j = 0; j < LANES16; j++) {
        zz += z[j];
        nn += na[j];
        ii += in[j];
        hh = h[j] > hh ? h[j] : hh;
        ll = l[j] < ll ? l[j] : ll;
    }
    *zeros = zz;
    *nan = nn;
    *inf = ii;
    *hi = hh;
    *lo = ll;
}

static int
scan_block_f16(const uint16_t *s, int32_t k, acc_t *a)
{
    int32_t hi, mn, nz, lo;
    extremes16(s, k, -1, &hi, &mn, &nz);
    lo = nz + 1;
    if (mn == 0 || hi >= F16_INF) {
        int32_t z, na, in;
        rare16(s, k, &z, &na, &in, &hi, &lo);
        a->zeros += (uint64_t)z;
        a->nan += (uint64_t)na;
        a->inf += (uint64_t)in;
    }
    if (hi >= 0)
        a->hi = f16_bits_to_f32(hi) > a->hi ? f16_bits_to_f32(hi) : a->hi;
    if (lo < 0x7FFF && f16_bits_to_f32(lo) < a->lo)
        a->lo = f16_bits_to_f32(lo);
    return 0;
}

/* One block (n <= BLOCK) of two float32 tensors of one shape, A and B: how many elements differ (NaN differs
 * from everything, -0 equals +0), sum((B - A)**2) and sum(A**2), in double. Lanes keep separate sums, so the
 * loop vectorizes without reordering any one sum (no -ffast-math); a lane counts at most BLOCK / LANESD. */
#define LANESD 16

VECTOR_CLONES static void
pair_pass(const float *a, const float *b, size_t n, uint64_t *changed, double *dd, double *aa)
{
    double d2[LANESD], a2[LANESD];
    int32_t c[LANESD];
    for (int j = 0; j < LANESD; j++) {
        d2[j] = a2[j] = 0.0;
        c[j] = 0;
    }
    const size_t full = n - n % LANESD;
    for (size_t g = 0; g < full; g += LANESD)
        for (size_t j = 0; j < LANESD; j++) {
            double u = a[g + j], v = b[g + j], d = v - u;
            c[j] += !(a[g + j] == b[g + j]);
            d2[j] += d * d;
            a2[j] += u * u;
        }
    for (size_t g = full; g < n; g++) {
        double u = a[g], v = b[g], d = v - u;
        c[0] += !(a[g] == b[g]);
        d2[0] += d * d;
        a2[0] += u * u;
    }
    uint64_t total = 0;
    double sd = 0.0, sa = 0.0;
    for (int j = 0; j < LANESD; j++) {
        total += (uint64_t)c[j];
        sd += d2[j];
        sa += a2[j];
    }
    *changed = total;
    *dd = sd;
    *aa = sa;
}

/* A and B must be float32 buffers of one length, aligned; otherwise both are released, a ValueError set,
 * and 0 returned. */
static int
check_pair(Py_buffer *va, Py_buffer *vb)
{
    const char *bad = va->len != vb->len ? "A and B differ in length"
                      : va->len % 4 != 0 ? "buffer length is not a multiple of 4 bytes"
                      : ((uintptr_t)va->buf % 4 || (uintptr_t)vb->buf % 4) ? "buffer is not aligned to its 4-byte items"
                      : NULL;
    if (bad == NULL)
        return 1;
    PyBuffer_Release(va);
    PyBuffer_Release(vb);
    PyErr_SetString(PyExc_ValueError, bad);
    return 0;
}

/* The 9-tuple scan_f32 returns (see the top of this file). */
static PyObject *
acc_tuple(const acc_t *a)
{
    return Py_BuildValue("(iiKKKKKKK)", a->hi, a->lo == MAG ? -1 : a->lo,
                         (unsigned long long)a->nan, (unsigned long long)a->inf, (unsigned long long)a->zeros,
                         (unsigned long long)a->o16, (unsigned long long)a->f16,
                         (unsigned long long)a->obf, (unsigned long long)a->fbf);
}

enum { F32, BF16, F16 };

static PyObject *
scan(PyObject *args, int kind)
{
    Py_buffer view;
    unsigned int o16, f16, obf, fbf;
    const Py_ssize_t item = kind == F32 ? 4 : 2;
    const char *fmt = kind == F32 ? "y*IIII:scan_f32" : kind == BF16 ? "y*IIII:scan_bf16" : "y*IIII:scan_f16";
    int bf16 = kind == BF16;
    if (!PyArg_ParseTuple(args, fmt, &view, &o16, &f16, &obf, &fbf))
        return NULL;
    uint32_t *wide = bf16 ? PyMem_Malloc(BLOCK * sizeof(uint32_t)) : NULL;
    /* elements are read as aligned words: a misaligned buffer is refused, never read */
    int misaligned = (uintptr_t)view.buf % (uintptr_t)item != 0;
    if (view.len % item != 0 || misaligned || (bf16 && wide == NULL)) {
        PyBuffer_Release(&view);
        PyMem_Free(wide);
        if (view.len % item != 0)
            PyErr_Format(PyExc_ValueError, "buffer length %zd is not a multiple of %zd bytes", view.len, item);
        else if (misaligned)
            PyErr_Format(PyExc_ValueError, "buffer is not aligned to its %zd-byte items", item);
        else
            PyErr_NoMemory();
        return NULL;
    }
    const int32_t lim[4] = {(int32_t)o16, (int32_t)f16, (int32_t)obf, (int32_t)fbf};
    Py_ssize_t n = view.len / item;
    acc_t a = {-1, MAG, 0, 0, 0, 0, 0, 0, 0};
    int fused = 0; /* per block: what the previous block leaves the next (see scan_block, scan_block_bf16) */
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i += BLOCK) {
        int32_t k = (int32_t)(n - i < BLOCK ? n - i : BLOCK);
        if (kind == BF16)
            fused = scan_block_bf16((const uint16_t *)view.buf + i, k, lim, fused, wide, &a);
        else if (kind == F16)
            fused = scan_block_f16((const uint16_t *)view.buf + i, k, &a);
        else
            fused = scan_block((const uint32_t *)view.buf + i, k, lim, fused, &a);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    PyMem_Free(wide);
    return acc_tuple(&a);
}

static PyObject *
scan_f32(PyObject *self, PyObject *args)
{
    (void)self;
    return scan(args, F32);
}

static PyObject *
scan_bf16(PyObject *self, PyObject *args)
{
    (void)self;
    return scan(args, BF16);
}

static PyObject *
scan_f16(PyObject *self, PyObject *args)
{
    (void)self;
    return scan(args, F16);
}

/* scan_f32 of A, scan_f32 of B and pair_pass of both, block by block: each block is read from memory once
 * and the other passes find it in L1. */
static PyObject *
scan_pair_f32(PyObject *self, PyObject *args)
{
    (void)self;
    Py_buffer va, vb;
    unsigned int o16, f16, obf, fbf;
    if (!PyArg_ParseTuple(args, "y*y*IIII:scan_pair_f32", &va, &vb, &o16, &f16, &obf, &fbf))
        return NULL;
    if (!check_pair(&va, &vb))
        return NULL;
    const int32_t lim[4] = {(int32_t)o16, (int32_t)f16, (int32_t)obf, (int32_t)fbf};
    const uint32_t *a = (const uint32_t *)va.buf, *b = (const uint32_t *)vb.buf;
    Py_ssize_t n = va.len / 4;
    acc_t sa = {-1, MAG, 0, 0, 0, 0, 0, 0, 0}, sb = sa;
    int fa = 0, fb = 0;
    uint64_t changed = 0;
    double dd = 0.0, aa = 0.0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i += BLOCK) {
        int32_t k = (int32_t)(n - i < BLOCK ? n - i : BLOCK);
        uint64_t c;
        double d2, a2;
        fa = scan_block(a + i, k, lim, fa, &sa);
        fb = scan_block(b + i, k, lim, fb, &sb);
        pair_pass((const float *)(a + i), (const float *)(b + i), (size_t)k, &c, &d2, &a2);
        changed += c;
        dd += d2;
        aa += a2;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&va);
    PyBuffer_Release(&vb);
    PyObject *ta = acc_tuple(&sa), *tb = acc_tuple(&sb);
    PyObject *out = (ta && tb) ? Py_BuildValue("(OOKdd)", ta, tb, (unsigned long long)changed, dd, aa) : NULL;
    Py_XDECREF(ta);
    Py_XDECREF(tb);
    return out;
}

static PyMethodDef methods[] = {
    {"scan_f32", scan_f32, METH_VARARGS, "Range statistics of float32 data as bit patterns (see _scan.c)."},
    {"scan_bf16", scan_bf16, METH_VARARGS, "scan_f32 for bfloat16 data (2-byte items), in float32 terms."},
    {"scan_f16", scan_f16, METH_VARARGS, "scan_f32 for float16 data (2-byte items), in float32 terms."},
    {"scan_pair_f32", scan_pair_f32, METH_VARARGS, "(scan_f32(A), scan_f32(B), changed, sum((B-A)**2), sum(A**2)) in one read."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_scan", "The compiled float32/bfloat16/float16 range scan.",
                                     -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC
PyInit__scan(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "BLOCK", BLOCK) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
