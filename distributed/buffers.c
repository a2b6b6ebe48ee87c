/* The ground floor of distributed/: the device buffers and host scratch every other file uses (allocation,
 * growth, zeros, the gather scratch) and their release, dopt_dist_destroy. */
#include <stdint.h>
#include <stdlib.h>

#include "dist_internal.h"

dopt_status dd_dalloc(dopt_dist_optim *d, size_t bytes, void **out) {
  return DEV(d)->alloc(DCTX(d), bytes ? bytes : 1, out);
}

/* A device buffer kept across calls: grown (freed and allocated again, zero
 * filled) to at least `bytes`, never shrunk. *cap is in bytes. */
dopt_status dd_grow_dev(dopt_dist_optim *d, void **buf, size_t *cap, size_t bytes) {
  if (bytes <= *cap) return DOPT_OK;
  if (*buf) DEV(d)->free(DCTX(d), *buf);
  *buf = NULL;
  *cap = 0;
  DOPT_TRY(dd_dalloc(d, bytes, buf));
  *cap = bytes;
  return DOPT_OK;
}

dopt_status dd_grow_views(dopt_dist_optim *d, size_t nb, size_t D) {
  const size_t n = nb * D;
  if (n <= d->ncap && nb <= d->nsends_cap) return DOPT_OK;
  const size_t cn = n > d->ncap ? n : d->ncap, cb = nb > d->nsends_cap ? nb : d->nsends_cap;
  const void **v = realloc(d->nviews, cn * sizeof *v);
  if (v) d->nviews = v;
  const void **sn = v ? realloc(d->nsends, cb * sizeof *sn) : NULL;
  if (sn) d->nsends = sn, d->nsends_cap = cb;
  size_t *c = sn ? realloc(d->ncnt, 3 * cn * sizeof *c) : NULL;
  if (!c) return dopt__fail(DOPT_ERR_NO_MEMORY, "distributed: views of %zu exchanges x %zu ranks", nb, D);
  d->ncnt = c, d->ncap = cn;
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

/* Device x[bytes] ← zeros. */
dopt_status dd_zero_dev(dopt_dist_optim *d, void *x, size_t bytes) {
  const float *z = NULL;
  if (bytes == 0) return DOPT_OK;
  DOPT_TRY(zeros_of(d, bytes, &z));
  return DEV(d)->upload(DCTX(d), x, z, bytes);
}

/* Gather scratch k (device or host), grown to at least `bytes` and kept. */
dopt_status dd_gdev(dopt_dist_optim *d, int k, size_t bytes, void **out) {
  DOPT_TRY(dd_grow_dev(d, &d->gdev[k], &d->gdev_cap[k], bytes));
  *out = d->gdev[k];
  return DOPT_OK;
}

dopt_status dd_ghost(dopt_dist_optim *d, int k, size_t bytes, unsigned char **out) {
  if (bytes > d->ghost_cap[k]) {
    unsigned char *h = realloc(d->ghost[k], bytes ? bytes : 1);
    if (!h) return dopt__fail(DOPT_ERR_NO_MEMORY, "distributed dd_gather: %zu bytes", bytes);
    d->ghost[k] = h;
    d->ghost_cap[k] = bytes;
  }
  *out = d->ghost[k];
  return DOPT_OK;
}

static void free_param(dopt_dist_optim *d, dist_param *p) {
  if (p->full) DEV(d)->free(DCTX(d), p->full);
  DEV(d)->free(DCTX(d), p->grad);
  if (p->mb) DEV(d)->free(DCTX(d), p->mb);
  DEV(d)->free(DCTX(d), p->master);
  if (p->work) DEV(d)->free(DCTX(d), p->work);
  for (int k = 0; k < p->nstates; k++)
    if (p->state[k]) DEV(d)->free(DCTX(d), p->state[k]);
  if (p->share.idx) DEV(d)->free(DCTX(d), (void *)(uintptr_t)p->share.idx);
  if (p->share.max) DEV(d)->free(DCTX(d), p->share.max);
  free(p->blk);
  free(p->ub);
  free(p->name);
}

void dopt_dist_destroy(dopt_dist_optim *d) {
  if (!d) return;
  for (int i = 0; i < d->np; i++) free_param(d, &d->p[i]);
  if (d->frames) DEV(d)->free(DCTX(d), d->frames);
  if (d->b.stage_buf) DEV(d)->free(DCTX(d), d->b.stage_buf);
  if (d->xfer) DEV(d)->free(DCTX(d), d->xfer);
  if (d->xs) DEV(d)->free(DCTX(d), d->xs);
  if (d->xr) DEV(d)->free(DCTX(d), d->xr);
  free(d->xc);
  free(d->views);
  free(d->nviews), free(d->nsends), free(d->ncnt);
  dd_gather_batch_free(d);
  free(d->xoff);
  free(d->xlist);
  free(d->xord);
  for (int k = 0; k < 2; k++)
    if (d->gdev[k]) DEV(d)->free(DCTX(d), d->gdev[k]);
  for (int k = 0; k < 3; k++) free(d->ghost[k]);
  free(d->gem);
  if (d->up) DEV(d)->free(DCTX(d), d->up);
  for (int op = 0; op < NOPS; op++)
    for (int t = 0; t < NTRANSPORTS; t++) free(d->b.l[op][t].v);
  if (d->flags) DEV(d)->free(DCTX(d), d->flags);
  if (d->codes) DEV(d)->free(DCTX(d), d->codes);
  if (d->words) DEV(d)->free(DCTX(d), d->words);
  if (d->cls) DEV(d)->free(DCTX(d), d->cls);
  if (d->parts) DEV(d)->free(DCTX(d), d->parts);
  if (d->pack) DEV(d)->free(DCTX(d), d->pack);
  free(d->part_at);
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

void dd_gather_batch_free(dopt_dist_optim *d) {
  free(d->bmine), free(d->bpeer), free(d->btp);
  d->bmine = d->bpeer = d->btp = NULL;
  d->batch = 0;
}
