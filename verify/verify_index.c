/* The index of a recorded run (verify/verify.h, docs/verify.md): parsing and
 * every check that needs no tensor file. Errors are one line naming the file,
 * the key path and the value (echoed strings cut to 60 bytes; control
 * characters are escaped by the CLI's error printer). Unknown keys are
 * rejected: a recorder that writes more bumps schema_version. */
#include "verify.h"
#include "files.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct vctx {
  const char *where;
  char *err;
  size_t cap;
} vctx;

static int fail(vctx *c, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

static int fail(vctx *c, const char *fmt, ...) {
  char msg[768];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  /* one line whatever the index holds: a key path echoes JSON keys, which may hold any character */
  char line[sizeof msg * 4];
  dopt__escape(msg, strlen(msg), line, sizeof line);
  snprintf(c->err, c->cap, "%s: %s", c->where, line);
  return -1;
}

/* A string for a message: quoted, its first 60 bytes escaped (dopt__escape), "..." when cut. */
static const char *shown(const char *s, char *buf, size_t cap) {
  if (cap < 16) return "";
  const size_t n = strnlen(s, 61);
  buf[0] = '\'';
  size_t k = 1 + dopt__escape(s, n > 60 ? 60 : n, buf + 1, cap - 5);
  if (n > 60) memcpy(buf + k, "...", 3), k += 3;
  buf[k++] = '\'';
  buf[k] = '\0';
  return buf;
}

/* The JSON value as a short text for a message (a number, a type name, or the string). */
static const char *value_text(const cJSON *v, char *buf, size_t cap) {
  if (!v) return "missing";
  if (cJSON_IsNumber(v)) {
    snprintf(buf, cap, "%.17g", v->valuedouble);
    return buf;
  }
  if (cJSON_IsString(v)) return shown(v->valuestring, buf, cap);
  if (cJSON_IsBool(v)) return cJSON_IsTrue(v) ? "true" : "false";
  if (cJSON_IsNull(v)) return "null";
  if (cJSON_IsArray(v)) return "an array";
  if (cJSON_IsObject(v)) return "an object";
  return "an invalid value";
}

/* Rejects keys outside `allowed` (NULL-terminated) and duplicate keys. */
static int check_keys(vctx *c, const cJSON *obj, const char *path, const char *const *allowed) {
  char b[96];
  for (const cJSON *it = obj->child; it; it = it->next) {
    const char *k = it->string ? it->string : "";
    int ok = 0;
    for (int i = 0; allowed[i] && !ok; i++) ok = strcmp(allowed[i], k) == 0;
    if (!ok) return fail(c, "%s: unknown key %s", path, shown(k, b, sizeof b));
    for (const cJSON *j = it->next; j; j = j->next)
      if (j->string && strcmp(j->string, k) == 0) return fail(c, "%s: duplicate key %s", path, shown(k, b, sizeof b));
  }
  return 0;
}

static const cJSON *member(const cJSON *obj, const char *key) { return cJSON_GetObjectItemCaseSensitive(obj, key); }

/* An integer in [lo, hi]. */
static int get_int(vctx *c, const cJSON *v, const char *path, long long lo, long long hi, long long *out) {
  char b[96];
  if (!v || !cJSON_IsNumber(v) || !isfinite(v->valuedouble) || v->valuedouble != floor(v->valuedouble))
    return fail(c, "%s: %s, expected an integer", path, value_text(v, b, sizeof b));
  if (v->valuedouble < (double)lo || v->valuedouble > (double)hi)
    return fail(c, "%s: %s is outside [%lld, %lld]", path, value_text(v, b, sizeof b), lo, hi);
  *out = (long long)v->valuedouble;
  return 0;
}

/* A string of 1..maxlen bytes without control characters, copied into dst (maxlen + 1 bytes). */
static int get_str(vctx *c, const cJSON *v, const char *path, size_t maxlen, char *dst) {
  char b[96];
  if (!v || !cJSON_IsString(v) || !v->valuestring) return fail(c, "%s: %s, expected a string", path, value_text(v, b, sizeof b));
  size_t n = strlen(v->valuestring);
  if (n == 0) return fail(c, "%s: empty string", path);
  if (n > maxlen) return fail(c, "%s: %s is %zu bytes, longer than the limit of %zu", path, shown(v->valuestring, b, sizeof b), n, maxlen);
  for (size_t i = 0; i < n; i++) {
    unsigned char ch = (unsigned char)v->valuestring[i];
    if (ch < 0x20 || ch == 0x7f) return fail(c, "%s: %s holds a control character", path, shown(v->valuestring, b, sizeof b));
  }
  memcpy(dst, v->valuestring, n + 1);
  return 0;
}

static int get_array(vctx *c, const cJSON *v, const char *path, long lo, long hi, int *n) {
  char b[96];
  if (!v || !cJSON_IsArray(v)) return fail(c, "%s: %s, expected an array", path, value_text(v, b, sizeof b));
  long k = 0;
  for (const cJSON *it = v->child; it; it = it->next)
    if (++k > hi) return fail(c, "%s: more than %ld entries (the limit)", path, hi);
  if (k < lo) return fail(c, "%s: %ld entries, at least %ld needed", path, k, lo);
  *n = (int)k;
  return 0;
}

static int get_object(vctx *c, const cJSON *v, const char *path) {
  char b[96];
  if (!v || !cJSON_IsObject(v)) return fail(c, "%s: %s, expected an object", path, value_text(v, b, sizeof b));
  return 0;
}

static int get_bool(vctx *c, const cJSON *v, const char *path, int *out) {
  char b[96];
  if (!v || !cJSON_IsBool(v)) return fail(c, "%s: %s, expected true or false", path, value_text(v, b, sizeof b));
  *out = cJSON_IsTrue(v) ? 1 : 0;
  return 0;
}

/* A relative path inside the recording: no leading '/', no '..' component, no backslash. */
static int safe_path(const char *p) {
  if (p[0] == '/' || strchr(p, '\\')) return 0;
  for (const char *s = p; *s;) {
    const char *e = strchr(s, '/');
    size_t n = e ? (size_t)(e - s) : strlen(s);
    if (n == 0 || (n == 2 && s[0] == '.' && s[1] == '.')) return 0;
    s += n;
    if (*s == '/') s++;
  }
  return 1;
}

/* ---- sorted parameter names: lookups in O(log n) ----------------------------------- */

static const vr_index *sort_ix; /* qsort has no context argument; set only around the call */
static int cmp_param_idx(const void *a, const void *b) {
  return strcmp(sort_ix->params[*(const int *)a].name, sort_ix->params[*(const int *)b].name);
}

typedef struct vr_lookup {
  int *order; /* params sorted by name (ix->by_name) */
} vr_lookup;

static int lookup(const vr_index *ix, const vr_lookup *lk, const char *name) {
  (void)lk;
  return vr_index_find_param(ix, name);
}

/* ---- sections ------------------------------------------------------------------------ */

static int parse_params(vctx *c, const cJSON *arr, vr_index *ix) {
  static const char *const keys[] = {"name", "shape", "dtype", "group", NULL};
  char path[128], b[96], dtype[16];
  if (get_array(c, arr, "params", 1, VR_MAX_PARAMS, &ix->nparams)) return -1;
  ix->params = calloc((size_t)ix->nparams, sizeof *ix->params);
  if (!ix->params) return fail(c, "params: out of memory for %d parameters", ix->nparams);
  int i = 0;
  for (const cJSON *it = arr->child; it; it = it->next, i++) {
    vr_param *p = &ix->params[i];
    snprintf(path, sizeof path, "params[%d]", i);
    if (get_object(c, it, path) || check_keys(c, it, path, keys)) return -1;
    snprintf(path, sizeof path, "params[%d].name", i);
    if (get_str(c, member(it, "name"), path, VR_MAX_NAME, p->name)) return -1;
    snprintf(path, sizeof path, "params[%d].dtype", i);
    const cJSON *dt = member(it, "dtype");
    if (!dt || !cJSON_IsString(dt) || strlen(dt->valuestring) >= sizeof dtype)
      return fail(c, "%s: %s, expected \"F32\"", path, value_text(dt, b, sizeof b));
    if (strcmp(dt->valuestring, "F32") != 0)
      return fail(c, "%s: %s: only F32 parameters can be verified (parameter %s)", path, shown(dt->valuestring, b, sizeof b),
                  p->name);
    snprintf(path, sizeof path, "params[%d].shape", i);
    int nd;
    if (get_array(c, member(it, "shape"), path, 0, DOPT_MAX_DIMS, &nd)) return -1;
    p->ndim = nd;
    p->numel = 1;
    int d = 0;
    for (const cJSON *s = member(it, "shape")->child; s; s = s->next, d++) {
      long long v;
      snprintf(path, sizeof path, "params[%d].shape[%d]", i, d);
      if (get_int(c, s, path, 1, VR_MAX_NUMEL, &v)) return -1;
      p->shape[d] = v;
      if (p->numel > VR_MAX_NUMEL / v)
        return fail(c, "params[%d].shape: parameter %s has more than %lld elements (the limit)", i, p->name,
                    (long long)VR_MAX_NUMEL);
      p->numel *= v;
    }
    long long g;
    snprintf(path, sizeof path, "params[%d].group", i);
    if (get_int(c, member(it, "group"), path, 0, ix->ngroups - 1, &g)) return -1;
    p->group = (int)g;
  }
  return 0;
}

static int parse_groups(vctx *c, const cJSON *arr, vr_index *ix) {
  static const char *const keys[] = {"hparams", NULL};
  char path[64], b[96];
  if (get_array(c, arr, "groups", 1, VR_MAX_GROUPS, &ix->ngroups)) return -1;
  ix->group_hparams = calloc((size_t)ix->ngroups, sizeof *ix->group_hparams);
  if (!ix->group_hparams) return fail(c, "groups: out of memory");
  int i = 0;
  for (const cJSON *it = arr->child; it; it = it->next, i++) {
    snprintf(path, sizeof path, "groups[%d]", i);
    if (get_object(c, it, path) || check_keys(c, it, path, keys)) return -1;
    snprintf(path, sizeof path, "groups[%d].hparams", i);
    const cJSON *h = member(it, "hparams");
    if (!h || !cJSON_IsString(h)) return fail(c, "%s: %s, expected a string", path, value_text(h, b, sizeof b));
    size_t n = strlen(h->valuestring);
    if (n > VR_MAX_HPARAMS) return fail(c, "%s: %zu bytes, longer than the limit of %d", path, n, VR_MAX_HPARAMS);
    for (size_t k = 0; k < n; k++)
      if ((unsigned char)h->valuestring[k] < 0x20) return fail(c, "%s: %s holds a control character", path, shown(h->valuestring, b, sizeof b));
    ix->group_hparams[i] = malloc(n + 1);
    if (!ix->group_hparams[i]) return fail(c, "%s: out of memory", path);
    memcpy(ix->group_hparams[i], h->valuestring, n + 1);
  }
  return 0;
}

/* A piece's tensor-parallel block (schema 3): {"dim", "lo", "len"}, the indices [lo, lo + len) of dimension
 * dim, into pc->lp. */
static int parse_block(vctx *c, const cJSON *bj, const char *base, const vr_param *p, vr_piece *pc) {
  static const char *const keys[] = {"dim", "lo", "len", NULL};
  char path[200];
  long long dim, lo, len;
  snprintf(path, sizeof path, "%s.block", base);
  if (get_object(c, bj, path) || check_keys(c, bj, path, keys)) return -1;
  snprintf(path, sizeof path, "%s.block.dim", base);
  if (get_int(c, member(bj, "dim"), path, 0, p->ndim > 0 ? p->ndim - 1 : 0, &dim)) return -1;
  const int64_t dl = p->ndim > 0 ? p->shape[dim] : 1;
  snprintf(path, sizeof path, "%s.block.lo", base);
  if (get_int(c, member(bj, "lo"), path, 0, dl - 1, &lo)) return -1;
  snprintf(path, sizeof path, "%s.block.len", base);
  if (get_int(c, member(bj, "len"), path, 1, dl - lo, &len)) return -1;
  pc->lp.block_dim = (int)dim, pc->lp.block_lo = lo, pc->lp.block_len = len;
  return 0;
}

/* A piece's stage (schema 4) below ix->stages, its expert below ix->experts. */
static int parse_place(vctx *c, const cJSON *it, const char *base, const vr_index *ix, vr_piece *pc) {
  char path[200];
  long long v;
  const cJSON *sj = member(it, "stage"), *ej = member(it, "expert");
  snprintf(path, sizeof path, "%s.stage", base);
  if (ix->stages && !sj) return fail(c, "%s: missing (stages is %d: every piece names its stage)", path, ix->stages);
  if (sj && !ix->stages) return fail(c, "%s: given but the recording has no stages", path);
  if (sj && get_int(c, sj, path, 0, ix->stages - 1, &v)) return -1;
  pc->lp.stage = sj ? (int)v : -1;
  snprintf(path, sizeof path, "%s.expert", base);
  if (ej && !ix->experts) return fail(c, "%s: given but the recording has no experts", path);
  if (ej && get_int(c, ej, path, 0, ix->experts - 1, &v)) return -1;
  pc->lp.expert = ej ? (int)v : -1;
  return 0;
}

static int parse_piece(vctx *c, const cJSON *it, const char *base, vr_index *ix, const vr_lookup *lk, vr_piece *pc) {
  static const char *const keys2[] = {"param", "lo", "len", "states", NULL};
  static const char *const keys3[] = {"param", "block", "lo", "len", "states", NULL};
  static const char *const keys4[] = {"param", "block", "lo", "len", "states", "stage", "expert", NULL};
  char path[160], name[VR_MAX_NAME + 1], b[96];
  if (get_object(c, it, base) ||
      check_keys(c, it, base, ix->schema_version >= 4 ? keys4 : ix->schema_version >= 3 ? keys3 : keys2))
    return -1;
  snprintf(path, sizeof path, "%s.param", base);
  if (get_str(c, member(it, "param"), path, VR_MAX_NAME, name)) return -1;
  pc->param = lookup(ix, lk, name);
  if (pc->param < 0) return fail(c, "%s: %s is not in params", path, shown(name, b, sizeof b));
  const vr_param *p = &ix->params[pc->param];
  const dopt_layout_piece init = DOPT_LAYOUT_PIECE_INIT;
  pc->lp = init;
  pc->ndim = p->ndim;
  pc->shape = p->shape;
  if (member(it, "block") && parse_block(c, member(it, "block"), base, p, pc)) return -1;
  if (parse_place(c, it, base, ix, pc)) return -1;
  const int64_t extent = dopt_layout_piece_extent(p->ndim, p->shape, &pc->lp); /* the block's elements */
  long long lo = 0, len = extent;
  const cJSON *jlo = member(it, "lo"), *jlen = member(it, "len");
  snprintf(path, sizeof path, "%s.lo", base);
  if (jlo && get_int(c, jlo, path, 0, extent - 1, &lo)) return -1;
  if (jlen || jlo) {
    snprintf(path, sizeof path, "%s.len", base);
    if (get_int(c, jlen, path, 1, extent - lo, &len)) return -1;
  }
  pc->lp.lo = lo;
  pc->lp.len = len;
  const cJSON *st = member(it, "states");
  if (!st) return 0;
  snprintf(path, sizeof path, "%s.states", base);
  if (get_object(c, st, path)) return -1;
  for (const cJSON *s = st->child; s; s = s->next) {
    const char *k = s->string ? s->string : "";
    for (const cJSON *j = s->next; j; j = j->next)
      if (j->string && strcmp(j->string, k) == 0) return fail(c, "%s: duplicate key %s", path, shown(k, b, sizeof b));
    if (pc->nstates == VR_MAX_PIECE_STATES) return fail(c, "%s: more than %d state ranges (the limit)", path, VR_MAX_PIECE_STATES);
    vr_state_range *r = &pc->states[pc->nstates];
    size_t kl = strlen(k);
    if (kl == 0 || kl > VR_MAX_KEY || strchr(k, '/'))
      return fail(c, "%s: state key %s: expected 1..%d bytes without '/'", path, shown(k, b, sizeof b), VR_MAX_KEY);
    memcpy(r->key, k, kl + 1);
    char sp[256];
    int n;
    snprintf(sp, sizeof sp, "%s.%s", path, r->key);
    if (get_array(c, s, sp, 2, 2, &n)) return -1;
    long long slo, slen;
    snprintf(sp, sizeof sp, "%s.%s[0]", path, r->key);
    if (get_int(c, s->child, sp, 0, VR_MAX_NUMEL - 1, &slo)) return -1;
    snprintf(sp, sizeof sp, "%s.%s[1]", path, r->key);
    if (get_int(c, s->child->next, sp, 1, VR_MAX_NUMEL - slo, &slen)) return -1;
    r->lo = slo;
    r->len = slen;
    pc->nstates++;
  }
  return 0;
}

static int parse_files(vctx *c, const cJSON *arr, const char *base, vr_rank *rk, long *total_files, long start) {
  static const char *const keys[] = {"path", "first_step", "last_step", NULL};
  char path[160], b[96];
  snprintf(path, sizeof path, "%s.files", base);
  if (get_array(c, arr, path, 0, VR_MAX_FILES, &rk->nfiles)) return -1;
  *total_files += rk->nfiles;
  if (*total_files > VR_MAX_FILES) return fail(c, "%s: more than %ld files in all ranks (the limit)", path, VR_MAX_FILES);
  rk->files = calloc(rk->nfiles > 0 ? (size_t)rk->nfiles : 1, sizeof *rk->files);
  if (!rk->files) return fail(c, "%s: out of memory", path);
  int i = 0;
  long next = start + 1;
  for (const cJSON *it = arr->child; it; it = it->next, i++) {
    vr_file *f = &rk->files[i];
    snprintf(path, sizeof path, "%s.files[%d]", base, i);
    if (get_object(c, it, path) || check_keys(c, it, path, keys)) return -1;
    snprintf(path, sizeof path, "%s.files[%d].path", base, i);
    if (get_str(c, member(it, "path"), path, VR_MAX_PATH, f->path)) return -1;
    if (!safe_path(f->path))
      return fail(c, "%s: %s: expected a relative path inside the recording (no leading '/', no '..')", path,
                  shown(f->path, b, sizeof b));
    long long first, last;
    snprintf(path, sizeof path, "%s.files[%d].first_step", base, i);
    if (get_int(c, member(it, "first_step"), path, 1, VR_MAX_STEPS, &first)) return -1;
    if (first != next)
      return fail(c, "%s: %lld, expected %ld (files hold contiguous blocks of steps from step %ld)", path, first, next,
                  start + 1);
    snprintf(path, sizeof path, "%s.files[%d].last_step", base, i);
    if (get_int(c, member(it, "last_step"), path, first, VR_MAX_STEPS, &last)) return -1;
    f->first = (long)first;
    f->last = (long)last;
    next = (long)last + 1;
  }
  return 0;
}

/* Every parameter's pieces obey the layout rule (dopt_layout_cover: one block dimension, disjoint or identical,
 * covering, one stage, one expert); the lowest rank's copy of each distinct range is its source. */
static int check_coverage(vctx *c, vr_index *ix, long npieces) {
  dopt_layout_piece *lps = malloc((size_t)(npieces > 0 ? npieces : 1) * sizeof *lps);
  int *ranks = malloc((size_t)(npieces > 0 ? npieces : 1) * sizeof *ranks);
  int *src = malloc((size_t)(npieces > 0 ? npieces : 1) * sizeof *src);
  vr_piece **at = malloc((size_t)(npieces > 0 ? npieces : 1) * sizeof *at);
  long *first = calloc((size_t)ix->nparams + 1, sizeof *first);
  int rc = 0;
  if (!lps || !ranks || !src || !at || !first) rc = fail(c, "ranks: out of memory for %ld pieces", npieces);
  /* the pieces grouped by parameter (a counting sort), each group by rank */
  for (int r = 0; rc == 0 && r < ix->world_size; r++)
    for (int i = 0; i < ix->ranks[r].npieces; i++) first[ix->ranks[r].pieces[i].param + 1]++;
  for (int p = 0; rc == 0 && p < ix->nparams; p++) first[p + 1] += first[p];
  for (int r = 0; rc == 0 && r < ix->world_size; r++)
    for (int i = 0; i < ix->ranks[r].npieces; i++) {
      vr_piece *pc = &ix->ranks[r].pieces[i];
      const long k = first[pc->param]++;
      lps[k] = pc->lp, ranks[k] = r, at[k] = pc;
    }
  for (long p = 0, k0 = 0; rc == 0 && p < ix->nparams; p++) { /* first[p] is now the end of p's group */
    const vr_param *vp = &ix->params[p];
    const size_t n = (size_t)(first[p] - k0);
    if (dopt_layout_cover(vp->name, vp->ndim, vp->shape, lps + k0, ranks + k0, n, src + k0) != DOPT_OK) {
      const char *m = dopt_last_error(), *colon = strchr(m, ':');
      rc = fail(c, "ranks: %s", colon ? colon + 2 : m); /* the line without its status name */
    }
    for (size_t j = 0; rc == 0 && j < n; j++) at[(size_t)k0 + j]->source = src[(size_t)k0 + j];
    k0 = first[p];
  }
  free(lps);
  free(ranks);
  free(src);
  free(at);
  free(first);
  return rc;
}

static int parse_ranks(vctx *c, const cJSON *arr, vr_index *ix, const vr_lookup *lk) {
  static const char *const keys[] = {"rank", "pieces", "files", NULL};
  char path[96];
  if (!arr || !cJSON_IsArray(arr) || cJSON_GetArraySize(arr) != ix->world_size) {
    char b[96];
    if (arr && cJSON_IsArray(arr))
      return fail(c, "ranks: %d entries but world_size is %d (one entry per rank)", cJSON_GetArraySize(arr), ix->world_size);
    return fail(c, "ranks: %s, expected an array", value_text(arr, b, sizeof b));
  }
  ix->ranks = calloc((size_t)ix->world_size, sizeof *ix->ranks);
  int *seen = calloc((size_t)ix->nparams, sizeof *seen);
  if (!ix->ranks || !seen) {
    free(seen);
    return fail(c, "ranks: out of memory");
  }
  long npieces = 0, nfiles = 0;
  int r = 0, rc = 0;
  for (const cJSON *it = arr->child; it && rc == 0; it = it->next, r++) {
    vr_rank *rk = &ix->ranks[r];
    snprintf(path, sizeof path, "ranks[%d]", r);
    if ((rc = get_object(c, it, path)) || (rc = check_keys(c, it, path, keys))) break;
    long long rv;
    snprintf(path, sizeof path, "ranks[%d].rank", r);
    if ((rc = get_int(c, member(it, "rank"), path, 0, ix->world_size - 1, &rv))) break;
    if (rv != r) {
      rc = fail(c, "%s: %lld, expected %d (ranks are listed in order)", path, rv, r);
      break;
    }
    const cJSON *pcs = member(it, "pieces");
    snprintf(path, sizeof path, "ranks[%d].pieces", r);
    if ((rc = get_array(c, pcs, path, 0, ix->nparams, &rk->npieces))) break;
    npieces += rk->npieces;
    if (npieces > VR_MAX_PIECES) {
      rc = fail(c, "%s: more than %ld pieces in all ranks (the limit)", path, VR_MAX_PIECES);
      break;
    }
    rk->pieces = calloc(rk->npieces > 0 ? (size_t)rk->npieces : 1, sizeof *rk->pieces);
    if (!rk->pieces) {
      rc = fail(c, "%s: out of memory", path);
      break;
    }
    int i = 0;
    for (const cJSON *pj = pcs->child; pj && rc == 0; pj = pj->next, i++) {
      char base[96], b[96];
      snprintf(base, sizeof base, "ranks[%d].pieces[%d]", r, i);
      if ((rc = parse_piece(c, pj, base, ix, lk, &rk->pieces[i]))) break;
      int p = rk->pieces[i].param;
      if (seen[p] == r + 1)
        rc = fail(c, "%s.param: %s is listed twice for rank %d", base, shown(ix->params[p].name, b, sizeof b), r);
      seen[p] = r + 1;
    }
    snprintf(path, sizeof path, "ranks[%d]", r);
    if (rc == 0) rc = parse_files(c, member(it, "files"), path, rk, &nfiles, ix->start_step);
    if (rc == 0 && (rk->nfiles ? rk->files[rk->nfiles - 1].last : ix->start_step) != ix->steps)
      rc = fail(c, "ranks[%d].files: cover steps %ld..%ld but steps is %ld", r, ix->start_step + 1,
                rk->nfiles ? rk->files[rk->nfiles - 1].last : ix->start_step, ix->steps);
  }
  free(seen);
  if (rc == 0) rc = check_coverage(c, ix, npieces);
  return rc;
}

static int parse_changes(vctx *c, const cJSON *arr, vr_index *ix) {
  static const char *const keys[] = {"step", "group", "key", "value", NULL};
  char path[96], b[96];
  int n;
  if (!arr) return 0;
  if (get_array(c, arr, "hparam_changes", 0, VR_MAX_CHANGES, &n)) return -1;
  ix->nchanges = n;
  ix->changes = calloc(n > 0 ? (size_t)n : 1, sizeof *ix->changes);
  if (!ix->changes) return fail(c, "hparam_changes: out of memory");
  int i = 0;
  long prev = ix->start_step + 1;
  for (const cJSON *it = arr->child; it; it = it->next, i++) {
    vr_change *ch = &ix->changes[i];
    snprintf(path, sizeof path, "hparam_changes[%d]", i);
    if (get_object(c, it, path) || check_keys(c, it, path, keys)) return -1;
    long long v;
    snprintf(path, sizeof path, "hparam_changes[%d].step", i);
    if (get_int(c, member(it, "step"), path, prev, ix->steps > prev ? ix->steps : prev, &v)) return -1;
    ch->step = (long)v;
    prev = ch->step;
    snprintf(path, sizeof path, "hparam_changes[%d].group", i);
    if (get_int(c, member(it, "group"), path, 0, ix->ngroups - 1, &v)) return -1;
    ch->group = (int)v;
    snprintf(path, sizeof path, "hparam_changes[%d].key", i);
    if (get_str(c, member(it, "key"), path, VR_MAX_KEY, ch->key)) return -1;
    const cJSON *val = member(it, "value");
    snprintf(path, sizeof path, "hparam_changes[%d].value", i);
    if (val && cJSON_IsNumber(val) && isfinite(val->valuedouble)) ch->value = val->valuedouble;
    else if (val && cJSON_IsBool(val)) ch->value = cJSON_IsTrue(val) ? 1.0 : 0.0;
    else if (val && cJSON_IsNull(val)) /* a schedule sets values; replayed, null would be lr=nan */
      return fail(c, "%s: null: a change must set a finite number or true/false", path);
    else return fail(c, "%s: %s, expected a finite number or true/false", path, value_text(val, b, sizeof b));
  }
  return 0;
}

/* A hyperparameter's value in the index: a finite number, true/false (1/0), or null (NaN: unset). */
static int get_hp_value(vctx *c, const cJSON *v, const char *path, double *out) {
  char b[96];
  if (v && cJSON_IsNull(v)) return *out = NAN, 0;
  if (v && cJSON_IsBool(v)) return *out = cJSON_IsTrue(v) ? 1.0 : 0.0, 0;
  if (v && cJSON_IsNumber(v) && isfinite(v->valuedouble)) return *out = v->valuedouble, 0;
  return fail(c, "%s: %s, expected a finite number, true, false or null", path, value_text(v, b, sizeof b));
}

/* hparam_disagreement (schema 4): {"step", "rank", "group", "key", "value", "rank0_value"} */
static int parse_disagreement(vctx *c, const cJSON *dj, vr_index *ix) {
  static const char *const keys[] = {"step", "rank", "group", "key", "value", "rank0_value", NULL};
  long long v;
  if (!dj) return 0;
  if (get_object(c, dj, "hparam_disagreement") || check_keys(c, dj, "hparam_disagreement", keys)) return -1;
  if (get_int(c, member(dj, "step"), "hparam_disagreement.step", ix->start_step + 1,
              ix->steps > ix->start_step ? ix->steps : ix->start_step + 1, &v))
    return -1;
  ix->disagree.step = (long)v;
  if (get_int(c, member(dj, "rank"), "hparam_disagreement.rank", 1, ix->world_size - 1, &v)) return -1;
  ix->disagree.rank = (int)v;
  if (get_int(c, member(dj, "group"), "hparam_disagreement.group", 0, ix->ngroups - 1, &v)) return -1;
  ix->disagree.group = (int)v;
  if (get_str(c, member(dj, "key"), "hparam_disagreement.key", VR_MAX_KEY, ix->disagree.key)) return -1;
  if (get_hp_value(c, member(dj, "value"), "hparam_disagreement.value", &ix->disagree.value)) return -1;
  return get_hp_value(c, member(dj, "rank0_value"), "hparam_disagreement.rank0_value", &ix->disagree.rank0);
}

static int parse_top(vctx *c, const cJSON *root, vr_index *ix, vr_lookup *lk) {
  /* schema 1's keys; schema 2 adds start_step, record.grads and record.projectors, and lets optimizer.name be null;
   * schema 3 adds record.grad_agree (and pieces their block); schema 4 stages and experts (and pieces their stage
   * and expert); schema 5 has schema 4's keys, its grad_agree digests being of each rank's pieces */
  static const char *const keys1[] = {"schema_version", "kind", "generator", "optimizer", "groups", "params", "torch",
                                      "world_size", "record", "ranks", "steps", "complete", "hparam_changes", NULL};
  static const char *const keys2[] = {"schema_version", "kind", "generator", "optimizer", "groups", "params", "torch",
                                      "world_size", "record", "ranks", "steps", "complete", "hparam_changes",
                                      "start_step", NULL};
  static const char *const keys4[] = {"schema_version", "kind", "generator", "optimizer", "groups", "params", "torch",
                                      "world_size", "record", "ranks", "steps", "complete", "hparam_changes",
                                      "start_step", "stages", "experts", "hparam_disagreement", NULL};
  static const char *const keys6[] = {"schema_version", "kind", "generator", "optimizer", "groups", "params", "torch",
                                      "world_size", "record", "ranks", "steps", "complete", "hparam_changes",
                                      "start_step", "stages", "experts", "hparam_disagreement", "construction_steps",
                                      "twin", NULL};
  static const char *const okeys[] = {"name", "upstream", NULL};
  static const char *const tkeys[] = {"version", "cpu_capability", "num_threads", NULL};
  static const char *const rkeys1[] = {"every", "params", "states", "flush_every", NULL};
  static const char *const rkeys2[] = {"every", "params", "states", "flush_every", "grads", "projectors", NULL};
  static const char *const rkeys3[] = {"every", "params", "states", "flush_every", "grads", "projectors", "grad_agree",
                                       NULL};
  static const char *const rkeys6[] = {"every", "params", "states", "flush_every", "grads", "projectors", "grad_agree",
                                       "clip", NULL};
  static const char *const ckeys[] = {"max_norm", "norm_type", NULL};
  static const char *const wkeys[] = {"terms", "construction_steps", "grad_dtype", NULL};
  char b[96];
  long long v;
  if (get_object(c, root, "(top level)")) return -1;
  /* the version first: a newer recorder's index is refused as such, not for an unknown key */
  if (get_int(c, member(root, "schema_version"), "schema_version", 0, 1000000, &v)) return -1;
  if (v < VR_SCHEMA_OLDEST || v > VR_SCHEMA_VERSION)
    return fail(c, "schema_version: %lld is not supported (this distopt reads %d to %d)", v, VR_SCHEMA_OLDEST,
                VR_SCHEMA_VERSION);
  ix->schema_version = (int)v;
  const int v2 = ix->schema_version >= 2;
  const int v6 = ix->schema_version >= 6;
  if (check_keys(c, root, "(top level)", v6 ? keys6 : ix->schema_version >= 4 ? keys4 : v2 ? keys2 : keys1)) return -1;
  const cJSON *kind = member(root, "kind");
  if (!kind || !cJSON_IsString(kind) || strcmp(kind->valuestring, VR_KIND) != 0)
    return fail(c, "kind: %s, expected \"%s\"", value_text(kind, b, sizeof b), VR_KIND);
  const cJSON *gen = member(root, "generator");
  char gbuf[257];
  if (gen && get_str(c, gen, "generator", 256, gbuf)) return -1;
  const cJSON *op = member(root, "optimizer");
  if (get_object(c, op, "optimizer") || check_keys(c, op, "optimizer", okeys)) return -1;
  if (!(v2 && cJSON_IsNull(member(op, "name"))) &&
      get_str(c, member(op, "name"), "optimizer.name", sizeof ix->optimizer - 1, ix->optimizer))
    return -1;
  if (member(op, "upstream") && get_str(c, member(op, "upstream"), "optimizer.upstream", sizeof ix->upstream - 1, ix->upstream))
    return -1;
  const cJSON *tj = member(root, "torch");
  if (tj) {
    if (get_object(c, tj, "torch") || check_keys(c, tj, "torch", tkeys)) return -1;
    if (member(tj, "version") && get_str(c, member(tj, "version"), "torch.version", sizeof ix->torch_version - 1, ix->torch_version))
      return -1;
    if (member(tj, "cpu_capability") &&
        get_str(c, member(tj, "cpu_capability"), "torch.cpu_capability", sizeof ix->cpu_capability - 1, ix->cpu_capability))
      return -1;
    if (member(tj, "num_threads") && get_int(c, member(tj, "num_threads"), "torch.num_threads", 1, 1 << 20, &v)) return -1;
  }
  const cJSON *rj = member(root, "record");
  if (get_object(c, rj, "record") ||
      check_keys(c, rj, "record", v6 ? rkeys6 : ix->schema_version >= 3 ? rkeys3 : v2 ? rkeys2 : rkeys1))
    return -1;
  if (get_int(c, member(rj, "every"), "record.every", 1, VR_MAX_STEPS, &v)) return -1;
  ix->every = (long)v;
  int flag = 0;
  if (member(rj, "params") && get_bool(c, member(rj, "params"), "record.params", &flag)) return -1;
  ix->record_params = member(rj, "params") ? flag : 0;
  if (member(rj, "states") && get_bool(c, member(rj, "states"), "record.states", &flag)) return -1;
  ix->record_states = member(rj, "states") ? flag : 0;
  const cJSON *gj = member(rj, "grads");
  if (gj) {
    if (!cJSON_IsString(gj) || (strcmp(gj->valuestring, "F32") != 0 && strcmp(gj->valuestring, "BF16") != 0))
      return fail(c, "record.grads: %s, expected \"F32\" or \"BF16\"", value_text(gj, b, sizeof b));
    ix->grads = strcmp(gj->valuestring, "BF16") == 0 ? VR_GRADS_BF16 : VR_GRADS_F32;
  }
  if (member(rj, "projectors") && get_bool(c, member(rj, "projectors"), "record.projectors", &ix->projectors)) return -1;
  if (member(rj, "grad_agree") && get_bool(c, member(rj, "grad_agree"), "record.grad_agree", &ix->grad_agree)) return -1;
  if (member(rj, "flush_every") && get_int(c, member(rj, "flush_every"), "record.flush_every", 1, VR_MAX_STEPS, &v)) return -1;
  const cJSON *cj = member(rj, "clip");
  if (cj && !cJSON_IsNull(cj)) { /* schema 6: the gradients before clipping, the norm and coefficient applied */
    if (get_object(c, cj, "record.clip") || check_keys(c, cj, "record.clip", ckeys)) return -1;
    const cJSON *mn = member(cj, "max_norm"), *nt = member(cj, "norm_type");
    if (!mn || !cJSON_IsNumber(mn) || !(mn->valuedouble > 0) || !isfinite(mn->valuedouble))
      return fail(c, "record.clip.max_norm: %s, expected a finite number > 0", value_text(mn, b, sizeof b));
    if (!nt || !cJSON_IsNumber(nt) || nt->valuedouble != 2.0)
      return fail(c, "record.clip.norm_type: %s, expected 2 (the 2-norm; no other is recorded)",
                  value_text(nt, b, sizeof b));
    ix->clip_max_norm = mn->valuedouble;
  }
  if (member(root, "start_step") && get_int(c, member(root, "start_step"), "start_step", 0, VR_MAX_STEPS, &v)) return -1;
  ix->start_step = member(root, "start_step") ? (long)v : 0;
  if (get_int(c, member(root, "steps"), "steps", ix->start_step, VR_MAX_STEPS, &v)) return -1;
  ix->steps = (long)v;
  if (member(root, "construction_steps") &&
      get_int(c, member(root, "construction_steps"), "construction_steps", 0, ix->start_step, &v))
    return -1;
  ix->construction_steps = member(root, "construction_steps") ? (long)v : 0;
  const cJSON *wj = member(root, "twin");
  if (wj && !cJSON_IsNull(wj)) { /* schema 6: a twin's recording (distopt.twin) */
    if (get_object(c, wj, "twin") || check_keys(c, wj, "twin", wkeys)) return -1;
    if (get_int(c, member(wj, "terms"), "twin.terms", 1, 1LL << 30, &v)) return -1;
    ix->twin_terms = (long)v;
    if (get_int(c, member(wj, "construction_steps"), "twin.construction_steps", 0, VR_MAX_STEPS, &v)) return -1;
    ix->twin_construction = (long)v;
    const cJSON *gd = member(wj, "grad_dtype");
    if (gd && (!cJSON_IsString(gd) || (strcmp(gd->valuestring, "F32") != 0 && strcmp(gd->valuestring, "BF16") != 0)))
      return fail(c, "twin.grad_dtype: %s, expected \"F32\" or \"BF16\"", value_text(gd, b, sizeof b));
    ix->twin_bf16 = gd && strcmp(gd->valuestring, "BF16") == 0;
  }
  if (get_bool(c, member(root, "complete"), "complete", &ix->complete)) return -1;
  if (get_int(c, member(root, "world_size"), "world_size", 1, VR_MAX_RANKS, &v)) return -1;
  ix->world_size = (int)v;
  if (member(root, "stages") && get_int(c, member(root, "stages"), "stages", 1, VR_MAX_RANKS, &v)) return -1;
  ix->stages = member(root, "stages") ? (int)v : 0;
  if (member(root, "experts") && get_int(c, member(root, "experts"), "experts", 1, VR_MAX_PARAMS, &v)) return -1;
  ix->experts = member(root, "experts") ? (int)v : 0;
  if (parse_groups(c, member(root, "groups"), ix)) return -1;
  if (parse_params(c, member(root, "params"), ix)) return -1;
  lk->order = ix->by_name = malloc((size_t)ix->nparams * sizeof *lk->order);
  if (!lk->order) return fail(c, "params: out of memory");
  for (int i = 0; i < ix->nparams; i++) lk->order[i] = i;
  sort_ix = ix;
  qsort(lk->order, (size_t)ix->nparams, sizeof *lk->order, cmp_param_idx);
  sort_ix = NULL;
  for (int i = 1; i < ix->nparams; i++)
    if (strcmp(ix->params[lk->order[i]].name, ix->params[lk->order[i - 1]].name) == 0)
      return fail(c, "params[%d].name: %s appears twice", lk->order[i] > lk->order[i - 1] ? lk->order[i] : lk->order[i - 1],
                  shown(ix->params[lk->order[i]].name, b, sizeof b));
  if (parse_ranks(c, member(root, "ranks"), ix, lk)) return -1;
  if (parse_changes(c, member(root, "hparam_changes"), ix)) return -1;
  return parse_disagreement(c, member(root, "hparam_disagreement"), ix);
}

int vr_index_parse(const char *text, size_t len, const char *where, vr_index *out, char *err, size_t cap) {
  vctx c = {where ? where : "index.json", err, cap};
  memset(out, 0, sizeof *out);
  if (cap) err[0] = '\0';
  if (len > (size_t)VR_MAX_INDEX_BYTES)
    return fail(&c, "%zu bytes, larger than the limit of %ld", len, VR_MAX_INDEX_BYTES);
  const long nul = dopt__json_nul(text, len);
  if (nul >= 0) return fail(&c, "a NUL character at byte %ld (a string would be cut short there)", nul);
  cJSON *root = cJSON_ParseWithLength(text, len);
  if (!root) {
    const char *at = cJSON_GetErrorPtr();
    long off = at && at >= text && at <= text + len ? (long)(at - text) : -1;
    return fail(&c, "not valid JSON (near byte %ld)", off);
  }
  vr_lookup lk = {NULL};
  int rc = parse_top(&c, root, out, &lk);
  cJSON_Delete(root);
  if (rc) vr_index_free(out);
  return rc;
}

void vr_index_free(vr_index *ix) {
  if (!ix) return;
  for (int g = 0; ix->group_hparams && g < ix->ngroups; g++) free(ix->group_hparams[g]);
  free(ix->group_hparams);
  free(ix->params);
  for (int r = 0; ix->ranks && r < ix->world_size; r++) {
    free(ix->ranks[r].pieces);
    free(ix->ranks[r].files);
  }
  free(ix->ranks);
  free(ix->changes);
  free(ix->by_name);
  memset(ix, 0, sizeof *ix);
}

int vr_index_find_param(const vr_index *ix, const char *name) {
  if (!ix->by_name) return -1;
  int lo = 0, hi = ix->nparams;
  while (lo < hi) {
    int mid = lo + (hi - lo) / 2, r = strcmp(ix->params[ix->by_name[mid]].name, name);
    if (r == 0) return ix->by_name[mid];
    if (r < 0) lo = mid + 1;
    else hi = mid;
  }
  return -1;
}

const vr_piece *vr_rank_piece(const vr_index *ix, int r, int param) {
  if (r < 0 || r >= ix->world_size) return NULL;
  for (int i = 0; i < ix->ranks[r].npieces; i++)
    if (ix->ranks[r].pieces[i].param == param) return &ix->ranks[r].pieces[i];
  return NULL;
}

int64_t vr_piece_run(const vr_piece *pc, int64_t j, int64_t *at) {
  if (j >= pc->lp.len) return 0;
  *at = vr_piece_elem(pc, j);
  if (pc->lp.block_dim < 0) return pc->lp.len - j;
  int64_t span = pc->lp.block_len; /* the block's elements of one index of the dimensions before its own */
  for (int k = pc->lp.block_dim + 1; k < pc->ndim; k++) span *= pc->shape[k];
  const int64_t run = span - (pc->lp.lo + j) % span;
  return run < pc->lp.len - j ? run : pc->lp.len - j;
}

/* Copies piece pc's elements from src to dst, one of them the parameter's flat array (to_param: dst) and the
 * other the piece's own (maybe unaligned: a safetensors tensor's bytes), run by run (vr_piece_run). */
static void piece_copy(const vr_piece *pc, void *dst, const void *src, int to_param) {
  unsigned char *d = dst;
  const unsigned char *s = src;
  int64_t at, n;
  for (int64_t j = 0; (n = vr_piece_run(pc, j, &at)) > 0; j += n) {
    const size_t p = (size_t)at * sizeof(float), own = (size_t)j * sizeof(float);
    memcpy(d + (to_param ? p : own), s + (to_param ? own : p), (size_t)n * sizeof(float));
  }
}

void vr_piece_put(const vr_piece *pc, const void *src, float *param) { piece_copy(pc, param, src, 1); }
void vr_piece_get(const vr_piece *pc, const float *param, float *dst) { piece_copy(pc, dst, param, 0); }
