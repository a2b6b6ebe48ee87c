/* Adafactor as torch.optim.Adafactor (torch >= 2.5; matched: 2.15's single-tensor step, the one a CPU run
 * takes), fp32. Not HF's algorithm (ref/adafactor.c): no relative step, no momentum, no eps added to g²,
 * the second moments interpolated with lerp, the row normaliser clamped, the decay scaled by lr.
 *
 * Per step t of a parameter P with gradient G (shapes: P, G [..., h, w]); N = numel:
 *   ω     = t^beta2_decay                                  (lerp weight, 1 at t = 1)
 *   ρ     = min(lr, 1/√t)
 *   α     = max(eps2, ‖P‖/√N)·ρ                            (‖P‖ before the decay)
 *   weight_decay: P ← P·(1 − lr·wd)
 *   factored (ndim ≥ 2, over the last two dims, leading dims are batch):
 *     row [..., h, 1] ← lerp(row, ‖G_row‖²/w, ω)            (‖·‖ an fp32 norm, then squared)
 *     col [..., 1, w] ← lerp(col, ‖G_col‖²/h, ω)
 *     V  = (row ⊗ col) / max(mean_h(row), eps1)
 *   else: variance ← lerp(variance, G², ω);  V = variance
 *   U = rsqrt(max(V, eps1²)) ⊙ G
 *   P ← P − (α / max(1, ‖U‖/(√N·d)))·U
 * eps1 none is fp32's machine epsilon (torch.finfo(p.dtype).eps of the fp32 master distopt steps).
 * The scalars are Python doubles as upstream computes them; lerp and add(alpha=) are torch's CPU vector
 * kernels' fused multiply-adds. Every cross-element sum (the norms, the row and column sums, the mean of
 * the rows) is exact (xsum), so a sharded step gives the single device's bits. */
#include <math.h>

#include "elem.h"
#include "registry.h"
#include "twice.h"

enum { LR, BETA2_DECAY, EPS1, EPS2, D, WD, NHP };

static const dopt_hp_def hps[NHP] = {
    [LR] = {"lr", DOPT_HP_REAL, 1e-2, "learning rate: the step is min(lr, 1/sqrt(t)) times the parameter scale"},
    [BETA2_DECAY] = {"beta2_decay", DOPT_HP_REAL, -0.8, "the second moments' lerp weight is t^beta2_decay (<= 0)"},
    [EPS1] = {"eps1", DOPT_HP_OPT, NAN,
              "floor of the row normaliser and (squared) of the variance (eps[0]; none = fp32 machine epsilon)"},
    [EPS2] = {"eps2", DOPT_HP_REAL, 1e-3, "floor of the parameter RMS in the step size (eps[1])"},
    [D] = {"d", DOPT_HP_REAL, 1.0, "update clipping threshold: RMS(U) above d scales U down (>= 1)"},
    [WD] = {"weight_decay", DOPT_HP_REAL, 0.0, "decoupled decay p *= 1 - lr*weight_decay"},
};

static dopt_status validate(const double *hp) {
  /* upstream's own checks, in its order */
  if (!(hp[LR] >= 0)) return dopt__fail(DOPT_ERR_INVALID_ARG, "torch_adafactor: lr=%g must be >= 0", hp[LR]);
  if (!(hp[BETA2_DECAY] <= 0))
    return dopt__fail(DOPT_ERR_INVALID_ARG, "torch_adafactor: beta2_decay=%g must be <= 0", hp[BETA2_DECAY]);
  if (!isnan(hp[EPS1]) && !(hp[EPS1] >= 0))
    return dopt__fail(DOPT_ERR_INVALID_ARG, "torch_adafactor: eps1=%g must be >= 0 or none", hp[EPS1]);
  if (!(hp[EPS2] >= 0)) return dopt__fail(DOPT_ERR_INVALID_ARG, "torch_adafactor: eps2=%g must be >= 0", hp[EPS2]);
  if (!(hp[D] >= 1)) return dopt__fail(DOPT_ERR_INVALID_ARG, "torch_adafactor: d=%g must be >= 1", hp[D]);
  if (!(hp[WD] >= 0))
    return dopt__fail(DOPT_ERR_INVALID_ARG, "torch_adafactor: weight_decay=%g must be >= 0", hp[WD]);
  return DOPT_OK;
}

/* upstream's shapes: row_var [..., h, 1], col_var [..., 1, w] (whole on every rank), variance like P */
static int layout(const double *hp, int ndim, const int64_t *shape, dopt_state_spec *out) {
  (void)hp;
  if (ndim < 2) {
    dopt_state_def(&out[0], "variance", ndim, shape, 1);
    return 1;
  }
  int64_t rs[DOPT_MAX_DIMS], cs[DOPT_MAX_DIMS];
  for (int i = 0; i < ndim; i++) rs[i] = cs[i] = shape[i];
  rs[ndim - 1] = 1;
  cs[ndim - 2] = 1;
  dopt_state_def(&out[0], "row_var", ndim, rs, 0);
  dopt_state_def(&out[1], "col_var", ndim, cs, 0);
  return 2;
}

static float eps1_of(const double *hp) { return isnan(hp[EPS1]) ? 0x1p-23f : (float)hp[EPS1]; }
/* clamp_(min=lo) as torch's: NaN stays NaN */
static inline float clamp_min(float x, float lo) { return x < lo ? lo : x; }
/* a mean of squares as upstream forms it: vector_norm(·) (fp32), squared, divided by the count */
static inline float norm_sq_mean(double sumsq, double count) {
  const float nrm = (float)sqrt(sumsq);
  return (nrm * nrm) / (float)count;
}

/* U of a factored piece, generated run by run: rsqrt(max(row[r]·col[c]/den[batch], eps1²))·G */
typedef struct upd_gen {
  const float *row, *col, *den, *g;
  size_t h;
  float eps_sq;
} upd_gen;
DOPT_BODY const float *gen_update_body(void *ctx, size_t off, size_t r, size_t c, size_t len, float *buf) {
  const upd_gen *q = ctx;
  const float *g = q->g + off, *col = q->col + c;
  const float row = q->row[r], den = q->den[r / q->h];
  for (size_t i = 0; i < len; i++) buf[i] = dopt_rsqrt_elem(clamp_min((row * col[i]) / den, q->eps_sq)) * g[i];
  return buf;
}
DOPT_TWICE(static, const float *, gen_update, (void *ctx, size_t off, size_t r, size_t c, size_t len, float *buf),
           (ctx, off, r, c, len, buf))

typedef struct final_run {
  float *w;
  float decay, coef;
  int use_wd;
} final_run;
DOPT_BODY void use_final_body(void *ctx, const float *u, size_t off, size_t r, size_t c, size_t len) {
  (void)r, (void)c;
  const final_run *f = ctx;
  float *w = f->w + off;
  for (size_t i = 0; i < len; i++) {
    const float p = f->use_wd ? w[i] * f->decay : w[i];
    w[i] = fmaf(u[i], f->coef, p); /* add_(update, alpha=−α/denom) */
  }
}
DOPT_TWICE_VOID(static, use_final, (void *ctx, const float *u, size_t off, size_t r, size_t c, size_t len),
                (ctx, u, off, r, c, len))

/* the update frame (norms, row/column sums and means) and the per-batch row normalisers den[b] */
static size_t den_at(const dopt_piece *pc) {
  dopt_update_frame f;
  return (dopt_update_frame_map(NULL, pc, 1, &f) + 15) & ~(size_t)15;
}
static size_t frame(const double *hp, const dopt_piece *pc) {
  (void)hp;
  return den_at(pc) + (pc->b ? pc->b : 1) * sizeof(float);
}

/* Stages (factored; a 1-D piece runs S0, S2, S4 as its 0, 1, 2):
 *   S0  MAX   ‖w‖² and the row/column maxima of G²            (dopt_second_moment_stage, eps1 = 0)
 *   S1  SUM   their words
 *   S2  MAX   row/col ← lerp of the means; the normalisers; ‖U‖² of the generated U
 *   S3  SUM   its words
 *   S4        α from ‖w‖, the clip denominator from ‖U‖; decay and update
 * 1-D: S0 lerps the variance (elementwise), forms U and posts both maxima, S2 their words. */
static dopt_status step(const dopt_step_args *a) {
  const double *hp = a->hp;
  const dopt_piece *pc = a->piece;
  const size_t n = pc->len, N = pc->numel;
  float *w = a->param;
  const float *g = a->grad;
  float *row = a->state[0], *col = pc->factored ? a->state[1] : NULL;
  dopt_update_frame f;
  dopt_update_frame_map(a->frame, pc, 1, &f);
  float *den = (float *)((unsigned char *)a->frame + den_at(pc));
  const float eps1 = eps1_of(hp), eps_sq = (float)((double)eps1 * (double)eps1);
  const double t = (double)a->step;
  const float omega = (float)pow(t, hp[BETA2_DECAY]);
  const int last = pc->factored ? 4 : 2;
  if (a->stage < last) *a->more = 1;
  const int stage = pc->factored ? a->stage : 2 * a->stage;
  const float *ws;
  size_t nw, numel_w;
  dopt_wstat(a, &ws, &nw, &numel_w); /* ‖w‖: of the piece, or of a projection wrapper's full weight */
  upd_gen ug = {row, col, den, g, pc->h, eps_sq};
  switch (stage) {
  case 0:
    if (pc->factored) return dopt_second_moment_stage(a, 0, &f, row, col, 0.0f, 0.0f, 0.0f);
    DOPT_TRY(dopt_ss_begin(f.pss, ws, nw, a->red));
    for (size_t i = 0; i < n; i++) {
      row[i] = dopt_lerp_elem(row[i], g[i] * g[i], omega);
      f.u[i] = dopt_rsqrt_elem(clamp_min(row[i], eps_sq)) * g[i];
    }
    return dopt_ss_begin(f.uss, f.u, n, a->red);
  case 1:
    return dopt_second_moment_stage(a, 1, &f, row, col, 0.0f, 0.0f, 0.0f);
  case 2:
    if (!pc->factored) {
      DOPT_TRY(dopt_ss_accum(f.pss, ws, nw, a->red));
      return dopt_ss_accum(f.uss, f.u, n, a->red);
    }
    {
      const size_t nr = pc->b * pc->h, nc = pc->b * pc->w;
      for (size_t i = 0; i < nr; i++)
        row[i] = dopt_lerp_elem(row[i], norm_sq_mean(dopt_xacc_value(&f.rc.acc[i], f.rc.scale[i]), (double)pc->w), omega);
      for (size_t i = 0; i < nc; i++)
        col[i] = dopt_lerp_elem(col[i], norm_sq_mean(dopt_xacc_value(&f.rc.acc[nr + i], f.rc.scale[nr + i]), (double)pc->h),
                           omega);
      for (size_t bi = 0; bi < pc->b; bi++) /* row_var.mean(dim=-2).clamp_(min=eps1) */
        den[bi] = clamp_min(dopt_mean_elem(dopt_xsum(row + bi * pc->h, pc->h), (double)pc->h), eps1);
    }
    return dopt_ss_begin_absmax(f.uss, dopt_gen_absmax(pc, gen_update, &ug), a->red);
  case 3:
    return dopt_ss_accum_gen(f.uss, pc, gen_update, &ug, a->red);
  default: { /* 4 */
    const double sqrt_n = pow((double)dopt_wstat_numel(a), 0.5);
    const double rho = fmin(hp[LR], 1.0 / pow(t, 0.5));
    const double pn = (double)(float)sqrt(dopt_ss_value(f.pss)) / sqrt_n;
    const double alpha = (pn > hp[EPS2] ? pn : hp[EPS2]) * rho; /* Python's max(eps2, ·): eps2 unless larger */
    const double un = (double)(float)sqrt(dopt_ss_value(f.uss));
    const double q = un / (pow((double)N, 0.5) * hp[D]);
    const double denom = q > 1.0 ? q : 1.0;
    final_run fr = {w, (float)(1.0 - hp[LR] * hp[WD]), (float)(-alpha / denom), hp[WD] != 0.0};
    if (pc->factored) dopt_piece_gen_each(pc, gen_update, &ug, use_final, &fr);
    else use_final(&fr, f.u, 0, 0, 0, n);
    return DOPT_OK;
  }
  }
}

/* settings that exercise every path: decay with a slower interpolation; an eps1 large enough to clamp the
 * normaliser and the variance, with a tight clip */
static const char *const grid[] = {
    "weight_decay=0.05,beta2_decay=-0.5",
    "lr=0.05,eps1=1e-3,d=1",
    NULL,
};

const dopt_optim_impl dopt_impl_torch_adafactor = {
    .name = "torch_adafactor",
    .summary = "Adafactor as torch.optim.Adafactor (torch >= 2.5: lerp'd factored second moment, no relative step)",
    .hp = hps,
    .nhp = NHP,
    .validate = validate,
    .layout = layout,
    .frame = frame,
    .step = step,
    .distributable = 1,
    .grid = grid,
};
