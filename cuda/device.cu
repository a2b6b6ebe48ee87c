/* The CUDA device (distopt/cuda.h): memory, the vector kernels and the step
 * of adamw, adafactor, came and lamb on a piece as loops over core/elem.h's
 * element functions (one source with the CPU reference; core/stats.c's
 * staging); every other optimizer through its CPU step on host copies
 * (core/hoststep.c). Step-dependent scalars come from core/elem.h's host
 * functions, as the CPU code's; exact sums use its fixed-point words with
 * integer atomics (any order gives the same words). Every entry point is synchronous for the
 * calling thread and runs on that thread's stream (cudaStreamPerThread). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

extern "C" {
#include "optim_impl.h"
}
#include "distopt/cuda.h"
#include "elem.h" /* the optimizers' element arithmetic and host scalars, shared with the CPU (one source) */
#include "grid.h" /* the exact dp sum's element arithmetic, shared with the CPU */
#include "kernels.cuh"

#define ST cudaStreamPerThread

namespace {

struct cuda_dev {
  dopt_device dev;
  int id;
  int sms;
  unsigned long long *count; /* [1] device counter of `average` (allocated once: no malloc per call) */
};

dopt_status cu_fail(cudaError_t e, const char *what) {
  return dopt__fail(DOPT_ERR_BACKEND, "cuda device: %s: %s", what, cudaGetErrorString(e));
}

#define CU(call, what)                        \
  do {                                        \
    cudaError_t cu_e_ = (call);               \
    if (cu_e_ != cudaSuccess) return cu_fail(cu_e_, what); \
  } while (0)

/* Stream-ordered scratch, zero-filled; freed on scope exit. */
struct scratch {
  void *p = nullptr;
  ~scratch() {
    if (p) cudaFreeAsync(p, ST);
  }
  dopt_status get(size_t bytes) {
    CU(cudaMallocAsync(&p, bytes ? bytes : 8, ST), "scratch alloc");
    CU(cudaMemsetAsync(p, 0, bytes ? bytes : 8, ST), "scratch memset");
    return DOPT_OK;
  }
};

const int BS = 256;

unsigned grid_for(const cuda_dev *c, size_t n) {
  size_t g = (n + BS - 1) / BS, cap = (size_t)c->sms * 32;
  if (g > cap) g = cap;
  return (unsigned)(g ? g : 1);
}

dopt_status sync(const char *what) {
  CU(cudaGetLastError(), what);
  CU(cudaStreamSynchronize(ST), what);
  return DOPT_OK;
}

#define GRID_STRIDE(i, n) \
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (size_t)gridDim.x * blockDim.x)

/* ---- vector kernels ------------------------------------------------------------------ */

__global__ void k_add(float *acc, const float *x, size_t n) {
  GRID_STRIDE(i, n) acc[i] = dopt_add_elem(acc[i], x[i]);
}
__global__ void k_scale(float *x, float a, size_t n) {
  GRID_STRIDE(i, n) x[i] = dopt_scale_elem(x[i], a);
}
__global__ void k_average(float *x, float d, size_t n, unsigned long long *bad) {
  unsigned long long c = 0;
  GRID_STRIDE(i, n) {
    float v = dopt_average_elem(x[i], d);
    x[i] = v;
    c += !isfinite(v);
  }
  for (int o = 16; o > 0; o >>= 1) c += __shfl_down_sync(0xffffffffu, c, o);
  if ((threadIdx.x & 31) == 0 && c) atomicAdd(bad, c);
}
__global__ void k_to_bf16(const float *x, uint16_t *y, size_t n) {
  GRID_STRIDE(i, n) y[i] = dopt_bf16_of_bits(__float_as_uint(x[i]));
}

/* ---- the exact dp sum (distopt/dpsum.h): core/grid.h's element functions per thread ------------ */

/* codes[logical block] = max over the piece's elements of their code (integer
 * max: any order); *bad += non-finite elements */
__global__ void k_grid_codes(const float *x, dopt_piece pc, int *codes, unsigned long long *bad) {
  unsigned long long c = 0;
  GRID_STRIDE(j, pc.len) {
    float v = x[j];
    int code = dopt_grid_code(v);
    if (code) atomicMax(&codes[dopt_grid_logical(&pc, pc.lo + j) / DOPT_GRID_BLOCK], code);
    c += !isfinite(v);
  }
  for (int o = 16; o > 0; o >>= 1) c += __shfl_down_sync(0xffffffffu, c, o);
  if ((threadIdx.x & 31) == 0 && c) atomicAdd(bad, c);
}
__global__ void k_grid_encode(const float *x, dopt_piece pc, const int *codes, int words, int k, int add, int64_t *w,
                              int64_t *cls) {
  GRID_STRIDE(j, pc.len) {
    float v = x[j];
    int64_t q[DOPT_DP_SUM_WORDS_MAX];
    dopt_grid_encode(v, codes[dopt_grid_logical(&pc, pc.lo + j) / DOPT_GRID_BLOCK], words, k, q);
    for (int t = 0; t < words; t++) {
      int64_t *o = w + j * (size_t)words + t;
      *o = add ? (int64_t)((uint64_t)*o + (uint64_t)q[t]) : q[t];
    }
    if (cls) cls[j] = (add ? cls[j] : 0) + dopt_grid_class(v);
  }
}
__global__ void k_grid_decode(const int64_t *w, const int64_t *cls, dopt_piece pc, const int *codes, int words, int k,
                              float *x) {
  GRID_STRIDE(j, pc.len) {
    x[j] = dopt_grid_decode(w + j * (size_t)words, cls ? cls[j] : 0,
                            codes[dopt_grid_logical(&pc, pc.lo + j) / DOPT_GRID_BLOCK], words, k);
  }
}

/* ---- exact Σx² of a piece (dopt_piece_sumsq) -------------------------------------------- */

__global__ void k_absmax(const float *x, size_t n, unsigned *out) {
  unsigned m = 0;
  GRID_STRIDE(i, n) m = max(m, finite_abs_bits(x[i]));
  m = block_max_u32(m);
  if (threadIdx.x == 0 && m) atomicMax(out, m);
}
__global__ void k_square_max(const unsigned *mb, double *m) {
  *m = dopt_square_d((double)__uint_as_float(*mb));
}
__global__ void k_xacc(const float *x, size_t n, double scale, int sq, unsigned long long *w) {
  xwords a = {{0, 0, 0, 0, 0}};
  GRID_STRIDE(i, n) {
    double v = (double)x[i];
    xw_add(a, scale, sq ? dopt_square_d(v) : v);
  }
  xw_block_flush(a, w);
}

/* Σx² of a piece in the two reduction phases of a staged step (core/stats.c
 * dopt_ss_*); lives in the step's frame (device memory). */
struct ss_dev {
  double m;
  unsigned mb, pad;
  unsigned long long w[5];
};

dopt_status ss_begin(const cuda_dev *c, ss_dev *d, const float *x, size_t n, const dopt_reducer *red) {
  CU(cudaMemsetAsync(&d->mb, 0, sizeof d->mb, ST), "sumsq: memset");
  if (n) k_absmax<<<grid_for(c, n), BS, 0, ST>>>(x, n, &d->mb);
  k_square_max<<<1, 1, 0, ST>>>(&d->mb, &d->m);
  DOPT_TRY(sync("sumsq: maximum"));
  return red ? red->post_max_f64(red->ctx, &d->m, 1) : DOPT_OK;
}

dopt_status ss_scale(ss_dev *d, double *scale) {
  double m;
  CU(cudaMemcpyAsync(&m, &d->m, sizeof m, cudaMemcpyDeviceToHost, ST), "sumsq: download");
  DOPT_TRY(sync("sumsq: download"));
  *scale = dopt_xsum_scale(m);
  return DOPT_OK;
}

dopt_status ss_accum(const cuda_dev *c, ss_dev *d, const float *x, size_t n, const dopt_reducer *red) {
  double scale = 1.0;
  DOPT_TRY(ss_scale(d, &scale));
  CU(cudaMemsetAsync(d->w, 0, sizeof d->w, ST), "sumsq: memset");
  if (n) k_xacc<<<grid_for(c, n), BS, 0, ST>>>(x, n, scale, 1, d->w);
  DOPT_TRY(sync("sumsq: accumulate"));
  return red ? red->post_sum_i64(red->ctx, (int64_t *)d->w, DOPT_XSUM_WORDS) : DOPT_OK;
}

dopt_status ss_value(ss_dev *d, double *out) {
  double scale = 1.0;
  DOPT_TRY(ss_scale(d, &scale));
  dopt_xacc acc;
  CU(cudaMemcpyAsync(acc.w, d->w, sizeof acc.w, cudaMemcpyDeviceToHost, ST), "sumsq: download");
  DOPT_TRY(sync("sumsq: download"));
  *out = dopt_xacc_value(&acc, scale);
  return DOPT_OK;
}

/* local Σx² (no reducer): the device's sumsq op */
dopt_status piece_sumsq(const cuda_dev *c, const float *x, size_t n, double *out) {
  scratch s;
  DOPT_TRY(s.get(sizeof(ss_dev)));
  ss_dev *d = (ss_dev *)s.p;
  DOPT_TRY(ss_begin(c, d, x, n, nullptr));
  DOPT_TRY(ss_accum(c, d, x, n, nullptr));
  return ss_value(d, out);
}

/* ---- piece geometry on the device ------------------------------------------------------ */

/* A piece is walked by its local rows: global row R of the [b, hl, wl] block
 * holds block elements [R·wl, (R+1)·wl) ∩ [lo, lo+len); one CUDA block per row. */
struct dpiece {
  size_t b, h, w, h0, hl, w0, wl, lo, len, R0;
};

dpiece make_dpiece(const dopt_piece *pc, size_t *nrows) {
  dpiece d = {pc->b, pc->h, pc->w, pc->h0, pc->hl, pc->w0, pc->wl, pc->lo, pc->len, 0};
  *nrows = 0;
  if (pc->len && pc->wl) {
    d.R0 = pc->lo / pc->wl;
    *nrows = (pc->lo + pc->len - 1) / pc->wl - d.R0 + 1;
  }
  return d;
}

unsigned row_threads(size_t wl) {
  size_t t = (wl + 31) / 32 * 32;
  return (unsigned)(t > 256 ? 256 : (t ? t : 32));
}

/* this block's row: element range [kb, ke) of the block, batch, logical row, first logical column index base */
struct rowinfo {
  size_t kb, ke, Rbase, bi, lrow, cbase;
};
__device__ __forceinline__ rowinfo row_of(const dpiece &p, size_t r) {
  rowinfo ri;
  size_t R = p.R0 + r, s = R * p.wl, e = s + p.wl, end = p.lo + p.len;
  ri.kb = s > p.lo ? s : p.lo;
  ri.ke = e < end ? e : end;
  ri.Rbase = s;
  ri.bi = R / p.hl;
  ri.lrow = ri.bi * p.h + p.h0 + R % p.hl;
  ri.cbase = ri.bi * p.w + p.w0; /* + local column j */
  return ri;
}

__global__ void k_rc_max(const float *u, dpiece p, size_t nrows, unsigned *rmax, unsigned *cmax) {
  for (size_t r = blockIdx.x; r < nrows; r += gridDim.x) {
    rowinfo ri = row_of(p, r);
    unsigned m = 0;
    for (size_t k = ri.kb + threadIdx.x; k < ri.ke; k += blockDim.x) {
      unsigned a = finite_abs_bits(u[k - p.lo]);
      m = max(m, a);
      if (a) atomicMax(&cmax[ri.cbase + (k - ri.Rbase)], a);
    }
    m = block_max_u32(m);
    if (threadIdx.x == 0) rmax[ri.lrow] = m;
  }
}
__global__ void k_rc_scale0(const unsigned *rmax, const unsigned *cmax, size_t nr, size_t nc, double *scale) {
  GRID_STRIDE(i, nr + nc) scale[i] = (double)__uint_as_float(i < nr ? rmax[i] : cmax[i - nr]);
}
__global__ void k_rc_scale1(double *scale, size_t n) {
  GRID_STRIDE(i, n) scale[i] = xsum_scale(scale[i]);
}
__global__ void k_rc_acc(const float *u, dpiece p, size_t nrows, size_t nr, const double *scale,
                         unsigned long long *acc) {
  for (size_t r = blockIdx.x; r < nrows; r += gridDim.x) {
    rowinfo ri = row_of(p, r);
    xwords a = {{0, 0, 0, 0, 0}};
    const double rs = scale[ri.lrow];
    for (size_t k = ri.kb + threadIdx.x; k < ri.ke; k += blockDim.x) {
      double v = (double)u[k - p.lo];
      xw_add(a, rs, v);
      size_t c = nr + ri.cbase + (k - ri.Rbase);
      xwords cw = {{0, 0, 0, 0, 0}};
      xw_add(cw, scale[c], v);
      for (int q = 0; q < 5; q++)
        if (cw.w[q]) atomicAdd(&acc[c * 5 + q], cw.w[q]);
    }
    xw_block_flush(a, &acc[ri.lrow * 5]);
  }
}
__global__ void k_rc_means(const long long *acc, const double *scale, size_t nr, size_t nc, double w, double h,
                           float *row_mean, float *col_mean) {
  GRID_STRIDE(i, nr + nc) {
    double v = xw_value(acc + 5 * i, scale[i]);
    if (i < nr) row_mean[i] = dopt_mean_elem(v, w);
    else col_mean[i - nr] = dopt_mean_elem(v, h);
  }
}

/* Row and column means in the two reduction phases (core/stats.c dopt_rc_*);
 * the buffers live in the step's frame and are posted as device memory. */
struct rc_dev {
  unsigned *rmax;           /* [nr + nc]: row maxima, then column maxima (float bits) */
  double *scale;            /* [nr + nc] */
  unsigned long long *acc;  /* [(nr + nc) · 5] */
};

void rc_take(dopt_frame *f, const dopt_piece *pc, rc_dev *out) {
  const size_t nacc = pc->b * pc->h + pc->b * pc->w;
  out->rmax = (unsigned *)dopt_frame_take(f, nacc * sizeof(unsigned));
  out->scale = (double *)dopt_frame_take(f, nacc * sizeof(double));
  out->acc = (unsigned long long *)dopt_frame_take(f, nacc * 5 * sizeof(unsigned long long));
}

dopt_status rc_begin(const cuda_dev *c, rc_dev *r, const float *u, const dopt_piece *pc, const dopt_reducer *red) {
  const size_t nr = pc->b * pc->h, nc = pc->b * pc->w, nacc = nr + nc;
  size_t nrows;
  dpiece p = make_dpiece(pc, &nrows);
  const unsigned rg = (unsigned)(nrows < 65535 * 16 ? nrows : 65535 * 16), rt = row_threads(pc->wl);
  if (nacc) CU(cudaMemsetAsync(r->rmax, 0, nacc * sizeof(unsigned), ST), "row/column maxima: memset");
  if (nrows) k_rc_max<<<rg, rt, 0, ST>>>(u, p, nrows, r->rmax, r->rmax + nr);
  if (nacc) k_rc_scale0<<<grid_for(c, nacc), BS, 0, ST>>>(r->rmax, r->rmax + nr, nr, nc, r->scale);
  DOPT_TRY(sync("row/column maxima"));
  return red ? red->post_max_f64(red->ctx, r->scale, nacc) : DOPT_OK;
}

dopt_status rc_accum(const cuda_dev *c, rc_dev *r, const float *u, const dopt_piece *pc, const dopt_reducer *red) {
  const size_t nr = pc->b * pc->h, nacc = nr + pc->b * pc->w;
  size_t nrows;
  dpiece p = make_dpiece(pc, &nrows);
  const unsigned rg = (unsigned)(nrows < 65535 * 16 ? nrows : 65535 * 16), rt = row_threads(pc->wl);
  if (nacc) k_rc_scale1<<<grid_for(c, nacc), BS, 0, ST>>>(r->scale, nacc);
  if (nacc) CU(cudaMemsetAsync(r->acc, 0, nacc * 5 * sizeof(unsigned long long), ST), "row/column sums: memset");
  if (nrows) k_rc_acc<<<rg, rt, 0, ST>>>(u, p, nrows, nr, r->scale, r->acc);
  DOPT_TRY(sync("row/column sums"));
  return red ? red->post_sum_i64(red->ctx, (int64_t *)r->acc, nacc * DOPT_XSUM_WORDS) : DOPT_OK;
}

dopt_status rc_means(const cuda_dev *c, const rc_dev *r, const dopt_piece *pc, float *row_mean, float *col_mean) {
  const size_t nr = pc->b * pc->h, nc = pc->b * pc->w;
  if (nr + nc)
    k_rc_means<<<grid_for(c, nr + nc), BS, 0, ST>>>((const long long *)r->acc, r->scale, nr, nc, (double)pc->w,
                                                    (double)pc->h, row_mean, col_mean);
  return sync("row/column means");
}

/* rmean[bi] = (float)(xsum(row[bi·h .. +h]) / h): one block per batch */
__global__ void k_batch_rmean(const float *row, size_t h, float *rmean) {
  __shared__ unsigned long long words[5];
  const float *r = row + (size_t)blockIdx.x * h;
  unsigned m = 0;
  for (size_t k = threadIdx.x; k < h; k += blockDim.x) m = max(m, finite_abs_bits(r[k]));
  m = block_max_u32(m);
  const double scale = xsum_scale((double)__uint_as_float(m));
  if (threadIdx.x < 5) words[threadIdx.x] = 0;
  __syncthreads();
  xwords a = {{0, 0, 0, 0, 0}};
  for (size_t k = threadIdx.x; k < h; k += blockDim.x) xw_add(a, scale, (double)r[k]);
  for (int q = 0; q < 5; q++)
    if (a.w[q]) atomicAdd(&words[q], a.w[q]);
  __syncthreads();
  if (threadIdx.x == 0) rmean[blockIdx.x] = dopt_mean_elem(xw_value((const long long *)words, scale), (double)h);
}
/* cf[c] = 1/sqrt(col[c]); rf[r] = 1/sqrt(row[r]/rmean[batch]) for all rows and columns */
__global__ void k_factors(const float *row, const float *col, const float *rmean, size_t nr, size_t nc, size_t h,
                          float *rf, float *cf) {
  GRID_STRIDE(i, nr + nc) {
    if (i < nr) rf[i] = dopt_row_factor(row[i], rmean[i / h]);
    else cf[i - nr] = dopt_rsqrt_elem(col[i - nr]);
  }
}
__global__ void k_apply(const float *rf, const float *cf, const float *x, dpiece p, size_t nrows, float *out) {
  for (size_t r = blockIdx.x; r < nrows; r += gridDim.x) {
    rowinfo ri = row_of(p, r);
    const float f = rf[ri.lrow];
    for (size_t k = ri.kb + threadIdx.x; k < ri.ke; k += blockDim.x)
      out[k - p.lo] = dopt_factored_elem(f, cf[ri.cbase + (k - ri.Rbase)], x[k - p.lo]);
  }
}

/* the factored update of core/stats.c (dopt_factors, dopt_gen_factored), materialised on the device */
dopt_status factored_apply(const cuda_dev *c, const float *row, const float *col, const float *x, const dopt_piece *pc,
                           float *out) {
  const size_t nr = pc->b * pc->h, nc = pc->b * pc->w;
  size_t nrows;
  dpiece p = make_dpiece(pc, &nrows);
  scratch s;
  DOPT_TRY(s.get((pc->b + nr + nc) * sizeof(float)));
  float *rmean = (float *)s.p, *rf = rmean + pc->b, *cf = rf + nr;
  if (pc->b && pc->h) k_batch_rmean<<<(unsigned)pc->b, 256, 0, ST>>>(row, pc->h, rmean);
  if (nr + nc) k_factors<<<grid_for(c, nr + nc), BS, 0, ST>>>(row, col, rmean, nr, nc, pc->h ? pc->h : 1, rf, cf);
  const unsigned rg = (unsigned)(nrows < 65535 * 16 ? nrows : 65535 * 16);
  if (nrows) k_apply<<<rg, row_threads(pc->wl), 0, ST>>>(rf, cf, x, p, nrows, out);
  return sync("factored update");
}

/* ---- optimizer kernels ------------------------------------------------------------------- */

/* Each kernel is a loop over core/elem.h's element function (one source with the CPU reference). */
__global__ void k_adamw(dopt_adamw_q q, float *w, const float *g, float *m, float *v, float *vmax, size_t n) {
  GRID_STRIDE(i, n) dopt_adamw_elem(&q, &w[i], g[i], &m[i], &v[i], vmax ? &vmax[i] : nullptr);
}
__global__ void k_lamb1(dopt_lamb_q q, const float *w, const float *g, float *m, float *v, float *u, size_t n) {
  GRID_STRIDE(i, n) u[i] = dopt_lamb_dir(&q, w[i], g[i], &m[i], &v[i]);
}
__global__ void k_axpy(float *w, float alpha, const float *u, size_t n) {
  GRID_STRIDE(i, n) w[i] = dopt_axpy_elem(w[i], alpha, u[i]);
}
__global__ void k_sq_eps(float *u, const float *g, float eps1, size_t n) {
  GRID_STRIDE(i, n) u[i] = dopt_sq_eps_elem(g[i], eps1);
}
__global__ void k_ema(float *stat, const float *mean, float b, float omb, size_t n) {
  GRID_STRIDE(i, n) stat[i] = dopt_ema_elem(stat[i], b, omb, mean[i]);
}
/* 1-D second moment: v = EMA(v, u); u = (1/sqrt(v))·g */
__global__ void k_vupd(float *v, float *u, const float *g, float b, float omb, size_t n) {
  GRID_STRIDE(i, n) {
    const float vi = dopt_ema_elem(v[i], b, omb, u[i]);
    v[i] = vi;
    u[i] = dopt_unfactored_elem(vi, g[i]);
  }
}
__global__ void k_ada_final(float *w, const float *u, float *m, float div, float alpha, float b1, float omb1,
                            float decay, int use_wd, size_t n) {
  GRID_STRIDE(i, n) w[i] = dopt_adafactor_final(w[i], u[i], m ? &m[i] : nullptr, div, alpha, b1, omb1, decay, use_wd);
}
__global__ void k_came_res(float *u, float *m, float div, float b1, float omb1, float eps2, size_t n) {
  GRID_STRIDE(i, n) u[i] = dopt_came_residual(u[i], &m[i], div, b1, omb1, eps2);
}
__global__ void k_came_final(float *w, const float *upd, float lr, float decay, int use_wd, size_t n) {
  GRID_STRIDE(i, n) w[i] = dopt_came_final(w[i], upd[i], lr, decay, use_wd);
}

/* ---- frames: what a step keeps between its stages (device memory) ------------------------------ */

struct frame {
  ss_dev *pss, *uss;    /* Σw², Σu² */
  float *u;             /* [n] */
  float *rmean, *cmean; /* [b·h], [b·w] (factored) */
  rc_dev rc;            /* (factored) */
};

/* The frame of adafactor/came (factored: all fields), lamb (pss, uss, u),
 * the Σx² step (pss); adamw needs none. base NULL: only the size. */
size_t map_frame(void *base, const char *name, const dopt_piece *pc, frame *f) {
  dopt_frame fr = {(unsigned char *)base, 0};
  memset(f, 0, sizeof *f);
  if (strcmp(name, "adamw") == 0) return 0;
  f->pss = (ss_dev *)dopt_frame_take(&fr, sizeof(ss_dev));
  if (strcmp(name, "sumsq") == 0) return fr.off;
  f->uss = (ss_dev *)dopt_frame_take(&fr, sizeof(ss_dev));
  f->u = (float *)dopt_frame_take(&fr, pc->len * sizeof(float));
  if (strcmp(name, "lamb") != 0 && pc->factored) {
    f->rmean = (float *)dopt_frame_take(&fr, pc->b * pc->h * sizeof(float));
    f->cmean = (float *)dopt_frame_take(&fr, pc->b * pc->w * sizeof(float));
    rc_take(&fr, pc, &f->rc);
  }
  return fr.off;
}

/* ---- steps (host scalars exactly as the CPU files compute them; stages as theirs) -------------- */

dopt_status step_adamw(const cuda_dev *c, const dopt_step_args *a) {
  enum { LR, BETA1, BETA2, EPS, WD, AMSGRAD };
  const double *hp = a->hp;
  const dopt_adamw_q q = dopt_adamw_scalars(hp[LR], hp[BETA1], hp[BETA2], hp[EPS], hp[WD], a->step);
  size_t n = a->piece->len;
  float *vmax = hp[AMSGRAD] != 0.0 ? (float *)a->state[2] : nullptr;
  if (n)
    k_adamw<<<grid_for(c, n), BS, 0, ST>>>(q, a->param, a->grad, (float *)a->state[0], (float *)a->state[1], vmax, n);
  return sync("adamw step");
}

/* the Σx² step (dopt__impl_sumsq): global-norm clipping */
dopt_status step_sumsq(const cuda_dev *c, const dopt_step_args *a, frame &f) {
  const size_t n = a->piece->len;
  if (a->stage == 0) {
    *a->more = 1;
    return ss_begin(c, f.pss, a->grad, n, a->red);
  }
  if (a->stage == 1) {
    *a->more = 1;
    return ss_accum(c, f.pss, a->grad, n, a->red);
  }
  return ss_value(f.pss, a->host_out);
}

dopt_status step_lamb(const cuda_dev *c, const dopt_step_args *a, frame &f) {
  enum { LR, BETA1, BETA2, EPS, WD, ADAM, BIASCORR };
  const double *hp = a->hp;
  const size_t n = a->piece->len;
  float *w = a->param, *u = f.u;
  if (a->stage == 0) {
    const dopt_lamb_q q = dopt_lamb_scalars(hp[BETA1], hp[BETA2], hp[EPS], hp[WD]);
    if (n) k_lamb1<<<grid_for(c, n), BS, 0, ST>>>(q, w, a->grad, (float *)a->state[0], (float *)a->state[1], u, n);
    DOPT_TRY(sync("lamb moments"));
    *a->more = 1;
    DOPT_TRY(ss_begin(c, f.pss, w, n, a->red));
    return ss_begin(c, f.uss, u, n, a->red);
  }
  if (a->stage == 1) {
    *a->more = 1;
    DOPT_TRY(ss_accum(c, f.pss, w, n, a->red));
    return ss_accum(c, f.uss, u, n, a->red);
  }
  double pss, uss;
  DOPT_TRY(ss_value(f.pss, &pss));
  DOPT_TRY(ss_value(f.uss, &uss));
  const float alpha =
      dopt_lamb_alpha(hp[LR], hp[BETA1], hp[BETA2], hp[BIASCORR] != 0.0, hp[ADAM] != 0.0, a->step, pss, uss);
  if (n) k_axpy<<<grid_for(c, n), BS, 0, ST>>>(w, alpha, u, n);
  return sync("lamb update");
}

dopt_status put_f32(float *dst, float v) {
  CU(cudaMemcpyAsync(dst, &v, sizeof v, cudaMemcpyHostToDevice, ST), "state upload");
  return sync("state upload");
}

/* stages as ref/adafactor.c */
dopt_status step_adafactor(const cuda_dev *c, const dopt_step_args *a, frame &f) {
  enum { LR, EPS1, EPS2, CLIP, DECAY, BETA1, WD, SCALE_P, REL_STEP, WARMUP };
  const double *hp = a->hp;
  const dopt_piece *pc = a->piece;
  const size_t n = pc->len, N = pc->numel, nr = pc->b * pc->h, nc = pc->b * pc->w;
  const float *g = a->grad;
  float *w = a->param, *u = f.u;
  int s = 0;
  float *m = isnan(hp[BETA1]) ? nullptr : (float *)a->state[s++];
  float *row = (float *)a->state[s++];
  float *col = pc->factored ? (float *)a->state[s++] : nullptr;
  float *rms_state = (float *)a->state[s];
  const double t = (double)a->step;
  const double beta2t = dopt_adafactor_beta2t(t, hp[DECAY]);
  const float b2t = (float)beta2t, omb2t = (float)(1.0 - beta2t);
  const float eps1 = (float)hp[EPS1];
  const int last = pc->factored ? 4 : 2;
  if (a->stage < last) *a->more = 1;
  switch (pc->factored ? a->stage : 2 * a->stage) {
  case 0:
    DOPT_TRY(ss_begin(c, f.pss, w, n, a->red));
    if (n) k_sq_eps<<<grid_for(c, n), BS, 0, ST>>>(u, g, eps1, n);
    if (pc->factored) {
      DOPT_TRY(sync("adafactor: g^2"));
      return rc_begin(c, &f.rc, u, pc, a->red);
    }
    if (n) k_vupd<<<grid_for(c, n), BS, 0, ST>>>(row, u, g, b2t, omb2t, n);
    DOPT_TRY(sync("adafactor: second moment"));
    return ss_begin(c, f.uss, u, n, a->red);
  case 1:
    DOPT_TRY(ss_accum(c, f.pss, w, n, a->red));
    return rc_accum(c, &f.rc, u, pc, a->red);
  case 2:
    if (!pc->factored) {
      DOPT_TRY(ss_accum(c, f.pss, w, n, a->red));
      return ss_accum(c, f.uss, u, n, a->red);
    }
    DOPT_TRY(rc_means(c, &f.rc, pc, f.rmean, f.cmean));
    if (nr) k_ema<<<grid_for(c, nr), BS, 0, ST>>>(row, f.rmean, b2t, omb2t, nr);
    if (nc) k_ema<<<grid_for(c, nc), BS, 0, ST>>>(col, f.cmean, b2t, omb2t, nc);
    DOPT_TRY(factored_apply(c, row, col, g, pc, u));
    return ss_begin(c, f.uss, u, n, a->red);
  case 3:
    return ss_accum(c, f.uss, u, n, a->red);
  default:
    break;
  }
  double pss, uss;
  DOPT_TRY(ss_value(f.pss, &pss));
  const float rms = dopt_rms_from_ss(pss, N);
  DOPT_TRY(put_f32(rms_state, rms));
  const float alpha =
      dopt_adafactor_step_size(hp[REL_STEP] != 0.0, hp[WARMUP] != 0.0, hp[LR], hp[SCALE_P] != 0.0, hp[EPS2], t, rms);
  DOPT_TRY(ss_value(f.uss, &uss));
  const float div = dopt_clip_div(dopt_rms_from_ss(uss, N), hp[CLIP]);
  const float b1 = isnan(hp[BETA1]) ? 0.0f : (float)hp[BETA1];
  const float omb1 = isnan(hp[BETA1]) ? 0.0f : (float)(1.0 - hp[BETA1]);
  const float decay = (float)(-hp[WD]) * alpha;
  const int use_wd = hp[WD] != 0.0;
  if (n) k_ada_final<<<grid_for(c, n), BS, 0, ST>>>(w, u, m, div, alpha, b1, omb1, decay, use_wd, n);
  return sync("adafactor update");
}

/* stages as ref/came.c */
dopt_status step_came(const cuda_dev *c, const dopt_step_args *a, frame &f) {
  enum { LR, EPS1, EPS2, CLIP, BETA1, BETA2, BETA3, WD };
  const double *hp = a->hp;
  const dopt_piece *pc = a->piece;
  const size_t n = pc->len, N = pc->numel;
  const int factored = pc->factored;
  const float *g = a->grad;
  float *w = a->param, *m = (float *)a->state[0], *u = f.u;
  float *sq_row = (float *)a->state[1], *sq_col = nullptr, *res_row = nullptr, *res_col = nullptr, *rms_state;
  if (factored) {
    sq_col = (float *)a->state[2];
    res_row = (float *)a->state[3];
    res_col = (float *)a->state[4];
    rms_state = (float *)a->state[5];
  } else {
    rms_state = (float *)a->state[2];
  }
  const size_t nr = pc->b * pc->h, nc = pc->b * pc->w;
  const float eps1 = (float)hp[EPS1], eps2 = (float)hp[EPS2];
  const float b2 = (float)hp[BETA2], omb2 = (float)(1.0 - hp[BETA2]);
  const float b3 = (float)hp[BETA3], omb3 = (float)(1.0 - hp[BETA3]);
  const int last = factored ? 6 : 2;
  if (a->stage < last) *a->more = 1;
  switch (factored ? a->stage : 2 * a->stage) {
  case 0:
    DOPT_TRY(ss_begin(c, f.pss, w, n, a->red));
    if (n) k_sq_eps<<<grid_for(c, n), BS, 0, ST>>>(u, g, eps1, n);
    DOPT_TRY(sync("came: g^2"));
    if (factored) return rc_begin(c, &f.rc, u, pc, a->red);
    if (n) k_vupd<<<grid_for(c, n), BS, 0, ST>>>(sq_row, u, g, b2, omb2, n);
    DOPT_TRY(sync("came: second moment"));
    return ss_begin(c, f.uss, u, n, a->red);
  case 1:
    DOPT_TRY(ss_accum(c, f.pss, w, n, a->red));
    return rc_accum(c, &f.rc, u, pc, a->red);
  case 2:
    if (!factored) {
      DOPT_TRY(ss_accum(c, f.pss, w, n, a->red));
      return ss_accum(c, f.uss, u, n, a->red);
    }
    DOPT_TRY(rc_means(c, &f.rc, pc, f.rmean, f.cmean));
    if (nr) k_ema<<<grid_for(c, nr), BS, 0, ST>>>(sq_row, f.rmean, b2, omb2, nr);
    if (nc) k_ema<<<grid_for(c, nc), BS, 0, ST>>>(sq_col, f.cmean, b2, omb2, nc);
    DOPT_TRY(factored_apply(c, sq_row, sq_col, g, pc, u));
    return ss_begin(c, f.uss, u, n, a->red);
  case 3:
    return ss_accum(c, f.uss, u, n, a->red);
  case 4: {
    double pss, uss;
    DOPT_TRY(ss_value(f.pss, &pss));
    DOPT_TRY(put_f32(rms_state, dopt_rms_from_ss(pss, N)));
    DOPT_TRY(ss_value(f.uss, &uss));
    const float div = dopt_clip_div(dopt_rms_from_ss(uss, N), hp[CLIP]);
    const float b1 = (float)hp[BETA1], omb1 = (float)(1.0 - hp[BETA1]);
    if (n) k_came_res<<<grid_for(c, n), BS, 0, ST>>>(u, m, div, b1, omb1, eps2, n);
    DOPT_TRY(sync("came: residual"));
    if (factored) return rc_begin(c, &f.rc, u, pc, a->red);
    break;
  }
  case 5:
    return rc_accum(c, &f.rc, u, pc, a->red);
  default:
    break;
  }
  const float *upd = m;
  if (factored) {
    DOPT_TRY(rc_means(c, &f.rc, pc, f.rmean, f.cmean));
    if (nr) k_ema<<<grid_for(c, nr), BS, 0, ST>>>(res_row, f.rmean, b3, omb3, nr);
    if (nc) k_ema<<<grid_for(c, nc), BS, 0, ST>>>(res_col, f.cmean, b3, omb3, nc);
    DOPT_TRY(factored_apply(c, res_row, res_col, m, pc, u));
    upd = u;
  }
  const float lr = (float)hp[LR];
  const float decay = (float)(-hp[WD] * hp[LR]);
  const int use_wd = hp[WD] != 0.0;
  if (n) k_came_final<<<grid_for(c, n), BS, 0, ST>>>(w, upd, lr, decay, use_wd, n);
  return sync("came update");
}

/* ---- the vtable ------------------------------------------------------------------------------ */

cuda_dev *D(void *ctx) { return (cuda_dev *)ctx; }

#define ENTER(c) CU(cudaSetDevice((c)->id), "cudaSetDevice")

dopt_status op_alloc(void *ctx, size_t bytes, void **out) {
  ENTER(D(ctx));
  *out = nullptr;
  cudaError_t e = cudaMalloc(out, bytes ? bytes : 1);
  if (e != cudaSuccess) {
    *out = nullptr;
    return dopt__fail(DOPT_ERR_NO_MEMORY, "cuda device %d: cudaMalloc of %zu bytes: %s", D(ctx)->id, bytes,
                      cudaGetErrorString(e));
  }
  CU(cudaMemsetAsync(*out, 0, bytes ? bytes : 1, ST), "cudaMemset");
  return sync("alloc");
}
void op_free(void *ctx, void *p) {
  if (!p) return;
  cudaSetDevice(D(ctx)->id);
  cudaStreamSynchronize(ST);
  cudaFree(p);
}
dopt_status op_memcpy(void *ctx, void *dst, const void *src, size_t bytes) {
  ENTER(D(ctx));
  if (bytes) CU(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, ST), "cudaMemcpy");
  return sync("memcpy");
}
dopt_status op_add(void *ctx, float *acc, const float *x, size_t n) {
  ENTER(D(ctx));
  if (n) k_add<<<grid_for(D(ctx), n), BS, 0, ST>>>(acc, x, n);
  return sync("add");
}
dopt_status op_scale(void *ctx, float *x, float a, size_t n) {
  ENTER(D(ctx));
  if (n) k_scale<<<grid_for(D(ctx), n), BS, 0, ST>>>(x, a, n);
  return sync("scale");
}
dopt_status op_average(void *ctx, float *x, float d, size_t n, int64_t *host_nonfinite) {
  ENTER(D(ctx));
  unsigned long long *cnt = D(ctx)->count, bad = 0;
  CU(cudaMemsetAsync(cnt, 0, sizeof *cnt, ST), "average: memset");
  if (n) k_average<<<grid_for(D(ctx), n), BS, 0, ST>>>(x, d, n, cnt);
  CU(cudaMemcpyAsync(&bad, cnt, sizeof bad, cudaMemcpyDeviceToHost, ST), "average: download");
  DOPT_TRY(sync("average")); /* one sync: the count is read on the host */
  *host_nonfinite = (int64_t)bad;
  return DOPT_OK;
}
dopt_status op_grid_codes(void *ctx, const float *x, const dopt_piece *pc, int32_t *codes, int64_t *host_nonfinite) {
  ENTER(D(ctx));
  unsigned long long *cnt = D(ctx)->count, bad = 0;
  CU(cudaMemsetAsync(cnt, 0, sizeof *cnt, ST), "grid codes: memset");
  if (pc->len) k_grid_codes<<<grid_for(D(ctx), pc->len), BS, 0, ST>>>(x, *pc, (int *)codes, cnt);
  CU(cudaMemcpyAsync(&bad, cnt, sizeof bad, cudaMemcpyDeviceToHost, ST), "grid codes: download");
  DOPT_TRY(sync("grid codes"));
  *host_nonfinite = (int64_t)bad;
  return DOPT_OK;
}
dopt_status op_grid_encode(void *ctx, const float *x, const dopt_piece *pc, const int32_t *codes, int words, int k,
                           int add, int64_t *w, int64_t *cls) {
  ENTER(D(ctx));
  if (pc->len)
    k_grid_encode<<<grid_for(D(ctx), pc->len), BS, 0, ST>>>(x, *pc, (const int *)codes, words, k, add, w, cls);
  return sync("grid encode");
}
dopt_status op_grid_decode(void *ctx, const int64_t *w, const int64_t *cls, const dopt_piece *pc, const int32_t *codes,
                           int words, int k, float *x) {
  ENTER(D(ctx));
  if (pc->len) k_grid_decode<<<grid_for(D(ctx), pc->len), BS, 0, ST>>>(w, cls, *pc, (const int *)codes, words, k, x);
  return sync("grid decode");
}
dopt_status op_sumsq(void *ctx, const float *x, size_t n, double *host_ss) {
  ENTER(D(ctx));
  return piece_sumsq(D(ctx), x, n, host_ss);
}
dopt_status op_to_bf16(void *ctx, const float *x, uint16_t *y, size_t n) {
  ENTER(D(ctx));
  if (n) k_to_bf16<<<grid_for(D(ctx), n), BS, 0, ST>>>(x, y, n);
  return sync("to_bf16");
}
int has_step(const char *name) {
  return strcmp(name, "adamw") == 0 || strcmp(name, "adafactor") == 0 || strcmp(name, "came") == 0 ||
         strcmp(name, "lamb") == 0 || strcmp(name, "sumsq") == 0;
}
/* The frame of a step: a kernel step's own layout (map_frame), or for a step without a kernel the CPU
 * reference's (impl->frame), which dopt__step_on_host moves to the host and back. */
size_t op_frame_bytes(void *ctx, const dopt_step_args *a) {
  (void)ctx;
  frame f;
  if (has_step(a->impl->name)) return map_frame(nullptr, a->impl->name, a->piece, &f);
  return a->impl->frame ? a->impl->frame(a->hp, a->piece) : 0;
}
/* Kernels for adamw, adafactor, came, lamb and the Σx² step; every other optimizer (the 8-bit, GaLore, Q-GaLore,
 * LISA and Muon steps) through the CPU reference on host copies of its buffers (core/hoststep.c): bitwise by
 * construction, at the cost of copying the piece's parameter, gradient, states and frame each way per stage. */
dopt_status op_step(void *ctx, const dopt_step_args *a) {
  ENTER(D(ctx));
  const char *name = a->impl->name;
  if (!has_step(name)) return dopt__step_on_host(&D(ctx)->dev, a, op_frame_bytes(ctx, a));
  frame f;
  map_frame(a->frame, name, a->piece, &f);
  if (strcmp(name, "adamw") == 0) return step_adamw(D(ctx), a);
  if (strcmp(name, "adafactor") == 0) return step_adafactor(D(ctx), a, f);
  if (strcmp(name, "came") == 0) return step_came(D(ctx), a, f);
  if (strcmp(name, "lamb") == 0) return step_lamb(D(ctx), a, f);
  return step_sumsq(D(ctx), a, f);
}

const dopt_device_ops cuda_ops = {
    "cuda", op_alloc, op_free, op_memcpy, op_memcpy, op_memcpy, op_add, op_scale, op_average, op_sumsq, op_to_bf16,
    op_frame_bytes, op_step, op_grid_codes, op_grid_encode, op_grid_decode, 0 /* host_chunk: one pass per kernel */, nullptr /* grid_sum */,
};

} // namespace

extern "C" int dopt_cuda_device_count(const char **why) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError(); /* clear the sticky-free error */
    if (why) *why = cudaGetErrorString(e);
    return 0;
  }
  if (n == 0 && why) *why = "no CUDA device";
  return n;
}

extern "C" dopt_status dopt_device_cuda(int device, dopt_device **out) {
  DOPT_CHECK_ARG(out != NULL, "dopt_device_cuda: out=NULL");
  *out = NULL;
  const char *why = "";
  int n = dopt_cuda_device_count(&why);
  if (n == 0) return dopt__fail(DOPT_ERR_UNSUPPORTED, "cuda device: no CUDA device available (%s)", why);
  DOPT_CHECK_ARG(device >= 0 && device < n, "dopt_device_cuda: device=%d out of range [0, %d)", device, n);
  CU(cudaSetDevice(device), "cudaSetDevice");
  int sms = 0;
  CU(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "device attributes");
  cudaMemPool_t pool;
  if (cudaDeviceGetDefaultMemPool(&pool, device) == cudaSuccess) { /* keep scratch memory cached */
    uint64_t keep = UINT64_MAX;
    cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep);
  }
  cuda_dev *c = (cuda_dev *)calloc(1, sizeof *c);
  if (!c) return dopt__fail(DOPT_ERR_NO_MEMORY, "dopt_device_cuda");
  c->id = device;
  c->sms = sms > 0 ? sms : 1;
  cudaError_t e = cudaMalloc((void **)&c->count, sizeof *c->count);
  if (e != cudaSuccess) {
    free(c);
    return cu_fail(e, "dopt_device_cuda: counter");
  }
  c->dev.ops = &cuda_ops;
  c->dev.ctx = c;
  *out = &c->dev;
  return DOPT_OK;
}

extern "C" void dopt_device_cuda_destroy(dopt_device *dev) {
  if (!dev) return;
  cuda_dev *c = (cuda_dev *)dev->ctx;
  cudaSetDevice(c->id);
  cudaStreamSynchronize(ST);
  cudaFree(c->count);
  free(c);
}
