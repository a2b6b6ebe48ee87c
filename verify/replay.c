/* distopt verify, the replay and the verdict (verifier.h): the reference stepped with the recorded gradients
 * and compared after every step, and the first divergence or an earlier cause (hyperparameters, gradient
 * digests). */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "files.h"
#include "verifier.h"

/* ---- the replay ---------------------------------------------------------------------- */

/* Step t's gradients; 1 when some parameter has only a digest (the step cannot be replayed). */
static int assemble_grads(vctx *c, long t, int *digest_only) {
  *digest_only = 0;
  for (int p = 0; p < c->rd.ix.nparams; p++) {
    int present = 0;
    if (vr_reader_grad(&c->rd, p, t, c->grad[p], &present) != DOPT_OK) return cli_errorf(CMD, "%s", c->rd.err);
    if (present < 0) *digest_only = 1;
    c->gptr[p] = present > 0 ? c->grad[p] : NULL;
  }
  return CLI_OK;
}

/* The reference's state `key` of parameter p after step t: its elements (*n) and 1; 0 when the reference keeps
 * no such F32 state (*none: it keeps no state at all for p: it never stepped). */
static int ref_state(vctx *c, int p, long t, const char *key, const float **data, int64_t *n, int *none) {
  *none = 0;
  if (c->ref_path) {
    char name[VR_MAX_NAME + VR_MAX_KEY + 64];
    size_t numel = 0;
    snprintf(name, sizeof name, "state/%ld/%s/%s", t, c->rd.ix.params[p].name, key);
    const void *b = vr_reader_f32(&c->ref, 0, t, name, &numel);
    if (!b) return 0;
    if (numel > c->scratch_n) { /* a reference state larger than the largest parameter: its own buffer */
      float *s = realloc(c->scratch, numel * sizeof *s);
      unsigned char *m = realloc(c->mask, numel);
      if (s) c->scratch = s;
      if (m) c->mask = m;
      if (!s || !m) return 0;
      c->scratch_n = numel;
    }
    memcpy(c->scratch, b, numel * sizeof(float));
    *data = c->scratch;
    *n = (int64_t)numel;
    return 1;
  }
  int nst = dopt_optim_num_states(c->opt, p);
  *none = nst == 0;
  for (int k = 0; k < nst; k++) {
    dopt_state_view v;
    if (dopt_optim_state(c->opt, p, k, &v) == DOPT_OK && strcmp(v.name, key) == 0) {
      if (v.dtype != DOPT_F32) return 0;
      *n = 1;
      for (int d = 0; d < v.ndim; d++) *n *= v.shape[d];
      *data = v.data;
      return 1;
    }
  }
  return 0;
}

/* The reference's step count of parameter p after step t; 0 when it has none to compare (--reference: REF
 * records none). */
static int ref_step(vctx *c, int p, long t, double *out) {
  if (!c->ref_path) {
    int64_t v = 0;
    dopt_optim_get_step(c->opt, p, &v);
    *out = (double)v;
    return 1;
  }
  char name[VR_MAX_NAME + 64];
  snprintf(name, sizeof name, "state/%ld/%s/step", t, c->rd.ix.params[p].name);
  dopt_st_tensor x;
  if (vr_reader_seek(&c->ref, 0, t) != DOPT_OK || dopt_st_find(c->ref.f[0], name, &x) != DOPT_OK) return 0;
  *out = vf_scalar_value(&x);
  return 1;
}

/* The update allowance (verify_tol.update) after the reference's step: every rank's piece of a parameter whose
 * step counted the tolerance's counter (Muon's Newton-Schulz) grows by tol_update times the piece's largest
 * change in that step, max|ref - prev| (--stepwise: this step's alone; accumulated: summed over the steps, as
 * the differences of the updates add up). */
static void grow_allowance(vctx *c) {
  const vr_index *ix = &c->rd.ix;
  for (int r = 0; r < ix->world_size; r++)
    for (int i = 0; i < ix->ranks[r].npieces; i++) {
      const vr_piece *pc = &ix->ranks[r].pieces[i];
      vstat *s = &c->st[c->rt[r].keys[i].stat[0]];
      if (c->stepwise) s->allow = 0.0;
      if (!c->stepped_ns[pc->param]) continue;
      const float *rp = c->data[pc->param], *pp = c->prev[pc->param];
      if (pc->lp.block_dim >= 0) {
        vr_piece_get(pc, rp, c->gath);
        vr_piece_get(pc, pp, c->gath_prev);
        rp = c->gath, pp = c->gath_prev;
      } else {
        rp += pc->lp.lo, pp += pc->lp.lo;
      }
      double du = 0.0;
      for (int64_t k = 0; k < pc->lp.len; k++) {
        const double d = fabs((double)rp[k] - (double)pp[k]);
        if (d > du) du = d;
      }
      s->allow += c->tol_update * du;
    }
}

/* A parameter piece's bound at this step: the declared (or given) one plus its update allowance relative to
 * max|ref| (the comparison's), as the error is; keeps the worst error / bound for the report. */
static double param_bound(vstat *s, double tol, double maxref, double rel) {
  const double bound = tol + (s->allow > 0 && maxref > 0 ? s->allow / maxref : 0.0);
  if (bound > 0 && rel / bound > s->worst_frac) s->worst_frac = rel / bound;
  return bound;
}

static int compare_step(vctx *c, long t) {
  char key[VR_MAX_NAME + 128];
  if (c->ref_path && vr_reader_seek(&c->ref, 0, t) != DOPT_OK) return cli_errorf(CMD, "--reference: %s", c->ref.err);
  for (int r = 0; r < c->rd.ix.world_size; r++) {
    const vr_rank *rk = &c->rd.ix.ranks[r];
    const dopt_st_file *f = c->rd.f[r];
    for (int i = 0; i < rk->npieces; i++) {
      const vr_piece *pc = &rk->pieces[i];
      const vr_param *vp = &c->rd.ix.params[pc->param];
      const vpiece_keys *pk = &c->rt[r].keys[i];
      dopt_st_tensor rec;
      /* states first: they feed the parameter's update, so at the first divergent step the verdict
       * names the state where the computations parted (a wrong statistic), not its consequence */
      for (int j = 1; j <= pk->nkeys; j++) {
        vstat *s = &c->st[pk->stat[j]];
        snprintf(key, sizeof key, "state/%ld/%s/%s", t, vp->name, s->key);
        if (dopt_st_find(f, key, &rec) != DOPT_OK) continue;
        if (strcmp(s->key, "step") == 0) {
          double ref = 0, got = vf_scalar_value(&rec);
          if (!ref_step(c, pc->param, t, &ref)) {
            s->no_ref = 1;
            continue;
          }
          double d = fabs(got - ref);
          if (!(d <= s->max_abs)) s->max_abs = d;
          s->compared++;
          double rel = d == 0.0 ? 0.0 : (ref != 0.0 ? d / fabs(ref) : INFINITY);
          if (rel > s->max_rel) s->max_rel = rel;
          vf_add_point(c, s, t, rel);
          if (d != 0.0) {
            if (!s->first_beyond) s->first_beyond = t;
            if (!c->verdict_step) {
              c->verdict_step = t;
              c->verdict_stat = (int)(s - c->st);
              c->verdict_value = rel;
            }
          }
          continue;
        }
        const float *data = NULL;
        int64_t n = 0, lo, len;
        int none = 0;
        if (!ref_state(c, pc->param, t, s->key, &data, &n, &none)) {
          if (!none) { /* a key the reference does not keep: listed, not compared */
            s->no_ref = 1;
            continue;
          }
          /* torch has state, the reference none: the parameter never stepped here */
          s->compared++;
          s->max_abs = INFINITY;
          vf_record_result(c, pk->stat[j], t, INFINITY, vf_state_tol(c, s->key));
          continue;
        }
        int mapped;
        if (vf_state_range(c, pc, s->key, n, &lo, &len, &mapped)) {
          char el[96];
          dopt_layout_piece_text(&pc->lp, el, sizeof el);
          return cli_errorf(CMD, "%s: rank %d records state '%s' of '%s' for elements %s of the parameter but "
                                 "declares no range of the state (ranks[%d].pieces[].states)",
                            c->rd.index_path, r, s->key, vp->name, el, r);
        }
        if (mapped) { /* an elementwise state of a block: the piece's elements, gathered */
          vr_piece_get(pc, data, c->gath);
          data = c->gath, lo = 0;
        }
        if (lo + len > n && !mapped)
          return cli_errorf(CMD, "%s: rank %d, state '%s' of '%s': range [%lld, %lld) is outside the reference's %lld "
                                 "elements", c->rd.index_path, r, s->key, vp->name, (long long)lo, (long long)(lo + len),
                            (long long)n);
        if ((int64_t)rec.numel != len)
          return cli_errorf(CMD, "rank %d: tensor '%s' has %zu elements, expected %lld (the state range [%lld, %lld))",
                            r, key, rec.numel, (long long)len, (long long)lo, (long long)(lo + len));
        double rel = vf_compare_f32(s, rec.data, data + lo, (size_t)len, NULL);
        vf_record_result(c, pk->stat[j], t, rel, vf_state_tol(c, s->key));
      }
      snprintf(key, sizeof key, "param/%ld/%s", t, vp->name);
      if (dopt_st_find(f, key, &rec) == DOPT_OK) {
        vstat *s = &c->st[pk->stat[0]];
        const float *ref = vf_ref_param(c, pc->param, t);
        if (!ref)
          return cli_errorf(CMD, "--reference %s: no '%s' (the recording compares it)", c->ref.index_path, key);
        if (pc->lp.block_dim >= 0) { /* a block: its elements gathered */
          vr_piece_get(pc, ref, c->gath);
          ref = c->gath;
        }
        double maxref;
        double rel = vf_compare_f32(s, rec.data, pc->lp.block_dim >= 0 ? ref : ref + pc->lp.lo, (size_t)pc->lp.len,
                                    &maxref);
        vf_record_result(c, pk->stat[0], t, rel, param_bound(s, c->tol_param, maxref, rel));
      } else if (c->rd.ix.record_params && t % c->rd.ix.every == 0) {
        /* a recorded step without the parameter: a lost or wrong block would otherwise pass unchecked */
        return cli_errorf(CMD, "%s: rank %d's file for step %ld has no '%s' (record.params is true and every=%ld)",
                          c->rd.index_path, r, t, key, c->rd.ix.every);
      }
    }
  }
  return CLI_OK;
}

/* record.grad_agree: every rank that has a whole gradient of parameter p at step t recorded the SHA-256 of it
 * (grad_agree/<t>/<p>); those ranks hold copies of the same gradient (DDP replicas, ZeRO: the dp average), so
 * every digest must equal the lowest such rank's (a rank without one, a pipeline stage that does not hold p,
 * is not compared). The first difference, by step, parameter and rank, is a divergence. */
/* Rank r's and rank q's grad_agree digests of parameter p are of the same elements: schema <= 4, always (each
 * is of the whole gradient); schema 5, when both hold the same pieces of p in the same order, or neither holds
 * a piece of p other than the whole tensor (their digests are of the whole gradient). */
static int whole_piece(const vr_piece *pc) {
  int64_t n = 1;
  for (int k = 0; k < pc->ndim; k++) n *= pc->shape[k];
  return pc->lp.block_dim < 0 && pc->lp.lo == 0 && pc->lp.len == n;
}
static int same_form(const vr_index *ix, int p, int r, int q) {
  if (ix->schema_version < 5) return 1;
  const vr_rank *a = &ix->ranks[r], *b = &ix->ranks[q];
  int i = 0, j = 0, na = 0, nb = 0;
  for (int k = 0; k < a->npieces; k++) na += a->pieces[k].param == p && !whole_piece(&a->pieces[k]);
  for (int k = 0; k < b->npieces; k++) nb += b->pieces[k].param == p && !whole_piece(&b->pieces[k]);
  if (na != nb) return 0;
  for (int m = 0; m < na; m++, i++, j++) { /* the m-th non-whole piece of p on each side */
    while (a->pieces[i].param != p || whole_piece(&a->pieces[i])) i++;
    while (b->pieces[j].param != p || whole_piece(&b->pieces[j])) j++;
    const dopt_layout_piece *x = &a->pieces[i].lp, *y = &b->pieces[j].lp;
    if (x->block_dim != y->block_dim || x->block_lo != y->block_lo || x->block_len != y->block_len || x->lo != y->lo ||
        x->len != y->len)
      return 0;
  }
  return 1;
}

/* Each rank's form class of each parameter, once for the run (the layout does not change between steps):
 * c->agree_rep[p · world + r] is the lowest rank whose pieces of p are rank r's (same_form). */
static int agreement_forms(vctx *c) {
  const vr_index *ix = &c->rd.ix;
  const size_t W = (size_t)ix->world_size, n = (size_t)(ix->nparams > 0 ? ix->nparams : 1) * W;
  c->agree_rep = malloc((n + W) * sizeof *c->agree_rep);
  c->agree_dig = malloc(W * sizeof *c->agree_dig);
  if (!c->agree_rep || !c->agree_dig)
    return vf_lib_error(NULL, dopt__fail(DOPT_ERR_NO_MEMORY, "%s: gradient agreement of %d parameters x %zu ranks",
                                         c->rd.index_path, ix->nparams, W));
  c->agree_first = c->agree_rep + n;
  for (int p = 0; p < ix->nparams; p++)
    for (int r = 0; r < ix->world_size; r++) {
      int b = 0;
      while (b < r && !same_form(ix, p, r, b)) b++;
      c->agree_rep[(size_t)p * W + (size_t)r] = b;
    }
  return CLI_OK;
}

/* Step t's gradient digests: each rank's against the lowest rank of its form class that recorded one; the
 * first difference is the verdict's cause (vf_early_verdict). */
static int check_agreement(vctx *c, long t) {
  const vr_index *ix = &c->rd.ix;
  if (!ix->grad_agree || c->agree_step) return CLI_OK;
  if (!c->agree_rep && agreement_forms(c) != CLI_OK) return CLI_USAGE;
  c->agree_checked++;
  char key[VR_MAX_NAME + 64];
  const size_t W = (size_t)ix->world_size;
  for (int p = 0; p < ix->nparams; p++) {
    snprintf(key, sizeof key, "grad_agree/%ld/%s", t, ix->params[p].name);
    const int *rep = c->agree_rep + (size_t)p * W;
    for (size_t k = 0; k < W; k++) c->agree_dig[k] = NULL; /* by class: the first digest of the step, its rank */
    for (int r = 0; r < ix->world_size; r++) {
      const unsigned char *d = vr_reader_digest(&c->rd, r, t, key);
      if (!d) continue; /* no digest of p there (another pipeline stage's, or none this step) */
      const int k = rep[r];
      if (!c->agree_dig[k]) {
        c->agree_dig[k] = d, c->agree_first[k] = r;
        continue;
      }
      c->agree_compared++;
      if (memcmp(d, c->agree_dig[k], 32) != 0) {
        c->agree_step = t, c->agree_param = p, c->agree_rank = r, c->agree_base = c->agree_first[k];
        return CLI_OK;
      }
    }
  }
  return CLI_OK;
}


static void hp_value_text(double v, char *buf, size_t cap) {
  if (isnan(v)) snprintf(buf, cap, "unset");
  else snprintf(buf, cap, "%.9g", v);
}

int vf_early_verdict(const vctx *c, early *e) {
  const long hs = c->rd.ix.disagree.step, as = c->agree_step, vs = c->verdict_step, ts = c->tw_step;
  memset(e, 0, sizeof *e);
  if (c->cont_step) { /* the window's start: before any step it replays */
    e->kind = "resume", e->step = c->cont_step, e->rank = c->cont_rank, e->tensor = c->cont_tensor;
    snprintf(e->text, sizeof e->text, "DIVERGED at step %ld (the window's start, tensor %s, rank %d: %s)", e->step,
             e->tensor, e->rank, c->cont_why);
  } else if (hs && (!vs || hs <= vs) && (!as || hs <= as) && (!ts || hs <= ts)) {
    char a[40], b[40];
    hp_value_text(c->rd.ix.disagree.value, a, sizeof a);
    hp_value_text(c->rd.ix.disagree.rank0, b, sizeof b);
    e->kind = "hparams", e->step = hs, e->rank = c->rd.ix.disagree.rank, e->tensor = c->rd.ix.disagree.key;
    snprintf(e->text, sizeof e->text, "DIVERGED at step %ld (hyperparameters: rank %d's %s of group %d is %s, rank "
             "0's %s, which the replay uses)", hs, e->rank, e->tensor, c->rd.ix.disagree.group, a, b);
  } else if (as && (!vs || as <= vs) && (!ts || as <= ts)) {
    e->kind = "gradients", e->step = as, e->rank = c->agree_rank, e->tensor = c->rd.ix.params[c->agree_param].name;
    snprintf(e->text, sizeof e->text, "DIVERGED at step %ld (gradient of %s: rank %d differs from rank %d)", as,
             e->tensor, c->agree_rank, c->agree_base);
  } else if (ts && (!vs || ts <= vs)) { /* twin.c: gradient, norm/clip, step counter */
    e->kind = c->tw_kind, e->step = ts, e->rank = c->tw_rank, e->tensor = c->rd.ix.params[c->tw_param].name;
    snprintf(e->text, sizeof e->text, "DIVERGED at step %ld (%s)", ts, c->tw_why);
  }
  return e->kind != NULL;
}

/* --stepwise: the state after step t was recorded (parameters and states), so step t+1 can start from it. */
static int recorded_after(const vctx *c, long t) {
  return t == c->rd.ix.start_step || (c->rd.ix.record_params && c->rd.ix.record_states && t % c->rd.ix.every == 0);
}

static int replay_steps(vctx *c, cli_progress *pg);

int vf_replay(vctx *c) {
  cli_progress pg;
  cli_progress_init(&pg, c->quiet);
  const int rc = replay_steps(c, &pg);
  cli_progress_end(&pg);
  if (rc) return rc;
  long compared = 0;
  for (int i = 0; i < c->nst; i++) compared += c->st[i].compared;
  if (compared == 0)
    return cli_errorf(CMD, "%s: no recorded parameter or state (param/<t>/..., state/<t>/...) to compare", c->rd.index_path);
  if (c->twin_path && !c->tw_step && c->tw_grad_compared == 0) /* a twin's check that compared nothing is no pass */
    return cli_errorf(CMD, "--twin %s: no step had a gradient on both sides to compare", c->twin.index_path);
  return CLI_OK;
}

/* vf_replay's steps, each announced on the progress line. */
static int replay_steps(vctx *c, cli_progress *pg) {
  const vr_index *ix = &c->rd.ix;
  long ch = 0;
  int synced = 1; /* --stepwise: the reference's state is the recorded run's (0 after a skipped step) */
  for (long t = ix->start_step + 1; t <= ix->steps; t++) {
    int rc;
    /* --stepwise: from the state recorded after step t-1 (read before moving to step t's block) */
    if (c->stepwise && !c->ref_path && t - 1 > ix->start_step && recorded_after(c, t - 1)) {
      if ((rc = vf_force_states(c, t - 1, 0))) return rc;
      synced = 1;
    }
    for (int r = 0; r < ix->world_size; r++)
      if ((rc = vf_file_for_step(c, r, t))) return rc;
    if ((rc = check_agreement(c, t))) return rc;
    for (; !c->ref_path && ch < ix->nchanges && ix->changes[ch].step == t; ch++) {
      const vr_change *h = &ix->changes[ch];
      dopt_status s = dopt_optim_set_hparam(c->opt, h->group, h->key, h->value);
      if (s != DOPT_OK) {
        char what[4400];
        snprintf(what, sizeof what, "%s: hparam_changes[%ld] (step %ld)", c->rd.index_path, ch, t);
        return vf_lib_error(what, s);
      }
    }
    if (!c->ref_path) {
      int digest_only = 0;
      if ((rc = assemble_grads(c, t, &digest_only))) return rc;
      if (digest_only && !c->stepwise)
        return cli_errorf(CMD, "%s: step %ld keeps only gradient digests: the accumulated replay needs every step's "
                               "gradient (--stepwise replays the steps whose gradients are kept)", c->rd.index_path, t);
      if (!digest_only && (rc = vf_twin_step(c, t))) return rc;
      if (c->stepwise) {
        if (digest_only || !synced) { /* not replayed: the next step starts from its recorded state again */
          c->not_replayed++;
          synced = 0;
          continue;
        }
      }
      for (int p = 0; c->prev && p < ix->nparams; p++) /* the update allowance: the parameters before */
        memcpy(c->prev[p], c->data[p], (size_t)ix->params[p].numel * sizeof(float));
      dopt_status s = dopt_optim_step(c->opt, c->gptr);
      if (c->hook_err[0]) return cli_errorf(CMD, "%s", c->hook_err);
      if (s != DOPT_OK) {
        char what[64];
        snprintf(what, sizeof what, "step %ld: the reference step failed", t);
        return vf_lib_error(what, s);
      }
      for (int p = 0; c->stepped_ns && p < ix->nparams; p++) {
        dopt_counters k = DOPT_COUNTERS_INIT;
        c->stepped_ns[p] = dopt_optim_counters(c->opt, p, &k) == DOPT_OK && k.last[c->update_counter] > 0;
      }
      if (c->prev) grow_allowance(c);
      if (ix->projectors && (rc = vf_check_refreshes(c, t))) return rc;
      if ((rc = vf_adopt_bases(c, t))) return rc;
    }
    long before = 0;
    for (int i = 0; i < c->nst; i++) before += c->st[i].compared;
    if ((rc = compare_step(c, t))) return rc;
    long after = 0;
    for (int i = 0; i < c->nst; i++) after += c->st[i].compared;
    if (after > before) c->compared_steps++;
    cli_progress_step(pg, "verify", t - ix->start_step, ix->steps - ix->start_step, NULL);
  }
  return CLI_OK;
}
