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

/* The one escaping rule (dopt__escape): C1 controls, bidi overrides and isolates, zero-width and other format
 * characters, line separators and invalid UTF-8 are escaped too (they reached terminals and CI logs raw); real
 * non-ASCII text passes; an escape or a character is never split at the end of the buffer. */
static void test_escape_unicode(void **st) {
  (void)st;
  static const struct {
    const char *in, *want;
  } cases[] = {
      {"caf\xc3\xa9 \xe6\xbc\xa2 \xf0\x9f\x98\x80", "caf\xc3\xa9 \xe6\xbc\xa2 \xf0\x9f\x98\x80"}, /* é 漢 😀 */
      {"a\xc2\x85z", "a\\u0085z"},                        /* NEL, a C1 control */
      {"x\xe2\x80\xaey\xe2\x81\xa6", "x\\u202ey\\u2066"},  /* RIGHT-TO-LEFT OVERRIDE, LEFT-TO-RIGHT ISOLATE */
      {"\xe2\x80\x8b\xef\xbb\xbf", "\\u200b\\ufeff"},    /* ZERO WIDTH SPACE, BOM */
      {"l\xe2\x80\xa8p\xe2\x80\xa9", "l\\u2028p\\u2029"}, /* LINE / PARAGRAPH SEPARATOR */
      {"bad\xff\xfe", "bad\\xff\\xfe"},                     /* not UTF-8 */
      {"cut\xe2\x80", "cut\\xe2\\x80"},                     /* a sequence cut short */
      {"over\xc0\xaf", "over\\xc0\\xaf"},                   /* an overlong '/' */
      {"tab\tnl\n\x7f", "tab\\x09nl\\x0a\\x7f"},
  };
  char out[128];
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    dopt__escape(cases[i].in, strlen(cases[i].in), out, sizeof out);
    if (strcmp(out, cases[i].want) != 0) fail_msg("case %zu: '%s', want '%s'", i, out, cases[i].want);
  }
  /* through the error message too */
  dopt__fail(DOPT_ERR_NOT_FOUND, "tensor '%s'", "w\xe2\x80\xae\xc2\x9b");
  assert_string_equal(dopt_last_error(), "DOPT_ERR_NOT_FOUND: tensor 'w\\u202e\\u009b'");
  /* a full buffer: the escape (4 bytes) that does not fit is left out whole */
  char small[8];
  assert_int_equal(dopt__escape("abcd\x01", 5, small, sizeof small), 4);
  assert_string_equal(small, "abcd");
  assert_int_equal(dopt__escape("ab\xe6\xbc\xa2\xe6\xbc\xa2", 8, small, sizeof small), 5);
  assert_string_equal(small, "ab\xe6\xbc\xa2");
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_message_escaped_one_line), cmocka_unit_test(test_escape_unicode),
      cmocka_unit_test(test_names_and_messages),
      cmocka_unit_test(test_message),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
