/* File operations (core/files.h, docs/files.md): one place for the rule that
 * every output follows, the atomic write, reads that never block on a FIFO,
 * the output/input collision check and folders removed without following a
 * link. */
#define _GNU_SOURCE /* O_NOFOLLOW, O_DIRECTORY, O_CLOEXEC, fdopendir, realpath */
#include "files.h"

#include "distopt/files.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#define MAX_LINKS 40 /* as the kernel's own limit of links followed in one path */

/* ---- paths ---------------------------------------------------------------------------- */

dopt_status dopt__path_join(char *out, const char *a, const char *b) {
  int n = snprintf(out, DOPT_PATH_MAX, "%s/%s", a, b);
  if (n < 0 || n >= DOPT_PATH_MAX)
    return dopt__fail(DOPT_ERR_INVALID_ARG, "path '%.64s.../%.64s' is longer than %d bytes", a, b, DOPT_PATH_MAX - 1);
  return DOPT_OK;
}

void dopt__path_parent(const char *path, char *out) {
  snprintf(out, DOPT_PATH_MAX, "%s", path);
  size_t n = strlen(out);
  while (n > 1 && out[n - 1] == '/') out[--n] = '\0'; /* "a/b/" is "a/b" */
  char *s = strrchr(out, '/');
  if (!s) snprintf(out, DOPT_PATH_MAX, ".");
  else if (s == out) out[1] = '\0';
  else *s = '\0';
}

const char *dopt__file_kind(unsigned mode) {
  switch (mode & S_IFMT) {
  case S_IFREG: return "a regular file";
  case S_IFDIR: return "a folder";
  case S_IFIFO: return "a FIFO (named pipe)";
  case S_IFSOCK: return "a socket";
  case S_IFCHR: return "a character device";
  case S_IFBLK: return "a block device";
  case S_IFLNK: return "a symbolic link";
  default: return "not a regular file";
  }
}

/* "opt 'path'" or "path", for the messages. */
static void named(char *buf, size_t cap, const char *opt, const char *path) {
  if (opt) snprintf(buf, cap, "%s '%s'", opt, path);
  else snprintf(buf, cap, "%s", path);
}

/* The final target of path: its last component's symbolic links followed
 * (the kernel follows the folders'); a dangling link names the file to be
 * made. *st: lstat of the result; *exists: whether it exists. */
static dopt_status resolve_links(const char *path, char *out, struct stat *st, int *exists) {
  char cur[DOPT_PATH_MAX], link[DOPT_PATH_MAX], dir[DOPT_PATH_MAX];
  if (snprintf(cur, sizeof cur, "%s", path) >= (int)sizeof cur)
    return dopt__fail(DOPT_ERR_INVALID_ARG, "'%.64s...': path longer than %d bytes", path, DOPT_PATH_MAX - 1);
  for (int hop = 0; hop <= MAX_LINKS; hop++) {
    if (lstat(cur, st) != 0) {
      if (errno != ENOENT && errno != ENOTDIR) return dopt__fail(DOPT_ERR_IO, "%s: %s", cur, strerror(errno));
      *exists = 0;
      memcpy(out, cur, strlen(cur) + 1);
      return DOPT_OK;
    }
    if (!S_ISLNK(st->st_mode)) {
      *exists = 1;
      memcpy(out, cur, strlen(cur) + 1);
      return DOPT_OK;
    }
    ssize_t n = readlink(cur, link, sizeof link - 1);
    if (n < 0) return dopt__fail(DOPT_ERR_IO, "%s: cannot read the link: %s", cur, strerror(errno));
    link[n] = '\0';
    if (link[0] == '/') {
      memcpy(cur, link, (size_t)n + 1);
    } else {
      dopt__path_parent(cur, dir);
      DOPT_TRY(dopt__path_join(cur, dir, link));
    }
  }
  return dopt__fail(DOPT_ERR_IO, "%s: more than %d symbolic links", path, MAX_LINKS);
}

/* ---- reading -------------------------------------------------------------------------- */

dopt_status dopt__open_read(const char *path, int *fd, uint64_t *size) {
  *fd = -1;
  /* non-blocking: opening a FIFO for reading would wait for a writer */
  int f = open(path, O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
  struct stat st;
  if (f < 0) {
    int e = errno;
    if (stat(path, &st) == 0 && !S_ISREG(st.st_mode)) /* a socket cannot be opened at all (ENXIO): say what it is */
      return dopt__fail(DOPT_ERR_IO, "%s: %s, not a regular file", path, dopt__file_kind((unsigned)st.st_mode));
    return dopt__fail(e == ENOENT ? DOPT_ERR_NOT_FOUND : DOPT_ERR_IO, "%s: cannot open: %s", path, strerror(e));
  }
  if (fstat(f, &st) != 0) {
    int e = errno;
    close(f);
    return dopt__fail(DOPT_ERR_IO, "%s: cannot stat: %s", path, strerror(e));
  }
  if (!S_ISREG(st.st_mode)) {
    close(f);
    return dopt__fail(DOPT_ERR_IO, "%s: %s, not a regular file", path, dopt__file_kind((unsigned)st.st_mode));
  }
  int fl = fcntl(f, F_GETFL);
  if (fl >= 0) fcntl(f, F_SETFL, fl & ~O_NONBLOCK);
  *fd = f;
  if (size) *size = (uint64_t)st.st_size;
  return DOPT_OK;
}

dopt_status dopt__fopen_read(const char *path, FILE **out, uint64_t *size) {
  int fd;
  *out = NULL;
  DOPT_TRY(dopt__open_read(path, &fd, size));
  FILE *f = fdopen(fd, "rb");
  if (!f) {
    close(fd);
    return dopt__fail(DOPT_ERR_NO_MEMORY, "%s: a stream", path);
  }
  *out = f;
  return DOPT_OK;
}

long dopt__json_nul(const char *text, size_t n) {
  int in = 0; /* inside a string */
  for (size_t i = 0; i < n; i++) {
    const char ch = text[i];
    if (ch == '\0') return (long)i;
    if (!in) {
      in = ch == '"';
      continue;
    }
    if (ch == '"') {
      in = 0;
    } else if (ch == '\\' && i + 1 < n) {
      if (text[i + 1] == 'u' && i + 5 < n && memcmp(text + i + 2, "0000", 4) == 0) return (long)i;
      i++; /* the escaped character */
    }
  }
  return -1;
}

dopt_status dopt__json_no_nul(const char *text, size_t n, const char *where, long base) {
  const long at = dopt__json_nul(text, n);
  return at < 0 ? DOPT_OK
                : dopt__fail(DOPT_ERR_FORMAT, "%s: a NUL character at byte %ld (a string would be cut short there)",
                             where, base + at);
}

dopt_status dopt__pread_all(int fd, void *buf, size_t n, uint64_t off, const char *path) {
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

dopt_status dopt__pwrite_all(int fd, const void *buf, size_t n, uint64_t off, const char *path) {
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

dopt_status dopt__read_all(const char *path, size_t max, char **out, size_t *len) {
  *out = NULL;
  int fd;
  uint64_t size;
  DOPT_TRY(dopt__open_read(path, &fd, &size));
  if (size > max) {
    close(fd);
    return dopt__fail(DOPT_ERR_FORMAT, "%s: %llu bytes exceed the limit of %zu", path, (unsigned long long)size, max);
  }
  size_t n = (size_t)size;
  char *buf = malloc(n + 1);
  if (!buf) {
    close(fd);
    return dopt__fail(DOPT_ERR_NO_MEMORY, "%s: %zu bytes", path, n);
  }
  dopt_status s = dopt__pread_all(fd, buf, n, 0, path);
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

/* ---- outputs ---------------------------------------------------------------------------- */

/* The folder that would hold a new entry at path: exists, is a folder, writable. */
static dopt_status check_folder(const char *what, const char *path) {
  char dir[DOPT_PATH_MAX];
  dopt__path_parent(path, dir);
  struct stat st;
  if (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode) || access(dir, W_OK) != 0)
    return dopt__fail(DOPT_ERR_INVALID_ARG, "%s: the folder '%s' does not exist or is not writable", what, dir);
  return DOPT_OK;
}

dopt_status dopt__check_output(const char *opt, const char *path, int kind) {
  char what[DOPT_PATH_MAX + 64], target[DOPT_PATH_MAX];
  named(what, sizeof what, opt, path ? path : "");
  if (!path || !*path) return dopt__fail(DOPT_ERR_INVALID_ARG, "%s: empty path", what);
  struct stat st;
  int exists;
  if (resolve_links(path, target, &st, &exists) != DOPT_OK) { /* its message, past "DOPT_ERR_IO: " */
    char why[512];
    const char *m = dopt_last_error(), *c = strstr(m, ": ");
    snprintf(why, sizeof why, "%s", c ? c + 2 : m);
    return dopt__fail(DOPT_ERR_INVALID_ARG, "%s: %s", what, why);
  }
  if (kind == DOPT_OUT_DIR) {
    if (!exists) { /* made when written: its nearest existing ancestor must take it */
      char up[DOPT_PATH_MAX], next[DOPT_PATH_MAX];
      snprintf(up, sizeof up, "%s", target);
      for (;;) {
        dopt__path_parent(up, next);
        struct stat ps;
        if (stat(next, &ps) == 0) {
          if (!S_ISDIR(ps.st_mode) || access(next, W_OK) != 0)
            return dopt__fail(DOPT_ERR_INVALID_ARG, "%s: cannot be created: '%s' is %s%s", what, next,
                              dopt__file_kind((unsigned)ps.st_mode), S_ISDIR(ps.st_mode) ? " that is not writable" : "");
          return DOPT_OK;
        }
        if (strcmp(next, up) == 0) break;
        snprintf(up, sizeof up, "%s", next);
      }
      return dopt__fail(DOPT_ERR_INVALID_ARG, "%s: no existing folder above it", what);
    }
    if (!S_ISDIR(st.st_mode))
      return dopt__fail(DOPT_ERR_INVALID_ARG, "%s is %s; a folder is needed here", what,
                        dopt__file_kind((unsigned)st.st_mode));
    if (access(target, W_OK) != 0) return dopt__fail(DOPT_ERR_INVALID_ARG, "%s: the folder is not writable", what);
    return DOPT_OK;
  }
  if (exists && S_ISCHR(st.st_mode)) return DOPT_OK; /* written through */
  if (exists && !S_ISREG(st.st_mode))
    return dopt__fail(DOPT_ERR_INVALID_ARG, "%s is %s; an output must be a regular file or a character device", what,
                      dopt__file_kind((unsigned)st.st_mode));
  return check_folder(what, target);
}

static int same_node(const struct stat *a, const struct stat *b) { return a->st_dev == b->st_dev && a->st_ino == b->st_ino; }

/* 1 when a proper ancestor folder of the existing path p (resolved) is the node `of`. */
static int has_ancestor(const char *p, const struct stat *of) {
  char real[PATH_MAX], up[DOPT_PATH_MAX];
  if (!realpath(p, real)) return 0;
  for (;;) {
    dopt__path_parent(real, up);
    if (strcmp(up, real) == 0) return 0; /* "/" */
    struct stat st;
    if (stat(up, &st) == 0 && same_node(&st, of)) return 1;
    snprintf(real, sizeof real, "%s", up);
  }
}

dopt_status dopt__check_apart(const char *out_opt, const char *out, const char *in_opt, const char *in) {
  struct stat si, sp, lst;
  if (!out || !in || !*out || !*in || stat(in, &si) != 0) return DOPT_OK;
  char target[DOPT_PATH_MAX], p[DOPT_PATH_MAX], up[DOPT_PATH_MAX];
  int exists;
  if (resolve_links(out, target, &lst, &exists) != DOPT_OK) {
    dopt_clear_error();
    return DOPT_OK; /* dopt__check_output reports it */
  }
  /* p: the output if it exists, else its nearest existing folder */
  snprintf(p, sizeof p, "%s", target);
  int is_out = 1;
  while (stat(p, &sp) != 0) {
    dopt__path_parent(p, up);
    if (strcmp(up, p) == 0) return DOPT_OK;
    snprintf(p, sizeof p, "%s", up);
    is_out = 0;
  }
  char o[DOPT_PATH_MAX + 64], i[DOPT_PATH_MAX + 64];
  named(o, sizeof o, out_opt, out);
  named(i, sizeof i, in_opt, in);
  if (is_out && same_node(&sp, &si))
    return dopt__fail(DOPT_ERR_INVALID_ARG, "%s is the input %s: it would be replaced (choose another path)", o, i);
  if (S_ISDIR(si.st_mode) && ((!is_out && same_node(&sp, &si)) || has_ancestor(p, &si)))
    return dopt__fail(DOPT_ERR_INVALID_ARG, "%s is inside the input %s: writing it would change an input (choose a "
                      "path outside it)", o, i);
  if (is_out && S_ISDIR(sp.st_mode) && has_ancestor(in, &sp))
    return dopt__fail(DOPT_ERR_INVALID_ARG, "%s holds the input %s: writing there could change an input (choose a "
                      "folder that does not hold it)", o, i);
  return DOPT_OK;
}

/* path's final target (resolve_links) split into its folder and its last name (trailing
 * slashes dropped); *st, *exists: resolve_links'. 0: cannot tell (dopt__check_output reports it). */
static int target_parts(const char *path, char *dir, char *name, struct stat *st, int *exists) {
  char target[DOPT_PATH_MAX];
  if (resolve_links(path, target, st, exists) != DOPT_OK) {
    dopt_clear_error();
    return 0;
  }
  size_t n = strlen(target);
  while (n > 1 && target[n - 1] == '/') target[--n] = '\0';
  const char *slash = strrchr(target, '/');
  snprintf(name, DOPT_PATH_MAX, "%s", slash ? slash + 1 : target);
  dopt__path_parent(target, dir);
  return 1;
}

/* Where an output lands: its node when it exists, else its folder's node and its name
 * (links resolved as the write resolves them). 0: cannot tell (a folder not made yet). */
typedef struct landing {
  dev_t dev;
  ino_t ino;
  int exists, chr;
  char name[DOPT_PATH_MAX];
} landing;

static int land(const char *path, landing *l) {
  char dir[DOPT_PATH_MAX];
  struct stat st;
  memset(l, 0, sizeof *l);
  if (!target_parts(path, dir, l->name, &st, &l->exists)) return 0;
  if (l->exists) {
    if (stat(path, &st) != 0) return 0; /* through the links: the node written */
    l->chr = S_ISCHR(st.st_mode);
    l->name[0] = '\0';                  /* the node alone names it */
  } else if (stat(dir, &st) != 0) {
    return 0;
  }
  l->dev = st.st_dev;
  l->ino = st.st_ino;
  return 1;
}

dopt_status dopt__check_distinct(const char *opt_a, const char *a, const char *opt_b, const char *b) {
  landing la, lb;
  if (!a || !b || !*a || !*b || !land(a, &la) || !land(b, &lb)) return DOPT_OK;
  if (la.exists != lb.exists || la.dev != lb.dev || la.ino != lb.ino || strcmp(la.name, lb.name) != 0) return DOPT_OK;
  if (la.chr) return DOPT_OK; /* a character device (/dev/null) takes every output */
  char na[DOPT_PATH_MAX + 64], nb[DOPT_PATH_MAX + 64];
  named(na, sizeof na, opt_a, a);
  named(nb, sizeof nb, opt_b, b);
  return dopt__fail(DOPT_ERR_INVALID_ARG, "%s and %s are the same file: one output would replace the other (choose "
                    "two paths)", na, nb);
}

dopt_status dopt__check_ckpt_names(const char *out_opt, const char *out, const char *dir_opt, const char *dir) {
  char parent[DOPT_PATH_MAX], name[DOPT_PATH_MAX];
  struct stat st, sd;
  int exists = 0;
  if (!out || !dir || !*out || !*dir || stat(dir, &sd) != 0) return DOPT_OK;
  if (!target_parts(out, parent, name, &st, &exists)) return DOPT_OK;
  if (strcmp(name, "latest") != 0 && strncmp(name, "step-", 5) != 0 && strncmp(name, ".tmp-step-", 10) != 0)
    return DOPT_OK;
  if (stat(parent, &st) != 0 || !same_node(&st, &sd)) return DOPT_OK;
  char no[DOPT_PATH_MAX + 64], nd[DOPT_PATH_MAX + 64];
  named(no, sizeof no, out_opt, out);
  named(nd, sizeof nd, dir_opt, dir);
  return dopt__fail(DOPT_ERR_INVALID_ARG, "%s is a name the checkpoint folder %s uses (latest, step-<N>, "
                    ".tmp-step-<N>): one output would replace the other (choose another name)", no, nd);
}

struct dopt_wfile {
  char target[DOPT_PATH_MAX]; /* what the commit replaces (links resolved for an output) */
  char tmp[DOPT_PATH_MAX];    /* "" when written through (a character device) */
  int fd;
  FILE *fp;
};

static atomic_uint tmp_serial; /* distinct temporary names for threads of one process */

dopt_status dopt__wfile_open(const char *path, int mode, dopt_wfile **out) {
  *out = NULL;
  DOPT_CHECK_ARG(path && *path, "write: empty path");
  dopt_wfile *w = calloc(1, sizeof *w);
  if (!w) return dopt__fail(DOPT_ERR_NO_MEMORY, "%s: %zu bytes", path, sizeof *w);
  w->fd = -1;
  struct stat st;
  int exists = 0;
  dopt_status s = DOPT_OK;
  if (mode == DOPT_W_INTERNAL) {
    if (snprintf(w->target, sizeof w->target, "%s", path) >= (int)sizeof w->target)
      s = dopt__fail(DOPT_ERR_INVALID_ARG, "'%.64s...': path longer than %d bytes", path, DOPT_PATH_MAX - 1);
    exists = s == DOPT_OK && lstat(path, &st) == 0;
    if (exists && S_ISDIR(st.st_mode))
      s = dopt__fail(DOPT_ERR_IO, "%s is a folder; distopt writes a file there", path);
  } else {
    s = resolve_links(path, w->target, &st, &exists);
    if (s == DOPT_OK && exists && S_ISCHR(st.st_mode)) { /* written through: no temporary, no rename */
      if ((w->fd = open(w->target, O_WRONLY | O_NOCTTY | O_CLOEXEC)) < 0)
        s = dopt__fail(DOPT_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
      if (s == DOPT_OK) {
        *out = w;
        return DOPT_OK;
      }
    } else if (s == DOPT_OK && exists && !S_ISREG(st.st_mode)) {
      s = dopt__fail(DOPT_ERR_IO, "%s is %s; an output must be a regular file or a character device", path,
                     dopt__file_kind((unsigned)st.st_mode));
    }
  }
  /* the temporary: next to the target, made exclusively (never through a link someone placed there) */
  for (int attempt = 0; s == DOPT_OK && w->fd < 0; attempt++) {
    unsigned k = atomic_fetch_add(&tmp_serial, 1u);
    int n = snprintf(w->tmp, sizeof w->tmp, "%s.tmp-%ld-%u", w->target, (long)getpid(), k);
    if (n < 0 || n >= (int)sizeof w->tmp) {
      s = dopt__fail(DOPT_ERR_INVALID_ARG, "%s: path too long for its temporary file", path);
      break;
    }
    w->fd = open(w->tmp, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644); /* RDWR: a writer may read back */
    if (w->fd < 0 && (errno != EEXIST || attempt >= 100))
      s = dopt__fail(DOPT_ERR_IO, "%s: cannot create its temporary file %s: %s", path, w->tmp, strerror(errno));
  }
  if (s == DOPT_OK && exists && S_ISREG(st.st_mode)) (void)fchmod(w->fd, st.st_mode & 07777); /* keep its permissions */
  if (s != DOPT_OK) {
    w->tmp[0] = '\0';
    dopt__wfile_abort(w);
    return s;
  }
  *out = w;
  return DOPT_OK;
}

int dopt__wfile_fd(const dopt_wfile *w) { return w ? w->fd : -1; }

FILE *dopt__wfile_stream(dopt_wfile *w) {
  if (w && !w->fp && w->fd >= 0) w->fp = fdopen(w->fd, "wb");
  return w ? w->fp : NULL;
}

void dopt__wfile_abort(dopt_wfile *w) {
  if (!w) return;
  if (w->fp) fclose(w->fp);
  else if (w->fd >= 0) close(w->fd);
  if (w->tmp[0]) unlink(w->tmp);
  free(w);
}

dopt_status dopt__wfile_commit(dopt_wfile *w) {
  DOPT_CHECK_ARG(w != NULL, "write: no file");
  dopt_status s = DOPT_OK;
  const char *name = w->target;
  if (w->fp && (fflush(w->fp) != 0 || ferror(w->fp)))
    s = dopt__fail(DOPT_ERR_IO, "%s: write failed: %s", name, strerror(errno));
  if (s == DOPT_OK && w->tmp[0] && fsync(w->fd) != 0)
    s = dopt__fail(DOPT_ERR_IO, "%s: fsync failed: %s", name, strerror(errno));
  int rc = w->fp ? fclose(w->fp) : close(w->fd);
  w->fp = NULL;
  w->fd = -1;
  if (rc != 0 && s == DOPT_OK) s = dopt__fail(DOPT_ERR_IO, "%s: close failed: %s", name, strerror(errno));
  if (s == DOPT_OK && w->tmp[0] && rename(w->tmp, w->target) != 0)
    s = dopt__fail(DOPT_ERR_IO, "%s: cannot rename into place: %s", name, strerror(errno));
  if (s == DOPT_OK && w->tmp[0]) {
    w->tmp[0] = '\0'; /* renamed: nothing to remove */
    char dir[DOPT_PATH_MAX];
    dopt__path_parent(w->target, dir);
    s = dopt__sync_dir(dir);
  }
  dopt__wfile_abort(w);
  return s;
}

dopt_status dopt__write_file(const char *path, int mode, const void *data, size_t n) {
  dopt_wfile *w;
  DOPT_TRY(dopt__wfile_open(path, mode, &w));
  const unsigned char *p = data;
  while (n > 0) { /* write(2), not pwrite: a character device (a terminal) cannot seek */
    ssize_t k = write(w->fd, p, n > ((size_t)1 << 30) ? (size_t)1 << 30 : n);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) {
      dopt_status s = dopt__fail(DOPT_ERR_IO, "%s: write failed: %s", path, k < 0 ? strerror(errno) : "no progress");
      dopt__wfile_abort(w);
      return s;
    }
    p += k;
    n -= (size_t)k;
  }
  return dopt__wfile_commit(w);
}

dopt_status dopt_write_file(const char *path, const void *data, size_t n) {
  DOPT_CHECK_ARG(path && (data || n == 0), "dopt_write_file: NULL argument");
  return dopt__write_file(path, DOPT_W_OUTPUT, data, n);
}

dopt_status dopt__write_stream(const char *path, int mode, int (*body)(FILE *f, const void *ctx), const void *ctx) {
  dopt_wfile *w;
  DOPT_TRY(dopt__wfile_open(path, mode, &w));
  FILE *fp = dopt__wfile_stream(w);
  if (!fp || !body(fp, ctx) || ferror(fp)) {
    dopt_status s = fp ? dopt__fail(DOPT_ERR_IO, "%s: write failed: %s", path, strerror(errno))
                       : dopt__fail(DOPT_ERR_NO_MEMORY, "%s: a stream", path);
    dopt__wfile_abort(w);
    return s;
  }
  return dopt__wfile_commit(w);
}

/* ---- folders ---------------------------------------------------------------------------- */

dopt_status dopt__sync_dir(const char *dir) {
  int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return dopt__fail(DOPT_ERR_IO, "%s: cannot open to sync: %s", dir, strerror(errno));
  int rc = fsync(fd), err = errno;
  close(fd);
  if (rc != 0 && err != EINVAL) return dopt__fail(DOPT_ERR_IO, "%s: fsync failed: %s", dir, strerror(err));
  return DOPT_OK;
}

dopt_status dopt__mkdir_p(const char *dir) {
  char buf[DOPT_PATH_MAX];
  int n = snprintf(buf, sizeof buf, "%s", dir);
  if (n <= 0 || n >= (int)sizeof buf) return dopt__fail(DOPT_ERR_INVALID_ARG, "folder '%.64s': empty or too long", dir);
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
  if (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode)) return dopt__fail(DOPT_ERR_IO, "%s: not a folder", dir);
  return DOPT_OK;
}

dopt_status dopt__remove_flat_dir(const char *dir) {
  struct stat st;
  if (lstat(dir, &st) != 0) {
    if (errno == ENOENT) return DOPT_OK;
    return dopt__fail(DOPT_ERR_IO, "%s: %s", dir, strerror(errno));
  }
  if (S_ISLNK(st.st_mode)) { /* the link goes, what it points to stays */
    if (unlink(dir) != 0) return dopt__fail(DOPT_ERR_IO, "%s: cannot remove the link: %s", dir, strerror(errno));
    return DOPT_OK;
  }
  if (!S_ISDIR(st.st_mode))
    return dopt__fail(DOPT_ERR_IO, "%s is %s where distopt's own folder should be (remove it or choose another folder)",
                      dir, dopt__file_kind((unsigned)st.st_mode));
  int fd = open(dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC); /* replaced by a link meanwhile: ELOOP */
  if (fd < 0) return dopt__fail(DOPT_ERR_IO, "%s: cannot open: %s", dir, strerror(errno));
  DIR *d = fdopendir(fd);
  if (!d) {
    close(fd);
    return dopt__fail(DOPT_ERR_IO, "%s: cannot list: %s", dir, strerror(errno));
  }
  dopt_status s = DOPT_OK;
  /* two passes: a folder inside means it is not ours; then nothing is removed */
  for (int pass = 0; pass < 2 && s == DOPT_OK; pass++) {
    rewinddir(d);
    for (struct dirent *e; s == DOPT_OK && (e = readdir(d)) != NULL;) {
      if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
      struct stat es;
      if (pass == 0 && fstatat(fd, e->d_name, &es, AT_SYMLINK_NOFOLLOW) == 0 && S_ISDIR(es.st_mode))
        s = dopt__fail(DOPT_ERR_IO, "%s holds a folder '%s': not distopt's own, nothing removed", dir, e->d_name);
      if (pass == 1 && unlinkat(fd, e->d_name, 0) != 0 && errno != ENOENT)
        s = dopt__fail(DOPT_ERR_IO, "%s/%s: cannot remove: %s", dir, e->d_name, strerror(errno));
    }
  }
  closedir(d);
  if (s == DOPT_OK && rmdir(dir) != 0) s = dopt__fail(DOPT_ERR_IO, "%s: cannot remove: %s", dir, strerror(errno));
  return s;
}
