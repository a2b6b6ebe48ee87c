/* Owner mode (docs/distributed.md#owner-mode): a parameter whose step needs
 * the whole tensor (GaLore's SVD, 8-bit blocks of the logical tensor;
 * dopt__impl_whole) steps with the reference's own step on one owner rank,
 * (dp rank p->owner, tp rank p->owner_tp). Its data moves as little as the
 * whole-tensor step allows:
 *   gradient  the exact dp sum's words are reduced to the owner's dp row only
 *             (dp_sum.c, dd_dp_sum) and averaged there; the owner row's TP
 *             blocks go to the owner (one all_to_allv over tp per batch);
 *   values    the owner sends each TP rank of its row that rank's block of
 *             the new tensor (all_to_allv over tp), and the owner rows send
 *             each dp rank what it holds: the whole TP block up to zero 2,
 *             its ZeRO shard with zero 3 (one all_to_allv over dp per batch).
 * Many owners share each exchange: the owned parameters stepped this step
 * are cut into batches of at most the bucket budget (logical bytes, the same
 * cut on every rank); within a batch and an owner row they are ordered by
 * the owner's tp rank, then by index, so that what one rank sends another is
 * one contiguous region. A transport without reduce or all_to_allv gets an
 * all-reduce (dp_sum.c) and one broadcast per region (exchange, below).
 * Bitwise the reference by construction: the same step on the same whole
 * tensors. */
#include <stdlib.h>
#include <string.h>

#include "dist_internal.h"

/* ---- helpers ---------------------------------------------------------------------------- */

/* Sends the buffer x[count] (device) of the rank at dp rank `owner`, tp rank
 * `owner_tp` to every rank: over tp in the owner's dp row, then over dp in
 * every tp column. */
dopt_status dd_from_rank(dopt_dist_optim *d, int owner, int owner_tp, void *x, size_t count, dopt_dtype dt) {
  if (d->tp.size > 1 && d->dp.rank == owner) DOPT_TRY(d->tp.ops->broadcast(d->tp.comm, x, x, count, dt, owner_tp));
  if (d->dp.size > 1) DOPT_TRY(d->dp.ops->broadcast(d->dp.comm, x, x, count, dt, owner));
  return DOPT_OK;
}

/* The owner's whole buffer of parameter p to every rank. */
dopt_status dd_from_owner(dopt_dist_optim *d, const dist_param *p, void *x, size_t count, dopt_dtype dt) {
  return dd_from_rank(d, p->owner, p->owner_tp, x, count, dt);
}

/* Elements of TP rank r's block of p (the whole tensor when replicated). */
static size_t block_numel(const dopt_dist_optim *d, const dist_param *p, int r) {
  size_t h0, hl, w0, wl;
  dd_tp_block(p, d->tp.size, r, &h0, &hl, &w0, &wl);
  return p->pc.b * hl * wl;
}

/* Copies TP rank r's block between the logical tensor full[numel] and the
 * packed block blk[block_numel] (device memory both): to_full != 0 writes
 * the block into full. Rows of the [b, h, w] view; whole rows in one run. */
static dopt_status block_copy(dopt_dist_optim *d, const dist_param *p, int r, float *full, float *blk, int to_full) {
  size_t h0, hl, w0, wl;
  dd_tp_block(p, d->tp.size, r, &h0, &hl, &w0, &wl);
  const dopt_piece *pc = &p->pc;
  const size_t run = wl == pc->w ? hl * wl : wl, nrun = wl == pc->w ? 1 : hl;
  if (run == 0) return DOPT_OK;
  for (size_t bi = 0; bi < pc->b; bi++)
    for (size_t i = 0; i < nrun; i++) {
      float *f = full + (bi * pc->h + h0 + i) * pc->w + w0, *b = blk + (bi * hl + i) * wl;
      DOPT_TRY(DEV(d)->copy(DCTX(d), to_full ? f : b, to_full ? b : f, run * sizeof(float)));
    }
  return DOPT_OK;
}

/* This rank's values of p from x (device), which holds elements
 * [x_lo, ...) of its TP block: the fp32 extent it keeps (the master shard,
 * or the whole block) and the bf16 working copy of the extent it keeps. */
static dopt_status load_from(dopt_dist_optim *d, dist_param *p, const float *x, size_t x_lo) {
  const dopt_piece *pc = &p->pc;
  size_t from = p->master_sharded ? pc->lo : 0, count = p->master_sharded ? pc->len : p->lnumel;
  if (count) DOPT_TRY(DEV(d)->copy(DCTX(d), p->master, x + (from - x_lo), count * sizeof(float)));
  if (!p->bf16) return DOPT_OK;
  size_t wfrom = d->zero == 3 ? pc->lo : 0, wcount = d->zero == 3 ? pc->len : p->lnumel;
  return wcount ? DEV(d)->to_bf16(DCTX(d), x + (wfrom - x_lo), p->work, wcount) : DOPT_OK;
}

/* A personalised exchange: the transport's all_to_allv, or (a transport
 * without one) the regions one by one as broadcasts, every rank knowing the
 * whole count matrix from one all-gather of the send counts. */
static dopt_status exchange(dopt_dist_optim *d, const dopt_transport *t, const void *send, const size_t *sc,
                            const size_t *sd, void *recv, const size_t *rc, const size_t *rd) {
  if (t->ops->all_to_allv) return t->ops->all_to_allv(t->comm, send, sc, sd, recv, rc, rd, DOPT_F32);
  const int n = t->size;
  int64_t *m = NULL, *hm = malloc((size_t)n * (size_t)n * sizeof *hm);
  if (!hm) return dopt__fail(DOPT_ERR_NO_MEMORY, "distributed owner exchange: %d x %d counts", n, n);
  dopt_status s = dd_dalloc(d, (size_t)n * (size_t)n * sizeof *m, (void **)&m);
  for (int j = 0; s == DOPT_OK && j < n; j++) hm[(size_t)t->rank * (size_t)n + (size_t)j] = (int64_t)sc[j];
  if (s == DOPT_OK) s = DEV(d)->upload(DCTX(d), m + (size_t)t->rank * (size_t)n, hm + (size_t)t->rank * (size_t)n,
                                       (size_t)n * sizeof *m);
  if (s == DOPT_OK) s = t->ops->all_gather(t->comm, m + (size_t)t->rank * (size_t)n, m, (size_t)n, DOPT_I64);
  if (s == DOPT_OK) s = DEV(d)->download(DCTX(d), hm, m, (size_t)n * (size_t)n * sizeof *m);
  size_t most = 1;
  for (size_t k = 0; s == DOPT_OK && k < (size_t)n * (size_t)n; k++) most = (size_t)hm[k] > most ? (size_t)hm[k] : most;
  void *tmp = NULL;
  if (s == DOPT_OK) s = dd_gdev(d, 1, most * sizeof(float), &tmp);
  for (int src = 0; s == DOPT_OK && src < n; src++)
    for (int dst = 0; s == DOPT_OK && dst < n; dst++) {
      size_t cnt = (size_t)hm[(size_t)src * (size_t)n + (size_t)dst];
      if (cnt == 0) continue;
      if (src == dst) { /* a rank's own region: a copy, no collective (every rank skips it) */
        if (src == t->rank)
          s = DEV(d)->copy(DCTX(d), (float *)recv + rd[src], (const float *)send + sd[dst], cnt * sizeof(float));
        continue;
      }
      float *buf = src == t->rank ? (float *)(uintptr_t)((const float *)send + sd[dst])
                   : dst == t->rank ? (float *)recv + rd[src] : tmp;
      s = t->ops->broadcast(t->comm, buf, buf, cnt, DOPT_F32, src);
    }
  if (m) DEV(d)->free(DCTX(d), m);
  free(hm);
  return s;
}

/* ---- one batch ---------------------------------------------------------------------------- */

/* The owned parameters of batch list[0, n) (ascending index) owned by dp row
 * `row`, in the exchange order (the owner's tp rank, then index): out[0, *m). */
static void row_order(const dopt_dist_optim *d, const int *list, int n, int row, int *out, int *m) {
  *m = 0;
  for (int t = 0; t < d->tp.size; t++)
    for (int k = 0; k < n; k++)
      if (d->p[list[k]].owner == row && d->p[list[k]].owner_tp == t) out[(*m)++] = list[k];
}

/* Whether every TP block of p is one run of the logical tensor (rows split
 * with one batch, a 1-D split, replicated); then block r starts at *off. */
static int block_run(const dopt_dist_optim *d, const dist_param *p, int r, size_t *off) {
  size_t h0, hl, w0, wl;
  dd_tp_block(p, d->tp.size, r, &h0, &hl, &w0, &wl);
  const dopt_piece *pc = &p->pc;
  *off = (h0 * pc->w + w0);
  return (pc->b == 1 && (hl <= 1 || wl == pc->w)) || (hl == pc->h && wl == pc->w);
}

static int all_runs(const dopt_dist_optim *d, const dist_param *p) {
  size_t off;
  for (int r = 0; r < d->tp.size; r++)
    if (!block_run(d, p, r, &off)) return 0;
  return 1;
}

/* The new values of p can be received straight into its fp32 parameter: the
 * rank keeps the whole TP block in fp32, nothing else. */
static int values_direct(const dist_param *p) { return !p->bf16 && !p->master_sharded; }

/* The owner's step of parameter i on the whole gradient g (device [numel]). */
static dopt_status step_whole(dopt_dist_optim *d, int i, const float *g) {
  dist_param *p = &d->p[i];
  dopt_piece whole;
  dopt_piece_full(p->ndim, p->shape, &whole);
  p->events = 0;
  dopt_step_args a = {d->impl, d->hp[p->group], p->step, &whole, p->full, g, p->state, NULL, NULL, &p->events,
                      (uint64_t)i, 0, NULL, NULL, NULL, NULL, 0, NULL, NULL, p->ndim, p->shape};
  DOPT_TRY(dd_grow_dev(d, &d->frames, &d->frames_cap, DEV(d)->frame_bytes(DCTX(d), &a)));
  a.frame = d->frames;
  return dopt__run_stages(d->dev, &a);
}

/* 1. the averaged TP blocks of my row's parameters ord[0, m) (dp_sum.c left them on this row) to their
 * owners over tp; *recv: where this rank, as an owner, received them (by source, then parameter), or the
 * logical gradient itself (*whole) when it owns one tensor whose blocks are runs of it. A replicated
 * tensor needs nothing: the owner's own block is the whole gradient. */
static dopt_status grads_to_owners(dopt_dist_optim *d, const int *ord, int m, const float **recv, int *whole) {
  const int T = d->tp.size, me = d->tp.rank;
  size_t *sc = d->xc, *sd = sc + d->xn, *rc = sd + d->xn, *rd = rc + d->xn;
  int nsend = 0, nrecv = 0, last_send = -1, last_recv = -1;
  size_t ssum = 0, rsum = 0;
  for (int k = 0; k < m; k++) {
    const dist_param *p = &d->p[ord[k]];
    if (p->role == DOPT_TP_REPLICATED) continue;
    nsend++, last_send = ord[k], ssum += p->lnumel;
    if (p->owner_tp == me) nrecv++, last_recv = ord[k], rsum += dopt_numel(p->ndim, p->shape);
  }
  *recv = NULL;
  *whole = 0;
  if (T == 1 || nsend == 0) return DOPT_OK; /* the same answer on every rank of the row */
  /* send: one tensor's block straight from its accumulator, else packed by destination */
  const float *send = nsend == 1 ? d->p[last_send].grad : NULL;
  if (!send) DOPT_TRY(dd_grow_dev(d, &d->xs, &d->xs_cap, ssum * sizeof(float)));
  size_t off = 0;
  for (int t = 0; t < T; t++) {
    sd[t] = off;
    sc[t] = rc[t] = 0;
    for (int k = 0; k < m; k++) {
      dist_param *p = &d->p[ord[k]];
      if (p->role == DOPT_TP_REPLICATED || p->owner_tp != t) continue;
      if (!send) DOPT_TRY(DEV(d)->copy(DCTX(d), (float *)d->xs + off, p->grad, p->lnumel * sizeof(float)));
      off += p->lnumel;
      sc[t] += p->lnumel;
    }
    if (send) sd[t] = 0;
  }
  /* receive: one tensor whose blocks are runs, straight into the logical gradient; else by source */
  float *dst = NULL;
  if (nrecv == 1 && all_runs(d, &d->p[last_recv])) {
    DOPT_TRY(dd_grow_dev(d, (void **)&d->xfer, &d->xfer_cap, rsum * sizeof(float)));
    dst = d->xfer;
    *whole = 1;
  } else {
    DOPT_TRY(dd_grow_dev(d, &d->xr, &d->xr_cap, (rsum ? rsum : 1) * sizeof(float)));
    dst = d->xr;
  }
  size_t roff = 0;
  for (int s = 0; s < T; s++) {
    rd[s] = roff;
    for (int k = 0; k < m; k++) {
      const dist_param *p = &d->p[ord[k]];
      if (p->role != DOPT_TP_REPLICATED && p->owner_tp == me) rc[s] += block_numel(d, p, s);
    }
    if (*whole) (void)block_run(d, &d->p[last_recv], s, &rd[s]);
    roff += rc[s];
  }
  *recv = dst;
  return exchange(d, &d->tp, send ? (const void *)send : d->xs, sc, sd, dst, rc, rd);
}

/* 3. the new values over tp: from each owner, every tp rank of its row receives its block of each of the
 * row's parameters ord[0, m) (replicated: the whole tensor), in row order (d->xoff), into *vals: the
 * parameter's fp32 buffer itself when the row steps one tensor that is kept so (values_direct), else a
 * buffer from which every parameter is loaded. */
static dopt_status values_over_tp(dopt_dist_optim *d, const int *ord, int m, float **vals) {
  const int T = d->tp.size, me = d->tp.rank;
  size_t *sc = d->xc, *sd = sc + d->xn, *rc = sd + d->xn, *rd = rc + d->xn;
  int nmine = 0, mine = -1;
  size_t vsum = 0, osum = 0;
  for (int k = 0; k < m; k++) {
    const dist_param *p = &d->p[ord[k]];
    vsum += p->lnumel;
    if (p->owner_tp == me) {
      nmine++, mine = ord[k];
      for (int t = 0; t < T; t++) osum += block_numel(d, p, t);
    }
  }
  const int direct = m == 1 && values_direct(&d->p[ord[0]]);
  float *dst = direct ? d->p[ord[0]].master : NULL;
  if (!direct) {
    DOPT_TRY(dd_grow_dev(d, &d->xr, &d->xr_cap, (vsum ? vsum : 1) * sizeof(float)));
    dst = d->xr;
  }
  /* send: one owned tensor whose blocks are runs, straight from the owner's logical values; else packed */
  const float *send = nmine == 1 && all_runs(d, &d->p[mine]) ? d->p[mine].full : NULL;
  if (!send && osum) DOPT_TRY(dd_grow_dev(d, &d->xs, &d->xs_cap, osum * sizeof(float)));
  size_t off = 0;
  for (int t = 0; t < T; t++) {
    sd[t] = off;
    sc[t] = 0;
    for (int k = 0; k < m; k++) {
      dist_param *p = &d->p[ord[k]];
      if (p->owner_tp != me) continue;
      size_t bn = block_numel(d, p, t);
      if (send) (void)block_run(d, p, t, &sd[t]);
      else if (p->role == DOPT_TP_REPLICATED) DOPT_TRY(DEV(d)->copy(DCTX(d), (float *)d->xs + off, p->full, bn * sizeof(float)));
      else DOPT_TRY(block_copy(d, p, t, p->full, (float *)d->xs + off, 0));
      off += bn;
      sc[t] += bn;
    }
  }
  size_t roff = 0;
  for (int s = 0; s < T; s++) {
    rd[s] = roff;
    rc[s] = 0;
    for (int k = 0; k < m; k++)
      if (d->p[ord[k]].owner_tp == s) {
        d->xoff[ord[k]] = roff + rc[s];
        rc[s] += d->p[ord[k]].lnumel;
      }
    roff += rc[s];
  }
  *vals = dst;
  const float *src = send ? send : (const float *)d->xs;
  if (T > 1) DOPT_TRY(exchange(d, &d->tp, src, sc, sd, dst, rc, rd));
  else if (vsum) DOPT_TRY(DEV(d)->copy(DCTX(d), dst, src + sd[0], vsum * sizeof(float)));
  if (direct) return DOPT_OK;
  for (int k = 0; k < m; k++) DOPT_TRY(load_from(d, &d->p[ord[k]], dst + d->xoff[ord[k]], 0));
  return DOPT_OK;
}

/* Steps the owned parameters list[0, n) (ascending index, none skipped):
 * gradients to their owners, the owners' steps, the new values back. */
static dopt_status owner_batch(dopt_dist_optim *d, const int *list, int n) {
  const int T = d->tp.size, D = d->dp.size, me = d->tp.rank, row = d->dp.rank;
  size_t *sc = d->xc, *sd = sc + d->xn, *rc = sd + d->xn, *rd = rc + d->xn, *gpos = rd + d->xn;
  int *ord = d->xord, m = 0;
  row_order(d, list, n, row, ord, &m); /* my row's parameters */
  for (int k = 0; k < n; k++) d->p[list[k]].step++;
  float *vals = NULL;
  if (m > 0) {
    const float *recv = NULL;
    int whole = 0;
    DOPT_TRY(grads_to_owners(d, ord, m, &recv, &whole));
    /* 2. the owners' steps: the whole gradient assembled from the blocks (by source, then parameter) */
    for (int s = 0; s < T; s++) gpos[s] = recv && !whole ? rd[s] : 0;
    for (int k = 0; k < m; k++) {
      dist_param *p = &d->p[ord[k]];
      if (p->owner_tp != me) continue;
      const float *g = p->grad; /* replicated (or tp 1): the block is the whole gradient */
      if (T > 1 && p->role != DOPT_TP_REPLICATED && whole) g = recv;
      else if (T > 1 && p->role != DOPT_TP_REPLICATED) {
        DOPT_TRY(dd_grow_dev(d, (void **)&d->xfer, &d->xfer_cap, dopt_numel(p->ndim, p->shape) * sizeof(float)));
        for (int s = 0; s < T; s++) {
          DOPT_TRY(block_copy(d, p, s, d->xfer, (float *)(uintptr_t)recv + gpos[s], 1));
          gpos[s] += block_numel(d, p, s);
        }
        g = d->xfer;
      }
      DOPT_TRY(step_whole(d, ord[k], g));
    }
    DOPT_TRY(values_over_tp(d, ord, m, &vals));
  }
  if (D == 1) return DOPT_OK;

  /* 4. over dp, in every tp column: the owner rows' blocks to the other rows, in one exchange (every row sends
   * what it stepped to every other row) */
  if (d->zero < 3) { /* every dp rank keeps the whole TP block */
    size_t cnt = 0, rtot = 0;
    for (int k = 0; k < m; k++) cnt += d->p[ord[k]].lnumel;
    for (int q = 0; q < D; q++) sd[q] = 0, sc[q] = q == row ? 0 : cnt; /* the same region to every other row */
    for (int o = 0; o < D; o++) {
      int mo = 0;
      rd[o] = rtot, rc[o] = 0;
      if (o == row) continue;
      row_order(d, list, n, o, ord, &mo);
      for (int k = 0; k < mo; k++) d->xoff[ord[k]] = rtot + rc[o], rc[o] += d->p[ord[k]].lnumel;
      rtot += rc[o];
    }
    void *rbuf = NULL;
    DOPT_TRY(dd_gdev(d, 0, (rtot ? rtot : 1) * sizeof(float), &rbuf));
    DOPT_TRY(exchange(d, &d->dp, cnt ? (const void *)vals : rbuf, sc, sd, rbuf, rc, rd));
    for (int o = 0; o < D; o++) {
      int mo = 0;
      if (o == row) continue; /* loaded in step 3 */
      row_order(d, list, n, o, ord, &mo);
      for (int k = 0; k < mo; k++) DOPT_TRY(load_from(d, &d->p[ord[k]], (const float *)rbuf + d->xoff[ord[k]], 0));
    }
    return DOPT_OK;
  }
  /* zero 3: each dp rank q of the column receives only its shard [q·chunk, +len) of each block */
  size_t spos = 0;
  row_order(d, list, n, row, ord, &m);
  for (int k = 0; k < m; k++) spos += d->p[ord[k]].padded - d->p[ord[k]].chunk; /* what leaves this row */
  DOPT_TRY(dd_grow_dev(d, &d->xs, &d->xs_cap, (spos ? spos : 1) * sizeof(float)));
  size_t off = 0;
  for (int q = 0; q < D; q++) {
    sd[q] = off;
    sc[q] = 0;
    if (q == row) continue;
    for (int k = 0; k < m; k++) {
      const dist_param *p = &d->p[ord[k]];
      size_t lo = (size_t)q * p->chunk, len = lo < p->lnumel ? (p->lnumel - lo < p->chunk ? p->lnumel - lo : p->chunk) : 0;
      if (len)
        DOPT_TRY(DEV(d)->copy(DCTX(d), (float *)d->xs + off, vals + d->xoff[ord[k]] + lo, len * sizeof(float)));
      off += len;
      sc[q] += len;
    }
  }
  size_t rtot = 0;
  for (int o = 0; o < D; o++) {
    int mo = 0;
    rd[o] = rtot;
    rc[o] = 0;
    if (o == row) continue;
    row_order(d, list, n, o, ord, &mo);
    for (int k = 0; k < mo; k++) {
      d->xoff[ord[k]] = rtot + rc[o];
      rc[o] += d->p[ord[k]].pc.len;
    }
    rtot += rc[o];
  }
  void *rbuf = NULL;
  DOPT_TRY(dd_gdev(d, 0, (rtot ? rtot : 1) * sizeof(float), &rbuf));
  DOPT_TRY(exchange(d, &d->dp, d->xs, sc, sd, rbuf, rc, rd));
  for (int o = 0; o < D; o++) {
    int mo = 0;
    if (o == row) continue;
    row_order(d, list, n, o, ord, &mo);
    for (int k = 0; k < mo; k++) {
      dist_param *p = &d->p[ord[k]];
      DOPT_TRY(load_from(d, p, (const float *)rbuf + d->xoff[ord[k]], p->pc.lo));
    }
  }
  return DOPT_OK;
}

/* The owned parameters stepped this step, in batches of at most the bucket
 * budget of logical bytes (each parameter at least alone; 0: one batch). */
dopt_status dd_owner_steps(dopt_dist_optim *d) {
  int n = 0;
  size_t bytes = 0;
  for (int i = 0; i < d->np; i++) {
    const dist_param *p = &d->p[i];
    if (!p->owned || d->skip[i]) continue;
    size_t b = dopt_numel(p->ndim, p->shape) * sizeof(float);
    if (n > 0 && d->bucket_bytes && bytes + b > d->bucket_bytes) {
      DOPT_TRY(owner_batch(d, d->xlist, n));
      n = 0;
      bytes = 0;
    }
    d->xlist[n++] = i;
    bytes += b;
  }
  return n ? owner_batch(d, d->xlist, n) : DOPT_OK;
}
