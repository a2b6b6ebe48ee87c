/* Plugin features of the distributed optimizers, bitwise against the
 * reference in the same mode: global gradient-norm clipping with gradient
 * accumulation, bf16 working parameters with fp32 masters, skipping steps
 * with non-finite gradients; and the configuration errors. */
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "disttest.h"
#include "distopt/sim.h"
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
    dt_expect(&got, &ref[l->dp]);
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
  int stage;    /* dopt_dist_config.stages[0] (no pipeline: only 0 is valid) */
  size_t chunk; /* dopt_dist_config.chunk_elems */
  int ep;       /* > 1: the ep transport claims this size (refused before any collective) */
  int expert, nexperts; /* dopt_dist_config.experts[0] and num_experts (nexperts 0: no experts given) */
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
  cfg.stages = &e->stage;
  cfg.chunk_elems = e->chunk;
  if (e->nexperts) cfg.experts = &e->expert, cfg.num_experts = e->nexperts;
  if (s == DOPT_OK) s = dopt_sim_transport(world, &cfg.tp);
  if (s == DOPT_OK) s = dopt_sim_transport(world, &cfg.dp);
  if (s == DOPT_OK && e->ep > 1) {
    s = dopt_sim_transport(world, &cfg.ep);
    cfg.moe_dp = cfg.dp;
    cfg.ep.size = e->ep;
  }
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
        dt_expect(&got, &ref[l->dp]);
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
  dt_expect(got, ref);
  char err[512] = "", msg[512] = "";
  if (dt_run_dist(c, l, got, err, sizeof err) != DOPT_OK)
    fail_msg("%s tp%d dp%d zero%d: %s", c->optimizer, l->tp, l->dp, l->zero, err);
  if (dt_compare(c, ref, got, msg, sizeof msg))
    fail_msg("%s [%s] tp%d dp%d zero%d: %s", c->optimizer, c->hparams, l->tp, l->dp, l->zero, msg);
}


/* ---- 8-bit states per rank, from the layout alone (a brute force over every element) ------------------- */

/* Uneven split of n over parts: part r gets base + (r < rem) from r·base + min(r, rem). */
static void split_of(size_t n, int parts, int r, size_t *off, size_t *len) {
  const size_t base = n / (size_t)parts, rem = n % (size_t)parts, ur = (size_t)r;
  *len = base + (ur < rem);
  *off = ur * base + (ur < rem ? ur : rem);
}

/* What an adamw8bit parameter costs world rank w (tp rank w % tp, dp rank w / tp) in state bytes, as
 * docs/distributed.md lays it out: 8-bit (numel >= min8) codes 2 bytes per element of its padded ZeRO extent
 * (chunk; the TP block at zero 0) and 8 bytes per block any of its elements falls in; fp32 states 8 bytes
 * per element of the extent; 400 with percentile clipping. *shared: the parameter has a block whose elements
 * lie in two different pieces. */
static size_t q8_rank_bytes(const dt_param *p, const dt_layout *l, int w, size_t B, size_t min8, int pct,
                            int *shared) {
  int64_t one = 1;
  size_t numel = 1, b = 1, h = 1, wd = 1;
  for (int k = 0; k < p->ndim; k++) numel *= (size_t)p->shape[k];
  if (p->ndim >= 2) {
    wd = (size_t)p->shape[p->ndim - 1], h = (size_t)p->shape[p->ndim - 2], b = numel / (h * wd);
  } else {
    wd = numel;
  }
  (void)one;
  const int split = l->tp > 1 && p->role != DOPT_TP_REPLICATED;
  const int rows = split && p->role == DOPT_TP_COLUMN && p->ndim >= 2, zdp = l->zero >= 1 ? l->dp : 1;
  const int tr = w % l->tp, dr = w / l->tp;
  size_t h0 = 0, hl = h, w0 = 0, wl = wd;
  if (split && rows) split_of(h, l->tp, tr, &h0, &hl);
  else if (split) split_of(wd, l->tp, tr, &w0, &wl);
  const size_t ln = b * hl * wl, chunk = (ln + (size_t)zdp - 1) / (size_t)zdp;
  const size_t nb = (numel + B - 1) / B;
  /* every element's piece: (tp block index, dp range index); blocks of this rank's elements; shared blocks */
  unsigned char *mine = calloc(nb ? nb : 1, 1);
  long long *first = malloc((nb ? nb : 1) * sizeof *first);
  for (size_t k = 0; k < nb; k++) first[k] = -1;
  *shared = 0;
  for (size_t L = 0; L < numel; L++) {
    const size_t bi = L / (h * wd), row = L / wd % h, col = L % wd;
    int t = 0; /* the TP rank whose block holds it (REPLICATED: all, piece of tp rank 0) */
    for (int r = 0; split && r < l->tp; r++) {
      size_t o, n;
      split_of(rows ? h : wd, l->tp, r, &o, &n);
      const size_t x = rows ? row : col;
      if (x >= o && x < o + n) t = r;
    }
    size_t th0 = 0, thl = h, tw0 = 0, twl = wd;
    if (split && rows) split_of(h, l->tp, t, &th0, &thl);
    else if (split) split_of(wd, l->tp, t, &tw0, &twl);
    const size_t tln = b * thl * twl, tchunk = (tln + (size_t)zdp - 1) / (size_t)zdp;
    const size_t j = (bi * thl + row - th0) * twl + col - tw0, q = j / tchunk;
    const long long piece = (long long)t * 1000 + (long long)q;
    if (first[L / B] < 0) first[L / B] = piece;
    else if (first[L / B] != piece) *shared = 1;
    if ((t == tr || !split) && (l->zero == 0 || (int)q == dr)) mine[L / B] = 1;
  }
  size_t nblk = 0;
  for (size_t k = 0; k < nb; k++) nblk += mine[k];
  free(mine);
  free(first);
  const size_t ext = l->zero >= 1 ? chunk : ln;
  return (numel >= min8 ? 2 * ext + 8 * nblk : 8 * ext) + (pct ? 400 : 0);
}

/* Every rank holds exactly its own pieces' 8-bit states (q8_rank_bytes summed over the case's parameters):
 * its codes (1/dp of the reference's, plus ZeRO padding) and the absmax of the blocks its elements fall in
 * (one block more per shard edge at most), nothing of anybody else's tensor. */
static void check_q8_states(const dt_case *c, const dt_layout *l, const dt_result *got, size_t B, size_t min8,
                            int pct) {
  for (int w = 0; w < l->tp * l->dp; w++) {
    size_t want = 0;
    int sh;
    for (int i = 0; i < c->nparams; i++) want += q8_rank_bytes(&c->params[i], l, w, B, min8, pct, &sh);
    if (got->state_mem[w] != want)
      fail_msg("%s [%s] tp%d dp%d zero%d: world rank %d holds %zu state bytes, its pieces' are %zu", c->optimizer,
               c->hparams, l->tp, l->dp, l->zero, w, got->state_mem[w], want);
  }
}

/* bitsandbytes #2080: FSDP applied min_8bit_size to the flattened shard, so a
 * 4096-element weight sharded 4 ways (1024 each) silently got fp32 states.
 * Here the threshold is the logical numel's: 8-bit codes in every layout, the
 * same bytes as the reference, and every rank holds its own pieces' states. */
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
    check_q8_states(&c, &L[li], &got, 256, 4096, 0);
    dt_result_free(&got);
  }
  dt_result_free(&ref);
}


/* Collectives per step in buckets (docs/distributed.md "Collectives per step"): the exact dp sum's parts (one
 * all_to_allv over dp), its block codes (one MAX over tp and over dp) and, at zero 1/2, the weights (one
 * all_gather over dp) go one collective per bucket, so with one bucket (bucket_bytes 0) a step's count does not
 * depend on the number of parameters. Exact per kind on every rank, for AdamW (no statistic rounds) with 5 and
 * 15 tensors and one bucket or a bucket per tensor; the non-finite flags add one MAX per transport per step;
 * zero 0 gathers the summed segments instead (one all_gather per bucket). GaLore's owner steps (their
 * exchanges batched the same way, no broadcast) stay within the same per-kind bounds for 5 and 15 tensors
 * (which of them a rank issues depends on what its row owns). Bitwise throughout. */
static void test_collectives_per_bucket(void **st) {
  (void)st;
  static const dt_param P[] = {
      {"t0", 2, {10, 9}, DOPT_TP_COLUMN, 0},  {"t1", 2, {7, 10}, DOPT_TP_ROW, 0},      {"t2", 1, {9}, DOPT_TP_REPLICATED, 1},
      {"t3", 1, {10}, DOPT_TP_COLUMN, 1},     {"t4", 2, {1, 5}, DOPT_TP_COLUMN, 0},    {"t5", 2, {12, 8}, DOPT_TP_COLUMN, 0},
      {"t6", 2, {6, 11}, DOPT_TP_ROW, 0},     {"t7", 1, {13}, DOPT_TP_REPLICATED, 1},  {"t8", 2, {9, 9}, DOPT_TP_COLUMN, 0},
      {"t9", 3, {2, 3, 5}, DOPT_TP_COLUMN, 0}, {"t10", 2, {5, 14}, DOPT_TP_ROW, 0},    {"t11", 1, {8}, DOPT_TP_COLUMN, 1},
      {"t12", 2, {11, 7}, DOPT_TP_COLUMN, 0}, {"t13", 2, {4, 4}, DOPT_TP_REPLICATED, 0}, {"t14", 1, {6}, DOPT_TP_REPLICATED, 1},
  };
  static const dt_layout L[] = {{2, 2, 2, 0}, {2, 2, 2, 1}, {1, 3, 1, 0}, {1, 3, 1, 1}, {2, 3, 0, 0},
                                {2, 3, 0, 1}, {3, 2, 3, 0}, {3, 2, 3, 1}};
  const int steps = 3;
  for (size_t li = 0; li < sizeof L / sizeof L[0]; li++) {
    const dt_layout *l = &L[li];
    for (int big = 0; big < 2; big++) {
      const int np = big ? 15 : 5;
      for (int o = 0; o < 2; o++) {
        dt_case c = {o ? "galore_adamw" : "adamw", o ? "lr=1e-2,rank=2,update_proj_gap=3" : "lr=1e-2", NULL, P, np,
                     steps, 1, 0.0, 0, 3 + (uint64_t)np, 0.5, 0, steps, 0, 0, 0, 0, 0};
        dt_result ref, got;
        assert_ok(dt_run_reference(&c, l->dp, &ref));
        expect_bitwise(&c, l, &ref, &got);
        /* buckets: one, or one per tensor (each tensor's estimate is above 1 byte) */
        const uint64_t nb = l->bucket_bytes ? (uint64_t)np : 1, T = (uint64_t)(l->tp > 1), D = (uint64_t)(l->dp > 1);
        for (int w = 0; w < l->tp * l->dp; w++) {
          const uint64_t *k = got.step_ops[w];
          const uint64_t ns = (uint64_t)steps;
          const uint64_t ar = k[DOPT_SIM_KIND_ALL_REDUCE] / ns, a2a = k[DOPT_SIM_KIND_ALL_TO_ALLV] / ns;
          const uint64_t ag = k[DOPT_SIM_KIND_ALL_GATHER] / ns, rest = (k[DOPT_SIM_KIND_REDUCE_SCATTER] +
                              k[DOPT_SIM_KIND_BROADCAST] + k[DOPT_SIM_KIND_REDUCE]) / ns;
          if (o == 0) {
            const uint64_t want_ar = 2 + nb * (T + D), want_a2a = D * nb, want_ag = D * (l->zero == 3 ? 0 : nb);
            if (ar != want_ar || a2a != want_a2a || ag != want_ag || rest != 0)
              fail_msg("adamw, %d tensors, tp%d dp%d zero%d bucket %zu: rank %d issued per step all_reduce %llu "
                       "(want %llu), all_to_allv %llu (%llu), all_gather %llu (%llu), others %llu (0)", np, l->tp,
                       l->dp, l->zero, l->bucket_bytes, w, (unsigned long long)ar, (unsigned long long)want_ar,
                       (unsigned long long)a2a, (unsigned long long)want_a2a, (unsigned long long)ag,
                       (unsigned long long)want_ag, (unsigned long long)rest);
          } else if (l->bucket_bytes == 0) {
            /* one batch: the flags and codes MAX; all_to_allv: the dp sum's parts, the owners' gradients and
             * values over tp (on a row that owns a TP-split tensor: ownership decides), the values over dp;
             * no broadcast, reduce or reduce-scatter; the weights of the piecewise tensors */
            if (ar != 2 + T + D || a2a > D + 2 * T + D || ag > D * (l->zero == 3 ? 0 : 1) || rest != 0)
              fail_msg("galore_adamw, %d tensors, tp%d dp%d zero%d, one bucket: rank %d issued per step all_reduce "
                       "%llu (want %llu), all_to_allv %llu (at most %llu), all_gather %llu, others %llu (0)", np,
                       l->tp, l->dp, l->zero, w, (unsigned long long)ar, (unsigned long long)(2 + T + D),
                       (unsigned long long)a2a, (unsigned long long)(D + 2 * T + D), (unsigned long long)ag,
                       (unsigned long long)rest);
          }
        }
        dt_result_free(&ref);
        dt_result_free(&got);
      }
    }
  }
}

/* 8-bit states sharded by the logical blocks (docs/distributed.md "8-bit blocks"): adamw8bit steps every
 * tensor piecewise, a block whose elements several ranks hold takes its absmax from one MAX over them, and
 * every rank holds only its own codes and the absmax of its blocks. Bitwise the reference, outside the CI
 * grid's layouts: blocks of 64 straddling ZeRO edges at dp 5..8, ROW splits whose rows are narrower than a
 * block (strided blocks), tp 5..8, ZeRO-3, bf16 working copies, 3 accumulated micro-batches, global clipping,
 * percentile clipping; and torchao #4912's (6, 1024) weight with bitsandbytes' min_8bit_size 4096, which
 * became fp32 when split in two: 8-bit here in every split. One MAX round per step: with one bucket, the
 * statistic collectives per step are one per transport that a tensor with shared blocks reduces over. */
static void test_8bit_blocks_any_layout(void **st) {
  (void)st;
  static const dt_param P[] = {
      {"col", 2, {37, 29}, DOPT_TP_COLUMN, 0}, {"row", 2, {13, 40}, DOPT_TP_ROW, 0},
      {"t3", 3, {2, 5, 30}, DOPT_TP_COLUMN, 0}, {"rep", 1, {300}, DOPT_TP_REPLICATED, 1},
      {"b", 1, {50}, DOPT_TP_COLUMN, 1},       {"one", 2, {1, 70}, DOPT_TP_ROW, 0},
  };
  static const dt_param W4912[] = {{"w", 2, {6, 1024}, DOPT_TP_COLUMN, 0}, {"wr", 2, {6, 1024}, DOPT_TP_ROW, 0}};
  static const struct {
    const char *hp;
    const dt_param *p;
    int np, micro, bf16, pct;
    double clip;
    size_t B, min8;
  } S[] = {
      {"lr=1e-2,min_8bit_size=64,block_size=64", P, 6, 1, 0, 0, 0.0, 64, 64},
      {"lr=1e-2,min_8bit_size=64,block_size=64,weight_decay=0.01", P, 6, 3, 1, 0, 0.05, 64, 64},
      {"lr=1e-2,min_8bit_size=64,block_size=128,percentile_clipping=5", P, 6, 1, 0, 1, 0.0, 128, 64},
      {"lr=1e-2,block_size=256", W4912, 2, 1, 0, 0, 0.0, 256, 4096}, /* bitsandbytes' default min_8bit_size */
  };
  static const dt_layout L[] = {{1, 7, 2, 0}, {1, 7, 3, 0}, {1, 5, 1, 0}, {1, 8, 2, 0}, {5, 1, 0, 0},
                                {6, 1, 0, 0}, {7, 2, 3, 0}, {8, 1, 0, 0}, {3, 5, 3, 0}, {2, 6, 1, 0}};
  int runs = 0;
  for (size_t k = 0; k < sizeof S / sizeof S[0]; k++) {
    dt_case c = {"adamw8bit", S[k].hp, NULL, S[k].p, S[k].np, 9, S[k].micro, S[k].clip, S[k].bf16,
                 500 + (uint64_t)k, 0.5, 0, 3, 0, 0, 0, 0, 0};
    dt_result ref[9];
    int have[9] = {0};
    for (size_t li = 0; li < sizeof L / sizeof L[0]; li++) {
      const dt_layout *l = &L[li];
      if (!have[l->dp]) {
        assert_ok(dt_run_reference(&c, l->dp, &ref[l->dp]));
        have[l->dp] = 1;
        for (int i = 0; i < c.nparams; i++)
          for (int q = 0; q < ref[l->dp].nstates[i]; q++)
            if (strcmp(ref[l->dp].state_name[i][q], "state1") == 0) {
              size_t n = 1;
              for (int d = 0; d < c.params[i].ndim; d++) n *= (size_t)c.params[i].shape[d];
              if (ref[l->dp].state_bytes[i][q] != (n >= S[k].min8 ? n : 4 * n))
                fail_msg("[%s] %s: state1 is %zu bytes", c.hparams, c.params[i].name, ref[l->dp].state_bytes[i][q]);
            }
      }
      dt_result got;
      expect_bitwise(&c, l, &ref[l->dp], &got);
      check_q8_states(&c, l, &got, S[k].B, S[k].min8, S[k].pct);
      /* one bucket, no percentile or global clipping: one MAX round, over each transport a posting tensor uses */
      if (!S[k].pct && S[k].clip == 0.0) {
        int over_tp = 0, over_dp = 0;
        for (int i = 0; i < c.nparams; i++) {
          int sh;
          q8_rank_bytes(&c.params[i], l, 0, S[k].B, S[k].min8, 0, &sh);
          size_t n = 1;
          for (int d = 0; d < c.params[i].ndim; d++) n *= (size_t)c.params[i].shape[d];
          if (!sh || n < S[k].min8) continue;
          over_tp |= l->tp > 1 && c.params[i].role != DOPT_TP_REPLICATED;
          over_dp |= l->zero >= 1 && l->dp > 1;
        }
        for (int w = 0; w < l->tp * l->dp; w++)
          if (got.stat_collectives[w] != (int64_t)(over_tp + over_dp) * c.steps)
            fail_msg("[%s] tp%d dp%d zero%d: rank %d issued %lld statistic collectives in %d steps, expected %d",
                     c.hparams, l->tp, l->dp, l->zero, w, (long long)got.stat_collectives[w], c.steps,
                     (over_tp + over_dp) * c.steps);
      }
      dt_result_free(&got);
      runs++;
    }
    for (int d = 0; d < 9; d++)
      if (have[d]) dt_result_free(&ref[d]);
  }
  printf("8-bit blocks: %d runs bitwise, every rank's states its own pieces'\n", runs);
}

/* Owner mode per parameter: under galore_adamw only the projected matrix steps whole on one owner rank; the
 * bias (not projected: plain HF AdamW) steps piecewise, its states sharded over dp like AdamW's (before, the
 * whole optimizer was in owner mode and the bias's states sat whole on one rank). Every rank that does not own
 * the matrix holds exactly its ZeRO piece of the bias's two states; the ranks hold the reference's state bytes
 * once between them; bitwise the reference. The same for galore_adamw8bit's bias below min_8bit_size (adamw8bit
 * itself owns nothing: test_8bit_blocks_any_layout). */
static void test_owner_mode_per_parameter(void **st) {
  (void)st;
  static const dt_param P[] = {{"w", 2, {32, 24}, DOPT_TP_COLUMN, 0}, {"b", 1, {400}, DOPT_TP_COLUMN, 1}};
  static const struct {
    const char *opt, *hp;
  } O[] = {{"galore_adamw", "lr=1e-2,rank=4,update_proj_gap=3"},
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
      {"ddp", 1, DOPT_TP_REPLICATED, "plugin ddp", DOPT_ERR_INVALID_ARG, 0, "", 0, 0, 0, 0, 0},
      {"zero", 0, DOPT_TP_REPLICATED, "plugin zero", DOPT_ERR_INVALID_ARG, 0, "", 0, 0, 0, 0, 0},
      {"fsdp", 2, DOPT_TP_REPLICATED, "plugin fsdp", DOPT_ERR_INVALID_ARG, 0, "", 0, 0, 0, 0, 0},
      {"hybrid", 3, DOPT_TP_REPLICATED, "zero 3 is the fsdp plugin", DOPT_ERR_INVALID_ARG, 0, "", 0, 0, 0, 0, 0},
      {"colossal", 0, DOPT_TP_REPLICATED, "unknown plugin 'colossal'", DOPT_ERR_NOT_FOUND, 0, "", 0, 0, 0, 0, 0},
      {"hybrid", 4, DOPT_TP_REPLICATED, "zero_stage=4", DOPT_ERR_INVALID_ARG, 0, "", 0, 0, 0, 0, 0},
      {"hybrid", 0, DOPT_TP_ROW, "'v' role ROW", DOPT_ERR_INVALID_ARG, 0, "", 0, 0, 0, 0, 0},
      {"hybrid", 0, (dopt_tp_role)7, "roles[0]=7", DOPT_ERR_INVALID_ARG, 0, "", 0, 0, 0, 0, 0},
      {"hybrid", 0, DOPT_TP_REPLICATED, "stages[0]=1 ('v') outside [0, pp=1)", DOPT_ERR_INVALID_ARG, 0, "", 1, 0, 0, 0, 0},
      {"gemini", 3, DOPT_TP_REPLICATED, "plugin gemini needs chunk_elems >= 1", DOPT_ERR_INVALID_ARG, 0, "", 0, 0, 0, 0, 0},
      {"fsdp", 3, DOPT_TP_REPLICATED, "chunk_elems=64 is for plugin gemini, not 'fsdp'", DOPT_ERR_INVALID_ARG, 0, "",
       0, 64, 0, 0, 0},
      {"gemini", 2, DOPT_TP_REPLICATED, "plugin gemini: needs zero=3", DOPT_ERR_INVALID_ARG, 0, "", 0, 64, 0, 0, 0},
      /* MoE-Hybrid: ep outside moe_hybrid, an ep that dp does not split into, ZeRO 3, expert ids without the
       * plugin or out of range */
      {"hybrid", 0, DOPT_TP_REPLICATED, "ep=2 is plugin moe_hybrid's expert parallelism, not 'hybrid'",
       DOPT_ERR_INVALID_ARG, 0, "", 0, 0, 2, 0, 0},
      {"moe_hybrid", 1, DOPT_TP_REPLICATED, "needs dp = moe_dp x ep (got dp=1 ep=2 moe_dp=1)", DOPT_ERR_INVALID_ARG, 0,
       "", 0, 0, 2, 0, 0},
      {"moe_hybrid", 3, DOPT_TP_REPLICATED, "plugin moe_hybrid: needs zero 0-2 (got tp=1 zero=3", DOPT_ERR_INVALID_ARG, 0, "", 0, 0, 0, 0, 0},
      {"hybrid", 0, DOPT_TP_REPLICATED, "expert ids need plugin moe_hybrid", DOPT_ERR_INVALID_ARG, 0, "", 0, 0, 0, 0, 4},
      {"moe_hybrid", 0, DOPT_TP_REPLICATED, "experts[0]=6 ('v') outside [-1, num_experts=6)", DOPT_ERR_INVALID_ARG, 0,
       "", 0, 0, 0, 6, 6},
      {"moe_hybrid", 0, DOPT_TP_REPLICATED, "experts[0]=-2 ('v')", DOPT_ERR_INVALID_ARG, 0, "", 0, 0, 0, -2, 6},
      {"hybrid", 0, DOPT_TP_REPLICATED, "no gradients", DOPT_ERR_STATE, 0, "", 0, 0, 0, 0, 0},
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
      cmocka_unit_test(test_8bit_blocks_any_layout),
      cmocka_unit_test(test_collectives_per_bucket),
      cmocka_unit_test(test_owner_mode_per_parameter),
      cmocka_unit_test(test_galore_split_inner_dimension),
      cmocka_unit_test(test_config_errors),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
