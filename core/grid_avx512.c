/* The exact dp sum's segment kernels on AVX-512 (F and DQ; core/grid.h,
 * docs/dp-sum.md "Fast paths"): the AVX2 kernels' formulations
 * (core/grid_avx2.c) at twice the width, with mask registers for the lane
 * tests and blends, native 64-bit arithmetic shifts, absolute values and
 * compares, and int64 → double conversion (exact: the converted values are
 * below 2^53). The same bytes as the portable kernels; selected at run time
 * before AVX2 where the CPU has AVX-512 F and DQ. */
#include "grid.h"

#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
#include <immintrin.h>

#define AVX512_FN __attribute__((target("avx512f,avx512dq")))
#define PORTABLE dopt__grid_kernels(DOPT_GRID_IMPL_PORTABLE)

/* rint(|x|·2^(W·K − top)) of 16 elements (fp32 bits u) before the final left
 * shift, as enc_q8 in core/grid_avx2.c: q (≤ 2^24, 0 for non-finite x) and
 * the left shift *l, so |v| = q·2^l. s0 = W·K − 24 − max(code,1). */
AVX512_FN static inline __m512i enc_q16(__m512i u, __m512i s0, __m512i *l) {
  const __m512i one = _mm512_set1_epi32(1), zero = _mm512_setzero_si512();
  const __m512i ex = _mm512_and_si512(_mm512_srli_epi32(u, 23), _mm512_set1_epi32(0xff));
  const __mmask16 fin = _mm512_cmplt_epi32_mask(ex, _mm512_set1_epi32(0xff));
  const __m512i m = _mm512_add_epi32(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffff)),
                                     _mm512_slli_epi32(_mm512_min_epi32(ex, one), 23)); /* the implicit bit */
  const __m512i s = _mm512_add_epi32(_mm512_max_epi32(ex, one), s0);
  /* common case: no nonzero element below the grid's unit */
  if (!(_mm512_test_epi32_mask(m, m) & _mm512_cmplt_epi32_mask(s, zero))) {
    *l = s;
    return _mm512_maskz_mov_epi32(fin, m);
  }
  const __m512i r = _mm512_min_epi32(_mm512_max_epi32(_mm512_sub_epi32(one, s), one), _mm512_set1_epi32(31));
  *l = _mm512_max_epi32(s, zero);
  const __m512i m2 = _mm512_slli_epi32(m, 1);
  const __m512i bias = _mm512_add_epi32(_mm512_sub_epi32(_mm512_sllv_epi32(one, _mm512_sub_epi32(r, one)), one),
                                        _mm512_and_si512(_mm512_srlv_epi32(m2, r), one));
  return _mm512_maskz_mov_epi32(fin, _mm512_srlv_epi32(_mm512_add_epi32(m2, bias), r)); /* 2m + bias < 2^31 */
}

/* w[0..8) (+)= v */
AVX512_FN static inline void put8(int64_t *w, int add, __m512i v) {
  _mm512_storeu_si512((void *)w, add ? _mm512_add_epi64(_mm512_loadu_si512((const void *)w), v) : v);
}

/* one word: v = ±q·2^l, |v| < 2^K; the sign applied in 32 bits, the shift in 64 */
AVX512_FN static void encode1_avx512(const float *x, size_t n, int32_t code, int k, int add, int64_t *w) {
  const __m512i s0 = _mm512_set1_epi32(k - 24 - (code > 1 ? code : 1));
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i u = _mm512_loadu_si512((const void *)(x + i));
    __m512i l;
    const __m512i q = enc_q16(u, s0, &l), neg = _mm512_srai_epi32(u, 31);
    const __m512i qs = _mm512_sub_epi32(_mm512_xor_si512(q, neg), neg);
    put8(w + i, add,
         _mm512_sllv_epi64(_mm512_cvtepi32_epi64(_mm512_castsi512_si256(qs)),
                           _mm512_cvtepu32_epi64(_mm512_castsi512_si256(l))));
    put8(w + i + 8, add,
         _mm512_sllv_epi64(_mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(qs, 1)),
                           _mm512_cvtepu32_epi64(_mm512_extracti64x4_epi64(l, 1))));
  }
  PORTABLE->encode(x + i, n - i, code, 1, k, add, w + i);
}

/* two words of 8 elements: hi = |v| >> K, lo = |v| mod 2^K with x's sign, interleaved per element into
 * w[0..16) */
AVX512_FN static inline void put_two8(int64_t *w, int add, __m256i q, __m256i l, __m256i ng, int k) {
  const __m512i zero = _mm512_setzero_si512();
  const __m512i qz = _mm512_cvtepu32_epi64(q), lz = _mm512_cvtepu32_epi64(l);
  const __mmask8 neg = _mm512_cmplt_epi64_mask(_mm512_cvtepi32_epi64(ng), zero);
  /* a shift either way; the other count is out of range and gives 0 */
  const __m512i a = _mm512_sub_epi64(lz, _mm512_set1_epi64(k));
  __m512i hi = _mm512_or_si512(_mm512_sllv_epi64(qz, a), _mm512_srlv_epi64(qz, _mm512_sub_epi64(zero, a)));
  __m512i lo = _mm512_and_si512(_mm512_sllv_epi64(qz, lz), _mm512_set1_epi64((int64_t)((UINT64_C(1) << k) - 1u)));
  hi = _mm512_mask_sub_epi64(hi, neg, zero, hi);
  lo = _mm512_mask_sub_epi64(lo, neg, zero, lo);
  put8(w, add, _mm512_permutex2var_epi64(hi, _mm512_set_epi64(11, 3, 10, 2, 9, 1, 8, 0), lo)); /* h0 l0 .. h3 l3 */
  put8(w + 8, add, _mm512_permutex2var_epi64(hi, _mm512_set_epi64(15, 7, 14, 6, 13, 5, 12, 4), lo));
}

AVX512_FN static void encode2_avx512(const float *x, size_t n, int32_t code, int k, int add, int64_t *w) {
  const __m512i s0 = _mm512_set1_epi32(2 * k - 24 - (code > 1 ? code : 1));
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i u = _mm512_loadu_si512((const void *)(x + i));
    __m512i l;
    const __m512i q = enc_q16(u, s0, &l), neg = _mm512_srai_epi32(u, 31);
    put_two8(w + 2 * i, add, _mm512_castsi512_si256(q), _mm512_castsi512_si256(l), _mm512_castsi512_si256(neg), k);
    put_two8(w + 2 * i + 16, add, _mm512_extracti64x4_epi64(q, 1), _mm512_extracti64x4_epi64(l, 1),
             _mm512_extracti64x4_epi64(neg, 1), k);
  }
  PORTABLE->encode(x + i, n - i, code, 2, k, add, w + 2 * i);
}

AVX512_FN static void encode_avx512(const float *x, size_t n, int32_t code, int words, int k, int add, int64_t *w) {
  if (words == 1) encode1_avx512(x, n, code, k, add, w);
  else encode2_avx512(x, n, code, k, add, w);
}

/* mag < 2^63 → fp32 of ±mag·2^esh (neg: the negative lanes; −250 ≤ esh ≤ 84) stored in x[0..8), as finish4 in
 * core/grid_avx2.c: from 2^52 on the low 11 bits are folded into a sticky bit, so the conversion to double is
 * exact, the power-of-two scaling too, and double → fp32 rounds once. */
AVX512_FN static inline void finish8(__m512i mag, __mmask8 neg, __m512i esh, float *x) {
  const __m512i one = _mm512_set1_epi64(1);
  const __mmask8 big = _mm512_cmpgt_epi64_mask(mag, _mm512_set1_epi64((INT64_C(1) << 52) - 1));
  const __mmask8 st = _mm512_test_epi64_mask(mag, _mm512_set1_epi64(2047));
  const __m512i folded = _mm512_mask_or_epi64(_mm512_srli_epi64(mag, 11), st, _mm512_srli_epi64(mag, 11), one);
  const __m512d d = _mm512_cvtepi64_pd(_mm512_mask_mov_epi64(mag, big, folded)); /* < 2^53: exact */
  const __m512i e = _mm512_mask_add_epi64(esh, big, esh, _mm512_set1_epi64(11));
  const __m512d p2 = _mm512_castsi512_pd(_mm512_slli_epi64(_mm512_add_epi64(e, _mm512_set1_epi64(1023)), 52));
  __m512i v = _mm512_castpd_si512(_mm512_mul_pd(d, p2));
  v = _mm512_mask_or_epi64(v, neg, v, _mm512_set1_epi64(INT64_MIN)); /* zero lanes: v = +0, neg clear */
  _mm256_storeu_ps(x, _mm512_cvtpd_ps(_mm512_castsi512_pd(v)));
}

/* one word: |Q| < 2^62 */
AVX512_FN static void decode1_avx512(const int64_t *w, size_t n, int32_t code, int k, float *x) {
  const __m512i esh = _mm512_set1_epi64(dopt_grid_top(code) - k); /* value = Q·2^e */
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m512i q = _mm512_loadu_si512((const void *)(w + i));
    finish8(_mm512_abs_epi64(q), _mm512_cmplt_epi64_mask(q, _mm512_setzero_si512()), esh, x + i);
  }
  PORTABLE->decode(w + i, n - i, code, 1, k, x + i);
}

/* two words: Q = hi·2^K + lo, the cases of decode2_avx2 */
AVX512_FN static void decode2_avx512(const int64_t *w, size_t n, int32_t code, int k, float *x) {
  const int64_t e = dopt_grid_top(code) - 2 * k; /* value = Q·2^e */
  const __m512i zero = _mm512_setzero_si512(), one = _mm512_set1_epi64(1);
  const __m512i kmask = _mm512_set1_epi64((int64_t)((UINT64_C(1) << k) - 1u));
  const __m512i low = _mm512_set1_epi64((int64_t)((UINT64_C(1) << (k - 26)) - 1u));
  const __m512i ih = _mm512_set_epi64(14, 12, 10, 8, 6, 4, 2, 0), il = _mm512_set_epi64(15, 13, 11, 9, 7, 5, 3, 1);
  const __m512i ea = _mm512_set1_epi64(e), eb = _mm512_set1_epi64(e + k - 26), ec = _mm512_set1_epi64(e + k - 1);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m512i p0 = _mm512_loadu_si512((const void *)(w + 2 * i));
    const __m512i p1 = _mm512_loadu_si512((const void *)(w + 2 * i + 8));
    __m512i hi = _mm512_permutex2var_epi64(p0, ih, p1), lo = _mm512_permutex2var_epi64(p0, il, p1);
    /* carry: lo = c·2^K + lo' with 0 ≤ lo' < 2^K */
    hi = _mm512_add_epi64(hi, _mm512_srai_epi64(lo, (unsigned)k));
    lo = _mm512_and_si512(lo, kmask);
    /* |Q| = mh·2^K + ml: for Q < 0 (hi < 0), (−hi − 1, 2^K − lo) when lo > 0 */
    const __mmask8 neg = _mm512_cmplt_epi64_mask(hi, zero), lnz = _mm512_test_epi64_mask(lo, lo);
    const __m512i mh = _mm512_mask_sub_epi64(_mm512_abs_epi64(hi), neg & lnz, _mm512_abs_epi64(hi), one);
    const __m512i ml = _mm512_mask_and_epi64(lo, neg, _mm512_sub_epi64(zero, lo), kmask);
    /* mh = 0: ml itself; mh < 2^25: bits from K−25 up, sticky at K−26; else 2·mh with ml's sticky */
    const __m512i top = _mm512_or_si512(_mm512_slli_epi64(mh, 26), _mm512_srli_epi64(ml, (unsigned)(k - 26)));
    const __m512i mb = _mm512_mask_or_epi64(top, _mm512_test_epi64_mask(ml, low), top, one);
    const __m512i mc = _mm512_mask_or_epi64(_mm512_slli_epi64(mh, 1), lnz, _mm512_slli_epi64(mh, 1), one);
    const __mmask8 ca = _mm512_testn_epi64_mask(mh, mh);
    const __mmask8 cc = _mm512_cmpgt_epi64_mask(mh, _mm512_set1_epi64((1 << 25) - 1));
    const __m512i mag = _mm512_mask_mov_epi64(_mm512_mask_mov_epi64(mb, ca, ml), cc, mc);
    const __m512i esh = _mm512_mask_mov_epi64(_mm512_mask_mov_epi64(eb, ca, ea), cc, ec);
    finish8(mag, neg, esh, x + i);
  }
  PORTABLE->decode(w + 2 * i, n - i, code, 2, k, x + i);
}

AVX512_FN static void decode_avx512(const int64_t *w, size_t n, int32_t code, int words, int k, float *x) {
  if (words == 1) decode1_avx512(w, n, code, k, x);
  else decode2_avx512(w, n, code, k, x);
}

/* The block code (the largest finite abs bits' code), the non-finite count, and the smallest exponent field
 * of a nonzero finite element (dopt__grid_kern.code_min) */
AVX512_FN static int32_t code_min_avx512(const float *x, size_t n, int64_t *nonfinite, int32_t *cmin) {
  const __m512i absm = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000), one = _mm512_set1_epi32(1);
  __m512i mx = _mm512_setzero_si512(), mn = _mm512_set1_epi32(-1), nb = _mm512_setzero_si512();
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i a = _mm512_and_si512(_mm512_loadu_si512((const void *)(x + i)), absm);
    const __mmask16 fin = _mm512_cmplt_epu32_mask(a, inf);
    mx = _mm512_mask_max_epu32(mx, fin, mx, a);
    mn = _mm512_mask_min_epu32(mn, fin & _mm512_test_epi32_mask(a, a), mn, a);
    nb = _mm512_mask_add_epi32(nb, (__mmask16)~fin, nb, one);
  }
  *nonfinite += (int64_t)(uint32_t)_mm512_reduce_add_epi32(nb);
  const int32_t e = (int32_t)((uint32_t)_mm512_reduce_min_epu32(mn) >> 23); /* none: 0x1ff */
  if (e < *cmin) *cmin = e;
  const int32_t cv = dopt_grid_code_of_abs((uint32_t)_mm512_reduce_max_epu32(mx));
  const int32_t ct = dopt__grid_code_min(x + i, n - i, nonfinite, cmin);
  return cv > ct ? cv : ct;
}

/* the block code alone (dopt__grid_kern.code): code_min's loop, its minimum unused */
AVX512_FN static int32_t code_avx512(const float *x, size_t n, int64_t *nonfinite) {
  int32_t cmin = 0xff;
  return code_min_avx512(x, n, nonfinite, &cmin);
}

/* out[i] = (float)(+0.0 + Σ_d parts[d][lo + i]) in double, an exact zero as +0 (the caller checked that every
 * addition is exact) */
AVX512_FN static void sum_double_avx512(const float *const *parts, int np, size_t lo, size_t n, float *out) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512d a0 = _mm512_setzero_pd(), a1 = _mm512_setzero_pd();
    for (int d = 0; d < np; d++) {
      const __m512 v = _mm512_loadu_ps(parts[d] + lo + i);
      a0 = _mm512_add_pd(a0, _mm512_cvtps_pd(_mm512_castps512_ps256(v)));
      a1 = _mm512_add_pd(a1, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))));
    }
    const __m512 r = _mm512_insertf32x8(_mm512_castps256_ps512(_mm512_cvtpd_ps(a0)), _mm512_cvtpd_ps(a1), 1);
    const __m512i b = _mm512_castps_si512(r);
    const __mmask16 nz = _mm512_test_epi32_mask(b, _mm512_set1_epi32(0x7fffffff)); /* −0 → +0 */
    _mm512_storeu_si512((void *)(out + i), _mm512_maskz_mov_epi32(nz, b));
  }
  dopt__grid_sum_double(parts, np, lo + i, n - i, out + i);
}

static const dopt__grid_kern kern_avx512 = {code_avx512, encode_avx512, decode_avx512, code_min_avx512,
                                            sum_double_avx512};

/* Read-only after libgcc's constructor ran: safe from any thread. */
const dopt__grid_kern *dopt__grid_kern_avx512(void) {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") ? &kern_avx512 : NULL;
}

#else
const dopt__grid_kern *dopt__grid_kern_avx512(void) { return NULL; }
#endif
