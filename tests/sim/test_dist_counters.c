/* Counters (dopt_counters) compared between the reference and the distributed optimizer after every step
 * (dopt_dist_check_counters): the reference counts what it should, and each class of "wrong amount of work"
 * bug, planted into the distributed side, is named by its counter at its step, including a repeated refresh
 * whose parameters stay bitwise equal. */
#include "testutil.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "disttest.h"
#include "optim_impl.h"
#include "planted.h"

static const dt_param GP[] = {
    {"layers.0.w", 2, {32, 24}, DOPT_TP_COLUMN, 0},
    {"layers.0.b", 1, {24}, DOPT_TP_REPLICATED, 1},
};
static const dt_param QP[] = {
    {"w", 2, {6, 1024}, DOPT_TP_REPLICATED, 0}, /* torchao #4912's shape: 8-bit whole, 3072 per rank at dp 2 */
};

static int64_t total(const dt_case *c, const dt_result *r, int param, dopt_counter id) {
  int64_t n = 0;
  for (int t = 1; t <= c->steps; t++) n += r->counts[((size_t)t * (size_t)c->nparams + (size_t)param) * DOPT_NCOUNTERS + id];
  return n;
}

/* ---- the reference counts what it does ---- */

static void test_reference_counts(void **st) {
  (void)st;
  dt_case g = {"galore_adamw", "rank=4,update_proj_gap=2,lr=1e-2", NULL, GP, 2, 6, 1, 0.0, 0, 11, 0.5, 0, 6, 0, 0, 0, 0, 0};
  dt_result r;
  assert_ok(dt_run_reference(&g, 2, &r));
  assert_int_equal(total(&g, &r, 0, DOPT_COUNTER_STEPS), 6);
  assert_int_equal(total(&g, &r, 0, DOPT_COUNTER_PROJECTED), 6);
  assert_int_equal(total(&g, &r, 0, DOPT_COUNTER_REFRESHES), 3); /* steps 1, 3, 5 */
  assert_int_equal(total(&g, &r, 1, DOPT_COUNTER_PROJECTED), 0); /* the bias: the inner AdamW */
  assert_int_equal(r.counts[(3 * 2 + 0) * DOPT_NCOUNTERS + DOPT_COUNTER_REFRESHES], 1);
  assert_int_equal(r.counts[(4 * 2 + 0) * DOPT_NCOUNTERS + DOPT_COUNTER_REFRESHES], 0);
  dt_result_free(&r);

  dt_case q = {"adamw8bit", "lr=1e-2,min_8bit_size=4096", NULL, QP, 1, 4, 1, 0.0, 0, 12, 0.5, 0, 4, 0, 0, 0, 0, 0};
  assert_ok(dt_run_reference(&q, 2, &r));
  assert_int_equal(total(&q, &r, 0, DOPT_COUNTER_Q8_STEPS), 4);
  assert_int_equal(total(&q, &r, 0, DOPT_COUNTER_Q8_FP32_STEPS), 0);
  dt_result_free(&r);
  q.hparams = "lr=1e-2,min_8bit_size=8192";
  assert_ok(dt_run_reference(&q, 2, &r));
  assert_int_equal(total(&q, &r, 0, DOPT_COUNTER_Q8_STEPS), 0);
  assert_int_equal(total(&q, &r, 0, DOPT_COUNTER_Q8_FP32_STEPS), 4);
  dt_result_free(&r);

  static const dt_param MP[] = {{"layers.0.experts", 3, {4, 9, 7}, DOPT_TP_COLUMN, 0}, {"ln", 1, {9}, DOPT_TP_REPLICATED, 0}};
  dt_case m = {"muon", "lr=2e-2,ns_steps=5", NULL, MP, 2, 3, 1, 0.0, 0, 13, 0.5, 0, 3, 0, 0, 0, 0, 0};
  assert_ok(dt_run_reference(&m, 1, &r));
  assert_int_equal(total(&m, &r, 0, DOPT_COUNTER_NS), 12); /* 4 experts x 3 steps */
  assert_int_equal(total(&m, &r, 0, DOPT_COUNTER_NS_ITERATIONS), 60);
  assert_int_equal(total(&m, &r, 1, DOPT_COUNTER_AUX_ADAM), 3);
  assert_int_equal(total(&m, &r, 1, DOPT_COUNTER_NS), 0);
  dt_result_free(&r);

  static const dt_param LP[] = {{"layers.0.w", 2, {6, 5}, DOPT_TP_COLUMN, 0}, {"layers.1.w", 2, {6, 5}, DOPT_TP_COLUMN, 0},
                                {"head", 2, {5, 6}, DOPT_TP_ROW, 0}};
  dt_case l = {"lisa", "inner=adamw,n_layers=1,interval=2,reset_states=true,lr=1e-2", NULL, LP, 3, 8, 1, 0.0, 0, 14, 0.5, 0, 8, 0, 0, 0, 0, 0};
  assert_ok(dt_run_reference(&l, 1, &r));
  /* one of the two layers active per interval: each step one frozen; the head always trained */
  assert_int_equal(total(&l, &r, 0, DOPT_COUNTER_FROZEN) + total(&l, &r, 1, DOPT_COUNTER_FROZEN), 8);
  assert_int_equal(total(&l, &r, 0, DOPT_COUNTER_STEPS) + total(&l, &r, 1, DOPT_COUNTER_STEPS), 8);
  assert_int_equal(total(&l, &r, 2, DOPT_COUNTER_FROZEN), 0);
  assert_int_equal(total(&l, &r, 0, DOPT_COUNTER_RESETS), 4); /* every interval, both layers */
  assert_int_equal(total(&l, &r, 2, DOPT_COUNTER_RESETS), 0);
  dt_result_free(&r);
}

/* ---- planted bugs ---- */

static void expect_named(const char *what, const char *msg, const char *needle) {
  printf("planted: %s -> %s\n", what, msg);
  if (!strstr(msg, needle)) fail_msg("planted bug '%s' not named by its counter ('%s'): %s", what, needle, msg);
}

static void test_planted_counts(void **st) {
  (void)st;
  static const dt_layout l = {2, 2, 2, 0};
  char msg[512];
  dt_case g = {"galore_adamw", "rank=4,update_proj_gap=2,lr=1e-2", NULL, GP, 2, 6, 1, 0.0, 0, 21, 0.5, 0, 1, 0, 0, 0, 0, 0};
  dt_result ref;
  assert_ok(dt_run_reference(&g, l.dp, &ref));
  /* the correct side passes, with and without the counters: the check is not merely strict */
  if (dt_diverges(&g, &l, &ref, 1, msg, sizeof msg)) fail_msg("galore_adamw without a planted bug: %s", msg);

  for (int k = 0; k < DT_PLANT_COUNT; k++) assert_non_null(dt_planted(k));
  dt_dist_impl = dt_planted(DT_PLANT_REFRESH_TWICE); /* the same bits at every step: only the counters see it */
  const int bits = dt_diverges(&g, &l, &ref, 0, msg, sizeof msg);
  if (bits) fail_msg("a repeated refresh was expected to keep the bits: %s", msg);
  assert_true(dt_diverges(&g, &l, &ref, 1, msg, sizeof msg));
  expect_named(dt_planted_what(DT_PLANT_REFRESH_TWICE), msg, "DIVERGED at step 1 (events: galore.refreshes of layers.0.w: reference 1, distributed 2");

  dt_dist_impl = dt_planted(DT_PLANT_REFRESH_SKIPPED);
  assert_true(dt_diverges(&g, &l, &ref, 1, msg, sizeof msg));
  expect_named(dt_planted_what(DT_PLANT_REFRESH_SKIPPED), msg, "DIVERGED at step 3 (events: galore.refreshes of layers.0.w: reference 1, distributed 0");

  dt_dist_impl = dt_planted(DT_PLANT_PLAIN_PATH);
  assert_true(dt_diverges(&g, &l, &ref, 1, msg, sizeof msg));
  expect_named(dt_planted_what(DT_PLANT_PLAIN_PATH), msg, "DIVERGED at step 1 (events: galore.projected of layers.0.w: reference 1, distributed 0");
  dt_dist_impl = NULL;
  dt_result_free(&ref);

  static const dt_layout l2 = {1, 2, 2, 0};
  dt_case q = {"adamw8bit", "lr=1e-2", NULL, QP, 1, 4, 1, 0.0, 0, 22, 0.5, 0, 1, 0, 0, 0, 0, 0};
  assert_ok(dt_run_reference(&q, l2.dp, &ref));
  if (dt_diverges(&q, &l2, &ref, 1, msg, sizeof msg)) fail_msg("adamw8bit without a planted bug: %s", msg);
  dt_dist_impl = dt_planted(DT_PLANT_Q8_SHARD);
  assert_true(dt_diverges(&q, &l2, &ref, 1, msg, sizeof msg));
  expect_named(dt_planted_what(DT_PLANT_Q8_SHARD), msg, "DIVERGED at step 1 (events: q8.steps of w: reference 1, distributed 0 on rank 0)");
  dt_dist_impl = NULL;
  /* wasted work on one rank only (the tail shard's step run twice, the same bits): an each counter is checked
   * on every rank, not only on rank 0 */
  dt_dist_impl = dt_planted(DT_PLANT_Q8_TAIL_TWICE);
  if (dt_diverges(&q, &l2, &ref, 0, msg, sizeof msg)) fail_msg("the tail stepped twice was expected to keep the bits: %s", msg);
  assert_true(dt_diverges(&q, &l2, &ref, 1, msg, sizeof msg));
  expect_named(dt_planted_what(DT_PLANT_Q8_TAIL_TWICE), msg, "DIVERGED at step 1 (events: q8.steps of w: reference 1, distributed 2 on rank 1)");
  dt_dist_impl = NULL;
  dt_result_free(&ref);
}

/* Replicas counted once: a TP-replicated tensor's pieces repeat over tp, a piecewise one's at ZeRO 0 over dp;
 * a sum counter (non-finite elements reset, applied) totals over the primary pieces only */
static void test_replicas_counted_once(void **st) {
  (void)st;
  static const dt_param RP[] = {{"w", 2, {6, 1024}, DOPT_TP_REPLICATED, 0}, {"c", 2, {8, 96}, DOPT_TP_COLUMN, 0}};
  dt_case q = {"adamw8bit", "lr=1e-2,min_8bit_size=512,block_size=256", NULL, RP, 2, 3, 1, 0.0, 0, 23, 0.5, 2, 1, 0, 0,
               0, 1, 0};
  static const dt_layout L[] = {{2, 2, 0, 0}, {2, 2, 2, 0}, {1, 3, 0, 0}, {3, 1, 0, 0}};
  for (size_t k = 0; k < sizeof L / sizeof L[0]; k++) {
    dt_result ref;
    assert_ok(dt_run_reference(&q, L[k].dp, &ref));
    assert_true(total(&q, &ref, 0, DOPT_COUNTER_NONFINITE_RESETS) >= 1); /* the NaN planted at step 2 */
    char msg[512];
    if (dt_diverges(&q, &L[k], &ref, 1, msg, sizeof msg))
      fail_msg("tp%d dp%d zero%d: %s", L[k].tp, L[k].dp, L[k].zero, msg);
    dt_result_free(&ref);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {cmocka_unit_test(test_reference_counts), cmocka_unit_test(test_planted_counts),
                                     cmocka_unit_test(test_replicas_counted_once)};
  return cmocka_run_group_tests(tests, NULL, NULL);
}
