/* The measurement of a gathered tensor against the reference's (harness.h): max abs error, max ULP distance,
 * the first divergent step; and its merge over every rank (backend mpi). */
#include <errno.h>
#include <fnmatch.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "compare.h"
#include "distopt/cuda.h"
#include "distopt/dpsum.h"
#include "distopt/launch.h"
#include "distopt/mpi.h"
#include "distopt/safetensors.h"
#include "distopt/sim.h"
#include "files.h"
#include "internal.h"
#include "model.h"
#include "registry.h"
#include "verify.h"
#include "harness.h"

static uint64_t ulp_distance(float a, float b) {
  if (a != a || b != b) return UINT64_MAX; /* one NaN: as far apart as it gets (two: measure's NaN = NaN) */
  int32_t ia, ib;
  memcpy(&ia, &a, sizeof ia);
  memcpy(&ib, &b, sizeof ib);
  int64_t oa = ia < 0 ? (int64_t)INT32_MIN - ia : ia, ob = ib < 0 ? (int64_t)INT32_MIN - ib : ib;
  int64_t d = oa - ob;
  return (uint64_t)(d < 0 ? -d : d);
}

/* Records the difference of one tensor after step t (1-based). */
void ce_measure(cmp_tensor_stat *ts, int t, const float *ref, const float *got, size_t n) {
  double mabs = 0;
  uint64_t mulp = 0, nans = 0;
  enum { RUN = 1024 };
  for (size_t k0 = 0; k0 < n; k0 += RUN) {
    const size_t k1 = n - k0 < RUN ? n : k0 + RUN;
    if (memcmp(ref + k0, got + k0, (k1 - k0) * sizeof(float)) == 0) { /* equal bytes (the usual case) */
      unsigned c = 0;
      for (size_t k = k0; k < k1; k++) c += ref[k] != ref[k]; /* its NaN pairs */
      nans += c;
      continue;
    }
    for (size_t k = k0; k < k1; k++) {
      if (ref[k] != ref[k] && got[k] != got[k]) { /* NaN = NaN, counted apart (docs/nan-policy.md) */
        nans++;
        continue;
      }
      if (memcmp(&ref[k], &got[k], sizeof(float)) == 0) continue;
      double d = fabs((double)ref[k] - (double)got[k]);
      if (!(d <= mabs)) mabs = d; /* NaN: kept as NaN */
      uint64_t u = ulp_distance(ref[k], got[k]);
      if (u == 0) u = 1; /* +0 vs -0 */
      mulp = u > mulp ? u : mulp;
    }
  }
  ts->abs_per_step[t - 1] = mabs;
  ts->ulp_per_step[t - 1] = mulp;
  if (nans > ts->nan_pairs) ts->nan_pairs = nans;
  if (!(mabs <= ts->max_abs)) ts->max_abs = mabs;
  if (mulp > ts->max_ulp) ts->max_ulp = mulp;
  if (mulp > 0 && ts->first_diff == 0) ts->first_diff = t;
}

/* A state the distributed side holds in another size, or not at all (its layout differs: a wrong state
 * decision), after step t: every element differs (ULP column UINT64_MAX, abs +inf); a finding, not an error. */
void ce_measure_mismatch(cmp_tensor_stat *ts, int t) {
  ts->abs_per_step[t - 1] = INFINITY;
  ts->ulp_per_step[t - 1] = UINT64_MAX;
  ts->max_abs = INFINITY;
  ts->max_ulp = UINT64_MAX;
  if (ts->first_diff == 0) ts->first_diff = t;
}

/* Records the difference of a non-fp32 state (8-bit codes, int8 weights,
 * quantised projectors) after step t: byte for byte; the "ULP" column counts
 * the differing bytes and the abs column stays 0. */
void ce_measure_bytes(cmp_tensor_stat *ts, int t, const void *ref, const void *got, size_t bytes) {
  const unsigned char *a = ref, *b = got;
  uint64_t diff = 0;
  for (size_t k = 0; k < bytes; k++) diff += a[k] != b[k];
  ts->abs_per_step[t - 1] = 0;
  ts->ulp_per_step[t - 1] = diff;
  if (diff > ts->max_ulp) ts->max_ulp = diff;
  if (diff > 0 && ts->first_diff == 0) ts->first_diff = t;
}


/* Backend mpi: every rank stepped its own reference and measured its own
 * gathered tensors; one all_reduce MAX (I64) over the world merges them, so
 * rank 0 reports a difference seen by any rank. Keys, all exact: a double
 * >= 0 (or a NaN, sign bit cleared) orders like its bits as an int64 (a NaN
 * wins); a ULP count as itself (UINT64_MAX, a NaN mismatch: INT64_MAX); the
 * first divergent step as -step (none: INT64_MIN), so MAX is the earliest.
 * The skip counters come from collectives and must agree on every rank. */
static int64_t abs_key(double d) {
  int64_t k;
  memcpy(&k, &d, sizeof k);
  return k & INT64_MAX;
}
static double key_abs(int64_t k) {
  double d;
  memcpy(&d, &k, sizeof d);
  return d;
}
static int64_t ulp_key(uint64_t u) { return u > (uint64_t)INT64_MAX ? INT64_MAX : (int64_t)u; }
static uint64_t key_ulp(int64_t k) { return k == INT64_MAX ? UINT64_MAX : (uint64_t)k; }

dopt_status ce_merge_measurements(const dopt_transport *w, cmp_result *r, int steps) {
  const size_t per = 4 + 2 * (size_t)steps, n = (size_t)r->ntensors * per + 4, us = (size_t)steps;
  int64_t *v = malloc(n * sizeof *v);
  if (!v) return dopt__fail(DOPT_ERR_NO_MEMORY, "backend mpi: %zu measurement words", n);
  for (int k = 0; k < r->ntensors; k++) {
    const cmp_tensor_stat *t = &r->t[k];
    int64_t *b = v + (size_t)k * per;
    b[0] = abs_key(t->max_abs);
    b[1] = ulp_key(t->max_ulp);
    b[2] = t->first_diff ? -(int64_t)t->first_diff : INT64_MIN;
    for (size_t q = 0; q < us; q++) {
      b[3 + q] = abs_key(t->abs_per_step[q]);
      b[3 + us + q] = ulp_key(t->ulp_per_step[q]);
    }
    b[3 + 2 * us] = ulp_key(t->nan_pairs);
  }
  int64_t *sk = v + n - 4; /* max and -min of each counter */
  sk[0] = r->skipped_ref, sk[1] = -r->skipped_ref, sk[2] = r->skipped_dist, sk[3] = -r->skipped_dist;
  dopt_status st = w->ops->all_reduce(w->comm, v, v, n, DOPT_I64, DOPT_MAX);
  for (int k = 0; st == DOPT_OK && k < r->ntensors; k++) {
    cmp_tensor_stat *t = &r->t[k];
    const int64_t *b = v + (size_t)k * per;
    t->max_abs = key_abs(b[0]);
    t->max_ulp = key_ulp(b[1]);
    t->first_diff = b[2] == INT64_MIN ? 0 : (int)-b[2];
    for (size_t q = 0; q < us; q++) {
      t->abs_per_step[q] = key_abs(b[3 + q]);
      t->ulp_per_step[q] = key_ulp(b[3 + us + q]);
    }
    t->nan_pairs = key_ulp(b[3 + 2 * us]);
  }
  if (st == DOPT_OK && (sk[0] != -sk[1] || sk[2] != -sk[3]))
    st = dopt__fail(DOPT_ERR_MISMATCH, "backend mpi: the ranks disagree on skipped steps (reference %lld..%lld, "
                    "distributed %lld..%lld)", (long long)-sk[1], (long long)sk[0], (long long)-sk[3], (long long)sk[2]);
  if (st == DOPT_OK) r->skipped_ref = sk[0], r->skipped_dist = sk[2];
  free(v);
  return st;
}

double cmp_now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}
