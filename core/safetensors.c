/* safetensors reader/writer on cJSON (see include/distopt/safetensors.h). */
#include "distopt/safetensors.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "files.h"
#include "index.h"
#include "optim_impl.h"

/* Header larger than this is rejected (the format's own readers use 100 MB). */
#define ST_MAX_HEADER (100u * 1024u * 1024u)

struct dopt_st_file {
  char *path;
  unsigned char *buf; /* the data buffer (after the header); NULL when streamed (dopt_st_open) */
  size_t buf_len;
  int fd;             /* streamed: the open file, read with pread (thread-safe); else -1 */
  uint64_t data_at;   /* the data buffer's offset in the file: 8 + header length */
  size_t *off;        /* [n] each tensor's data offset in the buffer */
  cJSON *header;
  dopt_st_tensor *t;
  int n;
  int *by_name; /* [n] indices of t sorted by name: duplicates and lookups in O(n log n) / O(log n) */
};

static int dtype_from_name(const char *s) {
  for (int d = 0; d < DOPT_DTYPE_COUNT_; d++)
    if (strcmp(dopt_dtype_name((dopt_dtype)d), s) == 0) return d;
  return -1;
}

/* Orders (offset, bytes, index) triples by offset. */
typedef struct st_span {
  size_t off, bytes;
  int i;
} st_span;

static int cmp_offsets(const void *a, const void *b) {
  const st_span *x = a, *y = b;
  return x->off < y->off ? -1 : x->off > y->off;
}

void dopt_st_free(dopt_st_file *f) {
  if (!f) return;
  free(f->path);
  free(f->buf);
  free(f->off);
  if (f->fd >= 0) close(f->fd);
  cJSON_Delete(f->header);
  free(f->t);
  free(f->by_name);
  free(f);
}

/* Parses one tensor entry of the header. */
static dopt_status parse_entry(dopt_st_file *f, const cJSON *e, dopt_st_tensor *t, size_t *toff) {
  const char *p = f->path;
  t->name = e->string;
  if (!cJSON_IsObject(e)) return dopt__fail(DOPT_ERR_FORMAT, "%s: tensor '%s': entry is not an object", p, t->name);
  const cJSON *dt = cJSON_GetObjectItemCaseSensitive(e, "dtype");
  const cJSON *sh = cJSON_GetObjectItemCaseSensitive(e, "shape");
  const cJSON *off = cJSON_GetObjectItemCaseSensitive(e, "data_offsets");
  if (!cJSON_IsString(dt)) return dopt__fail(DOPT_ERR_FORMAT, "%s: tensor '%s': missing dtype", p, t->name);
  int d = dtype_from_name(dt->valuestring);
  if (d < 0)
    return dopt__fail(DOPT_ERR_UNSUPPORTED, "%s: tensor '%s': dtype '%s' not supported", p, t->name, dt->valuestring);
  t->dtype = (dopt_dtype)d;
  if (!cJSON_IsArray(sh)) return dopt__fail(DOPT_ERR_FORMAT, "%s: tensor '%s': missing shape", p, t->name);
  int nd = cJSON_GetArraySize(sh);
  if (nd > DOPT_MAX_DIMS)
    return dopt__fail(DOPT_ERR_UNSUPPORTED, "%s: tensor '%s': ndim=%d > %d", p, t->name, nd, DOPT_MAX_DIMS);
  t->ndim = nd;
  t->numel = 1;
  for (int i = 0; i < nd; i++) {
    const cJSON *x = cJSON_GetArrayItem(sh, i);
    if (!cJSON_IsNumber(x) || x->valuedouble < 0 || x->valuedouble != floor(x->valuedouble) || x->valuedouble > 9e15)
      return dopt__fail(DOPT_ERR_FORMAT, "%s: tensor '%s': shape[%d] is not a non-negative integer", p, t->name, i);
    t->shape[i] = (int64_t)x->valuedouble;
    if (t->shape[i] > 0 && t->numel > SIZE_MAX / (size_t)t->shape[i])
      return dopt__fail(DOPT_ERR_FORMAT, "%s: tensor '%s': shape overflows", p, t->name);
    t->numel *= (size_t)t->shape[i];
  }
  if (!cJSON_IsArray(off) || cJSON_GetArraySize(off) != 2)
    return dopt__fail(DOPT_ERR_FORMAT, "%s: tensor '%s': data_offsets must be [begin, end]", p, t->name);
  double b = cJSON_GetArrayItem(off, 0)->valuedouble, en = cJSON_GetArrayItem(off, 1)->valuedouble;
  if (b >= 0 && en >= 0 && en < b)
    return dopt__fail(DOPT_ERR_FORMAT, "%s: tensor '%s': data_offsets [%.0f, %.0f] are reversed (end < begin)", p,
                      t->name, b, en);
  if (!(b >= 0 && en >= b && en <= (double)f->buf_len) || b != floor(b) || en != floor(en))
    return dopt__fail(DOPT_ERR_FORMAT, "%s: tensor '%s': data_offsets [%.0f, %.0f] outside the %zu-byte buffer", p,
                      t->name, b, en, f->buf_len);
  t->bytes = (size_t)en - (size_t)b;
  if (t->numel > SIZE_MAX / dopt_dtype_size(t->dtype)) /* numel · size wraps (e.g. [2^31, 2^31] F32 = 2^64 bytes) */
    return dopt__fail(DOPT_ERR_FORMAT, "%s: tensor '%s': %zu x %s elements overflow the byte count", p, t->name,
                      t->numel, dopt_dtype_name(t->dtype));
  if (t->bytes != t->numel * dopt_dtype_size(t->dtype))
    return dopt__fail(DOPT_ERR_FORMAT, "%s: tensor '%s': %zu bytes for %zu x %s elements", p, t->name, t->bytes,
                      t->numel, dopt_dtype_name(t->dtype));
  *toff = (size_t)b;
  t->data = f->buf ? f->buf + (size_t)b : NULL;
  return DOPT_OK;
}

/* Sorts f->by_name by the tensors' names (a merge sort: qsort has no context
 * argument in C11, and the names live in f->t). */
static void sort_by_name(dopt_st_file *f) {
  int n = f->n, *a = f->by_name, *tmp = malloc((size_t)(n ? n : 1) * sizeof *tmp);
  if (!tmp) { /* insertion sort: correct, only slower */
    for (int i = 1; i < n; i++)
      for (int j = i; j > 0 && strcmp(f->t[a[j - 1]].name, f->t[a[j]].name) > 0; j--) {
        int x = a[j];
        a[j] = a[j - 1];
        a[j - 1] = x;
      }
    return;
  }
  for (int w = 1; w < n; w *= 2) {
    for (int lo = 0; lo < n; lo += 2 * w) {
      int mid = lo + w < n ? lo + w : n, hi = lo + 2 * w < n ? lo + 2 * w : n, i = lo, j = mid, k = lo;
      while (i < mid && j < hi) tmp[k++] = strcmp(f->t[a[i]].name, f->t[a[j]].name) <= 0 ? a[i++] : a[j++];
      while (i < mid) tmp[k++] = a[i++];
      while (j < hi) tmp[k++] = a[j++];
    }
    memcpy(a, tmp, (size_t)n * sizeof *a);
  }
  free(tmp);
}

/* The header (validated whole), and the data buffer read (stream 0) or left in the file (stream 1). */
static dopt_status st_read(const char *path, int stream, dopt_st_file **out) {
  *out = NULL;
  FILE *fp; /* a regular file only: a folder, FIFO or device is refused, never waited on */
  dopt_status s = dopt__fopen_read(path, &fp, NULL);
  if (s == DOPT_ERR_NOT_FOUND) return dopt__fail(DOPT_ERR_IO, "%s: cannot open: %s", path, strerror(ENOENT));
  if (s != DOPT_OK) return s;
  dopt_st_file *f = calloc(1, sizeof *f);
  char *hdr = NULL;
  if (f) f->fd = -1;
  unsigned char lenb[8];
  if (!f || !(f->path = malloc(strlen(path) + 1))) {
    s = dopt__fail(DOPT_ERR_NO_MEMORY, "%s: load", path);
    goto done;
  }
  strcpy(f->path, path);
  if (fseek(fp, 0, SEEK_END) != 0) {
    s = dopt__fail(DOPT_ERR_IO, "%s: cannot seek", path);
    goto done;
  }
  long fsz = ftell(fp);
  rewind(fp);
  if (fsz < 8 || fread(lenb, 1, 8, fp) != 8) {
    s = dopt__fail(DOPT_ERR_FORMAT, "%s: truncated: %ld bytes, no 8-byte header length", path, fsz);
    goto done;
  }
  uint64_t hlen = 0;
  for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | lenb[i];
  if (hlen > (uint64_t)fsz - 8) {
    s = dopt__fail(DOPT_ERR_FORMAT, "%s: header length %llu exceeds the file (%ld bytes)", path,
                   (unsigned long long)hlen, fsz);
    goto done;
  }
  if (hlen > ST_MAX_HEADER) {
    s = dopt__fail(DOPT_ERR_FORMAT, "%s: header length %llu is over the limit of %u bytes (ST_MAX_HEADER)", path,
                   (unsigned long long)hlen, ST_MAX_HEADER);
    goto done;
  }
  hdr = malloc((size_t)hlen + 1);
  f->buf_len = (size_t)((uint64_t)fsz - 8 - hlen);
  f->data_at = 8 + hlen;
  if (!stream) f->buf = malloc(f->buf_len ? f->buf_len : 1);
  if (!hdr || (!stream && !f->buf)) {
    s = dopt__fail(DOPT_ERR_NO_MEMORY, "%s: %ld bytes", path, fsz);
    goto done;
  }
  if (fread(hdr, 1, (size_t)hlen, fp) != hlen || (!stream && fread(f->buf, 1, f->buf_len, fp) != f->buf_len)) {
    s = dopt__fail(DOPT_ERR_IO, "%s: short read", path);
    goto done;
  }
  if (stream && (f->fd = dup(fileno(fp))) < 0) {
    s = dopt__fail(DOPT_ERR_IO, "%s: %s", path, strerror(errno));
    goto done;
  }
  hdr[hlen] = '\0';
  if ((s = dopt__json_no_nul(hdr, (size_t)hlen, path, 8)) != DOPT_OK) goto done;
  f->header = cJSON_ParseWithLength(hdr, (size_t)hlen);
  if (!f->header || !cJSON_IsObject(f->header)) {
    s = dopt__fail(DOPT_ERR_FORMAT, "%s: header is not a JSON object", path);
    goto done;
  }
  int n = 0;
  const cJSON *e;
  cJSON_ArrayForEach(e, f->header) n += strcmp(e->string, "__metadata__") != 0;
  f->t = calloc((size_t)(n ? n : 1), sizeof *f->t);
  f->off = calloc((size_t)(n ? n : 1), sizeof *f->off);
  if (!f->t || !f->off) {
    s = dopt__fail(DOPT_ERR_NO_MEMORY, "%s: %d tensors", path, n);
    goto done;
  }
  cJSON_ArrayForEach(e, f->header) {
    if (strcmp(e->string, "__metadata__") == 0) {
      const cJSON *m;
      if (!cJSON_IsObject(e)) {
        s = dopt__fail(DOPT_ERR_FORMAT, "%s: __metadata__ is not an object", path);
        goto done;
      }
      cJSON_ArrayForEach(m, e) if (!cJSON_IsString(m)) {
        s = dopt__fail(DOPT_ERR_FORMAT, "%s: __metadata__['%s'] is not a string", path, m->string);
        goto done;
      }
      continue;
    }
    if ((s = parse_entry(f, e, &f->t[f->n], &f->off[f->n])) != DOPT_OK) goto done;
    f->n++;
  }
  /* the name index; a name twice is adjacent in it */
  f->by_name = malloc((size_t)(f->n ? f->n : 1) * sizeof *f->by_name);
  if (!f->by_name) {
    s = dopt__fail(DOPT_ERR_NO_MEMORY, "%s: %d tensors", path, f->n);
    goto done;
  }
  for (int i = 0; i < f->n; i++) f->by_name[i] = i;
  sort_by_name(f);
  for (int i = 1; i < f->n; i++)
    if (strcmp(f->t[f->by_name[i - 1]].name, f->t[f->by_name[i]].name) == 0) {
      s = dopt__fail(DOPT_ERR_FORMAT, "%s: tensor '%s' appears twice", path, f->t[f->by_name[i]].name);
      goto done;
    }
  /* no two tensors may share bytes */
  {
    st_span *sorted = malloc((size_t)(f->n ? f->n : 1) * sizeof *sorted);
    if (!sorted) {
      s = dopt__fail(DOPT_ERR_NO_MEMORY, "%s", path);
      goto done;
    }
    for (int i = 0; i < f->n; i++) sorted[i] = (st_span){f->off[i], f->t[i].bytes, i};
    qsort(sorted, (size_t)f->n, sizeof *sorted, cmp_offsets);
    for (int i = 1; i < f->n; i++) {
      if (sorted[i].off < sorted[i - 1].off + sorted[i - 1].bytes) {
        s = dopt__fail(DOPT_ERR_FORMAT, "%s: tensors '%s' and '%s' overlap", path, f->t[sorted[i - 1].i].name,
                       f->t[sorted[i].i].name);
        break;
      }
    }
    free(sorted);
  }
done:
  fclose(fp);
  free(hdr);
  if (s != DOPT_OK) {
    dopt_st_free(f);
    return s;
  }
  *out = f;
  return DOPT_OK;
}

dopt_status dopt_st_load(const char *path, dopt_st_file **out) {
  DOPT_CHECK_ARG(path && out, "dopt_st_load: path/out NULL");
  return st_read(path, 0, out);
}

dopt_status dopt_st_open(const char *path, dopt_st_file **out) {
  DOPT_CHECK_ARG(path && out, "dopt_st_open: path/out NULL");
  return st_read(path, 1, out);
}

int dopt_st_count(const dopt_st_file *f) { return f ? f->n : 0; }

dopt_status dopt_st_get(const dopt_st_file *f, int i, dopt_st_tensor *out) {
  DOPT_CHECK_ARG(f && out, "dopt_st_get: file/out NULL");
  DOPT_CHECK_ARG(i >= 0 && i < f->n, "dopt_st_get: index=%d out of range [0, %d)", i, f->n);
  *out = f->t[i];
  return DOPT_OK;
}

/* The tensor's index by a binary search of the name index; -1 when absent. */
static int find_index(const dopt_st_file *f, const char *name) {
  int lo = 0, hi = f->n;
  while (lo < hi) {
    int mid = lo + (hi - lo) / 2, c = strcmp(f->t[f->by_name[mid]].name, name);
    if (c == 0) return f->by_name[mid];
    if (c < 0) lo = mid + 1;
    else hi = mid;
  }
  return -1;
}

dopt_status dopt_st_find(const dopt_st_file *f, const char *name, dopt_st_tensor *out) {
  DOPT_CHECK_ARG(f && name && out, "dopt_st_find: NULL argument");
  const int i = find_index(f, name);
  if (i < 0) return dopt__fail(DOPT_ERR_NOT_FOUND, "%s: no tensor '%s'", f->path, name);
  *out = f->t[i];
  return DOPT_OK;
}

const char *dopt_st_meta(const dopt_st_file *f, const char *key) {
  if (!f || !key) return NULL;
  const cJSON *m = cJSON_GetObjectItemCaseSensitive(f->header, "__metadata__");
  const cJSON *v = m ? cJSON_GetObjectItemCaseSensitive(m, key) : NULL;
  return cJSON_IsString(v) ? v->valuestring : NULL;
}

/* n bytes at the tensor's byte offset `at` (from its start) into dst: from the buffer, or read from the file. */
static dopt_status read_span(const dopt_st_file *f, const char *name, int idx, size_t at, size_t n, void *dst) {
  if (f->buf) {
    memcpy(dst, (const unsigned char *)f->t[idx].data + at, n);
    return DOPT_OK;
  }
  unsigned char *d = dst;
  uint64_t pos = f->data_at + f->off[idx] + at;
  while (n > 0) {
    const size_t want = n < ((size_t)1 << 30) ? n : ((size_t)1 << 30);
    const ssize_t got = pread(f->fd, d, want, (off_t)pos);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0)
      return dopt__fail(DOPT_ERR_IO, "%s: tensor '%s': %s at byte %llu", f->path, name,
                        got < 0 ? strerror(errno) : "the file ends", (unsigned long long)pos);
    d += got, pos += (uint64_t)got, n -= (size_t)got;
  }
  return DOPT_OK;
}

/* The index of F32 tensor `name` (errors name the tensor and the file). */
static dopt_status f32_index(const dopt_st_file *f, const char *name, int *idx) {
  *idx = find_index(f, name);
  if (*idx < 0) return dopt__fail(DOPT_ERR_NOT_FOUND, "%s: no tensor '%s'", f->path, name);
  if (f->t[*idx].dtype != DOPT_F32)
    return dopt__fail(DOPT_ERR_UNSUPPORTED, "%s: tensor '%s' is %s, expected F32", f->path, name,
                      dopt_dtype_name(f->t[*idx].dtype));
  return DOPT_OK;
}

dopt_status dopt_st_read_f32(const dopt_st_file *f, const char *name, float *dst, size_t n) {
  DOPT_CHECK_ARG(f && name, "dopt_st_read_f32: NULL argument");
  int idx;
  DOPT_TRY(f32_index(f, name, &idx));
  if (f->t[idx].numel != n)
    return dopt__fail(DOPT_ERR_SHAPE, "%s: tensor '%s' has %zu elements, expected %zu", f->path, name,
                      f->t[idx].numel, n);
  return read_span(f, name, idx, 0, f->t[idx].bytes, dst);
}

dopt_status dopt_st_read_f32_block(const dopt_st_file *f, const char *name, size_t b, size_t h, size_t w, size_t h0,
                                   size_t hl, size_t w0, size_t wl, float *dst) {
  DOPT_CHECK_ARG(f && name && (dst || b * hl * wl == 0), "dopt_st_read_f32_block: NULL argument");
  int idx;
  DOPT_TRY(f32_index(f, name, &idx));
  const size_t numel = f->t[idx].numel;
  if (h && w && b > SIZE_MAX / h / w) return dopt__fail(DOPT_ERR_SHAPE, "%s: tensor '%s': view overflows", f->path, name);
  if (numel != b * h * w)
    return dopt__fail(DOPT_ERR_SHAPE, "%s: tensor '%s' has %zu elements, the view [%zu, %zu, %zu] %zu", f->path, name,
                      numel, b, h, w, b * h * w);
  DOPT_CHECK_ARG(h0 <= h && hl <= h - h0 && w0 <= w && wl <= w - w0,
                 "dopt_st_read_f32_block: rows [%zu, +%zu) x columns [%zu, +%zu) outside [%zu, %zu]", h0, hl, w0, wl, h,
                 w);
  const size_t e = sizeof(float);
  for (size_t bi = 0; bi < b; bi++) {
    if (w0 == 0 && wl == w) { /* whole rows: one span per leading index */
      DOPT_TRY(read_span(f, name, idx, (bi * h + h0) * w * e, hl * w * e, dst + bi * hl * w));
      continue;
    }
    for (size_t r = 0; r < hl; r++)
      DOPT_TRY(read_span(f, name, idx, ((bi * h + h0 + r) * w + w0) * e, wl * e, dst + (bi * hl + r) * wl));
  }
  return DOPT_OK;
}

/* ---- writer ------------------------------------------------------------------- */

typedef struct st_item {
  char *name;
  dopt_dtype dtype;
  int ndim;
  int64_t shape[DOPT_MAX_DIMS];
  void *data;
  size_t bytes;
} st_item;

struct dopt_st_writer {
  st_item *items;
  int n, cap;
  dopt_index names; /* item names -> index: the duplicate check in O(1) */
  cJSON *meta;
};

static int same_name(const void *ctx, int i, const void *key) {
  return strcmp(((const dopt_st_writer *)ctx)->items[i].name, (const char *)key) == 0;
}

/* 1 + the index of the item called name, or 0. */
static int writer_find(const dopt_st_writer *w, const char *name) {
  return dopt__index_find(&w->names, dopt__hash_str(name), same_name, w, name);
}

dopt_status dopt_st_writer_create(dopt_st_writer **out) {
  DOPT_CHECK_ARG(out != NULL, "dopt_st_writer_create: out=NULL");
  dopt_st_writer *w = calloc(1, sizeof *w);
  if (!w || !(w->meta = cJSON_CreateObject())) {
    free(w);
    return dopt__fail(DOPT_ERR_NO_MEMORY, "dopt_st_writer_create: %zu bytes and a JSON object", sizeof *w);
  }
  *out = w;
  return DOPT_OK;
}

void dopt_st_writer_free(dopt_st_writer *w) {
  if (!w) return;
  for (int i = 0; i < w->n; i++) {
    free(w->items[i].name);
    free(w->items[i].data);
  }
  free(w->items);
  dopt__index_free(&w->names);
  cJSON_Delete(w->meta);
  free(w);
}

dopt_status dopt_st_writer_add(dopt_st_writer *w, const char *name, dopt_dtype dtype, int ndim,
                               const int64_t *shape, const void *data) {
  DOPT_CHECK_ARG(w && name && (data || ndim >= 0), "dopt_st_writer_add: NULL argument");
  DOPT_CHECK_ARG(*name && strcmp(name, "__metadata__") != 0, "dopt_st_writer_add: name='%s' is reserved", name);
  DOPT_CHECK_ARG(ndim >= 0 && ndim <= DOPT_MAX_DIMS, "dopt_st_writer_add: '%s' ndim=%d", name, ndim);
  DOPT_CHECK_ARG((unsigned)dtype < DOPT_DTYPE_COUNT_, "dopt_st_writer_add: '%s' dtype=%d", name, (int)dtype);
  DOPT_CHECK_ARG(!writer_find(w, name), "dopt_st_writer_add: tensor '%s' added twice", name);
  if (w->n == w->cap) {
    int cap = w->cap ? 2 * w->cap : 16;
    st_item *it = realloc(w->items, (size_t)cap * sizeof *it);
    if (!it) return dopt__fail(DOPT_ERR_NO_MEMORY, "dopt_st_writer_add: '%s'", name);
    w->items = it;
    w->cap = cap;
  }
  st_item *it = &w->items[w->n];
  memset(it, 0, sizeof *it);
  it->dtype = dtype;
  it->ndim = ndim;
  for (int i = 0; i < ndim; i++) {
    DOPT_CHECK_ARG(shape[i] >= 0, "dopt_st_writer_add: '%s' shape[%d]=%lld", name, i, (long long)shape[i]);
    it->shape[i] = shape[i];
  }
  it->bytes = dopt_numel(ndim, shape) * dopt_dtype_size(dtype);
  it->name = malloc(strlen(name) + 1);
  it->data = malloc(it->bytes ? it->bytes : 1);
  if (!it->name || !it->data) {
    free(it->name);
    free(it->data);
    return dopt__fail(DOPT_ERR_NO_MEMORY, "dopt_st_writer_add: '%s' (%zu bytes)", name, it->bytes);
  }
  strcpy(it->name, name);
  if (it->bytes) memcpy(it->data, data, it->bytes);
  dopt_status s = dopt__index_add(&w->names, dopt__hash_str(it->name), w->n);
  if (s != DOPT_OK) {
    free(it->name);
    free(it->data);
    return s;
  }
  w->n++;
  return DOPT_OK;
}

dopt_status dopt_st_writer_meta(dopt_st_writer *w, const char *key, const char *value) {
  DOPT_CHECK_ARG(w && key && value, "dopt_st_writer_meta: NULL argument");
  cJSON_DeleteItemFromObjectCaseSensitive(w->meta, key);
  if (!cJSON_AddStringToObject(w->meta, key, value))
    return dopt__fail(DOPT_ERR_NO_MEMORY, "dopt_st_writer_meta: '%s'", key);
  return DOPT_OK;
}

dopt_status dopt_st_writer_save(dopt_st_writer *w, const char *path) {
  DOPT_CHECK_ARG(w && path, "dopt_st_writer_save: NULL argument");
  cJSON *h = cJSON_CreateObject();
  if (!h) return dopt__fail(DOPT_ERR_NO_MEMORY, "%s: header", path);
  dopt_status s = DOPT_OK;
  if (cJSON_GetArraySize(w->meta) > 0) cJSON_AddItemToObject(h, "__metadata__", cJSON_Duplicate(w->meta, 1));
  size_t off = 0;
  for (int i = 0; i < w->n && s == DOPT_OK; i++) {
    const st_item *it = &w->items[i];
    cJSON *e = cJSON_AddObjectToObject(h, it->name);
    cJSON *sh = e ? cJSON_AddArrayToObject(e, "shape") : NULL;
    cJSON *of = e ? cJSON_AddArrayToObject(e, "data_offsets") : NULL;
    if (!e || !sh || !of || !cJSON_AddStringToObject(e, "dtype", dopt_dtype_name(it->dtype))) {
      s = dopt__fail(DOPT_ERR_NO_MEMORY, "%s: header entry '%s'", path, it->name);
      break;
    }
    for (int d = 0; d < it->ndim; d++) cJSON_AddItemToArray(sh, cJSON_CreateNumber((double)it->shape[d]));
    cJSON_AddItemToArray(of, cJSON_CreateNumber((double)off));
    cJSON_AddItemToArray(of, cJSON_CreateNumber((double)(off + it->bytes)));
    off += it->bytes;
  }
  char *json = s == DOPT_OK ? cJSON_PrintUnformatted(h) : NULL;
  cJSON_Delete(h);
  if (s != DOPT_OK) return s;
  if (!json) return dopt__fail(DOPT_ERR_NO_MEMORY, "%s: header text", path);
  size_t jl = strlen(json), padded = (jl + 7) & ~(size_t)7; /* data buffer 8-byte aligned */
  dopt_wfile *wf; /* atomic: a temporary in the target's folder, renamed over it (core/files.h) */
  s = dopt__wfile_open(path, DOPT_W_OUTPUT, &wf);
  FILE *fp = s == DOPT_OK ? dopt__wfile_stream(wf) : NULL;
  if (s == DOPT_OK && !fp) s = dopt__fail(DOPT_ERR_NO_MEMORY, "%s: a stream", path);
  if (fp) {
    unsigned char lenb[8];
    for (int i = 0; i < 8; i++) lenb[i] = (unsigned char)((uint64_t)padded >> (8 * i));
    int ok = fwrite(lenb, 1, 8, fp) == 8 && fwrite(json, 1, jl, fp) == jl;
    for (size_t i = jl; ok && i < padded; i++) ok = fputc(' ', fp) != EOF;
    for (int i = 0; ok && i < w->n; i++)
      ok = w->items[i].bytes == 0 || fwrite(w->items[i].data, 1, w->items[i].bytes, fp) == w->items[i].bytes;
    if (!ok) s = dopt__fail(DOPT_ERR_IO, "%s: write failed: %s", path, strerror(errno));
  }
  if (s == DOPT_OK) s = dopt__wfile_commit(wf);
  else dopt__wfile_abort(wf);
  free(json);
  return s;
}
