/* GaLore projector: plan, SVD (exact / randomized), sign convention,
 * projection GEMMs. Semantics in ref/galore_proj.h and docs/galore.md. */
#include "galore_proj.h"
#include "ctr_rng.h"

#include <cblas.h>
#include <lapacke.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <pthread.h>

#include "distopt/optim.h"
#include "internal.h"

/* ---- OpenBLAS thread pinning ---------------------------------------------------
 * OpenBLAS' thread count is process-global: pin it to 1 around every call so a
 * result never depends on OPENBLAS_NUM_THREADS (a GEMM or a LAPACK driver may
 * split its work, and so its rounding, by thread count). The pinned region is
 * also a process-wide critical section: rank threads (the simulator, the
 * distributed owner steps) that project or decompose at once would otherwise
 * see each other's unpinning in the middle of a call. Code outside distopt
 * that changes the count concurrently is not covered (docs/galore.md). */
static pthread_mutex_t blas_mu = PTHREAD_MUTEX_INITIALIZER;
int dopt_blas_pin(void) {
  pthread_mutex_lock(&blas_mu);
  int t = openblas_get_num_threads();
  if (t != 1) openblas_set_num_threads(1);
  return t;
}
void dopt_blas_unpin(int t) {
  if (t != 1) openblas_set_num_threads(t);
  pthread_mutex_unlock(&blas_mu);
}

static int inject_failures = 0;
void dopt__galore_inject_svd_failures(int n) { inject_failures = n; }
static int injected(void) {
  if (inject_failures <= 0) return 0;
  inject_failures--;
  return 1;
}

void dopt_galore_plan_make(int proj_type, size_t m, size_t n, size_t rank, dopt_galore_plan *out) {
  memset(out, 0, sizeof *out);
  out->m = m;
  out->n = n;
  size_t mn = m < n ? m : n;
  out->r = rank < mn ? rank : mn;
  out->clamped = rank > mn;
  switch (proj_type) {
  case DOPT_PROJ_STD: out->right = m >= n; break;
  case DOPT_PROJ_REVERSE_STD: out->right = m < n; break;
  case DOPT_PROJ_RIGHT: out->right = 1; break;
  case DOPT_PROJ_LEFT: out->right = 0; break;
  default: out->right = 1; out->left = 1; break; /* full */
  }
  if (proj_type != DOPT_PROJ_FULL) out->left = !out->right;
  out->rows = out->left ? out->r : m;
  out->cols = out->right ? out->r : n;
}

/* ---- counter-based Gaussian ------------------------------------------------------ */

float dopt_galore_gauss(uint64_t seed, int64_t iter, uint64_t index) {
  return dopt_ctr_normal(dopt_ctr_mix64(dopt_ctr_mix64(dopt_ctr_mix64(seed) ^ (uint64_t)iter) ^ index));
}

/* ---- SVD ---------------------------------------------------------------------------- */

static int all_finite(const float *x, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (!isfinite(x[i])) return 0;
  return 1;
}

/* Thin SVD of a [m, n] row-major (destroyed): U [m, k] (ld k), s [k], Vt [k, n],
 * k = min(m, n). sgesdd, then sgesvd on a fresh copy of g0 if it fails.
 * Returns 0 on success. The caller has pinned the BLAS threads. */
static int thin_svd(size_t m, size_t n, const float *g0, float *a, float *U, float *s, float *Vt, unsigned *events) {
  size_t k = m < n ? m : n;
  lapack_int M = (lapack_int)m, Nn = (lapack_int)n, K = (lapack_int)k;
  memcpy(a, g0, m * n * sizeof *a);
  lapack_int info = injected() ? 1 : LAPACKE_sgesdd(LAPACK_ROW_MAJOR, 'S', M, Nn, a, Nn, s, U, K, Vt, Nn);
  if (info == 0 && all_finite(s, k) && all_finite(U, m * k) && all_finite(Vt, k * n)) return 0;
  if (events) *events |= DOPT_EVENT_SVD_FALLBACK;
  memcpy(a, g0, m * n * sizeof *a);
  float *superb = malloc((k > 1 ? k - 1 : 1) * sizeof *superb);
  if (!superb) return -1;
  info = injected() ? 1 : LAPACKE_sgesvd(LAPACK_ROW_MAJOR, 'S', 'S', M, Nn, a, Nn, s, U, K, Vt, Nn, superb);
  free(superb);
  if (info == 0 && all_finite(s, k) && all_finite(U, m * k) && all_finite(Vt, k * n)) return 0;
  return -1;
}

/* In-place orthonormal basis of the columns of Y [rows, k] (row-major). */
static int orthonormalise(size_t rows, size_t k, float *Y, float *tau) {
  lapack_int R = (lapack_int)rows, K = (lapack_int)k;
  if (LAPACKE_sgeqrf(LAPACK_ROW_MAJOR, R, K, Y, K, tau) != 0) return -1;
  if (LAPACKE_sorgqr(LAPACK_ROW_MAJOR, R, K, K, Y, K, tau) != 0) return -1;
  return all_finite(Y, rows * k) ? 0 : -1;
}

/* Randomized top-k SVD (Halko, Martinsson, Tropp): Q = orth(G·Ω), q power
 * iterations Q ← orth(G·orth(Gᵀ·Q)), then the thin SVD of Qᵀ·G [k, n]:
 * U = Q·Ũ [m, k], Vt [k, n]. Returns 0 on success. Caller pinned the threads. */
static int randomized_svd(size_t m, size_t n, size_t k, const float *g, const dopt_svd_opts *opt, float *U, float *s,
                          float *Vt, unsigned *events) {
  int rc = -1;
  size_t big = m > n ? m : n;
  float *om = malloc(n * k * sizeof *om), *Q = malloc(m * k * sizeof *Q), *Z = malloc(n * k * sizeof *Z);
  float *Bs = malloc(k * n * sizeof *Bs), *a = malloc(k * n * sizeof *a), *Ub = malloc(k * k * sizeof *Ub);
  float *tau = malloc(big * sizeof *tau);
  if (!om || !Q || !Z || !Bs || !a || !Ub || !tau) goto done;
  const int M = (int)m, N = (int)n, K = (int)k;
  for (size_t i = 0; i < n * k; i++) om[i] = dopt_galore_gauss(opt->seed, opt->iter, (uint64_t)i);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, M, K, N, 1.0f, g, N, om, K, 0.0f, Q, K); /* G·Ω */
  if (orthonormalise(m, k, Q, tau)) goto done;
  for (int it = 0; it < opt->power_iters; it++) {
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, N, K, M, 1.0f, g, N, Q, K, 0.0f, Z, K); /* Gᵀ·Q */
    if (orthonormalise(n, k, Z, tau)) goto done;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, M, K, N, 1.0f, g, N, Z, K, 0.0f, Q, K); /* G·Z */
    if (orthonormalise(m, k, Q, tau)) goto done;
  }
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, K, N, M, 1.0f, Q, K, g, N, 0.0f, Bs, N); /* Qᵀ·G */
  if (thin_svd(k, n, Bs, a, Ub, s, Vt, events)) goto done;
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, M, K, K, 1.0f, Q, K, Ub, K, 0.0f, U, K); /* Q·Ũ */
  rc = all_finite(U, m * k) ? 0 : -1;
done:
  free(om);
  free(Q);
  free(Z);
  free(Bs);
  free(a);
  free(Ub);
  free(tau);
  return rc;
}

/* Sign convention on the first r of k columns of U [m, k] / rows of Vt [k, n]. */
static void fix_signs(size_t m, size_t n, size_t k, size_t r, float *U, float *Vt, int on_left) {
  for (size_t j = 0; j < r; j++) {
    float best = -1.0f;
    int neg = 0;
    size_t len = on_left ? m : n;
    for (size_t i = 0; i < len; i++) {
      float x = on_left ? U[i * k + j] : Vt[j * n + i];
      if (fabsf(x) > best) { /* strict: ties keep the lowest index */
        best = fabsf(x);
        neg = x < 0.0f;
      }
    }
    if (!neg) continue;
    for (size_t i = 0; i < m; i++) U[i * k + j] = -U[i * k + j];
    for (size_t i = 0; i < n; i++) Vt[j * n + i] = -Vt[j * n + i];
  }
}

dopt_status dopt_galore_svd(size_t m, size_t n, size_t r, const float *g, const dopt_svd_opts *opt, int sign_on_left,
                            float *Uo, float *so, float *Vto, unsigned *events) {
  size_t mn = m < n ? m : n;
  if (r > mn) r = mn;
  size_t k = mn;
  int randomized = opt && opt->kind == DOPT_SVD_RANDOMIZED;
  if (randomized) {
    size_t p = opt->oversample < 0 ? r : (size_t)opt->oversample; /* -1: auto, p = r */
    k = r + p < mn ? r + p : mn;
    if (k == mn) randomized = 0; /* the range finder would span everything: exact is cheaper */
  }
  float *U = malloc(m * k * sizeof *U), *s = malloc(k * sizeof *s), *Vt = malloc(k * n * sizeof *Vt);
  float *a = randomized ? NULL : malloc(m * n * sizeof *a);
  if (!U || !s || !Vt || (!randomized && !a)) {
    free(U), free(s), free(Vt), free(a);
    return dopt__fail(DOPT_ERR_NO_MEMORY, "galore: SVD buffers for a [%zu, %zu] gradient", m, n);
  }
  int th = dopt_blas_pin();
  int rc = randomized ? randomized_svd(m, n, k, g, opt, U, s, Vt, events) : thin_svd(m, n, g, a, U, s, Vt, events);
  dopt_blas_unpin(th);
  if (rc == 0) {
    fix_signs(m, n, k, r, U, Vt, sign_on_left);
    for (size_t i = 0; Uo && i < m; i++) memcpy(Uo + i * r, U + i * k, r * sizeof *U);
    if (so) memcpy(so, s, r * sizeof *s);
    if (Vto) memcpy(Vto, Vt, r * n * sizeof *Vt);
  }
  free(U), free(s), free(Vt), free(a);
  if (rc != 0)
    return dopt__fail(DOPT_ERR_NUMERIC, "galore: %s SVD of a [%zu, %zu] gradient failed (sgesdd and sgesvd)",
                      randomized ? "randomized" : "exact", m, n);
  return DOPT_OK;
}

dopt_status dopt_galore_refresh(const dopt_galore_plan *p, const float *g, const dopt_svd_opts *opt, int have_prev,
                                float *A, float *B, unsigned *events) {
  float *Anew = p->left ? malloc(p->m * p->r * sizeof *Anew) : NULL;
  float *Bnew = p->right ? malloc(p->r * p->n * sizeof *Bnew) : NULL;
  if ((p->left && !Anew) || (p->right && !Bnew)) {
    free(Anew), free(Bnew);
    return dopt__fail(DOPT_ERR_NO_MEMORY, "galore: projector of a [%zu, %zu] gradient", p->m, p->n);
  }
  dopt_status s = dopt_galore_svd(p->m, p->n, p->r, g, opt, p->left, Anew, NULL, Bnew, events);
  if (s == DOPT_OK) {
    if (A) memcpy(A, Anew, p->m * p->r * sizeof *A);
    if (B) memcpy(B, Bnew, p->r * p->n * sizeof *B);
  }
  free(Anew), free(Bnew);
  if (s == DOPT_OK) return DOPT_OK;
  if (events) *events |= DOPT_EVENT_SVD_FAILED;
  if (have_prev) return DOPT_OK; /* keep the previous projector */
  return dopt__fail(DOPT_ERR_NUMERIC,
                    "galore: the first SVD of a [%zu, %zu] gradient failed (sgesdd and sgesvd; non-finite gradient?) "
                    "and there is no previous projector to keep",
                    p->m, p->n);
}

void dopt_galore_project(const dopt_galore_plan *p, const float *g, const float *A, const float *B, float *R,
                         float *ws) {
  const int M = (int)p->m, N = (int)p->n, r = (int)p->r;
  int th = dopt_blas_pin();
  if (p->left && p->right) { /* Aᵀ·G [r, n], then ·Bᵀ */
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, r, N, M, 1.0f, A, r, g, N, 0.0f, ws, N);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, r, r, N, 1.0f, ws, N, B, N, 0.0f, R, r);
  } else if (p->right) { /* G·Bᵀ [m, r] */
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, M, r, N, 1.0f, g, N, B, N, 0.0f, R, r);
  } else { /* Aᵀ·G [r, n] */
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, r, N, M, 1.0f, A, r, g, N, 0.0f, R, N);
  }
  dopt_blas_unpin(th);
}

void dopt_galore_project_back(const dopt_galore_plan *p, const float *Nl, const float *A, const float *B, float scale,
                              float *out, float *ws) {
  const int M = (int)p->m, N = (int)p->n, r = (int)p->r;
  int th = dopt_blas_pin();
  if (p->left && p->right) { /* (A·N) [m, r], then ·B */
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, M, r, r, 1.0f, A, r, Nl, r, 0.0f, ws, r);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, M, N, r, 1.0f, ws, r, B, N, 0.0f, out, N);
  } else if (p->right) { /* N·B */
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, M, N, r, 1.0f, Nl, r, B, N, 0.0f, out, N);
  } else { /* A·N */
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, M, N, r, 1.0f, A, r, Nl, N, 0.0f, out, N);
  }
  dopt_blas_unpin(th);
  for (size_t i = 0; i < p->m * p->n; i++) out[i] = out[i] * scale;
}

int dopt_galore_applies(double rank, int proj_type, int ndim, const int64_t *shape, dopt_galore_plan *pl) {
  if (rank <= 0 || ndim < 2) return 0;
  for (int i = 0; i < ndim - 2; i++)
    if (shape[i] != 1) return 0;
  dopt_galore_plan_make(proj_type, (size_t)shape[ndim - 2], (size_t)shape[ndim - 1], (size_t)rank, pl);
  return 1;
}

static int any_nonzero(const float *x, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (x[i] != 0.0f) return 1;
  return 0;
}

int dopt_galore_due(const dopt_galore_plan *p, int64_t step, int64_t gap, const float *A, const float *B,
                    int *have_prev) {
  int64_t iter = step - 1; /* upstream projects with the pre-increment step */
  *have_prev = A ? any_nonzero(A, p->m * p->r) : any_nonzero(B, p->r * p->n);
  return !*have_prev || iter % gap == 0;
}
