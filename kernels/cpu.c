/* A small-row bf16 linear for x86 CPUs with AVX512-BF16: out[m, n] = sum_k x[m, k] w[n, k] (+ bias[n]).
 *
 * Built and loaded by kernels/cpu/builds.py (kernels/cpu/ops/linear.py says why this exists and what it measured); the
 * plain-torch reference beside it is `linear_reference` there.
 *
 * Weight layout (packed once by kernels.cpu.pack): [ceil(N / NB)][ceil(K / 32)][NB][32] bf16, zero-padded, so a
 * block of NB outputs streams through memory in one sequential pass.
 *
 * Rows run in tiles of 4, 2 and 1 over each block (the block stays in L1 between tiles). The memory stream is
 * kept going by software prefetches into L2, PF_DIST bytes ahead of the block being read, spread evenly over
 * all the tiles' passes of that block: the first tile alone would prefetch and the later ones (reading L1)
 * would leave the memory idle, so an 8-row product cost a 1-row read plus its compute instead of the larger of
 * the two (PERFORMANCE.md, section 1).
 *
 * Row invariance by construction: every output (m, n) is accumulated in its own 16-lane fp32 register over the
 * K chunks in order (VDPBF16PS), then reduced by one fixed shuffle tree (`hsum16`, and `hsum4`: the same tree
 * for four registers). Nothing in that sequence depends on M, on the other rows, on which rows share a tile,
 * or on the thread count (threads split the output blocks, never K). A token's row therefore has the same bits
 * in a 1-row forward and inside any tree.
 */
#include <immintrin.h>
#include <stdint.h>
#include <math.h>
#include <string.h>
#include <stdlib.h>
#include "cpu_portable.c"   /* no vector code: UniSpec's tree, the window step, the top-k insertion */

#define NB 4      /* outputs per block (weight rows streamed together) */
#define MB 4      /* rows per register block: NB x MB = 16 accumulators */
#define PF_DIST 8192   /* bytes the prefetches run ahead of the packed weight stream (into L2) */

int sv_block_outputs(void) { return NB; }

/* the 16 horizontal sums of v[0..15] as one vector (lane i = sum of v[i]'s lanes): a fixed tree of in-lane
 * shuffles and adds, so each sum's order is the same whatever the other 15 hold. A register's 16 lanes
 * e0..e15 are summed as ((L0 + L1) + (L2 + L3)), each 128-bit lane L = (e0 + e2) + (e1 + e3) of its four. */
static inline __m512 hsum16(const __m512* v) {
    __m512 a[8], b[4], c[2];
    for (int k = 0; k < 8; k++)       /* per 128-bit lane: [v2k 0+2, v2k+1 0+2, v2k 1+3, v2k+1 1+3] */
        a[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
    for (int k = 0; k < 4; k++) {     /* per 128-bit lane: the lane's sum of v4k .. v4k+3 */
        const __m512d x = _mm512_castps_pd(a[2 * k]), y = _mm512_castps_pd(a[2 * k + 1]);
        b[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int k = 0; k < 2; k++)       /* 128-bit lanes (0, 2) + (1, 3) of b2k and b2k+1 */
        c[k] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * k], b[2 * k + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * k], b[2 * k + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}

/* hsum16's tree for four registers: lane j < 4 of the result = the sum of v_j's lanes, in hsum16's order */
static inline __m128 hsum4(__m512 v0, __m512 v1, __m512 v2, __m512 v3) {
    const __m512 a0 = _mm512_add_ps(_mm512_unpacklo_ps(v0, v1), _mm512_unpackhi_ps(v0, v1));
    const __m512 a1 = _mm512_add_ps(_mm512_unpacklo_ps(v2, v3), _mm512_unpackhi_ps(v2, v3));
    const __m512d x = _mm512_castps_pd(a0), y = _mm512_castps_pd(a1);
    const __m512 b = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    const __m512 c = _mm512_add_ps(_mm512_shuffle_f32x4(b, b, 0x88), _mm512_shuffle_f32x4(b, b, 0xDD));
    const __m512 d = _mm512_add_ps(_mm512_shuffle_f32x4(c, c, 0x88), _mm512_shuffle_f32x4(c, c, 0xDD));
    return _mm512_castps512_ps128(d);
}

/* hsum16's tree for eight registers: lane j < 8 of the result = the sum of v[j]'s lanes, in hsum16's order (its
 * first two steps on v[0..7], its third on the pair, its fourth on the result and itself) */
static inline __m256 hsum8(const __m512* v) {
    __m512 a[4], b[2];
    for (int k = 0; k < 4; k++)
        a[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
    for (int k = 0; k < 2; k++) {
        const __m512d x = _mm512_castps_pd(a[2 * k]), y = _mm512_castps_pd(a[2 * k + 1]);
        b[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    const __m512 c = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88), _mm512_shuffle_f32x4(b[0], b[1], 0xDD));
    return _mm512_castps512_ps256(_mm512_add_ps(_mm512_shuffle_f32x4(c, c, 0x88), _mm512_shuffle_f32x4(c, c, 0xDD)));
}

#define DP(a, x, w) a = _mm512_dpbf16_ps(a, x, w)
#define LOADW(j) ((__m512bh)_mm512_loadu_si512((const void*)(wc + (j) * 32)))
/* the 4 x 4 tile's sixteen products for one K chunk (v0..v3: the rows' chunks; LOAD(j): output j's), and its
 * sixteen accumulators reduced into r[4][NB] (row-major) by hsum16 */
#define DP16(LOAD) do { __m512bh w_; \
    w_ = LOAD(0); DP(a00, v0, w_); DP(a10, v1, w_); DP(a20, v2, w_); DP(a30, v3, w_); \
    w_ = LOAD(1); DP(a01, v0, w_); DP(a11, v1, w_); DP(a21, v2, w_); DP(a31, v3, w_); \
    w_ = LOAD(2); DP(a02, v0, w_); DP(a12, v1, w_); DP(a22, v2, w_); DP(a32, v3, w_); \
    w_ = LOAD(3); DP(a03, v0, w_); DP(a13, v1, w_); DP(a23, v2, w_); DP(a33, v3, w_); } while (0)
#define REDUCE16(r) do { \
    const __m512 acc_[16] = {a00, a01, a02, a03, a10, a11, a12, a13, a20, a21, a22, a23, a30, a31, a32, a33}; \
    _mm512_storeu_ps(&r[0][0], hsum16(acc_)); } while (0)
/* row i's chunk c of x: whole, or the last partial chunk masked to zeros (the packed weight is zero-padded) */
#define XCHUNK(p, c) ((c) < full ? (__m512bh)_mm512_loadu_si512((const void*)((p) + (c) * 32)) \
                                 : (__m512bh)_mm512_maskz_loadu_epi16(tail, (const void*)((p) + (c) * 32)))
/* this pass's share of the next PF_DIST bytes of the stream: ps bytes per chunk, one line at a time */
#define PREFETCH(c) do { const char* q_ = pf + (size_t)(c) * ps; \
    for (int o_ = 0; o_ < ps; o_ += 64) _mm_prefetch(q_ + o_, _MM_HINT_T1); } while (0)

/* Four rows x four outputs: sixteen accumulators held in registers (named, so the compiler keeps them there).
 * kc chunks, the last one partial when tail != 0. */
static inline void tile4(const uint16_t* x, int K, const uint16_t* wb, int kc, __mmask32 tail, float r[4][NB],
                         const char* pf, int ps) {
    __m512 a00 = _mm512_setzero_ps(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00, a13 = a00,
           a20 = a00, a21 = a00, a22 = a00, a23 = a00, a30 = a00, a31 = a00, a32 = a00, a33 = a00;
    const uint16_t *x0 = x, *x1 = x + K, *x2 = x + 2 * (size_t)K, *x3 = x + 3 * (size_t)K;
    const int full = tail ? kc - 1 : kc;
    for (int c = 0; c < kc; c++) {
        const __m512bh v0 = XCHUNK(x0, c), v1 = XCHUNK(x1, c), v2 = XCHUNK(x2, c), v3 = XCHUNK(x3, c);
        const uint16_t* wc = wb + (size_t)c * NB * 32;
        PREFETCH(c);
        DP16(LOADW);
    }
    REDUCE16(r);
}

/* Two rows x four outputs: each output's sequence as in tile4 (chunks in order, the same tree). */
static inline void tile2(const uint16_t* x, int K, const uint16_t* wb, int kc, __mmask32 tail, float r[2][NB],
                         const char* pf, int ps) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    const uint16_t *x0 = x, *x1 = x + K;
    const int full = tail ? kc - 1 : kc;
    for (int c = 0; c < kc; c++) {
        const __m512bh v = XCHUNK(x0, c), u = XCHUNK(x1, c);
        const uint16_t* wc = wb + (size_t)c * NB * 32;
        PREFETCH(c);
        __m512bh w_;
        w_ = LOADW(0); DP(a0, v, w_); DP(b0, u, w_);
        w_ = LOADW(1); DP(a1, v, w_); DP(b1, u, w_);
        w_ = LOADW(2); DP(a2, v, w_); DP(b2, u, w_);
        w_ = LOADW(3); DP(a3, v, w_); DP(b3, u, w_);
    }
    _mm_storeu_ps(r[0], hsum4(a0, a1, a2, a3));
    _mm_storeu_ps(r[1], hsum4(b0, b1, b2, b3));
}

/* One row x four outputs: the same again. */
static inline void tile1(const uint16_t* x, const uint16_t* wb, int kc, __mmask32 tail, float r[NB],
                         const char* pf, int ps) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    const int full = tail ? kc - 1 : kc;
    for (int c = 0; c < kc; c++) {
        const __m512bh v = XCHUNK(x, c);
        const uint16_t* wc = wb + (size_t)c * NB * 32;
        PREFETCH(c);
        DP(a0, v, LOADW(0)); DP(a1, v, LOADW(1)); DP(a2, v, LOADW(2)); DP(a3, v, LOADW(3));
    }
    _mm_storeu_ps(r, hsum4(a0, a1, a2, a3));
}

/* a tile's sums r[mb][NB] (row-major, as REDUCE16 leaves them) into out rows m.., outputs b*NB.. (nb of them):
 * the bias added (fp32), then fp32, or bf16 by VCVTNEPS2BF16 (round to nearest even, NaN kept quiet; an fp32
 * denormal, below 1.2e-38, becomes a signed zero), one masked store per row. The scalar loop this replaces (16
 * conversions and index sums a tile) cost 15-20% of a compute-bound product at K = 576: SmolLM2's qkv and
 * gate-up at 8-64 rows went from 73 to 88-100 GMAC/s on one Zen 4 core, with bitwise the same outputs. */
static inline void store_tile(const float r[MB][NB], int mb, int nb, const float* bias, void* out, int out_f32,
                              int m, int N, int b) {
    const __mmask8 om = (__mmask8)((1u << nb) - 1);
    const __m128 bv = bias ? _mm_maskz_loadu_ps(om, bias + (size_t)b * NB) : _mm_setzero_ps();
    for (int i = 0; i < mb; i++) {
        __m128 s = _mm_loadu_ps(r[i]);
        if (bias) s = _mm_add_ps(s, bv);
        const size_t o = (size_t)(m + i) * N + (size_t)b * NB;
        if (out_f32) _mm_mask_storeu_ps((float*)out + o, om, s);
        else _mm_mask_storeu_epi16((uint16_t*)out + o, om, (__m128i)_mm_cvtneps_pbh(s));
    }
}

static void blocks(const uint16_t* x, const uint16_t* wp, const float* bias, void* out, int out_f32,
                   int M, int N, int K, int b0, int b1) {
    const int kc = (K + 31) / 32;
    const __mmask32 tail = (K % 32) ? (((__mmask32)1 << (K % 32)) - 1) : 0;
    const int passes = M / MB + (M % MB == 3 ? 2 : M % MB ? 1 : 0);   /* tiles of 4, then 2, then 1 */
    const int ps = NB * 64 / passes;      /* a block chunk is NB * 64 bytes; each pass prefetches its share */
    float r[MB][NB];
    for (int b = b0; b < b1; b++) {
        const uint16_t* wb = wp + (size_t)b * kc * NB * 32;
        const char* pf = (const char*)wb + PF_DIST;
        const int nb = (N - b * NB < NB) ? N - b * NB : NB;
        for (int m = 0; m < M;) {
            const int left = M - m, mb = left >= 4 ? 4 : left >= 2 ? 2 : 1;
            const uint16_t* xm = x + (size_t)m * K;
            if (mb == 4) tile4(xm, K, wb, kc, tail, r, pf, ps);
            else if (mb == 2) tile2(xm, K, wb, kc, tail, r, pf, ps);
            else tile1(xm, wb, kc, tail, r[0], pf, ps);
            pf += (size_t)kc * ps;
            store_tile(r, mb, nb, bias, out, out_f32, m, N, b);
            m += mb;
        }
    }
}

/* x [M, K] bf16 contiguous; wp packed (above); bias [N] fp32 or NULL; out [M, N] fp32 (out_f32) or bf16. */
void sv_linear_bf16(const uint16_t* x, const uint16_t* wp, const float* bias, void* out, int out_f32,
                    int M, int N, int K, int threads) {
    const int nblocks = (N + NB - 1) / NB;
    if (threads <= 1) {
        blocks(x, wp, bias, out, out_f32, M, N, K, 0, nblocks);
        return;
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int t = 0; t < threads; t++) {
        int b0 = (int)((long)nblocks * t / threads), b1 = (int)((long)nblocks * (t + 1) / threads);
        if (b0 < b1) blocks(x, wp, bias, out, out_f32, M, N, K, b0, b1);
    }
}

/* ---- the same product in fp32 (AVX-512F only): a model kept in fp32 ------------------------------------------
 *
 * Packed [ceil(N / NB)][ceil(K / 16)][NB][16] fp32 (a chunk is 64 bytes, as a bf16 chunk of 32 is), tiles of 4, 2
 * and 1 rows with the same prefetch schedule, each output summed by one FMA chain over the K chunks in order and
 * reduced by hsum16 / hsum4. So, as in bf16, a row's bits are a function of that row: what lets an fp32 decode
 * run every step unpadded (oneDNN's fp32 GEMM gives rows 1-3 of a product other bits than it gives them inside
 * a larger one, so the torch path pads every step to >= 4 rows: an `ar` step then streams the weights for 4). */
#define FCHUNK(p, c) ((c) < full ? _mm512_loadu_ps((p) + (c) * 16) : _mm512_maskz_loadu_ps(tail, (p) + (c) * 16))
#define FM(a, x, w) a = _mm512_fmadd_ps(x, w, a)
#define FLOADW(j) _mm512_loadu_ps(wc + (j) * 16)

static inline void ftile4(const float* x, int K, const float* wb, int kc, __mmask16 tail, float r[4][NB],
                          const char* pf, int ps) {
    __m512 a00 = _mm512_setzero_ps(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00, a13 = a00,
           a20 = a00, a21 = a00, a22 = a00, a23 = a00, a30 = a00, a31 = a00, a32 = a00, a33 = a00;
    const float *x0 = x, *x1 = x + K, *x2 = x + 2 * (size_t)K, *x3 = x + 3 * (size_t)K;
    const int full = tail ? kc - 1 : kc;
    for (int c = 0; c < kc; c++) {
        const __m512 v0 = FCHUNK(x0, c), v1 = FCHUNK(x1, c), v2 = FCHUNK(x2, c), v3 = FCHUNK(x3, c);
        const float* wc = wb + (size_t)c * NB * 16;
        PREFETCH(c);
        __m512 w_;
        w_ = FLOADW(0); FM(a00, v0, w_); FM(a10, v1, w_); FM(a20, v2, w_); FM(a30, v3, w_);
        w_ = FLOADW(1); FM(a01, v0, w_); FM(a11, v1, w_); FM(a21, v2, w_); FM(a31, v3, w_);
        w_ = FLOADW(2); FM(a02, v0, w_); FM(a12, v1, w_); FM(a22, v2, w_); FM(a32, v3, w_);
        w_ = FLOADW(3); FM(a03, v0, w_); FM(a13, v1, w_); FM(a23, v2, w_); FM(a33, v3, w_);
    }
    REDUCE16(r);
}

static inline void ftile2(const float* x, int K, const float* wb, int kc, __mmask16 tail, float r[2][NB],
                          const char* pf, int ps) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    const float *x0 = x, *x1 = x + K;
    const int full = tail ? kc - 1 : kc;
    for (int c = 0; c < kc; c++) {
        const __m512 v = FCHUNK(x0, c), u = FCHUNK(x1, c);
        const float* wc = wb + (size_t)c * NB * 16;
        PREFETCH(c);
        __m512 w_;
        w_ = FLOADW(0); FM(a0, v, w_); FM(b0, u, w_);
        w_ = FLOADW(1); FM(a1, v, w_); FM(b1, u, w_);
        w_ = FLOADW(2); FM(a2, v, w_); FM(b2, u, w_);
        w_ = FLOADW(3); FM(a3, v, w_); FM(b3, u, w_);
    }
    _mm_storeu_ps(r[0], hsum4(a0, a1, a2, a3));
    _mm_storeu_ps(r[1], hsum4(b0, b1, b2, b3));
}

static inline void ftile1(const float* x, const float* wb, int kc, __mmask16 tail, float r[NB], const char* pf, int ps) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    const int full = tail ? kc - 1 : kc;
    for (int c = 0; c < kc; c++) {
        const __m512 v = FCHUNK(x, c);
        const float* wc = wb + (size_t)c * NB * 16;
        PREFETCH(c);
        FM(a0, v, FLOADW(0)); FM(a1, v, FLOADW(1)); FM(a2, v, FLOADW(2)); FM(a3, v, FLOADW(3));
    }
    _mm_storeu_ps(r, hsum4(a0, a1, a2, a3));
}

static void fblocks(const float* x, const float* wp, const float* bias, float* out, int M, int N, int K, int b0, int b1) {
    const int kc = (K + 15) / 16;
    const __mmask16 tail = (K % 16) ? (__mmask16)((1u << (K % 16)) - 1) : 0;
    const int passes = M / MB + (M % MB == 3 ? 2 : M % MB ? 1 : 0);
    const int ps = NB * 64 / passes;
    float r[MB][NB];
    for (int b = b0; b < b1; b++) {
        const float* wb = wp + (size_t)b * kc * NB * 16;
        const char* pf = (const char*)wb + PF_DIST;
        const int nb = (N - b * NB < NB) ? N - b * NB : NB;
        for (int m = 0; m < M;) {
            const int left = M - m, mb = left >= 4 ? 4 : left >= 2 ? 2 : 1;
            const float* xm = x + (size_t)m * K;
            if (mb == 4) ftile4(xm, K, wb, kc, tail, r, pf, ps);
            else if (mb == 2) ftile2(xm, K, wb, kc, tail, r, pf, ps);
            else ftile1(xm, wb, kc, tail, r[0], pf, ps);
            pf += (size_t)kc * ps;
            store_tile(r, mb, nb, bias, out, 1, m, N, b);
            m += mb;
        }
    }
}

/* x [M, K] fp32 contiguous; wp packed (above); bias [N] or NULL; out [M, N] fp32. */
void sv_linear_f32(const float* x, const float* wp, const float* bias, float* out, int M, int N, int K, int threads) {
    const int nblocks = (N + NB - 1) / NB;
    if (threads <= 1) {
        fblocks(x, wp, bias, out, M, N, K, 0, nblocks);
        return;
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int t = 0; t < threads; t++) {
        int b0 = (int)((long)nblocks * t / threads), b1 = (int)((long)nblocks * (t + 1) / threads);
        if (b0 < b1) fblocks(x, wp, bias, out, M, N, K, b0, b1);
    }
}

/* The same product over a weight left row-major, w [N, K] (a buffer rewritten in place, which a packed copy would
 * have to follow: MicroSpec's gathered window head, a drafter's vocabulary head): out[m, n] fp32 or bf16. Four
 * outputs stream four rows at once; the last partial K chunk is masked on both sides. Each output is summed in
 * its own register in K order, as above, so a row's bits do not depend on M or the other rows. */
#define RLOADW(j, m) ((__m512bh)_mm512_maskz_loadu_epi16(m, (const void*)(w##j + c * 32)))

static inline void rtile4(const uint16_t* x, int K, const uint16_t* w, int nb, int kc, __mmask32 tail,
                          float r[MB][NB], const char* pf, int ps) {
    __m512 a00 = _mm512_setzero_ps(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00, a13 = a00,
           a20 = a00, a21 = a00, a22 = a00, a23 = a00, a30 = a00, a31 = a00, a32 = a00, a33 = a00;
    const uint16_t *x0 = x, *x1 = x + K, *x2 = x + 2 * (size_t)K, *x3 = x + 3 * (size_t)K;
    /* rows past N (nb < 4) re-read row 0: their sums are computed and dropped */
    const uint16_t *w0 = w, *w1 = nb > 1 ? w + (size_t)K : w, *w2 = nb > 2 ? w + 2 * (size_t)K : w,
                   *w3 = nb > 3 ? w + 3 * (size_t)K : w;
    for (int c = 0; c < kc; c++) {
        const __mmask32 m = (c == kc - 1 && tail) ? tail : (__mmask32)0xFFFFFFFFu;
        const __m512bh v0 = (__m512bh)_mm512_maskz_loadu_epi16(m, (const void*)(x0 + c * 32));
        const __m512bh v1 = (__m512bh)_mm512_maskz_loadu_epi16(m, (const void*)(x1 + c * 32));
        const __m512bh v2 = (__m512bh)_mm512_maskz_loadu_epi16(m, (const void*)(x2 + c * 32));
        const __m512bh v3 = (__m512bh)_mm512_maskz_loadu_epi16(m, (const void*)(x3 + c * 32));
#define RLOAD(j) RLOADW(j, m)
        PREFETCH(c);
        DP16(RLOAD);
#undef RLOAD
    }
    REDUCE16(r);
}

static inline void rtile1(const uint16_t* x, int K, const uint16_t* w, int nb, int kc, __mmask32 tail, float r[NB],
                          const char* pf, int ps) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    const uint16_t *w0 = w, *w1 = nb > 1 ? w + (size_t)K : w, *w2 = nb > 2 ? w + 2 * (size_t)K : w,
                   *w3 = nb > 3 ? w + 3 * (size_t)K : w;
    for (int c = 0; c < kc; c++) {
        const __mmask32 m = (c == kc - 1 && tail) ? tail : (__mmask32)0xFFFFFFFFu;
        const __m512bh v = (__m512bh)_mm512_maskz_loadu_epi16(m, (const void*)(x + c * 32));
        PREFETCH(c);
        DP(a0, v, RLOADW(0, m)); DP(a1, v, RLOADW(1, m)); DP(a2, v, RLOADW(2, m)); DP(a3, v, RLOADW(3, m));
    }
    _mm_storeu_ps(r, hsum4(a0, a1, a2, a3));
}

static void rblocks(const uint16_t* x, const uint16_t* w, void* out, int out_f32, int M, int N, int K, int b0, int b1) {
    const int kc = (K + 31) / 32;
    const __mmask32 tail = (K % 32) ? (((__mmask32)1 << (K % 32)) - 1) : 0;
    const int passes = M / MB + M % MB;       /* tiles of 4, then 1: the prefetch schedule of `blocks` */
    const int ps = NB * 64 / passes;
    float r[MB][NB];
    for (int b = b0; b < b1; b++) {
        const int nb = (N - b * NB < NB) ? N - b * NB : NB;
        const uint16_t* wb = w + (size_t)b * NB * K;
        const char* pf = (const char*)wb + PF_DIST;  /* the block's NB rows lie together: one stream */
        for (int m = 0; m < M; m += MB) {
            const int mb = (M - m < MB) ? M - m : MB;
            if (mb == MB) { rtile4(x + (size_t)m * K, K, wb, nb, kc, tail, r, pf, ps); pf += (size_t)kc * ps; }
            else for (int i = 0; i < mb; i++) {
                rtile1(x + (size_t)(m + i) * K, K, wb, nb, kc, tail, r[i], pf, ps);
                pf += (size_t)kc * ps;
            }
            store_tile(r, mb, nb, NULL, out, out_f32, m, N, b);
        }
    }
}

void sv_linear_rows_bf16(const uint16_t* x, const uint16_t* w, void* out, int out_f32, int M, int N, int K,
                         int threads) {
    const int nblocks = (N + NB - 1) / NB;
    if (threads <= 1) { rblocks(x, w, out, out_f32, M, N, K, 0, nblocks); return; }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int t = 0; t < threads; t++) {
        int b0 = (int)((long)nblocks * t / threads), b1 = (int)((long)nblocks * (t + 1) / threads);
        if (b0 < b1) rblocks(x, w, out, out_f32, M, N, K, b0, b1);
    }
}

/* ---- fixed-order attention for the exact decode (engine.native rules 2 and 3, one row at a time) ----------
 *
 * For each row r (a token at logical position pos[r]) and query head h: the keys of the row's logical
 * context in logical order, in blocks of BLOCK positions aligned to multiples of BLOCK. Blocks [0, b0) are
 * committed and read where they lie (slot = position); the next tb blocks (the tail: two, or as many as a deep
 * draft tree reaches) are read through idx[r] (the cache slot of each of their positions for this row, [tb BLOCK],
 * engine.native.tail_index) where ok[r] says the position is in the row's context. A key is also hidden when
 * window > 0 and pos[r] - key position >= window. Three passes over the row's visible blocks: the scores s (and their max m, lane-wise), the weights e = exp(s - m) and their
 * sum l, both of the weights rounded to bf16 (lane-wise in block order, then one fixed reduction), then sum of
 * e v by VDPBF16PS over key pairs, one chain per output dim over the pairs in logical order; out = that sum *
 * (1 / l) in fp32. (A running max folded block by block, the flash-attention form, spent two scalar expf and a
 * serial chain per head and block, and fp32 FMAs did one key per instruction: the passes take a SmolLM2-shaped
 * layer at 8 rows and a 1500-token cache from 0.51 to 0.31 ms.) Everything here is a function
 * of the row's logical context alone (not of n, of the other rows, or of where an ancestor sits in the cache),
 * so an `ar` step and any tree give the row the same bits. q fp32 [n, H, hd] holding bf16 values (scores by VDPBF16PS: exact products, fp32
 * sums; each key's 16 lanes reduced by `hsum16`'s fixed tree); kc, vc bf16 [kvh, cap, hd]; out fp32 [n, H, hd]
 * (may be q itself: each (row, KV head) reads its queries before writing); hd % 16 == 0. The query heads of a
 * KV head run together, sharing each block's slots and visibility; the KV head is the outer loop, so its keys and
 * values stay in L2 while every row reads them. */

#define ABLOCK 32

/* exp(x) (the attention calls it with x = s - max <= 0): 2^n * p(f), n = round(x log2 e), f = x - n ln 2 (two-part ln 2),
 * p a degree-6 polynomial (Cephes' expf coefficients); fixed operations, so fixed bits. */
static inline __m512 exp_ps(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.0f)), _mm512_set1_ps(88.7f));   /* inf beyond */
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    f = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), f);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(f, f), _mm512_add_ps(f, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* One visible block's values for NT query heads of a KV head, dims 32 c0 .. 32 (c0 + CN) - 1 (NT, CN constants
 * at each call, so the accumulators stay in registers; LASTHALF: the group's last chunk is the head's half
 * chunk), added to the heads' running sums O[t] += sum over keys i of e[t][i] v_i by VDPBF16PS: keys in pairs
 * (2w, 2w + 1), their bf16 weights broadcast as one 32-bit pair, their value rows interleaved by unpacklo/hi_epi16
 * (lane k of the lo half: dim 8 (k / 4) + k % 4, of the hi half: that + 4; `attend` puts dims back in order).
 * Each output dim is one VDPBF16PS chain over the pairs in logical order, so the heads sharing a load and the
 * groups change no bit. e: head t's bf16 weights at e + t * es (a hidden key's weight is 0 and its value row
 * the zero row). */
static inline __attribute__((always_inline)) void fold_group(const int NT, const int CN, const int LASTHALF, int c0,
        const uint16_t* const* vp, uint32_t vis, const uint16_t* e, size_t es, __m512 (*O)[16]) {
    __m512 ol[4][2], oh[4][2];
    for (int t = 0; t < NT; t++)
        for (int c = 0; c < CN; c++) { ol[t][c] = O[t][2 * (c0 + c)]; oh[t][c] = O[t][2 * (c0 + c) + 1]; }
    for (int w = 0; w < ABLOCK / 2; w++) {
        if (!((vis >> (2 * w)) & 3u)) continue;              /* both keys hidden */
        __m512bh wp[4];
        for (int t = 0; t < NT; t++) {
            int32_t pair;
            memcpy(&pair, e + t * es + 2 * w, 4);
            wp[t] = (__m512bh)_mm512_set1_epi32(pair);
        }
        for (int c = 0; c < CN; c++) {
            const uint16_t* va = vp[2 * w] + 32 * (c0 + c);
            const uint16_t* vb = vp[2 * w + 1] + 32 * (c0 + c);
            const __m512i a = (LASTHALF && c == CN - 1)
                ? _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i*)va)) : _mm512_loadu_si512((const void*)va);
            const __m512i b = (LASTHALF && c == CN - 1)
                ? _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i*)vb)) : _mm512_loadu_si512((const void*)vb);
            const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(a, b), hi = (__m512bh)_mm512_unpackhi_epi16(a, b);
            for (int t = 0; t < NT; t++) {
                ol[t][c] = _mm512_dpbf16_ps(ol[t][c], wp[t], lo);
                oh[t][c] = _mm512_dpbf16_ps(oh[t][c], wp[t], hi);
            }
        }
    }
    for (int t = 0; t < NT; t++)
        for (int c = 0; c < CN; c++) { O[t][2 * (c0 + c)] = ol[t][c]; O[t][2 * (c0 + c) + 1] = oh[t][c]; }
}

/* all of a block's values for NT heads: groups of two chunks (64 dims), then an odd last chunk */
static inline __attribute__((always_inline)) void fold_values(const int NT, const int CH, const int HALF,
        const uint16_t* const* vp, uint32_t vis, const uint16_t* e, size_t es, __m512 (*O)[16]) {
    int c0 = 0;
    for (; c0 + 2 < CH; c0 += 2) fold_group(NT, 2, 0, c0, vp, vis, e, es, O);
    if (CH - c0 == 2) fold_group(NT, 2, HALF, c0, vp, vis, e, es, O);
    else fold_group(NT, 1, HALF, c0, vp, vis, e, es, O);
}

/* One head's scaled scores for 16 keys (rows kp[0 .. 15]), lanes outside vis16 -inf: per key CH VDPBF16PS in
 * chunk order into one accumulator (HALF: the last chunk is 16 dims, zero-extended), the 16 reduced by hsum16. */
static inline __attribute__((always_inline)) __m512 scores16(const int CH, const int HALF, const __m512bh* qb,
        const uint16_t* const* kp, __mmask16 vis16, __m512 scale) {
    __m512 acc[16];
    for (int i = 0; i < 16; i++) {
        const uint16_t* k = kp[i];
        __m512 a = _mm512_setzero_ps();
        for (int c = 0; c < CH; c++) {
            const __m512bh kv = (__m512bh)((HALF && c == CH - 1)
                ? _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i*)(k + 32 * c)))
                : _mm512_loadu_si512((const void*)(k + 32 * c)));
            a = _mm512_dpbf16_ps(a, qb[c], kv);
        }
        acc[i] = a;
    }
    return _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), vis16, _mm512_mul_ps(hsum16(acc), scale));
}

/* scores16 for NT query heads of one KV head at once (NT x CH small enough for the accumulators to stay in
 * registers: head size 64, up to 3 heads): each key chunk is loaded once for the NT heads, 8 keys at a time,
 * reduced by hsum8 (hsum16's tree), so every score has scores16's bits. s[t]: head t's 16 scores. */
static inline __attribute__((always_inline)) void scores16_heads(const int NT, const int CH, const int HALF,
        const __m512bh (*qb)[8], const uint16_t* const* kp, __mmask16 vis16, __m512 scale, __m512* s) {
    __m256 half[4][2];
    for (int e = 0; e < 2; e++) {
        __m512 acc[4][8];
        for (int t = 0; t < NT; t++)
            for (int i = 0; i < 8; i++) acc[t][i] = _mm512_setzero_ps();
        for (int i = 0; i < 8; i++) {
            const uint16_t* k = kp[8 * e + i];
            for (int c = 0; c < CH; c++) {
                const __m512bh kv = (__m512bh)((HALF && c == CH - 1)
                    ? _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i*)(k + 32 * c)))
                    : _mm512_loadu_si512((const void*)(k + 32 * c)));
                for (int t = 0; t < NT; t++) acc[t][i] = _mm512_dpbf16_ps(acc[t][i], qb[t][c], kv);
            }
        }
        for (int t = 0; t < NT; t++) half[t][e] = hsum8(acc[t]);
    }
    for (int t = 0; t < NT; t++) {
        const __m512 v = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(half[t][0])),
                                                             _mm256_castps_pd(half[t][1]), 1));
        s[t] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), vis16, _mm512_mul_ps(v, scale));
    }
}

/* block b's keys and values for row r (kp, vp [ABLOCK]) and which are visible (bit i: key i) */
static const uint16_t sv_zero_row[256];                      /* a hidden key's value row (weight 0) */

static inline uint32_t block_keys(int b, int b0, const uint16_t* K, const uint16_t* V, int hd, long p, int window,
                                  const int64_t* idx, const uint8_t* ok, const uint16_t** kp, const uint16_t** vp) {
    uint32_t vis;
    if (b < b0) {                                            /* committed: position = slot, all in context */
        const size_t s0 = (size_t)b * ABLOCK * hd;
        for (int i = 0; i < ABLOCK; i++) { kp[i] = K + s0 + (size_t)i * hd; vp[i] = V + s0 + (size_t)i * hd; }
        vis = 0xFFFFFFFFu;
        const long cut = window > 0 ? p - window + 1 - (long)b * ABLOCK : 0;   /* keys below: out of the window */
        if (cut >= ABLOCK) vis = 0;
        else if (cut > 0) {
            vis <<= cut;
            for (int i = 0; i < cut; i++) vp[i] = sv_zero_row;
        }
    } else {                                                 /* the row's gathered tail (idx, ok: the row's) */
        vis = 0;
        for (int i = 0; i < ABLOCK; i++) {
            const int t = (b - b0) * ABLOCK + i;
            const long kpos = (long)b * ABLOCK + i;
            int v = ok[t];
            if (v && window > 0 && p - kpos >= window) v = 0;
            const size_t s = v ? (size_t)idx[t] * hd : 0;
            kp[i] = K + s;
            vp[i] = v ? V + s : sv_zero_row;
            vis |= (uint32_t)v << i;
        }
    }
    return vis;
}

#define MAXG 16   /* query heads per KV head handled together (more: in passes) */

static __thread float* sv_scores;          /* per thread: [MAXG][keys] scores, then each block's bf16 weights */
static __thread size_t sv_scores_n;

/* Row r, KV head j, its query heads h0 .. h0 + gh - 1; hd = 32 CH (- 16 when HALF): CH, HALF constants at the
 * calls of the common head sizes, so the chunk loops unroll. Three passes over the row's blocks: the scores
 * (and each head's running max, lane-wise), the weights exp(s - max) and their sum (lane-wise, blocks in
 * order, then one fixed reduction), the values. */
static inline __attribute__((always_inline)) void attend(const int CH, const int HALF, const float* q,
        const uint16_t* kc, const uint16_t* vc, const int64_t* pos, const int64_t* idx, const uint8_t* ok, float* out,
        int r, int j, int h0, int gh, int H, int g, int hd, long cap, int b0, int tb, int window, float scale) {
    /* fold_group's lanes back to dim order: dims 32c .. 32c + 15 and 32c + 16 .. 32c + 31 from its (lo, hi) */
    const __m512i lo_idx = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i hi_idx = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    const __m512 sc = _mm512_set1_ps(scale);
    const uint16_t* K = kc + (size_t)j * cap * hd;
    const uint16_t* V = vc + (size_t)j * cap * hd;
    const int nb = b0 + tb;
    const size_t es = (size_t)nb * ABLOCK;                   /* a head's row of scores */
    if (sv_scores_n < (size_t)MAXG * es) {
        free(sv_scores);
        sv_scores_n = (size_t)MAXG * es;
        sv_scores = (float*)malloc(sv_scores_n * sizeof(float));
        if (!sv_scores) {                                    /* out of memory: NaN rows, never a wrong number */
            sv_scores_n = 0;
            for (int t = 0; t < gh; t++)
                for (int i = 0; i < hd; i++) out[((size_t)r * H + (size_t)j * g + h0 + t) * hd + i] = NAN;
            return;
        }
    }
    float* S = sv_scores;
    const int64_t* ri = idx + (size_t)r * tb * ABLOCK;
    const uint8_t* ro = ok + (size_t)r * tb * ABLOCK;
    /* q rounded to bf16 (the decode's q is bf16 already), in 32-element chunks for VDPBF16PS; a last half chunk
     * is zero-padded */
    __m512bh qb[MAXG][8];
    __m512 mx[MAXG], O[MAXG][16];
    for (int t = 0; t < gh; t++) {
        const float* qr = q + ((size_t)r * H + (size_t)j * g + h0 + t) * hd;
        for (int c = 0; c < CH; c++) {
            const __m512 lo = _mm512_loadu_ps(qr + 32 * c);
            const __m512 hi = (HALF && c == CH - 1) ? _mm512_setzero_ps() : _mm512_loadu_ps(qr + 32 * c + 16);
            qb[t][c] = _mm512_cvtne2ps_pbh(hi, lo);
        }
        for (int v = 0; v < 2 * CH; v++) O[t][v] = _mm512_setzero_ps();
        mx[t] = _mm512_set1_ps(-INFINITY);
    }
    const long p = pos[r];
    const uint16_t *kp[ABLOCK], *vp[ABLOCK];
    uint32_t visb[nb];
    for (int b = 0; b < nb; b++) {                           /* 1: scores */
        const uint32_t vis = visb[b] = block_keys(b, b0, K, V, hd, p, window, ri, ro, kp, vp);
        if (!vis) continue;                                  /* a block the row cannot see */
        if (CH <= 2) {                                       /* small heads: up to 3 heads share each key load */
            for (int t0 = 0; t0 < gh; t0 += 3) {
                const int nt = gh - t0 < 3 ? gh - t0 : 3;
                __m512 s0[3], s1[3];
                if (nt == 3) { scores16_heads(3, CH, HALF, qb + t0, kp, (__mmask16)vis, sc, s0);
                               scores16_heads(3, CH, HALF, qb + t0, kp + 16, (__mmask16)(vis >> 16), sc, s1); }
                else if (nt == 2) { scores16_heads(2, CH, HALF, qb + t0, kp, (__mmask16)vis, sc, s0);
                                    scores16_heads(2, CH, HALF, qb + t0, kp + 16, (__mmask16)(vis >> 16), sc, s1); }
                else { scores16_heads(1, CH, HALF, qb + t0, kp, (__mmask16)vis, sc, s0);
                       scores16_heads(1, CH, HALF, qb + t0, kp + 16, (__mmask16)(vis >> 16), sc, s1); }
                for (int u = 0; u < nt; u++) {
                    const int t = t0 + u;
                    _mm512_storeu_ps(S + t * es + (size_t)b * ABLOCK, s0[u]);
                    _mm512_storeu_ps(S + t * es + (size_t)b * ABLOCK + 16, s1[u]);
                    mx[t] = _mm512_max_ps(mx[t], _mm512_max_ps(s0[u], s1[u]));
                }
            }
        } else for (int t = 0; t < gh; t++) {
            const __m512 s0 = scores16(CH, HALF, qb[t], kp, (__mmask16)vis, sc);
            const __m512 s1 = scores16(CH, HALF, qb[t], kp + 16, (__mmask16)(vis >> 16), sc);
            _mm512_storeu_ps(S + t * es + (size_t)b * ABLOCK, s0);
            _mm512_storeu_ps(S + t * es + (size_t)b * ABLOCK + 16, s1);
            mx[t] = _mm512_max_ps(mx[t], _mm512_max_ps(s0, s1));
        }
    }
    float inv[MAXG];
    const __m512i hi16 = _mm512_set1_epi32((int)0xFFFF0000u);
    for (int t = 0; t < gh; t++) {                           /* 2: weights (bf16) and their sum */
        const __m512 mv = _mm512_set1_ps(_mm512_reduce_max_ps(mx[t]));
        __m512 l = _mm512_setzero_ps();
        float* st = S + t * es;
        for (int b = 0; b < nb; b++) {
            const uint32_t vis = visb[b];
            if (!vis) continue;
            float* sb = st + (size_t)b * ABLOCK;
            const __m512 e0 = _mm512_maskz_mov_ps((__mmask16)vis, exp_ps(_mm512_sub_ps(_mm512_loadu_ps(sb), mv)));
            const __m512 e1 = _mm512_maskz_mov_ps((__mmask16)(vis >> 16),
                                                  exp_ps(_mm512_sub_ps(_mm512_loadu_ps(sb + 16), mv)));
            /* rounded to bf16 (key k at element k) over the block's first 64 bytes; the sum is of what the
             * values get: even keys, then odd keys, added lane-wise */
            const __m512i eb = (__m512i)_mm512_cvtne2ps_pbh(e1, e0);
            _mm512_storeu_si512((void*)sb, eb);
            l = _mm512_add_ps(l, _mm512_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(eb, 16)),
                                               _mm512_castsi512_ps(_mm512_and_si512(eb, hi16))));
        }
        inv[t] = 1.0f / _mm512_reduce_add_ps(l);
    }
    for (int b = 0; b < nb; b++) {                           /* 3: values, up to four heads sharing each load */
        const uint32_t vis = visb[b];
        if (!vis) continue;
        block_keys(b, b0, K, V, hd, p, window, ri, ro, kp, vp);
        const uint16_t* eb = (const uint16_t*)S + 2 * (size_t)b * ABLOCK;    /* the block's bf16 weights */
        for (int t0 = 0; t0 < gh; t0 += 4) {
            const int nt = gh - t0 < 4 ? gh - t0 : 4;
            const uint16_t* e = eb + 2 * t0 * es;
            if (nt == 4) fold_values(4, CH, HALF, vp, vis, e, 2 * es, O + t0);
            else if (nt == 3) fold_values(3, CH, HALF, vp, vis, e, 2 * es, O + t0);
            else if (nt == 2) fold_values(2, CH, HALF, vp, vis, e, 2 * es, O + t0);
            else fold_values(1, CH, HALF, vp, vis, e, 2 * es, O + t0);
        }
    }
    for (int t = 0; t < gh; t++) {
        float* orow = out + ((size_t)r * H + (size_t)j * g + h0 + t) * hd;
        const __m512 iv = _mm512_set1_ps(inv[t]);
        for (int c = 0; c < CH; c++) {
            const __m512 e = _mm512_mul_ps(O[t][2 * c], iv), od = _mm512_mul_ps(O[t][2 * c + 1], iv);
            _mm512_storeu_ps(orow + 32 * c, _mm512_permutex2var_ps(e, lo_idx, od));
            if (!(HALF && c == CH - 1)) _mm512_storeu_ps(orow + 32 * c + 16, _mm512_permutex2var_ps(e, hi_idx, od));
        }
    }
}

void sv_attention(const float* q, const uint16_t* kc, const uint16_t* vc, const int64_t* pos,
                  const int64_t* idx, const uint8_t* ok, float* out, int n, int H, int kvh, int hd, long cap,
                  int b0, int tb, int window, float scale, int threads) {
    const int g = H / kvh;
#pragma omp parallel for num_threads(threads) schedule(static) collapse(2) if (threads > 1)
    for (int j = 0; j < kvh; j++)            /* KV head outer: its keys and values stay in L2 across the rows */
        for (int r = 0; r < n; r++)
            for (int h0 = 0; h0 < g; h0 += MAXG) {
                const int gh = g - h0 < MAXG ? g - h0 : MAXG;
#define ATTEND(CH, HALF) attend(CH, HALF, q, kc, vc, pos, idx, ok, out, r, j, h0, gh, H, g, hd, cap, b0, tb, window, scale)
                if (hd == 64) ATTEND(2, 0);
                else if (hd == 128) ATTEND(4, 0);
                else if (hd == 256) ATTEND(8, 0);
                else ATTEND((hd + 31) / 32, hd % 32 != 0);
#undef ATTEND
            }
}

/* ---- top-k of fp32 rows (k small): the verify's argmax and MicroSpec's verify top-k over a 262k vocabulary --------
 *
 * One pass per row at memory speed: 16 values at a time are compared with the current k-th best and only a lane
 * above it goes to the sorted insertion. Ties keep the lower index (torch.argmax's first maximum). Returns, per
 * row, whether it held a NaN (the caller then asks torch, which ranks NaN first). */
static int topk_row(const float* z, long V, int k, float* vals, int64_t* idx) {
    for (int j = 0; j < k; j++) { vals[j] = -INFINITY; idx[j] = -1; }
    __m512 th = _mm512_set1_ps(-INFINITY);
    __mmask16 nan = 0;
    for (long i = 0; i < V; i += 16) {
        const __mmask16 live = V - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (V - i)) - 1);
        const __m512 v = _mm512_maskz_loadu_ps(live, z + i);
        nan |= _mm512_mask_cmp_ps_mask(live, v, v, _CMP_UNORD_Q);
        __mmask16 up = _mm512_mask_cmp_ps_mask(live, v, th, _CMP_GT_OQ);
        while (up) {
            const int lane = __builtin_ctz(up);
            up &= up - 1;
            const float x = z[i + lane];
            if (!(x > vals[k - 1])) continue;                /* the threshold rose within this vector */
            topk_insert(x, i + lane, k, vals, idx);
            th = _mm512_set1_ps(vals[k - 1]);
        }
    }
    return nan != 0;
}

int sv_topk_f32(const float* z, int n, long V, int k, float* vals, int64_t* idx, int threads) {
    return topk_rows(topk_row, z, n, V, k, vals, idx, threads);
}

/* ---- top-k and log-sum-exp of fp32 rows: the successor store's confidences (engine.store.topk_probs) ----------
 *
 * UniSpec and Token Recycling keep, per token, the target's top-k and their probabilities exp(z - lse(z)) (UniSpec
 * §3.1): the top-k pass above, then one pass summing exp(z - max) (the max is the top-1) with `exp_ps`, each of the
 * 16 lanes accumulated in fp64. torch.logsumexp on one thread spends ~3 ns a logit in its exp (38 ms for a
 * 200-token prompt over a 49k vocabulary); this pass takes a tenth of that. lse[r] is NaN where the caller must
 * ask torch instead: a row holding NaN, +inf, or fewer than k values above -inf. */
/* sum of exp(z - mx) over a row, each of the 16 lanes accumulated in fp64 (two fp64 halves), then reduced */
static double expsum16(const float* zr, long V, float mx) {
    const __m512 mv = _mm512_set1_ps(mx);
    __m512d s0 = _mm512_setzero_pd(), s1 = _mm512_setzero_pd();
    for (long i = 0; i < V; i += 16) {
        const __mmask16 live = V - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (V - i)) - 1);
        const __m512 e = _mm512_maskz_mov_ps(live, exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, zr + i), mv)));
        s0 = _mm512_add_pd(s0, _mm512_cvtps_pd(_mm512_castps512_ps256(e)));
        s1 = _mm512_add_pd(s1, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1))));
    }
    return _mm512_reduce_add_pd(_mm512_add_pd(s0, s1));
}

int sv_topk_lse_f32(const float* z, int n, long V, int k, float* vals, int64_t* idx, float* lse, int threads) {
    return topk_lse_rows(topk_row, expsum16, z, n, V, k, vals, idx, lse, threads);
}


/* ---- one decoder layer, fused (the native decode's `_layer` in exact mode, one call per layer) -------------
 *
 * Between the linears a decoder layer is a dozen elementwise steps (norms, RoPE, the cache write, residual
 * adds, the gated activation). As torch ops they cost more than the arithmetic: ~25 calls per layer, ~270 us a
 * layer on SmolLM2 (8 ms of its 27 ms forward). Here they run in one call, with the same roundings the torch
 * path makes: every intermediate torch holds in bf16 is rounded to bf16 here at the same point (a product or sum of
 * two bf16 values is exact in fp32, so rounding it gives torch's bits); the norms' sums of squares and the
 * activations' exp/tanh are computed in another (fixed) order, so those agree to rounding, not bitwise.
 * Every step is per row, so a row's bits depend on that row alone (rule 1 holds as for the linear above). */

typedef struct {
    int d, H, kvh, hd, I;            /* hidden, query heads, KV heads, head dim, MLP width */
    int din;                         /* width of the attention input: d, or 2 d (EAGLE-3's midlayer) */
    int gemma_norm;                  /* 1: out = round(h * w), w = (1 + weight) in fp32; 0: round(w * round(h)) */
    int act;                         /* 0: SiLU; 1: GELU (tanh approximation) */
    float eps;
    const float *in_norm;            /* [d] or NULL: the attention input is x itself (EAGLE-1's layer) */
    const float *q_norm, *k_norm;    /* [hd] or NULL */
    const float *post_attn_norm, *pre_mlp_norm, *post_mlp_norm;   /* [d]; post_* may be NULL */
    const uint16_t *qkv, *o, *gate_up, *down;                     /* packed as sv_linear_bf16 reads them */
    const float *qkv_bias;           /* [(H + 2 kvh) hd] or NULL */
} sv_layer_t;

/* 16 bf16 values in and out of fp32 lanes, masked at a row's end; the store rounds to nearest even (VCVTNEPS2BF16,
 * which also flushes denormals: values below 1e-38, far under what a layer's activations hold) */
static inline __mmask16 lanes(int left) { return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1); }
static inline __m512 ld(const uint16_t* p, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
static inline void st(uint16_t* p, __mmask16 m, __m512 v) { _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v)); }
static inline __m512 rnd(__m512 v) {                  /* v rounded to bf16, kept in fp32 */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

/* x [n, width] bf16 (row stride xs) -> out (row stride os): torch's RMSNorm as engine.native._rmsnorm computes it,
 * h = x / sqrt(mean(x^2) + eps) in fp32, then round(w * round(h)) (Llama) or round(h * w), w = 1 + weight (Gemma) */
static void rmsnorm(const uint16_t* x, const float* w, uint16_t* out, int n, int width, float eps, int gemma,
                    size_t xs, size_t os) {
    for (int r = 0; r < n; r++) {
        const uint16_t* xr = x + r * xs;
        uint16_t* orow = out + r * os;
        __m512 acc = _mm512_setzero_ps();
        for (int i = 0; i < width; i += 16) { __m512 v = ld(xr + i, lanes(width - i)); acc = _mm512_fmadd_ps(v, v, acc); }
        const __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(acc) / (float)width + eps));
        for (int i = 0; i < width; i += 16) {
            const __mmask16 m = lanes(width - i);
            const __m512 h = _mm512_mul_ps(ld(xr + i, m), inv), wv = _mm512_maskz_loadu_ps(m, w + i);
            st(orow + i, m, gemma ? _mm512_mul_ps(h, wv) : _mm512_mul_ps(wv, rnd(h)));
        }
    }
}

/* the gated activation, act(gate) rounded to bf16 then times up: SiLU g / (1 + exp(-g)), or GELU's tanh form
 * 0.5 g (1 + tanh(y)), y = sqrt(2 / pi) (g + 0.044715 g^3), tanh(y) = 1 - 2 / (exp(2 y) + 1) */
static inline __m512 act16(__m512 g, int act) {
    const __m512 one = _mm512_set1_ps(1.0f);
    if (act == 0) return _mm512_div_ps(g, _mm512_add_ps(one, exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g))));
    const __m512 y = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f),
                                   _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(0.044715f), g), _mm512_mul_ps(g, g), g));
    const __m512 th = _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.0f),
                                                      _mm512_add_ps(exp_ps(_mm512_add_ps(y, y)), one)));
    return _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), g), _mm512_add_ps(one, th));
}

/* out = round(x + t), n values (the residual add in bf16) */
static void add_rows(uint16_t* x, const uint16_t* t, size_t n) {
    for (size_t i = 0; i < n; i += 16) {
        const __mmask16 m = lanes((int)(n - i < 16 ? n - i : 16));
        st(x + i, m, _mm512_add_ps(ld(x + i, m), ld(t + i, m)));
    }
}

size_t sv_layer_scratch(const sv_layer_t* L, int n) {      /* bytes of scratch `sv_layer` needs for n rows */
    const size_t qkv = (size_t)(L->H + 2 * L->kvh) * L->hd, hq = (size_t)L->H * L->hd;
    return (size_t)n * (2 * ((size_t)L->din + qkv + hq + L->d + 2 * (size_t)L->I + L->d) + 4 * hq) + 64;
}

/* x [n, d] bf16, updated in place to the layer's output; attn_in [n, din] bf16 or NULL (then the attention
 * input is in_norm(x), or x where in_norm is NULL); cos, sin [n, hd] bf16 (the rows' RoPE); kc, vc [kvh, cap, hd]
 * bf16: the layer's cache, row r's k and v written at slot slots[r]; b0, tb, pos, idx, ok, window, scale: as
 * sv_attention reads them; scratch: sv_layer_scratch(L, n) bytes. */
void sv_layer(const sv_layer_t* L, uint16_t* x, const uint16_t* attn_in, const uint16_t* cos, const uint16_t* sin,
              uint16_t* kc, uint16_t* vc, long cap, const int64_t* slots, int b0, int tb, const int64_t* pos,
              const int64_t* idx, const uint8_t* ok, int window, float scale, void* scratch, int n, int threads) {
    const int d = L->d, H = L->H, kvh = L->kvh, hd = L->hd, I = L->I, din = L->din;
    const int nqkv = (H + 2 * kvh) * hd, hq = H * hd, half = hd / 2;
    uint16_t* h = (uint16_t*)scratch;                    /* [n, din] attention input */
    uint16_t* qkv = h + (size_t)n * din;                 /* [n, nqkv] */
    uint16_t* a = qkv + (size_t)n * nqkv;                /* [n, hq] attention output, bf16 */
    uint16_t* t = a + (size_t)n * hq;                    /* [n, d] o-proj / down-proj output */
    uint16_t* gu = t + (size_t)n * d;                    /* [n, 2 I] gate | up, then the activation in gate */
    uint16_t* hn = gu + (size_t)n * 2 * I;               /* [n, d] the MLP's input */
    float* af = (float*)(((uintptr_t)(hn + (size_t)n * d) + 63) & ~(uintptr_t)63);   /* [n, H, hd] fp32 */

    const uint16_t* hin = attn_in;
    if (!hin) {
        if (L->in_norm) { rmsnorm(x, L->in_norm, h, n, d, L->eps, L->gemma_norm, d, d); hin = h; }
        else hin = x;
    }
    sv_linear_bf16(hin, L->qkv, L->qkv_bias, qkv, 0, n, nqkv, din, threads);
    for (int r = 0; r < n; r++) {
        uint16_t* row = qkv + (size_t)r * nqkv;
        if (L->q_norm) {                                  /* q/k RMSNorm over the head dim (qwen3, gemma3) */
            rmsnorm(row, L->q_norm, row, H, hd, L->eps, L->gemma_norm, hd, hd);
            rmsnorm(row + hq, L->k_norm, row + hq, kvh, hd, L->eps, L->gemma_norm, hd, hd);
        }
        const uint16_t* c = cos + (size_t)r * hd;
        const uint16_t* s = sin + (size_t)r * hd;
        for (int j = 0; j < H + kvh; j++) {               /* RoPE on q and k: x c + rotate_half(x) s, in bf16 */
            uint16_t* v = row + (size_t)j * hd;
            for (int i = 0; i < half; i += 16) {
                const __mmask16 m = lanes(half - i);
                const __m512 lo = ld(v + i, m), hi = ld(v + half + i, m);
                const __m512 c0 = ld(c + i, m), c1 = ld(c + half + i, m), s0 = ld(s + i, m), s1 = ld(s + half + i, m);
                const __m512 nhi = _mm512_sub_ps(_mm512_setzero_ps(), hi);
                st(v + i, m, _mm512_add_ps(rnd(_mm512_mul_ps(lo, c0)), rnd(_mm512_mul_ps(nhi, s0))));
                st(v + half + i, m, _mm512_add_ps(rnd(_mm512_mul_ps(hi, c1)), rnd(_mm512_mul_ps(lo, s1))));
            }
        }
        for (int j = 0; j < kvh; j++) {                   /* the cache write */
            memcpy(kc + ((size_t)j * cap + slots[r]) * hd, row + hq + (size_t)j * hd, 2 * (size_t)hd);
            memcpy(vc + ((size_t)j * cap + slots[r]) * hd, row + hq + (size_t)(kvh + j) * hd, 2 * (size_t)hd);
        }
        float* qf = af + (size_t)r * hq;                  /* q in fp32 for the attention (as q.float()) */
        for (int i = 0; i < hq; i += 16) _mm512_mask_storeu_ps(qf + i, lanes(hq - i), ld(row + i, lanes(hq - i)));
    }
    /* the attention reads q from af and writes its output over it (each (row, head) reads its q first) */
    sv_attention(af, kc, vc, pos, idx, ok, af, n, H, kvh, hd, cap, b0, tb, window, scale, threads);
    for (size_t i = 0; i < (size_t)n * hq; i += 16) {
        const __mmask16 m = lanes((int)((size_t)n * hq - i < 16 ? (size_t)n * hq - i : 16));
        st(a + i, m, _mm512_maskz_loadu_ps(m, af + i));
    }
    sv_linear_bf16(a, L->o, NULL, t, 0, n, d, hq, threads);
    if (L->post_attn_norm) rmsnorm(t, L->post_attn_norm, t, n, d, L->eps, L->gemma_norm, d, d);
    add_rows(x, t, (size_t)n * d);
    rmsnorm(x, L->pre_mlp_norm, hn, n, d, L->eps, L->gemma_norm, d, d);
    sv_linear_bf16(hn, L->gate_up, NULL, gu, 0, n, 2 * I, d, threads);
    for (int r = 0; r < n; r++) {
        uint16_t* g = gu + (size_t)r * 2 * I;
        uint16_t* o = gu + (size_t)r * I;                 /* compacted to [n, I] for the down-proj (o <= g) */
        for (int i = 0; i < I; i += 16) {
            const __mmask16 m = lanes(I - i);
            st(o + i, m, _mm512_mul_ps(rnd(act16(ld(g + i, m), L->act)), ld(g + I + i, m)));
        }
    }
    sv_linear_bf16(gu, L->down, NULL, t, 0, n, d, I, threads);
    if (L->post_mlp_norm) rmsnorm(t, L->post_mlp_norm, t, n, d, L->eps, L->gemma_norm, d, d);
    add_rows(x, t, (size_t)n * d);
}
