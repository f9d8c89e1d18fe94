/* The fp32 small-row linear for x86 CPUs with AVX2 and FMA but no AVX-512 (most laptops and desktops: Intel's
 * client cores since Alder Lake, AMD before Zen 4): out[m, n] = sum_k x[m, k] w[n, k] (+ bias[n]), fp32.
 *
 * Built and loaded by kernels/cpu.py where kernels/cpu.c (AVX-512) cannot run, or where SPECVOCAB_CPU_ISA=avx2
 * asks for it; its plain-torch reference is `linear_reason`'s neighbour there, `linear_reference`. It is
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
