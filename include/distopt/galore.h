/* distopt — GaLore helpers (the optimizer itself is the registry entry
 * "galore_adamw"; docs/galore.md).
 *
 * Parameter grouping as ColossalAI's get_galore_param_groups: 2-D weights go
 * to a GaLore group (rank 256, update_proj_gap 200, scale 0.25, proj_type std,
 * then `galore_overrides`), other weights to a plain-AdamW group with the
 * optimizer's weight decay, biases and norm weights to a plain-AdamW group
 * without decay. */
#ifndef DISTOPT_GALORE_H
#define DISTOPT_GALORE_H

#include "distopt/export.h"
#include "distopt/optim.h"
#include "distopt/status.h"

#ifdef __cplusplus
extern "C" {
#endif

enum {
  DOPT_GALORE_CLASS_GALORE = 0,  /* projected (GaLore group) */
  DOPT_GALORE_CLASS_DECAY = 1,   /* plain AdamW with weight decay */
  DOPT_GALORE_CLASS_NODECAY = 2, /* plain AdamW, weight_decay = 0 */
};

/* The class of a parameter by name and rank: a name containing "bias" or
 * "norm" (any case; covers "LayerNorm.weight", "RMSNorm", "ln_norm") →
 * NODECAY; otherwise ndim == 2 → GALORE; otherwise → DECAY. Returns -1 for
 * name == NULL or ndim < 0. */
DOPT_API int dopt_galore_classify(const char *name, int ndim);

/* Adds the three groups to a "galore_adamw" optimizer (any existing groups
 * are kept): the GaLore group ("rank=256,update_proj_gap=200,scale=0.25,
 * proj_type=std" then galore_overrides, on top of group 0), the decay group
 * (group 0 with rank=0) and the no-decay group (rank=0, weight_decay=0). Any
 * output pointer may be NULL. */
DOPT_API dopt_status dopt_galore_add_groups(dopt_optim *o, const char *galore_overrides, int *galore_group,
                                            int *decay_group, int *nodecay_group);

/* dopt_optim_set_projector_hook (a caller-supplied projector): distopt/optim.h. */

#ifdef __cplusplus
}
#endif
#endif
