/* The digest of `distopt compare` (cmp_result.digest / ref_digest, docs/digest.md)
 * names the final logical tensors, not the layout:
 *  - on a gradient trace whose shard sums are exact (small multiples of 2^-14,
 *    6 shards per step), every layout sees the same averaged gradient, so
 *    tp1 dp1 zero0 (ddp), tp2 dp2 zero2 (hybrid) and tp1 dp3 zero3 (fsdp),
 *    the last two also with the simulator copying every exchange (its
 *    default: the dp sum reads the others' parts in place), must give one
 *    digest, for adamw and adafactor (and with --bf16), equal
 *    to the reference's;
 *  - that digest is the one this file computes itself from a plain optimizer
 *    stepped on the same gradients, with the documented record order (each
 *    parameter, its states, its "<p>/step"), so the engine hashes what the
 *    documentation says and nothing else;
 *  - one more step, or another learning rate, changes it. */
#include "testutil.h"

#include <stdio.h>
#include <stdlib.h>

#include "compare.h"
#include "distopt/safetensors.h"

#define STEPS 5
#define SHARDS 6 /* dp 1, 2 and 3 each split them evenly */

static char dir[256], trace[512];

typedef struct tparam {
  const char *name, *role;
  int ndim;
  int64_t shape[2];
} tparam;

/* uneven TP splits (13 rows or columns over tp 2), a replicated 2-D tensor */
static const tparam P[] = {
    {"fc1.weight", "column", 2, {13, 8}}, {"fc1.bias", "column", 1, {13}},
    {"fc2.weight", "row", 2, {6, 13}},    {"fc2.bias", "replicated", 1, {6}},
    {"head.scale", "replicated", 2, {1, 7}},
};
#define NP ((int)(sizeof P / sizeof P[0]))

static size_t numel(const tparam *p) { return (size_t)p->shape[0] * (size_t)(p->ndim == 2 ? p->shape[1] : 1); }

/* gradient element k of parameter i for (step, shard): an integer in
 * [-1000, 1000] times 2^-14 (about 1 in 16 exactly zero), so any sum of six
 * is exact and the data-parallel average does not depend on dp */
static float grad_value(int i, int step, int shard, size_t k) {
  uint64_t s = ((uint64_t)i << 40) ^ ((uint64_t)step << 24) ^ ((uint64_t)shard << 16) ^ k;
  uint64_t r = dt_rand_u64(&s);
  if ((r & 15) == 0) return 0.0f;
  return (float)((int)((r >> 8) % 2001) - 1000) * 0x1.0p-14f;
}

static int setup(void **st) {
  (void)st;
  if (dt_make_tmpdir(dir, sizeof dir, "dopt_cmpdig") != 0) return -1;
  snprintf(trace, sizeof trace, "%s/exact.safetensors", dir);
  dopt_st_writer *w;
  if (dopt_st_writer_create(&w) != DOPT_OK) return -1;
  char params[256] = "", roles[256] = "", key[128];
  float buf[128];
  uint64_t seed = 42;
  for (int i = 0; i < NP; i++) {
    snprintf(params + strlen(params), sizeof params - strlen(params), "%s%s", i ? "," : "", P[i].name);
    snprintf(roles + strlen(roles), sizeof roles - strlen(roles), "%s%s:%s", i ? "," : "", P[i].name, P[i].role);
    for (size_t k = 0; k < numel(&P[i]); k++) buf[k] = (float)(dt_rand_uniform(&seed) - 0.5) * 0.2f;
    snprintf(key, sizeof key, "init/%s", P[i].name);
    if (dopt_st_writer_add(w, key, DOPT_F32, P[i].ndim, P[i].shape, buf) != DOPT_OK) return -1;
    for (int t = 1; t <= STEPS + 1; t++)
      for (int sh = 0; sh < SHARDS; sh++) {
        for (size_t k = 0; k < numel(&P[i]); k++) buf[k] = grad_value(i, t, sh, k);
        snprintf(key, sizeof key, "grad/%d/%d/%s", t, sh, P[i].name);
        if (dopt_st_writer_add(w, key, DOPT_F32, P[i].ndim, P[i].shape, buf) != DOPT_OK) return -1;
      }
  }
  char steps[16], shards[16];
  snprintf(steps, sizeof steps, "%d", STEPS + 1);
  snprintf(shards, sizeof shards, "%d", SHARDS);
  dopt_status s = dopt_st_writer_meta(w, "params", params);
  if (s == DOPT_OK) s = dopt_st_writer_meta(w, "tp_roles", roles);
  if (s == DOPT_OK) s = dopt_st_writer_meta(w, "steps", steps);
  if (s == DOPT_OK) s = dopt_st_writer_meta(w, "shards", shards);
  if (s == DOPT_OK) s = dopt_st_writer_save(w, trace);
  dopt_st_writer_free(w);
  return s == DOPT_OK ? 0 : -1;
}

static int teardown(void **st) {
  (void)st;
  return dt_remove_tmpdir(dir);
}

static void opts(cmp_options *o, const char *optimizer, const char *plugin, int tp, int dp, int zero) {
  cmp_options_default(o);
  snprintf(o->optimizer, sizeof o->optimizer, "%s", optimizer);
  snprintf(o->plugin, sizeof o->plugin, "%s", plugin);
  o->tp = tp, o->dp = dp, o->zero = zero;
  o->steps = STEPS;
  o->quiet = 1;
  snprintf(o->source, sizeof o->source, "trace");
  snprintf(o->trace_path, sizeof o->trace_path, "%s", trace);
}

/* Runs the comparison; returns the distributed digest in hex (the caller frees nothing). */
static void run_digest(const cmp_options *o, char hex[DOPT_DIGEST_HEX]) {
  cmp_result r;
  assert_ok(cmp_run(o, &r, NULL, NULL));
  if (!r.equivalent) fail_msg("%s %s tp%d dp%d zero%d: not bitwise", o->optimizer, o->plugin, o->tp, o->dp, o->zero);
  assert_int_equal(strlen(r.digest), 64);
  if (strcmp(r.digest, r.ref_digest) != 0)
    fail_msg("%s %s tp%d dp%d zero%d%s: distributed digest %s, reference %s", o->optimizer, o->plugin, o->tp, o->dp,
             o->zero, o->bf16 ? " bf16" : "", r.digest, r.ref_digest);
  snprintf(hex, DOPT_DIGEST_HEX, "%s", r.digest);
  cmp_result_free(&r);
}

/* The digest this file expects: a plain optimizer stepped on the averaged
 * trace gradients, hashed in the documented order. */
static void expected_digest(const char *optimizer, const char *hparams, int steps, char hex[DOPT_DIGEST_HEX]) {
  dopt_st_file *f;
  assert_ok(dopt_st_load(trace, &f));
  dopt_optim *opt;
  assert_ok(dopt_optim_create(optimizer, hparams, &opt));
  float *w[NP], *g[NP];
  char key[128];
  for (int i = 0; i < NP; i++) {
    w[i] = malloc(numel(&P[i]) * sizeof(float));
    g[i] = malloc(numel(&P[i]) * sizeof(float));
    assert_true(w[i] && g[i]);
    snprintf(key, sizeof key, "init/%s", P[i].name);
    assert_ok(dopt_st_read_f32(f, key, w[i], numel(&P[i])));
    dopt_param_config pc = DOPT_PARAM_CONFIG_INIT;
    pc.name = P[i].name;
    pc.ndim = P[i].ndim;
    memcpy(pc.shape, P[i].shape, sizeof P[i].shape);
    pc.data = w[i];
    assert_ok(dopt_optim_add_param(opt, 0, &pc, NULL));
  }
  for (int t = 1; t <= steps; t++) {
    for (int i = 0; i < NP; i++) {
      for (size_t k = 0; k < numel(&P[i]); k++) {
        float sum = 0.0f; /* exact in any order */
        for (int sh = 0; sh < SHARDS; sh++) sum += grad_value(i, t, sh, k);
        g[i][k] = sum / (float)SHARDS;
      }
    }
    assert_ok(dopt_optim_step(opt, (const float *const *)g));
  }
  dopt_digest *d;
  assert_ok(dopt_digest_create(&d));
  for (int i = 0; i < NP; i++) {
    assert_ok(dopt_digest_tensor(d, P[i].name, DOPT_F32, P[i].ndim, P[i].shape, w[i], numel(&P[i]) * sizeof(float)));
    for (int k = 0; k < dopt_optim_num_states(opt, i); k++) {
      dopt_state_view v;
      assert_ok(dopt_optim_state(opt, i, k, &v));
      snprintf(key, sizeof key, "%s/%s", P[i].name, v.name);
      assert_ok(dopt_digest_tensor(d, key, v.dtype, v.ndim, v.shape, v.data, v.bytes));
    }
    int64_t step;
    assert_ok(dopt_optim_get_step(opt, i, &step));
    assert_int_equal(step, steps);
    snprintf(key, sizeof key, "%s/step", P[i].name);
    assert_ok(dopt_digest_tensor(d, key, DOPT_I64, 0, NULL, &step, sizeof step));
  }
  assert_ok(dopt_digest_final(d, NULL, hex));
  dopt_digest_destroy(d);
  for (int i = 0; i < NP; i++) free(w[i]), free(g[i]);
  dopt_optim_destroy(opt);
  dopt_st_free(f);
}

static const struct {
  const char *plugin;
  int tp, dp, zero, copy;
} LAYOUTS[] = {{"ddp", 1, 1, 0, 0}, {"hybrid", 2, 2, 2, 0}, {"fsdp", 1, 3, 3, 0}, {"hybrid", 2, 2, 2, 1},
               {"fsdp", 1, 3, 3, 1}};
#define NL ((int)(sizeof LAYOUTS / sizeof LAYOUTS[0]))

static void layouts_agree(const char *optimizer, int bf16, char first[DOPT_DIGEST_HEX]) {
  for (int l = 0; l < NL; l++) {
    cmp_options o;
    opts(&o, optimizer, LAYOUTS[l].plugin, LAYOUTS[l].tp, LAYOUTS[l].dp, LAYOUTS[l].zero);
    o.bf16 = bf16;
    o.copy_exchanges = LAYOUTS[l].copy;
    char hex[DOPT_DIGEST_HEX];
    run_digest(&o, hex);
    if (l == 0) snprintf(first, DOPT_DIGEST_HEX, "%s", hex);
    else if (strcmp(hex, first) != 0)
      fail_msg("%s%s: %s tp%d dp%d zero%d%s digests %s, %s tp1 dp1 zero0 %s", optimizer, bf16 ? " bf16" : "",
               LAYOUTS[l].plugin, LAYOUTS[l].tp, LAYOUTS[l].dp, LAYOUTS[l].zero, LAYOUTS[l].copy ? " copied" : "",
               hex, LAYOUTS[0].plugin, first);
  }
}

static void check_optimizer(const char *optimizer) {
  char base[DOPT_DIGEST_HEX], want[DOPT_DIGEST_HEX], hex[DOPT_DIGEST_HEX];
  layouts_agree(optimizer, 0, base);
  expected_digest(optimizer, "", STEPS, want);
  if (strcmp(base, want) != 0) fail_msg("%s: compare's digest %s, this test's own %s", optimizer, base, want);
  /* with bf16 working copies the digest covers them too: one value across layouts, another than fp32's */
  char b16[DOPT_DIGEST_HEX];
  layouts_agree(optimizer, 1, b16);
  assert_string_not_equal(b16, base);
  /* one more step */
  cmp_options o;
  opts(&o, optimizer, "hybrid", 2, 2, 2);
  o.steps = STEPS + 1;
  run_digest(&o, hex);
  assert_string_not_equal(hex, base);
  expected_digest(optimizer, "", STEPS + 1, want);
  assert_string_equal(hex, want);
  /* another learning rate */
  opts(&o, optimizer, "fsdp", 1, 3, 3);
  snprintf(o.hparams, sizeof o.hparams, "%s", strcmp(optimizer, "adamw") == 0 ? "lr=2e-3" : "relative_step=false,lr=2e-2");
  run_digest(&o, hex);
  assert_string_not_equal(hex, base);
  expected_digest(optimizer, o.hparams, STEPS, want);
  assert_string_equal(hex, want);
}

static void test_adamw(void **st) {
  (void)st;
  check_optimizer("adamw");
}

static void test_adafactor(void **st) {
  (void)st;
  check_optimizer("adafactor");
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_adamw),
      cmocka_unit_test(test_adafactor),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
