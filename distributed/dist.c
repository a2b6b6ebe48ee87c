/* Distributed optimizers (include/distopt/dist.h, docs/distributed.md).
 *
 * Every rank runs the reference's step code (core/optim_impl.h) on its piece
 * of each logical tensor; the statistics that span the tensor go through a
 * reducer over exactly the ranks that hold its pieces (TP if the tensor is
 * TP-split, DP if it is ZeRO-sharded; replicas never add up twice) using MAX
 * and integer SUM, which are exact in any order. Steps run in stages, all
 * parameters of a bucket together: a round runs every step's next stage,
 * whose posts are packed per transport and operation and reduced in one
 * collective each (docs/architecture.md), so a step costs O(phases)
 * collectives per bucket, not O(parameters × statistics). Only the
 * data-parallel gradient sum is a floating-point collective; the transport
 * sums it in rank order, and the reference mirrors that order.
 *
 * This file never includes pthread, CUDA or NCCL headers: collectives go
 * through dopt_transport, memory and kernels through dopt_device. */
#include "distopt/dist.h"

#include "distopt/checkpoint.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grid.h"
#include "optim_impl.h"

typedef struct dist_param dist_param;

/* The reducer of one parameter: its split groups. Posts go to the batch. */
typedef struct red_ctx {
  dopt_dist_optim *d;
  int over_tp, over_dp;
} red_ctx;

/* ---- the reduction batch ----------------------------------------------------------------
 * What the stages of one round posted, per operation (MAX F64, SUM I64) and
 * transport (tp, dp): a parameter split over both posts to both lists, and
 * gets the TP reduction, then the DP one (MAX and integer SUM compose exactly
 * in any order). A list of one array is reduced in place; longer lists are
 * packed into a staging buffer of device memory and unpacked after. */
enum { OP_MAX, OP_SUM, NOPS };
enum { T_TP, T_DP, NTRANSPORTS };

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
  int ndim;
  int64_t shape[DOPT_MAX_DIMS]; /* logical */
  dopt_tp_role role;
  int lndim;
  int64_t lshape[DOPT_MAX_DIMS]; /* TP-local block */
  size_t lnumel;
  size_t chunk;  /* ZeRO shard size (lnumel when not sharded) */
  size_t padded; /* chunk · dp when sharded, else lnumel */
  dopt_piece pc;
  int bf16;
  int master_sharded; /* zero 3, or bf16 with zero >= 1: the fp32 master stays a shard */
  float *grad;   /* [padded] accumulated gradients */
  float *master; /* fp32 values: [chunk] if master_sharded, else [padded] */
  uint16_t *work; /* bf16 working copy: [chunk] (zero 3) or [padded] */
  int nstates;
  dopt_state_spec spec[DOPT_MAX_STATES];
  void *state[DOPT_MAX_STATES]; /* elementwise: [chunk]; others whole */
  int64_t step;
  int acc;        /* the accumulator holds a gradient since the last step */
  float *mb;      /* batch-invariant mode: device [mb_cap · lnumel], this step's micro-batch gradients */
  int nmb, mb_cap;
  red_ctx rc;
  dopt_reducer red;
  size_t est;     /* rank-independent frame estimate for bucketing: logical bytes / ranks sharing */
  /* owner mode (an optimizer whose step needs the whole tensor): one rank,
   * (tp rank owner_tp, dp rank owner), holds the logical fp32 values and
   * every state whole, and steps them with the reference's own step */
  int owner, owner_tp; /* the owning rank's dp and tp ranks (owner mode) */
  float *full;        /* [numel] the logical fp32 values (owner ranks only) */
  unsigned events;    /* DOPT_EVENT_* of the last step (owner ranks) */
};

struct dopt_dist_optim {
  const dopt_optim_impl *impl;
  double (*hp)[DOPT_MAX_HPARAMS]; /* per group */
  int ngroups;
  dist_param *p;
  int np;
  dopt_transport tp, dp;
  const dopt_device *dev;
  int zero;
  double max_grad_norm;
  int skip_nonfinite;
  int micro;        /* micro-batches accumulated since the last step */
  int64_t skipped;
  float *up;        /* device buffer for uploading one gradient */
  size_t up_cap;    /* bytes */
  size_t bucket_bytes; /* frame budget of one bucket of steps (0: one bucket) */
  void *frames;     /* device memory: the frames of one bucket */
  size_t frames_cap;
  dopt_step_args *args; /* [np] one bucket's step arguments */
  size_t *frame_off;   /* [np] */
  int *more;           /* [np] */
  int owned;        /* the optimizer's step needs whole tensors: owner mode for every parameter */
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
  void *gdev[2];    /* device scratch of gathers (kept: no allocation, no page faults per call) */
  size_t gdev_cap[2];
  unsigned char *ghost[3]; /* host scratch: gathers (0, 1), the owner step's whole tensor (2) */
  size_t ghost_cap[3];
  size_t xfer_cap;  /* bytes */
  batch b;
  double *ss;       /* per-parameter Σg² (clipping) */
  /* the exact dp sum (distopt/dpsum.h) */
  int dp_words;     /* int64 words per element; 0: fp32 in the transport's order */
  int keep;         /* batch-invariant: micro-batches kept and summed on the grid one by one */
  size_t *code_off; /* [np] parameter i's block codes at codes[code_off[i]]; codes[0, np): its non-finite flag */
  size_t ncodes;
  int32_t *codes;   /* device [ncodes], one MAX over the world */
  int32_t *hflags;  /* host [np] */
  int64_t *words;   /* device [padded · dp_words] of the largest parameter */
  size_t words_cap;
  int64_t *cls;     /* device [padded]: NaN/±inf counts, when a parameter has a non-finite value */
  size_t cls_cap;
};

/* ---- helpers ------------------------------------------------------------------------- */

#define DEV(d) ((d)->dev->ops)
#define DCTX(d) ((d)->dev->ctx)

static dopt_status push(batch *b, int op, int t, void *x, size_t n) {
  post_list *l = &b->l[op][t];
  if (l->len == l->cap) {
    size_t cap = l->cap ? 2 * l->cap : 64;
    post *v = realloc(l->v, cap * sizeof *v);
    if (!v) return b->err = dopt__fail(DOPT_ERR_NO_MEMORY, "distributed step: reduction batch of %zu arrays", cap);
    l->v = v;
    l->cap = cap;
  }
  l->v[l->len].x = x;
  l->v[l->len].n = n;
  l->len++;
  l->words += n;
  return DOPT_OK;
}

static dopt_status post_op(void *ctx, int op, void *x, size_t n) {
  red_ctx *r = ctx;
  if (n == 0) return DOPT_OK;
  if (r->over_tp) DOPT_TRY(push(&r->d->b, op, T_TP, x, n));
  if (r->over_dp) DOPT_TRY(push(&r->d->b, op, T_DP, x, n));
  return DOPT_OK;
}

static dopt_status post_max(void *ctx, double *x, size_t n) { return post_op(ctx, OP_MAX, x, n); }
static dopt_status post_sum(void *ctx, int64_t *x, size_t n) { return post_op(ctx, OP_SUM, x, n); }

static dopt_status grow_dev(dopt_dist_optim *d, void **buf, size_t *cap, size_t bytes);

/* Reduces everything posted since the last flush: per operation and
 * transport, one collective over the packed words. Every rank of a group
 * posts the same arrays in the same order (pieces of the same tensors, the
 * same stages), so the collectives match. */
static dopt_status flush(dopt_dist_optim *d) {
  batch *b = &d->b;
  dopt_status s = b->err;
  for (int op = 0; op < NOPS; op++) {
    for (int t = 0; t < NTRANSPORTS; t++) {
      post_list *l = &b->l[op][t];
      const dopt_transport *tr = t == T_TP ? &d->tp : &d->dp;
      const dopt_dtype dt = op == OP_MAX ? DOPT_F64 : DOPT_I64;
      const dopt_redop rop = op == OP_MAX ? DOPT_MAX : DOPT_SUM;
      if (s == DOPT_OK && l->len == 1) {
        s = tr->ops->all_reduce(tr->comm, l->v[0].x, l->v[0].x, l->v[0].n, dt, rop);
        b->collectives++;
      } else if (s == DOPT_OK && l->len > 1) {
        s = grow_dev(d, &b->stage_buf, &b->stage_cap, l->words * 8); /* F64 and I64 words alike */
        unsigned char *buf = b->stage_buf;
        for (size_t i = 0, off = 0; s == DOPT_OK && i < l->len; off += l->v[i].n * 8, i++)
          s = DEV(d)->copy(DCTX(d), buf + off, l->v[i].x, l->v[i].n * 8);
        if (s == DOPT_OK) s = tr->ops->all_reduce(tr->comm, buf, buf, l->words, dt, rop);
        b->collectives++;
        for (size_t i = 0, off = 0; s == DOPT_OK && i < l->len; off += l->v[i].n * 8, i++)
          s = DEV(d)->copy(DCTX(d), l->v[i].x, buf + off, l->v[i].n * 8);
      }
      l->len = 0;
      l->words = 0;
    }
  }
  b->err = DOPT_OK;
  return s;
}

/* Uneven split of n items over `parts`: part r gets base + (r < rem). */
static void split_range(size_t n, int parts, int r, size_t *off, size_t *len) {
  size_t base = n / (size_t)parts, rem = n % (size_t)parts, ur = (size_t)r;
  *len = base + (ur < rem);
  *off = ur * base + (ur < rem ? ur : rem);
}

/* The TP block of a parameter for TP rank r: rows/cols of the [b, h, w] view. */
static void tp_block(const dist_param *p, int tp, int r, size_t *h0, size_t *hl, size_t *w0, size_t *wl) {
  dopt_piece full;
  dopt_piece_full(p->ndim, p->shape, &full);
  *h0 = 0, *hl = full.h, *w0 = 0, *wl = full.w;
  if (p->role == DOPT_TP_COLUMN && p->ndim >= 2) split_range(full.h, tp, r, h0, hl);
  else if (p->role == DOPT_TP_COLUMN || p->role == DOPT_TP_ROW) split_range(full.w, tp, r, w0, wl);
}

static void free_param(dopt_dist_optim *d, dist_param *p) {
  if (p->full) DEV(d)->free(DCTX(d), p->full);
  DEV(d)->free(DCTX(d), p->grad);
  if (p->mb) DEV(d)->free(DCTX(d), p->mb);
  DEV(d)->free(DCTX(d), p->master);
  if (p->work) DEV(d)->free(DCTX(d), p->work);
  for (int k = 0; k < p->nstates; k++)
    if (p->state[k]) DEV(d)->free(DCTX(d), p->state[k]);
  free(p->name);
}

void dopt_dist_destroy(dopt_dist_optim *d) {
  if (!d) return;
  for (int i = 0; i < d->np; i++) free_param(d, &d->p[i]);
  if (d->frames) DEV(d)->free(DCTX(d), d->frames);
  if (d->b.stage_buf) DEV(d)->free(DCTX(d), d->b.stage_buf);
  if (d->xfer) DEV(d)->free(DCTX(d), d->xfer);
  for (int k = 0; k < 2; k++)
    if (d->gdev[k]) DEV(d)->free(DCTX(d), d->gdev[k]);
  for (int k = 0; k < 3; k++) free(d->ghost[k]);
  if (d->up) DEV(d)->free(DCTX(d), d->up);
  for (int op = 0; op < NOPS; op++)
    for (int t = 0; t < NTRANSPORTS; t++) free(d->b.l[op][t].v);
  if (d->flags) DEV(d)->free(DCTX(d), d->flags);
  if (d->codes) DEV(d)->free(DCTX(d), d->codes);
  if (d->words) DEV(d)->free(DCTX(d), d->words);
  if (d->cls) DEV(d)->free(DCTX(d), d->cls);
  free(d->code_off);
  free(d->hflags);
  free(d->args);
  free(d->frame_off);
  free(d->more);
  free(d->layer);
  free(d->has);
  free(d->frozen);
  free(d->skip);
  free(d->zeros);
  free(d->p);
  free(d->hp);
  free(d->ss);
  free(d);
}

/* ---- creation --------------------------------------------------------------------------- */

static dopt_status check_config(const dopt_dist_config *cfg) {
  DOPT_CHECK_ARG((cfg->version == 1 && cfg->struct_size >= DOPT_DIST_CONFIG_V1_SIZE) ||
                     (cfg->version == 2 && cfg->struct_size >= DOPT_DIST_CONFIG_V2_SIZE) ||
                     (cfg->version == DOPT_DIST_CONFIG_VERSION && cfg->struct_size >= sizeof(dopt_dist_config)),
                 "dopt_dist_create: config struct_size=%u version=%u (initialise with DOPT_DIST_CONFIG_INIT)",
                 cfg->struct_size, cfg->version);
  DOPT_CHECK_ARG(cfg->tp.ops && cfg->dp.ops, "dopt_dist_create: tp/dp transports not set");
  DOPT_CHECK_ARG(cfg->tp.size >= 1 && cfg->dp.size >= 1 && cfg->tp.rank >= 0 && cfg->tp.rank < cfg->tp.size &&
                     cfg->dp.rank >= 0 && cfg->dp.rank < cfg->dp.size,
                 "dopt_dist_create: tp rank %d of %d, dp rank %d of %d", cfg->tp.rank, cfg->tp.size, cfg->dp.rank,
                 cfg->dp.size);
  DOPT_CHECK_ARG(cfg->version < 3 || (cfg->dp_sum_words >= 0 && cfg->dp_sum_words <= DOPT_DP_SUM_WORDS_MAX),
                 "dopt_dist_create: dp_sum_words=%d must be 0 (fp32 in the transport's order), 1 or 2",
                 cfg->dp_sum_words);
  DOPT_CHECK_ARG(cfg->version < 3 || !cfg->batch_invariant || cfg->dp_sum_words >= 1,
                 "dopt_dist_create: batch_invariant=%d needs the exact dp sum (dp_sum_words=%d)", cfg->batch_invariant,
                 cfg->dp_sum_words);
  DOPT_CHECK_ARG(cfg->dp.size <= DOPT_DP_SUM_MAX_PARTS, "dopt_dist_create: dp=%d above %d", cfg->dp.size,
                 DOPT_DP_SUM_MAX_PARTS);
  DOPT_CHECK_ARG(cfg->max_grad_norm >= 0 && isfinite(cfg->max_grad_norm),
                 "dopt_dist_create: max_grad_norm=%g must be finite and >= 0", cfg->max_grad_norm);
  return dopt_dist_check_layout(cfg->plugin, cfg->tp.size, cfg->dp.size, cfg->zero_stage);
}

dopt_status dopt_dist_check_layout(const char *plugin, int tp, int dp, int zero) {
  const char *pl = plugin ? plugin : "";
  DOPT_CHECK_ARG(tp >= 1 && dp >= 1, "layout: tp=%d dp=%d must be >= 1", tp, dp);
  DOPT_CHECK_ARG(zero >= 0 && zero <= 3, "layout: zero_stage=%d outside [0, 3]", zero);
  if (strcmp(pl, "ddp") == 0) {
    DOPT_CHECK_ARG(tp == 1 && zero == 0, "plugin ddp: needs tp=1 and zero=0 (got tp=%d zero=%d)", tp, zero);
  } else if (strcmp(pl, "zero") == 0) {
    DOPT_CHECK_ARG(tp == 1 && (zero == 1 || zero == 2), "plugin zero: needs tp=1 and zero 1 or 2 (got tp=%d zero=%d)",
                   tp, zero);
  } else if (strcmp(pl, "hybrid") == 0) {
    DOPT_CHECK_ARG(zero <= 2, "plugin hybrid: zero=%d (0, 1 or 2; zero 3 is the fsdp plugin)", zero);
  } else if (strcmp(pl, "fsdp") == 0) {
    DOPT_CHECK_ARG(zero == 3, "plugin fsdp: needs zero=3 (got %d)", zero);
  } else {
    return dopt__fail(DOPT_ERR_NOT_FOUND, "unknown plugin '%s' (ddp, zero, hybrid, fsdp)", pl);
  }
  return DOPT_OK;
}

static dopt_status dalloc(dopt_dist_optim *d, size_t bytes, void **out) {
  return DEV(d)->alloc(DCTX(d), bytes ? bytes : 1, out);
}

/* A device buffer kept across calls: grown (freed and allocated again, zero
 * filled) to at least `bytes`, never shrunk. *cap is in bytes. */
static dopt_status grow_dev(dopt_dist_optim *d, void **buf, size_t *cap, size_t bytes) {
  if (bytes <= *cap) return DOPT_OK;
  if (*buf) DEV(d)->free(DCTX(d), *buf);
  *buf = NULL;
  *cap = 0;
  DOPT_TRY(dalloc(d, bytes, buf));
  *cap = bytes;
  return DOPT_OK;
}

static dopt_status ghost(dopt_dist_optim *d, int k, size_t bytes, unsigned char **out);

/* Sets this rank's values of parameter p from the logical fp32 tensor `full`
 * (host): its TP block (row by row), the fp32 extent it holds (the master
 * shard, or the whole TP-local block) and the bf16 working copy of the
 * extent it holds. At creation and after an owner step. */
static dopt_status load_values(dopt_dist_optim *d, dist_param *p, const float *full) {
  const dopt_piece *pc = &p->pc;
  unsigned char *bb = NULL;
  DOPT_TRY(ghost(d, 1, (p->lnumel ? p->lnumel : 1) * sizeof(float), &bb));
  float *blk = (float *)(void *)bb;
  for (size_t bi = 0; bi < pc->b; bi++)
    for (size_t i = 0; i < pc->hl; i++)
      memcpy(blk + (bi * pc->hl + i) * pc->wl, full + (bi * pc->h + pc->h0 + i) * pc->w + pc->w0,
             pc->wl * sizeof(float));
  size_t from = p->master_sharded ? pc->lo : 0, count = p->master_sharded ? pc->len : p->lnumel;
  dopt_status s = DEV(d)->upload(DCTX(d), p->master, blk + from, count * sizeof(float));
  if (s == DOPT_OK && p->bf16) { /* the working copy of the extent this rank holds */
    size_t wfrom = d->zero == 3 ? pc->lo : 0, wcount = d->zero == 3 ? pc->len : p->lnumel;
    unsigned char *hb = NULL;
    s = ghost(d, 0, (wcount ? wcount : 1) * sizeof(uint16_t), &hb);
    uint16_t *hw = (uint16_t *)(void *)hb;
    for (size_t k = 0; s == DOPT_OK && k < wcount; k++) hw[k] = dopt_f32_to_bf16(blk[wfrom + k]);
    if (s == DOPT_OK) s = DEV(d)->upload(DCTX(d), p->work, hw, wcount * sizeof *hw);
  }
  return s;
}

/* Bytes of state k this rank's buffer holds: an elementwise state's ZeRO
 * shard (sharded like the parameter), else the whole logical state (owner
 * mode: on the owner only). */
static size_t state_held_bytes(const dopt_dist_optim *d, const dist_param *p, int k) {
  return !d->owned && p->spec[k].elementwise ? p->chunk * sizeof(float) : p->spec[k].v.bytes;
}

/* Sets up one parameter: geometry, buffers, the initial values of its piece. */
static dopt_status setup_param(dopt_dist_optim *d, dist_param *p, const dopt_param *src, dopt_tp_role role) {
  const int tpn = d->tp.size, dpn = d->dp.size;
  p->group = src->group;
  p->ndim = src->ndim;
  memcpy(p->shape, src->shape, sizeof p->shape);
  p->role = tpn > 1 ? role : DOPT_TP_REPLICATED;
  p->bf16 = src->work != NULL;
  if (role == DOPT_TP_ROW && src->ndim < 2)
    return dopt__fail(DOPT_ERR_INVALID_ARG, "dopt_dist_create: '%s' role ROW needs a >= 2-D tensor (ndim=%d)", src->name,
                      src->ndim);
  if (role == DOPT_TP_COLUMN && src->ndim < 1)
    return dopt__fail(DOPT_ERR_INVALID_ARG, "dopt_dist_create: '%s' is a scalar; it can only be replicated", src->name);
  dopt_piece *pc = &p->pc;
  dopt_piece_full(p->ndim, p->shape, pc);
  tp_block(p, tpn, d->tp.rank, &pc->h0, &pc->hl, &pc->w0, &pc->wl);
  p->lnumel = pc->b * pc->hl * pc->wl;
  p->lndim = p->ndim;
  memcpy(p->lshape, p->shape, sizeof p->lshape);
  if (p->role == DOPT_TP_COLUMN) p->lshape[p->ndim >= 2 ? p->ndim - 2 : 0] = (int64_t)(p->ndim >= 2 ? pc->hl : pc->wl);
  if (p->role == DOPT_TP_ROW) p->lshape[p->ndim - 1] = (int64_t)pc->wl;
  /* ZeRO: flatten, pad to a multiple of dp, split evenly */
  if (d->zero >= 1) {
    p->chunk = (p->lnumel + (size_t)dpn - 1) / (size_t)dpn;
    p->padded = p->chunk * (size_t)dpn;
    pc->lo = (size_t)d->dp.rank * p->chunk;
    pc->len = pc->lo < p->lnumel ? (p->lnumel - pc->lo < p->chunk ? p->lnumel - pc->lo : p->chunk) : 0;
    if (pc->lo > p->lnumel) pc->lo = p->lnumel;
  } else {
    p->chunk = p->padded = p->lnumel;
    pc->lo = 0;
    pc->len = p->lnumel;
  }
  /* fp32 parameters are the model weights: whole on every rank up to zero 2.
   * With bf16 working copies only those are whole; the masters stay shards. */
  p->master_sharded = d->zero == 3 || (p->bf16 && d->zero >= 1);
  size_t mext = p->master_sharded ? p->chunk : p->padded, wext = d->zero == 3 ? p->chunk : p->padded;
  DOPT_TRY(dalloc(d, p->padded * sizeof(float), (void **)&p->grad));
  DOPT_TRY(dalloc(d, mext * sizeof(float), (void **)&p->master));
  if (p->bf16) DOPT_TRY(dalloc(d, wext * sizeof(uint16_t), (void **)&p->work));
  DOPT_TRY(load_values(d, p, src->data));
  /* states: elementwise ones are sharded like the parameter, the others whole */
  p->nstates = d->impl->layout(d->hp[p->group], p->ndim, p->shape, p->spec);
  if (d->owned) { /* whole states and the logical values on the owner ranks only */
    if (d->dp.rank == p->owner && d->tp.rank == p->owner_tp) {
      size_t numel = dopt_numel(p->ndim, p->shape);
      DOPT_TRY(dalloc(d, numel * sizeof(float), (void **)&p->full));
      DOPT_TRY(DEV(d)->upload(DCTX(d), p->full, src->data, numel * sizeof(float)));
      for (int k = 0; k < p->nstates; k++) DOPT_TRY(dalloc(d, state_held_bytes(d, p, k), &p->state[k]));
    }
  } else {
    for (int k = 0; k < p->nstates; k++) DOPT_TRY(dalloc(d, state_held_bytes(d, p, k), &p->state[k]));
  }
  p->step = src->step;
  p->rc.d = d;
  p->rc.over_tp = p->role != DOPT_TP_REPLICATED;
  p->rc.over_dp = d->zero >= 1 && dpn > 1;
  p->red.ctx = &p->rc;
  p->red.post_max_f64 = post_max;
  p->red.post_sum_i64 = post_sum;
  /* bucketing must cut the parameter list at the same places on every rank:
   * estimate the frame from logical sizes, not from this rank's piece */
  size_t sharing = (p->rc.over_tp ? (size_t)tpn : 1) * (p->rc.over_dp ? (size_t)dpn : 1);
  p->est = dopt_numel(p->ndim, p->shape) * sizeof(float) / sharing;
  p->name = malloc(strlen(src->name) + 1);
  if (!p->name) return dopt__fail(DOPT_ERR_NO_MEMORY, "dopt_dist_create: '%s'", src->name);
  strcpy(p->name, src->name);
  return DOPT_OK;
}

/* Owner mode: parameters go whole to the world's ranks, largest first, each
 * to the least loaded rank (ties: the lowest), as torch's
 * ZeroRedundancyOptimizer partitions whole parameters; world slot w is tp rank
 * w mod tp, dp rank w / tp. Logical sizes only, so every rank agrees. */
static void assign_owners(dopt_dist_optim *d, dopt_optim *po) {
  const int world = d->tp.size * d->dp.size;
  size_t *load = calloc((size_t)world, sizeof *load);
  char *done = calloc((size_t)(d->np > 0 ? d->np : 1), 1);
  for (int n = 0; done && load && n < d->np; n++) {
    int best = -1;
    size_t bs = 0;
    for (int i = 0; i < d->np; i++) {
      const dopt_param *q = dopt__optim_param(po, i);
      if (!done[i] && (best < 0 || q->numel > bs)) best = i, bs = q->numel;
    }
    int r = 0;
    for (int k = 1; k < world; k++)
      if (load[k] < load[r]) r = k;
    d->p[best].owner = r / d->tp.size;
    d->p[best].owner_tp = r % d->tp.size;
    load[r] += bs;
    done[best] = 1;
  }
  if (!done || !load) /* out of memory: round robin, still the same on every rank */
    for (int i = 0; i < d->np; i++) d->p[i].owner = (i / d->tp.size) % d->dp.size, d->p[i].owner_tp = i % d->tp.size;
  free(done);
  free(load);
}

dopt_status dopt_dist_create(const dopt_optim *plain, const dopt_dist_config *cfg, const dopt_tp_role *roles,
                             dopt_dist_optim **out) {
  DOPT_CHECK_ARG(plain && cfg && out, "dopt_dist_create: NULL argument");
  *out = NULL;
  DOPT_TRY(check_config(cfg));
  dopt_optim *po = (dopt_optim *)(uintptr_t)plain; /* read only */
  dopt_dist_optim *d = calloc(1, sizeof *d);
  if (!d) return dopt__fail(DOPT_ERR_NO_MEMORY, "dopt_dist_create: %zu bytes for the optimizer", sizeof *d);
  d->impl = dopt__optim_impl(plain); /* a wrapper's inner optimizer */
  d->wrapper = dopt__optim_wrapper(plain);
  if (d->wrapper) memcpy(d->whp, dopt__optim_wrapper_hp(plain), sizeof d->whp);
  d->gstep = dopt__optim_gstep(plain);
  d->owned = !d->impl->distributable; /* GaLore's SVD, 8-bit blocks of the logical tensor: owner mode */
  d->tp = cfg->tp;
  d->dp = cfg->dp;
  d->dev = cfg->device ? cfg->device : dopt_device_cpu();
  d->zero = cfg->zero_stage;
  d->max_grad_norm = cfg->max_grad_norm;
  d->skip_nonfinite = cfg->skip_nonfinite;
  d->bucket_bytes = cfg->version >= 2 ? cfg->bucket_bytes : DOPT_DIST_BUCKET_BYTES_DEFAULT;
  d->dp_words = cfg->version >= 3 ? cfg->dp_sum_words : DOPT_DP_SUM_DEFAULT_WORDS;
  d->keep = cfg->version >= 3 && cfg->batch_invariant;
  d->ngroups = dopt_optim_num_groups(plain);
  d->np = dopt_optim_num_params(plain);
  const size_t npa = d->np > 0 ? (size_t)d->np : 1;
  d->hp = calloc((size_t)d->ngroups, sizeof *d->hp);
  d->p = calloc(npa, sizeof *d->p);
  d->ss = calloc(npa, sizeof *d->ss);
  d->args = calloc(npa, sizeof *d->args);
  d->frame_off = calloc(npa, sizeof *d->frame_off);
  d->more = calloc(npa, sizeof *d->more);
  d->layer = calloc(npa, sizeof *d->layer);
  d->has = calloc(npa, 1);
  d->frozen = calloc(npa, 1);
  d->skip = calloc(npa, 1);
  dopt_status cs = DEV(d)->alloc(DCTX(d), (npa + 1) * sizeof(int64_t), (void **)&d->flags);
  if (cs != DOPT_OK) d->flags = NULL;
  if (!d->hp || !d->p || !d->ss || !d->args || !d->frame_off || !d->more || !d->layer || !d->has || !d->frozen ||
      !d->skip || !d->flags) {
    dopt_dist_destroy(d);
    return dopt__fail(DOPT_ERR_NO_MEMORY, "dopt_dist_create: %d parameters", d->np);
  }
  for (int g = 0; g < d->ngroups; g++) memcpy(d->hp[g], dopt__optim_group_hp(plain, g), sizeof d->hp[g]);
  if (d->owned) assign_owners(d, po);
  for (int i = 0; i < d->np; i++) {
    dopt_tp_role role = roles ? roles[i] : DOPT_TP_REPLICATED;
    dopt_status s = (unsigned)role > DOPT_TP_ROW
                        ? dopt__fail(DOPT_ERR_INVALID_ARG, "dopt_dist_create: roles[%d]=%d", i, (int)role)
                        : setup_param(d, &d->p[i], dopt__optim_param(po, i), role);
    d->layer[i] = dopt__optim_param(po, i)->layer;
    if (s != DOPT_OK) {
      d->np = i + 1; /* free what was set up */
      dopt_dist_destroy(d);
      return s;
    }
  }
  /* the exact dp sum's codes: np non-finite flags, then each parameter's logical blocks */
  d->code_off = calloc(npa, sizeof *d->code_off);
  d->hflags = calloc(npa, sizeof *d->hflags);
  d->ncodes = (size_t)d->np;
  for (int i = 0; d->code_off && i < d->np; i++) {
    d->code_off[i] = d->ncodes;
    d->ncodes += dopt_grid_blocks(dopt_numel(d->p[i].ndim, d->p[i].shape));
  }
  cs = d->code_off && d->hflags ? dalloc(d, d->ncodes * sizeof(int32_t), (void **)&d->codes) : DOPT_ERR_NO_MEMORY;
  if (cs != DOPT_OK) {
    d->codes = NULL;
    dopt_dist_destroy(d);
    return dopt__fail(DOPT_ERR_NO_MEMORY, "dopt_dist_create: the dp sum's block codes of %d parameters", d->np);
  }
  *out = d;
  return DOPT_OK;
}

static dopt_status check_param(const dopt_dist_optim *d, int i, const char *fn) {
  DOPT_CHECK_ARG(d != NULL, "%s: optimizer=NULL", fn);
  DOPT_CHECK_ARG(i >= 0 && i < d->np, "%s: param=%d out of range [0, %d)", fn, i, d->np);
  return DOPT_OK;
}

dopt_status dopt_dist_local_shape(const dopt_dist_optim *d, int i, int *ndim, int64_t *shape, size_t *numel) {
  DOPT_TRY(check_param(d, i, "dopt_dist_local_shape"));
  const dist_param *p = &d->p[i];
  if (ndim) *ndim = p->lndim;
  if (shape) memcpy(shape, p->lshape, sizeof p->lshape);
  if (numel) *numel = p->lnumel;
  return DOPT_OK;
}

/* ---- gradients and the step ----------------------------------------------------------------- */

dopt_status dopt_dist_backward(dopt_dist_optim *d, const float *const *grads) {
  DOPT_CHECK_ARG(d && grads, "dopt_dist_backward: NULL argument");
  for (int i = 0; i < d->np; i++) {
    dist_param *p = &d->p[i];
    if (!grads[i]) continue; /* no gradient in this micro-batch (torch: .grad untouched) */
    d->has[i] = 1;
    if (p->lnumel == 0) continue;
    if (d->keep) { /* kept whole until the step (grown by doubling, copied over) */
      if (p->nmb == p->mb_cap) {
        int cap = p->mb_cap ? 2 * p->mb_cap : 4;
        float *nb = NULL;
        DOPT_TRY(dalloc(d, (size_t)cap * p->lnumel * sizeof(float), (void **)&nb));
        dopt_status s = p->nmb ? DEV(d)->copy(DCTX(d), nb, p->mb, (size_t)p->nmb * p->lnumel * sizeof(float)) : DOPT_OK;
        if (s != DOPT_OK) {
          DEV(d)->free(DCTX(d), nb);
          return s;
        }
        if (p->mb) DEV(d)->free(DCTX(d), p->mb);
        p->mb = nb;
        p->mb_cap = cap;
      }
      DOPT_TRY(DEV(d)->upload(DCTX(d), p->mb + (size_t)p->nmb * p->lnumel, grads[i], p->lnumel * sizeof(float)));
      p->nmb++;
      continue;
    }
    if (!p->acc) { /* the first gradient since the step is copied: acc = g0, then acc + g1 + ... */
      DOPT_TRY(DEV(d)->upload(DCTX(d), p->grad, grads[i], p->lnumel * sizeof(float)));
      p->acc = 1;
      continue;
    }
    DOPT_TRY(grow_dev(d, (void **)&d->up, &d->up_cap, p->lnumel * sizeof(float))); /* the largest TP-local tensor */
    DOPT_TRY(DEV(d)->upload(DCTX(d), d->up, grads[i], p->lnumel * sizeof(float)));
    DOPT_TRY(DEV(d)->add(DCTX(d), p->grad, d->up, p->lnumel));
  }
  d->micro++;
  return DOPT_OK;
}

/* Host zeros, at least `bytes`. */
static dopt_status zeros_of(dopt_dist_optim *d, size_t bytes, const float **out) {
  if (bytes > d->zeros_cap) {
    free(d->zeros);
    d->zeros = calloc(1, bytes);
    d->zeros_cap = d->zeros ? bytes : 0;
    if (!d->zeros) return dopt__fail(DOPT_ERR_NO_MEMORY, "distributed: %zu bytes of zeros", bytes);
  }
  *out = d->zeros;
  return DOPT_OK;
}

/* The piece this rank holds of parameter p's tensors: its ZeRO range of the
 * TP block (`sharded`), or the whole TP block. */
static void held_piece(const dist_param *p, int sharded, dopt_piece *out) {
  *out = p->pc;
  if (!sharded) {
    out->lo = 0;
    out->len = p->lnumel;
  }
}

/* Device x[bytes] ← zeros. */
static dopt_status zero_dev(dopt_dist_optim *d, void *x, size_t bytes) {
  const float *z = NULL;
  if (bytes == 0) return DOPT_OK;
  DOPT_TRY(zeros_of(d, bytes, &z));
  return DEV(d)->upload(DCTX(d), x, z, bytes);
}

/* SUM over dp of x[padded·per] (all-reduce for zero 0/1; reduce-scatter for
 * zero 2/3, in place: this rank's block of the padded buffer). */
static dopt_status dp_sum(dopt_dist_optim *d, const dist_param *p, void *x, size_t per, dopt_dtype dt) {
  if (d->zero >= 2)
    return d->dp.ops->reduce_scatter(d->dp.comm, x, (char *)x + (size_t)d->dp.rank * p->chunk * per * dopt_dtype_size(dt),
                                     p->chunk * per, dt, DOPT_SUM);
  return d->dp.ops->all_reduce(d->dp.comm, x, x, p->padded * per, dt, DOPT_SUM);
}

/* The exact dp sum of every parameter's accumulated gradient (docs/dp-sum.md):
 * the logical blocks' codes and the non-finite flags in one MAX over the
 * world (tp, then dp: a logical block may straddle TP blocks), then per
 * parameter its words (and, with a non-finite value somewhere, its class
 * counts) in one integer SUM over dp, decoded into this rank's piece. */
static dopt_status exact_dp_sum(dopt_dist_optim *d) {
  /* the contributions: one accumulated gradient per rank, or (batch
   * invariant) every micro-batch of every rank */
  const int W = d->dp_words, n = d->keep ? d->dp.size * d->micro : d->dp.size;
  const int k = 62 - dopt_grid_headroom(n);
  DOPT_TRY(zero_dev(d, d->codes, d->ncodes * sizeof(int32_t)));
  for (int i = 0; i < d->np; i++) {
    dist_param *p = &d->p[i];
    if (p->lnumel == 0) continue;
    dopt_piece tb; /* the whole TP block */
    held_piece(p, 0, &tb);
    const int nsrc = d->keep ? p->nmb : 1;
    int64_t bad = 0;
    for (int m = 0; m < nsrc; m++) {
      int64_t b;
      const float *src = d->keep ? p->mb + (size_t)m * p->lnumel : p->grad;
      DOPT_TRY(DEV(d)->grid_codes(DCTX(d), src, &tb, d->codes + d->code_off[i], &b));
      bad += b;
    }
    const int32_t one = 1;
    if (bad) DOPT_TRY(DEV(d)->upload(DCTX(d), d->codes + i, &one, sizeof one));
  }
  if (d->tp.size > 1) DOPT_TRY(d->tp.ops->all_reduce(d->tp.comm, d->codes, d->codes, d->ncodes, DOPT_I32, DOPT_MAX));
  if (d->dp.size > 1) DOPT_TRY(d->dp.ops->all_reduce(d->dp.comm, d->codes, d->codes, d->ncodes, DOPT_I32, DOPT_MAX));
  DOPT_TRY(DEV(d)->download(DCTX(d), d->hflags, d->codes, (size_t)d->np * sizeof(int32_t)));
  for (int i = 0; i < d->np; i++) {
    dist_param *p = &d->p[i];
    if (p->lnumel == 0) continue; /* the same on every rank of this dp group */
    const int32_t *codes = d->codes + d->code_off[i];
    const int flagged = d->hflags[i] != 0;
    DOPT_TRY(grow_dev(d, (void **)&d->words, &d->words_cap, p->padded * (size_t)W * sizeof(int64_t)));
    if (flagged) DOPT_TRY(grow_dev(d, (void **)&d->cls, &d->cls_cap, p->padded * sizeof(int64_t)));
    dopt_piece tb; /* the whole TP block */
    held_piece(p, 0, &tb);
    const int nsrc = d->keep ? p->nmb : 1;
    /* zero words where nothing is encoded: no micro-batch on this rank, ZeRO padding */
    const size_t zfrom = nsrc ? p->lnumel : 0;
    if (p->padded > zfrom) {
      size_t tail = p->padded - zfrom;
      DOPT_TRY(zero_dev(d, d->words + zfrom * (size_t)W, tail * (size_t)W * sizeof(int64_t)));
      if (flagged) DOPT_TRY(zero_dev(d, d->cls + zfrom, tail * sizeof(int64_t)));
    }
    for (int m = 0; m < nsrc; m++) { /* the first sets the words, the next ones add to them */
      const float *src = d->keep ? p->mb + (size_t)m * p->lnumel : p->grad;
      DOPT_TRY(DEV(d)->grid_encode(DCTX(d), src, &tb, codes, W, k, m > 0, d->words, flagged ? d->cls : NULL));
    }
    if (d->dp.size > 1) {
      DOPT_TRY(dp_sum(d, p, d->words, (size_t)W, DOPT_I64));
      if (flagged) DOPT_TRY(dp_sum(d, p, d->cls, 1, DOPT_I64));
    }
    DOPT_TRY(DEV(d)->grid_decode(DCTX(d), d->words + p->pc.lo * (size_t)W, flagged ? d->cls + p->pc.lo : NULL, &p->pc,
                                 codes, W, k, p->grad + p->pc.lo));
  }
  return DOPT_OK;
}

/* The averaged gradient of each piece: the SUM over dp (exact, or fp32 in
 * the transport's order), then one division by dp·micro; *nonfinite counts
 * the non-finite averaged elements of this rank's pieces. */
static dopt_status reduce_grads(dopt_dist_optim *d, int64_t *nonfinite) {
  *nonfinite = 0;
  const float denom = (float)((double)d->dp.size * (double)d->micro);
  for (int i = 0; i < d->np; i++) {
    dist_param *p = &d->p[i];
    if (!p->acc) DOPT_TRY(zero_dev(d, p->grad, p->lnumel * sizeof(float))); /* no gradient on this rank: it adds zeros (DDP's unused parameters) */
    p->acc = 0;
  }
  if (d->keep && d->dp.size * d->micro == 1) { /* one contribution: itself (dopt_dp_sum's rule) */
    for (int i = 0; i < d->np; i++) {
      dist_param *p = &d->p[i];
      if (p->nmb) DOPT_TRY(DEV(d)->copy(DCTX(d), p->grad, p->mb, p->lnumel * sizeof(float)));
    }
  } else if ((d->dp.size > 1 || d->keep) && d->dp_words > 0) {
    DOPT_TRY(exact_dp_sum(d));
  }
  for (int i = 0; i < d->np; i++) d->p[i].nmb = 0;
  for (int i = 0; i < d->np; i++) {
    dist_param *p = &d->p[i];
    if (d->dp.size > 1 && d->dp_words == 0) DOPT_TRY(dp_sum(d, p, p->grad, 1, DOPT_F32));
    int64_t bad;
    DOPT_TRY(DEV(d)->average(DCTX(d), p->grad + p->pc.lo, denom, p->pc.len, &bad));
    *nonfinite += bad;
  }
  return DOPT_OK;
}

/* h[n] (host) ← its MAX over the world (tp, then dp), through the device
 * buffer d->flags (np + 1 words): a transport reduces device memory (NCCL and
 * the device-buffer simulator cannot read a host pointer). */
static dopt_status world_max(dopt_dist_optim *d, int64_t *h, size_t n) {
  DOPT_TRY(DEV(d)->upload(DCTX(d), d->flags, h, n * sizeof *h));
  DOPT_TRY(d->tp.ops->all_reduce(d->tp.comm, d->flags, d->flags, n, DOPT_I64, DOPT_MAX));
  DOPT_TRY(d->dp.ops->all_reduce(d->dp.comm, d->flags, d->flags, n, DOPT_I64, DOPT_MAX));
  return DEV(d)->download(DCTX(d), h, d->flags, n * sizeof *h);
}

/* One MAX over the world (tp, then dp) of {non-finite count, has[0..np)}:
 * whether any rank saw a non-finite averaged gradient, and which parameters
 * received a gradient on some rank (a rank without one added zeros). */
static dopt_status world_flags(dopt_dist_optim *d, int64_t *bad) {
  const size_t n = (size_t)d->np + 1;
  int64_t *h = malloc(n * sizeof *h);
  if (!h) return dopt__fail(DOPT_ERR_NO_MEMORY, "distributed step: %d flags", d->np);
  h[0] = *bad;
  for (int i = 0; i < d->np; i++) h[1 + i] = d->has[i];
  dopt_status s = world_max(d, h, n);
  if (s == DOPT_OK) {
    *bad = h[0];
    for (int i = 0; i < d->np; i++) d->skip[i] = h[1 + i] == 0;
  }
  free(h);
  return s;
}

/* The wrapper's schedule (LISA) for this step: frozen parameters are skipped
 * like absent ones; a reset restarts every layer parameter from zero states
 * and step 0. The same on every rank, with no communication. */
static dopt_status apply_schedule(dopt_dist_optim *d) {
  int reset = 0;
  DOPT_TRY(d->wrapper->wrap->schedule(d->whp, d->gstep, d->np, d->layer, d->frozen, &reset));
  for (int i = 0; i < d->np; i++) {
    dist_param *p = &d->p[i];
    d->skip[i] |= d->frozen[i];
    if (!reset || d->layer[i] < 0) continue;
    p->step = 0;
    for (int k = 0; k < p->nstates; k++) {
      if (!p->state[k]) continue; /* owner mode: not the owner */
      DOPT_TRY(zero_dev(d, p->state[k], state_held_bytes(d, p, k)));
    }
  }
  return DOPT_OK;
}

/* Runs the staged steps d->args[first, last) round by round: each round runs
 * every unfinished step's next stage, then reduces what the round posted (one
 * collective per transport and operation). Frames: d->frames at d->frame_off.
 * honour_skip: parameters skipped this step (d->skip) do not run. */
static dopt_status run_rounds(dopt_dist_optim *d, int first, int last, int honour_skip) {
  int active = 0;
  for (int i = first; i < last; i++) active += d->more[i] = !(honour_skip && d->skip[i]);
  for (int stage = 0; active > 0; stage++) {
    for (int i = first; i < last; i++) {
      if (!d->more[i]) continue;
      dopt_step_args *a = &d->args[i];
      a->stage = stage;
      a->more = &d->more[i];
      d->more[i] = 0;
      a->frame = d->frames ? (unsigned char *)d->frames + d->frame_off[i] : NULL; /* NULL + 0 is undefined */
      DOPT_TRY(DEV(d)->step(DCTX(d), a));
      if (!d->more[i]) active--;
    }
    DOPT_TRY(flush(d));
  }
  return DOPT_OK;
}

/* Lays out the frames of d->args[first, last) in d->frames (grown as needed). */
static dopt_status map_frames(dopt_dist_optim *d, int first, int last) {
  size_t total = 0;
  for (int i = first; i < last; i++) {
    d->frame_off[i] = total;
    total += (DEV(d)->frame_bytes(DCTX(d), &d->args[i]) + 15) & ~(size_t)15;
  }
  return grow_dev(d, &d->frames, &d->frames_cap, total);
}

/* Steps d->args[0, np) in buckets: consecutive parameters whose frame
 * estimates (rank-independent) fit in d->bucket_bytes share their
 * collectives; a parameter larger than the budget is a bucket of its own. */
static dopt_status run_buckets(dopt_dist_optim *d) {
  int first = 0;
  while (first < d->np) {
    int last = first + 1;
    size_t est = d->p[first].est;
    while (last < d->np && (d->bucket_bytes == 0 || est + d->p[last].est <= d->bucket_bytes)) est += d->p[last++].est;
    DOPT_TRY(map_frames(d, first, last));
    DOPT_TRY(run_rounds(d, first, last, 1));
    first = last;
  }
  return DOPT_OK;
}

static dopt_status gather(dopt_dist_optim *d, const dist_param *p, const void *src, int sharded, size_t elem,
                          dopt_dtype dt, void *out);

/* Sends the buffer x[count] (device) of the rank at dp rank `owner`, tp rank
 * `owner_tp` to every rank: over tp in the owner's dp row, then over dp in
 * every tp column. */
static dopt_status from_rank(dopt_dist_optim *d, int owner, int owner_tp, void *x, size_t count, dopt_dtype dt) {
  if (d->tp.size > 1 && d->dp.rank == owner) DOPT_TRY(d->tp.ops->broadcast(d->tp.comm, x, x, count, dt, owner_tp));
  if (d->dp.size > 1) DOPT_TRY(d->dp.ops->broadcast(d->dp.comm, x, x, count, dt, owner));
  return DOPT_OK;
}

/* The owner's whole buffer of parameter p to every rank. */
static dopt_status from_owner(dopt_dist_optim *d, const dist_param *p, void *x, size_t count, dopt_dtype dt) {
  return from_rank(d, p->owner, p->owner_tp, x, count, dt);
}

/* Owner mode, one parameter: the whole averaged gradient on every rank
 * (all-gathers over dp and tp), the reference's own step on the whole tensor
 * on the owner, the new values from the owner to every rank (broadcasts),
 * each rank keeps its piece. Bitwise the reference by construction: the same
 * step on the same whole tensors. */
static dopt_status owner_step(dopt_dist_optim *d, int i, float *host) {
  dist_param *p = &d->p[i];
  const size_t numel = dopt_numel(p->ndim, p->shape);
  const int mine = d->dp.rank == p->owner && d->tp.rank == p->owner_tp;
  p->step++;
  DOPT_TRY(grow_dev(d, (void **)&d->xfer, &d->xfer_cap, numel * sizeof(float)));
  /* the averaged gradient is valid on each rank's piece (zero >= 1) or its whole TP-local block */
  DOPT_TRY(gather(d, p, p->grad + (d->zero >= 1 ? (size_t)d->dp.rank * p->chunk : 0), d->zero >= 1, sizeof(float),
                  DOPT_F32, mine ? host : NULL));
  if (mine) {
    dopt_piece whole;
    dopt_piece_full(p->ndim, p->shape, &whole);
    DOPT_TRY(DEV(d)->upload(DCTX(d), d->xfer, host, numel * sizeof(float)));
    p->events = 0;
    dopt_step_args a = {d->impl, d->hp[p->group], p->step, &whole, p->full, d->xfer, p->state, NULL, NULL, &p->events,
                        (uint64_t)i, 0, NULL, NULL, NULL};
    DOPT_TRY(grow_dev(d, &d->frames, &d->frames_cap, DEV(d)->frame_bytes(DCTX(d), &a)));
    a.frame = d->frames;
    DOPT_TRY(dopt__run_stages(d->dev, &a));
  }
  float *vals = mine ? p->full : d->xfer;
  DOPT_TRY(from_owner(d, p, vals, numel, DOPT_F32));
  DOPT_TRY(DEV(d)->download(DCTX(d), host, vals, numel * sizeof(float)));
  return load_values(d, p, host);
}

static dopt_status owner_steps(dopt_dist_optim *d) {
  size_t maxn = 1;
  for (int i = 0; i < d->np; i++) {
    size_t n = dopt_numel(d->p[i].ndim, d->p[i].shape);
    maxn = n > maxn ? n : maxn;
  }
  unsigned char *host = NULL; /* kept across steps, like the gathers' scratch */
  DOPT_TRY(ghost(d, 2, maxn * sizeof(float), &host));
  for (int i = 0; i < d->np; i++)
    if (!d->skip[i]) DOPT_TRY(owner_step(d, i, (float *)(void *)host));
  return DOPT_OK;
}

dopt_status dopt_dist_step(dopt_dist_optim *d, dopt_dist_step_info *info) {
  DOPT_CHECK_ARG(d != NULL, "dopt_dist_step: optimizer=NULL");
  if (d->micro == 0) return dopt__fail(DOPT_ERR_STATE, "dopt_dist_step: no gradients (call dopt_dist_backward first)");
  dopt_dist_step_info local = {0, -1.0, d->micro};
  int64_t bad;
  DOPT_TRY(reduce_grads(d, &bad));
  DOPT_TRY(world_flags(d, &bad));
  memset(d->has, 0, (size_t)d->np);
  if (d->skip_nonfinite && bad > 0) {
    d->skipped++;
    local.skipped = 1;
    if (info) *info = local;
    d->micro = 0;
    return DOPT_OK;
  }
  if (d->wrapper) DOPT_TRY(apply_schedule(d));
  d->gstep++;
  if (d->max_grad_norm > 0) { /* every gradient piece's Σg² as a staged step, one bucket */
    for (int i = 0; i < d->np; i++) {
      dist_param *p = &d->p[i];
      d->args[i] = (dopt_step_args){&dopt__impl_sumsq, NULL, 0, &p->pc, NULL, p->grad + p->pc.lo, NULL, NULL, &p->red,
                                    NULL, (uint64_t)i, 0, NULL, &d->ss[i], NULL};
    }
    DOPT_TRY(map_frames(d, 0, d->np));
    DOPT_TRY(run_rounds(d, 0, d->np, 0)); /* every gradient: an absent one is zeros */
    float coef = dopt_clip_coef(d->ss, d->np, d->max_grad_norm, &local.grad_norm);
    for (int i = 0; i < d->np; i++) DOPT_TRY(DEV(d)->scale(DCTX(d), d->p[i].grad + d->p[i].pc.lo, coef, d->p[i].pc.len));
  }
  if (d->owned) { /* every rank has its new values already: no working-copy update, no all-gather */
    DOPT_TRY(owner_steps(d));
    if (info) *info = local;
    d->micro = 0;
    return DOPT_OK;
  }
  for (int i = 0; i < d->np; i++) {
    dist_param *p = &d->p[i];
    if (!d->skip[i]) p->step++;
    float *param = p->master + (p->master_sharded ? 0 : p->pc.lo);
    d->args[i] = (dopt_step_args){d->impl, d->hp[p->group], p->step, &p->pc, param, p->grad + p->pc.lo, p->state,
                                  NULL, &p->red, NULL, (uint64_t)i, 0, NULL, NULL, NULL};
  }
  DOPT_TRY(run_buckets(d));
  for (int i = 0; i < d->np; i++) {
    dist_param *p = &d->p[i];
    if (d->skip[i]) continue; /* untouched: its values are still in place everywhere */
    float *param = p->master + (p->master_sharded ? 0 : p->pc.lo);
    if (p->bf16) DOPT_TRY(DEV(d)->to_bf16(DCTX(d), param, p->work + (d->zero == 3 ? 0 : p->pc.lo), p->pc.len));
    /* zero 1/2: every dp rank gets the whole TP-local model weights back (the
     * bf16 working copy, or the fp32 parameter itself) */
    if ((d->zero == 1 || d->zero == 2) && d->dp.size > 1) {
      size_t me = (size_t)d->dp.rank * p->chunk;
      if (p->bf16) DOPT_TRY(d->dp.ops->all_gather(d->dp.comm, p->work + me, p->work, p->chunk, DOPT_BF16));
      else DOPT_TRY(d->dp.ops->all_gather(d->dp.comm, p->master + me, p->master, p->chunk, DOPT_F32));
    }
  }
  if (info) *info = local;
  d->micro = 0; /* the next backward overwrites the accumulators */
  return DOPT_OK;
}

int64_t dopt_dist_stat_collectives(const dopt_dist_optim *d) { return d ? d->b.collectives : 0; }

int64_t dopt_dist_skipped_steps(const dopt_dist_optim *d) { return d ? d->skipped : 0; }

/* ---- gathering logical tensors ------------------------------------------------------------------ */

/* Gather scratch k (device or host), grown to at least `bytes` and kept. */
static dopt_status gdev(dopt_dist_optim *d, int k, size_t bytes, void **out) {
  DOPT_TRY(grow_dev(d, &d->gdev[k], &d->gdev_cap[k], bytes));
  *out = d->gdev[k];
  return DOPT_OK;
}

static dopt_status ghost(dopt_dist_optim *d, int k, size_t bytes, unsigned char **out) {
  if (bytes > d->ghost_cap[k]) {
    unsigned char *h = realloc(d->ghost[k], bytes ? bytes : 1);
    if (!h) return dopt__fail(DOPT_ERR_NO_MEMORY, "distributed gather: %zu bytes", bytes);
    d->ghost[k] = h;
    d->ghost_cap[k] = bytes;
  }
  *out = d->ghost[k];
  return DOPT_OK;
}

/* The whole TP-local block (host, [lnumel]) of a tensor stored as this rank's
 * shard (sharded != 0: [chunk] at src) or whole (src [lnumel]). elem: 4, 2 or 1. */
static dopt_status gather_tp_local(dopt_dist_optim *d, const dist_param *p, const void *src, int sharded, size_t elem,
                                   dopt_dtype dt, unsigned char *host) {
  if (!sharded || d->dp.size == 1) return DEV(d)->download(DCTX(d), host, src, p->lnumel * elem);
  void *buf = NULL;
  DOPT_TRY(gdev(d, 0, p->padded * elem, &buf));
  DOPT_TRY(d->dp.ops->all_gather(d->dp.comm, src, buf, p->chunk, dt));
  return DEV(d)->download(DCTX(d), host, buf, p->lnumel * elem);
}

/* Assembles the logical tensor from every TP rank's block (host in, host out). */
static dopt_status assemble_tp(dopt_dist_optim *d, const dist_param *p, const unsigned char *mine, size_t elem,
                               dopt_dtype dt, unsigned char *out) { /* out NULL: take part only */
  const dopt_piece *pc = &p->pc;
  if (p->role == DOPT_TP_REPLICATED) {
    if (out) memcpy(out, mine, p->lnumel * elem);
    return DOPT_OK;
  }
  const int tpn = d->tp.size;
  size_t maxblk = 0;
  for (int r = 0; r < tpn; r++) {
    size_t h0, hl, w0, wl;
    tp_block(p, tpn, r, &h0, &hl, &w0, &wl);
    maxblk = pc->b * hl * wl > maxblk ? pc->b * hl * wl : maxblk;
  }
  const size_t blk_bytes = (maxblk ? maxblk : 1) * elem;
  void *send = NULL, *recv = NULL;
  unsigned char *all = NULL;
  DOPT_TRY(gdev(d, 0, blk_bytes, &send));
  DOPT_TRY(gdev(d, 1, blk_bytes * (size_t)tpn, &recv));
  DOPT_TRY(ghost(d, 1, blk_bytes * (size_t)tpn, &all));
  DOPT_TRY(DEV(d)->upload(DCTX(d), send, mine, p->lnumel * elem));
  if (maxblk) DOPT_TRY(d->tp.ops->all_gather(d->tp.comm, send, recv, maxblk, dt));
  if (!out) return DOPT_OK;
  DOPT_TRY(DEV(d)->download(DCTX(d), all, recv, maxblk * elem * (size_t)tpn));
  for (int r = 0; r < tpn; r++) {
    size_t h0, hl, w0, wl;
    tp_block(p, tpn, r, &h0, &hl, &w0, &wl);
    const unsigned char *blk = all + (size_t)r * maxblk * elem;
    for (size_t bi = 0; bi < pc->b; bi++)
      for (size_t i = 0; i < hl; i++)
        memcpy(out + ((bi * pc->h + h0 + i) * pc->w + w0) * elem, blk + (bi * hl + i) * wl * elem, wl * elem);
  }
  return DOPT_OK;
}

/* The logical tensor on every rank (collective); out NULL: this rank only
 * takes part (the owner step's non-owners). */
static dopt_status gather(dopt_dist_optim *d, const dist_param *p, const void *src, int sharded, size_t elem,
                          dopt_dtype dt, void *out) {
  unsigned char *mine = NULL;
  DOPT_TRY(ghost(d, 0, (p->lnumel ? p->lnumel : 1) * elem, &mine));
  DOPT_TRY(gather_tp_local(d, p, src, sharded, elem, dt, mine));
  return assemble_tp(d, p, mine, elem, dt, out);
}

dopt_status dopt_dist_gather_param(dopt_dist_optim *d, int i, float *out) {
  DOPT_TRY(check_param(d, i, "dopt_dist_gather_param"));
  DOPT_CHECK_ARG(out != NULL, "dopt_dist_gather_param: out=NULL");
  return gather(d, &d->p[i], d->p[i].master, d->p[i].master_sharded, sizeof(float), DOPT_F32, out);
}

dopt_status dopt_dist_gather_work(dopt_dist_optim *d, int i, uint16_t *out) {
  DOPT_TRY(check_param(d, i, "dopt_dist_gather_work"));
  DOPT_CHECK_ARG(out != NULL, "dopt_dist_gather_work: out=NULL");
  if (!d->p[i].bf16) return dopt__fail(DOPT_ERR_STATE, "dopt_dist_gather_work: '%s' is not a bf16 parameter", d->p[i].name);
  return gather(d, &d->p[i], d->p[i].work, d->zero == 3, sizeof(uint16_t), DOPT_BF16, out);
}

dopt_status dopt_dist_gather_state(dopt_dist_optim *d, int i, const char *key, void *out) {
  DOPT_TRY(check_param(d, i, "dopt_dist_gather_state"));
  DOPT_CHECK_ARG(key && out, "dopt_dist_gather_state: key/out NULL");
  dist_param *p = &d->p[i];
  for (int k = 0; k < p->nstates; k++) {
    if (strcmp(p->spec[k].v.name, key) != 0) continue;
    if (d->owned) { /* whole on the owner: broadcast */
      size_t bytes = p->spec[k].v.bytes;
      void *src = p->state[k];
      if (!src) {
        DOPT_TRY(grow_dev(d, (void **)&d->xfer, &d->xfer_cap, bytes));
        src = d->xfer;
      }
      DOPT_TRY(from_owner(d, p, src, bytes, DOPT_U8));
      return DEV(d)->download(DCTX(d), out, src, bytes);
    }
    if (!p->spec[k].elementwise) return DEV(d)->download(DCTX(d), out, p->state[k], p->spec[k].v.bytes);
    return gather(d, p, p->state[k], d->zero >= 1, sizeof(float), DOPT_F32, out);
  }
  return dopt__fail(DOPT_ERR_NOT_FOUND, "dopt_dist_gather_state: '%s' has no state '%s'", p->name, key);
}

dopt_status dopt_dist_state_bytes(const dopt_dist_optim *d, int i, const char *key, size_t *bytes) {
  DOPT_TRY(check_param(d, i, "dopt_dist_state_bytes"));
  DOPT_CHECK_ARG(key && bytes, "dopt_dist_state_bytes: key/bytes NULL");
  const dist_param *p = &d->p[i];
  for (int k = 0; k < p->nstates; k++)
    if (strcmp(p->spec[k].v.name, key) == 0) {
      *bytes = p->spec[k].v.bytes;
      return DOPT_OK;
    }
  return dopt__fail(DOPT_ERR_NOT_FOUND, "dopt_dist_state_bytes: '%s' has no state '%s'", p->name, key);
}

dopt_status dopt_dist_get_step(const dopt_dist_optim *d, int i, int64_t *step) {
  DOPT_TRY(check_param(d, i, "dopt_dist_get_step"));
  DOPT_CHECK_ARG(step != NULL, "dopt_dist_get_step: step=NULL");
  *step = d->p[i].step;
  return DOPT_OK;
}

dopt_status dopt_dist_memory_usage(const dopt_dist_optim *d, dopt_dist_memory *m) {
  DOPT_CHECK_ARG(d && m, "dopt_dist_memory_usage: NULL argument");
  memset(m, 0, sizeof *m);
  for (int i = 0; i < d->np; i++) {
    const dist_param *p = &d->p[i];
    size_t mext = p->master_sharded ? p->chunk : p->padded, wext = d->zero == 3 ? p->chunk : p->padded;
    m->param_bytes += mext * sizeof(float) + (p->bf16 ? wext * sizeof(uint16_t) : 0);
    m->grad_bytes += p->padded * sizeof(float);
    for (int k = 0; k < p->nstates; k++) m->state_bytes += p->state[k] ? state_held_bytes(d, p, k) : 0;
    if (p->full) m->param_bytes += dopt_numel(p->ndim, p->shape) * sizeof(float); /* the owner's logical copy */
  }
  return DOPT_OK;
}

/* ---- replicas ------------------------------------------------------------------------------ */

/* World rank 0's bytes reach every rank (from_rank 0, 0), each rank compares
 * them with its own, and one MIN over the world (world_max of the negated key)
 * of (world rank, byte offset) of the differing ranks names the first. */
dopt_status dopt_dist_check_replicas(dopt_dist_optim *d, const void *mine, size_t bytes, int *rank, size_t *offset) {
  DOPT_CHECK_ARG(d != NULL && rank != NULL && offset != NULL && (mine != NULL || bytes == 0),
                 "dopt_dist_check_replicas: NULL argument");
  DOPT_CHECK_ARG(bytes <= ((size_t)1 << 31), "dopt_dist_check_replicas: bytes=%zu above 2^31", bytes);
  *rank = -1;
  *offset = 0;
  const size_t words = (bytes + 7) / 8 ? (bytes + 7) / 8 : 1;
  int64_t *h = calloc(words, sizeof *h);
  void *buf = NULL;
  if (!h) return dopt__fail(DOPT_ERR_NO_MEMORY, "dopt_dist_check_replicas: %zu bytes", bytes);
  if (bytes) memcpy(h, mine, bytes);
  dopt_status s = DEV(d)->alloc(DCTX(d), words * sizeof *h, &buf);
  if (s == DOPT_OK) s = DEV(d)->upload(DCTX(d), buf, h, words * sizeof *h);
  if (s == DOPT_OK) s = from_rank(d, 0, 0, buf, words, DOPT_I64);
  if (s == DOPT_OK) s = DEV(d)->download(DCTX(d), h, buf, words * sizeof *h);
  int64_t key = INT64_MAX;
  if (s == DOPT_OK) {
    const unsigned char *a = (const unsigned char *)h, *b = mine;
    size_t j = 0;
    while (j < bytes && a[j] == b[j]) j++;
    const int64_t wr = (int64_t)d->dp.rank * d->tp.size + d->tp.rank;
    if (j < bytes) key = (wr << 32) | (int64_t)j;
  }
  int64_t neg = -key;
  if (s == DOPT_OK) s = world_max(d, &neg, 1);
  if (s == DOPT_OK && -neg != INT64_MAX) {
    *rank = (int)(-neg >> 32);
    *offset = (size_t)(-neg & 0xffffffff);
  }
  if (buf) DEV(d)->free(DCTX(d), buf);
  free(h);
  return s;
}

/* ---- checkpoints (docs/checkpoints.md) ------------------------------------------------------ */

/* Every rank learns whether any rank failed; a rank that did not fail itself
 * returns DOPT_ERR_ABORTED naming the phase (the failing rank has the cause). */
static dopt_status agree(dopt_dist_optim *d, dopt_status mine, const char *phase) {
  int64_t v = mine != DOPT_OK;
  char cause[1024] = "";
  if (mine != DOPT_OK) snprintf(cause, sizeof cause, "%s", dopt_last_error()); /* the collective may overwrite it */
  dopt_status s = world_max(d, &v, 1); /* the barrier of the checkpoint protocol */
  if (mine != DOPT_OK) return dopt__fail(mine, "%s", cause);
  if (s != DOPT_OK) return s;
  return v ? dopt__fail(DOPT_ERR_ABORTED, "checkpoint %s: another rank failed (its message has the cause)", phase)
           : DOPT_OK;
}

/* A replica writes nothing twice: a TP-replicated block is written by TP
 * rank 0, a block every dp rank holds whole by dp rank 0. */
static int writes_piece(const dopt_dist_optim *d, const dist_param *p, int sharded, const dopt_piece *pc) {
  return pc->len > 0 && (d->tp.rank == 0 || p->role != DOPT_TP_REPLICATED) && (d->dp.rank == 0 || sharded);
}

/* device x[pc->len] (dtype dt) → the writer, through host scratch */
static dopt_status put_piece(dopt_dist_optim *d, dopt_ckpt_writer *w, const char *tensor, dopt_dtype dt, int ndim,
                             const int64_t *shape, const dopt_piece *pc, const void *x) {
  const size_t bytes = pc->len * dopt_dtype_size(dt);
  unsigned char *h = NULL;
  DOPT_TRY(ghost(d, 0, bytes ? bytes : 1, &h));
  DOPT_TRY(DEV(d)->download(DCTX(d), h, x, bytes));
  return dopt_ckpt_put(w, tensor, dt, ndim, shape, pc, h);
}

static dopt_status write_pieces(dopt_dist_optim *d, dopt_ckpt_writer *w) {
  char name[512];
  for (int i = 0; i < d->np; i++) {
    dist_param *p = &d->p[i];
    dopt_piece pc;
    held_piece(p, p->master_sharded, &pc);
    if (writes_piece(d, p, p->master_sharded, &pc))
      DOPT_TRY(put_piece(d, w, p->name, DOPT_F32, p->ndim, p->shape, &pc, p->master));
    if (p->bf16) {
      held_piece(p, d->zero == 3, &pc);
      snprintf(name, sizeof name, "%s/bf16", p->name);
      if (writes_piece(d, p, d->zero == 3, &pc))
        DOPT_TRY(put_piece(d, w, name, DOPT_BF16, p->ndim, p->shape, &pc, p->work));
    }
    if (p->step == 0) continue; /* no states yet (has_state = 0): the reference allocates them at its first step */
    for (int k = 0; k < p->nstates; k++) {
      const dopt_state_view *v = &p->spec[k].v;
      snprintf(name, sizeof name, "%s/%s", p->name, v->name);
      dopt_piece whole;
      dopt_piece_full(v->ndim, v->shape, &whole);
      if (d->owned) { /* whole, on the owner */
        if (p->state[k]) DOPT_TRY(put_piece(d, w, name, v->dtype, v->ndim, v->shape, &whole, p->state[k]));
      } else if (p->spec[k].elementwise) { /* sharded like the parameter (zero >= 1), the parameter's shape */
        held_piece(p, d->zero >= 1, &pc);
        if (writes_piece(d, p, d->zero >= 1, &pc))
          DOPT_TRY(put_piece(d, w, name, v->dtype, v->ndim, v->shape, &pc, p->state[k]));
      } else if (d->tp.rank == 0 && d->dp.rank == 0) { /* replicated whole on every rank */
        DOPT_TRY(put_piece(d, w, name, v->dtype, v->ndim, v->shape, &whole, p->state[k]));
      }
    }
  }
  return DOPT_OK;
}

/* A failed save (every writer closed or aborted): rank 0 removes the temporary generation; the
 * first failure's message is kept. */
static dopt_status discard(int rank, const char *tmp, dopt_status s) {
  if (rank != 0) return s;
  char keep[512];
  snprintf(keep, sizeof keep, "%s", dopt_last_error());
  (void)dopt_ckpt_discard(tmp);
  return dopt__fail(s, "%s", keep);
}

dopt_status dopt_dist_save(dopt_dist_optim *d, const dopt_optim *plain, const char *ckpt_dir, int64_t global_step) {
  DOPT_CHECK_ARG(d && plain && ckpt_dir, "dopt_dist_save: NULL argument");
  const int rank = d->dp.rank * d->tp.size + d->tp.rank, nranks = d->tp.size * d->dp.size;
  const int64_t gs = global_step >= 0 ? global_step : d->gstep + d->skipped;
  char tmp[4096];
  /* rank 0 creates the temporary generation; then every rank writes its pieces */
  dopt_status s = rank == 0 ? dopt_ckpt_begin(ckpt_dir, gs, tmp, sizeof tmp) : DOPT_OK;
  DOPT_TRY(agree(d, s, "begin"));
  DOPT_TRY(dopt_ckpt_tmp_dir(ckpt_dir, gs, tmp, sizeof tmp));
  dopt_ckpt_writer *w = NULL;
  s = dopt_ckpt_writer_open(tmp, rank, nranks, &w);
  if (s == DOPT_OK) s = write_pieces(d, w);
  if (s == DOPT_OK) s = dopt_ckpt_writer_close(w);
  else dopt_ckpt_abort_writer(w);
  s = agree(d, s, "write");
  if (s != DOPT_OK) return discard(rank, tmp, s);
  /* rank 0: the metadata (the plain optimizer's, with this run's counters), the index, the rename */
  s = DOPT_OK;
  if (rank == 0) {
    dopt_ckpt_info info = DOPT_CKPT_INFO_INIT;
    info.global_step = gs;
    info.skipped_steps = d->skipped;
    dopt_ckpt_meta *m = NULL;
    s = dopt_ckpt_meta_from_optim(plain, &info, &m);
    if (s == DOPT_OK && m->nparams != d->np)
      s = dopt__fail(DOPT_ERR_INVALID_ARG, "dopt_dist_save: plain optimizer has %d parameters, the distributed %d",
                     m->nparams, d->np);
    for (int i = 0; s == DOPT_OK && i < d->np; i++) {
      m->params[i].step = d->p[i].step;
      m->params[i].has_state = d->p[i].step > 0;
    }
    if (s == DOPT_OK) {
      m->optimizer_steps = d->gstep;
      m->world.plugin = d->zero == 3 ? "fsdp" : "hybrid";
      m->world.tp = d->tp.size;
      m->world.dp = d->dp.size;
      m->world.zero = d->zero;
      s = dopt_ckpt_commit(ckpt_dir, tmp, m);
    }
    dopt_ckpt_meta_free(m);
    if (s != DOPT_OK) s = discard(0, tmp, s); /* a full disk at the index: nothing of the save is left */
  }
  return agree(d, s, "commit");
}

/* Reads the piece pc of `tensor` into device x (dtype dt), through host scratch. */
static dopt_status get_piece(dopt_dist_optim *d, dopt_ckpt_reader *r, const char *tensor, dopt_dtype dt,
                             const dopt_piece *pc, void *x) {
  const size_t bytes = pc->len * dopt_dtype_size(dt);
  if (bytes == 0) return DOPT_OK;
  unsigned char *h = NULL;
  DOPT_TRY(ghost(d, 0, bytes, &h));
  DOPT_TRY(dopt_ckpt_get(r, tensor, pc, h));
  return DEV(d)->upload(DCTX(d), x, h, bytes);
}

static dopt_status read_pieces(dopt_dist_optim *d, dopt_ckpt_reader *r, const dopt_ckpt_meta *m) {
  char name[512];
  for (int i = 0; i < d->np; i++) {
    dist_param *p = &d->p[i];
    dopt_piece pc;
    held_piece(p, p->master_sharded, &pc);
    DOPT_TRY(get_piece(d, r, p->name, DOPT_F32, &pc, p->master));
    if (p->bf16) {
      held_piece(p, d->zero == 3, &pc);
      snprintf(name, sizeof name, "%s/bf16", p->name);
      DOPT_TRY(get_piece(d, r, name, DOPT_BF16, &pc, p->work));
    }
    if (d->owned && p->full) { /* the owner's logical values */
      dopt_piece whole;
      dopt_piece_full(p->ndim, p->shape, &whole);
      DOPT_TRY(get_piece(d, r, p->name, DOPT_F32, &whole, p->full));
    }
    p->step = m->params[i].step;
    for (int k = 0; k < p->nstates; k++) {
      if (!p->state[k]) continue; /* owner mode: not the owner */
      const dopt_state_view *v = &p->spec[k].v;
      DOPT_TRY(zero_dev(d, p->state[k], state_held_bytes(d, p, k))); /* ZeRO padding, states never allocated */
      if (!m->params[i].has_state) continue;
      snprintf(name, sizeof name, "%s/%s", p->name, v->name);
      dopt_piece whole;
      dopt_piece_full(v->ndim, v->shape, &whole);
      if (!d->owned && p->spec[k].elementwise) held_piece(p, d->zero >= 1, &pc);
      DOPT_TRY(get_piece(d, r, name, v->dtype, !d->owned && p->spec[k].elementwise ? &pc : &whole, p->state[k]));
    }
    p->acc = 0;
    p->nmb = 0;
  }
  d->gstep = m->optimizer_steps;
  d->skipped = m->skipped_steps;
  d->micro = 0;
  memset(d->has, 0, (size_t)d->np);
  return DOPT_OK;
}

dopt_status dopt_dist_load(dopt_dist_optim *d, const dopt_optim *plain, const char *path) {
  DOPT_CHECK_ARG(d && plain && path, "dopt_dist_load: NULL argument");
  dopt_ckpt_reader *r = NULL;
  dopt_ckpt_meta *live = NULL;
  const dopt_ckpt_meta *saved = NULL;
  /* every rank opens, checks the metadata against this optimizer and verifies every piece's
   * checksum before anything is loaded; then all agree */
  dopt_status s = dopt_ckpt_open(path, &r);
  if (s == DOPT_OK) s = dopt_ckpt_read_meta(r, &saved);
  if (s == DOPT_OK) s = dopt_ckpt_meta_from_optim(plain, NULL, &live);
  if (s == DOPT_OK) s = dopt_ckpt_meta_check(saved, live, dopt_ckpt_path(r));
  if (s == DOPT_OK && saved->nparams != d->np)
    s = dopt__fail(DOPT_ERR_SHAPE, "%s: %d parameters, this optimizer %d", dopt_ckpt_path(r), saved->nparams, d->np);
  if (s == DOPT_OK) s = dopt_ckpt_verify(r);
  dopt_ckpt_meta_free(live);
  s = agree(d, s, "load");
  if (s == DOPT_OK) s = read_pieces(d, r, saved);
  dopt_ckpt_close(r);
  return agree(d, s, "load");
}
