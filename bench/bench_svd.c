/* dopt_svd_bench: exact (LAPACK sgesdd) vs randomized (seeded range finder)
 * top-r SVD of gradients with a decaying spectrum, and galore_adamw step
 * times. Not a test; numbers go into docs/galore.md.
 *
 *   dopt_svd_bench [--size N] [--ranks 128,512] [--reps 3] [--oversample -1] [--power-iters 4]
 *
 * Gradient: G = X·diag(σ)·Yᵀ + noise, σ_i = i^-1.5 (i = 1..N/2), X, Y
 * Gaussian with unit-norm columns in expectation, noise 1e-6·N(0,1). The
 * subspace error is sin θ of the largest principal angle between the exact
 * and randomized top-r left singular subspaces (from the smallest singular
 * value of U_exactᵀ·U_rand). The library pins OpenBLAS to one thread, so all
 * timings are single-threaded. */
#include <cblas.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "distopt/distopt.h"
#include "galore_proj.h"

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmpd(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}
static double median(double *v, int n) {
  qsort(v, (size_t)n, sizeof *v, cmpd);
  return v[n / 2];
}

static void fill(float *x, size_t n, uint64_t seed, float scale) {
  for (size_t i = 0; i < n; i++) x[i] = dopt_galore_gauss(seed, 0, i) * scale;
}

static double sin_theta(const float *A, const float *B, size_t m, size_t r) {
  float *M = malloc(r * r * sizeof *M), *s = malloc(r * sizeof *s);
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)r, (int)r, (int)m, 1.0f, A, (int)r, B, (int)r, 0.0f, M,
              (int)r);
  dopt_svd_opts ex = {DOPT_SVD_EXACT, 0, 0, 0, 0};
  double c = 0;
  if (dopt_galore_svd(r, r, r, M, &ex, 1, NULL, s, NULL, NULL) == DOPT_OK) c = s[r - 1] < 1 ? s[r - 1] : 1;
  free(M), free(s);
  return sqrt(1 - c * c);
}

/* median step times of galore_adamw at rank r: refresh and non-refresh steps */
static void step_times(const float *g, size_t n, int r, const char *svd, int reps, double *refresh, double *plain) {
  char hp[160];
  snprintf(hp, sizeof hp, "rank=%d,update_proj_gap=2,svd=%s,scale=0.25", r, svd);
  dopt_optim *o;
  if (dopt_optim_create("galore_adamw", hp, &o) != DOPT_OK) exit(1);
  float *w = malloc(n * n * sizeof *w);
  fill(w, n * n, 99, 0.02f);
  dopt_param_config pc = DOPT_PARAM_CONFIG_INIT;
  pc.name = "w", pc.ndim = 2, pc.shape[0] = (int64_t)n, pc.shape[1] = (int64_t)n, pc.data = w;
  dopt_optim_add_param(o, 0, &pc, NULL);
  const float *gp[1] = {g};
  double tr[16], tp[16];
  for (int k = 0; k < reps; k++) {
    double t0 = now();
    if (dopt_optim_step(o, gp) != DOPT_OK) exit(1); /* odd step: iter even → refresh */
    double t1 = now();
    if (dopt_optim_step(o, gp) != DOPT_OK) exit(1);
    tr[k] = t1 - t0;
    tp[k] = now() - t1;
  }
  *refresh = median(tr, reps);
  *plain = median(tp, reps);
  dopt_optim_destroy(o);
  free(w);
}

int main(int argc, char **argv) {
  size_t n = 4096;
  int ranks[8] = {128, 512}, nr = 2, reps = 3, over = -1, piters = 4;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--size") && i + 1 < argc) n = (size_t)atol(argv[++i]);
    else if (!strcmp(argv[i], "--reps") && i + 1 < argc) reps = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--oversample") && i + 1 < argc) over = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--power-iters") && i + 1 < argc) piters = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--ranks") && i + 1 < argc) {
      nr = 0;
      for (char *t = strtok(argv[++i], ","); t && nr < 8; t = strtok(NULL, ",")) ranks[nr++] = atoi(t);
    } else {
      fprintf(stderr, "usage: %s [--size N] [--ranks 128,512] [--reps 3] [--oversample -1] [--power-iters 4]\n",
              argv[0]);
      return 2;
    }
  }
  if (reps < 1 || reps > 15 || n < 16) return 2;
  size_t K = n / 2;
  float *X = malloc(n * K * sizeof *X), *Y = malloc(n * K * sizeof *Y), *g = malloc(n * n * sizeof *g);
  fill(X, n * K, 1, (float)(1.0 / sqrt((double)n)));
  fill(Y, n * K, 2, (float)(1.0 / sqrt((double)n)));
  for (size_t j = 0; j < K; j++) {
    float sj = (float)pow((double)j + 1, -1.5);
    for (size_t i = 0; i < n; i++) X[i * K + j] *= sj;
  }
  fill(g, n * n, 3, 1e-6f);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)n, (int)n, (int)K, 1.0f, X, (int)K, Y, (int)K, 1.0f, g,
              (int)n);
  free(X), free(Y);
  printf("dopt_svd_bench: %zux%zu fp32, sigma_i = i^-1.5 + 1e-6 noise, oversample %d, power iters %d, median of %d, "
         "1 BLAS thread\n", n, n, over, piters, reps);
  printf("%6s %10s %10s %8s %8s %14s %14s %14s\n", "rank", "exact s", "rand s", "speedup", "sin th", "step exact s",
         "step rand s", "step norefr s");
  for (int k = 0; k < nr; k++) {
    size_t r = (size_t)ranks[k];
    float *U0 = malloc(n * r * sizeof *U0), *U1 = malloc(n * r * sizeof *U1);
    double te[16], tr[16];
    dopt_svd_opts ex = {DOPT_SVD_EXACT, 0, 0, 0, 0}, rs = {DOPT_SVD_RANDOMIZED, over, piters, 1, 0};
    for (int i = 0; i < reps; i++) {
      double t0 = now();
      if (dopt_galore_svd(n, n, r, g, &ex, 1, U0, NULL, NULL, NULL) != DOPT_OK) return 1;
      double t1 = now();
      if (dopt_galore_svd(n, n, r, g, &rs, 1, U1, NULL, NULL, NULL) != DOPT_OK) return 1;
      te[i] = t1 - t0;
      tr[i] = now() - t1;
    }
    double me = median(te, reps), mr = median(tr, reps), st = sin_theta(U0, U1, n, r);
    double se_ref, se_plain, sr_ref, sr_plain;
    step_times(g, n, (int)r, "exact", reps, &se_ref, &se_plain);
    step_times(g, n, (int)r, "randomized", reps, &sr_ref, &sr_plain);
    printf("%6zu %10.3f %10.3f %7.1fx %8.3g %14.3f %14.3f %14.3f\n", r, me, mr, me / mr, st, se_ref, sr_ref,
           0.5 * (se_plain + sr_plain));
    fflush(stdout);
    free(U0), free(U1);
  }
  free(g);
  return 0;
}
