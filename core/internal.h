/* Library-internal helpers shared by ref/, distributed/, sim/ (never installed). */
#ifndef DISTOPT_INTERNAL_H
#define DISTOPT_INTERNAL_H

#include "distopt/status.h"

#include <stddef.h>
#include <stdint.h>

#if defined(__GNUC__)
#define DOPT_PRINTF(a, b) __attribute__((format(printf, a, b)))
#else
#define DOPT_PRINTF(a, b)
#endif

/* Record a detailed message for this thread and return `s`. The message must
 * name the argument and the value that failed, e.g.
 *   return dopt__fail(DOPT_ERR_INVALID_ARG, "adafactor: clip_threshold=%g must be > 0", v); */
dopt_status dopt__fail(dopt_status s, const char *fmt, ...) DOPT_PRINTF(2, 3);
/* The one escaping rule for what is echoed (core/escape.c): s[0..n) into out (cap bytes, NUL-terminated) with
 * C0 controls and DEL as \xNN, C1 controls, format characters (bidi controls, zero-width characters, the BOM)
 * and line/paragraph separators as \uXXXX, each byte of invalid UTF-8 as \xNN; other text, non-ASCII included,
 * as it is. Never splits an escape or a character; returns the bytes written. */
size_t dopt__escape(const char *s, size_t n, char *out, size_t cap);
/* "[d0,d1,...]" of a shape, for messages (core/shape.c). */
void dopt__shape_text(int ndim, const int64_t *shape, char *out, size_t cap);

/* Propagate a failing status (the callee already wrote the message). */
#define DOPT_TRY(expr)                 \
  do {                                 \
    dopt_status dopt_try_s_ = (expr);  \
    if (dopt_try_s_ != DOPT_OK)        \
      return dopt_try_s_;              \
  } while (0)

#define DOPT_CHECK_ARG(cond, ...)                        \
  do {                                                   \
    if (!(cond))                                         \
      return dopt__fail(DOPT_ERR_INVALID_ARG, __VA_ARGS__); \
  } while (0)

#endif
