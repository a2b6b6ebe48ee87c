/* The optimised exact-sum paths (core/xsum.c, core/stats.c: vector kernels,
 * blocked double accumulation, fused row/column passes over generated runs)
 * against a plain scalar transcription of the definition in
 * include/distopt/xsum.h, written here: every accumulator's carry-normalised
 * words, maximum and result must be bitwise equal, on
 * random data with zeros, -0, subnormals, huge values, ±inf and NaN, for many
 * lengths (including past the 2^18-element block) and strides. */
#include "testutil.h"

#include <math.h>
#include <stdlib.h>

#include "distopt/xsum.h"
#include "optim_impl.h"

/* ---- the definition, straightforwardly ---------------------------------------- */

static void ref_add(dopt_xacc *a, double scale, double x) {
  if (isnan(x)) {
    a->w[2]++;
    return;
  }
  if (isinf(x)) {
    a->w[x > 0 ? 3 : 4]++;
    return;
  }
  int64_t q = (int64_t)rint(x * scale);
  int64_t lo = (int64_t)((uint64_t)q & 0xffffffffu);
  if (lo >= 2147483648) lo -= 4294967296; /* signed low word in [-2^31, 2^31) */
  a->w[0] = (int64_t)((uint64_t)a->w[0] + (uint64_t)((q - lo) / 4294967296));
  a->w[1] = (int64_t)((uint64_t)a->w[1] + (uint64_t)lo);
}

static double ref_absmax(const float *x, size_t n, size_t stride) {
  float m = 0.0f;
  for (size_t i = 0; i < n; i++) {
    float a = fabsf(x[i * stride]);
    if (isfinite(a) && a > m) m = a;
  }
  return (double)m;
}

/* ---- data ------------------------------------------------------------------------ */

static float rand_value(uint64_t *st, int special) {
  double u = dt_rand_uniform(st);
  if (special) {
    if (u < 0.02) return 0.0f;
    if (u < 0.03) return -0.0f;
    if (u < 0.05) return (float)(dt_rand_normal(st) * 1e-41); /* subnormal */
    if (u < 0.06) return (float)(dt_rand_normal(st) * 1e38);  /* huge */
    if (u < 0.065) return INFINITY;
    if (u < 0.07) return -INFINITY;
    if (u < 0.075) return NAN;
    if (u < 0.10) return (float)(dt_rand_normal(st) * pow(10.0, 60.0 * dt_rand_uniform(st) - 40.0));
  }
  return (float)dt_rand_normal(st);
}

static float *rand_array(uint64_t *st, size_t n, int special) {
  float *x = malloc((n ? n : 1) * sizeof *x);
  assert_non_null(x);
  for (size_t i = 0; i < n; i++) x[i] = rand_value(st, special);
  return x;
}

/* The words carry-normalised (0 <= lo < 2^32, as dopt_xacc_value reads them): the fast paths may split a tie
 * (q ≡ 2^31 mod 2^32) between hi and lo otherwise than the definition, never the total. */
static dopt_xacc normalised(const dopt_xacc *a) {
  dopt_xacc r = *a;
  const int64_t low = (int64_t)((uint64_t)a->w[1] & 0xffffffffu);
  r.w[0] = (int64_t)((uint64_t)a->w[0] + (uint64_t)((a->w[1] - low) / 4294967296));
  r.w[1] = low;
  return r;
}

static void assert_acc_equal(const dopt_xacc *a0, const dopt_xacc *b0, const char *what, size_t n) {
  const dopt_xacc na = normalised(a0), nb = normalised(b0), *a = &na, *b = &nb;
  if (memcmp(a, b, sizeof *a) != 0)
    fail_msg("%s (n=%zu): words (%lld %lld %lld %lld %lld) vs reference (%lld %lld %lld %lld %lld)", what, n,
             (long long)a->w[0], (long long)a->w[1], (long long)a->w[2], (long long)a->w[3], (long long)a->w[4],
             (long long)b->w[0], (long long)b->w[1], (long long)b->w[2], (long long)b->w[3], (long long)b->w[4]);
}

static void assert_bits_equal(double a, double b, const char *what, size_t n) {
  if (memcmp(&a, &b, sizeof a) != 0) fail_msg("%s (n=%zu): %.17g vs reference %.17g", what, n, a, b);
}

static const size_t LENGTHS[] = {0, 1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 33, 63, 64, 65, 100, 127, 1000, 4097, 70001,
                                 (1u << 18) - 1, (1u << 18), (1u << 18) + 9, 600003};

/* ---- vectors ------------------------------------------------------------------------ */

static void check_vector(const float *x, size_t n, const char *tag) {
  for (size_t stride = 1; stride <= 4; stride++) {
    size_t m = n / stride;
    double amax = ref_absmax(x, m, stride);
    assert_bits_equal(dopt_absmax(x, m, stride), amax, "absmax", m);
    /* the contract scale, and twice it (|q| up to 2^63: the range fallback) */
    for (int k = 0; k < 2; k++) {
      double scale = dopt_xsum_scale(amax) * (k ? 2.0 : 1.0);
      dopt_xacc a = {{3, -5, 0, 1, 0}}, r = a; /* non-zero start: adds to what is there */
      dopt_xacc_add_n(&a, scale, x, m, stride);
      for (size_t i = 0; i < m; i++) ref_add(&r, scale, (double)x[i * stride]);
      assert_acc_equal(&a, &r, tag, m);
      assert_bits_equal(dopt_xacc_value(&a, scale), dopt_xacc_value(&r, scale), "value", m);
    }
  }
  double amax = ref_absmax(x, n, 1);
  for (int k = 0; k < 2; k++) {
    double scale = dopt_xsum_scale(amax * amax) * (k ? 2.0 : 1.0);
    dopt_xacc a = {{0}}, r = a;
    dopt_xacc_add_sq_n(&a, scale, x, n);
    for (size_t i = 0; i < n; i++) ref_add(&r, scale, (double)x[i] * (double)x[i]);
    assert_acc_equal(&a, &r, "add_sq_n", n);
  }
  /* the one-segment conveniences */
  double sc = dopt_xsum_scale(amax), sq = dopt_xsum_scale(amax * amax);
  dopt_xacc r = {{0}}, r2 = {{0}};
  for (size_t i = 0; i < n; i++) {
    ref_add(&r, sc, (double)x[i]);
    ref_add(&r2, sq, (double)x[i] * (double)x[i]);
  }
  assert_bits_equal(dopt_xsum(x, n), dopt_xacc_value(&r, sc), "xsum", n);
  assert_bits_equal(dopt_xsum_sq(x, n), dopt_xacc_value(&r2, sq), "xsum_sq", n);
}

static void test_vectors(void **st) {
  (void)st;
  uint64_t rs = 42;
  for (size_t li = 0; li < sizeof LENGTHS / sizeof LENGTHS[0]; li++) {
    size_t n = LENGTHS[li];
    for (int special = 0; special < 2; special++) {
      float *x = rand_array(&rs, n, special);
      check_vector(x, n, special ? "add_n special" : "add_n normal");
      /* unaligned start */
      if (n > 1) check_vector(x + 1, n - 1, "add_n offset");
      free(x);
    }
  }
  /* all-subnormal, all-zero, one non-finite in an otherwise normal block */
  size_t n = 1000;
  float *x = rand_array(&rs, n, 0);
  for (size_t i = 0; i < n; i++) x[i] = (float)(x[i] * 1e-40);
  check_vector(x, n, "subnormal");
  for (size_t i = 0; i < n; i++) x[i] = 0.0f;
  check_vector(x, n, "zeros");
  for (size_t i = 0; i < n; i++) x[i] = (float)dt_rand_normal(&rs);
  x[517] = NAN;
  check_vector(x, n, "one NaN");
  x[517] = -INFINITY;
  check_vector(x, n, "one -inf");
  free(x);
  /* ties of the word split: q ≡ 2^31 (mod 2^32) at scale 1, both signs, among ordinary values */
  float ties[40];
  for (int i = 0; i < 40; i++) ties[i] = (float)((i % 4 == 3 ? 1.0 : (2 * (i % 5) + 1) * 0x1p31) * (i % 2 ? -1 : 1));
  dopt_xacc a = {{0}}, r = a;
  dopt_xacc_add_n(&a, 1.0, ties, 40, 1);
  for (int i = 0; i < 40; i++) ref_add(&r, 1.0, (double)ties[i]);
  assert_acc_equal(&a, &r, "ties", 40);
}

/* ---- row/column statistics ------------------------------------------------------------ */

/* The piece statistics of a whole [b, h, w] tensor against the per-element
 * definition: maxima, scales, accumulator words, means, bit for bit. */
static void check_rowcol(const float *u, size_t b, size_t h, size_t w) {
  size_t nr = b * h, nc = b * w;
  double *rs = malloc((nr + 1) * sizeof *rs), *cs = malloc((nc + 1) * sizeof *cs);
  dopt_xacc *rr = calloc(nr + 1, sizeof *rr), *cr = calloc(nc + 1, sizeof *cr);
  float *rm = malloc((nr + 1) * sizeof *rm), *cm = malloc((nc + 1) * sizeof *cm);
  assert_true(rs && cs && rr && cr && rm && cm);
  for (size_t k = 0; k < b; k++) {
    for (size_t i = 0; i < h; i++) rs[k * h + i] = dopt_xsum_scale(ref_absmax(u + (k * h + i) * w, w, 1));
    for (size_t j = 0; j < w; j++) cs[k * w + j] = dopt_xsum_scale(ref_absmax(u + k * h * w + j, h, w));
  }
  for (size_t k = 0; k < b; k++)
    for (size_t i = 0; i < h; i++)
      for (size_t j = 0; j < w; j++) {
        double x = (double)u[(k * h + i) * w + j];
        ref_add(&rr[k * h + i], rs[k * h + i], x);
        ref_add(&cr[k * w + j], cs[k * w + j], x);
      }
  int64_t shape[3] = {(int64_t)b, (int64_t)h, (int64_t)w};
  dopt_piece pc;
  dopt_piece_full(3, shape, &pc);
  /* the three phases of the staged statistic, with no reducer */
  dopt_frame fr = {NULL, 0};
  dopt_rc_stat rc;
  dopt_rc_take(&fr, &pc, &rc);
  fr.base = malloc(fr.off);
  assert_non_null(fr.base);
  fr.off = 0;
  dopt_rc_take(&fr, &pc, &rc);
  assert_int_equal(dopt_rc_begin(&rc, u, &pc, NULL), DOPT_OK);
  assert_int_equal(dopt_rc_accum(&rc, u, &pc, NULL), DOPT_OK);
  dopt_rc_means(&rc, &pc, rm, cm);
  free(fr.base);
  for (size_t i = 0; i < nr; i++) {
    float e = (float)(dopt_xacc_value(&rr[i], rs[i]) / (double)w);
    assert_memory_equal(&rm[i], &e, sizeof e);
  }
  for (size_t i = 0; i < nc; i++) {
    float e = (float)(dopt_xacc_value(&cr[i], cs[i]) / (double)h);
    assert_memory_equal(&cm[i], &e, sizeof e);
  }
  free(rs), free(cs), free(rr), free(cr), free(rm), free(cm);
}

static void test_rowcol(void **st) {
  (void)st;
  static const size_t shapes[][3] = {{1, 1, 1}, {1, 1, 9}, {1, 9, 1}, {1, 3, 4}, {1, 5, 7},   {2, 17, 33},
                                     {1, 64, 64}, {3, 13, 31}, {1, 257, 129}, {1, 100, 1000}, {2, 1000, 3},
                                     {1, 3, 5000}, {2, 2, 4099}}; /* rows longer than one run (DOPT_RUN) */
  uint64_t rs = 7;
  for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
    size_t b = shapes[s][0], h = shapes[s][1], w = shapes[s][2];
    for (int special = 0; special < 2; special++) {
      float *u = rand_array(&rs, b * h * w, special);
      check_rowcol(u, b, h, w);
      /* non-negative inputs (g² + eps), as the optimizers pass */
      for (size_t i = 0; i < b * h * w; i++) u[i] = u[i] * u[i] + 1e-30f;
      check_rowcol(u, b, h, w);
      free(u);
    }
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_vectors),
      cmocka_unit_test(test_rowcol),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
