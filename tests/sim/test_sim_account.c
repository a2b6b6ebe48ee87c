/* Accounting: per-communicator counts and bytes, nccl-tests bandwidth
 * factors, the operation log and the alpha-beta projection onto a target
 * cluster (64 GPUs: tp=8 over NVLink, dp=8 over InfiniBand). */
#include "simtest.h"

#include <math.h>

enum { TP = 2, DP = 2, N = TP * DP, ELEMS = 1 << 16 };

typedef struct acct_ctx {
  float buf[N][ELEMS];
  float shard[N][ELEMS / DP];
} acct_ctx;

/* One "training step": TP all-reduce of activations (256 KiB), ZeRO
 * reduce-scatter + all-gather of gradients over DP, a world barrier. */
static dopt_status step_body(dopt_sim_comm *world, int rank, void *user) {
  acct_ctx *a = user;
  dopt_sim_comm *tp, *dp;
  DOPT_TRY(dopt_sim_comm_split_labeled(world, rank / TP, rank, "tp", &tp));
  DOPT_TRY(dopt_sim_comm_split_labeled(world, rank % TP, rank, "dp", &dp));
  DOPT_TRY(dopt_sim_all_reduce(a->buf[rank], a->buf[rank], ELEMS, DOPT_F32, DOPT_SUM, tp));
  DOPT_TRY(dopt_sim_reduce_scatter(a->buf[rank], a->shard[rank], ELEMS / DP, DOPT_F32,
                                   DOPT_SUM, dp));
  DOPT_TRY(dopt_sim_all_gather(a->shard[rank], a->buf[rank], ELEMS / DP, DOPT_F32, dp));
  if (rank == 0)
    DOPT_TRY(dopt_sim_send(a->shard[rank], 16, DOPT_F32, 1, world));
  if (rank == 1)
    DOPT_TRY(dopt_sim_recv(a->shard[rank], 16, DOPT_F32, 0, world));
  return dopt_sim_barrier(world);
}

static void test_stats_and_projection(void **st) {
  (void)st;
  acct_ctx *a = calloc(1, sizeof *a);
  assert_non_null(a);
  dopt_sim_config cfg = DOPT_SIM_CONFIG_INIT;
  cfg.nranks = N;
  dopt_status s[N];
  dopt_sim_world *w;
  st_run(&cfg, step_body, a, s, NULL, &w);
  for (int r = 0; r < N; r++)
    assert_int_equal(s[r], DOPT_OK);

  dopt_sim_comm *c0;
  dopt_sim_stats stats = DOPT_SIM_STATS_INIT;
  assert_ok(dopt_sim_world_comm(w, 0, &c0));
  assert_ok(dopt_sim_comm_stats(c0, &stats));
  assert_int_equal(stats.ops[DOPT_SIM_KIND_SPLIT], 2);
  assert_int_equal(stats.ops[DOPT_SIM_KIND_BARRIER], 1);
  assert_int_equal(stats.ops[DOPT_SIM_KIND_SEND], 1);
  assert_int_equal(stats.bytes[DOPT_SIM_KIND_SEND], 64);
  assert_int_equal(stats.ops[DOPT_SIM_KIND_RECV], 1);
  assert_true(stats.seconds[DOPT_SIM_KIND_BARRIER] > 0.0);

  /* log: 2 tp all-reduces, 2 dp reduce-scatters, 2 dp all-gathers, 1 send, 1 barrier */
  size_t nrec = dopt_sim_world_record_count(w);
  assert_int_equal(nrec, 8);
  int per_label[3] = {0};
  for (size_t i = 0; i < nrec; i++) {
    dopt_sim_record rec;
    assert_ok(dopt_sim_world_record(w, i, &rec));
    const uint64_t full = (uint64_t)ELEMS * 4u;
    if (strcmp(rec.label, "tp") == 0) {
      per_label[0]++;
      assert_int_equal(rec.kind, DOPT_SIM_KIND_ALL_REDUCE);
      assert_int_equal(rec.bytes, full);
      assert_int_equal(rec.nranks, TP);
    } else if (strcmp(rec.label, "dp") == 0) {
      per_label[1]++;
      assert_int_equal(rec.bytes, full); /* nccl-tests: the full buffer */
    } else {
      per_label[2]++;
      assert_string_equal(rec.label, "world");
    }
  }
  assert_int_equal(per_label[0], 2);
  assert_int_equal(per_label[1], 4);
  assert_int_equal(per_label[2], 2);

  /* projection for rank 0 on 64 GPUs */
  const dopt_sim_link links[2] = {{"tp", 8, 450e9, 2e-6}, {"dp", 8, 50e9, 5e-6}};
  dopt_sim_cluster cl = DOPT_SIM_CLUSTER_INIT;
  cl.links = links;
  cl.nlinks = 2;
  cl.fallback = (dopt_sim_link){"world", 64, 50e9, 5e-6};
  dopt_sim_projection p = DOPT_SIM_PROJECTION_INIT;
  assert_ok(dopt_sim_project(w, 0, &cl, &p));
  double B = (double)ELEMS * 4.0;
  double ar = 14 * 2e-6 + 2.0 * 7.0 / 8.0 * B / 450e9;
  double rs = 7 * 5e-6 + 7.0 / 8.0 * B / 50e9;
  double send = 5e-6 + 64.0 / 50e9;
  double bar = 2.0 * 63.0 * 5e-6;
  assert_true(fabs(p.seconds[DOPT_SIM_KIND_ALL_REDUCE] - ar) < 1e-12);
  assert_true(fabs(p.seconds[DOPT_SIM_KIND_REDUCE_SCATTER] - rs) < 1e-12);
  assert_true(fabs(p.seconds[DOPT_SIM_KIND_ALL_GATHER] - rs) < 1e-12);
  assert_true(fabs(p.seconds[DOPT_SIM_KIND_SEND] - send) < 1e-12);
  assert_true(fabs(p.total_s - (ar + 2 * rs + send + bar)) < 1e-12);
  assert_int_equal(p.ops[DOPT_SIM_KIND_ALL_REDUCE], 1); /* only rank 0's TP group */
  /* rank 3 is neither sender nor receiver */
  assert_ok(dopt_sim_project(w, 3, &cl, &p));
  assert_int_equal(p.ops[DOPT_SIM_KIND_SEND], 0);
  cl.struct_size = 4;
  assert_status(dopt_sim_project(w, 0, &cl, &p), DOPT_ERR_INVALID_ARG, "struct_size=4");
  dopt_sim_world_destroy(w);
  free(a);
}

static void test_bandwidth_factors(void **st) {
  (void)st;
  assert_true(dopt_sim_busbw_factor(DOPT_SIM_KIND_ALL_REDUCE, 8) == 2.0 * 7.0 / 8.0);
  assert_true(dopt_sim_busbw_factor(DOPT_SIM_KIND_REDUCE_SCATTER, 4) == 0.75);
  assert_true(dopt_sim_busbw_factor(DOPT_SIM_KIND_ALL_GATHER, 2) == 0.5);
  assert_true(dopt_sim_busbw_factor(DOPT_SIM_KIND_ALL_TO_ALL, 4) == 0.75);
  assert_true(dopt_sim_busbw_factor(DOPT_SIM_KIND_BROADCAST, 4) == 1.0);
  assert_true(dopt_sim_busbw_factor(DOPT_SIM_KIND_REDUCE, 4) == 1.0);
  double alg, bus;
  assert_ok(dopt_sim_bandwidth(DOPT_SIM_KIND_ALL_REDUCE, 4, 1000000, 0.001, &alg, &bus));
  assert_true(fabs(alg - 1e9) < 1e-3);
  assert_true(fabs(bus - 1.5e9) < 1e-3);
  assert_status(dopt_sim_bandwidth(DOPT_SIM_KIND_ALL_REDUCE, 4, 1, 0.0, &alg, &bus),
                DOPT_ERR_INVALID_ARG, "seconds=0");
  dopt_sim_link l = {"x", 0, 1e9, 1e-6};
  assert_true(dopt_sim_cost(DOPT_SIM_KIND_ALL_REDUCE, 1, 1000, &l) == 0.0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_stats_and_projection),
      cmocka_unit_test(test_bandwidth_factors),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
