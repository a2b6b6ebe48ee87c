/* Checkpoints of an optimizer: its metadata (groups, hyperparameters,
 * parameters, step counts) and the check of a checkpoint's metadata against
 * it; single-device save and load (dopt_optim_save, dopt_optim_load). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt_internal.h"
#include "index.h"

/* ---- metadata of an optimizer -------------------------------------------------------------- */

void dopt_ckpt_meta_free(dopt_ckpt_meta *m) {
  if (!m) return;
  meta_box *b = (meta_box *)(void *)m;
  ck_ar_free(&b->ar);
  free(b);
}

static void hparams_of(const dopt_optim_impl *im, const double *hp, dopt_ckpt_hparam *out) {
  for (int k = 0; k < im->nhp; k++) {
    const dopt_hp_def *d = &im->hp[k];
    dopt_ckpt_hparam *h = &out[k];
    h->key = d->key;
    h->value = hp[k];
    h->choice = NULL;
    h->is_default = hp[k] == d->def || (isnan(hp[k]) && isnan(d->def));
    if (d->kind == DOPT_HP_BOOL) h->kind = DOPT_CKPT_HP_BOOL;
    else if (d->kind == DOPT_HP_OPT && isnan(hp[k])) h->kind = DOPT_CKPT_HP_NONE;
    else if (d->kind == DOPT_HP_ENUM) {
      h->kind = DOPT_CKPT_HP_CHOICE;
      h->choice = d->choices[(int)hp[k]];
    } else h->kind = DOPT_CKPT_HP_NUMBER;
  }
}

dopt_status dopt_ckpt_meta_from_optim(const dopt_optim *o, const dopt_ckpt_info *extra, dopt_ckpt_meta **out) {
  DOPT_CHECK_ARG(o && out, "dopt_ckpt_meta_from_optim: NULL argument");
  *out = NULL;
  DOPT_CHECK_ARG(!extra || (extra->struct_size >= sizeof(dopt_ckpt_info) && extra->version == DOPT_CKPT_INFO_VERSION),
                 "dopt_ckpt_meta_from_optim: info struct_size=%u version=%u (initialise with DOPT_CKPT_INFO_INIT)",
                 extra ? extra->struct_size : 0u, extra ? extra->version : 0u);
  DOPT_CHECK_ARG(!extra || extra->skipped_steps >= 0, "dopt_ckpt_meta_from_optim: skipped_steps=%lld",
                 extra ? (long long)extra->skipped_steps : 0LL);
  meta_box *b = calloc(1, sizeof *b);
  if (!b) return dopt__fail(DOPT_ERR_NO_MEMORY, "dopt_ckpt_meta_from_optim: %zu bytes", sizeof *b);
  dopt_ckpt_meta *m = &b->m;
  *m = (dopt_ckpt_meta)DOPT_CKPT_META_INIT;
  const dopt_optim_impl *im = dopt__optim_impl(o), *wr = dopt__optim_wrapper(o);
  m->optimizer = im->name;
  m->ngroups = dopt_optim_num_groups(o);
  m->nparams = dopt_optim_num_params(o);
  m->groups = ck_ar_alloc(&b->ar, (size_t)(m->ngroups ? m->ngroups : 1) * sizeof *m->groups);
  m->params = ck_ar_alloc(&b->ar, (size_t)(m->nparams ? m->nparams : 1) * sizeof *m->params);
  int ok = m->groups && m->params;
  for (int g = 0; ok && g < m->ngroups; g++) {
    m->groups[g].nhparams = im->nhp;
    ok = (m->groups[g].hparams = ck_ar_alloc(&b->ar, (size_t)im->nhp * sizeof(dopt_ckpt_hparam))) != NULL;
    if (ok) hparams_of(im, dopt__optim_group_hp(o, g), m->groups[g].hparams);
  }
  if (ok && wr) {
    m->wrapper = wr->name;
    m->nwrapper_hparams = wr->nhp;
    ok = (m->wrapper_hparams = ck_ar_alloc(&b->ar, (size_t)wr->nhp * sizeof(dopt_ckpt_hparam))) != NULL;
    if (ok) hparams_of(wr, dopt__optim_wrapper_hp(o), m->wrapper_hparams);
  }
  for (int i = 0; ok && i < m->nparams; i++) {
    const dopt_param *p = dopt__optim_param((dopt_optim *)(uintptr_t)o, i); /* read only */
    dopt_ckpt_param *q = &m->params[i];
    ok = (q->name = ck_ar_strdup(&b->ar, p->name)) != NULL;
    q->dtype = p->work ? DOPT_BF16 : DOPT_F32;
    q->ndim = p->ndim;
    memcpy(q->shape, p->shape, sizeof q->shape);
    q->group = p->group;
    q->layer = p->layer;
    q->step = p->step;
    q->has_bf16 = p->work != NULL;
    q->has_state = p->nstates > 0;
  }
  if (!ok) {
    dopt_ckpt_meta_free(m);
    return dopt__fail(DOPT_ERR_NO_MEMORY, "dopt_ckpt_meta_from_optim: the description of %d parameters", m->nparams);
  }
  m->optimizer_steps = dopt__optim_gstep(o);
  m->eval_mode = dopt_optim_get_mode(o);
  m->skipped_steps = extra ? extra->skipped_steps : 0;
  m->global_step = extra && extra->global_step >= 0 ? extra->global_step : m->optimizer_steps + m->skipped_steps;
  *out = m;
  return DOPT_OK;
}

static int hp_equal(const dopt_ckpt_hparam *a, const dopt_ckpt_hparam *b) {
  int ca = a->kind == DOPT_CKPT_HP_CHOICE, cb = b->kind == DOPT_CKPT_HP_CHOICE;
  if (ca || cb) return ca && cb && a->choice && b->choice && strcmp(a->choice, b->choice) == 0;
  int na = a->kind == DOPT_CKPT_HP_NONE, nb = b->kind == DOPT_CKPT_HP_NONE;
  if (na || nb) return na && nb;
  return a->value == b->value; /* exact; a bool reads as 1/0 either way */
}

static dopt_status hparams_check(const dopt_ckpt_hparam *s, int ns, const dopt_ckpt_hparam *l, int nl,
                                 const char *where, const char *what) {
  for (int k = 0; k < nl; k++) {
    const dopt_ckpt_hparam *x = NULL;
    for (int j = 0; j < ns && !x; j++)
      if (s[j].key && strcmp(s[j].key, l[k].key) == 0) x = &s[j];
    char a[64], b[64];
    ck_hp_str(&l[k], b, sizeof b);
    if (!x && l[k].is_default) continue; /* a key added since the checkpoint was written, at its default */
    if (!x)
      return dopt__fail(DOPT_ERR_INVALID_ARG, "%s: %s: hyperparameter %s is missing in the checkpoint (optimizer %s)",
                        where, what, l[k].key, b);
    ck_hp_str(x, a, sizeof a);
    if (!hp_equal(x, &l[k]))
      return dopt__fail(DOPT_ERR_INVALID_ARG, "%s: %s: hyperparameter %s is %s in the checkpoint, %s in the optimizer",
                        where, what, l[k].key, a, b);
  }
  if (ns != nl) /* a key the optimizer does not know */
    for (int j = 0; j < ns; j++) {
      int found = 0;
      for (int k = 0; k < nl && !found; k++) found = s[j].key && strcmp(s[j].key, l[k].key) == 0;
      if (!found)
        return dopt__fail(DOPT_ERR_INVALID_ARG, "%s: %s: the checkpoint's hyperparameter %s is not the optimizer's",
                          where, what, s[j].key ? s[j].key : "?");
    }
  return DOPT_OK;
}

dopt_status dopt_ckpt_meta_check(const dopt_ckpt_meta *s, const dopt_ckpt_meta *l, const char *where) {
  DOPT_CHECK_ARG(s && l, "dopt_ckpt_meta_check: NULL argument");
  if (!where) where = "checkpoint";
  if (strcmp(s->optimizer, l->optimizer) != 0)
    return dopt__fail(DOPT_ERR_INVALID_ARG, "%s: optimizer '%s' in the checkpoint, '%s' here", where, s->optimizer,
                      l->optimizer);
  if ((s->wrapper == NULL) != (l->wrapper == NULL) || (s->wrapper && strcmp(s->wrapper, l->wrapper) != 0))
    return dopt__fail(DOPT_ERR_INVALID_ARG, "%s: wrapper '%s' in the checkpoint, '%s' here", where,
                      s->wrapper ? s->wrapper : "none", l->wrapper ? l->wrapper : "none");
  if (l->wrapper)
    DOPT_TRY(hparams_check(s->wrapper_hparams, s->nwrapper_hparams, l->wrapper_hparams, l->nwrapper_hparams, where,
                           l->wrapper));
  if (s->ngroups != l->ngroups)
    return dopt__fail(DOPT_ERR_INVALID_ARG, "%s: %d parameter groups in the checkpoint, %d here", where, s->ngroups,
                      l->ngroups);
  char what[32];
  for (int g = 0; g < l->ngroups; g++) {
    snprintf(what, sizeof what, "group %d", g);
    DOPT_TRY(hparams_check(s->groups[g].hparams, s->groups[g].nhparams, l->groups[g].hparams, l->groups[g].nhparams,
                           where, what));
  }
  if (s->nparams != l->nparams)
    return dopt__fail(DOPT_ERR_SHAPE, "%s: %d parameters in the checkpoint, %d here", where, s->nparams, l->nparams);
  for (int i = 0; i < l->nparams; i++) {
    const dopt_ckpt_param *a = &s->params[i], *b = &l->params[i];
    if (strcmp(a->name, b->name) != 0)
      return dopt__fail(DOPT_ERR_NOT_FOUND, "%s: parameter %d is '%s' in the checkpoint, '%s' here", where, i, a->name,
                        b->name);
    if (a->dtype != b->dtype || !ck_same_shape(a->ndim, a->shape, b->ndim, b->shape)) {
      char x[160], y[160];
      dopt__shape_text(a->ndim, a->shape, x, sizeof x);
      dopt__shape_text(b->ndim, b->shape, y, sizeof y);
      return dopt__fail(DOPT_ERR_SHAPE, "%s: parameter '%s' is %s %s in the checkpoint, %s %s here", where, a->name,
                        dopt_dtype_name(a->dtype), x, dopt_dtype_name(b->dtype), y);
    }
    if (a->group != b->group)
      return dopt__fail(DOPT_ERR_INVALID_ARG, "%s: parameter '%s' is in group %d in the checkpoint, %d here", where,
                        a->name, a->group, b->group);
    if (l->wrapper && a->layer != b->layer)
      return dopt__fail(DOPT_ERR_INVALID_ARG, "%s: parameter '%s' has layer %d in the checkpoint, %d here", where,
                        a->name, a->layer, b->layer);
  }
  return DOPT_OK;
}

/* ---- the single device ---------------------------------------------------------------------- */

static int same_cstr(const void *ctx, int i, const void *key) {
  return strcmp(((const char *const *)ctx)[i], (const char *)key) == 0;
}

/* The names of every tensor an optimizer saves (with meta's has_state/has_bf16), into names[]. */
static dopt_status tensor_names(dopt_optim *o, const dopt_ckpt_meta *m, arena *ar, char ***names_out, int *n_out,
                                dopt_index *ix) {
  const dopt_optim_impl *im = dopt__optim_impl(o);
  int cap = 0, n = 0;
  for (int i = 0; i < m->nparams; i++) cap += 2 + DOPT_MAX_STATES;
  char **names = ck_ar_alloc(ar, (size_t)(cap ? cap : 1) * sizeof *names);
  if (!names) return dopt__fail(DOPT_ERR_NO_MEMORY, "checkpoint: %d tensor names", cap);
  for (int i = 0; i < m->nparams; i++) {
    const dopt_ckpt_param *p = &m->params[i];
    dopt_state_spec lay[DOPT_MAX_STATES];
    int ns = p->has_state ? im->layout(dopt__optim_group_hp(o, p->group), p->ndim, p->shape, lay) : 0;
    for (int k = -2; k < ns; k++) {
      if (k == -1 && !p->has_bf16) continue;
      size_t len = strlen(p->name) + 8 + (k >= 0 ? strlen(lay[k].v.name) : 0);
      char *nm = ck_ar_alloc(ar, len);
      if (!nm) return dopt__fail(DOPT_ERR_NO_MEMORY, "checkpoint: %zu bytes for a name of '%s'", len, p->name);
      if (k == -2) snprintf(nm, len, "%s", p->name);
      else if (k == -1) snprintf(nm, len, "%s/bf16", p->name);
      else snprintf(nm, len, "%s/%s", p->name, lay[k].v.name);
      if (dopt__index_find(ix, dopt__hash_str(nm), same_cstr, names, nm))
        return dopt__fail(DOPT_ERR_INVALID_ARG, "checkpoint: tensor name '%s' is used twice (parameter names must be "
                          "unique and not look like '<param>/<state>')", nm);
      names[n] = nm;
      DOPT_TRY(dopt__index_add(ix, dopt__hash_str(nm), n));
      n++;
    }
  }
  *names_out = names;
  *n_out = n;
  return DOPT_OK;
}

dopt_status dopt_optim_save(dopt_optim *o, const char *ckpt_dir, const dopt_ckpt_info *extra) {
  DOPT_CHECK_ARG(o && ckpt_dir && *ckpt_dir, "dopt_optim_save: NULL argument");
  dopt_ckpt_meta *m;
  DOPT_TRY(dopt_ckpt_meta_from_optim(o, extra, &m));
  arena ar;
  memset(&ar, 0, sizeof ar);
  dopt_index ix;
  memset(&ix, 0, sizeof ix);
  char **names, tmp[CK_PATH];
  int nnames;
  dopt_ckpt_writer *w = NULL;
  int begun = 0;
  dopt_status s = tensor_names(o, m, &ar, &names, &nnames, &ix); /* refuses names that collide */
  if (s == DOPT_OK) s = dopt_ckpt_begin(ckpt_dir, m->global_step, tmp, sizeof tmp);
  begun = s == DOPT_OK;
  if (s == DOPT_OK) s = dopt_ckpt_writer_open(tmp, 0, 1, &w);
  char name[1024];
  for (int i = 0; s == DOPT_OK && i < m->nparams; i++) {
    const dopt_param *p = dopt__optim_param(o, i);
    dopt_piece pc;
    dopt_piece_full(p->ndim, p->shape, &pc);
    s = dopt_ckpt_put(w, p->name, DOPT_F32, p->ndim, p->shape, &pc, p->data);
    snprintf(name, sizeof name, "%s/bf16", p->name);
    if (s == DOPT_OK && p->work) s = dopt_ckpt_put(w, name, DOPT_BF16, p->ndim, p->shape, &pc, p->work);
    for (int k = 0; s == DOPT_OK && k < p->nstates; k++) {
      const dopt_state_view *v = &p->st[k];
      dopt_piece sp;
      dopt_piece_full(v->ndim, v->shape, &sp);
      snprintf(name, sizeof name, "%s/%s", p->name, v->name);
      s = dopt_ckpt_put(w, name, v->dtype, v->ndim, v->shape, &sp, v->data);
    }
  }
  if (s == DOPT_OK) {
    s = dopt_ckpt_writer_close(w);
    w = NULL;
  }
  if (s == DOPT_OK) s = dopt_ckpt_commit(ckpt_dir, tmp, m);
  if (w) dopt_ckpt_abort_writer(w);
  if (s != DOPT_OK && begun) {
    char keep[512];
    snprintf(keep, sizeof keep, "%s", dopt_last_error());
    (void)dopt_ckpt_discard(tmp);
    dopt__fail(s, "%s", keep); /* the first failure's message, not the clean-up's */
  }
  dopt__index_free(&ix);
  ck_ar_free(&ar);
  dopt_ckpt_meta_free(m);
  return s;
}

dopt_status dopt_optim_load(dopt_optim *o, const char *path) {
  DOPT_CHECK_ARG(o && path, "dopt_optim_load: NULL argument");
  dopt_ckpt_reader *r;
  DOPT_TRY(dopt_ckpt_open(path, &r));
  const dopt_ckpt_meta *sm = &r->meta.m;
  dopt_ckpt_meta *lm = NULL;
  arena ar;
  memset(&ar, 0, sizeof ar);
  dopt_index ix;
  memset(&ix, 0, sizeof ix);
  char **names = NULL;
  void **buf = NULL;
  int nnames = 0;
  const dopt_optim_impl *im = dopt__optim_impl(o);
  dopt_status s = dopt_ckpt_meta_from_optim(o, NULL, &lm);
  if (s == DOPT_OK) s = dopt_ckpt_meta_check(sm, lm, r->index_path);
  /* the tensors this optimizer expects, with the checkpoint's has_state/has_bf16 */
  if (s == DOPT_OK) {
    for (int i = 0; i < lm->nparams; i++) {
      lm->params[i].has_state = sm->params[i].has_state;
      lm->params[i].has_bf16 = sm->params[i].has_bf16 && lm->params[i].has_bf16;
    }
    s = tensor_names(o, lm, &ar, &names, &nnames, &ix);
  }
  for (int i = 0; s == DOPT_OK && i < r->t.nt; i++)
    if (!dopt__index_find(&ix, dopt__hash_str(r->t.t[i].name), same_cstr, names, r->t.t[i].name))
      s = dopt__fail(DOPT_ERR_FORMAT, "%s: tensor '%s' is no parameter or state of this optimizer", r->index_path,
                     r->t.t[i].name);
  if (s == DOPT_OK && !(buf = ck_ar_alloc(&ar, (size_t)(nnames ? nnames : 1) * sizeof *buf)))
    s = dopt__fail(DOPT_ERR_NO_MEMORY, "dopt_optim_load: %d tensor buffers", nnames);
  /* 1. read and verify everything into scratch */
  int t = 0;
  for (int i = 0; s == DOPT_OK && i < lm->nparams; i++) {
    const dopt_ckpt_param *p = &lm->params[i];
    dopt_state_spec lay[DOPT_MAX_STATES];
    int ns = p->has_state ? im->layout(dopt__optim_group_hp(o, p->group), p->ndim, p->shape, lay) : 0;
    for (int k = -2; s == DOPT_OK && k < ns; k++) {
      if (k == -1 && !p->has_bf16) continue;
      dopt_dtype dt = k == -2 ? DOPT_F32 : k == -1 ? DOPT_BF16 : lay[k].v.dtype;
      int nd = k >= 0 ? lay[k].v.ndim : p->ndim;
      const int64_t *sh = k >= 0 ? lay[k].v.shape : p->shape;
      const ck_tensor *x = ck_table_find(&r->t, names[t]);
      if (!x || x->dtype != dt || !ck_same_shape(x->ndim, x->shape, nd, sh)) {
        char a[160];
        dopt__shape_text(nd, sh, a, sizeof a);
        s = dopt__fail(DOPT_ERR_SHAPE, "%s: tensor '%s': expected %s %s, the checkpoint has %s", r->index_path,
                       names[t], dopt_dtype_name(dt), a, x ? dopt_dtype_name(x->dtype) : "none");
        break;
      }
      dopt_piece full;
      dopt_piece_full(nd, sh, &full);
      if (!(buf[t] = ck_ar_alloc(&ar, full.numel * dopt_dtype_size(dt))))
        s = dopt__fail(DOPT_ERR_NO_MEMORY, "dopt_optim_load: '%s' (%zu bytes)", names[t], full.numel * dopt_dtype_size(dt));
      if (s == DOPT_OK) s = dopt_ckpt_get(r, names[t], &full, buf[t]);
      t++;
    }
  }
  /* 2. allocate the states that are not (undone if that fails): the only step that can fail */
  unsigned char *fresh = s == DOPT_OK ? ck_ar_alloc(&ar, (size_t)(lm->nparams ? lm->nparams : 1)) : NULL;
  int64_t *old_step = s == DOPT_OK ? ck_ar_alloc(&ar, (size_t)(lm->nparams ? lm->nparams : 1) * sizeof *old_step) : NULL;
  if (s == DOPT_OK && (!fresh || !old_step)) s = dopt__fail(DOPT_ERR_NO_MEMORY, "dopt_optim_load: bookkeeping of %d parameters", lm->nparams);
  for (int i = 0; s == DOPT_OK && i < lm->nparams; i++) {
    dopt_param *p = dopt__optim_param(o, i);
    old_step[i] = p->step;
    if (sm->params[i].has_state && p->nstates == 0) {
      s = dopt_optim_init_state(o, i); /* the layout of these hyperparameters: the checkpoint's */
      fresh[i] = s == DOPT_OK;
    }
  }
  if (s != DOPT_OK && fresh)
    for (int i = 0; i < lm->nparams; i++)
      if (fresh[i]) {
        dopt__optim_free_states(o, i);
        dopt__optim_param(o, i)->step = old_step[i];
      }
  /* 3. copy */
  if (s == DOPT_OK) {
    t = 0;
    for (int i = 0; i < lm->nparams; i++) {
      const dopt_ckpt_param *sp = &sm->params[i], *lp = &lm->params[i];
      dopt_param *p = dopt__optim_param(o, i);
      memcpy(p->data, buf[t++], p->numel * sizeof(float));
      if (lp->has_bf16) memcpy(p->work, buf[t++], p->numel * sizeof(uint16_t));
      else if (p->work) /* saved without its working copy: the rounded master, as after a step */
        for (size_t e = 0; e < p->numel; e++) p->work[e] = dopt_f32_to_bf16(p->data[e]);
      if (sp->has_state)
        for (int k = 0; k < p->nstates; k++) memcpy(p->st[k].data, buf[t++], p->st[k].bytes);
      else
        dopt__optim_free_states(o, i);
      p->step = sp->step;
    }
    s = dopt_optim_set_gstep(o, sm->optimizer_steps);
    if (s == DOPT_OK) s = dopt_optim_declare_mode(o, sm->eval_mode); /* the weights loaded are that mode's point */
  }
  dopt__index_free(&ix);
  ck_ar_free(&ar);
  dopt_ckpt_meta_free(lm);
  dopt_ckpt_close(r);
  return s;
}
