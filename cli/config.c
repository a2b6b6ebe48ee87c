/* `distopt compare` YAML configuration (see compare.h for the shape), read
 * with libyaml's document API.
 *
 * Decisions:
 *  - Every problem in the file's content is DOPT_ERR_FORMAT: malformed YAML
 *    (libyaml's message and line), unknown keys at any level, duplicate keys,
 *    wrong types, out-of-range counts, strings too long for their buffer,
 *    unknown plugin or gradient source names. The message reads
 *    "FILE:LINE: KEY: problem" with KEY dotted ("plugin.tp", "groups[1].params").
 *    A file that cannot be opened is DOPT_ERR_IO.
 *  - Optimizer hyperparameter names are not checked here (the registry does
 *    that when the optimizer is created); their values must be scalars: a
 *    number, true/false or none/null. Booleans are written "true"/"false",
 *    nulls "none", numbers as written in the file.
 *  - Booleans: true/false (also True/TRUE/False/FALSE); no yes/no/on/off.
 *  - Quoting is not significant: `steps: "100"` is the integer 100.
 *  - The file is loaded on top of o: sections that are absent leave their
 *    fields alone. An `optimizer` mapping must name its `type` and replaces
 *    the hyperparameters; a `groups` sequence replaces all groups.
 *    `gradients.path` without `source` implies `source: trace`.
 *  - Relative `gradients.path` is resolved against the YAML file's directory;
 *    output paths are kept as written (relative to the working directory).
 *  - Layout values the file gives (plugin.type/tp/dp/zero, checkpoint.resume.*)
 *    are marked in o->given and o->given_yaml: cmp_apply_plugin keeps them and
 *    completes the rest from the plugin, and names a contradiction by its key.
 *  - o is only written when the whole file is valid: on error it is unchanged.
 */
#include "cli.h"
#include "compare.h"
#include "model.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <yaml.h>

#include "files.h"
#include "internal.h"
#include "registry.h"

typedef struct cfg_ctx {
  const char *path;
  yaml_document_t *doc;
  size_t *tagged; /* start offsets of the scalars written with an explicit tag (!!str 3), ascending */
  int ntagged;
} cfg_ctx;

static unsigned long node_line(const yaml_node_t *n) { return (unsigned long)n->start_mark.line + 1; }

/* "FILE:LINE: KEY: problem" as DOPT_ERR_FORMAT. */
static dopt_status cfg_fail(const cfg_ctx *c, const yaml_node_t *n, const char *key, const char *fmt, ...)
    DOPT_PRINTF(4, 5);
static dopt_status cfg_fail(const cfg_ctx *c, const yaml_node_t *n, const char *key, const char *fmt, ...) {
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  return dopt__fail(DOPT_ERR_FORMAT, "%s:%lu: %s: %s", c->path, node_line(n), key, msg);
}

static const char *node_kind(const yaml_node_t *n) {
  switch (n->type) {
  case YAML_SCALAR_NODE: return "a scalar";
  case YAML_SEQUENCE_NODE: return "a sequence";
  case YAML_MAPPING_NODE: return "a mapping";
  default: return "nothing";
  }
}

static const char *scalar(const yaml_node_t *n) { return (const char *)n->data.scalar.value; }

static int is_null(const yaml_node_t *n) {
  if (n->type != YAML_SCALAR_NODE || n->data.scalar.style != YAML_PLAIN_SCALAR_STYLE) return 0;
  const char *s = scalar(n);
  return s[0] == '\0' || strcmp(s, "~") == 0 || strcmp(s, "null") == 0 || strcmp(s, "Null") == 0 ||
         strcmp(s, "NULL") == 0;
}

/* Joins "parent.key" (or "parent[i]") into buf. */
static const char *join_key(char *buf, size_t cap, const char *parent, const char *key) {
  if (parent[0]) snprintf(buf, cap, "%s.%s", parent, key);
  else snprintf(buf, cap, "%s", key);
  return buf;
}

/* Checks that n is a mapping whose keys are distinct scalars, all in
 * `allowed` (a NULL-terminated list; NULL: any key). */
static dopt_status check_mapping(const cfg_ctx *c, yaml_node_t *n, const char *where, const char *const *allowed) {
  if (n->type != YAML_MAPPING_NODE)
    return cfg_fail(c, n, where[0] ? where : "(top level)", "must be a mapping, got %s", node_kind(n));
  for (yaml_node_pair_t *p = n->data.mapping.pairs.start; p < n->data.mapping.pairs.top; p++) {
    yaml_node_t *k = yaml_document_get_node(c->doc, p->key);
    char kb[160];
    if (!k || k->type != YAML_SCALAR_NODE)
      return cfg_fail(c, k ? k : n, where[0] ? where : "(top level)", "keys must be scalars, got %s",
                      k ? node_kind(k) : "nothing");
    join_key(kb, sizeof kb, where, scalar(k));
    for (yaml_node_pair_t *q = n->data.mapping.pairs.start; q < p; q++) {
      yaml_node_t *k2 = yaml_document_get_node(c->doc, q->key);
      if (strcmp(scalar(k2), scalar(k)) == 0)
        return cfg_fail(c, k, kb, "duplicate key (first on line %lu)", node_line(k2));
    }
    if (!allowed) continue;
    int ok = 0;
    for (int i = 0; allowed[i] && !ok; i++) ok = strcmp(allowed[i], scalar(k)) == 0;
    if (!ok) {
      char list[256] = "";
      size_t len = 0;
      for (int i = 0; allowed[i]; i++) {
        int w = snprintf(list + len, sizeof list - len, "%s%s", i ? ", " : "", allowed[i]);
        if (w < 0 || (size_t)w >= sizeof list - len) break;
        len += (size_t)w;
      }
      return cfg_fail(c, k, kb, "unknown key (expected one of: %s)", list);
    }
  }
  return DOPT_OK;
}

/* The value of `key` in mapping n, or NULL. */
static yaml_node_t *lookup(const cfg_ctx *c, yaml_node_t *n, const char *key) {
  for (yaml_node_pair_t *p = n->data.mapping.pairs.start; p < n->data.mapping.pairs.top; p++) {
    yaml_node_t *k = yaml_document_get_node(c->doc, p->key);
    if (k && k->type == YAML_SCALAR_NODE && strcmp(scalar(k), key) == 0)
      return yaml_document_get_node(c->doc, p->value);
  }
  return NULL;
}

static dopt_status need_scalar(const cfg_ctx *c, const yaml_node_t *v, const char *key, const char *what) {
  if (v->type != YAML_SCALAR_NODE) return cfg_fail(c, v, key, "must be %s, got %s", what, node_kind(v));
  if (is_null(v)) return cfg_fail(c, v, key, "must be %s, got null", what);
  return DOPT_OK;
}

/* An integer is a plain scalar (no quotes, no explicit tag) of digits, optionally after one '-':
 * " 3", "2" and !!str 3 are strings, as YAML reads them. */
static dopt_status plain_integer(const cfg_ctx *c, const yaml_node_t *v, const char *key, int sign_ok) {
  const char *s = scalar(v);
  int tagged = 0;
  for (int lo = 0, hi = c->ntagged; lo < hi && !tagged;) { /* binary search of the tagged offsets */
    int mid = lo + (hi - lo) / 2;
    if (c->tagged[mid] == v->start_mark.index) tagged = 1;
    else if (c->tagged[mid] < v->start_mark.index) lo = mid + 1;
    else hi = mid;
  }
  size_t i = sign_ok && s[0] == '-';
  int digits = s[i] != '\0';
  for (; s[i] && digits; i++) digits = s[i] >= '0' && s[i] <= '9';
  if (v->data.scalar.style != YAML_PLAIN_SCALAR_STYLE || tagged || !digits)
    return cfg_fail(c, v, key, "must be %s, got %s'%s'", sign_ok ? "an integer" : "a non-negative integer",
                    v->data.scalar.style != YAML_PLAIN_SCALAR_STYLE ? "the quoted string " : tagged ? "the tagged " : "",
                    s);
  return DOPT_OK;
}

static dopt_status get_int(const cfg_ctx *c, const yaml_node_t *v, const char *key, long lo, long hi, int *out) {
  DOPT_TRY(need_scalar(c, v, key, "an integer"));
  DOPT_TRY(plain_integer(c, v, key, 1));
  const char *s = scalar(v);
  char *end;
  errno = 0;
  long x = strtol(s, &end, 10);
  if (end == s || *end != '\0') return cfg_fail(c, v, key, "must be an integer, got '%s'", s);
  if (errno == ERANGE || x < lo || x > hi) {
    if (lo == 1 && x < 1) return cfg_fail(c, v, key, "must be positive, got %s", s);
    return cfg_fail(c, v, key, "must be in [%ld, %ld], got %s", lo, hi, s);
  }
  *out = (int)x;
  return DOPT_OK;
}

static dopt_status get_u64(const cfg_ctx *c, const yaml_node_t *v, const char *key, uint64_t *out) {
  DOPT_TRY(need_scalar(c, v, key, "a non-negative integer"));
  DOPT_TRY(plain_integer(c, v, key, 0));
  const char *s = scalar(v);
  char *end;
  errno = 0;
  if (s[0] == '-') return cfg_fail(c, v, key, "must be a non-negative integer, got '%s'", s);
  unsigned long long x = strtoull(s, &end, 10);
  if (end == s || *end != '\0') return cfg_fail(c, v, key, "must be a non-negative integer, got '%s'", s);
  if (errno == ERANGE) return cfg_fail(c, v, key, "%s does not fit in 64 bits", s);
  *out = (uint64_t)x;
  return DOPT_OK;
}

/* A chunk size: an integer in [1, CMP_CHUNK_MAX]. */
static dopt_status get_size(const cfg_ctx *c, const yaml_node_t *v, const char *key, size_t *out) {
  uint64_t x = 0;
  DOPT_TRY(get_u64(c, v, key, &x));
  if (x < 1 || x > CMP_CHUNK_MAX)
    return cfg_fail(c, v, key, "must be in [1, %zu], got %llu", CMP_CHUNK_MAX, (unsigned long long)x);
  *out = (size_t)x;
  return DOPT_OK;
}

static dopt_status get_double(const cfg_ctx *c, const yaml_node_t *v, const char *key, double *out) {
  DOPT_TRY(need_scalar(c, v, key, "a number"));
  const char *s = scalar(v);
  char *end;
  double x = strtod(s, &end);
  if (end == s || *end != '\0' || !isfinite(x)) return cfg_fail(c, v, key, "must be a finite number, got '%s'", s);
  *out = x;
  return DOPT_OK;
}

/* 1 true, 0 false, -1 neither. */
static int bool_word(const char *s) {
  if (strcmp(s, "true") == 0 || strcmp(s, "True") == 0 || strcmp(s, "TRUE") == 0) return 1;
  if (strcmp(s, "false") == 0 || strcmp(s, "False") == 0 || strcmp(s, "FALSE") == 0) return 0;
  return -1;
}

static dopt_status get_bool(const cfg_ctx *c, const yaml_node_t *v, const char *key, int *out) {
  DOPT_TRY(need_scalar(c, v, key, "true or false"));
  int b = bool_word(scalar(v));
  if (b < 0) return cfg_fail(c, v, key, "must be true or false, got '%s'", scalar(v));
  *out = b;
  return DOPT_OK;
}

static dopt_status get_str(const cfg_ctx *c, const yaml_node_t *v, const char *key, char *buf, size_t cap) {
  DOPT_TRY(need_scalar(c, v, key, "a string"));
  const char *s = scalar(v);
  size_t n = v->data.scalar.length;
  if (n == 0 || s[0] == '\0') return cfg_fail(c, v, key, "must be a non-empty string");
  if (strlen(s) != n) return cfg_fail(c, v, key, "contains a NUL character");
  if (n >= cap) return cfg_fail(c, v, key, "'%.40s...' is too long (%zu characters, at most %zu)", s, n, cap - 1);
  memcpy(buf, s, n + 1);
  return DOPT_OK;
}

/* Appends "key=value" for each pair of mapping n except `skip` to buf
 * (comma-separated): every value --hparams takes — a number, true/false,
 * none (or null), or a name (an enumeration's choice: proj_type: reverse_std,
 * svd: lapack, LISA's inner: adamw), which the optimizer then checks. */
static dopt_status collect_hparams(const cfg_ctx *c, yaml_node_t *n, const char *where, const char *skip, char *buf,
                                   size_t cap) {
  size_t len = 0;
  buf[0] = '\0';
  for (yaml_node_pair_t *p = n->data.mapping.pairs.start; p < n->data.mapping.pairs.top; p++) {
    yaml_node_t *k = yaml_document_get_node(c->doc, p->key), *v = yaml_document_get_node(c->doc, p->value);
    const char *ks = scalar(k);
    if (strcmp(ks, skip) == 0) continue;
    char kb[160];
    join_key(kb, sizeof kb, where, ks);
    if (ks[0] == '\0' || strpbrk(ks, ",= \t\r\n") != NULL)
      return cfg_fail(c, k, kb, "not a valid hyperparameter name");
    if (v->type != YAML_SCALAR_NODE)
      return cfg_fail(c, v, kb, "must be a number, true/false, none or a name, got %s", node_kind(v));
    const char *vs = scalar(v);
    const char *val;
    if (is_null(v) || strcmp(vs, "none") == 0 || strcmp(vs, "None") == 0) {
      val = "none";
    } else if (bool_word(vs) >= 0) {
      val = bool_word(vs) ? "true" : "false";
    } else {
      char *end;
      double x = strtod(vs, &end);
      int number = end != vs && *end == '\0' && strpbrk(vs, ", \t\r\n") == NULL;
      if (number && !isfinite(x)) return cfg_fail(c, v, kb, "must be a finite number, got '%s'", vs);
      int name = !number && vs[0] != '\0';
      for (const char *q = vs; name && *q; q++)
        name = (*q >= 'a' && *q <= 'z') || (*q >= 'A' && *q <= 'Z') || (*q >= '0' && *q <= '9') || *q == '_' ||
               *q == '-' || *q == '.';
      if (!number && !name)
        return cfg_fail(c, v, kb, "must be a number, true/false, none or a name ([A-Za-z0-9_.-]), got '%s'", vs);
      val = vs;
    }
    int w = snprintf(buf + len, cap - len, "%s%s=%s", len ? "," : "", ks, val);
    if (w < 0 || (size_t)w >= cap - len)
      return cfg_fail(c, k, kb, "the hyperparameters of '%s' are too long (at most %zu characters)",
                      where[0] ? where : "(top level)", cap - 1);
    len += (size_t)w;
  }
  return DOPT_OK;
}

/* The registry's check of what mapping n gave: optimizer `type` with hyperparameters `base` (and, when
 * group_hp is given, a group overriding them). Its message (which names the key and the value) is
 * reported at the line of the key it names: FILE:LINE: where.key: message. An optimizer the registry
 * does not know is left to the command, which names it. */
static dopt_status check_hparams(const cfg_ctx *c, yaml_node_t *n, const char *where, const char *skip,
                                 const char *type, const char *base, const char *group_hp) {
  dopt_optim *o = NULL;
  int g;
  if (!dopt_find_impl(type)) return DOPT_OK;
  dopt_status s = dopt_optim_create(type, base, &o);
  if (s == DOPT_OK && group_hp) s = dopt_optim_add_group(o, group_hp, &g);
  dopt_optim_destroy(o);
  if (s == DOPT_OK) return DOPT_OK;
  char why[512];
  const char *m = dopt_last_error(), *colon = strstr(m, ": ");
  snprintf(why, sizeof why, "%s", colon ? colon + 2 : m); /* past "DOPT_ERR_INVALID_ARG: " */
  yaml_node_t *at = n;
  char kb[160];
  snprintf(kb, sizeof kb, "%s", where);
  for (yaml_node_pair_t *p = n->data.mapping.pairs.start; p < n->data.mapping.pairs.top; p++) {
    yaml_node_t *k = yaml_document_get_node(c->doc, p->key);
    const char *ks = scalar(k);
    char eq[140], quoted[140];
    snprintf(eq, sizeof eq, " %s=", ks);
    snprintf(quoted, sizeof quoted, "'%s'", ks);
    if (strcmp(ks, skip) != 0 && (strstr(why, eq) || strstr(why, quoted))) {
      at = yaml_document_get_node(c->doc, p->value);
      join_key(kb, sizeof kb, where, ks);
      break;
    }
  }
  return cfg_fail(c, at, kb, "%s", why);
}

/* cli.h: the hyperparameters an optimizer given alone gets (its upstream defaults, or the registry's example). */
const char *cli_default_hparams(const char *name) {
  dopt_optim *o = NULL;
  if (dopt_optim_create(name, "", &o) == DOPT_OK) {
    dopt_optim_destroy(o);
    return "";
  }
  for (int i = 0; i < dopt_optim_registry_count(); i++) {
    dopt_optim_info in;
    if (dopt_optim_registry_info(i, &in) == DOPT_OK && strcmp(in.name, name) == 0) return in.example;
  }
  return "";
}

static dopt_status load_optimizer(const cfg_ctx *c, yaml_node_t *n, cmp_options *o) {
  DOPT_TRY(check_mapping(c, n, "optimizer", NULL));
  yaml_node_t *t = lookup(c, n, "type");
  if (!t) return cfg_fail(c, n, "optimizer.type", "missing (the optimizer's registry name)");
  DOPT_TRY(get_str(c, t, "optimizer.type", o->optimizer, sizeof o->optimizer));
  DOPT_TRY(collect_hparams(c, n, "optimizer", "type", o->hparams, sizeof o->hparams));
  /* no key given: the defaults the command line's --optimizer alone gets (upstream's, or the registry's example
   * where those are no optimizer: CAME's lr) */
  if (!o->hparams[0]) snprintf(o->hparams, sizeof o->hparams, "%s", cli_default_hparams(o->optimizer));
  return check_hparams(c, n, "optimizer", "type", o->optimizer, o->hparams, NULL);
}

/* typed: the file gave optimizer.type, so the groups are checked against it (otherwise the command's). */
static dopt_status load_groups(const cfg_ctx *c, yaml_node_t *n, cmp_options *o, int typed) {
  if (n->type != YAML_SEQUENCE_NODE)
    return cfg_fail(c, n, "groups", "must be a sequence of mappings, got %s", node_kind(n));
  int count = (int)(n->data.sequence.items.top - n->data.sequence.items.start);
  if (count > CMP_MAX_GROUPS) {
    yaml_node_t *extra = yaml_document_get_node(c->doc, n->data.sequence.items.start[CMP_MAX_GROUPS]);
    return cfg_fail(c, extra, "groups", "too many groups (%d, at most %d)", count, CMP_MAX_GROUPS);
  }
  /* a fresh list: the one o shares with the caller's options stays as it is until the file is valid */
  o->groups = NULL;
  o->ngroups = 0;
  for (int i = 0; i < count; i++) {
    yaml_node_t *g = yaml_document_get_node(c->doc, n->data.sequence.items.start[i]);
    char where[32], kb[64], glob[CMP_GLOB_MAX], hp[CMP_GROUP_HP_MAX];
    snprintf(where, sizeof where, "groups[%d]", i);
    DOPT_TRY(check_mapping(c, g, where, NULL));
    yaml_node_t *pv = lookup(c, g, "params");
    join_key(kb, sizeof kb, where, "params");
    if (!pv) return cfg_fail(c, g, kb, "missing (a glob of parameter names)");
    DOPT_TRY(get_str(c, pv, kb, glob, sizeof glob));
    DOPT_TRY(collect_hparams(c, g, where, "params", hp, sizeof hp));
    if (typed) DOPT_TRY(check_hparams(c, g, where, "params", o->optimizer, o->hparams, hp));
    if (cmp_options_add_group(o, glob, strlen(glob), hp) != DOPT_OK) return cfg_fail(c, g, where, "%s", dopt_last_error());
  }
  return DOPT_OK;
}

/* A layout value the file gave: the plugin does not override it (cmp_apply_plugin). */
static void given(cmp_options *o, unsigned bit) {
  o->given |= bit;
  o->given_yaml |= bit;
}

/* A plugin's name (the library's table, dopt_dist_plugin_find) at `key`. */
static dopt_status get_plugin(const cfg_ctx *c, yaml_node_t *v, const char *key, char *out, size_t cap) {
  DOPT_TRY(get_str(c, v, key, out, cap));
  if (dopt_dist_plugin_find(out)) return DOPT_OK;
  char names[128];
  cmp_plugin_names(names, sizeof names);
  return cfg_fail(c, v, key, "unknown plugin '%s' (expected %s)", out, names);
}

static dopt_status load_plugin(const cfg_ctx *c, yaml_node_t *n, cmp_options *o) {
  static const char *const keys[] = {"type", "tp", "dp", "zero", "pp", "layers_per_stage", "chunk_size", "ep",
                                     "expert_stacks", "ranks", "dp_sum",
                                     "ring_order", "batch_invariant", "backend", "device", NULL};
  DOPT_TRY(check_mapping(c, n, "plugin", keys));
  yaml_node_t *v;
  if ((v = lookup(c, n, "type"))) {
    DOPT_TRY(get_plugin(c, v, "plugin.type", o->plugin, sizeof o->plugin));
    given(o, CMP_GIVEN_PLUGIN);
  }
  if ((v = lookup(c, n, "tp"))) {
    DOPT_TRY(get_int(c, v, "plugin.tp", 1, 1 << 20, &o->tp));
    given(o, CMP_GIVEN_TP);
  }
  if ((v = lookup(c, n, "dp"))) {
    DOPT_TRY(get_int(c, v, "plugin.dp", 1, 1 << 20, &o->dp));
    given(o, CMP_GIVEN_DP);
  }
  if ((v = lookup(c, n, "zero"))) {
    DOPT_TRY(get_int(c, v, "plugin.zero", 0, 3, &o->zero));
    given(o, CMP_GIVEN_ZERO);
  }
  if ((v = lookup(c, n, "pp"))) DOPT_TRY(get_int(c, v, "plugin.pp", 1, CMP_PP_MAX, &o->pp));
  if ((v = lookup(c, n, "chunk_size"))) DOPT_TRY(get_size(c, v, "plugin.chunk_size", &o->chunk_size));
  if ((v = lookup(c, n, "ep"))) DOPT_TRY(get_int(c, v, "plugin.ep", 1, 64, &o->ep));
  if ((v = lookup(c, n, "expert_stacks")))
    DOPT_TRY(get_str(c, v, "plugin.expert_stacks", o->expert_stacks, sizeof o->expert_stacks));
  if ((v = lookup(c, n, "layers_per_stage"))) {
    if (v->type != YAML_SEQUENCE_NODE)
      return cfg_fail(c, v, "plugin.layers_per_stage", "must be a sequence of layer counts, got %s", node_kind(v));
    const int count = (int)(v->data.sequence.items.top - v->data.sequence.items.start);
    if (count < 1 || count > CMP_PP_MAX)
      return cfg_fail(c, v, "plugin.layers_per_stage", "%d stages (1 to %d)", count, CMP_PP_MAX);
    for (int i = 0; i < count; i++) {
      yaml_node_t *e = yaml_document_get_node(c->doc, v->data.sequence.items.start[i]);
      char where[48];
      snprintf(where, sizeof where, "plugin.layers_per_stage[%d]", i);
      DOPT_TRY(get_int(c, e, where, 1, 1000000, &o->layers_per_stage[i]));
    }
    o->nlps = count;
  }
  if ((v = lookup(c, n, "ranks"))) DOPT_TRY(get_int(c, v, "plugin.ranks", 1, 1 << 20, &o->ranks));
  if ((v = lookup(c, n, "dp_sum"))) {
    char name[16];
    DOPT_TRY(get_str(c, v, "plugin.dp_sum", name, sizeof name));
    int w = cmp_parse_dp_sum(name);
    if (w < 0) return cfg_fail(c, v, "plugin.dp_sum", "'%s' (expected exact, exact2 or rank-order)", name);
    o->dp_sum_words = w;
  }
  if ((v = lookup(c, n, "ring_order"))) DOPT_TRY(get_bool(c, v, "plugin.ring_order", &o->ring_order));
  if ((v = lookup(c, n, "batch_invariant")))
    DOPT_TRY(get_bool(c, v, "plugin.batch_invariant", &o->batch_invariant));
  if ((v = lookup(c, n, "backend"))) { /* --backend */
    DOPT_TRY(get_str(c, v, "plugin.backend", o->backend, sizeof o->backend));
    if (strcmp(o->backend, "sim") != 0 && strcmp(o->backend, "nccl") != 0 && strcmp(o->backend, "mpi") != 0)
      return cfg_fail(c, v, "plugin.backend", "unknown backend '%s' (expected sim, nccl or mpi)", o->backend);
  }
  if ((v = lookup(c, n, "device"))) { /* --device */
    DOPT_TRY(get_str(c, v, "plugin.device", o->device, sizeof o->device));
    if (strcmp(o->device, "cpu") != 0 && strcmp(o->device, "cuda") != 0)
      return cfg_fail(c, v, "plugin.device", "unknown device '%s' (expected cpu or cuda)", o->device);
  }
  return DOPT_OK;
}

/* Resolves a relative trace path against the YAML file's directory. */
static dopt_status resolve_path(const cfg_ctx *c, const yaml_node_t *v, const char *rel, char *out, size_t cap) {
  const char *slash = strrchr(c->path, '/');
  int w;
  if (rel[0] == '/' || !slash) w = snprintf(out, cap, "%s", rel);
  else w = snprintf(out, cap, "%.*s/%s", (int)(slash - c->path), c->path, rel);
  if (w < 0 || (size_t)w >= cap)
    return cfg_fail(c, v, "gradients.path", "'%.40s...' is too long once resolved (%d characters, at most %zu)", rel,
                    w, cap - 1);
  return DOPT_OK;
}

static dopt_status load_gradients(const cfg_ctx *c, yaml_node_t *n, cmp_options *o) {
  static const char *const keys[] = {"source", "seed", "model", "path", NULL};
  DOPT_TRY(check_mapping(c, n, "gradients", keys));
  yaml_node_t *src = lookup(c, n, "source"), *seed = lookup(c, n, "seed"), *path = lookup(c, n, "path");
  yaml_node_t *model = lookup(c, n, "model");
  if (src) {
    DOPT_TRY(get_str(c, src, "gradients.source", o->source, sizeof o->source));
    if (strcmp(o->source, "synthetic") != 0 && strcmp(o->source, "trace") != 0)
      return cfg_fail(c, src, "gradients.source", "unknown source '%s' (expected synthetic or trace)", o->source);
  }
  if (seed) {
    if (src && strcmp(o->source, "trace") == 0)
      return cfg_fail(c, seed, "gradients.seed", "only applies to source synthetic");
    DOPT_TRY(get_u64(c, seed, "gradients.seed", &o->seed));
  }
  if (model) {
    if (src && strcmp(o->source, "trace") == 0)
      return cfg_fail(c, model, "gradients.model", "only applies to source synthetic");
    DOPT_TRY(get_str(c, model, "gradients.model", o->model, sizeof o->model));
    cmp_model m;
    if (cmp_model_parse(o->model, &m) != DOPT_OK) return cfg_fail(c, model, "gradients.model", "%s", dopt_last_error());
  }
  if (path) {
    if (src && strcmp(o->source, "synthetic") == 0)
      return cfg_fail(c, path, "gradients.path", "only applies to source trace");
    char rel[sizeof o->trace_path];
    DOPT_TRY(get_str(c, path, "gradients.path", rel, sizeof rel));
    DOPT_TRY(resolve_path(c, path, rel, o->trace_path, sizeof o->trace_path));
    if (!src) snprintf(o->source, sizeof o->source, "trace");
  }
  return DOPT_OK;
}

static dopt_status load_output(const cfg_ctx *c, yaml_node_t *n, cmp_options *o) {
  static const char *const keys[] = {"json", "plot", "quiet", NULL};
  DOPT_TRY(check_mapping(c, n, "output", keys));
  yaml_node_t *v;
  if ((v = lookup(c, n, "json"))) DOPT_TRY(get_str(c, v, "output.json", o->json_path, sizeof o->json_path));
  if ((v = lookup(c, n, "plot"))) DOPT_TRY(get_str(c, v, "output.plot", o->svg_path, sizeof o->svg_path));
  if ((v = lookup(c, n, "quiet"))) DOPT_TRY(get_bool(c, v, "output.quiet", &o->quiet));
  return DOPT_OK;
}

/* checkpoint: {at: K, dir: DIR, start_over: BOOL, resume: {type: P, tp: T, dp: D, zero: Z}} */
static dopt_status load_checkpoint(const cfg_ctx *c, yaml_node_t *n, cmp_options *o) {
  static const char *const keys[] = {"at", "dir", "start_over", "resume", NULL};
  static const char *const rkeys[] = {"type", "tp", "dp", "zero", "pp", "chunk_size", "ep", NULL};
  DOPT_TRY(check_mapping(c, n, "checkpoint", keys));
  yaml_node_t *v;
  if ((v = lookup(c, n, "at"))) DOPT_TRY(get_int(c, v, "checkpoint.at", 1, 1000000, &o->checkpoint_at));
  if ((v = lookup(c, n, "dir"))) DOPT_TRY(get_str(c, v, "checkpoint.dir", o->checkpoint_dir, sizeof o->checkpoint_dir));
  if ((v = lookup(c, n, "start_over"))) DOPT_TRY(get_bool(c, v, "checkpoint.start_over", &o->start_over));
  if ((v = lookup(c, n, "resume"))) {
    DOPT_TRY(check_mapping(c, v, "checkpoint.resume", rkeys));
    yaml_node_t *w;
    if ((w = lookup(c, v, "type"))) {
      DOPT_TRY(get_plugin(c, w, "checkpoint.resume.type", o->resume_plugin, sizeof o->resume_plugin));
      given(o, CMP_GIVEN_RESUME_PLUGIN);
    }
    if ((w = lookup(c, v, "tp"))) {
      DOPT_TRY(get_int(c, w, "checkpoint.resume.tp", 1, 64, &o->resume_tp));
      given(o, CMP_GIVEN_RESUME_TP);
    }
    if ((w = lookup(c, v, "dp"))) {
      DOPT_TRY(get_int(c, w, "checkpoint.resume.dp", 1, 64, &o->resume_dp));
      given(o, CMP_GIVEN_RESUME_DP);
    }
    if ((w = lookup(c, v, "zero"))) {
      DOPT_TRY(get_int(c, w, "checkpoint.resume.zero", 0, 3, &o->resume_zero));
      given(o, CMP_GIVEN_RESUME_ZERO);
    }
    if ((w = lookup(c, v, "pp"))) DOPT_TRY(get_int(c, w, "checkpoint.resume.pp", 1, CMP_PP_MAX, &o->resume_pp));
    if ((w = lookup(c, v, "chunk_size"))) DOPT_TRY(get_size(c, w, "checkpoint.resume.chunk_size", &o->resume_chunk_size));
    if ((w = lookup(c, v, "ep"))) DOPT_TRY(get_int(c, w, "checkpoint.resume.ep", 1, 64, &o->resume_ep));
  }
  return DOPT_OK;
}

/* compare: {sweep: true, max_tp: 4, max_dp: 4, max_pp: 1}   (--sweep, --max-tp, --max-dp, --max-pp) */
static dopt_status load_compare(const cfg_ctx *c, yaml_node_t *n, cmp_options *o) {
  static const char *const keys[] = {"sweep", "max_tp", "max_dp", "max_pp", "threads", NULL};
  DOPT_TRY(check_mapping(c, n, "compare", keys));
  yaml_node_t *v;
  if ((v = lookup(c, n, "sweep"))) DOPT_TRY(get_bool(c, v, "compare.sweep", &o->sweep));
  if ((v = lookup(c, n, "max_tp"))) DOPT_TRY(get_int(c, v, "compare.max_tp", 1, CMP_SWEEP_MAX, &o->max_tp));
  if ((v = lookup(c, n, "max_dp"))) DOPT_TRY(get_int(c, v, "compare.max_dp", 1, CMP_SWEEP_MAX, &o->max_dp));
  if ((v = lookup(c, n, "max_pp"))) DOPT_TRY(get_int(c, v, "compare.max_pp", 1, CMP_SWEEP_MAX, &o->max_pp));
  if ((v = lookup(c, n, "threads"))) DOPT_TRY(get_int(c, v, "compare.threads", 0, 256, &o->threads));
  return DOPT_OK;
}

static dopt_status load_root(const cfg_ctx *c, yaml_node_t *root, cmp_options *o) {
  static const char *const keys[] = {"optimizer", "groups", "plugin", "steps", "accumulation", "max_grad_norm",
                                     "bf16", "gradients", "output", "checkpoint", "compare", NULL};
  DOPT_TRY(check_mapping(c, root, "", keys));
  yaml_node_t *v;
  if ((v = lookup(c, root, "optimizer"))) DOPT_TRY(load_optimizer(c, v, o));
  if ((v = lookup(c, root, "groups"))) DOPT_TRY(load_groups(c, v, o, lookup(c, root, "optimizer") != NULL));
  if ((v = lookup(c, root, "plugin"))) DOPT_TRY(load_plugin(c, v, o));
  if ((v = lookup(c, root, "steps"))) DOPT_TRY(get_int(c, v, "steps", 1, 1L << 30, &o->steps));
  if ((v = lookup(c, root, "accumulation"))) DOPT_TRY(get_int(c, v, "accumulation", 1, 1 << 20, &o->micro));
  if ((v = lookup(c, root, "max_grad_norm"))) {
    DOPT_TRY(get_double(c, v, "max_grad_norm", &o->max_grad_norm));
    if (o->max_grad_norm < 0.0)
      return cfg_fail(c, v, "max_grad_norm", "must be >= 0 (0: no clipping), got %s", scalar(v));
  }
  if ((v = lookup(c, root, "bf16"))) DOPT_TRY(get_bool(c, v, "bf16", &o->bf16));
  if ((v = lookup(c, root, "gradients"))) DOPT_TRY(load_gradients(c, v, o));
  if ((v = lookup(c, root, "output"))) DOPT_TRY(load_output(c, v, o));
  if ((v = lookup(c, root, "checkpoint"))) DOPT_TRY(load_checkpoint(c, v, o));
  if ((v = lookup(c, root, "compare"))) DOPT_TRY(load_compare(c, v, o));
  return DOPT_OK;
}

static dopt_status parser_error(const char *path, const yaml_parser_t *p) {
  const char *problem = p->problem ? p->problem : "unknown error";
  if (p->error == YAML_MEMORY_ERROR) return dopt__fail(DOPT_ERR_NO_MEMORY, "%s: YAML parser out of memory", path);
  if (p->error == YAML_READER_ERROR)
    return dopt__fail(DOPT_ERR_FORMAT, "%s: byte %zu: YAML: %s", path, p->problem_offset, problem);
  if (p->context)
    return dopt__fail(DOPT_ERR_FORMAT, "%s:%lu: YAML: %s (%s on line %lu)", path,
                      (unsigned long)p->problem_mark.line + 1, problem, p->context,
                      (unsigned long)p->context_mark.line + 1);
  return dopt__fail(DOPT_ERR_FORMAT, "%s:%lu: YAML: %s", path, (unsigned long)p->problem_mark.line + 1, problem);
}

/* Bounds on a configuration file, checked on libyaml's event stream before a
 * document is built: a hostile file (nested 200 000 deep, 50 000 keys) is
 * refused in one pass instead of taking minutes. A real configuration is a
 * few hundred bytes, 3 levels deep. */
#define CFG_MAX_BYTES (1L << 20)
#define CFG_MAX_DEPTH 32
#define CFG_MAX_NODES 10000

static dopt_status prescan(const char *path, FILE *f, size_t **tagged, int *ntagged) {
  *tagged = NULL;
  *ntagged = 0;
  if (fseek(f, 0, SEEK_END) != 0) return dopt__fail(DOPT_ERR_IO, "%s: cannot seek: %s", path, strerror(errno));
  long size = ftell(f);
  rewind(f);
  if (size < 0 || size > CFG_MAX_BYTES)
    return dopt__fail(DOPT_ERR_FORMAT, "%s: %ld bytes: a configuration may have at most %ld", path, size,
                      CFG_MAX_BYTES);
  yaml_parser_t parser;
  if (!yaml_parser_initialize(&parser)) return dopt__fail(DOPT_ERR_NO_MEMORY, "%s: YAML parser", path);
  yaml_parser_set_input_file(&parser, f);
  dopt_status s = DOPT_OK;
  int depth = 0, nodes = 0;
  for (;;) {
    yaml_event_t e;
    if (!yaml_parser_parse(&parser, &e)) {
      s = parser_error(path, &parser);
      break;
    }
    yaml_event_type_t t = e.type;
    unsigned long line = (unsigned long)e.start_mark.line + 1;
    if (t == YAML_SCALAR_EVENT && e.data.scalar.tag && nodes < CFG_MAX_NODES) { /* an explicit tag: !!str 3 */
      if (!*tagged && !(*tagged = malloc(CFG_MAX_NODES * sizeof **tagged))) {
        yaml_event_delete(&e);
        s = dopt__fail(DOPT_ERR_NO_MEMORY, "%s: YAML tags", path);
        break;
      }
      (*tagged)[(*ntagged)++] = e.start_mark.index; /* events come in file order: ascending */
    }
    yaml_event_delete(&e);
    if (t == YAML_STREAM_END_EVENT) break;
    if (t == YAML_MAPPING_START_EVENT || t == YAML_SEQUENCE_START_EVENT) depth++;
    if (t == YAML_MAPPING_END_EVENT || t == YAML_SEQUENCE_END_EVENT) depth--;
    if (t == YAML_MAPPING_START_EVENT || t == YAML_SEQUENCE_START_EVENT || t == YAML_SCALAR_EVENT ||
        t == YAML_ALIAS_EVENT)
      nodes++;
    if (depth > CFG_MAX_DEPTH) {
      s = dopt__fail(DOPT_ERR_FORMAT, "%s:%lu: nested deeper than %d levels", path, line, CFG_MAX_DEPTH);
      break;
    }
    if (nodes > CFG_MAX_NODES) {
      s = dopt__fail(DOPT_ERR_FORMAT, "%s:%lu: more than %d YAML nodes", path, line, CFG_MAX_NODES);
      break;
    }
  }
  yaml_parser_delete(&parser);
  rewind(f);
  return s;
}

dopt_status cmp_load_yaml(const char *path, cmp_options *o) {
  DOPT_CHECK_ARG(path != NULL, "cmp_load_yaml: path=NULL");
  DOPT_CHECK_ARG(o != NULL, "cmp_load_yaml: o=NULL");
  FILE *f; /* a regular file: a FIFO is refused, never waited on */
  dopt_status ps = dopt__fopen_read(path, &f, NULL);
  if (ps == DOPT_ERR_NOT_FOUND) return dopt__fail(DOPT_ERR_IO, "%s: cannot open: %s", path, strerror(ENOENT));
  if (ps != DOPT_OK) return ps;
  size_t *tagged = NULL;
  int ntagged = 0;
  ps = prescan(path, f, &tagged, &ntagged);
  if (ps != DOPT_OK) {
    free(tagged);
    fclose(f);
    return ps;
  }
  yaml_parser_t parser;
  if (!yaml_parser_initialize(&parser)) {
    free(tagged);
    fclose(f);
    return dopt__fail(DOPT_ERR_NO_MEMORY, "%s: YAML parser", path);
  }
  yaml_parser_set_input_file(&parser, f);
  yaml_document_t doc;
  dopt_status s = DOPT_OK;
  if (!yaml_parser_load(&parser, &doc)) {
    s = parser_error(path, &parser);
  } else {
    cfg_ctx c = {path, &doc, tagged, ntagged};
    yaml_node_t *root = yaml_document_get_root_node(&doc);
    if (!root) {
      s = dopt__fail(DOPT_ERR_FORMAT, "%s: empty configuration (no YAML document)", path);
    } else {
      /* A second document is an error, not silently ignored. */
      yaml_document_t next;
      if (!yaml_parser_load(&parser, &next)) {
        s = parser_error(path, &parser);
      } else {
        yaml_node_t *r2 = yaml_document_get_root_node(&next);
        if (r2)
          s = dopt__fail(DOPT_ERR_FORMAT, "%s:%lu: more than one YAML document", path,
                         (unsigned long)r2->start_mark.line + 1);
        yaml_document_delete(&next);
      }
      if (s == DOPT_OK) {
        cmp_options tmp = *o; /* o changes only when the whole file is valid */
        s = load_root(&c, root, &tmp);
        if (tmp.groups != o->groups) { /* the file gave groups: the list that is not kept goes */
          free(s == DOPT_OK ? o->groups : tmp.groups);
        }
        if (s == DOPT_OK) *o = tmp;
      }
    }
    yaml_document_delete(&doc);
  }
  yaml_parser_delete(&parser);
  free(tagged);
  fclose(f);
  return s;
}
