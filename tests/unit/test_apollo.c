/* APOLLO (ref/apollo.c; docs/optimizers.md "APOLLO") beyond its golden cases, which adopt distopt's draws on the
 * upstream side: distopt's own draw rule checked against bounds derived from what upstream's torch.randn draws
 * are (i.i.d. N(0, 1/r) entries), the refresh schedule and keys, the projector hook (a recorded run's draws),
 * and the one-line refusals. */
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "distopt/distopt.h"

/* An apollo optimizer over `np` [m, n] parameters; *o and the parameters' data (weights 0.5·N(0,1)). */
static float **make(const char *hp, int np, size_t m, size_t n, dopt_optim **o) {
  assert_ok(dopt_optim_create("apollo", hp, o));
  float **w = malloc((size_t)np * sizeof *w);
  uint64_t seed = 17;
  for (int i = 0; i < np; i++) {
    w[i] = malloc(m * n * sizeof(float));
    for (size_t k = 0; k < m * n; k++) w[i][k] = (float)(0.5 * dt_rand_normal(&seed));
    dopt_param_config pc = DOPT_PARAM_CONFIG_INIT;
    pc.name = "w", pc.ndim = 2, pc.shape[0] = (int64_t)m, pc.shape[1] = (int64_t)n, pc.data = w[i];
    assert_ok(dopt_optim_add_param(*o, 0, &pc, NULL));
  }
  return w;
}

static void step_all(dopt_optim *o, int np, size_t numel, uint64_t seed) {
  const float *g[8];
  float *buf = malloc((size_t)np * numel * sizeof *buf);
  for (int i = 0; i < np; i++) {
    for (size_t k = 0; k < numel; k++) buf[(size_t)i * numel + k] = (float)dt_rand_normal(&seed);
    g[i] = buf + (size_t)i * numel;
  }
  assert_ok(dopt_optim_step(o, g));
  free(buf);
}

static const float *projector(dopt_optim *o, int p, size_t *n) {
  dopt_state_view v;
  assert_ok(dopt_optim_state(o, p, 2, &v));
  assert_string_equal(v.name, "projector");
  *n = v.bytes / sizeof(float);
  return v.data;
}

/* The draw rule against what upstream's is: P = Z/√r, Z i.i.d. N(0, 1). For N draws of √r·P the sample mean
 * has standard deviation 1/√N and the sample variance √(2/N) (fourth moment 3): |mean| <= 5/√N and
 * |var − 1| <= 5·√(2/N) fail a correct generator with probability below 1e-6 each; the fourth moment's sample
 * mean (standard deviation √(96/N): E z^8 = 105, minus 9) within 5·√(96/N) of 3 catches a uniform or a
 * truncated draw. Two draws that should be independent (another parameter, another refresh) have a sample
 * correlation within 5/√N of 0, and are not equal. The projection's purpose, E‖G·Pᵀ‖² = ‖G‖², is the variance
 * above: no separate check. */
static void moments(const float *P, size_t N, double r, double *mean, double *var, double *m4) {
  double s = 0, s2 = 0, s4 = 0;
  for (size_t i = 0; i < N; i++) {
    const double z = (double)P[i] * sqrt(r);
    s += z, s2 += z * z, s4 += z * z * z * z;
  }
  *mean = s / (double)N, *var = s2 / (double)N - *mean * *mean, *m4 = s4 / (double)N;
}

static double corr(const float *a, const float *b, size_t N) {
  double ab = 0, aa = 0, bb = 0;
  for (size_t i = 0; i < N; i++) ab += (double)a[i] * b[i], aa += (double)a[i] * a[i], bb += (double)b[i] * b[i];
  return ab / sqrt(aa * bb);
}

static void test_draws(void **st) {
  (void)st;
  /* right projection of two [1024, 512] matrices at rank 64 (std: the smaller side, the columns): P [64, 512],
   * N = 32768 draws each */
  const size_t m = 1024, n = 512, r = 64;
  dopt_optim *o;
  float **w = make("rank=64,update_proj_gap=2,seed=3", 2, m, n, &o);
  step_all(o, 2, m * n, 5);
  size_t N, N1;
  const float *P0 = projector(o, 0, &N), *P1 = projector(o, 1, &N1);
  assert_int_equal(N, r * n);
  assert_int_equal(N1, N);
  double mean, var, m4;
  moments(P0, N, (double)r, &mean, &var, &m4);
  printf("  draws: N=%zu mean %.2e (bound %.2e), var-1 %.2e (bound %.2e), m4 %.3f (bound 3 +- %.3f)\n", N, mean,
         5 / sqrt((double)N), var - 1, 5 * sqrt(2.0 / (double)N), m4, 5 * sqrt(96.0 / (double)N));
  assert_true(fabs(mean) <= 5 / sqrt((double)N));
  assert_true(fabs(var - 1) <= 5 * sqrt(2.0 / (double)N));
  assert_true(fabs(m4 - 3) <= 5 * sqrt(96.0 / (double)N));
  /* another parameter: independent */
  float *first = malloc(N * sizeof *first);
  memcpy(first, P0, N * sizeof *first);
  assert_true(fabs(corr(P0, P1, N)) <= 5 / sqrt((double)N));
  /* step 2 (0-based 1) keeps the projection; step 3 (0-based 2) redraws it, independent of the first */
  step_all(o, 2, m * n, 6);
  assert_memory_equal(projector(o, 0, &N), first, N * sizeof *first);
  step_all(o, 2, m * n, 7);
  const float *P2 = projector(o, 0, &N);
  assert_true(fabs(corr(first, P2, N)) <= 5 / sqrt((double)N));
  dopt_counters k = DOPT_COUNTERS_INIT;
  assert_ok(dopt_optim_counters(o, 0, &k));
  assert_int_equal(k.total[DOPT_COUNTER_REFRESHES], 2);
  assert_int_equal(k.total[DOPT_COUNTER_PROJECTED], 3);
  /* the keys: the same seed and parameter give the same first draw in a fresh optimizer; another seed does not */
  dopt_optim *o2, *o3;
  float **w2 = make("rank=64,update_proj_gap=2,seed=3", 2, m, n, &o2);
  float **w3 = make("rank=64,update_proj_gap=2,seed=4", 2, m, n, &o3);
  step_all(o2, 2, m * n, 99);
  step_all(o3, 2, m * n, 99);
  assert_memory_equal(projector(o2, 0, &N), first, N * sizeof *first);
  assert_true(fabs(corr(projector(o3, 0, &N), first, N)) <= 5 / sqrt((double)N));
  /* a left projection ([512, 1024]: std projects the smaller side, the rows) is P [m, r] = [512, 64] */
  dopt_optim *o4;
  float **w4 = make("rank=64", 1, n, m, &o4);
  step_all(o4, 1, m * n, 8);
  projector(o4, 0, &N);
  assert_int_equal(N, n * r);
  for (int i = 0; i < 2; i++) free(w[i]), free(w2[i]), free(w3[i]);
  free(w4[0]);
  free(w), free(w2), free(w3), free(w4), free(first);
  dopt_optim_destroy(o), dopt_optim_destroy(o2), dopt_optim_destroy(o3), dopt_optim_destroy(o4);
}

/* The hook supplies the draw (a recorded run's): it is used as given, once per refresh. */
static int calls;
static int hook(void *user, int param, int64_t step, const float *grad, int64_t m, int64_t n, int64_t r, float *left,
                float *right) {
  (void)user, (void)param, (void)grad;
  (void)step, (void)m;
  if (++calls == 1) return -1; /* the first call fails its step (checked below) */
  if (left || !right) return 0;
  for (int64_t i = 0; i < r * n; i++) right[i] = (float)(i % 7) - 3.0f;
  return 1;
}

static void test_hook(void **st) {
  (void)st;
  dopt_optim *o;
  float **w = make("rank=2,update_proj_gap=3", 1, 6, 4, &o);
  assert_ok(dopt_optim_set_projector_hook(o, hook, NULL));
  float g[24];
  for (int i = 0; i < 24; i++) g[i] = 0.1f * (float)(i - 11);
  const float *gp[1] = {g};
  assert_status(dopt_optim_step(o, gp), DOPT_ERR_INVALID_ARG, "projector hook failed");
  assert_ok(dopt_optim_step(o, gp));
  size_t N;
  const float *P = projector(o, 0, &N);
  assert_int_equal(N, 8);
  for (size_t i = 0; i < N; i++) assert_true(P[i] == (float)(i % 7) - 3.0f);
  dopt_counters k = DOPT_COUNTERS_INIT;
  assert_ok(dopt_optim_counters(o, 0, &k));
  assert_int_equal(k.last[DOPT_COUNTER_SUPPLIED], 1);
  free(w[0]), free(w);
  dopt_optim_destroy(o);
}

static void test_refusals(void **st) {
  (void)st;
  dopt_optim *o = NULL;
  assert_status(dopt_optim_create("apollo", "rank=-1", &o), DOPT_ERR_INVALID_ARG, "rank=-1");
  assert_status(dopt_optim_create("apollo", "update_proj_gap=0", &o), DOPT_ERR_INVALID_ARG, "update_proj_gap=0");
  assert_status(dopt_optim_create("apollo", "scale=-1", &o), DOPT_ERR_INVALID_ARG, "scale=-1");
  assert_status(dopt_optim_create("apollo", "proj_type=full", &o), DOPT_ERR_INVALID_ARG, "proj_type");
  assert_status(dopt_optim_create("galore", "inner=apollo", &o), DOPT_ERR_INVALID_ARG, "inner=apollo");
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_draws),
      cmocka_unit_test(test_hook),
      cmocka_unit_test(test_refusals),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
