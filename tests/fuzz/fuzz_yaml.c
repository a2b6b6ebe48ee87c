/* Fuzz target: the YAML configuration loader of `distopt compare`
 * (cmp_load_yaml); a rejected file must leave the options unchanged. */
#include <string.h>

#include "compare.h"
#include "fuzzcommon.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  cmp_options o, before;
  cmp_options_default(&o);
  before = o;
  if (cmp_load_yaml(fuzz_file(data, size, ".yaml"), &o) != DOPT_OK && memcmp(&o, &before, sizeof o) != 0) abort();
  cmp_options_free(&o);
  return 0;
}
