/* dopt_dist_bench: the distributed step on the collective simulator against
 * the single-device reference, and its projected cost on a described cluster
 * (docs/distributed.md, "Measured"). Prints tables; not a test.
 *
 *   dopt_dist_bench [--optimizer NAME|all] [--size N] [--steps K] [--warmup W]
 *                   [--zero Z] [--clip X] [--dp-sum exact|rank-order]
 *                   [--exchanges in-place|copied]
 *
 * Parameter set: one N×N weight (TP role COLUMN: rows split over tp) and one
 * N-element bias (REPLICATED); N = 4096 by default. Per optimizer:
 *  (a) reference: CPU time of one dopt_optim_step (one thread), and with
 *      it the CPU time of dopt_dp_sum of the dp rank partials of both
 *      gradients in the same dp-sum mode (what the distributed step sums;
 *      measured once, it does not depend on the optimizer);
 *  (b) distributed, tp=2 × dp=2 × zero=2 on 4 simulator rank threads: process
 *      CPU time (all ranks together) and wall time of dopt_dist_step alone
 *      (gradients are fed with dopt_dist_backward before each step, outside
 *      the timed window, which is delimited by simulator barriers), bytes and
 *      collectives per step of each rank (sim accounting of its tp and dp
 *      communicators: the collectives it took part in), their mean and
 *      maximum over the ranks (owner mode loads the owners more);
 *  (c) the collectives one rank issues per step (the simulator's operation
 *      log) projected with the α–β model (dopt_sim_project) onto three
 *      cluster descriptions (see `clusters` below).
 * Medians over K timed steps after W warm-up steps. Rank bodies return
 * statuses; nothing asserts on a rank thread. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "distopt/dist.h"
#include "distopt/dpsum.h"
#include "distopt/optim.h"
#include "distopt/sim.h"

#define TP 2
#define DP 2
#define NRANKS (TP * DP)
#define MAXSTEPS 101

#define BTRY(expr)                 \
  do {                             \
    dopt_status bt_s_ = (expr);    \
    if (bt_s_ != DOPT_OK)          \
      return bt_s_;                \
  } while (0)

typedef struct opt_case {
  const char *name, *hparams;
} opt_case;

static const opt_case CASES[] = {
    {"adamw", NULL},
    {"adafactor", NULL},
    {"came", "lr=2e-4"},
    {"lamb", NULL},
    {"adamw8bit", NULL},
    /* owner mode: each whole parameter stepped on one rank */
    {"galore_adamw", "rank=128"},
    {"galore_adamw8bit", "rank=128"},
    {"q_galore", "rank=128"},
    {"muon", "lr=2e-2"},
    {"lisa", "inner=adamw"},
};
#define NCASES ((int)(sizeof CASES / sizeof CASES[0]))

typedef struct opts {
  const char *only; /* NULL: all */
  size_t n;
  int steps, warmup, zero;
  double clip;
  int dp_words; /* the dp sum: DOPT_DP_SUM_DEFAULT_WORDS (exact) or 0 (fp32 in rank order) */
  int copy;     /* the simulator copies every exchange (dopt_sim_config.copy_exchanges) */
} opts;

/* ---- timing helpers ------------------------------------------------------------------- */

static double clock_s(clockid_t id) {
  struct timespec t;
  clock_gettime(id, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static double median(const double *v, int n) {
  double tmp[MAXSTEPS];
  memcpy(tmp, v, (size_t)n * sizeof *tmp);
  qsort(tmp, (size_t)n, sizeof *tmp, cmp_double);
  return n % 2 ? tmp[n / 2] : 0.5 * (tmp[n / 2 - 1] + tmp[n / 2]);
}

/* ---- data ------------------------------------------------------------------------------ */

static uint64_t mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/* uniform in [-scale, scale) */
static void fill(float *x, size_t n, uint64_t seed, double scale) {
  for (size_t i = 0; i < n; i++)
    x[i] = (float)(((double)(mix(seed + 0x9E3779B97F4A7C15ull * (i + 1)) >> 11) * 0x1.0p-53 - 0.5) * 2.0 * scale);
}

/* An optimizer over {weight [n, n], bias [n]} whose parameters are copies of w0/b0. */
static dopt_status build(const opt_case *oc, size_t n, const float *w0, const float *b0, float **w, float **b,
                         dopt_optim **out) {
  *out = NULL;
  *w = malloc(n * n * sizeof(float));
  *b = malloc(n * sizeof(float));
  if (!*w || !*b) return DOPT_ERR_NO_MEMORY;
  memcpy(*w, w0, n * n * sizeof(float));
  memcpy(*b, b0, n * sizeof(float));
  dopt_optim *o;
  BTRY(dopt_optim_create(oc->name, oc->hparams, &o));
  dopt_param_config pc = DOPT_PARAM_CONFIG_INIT;
  pc.name = "weight";
  pc.ndim = 2;
  pc.shape[0] = pc.shape[1] = (int64_t)n;
  pc.data = *w;
  dopt_status s = dopt_optim_add_param(o, 0, &pc, NULL);
  pc.name = "bias";
  pc.ndim = 1;
  pc.data = *b;
  if (s == DOPT_OK) s = dopt_optim_add_param(o, 0, &pc, NULL);
  if (s != DOPT_OK) {
    dopt_optim_destroy(o);
    return s;
  }
  *out = o;
  return DOPT_OK;
}

/* ---- the distributed run ----------------------------------------------------------------- */

typedef struct dist_ctx {
  const opts *op;
  const dopt_optim *plain; /* shared, read only (dopt_dist_create only reads it) */
  const float *gw, *gb;    /* the logical gradients (every dp rank gets the same) */
  /* written by world rank 0 only */
  double proc_cpu[MAXSTEPS], wall[MAXSTEPS];
  dopt_dist_memory mem;
  /* written by each rank into its own row */
  dopt_sim_stats before[NRANKS][2], after[NRANKS][2]; /* its tp, dp communicators */
  /* written by each rank into its own row */
  double thread_cpu[NRANKS][MAXSTEPS];
} dist_ctx;

static dopt_status dist_body(dopt_sim_comm *world, int rank, void *user) {
  dist_ctx *x = user;
  const opts *op = x->op;
  dopt_sim_comm *tpc = NULL, *dpc = NULL;
  /* Megatron layout: TP groups are contiguous ranks, DP groups stride by tp */
  BTRY(dopt_sim_comm_split_labeled(world, rank / TP, rank, "tp", &tpc));
  BTRY(dopt_sim_comm_split_labeled(world, rank % TP, rank, "dp", &dpc));
  dopt_dist_config cfg = DOPT_DIST_CONFIG_INIT;
  cfg.plugin = op->zero == 3 ? "fsdp" : "hybrid";
  cfg.zero_stage = op->zero;
  cfg.max_grad_norm = op->clip;
  cfg.dp_sum_words = op->dp_words;
  BTRY(dopt_sim_transport(tpc, &cfg.tp));
  BTRY(dopt_sim_transport(dpc, &cfg.dp));
  const dopt_tp_role roles[2] = {DOPT_TP_COLUMN, DOPT_TP_REPLICATED};
  dopt_dist_optim *d = NULL;
  BTRY(dopt_dist_create(x->plain, &cfg, roles, &d));
  /* this rank's TP block of the weight gradient: rows [h0, h0 + hl) (uneven
   * split: base + (r < rem) rows), contiguous in the row-major logical tensor */
  const size_t n = op->n, base = n / TP, rem = n % TP, r = (size_t)cfg.tp.rank;
  const size_t h0 = r * base + (r < rem ? r : rem);
  int ndim;
  int64_t shape[DOPT_MAX_DIMS];
  size_t lnumel;
  dopt_status s = dopt_dist_local_shape(d, 0, &ndim, shape, &lnumel);
  if (s == DOPT_OK && (ndim != 2 || (size_t)shape[0] != base + (r < rem) || (size_t)shape[1] != n)) {
    fprintf(stderr, "rank %d: unexpected local shape [%lld, %lld]\n", rank, (long long)shape[0], (long long)shape[1]);
    s = DOPT_ERR_SHAPE;
  }
  const float *grads[2] = {x->gw + h0 * n, x->gb};
  const int total = op->warmup + op->steps;
  for (int it = 0; it < total && s == DOPT_OK; it++) {
    s = dopt_dist_backward(d, grads);
    if (s == DOPT_OK) s = dopt_sim_barrier(world); /* everyone has its gradients */
    if (s != DOPT_OK) break;
    if (it == op->warmup) {
      x->before[rank][0] = (dopt_sim_stats)DOPT_SIM_STATS_INIT;
      x->before[rank][1] = (dopt_sim_stats)DOPT_SIM_STATS_INIT;
      s = dopt_sim_comm_stats(tpc, &x->before[rank][0]);
      if (s == DOPT_OK) s = dopt_sim_comm_stats(dpc, &x->before[rank][1]);
    }
    double p0 = clock_s(CLOCK_PROCESS_CPUTIME_ID), w0 = clock_s(CLOCK_MONOTONIC);
    double t0 = clock_s(CLOCK_THREAD_CPUTIME_ID);
    dopt_dist_step_info info;
    if (s == DOPT_OK) s = dopt_dist_step(d, &info);
    double t1 = clock_s(CLOCK_THREAD_CPUTIME_ID);
    if (s == DOPT_OK) s = dopt_sim_barrier(world); /* everyone has finished its step */
    double p1 = clock_s(CLOCK_PROCESS_CPUTIME_ID), w1 = clock_s(CLOCK_MONOTONIC);
    if (s == DOPT_OK && info.skipped) {
      fprintf(stderr, "rank %d: step %d skipped (non-finite gradient)\n", rank, it);
      s = DOPT_ERR_NUMERIC;
    }
    if (it >= op->warmup) {
      x->thread_cpu[rank][it - op->warmup] = t1 - t0;
      if (rank == 0) {
        x->proc_cpu[it - op->warmup] = p1 - p0;
        x->wall[it - op->warmup] = w1 - w0;
      }
    }
  }
  if (s == DOPT_OK) {
    x->after[rank][0] = (dopt_sim_stats)DOPT_SIM_STATS_INIT;
    x->after[rank][1] = (dopt_sim_stats)DOPT_SIM_STATS_INIT;
    s = dopt_sim_comm_stats(tpc, &x->after[rank][0]);
    if (s == DOPT_OK) s = dopt_sim_comm_stats(dpc, &x->after[rank][1]);
  }
  if (s == DOPT_OK && rank == 0) s = dopt_dist_memory_usage(d, &x->mem);
  dopt_dist_destroy(d);
  return s;
}

/* ---- cluster descriptions for the projection ------------------------------------------------ */

#define NVLINK_BPS 450e9
#define NVLINK_LAT 2e-6
#define IB_BPS 50e9
#define IB_LAT 5e-6

typedef struct cluster_desc {
  const char *name;
  dopt_sim_link links[2];
} cluster_desc;

static const cluster_desc CLUSTERS[] = {
    {"1 node x 4 GPU: tp2, dp2 on NVLink", {{"tp", 0, NVLINK_BPS, NVLINK_LAT}, {"dp", 0, NVLINK_BPS, NVLINK_LAT}}},
    {"2 nodes x 2 GPU: tp2 NVLink, dp2 IB", {{"tp", 0, NVLINK_BPS, NVLINK_LAT}, {"dp", 0, IB_BPS, IB_LAT}}},
    {"64 GPU: tp8 NVLink x dp8 IB (*)", {{"tp", 8, NVLINK_BPS, NVLINK_LAT}, {"dp", 8, IB_BPS, IB_LAT}}},
};
#define NCLUSTERS ((int)(sizeof CLUSTERS / sizeof CLUSTERS[0]))

/* ---- the reference's dp sum ------------------------------------------------------------ */

/* CPU time of dopt_dp_sum over the DP rank partials of both gradients (every
 * dp rank gets the same values, each in its own buffer as on the ranks: DP
 * copies of gw and gb, so every part is read from memory), in the run's dp-sum
 * mode: what the reference would add to its step to start from the rank
 * partials instead of the averaged gradient (item 2 of the dp-sum issue:
 * dist ≤ 1.5 × (ref + this)). Median of `steps` runs after the warm-up ones. */
static double dpsum_cpu(const opts *op, const float *gw, const float *gb) {
  const size_t n = op->n, nw = n * n;
  float *out = malloc(nw * sizeof *out), *cw = malloc(DP * nw * sizeof *cw), *cb = malloc(DP * n * sizeof *cb);
  double r = -1;
  if (!out || !cw || !cb) goto done;
  const float *pw[DP], *pb[DP];
  for (int d = 0; d < DP; d++) {
    memcpy(cw + (size_t)d * nw, gw, nw * sizeof *cw);
    memcpy(cb + (size_t)d * n, gb, n * sizeof *cb);
    pw[d] = cw + (size_t)d * nw, pb[d] = cb + (size_t)d * n;
  }
  double cpu[MAXSTEPS];
  for (int it = 0; it < op->warmup + op->steps; it++) {
    double c0 = clock_s(CLOCK_PROCESS_CPUTIME_ID);
    dopt_status s = dopt_dp_sum(pw, DP, op->dp_words, nw, out);
    if (s == DOPT_OK) s = dopt_dp_sum(pb, DP, op->dp_words, n, out);
    double c1 = clock_s(CLOCK_PROCESS_CPUTIME_ID);
    if (s != DOPT_OK) goto done;
    if (it >= op->warmup) cpu[it - op->warmup] = c1 - c0;
  }
  r = median(cpu, op->steps);
done:
  free(out);
  free(cw);
  free(cb);
  return r;
}

/* ---- one optimizer ----------------------------------------------------------------------- */

typedef struct row {
  const char *name;
  double ref_cpu, ref_wall, dist_cpu, dist_thread_cpu, dist_wall;
  double bytes, bus_bytes, ops; /* rank 0 */
  double bytes_mean, bytes_max;   /* over the ranks */
  double ops_kind[DOPT_SIM_KIND_COUNT], bytes_kind[DOPT_SIM_KIND_COUNT];
  dopt_sim_projection proj[NCLUSTERS];
  dopt_dist_memory mem;
  size_t ref_state_bytes;
} row;

static dopt_status run_case(const opt_case *oc, const opts *op, const float *w0, const float *b0, const float *gw,
                            const float *gb, row *out) {
  memset(out, 0, sizeof *out);
  out->name = oc->name;
  const size_t n = op->n;
  /* (a) the reference, one thread */
  {
    float *w, *b;
    dopt_optim *o;
    dopt_status s = build(oc, n, w0, b0, &w, &b, &o);
    const float *g[2] = {gw, gb};
    double cpu[MAXSTEPS], wall[MAXSTEPS];
    for (int it = 0; s == DOPT_OK && it < op->warmup + op->steps; it++) {
      double c0 = clock_s(CLOCK_PROCESS_CPUTIME_ID), t0 = clock_s(CLOCK_MONOTONIC);
      s = dopt_optim_step(o, g);
      double c1 = clock_s(CLOCK_PROCESS_CPUTIME_ID), t1 = clock_s(CLOCK_MONOTONIC);
      if (it >= op->warmup) {
        cpu[it - op->warmup] = c1 - c0;
        wall[it - op->warmup] = t1 - t0;
      }
    }
    size_t full = 0;
    if (s == DOPT_OK) s = dopt_optim_state_bytes(o, -1, &out->ref_state_bytes, &full);
    dopt_optim_destroy(o);
    free(w);
    free(b);
    if (s != DOPT_OK) {
      fprintf(stderr, "%s reference: %s: %s\n", oc->name, dopt_status_name(s), dopt_last_error());
      return s;
    }
    out->ref_cpu = median(cpu, op->steps);
    out->ref_wall = median(wall, op->steps);
  }
  /* (b) distributed on the simulator */
  float *w, *b;
  dopt_optim *plain;
  BTRY(build(oc, n, w0, b0, &w, &b, &plain));
  dist_ctx *x = calloc(1, sizeof *x);
  dopt_sim_world *world = NULL;
  dopt_sim_config cfg = DOPT_SIM_CONFIG_INIT;
  cfg.nranks = NRANKS;
  cfg.timeout_ms = 600000; /* 4 threads on 2 shared cores, large steps */
  cfg.copy_exchanges = op->copy;
  dopt_status s = x ? dopt_sim_world_create(&cfg, &world) : DOPT_ERR_NO_MEMORY;
  if (s == DOPT_OK) {
    x->op = op;
    x->plain = plain;
    x->gw = gw;
    x->gb = gb;
    dopt_status st[NRANKS];
    s = dopt_sim_launch(world, dist_body, x, st);
    for (int r = 0; r < NRANKS; r++)
      if (st[r] != DOPT_OK)
        fprintf(stderr, "%s rank %d: %s: %s\n", oc->name, r, dopt_status_name(st[r]),
                dopt_sim_world_rank_error(world, r));
  }
  if (s == DOPT_OK) {
    double tsum[MAXSTEPS];
    for (int k = 0; k < op->steps; k++) {
      tsum[k] = 0;
      for (int r = 0; r < NRANKS; r++) tsum[k] += x->thread_cpu[r][k];
    }
    out->dist_cpu = median(x->proc_cpu, op->steps);
    out->dist_thread_cpu = median(tsum, op->steps);
    out->dist_wall = median(x->wall, op->steps);
    out->mem = x->mem;
    /* each rank's communicators: every collective it took part in (rank 0's kinds and bus bytes listed) */
    for (int r = 0; r < NRANKS; r++) {
      double mine = 0;
      for (int c = 0; c < 2; c++) {
        int gn = x->after[r][c].nranks;
        for (int k = 0; k < DOPT_SIM_KIND_COUNT; k++) {
          double ops = (double)(x->after[r][c].ops[k] - x->before[r][c].ops[k]) / op->steps;
          double by = (double)(x->after[r][c].bytes[k] - x->before[r][c].bytes[k]) / op->steps;
          mine += by;
          if (r != 0) continue;
          out->ops_kind[k] += ops;
          out->bytes_kind[k] += by;
          out->ops += ops;
          out->bytes += by;
          out->bus_bytes += by * dopt_sim_busbw_factor((dopt_sim_kind)k, gn);
        }
      }
      out->bytes_mean += mine / NRANKS;
      out->bytes_max = mine > out->bytes_max ? mine : out->bytes_max;
    }
    /* (c) projection: the log holds warmup + steps identical steps (plus the
     * bench's own barriers on the world communicator, dropped here) */
    const int total = op->warmup + op->steps;
    for (int ci = 0; ci < NCLUSTERS && s == DOPT_OK; ci++) {
      dopt_sim_cluster cl = DOPT_SIM_CLUSTER_INIT;
      cl.links = CLUSTERS[ci].links;
      cl.nlinks = 2;
      dopt_sim_projection p = DOPT_SIM_PROJECTION_INIT;
      s = dopt_sim_project(world, 0, &cl, &p);
      if (s != DOPT_OK) break;
      p.total_s -= p.seconds[DOPT_SIM_KIND_BARRIER];
      p.seconds[DOPT_SIM_KIND_BARRIER] = 0;
      p.ops[DOPT_SIM_KIND_BARRIER] = 0;
      p.total_s /= total;
      for (int k = 0; k < DOPT_SIM_KIND_COUNT; k++) {
        if (p.ops[k] % (uint64_t)total != 0) {
          fprintf(stderr, "%s: %llu %s operations over %d steps: steps differ\n", oc->name,
                  (unsigned long long)p.ops[k], dopt_sim_kind_name((dopt_sim_kind)k), total);
          s = DOPT_ERR_STATE;
        }
        p.seconds[k] /= total;
        p.ops[k] /= (uint64_t)total;
      }
      out->proj[ci] = p;
    }
  } else {
    fprintf(stderr, "%s distributed: %s: %s\n", oc->name, dopt_status_name(s), dopt_last_error());
  }
  if (world) dopt_sim_world_destroy(world);
  free(x);
  dopt_optim_destroy(plain);
  free(w);
  free(b);
  return s;
}

/* ---- main ----------------------------------------------------------------------------------- */

static int usage(const char *argv0) {
  fprintf(stderr,
          "usage: %s [--optimizer NAME|all] [--size N] [--steps K] [--warmup W] [--zero Z] [--clip X]\n"
          "          [--dp-sum exact|rank-order] [--exchanges in-place|copied]\n"
          "  --optimizer  a registry name (GaLore ones with rank=128; came lr=2e-4), or all (default)\n"
          "  --size N     weight N x N (TP COLUMN) + bias N (replicated); default 4096\n"
          "  --steps K    timed steps, median reported (default 5, 1..%d)\n"
          "  --warmup W   untimed steps first (default 2)\n"
          "  --zero Z     ZeRO stage of the distributed run, 0..3 (default 2)\n"
          "  --clip X     global gradient-norm clipping in the distributed run (default 0: off)\n"
          "  --dp-sum S   the distributed run's dp gradient sum: exact (default) or rank-order (fp32)\n"
          "  --exchanges E  in-place (default: the dp sum reads the other ranks' parts where they are, as the\n"
          "               simulator's threads share memory) or copied (every exchange copies, as over a network)\n",
          argv0, MAXSTEPS - 1);
  return 2;
}

static const char *kind_short(int k) {
  switch (k) {
  case DOPT_SIM_KIND_ALL_REDUCE: return "AR";
  case DOPT_SIM_KIND_REDUCE_SCATTER: return "RS";
  case DOPT_SIM_KIND_ALL_GATHER: return "AG";
  default: return dopt_sim_kind_name((dopt_sim_kind)k);
  }
}

int main(int argc, char **argv) {
  opts op = {NULL, 4096, 5, 2, 2, 0.0, DOPT_DP_SUM_DEFAULT_WORDS, 0};
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    char *end = NULL;
    if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
      usage(argv[0]);
      return 0;
    }
    if (!v) return usage(argv[0]);
    if (strcmp(a, "--optimizer") == 0) {
      op.only = strcmp(v, "all") == 0 ? NULL : v;
    } else if (strcmp(a, "--size") == 0) {
      long long nv = strtoll(v, &end, 10);
      if (*end || nv < 1 || nv > 65536) return usage(argv[0]);
      op.n = (size_t)nv;
    } else if (strcmp(a, "--steps") == 0) {
      long nv = strtol(v, &end, 10);
      if (*end || nv < 1 || nv >= MAXSTEPS) return usage(argv[0]);
      op.steps = (int)nv;
    } else if (strcmp(a, "--warmup") == 0) {
      long nv = strtol(v, &end, 10);
      if (*end || nv < 0 || nv > 1000) return usage(argv[0]);
      op.warmup = (int)nv;
    } else if (strcmp(a, "--zero") == 0) {
      long nv = strtol(v, &end, 10);
      if (*end || nv < 0 || nv > 3) return usage(argv[0]);
      op.zero = (int)nv;
    } else if (strcmp(a, "--dp-sum") == 0) {
      if (strcmp(v, "exact") == 0) op.dp_words = DOPT_DP_SUM_DEFAULT_WORDS;
      else if (strcmp(v, "rank-order") == 0) op.dp_words = 0;
      else return usage(argv[0]);
    } else if (strcmp(a, "--exchanges") == 0) {
      if (strcmp(v, "in-place") == 0) op.copy = 0;
      else if (strcmp(v, "copied") == 0) op.copy = 1;
      else return usage(argv[0]);
    } else if (strcmp(a, "--clip") == 0) {
      double nv = strtod(v, &end);
      if (*end || !(nv >= 0) || !isfinite(nv)) return usage(argv[0]);
      op.clip = nv;
    } else {
      return usage(argv[0]);
    }
    i++;
  }
  int which[NCASES], nrun = 0;
  for (int c = 0; c < NCASES; c++)
    if (!op.only || strcmp(op.only, CASES[c].name) == 0) which[nrun++] = c;
  if (nrun == 0) {
    fprintf(stderr, "unknown optimizer '%s' (a registry name, or all)\n", op.only);
    return 2;
  }
  const size_t n = op.n;
  float *w0 = malloc(n * n * sizeof(float)), *b0 = malloc(n * sizeof(float));
  float *gw = malloc(n * n * sizeof(float)), *gb = malloc(n * sizeof(float));
  row *rows = calloc((size_t)nrun, sizeof *rows);
  if (!w0 || !b0 || !gw || !gb || !rows) {
    fprintf(stderr, "out of memory (size %zu)\n", n);
    return 1;
  }
  fill(w0, n * n, 1, 0.02);
  fill(b0, n, 2, 0.02);
  fill(gw, n * n, 3, 1e-3);
  fill(gb, n, 4, 1e-3);

  printf("distributed step vs reference: weight [%zu, %zu] (TP COLUMN) + bias [%zu] (replicated), fp32\n", n, n, n);
  printf("dist: tp=%d x dp=%d x zero=%d (%s) on %d simulator rank threads; clip %s; dp sum %s; exchanges %s; median "
         "of %d steps after %d warm-up\n\n",
         TP, DP, op.zero, op.zero == 3 ? "fsdp" : "hybrid", NRANKS, op.clip > 0 ? "on" : "off",
         op.dp_words ? "exact" : "rank-order (fp32)", op.copy ? "copied" : "in place", op.steps, op.warmup);
  const double sum_cpu = dpsum_cpu(&op, gw, gb);
  if (sum_cpu < 0) {
    fprintf(stderr, "dopt_dp_sum: %s\n", dopt_last_error());
    return 1;
  }
  int rc = 0;
  for (int i = 0; i < nrun; i++) {
    dopt_status s = run_case(&CASES[which[i]], &op, w0, b0, gw, gb, &rows[i]);
    if (s != DOPT_OK) {
      rc = 1;
      rows[i].name = NULL;
    }
  }

  printf("| optimizer | ref CPU ms | dist CPU ms | ratio | ref + dp sum ms | dist / (ref + sum) | dist wall ms | "
         "MB/step rank 0 | mean | max | bus MB/step rank 0 | collectives/step rank 0 |\n");
  printf("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|\n");
  for (int i = 0; i < nrun; i++) {
    const row *r = &rows[i];
    if (!r->name) continue;
    char kinds[128] = "";
    size_t off = 0;
    for (int k = 0; k < DOPT_SIM_KIND_COUNT; k++)
      if (r->ops_kind[k] > 0)
        off += (size_t)snprintf(kinds + off, sizeof kinds - off, "%s%s %.0f", off ? ", " : "", kind_short(k),
                                r->ops_kind[k]);
    printf("| %s | %.1f | %.1f | %.2fx | %.1f | %.2fx | %.1f | %.1f | %.1f | %.1f | %.1f | %.0f (%s) |\n", r->name,
           r->ref_cpu * 1e3, r->dist_cpu * 1e3, r->dist_cpu / r->ref_cpu, (r->ref_cpu + sum_cpu) * 1e3,
           r->dist_cpu / (r->ref_cpu + sum_cpu), r->dist_wall * 1e3, r->bytes / 1e6, r->bytes_mean / 1e6,
           r->bytes_max / 1e6, r->bus_bytes / 1e6, r->ops, kinds);
  }
  printf("\nref CPU: one dopt_optim_step, one thread. ref + dp sum: plus dopt_dp_sum of the %d dp partials of both\n"
         "gradients in the same mode (%.1f ms, one thread). dist CPU: process CPU time of one dopt_dist_step on all %d\n"
         "ranks together (sum of the ranks' thread CPU times for comparison below). MB: nccl-tests bytes\n"
         "(all_reduce, reduce, broadcast count*size; reduce_scatter/all_gather the full n*count*size buffer;\n"
         "all_to_allv the busiest sender's bytes to the others) of the collectives a rank took part in: rank 0's,\n"
         "the mean and the max over the ranks; bus MB: times the bus factor (what one rank sends in a ring).\n\n",
         DP, sum_cpu * 1e3, NRANKS);
  printf("| optimizer | ref wall ms | dist thread-CPU sum ms | state MB/rank (ref whole) | param+master MB/rank | "
         "grad MB/rank |\n|---|---:|---:|---:|---:|---:|\n");
  for (int i = 0; i < nrun; i++) {
    const row *r = &rows[i];
    if (!r->name) continue;
    printf("| %s | %.1f | %.1f | %.2f (%.2f) | %.1f | %.1f |\n", r->name, r->ref_wall * 1e3,
           r->dist_thread_cpu * 1e3, (double)r->mem.state_bytes / 1e6, (double)r->ref_state_bytes / 1e6, (double)r->mem.param_bytes / 1e6,
           (double)r->mem.grad_bytes / 1e6);
  }

  printf("\nprojected communication per step of one rank (alpha-beta, dopt_sim_project; NVLink %.0f GB/s %.0f us,\n"
         "IB %.0f GB/s %.0f us), ms:\n\n",
         NVLINK_BPS / 1e9, NVLINK_LAT * 1e6, IB_BPS / 1e9, IB_LAT * 1e6);
  printf("| optimizer | cluster | total ms | all_reduce ms (ops) | reduce_scatter ms (ops) | all_gather ms (ops) |\n");
  printf("|---|---|---:|---:|---:|---:|\n");
  for (int i = 0; i < nrun; i++) {
    const row *r = &rows[i];
    if (!r->name) continue;
    for (int ci = 0; ci < NCLUSTERS; ci++) {
      const dopt_sim_projection *p = &r->proj[ci];
      printf("| %s | %s | %.3f | %.3f (%llu) | %.3f (%llu) | %.3f (%llu) |\n", r->name, CLUSTERS[ci].name,
             p->total_s * 1e3, p->seconds[DOPT_SIM_KIND_ALL_REDUCE] * 1e3,
             (unsigned long long)p->ops[DOPT_SIM_KIND_ALL_REDUCE], p->seconds[DOPT_SIM_KIND_REDUCE_SCATTER] * 1e3,
             (unsigned long long)p->ops[DOPT_SIM_KIND_REDUCE_SCATTER], p->seconds[DOPT_SIM_KIND_ALL_GATHER] * 1e3,
             (unsigned long long)p->ops[DOPT_SIM_KIND_ALL_GATHER]);
    }
  }
  printf("\n(*) recorded at tp2 x dp2; the link's group_size replaces the recorded group size, so the 64-GPU row\n"
         "costs the tp2 x dp2 per-rank buffers on groups of 8. A real tp8 run has 4x smaller TP-local\n"
         "gradient/parameter buffers; the Adafactor/CAME row/column accumulators are full-size either way.\n");
  free(w0);
  free(b0);
  free(gw);
  free(gb);
  free(rows);
  return rc;
}
