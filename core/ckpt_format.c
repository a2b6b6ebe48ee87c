/* Checkpoint formats (docs/checkpoints.md): the JSON of index.json and of a
 * rank's piece list rank-<r>.json — pieces, hyperparameters, the metadata —
 * written and parsed, every field checked when read. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt_internal.h"

static int dtype_by_name(const char *s) {
  for (int d = 0; d < DOPT_DTYPE_COUNT_; d++)
    if (strcmp(dopt_dtype_name((dopt_dtype)d), s) == 0) return d;
  return -1;
}


int ck_same_shape(int na, const int64_t *a, int nb, const int64_t *b) {
  if (na != nb) return 0;
  for (int d = 0; d < na; d++)
    if (a[d] != b[d]) return 0;
  return 1;
}
static const char *const piece_keys[PF_N] = {"b", "h", "w", "numel", "factored", "h0", "hl", "w0", "wl", "lo", "len"};

/* ---- JSON ---------------------------------------------------------------------- */

/* Builders record an allocation failure in *oom instead of checking each call. */
cJSON *ck_jadd(cJSON *obj, const char *key, cJSON *item, int *oom) {
  if (!item) {
    *oom = 1;
    return NULL;
  }
  if (!obj) {
    cJSON_Delete(item);
    *oom = 1;
    return NULL;
  }
  if (key) {
    if (!cJSON_AddItemToObject(obj, key, item)) {
      cJSON_Delete(item);
      *oom = 1;
      return NULL;
    }
  } else if (!cJSON_AddItemToArray(obj, item)) {
    cJSON_Delete(item);
    *oom = 1;
    return NULL;
  }
  return item;
}

cJSON *ck_jnum(double v) { return cJSON_CreateNumber(v); }

void ck_jadd_shape(cJSON *obj, const char *key, int ndim, const int64_t *shape, int *oom) {
  cJSON *a = ck_jadd(obj, key, cJSON_CreateArray(), oom);
  for (int d = 0; d < ndim; d++) ck_jadd(a, NULL, ck_jnum((double)shape[d]), oom);
}

void ck_jadd_piece(cJSON *obj, const dopt_piece *pc, int *oom) {
  uint64_t v[PF_N];
  ck_piece_get(pc, v);
  for (int k = 0; k < PF_N; k++) ck_jadd(obj, piece_keys[k], ck_jnum((double)v[k]), oom);
}

dopt_status ck_jget(const cJSON *obj, const char *key, const char *where, const char *ctx, const cJSON **out) {
  *out = NULL;
  const cJSON *v = cJSON_IsObject(obj) ? cJSON_GetObjectItemCaseSensitive(obj, key) : NULL;
  if (!v) return dopt__fail(DOPT_ERR_FORMAT, "%s: %s: missing \"%s\"", where, ctx, key);
  *out = v;
  return DOPT_OK;
}

dopt_status ck_jint(const cJSON *obj, const char *key, double lo, double hi, const char *where, const char *ctx,
                    int64_t *out) {
  const cJSON *v;
  *out = 0;
  DOPT_TRY(ck_jget(obj, key, where, ctx, &v));
  double x = cJSON_IsNumber(v) ? v->valuedouble : NAN;
  if (!(x >= lo && x <= hi && x == floor(x)))
    return dopt__fail(DOPT_ERR_FORMAT, "%s: %s: \"%s\" is not an integer in [%.0f, %.0f]", where, ctx, key, lo, hi);
  *out = (int64_t)x;
  return DOPT_OK;
}

dopt_status ck_jstr(const cJSON *obj, const char *key, const char *where, const char *ctx, const char **out) {
  const cJSON *v;
  *out = "";
  DOPT_TRY(ck_jget(obj, key, where, ctx, &v));
  if (!cJSON_IsString(v)) return dopt__fail(DOPT_ERR_FORMAT, "%s: %s: \"%s\" is not a string", where, ctx, key);
  *out = v->valuestring;
  return DOPT_OK;
}

static dopt_status jbool(const cJSON *obj, const char *key, const char *where, const char *ctx, int *out) {
  const cJSON *v;
  *out = 0;
  DOPT_TRY(ck_jget(obj, key, where, ctx, &v));
  if (!cJSON_IsBool(v)) return dopt__fail(DOPT_ERR_FORMAT, "%s: %s: \"%s\" is not true/false", where, ctx, key);
  *out = cJSON_IsTrue(v) ? 1 : 0;
  return DOPT_OK;
}

dopt_status ck_jdtype(const cJSON *obj, const char *key, const char *where, const char *ctx, dopt_dtype *out) {
  const char *s;
  *out = DOPT_F32;
  DOPT_TRY(ck_jstr(obj, key, where, ctx, &s));
  int d = dtype_by_name(s);
  if (d < 0) return dopt__fail(DOPT_ERR_FORMAT, "%s: %s: dtype '%s' unknown", where, ctx, s);
  *out = (dopt_dtype)d;
  return DOPT_OK;
}

dopt_status ck_jshape(const cJSON *obj, const char *key, const char *where, const char *ctx, int *ndim,
                      int64_t *shape) {
  const cJSON *v;
  *ndim = 0;
  DOPT_TRY(ck_jget(obj, key, where, ctx, &v));
  int n = cJSON_IsArray(v) ? cJSON_GetArraySize(v) : -1;
  if (n < 0 || n > DOPT_MAX_DIMS)
    return dopt__fail(DOPT_ERR_FORMAT, "%s: %s: \"%s\" is not an array of at most %d dimensions", where, ctx, key,
                      DOPT_MAX_DIMS);
  double numel = 1;
  for (int d = 0; d < n; d++) {
    const cJSON *x = cJSON_GetArrayItem(v, d);
    double y = cJSON_IsNumber(x) ? x->valuedouble : -1;
    if (!(y >= 0 && y <= CK_MAX_INT && y == floor(y)))
      return dopt__fail(DOPT_ERR_FORMAT, "%s: %s: \"%s\"[%d] is not a size", where, ctx, key, d);
    shape[d] = (int64_t)y;
    numel *= y;
  }
  if (numel > CK_MAX_INT) return dopt__fail(DOPT_ERR_FORMAT, "%s: %s: \"%s\" has too many elements", where, ctx, key);
  *ndim = n;
  return DOPT_OK;
}

static dopt_status jpiece(const cJSON *obj, const char *where, const char *ctx, dopt_piece *pc) {
  uint64_t v[PF_N];
  for (int k = 0; k < PF_N; k++) {
    int64_t x;
    DOPT_TRY(ck_jint(obj, piece_keys[k], 0, k == PF_FACTORED ? 1 : CK_MAX_INT, where, ctx, &x));
    v[k] = (uint64_t)x;
  }
  ck_piece_set(pc, v);
  return DOPT_OK;
}

static dopt_status jsha(const cJSON *obj, const char *where, const char *ctx, char *out) {
  const char *s;
  DOPT_TRY(ck_jstr(obj, "sha256", where, ctx, &s));
  int ok = strlen(s) == DOPT_DIGEST_HEX - 1;
  for (size_t i = 0; ok && s[i]; i++) ok = (s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'f');
  if (!ok) return dopt__fail(DOPT_ERR_FORMAT, "%s: %s: \"sha256\" is not 64 lowercase hex digits", where, ctx);
  memcpy(out, s, DOPT_DIGEST_HEX);
  return DOPT_OK;
}

/* A piece entry: piece fields, key, bytes, sha256 (and with_tensor: tensor, dtype, shape). */
dopt_status ck_parse_piece(ck_table *t, const cJSON *e, int file, int with_tensor, const ck_tensor *owner,
                           const char *where) {
  char ctx[256];
  snprintf(ctx, sizeof ctx, "piece of %s", owner ? owner->name : t->files[file].name);
  ck_piece *p = ck_table_new_piece(t);
  if (!p) return dopt__fail(DOPT_ERR_NO_MEMORY, "%s: pieces", where);
  const char *key, *tensor = owner ? owner->name : NULL;
  if (with_tensor) {
    DOPT_TRY(ck_jstr(e, "tensor", where, ctx, &tensor));
    snprintf(ctx, sizeof ctx, "piece of '%s'", tensor);
    DOPT_TRY(ck_jdtype(e, "dtype", where, ctx, &p->dtype));
    DOPT_TRY(ck_jshape(e, "shape", where, ctx, &p->ndim, p->shape));
  } else {
    p->dtype = owner->dtype;
    p->ndim = owner->ndim;
    memcpy(p->shape, owner->shape, sizeof p->shape);
  }
  if (!*tensor) return dopt__fail(DOPT_ERR_FORMAT, "%s: a piece has an empty tensor name", where);
  DOPT_TRY(ck_jstr(e, "key", where, ctx, &key));
  DOPT_TRY(jpiece(e, where, ctx, &p->pc));
  int64_t bytes;
  DOPT_TRY(ck_jint(e, "bytes", 0, CK_MAX_INT, where, ctx, &bytes));
  DOPT_TRY(jsha(e, where, ctx, p->sha));
  p->file = file;
  p->fname = t->files[file].name; /* arena memory: stays where it is when files[] grows */
  p->bytes = (size_t)bytes;
  p->tensor = ck_ar_strdup(&t->ar, tensor);
  p->key = ck_ar_strdup(&t->ar, key);
  if (!p->tensor || !p->key) return dopt__fail(DOPT_ERR_NO_MEMORY, "%s: names", where);
  DOPT_TRY(ck_check_piece(DOPT_ERR_FORMAT, where, tensor, p->ndim, p->shape, &p->pc));
  if (p->bytes != p->pc.len * dopt_dtype_size(p->dtype))
    return dopt__fail(DOPT_ERR_FORMAT, "%s: tensor '%s' piece %s: %zu bytes for %zu x %s elements", where, tensor, key,
                      p->bytes, p->pc.len, dopt_dtype_name(p->dtype));
  return DOPT_OK;
}

/* A rank file name: rank-<5 digits>-of-<5 digits>.safetensors (nothing else may be named in an index). */
int ck_rank_file_name_ok(const char *s) {
  int r, n;
  char tail[32];
  if (strlen(s) != 31 || sscanf(s, "rank-%5d-of-%5d%31s", &r, &n, tail) != 3) return 0;
  char again[64];
  snprintf(again, sizeof again, "rank-%05d-of-%05d.safetensors", r, n);
  return strcmp(again, s) == 0;
}
/* ---- hyperparameters and metadata ------------------------------------------------ */


void ck_hp_str(const dopt_ckpt_hparam *h, char *out, size_t cap) {
  switch (h->kind) {
  case DOPT_CKPT_HP_BOOL: snprintf(out, cap, "%s", h->value != 0.0 ? "true" : "false"); break;
  case DOPT_CKPT_HP_NONE: snprintf(out, cap, "none"); break;
  case DOPT_CKPT_HP_CHOICE: snprintf(out, cap, "%s", h->choice ? h->choice : "?"); break;
  default: /* the shortest of 15 or 17 digits that reads back as the same double */
    snprintf(out, cap, "%.15g", h->value);
    if (strtod(out, NULL) != h->value) snprintf(out, cap, "%.17g", h->value);
    break;
  }
}

static cJSON *hparams_json(const dopt_ckpt_hparam *h, int n, int *oom) {
  cJSON *o = cJSON_CreateObject();
  if (!o) *oom = 1;
  for (int k = 0; o && k < n; k++) {
    cJSON *v;
    switch (h[k].kind) {
    case DOPT_CKPT_HP_BOOL: v = cJSON_CreateBool(h[k].value != 0.0); break;
    case DOPT_CKPT_HP_NONE: v = cJSON_CreateNull(); break;
    case DOPT_CKPT_HP_CHOICE: v = cJSON_CreateString(h[k].choice ? h[k].choice : ""); break;
    default: v = ck_jnum(h[k].value); break;
    }
    ck_jadd(o, h[k].key, v, oom);
  }
  return o;
}

static dopt_status parse_hparams(const cJSON *o, const char *where, const char *ctx, arena *ar, dopt_ckpt_hparam **out,
                                 int *n) {
  if (!cJSON_IsObject(o)) return dopt__fail(DOPT_ERR_FORMAT, "%s: %s: hyperparameters are not an object", where, ctx);
  int cnt = cJSON_GetArraySize(o), k = 0;
  dopt_ckpt_hparam *h = ck_ar_alloc(ar, (size_t)(cnt ? cnt : 1) * sizeof *h);
  if (!h) return dopt__fail(DOPT_ERR_NO_MEMORY, "%s: hyperparameters", where);
  const cJSON *v;
  cJSON_ArrayForEach(v, o) {
    dopt_ckpt_hparam *x = &h[k++];
    if (!(x->key = ck_ar_strdup(ar, v->string ? v->string : ""))) return dopt__fail(DOPT_ERR_NO_MEMORY, "%s", where);
    if (cJSON_IsBool(v)) {
      x->kind = DOPT_CKPT_HP_BOOL;
      x->value = cJSON_IsTrue(v) ? 1.0 : 0.0;
    } else if (cJSON_IsNull(v)) {
      x->kind = DOPT_CKPT_HP_NONE;
      x->value = NAN;
    } else if (cJSON_IsString(v)) {
      x->kind = DOPT_CKPT_HP_CHOICE;
      x->value = NAN;
      if (!(x->choice = ck_ar_strdup(ar, v->valuestring))) return dopt__fail(DOPT_ERR_NO_MEMORY, "%s", where);
    } else if (cJSON_IsNumber(v) && isfinite(v->valuedouble)) {
      x->kind = DOPT_CKPT_HP_NUMBER;
      x->value = v->valuedouble;
    } else {
      return dopt__fail(DOPT_ERR_FORMAT, "%s: %s: hyperparameter '%s' is not a number, boolean, null or name", where,
                        ctx, x->key);
    }
  }
  *out = h;
  *n = cnt;
  return DOPT_OK;
}

dopt_status ck_check_meta_input(const dopt_ckpt_meta *m, const char *fn) {
  DOPT_CHECK_ARG(m != NULL, "%s: meta=NULL", fn);
  DOPT_CHECK_ARG(m->struct_size >= sizeof(dopt_ckpt_meta) && m->version == DOPT_CKPT_META_VERSION,
                 "%s: meta struct_size=%u version=%u (initialise with DOPT_CKPT_META_INIT)", fn, m->struct_size,
                 m->version);
  DOPT_CHECK_ARG(m->optimizer && *m->optimizer, "%s: meta optimizer is empty", fn);
  DOPT_CHECK_ARG(m->ngroups >= 0 && (m->groups || m->ngroups == 0), "%s: meta ngroups=%d", fn, m->ngroups);
  DOPT_CHECK_ARG(m->nparams >= 0 && (m->params || m->nparams == 0), "%s: meta nparams=%d", fn, m->nparams);
  DOPT_CHECK_ARG(m->global_step >= 0 && m->global_step < (int64_t)CK_MAX_INT, "%s: global_step=%lld", fn,
                 (long long)m->global_step);
  DOPT_CHECK_ARG(m->optimizer_steps >= 0 && m->skipped_steps >= 0, "%s: optimizer_steps=%lld skipped_steps=%lld", fn,
                 (long long)m->optimizer_steps, (long long)m->skipped_steps);
  for (int g = 0; g < m->ngroups; g++)
    for (int k = 0; k < m->groups[g].nhparams; k++)
      DOPT_CHECK_ARG(m->groups[g].hparams[k].key != NULL, "%s: group %d hyperparameter %d has no key", fn, g, k);
  /* the counters the reader checks (ck_parse_meta): written consistent, or not at all */
  DOPT_CHECK_ARG(m->optimizer_steps <= m->global_step && m->skipped_steps <= m->global_step - m->optimizer_steps,
                 "%s: global_step=%lld is less than optimizer_steps=%lld + skipped_steps=%lld", fn,
                 (long long)m->global_step, (long long)m->optimizer_steps, (long long)m->skipped_steps);
  for (int i = 0; i < m->nparams; i++) {
    const dopt_ckpt_param *p = &m->params[i];
    DOPT_CHECK_ARG(p->name && *p->name, "%s: parameter %d has no name", fn, i);
    DOPT_CHECK_ARG(p->step >= 0 && p->step <= m->optimizer_steps, "%s: parameter '%s' step=%lld is outside [0, "
                   "optimizer_steps=%lld]", fn, p->name, (long long)p->step, (long long)m->optimizer_steps);
    DOPT_CHECK_ARG(p->group >= 0 && p->group < m->ngroups, "%s: parameter '%s' group=%d out of range [0, %d)", fn,
                   p->name, p->group, m->ngroups);
    DOPT_CHECK_ARG(p->ndim >= 0 && p->ndim <= DOPT_MAX_DIMS, "%s: parameter '%s' ndim=%d", fn, p->name, p->ndim);
    DOPT_CHECK_ARG(p->dtype == DOPT_F32 || p->dtype == DOPT_BF16, "%s: parameter '%s' dtype=%s", fn, p->name,
                   dopt_dtype_name(p->dtype));
  }
  return DOPT_OK;
}

static cJSON *meta_json(const dopt_ckpt_meta *m, int *oom) {
  cJSON *r = cJSON_CreateObject();
  if (!r) *oom = 1;
  ck_jadd(r, "format", cJSON_CreateString(DOPT_CKPT_FORMAT), oom);
  ck_jadd(r, "version", ck_jnum(DOPT_CKPT_FORMAT_VERSION), oom);
  ck_jadd(r, "optimizer", cJSON_CreateString(m->optimizer), oom);
  if (m->wrapper) {
    cJSON *w = ck_jadd(r, "wrapper", cJSON_CreateObject(), oom);
    ck_jadd(w, "name", cJSON_CreateString(m->wrapper), oom);
    ck_jadd(w, "hparams", hparams_json(m->wrapper_hparams, m->nwrapper_hparams, oom), oom);
  } else {
    ck_jadd(r, "wrapper", cJSON_CreateNull(), oom);
  }
  cJSON *gs = ck_jadd(r, "groups", cJSON_CreateArray(), oom);
  for (int g = 0; g < m->ngroups; g++) {
    cJSON *go = ck_jadd(gs, NULL, cJSON_CreateObject(), oom);
    ck_jadd(go, "hparams", hparams_json(m->groups[g].hparams, m->groups[g].nhparams, oom), oom);
    cJSON *mem = ck_jadd(go, "params", cJSON_CreateArray(), oom);
    for (int i = 0; i < m->nparams; i++)
      if (m->params[i].group == g) ck_jadd(mem, NULL, cJSON_CreateString(m->params[i].name), oom);
  }
  ck_jadd(r, "global_step", ck_jnum((double)m->global_step), oom);
  ck_jadd(r, "optimizer_steps", ck_jnum((double)m->optimizer_steps), oom);
  ck_jadd(r, "skipped_steps", ck_jnum((double)m->skipped_steps), oom);
  if (m->eval_mode) ck_jadd(r, "mode", cJSON_CreateString("eval"), oom); /* absent: train mode */
  cJSON *w = ck_jadd(r, "world", cJSON_CreateObject(), oom);
  ck_jadd(w, "plugin", cJSON_CreateString(m->world.plugin ? m->world.plugin : "reference"), oom);
  ck_jadd(w, "tp", ck_jnum(m->world.tp), oom);
  ck_jadd(w, "dp", ck_jnum(m->world.dp), oom);
  ck_jadd(w, "zero", ck_jnum(m->world.zero), oom);
  cJSON *ps = ck_jadd(r, "params", cJSON_CreateArray(), oom);
  for (int i = 0; i < m->nparams; i++) {
    const dopt_ckpt_param *p = &m->params[i];
    cJSON *po = ck_jadd(ps, NULL, cJSON_CreateObject(), oom);
    ck_jadd(po, "name", cJSON_CreateString(p->name), oom);
    ck_jadd(po, "dtype", cJSON_CreateString(dopt_dtype_name(p->dtype)), oom);
    ck_jadd_shape(po, "shape", p->ndim, p->shape, oom);
    ck_jadd(po, "group", ck_jnum(p->group), oom);
    ck_jadd(po, "layer", ck_jnum(p->layer), oom);
    ck_jadd(po, "step", ck_jnum((double)p->step), oom);
    ck_jadd(po, "has_bf16", cJSON_CreateBool(p->has_bf16 != 0), oom);
    ck_jadd(po, "has_state", cJSON_CreateBool(p->has_state != 0), oom);
  }
  return r;
}

dopt_status ck_parse_meta(const cJSON *r, const char *where, meta_box *mb) {
  dopt_ckpt_meta *m = &mb->m;
  arena *ar = &mb->ar;
  *m = (dopt_ckpt_meta)DOPT_CKPT_META_INIT;
  const char *s;
  const cJSON *v;
  DOPT_TRY(ck_jstr(r, "optimizer", where, "index", &s));
  if (!(m->optimizer = ck_ar_strdup(ar, s))) return dopt__fail(DOPT_ERR_NO_MEMORY, "%s", where);
  DOPT_TRY(ck_jget(r, "wrapper", where, "index", &v));
  if (!cJSON_IsNull(v)) {
    const cJSON *wh;
    DOPT_TRY(ck_jstr(v, "name", where, "wrapper", &s));
    if (!(m->wrapper = ck_ar_strdup(ar, s))) return dopt__fail(DOPT_ERR_NO_MEMORY, "%s", where);
    DOPT_TRY(ck_jget(v, "hparams", where, "wrapper", &wh));
    DOPT_TRY(parse_hparams(wh, where, "wrapper", ar, &m->wrapper_hparams, &m->nwrapper_hparams));
  }
  int64_t x;
  DOPT_TRY(ck_jint(r, "global_step", 0, CK_MAX_INT, where, "index", &m->global_step));
  DOPT_TRY(ck_jint(r, "optimizer_steps", 0, CK_MAX_INT, where, "index", &m->optimizer_steps));
  DOPT_TRY(ck_jint(r, "skipped_steps", 0, CK_MAX_INT, where, "index", &m->skipped_steps));
  /* every step of the loop was taken or skipped: global_step counts at least both */
  if (m->optimizer_steps > m->global_step || m->skipped_steps > m->global_step - m->optimizer_steps)
    return dopt__fail(DOPT_ERR_FORMAT, "%s: global_step %lld is less than optimizer_steps %lld + skipped_steps %lld "
                      "(the counters disagree)", where, (long long)m->global_step, (long long)m->optimizer_steps,
                      (long long)m->skipped_steps);
  if (cJSON_GetObjectItemCaseSensitive(r, "mode")) { /* optional: "eval" (saved in evaluation mode) or "train" */
    DOPT_TRY(ck_jstr(r, "mode", where, "index", &s));
    if (strcmp(s, "eval") != 0 && strcmp(s, "train") != 0)
      return dopt__fail(DOPT_ERR_FORMAT, "%s: index key 'mode' is \"%.40s\" (\"train\" or \"eval\")", where, s);
    m->eval_mode = strcmp(s, "eval") == 0;
  }
  DOPT_TRY(ck_jget(r, "world", where, "index", &v));
  DOPT_TRY(ck_jstr(v, "plugin", where, "world", &s));
  if (!(m->world.plugin = ck_ar_strdup(ar, s))) return dopt__fail(DOPT_ERR_NO_MEMORY, "%s", where);
  DOPT_TRY(ck_jint(v, "tp", 0, 1e9, where, "world", &x));
  m->world.tp = (int)x;
  DOPT_TRY(ck_jint(v, "dp", 0, 1e9, where, "world", &x));
  m->world.dp = (int)x;
  DOPT_TRY(ck_jint(v, "zero", 0, 3, where, "world", &x));
  m->world.zero = (int)x;
  const cJSON *gs, *ps, *e;
  DOPT_TRY(ck_jget(r, "groups", where, "index", &gs));
  DOPT_TRY(ck_jget(r, "params", where, "index", &ps));
  if (!cJSON_IsArray(gs) || !cJSON_IsArray(ps))
    return dopt__fail(DOPT_ERR_FORMAT, "%s: \"groups\" and \"params\" must be arrays", where);
  m->ngroups = cJSON_GetArraySize(gs);
  m->nparams = cJSON_GetArraySize(ps);
  m->groups = ck_ar_alloc(ar, (size_t)(m->ngroups ? m->ngroups : 1) * sizeof *m->groups);
  m->params = ck_ar_alloc(ar, (size_t)(m->nparams ? m->nparams : 1) * sizeof *m->params);
  if (!m->groups || !m->params) return dopt__fail(DOPT_ERR_NO_MEMORY, "%s", where);
  int i = 0;
  char ctx[300];
  cJSON_ArrayForEach(e, ps) {
    dopt_ckpt_param *p = &m->params[i];
    snprintf(ctx, sizeof ctx, "params[%d]", i);
    DOPT_TRY(ck_jstr(e, "name", where, ctx, &s));
    if (!*s) return dopt__fail(DOPT_ERR_FORMAT, "%s: %s: empty name", where, ctx);
    if (!(p->name = ck_ar_strdup(ar, s))) return dopt__fail(DOPT_ERR_NO_MEMORY, "%s", where);
    snprintf(ctx, sizeof ctx, "parameter '%s'", s);
    DOPT_TRY(ck_jdtype(e, "dtype", where, ctx, &p->dtype));
    DOPT_TRY(ck_jshape(e, "shape", where, ctx, &p->ndim, p->shape));
    DOPT_TRY(ck_jint(e, "group", 0, m->ngroups - 1, where, ctx, &x));
    p->group = (int)x;
    DOPT_TRY(ck_jint(e, "layer", -1, 2147483647.0, where, ctx, &x));
    p->layer = (int)x;
    DOPT_TRY(ck_jint(e, "step", 0, CK_MAX_INT, where, ctx, &p->step));
    DOPT_TRY(jbool(e, "has_bf16", where, ctx, &p->has_bf16));
    DOPT_TRY(jbool(e, "has_state", where, ctx, &p->has_state));
    if (p->step > m->optimizer_steps) /* a parameter steps at most once per optimizer step */
      return dopt__fail(DOPT_ERR_FORMAT, "%s: %s: step %lld is more than optimizer_steps %lld (the counters disagree)",
                        where, ctx, (long long)p->step, (long long)m->optimizer_steps);
    i++;
  }
  int g = 0;
  cJSON_ArrayForEach(e, gs) {
    snprintf(ctx, sizeof ctx, "groups[%d]", g);
    const cJSON *h, *mem, *nm;
    DOPT_TRY(ck_jget(e, "hparams", where, ctx, &h));
    DOPT_TRY(parse_hparams(h, where, ctx, ar, &m->groups[g].hparams, &m->groups[g].nhparams));
    DOPT_TRY(ck_jget(e, "params", where, ctx, &mem));
    if (!cJSON_IsArray(mem)) return dopt__fail(DOPT_ERR_FORMAT, "%s: %s: \"params\" is not an array", where, ctx);
    int k = 0;
    cJSON_ArrayForEach(nm, mem) { /* the members, in parameter order */
      while (k < m->nparams && m->params[k].group != g) k++;
      if (!cJSON_IsString(nm) || k == m->nparams || strcmp(nm->valuestring, m->params[k].name) != 0)
        return dopt__fail(DOPT_ERR_FORMAT, "%s: %s: member '%s' is not the next parameter of group %d", where, ctx,
                          cJSON_IsString(nm) ? nm->valuestring : "?", g);
      k++;
    }
    while (k < m->nparams && m->params[k].group != g) k++;
    if (k < m->nparams)
      return dopt__fail(DOPT_ERR_FORMAT, "%s: %s: parameter '%s' of group %d is not listed", where, ctx,
                        m->params[k].name, g);
    g++;
  }
  return DOPT_OK;
}
dopt_status ck_read_json(const char *path, cJSON **out) {
  char *text;
  size_t n;
  DOPT_TRY(dopt__read_all(path, CK_MAX_JSON, &text, &n));
  const dopt_status nul = dopt__json_no_nul(text, n, path, 0);
  if (nul != DOPT_OK) {
    free(text);
    *out = NULL;
    return nul;
  }
  const char *end = NULL;
  *out = cJSON_ParseWithLengthOpts(text, n, &end, 0);
  int trailing = 0;
  for (const char *c = end; *out && c && c < text + n; c++) trailing |= !(*c == ' ' || *c == '\n' || *c == '\t' || *c == '\r');
  free(text);
  if (!*out || trailing) {
    cJSON_Delete(*out);
    *out = NULL;
    return dopt__fail(DOPT_ERR_FORMAT, "%s: not valid JSON (truncated or corrupted)", path);
  }
  return DOPT_OK;
}
char *ck_index_json(const ck_table *t, const dopt_ckpt_meta *m) {
  int oom = 0;
  cJSON *r = meta_json(m, &oom);
  cJSON *fs = ck_jadd(r, "files", cJSON_CreateArray(), &oom);
  for (int f = 0; f < t->nfiles; f++) {
    cJSON *fo = ck_jadd(fs, NULL, cJSON_CreateObject(), &oom);
    ck_jadd(fo, "name", cJSON_CreateString(t->files[f].name), &oom);
    ck_jadd(fo, "bytes", ck_jnum((double)t->files[f].bytes), &oom);
  }
  cJSON *ts = ck_jadd(r, "tensors", cJSON_CreateArray(), &oom);
  for (int i = 0; i < t->nt && !oom; i++) {
    const ck_tensor *x = &t->t[i];
    cJSON *to = ck_jadd(ts, NULL, cJSON_CreateObject(), &oom);
    ck_jadd(to, "name", cJSON_CreateString(x->name), &oom);
    ck_jadd(to, "dtype", cJSON_CreateString(dopt_dtype_name(x->dtype)), &oom);
    ck_jadd_shape(to, "shape", x->ndim, x->shape, &oom);
    cJSON *ps = ck_jadd(to, "pieces", cJSON_CreateArray(), &oom);
    for (int k = 0; k < x->npieces; k++) {
      const ck_piece *p = x->pieces[k];
      cJSON *po = ck_jadd(ps, NULL, cJSON_CreateObject(), &oom);
      ck_jadd(po, "file", cJSON_CreateString(t->files[p->file].name), &oom);
      ck_jadd(po, "key", cJSON_CreateString(p->key), &oom);
      ck_jadd_piece(po, &p->pc, &oom);
      ck_jadd(po, "bytes", ck_jnum((double)p->bytes), &oom);
      ck_jadd(po, "sha256", cJSON_CreateString(p->sha), &oom);
    }
  }
  char *text = oom ? NULL : cJSON_Print(r);
  cJSON_Delete(r);
  return text;
}
