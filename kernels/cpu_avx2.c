/* The fp32 small-row linear for x86 CPUs with AVX2 and FMA but no AVX-512 (most laptops and desktops: Intel's
 * client cores since Alder Lake, AMD before Zen 4): out[m, n] = sum_k x[m, k] w[n, k] (+ bias[n]), fp32.
 *
 * Built and loaded by kernels/cpu/builds.py where kernels/cpu.c (AVX-512) cannot run, or where SPECVOCAB_CPU_ISA=avx2
 * asks for it; its plain-torch reference is kernels/cpu/ops/linear.py's `linear_reference`. It is
 * kernels/cpu.c's `sv_linear_f32` at half the width: the same packed layout with 8-float chunks
 * ([ceil(N / NB)][ceil(K / 8)][NB][8] fp32, zero-padded: a block of NB outputs streams in one sequential pass),
 * the same prefetch schedule (PF_DIST bytes ahead into L2, spread over every row tile's pass of a block), row
 * tiles of 3, 2 and 1 (12 accumulators: AVX2 has 16 registers, not 32).
 *
 * Row invariance by construction (engine.native rule 1): every output (m, n) is accumulated in its own 8-lane
 * register by one FMA per K chunk, chunks in order, then reduced by one fixed tree (`hsum4x8`). Nothing in that
 * sequence depends on M, on the other rows, on which rows share a tile, or on the thread count (threads split the
 * output blocks, never K). So a token's row has the same bits in a 1-row forward and inside any tree, and a
 * decode in fp32 runs every step at exactly its tree's rows (oneDNN's fp32 GEMM gives rows 1-3 of a product
 * other bits than inside a larger one: without this kernel every step is padded to 4 rows). Its bits differ
 * from the AVX-512 kernel's (another sum order); a decode uses one of them for all its forwards.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stddef.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "cpu_portable.c"   /* no vector code: UniSpec's tree, the window step, the top-k insertion */

#define NB 4           /* outputs per block (weight rows streamed together) */
#define CH 8           /* K elements per chunk (one 256-bit register of fp32) */
#define PF_DIST 8192   /* bytes the prefetches run ahead of the packed weight stream (into L2) */

int sv2_block_outputs(void) { return NB; }
int sv2_chunk(void) { return CH; }

/* lane j < 4 of the result = the sum of v_j's eight lanes e0..e7, always as ((e0 + e2) + (e1 + e3)) +
 * ((e4 + e6) + (e5 + e7)): in-lane unpacks and adds, then the two 128-bit halves. Each sum's order is the
 * same whatever the other three registers hold. */
static inline __m128 hsum4x8(__m256 v0, __m256 v1, __m256 v2, __m256 v3) {
    const __m256 a0 = _mm256_add_ps(_mm256_unpacklo_ps(v0, v1), _mm256_unpackhi_ps(v0, v1));
    const __m256 a1 = _mm256_add_ps(_mm256_unpacklo_ps(v2, v3), _mm256_unpackhi_ps(v2, v3));
    const __m256d x = _mm256_castps_pd(a0), y = _mm256_castps_pd(a1);
    const __m256 b = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)),
                                   _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
    return _mm_add_ps(_mm256_castps256_ps128(b), _mm256_extractf128_ps(b, 1));
}

/* this pass's share of the next PF_DIST bytes of the stream: ps bytes per chunk, one line at a time */
#define PREFETCH(c) do { const char* q_ = pf + (size_t)(c) * ps; \
    for (int o_ = 0; o_ < ps; o_ += 64) _mm_prefetch(q_ + o_, _MM_HINT_T1); } while (0)

/* R rows (1..3) x NB outputs over kc chunks, the last one partial when it is masked (tail lanes zero in x; the
 * packed weight is zero-padded there). r[i][j] = the sum for row i, output j. */
static inline __attribute__((always_inline)) void tile(const int R, const float* x, int K, const float* wb, int kc,
                                                       int full, __m256i tail, float r[3][NB], const char* pf,
                                                       int ps) {
    __m256 a[3][NB];
    for (int i = 0; i < R; i++)
        for (int j = 0; j < NB; j++) a[i][j] = _mm256_setzero_ps();
    for (int c = 0; c < kc; c++) {
        __m256 v[3];
        for (int i = 0; i < R; i++) {
            const float* p = x + (size_t)i * K + (size_t)c * CH;
            v[i] = c < full ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, tail);
        }
        const float* wc = wb + (size_t)c * NB * CH;
        PREFETCH(c);
        for (int j = 0; j < NB; j++) {
            const __m256 w = _mm256_loadu_ps(wc + j * CH);
            for (int i = 0; i < R; i++) a[i][j] = _mm256_fmadd_ps(v[i], w, a[i][j]);
        }
    }
    for (int i = 0; i < R; i++) _mm_storeu_ps(r[i], hsum4x8(a[i][0], a[i][1], a[i][2], a[i][3]));
}

static void tile3(const float* x, int K, const float* wb, int kc, int full, __m256i tail, float r[3][NB],
                  const char* pf, int ps) { tile(3, x, K, wb, kc, full, tail, r, pf, ps); }
static void tile2(const float* x, int K, const float* wb, int kc, int full, __m256i tail, float r[3][NB],
                  const char* pf, int ps) { tile(2, x, K, wb, kc, full, tail, r, pf, ps); }
static void tile1(const float* x, int K, const float* wb, int kc, int full, __m256i tail, float r[3][NB],
                  const char* pf, int ps) { tile(1, x, K, wb, kc, full, tail, r, pf, ps); }

#define TILE_ROWS(left) ((left) == 4 ? 2 : (left) >= 3 ? 3 : (left))

static void blocks(const float* x, const float* wp, const float* bias, float* out, int M, int N, int K, int b0,
                   int b1) {
    const int kc = (K + CH - 1) / CH, rem = K % CH, full = rem ? kc - 1 : kc;
    int lanes[CH];
    for (int l = 0; l < CH; l++) lanes[l] = l < rem ? -1 : 0;
    const __m256i tail = _mm256_loadu_si256((const __m256i*)lanes);
    int passes = 0;                                  /* the tiles below: 3 rows, but 4 rows as 2 + 2 (a 1-row */
    for (int m = 0; m < M; m += TILE_ROWS(M - m)) passes++;       /* tile's 4 FMA chains run at half the rate) */
    const int ps = NB * CH * 4 / passes;       /* a block chunk is NB * CH * 4 bytes; each pass prefetches its share */
    float r[3][NB];
    for (int b = b0; b < b1; b++) {
        const float* wb = wp + (size_t)b * kc * NB * CH;
        const char* pf = (const char*)wb + PF_DIST;
        const int nb = (N - b * NB < NB) ? N - b * NB : NB;
        for (int m = 0; m < M;) {
            const int mb = TILE_ROWS(M - m);
            const float* xm = x + (size_t)m * K;
            if (mb == 3) tile3(xm, K, wb, kc, full, tail, r, pf, ps);
            else if (mb == 2) tile2(xm, K, wb, kc, full, tail, r, pf, ps);
            else tile1(xm, K, wb, kc, full, tail, r, pf, ps);
            pf += (size_t)kc * ps;
            for (int i = 0; i < mb; i++) {                       /* the bias added in fp32, then the nb outputs */
                float* o = out + (size_t)(m + i) * N + (size_t)b * NB;
                for (int j = 0; j < nb; j++) o[j] = bias ? r[i][j] + bias[b * NB + j] : r[i][j];
            }
            m += mb;
        }
    }
}

/* x [M, K] fp32 contiguous; wp packed (above); bias [N] or NULL; out [M, N] fp32. */
void sv2_linear_f32(const float* x, const float* wp, const float* bias, float* out, int M, int N, int K,
                    int threads) {
    const int nblocks = (N + NB - 1) / NB;
    if (threads <= 1) {
        blocks(x, wp, bias, out, M, N, K, 0, nblocks);
        return;
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int t = 0; t < threads; t++) {
        int b0 = (int)((long)nblocks * t / threads), b1 = (int)((long)nblocks * (t + 1) / threads);
        if (b0 < b1) blocks(x, wp, bias, out, M, N, K, b0, b1);
    }
}

/* ---- the exact decode's attention in fp32 (engine.native rules 2 and 3, one row at a time) -------------------
 *
 * kernels/cpu.c's `sv_attention` (its docstring gives the contract) over an fp32 cache: for row r (logical
 * position pos[r]) and each query head, the keys of the row's logical context in logical order - blocks
 * [0, b0) committed (slot = position), then the next tb blocks through idx[r] where ok[r] says the position is
 * in the row's context - a key also hidden when window > 0 and pos[r] - its position >= window. Scores: one FMA
 * chain per key over the head dims in 8-float chunks, reduced by `hsum4x8` (four keys at a time); times scale;
 * their max; the weights exp(s - max) (`exp8`) and their sum, in key order; the output sum of weight x
 * value, one FMA chain per dim over the keys in order; divided by the sum. Everything is a function of the row's
 * logical context alone (not of n, of the other rows, or of where a key lies in the cache), so an `ar` step and
 * any tree give the row the same bits; threads split (row, KV head) pairs. q fp32 [n, H, hd]; kc, vc fp32
 * [kvh, cap, hd]; out fp32 [n, H, hd]; hd % 8 == 0. The torch path it replaces (`_attention_exact`: a dozen
 * small GEMMs and softmax pieces a layer, padded to 4 query rows) took 12 ms of a 49 ms SmolLM2 forward at one
 * row and 41 of 110 at eight. */
#define ABLOCK 32

/* exp(x) for x <= 0 (the attention calls it with s - max): 2^n p(f), n = round(x log2 e), f = x - n ln 2 (two-part
 * ln 2), p Cephes' degree-6 expf polynomial (kernels/cpu.c's `exp_ps` at 8 lanes); x below -87 is taken as -87
 * (its exp, 1.6e-38, is as good as 0 beside the max's weight 1). Fixed operations, so fixed bits. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 f = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    f = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), f);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(f, f), _mm256_add_ps(f, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* out[c] = sum over keys i in order of w[i] v_i[c] for NC (<= 8) chunks of dims from c0: one FMA chain per dim,
 * in registers (NC constant at each call) */
static inline __attribute__((always_inline)) void values(const int NC, int c0, const float* const* vals,
                                                         const float* w, int nk, __m256* o) {
    __m256 a[8];
    for (int c = 0; c < NC; c++) a[c] = _mm256_setzero_ps();
    for (int i = 0; i < nk; i++) {
        const __m256 wi = _mm256_set1_ps(w[i]);
        const float* vr = vals[i] + c0 * CH;
        for (int c = 0; c < NC; c++) a[c] = _mm256_fmadd_ps(wi, _mm256_loadu_ps(vr + c * CH), a[c]);
    }
    for (int c = 0; c < NC; c++) o[c0 + c] = a[c];
}

static void attend_f32(const float* q, const float* kc, const float* vc, const int64_t* pos, const int64_t* idx,
                       const uint8_t* ok, float* out, int r, int j, int H, int kvh, int hd, long cap, int b0,
                       int tb, int window, float scale, const float** keys, const float** vals, float* s, __m256* o) {
    const int g = H / kvh, hc = hd / CH;
    const float* K = kc + (size_t)j * cap * hd;
    const float* V = vc + (size_t)j * cap * hd;
    const long p = pos[r];
    int nk = 0;
    for (long t = 0; t < (long)b0 * ABLOCK; t++)                  /* committed: slot = logical position */
        if (!window || p - t < window) { keys[nk] = K + t * hd; vals[nk] = V + t * hd; nk++; }
    for (int t = 0; t < tb * ABLOCK; t++) {                         /* the tail, through the row's slots */
        const long kp = (long)b0 * ABLOCK + t, slot = idx[(size_t)r * tb * ABLOCK + t];
        if (ok[(size_t)r * tb * ABLOCK + t] && (!window || p - kp < window)) {
            keys[nk] = K + slot * hd; vals[nk] = V + slot * hd; nk++;
        }
    }
    for (int t = 0; t < g; t++) {
        const int h = j * g + t;
        const float* qr = q + ((size_t)r * H + h) * hd;
        float* orow = out + ((size_t)r * H + h) * hd;
        if (!nk) { for (int d = 0; d < hd; d++) orow[d] = NAN; continue; }    /* nothing to attend to */
        float mx = -INFINITY;
        for (int i = 0; i < nk; i += 4) {                          /* scores, four keys at a time */
            const float* kp4[4];
            for (int u = 0; u < 4; u++) kp4[u] = keys[i + u < nk ? i + u : i];   /* past the end: recomputed */
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int c = 0; c < hc; c++) {
                const __m256 x = _mm256_loadu_ps(qr + c * CH);
                a0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(kp4[0] + c * CH), a0);
                a1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(kp4[1] + c * CH), a1);
                a2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(kp4[2] + c * CH), a2);
                a3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(kp4[3] + c * CH), a3);
            }
            float four[4];
            _mm_storeu_ps(four, _mm_mul_ps(hsum4x8(a0, a1, a2, a3), _mm_set1_ps(scale)));
            for (int u = 0; u < 4 && i + u < nk; u++) {
                s[i + u] = four[u];
                if (four[u] > mx) mx = four[u];
            }
        }
        const __m256 mv = _mm256_set1_ps(mx);                      /* the weights (s is padded to 8) */
        for (int i = 0; i < nk; i += 8) _mm256_storeu_ps(s + i, exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), mv)));
        float l = 0.0f;
        for (int i = 0; i < nk; i++) l += s[i];                    /* their sum, keys in order */
        for (int c0 = 0; c0 < hc; c0 += 8) {                       /* values: one chain per dim, keys in order */
            switch (hc - c0 < 8 ? hc - c0 : 8) {
                case 8: values(8, c0, vals, s, nk, o); break;
                case 7: values(7, c0, vals, s, nk, o); break;
                case 6: values(6, c0, vals, s, nk, o); break;
                case 5: values(5, c0, vals, s, nk, o); break;
                case 4: values(4, c0, vals, s, nk, o); break;
                case 3: values(3, c0, vals, s, nk, o); break;
                case 2: values(2, c0, vals, s, nk, o); break;
                default: values(1, c0, vals, s, nk, o); break;
            }
        }
        const __m256 lv = _mm256_set1_ps(l);
        for (int c = 0; c < hc; c++) _mm256_storeu_ps(orow + c * CH, _mm256_div_ps(o[c], lv));
    }
}

/* returns 0, or -1 when its scratch could not be allocated (out is then NaN) */
int sv2_attention_f32(const float* q, const float* kc, const float* vc, const int64_t* pos, const int64_t* idx,
                      const uint8_t* ok, float* out, int n, int H, int kvh, int hd, long cap, int b0, int tb,
                      int window, float scale, int threads) {
    const long most = (long)(b0 + tb) * ABLOCK;
    int failed = 0;
#pragma omp parallel num_threads(threads > 1 && n * kvh > 1 ? threads : 1) reduction(|:failed)
    {
        const float** keys = (const float**)malloc(2 * most * sizeof(float*));
        float* s = (float*)malloc((most + 8) * sizeof(float));   /* scores, then weights; padded for exp8 */
        __m256* o = (__m256*)aligned_alloc(32, (size_t)(hd / CH + 1) * sizeof(__m256));
        if (!keys || !s || !o) failed = 1;
#pragma omp for schedule(static)
        for (int task = 0; task < n * kvh; task++) {
            if (!keys || !s || !o) {
                for (int d = 0; d < (H / kvh) * hd; d++)
                    out[((size_t)(task / kvh) * H + (size_t)(task % kvh) * (H / kvh)) * hd + d] = NAN;
                continue;
            }
            attend_f32(q, kc, vc, pos, idx, ok, out, task / kvh, task % kvh, H, kvh, hd, cap, b0, tb, window,
                       scale, keys, keys + most, s, o);
        }
        free(keys); free(s); free(o);
    }
    return failed ? -1 : 0;
}

/* ---- top-k of fp32 rows (k small), and their log-sum-exp: kernels/cpu.c's `sv_topk_f32` / `sv_topk_lse_f32` at
 * 8 lanes (the verify's argmax and MicroSpec's verify top-k; the successor store's confidences). One pass per row:
 * 8 values at a time compared with the current k-th best, only a lane above it going to the sorted insertion;
 * ties keep the lower index (torch.argmax's first maximum), so the top-k are the AVX-512 build's exactly. The
 * log-sum-exp: one pass of exp(z - max) (`exp8`) summed in fp64, lane by lane, then the lanes in order: the
 * same sum in another order than the AVX-512 build's, so equal to rounding, not bitwise. */
static inline __m256i live8(long left) {
    const int n = left >= 8 ? 8 : (int)left;
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

static int topk_row8(const float* z, long V, int k, float* vals, int64_t* idx) {
    for (int j = 0; j < k; j++) { vals[j] = -INFINITY; idx[j] = -1; }
    __m256 th = _mm256_set1_ps(-INFINITY);
    int nan = 0;
    for (long i = 0; i < V; i += 8) {
        const __m256i live = live8(V - i);
        const __m256 v = _mm256_maskload_ps(z + i, live);
        const int lm = _mm256_movemask_ps(_mm256_castsi256_ps(live));
        nan |= _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)) & lm;
        int up = _mm256_movemask_ps(_mm256_cmp_ps(v, th, _CMP_GT_OQ)) & lm;
        while (up) {
            const int lane = __builtin_ctz(up);
            up &= up - 1;
            const float x = z[i + lane];
            if (!(x > vals[k - 1])) continue;                /* the threshold rose within this vector */
            topk_insert(x, i + lane, k, vals, idx);
            th = _mm256_set1_ps(vals[k - 1]);
        }
    }
    return nan != 0;
}

int sv2_topk_f32(const float* z, int n, long V, int k, float* vals, int64_t* idx, int threads) {
    return topk_rows(topk_row8, z, n, V, k, vals, idx, threads);
}

/* sum of exp(z - mx) over a row: each of the 8 lanes accumulated in fp64 (two fp64 halves), then the lanes */
static double expsum8(const float* zr, long V, float mx) {
    const __m256 mv = _mm256_set1_ps(mx);
    __m256d s0 = _mm256_setzero_pd(), s1 = _mm256_setzero_pd();
    for (long i = 0; i < V; i += 8) {
        const __m256i live = live8(V - i);
        const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_maskload_ps(zr + i, live), mv)),
                                       _mm256_castsi256_ps(live));
        s0 = _mm256_add_pd(s0, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
        s1 = _mm256_add_pd(s1, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
    }
    double lanes[4];
    _mm256_storeu_pd(lanes, _mm256_add_pd(s0, s1));
    return (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
}

int sv2_topk_lse_f32(const float* z, int n, long V, int k, float* vals, int64_t* idx, float* lse, int threads) {
    return topk_lse_rows(topk_row8, expsum8, z, n, V, k, vals, idx, lse, threads);
}


/* ---- one decoder layer in fp32, fused (kernels/cpu.c's `sv_layer` for an fp32 model; its docstring) --------------
 *
 * The same steps in one call - the input norm, the qkv linear, q/k norms, RoPE, the cache write, the attention
 * (`sv2_attention_f32`), the o linear, the post-attention norm and residual, the MLP's norm, gate/up linear,
 * activation and down linear, the post-MLP norm and residual - in fp32 throughout, as the torch layer computes
 * an fp32 model (engine.native `_layer`; reference kernels.cpu.layer_reference). The norms' sums of squares and
 * the activations' exp run in another fixed order than torch's, so the two agree to rounding, not bitwise;
 * every step is per row, so a row's bits depend on that row alone. The weights are packed for `sv2_linear_f32`. */
typedef struct {                       /* kernels/cpu.c `sv_layer_t`, field for field (kernels.cpu.ops.layer._LayerSpec) */
    int d, H, kvh, hd, I, din, gemma_norm, act;
    float eps;
    const float *in_norm, *q_norm, *k_norm, *post_attn_norm, *pre_mlp_norm, *post_mlp_norm;
    const float *qkv, *o, *gate_up, *down;
    const float *qkv_bias;
} sv2_layer_t;

static inline float hsum8(__m256 v) {                 /* ((e0 + e4) + (e2 + e6)) + ((e1 + e5) + (e3 + e7)) */
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    return _mm_cvtss_f32(_mm_add_ss(a, _mm_shuffle_ps(a, a, 1)));
}

/* x [n, width] (row stride xs) -> out (row stride os, may be x): h = x / sqrt(mean(x^2) + eps), then h w */
static void rmsnorm8(const float* x, const float* w, float* out, int n, int width, float eps, size_t xs, size_t os) {
    for (int r = 0; r < n; r++) {
        const float* xr = x + r * xs;
        float* orow = out + r * os;
        __m256 acc = _mm256_setzero_ps();
        for (int i = 0; i < width; i += 8) {
            const __m256 v = _mm256_maskload_ps(xr + i, live8(width - i));
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        const __m256 inv = _mm256_set1_ps(1.0f / sqrtf(hsum8(acc) / (float)width + eps));
        for (int i = 0; i < width; i += 8) {
            const __m256i m = live8(width - i);
            const __m256 h = _mm256_mul_ps(_mm256_maskload_ps(xr + i, m), inv);
            _mm256_maskstore_ps(orow + i, m, _mm256_mul_ps(h, _mm256_maskload_ps(w + i, m)));
        }
    }
}

/* SiLU g / (1 + exp(-g)), or GELU's tanh form 0.5 g (1 + tanh(y)), y = sqrt(2 / pi) (g + 0.044715 g^3),
 * tanh(y) = 1 - 2 / (exp(2 y) + 1); exp's argument capped at 88 (exp8 has no upper clamp of its own) */
static inline __m256 act8(__m256 g, int act) {
    const __m256 one = _mm256_set1_ps(1.0f), cap = _mm256_set1_ps(88.0f);
    if (act == 0)
        return _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), g), cap))));
    const __m256 y = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f),
                                   _mm256_add_ps(g, _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.044715f), g),
                                                                  _mm256_mul_ps(g, g))));
    const __m256 th = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.0f),
                                                      _mm256_add_ps(exp8(_mm256_min_ps(_mm256_add_ps(y, y), cap)), one)));
    return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), g), _mm256_add_ps(one, th));
}

static void add_rows8(float* x, const float* t, size_t n) {          /* x += t */
    for (size_t i = 0; i < n; i += 8) {
        const __m256i m = live8((long)(n - i));
        _mm256_maskstore_ps(x + i, m, _mm256_add_ps(_mm256_maskload_ps(x + i, m), _mm256_maskload_ps(t + i, m)));
    }
}

size_t sv2_layer_scratch(const sv2_layer_t* L, int n) {   /* bytes of scratch `sv2_layer_f32` needs for n rows */
    const size_t qkv = (size_t)(L->H + 2 * L->kvh) * L->hd, hq = (size_t)L->H * L->hd;
    return (size_t)n * 4 * ((size_t)L->din + qkv + hq + L->d + 2 * (size_t)L->I + L->d) + 64;
}

/* x [n, d] fp32, updated in place to the layer's output; attn_in [n, din] or NULL (then the attention input is
 * in_norm(x), or x where in_norm is NULL); cos, sin [n, hd]; kc, vc [kvh, cap, hd] fp32, row r's k and v written
 * at slot slots[r]; b0, tb, pos, idx, ok, window, scale: as `sv2_attention_f32` */
void sv2_layer_f32(const sv2_layer_t* L, float* x, const float* attn_in, const float* cos, const float* sin,
                   float* kc, float* vc, long cap, const int64_t* slots, int b0, int tb, const int64_t* pos,
                   const int64_t* idx, const uint8_t* ok, int window, float scale, void* scratch, int n, int threads) {
    const int d = L->d, H = L->H, kvh = L->kvh, hd = L->hd, I = L->I, din = L->din;
    const int nqkv = (H + 2 * kvh) * hd, hq = H * hd, half = hd / 2;
    float* h = (float*)scratch;                          /* [n, din] attention input */
    float* qkv = h + (size_t)n * din;                    /* [n, nqkv] */
    float* a = qkv + (size_t)n * nqkv;                   /* [n, hq] q, then the attention output over it */
    float* t = a + (size_t)n * hq;                       /* [n, d] o-proj / down-proj output */
    float* gu = t + (size_t)n * d;                       /* [n, 2 I] gate | up, then the activation in gate */
    float* hn = gu + (size_t)n * 2 * I;                  /* [n, d] the MLP's input */

    const float* hin = attn_in;
    if (!hin) {
        if (L->in_norm) { rmsnorm8(x, L->in_norm, h, n, d, L->eps, d, d); hin = h; }
        else hin = x;
    }
    sv2_linear_f32(hin, L->qkv, L->qkv_bias, qkv, n, nqkv, din, threads);
    for (int r = 0; r < n; r++) {
        float* row = qkv + (size_t)r * nqkv;
        if (L->q_norm) {                                  /* q/k RMSNorm over the head dim (qwen3, gemma3) */
            rmsnorm8(row, L->q_norm, row, H, hd, L->eps, hd, hd);
            rmsnorm8(row + hq, L->k_norm, row + hq, kvh, hd, L->eps, hd, hd);
        }
        const float* c = cos + (size_t)r * hd;
        const float* s = sin + (size_t)r * hd;
        for (int j = 0; j < H + kvh; j++) {               /* RoPE on q and k: x c + rotate_half(x) s */
            float* v = row + (size_t)j * hd;
            for (int i = 0; i < half; i += 8) {
                const __m256i m = live8(half - i);
                const __m256 lo = _mm256_maskload_ps(v + i, m), hi = _mm256_maskload_ps(v + half + i, m);
                const __m256 c0 = _mm256_maskload_ps(c + i, m), c1 = _mm256_maskload_ps(c + half + i, m);
                const __m256 s0 = _mm256_maskload_ps(s + i, m), s1 = _mm256_maskload_ps(s + half + i, m);
                const __m256 nhi = _mm256_sub_ps(_mm256_setzero_ps(), hi);
                _mm256_maskstore_ps(v + i, m, _mm256_add_ps(_mm256_mul_ps(lo, c0), _mm256_mul_ps(nhi, s0)));
                _mm256_maskstore_ps(v + half + i, m, _mm256_add_ps(_mm256_mul_ps(hi, c1), _mm256_mul_ps(lo, s1)));
            }
        }
        for (int j = 0; j < kvh; j++) {                   /* the cache write */
            memcpy(kc + ((size_t)j * cap + slots[r]) * hd, row + hq + (size_t)j * hd, 4 * (size_t)hd);
            memcpy(vc + ((size_t)j * cap + slots[r]) * hd, row + hq + (size_t)(kvh + j) * hd, 4 * (size_t)hd);
        }
        memcpy(a + (size_t)r * hq, row, 4 * (size_t)hq);  /* q, contiguous for the attention */
    }
    /* each (row, KV head) reads its queries before writing its outputs over them */
    if (sv2_attention_f32(a, kc, vc, pos, idx, ok, a, n, H, kvh, hd, cap, b0, tb, window, scale, threads)) return;
    sv2_linear_f32(a, L->o, NULL, t, n, d, hq, threads);
    if (L->post_attn_norm) rmsnorm8(t, L->post_attn_norm, t, n, d, L->eps, d, d);
    add_rows8(x, t, (size_t)n * d);
    rmsnorm8(x, L->pre_mlp_norm, hn, n, d, L->eps, d, d);
    sv2_linear_f32(hn, L->gate_up, NULL, gu, n, 2 * I, d, threads);
    for (int r = 0; r < n; r++) {
        const float* g = gu + (size_t)r * 2 * I;
        float* o = gu + (size_t)r * I;                    /* compacted to [n, I] for the down-proj (o <= g) */
        for (int i = 0; i < I; i += 8) {
            const __m256i m = live8(I - i);
            _mm256_maskstore_ps(o + i, m, _mm256_mul_ps(act8(_mm256_maskload_ps(g + i, m), L->act),
                                                        _mm256_maskload_ps(g + I + i, m)));
        }
    }
    sv2_linear_f32(gu, L->down, NULL, t, n, d, I, threads);
    if (L->post_mlp_norm) rmsnorm8(t, L->post_mlp_norm, t, n, d, L->eps, d, d);
    add_rows8(x, t, (size_t)n * d);
}
