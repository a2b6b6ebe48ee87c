/* The status table: names and messages come from one X-macro table, unknown
 * codes are handled, and the thread-local message carries the detail. */
#include "testutil.h"

#include <stdio.h>

#include "internal.h"

static void test_names_and_messages(void **st) {
  (void)st;
  assert_string_equal(dopt_status_name(DOPT_OK), "DOPT_OK");
  assert_string_equal(dopt_status_name(DOPT_ERR_TIMEOUT), "DOPT_ERR_TIMEOUT");
  assert_string_equal(dopt_status_str(DOPT_ERR_NO_MEMORY), "out of memory");
  assert_string_equal(dopt_status_name((dopt_status)9999), "DOPT_UNKNOWN_STATUS");
  for (int s = 0; s < DOPT_STATUS_COUNT_; s++) {
    assert_true(strncmp(dopt_status_name((dopt_status)s), "DOPT_", 5) == 0);
    assert_true(strlen(dopt_status_str((dopt_status)s)) > 3);
  }
}

static void test_message(void **st) {
  (void)st;
  dopt_clear_error();
  assert_string_equal(dopt_last_error(), "");
  dopt_status s = dopt__fail(DOPT_ERR_INVALID_ARG, "lr=%g must be >= 0", -1.0);
  assert_int_equal(s, DOPT_ERR_INVALID_ARG);
  assert_string_equal(dopt_last_error(), "DOPT_ERR_INVALID_ARG: lr=-1 must be >= 0");
}

/* One line whatever the input: control characters escaped, a callee's
 * status name passed through is not repeated. */
static void test_message_escaped_one_line(void **st) {
  (void)st;
  assert_int_equal(dopt__fail(DOPT_ERR_FORMAT, "tensor '%s': bad", "a\nb\tc\x7f"), DOPT_ERR_FORMAT);
  assert_string_equal(dopt_last_error(), "DOPT_ERR_FORMAT: tensor 'a\\x0ab\\x09c\\x7f': bad");
  dopt__fail(DOPT_ERR_ABORTED, "peer gone");
  char inner[128];
  snprintf(inner, sizeof inner, "%s", dopt_last_error());
  dopt__fail(DOPT_ERR_ABORTED, "sim_launch: rank 1: %s", inner);
  assert_string_equal(dopt_last_error(), "DOPT_ERR_ABORTED: sim_launch: rank 1: peer gone");
  dopt__fail(DOPT_ERR_IO, "rank 1: %s", inner); /* another status's name stays: it says what the callee saw */
  assert_string_equal(dopt_last_error(), "DOPT_ERR_IO: rank 1: DOPT_ERR_ABORTED: peer gone");
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_message_escaped_one_line),
      cmocka_unit_test(test_names_and_messages),
      cmocka_unit_test(test_message),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
