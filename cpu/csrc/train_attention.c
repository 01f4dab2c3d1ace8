/* Causal self-attention of the trainer on CPU, forward and backward, over packed rows (cpu/train_attention.py).
 *
 * Layout: q, o, dq, do [T, Hq, D]; k, v, dk, dv [T, Hkv, D]; lse [T, Hq]; fp32, contiguous. Hq a multiple of Hkv
 * (GQA: query head h reads kv head h / (Hq / Hkv)). rows [R, 4] int64: a row is the query tokens
 * [qs, qs + nq) of the packed tensors; it attends to every token of a prefix [ps, ps + np) (np may be 0) and
 * causally to its own tokens, so query i of the row sees np + i + 1 keys. A packed causal sequence is a row with
 * no prefix; a GRPO child is a row whose prefix is its group's one copy of the prompt, whose own row (no prefix)
 * computes the prompt's queries once (model/attention.py SharedPrefixCausal). tasks [ntasks + 1]: task t is rows
 * [tasks[t], tasks[t + 1]). The caller guarantees (train_attention.CausalRows checks): every token is the query of
 * exactly one row, and a row's prefix tokens are queries of rows of its own task.
 *
 * One work item = one task x one kv head, over OpenMP threads: its rows in order, the query heads of the kv head in
 * order, a row's queries QB (8 or 4) at a time, so that they share every load of a key, a value and a key's gradient.
 * The row's keys (and values), transposed into a [D][L16] scratch, give the scores of 16 keys in one vector per
 * head dimension (no reduction across lanes); then softmax on whole vectors (exp of non-positive arguments,
 * exp_nonpos.h) and the probability-weighted sum of V rows in registers. The backward recomputes the scores from
 * the saved log-sum-exp (FlashAttention-2's recurrence): dq in registers, the row's dk and dv summed in a [L][D]
 * scratch and added to the task's tokens after the row. A key's gradient is summed inside its own task only, in
 * that fixed order, so results do not depend on the thread count. A query never multiplies a key past its own,
 * so a non-finite later token does not reach it; a NaN score or an infinite maximum makes the query's output and
 * lse NaN (as softmax would).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "exp_nonpos.h"

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC target("prefer-vector-width=512")   /* GCC keeps its loops to 256 bits on AVX-512 parts otherwise */
#endif

typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));

typedef int32_t v16i __attribute__((vector_size(64)));

#define INLINE static inline __attribute__((always_inline))

/* Lane-wise m ? a : b (m lanes all ones or zeros, as vector comparisons give them). */
INLINE v16 vsel(v16i m, v16 a, v16 b) {
    return (v16)(((v16i)a & m) | ((v16i)b & ~m));
}

/* exp_nonpos (exp_nonpos.h) on 16 lanes, the same arithmetic written on whole vectors: the compiler's own
 * vectorisation of the softmax loops peeled scalar iterations off them and kept their sums in memory. floor is a
 * truncation moved down where it rounded up; a NaN lane stays NaN. */
INLINE v16 exp_nonpos_v16(v16 x) {
    x = vsel(x < -87.0f, (v16){0} - 87.0f, x);
    const v16 y = x * EXP_NONPOS_LOG2E + 0.5f;
    v16 n = __builtin_convertvector(__builtin_convertvector(y, v16i), v16);
    n -= (v16)((v16i)((v16){0} + 1.0f) & (n > y));
    const v16 r = x - n * EXP_NONPOS_LN2_HI - n * EXP_NONPOS_LN2_LO;
    const v16 p = EXP_NONPOS_POLY(r);
    return p * (v16)((__builtin_convertvector(n, v16i) + 127) << 23);
}

INLINE float hmax16(v16 v) {
    float m = v[0];
    for (int i = 1; i < 16; i++) m = v[i] > m ? v[i] : m;
    return m;
}

INLINE float hsum16(v16 v) {
    float a = 0.0f;
    for (int i = 0; i < 16; i++) a += v[i];
    return a;
}

static const v16i IOTA = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

typedef struct {
    int64_t qs, nq, ps, np;
} Row;

/* Queries of a row computed together: they share every load of a key, a value and a key's gradient. Eight at
 * head dim 16, where a query's accumulator is one vector (more sums in flight, each key load shared by more
 * queries: the long vs-TRL job's attention took 13.1 -> 11.8 ms forward and 21.7 -> 18.6 ms backward a
 * micro-batch); four above (at 32, eight made the backward slower). D must be in scope. */
#define QBMAX 8
#define QB ((D) <= 16 ? 8 : 4)

/* The row's keys (prefix, then its own tokens) of kv head g transposed to dst[d * L16 + j], zero past L. */
INLINE void transpose_keys(const float *restrict src, float *restrict dst, const Row *r, int64_t Hkv, int64_t g,
                           const int64_t D, int64_t L16) {
    const int64_t L = r->np + r->nq;
    for (int64_t j = 0; j < L; j++) {
        const int64_t tok = j < r->np ? r->ps + j : r->qs + j - r->np;
        const float *restrict x = src + (tok * Hkv + g) * D;
        for (int64_t d = 0; d < D; d++) dst[d * L16 + j] = x[d];
    }
    for (int64_t d = 0; d < D; d++)
        for (int64_t j = L; j < L16; j++) dst[d * L16 + j] = 0.0f;
}

/* s[u * L16 + j] = sum_d x[u * D + d] * kT[d * L16 + j] for the QB rows x and j < nb (a multiple of 16): 16 keys
 * per vector, two vectors a step, so eight independent sums hide the multiply-add's latency. */
INLINE void scores(const float *restrict x, const float *restrict kT, float *restrict s, int64_t nb, const int64_t D,
                   int64_t L16) {
    int64_t jb = 0;
    for (; jb + 32 <= nb; jb += 32) {
        v16 a[2][QBMAX];
        for (int u = 0; u < QB; u++) a[0][u] = a[1][u] = (v16){0};
        for (int64_t d = 0; d < D; d++) {
            const v16 k0 = *(const v16 *)(kT + d * L16 + jb), k1 = *(const v16 *)(kT + d * L16 + jb + 16);
            for (int u = 0; u < QB; u++) {
                a[0][u] += x[u * D + d] * k0;
                a[1][u] += x[u * D + d] * k1;
            }
        }
        for (int u = 0; u < QB; u++) {
            *(v16 *)(s + u * L16 + jb) = a[0][u];
            *(v16 *)(s + u * L16 + jb + 16) = a[1][u];
        }
    }
    if (jb < nb) {
        v16 a[QBMAX];
        for (int u = 0; u < QB; u++) a[u] = (v16){0};
        for (int64_t d = 0; d < D; d++) {
            const v16 k0 = *(const v16 *)(kT + d * L16 + jb);
            for (int u = 0; u < QB; u++) a[u] += x[u * D + d] * k0;
        }
        for (int u = 0; u < QB; u++) *(v16 *)(s + u * L16 + jb) = a[u];
    }
}

/* Head dims that take 16-lane vectors held in registers (the compiler otherwise vectorises the loops over keys,
 * with scalar loads, and keeps the accumulators in memory). */
#define VEC(D) ((D) % 16 == 0 && (D) <= 128)

/* The keys every query of the block sees (all = min lim) and any of them sees (n = max lim). */
INLINE void key_range(const int64_t *lim, int64_t *all, int64_t *n, const int64_t D) {
    *all = *n = lim[0];
    for (int u = 1; u < QB; u++) {
        *all = lim[u] < *all ? lim[u] : *all;
        *n = lim[u] > *n ? lim[u] : *n;
    }
}

/* out[u][0..D) += sum_{j < lim[u]} w[u * L16 + j] * x_j for the QB queries, x_j the rows of tokens from tok0
 * (stride floats apart); w and out advanced to the segment by the caller. A query never multiplies a key past its
 * own (a zero weight times a non-finite value would still be NaN). */
INLINE void weighted_sum(float *restrict out, const float *restrict w, int64_t L16, const float *restrict base,
                         int64_t tok0, const int64_t *lim, int64_t stride, const int64_t D) {
    int64_t all, n;
    key_range(lim, &all, &n, D);
    if (VEC(D)) {
        const int64_t C = D / 16;
        v16 a[QBMAX][8];
        for (int u = 0; u < QB; u++)
            for (int64_t c = 0; c < C; c++) a[u][c] = *(const v16u *)(out + u * D + 16 * c);
        int64_t j = 0;
        if (C == 1) {   /* one vector a query: two keys a step into two sums, so that 2 QB sums hide the latency */
            v16 b[QBMAX];
            for (int u = 0; u < QB; u++) b[u] = (v16){0};
            for (; j + 2 <= all; j += 2) {
                const v16 x0 = *(const v16u *)(base + (tok0 + j) * stride);
                const v16 x1 = *(const v16u *)(base + (tok0 + j + 1) * stride);
                for (int u = 0; u < QB; u++) {
                    a[u][0] += w[u * L16 + j] * x0;
                    b[u] += w[u * L16 + j + 1] * x1;
                }
            }
            for (int u = 0; u < QB; u++) a[u][0] += b[u];
        }
        for (; j < all; j++) {
            const float *restrict x = base + (tok0 + j) * stride;
            for (int64_t c = 0; c < C; c++) {
                const v16 xv = *(const v16u *)(x + 16 * c);
                for (int u = 0; u < QB; u++) a[u][c] += w[u * L16 + j] * xv;
            }
        }
        for (int64_t j = all; j < n; j++) {
            const float *restrict x = base + (tok0 + j) * stride;
            for (int64_t c = 0; c < C; c++)
                for (int u = 0; u < QB; u++)
                    if (j < lim[u]) a[u][c] += w[u * L16 + j] * *(const v16u *)(x + 16 * c);
        }
        for (int u = 0; u < QB; u++)
            for (int64_t c = 0; c < C; c++) *(v16u *)(out + u * D + 16 * c) = a[u][c];
    } else {
        for (int64_t j = 0; j < n; j++)
            for (int u = 0; u < QB; u++)
                if (j < lim[u])
                    for (int64_t d = 0; d < D; d++) out[u * D + d] += w[u * L16 + j] * base[(tok0 + j) * stride + d];
    }
}

INLINE void backward_key(v16 a[QBMAX][8], int all, const float *restrict p, const float *restrict ds, int64_t L16,
                         int64_t j, const int64_t *lim, const float *restrict x, float *restrict dkj,
                         float *restrict dvj, const v16 *qr, const v16 *dr, const int64_t C) {
    const int64_t D = 16 * C;
    for (int64_t c = 0; c < C; c++) {
        const v16 xv = *(const v16u *)(x + 16 * c);
        v16 gk = *(const v16u *)(dkj + 16 * c), gv = *(const v16u *)(dvj + 16 * c);
        for (int u = 0; u < QB; u++) {
            if (all || j < lim[u]) a[u][c] += ds[u * L16 + j] * xv;   /* (0 * a non-finite key is NaN) */
            gk += ds[u * L16 + j] * qr[u * 8 + c];
            gv += p[u * L16 + j] * dr[u * 8 + c];
        }
        *(v16u *)(dkj + 16 * c) = gk;
        *(v16u *)(dvj + 16 * c) = gv;
    }
}

/* For the keys (rows of k from tok0) with the QB queries' probabilities p and score gradients ds (rows L16 apart,
 * advanced to the segment; zero from a query's lim[u] on): dq[u] += sum_{j < lim[u]} ds[u][j] k_j, and each key's
 * dkr_j += sum_u ds[u][j] qv[u], dvr_j += sum_u p[u][j] dout[u]. */
INLINE void backward_keys(float *restrict dq, const float *restrict p, const float *restrict ds, int64_t L16,
                          const float *restrict base, int64_t tok0, const int64_t *lim, int64_t stride,
                          float *restrict dkr, float *restrict dvr, const float *restrict qv,
                          const float *restrict dout, const int64_t D) {
    int64_t all, n;
    key_range(lim, &all, &n, D);
    if (VEC(D)) {
        const int64_t C = D / 16;
        v16 a[QBMAX][8], qr[QBMAX * 8], dr[QBMAX * 8];
        for (int u = 0; u < QB; u++)
            for (int64_t c = 0; c < C; c++) {
                a[u][c] = *(const v16u *)(dq + u * D + 16 * c);
                qr[u * 8 + c] = *(const v16u *)(qv + u * D + 16 * c);
                dr[u * 8 + c] = *(const v16u *)(dout + u * D + 16 * c);
            }
        for (int64_t j = 0; j < all; j++)
            backward_key(a, 1, p, ds, L16, j, lim, base + (tok0 + j) * stride, dkr + j * D, dvr + j * D, qr, dr, C);
        for (int64_t j = all; j < n; j++)
            backward_key(a, 0, p, ds, L16, j, lim, base + (tok0 + j) * stride, dkr + j * D, dvr + j * D, qr, dr, C);
        for (int u = 0; u < QB; u++)
            for (int64_t c = 0; c < C; c++) *(v16u *)(dq + u * D + 16 * c) = a[u][c];
    } else {
        for (int64_t j = 0; j < n; j++)
            for (int u = 0; u < QB; u++)
                for (int64_t d = 0; d < D; d++) {
                    if (j < lim[u]) dq[u * D + d] += ds[u * L16 + j] * base[(tok0 + j) * stride + d];
                    dkr[j * D + d] += ds[u * L16 + j] * qv[u * D + d];
                    dvr[j * D + d] += p[u * L16 + j] * dout[u * D + d];
                }
    }
}

/* Query u of the block starting at ib: the row's query min(ib + u, nq - 1) (a block past the row's end repeats
 * its last query, computed and not stored). */
INLINE int64_t block_query(const Row *r, int64_t ib, int u) {
    return ib + u < r->nq ? ib + u : r->nq - 1;
}

INLINE void row_fwd(const float *restrict q, const float *restrict k, const float *restrict v, float *restrict o,
                    float *restrict lse, const Row *r, int64_t Hq, int64_t Hkv, int64_t g, const int64_t D, float scale,
                    float *restrict kT, float *restrict s, float *restrict qv, float *restrict acc) {
    const int64_t L = r->np + r->nq, L16 = (L + 15) & ~(int64_t)15, rep = Hq / Hkv, stride = Hkv * D;
    transpose_keys(k, kT, r, Hkv, g, D, L16);
    for (int64_t hh = 0; hh < rep; hh++) {
        const int64_t h = g * rep + hh;
        for (int64_t ib = 0; ib < r->nq; ib += QB) {
            const int64_t nmax = r->np + block_query(r, ib, QB - 1) + 1, nb = (nmax + 15) & ~(int64_t)15;
            for (int u = 0; u < QB; u++) {
                const float *restrict qi = q + ((r->qs + block_query(r, ib, u)) * Hq + h) * D;
                for (int64_t d = 0; d < D; d++) qv[u * D + d] = qi[d] * scale;
            }
            scores(qv, kT, s, nb, D, L16);
            float m[QBMAX], l[QBMAX];
            for (int u = 0; u < QB; u++) {
                float *restrict su = s + u * L16;
                const int64_t n = r->np + block_query(r, ib, u) + 1;
                /* whole vectors: keys from n on count as -inf (a NaN score is never the maximum) */
                v16 vm = (v16){0} - INFINITY, vl = (v16){0};
                for (int64_t jb = 0; jb < nb; jb += 16) {
                    const v16 x = *(const v16 *)(su + jb);
                    vm = vsel((IOTA + (int32_t)jb < (int32_t)n) & (x > vm), x, vm);
                }
                const float mu = hmax16(vm);
                for (int64_t jb = 0; jb < nb; jb += 16) {   /* NaN for a NaN score, and for every one if mu is
                                                               NaN or inf */
                    const v16 p = vsel(IOTA + (int32_t)jb < (int32_t)n, exp_nonpos_v16(*(v16 *)(su + jb) - mu),
                                       (v16){0});
                    *(v16 *)(su + jb) = p;
                    vl += p;
                }
                m[u] = mu;
                l[u] = hsum16(vl);
                for (int64_t d = 0; d < D; d++) acc[u * D + d] = 0.0f;
            }
            int64_t pre[QBMAX], own[QBMAX];   /* keys each query sees: the whole prefix, its row up to itself */
            for (int u = 0; u < QB; u++) {
                pre[u] = r->np;
                own[u] = block_query(r, ib, u) + 1;
            }
            weighted_sum(acc, s, L16, v + g * D, r->ps, pre, stride, D);
            weighted_sum(acc, s + r->np, L16, v + g * D, r->qs, own, stride, D);
            for (int u = 0; u < QB && ib + u < r->nq; u++) {
                const int64_t t = r->qs + ib + u;
                float *restrict oi = o + (t * Hq + h) * D;
                const int bad = l[u] != l[u] || isinf(m[u]);
                const float inv = 1.0f / l[u];
                for (int64_t d = 0; d < D; d++) oi[d] = bad ? NAN : acc[u * D + d] * inv;
                lse[t * Hq + h] = bad ? NAN : m[u] + logf(l[u]);
            }
        }
    }
}

INLINE void row_bwd(const float *restrict q, const float *restrict k, const float *restrict v,
                    const float *restrict o, const float *restrict dout, const float *restrict lse,
                    float *restrict dq, float *restrict dk, float *restrict dv, const Row *r, int64_t Hq, int64_t Hkv,
                    int64_t g, const int64_t D, float scale, float *restrict kT, float *restrict vT,
                    float *restrict s, float *restrict dp, float *restrict qv, float *restrict dov,
                    float *restrict acc, float *restrict dkr, float *restrict dvr) {
    const int64_t L = r->np + r->nq, L16 = (L + 15) & ~(int64_t)15, rep = Hq / Hkv, stride = Hkv * D;
    transpose_keys(k, kT, r, Hkv, g, D, L16);
    transpose_keys(v, vT, r, Hkv, g, D, L16);
    memset(dkr, 0, (size_t)(L * D) * sizeof(float));
    memset(dvr, 0, (size_t)(L * D) * sizeof(float));
    for (int64_t hh = 0; hh < rep; hh++) {
        const int64_t h = g * rep + hh;
        for (int64_t ib = 0; ib < r->nq; ib += QB) {
            const int64_t nmax = r->np + block_query(r, ib, QB - 1) + 1, nb = (nmax + 15) & ~(int64_t)15;
            float delta[QBMAX], li[QBMAX];
            for (int u = 0; u < QB; u++) {   /* a repeated query gets a zero output gradient: it adds nothing */
                const int64_t t = r->qs + block_query(r, ib, u);
                const float *restrict qi = q + (t * Hq + h) * D, *restrict oi = o + (t * Hq + h) * D;
                const float *restrict doi = dout + (t * Hq + h) * D;
                const float live = ib + u < r->nq ? 1.0f : 0.0f;
                float dl = 0.0f;
                for (int64_t d = 0; d < D; d++) {
                    qv[u * D + d] = qi[d] * scale;
                    dov[u * D + d] = doi[d] * live;
                    dl += dov[u * D + d] * oi[d];
                    acc[u * D + d] = 0.0f;
                }
                delta[u] = dl;
                li[u] = lse[t * Hq + h];
            }
            scores(qv, kT, s, nb, D, L16);
            scores(dov, vT, dp, nb, D, L16);
            for (int u = 0; u < QB; u++) {   /* s: probabilities, dp: the scores' gradients */
                float *restrict su = s + u * L16, *restrict du = dp + u * L16;
                const int64_t n = r->np + block_query(r, ib, u) + 1;
                const float lu = li[u], de = delta[u];
                for (int64_t jb = 0; jb < nb; jb += 16) {   /* whole vectors: keys from n on get zeros */
                    const v16i live = IOTA + (int32_t)jb < (int32_t)n;
                    const v16 x = *(v16 *)(su + jb) - lu;
                    const v16 p = vsel(live, exp_nonpos_v16(vsel(x > 0.0f, (v16){0}, x)), (v16){0});   /* x > 0
                                                                                        only by rounding */
                    *(v16 *)(su + jb) = p;
                    *(v16 *)(du + jb) = vsel(live, p * (*(v16 *)(du + jb) - de), (v16){0});
                }
            }
            int64_t pre[QBMAX], own[QBMAX];
            for (int u = 0; u < QB; u++) {
                pre[u] = r->np;
                own[u] = block_query(r, ib, u) + 1;
            }
            backward_keys(acc, s, dp, L16, k + g * D, r->ps, pre, stride, dkr, dvr, qv, dov, D);
            backward_keys(acc, s + r->np, dp + r->np, L16, k + g * D, r->qs, own, stride, dkr + r->np * D,
                          dvr + r->np * D, qv, dov, D);
            for (int u = 0; u < QB && ib + u < r->nq; u++) {
                float *restrict dqi = dq + ((r->qs + ib + u) * Hq + h) * D;
                for (int64_t d = 0; d < D; d++) dqi[d] = acc[u * D + d] * scale;
            }
        }
    }
    for (int64_t j = 0; j < L; j++) {
        const int64_t tok = j < r->np ? r->ps + j : r->qs + j - r->np;
        float *restrict a = dk + (tok * Hkv + g) * D, *restrict b = dv + (tok * Hkv + g) * D;
        for (int64_t d = 0; d < D; d++) {
            a[d] += dkr[j * D + d];
            b[d] += dvr[j * D + d];
        }
    }
}

static float *scratch(int64_t n) {
    return (float *)aligned_alloc(64, (size_t)(((n * (int64_t)sizeof(float)) + 63) & ~(int64_t)63));
}

/* Both directions' tensors (the backward's NULL in a forward call) and the plan. */
typedef struct {
    const float *q, *k, *v, *dout;
    float *o, *lse, *dq, *dk, *dv;
    const Row *rows;
    const int64_t *tasks;
    int64_t Hq, Hkv;
    float scale;
} Args;

/* One thread's scratch: the forward uses kT, s, qv, acc; the backward all of them. */
typedef struct {
    float *kT, *vT, *s, *dp, *qv, *dov, *acc, *dkr, *dvr;
} Scratch;

/* One work item, task t x kv head g: its rows in order (a backward first zeroes the task's key gradients). */
INLINE void task(const Args *a, const Scratch *w, int backward, int64_t t, int64_t g, const int64_t D) {
    const int64_t Hq = a->Hq, Hkv = a->Hkv;
    if (!backward) {
        for (int64_t ri = a->tasks[t]; ri < a->tasks[t + 1]; ri++)
            row_fwd(a->q, a->k, a->v, a->o, a->lse, a->rows + ri, Hq, Hkv, g, D, a->scale, w->kT, w->s, w->qv,
                    w->acc);
        return;
    }
    for (int64_t ri = a->tasks[t]; ri < a->tasks[t + 1]; ri++) {
        const Row *r = a->rows + ri;
        for (int64_t i = 0; i < r->nq; i++) {
            memset(a->dk + ((r->qs + i) * Hkv + g) * D, 0, (size_t)D * sizeof(float));
            memset(a->dv + ((r->qs + i) * Hkv + g) * D, 0, (size_t)D * sizeof(float));
        }
    }
    for (int64_t ri = a->tasks[t]; ri < a->tasks[t + 1]; ri++)
        row_bwd(a->q, a->k, a->v, a->o, a->dout, a->lse, a->dq, a->dk, a->dv, a->rows + ri, Hq, Hkv, g, D, a->scale,
                w->kT, w->vT, w->s, w->dp, w->qv, w->dov, w->acc, w->dkr, w->dvr);
}

/* Every (task, kv head) item over the threads, each with its own scratch; the common head dims compiled as
 * constants. Returns 0, or -1 when scratch memory could not be had. */
static int run(const Args *a, int backward, int64_t nrows, int64_t ntasks, int64_t D, int nt) {
    int64_t m = 1;
    for (int64_t i = 0; i < nrows; i++) m = a->rows[i].np + a->rows[i].nq > m ? a->rows[i].np + a->rows[i].nq : m;
    const int64_t L16 = (m + 15) & ~(int64_t)15;
    int failed = 0;
#pragma omp parallel num_threads(nt) reduction(| : failed)
    {
        Scratch w = {scratch(D * L16), NULL, scratch(QBMAX * L16), NULL, scratch(QBMAX * D), NULL,
                     scratch(QBMAX * D), NULL, NULL};
        if (backward) {
            w.vT = scratch(D * L16);
            w.dp = scratch(QBMAX * L16);
            w.dov = scratch(QBMAX * D);
            w.dkr = scratch(L16 * D);
            w.dvr = scratch(L16 * D);
        }
        const int mine = !w.kT || !w.s || !w.qv || !w.acc
                         || (backward && (!w.vT || !w.dp || !w.dov || !w.dkr || !w.dvr));
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < ntasks * a->Hkv; item++) {
            if (mine) continue;
            const int64_t t = item / a->Hkv, g = item % a->Hkv;
            switch (D) {
            case 16: task(a, &w, backward, t, g, 16); break;
            case 32: task(a, &w, backward, t, g, 32); break;
            case 64: task(a, &w, backward, t, g, 64); break;
            case 128: task(a, &w, backward, t, g, 128); break;
            default: task(a, &w, backward, t, g, D);
            }
        }
        failed |= mine;
        free(w.kT), free(w.vT), free(w.s), free(w.dp), free(w.qv), free(w.dov), free(w.acc), free(w.dkr), free(w.dvr);
    }
    return failed ? -1 : 0;
}

int attention_fwd(const float *q, const float *k, const float *v, float *o, float *lse, const int64_t *rows,
                  int64_t nrows, const int64_t *tasks, int64_t ntasks, int64_t Hq, int64_t Hkv, int64_t D,
                  float scale, int nt) {
    const Args a = {q, k, v, NULL, o, lse, NULL, NULL, NULL, (const Row *)rows, tasks, Hq, Hkv, scale};
    return run(&a, 0, nrows, ntasks, D, nt);
}

int attention_bwd(const float *q, const float *k, const float *v, const float *o, const float *dout,
                  const float *lse, float *dq, float *dk, float *dv, const int64_t *rows, int64_t nrows,
                  const int64_t *tasks, int64_t ntasks, int64_t Hq, int64_t Hkv, int64_t D, float scale, int nt) {
    const Args a = {q, k, v, dout, (float *)o, (float *)lse, dq, dk, dv, (const Row *)rows, tasks, Hq, Hkv, scale};
    return run(&a, 1, nrows, ntasks, D, nt);
}
