/* The step (docs/distributed.md): gradients in (accumulated micro-batches),
 * averaged over dp, the non-finite skip, global-norm clipping, the wrapper's
 * schedule (LISA), the staged step of every piece in rounds and buckets, and
 * the new values back to every rank that holds them. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "dist_internal.h"

dopt_status dopt_dist_backward(dopt_dist_optim *d, const float *const *grads) {
  DOPT_CHECK_ARG(d && grads, "dopt_dist_backward: NULL argument");
  for (int i = 0; i < d->np; i++) {
    dist_param *p = &d->p[i];
    if (!grads[i] || !dd_present(d, p)) continue; /* no gradient in this micro-batch (torch: .grad untouched), or
                                                   * another stage's parameter (its gradient is that stage's) */
    d->has[i] = 1;
    if (p->lnumel == 0) continue;
    if (d->keep) { /* kept whole until the step (grown by doubling, copied over) */
      if (p->nmb == p->mb_cap) {
        int cap = p->mb_cap ? 2 * p->mb_cap : 4;
        float *nb = NULL;
        DOPT_TRY(dd_dalloc(d, (size_t)cap * p->lnumel * sizeof(float), (void **)&nb));
        dopt_status s = p->nmb ? DEV(d)->copy(DCTX(d), nb, p->mb, (size_t)p->nmb * p->lnumel * sizeof(float)) : DOPT_OK;
        if (s != DOPT_OK) {
          DEV(d)->free(DCTX(d), nb);
          return s;
        }
        if (p->mb) DEV(d)->free(DCTX(d), p->mb);
        p->mb = nb;
        p->mb_cap = cap;
      }
      DOPT_TRY(DEV(d)->upload(DCTX(d), p->mb + (size_t)p->nmb * p->lnumel, grads[i], p->lnumel * sizeof(float)));
      p->nmb++;
      continue;
    }
    if (!p->acc) { /* the first gradient since the step is copied: acc = g0, then acc + g1 + ... */
      if (grads[i] != p->grad) /* else written in place (dopt_dist_grad_buffer) */
        DOPT_TRY(DEV(d)->upload(DCTX(d), p->grad, grads[i], p->lnumel * sizeof(float)));
      p->acc = 1;
      continue;
    }
    DOPT_TRY(dd_grow_dev(d, (void **)&d->up, &d->up_cap, p->lnumel * sizeof(float))); /* the largest TP-local tensor */
    DOPT_TRY(DEV(d)->upload(DCTX(d), d->up, grads[i], p->lnumel * sizeof(float)));
    DOPT_TRY(DEV(d)->add(DCTX(d), p->grad, d->up, p->lnumel));
  }
  d->micro++;
  return DOPT_OK;
}

dopt_status dopt_dist_grad_buffer(dopt_dist_optim *d, int param, float **out) {
  DOPT_CHECK_ARG(d && out, "dopt_dist_grad_buffer: NULL argument");
  DOPT_CHECK_ARG(param >= 0 && param < d->np, "dopt_dist_grad_buffer: param=%d out of range [0,%d)", param, d->np);
  const dist_param *p = &d->p[param];
  *out = !d->keep && !p->acc && p->lnumel && DEV(d)->host_chunk && dd_present(d, p) ? p->grad : NULL;
  return DOPT_OK;
}

/* An ep-split stack's gradient counts for this rank's own experts only: the other ep ranks' slices of the
 * accumulator (and of each kept micro-batch) are zeroed before the dp sum (no tokens reached them here). */
static dopt_status own_experts_only(dopt_dist_optim *d, dist_param *p) {
  size_t x0, x1;
  dd_ep_range(d, p, d->tp.rank, d->ep.rank, &x0, &x1);
  for (int m = -1; m < p->nmb; m++) {
    float *g = m < 0 ? p->grad : p->mb + (size_t)m * p->lnumel;
    DOPT_TRY(dd_zero_dev(d, g, x0 * sizeof(float)));
    DOPT_TRY(dd_zero_dev(d, g + x1, (p->lnumel - x1) * sizeof(float)));
  }
  return DOPT_OK;
}

/* The averaged gradient of each piece: the SUM over its dp group (dp; an
 * expert's moe_dp: exact, or fp32 in the transport's order), then one
 * division by that group's size · micro; *nonfinite counts
 * the non-finite averaged elements of this rank's pieces (p->gpc: owner
 * mode, the whole TP block on the owner's dp row). */
static dopt_status reduce_grads(dopt_dist_optim *d, int64_t *nonfinite) {
  *nonfinite = 0;
  for (int i = 0; i < d->np; i++) {
    dist_param *p = &d->p[i];
    if (!p->acc) DOPT_TRY(dd_zero_dev(d, p->grad, p->lnumel * sizeof(float))); /* no gradient on this rank: it adds zeros (DDP's unused parameters) */
    p->acc = 0, p->avgd = 0, p->avg_bad = 0;
    if (dd_ep_stack(d, p)) DOPT_TRY(own_experts_only(d, p));
  }
  /* a bucket of one contribution (dp 1 batch invariant with one micro-batch, an expert alone in its moe_dp) is
   * that contribution itself (dd_exact_dp_sum, dopt_dp_sum's rule) */
  if ((d->dp.size > 1 || d->keep) && d->dp_words > 0) DOPT_TRY(dd_exact_dp_sum(d));
  for (int i = 0; i < d->np; i++) d->p[i].nmb = 0;
  for (int i = 0; i < d->np; i++) {
    dist_param *p = &d->p[i];
    const dopt_transport *g = dd_dpg(d, p);
    if (g->size > 1 && d->dp_words == 0) DOPT_TRY(dd_dp_sum(d, p, p->grad, 1, DOPT_F32));
    int64_t bad = p->avg_bad;
    if (!p->avgd) DOPT_TRY(DEV(d)->average(DCTX(d), p->grad + p->gpc.lo, dd_avg_denom(d, p), p->gpc.len, &bad));
    *nonfinite += bad;
  }
  return DOPT_OK;
}

/* One MAX over the stage (tp, then dp) of {non-finite count, has[0..np)}:
 * whether any rank saw a non-finite averaged gradient, and which parameters
 * received a gradient on some rank (a rank without one added zeros); the
 * non-finite count then over pp (the skip is the whole model's). A parameter
 * another stage or ep rank holds is skipped here (its holders step it). */
static dopt_status world_flags(dopt_dist_optim *d, int64_t *bad) {
  const size_t n = (size_t)d->np + 1;
  int64_t *h = malloc(n * sizeof *h);
  if (!h) return dopt__fail(DOPT_ERR_NO_MEMORY, "distributed step: %d flags", d->np);
  h[0] = *bad;
  for (int i = 0; i < d->np; i++) h[1 + i] = d->has[i];
  dopt_status s = dd_reduce_i64(d, h, n, DOPT_MAX, 0);
  if (s == DOPT_OK && d->pp.size > 1) s = dd_reduce_i64(d, h, 1, DOPT_MAX, 1);
  if (s == DOPT_OK) {
    *bad = h[0];
    for (int i = 0; i < d->np; i++) d->skip[i] = h[1 + i] == 0 || !dd_present(d, &d->p[i]); /* held elsewhere */
  }
  free(h);
  return s;
}

/* The wrapper's schedule (LISA) for this step: frozen parameters are skipped
 * like absent ones; a reset restarts every layer parameter from zero states
 * and step 0. The same on every rank, with no communication. */
static dopt_status apply_schedule(dopt_dist_optim *d) {
  int reset = 0;
  DOPT_TRY(d->wrapper->wrap->schedule(d->whp, d->gstep, d->np, d->layer, d->frozen, &reset));
  for (int i = 0; i < d->np; i++) {
    dist_param *p = &d->p[i];
    d->skip[i] |= d->frozen[i];
    p->cnt_last[DOPT_COUNTER_FROZEN] = d->frozen[i] != 0 && dd_present(d, p);
    if (!reset || d->layer[i] < 0 || !dd_present(d, p)) continue;
    p->cnt_last[DOPT_COUNTER_RESETS] = 1;
    p->step = 0;
    for (int k = 0; k < p->nstates; k++) {
      if (!p->state[k]) continue; /* owner mode: not the owner */
      DOPT_TRY(dd_zero_dev(d, p->state[k], dd_state_held_bytes(p, k)));
    }
  }
  return DOPT_OK;
}

/* Whether d->args[i] runs in this round of steps: honour_skip (the step itself), not a parameter skipped this
 * step (d->skip) or one in owner mode (stepped whole by owner.c); the clipping statistic runs on every one. */
static int runs(const dopt_dist_optim *d, int i, int honour_skip) {
  return !(honour_skip && (d->skip[i] || d->p[i].owned));
}

/* Runs the staged steps d->args[first, last) round by round: each round runs
 * every unfinished step's next stage, then reduces what the round posted (one
 * collective per transport and operation). Frames: d->frames at d->frame_off.
 * honour_skip: parameters skipped this step (d->skip) do not run. */
static dopt_status run_rounds(dopt_dist_optim *d, int first, int last, int honour_skip) {
  int active = 0;
  for (int i = first; i < last; i++) active += d->more[i] = runs(d, i, honour_skip);
  for (int stage = 0; active > 0; stage++) {
    for (int i = first; i < last; i++) {
      if (!d->more[i]) continue;
      dopt_step_args *a = &d->args[i];
      a->stage = stage;
      a->more = &d->more[i];
      d->more[i] = 0;
      a->frame = d->frames ? (unsigned char *)d->frames + d->frame_off[i] : NULL; /* NULL + 0 is undefined */
      DOPT_TRY(DEV(d)->step(DCTX(d), a));
      if (!d->more[i]) active--;
    }
    DOPT_TRY(dd_flush(d));
  }
  return DOPT_OK;
}

/* Lays out the frames of d->args[first, last) in d->frames (grown as needed). */
static dopt_status map_frames(dopt_dist_optim *d, int first, int last, int honour_skip) {
  size_t total = 0;
  for (int i = first; i < last; i++) {
    d->frame_off[i] = total;
    if (d->p[i].owned && honour_skip) continue; /* not run here: no frame (its arguments are not set) */
    total += (DEV(d)->frame_bytes(DCTX(d), &d->args[i]) + 15) & ~(size_t)15;
  }
  return dd_grow_dev(d, &d->frames, &d->frames_cap, total);
}

/* Steps d->args[0, np) in buckets: consecutive parameters whose frame
 * estimates (rank-independent) fit in d->bucket_bytes share their
 * collectives; a parameter larger than the budget is a bucket of its own. */
static dopt_status run_buckets(dopt_dist_optim *d) {
  int first = 0;
  while (first < d->np) {
    int last = first + 1;
    size_t est = d->p[first].est;
    while (last < d->np && (d->bucket_bytes == 0 || est + d->p[last].est <= d->bucket_bytes)) est += d->p[last++].est;
    DOPT_TRY(map_frames(d, first, last, 1));
    DOPT_TRY(run_rounds(d, first, last, 1));
    first = last;
  }
  return DOPT_OK;
}

/* The model weights a parameter all-gathers at zero 1/2 (its bf16 working copy, or its fp32 values), the
 * padded buffer and the bytes per element. */
static unsigned char *weights_of(const dist_param *p, size_t *es) {
  *es = p->bf16 ? sizeof(uint16_t) : sizeof(float);
  return p->bf16 ? (unsigned char *)p->work : (unsigned char *)p->master;
}

/* Zero 1/2: every rank of a parameter's dp group gets the whole TP-local model weights of the parameters
 * stepped piecewise back, in buckets (dd_bucket_end: dense and expert parameters apart): one all_gather of bytes
 * per bucket over its group, each rank's shards packed by parameter (a bucket of one parameter: in place). */
static int gathers(const dopt_dist_optim *d, int i) {
  return !d->skip[i] && !d->p[i].owned && !dd_ep_stack(d, &d->p[i]); /* a stack's exact ranges: gather_exact */
}

/* An ep-split stack's new weights from every dp rank's exact range (dd_shard) to every dp rank: one all_to_allv
 * of bytes over dp (this rank's range sent from a copy: no transport sees one buffer as both ends). */
static dopt_status gather_exact(dopt_dist_optim *d, dist_param *p) {
  const size_t D = (size_t)d->dp.size, me = (size_t)d->dp.rank;
  size_t *sc = d->xc, *sd = sc + d->xn, *rc = sd + d->xn, *rd = rc + d->xn, es, lo, len;
  unsigned char *w = weights_of(p, &es);
  DOPT_TRY(dd_grow_dev(d, (void **)&d->pack, &d->pack_cap, (p->pc.len ? p->pc.len : 1) * es));
  if (p->pc.len) DOPT_TRY(DEV(d)->copy(DCTX(d), d->pack, w + p->pc.lo * es, p->pc.len * es));
  for (size_t q = 0; q < D; q++) {
    dd_shard(d, p, d->tp.rank, q, &lo, &len);
    sc[q] = q == me ? 0 : p->pc.len * es, sd[q] = 0;
    rc[q] = q == me ? 0 : len * es, rd[q] = lo * es;
  }
  return d->dp.ops->all_to_allv(d->dp.comm, d->pack, sc, sd, w, rc, rd, DOPT_U8);
}

/* The all-gather reads the other ranks' shards where they lie (all_gather_view, the simulator's threads) where the
 * device's buffers are host memory; views [xn] hold a group's size. */
static int by_ref(const dopt_dist_optim *d, const dopt_transport *g) {
  return g->ops->all_gather_view && g->ops->view_release && DEV(d)->host_chunk && (size_t)g->size <= d->xn;
}

/* gather_weights for a bucket [b0, b1) of n > 1 gathered parameters over g, by reference in one call
 * (all_gather_view_n): gather b sends the b-th parameter's own shard from where it lies in its weights; every other
 * rank's shard is copied into place from its view. */
static dopt_status gather_weights_n(dopt_dist_optim *d, const dopt_transport *g, int b0, int b1, int n) {
  const size_t D = (size_t)g->size, me = (size_t)g->rank;
  DOPT_TRY(dd_grow_views(d, (size_t)n, D));
  size_t *cnt = d->ncnt, es, b = 0;
  for (int i = b0; i < b1; i++) {
    if (!gathers(d, i)) continue;
    unsigned char *w = weights_of(&d->p[i], &es);
    d->nsends[b] = w + me * d->p[i].chunk * es, cnt[b] = d->p[i].chunk * es;
    b++;
  }
  DOPT_TRY(g->ops->all_gather_view_n(g->comm, n, d->nsends, cnt, d->nviews, DOPT_U8));
  b = 0;
  for (int i = b0; i < b1; i++) { /* rank q's shard into place: at q · chunk of each parameter's weights */
    const dist_param *p = &d->p[i];
    if (!gathers(d, i)) continue;
    unsigned char *w = weights_of(p, &es);
    for (size_t q = 0; q < D; q++)
      if (q != me && p->chunk) DOPT_TRY(DEV(d)->copy(DCTX(d), w + q * p->chunk * es, d->nviews[b * D + q], p->chunk * es));
    b++;
  }
  return g->ops->view_release(g->comm);
}

static dopt_status gather_weights(dopt_dist_optim *d) {
  for (int i = 0; i < d->np; i++)
    if (dd_ep_stack(d, &d->p[i]) && !d->skip[i] && !d->p[i].owned && d->dp.size > 1)
      DOPT_TRY(gather_exact(d, &d->p[i]));
  for (int b0 = 0; b0 < d->np;) {
    const int b1 = dd_bucket_end(d, b0, gathers);
    const dopt_transport *g = dd_dpg(d, &d->p[b0]);
    const size_t D = (size_t)g->size, me = (size_t)g->rank;
    if (D == 1) {
      b0 = b1;
      continue;
    }
    int n = 0, last = -1;
    size_t T = 0, es;
    for (int i = b0; i < b1; i++)
      if (gathers(d, i)) n++, last = i, (void)weights_of(&d->p[i], &es), T += d->p[i].chunk * es;
    const int view = by_ref(d, g); /* the other ranks' shards read where they lie: no receive buffer */
    if (n > 1 && view && g->ops->all_gather_view_n) { /* and no pack: each parameter's shard where it lies */
      DOPT_TRY(gather_weights_n(d, g, b0, b1, n));
      b0 = b1;
      continue;
    }
    if (n == 1 && !view) { /* in place */
      unsigned char *w = weights_of(&d->p[last], &es);
      DOPT_TRY(g->ops->all_gather(g->comm, w + me * d->p[last].chunk * es, w, d->p[last].chunk * es, DOPT_U8));
    } else if (n >= 1) {
      /* sent: one parameter's shard where it lies in its weights (read by reference), else the shards packed */
      unsigned char *send = NULL, *all = NULL;
      size_t at = 0;
      if (n == 1) {
        send = weights_of(&d->p[last], &es) + me * d->p[last].chunk * es;
      } else {
        DOPT_TRY(dd_grow_dev(d, (void **)&d->pack, &d->pack_cap, T));
        send = (unsigned char *)d->pack;
        for (int i = b0; i < b1; i++) {
          const dist_param *p = &d->p[i];
          if (!gathers(d, i)) continue;
          unsigned char *w = weights_of(p, &es);
          DOPT_TRY(DEV(d)->copy(DCTX(d), send + at, w + me * p->chunk * es, p->chunk * es));
          at += p->chunk * es;
        }
      }
      if (view) {
        DOPT_TRY(g->ops->all_gather_view(g->comm, send, d->views, T, DOPT_U8));
      } else {
        DOPT_TRY(dd_grow_dev(d, (void **)&d->parts, &d->parts_cap, D * T));
        all = (unsigned char *)d->parts;
        DOPT_TRY(g->ops->all_gather(g->comm, send, all, T, DOPT_U8));
      }
      at = 0;
      for (int i = b0; i < b1; i++) { /* rank q's shards into place: at q · chunk of each parameter's weights */
        const dist_param *p = &d->p[i];
        if (!gathers(d, i)) continue;
        unsigned char *w = weights_of(p, &es);
        for (size_t q = 0; q < D; q++)
          if (q != me && p->chunk)
            DOPT_TRY(DEV(d)->copy(DCTX(d), w + q * p->chunk * es,
                                  view ? (const unsigned char *)d->views[q] + at : all + q * T + at, p->chunk * es));
        at += p->chunk * es;
      }
      if (view) DOPT_TRY(g->ops->view_release(g->comm));
    }
    b0 = b1;
  }
  return DOPT_OK;
}

/* Pipeline, MoE: every parameter's step count from its holders, so that every rank reports, checks and saves the
 * same counts (dopt_dist_get_step, checkpoints). */
static dopt_status stages_steps(dopt_dist_optim *d) {
  if ((d->pp.size == 1 && d->ep.size == 1) || d->np == 0) return DOPT_OK;
  int64_t *h = malloc((size_t)d->np * sizeof *h);
  if (!h) return dopt__fail(DOPT_ERR_NO_MEMORY, "distributed step: %d step counts", d->np);
  for (int i = 0; i < d->np; i++) h[i] = d->p[i].step;
  dopt_status s = dd_sum_over_homes(d, h, DOPT_I64);
  for (int i = 0; s == DOPT_OK && i < d->np; i++) d->p[i].step = h[i];
  free(h);
  return s;
}

/* Train/eval (dopt_optim_set_mode on the shards): every rank moves its piece of every parameter that has stepped,
 * master and elementwise states where they lie (the swap is elementwise: a piece needs nothing of the others),
 * rounds its working copy, and ZeRO 1/2 all-gather the new weights as after a step, so that every replica of
 * every element moved once. */
dopt_status dopt_dist_set_mode(dopt_dist_optim *d, int eval) {
  DOPT_CHECK_ARG(d != NULL, "dopt_dist_set_mode: optimizer=NULL");
  DOPT_CHECK_ARG(eval == 0 || eval == 1, "dopt_dist_set_mode: eval=%d (0 train, 1 evaluation)", eval);
  if (!d->impl->swap)
    return dopt__fail(DOPT_ERR_UNSUPPORTED, "dopt_dist_set_mode: optimizer '%s' has one point for training and "
                      "evaluation (no modes; adamw_schedulefree has two)", d->impl->name);
  if (!DEV(d)->host_chunk)
    return dopt__fail(DOPT_ERR_UNSUPPORTED, "dopt_dist_set_mode: '%s' on a device whose memory is not the host's",
                      d->impl->name);
  if (d->nowned)
    return dopt__fail(DOPT_ERR_UNSUPPORTED, "dopt_dist_set_mode: %d parameters step in owner mode", d->nowned);
  if (d->batch) return dopt__fail(DOPT_ERR_STATE, "dopt_dist_set_mode: inside dopt_dist_gather_begin/end");
  if (d->eval == eval) return DOPT_OK;
  for (int i = 0; i < d->np; i++) {
    dist_param *p = &d->p[i];
    if (p->step < 1 || p->pc.len == 0) continue; /* never stepped (upstream: no z), or nothing here */
    float *param = p->master + (p->master_sharded ? 0 : p->pc.lo);
    d->impl->swap(d->hp[p->group], eval, p->step, p->pc.len, param, p->state);
    p->cnt_total[DOPT_COUNTER_SWAPS]++; /* not a step's: the totals only (every piece alike) */
    if (p->bf16) DOPT_TRY(DEV(d)->to_bf16(DCTX(d), param, p->work + (d->zero == 3 ? 0 : p->pc.lo), p->pc.len));
  }
  if (d->zero == 1 || d->zero == 2) { /* every parameter's weights, as after a step where every one stepped */
    unsigned char *keep = malloc(d->np ? (size_t)d->np : 1);
    if (!keep) return dopt__fail(DOPT_ERR_NO_MEMORY, "dopt_dist_set_mode: %d flags", d->np);
    memcpy(keep, d->skip, (size_t)d->np);
    memset(d->skip, 0, (size_t)d->np);
    const dopt_status s = gather_weights(d);
    memcpy(d->skip, keep, (size_t)d->np);
    free(keep);
    DOPT_TRY(s);
  }
  d->eval = eval;
  return DOPT_OK;
}

int dopt_dist_get_mode(const dopt_dist_optim *d) { return d ? d->eval : 0; }

dopt_status dopt_dist_step(dopt_dist_optim *d, dopt_dist_step_info *info) {
  DOPT_CHECK_ARG(d != NULL, "dopt_dist_step: optimizer=NULL");
  if (d->eval)
    return dopt__fail(DOPT_ERR_STATE, "dopt_dist_step: optimizer '%s' is in evaluation mode (dopt_dist_set_mode(d, 0) "
                      "before stepping)", d->impl->name);
  if (d->micro == 0) return dopt__fail(DOPT_ERR_STATE, "dopt_dist_step: no gradients (call dopt_dist_backward first)");
  if (d->batch) return dopt__fail(DOPT_ERR_STATE, "dopt_dist_step: inside dopt_dist_gather_begin/end (call end first)");
  dopt_dist_step_info local = {0, -1.0, d->micro};
  int64_t bad;
  for (int i = 0; i < d->np; i++) memset(d->p[i].cnt_last, 0, sizeof d->p[i].cnt_last);
  DOPT_TRY(reduce_grads(d, &bad));
  DOPT_TRY(world_flags(d, &bad));
  memset(d->has, 0, (size_t)d->np);
  if (d->skip_nonfinite && bad > 0) {
    d->skipped++;
    local.skipped = 1;
    if (info) *info = local;
    d->micro = 0;
    return DOPT_OK;
  }
  if (d->wrapper) DOPT_TRY(apply_schedule(d));
  d->gstep++;
  if (d->max_grad_norm > 0) { /* every gradient piece's Σg² as a staged step, one bucket */
    for (int i = 0; i < d->np; i++) {
      dist_param *p = &d->p[i];
      d->args[i] = (dopt_step_args){.impl = &dopt__impl_sumsq,
                                    .piece = &p->gpc,
                                    .grad = p->grad + p->gpc.lo,
                                    .red = &p->red,
                                    .tensor = (uint64_t)i,
                                    .host_out = &d->ss[i]};
    }
    DOPT_TRY(map_frames(d, 0, d->np, 0));
    DOPT_TRY(run_rounds(d, 0, d->np, 0)); /* every gradient: an absent one is zeros */
    DOPT_TRY(dd_sum_over_homes(d, d->ss, DOPT_F64)); /* every parameter's Σg² from its holders */
    float coef = dopt_clip_coef(d->ss, d->np, d->max_grad_norm, &local.grad_norm);
    for (int i = 0; i < d->np; i++)
      DOPT_TRY(DEV(d)->scale(DCTX(d), d->p[i].grad + d->p[i].gpc.lo, coef, d->p[i].gpc.len));
  }
  for (int i = 0; i < d->np; i++) { /* the piecewise parameters (owner mode: below) */
    dist_param *p = &d->p[i];
    if (p->owned) continue;
    if (!d->skip[i]) p->step++, p->cnt_last[DOPT_COUNTER_STEPS] = 1;
    float *param = p->master + (p->master_sharded ? 0 : p->pc.lo);
    d->args[i] = (dopt_step_args){.impl = d->impl,
                                  .hp = d->hp[p->group],
                                  .step = p->step,
                                  .piece = &p->pc,
                                  .param = param,
                                  .grad = p->grad + p->pc.lo,
                                  .state = p->state,
                                  .red = &p->red,
                                  .counts = p->cnt_last,
                                  .tensor = (uint64_t)i,
                                  .shared = p->qblock ? &p->share : NULL,
                                  .ndim = p->ndim,
                                  .shape = p->shape};
  }
  DOPT_TRY(run_buckets(d));
  for (int i = 0; i < d->np; i++) {
    dist_param *p = &d->p[i];
    if (d->skip[i] || p->owned) continue; /* untouched: its values are still in place everywhere */
    float *param = p->master + (p->master_sharded ? 0 : p->pc.lo);
    if (p->bf16) DOPT_TRY(DEV(d)->to_bf16(DCTX(d), param, p->work + (d->zero == 3 ? 0 : p->pc.lo), p->pc.len));
  }
  if (d->zero == 1 || d->zero == 2) DOPT_TRY(gather_weights(d));
  /* owner mode: every rank receives its pieces' new values (no working-copy update, no all-gather) */
  if (d->nowned) DOPT_TRY(dd_owner_steps(d));
  DOPT_TRY(stages_steps(d));
  for (int i = 0; i < d->np; i++) dopt_counts_add(d->p[i].cnt_total, d->p[i].cnt_last);
  if (info) *info = local;
  d->micro = 0; /* the next backward overwrites the accumulators */
  return DOPT_OK;
}

int64_t dopt_dist_stat_collectives(const dopt_dist_optim *d) { return d ? d->b.collectives : 0; }

int64_t dopt_dist_skipped_steps(const dopt_dist_optim *d) { return d ? d->skipped : 0; }
