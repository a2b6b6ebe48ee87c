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
#include "hf_adamw.h"
#include "registry.h"

/* the HF AdamW keys, then the projector's */
enum { LR = DOPT_HF_LR, BETA1, BETA2, EPS, WD, CORRECT_BIAS, PROJ = DOPT_HF_NKEYS, NHP = PROJ + DOPT_GP_COUNT };

static const dopt_hp_def hps[NHP] = {
    DOPT_HF_ADAMW_HPS,
    DOPT_GALORE_HPS_CORE("projection rank (0 = plain HF AdamW for this group)", DOPT_GALORE_GAP_DOC),
    DOPT_GALORE_HPS_SVD,
};

/* ---- HF AdamW (the inner; not registered): its keys are hps[0..PROJ) ---- */

dopt_status dopt_hf_validate(const char *who, const double *hp) {
  if (hp[LR] < 0) return dopt__fail(DOPT_ERR_INVALID_ARG, "%s: lr=%g must be >= 0", who, hp[LR]);
  if (hp[EPS] < 0) return dopt__fail(DOPT_ERR_INVALID_ARG, "%s: eps=%g must be >= 0", who, hp[EPS]);
  if (!(hp[BETA1] >= 0 && hp[BETA1] < 1))
    return dopt__fail(DOPT_ERR_INVALID_ARG, "%s: beta1=%g must be in [0, 1)", who, hp[BETA1]);
  if (!(hp[BETA2] >= 0 && hp[BETA2] < 1))
    return dopt__fail(DOPT_ERR_INVALID_ARG, "%s: beta2=%g must be in [0, 1)", who, hp[BETA2]);
  if (hp[WD] < 0) return dopt__fail(DOPT_ERR_INVALID_ARG, "%s: weight_decay=%g must be >= 0", who, hp[WD]);
  return DOPT_OK;
}

static dopt_status hf_validate(const double *hp) { return dopt_hf_validate("galore_adamw", hp); }

int dopt_hf_layout(const double *hp, int ndim, const int64_t *shape, dopt_state_spec *out) {
  (void)hp;
  dopt_state_def(&out[0], "exp_avg", ndim, shape, 1);
  dopt_state_def(&out[1], "exp_avg_sq", ndim, shape, 1);
  return 2;
}

float dopt_hf_neg_step(const double *hp, int64_t step) {
  double t = (double)step, step_size = hp[LR];
  if (hp[CORRECT_BIAS] != 0.0) step_size = step_size * sqrt(1.0 - pow(hp[BETA2], t)) / (1.0 - pow(hp[BETA1], t));
  return (float)(-step_size);
}

float dopt_hf_direction(const double *hp, int64_t step, const float *g, void *const *state, float *N, size_t n) {
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
  return dopt_hf_neg_step(hp, step);
}

/* element by element: the same operations as two passes */
dopt_status dopt_hf_step(const dopt_step_args *a) {
  const double *hp = a->hp;
  const float b1 = (float)hp[BETA1], omb1 = (float)(1.0 - hp[BETA1]);
  const float b2 = (float)hp[BETA2], omb2 = (float)(1.0 - hp[BETA2]);
  const float eps = (float)hp[EPS], ns = dopt_hf_neg_step(hp, a->step), neg_decay = (float)(-hp[LR] * hp[WD]);
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
    .layout = dopt_hf_layout,
    .step = dopt_hf_step,
    .distributable = 1,
};

/* ---- galore_adamw ---- */

static dopt_galore_spec spec(const double *hp) {
  (void)hp;
  dopt_galore_spec sp = {"galore_adamw", &hf_adamw, 0, PROJ, DOPT_GP_COUNT, LR, WD, dopt_hf_direction, -1, -1, -1};
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
