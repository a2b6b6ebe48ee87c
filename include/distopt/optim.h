/* distopt — single-device reference optimizers.
 *
 * Usage (torch-like):
 *   dopt_optim *o;
 *   dopt_optim_create("adafactor", "beta1=0.9,weight_decay=0.01", &o);   // group defaults
 *   int g_nodecay; dopt_optim_add_group(o, "weight_decay=0", &g_nodecay);  // another group
 *   dopt_param_config pc = DOPT_PARAM_CONFIG_INIT;
 *   pc.name = "layer0.weight"; pc.ndim = 2; pc.shape[0] = 768; pc.shape[1] = 3072; pc.data = w;
 *   int pid; dopt_optim_add_param(o, 0, &pc, &pid);
 *   ... dopt_optim_step(o, grads);   // grads[pid] (NULL = no gradient: param skipped)
 *   dopt_optim_destroy(o);
 *
 * Group 0 is created by dopt_optim_create with the given defaults; further
 * groups override some keys on top of those defaults. Hyperparameters are
 * validated when a group is created (rejections name the key and value).
 * Parameters are fp32 tensors of any rank (or bf16 working copies with fp32
 * master weights), updated in place; states are
 * allocated at a parameter's first step (as torch does) and are readable and
 * writable through dopt_optim_state().
 */
#ifndef DISTOPT_OPTIM_H
#define DISTOPT_OPTIM_H

#include <stddef.h>
#include <stdint.h>

#include "distopt/dtype.h"
#include "distopt/export.h"
#include "distopt/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct dopt_optim dopt_optim;

/* Versioned parameter description (append-only; always start from
 * DOPT_PARAM_CONFIG_INIT). */
typedef struct dopt_param_config {
  uint32_t struct_size;
  uint32_t version;
  const char *name;                /* copied; used for state names and errors */
  int ndim;                        /* 0..DOPT_MAX_DIMS (0 = scalar) */
  int64_t shape[DOPT_MAX_DIMS];
  dopt_dtype dtype;                /* DOPT_F32, or DOPT_BF16: data is the bf16 working copy
                                      (uint16_t), `master` the fp32 weights the optimizer steps */
  void *data;                      /* the working parameter, updated in place (borrowed) */
  float *master;                   /* fp32 master weights for bf16 params (borrowed) */
  int layer;                       /* layer index for layer-wise optimizers (LISA); -1 = none */
} dopt_param_config;

#define DOPT_PARAM_CONFIG_VERSION 1
/* Size of the version-1 struct: callers built against it stay accepted when
 * fields are appended (later fields then take their defaults). */
#define DOPT_PARAM_CONFIG_V1_SIZE (offsetof(dopt_param_config, layer) + sizeof(int))
#define DOPT_PARAM_CONFIG_INIT \
  { sizeof(dopt_param_config), DOPT_PARAM_CONFIG_VERSION, NULL, 0, {0}, DOPT_F32, NULL, NULL, -1 }

/* ---- registry ------------------------------------------------------------ */

/* Number of registered optimizers and their names ("adamw", "adafactor", ...). */
DOPT_API int dopt_optim_registry_count(void);
DOPT_API const char *dopt_optim_registry_name(int i);

/* What the registry knows about optimizer i besides its keys. The
 * hyperparameter settings are the optimizer's own (declared next to its step
 * in ref/<name>.c) and are what the project runs when the user chose none:
 * `example` in compare --matrix, and in compare, --sweep, bench and mem when
 * upstream's defaults are not a valid optimizer (CAME has no default lr);
 * `grid` in the equivalence grid (the first grid_ci on the CI layouts, all of
 * them under DOPT_GRID_FULL=1). Strings are static; "" means the defaults. */
typedef struct dopt_optim_info {
  int version;                 /* DOPT_OPTIM_INFO_VERSION */
  const char *name, *summary;
  int distributable;           /* 1: sharded piecewise; 0: one owner rank per parameter (docs/distributed.md) */
  int wrapper;                 /* 1: wraps an inner registry optimizer (LISA) */
  const char *example;         /* never NULL */
  const char *const *grid;     /* NULL-terminated, at least one entry */
  int grid_count, grid_ci;     /* entries in grid; how many of the first run on every CI layout (>= 1) */
} dopt_optim_info;
#define DOPT_OPTIM_INFO_VERSION 1
DOPT_API dopt_status dopt_optim_registry_info(int i, dopt_optim_info *out);
/* Writes a human-readable list of `name`'s keys, defaults and meanings into
 * buf (truncated to cap, always NUL-terminated). */
DOPT_API dopt_status dopt_optim_describe(const char *name, char *buf, size_t cap);

/* ---- lifetime and groups --------------------------------------------------- */

/* hparams: "key=value,key=value" (NULL or "" = upstream defaults). Values are
 * numbers, true/false, or none (for optional keys such as Adafactor's lr). */
DOPT_API dopt_status dopt_optim_create(const char *name, const char *hparams, dopt_optim **out);
DOPT_API void dopt_optim_destroy(dopt_optim *o);
DOPT_API const char *dopt_optim_name(const dopt_optim *o);

DOPT_API dopt_status dopt_optim_add_group(dopt_optim *o, const char *overrides, int *group);
DOPT_API int dopt_optim_num_groups(const dopt_optim *o);
/* Reads a group's hyperparameter; optional keys that are unset give NaN. */
DOPT_API dopt_status dopt_optim_get_hparam(const dopt_optim *o, int group, const char *key, double *value);
/* Changes one hyperparameter of a group (e.g. an lr schedule); validated. */
DOPT_API dopt_status dopt_optim_set_hparam(dopt_optim *o, int group, const char *key, double value);

DOPT_API dopt_status dopt_optim_add_param(dopt_optim *o, int group, const dopt_param_config *cfg, int *param);
DOPT_API int dopt_optim_num_params(const dopt_optim *o);
DOPT_API const char *dopt_optim_param_name(const dopt_optim *o, int param);

/* ---- stepping --------------------------------------------------------------- */

/* One optimizer step over every parameter. grads[i] is parameter i's gradient
 * (same shape, fp32); NULL means "no gradient" and leaves the parameter, its
 * state and its step count untouched, as torch does for grad None. */
DOPT_API dopt_status dopt_optim_step(dopt_optim *o, const float *const *grads);

/* dopt_optim_step with each gradient's element type: dtypes[i] DOPT_F32 (grads[i] is float[numel]) or DOPT_BF16
 * (uint16_t[numel], widened to fp32 exactly as the step reads it); dtypes NULL: every gradient fp32. A bf16
 * parameter (dopt_param_config.dtype DOPT_BF16) steps its fp32 master and leaves its working copy the new master
 * rounded to nearest even; before its step, an element whose working copy is no longer its master rounded
 * (written outside the optimizer: a loaded model, p.data.copy_) takes the working copy's value as its master
 * (docs/api.md "bf16 parameters"). The same bits as the fp32 gradients widened by the caller. */
DOPT_API dopt_status dopt_optim_step_typed(dopt_optim *o, const void *const *grads, const dopt_dtype *dtypes);

/* Train or evaluation mode (eval 1 / 0) of an optimizer whose parameters hold a different point in each
 * (adamw_schedulefree: y to train at, the average x to evaluate; schedulefree's optimizer.eval()/.train()):
 * every parameter that has stepped moves to the other point, elementwise, its bf16 working copy with it.
 * Setting the current mode changes nothing. A step in evaluation mode is refused (DOPT_ERR_STATE); an optimizer
 * starts in train mode. Other optimizers: DOPT_ERR_UNSUPPORTED. docs/optimizers.md, "Schedule-Free AdamW". */
DOPT_API dopt_status dopt_optim_set_mode(dopt_optim *o, int eval);
/* 1 in evaluation mode, 0 in train mode (or o NULL). */
DOPT_API int dopt_optim_get_mode(const dopt_optim *o);
/* Declares the mode the parameters are in without moving them: after loading weights and states saved in
 * evaluation mode (schedulefree's advice: save in eval mode), dopt_optim_declare_mode(o, 1), then
 * dopt_optim_set_mode(o, 0) to train on. */
DOPT_API dopt_status dopt_optim_declare_mode(dopt_optim *o, int eval);

/* Threads of the step, the caller included: 1..256, or 0 for the default —
 * DOPT_NUM_THREADS from the environment when set, else the cores this process
 * may run on (read at the next step). Large parameters of the optimizers
 * that take pieces are split over the threads, the others run whole, several
 * at once; the results are bitwise the same for every thread count
 * (docs/threads.md). get returns the count the next step uses (0: a bad
 * DOPT_NUM_THREADS, which the step reports). */
DOPT_API dopt_status dopt_optim_set_threads(dopt_optim *o, int nthreads);
DOPT_API int dopt_optim_get_threads(const dopt_optim *o);

/* ---- state ------------------------------------------------------------------- */

typedef struct dopt_state_view {
  const char *name;                /* upstream state_dict key: "exp_avg", "exp_avg_sq_row", ... */
  dopt_dtype dtype;
  int ndim;
  int64_t shape[DOPT_MAX_DIMS];
  void *data;                      /* writable: loading a checkpoint writes here */
  size_t bytes;
} dopt_state_view;

/* Number of state tensors of a parameter (0 before its first step). */
DOPT_API int dopt_optim_num_states(const dopt_optim *o, int param);
DOPT_API dopt_status dopt_optim_state(dopt_optim *o, int param, int index, dopt_state_view *out);
/* Allocates a parameter's state now (zeros, step 0), e.g. before loading. */
DOPT_API dopt_status dopt_optim_init_state(dopt_optim *o, int param);
DOPT_API dopt_status dopt_optim_get_step(const dopt_optim *o, int param, int64_t *step);
DOPT_API dopt_status dopt_optim_set_step(dopt_optim *o, int param, int64_t step);
/* The optimizer's step clock: dopt_optim_step calls so far, the input of a
 * wrapper's schedule (LISA samples layers from it). dopt_optim_load restores
 * it; set it to resume a run from states restored by hand. */
DOPT_API int64_t dopt_optim_get_gstep(const dopt_optim *o);
DOPT_API dopt_status dopt_optim_set_gstep(dopt_optim *o, int64_t gstep);

/* What a parameter's last step had to do beyond the plain update (bit flags;
 * 0 = nothing): */
#define DOPT_EVENT_RANK_CLAMPED 0x1u   /* a projection rank > min(m, n) was clamped */
#define DOPT_EVENT_SVD_FALLBACK 0x2u   /* sgesdd did not converge; sgesvd was used */
#define DOPT_EVENT_SVD_FAILED 0x4u     /* both SVDs failed: the previous projector was kept */
#define DOPT_EVENT_NONFINITE_RESET 0x8u /* non-finite gradient elements reset their states */
#define DOPT_EVENT_CLIPPED 0x10u       /* a per-tensor clipping (e.g. percentile) scaled the gradient */
/* The last step's flags, read from its counters (dopt_optim_counters). */
DOPT_API dopt_status dopt_optim_events(const dopt_optim *o, int param, unsigned *events);

/* ---- counters: how much work each parameter's steps did ----------------------------------
 * X(ID, "name", scope), one row per counter (docs/api.md "Counters"). Scope
 * DOPT_COUNT_EACH: a property of the parameter's step that every piece
 * stepping it reports alike (a distributed run is checked on every rank that
 * holds a piece); DOPT_COUNT_SUM: work counted where it is done (per matrix,
 * per element), whose total over the distinct pieces is the parameter's. New
 * rows go at the end (the ids are the ABI). */
#define DOPT_COUNTER_TABLE(X)                                                                                          \
  X(STEPS, "steps", DOPT_COUNT_EACH)                         /* updates applied (0: skipped, absent, frozen) */        \
  X(FROZEN, "lisa.frozen", DOPT_COUNT_EACH)                  /* steps a wrapper (LISA) froze it */                     \
  X(RESETS, "lisa.resets", DOPT_COUNT_EACH)                  /* its states and step reset by a wrapper (LISA) */       \
  X(Q8_STEPS, "q8.steps", DOPT_COUNT_EACH)                   /* steps on 8-bit states */                               \
  X(Q8_FP32_STEPS, "q8.fp32_steps", DOPT_COUNT_EACH)         /* an 8-bit optimizer's steps on fp32 states */           \
  X(CLIPPED, "q8.clipped", DOPT_COUNT_EACH)                  /* steps whose percentile clipping scaled the gradient */ \
  X(NONFINITE_RESETS, "q8.nonfinite_resets", DOPT_COUNT_SUM) /* non-finite gradient elements (their states reset) */   \
  X(PROJECTED, "galore.projected", DOPT_COUNT_SUM)           /* steps of a matrix in its low-rank frame */             \
  X(REFRESHES, "galore.refreshes", DOPT_COUNT_SUM)           /* projector refreshes (SVD or supplied) */               \
  X(SUPPLIED, "galore.supplied", DOPT_COUNT_SUM)             /* refreshes whose projector the caller's hook gave */    \
  X(RANK_CLAMPED, "galore.rank_clamped", DOPT_COUNT_SUM)     /* projected steps with a rank clamped to min(m, n) */    \
  X(SVD_FALLBACKS, "galore.svd_fallbacks", DOPT_COUNT_SUM)   /* sgesdd failed, sgesvd used */                          \
  X(SVD_FAILURES, "galore.svd_failures", DOPT_COUNT_SUM)     /* both SVDs failed: the previous projector kept */       \
  X(NS, "muon.ns", DOPT_COUNT_SUM)                           /* Newton-Schulz calls (one per matrix) */                \
  X(AUX_ADAM, "muon.adam", DOPT_COUNT_EACH)                  /* steps on Muon's auxiliary Adam path */                 \
  X(NS_ITERATIONS, "muon.ns_iterations", DOPT_COUNT_SUM)     /* Newton-Schulz iterations (calls x ns_steps) */   \
  X(LIMITED, "apollo.limited", DOPT_COUNT_SUM)               /* steps whose norm-growth limiter scaled the update */ \
  X(EIGH, "soap.eigh", DOPT_COUNT_SUM)                       /* eigendecompositions (a preconditioner's first basis) */ \
  X(QR, "soap.qr", DOPT_COUNT_SUM)                           /* eigenbasis refreshes by power iteration and QR */ \
  X(EIGH_FP64, "soap.eigh_fp64", DOPT_COUNT_SUM)             /* first bases that took the float64 fallback */ \
  X(SWAPS, "schedulefree.swaps", DOPT_COUNT_EACH)            /* train/eval swaps of its points (in the totals only) */

#define DOPT_COUNT_EACH 0
#define DOPT_COUNT_SUM 1
#define DOPT_COUNTER_ID_(id, name, scope) DOPT_COUNTER_##id,
typedef enum dopt_counter { DOPT_COUNTER_TABLE(DOPT_COUNTER_ID_) DOPT_NCOUNTERS } dopt_counter;
#undef DOPT_COUNTER_ID_
#define DOPT_COUNTERS_MAX 32 /* room in dopt_counters: rows can be added without changing its size */

#define DOPT_COUNTERS_VERSION 1
typedef struct dopt_counters {
  size_t size;                       /* sizeof(dopt_counters) */
  int version;                       /* DOPT_COUNTERS_VERSION */
  int n;                             /* out: the counters filled, DOPT_NCOUNTERS */
  int held;                          /* out: this optimizer (rank) holds a piece of the parameter it steps */
  int primary;                       /* out: its piece is the first copy (replicas repeat it): SUM counters total
                                      * over the primary pieces */
  int64_t last[DOPT_COUNTERS_MAX];   /* out: the last step call's counts */
  int64_t total[DOPT_COUNTERS_MAX];  /* out: since the optimizer was created */
} dopt_counters;
#define DOPT_COUNTERS_INIT { sizeof(dopt_counters), DOPT_COUNTERS_VERSION, 0, 0, 0, {0}, {0} }

/* A parameter's counters (the reference: held and primary are 1). */
DOPT_API dopt_status dopt_optim_counters(const dopt_optim *o, int param, dopt_counters *out);
/* Counter c's name ("galore.refreshes") and scope (DOPT_COUNT_*); NULL / -1 for an unknown id. */
DOPT_API const char *dopt_counter_name(int c);
DOPT_API int dopt_counter_scope(int c);

/* Exact optimizer-state memory in bytes. param >= 0: that parameter;
 * param = -1: all parameters. `allocated` = what is allocated now; `full` =
 * what it is once every parameter has stepped. Either pointer may be NULL. */
DOPT_API dopt_status dopt_optim_state_bytes(const dopt_optim *o, int param, size_t *allocated, size_t *full);

/* The exact state bytes a parameter of this shape would get from optimizer
 * `name` with hyperparameters `hparams`, without creating anything (for
 * memory planning of models too large to allocate). */
DOPT_API dopt_status dopt_optim_state_bytes_for(const char *name, const char *hparams, int ndim, const int64_t *shape,
                                                size_t *bytes);

/* The layer index of a parameter for layer-wise optimizers (LISA), from its
 * name: N of the first "layers.N." (or a trailing "layers.N") that starts the
 * name or follows '.' or '/', as in HF names "model.layers.12.mlp.up_proj.weight";
 * -1 otherwise (always trained). What `distopt run` and `compare` set as
 * dopt_param_config.layer. */
DOPT_API int dopt_layer_from_name(const char *name);

/* ---- gradient utilities shared by the reference and distributed/ ------------------ */

/* Global gradient-norm clipping as torch.nn.utils.clip_grad_norm_, shared by
 * the reference and distributed/: ss[i] is parameter i's exact Σg²; the total norm
 * is sqrt of their sum in parameter order (double); the coefficient is
 * fp32(min(1, max_norm / (norm + 1e-6))). */
DOPT_API float dopt_clip_coef(const double *ss, int n, double max_norm, double *norm);

/* A caller-supplied projector (e.g. one recorded from a galore_torch run):
 * called at every projector refresh of a projected matrix, before the SVD,
 * with the parameter's index in the optimizer, the 1-based step being taken,
 * its fp32 gradient grad [m, n] and the rank r after clamping. Fill `left`
 * [m, r] and/or `right` [r, n] (row-major, the side(s) proj_type projects;
 * the other is NULL) and return 1 to use them instead of the SVD, 0 to let
 * the SVD run, or -1 to fail the step (DOPT_ERR_INVALID_ARG). An all-zero
 * projector counts as none yet: the next step refreshes again (on Q-GaLore's
 * path a supplied projector is a refresh like the SVD's: it is quantised and
 * its first vector enters the lazy queue). Called from the stepping
 * thread(s), one parameter at a time per call. */
typedef int (*dopt_projector_fn)(void *user, int param, int64_t step, const float *grad, int64_t m, int64_t n,
                                 int64_t r, float *left, float *right);
/* Installs fn (NULL removes it) on a galore, galore_adamw, galore_adamw8bit
 * or q_galore optimizer, or LISA around one; other optimizers refuse it with
 * DOPT_ERR_UNSUPPORTED. */
DOPT_API dopt_status dopt_optim_set_projector_hook(dopt_optim *o, dopt_projector_fn fn, void *user);

#ifdef __cplusplus
}
#endif
#endif
