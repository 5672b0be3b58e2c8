/* One decode step of attention in C: one new query token per sequence, each sequence over
 * its own float32 KV buffer, grouped query heads (GQA) sharing a KV head.
 *
 * For sequence b, KV head h and each of its g query heads j:
 *     s_t = (q_j . K_t) / sqrt(D)      t = 0 .. T_b - 1
 *     out_j = sum_t softmax(s)_t V_t
 * K and V are read once per KV head (all g queries share each row), which is what a
 * decode step is bound by: `scaled_dot_product_attention` makes one call per sequence and
 * layer and reads the rows in small GEMM blocks.
 *
 * NOTE: the AVX2 + FMA kernel is compiled for that target alone (the rest of the module
 * for the build's baseline) and runs only where the CPU has both; elsewhere `attend`
 * raises and the Python side (pd_cache/model/layers.py) keeps torch's kernel. That side
 * also checks this kernel against torch's at import.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define TARGET __attribute__((target("avx2,fma")))

/* e^x for x <= 0 (scores after the maximum is taken off), 8 lanes: x = n ln2 + r,
 * e^r by the minimax polynomial of Cephes' expf, 2^n through the exponent bits. */
TARGET static inline __m256 exp_neg(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                   _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

TARGET static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* The 8 sums of 8 vectors, lane i of the result being the sum of a[i]'s lanes. */
TARGET static inline __m256 hsum8(const __m256 *a) {
    __m256 h01 = _mm256_hadd_ps(a[0], a[1]), h23 = _mm256_hadd_ps(a[2], a[3]);
    __m256 h45 = _mm256_hadd_ps(a[4], a[5]), h67 = _mm256_hadd_ps(a[6], a[7]);
    __m256 lo = _mm256_hadd_ps(h01, h23), hi = _mm256_hadd_ps(h45, h67);
    return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20),
                         _mm256_permute2f128_ps(lo, hi, 0x31));
}

/* The 8-lane partial products of query q and row `row` (D = 8 * nv floats each): their
 * lanes sum to the dot product. */
TARGET static inline __attribute__((always_inline)) __m256
dot_lanes(const float *q, const float *row, const int nv) {
    __m256 a = _mm256_mul_ps(_mm256_loadu_ps(q), _mm256_loadu_ps(row));
    for (int c = 1; c < nv; c++)
        a = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * c), _mm256_loadu_ps(row + 8 * c), a);
    return a;
}

/* One KV head of one sequence: queries q[g][D] -> out[g][D]; rows t of K and V at
 * k + t * stride (floats); scratch holds g * T scores. D is a multiple of 8, at most 128.
 * Tokens go in blocks that stay in L1 while every query of the group reads them. */
TARGET static inline __attribute__((always_inline)) void
attend_head(const float *q, float *out, const float *k, const float *v, Py_ssize_t T,
            Py_ssize_t stride, int g, const int D, float *scores) {
    const int nv = D / 8;
    const float scale = 1.0f / sqrtf((float)D);
    const __m256 vscale = _mm256_set1_ps(scale);
    Py_ssize_t t = 0;
    /* NOTE: rows are fetched ahead with the non-temporal hint: a step streams every
     * sequence's KV once (more than the L3 of a small machine), and kept out of the caches
     * it evicts less of the weights the step's linear layers read next (a step of `small`
     * at batch 8 about 5% cheaper). */
    for (; t + 8 <= T; t += 8) {
        for (int u = 0; u < 8; u++)
            for (int c = 0; c < D; c += 16)
                _mm_prefetch((const char *)(k + (t + 32 + u) * stride + c), _MM_HINT_NTA);
        for (int j = 0; j < g; j++) {
            const float *qj = q + (Py_ssize_t)j * D;
            __m256 acc[8];
            for (int u = 0; u < 8; u++)
                acc[u] = dot_lanes(qj, k + (t + u) * stride, nv);
            _mm256_storeu_ps(scores + (Py_ssize_t)j * T + t, _mm256_mul_ps(hsum8(acc), vscale));
        }
    }
    for (; t < T; t++) {
        const float *row = k + t * stride;
        for (int j = 0; j < g; j++)
            scores[(Py_ssize_t)j * T + t] = hsum(dot_lanes(q + (Py_ssize_t)j * D, row, nv)) * scale;
    }
    float inv[g];
    for (int j = 0; j < g; j++) {   /* softmax's numerators in place; their sum's inverse */
        float *s = scores + (Py_ssize_t)j * T;
        __m256 vm = _mm256_set1_ps(-INFINITY);
        Py_ssize_t i = 0;
        for (; i + 8 <= T; i += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(s + i));
        float m = -INFINITY, lanes[8];
        _mm256_storeu_ps(lanes, vm);
        for (int r = 0; r < 8; r++) m = lanes[r] > m ? lanes[r] : m;
        for (Py_ssize_t r = i; r < T; r++) m = s[r] > m ? s[r] : m;
        vm = _mm256_set1_ps(m);
        __m256 vsum = _mm256_setzero_ps();
        for (i = 0; i + 8 <= T; i += 8) {
            __m256 e = exp_neg(_mm256_sub_ps(_mm256_loadu_ps(s + i), vm));
            _mm256_storeu_ps(s + i, e);
            vsum = _mm256_add_ps(vsum, e);
        }
        float sum = hsum(vsum);
        if (i < T) {
            float tail[8];
            for (int r = 0; r < 8; r++) tail[r] = i + r < T ? s[i + r] - m : -INFINITY;
            _mm256_storeu_ps(tail, exp_neg(_mm256_loadu_ps(tail)));
            for (Py_ssize_t r = i; r < T; r++) { s[r] = tail[r - i]; sum += tail[r - i]; }
        }
        inv[j] = 1.0f / sum;
    }
    /* out_j = sum_t p_j[t] V_t: blocks of rows, two queries at a time over each block */
    for (Py_ssize_t r = 0; r < (Py_ssize_t)g * D; r++) out[r] = 0.0f;
    for (Py_ssize_t t0 = 0; t0 < T; t0 += 64) {
        const Py_ssize_t t1 = t0 + 64 < T ? t0 + 64 : T;
        for (int j = 0; j < g; j += 2) {
            const int two = j + 1 < g;
            const float *p0 = scores + (Py_ssize_t)j * T, *p1 = p0 + (two ? T : 0);
            float *o0 = out + (Py_ssize_t)j * D, *o1 = o0 + (two ? D : 0);
            __m256 a0[16], a1[16];
            for (int c = 0; c < nv; c++) {
                a0[c] = _mm256_loadu_ps(o0 + 8 * c);
                a1[c] = _mm256_loadu_ps(o1 + 8 * c);
            }
            for (Py_ssize_t tt = t0; tt < t1; tt++) {
                const float *row = v + tt * stride;
                if (j == 0)
                    for (int c = 0; c < D; c += 16)
                        _mm_prefetch((const char *)(row + 32 * stride + c), _MM_HINT_NTA);
                __m256 w0 = _mm256_set1_ps(p0[tt]), w1 = _mm256_set1_ps(p1[tt]);
                for (int c = 0; c < nv; c++) {
                    __m256 x = _mm256_loadu_ps(row + 8 * c);
                    a0[c] = _mm256_fmadd_ps(w0, x, a0[c]);
                    a1[c] = _mm256_fmadd_ps(w1, x, a1[c]);
                }
            }
            for (int c = 0; c < nv; c++) {
                if (two) _mm256_storeu_ps(o1 + 8 * c, a1[c]);
                _mm256_storeu_ps(o0 + 8 * c, a0[c]);
            }
        }
    }
    for (int j = 0; j < g; j++) {
        __m256 w = _mm256_set1_ps(inv[j]);
        for (int c = 0; c < nv; c++) {
            float *o = out + (Py_ssize_t)j * D + 8 * c;
            _mm256_storeu_ps(o, _mm256_mul_ps(w, _mm256_loadu_ps(o)));
        }
    }
}

/* One copy per head size, so that its vector count is a constant: the accumulators stay in
 * registers and the loops over them unroll. */
#define HEAD(d) \
    TARGET static void attend_head_##d(const float *q, float *out, const float *k, \
                                       const float *v, Py_ssize_t T, Py_ssize_t stride, \
                                       int g, int D, float *scores) { \
        attend_head(q, out, k, v, T, stride, g, d, scores); \
    }
HEAD(32)
HEAD(64)
HEAD(128)
TARGET static void attend_head_any(const float *q, float *out, const float *k, const float *v,
                                   Py_ssize_t T, Py_ssize_t stride, int g, int D, float *scores) {
    attend_head(q, out, k, v, T, stride, g, D, scores);
}

static int pointers(PyObject *seq, Py_ssize_t n, uintptr_t *out, const char *what) {
    PyObject *fast = PySequence_Fast(seq, what);
    if (fast == NULL) return -1;
    if (PySequence_Fast_GET_SIZE(fast) != n) {
        PyErr_Format(PyExc_ValueError, "attend: %s: expected %zd items", what, n);
        Py_DECREF(fast);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        out[i] = (uintptr_t)PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(fast, i));
        if (PyErr_Occurred()) { Py_DECREF(fast); return -1; }
    }
    Py_DECREF(fast);
    return 0;
}

/* attend(q, out, ks, vs, lens, kv_heads, group, head_dim, stride): the addresses of
 * q and out [B, kv_heads * group, head_dim] (contiguous float32), of each sequence's K and
 * V rows (token t at + t * stride floats, head h at + h * head_dim), their lengths. */
static PyObject *attend(PyObject *self, PyObject *args) {
    unsigned long long qa, oa;
    PyObject *ks, *vs, *lens;
    int kv_heads, g, D;
    Py_ssize_t stride;
    if (!PyArg_ParseTuple(args, "KKOOOiiin", &qa, &oa, &ks, &vs, &lens, &kv_heads, &g, &D,
                          &stride))
        return NULL;
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) {
        PyErr_SetString(PyExc_RuntimeError, "attend: this CPU has no AVX2 and FMA");
        return NULL;
    }
    if (D % 8 || D > 128 || kv_heads < 1 || g < 1 || stride < (Py_ssize_t)kv_heads * D) {
        PyErr_SetString(PyExc_ValueError, "attend: head_dim must be a multiple of 8 up to "
                                          "128, and the row stride hold every head");
        return NULL;
    }
    Py_ssize_t B = PySequence_Size(lens);
    if (B < 0) return NULL;
    uintptr_t *buf = PyMem_Malloc(3 * (B ? B : 1) * sizeof(uintptr_t));
    if (buf == NULL) return PyErr_NoMemory();
    uintptr_t *kp = buf, *vp = buf + B, *tn = buf + 2 * B;
    Py_ssize_t most = 1;
    if (pointers(ks, B, kp, "ks") || pointers(vs, B, vp, "vs") || pointers(lens, B, tn, "lens")) {
        PyMem_Free(buf);
        return NULL;
    }
    for (Py_ssize_t b = 0; b < B; b++) {
        if (tn[b] < 1) {
            PyMem_Free(buf);
            PyErr_SetString(PyExc_ValueError, "attend: every sequence has at least one key");
            return NULL;
        }
        most = (Py_ssize_t)tn[b] > most ? (Py_ssize_t)tn[b] : most;
    }
    float *scores = PyMem_RawMalloc((size_t)g * most * sizeof(float));
    if (scores == NULL) { PyMem_Free(buf); return PyErr_NoMemory(); }
    const float *q = (const float *)(uintptr_t)qa;
    float *out = (float *)(uintptr_t)oa;
    const Py_ssize_t H = (Py_ssize_t)kv_heads * g;
    void (*head)(const float *, float *, const float *, const float *, Py_ssize_t, Py_ssize_t,
                 int, int, float *) =
        D == 32 ? attend_head_32 : D == 64 ? attend_head_64 : D == 128 ? attend_head_128
                                                                      : attend_head_any;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t b = 0; b < B; b++)
        for (int h = 0; h < kv_heads; h++)
            head(q + (b * H + (Py_ssize_t)h * g) * D, out + (b * H + (Py_ssize_t)h * g) * D,
                        (const float *)kp[b] + (Py_ssize_t)h * D,
                        (const float *)vp[b] + (Py_ssize_t)h * D,
                        (Py_ssize_t)tn[b], stride, g, D, scores);
    Py_END_ALLOW_THREADS
    PyMem_RawFree(scores);
    PyMem_Free(buf);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"attend", attend, METH_VARARGS,
     "One decode step of grouped-query attention over float32 KV rows, in place."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_attend", NULL, -1, methods};

PyMODINIT_FUNC PyInit__attend(void) { return PyModule_Create(&module); }
