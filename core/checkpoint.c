/* Reshardable optimizer checkpoints (include/distopt/checkpoint.h,
 * docs/checkpoints.md): per-rank safetensors files of tensor pieces, their
 * piece lists, an index written last, generations published by an atomic
 * rename, and a reader that serves any piece of a tensor from whichever saved
 * pieces overlap it, checking each against its SHA-256. */
#define _GNU_SOURCE /* renameat2(RENAME_EXCHANGE): replace an existing generation atomically */
#include "distopt/checkpoint.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include "distopt/digest.h"
#include "grid.h"
#include "index.h"
#include "optim_impl.h"

#define CK_PATH 4096
/* Header space reserved before the data of a rank file, so that pieces are
 * written as they come; a longer header (about 7000 pieces) moves the data once. */
#define CK_HEADER_RESERVE ((size_t)1 << 20)
#define CK_CHUNK ((size_t)4 << 20)         /* read/copy granularity */
#define CK_COMPACT ((uint64_t)16 << 20)    /* a rank file with less data is rewritten without the reserve */
#define CK_MAX_JSON ((size_t)1 << 30)      /* index.json / rank-*.json */
#define CK_MAX_HEADER ((uint64_t)100 << 20) /* safetensors' own limit */
#define CK_MAX_INT 9007199254740992.0      /* 2^53: integers exact in JSON doubles */
#define CK_RANK_FORMAT "distopt-checkpoint-rank"

/* ---- small helpers ------------------------------------------------------------ */

typedef struct arena {
  void **b;
  size_t n, cap;
} arena;

static void *ar_alloc(arena *a, size_t bytes) {
  if (a->n == a->cap) {
    size_t cap = a->cap ? 2 * a->cap : 32;
    void **nb = realloc(a->b, cap * sizeof *nb);
    if (!nb) return NULL;
    a->b = nb;
    a->cap = cap;
  }
  void *p = calloc(1, bytes ? bytes : 1);
  if (p) a->b[a->n++] = p;
  return p;
}

static char *ar_strdup(arena *a, const char *s) {
  size_t n = strlen(s) + 1;
  char *p = ar_alloc(a, n);
  if (p) memcpy(p, s, n);
  return p;
}

static void ar_free(arena *a) {
  for (size_t i = 0; i < a->n; i++) free(a->b[i]);
  free(a->b);
  memset(a, 0, sizeof *a);
}

static dopt_status join(char *out, const char *a, const char *b) {
  int n = snprintf(out, CK_PATH, "%s/%s", a, b);
  if (n < 0 || n >= CK_PATH) return dopt__fail(DOPT_ERR_INVALID_ARG, "checkpoint: path '%s/%s' too long", a, b);
  return DOPT_OK;
}

static dopt_status pwrite_all(int fd, const void *buf, size_t n, uint64_t off, const char *path) {
  const unsigned char *p = buf;
  while (n > 0) {
    ssize_t k = pwrite(fd, p, n > ((size_t)1 << 30) ? (size_t)1 << 30 : n, (off_t)off);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return dopt__fail(DOPT_ERR_IO, "%s: write failed: %s", path, k < 0 ? strerror(errno) : "no progress");
    p += k;
    n -= (size_t)k;
    off += (uint64_t)k;
  }
  return DOPT_OK;
}

static dopt_status pread_all(int fd, void *buf, size_t n, uint64_t off, const char *path) {
  unsigned char *p = buf;
  while (n > 0) {
    ssize_t k = pread(fd, p, n > ((size_t)1 << 30) ? (size_t)1 << 30 : n, (off_t)off);
    if (k < 0 && errno == EINTR) continue;
    if (k < 0) return dopt__fail(DOPT_ERR_IO, "%s: read failed: %s", path, strerror(errno));
    if (k == 0)
      return dopt__fail(DOPT_ERR_FORMAT, "%s: truncated: nothing at byte %llu (%zu more bytes expected)", path,
                        (unsigned long long)off, n);
    p += k;
    n -= (size_t)k;
    off += (uint64_t)k;
  }
  return DOPT_OK;
}

/* fsync of a file or directory (a file system that cannot sync directories says EINVAL: accepted). */
static dopt_status fsync_path(const char *path, int is_dir) {
  int fd = open(path, is_dir ? O_RDONLY | O_DIRECTORY : O_RDONLY);
  if (fd < 0) return dopt__fail(DOPT_ERR_IO, "%s: cannot open to sync: %s", path, strerror(errno));
  int rc = fsync(fd), err = errno;
  close(fd);
  if (rc != 0 && err != EINVAL) return dopt__fail(DOPT_ERR_IO, "%s: fsync failed: %s", path, strerror(err));
  return DOPT_OK;
}

static void parent_of(const char *path, char *out) {
  snprintf(out, CK_PATH, "%s", path);
  char *s = strrchr(out, '/');
  if (!s) snprintf(out, CK_PATH, ".");
  else if (s == out) out[1] = '\0';
  else *s = '\0';
}

/* path ← data, durably: a temporary file written and fsynced, renamed into
 * place, the folder fsynced. */
static dopt_status write_durable(const char *path, const void *data, size_t n) {
  char tmp[CK_PATH], dir[CK_PATH];
  int k = snprintf(tmp, sizeof tmp, "%s.tmp-%ld", path, (long)getpid());
  if (k < 0 || k >= (int)sizeof tmp) return dopt__fail(DOPT_ERR_INVALID_ARG, "%s: path too long", path);
  int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) return dopt__fail(DOPT_ERR_IO, "%s: cannot create: %s", tmp, strerror(errno));
  dopt_status s = pwrite_all(fd, data, n, 0, tmp);
  if (s == DOPT_OK && fsync(fd) != 0) s = dopt__fail(DOPT_ERR_IO, "%s: fsync failed: %s", tmp, strerror(errno));
  if (close(fd) != 0 && s == DOPT_OK) s = dopt__fail(DOPT_ERR_IO, "%s: close failed: %s", tmp, strerror(errno));
  if (s == DOPT_OK && rename(tmp, path) != 0)
    s = dopt__fail(DOPT_ERR_IO, "%s: cannot rename into place: %s", path, strerror(errno));
  if (s != DOPT_OK) {
    unlink(tmp);
    return s;
  }
  parent_of(path, dir);
  return fsync_path(dir, 1);
}

/* The whole file as a NUL-terminated string (at most max bytes). */
static dopt_status read_text(const char *path, size_t max, char **out, size_t *len) {
  *out = NULL;
  int fd = open(path, O_RDONLY);
  if (fd < 0) return dopt__fail(errno == ENOENT ? DOPT_ERR_NOT_FOUND : DOPT_ERR_IO, "%s: cannot open: %s", path,
                                strerror(errno));
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    close(fd);
    return dopt__fail(DOPT_ERR_IO, "%s: not a regular file", path);
  }
  if ((uint64_t)st.st_size > max) {
    close(fd);
    return dopt__fail(DOPT_ERR_FORMAT, "%s: %lld bytes exceed the limit of %zu", path, (long long)st.st_size, max);
  }
  size_t n = (size_t)st.st_size;
  char *buf = malloc(n + 1);
  if (!buf) {
    close(fd);
    return dopt__fail(DOPT_ERR_NO_MEMORY, "%s: %zu bytes", path, n);
  }
  dopt_status s = pread_all(fd, buf, n, 0, path);
  close(fd);
  if (s != DOPT_OK) {
    free(buf);
    return s;
  }
  buf[n] = '\0';
  *out = buf;
  if (len) *len = n;
  return DOPT_OK;
}

static dopt_status mkdir_p(const char *dir) {
  char buf[CK_PATH];
  int n = snprintf(buf, sizeof buf, "%s", dir);
  if (n <= 0 || n >= (int)sizeof buf) return dopt__fail(DOPT_ERR_INVALID_ARG, "checkpoint: bad directory '%s'", dir);
  for (char *p = buf + 1;; p++) {
    if (*p == '/' || *p == '\0') {
      char c = *p;
      *p = '\0';
      if (mkdir(buf, 0755) != 0 && errno != EEXIST)
        return dopt__fail(DOPT_ERR_IO, "%s: cannot create: %s", buf, strerror(errno));
      *p = c;
      if (!c) break;
    }
  }
  struct stat st;
  if (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode)) return dopt__fail(DOPT_ERR_IO, "%s: not a directory", dir);
  return DOPT_OK;
}

/* Removes a directory of plain files (a temporary generation); absent is fine. */
static dopt_status remove_flat_dir(const char *dir) {
  DIR *d = opendir(dir);
  if (!d) {
    if (errno == ENOENT) return DOPT_OK;
    return dopt__fail(DOPT_ERR_IO, "%s: cannot open: %s", dir, strerror(errno));
  }
  dopt_status s = DOPT_OK;
  struct dirent *e;
  char p[CK_PATH];
  while (s == DOPT_OK && (e = readdir(d)) != NULL) {
    if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
    if ((s = join(p, dir, e->d_name)) != DOPT_OK) break;
    if (unlink(p) != 0) s = dopt__fail(DOPT_ERR_IO, "%s: cannot remove: %s", p, strerror(errno));
  }
  closedir(d);
  if (s == DOPT_OK && rmdir(dir) != 0) s = dopt__fail(DOPT_ERR_IO, "%s: cannot remove: %s", dir, strerror(errno));
  return s;
}

static int dtype_by_name(const char *s) {
  for (int d = 0; d < DOPT_DTYPE_COUNT_; d++)
    if (strcmp(dopt_dtype_name((dopt_dtype)d), s) == 0) return d;
  return -1;
}

static void shape_str(int ndim, const int64_t *shape, char *out, size_t cap) {
  size_t off = 0;
  out[0] = '\0';
  off += (size_t)snprintf(out, cap, "[");
  for (int d = 0; d < ndim && off < cap; d++)
    off += (size_t)snprintf(out + off, cap - off, "%s%lld", d ? "," : "", (long long)shape[d]);
  if (off < cap) snprintf(out + off, cap - off, "]");
}

static int same_shape(int na, const int64_t *a, int nb, const int64_t *b) {
  if (na != nb) return 0;
  for (int d = 0; d < na; d++)
    if (a[d] != b[d]) return 0;
  return 1;
}

/* ---- pieces -------------------------------------------------------------------- */

enum { PF_B, PF_H, PF_W, PF_NUMEL, PF_FACTORED, PF_H0, PF_HL, PF_W0, PF_WL, PF_LO, PF_LEN, PF_N };
static const char *const piece_keys[PF_N] = {"b", "h", "w", "numel", "factored", "h0", "hl", "w0", "wl", "lo", "len"};

static void piece_get(const dopt_piece *pc, uint64_t v[PF_N]) {
  v[PF_B] = pc->b, v[PF_H] = pc->h, v[PF_W] = pc->w, v[PF_NUMEL] = pc->numel, v[PF_FACTORED] = pc->factored != 0;
  v[PF_H0] = pc->h0, v[PF_HL] = pc->hl, v[PF_W0] = pc->w0, v[PF_WL] = pc->wl, v[PF_LO] = pc->lo, v[PF_LEN] = pc->len;
}

static void piece_set(dopt_piece *pc, const uint64_t v[PF_N]) {
  pc->b = (size_t)v[PF_B], pc->h = (size_t)v[PF_H], pc->w = (size_t)v[PF_W], pc->numel = (size_t)v[PF_NUMEL];
  pc->factored = (int)v[PF_FACTORED];
  pc->h0 = (size_t)v[PF_H0], pc->hl = (size_t)v[PF_HL], pc->w0 = (size_t)v[PF_W0], pc->wl = (size_t)v[PF_WL];
  pc->lo = (size_t)v[PF_LO], pc->len = (size_t)v[PF_LEN];
}

/* A piece must describe the tensor's logical [b, h, w] view and lie inside it. */
static dopt_status check_piece(dopt_status err, const char *where, const char *tensor, int ndim, const int64_t *shape,
                               const dopt_piece *pc) {
  dopt_piece f;
  dopt_piece_full(ndim, shape, &f);
  char sh[160];
  if (pc->b != f.b || pc->h != f.h || pc->w != f.w || pc->numel != f.numel || !pc->factored != !f.factored) {
    shape_str(ndim, shape, sh, sizeof sh);
    return dopt__fail(err, "%s: tensor '%s': piece view [b=%zu, h=%zu, w=%zu] numel=%zu factored=%d does not fit its "
                      "shape %s ([%zu, %zu, %zu])", where, tensor, pc->b, pc->h, pc->w, pc->numel, pc->factored, sh,
                      f.b, f.h, f.w);
  }
  if (pc->hl > f.h || pc->h0 > f.h - pc->hl || pc->wl > f.w || pc->w0 > f.w - pc->wl)
    return dopt__fail(err, "%s: tensor '%s': piece block rows [%zu, +%zu) cols [%zu, +%zu) outside [%zu, %zu]", where,
                      tensor, pc->h0, pc->hl, pc->w0, pc->wl, f.h, f.w);
  size_t blk = f.b * pc->hl * pc->wl;
  if (pc->len > blk || pc->lo > blk - pc->len)
    return dopt__fail(err, "%s: tensor '%s': piece range [%zu, +%zu) outside its block of %zu elements", where, tensor,
                      pc->lo, pc->len, blk);
  return DOPT_OK;
}

static int piece_is_whole(const dopt_piece *pc) {
  return pc->h0 == 0 && pc->w0 == 0 && pc->lo == 0 && pc->hl == pc->h && pc->wl == pc->w && pc->len == pc->numel;
}

/* Elements [e0, e1) of saved piece s (src: their data, element e0 first;
 * NULL: only count) that lie in piece w go to out (w's element k at
 * out[k - w->lo]). Returns how many lie in w. Works in row segments: the
 * elements of one block row are consecutive logical elements. */
static size_t scatter(const dopt_piece *s, size_t e0, size_t e1, const unsigned char *src, const dopt_piece *w,
                      unsigned char *out, size_t es) {
  size_t count = 0, q = s->lo + e0, qend = s->lo + e1;
  while (q < qend) {
    size_t cc = q % s->wl, seg = s->wl - cc;
    if (seg > qend - q) seg = qend - q;
    size_t L = dopt_grid_logical(s, q); /* the segment's first logical element */
    size_t bb = L / (s->h * s->w), row = (L / s->w) % s->h, c0 = L % s->w, c1 = c0 + seg;
    if (row >= w->h0 && row < w->h0 + w->hl) {
      size_t a = c0 > w->w0 ? c0 : w->w0, z = c1 < w->w0 + w->wl ? c1 : w->w0 + w->wl;
      if (a < z) {
        size_t kq = (bb * w->hl + (row - w->h0)) * w->wl + (a - w->w0), ke = kq + (z - a);
        size_t x0 = kq > w->lo ? kq : w->lo, x1 = ke < w->lo + w->len ? ke : w->lo + w->len;
        if (x0 < x1) {
          count += x1 - x0;
          if (src) memcpy(out + (x0 - w->lo) * es, src + ((q - s->lo - e0) + (a - c0) + (x0 - kq)) * es, (x1 - x0) * es);
        }
      }
    }
    q += seg;
  }
  return count;
}

static int blocks_meet(const dopt_piece *a, const dopt_piece *b) {
  return a->h0 < b->h0 + b->hl && b->h0 < a->h0 + a->hl && a->w0 < b->w0 + b->wl && b->w0 < a->w0 + a->wl;
}

/* ---- the piece table (a rank's list, the merged index) ------------------------------ */

typedef struct ck_piece {
  const char *tensor;
  dopt_dtype dtype;
  int ndim;
  int64_t shape[DOPT_MAX_DIMS];
  dopt_piece pc;
  int file;             /* index into the table's files */
  const char *fname;    /* that file's name */
  const char *key;      /* its safetensors key */
  size_t bytes;
  char sha[DOPT_DIGEST_HEX];
  uint64_t offset;      /* reader: the data's absolute offset in its file */
} ck_piece;

typedef struct ck_tensor {
  const char *name;
  dopt_dtype dtype;
  int ndim;
  int64_t shape[DOPT_MAX_DIMS];
  size_t numel;
  ck_piece **pieces;
  int npieces;
} ck_tensor;

typedef struct ck_file {
  const char *name;
  uint64_t bytes;
} ck_file;

typedef struct ck_table {
  arena ar;
  ck_file *files;
  int nfiles, files_cap;
  ck_piece *p;
  int np, pcap;
  ck_piece **sorted; /* by tensor, file, key */
  ck_tensor *t;      /* by name */
  int nt;
} ck_table;

static void table_free(ck_table *t) {
  free(t->files);
  free(t->p);
  free(t->sorted);
  free(t->t);
  ar_free(&t->ar);
  memset(t, 0, sizeof *t);
}

static dopt_status table_add_file(ck_table *t, const char *name, uint64_t bytes, int *idx) {
  if (t->nfiles == t->files_cap) {
    int cap = t->files_cap ? 2 * t->files_cap : 8;
    ck_file *f = realloc(t->files, (size_t)cap * sizeof *f);
    if (!f) return dopt__fail(DOPT_ERR_NO_MEMORY, "checkpoint: %d files", cap);
    t->files = f;
    t->files_cap = cap;
  }
  const char *nm = ar_strdup(&t->ar, name);
  if (!nm) return dopt__fail(DOPT_ERR_NO_MEMORY, "checkpoint: %zu bytes for a file name", strlen(name) + 1);
  t->files[t->nfiles] = (ck_file){nm, bytes};
  *idx = t->nfiles++;
  return DOPT_OK;
}

static ck_piece *table_new_piece(ck_table *t) {
  if (t->np == t->pcap) {
    int cap = t->pcap ? 2 * t->pcap : 64;
    ck_piece *p = realloc(t->p, (size_t)cap * sizeof *p);
    if (!p) return NULL;
    t->p = p;
    t->pcap = cap;
  }
  ck_piece *p = &t->p[t->np++];
  memset(p, 0, sizeof *p);
  return p;
}

/* (no global state: ranks open checkpoints concurrently, as threads of the simulator) */
static int cmp_piece(const void *x, const void *y) {
  const ck_piece *a = *(ck_piece *const *)x, *b = *(ck_piece *const *)y;
  int c = strcmp(a->tensor, b->tensor);
  if (c) return c;
  c = strcmp(a->fname, b->fname);
  return c ? c : strcmp(a->key, b->key);
}

static int cmp_block(const void *x, const void *y) {
  const dopt_piece *a = &(*(ck_piece *const *)x)->pc, *b = &(*(ck_piece *const *)y)->pc;
  size_t va[5] = {a->h0, a->hl, a->w0, a->wl, a->lo}, vb[5] = {b->h0, b->hl, b->w0, b->wl, b->lo};
  for (int i = 0; i < 5; i++)
    if (va[i] != vb[i]) return va[i] < vb[i] ? -1 : 1;
  return 0;
}

static int same_block(const dopt_piece *a, const dopt_piece *b) {
  return a->h0 == b->h0 && a->hl == b->hl && a->w0 == b->w0 && a->wl == b->wl;
}

/* The pieces of one tensor cover it exactly once: its [h, w] plane is
 * partitioned into TP blocks, and each block's flat range [0, b·hl·wl) into
 * the ranges of its pieces. */
static dopt_status check_cover(const ck_table *t, ck_tensor *ts, const char *where) {
  int n = ts->npieces;
  ck_piece **v = malloc((size_t)(n ? n : 1) * sizeof *v);
  int *lead = malloc((size_t)(n ? n : 1) * sizeof *lead); /* the first piece of each non-empty block */
  if (!v || !lead) {
    free(v);
    free(lead);
    return dopt__fail(DOPT_ERR_NO_MEMORY, "%s: %d pieces", where, n);
  }
  memcpy(v, ts->pieces, (size_t)n * sizeof *v);
  qsort(v, (size_t)n, sizeof *v, cmp_block);
  dopt_status s = DOPT_OK;
  size_t area = 0, b = n ? v[0]->pc.b : 0;
  int nblocks = 0;
  for (int i = 0; i < n && s == DOPT_OK;) {
    int j = i;
    size_t next = 0, blk = b * v[i]->pc.hl * v[i]->pc.wl;
    const ck_piece *prev = NULL;
    for (; j < n && same_block(&v[j]->pc, &v[i]->pc); j++) {
      const ck_piece *p = v[j];
      if (p->pc.len == 0) continue;
      if (p->pc.lo < next) {
        s = dopt__fail(DOPT_ERR_FORMAT, "%s: tensor '%s': pieces %s:%s and %s:%s overlap (elements [%zu, %zu) of block "
                       "rows [%zu, +%zu) cols [%zu, +%zu))", where, ts->name, t->files[prev->file].name, prev->key,
                       t->files[p->file].name, p->key, p->pc.lo, next, p->pc.h0, p->pc.hl, p->pc.w0, p->pc.wl);
        break;
      }
      if (p->pc.lo > next) {
        s = dopt__fail(DOPT_ERR_FORMAT, "%s: tensor '%s': elements [%zu, %zu) of block rows [%zu, +%zu) cols [%zu, +%zu) "
                       "are in no piece (gap before %s:%s)", where, ts->name, next, p->pc.lo, p->pc.h0, p->pc.hl,
                       p->pc.w0, p->pc.wl, t->files[p->file].name, p->key);
        break;
      }
      next = p->pc.lo + p->pc.len;
      prev = p;
    }
    if (s == DOPT_OK && blk > 0 && next < blk)
      s = dopt__fail(DOPT_ERR_FORMAT, "%s: tensor '%s': elements [%zu, %zu) of block rows [%zu, +%zu) cols [%zu, +%zu) are "
                     "in no piece", where, ts->name, next, blk, v[i]->pc.h0, v[i]->pc.hl, v[i]->pc.w0, v[i]->pc.wl);
    if (s == DOPT_OK && blk > 0) {
      /* a block must not meet another one */
      for (int k = 0; k < nblocks && s == DOPT_OK; k++) {
        const ck_piece *a = v[lead[k]], *c = v[i];
        if (blocks_meet(&a->pc, &c->pc))
          s = dopt__fail(DOPT_ERR_FORMAT, "%s: tensor '%s': pieces %s:%s and %s:%s overlap (blocks rows [%zu, +%zu) "
                         "cols [%zu, +%zu) and rows [%zu, +%zu) cols [%zu, +%zu))", where, ts->name,
                         t->files[a->file].name, a->key, t->files[c->file].name, c->key, a->pc.h0, a->pc.hl, a->pc.w0,
                         a->pc.wl, c->pc.h0, c->pc.hl, c->pc.w0, c->pc.wl);
      }
      area += v[i]->pc.hl * v[i]->pc.wl;
      lead[nblocks++] = i;
    }
    i = j;
  }
  if (s == DOPT_OK && n > 0 && ts->numel > 0 && area != v[0]->pc.h * v[0]->pc.w)
    s = dopt__fail(DOPT_ERR_FORMAT, "%s: tensor '%s': its %d block(s) cover %zu of the %zu x %zu (rows x cols) positions",
                   where, ts->name, nblocks, area, v[0]->pc.h, v[0]->pc.w);
  if (s == DOPT_OK && n == 0 && ts->numel > 0)
    s = dopt__fail(DOPT_ERR_FORMAT, "%s: tensor '%s' has no pieces", where, ts->name);
  free(v);
  free(lead);
  return s;
}

/* Sorts the pieces by tensor, groups them into tensors (one dtype and shape
 * each) and checks each tensor's cover. */
static dopt_status table_finish(ck_table *t, const char *where) {
  t->sorted = malloc((size_t)(t->np ? t->np : 1) * sizeof *t->sorted);
  t->t = calloc((size_t)(t->np ? t->np : 1), sizeof *t->t);
  if (!t->sorted || !t->t) return dopt__fail(DOPT_ERR_NO_MEMORY, "%s: %d pieces", where, t->np);
  for (int i = 0; i < t->np; i++) t->sorted[i] = &t->p[i];
  qsort(t->sorted, (size_t)t->np, sizeof *t->sorted, cmp_piece);
  for (int i = 0; i < t->np;) {
    ck_piece *p0 = t->sorted[i];
    ck_tensor *ts = &t->t[t->nt++];
    ts->name = p0->tensor;
    ts->dtype = p0->dtype;
    ts->ndim = p0->ndim;
    memcpy(ts->shape, p0->shape, sizeof ts->shape);
    ts->numel = dopt_numel(p0->ndim, p0->shape);
    ts->pieces = &t->sorted[i];
    int j = i;
    for (; j < t->np && strcmp(t->sorted[j]->tensor, p0->tensor) == 0; j++) {
      const ck_piece *p = t->sorted[j];
      if (p->dtype != p0->dtype || !same_shape(p->ndim, p->shape, p0->ndim, p0->shape)) {
        char a[160], b[160];
        shape_str(p0->ndim, p0->shape, a, sizeof a);
        shape_str(p->ndim, p->shape, b, sizeof b);
        return dopt__fail(DOPT_ERR_FORMAT, "%s: tensor '%s' is %s %s in %s:%s but %s %s in %s:%s", where, p0->tensor,
                          dopt_dtype_name(p0->dtype), a, t->files[p0->file].name, p0->key, dopt_dtype_name(p->dtype), b,
                          t->files[p->file].name, p->key);
      }
      if (j > i && p->file == t->sorted[j - 1]->file && strcmp(p->key, t->sorted[j - 1]->key) == 0)
        return dopt__fail(DOPT_ERR_FORMAT, "%s: tensor '%s': piece %s:%s listed twice", where, p->tensor,
                          t->files[p->file].name, p->key);
    }
    ts->npieces = j - i;
    DOPT_TRY(check_cover(t, ts, where));
    i = j;
  }
  return DOPT_OK;
}

static const ck_tensor *table_find(const ck_table *t, const char *name) {
  int lo = 0, hi = t->nt;
  while (lo < hi) {
    int mid = lo + (hi - lo) / 2, c = strcmp(t->t[mid].name, name);
    if (c == 0) return &t->t[mid];
    if (c < 0) lo = mid + 1;
    else hi = mid;
  }
  return NULL;
}

/* ---- JSON ---------------------------------------------------------------------- */

/* Builders record an allocation failure in *oom instead of checking each call. */
static cJSON *jadd(cJSON *obj, const char *key, cJSON *item, int *oom) {
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

static cJSON *jnum(double v) { return cJSON_CreateNumber(v); }

static void jadd_shape(cJSON *obj, const char *key, int ndim, const int64_t *shape, int *oom) {
  cJSON *a = jadd(obj, key, cJSON_CreateArray(), oom);
  for (int d = 0; d < ndim; d++) jadd(a, NULL, jnum((double)shape[d]), oom);
}

static void jadd_piece(cJSON *obj, const dopt_piece *pc, int *oom) {
  uint64_t v[PF_N];
  piece_get(pc, v);
  for (int k = 0; k < PF_N; k++) jadd(obj, piece_keys[k], jnum((double)v[k]), oom);
}

static dopt_status jget(const cJSON *obj, const char *key, const char *where, const char *ctx, const cJSON **out) {
  *out = NULL;
  const cJSON *v = cJSON_IsObject(obj) ? cJSON_GetObjectItemCaseSensitive(obj, key) : NULL;
  if (!v) return dopt__fail(DOPT_ERR_FORMAT, "%s: %s: missing \"%s\"", where, ctx, key);
  *out = v;
  return DOPT_OK;
}

static dopt_status jint(const cJSON *obj, const char *key, double lo, double hi, const char *where, const char *ctx,
                        int64_t *out) {
  const cJSON *v;
  *out = 0;
  DOPT_TRY(jget(obj, key, where, ctx, &v));
  double x = cJSON_IsNumber(v) ? v->valuedouble : NAN;
  if (!(x >= lo && x <= hi && x == floor(x)))
    return dopt__fail(DOPT_ERR_FORMAT, "%s: %s: \"%s\" is not an integer in [%.0f, %.0f]", where, ctx, key, lo, hi);
  *out = (int64_t)x;
  return DOPT_OK;
}

static dopt_status jstr(const cJSON *obj, const char *key, const char *where, const char *ctx, const char **out) {
  const cJSON *v;
  *out = "";
  DOPT_TRY(jget(obj, key, where, ctx, &v));
  if (!cJSON_IsString(v)) return dopt__fail(DOPT_ERR_FORMAT, "%s: %s: \"%s\" is not a string", where, ctx, key);
  *out = v->valuestring;
  return DOPT_OK;
}

static dopt_status jbool(const cJSON *obj, const char *key, const char *where, const char *ctx, int *out) {
  const cJSON *v;
  *out = 0;
  DOPT_TRY(jget(obj, key, where, ctx, &v));
  if (!cJSON_IsBool(v)) return dopt__fail(DOPT_ERR_FORMAT, "%s: %s: \"%s\" is not true/false", where, ctx, key);
  *out = cJSON_IsTrue(v) ? 1 : 0;
  return DOPT_OK;
}

static dopt_status jdtype(const cJSON *obj, const char *key, const char *where, const char *ctx, dopt_dtype *out) {
  const char *s;
  *out = DOPT_F32;
  DOPT_TRY(jstr(obj, key, where, ctx, &s));
  int d = dtype_by_name(s);
  if (d < 0) return dopt__fail(DOPT_ERR_FORMAT, "%s: %s: dtype '%s' unknown", where, ctx, s);
  *out = (dopt_dtype)d;
  return DOPT_OK;
}

static dopt_status jshape(const cJSON *obj, const char *key, const char *where, const char *ctx, int *ndim,
                          int64_t *shape) {
  const cJSON *v;
  *ndim = 0;
  DOPT_TRY(jget(obj, key, where, ctx, &v));
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
    DOPT_TRY(jint(obj, piece_keys[k], 0, k == PF_FACTORED ? 1 : CK_MAX_INT, where, ctx, &x));
    v[k] = (uint64_t)x;
  }
  piece_set(pc, v);
  return DOPT_OK;
}

static dopt_status jsha(const cJSON *obj, const char *where, const char *ctx, char *out) {
  const char *s;
  DOPT_TRY(jstr(obj, "sha256", where, ctx, &s));
  int ok = strlen(s) == DOPT_DIGEST_HEX - 1;
  for (size_t i = 0; ok && s[i]; i++) ok = (s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'f');
  if (!ok) return dopt__fail(DOPT_ERR_FORMAT, "%s: %s: \"sha256\" is not 64 lowercase hex digits", where, ctx);
  memcpy(out, s, DOPT_DIGEST_HEX);
  return DOPT_OK;
}

/* A piece entry: piece fields, key, bytes, sha256 (and with_tensor: tensor, dtype, shape). */
static dopt_status parse_piece(ck_table *t, const cJSON *e, int file, int with_tensor, const ck_tensor *owner,
                               const char *where) {
  char ctx[256];
  snprintf(ctx, sizeof ctx, "piece of %s", owner ? owner->name : t->files[file].name);
  ck_piece *p = table_new_piece(t);
  if (!p) return dopt__fail(DOPT_ERR_NO_MEMORY, "%s: pieces", where);
  const char *key, *tensor = owner ? owner->name : NULL;
  if (with_tensor) {
    DOPT_TRY(jstr(e, "tensor", where, ctx, &tensor));
    snprintf(ctx, sizeof ctx, "piece of '%s'", tensor);
    DOPT_TRY(jdtype(e, "dtype", where, ctx, &p->dtype));
    DOPT_TRY(jshape(e, "shape", where, ctx, &p->ndim, p->shape));
  } else {
    p->dtype = owner->dtype;
    p->ndim = owner->ndim;
    memcpy(p->shape, owner->shape, sizeof p->shape);
  }
  if (!*tensor) return dopt__fail(DOPT_ERR_FORMAT, "%s: a piece has an empty tensor name", where);
  DOPT_TRY(jstr(e, "key", where, ctx, &key));
  DOPT_TRY(jpiece(e, where, ctx, &p->pc));
  int64_t bytes;
  DOPT_TRY(jint(e, "bytes", 0, CK_MAX_INT, where, ctx, &bytes));
  DOPT_TRY(jsha(e, where, ctx, p->sha));
  p->file = file;
  p->fname = t->files[file].name; /* arena memory: stays where it is when files[] grows */
  p->bytes = (size_t)bytes;
  p->tensor = ar_strdup(&t->ar, tensor);
  p->key = ar_strdup(&t->ar, key);
  if (!p->tensor || !p->key) return dopt__fail(DOPT_ERR_NO_MEMORY, "%s: names", where);
  DOPT_TRY(check_piece(DOPT_ERR_FORMAT, where, tensor, p->ndim, p->shape, &p->pc));
  if (p->bytes != p->pc.len * dopt_dtype_size(p->dtype))
    return dopt__fail(DOPT_ERR_FORMAT, "%s: tensor '%s' piece %s: %zu bytes for %zu x %s elements", where, tensor, key,
                      p->bytes, p->pc.len, dopt_dtype_name(p->dtype));
  return DOPT_OK;
}

/* A rank file name: rank-<5 digits>-of-<5 digits>.safetensors (nothing else may be named in an index). */
static int rank_file_name_ok(const char *s) {
  int r, n;
  char tail[32];
  if (strlen(s) != 31 || sscanf(s, "rank-%5d-of-%5d%31s", &r, &n, tail) != 3) return 0;
  char again[64];
  snprintf(again, sizeof again, "rank-%05d-of-%05d.safetensors", r, n);
  return strcmp(again, s) == 0;
}

/* ---- hyperparameters and metadata ------------------------------------------------ */

typedef struct meta_box {
  dopt_ckpt_meta m; /* first: a dopt_ckpt_meta * is a meta_box * */
  arena ar;
} meta_box;

static void hp_str(const dopt_ckpt_hparam *h, char *out, size_t cap) {
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
    default: v = jnum(h[k].value); break;
    }
    jadd(o, h[k].key, v, oom);
  }
  return o;
}

static dopt_status parse_hparams(const cJSON *o, const char *where, const char *ctx, arena *ar, dopt_ckpt_hparam **out,
                                 int *n) {
  if (!cJSON_IsObject(o)) return dopt__fail(DOPT_ERR_FORMAT, "%s: %s: hyperparameters are not an object", where, ctx);
  int cnt = cJSON_GetArraySize(o), k = 0;
  dopt_ckpt_hparam *h = ar_alloc(ar, (size_t)(cnt ? cnt : 1) * sizeof *h);
  if (!h) return dopt__fail(DOPT_ERR_NO_MEMORY, "%s: hyperparameters", where);
  const cJSON *v;
  cJSON_ArrayForEach(v, o) {
    dopt_ckpt_hparam *x = &h[k++];
    if (!(x->key = ar_strdup(ar, v->string ? v->string : ""))) return dopt__fail(DOPT_ERR_NO_MEMORY, "%s", where);
    if (cJSON_IsBool(v)) {
      x->kind = DOPT_CKPT_HP_BOOL;
      x->value = cJSON_IsTrue(v) ? 1.0 : 0.0;
    } else if (cJSON_IsNull(v)) {
      x->kind = DOPT_CKPT_HP_NONE;
      x->value = NAN;
    } else if (cJSON_IsString(v)) {
      x->kind = DOPT_CKPT_HP_CHOICE;
      x->value = NAN;
      if (!(x->choice = ar_strdup(ar, v->valuestring))) return dopt__fail(DOPT_ERR_NO_MEMORY, "%s", where);
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

static dopt_status check_meta_input(const dopt_ckpt_meta *m, const char *fn) {
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
  for (int i = 0; i < m->nparams; i++) {
    const dopt_ckpt_param *p = &m->params[i];
    DOPT_CHECK_ARG(p->name && *p->name, "%s: parameter %d has no name", fn, i);
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
  jadd(r, "format", cJSON_CreateString(DOPT_CKPT_FORMAT), oom);
  jadd(r, "version", jnum(DOPT_CKPT_FORMAT_VERSION), oom);
  jadd(r, "optimizer", cJSON_CreateString(m->optimizer), oom);
  if (m->wrapper) {
    cJSON *w = jadd(r, "wrapper", cJSON_CreateObject(), oom);
    jadd(w, "name", cJSON_CreateString(m->wrapper), oom);
    jadd(w, "hparams", hparams_json(m->wrapper_hparams, m->nwrapper_hparams, oom), oom);
  } else {
    jadd(r, "wrapper", cJSON_CreateNull(), oom);
  }
  cJSON *gs = jadd(r, "groups", cJSON_CreateArray(), oom);
  for (int g = 0; g < m->ngroups; g++) {
    cJSON *go = jadd(gs, NULL, cJSON_CreateObject(), oom);
    jadd(go, "hparams", hparams_json(m->groups[g].hparams, m->groups[g].nhparams, oom), oom);
    cJSON *mem = jadd(go, "params", cJSON_CreateArray(), oom);
    for (int i = 0; i < m->nparams; i++)
      if (m->params[i].group == g) jadd(mem, NULL, cJSON_CreateString(m->params[i].name), oom);
  }
  jadd(r, "global_step", jnum((double)m->global_step), oom);
  jadd(r, "optimizer_steps", jnum((double)m->optimizer_steps), oom);
  jadd(r, "skipped_steps", jnum((double)m->skipped_steps), oom);
  cJSON *w = jadd(r, "world", cJSON_CreateObject(), oom);
  jadd(w, "plugin", cJSON_CreateString(m->world.plugin ? m->world.plugin : "reference"), oom);
  jadd(w, "tp", jnum(m->world.tp), oom);
  jadd(w, "dp", jnum(m->world.dp), oom);
  jadd(w, "zero", jnum(m->world.zero), oom);
  cJSON *ps = jadd(r, "params", cJSON_CreateArray(), oom);
  for (int i = 0; i < m->nparams; i++) {
    const dopt_ckpt_param *p = &m->params[i];
    cJSON *po = jadd(ps, NULL, cJSON_CreateObject(), oom);
    jadd(po, "name", cJSON_CreateString(p->name), oom);
    jadd(po, "dtype", cJSON_CreateString(dopt_dtype_name(p->dtype)), oom);
    jadd_shape(po, "shape", p->ndim, p->shape, oom);
    jadd(po, "group", jnum(p->group), oom);
    jadd(po, "layer", jnum(p->layer), oom);
    jadd(po, "step", jnum((double)p->step), oom);
    jadd(po, "has_bf16", cJSON_CreateBool(p->has_bf16 != 0), oom);
    jadd(po, "has_state", cJSON_CreateBool(p->has_state != 0), oom);
  }
  return r;
}

static dopt_status parse_meta(const cJSON *r, const char *where, meta_box *mb) {
  dopt_ckpt_meta *m = &mb->m;
  arena *ar = &mb->ar;
  *m = (dopt_ckpt_meta)DOPT_CKPT_META_INIT;
  const char *s;
  const cJSON *v;
  DOPT_TRY(jstr(r, "optimizer", where, "index", &s));
  if (!(m->optimizer = ar_strdup(ar, s))) return dopt__fail(DOPT_ERR_NO_MEMORY, "%s", where);
  DOPT_TRY(jget(r, "wrapper", where, "index", &v));
  if (!cJSON_IsNull(v)) {
    const cJSON *wh;
    DOPT_TRY(jstr(v, "name", where, "wrapper", &s));
    if (!(m->wrapper = ar_strdup(ar, s))) return dopt__fail(DOPT_ERR_NO_MEMORY, "%s", where);
    DOPT_TRY(jget(v, "hparams", where, "wrapper", &wh));
    DOPT_TRY(parse_hparams(wh, where, "wrapper", ar, &m->wrapper_hparams, &m->nwrapper_hparams));
  }
  int64_t x;
  DOPT_TRY(jint(r, "global_step", 0, CK_MAX_INT, where, "index", &m->global_step));
  DOPT_TRY(jint(r, "optimizer_steps", 0, CK_MAX_INT, where, "index", &m->optimizer_steps));
  DOPT_TRY(jint(r, "skipped_steps", 0, CK_MAX_INT, where, "index", &m->skipped_steps));
  DOPT_TRY(jget(r, "world", where, "index", &v));
  DOPT_TRY(jstr(v, "plugin", where, "world", &s));
  if (!(m->world.plugin = ar_strdup(ar, s))) return dopt__fail(DOPT_ERR_NO_MEMORY, "%s", where);
  DOPT_TRY(jint(v, "tp", 0, 1e9, where, "world", &x));
  m->world.tp = (int)x;
  DOPT_TRY(jint(v, "dp", 0, 1e9, where, "world", &x));
  m->world.dp = (int)x;
  DOPT_TRY(jint(v, "zero", 0, 3, where, "world", &x));
  m->world.zero = (int)x;
  const cJSON *gs, *ps, *e;
  DOPT_TRY(jget(r, "groups", where, "index", &gs));
  DOPT_TRY(jget(r, "params", where, "index", &ps));
  if (!cJSON_IsArray(gs) || !cJSON_IsArray(ps))
    return dopt__fail(DOPT_ERR_FORMAT, "%s: \"groups\" and \"params\" must be arrays", where);
  m->ngroups = cJSON_GetArraySize(gs);
  m->nparams = cJSON_GetArraySize(ps);
  m->groups = ar_alloc(ar, (size_t)(m->ngroups ? m->ngroups : 1) * sizeof *m->groups);
  m->params = ar_alloc(ar, (size_t)(m->nparams ? m->nparams : 1) * sizeof *m->params);
  if (!m->groups || !m->params) return dopt__fail(DOPT_ERR_NO_MEMORY, "%s", where);
  int i = 0;
  char ctx[300];
  cJSON_ArrayForEach(e, ps) {
    dopt_ckpt_param *p = &m->params[i];
    snprintf(ctx, sizeof ctx, "params[%d]", i);
    DOPT_TRY(jstr(e, "name", where, ctx, &s));
    if (!*s) return dopt__fail(DOPT_ERR_FORMAT, "%s: %s: empty name", where, ctx);
    if (!(p->name = ar_strdup(ar, s))) return dopt__fail(DOPT_ERR_NO_MEMORY, "%s", where);
    snprintf(ctx, sizeof ctx, "parameter '%s'", s);
    DOPT_TRY(jdtype(e, "dtype", where, ctx, &p->dtype));
    DOPT_TRY(jshape(e, "shape", where, ctx, &p->ndim, p->shape));
    DOPT_TRY(jint(e, "group", 0, m->ngroups - 1, where, ctx, &x));
    p->group = (int)x;
    DOPT_TRY(jint(e, "layer", -1, 2147483647.0, where, ctx, &x));
    p->layer = (int)x;
    DOPT_TRY(jint(e, "step", 0, CK_MAX_INT, where, ctx, &p->step));
    DOPT_TRY(jbool(e, "has_bf16", where, ctx, &p->has_bf16));
    DOPT_TRY(jbool(e, "has_state", where, ctx, &p->has_state));
    i++;
  }
  int g = 0;
  cJSON_ArrayForEach(e, gs) {
    snprintf(ctx, sizeof ctx, "groups[%d]", g);
    const cJSON *h, *mem, *nm;
    DOPT_TRY(jget(e, "hparams", where, ctx, &h));
    DOPT_TRY(parse_hparams(h, where, ctx, ar, &m->groups[g].hparams, &m->groups[g].nhparams));
    DOPT_TRY(jget(e, "params", where, ctx, &mem));
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

/* ---- writer ------------------------------------------------------------------------ */

typedef struct wr_piece {
  char *tensor;
  dopt_dtype dtype;
  int ndim;
  int64_t shape[DOPT_MAX_DIMS];
  dopt_piece pc;
  int index;   /* its ordinal among this rank's pieces of the tensor */
  int count;   /* (on a tensor's first piece) the pieces of the tensor so far */
  uint64_t begin, end;
  char sha[DOPT_DIGEST_HEX];
} wr_piece;

struct dopt_ckpt_writer {
  char dir[CK_PATH], path[CK_PATH], file[64];
  int rank, nranks, fd;
  uint64_t data; /* data bytes written */
  wr_piece *p;
  int n, cap;
  dopt_index names; /* tensor name -> its first piece */
};

static int same_tensor(const void *ctx, int i, const void *key) {
  return strcmp(((const dopt_ckpt_writer *)ctx)->p[i].tensor, (const char *)key) == 0;
}

dopt_status dopt_ckpt_writer_open(const char *dir, int rank, int nranks, dopt_ckpt_writer **out) {
  DOPT_CHECK_ARG(dir && out, "dopt_ckpt_writer_open: NULL argument");
  *out = NULL;
  DOPT_CHECK_ARG(nranks >= 1 && nranks <= 99999 && rank >= 0 && rank < nranks,
                 "dopt_ckpt_writer_open: rank=%d nranks=%d (need 0 <= rank < nranks <= 99999)", rank, nranks);
  dopt_ckpt_writer *w = calloc(1, sizeof *w);
  if (!w) return dopt__fail(DOPT_ERR_NO_MEMORY, "dopt_ckpt_writer_open: %zu bytes for the writer", sizeof *w);
  w->rank = rank;
  w->nranks = nranks;
  snprintf(w->file, sizeof w->file, "rank-%05d-of-%05d.safetensors", rank, nranks);
  int k = snprintf(w->dir, sizeof w->dir, "%s", dir);
  dopt_status s = k > 0 && k < (int)sizeof w->dir ? join(w->path, dir, w->file)
                                                  : dopt__fail(DOPT_ERR_INVALID_ARG, "dopt_ckpt_writer_open: dir is empty or longer than %zu bytes (%zu)",
                                                               sizeof w->dir - 1, strlen(dir));
  if (s == DOPT_OK && (w->fd = open(w->path, O_RDWR | O_CREAT | O_TRUNC, 0644)) < 0)
    s = dopt__fail(DOPT_ERR_IO, "%s: cannot create: %s", w->path, strerror(errno));
  if (s != DOPT_OK) {
    free(w);
    return s;
  }
  *out = w;
  return DOPT_OK;
}

static void writer_free(dopt_ckpt_writer *w) {
  for (int i = 0; i < w->n; i++) free(w->p[i].tensor);
  free(w->p);
  dopt__index_free(&w->names);
  free(w);
}

void dopt_ckpt_abort_writer(dopt_ckpt_writer *w) {
  if (!w) return;
  if (w->fd >= 0) close(w->fd);
  unlink(w->path);
  writer_free(w);
}

dopt_status dopt_ckpt_put(dopt_ckpt_writer *w, const char *tensor, dopt_dtype dt, int ndim, const int64_t *shape,
                          const dopt_piece *pc, const void *host_data) {
  DOPT_CHECK_ARG(w && tensor && pc && (shape || ndim == 0), "dopt_ckpt_put: NULL argument");
  DOPT_CHECK_ARG(*tensor, "dopt_ckpt_put: empty tensor name");
  DOPT_CHECK_ARG((unsigned)dt < DOPT_DTYPE_COUNT_, "dopt_ckpt_put: '%s' dtype=%d", tensor, (int)dt);
  DOPT_CHECK_ARG(ndim >= 0 && ndim <= DOPT_MAX_DIMS, "dopt_ckpt_put: '%s' ndim=%d", tensor, ndim);
  for (int d = 0; d < ndim; d++)
    DOPT_CHECK_ARG(shape[d] >= 0, "dopt_ckpt_put: '%s' shape[%d]=%lld", tensor, d, (long long)shape[d]);
  DOPT_TRY(check_piece(DOPT_ERR_INVALID_ARG, "dopt_ckpt_put", tensor, ndim, shape, pc));
  DOPT_CHECK_ARG(host_data || pc->len == 0, "dopt_ckpt_put: '%s' data=NULL", tensor);
  int first = dopt__index_find(&w->names, dopt__hash_str(tensor), same_tensor, w, tensor) - 1;
  if (first >= 0 && (w->p[first].dtype != dt || !same_shape(w->p[first].ndim, w->p[first].shape, ndim, shape))) {
    char a[160], b[160];
    shape_str(w->p[first].ndim, w->p[first].shape, a, sizeof a);
    shape_str(ndim, shape, b, sizeof b);
    return dopt__fail(DOPT_ERR_INVALID_ARG, "dopt_ckpt_put: tensor '%s' was %s %s, now %s %s", tensor,
                      dopt_dtype_name(w->p[first].dtype), a, dopt_dtype_name(dt), b);
  }
  if (w->n == w->cap) {
    int cap = w->cap ? 2 * w->cap : 64;
    wr_piece *p = realloc(w->p, (size_t)cap * sizeof *p);
    if (!p) return dopt__fail(DOPT_ERR_NO_MEMORY, "dopt_ckpt_put: %d pieces", cap);
    w->p = p;
    w->cap = cap;
  }
  wr_piece *p = &w->p[w->n];
  memset(p, 0, sizeof *p);
  size_t bytes = pc->len * dopt_dtype_size(dt);
  if (!(p->tensor = malloc(strlen(tensor) + 1))) return dopt__fail(DOPT_ERR_NO_MEMORY, "dopt_ckpt_put: '%s'", tensor);
  strcpy(p->tensor, tensor);
  p->dtype = dt;
  p->ndim = ndim;
  for (int d = 0; d < ndim; d++) p->shape[d] = shape[d];
  p->pc = *pc;
  p->begin = w->data;
  p->end = w->data + bytes;
  dopt_status s = dopt_digest_buffer(host_data, bytes, NULL, p->sha);
  if (s == DOPT_OK) s = pwrite_all(w->fd, host_data, bytes, 8 + CK_HEADER_RESERVE + w->data, w->path);
  if (s == DOPT_OK && first < 0) s = dopt__index_add(&w->names, dopt__hash_str(p->tensor), w->n);
  if (s != DOPT_OK) {
    free(p->tensor);
    return s;
  }
  if (first < 0) first = w->n;
  p->index = w->p[first].count++;
  w->data += bytes;
  w->n++;
  return DOPT_OK;
}

/* "<tensor>@<index>", allocated (NULL: out of memory). */
static char *piece_key(const wr_piece *p) {
  size_t cap = strlen(p->tensor) + 16;
  char *key = malloc(cap);
  if (key) snprintf(key, cap, "%s@%d", p->tensor, p->index);
  return key;
}

/* The safetensors header text of the writer's pieces. */
static char *writer_header(const dopt_ckpt_writer *w) {
  int oom = 0;
  cJSON *h = cJSON_CreateObject();
  cJSON *meta = jadd(h, "__metadata__", cJSON_CreateObject(), &oom);
  char buf[64], *key = NULL;
  jadd(meta, "format", cJSON_CreateString(DOPT_CKPT_FORMAT), &oom);
  snprintf(buf, sizeof buf, "%d", w->rank);
  jadd(meta, "rank", cJSON_CreateString(buf), &oom);
  snprintf(buf, sizeof buf, "%d", w->nranks);
  jadd(meta, "nranks", cJSON_CreateString(buf), &oom);
  for (int i = 0; i < w->n && !oom; i++) {
    const wr_piece *p = &w->p[i];
    free(key);
    if (!(key = piece_key(p))) {
      oom = 1;
      break;
    }
    cJSON *e = jadd(h, key, cJSON_CreateObject(), &oom);
    jadd(e, "dtype", cJSON_CreateString(dopt_dtype_name(p->dtype)), &oom);
    if (piece_is_whole(&p->pc)) jadd_shape(e, "shape", p->ndim, p->shape, &oom);
    else jadd_shape(e, "shape", 1, (const int64_t[1]){(int64_t)p->pc.len}, &oom);
    cJSON *of = jadd(e, "data_offsets", cJSON_CreateArray(), &oom);
    jadd(of, NULL, jnum((double)p->begin), &oom);
    jadd(of, NULL, jnum((double)p->end), &oom);
  }
  free(key);
  char *text = oom ? NULL : cJSON_PrintUnformatted(h);
  cJSON_Delete(h);
  return text;
}

static char *writer_rank_json(const dopt_ckpt_writer *w, uint64_t file_bytes) {
  int oom = 0;
  cJSON *r = cJSON_CreateObject();
  char *key = NULL;
  jadd(r, "format", cJSON_CreateString(CK_RANK_FORMAT), &oom);
  jadd(r, "version", jnum(DOPT_CKPT_FORMAT_VERSION), &oom);
  jadd(r, "rank", jnum(w->rank), &oom);
  jadd(r, "nranks", jnum(w->nranks), &oom);
  jadd(r, "file", cJSON_CreateString(w->file), &oom);
  jadd(r, "file_bytes", jnum((double)file_bytes), &oom);
  cJSON *ps = jadd(r, "pieces", cJSON_CreateArray(), &oom);
  for (int i = 0; i < w->n && !oom; i++) {
    const wr_piece *p = &w->p[i];
    free(key);
    if (!(key = piece_key(p))) {
      oom = 1;
      break;
    }
    cJSON *e = jadd(ps, NULL, cJSON_CreateObject(), &oom);
    jadd(e, "tensor", cJSON_CreateString(p->tensor), &oom);
    jadd(e, "dtype", cJSON_CreateString(dopt_dtype_name(p->dtype)), &oom);
    jadd_shape(e, "shape", p->ndim, p->shape, &oom);
    jadd(e, "key", cJSON_CreateString(key), &oom);
    jadd_piece(e, &p->pc, &oom);
    jadd(e, "bytes", jnum((double)(p->end - p->begin)), &oom);
    jadd(e, "sha256", cJSON_CreateString(p->sha), &oom);
  }
  free(key);
  char *text = oom ? NULL : cJSON_Print(r);
  cJSON_Delete(r);
  return text;
}

/* The header is longer than the reserved space: write it and the data into a new file. */
static dopt_status writer_move(dopt_ckpt_writer *w, const unsigned char *head, size_t hlen) {
  char tmp[CK_PATH];
  int k = snprintf(tmp, sizeof tmp, "%s.move", w->path);
  if (k < 0 || k >= (int)sizeof tmp) return dopt__fail(DOPT_ERR_INVALID_ARG, "%s: path too long", w->path);
  int fd = open(tmp, O_RDWR | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) return dopt__fail(DOPT_ERR_IO, "%s: cannot create: %s", tmp, strerror(errno));
  dopt_status s = pwrite_all(fd, head, hlen, 0, tmp);
  unsigned char *buf = s == DOPT_OK ? malloc(CK_CHUNK) : NULL;
  if (s == DOPT_OK && !buf) s = dopt__fail(DOPT_ERR_NO_MEMORY, "%s: copy buffer", tmp);
  for (uint64_t off = 0; s == DOPT_OK && off < w->data; off += CK_CHUNK) {
    size_t n = w->data - off < CK_CHUNK ? (size_t)(w->data - off) : CK_CHUNK;
    s = pread_all(w->fd, buf, n, 8 + CK_HEADER_RESERVE + off, w->path);
    if (s == DOPT_OK) s = pwrite_all(fd, buf, n, hlen + off, tmp);
  }
  free(buf);
  if (s == DOPT_OK && fsync(fd) != 0) s = dopt__fail(DOPT_ERR_IO, "%s: fsync failed: %s", tmp, strerror(errno));
  if (s == DOPT_OK && rename(tmp, w->path) != 0) s = dopt__fail(DOPT_ERR_IO, "%s: rename failed: %s", tmp, strerror(errno));
  if (s != DOPT_OK) {
    close(fd);
    unlink(tmp);
    return s;
  }
  close(w->fd);
  w->fd = fd;
  return DOPT_OK;
}

dopt_status dopt_ckpt_writer_close(dopt_ckpt_writer *w) {
  DOPT_CHECK_ARG(w != NULL, "dopt_ckpt_writer_close: writer=NULL");
  char *json = writer_header(w), *rank_json = NULL;
  unsigned char *head = NULL;
  dopt_status s = json ? DOPT_OK : dopt__fail(DOPT_ERR_NO_MEMORY, "%s: header", w->path);
  /* the header fills the reserved space; a longer one, or little data, moves the data once */
  size_t jl = json ? strlen(json) : 0;
  int move = jl > CK_HEADER_RESERVE || w->data <= CK_COMPACT;
  size_t hl = move ? (jl + 7) & ~(size_t)7 : CK_HEADER_RESERVE;
  if (s == DOPT_OK && !(head = malloc(8 + hl))) s = dopt__fail(DOPT_ERR_NO_MEMORY, "%s: header", w->path);
  if (s == DOPT_OK) { /* 8-byte little-endian length, the JSON, spaces (safetensors' padding) */
    for (int i = 0; i < 8; i++) head[i] = (unsigned char)((uint64_t)hl >> (8 * i));
    memcpy(head + 8, json, jl);
    memset(head + 8 + jl, ' ', hl - jl);
    s = move ? writer_move(w, head, 8 + hl) : pwrite_all(w->fd, head, 8 + hl, 0, w->path);
  }
  if (s == DOPT_OK && fsync(w->fd) != 0) s = dopt__fail(DOPT_ERR_IO, "%s: fsync failed: %s", w->path, strerror(errno));
  if (s == DOPT_OK && close(w->fd) != 0) s = dopt__fail(DOPT_ERR_IO, "%s: close failed: %s", w->path, strerror(errno));
  else if (s == DOPT_OK) w->fd = -1;
  if (s == DOPT_OK && !(rank_json = writer_rank_json(w, 8 + hl + w->data)))
    s = dopt__fail(DOPT_ERR_NO_MEMORY, "%s: piece list", w->path);
  if (s == DOPT_OK) {
    char name[32], path[CK_PATH];
    snprintf(name, sizeof name, "rank-%05d.json", w->rank);
    s = join(path, w->dir, name);
    if (s == DOPT_OK) s = write_durable(path, rank_json, strlen(rank_json));
  }
  free(json);
  free(head);
  free(rank_json);
  if (s != DOPT_OK) {
    dopt_ckpt_abort_writer(w);
    return s;
  }
  writer_free(w);
  return DOPT_OK;
}

/* ---- generations --------------------------------------------------------------------- */

dopt_status dopt_ckpt_tmp_dir(const char *ckpt_dir, int64_t step, char *out, size_t cap) {
  DOPT_CHECK_ARG(ckpt_dir && *ckpt_dir && out, "dopt_ckpt_tmp_dir: NULL argument");
  DOPT_CHECK_ARG(step >= 0 && step < (int64_t)CK_MAX_INT, "dopt_ckpt_tmp_dir: global_step=%lld", (long long)step);
  int n = snprintf(out, cap, "%s/.tmp-step-%09lld", ckpt_dir, (long long)step);
  if (n < 0 || (size_t)n >= cap || n >= CK_PATH)
    return dopt__fail(DOPT_ERR_INVALID_ARG, "dopt_ckpt_tmp_dir: '%s' does not fit %zu bytes", ckpt_dir, cap);
  return DOPT_OK;
}

dopt_status dopt_ckpt_begin(const char *ckpt_dir, int64_t step, char *out, size_t cap) {
  DOPT_TRY(dopt_ckpt_tmp_dir(ckpt_dir, step, out, cap));
  DOPT_TRY(mkdir_p(ckpt_dir));
  DOPT_TRY(remove_flat_dir(out)); /* a crashed save of the same step */
  if (mkdir(out, 0755) != 0) return dopt__fail(DOPT_ERR_IO, "%s: cannot create: %s", out, strerror(errno));
  return fsync_path(ckpt_dir, 1);
}

static dopt_status read_json(const char *path, cJSON **out) {
  char *text;
  size_t n;
  DOPT_TRY(read_text(path, CK_MAX_JSON, &text, &n));
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

/* Reads tmp_dir/rank-<r>.json into the table. */
static dopt_status merge_rank(ck_table *t, const char *tmp_dir, int r, int *nranks) {
  char name[32], path[CK_PATH];
  snprintf(name, sizeof name, "rank-%05d.json", r);
  DOPT_TRY(join(path, tmp_dir, name));
  if (access(path, F_OK) != 0)
    return dopt__fail(DOPT_ERR_NOT_FOUND, "%s: missing: rank %d did not close its writer (generation incomplete)",
                      path, r);
  cJSON *j;
  DOPT_TRY(read_json(path, &j));
  const char *s;
  int64_t rank = 0, n = 0, fb = 0;
  dopt_status st = jstr(j, "format", path, "rank list", &s);
  if (st == DOPT_OK && strcmp(s, CK_RANK_FORMAT) != 0)
    st = dopt__fail(DOPT_ERR_FORMAT, "%s: format '%s' is not '%s'", path, s, CK_RANK_FORMAT);
  if (st == DOPT_OK) st = jint(j, "rank", 0, 99998, path, "rank list", &rank);
  if (st == DOPT_OK) st = jint(j, "nranks", 1, 99999, path, "rank list", &n);
  if (st == DOPT_OK && (rank != r || (*nranks > 0 && n != *nranks)))
    st = dopt__fail(DOPT_ERR_FORMAT, "%s: says rank %lld of %lld, expected rank %d of %d", path, (long long)rank,
                    (long long)n, r, *nranks);
  if (st == DOPT_OK) st = jstr(j, "file", path, "rank list", &s);
  char want[64];
  snprintf(want, sizeof want, "rank-%05d-of-%05lld.safetensors", r, (long long)n);
  if (st == DOPT_OK && strcmp(s, want) != 0) st = dopt__fail(DOPT_ERR_FORMAT, "%s: file '%s', expected '%s'", path, s, want);
  if (st == DOPT_OK) st = jint(j, "file_bytes", 0, CK_MAX_INT, path, "rank list", &fb);
  struct stat sb;
  char fpath[CK_PATH];
  if (st == DOPT_OK) st = join(fpath, tmp_dir, want);
  if (st == DOPT_OK && (stat(fpath, &sb) != 0 || (uint64_t)sb.st_size != (uint64_t)fb))
    st = dopt__fail(DOPT_ERR_IO, "%s: missing or %lld bytes, its rank list says %lld", fpath,
                    stat(fpath, &sb) == 0 ? (long long)sb.st_size : -1LL, (long long)fb);
  int file = 0;
  if (st == DOPT_OK) st = table_add_file(t, want, (uint64_t)fb, &file);
  const cJSON *ps = NULL, *e;
  if (st == DOPT_OK) st = jget(j, "pieces", path, "rank list", &ps);
  if (st == DOPT_OK && !cJSON_IsArray(ps)) st = dopt__fail(DOPT_ERR_FORMAT, "%s: \"pieces\" is not an array", path);
  if (st == DOPT_OK) cJSON_ArrayForEach(e, ps) if ((st = parse_piece(t, e, file, 1, NULL, path)) != DOPT_OK) break;
  cJSON_Delete(j);
  if (st == DOPT_OK) *nranks = (int)n;
  return st;
}

static char *index_json(const ck_table *t, const dopt_ckpt_meta *m) {
  int oom = 0;
  cJSON *r = meta_json(m, &oom);
  cJSON *fs = jadd(r, "files", cJSON_CreateArray(), &oom);
  for (int f = 0; f < t->nfiles; f++) {
    cJSON *fo = jadd(fs, NULL, cJSON_CreateObject(), &oom);
    jadd(fo, "name", cJSON_CreateString(t->files[f].name), &oom);
    jadd(fo, "bytes", jnum((double)t->files[f].bytes), &oom);
  }
  cJSON *ts = jadd(r, "tensors", cJSON_CreateArray(), &oom);
  for (int i = 0; i < t->nt && !oom; i++) {
    const ck_tensor *x = &t->t[i];
    cJSON *to = jadd(ts, NULL, cJSON_CreateObject(), &oom);
    jadd(to, "name", cJSON_CreateString(x->name), &oom);
    jadd(to, "dtype", cJSON_CreateString(dopt_dtype_name(x->dtype)), &oom);
    jadd_shape(to, "shape", x->ndim, x->shape, &oom);
    cJSON *ps = jadd(to, "pieces", cJSON_CreateArray(), &oom);
    for (int k = 0; k < x->npieces; k++) {
      const ck_piece *p = x->pieces[k];
      cJSON *po = jadd(ps, NULL, cJSON_CreateObject(), &oom);
      jadd(po, "file", cJSON_CreateString(t->files[p->file].name), &oom);
      jadd(po, "key", cJSON_CreateString(p->key), &oom);
      jadd_piece(po, &p->pc, &oom);
      jadd(po, "bytes", jnum((double)p->bytes), &oom);
      jadd(po, "sha256", cJSON_CreateString(p->sha), &oom);
    }
  }
  char *text = oom ? NULL : cJSON_Print(r);
  cJSON_Delete(r);
  return text;
}

/* Every parameter's fp32 values (and bf16 copy) must be in the generation. */
static dopt_status check_param_tensors(const ck_table *t, const dopt_ckpt_meta *m, const char *where) {
  char name[1024];
  for (int i = 0; i < m->nparams; i++) {
    const dopt_ckpt_param *p = &m->params[i];
    const ck_tensor *x = table_find(t, p->name);
    if (!x || x->dtype != DOPT_F32 || !same_shape(x->ndim, x->shape, p->ndim, p->shape))
      return dopt__fail(DOPT_ERR_NOT_FOUND, "%s: parameter '%s': no F32 tensor of its shape", where, p->name);
    if (p->has_bf16) {
      snprintf(name, sizeof name, "%s/bf16", p->name);
      x = table_find(t, name);
      if (!x || x->dtype != DOPT_BF16 || !same_shape(x->ndim, x->shape, p->ndim, p->shape))
        return dopt__fail(DOPT_ERR_NOT_FOUND, "%s: parameter '%s': has_bf16 but no BF16 tensor '%s' of its shape",
                          where, p->name, name);
    }
  }
  return DOPT_OK;
}

dopt_status dopt_ckpt_commit(const char *ckpt_dir, const char *tmp_dir, const dopt_ckpt_meta *meta) {
  DOPT_CHECK_ARG(ckpt_dir && tmp_dir, "dopt_ckpt_commit: NULL argument");
  DOPT_TRY(check_meta_input(meta, "dopt_ckpt_commit"));
  ck_table t;
  memset(&t, 0, sizeof t);
  int nranks = 0;
  dopt_status s = merge_rank(&t, tmp_dir, 0, &nranks);
  for (int r = 1; s == DOPT_OK && r < nranks; r++) s = merge_rank(&t, tmp_dir, r, &nranks);
  if (s == DOPT_OK) s = table_finish(&t, tmp_dir);
  if (s == DOPT_OK) s = check_param_tensors(&t, meta, tmp_dir);
  char *text = s == DOPT_OK ? index_json(&t, meta) : NULL;
  if (s == DOPT_OK && !text) s = dopt__fail(DOPT_ERR_NO_MEMORY, "%s: index.json", tmp_dir);
  table_free(&t);
  char path[CK_PATH], gen[32], dst[CK_PATH];
  if (s == DOPT_OK) s = join(path, tmp_dir, "index.json");
  if (s == DOPT_OK) s = write_durable(path, text, strlen(text));
  free(text);
  snprintf(gen, sizeof gen, "step-%09lld", (long long)meta->global_step);
  if (s == DOPT_OK) s = join(dst, ckpt_dir, gen);
  if (s != DOPT_OK) return s;
  struct stat sb;
  if (stat(dst, &sb) == 0) { /* the same step saved again: swap atomically, then drop the old one */
    if (renameat2(AT_FDCWD, tmp_dir, AT_FDCWD, dst, RENAME_EXCHANGE) != 0)
      return dopt__fail(DOPT_ERR_IO, "%s: cannot replace the existing generation: %s", dst, strerror(errno));
    DOPT_TRY(fsync_path(ckpt_dir, 1));
    DOPT_TRY(remove_flat_dir(tmp_dir));
  } else if (rename(tmp_dir, dst) != 0) {
    return dopt__fail(DOPT_ERR_IO, "%s: cannot rename to %s: %s", tmp_dir, dst, strerror(errno));
  }
  DOPT_TRY(fsync_path(ckpt_dir, 1));
  char latest[CK_PATH], line[40];
  DOPT_TRY(join(latest, ckpt_dir, "latest"));
  int n = snprintf(line, sizeof line, "%s\n", gen);
  return write_durable(latest, line, (size_t)n);
}

/* ---- reader --------------------------------------------------------------------------- */

struct dopt_ckpt_reader {
  char gen[CK_PATH];
  char index_path[CK_PATH];
  meta_box meta;
  ck_table t;
  unsigned char *buf; /* CK_CHUNK */
};

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
  DOPT_TRY(join(latest, path, "latest"));
  DOPT_TRY(join(idx, path, "index.json"));
  if (access(latest, F_OK) == 0) {
    char *text;
    DOPT_TRY(read_text(latest, 256, &text, NULL));
    size_t n = strlen(text);
    while (n > 0 && (text[n - 1] == '\n' || text[n - 1] == ' ' || text[n - 1] == '\r')) text[--n] = '\0';
    dopt_status s = gen_name_ok(text) ? join(gen, path, text)
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
    if ((s = join(path, r->gen, t->files[f].name)) != DOPT_OK) break;
    int fd = open(path, O_RDONLY);
    if (fd < 0) {
      s = dopt__fail(errno == ENOENT ? DOPT_ERR_NOT_FOUND : DOPT_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
      break;
    }
    struct stat sb;
    unsigned char lenb[8];
    uint64_t hlen = 0;
    if (fstat(fd, &sb) != 0 || (uint64_t)sb.st_size != t->files[f].bytes)
      s = dopt__fail(DOPT_ERR_FORMAT, "%s: %lld bytes, index.json says %llu (truncated or replaced)", path,
                     (long long)sb.st_size, (unsigned long long)t->files[f].bytes);
    if (s == DOPT_OK) s = pread_all(fd, lenb, 8, 0, path);
    for (int i = 7; s == DOPT_OK && i >= 0; i--) hlen = (hlen << 8) | lenb[i];
    if (s == DOPT_OK && (hlen > CK_MAX_HEADER || hlen + 8 > t->files[f].bytes))
      s = dopt__fail(DOPT_ERR_FORMAT, "%s: safetensors header length %llu exceeds the file", path,
                     (unsigned long long)hlen);
    if (s == DOPT_OK && !(hdr = malloc((size_t)hlen + 1))) s = dopt__fail(DOPT_ERR_NO_MEMORY, "%s: header", path);
    if (s == DOPT_OK) s = pread_all(fd, hdr, (size_t)hlen, 8, path);
    close(fd);
    const char *end = NULL;
    if (s == DOPT_OK) {
      hdr[hlen] = '\0';
      h = cJSON_ParseWithLengthOpts(hdr, (size_t)hlen, &end, 0);
      int bad = !h || !cJSON_IsObject(h) || hdr[0] != '{';
      for (const char *c = end; !bad && c && c < hdr + hlen; c++) bad = *c != ' ';
      if (bad) s = dopt__fail(DOPT_ERR_FORMAT, "%s: safetensors header is not a JSON object (corrupted)", path);
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
      if ((s = jdtype(e, "dtype", path, ctx, &dt)) != DOPT_OK || (s = jshape(e, "shape", path, ctx, &nd, sh)) != DOPT_OK ||
          (s = jget(e, "data_offsets", path, ctx, &of)) != DOPT_OK)
        break;
      const cJSON *b0 = cJSON_GetArrayItem(of, 0), *b1 = cJSON_GetArrayItem(of, 1);
      double ob = cJSON_IsNumber(b0) ? b0->valuedouble : -1, oe = cJSON_IsNumber(b1) ? b1->valuedouble : -1;
      int whole = piece_is_whole(&p->pc);
      int64_t flat[1] = {(int64_t)p->pc.len};
      if (dt != p->dtype || !(whole ? same_shape(nd, sh, p->ndim, p->shape) : same_shape(nd, sh, 1, flat))) {
        char a[160];
        shape_str(nd, sh, a, sizeof a);
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
  ar_free(&r->meta.ar);
  table_free(&r->t);
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
  if (st == DOPT_OK) st = join(r->index_path, r->gen, "index.json");
  if (st == DOPT_OK && access(r->index_path, F_OK) != 0)
    st = dopt__fail(DOPT_ERR_NOT_FOUND, "%s: missing: a half-written generation", r->index_path);
  if (st == DOPT_OK) st = read_json(r->index_path, &j);
  if (st == DOPT_OK) st = jstr(j, "format", where, "index", &s);
  if (st == DOPT_OK && strcmp(s, DOPT_CKPT_FORMAT) != 0)
    st = dopt__fail(DOPT_ERR_FORMAT, "%s: format '%s' is not '%s'", where, s, DOPT_CKPT_FORMAT);
  if (st == DOPT_OK) st = jint(j, "version", 0, CK_MAX_INT, where, "index", &version);
  if (st == DOPT_OK && version != DOPT_CKPT_FORMAT_VERSION)
    st = dopt__fail(DOPT_ERR_UNSUPPORTED, "%s: format version %lld is unknown (this library reads version %d)", where,
                    (long long)version, DOPT_CKPT_FORMAT_VERSION);
  if (st == DOPT_OK) st = parse_meta(j, where, &r->meta);
  const cJSON *fs = NULL, *ts = NULL, *e;
  if (st == DOPT_OK) st = jget(j, "files", where, "index", &fs);
  if (st == DOPT_OK) st = jget(j, "tensors", where, "index", &ts);
  if (st == DOPT_OK && (!cJSON_IsArray(fs) || !cJSON_IsArray(ts)))
    st = dopt__fail(DOPT_ERR_FORMAT, "%s: \"files\" and \"tensors\" must be arrays", where);
  if (st == DOPT_OK) cJSON_ArrayForEach(e, fs) {
    const char *nm;
    int64_t bytes;
    int idx;
    if ((st = jstr(e, "name", where, "files[]", &nm)) != DOPT_OK) break;
    if (!rank_file_name_ok(nm)) {
      st = dopt__fail(DOPT_ERR_FORMAT, "%s: file '%s' is not a rank file name", where, nm);
      break;
    }
    for (int f = 0; f < r->t.nfiles; f++)
      if (strcmp(r->t.files[f].name, nm) == 0) st = dopt__fail(DOPT_ERR_FORMAT, "%s: file '%s' listed twice", where, nm);
    if (st != DOPT_OK || (st = jint(e, "bytes", 0, CK_MAX_INT, where, nm, &bytes)) != DOPT_OK ||
        (st = table_add_file(&r->t, nm, (uint64_t)bytes, &idx)) != DOPT_OK)
      break;
  }
  if (st == DOPT_OK) cJSON_ArrayForEach(e, ts) {
    ck_tensor owner;
    memset(&owner, 0, sizeof owner);
    const cJSON *ps, *pe;
    if ((st = jstr(e, "name", where, "tensors[]", &owner.name)) != DOPT_OK) break;
    if ((st = jdtype(e, "dtype", where, owner.name, &owner.dtype)) != DOPT_OK ||
        (st = jshape(e, "shape", where, owner.name, &owner.ndim, owner.shape)) != DOPT_OK ||
        (st = jget(e, "pieces", where, owner.name, &ps)) != DOPT_OK)
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
      if ((st = jstr(pe, "file", where, owner.name, &fname)) != DOPT_OK) break;
      int file = -1;
      for (int f = 0; f < r->t.nfiles; f++)
        if (strcmp(r->t.files[f].name, fname) == 0) file = f;
      if (file < 0) {
        st = dopt__fail(DOPT_ERR_FORMAT, "%s: tensor '%s': piece file '%s' is not in \"files\"", where, owner.name, fname);
        break;
      }
      if ((st = parse_piece(&r->t, pe, file, 0, &owner, where)) != DOPT_OK) break;
    }
    if (st != DOPT_OK) break;
  }
  cJSON_Delete(j);
  if (st == DOPT_OK) st = table_finish(&r->t, where);
  if (st == DOPT_OK) st = check_param_tensors(&r->t, &r->meta.m, where);
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
  const ck_tensor *x = table_find(&r->t, tensor);
  if (!x) return dopt__fail(DOPT_ERR_NOT_FOUND, "%s: no tensor '%s'", r->index_path, tensor);
  tensor_info(x, out);
  return DOPT_OK;
}

/* Reads one saved piece whole in chunks, hashing it; the elements that lie
 * in `want` go to out (want NULL: verify only). */
static dopt_status read_piece(dopt_ckpt_reader *r, const ck_tensor *x, const ck_piece *p, const dopt_piece *want,
                              void *out, size_t *got) {
  char path[CK_PATH];
  DOPT_TRY(join(path, r->gen, r->t.files[p->file].name));
  int fd = open(path, O_RDONLY);
  if (fd < 0)
    return dopt__fail(errno == ENOENT ? DOPT_ERR_NOT_FOUND : DOPT_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
  dopt_digest *d = NULL;
  dopt_status s = dopt_digest_create(&d);
  const size_t es = dopt_dtype_size(x->dtype), chunk = CK_CHUNK / es;
  for (size_t e0 = 0; s == DOPT_OK && e0 < p->pc.len; e0 += chunk) {
    size_t e1 = p->pc.len - e0 < chunk ? p->pc.len : e0 + chunk;
    s = pread_all(fd, r->buf, (e1 - e0) * es, p->offset + e0 * es, path);
    if (s == DOPT_OK) s = dopt_digest_bytes(d, r->buf, (e1 - e0) * es);
    if (s == DOPT_OK && want) *got += scatter(&p->pc, e0, e1, r->buf, want, out, es);
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
  const ck_tensor *x = table_find(&r->t, tensor);
  if (!x) return dopt__fail(DOPT_ERR_NOT_FOUND, "%s: no tensor '%s'", r->index_path, tensor);
  DOPT_TRY(check_piece(DOPT_ERR_INVALID_ARG, "dopt_ckpt_get", tensor, x->ndim, x->shape, want));
  size_t got = 0;
  for (int k = 0; k < x->npieces; k++) {
    const ck_piece *p = x->pieces[k];
    if (p->pc.len == 0 || want->len == 0 || !blocks_meet(&p->pc, want)) continue;
    if (scatter(&p->pc, 0, p->pc.len, NULL, want, NULL, 0) == 0) continue; /* no element in common: not read */
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

/* ---- metadata of an optimizer -------------------------------------------------------------- */

void dopt_ckpt_meta_free(dopt_ckpt_meta *m) {
  if (!m) return;
  meta_box *b = (meta_box *)(void *)m;
  ar_free(&b->ar);
  free(b);
}

static void hparams_of(const dopt_optim_impl *im, const double *hp, dopt_ckpt_hparam *out) {
  for (int k = 0; k < im->nhp; k++) {
    const dopt_hp_def *d = &im->hp[k];
    dopt_ckpt_hparam *h = &out[k];
    h->key = d->key;
    h->value = hp[k];
    h->choice = NULL;
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
  m->groups = ar_alloc(&b->ar, (size_t)(m->ngroups ? m->ngroups : 1) * sizeof *m->groups);
  m->params = ar_alloc(&b->ar, (size_t)(m->nparams ? m->nparams : 1) * sizeof *m->params);
  int ok = m->groups && m->params;
  for (int g = 0; ok && g < m->ngroups; g++) {
    m->groups[g].nhparams = im->nhp;
    ok = (m->groups[g].hparams = ar_alloc(&b->ar, (size_t)im->nhp * sizeof(dopt_ckpt_hparam))) != NULL;
    if (ok) hparams_of(im, dopt__optim_group_hp(o, g), m->groups[g].hparams);
  }
  if (ok && wr) {
    m->wrapper = wr->name;
    m->nwrapper_hparams = wr->nhp;
    ok = (m->wrapper_hparams = ar_alloc(&b->ar, (size_t)wr->nhp * sizeof(dopt_ckpt_hparam))) != NULL;
    if (ok) hparams_of(wr, dopt__optim_wrapper_hp(o), m->wrapper_hparams);
  }
  for (int i = 0; ok && i < m->nparams; i++) {
    const dopt_param *p = dopt__optim_param((dopt_optim *)(uintptr_t)o, i); /* read only */
    dopt_ckpt_param *q = &m->params[i];
    ok = (q->name = ar_strdup(&b->ar, p->name)) != NULL;
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
    hp_str(&l[k], b, sizeof b);
    if (!x)
      return dopt__fail(DOPT_ERR_INVALID_ARG, "%s: %s: hyperparameter %s is missing in the checkpoint (optimizer %s)",
                        where, what, l[k].key, b);
    hp_str(x, a, sizeof a);
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
    if (a->dtype != b->dtype || !same_shape(a->ndim, a->shape, b->ndim, b->shape)) {
      char x[160], y[160];
      shape_str(a->ndim, a->shape, x, sizeof x);
      shape_str(b->ndim, b->shape, y, sizeof y);
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
  char **names = ar_alloc(ar, (size_t)(cap ? cap : 1) * sizeof *names);
  if (!names) return dopt__fail(DOPT_ERR_NO_MEMORY, "checkpoint: %d tensor names", cap);
  for (int i = 0; i < m->nparams; i++) {
    const dopt_ckpt_param *p = &m->params[i];
    dopt_state_spec lay[DOPT_MAX_STATES];
    int ns = p->has_state ? im->layout(dopt__optim_group_hp(o, p->group), p->ndim, p->shape, lay) : 0;
    for (int k = -2; k < ns; k++) {
      if (k == -1 && !p->has_bf16) continue;
      size_t len = strlen(p->name) + 8 + (k >= 0 ? strlen(lay[k].v.name) : 0);
      char *nm = ar_alloc(ar, len);
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
    (void)remove_flat_dir(tmp);
    dopt__fail(s, "%s", keep); /* the first failure's message, not the clean-up's */
  }
  dopt__index_free(&ix);
  ar_free(&ar);
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
  if (s == DOPT_OK && !(buf = ar_alloc(&ar, (size_t)(nnames ? nnames : 1) * sizeof *buf)))
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
      const ck_tensor *x = table_find(&r->t, names[t]);
      if (!x || x->dtype != dt || !same_shape(x->ndim, x->shape, nd, sh)) {
        char a[160];
        shape_str(nd, sh, a, sizeof a);
        s = dopt__fail(DOPT_ERR_SHAPE, "%s: tensor '%s': expected %s %s, the checkpoint has %s", r->index_path,
                       names[t], dopt_dtype_name(dt), a, x ? dopt_dtype_name(x->dtype) : "none");
        break;
      }
      dopt_piece full;
      dopt_piece_full(nd, sh, &full);
      if (!(buf[t] = ar_alloc(&ar, full.numel * dopt_dtype_size(dt))))
        s = dopt__fail(DOPT_ERR_NO_MEMORY, "dopt_optim_load: '%s' (%zu bytes)", names[t], full.numel * dopt_dtype_size(dt));
      if (s == DOPT_OK) s = dopt_ckpt_get(r, names[t], &full, buf[t]);
      t++;
    }
  }
  /* 2. allocate the states that are not (undone if that fails): the only step that can fail */
  unsigned char *fresh = s == DOPT_OK ? ar_alloc(&ar, (size_t)(lm->nparams ? lm->nparams : 1)) : NULL;
  int64_t *old_step = s == DOPT_OK ? ar_alloc(&ar, (size_t)(lm->nparams ? lm->nparams : 1) * sizeof *old_step) : NULL;
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
  }
  dopt__index_free(&ix);
  ar_free(&ar);
  dopt_ckpt_meta_free(lm);
  dopt_ckpt_close(r);
  return s;
}
