/* The 8-bit Adam kernels with bitsandbytes' CUDA semantics (see
 * distopt/quant8.h and docs/adamw8bit.md): one block of the update in scalar
 * C, AVX2 and AVX-512, the launcher over the blocks, and percentile clipping.
 * The quantiser and its tables are ref/quant8.c; what both use is
 * ref/quant8_lut.h. The rules of ref/quant8.c's opening comment hold here:
 * one IEEE operation at a time, each followed by F() (the GPU's
 * flush-to-zero), correctly rounded where upstream approximates. */
#include "distopt/quant8.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "quant8_fast.h"
#include "quant8_lut.h"
#include "registry.h"

/* ---- Adam kernels ------------------------------------------------------------------ */

typedef struct scalars {
  float beta1, beta2, omb1, omb2, step_size, c2eps, decay, gscale;
  int decay_on;
} scalars;

/* The kernel's per-launch scalars, in fp32: c1 = 1 − β1^t, c2 = √(1 − β2^t),
 * step_size = (−lr·c2)/c1 (upstream: fast pow and __fdividef). */
static scalars kernel_scalars(const dopt_q8_adam_hp *hp) {
  scalars s;
  const float t = (float)hp->step;
  const float c1 = F(1.0f - F(powf(hp->beta1, t)));
  const float c2 = F(sqrtf(F(1.0f - F(powf(hp->beta2, t)))));
  s.beta1 = hp->beta1;
  s.beta2 = hp->beta2;
  s.omb1 = F(1.0f - hp->beta1);
  s.omb2 = F(1.0f - hp->beta2);
  s.step_size = F(F(-hp->lr * c2) / c1);
  s.c2eps = F(c2 * hp->eps);
  s.decay = F(1.0f - F(hp->lr * hp->weight_decay));
  s.decay_on = hp->weight_decay > 0.0f;
  s.gscale = hp->gnorm_scale;
  return s;
}

static dopt_status check_hp(const dopt_q8_adam_hp *hp, const char *fn) {
  DOPT_CHECK_ARG(hp != NULL, "%s: hp=NULL", fn);
  DOPT_CHECK_ARG(hp->step >= 1, "%s: step=%lld must be >= 1", fn, (long long)hp->step);
  return DOPT_OK;
}

/* what one update needs besides the arrays */
typedef struct q8ctx {
  scalars k;
  const float *code1, *code2;   /* signed (m), unsigned (v) */
  const uint32_t *lut1, *lut2; /* their tables; NULL: dopt_q8_search */
} q8ctx;

/* The kernel's equations for one slot, in plain C; the AVX2 block below does
 * the same operations lane by lane. new_states: the slot's new states from
 * its flushed gradient gj and bytes q1, q2 under the block's current absmax
 * a1, a2 (a padding slot: gj = 0, byte 128 / byte 0); a non-finite gradient
 * gives s1 = s2 = 0 and returns 0. */
static inline int new_states(const q8ctx *c, float gj, uint8_t q1, uint8_t q2, float a1, float a2, float *s1,
                             float *s2) {
  const scalars k = c->k;
  *s1 = 0.0f, *s2 = 0.0f;
  if (!isfinite(gj)) return 0;
  const float gs = F(gj * k.gscale);
  float v = F(c->code2[q2] * a2);
  *s2 = F(F(v * k.beta2) + F(F(k.omb2 * gs) * gs));
  float m = F(c->code1[q1] * a1);
  *s1 = F(F(m * k.beta1) + F(k.omb1 * gs));
  return 1;
}

/* apply_elem: the parameter (unless its gradient g is non-finite) and the
 * two bytes of one element from its new states and the block's new absmax
 * m1, m2. */
static inline void apply_elem(const q8ctx *c, float *p, float g, float s1, float s2, float m1, float m2, uint8_t *b1,
                              uint8_t *b2) {
  const scalars k = c->k;
  /* 3. parameter: step from the full-precision states, then decay */
  if (isfinite(F(g))) {
    float pj = F(*p);
    const float den = F(F(sqrtf(s2)) + k.c2eps);
    pj = F(pj + F(k.step_size * F(s1 / den)));
    if (k.decay_on) pj = F(pj * k.decay);
    *p = pj;
  }
  /* 4. requantise; keep the sign of m */
  uint8_t q1 = search_any(c->code1, c->lut1, LUT_KNEG(1), F(s1 / m1));
  if (signbit(c->code1[q1]) != signbit(s1)) q1 = (uint8_t)(s1 > 0.0f ? q1 + 1u : q1 - 1u);
  *b1 = q1;
  *b2 = search_any(c->code2, c->lut2, LUT_KNEG(0), F(s2 / m2));
}

/* One block of B slots, `valid` of them real (the rest padded: g = 0, byte
 * 128 / byte 0). Returns the number of non-finite gradient items. */
static size_t block_scalar(const q8ctx *c, float *p, const float *g, uint8_t *state1, uint8_t *state2, float *absmax1,
                           float *absmax2, size_t valid, size_t B) {
  float s1b[DOPT_Q8_BLOCK_MAX], s2b[DOPT_Q8_BLOCK_MAX];
  size_t bad = 0;
  const float a1 = *absmax1, a2 = *absmax2;
  float m1 = -FLT_MAX, m2 = -FLT_MAX;
  /* 1. new states of all B slots */
  for (size_t j = 0; j < B; j++) {
    const int in = j < valid;
    bad += !new_states(c, in ? F(g[j]) : 0.0f, in ? state1[j] : 128, in ? state2[j] : 0, a1, a2, &s1b[j], &s2b[j]);
    m1 = fmaxf(m1, fabsf(s1b[j]));
    m2 = fmaxf(m2, fabsf(s2b[j]));
  }
  /* 2. absmax of the new, unquantised states */
  *absmax1 = m1;
  *absmax2 = m2;
  for (size_t j = 0; j < valid; j++) apply_elem(c, &p[j], g[j], s1b[j], s2b[j], m1, m2, &state1[j], &state2[j]);
  return bad;
}

#ifdef Q8_AVX2
/* ---- the AVX2 block --------------------------------------------------------------
 *
 * block_scalar for a full block (B a multiple of 8, both tables present), 8
 * lanes at a time: the same IEEE operations on each element, in the same
 * order and with the same operand order, and the table search. max_ps(|s|, m)
 * returns m when |s| is NaN, as fmaxf(m, |s|) does, and the running maxima
 * are never NaN, so the lane maxima reduce to the same absmax in any order.
 *
 * Flush-to-zero. F(r) differs from r only when r is a nonzero subnormal.
 * Each pass first runs without F (`exact` = 0) and then reads the x86 status
 * flags: a nonzero subnormal result r = RN(a op b) is either inexact, and
 * then tiny, which raises the underflow flag (UE), or exact, and then the
 * next operation that reads it raises the denormal-operand flag (DE). Every
 * intermediate value of a pass is read by a later floating-point operation
 * (add, mul, div, sqrt, max, compare), except the final parameter, which
 * keeps its F; the quotients s/absmax go to the table search, which gives a
 * subnormal and a zero of the same sign the same byte (both clamp to the
 * table's first bucket), so they need no F. So if neither flag is raised
 * after the pass, every F was the identity and the pass's results are
 * exactly those of the F version; if one is raised (rare: subnormal
 * gradients, parameters or states, or a tiny absmax), the pass is run again
 * with F8 everywhere (`exact` = 1), from inputs it has not overwritten.
 * The fast passes run only under the default MXCSR (round to nearest, no
 * FTZ/DAZ, all exceptions masked); otherwise both passes run exact. */
#define CSR_DE 0x0002u /* denormal operand */
#define CSR_UE 0x0010u /* underflow */
#define CSR_DEFAULT 0x1f80u /* all exceptions masked, round to nearest, no FTZ/DAZ */

/* F() on 8 lanes: |x| < FLT_MIN (not NaN) → a zero of x's sign */
AVX2_FN static inline __m256 F8(__m256 x) {
  const __m256 mag = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 tiny = _mm256_cmp_ps(_mm256_and_ps(x, mag), _mm256_set1_ps(FLT_MIN), _CMP_LT_OQ);
  return _mm256_andnot_ps(_mm256_and_ps(tiny, mag), x);
}
#define FX(x) (exact ? F8(x) : (x))

/* tab[q[0..7]] (8 scalar loads: faster than a gather here) */
AVX2_FN static inline __m256 lookup8(const float *tab, const uint8_t *q) {
  uint64_t w;
  memcpy(&w, q, sizeof w);
  return _mm256_setr_ps(tab[w & 255u], tab[(w >> 8) & 255u], tab[(w >> 16) & 255u], tab[(w >> 24) & 255u],
                        tab[(w >> 32) & 255u], tab[(w >> 40) & 255u], tab[(w >> 48) & 255u], tab[w >> 56]);
}

/* clears UE and DE (and orders the floating-point work after it) */
AVX2_FN static inline void flags_clear(void) {
  const unsigned csr = _mm_getcsr();
  if (csr & (CSR_DE | CSR_UE)) _mm_setcsr(csr & ~(CSR_DE | CSR_UE));
  __asm__ __volatile__("" ::: "memory");
}

/* UE or DE raised since flags_clear (the pass's results are in memory first) */
AVX2_FN static inline int flags_raised(void) {
  __asm__ __volatile__("" ::: "memory");
  return (_mm_getcsr() & (CSR_DE | CSR_UE)) != 0;
}

/* 1. new states of the block into s1b/s2b; their absmax into *m1, *m2 */
AVX2_FN static inline __attribute__((always_inline)) size_t pass1_avx2(const q8ctx *c, const float *g,
                                                                         const uint8_t *state1, const uint8_t *state2,
                                                                         float a1s, float a2s, size_t B, float *s1b,
                                                                         float *s2b, float *m1, float *m2, int exact) {
  const scalars k = c->k;
  const __m256 mag = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)), big = _mm256_set1_ps(FLT_MAX);
  const __m256 gscale = _mm256_set1_ps(k.gscale), beta1 = _mm256_set1_ps(k.beta1), beta2 = _mm256_set1_ps(k.beta2);
  const __m256 omb1 = _mm256_set1_ps(k.omb1), omb2 = _mm256_set1_ps(k.omb2);
  const __m256 a1 = _mm256_set1_ps(a1s), a2 = _mm256_set1_ps(a2s);
  __m256 mx1 = _mm256_set1_ps(-FLT_MAX), mx2 = mx1;
  size_t bad = 0;
  for (size_t j = 0; j < B; j += 8) {
    const __m256 gj = FX(_mm256_loadu_ps(g + j));
    const __m256 fin = _mm256_cmp_ps(_mm256_and_ps(gj, mag), big, _CMP_LE_OQ); /* isfinite */
    bad += (size_t)__builtin_popcount(~(unsigned)_mm256_movemask_ps(fin) & 0xffu);
    const __m256 gs = FX(_mm256_mul_ps(gj, gscale));
    __m256 s2 = FX(_mm256_mul_ps(lookup8(c->code2, state2 + j), a2));
    s2 = FX(_mm256_add_ps(FX(_mm256_mul_ps(s2, beta2)), FX(_mm256_mul_ps(FX(_mm256_mul_ps(omb2, gs)), gs))));
    __m256 s1 = FX(_mm256_mul_ps(lookup8(c->code1, state1 + j), a1));
    s1 = FX(_mm256_add_ps(FX(_mm256_mul_ps(s1, beta1)), FX(_mm256_mul_ps(omb1, gs))));
    s1 = _mm256_and_ps(s1, fin); /* non-finite g: +0 */
    s2 = _mm256_and_ps(s2, fin);
    mx1 = _mm256_max_ps(_mm256_and_ps(s1, mag), mx1);
    mx2 = _mm256_max_ps(_mm256_and_ps(s2, mag), mx2);
    _mm256_store_ps(s1b + j, s1);
    _mm256_store_ps(s2b + j, s2);
  }
  float l1[8], l2[8];
  _mm256_storeu_ps(l1, mx1);
  _mm256_storeu_ps(l2, mx2);
  float r1 = l1[0], r2 = l2[0];
  for (int i = 1; i < 8; i++) {
    r1 = l1[i] > r1 ? l1[i] : r1;
    r2 = l2[i] > r2 ? l2[i] : r2;
  }
  *m1 = r1;
  *m2 = r2;
  return bad;
}

/* 3. and 4.: parameters (read from psrc, written to p; the fast pass keeps
 * the originals in psave) and the bytes, from s1b/s2b */
AVX2_FN static inline __attribute__((always_inline)) void pass2_avx2(const q8ctx *c, float *p, const float *psrc,
                                                                       float *psave, const float *g, uint8_t *state1,
                                                                       uint8_t *state2, size_t B, const float *s1b,
                                                                       const float *s2b, float m1, float m2,
                                                                       int exact) {
  const scalars k = c->k;
  const __m256 mag = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)), big = _mm256_set1_ps(FLT_MAX);
  const __m256 m1v = _mm256_set1_ps(m1), m2v = _mm256_set1_ps(m2);
  const __m256 step_size = _mm256_set1_ps(k.step_size), c2eps = _mm256_set1_ps(k.c2eps),
               decay = _mm256_set1_ps(k.decay);
  const __m256i k127 = _mm256_set1_epi32(127), m1i = _mm256_set1_epi32(-1), two = _mm256_set1_epi32(2),
                lo8 = _mm256_set1_epi32(0xff);
  for (size_t j = 0; j < B; j += 8) {
    const __m256 s1 = _mm256_load_ps(s1b + j), s2 = _mm256_load_ps(s2b + j);
    /* 3. parameter where g is finite (isfinite(F(g)) = isfinite(g)) */
    const __m256 fin = _mm256_cmp_ps(_mm256_and_ps(_mm256_loadu_ps(g + j), mag), big, _CMP_LE_OQ);
    const __m256 p0 = _mm256_loadu_ps(psrc + j);
    if (!exact) _mm256_store_ps(psave + j, p0);
    __m256 pj = FX(p0);
    const __m256 den = FX(_mm256_add_ps(FX(_mm256_sqrt_ps(s2)), c2eps));
    pj = FX(_mm256_add_ps(pj, FX(_mm256_mul_ps(step_size, FX(_mm256_div_ps(s1, den))))));
    if (k.decay_on) pj = FX(_mm256_mul_ps(pj, decay));
    _mm256_storeu_ps(p + j, _mm256_blendv_ps(p0, F8(pj), fin)); /* F8 again: idempotent; the flags' blind spot */
    /* 4. requantise (F of the quotient: same byte); sign fix: code1[q] is
     * negative exactly for q < 127 */
    __m256i q1 = lut_search8(c->lut1, LUT_KNEG(1), _mm256_div_ps(s1, m1v));
    const __m256i s1i = _mm256_castps_si256(s1);
    const __m256i differ = _mm256_xor_si256(_mm256_cmpgt_epi32(k127, q1), _mm256_srai_epi32(s1i, 31));
    const __m256i pos = _mm256_castps_si256(_mm256_cmp_ps(s1, _mm256_setzero_ps(), _CMP_GT_OQ));
    const __m256i delta = _mm256_add_epi32(m1i, _mm256_and_si256(pos, two)); /* +1 if s1 > 0, else −1 */
    q1 = _mm256_and_si256(_mm256_add_epi32(q1, _mm256_and_si256(differ, delta)), lo8);
    store_u8x8(state1 + j, q1);
    store_u8x8(state2 + j, lut_search8(c->lut2, LUT_KNEG(0), _mm256_div_ps(s2, m2v)));
  }
}
#undef FX

/* One block with a kernel's two passes: each fast pass, then the flags,
 * then the flushed pass where a flag was raised (see above). Written once,
 * compiled for each instruction set's passes. */
#define Q8_BLOCK_FN(ATTR, name, pass1, pass2)                                                                         \
  ATTR static size_t name(const q8ctx *c, float *p, const float *g, uint8_t *state1, uint8_t *state2, float *absmax1, \
                          float *absmax2, size_t B, float *s1b, float *s2b, float *psave, int fast) {                 \
    float m1, m2;                                                                                                     \
    size_t bad;                                                                                                       \
    int redo = 1;                                                                                                     \
    if (fast) {                                                                                                       \
      flags_clear();                                                                                                  \
      bad = pass1(c, g, state1, state2, *absmax1, *absmax2, B, s1b, s2b, &m1, &m2, 0);                                \
      redo = flags_raised();                                                                                          \
    }                                                                                                                 \
    if (redo) bad = pass1(c, g, state1, state2, *absmax1, *absmax2, B, s1b, s2b, &m1, &m2, 1);                        \
    /* 2. absmax of the new, unquantised states */                                                                    \
    *absmax1 = m1;                                                                                                    \
    *absmax2 = m2;                                                                                                    \
    if (fast) {                                                                                                       \
      flags_clear();                                                                                                  \
      pass2(c, p, p, psave, g, state1, state2, B, s1b, s2b, m1, m2, 0);                                               \
      if (flags_raised()) pass2(c, p, psave, NULL, g, state1, state2, B, s1b, s2b, m1, m2, 1);                        \
    } else {                                                                                                          \
      pass2(c, p, p, NULL, g, state1, state2, B, s1b, s2b, m1, m2, 1);                                                \
    }                                                                                                                 \
    return bad;                                                                                                       \
  }

Q8_BLOCK_FN(AVX2_FN, block_avx2, pass1_avx2, pass2_avx2)

/* F() on 16 lanes: a subnormal becomes a zero of its sign */
AVX512_FN static inline __m512 F16(__m512 x) {
  return _mm512_mask_and_ps(x, _mm512_fpclass_ps_mask(x, 0x20), x, _mm512_set1_ps(-0.0f));
}

/* The byte order deq64 reads: after the two interleaving steps (within
 * 128-bit lanes) output c, lane L, slot j holds input byte 16L + 4c + j, so
 * that byte must be element 16c + 4L + j of the 64. */
static _Alignas(64) const uint8_t g_deq_order[64] = {
#define O4(L, c) 16 * (c) + 4 * (L), 16 * (c) + 4 * (L) + 1, 16 * (c) + 4 * (L) + 2, 16 * (c) + 4 * (L) + 3
#define O16(L) O4(L, 0), O4(L, 1), O4(L, 2), O4(L, 3)
    O16(0), O16(1), O16(2), O16(3)
#undef O16
#undef O4
};

/* code[q[0..63]] into out[0..3] (16 floats each, in order); pl: the code's
 * byte planes [4][256] */
AVX512_FN static inline __attribute__((always_inline)) void deq64(const uint8_t *pl, const uint8_t *q,
                                                                  __m512 out[4]) {
  const __m512i idx =
      _mm512_permutexvar_epi8(_mm512_load_si512((const void *)g_deq_order), _mm512_loadu_si512((const void *)q));
  const __mmask64 hi = _mm512_movepi8_mask(idx); /* code index >= 128 */
  __m512i P[4];
  for (int k = 0; k < 4; k++) {
    const uint8_t *t = pl + DOPT_Q8_CODES * k;
    const __m512i lo = _mm512_permutex2var_epi8(_mm512_load_si512((const void *)t), idx,
                                                _mm512_load_si512((const void *)(t + 64)));
    const __m512i up = _mm512_permutex2var_epi8(_mm512_load_si512((const void *)(t + 128)), idx,
                                                _mm512_load_si512((const void *)(t + 192)));
    P[k] = _mm512_mask_blend_epi8(hi, lo, up);
  }
  const __m512i w01l = _mm512_unpacklo_epi8(P[0], P[1]), w01h = _mm512_unpackhi_epi8(P[0], P[1]);
  const __m512i w23l = _mm512_unpacklo_epi8(P[2], P[3]), w23h = _mm512_unpackhi_epi8(P[2], P[3]);
  out[0] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(w01l, w23l));
  out[1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(w01l, w23l));
  out[2] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(w01h, w23h));
  out[3] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(w01h, w23h));
}

#define FX16(x) (exact ? F16(x) : (x))
#define NONFINITE 0x99 /* fpclass: QNaN, SNaN, +inf, -inf */

/* pass1_avx2 on 16 lanes, 64 slots at a time */
AVX512_FN static inline __attribute__((always_inline)) size_t pass1_avx512(const q8ctx *c, const float *g,
                                                                           const uint8_t *state1,
                                                                           const uint8_t *state2, float a1s, float a2s,
                                                                           size_t B, float *s1b, float *s2b, float *m1,
                                                                           float *m2, int exact) {
  const scalars k = c->k;
  const __m512 gscale = _mm512_set1_ps(k.gscale), beta1 = _mm512_set1_ps(k.beta1), beta2 = _mm512_set1_ps(k.beta2);
  const __m512 omb1 = _mm512_set1_ps(k.omb1), omb2 = _mm512_set1_ps(k.omb2);
  const __m512 a1 = _mm512_set1_ps(a1s), a2 = _mm512_set1_ps(a2s);
  __m512 mx1 = _mm512_set1_ps(-FLT_MAX), mx2 = mx1;
  size_t bad = 0;
  for (size_t j = 0; j < B; j += 64) {
    __m512 d1[4], d2[4];
    deq64(dopt__q8_planes[1][0], state1 + j, d1);
    deq64(dopt__q8_planes[0][0], state2 + j, d2);
    for (int u = 0; u < 4; u++) {
      const size_t o = j + 16 * (size_t)u;
      const __m512 gj = FX16(_mm512_loadu_ps(g + o));
      const __mmask16 fin = (__mmask16)~_mm512_fpclass_ps_mask(gj, NONFINITE);
      bad += (size_t)__builtin_popcount(~(unsigned)fin & 0xffffu);
      const __m512 gs = FX16(_mm512_mul_ps(gj, gscale));
      __m512 s2 = FX16(_mm512_mul_ps(d2[u], a2));
      s2 = FX16(_mm512_add_ps(FX16(_mm512_mul_ps(s2, beta2)), FX16(_mm512_mul_ps(FX16(_mm512_mul_ps(omb2, gs)), gs))));
      __m512 s1 = FX16(_mm512_mul_ps(d1[u], a1));
      s1 = FX16(_mm512_add_ps(FX16(_mm512_mul_ps(s1, beta1)), FX16(_mm512_mul_ps(omb1, gs))));
      s1 = _mm512_maskz_mov_ps(fin, s1); /* non-finite g: +0 */
      s2 = _mm512_maskz_mov_ps(fin, s2);
      mx1 = _mm512_max_ps(_mm512_abs_ps(s1), mx1);
      mx2 = _mm512_max_ps(_mm512_abs_ps(s2), mx2);
      _mm512_store_ps(s1b + o, s1);
      _mm512_store_ps(s2b + o, s2);
    }
  }
  *m1 = _mm512_reduce_max_ps(mx1); /* never NaN: any order */
  *m2 = _mm512_reduce_max_ps(mx2);
  return bad;
}

/* RN(s/m) for m in [2^-100, 2^100] from y = RN(1/m) (Markstein: q within an
 * ulp, the remainder s − m·q exact, one correction). A subnormal anywhere on
 * the way raises UE or DE, and the pass reruns with divisions. */
AVX512_FN static inline __m512 quot16(__m512 s, __m512 m, __m512 y) {
  const __m512 q = _mm512_mul_ps(s, y);
  return _mm512_fmadd_ps(_mm512_fnmadd_ps(m, q, s), y, q);
}

/* pass2_avx2 on 16 lanes; the fast pass forms the two quotients by quot16 */
AVX512_FN static inline __attribute__((always_inline)) void pass2_avx512(const q8ctx *c, float *p, const float *psrc,
                                                                         float *psave, const float *g,
                                                                         uint8_t *state1, uint8_t *state2, size_t B,
                                                                         const float *s1b, const float *s2b, float m1,
                                                                         float m2, int exact) {
  const scalars k = c->k;
  const __m512 m1v = _mm512_set1_ps(m1), m2v = _mm512_set1_ps(m2);
  const int recip = !exact && m1 >= 0x1p-100f && m1 <= 0x1p100f && m2 >= 0x1p-100f && m2 <= 0x1p100f;
  const __m512 y1v = _mm512_set1_ps(recip ? 1.0f / m1 : 0.0f), y2v = _mm512_set1_ps(recip ? 1.0f / m2 : 0.0f);
  const __m512 step_size = _mm512_set1_ps(k.step_size), c2eps = _mm512_set1_ps(k.c2eps),
               decay = _mm512_set1_ps(k.decay), zero = _mm512_setzero_ps();
  const __m512i k127 = _mm512_set1_epi32(127), one = _mm512_set1_epi32(1);
  for (size_t j = 0; j < B; j += 16) {
    const __m512 s1 = _mm512_load_ps(s1b + j), s2 = _mm512_load_ps(s2b + j);
    const __mmask16 fin = (__mmask16)~_mm512_fpclass_ps_mask(_mm512_loadu_ps(g + j), NONFINITE);
    const __m512 p0 = _mm512_loadu_ps(psrc + j);
    if (!exact) _mm512_store_ps(psave + j, p0);
    __m512 pj = FX16(p0);
    const __m512 den = FX16(_mm512_add_ps(FX16(_mm512_sqrt_ps(s2)), c2eps));
    pj = FX16(_mm512_add_ps(pj, FX16(_mm512_mul_ps(step_size, FX16(_mm512_div_ps(s1, den))))));
    if (k.decay_on) pj = FX16(_mm512_mul_ps(pj, decay));
    _mm512_storeu_ps(p + j, _mm512_mask_mov_ps(p0, fin, F16(pj))); /* F16 again: the flags' blind spot */
    const __m512 x1 = recip ? quot16(s1, m1v, y1v) : _mm512_div_ps(s1, m1v);
    const __m512 x2 = recip ? quot16(s2, m2v, y2v) : _mm512_div_ps(s2, m2v);
    __m512i q1 = lut_search16(c->lut1, LUT_KNEG(1), x1);
    /* sign fix: code1[q] is negative exactly for q < 127; ±1 by the sign of s1 (mod 256 at the store) */
    const __mmask16 differ = _mm512_cmplt_epi32_mask(q1, k127) ^ _mm512_movepi32_mask(_mm512_castps_si512(s1));
    const __mmask16 pos = _mm512_cmp_ps_mask(s1, zero, _CMP_GT_OQ);
    q1 = _mm512_mask_add_epi32(q1, differ & pos, q1, one);
    q1 = _mm512_mask_sub_epi32(q1, differ & (__mmask16)~pos, q1, one);
    _mm_storeu_si128((__m128i *)(void *)(state1 + j), _mm512_cvtepi32_epi8(q1));
    _mm_storeu_si128((__m128i *)(void *)(state2 + j), _mm512_cvtepi32_epi8(lut_search16(c->lut2, LUT_KNEG(0), x2)));
  }
}
#undef FX16
#undef NONFINITE

Q8_BLOCK_FN(AVX512_FN, block_avx512, pass1_avx512, pass2_avx512)
#endif

static dopt_status ctx_of(const dopt_q8_adam_hp *hp, const char *fn, q8ctx *c) {
  DOPT_TRY(check_hp(hp, fn));
  DOPT_CHECK_ARG(dopt_q8_block_ok(hp->block), "%s: block=%zu must be a power of two in [64, 4096]", fn, hp->block);
  c->k = kernel_scalars(hp);
  c->code1 = dopt_q8_map(1);
  c->code2 = dopt_q8_map(0);
  c->lut1 = dopt__q8_lut(1);
  c->lut2 = dopt__q8_lut(0);
  return DOPT_OK;
}

dopt_status dopt__q8_adam_update_impl(float *p, const float *g, uint8_t *state1, uint8_t *state2, float *absmax1,
                                      float *absmax2, size_t n, const dopt_q8_adam_hp *hp, size_t *nonfinite,
                                      dopt_q8_impl impl) {
  q8ctx c;
  DOPT_TRY(ctx_of(hp, "dopt_q8_adam_update", &c));
  DOPT_CHECK_ARG(n == 0 || (p && g && state1 && state2 && absmax1 && absmax2), "dopt_q8_adam_update: NULL array");
  dopt_q8_impl use;
  DOPT_TRY(dopt__q8_impl_pick(impl, "dopt_q8_adam_update", &use));
  const size_t B = hp->block;
  size_t bad = 0;
#ifdef Q8_AVX2
  const int wide = c.lut1 && c.lut2 && use != DOPT_Q8_IMPL_SCALAR;
  const int w512 = wide && use == DOPT_Q8_IMPL_AVX512;
  _Alignas(64) float s1b[DOPT_Q8_BLOCK_MAX], s2b[DOPT_Q8_BLOCK_MAX], psave[DOPT_Q8_BLOCK_MAX];
  const unsigned csr0 = wide ? _mm_getcsr() : 0;
  const int fast = wide && (csr0 & ~0x3fu) == CSR_DEFAULT; /* the six flags aside */
#endif
  for (size_t b0 = 0, blk = 0; b0 < n; b0 += B, blk++) {
    const size_t valid = n - b0 < B ? n - b0 : B;
#ifdef Q8_AVX2
    if (w512 && valid == B) {
      bad += block_avx512(&c, p + b0, g + b0, state1 + b0, state2 + b0, absmax1 + blk, absmax2 + blk, B, s1b, s2b,
                          psave, fast);
      continue;
    }
    if (wide && valid == B) {
      bad += block_avx2(&c, p + b0, g + b0, state1 + b0, state2 + b0, absmax1 + blk, absmax2 + blk, B, s1b, s2b,
                        psave, fast);
      continue;
    }
#endif
    bad += block_scalar(&c, p + b0, g + b0, state1 + b0, state2 + b0, absmax1 + blk, absmax2 + blk, valid, B);
  }
#ifdef Q8_AVX2
  if (fast) _mm_setcsr(_mm_getcsr() | (csr0 & 0x3fu)); /* the caller's sticky flags back */
#endif
  if (nonfinite) *nonfinite = bad;
  return DOPT_OK;
}

dopt_status dopt_q8_adam_update(float *p, const float *g, uint8_t *state1, uint8_t *state2, float *absmax1,
                                float *absmax2, size_t n, const dopt_q8_adam_hp *hp, size_t *nonfinite) {
  return dopt__q8_adam_update_impl(p, g, state1, state2, absmax1, absmax2, n, hp, nonfinite, DOPT_Q8_IMPL_AUTO);
}

dopt_status dopt_q8_adam_absmax(const float *g, const uint8_t *state1, const uint8_t *state2, float a1, float a2,
                                size_t n, size_t pad, const dopt_q8_adam_hp *hp, float *m1, float *m2,
                                size_t *nonfinite) {
  q8ctx c;
  DOPT_TRY(ctx_of(hp, "dopt_q8_adam_absmax", &c));
  DOPT_CHECK_ARG((n == 0 || (g && state1 && state2)) && m1 && m2, "dopt_q8_adam_absmax: NULL array");
  DOPT_CHECK_ARG(n + pad <= hp->block, "dopt_q8_adam_absmax: n=%zu + pad=%zu slots exceed the block of %zu", n, pad,
                 hp->block);
  float x1 = *m1, x2 = *m2, s1, s2;
  size_t bad = 0;
  for (size_t j = 0; j < n; j++) {
    bad += !new_states(&c, F(g[j]), state1[j], state2[j], a1, a2, &s1, &s2);
    x1 = fmaxf(x1, fabsf(s1));
    x2 = fmaxf(x2, fabsf(s2));
  }
  if (pad) { /* every padding slot has the same new states */
    new_states(&c, 0.0f, 128, 0, a1, a2, &s1, &s2);
    x1 = fmaxf(x1, fabsf(s1));
    x2 = fmaxf(x2, fabsf(s2));
  }
  *m1 = x1, *m2 = x2;
  if (nonfinite) *nonfinite += bad;
  return DOPT_OK;
}

dopt_status dopt_q8_adam_apply(float *p, const float *g, uint8_t *state1, uint8_t *state2, float a1, float a2,
                               float m1, float m2, size_t n, const dopt_q8_adam_hp *hp) {
  q8ctx c;
  DOPT_TRY(ctx_of(hp, "dopt_q8_adam_apply", &c));
  DOPT_CHECK_ARG(n == 0 || (p && g && state1 && state2), "dopt_q8_adam_apply: NULL array");
  DOPT_CHECK_ARG(n <= hp->block, "dopt_q8_adam_apply: n=%zu exceeds the block of %zu", n, hp->block);
  for (size_t j = 0; j < n; j++) {
    float s1, s2;
    new_states(&c, F(g[j]), state1[j], state2[j], a1, a2, &s1, &s2);
    apply_elem(&c, &p[j], g[j], s1, s2, m1, m2, &state1[j], &state2[j]);
  }
  return DOPT_OK;
}

dopt_status dopt_q8_adam32_update(float *p, const float *g, float *state1, float *state2, size_t n,
                                  const dopt_q8_adam_hp *hp) {
  DOPT_TRY(check_hp(hp, "dopt_q8_adam32_update"));
  DOPT_CHECK_ARG(n == 0 || (p && g && state1 && state2), "dopt_q8_adam32_update: NULL array");
  const scalars k = kernel_scalars(hp);
  for (size_t i = 0; i < n; i++) {
    const float gs = F(F(g[i]) * k.gscale);
    const float s1 = F(F(state1[i] * k.beta1) + F(k.omb1 * gs));
    const float s2 = F(F(state2[i] * k.beta2) + F(k.omb2 * F(gs * gs)));
    float pj = F(p[i]);
    pj = F(pj + F(k.step_size * F(s1 / F(F(sqrtf(s2)) + k.c2eps))));
    if (k.decay_on) pj = F(pj * k.decay);
    p[i] = pj;
    state1[i] = s1;
    state2[i] = s2;
  }
  return DOPT_OK;
}

/* ---- percentile clipping ------------------------------------------------------------ */

/* ascending, NaN last (torch.sort) */
static int cmp_nan_last(const void *a, const void *b) {
  float x = *(const float *)a, y = *(const float *)b;
  if (isnan(x) || isnan(y)) return isnan(x) - isnan(y);
  return (x > y) - (x < y);
}

float dopt_q8_percentile_clipping(const float *g, size_t n, float *gnorm_vec, int64_t step, int percentile,
                                  int *clipped) {
  /* exact, rounded to double; NaN if a gradient is NaN, else +inf if one is infinite (as a plain double sum) */
  return dopt__q8_percentile_scale(dopt_sumsq(g, n), gnorm_vec, step, percentile, clipped);
}

float dopt__q8_percentile_scale(double ss, float *gnorm_vec, int64_t step, int percentile, int *clipped) {
  const float gn = (float)ss;
  const size_t slot = (size_t)(step % DOPT_Q8_GNORM_HISTORY);
  gnorm_vec[slot] = 0.0f; /* upstream zeroes the slot, then the kernel adds ‖g‖² */
  if (step == 1) {
    for (int i = 0; i < DOPT_Q8_GNORM_HISTORY; i++) gnorm_vec[i] += gn; /* into every slot */
  } else {
    gnorm_vec[slot] += gn;
  }
  float sorted[DOPT_Q8_GNORM_HISTORY];
  memcpy(sorted, gnorm_vec, sizeof sorted);
  qsort(sorted, DOPT_Q8_GNORM_HISTORY, sizeof *sorted, cmp_nan_last);
  if (percentile < 0) percentile = 0;
  if (percentile >= DOPT_Q8_GNORM_HISTORY) percentile = DOPT_Q8_GNORM_HISTORY - 1;
  const float current = sqrtf(gnorm_vec[slot]);
  const float clip = sqrtf(sorted[percentile]);
  const float scale = current > clip ? clip / current : 1.0f;
  if (clipped) *clipped = scale != 1.0f;
  return scale;
}
