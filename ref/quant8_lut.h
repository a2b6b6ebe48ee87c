/* The table search the 8-bit quantiser (ref/quant8.c) and the 8-bit Adam
 * kernels (ref/quant8_adam.c) share (internal to those two files): the GPU's
 * flush-to-zero F(), the fast exact search on a table indexed by the float's
 * bits (the method below; the tables are built in quant8.c) in scalar C and on
 * 8 (AVX2) and 16 (AVX-512) lanes, the maps' byte planes for the AVX-512
 * dequantisation, and the choice of implementation. */
#ifndef DISTOPT_QUANT8_LUT_H
#define DISTOPT_QUANT8_LUT_H

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "distopt/quant8.h"
#include "quant8_fast.h"

/* flush-to-zero: subnormals become a zero of the same sign */
static inline float F(float x) { return fabsf(x) < FLT_MIN ? copysignf(0.0f, x) : x; }

/* ---- the fast search: a table on the float's bits -------------------------------
 *
 * For a sorted code the CUDA search (dopt_q8_search, ref/quant8.c) is a
 * non-decreasing step function of x
 * (NaN aside): its last pivot P is even, P−1 and P+1 are the bounds it kept,
 * and it returns the nearest of the three by the fp32 midpoints
 * F((code[i] + code[i+1])·0.5), a value exactly on a midpoint going to the
 * even index. So for x ≥ 0 the byte is determined by where |x| falls among
 * 255 thresholds, and a table indexed by the top 16 bits of |x| (sign 0,
 * exponent, 7 mantissa bits) over [2^-23, 1] holds, per bucket, the byte at
 * the bucket's start (`base`) and the low 16 bits after which the byte is one
 * higher (`split`; 0xffff: no step in the bucket). 7 mantissa bits are
 * finer than the closest codes of both maps (relative spacing ≥ 0.7 %), so a
 * bucket holds at most one step; below 2^-23 and above 1 the byte is
 * constant. Negative x: the signed map is symmetric (code[i] = −code[254−i],
 * and mirrored pairs have opposite parity, so ties mirror too), hence
 * byte(−|x|) = max(254 − byte(|x|), 0) (no −1.0 code, so the 255 side clamps
 * to 0); for the unsigned map every negative value gives 0 = max(0 − byte, 0).
 * NaN gives 0. The table is built from dopt_q8_search itself (binary search
 * for the step inside each bucket) and every assumption above is checked
 * while building it; the unit test compares the two searches on ~10^8
 * patterns (every midpoint and code ±64 ulps, every bucket edge, random
 * patterns of all classes). */
#define LUT_LO 0x34000000u /* bits of 2^-23: below every threshold of both maps (checked) */
#define LUT_HI 0x3f800000u /* bits of 1.0f: at or above every threshold (checked) */
#define LUT_N ((size_t)((LUT_HI - LUT_LO) >> 16) + 1)
#define LUT_KNEG(is_signed) ((is_signed) ? 254 : 0)

static uint32_t bits_of(float f) {
  uint32_t b;
  memcpy(&b, &f, sizeof b);
  return b;
}

static inline uint8_t lut_search(const uint32_t *t, int kneg, float x) {
  const uint32_t b = bits_of(x), u = b & 0x7fffffffu;
  if (u > 0x7f800000u) return 0; /* NaN */
  const uint32_t c = u < LUT_LO ? LUT_LO : u > LUT_HI ? LUT_HI : u;
  const uint32_t e = t[(c - LUT_LO) >> 16];
  int r = (int)(e & 0xffu) + ((c & 0xffffu) > (e >> 16));
  if (b >> 31) r = kneg - r > 0 ? kneg - r : 0;
  return (uint8_t)r;
}

static inline uint8_t search_any(const float *code, const uint32_t *t, int kneg, float x) {
  return t ? lut_search(t, kneg, x) : dopt_q8_search(code, x);
}

/* the maps as four byte planes, dopt__q8_planes[s][k][i] = byte k (little-endian)
 * of dopt_q8_map(s)[i] (built with the tables in ref/quant8.c): the AVX-512
 * kernel dequantises 64 bytes with byte permutes */
extern _Alignas(64) uint8_t dopt__q8_planes[2][4][DOPT_Q8_CODES];

/* The implementation a call runs (*use: AUTO resolved to the widest this CPU
 * runs); DOPT_ERR_UNSUPPORTED for one this CPU (or build) cannot run */
dopt_status dopt__q8_impl_pick(dopt_q8_impl impl, const char *fn, dopt_q8_impl *use);

#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
#include <immintrin.h>
#define Q8_AVX2 1
#define AVX2_FN __attribute__((target("avx2")))

/* lut_search on 8 lanes: bytes as int32 */
AVX2_FN static inline __m256i lut_search8(const uint32_t *t, int kneg, __m256 x) {
  const __m256i b = _mm256_castps_si256(x), u = _mm256_and_si256(b, _mm256_set1_epi32(0x7fffffff));
  const __m256i nan = _mm256_cmpgt_epi32(u, _mm256_set1_epi32(0x7f800000));
  const __m256i c = _mm256_min_epi32(_mm256_max_epi32(u, _mm256_set1_epi32((int)LUT_LO)),
                                     _mm256_set1_epi32((int)LUT_HI));
  const __m256i e = _mm256_i32gather_epi32((const int *)t, _mm256_srli_epi32(_mm256_sub_epi32(c, _mm256_set1_epi32((int)LUT_LO)), 16), 4);
  const __m256i up = _mm256_cmpgt_epi32(_mm256_and_si256(c, _mm256_set1_epi32(0xffff)), _mm256_srli_epi32(e, 16));
  const __m256i rp = _mm256_sub_epi32(_mm256_and_si256(e, _mm256_set1_epi32(0xff)), up); /* up is -1 or 0 */
  const __m256i rn = _mm256_max_epi32(_mm256_sub_epi32(_mm256_set1_epi32(kneg), rp), _mm256_setzero_si256());
  const __m256i r = _mm256_blendv_epi8(rp, rn, _mm256_srai_epi32(b, 31));
  return _mm256_andnot_si256(nan, r);
}

/* 8 int32 lanes in [0, 255] → 8 bytes */
AVX2_FN static inline void store_u8x8(uint8_t *q, __m256i r) {
  const __m256i w = _mm256_packus_epi16(_mm256_packus_epi32(r, r), _mm256_setzero_si256());
  const __m128i v = _mm_unpacklo_epi32(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
  _mm_storel_epi64((__m128i *)(void *)q, v);
}

/* ---- AVX-512 (F, BW, DQ, VL, VBMI) ------------------------------------------------
 * The same operations again on 16 lanes, with mask registers where the AVX2
 * code blends, and the dequantisation without scalar loads: 64 bytes at a
 * time, each of the code's four byte planes looked up by two byte permutes
 * of 128 entries (vpermi2b) and a blend on the index's top bit, the planes
 * interleaved back into floats. */
#define AVX512_FN __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vbmi,avx2,fma")))

/* lut_search on 16 lanes: bytes as int32 */
AVX512_FN static inline __m512i lut_search16(const uint32_t *t, int kneg, __m512 x) {
  const __m512i b = _mm512_castps_si512(x), u = _mm512_and_si512(b, _mm512_set1_epi32(0x7fffffff));
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(u, _mm512_set1_epi32(0x7f800000));
  const __m512i c = _mm512_min_epu32(_mm512_max_epu32(u, _mm512_set1_epi32((int)LUT_LO)),
                                     _mm512_set1_epi32((int)LUT_HI));
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wsign-conversion" /* GCC's gather macro (unoptimised builds) casts its mask */
  const __m512i e =
      _mm512_i32gather_epi32(_mm512_srli_epi32(_mm512_sub_epi32(c, _mm512_set1_epi32((int)LUT_LO)), 16), t, 4);
#pragma GCC diagnostic pop
  const __mmask16 up =
      _mm512_cmpgt_epu32_mask(_mm512_and_si512(c, _mm512_set1_epi32(0xffff)), _mm512_srli_epi32(e, 16));
  const __m512i rp = _mm512_and_si512(e, _mm512_set1_epi32(0xff));
  __m512i r = _mm512_mask_add_epi32(rp, up, rp, _mm512_set1_epi32(1));
  const __mmask16 neg = _mm512_movepi32_mask(b);
  if (kneg)
    r = _mm512_mask_mov_epi32(r, neg,
                              _mm512_max_epi32(_mm512_sub_epi32(_mm512_set1_epi32(kneg), r), _mm512_setzero_si512()));
  else
    r = _mm512_maskz_mov_epi32((__mmask16)~neg, r);
  return _mm512_maskz_mov_epi32((__mmask16)~nan, r);
}
#endif

#endif
