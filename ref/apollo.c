/* APOLLO as apollo-torch 1.0.3 `APOLLOAdamW` (Zhu et al. 2024, "SGD-like memory, AdamW-level performance"),
 * fp32, with its random projection ("proj": "random"). A matrix [m, n] of a group with rank r > 0:
 *   P ← N(0, 1)/√r from distopt's counter-based generator, keyed (seed, parameter, refresh q = ⌊(t−1)/T⌋,
 *       element of P): right [r, n] (R = G·Pᵀ [m, r]) or left [m, r] (R = Pᵀ·G [r, n]), side as proj_type says
 *   m ← m·β1 + (1−β1)·R;  v ← v·β2 + ((1−β2)·R)·R;  N ← m / (√v + ε)        (HF AdamW on R, ref/galore_adamw.c)
 *   f ← ‖N‖/(‖R‖ + 1e−8), per channel of the unprojected side (channel: a row for right, a column for left)
 *       or over the whole matrix (tensor)
 *   S ← G·f (·√scale first with scale_front)
 *   norm-growth limiter (unless disable_nl): after the first step, ρ = ‖S‖/(s + 1e−8); ρ ≥ 1.01: S ← S/(ρ/1.01),
 *       s ← ‖S‖/(ρ/1.01); else s ← ‖S‖ (s: the state scaled_grad, ‖S‖ of the first step)
 *   p ← p + (−step_size)·(S·√scale)  (√scale here unless scale_front), step_size = lr·√bc2/bc1
 *   p ← p + (−lr·wd)·p                                    (after the update, wd > 0)
 * APOLLO-Mini is the setting rank=1,scale_type=tensor (the paper's scale 128). Groups with rank 0, and
 * parameters that are not 2-D, are plain HF AdamW on any piece (upstream's groups without "rank"). A projected
 * matrix steps whole (owner mode): its projection is a product over rows or columns. The projection is kept as
 * the state `projector` (upstream's ortho_matrix, [r, n] or [m, r]) and redrawn at every refresh, or taken from
 * the caller's projector hook there (dopt_optim_set_projector_hook: a recorded upstream run's draws). Norms are exact sums of squares (core's exact reduction) rounded once; products are dopt_gemm_nn's (fp32, one
 * rounding per k in k order). docs/optimizers.md ("APOLLO") lists what differs from apollo_torch. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ctr_rng.h"
#include "hf_adamw.h"
#include "ns.h"
#include "registry.h"

enum { RANK = DOPT_HF_NKEYS, GAP, SCALE, PROJ_TYPE, SCALE_TYPE, SCALE_FRONT, DISABLE_NL, SEED, NHP };
enum { STD = 0, REVERSE_STD, LEFT, RIGHT };
enum { CHANNEL = 0, TENSOR };

static const char *const proj_types[] = {"std", "reverse_std", "left", "right", NULL};
static const char *const scale_types[] = {"channel", "tensor", NULL};

static const dopt_hp_def hps[NHP] = {
    DOPT_HF_ADAMW_HPS,
    [RANK] = {"rank", DOPT_HP_INT, 0.0, "projection rank (0 = plain HF AdamW for this group; APOLLO-Mini: 1)", NULL},
    [GAP] = {"update_proj_gap", DOPT_HP_INT, 200.0, "a new projection at 0-based steps 0, T, 2T, ...", NULL},
    [SCALE] = {"scale", DOPT_HP_REAL, 1.0, "the update is multiplied by sqrt(scale) (APOLLO-Mini: 128)", NULL},
    [PROJ_TYPE] = {"proj_type", DOPT_HP_ENUM, 0.0, "projected side: std (the smaller), reverse_std, left, right",
                   proj_types},
    [SCALE_TYPE] = {"scale_type", DOPT_HP_ENUM, 0.0, "gradient scaling per channel or per tensor (APOLLO-Mini)",
                    scale_types},
    [SCALE_FRONT] = {"scale_front", DOPT_HP_BOOL, 0.0, "apply sqrt(scale) before the norm-growth limiter", NULL},
    [DISABLE_NL] = {"disable_nl", DOPT_HP_BOOL, 0.0, "turn the norm-growth limiter off", NULL},
    [SEED] = {"seed", DOPT_HP_INT, 0.0, "projection generator seed (keys: seed, parameter, refresh, element)", NULL},
};

static dopt_status validate(const double *hp) {
  DOPT_TRY(dopt_hf_validate("apollo", hp));
  if (!(hp[RANK] >= 0 && hp[RANK] <= 1048576))
    return dopt__fail(DOPT_ERR_INVALID_ARG, "apollo: rank=%g must be in [0, 1048576]", hp[RANK]);
  if (!(hp[GAP] >= 1 && hp[GAP] <= 1e15))
    return dopt__fail(DOPT_ERR_INVALID_ARG, "apollo: update_proj_gap=%g must be in [1, 1e15]", hp[GAP]);
  if (!(hp[SCALE] >= 0)) return dopt__fail(DOPT_ERR_INVALID_ARG, "apollo: scale=%g must be >= 0", hp[SCALE]);
  if (!(hp[SEED] >= 0 && hp[SEED] <= 9007199254740992.0))
    return dopt__fail(DOPT_ERR_INVALID_ARG, "apollo: seed=%g must be in [0, 2^53]", hp[SEED]);
  return DOPT_OK;
}

/* A projected matrix: R [rows, cols], P right [r, n] or left [m, r]. */
typedef struct plan {
  size_t m, n, r;
  int left;
  size_t rows, cols;
} plan;

static int projected(const double *hp, int ndim, const int64_t *shape, plan *p) {
  if (hp[RANK] < 1 || ndim != 2 || !shape || shape[0] < 1 || shape[1] < 1) return 0;
  p->m = (size_t)shape[0], p->n = (size_t)shape[1], p->r = (size_t)hp[RANK];
  const int pt = (int)hp[PROJ_TYPE], tall = p->m >= p->n;
  p->left = pt == LEFT || (pt == STD && !tall) || (pt == REVERSE_STD && tall);
  p->rows = p->left ? p->r : p->m;
  p->cols = p->left ? p->n : p->r;
  return 1;
}

static int layout(const double *hp, int ndim, const int64_t *shape, dopt_state_spec *out) {
  plan p;
  if (!projected(hp, ndim, shape, &p)) return dopt_hf_layout(hp, ndim, shape, out);
  const int64_t low[2] = {(int64_t)p.rows, (int64_t)p.cols};
  dopt_state_def(&out[0], "exp_avg", 2, low, 0);
  dopt_state_def(&out[1], "exp_avg_sq", 2, low, 0);
  const int64_t ps[2] = {(int64_t)(p.left ? p.m : p.r), (int64_t)(p.left ? p.r : p.n)};
  dopt_state_def(&out[2], "projector", 2, ps, 0);
  if (hp[DISABLE_NL] != 0.0) return 3;
  dopt_state_def(&out[3], "scaled_grad", 0, low, 0); /* ‖S‖ after the limiter: one float */
  return 4;
}

static int whole(const double *hp, int ndim, const int64_t *shape) {
  plan p;
  return projected(hp, ndim, shape, &p);
}

/* 2·m·n·r (the projection), r·(m or n) normals at ~16 multiply-adds each, ~8 per element of the low-rank
 * Adam and of the full update */
static double cost(const double *hp, int ndim, const int64_t *shape) {
  plan p;
  size_t numel = 1;
  for (int d = 0; d < ndim; d++) numel *= (size_t)shape[d];
  if (!projected(hp, ndim, shape, &p)) return DOPT_COST_PER_ELEMENT * (double)numel;
  const double mn = (double)p.m * (double)p.n, low = (double)p.rows * (double)p.cols;
  return 2.0 * mn * (double)p.r + 16.0 * (double)p.r * (double)(p.left ? p.m : p.n) + DOPT_COST_PER_ELEMENT * (low + mn);
}

/* ‖x‖ of n floats at stride 1: the exact sum of squares, its square root rounded once to fp32 */
static float norm_of(const float *x, size_t n) { return (float)sqrt(dopt_sumsq(x, n)); }

/* A new projection P (row-major, [m, r] left or [r, n] right) at a refresh: the caller's hook's, else the
 * generator's, element e of P the draw (seed, tensor, q, e) divided by √r in fp32 (upstream's randn / sqrt(rank)).
 * Returns 0, or -1 when the hook failed (*st set). */
static int draw(const dopt_step_args *a, const plan *p, uint64_t q, float *P, dopt_status *st) {
  if (a->proj_hook) {
    const int given = a->proj_hook->fn(a->proj_hook->user, (int)a->tensor, a->step, a->grad, (int64_t)p->m,
                                       (int64_t)p->n, (int64_t)p->r, p->left ? P : NULL, p->left ? NULL : P);
    if (given < 0) {
      *st = dopt__fail(DOPT_ERR_INVALID_ARG, "apollo: the projector hook failed for parameter %d at step %lld",
                       (int)a->tensor, (long long)a->step);
      return -1;
    }
    if (given > 0) {
      dopt_count(a, DOPT_COUNTER_SUPPLIED, 1);
      return 0;
    }
  }
  const uint64_t seed = (uint64_t)a->hp[SEED];
  const float sq = (float)sqrt((double)p->r);
  const size_t np = p->r * (p->left ? p->m : p->n);
  for (size_t e = 0; e < np; e++) P[e] = dopt_ctr_gauss(seed, a->tensor, q, e) / sq;
  return 0;
}

static int all_zero(const float *x, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (x[i] != 0.0f) return 0;
  return 1;
}

static dopt_status projected_step(const dopt_step_args *a, const plan *p) {
  const double *hp = a->hp;
  if (a->piece->len != a->piece->numel)
    return dopt__fail(DOPT_ERR_UNSUPPORTED, "apollo: a projected parameter needs the whole tensor (got %zu of %zu elements)",
                      a->piece->len, a->piece->numel);
  const size_t m = p->m, n = p->n, nl = p->rows * p->cols, mn = m * n, np = p->r * (p->left ? m : n);
  const int64_t iter = a->step - 1, gap = (int64_t)hp[GAP];
  float *Pt = malloc(np * sizeof *Pt), *R = malloc(nl * sizeof *R), *N = malloc(nl * sizeof *N);
  float *S = malloc(mn * sizeof *S), *f = malloc((p->left ? n : m) * sizeof *f);
  float *T = p->left && hp[SCALE_TYPE] == CHANNEL ? malloc(2 * nl * sizeof *T) : NULL;
  dopt_status st = DOPT_OK;
  if (!Pt || !R || !N || !S || !f || (p->left && hp[SCALE_TYPE] == CHANNEL && !T)) {
    st = dopt__fail(DOPT_ERR_NO_MEMORY, "apollo: buffers for a [%zu, %zu] parameter at rank %zu", m, n, p->r);
    goto done;
  }
  dopt_count(a, DOPT_COUNTER_PROJECTED, 1);
  /* a new projection at 0-based steps 0, T, 2T, ... and whenever there is none (all zeros: a fresh state) */
  float *P = a->state[2];
  if (iter % gap == 0 || all_zero(P, np)) {
    dopt_count(a, DOPT_COUNTER_REFRESHES, 1);
    if (draw(a, p, (uint64_t)(iter / gap), P, &st)) goto done;
  }
  /* its transpose for dopt_gemm_nn: right Pᵀ [n, r], left Pᵀ [r, m] */
  const size_t pr = p->left ? m : p->r, pc = p->left ? p->r : n;
  for (size_t i = 0; i < pr; i++)
    for (size_t k = 0; k < pc; k++) Pt[k * pr + i] = P[i * pc + k];
  st = p->left ? dopt_gemm_nn(p->r, n, m, Pt, a->grad, R, a->par) : dopt_gemm_nn(m, p->r, n, a->grad, Pt, R, a->par);
  if (st != DOPT_OK) goto done;
  const float ns = dopt_hf_direction(hp, a->step, R, a->state, N, nl);

  /* the scaling factor(s) f: ‖N‖/(‖R‖ + 1e−8) per tensor, per row of R (right) or per column (left) */
  size_t nf = 1;
  if (hp[SCALE_TYPE] == TENSOR) {
    f[0] = norm_of(N, nl) / (norm_of(R, nl) + 1e-8f);
  } else if (!p->left) {
    nf = m;
    for (size_t i = 0; i < m; i++) f[i] = norm_of(N + i * p->r, p->r) / (norm_of(R + i * p->r, p->r) + 1e-8f);
  } else { /* columns of R [r, n]: transposed into T [n, r] (and N into T + nl) */
    nf = n;
    for (size_t k = 0; k < p->r; k++)
      for (size_t j = 0; j < n; j++) T[j * p->r + k] = R[k * n + j], T[nl + j * p->r + k] = N[k * n + j];
    for (size_t j = 0; j < n; j++) f[j] = norm_of(T + nl + j * p->r, p->r) / (norm_of(T + j * p->r, p->r) + 1e-8f);
  }
  const float sf = (float)sqrt(hp[SCALE]);
  const int front = hp[SCALE_FRONT] != 0.0;
  for (size_t i = 0; i < m; i++)
    for (size_t j = 0; j < n; j++) {
      const float fi = nf == 1 ? f[0] : p->left ? f[j] : f[i];
      float s = a->grad[i * n + j] * fi;
      S[i * n + j] = front ? s * sf : s;
    }
  /* the norm-growth limiter (Fira's), against the last step's ‖S‖ */
  float lim = 0.0f; /* 0: S as is */
  if (hp[DISABLE_NL] == 0.0) {
    float *prev = a->state[3];
    const float sn = norm_of(S, mn);
    if (a->step > 1) {
      const float ratio = sn / (prev[0] + 1e-8f);
      if (!(ratio < 1.01f)) lim = ratio / 1.01f;
    }
    prev[0] = lim != 0.0f ? sn / lim : sn;
    if (lim != 0.0f) dopt_count(a, DOPT_COUNTER_LIMITED, 1);
  }
  const float neg_decay = (float)(-hp[DOPT_HF_LR] * hp[DOPT_HF_WD]);
  const int decay = hp[DOPT_HF_WD] > 0.0;
  float *w = a->param;
  for (size_t i = 0; i < mn; i++) {
    float s = lim != 0.0f ? S[i] / lim : S[i];
    if (!front) s = s * sf;
    const float wi = w[i] + ns * s;
    w[i] = decay ? wi + neg_decay * wi : wi;
  }
done:
  free(Pt);
  free(R);
  free(N);
  free(S);
  free(f);
  free(T);
  return st;
}

static dopt_status step(const dopt_step_args *a) {
  int64_t view[3];
  int ndim;
  const int64_t *shape = dopt_step_shape(a, view, &ndim);
  plan p;
  if (!projected(a->hp, ndim, shape, &p)) return dopt_hf_step(a);
  return projected_step(a, &p);
}

/* settings that exercise every path (dopt_optim_impl.example/grid): channel and tensor scaling (APOLLO-Mini),
 * refreshes inside 100 steps, every side, sqrt(scale) before the limiter, the limiter off, a rank above the
 * small tensors' sides */
static const char *const grid[] = {
    "lr=1e-2,rank=3,update_proj_gap=7,weight_decay=0.1",
    "lr=1e-2,rank=1,update_proj_gap=9,scale_type=tensor,scale=128,seed=5",
    "lr=1e-2,rank=2,update_proj_gap=6,proj_type=reverse_std,scale_type=tensor,scale_front=true",
    "lr=1e-2,rank=3,update_proj_gap=5,proj_type=left,disable_nl=true",
    "lr=1e-2,rank=40,update_proj_gap=11,proj_type=right",
    NULL,
};

const dopt_optim_impl dopt_impl_apollo = {
    .name = "apollo",
    .summary = "APOLLO as apollo-torch 1.0.3 (random projection, channel/tensor scaling of the raw gradient; "
               "APOLLO-Mini: rank=1,scale_type=tensor)",
    .hp = hps,
    .nhp = NHP,
    .validate = validate,
    .layout = layout,
    .step = step,
    .distributable = 0,
    .whole = whole,
    .cost = cost,
    .projection = 1,
    .projector_hook = 1,
    .example = "rank=2,update_proj_gap=2",
    .grid = grid,
};
