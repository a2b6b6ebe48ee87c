/* The CPU device (distopt/device.h): device memory is host memory and the
 * kernels are the reference's own loops, so a distributed run on the CPU
 * executes exactly the reference's floating-point operations. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "elem.h"
#include "grid.h"
#include "optim_impl.h"
#include "twice.h"

static dopt_status cpu_alloc(void *ctx, size_t bytes, void **out) {
  (void)ctx;
  *out = calloc(1, bytes ? bytes : 1);
  return *out ? DOPT_OK : dopt__fail(DOPT_ERR_NO_MEMORY, "cpu device: alloc of %zu bytes", bytes);
}

static void cpu_free(void *ctx, void *p) {
  (void)ctx;
  free(p);
}

static dopt_status cpu_copy(void *ctx, void *dst, const void *src, size_t bytes) {
  (void)ctx;
  if (bytes) memmove(dst, src, bytes);
  return DOPT_OK;
}

static dopt_status cpu_add(void *ctx, float *acc, const float *x, size_t n) {
  (void)ctx;
  for (size_t i = 0; i < n; i++) acc[i] = dopt_add_elem(acc[i], x[i]);
  return DOPT_OK;
}

static dopt_status cpu_scale(void *ctx, float *x, float a, size_t n) {
  (void)ctx;
  for (size_t i = 0; i < n; i++) x[i] = dopt_scale_elem(x[i], a);
  return DOPT_OK;
}

/* x[i] ← x[i] / d for i < n; returns how many results are not finite. r: d's reciprocal where d is a power of
 * two, else 0. Multiplying by 2^-k gives the division's bits: x · 2^-k and x / 2^k are the same real number,
 * rounded once either way (zeros, subnormals, infinities and NaN included, and a caller's FTZ/DAZ acts on both
 * alike), and the multiply costs a fraction of the division (dp and the micro-batches are usually powers of two). */
DOPT_BODY int64_t average_loop_body(float *x, float d, float r, size_t n) {
  int64_t c = 0;
  for (size_t i0 = 0; i0 < n; i0 += (size_t)1 << 30) { /* the count in 32-bit lanes, summed per 2^30 elements */
    const size_t e = n - i0 < (size_t)1 << 30 ? n : i0 + ((size_t)1 << 30);
    int32_t ci = 0;
    if (r != 0.0f)
      for (size_t i = i0; i < e; i++) {
        x[i] = x[i] * r;
        ci += !isfinite(x[i]);
      }
    else
      for (size_t i = i0; i < e; i++) {
        x[i] = dopt_average_elem(x[i], d);
        ci += !isfinite(x[i]);
      }
    c += ci;
  }
  return c;
}
DOPT_TWICE(static, int64_t, average_loop, (float *x, float d, float r, size_t n), (x, d, r, n))

/* 2^-k for d = 2^k with 2^-k a normal float (|k| ≤ 126), else 0. */
static float pow2_reciprocal(float d) {
  int e;
  const float m = frexpf(d, &e); /* d = m · 2^e, m ∈ [0.5, 1) */
  return isfinite(d) && m == 0.5f && e - 1 >= -126 && e - 1 <= 126 ? ldexpf(1.0f, 1 - e) : 0.0f;
}

static dopt_status cpu_average(void *ctx, float *x, float d, size_t n, int64_t *nonfinite) {
  (void)ctx;
  *nonfinite = average_loop(x, d, pow2_reciprocal(d), n);
  return DOPT_OK;
}

static dopt_status cpu_sumsq(void *ctx, const float *x, size_t n, double *ss) {
  (void)ctx;
  *ss = dopt_sumsq(x, n);
  return DOPT_OK;
}

static dopt_status cpu_to_bf16(void *ctx, const float *x, uint16_t *y, size_t n) {
  (void)ctx;
  for (size_t i = 0; i < n; i++) y[i] = dopt_f32_to_bf16(x[i]);
  return DOPT_OK;
}

static size_t cpu_frame_bytes(void *ctx, const dopt_step_args *a) {
  (void)ctx;
  return a->impl->frame ? a->impl->frame(a->hp, a->piece) : 0;
}

static dopt_status cpu_step(void *ctx, const dopt_step_args *a) {
  (void)ctx;
  return a->impl->step(a);
}

static dopt_status cpu_grid_codes(void *ctx, const float *x, const dopt_piece *pc, int32_t *codes, int64_t *bad) {
  (void)ctx;
  dopt__grid_codes(x, pc, codes, bad);
  return DOPT_OK;
}

static dopt_status cpu_grid_encode(void *ctx, const float *x, const dopt_piece *pc, const int32_t *codes, int words,
                                   int k, int add, int64_t *w, int64_t *cls) {
  (void)ctx;
  dopt__grid_encode(x, pc, codes, words, k, add, w, cls);
  return DOPT_OK;
}

static dopt_status cpu_grid_decode(void *ctx, const int64_t *w, const int64_t *cls, const dopt_piece *pc,
                                   const int32_t *codes, int words, int k, float *x) {
  (void)ctx;
  dopt__grid_decode(w, cls, pc, codes, words, k, x);
  return DOPT_OK;
}

/* dopt__dp_sum_k goes block by block, reading every part's block before writing out's: out may be a part. */
static dopt_status cpu_grid_sum(void *ctx, const float *const *parts, int nparts, int words, size_t n, float *out) {
  (void)ctx;
  return dopt__dp_sum_k(dopt__grid_kernels(DOPT_GRID_IMPL_AUTO), parts, nparts, words, n, out);
}

static const dopt_device_ops cpu_ops = {
    .name = "cpu",
    .alloc = cpu_alloc,
    .free = cpu_free,
    .upload = cpu_copy,
    .download = cpu_copy,
    .copy = cpu_copy,
    .add = cpu_add,
    .scale = cpu_scale,
    .average = cpu_average,
    .sumsq = cpu_sumsq,
    .to_bf16 = cpu_to_bf16,
    .frame_bytes = cpu_frame_bytes,
    .step = cpu_step,
    .grid_codes = cpu_grid_codes,
    .grid_encode = cpu_grid_encode,
    .grid_decode = cpu_grid_decode,
    .host_chunk = 4096, /* 2 parts of fp32 and one int64 word: 64 KiB, in L2 */
    .grid_sum = cpu_grid_sum,
};

static const dopt_device cpu_device = {&cpu_ops, NULL};

const dopt_device *dopt_device_cpu(void) { return &cpu_device; }
