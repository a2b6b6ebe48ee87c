/* distopt — element types, shared by tensors, optimizer states, safetensors
 * files and collectives. Names are safetensors' dtype names. */
#ifndef DISTOPT_DTYPE_H
#define DISTOPT_DTYPE_H

#include <stddef.h>

#include "distopt/export.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DOPT_MAX_DIMS 8

typedef enum dopt_dtype {
  DOPT_F32 = 0,
  DOPT_F64 = 1,
  DOPT_BF16 = 2,
  DOPT_F16 = 3,
  DOPT_I32 = 4,
  DOPT_I64 = 5,
  DOPT_U8 = 6,
  DOPT_I8 = 7,
  DOPT_DTYPE_COUNT_
} dopt_dtype;

DOPT_API size_t dopt_dtype_size(dopt_dtype t);
DOPT_API const char *dopt_dtype_name(dopt_dtype t); /* "F32", "BF16", ... (safetensors names) */

#ifdef __cplusplus
}
#endif
#endif
