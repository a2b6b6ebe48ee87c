/* GaLore-AdamW as galore_torch 1.0 `GaLoreAdamW` (an HF-style AdamW with
 * gradient low-rank projection), fp32: the GaLore projection (ref/galore.c)
 * around a fixed HF AdamW (transformers' AdamW, not torch's: eps outside the
 * bias correction, decay after the update), in GaLoreAdamW's form:
 *   R ← project(G)                                   (low-rank shape)
 *   m ← m·β1 + (1−β1)·R;  v ← v·β2 + ((1−β2)·R)·R   (low-rank, never reset)
 *   N ← m / (√v + ε)
 *   p ← p + (−step_size)·(scale · project_back(N)),  step_size = lr·√bc2/bc1
 *   p ← p + (−lr·wd)·p                              (after the update, wd > 0)
 * Groups with rank = 0, and parameters that are not matrices (ndim < 2, or
 * leading dims other than 1), are plain HF AdamW (no projection, any piece).
 * State: exp_avg, exp_avg_sq, projector (A [m, r] or B [r, n]; full:
 * projector_left, projector_right); the step is the parameter's step.
 * docs/galore.md lists every deviation from galore_torch. */
#include <math.h>

#include "galore_proj.h"
#include "registry.h"

/* the HF AdamW keys, then the projector's */
enum { LR, BETA1, BETA2, EPS, WD, CORRECT_BIAS, PROJ, NHP = PROJ + DOPT_GP_COUNT };

static const dopt_hp_def hps[NHP] = {
    [LR] = {"lr", DOPT_HP_REAL, 1e-3, "learning rate", NULL},
    [BETA1] = {"beta1", DOPT_HP_REAL, 0.9, "first-moment decay", NULL},
    [BETA2] = {"beta2", DOPT_HP_REAL, 0.999, "second-moment decay", NULL},
    [EPS] = {"eps", DOPT_HP_REAL, 1e-6, "added to sqrt(v) (not bias-corrected, HF style)", NULL},
    [WD] = {"weight_decay", DOPT_HP_REAL, 0.0, "decoupled decay after the update: p -= lr*wd*p", NULL},
    [CORRECT_BIAS] = {"correct_bias", DOPT_HP_BOOL, 1.0, "step_size = lr*sqrt(1-beta2^t)/(1-beta1^t)", NULL},
    DOPT_GALORE_HPS_CORE("projection rank (0 = plain HF AdamW for this group)", DOPT_GALORE_GAP_DOC),
    DOPT_GALORE_HPS_SVD,
};

/* ---- HF AdamW (the inner; not registered): its keys are hps[0..PROJ) ---- */

static dopt_status hf_validate(const double *hp) {
  if (hp[LR] < 0) return dopt__fail(DOPT_ERR_INVALID_ARG, "galore_adamw: lr=%g must be >= 0", hp[LR]);
  if (hp[EPS] < 0) return dopt__fail(DOPT_ERR_INVALID_ARG, "galore_adamw: eps=%g must be >= 0", hp[EPS]);
  if (!(hp[BETA1] >= 0 && hp[BETA1] < 1))
    return dopt__fail(DOPT_ERR_INVALID_ARG, "galore_adamw: beta1=%g must be in [0, 1)", hp[BETA1]);
  if (!(hp[BETA2] >= 0 && hp[BETA2] < 1))
    return dopt__fail(DOPT_ERR_INVALID_ARG, "galore_adamw: beta2=%g must be in [0, 1)", hp[BETA2]);
  if (hp[WD] < 0) return dopt__fail(DOPT_ERR_INVALID_ARG, "galore_adamw: weight_decay=%g must be >= 0", hp[WD]);
  return DOPT_OK;
}

static int hf_layout(const double *hp, int ndim, const int64_t *shape, dopt_state_spec *out) {
  (void)hp;
  dopt_state_def(&out[0], "exp_avg", ndim, shape, 1);
  dopt_state_def(&out[1], "exp_avg_sq", ndim, shape, 1);
  return 2;
}

/* −step_size = −lr·√bc2/bc1 (correct_bias) or −lr, as fp32 */
static float neg_step(const double *hp, int64_t step) {
  double t = (double)step, step_size = hp[LR];
  if (hp[CORRECT_BIAS] != 0.0) step_size = step_size * sqrt(1.0 - pow(hp[BETA2], t)) / (1.0 - pow(hp[BETA1], t));
  return (float)(-step_size);
}

/* HF AdamW moments and normalised update N of g[n]; returns the multiplier −step_size. */
static float hf_direction(const double *hp, int64_t step, const float *g, void *const *state, float *N, size_t n) {
  const float b1 = (float)hp[BETA1], omb1 = (float)(1.0 - hp[BETA1]);
  const float b2 = (float)hp[BETA2], omb2 = (float)(1.0 - hp[BETA2]);
  const float eps = (float)hp[EPS];
  float *m = state[0], *v = state[1];
  for (size_t i = 0; i < n; i++) {
    float mi = m[i] * b1 + omb1 * g[i];
    float vi = v[i] * b2 + (omb2 * g[i]) * g[i];
    m[i] = mi;
    v[i] = vi;
    N[i] = mi / (sqrtf(vi) + eps);
  }
  return neg_step(hp, step);
}

/* An unprojected piece, elementwise: p ← p + (−step_size)·N, then p ← p + (−lr·wd)·p (element by element: the same
 * operations as two passes) */
static dopt_status hf_step(const dopt_step_args *a) {
  const double *hp = a->hp;
  const float b1 = (float)hp[BETA1], omb1 = (float)(1.0 - hp[BETA1]);
  const float b2 = (float)hp[BETA2], omb2 = (float)(1.0 - hp[BETA2]);
  const float eps = (float)hp[EPS], ns = neg_step(hp, a->step), neg_decay = (float)(-hp[LR] * hp[WD]);
  const int decay = hp[WD] > 0.0;
  float *w = a->param, *m = a->state[0], *v = a->state[1];
  const float *g = a->grad;
  for (size_t i = 0; i < a->piece->len; i++) {
    float mi = m[i] * b1 + omb1 * g[i];
    float vi = v[i] * b2 + (omb2 * g[i]) * g[i];
    m[i] = mi;
    v[i] = vi;
    float wi = w[i] + ns * (mi / (sqrtf(vi) + eps));
    w[i] = decay ? wi + neg_decay * wi : wi;
  }
  return DOPT_OK;
}

static const dopt_optim_impl hf_adamw = {
    .name = "galore_adamw",
    .summary = "HF AdamW (galore_adamw's inner)",
    .hp = hps,
    .nhp = PROJ,
    .validate = hf_validate,
    .layout = hf_layout,
    .step = hf_step,
    .distributable = 1,
};

/* ---- galore_adamw ---- */

static dopt_galore_spec spec(const double *hp) {
  (void)hp;
  dopt_galore_spec sp = {"galore_adamw", &hf_adamw, 0, PROJ, DOPT_GP_COUNT, LR, WD, hf_direction, -1, -1, -1};
  return sp;
}

static dopt_status validate(const double *hp) {
  DOPT_TRY(hf_validate(hp));
  dopt_galore_spec sp = spec(hp);
  return dopt_galore_validate(&sp, hp);
}
DOPT_GALORE_FORM_FUNCTIONS

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
    DOPT_GALORE_FORM_IMPL,
    .example = "rank=4,update_proj_gap=2",
    .grid = grid,
};
