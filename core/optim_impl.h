/* Internal optimizer interface: each reference optimizer (ref/adamw.c, ...)
 * fills one dopt_optim_impl; core/optim.c does hyperparameters, groups,
 * parameters, state storage and the step loop; ref/registry.c names them. The step of every
 * optimizer is written once, on a *piece* of the logical tensor with a
 * reducer for its cross-element statistics (distopt/device.h): the
 * single-device reference calls it with the whole tensor and no reducer,
 * distributed/ with its shard and a reducer over the ranks sharing the tensor, so
 * the two are the same computation. */
#ifndef DISTOPT_OPTIM_IMPL_H
#define DISTOPT_OPTIM_IMPL_H

#include "distopt/device.h"
#include "distopt/optim.h"
#include "distopt/xsum.h"
#include "internal.h"

#define DOPT_MAX_STATES 16
#define DOPT_MAX_HPARAMS 32

typedef enum dopt_hp_kind {
  DOPT_HP_REAL = 0, /* finite number */
  DOPT_HP_BOOL = 1, /* true/false (stored as 1.0/0.0) */
  DOPT_HP_OPT = 2,  /* finite number or none (stored as NaN) */
  DOPT_HP_ENUM = 3, /* one of `choices` by name (stored as its index) */
} dopt_hp_kind;

typedef struct dopt_hp_def {
  const char *key;
  dopt_hp_kind kind;
  double def; /* NaN = none (DOPT_HP_OPT only); the index for DOPT_HP_ENUM */
  const char *doc;
  const char *const *choices; /* DOPT_HP_ENUM: NULL-terminated names */
} dopt_hp_def;

/* A state tensor's description. Elementwise states have the parameter's
 * shape and are sharded like it; the others (factored row/column statistics,
 * the 0-d RMS) are small and every rank holds them whole. */
typedef struct dopt_state_spec {
  dopt_state_view v; /* name, dtype, shape, bytes (data NULL) */
  int elementwise;
} dopt_state_spec;

/* A parameter as the single-device optimizer sees it. */
typedef struct dopt_param {
  char *name;
  int group;
  int ndim;
  int64_t shape[DOPT_MAX_DIMS];
  size_t numel;
  float *data;      /* fp32 values the optimizer updates (the master for bf16) */
  uint16_t *work;   /* bf16 working copy (NULL for fp32 parameters) */
  int layer;
  int64_t step;                        /* steps taken by this parameter */
  int frozen;                          /* set by a wrapper's pre_step (LISA): skip as a NULL gradient */
  unsigned events;                     /* DOPT_EVENT_* of the last step */
  int nstates;                         /* 0 until allocated */
  dopt_state_view st[DOPT_MAX_STATES]; /* names/shapes from the layout, data owned */
} dopt_param;

/* One step of one optimizer on one piece (what dopt_device_ops.step runs). */
typedef struct dopt_step_args {
  const struct dopt_optim_impl *impl;
  const double *hp;        /* the group's hyperparameters, impl order */
  int64_t step;            /* t, already incremented */
  const dopt_piece *piece;
  float *param;            /* [len] */
  const float *grad;       /* [len] */
  void *const *state;      /* elementwise states [len], the others whole */
  float *ws;               /* scratch floats: impl->scratch(piece) */
  const dopt_reducer *red; /* NULL: single device */
  unsigned *events;        /* the step ORs DOPT_EVENT_* flags here (may be NULL) */
  uint64_t tensor;         /* the parameter's index in its optimizer (counter-based generator key) */
} dopt_step_args;

typedef struct dopt_optim_impl {
  const char *name;
  const char *summary;
  const dopt_hp_def *hp;
  int nhp;
  /* Cross-key validation beyond the per-key kind checks (e.g. Adafactor's lr
   * with relative_step). hp[] is indexed as the impl's hp table. */
  dopt_status (*validate)(const double *hp);
  /* The state tensors of a parameter of this logical shape; returns their number. */
  int (*layout)(const double *hp, int ndim, const int64_t *shape, dopt_state_spec *out);
  /* Scratch floats needed to step this piece (NULL: none). */
  size_t (*scratch)(const dopt_piece *piece);
  /* One step on one piece. */
  dopt_status (*step)(const dopt_step_args *a);
  /* 1: the step is correct on any piece with a reducer (distributed/ may shard it);
   * 0: it needs the whole tensor (e.g. an SVD of the full gradient) and
   * distributed/ refuses it. */
  int distributable;
  /* Non-NULL: a wrapper (LISA). Its own keys are hp[]; every other key
   * belongs to the inner optimizer it chooses (docs/lisa.md). */
  const struct dopt_wrap_ops *wrap;
} dopt_optim_impl;

/* A wrapper optimizer around an inner registry optimizer. The optimizer
 * object then runs the inner impl (groups hold the inner hyperparameters)
 * and calls pre_step once per dopt_optim_step, before the parameter loop. */
typedef struct dopt_wrap_ops {
  /* The inner optimizer chosen by the wrapper's hyperparameters whp. */
  const dopt_optim_impl *(*inner)(const double *whp);
  /* gstep: 0-based number of dopt_optim_step calls before this one. Sets
   * frozen on every parameter (a frozen parameter is skipped exactly as a
   * NULL gradient) and may free states (dopt__optim_free_states). */
  dopt_status (*pre_step)(dopt_optim *o, const double *whp, int64_t gstep);
} dopt_wrap_ops;

/* The optimizer object over one implementation (the public name-based
 * calls, dopt_optim_create etc., are ref/registry.c's: they look the name up
 * and call these). */
dopt_status dopt__optim_create_impl(const dopt_optim_impl *im, const char *hparams, dopt_optim **out);
dopt_status dopt__impl_state_bytes(const dopt_optim_impl *im, const char *hparams, int ndim, const int64_t *shape,
                                   size_t *bytes);
dopt_status dopt__impl_describe(const dopt_optim_impl *im, char *buf, size_t cap);
/* The implementation and group hyperparameters of a registry optimizer. */
const dopt_optim_impl *dopt__optim_impl(const dopt_optim *o);
const double *dopt__optim_group_hp(const dopt_optim *o, int group);
dopt_param *dopt__optim_param(dopt_optim *o, int i);
/* The wrapper around o's impl (LISA), or NULL. */
const dopt_optim_impl *dopt__optim_wrapper(const dopt_optim *o);
/* Frees parameter i's states: it restarts from zeros and step 0 at its next step. */
void dopt__optim_free_states(dopt_optim *o, int i);

/* Shape helpers. */
size_t dopt_numel(int ndim, const int64_t *shape);
/* Splits a >=2-D shape into batch x rows x cols (leading dims are batch). */
void dopt_split_bhw(int ndim, const int64_t *shape, size_t *b, size_t *h, size_t *w);
/* Fills a state spec's name/dtype/shape (F32; _dtype: any dtype). */
void dopt_state_def(dopt_state_spec *s, const char *name, int ndim, const int64_t *shape, int elementwise);
void dopt_state_def_dtype(dopt_state_spec *s, const char *name, dopt_dtype dtype, int ndim, const int64_t *shape,
                          int elementwise);

/* ---- exact statistics of a piece (core/stats.c) -------------------------------------- */

/* RMS as upstream computes it from a sum of squares ss over n elements:
 * fp32 norm, then divided by fp32 sqrt(n). */
float dopt_rms_from_ss(double ss, size_t n);

/* Exact Σx² over a piece's n local elements, combined by red (NULL: local). */
dopt_status dopt_piece_sumsq(const float *x, size_t n, const dopt_reducer *red, double *out);

/* Row and column means of U over the logical [b, h, w], U given as the
 * piece's local elements: row_mean[b·h] = Σ_w U / w, col_mean[b·w] = Σ_h U / h
 * (fp32), identical on every rank. Phases: absmax (reducer MAX), fixed-point
 * accumulation (reducer SUM), finalisation. */
dopt_status dopt_piece_rowcol_means(const float *u, const dopt_piece *pc, const dopt_reducer *red, float *row_mean,
                                    float *col_mean);

/* Factored second-moment approximation times x on the piece (HF
 * _approx_sq_grad): out[k] = (rsqrt(row[r]/rmean[b]) · rsqrt(col[c])) · x[k]
 * for the local element k at logical row r and column c; rmean[b] is the mean
 * of the whole row statistic of batch b (exact sum / h). row, col: whole. */
dopt_status dopt_piece_factored_apply(const float *row, const float *col, const float *x, const dopt_piece *pc,
                                      float *out);

/* Appends the factored statistics (row [..., h], column [..., w]) of a >=2-D
 * parameter to out[*n]. */
void dopt_factored_state_defs(const char *row_name, const char *col_name, int ndim, const int64_t *shape,
                              dopt_state_spec *out, int *n);
/* Scratch floats of a factored step: U [len] plus row and column means. */
size_t dopt_factored_scratch(const dopt_piece *pc);

/* Exact sum of squares of a local array x[n] (double). */
double dopt_sumsq(const float *x, size_t n);

#endif
