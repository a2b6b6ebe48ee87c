/* The per-element arithmetic of the exact data-parallel sum
 * (include/distopt/dpsum.h, docs/dp-sum.md), written once for the C library
 * and the CUDA kernels (DOPT_GRID_FN is __host__ __device__ under nvcc), so
 * the CPU device, the reference and the GPU compute the very same words.
 * Only exact operations: scaling by powers of two, rint/trunc of exactly
 * scaled values, integer arithmetic; one rounding to fp32 in decode. */
#ifndef DOPT_CORE_GRID_H
#define DOPT_CORE_GRID_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "distopt/device.h"
#include "distopt/dpsum.h"
#include "elem.h" /* DOPT_D*: explicit round-to-nearest on the device */

#ifdef __CUDACC__
#define DOPT_GRID_FN __host__ __device__ static inline
#else
#define DOPT_GRID_FN static inline
#endif

/* class counts: NaN in bits 0..20, +inf in 21..41, −inf in 42..62 */
#define DOPT_GRID_CLASS_BITS 21
#define DOPT_GRID_CLASS_MASK ((int64_t)((1 << DOPT_GRID_CLASS_BITS) - 1))

/* The block-maximum code of one element: 0 for ±0 and non-finite values, 1
 * for subnormals, else the biased exponent field (1..254). */
DOPT_GRID_FN int32_t dopt_grid_code(float x) {
  uint32_t u;
  memcpy(&u, &x, sizeof u);
  uint32_t ex = (u >> 23) & 0xffu;
  if (ex == 0xffu) return 0;
  if (ex == 0) return (u & 0x7fffffu) ? 1 : 0;
  return (int32_t)ex;
}

/* Headroom bits for n contributions: ⌈log2 n⌉. */
DOPT_GRID_FN int dopt_grid_headroom(int n) {
  int h = 0;
  while (h < 30 && (1 << h) < n) h++;
  return h;
}

/* Every finite element of a block with code c has |x| < 2^top. */
DOPT_GRID_FN int dopt_grid_top(int32_t code) { return (code > 1 ? code : 1) - 126; }

/* 2^e as a double, −1022 ≤ e ≤ 1023 (bit assembly: no libm call). */
DOPT_GRID_FN double dopt_grid_pow2(int e) {
  uint64_t u = (uint64_t)(e + 1023) << 52;
  double d;
  memcpy(&d, &u, sizeof d);
  return d;
}

/* rint(v) in the default rounding mode (nearest-even) for a v with at most
 * 24 significant bits and |v| < 2^125, without a libm call or a branch:
 * (v + c) − c with c = ±2^52 rounds once below 2^52; above, v is an integer
 * and both operations are exact (v's bits and 2^52 fit in 53 bits) or leave v
 * unchanged (2^52 below half of v's ulp). */
DOPT_GRID_FN double dopt_grid_rint(double v) {
  const double c = copysign(0x1p52, v);
  return DOPT_DSUB(DOPT_DADD(v, c), c);
}

/* The words of finite x in a block with code `code` (≥ x's own code): v =
 * rint(x·2^(W·K − top)) as W int64 words (W = 2: hi = trunc(v/2^K), lo = v −
 * hi·2^K). Non-finite x: zero words (its class is counted apart). */
DOPT_GRID_FN void dopt_grid_encode(float x, int32_t code, int words, int k, int64_t *w) {
  if (!isfinite(x)) {
    w[0] = 0;
    if (words == 2) w[1] = 0;
    return;
  }
  /* exact: a power-of-two scaling of a 24-bit value, |.| < 2^(W·K) ≤ 2^124 */
  double v = dopt_grid_rint(DOPT_DMUL((double)x, dopt_grid_pow2(words * k - dopt_grid_top(code))));
  if (words == 1) {
    w[0] = (int64_t)v;
    return;
  }
  int64_t hi = (int64_t)DOPT_DMUL(v, dopt_grid_pow2(-k)); /* truncation toward zero; exact scaling, |.| < 2^K */
  w[0] = hi;
  w[1] = (int64_t)DOPT_DSUB(v, DOPT_DMUL((double)hi, dopt_grid_pow2(k))); /* exact: the low bits of v's ≤ 24-bit significand */
}

DOPT_GRID_FN int64_t dopt_grid_class(float x) {
  if (isnan(x)) return 1;
  if (isinf(x)) return x > 0 ? (int64_t)1 << DOPT_GRID_CLASS_BITS : (int64_t)1 << (2 * DOPT_GRID_CLASS_BITS);
  return 0;
}

DOPT_GRID_FN int dopt_grid_clz64(uint64_t x) {
#ifdef __CUDA_ARCH__
  return __clzll((long long)x);
#else
  return __builtin_clzll(x);
#endif
}

/* The summed words (and class counts, 0: all finite) → fp32, rounded once
 * to nearest-even. An exact zero is +0. */
DOPT_GRID_FN float dopt_grid_decode(const int64_t *w, int64_t cls, int32_t code, int words, int k) {
  if (cls != 0) {
    int64_t nan = cls & DOPT_GRID_CLASS_MASK, pinf = (cls >> DOPT_GRID_CLASS_BITS) & DOPT_GRID_CLASS_MASK,
            ninf = (cls >> (2 * DOPT_GRID_CLASS_BITS)) & DOPT_GRID_CLASS_MASK;
    if (nan != 0 || (pinf != 0 && ninf != 0)) {
      uint32_t qnan = 0x7fc00000u; /* the canonical NaN */
      float f;
      memcpy(&f, &qnan, sizeof f);
      return f;
    }
    if (pinf != 0) return (float)INFINITY;
    if (ninf != 0) return -(float)INFINITY;
  }
  /* Q as a 128-bit two's complement (top:bot): w0 (W = 1) or w0·2^K + w1 */
  uint64_t bot;
  int64_t top;
  if (words == 1) {
    bot = (uint64_t)w[0];
    top = w[0] < 0 ? -1 : 0;
  } else {
    uint64_t u = (uint64_t)w[0];
    bot = u << k;
    /* the bits of w0 shifted out of bot, sign-extended (0 < k < 64) */
    top = (int64_t)(w[0] < 0 ? ~(~u >> (64 - k)) : u >> (64 - k));
    uint64_t lo = (uint64_t)w[1], nb = bot + lo;
    top = top + (w[1] < 0 ? -1 : 0) + (nb < bot ? 1 : 0); /* |Q| < 2^126: no overflow */
    bot = nb;
  }
  const int e = dopt_grid_top(code) - words * k; /* value = Q · 2^e */
  const int neg = top < 0;
  /* the magnitude, without a branch on the sign: (x ^ m) + (m & 1) negates when m is all ones */
  const uint64_t msk = (uint64_t)0 - (uint64_t)neg;
  uint64_t ml = (bot ^ msk) + (msk & 1u);
  uint64_t mh = ((uint64_t)top ^ msk) + ((msk & 1u) & (ml == 0 ? 1u : 0u));
  if (mh == 0 && ml == 0) return 0.0f;
  {
    /* the magnitude in 63 bits: shifted right by sh with the shifted-out bits
     * OR-ed into bit 0 (a sticky bit far below fp32's rounding position), so
     * the int64 → fp32 conversion (C's, rounding once) rounds like the whole
     * magnitude; the power-of-two scaling is exact while the result is normal
     * (or overflows to ±inf, as rounding asks) */
    const int sh = mh ? 65 - dopt_grid_clz64(mh) : ml >> 63 ? 1 : 0;
    uint64_t m63 = ml;
    if (sh > 0) m63 = (ml >> sh) | (mh << (64 - sh)) | ((ml & ((UINT64_C(1) << sh) - 1u)) != 0 ? 1u : 0u);
    const double v = DOPT_DMUL((double)(float)(int64_t)m63, dopt_grid_pow2(e + sh));
    if (v > 0x1p-126) return (float)(neg ? -v : v);
  }
  /* subnormal results: rounded here, once, at 2^-149 */
  const int p = mh ? 127 - dopt_grid_clz64(mh) : 63 - dopt_grid_clz64(ml); /* top bit of the magnitude */
  int ulp = p + e - 23;
  if (ulp < -149) ulp = -149; /* subnormal results keep fewer bits */
  const int s = ulp - e;      /* low bits to round away */
  uint64_t m;
  if (s <= 0) {
    m = ml; /* < 2^24 */
  } else {
    m = s >= 64 ? mh >> (s - 64) : (ml >> s) | (mh << (64 - s));
    const int b = s - 1; /* the guard bit; sticky: the bits below it */
    uint64_t guard = b >= 64 ? (mh >> (b - 64)) & 1u : (ml >> b) & 1u;
    int sticky = b == 0 ? 0 : b < 64 ? (ml & ((UINT64_C(1) << b) - 1u)) != 0
                              : b == 64 ? ml != 0 : (ml != 0 || (mh & ((UINT64_C(1) << (b - 64)) - 1u)) != 0);
    if (guard && (sticky || (m & 1u))) m++;
  }
  /* m ≤ 2^24 and m·2^(e+s) is an fp32 value (or beyond the range: ±inf, as rounding asks) */
  float r = (float)DOPT_DMUL((double)m, dopt_grid_pow2(e + (s > 0 ? s : 0)));
  return neg ? -r : r;
}

/* Flat index j of the TP block [b, hl, wl] of piece pc → logical flat index. */
DOPT_GRID_FN size_t dopt_grid_logical(const dopt_piece *pc, size_t j) {
  size_t per = pc->hl * pc->wl, r = j % per;
  return ((j / per) * pc->h + pc->h0 + r / pc->wl) * pc->w + pc->w0 + r % pc->wl;
}

#ifndef __CUDACC__
/* The CPU kernels over a piece's elements [pc->lo, pc->lo + pc->len) of its
 * TP block; x, w, cls point at element lo (w: words per element; encode
 * with add: w += the words, cls += the class, a local integer sum). */
void dopt__grid_codes(const float *x, const dopt_piece *pc, int32_t *codes, int64_t *nonfinite);
void dopt__grid_encode(const float *x, const dopt_piece *pc, const int32_t *codes, int words, int k, int add,
                       int64_t *w, int64_t *cls);
void dopt__grid_decode(const int64_t *w, const int64_t *cls, const dopt_piece *pc, const int32_t *codes, int words,
                       int k, float *x);

/* The code of a block whose largest finite |x| has the bit pattern a (the
 * abs bits are ordered like the magnitudes, and dopt_grid_code is monotone in
 * them, so the block's MAX of codes is the code of its MAX of abs bits). */
DOPT_GRID_FN int32_t dopt_grid_code_of_abs(uint32_t a) {
  const int32_t ex = (int32_t)(a >> 23);
  return ex ? ex : a ? 1 : 0;
}

/* The kernels on a segment: n contiguous elements of one logical block (code
 * `code` for encode and decode). Two implementations (docs/dp-sum.md, "Fast
 * paths"): the portable one calls the element functions above; the AVX2 and
 * AVX-512 ones (core/grid_avx2.c, core/grid_avx512.c, x86-64 with runtime
 * dispatch) compute the same bytes with integer shifts, tested bit for bit
 * against it (tests/unit/test_dpsum.c).
 * Non-finite elements: encode writes (adds) zero words and leaves the class
 * counts to the caller; decode decodes the words only (the caller
 * overwrites the elements whose class count is not 0). */
typedef struct dopt__grid_kern {
  int32_t (*code)(const float *x, size_t n, int64_t *nonfinite); /* max dopt_grid_code; nonfinite += count */
  void (*encode)(const float *x, size_t n, int32_t code, int words, int k, int add, int64_t *w);
  void (*decode)(const int64_t *w, size_t n, int32_t code, int words, int k, float *x);
  /* dopt_dp_sum's exact double path (dopt__dp_sum_k; NULL: none, the portable set, so that the tests compare
   * it with the words): code as above, and *cmin = min(*cmin, the smallest exponent field of a nonzero finite
   * element, 0 for a subnormal); out[i] = (float)(+0.0 + Σ_d (double)parts[d][i]), an exact zero as +0 */
  int32_t (*code_min)(const float *x, size_t n, int64_t *nonfinite, int32_t *cmin);
  void (*sum_double)(const float *const *parts, int nparts, size_t lo, size_t n, float *out);
} dopt__grid_kern;

/* The portable code_min and sum_double (the vector kernels' tails). */
int32_t dopt__grid_code_min(const float *x, size_t n, int64_t *nonfinite, int32_t *cmin);
void dopt__grid_sum_double(const float *const *parts, int nparts, size_t lo, size_t n, float *out);

enum { DOPT_GRID_IMPL_AUTO = 0, DOPT_GRID_IMPL_PORTABLE = 1, DOPT_GRID_IMPL_AVX2 = 2, DOPT_GRID_IMPL_AVX512 = 3 };
/* The kernels of an implementation (AUTO: AVX-512 where the CPU has it, else
 * AVX2, else portable); NULL for a vector set the CPU or the compiler lacks. */
const dopt__grid_kern *dopt__grid_kernels(int impl);
const dopt__grid_kern *dopt__grid_kern_avx2(void);   /* core/grid_avx2.c: NULL when unavailable */
const dopt__grid_kern *dopt__grid_kern_avx512(void); /* core/grid_avx512.c: NULL when unavailable */

/* The piece kernels and the whole-tensor sum (dopt_dp_sum) with the given kernels. */
void dopt__grid_codes_k(const dopt__grid_kern *kn, const float *x, const dopt_piece *pc, int32_t *codes,
                        int64_t *nonfinite);
void dopt__grid_encode_k(const dopt__grid_kern *kn, const float *x, const dopt_piece *pc, const int32_t *codes,
                         int words, int k, int add, int64_t *w, int64_t *cls);
void dopt__grid_decode_k(const dopt__grid_kern *kn, const int64_t *w, const int64_t *cls, const dopt_piece *pc,
                         const int32_t *codes, int words, int k, float *x);
dopt_status dopt__dp_sum_k(const dopt__grid_kern *kn, const float *const *parts, int nparts, int words, size_t numel,
                           float *out);
#endif

#endif
