/* Steps run on the host for a device without a kernel for them (dopt__step_on_host, core/hoststep.c), as
 * the CUDA device runs every optimizer it has no kernel for: every registered optimizer's grid settings
 * (the first grid_ci, the CI ones) at four layouts (piecewise statistics posted from host copies, owner
 * mode, ZeRO-3, TP ROW splits, bf16 masters, clipping) on the checking device with host steps on, bitwise
 * the reference in every rank's copy (disttest compares each rank's). And the mapping of posted arrays: a
 * step posting memory that is none of its buffers fails in one line. */
#include "testutil.h"

#include <stdio.h>
#include <string.h>

#include "disttest.h"
#include "internal.h"
#include "optim_impl.h"

static const dt_param PARAMS[] = {
    {"w", 2, {10, 9}, DOPT_TP_COLUMN, 0}, {"o", 2, {7, 10}, DOPT_TP_ROW, 0}, {"ln", 1, {9}, DOPT_TP_REPLICATED, 1},
    {"b", 1, {300}, DOPT_TP_COLUMN, 1},  {"e", 3, {2, 6, 5}, DOPT_TP_COLUMN, 0},
};
#define NP ((int)(sizeof PARAMS / sizeof PARAMS[0]))

static const dt_layout LAYOUTS[] = {{2, 2, 2, 0}, {1, 3, 3, 0}, {3, 2, 1, 256}, {2, 1, 0, 1}};
#define NL ((int)(sizeof LAYOUTS / sizeof LAYOUTS[0]))

static int host_off(void **st) {
  (void)st;
  dt_host_steps = 0;
  return 0;
}

static void test_every_optimizer_on_host(void **st) {
  (void)st;
  int runs = 0;
  for (int i = 0; i < dopt_optim_registry_count(); i++) {
    dopt_optim_info in;
    assert_ok(dopt_optim_registry_info(i, &in));
    for (int k = 0; k < in.grid_ci; k++) {
      dt_case c = {in.name, in.grid[k], NULL, PARAMS, NP, 4, 2, k ? 0.0 : 0.5, k == 1, 77 + (uint64_t)i, 0.05,
                   0, 2, 0, 0, 0, 0, 0};
      dt_result ref[4];
      int have[4] = {0};
      for (int li = 0; li < NL; li++) {
        const dt_layout *l = &LAYOUTS[li];
        if (!have[l->dp]) {
          dt_host_steps = 0;
          assert_ok(dt_run_reference(&c, l->dp, &ref[l->dp]));
          have[l->dp] = 1;
        }
        dt_result got;
        dt_expect(&got, &ref[l->dp]);
        char err[512] = "", msg[512] = "";
        dt_host_steps = 1; /* reset by host_off, also when a check fails */
        if (dt_run_dist(&c, l, &got, err, sizeof err) != DOPT_OK)
          fail_msg("%s (%s) tp%d dp%d zero%d: %s", c.optimizer, c.hparams, l->tp, l->dp, l->zero, err);
        dt_host_steps = 0;
        if (dt_compare(&c, &ref[l->dp], &got, msg, sizeof msg))
          fail_msg("%s (%s) tp%d dp%d zero%d on host steps: %s", c.optimizer, c.hparams, l->tp, l->dp, l->zero, msg);
        dt_result_free(&got);
        runs++;
      }
      for (int d = 0; d < 4; d++)
        if (have[d]) dt_result_free(&ref[d]);
    }
  }
  printf("host steps: %d runs, every optimizer bitwise the reference\n", runs);
  assert_true(runs >= 4 * dopt_optim_registry_count());
}

/* A stage that posts an array outside its buffers (a stack array) is refused, naming the array. */
static dopt_status posts_stack(const dopt_step_args *a) {
  double x[2] = {1, 2};
  return a->red->post_max_f64(a->red->ctx, x, 2);
}
static dopt_status count_post(void *ctx, double *x, size_t n) {
  (void)x;
  *(size_t *)ctx += n;
  return DOPT_OK;
}
static void test_post_outside_buffers(void **st) {
  (void)st;
  dopt_optim_impl impl = {.name = "stack_poster", .step = posts_stack};
  dopt_piece pc;
  const int64_t shape[1] = {4};
  dopt_piece_full(1, shape, &pc);
  float w[4] = {0}, g[4] = {0};
  size_t posted = 0;
  dopt_reducer red = {&posted, count_post, NULL};
  int more = 0;
  dopt_step_args a = {.impl = &impl, .piece = &pc, .param = w, .grad = g, .red = &red, .more = &more, .step = 1};
  assert_status(dopt__step_on_host(dopt_device_cpu(), &a, 0), DOPT_ERR_STATE,
                "host step: posted MAX array of 2 doubles lies in no step buffer");
  assert_int_equal(posted, 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_teardown(test_every_optimizer_on_host, host_off),
      cmocka_unit_test(test_post_outside_buffers),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
