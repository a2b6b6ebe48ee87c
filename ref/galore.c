/* GaLore as one projection around an inner optimizer (docs/galore.md).
 *
 * For a matrix P [m, n] in a group with rank > 0 (leading dims 1), each step:
 *   1. refresh the projector(s) at 0-based iterations 0, T, 2T, ... (or
 *      when none exists yet): top-r singular vectors of G (ref/galore_proj.c)
 *   2. R = project(G)                                        [rows, cols]
 *   3. the inner optimizer steps R with its states in the low-rank shape:
 *      a zero low-rank parameter U (its own weight decay off; its parameter
 *      statistics, e.g. Adafactor's RMS or LAMB's ‖w‖, from the full P)
 *   4. weight decay of the full weight, P ← P + c·P, before the update for
 *      an inner that decays before (Adafactor: c = −wd·α, GaLoreAdafactor),
 *      else after it (c = −lr·wd, GaLoreAdamW8bit)
 *   5. P ← P + scale·project_back(U)
 * GaLoreAdamW's form (a fixed HF-AdamW inner) back-projects the normalised
 * update and multiplies by −step_size (dopt_galore_spec.direction). Every
 * other parameter (rank 0, vectors, batched matrices) is stepped by the
 * inner optimizer alone, on any piece, with its threads and reducer.
 *
 * The `galore` wrapper takes inner=NAME (any registered optimizer that steps
 * itself); its hyperparameters are `inner`, the projector's keys, then the
 * inner's keys under their own names (inner.KEY where the projector has a
 * KEY too, e.g. a seed). galore_adamw, galore_adamw8bit and q_galore are the
 * same projection with a fixed inner (ref/galore_adamw*.c, ref/q_galore.c). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "galore_proj.h"
#include "q_galore_quant.h"
#include "registry.h"

const char *const dopt_galore_proj_types[] = {"std", "reverse_std", "left", "right", "full", NULL};
const char *const dopt_galore_svd_kinds[] = {"exact", "randomized", NULL};

static int is_int(double v, double lo, double hi) { return v == floor(v) && v >= lo && v <= hi; }

static int key_index(const dopt_optim_impl *im, const char *key) {
  for (int k = 0; k < im->nhp; k++)
    if (strcmp(im->hp[k].key, key) == 0) return k;
  return -1;
}

void dopt_galore_spec_keys(dopt_galore_spec *sp) {
  sp->lr = key_index(sp->inner, "lr");
  sp->wd = key_index(sp->inner, "weight_decay");
}

static int lazy_on(const dopt_galore_spec *sp, const double *hp) { return sp->q_lazy < 0 || hp[sp->q_lazy] != 0.0; }
int dopt_galore_quantised(const dopt_galore_spec *sp, const double *hp) {
  if (sp->q_off < 0) return 0;
  const double *q = hp + sp->q_off;
  return q[DOPT_GQ_QUANT] != 0.0 || q[DOPT_GQ_INT8_WEIGHTS] != 0.0 || lazy_on(sp, hp);
}

static dopt_status validate_quant(const dopt_galore_spec *sp, const double *hp) {
  const double *q = hp + sp->q_off;
  if (q[DOPT_GQ_BITS] != 4 && q[DOPT_GQ_BITS] != 8)
    return dopt__fail(DOPT_ERR_INVALID_ARG, "%s: proj_bits=%g must be 4 or 8", sp->who, q[DOPT_GQ_BITS]);
  if (!(q[DOPT_GQ_GROUP] == -1 || is_int(q[DOPT_GQ_GROUP], 1, 1e12)))
    return dopt__fail(DOPT_ERR_INVALID_ARG, "%s: proj_group_size=%g must be -1 or an integer >= 1", sp->who,
                      q[DOPT_GQ_GROUP]);
  if (!(q[DOPT_GQ_GAMMA] > 0))
    return dopt__fail(DOPT_ERR_INVALID_ARG, "%s: gamma_proj=%g must be > 0", sp->who, q[DOPT_GQ_GAMMA]);
  if (!is_int(q[DOPT_GQ_QUEUE], 1, 1e6))
    return dopt__fail(DOPT_ERR_INVALID_ARG, "%s: queue_size=%g must be an integer >= 1", sp->who, q[DOPT_GQ_QUEUE]);
  if (!is_int(q[DOPT_GQ_WEIGHT_GROUP], 1, 1e12))
    return dopt__fail(DOPT_ERR_INVALID_ARG, "%s: weight_group_size=%g must be an integer >= 1", sp->who,
                      q[DOPT_GQ_WEIGHT_GROUP]);
  if (!is_int(hp[sp->q_seed], 0, 9007199254740992.0))
    return dopt__fail(DOPT_ERR_INVALID_ARG, "%s: seed=%g must be an integer in [0, 2^53]", sp->who, hp[sp->q_seed]);
  return DOPT_OK;
}

dopt_status dopt_galore_validate(const dopt_galore_spec *sp, const double *hp) {
  const double *g = hp + sp->proj_off;
  if (!is_int(g[DOPT_GP_RANK], 0, 1e9))
    return dopt__fail(DOPT_ERR_INVALID_ARG, "%s: rank=%g must be an integer >= 0", sp->who, g[DOPT_GP_RANK]);
  if (!is_int(g[DOPT_GP_GAP], 1, 1e15))
    return dopt__fail(DOPT_ERR_INVALID_ARG, "%s: update_proj_gap=%g must be an integer >= 1", sp->who,
                      g[DOPT_GP_GAP]);
  if (sp->q_off >= 0) DOPT_TRY(validate_quant(sp, hp));
  if (sp->nproj < DOPT_GP_COUNT) return DOPT_OK;
  if (dopt_galore_quantised(sp, hp) && (int)g[DOPT_GP_PROJ_TYPE] == DOPT_PROJ_FULL)
    return dopt__fail(DOPT_ERR_INVALID_ARG, "%s: proj_type=full keeps two projectors; proj_quant, lazy_refresh and "
                      "int8_weights need one (std, reverse_std, left or right)", sp->who);
  if (!is_int(g[DOPT_GP_OVERSAMPLE], -1, 1e6))
    return dopt__fail(DOPT_ERR_INVALID_ARG, "%s: oversample=%g must be an integer >= 0 (or -1: auto)", sp->who,
                      g[DOPT_GP_OVERSAMPLE]);
  if (!is_int(g[DOPT_GP_POWER_ITERS], 0, 100))
    return dopt__fail(DOPT_ERR_INVALID_ARG, "%s: power_iters=%g must be an integer in [0, 100]", sp->who,
                      g[DOPT_GP_POWER_ITERS]);
  if (!is_int(g[DOPT_GP_SEED], 0, 9007199254740992.0))
    return dopt__fail(DOPT_ERR_INVALID_ARG, "%s: seed=%g must be an integer in [0, 2^53]", sp->who, g[DOPT_GP_SEED]);
  return DOPT_OK;
}

int dopt_galore_plan_of(const dopt_galore_spec *sp, const double *hp, int ndim, const int64_t *shape,
                        dopt_galore_plan *pl) {
  const double *g = hp + sp->proj_off;
  const int type = sp->nproj == DOPT_GP_COUNT ? (int)g[DOPT_GP_PROJ_TYPE] : DOPT_PROJ_STD;
  return dopt_galore_applies(g[DOPT_GP_RANK], type, ndim, shape, pl);
}

/* ---- Q-GaLore's projector (q_galore_torch; docs/q_galore.md) ----
 * One projector P (A [m, r] or B [r, n]: never full) stored quantised in groups of proj_group_size (asymmetric
 * min-max, int4 or int8) or fp32, dequantised on every use; the lazy refresh (the cosine of the new first singular
 * vector with the previous one into a FIFO whose full mean >= cos_threshold multiplies the parameter's gap by
 * gamma_proj); optional INT8 weights held as codes with per-group scales/zeros, re-gridded after each step with
 * stochastic rounding keyed (seed, step, parameter, element). */

/* the "lazy" state (F64): flags, the current gap, counters, then the queue (lazy refresh only) */
enum { LZ_HAVE, LZ_GAP, LZ_SVDS, LZ_COUNT, LZ_WINIT, LZ_QUEUE };

static size_t ceil_div(size_t a, size_t b) { return (a + b - 1) / b; }
/* P's elements and its quantisation group (-1: one row of P) */
static size_t proj_numel(const dopt_galore_plan *pl) { return pl->right ? pl->r * pl->n : pl->m * pl->r; }
static size_t proj_group(const double *q, const dopt_galore_plan *pl) {
  return q[DOPT_GQ_GROUP] > 0 ? (size_t)q[DOPT_GQ_GROUP] : (pl->right ? pl->n : pl->r);
}

static int quant_layout(const dopt_galore_spec *sp, const double *hp, const dopt_galore_plan *pl, size_t numel,
                        dopt_state_spec *out) {
  const double *q = hp + sp->q_off;
  const size_t P = proj_numel(pl), gs = proj_group(q, pl);
  int n = 0;
  if (q[DOPT_GQ_QUANT] != 0.0) {
    int64_t qb[1] = {(int64_t)dopt_qg_code_bytes(P, (int)q[DOPT_GQ_BITS], q[DOPT_GQ_INT4_PACKED] != 0.0)};
    int64_t ng[1] = {(int64_t)ceil_div(P, gs)};
    dopt_state_def_dtype(&out[n++], "projector_q", DOPT_U8, 1, qb, 0);
    dopt_state_def(&out[n++], "projector_scales", 1, ng, 0);
    dopt_state_def(&out[n++], "projector_zeros", 1, ng, 0);
  } else {
    int64_t a[2] = {(int64_t)pl->m, (int64_t)pl->r}, b[2] = {(int64_t)pl->r, (int64_t)pl->n};
    dopt_state_def(&out[n++], "projector", 2, pl->right ? b : a, 0);
  }
  const int lazy = lazy_on(sp, hp);
  if (lazy) {
    int64_t vl[1] = {(int64_t)(pl->right ? pl->n : pl->m)};
    dopt_state_def(&out[n++], "projector_prev", 1, vl, 0);
  }
  int64_t lz[1] = {LZ_QUEUE + (lazy ? (int64_t)q[DOPT_GQ_QUEUE] : 0)};
  dopt_state_def_dtype(&out[n++], "lazy", DOPT_F64, 1, lz, 0);
  if (q[DOPT_GQ_INT8_WEIGHTS] != 0.0) {
    int64_t wn[1] = {(int64_t)numel}, wg[1] = {(int64_t)ceil_div(numel, (size_t)q[DOPT_GQ_WEIGHT_GROUP])};
    dopt_state_def_dtype(&out[n++], "weight_q", DOPT_U8, 1, wn, 0);
    dopt_state_def(&out[n++], "weight_scales", 1, wg, 0);
    dopt_state_def(&out[n++], "weight_zeros", 1, wg, 0);
  }
  return n;
}

int dopt_galore_layout(const dopt_galore_spec *sp, const double *hp, int ndim, const int64_t *shape, int projectors,
                       dopt_state_spec *out, int *ninner) {
  const double *ih = hp + sp->inner_off;
  dopt_galore_plan pl;
  if (!dopt_galore_plan_of(sp, hp, ndim, shape, &pl)) {
    *ninner = sp->inner->layout(ih, ndim, shape, out);
    return *ninner;
  }
  const int64_t lr[2] = {(int64_t)pl.rows, (int64_t)pl.cols};
  int n = *ninner = sp->inner->layout(ih, 2, lr, out);
  for (int k = 0; k < n; k++) out[k].kind = DOPT_STATE_WHOLE, out[k].block = 0; /* low-rank, on its owner: whole */
  if (!projectors) return n;
  int64_t a[2] = {(int64_t)pl.m, (int64_t)pl.r}, b[2] = {(int64_t)pl.r, (int64_t)pl.n};
  if (dopt_galore_quantised(sp, hp)) return n + quant_layout(sp, hp, &pl, dopt_numel(ndim, shape), out + n);
  if (pl.left && pl.right) {
    dopt_state_def(&out[n++], "projector_left", 2, a, 0);
    dopt_state_def(&out[n++], "projector_right", 2, b, 0);
  } else {
    dopt_state_def(&out[n++], "projector", 2, pl.left ? a : b, 0);
  }
  return n;
}

int dopt_galore_whole(const dopt_galore_spec *sp, const double *hp, int ndim, const int64_t *shape) {
  dopt_galore_plan pl;
  return dopt_galore_plan_of(sp, hp, ndim, shape, &pl) ||
         dopt__impl_whole(sp->inner, hp + sp->inner_off, ndim, shape);
}

double dopt_galore_cost(const dopt_galore_spec *sp, const double *hp, int ndim, const int64_t *shape) {
  dopt_galore_plan pl;
  const double *ih = hp + sp->inner_off;
  if (!dopt_galore_plan_of(sp, hp, ndim, shape, &pl)) return dopt__impl_cost(sp->inner, ih, ndim, shape);
  const double m = (double)pl.m, n = (double)pl.n, r = (double)pl.r, mn = m < n ? m : n;
  const int64_t low[2] = {(int64_t)pl.rows, (int64_t)pl.cols};
  const double *g = hp + sp->proj_off, gap = g[DOPT_GP_GAP] >= 1 ? g[DOPT_GP_GAP] : 1;
  double svd = 4.0 * m * n * mn; /* dense SVD: LAPACK gesdd's leading term */
  if (sp->nproj == DOPT_GP_COUNT && (int)g[DOPT_GP_SVD] == DOPT_SVD_RANDOMIZED) {
    const double p = g[DOPT_GP_OVERSAMPLE] < 0 ? r : g[DOPT_GP_OVERSAMPLE], k = r + p < mn ? r + p : mn;
    svd = (2.0 + 2.0 * g[DOPT_GP_POWER_ITERS]) * m * n * k; /* the sketch and q power iterations: two G products each */
  }
  return 2.0 * m * n * r * (double)(pl.left + pl.right) + 4.0 * m * n + dopt__impl_cost(sp->inner, ih, 2, low) +
         svd / gap;
}

/* A piece is projected iff the layout was the low-rank one: a matrix piece of a projected parameter. */
static int projected(const dopt_galore_spec *sp, const double *hp, const dopt_piece *pc, dopt_galore_plan *pl) {
  const int64_t shape[2] = {(int64_t)pc->h, (int64_t)pc->w};
  return pc->factored && pc->b == 1 && dopt_galore_plan_of(sp, hp, 2, shape, pl);
}

size_t dopt_galore_frame(const dopt_galore_spec *sp, const double *hp, const dopt_piece *pc) {
  dopt_galore_plan pl;
  if (projected(sp, hp, pc, &pl) || !sp->inner->frame) return 0;
  return sp->inner->frame(hp + sp->inner_off, pc);
}

int dopt_galore_begin(const dopt_galore_spec *sp, const dopt_step_args *a, dopt_galore_plan *pl, dopt_status *st) {
  if (!projected(sp, a->hp, a->piece, pl)) {
    dopt_step_args in = *a;
    in.impl = sp->inner;
    in.hp = a->hp + sp->inner_off;
    *st = sp->inner->step(&in);
    return 1;
  }
  if (a->piece->len != a->piece->numel) {
    *st = dopt__fail(DOPT_ERR_UNSUPPORTED, "%s: a projected parameter needs the whole tensor (got %zu of %zu elements)",
                     sp->who, a->piece->len, a->piece->numel);
    return 1;
  }
  dopt_count(a, DOPT_COUNTER_PROJECTED, 1);
  if (pl->clamped) dopt_count(a, DOPT_COUNTER_RANK_CLAMPED, 1);
  *st = DOPT_OK;
  return 0;
}

/* The full weight's decay factor c (P ← P + c·P) and whether it comes before the update. */
static int decay_of(const dopt_galore_spec *sp, const double *ih, int64_t step, void *const *state, float *c) {
  if (sp->inner->lowrank_decay && !sp->direction) return sp->inner->lowrank_decay(ih, step, state, c);
  *c = sp->wd >= 0 && sp->lr >= 0 && ih[sp->wd] > 0.0 ? (float)(-ih[sp->lr] * ih[sp->wd]) : 0.0f;
  return 0;
}

dopt_status dopt_galore_update(const dopt_galore_spec *sp, const dopt_step_args *a, const dopt_galore_plan *pl,
                               const float *A, const float *B) {
  const size_t nl = pl->rows * pl->cols, numel = pl->m * pl->n;
  const double *ih = a->hp + sp->inner_off;
  float *w = a->param;
  float *R = malloc(nl * sizeof *R), *U = calloc(nl, sizeof *U), *full = malloc(numel * sizeof *full);
  float *ws = pl->left && pl->right ? malloc((pl->m > pl->n ? pl->m : pl->n) * pl->r * sizeof *ws) : NULL;
  void *frame = NULL;
  dopt_status st = DOPT_OK;
  if (!R || !U || !full || (pl->left && pl->right && !ws)) {
    st = dopt__fail(DOPT_ERR_NO_MEMORY, "%s: buffers for a [%zu, %zu] parameter", sp->who, pl->m, pl->n);
    goto done;
  }
  dopt_galore_project(pl, a->grad, A, B, R, ws);
  float mult = 1.0f; /* delta form: P + 1·x is P + x exactly */
  if (sp->direction) {
    mult = sp->direction(ih, a->step, R, a->state, U, nl);
  } else { /* the inner's whole step on the zero low-rank parameter U, its decay off */
    double hp[DOPT_MAX_HPARAMS];
    memcpy(hp, ih, (size_t)sp->inner->nhp * sizeof *hp);
    if (sp->wd >= 0) hp[sp->wd] = 0.0;
    dopt_piece lp;
    dopt_piece_full(2, (const int64_t[2]){(int64_t)pl->rows, (int64_t)pl->cols}, &lp);
    const size_t fb = sp->inner->frame ? sp->inner->frame(hp, &lp) : 0;
    if (fb && !(frame = malloc(fb))) {
      st = dopt__fail(DOPT_ERR_NO_MEMORY, "%s: a step frame of %zu bytes", sp->who, fb);
      goto done;
    }
    int more = 0;
    const int64_t low[2] = {(int64_t)pl->rows, (int64_t)pl->cols};
    dopt_step_args in = {.impl = sp->inner,
                         .hp = hp,
                         .step = a->step,
                         .piece = &lp,
                         .param = U,
                         .grad = R,
                         .state = a->state,
                         .frame = frame,
                         .counts = a->counts,
                         .tensor = a->tensor,
                         .more = &more,
                         .par = a->par,
                         .wstat = w,
                         .wstat_len = numel,
                         .proj_hook = a->proj_hook,
                         .ndim = 2,
                         .shape = low};
    if ((st = dopt__run_stages(NULL, &in)) != DOPT_OK) goto done;
  }
  float c;
  const int before = decay_of(sp, ih, a->step, a->state, &c);
  if (before && c != 0.0f)
    for (size_t i = 0; i < numel; i++) w[i] = w[i] + c * w[i];
  dopt_galore_project_back(pl, U, A, B, (float)a->hp[sp->proj_off + DOPT_GP_SCALE], full, ws);
  for (size_t i = 0; i < numel; i++) w[i] = w[i] + mult * full[i];
  if (!before && c != 0.0f)
    for (size_t i = 0; i < numel; i++) w[i] = w[i] + c * w[i];
done:
  free(R);
  free(U);
  free(full);
  free(ws);
  free(frame);
  return st;
}

static dopt_svd_opts svd_opts(const dopt_galore_spec *sp, const double *hp, int64_t iter) {
  const double *g = hp + sp->proj_off;
  if (sp->nproj < DOPT_GP_COUNT) return (dopt_svd_opts){DOPT_SVD_EXACT, -1, 0, 0, iter};
  return (dopt_svd_opts){(int)g[DOPT_GP_SVD], (int)g[DOPT_GP_OVERSAMPLE], (int)g[DOPT_GP_POWER_ITERS],
                         (uint64_t)g[DOPT_GP_SEED], iter};
}

/* A refresh's counts: one refresh (supplied or by SVD), and the SVD's DOPT_EVENT_* flags. */
static void count_refresh(const dopt_step_args *a, unsigned ev) {
  dopt_count(a, DOPT_COUNTER_REFRESHES, 1);
  if (ev & DOPT_EVENT_SVD_FALLBACK) dopt_count(a, DOPT_COUNTER_SVD_FALLBACKS, 1);
  if (ev & DOPT_EVENT_SVD_FAILED) dopt_count(a, DOPT_COUNTER_SVD_FAILURES, 1);
}

/* At a due refresh: the caller's projector (1: A/B filled), 0 when there is no hook or it declined, -1 on its
 * failure (*st set). */
static int hooked(const dopt_galore_spec *sp, const dopt_step_args *a, const dopt_galore_plan *pl, float *A, float *B,
                  dopt_status *st) {
  if (!a->proj_hook) return 0;
  int given = a->proj_hook->fn(a->proj_hook->user, (int)a->tensor, a->step, a->grad, (int64_t)pl->m, (int64_t)pl->n,
                               (int64_t)pl->r, A, B);
  if (given > 0) dopt_count(a, DOPT_COUNTER_SUPPLIED, 1);
  if (given >= 0) return given != 0;
  *st = dopt__fail(DOPT_ERR_INVALID_ARG, "%s: the projector hook failed for parameter %d at step %lld", sp->who,
                   (int)a->tensor, (long long)a->step);
  return -1;
}

/* Q-GaLore's step of a projected parameter; its states after the inner's (ni) as quant_layout lays them out. */
static dopt_status quant_step(const dopt_galore_spec *sp, const dopt_step_args *a, const dopt_galore_plan *pl,
                              int idx) {
  const double *hp = a->hp, *q = hp + sp->q_off;
  const int quant = q[DOPT_GQ_QUANT] != 0.0, bits = (int)q[DOPT_GQ_BITS], packed = q[DOPT_GQ_INT4_PACKED] != 0.0;
  const int int8w = q[DOPT_GQ_INT8_WEIGHTS] != 0.0, lazy = lazy_on(sp, hp);
  const size_t P = proj_numel(pl), gs = proj_group(q, pl), wg = (size_t)q[DOPT_GQ_WEIGHT_GROUP];
  const size_t numel = a->piece->numel;
  uint8_t *pq = NULL;
  float *ps = NULL, *pz = NULL, *pf = NULL;
  if (quant) {
    pq = a->state[idx++];
    ps = a->state[idx++];
    pz = a->state[idx++];
  } else {
    pf = a->state[idx++];
  }
  float *prev = lazy ? a->state[idx++] : NULL;
  double *lz = a->state[idx++];
  uint8_t *wq = int8w ? a->state[idx] : NULL;
  float *wsc = int8w ? a->state[idx + 1] : NULL, *wze = int8w ? a->state[idx + 2] : NULL;
  if (quant && P % gs != 0)
    return dopt__fail(DOPT_ERR_INVALID_ARG,
                      "%s: projector of %zu elements is not a multiple of proj_group_size=%zu (upstream "
                      "asserts; use proj_group_size=-1 for per-row groups)",
                      sp->who, P, gs);
  if (int8w && numel % wg != 0)
    return dopt__fail(DOPT_ERR_INVALID_ARG, "%s: weight of %zu elements is not a multiple of weight_group_size=%zu",
                      sp->who, numel, wg);
  float *proj = malloc(P * sizeof *proj);
  if (!proj) return dopt__fail(DOPT_ERR_NO_MEMORY, "%s: buffers for a [%zu, %zu] parameter", sp->who, pl->m, pl->n);
  dopt_status st = DOPT_OK;
  float *w = a->param;
  if (int8w) { /* the weight is its codes: quantise once (nearest, as the model conversion), then dequantise */
    if (lz[LZ_WINIT] == 0.0) {
      dopt_qg_quantize(w, numel, wg, 8, 0, wq, wsc, wze);
      lz[LZ_WINIT] = 1.0;
    }
    dopt_qg_dequantize(wq, numel, wg, 8, 0, wsc, wze, w);
  }
  const int have = lz[LZ_HAVE] != 0.0;
  if (!have) lz[LZ_GAP] = hp[sp->proj_off + DOPT_GP_GAP];
  const int64_t iter = a->step - 1; /* upstream projects with the pre-increment step */
  float *A = pl->left ? proj : NULL, *B = pl->right ? proj : NULL;
  if (!have || iter % (int64_t)lz[LZ_GAP] == 0) {
    if (have) { /* kept if the SVD fails */
      if (quant) dopt_qg_dequantize(pq, P, gs, bits, packed, ps, pz, proj);
      else memcpy(proj, pf, P * sizeof *proj);
    }
    unsigned ev = 0;
    const dopt_svd_opts so = svd_opts(sp, hp, iter);
    const int given = hooked(sp, a, pl, A, B, &st);
    if (given < 0 || (!given && (st = dopt_galore_refresh(pl, a->grad, &so, have, A, B, &ev)) != DOPT_OK)) goto done;
    count_refresh(a, ev);
    if (!(ev & DOPT_EVENT_SVD_FAILED)) {
      lz[LZ_SVDS] += 1.0;
      const size_t vlen = pl->right ? pl->n : pl->m, vstride = pl->right ? 1 : pl->r; /* B[0, :] or A[:, 0] */
      if (lazy) {
        if (have) {
          float c = dopt_qg_cosine(prev, 1, proj, vstride, vlen);
          if (q[DOPT_GQ_ABS_COSINE] != 0.0) c = fabsf(c);
          int count = (int)lz[LZ_COUNT];
          lz[LZ_GAP] = dopt_qg_lazy_push(lz + LZ_QUEUE, &count, (int)q[DOPT_GQ_QUEUE], c, q[DOPT_GQ_COS_THRESHOLD],
                                         q[DOPT_GQ_GAMMA], lz[LZ_GAP]);
          lz[LZ_COUNT] = count;
        }
        for (size_t i = 0; i < vlen; i++) prev[i] = proj[i * vstride];
      }
      if (quant) dopt_qg_quantize(proj, P, gs, bits, packed, pq, ps, pz);
      else memcpy(pf, proj, P * sizeof *proj);
      lz[LZ_HAVE] = 1.0;
    }
  }
  /* every use dequantises the stored projector */
  if (quant) dopt_qg_dequantize(pq, P, gs, bits, packed, ps, pz, proj);
  else memcpy(proj, pf, P * sizeof *proj);
  if ((st = dopt_galore_update(sp, a, pl, A, B)) != DOPT_OK) goto done;
  if (int8w) { /* re-grid with fresh per-group min/max, round, and show the dequantised weight */
    if (q[DOPT_GQ_STOCH_ROUND] != 0.0)
      dopt_qg_quantize_sr(w, numel, wg, (uint64_t)hp[sp->q_seed], a->step, a->tensor, 0, wq, wsc, wze);
    else dopt_qg_quantize(w, numel, wg, 8, 0, wq, wsc, wze);
    dopt_qg_dequantize(wq, numel, wg, 8, 0, wsc, wze, w);
  }
done:
  free(proj);
  return st;
}

dopt_status dopt_galore_step(const dopt_galore_spec *sp, const dopt_step_args *a) {
  dopt_galore_plan pl;
  dopt_status st;
  if (dopt_galore_begin(sp, a, &pl, &st)) return st;
  dopt_state_spec lay[DOPT_MAX_STATES];
  int ni;
  dopt_galore_layout(sp, a->hp, 2, (const int64_t[2]){(int64_t)pl.m, (int64_t)pl.n}, 0, lay, &ni);
  if (dopt_galore_quantised(sp, a->hp)) return quant_step(sp, a, &pl, ni);
  float *A = pl.left ? a->state[ni] : NULL;
  float *B = pl.right ? a->state[ni + (pl.left ? 1 : 0)] : NULL;
  const dopt_svd_opts so = svd_opts(sp, a->hp, a->step - 1);
  const int64_t gap = (int64_t)a->hp[sp->proj_off + DOPT_GP_GAP];
  int have_prev;
  if (!dopt_galore_due(&pl, a->step, gap, A, B, &have_prev)) return dopt_galore_update(sp, a, &pl, A, B);
  const int given = hooked(sp, a, &pl, A, B, &st); /* the caller's projector first */
  if (given < 0) return st;
  unsigned ev = 0;
  if (!given) DOPT_TRY(dopt_galore_refresh(&pl, a->grad, &so, have_prev, A, B, &ev));
  count_refresh(a, ev);
  return dopt_galore_update(sp, a, &pl, A, B);
}

/* ---- the `galore` wrapper: inner=NAME ------------------------------------------------- */

enum { INNER, PROJ, QUANT = PROJ + DOPT_GP_COUNT, LAZY = QUANT + DOPT_GQ_COUNT, NOWN };

static const dopt_hp_def hps[NOWN] = {
    [INNER] = {"inner", DOPT_HP_ENUM, 0.0,
               "the optimizer of the low-rank gradient and of unprojected parameters (its keys follow)",
               dopt__registry_names},
    DOPT_GALORE_HPS_CORE("projection rank (0 = the inner optimizer alone for this group)", DOPT_GALORE_GAP_DOC),
    DOPT_GALORE_HPS_SVD,
    DOPT_GALORE_HPS_QUANT(0.0),
    [LAZY] = {"lazy_refresh", DOPT_HP_BOOL, 0.0, "Q-GaLore's lazy refresh: the gap grows while the subspace is stable",
              NULL},
};

/* The composite's spec: hp[INNER] names the inner, whose keys follow the wrapper's. */
static dopt_galore_spec spec(const double *hp) {
  dopt_galore_spec sp = {"galore", dopt_find_impl(dopt__registry_names[(int)hp[INNER]]), NOWN, PROJ, DOPT_GP_COUNT,
                         -1, -1, NULL, QUANT, LAZY, PROJ + DOPT_GP_SEED};
  dopt_galore_spec_keys(&sp);
  return sp;
}

static dopt_status validate(const double *hp) {
  dopt_galore_spec sp = spec(hp);
  DOPT_TRY(dopt_galore_validate(&sp, hp));
  return sp.inner->validate ? sp.inner->validate(hp + NOWN) : DOPT_OK;
}
DOPT_GALORE_FORM_FUNCTIONS

/* The impl for inner whp[INNER]: the wrapper's keys (inner's default = the chosen one), then the inner's. */
static dopt_status compose(const dopt_optim_impl *self, const double *whp, const dopt_optim_impl **out) {
  const char *name = dopt__registry_names[(int)whp[INNER]];
  const dopt_optim_impl *in = dopt_find_impl(name);
  if (!in || in->wrap || in->compose || in->projection)
    return dopt__fail(DOPT_ERR_INVALID_ARG, "galore: inner=%s is a wrapper or projects its own gradient; choose one that "
                      "steps itself (adamw, adafactor, came, lamb, adamw8bit, ...)", name);
  if (in->swap) /* its parameter is an iterate (Schedule-Free's y), not a weight an update is added to */
    return dopt__fail(DOPT_ERR_INVALID_ARG, "galore: inner=%s keeps its iterates in the parameter (train/eval "
                      "points); a projected step has no parameter of its own: choose an inner that returns an update",
                      name);
  if (NOWN + in->nhp > DOPT_MAX_HPARAMS)
    return dopt__fail(DOPT_ERR_UNSUPPORTED, "galore: inner=%s has %d hyperparameters; at most %d fit beside the "
                      "projector's %d", name, in->nhp, DOPT_MAX_HPARAMS - NOWN, NOWN);
  const int nhp = NOWN + in->nhp;
  size_t names = 0;
  for (int k = 0; k < in->nhp; k++) names += strlen(in->hp[k].key) + 7; /* "inner." + key + NUL */
  dopt_optim_impl *im = malloc(sizeof *im);
  dopt_hp_def *hp = malloc((size_t)nhp * sizeof *hp + names);
  if (!im || !hp) {
    free(im);
    free(hp);
    return dopt__fail(DOPT_ERR_NO_MEMORY, "galore: the hyperparameter table for inner=%s", name);
  }
  char *text = (char *)(hp + nhp);
  memcpy(hp, hps, sizeof hps);
  hp[INNER].def = whp[INNER];
  for (int k = 0; k < in->nhp; k++) {
    hp[NOWN + k] = in->hp[k];
    int clash = 0;
    for (int j = 0; j < NOWN; j++) clash |= strcmp(hps[j].key, in->hp[k].key) == 0;
    if (clash) { /* the projector's key keeps its name; the inner's is inner.KEY */
      strcpy(text, "inner.");
      strcat(text, in->hp[k].key);
      hp[NOWN + k].key = text;
      text += strlen(text) + 1;
    }
  }
  *im = *self;
  im->hp = hp;
  im->nhp = nhp;
  im->compose = NULL;
  im->composed = 1;
  im->nown = NOWN;
  *out = im;
  return DOPT_OK;
}

/* settings that exercise every path (dopt_optim_impl.example/grid): projected and unprojected parameters, refreshes
 * inside the run, an elementwise, a factored (its RMS from the full weight, decay before) and a norm-based inner,
 * 8-bit low-rank states, the randomized SVD, Q-GaLore's projector (quantised, lazy, INT8 weights) */
static const char *const grid[] = {
    "inner=adafactor,rank=3,update_proj_gap=7,beta1=0.9,weight_decay=0.01",
    "inner=lamb,rank=3,update_proj_gap=6,proj_type=left,lr=1e-2,weight_decay=0.01",
    "inner=adamw,rank=4,update_proj_gap=5,proj_type=full,lr=1e-2",
    "inner=adamw8bit,rank=3,update_proj_gap=9,min_8bit_size=8,lr=1e-2,svd=randomized",
    "inner=came,rank=3,update_proj_gap=8,proj_type=right,lr=1e-3",
    "inner=lamb,rank=3,update_proj_gap=3,lr=1e-2,proj_quant=true,proj_group_size=-1,lazy_refresh=true,queue_size=2,"
    "cos_threshold=-1,int8_weights=true,weight_group_size=1",
    NULL,
};

const dopt_optim_impl dopt_impl_galore = {
    .name = "galore",
    .summary = "GaLore around any optimizer: inner= steps the low-rank projected gradient (galore_torch 1.0's projector)",
    .hp = hps,
    .nhp = NOWN,
    DOPT_GALORE_FORM_IMPL,
    .compose = compose,
    .example = "inner=adafactor,rank=4,update_proj_gap=2",
    .grid = grid,
    .grid_ci = 2,
};
