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

/* Hostile-input bounds, not sizes of fixed tables (both grow as needed):
 * parameters of a trace or recording (a 70B LLaMA has 723), extra groups. */
#define CMP_MAX_PARAMS 1000000
#define CMP_MAX_GROUPS 1024
#define CMP_GLOB_MAX 256 /* a group's glob, bytes with the terminator */
#define CMP_GROUP_HP_MAX 512

typedef struct cmp_param {
  char name[64];
  int ndim;
  int64_t shape[DOPT_MAX_DIMS];
  dopt_tp_role role;
} cmp_param;

/* An extra parameter group: parameters matching glob (fnmatch) get hp's overrides. */
typedef struct cmp_group {
  char glob[CMP_GLOB_MAX];
  char hp[CMP_GROUP_HP_MAX];
} cmp_group;

/* Gemini's chunk when --chunk-size is not given: 2^20 elements (4 MiB of fp32). */
#define CMP_GEMINI_CHUNK_DEFAULT ((size_t)1 << 20)
/* --chunk-size at most this (2^40 elements). */
#define CMP_CHUNK_MAX ((size_t)1 << 40)

/* --pp at most this (a world is at most 64 ranks). */
#define CMP_PP_MAX 64

typedef struct cmp_options {
  char optimizer[32];
  char hparams[512];                      /* group 0: "k=v,..." */
  int ngroups;                            /* extra groups, first match wins */
  cmp_group *groups;                      /* [ngroups], heap; owned by the options (cmp_options_free): a
                                             struct copy shares it (read only) */
  char plugin[16];                        /* ddp, zero, hybrid, fsdp, gemini, moe_hybrid */
  int tp, dp, zero;
  int pp;                                 /* pipeline stages (hybrid only; 1: none): the world is pp x tp x dp */
  int layers_per_stage[CMP_PP_MAX];       /* --layers-per-stage (plugin.layers_per_stage): decoder layers per
                                             stage; nlps 0: ColossalAI's default partition */
  int nlps;
  size_t chunk_size;                      /* --chunk-size (plugin.chunk_size): Gemini's chunk in elements (0: the
                                             default CMP_GEMINI_CHUNK_DEFAULT with plugin gemini) */
  int ep;                                 /* --ep (plugin.ep): moe_hybrid's expert parallelism, dividing dp
                                             (moe_dp = dp / ep); 1: none */
  char expert_stacks[CMP_GLOB_MAX];       /* --expert-stacks GLOB (plugin.expert_stacks): the >= 3-D parameters that
                                             are stacks of every expert along dim 0 (fnmatch); "": by name
                                             (cmp_stack_of) */
  int ranks;                              /* world size asked for (0: pp·tp·dp); must equal pp·tp·dp */
  int steps;
  int micro;                              /* micro-batches per step (gradient accumulation) */
  double max_grad_norm;                   /* 0: no clipping */
  int bf16;                               /* bf16 working parameters with fp32 masters */
  char source[16];                        /* "synthetic" or "trace" */
  char model[48];                         /* synthetic: "" the built-in small transformer, or --model's
                                             preset or size (compare/model.h) */
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
  int resume_pp;                          /* 0: the first layout's (the resume world's layer partition: ColossalAI's
                                             default, or layers_per_stage when pp is unchanged) */
  size_t resume_chunk_size;               /* 0: the first layout's (a gemini resume layout) */
  int resume_ep;                          /* 0: the first layout's where the resume plugin is moe_hybrid, else 1 */
  char checkpoint_dir[512];               /* "" : a fresh directory under $TMPDIR */
  int start_over;                         /* --start-over: checkpoint_dir's generations are removed first */
  unsigned given;                         /* CMP_GIVEN_* bits: the layout values the user gave (CLI or YAML) */
  unsigned given_yaml;                    /* those of them the YAML file gave (spelling of a contradiction) */
  int sweep;                              /* --sweep: every tp in 1..max_tp x dp in 1..max_dp x zero 0..3 */
  int max_tp, max_dp;                     /* --max-tp, --max-dp (default 4, at most CMP_SWEEP_MAX) */
  int max_pp;                             /* --max-pp (default 1: no stages; pp > 1 layouts are hybrid, zero 0-2) */
  int threads;                            /* --threads: the reference's step threads (0: the library's default
                                             with the simulator, 1 with a process per rank) */
  const struct dopt_optim_impl *dist_impl; /* tests only (no option or key): the distributed side's optimizer,
                                             a planted bug; NULL: the registry's, as the reference */
  int copy_exchanges;                     /* tests only (no option or key): the simulator copies every exchange
                                             (dopt_sim_config.copy_exchanges) instead of offering reads in place */
} cmp_options;

/* ColossalAI's default layer partition (Policy.distribute_layers): per[k] = L div pp, and the L mod pp remaining
 * layers one each to stages pp/2 - (L mod pp)/2 on. per[pp]. */
void cmp_layers_per_stage(long L, int pp, long *per);

/* The expert id of a parameter named "...experts.<e>...." (a whole name component "experts" followed by a
 * number of 1-5 digits and a dot: Hugging Face Mixtral's block_sparse_moe.experts.3.w1.weight), else -1. */
int cmp_expert_of(const char *name);
/* Whether a parameter is a stack of every expert along dimension 0: a whole name component "experts" followed by
 * a component that is not a number (model.layers.0.mlp.experts.gate_proj), at least 3-D. */
int cmp_stack_of(const char *name, int ndim);

/* "3,5,4": the decoder layers of each pipeline stage (--layers-per-stage, plugin.layers_per_stage) into o. */
dopt_status cmp_parse_layers_per_stage(const char *v, cmp_options *o);

/* The layout values a user can give; the ones not given follow from the
 * plugin (cmp_apply_plugin). */
enum {
  CMP_GIVEN_PLUGIN = 1u << 0,        /* --plugin, plugin.type */
  CMP_GIVEN_TP = 1u << 1,            /* --tp, plugin.tp */
  CMP_GIVEN_DP = 1u << 2,            /* --dp, plugin.dp */
  CMP_GIVEN_ZERO = 1u << 3,          /* --zero, plugin.zero */
  CMP_GIVEN_RESUME_PLUGIN = 1u << 4, /* --resume-plugin, checkpoint.resume.type */
  CMP_GIVEN_RESUME_TP = 1u << 5,     /* --resume-tp, checkpoint.resume.tp */
  CMP_GIVEN_RESUME_DP = 1u << 6,     /* --resume-dp, checkpoint.resume.dp */
  CMP_GIVEN_RESUME_ZERO = 1u << 7    /* --resume-zero, checkpoint.resume.zero */
};

/* --max-tp / --max-dp (compare.max_tp / max_dp) at most this. */
#define CMP_SWEEP_MAX 8

/* Completes the layouts from what the plugins imply (docs/cli.md, "Plugins
 * and layouts"), for the values o->given does not name:
 *   ddp: tp 1, zero 0 (only those); zero: tp 1 (only), zero 1 (1 or 2, as
 *   ColossalAI's LowLevelZeroPlugin); hybrid: tp 2, zero 2 (zero 0-2, any tp);
 *   fsdp: tp 2, zero 3 (only 3, any tp).
 * Without a plugin given it is hybrid, or fsdp when the zero given is 3. The
 * resume layout (--resume-*) keeps the first layout's values where its plugin
 * allows them, otherwise takes what that plugin implies; without a resume
 * plugin given it is the first layout's plugin, or the one that expresses
 * the resume values given (cmp_layout_plugin). A given value the given
 * plugin does not allow is DOPT_ERR_INVALID_ARG naming both options, their
 * values and what the plugin implies; an unknown plugin DOPT_ERR_NOT_FOUND.
 * o is unchanged on error. */
dopt_status cmp_apply_plugin(cmp_options *o);
/* The layout a --checkpoint-at run resumes in (*ob: o with the resume values completed): each --resume-* value
 * where given, else the first layout's where the resume plugin has it; a plugin without stages (all but hybrid)
 * resumes with pp 1 and one without experts (all but moe_hybrid) with ep 1; Gemini's chunk its own. */
void cmp_resume_options(const cmp_options *o, cmp_options *ob);

/* The plugin that expresses tp x zero directly: zero 3 fsdp; tp 1: ddp
 * (zero 0) or zero (zero 1, 2); otherwise hybrid. */
const char *cmp_layout_plugin(int tp, int zero);
/* The plugins' names from the library's table, "ddp, zero, ... or moe_hybrid", into buf (cut to cap). */
void cmp_plugin_names(char *buf, size_t cap);

/* --dp-sum / plugin.dp_sum names: "exact" (1 word), "exact2" (2 words),
 * "rank-order" (0); -1 for anything else. */
int cmp_parse_dp_sum(const char *name);
const char *cmp_dp_sum_name(int words);

/* Defaults: adafactor, hybrid tp2 × dp2 × zero2, 100 steps, synthetic. */
void cmp_options_default(cmp_options *o);
/* Appends a group (glob: its first glob_len bytes): DOPT_ERR_INVALID_ARG naming the limit when the
 * glob, the hyperparameters or the count are too long or many; o unchanged on error. */
dopt_status cmp_options_add_group(cmp_options *o, const char *glob, size_t glob_len, const char *hp);
/* Frees what the options own (the groups); o is then empty of groups. */
void cmp_options_free(cmp_options *o);

/* Per tensor ("fc1.weight" or "fc1.weight/exp_avg"), over the steps run. */
typedef struct cmp_tensor_stat {
  char name[128];
  int is_state;
  double max_abs;          /* max |dist - ref| over all elements and steps */
  uint64_t max_ulp;        /* max ULP distance (0 = bitwise equal) */
  int first_diff;          /* first step with any bit difference (+0 vs -0 counts as 1 ULP; 0: never);
                              bitwise = max_ulp == 0 && first_diff == 0 */
  uint64_t nan_pairs;      /* most elements NaN on both sides after one step: equal under the NaN policy
                              (docs/nan-policy.md), whatever their sign and payload bits */
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
  /* CPU over the steps after the first (setup and first touches excluded), cpu_steps of them: the process's, and
   * the lead thread's in the reference's own work — its dp · micro gradients, their exact sum, its optimizer step
   * (all of it with --threads 1; with more, the reference's pool threads are not in it) */
  double cpu_process, cpu_reference;
  int cpu_steps;
  uint64_t declared_ulp;   /* the optimizer's declared tolerance (0: bitwise) */
  int equivalent;          /* every tensor within declared_ulp at every step, same skips */
  int rank;                /* this process's rank (backends nccl, mpi); only rank 0 reports (nccl: only it
                              measures; mpi: every rank measures, merged onto every rank) */
  int micro;               /* micro-batches per step actually used (with a trace: its shards / dp) */
  int run_failed;          /* cmp_run failed in what the run wrote (a checkpoint: a full disk), not on its
                              options or input (both exit 2); set on failure only */
  int before_work;         /* set on failure: refused by its checks before any rank started work; with a process
                              per rank (backend mpi) every rank then fails alike, none waits in a collective */
  int said_elsewhere;      /* with before_work under mpi: the lowest refusing rank prints the line, not this one */
  /* SHA-256 (docs/digest.md) of the final logical tensors, per parameter in r->t order: the
   * parameter, its bf16 copy, its states, then its step count ("<p>/step", I64 scalar); of the
   * distributed run (gathered) and of the reference. "" when not measured (backend nccl, rank > 0). */
  char digest[DOPT_DIGEST_HEX], ref_digest[DOPT_DIGEST_HEX];
  /* Every rank's own copy after every step (dopt_dist_check_replicas on per-tensor digests):
   * the first step at which some rank's copy differed from rank 0's (0: never), that rank
   * and the tensor ("<p>/step" for a step counter). */
  int drift_step, drift_rank;
  char drift_tensor[160];
  /* The step counters of the distributed run against the reference's, every step: the
   * first mismatch (0: none), its parameter and both counts. */
  int counter_step;
  char counter_param[128];
  int64_t counter_ref, counter_dist;
  /* The counters (dopt_counters: what each parameter's step did) against the reference's after every
   * step (dopt_dist_check_counters): the first difference (0: none), its parameter, counter, world rank
   * (-1: a SUM counter's total over the pieces) and both counts; the reference's totals per counter over
   * the steps run (summed over parameters); the steps at which some projector refreshed (--plot), ascending. */
  int events_step, events_rank, events_counter;
  char events_param[128];
  int64_t events_ref, events_dist;
  int64_t event_totals[DOPT_NCOUNTERS];
  int *refresh_steps;
  int nrefresh;
} cmp_result;

typedef void (*cmp_progress_fn)(int step, int steps, double elapsed, uint64_t worst_ulp, void *user);

/* Runs the comparison. Bad options or input (unknown optimizer, plugin or
 * key, ranks ≠ tp·dp, unreadable/malformed trace) return an error with
 * dopt_last_error() naming it; progress may be NULL. */
dopt_status cmp_run(const cmp_options *o, cmp_result *r, cmp_progress_fn progress, void *user);
void cmp_result_free(cmp_result *r);

/* For tests: the --model generator's vector variants this CPU runs (their names, space-separated, into ran)
 * against the portable one on every tensor of `model` (a --model spec), whole and as 3 x 3 blocks. Returns how
 * many blocks differ in any byte (0: the same values on every machine), or -1 (a bad spec, no memory). */
int cmp_synth_variants_differ(const char *model, char *ran, size_t cap);

/* The declared tolerance of an optimizer, in ULP (0 = bitwise). */
uint64_t cmp_declared_ulp(const char *optimizer);

/* 1: a --trace path names a recording of distopt.record (a directory or its index.json,
 * docs/verify.md: one shard per step) rather than a single-file gradient trace. */
int cmp_trace_is_recording(const char *path);


/* Seconds on the monotonic clock (the wall-clock timer of compare, --sweep and bench). */
double cmp_now_s(void);

/* YAML configuration (cli/config.c, libyaml), in the shape of ms-swift's
 * optimizer configs:
 *   optimizer: {type: came, lr: 2e-4, weight_decay: 0.01}
 *   groups: [{params: "*bias", weight_decay: 0}]          # optional
 *   plugin: {type: hybrid, tp: 2, dp: 2, zero: 2}         # also backend: sim|nccl|mpi, device: cpu|cuda
 *   steps: 100
 *   accumulation: 1                                        # optional
 *   max_grad_norm: 1.0                                     # optional
 *   bf16: false                                            # optional
 *   gradients: {source: synthetic, seed: 1, model: llama-60m} | {source: trace, path: FILE}
 *   output: {json: FILE, plot: FILE.svg}                   # optional
 *   checkpoint: {at: K, dir: DIR, resume: {type: P, tp: T, dp: D, zero: Z}}   # optional
 *   compare: {sweep: false, max_tp: 4, max_dp: 4, threads: 0}   # optional (--sweep, --threads)
 * Layout values the file gives are marked in o->given / o->given_yaml
 * (cmp_apply_plugin completes the rest).
 * Loads into o (on top of its current values). Unknown keys, wrong types,
 * duplicate keys and malformed YAML are DOPT_ERR_FORMAT with
 * "FILE:LINE: dotted.key: problem"; an unreadable file is DOPT_ERR_IO. o is
 * unchanged on error. */
dopt_status cmp_load_yaml(const char *path, cmp_options *o);

/* One layout of `distopt compare --sweep`. */
typedef enum {
  CMP_CELL_BITWISE,   /* every tensor bitwise equal to the reference at every step */
  CMP_CELL_WITHIN,    /* equivalent within the declared tolerance, not bitwise */
  CMP_CELL_DIVERGED,  /* beyond the declared tolerance from `step` (or the skipped steps differ: step 0) */
  CMP_CELL_ERROR,     /* cmp_run failed: `message` */
  CMP_CELL_SKIPPED    /* not run: `message` says why (e.g. dp does not divide a trace's shards) */
} cmp_cell_kind;

typedef struct cmp_sweep_cell {
  int tp, dp, zero;
  int pp;                   /* pipeline stages (1: none) */
  char plugin[16];          /* the plugin that expresses the layout (cmp_layout_plugin) */
  cmp_cell_kind kind;
  int step;                 /* DIVERGED: the first step beyond the declared tolerance */
  char tensor[128];         /* DIVERGED: the first tensor beyond it at that step */
  uint64_t worst_ulp;       /* max ULP over all tensors and steps */
  uint64_t declared_ulp;
  char message[512];        /* ERROR / SKIPPED: one line */
  char digest[DOPT_DIGEST_HEX], ref_digest[DOPT_DIGEST_HEX];
  double seconds;
} cmp_sweep_cell;

/* Fills kind, step, tensor, worst_ulp, declared_ulp, digests and seconds of c from a result. */
void cmp_sweep_cell_set(cmp_sweep_cell *c, const cmp_result *r);
/* The grid (rows tp x dp, columns zero 0..3), the details of every cell that
 * is not bitwise, and "N of M layouts bitwise". */
void cmp_print_sweep(FILE *f, const cmp_options *o, const cmp_sweep_cell *cells, int ncells);
/* The sweep's JSON record (its own "schema_version", "kind": "sweep"; docs/cli.md). */
dopt_status cmp_write_sweep_json(const char *path, const cmp_options *o, const cmp_sweep_cell *cells, int ncells);

/* Ranks that agree (compare/agree.c): the effective configuration of a multi-process compare as text,
 * one "key=value" line per option (keys spelled as the command-line options, after the YAML file and the
 * defaults; the build; the trace's identity: its size and its safetensors header's SHA-256, or a
 * recording's index.json), control characters and '\\' written as \xNN. Returns its length, or -1
 * (dopt_last_error says why) when it does not fit cap (CMP_CONFIG_MAX is enough). */
#define CMP_CONFIG_MAX 65536
int cmp_config_text(const cmp_options *o, char *buf, size_t cap);
/* The first option where this rank's text (mine) and rank 0's (theirs: from another process, parsed as
 * untrusted input) differ: 0 equal; 1 differs, msg "--optimizer is 'came' on rank 1, 'adamw' on rank 0";
 * -1 a text is malformed (msg says where). */
int cmp_config_diff(const char *mine, size_t nm, const char *theirs, size_t nt, int rank, char *msg, size_t cap);
/* Before any other collective, every rank's SHA-256 of its text against rank 0's: over the world
 * transport (backend mpi: one broadcast of rank 0's digest and text, one all_reduce MIN), or over the
 * TCP rendezvous of the launcher's environment (backend nccl; nothing when there is no launcher).
 * *first: the lowest rank whose text differs (-1: all agree); on that rank msg holds the one line that
 * names the first differing option and both values. */
dopt_status cmp_config_agree(const dopt_transport *world, const char *mine, size_t nm, int *first, char *msg,
                             size_t cap);
dopt_status cmp_config_agree_tcp(const char *mine, size_t nm, int *first, char *msg, size_t cap);
/* Every rank of world says whether it is flagged (a differing configuration, a refusal); *lowest: the lowest
 * flagged rank on every rank (-1: none). One all_reduce MIN. */
dopt_status cmp_lowest_flagged(const dopt_transport *world, int flagged, int *lowest);

/* Reports (cli/report.c). */
void cmp_print_table(FILE *f, const cmp_options *o, const cmp_result *r);
dopt_status cmp_write_json(const char *path, const cmp_options *o, const cmp_result *r);
dopt_status cmp_write_svg(const char *path, const cmp_options *o, const cmp_result *r);

#endif
