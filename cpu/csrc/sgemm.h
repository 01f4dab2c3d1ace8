/* The Fortran BLAS sgemm that torch's own F.linear calls, reached through its address in torch's CPU library
 * (cpu/build.py `sgemm_address`) by the kernels that run whole blocks of a model in C. */
#ifndef TIDAL_SGEMM_H
#define TIDAL_SGEMM_H

/* C = alpha op(A) op(B) + beta C, column-major; a row-major [m, n] matrix is a column-major [n, m] one. With beta 0,
 * C is written without being read. */
typedef void (*sgemm_fn)(const char *, const char *, const int *, const int *, const int *, const float *,
                         const float *, const int *, const float *, const int *, const float *, float *,
                         const int *);

#endif
