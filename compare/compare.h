/* The equivalence harness behind `distopt compare`: runs a registered
 * optimizer under a plugin and layout on the collective simulator beside the
 * single-device reference, on the same gradients, and measures per step and
 * per tensor how far the gathered distributed parameters and states are from
 * the reference (max abs error, max ULP distance, first divergent step). */
#ifndef DOPT_COMPARE_H
#define DOPT_COMPARE_H

#include <stdint.h>
#include <stdio.h>

#include "distopt/digest.h"
#include "distopt/dist.h"
#include "distopt/distopt.h"

#define CMP_MAX_PARAMS 32
#define CMP_MAX_GROUPS 8

typedef struct cmp_param {
  char name[64];
  int ndim;
  int64_t shape[DOPT_MAX_DIMS];
  dopt_tp_role role;
} cmp_param;

typedef struct cmp_options {
  char optimizer[32];
  char hparams[512];                      /* group 0: "k=v,..." */
  int ngroups;                            /* extra groups: parameters matching glob get hp overrides */
  char group_glob[CMP_MAX_GROUPS][64];
  char group_hp[CMP_MAX_GROUPS][256];
  char plugin[16];                        /* ddp, zero, hybrid, fsdp */
  int tp, dp, zero;
  int ranks;                              /* world size asked for (0: tp·dp); must equal tp·dp */
  int steps;
  int micro;                              /* micro-batches per step (gradient accumulation) */
  double max_grad_norm;                   /* 0: no clipping */
  int bf16;                               /* bf16 working parameters with fp32 masters */
  char source[16];                        /* "synthetic" or "trace" */
  char trace_path[512];
  uint64_t seed;                          /* synthetic gradients */
  char json_path[512];                    /* "" = none */
  char svg_path[512];                     /* "" = none */
  int quiet;                              /* no progress line */
  char backend[8];                        /* "sim" (threads, one process), "nccl" or "mpi" (one process per rank) */
  char device[8];                         /* "cpu" or "cuda" */
  int ring_order;                         /* simulate a ring all-reduce's summation order (what a real
                                             NCCL order changes: with --dp-sum rank-order not bitwise for dp >= 3) */
  int dp_sum_words;                       /* the dp gradient sum: 1 or 2 = exact with that many int64 words
                                             (distopt/dpsum.h), 0 = fp32 in the transport's order */
  int batch_invariant;                    /* every micro-batch on the grid: bits independent of dp × accumulation */
  int checkpoint_at;                      /* > 0: save after this step and resume in the resume layout */
  char resume_plugin[16];                 /* "" / 0 / -1 (zero): the first layout's */
  int resume_tp, resume_dp, resume_zero;
  char checkpoint_dir[512];               /* "" : a fresh directory under $TMPDIR */
} cmp_options;

/* --dp-sum / plugin.dp_sum names: "exact" (1 word), "exact2" (2 words),
 * "rank-order" (0); -1 for anything else. */
int cmp_parse_dp_sum(const char *name);
const char *cmp_dp_sum_name(int words);

/* Defaults: adafactor, hybrid tp2 × dp2 × zero2, 100 steps, synthetic. */
void cmp_options_default(cmp_options *o);

/* Per tensor ("fc1.weight" or "fc1.weight/exp_avg"), over the steps run. */
typedef struct cmp_tensor_stat {
  char name[128];
  int is_state;
  double max_abs;          /* max |dist - ref| over all elements and steps */
  uint64_t max_ulp;        /* max ULP distance (0 = bitwise equal) */
  int first_diff;          /* first step with any bit difference (+0 vs -0 counts as 1 ULP; 0: never);
                              bitwise = max_ulp == 0 && first_diff == 0 */
  double *abs_per_step;    /* [steps]: max |dist - ref| after step t+1 */
  uint64_t *ulp_per_step;  /* [steps] */
  dopt_dtype dtype;        /* the logical layout (plan_tensors), what the digest records */
  int ndim;
  int64_t shape[DOPT_MAX_DIMS];
} cmp_tensor_stat;

typedef struct cmp_result {
  int steps;               /* steps run */
  int ntensors;
  cmp_tensor_stat *t;
  int64_t skipped_ref, skipped_dist;
  double seconds;
  uint64_t declared_ulp;   /* the optimizer's declared tolerance (0: bitwise) */
  int equivalent;          /* every tensor within declared_ulp at every step, same skips */
  int rank;                /* this process's rank (backends nccl, mpi); only rank 0 reports (nccl: only it
                              measures; mpi: every rank measures, merged onto every rank) */
  int micro;               /* micro-batches per step actually used (with a trace: its shards / dp) */
  /* SHA-256 (docs/digest.md) of the final logical tensors, per parameter in r->t order: the
   * parameter, its bf16 copy, its states, then its step count ("<p>/step", I64 scalar); of the
   * distributed run (gathered) and of the reference. "" when not measured (backend nccl, rank > 0). */
  char digest[DOPT_DIGEST_HEX], ref_digest[DOPT_DIGEST_HEX];
} cmp_result;

typedef void (*cmp_progress_fn)(int step, int steps, double elapsed, uint64_t worst_ulp, void *user);

/* Runs the comparison. Bad options or input (unknown optimizer, plugin or
 * key, ranks ≠ tp·dp, unreadable/malformed trace) return an error with
 * dopt_last_error() naming it; progress may be NULL. */
dopt_status cmp_run(const cmp_options *o, cmp_result *r, cmp_progress_fn progress, void *user);
void cmp_result_free(cmp_result *r);

/* The declared tolerance of an optimizer, in ULP (0 = bitwise). */
uint64_t cmp_declared_ulp(const char *optimizer);

/* YAML configuration (compare/config.c, libyaml), in the shape of ms-swift's
 * optimizer configs:
 *   optimizer: {type: came, lr: 2e-4, weight_decay: 0.01}
 *   groups: [{params: "*bias", weight_decay: 0}]          # optional
 *   plugin: {type: hybrid, tp: 2, dp: 2, zero: 2}         # also backend: sim|nccl|mpi, device: cpu|cuda
 *   steps: 100
 *   accumulation: 1                                        # optional
 *   max_grad_norm: 1.0                                     # optional
 *   bf16: false                                            # optional
 *   gradients: {source: synthetic, seed: 1} | {source: trace, path: FILE}
 *   output: {json: FILE, plot: FILE.svg}                   # optional
 * Loads into o (on top of its current values). Unknown keys, wrong types,
 * duplicate keys and malformed YAML are DOPT_ERR_FORMAT with
 * "FILE:LINE: dotted.key: problem"; an unreadable file is DOPT_ERR_IO. o is
 * unchanged on error. */
dopt_status cmp_load_yaml(const char *path, cmp_options *o);

/* Reports (compare/report.c). */
void cmp_print_table(FILE *f, const cmp_options *o, const cmp_result *r);
dopt_status cmp_write_json(const char *path, const cmp_options *o, const cmp_result *r);
dopt_status cmp_write_svg(const char *path, const cmp_options *o, const cmp_result *r);

#endif
