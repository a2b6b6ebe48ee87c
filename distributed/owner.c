/* Owner mode (docs/distributed.md#owner-mode): a parameter whose step needs
 * the whole tensor (GaLore's SVD; Muon's Newton-Schulz; dopt__impl_whole)
 * steps with the reference's own step on an owner rank. A tensor of one unit
 * belongs whole to (dp rank p->owner, tp rank p->owner_tp); a tensor of
 * several units (dopt__impl_units: an expert stack [E, out, in] whose experts
 * step independently) has its units spread over owners, each owning a run of
 * whole units ("owner units", dd_units). Its data moves as little as the
 * step allows:
 *   gradient  the exact dp sum brings each dp row the part of the TP block
 *             whose units that row's ranks own (dp_sum.c: its segment) and
 *             averages it there; each tp rank of the row sends every owner of
 *             the row its block's part of that owner's units (one all_to_allv
 *             over tp per batch);
 *   values    each owner sends each tp rank of its row that rank's block of
 *             its new units (all_to_allv over tp), and each row sends every
 *             dp rank what it keeps of the row's units: all of them up to
 *             zero 2, its ZeRO shard's share with zero 3 (one all_to_allv
 *             over dp per batch).
 * Many owners share each exchange: the owned parameters stepped this step
 * are cut into batches of at most the bucket budget (logical bytes, the same
 * cut on every rank); what a row's ranks receive is laid out by source (the
 * owner's tp rank), then by parameter index, so that what one rank sends
 * another is one contiguous region and every rank of a tp column knows
 * every row's layout. A transport without reduce or all_to_allv gets an
 * all-reduce (dp_sum.c) and one broadcast per region (exchange, below).
 * Bitwise the reference by construction: the same step on the same whole
 * tensors, or on the same whole units. */
#include <stdlib.h>
#include <string.h>

#include "dist_internal.h"

/* ---- helpers ---------------------------------------------------------------------------- */

/* Elements of TP rank r's block of p (the whole tensor when replicated). */
static size_t block_numel(const dopt_dist_optim *d, const dist_param *p, int r) {
  size_t h0, hl, w0, wl;
  dd_tp_block(p, d->tp.size, r, &h0, &hl, &w0, &wl);
  return p->pc.b * hl * wl;
}

/* Elements of one unit: in TP rank r's block, and in the logical tensor. */
static size_t bunit(const dopt_dist_optim *d, const dist_param *p, int r) {
  return block_numel(d, p, r) / (size_t)p->nunits;
}
static size_t lunit(const dist_param *p) { return dopt_numel(p->ndim, p->shape) / (size_t)p->nunits; }

/* Copies TP rank r's block of units [u0, u1) between the logical units
 * sub[(u1 - u0) · lunit] and their packed block blk[(u1 - u0) · bunit]
 * (device memory both): to_full != 0 writes the block into sub. Rows of the
 * [b, h, w] view (a unit is b / nunits of its leading indices); whole rows
 * in one run. */
static dopt_status block_copy(dopt_dist_optim *d, const dist_param *p, int r, size_t u0, size_t u1, float *sub,
                              float *blk, int to_full) {
  size_t h0, hl, w0, wl;
  dd_tp_block(p, d->tp.size, r, &h0, &hl, &w0, &wl);
  const dopt_piece *pc = &p->pc;
  const size_t nb = (u1 - u0) * (pc->b / (size_t)p->nunits);
  const size_t run = wl == pc->w ? hl * wl : wl, nrun = wl == pc->w ? 1 : hl;
  if (run == 0) return DOPT_OK;
  for (size_t bi = 0; bi < nb; bi++)
    for (size_t i = 0; i < nrun; i++) {
      float *f = sub + (bi * pc->h + h0 + i) * pc->w + w0, *b = blk + (bi * hl + i) * wl;
      DOPT_TRY(DEV(d)->copy(DCTX(d), to_full ? f : b, to_full ? b : f, run * sizeof(float)));
    }
  return DOPT_OK;
}

/* This rank's values of p from x (device), which holds elements [lo, lo + len) of its TP block: the part of
 * the fp32 extent it keeps (the master shard, or the whole block) and of its bf16 working copy that falls
 * in that range. */
static dopt_status load_range(dopt_dist_optim *d, dist_param *p, const float *x, size_t lo, size_t len) {
  const dopt_piece *pc = &p->pc;
  const size_t hi = lo + len;
  size_t from = p->master_sharded ? pc->lo : 0, count = p->master_sharded ? pc->len : p->lnumel;
  size_t a = from > lo ? from : lo, b = from + count < hi ? from + count : hi;
  if (a < b) DOPT_TRY(DEV(d)->copy(DCTX(d), p->master + (a - from), x + (a - lo), (b - a) * sizeof(float)));
  if (!p->bf16) return DOPT_OK;
  from = d->zero == 3 ? pc->lo : 0, count = d->zero == 3 ? pc->len : p->lnumel;
  a = from > lo ? from : lo, b = from + count < hi ? from + count : hi;
  return a < b ? DEV(d)->to_bf16(DCTX(d), x + (a - lo), p->work + (a - from), b - a) : DOPT_OK;
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

/* The owned parameters of batch list[0, n) (ascending index) with units in dp row `row`: out[0, *m). */
static void row_params(const dopt_dist_optim *d, const int *list, int n, int row, int *out, int *m) {
  *m = 0;
  for (int k = 0; k < n; k++) {
    size_t u0, u1;
    dd_row_units(d, &d->p[list[k]], row, &u0, &u1);
    if (u1 > u0) out[(*m)++] = list[k];
  }
}

/* Whether TP block r's part of units [u0, u1) is one run of those units' logical elements (rows split with
 * one leading index, a 1-D split, replicated); then it starts at *off within them. */
static int block_run(const dopt_dist_optim *d, const dist_param *p, int r, size_t u0, size_t u1, size_t *off) {
  size_t h0, hl, w0, wl;
  dd_tp_block(p, d->tp.size, r, &h0, &hl, &w0, &wl);
  const dopt_piece *pc = &p->pc;
  const size_t nb = (u1 - u0) * (pc->b / (size_t)p->nunits);
  *off = h0 * pc->w + w0;
  return (nb == 1 && (hl <= 1 || wl == pc->w)) || (hl == pc->h && wl == pc->w);
}

static int all_runs(const dopt_dist_optim *d, const dist_param *p, size_t u0, size_t u1) {
  size_t off;
  for (int r = 0; r < d->tp.size; r++)
    if (!block_run(d, p, r, u0, u1, &off)) return 0;
  return 1;
}

/* The new values of p can be received straight into its fp32 parameter: the
 * rank keeps the whole TP block in fp32, nothing else. */
static int values_direct(const dist_param *p) { return !p->bf16 && !p->master_sharded; }

/* The owner's step of parameter i on its units' gradient g (device [(u1 - u0) · lunit]). */
static dopt_status step_units(dopt_dist_optim *d, int i, const float *g) {
  dist_param *p = &d->p[i];
  dopt_piece piece;
  dopt_piece_full(p->ndim, p->shape, &piece);
  piece.lo = p->u0 * lunit(p), piece.len = (p->u1 - p->u0) * lunit(p); /* one unit: the whole tensor */
  p->cnt_last[DOPT_COUNTER_STEPS] = 1;
  dopt_step_args a = {.impl = d->impl,
                      .hp = d->hp[p->group],
                      .step = p->step,
                      .piece = &piece,
                      .param = p->full,
                      .grad = g,
                      .state = p->state,
                      .counts = p->cnt_last,
                      .tensor = (uint64_t)i,
                      .ndim = p->ndim,
                      .shape = p->shape};
  DOPT_TRY(dd_grow_dev(d, &d->frames, &d->frames_cap, DEV(d)->frame_bytes(DCTX(d), &a)));
  a.frame = d->frames;
  return dopt__run_stages(d->dev, &a);
}

/* 1. my row's averaged gradients (row: this rank's rank in the batch's data-parallel group, dp or moe_dp;
 * dp_sum.c left this row's units of each TP block here) to their owners over tp: each tp rank sends owner t its block's part of t's units of each parameter ord[0, m); *recv: where this
 * rank, as an owner, received them (by source, then parameter), or its units' logical gradient itself (*whole)
 * when it owns units of one tensor whose blocks are runs of them. A replicated tensor needs nothing: every
 * rank's block is the whole gradient. */
static dopt_status grads_to_owners(dopt_dist_optim *d, int row, const int *ord, int m, const float **recv,
                                   int *whole) {
  const int T = d->tp.size, me = d->tp.rank, base = row * T;
  size_t *sc = d->xc, *sd = sc + d->xn, *rc = sd + d->xn, *rd = rc + d->xn;
  int nsend = 0, nrecv = 0, last_send = -1, last_recv = -1;
  size_t ssum = 0, rsum = 0, u0, u1;
  for (int k = 0; k < m; k++) {
    const dist_param *p = &d->p[ord[k]];
    if (p->role == DOPT_TP_REPLICATED) continue;
    dd_row_units(d, p, row, &u0, &u1);
    nsend++, last_send = ord[k], ssum += (u1 - u0) * bunit(d, p, me);
    if (p->u1 > p->u0) nrecv++, last_recv = ord[k], rsum += (p->u1 - p->u0) * lunit(p);
  }
  *recv = NULL;
  *whole = 0;
  if (T == 1 || nsend == 0) return DOPT_OK; /* the same answer on every rank of the row */
  /* send: one tensor's units straight from its accumulator (each owner's run is contiguous), else packed by
   * destination */
  const float *send = nsend == 1 ? d->p[last_send].grad : NULL;
  if (!send) DOPT_TRY(dd_grow_dev(d, &d->xs, &d->xs_cap, (ssum ? ssum : 1) * sizeof(float)));
  size_t off = 0;
  for (int t = 0; t < T; t++) {
    sd[t] = off;
    sc[t] = rc[t] = 0;
    for (int k = 0; k < m; k++) {
      dist_param *p = &d->p[ord[k]];
      if (p->role == DOPT_TP_REPLICATED) continue;
      dd_units(d, p, base + t, &u0, &u1);
      const size_t bu = bunit(d, p, me), cnt = (u1 - u0) * bu;
      if (send) sd[t] = u0 * bu;
      else if (cnt) DOPT_TRY(DEV(d)->copy(DCTX(d), (float *)d->xs + off, p->grad + u0 * bu, cnt * sizeof(float)));
      off += cnt;
      sc[t] += cnt;
    }
  }
  /* receive: the units of one tensor whose blocks are runs, straight into their logical gradient; else by
   * source */
  float *dst = NULL;
  if (nrecv == 1 && all_runs(d, &d->p[last_recv], d->p[last_recv].u0, d->p[last_recv].u1)) {
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
      if (p->role != DOPT_TP_REPLICATED) rc[s] += (p->u1 - p->u0) * bunit(d, p, s);
    }
    if (*whole) (void)block_run(d, &d->p[last_recv], s, d->p[last_recv].u0, d->p[last_recv].u1, &rd[s]);
    roff += rc[s];
  }
  *recv = dst;
  return exchange(d, &d->tp, send ? (const void *)send : d->xs, sc, sd, dst, rc, rd);
}

/* What a rank of tp column `col` in dp row `row` receives of the row's new values, in the exchange's order (by
 * source, then parameter ord[0, m)): piece j is parameter *i's TP-block elements [*lo, *lo + *len), at *at in
 * the row's buffer. Returns 0 after the last piece. Every rank of the column computes the same pieces for any
 * row. */
typedef struct piece_it {
  int s, k;
  size_t at;
} piece_it;
static int next_piece(const dopt_dist_optim *d, const int *ord, int m, int row, int col, piece_it *it, int *i,
                      size_t *lo, size_t *len, size_t *at) {
  const int T = d->tp.size;
  for (; it->s < T; it->s++, it->k = 0)
    while (it->k < m) {
      const dist_param *p = &d->p[ord[it->k++]];
      size_t u0, u1;
      dd_units(d, p, row * T + it->s, &u0, &u1);
      if (u1 == u0) continue;
      const size_t bu = bunit(d, p, col);
      *i = (int)(p - d->p), *lo = u0 * bu, *len = (u1 - u0) * bu, *at = it->at;
      it->at += *len;
      return 1;
    }
  return 0;
}

/* 3. the new values over tp: from each owner, every tp rank of its row receives its block of the owner's units
 * of each of the row's parameters ord[0, m) (replicated: the units themselves), into *vals in the order of
 * next_piece: the parameter's fp32 buffer itself when the row steps one tensor that is kept so
 * (values_direct), else a buffer from which every parameter is loaded. *vsum: the elements of *vals. */
static dopt_status values_over_tp(dopt_dist_optim *d, int row, const int *ord, int m, float **vals, size_t *vsum) {
  const int T = d->tp.size, me = d->tp.rank;
  size_t *sc = d->xc, *sd = sc + d->xn, *rc = sd + d->xn, *rd = rc + d->xn;
  int nmine = 0, mine = -1, i;
  size_t osum = 0, ru0, ru1, lo, len, at;
  *vsum = 0;
  for (int k = 0; k < m; k++) {
    const dist_param *p = &d->p[ord[k]];
    dd_row_units(d, p, row, &ru0, &ru1);
    *vsum += (ru1 - ru0) * bunit(d, p, me);
    if (p->u1 > p->u0) {
      nmine++, mine = ord[k];
      for (int t = 0; t < T; t++) osum += (p->u1 - p->u0) * bunit(d, p, t);
    }
  }
  const int direct = m == 1 && values_direct(&d->p[ord[0]]);
  float *dst = NULL;
  if (direct) {
    dd_row_units(d, &d->p[ord[0]], row, &ru0, &ru1);
    dst = d->p[ord[0]].master + ru0 * bunit(d, &d->p[ord[0]], me); /* the row's units of the block, in place */
  } else {
    DOPT_TRY(dd_grow_dev(d, &d->xr, &d->xr_cap, (*vsum ? *vsum : 1) * sizeof(float)));
    dst = d->xr;
  }
  /* send: the units of one owned tensor whose blocks are runs, straight from the owner's values; else packed */
  const float *send = nmine == 1 && all_runs(d, &d->p[mine], d->p[mine].u0, d->p[mine].u1) ? d->p[mine].full : NULL;
  if (!send && osum) DOPT_TRY(dd_grow_dev(d, &d->xs, &d->xs_cap, osum * sizeof(float)));
  size_t off = 0;
  for (int t = 0; t < T; t++) {
    sd[t] = off;
    sc[t] = 0;
    for (int k = 0; k < m; k++) {
      dist_param *p = &d->p[ord[k]];
      if (p->u1 == p->u0) continue;
      const size_t bn = (p->u1 - p->u0) * bunit(d, p, t);
      if (send) (void)block_run(d, p, t, p->u0, p->u1, &sd[t]);
      else if (p->role == DOPT_TP_REPLICATED) DOPT_TRY(DEV(d)->copy(DCTX(d), (float *)d->xs + off, p->full, bn * sizeof(float)));
      else DOPT_TRY(block_copy(d, p, t, p->u0, p->u1, p->full, (float *)d->xs + off, 0));
      off += bn;
      sc[t] += bn;
    }
  }
  for (int s = 0; s < T; s++) rc[s] = rd[s] = 0;
  piece_it it = {0, 0, 0};
  while (next_piece(d, ord, m, row, me, &it, &i, &lo, &len, &at)) { /* by source: each one's pieces in a run */
    if (rc[it.s] == 0) rd[it.s] = at;
    rc[it.s] += len;
  }
  *vals = dst;
  const float *src = send ? send : (const float *)d->xs;
  if (T > 1) DOPT_TRY(exchange(d, &d->tp, src, sc, sd, dst, rc, rd));
  else if (*vsum) DOPT_TRY(DEV(d)->copy(DCTX(d), dst, src + sd[0], *vsum * sizeof(float)));
  if (direct) return DOPT_OK;
  it = (piece_it){0, 0, 0};
  while (next_piece(d, ord, m, row, me, &it, &i, &lo, &len, &at)) DOPT_TRY(load_range(d, &d->p[i], dst + at, lo, len));
  return DOPT_OK;
}

/* The part [*a, *b) of TP-block elements [lo, lo + len) of p in dp rank q's ZeRO shard (empty: *a >= *b). */
static void shard_cut(const dopt_dist_optim *d, const dist_param *p, size_t q, size_t lo, size_t len, size_t *a,
                      size_t *b) {
  size_t s0, sl;
  dd_shard(d, p, d->tp.rank, q, &s0, &sl);
  const size_t s1 = s0 + sl;
  *a = lo > s0 ? lo : s0, *b = lo + len < s1 ? lo + len : s1;
}

/* Steps the owned parameters list[0, n) (ascending index, none skipped, all of one data-parallel group G: dp,
 * or the experts' moe_dp): gradients to their owners, the owners' steps, the new values back. */
static dopt_status owner_batch(dopt_dist_optim *d, const int *list, int n) {
  const dopt_transport *G = dd_dpg(d, &d->p[list[0]]);
  const int T = d->tp.size, D = G->size, me = d->tp.rank, row = G->rank;
  size_t *sc = d->xc, *sd = sc + d->xn, *rc = sd + d->xn, *rd = rc + d->xn, *gpos = rd + d->xn;
  int *ord = d->xord, m = 0, i;
  row_params(d, list, n, row, ord, &m); /* my row's parameters */
  for (int k = 0; k < n; k++) d->p[list[k]].step++;
  float *vals = NULL;
  size_t vsum = 0, lo, len, at;
  if (m > 0) {
    const float *recv = NULL;
    int whole = 0;
    DOPT_TRY(grads_to_owners(d, row, ord, m, &recv, &whole));
    /* 2. the owners' steps: their units' gradient assembled from the blocks (by source, then parameter) */
    for (int s = 0; s < T; s++) gpos[s] = recv && !whole ? rd[s] : 0;
    for (int k = 0; k < m; k++) {
      dist_param *p = &d->p[ord[k]];
      if (p->u1 == p->u0) continue;
      const float *g = p->grad + p->u0 * lunit(p); /* replicated (or tp 1): the block is the whole gradient */
      if (T > 1 && p->role != DOPT_TP_REPLICATED && whole) g = recv;
      else if (T > 1 && p->role != DOPT_TP_REPLICATED) {
        DOPT_TRY(dd_grow_dev(d, (void **)&d->xfer, &d->xfer_cap, (p->u1 - p->u0) * lunit(p) * sizeof(float)));
        for (int s = 0; s < T; s++) {
          DOPT_TRY(block_copy(d, p, s, p->u0, p->u1, d->xfer, (float *)(uintptr_t)recv + gpos[s], 1));
          gpos[s] += (p->u1 - p->u0) * bunit(d, p, s);
        }
        g = d->xfer;
      }
      DOPT_TRY(step_units(d, ord[k], g));
    }
    DOPT_TRY(values_over_tp(d, row, ord, m, &vals, &vsum));
  }
  if (D == 1) return DOPT_OK;

  /* 4. over dp, in every tp column: each row's pieces to the other rows, in one exchange (every row sends what
   * it stepped to every other row; a row's pieces are in next_piece's order, which every rank can compute) */
  piece_it it;
  if (d->zero < 3) { /* every dp rank keeps the whole TP block */
    size_t rtot = 0;
    for (int q = 0; q < D; q++) sd[q] = 0, sc[q] = q == row ? 0 : vsum; /* the same region to every other row */
    for (int o = 0; o < D; o++) {
      int mo = 0;
      rd[o] = rtot, rc[o] = 0;
      if (o == row) continue;
      row_params(d, list, n, o, ord, &mo);
      it = (piece_it){0, 0, 0};
      while (next_piece(d, ord, mo, o, me, &it, &i, &lo, &len, &at)) rc[o] += len;
      rtot += rc[o];
    }
    void *rbuf = NULL;
    DOPT_TRY(dd_gdev(d, 0, (rtot ? rtot : 1) * sizeof(float), &rbuf));
    /* send and receive never overlap (MPI forbids it even with nothing to send; Open MPI's non-blocking
     * all_to_allv mishandles it): a row that stepped nothing sends from its own scratch */
    const void *sbuf = vals;
    if (!vsum) {
      DOPT_TRY(dd_grow_dev(d, &d->xs, &d->xs_cap, sizeof(float)));
      sbuf = d->xs;
    }
    DOPT_TRY(exchange(d, G, sbuf, sc, sd, rbuf, rc, rd));
    for (int o = 0; o < D; o++) {
      int mo = 0;
      if (o == row) continue; /* loaded in step 3 */
      row_params(d, list, n, o, ord, &mo);
      it = (piece_it){0, 0, 0};
      while (next_piece(d, ord, mo, o, me, &it, &i, &lo, &len, &at))
        DOPT_TRY(load_range(d, &d->p[i], (const float *)rbuf + rd[o] + at, lo, len));
    }
    return DOPT_OK;
  }
  /* zero 3: each dp rank q of the column receives only the share of each piece in its shard (dd_shard) */
  row_params(d, list, n, row, ord, &m);
  size_t spos = 0;
  for (int q = 0; q < D; q++) {
    if (q == row) continue;
    it = (piece_it){0, 0, 0};
    while (next_piece(d, ord, m, row, me, &it, &i, &lo, &len, &at)) {
      size_t a, b;
      shard_cut(d, &d->p[i], (size_t)q, lo, len, &a, &b);
      spos += a < b ? b - a : 0;
    }
  }
  DOPT_TRY(dd_grow_dev(d, &d->xs, &d->xs_cap, (spos ? spos : 1) * sizeof(float)));
  size_t off = 0;
  for (int q = 0; q < D; q++) {
    sd[q] = off;
    sc[q] = 0;
    if (q == row) continue;
    it = (piece_it){0, 0, 0};
    while (next_piece(d, ord, m, row, me, &it, &i, &lo, &len, &at)) {
      size_t a, b;
      shard_cut(d, &d->p[i], (size_t)q, lo, len, &a, &b);
      if (a >= b) continue;
      DOPT_TRY(DEV(d)->copy(DCTX(d), (float *)d->xs + off, vals + at + (a - lo), (b - a) * sizeof(float)));
      off += b - a;
      sc[q] += b - a;
    }
  }
  size_t rtot = 0;
  for (int o = 0; o < D; o++) {
    int mo = 0;
    rd[o] = rtot;
    rc[o] = 0;
    if (o == row) continue;
    row_params(d, list, n, o, ord, &mo);
    it = (piece_it){0, 0, 0};
    while (next_piece(d, ord, mo, o, me, &it, &i, &lo, &len, &at)) {
      size_t a, b;
      shard_cut(d, &d->p[i], (size_t)row, lo, len, &a, &b);
      rc[o] += a < b ? b - a : 0;
    }
    rtot += rc[o];
  }
  void *rbuf = NULL;
  DOPT_TRY(dd_gdev(d, 0, (rtot ? rtot : 1) * sizeof(float), &rbuf));
  DOPT_TRY(exchange(d, G, d->xs, sc, sd, rbuf, rc, rd));
  for (int o = 0; o < D; o++) {
    int mo = 0;
    if (o == row) continue;
    row_params(d, list, n, o, ord, &mo);
    it = (piece_it){0, 0, 0};
    size_t got = rd[o];
    while (next_piece(d, ord, mo, o, me, &it, &i, &lo, &len, &at)) {
      size_t a, b;
      shard_cut(d, &d->p[i], (size_t)row, lo, len, &a, &b);
      if (a >= b) continue;
      DOPT_TRY(load_range(d, &d->p[i], (const float *)rbuf + got, a, b - a));
      got += b - a;
    }
  }
  return DOPT_OK;
}

/* The owned parameters stepped this step, in batches of at most the bucket
 * budget of logical bytes (each parameter at least alone; 0: one batch): the
 * dense ones (over dp), then the experts (over moe_dp; an ep rank owns only
 * its own experts, so these batches differ between ep ranks but not within
 * a moe_dp group). */
dopt_status dd_owner_steps(dopt_dist_optim *d) {
  for (int experts = 0; experts < 2; experts++) {
    int n = 0;
    size_t bytes = 0;
    for (int i = 0; i < d->np; i++) {
      const dist_param *p = &d->p[i];
      if (!p->owned || d->skip[i] || (p->expert >= 0) != experts) continue;
      size_t b = dopt_numel(p->ndim, p->shape) * sizeof(float);
      if (n > 0 && d->bucket_bytes && bytes + b > d->bucket_bytes) {
        DOPT_TRY(owner_batch(d, d->xlist, n));
        n = 0;
        bytes = 0;
      }
      d->xlist[n++] = i;
      bytes += b;
    }
    if (n) DOPT_TRY(owner_batch(d, d->xlist, n));
  }
  return DOPT_OK;
}
