/* Paged attention for CPU engines: each query row attends over the first n tokens of its sequence in the KV pool,
 * read in place through the block table (no gather into a padded copy, no mask over padding).
 *
 * Layout (kernels/__init__.py): k_cache, v_cache [num_blocks, block_size, Hkv, D] fp32, contiguous;
 * q and out [R, Hq, D] fp32, contiguous; block_tables [num_seqs, bt_stride] int32. Row r is a query token of
 * sequence row_seq[r] that attends to that sequence's first row_len[r] pool tokens: a decode row attends to the
 * whole context, prefill token i of a chunk to the tokens up to its own position (causal), so one call serves
 * decode rows, prefill chunks and mixed batches alike.
 *
 * One work item = one query row, all its heads: each KV block is a contiguous run of bs * Hkv * D values, read
 * front to back (the next block is prefetched while this one is read), and every K/V row loaded serves its GQA
 * group's query heads. Two passes over the context: scores (q . k * scale) into a scratch row per query head,
 * softmax, then the probability-weighted sum of V. Rows are spread over OpenMP threads (torch's own libgomp when
 * torch is loaded first). A row's arithmetic does not depend on the other rows of the batch, so a sequence's
 * output is the same whatever it is batched with.
 *
 * Non-finite input: a NaN score, or a +inf maximum, makes that row's output NaN (as softmax would), so the
 * engine's non-finite-logits check still sees it. Built with reassociation allowed (vectorised dot products) but
 * without -ffinite-math-only, so the NaN tests are kept.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* exp(x) for x <= 0 (softmax after subtracting the max): Cody-Waite range reduction and a degree-6 polynomial,
 * relative error ~2e-7 on [-87, 0]; below that it returns 0. Plain arithmetic, so the loop vectorises. */
static inline float exp_nonpos(float x) {
    const float log2e = 1.44269504088896341f, ln2_hi = 0.693359375f, ln2_lo = -2.12194440e-4f;
    x = x < -87.0f ? -87.0f : x;
    float n = floorf(x * log2e + 0.5f);
    float r = x - n * ln2_hi - n * ln2_lo;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { uint32_t u; float f; } scale;
    scale.u = (uint32_t)((int32_t)n + 127) << 23;
    return p * scale.f;
}

/* Token j of m in the current block prefetches its share of the next block's cache lines (a block is one
 * contiguous run of blk_floats values), so the whole next block is on its way before it is read. */
static inline void prefetch_share(const char *next, int64_t j, int64_t m, int64_t blk_floats) {
    const int64_t lines = blk_floats * (int64_t)sizeof(float) / 64, per = (lines + m - 1) / m;
    for (int64_t l = j * per; l < (j + 1) * per && l < lines; l++) __builtin_prefetch(next + l * 64);
}

/* All query heads of one row over the first n pool tokens of its sequence. Each block's K rows (all kv heads) are one
 * contiguous bs * Hkv * D run, read front to back; likewise V. scores: Hq * n scratch, inv_sum: Hq. */
static inline __attribute__((always_inline)) void
attend(const float *q, const float *k_cache, const float *v_cache, const int32_t *table, int64_t n, float *out,
       float *scores, float *inv_sum, int64_t Hq, int64_t Hkv, const int64_t D, int64_t bs, float scale) {
    const int64_t G = Hq / Hkv, blk_stride = bs * Hkv * D;
    int nan = 0;
    for (int64_t t0 = 0; t0 < n; t0 += bs) {
        const int64_t m = n - t0 < bs ? n - t0 : bs;
        const float *kb = k_cache + (int64_t)table[t0 / bs] * blk_stride;
        const char *next = t0 + bs < n ? (const char *)(k_cache + (int64_t)table[t0 / bs + 1] * blk_stride) : NULL;
        for (int64_t j = 0; j < m; j++) {
            if (next) prefetch_share(next, j, m, blk_stride);
            for (int64_t hq = 0; hq < Hq; hq++) {
                const float *qh = q + hq * D, *kt = kb + (j * Hkv + hq / G) * D;
                float s = 0.0f;
                for (int64_t d = 0; d < D; d++) s += qh[d] * kt[d];
                s *= scale;
                nan |= s != s;
                scores[hq * n + t0 + j] = s;
            }
        }
    }
    for (int64_t hq = 0; hq < Hq; hq++) {
        float *sh = scores + hq * n;
        float mx = -INFINITY, sum = 0.0f;
        for (int64_t t = 0; t < n; t++) mx = sh[t] > mx ? sh[t] : mx;
        nan |= mx == INFINITY;
        for (int64_t t = 0; t < n; t++) {
            float p = exp_nonpos(sh[t] - mx);
            sh[t] = p;
            sum += p;
        }
        inv_sum[hq] = 1.0f / sum;
    }
    if (nan) {  /* as softmax would: a NaN score or a +inf maximum poisons the output */
        for (int64_t i = 0; i < Hq * D; i++) out[i] = NAN;
        return;
    }
    memset(out, 0, (size_t)(Hq * D) * sizeof(float));
    for (int64_t t0 = 0; t0 < n; t0 += bs) {
        const int64_t m = n - t0 < bs ? n - t0 : bs;
        const float *vb = v_cache + (int64_t)table[t0 / bs] * blk_stride;
        const char *next = t0 + bs < n ? (const char *)(v_cache + (int64_t)table[t0 / bs + 1] * blk_stride) : NULL;
        for (int64_t j = 0; j < m; j++) {
            if (next) prefetch_share(next, j, m, blk_stride);
            for (int64_t hq = 0; hq < Hq; hq++) {
                const float p = scores[hq * n + t0 + j], *vt = vb + (j * Hkv + hq / G) * D;
                float *oh = out + hq * D;
                for (int64_t d = 0; d < D; d++) oh[d] += p * vt[d];
            }
        }
    }
    for (int64_t hq = 0; hq < Hq; hq++)
        for (int64_t d = 0; d < D; d++) out[hq * D + d] *= inv_sum[hq];
}

/* attend() compiled for the common head dims as constants (unrolled, vectorised dot products), and for any other */
#define ATTEND_ARGS const float *q, const float *kc, const float *vc, const int32_t *table, int64_t n, float *out, \
    float *scores, float *inv_sum, int64_t Hq, int64_t Hkv, int64_t D, int64_t bs, float scale
static void attend_d64(ATTEND_ARGS) { (void)D; attend(q, kc, vc, table, n, out, scores, inv_sum, Hq, Hkv, 64, bs, scale); }
static void attend_d128(ATTEND_ARGS) { (void)D; attend(q, kc, vc, table, n, out, scores, inv_sum, Hq, Hkv, 128, bs, scale); }
static void attend_any(ATTEND_ARGS) { attend(q, kc, vc, table, n, out, scores, inv_sum, Hq, Hkv, D, bs, scale); }

/* Returns 0; -1 when scratch memory could not be allocated; -2 when a row names a sequence outside
 * [0, num_seqs) or a block table entry it would read lies outside [0, num_blocks) (checked before anything is
 * read, so a bad table raises in the caller instead of crashing). */
int paged_attention_f32(const float *q, const float *k_cache, const float *v_cache, const int32_t *block_tables,
                        int64_t bt_stride, const int32_t *row_seq, const int32_t *row_len, float *out, int64_t R,
                        int64_t Hq, int64_t Hkv, int64_t D, int64_t bs, int64_t num_blocks, int64_t num_seqs,
                        float scale, int num_threads) {
    int64_t max_n = 0;
    for (int64_t r = 0; r < R; r++) {
        const int64_t b = row_seq[r], n = row_len[r];
        if (b < 0 || b >= num_seqs || n > bt_stride * bs) return -2;
        max_n = n > max_n ? n : max_n;
        for (int64_t i = 0; i < (n + bs - 1) / bs; i++) {
            const int32_t blk = block_tables[b * bt_stride + i];
            if (blk < 0 || blk >= num_blocks) return -2;
        }
    }
    void (*attend_row)(ATTEND_ARGS) = D == 64 ? attend_d64 : D == 128 ? attend_d128 : attend_any;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *scores = (float *)malloc((size_t)(Hq * (max_n + 1)) * sizeof(float));
        if (scores == NULL) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < R; r++) {
            const int64_t n = row_len[r];
            float *o = out + r * Hq * D;
            if (scores == NULL) continue;
            if (n <= 0) {
                memset(o, 0, (size_t)(Hq * D) * sizeof(float));
                continue;
            }
            attend_row(q + r * Hq * D, k_cache, v_cache, block_tables + (int64_t)row_seq[r] * bt_stride, n, o, scores,
                   scores + Hq * n, Hq, Hkv, D, bs, scale);
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
