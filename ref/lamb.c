/* LAMB as ColossalAI's colossalai.nn.optimizer.Lamb (fp32):
 *   m ← β1·m + (1−β1)·g;  v ← β2·v + ((1−β2)·g)·g      (moments not debiased)
 *   lr' = bias_correction ? lr·√(1−β2^t)/(1−β1^t) : lr  (an lr factor, outside the ratio)
 *   u   = m/(√v + eps) + wd·p
 *   trust = ‖p‖/‖u‖ (no clamp), 1 if either norm is 0; adam=true forces 1
 *   p ← p + (−lr'·trust)·u
 * Norms are exact sums of squares (xsum), so they are partition-independent.
 * State: exp_avg, exp_avg_sq [param shape]. */
#include <math.h>

#include "elem.h"
#include "registry.h"

enum { LR, BETA1, BETA2, EPS, WD, ADAM, BIASCORR, NHP };

static const dopt_hp_def hps[NHP] = {
    [LR] = {"lr", DOPT_HP_REAL, 1e-3, "learning rate"},
    [BETA1] = {"beta1", DOPT_HP_REAL, 0.9, "first-moment decay"},
    [BETA2] = {"beta2", DOPT_HP_REAL, 0.999, "second-moment decay"},
    [EPS] = {"eps", DOPT_HP_REAL, 1e-6, "added to sqrt(v)"},
    [WD] = {"weight_decay", DOPT_HP_REAL, 0.0, "decay added to the update inside the trust ratio"},
    [ADAM] = {"adam", DOPT_HP_BOOL, 0.0, "trust ratio 1 (Adam with decoupled decay)"},
    [BIASCORR] = {"bias_correction", DOPT_HP_BOOL, 0.0, "lr * sqrt(1-beta2^t)/(1-beta1^t)"},
};

static dopt_status validate(const double *hp) {
  if (hp[LR] < 0) return dopt__fail(DOPT_ERR_INVALID_ARG, "lamb: lr=%g must be >= 0", hp[LR]);
  if (hp[EPS] < 0) return dopt__fail(DOPT_ERR_INVALID_ARG, "lamb: eps=%g must be >= 0", hp[EPS]);
  if (!(hp[BETA1] >= 0 && hp[BETA1] < 1))
    return dopt__fail(DOPT_ERR_INVALID_ARG, "lamb: beta1=%g must be in [0, 1)", hp[BETA1]);
  if (!(hp[BETA2] >= 0 && hp[BETA2] < 1))
    return dopt__fail(DOPT_ERR_INVALID_ARG, "lamb: beta2=%g must be in [0, 1)", hp[BETA2]);
  if (hp[WD] < 0) return dopt__fail(DOPT_ERR_INVALID_ARG, "lamb: weight_decay=%g must be >= 0", hp[WD]);
  return DOPT_OK;
}

static int layout(const double *hp, int ndim, const int64_t *shape, dopt_state_spec *out) {
  (void)hp;
  dopt_state_def(&out[0], "exp_avg", ndim, shape, 1);
  dopt_state_def(&out[1], "exp_avg_sq", ndim, shape, 1);
  return 2;
}

/* Stages: S0 moments, u, and the maxima of ‖p‖², ‖u‖² (MAX); S1 their words
 * (SUM); S2 the trust ratio and the update. */
static dopt_status step(const dopt_step_args *a) {
  const double *hp = a->hp;
  const size_t n = a->piece->len;
  const float *g = a->grad;
  float *w = a->param, *m = a->state[0], *v = a->state[1];
  dopt_update_frame f;
  dopt_update_frame_map(a->frame, a->piece, 0, &f);
  float *u = f.u;
  if (a->stage == 0) {
    const dopt_lamb_q q = dopt_lamb_scalars(hp[BETA1], hp[BETA2], hp[EPS], hp[WD]);
    /* tiles of 4096: the maxima of |p| and |u| (for ‖p‖, ‖u‖ over the
     * logical tensor) are taken while the tile is in cache */
    float wm = 0.0f, um = 0.0f;
    for (size_t t0 = 0; t0 < n; t0 += 4096) {
      const size_t t1 = n - t0 < 4096 ? n : t0 + 4096;
      for (size_t i = t0; i < t1; i++) u[i] = dopt_lamb_dir(&q, w[i], g[i], &m[i], &v[i]); /* core/elem.h */
      if (!a->wstat) wm = dopt_absmax_tile(wm, w + t0, t1 - t0);
      um = dopt_absmax_tile(um, u + t0, t1 - t0);
    }
    if (a->wstat) wm = dopt_absmax_tile(0.0f, a->wstat, a->wstat_len); /* ‖w‖ of a projection wrapper's full weight */
    *a->more = 1;
    DOPT_TRY(dopt_ss_begin_absmax(f.pss, wm, a->red));
    return dopt_ss_begin_absmax(f.uss, um, a->red);
  }
  if (a->stage == 1) {
    *a->more = 1;
    const float *ws;
    size_t nw, Nw;
    dopt_wstat(a, &ws, &nw, &Nw);
    DOPT_TRY(dopt_ss_accum(f.pss, ws, nw, a->red));
    return dopt_ss_accum(f.uss, u, n, a->red);
  }
  const float alpha = dopt_lamb_alpha(hp[LR], hp[BETA1], hp[BETA2], hp[BIASCORR] != 0.0, hp[ADAM] != 0.0, a->step,
                                      dopt_ss_value(f.pss), dopt_ss_value(f.uss));
  for (size_t i = 0; i < n; i++) w[i] = dopt_axpy_elem(w[i], alpha, u[i]);
  return DOPT_OK;
}

/* settings that exercise every path (dopt_optim_impl.example/grid) */
static const char *const grid[] = {
    "lr=1e-2,bias_correction=true,weight_decay=0.01",
    "lr=1e-2",
    "lr=1e-2,adam=true,weight_decay=0.01",
    NULL,
};

const dopt_optim_impl dopt_impl_lamb = {
    .name = "lamb",
    .summary = "LAMB as ColossalAI's Lamb (bias correction as an lr factor, optional adam mode)",
    .hp = hps,
    .nhp = NHP,
    .validate = validate,
    .layout = layout,
    .frame = dopt_update_frame_norms,
    .step = step,
    .distributable = 1,
    .grid = grid,
};
