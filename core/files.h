/* Every file distopt reads or writes goes through here (docs/files.md): the
 * one rule for outputs, the atomic write, inputs opened without blocking, the
 * output/input collision check and folders removed without following links.
 * Used by the safetensors writer and reader, the checkpoints, and every
 * command-line output (compare/). */
#ifndef DISTOPT_FILES_H
#define DISTOPT_FILES_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "internal.h"

#define DOPT_PATH_MAX 4096

/* ---- paths ---------------------------------------------------------------------------- */

/* out[DOPT_PATH_MAX] = "a/b" (DOPT_ERR_INVALID_ARG when it does not fit). */
dopt_status dopt__path_join(char *out, const char *a, const char *b);
/* out[DOPT_PATH_MAX] = the folder of path: "." for "x", "/" for "/x". */
void dopt__path_parent(const char *path, char *out);

/* ---- reading -------------------------------------------------------------------------- */

/* Opens path for reading. Only a regular file (followed through links) is
 * opened: a FIFO, socket, device or folder is refused with one line naming
 * the path and what it is, and the open never blocks (it is non-blocking
 * until the type is known). *size: its bytes (NULL: not wanted).
 * DOPT_ERR_NOT_FOUND when it does not exist, DOPT_ERR_IO otherwise. */
dopt_status dopt__open_read(const char *path, int *fd, uint64_t *size);
/* The same, as a stdio stream ("rb"). */
dopt_status dopt__fopen_read(const char *path, FILE **f, uint64_t *size);
/* The whole file, NUL-terminated, at most max bytes (DOPT_ERR_FORMAT beyond). */
dopt_status dopt__read_all(const char *path, size_t max, char **text, size_t *len);
/* The offset of the first NUL a JSON text would carry into a C string — a raw NUL byte, or the escape \u0000
 * in a string, where a parser cuts the string short (a name or a path that ends early) — or -1. Every JSON
 * reader (checkpoint index and rank headers, safetensors headers, recordings' index.json) refuses such a text. */
long dopt__json_nul(const char *text, size_t n);
/* The same as a status: DOPT_ERR_FORMAT naming `where` and the byte (base + the offset in text), or DOPT_OK. */
dopt_status dopt__json_no_nul(const char *text, size_t n, const char *where, long base);
/* Exactly n bytes at offset off (path: for messages); a short file is DOPT_ERR_FORMAT. */
dopt_status dopt__pread_all(int fd, void *buf, size_t n, uint64_t off, const char *path);
dopt_status dopt__pwrite_all(int fd, const void *buf, size_t n, uint64_t off, const char *path);

/* ---- outputs ---------------------------------------------------------------------------- */

/* The one rule for a path the user names as an output (option opt, e.g.
 * "--out"; NULL: the path alone is named), checked before any work:
 *   DOPT_OUT_FILE: absent or a regular file: written atomically (a temporary
 *     file in its folder, renamed over it), so the folder must exist and be
 *     writable; a character device: written through (no temporary, no
 *     rename); a symbolic link: its final target, by the same rule, replaced
 *     in the target's folder; a FIFO, socket, block device or folder: refused.
 *   DOPT_OUT_DIR: absent (created, with its parents, when written) or a
 *     folder (through links), writable; anything else refused.
 * An empty path is refused. DOPT_ERR_INVALID_ARG, one line. */
enum { DOPT_OUT_FILE = 0, DOPT_OUT_DIR = 1 };
dopt_status dopt__check_output(const char *opt, const char *path, int kind);

/* An output may not be, lie inside, or (a folder) hold an input of the same
 * command: compared by device and inode along the resolved paths, so links,
 * hard links, bind mounts and "./" spellings are seen through. An input that
 * does not exist is apart from everything. DOPT_ERR_INVALID_ARG naming both
 * options and paths. */
dopt_status dopt__check_apart(const char *out_opt, const char *out, const char *in_opt, const char *in);

/* Two outputs of one command may not land in the same file (by device and
 * inode, links and spellings seen through; a file not made yet by its
 * folder's node and its name), unless it is a character device, which takes
 * both. DOPT_ERR_INVALID_ARG naming both options and paths. */
dopt_status dopt__check_distinct(const char *opt_a, const char *a, const char *opt_b, const char *b);

/* A file output inside a checkpoint folder that is another output of the
 * same command may not take a name the folder's writer uses (`latest`,
 * `step-<N>`, `.tmp-step-<N>`; checked when the folder exists). */
dopt_status dopt__check_ckpt_names(const char *out_opt, const char *out, const char *dir_opt, const char *dir);

/* An output being written. DOPT_W_OUTPUT: a path the user named, by the rule
 * of dopt__check_output (links resolved, a character device written through).
 * DOPT_W_INTERNAL: a file inside distopt's own folder (a checkpoint's
 * `latest`, index.json, rank files): never followed, whatever is there is
 * replaced by the rename (a folder there is an error). The temporary file is
 * created exclusively (O_EXCL | O_NOFOLLOW: never through a planted link)
 * next to the target, with the target's permissions when it exists. */
enum { DOPT_W_OUTPUT = 0, DOPT_W_INTERNAL = 1 };
typedef struct dopt_wfile dopt_wfile;
dopt_status dopt__wfile_open(const char *path, int mode, dopt_wfile **out);
int dopt__wfile_fd(const dopt_wfile *w);
/* A stdio stream on the file (made on the first call; NULL: out of memory). */
FILE *dopt__wfile_stream(dopt_wfile *w);
/* Flushes, syncs, renames the temporary over the target and syncs its folder
 * (a character device: flushed and closed). Frees w, also on failure, when
 * the temporary is removed and the target is as it was. */
dopt_status dopt__wfile_commit(dopt_wfile *w);
/* Removes the temporary (the target is as it was) and frees w; NULL is fine. */
void dopt__wfile_abort(dopt_wfile *w);
/* path ← data[n] through a dopt_wfile. */
dopt_status dopt__write_file(const char *path, int mode, const void *data, size_t n);
/* path ← what body writes to the stream (body returns nonzero on success), through a dopt_wfile. */
dopt_status dopt__write_stream(const char *path, int mode, int (*body)(FILE *f, const void *ctx), const void *ctx);

/* ---- folders ---------------------------------------------------------------------------- */

/* dir and its missing parents (0755); an existing folder (through links) is fine. */
dopt_status dopt__mkdir_p(const char *dir);
/* fsync of a folder (a file system that cannot sync folders says EINVAL: accepted). */
dopt_status dopt__sync_dir(const char *dir);
/* Removes dir, a folder of plain files that distopt wrote (a temporary
 * checkpoint generation). Absent is fine; a symbolic link there is removed as
 * a link and never followed; inside, links are removed as links; a folder
 * inside, or anything but a folder or link at dir, is an error naming it, and
 * then nothing is removed. */
dopt_status dopt__remove_flat_dir(const char *dir);

/* What a stat mode is, in words ("a FIFO (named pipe)", "a folder", ...). */
const char *dopt__file_kind(unsigned mode);

#endif
