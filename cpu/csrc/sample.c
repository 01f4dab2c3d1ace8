/* Temperature sampling by inverse CDF for CPU engines (cpu/sample.py; contract: kernels.sample.sample_ref,
 * arithmetic: the Triton kernel of kernels/triton_ops/sample.py). Per row of fp32 logits x and temperature T, with
 * z = x / T:
 *   1. m = max z, and whether the row is bad (a NaN or +inf anywhere, or every entry -inf);
 *   2. s = sum of e^(z - m) (vectorised);
 *   3. the running sum of e^(z - m) in index order, to the first index of positive probability where it exceeds
 *      u * s (the last index of positive probability if rounding leaves the running total just short of u * s).
 * The token's logprob is z_token - m - log s; a bad row gets a NaN logprob (the engine ends such a request with
 * an error) and token 0. An entry of -inf has probability exactly 0 and is never drawn. Each row's arithmetic
 * depends only on that row, so results do not depend on the batch or the thread count.
 */
#include <math.h>
#include <stdint.h>

#include "exp_nonpos.h"

static inline float weight(float z, float m) { return z == -INFINITY ? 0.0f : exp_nonpos(z - m); }

static void sample_row(const float *restrict x, int64_t V, float temp, float u, int64_t *token, float *logprob) {
    float m = -INFINITY;
    int bad = 0;
    for (int64_t i = 0; i < V; i++) {
        const float z = x[i] / temp;
        bad |= (z != z) | (z == INFINITY);
        m = z > m ? z : m;
    }
    if (bad || m == -INFINITY) {
        *token = 0;
        *logprob = NAN;
        return;
    }
    float s = 0.0f;
    for (int64_t i = 0; i < V; i++) s += weight(x[i] / temp, m);
    const float target = u * s;
    float run = 0.0f;
    int64_t found = -1, last = 0;
    for (int64_t i = 0; i < V; i++) {
        const float e = weight(x[i] / temp, m);
        if (e > 0.0f) {
            run += e;
            last = i;
            if (run > target) {
                found = i;
                break;
            }
        }
    }
    const int64_t tok = found >= 0 ? found : last;
    *token = tok;
    *logprob = x[tok] / temp - m - logf(s);
}

/* logits [B, V] (row stride `stride`), temps and u [B] -> tokens [B], logprobs [B]. */
void sample_f32(const float *logits, int64_t B, int64_t V, int64_t stride, const float *temps, const float *u,
                int64_t *tokens, float *logprobs, int nt) {
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1 && B * V >= (1 << 16))
    for (int64_t r = 0; r < B; r++) sample_row(logits + r * stride, V, temps[r], u[r], tokens + r, logprobs + r);
}
