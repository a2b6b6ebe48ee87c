/* Q-GaLore as VITA-Group/Q-GaLore's q_galore_torch (QGaLoreAdamW8bit with
 * GaLoreProjector(quant=...); docs/q_galore.md), fp32 parameters. It is
 * galore_adamw8bit (ref/galore_adamw8bit.c) plus:
 *   - a quantised projector (asymmetric min-max, int4 or int8, groups;
 *     int4 packed two per byte unless int4_packed=false), dequantised on
 *     every use;
 *   - the lazy subspace refresh: at a refresh the cosine similarity of the
 *     new first singular vector with the previous one is pushed into a FIFO
 *     of queue_size; a full queue with mean >= cos_threshold multiplies the
 *     parameter's gap by gamma_proj (int()); the queue is never cleared;
 *   - optional INT8 weights (int8_weights=true): the weight is held as uint8
 *     codes with per-group (weight_group_size of the row-major flattened
 *     weight) scales/zeros as optimizer state, dequantised before the step
 *     and re-gridded after it with stochastic rounding keyed (seed, step,
 *     parameter index, element index); the fp32 parameter the caller sees is
 *     the dequantised weight.
 * Only proj_type std exists upstream (asserted there), so it is the only one
 * here; the SVD is the exact one of ref/galore_proj.c. Groups with rank = 0
 * and non-matrix parameters are plain AdamW8bit (no INT8 weights, as
 * upstream keeps embeddings, norms and the head in bf16). docs/q_galore.md. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "distopt/quant8.h"
#include "galore_proj.h"
#include "registry.h"
#include "qgalore.h"

/* hp[0..7] are AdamW8bit's (shared validation, layout and kernel) */
enum {
  LR, BETA1, BETA2, EPS, WD, MIN8, PCT, BLOCK,
  RANK, GAP, SCALE,
  PROJ_QUANT, PROJ_BITS, PROJ_GROUP, INT4_PACKED,
  COS_THRESHOLD, GAMMA_PROJ, QUEUE_SIZE, ABS_COSINE,
  INT8_WEIGHTS, WEIGHT_GROUP, STOCH_ROUND, SEED, NHP
};

static const dopt_hp_def hps[NHP] = {
    DOPT_GALORE8_HPS(2048, "8-bit state block (2048 = bnb 0.43.1, Q-GaLore's pin)"),
    DOPT_GALORE_HPS_CORE("projection rank (0 = plain AdamW8bit for this group)",
                         "initial refresh gap (grows by gamma_proj, lazy rule)"),
    [PROJ_QUANT] = {"proj_quant", DOPT_HP_BOOL, 1.0, "store the projector quantised (upstream quant)", NULL},
    [PROJ_BITS] = {"proj_bits", DOPT_HP_REAL, 4.0, "projector bits: 4 or 8 (upstream quant_n_bit)", NULL},
    [PROJ_GROUP] = {"proj_group_size", DOPT_HP_REAL, 256.0, "projector quantisation group (-1 = per row)", NULL},
    [INT4_PACKED] = {"int4_packed", DOPT_HP_BOOL, 1.0, "two int4 codes per byte (false = one per byte, upstream)",
                     NULL},
    [COS_THRESHOLD] = {"cos_threshold", DOPT_HP_REAL, 0.4, "lazy refresh: queue mean at or above this grows the gap",
                       NULL},
    [GAMMA_PROJ] = {"gamma_proj", DOPT_HP_REAL, 2.0, "lazy refresh: gap <- int(gap * gamma_proj)", NULL},
    [QUEUE_SIZE] = {"queue_size", DOPT_HP_REAL, 5.0, "lazy refresh: cosine FIFO length", NULL},
    [ABS_COSINE] = {"abs_cosine", DOPT_HP_BOOL, 0.0, "use |cos| (deviation; upstream: signed)", NULL},
    [INT8_WEIGHTS] = {"int8_weights", DOPT_HP_BOOL, 0.0, "hold GaLore weights as INT8 codes (optimizer state)", NULL},
    [WEIGHT_GROUP] = {"weight_group_size", DOPT_HP_REAL, 256.0, "INT8 weight group (row-major flattened)", NULL},
    [STOCH_ROUND] = {"stochastic_round", DOPT_HP_BOOL, 1.0, "INT8 weights: stochastic (else nearest) rounding", NULL},
    [SEED] = {"seed", DOPT_HP_REAL, 0.0, "stochastic rounding generator seed", NULL},
};

/* lazy-refresh state ("lazy", F64): flags, gap, counters, then the queue */
enum { LZ_HAVE, LZ_GAP, LZ_SVDS, LZ_COUNT, LZ_WINIT, LZ_QUEUE };

static int is_int(double v, double lo, double hi) { return v == floor(v) && v >= lo && v <= hi; }

/* the projection with inner adamw8bit; the projector keys are rank, gap, scale (std, exact) */
static dopt_galore_spec spec(const double *hp) {
  (void)hp;
  dopt_galore_spec sp = {"q_galore", &dopt_impl_adamw8bit, 0, RANK, 3, -1, -1, NULL};
  dopt_galore_spec_keys(&sp);
  return sp;
}

static dopt_status validate(const double *hp) {
  DOPT_TRY(dopt__adamw8bit_validate("q_galore", hp));
  dopt_galore_spec sp = spec(hp);
  DOPT_TRY(dopt_galore_validate(&sp, hp));
  if (hp[PROJ_BITS] != 4 && hp[PROJ_BITS] != 8)
    return dopt__fail(DOPT_ERR_INVALID_ARG, "q_galore: proj_bits=%g must be 4 or 8", hp[PROJ_BITS]);
  if (!(hp[PROJ_GROUP] == -1 || is_int(hp[PROJ_GROUP], 1, 1e12)))
    return dopt__fail(DOPT_ERR_INVALID_ARG, "q_galore: proj_group_size=%g must be -1 or an integer >= 1",
                      hp[PROJ_GROUP]);
  if (!(hp[GAMMA_PROJ] > 0))
    return dopt__fail(DOPT_ERR_INVALID_ARG, "q_galore: gamma_proj=%g must be > 0", hp[GAMMA_PROJ]);
  if (!is_int(hp[QUEUE_SIZE], 1, 1e6))
    return dopt__fail(DOPT_ERR_INVALID_ARG, "q_galore: queue_size=%g must be an integer >= 1", hp[QUEUE_SIZE]);
  if (!is_int(hp[WEIGHT_GROUP], 1, 1e12))
    return dopt__fail(DOPT_ERR_INVALID_ARG, "q_galore: weight_group_size=%g must be an integer >= 1",
                      hp[WEIGHT_GROUP]);
  if (!is_int(hp[SEED], 0, 9007199254740992.0))
    return dopt__fail(DOPT_ERR_INVALID_ARG, "q_galore: seed=%g must be an integer in [0, 2^53]", hp[SEED]);
  return DOPT_OK;
}

/* projector geometry: P elements, its row length, the first-vector length */
static size_t proj_numel(const dopt_galore_plan *pl) { return pl->right ? pl->r * pl->n : pl->m * pl->r; }
static size_t proj_group(const double *hp, const dopt_galore_plan *pl) {
  return hp[PROJ_GROUP] > 0 ? (size_t)hp[PROJ_GROUP] : (pl->right ? pl->n : pl->r);
}
static size_t ceil_div(size_t a, size_t b) { return (a + b - 1) / b; }

static int layout(const double *hp, int ndim, const int64_t *shape, dopt_state_spec *out) {
  dopt_galore_spec sp = spec(hp);
  dopt_galore_plan pl;
  int n;
  dopt_galore_layout(&sp, hp, ndim, shape, 0, out, &n);
  if (!dopt_galore_plan_of(&sp, hp, ndim, shape, &pl)) return n;
  size_t P = proj_numel(&pl), gs = proj_group(hp, &pl);
  if (hp[PROJ_QUANT] != 0.0) {
    int64_t qb[1] = {(int64_t)dopt_qg_code_bytes(P, (int)hp[PROJ_BITS], hp[INT4_PACKED] != 0.0)};
    int64_t ng[1] = {(int64_t)ceil_div(P, gs)};
    dopt_state_def_dtype(&out[n++], "projector_q", DOPT_U8, 1, qb, 0);
    dopt_state_def(&out[n++], "projector_scales", 1, ng, 0);
    dopt_state_def(&out[n++], "projector_zeros", 1, ng, 0);
  } else {
    int64_t a[2] = {(int64_t)pl.m, (int64_t)pl.r}, b[2] = {(int64_t)pl.r, (int64_t)pl.n};
    dopt_state_def(&out[n++], "projector", 2, pl.right ? b : a, 0);
  }
  int64_t vl[1] = {(int64_t)(pl.right ? pl.n : pl.m)};
  dopt_state_def(&out[n++], "projector_prev", 1, vl, 0);
  int64_t lz[1] = {LZ_QUEUE + (int64_t)hp[QUEUE_SIZE]};
  dopt_state_def_dtype(&out[n++], "lazy", DOPT_F64, 1, lz, 0);
  if (hp[INT8_WEIGHTS] != 0.0) {
    size_t numel = dopt_numel(ndim, shape);
    int64_t wn[1] = {(int64_t)numel}, wg[1] = {(int64_t)ceil_div(numel, (size_t)hp[WEIGHT_GROUP])};
    dopt_state_def_dtype(&out[n++], "weight_q", DOPT_U8, 1, wn, 0);
    dopt_state_def(&out[n++], "weight_scales", 1, wg, 0);
    dopt_state_def(&out[n++], "weight_zeros", 1, wg, 0);
  }
  return n;
}

/* A projected parameter (its SVD) and an 8-bit one (blocks of the logical tensor) need the whole tensor; a small
 * parameter with fp32 states (below min_8bit_size, no percentile clipping) is elementwise AdamW. */
static int whole(const double *hp, int ndim, const int64_t *shape) {
  dopt_galore_spec sp = spec(hp);
  return dopt_galore_whole(&sp, hp, ndim, shape);
}

static dopt_status step(const dopt_step_args *a) {
  const double *hp = a->hp;
  const dopt_galore_spec sp = spec(hp);
  dopt_galore_plan pl;
  dopt_status st;
  if (dopt_galore_begin(&sp, a, &pl, &st)) return st;
  dopt_state_spec tmp[DOPT_MAX_STATES];
  int idx;
  dopt_galore_layout(&sp, hp, 2, (const int64_t[2]){(int64_t)pl.m, (int64_t)pl.n}, 0, tmp, &idx);
  const int quant = hp[PROJ_QUANT] != 0.0, bits = (int)hp[PROJ_BITS], packed = hp[INT4_PACKED] != 0.0;
  const int int8w = hp[INT8_WEIGHTS] != 0.0;
  const size_t P = proj_numel(&pl), gs = proj_group(hp, &pl), wg = (size_t)hp[WEIGHT_GROUP], numel = a->piece->numel;
  uint8_t *pq = NULL;
  float *ps = NULL, *pz = NULL, *pf = NULL;
  if (quant) {
    pq = a->state[idx++];
    ps = a->state[idx++];
    pz = a->state[idx++];
  } else {
    pf = a->state[idx++];
  }
  float *prev = a->state[idx++];
  double *lz = a->state[idx++];
  uint8_t *wq = int8w ? a->state[idx] : NULL;
  float *wsc = int8w ? a->state[idx + 1] : NULL, *wze = int8w ? a->state[idx + 2] : NULL;
  if (quant && P % gs != 0)
    return dopt__fail(DOPT_ERR_INVALID_ARG,
                      "q_galore: projector of %zu elements is not a multiple of proj_group_size=%zu (upstream "
                      "asserts; use proj_group_size=-1 for per-row groups)",
                      P, gs);
  if (int8w && numel % wg != 0)
    return dopt__fail(DOPT_ERR_INVALID_ARG, "q_galore: weight of %zu elements is not a multiple of weight_group_size=%zu",
                      numel, wg);

  float *proj = malloc(P * sizeof *proj);
  st = DOPT_OK;
  if (!proj) {
    st = dopt__fail(DOPT_ERR_NO_MEMORY, "q_galore: buffers for a [%zu, %zu] parameter", pl.m, pl.n);
    goto done;
  }
  float *w = a->param;
  if (int8w) { /* the weight is its codes: quantise once (nearest, as the model conversion), then dequantise */
    if (lz[LZ_WINIT] == 0.0) {
      dopt_qg_quantize(w, numel, wg, 8, 0, wq, wsc, wze);
      lz[LZ_WINIT] = 1.0;
    }
    dopt_qg_dequantize(wq, numel, wg, 8, 0, wsc, wze, w);
  }

  const int have = lz[LZ_HAVE] != 0.0;
  if (!have) lz[LZ_GAP] = hp[GAP];
  const int64_t iter = a->step - 1; /* upstream projects with the pre-increment step */
  float *A = pl.left ? proj : NULL, *B = pl.right ? proj : NULL;
  if (!have || iter % (int64_t)lz[LZ_GAP] == 0) {
    if (have) { /* kept if the SVD fails */
      if (quant) dopt_qg_dequantize(pq, P, gs, bits, packed, ps, pz, proj);
      else memcpy(proj, pf, P * sizeof *proj);
    }
    unsigned ev = 0;
    dopt_svd_opts so = {DOPT_SVD_EXACT, -1, 0, 0, iter};
    if ((st = dopt_galore_refresh(&pl, a->grad, &so, have, A, B, &ev)) != DOPT_OK) goto done;
    if (a->events) *a->events |= ev;
    if (!(ev & DOPT_EVENT_SVD_FAILED)) {
      lz[LZ_SVDS] += 1.0;
      const size_t vlen = pl.right ? pl.n : pl.m, vstride = pl.right ? 1 : pl.r; /* B[0, :] or A[:, 0] */
      if (have) {
        float c = dopt_qg_cosine(prev, 1, proj, vstride, vlen);
        if (hp[ABS_COSINE] != 0.0) c = fabsf(c);
        int count = (int)lz[LZ_COUNT];
        lz[LZ_GAP] = dopt_qg_lazy_push(lz + LZ_QUEUE, &count, (int)hp[QUEUE_SIZE], c, hp[COS_THRESHOLD],
                                       hp[GAMMA_PROJ], lz[LZ_GAP]);
        lz[LZ_COUNT] = count;
      }
      for (size_t i = 0; i < vlen; i++) prev[i] = proj[i * vstride];
      if (quant) dopt_qg_quantize(proj, P, gs, bits, packed, pq, ps, pz);
      else memcpy(pf, proj, P * sizeof *proj);
      lz[LZ_HAVE] = 1.0;
    }
  }
  /* every use dequantises the stored projector */
  if (quant) dopt_qg_dequantize(pq, P, gs, bits, packed, ps, pz, proj);
  else memcpy(proj, pf, P * sizeof *proj);
  if ((st = dopt_galore_update(&sp, a, &pl, A, B)) != DOPT_OK) goto done;
  if (int8w) { /* re-grid with fresh per-group min/max, round, and show the dequantised weight */
    if (hp[STOCH_ROUND] != 0.0) dopt_qg_quantize_sr(w, numel, wg, (uint64_t)hp[SEED], a->step, a->tensor, 0, wq, wsc, wze);
    else dopt_qg_quantize(w, numel, wg, 8, 0, wq, wsc, wze);
    dopt_qg_dequantize(wq, numel, wg, 8, 0, wsc, wze, w);
  }
done:
  free(proj);
  return st;
}

/* settings that exercise every path (dopt_optim_impl.example/grid): lazy refreshes, INT8 weights, 8-bit projector */
static const char *const grid[] = {
    "lr=1e-2,rank=3,update_proj_gap=5,proj_group_size=-1,int8_weights=true,weight_group_size=1",
    "lr=1e-2,rank=4,update_proj_gap=3,proj_group_size=-1,proj_bits=8",
    NULL,
};

const dopt_optim_impl dopt_impl_q_galore = {
    .name = "q_galore",
    .summary = "Q-GaLore as q_galore_torch (quantised projector, lazy refresh, optional INT8 weights, 8-bit Adam)",
    .hp = hps,
    .nhp = NHP,
    .validate = validate,
    .layout = layout,
    .step = step,
    .distributable = 0,
    .whole = whole,
    .projection = 1,
    .example = "rank=4,update_proj_gap=2,proj_group_size=-1",
    .grid = grid,
};
