/* Equivalence harness for the distributed optimizers: the same seeded
 * micro-batch gradients drive the single-device reference (main thread) and
 * the distributed optimizer on the simulator (tp·dp rank threads); results
 * are compared bit for bit. Rank bodies never assert: they return a status
 * and leave their gathered tensors in per-run buffers. */
#ifndef DOPT_DISTTEST_H
#define DOPT_DISTTEST_H

#include <stddef.h>
#include <stdint.h>

#include "distopt/dist.h"
#include "distopt/sim.h"

#define DT_MAXP 16
#define DT_MAXS 16
#define DT_MAXCK 16

typedef struct dt_param {
  const char *name;
  int ndim;
  int64_t shape[4];
  dopt_tp_role role;
  int group; /* 0 or 1 (group 1: the "no decay" overrides) */
} dt_param;

typedef struct dt_case {
  const char *optimizer;
  const char *hparams;   /* group 0 */
  const char *group1;    /* overrides of group 1 (NULL: "weight_decay=0") */
  const dt_param *params;
  int nparams;
  int steps;
  int micro;             /* micro-batches per step */
  double max_grad_norm;  /* 0: off */
  int bf16;              /* bf16 working params with fp32 masters */
  uint64_t seed;
  double grad_scale;
  int nan_step;          /* a NaN in one gradient at this step (0: none) */
  int check_every;       /* compare every k steps (and after the last) */
  int dp_sum;            /* 0: the default exact dp sum; 1, 2: exact with that many words; -1: rank-order fp32 */
  int ring_order;        /* the simulator sums in ring order (DOPT_SIM_ORDER_RING) */
  int wide;              /* every element its own fixed scale 2^0..2^-63: beyond one dp-sum word's exact
                            range (2^35 below a block's maximum), so the shared block grid decides bits */
  int apply_nonfinite;   /* NaN/inf gradients are applied (dopt_dist_config.skip_nonfinite = 0) */
  int batch_invariant;   /* dopt_dist_config.batch_invariant: every micro-batch a part of the exact sum */
} dt_case;

/* Set by a test on its main thread before dt_run_dist (read only on the rank threads): the transports lack
 * reduce and all_to_allv, as an older or minimal backend (distributed/'s fallbacks). */
extern int dt_basic_transport;
/* Set likewise: every step runs through dopt__step_on_host (download, the CPU step on host copies, upload), as
 * the CUDA device runs the steps it has no kernel for. */
extern int dt_host_steps;

/* Planted bugs, set by a test on its main thread before dt_run_dist: the distributed side runs this
 * implementation instead of the registry's (the reference keeps the registry's), or steps after every
 * micro-batch instead of once per step (an optimizer step per micro-batch, as a gradient hook would). */
struct dopt_optim_impl;
extern const struct dopt_optim_impl *dt_dist_impl;
extern int dt_step_per_micro;
/* The world rank of the calling rank thread (-1 elsewhere): what a planted bug keys on to differ per rank. */
extern _Thread_local int dt_thread_rank;

/* The plain (single-device) optimizer of a case with its initial values:
 * data[i] (fp32; with bf16 the master), work[i] (bf16 or NULL), updated in
 * place by the optimizer: free them after it. */
dopt_status dt_build_plain(const dt_case *c, float **data, float **master, uint16_t **work, dopt_optim **out);

/* The dopt_dist_config.dp_sum_words of a case. */
int dt_dp_words(const dt_case *c);

typedef struct dt_layout {
  int tp, dp, zero;
  size_t bucket_bytes; /* dopt_dist_config.bucket_bytes (0: one bucket) */
} dt_layout;

/* Set by a test on its main thread before dt_run_dist: pipeline stages (0 or 1: none), the world
 * dt_pp × tp × dp, parameter i on stage dt_stage(i, nparams, dt_pp). */
extern int dt_pp;
/* Set likewise: Gemini's chunk size (0: per-tensor ZeRO); the layout's zero must be 3, the plugin is gemini. */
extern size_t dt_chunk;
/* Set likewise: MoE-Hybrid (plugin moe_hybrid, docs/distributed.md "MoE-Hybrid"): expert parallelism dt_ep
 * (0 or 1: none; it must divide the layout's dp), dt_experts[i] parameter i's expert id (-1 dense,
 * DOPT_DIST_EXPERT_STACK a stack of all dt_nexperts along dimension 0: each rank's gradient counts for its ep
 * rank's experts only, summed over dp, divided by moe_dp · micro) of dt_nexperts. Both the reference and the distributed run sum an expert's gradient over the dp ranks of its ep
 * rank (dopt_dist_expert_rank; dp rank = moe_dp rank · ep + ep rank) and divide by moe_dp · micro. */
extern int dt_ep;
extern const int *dt_experts;
extern int dt_nexperts;

/* The stage of parameter i of n under pp stages: contiguous runs of the parameter list, as balanced as n
 * allows (the test's explicit map, dopt_dist_config.stages). */
int dt_stage(int i, int n, int pp);

#define DT_MAXRANKS 64

/* Results of one run at the checkpoints: parameters, bf16 working copies,
 * states (by name), step counters; plus skipped steps. */
typedef struct dt_result {
  int nck;
  int ck_step[DT_MAXCK];
  float *param[DT_MAXCK][DT_MAXP];
  uint16_t *work[DT_MAXCK][DT_MAXP];
  int nstates[DT_MAXP];
  char state_name[DT_MAXP][DT_MAXS][32];
  size_t state_bytes[DT_MAXP][DT_MAXS]; /* the reference's (8-bit codes, quantised projectors: not fp32) */
  float *state[DT_MAXCK][DT_MAXP][DT_MAXS]; /* state_bytes bytes (NULL: not allocated at that checkpoint) */
  int64_t step[DT_MAXCK][DT_MAXP];
  int64_t skipped;
  int64_t stat_collectives[DT_MAXRANKS]; /* dopt_dist_stat_collectives of each world rank after the run */
  /* every collective each world rank's dopt_dist_step calls issued over the run, by kind (its tp and dp
   * communicators together; a group of one counts as the simulator counts it) */
  uint64_t step_ops[DT_MAXRANKS][DOPT_SIM_KIND_COUNT];
  size_t state_mem[DT_MAXRANKS];         /* dopt_dist_memory_usage().state_bytes of each world rank */
  size_t ref_state_mem;                  /* the reference's allocated state bytes at the end */
  /* Each world rank's piece of each parameter (dopt_dist_layout), distributed runs only (nlayout ranks; 0: the
   * reference): dt_compare checks that they obey the layout rule (dopt_layout_cover) for every parameter. */
  int nlayout;
  dopt_layout_piece layout[DT_MAXRANKS][DT_MAXP];
  /* Every rank's own copy (distributed runs only): at each checkpoint every
   * rank digests what it gathered of each parameter (values, bf16 copy, step
   * counter, states) and dopt_dist_check_replicas compares the digests with
   * rank 0's, whose values dt_compare compares with the reference in full: a
   * replica that drifts on one rank cannot hide behind rank 0. The first
   * checkpoint where some rank differed (0: none), that world rank and the
   * parameter's index. */
  int drift_step, drift_rank, drift_param;
  /* Counters (dopt_counters). The reference's run fills counts: [(steps + 1) · nparams · DOPT_NCOUNTERS], each
   * step's counts (its totals' change; row 0 unused). A distributed run reads ref_counts (set it to the
   * reference's counts before the run, or NULL: not checked) and checks them after every step with
   * dopt_dist_check_counters; the first difference: step (0: none), parameter, counter, world rank (-1: the
   * total over the pieces) and both counts. */
  int64_t *counts;
  const int64_t *ref_counts;
  int counter_step, counter_param, counter_id, counter_rank;
  int64_t counter_ref, counter_dist;
} dt_result;

/* The plugin name the layout belongs to. */
const char *dt_plugin(const dt_layout *l);

/* Runs the reference on the dp-average of the micro-batch gradients of dp
 * data-parallel ranks (their dp sum as dopt_dp_sum computes it). */
dopt_status dt_run_reference(const dt_case *c, int dp, dt_result *out);
/* The same, resumed: steps t_first..c->steps after dopt_optim_load(load_dir) (NULL, 1: dt_run_reference). */
dopt_status dt_run_reference_from(const dt_case *c, int dp, const char *load_dir, int t_first, dt_result *out);
/* Runs the distributed optimizer on tp·dp simulated ranks. */
dopt_status dt_run_dist(const dt_case *c, const dt_layout *l, dt_result *out, char *err, size_t errcap);
/* Steps t_first..t_last only, after loading a checkpoint (load_dir, or NULL)
 * and saving one after the last (save_dir, or NULL): dopt_dist_load/_save. */
dopt_status dt_run_dist_steps(const dt_case *c, const dt_layout *l, int t_first, int t_last, const char *load_dir,
                              const char *save_dir, dt_result *out, char *err, size_t errcap);
/* Compares two results bitwise; returns 0 if identical, else writes the first
 * difference (checkpoint, tensor, index, values, ULP) into msg. */
int dt_compare(const dt_case *c, const dt_result *ref, const dt_result *got, char *msg, size_t cap);
/* Prepares got for a distributed run compared with ref: the reference's state names (the layout the gathers
 * read) and its per-step counters (checked after every step). */
void dt_expect(dt_result *got, const dt_result *ref);
/* Runs the distributed side (dt_expect, dt_run_dist; counters 0: the counters not checked) and compares it
 * with ref: 0 when identical, else 1 with the failure or the first difference in msg. */
int dt_diverges(const dt_case *c, const dt_layout *l, const dt_result *ref, int counters, char *msg, size_t cap);
void dt_result_free(dt_result *r);

/* The deterministic micro-batch gradient of parameter p (logical, numel
 * elements) at (step, micro, dp rank). */
void dt_gradient(const dt_case *c, int p, int step, int micro, int dprank, float *out);

#endif
