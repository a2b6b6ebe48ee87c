/* The equivalence engine's own parts (compare/; not installed): what its files share.
 *   options.c  the options: defaults, groups, dp-sum names, the plugins' layouts (cmp_apply_plugin), the checks
 *   source.c   the gradient sources: synthetic (portable and vectorised generators), a trace, a recording;
 *              the data-parallel shards and micro-batches they give, the experts and expert stacks
 *   rank.c     one rank's run: the distributed optimizer and (on the lead) the reference side by side, each
 *              step measured, checked and (at the end) digested
 *   measure.c  the measurement of one tensor against the reference's (max abs, ULPs, first divergent step)
 *              and its merge over the ranks (backend mpi); the clock (cmp_now_s)
 *   engine.c   the plan (tensors, stages) and the launch: the simulator, MPI or NCCL world, checkpoints, cmp_run
 * The CLI (cli/) uses compare.h only. */
#ifndef DOPT_COMPARE_HARNESS_H
#define DOPT_COMPARE_HARNESS_H

#include <pthread.h>

#include "compare.h"
#include "distopt/safetensors.h"
#include "verify.h"

/* A recording (docs/verify.md) read as a trace: one reader (one open file per rank) shared by the
 * rank threads, so every read goes through the lock. */
typedef struct rec_source {
  vr_reader rd;
  pthread_mutex_t mu;
} rec_source;

typedef struct source {
  int np;
  cmp_param *p;        /* [np] */
  size_t *numel;       /* [np] */
  float **init;        /* [np]: the initial values, whole (the shared template's data) */
  dopt_st_file *trace; /* a single-file trace (NULL: none) */
  rec_source *rec;     /* a recording (NULL: none); neither: synthetic */
  int shards;          /* trace or recording (1): shards per step; 0: synthetic */
  uint64_t seed;
  int fast;            /* --model: the vectorised generator (ce_synth_fast) */
  float **trig;        /* fast: [np], per parameter its [rows] sin(0.7 r + 0.3), [rows] sin(0.45 r + 1.1),
                          [w] cos(0.4 c), [w] cos(1.3 c + 0.5) as floats (rows = b · h, dopt_piece_full) */
  int *expert;         /* [np] the expert id of a parameter named "experts.<e>." (cmp_expert_of), else -1 */
  int nexperts;        /* the largest id + 1 (0: a dense model) */
} source;

/* One comparison world's run, shared by its ranks (rank threads, or a process per rank). */
typedef struct run_ctx {
  const cmp_options *o;
  const dopt_device *dev; /* NULL: the CPU */
  const source *s;
  cmp_result *r;
  cmp_progress_fn progress;
  void *user;
  double t0;
  const dopt_transport *measure_world; /* backend mpi: every rank measures; merged over this world */
  /* --checkpoint-at: the steps this world runs, where it saves or loads */
  int t_first, t_last;          /* 1 and o->steps without a checkpoint */
  const char *save_dir;         /* save after t_last */
  const char *load_dir;         /* load before t_first */
  const cmp_options *replay;    /* the options of the steps before t_first: the lead's reference replays them */
  int save_failed;              /* rank 0: writing the checkpoint failed (a full disk): the run's failure */
  const dopt_optim *plain;      /* the template every rank thread reads (NULL: each process builds its own) */
  const int *stages;            /* [np] every parameter's pipeline stage in this world's layout (plan_stages) */
} run_ctx;

/* One rank's groups (either backend): tp, dp, pp, and moe_hybrid's ep and moe_dp (size 1: none). */
typedef struct rank_groups {
  dopt_transport tp, dp, pp, ep, mdp;
} rank_groups;


/* ---- options.c ---- */
dopt_status ce_check_options(const cmp_options *o);

/* ---- source.c ---- */
dopt_status ce_check_stacks(const cmp_options *o, const source *s, const char *what);
int ce_ep_stack(const cmp_options *o, const source *s, int i);
void ce_grad_key(char *key, size_t cap, int t, int sh, const char *name);
int ce_holds_param(const cmp_options *o, const source *s, int i, int d);
dopt_status ce_load_source(const cmp_options *o, source *s);
int ce_micro_of(const cmp_options *o, const source *s);
int ce_moe_of(const cmp_options *o, const source *s);
void ce_own_experts_only(const cmp_options *o, const source *s, int i, int d, float *g);
dopt_status ce_plan_experts(source *s, int moe, const char *stacks);
dopt_status ce_shard_grad(const source *s, int i, int step, int shard, float *out);
int ce_shard_of(const cmp_options *o, const source *s, int d, int m);
void ce_source_free(source *s);
void ce_synth_block(const source *s, int i, int step, int shard, size_t h0, size_t hl, size_t w0, size_t wl, float *out);
void ce_synth_fast(const source *s, int i, int step, int shard, size_t h0, size_t hl, size_t w0, size_t wl, float *out);

/* ---- measure.c ---- */
void ce_measure(cmp_tensor_stat *ts, int t, const float *ref, const float *got, size_t n);
void ce_measure_bytes(cmp_tensor_stat *ts, int t, const void *ref, const void *got, size_t bytes);
void ce_measure_mismatch(cmp_tensor_stat *ts, int t);
dopt_status ce_merge_measurements(const dopt_transport *w, cmp_result *r, int steps);

/* ---- rank.c ---- */
dopt_status ce_build_plain(const cmp_options *o, const source *s, int dist, float **data, uint16_t **work, dopt_optim **out);
dopt_status ce_rank_run(run_ctx *x, int rank, const rank_groups *rg);

#endif
