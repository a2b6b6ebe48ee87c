/* One source for the optimizers' element arithmetic: the per-element updates
 * of AdamW, LAMB, Adafactor and CAME, the factored second moment's factors,
 * bf16 rounding, and the step's host scalars. Compiled by the C compiler for
 * ref/ and core/ (the CPU device) and by nvcc for the CUDA kernels
 * (cuda/device.cu), so the golden, grid and thread tests test the GPU's
 * arithmetic too (docs/cuda.md "One source").
 *
 * Every floating-point operation goes through the DOPT_F* macros: plain C
 * operators on the host (the build has -ffp-contract=off, never fast-math),
 * explicit round-to-nearest intrinsics on the device (no contraction and no
 * approximate division or square root, whatever nvcc's flags). Each function
 * is written in the reference's order of operations, and element functions
 * take and return values (the caller loads and stores). Step-dependent
 * transcendental scalars (pow, sqrt of bias corrections, Adafactor's decay and
 * step size) are computed once per step on the host, in double, by the
 * dopt_*_scalars functions below, and passed to the kernels.
 *
 * tests/layering/check_kernels.cmake enforces the rule for the kernel files
 * (docs/cuda.md "One source"). */
#ifndef DOPT_ELEM_H
#define DOPT_ELEM_H

#include <math.h>
#include <stdint.h>

#if defined(__CUDACC__)
#define DOPT_EL __host__ __device__ __forceinline__
#else
#define DOPT_EL static inline
#endif

#if defined(__CUDA_ARCH__)
#define DOPT_FADD(a, b) __fadd_rn((a), (b))
#define DOPT_FSUB(a, b) __fsub_rn((a), (b))
#define DOPT_FMUL(a, b) __fmul_rn((a), (b))
#define DOPT_FDIV(a, b) __fdiv_rn((a), (b))
#define DOPT_FSQRT(a) __fsqrt_rn(a)
#define DOPT_DADD(a, b) __dadd_rn((a), (b))
#define DOPT_DSUB(a, b) __dsub_rn((a), (b))
#define DOPT_DMUL(a, b) __dmul_rn((a), (b))
#define DOPT_DDIV(a, b) __ddiv_rn((a), (b))
#define DOPT_I2D(a) __ll2double_rn((long long)(a))
#define DOPT_D2F(a) __double2float_rn(a)
#else
#define DOPT_FADD(a, b) ((a) + (b))
#define DOPT_FSUB(a, b) ((a) - (b))
#define DOPT_FMUL(a, b) ((a) * (b))
#define DOPT_FDIV(a, b) ((a) / (b))
#define DOPT_FSQRT(a) sqrtf(a)
#define DOPT_DADD(a, b) ((a) + (b))
#define DOPT_DSUB(a, b) ((a) - (b))
#define DOPT_DMUL(a, b) ((a) * (b))
#define DOPT_DDIV(a, b) ((a) / (b))
#define DOPT_I2D(a) ((double)(a))
#define DOPT_D2F(a) ((float)(a))
#endif

/* ---- exact sums (distopt/xsum.h, core/xsum.c): the words of one value, the value of the words -------- */

enum { DOPT_XW_HI = 0, DOPT_XW_LO = 1, DOPT_XW_NAN = 2, DOPT_XW_PINF = 3, DOPT_XW_NINF = 4 };

/* 2^(62−e) for absmax < 2^e (|x|·scale < 2^62: rint cannot overflow int64, and the 32-bit halves leave
 * headroom for 2^32 additions); 1 for 0 and non-finite. */
DOPT_EL double dopt_xsum_scale_of(double absmax) {
  if (!(absmax > 0.0) || !isfinite(absmax)) return 1.0;
  int e;
  (void)frexp(absmax, &e);
  return ldexp(1.0, 62 - e);
}

/* The word a non-finite x counts in (DOPT_XW_NAN, _PINF, _NINF), or −1 for a finite one. */
DOPT_EL int dopt_xsum_class(double x) {
  if (isfinite(x)) return -1;
  return isnan(x) ? DOPT_XW_NAN : (x > 0 ? DOPT_XW_PINF : DOPT_XW_NINF);
}

/* A finite x's two words: q = rint(x·scale) (exact: a power of two), its signed low 32 bits lo ∈ [−2^31, 2^31)
 * and hi = (q − lo) / 2^32 (exact). */
DOPT_EL void dopt_xsum_split(double scale, double x, int64_t *hi, int64_t *lo) {
  const int64_t q = (int64_t)rint(DOPT_DMUL(x, scale));
  int64_t l = (int64_t)((uint64_t)q & 0xffffffffu);
  if (l >= 2147483648) l -= 4294967296;
  *hi = (q - l) / 4294967296;
  *lo = l;
}

/* The value of summed words w[5]: NaN, ±inf by the counts, else the integer total carry-normalised (so the
 * double depends only on the total) times 2^32 plus the low word, divided by scale (a power of two). */
DOPT_EL double dopt_xsum_value_of(const int64_t *w, double scale) {
  if (w[DOPT_XW_NAN] > 0 || (w[DOPT_XW_PINF] > 0 && w[DOPT_XW_NINF] > 0)) return NAN;
  if (w[DOPT_XW_PINF] > 0) return INFINITY;
  if (w[DOPT_XW_NINF] > 0) return -INFINITY;
  const int64_t lo = w[DOPT_XW_LO];
  const int64_t lo_low = (int64_t)((uint64_t)lo & 0xffffffffu);
  const int64_t hi = w[DOPT_XW_HI] + (lo - lo_low) / 4294967296;
  return DOPT_DDIV(DOPT_DADD(DOPT_DMUL(DOPT_I2D(hi), 4294967296.0), DOPT_I2D(lo_low)), scale);
}

/* A mean: (float)(sum / count), one rounding to double then one to float (row and column means) */
DOPT_EL float dopt_mean_elem(double sum, double count) { return DOPT_D2F(DOPT_DDIV(sum, count)); }

/* x² in double (the sums of squares' terms) */
DOPT_EL double dopt_square_d(double x) { return DOPT_DMUL(x, x); }

/* ---- the device's vector kernels (distopt/device.h: add, scale, average) ----------------------------- */

DOPT_EL float dopt_add_elem(float acc, float x) { return DOPT_FADD(acc, x); }
DOPT_EL float dopt_scale_elem(float x, float a) { return DOPT_FMUL(x, a); }
DOPT_EL float dopt_average_elem(float x, float d) { return DOPT_FDIV(x, d); }

/* ---- AdamW (ref/adamw.c): torch.optim.AdamW's single-tensor order ---------------------------- */

typedef struct dopt_adamw_q {
  float decay, b1, omb1, b2, omb2, neg_step, bc2_sqrt, eps;
} dopt_adamw_q;

/* Host, once per step: decay = 1 − lr·wd, −lr/bc1, √bc2 with bc_i = 1 − β_i^t in double (as torch). */
static inline dopt_adamw_q dopt_adamw_scalars(double lr, double beta1, double beta2, double eps, double wd,
                                              int64_t step) {
  const double t = (double)step, bc1 = 1.0 - pow(beta1, t), bc2 = 1.0 - pow(beta2, t);
  dopt_adamw_q q;
  q.decay = (float)(1.0 - lr * wd);
  q.b1 = (float)beta1, q.omb1 = (float)(1.0 - beta1);
  q.b2 = (float)beta2, q.omb2 = (float)(1.0 - beta2);
  q.neg_step = (float)(-(lr / bc1));
  q.bc2_sqrt = (float)sqrt(bc2);
  q.eps = (float)eps;
  return q;
}

/* One element: w ← w·decay; m ← m·β1 + (1−β1)·g; v ← v·β2 + ((1−β2)·g)·g; with amsgrad (vmax non-NULL)
 * vmax ← max(vmax, v) is the denominator's; w ← w + (−lr/bc1·m) / (√v̂ / √bc2 + ε). */
DOPT_EL void dopt_adamw_elem(const dopt_adamw_q *q, float *w, float g, float *m, float *v, float *vmax) {
  const float wi = DOPT_FMUL(*w, q->decay);
  const float mi = DOPT_FADD(DOPT_FMUL(*m, q->b1), DOPT_FMUL(q->omb1, g));
  const float vi = DOPT_FADD(DOPT_FMUL(*v, q->b2), DOPT_FMUL(DOPT_FMUL(q->omb2, g), g));
  float vd = vi;
  if (vmax) {
    vd = *vmax > vi ? *vmax : vi;
    *vmax = vd;
  }
  const float denom = DOPT_FADD(DOPT_FDIV(DOPT_FSQRT(vd), q->bc2_sqrt), q->eps);
  *w = DOPT_FADD(wi, DOPT_FDIV(DOPT_FMUL(q->neg_step, mi), denom));
  *m = mi;
  *v = vi;
}

/* ---- LAMB (ref/lamb.c, ColossalAI's) ----------------------------------------------------------- */

typedef struct dopt_lamb_q {
  float b1, omb1, b2, omb2, eps, wd;
  int use_wd;
} dopt_lamb_q;

static inline dopt_lamb_q dopt_lamb_scalars(double beta1, double beta2, double eps, double wd) {
  dopt_lamb_q q;
  q.b1 = (float)beta1, q.omb1 = (float)(1.0 - beta1);
  q.b2 = (float)beta2, q.omb2 = (float)(1.0 - beta2);
  q.eps = (float)eps, q.wd = (float)wd;
  q.use_wd = wd != 0.0;
  return q;
}

/* Pass 1: the moments (not debiased) and the direction u = m / (√v + ε) + wd·w. */
DOPT_EL float dopt_lamb_dir(const dopt_lamb_q *q, float w, float g, float *m, float *v) {
  const float mi = DOPT_FADD(DOPT_FMUL(*m, q->b1), DOPT_FMUL(q->omb1, g));
  const float vi = DOPT_FADD(DOPT_FMUL(*v, q->b2), DOPT_FMUL(DOPT_FMUL(q->omb2, g), g));
  *m = mi;
  *v = vi;
  float u = DOPT_FDIV(mi, DOPT_FADD(DOPT_FSQRT(vi), q->eps));
  if (q->use_wd) u = DOPT_FADD(u, DOPT_FMUL(q->wd, w));
  return u;
}

/* Pass 2's step factor −lr'·trust, lr' = lr·√(1−β2^t)/(1−β1^t) with bias correction; trust = ‖w‖/‖u‖ from the
 * exact sums of squares (1 when either is 0 or in adam mode). Host. */
static inline float dopt_lamb_alpha(double lr, double beta1, double beta2, int bias_correction, int adam,
                                    int64_t step, double wss, double uss) {
  const double t = (double)step;
  if (bias_correction) lr *= sqrt(1.0 - pow(beta2, t)) / (1.0 - pow(beta1, t));
  const float wnorm = (float)sqrt(wss), unorm = (float)sqrt(uss);
  float trust = (wnorm == 0.0f || unorm == 0.0f) ? 1.0f : wnorm / unorm;
  if (adam) trust = 1.0f;
  return (float)(-lr) * trust;
}

/* w + alpha·u */
DOPT_EL float dopt_axpy_elem(float w, float alpha, float u) { return DOPT_FADD(w, DOPT_FMUL(alpha, u)); }

/* ---- the factored second moment (core/stats.c; Adafactor and CAME) ----------------------------- */

/* U = G² + eps1 */
DOPT_EL float dopt_sq_eps_elem(float g, float eps1) { return DOPT_FADD(DOPT_FMUL(g, g), eps1); }

/* torch's CPU lerp(self, end, w) with a scalar weight, as its vector kernel computes it: one fused multiply-add,
 * self + w·(end − self) for |w| < 0.5, else end + (w − 1)·(end − self) (Muon's and NorMuon's momentum, the second
 * moments of torch's Adafactor and Adam-mini, Schedule-Free's iterates) */
DOPT_EL float dopt_lerp_elem(float self, float end, float w) {
  return fabsf(w) < 0.5f ? fmaf(w, DOPT_FSUB(end, self), self) : fmaf(DOPT_FSUB(w, 1.0f), DOPT_FSUB(end, self), end);
}

/* stat·b + (1−b)·x: a row or column statistic's EMA, and the unfactored (1-D) second moment */
DOPT_EL float dopt_ema_elem(float stat, float b, float omb, float x) {
  return DOPT_FADD(DOPT_FMUL(stat, b), DOPT_FMUL(omb, x));
}

/* 1/√x: a column factor (x the column statistic), a row factor (x = row / its batch's row mean), and the
 * unfactored update's factor (x the second moment) */
DOPT_EL float dopt_rsqrt_elem(float x) { return DOPT_FDIV(1.0f, DOPT_FSQRT(x)); }

/* the unfactored (1-D) update of one element: (1/√v)·g */
DOPT_EL float dopt_unfactored_elem(float v, float g) { return DOPT_FMUL(dopt_rsqrt_elem(v), g); }

/* the row factor 1/√(row / mean of the batch's rows) */
DOPT_EL float dopt_row_factor(float row, float row_mean) { return dopt_rsqrt_elem(DOPT_FDIV(row, row_mean)); }

/* the factored update of one element: (row factor · column factor) · x */
DOPT_EL float dopt_factored_elem(float rf, float cf, float x) { return DOPT_FMUL(DOPT_FMUL(rf, cf), x); }

/* ---- Adafactor (ref/adafactor.c, transformers') ------------------------------------------------ */

/* The step size α = ρ·max(eps2, RMS) in upstream's precision (the product is an fp32 tensor op when RMS wins
 * the max, a double product otherwise); ρ = min(1e-2 or 1e-6·t with warm-up, 1/√t) with relative_step. Host. */
static inline float dopt_adafactor_step_size(int relative_step, int warmup_init, double lr, int scale_parameter,
                                             double eps2, double t, float rms) {
  double rho;
  if (relative_step) {
    const double min_step = warmup_init ? 1e-6 * t : 1e-2;
    const double inv = 1.0 / sqrt(t);
    rho = min_step < inv ? min_step : inv;
  } else {
    rho = lr;
  }
  if (!scale_parameter) return (float)rho;
  if (rms > (float)eps2) return (float)rho * rms;
  return (float)(rho * eps2);
}

/* β2_t = 1 − t^decay_rate (the second moment's decay at step t). Host. */
static inline double dopt_adafactor_beta2t(double t, double decay_rate) { return 1.0 - pow(t, decay_rate); }

/* The update's clipping divisor max(1, RMS(U) / d), NaN propagating (torch's clamp_(min=1)). Host. */
static inline float dopt_clip_div(float urms, double clip_threshold) {
  float div = urms / (float)clip_threshold;
  if (!(div > 1.0f)) div = div != div ? div : 1.0f;
  return div;
}

/* The last pass: u = (U / div)·α; with a momentum (m non-NULL) m ← m·β1 + (1−β1)·u and u = m; the decay
 * w ← w + (−wd·α)·w (use_wd); w ← w − u. */
DOPT_EL float dopt_adafactor_final(float w, float u, float *m, float div, float alpha, float b1, float omb1,
                                   float decay, int use_wd) {
  float ui = DOPT_FMUL(DOPT_FDIV(u, div), alpha);
  if (m) {
    const float mi = DOPT_FADD(DOPT_FMUL(*m, b1), DOPT_FMUL(omb1, ui));
    *m = mi;
    ui = mi;
  }
  if (use_wd) w = DOPT_FADD(w, DOPT_FMUL(decay, w));
  return DOPT_FSUB(w, ui);
}

/* ---- CAME (ref/came.c, came_pytorch's) --------------------------------------------------------- */

/* the clipped update Û = U / div */
DOPT_EL float dopt_came_uhat(float u, float div) { return DOPT_FDIV(u, div); }

/* the residual (Û − m)² + eps2 of Û and the updated m */
DOPT_EL float dopt_came_res(float uh, float m, float eps2) {
  const float r = DOPT_FSUB(uh, m);
  return DOPT_FADD(DOPT_FMUL(r, r), eps2);
}

/* Û = U / div; m ← m·β1 + (1−β1)·Û; returns the residual (Û − m)² + eps2. */
DOPT_EL float dopt_came_residual(float u, float *m, float div, float b1, float omb1, float eps2) {
  const float uh = dopt_came_uhat(u, div);
  const float mi = DOPT_FADD(DOPT_FMUL(*m, b1), DOPT_FMUL(omb1, uh));
  *m = mi;
  return dopt_came_res(uh, mi, eps2);
}

/* w ← w + (−wd·lr)·w (use_wd); w − upd·lr */
DOPT_EL float dopt_came_final(float w, float upd, float lr, float decay, int use_wd) {
  if (use_wd) w = DOPT_FADD(w, DOPT_FMUL(decay, w));
  return DOPT_FSUB(w, DOPT_FMUL(upd, lr));
}

/* ---- bf16 ---------------------------------------------------------------------------------------- */

/* The bf16 of an fp32 given as its bits: round to nearest even; NaN stays a quiet NaN. */
DOPT_EL uint16_t dopt_bf16_of_bits(uint32_t u) {
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

#endif
