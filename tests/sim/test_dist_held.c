/* Gathers to the lead only (dopt_dist_set_gather) and the replica check on
 * held pieces (dopt_dist_check_held), on tp 2 x dp 3: the lead's tensors are
 * the all-gather's bytes; a bit flipped in one rank's copy of a replicated
 * piece (white box: the rank's own buffer) is found by every rank, at the
 * right rank, by name; a flipped bit in an unreplicated shard is not a
 * replica difference. Each case runs twice: with the simulator's exchanges by
 * reference (the CPU device's copies compared in place with rank 0's) and
 * copied (no views: compared by digest). */
#include "testutil.h"

#include <stdio.h>
#include <string.h>

#include "dist_internal.h"
#include "distopt/sim.h"

enum { TP = 2, DP = 3, NR = TP * DP, STEPS = 2 };

typedef struct held_case {
  const char *opt, *hp; /* NULL: adafactor's defaults */
  int zero;
  int bad_rank;      /* world rank whose copy is flipped (-1: none) */
  int param, entry;  /* the flipped piece: 0 fp32 values, 1 + k state k */
  int last;          /* flip the held values' last byte (entry 0), not the first */
  int want_rank;     /* the answer (-1: none) */
  const char *want;  /* its name */
  /* per world rank: what it got */
  int rank[NR], pidx[NR];
  char name[NR][64];
  int gathers_equal; /* the lead: lead-mode gathers byte-equal to the all-gathers */
} held_case;

static const int64_t WS[2] = {6, 5};

static dopt_status body(dopt_sim_comm *world, int rank, void *user) {
  held_case *x = user;
  dopt_sim_comm *tpc, *dpc;
  DOPT_TRY(dopt_sim_comm_split_labeled(world, rank / TP, rank, "tp", &tpc));
  DOPT_TRY(dopt_sim_comm_split_labeled(world, rank % TP, rank, "dp", &dpc));
  float w[30], ln[7];
  for (int k = 0; k < 30; k++) w[k] = 0.01f * (float)(k % 7) - 0.02f;
  for (int k = 0; k < 7; k++) ln[k] = 1.0f + 0.1f * (float)k;
  dopt_optim *o = NULL;
  DOPT_TRY(dopt_optim_create(x->opt ? x->opt : "adafactor", x->hp, &o));
  dopt_param_config pw = DOPT_PARAM_CONFIG_INIT, pl = DOPT_PARAM_CONFIG_INIT;
  pw.name = "w", pw.ndim = 2, pw.shape[0] = WS[0], pw.shape[1] = WS[1], pw.data = w;
  pl.name = "ln", pl.ndim = 1, pl.shape[0] = 7, pl.data = ln;
  dopt_status s = dopt_optim_add_param(o, 0, &pw, NULL);
  if (s == DOPT_OK) s = dopt_optim_add_param(o, 0, &pl, NULL);
  dopt_dist_config cfg = DOPT_DIST_CONFIG_INIT;
  cfg.plugin = x->zero == 3 ? "fsdp" : "hybrid";
  cfg.zero_stage = x->zero;
  if (s == DOPT_OK) s = dopt_sim_transport(tpc, &cfg.tp);
  if (s == DOPT_OK) s = dopt_sim_transport(dpc, &cfg.dp);
  const dopt_tp_role roles[2] = {DOPT_TP_COLUMN, DOPT_TP_REPLICATED};
  dopt_dist_optim *d = NULL;
  if (s == DOPT_OK) s = dopt_dist_create(o, &cfg, roles, &d);
  /* the same logical gradients on every dp rank: w's TP block (3 rows of 6), ln whole */
  const int tr = rank % TP;
  for (int t = 0; s == DOPT_OK && t < STEPS; t++) {
    float gw[15], gl[7];
    for (int k = 0; k < 15; k++) gw[k] = 0.05f * (float)((tr * 15 + k + t) % 11) - 0.2f;
    for (int k = 0; k < 7; k++) gl[k] = 0.03f * (float)((k + 2 * t) % 5) - 0.05f;
    const float *g[2] = {gw, gl};
    s = dopt_dist_backward(d, g);
    if (s == DOPT_OK) s = dopt_dist_step(d, NULL);
  }
  /* lead-mode gathers against the all-gathers, every tensor */
  const int lead = dopt_dist_is_lead(d);
  int equal = 1;
  for (int i = 0; s == DOPT_OK && i < 2; i++) {
    float a[30], b[30];
    s = dopt_dist_set_gather(d, DOPT_DIST_GATHER_LEAD);
    if (s == DOPT_OK) s = dopt_dist_gather_param(d, i, lead ? a : NULL);
    if (s == DOPT_OK) s = dopt_dist_set_gather(d, DOPT_DIST_GATHER_ALL);
    if (s == DOPT_OK) s = dopt_dist_gather_param(d, i, b);
    if (s == DOPT_OK && lead) equal &= memcmp(a, b, (i == 0 ? 30 : 7) * sizeof(float)) == 0;
    for (int k = 0; s == DOPT_OK && k < d->p[i].nstates; k++) {
      const char *key = d->p[i].spec[k].v.name;
      size_t bytes = 0;
      s = dopt_dist_state_bytes(d, i, key, &bytes);
      float sa[30], sb[30];
      if (s == DOPT_OK && bytes > sizeof sa) s = DOPT_ERR_SHAPE;
      if (s == DOPT_OK) s = dopt_dist_set_gather(d, DOPT_DIST_GATHER_LEAD);
      if (s == DOPT_OK) s = dopt_dist_gather_state(d, i, key, lead ? sa : NULL);
      if (s == DOPT_OK) s = dopt_dist_set_gather(d, DOPT_DIST_GATHER_ALL);
      if (s == DOPT_OK) s = dopt_dist_gather_state(d, i, key, sb);
      if (s == DOPT_OK && lead) equal &= memcmp(sa, sb, bytes) == 0;
    }
  }
  if (lead) x->gathers_equal = equal;
  /* the plant: one bit of this rank's own copy */
  if (s == DOPT_OK && rank == x->bad_rank) {
    dist_param *p = &d->p[x->param];
    unsigned char *at = x->entry == 0 ? (unsigned char *)p->master : (unsigned char *)p->state[x->entry - 1];
    const size_t held = (p->master_sharded ? p->pc.len : p->lnumel) * sizeof(float); /* entry 0's bytes */
    at[x->last ? held - 1 : 0] ^= 0x01;
  }
  if (s == DOPT_OK) s = dopt_dist_check_held(d, &x->rank[rank], &x->pidx[rank], x->name[rank], sizeof x->name[rank]);
  dopt_dist_destroy(d);
  dopt_optim_destroy(o);
  return s;
}

static void test_held(void **st) {
  (void)st;
  /* adafactor's states: w (factored) exp_avg_sq_row, exp_avg_sq_col, RMS; ln exp_avg_sq, RMS. World rank
   * r is tp rank r % 2, dp rank r / 2. */
  /* adamw8bit (blocks of 64): w [6, 5] is one block whose elements every piece holds (tp 2 x dp 3 at ZeRO
   * 1..3, tp 2 at ZeRO 0), states state1, state2, absmax1, absmax2; ln stays fp32 (7 < 16) */
  const char *q8 = "adamw8bit", *q8hp = "lr=1e-2,min_8bit_size=16,block_size=64";
  held_case cases[] = {
      /* a shared block's absmax copy on rank 4 (not the rank of the block's first element, rank 0) */
      {q8, q8hp, 1, 4, 0, 3, 0, 4, "w/absmax1", {0}, {0}, {{0}}, 0},
      {q8, q8hp, 3, 5, 0, 4, 0, 5, "w/absmax2", {0}, {0}, {{0}}, 0},
      /* the first element's holder itself: every other holder differs from it, the lowest is named */
      {q8, q8hp, 2, 0, 0, 3, 0, 1, "w/absmax1", {0}, {0}, {{0}}, 0},
      /* ZeRO 0: replicated over dp, and shared over tp */
      {q8, q8hp, 0, 3, 0, 3, 0, 3, "w/absmax1", {0}, {0}, {{0}}, 0},
      /* the codes are a shard held once at ZeRO 2: not a replica difference */
      {q8, q8hp, 2, 3, 0, 1, 0, -1, "", {0}, {0}, {{0}}, 0},
      {q8, q8hp, 2, -1, 0, 0, 0, -1, "", {0}, {0}, {{0}}, 0},
      {NULL, NULL, 1, -1, 0, 0, 0, -1, "", {0}, {0}, {{0}}, 0},
      {NULL, NULL, 0, -1, 0, 0, 0, -1, "", {0}, {0}, {{0}}, 0},
      {NULL, NULL, 3, -1, 0, 0, 0, -1, "", {0}, {0}, {{0}}, 0},
      /* ln's values (TP-replicated) on rank 3: differs from rank 2 (tp) and rank 1 (dp) */
      {NULL, NULL, 1, 3, 1, 0, 0, 3, "ln", {0}, {0}, {{0}}, 0},
      /* w's values (replicated over dp below ZeRO-3) on rank 4 */
      {NULL, NULL, 1, 4, 0, 0, 0, 4, "w", {0}, {0}, {{0}}, 0},
      /* a factored statistic, the logical state on every rank, on rank 5 */
      {NULL, NULL, 2, 5, 0, 1, 0, 5, "w/exp_avg_sq_row", {0}, {0}, {{0}}, 0},
      /* an elementwise state at ZeRO 0 (replicated over dp) on rank 2 */
      {NULL, NULL, 0, 2, 1, 1, 0, 2, "ln/exp_avg_sq", {0}, {0}, {{0}}, 0},
      /* ZeRO 3: w's values are a shard held once: not a replica difference */
      {NULL, NULL, 3, 4, 0, 0, 0, -1, "", {0}, {0}, {{0}}, 0},
      /* ZeRO 3: ln's shard is held by both TP ranks of its dp rank */
      {NULL, NULL, 3, 3, 1, 0, 0, 3, "ln", {0}, {0}, {{0}}, 0},
      /* dp rank 0 itself (rank 0): the others of its dp group differ from it, the lowest is named */
      {NULL, NULL, 1, 0, 0, 0, 0, 2, "w", {0}, {0}, {{0}}, 0},
      /* the last byte of a replicated copy: compared to the end (ZeRO 1: w's values whole; ZeRO 3: ln's shard) */
      {NULL, NULL, 1, 4, 0, 0, 1, 4, "w", {0}, {0}, {{0}}, 0},
      {NULL, NULL, 3, 3, 1, 0, 1, 3, "ln", {0}, {0}, {{0}}, 0},
  };
  for (size_t c = 0; c < 2 * (sizeof cases / sizeof cases[0]); c++) {
    held_case *x = &cases[c / 2];
    memset(x->rank, 0, sizeof x->rank);
    memset(x->name, 0, sizeof x->name);
    x->gathers_equal = 0;
    dopt_sim_config sc = DOPT_SIM_CONFIG_INIT;
    sc.nranks = NR;
    sc.copy_exchanges = (int)(c % 2); /* no views: digests */
    sc.timeout_ms = 20000;
    dopt_sim_world *w;
    assert_ok(dopt_sim_world_create(&sc, &w));
    dopt_status rs[NR];
    assert_ok(dopt_sim_launch(w, body, x, rs));
    for (int r = 0; r < NR; r++) {
      if (rs[r] != DOPT_OK) fail_msg("case %zu rank %d: %s", c, r, dopt_sim_world_rank_error(w, r));
      if (x->rank[r] != x->want_rank || (x->want_rank >= 0 && strcmp(x->name[r], x->want) != 0))
        fail_msg("case %zu (zero %d, rank %d's %s, %s): rank %d got rank %d '%s', want %d '%s'", c / 2, x->zero,
                 x->bad_rank, x->want, c % 2 ? "copied: digests" : "in place", r, x->rank[r], x->name[r],
                 x->want_rank, x->want);
      if (x->want_rank >= 0 && x->pidx[r] != x->param) fail_msg("case %zu rank %d: param %d", c, r, x->pidx[r]);
    }
    if (!x->gathers_equal) fail_msg("case %zu (zero %d): the lead's gathers differ from the all-gathers", c, x->zero);
    dopt_sim_world_destroy(w);
  }
}

/* One rank (the lead): out NULL is refused in both modes, and the mode is checked. */
static dopt_status one_body(dopt_sim_comm *world, int rank, void *user) {
  (void)rank;
  int *ok = user;
  float v[4] = {1, 2, 3, 4};
  dopt_optim *o = NULL;
  DOPT_TRY(dopt_optim_create("adamw", NULL, &o));
  dopt_param_config pc = DOPT_PARAM_CONFIG_INIT;
  pc.name = "v", pc.ndim = 1, pc.shape[0] = 4, pc.data = v;
  dopt_status s = dopt_optim_add_param(o, 0, &pc, NULL);
  dopt_dist_config cfg = DOPT_DIST_CONFIG_INIT;
  if (s == DOPT_OK) s = dopt_sim_transport(world, &cfg.tp);
  if (s == DOPT_OK) s = dopt_sim_transport(world, &cfg.dp);
  dopt_tp_role role = DOPT_TP_REPLICATED;
  dopt_dist_optim *d = NULL;
  if (s == DOPT_OK) s = dopt_dist_create(o, &cfg, &role, &d);
  *ok = s == DOPT_OK && dopt_dist_is_lead(d) && dopt_dist_gather_param(d, 0, NULL) == DOPT_ERR_INVALID_ARG &&
        dopt_dist_set_gather(d, DOPT_DIST_GATHER_LEAD) == DOPT_OK &&
        dopt_dist_gather_param(d, 0, NULL) == DOPT_ERR_INVALID_ARG && dopt_dist_set_gather(d, 2) == DOPT_ERR_INVALID_ARG;
  dopt_dist_destroy(d);
  dopt_optim_destroy(o);
  return s;
}

static void test_lead_args(void **st) {
  (void)st;
  dopt_sim_config sc = DOPT_SIM_CONFIG_INIT;
  sc.nranks = 1;
  sc.timeout_ms = 20000;
  dopt_sim_world *w;
  assert_ok(dopt_sim_world_create(&sc, &w));
  dopt_status rs[1];
  int ok = 0;
  assert_ok(dopt_sim_launch(w, one_body, &ok, rs));
  assert_ok(rs[0]);
  assert_true(ok);
  dopt_sim_world_destroy(w);
}

int main(void) {
  const struct CMUnitTest tests[] = {cmocka_unit_test(test_held), cmocka_unit_test(test_lead_args)};
  return cmocka_run_group_tests(tests, NULL, NULL);
}
