/* Device helpers shared by the CUDA sources: bit-level maxima, the exact sums'
 * word accumulation and block reductions. The arithmetic itself is core/elem.h's
 * (one source with the CPU: explicit round-to-nearest intrinsics on the device,
 * so no contraction or approximate division/sqrt whatever the flags; the build
 * also passes --fmad=false -prec-div=true -prec-sqrt=true), enforced by
 * tests/layering/check_kernels.cmake on the PTX. */
#ifndef DOPT_CUDA_KERNELS_CUH
#define DOPT_CUDA_KERNELS_CUH

#include <cuda_runtime.h>
#include <stdint.h>

#include "elem.h" /* the element arithmetic shared with the CPU (exact sums included) */

#define DOPT_FLT_MAX_BITS 0x7f7fffffu

/* |x| as its bit pattern when finite, else 0 (non-negative floats order as
 * unsigned integers, so atomicMax on the bits is a float max). */
__device__ __forceinline__ unsigned finite_abs_bits(float x) {
  unsigned u = __float_as_uint(x) & 0x7fffffffu;
  return u <= DOPT_FLT_MAX_BITS ? u : 0u;
}

/* xsum words (distopt/xsum.h): hi, lo, #NaN, #+inf, #-inf as unsigned
 * 64-bit integers (wrapping addition = the int64 words mod 2^64). */
struct xwords {
  unsigned long long w[5];
};

/* Adds one value: core/elem.h's words (core/xsum.c add_scaled() on the CPU), added as unsigned words. */
__device__ __forceinline__ void xw_add(xwords &a, double scale, double x) {
  const int k = dopt_xsum_class(x);
  if (k >= 0) {
    a.w[k] += 1ull;
    return;
  }
  int64_t hi, lo;
  dopt_xsum_split(scale, x, &hi, &lo);
  a.w[DOPT_XW_HI] += (unsigned long long)hi;
  a.w[DOPT_XW_LO] += (unsigned long long)lo;
}

/* dopt_xsum_scale() */
__device__ __forceinline__ double xsum_scale(double absmax) { return dopt_xsum_scale_of(absmax); }

/* dopt_xacc_value(): words summed as unsigned, read as the int64 words they are mod 2^64 */
__device__ __forceinline__ double xw_value(const long long *w, double scale) {
  int64_t s[5];
  for (int k = 0; k < 5; k++) s[k] = (int64_t)w[k];
  return dopt_xsum_value_of(s, scale);
}

/* warp and block sums of the words; the block's thread 0 adds them to out. */
__device__ __forceinline__ void xw_block_flush(xwords &a, unsigned long long *out) {
  __shared__ unsigned long long sh[32][5];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  for (int k = 0; k < 5; k++)
    for (int o = 16; o > 0; o >>= 1) a.w[k] += __shfl_down_sync(0xffffffffu, a.w[k], o);
  if (lane == 0)
    for (int k = 0; k < 5; k++) sh[warp][k] = a.w[k];
  __syncthreads();
  if (warp == 0) {
    for (int k = 0; k < 5; k++) a.w[k] = lane < nw ? sh[lane][k] : 0ull;
    for (int k = 0; k < 5; k++)
      for (int o = 16; o > 0; o >>= 1) a.w[k] += __shfl_down_sync(0xffffffffu, a.w[k], o);
    if (lane == 0)
      for (int k = 0; k < 5; k++)
        if (a.w[k]) atomicAdd(&out[k], a.w[k]);
  }
  __syncthreads();
}

/* block max of unsigned values; every thread gets the result */
__device__ __forceinline__ unsigned block_max_u32(unsigned v) {
  __shared__ unsigned sh[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_down_sync(0xffffffffu, v, o));
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned m = 0;
    for (int i = 0; i < nw; i++) m = max(m, sh[i]);
    sh[0] = m;
  }
  __syncthreads();
  unsigned r = sh[0];
  __syncthreads();
  return r;
}

#endif
