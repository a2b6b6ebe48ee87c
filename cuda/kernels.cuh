/* Device arithmetic shared by the CUDA sources. Every fp32/fp64 operation
 * that must match the CPU reference is written with an explicit
 * round-to-nearest intrinsic, so no contraction (FMA) or approximate
 * division/sqrt can creep in whatever the compiler flags; the build also
 * passes --fmad=false -prec-div=true -prec-sqrt=true. */
#ifndef DOPT_CUDA_KERNELS_CUH
#define DOPT_CUDA_KERNELS_CUH

#include <cuda_runtime.h>
#include <stdint.h>

#define DOPT_FLT_MAX_BITS 0x7f7fffffu

__device__ __forceinline__ float rn_fmul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float rn_fadd(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ float rn_fsub(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ float rn_fdiv(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ float rn_fsqrt(float a) { return __fsqrt_rn(a); }
__device__ __forceinline__ double rn_dmul(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ double rn_dadd(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ double rn_ddiv(double a, double b) { return __ddiv_rn(a, b); }

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

/* Adds one value with the definition of ref/xsum.c add_scaled(). */
__device__ __forceinline__ void xw_add(xwords &a, double scale, double x) {
  if (!isfinite(x)) {
    a.w[isnan(x) ? 2 : (x > 0 ? 3 : 4)] += 1ull;
    return;
  }
  long long q = (long long)rint(rn_dmul(x, scale));
  unsigned long long uq = (unsigned long long)q;
  long long lo = (long long)(uq & 0xffffffffull);
  if (lo >= 2147483648ll) lo -= 4294967296ll;
  a.w[0] += (unsigned long long)((q - lo) / 4294967296ll);
  a.w[1] += (unsigned long long)lo;
}

/* dopt_xsum_scale(): 2^(62-e) with absmax < 2^e; 1 for 0 and non-finite. */
__device__ __forceinline__ double xsum_scale(double absmax) {
  if (!(absmax > 0.0) || !isfinite(absmax)) return 1.0;
  int e;
  (void)frexp(absmax, &e);
  return ldexp(1.0, 62 - e);
}

/* dopt_xacc_value() */
__device__ __forceinline__ double xw_value(const long long *w, double scale) {
  if (w[2] > 0 || (w[3] > 0 && w[4] > 0)) return __longlong_as_double(0x7ff8000000000000ll);
  if (w[3] > 0) return __longlong_as_double(0x7ff0000000000000ll);
  if (w[4] > 0) return __longlong_as_double((long long)0xfff0000000000000ull);
  long long lo = w[1];
  long long lo_low = (long long)((unsigned long long)lo & 0xffffffffull);
  long long hi = w[0] + (lo - lo_low) / 4294967296ll;
  double v = rn_dadd(rn_dmul(__ll2double_rn(hi), 4294967296.0), __ll2double_rn(lo_low));
  return rn_ddiv(v, scale);
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
