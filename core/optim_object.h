/* The optimizer object's representation (internal to core/optim.c and
 * core/optim_step.c, never included elsewhere): struct dopt_optim with its
 * groups, parameters, thread pool and the last step's work items, and the two
 * calls the object and its step loop share. Everything outside these two files
 * reaches an optimizer through distopt/optim.h and the dopt__optim_* calls of
 * core/optim_impl.h. */
#ifndef DISTOPT_OPTIM_OBJECT_H
#define DISTOPT_OPTIM_OBJECT_H

#include "index.h"
#include "optim_impl.h"

typedef struct group {
  double hp[DOPT_MAX_HPARAMS];
} group;

struct dopt_optim {
  const dopt_optim_impl *impl; /* the optimizer that steps (a wrapper's inner one) */
  const dopt_optim_impl *wrapper; /* LISA around impl, or NULL */
  double whp[DOPT_MAX_HPARAMS];   /* the wrapper's own hyperparameters */
  int64_t gstep;                  /* dopt_optim_step calls so far */
  group *groups;
  int ngroups;
  dopt_param *params;
  int nparams, params_cap;
  dopt_index by_data; /* params[i].data -> i: the aliasing check in O(1) */
  int threads;             /* dopt_optim_set_threads (0: the default, resolved at the first step) */
  size_t min_chunk;        /* smallest piece a parameter is split into (dopt__optim_set_min_chunk) */
  struct dopt_pool *pool;  /* threads > 1 */
  struct item *items;      /* the last step's work items; their frames are reused */
  int nitems, items_cap;
  int last_parts;          /* most pieces any parameter had in the last step */
  dopt_proj_hook hook;     /* dopt_optim_set_projector_hook (fn NULL: none) */
};

/* Allocates a parameter's states from the layout (zeros, step 0; no-op when it has them); core/optim.c. */
dopt_status dopt__optim_alloc_states(dopt_optim *o, dopt_param *p);
/* Frees the last step's work items and their frames; core/optim_step.c. */
void dopt__optim_free_items(dopt_optim *o);

#endif
