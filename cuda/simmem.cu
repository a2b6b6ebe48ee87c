/* The simulator's data movement on device memory (dopt_sim_memops,
 * distopt/sim.h): lets N rank threads of one process share one GPU with
 * device buffers, where NCCL refuses several ranks per GPU. The reduction
 * combines the ranks in the simulator's fixed order, element by element, with
 * the operations of sim/sim_data.c (bf16 accumulated in fp32, rounded once;
 * integers wrap). Synchronous for the calling thread, on its own stream
 * (cudaStreamPerThread) and its current device. A CUDA failure here has no
 * status to return to: it is reported on stderr and aborts. */
#include <stdio.h>
#include <stdlib.h>

#include "distopt/cuda.h"
#include "kernels.cuh"

#define ST cudaStreamPerThread

namespace {

void check(cudaError_t e, const char *what) {
  if (e == cudaSuccess) return;
  fprintf(stderr, "distopt: cuda simulator memops: %s: %s\n", what, cudaGetErrorString(e));
  abort();
}

__device__ __forceinline__ float bf2f(uint16_t h) { return __uint_as_float((unsigned)h << 16); }
__device__ __forceinline__ uint16_t f2bf(float f) { return dopt_bf16_of_bits(__float_as_uint(f)); }

/* element traits: load to accumulator, store, add, multiply, divide by n */
struct tf32 {
  typedef float T;
  typedef float A;
  static __device__ A ld(T x) { return x; }
  static __device__ T st(A x) { return x; }
  static __device__ A add(A a, A b) { return DOPT_FADD(a, b); }
  static __device__ A mul(A a, A b) { return DOPT_FMUL(a, b); }
  static __device__ A div(A a, int n) { return DOPT_FDIV(a, (float)n); }
};
struct tf64 {
  typedef double T;
  typedef double A;
  static __device__ A ld(T x) { return x; }
  static __device__ T st(A x) { return x; }
  static __device__ A add(A a, A b) { return DOPT_DADD(a, b); }
  static __device__ A mul(A a, A b) { return DOPT_DMUL(a, b); }
  static __device__ A div(A a, int n) { return DOPT_DDIV(a, (double)n); }
};
struct tbf16 {
  typedef uint16_t T;
  typedef float A;
  static __device__ A ld(T x) { return bf2f(x); }
  static __device__ T st(A x) { return f2bf(x); }
  static __device__ A add(A a, A b) { return DOPT_FADD(a, b); }
  static __device__ A mul(A a, A b) { return DOPT_FMUL(a, b); }
  static __device__ A div(A a, int n) { return DOPT_FDIV(a, (float)n); }
};
struct ti32 {
  typedef int32_t T;
  typedef int32_t A;
  static __device__ A ld(T x) { return x; }
  static __device__ T st(A x) { return x; }
  static __device__ A add(A a, A b) { return (int32_t)((uint32_t)a + (uint32_t)b); }
  static __device__ A mul(A a, A b) { return (int32_t)((uint32_t)a * (uint32_t)b); }
  static __device__ A div(A a, int n) { return (int32_t)(a / (int32_t)n); }
};
struct ti64 {
  typedef int64_t T;
  typedef int64_t A;
  static __device__ A ld(T x) { return x; }
  static __device__ T st(A x) { return x; }
  static __device__ A add(A a, A b) { return (int64_t)((uint64_t)a + (uint64_t)b); }
  static __device__ A mul(A a, A b) { return (int64_t)((uint64_t)a * (uint64_t)b); }
  static __device__ A div(A a, int n) { return (int64_t)(a / (int64_t)n); }
};
struct tu8 {
  typedef uint8_t T;
  typedef uint8_t A;
  static __device__ A ld(T x) { return x; }
  static __device__ T st(A x) { return x; }
  static __device__ A add(A a, A b) { return (uint8_t)((unsigned)a + (unsigned)b); }
  static __device__ A mul(A a, A b) { return (uint8_t)((unsigned)a * (unsigned)b); }
  static __device__ A div(A a, int n) { return (uint8_t)((unsigned)a / (unsigned)n); }
};

template <class K>
__global__ void k_reduce(int op, void *out, const void *const *srcs, int n, int start, size_t off, size_t count) {
  typedef typename K::T T;
  typedef typename K::A A;
  for (size_t k = (size_t)blockIdx.x * blockDim.x + threadIdx.x; k < count; k += (size_t)gridDim.x * blockDim.x) {
    A acc = K::ld(((const T *)srcs[start])[off + k]);
    for (int j = 1; j < n; j++) {
      A x = K::ld(((const T *)srcs[(start + j) % n])[off + k]);
      switch (op) {
      case DOPT_PROD: acc = K::mul(acc, x); break;
      case DOPT_MAX: acc = x > acc ? x : acc; break;
      case DOPT_MIN: acc = x < acc ? x : acc; break;
      default: acc = K::add(acc, x); break;
      }
    }
    ((T *)out)[k] = op == DOPT_AVG ? K::st(K::div(acc, n)) : K::st(acc);
  }
}

void mem_copy(void *ctx, void *dst, const void *src, size_t bytes) {
  (void)ctx;
  check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, ST), "copy");
  check(cudaStreamSynchronize(ST), "copy");
}

void mem_reduce(void *ctx, dopt_dtype dt, dopt_redop op, void *out, const void *const *srcs, int n, int start,
                size_t off, size_t count) {
  (void)ctx;
  void *dsrcs = nullptr;
  check(cudaMallocAsync(&dsrcs, (size_t)n * sizeof(void *), ST), "reduce: pointer table");
  check(cudaMemcpyAsync(dsrcs, srcs, (size_t)n * sizeof(void *), cudaMemcpyHostToDevice, ST), "reduce: pointer table");
  size_t g = (count + 255) / 256;
  unsigned grid = (unsigned)(g > 4096 ? 4096 : g);
  const void *const *s = (const void *const *)dsrcs;
  switch (dt) {
  case DOPT_F32: k_reduce<tf32><<<grid, 256, 0, ST>>>((int)op, out, s, n, start, off, count); break;
  case DOPT_F64: k_reduce<tf64><<<grid, 256, 0, ST>>>((int)op, out, s, n, start, off, count); break;
  case DOPT_BF16: k_reduce<tbf16><<<grid, 256, 0, ST>>>((int)op, out, s, n, start, off, count); break;
  case DOPT_I32: k_reduce<ti32><<<grid, 256, 0, ST>>>((int)op, out, s, n, start, off, count); break;
  case DOPT_I64: k_reduce<ti64><<<grid, 256, 0, ST>>>((int)op, out, s, n, start, off, count); break;
  case DOPT_U8: k_reduce<tu8><<<grid, 256, 0, ST>>>((int)op, out, s, n, start, off, count); break;
  default: break; /* validated by the simulator */
  }
  check(cudaGetLastError(), "reduce: launch");
  check(cudaFreeAsync(dsrcs, ST), "reduce: pointer table");
  check(cudaStreamSynchronize(ST), "reduce");
}

__global__ void k_flip(unsigned char *p, unsigned char mask) { *p = (unsigned char)(*p ^ mask); }

void mem_flip(void *ctx, void *buf, size_t count, dopt_dtype dt, uint64_t elem, uint32_t bit) {
  (void)ctx;
  size_t esz = dopt_dtype_size(dt);
  if (count == 0 || esz == 0) return;
  size_t b = (size_t)(bit % (uint32_t)(esz * 8u));
  size_t byte = (size_t)(elem % count) * esz + b / 8u;
  k_flip<<<1, 1, 0, ST>>>((unsigned char *)buf + byte, (unsigned char)(1u << (b % 8u)));
  check(cudaGetLastError(), "bit flip");
  check(cudaStreamSynchronize(ST), "bit flip");
}

const dopt_sim_memops cuda_memops = {nullptr, mem_copy, mem_reduce, mem_flip};

} // namespace

extern "C" const dopt_sim_memops *dopt_cuda_sim_memops(void) { return &cuda_memops; }
