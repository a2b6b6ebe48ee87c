/* Muon distributed (docs/muon.md, docs/distributed.md#owner-mode): every Muon matrix steps whole on its owner
 * (TP blocks assembled there, the dp sum reduced to its row, its new blocks and shards back), aux Adam
 * piecewise; bitwise the reference outside the CI grid's layouts (tp 5..8, dp 5..8, ZeRO 0..3, uneven splits,
 * a 3-D expert stack, a conv filter, bf16 working copies, 3 micro-batches, clipping, LISA around Muon); and
 * the known bugs of distributed Muon, planted into the distributed side, are caught against the reference:
 * Newton-Schulz on each rank's shard, a matrix on a plain path, an optimizer step per micro-batch, the
 * matrices on the aux-Adam path. */
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "disttest.h"
#include "optim_impl.h"

extern const dopt_optim_impl dopt_impl_muon;

/* "layers.N." for LISA */
static const dt_param P[] = {
    {"layers.0.w", 2, {12, 10}, DOPT_TP_COLUMN, 0},    {"layers.1.o", 2, {10, 12}, DOPT_TP_ROW, 0},
    {"layers.0.experts", 3, {4, 9, 7}, DOPT_TP_COLUMN, 0}, {"conv", 4, {6, 2, 3, 3}, DOPT_TP_COLUMN, 0},
    {"layers.1.b", 1, {12}, DOPT_TP_COLUMN, 1},        {"ln", 1, {10}, DOPT_TP_REPLICATED, 1},
    {"tall", 2, {17, 5}, DOPT_TP_ROW, 0},
};
#define NP ((int)(sizeof P / sizeof P[0]))

static void expect_bitwise(const dt_case *c, const dt_layout *l, dt_result *ref) {
  dt_result got;
  dt_expect(&got, ref);
  char err[512] = "", msg[512] = "";
  if (dt_run_dist(c, l, &got, err, sizeof err) != DOPT_OK)
    fail_msg("%s [%s] tp%d dp%d zero%d: %s", c->optimizer, c->hparams, l->tp, l->dp, l->zero, err);
  if (dt_compare(c, ref, &got, msg, sizeof msg))
    fail_msg("%s [%s] tp%d dp%d zero%d: %s", c->optimizer, c->hparams, l->tp, l->dp, l->zero, msg);
  dt_result_free(&got);
}

static void test_muon_any_layout(void **st) {
  (void)st;
  static const struct {
    const char *opt, *hp;
    int micro, bf16;
    double clip;
  } S[] = {
      {"muon", "lr=2e-2,weight_decay=0.01", 1, 0, 0.0},
      {"muon", "lr=2e-2,ns_dtype=fp32,nesterov=false,adjust_lr_fn=original", 3, 1, 0.05},
      {"lisa", "inner=muon,n_layers=1,interval=2,lr=2e-2", 1, 0, 0.0},
  };
  static const dt_layout L[] = {{5, 1, 0, 0}, {6, 2, 2, 0}, {7, 1, 0, 1}, {8, 1, 0, 0}, {1, 5, 3, 0},
                                {1, 6, 2, 256}, {2, 7, 3, 0}, {1, 8, 1, 0}, {3, 5, 3, 0}};
  int runs = 0;
  for (size_t k = 0; k < sizeof S / sizeof S[0]; k++) {
    dt_case c = {S[k].opt, S[k].hp, NULL, P, NP, 8, S[k].micro, S[k].clip, S[k].bf16, 700 + (uint64_t)k, 0.5, 0, 4,
                 0, 0, 0, 0, 0};
    dt_result ref[9];
    int have[9] = {0};
    for (size_t li = 0; li < sizeof L / sizeof L[0]; li++) {
      const int dp = L[li].dp;
      if (!have[dp]) {
        assert_ok(dt_run_reference(&c, dp, &ref[dp]));
        have[dp] = 1;
      }
      expect_bitwise(&c, &L[li], &ref[dp]);
      runs++;
    }
    for (int d = 0; d < 9; d++)
      if (have[d]) dt_result_free(&ref[d]);
  }
  printf("muon: %d runs outside the grid, bitwise\n", runs);
}

/* Owner units: an expert stack's experts spread over owners. Two stacks (6 and 5 experts, COLUMN and ROW) and
 * a matrix, Muon only, at world 4 and 8: bitwise; every rank holds momentum (state bytes > 0), none a whole
 * stack (the old one-owner-per-tensor layout put each stack's 1 512 or 960 bytes on one rank), the bytes of all
 * ranks sum to the reference's, and with units enough each rank's share is within one expert of the mean. */
static void test_muon_expert_owners(void **st) {
  (void)st;
  static const dt_param Q[] = {
      {"layers.0.experts.up", 3, {6, 9, 7}, DOPT_TP_COLUMN, 0},
      {"layers.0.experts.down", 3, {5, 8, 6}, DOPT_TP_ROW, 0},
      {"layers.0.w", 2, {10, 12}, DOPT_TP_COLUMN, 0},
  };
  static const dt_layout L[] = {{2, 2, 1, 0}, {1, 4, 3, 0}, {2, 4, 2, 0}, {4, 2, 3, 0}, {1, 8, 0, 0}};
  const size_t stack = 6 * 63 * 4, total = stack + 5 * 48 * 4 + 120 * 4;
  for (size_t li = 0; li < sizeof L / sizeof L[0]; li++) {
    dt_case c = {"muon", "lr=2e-2,weight_decay=0.01", NULL, Q, 3, 6, 2, 0.0, 0, 900 + (uint64_t)li, 0.5, 0, 3,
                 0, 0, 0, 0, 0};
    dt_result ref;
    assert_ok(dt_run_reference(&c, L[li].dp, &ref));
    dt_result got;
    dt_expect(&got, &ref);
    char err[512] = "", msg[512] = "";
    if (dt_run_dist(&c, &L[li], &got, err, sizeof err) != DOPT_OK) fail_msg("tp%d dp%d: %s", L[li].tp, L[li].dp, err);
    if (dt_compare(&c, &ref, &got, msg, sizeof msg)) fail_msg("tp%d dp%d zero%d: %s", L[li].tp, L[li].dp, L[li].zero, msg);
    const int W = L[li].tp * L[li].dp;
    size_t sum = 0, most = 0;
    for (int r = 0; r < W; r++) {
      sum += got.state_mem[r];
      most = got.state_mem[r] > most ? got.state_mem[r] : most;
      if (got.state_mem[r] == 0) fail_msg("tp%d dp%d: rank %d holds no momentum", L[li].tp, L[li].dp, r);
    }
    assert_int_equal(sum, total);
    assert_int_equal(ref.ref_state_mem, total);
    if (most >= stack) fail_msg("tp%d dp%d: a rank holds %zu bytes, a whole stack is %zu", L[li].tp, L[li].dp, most, stack);
    if (W == 4 && most > total / 4 + 63 * 4) fail_msg("tp%d dp%d: %zu bytes on one rank, mean %zu", L[li].tp, L[li].dp, most, total / 4);
    printf("owner units tp%d dp%d: max rank %zu of %zu bytes (mean %zu)\n", L[li].tp, L[li].dp, most, total, total / (size_t)W);
    dt_result_free(&got);
    dt_result_free(&ref);
  }
}

/* ---- planted bugs: the distributed side runs a broken Muon --------------------------------------------- */

static const dopt_optim_impl *real(void) { return &dopt_impl_muon; }

/* Newton-Schulz on each rank's own shard: the matrices step piecewise, each piece orthogonalised as a [1, len]
 * matrix of its own (a ZeRO-sharded Muon without the gather) */
static int shard_whole(const double *hp, int ndim, const int64_t *shape) {
  (void)hp, (void)ndim, (void)shape;
  return 0;
}
static dopt_status shard_step(const dopt_step_args *a) {
  if (!a->piece->factored || a->piece->len == a->piece->numel) return real()->step(a);
  dopt_piece fake;
  const int64_t shape[2] = {1, (int64_t)a->piece->len};
  dopt_piece_full(2, shape, &fake);
  dopt_step_args b = *a;
  b.piece = &fake, b.ndim = 2, b.shape = shape, b.red = NULL;
  return real()->step(&b);
}

/* a matrix on a plain path: the 3-D expert stack's update skips the iteration (ns_steps 0: only normalised) */
static dopt_status plain_step(const dopt_step_args *a) {
  if (a->ndim != 3) return real()->step(a);
  double hp[DOPT_MAX_HPARAMS];
  memcpy(hp, a->hp, (size_t)real()->nhp * sizeof *hp);
  for (int k = 0; k < real()->nhp; k++)
    if (strcmp(real()->hp[k].key, "ns_steps") == 0) hp[k] = 0.0;
  dopt_step_args b = *a;
  b.hp = hp;
  return real()->step(&b);
}

/* a matrix silently on the aux-Adam path: the distributed side sees each 2-D matrix flattened to 1-D (what a
 * model built under ZeRO-3 init hands the optimizer), so use_muon=auto steps it with Adam */
static int flat(int ndim, const int64_t *shape, int64_t *one) {
  if (ndim != 2) return 0;
  one[0] = shape[0] * shape[1];
  return 1;
}
static int flat_layout(const double *hp, int ndim, const int64_t *shape, dopt_state_spec *out) {
  int64_t one[1];
  return flat(ndim, shape, one) ? real()->layout(hp, 1, one, out) : real()->layout(hp, ndim, shape, out);
}
static int flat_whole(const double *hp, int ndim, const int64_t *shape) {
  int64_t one[1];
  return flat(ndim, shape, one) ? real()->whole(hp, 1, one) : real()->whole(hp, ndim, shape);
}
static dopt_status flat_step(const dopt_step_args *a) {
  int64_t one[1];
  if (!a->shape || !flat(a->ndim, a->shape, one)) return real()->step(a);
  dopt_step_args b = *a;
  b.ndim = 1, b.shape = one;
  return real()->step(&b);
}

static void test_muon_planted_bugs(void **st) {
  (void)st;
  dopt_optim_impl shard = dopt_impl_muon, plain = dopt_impl_muon, aux = dopt_impl_muon;
  shard.whole = shard_whole, shard.step = shard_step;
  plain.step = plain_step;
  aux.layout = flat_layout, aux.whole = flat_whole, aux.step = flat_step;
  static const dt_layout l = {2, 2, 2, 0};
  dt_case c = {"muon", "lr=2e-2", NULL, P, NP, 6, 3, 0.0, 0, 77, 0.5, 0, 3, 0, 0, 0, 0, 0};
  dt_result ref;
  assert_ok(dt_run_reference(&c, l.dp, &ref));
  char msg[512] = "";
  /* the correct distributed Muon first: the harness is not merely strict */
  if (dt_diverges(&c, &l, &ref, 1, msg, sizeof msg)) fail_msg("muon without a planted bug: %s", msg);
  static const char *const what[] = {"Newton-Schulz on each rank's shard", "the expert stack on a plain path",
                                     "an optimizer step per micro-batch", "the matrices on the aux-Adam path"};
  for (int k = 0; k < 4; k++) {
    dt_dist_impl = k == 0 ? &shard : k == 1 ? &plain : k == 3 ? &aux : NULL;
    dt_step_per_micro = k == 2;
    msg[0] = '\0';
    const int got = dt_diverges(&c, &l, &ref, 1, msg, sizeof msg);
    dt_dist_impl = NULL;
    dt_step_per_micro = 0;
    if (!got) fail_msg("planted bug not caught: %s", what[k]);
    printf("planted: %s -> %s\n", what[k], msg);
    /* each is a wrong amount of work: named by a counter at step 1, before any bit is compared */
    if (!strstr(msg, "DIVERGED at step 1 (events: ")) fail_msg("planted bug not named by a counter: %s: %s", what[k], msg);
  }
  dt_result_free(&ref);
}

int main(void) {
  const struct CMUnitTest tests[] = {cmocka_unit_test(test_muon_any_layout), cmocka_unit_test(test_muon_expert_owners),
                                     cmocka_unit_test(test_muon_planted_bugs)};
  return cmocka_run_group_tests(tests, NULL, NULL);
}
