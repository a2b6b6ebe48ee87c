/* Fuzz target: the configuration check of a multi-process compare (compare/agree.c, docs/mpi.md): rank 0's
 * configuration text arrives from another process and is parsed as untrusted input by cmp_config_diff.
 * Beyond "no crash, no leak, no UB": the answer is -1, 0 or 1 with one NUL-terminated line of message
 * (empty exactly when the texts agree); they agree only when they are byte-identical; a text compared with
 * itself never differs; and a well-formed text of this rank against the fuzzed one differs or is malformed
 * unless the bytes are the same. */
#include <stdlib.h>
#include <string.h>

#include "compare.h"
#include "fuzzcommon.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void check_msg(int rc, const char *msg) {
  if (rc < -1 || rc > 1 || strchr(msg, '\n') || (rc == 0) != (msg[0] == '\0')) abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  static char mine[CMP_CONFIG_MAX];
  static int nm = -1;
  if (nm < 0) { /* this rank: the defaults, as a real rank would send them */
    cmp_options o;
    cmp_options_default(&o);
    nm = cmp_config_text(&o, mine, sizeof mine);
    if (nm <= 0) abort();
  }
  const char *theirs = (const char *)data;
  char msg[512];
  int rc = cmp_config_diff(mine, (size_t)nm, theirs, size, 1, msg, sizeof msg);
  check_msg(rc, msg);
  int same = size == (size_t)nm && memcmp(theirs, mine, size) == 0;
  if ((rc == 0) != same) abort();
  rc = cmp_config_diff(theirs, size, theirs, size, 1, msg, sizeof msg); /* itself: never a difference */
  check_msg(rc, msg);
  if (rc == 1) abort();
  return 0;
}
