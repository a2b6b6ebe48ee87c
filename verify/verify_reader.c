/* Reading a recording (verify/verify.h, docs/verify.md): the index, each
 * parameter's source pieces, and the tensor files one block per rank at a
 * time, checked against the index when loaded. Shared by `distopt verify`
 * (verify/, the verifier) and `distopt compare --trace` on a recording (compare/source.c). */
#include "verify.h"

#include "files.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static dopt_status rfail(vr_reader *rd, dopt_status s, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;

static dopt_status rfail(vr_reader *rd, dopt_status s, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(rd->err, sizeof rd->err, fmt, ap);
  va_end(ap);
  return s;
}

/* A library call's failure: its message (as `distopt verify` printed it before the reader). */
static dopt_status lib_fail(vr_reader *rd, dopt_status s) {
  const char *msg = dopt_last_error();
  return rfail(rd, s, "%s", *msg ? msg : dopt_status_str(s));
}

/* ---- the index ---------------------------------------------------------------------------- */

static dopt_status load_index(vr_reader *rd, const char *trace) {
  struct stat sb;
  size_t tl = strlen(trace);
  if (tl >= sizeof rd->dir - 16) return rfail(rd, DOPT_ERR_INVALID_ARG, "TRACE '%.64s...': path too long", trace);
  if (stat(trace, &sb) != 0) return rfail(rd, DOPT_ERR_IO, "%s: %s", trace, strerror(errno));
  if (S_ISDIR(sb.st_mode)) {
    memcpy(rd->dir, trace, tl + 1);
    snprintf(rd->index_path, sizeof rd->index_path, "%s/index.json", rd->dir);
  } else {
    snprintf(rd->index_path, sizeof rd->index_path, "%s", trace);
    const char *slash = strrchr(trace, '/');
    if (slash) {
      memcpy(rd->dir, trace, (size_t)(slash - trace));
      rd->dir[slash - trace] = '\0';
      if (!rd->dir[0]) strcpy(rd->dir, "/");
    } else strcpy(rd->dir, ".");
  }
  char *text; /* a regular file: a FIFO there is refused, never waited on */
  size_t n;
  dopt_status s = dopt__read_all(rd->index_path, VR_MAX_INDEX_BYTES, &text, &n);
  if (s != DOPT_OK) return lib_fail(rd, s);
  int rc = vr_index_parse(text, n, rd->index_path, &rd->ix, rd->err, sizeof rd->err);
  free(text);
  return rc ? DOPT_ERR_FORMAT : DOPT_OK;
}

dopt_status vr_reader_open(vr_reader *rd, const char *path) {
  memset(rd, 0, sizeof *rd);
  dopt_status s = load_index(rd, path);
  if (s != DOPT_OK) return s;
  const vr_index *ix = &rd->ix;
  int np = ix->nparams;
  rd->nsrc = calloc(np > 0 ? (size_t)np : 1, sizeof *rd->nsrc);
  rd->src = calloc(np > 0 ? (size_t)np : 1, sizeof *rd->src);
  rd->cur = malloc((size_t)ix->world_size * sizeof *rd->cur);
  rd->f = calloc((size_t)ix->world_size, sizeof *rd->f);
  if (!rd->nsrc || !rd->src || !rd->cur || !rd->f) return rfail(rd, DOPT_ERR_NO_MEMORY, "out of memory");
  for (int r = 0; r < ix->world_size; r++) {
    rd->cur[r] = -1;
    for (int i = 0; i < ix->ranks[r].npieces; i++)
      if (ix->ranks[r].pieces[i].source) rd->nsrc[ix->ranks[r].pieces[i].param]++;
  }
  for (int p = 0; p < np; p++) {
    rd->src[p] = calloc(rd->nsrc[p] > 0 ? (size_t)rd->nsrc[p] : 1, sizeof *rd->src[p]);
    if (!rd->src[p]) return rfail(rd, DOPT_ERR_NO_MEMORY, "out of memory");
    rd->nsrc[p] = 0;
  }
  for (int r = 0; r < ix->world_size; r++)
    for (int i = 0; i < ix->ranks[r].npieces; i++) {
      const vr_piece *pc = &ix->ranks[r].pieces[i];
      if (pc->source) rd->src[pc->param][rd->nsrc[pc->param]++] = (vr_source){r, pc};
    }
  return DOPT_OK;
}

void vr_reader_close(vr_reader *rd) {
  for (int p = 0; rd->src && p < rd->ix.nparams; p++) free(rd->src[p]);
  free(rd->src);
  free(rd->nsrc);
  for (int r = 0; rd->f && r < rd->ix.world_size; r++) dopt_st_free(rd->f[r]);
  free(rd->f);
  free(rd->cur);
  vr_index_free(&rd->ix);
  memset(rd, 0, sizeof *rd);
}

/* ---- tensor files ------------------------------------------------------------------------- */

/* Parses "<t>/" at s: the step (decimal, no sign or leading zero); returns the rest or NULL. */
static const char *parse_step(const char *s, long *t) {
  long v = 0;
  int nd = 0;
  while (s[nd] >= '0' && s[nd] <= '9' && nd < 9) v = v * 10 + (s[nd] - '0'), nd++;
  if (nd == 0 || s[nd] != '/' || s[0] == '0') return NULL;
  *t = v;
  return s + nd + 1;
}

static int piece_index(const vr_index *ix, int r, int param) {
  const vr_rank *rk = &ix->ranks[r];
  for (int i = 0; i < rk->npieces; i++)
    if (rk->pieces[i].param == param) return i;
  return -1;
}

/* Every tensor of rank r's file k: a known kind, a step inside the file's block, a parameter
 * of the rank's layout, F32 with the piece's element count (states: checked when compared). */
static dopt_status check_file(vr_reader *rd, int r, int k, const char *fpath) {
  const vr_index *ix = &rd->ix;
  const vr_file *vf = &ix->ranks[r].files[k];
  const dopt_st_file *f = rd->f[r];
  const dopt_status E = DOPT_ERR_FORMAT;
  const char *meta_rank = dopt_st_meta(f, "rank");
  if (meta_rank) {
    char want[16];
    snprintf(want, sizeof want, "%d", r);
    if (strcmp(meta_rank, want) != 0)
      return rfail(rd, E, "%s: metadata rank '%.32s' but the index lists it for rank %d", fpath, meta_rank, r);
  }
  int n = dopt_st_count(f);
  for (int i = 0; i < n; i++) {
    dopt_st_tensor t;
    dopt_st_get(f, i, &t);
    const char *nm = t.name, *rest = NULL, *kind;
    long step = 0;
    char pname[VR_MAX_NAME + 1], key[VR_MAX_KEY + 1] = "";
    /* kinds: init, init_state (a window's states at its start), grad, grad_digest, param, state, proj,
     * grad_agree (schema 3 with record.grad_agree: of any parameter, held or not), clipped_digest and clip (schema
     * 6 with record.clip), grad_abs (a twin's) */
    static const char *const stepped[] = {"grad_digest", "grad_agree", "grad", "param", "state", "proj",
                                          "clipped_digest", "grad_abs", "clip", NULL};
    const int v2 = ix->schema_version >= 2;
    /* each kind's schema: 0, 1: grad_digest and grad_agree (2, record.grad_agree); 2-4 any; 5 (2); 6-8 (6 with
     * record.clip: the clip's digests and clip/<t>/norm|coef; a twin's grad_abs) */
    const int allowed[] = {v2, ix->grad_agree, 1, 1, 1, v2, ix->clip_max_norm > 0, ix->twin_terms > 0,
                           ix->clip_max_norm > 0};
    int keyed = 0; /* the name ends in /<key> */
    kind = NULL;
    if (strncmp(nm, "init/", 5) == 0 || (v2 && strncmp(nm, "init_state/", 11) == 0)) {
      kind = nm[4] == '/' ? "init" : "init_state";
      rest = nm + strlen(kind) + 1;
      keyed = kind[4] == '_';
      if (k != 0) return rfail(rd, E, "%s: tensor '%s': %s/ tensors belong in the rank's first file", fpath, nm, kind);
    } else {
      for (int j = 0; stepped[j] && !kind; j++) {
        size_t kl = strlen(stepped[j]);
        if (strncmp(nm, stepped[j], kl) == 0 && nm[kl] == '/' && allowed[j]) kind = stepped[j];
      }
      if (!kind)
        return rfail(rd, E, "%s: tensor '%s': expected init/, grad/, param/ or state/%s%s%s%s", fpath, nm,
                     v2 ? " (or init_state/, grad_digest/, proj/)" : "", ix->grad_agree ? " or grad_agree/" : "",
                     ix->clip_max_norm > 0 ? " or clip/, clipped_digest/" : "", ix->twin_terms > 0 ? " or grad_abs/" : "");
      keyed = strcmp(kind, "state") == 0 || strcmp(kind, "proj") == 0;
      rest = parse_step(nm + strlen(kind) + 1, &step);
      if (!rest)
        return rfail(rd, E, "%s: tensor '%s': expected %s/<step>/<param>%s with step a decimal integer >= 1", fpath, nm,
                     kind, keyed ? "/<key>" : "");
      if (step < vf->first || step > vf->last)
        return rfail(rd, E, "%s: tensor '%s': step %ld is outside the file's steps %ld..%ld", fpath, nm, step, vf->first,
                     vf->last);
    }
    if (strcmp(kind, "clip") == 0) { /* clip/<t>/norm, clip/<t>/coef: the rank's total norm and coefficient */
      if (strcmp(rest, "norm") != 0 && strcmp(rest, "coef") != 0)
        return rfail(rd, E, "%s: tensor '%s': expected clip/<step>/norm or clip/<step>/coef", fpath, nm);
      if (t.numel != 1 || t.dtype != DOPT_F32)
        return rfail(rd, E, "%s: tensor '%s': one F32 element expected (got %s, %zu elements)", fpath, nm,
                     dopt_dtype_name(t.dtype), t.numel);
      continue;
    }
    size_t rl = strlen(rest);
    if (keyed) {
      const char *slash = strrchr(rest, '/');
      if (!slash || slash == rest || !slash[1] || strlen(slash + 1) > VR_MAX_KEY)
        return rfail(rd, E, "%s: tensor '%s': expected %s/%s<param>/<key> (key 1..%d bytes)", fpath, nm, kind,
                     strcmp(kind, "init_state") == 0 ? "" : "<step>/", VR_MAX_KEY);
      rl = (size_t)(slash - rest);
      snprintf(key, sizeof key, "%s", slash + 1);
    }
    if (rl == 0 || rl > VR_MAX_NAME) return rfail(rd, E, "%s: tensor '%s': bad parameter name", fpath, nm);
    memcpy(pname, rest, rl);
    pname[rl] = '\0';
    int p = vr_index_find_param(ix, pname);
    if (strcmp(kind, "grad_agree") == 0) { /* any parameter of the index: the rank's whole gradient's digest */
      if (p < 0) return rfail(rd, E, "%s: tensor '%s': no parameter '%s' in the index", fpath, nm, pname);
      if (t.numel != 32 || t.dtype != DOPT_U8)
        return rfail(rd, E, "%s: tensor '%s': a gradient digest is 32 U8 (SHA-256; got %s, %zu elements)", fpath, nm,
                     dopt_dtype_name(t.dtype), t.numel);
      continue;
    }
    int pi = p >= 0 ? piece_index(ix, r, p) : -1;
    if (pi < 0) return rfail(rd, E, "%s: tensor '%s': rank %d's layout has no parameter '%s'", fpath, nm, r, pname);
    const vr_piece *pc = &ix->ranks[r].pieces[pi];
    const int is_state = strcmp(kind, "state") == 0 || strcmp(kind, "init_state") == 0;
    const int is_grad = strcmp(kind, "grad") == 0; /* (grad_abs: F32 always) */
    if (strcmp(kind, "grad_digest") == 0 || strcmp(kind, "clipped_digest") == 0) {
      if (t.numel != 32 || t.dtype != DOPT_U8)
        return rfail(rd, E, "%s: tensor '%s': a gradient digest is 32 U8 (SHA-256; got %s, %zu elements)", fpath, nm,
                     dopt_dtype_name(t.dtype), t.numel);
    } else if (is_state && strcmp(key, "step") == 0) {
      if (t.numel != 1 || (t.dtype != DOPT_F32 && t.dtype != DOPT_F64 && t.dtype != DOPT_I64 && t.dtype != DOPT_I32))
        return rfail(rd, E, "%s: tensor '%s': a step count must be one F32, F64, I32 or I64 element (got %s, %zu "
                            "elements)", fpath, nm, dopt_dtype_name(t.dtype), t.numel);
    } else if (t.dtype != (is_grad && ix->grads == VR_GRADS_BF16 ? DOPT_BF16 : DOPT_F32)) {
      return rfail(rd, E, "%s: tensor '%s' is %s, expected %s", fpath, nm, dopt_dtype_name(t.dtype),
                   is_grad && ix->grads == VR_GRADS_BF16 ? "BF16 (record.grads)" : "F32");
    } else if (!keyed && (int64_t)t.numel != pc->lp.len) {
      return rfail(rd, E, "%s: tensor '%s' has %zu elements but rank %d's piece of '%s' has %lld", fpath, nm, t.numel,
                   r, pname, (long long)pc->lp.len);
    }
    if (strcmp(kind, "state") == 0 && rd->on_state &&
        rd->on_state(rd->user, r, pi, key, fpath, nm, rd->err, sizeof rd->err))
      return E;
  }
  return DOPT_OK;
}

static dopt_status load_file(vr_reader *rd, int r, int k) {
  dopt_st_free(rd->f[r]);
  rd->f[r] = NULL;
  rd->cur[r] = k;
  char fpath[4600];
  snprintf(fpath, sizeof fpath, "%s/%s", rd->dir, rd->ix.ranks[r].files[k].path);
  dopt_status s = dopt_st_load(fpath, &rd->f[r]);
  if (s != DOPT_OK) {
    rd->cur[r] = -1;
    return lib_fail(rd, s);
  }
  rd->loads++;
  s = check_file(rd, r, k, fpath);
  if (s != DOPT_OK) { /* not kept: a later seek loads (and reports) it again */
    dopt_st_free(rd->f[r]);
    rd->f[r] = NULL;
    rd->cur[r] = -1;
  }
  return s;
}

dopt_status vr_reader_seek(vr_reader *rd, int r, long t) {
  const vr_rank *rk = &rd->ix.ranks[r];
  int k = rd->cur[r];
  if (k >= 0 && rd->f[r] && rk->files[k].first <= t && t <= rk->files[k].last) return DOPT_OK;
  /* the files are contiguous blocks from step 1 (vr_index_parse): the first whose last step is >= t */
  int lo = 0, hi = rk->nfiles;
  while (lo < hi) {
    int mid = lo + (hi - lo) / 2;
    if (rk->files[mid].last < t) lo = mid + 1;
    else hi = mid;
  }
  if (t <= rd->ix.start_step || lo >= rk->nfiles) return rfail(rd, DOPT_ERR_FORMAT, "rank %d: no file holds step %ld", r, t);
  return load_file(rd, r, lo);
}

dopt_status vr_reader_init(vr_reader *rd, int p, float *out) {
  const vr_index *ix = &rd->ix;
  char key[VR_MAX_NAME + 64];
  snprintf(key, sizeof key, "init/%s", ix->params[p].name);
  for (int k = 0; k < rd->nsrc[p]; k++) {
    const vr_source *sr = &rd->src[p][k];
    dopt_status s = vr_reader_seek(rd, sr->rank, ix->start_step + 1);
    if (s != DOPT_OK) return s;
    dopt_st_tensor t;
    if (dopt_st_find(rd->f[sr->rank], key, &t) != DOPT_OK)
      return rfail(rd, DOPT_ERR_FORMAT, "%s/%s: tensor '%s' is missing (rank %d's first file holds its initial values)",
                   rd->dir, ix->ranks[sr->rank].files[0].path, key, sr->rank);
    vr_piece_put(sr->pc, t.data, out);
  }
  return DOPT_OK;
}

dopt_status vr_reader_grad(vr_reader *rd, int p, long t, float *out, int *present) {
  const vr_index *ix = &rd->ix;
  char key[VR_MAX_NAME + 64], dkey[VR_MAX_NAME + 64];
  snprintf(key, sizeof key, "grad/%ld/%s", t, ix->params[p].name);
  snprintf(dkey, sizeof dkey, "grad_digest/%ld/%s", t, ix->params[p].name);
  static const char *const what[] = {"records only a digest of", "records no", "records"};
  int seen = -2;
  for (int k = 0; k < rd->nsrc[p]; k++) {
    const vr_source *sr = &rd->src[p][k];
    dopt_status s = vr_reader_seek(rd, sr->rank, t);
    if (s != DOPT_OK) return s;
    dopt_st_tensor g, d;
    int has = dopt_st_find(rd->f[sr->rank], key, &g) == DOPT_OK ? 1
              : dopt_st_find(rd->f[sr->rank], dkey, &d) == DOPT_OK ? -1
                                                                    : 0;
    if (seen > -2 && has != seen)
      return rfail(rd, DOPT_ERR_FORMAT, "step %ld: parameter '%s': rank %d %s a gradient but rank %d %s one", t,
                   ix->params[p].name, sr->rank, what[has + 1], rd->src[p][0].rank, what[seen + 1]);
    seen = has;
    if (has != 1) continue;
    if (g.dtype == DOPT_BF16) { /* widened exactly: the bf16 bits are the top half of the f32's */
      const unsigned char *b = g.data;
      int64_t at, m;
      for (int64_t j = 0; (m = vr_piece_run(sr->pc, j, &at)) > 0; j += m)
        for (int64_t i = j; i < j + m; i++) {
          uint32_t u = (uint32_t)((unsigned)b[2 * i] | (unsigned)b[2 * i + 1] << 8) << 16;
          memcpy(out + at + (i - j), &u, sizeof u);
        }
    } else {
      vr_piece_put(sr->pc, g.data, out);
    }
  }
  if (seen == -1 && !rd->allow_digest)
    return rfail(rd, DOPT_ERR_FORMAT, "step %ld: parameter '%s': the recording keeps only the digest of its gradient "
                                      "(grad_digest/): this step cannot be replayed", t, ix->params[p].name);
  *present = seen < -1 ? 0 : seen;
  return DOPT_OK;
}

const unsigned char *vr_reader_digest(vr_reader *rd, int r, long t, const char *name) {
  if (vr_reader_seek(rd, r, t) != DOPT_OK) return NULL;
  dopt_st_tensor x;
  if (dopt_st_find(rd->f[r], name, &x) != DOPT_OK || x.dtype != DOPT_U8 || x.numel != 32) return NULL;
  return x.data;
}

const void *vr_reader_f32(vr_reader *rd, int r, long t, const char *name, size_t *numel) {
  if (vr_reader_seek(rd, r, t) != DOPT_OK) return NULL;
  dopt_st_tensor x;
  if (dopt_st_find(rd->f[r], name, &x) != DOPT_OK || x.dtype != DOPT_F32) return NULL;
  *numel = x.numel;
  return x.data;
}
