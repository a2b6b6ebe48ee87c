/* Generic optimizer object: "key=value" hyperparameters, torch-style
 * parameter groups, lazily allocated states, counters and descriptions (the
 * staged step loop over the thread pool: core/optim_step.c). The math lives in
 * one file per optimizer in ref/, and the table that names them is
 * ref/registry.c: this file knows optimizers only as dopt_optim_impl pointers. */
#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "index.h"
#include "optim_impl.h"
#include "optim_object.h"
#include "pool.h"

/* ---- the optimizer object ----------------------------------------------------- */

static int find_key(const dopt_optim_impl *im, const char *key, size_t len) {
  for (int i = 0; i < im->nhp; i++)
    if (strlen(im->hp[i].key) == len && strncmp(im->hp[i].key, key, len) == 0) return i;
  /* a projection wrapper's composite: inner.KEY names the inner's KEY (its table says inner.KEY only where the
   * wrapper has a KEY of its own): one prefix, and only a key of the inner (inner.rank is not the projector's
   * rank, inner.inner.lr no key at all; a LISA group refuses both alike) */
  if (im->composed && len > 6 && strncmp(key, "inner.", 6) == 0)
    for (int i = im->nown; i < im->nhp; i++)
      if (strlen(im->hp[i].key) == len - 6 && strncmp(im->hp[i].key, key + 6, len - 6) == 0) return i;
  return -1;
}

static dopt_status unknown_key(const dopt_optim_impl *im, const char *key, size_t len) {
  char known[256] = "";
  size_t off = 0;
  for (int i = 0; i < im->nhp && off < sizeof known; i++) {
    int n = snprintf(known + off, sizeof known - off, "%s%s", i ? ", " : "", im->hp[i].key);
    if (n < 0) break;
    off += (size_t)n;
  }
  return dopt__fail(DOPT_ERR_NOT_FOUND, "%s: unknown hyperparameter '%.*s' (known: %s)", im->name, (int)len,
                    key, known);
}

/* Checks one value against its key's kind. */
static dopt_status check_kind(const dopt_optim_impl *im, int k, double v) {
  const dopt_hp_def *d = &im->hp[k];
  if (d->kind == DOPT_HP_OPT && isnan(v)) return DOPT_OK;
  if (!isfinite(v)) return dopt__fail(DOPT_ERR_INVALID_ARG, "%s: %s=%g must be finite", im->name, d->key, v);
  if (d->kind == DOPT_HP_BOOL && v != 0.0 && v != 1.0)
    return dopt__fail(DOPT_ERR_INVALID_ARG, "%s: %s=%g must be true or false", im->name, d->key, v);
  if (d->kind == DOPT_HP_ENUM) {
    int n = 0;
    while (d->choices[n]) n++;
    if (v != floor(v) || v < 0 || v >= n)
      return dopt__fail(DOPT_ERR_INVALID_ARG, "%s: %s=%g is not a choice index in [0, %d)", im->name, d->key, v, n);
  }
  return DOPT_OK;
}

/* Parses "k=v,k=v" into hp[] (on top of what hp[] holds). */
static dopt_status parse_hparams(const dopt_optim_impl *im, const char *text, double *hp) {
  const char *s = text ? text : "";
  while (*s) {
    while (*s == ',' || isspace((unsigned char)*s)) s++;
    if (!*s) break;
    const char *key = s;
    while (*s && *s != '=' && *s != ',') s++;
    size_t klen = (size_t)(s - key);
    while (klen > 0 && isspace((unsigned char)key[klen - 1])) klen--;
    if (*s != '=')
      return dopt__fail(DOPT_ERR_INVALID_ARG, "%s: hyperparameter '%.*s' has no '=value'", im->name, (int)klen,
                        key);
    s++;
    while (isspace((unsigned char)*s)) s++;
    const char *val = s;
    while (*s && *s != ',') s++;
    size_t vlen = (size_t)(s - val);
    while (vlen > 0 && isspace((unsigned char)val[vlen - 1])) vlen--;
    int k = find_key(im, key, klen);
    if (k < 0) return unknown_key(im, key, klen);
    char buf[64];
    if (vlen == 0 || vlen >= sizeof buf)
      return dopt__fail(DOPT_ERR_INVALID_ARG, "%s: %s='%.*s' is not a value", im->name, im->hp[k].key, (int)vlen,
                        val);
    memcpy(buf, val, vlen);
    buf[vlen] = '\0';
    double v;
    /* an enum's names first: its "true"/"false" are choices (muon's use_muon: auto, true, false), not 1/0 */
    if (im->hp[k].kind != DOPT_HP_ENUM && (strcmp(buf, "true") == 0 || strcmp(buf, "True") == 0)) {
      v = 1.0;
    } else if (im->hp[k].kind != DOPT_HP_ENUM && (strcmp(buf, "false") == 0 || strcmp(buf, "False") == 0)) {
      v = 0.0;
    } else if (im->hp[k].kind == DOPT_HP_ENUM) {
      int found = -1;
      char names[256] = "";
      for (int c = 0; im->hp[k].choices[c]; c++) {
        if (strcmp(buf, im->hp[k].choices[c]) == 0 || (strcmp(buf, "True") == 0 && strcmp(im->hp[k].choices[c], "true") == 0) ||
            (strcmp(buf, "False") == 0 && strcmp(im->hp[k].choices[c], "false") == 0))
          found = c;
        snprintf(names + strlen(names), sizeof names - strlen(names), "%s%s", c ? ", " : "", im->hp[k].choices[c]);
      }
      if (found < 0)
        return dopt__fail(DOPT_ERR_INVALID_ARG, "%s: %s='%s' is not one of: %s", im->name, im->hp[k].key, buf, names);
      v = (double)found;
    } else if (strcmp(buf, "none") == 0 || strcmp(buf, "None") == 0 || strcmp(buf, "null") == 0) {
      if (im->hp[k].kind != DOPT_HP_OPT)
        return dopt__fail(DOPT_ERR_INVALID_ARG, "%s: %s=none is not allowed (the key needs a value)", im->name,
                          im->hp[k].key);
      v = NAN;
    } else {
      char *end;
      errno = 0;
      v = strtod(buf, &end);
      if (*end != '\0' || end == buf)
        return dopt__fail(DOPT_ERR_INVALID_ARG, "%s: %s='%s' is not a number", im->name, im->hp[k].key, buf);
      if (errno == ERANGE && isinf(v)) /* overflow; an underflow (1e-320) keeps its subnormal or zero value */
        return dopt__fail(DOPT_ERR_INVALID_ARG, "%s: %s=%s is out of the double range", im->name, im->hp[k].key, buf);
      if (isnan(v))
        return dopt__fail(DOPT_ERR_INVALID_ARG, "%s: %s=%s is NaN", im->name, im->hp[k].key, buf);
    }
    DOPT_TRY(check_kind(im, k, v));
    hp[k] = v;
  }
  return DOPT_OK;
}

static dopt_status validate_group(const dopt_optim_impl *im, const double *hp) {
  for (int k = 0; k < im->nhp; k++) DOPT_TRY(check_kind(im, k, hp[k]));
  if (im->composed && hp[0] != im->hp[0].def) /* the composite was built for one inner */
    return dopt__fail(DOPT_ERR_INVALID_ARG, "%s: inner=%s cannot differ from the optimizer's inner=%s (per group or "
                      "after creation)", im->name, im->hp[0].choices[(int)hp[0]], im->hp[0].choices[(int)im->hp[0].def]);
  return im->validate ? im->validate(hp) : DOPT_OK;
}

/* Splits a wrapper's "k=v,..." into its own keys and the inner optimizer's
 * (every other key; "inner.KEY" always goes to the inner optimizer, for keys
 * both define, e.g. seed). */
static dopt_status split_wrapper(const dopt_optim_impl *w, const char *text, char **own, char **inner) {
  size_t cap = (text ? strlen(text) : 0) + 2;
  *own = calloc(1, cap);
  *inner = calloc(1, cap);
  if (!*own || !*inner) {
    free(*own), free(*inner);
    *own = *inner = NULL;
    return dopt__fail(DOPT_ERR_NO_MEMORY, "%s: hyperparameters", w->name);
  }
  const char *s = text ? text : "";
  while (*s) {
    while (*s == ',' || isspace((unsigned char)*s)) s++;
    if (!*s) break;
    const char *tok = s;
    while (*s && *s != ',') s++;
    size_t tlen = (size_t)(s - tok), klen = 0;
    while (klen < tlen && tok[klen] != '=') klen++;
    while (klen > 0 && isspace((unsigned char)tok[klen - 1])) klen--;
    char *dst;
    if (klen > 6 && strncmp(tok, "inner.", 6) == 0) {
      tok += 6;
      tlen -= 6;
      dst = *inner;
    } else {
      dst = find_key(w, tok, klen) >= 0 ? *own : *inner;
    }
    if (*dst) strcat(dst, ",");
    strncat(dst, tok, tlen);
  }
  return DOPT_OK;
}

void dopt__impl_release(const dopt_optim_impl *im) {
  if (!im || !im->composed) return;
  free((void *)(uintptr_t)im->hp);
  free((void *)(uintptr_t)im);
}

/* The composite of projection wrapper w for the inner its `inner=NAME` key in text names (w's default
 * without one): w's own keys of text (split_wrapper) parsed for `inner`; all of text is parsed into the
 * composite by the caller. */
static dopt_status compose(const dopt_optim_impl *w, const char *text, const dopt_optim_impl **out) {
  double whp[DOPT_MAX_HPARAMS];
  for (int k = 0; k < w->nhp; k++) whp[k] = w->hp[k].def;
  char *own, *rest;
  DOPT_TRY(split_wrapper(w, text, &own, &rest));
  dopt_status s = parse_hparams(w, own, whp);
  free(own);
  free(rest);
  return s == DOPT_OK ? w->compose(w, whp, out) : s;
}

/* The optimizer that steps and its hyperparameters: for a wrapper (LISA),
 * its own keys into whp and the inner optimizer's into hp. */
static dopt_status resolve(const dopt_optim_impl *im, const char *hparams, const dopt_optim_impl **step_impl,
                           double *hp, const dopt_optim_impl **wrapper, double *whp) {
  const dopt_optim_impl *in = im;
  char *own = NULL, *rest = NULL;
  *wrapper = NULL;
  if (im->wrap) {
    DOPT_TRY(split_wrapper(im, hparams, &own, &rest));
    for (int k = 0; k < im->nhp; k++) whp[k] = im->hp[k].def;
    dopt_status s = parse_hparams(im, own, whp);
    if (s == DOPT_OK) s = validate_group(im, whp);
    if (s == DOPT_OK && !(in = im->wrap->inner(whp)))
      s = dopt__fail(DOPT_ERR_INVALID_ARG, "%s: no inner optimizer", im->name);
    free(own);
    if (s != DOPT_OK) {
      free(rest);
      return s;
    }
    *wrapper = im;
    hparams = rest;
  }
  if (in->compose) { /* a projection wrapper (GaLore): the composite for its inner */
    dopt_status s = compose(in, hparams, &in);
    if (s != DOPT_OK) {
      free(rest);
      return s;
    }
  }
  for (int k = 0; k < in->nhp; k++) hp[k] = in->hp[k].def;
  dopt_status s = parse_hparams(in, hparams, hp);
  if (s == DOPT_OK) s = validate_group(in, hp);
  free(rest);
  if (s == DOPT_OK) *step_impl = in;
  else dopt__impl_release(in);
  return s;
}

static dopt_status push_group(dopt_optim *o, const double *hp, int *out) {
  group *g = realloc(o->groups, (size_t)(o->ngroups + 1) * sizeof *g);
  if (!g) return dopt__fail(DOPT_ERR_NO_MEMORY, "optimizer: group %d", o->ngroups);
  o->groups = g;
  memcpy(g[o->ngroups].hp, hp, sizeof g[o->ngroups].hp);
  if (out) *out = o->ngroups;
  o->ngroups++;
  return DOPT_OK;
}

dopt_status dopt__optim_create_impl(const dopt_optim_impl *im, const char *hparams, dopt_optim **out) {
  const char *name = im->name;
  *out = NULL;
  double hp[DOPT_MAX_HPARAMS], whp[DOPT_MAX_HPARAMS];
  const dopt_optim_impl *wrapper = NULL;
  DOPT_TRY(resolve(im, hparams, &im, hp, &wrapper, whp));
  dopt_optim *o = calloc(1, sizeof *o);
  if (!o) return dopt__fail(DOPT_ERR_NO_MEMORY, "dopt_optim_create: %s", name);
  o->impl = im;
  o->wrapper = wrapper;
  if (wrapper) memcpy(o->whp, whp, sizeof whp);
  dopt_status s = push_group(o, hp, NULL);
  if (s != DOPT_OK) {
    free(o);
    return s;
  }
  *out = o;
  return DOPT_OK;
}

/* Frees the last step's work items and their frames. */
static void free_items(dopt_optim *o) {
  for (int i = 0; i < o->items_cap; i++) {
    free(o->items[i].frame);
    free(o->items[i].whole);
    free(o->items[i].g32);
    free(o->items[i].posts);
  }
  free(o->items);
}

static void free_states(dopt_param *p) {
  for (int i = 0; i < p->nstates; i++) free(p->st[i].data);
  p->nstates = 0;
}

void dopt_optim_destroy(dopt_optim *o) {
  if (!o) return;
  for (int i = 0; i < o->nparams; i++) {
    free_states(&o->params[i]);
    free(o->params[i].name);
  }
  free(o->params);
  dopt__index_free(&o->by_data);
  free(o->groups);
  free_items(o);
  dopt__pool_destroy(o->pool);
  dopt__impl_release(o->impl);
  free(o);
}

const char *dopt_optim_name(const dopt_optim *o) { return o ? (o->wrapper ? o->wrapper : o->impl)->name : NULL; }
int dopt_optim_num_groups(const dopt_optim *o) { return o ? o->ngroups : 0; }
int dopt_optim_num_params(const dopt_optim *o) { return o ? o->nparams : 0; }
const char *dopt_optim_param_name(const dopt_optim *o, int i) {
  return o && i >= 0 && i < o->nparams ? o->params[i].name : NULL;
}

dopt_status dopt_optim_add_group(dopt_optim *o, const char *overrides, int *groupid) {
  DOPT_CHECK_ARG(o != NULL, "dopt_optim_add_group: optimizer=NULL");
  double hp[DOPT_MAX_HPARAMS];
  memcpy(hp, o->groups[0].hp, sizeof hp);
  if (o->wrapper) { /* the wrapper's keys are optimizer-wide */
    char *own, *rest;
    DOPT_TRY(split_wrapper(o->wrapper, overrides, &own, &rest));
    dopt_status s = *own ? dopt__fail(DOPT_ERR_INVALID_ARG, "%s: '%s' is optimizer-wide, not a group override",
                                      o->wrapper->name, own)
                         : parse_hparams(o->impl, rest, hp);
    free(own), free(rest);
    DOPT_TRY(s);
  } else {
    DOPT_TRY(parse_hparams(o->impl, overrides, hp));
  }
  DOPT_TRY(validate_group(o->impl, hp));
  return push_group(o, hp, groupid);
}

static dopt_status check_group(const dopt_optim *o, int g, const char *fn) {
  DOPT_CHECK_ARG(o != NULL, "%s: optimizer=NULL", fn);
  DOPT_CHECK_ARG(g >= 0 && g < o->ngroups, "%s: group=%d out of range [0, %d)", fn, g, o->ngroups);
  return DOPT_OK;
}

dopt_status dopt_optim_get_hparam(const dopt_optim *o, int g, const char *key, double *value) {
  DOPT_TRY(check_group(o, g, "dopt_optim_get_hparam"));
  DOPT_CHECK_ARG(key && value, "dopt_optim_get_hparam: key/value NULL");
  if (o->wrapper && strncmp(key, "inner.", 6) == 0) key += 6;
  else if (o->wrapper && find_key(o->wrapper, key, strlen(key)) >= 0) {
    *value = o->whp[find_key(o->wrapper, key, strlen(key))];
    return DOPT_OK;
  }
  int k = find_key(o->impl, key, strlen(key));
  if (k < 0) return unknown_key(o->impl, key, strlen(key));
  *value = o->groups[g].hp[k];
  return DOPT_OK;
}

dopt_status dopt_optim_set_hparam(dopt_optim *o, int g, const char *key, double value) {
  DOPT_TRY(check_group(o, g, "dopt_optim_set_hparam"));
  DOPT_CHECK_ARG(key != NULL, "dopt_optim_set_hparam: key=NULL");
  if (o->wrapper && strncmp(key, "inner.", 6) == 0) key += 6;
  else if (o->wrapper && find_key(o->wrapper, key, strlen(key)) >= 0) {
    int w = find_key(o->wrapper, key, strlen(key));
    double whp[DOPT_MAX_HPARAMS];
    memcpy(whp, o->whp, sizeof whp);
    whp[w] = value;
    DOPT_TRY(validate_group(o->wrapper, whp));
    if (o->wrapper->wrap->inner(whp) != o->impl)
      return dopt__fail(DOPT_ERR_STATE, "%s: %s cannot change after creation", o->wrapper->name, key);
    o->whp[w] = value;
    return DOPT_OK;
  }
  int k = find_key(o->impl, key, strlen(key));
  if (k < 0) return unknown_key(o->impl, key, strlen(key));
  double hp[DOPT_MAX_HPARAMS];
  memcpy(hp, o->groups[g].hp, sizeof hp);
  hp[k] = value;
  DOPT_TRY(validate_group(o->impl, hp));
  /* a change that alters the state layout of an already-stepped parameter
   * (e.g. Adafactor beta1 none -> 0.9) is refused, as upstream would fail */
  for (int i = 0; i < o->nparams; i++) {
    dopt_param *p = &o->params[i];
    if (p->group != g || p->nstates == 0) continue;
    dopt_state_spec lay[DOPT_MAX_STATES];
    int n = o->impl->layout(hp, p->ndim, p->shape, lay), same = n == p->nstates;
    for (int s = 0; same && s < n; s++) same = lay[s].v.bytes == p->st[s].bytes && lay[s].v.dtype == p->st[s].dtype;
    if (!same) /* also a different size or dtype, e.g. adamw8bit's block_size */
      return dopt__fail(DOPT_ERR_STATE, "%s: changing %s on group %d would change the state of '%s'",
                        o->impl->name, key, g, p->name);
  }
  o->groups[g].hp[k] = value;
  return DOPT_OK;
}

/* add_param refuses a parameter that aliases another: a pointer index over params[i].data */
static int same_data(const void *ctx, int i, const void *key) {
  return ((const dopt_optim *)ctx)->params[i].data == key;
}

static int find_data(const dopt_optim *o, const void *p) {
  return dopt__index_find(&o->by_data, dopt__hash_ptr(p), same_data, o, p);
}

dopt_status dopt_optim_add_param(dopt_optim *o, int g, const dopt_param_config *cfg, int *pid) {
  DOPT_TRY(check_group(o, g, "dopt_optim_add_param"));
  DOPT_CHECK_ARG(cfg != NULL, "dopt_optim_add_param: config=NULL");
  DOPT_CHECK_ARG(cfg->struct_size >= DOPT_PARAM_CONFIG_V1_SIZE && cfg->version >= 1 &&
                     cfg->version <= DOPT_PARAM_CONFIG_VERSION,
                 "dopt_optim_add_param: config struct_size=%u version=%u (initialise with DOPT_PARAM_CONFIG_INIT)",
                 cfg->struct_size, cfg->version);
  const char *nm = cfg->name ? cfg->name : "";
  DOPT_CHECK_ARG(cfg->ndim >= 0 && cfg->ndim <= DOPT_MAX_DIMS, "dopt_optim_add_param: '%s' ndim=%d outside [0, %d]",
                 nm, cfg->ndim, DOPT_MAX_DIMS);
  for (int i = 0; i < cfg->ndim; i++)
    DOPT_CHECK_ARG(cfg->shape[i] > 0, "dopt_optim_add_param: '%s' shape[%d]=%lld must be > 0", nm, i,
                   (long long)cfg->shape[i]);
  if (cfg->dtype != DOPT_F32 && cfg->dtype != DOPT_BF16)
    return dopt__fail(DOPT_ERR_UNSUPPORTED, "dopt_optim_add_param: '%s' dtype=%s: parameters are F32, or BF16 with an "
                      "F32 master", nm, dopt_dtype_name(cfg->dtype));
  DOPT_CHECK_ARG(cfg->data != NULL, "dopt_optim_add_param: '%s' data=NULL", nm);
  DOPT_CHECK_ARG(cfg->dtype != DOPT_BF16 || cfg->master != NULL,
                 "dopt_optim_add_param: '%s' dtype=BF16 needs master (fp32 master weights)", nm);
  int other = find_data(o, cfg->data);
  if (!other && cfg->master) other = find_data(o, cfg->master);
  if (other)
    return dopt__fail(DOPT_ERR_INVALID_ARG, "dopt_optim_add_param: '%s' shares its data with '%s'", nm,
                      o->params[other - 1].name);
  if (o->nparams == o->params_cap) { /* geometric growth: n parameters in O(n) copies */
    int cap = o->params_cap ? 2 * o->params_cap : 16;
    dopt_param *ps = realloc(o->params, (size_t)cap * sizeof *ps);
    if (!ps) return dopt__fail(DOPT_ERR_NO_MEMORY, "dopt_optim_add_param: '%s'", nm);
    o->params = ps;
    o->params_cap = cap;
  }
  dopt_param *p = &o->params[o->nparams];
  memset(p, 0, sizeof *p);
  p->name = malloc(strlen(nm) + 1);
  if (!p->name) return dopt__fail(DOPT_ERR_NO_MEMORY, "dopt_optim_add_param: '%s'", nm);
  strcpy(p->name, nm);
  p->group = g;
  p->ndim = cfg->ndim;
  memcpy(p->shape, cfg->shape, sizeof p->shape);
  p->numel = dopt_numel(cfg->ndim, cfg->shape);
  if (cfg->dtype == DOPT_BF16) { /* the optimizer updates the master; data is the bf16 working copy */
    p->data = cfg->master;
    p->work = cfg->data;
  } else {
    p->data = cfg->data;
  }
  p->layer = cfg->layer;
  dopt_status ix = dopt__index_add(&o->by_data, dopt__hash_ptr(p->data), o->nparams);
  if (ix != DOPT_OK) {
    free(p->name);
    return ix;
  }
  if (pid) *pid = o->nparams;
  o->nparams++;
  return DOPT_OK;
}

static dopt_status check_param(const dopt_optim *o, int i, const char *fn) {
  DOPT_CHECK_ARG(o != NULL, "%s: optimizer=NULL", fn);
  DOPT_CHECK_ARG(i >= 0 && i < o->nparams, "%s: param=%d out of range [0, %d)", fn, i, o->nparams);
  return DOPT_OK;
}

dopt_status dopt__optim_alloc_states(dopt_optim *o, dopt_param *p) {
  if (p->nstates > 0) return DOPT_OK;
  dopt_state_spec lay[DOPT_MAX_STATES];
  int n = o->impl->layout(o->groups[p->group].hp, p->ndim, p->shape, lay);
  const long long qb = dopt_layout_block(lay, n);
  if (qb < 0)
    return dopt__fail(DOPT_ERR_STATE, "%s: the blockwise states of '%s' have different blocks", o->impl->name,
                      p->name);
  p->qblock = (size_t)qb;
  for (int i = 0; i < n; i++) {
    p->st[i] = lay[i].v;
    p->kind[i] = (unsigned char)lay[i].kind;
    p->st[i].data = calloc(1, lay[i].v.bytes ? lay[i].v.bytes : 1);
    if (!p->st[i].data) {
      for (int j = 0; j < i; j++) free(p->st[j].data);
      return dopt__fail(DOPT_ERR_NO_MEMORY, "%s: state '%s' of '%s' (%zu bytes)", o->impl->name, lay[i].v.name,
                        p->name, lay[i].v.bytes);
    }
  }
  p->nstates = n;
  p->step = 0;
  return DOPT_OK;
}

double dopt__impl_cost(const dopt_optim_impl *im, const double *hp, int ndim, const int64_t *shape) {
  return im->cost ? im->cost(hp, ndim, shape) : DOPT_COST_PER_ELEMENT * (double)dopt_numel(ndim, shape);
}

/* items in decreasing cost, then bytes, then index */
typedef struct owner_item {
  double cost, bytes;
  int i;
} owner_item;

static int cmp_owner_item(const void *a, const void *b) {
  const owner_item *x = a, *y = b;
  if (x->cost != y->cost) return x->cost < y->cost ? 1 : -1;
  if (x->bytes != y->bytes) return x->bytes < y->bytes ? 1 : -1;
  return (x->i > y->i) - (x->i < y->i);
}

int dopt__assign_owners(int n, const double *cost, const double *bytes, int world, int *owner) {
  owner_item *it = malloc((size_t)(n > 0 ? n : 1) * sizeof *it);
  double *lc = calloc((size_t)world, sizeof *lc), *lb = calloc((size_t)world, sizeof *lb);
  if (!it || !lc || !lb) {
    free(it), free(lc), free(lb);
    return -1;
  }
  double tc = 0, tb = 0;
  for (int k = 0; k < n; k++) it[k] = (owner_item){cost[k], bytes[k], k}, tc += cost[k], tb += bytes[k];
  if (tc <= 0) tc = 1;
  if (tb <= 0) tb = 1;
  qsort(it, (size_t)n, sizeof *it, cmp_owner_item);
  for (int k = 0; k < n; k++) {
    int best = 0;
    double bmax = 0, bsum = 0;
    for (int r = 0; r < world; r++) {
      const double c = (lc[r] + it[k].cost) / tc, b = (lb[r] + it[k].bytes) / tb;
      const double mx = c > b ? c : b, sm = c + b;
      if (r == 0 || mx < bmax || (mx == bmax && sm < bsum)) best = r, bmax = mx, bsum = sm;
    }
    owner[it[k].i] = best;
    lc[best] += it[k].cost;
    lb[best] += it[k].bytes;
  }
  free(it), free(lc), free(lb);
  return 0;
}

int dopt__impl_whole(const dopt_optim_impl *im, const double *hp, int ndim, const int64_t *shape) {
  if (im->distributable) return 0;
  return im->whole ? im->whole(hp, ndim, shape) != 0 : 1;
}

int64_t dopt__impl_units(const dopt_optim_impl *im, const double *hp, int ndim, const int64_t *shape) {
  if (!im->units || !dopt__impl_whole(im, hp, ndim, shape)) return 1;
  dopt_piece pc;
  dopt_piece_full(ndim, shape, &pc);
  const int64_t u = im->units(hp, ndim, shape);
  return u == (int64_t)pc.b && u > 1 ? u : 1;
}

dopt_status dopt_optim_init_state(dopt_optim *o, int i) {
  DOPT_TRY(check_param(o, i, "dopt_optim_init_state"));
  return dopt__optim_alloc_states(o, &o->params[i]);
}

int dopt_optim_num_states(const dopt_optim *o, int i) {
  return o && i >= 0 && i < o->nparams ? o->params[i].nstates : 0;
}

dopt_status dopt_optim_state(dopt_optim *o, int i, int idx, dopt_state_view *out) {
  DOPT_TRY(check_param(o, i, "dopt_optim_state"));
  DOPT_CHECK_ARG(out != NULL, "dopt_optim_state: out=NULL");
  const dopt_param *p = &o->params[i];
  DOPT_CHECK_ARG(idx >= 0 && idx < p->nstates, "dopt_optim_state: '%s' state index=%d out of range [0, %d)",
                 p->name, idx, p->nstates);
  *out = p->st[idx];
  return DOPT_OK;
}

dopt_status dopt_optim_get_step(const dopt_optim *o, int i, int64_t *step) {
  DOPT_TRY(check_param(o, i, "dopt_optim_get_step"));
  DOPT_CHECK_ARG(step != NULL, "dopt_optim_get_step: step=NULL");
  *step = o->params[i].step;
  return DOPT_OK;
}

dopt_status dopt_optim_set_step(dopt_optim *o, int i, int64_t step) {
  DOPT_TRY(check_param(o, i, "dopt_optim_set_step"));
  DOPT_CHECK_ARG(step >= 0, "dopt_optim_set_step: step=%lld must be >= 0", (long long)step);
  DOPT_TRY(dopt__optim_alloc_states(o, &o->params[i]));
  o->params[i].step = step;
  return DOPT_OK;
}

int64_t dopt_optim_get_gstep(const dopt_optim *o) { return o ? o->gstep : 0; }

dopt_status dopt_optim_set_gstep(dopt_optim *o, int64_t gstep) {
  DOPT_CHECK_ARG(o != NULL, "dopt_optim_set_gstep: optimizer=NULL");
  DOPT_CHECK_ARG(gstep >= 0, "dopt_optim_set_gstep: gstep=%lld must be >= 0", (long long)gstep);
  o->gstep = gstep;
  return DOPT_OK;
}

dopt_status dopt_optim_state_bytes(const dopt_optim *o, int i, size_t *allocated, size_t *full) {
  DOPT_CHECK_ARG(o != NULL, "dopt_optim_state_bytes: optimizer=NULL");
  DOPT_CHECK_ARG(i >= -1 && i < o->nparams, "dopt_optim_state_bytes: param=%d out of range [-1, %d)", i,
                 o->nparams);
  size_t a = 0, f = 0;
  for (int k = (i < 0 ? 0 : i); k < (i < 0 ? o->nparams : i + 1); k++) {
    const dopt_param *p = &o->params[k];
    dopt_state_spec lay[DOPT_MAX_STATES];
    int n = o->impl->layout(o->groups[p->group].hp, p->ndim, p->shape, lay);
    for (int s = 0; s < n; s++) f += lay[s].v.bytes;
    for (int s = 0; s < p->nstates; s++) a += p->st[s].bytes;
  }
  if (allocated) *allocated = a;
  if (full) *full = f;
  return DOPT_OK;
}

dopt_status dopt__impl_state_bytes(const dopt_optim_impl *im, const char *hparams, int ndim, const int64_t *shape,
                                   size_t *bytes) {
  double hp[DOPT_MAX_HPARAMS], whp[DOPT_MAX_HPARAMS];
  const dopt_optim_impl *wrapper;
  DOPT_TRY(resolve(im, hparams, &im, hp, &wrapper, whp)); /* LISA: the inner optimizer's (all layers active) */
  dopt_state_spec lay[DOPT_MAX_STATES];
  int n = im->layout(hp, ndim, shape, lay);
  dopt__impl_release(im);
  size_t b = 0;
  for (int i = 0; i < n; i++) b += lay[i].v.bytes;
  *bytes = b;
  return DOPT_OK;
}

dopt_status dopt_optim_events(const dopt_optim *o, int i, unsigned *events) {
  DOPT_TRY(check_param(o, i, "dopt_optim_events"));
  DOPT_CHECK_ARG(events != NULL, "dopt_optim_events: events=NULL");
  *events = dopt__counts_events(o->params[i].cnt_last);
  return DOPT_OK;
}

unsigned dopt__counts_events(const int64_t *c) {
  return (c[DOPT_COUNTER_RANK_CLAMPED] ? DOPT_EVENT_RANK_CLAMPED : 0u) |
         (c[DOPT_COUNTER_SVD_FALLBACKS] ? DOPT_EVENT_SVD_FALLBACK : 0u) |
         (c[DOPT_COUNTER_SVD_FAILURES] ? DOPT_EVENT_SVD_FAILED : 0u) |
         (c[DOPT_COUNTER_NONFINITE_RESETS] ? DOPT_EVENT_NONFINITE_RESET : 0u) |
         (c[DOPT_COUNTER_CLIPPED] ? DOPT_EVENT_CLIPPED : 0u);
}

dopt_status dopt__counters_fill(dopt_counters *out, const int64_t *last, const int64_t *total, int held, int primary) {
  DOPT_CHECK_ARG(out != NULL, "counters: out=NULL");
  DOPT_CHECK_ARG(out->size >= sizeof *out && out->version >= 1,
                 "counters: out.size=%zu / version=%d (initialise it with DOPT_COUNTERS_INIT)", out->size, out->version);
  out->n = DOPT_NCOUNTERS;
  out->held = held, out->primary = primary;
  memset(out->last, 0, sizeof out->last);
  memset(out->total, 0, sizeof out->total);
  memcpy(out->last, last, DOPT_NCOUNTERS * sizeof *last);
  memcpy(out->total, total, DOPT_NCOUNTERS * sizeof *total);
  return DOPT_OK;
}

dopt_status dopt_optim_counters(const dopt_optim *o, int i, dopt_counters *out) {
  DOPT_TRY(check_param(o, i, "dopt_optim_counters"));
  return dopt__counters_fill(out, o->params[i].cnt_last, o->params[i].cnt_total, 1, 1);
}

#define DOPT_COUNTER_ROW_(id, name, scope) {name, scope},
static const struct {
  const char *name;
  int scope;
} counter_rows[] = {DOPT_COUNTER_TABLE(DOPT_COUNTER_ROW_)};
#undef DOPT_COUNTER_ROW_

const char *dopt_counter_name(int c) { return c >= 0 && c < DOPT_NCOUNTERS ? counter_rows[c].name : NULL; }
int dopt_counter_scope(int c) { return c >= 0 && c < DOPT_NCOUNTERS ? counter_rows[c].scope : -1; }

const dopt_optim_impl *dopt__optim_impl(const dopt_optim *o) { return o->impl; }
const double *dopt__optim_group_hp(const dopt_optim *o, int g) { return o->groups[g].hp; }
dopt_param *dopt__optim_param(dopt_optim *o, int i) { return &o->params[i]; }
const dopt_optim_impl *dopt__optim_wrapper(const dopt_optim *o) { return o->wrapper; }
const double *dopt__optim_wrapper_hp(const dopt_optim *o) { return o->whp; }
int64_t dopt__optim_gstep(const dopt_optim *o) { return o->gstep; }
void dopt__optim_free_states(dopt_optim *o, int i) {
  free_states(&o->params[i]);
  o->params[i].step = 0;
}

/* A key's default as describe prints it: true/false, an enum's name, none, an integer without a fraction,
 * a real with one ("1.0", "0.001", "1e-30"). */
static void default_text(const dopt_hp_def *d, char *def, size_t cap) {
  if (d->kind == DOPT_HP_BOOL) snprintf(def, cap, "%s", d->def != 0.0 ? "true" : "false");
  else if (d->kind == DOPT_HP_ENUM) snprintf(def, cap, "%s", d->choices[(int)d->def]);
  else if (isnan(d->def)) snprintf(def, cap, "none");
  else if (d->kind == DOPT_HP_INT) snprintf(def, cap, "%.0f", d->def);
  else if (d->def == floor(d->def) && fabs(d->def) < 1e15) snprintf(def, cap, "%.1f", d->def);
  else snprintf(def, cap, "%g", d->def);
}

/* One key's line: key, default, meaning; an enum's choices after it ("(one of: a, b, c)"), so a reader of the
 * text tells an enum whose default is a choice named "none" or "true" from an optional number or a bool. */
static int describe_key(const dopt_hp_def *d, char *buf, size_t cap) {
  char def[32], choices[512] = "";
  default_text(d, def, sizeof def);
  if (d->kind == DOPT_HP_ENUM) {
    size_t at = (size_t)snprintf(choices, sizeof choices, " (one of: ");
    for (int c = 0; d->choices[c] && at < sizeof choices; c++)
      at += (size_t)snprintf(choices + at, sizeof choices - at, "%s%s", c ? ", " : "", d->choices[c]);
    if (at < sizeof choices) snprintf(choices + at, sizeof choices - at, ")");
  }
  return snprintf(buf, cap, "  %-16s %-8s %s%s\n", d->key, def, d->doc, choices);
}

dopt_status dopt__impl_describe(const dopt_optim_impl *im, char *buf, size_t cap) {
  size_t off = 0;
  if (im->wrap || im->compose) { /* the wrapper's keys, then a note on forwarding */
    int n0 = snprintf(buf, cap, "%s: %s\n", im->name, im->summary);
    for (int k = 0; n0 >= 0 && k < im->nhp; k++) {
      off += (size_t)n0;
      if (off >= cap) return DOPT_OK;
      n0 = describe_key(&im->hp[k], buf + off, cap - off);
    }
    if (n0 >= 0 && (off += (size_t)n0) < cap)
      snprintf(buf + off, cap - off, "  (every other key is the inner optimizer's; inner.KEY forces forwarding)\n");
    return DOPT_OK;
  }
  int n = snprintf(buf, cap, "%s: %s\n", im->name, im->summary);
  for (int k = 0; n >= 0 && k < im->nhp; k++) {
    off += (size_t)n;
    if (off >= cap) break;
    n = describe_key(&im->hp[k], buf + off, cap - off);
  }
  return DOPT_OK;
}

float dopt_clip_coef(const double *ss, int n, double max_norm, double *norm) {
  double total = 0.0;
  for (int i = 0; i < n; i++) total += ss[i]; /* parameter order, double */
  double nrm = sqrt(total);
  if (norm) *norm = nrm;
  double coef = max_norm / (nrm + 1e-6);
  return (float)(coef > 1.0 ? 1.0 : coef); /* NaN norm: NaN coefficient, as torch */
}
