/* CAME as the official came_pytorch CAME after the Feb-2024 fix (b368dc0), fp32.
 *
 * Per step of P with gradient G (factored over the last two dims if ndim ≥ 2):
 *   U   = G² + eps1
 *   row_v ← β2·row_v + (1−β2)·mean_w(U);  col_v ← β2·col_v + (1−β2)·mean_h(U)
 *   U   ← (rsqrt(row_v/mean_h(row_v)) ⊗ rsqrt(col_v)) ⊙ G      [1-D: rsqrt(v) ⊙ G]
 *   Û   = U / max(1, RMS(U)/clip_threshold)
 *   m   ← β1·m + (1−β1)·Û
 *   Res = (Û − m)² + eps2                                          (updated m)
 *   row_r ← β3·row_r + (1−β3)·mean_w(Res);  col_r likewise
 *   upd = (rsqrt(row_r/mean_h(row_r)) ⊗ rsqrt(col_r)) ⊙ m          [1-D: a copy of m]
 *   weight_decay: P ← P + (−wd·lr)·P   (decoupled, before the update)
 *   P ← P − lr·upd
 * State: exp_avg [P]; factored: exp_avg_sq_row, exp_avg_res_row [..., h],
 * exp_avg_sq_col, exp_avg_res_col [..., w]; 1-D: exp_avg_sq [P]; RMS (0-d,
 * computed each step as upstream does, never used). Separate tensors for the
 * second-moment and residual statistics (no aliasing). */
#include <math.h>

#include "elem.h"
#include "registry.h"
#include "twice.h"

enum { LR, EPS1, EPS2, CLIP, BETA1, BETA2, BETA3, WD, NHP };

static const dopt_hp_def hps[NHP] = {
    [LR] = {"lr", DOPT_HP_OPT, NAN, "learning rate (required, > 0)"},
    [EPS1] = {"eps1", DOPT_HP_REAL, 1e-30, "added to g^2"},
    [EPS2] = {"eps2", DOPT_HP_REAL, 1e-16, "added to the residual (U - m)^2"},
    [CLIP] = {"clip_threshold", DOPT_HP_REAL, 1.0, "update RMS clipping threshold"},
    [BETA1] = {"beta1", DOPT_HP_REAL, 0.9, "momentum decay"},
    [BETA2] = {"beta2", DOPT_HP_REAL, 0.999, "second-moment decay"},
    [BETA3] = {"beta3", DOPT_HP_REAL, 0.9999, "residual (confidence) decay"},
    [WD] = {"weight_decay", DOPT_HP_REAL, 0.0, "decoupled decay p -= lr*wd*p"},
};

static dopt_status validate(const double *hp) {
  if (isnan(hp[LR])) return dopt__fail(DOPT_ERR_INVALID_ARG, "came: lr=none: CAME needs an lr > 0");
  if (!(hp[LR] > 0)) return dopt__fail(DOPT_ERR_INVALID_ARG, "came: lr=%g must be > 0", hp[LR]);
  static const char *const bn[3] = {"beta1", "beta2", "beta3"};
  for (int i = 0; i < 3; i++)
    if (!(hp[BETA1 + i] >= 0 && hp[BETA1 + i] <= 1))
      return dopt__fail(DOPT_ERR_INVALID_ARG, "came: %s=%g must be in [0, 1]", bn[i], hp[BETA1 + i]);
  if (!(hp[CLIP] > 0)) return dopt__fail(DOPT_ERR_INVALID_ARG, "came: clip_threshold=%g must be > 0", hp[CLIP]);
  if (hp[EPS1] < 0) return dopt__fail(DOPT_ERR_INVALID_ARG, "came: eps1=%g must be >= 0", hp[EPS1]);
  if (hp[EPS2] < 0) return dopt__fail(DOPT_ERR_INVALID_ARG, "came: eps2=%g must be >= 0", hp[EPS2]);
  if (hp[WD] < 0) return dopt__fail(DOPT_ERR_INVALID_ARG, "came: weight_decay=%g must be >= 0", hp[WD]);
  return DOPT_OK;
}

static int layout(const double *hp, int ndim, const int64_t *shape, dopt_state_spec *out) {
  (void)hp;
  int n = 0;
  dopt_state_def(&out[n++], "exp_avg", ndim, shape, 1);
  if (ndim >= 2) {
    dopt_factored_state_defs("exp_avg_sq_row", "exp_avg_sq_col", ndim, shape, out, &n);
    dopt_factored_state_defs("exp_avg_res_row", "exp_avg_res_col", ndim, shape, out, &n);
  } else {
    dopt_state_def(&out[n++], "exp_avg_sq", ndim, shape, 1);
  }
  dopt_state_def(&out[n++], "RMS", 0, shape, 0);
  return n;
}

/* stat ← β·stat + (1−β)·mean (row or column statistic update) */
static void ema(float *stat, const float *mean, size_t n, double beta) {
  const float b = (float)beta, omb = (float)(1.0 - beta);
  for (size_t i = 0; i < n; i++) stat[i] = dopt_ema_elem(stat[i], b, omb, mean[i]);
}

/* Stages (factored; a 1-D parameter needs S0 = S0+S2, S1 = S1+S3, S2 = S4+S6
 * without the residual statistics):
 *   S0  MAX   ‖w‖², row/column maxima of U = G² + eps1
 *   S1  SUM   their words
 *   S2  MAX   RMS(w); sq_row/col ← EMA of the means; U ← factored(sq) ⊙ G; ‖U‖²
 *   S3  SUM   its words
 *   S4  MAX   Û = U / max(1, RMS(U)/d); m ← β1·m + (1−β1)·Û; Res = (Û − m)² + eps2, row/column maxima
 *   S5  SUM   their words
 *   S6        res_row/col ← EMA; upd = factored(res) ⊙ m; decay, update
 * U, the residual and upd are generated where a stage reads them
 * (core/stats.c): nothing piece-sized is written but m and w. */
/* Factored: the residual generated from G run by run (core/stats.c), U =
 * factored(sq) ⊙ G recomputed; S4 updates m as it goes (each element is
 * generated once there), S5 reads the updated m. */
typedef struct residual_gen {
  dopt_fact_gen u; /* U = factored(sq) ⊙ G */
  float *m;
  float div, b1, omb1, eps2;
} residual_gen;
DOPT_BODY const float *gen_residual_first_body(void *ctx, size_t off, size_t r, size_t c, size_t len, float *buf) {
  const residual_gen *g = ctx;
  const float *u = dopt_gen_factored((void *)&g->u, off, r, c, len, buf);
  float *m = g->m + off;
  for (size_t i = 0; i < len; i++) buf[i] = dopt_came_residual(u[i], &m[i], g->div, g->b1, g->omb1, g->eps2);
  return buf;
}
DOPT_TWICE(static, const float *, gen_residual_first,
           (void *ctx, size_t off, size_t r, size_t c, size_t len, float *buf), (ctx, off, r, c, len, buf))
DOPT_BODY const float *gen_residual_again_body(void *ctx, size_t off, size_t r, size_t c, size_t len, float *buf) {
  const residual_gen *g = ctx;
  const float *u = dopt_gen_factored((void *)&g->u, off, r, c, len, buf);
  const float *m = g->m + off;
  for (size_t i = 0; i < len; i++) buf[i] = dopt_came_res(dopt_came_uhat(u[i], g->div), m[i], g->eps2);
  return buf;
}
DOPT_TWICE(static, const float *, gen_residual_again,
           (void *ctx, size_t off, size_t r, size_t c, size_t len, float *buf), (ctx, off, r, c, len, buf))

/* The last pass over one run: decay, update; the update given (1-D: m), or
 * (upd NULL, factored) formed here as factored(res) ⊙ m element by element. */
typedef struct final_run {
  float *w;
  float lr, decay;
  int use_wd;
  const dopt_fact_gen *fg; /* factored: upd = factored(res_row, res_col) ⊙ m */
} final_run;
DOPT_BODY void use_final_body(void *ctx, const float *upd, size_t off, size_t r, size_t c, size_t len) {
  const final_run *f = ctx;
  float *w = f->w + off;
  if (upd) {
    for (size_t i = 0; i < len; i++) w[i] = dopt_came_final(w[i], upd[i], f->lr, f->decay, f->use_wd);
    return;
  }
  const float rf = f->fg->rf[r], *cf = f->fg->cf + c, *m = f->fg->x + off;
  for (size_t i = 0; i < len; i++)
    w[i] = dopt_came_final(w[i], dopt_factored_elem(rf, cf[i], m[i]), f->lr, f->decay, f->use_wd);
}
DOPT_TWICE_VOID(static, use_final, (void *ctx, const float *upd, size_t off, size_t r, size_t c, size_t len),
                (ctx, upd, off, r, c, len))

static dopt_status step(const dopt_step_args *a) {
  const double *hp = a->hp;
  const dopt_piece *pc = a->piece;
  const size_t n = pc->len, N = pc->numel; /* local and logical element counts */
  const int factored = pc->factored;
  float *w = a->param;
  float *m = a->state[0];
  float *sq_row = a->state[1], *sq_col = NULL, *res_row = NULL, *res_col = NULL;
  float *rms_state;
  if (factored) {
    sq_col = a->state[2];
    res_row = a->state[3];
    res_col = a->state[4];
    rms_state = a->state[5];
  } else {
    rms_state = a->state[2];
  }
  dopt_update_frame f;
  dopt_update_frame_map(a->frame, pc, 1, &f);
  const size_t nr = pc->b * pc->h, nc = pc->b * pc->w;
  float *u = f.u;
  const float eps1 = (float)hp[EPS1], eps2 = (float)hp[EPS2];
  const int last = factored ? 6 : 2;
  if (a->stage < last) *a->more = 1;
  const int stage = factored ? a->stage : 2 * a->stage; /* 1-D: 0, 2, 4 */

  if (stage < 4)
    return dopt_second_moment_stage(a, stage, &f, sq_row, sq_col, (float)hp[BETA2], (float)(1.0 - hp[BETA2]), eps1);
  /* RMS(w): of the logical parameter, or of a projection wrapper's full weight */
  if (stage == 4) *rms_state = dopt_rms_from_ss(dopt_ss_value(f.pss), dopt_wstat_numel(a));
  const float div = dopt_clip_div(dopt_rms_from_ss(dopt_ss_value(f.uss), N), hp[CLIP]);
  residual_gen rg = {{f.rf, f.cf, a->grad}, m, div, (float)hp[BETA1], (float)(1.0 - hp[BETA1]), eps2};
  switch (stage) {
  case 4: /* 1-D: S2, the last stage */
    /* m ← β1·m + (1−β1)·Û, then the residual (factored: its row/column maxima) */
    if (factored) return dopt_rc_begin_gen(&f.rc, pc, a->red, gen_residual_first, &rg);
    for (size_t i = 0; i < n; i++) u[i] = dopt_came_residual(u[i], &m[i], div, rg.b1, rg.omb1, eps2);
    break;
  case 5:
    return dopt_rc_accum_gen(&f.rc, pc, a->red, gen_residual_again, &rg);
  default:
    break;
  }
  const float lr = (float)hp[LR];
  dopt_fact_gen upd = {f.rf, f.cf, m}; /* factored: upd = factored(res) ⊙ m */
  final_run fr = {w, lr, (float)(-hp[WD] * hp[LR]), hp[WD] != 0.0, &upd};
  if (!factored) { /* 1-D: the update is a copy of m (no confidence term) */
    use_final(&fr, m, 0, 0, 0, n);
    return DOPT_OK;
  }
  dopt_rc_means(&f.rc, pc, f.rmean, f.cmean);
  ema(res_row, f.rmean, nr, hp[BETA3]);
  ema(res_col, f.cmean, nc, hp[BETA3]);
  dopt_factors(res_row, res_col, pc, f.rf, f.cf); /* the second moment's factors are not needed after S5 */
  dopt_piece_gen_each(pc, NULL, NULL, use_final, &fr);
  return DOPT_OK;
}

/* settings that exercise every path (dopt_optim_impl.example/grid): CAME has no default lr */
static const char *const grid[] = {
    "lr=1e-3,weight_decay=0.01",
    "lr=2e-4,beta2=0.95,beta3=0.999",
    NULL,
};

const dopt_optim_impl dopt_impl_came = {
    .name = "came",
    .summary = "CAME as the official came_pytorch (after the Feb-2024 fix): confidence-guided factored update",
    .hp = hps,
    .nhp = NHP,
    .validate = validate,
    .layout = layout,
    .frame = dopt_update_frame_rowcol,
    .step = step,
    .distributable = 1,
    .example = "lr=2e-4",
    .grid = grid,
};
