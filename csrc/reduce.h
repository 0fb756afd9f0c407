#ifndef DLSHARE_REDUCE_H
#define DLSHARE_REDUCE_H
#include <stddef.h>
#include <stdint.h>

/* Element types of the aggregation kernels (the wire codes of aggregator/protocol.py). */
#define DLS_DT_F32 1
#define DLS_DT_F16 2
#define DLS_DT_BF16 3

/* dst[i] = (srcs[0][i] + srcs[1][i] + ... + srcs[nsrc-1][i]) / divisor.
 * The sum runs left to right (rank order) in fp32 for every dtype, so results are
 * reproducible; fp16/bf16 are rounded to nearest-even once, at the end.  divisor 1
 * skips the division.  dst may alias srcs[0].  Returns 0, or -EINVAL for a bad dtype, no source or a zero divisor. */
int dls_reduce_sum(int dtype, void *dst, const void *const *srcs, size_t nsrc, size_t count, float divisor);
/* dst[i] += src[i] (fp32 arithmetic, one rounding for fp16/bf16). */
int dls_reduce_add(int dtype, void *dst, const void *src, size_t count);
/* dst[i] /= divisor. */
int dls_reduce_scale(int dtype, void *dst, size_t count, float divisor);
/* dst[i] = src[i] in another dtype (widening is exact; narrowing rounds to nearest even, as torch's
 * .to() does).  dst and src must not overlap.  Returns 0, or -EINVAL for a bad dtype. */
int dls_reduce_convert(int dst_dt, void *dst, int src_dt, const void *src, size_t count);
/* 1 when the AVX2+F16C path is in use. */
int dls_reduce_simd(void);
/* Tests: force the scalar path (1) or go back to run-time dispatch (0). */
void dls_reduce_force_scalar(int on);
#endif
