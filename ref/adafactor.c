/* Adafactor as transformers.optimization.Adafactor (HF), fp32.
 *
 * Per step t of a parameter P with gradient G (shapes: P, G [..., h, w]):
 *   RMS   = ‖P‖/√numel                                  (before the update)
 *   ρ     = relative_step ? min(warmup_init ? 1e-6·t : 1e-2, 1/√t) : lr
 *   α     = scale_parameter ? ρ·max(eps2, RMS) : ρ
 *   β2t   = 1 − t^decay_rate
 *   U     = G² + eps1
 *   factored (ndim ≥ 2, over the last two dims, leading dims are batch):
 *     row [..., h] ← β2t·row + (1−β2t)·mean_w(U)
 *     col [..., w] ← β2t·col + (1−β2t)·mean_h(U)
 *     U ← (rsqrt(row/mean_h(row)) ⊗ rsqrt(col)) ⊙ G
 *   else: v ← β2t·v + (1−β2t)·U;  U ← rsqrt(v) ⊙ G
 *   U ← U / max(1, RMS(U)/clip_threshold);  U ← α·U
 *   beta1: m ← β1·m + (1−β1)·U; U ← m          (momentum of the scaled update, as HF)
 *   weight_decay: P ← P + (−wd·α)·P            (decoupled, scaled by α, before the update)
 *   P ← P − U
 * Every cross-element sum (means, RMS) is an exact xsum. */
#include <math.h>

#include "elem.h"
#include "registry.h"
#include "twice.h"

enum { LR, EPS1, EPS2, CLIP, DECAY, BETA1, WD, SCALE_P, REL_STEP, WARMUP, NHP };

static const dopt_hp_def hps[NHP] = {
    [LR] = {"lr", DOPT_HP_OPT, NAN, "external learning rate (requires relative_step=false)"},
    [EPS1] = {"eps1", DOPT_HP_REAL, 1e-30, "added to g^2 (regulariser of the second moment)"},
    [EPS2] = {"eps2", DOPT_HP_REAL, 1e-3, "floor of the parameter RMS in the step size"},
    [CLIP] = {"clip_threshold", DOPT_HP_REAL, 1.0, "update RMS clipping threshold d"},
    [DECAY] = {"decay_rate", DOPT_HP_REAL, -0.8, "beta2_t = 1 - t^decay_rate (must be < 0)"},
    [BETA1] = {"beta1", DOPT_HP_OPT, NAN, "momentum of the update (none = no first moment)"},
    [WD] = {"weight_decay", DOPT_HP_REAL, 0.0, "decoupled decay, scaled by the effective step size"},
    [SCALE_P] = {"scale_parameter", DOPT_HP_BOOL, 1.0, "scale the step by max(eps2, RMS(p))"},
    [REL_STEP] = {"relative_step", DOPT_HP_BOOL, 1.0, "time-dependent step min(1e-2, 1/sqrt(t))"},
    [WARMUP] = {"warmup_init", DOPT_HP_BOOL, 0.0, "relative step 1e-6*t during warm-up"},
};

static dopt_status validate(const double *hp) {
  /* what upstream rejects */
  if (!isnan(hp[LR]) && hp[REL_STEP] != 0.0)
    return dopt__fail(DOPT_ERR_INVALID_ARG,
                      "adafactor: lr=%g cannot be combined with relative_step=true (set relative_step=false)",
                      hp[LR]);
  if (hp[WARMUP] != 0.0 && hp[REL_STEP] == 0.0)
    return dopt__fail(DOPT_ERR_INVALID_ARG, "adafactor: warmup_init=true requires relative_step=true");
  /* what upstream misses (it fails at the first step or silently diverges) */
  if (isnan(hp[LR]) && hp[REL_STEP] == 0.0)
    return dopt__fail(DOPT_ERR_INVALID_ARG, "adafactor: relative_step=false needs an lr (lr=none)");
  if (!isnan(hp[LR]) && hp[LR] < 0) return dopt__fail(DOPT_ERR_INVALID_ARG, "adafactor: lr=%g must be >= 0", hp[LR]);
  if (!(hp[DECAY] < 0))
    return dopt__fail(DOPT_ERR_INVALID_ARG, "adafactor: decay_rate=%g must be < 0 (beta2_t = 1 - t^decay_rate)",
                      hp[DECAY]);
  if (!(hp[CLIP] > 0)) return dopt__fail(DOPT_ERR_INVALID_ARG, "adafactor: clip_threshold=%g must be > 0", hp[CLIP]);
  if (hp[EPS1] < 0) return dopt__fail(DOPT_ERR_INVALID_ARG, "adafactor: eps1=%g must be >= 0", hp[EPS1]);
  if (hp[EPS2] < 0) return dopt__fail(DOPT_ERR_INVALID_ARG, "adafactor: eps2=%g must be >= 0", hp[EPS2]);
  if (!isnan(hp[BETA1]) && !(hp[BETA1] >= 0 && hp[BETA1] < 1))
    return dopt__fail(DOPT_ERR_INVALID_ARG, "adafactor: beta1=%g must be in [0, 1) or none", hp[BETA1]);
  if (hp[WD] < 0) return dopt__fail(DOPT_ERR_INVALID_ARG, "adafactor: weight_decay=%g must be >= 0", hp[WD]);
  return DOPT_OK;
}

static int layout(const double *hp, int ndim, const int64_t *shape, dopt_state_spec *out) {
  int n = 0;
  if (!isnan(hp[BETA1])) dopt_state_def(&out[n++], "exp_avg", ndim, shape, 1);
  if (ndim >= 2) dopt_factored_state_defs("exp_avg_sq_row", "exp_avg_sq_col", ndim, shape, out, &n);
  else dopt_state_def(&out[n++], "exp_avg_sq", ndim, shape, 1);
  dopt_state_def(&out[n++], "RMS", 0, shape, 0);
  return n;
}

/* The step size α = ρ·max(eps2, RMS), in upstream's precision: the product is
 * an fp32 tensor op when RMS wins the max, a double product otherwise. */
static float step_size(const double *hp, double t, float rms) {
  return dopt_adafactor_step_size(hp[REL_STEP] != 0.0, hp[WARMUP] != 0.0, hp[LR], hp[SCALE_P] != 0.0, hp[EPS2], t, rms);
}

/* The last pass over one run: momentum, decay, update; U given (1-D: f.u),
 * or (u NULL, factored) formed here from the gradient element by element, so
 * the gradient's loads overlap the arithmetic. */
typedef struct final_run {
  float *w, *m;
  float div, alpha, b1, omb1, decay;
  int use_wd;
  const dopt_fact_gen *fg; /* factored: U = factored(row, col) ⊙ G */
} final_run;
DOPT_BODY void use_final_body(void *ctx, const float *u, size_t off, size_t r, size_t c, size_t len) {
  const final_run *f = ctx;
  float *w = f->w + off, *m = f->m ? f->m + off : NULL;
  if (u) {
    for (size_t i = 0; i < len; i++)
      w[i] = dopt_adafactor_final(w[i], u[i], m ? &m[i] : NULL, f->div, f->alpha, f->b1, f->omb1, f->decay,
                                  f->use_wd);
    return;
  }
  const float rf = f->fg->rf[r], *cf = f->fg->cf + c, *g = f->fg->x + off;
  if (m)
    for (size_t i = 0; i < len; i++)
      w[i] = dopt_adafactor_final(w[i], dopt_factored_elem(rf, cf[i], g[i]), &m[i], f->div, f->alpha, f->b1, f->omb1,
                                  f->decay, f->use_wd);
  else
    for (size_t i = 0; i < len; i++)
      w[i] = dopt_adafactor_final(w[i], dopt_factored_elem(rf, cf[i], g[i]), NULL, f->div, f->alpha, f->b1, f->omb1,
                                  f->decay, f->use_wd);
}
DOPT_TWICE_VOID(static, use_final, (void *ctx, const float *u, size_t off, size_t r, size_t c, size_t len),
                (ctx, u, off, r, c, len))

/* Stages (factored; a 1-D parameter has no row/column means and needs only
 * S0 = S0+S2, S1 = S1+S3, S2 = S4):
 *   S0  MAX   ‖w‖² and the row/column maxima of U = G² + eps1
 *   S1  SUM   their words
 *   S2  MAX   row/col ← EMA of the means; U = factored(row, col) ⊙ G; ‖U‖²
 *   S3  SUM   its words
 *   S4        RMS(w) → α; clip U by RMS(U); momentum, decay, update
 * U is generated from G where a stage reads it (core/stats.c): each stage
 * reads G once and writes nothing piece-sized. */
static dopt_status step(const dopt_step_args *a) {
  const double *hp = a->hp;
  const dopt_piece *pc = a->piece;
  const size_t n = pc->len;     /* local elements */
  const size_t N = pc->numel;   /* logical elements: every mean and RMS divides by these */
  float *w = a->param;
  int s = 0;
  float *m = isnan(hp[BETA1]) ? NULL : a->state[s++];
  float *row = a->state[s++]; /* [b, h] whole (1-D: exp_avg_sq, local) */
  float *col = pc->factored ? a->state[s++] : NULL; /* [b, w] whole */
  float *rms_state = a->state[s];
  dopt_update_frame f;
  dopt_update_frame_map(a->frame, pc, 1, &f);

  const double t = (double)a->step;
  const double beta2t = dopt_adafactor_beta2t(t, hp[DECAY]);
  const float b2t = (float)beta2t, omb2t = (float)(1.0 - beta2t);
  const float eps1 = (float)hp[EPS1];
  const int last = pc->factored ? 4 : 2;
  if (a->stage < last) *a->more = 1;
  const int stage = pc->factored ? a->stage : 2 * a->stage; /* 1-D: 0, 2, 4 */
  if (stage < 4) return dopt_second_moment_stage(a, stage, &f, row, col, b2t, omb2t, eps1);
  /* S4 (1-D: S2) */
  /* RMS(w): of the logical parameter, or of a projection wrapper's full weight */
  const float rms = dopt_rms_from_ss(dopt_ss_value(f.pss), dopt_wstat_numel(a));
  *rms_state = rms;
  const float alpha = step_size(hp, t, rms);
  const float div = dopt_clip_div(dopt_rms_from_ss(dopt_ss_value(f.uss), N), hp[CLIP]); /* clamp(min=1) */
  const float b1 = isnan(hp[BETA1]) ? 0.0f : (float)hp[BETA1];
  const float omb1 = isnan(hp[BETA1]) ? 0.0f : (float)(1.0 - hp[BETA1]);
  const float decay = (float)(-hp[WD]) * alpha;
  const int use_wd = hp[WD] != 0.0;
  dopt_fact_gen fg = {f.rf, f.cf, a->grad};
  final_run fr = {w, m, div, alpha, b1, omb1, decay, use_wd, &fg};
  if (pc->factored) {
    dopt_piece_gen_each(pc, NULL, NULL, use_final, &fr);
  } else {
    use_final(&fr, f.u, 0, 0, 0, n);
  }
  return DOPT_OK;
}

/* Under a projection wrapper (GaLoreAdafactor): the decay of the full
 * weight comes before the update and is scaled by α, which takes RMS(w) of
 * the full weight from the RMS state the low-rank step wrote (the last state). */
static int lowrank_decay(const double *hp, int64_t step, void *const *state, float *factor) {
  const int k = (isnan(hp[BETA1]) ? 0 : 1) + 2; /* exp_avg?, row, col, RMS: a projected gradient is a matrix */
  *factor = hp[WD] != 0.0 ? (float)(-hp[WD]) * step_size(hp, (double)step, *(const float *)state[k]) : 0.0f;
  return 1;
}

/* settings that exercise every path (dopt_optim_impl.example/grid) */
static const char *const grid[] = {
    "beta1=0.9,weight_decay=0.01",
    "",
    "relative_step=false,lr=1e-2,scale_parameter=false,clip_threshold=0.5",
    NULL,
};

const dopt_optim_impl dopt_impl_adafactor = {
    .name = "adafactor",
    .summary = "Adafactor as transformers.optimization.Adafactor (factored second moment over the last two dims)",
    .hp = hps,
    .nhp = NHP,
    .validate = validate,
    .layout = layout,
    .frame = dopt_update_frame_rowcol,
    .step = step,
    .distributable = 1,
    .grid = grid,
    .lowrank_decay = lowrank_decay,
};
