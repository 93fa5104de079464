/* stream_st.core._sums: the sums of F16, BF16 and F32 values, widened exactly, in one pass.
 *
 * sums(values, kind, shift, portable=False) -> (s1, s2): for a C-contiguous buffer of float
 * values of safetensors dtype kind ("F16", "BF16" or "F32"), all finite, the sum of (x - shift)
 * and the sum of (x - shift)**2 over its values x, in double. Each value is taken as a float32
 * (exact: every F16 and BF16 value is one) and widened to double; the subtraction is the only
 * rounding before the sums, which run in 16 double accumulators over blocks of BLOCK values, the
 * blocks' totals added in order: the rounding error stays that of a sum of a few hundred terms.
 *
 * The work runs with the GIL released: the validator's worker threads summarise parts of a file
 * on every core at once. On x86-64 CPUs with AVX2, FMA and F16C (checked at run time) F16 is
 * widened by the CPU's conversion instruction, 8 values at a time; elsewhere, and with
 * portable=True, by moving its bits (the same values; tests compare both with numpy).
 *
 * The module uses the stable ABI of Python 3.11 (Py_buffer is part of it from then on), and GCC's
 * or Clang's vector extensions: other compilers fail to build it, and stream_st.core.moments then
 * computes the same sums with numpy. It is optional at install time for that reason.
 */
#define Py_LIMITED_API 0x030B0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>
#define HAVE_F16C_PATH 1
#endif

#define BLOCK 1024 /* values widened into float32 scratch, then summed: 4 KiB, in L1 */
#define INLINE static inline __attribute__((always_inline))

typedef double v4d __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));
typedef void widen_fn(const unsigned char *bits, ptrdiff_t n, float *out);

INLINE float as_float(uint32_t bits) {
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* The 16-bit pattern at p, which need not be aligned (a tensor may start at any byte). */
INLINE uint32_t load16(const unsigned char *p) {
    uint16_t bits;
    memcpy(&bits, p, sizeof bits);
    return bits;
}

INLINE uint32_t bits_of(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    return bits;
}

/* F16 as float32 by its bits: the exponent rebiased (15 to 127) and the mantissa moved up 13
   places; a subnormal F16 (exponent 0) comes out as 2**-14 * (1 + m/1024), from which 2**-14 is
   taken (exactly), leaving m * 2**-24. No branch: the compiler makes it vector code. */
static void widen_f16(const unsigned char *bits, ptrdiff_t n, float *out) {
    for (ptrdiff_t i = 0; i < n; i++) {
        uint32_t x = load16(bits + 2 * i);
        uint32_t subnormal = -(uint32_t)((x & 0x7c00u) == 0);
        uint32_t wide = ((x & 0x7fffu) << 13) + (112u << 23) + (subnormal & (1u << 23));
        float value = as_float(wide) - as_float(subnormal & (113u << 23));
        out[i] = as_float(bits_of(value) | ((x & 0x8000u) << 16));
    }
}

/* F32 as it is (the copy into the block's scratch also takes it from any alignment). */
static void widen_f32(const unsigned char *bits, ptrdiff_t n, float *out) {
    memcpy(out, bits, (size_t)n * sizeof *out);
}

/* BF16 is the upper half of a float32. */
static void widen_bf16(const unsigned char *bits, ptrdiff_t n, float *out) {
    for (ptrdiff_t i = 0; i < n; i++) out[i] = as_float(load16(bits + 2 * i) << 16);
}

INLINE void sums(widen_fn *widen, size_t width, const unsigned char *bits, ptrdiff_t n,
                 double shift, double *s1, double *s2) {
    float scratch[BLOCK] __attribute__((aligned(32)));
    v4d k = {shift, shift, shift, shift};
    double t1 = 0.0, t2 = 0.0;
    for (ptrdiff_t at = 0; at < n; at += BLOCK) {
        ptrdiff_t count = n - at < BLOCK ? n - at : BLOCK;
        ptrdiff_t whole = count & ~(ptrdiff_t)15;
        widen(bits + width * (size_t)at, count, scratch);
        v4d a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, q0 = {0}, q1 = {0}, q2 = {0}, q3 = {0};
        for (ptrdiff_t i = 0; i < whole; i += 16) {
            v4f f0, f1, f2, f3;
            memcpy(&f0, scratch + i, sizeof f0);
            memcpy(&f1, scratch + i + 4, sizeof f1);
            memcpy(&f2, scratch + i + 8, sizeof f2);
            memcpy(&f3, scratch + i + 12, sizeof f3);
            v4d x0 = __builtin_convertvector(f0, v4d) - k;
            v4d x1 = __builtin_convertvector(f1, v4d) - k;
            v4d x2 = __builtin_convertvector(f2, v4d) - k;
            v4d x3 = __builtin_convertvector(f3, v4d) - k;
            a0 += x0, a1 += x1, a2 += x2, a3 += x3;
            q0 += x0 * x0, q1 += x1 * x1, q2 += x2 * x2, q3 += x3 * x3;
        }
        v4d a = (a0 + a1) + (a2 + a3), q = (q0 + q1) + (q2 + q3);
        double b1 = (a[0] + a[1]) + (a[2] + a[3]), b2 = (q[0] + q[1]) + (q[2] + q[3]);
        for (ptrdiff_t i = whole; i < count; i++) {
            double x = (double)scratch[i] - shift;
            b1 += x, b2 += x * x;
        }
        t1 += b1, t2 += b2;
    }
    *s1 = t1, *s2 = t2;
}

enum kind { F16, BF16, F32 };

static const size_t widths[] = {2, 2, 4};

static void sums_portable(enum kind kind, const unsigned char *bits, ptrdiff_t n, double shift,
                          double *s1, double *s2) {
    widen_fn *widen[] = {widen_f16, widen_bf16, widen_f32};
    sums(widen[kind], widths[kind], bits, n, shift, s1, s2);
}

#ifdef HAVE_F16C_PATH
#define V3 __attribute__((target("avx2,fma,f16c")))

V3 static void widen_f16_f16c(const unsigned char *bits, ptrdiff_t n, float *out) {
    ptrdiff_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i,
                         _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(bits + 2 * i))));
    for (; i < n; i++) out[i] = _cvtsh_ss((unsigned short)load16(bits + 2 * i));
}

V3 static void sums_avx2(enum kind kind, const unsigned char *bits, ptrdiff_t n, double shift,
                         double *s1, double *s2) {
    /* BF16 and F32 are widened as on the portable path (a shift, a copy: as fast either way) */
    widen_fn *widen[] = {widen_f16_f16c, widen_bf16, widen_f32};
    sums(widen[kind], widths[kind], bits, n, shift, s1, s2);
}

static int has_avx2(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
}
#else
static int has_avx2(void) { return 0; }
#endif

static int fast; /* whether the AVX2 path runs here: set once, at import */

static PyObject *py_sums(PyObject *module, PyObject *args) {
    Py_buffer view;
    const char *name;
    int portable = 0;
    double shift, s1, s2;
    enum kind kind;
    (void)module;
    if (!PyArg_ParseTuple(args, "y*sd|p:sums", &view, &name, &shift, &portable)) return NULL;
    if (!strcmp(name, "F16"))
        kind = F16;
    else if (!strcmp(name, "BF16"))
        kind = BF16;
    else if (!strcmp(name, "F32"))
        kind = F32;
    else {
        PyBuffer_Release(&view);
        PyErr_Format(PyExc_ValueError, "sums: kind '%s' is not F16, BF16 or F32", name);
        return NULL;
    }
    if ((size_t)view.len % widths[kind]) {
        PyBuffer_Release(&view);
        PyErr_Format(PyExc_ValueError, "sums: %zd bytes are not a whole number of %s values",
                     view.len, name);
        return NULL;
    }
    const unsigned char *bits = view.buf;
    ptrdiff_t n = (ptrdiff_t)((size_t)view.len / widths[kind]);
    Py_BEGIN_ALLOW_THREADS
#ifdef HAVE_F16C_PATH
    if (fast && !portable)
        sums_avx2(kind, bits, n, shift, &s1, &s2);
    else
#endif
        sums_portable(kind, bits, n, shift, &s1, &s2);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    return Py_BuildValue("(dd)", s1, s2);
}

static PyObject *py_path(PyObject *module, PyObject *unused) {
    (void)module, (void)unused;
    return PyUnicode_FromString(fast ? "avx2" : "portable");
}

static PyMethodDef methods[] = {
    {"sums", py_sums, METH_VARARGS,
     "sums(values, kind, shift, portable=False) -> (s1, s2): the sums of (x - shift) and its "
     "square over the finite values of dtype kind (F16, BF16 or F32) that fill the buffer."},
    {"path", py_path, METH_NOARGS,
     "path() -> 'avx2' or 'portable': how sums widens and adds on this CPU."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    "stream_st.core._sums",
    "The sums of F16, BF16 and F32 values in one pass, GIL released (see stream_st.core.moments).",
    -1,
    methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC PyInit__sums(void) {
    fast = has_avx2();
    return PyModule_Create(&module);
}
