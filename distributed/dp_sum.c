/* The data-parallel gradient sum (docs/dp-sum.md): exact — the logical
 * blocks' codes in one MAX over the world, the fixed-point words in one
 * integer SUM over dp, decoded into each rank's piece — or fp32 in the
 * transport's order. Owner mode: reduced to the owner's dp row only. */
#include "dist_internal.h"

/* SUM over dp of x[padded·per] (all-reduce for zero 0/1; reduce-scatter for
 * zero 2/3, in place: this rank's block of the padded buffer); owner mode:
 * x[lnumel·per] reduced to the owner's dp row (all-reduce with a transport
 * that has no reduce). */
dopt_status dd_dp_sum(dopt_dist_optim *d, const dist_param *p, void *x, size_t per, dopt_dtype dt) {
  if (p->owned)
    return d->dp.ops->reduce ? d->dp.ops->reduce(d->dp.comm, x, x, p->lnumel * per, dt, DOPT_SUM, p->owner)
                             : d->dp.ops->all_reduce(d->dp.comm, x, x, p->lnumel * per, dt, DOPT_SUM);
  if (d->zero >= 2)
    return d->dp.ops->reduce_scatter(d->dp.comm, x, (char *)x + (size_t)d->dp.rank * p->chunk * per * dopt_dtype_size(dt),
                                     p->chunk * per, dt, DOPT_SUM);
  return d->dp.ops->all_reduce(d->dp.comm, x, x, p->padded * per, dt, DOPT_SUM);
}

/* This rank's segment of a parameter's TP block for the fused sum: the ZeRO shard (zero >= 1: p->pc), or at
 * zero 0 the same split of the whole block, [q·S, q·S + len) with S = ceil(lnumel / dp). */
static size_t seg_size(const dopt_dist_optim *d, const dist_param *p) {
  return (p->lnumel + (size_t)d->dp.size - 1) / (size_t)d->dp.size;
}
static size_t seg_len(const dist_param *p, size_t S, size_t q) {
  const size_t lo = q * S;
  return lo >= p->lnumel ? 0 : p->lnumel - lo < S ? p->lnumel - lo : S;
}

/* The fused path (a parameter not in owner mode, one accumulated gradient per rank, a transport that can
 * exchange): every dp rank's fp32 values of this rank's segment arrive by one all_to_allv (the fp32
 * reduce-scatter's traffic, not W words per element), the codes are taken over them, and after the MAX
 * each part is encoded, added and decoded a few thousand elements at a time, in cache, as dopt_dp_sum does. */
static int fused(const dopt_dist_optim *d, const dist_param *p) {
  /* not on p->lnumel: a TP rank's block may be empty where the others' are not, and the MAX is over tp too,
   * so every rank takes this path for the same parameters */
  return !d->keep && !p->owned && d->dp.size > 1 && d->dp.ops->all_to_allv != NULL;
}

/* A fused parameter's room in the bucket buffer: its dp parts [dp · S], then (zero 0) its own sum [S]. */
static size_t fused_room(const dopt_dist_optim *d, const dist_param *p) {
  return ((size_t)d->dp.size + 1) * seg_size(d, p);
}

/* The parts of parameter i's segment: recv [dp · S], part q at q · len. */
static dopt_status fused_exchange(dopt_dist_optim *d, int i, float *recv) {
  dist_param *p = &d->p[i];
  const size_t n = (size_t)d->dp.size, S = seg_size(d, p), me = (size_t)d->dp.rank, len = seg_len(p, S, me);
  size_t *c = d->xc; /* [5 · xn]: send counts, send offsets, receive counts, receive offsets */
  for (size_t q = 0; q < n; q++) c[q] = seg_len(p, S, q), c[n + q] = q * S, c[2 * n + q] = len, c[3 * n + q] = q * len;
  return d->dp.ops->all_to_allv(d->dp.comm, p->grad, c, c + n, recv, c + 2 * n, c + 3 * n, DOPT_F32);
}

/* The codes of parameter i's blocks over its segment's parts (MAX into d->codes), its non-finite flag. */
static dopt_status fused_codes(dopt_dist_optim *d, int i, const float *recv) {
  dist_param *p = &d->p[i];
  const size_t S = seg_size(d, p), len = seg_len(p, S, (size_t)d->dp.rank);
  dopt_piece g = p->pc;
  g.lo = (size_t)d->dp.rank * S, g.len = len;
  int64_t bad = 0;
  for (int q = 0; q < d->dp.size && len; q++) {
    int64_t b;
    DOPT_TRY(DEV(d)->grid_codes(DCTX(d), recv + (size_t)q * len, &g, d->codes + d->code_off[i], &b));
    bad += b;
  }
  const int32_t one = 1;
  return bad ? DEV(d)->upload(DCTX(d), d->codes + i, &one, sizeof one) : DOPT_OK;
}

/* The sum of parameter i's segment into p->grad (zero 0: then every segment to every rank). */
static dopt_status fused_sum(dopt_dist_optim *d, int i, float *recv, int W, int k) {
  dist_param *p = &d->p[i];
  const size_t S = seg_size(d, p), len = seg_len(p, S, (size_t)d->dp.rank);
  const int flagged = d->hflags[i] != 0;
  /* a few thousand elements at a time on the CPU (the words stay in cache); one pass on other devices */
  const size_t sub = d->dev == dopt_device_cpu() ? 4096 : (len ? len : 1);
  DOPT_TRY(dd_grow_dev(d, (void **)&d->words, &d->words_cap, sub * (size_t)W * sizeof(int64_t)));
  if (flagged) DOPT_TRY(dd_grow_dev(d, (void **)&d->cls, &d->cls_cap, sub * sizeof(int64_t)));
  const int32_t *codes = d->codes + d->code_off[i];
  for (size_t s0 = 0; s0 < len; s0 += sub) {
    dopt_piece sp = p->pc;
    sp.lo = (size_t)d->dp.rank * S + s0, sp.len = len - s0 < sub ? len - s0 : sub;
    for (int q = 0; q < d->dp.size; q++)
      DOPT_TRY(DEV(d)->grid_encode(DCTX(d), recv + (size_t)q * len + s0, &sp, codes, W, k, q > 0, d->words,
                                   flagged ? d->cls : NULL));
    DOPT_TRY(DEV(d)->grid_decode(DCTX(d), d->words, flagged ? d->cls : NULL, &sp, codes, W, k, p->grad + sp.lo));
  }
  if (d->zero >= 1) return DOPT_OK;
  /* zero 0: every rank's segment to every rank (S elements each: the last ones padded), then the block */
  float *seg = recv + (size_t)d->dp.size * S; /* recv has room for dp · S + S */
  if (len) DOPT_TRY(DEV(d)->copy(DCTX(d), seg, p->grad + (size_t)d->dp.rank * S, len * sizeof(float)));
  DOPT_TRY(d->dp.ops->all_gather(d->dp.comm, seg, recv, S, DOPT_F32));
  return DEV(d)->copy(DCTX(d), p->grad, recv, p->lnumel * sizeof(float));
}

/* Every code and flag: its MAX over the world (tp, then dp); the flags to the host. */
static dopt_status max_codes(dopt_dist_optim *d) {
  if (d->tp.size > 1) DOPT_TRY(d->tp.ops->all_reduce(d->tp.comm, d->codes, d->codes, d->ncodes, DOPT_I32, DOPT_MAX));
  if (d->dp.size > 1) DOPT_TRY(d->dp.ops->all_reduce(d->dp.comm, d->codes, d->codes, d->ncodes, DOPT_I32, DOPT_MAX));
  return DEV(d)->download(DCTX(d), d->hflags, d->codes, (size_t)d->np * sizeof(int32_t));
}

/* The exact dp sum of every parameter's accumulated gradient (docs/dp-sum.md):
 * the logical blocks' codes and the non-finite flags in one MAX over the
 * world (tp, then dp: a logical block may straddle TP blocks), then per
 * parameter its words (and, with a non-finite value somewhere, its class
 * counts) in one integer SUM over dp, decoded into this rank's piece; the
 * fused parameters (fused()) instead receive their pieces' fp32 parts, take
 * the codes over them before the MAX (one per bucket) and sum them locally. */
dopt_status dd_exact_dp_sum(dopt_dist_optim *d) {
  /* the contributions: one accumulated gradient per rank, or (batch
   * invariant) every micro-batch of every rank */
  const int W = d->dp_words, n = d->keep ? d->dp.size * d->micro : d->dp.size;
  const int k = 62 - dopt_grid_headroom(n);
  DOPT_TRY(dd_zero_dev(d, d->codes, d->ncodes * sizeof(int32_t)));
  for (int i = 0; i < d->np; i++) {
    dist_param *p = &d->p[i];
    if (p->lnumel == 0 || fused(d, p)) continue; /* fused: below, over the parts it receives */
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
    if (bad) DOPT_TRY(DEV(d)->upload(DCTX(d), d->codes + i, &one, sizeof one));
  }
  /* the fused parameters in buckets of consecutive ones whose logical bytes / tp (the same on every rank) fit
   * d->bucket_bytes: their parts, their codes, one MAX (of every code: the first also completes the others'),
   * their sums */
  int maxed = 0;
  for (int b0 = 0; b0 < d->np;) {
    if (!fused(d, &d->p[b0])) {
      b0++;
      continue;
    }
    int b1 = b0;
    size_t est = 0, room = 0;
    while (b1 < d->np && fused(d, &d->p[b1])) {
      const size_t e = dopt_numel(d->p[b1].ndim, d->p[b1].shape) * sizeof(float) / (size_t)d->tp.size;
      if (b1 > b0 && d->bucket_bytes && est + e > d->bucket_bytes) break;
      est += e;
      room += fused_room(d, &d->p[b1]);
      b1++;
    }
    DOPT_TRY(dd_grow_dev(d, (void **)&d->parts, &d->parts_cap, room * sizeof(float)));
    float *recv = d->parts; /* per parameter its fused_room */
    size_t at = 0;
    for (int i = b0; i < b1; i++) {
      DOPT_TRY(fused_exchange(d, i, recv + at));
      DOPT_TRY(fused_codes(d, i, recv + at));
      at += fused_room(d, &d->p[i]);
    }
    DOPT_TRY(max_codes(d));
    maxed = 1;
    at = 0;
    for (int i = b0; i < b1; i++) {
      DOPT_TRY(fused_sum(d, i, recv + at, W, k));
      at += fused_room(d, &d->p[i]);
    }
    b0 = b1;
  }
  if (!maxed) DOPT_TRY(max_codes(d));
  for (int i = 0; i < d->np; i++) {
    dist_param *p = &d->p[i];
    if (p->lnumel == 0 || fused(d, p)) continue; /* the same on every rank of this dp group */
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
    if (d->dp.size > 1) {
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
