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

extern const dopt_optim_impl dopt_impl_galore_adamw, dopt_impl_adamw8bit;

static const dt_param GP[] = {
    {"layers.0.w", 2, {32, 24}, DOPT_TP_COLUMN, 0},
    {"layers.0.b", 1, {24}, DOPT_TP_REPLICATED, 1},
};
static const dt_param QP[] = {
    {"w", 2, {6, 1024}, DOPT_TP_REPLICATED, 0}, /* torchao #4912's shape: 8-bit whole, 3072 per rank at dp 2 */
};

static int hp_index(const dopt_optim_impl *im, const char *key) {
  for (int k = 0; k < im->nhp; k++)
    if (strcmp(im->hp[k].key, key) == 0) return k;
  fail_msg("%s has no key %s", im->name, key);
  return -1;
}

static int64_t total(const dt_case *c, const dt_result *r, int param, dopt_counter id) {
  int64_t n = 0;
  for (int t = 1; t <= c->steps; t++) n += r->counts[((size_t)t * (size_t)c->nparams + (size_t)param) * DOPT_NCOUNTERS + id];
  return n;
}

/* Runs the distributed side; with_counters 0: the counters are not checked (bits only). Returns dt_compare's
 * verdict, its message in msg. */
static int run_vs(const dt_case *c, const dt_layout *l, const dt_result *ref, int with_counters, char *msg, size_t cap) {
  dt_result got;
  memcpy(got.state_name, ref->state_name, sizeof got.state_name);
  got.ref_counts = with_counters ? ref->counts : NULL;
  memcpy(got.nstates, ref->nstates, sizeof got.nstates);
  char err[512] = "";
  msg[0] = '\0';
  dopt_status s = dt_run_dist(c, l, &got, err, sizeof err);
  const int diverged = s != DOPT_OK ? (snprintf(msg, cap, "failed: %s", err), 1) : dt_compare(c, ref, &got, msg, cap);
  dt_result_free(&got);
  return diverged;
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

static const dopt_optim_impl *galore(void) { return &dopt_impl_galore_adamw; }
static const dopt_optim_impl *q8(void) { return &dopt_impl_adamw8bit; }
static int gap_key, min8_key;

/* A refresh run twice: at every step the matrix's step is first run on copies of its values and states (so a
 * due refresh computes its SVD twice, on the same gradient: the same projector, the same bits) */
static dopt_status twice_step(const dopt_step_args *a) {
  if (a->ndim != 2 || a->piece->len != a->piece->numel || a->stage != 0) return galore()->step(a);
  dopt_state_spec sp[DOPT_MAX_STATES];
  const int ns = galore()->layout(a->hp, a->ndim, a->shape, sp);
  void *copy[DOPT_MAX_STATES] = {0};
  float *w = malloc(a->piece->len * sizeof *w);
  dopt_status s = w ? DOPT_OK : DOPT_ERR_NO_MEMORY;
  for (int k = 0; s == DOPT_OK && k < ns; k++) {
    copy[k] = malloc(sp[k].v.bytes ? sp[k].v.bytes : 1);
    if (!copy[k]) s = DOPT_ERR_NO_MEMORY;
    else memcpy(copy[k], a->state[k], sp[k].v.bytes);
  }
  int64_t cnt[DOPT_NCOUNTERS] = {0};
  int more = 0;
  if (s == DOPT_OK) {
    memcpy(w, a->param, a->piece->len * sizeof *w);
    dopt_step_args b = *a;
    b.param = w, b.state = copy, b.counts = cnt, b.more = &more;
    s = galore()->step(&b);
  }
  if (a->counts) a->counts[DOPT_COUNTER_REFRESHES] += cnt[DOPT_COUNTER_REFRESHES];
  for (int k = 0; k < ns; k++) free(copy[k]);
  free(w);
  return s == DOPT_OK ? galore()->step(a) : s;
}

/* A refresh skipped: after the first, the distributed side never refreshes (a gap it reads as infinite) */
static dopt_status skip_step(const dopt_step_args *a) {
  if (a->step == 1) return galore()->step(a);
  double hp[DOPT_MAX_HPARAMS];
  memcpy(hp, a->hp, (size_t)galore()->nhp * sizeof *hp);
  hp[gap_key] = 1e9;
  dopt_step_args b = *a;
  b.hp = hp;
  return galore()->step(&b);
}

/* A matrix on the plain path: the distributed side sees it flattened (a model built under ZeRO-3 init), so it
 * steps piecewise with the inner AdamW, unprojected */
static int flat(int ndim, const int64_t *shape, int64_t *one) { /* 2-D, or the checking device's [1, h, w] view */
  if (ndim < 2) return 0;
  one[0] = (int64_t)dopt_numel(ndim, shape);
  return 1;
}
static int flat_layout(const double *hp, int ndim, const int64_t *shape, dopt_state_spec *out) {
  int64_t one[1];
  return flat(ndim, shape, one) ? galore()->layout(hp, 1, one, out) : galore()->layout(hp, ndim, shape, out);
}
static int flat_whole(const double *hp, int ndim, const int64_t *shape) {
  int64_t one[1];
  return flat(ndim, shape, one) ? galore()->whole(hp, 1, one) : galore()->whole(hp, ndim, shape);
}
static size_t flat_frame(const double *hp, const dopt_piece *pc) {
  dopt_piece f = *pc;
  f.factored = 0;
  return galore()->frame ? galore()->frame(hp, &f) : 0;
}
static dopt_status flat_step(const dopt_step_args *a) {
  int64_t one[1];
  if (!a->shape || !flat(a->ndim, a->shape, one)) return galore()->step(a);
  dopt_piece f = *a->piece;
  f.factored = 0;
  dopt_step_args b = *a;
  b.ndim = 1, b.shape = one, b.piece = &f;
  return galore()->step(&b);
}

/* The 8-bit decision made on the shard's numel (bitsandbytes #2080, torchao #4912): min_8bit_size compared
 * with numel / dp, dp = 2 */
static const double *shard_hp(const double *hp, size_t numel, double *buf) {
  if ((double)(numel / 2) >= hp[min8_key]) return hp;
  memcpy(buf, hp, (size_t)q8()->nhp * sizeof *buf);
  buf[min8_key] = (double)numel + 1.0; /* fp32 states */
  return buf;
}
static int shard_layout(const double *hp, int ndim, const int64_t *shape, dopt_state_spec *out) {
  double buf[DOPT_MAX_HPARAMS];
  return q8()->layout(shard_hp(hp, dopt_numel(ndim, shape), buf), ndim, shape, out);
}
static size_t shard_frame(const double *hp, const dopt_piece *pc) {
  double buf[DOPT_MAX_HPARAMS];
  return q8()->frame ? q8()->frame(shard_hp(hp, pc->numel, buf), pc) : 0;
}
static dopt_status shard_step(const dopt_step_args *a) {
  double buf[DOPT_MAX_HPARAMS];
  dopt_step_args b = *a;
  b.hp = shard_hp(a->hp, a->piece->numel, buf);
  return q8()->step(&b);
}

static void expect_named(const char *what, const char *msg, const char *needle) {
  printf("planted: %s -> %s\n", what, msg);
  if (!strstr(msg, needle)) fail_msg("planted bug '%s' not named by its counter ('%s'): %s", what, needle, msg);
}

static void test_planted_counts(void **st) {
  (void)st;
  gap_key = hp_index(galore(), "update_proj_gap");
  min8_key = hp_index(q8(), "min_8bit_size");
  static const dt_layout l = {2, 2, 2, 0};
  char msg[512];
  dt_case g = {"galore_adamw", "rank=4,update_proj_gap=2,lr=1e-2", NULL, GP, 2, 6, 1, 0.0, 0, 21, 0.5, 0, 1, 0, 0, 0, 0, 0};
  dt_result ref;
  assert_ok(dt_run_reference(&g, l.dp, &ref));
  /* the correct side passes, with and without the counters: the check is not merely strict */
  if (run_vs(&g, &l, &ref, 1, msg, sizeof msg)) fail_msg("galore_adamw without a planted bug: %s", msg);

  dopt_optim_impl twice = *galore(), skip = *galore(), plain = *galore();
  twice.step = twice_step;
  skip.step = skip_step;
  plain.layout = flat_layout, plain.whole = flat_whole, plain.frame = flat_frame, plain.step = flat_step;

  dt_dist_impl = &twice; /* the same bits at every step: only the counters see it */
  const int bits = run_vs(&g, &l, &ref, 0, msg, sizeof msg);
  if (bits) fail_msg("a repeated refresh was expected to keep the bits: %s", msg);
  assert_true(run_vs(&g, &l, &ref, 1, msg, sizeof msg));
  expect_named("a refresh run twice", msg, "DIVERGED at step 1 (events: galore.refreshes of layers.0.w: reference 1, distributed 2");

  dt_dist_impl = &skip;
  assert_true(run_vs(&g, &l, &ref, 1, msg, sizeof msg));
  expect_named("a refresh skipped", msg, "DIVERGED at step 3 (events: galore.refreshes of layers.0.w: reference 1, distributed 0");

  dt_dist_impl = &plain;
  assert_true(run_vs(&g, &l, &ref, 1, msg, sizeof msg));
  expect_named("a matrix on the plain path", msg, "DIVERGED at step 1 (events: galore.projected of layers.0.w: reference 1, distributed 0");
  dt_dist_impl = NULL;
  dt_result_free(&ref);

  static const dt_layout l2 = {1, 2, 2, 0};
  dt_case q = {"adamw8bit", "lr=1e-2", NULL, QP, 1, 4, 1, 0.0, 0, 22, 0.5, 0, 1, 0, 0, 0, 0, 0};
  assert_ok(dt_run_reference(&q, l2.dp, &ref));
  if (run_vs(&q, &l2, &ref, 1, msg, sizeof msg)) fail_msg("adamw8bit without a planted bug: %s", msg);
  dopt_optim_impl shard = *q8();
  shard.layout = shard_layout, shard.frame = shard_frame, shard.step = shard_step;
  dt_dist_impl = &shard;
  assert_true(run_vs(&q, &l2, &ref, 1, msg, sizeof msg));
  expect_named("an 8-bit decision on the shard's numel", msg, "DIVERGED at step 1 (events: q8.steps of w: reference 1, distributed 0 on rank 0)");
  dt_dist_impl = NULL;
  dt_result_free(&ref);
}

int main(void) {
  const struct CMUnitTest tests[] = {cmocka_unit_test(test_reference_counts), cmocka_unit_test(test_planted_counts)};
  return cmocka_run_group_tests(tests, NULL, NULL);
}
