/* The optimizer object's representation (internal to core/optim.c and
 * core/optim_step.c, never included elsewhere): struct dopt_optim with its
 * groups, parameters, thread pool and the last step's work items (one piece of
 * a parameter's step each: its frame, states, posts and counts), and the calls
 * the object and its step loop share. Everything outside these two files
 * reaches an optimizer through distopt/optim.h and the dopt__optim_* calls of
 * core/optim_impl.h. */
#ifndef DISTOPT_OPTIM_OBJECT_H
#define DISTOPT_OPTIM_OBJECT_H

#include "index.h"
#include "optim_impl.h"

typedef struct group {
  double hp[DOPT_MAX_HPARAMS];
} group;

/* A statistic a stage posted from its frame, reduced between stages (optim_step.c). */
typedef struct post {
  int sum;  /* 0: MAX over F64, 1: SUM over I64 */
  void *x;  /* in the piece's frame */
  size_t n;
} post;

/* A work item of the last step: piece `part` of a parameter (optim_step.c builds and runs them; optim.c frees
 * them with the optimizer). */
typedef struct item {
  int param;       /* index in o->params */
  int part, parts; /* piece `part` of the parameter's `parts` */
  int stage, more;
  dopt_piece pc;
  void *frame, *whole; /* the step's frame; part > 0: private copies of the whole states */
  size_t frame_cap, whole_cap;
  float *g32; /* a bf16 gradient widened (pieces of an optimizer that is not pointwise), [g32_cap] */
  size_t g32_cap;
  void *state[DOPT_MAX_STATES];
  dopt_reducer red;
  post *posts;
  int nposts, posts_cap;
  int64_t counts[DOPT_NCOUNTERS]; /* this piece's counts of the step */
  int solo; /* a whole tensor of an optimizer that takes no pieces, large: run alone, with dopt_par */
  dopt_status st;
  char msg[512]; /* the failing stage's message (it ran on another thread) */
} item;

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
  item *items;             /* the last step's work items; their frames are reused */
  int nitems, items_cap;
  int last_parts;          /* most pieces any parameter had in the last step */
  dopt_proj_hook hook;     /* dopt_optim_set_projector_hook (fn NULL: none) */
  int eval;                /* dopt_optim_set_mode: 1 in evaluation mode (an impl with swap), the step refused */
};

/* Allocates a parameter's states from the layout (zeros, step 0; no-op when it has them); core/optim.c. */
dopt_status dopt__optim_alloc_states(dopt_optim *o, dopt_param *p);

#endif
