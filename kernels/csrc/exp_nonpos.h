/* Shared by the C kernels of kernels/csrc (cpu_native.build hashes this header into every kernel's cache key). */
#ifndef TIDAL_EXP_NONPOS_H
#define TIDAL_EXP_NONPOS_H

#include <math.h>
#include <stdint.h>

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

#endif
