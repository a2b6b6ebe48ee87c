/* The plan of a distributed optimizer (docs/distributed.md): each parameter's
 * TP block and ZeRO range, its buffers and first values, the owners of owner
 * mode and their units; creation (destruction and the shared buffers:
 * buffers.c). */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dist_internal.h"

/* The TP block of a parameter for TP rank r: rows/cols of the [b, h, w] view (dopt_tp_block, the one rule). */
void dd_tp_block(const dist_param *p, int tp, int r, size_t *h0, size_t *hl, size_t *w0, size_t *wl) {
  dopt_piece blk;
  dopt_tp_block(p->ndim, p->shape, p->role, tp, r, &blk);
  *h0 = blk.h0, *hl = blk.hl, *w0 = blk.w0, *wl = blk.wl;
}

/* Elements of TP rank r's block of p (another stage's parameter: none). */
static size_t block_numel_of(const dopt_dist_optim *d, const dist_param *p, int r) {
  if (!dd_present(d, p)) return 0;
  size_t h0, hl, w0, wl;
  dd_tp_block(p, d->tp.size, r, &h0, &hl, &w0, &wl);
  dopt_piece full;
  dopt_piece_full(p->ndim, p->shape, &full);
  return full.b * hl * wl;
}

void dd_ep_range(const dopt_dist_optim *d, const dist_param *p, int r, int e, size_t *x0, size_t *x1) {
  const size_t n = block_numel_of(d, p, r), E = (size_t)p->shape[0], per = E ? n / E : 0; /* b-major: experts outermost */
  size_t f0, fl;
  dopt_split_range(E, d->ep.size, e, &f0, &fl);
  *x0 = f0 * per, *x1 = (f0 + fl) * per;
}

void dd_shard(const dopt_dist_optim *d, const dist_param *p, int r, size_t q, size_t *lo, size_t *len) {
  if (dd_ep_stack(d, p)) { /* dp rank q = moe_dp rank m · ep + ep rank e: m's part of e's experts */
    const size_t M = (size_t)d->mdp.size, m = q / (size_t)d->ep.size;
    size_t x0, x1;
    dd_ep_range(d, p, r, (int)(q % (size_t)d->ep.size), &x0, &x1);
    const size_t S = (x1 - x0 + M - 1) / M, a = m * S < x1 - x0 ? m * S : x1 - x0;
    *lo = x0 + a;
    *len = (x1 - x0 - a) < S ? x1 - x0 - a : S;
    return;
  }
  const size_t n = block_numel_of(d, p, r), D = (size_t)dd_dpg(d, p)->size;
  dopt_chunk_range(d->gem ? d->gem[p - d->p] : (dopt_chunk_slot){0, (n + D - 1) / D}, n, q, lo, len);
}

/* Gemini: the blocks packed into chunks (dopt_dist_config.chunk_elems; dopt_chunk_pack), by TP rank 0's
 * blocks (the largest of an uneven split), so every TP rank has the same chunks (a TP-replicated tensor the
 * same shards everywhere); a smaller block leaves the end of its room unused; another stage's parameter is an
 * empty block. Logical shapes only. */
static dopt_status plan_chunks(dopt_dist_optim *d) {
  const size_t np = (size_t)d->np;
  size_t *n = malloc((np ? np : 1) * sizeof *n);
  d->gem = malloc((np ? np : 1) * sizeof *d->gem);
  if (!n || !d->gem) {
    free(n);
    return dopt__fail(DOPT_ERR_NO_MEMORY, "dopt_dist_create: gemini chunks of %zu parameters", np);
  }
  for (size_t i = 0; i < np; i++) n[i] = block_numel_of(d, &d->p[i], 0);
  dopt_chunk_pack(n, np, d->chunk_elems, (size_t)d->dp.size, d->gem);
  free(n);
  return DOPT_OK;
}

static dopt_status check_config(const dopt_dist_config *cfg) {
  DOPT_CHECK_ARG((cfg->version == 1 && cfg->struct_size >= DOPT_DIST_CONFIG_V1_SIZE) ||
                     (cfg->version == 2 && cfg->struct_size >= DOPT_DIST_CONFIG_V2_SIZE) ||
                     (cfg->version == 3 && cfg->struct_size >= DOPT_DIST_CONFIG_V3_SIZE) ||
                     (cfg->version == 4 && cfg->struct_size >= DOPT_DIST_CONFIG_V4_SIZE) ||
                     (cfg->version == 5 && cfg->struct_size >= DOPT_DIST_CONFIG_V5_SIZE) ||
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
  if (cfg->version >= 4 && cfg->pp.size > 1) {
    DOPT_CHECK_ARG(cfg->pp.ops && cfg->pp.ops->all_reduce && cfg->pp.ops->broadcast,
                   "dopt_dist_create: pp=%d needs a pp transport with all_reduce and broadcast", cfg->pp.size);
    DOPT_CHECK_ARG(cfg->pp.rank >= 0 && cfg->pp.rank < cfg->pp.size, "dopt_dist_create: pp rank %d of %d",
                   cfg->pp.rank, cfg->pp.size);
  }
  const size_t chunk = cfg->version >= 5 ? cfg->chunk_elems : 0;
  const int gemini = cfg->plugin && strcmp(cfg->plugin, "gemini") == 0;
  DOPT_CHECK_ARG(!gemini || chunk >= 1, "dopt_dist_create: plugin gemini needs chunk_elems >= 1 (the chunk size)");
  DOPT_CHECK_ARG(gemini || chunk == 0, "dopt_dist_create: chunk_elems=%zu is for plugin gemini, not '%s'", chunk,
                 cfg->plugin ? cfg->plugin : "");
  DOPT_CHECK_ARG(!gemini || cfg->dp.size == 1 || (cfg->dp_sum_words >= 1 && cfg->dp.ops->all_to_allv),
                 "dopt_dist_create: plugin gemini at dp=%d needs the exact dp sum (dp_sum_words=%d) and the dp "
                 "transport's all_to_allv (a chunk's shards cut through tensors: exact counts, no padding)",
                 cfg->dp.size, cfg->dp_sum_words);
  const int moe = cfg->plugin && strcmp(cfg->plugin, "moe_hybrid") == 0;
  const int ep = cfg->version >= 6 && cfg->ep.size > 1 ? cfg->ep.size : 1;
  DOPT_CHECK_ARG(moe || ep == 1, "dopt_dist_create: ep=%d is plugin moe_hybrid's expert parallelism, not '%s'", ep,
                 cfg->plugin ? cfg->plugin : "");
  if (ep > 1) {
    DOPT_CHECK_ARG(cfg->ep.ops && cfg->ep.ops->all_reduce && cfg->ep.ops->broadcast && cfg->moe_dp.ops,
                   "dopt_dist_create: ep=%d needs an ep transport with all_reduce and broadcast and a moe_dp transport",
                   ep);
    DOPT_CHECK_ARG(cfg->dp.size % ep == 0 && cfg->moe_dp.size == cfg->dp.size / ep,
                   "dopt_dist_create: plugin moe_hybrid needs dp = moe_dp x ep (got dp=%d ep=%d moe_dp=%d)",
                   cfg->dp.size, ep, cfg->moe_dp.size);
    DOPT_CHECK_ARG(cfg->ep.rank >= 0 && cfg->ep.rank < ep && cfg->moe_dp.rank >= 0 &&
                       cfg->moe_dp.rank < cfg->moe_dp.size && cfg->dp.rank == cfg->moe_dp.rank * ep + cfg->ep.rank,
                   "dopt_dist_create: dp rank %d must be moe_dp rank %d x ep %d + ep rank %d (ep inside dp)",
                   cfg->dp.rank, cfg->moe_dp.rank, ep, cfg->ep.rank);
  }
  DOPT_CHECK_ARG(cfg->version < 6 || !cfg->experts || (moe && cfg->num_experts >= 1),
                 "dopt_dist_create: experts given with num_experts=%d (plugin '%s'): expert ids need plugin "
                 "moe_hybrid and num_experts >= 1", cfg->version >= 6 ? cfg->num_experts : 0,
                 cfg->plugin ? cfg->plugin : "");
  DOPT_CHECK_ARG(cfg->max_grad_norm >= 0 && isfinite(cfg->max_grad_norm),
                 "dopt_dist_create: max_grad_norm=%g must be finite and >= 0", cfg->max_grad_norm);
  return dopt_dist_check_layout(cfg->plugin, cfg->tp.size, cfg->dp.size, cfg->zero_stage);
}

/* Sets this rank's values of parameter p from the logical fp32 tensor `full`
 * (host): its TP block (row by row), the fp32 extent it holds (the master
 * shard, or the whole TP-local block) and the bf16 working copy of the
 * extent it holds. At creation and after an owner step. */
dopt_status dd_load_values(dopt_dist_optim *d, dist_param *p, const float *full) {
  const dopt_piece *pc = &p->pc;
  /* the TP block assembled in place where the master holds all of it in host memory, else in a scratch */
  const int direct = DEV(d)->host_chunk && !p->master_sharded;
  float *blk = p->master;
  if (!direct) {
    unsigned char *bb = NULL;
    DOPT_TRY(dd_ghost(d, 1, (p->lnumel ? p->lnumel : 1) * sizeof(float), &bb));
    blk = (float *)(void *)bb;
  }
  for (size_t bi = 0; bi < pc->b; bi++)
    for (size_t i = 0; i < pc->hl; i++)
      memcpy(blk + (bi * pc->hl + i) * pc->wl, full + (bi * pc->h + pc->h0 + i) * pc->w + pc->w0,
             pc->wl * sizeof(float));
  size_t from = p->master_sharded ? pc->lo : 0, count = p->master_sharded ? pc->len : p->lnumel;
  dopt_status s = direct ? DOPT_OK : DEV(d)->upload(DCTX(d), p->master, blk + from, count * sizeof(float));
  if (s == DOPT_OK && p->bf16) { /* the working copy of the extent this rank holds */
    size_t wfrom = d->zero == 3 ? pc->lo : 0, wcount = d->zero == 3 ? pc->len : p->lnumel;
    unsigned char *hb = NULL;
    s = dd_ghost(d, 0, (wcount ? wcount : 1) * sizeof(uint16_t), &hb);
    uint16_t *hw = (uint16_t *)(void *)hb;
    for (size_t k = 0; s == DOPT_OK && k < wcount; k++) hw[k] = dopt_f32_to_bf16(blk[wfrom + k]);
    if (s == DOPT_OK) s = DEV(d)->upload(DCTX(d), p->work, hw, wcount * sizeof *hw);
  }
  return s;
}

/* Bytes of state k this rank's buffer holds: an elementwise state's ZeRO
 * shard (sharded like the parameter), a blockwise state's values of the
 * blocks this rank's piece falls in, else the whole logical state (owner
 * mode: every state whole, on the owner only). */
size_t dd_state_held_bytes(const dist_param *p, int k) {
  const size_t es = dopt_dtype_size(p->spec[k].v.dtype);
  if (p->owned) return p->spec[k].v.bytes / (size_t)p->nunits * (p->u1 - p->u0); /* this rank's units */
  if (p->spec[k].kind == DOPT_STATE_WHOLE) return p->spec[k].v.bytes;
  return (p->spec[k].kind == DOPT_STATE_ELEMENTWISE ? p->chunk : p->nblk) * es;
}

static int cmp_size(const void *a, const void *b) {
  const size_t x = *(const size_t *)a, y = *(const size_t *)b;
  return (x > y) - (x < y);
}

/* Appends v to the growable host list *l (*n used, *cap allocated). */
static int push_size(size_t **l, size_t *n, size_t *cap, size_t v) {
  if (*n == *cap) {
    size_t c = *cap ? 2 * *cap : 64;
    size_t *q = realloc(*l, c * sizeof *q);
    if (!q) return 0;
    *l = q, *cap = c;
  }
  (*l)[(*n)++] = v;
  return 1;
}

/* The blocks of B elements that the pieces of several ranks hold elements of: every rank's piece (each TP
 * block and, sharded, each ZeRO range of it) cut into its logically contiguous runs; a run that starts
 * inside a block shares that block with the piece holding the element before it (every boundary between
 * two pieces is such a start). From the layout alone, so the list is the same on every rank. */
static dopt_status share_blocks(dopt_dist_optim *d, dist_param *p, size_t B) {
  size_t *l = NULL, n = 0, cap = 0;
  dopt_piece pc;
  dopt_piece_full(p->ndim, p->shape, &pc);
  const int tpn = p->role == DOPT_TP_REPLICATED ? 1 : d->tp.size, dpn = d->zero >= 1 ? dd_dpg(d, p)->size : 1;
  for (int r = 0; r < tpn; r++) {
    dd_tp_block(p, d->tp.size, r, &pc.h0, &pc.hl, &pc.w0, &pc.wl);
    const size_t ln = pc.b * pc.hl * pc.wl;
    for (int q = 0; q < dpn; q++) {
      if (dpn > 1) dd_shard(d, p, r, (size_t)q, &pc.lo, &pc.len);
      else pc.lo = 0, pc.len = ln;
      size_t off = 0;
      dopt_run run;
      while (dopt_piece_next_run(&pc, &off, &run))
        if (run.at % B && !push_size(&l, &n, &cap, run.at / B)) {
          free(l);
          return dopt__fail(DOPT_ERR_NO_MEMORY, "dopt_dist_create: '%s': shared blocks (%zu)", p->name, n);
        }
    }
  }
  if (n) qsort(l, n, sizeof *l, cmp_size);
  size_t u = 0;
  for (size_t i = 0; i < n; i++)
    if (u == 0 || l[i] != l[u - 1]) l[u++] = l[i];
  p->share.block = B;
  p->share.n = u;
  dopt_status s = dd_dalloc(d, u * sizeof *l, (void **)&p->share.idx);
  if (s == DOPT_OK) s = dd_dalloc(d, 2 * u * sizeof(double), (void **)&p->share.max);
  if (s == DOPT_OK && u) s = DEV(d)->upload(DCTX(d), (void *)(uintptr_t)p->share.idx, l, u * sizeof *l);
  free(l);
  return s;
}

/* The blockwise states' geometry of a piecewise parameter: its block, the blocks of this rank's piece, the
 * shared blocks. */
static dopt_status plan_blocks(dopt_dist_optim *d, dist_param *p) {
  const long long B = dopt_layout_block(p->spec, p->nstates);
  if (B < 0) return dopt__fail(DOPT_ERR_STATE, "dopt_dist_create: '%s': blockwise states of different blocks", p->name);
  if (B == 0 || p->owned) return DOPT_OK;
  for (int k = 0; k < p->nstates; k++)
    if (p->spec[k].kind == DOPT_STATE_BLOCKWISE && p->spec[k].v.dtype != DOPT_F32)
      return dopt__fail(DOPT_ERR_UNSUPPORTED, "dopt_dist_create: '%s': blockwise state '%s' is %s (F32 only)", p->name,
                        p->spec[k].v.name, dopt_dtype_name(p->spec[k].v.dtype));
  p->qblock = (size_t)B;
  p->nblk = dopt_piece_blocks(&p->pc, p->qblock, NULL);
  p->blk = malloc((p->nblk ? p->nblk : 1) * sizeof *p->blk);
  if (!p->blk) return dopt__fail(DOPT_ERR_NO_MEMORY, "dopt_dist_create: '%s': %zu blocks", p->name, p->nblk);
  dopt_piece_blocks(&p->pc, p->qblock, p->blk);
  return share_blocks(d, p, p->qblock);
}

/* Sets up one parameter whose stage, shape and role dopt_dist_create set: its geometry, buffers, the initial
 * values of its piece. role: the one given (p->role: replicated without tensor parallelism). */
static dopt_status setup_param(dopt_dist_optim *d, dist_param *p, const dopt_param *src, dopt_tp_role role) {
  const dopt_transport *g = dd_dpg(d, p); /* its data-parallel group: dp, or an expert's moe_dp */
  const int tpn = d->tp.size, dpn = g->size;
  p->name = malloc(strlen(src->name) + 1);
  if (!p->name) return dopt__fail(DOPT_ERR_NO_MEMORY, "dopt_dist_create: '%s'", src->name);
  strcpy(p->name, src->name);
  p->group = src->group;
  p->bf16 = src->work != NULL;
  if (role == DOPT_TP_ROW && src->ndim < 2)
    return dopt__fail(DOPT_ERR_INVALID_ARG, "dopt_dist_create: '%s' role ROW needs a >= 2-D tensor (ndim=%d)", src->name,
                      src->ndim);
  if (role == DOPT_TP_COLUMN && src->ndim < 1)
    return dopt__fail(DOPT_ERR_INVALID_ARG, "dopt_dist_create: '%s' is a scalar; it can only be replicated", src->name);
  dopt_piece *pc = &p->pc;
  dopt_piece_full(p->ndim, p->shape, pc);
  dd_tp_block(p, tpn, d->tp.rank, &pc->h0, &pc->hl, &pc->w0, &pc->wl);
  const int here = dd_present(d, p);
  if (!here) pc->hl = 0; /* another stage's or ep rank's parameter: an empty block (no gradient, values, states) */
  p->lnumel = pc->b * pc->hl * pc->wl;
  p->lndim = p->ndim;
  memcpy(p->lshape, p->shape, sizeof p->lshape);
  if (p->role == DOPT_TP_COLUMN) p->lshape[p->ndim >= 2 ? p->ndim - 2 : 0] = (int64_t)(p->ndim >= 2 ? pc->hl : pc->wl);
  if (p->role == DOPT_TP_ROW) p->lshape[p->ndim - 1] = (int64_t)pc->wl;
  if (!here) p->lshape[0] = 0, p->lndim = p->ndim > 0 ? p->ndim : 1;
  /* ZeRO: flatten, pad to a multiple of dp, split evenly */
  if (d->zero >= 1) {
    dd_shard(d, p, d->tp.rank, (size_t)g->rank, &pc->lo, &pc->len);
    if (dd_exact_shards(d, p)) { /* this rank's piece alone: the collectives move exact counts (all_to_allv) */
      p->chunk = pc->len;
      p->padded = p->lnumel;
    } else {
      p->chunk = (p->lnumel + (size_t)dpn - 1) / (size_t)dpn;
      p->padded = p->chunk * (size_t)dpn;
    }
  } else {
    p->chunk = p->padded = p->lnumel;
    pc->lo = 0;
    pc->len = p->lnumel;
  }
  /* fp32 parameters are the model weights: whole on every rank up to zero 2.
   * With bf16 working copies only those are whole; the masters stay shards. */
  p->master_sharded = d->zero == 3 || (p->bf16 && d->zero >= 1);
  size_t mext = p->master_sharded ? p->chunk : p->padded, wext = d->zero == 3 ? p->chunk : p->padded;
  DOPT_TRY(dd_dalloc(d, p->padded * sizeof(float), (void **)&p->grad));
  DOPT_TRY(dd_dalloc(d, mext * sizeof(float), (void **)&p->master));
  if (p->bf16) DOPT_TRY(dd_dalloc(d, wext * sizeof(uint16_t), (void **)&p->work));
  DOPT_TRY(dd_load_values(d, p, src->data));
  /* states: elementwise ones are sharded like the parameter, blockwise ones by the blocks of its piece, the
   * others whole; none for another stage's parameter */
  p->nstates = d->impl->layout(d->hp[p->group], p->ndim, p->shape, p->spec);
  if (here) DOPT_TRY(plan_blocks(d, p));
  if (p->owned) { /* the states and the logical values of its units on each owner rank only */
    dd_units(d, p, g->rank * tpn + d->tp.rank, &p->u0, &p->u1);
    if (p->u1 > p->u0) {
      const size_t lu = dopt_numel(p->ndim, p->shape) / (size_t)p->nunits, cnt = (p->u1 - p->u0) * lu;
      DOPT_TRY(dd_dalloc(d, cnt * sizeof(float), (void **)&p->full));
      DOPT_TRY(DEV(d)->upload(DCTX(d), p->full, src->data + p->u0 * lu, cnt * sizeof(float)));
      for (int k = 0; k < p->nstates; k++) DOPT_TRY(dd_dalloc(d, dd_state_held_bytes(p, k), &p->state[k]));
    }
  } else if (here) {
    for (int k = 0; k < p->nstates; k++) DOPT_TRY(dd_dalloc(d, dd_state_held_bytes(p, k), &p->state[k]));
  }
  p->step = src->step;
  p->rc.d = d;
  p->rc.over_tp = p->role != DOPT_TP_REPLICATED;
  /* owner mode: the averaged gradient is on the owner's dp row only (gpc), so its statistics sum over dp */
  p->rc.over_dp = (d->zero >= 1 || p->owned) && dpn > 1;
  p->rc.dpt = p->expert >= 0 ? T_MDP : T_DP;
  p->gpc = p->pc;
  if (p->owned) { /* its dp row's units of the TP block */
    size_t ru0, ru1;
    dd_row_units(d, p, g->rank, &ru0, &ru1);
    dd_held_piece(p, 0, &p->gpc);
    const size_t bu = p->lnumel / (size_t)p->nunits;
    p->gpc.lo = ru1 > ru0 ? ru0 * bu : 0;
    p->gpc.len = (ru1 - ru0) * bu;
  }
  p->red.ctx = &p->rc;
  p->red.post_max_f64 = dd_post_max;
  p->red.post_sum_i64 = dd_post_sum;
  /* bucketing must cut the parameter list at the same places on every rank:
   * estimate the frame from logical sizes, not from this rank's piece */
  size_t sharing = (p->rc.over_tp ? (size_t)tpn : 1) * (p->rc.over_dp ? (size_t)dpn : 1);
  p->est = dopt_numel(p->ndim, p->shape) * sizeof(float) / sharing;
  return DOPT_OK;
}

/* Owner mode: the parameters in owner mode go to the world's ranks by their
 * step cost and state bytes (dopt__assign_owners: largest cost first, each
 * where the larger share of the two stays smallest; docs/distributed.md
 * "Owners by cost"); world slot w is tp rank w mod tp, dp rank w / tp. A
 * tensor of several units (dopt__impl_units: an expert stack whose states are
 * all elementwise) is min(units, world) items of consecutive units, and each
 * slot owns as many of its units as its items hold, in slot order (ub).
 * Logical shapes only, so every rank agrees. MoE: the dense parameters over
 * the world's tp x dp slots, an ep rank's experts (experts = 1) over the tp x
 * moe_dp slots of its group (slot: moe_dp rank · tp + tp rank), separately,
 * so that the dense owners are the same on every ep rank. */
static dopt_status assign_owners(dopt_dist_optim *d, dopt_optim *po, int experts) {
  const int world = d->tp.size * (experts ? d->mdp.size : d->dp.size);
  size_t n = 0;
  for (int i = 0; i < d->np; i++) {
    dist_param *p = &d->p[i];
    if (!p->owned || (p->expert >= 0) != experts) continue;
    const dopt_param *q = dopt__optim_param(po, i);
    dopt_state_spec sp[DOPT_MAX_STATES];
    const int ns = d->impl->layout(d->hp[q->group], q->ndim, q->shape, sp);
    p->nunits = dopt__impl_units(d->impl, d->hp[q->group], q->ndim, q->shape);
    for (int k = 0; k < ns; k++)
      if (sp[k].kind != DOPT_STATE_ELEMENTWISE) p->nunits = 1;
    n += p->nunits > world ? (size_t)world : (size_t)p->nunits;
  }
  const size_t na = n ? n : 1;
  double *cost = malloc(na * sizeof *cost), *bytes = malloc(na * sizeof *bytes);
  int *idx = malloc(na * sizeof *idx), *slot = malloc(na * sizeof *slot);
  size_t *g0 = malloc(na * sizeof *g0), *g1 = malloc(na * sizeof *g1);
  int ok = cost && bytes && idx && slot && g0 && g1 && n <= (size_t)INT32_MAX;
  n = 0;
  for (int i = 0; ok && i < d->np; i++) {
    dist_param *p = &d->p[i];
    if (!p->owned || (p->expert >= 0) != experts) continue;
    const dopt_param *q = dopt__optim_param(po, i);
    const double *hp = d->hp[q->group];
    dopt_state_spec sp[DOPT_MAX_STATES];
    const int ns = d->impl->layout(hp, q->ndim, q->shape, sp);
    double b = 0;
    for (int k = 0; k < ns; k++) b += (double)sp[k].v.bytes;
    const double c = dopt__impl_cost(d->impl, hp, q->ndim, q->shape), nu = (double)p->nunits;
    const size_t G = p->nunits > world ? (size_t)world : (size_t)p->nunits;
    for (size_t g = 0; g < G; g++, n++) { /* units [g·nu/G, (g + 1)·nu/G) */
      g0[n] = g * (size_t)p->nunits / G, g1[n] = (g + 1) * (size_t)p->nunits / G;
      const double share = (double)(g1[n] - g0[n]) / nu;
      cost[n] = c * share, bytes[n] = b * share, idx[n] = i;
    }
    if (p->nunits > 1) {
      p->ub = calloc((size_t)world + 1, sizeof *p->ub);
      ok = p->ub != NULL;
    }
  }
  ok = ok && dopt__assign_owners((int)n, cost, bytes, world, slot) == 0;
  for (size_t k = 0; ok && k < n; k++) {
    dist_param *p = &d->p[idx[k]];
    if (p->ub) p->ub[slot[k] + 1] += g1[k] - g0[k]; /* counts per slot, then their prefix sums */
    else p->owner = slot[k] / d->tp.size, p->owner_tp = slot[k] % d->tp.size;
  }
  for (int i = 0; ok && i < d->np; i++)
    for (int s = 0; d->p[i].ub && (d->p[i].expert >= 0) == experts && s < world; s++) d->p[i].ub[s + 1] += d->p[i].ub[s];
  free(cost), free(bytes), free(idx), free(slot), free(g0), free(g1);
  return ok ? DOPT_OK : dopt__fail(DOPT_ERR_NO_MEMORY, "dopt_dist_create: owners of %zu owned units", n);
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
  d->tp = cfg->tp;
  d->dp = cfg->dp;
  d->pp = cfg->version >= 4 && cfg->pp.size > 1 ? cfg->pp : (dopt_transport){NULL, NULL, 0, 1};
  const int moe_ep = cfg->version >= 6 && cfg->ep.size > 1;
  d->ep = moe_ep ? cfg->ep : (dopt_transport){NULL, NULL, 0, 1};
  d->mdp = moe_ep ? cfg->moe_dp : cfg->dp;
  d->chunk_elems = cfg->version >= 5 ? cfg->chunk_elems : 0;
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
  d->xn = (size_t)(d->tp.size > d->dp.size ? d->tp.size : d->dp.size);
  d->xc = calloc(5 * d->xn, sizeof *d->xc);
  d->views = calloc(d->xn, sizeof *d->views);
  d->xoff = calloc(npa, sizeof *d->xoff);
  d->xlist = calloc(npa, sizeof *d->xlist);
  d->xord = calloc(npa, sizeof *d->xord);
  dopt_status cs = DEV(d)->alloc(DCTX(d), (npa + 1) * sizeof(int64_t), (void **)&d->flags);
  if (cs != DOPT_OK) d->flags = NULL;
  if (!d->hp || !d->p || !d->ss || !d->args || !d->frame_off || !d->more || !d->layer || !d->has || !d->frozen ||
      !d->skip || !d->flags || !d->xc || !d->views || !d->xoff || !d->xlist || !d->xord) {
    dopt_dist_destroy(d);
    return dopt__fail(DOPT_ERR_NO_MEMORY, "dopt_dist_create: %d parameters", d->np);
  }
  for (int g = 0; g < d->ngroups; g++) memcpy(d->hp[g], dopt__optim_group_hp(plain, g), sizeof d->hp[g]);
  /* owner mode per parameter: GaLore's projected matrices (the SVD), 8-bit blocks of the logical tensor; the
   * other parameters of those optimizers step piecewise */
  /* every parameter's stage, logical shape and role: what the owners, the chunks and the layout start from */
  const int *stages = cfg->version >= 4 ? cfg->stages : NULL;
  const int *experts = cfg->version >= 6 ? cfg->experts : NULL, ne = experts ? cfg->num_experts : 0;
  for (int i = 0; i < d->np; i++) {
    const dopt_param *q = dopt__optim_param(po, i);
    dist_param *p = &d->p[i];
    const dopt_tp_role role = roles ? roles[i] : DOPT_TP_REPLICATED;
    p->stage = stages ? stages[i] : 0;
    p->expert = experts ? experts[i] : -1;
    p->home = -1;
    if (p->expert >= 0 && p->expert < ne) p->home = dopt_dist_expert_rank(p->expert, ne, d->ep.size);
    p->ndim = q->ndim;
    memcpy(p->shape, q->shape, sizeof p->shape);
    p->role = d->tp.size > 1 ? role : DOPT_TP_REPLICATED;
    dopt_status s = DOPT_OK;
    if (p->stage < 0 || p->stage >= d->pp.size)
      s = dopt__fail(DOPT_ERR_INVALID_ARG, "dopt_dist_create: stages[%d]=%d ('%s') outside [0, pp=%d)", i, p->stage,
                     q->name, d->pp.size);
    else if ((unsigned)role > DOPT_TP_ROW)
      s = dopt__fail(DOPT_ERR_INVALID_ARG, "dopt_dist_create: roles[%d]=%d", i, (int)role);
    else if (p->expert < DOPT_DIST_EXPERT_STACK || (p->expert >= 0 && p->expert >= ne))
      s = dopt__fail(DOPT_ERR_INVALID_ARG, "dopt_dist_create: experts[%d]=%d ('%s') outside [-1, num_experts=%d) "
                     "and not DOPT_DIST_EXPERT_STACK (-2)", i, p->expert, q->name, ne);
    else if (p->expert == DOPT_DIST_EXPERT_STACK && (q->ndim < 3 || q->shape[0] != ne))
      s = dopt__fail(DOPT_ERR_INVALID_ARG, "dopt_dist_create: experts[%d]=-2 ('%s') is a stack of experts: it needs "
                     "ndim >= 3 and shape[0] = num_experts=%d (ndim %d, shape[0] %lld)", i, q->name, ne, q->ndim,
                     (long long)(q->ndim ? q->shape[0] : 0));
    else if (dd_ep_stack(d, p) && d->dp.size > 1 &&
             (d->zero == 0 || d->dp_words < 1 || !d->dp.ops->all_to_allv))
      s = dopt__fail(DOPT_ERR_INVALID_ARG, "dopt_dist_create: '%s', a stack of experts split over ep=%d, needs zero 1 "
                     "or 2 (got %d), the exact dp sum (dp_sum_words=%d) and the dp transport's all_to_allv (its "
                     "shards are exact ranges of each ep rank's experts)", q->name, d->ep.size, d->zero, d->dp_words);
    if (s != DOPT_OK) {
      dopt_dist_destroy(d);
      return s;
    }
  }
  if (d->chunk_elems) {
    dopt_status s = plan_chunks(d);
    if (s != DOPT_OK) {
      dopt_dist_destroy(d);
      return s;
    }
  }
  for (int i = 0; i < d->np; i++) {
    const dopt_param *q = dopt__optim_param(po, i);
    /* a parameter of another stage or ep rank is held nowhere on this one: not owned here */
    d->p[i].owned = dd_present(d, &d->p[i]) && dopt__impl_whole(d->impl, d->hp[q->group], q->ndim, q->shape);
    d->p[i].nunits = 1;
    d->nowned += d->p[i].owned;
  }
  if (d->nowned) {
    dopt_status s = assign_owners(d, po, 0);
    if (s == DOPT_OK) s = assign_owners(d, po, 1);
    if (s != DOPT_OK) {
      dopt_dist_destroy(d);
      return s;
    }
  }
  for (int i = 0; i < d->np; i++) {
    dopt_status s = setup_param(d, &d->p[i], dopt__optim_param(po, i), roles ? roles[i] : DOPT_TP_REPLICATED);
    d->layer[i] = dopt__optim_param(po, i)->layer;
    if (s != DOPT_OK) {
      d->np = i + 1; /* free what was set up */
      dopt_dist_destroy(d);
      return s;
    }
  }
  /* the exact dp sum's codes: per parameter its non-finite flag, then its logical blocks' codes (a bucket of
   * consecutive parameters is one range: one MAX) */
  d->code_off = calloc(npa + 1, sizeof *d->code_off);
  d->hflags = calloc(npa, sizeof *d->hflags);
  d->part_at = calloc(npa, sizeof *d->part_at);
  d->ncodes = 0;
  for (int i = 0; d->code_off && i < d->np; i++) {
    d->code_off[i] = d->ncodes + 1;
    d->ncodes += 1 + dopt_grid_blocks(dopt_numel(d->p[i].ndim, d->p[i].shape));
  }
  if (d->code_off) d->code_off[d->np] = d->ncodes + 1; /* the end of the last range, + 1 */
  cs = d->code_off && d->hflags && d->part_at ? dd_dalloc(d, d->ncodes * sizeof(int32_t), (void **)&d->codes) : DOPT_ERR_NO_MEMORY;
  if (cs != DOPT_OK) {
    d->codes = NULL;
    dopt_dist_destroy(d);
    return dopt__fail(DOPT_ERR_NO_MEMORY, "dopt_dist_create: the dp sum's block codes of %d parameters", d->np);
  }
  for (int k = 0; k < 3; k++) { /* the loading scratch (a ZeRO-3 shard's TP block, bf16 copies): not kept */
    free(d->ghost[k]);
    d->ghost[k] = NULL, d->ghost_cap[k] = 0;
  }
  *out = d;
  return DOPT_OK;
}

int dopt_dist_expert_rank(int e, int ne, int ep) {
  if (e < 0 || ne < 1 || e >= ne || ep < 1) return -1;
  const int base = ne / ep, rem = ne % ep; /* ranks [0, rem) hold base + 1 experts, the others base */
  return e < rem * (base + 1) ? e / (base + 1) : rem + (e - rem * (base + 1)) / base;
}

int dd_bucket_end(const dopt_dist_optim *d, int b0, int (*member)(const dopt_dist_optim *d, int i)) {
  size_t est = 0;
  int n = 0, b1 = b0;
  const int experts = b0 < d->np && d->p[b0].expert >= 0; /* one data-parallel group per bucket */
  for (; b1 < d->np; b1++) {
    if ((d->p[b1].expert >= 0) != experts) break;
    if (member && !member(d, b1)) continue;
    const dist_param *p = &d->p[b1];
    const size_t e = dopt_numel(p->ndim, p->shape) * sizeof(float) / (size_t)d->tp.size;
    const int big = d->bucket_bytes && 2 * e >= d->bucket_bytes;
    if (n > 0 && d->bucket_bytes && (big || est + e > d->bucket_bytes)) break;
    est += e;
    n++;
    if (big) return b1 + 1;
  }
  return b1;
}

dopt_status dd_check_param(const dopt_dist_optim *d, int i, const char *fn) {
  DOPT_CHECK_ARG(d != NULL, "%s: optimizer=NULL", fn);
  DOPT_CHECK_ARG(i >= 0 && i < d->np, "%s: param=%d out of range [0, %d)", fn, i, d->np);
  return DOPT_OK;
}

dopt_status dopt_dist_local_shape(const dopt_dist_optim *d, int i, int *ndim, int64_t *shape, size_t *numel) {
  DOPT_TRY(dd_check_param(d, i, "dopt_dist_local_shape"));
  const dist_param *p = &d->p[i];
  if (ndim) *ndim = p->lndim;
  if (shape) memcpy(shape, p->lshape, sizeof p->lshape);
  if (numel) *numel = p->lnumel;
  return DOPT_OK;
}

dopt_status dopt_dist_layout(const dopt_dist_optim *d, int i, dopt_layout_piece *out) {
  DOPT_TRY(dd_check_param(d, i, "dopt_dist_layout"));
  DOPT_CHECK_ARG(out != NULL, "dopt_dist_layout: out=NULL");
  const dist_param *p = &d->p[i];
  /* gpc: pc, or in owner mode the owner's whole block; len 0 (an empty TP block or shard, another stage's
   * parameter) stays 0 */
  dopt_piece none;
  const dopt_piece *pc = &p->gpc;
  if (!dd_present(d, p)) { /* another stage's parameter: nothing of it (its emptied block is no TP block) */
    dopt_piece_full(p->ndim, p->shape, &none);
    none.lo = none.len = 0;
    pc = &none;
  }
  DOPT_TRY(dopt_layout_from_piece(pc, p->ndim, out));
  if (d->pp.size > 1) out->stage = p->stage;
  out->expert = p->expert >= 0 ? p->expert : -1; /* a stack's experts are the indices of its dimension 0 */
  return DOPT_OK;
}

/* The piece this rank holds of parameter p's tensors: its ZeRO range of the
 * TP block (`sharded`), or the whole TP block. */
void dd_held_piece(const dist_param *p, int sharded, dopt_piece *out) {
  *out = p->pc;
  if (!sharded) {
    out->lo = 0;
    out->len = p->lnumel;
  }
}

/* The first unit of world slot s (ub[s]; one unit: 0 up to the owner's slot, 1 after it). */
static size_t ub_at(const dopt_dist_optim *d, const dist_param *p, int s) {
  if (p->ub) return p->ub[s];
  return s <= p->owner * d->tp.size + p->owner_tp ? 0 : 1;
}

void dd_units(const dopt_dist_optim *d, const dist_param *p, int slot, size_t *u0, size_t *u1) {
  *u0 = ub_at(d, p, slot), *u1 = ub_at(d, p, slot + 1);
}

void dd_row_units(const dopt_dist_optim *d, const dist_param *p, int row, size_t *u0, size_t *u1) {
  *u0 = ub_at(d, p, row * d->tp.size), *u1 = ub_at(d, p, (row + 1) * d->tp.size);
}

/* The divisor of p's averaged gradient: its dp group's size · micro-batches (an ep-split stack: each element is
 * one expert's, summed over dp with zeros off its ep rank, averaged over the moe_dp ranks that gave it). */
float dd_avg_denom(const dopt_dist_optim *d, const dist_param *p) {
  return (float)((double)(dd_ep_stack(d, p) ? d->mdp.size : dd_dpg(d, p)->size) * (double)d->micro);
}
