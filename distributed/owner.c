/* Owner mode (docs/distributed.md#owner-mode): an optimizer whose step needs
 * the whole tensor (GaLore's SVD, 8-bit blocks of the logical tensor) steps
 * each parameter with the reference's own step on one owner rank; the other
 * ranks receive the new values and keep their pieces. */
#include "dist_internal.h"

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
  DOPT_TRY(dd_grow_dev(d, (void **)&d->xfer, &d->xfer_cap, numel * sizeof(float)));
  /* the averaged gradient is valid on each rank's piece (zero >= 1) or its whole TP-local block */
  DOPT_TRY(dd_gather(d, p, p->grad + (d->zero >= 1 ? (size_t)d->dp.rank * p->chunk : 0), d->zero >= 1, sizeof(float),
                  DOPT_F32, mine ? host : NULL));
  if (mine) {
    dopt_piece whole;
    dopt_piece_full(p->ndim, p->shape, &whole);
    DOPT_TRY(DEV(d)->upload(DCTX(d), d->xfer, host, numel * sizeof(float)));
    p->events = 0;
    dopt_step_args a = {d->impl, d->hp[p->group], p->step, &whole, p->full, d->xfer, p->state, NULL, NULL, &p->events,
                        (uint64_t)i, 0, NULL, NULL, NULL};
    DOPT_TRY(dd_grow_dev(d, &d->frames, &d->frames_cap, DEV(d)->frame_bytes(DCTX(d), &a)));
    a.frame = d->frames;
    DOPT_TRY(dopt__run_stages(d->dev, &a));
  }
  float *vals = mine ? p->full : d->xfer;
  DOPT_TRY(dd_from_owner(d, p, vals, numel, DOPT_F32));
  DOPT_TRY(DEV(d)->download(DCTX(d), host, vals, numel * sizeof(float)));
  return dd_load_values(d, p, host);
}

dopt_status dd_owner_steps(dopt_dist_optim *d) {
  size_t maxn = 1;
  for (int i = 0; i < d->np; i++) {
    size_t n = dopt_numel(d->p[i].ndim, d->p[i].shape);
    maxn = n > maxn ? n : maxn;
  }
  unsigned char *host = NULL; /* kept across steps, like the gathers' scratch */
  DOPT_TRY(dd_ghost(d, 2, maxn * sizeof(float), &host));
  for (int i = 0; i < d->np; i++)
    if (!d->skip[i]) DOPT_TRY(owner_step(d, i, (float *)(void *)host));
  return DOPT_OK;
}
