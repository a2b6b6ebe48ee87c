/* Status names/messages generated from DOPT_STATUS_TABLE, and the per-thread
 * error message buffer. */
#include "internal.h"

#include <stdarg.h>
#include <stdio.h>

const char *dopt_status_name(dopt_status s) {
  switch (s) {
#define DOPT_STATUS_NAME_(name, value, msg) \
  case name:                                \
    return #name;
    DOPT_STATUS_TABLE(DOPT_STATUS_NAME_)
#undef DOPT_STATUS_NAME_
  default:
    return "DOPT_UNKNOWN_STATUS";
  }
}

const char *dopt_status_str(dopt_status s) {
  switch (s) {
#define DOPT_STATUS_STR_(name, value, msg) \
  case name:                               \
    return msg;
    DOPT_STATUS_TABLE(DOPT_STATUS_STR_)
#undef DOPT_STATUS_STR_
  default:
    return "unknown status code";
  }
}

static _Thread_local char tls_msg[512];

const char *dopt_last_error(void) { return tls_msg; }
void dopt_clear_error(void) { tls_msg[0] = '\0'; }

dopt_status dopt__fail(dopt_status s, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  int n = snprintf(tls_msg, sizeof tls_msg, "%s: ", dopt_status_name(s));
  if (n < 0 || (size_t)n >= sizeof tls_msg) n = 0;
  vsnprintf(tls_msg + n, sizeof tls_msg - (size_t)n, fmt, ap);
  va_end(ap);
  return s;
}
