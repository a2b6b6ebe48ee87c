/* The registry: every reference optimizer by name (ref/registry.c), and the
 * helpers ref/ files share. Above core/: core/ never includes this. */
#ifndef DISTOPT_REGISTRY_H
#define DISTOPT_REGISTRY_H

#include "optim_impl.h"

/* Every registered optimizer's name in registry order, NULL-terminated (the
 * choices of LISA's `inner`). */
extern const char *const dopt__registry_names[];

/* 8-bit Adam pieces shared by adamw8bit and galore_adamw8bit (hp[0..7]: lr,
 * beta1, beta2, eps, weight_decay, min_8bit_size, percentile_clipping,
 * block_size). */
dopt_status dopt__adamw8bit_validate(const char *who, const double *hp);
int dopt__adamw8bit_layout(const double *hp, int ndim, const int64_t *shape, dopt_state_spec *out);
/* 1 when an 8-bit Adam step on a tensor of numel elements needs the whole tensor (hp[0..7]): 8-bit blocks of the
 * logical tensor (numel >= min_8bit_size), or percentile clipping (the norm of the whole gradient); else the
 * fp32-state kernel is elementwise and runs on any piece. */
int dopt__adamw8bit_whole(const double *hp, size_t numel);
/* par: NULL, or threads for the 8-bit blocks (whole blocks per thread: the
 * same bits for any split) */
dopt_status dopt__adamw8bit_update(const double *hp, double wd, int64_t step, float *p, const float *g, size_t n,
                                   void *const *state, unsigned *events, const dopt_par *par);

const dopt_optim_impl *dopt_find_impl(const char *name);

#endif
