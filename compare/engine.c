/* The equivalence engine (docs/cli.md, harness.h): the plan of the tensors and stages, and the launch of a
 * comparison on the simulator, MPI or NCCL, with its checkpoint and resume. */
#include <errno.h>
#include <fnmatch.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>

#include "compare.h"
#include "distopt/cuda.h"
#include "distopt/dpsum.h"
#include "distopt/launch.h"
#include "distopt/mpi.h"
#include "distopt/safetensors.h"
#include "distopt/sim.h"
#include "files.h"
#include "internal.h"
#include "model.h"
#include "registry.h"
#include "verify.h"
#include "harness.h"


/* The pipeline stage of every parameter (docs/distributed.md "Pipeline stages"): the decoder layers (names
 * with "layers.N.", L = the largest N + 1) in pp contiguous runs, as ColossalAI's Policy.distribute_layers:
 * L / pp each, and the L mod pp extra layers one each to the stages from pp/2 - (L mod pp)/2 on; or as
 * layers_per_stage says. A parameter without a layer number goes to the first stage before the first
 * layer's parameters (the embeddings), else to the last (the final norm, the head). */
void cmp_layers_per_stage(long L, int pp, long *per) {
  for (int k = 0; k < pp; k++) per[k] = L / pp;
  for (long k = pp / 2 - (L % pp) / 2, e = k + L % pp; k < e; k++) per[k]++;
}

static dopt_status plan_stages(const cmp_options *o, const source *s, int *stage) {
  long L = 0;
  int first = -1;
  for (int i = 0; i < s->np; i++) {
    const long n = dopt_layer_from_name(s->p[i].name); /* LISA's rule too */
    if (n >= 0 && first < 0) first = i;
    if (n + 1 > L) L = n + 1;
  }
  for (int i = 0; i < s->np; i++) stage[i] = 0;
  if (o->pp == 1) return DOPT_OK;
  if (L < o->pp)
    return dopt__fail(DOPT_ERR_INVALID_ARG, "pp=%d: the model has %ld decoder layers (parameters named "
                      "'layers.N.'); each stage needs one", o->pp, L);
  long per[CMP_PP_MAX], sum = 0;
  if (o->nlps)
    for (int k = 0; k < o->pp; k++) per[k] = o->layers_per_stage[k];
  else
    cmp_layers_per_stage(L, o->pp, per);
  for (int k = 0; k < o->pp; k++) sum += per[k];
  if (sum != L)
    return dopt__fail(DOPT_ERR_INVALID_ARG, "layers_per_stage: %ld layers in all, the model has %ld", sum, L);
  for (int i = 0; i < s->np; i++) {
    const long n = dopt_layer_from_name(s->p[i].name);
    if (n < 0) {
      stage[i] = first < 0 || i < first ? 0 : o->pp - 1;
      continue;
    }
    long at = 0;
    int k = 0;
    while (k < o->pp - 1 && n >= at + per[k]) at += per[k++];
    stage[i] = k;
  }
  return DOPT_OK;
}


/* World rank r's coordinates (dopt_rank_coords_of: the library's rule, ep inside dp as ColossalAI's
 * MoeHybridParallelPlugin): the colours of its tp, dp, pp, ep and moe_dp groups (c[5]), each the index of the
 * group among the world's groups of that kind. */
enum { G_TP, G_DP, G_PP, G_EP, G_MDP, NGROUPS };
static void group_colours(const cmp_options *o, int r, int *c) {
  const dopt_rank_coords x = dopt_rank_coords_of(r, o->tp, o->dp, o->ep);
  c[G_TP] = x.stage * o->dp + x.dp;
  c[G_DP] = x.stage * o->tp + x.tp;
  c[G_PP] = x.dp * o->tp + x.tp;
  c[G_EP] = (x.stage * (o->dp / o->ep) + x.moe_dp) * o->tp + x.tp;
  c[G_MDP] = (x.stage * o->ep + x.ep) * o->tp + x.tp;
}

/* The groups split from the world (sim: labelled) that this layout has: tp and dp always, pp with stages, ep and
 * moe_dp with expert parallelism. */
static int has_group(const cmp_options *o, int g) {
  return g == G_TP || g == G_DP || (g == G_PP && o->pp > 1) || ((g == G_EP || g == G_MDP) && o->ep > 1);
}
static const char *const GROUP_LABEL[NGROUPS] = {"tp", "dp", "pp", "ep", "moe_dp"};
static dopt_transport *group_slot(rank_groups *rg, int g) {
  return g == G_TP ? &rg->tp : g == G_DP ? &rg->dp : g == G_PP ? &rg->pp : g == G_EP ? &rg->ep : &rg->mdp;
}
static const rank_groups NO_GROUPS = {{NULL, NULL, 0, 1}, {NULL, NULL, 0, 1}, {NULL, NULL, 0, 1}, {NULL, NULL, 0, 1},
                                      {NULL, NULL, 0, 1}};

static dopt_status rank_body(dopt_sim_comm *world, int rank, void *user) {
  run_ctx *x = user;
  rank_groups rg = NO_GROUPS;
  int c[NGROUPS];
  group_colours(x->o, rank, c);
  for (int g = 0; g < NGROUPS; g++) {
    if (!has_group(x->o, g)) continue;
    dopt_sim_comm *sc;
    DOPT_TRY(dopt_sim_comm_split_labeled(world, c[g], rank, GROUP_LABEL[g], &sc));
    DOPT_TRY(dopt_sim_transport(sc, group_slot(&rg, g)));
  }
  return ce_rank_run(x, rank, &rg);
}

static void plan_layout(cmp_tensor_stat *t, dopt_dtype dt, int ndim, const int64_t *shape) {
  t->dtype = dt;
  t->ndim = ndim;
  memcpy(t->shape, shape, sizeof t->shape);
}

/* The tensors measured: per parameter, the parameter, its bf16 working copy
 * (with bf16), then every state of the optimizer's layout. */
static dopt_status plan_tensors(const cmp_options *o, const source *s, cmp_result *r) {
  uint16_t **work = calloc(s->np > 0 ? (size_t)s->np : 1, sizeof *work);
  if (!work) return dopt__fail(DOPT_ERR_NO_MEMORY, "compare: %d parameters", s->np);
  dopt_optim *opt;
  dopt_status bs = ce_build_plain(o, s, 0, NULL, work, &opt); /* on the source's values: only its states are made */
  if (bs != DOPT_OK) {
    for (int i = 0; i < s->np; i++) free(work[i]);
    free(work);
    return bs;
  }
  int cap = s->np * (2 + DOPT_MAX_STATES), n = 0;
  r->t = calloc((size_t)cap, sizeof *r->t);
  dopt_status st = r->t ? DOPT_OK : dopt__fail(DOPT_ERR_NO_MEMORY, "compare results: %d tensors", cap);
  for (int i = 0; i < s->np && st == DOPT_OK; i++) {
    st = dopt_optim_init_state(opt, i);
    snprintf(r->t[n].name, sizeof r->t[0].name, "%s", s->p[i].name);
    plan_layout(&r->t[n++], DOPT_F32, s->p[i].ndim, s->p[i].shape);
    if (o->bf16) {
      snprintf(r->t[n].name, sizeof r->t[0].name, "%s/bf16", s->p[i].name);
      plan_layout(&r->t[n], DOPT_BF16, s->p[i].ndim, s->p[i].shape);
      r->t[n++].is_state = 0;
    }
    for (int k = 0; st == DOPT_OK && k < dopt_optim_num_states(opt, i); k++) {
      dopt_state_view v;
      st = dopt_optim_state(opt, i, k, &v);
      snprintf(r->t[n].name, sizeof r->t[0].name, "%s/%s", s->p[i].name, v.name);
      plan_layout(&r->t[n], v.dtype, v.ndim, v.shape);
      r->t[n++].is_state = 1;
    }
  }
  r->ntensors = n;
  for (int k = 0; k < n && st == DOPT_OK; k++) {
    r->t[k].abs_per_step = calloc((size_t)o->steps, sizeof(double));
    r->t[k].ulp_per_step = calloc((size_t)o->steps, sizeof(uint64_t));
    if (!r->t[k].abs_per_step || !r->t[k].ulp_per_step)
      st = dopt__fail(DOPT_ERR_NO_MEMORY, "compare results: %d steps of tensor '%s'", o->steps, r->t[k].name);
  }
  dopt_optim_destroy(opt);
  for (int i = 0; i < s->np; i++) free(work[i]);
  free(work);
  return st;
}
/* The NCCL backend: this process is one rank of a launcher's world
 * (torchrun, mpirun, srun) of tp·dp processes, one GPU each (local rank). */
static dopt_status run_nccl(run_ctx *x) {
  const cmp_options *o = x->o;
  dopt_nccl_comm *world = NULL, *gc[NGROUPS] = {NULL};
  dopt_status st = dopt_nccl_init_env(120000, &world);
  dopt_transport wt;
  rank_groups rg = NO_GROUPS;
  if (st == DOPT_OK) st = dopt_nccl_transport(world, &wt);
  if (st == DOPT_OK && wt.size != o->pp * o->tp * o->dp)
    st = dopt__fail(DOPT_ERR_INVALID_ARG, "backend nccl: the launcher started %d ranks but pp x tp x dp = %d x %d x %d = %d",
                    wt.size, o->pp, o->tp, o->dp, o->pp * o->tp * o->dp);
  int c[NGROUPS] = {0};
  if (st == DOPT_OK) group_colours(o, wt.rank, c);
  for (int g = 0; st == DOPT_OK && g < NGROUPS; g++)
    if (has_group(o, g)) {
      st = dopt_nccl_split(world, c[g], wt.rank, &gc[g]);
      if (st == DOPT_OK) st = dopt_nccl_transport(gc[g], group_slot(&rg, g));
    }
  if (st == DOPT_OK) {
    x->r->rank = wt.rank;
    st = ce_rank_run(x, wt.rank, &rg);
  }
  if (st != DOPT_OK) { /* peers fail instead of waiting; every communicator, so that none finalises for minutes */
    for (int g = NGROUPS - 1; g >= 0; g--)
      if (gc[g]) dopt_nccl_abort(gc[g]);
    if (world) dopt_nccl_abort(world);
  }
  for (int g = NGROUPS - 1; g >= 0; g--) dopt_nccl_destroy(gc[g]);
  dopt_nccl_destroy(world);
  return st;
}

/* The MPI backend: this process is one rank of an mpirun world of tp·dp
 * processes on the CPU device, split into TP and DP groups as run_nccl does.
 * Every rank steps the reference and measures what it gathered; the
 * measurements are merged over the world (ce_merge_measurements). MPI stays
 * initialised: the caller finalises it (dopt_mpi_finalize), or on an error
 * aborts the job (dopt_mpi_abort) so that no peer waits for its timeout. */
static dopt_status run_mpi(run_ctx *x) {
  const cmp_options *o = x->o;
  dopt_mpi_comm *world = NULL, *gc[NGROUPS] = {NULL};
  dopt_status st = dopt_mpi_init(120000, &world);
  dopt_transport wt;
  rank_groups rg = NO_GROUPS;
  if (st == DOPT_OK) st = dopt_mpi_transport(world, &wt);
  if (st == DOPT_OK && wt.size != o->pp * o->tp * o->dp)
    st = dopt__fail(DOPT_ERR_INVALID_ARG, "backend mpi: mpirun started %d processes but pp x tp x dp = %d x %d x %d = %d",
                    wt.size, o->pp, o->tp, o->dp, o->pp * o->tp * o->dp);
  int c[NGROUPS] = {0};
  if (st == DOPT_OK) group_colours(o, wt.rank, c);
  for (int g = 0; st == DOPT_OK && g < NGROUPS; g++)
    if (has_group(o, g)) {
      st = dopt_mpi_split(world, c[g], wt.rank, &gc[g]);
      if (st == DOPT_OK) st = dopt_mpi_transport(gc[g], group_slot(&rg, g));
    }
  if (st == DOPT_OK) {
    x->r->rank = wt.rank;
    x->measure_world = &wt;
    st = ce_rank_run(x, wt.rank, &rg);
    x->measure_world = NULL;
  }
  for (int g = NGROUPS - 1; g >= 0; g--) dopt_mpi_destroy(gc[g]);
  dopt_mpi_destroy(world);
  return st;
}

/* Backend mpi, before any collective of the run: every rank's checks (options, input, memory: a rank's own
 * memory or files may differ) agree. mine: this rank's verdict. All pass, or every rank fails: the lowest
 * refusing rank with its own error (*said_elsewhere 0), the others with a status naming it (1). */
static dopt_status mpi_checks_agree(dopt_status mine, int *said_elsewhere) {
  char why[600];
  snprintf(why, sizeof why, "%s", mine != DOPT_OK ? dopt_last_error() : "");
  *said_elsewhere = 0;
  dopt_mpi_comm *world = NULL;
  dopt_status st = dopt_mpi_init(120000, &world);
  dopt_transport wt;
  int lowest = -1;
  if (st == DOPT_OK) st = dopt_mpi_transport(world, &wt);
  if (st == DOPT_OK) st = cmp_lowest_flagged(&wt, mine != DOPT_OK, &lowest);
  dopt_mpi_destroy(world);
  if (st != DOPT_OK) return st;
  if (lowest < 0) return DOPT_OK;
  if (mine != DOPT_OK) {
    *said_elsewhere = wt.rank != lowest;
    return dopt__fail(mine, "%s", why);
  }
  *said_elsewhere = 1;
  return dopt__fail(DOPT_ERR_INVALID_ARG, "rank %d refused the run before it started", lowest);
}

/* The simulator backend: x->o's tp·dp rank threads in one world. */
static dopt_status run_sim(run_ctx *x) {
  const cmp_options *o = x->o;
  dopt_sim_config sc = DOPT_SIM_CONFIG_INIT;
  sc.nranks = o->pp * o->tp * o->dp;
  sc.timeout_ms = 120000; /* rank 0 runs the reference between collectives */
  sc.mode = o->ring_order ? DOPT_SIM_ORDER_RING : DOPT_SIM_ORDER_RANK;
  sc.memops = x->dev ? dopt_cuda_sim_memops() : NULL; /* device buffers on one GPU */
  sc.copy_exchanges = o->copy_exchanges;
  dopt_sim_world *w = NULL;
  dopt_status st = dopt_sim_world_create(&sc, &w);
  if (st == DOPT_OK) {
    dopt_status rs[64];
    st = dopt_sim_launch(w, rank_body, x, rs);
    for (int k = 0; st == DOPT_OK && k < sc.nranks; k++)
      if (rs[k] != DOPT_OK) st = dopt__fail(rs[k], "rank %d: %s", k, dopt_sim_world_rank_error(w, k));
  }
  dopt_sim_world_destroy(w);
  return st;
}

/* --checkpoint-at: steps 1..K in x's layout, saved into dir; K+1..steps in the resume layout ob (stages
 * rstages), loaded from it; run: the backend's (run_sim, or run_mpi in the same processes). */
static dopt_status run_resumed(run_ctx *x, const cmp_options *ob, int *rstages, const char *dir,
                               dopt_status (*run)(run_ctx *)) {
  const cmp_options *o = x->o;
  x->t_last = o->checkpoint_at;
  x->save_dir = dir;
  dopt_status st = run(x);
  run_ctx y = *x;
  y.o = ob;
  y.t_first = o->checkpoint_at + 1;
  y.t_last = o->steps;
  y.save_dir = NULL;
  y.load_dir = dir;
  y.replay = o;
  y.stages = rstages;
  if (st == DOPT_OK) st = run(&y);
  return st;
}

/* --checkpoint-dir, or a fresh directory under $TMPDIR (left for inspection). A given folder holds only this
 * run's generations, each save after its latest (dopt_ckpt_claim, on the template optimizer: the model,
 * optimizer and hyperparameters the save records), or is emptied first (--start-over). */
static dopt_status checkpoint_dir(const cmp_options *o, const dopt_optim *plain, char *dir, size_t cap) {
  if (o->checkpoint_dir[0]) {
    snprintf(dir, cap, "%s", o->checkpoint_dir);
    if (o->start_over) return dopt_ckpt_clear(dir);
    dopt_ckpt_meta *m;
    DOPT_TRY(dopt_ckpt_meta_from_optim(plain, NULL, &m));
    dopt_status st = dopt_ckpt_claim(dir, m, o->checkpoint_at);
    dopt_ckpt_meta_free(m);
    if (st != DOPT_OK) {
      char why[1200];
      snprintf(why, sizeof why, "%s", dopt_last_error());
      return dopt__fail(st, "--checkpoint-dir: %s (another folder, or --start-over to remove its generations first)",
                        why);
    }
    return DOPT_OK;
  }
  const char *tmp = getenv("TMPDIR");
  int w = snprintf(dir, cap, "%s/distopt-ckpt-XXXXXX", tmp && tmp[0] ? tmp : "/tmp");
  if (w < 0 || (size_t)w >= cap) return dopt__fail(DOPT_ERR_INVALID_ARG, "TMPDIR is too long (%d characters)", w);
  if (!mkdtemp(dir)) return dopt__fail(DOPT_ERR_IO, "checkpoint directory '%s': %s", dir, strerror(errno));
  return DOPT_OK;
}


/* The memory this process may use: the least of MemAvailable (/proc/meminfo), the cgroup's room (v2:
 * memory.max less memory.current) and RLIMIT_AS; $DOPT_MEM_AVAILABLE (bytes) replaces all three (tests).
 * *which names the measure that decided; INFINITY when none is known. */
static double mem_available(const char **which) {
  const char *env = getenv("DOPT_MEM_AVAILABLE");
  if (env && *env) {
    char *end;
    const double v = strtod(env, &end);
    if (!*end && v >= 0) {
      *which = "DOPT_MEM_AVAILABLE";
      return v;
    }
  }
  double best = INFINITY;
  *which = "unknown";
  FILE *f = fopen("/proc/meminfo", "r");
  char line[256];
  while (f && fgets(line, sizeof line, f)) {
    unsigned long long kb;
    if (sscanf(line, "MemAvailable: %llu kB", &kb) == 1 && (double)kb * 1024.0 < best)
      best = (double)kb * 1024.0, *which = "MemAvailable in /proc/meminfo";
  }
  if (f) fclose(f);
  unsigned long long max = 0, cur = 0;
  FILE *m = fopen("/sys/fs/cgroup/memory.max", "r"), *c = fopen("/sys/fs/cgroup/memory.current", "r");
  if (m && c && fscanf(m, "%llu", &max) == 1 && fscanf(c, "%llu", &cur) == 1 && max >= cur &&
      (double)(max - cur) < best)
    best = (double)(max - cur), *which = "the cgroup's memory.max less memory.current";
  if (m) fclose(m);
  if (c) fclose(c);
  struct rlimit rl;
  if (getrlimit(RLIMIT_AS, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY && (double)rl.rlim_cur < best)
    best = (double)rl.rlim_cur, *which = "RLIMIT_AS (ulimit -v)";
  return best;
}

/* --model: the least a run holds, in fp32 model copies, against the memory it may use, before anything is
 * allocated (a 7b model at dp 8 would otherwise fail minutes later, or be killed). A lower bound: the
 * reference's parameters and gradient sum, the shared template and the optimizer's states
 * (dopt_optim_state_bytes_for, exact), and the distributed side's parameters (dp copies below ZeRO-3, one at
 * ZeRO-3), every rank's gradients (dp copies: each generates its own) and the states once more. Measured
 * peaks are higher (docs/cli.md "Scale": 13 to 52 copies). */
static dopt_status check_model_memory(const cmp_options *o) {
  if (!o->model[0]) return DOPT_OK;
  cmp_model m;
  DOPT_TRY(cmp_model_parse(o->model, &m));
  double params = 0, states = 0;
  for (int i = 0; i < cmp_model_ntensors(&m); i++) {
    cmp_model_tensor t;
    cmp_model_tensor_at(&m, i, &t);
    double n = 1;
    for (int d = 0; d < t.ndim; d++) n *= (double)t.shape[d];
    params += n;
    size_t b = 0;
    if (dopt_optim_state_bytes_for(o->optimizer, o->hparams, t.ndim, t.shape, &b) == DOPT_OK) states += (double)b;
  }
  const double dp = o->dp > 0 ? o->dp : 1, copies = 3.0 + (o->zero == 3 ? 1.0 : dp) + dp + (o->bf16 ? 1.5 : 0.0);
  const double need = 4.0 * params * copies + 2.0 * states;
  const char *which;
  const double have = mem_available(&which);
  if (need <= have) return DOPT_OK;
  const double gib = 1024.0 * 1024.0 * 1024.0;
  return dopt__fail(DOPT_ERR_NO_MEMORY, "--model %s (%.4g M parameters) at dp %d zero %d holds at least %.2f GiB "
                    "(%.4g fp32 copies of %.3g GiB and %.3g GiB of %s states, twice), more than the %.2f GiB "
                    "available (%s): a smaller model or fewer dp ranks", o->model, params / 1e6, o->dp, o->zero,
                    need / gib, copies, 4.0 * params / gib, states / gib, o->optimizer, have / gib, which);
}

dopt_status cmp_run(const cmp_options *o, cmp_result *r, cmp_progress_fn progress, void *user) {
  memset(r, 0, sizeof *r);
  /* the checks (each rank of backend mpi makes them, then all agree before the run: mpi_checks_agree) */
  dopt_status st = ce_check_options(o);
  if (st == DOPT_OK) st = check_model_memory(o);
  source s;
  memset(&s, 0, sizeof s);
  if (st == DOPT_OK) st = ce_load_source(o, &s);
  if (st == DOPT_OK)
    st = ce_plan_experts(&s,
                      strcmp(o->plugin, "moe_hybrid") == 0 ||
                          (o->checkpoint_at > 0 &&
                           strcmp(o->resume_plugin[0] ? o->resume_plugin : o->plugin, "moe_hybrid") == 0),
                      o->expert_stacks);
  if (st == DOPT_OK) st = plan_tensors(o, &s, r); /* also validates hyperparameters and groups */
  cmp_options ob; /* the resume layout (--checkpoint-at) */
  cmp_resume_options(o, &ob);
  if (st == DOPT_OK) st = ce_check_stacks(o, &s, "");
  if (st == DOPT_OK && o->checkpoint_at > 0) st = ce_check_stacks(&ob, &s, "resume: ");
  /* every parameter's stage in both layouts, before any rank starts (a refusal is one line, no rank prefix) */
  int *stages = st == DOPT_OK ? calloc(2 * (s.np > 0 ? (size_t)s.np : 1), sizeof *stages) : NULL;
  if (st == DOPT_OK && !stages) st = dopt__fail(DOPT_ERR_NO_MEMORY, "compare: stages of %d parameters", s.np);
  int *rstages = stages ? stages + (s.np > 0 ? s.np : 1) : NULL;
  if (st == DOPT_OK) st = plan_stages(o, &s, stages);
  if (st == DOPT_OK && o->checkpoint_at > 0 && plan_stages(&ob, &s, rstages) != DOPT_OK)
    st = dopt__fail(DOPT_ERR_INVALID_ARG, "resume: %s", dopt_last_error());
  if (st == DOPT_OK) r->micro = ce_micro_of(o, &s);
  dopt_device *dev = NULL;
  int devno = 0; /* backend nccl: the local rank's GPU, local rank mod devices (as dopt_nccl_init_env) */
  if (st == DOPT_OK && strcmp(o->backend, "nccl") == 0) {
    dopt_launch_env env;
    st = dopt_launch_env_parse(NULL, NULL, &env);
    int ndev = dopt_cuda_device_count(NULL);
    devno = ndev > 0 ? dopt_launch_device(env.local_rank, ndev) : env.local_rank; /* srun --gpus-per-task 1: 0 */
  }
  if (st == DOPT_OK && strcmp(o->device, "cuda") == 0) st = dopt_device_cuda(devno, &dev);
  run_ctx x = {o, dev, &s, r, progress, user, cmp_now_s(), NULL, 1, o->steps, NULL, NULL, NULL, 0, NULL, stages};
  /* the simulator's rank threads share one template on the source's values (with bf16: its copies) */
  dopt_optim *tmpl = NULL;
  uint16_t **twork = st == DOPT_OK ? calloc(s.np > 0 ? (size_t)s.np : 1, sizeof *twork) : NULL;
  if (st == DOPT_OK && !twork) st = dopt__fail(DOPT_ERR_NO_MEMORY, "compare: %d parameters", s.np);
  if (st == DOPT_OK && strcmp(o->backend, "sim") == 0) st = ce_build_plain(o, &s, 1, NULL, twork, &tmpl);
  x.plain = tmpl;
  char mpi_dir[600] = ""; /* backend mpi with a resume: the folder, claimed among the checks every process makes */
  if (st == DOPT_OK && strcmp(o->backend, "mpi") == 0 && o->checkpoint_at > 0) {
    dopt_optim *whose = NULL; /* the folder's identity check needs the run's optimizer: built for it alone */
    st = ce_build_plain(o, &s, 1, NULL, twork, &whose);
    if (st == DOPT_OK) st = checkpoint_dir(o, whose, mpi_dir, sizeof mpi_dir);
    dopt_optim_destroy(whose);
  }
  int said_elsewhere = 0;
  if (strcmp(o->backend, "mpi") == 0) st = mpi_checks_agree(st, &said_elsewhere); /* every rank, even refusing */
  const int before_work = st != DOPT_OK;
  if (st == DOPT_OK && strcmp(o->backend, "nccl") == 0) {
    st = run_nccl(&x);
    r->seconds = cmp_now_s() - x.t0;
  } else if (st == DOPT_OK && strcmp(o->backend, "mpi") == 0 && o->checkpoint_at > 0) {
    /* the same processes save into --checkpoint-dir (every process sees it) and resume in as many ranks */
    st = run_resumed(&x, &ob, rstages, mpi_dir, run_mpi);
    r->seconds = cmp_now_s() - x.t0;
  } else if (st == DOPT_OK && strcmp(o->backend, "mpi") == 0) {
    st = run_mpi(&x);
    r->seconds = cmp_now_s() - x.t0;
  } else if (st == DOPT_OK && o->checkpoint_at > 0) {
    char dir[600];
    st = checkpoint_dir(o, tmpl, dir, sizeof dir);
    if (st == DOPT_OK) st = dopt__mkdir_p(dir); /* a folder that cannot be made: said before the steps run */
    if (st == DOPT_OK) st = run_resumed(&x, &ob, rstages, dir, run_sim);
    r->seconds = cmp_now_s() - x.t0;
  } else if (st == DOPT_OK) {
    st = run_sim(&x);
    r->seconds = cmp_now_s() - x.t0;
  }
  dopt_optim_destroy(tmpl);
  free(stages);
  for (int i = 0; twork && i < s.np; i++) free(twork[i]);
  free(twork);
  dopt_device_cuda_destroy(dev);
  ce_source_free(&s);
  if (st != DOPT_OK) {
    cmp_result_free(r);
    r->run_failed = x.save_failed;
    r->before_work = before_work;
    r->said_elsewhere = said_elsewhere;
    return st;
  }
  r->declared_ulp = cmp_declared_ulp(o->optimizer);
  r->equivalent = r->skipped_ref == r->skipped_dist;
  for (int k = 0; k < r->ntensors; k++) r->equivalent &= r->t[k].max_ulp <= r->declared_ulp;
  r->equivalent &= r->drift_step == 0 && r->counter_step == 0 && r->events_step == 0;
  return DOPT_OK;
}

void cmp_result_free(cmp_result *r) {
  for (int k = 0; k < r->ntensors; k++) {
    free(r->t[k].abs_per_step);
    free(r->t[k].ulp_per_step);
  }
  free(r->t);
  free(r->refresh_steps);
  memset(r, 0, sizeof *r);
}
