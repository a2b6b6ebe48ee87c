/* HF AdamW (internal; transformers' AdamW as galore_torch and apollo_torch carry it: eps outside the bias
 * correction, decay after the update), defined in ref/galore_adamw.c: galore_adamw's inner and APOLLO's
 * low-rank and unprojected steps (ref/apollo.c). Its keys sit at hp[0, DOPT_HF_NKEYS) of both optimizers'
 * tables, in this order. */
#ifndef DISTOPT_HF_ADAMW_H
#define DISTOPT_HF_ADAMW_H

#include "optim_impl.h"

enum { DOPT_HF_LR, DOPT_HF_BETA1, DOPT_HF_BETA2, DOPT_HF_EPS, DOPT_HF_WD, DOPT_HF_CORRECT_BIAS, DOPT_HF_NKEYS };

#define DOPT_HF_ADAMW_HPS                                                                                      \
  [DOPT_HF_LR] = {"lr", DOPT_HP_REAL, 1e-3, "learning rate", NULL},                                            \
  [DOPT_HF_BETA1] = {"beta1", DOPT_HP_REAL, 0.9, "first-moment decay", NULL},                                  \
  [DOPT_HF_BETA2] = {"beta2", DOPT_HP_REAL, 0.999, "second-moment decay", NULL},                               \
  [DOPT_HF_EPS] = {"eps", DOPT_HP_REAL, 1e-6, "added to sqrt(v) (not bias-corrected, HF style)", NULL},        \
  [DOPT_HF_WD] = {"weight_decay", DOPT_HP_REAL, 0.0, "decoupled decay after the update: p -= lr*wd*p", NULL},  \
  [DOPT_HF_CORRECT_BIAS] = {"correct_bias", DOPT_HP_BOOL, 1.0, "step_size = lr*sqrt(1-beta2^t)/(1-beta1^t)", NULL}

/* One-line checks of the HF keys; who names the optimizer in the message. */
dopt_status dopt_hf_validate(const char *who, const double *hp);
/* exp_avg, exp_avg_sq in the parameter's shape, elementwise. */
int dopt_hf_layout(const double *hp, int ndim, const int64_t *shape, dopt_state_spec *out);
/* −step_size = −lr·√bc2/bc1 (correct_bias) or −lr, as fp32. */
float dopt_hf_neg_step(const double *hp, int64_t step);
/* The moments (state[0], state[1]) and normalised update N[i] = m/(√v + eps) of g[n]; returns −step_size. */
float dopt_hf_direction(const double *hp, int64_t step, const float *g, void *const *state, float *N, size_t n);
/* The whole HF AdamW step on any piece, elementwise: p ← p + (−step_size)·N, then p ← p + (−lr·wd)·p. */
dopt_status dopt_hf_step(const dopt_step_args *a);

#endif
