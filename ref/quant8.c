/* 8-bit blockwise quantisation and the 8-bit Adam kernels with bitsandbytes'
 * CUDA semantics (see distopt/quant8.h and docs/adamw8bit.md).
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

#include "registry.h"

/* flush-to-zero: subnormals become a zero of the same sign */
static inline float F(float x) { return fabsf(x) < FLT_MIN ? copysignf(0.0f, x) : x; }

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
static void build_maps(void) {
  dopt_q8_create_dynamic_map(0, g_maps[0]);
  dopt_q8_create_dynamic_map(1, g_maps[1]);
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

dopt_status dopt_q8_quantize_blockwise(const float *code, const float *x, size_t n, size_t block, uint8_t *q,
                                       float *absmax) {
  DOPT_CHECK_ARG(code && (x || !n) && (q || !n) && (absmax || !n), "dopt_q8_quantize_blockwise: NULL argument");
  DOPT_CHECK_ARG(dopt_q8_block_ok(block), "dopt_q8_quantize_blockwise: block=%zu must be a power of two in [64, 4096]",
                 block);
  for (size_t b0 = 0, blk = 0; b0 < n; b0 += block, blk++) {
    const size_t valid = n - b0 < block ? n - b0 : block;
    float m = -FLT_MAX;
    for (size_t j = 0; j < valid; j++) m = fmaxf(m, fabsf(F(x[b0 + j])));
    absmax[blk] = m;
    const float inv = F(1.0f / m);
    for (size_t j = 0; j < valid; j++) q[b0 + j] = dopt_q8_search(code, F(F(x[b0 + j]) * inv));
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

dopt_status dopt_q8_adam_update(float *p, const float *g, uint8_t *state1, uint8_t *state2, float *absmax1,
                                float *absmax2, size_t n, const dopt_q8_adam_hp *hp, size_t *nonfinite) {
  DOPT_TRY(check_hp(hp, "dopt_q8_adam_update"));
  DOPT_CHECK_ARG(n == 0 || (p && g && state1 && state2 && absmax1 && absmax2), "dopt_q8_adam_update: NULL array");
  DOPT_CHECK_ARG(dopt_q8_block_ok(hp->block), "dopt_q8_adam_update: block=%zu must be a power of two in [64, 4096]",
                 hp->block);
  const float *code1 = dopt_q8_map(1), *code2 = dopt_q8_map(0);
  const scalars k = kernel_scalars(hp);
  const size_t B = hp->block;
  float s1b[DOPT_Q8_BLOCK_MAX], s2b[DOPT_Q8_BLOCK_MAX];
  size_t bad = 0;
  for (size_t b0 = 0, blk = 0; b0 < n; b0 += B, blk++) {
    const size_t valid = n - b0 < B ? n - b0 : B;
    const float a1 = absmax1[blk], a2 = absmax2[blk];
    float m1 = -FLT_MAX, m2 = -FLT_MAX;
    /* 1. new states of all B slots (padding: g = 0, byte 128 / byte 0) */
    for (size_t j = 0; j < B; j++) {
      const int in = j < valid;
      const float gj = in ? F(g[b0 + j]) : 0.0f;
      const uint8_t q1 = in ? state1[b0 + j] : 128, q2 = in ? state2[b0 + j] : 0;
      float s1 = 0.0f, s2 = 0.0f;
      if (isfinite(gj)) {
        const float gs = F(gj * k.gscale);
        s2 = F(code2[q2] * a2);
        s2 = F(F(s2 * k.beta2) + F(F(k.omb2 * gs) * gs));
        s1 = F(code1[q1] * a1);
        s1 = F(F(s1 * k.beta1) + F(k.omb1 * gs));
      } else {
        bad++;
      }
      m1 = fmaxf(m1, fabsf(s1));
      m2 = fmaxf(m2, fabsf(s2));
      s1b[j] = s1;
      s2b[j] = s2;
    }
    /* 2. absmax of the new, unquantised states */
    absmax1[blk] = m1;
    absmax2[blk] = m2;
    for (size_t j = 0; j < valid; j++) {
      const float s1 = s1b[j], s2 = s2b[j];
      /* 3. parameter: step from the full-precision states, then decay */
      if (isfinite(F(g[b0 + j]))) {
        float pj = F(p[b0 + j]);
        const float den = F(F(sqrtf(s2)) + k.c2eps);
        pj = F(pj + F(k.step_size * F(s1 / den)));
        if (k.decay_on) pj = F(pj * k.decay);
        p[b0 + j] = pj;
      }
      /* 4. requantise; keep the sign of m */
      uint8_t q1 = dopt_q8_search(code1, F(s1 / m1));
      if (signbit(code1[q1]) != signbit(s1)) q1 = (uint8_t)(s1 > 0.0f ? q1 + 1u : q1 - 1u);
      state1[b0 + j] = q1;
      state2[b0 + j] = dopt_q8_search(code2, F(s2 / m2));
    }
  }
  if (nonfinite) *nonfinite = bad;
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
  int finite = 1;
  for (size_t i = 0; i < n && finite; i++) finite = isfinite(g[i]);
  double ss = 0.0;
  if (finite) {
    ss = dopt_sumsq(g, n); /* exact, rounded to double */
  } else {
    for (size_t i = 0; i < n; i++) ss += (double)g[i] * (double)g[i]; /* inf or NaN */
  }
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
