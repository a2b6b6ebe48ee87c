// A kernel file that breaks the one-source rule (check_kernels.cmake must name both lines).
#include <cuda_runtime.h>
__global__ void k_plain_axpy(float *w, float a, const float *u, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) w[i] = w[i] + a * u[i];  // contracts to an fma
}
__global__ void k_fast_exp(float *x, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] = __expf(x[i]);  // approximate
}
