/* Fuzz target: the output/input collision check and the one rule for outputs (core/files.c,
 * docs/files.md). Each input builds a small tree in a fresh sandbox — regular files, folders, symbolic
 * links (relative or absolute, dangling, looping), hard links, FIFOs — and spells an output and an input
 * path through it ("..", ".", "//", links). The property: whenever dopt__check_output and
 * dopt__check_apart accept the pair, writing the output (dopt__write_file, as every command writes) leaves
 * the input byte-identical and changes nothing in the sandbox but the output's final target; when they
 * refuse, the message is one line; and nothing ever blocks (a FIFO is never opened for writing). Then the
 * input path as a second output: when dopt__check_distinct accepts it, writing it leaves the first output's
 * content as written. */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "files.h"
#include "fuzzcommon.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static char box[256];
static const char *const NAMES[] = {"a", "b", "c", "d", "d/e", "d/f", "g", "g/h"};
#define NN ((int)(sizeof NAMES / sizeof NAMES[0]))
static const char *const PARTS[] = {"a", "b", "c", "d", "e", "f", "g", "h", "..", ".", "x", ""};
#define NP ((int)(sizeof PARTS / sizeof PARTS[0]))

static void rm_tree(const char *p) {
  struct stat st;
  if (lstat(p, &st) != 0) return;
  if (S_ISDIR(st.st_mode)) {
    DIR *d = opendir(p);
    for (struct dirent *e; d && (e = readdir(d)) != NULL;) {
      if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
      char q[1024];
      snprintf(q, sizeof q, "%s/%s", p, e->d_name);
      rm_tree(q);
    }
    if (d) closedir(d);
    rmdir(p);
  } else unlink(p);
}

/* A hash of every entry below root (FNV-1a over relative name, kind, content or link target), never
 * following a link, skipping the entry `skip` (an absolute path; NULL: none). */
static void hash_tree(const char *root, const char *rel, const char *skip, uint64_t *h) {
  char dir[1024];
  snprintf(dir, sizeof dir, "%s%s%s", root, *rel ? "/" : "", rel);
  DIR *d = opendir(dir);
  if (!d) return;
  char names[64][256];
  int n = 0;
  for (struct dirent *e; (e = readdir(d)) != NULL && n < 64;)
    if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) snprintf(names[n++], 256, "%s", e->d_name);
  closedir(d);
  qsort(names, (size_t)n, sizeof names[0], (int (*)(const void *, const void *))strcmp);
  for (int i = 0; i < n; i++) {
    char r[600], full[1700];
    snprintf(r, sizeof r, "%s%s%s", rel, *rel ? "/" : "", names[i]);
    snprintf(full, sizeof full, "%s/%s", root, r);
    if (skip && strcmp(full, skip) == 0) continue;
    struct stat st;
    if (lstat(full, &st) != 0) continue;
    unsigned char buf[4096];
    size_t len = 0;
    if (S_ISREG(st.st_mode)) {
      int fd = open(full, O_RDONLY | O_NOFOLLOW);
      ssize_t k = fd >= 0 ? read(fd, buf, sizeof buf) : 0;
      len = k > 0 ? (size_t)k : 0;
      if (fd >= 0) close(fd);
    } else if (S_ISLNK(st.st_mode)) {
      ssize_t k = readlink(full, (char *)buf, sizeof buf);
      len = k > 0 ? (size_t)k : 0;
    }
    const unsigned char *parts[3] = {(const unsigned char *)r, (const unsigned char *)&st.st_mode, buf};
    size_t lens[3] = {strlen(r), sizeof st.st_mode, len};
    for (int p = 0; p < 3; p++)
      for (size_t k = 0; k < lens[p]; k++) *h = (*h ^ parts[p][k]) * 0x100000001b3ull;
    if (S_ISDIR(st.st_mode)) hash_tree(root, r, skip, h);
  }
}

/* A path from the input: `k` parts, absolute (in the box) or relative to it. */
static void spell(const uint8_t **p, const uint8_t *end, char *out, size_t cap) {
  int k = *p < end ? 1 + **p % 4 : 1;
  if (*p < end) (*p)++;
  snprintf(out, cap, "%s", box);
  for (int i = 0; i < k; i++) {
    const char *part = PARTS[*p < end ? **p % NP : 0];
    if (*p < end) (*p)++;
    size_t l = strlen(out);
    snprintf(out + l, cap - l, "/%s", part);
  }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (!box[0]) snprintf(box, sizeof box, "%s/dopt_fuzz_paths_%ld", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp", (long)getpid());
  rm_tree(box);
  if (mkdir(box, 0755) != 0) abort();
  const uint8_t *p = data, *end = data + size;
  /* the tree: each name made as one of seven kinds (or left out) */
  for (int i = 0; i < NN; i++) {
    char path[512], target[512];
    snprintf(path, sizeof path, "%s/%s", box, NAMES[i]);
    int kind = p < end ? *p++ % 8 : 0, t = p < end ? *p++ % NN : 0;
    snprintf(target, sizeof target, "%s%s", kind == 4 ? box : "", kind == 4 ? "/" : "");
    strncat(target, NAMES[t], sizeof target - strlen(target) - 1);
    switch (kind) {
    case 1: { FILE *f = fopen(path, "w"); if (f) { fprintf(f, "%s", NAMES[i]); fclose(f); } break; }
    case 2: mkdir(path, 0755); break;
    case 3: case 4: if (symlink(kind == 3 && strchr(NAMES[i], '/') ? "../a" : target, path)) {} break;
    case 5: mkfifo(path, 0644); break;
    case 6: { char src[512]; snprintf(src, sizeof src, "%s/%s", box, NAMES[t]); if (link(src, path)) {} break; }
    case 7: if (symlink(NAMES[i], path)) {} break; /* a loop */
    default: break;
    }
  }
  char out[600], in[600];
  spell(&p, end, out, sizeof out);
  spell(&p, end, in, sizeof in);
  int dir_out = p < end && (*p++ & 1);
  dopt_status s = dopt__check_output("--out", out, dir_out ? DOPT_OUT_DIR : DOPT_OUT_FILE);
  if (s == DOPT_OK) s = dopt__check_apart("--out", out, "--in", in);
  if (s != DOPT_OK) {
    if (strchr(dopt_last_error(), '\n')) abort();
    return 0;
  }
  if (dir_out) return 0; /* folders are made by the checkpoint code, checked by its own tests */
  /* accepted: write it, and nothing but the output's final target may change */
  char real_out[PATH_MAX + 1] = "";
  {
    char cur[600];
    snprintf(cur, sizeof cur, "%s", out);
    for (int hop = 0; hop < 40; hop++) { /* the final target, as the rule resolves it */
      char l[600];
      ssize_t k = readlink(cur, l, sizeof l - 1);
      if (k < 0) break;
      l[k] = '\0';
      if (l[0] == '/') snprintf(cur, sizeof cur, "%s", l);
      else {
        char *slash = strrchr(cur, '/');
        if (slash) slash[1] = '\0';
        strncat(cur, l, sizeof cur - strlen(cur) - 1);
      }
    }
    char parent[600], *slash;
    snprintf(parent, sizeof parent, "%s", cur);
    slash = strrchr(parent, '/');
    if (slash) *slash = '\0';
    char rp[PATH_MAX];
    if (realpath(parent, rp)) snprintf(real_out, sizeof real_out, "%s/%s", rp, slash ? slash + 1 : cur);
  }
  char rbox0[PATH_MAX];
  if (!realpath(box, rbox0)) abort();
  if (!real_out[0] || strncmp(real_out, rbox0, strlen(rbox0)) != 0 || real_out[strlen(rbox0)] != '/')
    return 0; /* ".." out of the sandbox: not written here */
  struct stat si;
  int in_exists = stat(in, &si) == 0;
  uint64_t before = 0xcbf29ce484222325ull, after = before, in_before = before, in_after = before;
  char rbox[PATH_MAX];
  if (!realpath(box, rbox)) abort();
  hash_tree(rbox, "", real_out, &before);
  char rin[PATH_MAX] = "";
  if (in_exists && realpath(in, rin) && S_ISDIR(si.st_mode)) hash_tree(rin, "", NULL, &in_before);
  else if (in_exists && rin[0]) { int fd = open(rin, O_RDONLY | O_NONBLOCK); unsigned char b[256]; ssize_t k = fd >= 0 ? read(fd, b, sizeof b) : 0; for (ssize_t i = 0; i < k; i++) in_before = (in_before ^ b[i]) * 0x100000001b3ull; if (fd >= 0) close(fd); }
  if (dopt__write_file(out, DOPT_W_OUTPUT, "written", 7) != DOPT_OK) {
    if (strchr(dopt_last_error(), '\n')) abort();
  }
  hash_tree(rbox, "", real_out, &after);
  if (before != after) abort(); /* something beside the output changed */
  if (in_exists && rin[0] && S_ISDIR(si.st_mode)) {
    hash_tree(rin, "", NULL, &in_after);
    if (in_after != in_before) abort();
  } else if (in_exists && rin[0]) {
    int fd = open(rin, O_RDONLY | O_NONBLOCK);
    unsigned char b[256];
    ssize_t k = fd >= 0 ? read(fd, b, sizeof b) : 0;
    for (ssize_t i = 0; i < k; i++) in_after = (in_after ^ b[i]) * 0x100000001b3ull;
    if (fd >= 0) close(fd);
    if (in_after != in_before) abort(); /* the input was written */
  }
  /* the second path as a second output of the same command: when dopt__check_distinct accepts the pair,
   * writing it never replaces what the first output holds (the sandbox has no character device) */
  char got[16] = "";
  int fd = open(out, O_RDONLY | O_NONBLOCK);
  ssize_t k = fd >= 0 ? read(fd, got, sizeof got - 1) : -1;
  if (fd >= 0) close(fd);
  if (k != 7 || memcmp(got, "written", 7) != 0) return 0; /* the first write did not land: nothing to keep */
  if (dopt__check_output("--plot", in, DOPT_OUT_FILE) != DOPT_OK || dopt__check_distinct("--out", out, "--plot", in) != DOPT_OK) {
    if (strchr(dopt_last_error(), '\n')) abort();
    return 0;
  }
  if (dopt__write_file(in, DOPT_W_OUTPUT, "second", 6) != DOPT_OK) return 0;
  memset(got, 0, sizeof got);
  fd = open(out, O_RDONLY | O_NONBLOCK);
  k = fd >= 0 ? read(fd, got, sizeof got - 1) : -1;
  if (fd >= 0) close(fd);
  if (k != 7 || memcmp(got, "written", 7) != 0) abort(); /* the second output replaced the first */
  return 0;
}
