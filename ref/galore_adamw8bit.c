/* GaLore-AdamW8bit as galore_torch's GaLoreAdamW8bit (adamw8bit.py on
 * bitsandbytes' blockwise 8-bit Adam; docs/galore.md), fp32 parameters.
 *
 * For a matrix in a group with rank > 0, each step:
 *   1. refresh the projector at 0-based iterations 0, T, 2T, ... (GaLore SVD,
 *      deterministic sign convention, ref/galore_proj.c);
 *   2. R = project(G)                                  [rows, cols] (low rank)
 *   3. the 8-bit (or, below min_8bit_size *of the low-rank size*, fp32) Adam
 *      kernel steps a zero "parameter" of R's shape with weight decay off:
 *      U = 0 + step_size·s1/(√s2 + c2·eps)   (= −lr·bias-corrected update)
 *      states: low-rank state1/state2 (+absmax) and, with percentile
 *      clipping, the gnorm history of R;
 *   4. P ← P + scale·project_back(U)
 *   5. decoupled decay after: P ← P + (−lr·wd)·P
 * Moments are kept (not reset, not rotated) across refreshes, as upstream.
 * Groups with rank = 0 and non-matrix parameters are plain AdamW8bit. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "distopt/quant8.h"
#include "galore_proj.h"
#include "registry.h"

/* hp[0..7] are AdamW8bit's (shared validation, layout and kernel) */
enum { LR, BETA1, BETA2, EPS, WD, MIN8, PCT, BLOCK, RANK, GAP, SCALE, PROJ_TYPE, SVD, OVERSAMPLE, POWER_ITERS, SEED, NHP };

static const char *const proj_types[] = {"std", "reverse_std", "left", "right", "full", NULL};
static const char *const svd_kinds[] = {"exact", "randomized", NULL};

static const dopt_hp_def hps[NHP] = {
    [LR] = {"lr", DOPT_HP_REAL, 1e-3, "learning rate", NULL},
    [BETA1] = {"beta1", DOPT_HP_REAL, 0.9, "first-moment decay", NULL},
    [BETA2] = {"beta2", DOPT_HP_REAL, 0.999, "second-moment decay", NULL},
    [EPS] = {"eps", DOPT_HP_REAL, 1e-8, "added to sqrt(v_hat)", NULL},
    [WD] = {"weight_decay", DOPT_HP_REAL, 1e-2, "decoupled decay after the update (full weight, not x scale)", NULL},
    [MIN8] = {"min_8bit_size", DOPT_HP_REAL, 4096, "states with fewer elements (low-rank size) stay fp32", NULL},
    [PCT] = {"percentile_clipping", DOPT_HP_REAL, 100, "clip the (low-rank) gradient at this percentile (100 = off)",
             NULL},
    [BLOCK] = {"block_size", DOPT_HP_REAL, DOPT_Q8_BLOCK_DEFAULT, "quantisation block (256; 2048 = bnb <= 0.43)", NULL},
    [RANK] = {"rank", DOPT_HP_REAL, 0.0, "projection rank (0 = plain AdamW8bit for this group)", NULL},
    [GAP] = {"update_proj_gap", DOPT_HP_REAL, 200.0, "refresh the projector at 0-based steps 0, T, 2T, ...", NULL},
    [SCALE] = {"scale", DOPT_HP_REAL, 1.0, "back-projection scale", NULL},
    [PROJ_TYPE] = {"proj_type", DOPT_HP_ENUM, 0.0, "projected side (docs/galore.md)", proj_types},
    [SVD] = {"svd", DOPT_HP_ENUM, 0.0, "exact (LAPACK) or randomized range finder", svd_kinds},
    [OVERSAMPLE] = {"oversample", DOPT_HP_REAL, -1.0, "randomized SVD: extra columns (-1: as many as the rank)", NULL},
    [POWER_ITERS] = {"power_iters", DOPT_HP_REAL, 4.0, "randomized SVD: power iterations", NULL},
    [SEED] = {"seed", DOPT_HP_REAL, 0.0, "randomized SVD: generator seed", NULL},
};

static int is_int(double v, double lo, double hi) { return v == floor(v) && v >= lo && v <= hi; }

static dopt_status validate(const double *hp) {
  DOPT_TRY(dopt__adamw8bit_validate("galore_adamw8bit", hp));
  if (!is_int(hp[RANK], 0, 1e9))
    return dopt__fail(DOPT_ERR_INVALID_ARG, "galore_adamw8bit: rank=%g must be an integer >= 0", hp[RANK]);
  if (!is_int(hp[GAP], 1, 1e15))
    return dopt__fail(DOPT_ERR_INVALID_ARG, "galore_adamw8bit: update_proj_gap=%g must be an integer >= 1", hp[GAP]);
  if (!is_int(hp[OVERSAMPLE], -1, 1e6) || !is_int(hp[POWER_ITERS], 0, 100) || !is_int(hp[SEED], 0, 9007199254740992.0))
    return dopt__fail(DOPT_ERR_INVALID_ARG,
                      "galore_adamw8bit: oversample=%g, power_iters=%g, seed=%g must be integers (>= -1; <= 100; <= 2^53)",
                      hp[OVERSAMPLE], hp[POWER_ITERS], hp[SEED]);
  return DOPT_OK;
}

static int plan_of(const double *hp, int ndim, const int64_t *shape, dopt_galore_plan *pl) {
  return dopt_galore_applies(hp[RANK], (int)hp[PROJ_TYPE], ndim, shape, pl);
}

static int layout(const double *hp, int ndim, const int64_t *shape, dopt_state_spec *out) {
  dopt_galore_plan pl;
  if (!plan_of(hp, ndim, shape, &pl)) return dopt__adamw8bit_layout(hp, ndim, shape, out);
  /* the 8-bit states in the low-rank shape (8-bit chosen on its size) */
  int64_t lr[2] = {(int64_t)pl.rows, (int64_t)pl.cols};
  int n = dopt__adamw8bit_layout(hp, 2, lr, out);
  int64_t a[2] = {(int64_t)pl.m, (int64_t)pl.r}, b[2] = {(int64_t)pl.r, (int64_t)pl.n};
  for (int k = 0; k < n; k++) out[k].elementwise = 0; /* low-rank: not shaped like the parameter */
  if (pl.left && pl.right) {
    dopt_state_def(&out[n++], "projector_left", 2, a, 0);
    dopt_state_def(&out[n++], "projector_right", 2, b, 0);
  } else {
    dopt_state_def(&out[n++], "projector", 2, pl.left ? a : b, 0);
  }
  return n;
}

/* A projected parameter (its SVD) and an 8-bit one (blocks of the logical tensor) need the whole tensor; a small
 * parameter with fp32 states (below min_8bit_size, no percentile clipping) is elementwise AdamW. */
static int whole(const double *hp, int ndim, const int64_t *shape) {
  dopt_galore_plan pl;
  return plan_of(hp, ndim, shape, &pl) || dopt__adamw8bit_whole(hp, dopt_numel(ndim, shape));
}

static dopt_status step(const dopt_step_args *a) {
  const double *hp = a->hp;
  const dopt_piece *pc = a->piece;
  dopt_galore_plan pl;
  int64_t shape[2] = {(int64_t)pc->h, (int64_t)pc->w};
  const int active = pc->factored && pc->b == 1 && plan_of(hp, 2, shape, &pl); /* the layout's rule (whole()) */
  if (pc->len != pc->numel && (active || dopt__adamw8bit_whole(hp, pc->numel)))
    return dopt__fail(DOPT_ERR_UNSUPPORTED, "galore_adamw8bit: needs the whole tensor (got %zu of %zu elements)", pc->len,
                      pc->numel);
  if (!active)
    return dopt__adamw8bit_update(hp, hp[WD], a->step, a->param, a->grad, pc->len, a->state, a->events, a->par);

  if (pl.clamped && a->events) *a->events |= DOPT_EVENT_RANK_CLAMPED;
  int nq = dopt__adamw8bit_layout(hp, 2, (int64_t[2]){(int64_t)pl.rows, (int64_t)pl.cols}, (dopt_state_spec[DOPT_MAX_STATES]){0});
  float *A = pl.left ? a->state[nq] : NULL;
  float *B = pl.right ? a->state[nq + (pl.left ? 1 : 0)] : NULL;
  dopt_svd_opts so = {(int)hp[SVD], (int)hp[OVERSAMPLE], (int)hp[POWER_ITERS], (uint64_t)hp[SEED], a->step - 1};
  DOPT_TRY(dopt_galore_refresh_if_due(&pl, a->grad, a->step, (int64_t)hp[GAP], &so, A, B, a->events));
  return dopt_galore8_update("galore_adamw8bit", &pl, hp, hp[SCALE], a->step, a->grad, A, B, a->state, a->param,
                             a->events);
}

dopt_status dopt_galore8_update(const char *who, const dopt_galore_plan *pl, const double *hp8, double scale,
                                int64_t step, const float *g, const float *A, const float *B, void *const *state,
                                float *w, unsigned *events) {
  const size_t nl = pl->rows * pl->cols, numel = pl->m * pl->n;
  float *R = malloc(nl * sizeof *R), *U = calloc(nl, sizeof *U), *full = malloc(numel * sizeof *full);
  float *ws = pl->left && pl->right ? malloc((pl->m > pl->n ? pl->m : pl->n) * pl->r * sizeof *ws) : NULL;
  dopt_status st = DOPT_OK;
  if (!R || !U || !full || (pl->left && pl->right && !ws)) {
    st = dopt__fail(DOPT_ERR_NO_MEMORY, "%s: buffers for a [%zu, %zu] parameter", who, pl->m, pl->n);
    goto done;
  }
  dopt_galore_project(pl, g, A, B, R, ws);
  /* the kernel on a zero parameter, decay off: U = −lr·(bias-corrected Adam update) */
  if ((st = dopt__adamw8bit_update(hp8, 0.0, step, U, R, nl, state, events, NULL)) != DOPT_OK) goto done;
  dopt_galore_project_back(pl, U, A, B, (float)scale, full, ws);
  for (size_t i = 0; i < numel; i++) w[i] = w[i] + full[i];
  if (hp8[WD] > 0.0) {
    const float neg_decay = (float)(-hp8[LR] * hp8[WD]);
    for (size_t i = 0; i < numel; i++) w[i] = w[i] + neg_decay * w[i];
  }
done:
  free(R);
  free(U);
  free(full);
  free(ws);
  return st;
}

/* settings that exercise every path (dopt_optim_impl.example/grid): low rank, refreshes, 8-bit states on the projected moments */
static const char *const grid[] = {
    "lr=1e-2,rank=3,update_proj_gap=9,min_8bit_size=8,block_size=256,proj_type=left",
    NULL,
};

const dopt_optim_impl dopt_impl_galore_adamw8bit = {
    .name = "galore_adamw8bit",
    .summary = "GaLore-AdamW8bit as galore_torch (bitsandbytes 8-bit Adam on the low-rank projected gradient)",
    .hp = hps,
    .nhp = NHP,
    .validate = validate,
    .layout = layout,
    .step = step,
    .distributable = 0,
    .whole = whole,
    .example = "rank=4,update_proj_gap=2,min_8bit_size=64",
    .grid = grid,
};
