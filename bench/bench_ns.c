/* dopt_ns_bench: Muon's Newton-Schulz iteration (ref/ns.c: bf16 arithmetic on our fixed k-order GEMM, the
 * same bits at any thread count) against OpenBLAS sgemm doing the same matrix products in fp32 (X·Xᵀ, (c·A)·A,
 * B·X per iteration, 5 iterations; no elementwise work), at 1 and 2 threads, on the same shapes. Prints a
 * table: median of 5 runs after 1 warm-up, GFLOP/s (2 flops per multiply-add), ratio to sgemm. A muon optimizer
 * step (momentum, iteration, scale, update) is timed too: what the reference and an owner rank spend.
 *
 *   dopt_ns_bench [--quick]     (--quick: the two smaller shapes) */
#include <cblas.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "distopt/distopt.h"
#include "ns.h"

void openblas_set_num_threads(int);

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static int cmp_d(const void *a, const void *b) {
  const double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

#define RUNS 5

static double median(double *t) {
  qsort(t, RUNS, sizeof *t, cmp_d);
  return t[RUNS / 2];
}

static void fill(float *x, size_t n, unsigned seed) {
  for (size_t i = 0; i < n; i++) {
    seed = seed * 1664525u + 1013904223u;
    x[i] = (float)((double)(seed >> 8) / 16777216.0 - 0.5);
  }
}

/* the iteration's products with sgemm: per step A = X·Xᵀ [r, r], C = A·A, T = B·X [r, c] */
static void sgemm_iteration(float *X, size_t r, size_t c, float *A, float *C, float *T, int steps) {
  for (int s = 0; s < steps; s++) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)r, (int)r, (int)c, 1.0f, X, (int)c, X, (int)c, 0.0f, A,
                (int)r);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)r, (int)r, (int)r, 1.0f, A, (int)r, A, (int)r, 0.0f, C,
                (int)r);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)r, (int)c, (int)r, 1.0f, C, (int)r, X, (int)c, 0.0f, T,
                (int)c);
  }
}

/* one muon step on a [h, w] parameter at `threads` (the iteration splits its GEMM rows over them) */
static double muon_step(size_t h, size_t w, int threads, float *p, const float *g) {
  dopt_optim *o = NULL;
  if (dopt_optim_create("muon", "lr=0.02", &o) != DOPT_OK) return -1;
  dopt_optim_set_threads(o, threads);
  dopt_param_config pc = DOPT_PARAM_CONFIG_INIT;
  pc.name = "w", pc.ndim = 2, pc.shape[0] = (int64_t)h, pc.shape[1] = (int64_t)w, pc.data = p;
  double t[RUNS];
  const float *gp[1] = {g};
  if (dopt_optim_add_param(o, 0, &pc, NULL) != DOPT_OK || dopt_optim_step(o, gp) != DOPT_OK) return -1;
  for (int k = 0; k < RUNS; k++) {
    double t0 = now();
    dopt_optim_step(o, gp);
    t[k] = now() - t0;
  }
  dopt_optim_destroy(o);
  return median(t);
}

int main(int argc, char **argv) {
  const int quick = argc > 1 && strcmp(argv[1], "--quick") == 0;
  static const size_t shapes[][2] = {{256, 1024}, {512, 512}, {512, 2048}, {1024, 1024}};
  const int nshapes = quick ? 2 : 4, steps = 5;
  printf("Newton-Schulz, %d iterations: distopt's bf16 iteration (fixed k-order GEMM) vs OpenBLAS sgemm on the\n"
         "same products in fp32; median of %d runs after 1 warm-up; GFLOP/s = 2 x multiply-adds of the products\n\n",
         steps, RUNS);
  printf("| shape | threads | distopt ms | distopt GFLOP/s | sgemm ms | sgemm GFLOP/s | distopt / sgemm time | "
         "muon step ms |\n|---|---:|---:|---:|---:|---:|---:|---:|\n");
  for (int si = 0; si < nshapes; si++) {
    const size_t h = shapes[si][0], w = shapes[si][1], r = h < w ? h : w, c = h < w ? w : h, n = h * w;
    const double flops = 2.0 * steps * (2.0 * (double)r * (double)r * (double)c + (double)r * (double)r * (double)r);
    float *x = malloc(n * sizeof *x), *g = malloc(n * sizeof *g), *p = malloc(n * sizeof *p);
    float *A = malloc(r * r * sizeof *A), *C = malloc(r * r * sizeof *C), *T = malloc(n * sizeof *T);
    if (!x || !g || !p || !A || !C || !T) return 1;
    fill(g, n, 7);
    for (int threads = 1; threads <= 2; threads++) {
      /* ours, through the optimizer's pool: the iteration alone is the step minus its elementwise passes, so
       * time the iteration on the pool with a muon step and a step of zero iterations */
      fill(p, n, 3);
      const double step = muon_step(h, w, threads, p, g);
      dopt_optim *o0 = NULL;
      double t0s[RUNS];
      dopt_optim_create("muon", "lr=0.02,ns_steps=0", &o0);
      dopt_optim_set_threads(o0, threads);
      dopt_param_config pc = DOPT_PARAM_CONFIG_INIT;
      pc.name = "w", pc.ndim = 2, pc.shape[0] = (int64_t)h, pc.shape[1] = (int64_t)w, pc.data = p;
      const float *gp[1] = {g};
      dopt_optim_add_param(o0, 0, &pc, NULL);
      dopt_optim_step(o0, gp);
      for (int k = 0; k < RUNS; k++) {
        double t0 = now();
        dopt_optim_step(o0, gp);
        t0s[k] = now() - t0;
      }
      dopt_optim_destroy(o0);
      const double ours = step - median(t0s);
      /* sgemm on the same products */
      openblas_set_num_threads(threads);
      fill(x, n, 5);
      double ts[RUNS];
      sgemm_iteration(x, r, c, A, C, T, steps);
      for (int k = 0; k < RUNS; k++) {
        double t0 = now();
        sgemm_iteration(x, r, c, A, C, T, steps);
        ts[k] = now() - t0;
      }
      const double sg = median(ts);
      printf("| [%zu, %zu] | %d | %.1f | %.2f | %.1f | %.2f | %.2fx | %.1f |\n", h, w, threads, ours * 1e3,
             flops / ours * 1e-9, sg * 1e3, flops / sg * 1e-9, ours / sg, step * 1e3);
    }
    free(x), free(g), free(p), free(A), free(C), free(T);
  }
  printf("\ndistopt's kernel: each output element one fmaf chain in k order (exact bf16 products), row blocks split over\n"
         "threads; sgemm: OpenBLAS's blocked fp32 kernel with FMAs (the order and the bits depend on the build and\n"
         "the thread count). The iteration's time is a muon step less a step with ns_steps=0 (the same elementwise\n"
         "passes and normalisation).\n");
  return 0;
}
