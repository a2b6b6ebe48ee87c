/* Exact, order-independent sums: see include/distopt/xsum.h and
 * docs/exact-reductions.md. */
#include "distopt/xsum.h"

#include <math.h>

enum { W_HI = 0, W_LO = 1, W_NAN = 2, W_PINF = 3, W_NINF = 4 };

double dopt_xsum_scale(double absmax) {
  if (!(absmax > 0.0) || !isfinite(absmax)) return 1.0;
  int e;
  (void)frexp(absmax, &e); /* absmax < 2^e */
  /* |x|·2^(62-e) < 2^62: rint cannot overflow int64, and the 32-bit halves
   * leave headroom for 2^32 additions (see header). */
  return ldexp(1.0, 62 - e);
}

static inline void add_scaled(dopt_xacc *a, double scale, double x) {
  if (!isfinite(x)) {
    a->w[isnan(x) ? W_NAN : (x > 0 ? W_PINF : W_NINF)] += 1;
    return;
  }
  /* x·scale is exact (power of two, no overflow for finite fp32-derived x). */
  int64_t q = (int64_t)rint(x * scale);
  uint64_t uq = (uint64_t)q;
  int64_t lo = (int64_t)(uq & 0xffffffffu);
  a->w[W_HI] += (q - lo) / 4294967296; /* exact: q - lo is a multiple of 2^32 */
  a->w[W_LO] += lo;
}

void dopt_xacc_add(dopt_xacc *acc, double scale, double x) { add_scaled(acc, scale, x); }

void dopt_xacc_add_n(dopt_xacc *acc, double scale, const float *x, size_t n, size_t stride) {
  for (size_t i = 0; i < n; i++) add_scaled(acc, scale, (double)x[i * stride]);
}

void dopt_xacc_add_sq_n(dopt_xacc *acc, double scale, const float *x, size_t n) {
  for (size_t i = 0; i < n; i++) {
    double v = (double)x[i];
    add_scaled(acc, scale, v * v); /* fp32·fp32 is exact in double */
  }
}

void dopt_xacc_merge(dopt_xacc *acc, const dopt_xacc *other) {
  for (int i = 0; i < DOPT_XSUM_WORDS; i++) acc->w[i] += other->w[i];
}

double dopt_xacc_value(const dopt_xacc *acc, double scale) {
  if (acc->w[W_NAN] > 0 || (acc->w[W_PINF] > 0 && acc->w[W_NINF] > 0)) return NAN;
  if (acc->w[W_PINF] > 0) return INFINITY;
  if (acc->w[W_NINF] > 0) return -INFINITY;
  /* carry-normalise so that (hi, lo) is the unique representation with
   * 0 <= lo < 2^32: the double conversion below then depends only on the
   * integer total, never on how it was accumulated. */
  int64_t lo = acc->w[W_LO];
  int64_t lo_low = (int64_t)((uint64_t)lo & 0xffffffffu);
  int64_t hi = acc->w[W_HI] + (lo - lo_low) / 4294967296;
  double v = (double)hi * 4294967296.0 + (double)lo_low;
  return v / scale; /* exact power-of-two scaling (barring subnormal results) */
}

double dopt_absmax(const float *x, size_t n, size_t stride) {
  float m = 0.0f;
  for (size_t i = 0; i < n; i++) {
    float a = fabsf(x[i * stride]);
    if (a > m && a <= 3.4028234664e38f) m = a; /* finite only; NaN compares false */
  }
  return (double)m;
}

double dopt_xsum(const float *x, size_t n) {
  double scale = dopt_xsum_scale(dopt_absmax(x, n, 1));
  dopt_xacc a = {{0}};
  dopt_xacc_add_n(&a, scale, x, n, 1);
  return dopt_xacc_value(&a, scale);
}

double dopt_xsum_sq(const float *x, size_t n) {
  double m = dopt_absmax(x, n, 1);
  double scale = dopt_xsum_scale(m * m);
  dopt_xacc a = {{0}};
  dopt_xacc_add_sq_n(&a, scale, x, n);
  return dopt_xacc_value(&a, scale);
}
