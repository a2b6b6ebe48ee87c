/* dopt_dpsum_bench: the exact data-parallel gradient sum (distopt/dpsum.h)
 * against the fp32 sum it replaces (docs/dp-sum.md).
 *
 * Table 1 (measured here, one thread): the whole-tensor sum of P rank
 * gradients of N fp32 elements — fp32 in rank order vs the exact sum with 1
 * and 2 int64 words (block codes, encode, integer add, decode: what the
 * ranks and the reduction do together, on one core), with the portable
 * kernels and with the AVX2 and AVX-512 ones (core/grid_avx2.c,
 * core/grid_avx512.c; "-" where the CPU lacks them), interleaved run by run —
 * median of REPS runs, ns per element and the ratio to the fp32 sum of the
 * same run.
 *
 * Table 2 (α–β model): bytes each rank sends per gradient element for an
 * all-reduce over n ranks (ring: 2(n−1)/n · bytes per element) and the
 * projected communication of one step's gradient sum of a model with
 * PARAMS parameters: fp32 ring all-reduce (what torch DDP does; not
 * bitwise), exact 1 and 2 words (ring all-reduce of int64 words + the
 * block-code MAX: one int32 per 256 elements), and the exchange the NCCL
 * transport used for rank-order fp32 sums before (all-gather of every
 * rank's gradient: (n−1) · 4 bytes per element).
 *
 *   dopt_dpsum_bench [N] [PARAMS] [ALPHA_US] [BETA_GBPS] */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "distopt/dpsum.h"
#include "grid.h"

#define REPS 7

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp_d(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static double uniform(void) {
  rng ^= rng << 13;
  rng ^= rng >> 7;
  rng ^= rng << 17;
  return (double)(rng >> 11) * 0x1p-53;
}

enum { NSETS = 3 }; /* portable, AVX2, AVX-512 */

/* the medians of REPS interleaved runs of the fp32 sum and the exact sums
 * with each kernel set (med[0] fp32, med[1 + 2s + w − 1] set s with w words;
 * a set that is NULL is not run) */
static void median_sums(const float *const *parts, int p, size_t n, float *out, const dopt__grid_kern *const *kn,
                        double *med) {
  double t[1 + 2 * NSETS][REPS];
  for (int r = 0; r < REPS; r++) {
    for (int c = 0; c < 1 + 2 * NSETS; c++) {
      if (c > 0 && !kn[(c - 1) / 2]) continue;
      double t0 = now_s();
      dopt_status st = c == 0 ? dopt_dp_sum(parts, p, DOPT_DP_SUM_RANK_ORDER, n, out)
                              : dopt__dp_sum_k(kn[(c - 1) / 2], parts, p, 1 + (c - 1) % 2, n, out);
      if (st != DOPT_OK) {
        fprintf(stderr, "dopt_dp_sum failed\n");
        exit(1);
      }
      t[c][r] = now_s() - t0;
    }
  }
  for (int c = 0; c < 1 + 2 * NSETS; c++) {
    if (c > 0 && !kn[(c - 1) / 2]) continue;
    qsort(t[c], REPS, sizeof t[c][0], cmp_d);
    med[c] = t[c][REPS / 2];
  }
}

int main(int argc, char **argv) {
  size_t n = argc > 1 ? (size_t)strtoull(argv[1], NULL, 10) : (size_t)1 << 22;
  double params = argc > 2 ? strtod(argv[2], NULL) : 7e9;
  double alpha = (argc > 3 ? strtod(argv[3], NULL) : 5.0) * 1e-6;
  double beta = (argc > 4 ? strtod(argv[4], NULL) : 25.0) * 1e9;
  if (n == 0 || !(params > 0) || !(alpha >= 0) || !(beta > 0)) {
    fprintf(stderr, "usage: dopt_dpsum_bench [N>0] [PARAMS] [ALPHA_US] [BETA_GBPS]\n");
    return 2;
  }
  enum { PMAX = 8 };
  float *x = malloc((size_t)PMAX * n * sizeof *x), *out = malloc(n * sizeof *out);
  if (!x || !out) return 1;
  for (size_t i = 0; i < (size_t)PMAX * n; i++) /* gradients: normal-ish, 4 decades of magnitude */
    x[i] = (float)((uniform() - 0.5) * pow(10.0, 4.0 * uniform() - 4.0));
  const float *parts[PMAX];
  for (int d = 0; d < PMAX; d++) parts[d] = x + (size_t)d * n;

  const dopt__grid_kern *kn[NSETS] = {dopt__grid_kernels(DOPT_GRID_IMPL_PORTABLE),
                                      dopt__grid_kernels(DOPT_GRID_IMPL_AVX2), dopt__grid_kernels(DOPT_GRID_IMPL_AVX512)};
  static const char *const names[NSETS] = {"portable", "avx2", "avx512"};
  printf("Table 1: sum of P gradients of N = %zu fp32 elements, one thread, median of %d (interleaved runs)\n", n, REPS);
  printf("%3s | %8s", "P", "fp32 ns");
  for (int w = 1; w <= 2; w++)
    for (int k = 0; k < NSETS; k++) printf(" | exact%d %-9s", w, names[k]);
  printf("\n");
  for (int p = 2; p <= PMAX; p *= 2) {
    double med[1 + 2 * NSETS];
    median_sums(parts, p, n, out, kn, med);
    const double k = 1e9 / (double)n;
    printf("%3d | %8.2f", p, med[0] * k);
    for (int w = 1; w <= 2; w++) /* words 1 then 2; each kernel set */
      for (int ks = 0; ks < NSETS; ks++) {
        const int c = 1 + 2 * ks + w - 1;
        if (!kn[ks]) printf(" | %16s", "-");
        else printf(" | %8.2f %6.2fx", med[c] * k, med[c] / med[0]);
      }
    printf("\n");
  }

  printf("\nTable 2: gradient sum per step, alpha-beta model (alpha %.1f us, beta %.1f GB/s per rank), %.3g parameters\n",
         alpha * 1e6, beta * 1e-9, params);
  printf("bytes sent per rank per gradient element (all-reduce, ring):\n");
  printf("%6s | %10s | %10s %6s | %10s %6s | %14s %7s\n", "ranks", "fp32 ring", "exact1", "ratio", "exact2", "ratio",
         "old exchange", "ratio");
  const double codes = 4.0 / DOPT_GRID_BLOCK; /* one int32 per block, MAX all-reduce */
  static const int N[] = {8, 64, 1024};
  for (int i = 0; i < 3; i++) {
    double r = 2.0 * (N[i] - 1) / N[i];
    double f = r * 4, e1 = r * (8 + codes), e2 = r * (16 + codes), ex = (N[i] - 1) * 4.0;
    printf("%6d | %10.3f | %10.3f %5.2fx | %10.3f %5.2fx | %14.1f %6.0fx\n", N[i], f, e1, e1 / f, e2, e2 / f, ex,
           ex / f);
  }
  printf("projected seconds per step (one all-reduce of the whole gradient; bucketed, 2(n-1) latency terms each):\n");
  printf("%6s | %10s | %10s | %10s | %12s\n", "ranks", "fp32 ring", "exact1", "exact2", "old exchange");
  for (int i = 0; i < 3; i++) {
    double r = 2.0 * (N[i] - 1) / N[i], lat = 2.0 * (N[i] - 1) * alpha;
    double f = lat + r * 4 * params / beta;
    double e1 = 2 * lat + r * (8 + codes) * params / beta, e2 = 2 * lat + r * (16 + codes) * params / beta;
    double ex = (N[i] - 1) * alpha + (N[i] - 1) * 4.0 * params / beta;
    printf("%6d | %10.3f | %10.3f | %10.3f | %12.2f\n", N[i], f, e1, e2, ex);
  }
  free(x);
  free(out);
  return 0;
}
