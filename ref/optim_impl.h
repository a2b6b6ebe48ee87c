/* Internal optimizer interface: each reference optimizer (ref/adamw.c, ...)
 * fills one dopt_optim_impl; ref/optim.c does registry, hyperparameters,
 * groups, parameters, state storage and the step loop. */
#ifndef DISTOPT_OPTIM_IMPL_H
#define DISTOPT_OPTIM_IMPL_H

#include "distopt/optim.h"
#include "distopt/xsum.h"
#include "internal.h"

#define DOPT_MAX_STATES 8
#define DOPT_MAX_HPARAMS 16

typedef enum dopt_hp_kind {
  DOPT_HP_REAL = 0, /* finite number */
  DOPT_HP_BOOL = 1, /* true/false (stored as 1.0/0.0) */
  DOPT_HP_OPT = 2,  /* finite number or none (stored as NaN) */
} dopt_hp_kind;

typedef struct dopt_hp_def {
  const char *key;
  dopt_hp_kind kind;
  double def; /* NaN = none (DOPT_HP_OPT only) */
  const char *doc;
} dopt_hp_def;

/* A parameter as the optimizers see it. */
typedef struct dopt_param {
  char *name;
  int group;
  int ndim;
  int64_t shape[DOPT_MAX_DIMS];
  size_t numel;
  float *data;
  int layer;
  int64_t step;                        /* steps taken by this parameter */
  int nstates;                         /* 0 until allocated */
  dopt_state_view st[DOPT_MAX_STATES]; /* names/shapes from the layout, data owned */
} dopt_param;

typedef struct dopt_optim_impl {
  const char *name;
  const char *summary;
  const dopt_hp_def *hp;
  int nhp;
  /* Cross-key validation beyond the per-key kind checks (e.g. Adafactor's lr
   * with relative_step). hp[] is indexed as the impl's hp table. */
  dopt_status (*validate)(const double *hp);
  /* Writes the state tensors' names, dtypes and shapes (data NULL) for a
   * parameter of this shape; returns their number. */
  int (*layout)(const double *hp, int ndim, const int64_t *shape, dopt_state_view *out);
  /* Scratch floats needed to step a parameter of this shape (NULL: none). */
  size_t (*scratch)(int ndim, const int64_t *shape);
  /* One step of one parameter; p->step was already incremented. */
  dopt_status (*step)(const double *hp, dopt_param *p, const float *g, float *scratch);
} dopt_optim_impl;

extern const dopt_optim_impl dopt_impl_adamw;
extern const dopt_optim_impl dopt_impl_adafactor;
extern const dopt_optim_impl dopt_impl_came;
extern const dopt_optim_impl dopt_impl_lamb;

const dopt_optim_impl *dopt_find_impl(const char *name);

/* Shape helpers. */
size_t dopt_numel(int ndim, const int64_t *shape);
/* Splits a >=2-D shape into batch x rows x cols (leading dims are batch). */
void dopt_split_bhw(int ndim, const int64_t *shape, size_t *b, size_t *h, size_t *w);
/* Fills a state view's name/dtype/shape. */
void dopt_state_def(dopt_state_view *v, const char *name, int ndim, const int64_t *shape);

/* ---- numerics shared by the factored optimizers (ref/factored.c) ---------- */

/* RMS as upstream computes it from a sum of squares ss over n elements:
 * fp32 norm, then divided by fp32 sqrt(n). */
float dopt_rms_from_ss(double ss, size_t n);

/* Exact row/column sums of U [b, h, w] in the three phases a distributed
 * version interleaves with collectives (MAX on the maxima, integer SUM on the
 * accumulators):
 *   1. dopt_rowcol_absmax: rmax[b*h], cmax[b*w] = max |U| per row / column;
 *   2. dopt_rowcol_accum:  racc[b*h], cacc[b*w] += fixed-point U, with the
 *      scales dopt_xsum_scale(global max) (accumulators zeroed by the caller);
 *   3. dopt_xacc_value(acc, scale) / global count.
 * dopt_row_col_means does all three for an unsharded tensor. */
void dopt_rowcol_absmax(const float *u, size_t b, size_t h, size_t w, double *rmax, double *cmax);
void dopt_rowcol_accum(const float *u, size_t b, size_t h, size_t w, const double *rscale,
                       const double *cscale, dopt_xacc *racc, dopt_xacc *cacc);
dopt_status dopt_row_col_means(const float *u, size_t b, size_t h, size_t w, float *row_mean,
                               float *col_mean);

/* Factored second-moment approximation times x (HF _approx_sq_grad):
 * out[b,i,j] = (rsqrt(row[b,i]/rmean[b]) * rsqrt(col[b,j])) * x[b,i,j],
 * where rmean[b] is the mean of row[b,:] (exact sum / h). */
dopt_status dopt_factored_apply(const float *row, const float *col, const float *x, size_t b, size_t h,
                                size_t w, float *out);

/* Appends the factored statistics "<prefix>_row" [..., h] and "<prefix>_col"
 * [..., w] of a >=2-D parameter to out[*n]. */
void dopt_factored_state_defs(const char *row_name, const char *col_name, int ndim, const int64_t *shape,
                              dopt_state_view *out, int *n);
/* Scratch floats of a factored step: U [numel] plus row and column means
 * (numel alone for < 2-D parameters). */
size_t dopt_factored_scratch(int ndim, const int64_t *shape);

/* Exact sum of squares of x[n] (double). */
double dopt_sumsq(const float *x, size_t n);

#endif
