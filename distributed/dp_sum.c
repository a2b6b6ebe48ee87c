/* The data-parallel gradient sum (docs/dp-sum.md): exact — the logical
 * blocks' codes in one MAX over the world, the fixed-point words in one
 * integer SUM over dp, decoded into each rank's piece — or fp32 in the
 * transport's order. Owner mode: each dp row sums the units its ranks own. */
#include "dist_internal.h"

/* SUM over dp of x[padded·per] (all-reduce for zero 0/1; reduce-scatter for
 * zero 2/3, in place: this rank's block of the padded buffer); owner mode:
 * x[lnumel·per] reduced to the owner's dp row (all-reduce with a transport
 * that has no reduce). */
dopt_status dd_dp_sum(dopt_dist_optim *d, const dist_param *p, void *x, size_t per, dopt_dtype dt) {
  const dopt_transport *g = dd_dpg(d, p); /* dp, or an expert's moe_dp */
  if (p->owned) /* one unit: reduced to its owner's row; units over several rows: all-reduced */
    return g->ops->reduce && !p->ub ? g->ops->reduce(g->comm, x, x, p->lnumel * per, dt, DOPT_SUM, p->owner)
                                    : g->ops->all_reduce(g->comm, x, x, p->lnumel * per, dt, DOPT_SUM);
  if (d->zero >= 2)
    return g->ops->reduce_scatter(g->comm, x, (char *)x + (size_t)g->rank * p->chunk * per * dopt_dtype_size(dt),
                                  p->chunk * per, dt, DOPT_SUM);
  return g->ops->all_reduce(g->comm, x, x, p->padded * per, dt, DOPT_SUM);
}

/* ---- the exact sum in buckets (a transport with all_to_allv, dp > 1) ---------------------------------------
 * Per bucket of consecutive parameters (their logical bytes / tp fit d->bucket_bytes, the same cut on every
 * rank): one all_to_allv over dp brings every dp rank's fp32 parts of the elements this rank sums (its
 * segment; owner mode: the whole TP block to the owner's row), the codes are taken over those parts, one MAX
 * over the world completes the bucket's codes and flags, and each part is encoded, added and decoded a few
 * thousand elements at a time in cache, as dopt_dp_sum does; at zero 0 one all_gather gives every rank the
 * whole TP blocks again. The parts are one accumulated gradient per rank, or (batch invariant) its micro-batch
 * gradients, every rank d->micro of them (a micro-batch without a gradient: zeros). Collectives per bucket:
 * 1 all_to_allv + 1 MAX per transport (+ 1 all_gather at zero 0), whatever the number of parameters. A bucket
 * holds dense or expert parameters (dd_bucket_end), and moves over their data-parallel group G (dp, or moe_dp:
 * an ep rank's experts, the others' an empty block here); the codes' MAX is over the whole dp either way (each
 * expert's from its own ranks, zeros elsewhere). */

/* A piecewise parameter's segment size at zero 0 (bucket_regather): S = ceil(lnumel / G); rank q of its group
 * sums [q·S, q·S + len) of the TP block. */
static size_t seg_size(const dopt_dist_optim *d, const dist_param *p) {
  const size_t D = (size_t)dd_dpg(d, p)->size;
  return (p->lnumel + D - 1) / D;
}

/* The elements of p's TP block that dp rank q sums: its ZeRO range (dd_shard; Gemini: its part of the chunk's
 * shard); owner mode: the units of its row's owners (one unit: the whole block on the owner's row). */
static void seg_of(const dopt_dist_optim *d, const dist_param *p, size_t q, size_t *lo, size_t *len) {
  if (p->owned) {
    size_t u0, u1;
    dd_row_units(d, p, (int)q, &u0, &u1);
    const size_t bu = p->lnumel / (size_t)p->nunits;
    *lo = u1 > u0 ? u0 * bu : 0;
    *len = (u1 - u0) * bu;
    return;
  }
  dd_shard(d, p, d->tp.rank, q, lo, len); /* zero 0: the same cut (regathered after the sum) */
}

static size_t nparts(const dopt_dist_optim *d) { return d->keep ? (size_t)d->micro : 1; }

/* Local part m of parameter p (device): its accumulated gradient, or its m-th micro-batch (NULL: none). */
static const float *local_part(const dopt_dist_optim *d, const dist_param *p, size_t m) {
  if (!d->keep) return p->grad;
  return m < (size_t)p->nmb ? p->mb + m * p->lnumel : NULL;
}

/* This rank's own part of what it sums is read where it is, in its accumulator (not sent to itself), unless the
 * parts are micro-batches (batch invariant: a missing one is zeros). */
static int self_direct(const dopt_dist_optim *d) { return !d->keep; }

/* Part (q, m) of parameter i's segment [lo, lo + len): this rank's own in its accumulator, the others' in d->parts
 * (or, read in place, in rank q's accumulator: d->views). */
static const float *part_ptr(const dopt_dist_optim *d, int i, size_t q, size_t m, size_t R, size_t lo, size_t len) {
  const dist_param *p = &d->p[i];
  const size_t me = (size_t)dd_dpg(d, p)->rank;
  if (self_direct(d) && q == me) return p->grad + lo;
  if (d->viewing == 2) return (const float *)d->nviews[(size_t)(i - d->view_b0) * (size_t)dd_dpg(d, p)->size + q];
  if (d->viewing) return (const float *)d->views[q] + d->part_at[i] + m * len;
  return d->parts + q * R + d->part_at[i] + m * len;
}

/* A bucket's exchange is read in place where the group's ranks share memory (the transport's all_to_allv_view and
 * a device whose buffers are host memory): the parts stay where their senders put them (a one-parameter bucket: in
 * their accumulators, which nobody writes outside its own segment; else their pack buffers) until the bucket's
 * view_release, and the copy of the dp − 1 parts each rank receives is saved. */
static int can_view(const dopt_dist_optim *d, const dopt_transport *G) {
  return G->ops->all_to_allv_view && G->ops->view_release && DEV(d)->host_chunk;
}

/* The exchange of what d->xc describes, from send: copied into d->parts (D·R floats), or read in place
 * (d->views). */
static dopt_status exchange(dopt_dist_optim *d, const dopt_transport *G, const float *send, size_t DR) {
  size_t *sc = d->xc, *sd = sc + d->xn, *rc = sd + d->xn, *rd = rc + d->xn;
  if (!can_view(d, G)) {
    DOPT_TRY(dd_grow_dev(d, (void **)&d->parts, &d->parts_cap, (DR ? DR : 1) * sizeof(float)));
    return G->ops->all_to_allv(G->comm, send, sc, sd, d->parts, rc, rd, DOPT_F32);
  }
  d->viewing = 1;
  return G->ops->all_to_allv_view(G->comm, send, sc, sd, d->views, rc, DOPT_F32);
}

/* A bucket of several parameters [b0, b1) read where their accumulators lie (all_to_allv_view_n): exchange b,
 * parameter b0 + b, sends each rank q of the group its segment; this rank's parts arrive as d->nviews[b·D + q]
 * (part_ptr). No pack buffer: the bucket's gradients are not copied. */
static dopt_status exchange_n(dopt_dist_optim *d, const dopt_transport *G, int b0, int b1) {
  const size_t D = (size_t)G->size, me = (size_t)G->rank, nb = (size_t)(b1 - b0), n = nb * D;
  DOPT_TRY(dd_grow_views(d, nb, D));
  size_t *sc = d->ncnt, *sd = sc + n, *rc = sd + n, lo, len, mlo, mlen;
  for (size_t b = 0; b < nb; b++) {
    const dist_param *p = &d->p[b0 + (int)b];
    d->nsends[b] = p->grad;
    seg_of(d, p, me, &mlo, &mlen);
    for (size_t q = 0; q < D; q++) {
      seg_of(d, p, q, &lo, &len);
      sc[b * D + q] = q == me ? 0 : len, sd[b * D + q] = lo;
      rc[b * D + q] = q == me ? 0 : mlen;
    }
  }
  d->viewing = 2, d->view_b0 = b0;
  return G->ops->all_to_allv_view_n(G->comm, (int)nb, d->nsends, sc, sd, d->nviews, rc, DOPT_F32);
}

/* The bucket [b0, b1)'s exchange: every other rank's parts of what this rank sums arrive in d->parts, from source
 * q at q·R, parameter i's P parts at d->part_at[i] within it, each `len` long (this rank's own slot unused when
 * its part is read in place); or read in place (can_view), the same layout at d->views[q] — or, for a bucket of
 * several accumulators with all_to_allv_view_n, each parameter's where it lies (exchange_n, d->nviews). */
static dopt_status bucket_exchange(dopt_dist_optim *d, int b0, int b1, size_t *R) {
  const dopt_transport *G = dd_dpg(d, &d->p[b0]);
  const size_t D = (size_t)G->size, P = nparts(d), me = (size_t)G->rank;
  const int self = self_direct(d);
  size_t *sc = d->xc, *sd = sc + d->xn, *rc = sd + d->xn, *rd = rc + d->xn;
  size_t stot = 0, lo, len;
  for (size_t q = 0; q < D; q++) {
    sd[q] = stot, sc[q] = 0;
    for (int i = b0; i < b1 && !(self && q == me); i++) seg_of(d, &d->p[i], q, &lo, &len), sc[q] += P * len;
    stot += sc[q];
  }
  *R = 0;
  for (int i = b0; i < b1; i++) seg_of(d, &d->p[i], me, &lo, &len), d->part_at[i] = *R, *R += P * len;
  for (size_t q = 0; q < D; q++) rc[q] = self && q == me ? 0 : *R, rd[q] = q * *R;
  if (b1 == b0 + 1 && P == 1) { /* one parameter's gradient: each destination's segment sent from where it is */
    const dist_param *p = &d->p[b0];
    for (size_t q = 0; q < D; q++) seg_of(d, p, q, &lo, &len), sd[q] = lo;
    return exchange(d, G, p->grad, D * *R);
  }
  if (self && can_view(d, G) && G->ops->all_to_allv_view_n) return exchange_n(d, G, b0, b1); /* accumulators */
  DOPT_TRY(dd_grow_dev(d, (void **)&d->pack, &d->pack_cap, (stot ? stot : 1) * sizeof(float)));
  for (size_t q = 0; q < D; q++) { /* by destination, then parameter, then part */
    size_t at = sd[q];
    for (int i = b0; i < b1 && sc[q]; i++) {
      const dist_param *p = &d->p[i];
      seg_of(d, p, q, &lo, &len);
      for (size_t m = 0; m < P && len; m++, at += len) {
        const float *src = local_part(d, p, m);
        DOPT_TRY(src ? DEV(d)->copy(DCTX(d), d->pack + at, src + lo, len * sizeof(float))
                     : dd_zero_dev(d, d->pack + at, len * sizeof(float)));
      }
    }
  }
  return exchange(d, G, d->pack, D * *R);
}

/* ---- spans: what can be summed before the codes' MAX -------------------------------------------------------
 * A logical block all of whose elements lie in one run of this rank's segment is held by no other rank (the TP
 * blocks partition the tensor, the segments each TP block), so its code is the MAX over this rank's parts alone:
 * such blocks are summed, decoded (and averaged) at once, while their parts are in cache, and only the rest — the
 * shared blocks at a segment's or a TP row's cut — waits for the MAX. Not where another rank holds the same
 * blocks (a TP-replicated tensor, an expert's moe_dp group), nor on a device without a host_chunk and a grid_sum
 * (a GPU: one pass per kernel there), nor with more than FUSE_MAX_PARTS parts (dp · micro-batches). */
enum { FUSE_MAX_PARTS = 64 }; /* parts of a private chunk: their pointers on the stack (grid_sum) */

static int fusable(const dopt_dist_optim *d, const dist_param *p) {
  if (!DEV(d)->host_chunk || !DEV(d)->grid_sum || dd_dpg(d, p) != &d->dp) return 0;
  if ((size_t)d->dp.size * nparts(d) > FUSE_MAX_PARTS) return 0;
  return d->tp.size == 1 || p->pc.hl != p->pc.h || p->pc.wl != p->pc.w;
}

typedef struct spans {
  dopt_piece g; /* the segment */
  int fuse;     /* 0: the whole segment is one shared span */
  size_t off;   /* dopt_piece_next_run's cursor */
  dopt_run r;   /* the current run, `in` of its elements taken */
  size_t in;
  int have, done;
  size_t no, nn; /* one span of look-ahead (merging) */
  int npriv, ahead;
} spans;

static void spans_init(spans *s, const dist_param *p, int fuse, size_t lo, size_t len) {
  memset(s, 0, sizeof *s);
  s->g = p->pc;
  s->g.lo = lo, s->g.len = len;
  s->fuse = fuse;
}

/* The next span of one run (offsets into the segment): its private blocks [pb, pe), or shared elements. */
static int span_raw(spans *s, size_t *o, size_t *n, int *priv) {
  if (!s->fuse) {
    if (s->done || s->g.len == 0) return 0;
    s->done = 1, *o = 0, *n = s->g.len, *priv = 0;
    return 1;
  }
  if (!s->have || s->in >= s->r.len) {
    if (!dopt_piece_next_run(&s->g, &s->off, &s->r)) return 0;
    s->have = 1, s->in = 0;
  }
  const size_t B = DOPT_GRID_BLOCK, x = s->r.at + s->in, e = s->r.at + s->r.len;
  const size_t pb = (s->r.at + B - 1) / B * B, pe = e == s->g.numel ? e : e / B * B; /* a short last block is whole */
  size_t end;
  if (pb < pe && x >= pb && x < pe) *priv = 1, end = pe;
  else *priv = 0, end = pb < pe && x < pb ? pb : e;
  *o = s->r.off + s->in, *n = end - x;
  s->in += *n;
  return 1;
}

/* The next span, adjacent spans of a kind merged (the piece kernels take any range of the segment). */
static int span_next(spans *s, size_t *o, size_t *n, int *priv) {
  if (!s->ahead && !span_raw(s, &s->no, &s->nn, &s->npriv)) return 0;
  *o = s->no, *n = s->nn, *priv = s->npriv, s->ahead = 0;
  while (span_raw(s, &s->no, &s->nn, &s->npriv)) {
    if (s->npriv != *priv || s->no != *o + *n) {
      s->ahead = 1;
      break;
    }
    *n += s->nn;
  }
  return 1;
}

/* Elements [o, o + n) of parameter i's segment [lo, lo + len) summed into p->grad (and divided by `denom` there when
 * not 0: the average, fused), the device's host_chunk elements at a time (whole blocks; the parts and the words
 * stay in cache), in one pass on a GPU. priv: whole private blocks, through the device's grid_sum (dopt_dp_sum's
 * code: each block's code and classes from its own parts); shared blocks: the words on the codes after the MAX and
 * the parameter's world flag. */
static dopt_status sum_span(dopt_dist_optim *d, int i, size_t R, int W, int k, size_t lo, size_t len, size_t o,
                            size_t n, int priv, float denom) {
  dist_param *p = &d->p[i];
  const size_t D = (size_t)dd_dpg(d, p)->size, P = nparts(d);
  const size_t B = DOPT_GRID_BLOCK, c = DEV(d)->host_chunk, sub = c ? (c + B - 1) / B * B : (n ? n : 1);
  const int flagged = d->hflags[i] != 0;
  const int32_t *codes = d->codes + d->code_off[i];
  if (!priv) DOPT_TRY(dd_grow_dev(d, (void **)&d->words, &d->words_cap, sub * (size_t)W * sizeof(int64_t)));
  if (!priv && flagged) DOPT_TRY(dd_grow_dev(d, (void **)&d->cls, &d->cls_cap, sub * sizeof(int64_t)));
  for (size_t s0 = 0; s0 < n; s0 += sub) {
    dopt_piece sp = p->pc;
    sp.lo = lo + o + s0, sp.len = n - s0 < sub ? n - s0 : sub;
    if (priv) { /* fusable: D · P ≤ FUSE_MAX_PARTS */
      const float *pp[FUSE_MAX_PARTS];
      for (size_t q = 0; q < D; q++)
        for (size_t m = 0; m < P; m++) pp[q * P + m] = part_ptr(d, i, q, m, R, lo, len) + o + s0;
      DOPT_TRY(DEV(d)->grid_sum(DCTX(d), pp, (int)(D * P), W, sp.len, p->grad + sp.lo));
    } else {
      int first = 1;
      for (size_t q = 0; q < D; q++)
        for (size_t m = 0; m < P; m++, first = 0)
          DOPT_TRY(DEV(d)->grid_encode(DCTX(d), part_ptr(d, i, q, m, R, lo, len) + o + s0, &sp, codes, W, k, !first,
                                       d->words, flagged ? d->cls : NULL));
      DOPT_TRY(DEV(d)->grid_decode(DCTX(d), d->words, flagged ? d->cls : NULL, &sp, codes, W, k, p->grad + sp.lo));
    }
    if (denom != 0.0f) {
      int64_t b;
      DOPT_TRY(DEV(d)->average(DCTX(d), p->grad + sp.lo, denom, sp.len, &b));
      p->avg_bad += b;
    }
  }
  return DOPT_OK;
}

/* Before the MAX, parameter i: its private spans summed (and averaged: when this rank's sum is exactly its piece of
 * the averaged gradient, at zero ≥ 1 on a host device), its shared spans' codes taken over every part (MAX into its
 * codes), its flag set when one of those holds a non-finite value. */
static dopt_status bucket_first(dopt_dist_optim *d, int i, size_t R, int W, int k) {
  dist_param *p = &d->p[i];
  const dopt_transport *G = dd_dpg(d, p);
  size_t lo, len, o, n;
  int priv;
  seg_of(d, p, (size_t)G->rank, &lo, &len);
  p->avgd = DEV(d)->host_chunk && d->zero != 0 && lo == p->gpc.lo && len == p->gpc.len;
  const float denom = p->avgd ? dd_avg_denom(d, p) : 0.0f;
  int64_t bad = 0;
  spans s;
  spans_init(&s, p, fusable(d, p), lo, len);
  while (span_next(&s, &o, &n, &priv)) {
    if (priv) {
      DOPT_TRY(sum_span(d, i, R, W, k, lo, len, o, n, 1, denom));
      continue;
    }
    dopt_piece g = p->pc;
    g.lo = lo + o, g.len = n;
    for (size_t q = 0; q < (size_t)G->size; q++)
      for (size_t m = 0; m < nparts(d); m++) {
        int64_t b;
        DOPT_TRY(DEV(d)->grid_codes(DCTX(d), part_ptr(d, i, q, m, R, lo, len) + o, &g, d->codes + d->code_off[i], &b));
        bad += b;
      }
  }
  const int32_t one = 1;
  return bad ? DEV(d)->upload(DCTX(d), d->codes + d->code_off[i] - 1, &one, sizeof one) : DOPT_OK;
}

/* After the MAX, parameter i: its shared spans summed into p->grad (owner mode: the whole block, on the owner's
 * row), averaged as bucket_first decided. */
static dopt_status bucket_rest(dopt_dist_optim *d, int i, size_t R, int W, int k) {
  dist_param *p = &d->p[i];
  size_t lo, len, o, n;
  int priv;
  seg_of(d, p, (size_t)dd_dpg(d, p)->rank, &lo, &len);
  const float denom = p->avgd ? dd_avg_denom(d, p) : 0.0f;
  spans s;
  spans_init(&s, p, fusable(d, p), lo, len);
  while (span_next(&s, &o, &n, &priv))
    if (!priv) DOPT_TRY(sum_span(d, i, R, W, k, lo, len, o, n, 0, denom));
  return DOPT_OK;
}

/* The codes and flags of parameters [b0, b1) (one range of d->codes): their MAX over the world (tp, then dp);
 * the flags to the host. */
static dopt_status max_codes(dopt_dist_optim *d, int b0, int b1) {
  int32_t *at = d->codes + d->code_off[b0] - 1;
  const size_t n = d->code_off[b1] - d->code_off[b0];
  if (d->tp.size > 1 && n) DOPT_TRY(d->tp.ops->all_reduce(d->tp.comm, at, at, n, DOPT_I32, DOPT_MAX));
  if (d->dp.size > 1 && n) DOPT_TRY(d->dp.ops->all_reduce(d->dp.comm, at, at, n, DOPT_I32, DOPT_MAX));
  for (int i = b0; i < b1; i++)
    DOPT_TRY(DEV(d)->download(DCTX(d), &d->hflags[i], d->codes + d->code_off[i] - 1, sizeof(int32_t)));
  return DOPT_OK;
}

/* zero 0: every rank's segments of the bucket's piecewise parameters to every rank (one all_gather: S_i
 * elements each, the last ones padded), then the whole TP blocks. */
static dopt_status bucket_regather(dopt_dist_optim *d, int b0, int b1) {
  const dopt_transport *G = dd_dpg(d, &d->p[b0]);
  const size_t D = (size_t)G->size, me = (size_t)G->rank;
  size_t T = 0, lo, len;
  for (int i = b0; i < b1; i++)
    if (!d->p[i].owned) T += seg_size(d, &d->p[i]);
  DOPT_TRY(dd_grow_dev(d, (void **)&d->pack, &d->pack_cap, (T ? T : 1) * sizeof(float)));
  DOPT_TRY(dd_grow_dev(d, (void **)&d->parts, &d->parts_cap, (D * T > 0 ? D * T : 1) * sizeof(float)));
  size_t at = 0;
  for (int i = b0; i < b1; i++) {
    const dist_param *p = &d->p[i];
    if (p->owned) continue;
    seg_of(d, p, me, &lo, &len);
    if (len) DOPT_TRY(DEV(d)->copy(DCTX(d), d->pack + at, p->grad + lo, len * sizeof(float)));
    at += seg_size(d, p);
  }
  DOPT_TRY(G->ops->all_gather(G->comm, d->pack, d->parts, T, DOPT_F32));
  at = 0;
  for (int i = b0; i < b1; i++) {
    const dist_param *p = &d->p[i];
    if (p->owned) continue;
    for (size_t q = 0; q < D; q++) {
      seg_of(d, p, q, &lo, &len);
      if (len) DOPT_TRY(DEV(d)->copy(DCTX(d), p->grad + lo, d->parts + q * T + at, len * sizeof(float)));
    }
    at += seg_size(d, p);
  }
  return DOPT_OK;
}

/* The exact dp sum of the bucket [b0, b1) without all_to_allv (or over a group of 1, batch invariant: the
 * micro-batches of this rank alone): the bucket's codes in one MAX over the world, then per parameter its int64
 * words in one integer SUM over its group (dd_dp_sum), decoded into this rank's piece. */
static dopt_status words_dp_sum(dopt_dist_optim *d, int b0, int b1, int W, int k) {
  for (int i = b0; i < b1; i++) {
    dist_param *p = &d->p[i];
    if (p->lnumel == 0) continue;
    dopt_piece tb; /* the whole TP block */
    dd_held_piece(p, 0, &tb);
    const int nsrc = d->keep ? p->nmb : 1;
    int64_t bad = 0;
    for (int m = 0; m < nsrc; m++) {
      int64_t b;
      const float *src = d->keep ? p->mb + (size_t)m * p->lnumel : p->grad;
      DOPT_TRY(DEV(d)->grid_codes(DCTX(d), src, &tb, d->codes + d->code_off[i], &b));
      bad += b;
    }
    const int32_t one = 1;
    if (bad) DOPT_TRY(DEV(d)->upload(DCTX(d), d->codes + d->code_off[i] - 1, &one, sizeof one));
  }
  DOPT_TRY(max_codes(d, b0, b1));
  for (int i = b0; i < b1; i++) {
    dist_param *p = &d->p[i];
    if (p->lnumel == 0) continue; /* the same on every rank of this dp group */
    const int32_t *codes = d->codes + d->code_off[i];
    const int flagged = d->hflags[i] != 0;
    DOPT_TRY(dd_grow_dev(d, (void **)&d->words, &d->words_cap, p->padded * (size_t)W * sizeof(int64_t)));
    if (flagged) DOPT_TRY(dd_grow_dev(d, (void **)&d->cls, &d->cls_cap, p->padded * sizeof(int64_t)));
    dopt_piece tb; /* the whole TP block */
    dd_held_piece(p, 0, &tb);
    const int nsrc = d->keep ? p->nmb : 1;
    /* zero words where nothing is encoded: no micro-batch on this rank, ZeRO padding */
    const size_t zfrom = nsrc ? p->lnumel : 0;
    if (p->padded > zfrom) {
      size_t tail = p->padded - zfrom;
      DOPT_TRY(dd_zero_dev(d, d->words + zfrom * (size_t)W, tail * (size_t)W * sizeof(int64_t)));
      if (flagged) DOPT_TRY(dd_zero_dev(d, d->cls + zfrom, tail * sizeof(int64_t)));
    }
    for (int m = 0; m < nsrc; m++) { /* the first sets the words, the next ones add to them */
      const float *src = d->keep ? p->mb + (size_t)m * p->lnumel : p->grad;
      DOPT_TRY(DEV(d)->grid_encode(DCTX(d), src, &tb, codes, W, k, m > 0, d->words, flagged ? d->cls : NULL));
    }
    if (dd_dpg(d, p)->size > 1) {
      DOPT_TRY(dd_dp_sum(d, p, d->words, (size_t)W, DOPT_I64));
      if (flagged) DOPT_TRY(dd_dp_sum(d, p, d->cls, 1, DOPT_I64));
    }
    const dopt_piece *g = &p->gpc; /* this rank's piece of the sum (owner mode: the owner row's whole block) */
    if (g->len)
      DOPT_TRY(DEV(d)->grid_decode(DCTX(d), d->words + g->lo * (size_t)W, flagged ? d->cls + g->lo : NULL, g, codes, W,
                                   k, p->grad + g->lo));
  }
  return DOPT_OK;
}

/* The exact dp sum of every parameter's gradient (docs/dp-sum.md): in buckets through all_to_allv (above), or
 * through the transport's integer sums (words_dp_sum). */
dopt_status dd_exact_dp_sum(dopt_dist_optim *d) {
  const int W = d->dp_words;
  d->viewing = 0;
  DOPT_TRY(dd_zero_dev(d, d->codes, d->ncodes * sizeof(int32_t)));
  for (int b0 = 0; b0 < d->np;) {
    const int b1 = dd_bucket_end(d, b0, NULL);
    /* the contributions: one accumulated gradient per rank of the group, or (batch invariant) every
     * micro-batch of every rank; one contribution is the sum itself (dopt_dp_sum's rule) */
    const dopt_transport *G = dd_dpg(d, &d->p[b0]);
    const int n = d->keep ? G->size * d->micro : G->size, k = 62 - dopt_grid_headroom(n);
    if (n == 1) {
      for (int i = b0; i < b1; i++)
        if (d->p[i].nmb) DOPT_TRY(DEV(d)->copy(DCTX(d), d->p[i].grad, d->p[i].mb, d->p[i].lnumel * sizeof(float)));
      b0 = b1;
      continue;
    }
    if (G->size == 1 || !G->ops->all_to_allv) {
      DOPT_TRY(words_dp_sum(d, b0, b1, W, k));
      b0 = b1;
      continue;
    }
    size_t R = 0;
    DOPT_TRY(bucket_exchange(d, b0, b1, &R));
    for (int i = b0; i < b1; i++) DOPT_TRY(bucket_first(d, i, R, W, k));
    DOPT_TRY(max_codes(d, b0, b1));
    for (int i = b0; i < b1; i++) DOPT_TRY(bucket_rest(d, i, R, W, k));
    if (d->viewing) { /* every rank has read the others' segments: they may write their accumulators again */
      d->viewing = 0;
      DOPT_TRY(G->ops->view_release(G->comm));
    }
    if (d->zero == 0) DOPT_TRY(bucket_regather(d, b0, b1));
    b0 = b1;
  }
  return DOPT_OK;
}
