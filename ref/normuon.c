/* NorMuon as pytorch-optimizer 4.1.0's NorMuon (arXiv 2510.05491; its reference code, microsoft/dion, is not on
 * PyPI): Muon whose orthogonalised update is normalised per neuron (row) by a second moment, fp32 parameters.
 *
 * use_muon=true steps a parameter P (shape [d0, ...]) with its gradient G, momentum M (momentum_buffer, P's
 * shape) and a per-row second moment V (second_momentum_buffer [d0, 1]):
 *   P ← P·(1 − lr·wd)                 (weight_decouple; else G ← G + wd·P)
 *   M ← lerp(M, G, 1 − momentum);  U ← nesterov ? lerp(G, M, momentum) : M
 *   U ← NS(U as [d0, numel/d0])       torch.optim.Muon's addmm form (ns.h DOPT_NS_ADDMM), ns_steps, in bf16
 *                                     (ns_dtype=fp32: fp32), then fp32
 *   n₀ = ‖U‖;  V ← lerp(V, mean_row(U²), 1 − beta2);  U ← U / (√V + eps)
 *   preserve_norm: U ← U·(n₀ / (‖U‖ + eps)), lr' = lr·√max(1, d0/(numel/d0))   (use_adjusted_lr:
 *                  lr·0.2·√max(d0, numel/d0))
 *   match_rms:     U ← U·(0.2·√numel / (‖U‖ + eps)), lr' = lr
 *   P ← P + (−lr')·U                   (torch's add_ with alpha: one fused multiply-add)
 * use_muon=false (upstream's AdamW groups; exp_avg, exp_avg_sq):
 *   m ← lerp(m, G, 1 − β1);  v ← lerp(v, G², 1 − β2);  P ← P + (−lr/bc1)·m / (√v / √bc2 + eps)
 * use_muon=auto: NorMuon for parameters of 2 or more dims, AdamW for the rest (upstream requires the key).
 * lr none: 2e-2 for NorMuon, 3e-4 (adamw_lr) for AdamW. The step count is the parameter's (upstream: the
 * group's, the same while every parameter of a group has a gradient at every step). Norms and row sums are
 * exact sums; a NorMuon matrix steps whole on its owner in distributed/ (the iteration needs all of it). */
#include <math.h>
#include <stdlib.h>

#include "elem.h"
#include "ns.h"
#include "registry.h"

enum { LR, MOMENTUM, BETA1, BETA2, WD, EPS, USE_MUON, NESTEROV, NS_STEPS, NS_DTYPE, NS_A, NS_B, NS_C, SCALE,
       ADJUSTED, DECOUPLE, NHP };
enum { USE_AUTO, USE_TRUE, USE_FALSE };
enum { NS_BF16, NS_FP32 };
enum { PRESERVE_NORM, MATCH_RMS };
static const char *const uses[] = {"auto", "true", "false", NULL};
static const char *const ns_dtypes[] = {"bf16", "fp32", NULL};
static const char *const scales[] = {"preserve_norm", "match_rms", NULL};

static const dopt_hp_def hps[NHP] = {
    [LR] = {"lr", DOPT_HP_OPT, NAN, "learning rate (none: 2e-2 for NorMuon, 3e-4 (adamw_lr) for AdamW groups)"},
    [MOMENTUM] = {"momentum", DOPT_HP_REAL, 0.95, "NorMuon: momentum (M <- lerp(M, G, 1 - momentum))"},
    [BETA1] = {"beta1", DOPT_HP_REAL, 0.9, "AdamW groups: first-moment decay (adamw_betas[0])"},
    [BETA2] = {"beta2", DOPT_HP_REAL, 0.95,
               "NorMuon: decay of the rows' second moment; AdamW groups: second-moment decay (adamw_betas[1])"},
    [WD] = {"weight_decay", DOPT_HP_REAL, 0.0, "weight decay (decoupled: p *= 1 - lr*wd)"},
    [EPS] = {"eps", DOPT_HP_REAL, 1e-10, "NorMuon: added to sqrt(V) and to the norm; AdamW groups: to sqrt(v_hat)"},
    [USE_MUON] = {"use_muon", DOPT_HP_ENUM, USE_AUTO,
                  "true: NorMuon (a 1-D parameter is refused), false: AdamW, auto: NorMuon for matrices", uses},
    [NESTEROV] = {"nesterov", DOPT_HP_BOOL, 1.0, "NorMuon: orthogonalise lerp(G, M, momentum)"},
    [NS_STEPS] = {"ns_steps", DOPT_HP_INT, 5.0, "NorMuon: Newton-Schulz iterations"},
    [NS_DTYPE] = {"ns_dtype", DOPT_HP_ENUM, NS_BF16, "NorMuon: the iteration's arithmetic (upstream: bf16)", ns_dtypes},
    [NS_A] = {"ns_a", DOPT_HP_REAL, DOPT_NS_A, "NorMuon: Newton-Schulz coefficient a (ns_coeffs[0]; 'original')"},
    [NS_B] = {"ns_b", DOPT_HP_REAL, DOPT_NS_B, "NorMuon: Newton-Schulz coefficient b (ns_coeffs[1])"},
    [NS_C] = {"ns_c", DOPT_HP_REAL, DOPT_NS_C, "NorMuon: Newton-Schulz coefficient c (ns_coeffs[2])"},
    [SCALE] = {"update_scale", DOPT_HP_ENUM, PRESERVE_NORM,
               "NorMuon: preserve_norm (the orthogonalised update's norm, the shape's lr rule) or match_rms (RMS 0.2)",
               scales},
    [ADJUSTED] = {"use_adjusted_lr", DOPT_HP_BOOL, 0.0,
                  "NorMuon, preserve_norm: lr*0.2*sqrt(max(d0, rest)) instead of lr*sqrt(max(1, d0/rest))"},
    [DECOUPLE] = {"weight_decouple", DOPT_HP_BOOL, 1.0, "decoupled decay (false: G += wd*P)"},
};

static double lr_of(const double *hp, int muon) { return !isnan(hp[LR]) ? hp[LR] : muon ? 2e-2 : 3e-4; }

static dopt_status validate(const double *hp) {
  if (!isnan(hp[LR]) && !(hp[LR] >= 0)) return dopt__fail(DOPT_ERR_INVALID_ARG, "normuon: lr=%g must be >= 0", hp[LR]);
  for (int k = MOMENTUM; k <= BETA2; k++)
    if (!(hp[k] >= 0 && hp[k] < 1))
      return dopt__fail(DOPT_ERR_INVALID_ARG, "normuon: %s=%g must be in [0, 1)", hps[k].key, hp[k]);
  if (!(hp[WD] >= 0)) return dopt__fail(DOPT_ERR_INVALID_ARG, "normuon: weight_decay=%g must be >= 0", hp[WD]);
  if (!(hp[EPS] >= 0)) return dopt__fail(DOPT_ERR_INVALID_ARG, "normuon: eps=%g must be >= 0", hp[EPS]);
  if (!(hp[NS_STEPS] >= 1 && hp[NS_STEPS] <= 100))
    return dopt__fail(DOPT_ERR_INVALID_ARG, "normuon: ns_steps=%g must be in [1, 100]", hp[NS_STEPS]);
  for (int k = NS_A; k <= NS_C; k++)
    if (!isfinite(hp[k]) || fabs(hp[k]) > 1e4)
      return dopt__fail(DOPT_ERR_INVALID_ARG, "normuon: %s=%g must be finite and within [-1e4, 1e4]", hps[k].key, hp[k]);
  return DOPT_OK;
}

static int is_muon(const double *hp, int ndim) {
  const int use = (int)hp[USE_MUON];
  return use == USE_TRUE || (use == USE_AUTO && ndim >= 2);
}

static int layout(const double *hp, int ndim, const int64_t *shape, dopt_state_spec *out) {
  if (!is_muon(hp, ndim)) {
    dopt_state_def(&out[0], "exp_avg", ndim, shape, 1);
    dopt_state_def(&out[1], "exp_avg_sq", ndim, shape, 1);
    return 2;
  }
  dopt_state_def(&out[0], "momentum_buffer", ndim, shape, 1);
  const int64_t vs[2] = {ndim >= 1 ? shape[0] : 1, 1};
  dopt_state_def(&out[1], "second_momentum_buffer", 2, vs, 0);
  return 2;
}

/* A NorMuon matrix needs the whole tensor (owner mode in distributed/); AdamW is elementwise. */
static int whole(const double *hp, int ndim, const int64_t *shape) {
  (void)shape;
  return is_muon(hp, ndim) && ndim >= 2;
}

static double cost(const double *hp, int ndim, const int64_t *shape) {
  const size_t numel = dopt_numel(ndim, shape);
  if (!whole(hp, ndim, shape)) return DOPT_COST_PER_ELEMENT * (double)numel;
  const size_t h = (size_t)shape[0], w = h ? numel / h : 0;
  return dopt_ns_cost(h, w, (int)hp[NS_STEPS]) + 12.0 * (double)numel;
}

/* upstream's AdamW groups, elementwise on any piece */
static dopt_status adamw_step(const dopt_step_args *a) {
  const double *hp = a->hp, lr = lr_of(hp, 0), t = (double)a->step;
  const float w1 = (float)(1.0 - hp[BETA1]), w2 = (float)(1.0 - hp[BETA2]), eps = (float)hp[EPS];
  const float bc2s = (float)sqrt(1.0 - pow(hp[BETA2], t)), neg = (float)(-lr / (1.0 - pow(hp[BETA1], t)));
  const float decay = (float)(1.0 - hp[WD] * lr), wd = (float)hp[WD];
  const int use_wd = hp[WD] != 0.0, decouple = hp[DECOUPLE] != 0.0;
  float *p = a->param, *m = a->state[0], *v = a->state[1];
  for (size_t i = 0; i < a->piece->len; i++) {
    float g = a->grad[i];
    if (use_wd && decouple) p[i] = p[i] * decay;
    else if (use_wd) g = fmaf(p[i], wd, g); /* grad.add_(p, alpha=wd) */
    m[i] = dopt_lerp_elem(m[i], g, w1);
    v[i] = dopt_lerp_elem(v[i], g * g, w2);
    p[i] = p[i] + (neg * m[i]) / (sqrtf(v[i]) / bc2s + eps); /* addcdiv_(m, denom, value=-lr/bc1) */
  }
  return DOPT_OK;
}

static dopt_status muon_step(const dopt_step_args *a, const int64_t *shape) {
  const double *hp = a->hp;
  const dopt_piece *pc = a->piece;
  const size_t n = pc->numel, h = (size_t)shape[0], w = h ? n / h : 0;
  if (pc->len != n)
    return dopt__fail(DOPT_ERR_UNSUPPORTED, "normuon: a NorMuon matrix needs the whole tensor (got %zu of %zu)",
                      pc->len, n);
  const double lr = lr_of(hp, 1);
  const float decay = (float)(1.0 - hp[WD] * lr), wd = (float)hp[WD], eps = (float)hp[EPS];
  const int use_wd = hp[WD] != 0.0, decouple = hp[DECOUPLE] != 0.0, nesterov = hp[NESTEROV] != 0.0;
  const float wm = (float)(1.0 - hp[MOMENTUM]), beta = (float)hp[MOMENTUM], w2 = (float)(1.0 - hp[BETA2]);
  float *p = a->param, *m = a->state[0], *v = a->state[1];
  float *u = malloc((n ? n : 1) * sizeof *u);
  if (!u) return dopt__fail(DOPT_ERR_NO_MEMORY, "normuon: the update of a %zu-element matrix", n);
  for (size_t i = 0; i < n; i++) {
    float g = a->grad[i];
    if (use_wd && decouple) p[i] = p[i] * decay;
    else if (use_wd) g = fmaf(p[i], wd, g);
    m[i] = dopt_lerp_elem(m[i], g, wm);
    u[i] = nesterov ? dopt_lerp_elem(g, m[i], beta) : m[i];
  }
  const dopt_ns_spec ns = {(int)hp[NS_STEPS], (int)hp[NS_DTYPE] == NS_BF16, DOPT_NS_ADDMM, hp[NS_A], hp[NS_B],
                           hp[NS_C], DOPT_NS_EPS};
  dopt_status s = dopt_ns_orthogonalize(u, h, w, &ns, a->par);
  dopt_count(a, DOPT_COUNTER_NS, 1);
  dopt_count(a, DOPT_COUNTER_NS_ITERATIONS, (int64_t)hp[NS_STEPS]);
  if (s != DOPT_OK) {
    free(u);
    return s;
  }
  const float n0 = (float)sqrt(dopt_sumsq(u, n)); /* update.norm() */
  for (size_t r = 0; r < h; r++) {               /* V ← lerp(V, mean_row(U²)); U ← U / (√V + eps) */
    float *row = u + r * w;
    v[r] = dopt_lerp_elem(v[r], (float)(dopt_sumsq(row, w) / (double)w), w2);
    const float den = sqrtf(v[r]) + eps;
    for (size_t j = 0; j < w; j++) row[j] = row[j] / den;
  }
  const float n1 = (float)sqrt(dopt_sumsq(u, n)) + eps;
  float f;
  double lr_adj = lr;
  if ((int)hp[SCALE] == PRESERVE_NORM) {
    f = n0 / n1; /* original_norm / update.norm().add_(eps): a 0-d fp32 division */
    const double d0 = (double)h, rest = (double)w;
    lr_adj = hp[ADJUSTED] != 0.0 ? lr * (0.2 * sqrt(d0 > rest ? d0 : rest)) : lr * pow(d0 / rest > 1.0 ? d0 / rest : 1.0, 0.5);
  } else {
    f = (1.0f / n1) * (float)(0.2 * sqrt((double)n)); /* a Python float / a 0-d tensor: its reciprocal times it */
  }
  const float alpha = (float)(-lr_adj);
  for (size_t i = 0; i < n; i++) p[i] = fmaf(u[i] * f, alpha, p[i]); /* p.add_(update, alpha=-lr) */
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
    return adamw_step(a);
  }
  if (ndim < 2)
    return dopt__fail(DOPT_ERR_SHAPE, "normuon: a %d-D parameter of %zu elements cannot be orthogonalised "
                      "(use_muon=true); put it in a use_muon=false group or leave use_muon=auto", ndim, pc->numel);
  return muon_step(a, shape);
}

/* settings that reach every path: bf16 with decay on the matrices, AdamW on the rest; fp32 without Nesterov,
 * coupled decay; match_rms; the adjusted lr */
static const char *const grid[] = {
    "lr=2e-2,weight_decay=0.01",
    "lr=2e-2,ns_dtype=fp32,nesterov=false,weight_decay=0.05,weight_decouple=false,ns_steps=3",
    "lr=2e-2,update_scale=match_rms,beta2=0.9",
    "lr=2e-2,use_adjusted_lr=true,momentum=0.9,beta1=0.8",
    NULL,
};

const dopt_optim_impl dopt_impl_normuon = {
    .name = "normuon",
    .summary = "NorMuon as pytorch-optimizer's NorMuon (Muon normalised per row by a second moment; AdamW groups)",
    .hp = hps,
    .nhp = NHP,
    .validate = validate,
    .layout = layout,
    .step = step,
    .distributable = 0,
    .whole = whole,
    .cost = cost,
    .grid = grid,
};
