/* SOAP (ref/soap.c; docs/optimizers.md "SOAP") beyond its golden cases: a first basis of a size whose LAPACK
 * workspace query would round (d = 2900: 1 + 6d + 2d² = 16 837 401 > 2^24 as a float), the bases orthonormal and
 * ordered, the refresh schedule in the counters, and the one-line refusals. */
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "distopt/distopt.h"

static void test_large_basis(void **st) {
  (void)st;
  const int64_t m = 2, n = 2900;
  dopt_optim *o;
  assert_ok(dopt_optim_create("soap", "max_precondition_dim=4096,precondition_frequency=1", &o));
  float *w = calloc((size_t)(m * n), sizeof *w), *g = malloc((size_t)(m * n) * sizeof *g);
  uint64_t seed = 3;
  for (int64_t i = 0; i < m * n; i++) g[i] = (float)dt_rand_normal(&seed);
  dopt_param_config pc = DOPT_PARAM_CONFIG_INIT;
  pc.name = "w", pc.ndim = 2, pc.shape[0] = m, pc.shape[1] = n, pc.data = w;
  assert_ok(dopt_optim_add_param(o, 0, &pc, NULL));
  const float *gp[1] = {g};
  assert_ok(dopt_optim_step(o, gp)); /* the first step: GG1 = (1 - 0.95)·GᵀG of rank 2, its 2900-wide eigh */
  dopt_counters k = DOPT_COUNTERS_INIT;
  assert_ok(dopt_optim_counters(o, 0, &k));
  assert_int_equal(k.last[DOPT_COUNTER_EIGH], 2);
  assert_int_equal(k.last[DOPT_COUNTER_EIGH_FP64], 0); /* fp32 succeeded: its workspace was not the query's */
  /* Q1 [2900, 2900]: its first two columns span G's rows (the nonzero eigenvalues, in descending order), and the
   * columns are orthonormal (a sample) */
  dopt_state_view q, gg;
  assert_ok(dopt_optim_state(o, 0, 4, &gg));
  assert_ok(dopt_optim_state(o, 0, 5, &q));
  assert_string_equal(q.name, "Q1");
  assert_string_equal(gg.name, "GG1");
  const float *Q = q.data, *A = gg.data;
  double worst = 0, lam[3];
  for (int a = 0; a < 3; a++) {
    double aq = 0;
    for (int64_t r = 0; r < n; r++) {
      double x = 0;
      for (int64_t c = 0; c < n; c++) x += (double)A[r * n + c] * Q[c * n + a];
      aq += (double)Q[r * n + a] * x;
    }
    lam[a] = aq;
    for (int b = 0; b < 3; b++) {
      double d = 0;
      for (int64_t r = 0; r < n; r++) d += (double)Q[r * n + a] * Q[r * n + b];
      worst = fmax(worst, fabs(d - (a == b ? 1.0 : 0.0)));
    }
  }
  printf("  d=2900: eigenvalues %.4g %.4g %.3g, orthonormality %.3g\n", lam[0], lam[1], lam[2], worst);
  assert_true(worst <= (2.0 * 2900 + 4) * 0x1p-24);
  assert_true(lam[0] >= lam[1] && lam[1] > 1e3 * fabs(lam[2]));
  /* step 2 updates and refreshes (frequency 1): one QR per dimension */
  assert_ok(dopt_optim_step(o, gp));
  assert_ok(dopt_optim_counters(o, 0, &k));
  assert_int_equal(k.last[DOPT_COUNTER_QR], 2);
  assert_int_equal(k.total[DOPT_COUNTER_EIGH], 2);
  for (int64_t i = 0; i < m * n; i++) assert_true(isfinite(w[i]));
  free(w), free(g);
  dopt_optim_destroy(o);
}

static void test_refusals(void **st) {
  (void)st;
  dopt_optim *o = NULL;
  assert_status(dopt_optim_create("soap", "merge_dims=true", &o), DOPT_ERR_UNSUPPORTED, "merge_dims");
  assert_status(dopt_optim_create("soap", "precondition_frequency=0", &o), DOPT_ERR_INVALID_ARG, "precondition_frequency");
  assert_status(dopt_optim_create("soap", "max_precondition_dim=0", &o), DOPT_ERR_INVALID_ARG, "max_precondition_dim");
  assert_status(dopt_optim_create("soap", "beta2=1", &o), DOPT_ERR_INVALID_ARG, "beta2");
  assert_status(dopt_optim_create("soap", "shampoo_beta=2", &o), DOPT_ERR_INVALID_ARG, "shampoo_beta");
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_large_basis),
      cmocka_unit_test(test_refusals),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
