/* 8-bit blockwise quantisation with bitsandbytes' CUDA semantics (see
 * distopt/quant8.h and docs/adamw8bit.md): the dynamic maps, the CUDA binary
 * search and the fast exact search's tables (scalar, AVX2, AVX-512), and
 * blockwise quantise / dequantise. The 8-bit Adam kernels are
 * ref/quant8_adam.c; what both use is ref/quant8_lut.h.
 *
 * Every fp32 operation below is one IEEE operation (the build has
 * -ffp-contract=off and no fast math) followed by F(), which emulates the GPU's
 * flush-to-zero; loads of gradients and parameters are flushed likewise
 * (denormals-are-zero). Where upstream contracts into an FMA or uses an
 * approximate instruction (fast pow, __fdividef, the approximate reciprocal
 * and sqrt) we use the correctly rounded operation instead: that is the only
 * intended difference from the GPU. */
#include "distopt/quant8.h"

#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "quant8_fast.h"
#include "quant8_lut.h"
#include "registry.h"

/* ---- maps ------------------------------------------------------------------------ */

/* torch.linspace(0.1, 1, n) in fp32 as torch 1.13's CPU kernel computes it
 * (the AVX2 build Debian ships, the one that made the golden maps):
 * step = (end − start)/(n − 1); the first floor(n/16)·16 items in vectors of
 * 8: base = scalar(i), item i+k = base + k·step (two roundings, as
 * Vectorized<float>::arange); the rest scalar(i) = start + step·i for
 * i < n/2, else end − step·(n−1−i), each one FMA (contracted by the compiler
 * in that kernel). Verified against the real maps (all 256 entries, both maps). */
static void torch_linspace(float start, float end, int n, float *out) {
  const float step = (end - start) / (float)(n - 1);
  const int half = n / 2;
  const int nvec = (n / 16) * 16;
#define SCALAR_AT(i) ((i) < half ? fmaf(step, (float)(i), start) : fmaf(-step, (float)(n - 1 - (i)), end))
  for (int i = 0; i < nvec; i += 8) {
    const float base = SCALAR_AT(i);
    for (int k = 0; k < 8; k++) {
      const float ks = (float)k * step;
      out[i + k] = base + ks;
    }
  }
  for (int i = nvec; i < n; i++) out[i] = SCALAR_AT(i);
#undef SCALAR_AT
}

static int cmp_float(const void *a, const void *b) {
  float x = *(const float *)a, y = *(const float *)b;
  return (x > y) - (x < y);
}

void dopt_q8_create_dynamic_map(int is_signed, float code[DOPT_Q8_CODES]) {
  /* max_exponent_bits = 7, total_bits = 8: non_sign_bits = 7 for both
   * (upstream subtracts 1 in either case), so no "additional items". */
  float b[130];
  int k = 0;
  for (int i = 0; i < 7; i++) {
    const int items = is_signed ? (1 << i) + 1 : (1 << (i + 1)) + 1;
    torch_linspace(0.1f, 1.0f, items, b);
    /* 10 ** (i − 6) is a Python float (an int 1 for i = 6); torch multiplies
     * the fp32 tensor by it rounded to fp32 */
    const float scale = (float)pow(10.0, (double)(i - 6));
    for (int j = 0; j + 1 < items; j++) {
      const float mean = (b[j] + b[j + 1]) / 2.0f;
      code[k++] = scale * mean;
      if (is_signed) code[k++] = -scale * mean;
    }
  }
  code[k++] = 0.0f;
  code[k++] = 1.0f;
  /* k == 256 for both maps (upstream asserts it) */
  qsort(code, (size_t)k, sizeof *code, cmp_float);
}

static float g_maps[2][DOPT_Q8_CODES];
static pthread_once_t g_maps_once = PTHREAD_ONCE_INIT;
static void build_luts(void);
static void build_maps(void) {
  dopt_q8_create_dynamic_map(0, g_maps[0]);
  dopt_q8_create_dynamic_map(1, g_maps[1]);
  build_luts();
}

const float *dopt_q8_map(int is_signed) {
  pthread_once(&g_maps_once, build_maps);
  return g_maps[is_signed ? 1 : 0];
}

/* ---- search and blockwise quantisation ------------------------------------------ */

int dopt_q8_block_ok(size_t block) {
  return block >= DOPT_Q8_BLOCK_MIN && block <= DOPT_Q8_BLOCK_MAX && (block & (block - 1)) == 0;
}

size_t dopt_q8_num_blocks(size_t n, size_t block) { return block ? (n + block - 1) / block : 0; }

/* The specification: the CUDA search, step by step. The fast search below
 * must agree with it on every input (tests/unit/test_quant8.c). */
uint8_t dopt_q8_search(const float *code, float x) {
  int pivot = 127, upper = 255, lower = 0;
  float upper_v = 1.0f, lower_v = -1.0f, val = code[pivot];
  for (int s = 64; s > 0; s >>= 1) {
    if (x > val) {
      lower = pivot;
      lower_v = val;
      pivot += s;
    } else {
      upper = pivot;
      upper_v = val;
      pivot -= s;
    }
    val = code[pivot];
  }
  /* bounds the search never moved take the map's ends (the pivot reaches at
   * most 254 and reaches 0 only at the very end, so these mean "untouched") */
  if (upper == 255) upper_v = code[255];
  if (lower == 0) lower_v = code[0];
  if (x > val) {
    const float mid = F((upper_v + val) * 0.5f);
    return (uint8_t)(x > mid ? upper : pivot);
  }
  const float mid = F((lower_v + val) * 0.5f);
  return (uint8_t)(x < mid ? lower : pivot); /* NaN: every comparison false → pivot 0 */
}

/* ---- the fast search's tables (the method and the search itself: ref/quant8_lut.h) ------ */

static uint32_t g_lut[2][LUT_N];
static int g_lut_ok[2];

static float float_of(uint32_t b) {
  float f;
  memcpy(&f, &b, sizeof f);
  return f;
}

/* builds t for code; 0 if an assumption of the method fails for this code */
static int build_lut(const float *code, int kneg, uint32_t *t) {
  if (dopt_q8_search(code, float_of(LUT_LO)) != dopt_q8_search(code, 0.0f)) return 0;
  if (dopt_q8_search(code, INFINITY) != dopt_q8_search(code, 1.0f)) return 0;
  for (size_t i = 0; i < LUT_N; i++) {
    const uint32_t lo = LUT_LO + ((uint32_t)i << 16), span = i + 1 < LUT_N ? 0xffffu : 0u;
    const int r0 = dopt_q8_search(code, float_of(lo)), r1 = dopt_q8_search(code, float_of(lo + span));
    if (r1 != r0 && r1 != r0 + 1) return 0;
    uint32_t split = 0xffffu;
    if (r1 != r0) { /* the last low part with byte r0 */
      uint32_t a = 0, z = span;
      while (z - a > 1) {
        const uint32_t m = a + (z - a) / 2;
        if (dopt_q8_search(code, float_of(lo + m)) == r0) a = m;
        else z = m;
      }
      split = a;
    }
    t[i] = (uint32_t)r0 | split << 16;
    /* the step and the negative rule at the bucket's probe points */
    const uint32_t probe[4] = {lo, lo + (split < span ? split : 0), lo + (split < span ? split + 1 : 0), lo + span};
    for (int k = 0; k < 4; k++)
      for (int sg = 0; sg < 2; sg++) {
        const float x = sg ? -float_of(probe[k]) : float_of(probe[k]);
        if (lut_search(t, kneg, x) != dopt_q8_search(code, x)) return 0;
      }
  }
  const float edge[6] = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, -NAN};
  for (int k = 0; k < 6; k++)
    if (lut_search(t, kneg, edge[k]) != dopt_q8_search(code, edge[k])) return 0;
  return 1;
}

/* the maps as byte planes for the AVX-512 dequantisation (ref/quant8_lut.h) */
_Alignas(64) uint8_t dopt__q8_planes[2][4][DOPT_Q8_CODES];

static void build_luts(void) {
  for (int s = 0; s < 2; s++) {
    g_lut_ok[s] = build_lut(g_maps[s], LUT_KNEG(s), g_lut[s]);
    for (int i = 0; i < DOPT_Q8_CODES; i++)
      for (int k = 0; k < 4; k++) dopt__q8_planes[s][k][i] = (uint8_t)(bits_of(g_maps[s][i]) >> (8 * k));
  }
  /* the update's sign fix tests signbit(code1[q]) as q < 127 */
  for (int q = 0; q < DOPT_Q8_CODES; q++)
    if ((signbit(g_maps[1][q]) != 0) != (q < 127)) g_lut_ok[1] = 0;
}

const uint32_t *dopt__q8_lut(int is_signed) {
  pthread_once(&g_maps_once, build_maps);
  const int s = is_signed ? 1 : 0;
  return g_lut_ok[s] ? g_lut[s] : NULL;
}

/* the table for code if it is a built-in map (by address), else NULL */
static const uint32_t *lut_for(const float *code, int *kneg) {
  for (int s = 0; s < 2; s++)
    if (code == dopt_q8_map(s)) {
      *kneg = LUT_KNEG(s);
      return dopt__q8_lut(s);
    }
  return NULL;
}

uint8_t dopt__q8_search_lut(int is_signed, float x) {
  const uint32_t *t = dopt__q8_lut(is_signed);
  return search_any(dopt_q8_map(is_signed), t, LUT_KNEG(is_signed), x);
}

#ifdef Q8_AVX2
/* Read-only after libgcc's constructor ran: safe from any thread. */
int dopt__q8_have_avx2(void) { return __builtin_cpu_supports("avx2") != 0; }

AVX2_FN static void search_n_avx2(const uint32_t *t, int kneg, const float *x, size_t n, uint8_t *q) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) store_u8x8(q + i, lut_search8(t, kneg, _mm256_loadu_ps(x + i)));
  for (; i < n; i++) q[i] = lut_search(t, kneg, x[i]);
}

int dopt__q8_have_avx512(void) {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("fma") && dopt__q8_have_avx2();
}

AVX512_FN static void search_n_avx512(const uint32_t *t, int kneg, const float *x, size_t n, uint8_t *q) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm_storeu_si128((__m128i *)(void *)(q + i),
                     _mm512_cvtepi32_epi8(lut_search16(t, kneg, _mm512_loadu_ps(x + i))));
  for (; i < n; i++) q[i] = lut_search(t, kneg, x[i]);
}

#else
int dopt__q8_have_avx2(void) { return 0; }
int dopt__q8_have_avx512(void) { return 0; }
#endif

/* The implementation a call runs (*use: AUTO resolved to the widest this CPU
 * runs); DOPT_ERR_UNSUPPORTED for one this CPU (or build) cannot run */
dopt_status dopt__q8_impl_pick(dopt_q8_impl impl, const char *fn, dopt_q8_impl *use) {
  DOPT_CHECK_ARG(impl >= DOPT_Q8_IMPL_AUTO && impl <= DOPT_Q8_IMPL_AVX512, "%s: impl=%d is not a dopt_q8_impl", fn,
                 (int)impl);
  if (impl == DOPT_Q8_IMPL_AVX2 && !dopt__q8_have_avx2())
    return dopt__fail(DOPT_ERR_UNSUPPORTED, "%s: AVX2 is not available", fn);
  if (impl == DOPT_Q8_IMPL_AVX512 && !dopt__q8_have_avx512())
    return dopt__fail(DOPT_ERR_UNSUPPORTED, "%s: AVX-512 (F, BW, DQ, VL, VBMI) is not available", fn);
  *use = impl != DOPT_Q8_IMPL_AUTO ? impl
         : dopt__q8_have_avx512()  ? DOPT_Q8_IMPL_AVX512
         : dopt__q8_have_avx2()    ? DOPT_Q8_IMPL_AVX2
                                   : DOPT_Q8_IMPL_SCALAR;
  return DOPT_OK;
}

dopt_status dopt__q8_search_n(int is_signed, const float *x, size_t n, uint8_t *q, dopt_q8_impl impl) {
  DOPT_CHECK_ARG(n == 0 || (x && q), "dopt__q8_search_n: NULL array");
  const int kneg = LUT_KNEG(is_signed);
  const uint32_t *t = dopt__q8_lut(is_signed);
  const float *code = dopt_q8_map(is_signed);
  dopt_q8_impl use;
  DOPT_TRY(dopt__q8_impl_pick(impl, "dopt__q8_search_n", &use));
#ifdef Q8_AVX2
  if (t && use == DOPT_Q8_IMPL_AVX512) {
    search_n_avx512(t, kneg, x, n, q);
    return DOPT_OK;
  }
  if (t && use == DOPT_Q8_IMPL_AVX2) {
    search_n_avx2(t, kneg, x, n, q);
    return DOPT_OK;
  }
#endif
  for (size_t i = 0; i < n; i++) q[i] = search_any(code, t, kneg, x[i]);
  return DOPT_OK;
}

dopt_status dopt_q8_quantize_blockwise(const float *code, const float *x, size_t n, size_t block, uint8_t *q,
                                       float *absmax) {
  DOPT_CHECK_ARG(code && (x || !n) && (q || !n) && (absmax || !n), "dopt_q8_quantize_blockwise: NULL argument");
  DOPT_CHECK_ARG(dopt_q8_block_ok(block), "dopt_q8_quantize_blockwise: block=%zu must be a power of two in [64, 4096]",
                 block);
  int kneg = 0;
  const uint32_t *t = lut_for(code, &kneg); /* NULL for a map of the caller's: the search above */
  for (size_t b0 = 0, blk = 0; b0 < n; b0 += block, blk++) {
    const size_t valid = n - b0 < block ? n - b0 : block;
    float m = -FLT_MAX;
    for (size_t j = 0; j < valid; j++) m = fmaxf(m, fabsf(F(x[b0 + j])));
    absmax[blk] = m;
    const float inv = F(1.0f / m);
    for (size_t j = 0; j < valid; j++) q[b0 + j] = search_any(code, t, kneg, F(F(x[b0 + j]) * inv));
  }
  return DOPT_OK;
}

dopt_status dopt_q8_dequantize_blockwise(const float *code, const uint8_t *q, const float *absmax, size_t n,
                                         size_t block, float *out) {
  DOPT_CHECK_ARG(code && (q || !n) && (absmax || !n) && (out || !n), "dopt_q8_dequantize_blockwise: NULL argument");
  DOPT_CHECK_ARG(dopt_q8_block_ok(block),
                 "dopt_q8_dequantize_blockwise: block=%zu must be a power of two in [64, 4096]", block);
  for (size_t i = 0; i < n; i++) out[i] = F(code[q[i]] * absmax[i / block]);
  return DOPT_OK;
}
