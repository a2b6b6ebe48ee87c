/* The equivalence grid: every optimizer × plugin × layout (tp, dp, zero) on
 * a parameter set with square, tall, wide, 1-D, H=1, 3-D and scalar tensors
 * whose sizes divide neither tp nor dp, run for 100 steps and compared bit
 * for bit with the single-device reference: every gathered parameter, every
 * optimizer state, every step counter. DOPT_GRID_FULL=1 runs every layout
 * tp, dp ∈ {1..4} × zero ∈ {0..3} and more hyperparameter settings. */
#include "testutil.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "disttest.h"
#include "optim_impl.h"

/* "layers.N." names give LISA three layers; the others are always trained */
static const dt_param PARAMS[] = {
    {"layers.0.sq", 2, {12, 12}, DOPT_TP_COLUMN, 0},  {"layers.1.tall", 2, {13, 5}, DOPT_TP_ROW, 0},
    {"layers.2.wide", 2, {5, 17}, DOPT_TP_COLUMN, 0}, {"emb", 2, {11, 6}, DOPT_TP_COLUMN, 0},
    {"h1", 2, {1, 11}, DOPT_TP_ROW, 0},               {"h1col", 2, {1, 7}, DOPT_TP_COLUMN, 0},
    {"layers.1.t3", 3, {2, 3, 5}, DOPT_TP_COLUMN, 0}, {"layers.0.vec", 1, {7}, DOPT_TP_COLUMN, 1},
    {"bias", 1, {9}, DOPT_TP_REPLICATED, 1},          {"zeros", 2, {3, 4}, DOPT_TP_REPLICATED, 0},
    {"s0", 0, {0}, DOPT_TP_REPLICATED, 1},
};
#define NPARAMS ((int)(sizeof PARAMS / sizeof PARAMS[0]))

typedef struct hp_setting {
  const char *opt, *hp;
} hp_setting;

/* The settings come from the registry: every registered optimizer with the
 * grid settings declared next to its step (dopt_optim_impl.grid: 8-bit with
 * 256-blocks on tensors that are not multiples of the block; GaLore
 * refreshing every few steps; LISA with a piecewise and an owner-mode inner
 * optimizer; ...), the first grid_ci of them on CI, all under
 * DOPT_GRID_FULL=1. piecewise: only the distributable, non-wrapper ones. */
#define MAX_SETTINGS 256
static int registry_settings(hp_setting *out, int full, int piecewise) {
  int n = 0;
  for (int i = 0; i < dopt_optim_registry_count(); i++) {
    dopt_optim_info in;
    assert_ok(dopt_optim_registry_info(i, &in));
    assert_true(in.grid_count >= 1 && in.grid_ci >= 1 && in.grid_ci <= in.grid_count);
    if (piecewise && (!in.distributable || in.wrapper)) continue;
    for (int k = 0; k < (full ? in.grid_count : in.grid_ci); k++) {
      if (n == MAX_SETTINGS) fail_msg("more than %d grid settings in the registry", MAX_SETTINGS);
      out[n++] = (hp_setting){in.name, in.grid[k]};
    }
  }
  return n;
}

/* CI layouts: every tp, dp and zero value, each plugin, uneven splits; the
 * statistics reduced in one bucket (0), a bucket per parameter (1 byte) or a
 * few parameters per bucket (256 bytes). */
static const dt_layout CI_LAYOUTS[] = {
    {1, 1, 0, 0}, {1, 2, 0, 1}, {1, 3, 1, 256}, {1, 4, 2, 0},  {2, 1, 0, 1}, {2, 2, 1, 256}, {2, 2, 2, 0},
    {3, 2, 0, 1}, {4, 1, 2, 256}, {2, 3, 3, 0}, {1, 3, 3, 1}, {3, 4, 2, 256}, {4, 2, 1, 0},  {4, 4, 3, 1},
};

/* The grid's layouts per setting, counted whether run or not (dt_subset_keep: the sanitizer passes'
 * rotating subset), for the summary lines. */
static int grid_candidates;

static uint64_t setting_key(const hp_setting *hp, int steps, int dp_sum, int ring) {
  uint64_t k = 1469598103934665603ull; /* FNV-1a over the name, the setting and the call */
  for (const char *p = hp->opt; *p; p++) k = (k ^ (unsigned char)*p) * 1099511628211ull;
  for (const char *p = hp->hp ? hp->hp : ""; *p; p++) k = (k ^ (unsigned char)*p) * 1099511628211ull;
  return k ^ ((uint64_t)steps << 40 | (uint64_t)dp_sum << 20 | (uint64_t)ring);
}

/* dp_sum, ring: dt_case's (the dp-sum mode; the simulator's ring order) */
static int run_grid(const hp_setting *hps, int nhp, const dt_layout *lays, int nlay, int steps, int dp_sum, int ring) {
  int runs = 0;
  for (int h = 0; h < nhp; h++) {
    const uint64_t key = setting_key(&hps[h], steps, dp_sum, ring);
    dt_case c = {hps[h].opt, hps[h].hp, NULL, PARAMS, NPARAMS, steps, 1, 0.0, 0, 1234 + (uint64_t)h, 0.05, 0, 25, dp_sum,
                 ring, 0, 0, 0};
    dt_result ref[9];
    int have_ref[9] = {0};
    for (int li = 0; li < nlay; li++) {
      const dt_layout *l = &lays[li];
      grid_candidates++;
      if (!dt_subset_keep(key, li, nlay)) continue;
      if (!have_ref[l->dp]) {
        assert_ok(dt_run_reference(&c, l->dp, &ref[l->dp]));
        have_ref[l->dp] = 1;
      }
      dt_result got;
      dt_expect(&got, &ref[l->dp]);
      char err[512] = "", msg[512] = "";
      dopt_status s = dt_run_dist(&c, l, &got, err, sizeof err);
      if (s != DOPT_OK) fail_msg("%s [%s] tp%d dp%d zero%d (%s): %s", c.optimizer, c.hparams ? c.hparams : "", l->tp, l->dp, l->zero, dt_plugin(l), err);
      if (dt_compare(&c, &ref[l->dp], &got, msg, sizeof msg))
        fail_msg("%s [%s] tp%d dp%d zero%d (%s) dp_sum %d%s: not bitwise equal: %s", c.optimizer,
                 c.hparams ? c.hparams : "", l->tp, l->dp, l->zero, dt_plugin(l), dt_dp_words(&c),
                 ring ? " ring order" : "", msg);
      dt_result_free(&got);
      runs++;
    }
    for (int d = 0; d < 9; d++)
      if (have_ref[d]) dt_result_free(&ref[d]);
  }
  return runs;
}

static void test_grid(void **st) {
  (void)st;
  const char *full = getenv("DOPT_GRID_FULL");
  int runs;
  grid_candidates = 0;
  if (full && full[0] == '1') {
    static dt_layout all[64];
    int n = 0;
    for (int tp = 1; tp <= 4; tp++)
      for (int dp = 1; dp <= 4; dp++)
        for (int z = 0; z <= 3; z++) all[n++] = (dt_layout){tp, dp, z, (size_t)(n % 3 == 0 ? 0 : n % 3 == 1 ? 1 : 256)};
    hp_setting h[MAX_SETTINGS];
    runs = run_grid(h, registry_settings(h, 1, 0), all, n, 100, 0, 0);
  } else {
    hp_setting h[MAX_SETTINGS];
    runs = run_grid(h, registry_settings(h, 0, 0), CI_LAYOUTS, (int)(sizeof CI_LAYOUTS / sizeof CI_LAYOUTS[0]), 100, 0,
                    0);
  }
  printf("equivalence grid: %d registered optimizers, %d of %d runs (%s) x 100 steps, %d parameters, bitwise equal\n",
         dopt_optim_registry_count(), runs, grid_candidates, dt_subset_desc(), NPARAMS);
}

/* Runs case c in layout l beside its reference; fails naming `what` unless the run succeeds and every rank is
 * bitwise the reference (dt_compare). *got keeps the distributed run (dt_result_free it). */
static void run_bitwise(const dt_case *c, const dt_layout *l, const char *what, dt_result *got) {
  dt_result ref;
  assert_ok(dt_run_reference(c, l->dp, &ref));
  dt_expect(got, &ref);
  char err[512] = "", msg[512] = "";
  if (dt_run_dist(c, l, got, err, sizeof err) != DOPT_OK) fail_msg("%s: %s", what, err);
  if (dt_compare(c, &ref, got, msg, sizeof msg)) fail_msg("%s: not bitwise equal: %s", what, msg);
  dt_result_free(&ref);
}

/* Pipeline stages (docs/distributed.md "Pipeline stages"): the 11 parameters in 2, 3 or 4 contiguous runs
 * (dt_stage: 6 + 5; 4 + 4 + 3; 3 + 3 + 3 + 2), each stage a tp x dp x ZeRO grid of its own, with clipping
 * across the stages; every registered optimizer's CI settings, bitwise the reference on every rank, every
 * rank's piece obeying the layout rule (a parameter on one stage, empty pieces elsewhere). */
static const dt_layout PP_LAYOUTS[] = {{2, 2, 2, 0}, {1, 3, 1, 256}, {2, 1, 0, 1}, {2, 2, 3, 256}, {3, 1, 2, 0}};
static const int PP_STAGES[] = {2, 3, 4, 2, 3};

static int no_stages(void **st) { /* also after a failure: the next tests run without stages */
  (void)st;
  dt_pp = 0;
  return 0;
}

static void test_grid_pipeline(void **st) {
  (void)st;
  hp_setting h[MAX_SETTINGS];
  const int nh = registry_settings(h, 0, 0), nl = (int)(sizeof PP_LAYOUTS / sizeof PP_LAYOUTS[0]);
  int runs = 0;
  grid_candidates = 0;
  for (int k = 0; k < nh; k++)
    for (int li = 0; li < nl; li++) {
      const dt_layout *l = &PP_LAYOUTS[li];
      grid_candidates++;
      if (!dt_subset_keep(setting_key(&h[k], 20, 0, 0) ^ 0x7070, li, nl)) continue;
      dt_pp = PP_STAGES[li];
      dt_case c = {h[k].opt, h[k].hp, NULL, PARAMS, NPARAMS, 20, 2, li % 2 ? 0.05 : 0.0, li == 4, 99 + (uint64_t)k,
                   0.05, li == 2 ? 7 : 0, 5, 0, 0, 0, 0, 0};
      char what[256];
      snprintf(what, sizeof what, "%s [%s] pp%d tp%d dp%d zero%d", c.optimizer, c.hparams ? c.hparams : "", dt_pp,
               l->tp, l->dp, l->zero);
      dt_result got;
      run_bitwise(&c, l, what, &got);
      if (li == 2 && got.skipped != 1) fail_msg("%s pp4: a NaN on stage 0 skipped %lld steps, not 1", c.optimizer,
                                               (long long)got.skipped);
      dt_result_free(&got);
      runs++;
    }
  printf("pipeline stages: %d of %d runs (%s; pp 2-4, clipping, bf16, a NaN on one stage) x 20 steps x 2 "
         "micro-batches, bitwise equal\n", runs, grid_candidates, dt_subset_desc());
}

/* Gemini (docs/distributed.md "Gemini: chunked ZeRO"): the parameters packed into chunks that divide nothing
 * (37, 100 elements: tensors larger than a chunk get their own; 1000: every tensor in one chunk, so every
 * shard edge cuts through a tensor), each chunk split evenly over dp 2-8, with tp and pipeline stages; every
 * registered optimizer's CI settings bitwise the reference on every rank, every piece under the layout rule
 * (dt_compare). */
static const dt_layout GEM_LAYOUTS[] = {{1, 2, 3, 0}, {2, 3, 3, 256}, {1, 8, 3, 1}, {3, 2, 3, 0}, {1, 5, 3, 256}};
static const size_t GEM_CHUNKS[] = {37, 100, 1000, 37, 1000};
static const int GEM_STAGES[] = {1, 1, 1, 1, 2};

static int per_tensor(void **st) { /* also after a failure */
  (void)st;
  dt_chunk = 0;
  dt_pp = 0;
  return 0;
}

/* The pieces Gemini must give at tp 1 without stages, computed here from the rule in docs/distributed.md (not
 * from the library's code): tensors in order into chunks of C = chunk rounded up to a multiple of dp, a tensor
 * joining the open chunk when it fits, a larger one alone in a chunk of its size rounded up; rank q holds
 * [q·S, (q+1)·S) of each chunk, S = chunk / dp. Every rank's piece of every parameter must be that range. */
static void expect_gemini_pieces(const dt_result *got, size_t chunk, int dp) {
  const size_t D = (size_t)dp, C = (chunk + D - 1) / D * D;
  size_t fill = 0;
  int open = 0;
  for (int i = 0; i < NPARAMS; i++) {
    size_t n = 1;
    for (int k = 0; k < PARAMS[i].ndim; k++) n *= (size_t)PARAMS[i].shape[k];
    size_t off = 0, size = C;
    if (n > C) {
      size = (n + D - 1) / D * D, open = 0;
    } else {
      if (!open || fill + n > C) open = 1, fill = 0;
      off = fill, fill += n;
    }
    const size_t S = size / D;
    for (size_t q = 0; q < D; q++) {
      const size_t a = q * S > off ? q * S - off : 0, b = (q + 1) * S > off ? (q + 1) * S - off : 0;
      const size_t lo = a < n ? a : n, len = (b < n ? b : n) - lo;
      const dopt_layout_piece *pc = &got->layout[q][i];
      if ((size_t)pc->len != len || (len && (size_t)pc->lo != lo))
        fail_msg("gemini chunk %zu dp %d: rank %zu's piece of %s is [%lld, +%lld), the chunks give [%zu, +%zu)", chunk,
                 dp, q, PARAMS[i].name, (long long)pc->lo, (long long)pc->len, lo, len);
    }
  }
}

static void test_grid_gemini(void **st) {
  (void)st;
  hp_setting h[MAX_SETTINGS];
  const int nh = registry_settings(h, 0, 0), nl = (int)(sizeof GEM_LAYOUTS / sizeof GEM_LAYOUTS[0]);
  int runs = 0;
  grid_candidates = 0;
  for (int k = 0; k < nh; k++)
    for (int li = 0; li < nl; li++) {
      const dt_layout *l = &GEM_LAYOUTS[li];
      grid_candidates++;
      if (!dt_subset_keep(setting_key(&h[k], 20, 0, 0) ^ 0x6e6e, li, nl)) continue;
      dt_chunk = GEM_CHUNKS[li];
      dt_pp = GEM_STAGES[li];
      dt_case c = {h[k].opt, h[k].hp, NULL, PARAMS, NPARAMS, 20, 2, li == 1 ? 0.05 : 0.0, li == 3, 55 + (uint64_t)k,
                   0.05, 0, 5, 0, 0, 0, 0, 0};
      char what[256];
      snprintf(what, sizeof what, "%s [%s] gemini chunk %zu tp%d dp%d pp%d", c.optimizer, c.hparams ? c.hparams : "",
               dt_chunk, l->tp, l->dp, dt_pp);
      dt_result got;
      run_bitwise(&c, l, what, &got);
      if (l->tp == 1 && dt_pp == 1 && strcmp(c.optimizer, "adamw") == 0) expect_gemini_pieces(&got, dt_chunk, l->dp);
      dt_result_free(&got);
      runs++;
    }
  printf("gemini chunks: %d of %d runs (%s; chunks 37/100/1000, dp 2-8, tp, pp) x 20 steps x 2 micro-batches, "
         "bitwise equal\n", runs, grid_candidates, dt_subset_desc());
}

/* MoE-Hybrid (docs/distributed.md "MoE-Hybrid"): six of the parameters are experts 0-5 (square, tall, wide,
 * H=1, 3-D and a 1-D bias: every kind of piece), the others dense; ep 2 and 4 (6 experts on ep 4: two ranks
 * hold two experts, two hold one), moe_dp 1-2, with tp 1-3, every ZeRO stage of the plugin, clipping, bf16,
 * two pipeline stages, a NaN in an expert's gradient; every registered optimizer's CI settings bitwise the
 * reference (each expert summed over its moe_dp ranks only) on every rank, every piece under the layout rule;
 * and the pieces themselves: an expert's on its ep rank's ranks only, with its expert id. */
static const int MOE_EXPERTS[NPARAMS] = {0, 1, 2, -1, 3, -1, 4, -1, 5, -1, -1};
static const dt_layout MOE_LAYOUTS[] = {{1, 4, 1, 0}, {2, 4, 2, 256}, {2, 2, 0, 1}, {1, 8, 2, 0}, {3, 4, 1, 256}};
static const int MOE_EP[] = {4, 2, 2, 4, 2};
static const int MOE_STAGES[] = {1, 1, 1, 1, 2};

static int no_experts(void **st) { /* also after a failure */
  (void)st;
  dt_basic_transport = 0;
  dt_ep = 0;
  dt_experts = NULL;
  dt_nexperts = 0;
  dt_pp = 0;
  return 0;
}

/* Every rank's piece of every expert parameter: nothing off its ep rank, its expert id everywhere. */
static void expect_moe_pieces(const dt_result *got, const dt_layout *l, int ep) {
  for (int r = 0; r < got->nlayout; r++)
    for (int i = 0; i < NPARAMS; i++) {
      const dopt_layout_piece *pc = &got->layout[r][i];
      const int q = r / l->tp % l->dp, e = MOE_EXPERTS[i];
      if (pc->expert != e) fail_msg("ep %d: rank %d's piece of %s names expert %d, not %d", ep, r, PARAMS[i].name, pc->expert, e);
      if (e >= 0 && q % ep != dopt_dist_expert_rank(e, 6, ep) && pc->len != 0)
        fail_msg("ep %d: rank %d (ep rank %d) holds %lld elements of %s (expert %d, on ep rank %d)", ep, r, q % ep,
                 (long long)pc->len, PARAMS[i].name, e, dopt_dist_expert_rank(e, 6, ep));
    }
}

static void test_grid_moe(void **st) {
  (void)st;
  hp_setting h[MAX_SETTINGS];
  const int nh = registry_settings(h, 0, 0), nl = (int)(sizeof MOE_LAYOUTS / sizeof MOE_LAYOUTS[0]);
  int runs = 0;
  grid_candidates = 0;
  /* the placement rule itself: 6 experts on ep 4 -> ranks 0 0 1 1 2 3; 7 on 3 -> 0 0 0 1 1 2 2 */
  const int want4[6] = {0, 0, 1, 1, 2, 3}, want3[7] = {0, 0, 0, 1, 1, 2, 2};
  for (int e = 0; e < 6; e++) assert_int_equal(dopt_dist_expert_rank(e, 6, 4), want4[e]);
  for (int e = 0; e < 7; e++) assert_int_equal(dopt_dist_expert_rank(e, 7, 3), want3[e]);
  assert_int_equal(dopt_dist_expert_rank(6, 6, 4), -1);
  dt_experts = MOE_EXPERTS;
  dt_nexperts = 6;
  for (int k = 0; k < nh; k++)
    for (int li = 0; li < nl; li++) {
      const dt_layout *l = &MOE_LAYOUTS[li];
      grid_candidates++;
      /* wide magnitudes inside each block (layouts 1 and 4: moe_dp 2, ep 2): a sum sized for dp instead of the
       * expert's moe_dp group grids them otherwise; the first setting's always run (the rotating subset aside) */
      const int wide = li == 1 || li == 4;
      if (!dt_subset_keep(setting_key(&h[k], 20, 0, 0) ^ 0x6d6f, li, nl) && !(wide && k == 0)) continue;
      dt_ep = MOE_EP[li];
      dt_pp = MOE_STAGES[li];
      dt_case c = {h[k].opt, h[k].hp, NULL, PARAMS, NPARAMS, 20, 2, li % 2 ? 0.05 : 0.0, li == 2, 77 + (uint64_t)k,
                   0.05, li == 3 ? 6 : 0, 5, 0, 0, wide, 0, 0};
      char what[256];
      snprintf(what, sizeof what, "%s [%s] moe_hybrid ep%d tp%d dp%d zero%d pp%d", c.optimizer,
               c.hparams ? c.hparams : "", dt_ep, l->tp, l->dp, l->zero, dt_pp);
      dt_result got;
      run_bitwise(&c, l, what, &got);
      if (li == 3 && got.skipped != 1) fail_msg("%s: a NaN in expert 0's gradient skipped %lld steps, not 1", what,
                                               (long long)got.skipped);
      expect_moe_pieces(&got, l, dt_ep);
      dt_result_free(&got);
      runs++;
    }
  printf("moe_hybrid: %d of %d runs (%s; 6 experts on ep 2 and 4, moe_dp 1-2, tp 1-3, zero 0-2, pp, clipping, "
         "bf16, a NaN in an expert) x 20 steps x 2 micro-batches, bitwise equal\n", runs, grid_candidates,
         dt_subset_desc());
}

/* MoE-Hybrid with expert stacks (DOPT_DIST_EXPERT_STACK): three stacks of 6 experts (column-, row-split and
 * replicated within each expert, sizes that divide nothing) beside dense tensors, ep 2, 3, 4 and 6 (6 experts on
 * 4 ranks: 2, 2, 1, 1), moe_dp 1-2, tp 1-3, zero 1-2, clipping, bf16, a pipeline; every registered optimizer's CI
 * settings bitwise the reference (each element's expert summed over dp with zeros off its ep rank, divided by
 * moe_dp · micro), and every rank's piece of a stack inside its ep rank's experts (but Muon's: owner mode). */
static const dt_param STACK_PARAMS[] = {
    {"layers.0.experts.w1", 3, {6, 5, 7}, DOPT_TP_COLUMN, 0}, {"layers.0.experts.w2", 3, {6, 7, 5}, DOPT_TP_ROW, 0},
    {"layers.1.experts.g", 3, {6, 3, 4}, DOPT_TP_REPLICATED, 0}, {"emb", 2, {11, 6}, DOPT_TP_COLUMN, 0},
    {"layers.1.sq", 2, {12, 12}, DOPT_TP_COLUMN, 0}, {"bias", 1, {9}, DOPT_TP_REPLICATED, 1},
};
#define NSTACK ((int)(sizeof STACK_PARAMS / sizeof STACK_PARAMS[0]))
static const int STACK_EXPERTS[NSTACK] = {DOPT_DIST_EXPERT_STACK, DOPT_DIST_EXPERT_STACK, DOPT_DIST_EXPERT_STACK,
                                          -1, -1, -1};
static const dt_layout STK_LAYOUTS[] = {{1, 4, 1, 0}, {2, 4, 2, 256}, {3, 6, 1, 1}, {1, 4, 2, 0}, {2, 6, 2, 0}};
static const int STK_EP[] = {2, 4, 3, 2, 6};
static const int STK_STAGES[] = {1, 1, 1, 2, 1};

/* Every rank's piece of a stack: its first and last element in an expert of its own ep rank, no expert id. */
static void expect_stack_pieces(const dt_result *got, const dt_layout *l, int ep) {
  for (int r = 0; r < got->nlayout; r++)
    for (int i = 0; i < 3; i++) {
      const dopt_layout_piece *pc = &got->layout[r][i];
      const int q = r / l->tp % l->dp;
      const int64_t per = STACK_PARAMS[i].shape[1] * STACK_PARAMS[i].shape[2];
      for (int end = 0; end < 2 && pc->len > 0; end++) {
        const int64_t at = dopt_layout_piece_elem(3, STACK_PARAMS[i].shape, pc, end ? pc->len - 1 : 0);
        if (dopt_dist_expert_rank((int)(at / per), 6, ep) != q % ep)
          fail_msg("ep %d: rank %d (ep rank %d) holds element %lld of %s (piece [%lld, +%lld)): expert %lld's", ep,
                   r, q % ep, (long long)at, STACK_PARAMS[i].name, (long long)pc->lo, (long long)pc->len,
                   (long long)(at / per));
      }
      if (pc->expert != -1) fail_msg("ep %d: rank %d's piece of stack %s names expert %d", ep, r, STACK_PARAMS[i].name, pc->expert);
    }
}

/* 1 when optimizer opt with hp steps a [6, 5, 7] stack whole in owner mode (Muon's, SOAP's preconditioned
 * tensors): its owners are spread over the world, not its ep rank (for a wrapper: its inner's rule) */
static int stacks_owned(const char *opt, const char *hp) {
  dopt_optim *o;
  if (dopt_optim_create(opt, hp, &o) != DOPT_OK) return 0;
  const int w = dopt__impl_whole(dopt__optim_impl(o), dopt__optim_group_hp(o, 0), 3, STACK_PARAMS[0].shape);
  dopt_optim_destroy(o);
  return w;
}

static void test_grid_moe_stacks(void **st) {
  (void)st;
  hp_setting h[MAX_SETTINGS];
  const int nh = registry_settings(h, 0, 0), nl = (int)(sizeof STK_LAYOUTS / sizeof STK_LAYOUTS[0]);
  int runs = 0;
  grid_candidates = 0;
  dt_experts = STACK_EXPERTS;
  dt_nexperts = 6;
  for (int k = 0; k < nh; k++)
    for (int li = 0; li < nl; li++) {
      const dt_layout *l = &STK_LAYOUTS[li];
      grid_candidates++;
      const int wide = li == 0; /* wide magnitudes inside each block, moe_dp 2 (see test_grid_moe); always the first */
      if (!dt_subset_keep(setting_key(&h[k], 12, 0, 0) ^ 0x7374, li, nl) && !(wide && k == 0)) continue;
      dt_ep = STK_EP[li];
      dt_pp = STK_STAGES[li];
      dt_case c = {h[k].opt, h[k].hp, NULL, STACK_PARAMS, NSTACK, 12, 2, li % 2 ? 0.05 : 0.0, li == 2, 91 + (uint64_t)k,
                   0.05, 0, 4, 0, 0, wide, 0, 0};
      char what[256];
      snprintf(what, sizeof what, "%s [%s] moe_hybrid stacks ep%d tp%d dp%d zero%d pp%d", c.optimizer,
               c.hparams ? c.hparams : "", dt_ep, l->tp, l->dp, l->zero, dt_pp);
      dt_result got;
      run_bitwise(&c, l, what, &got);
      /* Muon and SOAP step a stack's experts whole in owner mode: its owners are spread over the world, not its ep
       * rank */
      if (dt_pp == 1 && !strstr(c.optimizer, "muon") && !(c.hparams && strstr(c.hparams, "muon")) &&
          !stacks_owned(c.optimizer, c.hparams))
        expect_stack_pieces(&got, l, dt_ep);
      dt_result_free(&got);
      runs++;
    }
  printf("moe_hybrid expert stacks: %d of %d runs (%s; 3 stacks of 6 experts on ep 2-6, tp 1-3, zero 1-2, pp, "
         "clipping, bf16) x 12 steps x 2 micro-batches, bitwise equal\n", runs, grid_candidates, dt_subset_desc());
}

/* MoE-Hybrid on the fallbacks: the rank-order fp32 dp sum (each expert over its moe_dp ranks in rank order), and
 * transports without reduce and all_to_allv (the exact sum's integer words per tensor over moe_dp, the owners'
 * exchanges as broadcasts); owner mode (GaLore), 8-bit blocks and factored statistics, ep 2 and 4. */
static void test_grid_moe_fallbacks(void **st) {
  (void)st;
  static const struct {
    const char *opt, *hp;
  } O[] = {{"galore_adamw", "rank=2,update_proj_gap=3,lr=1e-2"},
           {"adamw8bit", "min_8bit_size=16,block_size=64,lr=1e-2"},
           {"adafactor", "beta1=0.9"}};
  static const dt_layout L[] = {{2, 4, 2, 0}, {1, 4, 1, 256}};
  static const int EP[] = {2, 4};
  dt_experts = MOE_EXPERTS;
  dt_nexperts = 6;
  int runs = 0;
  for (int k = 0; k < 3; k++)
    for (int li = 0; li < 2; li++)
      for (int basic = 0; basic < 2; basic++) {
        dt_ep = EP[li];
        dt_basic_transport = basic;
        dt_case c = {O[k].opt, O[k].hp, NULL, PARAMS, NPARAMS, 8, 2, 0.05, 0, 31 + (uint64_t)k, 0.05, 0, 4,
                     basic ? 0 : -1, 0, 0, 0, 0};
        char what[256];
        snprintf(what, sizeof what, "%s moe_hybrid ep%d tp%d dp%d zero%d %s", c.optimizer, dt_ep, L[li].tp, L[li].dp,
                 L[li].zero, basic ? "basic transports" : "rank-order dp sum");
        dt_result got;
        run_bitwise(&c, &L[li], what, &got);
        dt_result_free(&got);
        runs++;
      }
  printf("moe_hybrid fallbacks: %d runs (rank-order dp sum; transports without reduce and all_to_allv) x 8 steps "
         "x 2 micro-batches, bitwise equal\n", runs);
}

/* The simulator's ring order (chunks start at rank c+1 and accumulate around
 * the ring, as NCCL's ring all-reduce may) at dp 3..8, tp 1 and 2, every
 * ZeRO stage: with the exact dp sum, one and two words, every optimizer is
 * bitwise the reference. */
static const dt_layout ORDER_LAYOUTS[] = {
    {1, 3, 2, 0}, {2, 4, 1, 256}, {1, 5, 3, 1}, {1, 6, 0, 0}, {2, 7, 2, 1}, {1, 8, 3, 256}, {1, 8, 0, 0},
};

static void test_grid_ring_order(void **st) {
  (void)st;
  const int nl = (int)(sizeof ORDER_LAYOUTS / sizeof ORDER_LAYOUTS[0]);
  hp_setting h[MAX_SETTINGS];
  grid_candidates = 0;
  int runs = run_grid(h, registry_settings(h, 0, 0), ORDER_LAYOUTS, nl, 30, 1, 1);
  runs += run_grid(h, registry_settings(h, 0, 1), ORDER_LAYOUTS, nl, 30, 2, 1); /* two words: the piecewise ones */
  printf("ring order, exact dp sum: %d of %d runs (%s) x 30 steps at dp 3..8, bitwise equal\n", runs, grid_candidates,
         dt_subset_desc());
}

/* Adversarial gradients, ring order, on params[np] in layouts L[nl]: values over 2^±48 in every row (one word
 * rounds the small ones on the block grid, so a rank that used another grid — e.g. its own TP block's maxima —
 * would differ), and NaN/inf gradients applied (the class counts' path); returns the runs. */
static int adversarial(const dt_param *params, int np, const dt_layout *L, int nl) {
  static const hp_setting H[] = {{"adamw", "lr=1e-2,weight_decay=0.01"}, {"adafactor", "beta1=0.9,weight_decay=0.01"}};
  int runs = 0;
  for (int mode = 0; mode < 5; mode++) /* wide one word, two words, NaN applied; batch invariant: wide, NaN */
    for (int h = 0; h < 2; h++)
      for (int li = 0; li < nl; li++) {
        const dt_layout *l = &L[li];
        const int nan = mode == 2 || mode == 4;
        dt_case c = {H[h].opt, H[h].hp, NULL, params, np, 8, 3, 0.0, 0, 4321 + (uint64_t)h, 0.05, nan ? 3 : 0,
                     4, mode == 1 ? 2 : 1, 1, !nan, nan, mode >= 3};
        if (nan && h == 1) continue; /* adafactor spreads the NaN over its rows: adamw keeps it local */
        dt_result ref, got;
        assert_ok(dt_run_reference(&c, l->dp, &ref));
        dt_expect(&got, &ref);
        char err[512] = "", msg[512] = "";
        if (dt_run_dist(&c, l, &got, err, sizeof err) != DOPT_OK) fail_msg("%s", err);
        if (dt_compare(&c, &ref, &got, msg, sizeof msg))
          fail_msg("%s tp%d dp%d zero%d, mode %d: not bitwise equal: %s", c.optimizer, l->tp, l->dp, l->zero, mode, msg);
        dt_result_free(&ref);
        dt_result_free(&got);
        runs++;
      }
  return runs;
}

/* Row- and column-parallel splits of one-block tensors: every logical block straddles TP blocks or ZeRO
 * segments. */
static void test_adversarial_ring_order(void **st) {
  (void)st;
  static const dt_layout L[] = {{2, 3, 2, 0}, {3, 4, 1, 256}, {2, 5, 3, 1}, {1, 3, 0, 0}};
  printf("adversarial gradients, ring order: %d runs bitwise equal\n", adversarial(PARAMS, NPARAMS, L, 4));
}

/* Tensors of many blocks (DOPT_GRID_BLOCK 256): whole blocks inside one rank's segment are summed before the
 * codes' MAX (distributed/dp_sum.c, spans), the blocks cut by a segment, a TP row or a TP block after it; the
 * NaN (element n/2 of the first tensor) falls in a private block in some layouts (tp 1, 2) and in a shared one in
 * others; the checking device sums one block per chunk, so private spans cross chunk seams. */
static void test_adversarial_blocks(void **st) {
  (void)st;
  static const dt_param P[] = {
      {"layers.0.big", 2, {64, 40}, DOPT_TP_COLUMN, 0}, {"layers.1.rows", 2, {6, 700}, DOPT_TP_ROW, 0},
      {"layers.2.t3", 3, {3, 5, 200}, DOPT_TP_COLUMN, 0}, {"odd", 2, {37, 45}, DOPT_TP_COLUMN, 0},
      {"vec", 1, {1000}, DOPT_TP_COLUMN, 1},             {"bias", 1, {600}, DOPT_TP_REPLICATED, 1},
  };
  static const dt_layout L[] = {{2, 2, 2, 0}, {3, 2, 1, 0}, {1, 3, 2, 4096}, {2, 3, 3, 1}, {1, 2, 0, 0}};
  printf("adversarial gradients, many blocks: %d runs bitwise equal\n", adversarial(P, 6, L, 5));
}

/* The control: the fp32 dp sum in the transport's order is bitwise in rank
 * order and not in ring order (dp >= 3), so the ring-order test above can
 * tell the two sums apart. */
static void test_rank_order_sum_control(void **st) {
  (void)st;
  const dt_layout l = {1, 4, 2, 0};
  for (int ring = 0; ring <= 1; ring++) {
    dt_case c = {"adamw", "lr=1e-2,weight_decay=0.01", NULL, PARAMS, NPARAMS, 10, 1, 0.0, 0, 77, 0.05, 0, 5, -1, ring, 0, 0, 0};
    dt_result ref, got;
    assert_ok(dt_run_reference(&c, l.dp, &ref));
    dt_expect(&got, &ref);
    char err[512] = "", msg[512] = "";
    if (dt_run_dist(&c, &l, &got, err, sizeof err) != DOPT_OK) fail_msg("%s", err);
    int differs = dt_compare(&c, &ref, &got, msg, sizeof msg);
    if (differs != ring) fail_msg("fp32 dp sum, %s order: %s", ring ? "ring" : "rank", differs ? msg : "bitwise equal");
    dt_result_free(&ref);
    dt_result_free(&got);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {cmocka_unit_test(test_grid), cmocka_unit_test_teardown(test_grid_pipeline, no_stages),
                                     cmocka_unit_test_teardown(test_grid_gemini, per_tensor),
                                     cmocka_unit_test_teardown(test_grid_moe, no_experts),
                                     cmocka_unit_test_teardown(test_grid_moe_fallbacks, no_experts),
                                     cmocka_unit_test_teardown(test_grid_moe_stacks, no_experts),
                                     cmocka_unit_test(test_grid_ring_order),
                                     cmocka_unit_test(test_adversarial_ring_order),
                                     cmocka_unit_test(test_adversarial_blocks),
                                     cmocka_unit_test(test_rank_order_sum_control)};
  return cmocka_run_group_tests(tests, NULL, NULL);
}
