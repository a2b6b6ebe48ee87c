/* Logical tensors from the pieces every rank holds (parameters, bf16 copies,
 * states) on every rank or on the lead only, state sizes and memory, and the
 * replica checks: given bytes against rank 0's, and every held piece against
 * the same piece on the other ranks that hold it. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dist_internal.h"
#include "distopt/digest.h"

/* The device's buffers are host memory (the CPU device): gathers receive and send where the data is. */
#define HOST_MEM(d) ((d)->dev == dopt_device_cpu())

/* Every rank of t sends count elements at send to rank 0, which receives rank r's rcount elements at
 * recv + r · stride (elements; recv only on rank 0; the same rcount and stride on every rank). */
static dopt_status to_root(dopt_dist_optim *d, const dopt_transport *t, const void *send, size_t count, void *recv,
                           size_t rcount, size_t stride, dopt_dtype dt) {
  const size_t n = (size_t)t->size;
  size_t *c = d->xc; /* [5 · xn]: send counts, send offsets, receive counts, receive offsets */
  memset(c, 0, 4 * n * sizeof *c);
  c[0] = count;
  if (t->rank == 0)
    for (size_t r = 0; r < n; r++) c[2 * n + r] = rcount, c[3 * n + r] = r * stride;
  void *dummy = NULL; /* a receive buffer where nothing is received */
  if (t->rank != 0) DOPT_TRY(dd_gdev(d, 1, 8, &dummy));
  return t->ops->all_to_allv(t->comm, send, c, c + n, t->rank == 0 ? recv : dummy, c + 2 * n, c + 3 * n, dt);
}

/* The whole TP-local block (host, [lnumel]) of a tensor stored as this rank's
 * shard (sharded != 0: [chunk] at src) or whole (src [lnumel]). elem: 4, 2 or 1. */
static dopt_status gather_tp_local(dopt_dist_optim *d, const dist_param *p, const void *src, int sharded, size_t elem,
                                   dopt_dtype dt, unsigned char *host) { /* host NULL: send only (lead mode) */
  const dopt_transport *g = dd_dpg(d, p); /* dp, or an expert's moe_dp */
  if (!sharded || g->size == 1) return host ? DEV(d)->download(DCTX(d), host, src, p->lnumel * elem) : DOPT_OK;
  void *buf = NULL;
  if (dd_exact_shards(d, p)) { /* Gemini, an ep-split stack: every rank's exact range to rank 0, or to every rank */
    const size_t n = (size_t)g->size;
    size_t *c = d->xc, lo, len;
    memset(c, 0, 4 * n * sizeof *c);
    for (size_t q = 0; q < n; q++) c[q] = d->gather_lead && q != 0 ? 0 : p->pc.len;
    const int here = !d->gather_lead || g->rank == 0;
    for (size_t q = 0; here && q < n; q++) dd_shard(d, p, d->tp.rank, q, &lo, &len), c[2 * n + q] = len, c[3 * n + q] = lo;
    DOPT_TRY(dd_gdev(d, here ? 0 : 1, here ? (p->lnumel ? p->lnumel : 1) * elem : 8, &buf));
    DOPT_TRY(g->ops->all_to_allv(g->comm, src, c, c + n, buf, c + 2 * n, c + 3 * n, dt));
    return host && here ? DEV(d)->download(DCTX(d), host, buf, p->lnumel * elem) : DOPT_OK;
  }
  if (d->gather_lead) { /* every rank's shard to rank 0 of the group: rank r's at r · chunk */
    /* the CPU device's memory is the host's: received where it is wanted (host holds [padded]: dd_gather) */
    const int direct = host && HOST_MEM(d);
    if (g->rank == 0 && !direct) DOPT_TRY(dd_gdev(d, 0, p->padded * elem, &buf));
    DOPT_TRY(to_root(d, g, src, p->chunk, direct ? (void *)host : buf, p->chunk, p->chunk, dt));
    return host && g->rank == 0 && !direct ? DEV(d)->download(DCTX(d), host, buf, p->lnumel * elem) : DOPT_OK;
  }
  DOPT_TRY(dd_gdev(d, 0, p->padded * elem, &buf));
  DOPT_TRY(g->ops->all_gather(g->comm, src, buf, p->chunk, dt));
  return DEV(d)->download(DCTX(d), host, buf, p->lnumel * elem);
}

/* The most elements of a TP rank's block of p. */
static size_t max_tp_block(const dopt_dist_optim *d, const dist_param *p) {
  size_t maxblk = 0;
  for (int r = 0; r < d->tp.size; r++) {
    size_t h0, hl, w0, wl;
    dd_tp_block(p, d->tp.size, r, &h0, &hl, &w0, &wl);
    maxblk = p->pc.b * hl * wl > maxblk ? p->pc.b * hl * wl : maxblk;
  }
  return maxblk;
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
  const size_t maxblk = max_tp_block(d, p);
  const size_t blk_bytes = (maxblk ? maxblk : 1) * elem;
  void *send = NULL, *recv = NULL;
  unsigned char *all = NULL;
  const int lead = d->gather_lead, here = !lead || d->tp.rank == 0; /* lead mode: every block to tp rank 0 only */
  /* host memory (the CPU device): sent from mine (dd_gather sized it to a whole block) and assembled from
   * where it is received; a device's goes up and comes down */
  const int direct = HOST_MEM(d);
  if (!direct) DOPT_TRY(dd_gdev(d, 0, blk_bytes, &send));
  if (here) {
    DOPT_TRY(dd_gdev(d, 1, blk_bytes * (size_t)tpn, &recv));
    if (!direct) DOPT_TRY(dd_ghost(d, 1, blk_bytes * (size_t)tpn, &all));
  }
  if (direct) send = (void *)mine, all = recv;
  else DOPT_TRY(DEV(d)->upload(DCTX(d), send, mine, p->lnumel * elem));
  if (maxblk)
    DOPT_TRY(lead ? to_root(d, &d->tp, send, maxblk, recv, maxblk, maxblk, dt)
                  : d->tp.ops->all_gather(d->tp.comm, send, recv, maxblk, dt));
  if (!out || !here) return DOPT_OK;
  if (!direct) DOPT_TRY(DEV(d)->download(DCTX(d), all, recv, maxblk * elem * (size_t)tpn));
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

/* ---- lead-mode gathers read in place (dopt_dist_gather_begin / _end) ---- */

static int in_place(const dopt_dist_optim *d, const dopt_transport *t);

/* Elements [lo, lo + len) of TP rank r's block of p (flat in its [b, hl, wl]; a TP-replicated tensor's: the
 * whole [b, h, w]), read at x, into their places in the logical out [b, h, w], row run by row run. */
static void place_run(const dopt_dist_optim *d, const dist_param *p, int r, const unsigned char *x, size_t lo,
                      size_t len, size_t elem, unsigned char *out) {
  const dopt_piece *pc = &p->pc;
  size_t h0 = 0, hl = pc->h, w0 = 0, wl = pc->w;
  if (p->role != DOPT_TP_REPLICATED) dd_tp_block(p, d->tp.size, r, &h0, &hl, &w0, &wl);
  for (size_t j = lo, left = wl ? len : 0; left;) { /* element j: batch j / (hl · wl), row j / wl % hl, column j % wl */
    const size_t col = j % wl, run = wl - col < left ? wl - col : left, bi = j / (hl * wl), row = j / wl % hl;
    memcpy(out + ((bi * pc->h + h0 + row) * pc->w + w0 + col) * elem, x, run * elem);
    x += run * elem, j += run, left -= run;
  }
}

/* Inside the bracket: the lead copies entry `entry` of p from every rank that holds a part of it (sharded: the
 * shard of each (tp rank, dp rank), dd_shard; else each tp rank's dp rank 0's whole block) into out; a
 * TP-replicated tensor from tp rank 0's only. The other ranks do nothing. */
static dopt_status gather_batched(dopt_dist_optim *d, const dist_param *p, int entry, int sharded, size_t elem,
                                  unsigned char *out) {
  if (!dopt_dist_is_lead(d) || !out) return DOPT_OK;
  const int T = p->role == DOPT_TP_REPLICATED ? 1 : d->tp.size, D = sharded ? d->dp.size : 1;
  for (int r = 0; r < T; r++) {
    const uint64_t *peer = (const uint64_t *)(uintptr_t)d->btp[r];
    for (int q = 0; q < D; q++) {
      const uint64_t *tab = (const uint64_t *)(uintptr_t)peer[q];
      const unsigned char *x = (const unsigned char *)(uintptr_t)tab[(size_t)(p - d->p) * (size_t)d->bstride + (size_t)entry];
      size_t lo = 0, len, h0, hl, w0, wl;
      if (sharded) dd_shard(d, p, r, (size_t)q, &lo, &len);
      else if (p->role == DOPT_TP_REPLICATED) len = p->lnumel;
      else dd_tp_block(p, d->tp.size, r, &h0, &hl, &w0, &wl), len = p->pc.b * hl * wl;
      if (len) place_run(d, p, r, x, lo, len, elem, out);
    }
  }
  return DOPT_OK;
}

/* Over t (in_place, or of size 1): rank 0's at[r] becomes the address of rank r's tab [n] (I64), read by reference;
 * the release comes at dopt_dist_gather_end. */
static dopt_status tables_to_root(dopt_dist_optim *d, const dopt_transport *t, const uint64_t *tab, size_t n,
                                  uint64_t *at) {
  const size_t g = (size_t)t->size;
  if (g == 1) {
    at[0] = (uint64_t)(uintptr_t)tab;
    return DOPT_OK;
  }
  size_t *c = d->xc; /* [5 · xn]: send counts, send offsets, receive counts */
  memset(c, 0, 3 * g * sizeof *c);
  c[0] = n;
  for (size_t r = 0; t->rank == 0 && r < g; r++) c[2 * g + r] = n;
  DOPT_TRY(t->ops->all_to_allv_view(t->comm, tab, c, c + g, d->views, c + 2 * g, DOPT_I64));
  for (size_t r = 0; t->rank == 0 && r < g; r++) at[r] = (uint64_t)(uintptr_t)d->views[r];
  return DOPT_OK;
}

/* Every rank's table of where it holds each entry (bmine) to dp rank 0 by reference (bpeer: their addresses),
 * every dp rank 0's bpeer to the lead by reference (btp). The tables and the pieces stay unchanged until end. */
dopt_status dopt_dist_gather_begin(dopt_dist_optim *d) {
  DOPT_CHECK_ARG(d != NULL, "dopt_dist_gather_begin: d=NULL");
  if (d->batch) return dopt__fail(DOPT_ERR_STATE, "dopt_dist_gather_begin: already inside a begin/end bracket");
  const int on = d->gather_lead && HOST_MEM(d) && d->pp.size == 1 && d->ep.size == 1 &&
                 (d->dp.size == 1 || in_place(d, &d->dp)) && (d->tp.size == 1 || in_place(d, &d->tp));
  if (!on) return DOPT_OK;
  int S = 2;
  for (int i = 0; i < d->np; i++) S = 2 + d->p[i].nstates > S ? 2 + d->p[i].nstates : S;
  const size_t n = (size_t)d->np * (size_t)S, D = (size_t)d->dp.size, T = (size_t)d->tp.size;
  d->bstride = S;
  d->bmine = calloc(n ? n : 1, sizeof *d->bmine);
  d->bpeer = calloc(D, sizeof *d->bpeer);
  d->btp = calloc(T, sizeof *d->btp);
  if (!d->bmine || !d->bpeer || !d->btp) {
    dd_gather_batch_free(d);
    return dopt__fail(DOPT_ERR_NO_MEMORY, "dopt_dist_gather_begin: %zu entries", n);
  }
  for (int i = 0; i < d->np; i++) {
    const dist_param *p = &d->p[i];
    uint64_t *e = d->bmine + (size_t)i * (size_t)S;
    e[0] = (uint64_t)(uintptr_t)p->master, e[1] = (uint64_t)(uintptr_t)p->work;
    for (int k = 0; k < p->nstates; k++) e[2 + k] = (uint64_t)(uintptr_t)p->state[k];
  }
  dopt_status s = tables_to_root(d, &d->dp, d->bmine, n, d->bpeer); /* every dp rank's table to dp rank 0 */
  if (s == DOPT_OK && d->dp.rank == 0) s = tables_to_root(d, &d->tp, d->bpeer, D, d->btp); /* those to the lead */
  if (s != DOPT_OK) {
    dd_gather_batch_free(d);
    return s;
  }
  d->batch = 1;
  return DOPT_OK;
}

/* The releases in the order of the exchanges' nesting: tp among the dp ranks 0 (the lead has copied), then dp. */
dopt_status dopt_dist_gather_end(dopt_dist_optim *d) {
  DOPT_CHECK_ARG(d != NULL, "dopt_dist_gather_end: d=NULL");
  if (!d->batch) return DOPT_OK;
  dopt_status s = DOPT_OK;
  if (d->dp.rank == 0 && d->tp.size > 1) s = d->tp.ops->view_release(d->tp.comm);
  if (s == DOPT_OK && d->dp.size > 1) s = d->dp.ops->view_release(d->dp.comm);
  dd_gather_batch_free(d);
  return s;
}

/* The logical tensor on every rank (collective); out NULL: this rank only
 * takes part. */
dopt_status dd_gather(dopt_dist_optim *d, const dist_param *p, int entry, const void *src, int sharded, size_t elem,
                      dopt_dtype dt, void *out) {
  unsigned char *mine = NULL;
  if (d->batch) return gather_batched(d, p, entry, sharded, elem, out);
  if (d->gather_lead && dd_dpg(d, p)->rank != 0) return gather_tp_local(d, p, src, sharded, elem, dt, NULL); /* sends only */
  /* [lnumel]; in host memory also what is received into it and sent from it: [padded] shards, the largest
   * TP block */
  size_t cap = p->lnumel;
  if (HOST_MEM(d)) {
    const size_t blk = max_tp_block(d, p);
    cap = blk > cap ? blk : cap;
    cap = p->padded > cap ? p->padded : cap;
  }
  DOPT_TRY(dd_ghost(d, 0, (cap ? cap : 1) * elem, &mine));
  DOPT_TRY(gather_tp_local(d, p, src, sharded, elem, dt, mine));
  return assemble_tp(d, p, mine, elem, dt, out);
}

/* out may be NULL only where the gather delivers nothing (lead mode, not the lead). */
static int out_ok(const dopt_dist_optim *d, const void *out) {
  return out != NULL || (d->gather_lead && !dopt_dist_is_lead(d));
}

int dopt_dist_is_lead(const dopt_dist_optim *d) { return d && d->tp.rank == 0 && d->dp.rank == 0 && d->pp.rank == 0; }

dopt_status dopt_dist_set_gather(dopt_dist_optim *d, int mode) {
  DOPT_CHECK_ARG(d != NULL, "dopt_dist_set_gather: d=NULL");
  DOPT_CHECK_ARG(mode == DOPT_DIST_GATHER_ALL || mode == DOPT_DIST_GATHER_LEAD,
                 "dopt_dist_set_gather: mode=%d (DOPT_DIST_GATHER_ALL 0 or DOPT_DIST_GATHER_LEAD 1)", mode);
  if (mode == DOPT_DIST_GATHER_LEAD && (!d->tp.ops->all_to_allv || !d->dp.ops->all_to_allv || !d->mdp.ops->all_to_allv))
    return dopt__fail(DOPT_ERR_UNSUPPORTED, "dopt_dist_set_gather: DOPT_DIST_GATHER_LEAD needs the %s transport's "
                      "all_to_allv", !d->tp.ops->all_to_allv ? "tp" : !d->dp.ops->all_to_allv ? "dp" : "moe_dp");
  d->gather_lead = mode == DOPT_DIST_GATHER_LEAD;
  return DOPT_OK;
}

/* What a gather of parameter i assembles in its stage: 0 its values, 1 its bf16 copy, 2 state `key`. */
enum { G_PARAM, G_WORK, G_STATE };
static dopt_status gather_in_stage(dopt_dist_optim *d, int i, int what, const char *key, void *out);

/* A gather of parameter i (what, key) of `bytes` logical bytes: assembled where it is held (its stage; an
 * expert: its ep rank's tp x moe_dp grid), then sent over ep from that ep rank and over pp from that stage
 * (dd_from_holder): on every rank, or in lead mode along the leads of the groups only (tp rank 0 and rank 0 of
 * the parameter's dp group: the ranks it is assembled on, then world rank 0). out: where it is delivered (NULL
 * where nothing is: out_ok). */
static dopt_status gather_any(dopt_dist_optim *d, int i, int what, const char *key, size_t bytes, void *out) {
  const dist_param *p = &d->p[i];
  if (d->pp.size == 1 && (d->ep.size == 1 || p->home < 0)) return gather_in_stage(d, i, what, key, out);
  const int here = dd_present(d, p), carry = !d->gather_lead || (d->tp.rank == 0 && dd_dpg(d, p)->rank == 0);
  unsigned char *tmp = out;
  if (here && carry && !tmp) DOPT_TRY(dd_ghost(d, 2, bytes ? bytes : 1, &tmp)); /* a stage lead forwards it */
  if (here) DOPT_TRY(gather_in_stage(d, i, what, key, tmp));
  if (!carry || bytes == 0) return DOPT_OK;
  void *buf = NULL;
  DOPT_TRY(dd_gdev(d, 0, bytes, &buf));
  if (here) DOPT_TRY(DEV(d)->upload(DCTX(d), buf, tmp, bytes));
  DOPT_TRY(dd_from_holder(d, p, buf, bytes, DOPT_U8));
  return !here && out ? DEV(d)->download(DCTX(d), out, buf, bytes) : DOPT_OK;
}

dopt_status dopt_dist_gather_param(dopt_dist_optim *d, int i, float *out) {
  DOPT_TRY(dd_check_param(d, i, "dopt_dist_gather_param"));
  DOPT_CHECK_ARG(out_ok(d, out), "dopt_dist_gather_param: out=NULL");
  const dist_param *p = &d->p[i];
  return gather_any(d, i, G_PARAM, NULL, dopt_numel(p->ndim, p->shape) * sizeof(float), out);
}

dopt_status dopt_dist_gather_work(dopt_dist_optim *d, int i, uint16_t *out) {
  DOPT_TRY(dd_check_param(d, i, "dopt_dist_gather_work"));
  DOPT_CHECK_ARG(out_ok(d, out), "dopt_dist_gather_work: out=NULL");
  if (!d->p[i].bf16) return dopt__fail(DOPT_ERR_STATE, "dopt_dist_gather_work: '%s' is not a bf16 parameter", d->p[i].name);
  const dist_param *p = &d->p[i];
  return gather_any(d, i, G_WORK, NULL, dopt_numel(p->ndim, p->shape) * sizeof(uint16_t), out);
}

dopt_status dopt_dist_gather_state(dopt_dist_optim *d, int i, const char *key, void *out) {
  DOPT_TRY(dd_check_param(d, i, "dopt_dist_gather_state"));
  DOPT_CHECK_ARG(key && out_ok(d, out), "dopt_dist_gather_state: key/out NULL");
  size_t bytes = 0;
  DOPT_TRY(dopt_dist_state_bytes(d, i, key, &bytes));
  return gather_any(d, i, G_STATE, key, bytes, out);
}

static dopt_status gather_in_stage(dopt_dist_optim *d, int i, int what, const char *key, void *out) {
  dist_param *p = &d->p[i];
  if (what == G_PARAM) return dd_gather(d, p, 0, p->master, p->master_sharded, sizeof(float), DOPT_F32, out);
  if (what == G_WORK) return dd_gather(d, p, 1, p->work, d->zero == 3, sizeof(uint16_t), DOPT_BF16, out);
  for (int k = 0; k < p->nstates; k++) {
    if (strcmp(p->spec[k].v.name, key) != 0) continue;
    if (p->owned) { /* on the owners: each one's units broadcast from it (one unit: the whole state) */
      const size_t bytes = p->spec[k].v.bytes, ub = bytes / (size_t)p->nunits;
      void *buf = p->nunits == 1 ? p->state[k] : NULL;
      if (!buf) {
        DOPT_TRY(dd_grow_dev(d, (void **)&d->xfer, &d->xfer_cap, bytes ? bytes : 1));
        buf = d->xfer;
      }
      const dopt_transport *g = dd_dpg(d, p);
      for (int w = 0; w < d->tp.size * g->size; w++) {
        size_t u0, u1;
        dd_units(d, p, w, &u0, &u1);
        if (u1 == u0) continue;
        unsigned char *at = (unsigned char *)buf + u0 * ub;
        if (p->nunits > 1 && p->u1 > p->u0 && p->u0 == u0) /* mine: into place first */
          DOPT_TRY(DEV(d)->copy(DCTX(d), at, p->state[k], (u1 - u0) * ub));
        DOPT_TRY(dd_from_rank(d, g, w / d->tp.size, w % d->tp.size, at, (u1 - u0) * ub, DOPT_U8));
      }
      return out ? DEV(d)->download(DCTX(d), out, buf, bytes) : DOPT_OK;
    }
    const dopt_dtype dt = p->spec[k].v.dtype;
    if (p->spec[k].kind == DOPT_STATE_BLOCKWISE) return dd_gather_blocks(d, p, k, out);
    if (p->spec[k].kind == DOPT_STATE_WHOLE)
      return out ? DEV(d)->download(DCTX(d), out, p->state[k], p->spec[k].v.bytes) : DOPT_OK;
    return dd_gather(d, p, 2 + k, p->state[k], d->zero >= 1, dopt_dtype_size(dt), dt, out);
  }
  return dopt__fail(DOPT_ERR_NOT_FOUND, "dopt_dist_gather_state: '%s' has no state '%s'", p->name, key);
}

/* This rank's values of blockwise state k at their logical blocks, the other blocks -inf (host [nb] doubles,
 * *out allocated): what a MAX over the ranks turns into the logical state. */
static dopt_status blocks_of(dopt_dist_optim *d, const dist_param *p, int k, size_t nb, double **out) {
  double *v = malloc((nb ? nb : 1) * sizeof *v);
  float *mine = malloc((p->nblk ? p->nblk : 1) * sizeof *mine);
  dopt_status s = v && mine ? DOPT_OK : dopt__fail(DOPT_ERR_NO_MEMORY, "'%s/%s': %zu blocks", p->name, p->spec[k].v.name, nb);
  if (s == DOPT_OK && p->nblk) s = DEV(d)->download(DCTX(d), mine, p->state[k], p->nblk * sizeof *mine);
  for (size_t b = 0; s == DOPT_OK && b < nb; b++) v[b] = -INFINITY;
  for (size_t t = 0; s == DOPT_OK && t < p->nblk; t++) v[p->blk[t]] = (double)mine[t];
  free(mine);
  if (s != DOPT_OK) free(v);
  *out = s == DOPT_OK ? v : NULL;
  return s;
}

/* x[n] (host doubles) ← their MAX over the ranks that hold p (tp, then p's dp group), through device scratch */
static dopt_status world_max_f64(dopt_dist_optim *d, const dist_param *p, double *x, size_t n) {
  const dopt_transport *g = dd_dpg(d, p);
  void *buf = NULL;
  if (n == 0) return DOPT_OK;
  DOPT_TRY(dd_gdev(d, 0, n * sizeof *x, &buf));
  DOPT_TRY(DEV(d)->upload(DCTX(d), buf, x, n * sizeof *x));
  DOPT_TRY(d->tp.ops->all_reduce(d->tp.comm, buf, buf, n, DOPT_F64, DOPT_MAX));
  DOPT_TRY(g->ops->all_reduce(g->comm, buf, buf, n, DOPT_F64, DOPT_MAX));
  return DEV(d)->download(DCTX(d), x, buf, n * sizeof *x);
}

/* The logical blockwise state k ([nb] F32) on every rank (out NULL: take part only): every block from the
 * ranks whose piece holds elements of it (their copies are equal: dopt_dist_check_held checks it), by one MAX
 * over the world of nb doubles. */
dopt_status dd_gather_blocks(dopt_dist_optim *d, const dist_param *p, int k, float *out) {
  const size_t nb = (size_t)p->spec[k].v.shape[0];
  double *v = NULL;
  DOPT_TRY(blocks_of(d, p, k, nb, &v));
  dopt_status s = world_max_f64(d, p, v, nb);
  for (size_t b = 0; s == DOPT_OK && out && b < nb; b++) out[b] = (float)v[b];
  free(v);
  return s;
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
    if (p->full) /* the owner's logical copy of its units */
      m->param_bytes += (p->u1 - p->u0) * (dopt_numel(p->ndim, p->shape) / (size_t)p->nunits) * sizeof(float);
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
  if (s == DOPT_OK) s = dd_from_world0(d, buf, words, DOPT_I64);
  if (s == DOPT_OK) s = DEV(d)->download(DCTX(d), h, buf, words * sizeof *h);
  int64_t key = INT64_MAX;
  if (s == DOPT_OK) {
    const unsigned char *a = (const unsigned char *)h, *b = mine;
    size_t j = 0;
    while (j < bytes && a[j] == b[j]) j++;
    const int64_t wr = dd_world_rank(d);
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

/* ---- the replica check on held pieces ---- */

/* Entry e of parameter p: 0 its fp32 values, 1 its bf16 copy (bf16 only), then its states. The bytes this
 * rank holds (device; a shard: its valid p->pc.len elements), how many, and over which groups other ranks
 * hold the same bytes. */
typedef struct held {
  const void *x;
  size_t bytes;
  int over_dp, over_tp;
} held;

static held held_of(const dopt_dist_optim *d, const dist_param *p, int e) {
  held h = {NULL, 0, 0, 0};
  const int tprep = p->role == DOPT_TP_REPLICATED && d->tp.size > 1, dprep = dd_dpg(d, p)->size > 1;
  if (e == 0) {
    h.x = p->master;
    h.bytes = (p->master_sharded ? p->pc.len : p->lnumel) * sizeof(float);
    h.over_dp = dprep && !p->master_sharded, h.over_tp = tprep;
    return h;
  }
  if (p->bf16 && e == 1) {
    h.x = p->work;
    h.bytes = (d->zero == 3 ? p->pc.len : p->lnumel) * sizeof(uint16_t);
    h.over_dp = dprep && d->zero != 3, h.over_tp = tprep;
    return h;
  }
  const int k = e - 1 - p->bf16;
  if (p->owned) { /* its units on their owner, nothing elsewhere: nothing to compare */
    h.x = p->state[k];
    h.bytes = p->state[k] ? dd_state_held_bytes(p, k) : 0;
    return h;
  }
  h.x = p->state[k];
  if (p->spec[k].kind == DOPT_STATE_ELEMENTWISE) {
    h.bytes = (d->zero >= 1 ? p->pc.len : p->lnumel) * dopt_dtype_size(p->spec[k].v.dtype);
    h.over_dp = dprep && d->zero == 0, h.over_tp = tprep;
  } else if (p->spec[k].kind == DOPT_STATE_BLOCKWISE) { /* the blocks of the piece: replicated as it is */
    h.bytes = p->nblk * dopt_dtype_size(p->spec[k].v.dtype);
    h.over_dp = dprep && d->zero == 0, h.over_tp = tprep;
  } else { /* the logical state, the same on every rank */
    h.bytes = p->spec[k].v.bytes;
    h.over_dp = dprep, h.over_tp = d->tp.size > 1;
  }
  if (!h.x) h.bytes = 0;
  return h;
}

/* Broadcasts rank 0's digests over t; *first becomes (this world rank << 32 | e) for the first entry e
 * compared over t whose digest differs from rank 0's, when that is below *first. */
static dopt_status compare_over(dopt_dist_optim *d, const dopt_transport *t, const unsigned char *mine, size_t n,
                                const unsigned char *over, int64_t *first) {
  if (t->size == 1 || n == 0) return DOPT_OK;
  const size_t bytes = n * DOPT_DIGEST_BYTES;
  void *buf = NULL;
  unsigned char *theirs = malloc(bytes);
  if (!theirs) return dopt__fail(DOPT_ERR_NO_MEMORY, "dopt_dist_check_held: %zu digest bytes", bytes);
  dopt_status s = DEV(d)->alloc(DCTX(d), bytes, &buf);
  if (s == DOPT_OK) s = DEV(d)->upload(DCTX(d), buf, mine, bytes);
  if (s == DOPT_OK) s = t->ops->broadcast(t->comm, buf, buf, bytes, DOPT_U8, 0);
  if (s == DOPT_OK) s = DEV(d)->download(DCTX(d), theirs, buf, bytes);
  const int64_t wr = dd_world_rank(d);
  for (size_t e = 0; s == DOPT_OK && e < n; e++)
    if (over[e] && memcmp(theirs + e * DOPT_DIGEST_BYTES, mine + e * DOPT_DIGEST_BYTES, DOPT_DIGEST_BYTES) != 0) {
      const int64_t key = (wr << 32) | (int64_t)e;
      if (key < *first) *first = key;
      break;
    }
  if (buf) DEV(d)->free(DCTX(d), buf);
  free(theirs);
  return s;
}

/* Whether t's ranks can read each other's held bytes where they lie: one address space (the transport reads by
 * reference, all_to_allv_view) and buffers in host memory (the CPU device). */
static int in_place(const dopt_dist_optim *d, const dopt_transport *t) {
  return t->size > 1 && (size_t)t->size <= d->xn && HOST_MEM(d) && t->ops->all_to_allv_view && t->ops->view_release;
}

/* compare_over without digests, where in_place(d, t): tab [2n] is this rank's (address, bytes) of each entry;
 * rank 0's table reaches every rank by reference (the ranks share one address space, so its addresses are
 * readable), each rank compares its bytes with rank 0's, byte for byte, and the view release keeps rank 0's
 * buffers unchanged until every rank has read them. The same verdict as the digests, without hashing
 * dp × the model: memcmp reads at memory speed, SHA-256 at about 1.8 GB/s. */
static dopt_status compare_in_place(dopt_dist_optim *d, const dopt_transport *t, const uint64_t *tab, size_t n,
                                    const unsigned char *over, int64_t *first) {
  if (t->size == 1 || n == 0) return DOPT_OK;
  const size_t g = (size_t)t->size;
  size_t *c = d->xc; /* [5 · xn], xn ≥ t's size (in_place): send counts, send offsets, receive counts */
  memset(c, 0, 3 * g * sizeof *c);
  if (t->rank == 0)
    for (size_t r = 0; r < g; r++) c[r] = 2 * n; /* its whole table to every rank, offset 0 */
  c[2 * g] = 2 * n;                               /* from rank 0 */
  const void **v = d->views;
  dopt_status s = t->ops->all_to_allv_view(t->comm, tab, c, c + g, v, c + 2 * g, DOPT_I64);
  if (s != DOPT_OK) return s;
  const uint64_t *r0 = v[0];
  const int64_t wr = dd_world_rank(d);
  for (size_t e = 0; t->rank != 0 && e < n; e++) {
    if (!over[e]) continue;
    const size_t b = (size_t)tab[2 * e + 1];
    const void *x0 = (const void *)(uintptr_t)r0[2 * e], *x = (const void *)(uintptr_t)tab[2 * e];
    if (r0[2 * e + 1] != b || (b && memcmp(x0, x, b) != 0)) {
      const int64_t key = (wr << 32) | (int64_t)e;
      if (key < *first) *first = key;
      break;
    }
  }
  return t->ops->view_release(t->comm);
}

/* Whether this rank's piece holds logical element L (flat in the logical [b, h, w]). */
static int holds_elem(const dopt_piece *pc, size_t L) {
  const size_t bi = L / (pc->h * pc->w), row = L / pc->w % pc->h, col = L % pc->w;
  if (row < pc->h0 || row >= pc->h0 + pc->hl || col < pc->w0 || col >= pc->w0 + pc->wl) return 0;
  const size_t j = (bi * pc->hl + row - pc->h0) * pc->wl + col - pc->w0;
  return j >= pc->lo && j < pc->lo + pc->len;
}

/* The shared blocks of blockwise state k (entry e of check_held): each rank holding elements of a block keeps
 * a copy of its value; every copy is compared with the copy of the ranks that hold the block's first element
 * (one MAX over the ranks that hold p), and *first becomes (world rank << 32 | e) when this rank's copy differs and that
 * is below it. */
static dopt_status check_shared(dopt_dist_optim *d, const dist_param *p, int k, size_t e, int64_t *first) {
  const size_t n = p->share.n, B = p->qblock;
  size_t *idx = malloc(n * sizeof *idx);
  double *prim = malloc(n * sizeof *prim);
  float *mine = malloc((p->nblk ? p->nblk : 1) * sizeof *mine);
  long long *at = malloc(n * sizeof *at); /* this rank's slot of shared block s, or -1 */
  dopt_status s = idx && prim && mine && at ? DOPT_OK : dopt__fail(DOPT_ERR_NO_MEMORY, "dopt_dist_check_held: %zu blocks", n);
  if (s == DOPT_OK) s = DEV(d)->download(DCTX(d), idx, p->share.idx, n * sizeof *idx);
  if (s == DOPT_OK && p->nblk) s = DEV(d)->download(DCTX(d), mine, p->state[k], p->nblk * sizeof *mine);
  for (size_t q = 0, t = 0; s == DOPT_OK && q < n; q++) { /* both lists ascending */
    while (t < p->nblk && p->blk[t] < idx[q]) t++;
    at[q] = t < p->nblk && p->blk[t] == idx[q] ? (long long)t : -1;
    prim[q] = at[q] >= 0 && holds_elem(&p->pc, idx[q] * B) ? (double)mine[at[q]] : -INFINITY;
  }
  if (s == DOPT_OK) s = world_max_f64(d, p, prim, n);
  const int64_t wr = dd_world_rank(d);
  for (size_t q = 0; s == DOPT_OK && q < n; q++) {
    const float v = (float)prim[q];
    if (at[q] >= 0 && memcmp(&v, &mine[at[q]], sizeof v) != 0) {
      const int64_t key = (wr << 32) | (int64_t)e;
      if (key < *first) *first = key;
      break;
    }
  }
  free(idx);
  free(prim);
  free(mine);
  free(at);
  return s;
}

dopt_status dopt_dist_check_held(dopt_dist_optim *d, int *rank, int *param, char *name, size_t cap) {
  DOPT_CHECK_ARG(d != NULL && rank != NULL && param != NULL && (name != NULL || cap == 0),
                 "dopt_dist_check_held: NULL argument");
  *rank = -1;
  *param = -1;
  if (cap) name[0] = '\0';
  size_t n = 0;
  for (int i = 0; i < d->np; i++) n += 1 + (size_t)d->p[i].bf16 + (size_t)d->p[i].nstates;
  /* per entry: compared over dp (a dense parameter's), over moe_dp (an expert's), over tp */
  unsigned char *dg = NULL, *odp = calloc(n ? n : 1, 3), *omd = odp ? odp + (n ? n : 1) : NULL,
                *otp = omd ? omd + (n ? n : 1) : NULL;
  uint64_t *tab = calloc(2 * (n ? n : 1), sizeof *tab); /* (address, bytes) of each entry this rank holds */
  const int dp_in = in_place(d, &d->dp), md_in = d->ep.size <= 1 || in_place(d, &d->mdp), tp_in = in_place(d, &d->tp);
  const int digests = (d->dp.size > 1 && !dp_in) || (d->ep.size > 1 && d->mdp.size > 1 && !md_in) ||
                      (d->tp.size > 1 && !tp_in);
  if (digests) dg = calloc(n ? n : 1, DOPT_DIGEST_BYTES);
  if (!odp || !tab || (digests && !dg)) {
    free(dg);
    free(odp);
    free(tab);
    return dopt__fail(DOPT_ERR_NO_MEMORY, "dopt_dist_check_held: %zu pieces", n);
  }
  dopt_status s = DOPT_OK;
  size_t e = 0;
  for (int i = 0; s == DOPT_OK && i < d->np; i++) {
    const dist_param *p = &d->p[i];
    for (int q = 0; s == DOPT_OK && q < 1 + p->bf16 + p->nstates; q++, e++) {
      const held h = held_of(d, p, q);
      (p->expert >= 0 && d->ep.size > 1 ? omd : odp)[e] = (unsigned char)h.over_dp, otp[e] = (unsigned char)h.over_tp;
      if (!h.over_dp && !h.over_tp) continue; /* held once: nothing to compare with */
      tab[2 * e] = (uint64_t)(uintptr_t)h.x, tab[2 * e + 1] = h.bytes;
      if (!digests) continue;
      const void *bytes = h.x; /* the CPU device's buffers are host memory: digested where they are */
      if (!HOST_MEM(d)) {
        unsigned char *host = NULL;
        s = dd_ghost(d, 0, h.bytes ? h.bytes : 1, &host);
        if (s == DOPT_OK && h.bytes) s = DEV(d)->download(DCTX(d), host, h.x, h.bytes);
        bytes = host;
      }
      if (s == DOPT_OK) s = dopt_digest_buffer(h.bytes ? bytes : "", h.bytes, dg + e * DOPT_DIGEST_BYTES, NULL);
    }
  }
  int64_t first = INT64_MAX;
  if (s == DOPT_OK)
    s = dp_in ? compare_in_place(d, &d->dp, tab, n, odp, &first) : compare_over(d, &d->dp, dg, n, odp, &first);
  if (s == DOPT_OK && d->ep.size > 1)
    s = md_in ? compare_in_place(d, &d->mdp, tab, n, omd, &first) : compare_over(d, &d->mdp, dg, n, omd, &first);
  if (s == DOPT_OK)
    s = tp_in ? compare_in_place(d, &d->tp, tab, n, otp, &first) : compare_over(d, &d->tp, dg, n, otp, &first);
  e = 0;
  for (int i = 0; s == DOPT_OK && i < d->np; i++) { /* blocks whose elements several ranks hold */
    const dist_param *p = &d->p[i];
    for (int k = 0; s == DOPT_OK && k < p->nstates; k++)
      if (p->qblock && p->share.n && p->spec[k].kind == DOPT_STATE_BLOCKWISE)
        s = check_shared(d, p, k, e + 1 + (size_t)p->bf16 + (size_t)k, &first);
    e += 1 + (size_t)p->bf16 + (size_t)p->nstates;
  }
  int64_t neg = -first;
  if (s == DOPT_OK) s = dd_world_max(d, &neg, 1);
  if (s == DOPT_OK && -neg != INT64_MAX) {
    *rank = (int)(-neg >> 32);
    size_t want = (size_t)(-neg & 0xffffffff), at = 0;
    for (int i = 0; i < d->np; i++) {
      const dist_param *p = &d->p[i];
      const size_t m = 1 + (size_t)p->bf16 + (size_t)p->nstates;
      if (want >= at + m) {
        at += m;
        continue;
      }
      const int q = (int)(want - at);
      *param = i;
      if (cap) {
        if (q == 0) snprintf(name, cap, "%s", p->name);
        else if (p->bf16 && q == 1) snprintf(name, cap, "%s/bf16", p->name);
        else snprintf(name, cap, "%s/%s", p->name, p->spec[q - 1 - p->bf16].v.name);
      }
      break;
    }
  }
  free(dg);
  free(odp);
  free(tab);
  return s;
}
