/* The kernels with no vector code: UniSpec's draft tree and MicroSpec's window step (integer and scalar work,
 * O(tree) and O(entries) per step). Not a library of its own: kernels/cpu.c (AVX-512) and kernels/cpu_avx2.c
 * (AVX2) each #include it, so every x86 CPU either build runs on has them; kernels.cpu.builds' `provider` finds the
 * one loaded, and its build hash covers this file. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The row loops of the top-k passes of both builds (kernels/cpu.c, kernels/cpu_avx2.c), around their vector row
 * functions: `row` the top-k of one row (returns whether it held NaN), `expsum` the sum of exp(z - mx) over one
 * row in fp64. lse[r] = max + log(expsum), or NaN where the caller must ask torch: a row holding NaN, +inf, or
 * fewer than k values above -inf. */
typedef int (*sv_topk_row_fn)(const float* z, long V, int k, float* vals, int64_t* idx);
typedef double (*sv_expsum_fn)(const float* z, long V, float mx);

static int topk_rows(sv_topk_row_fn row, const float* z, int n, long V, int k, float* vals, int64_t* idx,
                     int threads) {
    int nan = 0;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(|:nan) if (threads > 1 && n > 1)
    for (int r = 0; r < n; r++) nan |= row(z + (size_t)r * V, V, k, vals + (size_t)r * k, idx + (size_t)r * k);
    return nan;
}

static int topk_lse_rows(sv_topk_row_fn row, sv_expsum_fn expsum, const float* z, int n, long V, int k, float* vals,
                         int64_t* idx, float* lse, int threads) {
    int bad = 0;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(|:bad) if (threads > 1 && n > 1)
    for (int r = 0; r < n; r++) {
        const float* zr = z + (size_t)r * V;
        float* vr = vals + (size_t)r * k;
        int64_t* ir = idx + (size_t)r * k;
        if (row(zr, V, k, vr, ir) || ir[k - 1] < 0 || isinf(vr[0])) { lse[r] = NAN; bad = 1; continue; }
        lse[r] = (float)((double)vr[0] + log(expsum(zr, V, vr[0])));
    }
    return bad;
}

/* x (at index i), which beats the k-th best, into the sorted top-k (vals descending, idx): the top-k passes of
 * both builds (kernels/cpu.c `topk_row`, kernels/cpu_avx2.c `topk_row8`); equal values keep the lower index */
static inline void topk_insert(float x, long i, int k, float* vals, int64_t* idx) {
    int j = k - 1;
    while (j > 0 && x > vals[j - 1]) { vals[j] = vals[j - 1]; idx[j] = idx[j - 1]; j--; }
    vals[j] = x;
    idx[j] = i;
}

/* ---- UniSpec's draft tree (UniSpec Alg. 1 l.16-30, App. A) ---------------------------------------------------
 *
 * engine.drafters.unispec.build_unispec_tree is the reference, node for node and bit for bit: the same pool
 * (level 1 = S[root] (+) C sorted by confidence, duplicates and empty slots dropped; each deeper level the store
 * rows of the previous level's frontier - its top-k scores >= r - row-major), the same scores (path: the
 * parent's score times the stored probability, one fp32 multiply), the same selection (the first g eligible
 * nodes by bottleneck confidence desc, depth asc, pool index asc) and the same re-indexing (depth, then rank).
 * Every torch sort there is stable; here each sort key ends with the index, so the order is the same total
 * order. The torch version is ~40 small ops a step (~0.8 ms on a CPU); this is one call of a few microseconds.
 * Returns the node count (root included), or -1 when root or a cache token is outside [0, V) (the caller then
 * runs the reference, which names the problem). */
typedef struct { float key; int depth; int idx; } sv_rank_t;

static int rank_cmp(const void* a, const void* b) {          /* key desc, depth asc, idx asc */
    const sv_rank_t *x = (const sv_rank_t*)a, *y = (const sv_rank_t*)b;
    if (x->key != y->key) return x->key > y->key ? -1 : 1;
    if (x->depth != y->depth) return x->depth < y->depth ? -1 : 1;
    return (x->idx > y->idx) - (x->idx < y->idx);
}

/* indices (into s[0..m)) of the top-k scores that are >= r, best first (ties: lower index first) */
static int frontier(const float* s, int m, int k, float r, sv_rank_t* tmp, int* out) {
    for (int i = 0; i < m; i++) { tmp[i].key = s[i]; tmp[i].depth = 0; tmp[i].idx = i; }
    qsort(tmp, m, sizeof(sv_rank_t), rank_cmp);
    int f = 0;
    for (int i = 0; i < m && i < k; i++)
        if (tmp[i].key >= r) out[f++] = tmp[i].idx;
    return f;
}

long sv_unispec_tree(long root, const int64_t* stok, const float* scon, long V, int ks, const int64_t* ctok,
                     const float* ccon, int kc, int k, int depth, float r, int g, int path, float min_score,
                     int exclude_root, int64_t* out_tok, int64_t* out_par, float* out_score) {
    if (root < 0 || root >= V) return -1;
    for (int i = 0; i < kc; i++) if (ctok[i] < 0 || ctok[i] >= V) return -1;
    const int m0 = ks + kc, cap = m0 + (depth > 1 ? (depth - 1) * k * ks : 0);
    int64_t* tok = malloc(sizeof(int64_t) * cap);
    float* score = malloc(sizeof(float) * cap);
    float* eff = malloc(sizeof(float) * cap);
    int* parent = malloc(sizeof(int) * cap);
    int* dep = malloc(sizeof(int) * cap);
    int* fr = malloc(sizeof(int) * cap);
    int* newi = malloc(sizeof(int) * cap);
    sv_rank_t* tmp = malloc(sizeof(sv_rank_t) * cap);
    /* level 1: S[root] then C, sorted by confidence (stable), duplicates after their best copy and empty slots out */
    int64_t t0[m0 > 0 ? m0 : 1];
    float c0[m0 > 0 ? m0 : 1];
    for (int j = 0; j < ks; j++) { t0[j] = stok[root * ks + j]; c0[j] = scon[root * ks + j]; }
    for (int j = 0; j < kc; j++) { t0[ks + j] = ctok[j]; c0[ks + j] = (exclude_root && ctok[j] == root) ? 0.0f : ccon[j]; }
    for (int i = 0; i < m0; i++) { tmp[i].key = c0[i]; tmp[i].depth = 0; tmp[i].idx = i; }
    qsort(tmp, m0, sizeof(sv_rank_t), rank_cmp);
    int P = 0;
    for (int i = 0; i < m0; i++) {
        const int64_t t = t0[tmp[i].idx];
        int seen = 0;
        for (int j = 0; j < i && !seen; j++) seen = t0[tmp[j].idx] == t;
        if (!seen && tmp[i].key > 0) { tok[P] = t; score[P] = tmp[i].key; parent[P] = -1; dep[P] = 1; P++; }
    }
    /* levels 2..depth: the frontier's store rows, row-major */
    int lo = 0, hi = P;
    int f = frontier(score + lo, hi - lo, k, r, tmp, fr);
    for (int lvl = 2; lvl <= depth && f > 0; lvl++) {
        for (int a = 0; a < f; a++) {
            const int pi = lo + fr[a];
            const int64_t* row_t = stok + tok[pi] * ks;
            const float* row_c = scon + tok[pi] * ks;
            for (int j = 0; j < ks; j++) {
                if (!(row_c[j] > 0)) continue;
                tok[P] = row_t[j];
                score[P] = path ? score[pi] * row_c[j] : row_c[j];
                parent[P] = pi;
                dep[P] = lvl;
                P++;
            }
        }
        lo = hi;
        hi = P;
        f = frontier(score + lo, hi - lo, k, r, tmp, fr);
    }
    /* selection: bottleneck confidence, the first g eligible nodes */
    int n = 0;
    for (int i = 0; i < P; i++) {
        eff[i] = parent[i] < 0 ? score[i] : (score[i] < eff[parent[i]] ? score[i] : eff[parent[i]]);
        if (score[i] >= min_score && score[i] > 0) { tmp[n].key = eff[i]; tmp[n].depth = dep[i]; tmp[n].idx = i; n++; }
    }
    qsort(tmp, n, sizeof(sv_rank_t), rank_cmp);
    const int chosen = n < g ? n : g;
    /* re-index: depth asc, then selection rank (tmp[0..chosen) is in rank order: one pass per depth) */
    int* order = fr;
    int o = 0;
    for (int d = 1; d <= depth; d++)
        for (int i = 0; i < chosen; i++)
            if (dep[tmp[i].idx] == d) order[o++] = tmp[i].idx;
    for (int i = 0; i < P; i++) newi[i] = -1;
    for (int i = 0; i < chosen; i++) newi[order[i]] = i + 1;
    out_tok[0] = root; out_par[0] = -1; out_score[0] = 1.0f;
    for (int i = 0; i < chosen; i++) {
        const int pi = order[i];
        out_tok[i + 1] = tok[pi];
        out_par[i + 1] = parent[pi] < 0 ? 0 : newi[parent[pi]];
        out_score[i + 1] = score[pi];
    }
    free(tok); free(score); free(eff); free(parent); free(dep); free(fr); free(newi); free(tmp);
    return chosen + 1;
}

/* ---- MicroSpec's window step (kernels/window.py `_window_step_torch` is the reference: the same state, the same
 * slot assignment, bit for bit) ---------------------------------------------------------------------------------
 *
 * One step's entries [m] (m <= W; negative = padding) are pushed into the ring (fifo_unique: only the first
 * occurrence of each token not active at the start of the step), counts follow, then Eq. 4 commits: evicted tokens
 * whose count fell to 0 leave (first occurrence in lane order; their rows pushed on the free stack in that order),
 * then pushed tokens not active at the start of the step enter (first occurrence in push order; each pops the
 * stack's top). Every mask is taken before any of active / slot_of changes, as in the vectorised reference.
 * `mark` [V] is scratch holding INT32_MAX everywhere on entry, and again on return (the Triton kernel's
 * first_pos). Writes the gather list (slots, tokens; -1 past the count) into out_slots / out_tokens [m] and
 * returns the count. The work is O(m), independent of V and W. */
long sv_window_step(const int64_t* entries, int m, int fifo_unique, int32_t* ring, int W, int64_t* ring_head,
                    int64_t* stream_len, int32_t* cnt, uint8_t* active, int32_t* slot_of, int32_t* tok_of_slot,
                    int32_t* free_slots, int64_t* free_top, int32_t* mark, int64_t* e, int64_t* old,
                    uint8_t* flag, int64_t* out_slots, int64_t* out_tokens) {
    const int32_t IDLE = 2147483647;
    int n = 0;                                            /* the pushed entries e[0 .. n) in order */
    for (int k = 0; k < m; k++) {
        const int64_t v = entries[k];
        if (v < 0) continue;
        if (fifo_unique) {
            if (active[v] || mark[v] != IDLE) continue;
            mark[v] = k;
        }
        e[n++] = v;
    }
    if (fifo_unique) for (int j = 0; j < n; j++) mark[e[j]] = IDLE;
    /* the push: lane k < n overwrites ring position (ring_head + k) % W, distinct since m <= W */
    for (int k = 0; k < n; k++) {
        const long pos = (long)((*ring_head + k) % W);
        old[k] = ring[pos];
        ring[pos] = (int32_t)e[k];
        if (old[k] >= 0) cnt[old[k]] -= 1;
    }
    for (int k = 0; k < n; k++) cnt[e[k]] += 1;
    *ring_head += n;
    *stream_len += n;
    /* the masks, all against the state at the start of the commit */
    for (int k = 0; k < n; k++) {                         /* flag bit 0: leave, bit 1: enter */
        uint8_t f = 0;
        const int64_t o = old[k];
        if (o >= 0 && mark[o] == IDLE) { mark[o] = k; if (cnt[o] == 0 && active[o]) f |= 1; }
        flag[k] = f;
    }
    for (int k = 0; k < n; k++) if (old[k] >= 0) mark[old[k]] = IDLE;
    for (int k = 0; k < n; k++) {
        const int64_t v = e[k];
        if (mark[v] == IDLE) { mark[v] = k; if (!active[v]) flag[k] |= 2; }
    }
    for (int k = 0; k < n; k++) mark[e[k]] = IDLE;
    /* leave: free rows, pushed on the stack in lane order */
    int64_t top = *free_top;
    for (int k = 0; k < n; k++) {
        if (!(flag[k] & 1)) continue;
        const int64_t t = old[k];
        const int32_t s = slot_of[t];
        free_slots[top++] = s;
        if (s >= 0) tok_of_slot[s] = -1;
        slot_of[t] = -1;
        active[t] = 0;
    }
    /* enter: rows popped from the stack top, in push order */
    long count = 0;
    for (int k = 0; k < n; k++) {
        if (!(flag[k] & 2)) continue;
        const int64_t t = e[k];
        const int32_t s = free_slots[top - 1 - count];
        slot_of[t] = s;
        tok_of_slot[s] = (int32_t)t;
        active[t] = 1;
        out_slots[count] = s;
        out_tokens[count] = t;
        count++;
    }
    *free_top = top - count;
    for (long j = count; j < m; j++) { out_slots[j] = -1; out_tokens[j] = -1; }
    return count;
}
