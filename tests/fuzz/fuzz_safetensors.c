/* Fuzz target: the safetensors reader (dopt_st_load), then every tensor read
 * whole and its metadata looked up, as `distopt run` does; the streamed reader
 * (dopt_st_open) accepts exactly the same files and reads every F32 tensor
 * with the same bytes. */
#include <stdlib.h>
#include <string.h>

#include "distopt/safetensors.h"
#include "fuzzcommon.h"

static volatile unsigned sink; /* keeps the reads of every byte */

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  dopt_st_file *f = NULL, *g = NULL;
  const char *path = fuzz_file(data, size, ".safetensors");
  const dopt_status ls = dopt_st_load(path, &f), os = dopt_st_open(path, &g);
  if (ls != os) abort(); /* the same verdict on every file */
  if (ls != DOPT_OK) return 0;
  if (dopt_st_count(g) != dopt_st_count(f)) abort();
  unsigned sum = 0;
  for (int i = 0; i < dopt_st_count(f); i++) {
    dopt_st_tensor t;
    if (dopt_st_get(f, i, &t) != DOPT_OK) abort(); /* an index below the count must exist */
    const unsigned char *b = t.data;
    for (size_t k = 0; k < t.bytes; k++) sum += b[k]; /* every byte of every tensor is readable */
    dopt_st_tensor again;
    if (dopt_st_find(f, t.name, &again) != DOPT_OK || again.data != t.data) abort(); /* the name index agrees */
    if (t.dtype == DOPT_F32) { /* streamed: the same bytes */
      float *a = malloc(t.bytes ? t.bytes : 1);
      if (!a) abort();
      if (dopt_st_read_f32(g, t.name, a, t.numel) != DOPT_OK || memcmp(a, t.data, t.bytes) != 0) abort();
      /* a block of the tensor seen as [1, rows, cols] (cols: its last dimension): the same as the loaded copy */
      const size_t cols = t.ndim ? (size_t)t.shape[t.ndim - 1] : 1, rows = cols ? t.numel / cols : 0;
      if (rows && cols) {
        const size_t h0 = rows / 3, hl = rows - h0 > 1 ? (rows - h0) / 2 + 1 : rows - h0, w0 = cols / 2,
                     wl = cols - w0;
        if (dopt_st_read_f32_block(g, t.name, 1, rows, cols, h0, hl, w0, wl, a) != DOPT_OK) abort();
        for (size_t r = 0; r < hl; r++)
          if (memcmp(a + r * wl, (const unsigned char *)t.data + ((h0 + r) * cols + w0) * sizeof(float),
                     wl * sizeof(float)) != 0) /* t.data may be unaligned for a float */
            abort();
      }
      free(a);
    }
  }
  sink = sum;
  (void)dopt_st_meta(f, "optimizer");
  dopt_st_free(f);
  dopt_st_free(g);
  return 0;
}
