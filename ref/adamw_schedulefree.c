/* Schedule-Free AdamW as schedulefree 1.4.1's AdamWScheduleFree (Defazio et al. 2024), fp32.
 *
 * The parameter holds y (train mode), the point gradients are taken at; z is the base sequence, x (the
 * average, what eval mode puts in the parameter) is never stored: y = (1 − β1)·z + β1·x. Per step t of a
 * parameter (upstream's group clock k = t − 1; scalars in double as Python computes them):
 *   sched  = t ≤ warmup_steps ? t / warmup_steps : 1          lr_t = lr·sched
 *   lr_max = max(lr_t, lr_max)     (lr_max starts at −1)
 *   w      = t^r · lr_max^weight_lr_power,   weight_sum += w,   c = w / weight_sum   (0 if weight_sum = 0)
 *   at t = 1: z ← P (upstream clones the parameter at its first step)
 *   v ← β2·v + (1 − β2)·G⊙G;  ĝ = G / (√(v / (1 − β2^t)) + eps);  ĝ += wd·y   (wd ≠ 0)
 *   y ← lerp(y, z, c);  y ← y + lr_t·(β1·(1 − c) − 1)·ĝ;  z ← z − lr_t·ĝ
 * Train/eval (the swap hook): eval y ← lerp(y, z, 1 − 1/β1) (= x), train x ← lerp(x, z, 1 − β1) (= y), for a
 * parameter that has stepped (upstream: one whose state has z). torch's CPU lerp and add/sub(alpha=) are fused
 * multiply-adds: fmaf at those places, as torch does. weight_sum and lr_max are upstream's group values, kept
 * per parameter in double (a parameter stepped at every step of its group has the group's values). */
#include <math.h>

#include "elem.h"
#include "registry.h"

enum { LR, BETA1, BETA2, EPS, WD, WARMUP, R, WLP, NHP };

static const dopt_hp_def hps[NHP] = {
    [LR] = {"lr", DOPT_HP_REAL, 0.0025, "learning rate (after warm-up)"},
    [BETA1] = {"beta1", DOPT_HP_REAL, 0.9, "interpolation of y between z and the average x (betas[0])"},
    [BETA2] = {"beta2", DOPT_HP_REAL, 0.999, "second-moment decay (betas[1])"},
    [EPS] = {"eps", DOPT_HP_REAL, 1e-8, "added to the bias-corrected sqrt(v)"},
    [WD] = {"weight_decay", DOPT_HP_REAL, 0.0, "wd*y added to the normalised gradient"},
    [WARMUP] = {"warmup_steps", DOPT_HP_INT, 0.0, "linear warm-up of lr over this many steps"},
    [R] = {"r", DOPT_HP_REAL, 0.0, "polynomial weighting t^r of the average"},
    [WLP] = {"weight_lr_power", DOPT_HP_REAL, 2.0, "the average's weights are lr_max^weight_lr_power"},
};

static dopt_status validate(const double *hp) {
  /* upstream checks nothing; these are the values its step and train/eval survive */
  if (!(hp[LR] >= 0)) return dopt__fail(DOPT_ERR_INVALID_ARG, "adamw_schedulefree: lr=%g must be >= 0", hp[LR]);
  if (!(hp[BETA1] > 0 && hp[BETA1] < 1))
    return dopt__fail(DOPT_ERR_INVALID_ARG, "adamw_schedulefree: beta1=%g must be in (0, 1) (eval divides by it)",
                      hp[BETA1]);
  if (!(hp[BETA2] >= 0 && hp[BETA2] < 1))
    return dopt__fail(DOPT_ERR_INVALID_ARG, "adamw_schedulefree: beta2=%g must be in [0, 1)", hp[BETA2]);
  if (!(hp[EPS] >= 0)) return dopt__fail(DOPT_ERR_INVALID_ARG, "adamw_schedulefree: eps=%g must be >= 0", hp[EPS]);
  if (!isfinite(hp[WD])) return dopt__fail(DOPT_ERR_INVALID_ARG, "adamw_schedulefree: weight_decay=%g", hp[WD]);
  if (!(hp[WARMUP] >= 0 && hp[WARMUP] <= 1e15))
    return dopt__fail(DOPT_ERR_INVALID_ARG, "adamw_schedulefree: warmup_steps=%g must be in [0, 1e15]", hp[WARMUP]);
  if (!isfinite(hp[R]) || !isfinite(hp[WLP]))
    return dopt__fail(DOPT_ERR_INVALID_ARG, "adamw_schedulefree: r=%g and weight_lr_power=%g must be finite", hp[R],
                      hp[WLP]);
  return DOPT_OK;
}

enum { S_Z, S_V, S_WSUM, S_LRMAX };
static int layout(const double *hp, int ndim, const int64_t *shape, dopt_state_spec *out) {
  (void)hp;
  dopt_state_def(&out[S_Z], "z", ndim, shape, 1);
  dopt_state_def(&out[S_V], "exp_avg_sq", ndim, shape, 1);
  dopt_state_def_dtype(&out[S_WSUM], "weight_sum", DOPT_F64, 0, shape, 0);
  dopt_state_def_dtype(&out[S_LRMAX], "lr_max", DOPT_F64, 0, shape, 0);
  return 4;
}

static dopt_status step(const dopt_step_args *a) {
  const double *hp = a->hp;
  const size_t n = a->piece->len;
  float *y = a->param, *z = a->state[S_Z], *v = a->state[S_V];
  double *wsum = a->state[S_WSUM], *lrmax = a->state[S_LRMAX];
  const float *g = a->grad;
  const double t = (double)a->step, k = t - 1.0;
  const double sched = k < hp[WARMUP] ? t / hp[WARMUP] : 1.0;
  const double bc2 = 1.0 - pow(hp[BETA2], t);
  const double lr = hp[LR] * sched;
  const double prev_max = a->step == 1 ? -1.0 : *lrmax;
  const double lr_max = prev_max > lr ? prev_max : lr; /* Python's max(lr, lr_max) */
  const double weight = pow(t, hp[R]) * pow(lr_max, hp[WLP]);
  const double weight_sum = (a->step == 1 ? 0.0 : *wsum) + weight;
  const double ckp1 = weight_sum != 0.0 ? weight / weight_sum : 0.0;
  *lrmax = lr_max, *wsum = weight_sum;
  const float b2 = (float)hp[BETA2], c2 = (float)(1.0 - hp[BETA2]), bc2f = (float)bc2, eps = (float)hp[EPS];
  const float wd = (float)hp[WD], c = (float)ckp1, ay = (float)(lr * (hp[BETA1] * (1.0 - ckp1) - 1.0));
  const float az = (float)-lr;
  const int use_wd = hp[WD] != 0.0;
  if (a->step == 1)
    for (size_t i = 0; i < n; i++) z[i] = y[i];
  for (size_t i = 0; i < n; i++) {
    v[i] = v[i] * b2 + (c2 * g[i]) * g[i]; /* mul_(beta2).addcmul_(g, g, value=1 - beta2) */
    float gn = g[i] / (sqrtf(v[i] / bc2f) + eps);
    if (use_wd) gn = fmaf(y[i], wd, gn); /* add_(y, alpha=wd) */
    const float yl = dopt_lerp_elem(y[i], z[i], c);
    y[i] = fmaf(gn, ay, yl);
    z[i] = fmaf(gn, az, z[i]); /* sub_(ĝ, alpha=lr) */
  }
  return DOPT_OK;
}

/* train ↔ eval on a piece of a parameter that has stepped */
static void swap(const double *hp, int to_eval, int64_t step, size_t n, float *param, void *const *state) {
  if (step < 1) return;
  const float *z = state[S_Z];
  const float w = (float)(to_eval ? 1.0 - 1.0 / hp[BETA1] : 1.0 - hp[BETA1]);
  for (size_t i = 0; i < n; i++) param[i] = dopt_lerp_elem(param[i], z[i], w);
}

/* settings that reach every path: decay with a warm-up and polynomial weights; plain defaults at a larger lr */
static const char *const grid[] = {
    "lr=1e-2,weight_decay=0.05,warmup_steps=5,r=0.5",
    "lr=3e-2,beta1=0.5",
    NULL,
};

const dopt_optim_impl dopt_impl_adamw_schedulefree = {
    .name = "adamw_schedulefree",
    .summary = "Schedule-Free AdamW as schedulefree's AdamWScheduleFree (y in the parameter, z state; train/eval)",
    .hp = hps,
    .nhp = NHP,
    .validate = validate,
    .layout = layout,
    .step = step,
    .distributable = 1,
    .swap = swap,
    .grid = grid,
};
