/* Exact, order-independent sums: see include/distopt/xsum.h and
 * docs/exact-reductions.md. */
#include "distopt/xsum.h"

#include "elem.h"
#include "xsum_fast.h"

#include <math.h>

enum { W_HI = DOPT_XW_HI, W_LO = DOPT_XW_LO, W_NAN = DOPT_XW_NAN, W_PINF = DOPT_XW_PINF, W_NINF = DOPT_XW_NINF };

/* The words of one value and the value of the words are core/elem.h's (the CUDA kernels' too). */
double dopt_xsum_scale(double absmax) { return dopt_xsum_scale_of(absmax); }

static inline void add_scaled(dopt_xacc *a, double scale, double x) {
  const int k = dopt_xsum_class(x);
  if (k >= 0) {
    a->w[k] += 1;
    return;
  }
  int64_t hi, lo; /* lo ∈ [-2^31, 2^31): 2^32 - 1 of them cannot overflow */
  dopt_xsum_split(scale, x, &hi, &lo);
  a->w[W_HI] += hi;
  a->w[W_LO] += lo;
}

void dopt_xacc_add(dopt_xacc *acc, double scale, double x) { add_scaled(acc, scale, x); }

/* ---- fast paths (core/xsum_fast.h) ---------------------------------------------
 * The per-element definition above, restated in double arithmetic that a
 * vector unit executes without integer conversions: for finite v = x·scale
 * with |v| < 2^63,
 *   q = rint(v)                 (exact integer, |q| < 2^63)
 *   h = (q + C) − C             (C = 1.5·2^84: q rounded to a multiple of 2^32, exact)
 *   l = q − h                   (exact: an integer with |l| <= 2^31)
 * so q = h + l. This splits q as the definition does except at a tie
 * (q ≡ 2^31 mod 2^32, where h may round down and l be +2^31): the words
 * differ there, their total (hi·2^32 + lo, what dopt_xacc_value reads after
 * carry normalisation) never does, nor do the words' bounds. Sums of h
 * (multiples of 2^32, |h| <= 2^63) and of l over at most XBLOCK elements stay
 * exact in double (below 2^85, resp. 2^50), so the lane sums are the integer
 * sums in any order; they are converted to int64 words per block. A block
 * with a non-finite value (its sums become inf/NaN) or with |q| >= 2^63 (only
 * possible with a scale smaller than dopt_xsum_scale(absmax) asks for) is
 * redone with the per-element definition. */
#define XBLOCK ((size_t)1 << 18)

static void add_run_scalar(dopt_xacc *acc, double scale, const float *x, size_t n, int sq) {
  dopt_xacc a = *acc; /* local copy: keeps the words in registers */
  for (size_t i = 0; i < n; i++) {
    double v = (double)x[i];
    add_scaled(&a, scale, sq ? dopt_square_d(v) : v);
  }
  *acc = a;
}

/* The column scratch over x[j0, n), portably: sh[j] += hi·2^32 (as the vector
 * lanes keep it), sl[j] += lo, the words of x[j]·cs[j] as the definition
 * splits them; returns max(r, the largest |q|). */
static double colsum_portable(double *sh, double *sl, const double *cs, const float *x, size_t j0, size_t n,
                              double r) {
  for (size_t j = j0; j < n; j++) {
    double q = rint((double)x[j] * cs[j]), h = floor(q * 0x1p-32), l = q - h * 0x1p32;
    if (l >= 0x1p31) l -= 0x1p32, h += 1.0;
    sh[j] += h * 0x1p32;
    sl[j] += l;
    r = fabs(q) > r ? fabs(q) : r;
  }
  return r;
}

#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
#include <immintrin.h>
#define DOPT_HAVE_AVX_PATH 1

/* Read-only after libgcc's constructor ran: safe from any thread (no static
 * cache here: every rank thread calls this). */
static int have_avx(void) { return __builtin_cpu_supports("avx") != 0; }

#define ROUND_CUR (_MM_FROUND_CUR_DIRECTION)

/* q = h + l: h a multiple of 2^32 (round to nearest), |l| <= 2^31 (exact double ops) */
__attribute__((target("avx"))) static inline void split_words(__m256d q, __m256d *h, __m256d *l) {
  const __m256d c = _mm256_set1_pd(0x1.8p84);
  *h = _mm256_sub_pd(_mm256_add_pd(q, c), c);
  *l = _mm256_sub_pd(q, *h);
}

/* h, l sums of one contiguous block (n ≤ XBLOCK); returns 0 and the words,
 * or 1 if the block must be redone per element. */
__attribute__((target("avx"))) static int run_block_avx(double scale, const float *x, size_t n, int sq,
                                                        int64_t *hi, int64_t *lo) {
  const __m256d s = _mm256_set1_pd(scale), sign = _mm256_set1_pd(-0.0);
  __m256d sh0 = _mm256_setzero_pd(), sl0 = sh0, sh1 = sh0, sl1 = sh0, mx = sh0;
  size_t i = 0;
  float tail[8];
  for (;;) {
    const float *p = x + i;
    if (i + 8 > n) {
      if (i >= n) break;
      size_t r = n - i;
      for (size_t j = 0; j < 8; j++) tail[j] = j < r ? x[i + j] : 0.0f; /* zeros add 0 to both words */
      p = tail;
    }
    __m256d v0 = _mm256_cvtps_pd(_mm_loadu_ps(p)), v1 = _mm256_cvtps_pd(_mm_loadu_ps(p + 4));
    if (sq) {
      v0 = _mm256_mul_pd(v0, v0);
      v1 = _mm256_mul_pd(v1, v1);
    }
    __m256d q0 = _mm256_round_pd(_mm256_mul_pd(v0, s), ROUND_CUR);
    __m256d q1 = _mm256_round_pd(_mm256_mul_pd(v1, s), ROUND_CUR);
    __m256d h0, h1, l0, l1;
    split_words(q0, &h0, &l0);
    split_words(q1, &h1, &l1);
    sl0 = _mm256_add_pd(sl0, l0);
    sl1 = _mm256_add_pd(sl1, l1);
    sh0 = _mm256_add_pd(sh0, h0);
    sh1 = _mm256_add_pd(sh1, h1);
    mx = _mm256_max_pd(mx, _mm256_max_pd(_mm256_andnot_pd(sign, q0), _mm256_andnot_pd(sign, q1)));
    i += 8;
  }
  double a[4], b[4], c[4], d[4], m[4];
  _mm256_storeu_pd(a, sh0);
  _mm256_storeu_pd(b, sh1);
  _mm256_storeu_pd(c, sl0);
  _mm256_storeu_pd(d, sl1);
  _mm256_storeu_pd(m, mx);
  int64_t h = 0, l = 0;
  for (int j = 0; j < 4; j++) {
    /* non-finite input: inf/NaN sums; out of range: |q| ≥ 2^63 */
    if (!(a[j] - a[j] == 0.0 && b[j] - b[j] == 0.0 && c[j] - c[j] == 0.0 && d[j] - d[j] == 0.0)) return 1;
    if (!(m[j] < 0x1p63)) return 1;
    h += (int64_t)(a[j] * 0x1p-32) + (int64_t)(b[j] * 0x1p-32); /* exact: multiples of 2^32 below 2^85 */
    l += (int64_t)c[j] + (int64_t)d[j];
  }
  *hi = h;
  *lo = l;
  return 0;
}

/* One row x[0..n) into the column scratch: sh[j], sl[j] += the words of x[j]
 * at scale cs[j]. The caller checked that every x[j] is finite; returns the
 * max |q| (>= 2^63: the scale was too small for the data). */
__attribute__((target("avx"))) static double colsum_row_avx(double *sh, double *sl, const double *cs, const float *x,
                                                            size_t n) {
  const __m256d sign = _mm256_set1_pd(-0.0);
  __m256d mx = _mm256_setzero_pd();
  size_t j = 0;
  for (; j + 4 <= n; j += 4) {
    __m256d q = _mm256_round_pd(_mm256_mul_pd(_mm256_cvtps_pd(_mm_loadu_ps(x + j)), _mm256_loadu_pd(cs + j)),
                                ROUND_CUR), h, l;
    split_words(q, &h, &l);
    _mm256_storeu_pd(sl + j, _mm256_add_pd(_mm256_loadu_pd(sl + j), l));
    _mm256_storeu_pd(sh + j, _mm256_add_pd(_mm256_loadu_pd(sh + j), h));
    mx = _mm256_max_pd(mx, _mm256_andnot_pd(sign, q));
  }
  double m[4], r = 0.0;
  _mm256_storeu_pd(m, mx);
  for (int t = 0; t < 4; t++) r = m[t] > r ? m[t] : r;
  return colsum_portable(sh, sl, cs, x, j, n, r); /* the tail */
}
#endif

void dopt__xacc_add_run(dopt_xacc *acc, double scale, const float *x, size_t n, int sq) {
#ifdef DOPT_HAVE_AVX_PATH
  if (have_avx()) {
    for (size_t i = 0; i < n; i += XBLOCK) {
      size_t m = n - i < XBLOCK ? n - i : XBLOCK;
      int64_t h, l;
      if (run_block_avx(scale, x + i, m, sq, &h, &l) == 0) {
        /* unsigned: the words wrap as the per-element int64 additions do */
        acc->w[W_HI] = (int64_t)((uint64_t)acc->w[W_HI] + (uint64_t)h);
        acc->w[W_LO] = (int64_t)((uint64_t)acc->w[W_LO] + (uint64_t)l);
      } else {
        add_run_scalar(acc, scale, x + i, m, sq);
      }
    }
    return;
  }
#endif
  add_run_scalar(acc, scale, x, n, sq);
}

#ifdef DOPT_HAVE_AVX_PATH
__attribute__((target("avx"))) static int all_finite_avx(const float *x, size_t n) {
  const __m256 sign = _mm256_set1_ps(-0.0f), big = _mm256_set1_ps(3.4028234664e38f);
  __m256 ok = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
  size_t i = 0;
  for (; i + 8 <= n; i += 8) /* |x| <= FLT_MAX: false for ±inf and NaN */
    ok = _mm256_and_ps(ok, _mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)), big, _CMP_LE_OQ));
  if (_mm256_movemask_ps(ok) != 0xff) return 0;
  for (; i < n; i++)
    if (!isfinite(x[i])) return 0;
  return 1;
}
#endif

static int all_finite(const float *x, size_t n) {
#ifdef DOPT_HAVE_AVX_PATH
  if (have_avx()) return all_finite_avx(x, n);
#endif
  for (size_t i = 0; i < n; i++)
    if (!isfinite(x[i])) return 0;
  return 1;
}

/* The column scratch (the same double formulation as the vector kernels,
 * portable where there is no AVX): a row is added only when all of it is
 * finite, so a row that is not leaves the scratch untouched. */
int dopt__colsum_row(double *sh, double *sl, const double *cs, const float *x, size_t n) {
  if (!all_finite(x, n)) return 1;
  double r = 0.0;
#ifdef DOPT_HAVE_AVX_PATH
  if (have_avx()) {
    r = colsum_row_avx(sh, sl, cs, x, n);
    return r < 0x1p63 ? 0 : -1;
  }
#endif
  r = colsum_portable(sh, sl, cs, x, 0, n, r);
  return r < 0x1p63 ? 0 : -1;
}

void dopt__colsum_flush(dopt_xacc *cacc, double *sh, double *sl, size_t n) {
  for (size_t j = 0; j < n; j++) {
    cacc[j].w[W_HI] = (int64_t)((uint64_t)cacc[j].w[W_HI] + (uint64_t)(int64_t)(sh[j] * 0x1p-32));
    cacc[j].w[W_LO] = (int64_t)((uint64_t)cacc[j].w[W_LO] + (uint64_t)(int64_t)sl[j]);
    sh[j] = sl[j] = 0.0;
  }
}

void dopt_xacc_add_n(dopt_xacc *acc, double scale, const float *x, size_t n, size_t stride) {
  if (stride == 1) {
    dopt__xacc_add_run(acc, scale, x, n, 0);
    return;
  }
  dopt_xacc a = *acc;
  for (size_t i = 0; i < n; i++) add_scaled(&a, scale, (double)x[i * stride]);
  *acc = a;
}

void dopt_xacc_add_sq_n(dopt_xacc *acc, double scale, const float *x, size_t n) {
  dopt__xacc_add_run(acc, scale, x, n, 1);
}

/* ---- maxima ------------------------------------------------------------------------ */

#ifdef DOPT_HAVE_AVX_PATH
__attribute__((target("avx"))) static float absmax_avx(const float *x, size_t n) {
  const __m256 sign = _mm256_set1_ps(-0.0f), big = _mm256_set1_ps(3.4028234664e38f);
  __m256 m0 = _mm256_setzero_ps(), m1 = m0;
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m256 a0 = _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)), a1 = _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i + 8));
    /* non-finite (|x| > FLT_MAX or NaN: the ordered compare is false) -> 0 */
    a0 = _mm256_and_ps(a0, _mm256_cmp_ps(a0, big, _CMP_LE_OQ));
    a1 = _mm256_and_ps(a1, _mm256_cmp_ps(a1, big, _CMP_LE_OQ));
    m0 = _mm256_max_ps(m0, a0);
    m1 = _mm256_max_ps(m1, a1);
  }
  float t[8];
  _mm256_storeu_ps(t, _mm256_max_ps(m0, m1));
  float m = 0.0f;
  for (int j = 0; j < 8; j++) m = t[j] > m ? t[j] : m;
  for (; i < n; i++) {
    float a = fabsf(x[i]);
    if (a > m && a <= 3.4028234664e38f) m = a;
  }
  return m;
}

__attribute__((target("avx"))) static float absmax_row_cols_avx(const float *r, size_t w, float *cmax) {
  const __m256 sign = _mm256_set1_ps(-0.0f), big = _mm256_set1_ps(3.4028234664e38f);
  __m256 m0 = _mm256_setzero_ps();
  size_t j = 0;
  for (; j + 8 <= w; j += 8) {
    __m256 a = _mm256_andnot_ps(sign, _mm256_loadu_ps(r + j));
    a = _mm256_and_ps(a, _mm256_cmp_ps(a, big, _CMP_LE_OQ));
    m0 = _mm256_max_ps(m0, a);
    _mm256_storeu_ps(cmax + j, _mm256_max_ps(_mm256_loadu_ps(cmax + j), a));
  }
  float t[8];
  _mm256_storeu_ps(t, m0);
  float m = 0.0f;
  for (int k = 0; k < 8; k++) m = t[k] > m ? t[k] : m;
  for (; j < w; j++) {
    float a = fabsf(r[j]);
    if (!(a <= 3.4028234664e38f)) continue;
    m = a > m ? a : m;
    cmax[j] = a > cmax[j] ? a : cmax[j];
  }
  return m;
}
#endif

float dopt__absmax_run(const float *x, size_t n) {
#ifdef DOPT_HAVE_AVX_PATH
  if (have_avx()) return absmax_avx(x, n);
#endif
  float m = 0.0f;
  for (size_t i = 0; i < n; i++) {
    float a = fabsf(x[i]);
    if (a > m && a <= 3.4028234664e38f) m = a;
  }
  return m;
}

float dopt__absmax_row_cols(const float *r, size_t w, float *cmax) {
#ifdef DOPT_HAVE_AVX_PATH
  if (have_avx()) return absmax_row_cols_avx(r, w, cmax);
#endif
  float m = 0.0f;
  for (size_t j = 0; j < w; j++) {
    float a = fabsf(r[j]);
    if (!(a <= 3.4028234664e38f)) continue;
    m = a > m ? a : m;
    cmax[j] = a > cmax[j] ? a : cmax[j];
  }
  return m;
}

void dopt_xacc_merge(dopt_xacc *acc, const dopt_xacc *other) {
  for (int i = 0; i < DOPT_XSUM_WORDS; i++) acc->w[i] += other->w[i];
}

double dopt_xacc_value(const dopt_xacc *acc, double scale) { return dopt_xsum_value_of(acc->w, scale); }

double dopt_absmax(const float *x, size_t n, size_t stride) {
  if (stride == 1) return (double)dopt__absmax_run(x, n);
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
