/* The file operations of the checkpoints: whole reads and writes at an
 * offset, durable writes (a temporary file renamed into place), folders
 * created and removed. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include "ckpt_internal.h"

dopt_status ck_join(char *out, const char *a, const char *b) {
  int n = snprintf(out, CK_PATH, "%s/%s", a, b);
  if (n < 0 || n >= CK_PATH) return dopt__fail(DOPT_ERR_INVALID_ARG, "checkpoint: path '%s/%s' too long", a, b);
  return DOPT_OK;
}

dopt_status ck_pwrite_all(int fd, const void *buf, size_t n, uint64_t off, const char *path) {
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

dopt_status ck_pread_all(int fd, void *buf, size_t n, uint64_t off, const char *path) {
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
dopt_status ck_fsync_path(const char *path, int is_dir) {
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
dopt_status ck_write_durable(const char *path, const void *data, size_t n) {
  char tmp[CK_PATH], dir[CK_PATH];
  int k = snprintf(tmp, sizeof tmp, "%s.tmp-%ld", path, (long)getpid());
  if (k < 0 || k >= (int)sizeof tmp) return dopt__fail(DOPT_ERR_INVALID_ARG, "%s: path too long", path);
  int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) return dopt__fail(DOPT_ERR_IO, "%s: cannot create: %s", tmp, strerror(errno));
  dopt_status s = ck_pwrite_all(fd, data, n, 0, tmp);
  if (s == DOPT_OK && fsync(fd) != 0) s = dopt__fail(DOPT_ERR_IO, "%s: fsync failed: %s", tmp, strerror(errno));
  if (close(fd) != 0 && s == DOPT_OK) s = dopt__fail(DOPT_ERR_IO, "%s: close failed: %s", tmp, strerror(errno));
  if (s == DOPT_OK && rename(tmp, path) != 0)
    s = dopt__fail(DOPT_ERR_IO, "%s: cannot rename into place: %s", path, strerror(errno));
  if (s != DOPT_OK) {
    unlink(tmp);
    return s;
  }
  parent_of(path, dir);
  return ck_fsync_path(dir, 1);
}

/* The whole file as a NUL-terminated string (at most max bytes). */
dopt_status ck_read_text(const char *path, size_t max, char **out, size_t *len) {
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
  dopt_status s = ck_pread_all(fd, buf, n, 0, path);
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

dopt_status ck_mkdir_p(const char *dir) {
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
dopt_status ck_remove_flat_dir(const char *dir) {
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
    if ((s = ck_join(p, dir, e->d_name)) != DOPT_OK) break;
    if (unlink(p) != 0) s = dopt__fail(DOPT_ERR_IO, "%s: cannot remove: %s", p, strerror(errno));
  }
  closedir(d);
  if (s == DOPT_OK && rmdir(dir) != 0) s = dopt__fail(DOPT_ERR_IO, "%s: cannot remove: %s", dir, strerror(errno));
  return s;
}
