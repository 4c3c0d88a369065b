/* The float32 range scan of `analyzer inspect` in one read of memory: optional, with a numpy fallback.
 *
 * scan_f32(buffer, fp16_overflow, fp16_flush, bf16_overflow, bf16_flush) -> 9 ints
 *   buffer: C-contiguous float32 data (any object with the buffer protocol: a numpy array, a memoryview);
 *   the four thresholds: the float32 bit patterns of the magnitudes in analyzer/_tensorstats.py.
 * Returns (hi, lo, nan, inf, zeros, fp16_overflow, fp16_flush, bf16_overflow, bf16_flush):
 *   hi: the bit pattern of the greatest finite magnitude, -1 when no element is finite;
 *   lo: the bit pattern of the least non-zero finite magnitude, -1 when there is none;
 *   the counts as _tensorstats.TensorStats defines them (overflows count finite values only).
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
#if !defined(AMP_AUTOPSY_NO_CLONES) && defined(__x86_64__) && !defined(__APPLE__) && \
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

static PyObject *
scan_f32(PyObject *self, PyObject *args)
{
    Py_buffer view;
    unsigned int o16, f16, obf, fbf;
    if (!PyArg_ParseTuple(args, "y*IIII:scan_f32", &view, &o16, &f16, &obf, &fbf))
        return NULL;
    if (view.len % 4 != 0) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "scan_f32: buffer length is not a multiple of 4 bytes");
        return NULL;
    }
    const int32_t lim[4] = {(int32_t)o16, (int32_t)f16, (int32_t)obf, (int32_t)fbf};
    const uint32_t *b = (const uint32_t *)view.buf;
    Py_ssize_t n = view.len / 4;
    acc_t a = {-1, MAG, 0, 0, 0, 0, 0, 0, 0};
    int fused = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i += BLOCK)
        fused = scan_block(b + i, (int32_t)(n - i < BLOCK ? n - i : BLOCK), lim, fused, &a);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    return Py_BuildValue("(iiKKKKKKK)", a.hi, a.lo == MAG ? -1 : a.lo,
                         (unsigned long long)a.nan, (unsigned long long)a.inf, (unsigned long long)a.zeros,
                         (unsigned long long)a.o16, (unsigned long long)a.f16,
                         (unsigned long long)a.obf, (unsigned long long)a.fbf);
}

static PyMethodDef methods[] = {
    {"scan_f32", scan_f32, METH_VARARGS, "Range statistics of float32 data as bit patterns (see _scan.c)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_scan", "The compiled float32 range scan.", -1, methods};

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
