/* The world collectives the other files share: reductions of host words over a stage or the world, and the
 * broadcasts that carry a buffer from a stage, a holder, a dp rank or world rank 0 to the ranks that need it. */
#include <stdlib.h>
#include <string.h>

#include "dist_internal.h"

/* Sends the buffer x[count] (device) of the rank at rank `owner` of the data-parallel group g (dp, or an
 * expert's moe_dp), tp rank `owner_tp`, to every rank of g's tp x g grid: over tp in the owner's row, then over
 * g in every tp column. */
dopt_status dd_from_rank(dopt_dist_optim *d, const dopt_transport *g, int owner, int owner_tp, void *x, size_t count,
                         dopt_dtype dt) {
  if (d->tp.size > 1 && g->rank == owner) DOPT_TRY(d->tp.ops->broadcast(d->tp.comm, x, x, count, dt, owner_tp));
  if (g->size > 1) DOPT_TRY(g->ops->broadcast(g->comm, x, x, count, dt, owner));
  return DOPT_OK;
}

/* h[n] (host) ← its reduction by op over one stage (tp, then dp; pp_too: then over pp, the whole world),
 * through a device buffer: d->flags (np + 1 words) when it fits, else one of its own (a transport reduces
 * device memory: NCCL and the device-buffer simulator cannot read a host pointer). */
dopt_status dd_reduce_i64(dopt_dist_optim *d, int64_t *h, size_t n, dopt_redop op, int pp_too) {
  void *buf = d->flags;
  if (n > (size_t)d->np + 1) DOPT_TRY(DEV(d)->alloc(DCTX(d), n * sizeof *h, &buf));
  dopt_status s = DEV(d)->upload(DCTX(d), buf, h, n * sizeof *h);
  if (s == DOPT_OK) s = d->tp.ops->all_reduce(d->tp.comm, buf, buf, n, DOPT_I64, op);
  if (s == DOPT_OK) s = d->dp.ops->all_reduce(d->dp.comm, buf, buf, n, DOPT_I64, op);
  if (s == DOPT_OK && pp_too && d->pp.size > 1) s = d->pp.ops->all_reduce(d->pp.comm, buf, buf, n, DOPT_I64, op);
  if (s == DOPT_OK) s = DEV(d)->download(DCTX(d), h, buf, n * sizeof *h);
  if (buf != (void *)d->flags) DEV(d)->free(DCTX(d), buf);
  return s;
}

/* h[n] ← its reduction over the world: every stage's tp and dp groups, then pp. */
dopt_status dd_world_reduce(dopt_dist_optim *d, int64_t *h, size_t n, dopt_redop op) {
  return dd_reduce_i64(d, h, n, op, 1);
}

dopt_status dd_from_stage(dopt_dist_optim *d, int stage, void *x, size_t count, dopt_dtype dt) {
  return d->pp.size > 1 ? d->pp.ops->broadcast(d->pp.comm, x, x, count, dt, stage) : DOPT_OK;
}

dopt_status dd_from_world0(dopt_dist_optim *d, void *x, size_t count, dopt_dtype dt) {
  if (d->tp.rank == 0 && d->dp.rank == 0) DOPT_TRY(dd_from_stage(d, 0, x, count, dt));
  return dd_from_rank(d, &d->dp, 0, 0, x, count, dt);
}

dopt_status dd_world_max(dopt_dist_optim *d, int64_t *h, size_t n) { return dd_world_reduce(d, h, n, DOPT_MAX); }

dopt_status dd_from_holder(dopt_dist_optim *d, const dist_param *p, void *x, size_t count, dopt_dtype dt) {
  if (d->ep.size > 1 && p->home >= 0 && p->stage == d->pp.rank) /* the holder's ep rank to its stage's others */
    DOPT_TRY(d->ep.ops->broadcast(d->ep.comm, x, x, count, dt, p->home));
  return dd_from_stage(d, p->stage, x, count, dt);
}

/* Each parameter's entry is its home's value and 0 on the other ranks of the ep and pp groups, so each SUM is
 * that value exactly, NaN and inf included. Through device scratch. */
dopt_status dd_sum_over_homes(dopt_dist_optim *d, void *x, dopt_dtype dt) {
  if ((d->pp.size == 1 && d->ep.size == 1) || d->np == 0) return DOPT_OK;
  const size_t bytes = (size_t)d->np * dopt_dtype_size(dt);
  for (int i = 0; i < d->np; i++)
    if (!dd_home(d, &d->p[i])) memset((unsigned char *)x + (size_t)i * dopt_dtype_size(dt), 0, dopt_dtype_size(dt));
  void *buf = NULL;
  DOPT_TRY(dd_gdev(d, 0, bytes, &buf));
  DOPT_TRY(DEV(d)->upload(DCTX(d), buf, x, bytes));
  if (d->ep.size > 1) DOPT_TRY(d->ep.ops->all_reduce(d->ep.comm, buf, buf, (size_t)d->np, dt, DOPT_SUM));
  if (d->pp.size > 1) DOPT_TRY(d->pp.ops->all_reduce(d->pp.comm, buf, buf, (size_t)d->np, dt, DOPT_SUM));
  return DEV(d)->download(DCTX(d), x, buf, bytes);
}
