/* Reading checkpoints (include/distopt/checkpoint.h): the generation a path
 * names, its index and every rank file's header checked on open, and any
 * piece of a tensor served from the saved pieces that overlap it, each
 * checked against its SHA-256. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ckpt_internal.h"

/* ---- reader --------------------------------------------------------------------------- */


static int gen_name_ok(const char *s) {
  if (strncmp(s, "step-", 5) != 0) return 0;
  size_t n = 0;
  for (const char *c = s + 5; *c; c++, n++)
    if (*c < '0' || *c > '9') return 0;
  return n >= 9 && n <= 16;
}

/* The generation a path names: CKPT (its `latest`) or CKPT/step-N. */
static dopt_status resolve_gen(const char *path, char *gen) {
  struct stat sb;
  if (stat(path, &sb) != 0 || !S_ISDIR(sb.st_mode))
    return dopt__fail(DOPT_ERR_NOT_FOUND, "%s: no such checkpoint directory", path);
  char latest[CK_PATH], idx[CK_PATH];
  DOPT_TRY(dopt__path_join(latest, path, "latest"));
  DOPT_TRY(dopt__path_join(idx, path, "index.json"));
  if (access(latest, F_OK) == 0) {
    char *text;
    DOPT_TRY(dopt__read_all(latest, 256, &text, NULL));
    size_t n = strlen(text);
    while (n > 0 && (text[n - 1] == '\n' || text[n - 1] == ' ' || text[n - 1] == '\r')) text[--n] = '\0';
    dopt_status s = gen_name_ok(text) ? dopt__path_join(gen, path, text)
                                      : dopt__fail(DOPT_ERR_FORMAT, "%s: '%s' is not a generation name (step-<N>)",
                                                   latest, text);
    free(text);
    if (s == DOPT_OK && (stat(gen, &sb) != 0 || !S_ISDIR(sb.st_mode)))
      s = dopt__fail(DOPT_ERR_NOT_FOUND, "%s: names %s, which does not exist", latest, gen);
    return s;
  }
  if (access(idx, F_OK) == 0) {
    snprintf(gen, CK_PATH, "%s", path);
    return DOPT_OK;
  }
  int ranks = 0; /* rank files without an index: a generation whose save did not finish */
  DIR *d = opendir(path);
  for (struct dirent *e; d && (e = readdir(d)) != NULL;) ranks |= strncmp(e->d_name, "rank-", 5) == 0;
  if (d) closedir(d);
  if (ranks) return dopt__fail(DOPT_ERR_NOT_FOUND, "%s: no index.json: a half-written generation", path);
  return dopt__fail(DOPT_ERR_NOT_FOUND, "%s: neither 'latest' nor index.json: not a checkpoint", path);
}

static int cmp_file_key(const void *x, const void *y) {
  const ck_piece *a = *(ck_piece *const *)x, *b = *(ck_piece *const *)y;
  if (a->file != b->file) return a->file < b->file ? -1 : 1;
  return strcmp(a->key, b->key);
}

/* Opens every rank file: its size, its safetensors header, and for each
 * piece the entry under its key (dtype, stored shape, byte range). */
static dopt_status check_files(dopt_ckpt_reader *r) {
  ck_table *t = &r->t;
  ck_piece **byf = malloc((size_t)(t->np ? t->np : 1) * sizeof *byf);
  if (!byf) return dopt__fail(DOPT_ERR_NO_MEMORY, "%s", r->index_path);
  for (int i = 0; i < t->np; i++) byf[i] = &t->p[i];
  qsort(byf, (size_t)t->np, sizeof *byf, cmp_file_key);
  dopt_status s = DOPT_OK;
  char path[CK_PATH], *hdr = NULL;
  cJSON *h = NULL;
  int k = 0;
  for (int f = 0; f < t->nfiles && s == DOPT_OK; f++) {
    int first = k;
    while (k < t->np && byf[k]->file == f) k++;
    if ((s = dopt__path_join(path, r->gen, t->files[f].name)) != DOPT_OK) break;
    int fd;
    uint64_t size;
    if ((s = dopt__open_read(path, &fd, &size)) != DOPT_OK) break; /* a FIFO or folder there: refused, never waited on */
    unsigned char lenb[8];
    uint64_t hlen = 0;
    if (size != t->files[f].bytes)
      s = dopt__fail(DOPT_ERR_FORMAT, "%s: %llu bytes, index.json says %llu (truncated or replaced)", path,
                     (unsigned long long)size, (unsigned long long)t->files[f].bytes);
    if (s == DOPT_OK) s = dopt__pread_all(fd, lenb, 8, 0, path);
    for (int i = 7; s == DOPT_OK && i >= 0; i--) hlen = (hlen << 8) | lenb[i];
    if (s == DOPT_OK && (hlen > CK_MAX_HEADER || hlen + 8 > t->files[f].bytes))
      s = dopt__fail(DOPT_ERR_FORMAT, "%s: safetensors header length %llu exceeds the file", path,
                     (unsigned long long)hlen);
    if (s == DOPT_OK && !(hdr = malloc((size_t)hlen + 1))) s = dopt__fail(DOPT_ERR_NO_MEMORY, "%s: header", path);
    if (s == DOPT_OK) s = dopt__pread_all(fd, hdr, (size_t)hlen, 8, path);
    close(fd);
    const char *end = NULL;
    if (s == DOPT_OK) {
      hdr[hlen] = '\0';
      s = dopt__json_no_nul(hdr, (size_t)hlen, path, 8);
      h = s != DOPT_OK ? NULL : cJSON_ParseWithLengthOpts(hdr, (size_t)hlen, &end, 0);
      int bad = !h || !cJSON_IsObject(h) || hdr[0] != '{';
      for (const char *c = end; !bad && c && c < hdr + hlen; c++) bad = *c != ' ';
      if (s == DOPT_OK && bad)
        s = dopt__fail(DOPT_ERR_FORMAT, "%s: safetensors header is not a JSON object (corrupted)", path);
    }
    const uint64_t data_len = t->files[f].bytes - 8 - hlen;
    const cJSON *e;
    if (s == DOPT_OK) cJSON_ArrayForEach(e, h) {
      if (strcmp(e->string, "__metadata__") == 0) continue;
      /* the piece with this key (binary search of the file's pieces) */
      int lo = first, hi = k;
      ck_piece *p = NULL;
      while (lo < hi) {
        int mid = lo + (hi - lo) / 2, c = strcmp(byf[mid]->key, e->string);
        if (c == 0) {
          p = byf[mid];
          break;
        }
        if (c < 0) lo = mid + 1;
        else hi = mid;
      }
      if (!p) {
        s = dopt__fail(DOPT_ERR_FORMAT, "%s: key '%s' is not in index.json", path, e->string);
        break;
      }
      if (p->offset) {
        s = dopt__fail(DOPT_ERR_FORMAT, "%s: key '%s' appears twice", path, e->string);
        break;
      }
      dopt_dtype dt;
      int nd;
      int64_t sh[DOPT_MAX_DIMS];
      const cJSON *of;
      char ctx[300];
      snprintf(ctx, sizeof ctx, "key '%s'", e->string);
      if ((s = ck_jdtype(e, "dtype", path, ctx, &dt)) != DOPT_OK || (s = ck_jshape(e, "shape", path, ctx, &nd, sh)) != DOPT_OK ||
          (s = ck_jget(e, "data_offsets", path, ctx, &of)) != DOPT_OK)
        break;
      const cJSON *b0 = cJSON_GetArrayItem(of, 0), *b1 = cJSON_GetArrayItem(of, 1);
      double ob = cJSON_IsNumber(b0) ? b0->valuedouble : -1, oe = cJSON_IsNumber(b1) ? b1->valuedouble : -1;
      int whole = ck_piece_is_whole(&p->pc);
      int64_t flat[1] = {(int64_t)p->pc.len};
      if (dt != p->dtype || !(whole ? ck_same_shape(nd, sh, p->ndim, p->shape) : ck_same_shape(nd, sh, 1, flat))) {
        char a[160];
        dopt__shape_text(nd, sh, a, sizeof a);
        s = dopt__fail(DOPT_ERR_FORMAT, "%s: key '%s' is %s %s, index.json says %s with %zu elements", path, e->string,
                       dopt_dtype_name(dt), a, dopt_dtype_name(p->dtype), p->pc.len);
        break;
      }
      if (cJSON_GetArraySize(of) != 2 || !(ob >= 0 && oe >= ob && oe <= (double)data_len) || ob != floor(ob) ||
          oe != floor(oe) || (size_t)(oe - ob) != p->bytes) {
        s = dopt__fail(DOPT_ERR_FORMAT, "%s: key '%s': data_offsets [%.0f, %.0f] do not hold its %zu bytes inside the "
                       "%llu-byte data", path, e->string, ob, oe, p->bytes, (unsigned long long)data_len);
        break;
      }
      p->offset = 8 + hlen + (uint64_t)ob;
    }
    for (int i = first; s == DOPT_OK && i < k; i++)
      if (!byf[i]->offset)
        s = dopt__fail(DOPT_ERR_FORMAT, "%s: key '%s' (tensor '%s') is missing", path, byf[i]->key, byf[i]->tensor);
    cJSON_Delete(h);
    h = NULL;
    free(hdr);
    hdr = NULL;
  }
  free(byf);
  return s;
}

void dopt_ckpt_close(dopt_ckpt_reader *r) {
  if (!r) return;
  ck_ar_free(&r->meta.ar);
  ck_table_free(&r->t);
  free(r->buf);
  free(r);
}

dopt_status dopt_ckpt_open(const char *path, dopt_ckpt_reader **out) {
  DOPT_CHECK_ARG(path && out, "dopt_ckpt_open: NULL argument");
  *out = NULL;
  dopt_ckpt_reader *r = calloc(1, sizeof *r);
  if (!r || !(r->buf = malloc(CK_CHUNK))) {
    free(r);
    return dopt__fail(DOPT_ERR_NO_MEMORY, "dopt_ckpt_open: %s", path);
  }
  cJSON *j = NULL;
  const char *where = r->index_path, *s;
  int64_t version;
  dopt_status st = resolve_gen(path, r->gen);
  if (st == DOPT_OK) st = dopt__path_join(r->index_path, r->gen, "index.json");
  if (st == DOPT_OK && access(r->index_path, F_OK) != 0)
    st = dopt__fail(DOPT_ERR_NOT_FOUND, "%s: missing: a half-written generation", r->index_path);
  if (st == DOPT_OK) st = ck_read_json(r->index_path, &j);
  if (st == DOPT_OK) st = ck_jstr(j, "format", where, "index", &s);
  if (st == DOPT_OK && strcmp(s, DOPT_CKPT_FORMAT) != 0)
    st = dopt__fail(DOPT_ERR_FORMAT, "%s: format '%s' is not '%s'", where, s, DOPT_CKPT_FORMAT);
  if (st == DOPT_OK) st = ck_jint(j, "version", 0, CK_MAX_INT, where, "index", &version);
  if (st == DOPT_OK && version != DOPT_CKPT_FORMAT_VERSION)
    st = dopt__fail(DOPT_ERR_UNSUPPORTED, "%s: format version %lld is unknown (this library reads version %d)", where,
                    (long long)version, DOPT_CKPT_FORMAT_VERSION);
  if (st == DOPT_OK) st = ck_parse_meta(j, where, &r->meta);
  const cJSON *fs = NULL, *ts = NULL, *e;
  if (st == DOPT_OK) st = ck_jget(j, "files", where, "index", &fs);
  if (st == DOPT_OK) st = ck_jget(j, "tensors", where, "index", &ts);
  if (st == DOPT_OK && (!cJSON_IsArray(fs) || !cJSON_IsArray(ts)))
    st = dopt__fail(DOPT_ERR_FORMAT, "%s: \"files\" and \"tensors\" must be arrays", where);
  if (st == DOPT_OK) cJSON_ArrayForEach(e, fs) {
    const char *nm;
    int64_t bytes;
    int idx;
    if ((st = ck_jstr(e, "name", where, "files[]", &nm)) != DOPT_OK) break;
    if (!ck_rank_file_name_ok(nm)) {
      st = dopt__fail(DOPT_ERR_FORMAT, "%s: file '%s' is not a rank file name", where, nm);
      break;
    }
    for (int f = 0; f < r->t.nfiles; f++)
      if (strcmp(r->t.files[f].name, nm) == 0) st = dopt__fail(DOPT_ERR_FORMAT, "%s: file '%s' listed twice", where, nm);
    if (st != DOPT_OK || (st = ck_jint(e, "bytes", 0, CK_MAX_INT, where, nm, &bytes)) != DOPT_OK ||
        (st = ck_table_add_file(&r->t, nm, (uint64_t)bytes, &idx)) != DOPT_OK)
      break;
  }
  if (st == DOPT_OK) cJSON_ArrayForEach(e, ts) {
    ck_tensor owner;
    memset(&owner, 0, sizeof owner);
    const cJSON *ps, *pe;
    if ((st = ck_jstr(e, "name", where, "tensors[]", &owner.name)) != DOPT_OK) break;
    if ((st = ck_jdtype(e, "dtype", where, owner.name, &owner.dtype)) != DOPT_OK ||
        (st = ck_jshape(e, "shape", where, owner.name, &owner.ndim, owner.shape)) != DOPT_OK ||
        (st = ck_jget(e, "pieces", where, owner.name, &ps)) != DOPT_OK)
      break;
    if (!cJSON_IsArray(ps)) {
      st = dopt__fail(DOPT_ERR_FORMAT, "%s: tensor '%s': \"pieces\" is not an array", where, owner.name);
      break;
    }
    if (cJSON_GetArraySize(ps) == 0) {
      st = dopt__fail(DOPT_ERR_FORMAT, "%s: tensor '%s' has no pieces", where, owner.name);
      break;
    }
    cJSON_ArrayForEach(pe, ps) {
      const char *fname;
      if ((st = ck_jstr(pe, "file", where, owner.name, &fname)) != DOPT_OK) break;
      int file = -1;
      for (int f = 0; f < r->t.nfiles; f++)
        if (strcmp(r->t.files[f].name, fname) == 0) file = f;
      if (file < 0) {
        st = dopt__fail(DOPT_ERR_FORMAT, "%s: tensor '%s': piece file '%s' is not in \"files\"", where, owner.name, fname);
        break;
      }
      if ((st = ck_parse_piece(&r->t, pe, file, 0, &owner, where)) != DOPT_OK) break;
    }
    if (st != DOPT_OK) break;
  }
  cJSON_Delete(j);
  if (st == DOPT_OK) st = ck_table_finish(&r->t, where);
  if (st == DOPT_OK) st = ck_check_param_tensors(&r->t, &r->meta.m, where);
  if (st == DOPT_OK) st = check_files(r);
  if (st != DOPT_OK) {
    dopt_ckpt_close(r);
    return st;
  }
  *out = r;
  return DOPT_OK;
}

const char *dopt_ckpt_path(const dopt_ckpt_reader *r) { return r ? r->gen : NULL; }

dopt_status dopt_ckpt_read_meta(const dopt_ckpt_reader *r, const dopt_ckpt_meta **m) {
  DOPT_CHECK_ARG(r && m, "dopt_ckpt_read_meta: NULL argument");
  *m = &r->meta.m;
  return DOPT_OK;
}

static void tensor_info(const ck_tensor *x, dopt_ckpt_tensor_info *out) {
  out->name = x->name;
  out->dtype = x->dtype;
  out->ndim = x->ndim;
  memcpy(out->shape, x->shape, sizeof out->shape);
  out->npieces = x->npieces;
  out->bytes = x->numel * dopt_dtype_size(x->dtype);
}

int dopt_ckpt_num_tensors(const dopt_ckpt_reader *r) { return r ? r->t.nt : 0; }

dopt_status dopt_ckpt_tensor(const dopt_ckpt_reader *r, int i, dopt_ckpt_tensor_info *out) {
  DOPT_CHECK_ARG(r && out, "dopt_ckpt_tensor: NULL argument");
  DOPT_CHECK_ARG(i >= 0 && i < r->t.nt, "dopt_ckpt_tensor: index=%d out of range [0, %d)", i, r->t.nt);
  tensor_info(&r->t.t[i], out);
  return DOPT_OK;
}

dopt_status dopt_ckpt_find(const dopt_ckpt_reader *r, const char *tensor, dopt_ckpt_tensor_info *out) {
  DOPT_CHECK_ARG(r && tensor && out, "dopt_ckpt_find: NULL argument");
  const ck_tensor *x = ck_table_find(&r->t, tensor);
  if (!x) return dopt__fail(DOPT_ERR_NOT_FOUND, "%s: no tensor '%s'", r->index_path, tensor);
  tensor_info(x, out);
  return DOPT_OK;
}

/* Reads one saved piece whole in chunks, hashing it; the elements that lie
 * in `want` go to out (want NULL: verify only). */
static dopt_status read_piece(dopt_ckpt_reader *r, const ck_tensor *x, const ck_piece *p, const dopt_piece *want,
                              void *out, size_t *got) {
  char path[CK_PATH];
  DOPT_TRY(dopt__path_join(path, r->gen, r->t.files[p->file].name));
  int fd;
  DOPT_TRY(dopt__open_read(path, &fd, NULL));
  dopt_digest *d = NULL;
  dopt_status s = dopt_digest_create(&d);
  const size_t es = dopt_dtype_size(x->dtype), chunk = CK_CHUNK / es;
  for (size_t e0 = 0; s == DOPT_OK && e0 < p->pc.len; e0 += chunk) {
    size_t e1 = p->pc.len - e0 < chunk ? p->pc.len : e0 + chunk;
    s = dopt__pread_all(fd, r->buf, (e1 - e0) * es, p->offset + e0 * es, path);
    if (s == DOPT_OK) s = dopt_digest_bytes(d, r->buf, (e1 - e0) * es);
    if (s == DOPT_OK && want) *got += ck_scatter(&p->pc, e0, e1, r->buf, want, out, es);
  }
  close(fd);
  char hex[DOPT_DIGEST_HEX];
  if (s == DOPT_OK) s = dopt_digest_final(d, NULL, hex);
  dopt_digest_destroy(d);
  if (s == DOPT_OK && strcmp(hex, p->sha) != 0)
    s = dopt__fail(DOPT_ERR_FORMAT, "%s: tensor '%s' key '%s': SHA-256 %.16s... does not match index.json's %.16s... "
                   "(corrupted)", path, x->name, p->key, hex, p->sha);
  return s;
}

dopt_status dopt_ckpt_get(dopt_ckpt_reader *r, const char *tensor, const dopt_piece *want, void *out) {
  DOPT_CHECK_ARG(r && tensor && want && (out || want->len == 0), "dopt_ckpt_get: NULL argument");
  const ck_tensor *x = ck_table_find(&r->t, tensor);
  if (!x) return dopt__fail(DOPT_ERR_NOT_FOUND, "%s: no tensor '%s'", r->index_path, tensor);
  DOPT_TRY(ck_check_piece(DOPT_ERR_INVALID_ARG, "dopt_ckpt_get", tensor, x->ndim, x->shape, want));
  size_t got = 0;
  for (int k = 0; k < x->npieces; k++) {
    const ck_piece *p = x->pieces[k];
    if (p->pc.len == 0 || want->len == 0 || !ck_blocks_meet(&p->pc, want)) continue;
    if (ck_scatter(&p->pc, 0, p->pc.len, NULL, want, NULL, 0) == 0) continue; /* no element in common: not read */
    DOPT_TRY(read_piece(r, x, p, want, out, &got));
  }
  if (got != want->len) /* cannot happen after the cover check */
    return dopt__fail(DOPT_ERR_FORMAT, "%s: tensor '%s': the pieces gave %zu of %zu elements", r->index_path, tensor,
                      got, want->len);
  return DOPT_OK;
}

dopt_status dopt_ckpt_verify(dopt_ckpt_reader *r) {
  DOPT_CHECK_ARG(r != NULL, "dopt_ckpt_verify: reader=NULL");
  for (int i = 0; i < r->t.nt; i++)
    for (int k = 0; k < r->t.t[i].npieces; k++) DOPT_TRY(read_piece(r, &r->t.t[i], r->t.t[i].pieces[k], NULL, NULL, NULL));
  return DOPT_OK;
}
