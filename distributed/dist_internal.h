/* Internal to the distributed optimizers (the files of distributed/; include/distopt/dist.h,
 * docs/distributed.md): the optimizer and parameter structs every file works
 * on, and the functions the files share. Who owns what:
 *   buffers.c     the device buffers and host scratch everything else uses, and destruction (the ground floor)
 *   comm.c        the world collectives the files share: reductions of host words, broadcasts from a stage,
 *                 a holder, a dp rank or world rank 0
 *   plan.c        creation: the layout of each parameter (TP block, ZeRO range, owner-mode units), owners
 *   batch.c       the reduction batch: statistics posted by the stages, reduced per transport and operation
 *   step.c        gradients in, the staged step: averaging, the non-finite skip, clipping, the wrapper's schedule,
 *                 rounds and buckets, the parameters back to every rank
 *   dp_sum.c      the data-parallel gradient sum: exact (block codes, words) or fp32 in the transport's order
 *   owner.c       owner mode: an optimizer whose step needs the whole tensor steps it on one rank
 *   gather.c      logical tensors gathered from the pieces, state sizes, memory, the replica check
 *   plugins.c     the plugins' table (dopt_dist_plugin_*) and dopt_dist_check_layout
 *   save_load.c   dopt_dist_save / dopt_dist_load: each rank's pieces, the agreement between ranks
 * None of them includes pthread, CUDA, NCCL or MPI headers: collectives go
 * through dopt_transport, memory and kernels through dopt_device. */
#ifndef DISTOPT_DIST_INTERNAL_H
#define DISTOPT_DIST_INTERNAL_H

#include "distopt/dist.h"

#include "grid.h"
#include "optim_impl.h"

typedef struct dist_param dist_param;

/* The reducer of one parameter: its split groups. Posts go to the batch. */
typedef struct red_ctx {
  dopt_dist_optim *d;
  int over_tp, over_dp;
  int dpt; /* the list over_dp posts to: T_DP, or T_MDP for an expert parameter */
} red_ctx;

/* The reduction batch (batch.c): what the stages of one round posted, per
 * operation (MAX F64, SUM I64) and transport (tp, dp, moe_dp): a parameter split over
 * both posts to both lists, and gets the TP reduction, then the DP one (MAX
 * and integer SUM compose exactly in any order). A list of one array is
 * reduced in place; longer lists are packed into a staging buffer of device
 * memory and unpacked after. */
enum { OP_MAX, OP_SUM, NOPS };
enum { T_TP, T_DP, T_MDP, NTRANSPORTS };

typedef struct post {
  void *x;
  size_t n;
} post;

typedef struct post_list {
  post *v;
  size_t len, cap, words;
} post_list;

typedef struct batch {
  post_list l[NOPS][NTRANSPORTS];
  void *stage_buf; /* device staging buffer for packing */
  size_t stage_cap; /* bytes */
  dopt_status err;  /* first failure of a post (the reducer's return is also checked) */
  int64_t collectives; /* collectives issued by reductions (statistics) so far */
} batch;

struct dist_param {
  char *name;
  int group;
  int stage; /* its pipeline stage: held, reduced and stepped only by the ranks of that stage (dd_present) */
  int expert; /* MoE: its expert id, -1 dense */
  int home;   /* MoE: the ep rank that holds the expert (dd_present), -1 dense (every ep rank) */
  int ndim;
  int64_t shape[DOPT_MAX_DIMS]; /* logical */
  dopt_tp_role role;
  int lndim;
  int64_t lshape[DOPT_MAX_DIMS]; /* TP-local block */
  size_t lnumel;
  size_t chunk;  /* ZeRO shard size (lnumel when not sharded) */
  size_t padded; /* chunk · dp when sharded, else lnumel */
  dopt_piece pc;
  dopt_piece gpc; /* where this rank holds the averaged gradient after the dp sum: pc, or (owner mode) the whole
                   * TP block on the owner's dp row and nothing on the others */
  int bf16;
  int master_sharded; /* zero 3, or bf16 with zero >= 1: the fp32 master stays a shard */
  float *grad;   /* [padded] accumulated gradients */
  float *master; /* fp32 values: [chunk] if master_sharded, else [padded] */
  uint16_t *work; /* bf16 working copy: [chunk] (zero 3) or [padded] */
  int nstates;
  dopt_state_spec spec[DOPT_MAX_STATES];
  void *state[DOPT_MAX_STATES]; /* elementwise: [chunk]; blockwise: [nblk]; others whole (owner mode: all whole) */
  /* blockwise states (8-bit absmax; piecewise parameters only): the block, the blocks the elements of this
   * rank's piece (pc) fall in (host [nblk], ascending: the order of the state buffers), and the blocks
   * several ranks hold elements of, whose values the step reduces by MAX (the same list on every rank) */
  size_t qblock;
  size_t nblk;
  size_t *blk;
  dopt_block_share share;
  int64_t step;
  int acc;        /* the accumulator holds a gradient since the last step */
  int avgd;       /* the exact dp sum averaged this rank's piece as it decoded it (its non-finite count: avg_bad) */
  int64_t avg_bad;
  float *mb;      /* batch-invariant mode: device [mb_cap · lnumel], this step's micro-batch gradients */
  int nmb, mb_cap;
  red_ctx rc;
  dopt_reducer red;
  size_t est;     /* rank-independent frame estimate for bucketing: logical bytes / ranks sharing */
  /* owner mode (a parameter whose step needs the whole tensor, dopt__impl_whole):
   * one rank, (tp rank owner_tp, dp rank owner), holds the logical fp32 values
   * and every state whole, and steps them with the reference's own step */
  int owned;           /* this parameter steps in owner mode */
  int owner, owner_tp; /* the owning rank's dp and tp ranks (owner mode, one unit) */
  /* owner units (dopt__impl_units: an expert stack's matrices): the tensor is nunits equal runs of the
   * logical tensor (and of each TP block); world slot s = dp rank · tp + tp rank owns units
   * [ub[s], ub[s + 1]) (host [world + 1], ascending); one unit: ub NULL, the whole tensor on (owner,
   * owner_tp). dd_units reads either. */
  int64_t nunits;
  size_t *ub;
  size_t u0, u1;      /* this rank's units: what full and the states hold (owner mode) */
  float *full;        /* [(u1 - u0) · numel / nunits] its units' logical fp32 values (owner ranks only) */
  int64_t cnt_last[DOPT_NCOUNTERS];  /* dopt_counters of this rank's piece: the last step call's counts */
  int64_t cnt_total[DOPT_NCOUNTERS]; /* since creation */
  int64_t cnt_seen[DOPT_NCOUNTERS];  /* cnt_total at the last dopt_dist_check_counters */
};

struct dopt_dist_optim {
  const dopt_optim_impl *impl;
  double (*hp)[DOPT_MAX_HPARAMS]; /* per group */
  int ngroups;
  dist_param *p;
  int np;
  dopt_transport tp, dp;
  dopt_transport pp; /* the pipeline group (size 1, ops NULL: no pipeline) */
  dopt_transport ep; /* MoE: the expert-parallel group (size 1, ops NULL: none) */
  dopt_transport mdp; /* MoE: the expert-data-parallel group, the experts' dp group (no MoE: dp) */
  size_t chunk_elems; /* Gemini: dopt_dist_config.chunk_elems; 0: per-tensor ZeRO */
  dopt_chunk_slot *gem; /* Gemini: [np] parameter i's place in its chunk (dopt_chunk_pack of TP rank 0's blocks,
                         * the largest of an uneven split: the same on every TP rank; NULL: per-tensor ZeRO) */
  const dopt_device *dev;
  int zero;
  double max_grad_norm;
  int skip_nonfinite;
  int micro;        /* micro-batches accumulated since the last step */
  int64_t skipped;
  int eval;         /* dopt_dist_set_mode: evaluation mode (an impl with swap), the step refused */
  float *up;        /* device buffer for uploading one gradient */
  size_t up_cap;    /* bytes */
  size_t bucket_bytes; /* frame budget of one bucket of steps (0: one bucket) */
  void *frames;     /* device memory: the frames of one bucket */
  size_t frames_cap;
  dopt_step_args *args; /* [np] one bucket's step arguments */
  size_t *frame_off;   /* [np] */
  int *more;           /* [np] */
  int nowned;       /* parameters in owner mode (the others step piecewise) */
  const dopt_optim_impl *wrapper; /* LISA around impl, or NULL */
  double whp[DOPT_MAX_HPARAMS];   /* the wrapper's own hyperparameters */
  int64_t gstep;    /* steps taken (the wrapper's clock) */
  int *layer;       /* [np] layer index per parameter (the wrapper's schedule) */
  unsigned char *has;    /* [np] this rank received a gradient since the last step */
  unsigned char *frozen; /* [np] the wrapper froze it for this step */
  unsigned char *skip;   /* [np] not stepped this step: no gradient on any rank, or frozen */
  int64_t *flags;   /* device [np + 1]: non-finite count, then per-parameter presence, for one MAX */
  float *zeros;     /* host zeros [zeros_cap] for absent gradients and state resets */
  size_t zeros_cap;
  float *xfer;      /* device [max numel]: a whole logical tensor in transit (owner mode) */
  void *xs, *xr;    /* device: what the owner exchanges send and receive (owner.c) */
  size_t xs_cap, xr_cap; /* bytes */
  size_t xn;        /* max(tp, dp) */
  size_t *xc;       /* host [5 · xn]: an exchange's send counts and offsets, receive counts and offsets, cursors */
  const void **views; /* host [xn]: the bucketed dp sum's sources read in place (all_to_allv_view, dp_sum.c) */
  int viewing;      /* the current bucket's parts are read through views until its view_release (2: through
                     * nviews, all_to_allv_view_n: each parameter's where its gradient lies) */
  int view_b0;      /* viewing 2: the bucket's first parameter */
  const void **nviews, **nsends; /* host [nb·dp], [nb]: all_to_allv_view_n's views and sends (dp_sum.c) */
  size_t *ncnt, ncap;            /* host [3·ncap]: its counts and displacements; ncap: nb·dp entries held */
  size_t nsends_cap;             /* entries of nsends held */
  size_t *xoff;     /* [np] a parameter's offset in the exchange's receive buffer */
  int *xlist, *xord; /* [np] a batch of owned parameters; one owner row's of them in exchange order */
  int gather_lead;  /* DOPT_DIST_GATHER_LEAD: gathers deliver to the lead only (gather.c; set_gather
                     * checked that both transports have all_to_allv) */
  int batch;        /* between dopt_dist_gather_begin and _end, read in place: the lead's gathers copy from
                     * the ranks' pieces where they lie (gather.c) */
  int bstride;      /* entries per parameter in bmine: 0 values, 1 bf16 copy, 2 + k state k */
  uint64_t *bmine;  /* host [np · bstride]: where this rank holds each entry (its shard, or the whole block) */
  uint64_t *bpeer;  /* host [dp]: on dp rank 0, where each dp rank's bmine lies */
  uint64_t *btp;    /* host [tp]: on the lead, where each tp rank's bpeer lies */
  void *gdev[2];    /* device scratch of gathers (kept: no allocation, no page faults per call) */
  size_t gdev_cap[2];
  unsigned char *ghost[3]; /* host scratch: gathers, loads and checkpoints (0, 1); a stage lead's gather (2) */
  size_t ghost_cap[3];
  size_t xfer_cap;  /* bytes */
  batch b;
  double *ss;       /* per-parameter Σg² (clipping) */
  /* the exact dp sum (distopt/dpsum.h) */
  int dp_words;     /* int64 words per element; 0: fp32 in the transport's order */
  int keep;         /* batch-invariant: micro-batches kept and summed on the grid one by one */
  size_t *code_off; /* [np + 1] parameter i's block codes at codes[code_off[i]], its non-finite flag just before */
  size_t ncodes;
  int32_t *codes;   /* device [ncodes], one MAX over the world */
  int32_t *hflags;  /* host [np] */
  int64_t *words;   /* device [padded · dp_words] of the largest parameter */
  size_t words_cap;
  int64_t *cls;     /* device [padded]: NaN/±inf counts, when a parameter has a non-finite value */
  size_t cls_cap;
  float *parts;     /* device: a bucket's dp parts of each segment (the bucketed dp sum, dp_sum.c) */
  size_t parts_cap;
  float *pack;      /* device: what a bucket's exchange or gather sends (dp_sum.c, step.c) */
  size_t pack_cap;
  size_t *part_at;  /* [np] dp_sum.c: a parameter's parts in each source's region of the bucket's exchange */
};

#define DEV(d) ((d)->dev->ops)
#define DCTX(d) ((d)->dev->ctx)

/* Whether this rank holds p: its stage, and for an expert parameter its ep rank (the parameter of another stage
 * or ep rank has an empty TP block here). */
static inline int dd_present(const dopt_dist_optim *d, const dist_param *p) {
  return p->stage == d->pp.rank && (p->home < 0 || p->home == d->ep.rank);
}

/* The one rank of the ep group that counts p in what spans the model (SUMs over pp and ep): its holder, or for
 * a dense parameter (held on every ep rank) ep rank 0. */
static inline int dd_home(const dopt_dist_optim *d, const dist_param *p) {
  return dd_present(d, p) && (p->home >= 0 || d->ep.rank == 0);
}

/* MoE: a stack of every expert (DOPT_DIST_EXPERT_STACK) split over ep: each ep rank's experts' slices of the TP
 * block are sharded over its moe_dp ranks (dd_shard: exact ranges of the block). */
static inline int dd_ep_stack(const dopt_dist_optim *d, const dist_param *p) {
  return p->expert == DOPT_DIST_EXPERT_STACK && d->ep.size > 1;
}

/* Shards that are exact ranges of the TP block rather than equal padded slots (Gemini's chunks, an ep-split
 * stack): the collectives that move them use exact counts (all_to_allv). */
static inline int dd_exact_shards(const dopt_dist_optim *d, const dist_param *p) {
  return d->gem != NULL || dd_ep_stack(d, p);
}

/* p's data-parallel group: dp, or for an expert parameter the expert-data-parallel group moe_dp. Its gradient
 * is summed and its ZeRO shards cut over this group (an ep-split stack: dp, its shards within each ep rank). */
static inline const dopt_transport *dd_dpg(const dopt_dist_optim *d, const dist_param *p) {
  return p->expert >= 0 ? &d->mdp : &d->dp;
}

/* This rank in the world (dopt_world_rank_of: (stage · dp + dp rank) · tp + tp rank). */
static inline int64_t dd_world_rank(const dopt_dist_optim *d) {
  const dopt_rank_coords c = {d->pp.rank, d->dp.rank, d->tp.rank, 0, 0};
  return dopt_world_rank_of(&c, d->tp.size, d->dp.size);
}

/* ---- buffers.c ---------------------------------------------------------------------------- */

dopt_status dd_dalloc(dopt_dist_optim *d, size_t bytes, void **out);
dopt_status dd_grow_dev(dopt_dist_optim *d, void **buf, size_t *cap, size_t bytes);
/* d->nviews, d->nsends and d->ncnt for nb exchanges over a group of D ranks (the transports' *_view_n). */
dopt_status dd_grow_views(dopt_dist_optim *d, size_t nb, size_t D);
dopt_status dd_zero_dev(dopt_dist_optim *d, void *x, size_t bytes);
dopt_status dd_gdev(dopt_dist_optim *d, int k, size_t bytes, void **out);
dopt_status dd_ghost(dopt_dist_optim *d, int k, size_t bytes, unsigned char **out);
void dd_gather_batch_free(dopt_dist_optim *d);

/* ---- comm.c ------------------------------------------------------------------------------- */

/* h[n] (host) ← its reduction by op over one stage (tp, then dp; pp_too: then over pp, the whole world). */
dopt_status dd_reduce_i64(dopt_dist_optim *d, int64_t *h, size_t n, dopt_redop op, int pp_too);
dopt_status dd_world_reduce(dopt_dist_optim *d, int64_t *h, size_t n, dopt_redop op);
/* Device x[count] of the ranks of stage `stage` to the other stages' ranks with the same tp and dp ranks (one
 * broadcast over pp; nothing without a pipeline). */
dopt_status dd_from_stage(dopt_dist_optim *d, int stage, void *x, size_t count, dopt_dtype dt);
/* Device x[count] of the ranks that hold p (its stage; an expert parameter: its ep rank) to every rank with the
 * same tp rank and moe_dp rank (over ep from the holder, then over pp from its stage). */
dopt_status dd_from_holder(dopt_dist_optim *d, const dist_param *p, void *x, size_t count, dopt_dtype dt);
/* Device x[count] of world rank 0 to every rank: over pp among the stages' leads, then in each stage
 * (dd_from_rank 0, 0). */
dopt_status dd_from_world0(dopt_dist_optim *d, void *x, size_t count, dopt_dtype dt);
dopt_status dd_world_max(dopt_dist_optim *d, int64_t *h, size_t n);
/* Host x[np] (dt: F64 or I64) ← its SUM over pp and ep, where each parameter's entry counts on its home
 * (dd_home) only (the others' are zeroed first): every rank gets the value of the ranks that hold it. */
dopt_status dd_sum_over_homes(dopt_dist_optim *d, void *x, dopt_dtype dt);
/* Sends device x[count] of the rank `owner` of group g (dp or moe_dp), tp rank `owner_tp`, to every rank of g's
 * tp x g grid. */
dopt_status dd_from_rank(dopt_dist_optim *d, const dopt_transport *g, int owner, int owner_tp, void *x, size_t count,
                         dopt_dtype dt);

/* ---- plan.c ------------------------------------------------------------------------------- */

dopt_status dd_check_param(const dopt_dist_optim *d, int i, const char *fn);
void dd_held_piece(const dist_param *p, int sharded, dopt_piece *out);
dopt_status dd_load_values(dopt_dist_optim *d, dist_param *p, const float *full);
size_t dd_state_held_bytes(const dist_param *p, int k);
void dd_tp_block(const dist_param *p, int tp, int r, size_t *h0, size_t *hl, size_t *w0, size_t *wl);
/* The ZeRO range [*lo, *lo + *len) of TP rank r's block of p that rank q of its dp group holds: per tensor,
 * q · S with S = ceil(n / group size); Gemini, the part of q's shard of the chunk the block lies in; an ep-split
 * stack, part m of ep rank e's experts' run (q = m · ep + e, dd_ep_range) (docs/distributed.md). */
void dd_shard(const dopt_dist_optim *d, const dist_param *p, int r, size_t q, size_t *lo, size_t *len);
/* An ep-split stack: the elements [*x0, *x1) of TP rank r's block that ep rank e's experts occupy. */
void dd_ep_range(const dopt_dist_optim *d, const dist_param *p, int r, int e, size_t *x0, size_t *x1);
/* Owner mode: the units [*u0, *u1) of world slot `slot` (dp rank · tp + tp rank), or of dp row `row`'s slots
 * (dd_row_units: the part of every TP block that row sums and steps). */
void dd_units(const dopt_dist_optim *d, const dist_param *p, int slot, size_t *u0, size_t *u1);
void dd_row_units(const dopt_dist_optim *d, const dist_param *p, int row, size_t *u0, size_t *u1);
float dd_avg_denom(const dopt_dist_optim *d, const dist_param *p);

/* The bucket of the dp sum's exchange and the weights' gather that starts at parameter b0 (plan.c): the end
 * of the run of consecutive parameters (those `member` accepts; NULL: all) whose logical bytes / tp fit
 * d->bucket_bytes (0: no limit); a parameter of at least half the budget is a bucket of its own (sent and
 * gathered in place, no packing copy); dense and expert parameters never share one (each bucket moves over one
 * data-parallel group, dd_dpg). The same cut on every rank. */
int dd_bucket_end(const dopt_dist_optim *d, int b0, int (*member)(const dopt_dist_optim *d, int i));

/* ---- batch.c ------------------------------------------------------------------------------ */

dopt_status dd_flush(dopt_dist_optim *d);
dopt_status dd_post_max(void *ctx, double *x, size_t n);
dopt_status dd_post_sum(void *ctx, int64_t *x, size_t n);

/* ---- dp_sum.c ----------------------------------------------------------------------------- */

dopt_status dd_dp_sum(dopt_dist_optim *d, const dist_param *p, void *x, size_t per, dopt_dtype dt);
dopt_status dd_exact_dp_sum(dopt_dist_optim *d);

/* ---- owner.c ------------------------------------------------------------------------------ */

dopt_status dd_owner_steps(dopt_dist_optim *d);

/* ---- gather.c ----------------------------------------------------------------------------- */

dopt_status dd_gather(dopt_dist_optim *d, const dist_param *p, int entry, const void *src, int sharded, size_t elem,
                      dopt_dtype dt, void *out);
dopt_status dd_gather_blocks(dopt_dist_optim *d, const dist_param *p, int k, float *out);

#endif
