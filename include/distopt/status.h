/* distopt — status codes.
 *
 * Every public function returns a dopt_status. The table below is the single
 * source of truth: the enum, dopt_status_name() and dopt_status_str() are all
 * generated from it (libuv style). Codes are stable; append, never renumber.
 */
#ifndef DISTOPT_STATUS_H
#define DISTOPT_STATUS_H

#include "distopt/export.h"

#ifdef __cplusplus
extern "C" {
#endif

/* X(NAME, value, message) */
#define DOPT_STATUS_TABLE(X)                                                        \
  X(DOPT_OK, 0, "success")                                                          \
  X(DOPT_ERR_INVALID_ARG, 1, "invalid argument")                                    \
  X(DOPT_ERR_NO_MEMORY, 2, "out of memory")                                         \
  X(DOPT_ERR_NOT_FOUND, 3, "unknown name (optimizer, key, tensor or file)")         \
  X(DOPT_ERR_SHAPE, 4, "shape or size mismatch")                                    \
  X(DOPT_ERR_IO, 5, "input/output error")                                           \
  X(DOPT_ERR_FORMAT, 6, "malformed or truncated input")                             \
  X(DOPT_ERR_UNSUPPORTED, 7, "unsupported feature or dtype")                        \
  X(DOPT_ERR_BACKEND, 8, "backend error (BLAS/LAPACK, transport, device)")          \
  X(DOPT_ERR_TIMEOUT, 9, "operation timed out")                                     \
  X(DOPT_ERR_ABORTED, 10, "communicator aborted")                                   \
  X(DOPT_ERR_MISMATCH, 11, "collective signature mismatch across ranks")            \
  X(DOPT_ERR_NOT_DIVISIBLE, 12, "count cannot be split evenly")                     \
  X(DOPT_ERR_NUMERIC, 13, "non-finite value or numerical failure")                  \
  X(DOPT_ERR_STATE, 14, "call not valid in the current state")                      \
  X(DOPT_ERR_OVERLAP, 15, "overlapping buffers not allowed")

typedef enum dopt_status {
#define DOPT_STATUS_ENUM_(name, value, msg) name = value,
  DOPT_STATUS_TABLE(DOPT_STATUS_ENUM_)
#undef DOPT_STATUS_ENUM_
  DOPT_STATUS_COUNT_
} dopt_status;

/* "DOPT_ERR_SHAPE"; "DOPT_UNKNOWN_STATUS" for values outside the table. */
DOPT_API const char *dopt_status_name(dopt_status s);
/* Generic one-line description of the code. */
DOPT_API const char *dopt_status_str(dopt_status s);
/* The detailed message of the last failing call made by this thread: names the
 * argument and the value that failed. Empty string when none. Thread-local, so
 * simulated ranks (threads) each see their own. */
DOPT_API const char *dopt_last_error(void);
/* Clears this thread's message. */
DOPT_API void dopt_clear_error(void);

#ifdef __cplusplus
}
#endif
#endif
