/* Writing checkpoints (include/distopt/checkpoint.h): a rank's writer, its
 * safetensors file of pieces and its piece list; the generations — begun in a
 * temporary folder, committed by rank 0 with the index and an atomic rename,
 * then `latest`. */
#define _GNU_SOURCE /* renameat2(RENAME_EXCHANGE): replace an existing generation atomically */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ckpt_internal.h"
#include "index.h"

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
  dopt_wfile *wf; /* the rank file, written to a temporary and renamed into place on close */
  int placed;     /* renamed into place (an abort then removes it) */
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
  dopt_status s = k > 0 && k < (int)sizeof w->dir ? dopt__path_join(w->path, dir, w->file)
                                                  : dopt__fail(DOPT_ERR_INVALID_ARG, "dopt_ckpt_writer_open: dir is empty or longer than %zu bytes (%zu)",
                                                               sizeof w->dir - 1, strlen(dir));
  if (s == DOPT_OK) s = dopt__wfile_open(w->path, DOPT_W_INTERNAL, &w->wf);
  w->fd = dopt__wfile_fd(w->wf);
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
  dopt__wfile_abort(w->wf); /* the temporary goes */
  if (w->placed) unlink(w->path);
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
  DOPT_TRY(ck_check_piece(DOPT_ERR_INVALID_ARG, "dopt_ckpt_put", tensor, ndim, shape, pc));
  DOPT_CHECK_ARG(host_data || pc->len == 0, "dopt_ckpt_put: '%s' data=NULL", tensor);
  int first = dopt__index_find(&w->names, dopt__hash_str(tensor), same_tensor, w, tensor) - 1;
  if (first >= 0 && (w->p[first].dtype != dt || !ck_same_shape(w->p[first].ndim, w->p[first].shape, ndim, shape))) {
    char a[160], b[160];
    dopt__shape_text(w->p[first].ndim, w->p[first].shape, a, sizeof a);
    dopt__shape_text(ndim, shape, b, sizeof b);
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
  if (s == DOPT_OK) s = dopt__pwrite_all(w->fd, host_data, bytes, 8 + CK_HEADER_RESERVE + w->data, w->path);
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
  cJSON *meta = ck_jadd(h, "__metadata__", cJSON_CreateObject(), &oom);
  char buf[64], *key = NULL;
  ck_jadd(meta, "format", cJSON_CreateString(DOPT_CKPT_FORMAT), &oom);
  snprintf(buf, sizeof buf, "%d", w->rank);
  ck_jadd(meta, "rank", cJSON_CreateString(buf), &oom);
  snprintf(buf, sizeof buf, "%d", w->nranks);
  ck_jadd(meta, "nranks", cJSON_CreateString(buf), &oom);
  for (int i = 0; i < w->n && !oom; i++) {
    const wr_piece *p = &w->p[i];
    free(key);
    if (!(key = piece_key(p))) {
      oom = 1;
      break;
    }
    cJSON *e = ck_jadd(h, key, cJSON_CreateObject(), &oom);
    ck_jadd(e, "dtype", cJSON_CreateString(dopt_dtype_name(p->dtype)), &oom);
    if (ck_piece_is_whole(&p->pc)) ck_jadd_shape(e, "shape", p->ndim, p->shape, &oom);
    else ck_jadd_shape(e, "shape", 1, (const int64_t[1]){(int64_t)p->pc.len}, &oom);
    cJSON *of = ck_jadd(e, "data_offsets", cJSON_CreateArray(), &oom);
    ck_jadd(of, NULL, ck_jnum((double)p->begin), &oom);
    ck_jadd(of, NULL, ck_jnum((double)p->end), &oom);
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
  ck_jadd(r, "format", cJSON_CreateString(CK_RANK_FORMAT), &oom);
  ck_jadd(r, "version", ck_jnum(DOPT_CKPT_FORMAT_VERSION), &oom);
  ck_jadd(r, "rank", ck_jnum(w->rank), &oom);
  ck_jadd(r, "nranks", ck_jnum(w->nranks), &oom);
  ck_jadd(r, "file", cJSON_CreateString(w->file), &oom);
  ck_jadd(r, "file_bytes", ck_jnum((double)file_bytes), &oom);
  cJSON *ps = ck_jadd(r, "pieces", cJSON_CreateArray(), &oom);
  for (int i = 0; i < w->n && !oom; i++) {
    const wr_piece *p = &w->p[i];
    free(key);
    if (!(key = piece_key(p))) {
      oom = 1;
      break;
    }
    cJSON *e = ck_jadd(ps, NULL, cJSON_CreateObject(), &oom);
    ck_jadd(e, "tensor", cJSON_CreateString(p->tensor), &oom);
    ck_jadd(e, "dtype", cJSON_CreateString(dopt_dtype_name(p->dtype)), &oom);
    ck_jadd_shape(e, "shape", p->ndim, p->shape, &oom);
    ck_jadd(e, "key", cJSON_CreateString(key), &oom);
    ck_jadd_piece(e, &p->pc, &oom);
    ck_jadd(e, "bytes", ck_jnum((double)(p->end - p->begin)), &oom);
    ck_jadd(e, "sha256", cJSON_CreateString(p->sha), &oom);
  }
  free(key);
  char *text = oom ? NULL : cJSON_Print(r);
  cJSON_Delete(r);
  return text;
}

/* The header is longer than the reserved space, or the data short: the header
 * and the data go into a new temporary file, which replaces the first one. */
static dopt_status writer_move(dopt_ckpt_writer *w, const unsigned char *head, size_t hlen) {
  dopt_wfile *nf;
  DOPT_TRY(dopt__wfile_open(w->path, DOPT_W_INTERNAL, &nf));
  const int fd = dopt__wfile_fd(nf);
  dopt_status s = dopt__pwrite_all(fd, head, hlen, 0, w->path);
  unsigned char *buf = s == DOPT_OK ? malloc(CK_CHUNK) : NULL;
  if (s == DOPT_OK && !buf) s = dopt__fail(DOPT_ERR_NO_MEMORY, "%s: copy buffer", w->path);
  for (uint64_t off = 0; s == DOPT_OK && off < w->data; off += CK_CHUNK) {
    size_t n = w->data - off < CK_CHUNK ? (size_t)(w->data - off) : CK_CHUNK;
    s = dopt__pread_all(w->fd, buf, n, 8 + CK_HEADER_RESERVE + off, w->path);
    if (s == DOPT_OK) s = dopt__pwrite_all(fd, buf, n, hlen + off, w->path);
  }
  free(buf);
  if (s != DOPT_OK) {
    dopt__wfile_abort(nf);
    return s;
  }
  dopt__wfile_abort(w->wf);
  w->wf = nf;
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
    s = move ? writer_move(w, head, 8 + hl) : dopt__pwrite_all(w->fd, head, 8 + hl, 0, w->path);
  }
  if (s == DOPT_OK) { /* synced and renamed into place; freed either way */
    s = dopt__wfile_commit(w->wf);
    w->wf = NULL;
    w->fd = -1;
    w->placed = s == DOPT_OK;
  }
  if (s == DOPT_OK && !(rank_json = writer_rank_json(w, 8 + hl + w->data)))
    s = dopt__fail(DOPT_ERR_NO_MEMORY, "%s: piece list", w->path);
  if (s == DOPT_OK) {
    char name[32], path[CK_PATH];
    snprintf(name, sizeof name, "rank-%05d.json", w->rank);
    s = dopt__path_join(path, w->dir, name);
    if (s == DOPT_OK) s = dopt__write_file(path, DOPT_W_INTERNAL, rank_json, strlen(rank_json));
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

/* What stands at a generation's name in the checkpoint folder: nothing, a
 * folder (an earlier save of the same step: replaced) or a symbolic link
 * (removed as a link, never followed). Anything else is not distopt's: an
 * error naming it, found before anything is written. */
static dopt_status check_gen_slot(const char *path, int *is_dir, int *is_link) {
  struct stat st;
  *is_dir = *is_link = 0;
  if (lstat(path, &st) != 0) {
    if (errno == ENOENT) return DOPT_OK;
    return dopt__fail(DOPT_ERR_IO, "%s: %s", path, strerror(errno));
  }
  *is_dir = S_ISDIR(st.st_mode);
  *is_link = S_ISLNK(st.st_mode);
  if (!*is_dir && !*is_link)
    return dopt__fail(DOPT_ERR_IO, "%s is %s where a checkpoint generation's folder belongs (remove it or choose "
                      "another checkpoint folder)", path, dopt__file_kind((unsigned)st.st_mode));
  return DOPT_OK;
}

static dopt_status gen_path(const char *ckpt_dir, int64_t step, char *gen, char *dst) {
  snprintf(gen, 32, "step-%09lld", (long long)step);
  return dopt__path_join(dst, ckpt_dir, gen);
}

/* The slots a save of step fills: its generation and temporary (nothing, a folder or a link) and `latest`
 * (not a folder). */
static dopt_status check_slots(const char *ckpt_dir, int64_t step, const char *tmp) {
  char gen[32], dst[CK_PATH], latest[CK_PATH];
  int is_dir, is_link;
  DOPT_TRY(gen_path(ckpt_dir, step, gen, dst));
  DOPT_TRY(dopt__path_join(latest, ckpt_dir, "latest"));
  DOPT_TRY(check_gen_slot(dst, &is_dir, &is_link));
  DOPT_TRY(check_gen_slot(tmp, &is_dir, &is_link));
  struct stat st;
  if (lstat(latest, &st) == 0 && S_ISDIR(st.st_mode))
    return dopt__fail(DOPT_ERR_IO, "%s is a folder where the checkpoint's file 'latest' belongs (remove it or choose "
                      "another checkpoint folder)", latest);
  return DOPT_OK;
}

dopt_status dopt_ckpt_check_dir(const char *ckpt_dir, int64_t step) {
  char tmp[CK_PATH];
  DOPT_TRY(dopt_ckpt_tmp_dir(ckpt_dir, step, tmp, sizeof tmp));
  DOPT_TRY(dopt__check_output(NULL, ckpt_dir, DOPT_OUT_DIR));
  return check_slots(ckpt_dir, step, tmp);
}

dopt_status dopt_ckpt_begin(const char *ckpt_dir, int64_t step, char *out, size_t cap) {
  DOPT_TRY(dopt_ckpt_tmp_dir(ckpt_dir, step, out, cap));
  DOPT_TRY(dopt__mkdir_p(ckpt_dir));
  DOPT_TRY(check_slots(ckpt_dir, step, out));
  DOPT_TRY(dopt__remove_flat_dir(out)); /* a crashed save of the same step; a link there goes as a link */
  if (mkdir(out, 0755) != 0) return dopt__fail(DOPT_ERR_IO, "%s: cannot create: %s", out, strerror(errno));
  return dopt__sync_dir(ckpt_dir);
}

/* 1 when name is a generation's (step-<digits>) or a temporary's (.tmp-step-<digits>); *step its number. */
static int gen_name(const char *name, int tmp_too, long long *step) {
  const char *d = strncmp(name, "step-", 5) == 0                  ? name + 5
                  : tmp_too && strncmp(name, ".tmp-step-", 10) == 0 ? name + 10
                                                                    : NULL;
  if (!d || !*d) return 0;
  for (const char *c = d; *c; c++)
    if (*c < '0' || *c > '9' || c - d > 17) return 0;
  *step = strtoll(d, NULL, 10);
  return 1;
}

/* The first generation's name in ckpt_dir ("" when none); DOPT_OK when the folder is missing. */
static dopt_status first_generation(const char *ckpt_dir, int tmp_too, char *name, size_t cap) {
  name[0] = '\0';
  DIR *d = opendir(ckpt_dir);
  if (!d) {
    if (errno == ENOENT) return DOPT_OK;
    return dopt__fail(DOPT_ERR_IO, "checkpoint folder '%s': %s", ckpt_dir, strerror(errno));
  }
  long long step;
  for (struct dirent *e; (e = readdir(d)) != NULL;)
    if (gen_name(e->d_name, tmp_too, &step)) {
      snprintf(name, cap, "%s", e->d_name);
      break;
    }
  closedir(d);
  return DOPT_OK;
}

/* A callee's message without its "DOPT_ERR_X: " (it is wrapped in another status's message). */
static const char *detail(const char *msg) {
  const char *c = strncmp(msg, "DOPT_", 5) == 0 ? strstr(msg, ": ") : NULL;
  return c ? c + 2 : msg;
}

dopt_status dopt_ckpt_claim(const char *ckpt_dir, const dopt_ckpt_meta *live, int64_t first_step) {
  DOPT_CHECK_ARG(ckpt_dir && *ckpt_dir && live, "dopt_ckpt_claim: NULL argument");
  char latest[CK_PATH], gen[256];
  DOPT_TRY(dopt__path_join(latest, ckpt_dir, "latest"));
  struct stat st;
  if (lstat(latest, &st) != 0) {
    if (errno != ENOENT) return dopt__fail(DOPT_ERR_IO, "%s: %s", latest, strerror(errno));
    DOPT_TRY(first_generation(ckpt_dir, 0, gen, sizeof gen));
    if (gen[0])
      return dopt__fail(DOPT_ERR_STATE, "checkpoint folder '%s' holds generation '%s' but no 'latest': it cannot say "
                        "which run wrote it, so nothing is written into it", ckpt_dir, gen);
    return DOPT_OK;
  }
  dopt_ckpt_reader *r;
  dopt_status s = dopt_ckpt_open(ckpt_dir, &r);
  if (s != DOPT_OK) {
    char why[1024];
    snprintf(why, sizeof why, "%s", detail(dopt_last_error()));
    return dopt__fail(DOPT_ERR_STATE, "checkpoint folder '%s': its latest generation cannot be read, so it cannot say "
                      "which run wrote it (%s)", ckpt_dir, why);
  }
  const dopt_ckpt_meta *m;
  dopt_ckpt_read_meta(r, &m);
  const int64_t last = m->global_step;
  s = dopt_ckpt_meta_check(m, live, dopt_ckpt_path(r));
  if (s != DOPT_OK) {
    char why[1024];
    snprintf(why, sizeof why, "%s", detail(dopt_last_error()));
    dopt_ckpt_close(r);
    return dopt__fail(DOPT_ERR_STATE, "checkpoint folder '%s' holds another run's generations: %s", ckpt_dir, why);
  }
  dopt_ckpt_close(r);
  if (first_step <= last)
    return dopt__fail(DOPT_ERR_STATE, "checkpoint folder '%s': its latest generation is step %lld of this run; a save "
                      "after step %lld would %s", ckpt_dir, (long long)last, (long long)first_step,
                      first_step == last ? "replace it" : "move 'latest' back");
  return DOPT_OK;
}

dopt_status dopt_ckpt_clear(const char *ckpt_dir) {
  DOPT_CHECK_ARG(ckpt_dir && *ckpt_dir, "dopt_ckpt_clear: ckpt_dir is NULL or empty");
  char latest[CK_PATH], gen[256], path[CK_PATH];
  DOPT_TRY(dopt__path_join(latest, ckpt_dir, "latest"));
  struct stat st;
  if (lstat(latest, &st) == 0) {
    if (S_ISDIR(st.st_mode))
      return dopt__fail(DOPT_ERR_IO, "%s is a folder where the checkpoint's file 'latest' belongs (remove it or "
                        "choose another checkpoint folder)", latest);
    if (unlink(latest) != 0) return dopt__fail(DOPT_ERR_IO, "%s: cannot remove: %s", latest, strerror(errno));
  }
  for (;;) { /* one at a time: the listing is read again after each removal */
    DOPT_TRY(first_generation(ckpt_dir, 1, gen, sizeof gen));
    if (!gen[0]) break;
    DOPT_TRY(dopt__path_join(path, ckpt_dir, gen));
    DOPT_TRY(dopt__remove_flat_dir(path));
  }
  struct stat ds;
  return stat(ckpt_dir, &ds) == 0 ? dopt__sync_dir(ckpt_dir) : DOPT_OK;
}

dopt_status dopt_ckpt_discard(const char *tmp_dir) {
  DOPT_CHECK_ARG(tmp_dir && *tmp_dir, "dopt_ckpt_discard: tmp_dir is NULL or empty");
  return dopt__remove_flat_dir(tmp_dir);
}

/* Reads tmp_dir/rank-<r>.json into the table. */
static dopt_status merge_rank(ck_table *t, const char *tmp_dir, int r, int *nranks) {
  char name[32], path[CK_PATH];
  snprintf(name, sizeof name, "rank-%05d.json", r);
  DOPT_TRY(dopt__path_join(path, tmp_dir, name));
  if (access(path, F_OK) != 0)
    return dopt__fail(DOPT_ERR_NOT_FOUND, "%s: missing: rank %d did not close its writer (generation incomplete)",
                      path, r);
  cJSON *j;
  DOPT_TRY(ck_read_json(path, &j));
  const char *s;
  int64_t rank = 0, n = 0, fb = 0;
  dopt_status st = ck_jstr(j, "format", path, "rank list", &s);
  if (st == DOPT_OK && strcmp(s, CK_RANK_FORMAT) != 0)
    st = dopt__fail(DOPT_ERR_FORMAT, "%s: format '%s' is not '%s'", path, s, CK_RANK_FORMAT);
  if (st == DOPT_OK) st = ck_jint(j, "rank", 0, 99998, path, "rank list", &rank);
  if (st == DOPT_OK) st = ck_jint(j, "nranks", 1, 99999, path, "rank list", &n);
  if (st == DOPT_OK && (rank != r || (*nranks > 0 && n != *nranks)))
    st = dopt__fail(DOPT_ERR_FORMAT, "%s: says rank %lld of %lld, expected rank %d of %d", path, (long long)rank,
                    (long long)n, r, *nranks);
  if (st == DOPT_OK) st = ck_jstr(j, "file", path, "rank list", &s);
  char want[64];
  snprintf(want, sizeof want, "rank-%05d-of-%05lld.safetensors", r, (long long)n);
  if (st == DOPT_OK && strcmp(s, want) != 0) st = dopt__fail(DOPT_ERR_FORMAT, "%s: file '%s', expected '%s'", path, s, want);
  if (st == DOPT_OK) st = ck_jint(j, "file_bytes", 0, CK_MAX_INT, path, "rank list", &fb);
  struct stat sb;
  char fpath[CK_PATH];
  if (st == DOPT_OK) st = dopt__path_join(fpath, tmp_dir, want);
  if (st == DOPT_OK && (stat(fpath, &sb) != 0 || (uint64_t)sb.st_size != (uint64_t)fb))
    st = dopt__fail(DOPT_ERR_IO, "%s: missing or %lld bytes, its rank list says %lld", fpath,
                    stat(fpath, &sb) == 0 ? (long long)sb.st_size : -1LL, (long long)fb);
  int file = 0;
  if (st == DOPT_OK) st = ck_table_add_file(t, want, (uint64_t)fb, &file);
  const cJSON *ps = NULL, *e;
  if (st == DOPT_OK) st = ck_jget(j, "pieces", path, "rank list", &ps);
  if (st == DOPT_OK && !cJSON_IsArray(ps)) st = dopt__fail(DOPT_ERR_FORMAT, "%s: \"pieces\" is not an array", path);
  if (st == DOPT_OK) cJSON_ArrayForEach(e, ps) if ((st = ck_parse_piece(t, e, file, 1, NULL, path)) != DOPT_OK) break;
  cJSON_Delete(j);
  if (st == DOPT_OK) *nranks = (int)n;
  return st;
}
dopt_status dopt_ckpt_commit(const char *ckpt_dir, const char *tmp_dir, const dopt_ckpt_meta *meta) {
  DOPT_CHECK_ARG(ckpt_dir && tmp_dir, "dopt_ckpt_commit: NULL argument");
  DOPT_TRY(ck_check_meta_input(meta, "dopt_ckpt_commit"));
  ck_table t;
  memset(&t, 0, sizeof t);
  int nranks = 0;
  dopt_status s = merge_rank(&t, tmp_dir, 0, &nranks);
  for (int r = 1; s == DOPT_OK && r < nranks; r++) s = merge_rank(&t, tmp_dir, r, &nranks);
  if (s == DOPT_OK) s = ck_table_finish(&t, tmp_dir);
  if (s == DOPT_OK) s = ck_check_param_tensors(&t, meta, tmp_dir);
  char *text = s == DOPT_OK ? ck_index_json(&t, meta) : NULL;
  if (s == DOPT_OK && !text) s = dopt__fail(DOPT_ERR_NO_MEMORY, "%s: index.json", tmp_dir);
  ck_table_free(&t);
  char path[CK_PATH], gen[32], dst[CK_PATH];
  if (s == DOPT_OK) s = dopt__path_join(path, tmp_dir, "index.json");
  if (s == DOPT_OK) s = dopt__write_file(path, DOPT_W_INTERNAL, text, strlen(text));
  free(text);
  if (s == DOPT_OK) s = gen_path(ckpt_dir, meta->global_step, gen, dst);
  int is_dir = 0, is_link = 0;
  if (s == DOPT_OK) s = check_gen_slot(dst, &is_dir, &is_link);
  if (s != DOPT_OK) return s;
  if (is_dir) { /* the same step saved again: swap atomically, then drop the old one */
    if (renameat2(AT_FDCWD, tmp_dir, AT_FDCWD, dst, RENAME_EXCHANGE) != 0)
      return dopt__fail(DOPT_ERR_IO, "%s: cannot replace the existing generation: %s", dst, strerror(errno));
    DOPT_TRY(dopt__sync_dir(ckpt_dir));
    DOPT_TRY(dopt__remove_flat_dir(tmp_dir));
  } else {
    if (is_link && unlink(dst) != 0) /* the link goes, what it points to stays */
      return dopt__fail(DOPT_ERR_IO, "%s: cannot remove the link: %s", dst, strerror(errno));
    if (rename(tmp_dir, dst) != 0)
      return dopt__fail(DOPT_ERR_IO, "%s: cannot rename to %s: %s", tmp_dir, dst, strerror(errno));
  }
  DOPT_TRY(dopt__sync_dir(ckpt_dir));
  char latest[CK_PATH], line[40];
  DOPT_TRY(dopt__path_join(latest, ckpt_dir, "latest"));
  int n = snprintf(line, sizeof line, "%s\n", gen);
  return dopt__write_file(latest, DOPT_W_INTERNAL, line, (size_t)n);
}
