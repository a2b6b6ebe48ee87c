/* SOAP as pytorch-optimizer 4.1.0's `SOAP` (Vyas et al. 2024, "SOAP: improving and stabilizing Shampoo using
 * Adam"): Adam in the eigenbasis of Shampoo's preconditioners, fp32. A parameter of shape (d_0, …, d_{k−1}) has a
 * preconditioner GG_i [d_i, d_i] and its eigenbasis Q_i for each dimension with d_i ≤ max_precondition_dim (a
 * vector only with precondition_1d); project(X) is X's mode product with every Q_i (Q_iᵀ along dim i, in dim
 * order), project_back the one with Q_i. Step t of the parameter (its own clock; upstream's is the group's):
 *   GG_i ← lerp(GG_i, Σ_{other dims} G⊗G, 1 − shampoo_beta)            (every step, after the update)
 *   t = 1: Q_i ← eigh(GG_i + 1e−30·I), eigenvalues descending; no update (upstream skips a group's first step)
 *   t ≥ 2, s = t − 1: G' = project(G);  m ← lerp(m, G, 1−β1);  v ← lerp(v, G'², 1−β2)
 *     N = project_back(project(m) / (√v + eps))   (÷ (√mean(N²) + eps) with normalize_gradient)
 *     p ← p + (−lr·√(1−β2^s)/(1−β1^s))·N;  p ← p·(1 − wd·lr)            (wd ≠ 0)
 *     then GG as above, and when s % precondition_frequency == 0 each Q_i from one power iteration:
 *     P = GG_i·Q_i, est_k = Σ_j Q_i[j,k]·P[j,k], the columns sorted by est descending, v permuted along dim i with
 *     them, Q_i ← the Q of a Householder QR of the sorted P (LAPACK sgeqrf/sorgqr, as torch.linalg.qr).
 * m is kept in the parameter's own coordinates, v in the eigenbasis. The eigenvectors' signs are fixed (each
 * column's largest-magnitude component positive, ties to the lowest index); upstream's are torch's LAPACK's,
 * and on a degenerate eigenspace (a rank-deficient GG_i: the first step's G·Gᵀ of a non-square matrix) any
 * basis is one: the golden cases and a recorded run's verify adopt upstream's first basis (docs/optimizers.md).
 * Products are dopt_gemm_nn's (fp32, one rounding per k in k order); est and mean(N²) exact sums rounded once.
 * A preconditioned parameter steps whole (owner mode); the others are elementwise (Adam on any piece). */
#include <lapacke.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "elem.h"
#include "galore_proj.h" /* dopt_blas_pin */
#include "ns.h"
#include "registry.h"

enum { LR, BETA1, BETA2, SHAMPOO_BETA, WD, FREQ, MAXDIM, MERGE_DIMS, PRECOND_1D, CORRECT_BIAS, NORMALIZE, EPS, NHP };

static const dopt_hp_def hps[NHP] = {
    [LR] = {"lr", DOPT_HP_REAL, 3e-3, "learning rate", NULL},
    [BETA1] = {"beta1", DOPT_HP_REAL, 0.95, "first-moment decay (the parameter's coordinates)", NULL},
    [BETA2] = {"beta2", DOPT_HP_REAL, 0.95, "second-moment decay (the eigenbasis)", NULL},
    [SHAMPOO_BETA] = {"shampoo_beta", DOPT_HP_OPT, NAN, "preconditioner decay (none: beta2)", NULL},
    [WD] = {"weight_decay", DOPT_HP_REAL, 1e-2, "decoupled decay after the update: p *= 1 - wd*lr", NULL},
    [FREQ] = {"precondition_frequency", DOPT_HP_INT, 10.0, "steps between the eigenbases' QR refreshes", NULL},
    [MAXDIM] = {"max_precondition_dim", DOPT_HP_INT, 10000.0, "larger dimensions are not preconditioned", NULL},
    [MERGE_DIMS] = {"merge_dims", DOPT_HP_BOOL, 0.0, "merge small dimensions (not supported: false)", NULL},
    [PRECOND_1D] = {"precondition_1d", DOPT_HP_BOOL, 0.0, "precondition vectors too", NULL},
    [CORRECT_BIAS] = {"correct_bias", DOPT_HP_BOOL, 1.0, "step size lr*sqrt(1-beta2^s)/(1-beta1^s)", NULL},
    [NORMALIZE] = {"normalize_gradient", DOPT_HP_BOOL, 0.0, "divide the update by its RMS (+ eps)", NULL},
    [EPS] = {"eps", DOPT_HP_REAL, 1e-8, "added to sqrt(v)", NULL},
};

#define SOAP_MAX_DIMS 7 /* 2 + 2·7 states <= DOPT_MAX_STATES */
static const char *const gg_names[SOAP_MAX_DIMS] = {"GG0", "GG1", "GG2", "GG3", "GG4", "GG5", "GG6"};
static const char *const q_names[SOAP_MAX_DIMS] = {"Q0", "Q1", "Q2", "Q3", "Q4", "Q5", "Q6"};

static dopt_status validate(const double *hp) {
  if (!(hp[LR] >= 0)) return dopt__fail(DOPT_ERR_INVALID_ARG, "soap: lr=%g must be >= 0", hp[LR]);
  for (int k = BETA1; k <= BETA2; k++)
    if (!(hp[k] >= 0 && hp[k] < 1))
      return dopt__fail(DOPT_ERR_INVALID_ARG, "soap: %s=%g must be in [0, 1)", hps[k].key, hp[k]);
  if (!isnan(hp[SHAMPOO_BETA]) && !(hp[SHAMPOO_BETA] >= 0 && hp[SHAMPOO_BETA] <= 1))
    return dopt__fail(DOPT_ERR_INVALID_ARG, "soap: shampoo_beta=%g must be in [0, 1] or none", hp[SHAMPOO_BETA]);
  if (!(hp[WD] >= 0)) return dopt__fail(DOPT_ERR_INVALID_ARG, "soap: weight_decay=%g must be >= 0", hp[WD]);
  if (!(hp[FREQ] >= 1 && hp[FREQ] <= 1e15))
    return dopt__fail(DOPT_ERR_INVALID_ARG, "soap: precondition_frequency=%g must be in [1, 1e15]", hp[FREQ]);
  if (!(hp[MAXDIM] >= 1 && hp[MAXDIM] <= 65536))
    return dopt__fail(DOPT_ERR_INVALID_ARG, "soap: max_precondition_dim=%g must be in [1, 65536]", hp[MAXDIM]);
  if (hp[MERGE_DIMS] != 0.0)
    return dopt__fail(DOPT_ERR_UNSUPPORTED, "soap: merge_dims=true is not supported (each dimension has its own "
                                            "preconditioner here): give false");
  if (!(hp[EPS] >= 0)) return dopt__fail(DOPT_ERR_INVALID_ARG, "soap: eps=%g must be >= 0", hp[EPS]);
  return DOPT_OK;
}

/* Which dimensions are preconditioned: pre[i] for i < ndim; returns how many. */
static int preconditioned(const double *hp, int ndim, const int64_t *shape, int *pre) {
  int n = 0;
  for (int i = 0; i < ndim; i++) {
    pre[i] = shape[i] <= (int64_t)hp[MAXDIM] && (ndim >= 2 || hp[PRECOND_1D] != 0.0);
    n += pre[i];
  }
  return ndim > SOAP_MAX_DIMS ? 0 : n;
}

static int layout(const double *hp, int ndim, const int64_t *shape, dopt_state_spec *out) {
  dopt_state_def(&out[0], "exp_avg", ndim, shape, 1);
  dopt_state_def(&out[1], "exp_avg_sq", ndim, shape, 1);
  int pre[DOPT_MAX_DIMS], n = 2;
  if (!preconditioned(hp, ndim, shape, pre)) return n;
  for (int i = 0; i < ndim; i++) {
    if (!pre[i]) continue;
    const int64_t sq[2] = {shape[i], shape[i]};
    dopt_state_def(&out[n++], gg_names[i], 2, sq, 0);
    dopt_state_def(&out[n++], q_names[i], 2, sq, 0);
  }
  return n;
}

static int whole(const double *hp, int ndim, const int64_t *shape) {
  int pre[DOPT_MAX_DIMS];
  return preconditioned(hp, ndim, shape, pre) > 0 || hp[NORMALIZE] != 0.0;
}

/* per step: two mode products of every preconditioned dim each way (2·numel·d_i each) and the outer product
 * (numel·d_i); the refreshes: a d³ product and a QR every precondition_frequency steps */
static double cost(const double *hp, int ndim, const int64_t *shape) {
  int pre[DOPT_MAX_DIMS];
  double numel = 1, c = 0;
  for (int i = 0; i < ndim; i++) numel *= (double)shape[i];
  if (!preconditioned(hp, ndim, shape, pre)) return DOPT_COST_PER_ELEMENT * numel;
  for (int i = 0; i < ndim; i++)
    if (pre[i]) {
      const double d = (double)shape[i];
      c += 7.0 * numel * d + 3.0 * d * d * d / hp[FREQ];
    }
  return c + DOPT_COST_PER_ELEMENT * numel;
}

/* X viewed as [A, d, B] around dimension i of shape[0, ndim) */
static void around(int ndim, const int64_t *shape, int i, size_t *A, size_t *d, size_t *B) {
  *A = 1, *B = 1;
  for (int j = 0; j < i; j++) *A *= (size_t)shape[j];
  for (int j = i + 1; j < ndim; j++) *B *= (size_t)shape[j];
  *d = (size_t)shape[i];
}

/* The mode-i product in place: X[a, :, b] ← Mᵀ·X[a, :, b] (forward: M = Q_i, its transpose Qt given) or
 * Q_i·X[a, :, b] (back); tmp: numel floats, T: d·d floats. */
static dopt_status mode(float *X, int ndim, const int64_t *shape, int i, const float *Q, int back, float *tmp,
                        float *T, const dopt_par *par) {
  size_t A, d, B;
  around(ndim, shape, i, &A, &d, &B);
  const float *M = Q;
  if (!back) { /* Qᵀ */
    for (size_t r = 0; r < d; r++)
      for (size_t c = 0; c < d; c++) T[c * d + r] = Q[r * d + c];
    M = T;
  }
  for (size_t a = 0; a < A; a++) DOPT_TRY(dopt_gemm_nn(d, B, d, M, X + a * d * B, tmp + a * d * B, par));
  memcpy(X, tmp, A * d * B * sizeof *X);
  return DOPT_OK;
}

/* project (back = 0) or project_back of X in place over every preconditioned dimension, in dimension order */
static dopt_status project(float *X, int ndim, const int64_t *shape, const int *pre, void *const *Qs, int back,
                           float *tmp, float *T, const dopt_par *par) {
  for (int i = 0; i < ndim; i++)
    if (pre[i]) DOPT_TRY(mode(X, ndim, shape, i, Qs[i], back, tmp, T, par));
  return DOPT_OK;
}

/* GG ← lerp(GG, Σ_{a,b} X[a,:,b]·X[a,:,b]ᵀ, w): Z [d, A·B] gathered from X, C = Z·Zᵀ */
static dopt_status outer(float *GG, const float *X, int ndim, const int64_t *shape, int i, float w, float *Z,
                         float *C, const dopt_par *par) {
  size_t A, d, B;
  around(ndim, shape, i, &A, &d, &B);
  for (size_t a = 0; a < A; a++)
    for (size_t r = 0; r < d; r++) memcpy(Z + r * A * B + a * B, X + (a * d + r) * B, B * sizeof *Z);
  DOPT_TRY(dopt_gemm_ex(d, d, A * B, Z, NULL, C, DOPT_GEMM_AAT, par));
  for (size_t k = 0; k < d * d; k++) GG[k] = dopt_lerp_elem(GG[k], C[k], w);
  return DOPT_OK;
}

/* The sign convention: each column's largest-magnitude component positive (ties: the lowest index). */
static void fix_signs(float *Q, size_t d) {
  for (size_t c = 0; c < d; c++) {
    size_t best = 0;
    for (size_t r = 1; r < d; r++)
      if (fabsf(Q[r * d + c]) > fabsf(Q[best * d + c])) best = r;
    if (Q[best * d + c] < 0)
      for (size_t r = 0; r < d; r++) Q[r * d + c] = -Q[r * d + c];
  }
}

/* Q ← the eigenvectors of GG + 1e−30·I, eigenvalues descending (upstream: torch.linalg.eigh, then flipped;
 * in float64 when the float32 one fails). w: d floats (the eigenvalues), wd: d·d + d doubles. */
static dopt_status eigh(const float *GG, size_t d, float *Q, float *w, double *wd, int *fp64) {
  float *a = Q;
  for (size_t k = 0; k < d * d; k++) a[k] = GG[k];
  for (size_t k = 0; k < d; k++) a[k * d + k] = a[k * d + k] + 1e-30f;
  /* the workspace sized here, not by LAPACK's query: ssyevd returns its size as a float, which rounds 1 + 6d + 2d²
   * down past 2^24 (d = 4096: 33 579 009, the call then refuses it as illegal and xerbla prints) */
  const size_t lw = 1 + 6 * d + 2 * d * d, liw = 3 + 5 * d;
  if (lw > 2147483647u)
    return dopt__fail(DOPT_ERR_UNSUPPORTED, "soap: a [%zu, %zu] preconditioner's eigendecomposition needs %zu floats "
                      "of workspace, past LAPACK's 32-bit sizes (max_precondition_dim <= 32766)", d, d, lw);
  float *work = malloc(lw * sizeof *work);
  lapack_int *iwork = malloc(liw * sizeof *iwork);
  if (!work || !iwork) {
    free(work), free(iwork);
    return dopt__fail(DOPT_ERR_NO_MEMORY, "soap: the eigendecomposition's workspace for a [%zu, %zu] preconditioner", d, d);
  }
  const int th = dopt_blas_pin();
  lapack_int info = LAPACKE_ssyevd_work(LAPACK_ROW_MAJOR, 'V', 'U', (lapack_int)d, a, (lapack_int)d, w, work,
                                        (lapack_int)lw, iwork, (lapack_int)liw);
  free(work), free(iwork);
  int ok = info == 0;
  for (size_t k = 0; ok && k < d * d; k++) ok = isfinite(a[k]);
  *fp64 = !ok;
  if (!ok) { /* upstream's fallback: float64 */
    double *ad = wd, *wv = wd + d * d;
    for (size_t k = 0; k < d * d; k++) ad[k] = (double)GG[k];
    for (size_t k = 0; k < d; k++) ad[k * d + k] += 1e-30;
    info = LAPACKE_dsyevd(LAPACK_ROW_MAJOR, 'V', 'U', (lapack_int)d, ad, (lapack_int)d, wv);
    ok = info == 0;
    for (size_t k = 0; ok && k < d * d; k++) ok = isfinite(ad[k]), a[k] = (float)ad[k];
  }
  dopt_blas_unpin(th);
  if (!ok) return dopt__fail(DOPT_ERR_NUMERIC, "soap: the eigendecomposition of a [%zu, %zu] preconditioner failed", d, d);
  /* ascending → descending: reverse the columns */
  for (size_t r = 0; r < d; r++)
    for (size_t c = 0; c < d / 2; c++) {
      const float t = a[r * d + c];
      a[r * d + c] = a[r * d + d - 1 - c], a[r * d + d - 1 - c] = t;
    }
  fix_signs(Q, d);
  return DOPT_OK;
}

_Thread_local int dopt__soap_unpermuted;

/* One power iteration of dimension i (upstream's get_orthogonal_matrix_qr): P = GG·Q, est_k = Σ_j Q[j,k]·P[j,k],
 * columns sorted by est descending (ties: lower index first), v permuted along dimension i with them, Q ← QR(P).
 * ws: 3·d·d + d floats + d size_t's of room (sized by the caller), tmp: numel floats. */
static dopt_status refresh(const float *GG, float *Q, float *v, int ndim, const int64_t *shape, int i, float *ws,
                           size_t *idx, float *tmp, const dopt_par *par) {
  size_t A, d, B;
  around(ndim, shape, i, &A, &d, &B);
  float *P = ws, *S = ws + d * d, *col = ws + 2 * d * d, *est = ws + 3 * d * d, *tau = tmp;
  DOPT_TRY(dopt_gemm_nn(d, d, d, GG, Q, P, par));
  for (size_t k = 0; k < d; k++) {
    for (size_t j = 0; j < d; j++) col[j] = Q[j * d + k] * P[j * d + k];
    est[k] = (float)dopt_xsum(col, d);
    idx[k] = k;
  }
  for (size_t k = 1; k < d; k++) { /* stable insertion sort, descending */
    const size_t x = idx[k];
    size_t j = k;
    while (j > 0 && est[idx[j - 1]] < est[x]) idx[j] = idx[j - 1], j--;
    idx[j] = x;
  }
  for (size_t r = 0; r < d; r++)
    for (size_t k = 0; k < d; k++) S[r * d + k] = P[r * d + idx[k]];
  /* v along dimension i: v'[a, k, b] = v[a, idx[k], b] */
  for (size_t a = 0; a < A; a++)
    for (size_t k = 0; k < d; k++) memcpy(tmp + d + (a * d + k) * B, v + (a * d + idx[k]) * B, B * sizeof *v);
  if (!dopt__soap_unpermuted) memcpy(v, tmp + d, A * d * B * sizeof *v);
  const int th = dopt_blas_pin();
  lapack_int info = LAPACKE_sgeqrf(LAPACK_ROW_MAJOR, (lapack_int)d, (lapack_int)d, S, (lapack_int)d, tau);
  if (info == 0) info = LAPACKE_sorgqr(LAPACK_ROW_MAJOR, (lapack_int)d, (lapack_int)d, (lapack_int)d, S, (lapack_int)d, tau);
  dopt_blas_unpin(th);
  if (info != 0) return dopt__fail(DOPT_ERR_NUMERIC, "soap: the QR of a [%zu, %zu] power iteration failed (LAPACK info %d)", d, d, (int)info);
  memcpy(Q, S, d * d * sizeof *Q);
  return DOPT_OK;
}

/* −step_size as fp32 for update s (>= 1) */
static float neg_step(const double *hp, int64_t s) {
  double ss = hp[LR];
  if (hp[CORRECT_BIAS] != 0.0) ss *= sqrt(1.0 - pow(hp[BETA2], (double)s)) / (1.0 - pow(hp[BETA1], (double)s));
  return (float)(-ss);
}

/* The elementwise step of a parameter without preconditioners (Adam, upstream's identity projections), any piece. */
static void plain(const dopt_step_args *a) {
  if (a->step < 2) return;
  const double *hp = a->hp;
  const float w1 = (float)(1.0 - hp[BETA1]), w2 = (float)(1.0 - hp[BETA2]), eps = (float)hp[EPS];
  const float ns = neg_step(hp, a->step - 1), keep = (float)(1.0 - hp[WD] * hp[LR]);
  const int decay = hp[WD] != 0.0;
  float *p = a->param, *m = a->state[0], *v = a->state[1];
  for (size_t k = 0; k < a->piece->len; k++) {
    const float g = a->grad[k];
    m[k] = dopt_lerp_elem(m[k], g, w1);
    v[k] = dopt_lerp_elem(v[k], g * g, w2);
    const float pk = p[k] + ns * (m[k] / (sqrtf(v[k]) + eps));
    p[k] = decay ? pk * keep : pk;
  }
}

static dopt_status step(const dopt_step_args *a) {
  const double *hp = a->hp;
  int64_t view[3];
  int ndim, pre[DOPT_MAX_DIMS];
  const int64_t *shape = dopt_step_shape(a, view, &ndim);
  if (!whole(hp, ndim, shape)) {
    plain(a);
    return DOPT_OK;
  }
  if (a->piece->len != a->piece->numel)
    return dopt__fail(DOPT_ERR_UNSUPPORTED, "soap: a preconditioned parameter needs the whole tensor (got %zu of %zu "
                      "elements)", a->piece->len, a->piece->numel);
  preconditioned(hp, ndim, shape, pre);
  const size_t numel = a->piece->numel;
  size_t dmax = 1;
  for (int i = 0; i < ndim; i++)
    if (pre[i] && (size_t)shape[i] > dmax) dmax = (size_t)shape[i];
  void *GGs[DOPT_MAX_DIMS] = {0}, *Qs[DOPT_MAX_DIMS] = {0};
  for (int i = 0, s = 2; i < ndim; i++)
    if (pre[i]) GGs[i] = a->state[s++], Qs[i] = a->state[s++];
  const size_t big = numel + dmax, sq = dmax * dmax;
  float *X = malloc(numel * sizeof *X), *tmp = malloc(big * sizeof *tmp), *ws = malloc((3 * sq + dmax) * sizeof *ws);
  float *C = malloc(sq * sizeof *C);
  double *wd = malloc((sq + dmax) * sizeof *wd);
  size_t *idx = malloc(dmax * sizeof *idx);
  dopt_status st = DOPT_OK;
  if (!X || !tmp || !ws || !C || !wd || !idx) {
    st = dopt__fail(DOPT_ERR_NO_MEMORY, "soap: buffers for a parameter of %zu elements", numel);
    goto done;
  }
  const float wgg = (float)(1.0 - (isnan(hp[SHAMPOO_BETA]) ? hp[BETA2] : hp[SHAMPOO_BETA]));
  float *p = a->param, *m = a->state[0], *v = a->state[1];
  const float *g = a->grad;
  const int64_t s = a->step - 1; /* the update's number (upstream's step - 1), and the refresh clock */
  if (a->step >= 2) {
    const float w1 = (float)(1.0 - hp[BETA1]), w2 = (float)(1.0 - hp[BETA2]), eps = (float)hp[EPS];
    memcpy(X, g, numel * sizeof *X); /* G' = project(G) */
    if ((st = project(X, ndim, shape, pre, Qs, 0, tmp, ws, a->par)) != DOPT_OK) goto done;
    for (size_t k = 0; k < numel; k++) {
      m[k] = dopt_lerp_elem(m[k], g[k], w1);
      v[k] = dopt_lerp_elem(v[k], X[k] * X[k], w2);
    }
    memcpy(X, m, numel * sizeof *X); /* N = project_back(project(m) / (√v + eps)) */
    if ((st = project(X, ndim, shape, pre, Qs, 0, tmp, ws, a->par)) != DOPT_OK) goto done;
    for (size_t k = 0; k < numel; k++) X[k] = X[k] / (sqrtf(v[k]) + eps);
    if ((st = project(X, ndim, shape, pre, Qs, 1, tmp, ws, a->par)) != DOPT_OK) goto done;
    if (hp[NORMALIZE] != 0.0) { /* ÷ (√mean(N²) + eps) */
      const float rms = sqrtf((float)(dopt_sumsq(X, numel) / (double)numel)) + eps;
      for (size_t k = 0; k < numel; k++) X[k] = X[k] / rms;
    }
    const float ns = neg_step(hp, s), keep = (float)(1.0 - hp[WD] * hp[LR]);
    const int decay = hp[WD] != 0.0;
    for (size_t k = 0; k < numel; k++) {
      const float pk = p[k] + ns * X[k];
      p[k] = decay ? pk * keep : pk;
    }
  }
  /* the preconditioners, then the bases: the first by eigendecomposition, later ones by power iteration */
  for (int i = 0; i < ndim; i++)
    if (pre[i] && (st = outer(GGs[i], g, ndim, shape, i, wgg, X, C, a->par)) != DOPT_OK) goto done;
  for (int i = 0; i < ndim; i++) {
    if (!pre[i]) continue;
    const size_t d = (size_t)shape[i];
    if (a->step == 1) {
      int fp64 = 0;
      if ((st = eigh(GGs[i], d, Qs[i], ws, wd, &fp64)) != DOPT_OK) goto done;
      dopt_count(a, DOPT_COUNTER_EIGH, 1);
      if (fp64) dopt_count(a, DOPT_COUNTER_EIGH_FP64, 1);
    } else if (s % (int64_t)hp[FREQ] == 0) {
      if ((st = refresh(GGs[i], Qs[i], v, ndim, shape, i, ws, idx, tmp, a->par)) != DOPT_OK) goto done;
      dopt_count(a, DOPT_COUNTER_QR, 1);
    }
  }
done:
  free(X);
  free(tmp);
  free(ws);
  free(C);
  free(wd);
  free(idx);
  return st;
}

/* ---- upstream's bases, checked before they are adopted (test_golden, distopt verify) ------------------------ */

/* The extreme eigenvalues of a symmetric n x n matrix G (double, destroyed): cyclic Jacobi rotations until the
 * off-diagonal is below 1e-15 of the diagonal's scale. */
static void sym_extremes(double *G, size_t n, double *lo, double *hi) {
  for (int sweep = 0; sweep < 100; sweep++) {
    double off = 0, dia = 0;
    for (size_t p = 0; p < n; p++)
      for (size_t q = 0; q < n; q++) {
        if (p == q) dia += G[p * n + q] * G[p * n + q];
        else off += G[p * n + q] * G[p * n + q];
      }
    if (off <= 1e-30 * dia) break;
    for (size_t p = 0; p < n; p++)
      for (size_t q = p + 1; q < n; q++) {
        if (G[p * n + q] == 0) continue;
        const double th = (G[q * n + q] - G[p * n + p]) / (2 * G[p * n + q]);
        const double t = (th >= 0 ? 1 : -1) / (fabs(th) + sqrt(th * th + 1)), c = 1 / sqrt(t * t + 1), sn = t * c;
        for (size_t k = 0; k < n; k++) { /* columns p, q */
          const double x = G[k * n + p], y = G[k * n + q];
          G[k * n + p] = c * x - sn * y, G[k * n + q] = sn * x + c * y;
        }
        for (size_t k = 0; k < n; k++) { /* rows p, q */
          const double x = G[p * n + k], y = G[q * n + k];
          G[p * n + k] = c * x - sn * y, G[q * n + k] = sn * x + c * y;
        }
      }
  }
  *lo = INFINITY, *hi = -INFINITY;
  for (size_t p = 0; p < n; p++) *lo = fmin(*lo, G[p * n + p]), *hi = fmax(*hi, G[p * n + p]);
}

int dopt__soap_basis_check(size_t d, const float *A, const float *prev, const float *theirs, const float *ours,
                           double *worst, char *why, size_t cap) {
  const double u = 0x1p-24;
  double fro = 0, orth = 0, off = 0, rise = 0, last = INFINITY;
  double *lam = malloc(d * sizeof *lam), *P = malloc(d * d * sizeof *P), *G = malloc(d * d * sizeof *G);
  size_t *ord = malloc(d * sizeof *ord);
  int rc = 0;
  *worst = 0;
  if (!lam || !P || !G || !ord) {
    snprintf(why, cap, "no memory for a [%zu, %zu] basis check", d, d);
    rc = -1;
    goto done;
  }
  for (size_t k = 0; k < d * d; k++) fro += (double)A[k] * (double)A[k];
  fro = sqrt(fro);
  const float *B = prev ? prev : theirs; /* whose QᵀAQ: the new basis, or the one the refresh started from */
  for (size_t a = 0; a < d; a++)
    for (size_t b = 0; b < d; b++) {
      double qq = 0, qaq = 0;
      for (size_t r = 0; r < d; r++) {
        qq += (double)theirs[r * d + a] * (double)theirs[r * d + b];
        double aq = 0;
        for (size_t c = 0; c < d; c++) aq += (double)A[r * d + c] * (double)B[c * d + b];
        qaq += (double)B[r * d + a] * aq;
      }
      orth = fmax(orth, fabs(qq - (a == b ? 1.0 : 0.0)));
      if (a != b) off = fmax(off, fabs(qaq));
      else rise = fmax(rise, qaq - last), last = qaq, lam[a] = qaq;
    }
  const double bo = (2.0 * (double)d + 4.0) * u;
  *worst = orth / bo;
  if (!(orth <= bo)) {
    snprintf(why, cap, "not orthonormal: max|QᵀQ - I| %.3g, beyond %.3g", orth, bo);
    rc = -1;
    goto done;
  }
  if (!prev) {
    const double be = (2.0 * (double)d + 4.0) * u * fro;
    *worst = fmax(*worst, fmax(off, rise) / be);
    if (!(off <= be) || !(rise <= be)) {
      snprintf(why, cap, "not an eigenbasis of the preconditioner in descending order (off-diagonal %.3g, order %.3g, "
               "beyond %.3g)", off, rise, be);
      rc = -1;
    }
    goto done;
  }
  for (size_t k = 0; k < d; k++) ord[k] = k;
  for (size_t a = 1; a < d; a++) { /* stable, descending: the refresh's order */
    const size_t x = ord[a];
    size_t j = a;
    while (j > 0 && lam[ord[j - 1]] < lam[x]) ord[j] = ord[j - 1], j--;
    ord[j] = x;
  }
  for (size_t r = 0; r < d; r++)
    for (size_t k = 0; k < d; k++) {
      double x = 0;
      for (size_t c = 0; c < d; c++) x += (double)A[r * d + c] * (double)prev[c * d + ord[k]];
      P[r * d + k] = x;
    }
  for (size_t k = 0; k < d; k++) {
    const size_t n = k + 1;
    for (size_t a = 0; a < n; a++)
      for (size_t b = 0; b < n; b++) {
        double x = 0;
        for (size_t r = 0; r < d; r++) x += P[r * d + a] * P[r * d + b];
        G[a * n + b] = x;
      }
    double lo, hi;
    sym_extremes(G, n, &lo, &hi);
    const double kappa = lo > 0 ? sqrt(hi / lo) : INFINITY;
    double e = 0;
    for (size_t r = 0; r < d; r++)
      e += ((double)theirs[r * d + k] - ours[r * d + k]) * ((double)theirs[r * d + k] - ours[r * d + k]);
    const double bk = sqrt(2.0) * (4.0 * (double)d + 8.0) * u * kappa;
    if (bk < INFINITY) *worst = fmax(*worst, sqrt(e) / bk);
    if (!(sqrt(e) <= bk)) {
      snprintf(why, cap, "column %zu is %.3g from ours, beyond %.3g (kappa %.3g)", k, sqrt(e), bk, kappa);
      rc = -1;
      goto done;
    }
  }
done:
  free(lam), free(P), free(G), free(ord);
  return rc;
}

/* settings that exercise every path (dopt_optim_impl.example/grid): QR refreshes inside 100 steps, a dimension
 * above max_precondition_dim (identity), preconditioned vectors, the normalised update, shampoo_beta apart; every
 * one caps the preconditioners at 64 (the test models' 4096-wide tensors would take a 4096 x 4096 eigendecomposition
 * and d³ products a refresh: seconds each) */
static const char *const grid[] = {
    "lr=1e-2,precondition_frequency=4,weight_decay=0.05,max_precondition_dim=64",
    "lr=1e-2,precondition_frequency=3,max_precondition_dim=8,precondition_1d=true,shampoo_beta=0.9",
    "lr=1e-2,precondition_frequency=5,normalize_gradient=true,correct_bias=false,weight_decay=0,max_precondition_dim=64",
    NULL,
};

const dopt_optim_impl dopt_impl_soap = {
    .name = "soap",
    .summary = "SOAP as pytorch-optimizer 4.1.0 (Adam in the eigenbases of Shampoo's preconditioners, QR refreshes)",
    .hp = hps,
    .nhp = NHP,
    .validate = validate,
    .layout = layout,
    .step = step,
    .distributable = 0,
    .whole = whole,
    .cost = cost,
    .example = "lr=1e-2,precondition_frequency=2,max_precondition_dim=64",
    .grid = grid,
};
