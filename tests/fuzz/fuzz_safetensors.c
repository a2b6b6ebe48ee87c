/* Fuzz target: the safetensors reader (dopt_st_load), then every tensor read
 * whole and its metadata looked up, as `distopt run` does. */
#include "distopt/safetensors.h"
#include "fuzzcommon.h"

static volatile unsigned sink; /* keeps the reads of every byte */

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  dopt_st_file *f = NULL;
  if (dopt_st_load(fuzz_file(data, size, ".safetensors"), &f) != DOPT_OK) return 0;
  unsigned sum = 0;
  for (int i = 0; i < dopt_st_count(f); i++) {
    dopt_st_tensor t;
    if (dopt_st_get(f, i, &t) != DOPT_OK) abort(); /* an index below the count must exist */
    const unsigned char *b = t.data;
    for (size_t k = 0; k < t.bytes; k++) sum += b[k]; /* every byte of every tensor is readable */
    dopt_st_tensor again;
    if (dopt_st_find(f, t.name, &again) != DOPT_OK || again.data != t.data) abort(); /* the name index agrees */
  }
  sink = sum;
  (void)dopt_st_meta(f, "optimizer");
  dopt_st_free(f);
  return 0;
}
