/* Element types (distopt/dtype.h) and the bf16 conversions (distopt/device.h):
 * the leaf of core/, used by every other file and using none. */
#include <string.h>

#include "elem.h"

#include "distopt/device.h"
#include "distopt/dtype.h"

size_t dopt_dtype_size(dopt_dtype t) {
  static const size_t sz[] = {4, 8, 2, 2, 4, 8, 1, 1};
  return (unsigned)t < DOPT_DTYPE_COUNT_ ? sz[t] : 0;
}

const char *dopt_dtype_name(dopt_dtype t) {
  static const char *const nm[] = {"F32", "F64", "BF16", "F16", "I32", "I64", "U8", "I8"};
  return (unsigned)t < DOPT_DTYPE_COUNT_ ? nm[t] : "?";
}

uint16_t dopt_f32_to_bf16(float x) {
  uint32_t u;
  memcpy(&u, &x, sizeof u);
  return dopt_bf16_of_bits(u); /* core/elem.h: the CUDA kernel's rounding too */
}

float dopt_bf16_to_f32(uint16_t x) {
  uint32_t u = (uint32_t)x << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}
