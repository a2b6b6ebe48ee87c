/* Plugin features of the distributed optimizers, bitwise against the
 * reference in the same mode: global gradient-norm clipping with gradient
 * accumulation, bf16 working parameters with fp32 masters, skipping steps
 * with non-finite gradients; and the configuration errors. */
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "disttest.h"
#include "internal.h"

static const dt_param PARAMS[] = {
    {"w", 2, {10, 9}, DOPT_TP_COLUMN, 0}, {"o", 2, {7, 10}, DOPT_TP_ROW, 0},   {"ln", 1, {9}, DOPT_TP_REPLICATED, 1},
    {"b", 1, {10}, DOPT_TP_COLUMN, 1},    {"h1", 2, {1, 5}, DOPT_TP_COLUMN, 0},
};
#define NP ((int)(sizeof PARAMS / sizeof PARAMS[0]))

static const dt_layout LAYOUTS[] = {{1, 1, 0, 0}, {2, 2, 0, 0}, {1, 3, 2, 0}, {2, 2, 3, 0}, {3, 2, 1, 0}, {4, 1, 2, 0}};
#define NL ((int)(sizeof LAYOUTS / sizeof LAYOUTS[0]))

static void check_case(dt_case *c) {
  dt_result ref[5];
  int have[5] = {0};
  for (int li = 0; li < NL; li++) {
    const dt_layout *l = &LAYOUTS[li];
    if (!have[l->dp]) {
      assert_ok(dt_run_reference(c, l->dp, &ref[l->dp]));
      have[l->dp] = 1;
    }
    dt_result got;
    memcpy(got.state_name, ref[l->dp].state_name, sizeof got.state_name);
    memcpy(got.nstates, ref[l->dp].nstates, sizeof got.nstates);
    char err[512] = "", msg[512] = "";
    if (dt_run_dist(c, l, &got, err, sizeof err) != DOPT_OK)
      fail_msg("%s tp%d dp%d zero%d: %s", c->optimizer, l->tp, l->dp, l->zero, err);
    if (dt_compare(c, &ref[l->dp], &got, msg, sizeof msg))
      fail_msg("%s tp%d dp%d zero%d (%s): %s", c->optimizer, l->tp, l->dp, l->zero, dt_plugin(l), msg);
    dt_result_free(&got);
  }
  for (int d = 0; d < 5; d++)
    if (have[d]) dt_result_free(&ref[d]);
}

/* Clipping active on every step (max norm far below the gradient norm) with
 * 3 accumulated micro-batches per step; owner mode too (GaLore's projected
 * matrices, 8-bit tensors: their averaged gradient is on the owner's dp row
 * only, and the norm must count it once, summed over tp and dp, at every
 * ZeRO stage). */
static void test_clip_and_accumulation(void **st) {
  (void)st;
  const char *opts[][2] = {{"adamw", "lr=1e-2,eps=1e-3"},
                           {"adafactor", "beta1=0.9"},
                           {"lamb", "lr=1e-2"},
                           {"galore_adamw", "rank=2,update_proj_gap=3,lr=1e-2"},
                           {"adamw8bit", "min_8bit_size=16,block_size=64,lr=1e-2"}};
  for (int k = 0; k < 5; k++) {
    dt_case c = {opts[k][0], opts[k][1], NULL, PARAMS, NP, 12, 3, 0.05, 0, 99 + (uint64_t)k, 0.5, 0, 4, 0, 0, 0, 0, 0};
    /* the clip must actually bite: the averaged gradient norm is >> 0.05 */
    float g[90];
    dt_gradient(&c, 0, 1, 0, 0, g);
    double ss = 0;
    for (int i = 0; i < 90; i++) ss += (double)g[i] * g[i];
    assert_true(sqrt(ss) > 10 * c.max_grad_norm);
    check_case(&c);
  }
}

/* Owner mode over transports without reduce and all_to_allv (an older or
 * minimal backend): the dp sum falls back to an all-reduce, the exchanges to
 * broadcasts of each region; bitwise the same, bf16 and ZeRO-3 included. */
static void test_owner_basic_transport(void **st) {
  (void)st;
  const char *opts[][2] = {{"galore_adamw", "rank=2,update_proj_gap=3,lr=1e-2"},
                           {"q_galore", "rank=2,update_proj_gap=2,proj_group_size=-1,min_8bit_size=16,block_size=64"}};
  for (int k = 0; k < 2; k++)
    for (int bf16 = 0; bf16 < 2; bf16++) {
      dt_case c = {opts[k][0], opts[k][1], NULL, PARAMS, NP, 6, 2, 0.05, bf16, 21 + (uint64_t)k, 0.5, 0, 3, 0, 0, 0, 0, 0};
      dt_basic_transport = 1; /* reset by basic_off, also when a check fails */
      check_case(&c);
    }
}

static int basic_off(void **st) {
  (void)st;
  dt_basic_transport = 0;
  return 0;
}

static void test_bf16_masters(void **st) {
  (void)st;
  const char *opts[][2] = {{"came", "lr=1e-3,weight_decay=0.01"}, {"adamw", "lr=1e-2"}};
  for (int k = 0; k < 2; k++) {
    dt_case c = {opts[k][0], opts[k][1], NULL, PARAMS, NP, 10, 1, 0.0, 1, 7 + (uint64_t)k, 0.05, 0, 5, 0, 0, 0, 0, 0};
    check_case(&c);
  }
}

/* A NaN in one rank's micro-batch at step 4: the step is skipped everywhere
 * (no parameter, state or step counter changes), then training continues. */
static void test_nonfinite_skip(void **st) {
  (void)st;
  dt_case c = {"adafactor", "beta1=0.9", NULL, PARAMS, NP, 8, 2, 0.0, 0, 5, 0.05, 4, 1, 0, 0, 0, 0, 0};
  check_case(&c);
  dt_result ref;
  assert_ok(dt_run_reference(&c, 2, &ref));
  assert_int_equal(ref.skipped, 1);
  /* checkpoint 3 (after step 4) equals checkpoint 2 (after step 3) */
  assert_int_equal(ref.ck_step[3], 4);
  assert_memory_equal(ref.param[2][0], ref.param[3][0], 90 * sizeof(float));
  assert_int_equal(ref.step[3][0], 3);
  dt_result_free(&ref);
}

/* ---- configuration errors (one rank, no collectives needed) ------------------------ */

typedef struct cfg_err {
  const char *plugin;
  int zero;
  dopt_tp_role role;
  const char *want;
  dopt_status code;
  dopt_status got;
  char msg[256];
} cfg_err;

/* AdamW over one parameter "v" [6] on v (the caller's storage). */
static dopt_status one_param_adamw(float *v, dopt_optim **o) {
  DOPT_TRY(dopt_optim_create("adamw", NULL, o));
  dopt_param_config pc = DOPT_PARAM_CONFIG_INIT;
  pc.name = "v";
  pc.ndim = 1;
  pc.shape[0] = 6;
  pc.data = v;
  return dopt_optim_add_param(*o, 0, &pc, NULL);
}

static dopt_status cfg_body(dopt_sim_comm *world, int rank, void *user) {
  (void)rank;
  cfg_err *e = user;
  dopt_optim *o = NULL;
  float v[6] = {0};
  dopt_status s = one_param_adamw(v, &o);
  dopt_dist_config cfg = DOPT_DIST_CONFIG_INIT;
  cfg.plugin = e->plugin;
  cfg.zero_stage = e->zero;
  if (s == DOPT_OK) s = dopt_sim_transport(world, &cfg.tp);
  if (s == DOPT_OK) s = dopt_sim_transport(world, &cfg.dp);
  dopt_dist_optim *d = NULL;
  if (s == DOPT_OK) {
    e->got = dopt_dist_create(o, &cfg, &e->role, &d);
    snprintf(e->msg, sizeof e->msg, "%s", dopt_last_error());
    if (e->got == DOPT_OK) {
      e->got = dopt_dist_step(d, NULL); /* no backward yet */
      snprintf(e->msg, sizeof e->msg, "%s", dopt_last_error());
    }
  }
  dopt_dist_destroy(d);
  dopt_optim_destroy(o);
  return s;
}

/* Batched reductions (docs/architecture.md): the statistics of a step cost
 * one collective per transport and reduction phase for all parameters of a
 * bucket, whatever their number; a bucket per parameter costs each
 * parameter's own phases on its own transports; both are bitwise equal to
 * the reference and the same count on every rank. Rounds per step with a
 * reducer: factored / 1-D parameter (ref/adafactor.c, came.c, lamb.c
 * stage tables); clipping adds 2 (MAX, SUM) for every parameter. */
static const dt_param MANY[] = {
    {"emb", 2, {11, 6}, DOPT_TP_COLUMN, 0},  {"q", 2, {6, 6}, DOPT_TP_COLUMN, 0},     {"o", 2, {6, 6}, DOPT_TP_ROW, 0},
    {"ln1", 1, {6}, DOPT_TP_REPLICATED, 1},  {"up", 2, {9, 6}, DOPT_TP_COLUMN, 0},    {"upb", 1, {9}, DOPT_TP_COLUMN, 1},
    {"dn", 2, {6, 9}, DOPT_TP_ROW, 0},       {"ln2", 1, {6}, DOPT_TP_REPLICATED, 1},  {"q2", 2, {6, 6}, DOPT_TP_COLUMN, 0},
    {"o2", 2, {6, 6}, DOPT_TP_ROW, 0},       {"t3", 3, {2, 3, 5}, DOPT_TP_COLUMN, 0}, {"sc", 2, {1, 6}, DOPT_TP_REPLICATED, 0},
    {"lnf", 1, {6}, DOPT_TP_REPLICATED, 1},  {"head", 2, {11, 6}, DOPT_TP_COLUMN, 0},
};
#define NMANY ((int)(sizeof MANY / sizeof MANY[0]))

static void test_batched_reductions(void **st) {
  (void)st;
  static const struct {
    const char *opt, *hp;
    int rounds_factored, rounds_1d;
  } O[] = {{"adamw", NULL, 0, 0}, {"adafactor", "beta1=0.9", 4, 2}, {"came", "lr=2e-4", 6, 2}, {"lamb", NULL, 2, 2}};
  static const dt_layout L[] = {{2, 2, 2, 0}, {2, 2, 2, 1}, {2, 3, 3, 0}, {3, 1, 0, 0}, {1, 3, 1, 1}};
  const int steps = 3;
  for (size_t k = 0; k < sizeof O / sizeof O[0]; k++) {
    for (int clip = 0; clip < 2; clip++) {
      dt_case c = {O[k].opt, O[k].hp, NULL, MANY, NMANY, steps, 1, clip ? 0.05 : 0.0, 0, 31 + (uint64_t)k, 0.5, 0,
                   steps, 0, 0, 0, 0, 0};
      dt_result ref[4];
      int have[4] = {0};
      for (size_t li = 0; li < sizeof L / sizeof L[0]; li++) {
        const dt_layout *l = &L[li];
        if (!have[l->dp]) {
          assert_ok(dt_run_reference(&c, l->dp, &ref[l->dp]));
          have[l->dp] = 1;
        }
        dt_result got;
        memcpy(got.state_name, ref[l->dp].state_name, sizeof got.state_name);
        memcpy(got.nstates, ref[l->dp].nstates, sizeof got.nstates);
        char err[512] = "", msg[512] = "";
        if (dt_run_dist(&c, l, &got, err, sizeof err) != DOPT_OK)
          fail_msg("%s tp%d dp%d zero%d bucket %zu: %s", c.optimizer, l->tp, l->dp, l->zero, l->bucket_bytes, err);
        if (dt_compare(&c, &ref[l->dp], &got, msg, sizeof msg))
          fail_msg("%s tp%d dp%d zero%d bucket %zu clip %d: %s", c.optimizer, l->tp, l->dp, l->zero, l->bucket_bytes,
                   clip, msg);
        /* the expected count: per bucket, each round runs on the transports
         * that some parameter of the bucket reduces over */
        int64_t expect = 0;
        const int over_dp = l->zero >= 1 && l->dp > 1;
        if (l->bucket_bytes == 0) {
          int any_f = 0, tp_f = 0, tp_any = 0;
          for (int i = 0; i < NMANY; i++) {
            int f = MANY[i].ndim >= 2, ot = l->tp > 1 && MANY[i].role != DOPT_TP_REPLICATED;
            any_f |= f && (ot || over_dp);
            tp_f |= f && ot;
            tp_any |= ot;
          }
          int r1 = O[k].rounds_1d, rf = O[k].rounds_factored;
          /* rounds every parameter has (min), then the factored ones' extra rounds */
          int common = r1 < rf ? r1 : rf, extra = rf > r1 ? rf - r1 : 0;
          expect = (int64_t)common * (tp_any + over_dp) + (any_f ? (int64_t)extra * (tp_f + over_dp) : 0);
          if (clip) expect += 2 * (tp_any + over_dp);
        } else {
          for (int i = 0; i < NMANY; i++) {
            int f = MANY[i].ndim >= 2, ot = l->tp > 1 && MANY[i].role != DOPT_TP_REPLICATED;
            expect += (int64_t)(f ? O[k].rounds_factored : O[k].rounds_1d) * (ot + over_dp);
          }
          if (clip) { /* clipping runs every parameter in one bucket */
            int tp_any = 0;
            for (int i = 0; i < NMANY; i++) tp_any |= l->tp > 1 && MANY[i].role != DOPT_TP_REPLICATED;
            expect += 2 * (tp_any + over_dp);
          }
        }
        expect *= steps;
        for (int r = 0; r < l->tp * l->dp; r++)
          if (got.stat_collectives[r] != expect)
            fail_msg("%s tp%d dp%d zero%d bucket %zu clip %d: rank %d issued %lld statistic collectives in %d steps, "
                     "expected %lld",
                     c.optimizer, l->tp, l->dp, l->zero, l->bucket_bytes, clip, r, (long long)got.stat_collectives[r],
                     steps, (long long)expect);
        dt_result_free(&got);
      }
      for (int d = 0; d < 4; d++)
        if (have[d]) dt_result_free(&ref[d]);
    }
  }
}

/* Runs c on layout l and compares it bitwise with the reference at dp. */
static void expect_bitwise(const dt_case *c, const dt_layout *l, dt_result *ref, dt_result *got) {
  memcpy(got->state_name, ref->state_name, sizeof got->state_name);
  memcpy(got->nstates, ref->nstates, sizeof got->nstates);
  char err[512] = "", msg[512] = "";
  if (dt_run_dist(c, l, got, err, sizeof err) != DOPT_OK)
    fail_msg("%s tp%d dp%d zero%d: %s", c->optimizer, l->tp, l->dp, l->zero, err);
  if (dt_compare(c, ref, got, msg, sizeof msg))
    fail_msg("%s [%s] tp%d dp%d zero%d: %s", c->optimizer, c->hparams, l->tp, l->dp, l->zero, msg);
}

/* bitsandbytes #2080: FSDP applied min_8bit_size to the flattened shard, so a
 * 4096-element weight sharded 4 ways (1024 each) silently got fp32 states.
 * Here the threshold is the logical numel's: 8-bit codes in every layout, the
 * same bytes as the reference, and the states held once across the ranks. */
static void test_8bit_threshold_is_logical(void **st) {
  (void)st;
  static const dt_param P[] = {{"w", 2, {64, 64}, DOPT_TP_COLUMN, 0}, {"b", 1, {64}, DOPT_TP_COLUMN, 1}};
  dt_case c = {"adamw8bit", "lr=1e-2,min_8bit_size=4096,block_size=256", NULL, P, 2, 6, 1, 0.0, 0, 7, 0.5, 0, 3, 0, 0, 0, 0, 0};
  dt_result ref;
  assert_ok(dt_run_reference(&c, 4, &ref));
  int found = 0;
  for (int k = 0; k < ref.nstates[0]; k++)
    if (strcmp(ref.state_name[0][k], "state1") == 0) {
      assert_int_equal(ref.state_bytes[0][k], 4096); /* U8 codes: 8-bit in the reference */
      found = 1;
    }
  assert_true(found);
  static const dt_layout L[] = {{1, 4, 3, 0}, {2, 4, 2, 0}, {4, 4, 1, 0}};
  for (size_t li = 0; li < sizeof L / sizeof L[0]; li++) {
    dt_result got;
    expect_bitwise(&c, &L[li], &ref, &got);
    size_t sum = 0;
    for (int r = 0; r < L[li].tp * L[li].dp; r++) sum += got.state_mem[r];
    if (sum != ref.ref_state_mem)
      fail_msg("tp%d dp%d: the ranks hold %zu state bytes together, the reference %zu", L[li].tp, L[li].dp, sum,
               ref.ref_state_mem);
    dt_result_free(&got);
  }
  dt_result_free(&ref);
}

/* Owner mode per parameter: under galore_adamw only the projected matrix steps whole on one owner rank; the
 * bias (not projected: plain HF AdamW) steps piecewise, its states sharded over dp like AdamW's (before, the
 * whole optimizer was in owner mode and the bias's states sat whole on one rank). Every rank that does not own
 * the matrix holds exactly its ZeRO piece of the bias's two states; the ranks hold the reference's state bytes
 * once between them; bitwise the reference. The same for adamw8bit's tensor below min_8bit_size. */
static void test_owner_mode_per_parameter(void **st) {
  (void)st;
  static const dt_param P[] = {{"w", 2, {32, 24}, DOPT_TP_COLUMN, 0}, {"b", 1, {400}, DOPT_TP_COLUMN, 1}};
  static const struct {
    const char *opt, *hp;
  } O[] = {{"galore_adamw", "lr=1e-2,rank=4,update_proj_gap=3"},
           {"adamw8bit", "lr=1e-2,min_8bit_size=512,block_size=256"},
           {"galore_adamw8bit", "lr=1e-2,rank=4,update_proj_gap=3,min_8bit_size=512,block_size=256"}};
  const dt_layout l = {1, 4, 2, 0};
  for (size_t o = 0; o < sizeof O / sizeof O[0]; o++) {
    dt_case c = {O[o].opt, O[o].hp, NULL, P, 2, 5, 1, 0.0, 0, 11, 0.5, 0, 5, 0, 0, 0, 0, 0};
    dt_result ref, got;
    assert_ok(dt_run_reference(&c, 4, &ref));
    expect_bitwise(&c, &l, &ref, &got);
    const size_t piece = 2 * (400 / 4) * sizeof(float); /* exp_avg / state1 and exp_avg_sq / state2, fp32 */
    size_t sum = 0, lo = SIZE_MAX;
    for (int r = 0; r < 4; r++) {
      sum += got.state_mem[r];
      lo = got.state_mem[r] < lo ? got.state_mem[r] : lo;
    }
    if (lo != piece)
      fail_msg("%s: a rank that owns nothing holds %zu state bytes, not its piece of the bias's states (%zu)",
               O[o].opt, lo, piece);
    if (sum != ref.ref_state_mem)
      fail_msg("%s: the ranks hold %zu state bytes together, the reference %zu", O[o].opt, sum, ref.ref_state_mem);
    dt_result_free(&ref);
    dt_result_free(&got);
  }
}

/* GaLore's projection when its inner dimension is split: a left projector
 * (Aᵀ·G contracts the rows) on a COLUMN-split weight (rows over tp), under
 * every ZeRO stage; and a right one on a ROW-split weight. */
static void test_galore_split_inner_dimension(void **st) {
  (void)st;
  static const dt_param P[] = {{"col", 2, {24, 10}, DOPT_TP_COLUMN, 0}, {"row", 2, {9, 26}, DOPT_TP_ROW, 0},
                               {"bias", 1, {24}, DOPT_TP_COLUMN, 1}};
  const char *hps[] = {"lr=1e-2,rank=4,update_proj_gap=3,proj_type=left",
                       "lr=1e-2,rank=4,update_proj_gap=3,proj_type=right",
                       "lr=1e-2,rank=4,update_proj_gap=3,proj_type=std,min_8bit_size=8,block_size=256"};
  const char *opts[] = {"galore_adamw", "galore_adamw", "galore_adamw8bit"};
  static const dt_layout L[] = {{3, 2, 3, 0}, {3, 2, 2, 0}, {4, 1, 0, 0}, {2, 3, 1, 0}};
  for (int h = 0; h < 3; h++) {
    dt_case c = {opts[h], hps[h], NULL, P, 3, 10, 1, 0.0, 0, 11 + (uint64_t)h, 0.5, 0, 5, 0, 0, 0, 0, 0};
    dt_result ref[4];
    int have[4] = {0};
    for (size_t li = 0; li < sizeof L / sizeof L[0]; li++) {
      int dp = L[li].dp;
      if (!have[dp]) {
        assert_ok(dt_run_reference(&c, dp, &ref[dp]));
        have[dp] = 1;
      }
      dt_result got;
      expect_bitwise(&c, &L[li], &ref[dp], &got);
      dt_result_free(&got);
    }
    for (int d = 0; d < 4; d++)
      if (have[d]) dt_result_free(&ref[d]);
  }
}

static void test_config_errors(void **st) {
  (void)st;
  cfg_err cases[] = {
      {"ddp", 1, DOPT_TP_REPLICATED, "plugin ddp", DOPT_ERR_INVALID_ARG, 0, ""},
      {"zero", 0, DOPT_TP_REPLICATED, "plugin zero", DOPT_ERR_INVALID_ARG, 0, ""},
      {"fsdp", 2, DOPT_TP_REPLICATED, "plugin fsdp", DOPT_ERR_INVALID_ARG, 0, ""},
      {"hybrid", 3, DOPT_TP_REPLICATED, "zero 3 is the fsdp plugin", DOPT_ERR_INVALID_ARG, 0, ""},
      {"gemini", 0, DOPT_TP_REPLICATED, "unknown plugin 'gemini'", DOPT_ERR_NOT_FOUND, 0, ""},
      {"hybrid", 4, DOPT_TP_REPLICATED, "zero_stage=4", DOPT_ERR_INVALID_ARG, 0, ""},
      {"hybrid", 0, DOPT_TP_ROW, "'v' role ROW", DOPT_ERR_INVALID_ARG, 0, ""},
      {"hybrid", 0, DOPT_TP_REPLICATED, "no gradients", DOPT_ERR_STATE, 0, ""},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    dopt_sim_config sc = DOPT_SIM_CONFIG_INIT;
    sc.nranks = 1;
    dopt_sim_world *w;
    assert_ok(dopt_sim_world_create(&sc, &w));
    dopt_status rs[1];
    assert_ok(dopt_sim_launch(w, cfg_body, &cases[i], rs));
    assert_ok(rs[0]);
    if (cases[i].got != cases[i].code || !strstr(cases[i].msg, cases[i].want))
      fail_msg("case %zu: %s '%s' (want %s '%s')", i, dopt_status_name(cases[i].got), cases[i].msg,
               dopt_status_name(cases[i].code), cases[i].want);
    dopt_sim_world_destroy(w);
  }
}

/* dopt_dist_check_replicas on tp 2 x dp 3: every rank learns the lowest world
 * rank whose bytes differ from rank 0's, and the first differing byte. */
typedef struct rep_case {
  int bad1, bad2;          /* world ranks whose bytes differ (-1: none) */
  size_t off1, off2;       /* where */
  int rank[6];             /* per world rank: the answer it got */
  size_t offset[6];
} rep_case;

static dopt_status rep_body(dopt_sim_comm *world, int rank, void *user) {
  rep_case *x = user;
  dopt_sim_comm *tpc, *dpc;
  DOPT_TRY(dopt_sim_comm_split_labeled(world, rank / 2, rank, "tp", &tpc));
  DOPT_TRY(dopt_sim_comm_split_labeled(world, rank % 2, rank, "dp", &dpc));
  dopt_optim *o = NULL;
  float v[6] = {0};
  dopt_status s = one_param_adamw(v, &o);
  dopt_dist_config cfg = DOPT_DIST_CONFIG_INIT;
  cfg.plugin = "hybrid";
  cfg.zero_stage = 1;
  if (s == DOPT_OK) s = dopt_sim_transport(tpc, &cfg.tp);
  if (s == DOPT_OK) s = dopt_sim_transport(dpc, &cfg.dp);
  dopt_tp_role role = DOPT_TP_REPLICATED;
  dopt_dist_optim *d = NULL;
  if (s == DOPT_OK) s = dopt_dist_create(o, &cfg, &role, &d);
  unsigned char bytes[45];
  for (int k = 0; k < 45; k++) bytes[k] = (unsigned char)(k * 7);
  if (rank == x->bad1) bytes[x->off1] ^= 1;
  if (rank == x->bad2) bytes[x->off2] ^= 0x80;
  if (s == DOPT_OK) s = dopt_dist_check_replicas(d, bytes, sizeof bytes, &x->rank[rank], &x->offset[rank]);
  dopt_dist_destroy(d);
  dopt_optim_destroy(o);
  return s;
}

static void test_check_replicas(void **st) {
  (void)st;
  rep_case cases[] = {{-1, -1, 0, 0, {0}, {0}}, {4, -1, 44, 0, {0}, {0}}, {5, 3, 0, 17, {0}, {0}}, {1, -1, 3, 0, {0}, {0}}};
  const int want_rank[] = {-1, 4, 3, 1};
  const size_t want_off[] = {0, 44, 17, 3};
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
    dopt_sim_config sc = DOPT_SIM_CONFIG_INIT;
    sc.nranks = 6;
    sc.timeout_ms = 20000;
    dopt_sim_world *w;
    assert_ok(dopt_sim_world_create(&sc, &w));
    dopt_status rs[6];
    assert_ok(dopt_sim_launch(w, rep_body, &cases[c], rs));
    for (int r = 0; r < 6; r++) {
      if (rs[r] != DOPT_OK) fail_msg("case %zu rank %d: %s", c, r, dopt_sim_world_rank_error(w, r));
      if (cases[c].rank[r] != want_rank[c] || (want_rank[c] >= 0 && cases[c].offset[r] != want_off[c]))
        fail_msg("case %zu: rank %d got rank %d offset %zu, want %d %zu", c, r, cases[c].rank[r], cases[c].offset[r],
                 want_rank[c], want_off[c]);
    }
    dopt_sim_world_destroy(w);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_check_replicas),
      cmocka_unit_test(test_clip_and_accumulation),
      cmocka_unit_test_teardown(test_owner_basic_transport, basic_off),
      cmocka_unit_test(test_bf16_masters),
      cmocka_unit_test(test_nonfinite_skip),
      cmocka_unit_test(test_batched_reductions),
      cmocka_unit_test(test_8bit_threshold_is_logical),
      cmocka_unit_test(test_owner_mode_per_parameter),
      cmocka_unit_test(test_galore_split_inner_dimension),
      cmocka_unit_test(test_config_errors),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
