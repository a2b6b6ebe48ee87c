/* Fuzz target: the gradient-trace loader of `distopt compare` (a trace is a
 * safetensors file with metadata params, steps, shards, tp_roles): one step
 * on one simulated rank when it loads. */
#include <stdio.h>

#include "compare.h"
#include "fuzzcommon.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  cmp_options o;
  cmp_options_default(&o);
  snprintf(o.source, sizeof o.source, "trace");
  snprintf(o.trace_path, sizeof o.trace_path, "%s", fuzz_file(data, size, ".trace.safetensors"));
  snprintf(o.optimizer, sizeof o.optimizer, "adamw");
  snprintf(o.plugin, sizeof o.plugin, "ddp");
  o.tp = 1, o.dp = 1, o.zero = 0, o.steps = 1;
  cmp_result r;
  if (cmp_run(&o, &r, NULL, NULL) == DOPT_OK) cmp_result_free(&r);
  return 0;
}
