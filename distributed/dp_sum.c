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

/* The exact dp sum of every parameter's accumulated gradient (docs/dp-sum.md):
 * the logical blocks' codes and the non-finite flags in one MAX over the
 * world (tp, then dp: a logical block may straddle TP blocks), then per
 * parameter its words (and, with a non-finite value somewhere, its class
 * counts) in one integer SUM over dp, decoded into this rank's piece. */
dopt_status dd_exact_dp_sum(dopt_dist_optim *d) {
  /* the contributions: one accumulated gradient per rank, or (batch
   * invariant) every micro-batch of every rank */
  const int W = d->dp_words, n = d->keep ? d->dp.size * d->micro : d->dp.size;
  const int k = 62 - dopt_grid_headroom(n);
  DOPT_TRY(dd_zero_dev(d, d->codes, d->ncodes * sizeof(int32_t)));
  for (int i = 0; i < d->np; i++) {
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
