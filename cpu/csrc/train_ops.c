/* Fused element-wise ops of the trainer's CPU forward and backward (cpu/ops.py): SwiGLU, RMSNorm and
 * rotary embedding, each one pass over memory where eager PyTorch makes three to six (and keeps the intermediates
 * alive for backward). fp32, contiguous tensors; rows spread over OpenMP threads.
 *
 * Every output element's arithmetic depends only on its own row, and RMSNorm's weight gradient is summed in fixed
 * chunks of `chunk` rows (one partial row per chunk, added in order by the caller), so results do not depend on the
 * thread count: a deterministic run stays bit-exact on resume with another `cpu_threads`.
 */
#include <math.h>
#include <stdint.h>

#include "exp_nonpos.h"
#include "sgemm.h"


/* sigmoid(g) from exp(-|g|), which never overflows; NaN in, NaN out. */
static inline float sigmoid(float g) {
    const float e = exp_nonpos(-fabsf(g)), inv = 1.0f / (1.0f + e);
    return g >= 0.0f ? inv : (g < 0.0f ? e * inv : g);
}

/* h = silu(g) * u over n elements. */
void swiglu_fwd(const float *restrict g, const float *restrict u, float *restrict h, int64_t n, int nt) {
#pragma omp parallel for simd num_threads(nt) schedule(static)
    for (int64_t i = 0; i < n; i++) h[i] = g[i] * sigmoid(g[i]) * u[i];
}

/* dg = dh * u * silu'(g), du = dh * silu(g); silu'(g) = s + silu(g) (1 - s), s = sigmoid(g). */
void swiglu_bwd(const float *restrict g, const float *restrict u, const float *restrict dh, float *restrict dg,
                float *restrict du, int64_t n, int nt) {
#pragma omp parallel for simd num_threads(nt) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        const float s = sigmoid(g[i]), silu = g[i] * s;
        du[i] = dh[i] * silu;
        dg[i] = dh[i] * u[i] * (s + silu * (1.0f - s));
    }
}

/* The MLP's gate and up projections side by side (cpu/ops.py `mlp`): row r of gu is [g | u], 2 I
 * floats. h[r] = silu(g) * u, I floats a row. */
void swiglu_fwd_gu(const float *restrict gu, float *restrict h, int64_t rows, int64_t I, int nt) {
#pragma omp parallel for num_threads(nt) schedule(static) if (rows * I >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        const float *restrict g = gu + r * 2 * I, *restrict u = g + I;
        float *restrict hr = h + r * I;
#pragma omp simd
        for (int64_t i = 0; i < I; i++) hr[i] = g[i] * sigmoid(g[i]) * u[i];
    }
}

/* Its backward from dh [rows, I]: dgu[r] = [dg | du] as swiglu_bwd, and h recomputed as swiglu_fwd_gu does (the
 * down projection's weight gradient needs it; the forward keeps only gu). */
void swiglu_bwd_gu(const float *restrict gu, const float *restrict dh, float *restrict h, float *restrict dgu,
                   int64_t rows, int64_t I, int nt) {
#pragma omp parallel for num_threads(nt) schedule(static) if (rows * I >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        const float *restrict g = gu + r * 2 * I, *restrict u = g + I, *restrict d = dh + r * I;
        float *restrict hr = h + r * I, *restrict dg = dgu + r * 2 * I, *restrict du = dg + I;
#pragma omp simd
        for (int64_t i = 0; i < I; i++) {
            const float s = sigmoid(g[i]), silu = g[i] * s;
            hr[i] = silu * u[i];
            du[i] = d[i] * silu;
            dg[i] = d[i] * u[i] * (s + silu * (1.0f - s));
        }
    }
}

/* The trainer's MLP, y = down(silu(x gate^T) * (x up^T)) for x [T, H] (cpu/ops.py `MLP`), `block` rows
 * at a time, so that a block's gate/up output gu [block, 2I] and SwiGLU output h [block, I] (scratch from the
 * caller) stay in cache between the matmuls. wgu_t [H, 2I] is the gate and up weights side by side, transposed;
 * wd [O, I]. */
void mlp_fwd(sgemm_fn sgemm, const float *x, const float *wgu_t, const float *wd, float *y, float *gu, float *h,
             int64_t T, int64_t H, int64_t I, int64_t O, int64_t block, int nt) {
    const int h_ = (int)H, i_ = (int)I, i2 = (int)(2 * I), o_ = (int)O;
    const float one = 1.0f, zero = 0.0f;
    for (int64_t s = 0; s < T; s += block) {
        const int n = (int)(T - s < block ? T - s : block);
        sgemm("N", "N", &i2, &n, &h_, &one, wgu_t, &i2, x + s * H, &h_, &zero, gu, &i2);   /* gu = x_s wgu_t */
        swiglu_fwd_gu(gu, h, n, I, nt);
        sgemm("T", "N", &o_, &n, &i_, &one, wd, &i_, h, &i_, &zero, y + s * O, &o_);      /* y_s = h wd^T */
    }
}

/* Its backward from dy [T, O], block by block: gu recomputed (cheaper than keeping [T, 2I] in memory), dh = dy_s wd,
 * SwiGLU's backward (dgu, and h again), the weight gradients dwd [O, I] and dwgu [2I, H] (gate then up) summed over
 * the blocks in order, dx_s = dgu wgu. wgu [2I, H] and wgu_t are the same weights. Scratch gu, dgu [block, 2I], h, dh
 * [block, I]. */
void mlp_bwd(sgemm_fn sgemm, const float *x, const float *wgu, const float *wgu_t, const float *wd, const float *dy,
             float *dx, float *dwgu, float *dwd, float *gu, float *h, float *dh, float *dgu, int64_t T, int64_t H,
             int64_t I, int64_t O, int64_t block, int nt) {
    const int h_ = (int)H, i_ = (int)I, i2 = (int)(2 * I), o_ = (int)O;
    const float one = 1.0f, zero = 0.0f;
    if (T == 0) {
        for (int64_t i = 0; i < 2 * I * H; i++) dwgu[i] = 0.0f;
        for (int64_t i = 0; i < O * I; i++) dwd[i] = 0.0f;
    }
    for (int64_t s = 0; s < T; s += block) {
        const int n = (int)(T - s < block ? T - s : block);
        const float *xs = x + s * H, *dys = dy + s * O, *beta = s == 0 ? &zero : &one;
        sgemm("N", "N", &i2, &n, &h_, &one, wgu_t, &i2, xs, &h_, &zero, gu, &i2);         /* gu = x_s wgu_t */
        sgemm("N", "N", &i_, &n, &o_, &one, wd, &i_, dys, &o_, &zero, dh, &i_);           /* dh = dy_s wd */
        swiglu_bwd_gu(gu, dh, h, dgu, n, I, nt);
        sgemm("N", "T", &i_, &o_, &n, &one, h, &i_, dys, &o_, beta, dwd, &i_);            /* dwd += dy_s^T h */
        sgemm("N", "T", &h_, &i2, &n, &one, xs, &h_, dgu, &i2, beta, dwgu, &h_);          /* dwgu += dgu^T x_s */
        sgemm("N", "N", &h_, &n, &i2, &one, wgu, &h_, dgu, &i2, &zero, dx + s * H, &h_);  /* dx_s = dgu wgu */
    }
}

/* y = w * (x * rstd), rstd = 1 / sqrt(mean(x^2) + eps), per row of D; rstd kept for backward. */
void rmsnorm_fwd(const float *restrict x, const float *restrict w, float *restrict y, float *restrict rstd,
                 int64_t rows, int64_t D, float eps, int nt) {
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *restrict xr = x + r * D;
        float *restrict yr = y + r * D;
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t d = 0; d < D; d++) ss += xr[d] * xr[d];
        const float rs = 1.0f / sqrtf(ss / (float)D + eps);
        rstd[r] = rs;
#pragma omp simd
        for (int64_t d = 0; d < D; d++) yr[d] = w[d] * (xr[d] * rs);
    }
}

/* Inference (the engine's CPU forward): with a residual, s = x + residual is written to s_out and normalised;
 * y = w * (s * rstd) per row of D, nothing kept for backward. residual and s_out may be NULL (then s = x). */
void rmsnorm_infer(const float *restrict x, const float *restrict residual, const float *restrict w,
                   float *restrict y, float *restrict s_out, int64_t rows, int64_t D, float eps, int nt) {
#pragma omp parallel for num_threads(nt) schedule(static) if (rows * D >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        const float *restrict xr = x + r * D;
        float *restrict yr = y + r * D;
        float ss = 0.0f;
        if (residual) {
            const float *restrict rr = residual + r * D;
            float *restrict sr = s_out + r * D;
#pragma omp simd reduction(+ : ss)
            for (int64_t d = 0; d < D; d++) {
                const float v = xr[d] + rr[d];
                sr[d] = v;
                ss += v * v;
            }
            xr = sr;
        } else {
#pragma omp simd reduction(+ : ss)
            for (int64_t d = 0; d < D; d++) ss += xr[d] * xr[d];
        }
        const float rs = 1.0f / sqrtf(ss / (float)D + eps);
#pragma omp simd
        for (int64_t d = 0; d < D; d++) yr[d] = w[d] * (xr[d] * rs);
    }
}

/* dx = rstd * (dy w) - x * rstd^3 * mean(dy w x); dw_part[c] = sum over rows [c chunk, (c + 1) chunk) of
 * dy * x * rstd. */
void rmsnorm_bwd(const float *restrict x, const float *restrict w, const float *restrict rstd,
                 const float *restrict dy, float *restrict dx, float *restrict dw_part, int64_t rows, int64_t D,
                 int64_t chunk, int nt) {
    const int64_t chunks = (rows + chunk - 1) / chunk;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t c = 0; c < chunks; c++) {
        float *restrict dwc = dw_part + c * D;
        for (int64_t d = 0; d < D; d++) dwc[d] = 0.0f;
        const int64_t end = (c + 1) * chunk < rows ? (c + 1) * chunk : rows;
        for (int64_t r = c * chunk; r < end; r++) {
            const float *restrict xr = x + r * D, *restrict dyr = dy + r * D;
            float *restrict dxr = dx + r * D;
            const float rs = rstd[r];
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < D; d++) dot += dyr[d] * w[d] * xr[d];
            const float k = rs * rs * rs * dot / (float)D;
#pragma omp simd
            for (int64_t d = 0; d < D; d++) {
                dxr[d] = dyr[d] * w[d] * rs - xr[d] * k;
                dwc[d] += dyr[d] * (xr[d] * rs);
            }
        }
    }
}

/* Rotary embedding, "rotate_half" layout: x [T, H, D], cos and sin [T, D].
 * forward:  out = x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1)
 * backward: dx = dy * cos + rotate_half^T(dy * sin), rotate_half^T(z) = (z2, -z1)
 * Both: o1 = x1 c1 - sign x2 sa, o2 = x2 c2 + sign x1 sb, with (sign, sa, sb) = (+1, s1, s2) forward and
 * (-1, s2, s1) backward. */
static void rope(const float *restrict x, const float *restrict cs, const float *restrict sn, float *restrict out,
                 int64_t T, int64_t H, int64_t D, int backward, int nt) {
    const int64_t half = D / 2;
    const float sign = backward ? -1.0f : 1.0f;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const float *restrict c = cs + t * D;
        const float *restrict sa = sn + t * D + (backward ? half : 0);
        const float *restrict sb = sn + t * D + (backward ? 0 : half);
        for (int64_t h = 0; h < H; h++) {
            const float *restrict xr = x + (t * H + h) * D;
            float *restrict o = out + (t * H + h) * D;
#pragma omp simd
            for (int64_t d = 0; d < half; d++) {
                o[d] = xr[d] * c[d] - sign * xr[d + half] * sa[d];
                o[d + half] = xr[d + half] * c[d + half] + sign * xr[d] * sb[d];
            }
        }
    }
}

void rope_fwd(const float *x, const float *cs, const float *sn, float *out, int64_t T, int64_t H, int64_t D, int nt) {
    rope(x, cs, sn, out, T, H, D, 0, nt);
}

void rope_bwd(const float *dy, const float *cs, const float *sn, float *dx, int64_t T, int64_t H, int64_t D, int nt) {
    rope(dy, cs, sn, dx, T, H, D, 1, nt);
}

/* The engine's rotary embedding in place (forward only): x [T, H, D] rotated by cos, sin [T, D]; each pair
 * (d, d + D/2) is read before either is written. */
void rope_inplace(float *x, const float *restrict cs, const float *restrict sn, int64_t T, int64_t H, int64_t D,
                  int nt) {
    const int64_t half = D / 2;
#pragma omp parallel for num_threads(nt) schedule(static) if (T * H * D >= 65536)
    for (int64_t t = 0; t < T; t++) {
        const float *restrict c = cs + t * D, *restrict s = sn + t * D;
        for (int64_t h = 0; h < H; h++) {
            float *restrict x1 = x + (t * H + h) * D, *restrict x2 = x1 + half;
#pragma omp simd
            for (int64_t d = 0; d < half; d++) {
                const float a = x1[d], b = x2[d];
                x1[d] = a * c[d] - b * s[d];
                x2[d] = b * c[d + half] + a * s[d + half];
            }
        }
    }
}
