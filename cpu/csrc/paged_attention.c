/* Paged attention for CPU engines: each query row attends over the first n tokens of its sequence in the KV pool,
 * read in place through the block table (no gather into a padded copy, no mask over padding).
 *
 * Layout (kernels/__init__.py): k_cache, v_cache [num_blocks, block_size, Hkv, D] fp32, contiguous;
 * q and out [R, Hq, D] fp32, contiguous; block_tables [num_seqs, bt_stride] int32. Row r is a query token of
 * sequence row_seq[r] that attends to that sequence's first row_len[r] pool tokens: a decode row attends to the
 * whole context, prefill token i of a chunk to the tokens up to its own position (causal), so one call serves
 * decode rows, prefill chunks and mixed batches alike.
 *
 * One work item = one query row, all its heads, one head at a time: scores (q . k * scale) into a scratch row,
 * softmax, then the probability-weighted sum of V in registers. The row's blocks lie anywhere in the pool, so
 * while a row is computed the cache lines of the next row's K and V are requested (the hardware prefetcher cannot
 * guess a block table), a few at a time, paced by the score passes (`pf_cursor`); the query heads of a GQA group
 * then read their kv head from cache. With AVX, the
 * scores of up to 8 consecutive tokens of a block are reduced across lanes together (dot8), every token of the
 * row through it, so a token's score does not depend on the block size (a request's KV moves between engines of
 * different block sizes and decodes on bit for bit). Head dims
 * that are a multiple of 8 use 8-lane vectors explicitly (GCC/Clang vector extensions: the compiler otherwise
 * vectorised the V sum across tokens, with gathers); 16, 32, 64 and 128 are compiled as constants. Rows are
 * spread over OpenMP threads (torch's own libgomp when torch is loaded first). A row's arithmetic does not depend
 * on the other rows of the batch, so a sequence's output is the same whatever it is batched with.
 *
 * Non-finite input: a NaN score, or a +inf maximum, makes that row's output NaN (as softmax would), so the
 * engine's non-finite-logits check still sees it. Built with reassociation allowed (vectorised dot products) but
 * without -ffinite-math-only, so the NaN tests are kept.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX__)
#include <immintrin.h>
#endif

#include "exp_nonpos.h"

/* 8 floats as one value (GCC/Clang vector extension): arithmetic on it is lane-wise; v8u loads and stores at any
 * float alignment. */
typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));

/* The next row's K and V cache lines, requested a few at a time while this row computes: K then V of each block in
 * turn, `pairs` K lines and the V lines at the same offsets per call. Requesting them all at once when a row starts
 * (~560 lines at 140 tokens of 2 kv heads x 16) filled the core's miss buffers and stalled the row behind them: the
 * kernel then took its compute time plus its memory time. Paced by the score passes (one line per query head and
 * token, so the next row's lines are all requested by the time this row's last head is scored), 256 rows x ~140
 * tokens inside the long vs-TRL job's engine took 0.384-0.412 s of paged attention a round instead of
 * 0.436-0.457 (bench/results/cpu-vs-trl.md). Only when to ask changes: the arithmetic, hence the output, does not. */
typedef struct {
    const char *k, *v;
    const int32_t *table;   /* NULL: nothing (left) to request */
    int64_t n, bs, tok_bytes, blk_bytes, b, off, bytes;
} pf_cursor;

static inline void pf_start(pf_cursor *c, const float *k_cache, const float *v_cache, const int32_t *table, int64_t n,
                            int64_t bs, int64_t tok_floats) {
    c->k = (const char *)k_cache, c->v = (const char *)v_cache, c->table = n > 0 ? table : NULL;
    c->n = n, c->bs = bs, c->tok_bytes = tok_floats * (int64_t)sizeof(float), c->blk_bytes = bs * c->tok_bytes;
    c->b = 0, c->off = 0, c->bytes = (n < bs ? n : bs) * c->tok_bytes;
}

static inline __attribute__((always_inline)) void pf_issue(pf_cursor *c, int pairs) {
    for (; pairs > 0 && c->table != NULL; pairs--) {
        if (c->off >= c->bytes) {  /* this block's lines are all requested: on to the next block */
            if (++c->b * c->bs >= c->n) {
                c->table = NULL;
                return;
            }
            const int64_t m = c->n - c->b * c->bs < c->bs ? c->n - c->b * c->bs : c->bs;
            c->off = 0, c->bytes = m * c->tok_bytes;
        }
        const int64_t at = (int64_t)c->table[c->b] * c->blk_bytes + c->off;
        __builtin_prefetch(c->k + at, 0, 2);
        __builtin_prefetch(c->v + at, 0, 2);
        c->off += 64;
    }
}

#if defined(__AVX__)
/* The dot products of q with up to 8 consecutive tokens' keys (D a multiple of 8): per token a vector of lane-wise
 * products, then the 8 vectors summed across lanes together (a transpose by horizontal adds), one score per lane.
 * A lane's sum involves only its own token, in an order fixed by D, so a token's score has the same bits in a
 * full group or a partial one: a row's output depends neither on its batch nor on the block size. */
static inline __m256 dot8(const float *restrict k, int64_t tok_stride, const v8u *qv, const int64_t D, int cnt) {
    __m256 a[8];
    for (int i = 0; i < 8; i++) {  /* lanes past the cnt tokens there are repeat the last one (never stored) */
        const v8u *kv = (const v8u *)(k + (i < cnt ? i : cnt - 1) * tok_stride);
        v8 p = qv[0] * kv[0];
        for (int64_t c = 1; c < D / 8; c++) p += qv[c] * kv[c];
        a[i] = (__m256)p;
    }
    const __m256 h01 = _mm256_hadd_ps(a[0], a[1]), h23 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 h45 = _mm256_hadd_ps(a[4], a[5]), h67 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 lo = _mm256_hadd_ps(h01, h23), hi = _mm256_hadd_ps(h45, h67);  /* half sums, 128-bit lanes */
    return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
}

static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}
#endif

/* All query heads of one row over the first n pool tokens of its sequence, one query head at a time: its scores
 * (q . k * scale, token order) into a scratch row, softmax, then the probability-weighted sum of V in a local
 * accumulator (registers when D is a compile-time constant). A head reads its kv head's D values in each token's
 * row of the block; the row's blocks stay in cache across its GQA group. scores: Hq * n scratch. */
static inline __attribute__((always_inline)) void
attend(const float *restrict q, const float *restrict k_cache, const float *restrict v_cache,
       const int32_t *restrict table, int64_t n, float *restrict out, float *restrict scores, int64_t Hq,
       int64_t Hkv, const int64_t D, int64_t bs, float scale, pf_cursor *pf) {
    const int64_t G = Hq / Hkv, blk_stride = bs * Hkv * D, tok_stride = Hkv * D;
    int nan = 0;
    for (int64_t hq = 0; hq < Hq; hq++) {
        const int64_t h = hq / G;
        const float *restrict qh = q + hq * D;
        float *restrict sh = scores + hq * n;
        float mx = -INFINITY;
        for (int64_t t0 = 0; t0 < n; t0 += bs) {
            const int64_t m = n - t0 < bs ? n - t0 : bs;
            const float *restrict kb = k_cache + (int64_t)table[t0 / bs] * blk_stride + h * D;
            int64_t j = 0;
#if defined(__AVX__)
            if (D % 8 == 0) {  /* 8 tokens at a time: their 8 lane-wise product vectors reduced together */
                const v8u *qv = (const v8u *)qh;
                const __m256 sc = _mm256_set1_ps(scale);
                __m256 vmx = _mm256_set1_ps(mx), bad = _mm256_setzero_ps();
                for (; j + 8 <= m; j += 8) {
                    pf_issue(pf, 4);
                    const __m256 s8 = _mm256_mul_ps(dot8(kb + j * tok_stride, tok_stride, qv, D, 8), sc);
                    bad = _mm256_or_ps(bad, _mm256_cmp_ps(s8, s8, _CMP_UNORD_Q));
                    vmx = _mm256_max_ps(vmx, s8);
                    _mm256_storeu_ps(sh + t0 + j, s8);
                }
                nan |= _mm256_movemask_ps(bad) != 0;
                mx = hmax8(vmx);
                if (j < m) {  /* the block's last m - j < 8 tokens: the same arithmetic, the valid lanes kept */
                    float s8[8];
                    _mm256_storeu_ps(s8, _mm256_mul_ps(dot8(kb + j * tok_stride, tok_stride, qv, D, (int)(m - j)),
                                                       sc));
                    for (int i = 0; j < m; i++, j++) {
                        nan |= s8[i] != s8[i];
                        mx = s8[i] > mx ? s8[i] : mx;
                        sh[t0 + j] = s8[i];
                    }
                }
            }
#endif
            for (; j < m; j++) {
                if (j & 1)
                    pf_issue(pf, 1);
                const float *restrict kt = kb + j * tok_stride;
                float s = 0.0f;
                if (D % 8 == 0) {  /* lane-wise products summed in a vector, then across its 8 lanes */
                    const v8u *kv = (const v8u *)kt, *qv = (const v8u *)qh;
                    v8 a = qv[0] * kv[0];
                    for (int64_t c = 1; c < D / 8; c++) a += qv[c] * kv[c];
                    s = ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
                } else {
                    for (int64_t d = 0; d < D; d++) s += qh[d] * kt[d];
                }
                s *= scale;
                nan |= s != s;
                mx = s > mx ? s : mx;
                sh[t0 + j] = s;
            }
        }
        nan |= mx == INFINITY;
        float sum = 0.0f;
        for (int64_t t = 0; t < n; t++) {
            const float p = exp_nonpos(sh[t] - mx);
            sh[t] = p;
            sum += p;
        }
        const float inv = 1.0f / sum;
        if (D % 8 == 0) {  /* acc in D / 8 vector registers, one FMA per 8 values (lanes never mix) */
            v8 acc[D / 8 > 0 ? D / 8 : 1];
            for (int64_t c = 0; c < D / 8; c++) acc[c] = (v8){0};
            for (int64_t t0 = 0; t0 < n; t0 += bs) {
                const int64_t m = n - t0 < bs ? n - t0 : bs;
                const float *restrict vb = v_cache + (int64_t)table[t0 / bs] * blk_stride + h * D;
                for (int64_t j = 0; j < m; j++) {
                    const float p = sh[t0 + j];
                    const v8u *vt = (const v8u *)(vb + j * tok_stride);
                    for (int64_t c = 0; c < D / 8; c++) acc[c] += p * vt[c];
                }
            }
            for (int64_t c = 0; c < D / 8; c++) ((v8u *)(out + hq * D))[c] = acc[c] * inv;
        } else {
            for (int64_t d = 0; d < D; d++) out[hq * D + d] = 0.0f;
            for (int64_t t0 = 0; t0 < n; t0 += bs) {
                const int64_t m = n - t0 < bs ? n - t0 : bs;
                const float *restrict vb = v_cache + (int64_t)table[t0 / bs] * blk_stride + h * D;
                for (int64_t j = 0; j < m; j++) {
                    const float p = sh[t0 + j], *restrict vt = vb + j * tok_stride;
                    for (int64_t d = 0; d < D; d++) out[hq * D + d] += p * vt[d];
                }
            }
            for (int64_t d = 0; d < D; d++) out[hq * D + d] *= inv;
        }
    }
    if (nan)  /* as softmax would: a NaN score or a +inf maximum poisons the output */
        for (int64_t i = 0; i < Hq * D; i++) out[i] = NAN;
}

/* attend() compiled for the common head dims as constants (unrolled, vectorised dot products), and for any other */
#define ATTEND_ARGS const float *q, const float *kc, const float *vc, const int32_t *table, int64_t n, float *out, \
    float *scores, int64_t Hq, int64_t Hkv, int64_t D, int64_t bs, float scale, pf_cursor *pf
static void attend_d16(ATTEND_ARGS) { (void)D; attend(q, kc, vc, table, n, out, scores, Hq, Hkv, 16, bs, scale, pf); }
static void attend_d32(ATTEND_ARGS) { (void)D; attend(q, kc, vc, table, n, out, scores, Hq, Hkv, 32, bs, scale, pf); }
static void attend_d64(ATTEND_ARGS) { (void)D; attend(q, kc, vc, table, n, out, scores, Hq, Hkv, 64, bs, scale, pf); }
static void attend_d128(ATTEND_ARGS) { (void)D; attend(q, kc, vc, table, n, out, scores, Hq, Hkv, 128, bs, scale, pf); }
static void attend_any(ATTEND_ARGS) { attend(q, kc, vc, table, n, out, scores, Hq, Hkv, D, bs, scale, pf); }

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
    void (*attend_row)(ATTEND_ARGS) = D == 16 ? attend_d16 : D == 32 ? attend_d32 : D == 64 ? attend_d64
        : D == 128 ? attend_d128 : attend_any;
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
            pf_cursor pf;  /* the next row's lines, requested while this one computes */
            const int64_t nxt = r + 1 < R ? r + 1 : r;
            pf_start(&pf, k_cache, v_cache, block_tables + (int64_t)row_seq[nxt] * bt_stride,
                     nxt > r ? row_len[nxt] : 0, bs, Hkv * D);
            attend_row(q + r * Hq * D, k_cache, v_cache, block_tables + (int64_t)row_seq[r] * bt_stride, n, o, scores,
                       Hq, Hkv, D, bs, scale, &pf);
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
