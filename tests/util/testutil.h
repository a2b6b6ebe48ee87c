/* Test helpers. Include after <cmocka.h>'s prerequisites; every assertion here
 * runs on the main thread only (cmocka is not thread-safe). */
#ifndef DOPT_TESTUTIL_H
#define DOPT_TESTUTIL_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "distopt/status.h"

/* Fails the test, printing the status name and the thread's detailed message. */
#define assert_ok(expr)                                                                  \
  do {                                                                                   \
    dopt_status s__ = (expr);                                                            \
    if (s__ != DOPT_OK)                                                                  \
      fail_msg("%s returned %s: %s", #expr, dopt_status_name(s__), dopt_last_error()); \
  } while (0)

/* Asserts a specific failing status and that the message mentions `needle`. */
#define assert_status(expr, want, needle)                                                      \
  do {                                                                                         \
    dopt_status s__ = (expr);                                                                  \
    if (s__ != (want))                                                                         \
      fail_msg("%s returned %s, want %s (%s)", #expr, dopt_status_name(s__),                  \
               dopt_status_name(want), dopt_last_error());                                     \
    if ((needle) != NULL && strstr(dopt_last_error(), (needle)) == NULL)                       \
      fail_msg("%s: message '%s' does not mention '%s'", #expr, dopt_last_error(), (needle)); \
  } while (0)

/* Distance in units in the last place between two finite floats (0 = identical
 * bits, also +0 vs -0 count as 0). */
uint64_t dt_ulp_distance(float a, float b);

/* Deterministic generator for test data (splitmix64). */
uint64_t dt_rand_u64(uint64_t *state);
double dt_rand_uniform(uint64_t *state);   /* [0, 1) */
double dt_rand_normal(uint64_t *state);

/* Creates a fresh per-process directory /tmp/<tag>_<pid> into buf; removes it. */
int dt_make_tmpdir(char *buf, size_t cap, const char *tag);
int dt_remove_tmpdir(const char *dir);

/* Runs the program bin with args (NULL-terminated, at most 60), stdout to
 * out and stderr to err (files; NULL: /dev/null); returns its exit code (-1:
 * it did not exit normally). */
int dt_run(const char *bin, const char *const *args, const char *out, const char *err);

/* dt_run with limits for the child: a wall-clock alarm (seconds; 0 none: a
 * command that hangs is killed and returns -1), a file-size limit (bytes; 0
 * none: a write beyond it fails with EFBIG, SIGXFSZ ignored, as a full disk),
 * environment variables set for it ("NAME=value", NULL-terminated), and an
 * address-space limit (bytes, as `ulimit -v`; 0 none). */
typedef struct dt_run_opts {
  unsigned timeout_s;
  unsigned long fsize_limit;
  const char *const *env;
  unsigned long as_limit;
} dt_run_opts;
int dt_run_with(const char *bin, const char *const *args, const char *out, const char *err, const dt_run_opts *o);

/* The rotating subset of the long grids (test.sh's sanitizer passes): DOPT_TEST_SUBSET="SEED/N"
 * (SEED hex, e.g. a commit hash; N >= 1) keeps every N-th item i of the n in group g, from an
 * offset that a hash of SEED and g chooses (exactly floor or ceil of n/N items: the cost does not
 * swing with the seed), and one item of a group of at most N; so every optimizer setting still
 * runs, each commit covers another part, and N offsets cover all. Unset: every item. A malformed
 * value fails the test. */
int dt_subset_keep(uint64_t group, int i, int n);
/* A wrapper's hyperparameters around registry optimizer `inner`: "inner=NAME" and, where the inner's defaults
 * are no optimizer (CAME's lr), its registry example's keys as inner.KEY; *alone: the inner's own hyperparameters
 * that match ("" or the example). */
void dt_wrapped_hparams(const char *inner, char *out, size_t cap, const char **alone);
/* The whole file, NUL-terminated (malloc'd; *n its bytes when n), or NULL when it cannot be read. */
char *dt_slurp(const char *path, size_t *n);
/* "every item" or "1 in N: DOPT_TEST_SUBSET=SEED/N, unset for all", for the test's summary line. */
const char *dt_subset_desc(void);

/* Returns the repository root (DOPT_SOURCE_DIR, set by CTest) or ".". */
const char *dt_source_dir(void);

#include <string.h>
#endif
