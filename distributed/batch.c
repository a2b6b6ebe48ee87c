/* The reduction batch: every statistic the stages of a round post (MAX F64,
 * integer SUM I64), per transport (tp, dp), reduced in one collective each
 * when the round ends (exact in any order, docs/exact-reductions.md). */
#include <stdlib.h>

#include "dist_internal.h"

static dopt_status push(batch *b, int op, int t, void *x, size_t n) {
  post_list *l = &b->l[op][t];
  if (l->len == l->cap) {
    size_t cap = l->cap ? 2 * l->cap : 64;
    post *v = realloc(l->v, cap * sizeof *v);
    if (!v) return b->err = dopt__fail(DOPT_ERR_NO_MEMORY, "distributed step: reduction batch of %zu arrays", cap);
    l->v = v;
    l->cap = cap;
  }
  l->v[l->len].x = x;
  l->v[l->len].n = n;
  l->len++;
  l->words += n;
  return DOPT_OK;
}

static dopt_status post_op(void *ctx, int op, void *x, size_t n) {
  red_ctx *r = ctx;
  if (n == 0) return DOPT_OK;
  if (r->over_tp) DOPT_TRY(push(&r->d->b, op, T_TP, x, n));
  if (r->over_dp) DOPT_TRY(push(&r->d->b, op, r->dpt, x, n));
  return DOPT_OK;
}

dopt_status dd_post_max(void *ctx, double *x, size_t n) { return post_op(ctx, OP_MAX, x, n); }

dopt_status dd_post_sum(void *ctx, int64_t *x, size_t n) { return post_op(ctx, OP_SUM, x, n); }

/* Reduces everything posted since the last flush: per operation and
 * transport, one collective over the packed words. Every rank of a group
 * posts the same arrays in the same order (pieces of the same tensors, the
 * same stages), so the collectives match. */
dopt_status dd_flush(dopt_dist_optim *d) {
  batch *b = &d->b;
  dopt_status s = b->err;
  for (int op = 0; op < NOPS; op++) {
    for (int t = 0; t < NTRANSPORTS; t++) {
      post_list *l = &b->l[op][t];
      const dopt_transport *tr = t == T_TP ? &d->tp : t == T_DP ? &d->dp : &d->mdp;
      const dopt_dtype dt = op == OP_MAX ? DOPT_F64 : DOPT_I64;
      const dopt_redop rop = op == OP_MAX ? DOPT_MAX : DOPT_SUM;
      if (s == DOPT_OK && l->len == 1) {
        s = tr->ops->all_reduce(tr->comm, l->v[0].x, l->v[0].x, l->v[0].n, dt, rop);
        b->collectives++;
      } else if (s == DOPT_OK && l->len > 1) {
        s = dd_grow_dev(d, &b->stage_buf, &b->stage_cap, l->words * 8); /* F64 and I64 words alike */
        unsigned char *buf = b->stage_buf;
        for (size_t i = 0, off = 0; s == DOPT_OK && i < l->len; off += l->v[i].n * 8, i++)
          s = DEV(d)->copy(DCTX(d), buf + off, l->v[i].x, l->v[i].n * 8);
        if (s == DOPT_OK) s = tr->ops->all_reduce(tr->comm, buf, buf, l->words, dt, rop);
        b->collectives++;
        for (size_t i = 0, off = 0; s == DOPT_OK && i < l->len; off += l->v[i].n * 8, i++)
          s = DEV(d)->copy(DCTX(d), l->v[i].x, buf + off, l->v[i].n * 8);
      }
      l->len = 0;
      l->words = 0;
    }
  }
  b->err = DOPT_OK;
  return s;
}
