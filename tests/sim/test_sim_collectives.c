/* Every collective, dtype and op, in and out of place, at 1, 2, 3, 4, 5 and 8
 * ranks with integer-valued data (exact results, compared with memcmp);
 * count 0; TP x DP grids built with split; point to point. */
#include "simtest.h"

enum { MAX_CASES = 1024, MAX_RANKS = 8 };

typedef struct coll_case {
  dopt_sim_kind kind;
  dopt_dtype dt;
  dopt_redop op;
  size_t count; /* per-rank count (NCCL convention) */
  int inplace;
  int root;
} coll_case;

typedef struct coll_run {
  coll_case cases[MAX_CASES];
  int ncases;
  void *out[MAX_CASES][MAX_RANKS]; /* rank r's received data, owned by main */
} coll_run;

static size_t in_count(const coll_case *c, int n) {
  return c->kind == DOPT_SIM_KIND_REDUCE_SCATTER || c->kind == DOPT_SIM_KIND_ALL_TO_ALL
             ? c->count * (size_t)n
             : c->count;
}

static size_t out_count(const coll_case *c, int n) {
  return c->kind == DOPT_SIM_KIND_ALL_GATHER || c->kind == DOPT_SIM_KIND_ALL_TO_ALL
             ? c->count * (size_t)n
             : c->count;
}

/* Runs one case on this rank; on success *out holds the received data. */
static dopt_status run_case(const coll_case *c, dopt_sim_comm *comm, int r, int n, void **out) {
  size_t esz = dopt_dtype_size(c->dt);
  size_t nin = in_count(c, n), nout = out_count(c, n);
  size_t big = (nin > nout ? nin : nout) + 1;
  unsigned char *in = malloc(big * esz), *res = malloc(big * esz);
  if (in == NULL || res == NULL) {
    free(in);
    free(res);
    return DOPT_ERR_NO_MEMORY;
  }
  memset(res, 0xab, big * esz);
  dopt_status s;
  unsigned char *result = res; /* where the output lands */
  switch (c->kind) {
  case DOPT_SIM_KIND_ALL_GATHER:
    /* in place: own block inside the receive buffer */
    for (size_t e = 0; e < c->count; e++)
      st_put(c->dt, c->inplace ? res + (size_t)r * c->count * esz : in, e,
             st_value(c->dt, c->op, r, e));
    s = dopt_sim_all_gather(c->inplace ? res + (size_t)r * c->count * esz : in, res, c->count,
                            c->dt, comm);
    break;
  default: {
    unsigned char *src = c->inplace ? res : in;
    for (size_t e = 0; e < nin; e++)
      st_put(c->dt, src, e, st_value(c->dt, c->op, r, e));
    unsigned char *dst = res;
    switch (c->kind) {
    case DOPT_SIM_KIND_ALL_REDUCE:
      s = dopt_sim_all_reduce(src, dst, c->count, c->dt, c->op, comm);
      break;
    case DOPT_SIM_KIND_REDUCE_SCATTER:
      if (c->inplace)
        result = dst = res + (size_t)r * c->count * esz;
      s = dopt_sim_reduce_scatter(src, dst, c->count, c->dt, c->op, comm);
      break;
    case DOPT_SIM_KIND_BROADCAST:
      s = dopt_sim_broadcast(src, dst, c->count, c->dt, c->root, comm);
      break;
    case DOPT_SIM_KIND_REDUCE:
      s = dopt_sim_reduce(src, dst, c->count, c->dt, c->op, c->root, comm);
      break;
    default:
      s = dopt_sim_all_to_all(src, dst, c->count, c->dt, comm);
      break;
    }
  }
  }
  if (s == DOPT_OK) {
    memmove(res, result, nout * esz);
    *out = res;
  } else {
    free(res);
  }
  free(in);
  return s;
}

static dopt_status coll_body(dopt_sim_comm *comm, int rank, void *user) {
  coll_run *run = user;
  int n = 0;
  dopt_status s = dopt_sim_comm_size(comm, &n);
  for (int i = 0; s == DOPT_OK && i < run->ncases; i++)
    s = run_case(&run->cases[i], comm, rank, n, &run->out[i][rank]);
  return s;
}

/* Expected output of rank i for case c, in a fresh buffer. */
static void *expected(const coll_case *c, int i, int n) {
  size_t esz = dopt_dtype_size(c->dt), nout = out_count(c, n);
  unsigned char *x = calloc(nout + 1, esz);
  for (size_t e = 0; e < nout; e++) {
    size_t blk = c->count ? e / c->count : 0, off = c->count ? e % c->count : 0;
    switch (c->kind) {
    case DOPT_SIM_KIND_ALL_REDUCE:
    case DOPT_SIM_KIND_REDUCE:
      st_expect_reduce(c->dt, c->op, n, e, x, e);
      break;
    case DOPT_SIM_KIND_REDUCE_SCATTER:
      st_expect_reduce(c->dt, c->op, n, (size_t)i * c->count + e, x, e);
      break;
    case DOPT_SIM_KIND_ALL_GATHER:
      st_put(c->dt, x, e, st_value(c->dt, c->op, (int)blk, off));
      break;
    case DOPT_SIM_KIND_BROADCAST:
      st_put(c->dt, x, e, st_value(c->dt, c->op, c->root, e));
      break;
    default: /* all_to_all: block j from rank j's block i */
      st_put(c->dt, x, e, st_value(c->dt, c->op, (int)blk, (size_t)i * c->count + off));
      break;
    }
  }
  return x;
}

static void add_case(coll_run *run, dopt_sim_kind kind, dopt_dtype dt, dopt_redop op,
                     size_t count, int inplace, int root) {
  assert_true(run->ncases < MAX_CASES);
  run->cases[run->ncases++] = (coll_case){kind, dt, op, count, inplace, root};
}

static void check_all_collectives(int n) {
  static const size_t counts[] = {0, 1, 13, 1500}; /* 1500 > one reduction block */
  coll_run *run = calloc(1, sizeof *run);
  assert_non_null(run);
  for (size_t ci = 0; ci < sizeof counts / sizeof counts[0]; ci++) {
    for (int dt = 0; dt < DOPT_DTYPE_COUNT_; dt++) {
      if (dt == DOPT_F16 || dt == DOPT_I8) continue; /* not collective dtypes */
      for (int ip = 0; ip < 2; ip++) {
        int root = (run->ncases + 1) % n;
        for (int op = 0; op < DOPT_REDOP_COUNT_; op++) {
          add_case(run, DOPT_SIM_KIND_ALL_REDUCE, dt, op, counts[ci], ip, -1);
          add_case(run, DOPT_SIM_KIND_REDUCE_SCATTER, dt, op, counts[ci], ip, -1);
          add_case(run, DOPT_SIM_KIND_REDUCE, dt, op, counts[ci], ip, root);
        }
        add_case(run, DOPT_SIM_KIND_ALL_GATHER, dt, DOPT_SUM, counts[ci], ip, -1);
        add_case(run, DOPT_SIM_KIND_BROADCAST, dt, DOPT_SUM, counts[ci], ip, root);
        if (!ip)
          add_case(run, DOPT_SIM_KIND_ALL_TO_ALL, dt, DOPT_SUM, counts[ci], 0, -1);
      }
    }
  }
  dopt_sim_config cfg = DOPT_SIM_CONFIG_INIT;
  cfg.nranks = n;
  dopt_status st[MAX_RANKS];
  dopt_sim_world *w;
  st_run(&cfg, coll_body, run, st, NULL, &w);
  for (int r = 0; r < n; r++)
    if (st[r] != DOPT_OK)
      fail_msg("n=%d rank %d: %s: %s", n, r, dopt_status_name(st[r]), dopt_sim_world_rank_error(w, r));
  for (int i = 0; i < run->ncases; i++) {
    const coll_case *c = &run->cases[i];
    size_t bytes = out_count(c, n) * dopt_dtype_size(c->dt);
    for (int r = 0; r < n; r++) {
      void *x = expected(c, r, n);
      int skip = c->kind == DOPT_SIM_KIND_REDUCE && r != c->root; /* recv unused */
      if (!skip && memcmp(x, run->out[i][r], bytes) != 0)
        fail_msg("n=%d case %d %s %s %s count=%zu inplace=%d root=%d: rank %d differs", n, i,
                 dopt_sim_kind_name(c->kind), dopt_dtype_name(c->dt), dopt_sim_op_name(c->op),
                 c->count, c->inplace, c->root, r);
      free(x);
      free(run->out[i][r]);
    }
  }
  dopt_sim_stats stats = DOPT_SIM_STATS_INIT;
  dopt_sim_comm *c0;
  assert_ok(dopt_sim_world_comm(w, 0, &c0));
  assert_ok(dopt_sim_comm_stats(c0, &stats));
  assert_string_equal(stats.label, "world");
  uint64_t total = 0;
  for (int k = 0; k < DOPT_SIM_KIND_COUNT; k++)
    total += stats.ops[k];
  assert_int_equal(total, (uint64_t)run->ncases);
  dopt_sim_world_destroy(w);
  free(run);
}

static void test_collectives_n1(void **st) { (void)st; check_all_collectives(1); }
static void test_collectives_n2(void **st) { (void)st; check_all_collectives(2); }
static void test_collectives_n3(void **st) { (void)st; check_all_collectives(3); }
static void test_collectives_n4(void **st) { (void)st; check_all_collectives(4); }
static void test_collectives_n5(void **st) { (void)st; check_all_collectives(5); }
static void test_collectives_n8(void **st) { (void)st; check_all_collectives(8); }

/* ---- TP x DP grids --------------------------------------------------------------
 * TP groups: consecutive ranks (color rank / tp); DP groups: color rank % tp.
 * ZeRO-style: reduce_scatter over DP then all_gather over DP restores the
 * DP all-reduce; TP all-reduce sums the TP group's world ranks. */
typedef struct grid {
  int tp, dp;
  int tp_rank[MAX_RANKS], dp_rank[MAX_RANKS], tp_size[MAX_RANKS], dp_size[MAX_RANKS];
  int tp_wrank[MAX_RANKS], dp_wrank[MAX_RANKS]; /* dopt_sim_comm_world_rank of the sub-communicators */
  int64_t tp_sum[MAX_RANKS];
  int64_t zero[MAX_RANKS][4 * MAX_RANKS];
  char tp_label[MAX_RANKS][DOPT_SIM_LABEL_MAX];
  int nocolor_null[MAX_RANKS];
} grid;

static dopt_status grid_body(dopt_sim_comm *world, int rank, void *user) {
  grid *g = user;
  dopt_sim_comm *tp, *dp, *none;
  DOPT_TRY(dopt_sim_comm_split_labeled(world, rank / g->tp, rank, "tp", &tp));
  DOPT_TRY(dopt_sim_comm_split_labeled(world, rank % g->tp, rank, "dp", &dp));
  DOPT_TRY(dopt_sim_comm_split(world, DOPT_SIM_SPLIT_NOCOLOR, 0, &none));
  g->nocolor_null[rank] = none == NULL;
  DOPT_TRY(dopt_sim_comm_rank(tp, &g->tp_rank[rank]));
  DOPT_TRY(dopt_sim_comm_rank(dp, &g->dp_rank[rank]));
  DOPT_TRY(dopt_sim_comm_size(tp, &g->tp_size[rank]));
  DOPT_TRY(dopt_sim_comm_size(dp, &g->dp_size[rank]));
  DOPT_TRY(dopt_sim_comm_world_rank(tp, &g->tp_wrank[rank]));
  DOPT_TRY(dopt_sim_comm_world_rank(dp, &g->dp_wrank[rank]));
  snprintf(g->tp_label[rank], DOPT_SIM_LABEL_MAX, "%s", dopt_sim_comm_label(tp));
  int64_t mine = rank;
  DOPT_TRY(dopt_sim_all_reduce(&mine, &g->tp_sum[rank], 1, DOPT_I64, DOPT_SUM, tp));
  /* ZeRO: grads of 4*dp elements, reduce-scatter then all-gather over DP */
  int64_t grad[4 * MAX_RANKS], shard[4];
  for (int e = 0; e < 4 * g->dp; e++)
    grad[e] = rank * 100 + e;
  DOPT_TRY(dopt_sim_reduce_scatter(grad, shard, 4, DOPT_I64, DOPT_SUM, dp));
  DOPT_TRY(dopt_sim_all_gather(shard, g->zero[rank], 4, DOPT_I64, dp));
  DOPT_TRY(dopt_sim_comm_destroy(tp));
  return dopt_sim_comm_destroy(dp);
}

static void check_grid(int tp, int dp) {
  grid *g = calloc(1, sizeof *g);
  assert_non_null(g);
  g->tp = tp;
  g->dp = dp;
  int n = tp * dp;
  dopt_sim_config cfg = DOPT_SIM_CONFIG_INIT;
  cfg.nranks = n;
  dopt_status st[MAX_RANKS];
  dopt_sim_world *w;
  st_run(&cfg, grid_body, g, st, NULL, &w);
  assert_int_equal(dopt_sim_world_size(w), n);
  for (int r = 0; r < n; r++) {
    if (st[r] != DOPT_OK)
      fail_msg("tp=%d dp=%d rank %d: %s", tp, dp, r, dopt_sim_world_rank_error(w, r));
    assert_true(g->nocolor_null[r]);
    assert_int_equal(g->tp_size[r], tp);
    assert_int_equal(g->dp_size[r], dp);
    assert_int_equal(g->tp_rank[r], r % tp);
    assert_int_equal(g->dp_rank[r], r / tp);
    assert_int_equal(g->tp_wrank[r], r); /* a sub-communicator's member keeps its world rank */
    assert_int_equal(g->dp_wrank[r], r);
    assert_string_equal(g->tp_label[r], "tp");
    int base = (r / tp) * tp;
    int64_t want = 0;
    for (int j = 0; j < tp; j++)
      want += base + j;
    assert_int_equal(g->tp_sum[r], want);
    for (int e = 0; e < 4 * dp; e++) {
      int64_t z = 0;
      for (int j = 0; j < dp; j++)
        z += (r % tp + j * tp) * 100 + e;
      assert_int_equal(g->zero[r][e], z);
    }
  }
  dopt_sim_world_destroy(w);
  free(g);
}

static void test_grids(void **st) {
  (void)st;
  check_grid(2, 2);
  check_grid(2, 4);
  check_grid(4, 2);
  check_grid(1, 3);
  check_grid(5, 1);
  /* the queries' refusals */
  assert_int_equal(dopt_sim_world_size(NULL), 0);
  int wr = -1;
  assert_status(dopt_sim_comm_world_rank(NULL, &wr), DOPT_ERR_INVALID_ARG, "comm=NULL");
  dopt_sim_config cfg = DOPT_SIM_CONFIG_INIT;
  cfg.nranks = 3;
  dopt_sim_world *w = NULL;
  assert_ok(dopt_sim_world_create(&cfg, &w));
  dopt_sim_comm *c = NULL;
  assert_ok(dopt_sim_world_comm(w, 2, &c));
  assert_ok(dopt_sim_comm_world_rank(c, &wr));
  assert_int_equal(wr, 2);
  assert_status(dopt_sim_comm_world_rank(c, NULL), DOPT_ERR_INVALID_ARG, "world_rank=NULL");
  dopt_sim_world_destroy(w);
}

/* Split ordering: by key, then by parent rank. */
typedef struct order_res {
  int newrank[MAX_RANKS];
} order_res;

static dopt_status order_body(dopt_sim_comm *world, int rank, void *user) {
  order_res *o = user;
  dopt_sim_comm *c;
  /* one color; key reverses the order for ranks 0..3, ties (key 9) keep parent order */
  DOPT_TRY(dopt_sim_comm_split(world, 0, rank < 4 ? 4 - rank : 9, &c));
  return dopt_sim_comm_rank(c, &o->newrank[rank]);
}

static void test_split_order(void **st) {
  (void)st;
  order_res o;
  dopt_sim_config cfg = DOPT_SIM_CONFIG_INIT;
  cfg.nranks = 6;
  dopt_status s[6];
  st_run(&cfg, order_body, &o, s, NULL, NULL);
  static const int want[6] = {3, 2, 1, 0, 4, 5};
  for (int r = 0; r < 6; r++) {
    assert_int_equal(s[r], DOPT_OK);
    assert_int_equal(o.newrank[r], want[r]);
  }
}

/* ---- point to point ----------------------------------------------------------------
 * Ring shift of two messages: matched by peer and order; eager sends do not
 * deadlock; the barrier separates rounds. */
typedef struct p2p_res {
  int32_t got[MAX_RANKS][2][5];
} p2p_res;

static dopt_status p2p_body(dopt_sim_comm *c, int rank, void *user) {
  p2p_res *p = user;
  int n;
  DOPT_TRY(dopt_sim_comm_size(c, &n));
  int32_t a[5], b[5];
  for (int e = 0; e < 5; e++) {
    a[e] = rank * 10 + e;
    b[e] = -(rank * 10 + e);
  }
  DOPT_TRY(dopt_sim_send(a, 5, DOPT_I32, (rank + 1) % n, c));
  DOPT_TRY(dopt_sim_send(b, 5, DOPT_I32, (rank + 1) % n, c));
  DOPT_TRY(dopt_sim_recv(p->got[rank][0], 5, DOPT_I32, (rank + n - 1) % n, c));
  DOPT_TRY(dopt_sim_recv(p->got[rank][1], 5, DOPT_I32, (rank + n - 1) % n, c));
  DOPT_TRY(dopt_sim_send(NULL, 0, DOPT_F32, rank, c)); /* count 0 to self */
  DOPT_TRY(dopt_sim_recv(NULL, 0, DOPT_F32, rank, c));
  return dopt_sim_barrier(c);
}

static void test_send_recv(void **st) {
  (void)st;
  for (int n = 1; n <= MAX_RANKS; n++) {
    p2p_res p;
    dopt_sim_config cfg = DOPT_SIM_CONFIG_INIT;
    cfg.nranks = n;
    dopt_status s[MAX_RANKS];
    st_run(&cfg, p2p_body, &p, s, NULL, NULL);
    for (int r = 0; r < n; r++) {
      assert_int_equal(s[r], DOPT_OK);
      int from = (r + n - 1) % n;
      for (int e = 0; e < 5; e++) {
        assert_int_equal(p.got[r][0][e], from * 10 + e);
        assert_int_equal(p.got[r][1][e], -(from * 10 + e));
      }
    }
  }
}

/* ---- all_to_allv ---------------------------------------------------------------------
 * Irregular counts (some zero, self included), regions with gaps in both
 * buffers; every rank's received bytes against the expected ones, the gaps
 * untouched; the accounting counts the busiest sender's off-rank bytes; a
 * count that does not match its peer's fails every rank with the pair named;
 * a bit-flip fault lands in the received data; a stopped rank fails its peers
 * instead of hanging. By reference (dopt_sim_all_to_allv_view): the views are
 * the senders' regions (the same values, NULL for empty ones), accounted as
 * the copy; a rank copying against ranks viewing is a mismatch on every rank;
 * refused in worlds with a fault plan or copy_exchanges, and then not offered
 * by dopt_sim_transport. */
enum { AV_GAP = 2, AV_CAP = 256 };

static size_t av_count(int i, int j, int mismatch) {
  size_t c = (size_t)((i * 3 + j * 5) % 4) * (size_t)(1 + (i + j) % 3);
  return mismatch && i == 0 && j == 1 ? c + 1 : c; /* rank 1 expects one more than rank 0 sends */
}

static float av_value(int from, int to, size_t e) { return (float)(from * 1000 + to * 100) + (float)e; }

typedef struct av_res {
  int mismatch;
  int view; /* 1: every rank by reference; 2: rank 1 by reference, the others copy */
  float got[MAX_RANKS][AV_CAP];
  char msg[MAX_RANKS][256];
} av_res;

static void av_layout(int n, int me, int recv_side, int mismatch, size_t *counts, size_t *displs) {
  size_t off = 1; /* a gap before the first region too */
  for (int j = 0; j < n; j++) {
    counts[j] = recv_side ? av_count(j, me, mismatch) : av_count(me, j, 0);
    displs[j] = off;
    off += counts[j] + AV_GAP;
  }
}

static dopt_status av_body(dopt_sim_comm *c, int rank, void *user) {
  av_res *res = user;
  int n;
  DOPT_TRY(dopt_sim_comm_size(c, &n));
  size_t sc[MAX_RANKS], sd[MAX_RANKS], rc[MAX_RANKS], rd[MAX_RANKS];
  av_layout(n, rank, 0, 0, sc, sd);
  av_layout(n, rank, 1, res->mismatch, rc, rd);
  float send[AV_CAP];
  for (int e = 0; e < AV_CAP; e++) send[e] = -1.0f;
  for (int j = 0; j < n; j++)
    for (size_t e = 0; e < sc[j]; e++) send[sd[j] + e] = av_value(rank, j, e);
  for (int e = 0; e < AV_CAP; e++) res->got[rank][e] = -7.0f;
  dopt_status s;
  if (res->view == 1 || (res->view == 2 && rank == 1)) {
    const void *views[MAX_RANKS];
    for (int j = 0; j < n; j++) views[j] = &views; /* must be overwritten */
    s = dopt_sim_all_to_allv_view(send, sc, sd, views, rc, DOPT_F32, c);
    for (int j = 0; j < n && s == DOPT_OK; j++) {
      if ((rc[j] == 0) != (views[j] == NULL) || (j == rank && rc[j] && views[j] != send + sd[j])) {
        snprintf(res->msg[rank], sizeof res->msg[rank], "view %d of %zu elements at %p", j, rc[j], views[j]);
        s = DOPT_ERR_STATE;
      } else if (rc[j]) {
        memcpy(res->got[rank] + rd[j], views[j], rc[j] * sizeof(float));
      }
    }
    if (s == DOPT_OK) s = dopt_sim_barrier(c); /* the release: send stays alive until every rank has read it */
  } else {
    s = dopt_sim_all_to_allv(send, sc, sd, res->got[rank], rc, rd, DOPT_F32, c);
  }
  if (s != DOPT_OK && !res->msg[rank][0]) snprintf(res->msg[rank], sizeof res->msg[rank], "%s", dopt_last_error());
  return s;
}

static void test_all_to_allv(void **st) {
  (void)st;
  for (int n = 1, view = 0; n <= MAX_RANKS; n += view, view = !view) {
    av_res *res = calloc(1, sizeof *res);
    assert_non_null(res);
    res->view = view;
    dopt_sim_config cfg = DOPT_SIM_CONFIG_INIT;
    cfg.nranks = n;
    dopt_status s[MAX_RANKS];
    dopt_sim_world *w;
    st_run(&cfg, av_body, res, s, NULL, &w);
    size_t most = 0;
    for (int r = 0; r < n; r++) {
      if (s[r] != DOPT_OK) fail_msg("all_to_allv n=%d view=%d rank %d: %s", n, view, r, res->msg[r]);
      size_t rc[MAX_RANKS], rd[MAX_RANKS], sent = 0;
      av_layout(n, r, 1, 0, rc, rd);
      float want[AV_CAP];
      for (int e = 0; e < AV_CAP; e++) want[e] = -7.0f;
      for (int j = 0; j < n; j++) {
        for (size_t e = 0; e < rc[j]; e++) want[rd[j] + e] = av_value(j, r, e);
        sent += j != r ? av_count(r, j, 0) : 0;
      }
      if (memcmp(want, res->got[r], sizeof want) != 0) fail_msg("all_to_allv n=%d view=%d: rank %d differs", n, view, r);
      most = sent > most ? sent : most;
    }
    dopt_sim_comm *c0;
    dopt_sim_stats stats = DOPT_SIM_STATS_INIT;
    assert_ok(dopt_sim_world_comm(w, 0, &c0));
    assert_ok(dopt_sim_comm_stats(c0, &stats));
    assert_int_equal(stats.ops[DOPT_SIM_KIND_ALL_TO_ALLV], 1);
    assert_int_equal(stats.bytes[DOPT_SIM_KIND_ALL_TO_ALLV], most * sizeof(float));
    assert_int_equal(stats.ops[DOPT_SIM_KIND_BARRIER], view); /* the release */
    assert_true(dopt_sim_busbw_factor(DOPT_SIM_KIND_ALL_TO_ALLV, n) == 1.0);
    dopt_sim_world_destroy(w);
    free(res);
  }
}

/* Counts that do not match their peer's; a rank copying (by reference: res->view 2) against ranks viewing. */
static void test_all_to_allv_mismatch(void **st) {
  (void)st;
  for (int kind = 0; kind < 2; kind++) {
    av_res *res = calloc(1, sizeof *res);
    assert_non_null(res);
    res->mismatch = kind == 0;
    res->view = kind == 1 ? 2 : 0;
    dopt_sim_config cfg = DOPT_SIM_CONFIG_INIT;
    cfg.nranks = 3;
    dopt_status s[MAX_RANKS];
    st_run(&cfg, av_body, res, s, NULL, NULL);
    char want[128];
    if (kind == 0)
      snprintf(want, sizeof want, "rank 0 sends %zu elements to rank 1, which expects %zu", av_count(0, 1, 0),
               av_count(0, 1, 1));
    else
      snprintf(want, sizeof want, "all_to_allv(copied,F32) vs rank 1 all_to_allv(by reference,F32)");
    for (int r = 0; r < 3; r++) {
      assert_int_equal(s[r], DOPT_ERR_MISMATCH);
      if (!strstr(res->msg[r], want)) fail_msg("rank %d: '%s' lacks '%s'", r, res->msg[r], want);
    }
    free(res);
  }
}

static void test_all_to_allv_faults(void **st) {
  (void)st;
  /* bit 3 of received element 2 on rank 1 (its first region from rank 0 starts at element 1) */
  dopt_sim_fault flip = {DOPT_SIM_FAULT_BITFLIP, 1, 0, 0, 2, 3};
  av_res *res = calloc(1, sizeof *res);
  assert_non_null(res);
  dopt_sim_config cfg = DOPT_SIM_CONFIG_INIT;
  cfg.nranks = 4;
  cfg.faults = &flip;
  cfg.nfaults = 1;
  dopt_status s[MAX_RANKS];
  st_run(&cfg, av_body, res, s, NULL, NULL);
  size_t rc[MAX_RANKS], rd[MAX_RANKS];
  av_layout(4, 1, 1, 0, rc, rd);
  assert_true(rc[0] >= 2 && rd[0] == 1); /* element 2 is rank 0's second value */
  uint32_t a, b;
  float want = av_value(0, 1, 1);
  memcpy(&a, &res->got[1][2], 4);
  memcpy(&b, &want, 4);
  for (int r = 0; r < 4; r++) assert_int_equal(s[r], DOPT_OK);
  assert_int_equal(a ^ b, 1u << 3);
  free(res);
  /* a rank stopped at its first call: the peers fail fast instead of waiting out the timeout */
  dopt_sim_fault stop = {DOPT_SIM_FAULT_STOP, 2, 0, 0, 0, 0};
  res = calloc(1, sizeof *res);
  assert_non_null(res);
  cfg.faults = &stop;
  cfg.timeout_ms = 60000;
  double t = 0;
  st_run(&cfg, av_body, res, s, &t, NULL);
  for (int r = 0; r < 4; r++) assert_int_not_equal(s[r], DOPT_OK);
  assert_true(t < 30.0);
  free(res);
}

/* By reference: worlds that refuse it (fault plan, copy_exchanges), where dopt_sim_transport does not offer it,
 * while a plain world's transport does. */
static void test_all_to_allv_view_rules(void **st) {
  (void)st;
  av_res *res = calloc(1, sizeof *res);
  assert_non_null(res);
  dopt_sim_config cfg;
  dopt_status s[MAX_RANKS];
  dopt_sim_fault flip = {DOPT_SIM_FAULT_BITFLIP, 1, 0, 0, 2, 3};
  for (int k = 0; k < 3; k++) { /* a fault plan, copy_exchanges: refused on every rank; then a plain world */
    memset(res, 0, sizeof *res);
    res->view = 1;
    cfg = (dopt_sim_config)DOPT_SIM_CONFIG_INIT;
    cfg.nranks = 3;
    cfg.faults = k == 0 ? &flip : NULL;
    cfg.nfaults = k == 0;
    cfg.copy_exchanges = k == 1;
    dopt_sim_world *w;
    st_run(&cfg, av_body, res, s, NULL, &w);
    for (int r = 0; r < 3; r++) {
      assert_int_equal(s[r], k < 2 ? DOPT_ERR_UNSUPPORTED : DOPT_OK);
      if (k < 2 && !strstr(res->msg[r], "copy_exchanges")) fail_msg("world %d rank %d: '%s'", k, r, res->msg[r]);
    }
    dopt_sim_comm *c0;
    dopt_transport t;
    assert_ok(dopt_sim_world_comm(w, 0, &c0));
    assert_ok(dopt_sim_transport(c0, &t));
    assert_true((t.ops->all_to_allv_view != NULL) == (k == 2));
    assert_true((t.ops->view_release != NULL) == (k == 2));
    assert_non_null(t.ops->all_to_allv);
    dopt_sim_world_destroy(w);
  }
  free(res);
}

/* nb all_to_allv by reference in one call (dopt_sim_all_to_allv_view_n): exchange b from its own send buffer,
 * views[b·n + j] rank j's exchange-b region for this rank (the values, NULL for empty ones, its own inside its
 * own send b); one op accounted as the busiest sender's off-rank elements over all exchanges; a count that does
 * not match its peer's in one exchange, or another nb on one rank, fails every rank; refused with
 * copy_exchanges, whose transport does not offer it. */
enum { AVN_NB = 3 };

static size_t avn_count(int i, int j, int b) { return (size_t)((i * 3 + j * 5 + b * 7) % 4) * (size_t)(1 + (i + j + b) % 3); }

/* The *_view_n tests' shared result: bad, the case a body plants (0: none); each rank's message. */
typedef struct vn_res {
  int bad;
  char msg[MAX_RANKS][256];
} vn_res;

/* One *_view_n world of n ranks (copy_exchanges: copy) running body with res->bad = bad; s: each rank's status. */
static dopt_sim_world *vn_run(dopt_sim_rank_fn body, vn_res *res, int n, int bad,
                              int copy, dopt_status *s) {
  memset(res, 0, sizeof *res);
  res->bad = bad;
  dopt_sim_config cfg = DOPT_SIM_CONFIG_INIT;
  cfg.nranks = n;
  cfg.copy_exchanges = copy;
  dopt_sim_world *w;
  st_run(&cfg, body, res, s, NULL, &w);
  return w;
}

/* Rank 0's transport ops and its counts of kind (ops, bytes) in world w. */
static const dopt_transport_ops *vn_ops(dopt_sim_world *w, dopt_sim_kind kind, uint64_t *ops, uint64_t *bytes) {
  dopt_sim_comm *c0;
  dopt_sim_stats stats = DOPT_SIM_STATS_INIT;
  dopt_transport t;
  assert_ok(dopt_sim_world_comm(w, 0, &c0));
  assert_ok(dopt_sim_comm_stats(c0, &stats));
  assert_ok(dopt_sim_transport(c0, &t));
  *ops = stats.ops[kind], *bytes = stats.bytes[kind];
  return t.ops;
}

static dopt_status avn_body(dopt_sim_comm *c, int rank, void *user) {
  vn_res *res = user; /* bad 1: rank 1 expects one more element from rank 0 in exchange 1; 2: rank 2 passes nb - 1 */
  int n;
  DOPT_TRY(dopt_sim_comm_size(c, &n));
  const size_t N = (size_t)n;
  size_t sc[AVN_NB * MAX_RANKS], sd[AVN_NB * MAX_RANKS], rc[AVN_NB * MAX_RANKS];
  float send[AVN_NB][AV_CAP];
  const void *sends[AVN_NB], *views[AVN_NB * MAX_RANKS];
  for (int b = 0; b < AVN_NB; b++) {
    size_t off = 1 + (size_t)b; /* gaps, and another first offset per exchange */
    for (int e = 0; e < AV_CAP; e++) send[b][e] = -1.0f;
    for (int j = 0; j < n; j++) {
      const size_t at = (size_t)b * N + (size_t)j;
      sc[at] = avn_count(rank, j, b), sd[at] = off;
      rc[at] = avn_count(j, rank, b) + (res->bad == 1 && b == 1 && rank == 1 && j == 0);
      for (size_t e = 0; e < sc[at]; e++) send[b][off + e] = av_value(rank, j, e) + 10000.0f * (float)b;
      off += sc[at] + AV_GAP;
      views[at] = &views; /* must be overwritten */
    }
    sends[b] = send[b];
  }
  const int nb = res->bad == 2 && rank == 2 ? AVN_NB - 1 : AVN_NB;
  dopt_status s = dopt_sim_all_to_allv_view_n(nb, sends, sc, sd, views, rc, DOPT_F32, c);
  for (int b = 0; b < AVN_NB && s == DOPT_OK; b++)
    for (int j = 0; j < n && s == DOPT_OK; j++) {
      const size_t at = (size_t)b * N + (size_t)j;
      const float *v = views[at];
      if ((rc[at] == 0) != (v == NULL) || (j == rank && rc[at] && v != send[b] + sd[at])) s = DOPT_ERR_STATE;
      for (size_t e = 0; e < rc[at] && s == DOPT_OK; e++)
        if (v[e] != av_value(j, rank, e) + 10000.0f * (float)b) s = DOPT_ERR_STATE;
      if (s != DOPT_OK) snprintf(res->msg[rank], sizeof res->msg[rank], "exchange %d from rank %d: wrong view", b, j);
    }
  if (s == DOPT_OK) s = dopt_sim_barrier(c);
  if (s != DOPT_OK && !res->msg[rank][0]) snprintf(res->msg[rank], sizeof res->msg[rank], "%s", dopt_last_error());
  return s;
}

static void test_all_to_allv_view_n(void **st) {
  (void)st;
  vn_res *res = calloc(1, sizeof *res);
  assert_non_null(res);
  dopt_status s[MAX_RANKS];
  uint64_t ops, bytes;
  for (int n = 1; n <= MAX_RANKS; n++) {
    dopt_sim_world *w = vn_run(avn_body, res, n, 0, 0, s);
    size_t most = 0;
    for (int r = 0; r < n; r++) {
      if (s[r] != DOPT_OK) fail_msg("all_to_allv_view_n n=%d rank %d: %s", n, r, res->msg[r]);
      size_t sent = 0;
      for (int b = 0; b < AVN_NB; b++)
        for (int j = 0; j < n; j++) sent += j != r ? avn_count(r, j, b) : 0;
      most = sent > most ? sent : most;
    }
    assert_non_null(vn_ops(w, DOPT_SIM_KIND_ALL_TO_ALLV, &ops, &bytes)->all_to_allv_view_n);
    assert_int_equal(ops, 1);
    assert_int_equal(bytes, most * sizeof(float));
    dopt_sim_world_destroy(w);
  }
  for (int bad = 1; bad <= 3; bad++) { /* a count in exchange 1, another nb, a copy_exchanges world */
    dopt_sim_world *w = vn_run(avn_body, res, 3, bad < 3 ? bad : 0, bad == 3, s);
    const char *want = bad == 1 ? "rank 0 sends" : bad == 2 ? "all_to_allv" : "copy_exchanges";
    for (int r = 0; r < 3; r++) {
      assert_int_equal(s[r], bad == 3 ? DOPT_ERR_UNSUPPORTED : DOPT_ERR_MISMATCH);
      if (!strstr(res->msg[r], want) || (bad == 1 && !strstr(res->msg[r], "in one of its exchanges")))
        fail_msg("case %d rank %d: '%s' lacks '%s'", bad, r, res->msg[r], want);
    }
    if (bad == 3) assert_null(vn_ops(w, DOPT_SIM_KIND_ALL_TO_ALLV, &ops, &bytes)->all_to_allv_view_n);
    dopt_sim_world_destroy(w);
  }
  free(res);
}

/* all_gather by reference (dopt_sim_all_gather_view): views[j] holds rank j's values (its own: its send), NULL
 * for an empty send; accounted as the copying all_gather (one op, count · size · n bytes), with the release
 * counted as a barrier; a rank copying against ranks viewing is a mismatch on every rank; refused under
 * copy_exchanges, where dopt_sim_transport does not offer it. */
enum { AGV_N = 5 };
typedef struct agv_res {
  int mode;    /* 0 every rank by reference, 1 rank 1 copies, 2 empty sends */
  float got[MAX_RANKS][MAX_RANKS * AGV_N];
  char msg[MAX_RANKS][256];
} agv_res;

static dopt_status agv_body(dopt_sim_comm *c, int rank, void *user) {
  agv_res *res = user;
  int n;
  DOPT_TRY(dopt_sim_comm_size(c, &n));
  const size_t cnt = res->mode == 2 ? 0 : AGV_N;
  float send[AGV_N];
  for (int e = 0; e < AGV_N; e++) send[e] = (float)(rank * 100 + e);
  dopt_status s;
  if (res->mode == 1 && rank == 1) {
    s = dopt_sim_all_gather(send, res->got[rank], cnt, DOPT_F32, c);
  } else {
    const void *views[MAX_RANKS];
    for (int j = 0; j < n; j++) views[j] = &views; /* must be overwritten */
    s = dopt_sim_all_gather_view(send, views, cnt, DOPT_F32, c);
    for (int j = 0; j < n && s == DOPT_OK; j++) {
      if ((cnt == 0) != (views[j] == NULL) || (j == rank && cnt && views[j] != send)) {
        snprintf(res->msg[rank], sizeof res->msg[rank], "view %d at %p", j, views[j]);
        s = DOPT_ERR_STATE;
      } else if (cnt) {
        memcpy(res->got[rank] + (size_t)j * cnt, views[j], cnt * sizeof(float));
      }
    }
    if (s == DOPT_OK) s = dopt_sim_barrier(c); /* the release */
  }
  if (s != DOPT_OK && !res->msg[rank][0]) snprintf(res->msg[rank], sizeof res->msg[rank], "%s", dopt_last_error());
  return s;
}

/* nb all_gather by reference in one call (dopt_sim_all_gather_view_n): views[b·n + j] is rank j's sends[b] (its
 * own: its own buffer; NULL for an empty gather); one op accounted as an all_gather of all the elements; another
 * count on one rank fails every rank; refused with copy_exchanges, whose transport does not offer it. */
enum { AGN_NB = 3 };
static const size_t AGN_COUNT[AGN_NB] = {2, 0, 5};


static dopt_status agn_body(dopt_sim_comm *c, int rank, void *user) {
  vn_res *res = user; /* bad: rank 2 gathers one element fewer in gather 2 */
  int n;
  DOPT_TRY(dopt_sim_comm_size(c, &n));
  float send[AGN_NB][8];
  size_t cnt[AGN_NB];
  const void *sends[AGN_NB], *views[AGN_NB * MAX_RANKS];
  for (int b = 0; b < AGN_NB; b++) {
    cnt[b] = AGN_COUNT[b] - (res->bad && rank == 2 && b == 2);
    for (int e = 0; e < 8; e++) send[b][e] = (float)(rank * 100 + b * 10 + e);
    sends[b] = send[b];
  }
  for (int k = 0; k < AGN_NB * n; k++) views[k] = &views; /* must be overwritten */
  dopt_status s = dopt_sim_all_gather_view_n(AGN_NB, sends, cnt, views, DOPT_F32, c);
  for (int b = 0; b < AGN_NB && s == DOPT_OK; b++)
    for (int j = 0; j < n && s == DOPT_OK; j++) {
      const float *v = views[b * n + j];
      if ((cnt[b] == 0) != (v == NULL) || (j == rank && v && v != send[b])) s = DOPT_ERR_STATE;
      for (size_t e = 0; v && e < cnt[b] && s == DOPT_OK; e++)
        if (v[e] != (float)(j * 100 + b * 10 + (int)e)) s = DOPT_ERR_STATE;
      if (s != DOPT_OK) snprintf(res->msg[rank], sizeof res->msg[rank], "gather %d, rank %d: wrong view", b, j);
    }
  if (s == DOPT_OK) s = dopt_sim_barrier(c);
  if (s != DOPT_OK && !res->msg[rank][0]) snprintf(res->msg[rank], sizeof res->msg[rank], "%s", dopt_last_error());
  return s;
}

static void test_all_gather_view_n(void **st) {
  (void)st;
  vn_res *res = calloc(1, sizeof *res);
  assert_non_null(res);
  dopt_status s[MAX_RANKS];
  uint64_t ops, bytes;
  for (int n = 1; n <= MAX_RANKS; n++) {
    dopt_sim_world *w = vn_run(agn_body, res, n, 0, 0, s);
    for (int r = 0; r < n; r++)
      if (s[r] != DOPT_OK) fail_msg("all_gather_view_n n=%d rank %d: %s", n, r, res->msg[r]);
    assert_non_null(vn_ops(w, DOPT_SIM_KIND_ALL_GATHER, &ops, &bytes)->all_gather_view_n);
    assert_int_equal(ops, 1);
    assert_int_equal(bytes, 7 * sizeof(float) * (size_t)n);
    dopt_sim_world_destroy(w);
  }
  for (int k = 0; k < 2; k++) { /* another count on rank 2; a copy_exchanges world */
    dopt_sim_world *w = vn_run(agn_body, res, 3, k == 0, k == 1, s);
    for (int r = 0; r < 3; r++) {
      assert_int_equal(s[r], k == 0 ? DOPT_ERR_MISMATCH : DOPT_ERR_UNSUPPORTED);
      if (!strstr(res->msg[r], k == 0 ? "all_gather" : "copy_exchanges")) fail_msg("case %d rank %d: '%s'", k, r, res->msg[r]);
    }
    if (k == 1) assert_null(vn_ops(w, DOPT_SIM_KIND_ALL_GATHER, &ops, &bytes)->all_gather_view_n);
    dopt_sim_world_destroy(w);
  }
  free(res);
}

static void test_all_gather_view(void **st) {
  (void)st;
  agv_res *res = calloc(1, sizeof *res);
  assert_non_null(res);
  dopt_status s[MAX_RANKS];
  for (int n = 1; n <= MAX_RANKS; n++)
    for (int mode = 0; mode <= 2; mode += 2) {
      memset(res, 0, sizeof *res);
      res->mode = mode;
      dopt_sim_config cfg = DOPT_SIM_CONFIG_INIT;
      cfg.nranks = n;
      dopt_sim_world *w;
      st_run(&cfg, agv_body, res, s, NULL, &w);
      for (int r = 0; r < n; r++) {
        if (s[r] != DOPT_OK) fail_msg("all_gather_view n=%d mode %d rank %d: %s", n, mode, r, res->msg[r]);
        for (int j = 0; j < n && mode == 0; j++)
          for (int e = 0; e < AGV_N; e++)
            if (res->got[r][j * AGV_N + e] != (float)(j * 100 + e)) fail_msg("n=%d rank %d: view %d element %d", n, r, j, e);
      }
      dopt_sim_comm *c0;
      dopt_sim_stats stats = DOPT_SIM_STATS_INIT;
      assert_ok(dopt_sim_world_comm(w, 0, &c0));
      assert_ok(dopt_sim_comm_stats(c0, &stats));
      assert_int_equal(stats.ops[DOPT_SIM_KIND_ALL_GATHER], 1);
      assert_int_equal(stats.bytes[DOPT_SIM_KIND_ALL_GATHER], (mode == 0 ? AGV_N : 0) * sizeof(float) * (size_t)n);
      assert_int_equal(stats.ops[DOPT_SIM_KIND_BARRIER], 1);
      {
        dopt_transport t;
        assert_ok(dopt_sim_transport(c0, &t));
        assert_non_null(t.ops->all_gather_view);
      }
      dopt_sim_world_destroy(w);
    }
  /* rank 1 copies against viewing ranks: a mismatch everywhere */
  memset(res, 0, sizeof *res);
  res->mode = 1;
  dopt_sim_config cfg = DOPT_SIM_CONFIG_INIT;
  cfg.nranks = 3;
  st_run(&cfg, agv_body, res, s, NULL, NULL);
  for (int r = 0; r < 3; r++) {
    assert_int_equal(s[r], DOPT_ERR_MISMATCH);
    if (!strstr(res->msg[r], "all_gather(count=5,F32,by reference) vs rank 1 all_gather(count=5,F32)")) fail_msg("rank %d: '%s'", r, res->msg[r]);
  }
  /* copy_exchanges: refused on every rank, and not offered by the transport */
  memset(res, 0, sizeof *res);
  cfg.copy_exchanges = 1;
  dopt_sim_world *w;
  st_run(&cfg, agv_body, res, s, NULL, &w);
  for (int r = 0; r < 3; r++) {
    assert_int_equal(s[r], DOPT_ERR_UNSUPPORTED);
    if (!strstr(res->msg[r], "copy_exchanges")) fail_msg("rank %d: '%s'", r, res->msg[r]);
  }
  dopt_sim_comm *c0;
  dopt_transport t;
  assert_ok(dopt_sim_world_comm(w, 0, &c0));
  assert_ok(dopt_sim_transport(c0, &t));
  assert_null(t.ops->all_gather_view);
  dopt_sim_world_destroy(w);
  free(res);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_all_gather_view),
      cmocka_unit_test(test_all_to_allv), cmocka_unit_test(test_all_to_allv_mismatch),
      cmocka_unit_test(test_all_to_allv_faults), cmocka_unit_test(test_all_to_allv_view_rules),
      cmocka_unit_test(test_all_to_allv_view_n),
      cmocka_unit_test(test_all_gather_view_n),
      cmocka_unit_test(test_collectives_n1), cmocka_unit_test(test_collectives_n2),
      cmocka_unit_test(test_collectives_n3), cmocka_unit_test(test_collectives_n4),
      cmocka_unit_test(test_collectives_n5), cmocka_unit_test(test_collectives_n8),
      cmocka_unit_test(test_grids),          cmocka_unit_test(test_split_order),
      cmocka_unit_test(test_send_recv),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
