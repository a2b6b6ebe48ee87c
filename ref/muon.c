/* Muon as PyPI muon-optimizer 0.1.0 (muon.py: SingleDeviceMuon,
 * SingleDeviceMuonWithAuxAdam; docs/muon.md), fp32 parameters.
 *
 * use_muon=true steps each matrix P [..., h, w] with its gradient G and
 * momentum M (state momentum_buffer, P's shape):
 *   M ← lerp(M, G, 1 − momentum)                    torch's lerp (fused, as its AVX2 kernel)
 *   U ← nesterov ? lerp(G, M, momentum) : M          (upstream writes it into p.grad)
 *   U ← NS(U) per matrix: 4-D [o, i, kh, kw] as [o, i·kh·kw]; otherwise
 *       every leading index of [..., h, w] its own (a 3-D expert stack
 *       [E, out, in] per expert, upstream's batched iteration); the quintic
 *       Newton–Schulz of ns.c, ns_steps times, in bf16 (ns_dtype=fp32: fp32)
 *       (flavor=torch: torch.optim.Muon's addmm form, ns.h)
 *   adjust_lr_fn none (muon-optimizer): U ← U·√max(1, G.size(-2)/G.size(-1))   (in U's arithmetic; the
 *                                     unflattened gradient's last two dims, also for 4-D); with flavor=torch,
 *                                     torch's None: original
 *          original (torch.optim.Muon): lr' = lr·√max(1, A/B), A, B = P's first two dims
 *          match_rms_adamw:             lr' = lr·0.2·√max(A, B)
 *          spectral_unclamped:          lr' = lr·√(A/B)
 *   P ← P·(1 − lr·weight_decay);  P ← P + (−lr')·U  (fused, as torch's add_ with alpha)
 * use_muon=false steps every parameter with upstream's aux Adam (states
 * exp_avg, exp_avg_sq; the step count is the parameter's):
 *   m ← lerp(m, G, 1 − β1);  v ← lerp(v, G², 1 − β2)
 *   U ← (m / (1 − β1^t)) / (√(v / (1 − β2^t)) + eps)
 *   P ← P·(1 − lr·weight_decay);  P ← P + (−lr)·U
 * use_muon=auto (the default; upstream has no default and asserts the key):
 * Muon for every parameter of 2 or more dims, aux Adam for the others.
 * lr none: 0.02 for Muon (flavor=torch: 1e-3), 3e-4 for aux Adam (the
 * upstreams' defaults); beta1, beta2, eps belong to aux Adam, momentum,
 * nesterov, ns_steps, ns_dtype, adjust_lr_fn, flavor, ns_a/b/c and ns_eps
 * to Muon.
 *
 * distributed/: a Muon matrix steps whole on its owner (the iteration needs
 * the whole matrix); aux Adam is elementwise and steps piecewise. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "elem.h"
#include "ns.h"
#include "registry.h"

enum { LR, MOMENTUM, WD, USE_MUON, BETA1, BETA2, EPS, NESTEROV, NS_STEPS, NS_DTYPE, ADJUST_LR, FLAVOR, NS_A, NS_B, NS_C,
       NS_EPS, NHP };
enum { NS_BF16, NS_FP32 };
enum { ADJ_NONE, ADJ_ORIGINAL, ADJ_MATCH_RMS, ADJ_SPECTRAL };
enum { FLAVOR_MUON_OPTIMIZER, FLAVOR_TORCH };
enum { USE_AUTO, USE_TRUE, USE_FALSE };

static const char *const uses[] = {"auto", "true", "false", NULL};
static const char *const ns_dtypes[] = {"bf16", "fp32", NULL};
static const char *const adjusts[] = {"none", "original", "match_rms_adamw", "spectral_unclamped", NULL};
static const char *const flavors[] = {"muon_optimizer", "torch", NULL};

static const dopt_hp_def hps[NHP] = {
    [LR] = {"lr", DOPT_HP_OPT, NAN,
            "learning rate (none: 0.02 in a Muon group, 1e-3 with flavor=torch, 3e-4 in an aux Adam group)", NULL},
    [MOMENTUM] = {"momentum", DOPT_HP_REAL, 0.95, "Muon: momentum (M <- lerp(M, G, 1 - momentum))", NULL},
    [WD] = {"weight_decay", DOPT_HP_REAL, 0.0, "decoupled decay before the update (p *= 1 - lr*wd)", NULL},
    [USE_MUON] = {"use_muon", DOPT_HP_ENUM, USE_AUTO,
                  "true: Muon (a 1-D parameter is refused), false: upstream's aux Adam, auto: Muon for matrices, "
                  "aux Adam for the rest",
                  uses},
    [BETA1] = {"beta1", DOPT_HP_REAL, 0.9, "aux Adam: first-moment decay", NULL},
    [BETA2] = {"beta2", DOPT_HP_REAL, 0.95, "aux Adam: second-moment decay", NULL},
    [EPS] = {"eps", DOPT_HP_REAL, 1e-10, "aux Adam: added to sqrt(v_hat)", NULL},
    [NESTEROV] = {"nesterov", DOPT_HP_BOOL, 1.0, "Muon: orthogonalise lerp(G, M, momentum) (upstream: always)", NULL},
    [NS_STEPS] = {"ns_steps", DOPT_HP_INT, 5.0, "Muon: Newton-Schulz iterations (upstream: 5)", NULL},
    [NS_DTYPE] = {"ns_dtype", DOPT_HP_ENUM, NS_BF16, "Muon: the iteration's arithmetic (upstream: bf16)", ns_dtypes},
    [ADJUST_LR] = {"adjust_lr_fn", DOPT_HP_ENUM, ADJ_NONE,
                   "Muon: none (the flavour's own rule: muon-optimizer's sqrt(max(1, rows/cols)) on the update, "
                   "torch's None = original), original, match_rms_adamw or spectral_unclamped (torch.optim.Muon's, "
                   "on the lr)",
                   adjusts},
    [FLAVOR] = {"flavor", DOPT_HP_ENUM, FLAVOR_MUON_OPTIMIZER,
                "Muon: whose Newton-Schulz arithmetic and defaults: muon_optimizer (0.1.0: separate bf16 ops, "
                "norm + eps) or torch (torch.optim.Muon: addmm, norm clamped at eps, lr 1e-3, adjust_lr_fn None)",
                flavors},
    [NS_A] = {"ns_a", DOPT_HP_REAL, DOPT_NS_A, "Muon: Newton-Schulz coefficient a (torch: ns_coefficients[0])", NULL},
    [NS_B] = {"ns_b", DOPT_HP_REAL, DOPT_NS_B, "Muon: Newton-Schulz coefficient b (torch: ns_coefficients[1])", NULL},
    [NS_C] = {"ns_c", DOPT_HP_REAL, DOPT_NS_C, "Muon: Newton-Schulz coefficient c (torch: ns_coefficients[2])", NULL},
    [NS_EPS] = {"ns_eps", DOPT_HP_REAL, DOPT_NS_EPS,
                "Muon: the Newton-Schulz normalisation's eps (torch.optim.Muon's eps; not aux Adam's eps)", NULL},
};

static int is_int(double v) { return v == floor(v); }

/* lr none: the per-kind defaults (muon-optimizer's 0.02 for Muon, torch.optim.Muon's 1e-3 with flavor=torch,
 * 3e-4 for aux Adam) */
static double lr_of(const double *hp, int muon) {
  if (!isnan(hp[LR])) return hp[LR];
  return !muon ? 3e-4 : (int)hp[FLAVOR] == FLAVOR_TORCH ? 1e-3 : 0.02;
}

static dopt_status validate(const double *hp) {
  if (!isnan(hp[LR]) && hp[LR] < 0) return dopt__fail(DOPT_ERR_INVALID_ARG, "muon: lr=%g must be >= 0", hp[LR]);
  if (!(hp[MOMENTUM] >= 0 && hp[MOMENTUM] < 1))
    return dopt__fail(DOPT_ERR_INVALID_ARG, "muon: momentum=%g must be in [0, 1)", hp[MOMENTUM]);
  if (hp[WD] < 0) return dopt__fail(DOPT_ERR_INVALID_ARG, "muon: weight_decay=%g must be >= 0", hp[WD]);
  if (!(hp[BETA1] >= 0 && hp[BETA1] < 1))
    return dopt__fail(DOPT_ERR_INVALID_ARG, "muon: beta1=%g must be in [0, 1)", hp[BETA1]);
  if (!(hp[BETA2] >= 0 && hp[BETA2] < 1))
    return dopt__fail(DOPT_ERR_INVALID_ARG, "muon: beta2=%g must be in [0, 1)", hp[BETA2]);
  if (hp[EPS] < 0) return dopt__fail(DOPT_ERR_INVALID_ARG, "muon: eps=%g must be >= 0", hp[EPS]);
  if (!(hp[NS_STEPS] >= 0 && hp[NS_STEPS] <= 100 && is_int(hp[NS_STEPS])))
    return dopt__fail(DOPT_ERR_INVALID_ARG, "muon: ns_steps=%g must be an integer in [0, 100]", hp[NS_STEPS]);
  static const char *const coef[] = {"ns_a", "ns_b", "ns_c"};
  for (int k = 0; k < 3; k++)
    if (!isfinite(hp[NS_A + k]) || fabs(hp[NS_A + k]) > 1e4)
      return dopt__fail(DOPT_ERR_INVALID_ARG, "muon: %s=%g must be finite and within [-1e4, 1e4]", coef[k],
                        hp[NS_A + k]);
  if (!(hp[NS_EPS] >= 0 && hp[NS_EPS] <= 1))
    return dopt__fail(DOPT_ERR_INVALID_ARG, "muon: ns_eps=%g must be in [0, 1]", hp[NS_EPS]);
  return DOPT_OK;
}

/* Whether a parameter of ndim dims in this group steps Muon (else aux Adam). use_muon=true with ndim < 2 is
 * Muon too, refused by the step. */
static int is_muon(const double *hp, int ndim) {
  const int use = (int)hp[USE_MUON];
  return use == USE_TRUE || (use == USE_AUTO && ndim >= 2);
}

static int layout(const double *hp, int ndim, const int64_t *shape, dopt_state_spec *out) {
  int n = 0;
  if (is_muon(hp, ndim)) {
    dopt_state_def(&out[n++], "momentum_buffer", ndim, shape, 1);
  } else {
    dopt_state_def(&out[n++], "exp_avg", ndim, shape, 1);
    dopt_state_def(&out[n++], "exp_avg_sq", ndim, shape, 1);
  }
  return n;
}

/* A Muon matrix needs the whole tensor (owner mode in distributed/); aux Adam is elementwise. */
static int whole(const double *hp, int ndim, const int64_t *shape) {
  (void)shape;
  return is_muon(hp, ndim) && ndim >= 2;
}

/* The matrices a Muon parameter is orthogonalised as: count × [h, w]. */
static void matrices(int ndim, const int64_t *shape, size_t *count, size_t *h, size_t *w) {
  if (ndim == 4) { /* a conv filter [o, i, kh, kw] viewed as [o, i·kh·kw] (upstream's later fix: reshaped back) */
    *count = 1, *h = (size_t)shape[0], *w = (size_t)(shape[1] * shape[2] * shape[3]);
    return;
  }
  dopt_split_bhw(ndim, shape, count, h, w);
}

/* The matrices of a 3-D or higher stack (not a conv filter) step on their own: one unit each (a piece of whole
 * matrices steps as those matrices would within the whole tensor; the lr rules read the parameter's shape). */
static int64_t units(const double *hp, int ndim, const int64_t *shape) {
  if (!whole(hp, ndim, shape) || ndim == 4 || ndim < 3) return 1;
  size_t count, h, w;
  matrices(ndim, shape, &count, &h, &w);
  return (int64_t)count;
}

static double cost(const double *hp, int ndim, const int64_t *shape) {
  const size_t numel = dopt_numel(ndim, shape);
  if (!whole(hp, ndim, shape)) return DOPT_COST_PER_ELEMENT * (double)numel; /* aux Adam */
  size_t count, h, w;
  matrices(ndim, shape, &count, &h, &w);
  return (double)count * dopt_ns_cost(h, w, (int)hp[NS_STEPS]) + 8.0 * (double)numel;
}

/* A Muon matrix's two elementwise passes, split over the pool (each element on its own: no bit depends on the
 * split) and, where the CPU has FMA, with fmaf as the instruction rather than libm's call (the same value: a fused
 * multiply-add rounds once either way). MOMENTUM: M ← lerp(M, G, w), U ← nesterov ? lerp(G, M, beta) : M;
 * UPDATE: P ← fmaf(alpha, U, P·decay). */
enum { EW_MOMENTUM, EW_UPDATE };
typedef struct ew_job {
  int kind, nesterov;
  float *m, *u, *p;
  const float *g;
  float w, beta, alpha, decay;
  size_t n;
} ew_job;

static inline __attribute__((always_inline)) void ew_body(const ew_job *e, size_t lo, size_t hi) {
  float *m = e->m, *u = e->u, *p = e->p;
  const float *g = e->g;
  if (e->kind == EW_MOMENTUM) {
    for (size_t i = lo; i < hi; i++) {
      m[i] = dopt_lerp_elem(m[i], g[i], e->w);
      u[i] = e->nesterov ? dopt_lerp_elem(g[i], m[i], e->beta) : m[i];
    }
  } else {
    for (size_t i = lo; i < hi; i++) p[i] = fmaf(e->alpha, u[i], p[i] * e->decay);
  }
}

#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
__attribute__((target("fma"))) static void ew_body_fma(const ew_job *e, size_t lo, size_t hi) { ew_body(e, lo, hi); }
static void ew_range(void *arg, size_t lo, size_t hi) {
  if (__builtin_cpu_supports("fma")) ew_body_fma(arg, lo, hi);
  else ew_body(arg, lo, hi);
}
#else
static void ew_range(void *arg, size_t lo, size_t hi) { ew_body(arg, lo, hi); }
#endif

/* parts of 2^16 elements or more */
static void ew_run(const dopt_par *par, ew_job *e) { dopt__par_ranges(par, e->n, (size_t)1 << 16, ew_range, e); }


/* aux Adam, elementwise on any piece */
static dopt_status adam_step(const dopt_step_args *a) {
  const double *hp = a->hp;
  const double lr = lr_of(hp, 0), t = (double)a->step;
  const float w1 = (float)(1.0 - hp[BETA1]), w2 = (float)(1.0 - hp[BETA2]);
  const float bc1 = (float)(1.0 - pow(hp[BETA1], t)), bc2 = (float)(1.0 - pow(hp[BETA2], t));
  const float eps = (float)hp[EPS], decay = (float)(1.0 - lr * hp[WD]), alpha = (float)(-lr);
  float *p = a->param, *m = a->state[0], *v = a->state[1];
  const float *g = a->grad;
  for (size_t i = 0; i < a->piece->len; i++) {
    m[i] = dopt_lerp_elem(m[i], g[i], w1);
    v[i] = dopt_lerp_elem(v[i], g[i] * g[i], w2);
    const float u = (m[i] / bc1) / (sqrtf(v[i] / bc2) + eps);
    p[i] = fmaf(alpha, u, p[i] * decay);
  }
  return DOPT_OK;
}

/* A stack's matrices: as many at once as the pool has threads, each on one (no bit depends on which), where
 * there are at least as many as threads; else one after another, each splitting its products over the pool. A
 * part stops at its first failure (the matrix is left as it was: dopt_ns_orthogonalize writes it only at its
 * end) and the caller redoes that one and the part's rest itself, so that the error is reported from here. */
typedef struct ns_job {
  float *u;
  size_t count, h, w, parts;
  const dopt_ns_spec *ns;
  size_t stop[DOPT_PAR_MAX]; /* part p's first matrix not done (count: all done) */
} ns_job;

static void ns_task(void *arg, size_t p) {
  ns_job *j = arg;
  j->stop[p] = j->count;
  for (size_t k = p; k < j->count; k += j->parts)
    if (dopt_ns_orthogonalize(j->u + k * j->h * j->w, j->h, j->w, j->ns, NULL) != DOPT_OK) {
      j->stop[p] = k;
      return;
    }
}

static dopt_status orthogonalize_all(float *u, size_t count, size_t h, size_t w, const dopt_ns_spec *ns,
                                     const dopt_par *par) {
  const size_t parts = dopt__par_parts(par);
  if (parts > 1 && count >= parts) {
    ns_job j = {u, count, h, w, parts, ns, {0}};
    par->run(par->ctx, parts, ns_task, &j);
    for (size_t p = 0; p < parts; p++)
      for (size_t k = j.stop[p]; k < count; k += parts) DOPT_TRY(dopt_ns_orthogonalize(u + k * h * w, h, w, ns, NULL));
    return DOPT_OK;
  }
  for (size_t k = 0; k < count; k++) DOPT_TRY(dopt_ns_orthogonalize(u + k * h * w, h, w, ns, par));
  return DOPT_OK;
}

static dopt_status muon_step(const dopt_step_args *a, int ndim, const int64_t *shape) {
  const double *hp = a->hp;
  const dopt_piece *pc = a->piece;
  const size_t n = pc->len;
  size_t count, h, wd;
  matrices(ndim, shape, &count, &h, &wd);
  /* the whole tensor, or (a stack: units) a piece of whole matrices */
  const size_t mat = h * wd;
  if (n != pc->numel && (units(hp, ndim, shape) == 1 || mat == 0 || pc->lo % mat != 0 || n % mat != 0))
    return dopt__fail(DOPT_ERR_UNSUPPORTED,
                      "muon: a Muon matrix needs whole matrices of %zu elements (got [%zu, +%zu) of %zu elements)", mat,
                      pc->lo, n, pc->numel);
  count = mat ? n / mat : 0;
  const int bf16 = (int)hp[NS_DTYPE] == NS_BF16, torch = (int)hp[FLAVOR] == FLAVOR_TORCH;
  const dopt_ns_spec ns = {(int)hp[NS_STEPS], bf16, torch ? DOPT_NS_ADDMM : DOPT_NS_SEPARATE,
                           hp[NS_A],          hp[NS_B], hp[NS_C], hp[NS_EPS]};
  float *p = a->param, *m = a->state[0];
  const float *g = a->grad;
  float *u = malloc((n ? n : 1) * sizeof *u);
  if (!u) return dopt__fail(DOPT_ERR_NO_MEMORY, "muon: the update of a %zu-element matrix", n);
  ew_job mom = {EW_MOMENTUM, hp[NESTEROV] != 0.0, m, u, NULL, g, (float)(1.0 - hp[MOMENTUM]), (float)hp[MOMENTUM],
                0.0f, 0.0f, n};
  ew_run(a->par, &mom);
  dopt_status s = orthogonalize_all(u, count, h, wd, &ns, a->par);
  dopt_count(a, DOPT_COUNTER_NS, (int64_t)count);
  dopt_count(a, DOPT_COUNTER_NS_ITERATIONS, (int64_t)count * (int64_t)hp[NS_STEPS]);
  if (s != DOPT_OK) {
    free(u);
    return s;
  }
  /* the scale: muon-optimizer's on the update, from the unflattened gradient's last two dims; torch.optim.Muon's
   * on the lr, from the parameter's first two (its None: original) */
  const double lr = lr_of(hp, 1), d0 = (double)shape[0], d1 = (double)shape[1];
  const double rows = (double)shape[ndim - 2], cols = (double)shape[ndim - 1];
  int rule = (int)hp[ADJUST_LR];
  if (rule == ADJ_NONE && torch) rule = ADJ_ORIGINAL;
  double lr_adj = lr;
  if (rule == ADJ_NONE) {
    const double sc = sqrt(rows / cols > 1.0 ? rows / cols : 1.0);
    const float f = bf16 ? dopt_round_bf16((float)sc) : (float)sc; /* a Python scalar factor on the update */
    for (size_t i = 0; i < n; i++) u[i] = bf16 ? dopt_round_bf16(u[i] * f) : u[i] * f;
  } else if (rule == ADJ_ORIGINAL) {
    lr_adj = lr * sqrt(d0 / d1 > 1.0 ? d0 / d1 : 1.0);
  } else if (rule == ADJ_MATCH_RMS) {
    lr_adj = lr * 0.2 * sqrt(d0 > d1 ? d0 : d1);
  } else {
    lr_adj = lr * sqrt(d0 / d1);
  }
  const float decay = (float)(1.0 - lr * hp[WD]), alpha = (float)(-lr_adj);
  ew_job upd = {EW_UPDATE, 0, NULL, u, p, NULL, 0.0f, 0.0f, alpha, decay, n};
  ew_run(a->par, &upd);
  free(u);
  return DOPT_OK;
}

static dopt_status step(const dopt_step_args *a) {
  const dopt_piece *pc = a->piece;
  /* the parameter's logical shape (a conv filter's 4 dims matter), or the piece's view */
  int64_t view[3];
  int ndim;
  const int64_t *shape = dopt_step_shape(a, view, &ndim);
  if (!is_muon(a->hp, ndim)) {
    dopt_count(a, DOPT_COUNTER_AUX_ADAM, 1);
    return adam_step(a);
  }
  if (ndim < 2)
    return dopt__fail(DOPT_ERR_SHAPE,
                      "muon: a %d-D parameter of %zu elements cannot be orthogonalised (use_muon=true); put it in a "
                      "use_muon=false group (aux Adam) or leave use_muon=auto",
                      ndim, pc->numel);
  return muon_step(a, ndim, shape);
}

/* GaLore around Muon (galore(inner=muon)): the full weight decays as Muon decays its parameter, before the
 * update, by lr·weight_decay with the lr its low-rank matrix steps with (lr none: Muon's 0.02, or aux Adam's
 * 3e-4 in a use_muon=false group); the wrapper's default, −lr·weight_decay from the key, would be NaN there. */
static int lowrank_decay(const double *hp, int64_t step, void *const *state, float *factor) {
  (void)step, (void)state;
  const double lr = lr_of(hp, is_muon(hp, 2));
  *factor = hp[WD] != 0.0 ? (float)(-(lr * hp[WD])) : 0.0f;
  return 1;
}

/* settings that exercise every path (dopt_optim_impl.example/grid): Muon in bf16 with weight decay on every
 * matrix (3-D ones per batch index), aux Adam on the rest (use_muon=auto); fp32 iteration without Nesterov;
 * torch.optim.Muon's lr rule */
static const char *const grid[] = {
    "lr=2e-2,weight_decay=0.01",
    "lr=2e-2,ns_dtype=fp32,nesterov=false,ns_steps=3",
    "lr=2e-2,adjust_lr_fn=match_rms_adamw,momentum=0.9,beta1=0.8",
    "flavor=torch,weight_decay=0.1,ns_a=3.0,ns_b=-3.2,ns_c=1.2,ns_eps=1e-6",
    NULL,
};

const dopt_optim_impl dopt_impl_muon = {
    .name = "muon",
    .summary = "Muon as muon-optimizer 0.1.0 (momentum orthogonalised by Newton-Schulz in bf16; aux Adam groups)",
    .hp = hps,
    .nhp = NHP,
    .validate = validate,
    .layout = layout,
    .step = step,
    .distributable = 0,
    .whole = whole,
    .cost = cost,
    .units = units,
    .lowrank_decay = lowrank_decay,
    .example = NULL,
    .grid = grid,
};
