/* compare checks every parameter's counters (dopt_counters) against the reference's after every step: the
 * reference's totals and refresh steps reach the result and the JSON record, and a planted wrong amount of
 * work is the verdict, named by counter and step, even where every tensor stays bitwise equal. */
#include "testutil.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "compare.h"
#include "planted.h"

static void galore_options(cmp_options *o) {
  cmp_options_default(o);
  snprintf(o->optimizer, sizeof o->optimizer, "galore_adamw");
  snprintf(o->hparams, sizeof o->hparams, "rank=4,update_proj_gap=2,lr=1e-2");
  o->tp = 2, o->dp = 2, o->zero = 2;
  o->steps = 6;
  o->quiet = 1;
}

static cJSON *json_of(const cmp_options *o, const cmp_result *r) {
  char dir[512], path[600];
  assert_int_equal(dt_make_tmpdir(dir, sizeof dir, "events"), 0);
  snprintf(path, sizeof path, "%s/r.json", dir);
  assert_ok(cmp_write_json(path, o, r));
  FILE *f = fopen(path, "rb");
  assert_non_null(f);
  static char buf[1 << 20];
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  unlink(path);
  dt_remove_tmpdir(dir);
  buf[n] = '\0';
  cJSON *root = cJSON_Parse(buf);
  assert_non_null(root);
  assert_int_equal(cJSON_GetObjectItem(root, "schema_version")->valueint, 6);
  return root;
}

static void test_counts_reach_the_report(void **st) {
  (void)st;
  cmp_options o;
  galore_options(&o);
  assert_ok(cmp_apply_plugin(&o));
  cmp_result r;
  assert_ok(cmp_run(&o, &r, NULL, NULL));
  assert_true(r.equivalent);
  assert_int_equal(r.events_step, 0);
  assert_true(r.event_totals[DOPT_COUNTER_STEPS] > 0);
  assert_true(r.event_totals[DOPT_COUNTER_PROJECTED] > 0);
  /* every projected matrix refreshes at steps 1, 3, 5 (update_proj_gap 2) */
  assert_int_equal(r.event_totals[DOPT_COUNTER_REFRESHES] * 2, r.event_totals[DOPT_COUNTER_PROJECTED]);
  assert_int_equal(r.nrefresh, 3);
  assert_int_equal(r.refresh_steps[0], 1);
  assert_int_equal(r.refresh_steps[2], 5);
  cJSON *root = json_of(&o, &r);
  cJSON *ev = cJSON_GetObjectItem(root, "events");
  assert_non_null(ev);
  assert_true(cJSON_IsNull(cJSON_GetObjectItem(ev, "first_difference")));
  cJSON *tot = cJSON_GetObjectItem(ev, "reference_totals");
  assert_int_equal((int64_t)cJSON_GetObjectItem(tot, "galore.refreshes")->valuedouble, r.event_totals[DOPT_COUNTER_REFRESHES]);
  assert_int_equal(cJSON_GetArraySize(cJSON_GetObjectItem(ev, "refresh_steps")), 3);
  cJSON_Delete(root);
  cmp_result_free(&r);
  cmp_options_free(&o);
}

/* a refresh run twice on the distributed side: the same projector, so every tensor stays bitwise equal and
 * only the counters see the wasted SVDs */
static void test_planted_refresh_twice(void **st) {
  (void)st;
  cmp_options o;
  galore_options(&o);
  assert_ok(cmp_apply_plugin(&o));
  o.dist_impl = dt_planted(DT_PLANT_REFRESH_TWICE);
  assert_non_null(o.dist_impl);
  cmp_result r;
  assert_ok(cmp_run(&o, &r, NULL, NULL));
  for (int k = 0; k < r.ntensors; k++)
    if (r.t[k].max_ulp != 0 || r.t[k].first_diff != 0) fail_msg("%s: %llu ULP", r.t[k].name, (unsigned long long)r.t[k].max_ulp);
  assert_string_equal(r.digest, r.ref_digest);
  assert_false(r.equivalent);
  assert_int_equal(r.events_step, 1);
  assert_int_equal(r.events_counter, DOPT_COUNTER_REFRESHES);
  assert_int_equal(r.events_rank, -1); /* a SUM counter: the total over the pieces */
  assert_int_equal(r.events_ref, 1);
  assert_int_equal(r.events_dist, 2);
  cJSON *root = json_of(&o, &r);
  cJSON *v = cJSON_GetObjectItem(root, "verdict");
  assert_string_equal(cJSON_GetObjectItem(v, "kind")->valuestring, "events");
  char want[256];
  snprintf(want, sizeof want, "DIVERGED at step 1 (events: galore.refreshes of %s: reference 1, distributed 2)",
           r.events_param);
  assert_string_equal(cJSON_GetObjectItem(v, "text")->valuestring, want);
  cJSON *fd = cJSON_GetObjectItem(cJSON_GetObjectItem(root, "events"), "first_difference");
  assert_string_equal(cJSON_GetObjectItem(fd, "counter")->valuestring, "galore.refreshes");
  assert_string_equal(cJSON_GetObjectItem(fd, "scope")->valuestring, "sum");
  cJSON_Delete(root);
  cmp_result_free(&r);
  cmp_options_free(&o);
}

/* a refresh skipped; a matrix on the plain path (its projector state absent on the distributed side: a
 * difference the table shows, not a failed run) */
static void test_planted_galore(void **st) {
  (void)st;
  static const struct {
    int plant, step;
    dopt_counter counter;
    int64_t ref, dist;
  } P[] = {{DT_PLANT_REFRESH_SKIPPED, 3, DOPT_COUNTER_REFRESHES, 1, 0}, {DT_PLANT_PLAIN_PATH, 1, DOPT_COUNTER_PROJECTED, 1, 0}};
  for (size_t k = 0; k < sizeof P / sizeof P[0]; k++) {
    cmp_options o;
    galore_options(&o);
    assert_ok(cmp_apply_plugin(&o));
    o.dist_impl = dt_planted(P[k].plant);
    cmp_result r;
    assert_ok(cmp_run(&o, &r, NULL, NULL));
    assert_false(r.equivalent);
    if (r.events_step != P[k].step || r.events_counter != (int)P[k].counter || r.events_ref != P[k].ref ||
        r.events_dist != P[k].dist)
      fail_msg("%s: step %d, %s: %lld vs %lld", dt_planted_what(P[k].plant), r.events_step,
               dopt_counter_name(r.events_counter), (long long)r.events_ref, (long long)r.events_dist);
    assert_string_not_equal(r.digest, r.ref_digest);
    cmp_result_free(&r);
    cmp_options_free(&o);
  }
}

/* an 8-bit decision on the shard's numel: an EACH counter, named with the first rank that differs */
static void test_planted_q8_shard(void **st) {
  (void)st;
  cmp_options o;
  cmp_options_default(&o);
  snprintf(o.optimizer, sizeof o.optimizer, "adamw8bit");
  snprintf(o.hparams, sizeof o.hparams, "lr=1e-2,min_8bit_size=1000");
  o.tp = 1, o.dp = 2, o.zero = 2;
  o.steps = 2;
  o.quiet = 1;
  assert_ok(cmp_apply_plugin(&o));
  o.dist_impl = dt_planted(DT_PLANT_Q8_SHARD); /* embed.weight: 1600 elements, 800 per rank */
  cmp_result r;
  assert_ok(cmp_run(&o, &r, NULL, NULL));
  assert_false(r.equivalent);
  assert_int_equal(r.events_step, 1);
  assert_int_equal(r.events_counter, DOPT_COUNTER_Q8_STEPS);
  assert_int_equal(r.events_rank, 0);
  assert_int_equal(r.events_ref, 1);
  assert_int_equal(r.events_dist, 0);
  cmp_result_free(&r);
  cmp_options_free(&o);
}

int main(void) {
  const struct CMUnitTest tests[] = {cmocka_unit_test(test_counts_reach_the_report),
                                     cmocka_unit_test(test_planted_refresh_twice), cmocka_unit_test(test_planted_galore),
                                     cmocka_unit_test(test_planted_q8_shard)};
  return cmocka_run_group_tests(tests, NULL, NULL);
}
