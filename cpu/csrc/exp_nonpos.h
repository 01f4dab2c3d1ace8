/* Shared by the C kernels of cpu/csrc (cpu/build.py `build` hashes this header into every kernel's cache key). */
#ifndef TIDAL_EXP_NONPOS_H
#define TIDAL_EXP_NONPOS_H

#include <math.h>
#include <stdint.h>

/* exp(x) for x <= 0 (softmax after subtracting the max): Cody-Waite range reduction and a degree-6 polynomial,
 * relative error ~2e-7 on [-87, 0]; below that it returns 0. Plain arithmetic, so the loop vectorises. The constants
 * and the polynomial are macros so that a kernel writing it on whole vectors (train_attention.c exp_nonpos_v16)
 * computes the very same arithmetic: they take a float or a GCC vector of floats alike. */
#define EXP_NONPOS_LOG2E 1.44269504088896341f
#define EXP_NONPOS_LN2_HI 0.693359375f
#define EXP_NONPOS_LN2_LO (-2.12194440e-4f)
/* e^r for the reduced argument r (|r| <= ln 2 / 2): 1 + r + r^2 (1/2 + r (1/6 + ...)), evaluated in this order */
#define EXP_NONPOS_POLY(r) \
    ((((((1.9875691500e-4f * (r) + 1.3981999507e-3f) * (r) + 8.3334519073e-3f) * (r) + 4.1665795894e-2f) * (r) \
         + 1.6666665459e-1f) * (r) + 5.0000001201e-1f) * (r) * (r) + (r) + 1.0f)

static inline float exp_nonpos(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = floorf(x * EXP_NONPOS_LOG2E + 0.5f);
    float r = x - n * EXP_NONPOS_LN2_HI - n * EXP_NONPOS_LN2_LO;
    float p = EXP_NONPOS_POLY(r);
    union { uint32_t u; float f; } scale;
    scale.u = (uint32_t)((int32_t)n + 127) << 23;
    return p * scale.f;
}

#endif
