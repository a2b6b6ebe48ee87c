/* The exact dp sum's exchange and the parameters' all-gather read in place (the
 * transport's all_to_allv_view and all_gather_view, which the simulator offers
 * on host buffers) against the same runs with every
 * exchange copied (dopt_sim_config.copy_exchanges): every rank's gathered
 * parameters and states byte-equal, its replicas equal (dopt_dist_check_held),
 * for buckets of one tensor (the parts read from the senders' accumulators),
 * of all tensors (from their pack buffers) and batch-invariant micro-batches
 * (several parts per rank, its own among them), at ZeRO 0 to 3 on tp 2 × dp 3
 * and tp 1 × dp 4; each dp communicator issued one release (a barrier) per
 * exchange and per all-gather when reading in place, none when copying, and
 * the same exchanges and all-gathers.
 * Then the same tensors gathered to the lead inside dopt_dist_gather_begin/end:
 * read in place, one exchange and one release per dp communicator for the
 * whole run of gathers (none per tensor) and a step refused inside; copied,
 * the bracket does nothing and each gather is a collective; either way the
 * lead's tensors byte-equal rank 0's gathered to every rank. */
#include "simtest.h"

#include <string.h>

#include "distopt/dist.h"

enum { NP = 4, MAXN = 128, MAXR = 6, MAXS = 2, STEPS = 3 };
static const char *const KEYS[] = {"exp_avg", "exp_avg_sq"}; /* AdamW's states (MAXS) */

static const struct {
  const char *name;
  int ndim;
  int64_t shape[2];
  dopt_tp_role role;
} P[NP] = {{"w1", 2, {12, 10}, DOPT_TP_COLUMN},
           {"b1", 1, {12}, DOPT_TP_COLUMN},
           {"w2", 2, {7, 12}, DOPT_TP_ROW},
           {"ln", 1, {9}, DOPT_TP_REPLICATED}};

typedef struct run {
  int tp, dp, zero, bucket_one, micro, copy; /* bucket_one: a bucket per tensor; micro > 1: batch invariant */
  /* per world rank */
  float param[MAXR][NP][MAXN], state[MAXR][NP][MAXS][MAXN];
  float lparam[NP][MAXN], lstate[NP][MAXS][MAXN]; /* gathered to the lead inside the bracket */
  uint64_t a2a[MAXR], ag[MAXR], barriers[MAXR];
  uint64_t la2a[MAXR], lbarriers[MAXR]; /* the dp communicator's during the bracket */
  int refused[MAXR];                    /* a step inside the bracket: its status */
  int held_rank[MAXR];
  char msg[MAXR][256];
} run;

static float grad_value(uint64_t seed) {
  uint64_t s = seed;
  return (float)(dt_rand_uniform(&s) - 0.5) * 0.1f;
}

static dopt_status body(dopt_sim_comm *world, int rank, void *user) {
  run *x = user;
  dopt_sim_comm *tpc, *dpc;
  DOPT_TRY(dopt_sim_comm_split_labeled(world, rank / x->tp, rank, "tp", &tpc));
  DOPT_TRY(dopt_sim_comm_split_labeled(world, rank % x->tp, rank, "dp", &dpc));
  const int tr = rank % x->tp, dr = rank / x->tp;
  float w[NP][MAXN];
  dopt_optim *o = NULL;
  DOPT_TRY(dopt_optim_create("adamw", "lr=1e-2,weight_decay=0.1", &o));
  dopt_status s = DOPT_OK;
  for (int i = 0; i < NP && s == DOPT_OK; i++) {
    for (int k = 0; k < MAXN; k++) w[i][k] = 0.01f * (float)((k * 7 + i) % 13) - 0.05f;
    dopt_param_config pc = DOPT_PARAM_CONFIG_INIT;
    pc.name = P[i].name, pc.ndim = P[i].ndim, pc.shape[0] = P[i].shape[0], pc.shape[1] = P[i].shape[1];
    pc.data = w[i];
    s = dopt_optim_add_param(o, 0, &pc, NULL);
  }
  dopt_dist_config cfg = DOPT_DIST_CONFIG_INIT;
  cfg.plugin = x->zero == 3 ? "fsdp" : "hybrid";
  cfg.zero_stage = x->zero;
  cfg.bucket_bytes = x->bucket_one ? 1 : 0;
  cfg.batch_invariant = x->micro > 1;
  if (s == DOPT_OK) s = dopt_sim_transport(tpc, &cfg.tp);
  if (s == DOPT_OK) s = dopt_sim_transport(dpc, &cfg.dp);
  /* the transport offers reads in place unless the world copies */
  if (s == DOPT_OK && (cfg.dp.ops->all_to_allv_view != NULL) == (x->copy != 0)) s = DOPT_ERR_STATE;
  dopt_tp_role roles[NP];
  for (int i = 0; i < NP; i++) roles[i] = P[i].role;
  dopt_dist_optim *d = NULL;
  if (s == DOPT_OK) s = dopt_dist_create(o, &cfg, roles, &d);
  size_t ln[NP] = {0};
  for (int i = 0; i < NP && s == DOPT_OK; i++) {
    int nd;
    int64_t sh[DOPT_MAX_DIMS];
    s = dopt_dist_local_shape(d, i, &nd, sh, &ln[i]);
  }
  /* gradients: each dp rank's own, a TP block's own values, a TP-replicated tensor's the same on its tp ranks */
  for (int t = 0; s == DOPT_OK && t < STEPS; t++) {
    for (int m = 0; s == DOPT_OK && m < x->micro; m++) {
      float g[NP][MAXN];
      const float *gp[NP];
      for (int i = 0; i < NP; i++) {
        const uint64_t who = (uint64_t)dr * 16 + (P[i].role == DOPT_TP_REPLICATED ? 0 : (uint64_t)tr + 1);
        for (size_t k = 0; k < ln[i]; k++)
          g[i][k] = grad_value(((who * 8 + (uint64_t)t) * 4 + (uint64_t)m) * 1000003 + (uint64_t)i * 4099 + k);
        gp[i] = g[i];
      }
      s = dopt_dist_backward(d, gp);
    }
    if (s == DOPT_OK) s = dopt_dist_step(d, NULL);
  }
  dopt_sim_stats st = DOPT_SIM_STATS_INIT;
  if (s == DOPT_OK) s = dopt_sim_comm_stats(dpc, &st);
  x->a2a[rank] = st.ops[DOPT_SIM_KIND_ALL_TO_ALLV], x->barriers[rank] = st.ops[DOPT_SIM_KIND_BARRIER];
  x->ag[rank] = st.ops[DOPT_SIM_KIND_ALL_GATHER];
  for (int i = 0; i < NP && s == DOPT_OK; i++) {
    s = dopt_dist_gather_param(d, i, x->param[rank][i]);
    for (int k = 0; k < MAXS && s == DOPT_OK; k++) {
      size_t bytes = 0;
      s = dopt_dist_state_bytes(d, i, KEYS[k], &bytes);
      if (s == DOPT_OK && bytes > sizeof x->state[rank][i][k]) s = DOPT_ERR_SHAPE;
      if (s == DOPT_OK) s = dopt_dist_gather_state(d, i, KEYS[k], x->state[rank][i][k]);
    }
  }
  int pidx;
  char name[64];
  if (s == DOPT_OK) s = dopt_dist_check_held(d, &x->held_rank[rank], &pidx, name, sizeof name);
  /* the lead's gathers inside the bracket (the others pass NULL) */
  const int lead = dopt_dist_is_lead(d);
  dopt_sim_stats s0 = DOPT_SIM_STATS_INIT, s1 = DOPT_SIM_STATS_INIT;
  if (s == DOPT_OK) s = dopt_dist_set_gather(d, DOPT_DIST_GATHER_LEAD);
  if (s == DOPT_OK) s = dopt_sim_comm_stats(dpc, &s0);
  /* in place: a gradient pending, so that only the bracket stops the step inside it */
  static const float zeros[MAXN];
  const float *zp[NP] = {zeros, zeros, zeros, zeros};
  if (s == DOPT_OK && !x->copy) s = dopt_dist_backward(d, zp);
  if (s == DOPT_OK) s = dopt_dist_gather_begin(d);
  if (s == DOPT_OK && !x->copy) x->refused[rank] = dopt_dist_step(d, NULL);
  for (int i = 0; i < NP && s == DOPT_OK; i++) {
    s = dopt_dist_gather_param(d, i, lead ? x->lparam[i] : NULL);
    for (int k = 0; k < MAXS && s == DOPT_OK; k++)
      s = dopt_dist_gather_state(d, i, KEYS[k], lead ? x->lstate[i][k] : NULL);
  }
  if (s == DOPT_OK) s = dopt_dist_gather_end(d);
  if (s == DOPT_OK) s = dopt_sim_comm_stats(dpc, &s1);
  x->la2a[rank] = s1.ops[DOPT_SIM_KIND_ALL_TO_ALLV] - s0.ops[DOPT_SIM_KIND_ALL_TO_ALLV];
  x->lbarriers[rank] = s1.ops[DOPT_SIM_KIND_BARRIER] - s0.ops[DOPT_SIM_KIND_BARRIER];
  if (s != DOPT_OK) snprintf(x->msg[rank], sizeof x->msg[rank], "%s", dopt_last_error());
  dopt_dist_destroy(d);
  dopt_optim_destroy(o);
  return s;
}

static void launch(run *x) {
  dopt_sim_config sc = DOPT_SIM_CONFIG_INIT;
  sc.nranks = x->tp * x->dp;
  sc.timeout_ms = 60000;
  sc.copy_exchanges = x->copy;
  dopt_status rs[MAXR];
  st_run(&sc, body, x, rs, NULL, NULL);
  for (int r = 0; r < sc.nranks; r++)
    if (rs[r] != DOPT_OK)
      fail_msg("tp%d dp%d zero%d bucket_one %d micro %d copy %d rank %d: %s: %s", x->tp, x->dp, x->zero,
               x->bucket_one, x->micro, x->copy, r, dopt_status_name(rs[r]), x->msg[r]);
}

static void test_views_equal_copies(void **st) {
  (void)st;
  static const int L[][2] = {{2, 3}, {1, 4}};
  run *v = malloc(sizeof *v), *c = malloc(sizeof *c);
  assert_true(v && c);
  int cases = 0;
  for (size_t li = 0; li < sizeof L / sizeof L[0]; li++)
    for (int zero = 0; zero <= 3; zero++)
      for (int shape = 0; shape < 3; shape++) { /* a bucket per tensor; one bucket; micro-batches */
        memset(v, 0, sizeof *v);
        v->tp = L[li][0], v->dp = L[li][1], v->zero = zero;
        v->bucket_one = shape == 0, v->micro = shape == 2 ? 2 : 1;
        *c = *v;
        c->copy = 1;
        launch(v);
        launch(c);
        const int nr = v->tp * v->dp;
        for (int r = 0; r < nr; r++) {
          if (memcmp(v->param[r], c->param[r], sizeof v->param[r]) != 0 ||
              memcmp(v->state[r], c->state[r], sizeof v->state[r]) != 0)
            fail_msg("tp%d dp%d zero%d shape %d: rank %d's parameters or states differ read in place and copied",
                     v->tp, v->dp, zero, shape, r);
          if (v->held_rank[r] != -1 || c->held_rank[r] != -1)
            fail_msg("tp%d dp%d zero%d shape %d: rank %d: replicas differ on rank %d (in place) / %d (copied)", v->tp,
                     v->dp, zero, shape, r, v->held_rank[r], c->held_rank[r]);
          /* the exchanges and the all-gathers: the same counts both ways; in place a release per exchange and per
           * all-gather of the parameters (zero 1, 2; zero 0's all-gathers regather the summed gradient, copied),
           * none copied */
          const uint64_t weights = zero == 1 || zero == 2 ? v->ag[r] : 0;
          if (v->a2a[r] != c->a2a[r] || v->a2a[r] == 0 || v->ag[r] != c->ag[r] || (weights == 0) != (zero % 3 == 0) ||
              v->barriers[r] != v->a2a[r] + weights || c->barriers[r] != 0)
            fail_msg("tp%d dp%d zero%d shape %d: rank %d's dp exchanges %llu (copied %llu), all-gathers %llu (copied "
                     "%llu), releases %llu (copied %llu)",
                     v->tp, v->dp, zero, shape, r, (unsigned long long)v->a2a[r], (unsigned long long)c->a2a[r],
                     (unsigned long long)v->ag[r], (unsigned long long)c->ag[r], (unsigned long long)v->barriers[r],
                     (unsigned long long)c->barriers[r]);
        }
        /* the lead's bracketed gathers: rank 0's tensors, both ways */
        if (memcmp(v->lparam, v->param[0], sizeof v->lparam) != 0 || memcmp(v->lstate, v->state[0], sizeof v->lstate) != 0 ||
            memcmp(c->lparam, c->param[0], sizeof c->lparam) != 0 || memcmp(c->lstate, c->state[0], sizeof c->lstate) != 0)
          fail_msg("tp%d dp%d zero%d shape %d: the lead's gathers in a bracket differ from rank 0's gathered to all "
                   "(in place %d, copied %d)",
                   v->tp, v->dp, zero, shape,
                   memcmp(v->lparam, v->param[0], sizeof v->lparam) || memcmp(v->lstate, v->state[0], sizeof v->lstate),
                   memcmp(c->lparam, c->param[0], sizeof c->lparam) || memcmp(c->lstate, c->state[0], sizeof c->lstate));
        for (int r = 0; r < nr; r++) {
          /* in place: one exchange of tables and one release per dp communicator, a step refused; copied: at
           * least one exchange (a sharded tensor's gather), no release */
          const uint64_t one = v->dp > 1;
          if (v->la2a[r] != one || v->lbarriers[r] != one || v->refused[r] != DOPT_ERR_STATE || c->lbarriers[r] != 0 ||
              (zero >= 1 && c->la2a[r] == 0))
            fail_msg("tp%d dp%d zero%d shape %d: rank %d in the bracket: dp exchanges %llu, releases %llu, step %s "
                     "(copied: %llu, %llu)",
                     v->tp, v->dp, zero, shape, r, (unsigned long long)v->la2a[r], (unsigned long long)v->lbarriers[r],
                     dopt_status_name((dopt_status)v->refused[r]), (unsigned long long)c->la2a[r],
                     (unsigned long long)c->lbarriers[r]);
        }
        assert_true(v->param[0][0][0] != -0.05f); /* w1[0] moved from its initial value */
        assert_true(v->state[0][0][1][0] > 0.0f); /* w1[0]'s exp_avg_sq gathered (g != 0) */
        cases++;
      }
  assert_int_equal(cases, 24);
  free(v);
  free(c);
}

int main(void) {
  const struct CMUnitTest tests[] = {cmocka_unit_test(test_views_equal_copies)};
  return cmocka_run_group_tests(tests, NULL, NULL);
}
