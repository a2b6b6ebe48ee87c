/* The exact dp sum's segment kernels on AVX2 (core/grid.h, docs/dp-sum.md
 * "Fast paths"): the same bytes as the portable kernels, which call the
 * element functions of core/grid.h. Selected at run time where the CPU has
 * AVX2. Formulations (no double → int64 conversion, which AVX2 lacks):
 *
 * code    The block's largest finite |x| as abs bits (a MAX of uint32), then
 *         dopt_grid_code_of_abs: 8 lanes.
 * encode  Integer only, 8 lanes of int32, the words in 4 lanes of int64.
 *         x = ±m·2^(max(ex,1) − 150) with the 24-bit significand m, so
 *         x·2^(W·K − top) = ±m·2^s with s = max(ex,1) + W·K − 24 − max(code,1).
 *         For s ≥ 0 the word is m << s (s ≤ W·K − 24, below 2^(W·K)); for
 *         s < 0 it is m >> −s rounded to nearest-even: (2m + 2^(r−1) − 1 +
 *         bit r of 2m) >> r with r = 1 − s clamped to [1, 31] (from 26 on the
 *         word is 0 either way); 8 elements all with s ≥ 0 (the common case)
 *         skip the rounding. That is rint(x·2^(W·K − top)), the portable
 *         value, exactly. Two words: hi = |v| >> K and lo = |v| mod 2^K, each
 *         with x's sign (trunc and the remainder, as the portable split).
 * decode  The summed words as a magnitude below 2^63 that rounds to fp32
 *         like |Q| (one word: |Q|; two words: carried to 0 ≤ lo < 2^K, negated
 *         as a pair, then 2·hi plus a sticky bit for lo, or hi's bits with
 *         lo's top 26 and a sticky bit, or lo alone, by the size of hi), with
 *         its low 11 bits folded into a sticky bit from 2^52 on so it
 *         converts to double exactly (the 2^52 bit-pattern trick), scaled by
 *         a power of two (exact in double), then double → fp32 rounds once,
 *         nearest-even: the folded bits lie below fp32's guard bit at every
 *         magnitude, subnormal results included, so this is the correctly
 *         rounded value, as the portable decode's. */
#include "grid.h"

#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
#include <immintrin.h>

#define AVX2_FN __attribute__((target("avx2")))
/* the tails (fewer than a vector's elements) go through the portable kernels */
#define PORTABLE dopt__grid_kernels(DOPT_GRID_IMPL_PORTABLE)

/* rint(|x|·2^(W·K − top)) of 8 elements (fp32 bits u) before the final
 * left shift: returns q (int32 lanes, ≤ 2^24, 0 for non-finite x) and *l,
 * the left shift (l ≤ W·K − 24; any value where q = 0), so |v| = q·2^l. s0 = W·K − 24 −
 * max(code,1). */
AVX2_FN static inline __m256i enc_q8(__m256i u, __m256i s0, __m256i *l) {
  const __m256i one = _mm256_set1_epi32(1), zero = _mm256_setzero_si256();
  const __m256i ex = _mm256_and_si256(_mm256_srli_epi32(u, 23), _mm256_set1_epi32(0xff));
  const __m256i fin = _mm256_cmpgt_epi32(_mm256_set1_epi32(0xff), ex);
  const __m256i m = _mm256_add_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffff)),
                                     _mm256_slli_epi32(_mm256_min_epi32(ex, one), 23)); /* the implicit bit */
  const __m256i s = _mm256_add_epi32(_mm256_max_epi32(ex, one), s0);
  /* common case: no nonzero element below 2^(W·K − 24) of the grid's unit
   * (zeros have any s: their q is 0 whatever the shift) */
  if (!_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_andnot_si256(_mm256_cmpeq_epi32(m, zero), s)))) {
    *l = s;
    return _mm256_and_si256(m, fin);
  }
  /* right shift r = 1 − s of 2m, clamped to [1, 31] (m < 2^24: from 26 on the result is 0) */
  const __m256i r = _mm256_min_epi32(_mm256_max_epi32(_mm256_sub_epi32(one, s), one), _mm256_set1_epi32(31));
  *l = _mm256_max_epi32(s, zero);
  const __m256i m2 = _mm256_slli_epi32(m, 1);
  const __m256i bias = _mm256_add_epi32(_mm256_sub_epi32(_mm256_sllv_epi32(one, _mm256_sub_epi32(r, one)), one),
                                        _mm256_and_si256(_mm256_srlv_epi32(m2, r), one));
  return _mm256_and_si256(_mm256_srlv_epi32(_mm256_add_epi32(m2, bias), r), fin); /* 2m + bias < 2^31 */
}

AVX2_FN static inline __m256i apply_sign(__m256i v, __m256i neg) {
  return _mm256_sub_epi64(_mm256_xor_si256(v, neg), neg);
}

/* w[0..4) (+)= v */
AVX2_FN static inline void put4(int64_t *w, int add, __m256i v) {
  __m256i *o = (__m256i *)(void *)w;
  _mm256_storeu_si256(o, add ? _mm256_add_epi64(_mm256_loadu_si256(o), v) : v);
}

/* two words of 4 elements: hi = |v| >> K, lo = |v| mod 2^K with x's sign,
 * interleaved per element into w[0..8) */
AVX2_FN static inline void put_two4(int64_t *w, int add, __m128i q, __m128i l, __m128i ng, int k) {
  const __m256i zero = _mm256_setzero_si256();
  const __m256i qz = _mm256_cvtepu32_epi64(q), lz = _mm256_cvtepu32_epi64(l), neg = _mm256_cvtepi32_epi64(ng);
  /* a shift either way; the other count is out of range and gives 0 */
  const __m256i a = _mm256_sub_epi64(lz, _mm256_set1_epi64x(k));
  const __m256i hi = apply_sign(_mm256_or_si256(_mm256_sllv_epi64(qz, a), _mm256_srlv_epi64(qz, _mm256_sub_epi64(zero, a))), neg);
  const __m256i lo = apply_sign(
      _mm256_and_si256(_mm256_sllv_epi64(qz, lz), _mm256_set1_epi64x((int64_t)((UINT64_C(1) << k) - 1u))), neg);
  const __m256i p = _mm256_unpacklo_epi64(hi, lo), b = _mm256_unpackhi_epi64(hi, lo);
  put4(w, add, _mm256_permute2x128_si256(p, b, 0x20)); /* [h0 l0 h1 l1] */
  put4(w + 4, add, _mm256_permute2x128_si256(p, b, 0x31));
}

/* one word: v = ±q·2^l, |v| < 2^K; the sign applied in 32 bits, the shift in 64 */
AVX2_FN static void encode1_avx2(const float *x, size_t n, int32_t code, int k, int add, int64_t *w) {
  const __m256i s0 = _mm256_set1_epi32(k - 24 - (code > 1 ? code : 1));
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i u = _mm256_loadu_si256((const __m256i *)(const void *)(x + i));
    __m256i l;
    const __m256i q = enc_q8(u, s0, &l), neg = _mm256_srai_epi32(u, 31);
    const __m256i qs = _mm256_sub_epi32(_mm256_xor_si256(q, neg), neg);
    put4(w + i, add,
         _mm256_sllv_epi64(_mm256_cvtepi32_epi64(_mm256_castsi256_si128(qs)),
                           _mm256_cvtepu32_epi64(_mm256_castsi256_si128(l))));
    put4(w + i + 4, add,
         _mm256_sllv_epi64(_mm256_cvtepi32_epi64(_mm256_extracti128_si256(qs, 1)),
                           _mm256_cvtepu32_epi64(_mm256_extracti128_si256(l, 1))));
  }
  PORTABLE->encode(x + i, n - i, code, 1, k, add, w + i);
}

AVX2_FN static void encode2_avx2(const float *x, size_t n, int32_t code, int k, int add, int64_t *w) {
  const __m256i s0 = _mm256_set1_epi32(2 * k - 24 - (code > 1 ? code : 1));
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i u = _mm256_loadu_si256((const __m256i *)(const void *)(x + i));
    __m256i l;
    const __m256i q = enc_q8(u, s0, &l), neg = _mm256_srai_epi32(u, 31);
    put_two4(w + 2 * i, add, _mm256_castsi256_si128(q), _mm256_castsi256_si128(l), _mm256_castsi256_si128(neg), k);
    put_two4(w + 2 * i + 8, add, _mm256_extracti128_si256(q, 1), _mm256_extracti128_si256(l, 1),
             _mm256_extracti128_si256(neg, 1), k);
  }
  PORTABLE->encode(x + i, n - i, code, 2, k, add, w + 2 * i);
}

AVX2_FN static void encode_avx2(const float *x, size_t n, int32_t code, int words, int k, int add, int64_t *w) {
  if (words == 1) encode1_avx2(x, n, code, k, add, w);
  else encode2_avx2(x, n, code, k, add, w);
}

/* v (0 ≤ v < 2^63) exactly as double: below 2^52 by the bit-pattern trick;
 * from 2^52 on, its low 11 bits folded into a sticky bit first (*big: all
 * ones there; the double is then v's folded value / 2^11) */
AVX2_FN static inline __m256d to_double_sticky(__m256i v, __m256i *big) {
  const __m256i one = _mm256_set1_epi64x(1), zero = _mm256_setzero_si256();
  *big = _mm256_cmpgt_epi64(v, _mm256_set1_epi64x((INT64_C(1) << 52) - 1));
  const __m256i st = _mm256_and_si256(_mm256_cmpgt_epi64(_mm256_and_si256(v, _mm256_set1_epi64x(2047)), zero), one);
  const __m256i c = _mm256_blendv_epi8(v, _mm256_or_si256(_mm256_srli_epi64(v, 11), st), *big); /* < 2^52 */
  const __m256i magic = _mm256_set1_epi64x(INT64_C(0x4330000000000000)); /* 2^52 */
  return _mm256_sub_pd(_mm256_castsi256_pd(_mm256_or_si256(c, magic)), _mm256_castsi256_pd(magic));
}

/* 2^e per lane, e a small int64 per lane (−1022 ≤ e ≤ 1023) */
AVX2_FN static inline __m256d pow2_lanes(__m256i e) {
  return _mm256_castsi256_pd(_mm256_slli_epi64(_mm256_add_epi64(e, _mm256_set1_epi64x(1023)), 52));
}

/* mag < 2^63 → fp32 of ±mag·2^esh (sign: neg, all ones; esh per lane, −250
 * ≤ esh ≤ 84), stored in x[0..4). The folded magnitude scaled by 2^esh is
 * exact in double (at least 2^−250: a normal double); double → fp32 is then
 * the one rounding, correct for normal and subnormal results and overflowing
 * to inf as rounding asks, because the folded bits sit below fp32's guard bit
 * at any magnitude. */
AVX2_FN static inline void finish4(__m256i mag, __m256i neg, __m256i esh, float *x) {
  __m256i big;
  const __m256d d = to_double_sticky(mag, &big);
  const __m256d v = _mm256_mul_pd(d, pow2_lanes(_mm256_add_epi64(esh, _mm256_and_si256(big, _mm256_set1_epi64x(11)))));
  const __m256d sgn = _mm256_and_pd(_mm256_castsi256_pd(neg), _mm256_set1_pd(-0.0));
  _mm_storeu_ps(x, _mm256_cvtpd_ps(_mm256_or_pd(v, sgn))); /* zero lanes: v = +0, neg clear */
}

/* one word: |Q| < 2^62 */
AVX2_FN static void decode1_avx2(const int64_t *w, size_t n, int32_t code, int k, float *x) {
  const __m256i esh = _mm256_set1_epi64x(dopt_grid_top(code) - k); /* value = Q·2^e */
  size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const __m256i q = _mm256_loadu_si256((const __m256i *)(const void *)(w + i));
    const __m256i neg = _mm256_cmpgt_epi64(_mm256_setzero_si256(), q);
    finish4(apply_sign(q, neg), neg, esh, x + i);
  }
  PORTABLE->decode(w + i, n - i, code, 1, k, x + i);
}

/* two words: Q = hi·2^K + lo */
AVX2_FN static void decode2_avx2(const int64_t *w, size_t n, int32_t code, int k, float *x) {
  const int64_t e = dopt_grid_top(code) - 2 * k; /* value = Q·2^e */
  const __m256i zero = _mm256_setzero_si256(), one = _mm256_set1_epi64x(1);
  const __m256i kmask = _mm256_set1_epi64x((int64_t)((UINT64_C(1) << k) - 1u));
  const __m128i cnt = _mm_cvtsi32_si128(k - 26);
  const __m256i low = _mm256_sub_epi64(_mm256_sll_epi64(one, cnt), one);
  size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const __m256i p0 = _mm256_loadu_si256((const __m256i *)(const void *)(w + 2 * i));
    const __m256i p1 = _mm256_loadu_si256((const __m256i *)(const void *)(w + 2 * i + 4));
    const __m256i a = _mm256_permute2x128_si256(p0, p1, 0x20), b = _mm256_permute2x128_si256(p0, p1, 0x31);
    __m256i hi = _mm256_unpacklo_epi64(a, b), lo = _mm256_unpackhi_epi64(a, b);
    /* carry: lo = c·2^K + lo' with 0 ≤ lo' < 2^K (arithmetic shift emulated) */
    const __m256i ls = _mm256_cmpgt_epi64(zero, lo);
    hi = _mm256_add_epi64(hi, _mm256_xor_si256(_mm256_srli_epi64(_mm256_xor_si256(lo, ls), k), ls));
    lo = _mm256_and_si256(lo, kmask);
    /* |Q| = mh·2^K + ml: for Q < 0 (hi < 0), (−hi − 1, 2^K − lo) when lo > 0 */
    const __m256i neg = _mm256_cmpgt_epi64(zero, hi);
    const __m256i lz = _mm256_cmpeq_epi64(lo, zero);
    const __m256i mh = _mm256_sub_epi64(apply_sign(hi, neg), _mm256_andnot_si256(lz, _mm256_and_si256(neg, one)));
    const __m256i ml = _mm256_blendv_epi8(lo, _mm256_and_si256(_mm256_sub_epi64(zero, lo), kmask), neg);
    /* a magnitude below 2^63 that rounds like |Q| (the sticky bit below
     * fp32's guard bit) and its scale: mh = 0: ml itself; mh < 2^25 (top
     * bit of |Q| in [K, K+24], guard ≥ K−24): bits from K−25 up, sticky at
     * K−26; mh ≥ 2^25 (guard ≥ K+1): 2·mh with ml's sticky at K−1 */
    const __m256i mb = _mm256_or_si256(
        _mm256_or_si256(_mm256_slli_epi64(mh, 26), _mm256_srl_epi64(ml, cnt)),
        _mm256_and_si256(_mm256_cmpgt_epi64(_mm256_and_si256(ml, low), zero), one));
    const __m256i mc = _mm256_or_si256(_mm256_slli_epi64(mh, 1), _mm256_andnot_si256(lz, one));
    const __m256i ca = _mm256_cmpeq_epi64(mh, zero), cc = _mm256_cmpgt_epi64(mh, _mm256_set1_epi64x((1 << 25) - 1));
    const __m256i mag = _mm256_blendv_epi8(_mm256_blendv_epi8(mb, ml, ca), mc, cc);
    const __m256i esh = _mm256_blendv_epi8(
        _mm256_blendv_epi8(_mm256_set1_epi64x(e + k - 26), _mm256_set1_epi64x(e), ca), _mm256_set1_epi64x(e + k - 1), cc);
    finish4(mag, neg, esh, x + i);
  }
  PORTABLE->decode(w + 2 * i, n - i, code, 2, k, x + i);
}

AVX2_FN static void decode_avx2(const int64_t *w, size_t n, int32_t code, int words, int k, float *x) {
  if (words == 1) decode1_avx2(w, n, code, k, x);
  else decode2_avx2(w, n, code, k, x);
}

/* The block code (the largest finite abs bits' code), the non-finite count, and the smallest exponent field
 * of a nonzero finite element (dopt__grid_kern.code_min) */
AVX2_FN static int32_t code_min_avx2(const float *x, size_t n, int64_t *nonfinite, int32_t *cmin) {
  const __m256i absm = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000), zero = _mm256_setzero_si256();
  __m256i mx = zero, mn = _mm256_set1_epi32(-1), nb = zero;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i a = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(const void *)(x + i)), absm);
    const __m256i fin = _mm256_cmpgt_epi32(inf, a); /* a ≤ 0x7fffffff: signed compare is fine */
    mx = _mm256_max_epu32(mx, _mm256_and_si256(a, fin));
    /* non-finite and zero lanes: all ones, no minimum */
    mn = _mm256_min_epu32(mn, _mm256_or_si256(a, _mm256_or_si256(_mm256_xor_si256(fin, _mm256_set1_epi32(-1)),
                                                                _mm256_cmpeq_epi32(a, zero))));
    nb = _mm256_sub_epi32(nb, _mm256_xor_si256(fin, _mm256_set1_epi32(-1)));
  }
  uint32_t m[8], c[8], l[8], amax = 0, amin = UINT32_MAX;
  int64_t bad = 0;
  _mm256_storeu_si256((__m256i *)(void *)m, mx);
  _mm256_storeu_si256((__m256i *)(void *)c, nb);
  _mm256_storeu_si256((__m256i *)(void *)l, mn);
  for (int t = 0; t < 8; t++) {
    amax = m[t] > amax ? m[t] : amax;
    amin = l[t] < amin ? l[t] : amin;
    bad += c[t];
  }
  *nonfinite += bad;
  const int32_t e = (int32_t)(amin >> 23); /* none: 0x1ff */
  if (e < *cmin) *cmin = e;
  const int32_t cv = dopt_grid_code_of_abs(amax), ct = dopt__grid_code_min(x + i, n - i, nonfinite, cmin);
  return cv > ct ? cv : ct;
}

/* the block code alone (dopt__grid_kern.code): code_min's loop, its minimum unused */
AVX2_FN static int32_t code_avx2(const float *x, size_t n, int64_t *nonfinite) {
  int32_t cmin = 0xff;
  return code_min_avx2(x, n, nonfinite, &cmin);
}

/* out[i] = (float)(+0.0 + Σ_d parts[d][lo + i]) in double, an exact zero as +0 (the caller checked that every
 * addition is exact) */
AVX2_FN static void sum_double_avx2(const float *const *parts, int np, size_t lo, size_t n, float *out) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
    for (int d = 0; d < np; d++) {
      const __m256 v = _mm256_loadu_ps(parts[d] + lo + i);
      a0 = _mm256_add_pd(a0, _mm256_cvtps_pd(_mm256_castps256_ps128(v)));
      a1 = _mm256_add_pd(a1, _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
    }
    const __m256 r = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm256_cvtpd_ps(a0)), _mm256_cvtpd_ps(a1), 1);
    /* −0 (an exact zero in a directed rounding mode) → +0 */
    const __m256 z = _mm256_cmp_ps(r, _mm256_setzero_ps(), _CMP_EQ_OQ);
    _mm256_storeu_ps(out + i, _mm256_andnot_ps(z, r));
  }
  dopt__grid_sum_double(parts, np, lo + i, n - i, out + i);
}

static const dopt__grid_kern kern_avx2 = {code_avx2, encode_avx2, decode_avx2, code_min_avx2, sum_double_avx2};

/* Read-only after libgcc's constructor ran: safe from any thread. */
const dopt__grid_kern *dopt__grid_kern_avx2(void) { return __builtin_cpu_supports("avx2") ? &kern_avx2 : NULL; }

#else
const dopt__grid_kern *dopt__grid_kern_avx2(void) { return NULL; }
#endif
