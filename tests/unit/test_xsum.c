/* Exact sums: the result is bitwise independent of element order and of how
 * the elements are partitioned (as ranks will partition them), combining
 * partial results only through MAX (absmax) and integer SUM (accumulators);
 * and it is accurate against a long-double oracle. */
#include "testutil.h"

#include <math.h>
#include <stdlib.h>

#include "distopt/xsum.h"

#define NMAX 5000

/* Data families: 0 normal, 1 huge dynamic range (1e-30..1e30), 2 non-negative
 * squares-like, 3 mostly zeros, 4 subnormals mixed with normals. */
static void fill(float *x, size_t n, int kind, uint64_t *rng) {
  for (size_t i = 0; i < n; i++) {
    double g = dt_rand_normal(rng);
    switch (kind) {
    case 0: x[i] = (float)g; break;
    case 1: x[i] = (float)(g * pow(10.0, 60.0 * dt_rand_uniform(rng) - 30.0)); break;
    case 2: x[i] = (float)(g * g * 1e-3 + 1e-30); break;
    case 3: x[i] = dt_rand_uniform(rng) < 0.9 ? 0.0f : (float)g; break;
    default: x[i] = dt_rand_uniform(rng) < 0.5 ? (float)(g * 1e-40) : (float)(g * 1e-30); break;
    }
  }
}

/* Splits x into `parts` random contiguous pieces of a random permutation, as
 * ranks would, and combines exactly as the collectives would. */
static double partitioned_sum(const float *x, size_t n, int parts, uint64_t *rng, int squares) {
  float *perm = malloc(n * sizeof *perm);
  size_t *cut = malloc((size_t)(parts + 1) * sizeof *cut);
  memcpy(perm, x, n * sizeof *perm);
  for (size_t i = n; i > 1; i--) {
    size_t j = (size_t)(dt_rand_u64(rng) % i);
    float t = perm[i - 1];
    perm[i - 1] = perm[j];
    perm[j] = t;
  }
  cut[0] = 0;
  cut[parts] = n;
  for (int p = 1; p < parts; p++) cut[p] = (size_t)(dt_rand_u64(rng) % (n + 1));
  for (int p = 1; p < parts; p++) /* sort the cut points */
    for (int q = p + 1; q < parts; q++)
      if (cut[q] < cut[p]) {
        size_t t = cut[p];
        cut[p] = cut[q];
        cut[q] = t;
      }
  /* phase 1: local absmax, MAX-combined */
  double m = 0;
  for (int p = 0; p < parts; p++) {
    double lm = dopt_absmax(perm + cut[p], cut[p + 1] - cut[p], 1);
    if (squares) lm *= lm;
    m = lm > m ? lm : m;
  }
  double scale = dopt_xsum_scale(m);
  /* phase 2: local accumulators, SUM-combined word by word in reverse order */
  dopt_xacc total = {{0}};
  for (int p = parts - 1; p >= 0; p--) {
    dopt_xacc a = {{0}};
    if (squares) dopt_xacc_add_sq_n(&a, scale, perm + cut[p], cut[p + 1] - cut[p]);
    else dopt_xacc_add_n(&a, scale, perm + cut[p], cut[p + 1] - cut[p], 1);
    for (int w = 0; w < DOPT_XSUM_WORDS; w++) total.w[w] += a.w[w];
  }
  free(perm);
  free(cut);
  return dopt_xacc_value(&total, scale);
}

static void test_partition_and_order_independence(void **st) {
  (void)st;
  uint64_t rng = 42;
  float *x = malloc(NMAX * sizeof *x);
  int trials = 0;
  for (int kind = 0; kind < 5; kind++) {
    for (int rep = 0; rep < 40; rep++) {
      size_t n = 1 + (size_t)(dt_rand_u64(&rng) % NMAX);
      fill(x, n, kind, &rng);
      for (int squares = 0; squares < 2; squares++) {
        double ref = squares ? dopt_xsum_sq(x, n) : dopt_xsum(x, n);
        for (int k = 0; k < 6; k++) {
          int parts = 1 + (int)(dt_rand_u64(&rng) % 9);
          double got = partitioned_sum(x, n, parts, &rng, squares);
          if (memcmp(&got, &ref, sizeof got) != 0)
            fail_msg("kind %d n %zu parts %d squares %d: %.17g vs %.17g", kind, n, parts, squares, got, ref);
          trials++;
        }
      }
    }
  }
  assert_true(trials == 5 * 40 * 2 * 6);
  free(x);
}

static void test_accuracy_against_long_double(void **st) {
  (void)st;
  uint64_t rng = 7;
  float *x = malloc(NMAX * sizeof *x);
  for (int kind = 0; kind < 5; kind++) {
    for (int rep = 0; rep < 30; rep++) {
      size_t n = 1 + (size_t)(dt_rand_u64(&rng) % NMAX);
      fill(x, n, kind, &rng);
      long double s = 0, sabs = 0, ss = 0;
      for (size_t i = 0; i < n; i++) {
        s += (long double)x[i];
        sabs += fabsl((long double)x[i]);
        ss += (long double)x[i] * (long double)x[i];
      }
      /* oracle error itself: n·2^-64·sabs; xsum's bound: n·2^-62·max <= n·2^-62·sabs */
      long double bound = (long double)n * 0x1p-60L * sabs;
      double got = dopt_xsum(x, n);
      if (fabsl((long double)got - s) > bound)
        fail_msg("kind %d n %zu: sum %.17g oracle %.20Lg (bound %.3Lg)", kind, n, got, s, bound);
      double gs = dopt_xsum_sq(x, n);
      if (fabsl((long double)gs - ss) > (long double)n * 0x1p-60L * ss)
        fail_msg("kind %d n %zu: sumsq %.17g oracle %.20Lg", kind, n, gs, ss);
      /* relative to fp32: the rounded sum of non-negatives is within 1 ulp */
      if (ss > 0 && (float)gs != (float)ss && dt_ulp_distance((float)gs, (float)ss) > 1)
        fail_msg("kind %d n %zu: fp32 sumsq %.9g vs oracle %.9g", kind, n, (double)(float)gs, (double)(float)ss);
    }
  }
  free(x);
}

static void test_tiny_sums_stay_nonzero(void **st) {
  (void)st;
  /* one huge, many tiny: the tiny ones are not lost to the fp32 result, and a
   * sum of only tiny (even subnormal) values is never rounded to zero */
  float sub[3] = {1e-45f, 2e-45f, 0.0f};
  assert_true(dopt_xsum(sub, 3) > 0.0);
  assert_true(dopt_xsum_sq(sub, 3) > 0.0);
  float eps1[4] = {1e-30f, 1e-30f, 1e-30f, 1e-30f};
  double s = dopt_xsum(eps1, 4);
  assert_true(s > 3.99e-30 && s < 4.01e-30);
  float mixed[2] = {1.0f, 1e-7f};
  assert_true((float)dopt_xsum(mixed, 2) == 1.0f + 1e-7f);
}

static void test_non_finite(void **st) {
  (void)st;
  float a[4] = {1.0f, NAN, 2.0f, 3.0f};
  assert_true(isnan(dopt_xsum(a, 4)));
  float b[3] = {1.0f, INFINITY, 2.0f};
  assert_true(isinf(dopt_xsum(b, 3)) && dopt_xsum(b, 3) > 0);
  float c[3] = {-INFINITY, 1.0f, -INFINITY};
  assert_true(isinf(dopt_xsum(c, 3)) && dopt_xsum(c, 3) < 0);
  float d[2] = {INFINITY, -INFINITY};
  assert_true(isnan(dopt_xsum(d, 2)));
  assert_true(isinf(dopt_xsum_sq(c, 3)));
  /* non-finite inputs do not poison the scale of the finite ones */
  assert_true(dopt_absmax(a, 4, 1) == 3.0);
  float e[1] = {0.0f};
  assert_true(dopt_xsum(e, 1) == 0.0 && dopt_xsum(e, 0) == 0.0);
}

/* Close to the documented limit (2^32 - 1 elements per segment): ~3·10^9
 * elements whose fixed-point low words are near 2^32 (the worst case for
 * the low word) still sum exactly. Built by merging one block accumulator
 * many times, exactly what an integer-sum collective over many ranks does. */
static void test_large_count_no_overflow(void **st) {
  (void)st;
  const float one = 1.0f, x = (float)(16777215.0 * 0x1p-53); /* q = (2^24-1)·2^8 */
  const double scale = dopt_xsum_scale(1.0);
  dopt_xacc block = {{0}}, total = {{0}};
  for (int i = 0; i < 65536; i++) dopt_xacc_add(&block, scale, (double)x);
  const long k = 46341; /* k·65536 ≈ 2^31.5 elements */
  for (long i = 0; i < k; i++) dopt_xacc_merge(&total, &block);
  dopt_xacc_add(&total, scale, (double)one);
  long double exact = 1.0L + (long double)k * 65536.0L * (long double)x;
  double got = dopt_xacc_value(&total, scale);
  if (fabsl((long double)got - exact) > 0x1p-50L) fail_msg("sum of 3e9 elements %.17g, exact %.20Lg", got, exact);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_partition_and_order_independence),
      cmocka_unit_test(test_accuracy_against_long_double),
      cmocka_unit_test(test_tiny_sums_stay_nonzero),
      cmocka_unit_test(test_non_finite),
      cmocka_unit_test(test_large_count_no_overflow),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
