/* The registry: every reference optimizer by name (ref/registry.c), and the
 * helpers ref/ files share. Above core/: core/ never includes this. */
#ifndef DISTOPT_REGISTRY_H
#define DISTOPT_REGISTRY_H

#include "optim_impl.h"

/* Every registered optimizer's name in registry order, NULL-terminated (the
 * choices of LISA's and galore's `inner`). */
extern const char *const dopt__registry_names[];

/* AdamW8bit's keys in this order (adamw8bit, and the 8-bit GaLore forms whose inner it is; the docs differ where the
 * states are low-rank, and Q-GaLore pins block_size 2048) */
#define DOPT_ADAMW8BIT_HPS(wd_doc, min8_doc, pct_doc, block_def, block_doc)       \
  {"lr", DOPT_HP_REAL, 1e-3, "learning rate", NULL},                             \
  {"beta1", DOPT_HP_REAL, 0.9, "first-moment decay", NULL},                      \
  {"beta2", DOPT_HP_REAL, 0.999, "second-moment decay", NULL},                   \
  {"eps", DOPT_HP_REAL, 1e-8, "added to sqrt(v_hat)", NULL},                     \
  {"weight_decay", DOPT_HP_REAL, 1e-2, wd_doc, NULL},                            \
  {"min_8bit_size", DOPT_HP_INT,  4096, min8_doc, NULL},                         \
  {"percentile_clipping", DOPT_HP_INT,  100, pct_doc, NULL},                     \
  {"block_size", DOPT_HP_INT,  block_def, block_doc, NULL}
enum { DOPT_ADAMW8BIT_NHP = 8 };
/* The 8-bit GaLore forms' docs of AdamW8bit's keys */
#define DOPT_GALORE8_HPS(block_def, block_doc)                                                                  \
  DOPT_ADAMW8BIT_HPS("decoupled decay after the update (full weight, not x scale)",                          \
                     "states with fewer elements (low-rank size) stay fp32",                                  \
                     "clip the (low-rank) gradient at this percentile (100 = off)", block_def, block_doc)
extern const dopt_optim_impl dopt_impl_adamw8bit;

/* 8-bit Adam pieces shared by adamw8bit and galore_adamw8bit (hp[0..7]: lr,
 * beta1, beta2, eps, weight_decay, min_8bit_size, percentile_clipping,
 * block_size). */

dopt_status dopt__adamw8bit_validate(const char *who, const double *hp);
int dopt__adamw8bit_layout(const double *hp, int ndim, const int64_t *shape, dopt_state_spec *out);

const dopt_optim_impl *dopt_find_impl(const char *name);

/* SOAP: a basis from another implementation (upstream's, recorded) checked before it is adopted (test_golden's
 * adopt_states, distopt verify); the bounds are derived in docs/optimizers.md ("SOAP"). d: its size; A: our
 * preconditioner GG [d, d] after the step; prev: the basis the refresh started from, NULL for the first basis
 * (an eigendecomposition); theirs: the new basis; ours: the one we computed (a refresh; unused for the first).
 * Orthonormal within (2d + 4)·u; the first an eigenbasis of A in descending order within (2d + 4)·u·‖A‖_F; a
 * refresh's column k within √2·(4d + 8)·u·κ₂(P_{:,1..k}) of ours, P = A·prev sorted as the refresh sorts it.
 * Returns 0, or -1 and a one-line reason in why[cap]; *worst: the largest measured / bound. */
int dopt__soap_basis_check(size_t d, const float *A, const float *prev, const float *theirs, const float *ours,
                           double *worst, char *why, size_t cap);

/* Tests only (tests/sim/test_dist_regress.c's planted bug): while set on the calling thread, SOAP's QR refresh
 * re-sorts an eigenbasis without permuting v with it (the class of NeMo Emerging-Optimizers PR #266). */
#ifndef __cplusplus /* (CUDA's bench includes this header as C++) */
extern _Thread_local int dopt__soap_unpermuted;
#endif

#endif
