/* GaLore-AdamW as galore_torch 1.0 `GaLoreAdamW` (an HF-style AdamW with
 * gradient low-rank projection), fp32:
 *   iter = t − 1 (the pre-increment step); if there is no projector yet or
 *   iter mod update_proj_gap == 0: projector(s) ← top-r singular vectors of G
 *   R ← project(G)                                   (low-rank shape)
 *   m ← m·β1 + (1−β1)·R;  v ← v·β2 + ((1−β2)·R)·R   (low-rank, never reset)
 *   N ← m / (√v + ε)
 *   p ← p + (−step_size)·(scale · project_back(N)),  step_size = lr·√bc2/bc1
 *   p ← p + (−lr·wd)·p                              (after the update, wd > 0)
 * Groups with rank = 0, and parameters that are not matrices (ndim < 2, or
 * leading dims other than 1), are plain HF AdamW (no projection).
 * State: exp_avg, exp_avg_sq, projector (A [m, r] or B [r, n]; full:
 * projector_left, projector_right); the step is the parameter's step.
 * docs/galore.md lists every deviation from galore_torch. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "galore_proj.h"
#include "registry.h"

enum { LR, BETA1, BETA2, EPS, WD, CORRECT_BIAS, RANK, GAP, SCALE, PROJ_TYPE, SVD, OVERSAMPLE, POWER_ITERS, SEED, NHP };

static const char *const proj_types[] = {"std", "reverse_std", "left", "right", "full", NULL};
static const char *const svd_kinds[] = {"exact", "randomized", NULL};

static const dopt_hp_def hps[NHP] = {
    [LR] = {"lr", DOPT_HP_REAL, 1e-3, "learning rate", NULL},
    [BETA1] = {"beta1", DOPT_HP_REAL, 0.9, "first-moment decay", NULL},
    [BETA2] = {"beta2", DOPT_HP_REAL, 0.999, "second-moment decay", NULL},
    [EPS] = {"eps", DOPT_HP_REAL, 1e-6, "added to sqrt(v) (not bias-corrected, HF style)", NULL},
    [WD] = {"weight_decay", DOPT_HP_REAL, 0.0, "decoupled decay after the update: p -= lr*wd*p", NULL},
    [CORRECT_BIAS] = {"correct_bias", DOPT_HP_BOOL, 1.0, "step_size = lr*sqrt(1-beta2^t)/(1-beta1^t)", NULL},
    [RANK] = {"rank", DOPT_HP_REAL, 0.0, "projection rank (0 = plain HF AdamW for this group)", NULL},
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
  if (hp[LR] < 0) return dopt__fail(DOPT_ERR_INVALID_ARG, "galore_adamw: lr=%g must be >= 0", hp[LR]);
  if (hp[EPS] < 0) return dopt__fail(DOPT_ERR_INVALID_ARG, "galore_adamw: eps=%g must be >= 0", hp[EPS]);
  if (!(hp[BETA1] >= 0 && hp[BETA1] < 1))
    return dopt__fail(DOPT_ERR_INVALID_ARG, "galore_adamw: beta1=%g must be in [0, 1)", hp[BETA1]);
  if (!(hp[BETA2] >= 0 && hp[BETA2] < 1))
    return dopt__fail(DOPT_ERR_INVALID_ARG, "galore_adamw: beta2=%g must be in [0, 1)", hp[BETA2]);
  if (hp[WD] < 0) return dopt__fail(DOPT_ERR_INVALID_ARG, "galore_adamw: weight_decay=%g must be >= 0", hp[WD]);
  if (!is_int(hp[RANK], 0, 1e9))
    return dopt__fail(DOPT_ERR_INVALID_ARG, "galore_adamw: rank=%g must be an integer >= 0", hp[RANK]);
  if (!is_int(hp[GAP], 1, 1e15))
    return dopt__fail(DOPT_ERR_INVALID_ARG, "galore_adamw: update_proj_gap=%g must be an integer >= 1", hp[GAP]);
  if (!is_int(hp[OVERSAMPLE], -1, 1e6))
    return dopt__fail(DOPT_ERR_INVALID_ARG, "galore_adamw: oversample=%g must be an integer >= 0 (or -1: auto)",
                      hp[OVERSAMPLE]);
  if (!is_int(hp[POWER_ITERS], 0, 100))
    return dopt__fail(DOPT_ERR_INVALID_ARG, "galore_adamw: power_iters=%g must be an integer in [0, 100]",
                      hp[POWER_ITERS]);
  if (!is_int(hp[SEED], 0, 9007199254740992.0))
    return dopt__fail(DOPT_ERR_INVALID_ARG, "galore_adamw: seed=%g must be an integer in [0, 2^53]", hp[SEED]);
  return DOPT_OK;
}

static int galore_plan(const double *hp, int ndim, const int64_t *shape, dopt_galore_plan *pl) {
  return dopt_galore_applies(hp[RANK], (int)hp[PROJ_TYPE], ndim, shape, pl);
}

static int layout(const double *hp, int ndim, const int64_t *shape, dopt_state_spec *out) {
  dopt_galore_plan pl;
  int n = 0;
  if (!galore_plan(hp, ndim, shape, &pl)) {
    dopt_state_def(&out[n++], "exp_avg", ndim, shape, 1);
    dopt_state_def(&out[n++], "exp_avg_sq", ndim, shape, 1);
    return n;
  }
  int64_t lr[2] = {(int64_t)pl.rows, (int64_t)pl.cols};
  int64_t a[2] = {(int64_t)pl.m, (int64_t)pl.r}, b[2] = {(int64_t)pl.r, (int64_t)pl.n};
  dopt_state_def(&out[n++], "exp_avg", 2, lr, 0);
  dopt_state_def(&out[n++], "exp_avg_sq", 2, lr, 0);
  if (pl.left && pl.right) {
    dopt_state_def(&out[n++], "projector_left", 2, a, 0);
    dopt_state_def(&out[n++], "projector_right", 2, b, 0);
  } else {
    dopt_state_def(&out[n++], "projector", 2, pl.left ? a : b, 0);
  }
  return n;
}

/* HF AdamW moments and normalised update on x[n] (R or G), N out. */
static void adam_core(const double *hp, const float *g, float *m, float *v, float *N, size_t n) {
  const float b1 = (float)hp[BETA1], omb1 = (float)(1.0 - hp[BETA1]);
  const float b2 = (float)hp[BETA2], omb2 = (float)(1.0 - hp[BETA2]);
  const float eps = (float)hp[EPS];
  for (size_t i = 0; i < n; i++) {
    float mi = m[i] * b1 + omb1 * g[i];
    float vi = v[i] * b2 + (omb2 * g[i]) * g[i];
    m[i] = mi;
    v[i] = vi;
    N[i] = mi / (sqrtf(vi) + eps);
  }
}

/* Only a projected parameter needs the whole tensor (its SVD); the others are HF AdamW, elementwise. */
static int whole(const double *hp, int ndim, const int64_t *shape) {
  dopt_galore_plan pl;
  return galore_plan(hp, ndim, shape, &pl);
}

static dopt_status step(const dopt_step_args *a) {
  const double *hp = a->hp;
  const dopt_piece *pc = a->piece;
  double t = (double)a->step;
  double step_size = hp[LR];
  if (hp[CORRECT_BIAS] != 0.0) {
    double bc1 = 1.0 - pow(hp[BETA1], t), bc2 = 1.0 - pow(hp[BETA2], t);
    step_size = step_size * sqrt(bc2) / bc1;
  }
  const float neg_step = (float)(-step_size);
  const float neg_decay = (float)(-hp[LR] * hp[WD]);
  float *w = a->param, *m = a->state[0], *v = a->state[1];
  size_t numel = pc->len; /* not projected: any piece (elementwise); projected: the whole tensor (below) */

  /* galore applies iff the state layout was the low-rank one: a matrix piece */
  dopt_galore_plan pl;
  int64_t shape[2] = {(int64_t)pc->h, (int64_t)pc->w};
  int active = pc->factored && pc->b == 1 && galore_plan(hp, 2, shape, &pl);
  if (active && pc->len != pc->numel)
    return dopt__fail(DOPT_ERR_UNSUPPORTED, "galore_adamw: a projected parameter needs the whole tensor (got %zu of "
                      "%zu elements)", pc->len, pc->numel);
  float *Nfull = NULL, *R = NULL, *Nl = NULL, *ws = NULL;
  dopt_status st = DOPT_OK;
  if (!active) {
    Nfull = malloc(numel * sizeof *Nfull);
    if (!Nfull) return dopt__fail(DOPT_ERR_NO_MEMORY, "galore_adamw: %zu floats", numel);
    adam_core(hp, a->grad, m, v, Nfull, numel);
  } else {
    if (pl.clamped && a->events) *a->events |= DOPT_EVENT_RANK_CLAMPED;
    float *A = pl.left ? a->state[2] : NULL;
    float *B = pl.right ? a->state[pl.left ? 3 : 2] : NULL;
    size_t nl = pl.rows * pl.cols;
    Nfull = malloc(numel * sizeof *Nfull);
    R = malloc(nl * sizeof *R);
    Nl = malloc(nl * sizeof *Nl);
    ws = pl.left && pl.right ? malloc((pl.m > pl.n ? pl.m : pl.n) * pl.r * sizeof *ws) : NULL;
    if (!Nfull || !R || !Nl || (pl.left && pl.right && !ws)) {
      st = dopt__fail(DOPT_ERR_NO_MEMORY, "galore_adamw: buffers for a [%zu, %zu] parameter", pl.m, pl.n);
      goto done;
    }
    dopt_svd_opts so = {(int)hp[SVD], (int)hp[OVERSAMPLE], (int)hp[POWER_ITERS], (uint64_t)hp[SEED], a->step - 1};
    st = dopt_galore_refresh_if_due(&pl, a->grad, a->step, (int64_t)hp[GAP], &so, A, B, a->events);
    if (st != DOPT_OK) goto done;
    dopt_galore_project(&pl, a->grad, A, B, R, ws);
    adam_core(hp, R, m, v, Nl, nl);
    dopt_galore_project_back(&pl, Nl, A, B, (float)hp[SCALE], Nfull, ws);
  }
  for (size_t i = 0; i < numel; i++) w[i] = w[i] + neg_step * Nfull[i];
  if (hp[WD] > 0.0)
    for (size_t i = 0; i < numel; i++) w[i] = w[i] + neg_decay * w[i];
done:
  free(Nfull);
  free(R);
  free(Nl);
  free(ws);
  return st;
}

/* settings that exercise every path (dopt_optim_impl.example/grid): a rank below the small tensors' dimensions and several projector refreshes; every projection type, the randomized SVD, the rank clamp (40) */
static const char *const grid[] = {
    "lr=1e-2,rank=3,update_proj_gap=7",
    "lr=1e-2,rank=3,update_proj_gap=6,proj_type=left",
    "lr=1e-2,rank=3,update_proj_gap=6,proj_type=right,svd=randomized",
    "lr=1e-2,rank=3,update_proj_gap=8,proj_type=full",
    "lr=1e-2,rank=40,update_proj_gap=5",
    NULL,
};

const dopt_optim_impl dopt_impl_galore_adamw = {
    .name = "galore_adamw",
    .summary = "GaLore-AdamW as galore_torch 1.0 (HF AdamW on low-rank projected gradients; rank=0: plain HF AdamW)",
    .hp = hps,
    .nhp = NHP,
    .validate = validate,
    .layout = layout,
    .step = step,
    .distributable = 0,
    .whole = whole,
    .example = "rank=4,update_proj_gap=2",
    .grid = grid,
};
