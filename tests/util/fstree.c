/* tests/util/fstree.h */
#define _GNU_SOURCE /* fstatat's AT_SYMLINK_NOFOLLOW */
#include "fstree.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "distopt/digest.h"

typedef struct entry {
  char path[512];          /* relative to the root */
  unsigned mode;           /* st_mode: kind and permissions */
  char what[DOPT_DIGEST_HEX + 600]; /* a file's SHA-256, a link's target, a device's number */
} entry;

struct dt_tree {
  entry *e;
  int n, cap;
};

static void add(dt_tree *t, const entry *x) {
  if (t->n == t->cap) {
    t->cap = t->cap ? 2 * t->cap : 64;
    t->e = realloc(t->e, (size_t)t->cap * sizeof *t->e);
    if (!t->e) abort();
  }
  t->e[t->n++] = *x;
}

static void file_digest(const char *path, char *hex) {
  snprintf(hex, DOPT_DIGEST_HEX, "unreadable");
  int fd = open(path, O_RDONLY | O_NONBLOCK | O_NOFOLLOW);
  if (fd < 0) return;
  dopt_digest *d = NULL;
  if (dopt_digest_create(&d) != DOPT_OK) abort();
  unsigned char buf[65536];
  for (ssize_t k; (k = read(fd, buf, sizeof buf)) > 0;) dopt_digest_bytes(d, buf, (size_t)k);
  close(fd);
  dopt_digest_final(d, NULL, hex);
  dopt_digest_destroy(d);
}

static void walk(dt_tree *t, const char *root, const char *rel) {
  char dir[1024];
  snprintf(dir, sizeof dir, "%s%s%s", root, *rel ? "/" : "", rel);
  DIR *d = opendir(dir);
  if (!d) return;
  for (struct dirent *de; (de = readdir(d)) != NULL;) {
    if (strcmp(de->d_name, ".") == 0 || strcmp(de->d_name, "..") == 0) continue;
    entry x;
    memset(&x, 0, sizeof x);
    snprintf(x.path, sizeof x.path, "%s%s%s", rel, *rel ? "/" : "", de->d_name);
    char full[1200];
    snprintf(full, sizeof full, "%s/%s", root, x.path);
    struct stat st;
    if (lstat(full, &st) != 0) continue;
    x.mode = (unsigned)st.st_mode;
    if (S_ISREG(st.st_mode)) file_digest(full, x.what);
    else if (S_ISLNK(st.st_mode)) {
      ssize_t k = readlink(full, x.what, sizeof x.what - 1);
      x.what[k > 0 ? k : 0] = '\0';
    } else if (S_ISCHR(st.st_mode) || S_ISBLK(st.st_mode))
      snprintf(x.what, sizeof x.what, "dev %llu", (unsigned long long)st.st_rdev);
    add(t, &x);
    if (S_ISDIR(st.st_mode)) walk(t, root, x.path);
  }
  closedir(d);
}

static int by_path(const void *a, const void *b) { return strcmp(((const entry *)a)->path, ((const entry *)b)->path); }

dt_tree *dt_tree_snap(const char *root) {
  dt_tree *t = calloc(1, sizeof *t);
  if (!t) abort();
  walk(t, root, "");
  if (t->n > 1) qsort(t->e, (size_t)t->n, sizeof *t->e, by_path); /* (an empty tree has no array) */
  return t;
}

void dt_tree_free(dt_tree *t) {
  if (!t) return;
  free(t->e);
  free(t);
}

static int skipped(const char *path, const char *const *skip) {
  for (; skip && *skip; skip++) {
    size_t n = strlen(*skip);
    if (strncmp(path, *skip, n) == 0 && (path[n] == '\0' || path[n] == '/')) return 1;
  }
  return 0;
}

int dt_tree_diff(const dt_tree *a, const dt_tree *b, const char *const *skip, char *msg, size_t cap) {
  int i = 0, j = 0;
  while (i < a->n || j < b->n) {
    const entry *x = i < a->n ? &a->e[i] : NULL, *y = j < b->n ? &b->e[j] : NULL;
    int c = !x ? 1 : !y ? -1 : strcmp(x->path, y->path);
    const entry *e = c <= 0 ? x : y;
    if (skipped(e->path, skip)) {
      i += c <= 0;
      j += c >= 0;
      continue;
    }
    if (c < 0) return snprintf(msg, cap, "%s: removed", x->path), 1;
    if (c > 0) return snprintf(msg, cap, "%s: created", y->path), 1;
    if ((x->mode & S_IFMT) != (y->mode & S_IFMT)) return snprintf(msg, cap, "%s: kind changed", x->path), 1;
    if (x->mode != y->mode) return snprintf(msg, cap, "%s: mode %o -> %o", x->path, x->mode, y->mode), 1;
    if (strcmp(x->what, y->what) != 0) return snprintf(msg, cap, "%s: content changed", x->path), 1;
    i++, j++;
  }
  return 0;
}
