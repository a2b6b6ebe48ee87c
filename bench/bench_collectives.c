/* dopt_collectives_bench: collectives per optimizer step and their cost, for
 * two parameter lists (docs/architecture.md, "Batched reductions"):
 *   block  the synthetic transformer block of `distopt compare` (9 tensors);
 *   llama  a 32-layer LLaMA-shaped list (291 tensors: embedding, per layer
 *          2 RMSNorm weights, q/k/v/o, gate/up/down; final norm, lm_head),
 *          dimensions divided by `--shrink` (default 16: hidden 256,
 *          intermediate 688, vocab 2000) so that it fits the simulator; the
 *          collective count does not depend on the dimensions.
 * Runs tp=2 x dp=2 x ZeRO-2 on 4 simulator rank threads and prints per
 * optimizer, for world rank 0 and one step: collectives by kind (all_reduce
 * carries every statistic, the non-finite count and the dp sum's block codes;
 * all_to_allv the dp sum's parts and owner exchanges, all_gather the
 * weights: one per bucket of bucket_bytes, the default 64 MiB),
 * the simulator's measured communication time, and the alpha-beta projection
 * (dopt_sim_project) of the recorded operations onto 8, 64 and 1024 GPUs.
 *
 * Uses only the public API, so the same file measures an older library too
 * (cc -I<old>/include bench_collectives.c <old>/libdistopt.a ...).
 *
 *   dopt_collectives_bench [--model block|llama|all] [--optimizer NAME|all] [--shrink K] */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "distopt/dist.h"
#include "distopt/optim.h"
#include "distopt/sim.h"

#define TP 2
#define DP 2
#define NRANKS (TP * DP)
#define WARMUP 1
#define STEPS 2

#define BTRY(expr)              \
  do {                          \
    dopt_status bt_s_ = (expr); \
    if (bt_s_ != DOPT_OK)       \
      return bt_s_;             \
  } while (0)

typedef struct tensor {
  char name[48];
  int ndim;
  int64_t shape[2];
  dopt_tp_role role;
} tensor;

typedef struct model {
  const char *name;
  tensor *t;
  int n;
} model;

static void add(model *m, const char *name, int ndim, int64_t a, int64_t b, dopt_tp_role role) {
  tensor *t = &m->t[m->n++];
  snprintf(t->name, sizeof t->name, "%s", name);
  t->ndim = ndim;
  t->shape[0] = a;
  t->shape[1] = b;
  t->role = role;
}

static void block_model(model *m) {
  m->name = "block";
  m->t = calloc(9, sizeof *m->t);
  add(m, "embed.weight", 2, 50, 32, DOPT_TP_COLUMN);
  add(m, "attn.qkv.weight", 2, 96, 32, DOPT_TP_COLUMN);
  add(m, "attn.out.weight", 2, 32, 32, DOPT_TP_ROW);
  add(m, "mlp.fc1.weight", 2, 70, 32, DOPT_TP_COLUMN);
  add(m, "mlp.fc1.bias", 1, 70, 0, DOPT_TP_COLUMN);
  add(m, "mlp.fc2.weight", 2, 32, 70, DOPT_TP_ROW);
  add(m, "mlp.fc2.bias", 1, 32, 0, DOPT_TP_REPLICATED);
  add(m, "norm.weight", 1, 32, 0, DOPT_TP_REPLICATED);
  add(m, "head.scale", 2, 1, 32, DOPT_TP_REPLICATED);
}

/* LLaMA-7B's list (hidden 4096, intermediate 11008, vocab 32000, 32 layers), dims / k */
static void llama_model(model *m, int k) {
  const int64_t H = 4096 / k, I = 11008 / k, V = 32000 / k;
  m->name = "llama";
  m->t = calloc(3 + 32 * 9, sizeof *m->t);
  add(m, "embed_tokens.weight", 2, V, H, DOPT_TP_COLUMN);
  char nm[48];
  static const char *const attn[] = {"q_proj", "k_proj", "v_proj"}, *const up[] = {"gate_proj", "up_proj"};
  for (int l = 0; l < 32; l++) {
    snprintf(nm, sizeof nm, "layers.%d.input_layernorm.weight", l);
    add(m, nm, 1, H, 0, DOPT_TP_REPLICATED);
    for (int j = 0; j < 3; j++) {
      snprintf(nm, sizeof nm, "layers.%d.self_attn.%s.weight", l, attn[j]);
      add(m, nm, 2, H, H, DOPT_TP_COLUMN);
    }
    snprintf(nm, sizeof nm, "layers.%d.self_attn.o_proj.weight", l);
    add(m, nm, 2, H, H, DOPT_TP_ROW);
    snprintf(nm, sizeof nm, "layers.%d.post_attention_layernorm.weight", l);
    add(m, nm, 1, H, 0, DOPT_TP_REPLICATED);
    for (int j = 0; j < 2; j++) {
      snprintf(nm, sizeof nm, "layers.%d.mlp.%s.weight", l, up[j]);
      add(m, nm, 2, I, H, DOPT_TP_COLUMN);
    }
    snprintf(nm, sizeof nm, "layers.%d.mlp.down_proj.weight", l);
    add(m, nm, 2, H, I, DOPT_TP_ROW);
  }
  add(m, "norm.weight", 1, H, 0, DOPT_TP_REPLICATED);
  add(m, "lm_head.weight", 2, V, H, DOPT_TP_COLUMN);
}

static size_t numel(const tensor *t) { return (size_t)t->shape[0] * (t->ndim == 2 ? (size_t)t->shape[1] : 1); }

static uint64_t mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

static void fill(float *x, size_t n, uint64_t seed, double scale) {
  for (size_t i = 0; i < n; i++)
    x[i] = (float)(((double)(mix(seed + 0x9E3779B97F4A7C15ull * (i + 1)) >> 11) * 0x1.0p-53 - 0.5) * 2.0 * scale);
}

/* ---- the distributed run -------------------------------------------------------------- */

typedef struct run_ctx {
  const model *m;
  const dopt_optim *plain;
  float **grad; /* logical gradients [n] per tensor; every dp rank takes the same */
  double comm_s[2]; /* written by rank 0: tp, dp communicator seconds over the timed steps */
  uint64_t ops[2][DOPT_SIM_KIND_COUNT];
  double step_wall;
} run_ctx;

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* TP rank r's block of a logical gradient (dopt_tp_block: the library's rule) */
static void tp_block(const tensor *t, const float *g, int r, float *out) {
  dopt_piece pc;
  dopt_tp_block(t->ndim, t->shape, t->role, TP, r, &pc);
  for (size_t bi = 0; bi < pc.b; bi++)
    for (size_t i = 0; i < pc.hl; i++)
      memcpy(out + (bi * pc.hl + i) * pc.wl, g + (bi * pc.h + pc.h0 + i) * pc.w + pc.w0, pc.wl * sizeof *g);
}

static dopt_status body(dopt_sim_comm *world, int rank, void *user) {
  run_ctx *x = user;
  const model *m = x->m;
  dopt_sim_comm *tpc = NULL, *dpc = NULL;
  BTRY(dopt_sim_comm_split_labeled(world, rank / TP, rank, "tp", &tpc));
  BTRY(dopt_sim_comm_split_labeled(world, rank % TP, rank, "dp", &dpc));
  dopt_dist_config cfg = DOPT_DIST_CONFIG_INIT;
  cfg.plugin = "hybrid";
  cfg.zero_stage = 2;
  BTRY(dopt_sim_transport(tpc, &cfg.tp));
  BTRY(dopt_sim_transport(dpc, &cfg.dp));
  dopt_tp_role *roles = malloc((size_t)m->n * sizeof *roles);
  float **local = calloc((size_t)m->n, sizeof *local);
  if (!roles || !local) return DOPT_ERR_NO_MEMORY;
  for (int i = 0; i < m->n; i++) roles[i] = m->t[i].role;
  dopt_dist_optim *d = NULL;
  dopt_status s = dopt_dist_create(x->plain, &cfg, roles, &d);
  for (int i = 0; s == DOPT_OK && i < m->n; i++) {
    local[i] = malloc(numel(&m->t[i]) * sizeof(float));
    if (!local[i]) s = DOPT_ERR_NO_MEMORY;
    else tp_block(&m->t[i], x->grad[i], cfg.tp.rank, local[i]);
  }
  dopt_sim_stats st0[2] = {DOPT_SIM_STATS_INIT, DOPT_SIM_STATS_INIT}, st1[2] = {DOPT_SIM_STATS_INIT, DOPT_SIM_STATS_INIT};
  double wall = 0;
  for (int it = 0; s == DOPT_OK && it < WARMUP + STEPS; it++) {
    s = dopt_dist_backward(d, (const float *const *)local);
    if (s == DOPT_OK) s = dopt_sim_barrier(world);
    if (s == DOPT_OK && rank == 0 && it == WARMUP) {
      s = dopt_sim_comm_stats(tpc, &st0[0]);
      if (s == DOPT_OK) s = dopt_sim_comm_stats(dpc, &st0[1]);
    }
    double t0 = now();
    dopt_dist_step_info info;
    if (s == DOPT_OK) s = dopt_dist_step(d, &info);
    if (s == DOPT_OK) s = dopt_sim_barrier(world);
    if (it >= WARMUP) wall += now() - t0;
  }
  if (s == DOPT_OK && rank == 0) {
    s = dopt_sim_comm_stats(tpc, &st1[0]);
    if (s == DOPT_OK) s = dopt_sim_comm_stats(dpc, &st1[1]);
    for (int c = 0; c < 2; c++) {
      x->comm_s[c] = 0;
      for (int k = 0; k < DOPT_SIM_KIND_COUNT; k++) {
        x->ops[c][k] = (st1[c].ops[k] - st0[c].ops[k]) / STEPS;
        x->comm_s[c] += (st1[c].seconds[k] - st0[c].seconds[k]) / STEPS;
      }
    }
    x->step_wall = wall / STEPS;
  }
  for (int i = 0; i < m->n; i++) free(local[i]);
  free(local);
  free(roles);
  dopt_dist_destroy(d);
  return s;
}

/* ---- projection ------------------------------------------------------------------------- */

#define NVLINK_BPS 450e9
#define NVLINK_LAT 2e-6
#define IB_BPS 50e9
#define IB_LAT 5e-6

typedef struct cluster_desc {
  const char *name;
  dopt_sim_link links[2];
} cluster_desc;

/* the recorded tp2 x dp2 operations on groups of these sizes (group_size) */
static const cluster_desc CLUSTERS[] = {
    {"8 GPU: tp4 x dp2, 1 node (NVLink)", {{"tp", 4, NVLINK_BPS, NVLINK_LAT}, {"dp", 2, NVLINK_BPS, NVLINK_LAT}}},
    {"64 GPU: tp8 (NVLink) x dp8 (IB)", {{"tp", 8, NVLINK_BPS, NVLINK_LAT}, {"dp", 8, IB_BPS, IB_LAT}}},
    {"1024 GPU: tp8 (NVLink) x dp128 (IB)", {{"tp", 8, NVLINK_BPS, NVLINK_LAT}, {"dp", 128, IB_BPS, IB_LAT}}},
};
#define NCLUSTERS ((int)(sizeof CLUSTERS / sizeof CLUSTERS[0]))

static dopt_status run(const model *m, const char *opt, const char *hp) {
  /* the plain optimizer over the logical parameters */
  float **w = calloc((size_t)m->n, sizeof *w), **g = calloc((size_t)m->n, sizeof *g);
  if (!w || !g) return DOPT_ERR_NO_MEMORY;
  dopt_optim *o = NULL;
  dopt_status s = dopt_optim_create(opt, hp, &o);
  for (int i = 0; s == DOPT_OK && i < m->n; i++) {
    size_t n = numel(&m->t[i]);
    w[i] = malloc(n * sizeof(float));
    g[i] = malloc(n * sizeof(float));
    if (!w[i] || !g[i]) {
      s = DOPT_ERR_NO_MEMORY;
      break;
    }
    fill(w[i], n, 1000 + (uint64_t)i, 0.02);
    fill(g[i], n, 2000 + (uint64_t)i, 1e-3);
    dopt_param_config pc = DOPT_PARAM_CONFIG_INIT;
    pc.name = m->t[i].name;
    pc.ndim = m->t[i].ndim;
    pc.shape[0] = m->t[i].shape[0];
    pc.shape[1] = m->t[i].shape[1];
    pc.data = w[i];
    s = dopt_optim_add_param(o, 0, &pc, NULL);
  }
  run_ctx x;
  memset(&x, 0, sizeof x);
  x.m = m;
  x.plain = o;
  x.grad = g;
  dopt_sim_world *world = NULL;
  dopt_sim_config cfg = DOPT_SIM_CONFIG_INIT;
  cfg.nranks = NRANKS;
  cfg.timeout_ms = 600000;
  if (s == DOPT_OK) s = dopt_sim_world_create(&cfg, &world);
  dopt_status st[NRANKS];
  if (s == DOPT_OK) s = dopt_sim_launch(world, body, &x, st);
  if (s != DOPT_OK) {
    fprintf(stderr, "%s/%s: %s: %s\n", m->name, opt, dopt_status_name(s),
            world ? dopt_sim_world_rank_error(world, 0) : dopt_last_error());
  } else {
    static const int kinds[] = {DOPT_SIM_KIND_ALL_REDUCE, DOPT_SIM_KIND_REDUCE_SCATTER, DOPT_SIM_KIND_ALL_GATHER,
                                DOPT_SIM_KIND_ALL_TO_ALLV, DOPT_SIM_KIND_BROADCAST, DOPT_SIM_KIND_REDUCE};
    printf("| %s | %d | %s |", m->name, m->n, opt);
    unsigned long long ops = 0;
    for (size_t k = 0; k < sizeof kinds / sizeof *kinds; k++) {
      const unsigned long long c = x.ops[0][kinds[k]] + x.ops[1][kinds[k]];
      printf(" %llu |", c);
      ops += c;
    }
    printf(" %llu | %.2f | %.1f |", ops, (x.comm_s[0] + x.comm_s[1]) * 1e3, x.step_wall * 1e3);
    const int total = WARMUP + STEPS;
    for (int ci = 0; ci < NCLUSTERS && s == DOPT_OK; ci++) {
      dopt_sim_cluster cl = DOPT_SIM_CLUSTER_INIT;
      cl.links = CLUSTERS[ci].links;
      cl.nlinks = 2;
      dopt_sim_projection p = DOPT_SIM_PROJECTION_INIT;
      s = dopt_sim_project(world, 0, &cl, &p);
      /* drop the bench's barriers; average over the identical steps */
      double stat = p.seconds[DOPT_SIM_KIND_ALL_REDUCE] / total;
      double all = (p.total_s - p.seconds[DOPT_SIM_KIND_BARRIER]) / total;
      printf(" %.3f / %.3f |", stat * 1e3, all * 1e3);
    }
    printf("\n");
  }
  if (world) dopt_sim_world_destroy(world);
  dopt_optim_destroy(o);
  for (int i = 0; i < m->n; i++) {
    free(w[i]);
    free(g[i]);
  }
  free(w);
  free(g);
  return s;
}

int main(int argc, char **argv) {
  const char *which = "all", *only = "all";
  int shrink = 16;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (strcmp(argv[i], "--model") == 0) which = argv[i + 1];
    else if (strcmp(argv[i], "--optimizer") == 0) only = argv[i + 1];
    else if (strcmp(argv[i], "--shrink") == 0) shrink = atoi(argv[i + 1]);
    else {
      fprintf(stderr, "usage: %s [--model block|llama|all] [--optimizer NAME|all] [--shrink K]\n", argv[0]);
      return 2;
    }
  }
  if ((argc - 1) % 2 != 0 || shrink < 1 || shrink > 1024) {
    fprintf(stderr, "usage: %s [--model block|llama|all] [--optimizer NAME|all] [--shrink K (1..1024)]\n", argv[0]);
    return 2;
  }
  static const char *const opts[][2] = {{"adamw", NULL},          {"adafactor", NULL},
                                        {"came", "lr=2e-4"},      {"lamb", NULL},
                                        {"adamw8bit", NULL},      {"galore_adamw", "rank=8,update_proj_gap=1000"}};
  model ms[2];
  int nm = 0;
  memset(ms, 0, sizeof ms);
  if (!strcmp(which, "all") || !strcmp(which, "block")) block_model(&ms[nm++]);
  if (!strcmp(which, "all") || !strcmp(which, "llama")) llama_model(&ms[nm++], shrink);
  printf("collectives per step of world rank 0 (its tp and dp communicators), tp=%d x dp=%d x ZeRO-2 on %d simulator\n"
         "rank threads; median-free: every step issues the same operations (mean of %d steps after %d warm-up)\n\n",
         TP, DP, NRANKS, STEPS, WARMUP);
  printf("| model | tensors | optimizer | all_reduce | reduce_scatter | all_gather | all_to_allv | broadcast | reduce | "
         "total | sim comm ms | sim step ms |");
  for (int c = 0; c < NCLUSTERS; c++) printf(" %s: stats / all ms |", CLUSTERS[c].name);
  printf("\n|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
  for (int c = 0; c < NCLUSTERS; c++) printf("---:|");
  printf("\n");
  int rc = 0;
  for (int i = 0; i < nm; i++)
    for (size_t k = 0; k < sizeof opts / sizeof opts[0]; k++)
      if (!strcmp(only, "all") || !strcmp(only, opts[k][0]))
        if (run(&ms[i], opts[k][0], opts[k][1]) != DOPT_OK) rc = 1;
  printf("\nall_reduce: every statistic collective, 2 for the non-finite count (tp, dp) and 2 per bucket for the exact\n"
         "dp sum's block codes (tp, dp); all_to_allv: the dp sum's parts (one per bucket) and the owner exchanges;\n"
         "all_gather: the weights at ZeRO-2 (one per bucket). sim comm ms: wall time\n"
         "of rank 0's collectives in the simulator. Projection: alpha-beta (NVLink %.0f GB/s %.0f us, IB %.0f GB/s\n"
         "%.0f us) of the recorded operations with the group sizes replaced (the tp2 x dp2 buffers on larger\n"
         "groups); stats = all_reduce only, all = every collective of the step.\n",
         NVLINK_BPS / 1e9, NVLINK_LAT * 1e6, IB_BPS / 1e9, IB_LAT * 1e6);
  for (int i = 0; i < nm; i++) free(ms[i].t);
  return rc;
}
