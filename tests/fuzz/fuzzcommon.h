/* Shared by the fuzz targets: the input as a file (the loaders take paths),
 * written to one temporary file per process. */
#ifndef DOPT_FUZZCOMMON_H
#define DOPT_FUZZCOMMON_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* The path of a file holding exactly data[size] (the same path every call). */
static inline const char *fuzz_file(const uint8_t *data, size_t size, const char *suffix) {
  static char path[256];
  if (!path[0]) {
    const char *tmp = getenv("TMPDIR");
    snprintf(path, sizeof path, "%s/dopt_fuzz_%ld%s", tmp && *tmp ? tmp : "/tmp", (long)getpid(), suffix);
  }
  FILE *f = fopen(path, "wb");
  if (!f) abort(); /* the harness itself failed: not a finding */
  if (size && fwrite(data, 1, size, f) != size) abort();
  fclose(f);
  return path;
}

#endif
