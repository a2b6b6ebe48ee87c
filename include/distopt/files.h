/* distopt — writing a file as distopt writes every output (docs/files.md).
 *
 * The rule: a new or regular file is written to a temporary file in its
 * folder, synced and renamed over it (readers see the old or the new file,
 * never half of one; its permissions are kept); a character device is
 * written through; a symbolic link is followed to its final target, which is
 * replaced in the target's own folder; a FIFO, socket, block device or folder
 * is refused. The temporary is created exclusively, never through a link
 * someone placed at its name. */
#ifndef DISTOPT_FILES_H_PUBLIC
#define DISTOPT_FILES_H_PUBLIC

#include <stddef.h>

#include "distopt/export.h"
#include "distopt/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* path ← data[n] by the rule above. DOPT_ERR_IO (naming the path) when the
 * path is refused or a write fails; then the file is as it was. */
DOPT_API dopt_status dopt_write_file(const char *path, const void *data, size_t n);

#ifdef __cplusplus
}
#endif
#endif
