/* AdamW as torch.optim.AdamW (single-tensor path, fp32), in torch's order of
 * operations so results agree to the last few ulps:
 *   p ← p·(1 − lr·wd)                          (decay before the moments)
 *   m ← m·β1 + (1−β1)·g
 *   v ← v·β2 + ((1−β2)·g)·g
 *   v̂max ← max(v̂max, v)                       (amsgrad)
 *   p ← p + (−lr/bc1 · m) / (√v / √bc2 + ε)     bc_i = 1 − β_i^t (host, double)
 * State: exp_avg, exp_avg_sq [param shape], max_exp_avg_sq with amsgrad. */
#include <math.h>

#include "elem.h"
#include "registry.h"

enum { LR, BETA1, BETA2, EPS, WD, AMSGRAD, NHP };

static const dopt_hp_def hps[NHP] = {
    [LR] = {"lr", DOPT_HP_REAL, 1e-3, "learning rate"},
    [BETA1] = {"beta1", DOPT_HP_REAL, 0.9, "first-moment decay"},
    [BETA2] = {"beta2", DOPT_HP_REAL, 0.999, "second-moment decay"},
    [EPS] = {"eps", DOPT_HP_REAL, 1e-8, "added to sqrt(v_hat)"},
    [WD] = {"weight_decay", DOPT_HP_REAL, 1e-2, "decoupled weight decay (p *= 1 - lr*wd)"},
    [AMSGRAD] = {"amsgrad", DOPT_HP_BOOL, 0.0, "use the running max of v"},
};

static dopt_status validate(const double *hp) {
  if (hp[LR] < 0) return dopt__fail(DOPT_ERR_INVALID_ARG, "adamw: lr=%g must be >= 0", hp[LR]);
  if (hp[EPS] < 0) return dopt__fail(DOPT_ERR_INVALID_ARG, "adamw: eps=%g must be >= 0", hp[EPS]);
  if (!(hp[BETA1] >= 0 && hp[BETA1] < 1))
    return dopt__fail(DOPT_ERR_INVALID_ARG, "adamw: beta1=%g must be in [0, 1)", hp[BETA1]);
  if (!(hp[BETA2] >= 0 && hp[BETA2] < 1))
    return dopt__fail(DOPT_ERR_INVALID_ARG, "adamw: beta2=%g must be in [0, 1)", hp[BETA2]);
  if (hp[WD] < 0) return dopt__fail(DOPT_ERR_INVALID_ARG, "adamw: weight_decay=%g must be >= 0", hp[WD]);
  return DOPT_OK;
}

static int layout(const double *hp, int ndim, const int64_t *shape, dopt_state_spec *out) {
  int n = 0;
  dopt_state_def(&out[n++], "exp_avg", ndim, shape, 1);
  dopt_state_def(&out[n++], "exp_avg_sq", ndim, shape, 1);
  if (hp[AMSGRAD] != 0.0) dopt_state_def(&out[n++], "max_exp_avg_sq", ndim, shape, 1);
  return n;
}

/* The element loop, compiled also for AVX2 and AVX-512 and picked per call by the CPU's features: the same IEEE
 * operations on wider vectors, each element's bits unchanged (no contraction: -ffp-contract=off). (Not GCC's
 * target_clones: its load-time resolver runs before ThreadSanitizer's runtime and crashes it.) */
static inline __attribute__((always_inline)) void adamw_body(const dopt_adamw_q *q, size_t n, float *w,
                                                             const float *g, float *m, float *v, float *vmax) {
  if (vmax)
    for (size_t i = 0; i < n; i++) dopt_adamw_elem(q, &w[i], g[i], &m[i], &v[i], &vmax[i]);
  else
    for (size_t i = 0; i < n; i++) dopt_adamw_elem(q, &w[i], g[i], &m[i], &v[i], NULL);
}

#if defined(__GNUC__) && defined(__x86_64__)
__attribute__((target("avx512f"))) static void adamw_avx512(const dopt_adamw_q *q, size_t n, float *w,
                                                            const float *g, float *m, float *v, float *vmax) {
  adamw_body(q, n, w, g, m, v, vmax);
}
__attribute__((target("avx2"))) static void adamw_avx2(const dopt_adamw_q *q, size_t n, float *w, const float *g,
                                                       float *m, float *v, float *vmax) {
  adamw_body(q, n, w, g, m, v, vmax);
}
#endif

static void adamw_loop(const dopt_adamw_q *q, size_t n, float *w, const float *g, float *m, float *v,
                       float *vmax) {
#if defined(__GNUC__) && defined(__x86_64__)
  if (__builtin_cpu_supports("avx512f")) {
    adamw_avx512(q, n, w, g, m, v, vmax);
    return;
  }
  if (__builtin_cpu_supports("avx2")) {
    adamw_avx2(q, n, w, g, m, v, vmax);
    return;
  }
#endif
  adamw_body(q, n, w, g, m, v, vmax);
}

static dopt_status step(const dopt_step_args *a) {
  const double *hp = a->hp;
  const float *g = a->grad;
  float *w = a->param, *m = a->state[0], *v = a->state[1];
  float *vmax = hp[AMSGRAD] != 0.0 ? a->state[2] : NULL;
  /* step-dependent scalars: once, on the host, in double (as torch); the element update is core/elem.h's,
   * the CUDA kernel's too */
  const dopt_adamw_q q = dopt_adamw_scalars(hp[LR], hp[BETA1], hp[BETA2], hp[EPS], hp[WD], a->step);
  const size_t n = a->piece->len;
  adamw_loop(&q, n, w, g, m, v, vmax);
  return DOPT_OK;
}

/* settings that exercise every path (dopt_optim_impl.example/grid) */
static const char *const grid[] = {
    "lr=1e-2,weight_decay=0.01",
    "lr=1e-2,amsgrad=true,weight_decay=0",
    NULL,
};

const dopt_optim_impl dopt_impl_adamw = {
    .name = "adamw",
    .summary = "AdamW as torch.optim.AdamW (decoupled decay before the moments, eps on sqrt(v_hat))",
    .hp = hps,
    .nhp = NHP,
    .validate = validate,
    .layout = layout,
    .step = step,
    .distributable = 1,
    .pointwise = 1,
    .grid = grid,
};
