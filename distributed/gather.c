/* Logical tensors from the pieces every rank holds (parameters, bf16 copies,
 * states), state sizes and memory, and the replica check: every rank's own
 * copy against rank 0's. */
#include <stdlib.h>
#include <string.h>

#include "dist_internal.h"

/* The whole TP-local block (host, [lnumel]) of a tensor stored as this rank's
 * shard (sharded != 0: [chunk] at src) or whole (src [lnumel]). elem: 4, 2 or 1. */
static dopt_status gather_tp_local(dopt_dist_optim *d, const dist_param *p, const void *src, int sharded, size_t elem,
                                   dopt_dtype dt, unsigned char *host) {
  if (!sharded || d->dp.size == 1) return DEV(d)->download(DCTX(d), host, src, p->lnumel * elem);
  void *buf = NULL;
  DOPT_TRY(dd_gdev(d, 0, p->padded * elem, &buf));
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
    dd_tp_block(p, tpn, r, &h0, &hl, &w0, &wl);
    maxblk = pc->b * hl * wl > maxblk ? pc->b * hl * wl : maxblk;
  }
  const size_t blk_bytes = (maxblk ? maxblk : 1) * elem;
  void *send = NULL, *recv = NULL;
  unsigned char *all = NULL;
  DOPT_TRY(dd_gdev(d, 0, blk_bytes, &send));
  DOPT_TRY(dd_gdev(d, 1, blk_bytes * (size_t)tpn, &recv));
  DOPT_TRY(dd_ghost(d, 1, blk_bytes * (size_t)tpn, &all));
  DOPT_TRY(DEV(d)->upload(DCTX(d), send, mine, p->lnumel * elem));
  if (maxblk) DOPT_TRY(d->tp.ops->all_gather(d->tp.comm, send, recv, maxblk, dt));
  if (!out) return DOPT_OK;
  DOPT_TRY(DEV(d)->download(DCTX(d), all, recv, maxblk * elem * (size_t)tpn));
  for (int r = 0; r < tpn; r++) {
    size_t h0, hl, w0, wl;
    dd_tp_block(p, tpn, r, &h0, &hl, &w0, &wl);
    const unsigned char *blk = all + (size_t)r * maxblk * elem;
    for (size_t bi = 0; bi < pc->b; bi++)
      for (size_t i = 0; i < hl; i++)
        memcpy(out + ((bi * pc->h + h0 + i) * pc->w + w0) * elem, blk + (bi * hl + i) * wl * elem, wl * elem);
  }
  return DOPT_OK;
}

/* The logical tensor on every rank (collective); out NULL: this rank only
 * takes part. */
dopt_status dd_gather(dopt_dist_optim *d, const dist_param *p, const void *src, int sharded, size_t elem,
                      dopt_dtype dt, void *out) {
  unsigned char *mine = NULL;
  DOPT_TRY(dd_ghost(d, 0, (p->lnumel ? p->lnumel : 1) * elem, &mine));
  DOPT_TRY(gather_tp_local(d, p, src, sharded, elem, dt, mine));
  return assemble_tp(d, p, mine, elem, dt, out);
}

dopt_status dopt_dist_gather_param(dopt_dist_optim *d, int i, float *out) {
  DOPT_TRY(dd_check_param(d, i, "dopt_dist_gather_param"));
  DOPT_CHECK_ARG(out != NULL, "dopt_dist_gather_param: out=NULL");
  return dd_gather(d, &d->p[i], d->p[i].master, d->p[i].master_sharded, sizeof(float), DOPT_F32, out);
}

dopt_status dopt_dist_gather_work(dopt_dist_optim *d, int i, uint16_t *out) {
  DOPT_TRY(dd_check_param(d, i, "dopt_dist_gather_work"));
  DOPT_CHECK_ARG(out != NULL, "dopt_dist_gather_work: out=NULL");
  if (!d->p[i].bf16) return dopt__fail(DOPT_ERR_STATE, "dopt_dist_gather_work: '%s' is not a bf16 parameter", d->p[i].name);
  return dd_gather(d, &d->p[i], d->p[i].work, d->zero == 3, sizeof(uint16_t), DOPT_BF16, out);
}

dopt_status dopt_dist_gather_state(dopt_dist_optim *d, int i, const char *key, void *out) {
  DOPT_TRY(dd_check_param(d, i, "dopt_dist_gather_state"));
  DOPT_CHECK_ARG(key && out, "dopt_dist_gather_state: key/out NULL");
  dist_param *p = &d->p[i];
  for (int k = 0; k < p->nstates; k++) {
    if (strcmp(p->spec[k].v.name, key) != 0) continue;
    if (p->owned) { /* whole on the owner: broadcast */
      size_t bytes = p->spec[k].v.bytes;
      void *src = p->state[k];
      if (!src) {
        DOPT_TRY(dd_grow_dev(d, (void **)&d->xfer, &d->xfer_cap, bytes));
        src = d->xfer;
      }
      DOPT_TRY(dd_from_owner(d, p, src, bytes, DOPT_U8));
      return DEV(d)->download(DCTX(d), out, src, bytes);
    }
    if (!p->spec[k].elementwise) return DEV(d)->download(DCTX(d), out, p->state[k], p->spec[k].v.bytes);
    return dd_gather(d, p, p->state[k], d->zero >= 1, sizeof(float), DOPT_F32, out);
  }
  return dopt__fail(DOPT_ERR_NOT_FOUND, "dopt_dist_gather_state: '%s' has no state '%s'", p->name, key);
}

dopt_status dopt_dist_state_bytes(const dopt_dist_optim *d, int i, const char *key, size_t *bytes) {
  DOPT_TRY(dd_check_param(d, i, "dopt_dist_state_bytes"));
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
  DOPT_TRY(dd_check_param(d, i, "dopt_dist_get_step"));
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
    for (int k = 0; k < p->nstates; k++) m->state_bytes += p->state[k] ? dd_state_held_bytes(p, k) : 0;
    if (p->full) m->param_bytes += dopt_numel(p->ndim, p->shape) * sizeof(float); /* the owner's logical copy */
  }
  return DOPT_OK;
}

/* World rank 0's bytes reach every rank (dd_from_rank 0, 0), each rank compares
 * them with its own, and one MIN over the world (dd_world_max of the negated key)
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
  if (s == DOPT_OK) s = dd_from_rank(d, 0, 0, buf, words, DOPT_I64);
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
  if (s == DOPT_OK) s = dd_world_max(d, &neg, 1);
  if (s == DOPT_OK && -neg != INT64_MAX) {
    *rank = (int)(-neg >> 32);
    *offset = (size_t)(-neg & 0xffffffff);
  }
  if (buf) DEV(d)->free(DCTX(d), buf);
  free(h);
  return s;
}
