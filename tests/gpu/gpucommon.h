/* Shared by the GPU tests: skip (exit 77, CTest SKIP_RETURN_CODE) without a
 * CUDA device. */
#ifndef DOPT_GPUCOMMON_H
#define DOPT_GPUCOMMON_H
#include <stdio.h>
#include <stdlib.h>

#include "distopt/cuda.h"

static inline void gpu_or_skip(const char *test) {
  const char *why = "";
  if (dopt_cuda_device_count(&why) == 0) {
    printf("%s: no CUDA device: skipped (%s)\n", test, why);
    fflush(stdout);
    exit(77);
  }
}
#endif
