/* Internal optimizer interface: each reference optimizer (ref/adamw.c, ...)
 * fills one dopt_optim_impl; core/optim.c does hyperparameters, groups,
 * parameters and state storage, core/optim_step.c the step loop;
 * ref/registry.c names them. The step of every optimizer is written once, on
 * a *piece* of the logical tensor with a reducer for its cross-element
 * statistics (distopt/device.h): the single-device reference calls it with
 * the whole tensor and no reducer, distributed/ with its shard and a reducer
 * over the ranks sharing the tensor, so the two are the same computation.
 * This header owns that interface: hyperparameter and state descriptions, the
 * step's arguments and buffers, the counters, the impl table, the optimizer
 * object's internal calls and the state specs. It includes what a step is
 * written with, each in a header of its own: pieces and their runs (piece.h),
 * ZeRO ranges and Gemini's chunks (zero_range.h), the exact statistics of a
 * piece (piece_stats.h). */
#ifndef DISTOPT_OPTIM_IMPL_H
#define DISTOPT_OPTIM_IMPL_H

#include "distopt/device.h"
#include "distopt/optim.h"
#include "distopt/xsum.h"
#include "internal.h"
#include "piece.h"
#include "piece_stats.h"
#include "zero_range.h"

#define DOPT_MAX_STATES 16
#define DOPT_MAX_HPARAMS 64

typedef enum dopt_hp_kind {
  DOPT_HP_REAL = 0, /* finite number */
  DOPT_HP_BOOL = 1, /* true/false (stored as 1.0/0.0) */
  DOPT_HP_OPT = 2,  /* finite number or none (stored as NaN) */
  DOPT_HP_ENUM = 3, /* one of `choices` by name (stored as its index) */
  DOPT_HP_INT = 4,  /* a whole number (a count, a size, a seed; stored as a double, its range and wholeness
                     * checked by the optimizer's validate): described without a fraction, where a REAL
                     * default always shows one ("1.0"), so bindings keep integers as integers */
} dopt_hp_kind;

typedef struct dopt_hp_def {
  const char *key;
  dopt_hp_kind kind;
  double def; /* NaN = none (DOPT_HP_OPT only); the index for DOPT_HP_ENUM */
  const char *doc;
  const char *const *choices; /* DOPT_HP_ENUM: NULL-terminated names */
} dopt_hp_def;

/* How a state tensor is laid out over the pieces of its parameter. */
typedef enum dopt_state_kind {
  DOPT_STATE_WHOLE = 0,       /* small (factored row/column statistics, the 0-d RMS, a clipping history):
                               * every piece, every rank holds it whole */
  DOPT_STATE_ELEMENTWISE = 1, /* the parameter's shape (any dtype): sliced and sharded like the parameter */
  DOPT_STATE_BLOCKWISE = 2,   /* one value per quantisation block of `block` consecutive elements of the
                               * logical flattened tensor, shape [ceil(numel / block)] (8-bit absmax): a
                               * piece holds the values of the blocks its elements fall in, in block order
                               * (dopt_piece_blocks); a block whose elements several pieces hold is held,
                               * and kept equal, by each of them */
} dopt_state_kind;

/* A state tensor's description. */
typedef struct dopt_state_spec {
  dopt_state_view v; /* name, dtype, logical shape, bytes (data NULL) */
  dopt_state_kind kind;
  size_t block;      /* DOPT_STATE_BLOCKWISE: elements per block (else 0) */
} dopt_state_spec;

/* A parameter as the single-device optimizer sees it. */
typedef struct dopt_param {
  char *name;
  int group;
  int ndim;
  int64_t shape[DOPT_MAX_DIMS];
  size_t numel;
  float *data;      /* fp32 values the optimizer updates (the master for bf16) */
  uint16_t *work;   /* bf16 working copy (NULL for fp32 parameters) */
  int layer;
  int64_t step;                        /* steps taken by this parameter */
  int frozen;                          /* set from a wrapper's schedule (LISA): skip as a NULL gradient */
  int64_t cnt_last[DOPT_NCOUNTERS];    /* dopt_counters: the last step call's counts */
  int64_t cnt_total[DOPT_NCOUNTERS];   /* since creation */
  int nstates;                         /* 0 until allocated */
  dopt_state_view st[DOPT_MAX_STATES]; /* names/shapes from the layout, data owned */
  unsigned char kind[DOPT_MAX_STATES]; /* dopt_state_kind of st[k] */
  size_t qblock;                       /* the block of its DOPT_STATE_BLOCKWISE states (0: none); the
                                        * threads cut its pieces on block boundaries */
} dopt_param;

/* One stage of one step of one optimizer on one piece (what
 * dopt_device_ops.step runs). A step is a short sequence of stages: stage 0
 * does the local work up to its first cross-element statistic and posts the
 * statistic's local words to red (MAX first, then SUM in the next stage);
 * the caller runs the posted reductions, batched over all parameters, and
 * calls stage 1, and so on; a stage that does not set *more ends the step.
 * The reference runs the same stages back to back with red = NULL. Whatever
 * a step needs from one stage to the next lives in its frame (impl->frame
 * bytes, never in static storage); a frame is not cleared between steps, so
 * a stage writes everything it or a later stage reads.
 *
 *   dist. round:   MAX      SUM      MAX      SUM
 *   adafactor:  S0 ─────► S1 ────► S2 ─────► S3 ────► S4   (factored)
 *                 ‖w‖²,rows,cols     ‖u‖²                   update
 */
/* Parallel loops inside one step on a whole tensor (the reference with
 * threads: core/optim_step.c): run(ctx, n, task, arg) calls task(arg, i) once for
 * every i in [0, n) on up to `threads` threads and returns when all are done.
 * A step may split work whose results do not depend on the split (8-bit
 * blocks) this way; NULL: one thread. */
#define DOPT_PAR_MAX 64         /* most parts a step splits its work into */
#define DOPT_PAR_MIN_BLOCKS 64  /* 8-bit blocks per part at least (16384 elements at block 256) */
typedef struct dopt_par {
  void *ctx;
  int threads;
  void (*run)(void *ctx, size_t n, void (*task)(void *arg, size_t i), void *arg);
} dopt_par;

/* The most parts work may split into on par: its threads, at most DOPT_PAR_MAX (1 for NULL). */
size_t dopt__par_parts(const dopt_par *par);
/* fn(arg, lo, hi) over [0, n) in equal parts of at least `min` elements each, on par's threads (par NULL or
 * one part: on the caller); returns when all are done. For elementwise passes, whose bits do not depend on
 * the split. */
void dopt__par_ranges(const dopt_par *par, size_t n, size_t min, void (*fn)(void *arg, size_t lo, size_t hi),
                      void *arg);

/* The blocks of a DOPT_STATE_BLOCKWISE state that several pieces of the tensor hold elements of: a value
 * per block (8-bit absmax) is then a MAX over those pieces, posted in one array per step. The list is the
 * same on every piece of the tensor (distributed/ derives it from every rank's piece); a piece that holds no
 * element of shared block s still posts its slot (-inf). NULL: no block is shared (a whole tensor, or the
 * reference's threads, which cut pieces on block boundaries). */
typedef struct dopt_block_share {
  size_t block;      /* elements per block */
  size_t n;          /* shared blocks */
  const size_t *idx; /* [n] their logical block indices, ascending (device memory) */
  double *max;       /* [2·n] the step's scratch for the per-block maxima it posts (device memory) */
} dopt_block_share;

typedef struct dopt_step_args {
  const struct dopt_optim_impl *impl;
  const double *hp;        /* the group's hyperparameters, impl order */
  int64_t step;            /* t, already incremented */
  const dopt_piece *piece;
  float *param;            /* [len] */
  const float *grad;       /* [len] */
  void *const *state;      /* elementwise states [len], the others whole */
  void *frame;             /* impl->frame(hp, piece) bytes, kept across stages */
  const dopt_reducer *red; /* NULL: single device */
  int64_t *counts;         /* [DOPT_NCOUNTERS] the step adds its counts here (dopt_count; may be NULL) */
  uint64_t tensor;         /* the parameter's index in its optimizer (counter-based generator key) */
  int stage;               /* the stage to run: 0, 1, ... */
  int *more;               /* set to 1 by a stage that posted and needs the next one */
  double *host_out;        /* dopt__impl_sumsq only: where the last stage writes Σx² (host) */
  const dopt_par *par;     /* NULL, or threads for independent work within the step */
  /* NULL: the parameter's own statistics (‖w‖, RMS(w)) are the piece's
   * (param, the logical numel). Else the tensor they are taken from,
   * wstat[wstat_len] whole: a projection wrapper (GaLore) steps a zero
   * low-rank parameter for the full weight it gives here, so relative step
   * sizes and trust ratios see the real weight (galore_torch's
   * GaLoreAdafactor: RMS of the full p). Read with dopt_wstat. */
  const float *wstat;
  size_t wstat_len;
  /* NULL, or the caller's projector at a GaLore refresh (dopt_optim_set_projector_hook) */
  const struct dopt_proj_hook *proj_hook;
  /* NULL, or the blocks of the piece's blockwise states that other pieces share (dopt_block_share) */
  const dopt_block_share *shared;
  /* the parameter's logical shape (ndim 0 and NULL: only the piece's [b, h, w] view is known) */
  int ndim;
  const int64_t *shape;
} dopt_step_args;

/* The device buffers a step receives, with their sizes: param and grad [len], every state in full (elementwise
 * [len], blockwise the piece's blocks, whole its logical size), the frame (frame_bytes), wstat [wstat_len], the
 * shared blocks' indices and maxima. out[DOPT_STEP_BUFS_MAX]; returns how many. Each names the field of
 * dopt_step_args it is (slot; state k: DOPT_BUF_STATE + k) and whether the step may write it (out). (The
 * checking device checks these; dopt__step_on_host moves them.) */
enum { DOPT_BUF_PARAM, DOPT_BUF_GRAD, DOPT_BUF_FRAME, DOPT_BUF_WSTAT, DOPT_BUF_SHARED_IDX, DOPT_BUF_SHARED_MAX,
       DOPT_BUF_STATE };
#define DOPT_STEP_BUFS_MAX (DOPT_BUF_STATE + DOPT_MAX_STATES)
typedef struct dopt_step_buf {
  const char *name;
  void *dev;
  size_t bytes;
  int out;
  int slot;
} dopt_step_buf;
int dopt__step_buffers(const dopt_step_args *a, size_t frame_bytes, dopt_step_buf *out);

/* Runs one stage of a's step on the host for a device without a kernel for it: downloads every buffer of
 * dopt__step_buffers (frame_bytes: the impl's frame, impl->frame), runs impl->step on the host copies (what a
 * stage posts to the reducer is mapped back to the device copies, which are what the caller reduces) and
 * uploads what the step may write. Bitwise the CPU device's step; costs a copy of the buffers each way. */
dopt_status dopt__step_on_host(const dopt_device *dev, const dopt_step_args *a, size_t frame_bytes);

/* Adds n to counter c of this step (a piece counts a SUM counter for the work it did, an EACH counter once). */
static inline void dopt_count(const dopt_step_args *a, dopt_counter c, int64_t n) {
  if (a->counts) a->counts[c] += n;
}

/* Merges one piece's counts of a step into the parameter's: SUM counters add, EACH counters (alike on every
 * piece) take the largest. */
static inline void dopt_counts_merge(int64_t *into, const int64_t *piece) {
  for (int c = 0; c < DOPT_NCOUNTERS; c++)
    into[c] = dopt_counter_scope(c) == DOPT_COUNT_SUM ? into[c] + piece[c] : (piece[c] > into[c] ? piece[c] : into[c]);
}

/* A step's counts into the totals. */
static inline void dopt_counts_add(int64_t *total, const int64_t *step) {
  for (int c = 0; c < DOPT_NCOUNTERS; c++) total[c] += step[c];
}

/* DOPT_EVENT_* flags of a step's counts; an out struct filled from a parameter's counts (checks size and
 * version). */
unsigned dopt__counts_events(const int64_t *counts);
dopt_status dopt__counters_fill(dopt_counters *out, const int64_t *last, const int64_t *total, int held, int primary);

typedef struct dopt_proj_hook {
  dopt_projector_fn fn;
  void *user;
} dopt_proj_hook;

/* The shape a step reads: the parameter's logical one (a->shape) where the caller gave it, else its piece's
 * [b, h, w] view ([w] for a vector); view: the caller's storage for the latter. */
static inline const int64_t *dopt_step_shape(const dopt_step_args *a, int64_t view[3], int *ndim) {
  const dopt_piece *pc = a->piece;
  view[0] = (int64_t)pc->b, view[1] = (int64_t)pc->h, view[2] = (int64_t)pc->w;
  *ndim = a->shape ? a->ndim : pc->factored ? 3 : 1;
  return a->shape ? a->shape : pc->factored ? view : view + 2;
}

/* The tensor a step takes its parameter statistics from (dopt_step_args.wstat): *w and *n the local
 * elements to reduce, *numel the logical count the RMS divides by. */
static inline void dopt_wstat(const dopt_step_args *a, const float **w, size_t *n, size_t *numel) {
  *w = a->wstat ? a->wstat : a->param;
  *n = a->wstat ? a->wstat_len : a->piece->len;
  *numel = a->wstat ? a->wstat_len : a->piece->numel;
}
/* The logical count RMS(w) divides by (dopt_wstat's *numel). */
static inline size_t dopt_wstat_numel(const dopt_step_args *a) { return a->wstat ? a->wstat_len : a->piece->numel; }

typedef struct dopt_optim_impl {
  const char *name;
  const char *summary;
  const dopt_hp_def *hp;
  int nhp;
  /* Cross-key validation beyond the per-key kind checks (e.g. Adafactor's lr
   * with relative_step). hp[] is indexed as the impl's hp table. */
  dopt_status (*validate)(const double *hp);
  /* The state tensors of a parameter of this logical shape; returns their number. */
  int (*layout)(const double *hp, int ndim, const int64_t *shape, dopt_state_spec *out);
  /* Bytes of frame a step on this piece needs across its stages (NULL: none). */
  size_t (*frame)(const double *hp, const dopt_piece *piece);
  /* One stage of a step on one piece (see dopt_step_args). */
  dopt_status (*step)(const dopt_step_args *a);
  /* 1: the step is correct on any piece with a reducer (distributed/ shards
   * it piecewise); 0: it needs the whole tensor (an SVD of the full gradient,
   * 8-bit blocks of the logical tensor) and distributed/ runs it whole on one
   * owner rank per parameter (docs/distributed.md, owner mode). */
  int distributable;
  /* 1: every element's update reads only that element of the parameter, the gradient and the elementwise states
   * (no statistic over elements, one stage, no reducer), so a step on any sub-range is the step on those
   * elements: the reference runs a bf16 parameter's step in cache-sized runs, each widened, stepped and rounded
   * back in one pass (optim_step.c). 0: the step runs on whole pieces. */
  int pointwise;
  /* Per parameter, for an optimizer that is not distributable: 1 when this
   * parameter's step needs the whole tensor (owner mode), 0 when it runs on
   * any piece (a GaLore parameter that is not projected is plain AdamW; an
   * 8-bit optimizer's tensor below min_8bit_size keeps fp32 states). NULL:
   * every parameter of a non-distributable optimizer is whole. The answer
   * depends only on the hyperparameters and the logical shape, so every rank
   * gives the same one. Use dopt__impl_whole. */
  int (*whole)(const double *hp, int ndim, const int64_t *shape);
  /* The work of one step of a parameter of this logical shape, in multiply-adds (docs/distributed.md,
   * "Owners by cost"; a periodic refresh amortised over its period), so distributed/ balances owners by it.
   * NULL: DOPT_COST_PER_ELEMENT per element (an elementwise step). Use dopt__impl_cost. */
  double (*cost)(const double *hp, int ndim, const int64_t *shape);
  /* For a parameter whose step needs the whole tensor (whole): the leading indices of its [b, h, w] view
   * (dopt_piece_full) when each steps on its own and every state is elementwise (Muon's expert stack
   * [E, out, in], orthogonalised per expert: E units), so the step runs on any piece of whole units and
   * distributed/ spreads one tensor's units over several owners (docs/distributed.md, "Owner units");
   * else 1. NULL: 1. Use dopt__impl_units. */
  int64_t (*units)(const double *hp, int ndim, const int64_t *shape);
  /* Non-NULL: a wrapper (LISA). Its own keys are hp[]; every other key
   * belongs to the inner optimizer it chooses (docs/lisa.md). */
  const struct dopt_wrap_ops *wrap;
  /* Settings that exercise the optimizer where nobody chose any
   * (dopt_optim_info): `example` (NULL: the defaults) on compare's small
   * synthetic model (--matrix; compare, --sweep, bench, mem when the defaults
   * are not a valid optimizer); `grid` (NULL-terminated, >= 1 entry; NULL: the defaults alone) on the
   * equivalence grid's parameter set (tensors of 1..13 rows and columns, 100
   * steps), the first grid_ci (0: 1) of them on every CI layout. Choose them
   * so every path of the step runs: refreshes, thresholds, options. */
  const char *example;
  const char *const *grid;
  int grid_ci;
  /* Non-NULL: a projection wrapper (GaLore, ref/galore.c). Its hp[] are
   * `inner` (hp[0], an enum of the registry) and its own keys; the
   * optimizer steps the impl compose() builds for the inner whp[0] names
   * (the inner's keys appended, `composed` set; core/optim.c frees it with
   * dopt__impl_release), or it fails when that inner cannot be wrapped. */
  dopt_status (*compose)(const struct dopt_optim_impl *self, const double *whp, const struct dopt_optim_impl **out);
  int composed;   /* 1: built by compose (heap; hp[0] is `inner` and fixed for the optimizer's life) */
  int nown;       /* a composite: hp[0, nown) are the wrapper's own keys, the inner's follow */
  int projection; /* 1: a gradient projection (GaLore, its fixed-inner aliases, APOLLO): not a projection wrapper's inner */
  int projector_hook; /* 1: its refreshes call dopt_step_args.proj_hook (dopt_galore_step) */
  /* A projection wrapper around this optimizer decays the full weight
   * itself (the inner's weight_decay is zeroed in its low-rank step):
   * p ← p + factor·p. NULL: after the back-projected update, factor
   * (float)(−lr·weight_decay) (galore_torch's GaLoreAdamW/AdamW8bit).
   * Otherwise this sets *factor from the low-rank step's states (after it
   * ran) and returns 1 to decay before the update, 0 after; *factor = 0: no
   * decay. hp: the inner's keys. */
  int (*lowrank_decay)(const double *hp, int64_t step, void *const *state, float *factor);
  /* Non-NULL: the parameter holds different points in training and in evaluation (Schedule-Free's y and x):
   * moves n elements of a parameter stepped `step` times between them, elementwise (to_eval 1: train → eval,
   * 0: back); state: its elementwise states at those elements. dopt_optim_set_mode and dopt_dist_set_mode run
   * it on every piece; the step runs in train mode only. NULL: one point (dopt_optim_set_mode is refused). */
  void (*swap)(const double *hp, int to_eval, int64_t step, size_t n, float *param, void *const *state);
} dopt_optim_impl;

/* The cost of an elementwise step per element, in multiply-adds (an Adam update: two moments, a square root,
 * a division, the update and the decay). */
#define DOPT_COST_PER_ELEMENT 8.0
/* impl->cost, or DOPT_COST_PER_ELEMENT per element. */
double dopt__impl_cost(const dopt_optim_impl *im, const double *hp, int ndim, const int64_t *shape);

/* impl->units for a parameter in owner mode (dopt__impl_whole), checked: the [b, h, w] view's b or 1. */
int64_t dopt__impl_units(const dopt_optim_impl *im, const double *hp, int ndim, const int64_t *shape);

/* Owners for n whole-tensor steps over `world` ranks (distributed/'s owner mode, docs/distributed.md "Owners
 * by cost"): the steps in decreasing cost (then state bytes, then index), each to the rank where the larger
 * of its cost and state bytes, as shares of their totals, stays smallest (then their sum, then the lowest
 * rank). From the inputs alone, so every rank computes the same map. owner[n]: world slots; 0 on success,
 * -1 out of memory. */
int dopt__assign_owners(int n, const double *cost, const double *bytes, int world, int *owner);

/* Frees an impl built by a projection wrapper's compose (no-op for the registered ones). */
void dopt__impl_release(const dopt_optim_impl *im);

/* 1 when a parameter of this logical shape steps whole (owner mode in distributed/): impl->whole, else
 * !impl->distributable. */
int dopt__impl_whole(const dopt_optim_impl *im, const double *hp, int ndim, const int64_t *shape);

/* A wrapper optimizer around an inner registry optimizer. The optimizer
 * object then runs the inner impl (groups hold the inner hyperparameters)
 * and asks the schedule once per step, before the parameter loop, which
 * parameters are frozen; the single-device loop (core/optim_step.c) and
 * distributed/ apply the same answer. */
typedef struct dopt_wrap_ops {
  /* The inner optimizer chosen by the wrapper's hyperparameters whp. */
  const dopt_optim_impl *(*inner)(const double *whp);
  /* gstep: 0-based number of steps before this one; layer[np]: each
   * parameter's layer index. Sets frozen[i] (a frozen parameter is skipped
   * exactly as a NULL gradient) and *reset = 1 when every parameter with a
   * layer >= 0 restarts from zero states and step 0 before this step. */
  dopt_status (*schedule)(const double *whp, int64_t gstep, int np, const int *layer, unsigned char *frozen,
                          int *reset);
} dopt_wrap_ops;

/* The optimizer object over one implementation (the public name-based
 * calls, dopt_optim_create etc., are ref/registry.c's: they look the name up
 * and call these). */
dopt_status dopt__optim_create_impl(const dopt_optim_impl *im, const char *hparams, dopt_optim **out);
dopt_status dopt__impl_state_bytes(const dopt_optim_impl *im, const char *hparams, int ndim, const int64_t *shape,
                                   size_t *bytes);
dopt_status dopt__impl_describe(const dopt_optim_impl *im, char *buf, size_t cap);
/* The implementation and group hyperparameters of a registry optimizer. */
const dopt_optim_impl *dopt__optim_impl(const dopt_optim *o);
const double *dopt__optim_group_hp(const dopt_optim *o, int group);
/* The wrapper's own hyperparameters and the steps taken so far (LISA's clock). */
const double *dopt__optim_wrapper_hp(const dopt_optim *o);
int64_t dopt__optim_gstep(const dopt_optim *o);
dopt_param *dopt__optim_param(dopt_optim *o, int i);
/* The wrapper around o's impl (LISA), or NULL. */
const dopt_optim_impl *dopt__optim_wrapper(const dopt_optim *o);
/* Tests: the smallest piece a parameter is split into for the threads (0:
 * the default, 32768 elements), and the most pieces any parameter had in the
 * last step, or parts a whole-tensor step split its work into (dopt_par; 1:
 * nothing was split). */
void dopt__optim_set_min_chunk(dopt_optim *o, size_t elements);
int dopt__optim_last_parts(const dopt_optim *o);
/* Frees parameter i's states: it restarts from zeros and step 0 at its next step. */
void dopt__optim_free_states(dopt_optim *o, int i);

/* State specs (core/shape.c). */
/* Fills a state spec's name/dtype/shape (F32; _dtype: any dtype); elementwise: DOPT_STATE_ELEMENTWISE,
 * else DOPT_STATE_WHOLE. */
void dopt_state_def(dopt_state_spec *s, const char *name, int ndim, const int64_t *shape, int elementwise);
void dopt_state_def_dtype(dopt_state_spec *s, const char *name, dopt_dtype dtype, int ndim, const int64_t *shape,
                          int elementwise);
/* A DOPT_STATE_BLOCKWISE state of a numel-element parameter: [ceil(numel / block)] of dtype. */
void dopt_state_def_blocks(dopt_state_spec *s, const char *name, dopt_dtype dtype, size_t numel, size_t block);
/* The block of a layout's blockwise states (0: none); -1 when two of them have different blocks. */
long long dopt_layout_block(const dopt_state_spec *spec, int n);
/* (core/stats.c) Appends the factored statistics (row [..., h], column [..., w]) of a >=2-D
 * parameter to out[*n]. */
void dopt_factored_state_defs(const char *row_name, const char *col_name, int ndim, const int64_t *shape,
                              dopt_state_spec *out, int *n);

/* Runs every stage of one step back to back on dev (NULL: impl->step on the
 * host) with a->red = NULL (the single device); a->stage and a->more are
 * ignored; a->frame must hold the frame the device asks for. */
dopt_status dopt__run_stages(const dopt_device *dev, const dopt_step_args *a);

/* Σx² of a piece as a step of its own (not registered): stage 0 posts the
 * maximum, stage 1 the words, stage 2 writes the total to *a->host_out. The
 * distributed global-norm clipping runs it for every parameter's gradient
 * piece (a->grad), batched like any step. */
extern const dopt_optim_impl dopt__impl_sumsq;

#endif
