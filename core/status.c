/* Status names/messages generated from DOPT_STATUS_TABLE, and the per-thread
 * error message buffer. */
#include "internal.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

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

/* The message: "NAME: text", on one line. Every control character of the
 * text (a newline in a tensor name, a YAML value, an argument echoed back) is
 * written as \xNN, and a repeat of "NAME: " inside the text (a callee's
 * message passed through) is dropped. */
dopt_status dopt__fail(dopt_status s, const char *fmt, ...) {
  char raw[sizeof tls_msg];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(raw, sizeof raw, fmt, ap);
  va_end(ap);
  const char *name = dopt_status_name(s);
  char text[sizeof raw]; /* raw without a repeat of "NAME: " */
  size_t t = 0, nl = strlen(name);
  for (const char *p = raw; *p; p++) {
    if (strncmp(p, name, nl) == 0 && p[nl] == ':' && p[nl + 1] == ' ') {
      p += nl + 1; /* the loop's p++ skips the space */
      continue;
    }
    text[t++] = *p;
  }
  int n = snprintf(tls_msg, sizeof tls_msg, "%s: ", name);
  size_t o = n < 0 || (size_t)n >= sizeof tls_msg ? 0 : (size_t)n;
  dopt__escape(text, t, tls_msg + o, sizeof tls_msg - o);
  return s;
}
