/* The registry: every reference optimizer by name (ref/registry.c), and the
 * helpers ref/ files share. Above core/: core/ never includes this. */
#ifndef DISTOPT_REGISTRY_H
#define DISTOPT_REGISTRY_H

#include "optim_impl.h"

extern const dopt_optim_impl dopt_impl_adamw;
extern const dopt_optim_impl dopt_impl_adafactor;
extern const dopt_optim_impl dopt_impl_came;
extern const dopt_optim_impl dopt_impl_lamb;
extern const dopt_optim_impl dopt_impl_adamw8bit;
extern const dopt_optim_impl dopt_impl_galore_adamw;
extern const dopt_optim_impl dopt_impl_galore_adamw8bit;
extern const dopt_optim_impl dopt_impl_q_galore;
extern const dopt_optim_impl dopt_impl_lisa;

/* 8-bit Adam pieces shared by adamw8bit and galore_adamw8bit (hp[0..7]: lr,
 * beta1, beta2, eps, weight_decay, min_8bit_size, percentile_clipping,
 * block_size). */
dopt_status dopt__adamw8bit_validate(const char *who, const double *hp);
int dopt__adamw8bit_layout(const double *hp, int ndim, const int64_t *shape, dopt_state_spec *out);
dopt_status dopt__adamw8bit_update(const double *hp, double wd, int64_t step, float *p, const float *g, size_t n,
                                   void *const *state, unsigned *events);

const dopt_optim_impl *dopt_find_impl(const char *name);

#endif
