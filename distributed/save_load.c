/* dopt_dist_save and dopt_dist_load, distributed checkpoints
 * (docs/checkpoints.md): every rank writes the pieces it holds into one
 * generation, rank 0 commits it; a load serves each rank its pieces of
 * whatever layout saved them. Every phase ends with an agreement, so that a
 * failure on one rank fails all of them. The checkpoint format itself, and
 * distopt/checkpoint.h, are core/ckpt_*.c's. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dist_internal.h"
#include "distopt/checkpoint.h"

/* Every rank learns whether any rank failed; a rank that did not fail itself
 * returns DOPT_ERR_ABORTED naming the phase (the failing rank has the cause). */
static dopt_status agree(dopt_dist_optim *d, dopt_status mine, const char *phase) {
  int64_t v = mine != DOPT_OK;
  char cause[1024] = "";
  if (mine != DOPT_OK) snprintf(cause, sizeof cause, "%s", dopt_last_error()); /* the collective may overwrite it */
  dopt_status s = dd_world_max(d, &v, 1); /* the barrier of the checkpoint protocol */
  if (mine != DOPT_OK) return dopt__fail(mine, "%s", cause);
  if (s != DOPT_OK) return s;
  return v ? dopt__fail(DOPT_ERR_ABORTED, "checkpoint %s: another rank failed (its message has the cause)", phase)
           : DOPT_OK;
}

/* A replica writes nothing twice: a TP-replicated block is written by TP
 * rank 0, a block every rank of its dp group holds whole by that group's rank 0. */
static int writes_piece(const dopt_dist_optim *d, const dist_param *p, int sharded, const dopt_piece *pc) {
  return pc->len > 0 && (d->tp.rank == 0 || p->role != DOPT_TP_REPLICATED) && (dd_dpg(d, p)->rank == 0 || sharded);
}

/* An owned parameter's units on this rank as a piece of the logical tensor (or of an elementwise state of its
 * shape) *whole: one unit, all of it. */
static const dopt_piece *owned_piece(const dist_param *p, dopt_piece *whole) {
  const size_t lu = whole->numel / (size_t)p->nunits;
  whole->lo = p->u0 * lu, whole->len = (p->u1 - p->u0) * lu;
  return whole;
}

/* device x[pc->len] (dtype dt) → the writer, through host scratch */
static dopt_status put_piece(dopt_dist_optim *d, dopt_ckpt_writer *w, const char *tensor, dopt_dtype dt, int ndim,
                             const int64_t *shape, const dopt_piece *pc, const void *x) {
  const size_t bytes = pc->len * dopt_dtype_size(dt);
  unsigned char *h = NULL;
  DOPT_TRY(dd_ghost(d, 0, bytes ? bytes : 1, &h));
  DOPT_TRY(DEV(d)->download(DCTX(d), h, x, bytes));
  return dopt_ckpt_put(w, tensor, dt, ndim, shape, pc, h);
}

static dopt_status write_pieces(dopt_dist_optim *d, dopt_ckpt_writer *w) {
  char name[512];
  for (int i = 0; i < d->np; i++) {
    dist_param *p = &d->p[i];
    if (!dd_present(d, p)) continue; /* its stage (its ep rank) writes it */
    const int lead = d->tp.rank == 0 && dd_dpg(d, p)->rank == 0; /* writes what every holder has whole */
    dopt_piece pc;
    dd_held_piece(p, p->master_sharded, &pc);
    if (writes_piece(d, p, p->master_sharded, &pc))
      DOPT_TRY(put_piece(d, w, p->name, DOPT_F32, p->ndim, p->shape, &pc, p->master));
    if (p->bf16) {
      dd_held_piece(p, d->zero == 3, &pc);
      snprintf(name, sizeof name, "%s/bf16", p->name);
      if (writes_piece(d, p, d->zero == 3, &pc))
        DOPT_TRY(put_piece(d, w, name, DOPT_BF16, p->ndim, p->shape, &pc, p->work));
    }
    if (p->step == 0) continue; /* no states yet (has_state = 0): the reference allocates them at its first step */
    for (int k = 0; k < p->nstates; k++) {
      const dopt_state_view *v = &p->spec[k].v;
      snprintf(name, sizeof name, "%s/%s", p->name, v->name);
      dopt_piece whole;
      dopt_piece_full(v->ndim, v->shape, &whole);
      if (p->owned) { /* its units, on their owner (one unit: whole) */
        if (p->state[k]) DOPT_TRY(put_piece(d, w, name, v->dtype, v->ndim, v->shape, owned_piece(p, &whole), p->state[k]));
      } else if (p->spec[k].kind == DOPT_STATE_BLOCKWISE) { /* gathered (collective), written whole by rank 0 */
        const size_t nb = (size_t)v->shape[0];
        float *all = lead ? malloc((nb ? nb : 1) * sizeof *all) : NULL;
        if (lead && !all)
          return dopt__fail(DOPT_ERR_NO_MEMORY, "dopt_dist_save: '%s': %zu blocks", name, nb);
        dopt_status s = dd_gather_blocks(d, p, k, all);
        if (s == DOPT_OK && all) s = dopt_ckpt_put(w, name, v->dtype, v->ndim, v->shape, &whole, all);
        free(all);
        DOPT_TRY(s);
      } else if (p->spec[k].kind == DOPT_STATE_ELEMENTWISE) { /* sharded like the parameter (zero >= 1) */
        dd_held_piece(p, d->zero >= 1, &pc);
        if (writes_piece(d, p, d->zero >= 1, &pc))
          DOPT_TRY(put_piece(d, w, name, v->dtype, v->ndim, v->shape, &pc, p->state[k]));
      } else if (lead) { /* replicated whole on every rank that holds it */
        DOPT_TRY(put_piece(d, w, name, v->dtype, v->ndim, v->shape, &whole, p->state[k]));
      }
    }
  }
  return DOPT_OK;
}

/* A failed save (every writer closed or aborted): rank 0 removes the temporary generation; the
 * first failure's message is kept. */
static dopt_status discard(int rank, const char *tmp, dopt_status s) {
  if (rank != 0) return s;
  char keep[512];
  snprintf(keep, sizeof keep, "%s", dopt_last_error());
  (void)dopt_ckpt_discard(tmp);
  return dopt__fail(s, "%s", keep);
}

dopt_status dopt_dist_save(dopt_dist_optim *d, const dopt_optim *plain, const char *ckpt_dir, int64_t global_step) {
  DOPT_CHECK_ARG(d && plain && ckpt_dir, "dopt_dist_save: NULL argument");
  const int rank = (int)dd_world_rank(d), nranks = d->pp.size * d->tp.size * d->dp.size;
  const int64_t gs = global_step >= 0 ? global_step : d->gstep + d->skipped;
  char tmp[4096];
  /* rank 0 creates the temporary generation; then every rank writes its pieces */
  dopt_status s = rank == 0 ? dopt_ckpt_begin(ckpt_dir, gs, tmp, sizeof tmp) : DOPT_OK;
  DOPT_TRY(agree(d, s, "begin"));
  DOPT_TRY(dopt_ckpt_tmp_dir(ckpt_dir, gs, tmp, sizeof tmp));
  dopt_ckpt_writer *w = NULL;
  s = dopt_ckpt_writer_open(tmp, rank, nranks, &w);
  if (s == DOPT_OK) s = write_pieces(d, w);
  if (s == DOPT_OK) s = dopt_ckpt_writer_close(w);
  else dopt_ckpt_abort_writer(w);
  s = agree(d, s, "write");
  if (s != DOPT_OK) return discard(rank, tmp, s);
  /* rank 0: the metadata (the plain optimizer's, with this run's counters), the index, the rename */
  s = DOPT_OK;
  if (rank == 0) {
    dopt_ckpt_info info = DOPT_CKPT_INFO_INIT;
    info.global_step = gs;
    info.skipped_steps = d->skipped;
    dopt_ckpt_meta *m = NULL;
    s = dopt_ckpt_meta_from_optim(plain, &info, &m);
    if (s == DOPT_OK && m->nparams != d->np)
      s = dopt__fail(DOPT_ERR_INVALID_ARG, "dopt_dist_save: plain optimizer has %d parameters, the distributed %d",
                     m->nparams, d->np);
    for (int i = 0; s == DOPT_OK && i < d->np; i++) {
      m->params[i].step = d->p[i].step;
      m->params[i].has_state = d->p[i].step > 0;
    }
    if (s == DOPT_OK) {
      m->optimizer_steps = d->gstep;
      m->eval_mode = d->eval;
      m->world.plugin = d->ep.size > 1 ? "moe_hybrid" : d->zero == 3 ? "fsdp" : "hybrid";
      m->world.tp = d->tp.size;
      m->world.dp = d->dp.size;
      m->world.zero = d->zero;
      s = dopt_ckpt_commit(ckpt_dir, tmp, m);
    }
    dopt_ckpt_meta_free(m);
    if (s != DOPT_OK) s = discard(0, tmp, s); /* a full disk at the index: nothing of the save is left */
  }
  return agree(d, s, "commit");
}

/* The checkpoint's `tensor` holds elements of dtype dt (an I32 tensor where an F32 state belongs has the same
 * bytes: read as floats, it would load silently). */
static dopt_status check_dtype(dopt_ckpt_reader *r, const char *tensor, dopt_dtype dt) {
  dopt_ckpt_tensor_info x;
  DOPT_TRY(dopt_ckpt_find(r, tensor, &x));
  if (x.dtype != dt)
    return dopt__fail(DOPT_ERR_SHAPE, "%s: tensor '%s': expected %s, the checkpoint has %s", dopt_ckpt_path(r), tensor,
                      dopt_dtype_name(dt), dopt_dtype_name(x.dtype));
  return DOPT_OK;
}

/* Reads the piece pc of `tensor` into device x (dtype dt), through host scratch. */
static dopt_status get_piece(dopt_dist_optim *d, dopt_ckpt_reader *r, const char *tensor, dopt_dtype dt,
                             const dopt_piece *pc, void *x) {
  DOPT_TRY(check_dtype(r, tensor, dt));
  const size_t bytes = pc->len * dopt_dtype_size(dt);
  if (bytes == 0) return DOPT_OK;
  unsigned char *h = NULL;
  DOPT_TRY(dd_ghost(d, 0, bytes, &h));
  DOPT_TRY(dopt_ckpt_get(r, tensor, pc, h));
  return DEV(d)->upload(DCTX(d), x, h, bytes);
}

/* The values of a blockwise F32 state at this rank's blocks (p->blk) into device x: the range of the
 * logical [nb] from its first block to its last, read at once, then picked. */
static dopt_status get_blocks(dopt_dist_optim *d, dopt_ckpt_reader *r, const char *tensor, const dist_param *p,
                              void *x) {
  DOPT_TRY(check_dtype(r, tensor, DOPT_F32));
  if (p->nblk == 0) return DOPT_OK;
  const size_t b0 = p->blk[0], span = p->blk[p->nblk - 1] - b0 + 1;
  const int64_t nb = (int64_t)((dopt_numel(p->ndim, p->shape) + p->qblock - 1) / p->qblock);
  dopt_piece pc;
  dopt_piece_full(1, &nb, &pc);
  pc.lo = b0;
  pc.len = span;
  float *h = malloc(span * sizeof *h);
  if (!h) return dopt__fail(DOPT_ERR_NO_MEMORY, "dopt_dist_load: '%s': %zu blocks", tensor, span);
  dopt_status s = dopt_ckpt_get(r, tensor, &pc, h);
  for (size_t t = 0; s == DOPT_OK && t < p->nblk; t++) h[t] = h[p->blk[t] - b0]; /* ascending: t <= blk[t] - b0 */
  if (s == DOPT_OK) s = DEV(d)->upload(DCTX(d), x, h, p->nblk * sizeof *h);
  free(h);
  return s;
}

static dopt_status read_pieces(dopt_dist_optim *d, dopt_ckpt_reader *r, const dopt_ckpt_meta *m) {
  char name[512];
  for (int i = 0; i < d->np; i++) {
    dist_param *p = &d->p[i];
    dopt_piece pc;
    dd_held_piece(p, p->master_sharded, &pc);
    DOPT_TRY(get_piece(d, r, p->name, DOPT_F32, &pc, p->master));
    if (p->bf16) {
      dd_held_piece(p, d->zero == 3, &pc);
      snprintf(name, sizeof name, "%s/bf16", p->name);
      DOPT_TRY(get_piece(d, r, name, DOPT_BF16, &pc, p->work));
    }
    if (p->owned && p->full) { /* the owner's logical values of its units */
      dopt_piece whole;
      dopt_piece_full(p->ndim, p->shape, &whole);
      DOPT_TRY(get_piece(d, r, p->name, DOPT_F32, owned_piece(p, &whole), p->full));
    }
    p->step = m->params[i].step;
    for (int k = 0; k < p->nstates; k++) {
      if (!p->state[k]) continue; /* owner mode: not the owner */
      const dopt_state_view *v = &p->spec[k].v;
      DOPT_TRY(dd_zero_dev(d, p->state[k], dd_state_held_bytes(p, k))); /* ZeRO padding, states never allocated */
      if (!m->params[i].has_state) continue;
      snprintf(name, sizeof name, "%s/%s", p->name, v->name);
      dopt_piece whole;
      dopt_piece_full(v->ndim, v->shape, &whole);
      if (!p->owned && p->spec[k].kind == DOPT_STATE_BLOCKWISE) {
        DOPT_TRY(get_blocks(d, r, name, p, p->state[k]));
        continue;
      }
      const int sliced = !p->owned && p->spec[k].kind == DOPT_STATE_ELEMENTWISE;
      if (sliced) dd_held_piece(p, d->zero >= 1, &pc);
      DOPT_TRY(get_piece(d, r, name, v->dtype, sliced ? &pc : p->owned ? owned_piece(p, &whole) : &whole, p->state[k]));
    }
    p->acc = 0;
    p->nmb = 0;
  }
  d->gstep = m->optimizer_steps;
  d->eval = m->eval_mode && d->impl->swap; /* the weights loaded are that mode's point */
  d->skipped = m->skipped_steps;
  d->micro = 0;
  memset(d->has, 0, (size_t)d->np);
  return DOPT_OK;
}

dopt_status dopt_dist_load(dopt_dist_optim *d, const dopt_optim *plain, const char *path) {
  DOPT_CHECK_ARG(d && plain && path, "dopt_dist_load: NULL argument");
  if (d->batch) return dopt__fail(DOPT_ERR_STATE, "dopt_dist_load: inside dopt_dist_gather_begin/end (call end first)");
  dopt_ckpt_reader *r = NULL;
  dopt_ckpt_meta *live = NULL;
  const dopt_ckpt_meta *saved = NULL;
  /* every rank opens, checks the metadata against this optimizer and verifies every piece's
   * checksum before anything is loaded; then all agree */
  dopt_status s = dopt_ckpt_open(path, &r);
  if (s == DOPT_OK) s = dopt_ckpt_read_meta(r, &saved);
  if (s == DOPT_OK) s = dopt_ckpt_meta_from_optim(plain, NULL, &live);
  if (s == DOPT_OK) s = dopt_ckpt_meta_check(saved, live, dopt_ckpt_path(r));
  if (s == DOPT_OK && saved->nparams != d->np)
    s = dopt__fail(DOPT_ERR_SHAPE, "%s: %d parameters, this optimizer %d", dopt_ckpt_path(r), saved->nparams, d->np);
  if (s == DOPT_OK) s = dopt_ckpt_verify(r);
  dopt_ckpt_meta_free(live);
  s = agree(d, s, "load");
  if (s == DOPT_OK) s = read_pieces(d, r, saved);
  dopt_ckpt_close(r);
  return agree(d, s, "load");
}
