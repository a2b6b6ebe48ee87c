/* Q-GaLore's building blocks: quantiser, int4 packing, stochastic rounding,
 * lazy-refresh rule (used by the GaLore engine, ref/galore.c, for q_galore and
 * galore's proj_quant / lazy_refresh / int8_weights keys). Semantics in
 * ref/q_galore_quant.h. */
#include "q_galore_quant.h"

#include <math.h>
#include <string.h>

#include "ctr_rng.h"

size_t dopt_qg_code_bytes(size_t n, int bits, int packed) { return bits == 4 && packed ? (n + 1) / 2 : n; }

static void put(uint8_t *q, size_t i, int bits, int packed, uint8_t v) {
  if (bits == 4 && packed) {
    uint8_t *b = &q[i / 2];
    *b = (uint8_t)(i % 2 ? (*b & 0x0f) | (v << 4) : (*b & 0xf0) | v);
  } else {
    q[i] = v;
  }
}

static uint8_t get(const uint8_t *q, size_t i, int bits, int packed) {
  if (bits == 4 && packed) return (uint8_t)(i % 2 ? q[i / 2] >> 4 : q[i / 2] & 0x0f);
  return q[i];
}

static float clampf(float v, float lo, float hi) { return v < lo ? lo : v > hi ? hi : v; }

/* scales and zeros of one group (fp32, as upstream) */
static void grid(const float *w, size_t n, float qmax, float *scale, float *zero) {
  float mx = w[0], mn = w[0];
  for (size_t i = 1; i < n; i++) {
    if (w[i] > mx) mx = w[i];
    if (w[i] < mn) mn = w[i];
  }
  float range = mx - mn;
  *scale = (range < 1e-5f ? 1e-5f : range) / qmax;
  *zero = clampf(-rintf(mn / *scale), 0.0f, qmax);
}

void dopt_qg_quantize(const float *w, size_t n, size_t gsize, int bits, int packed, uint8_t *q, float *scales,
                      float *zeros) {
  const float qmax = (float)((1 << bits) - 1);
  if (bits == 4 && packed) memset(q, 0, dopt_qg_code_bytes(n, bits, packed));
  for (size_t g = 0, lo = 0; lo < n; g++, lo += gsize) {
    size_t len = n - lo < gsize ? n - lo : gsize;
    grid(w + lo, len, qmax, &scales[g], &zeros[g]);
    for (size_t i = lo; i < lo + len; i++)
      put(q, i, bits, packed, (uint8_t)clampf(rintf(w[i] / scales[g]) + zeros[g], 0.0f, qmax));
  }
}

void dopt_qg_dequantize(const uint8_t *q, size_t n, size_t gsize, int bits, int packed, const float *scales,
                        const float *zeros, float *out) {
  for (size_t i = 0; i < n; i++) {
    size_t g = i / gsize;
    out[i] = scales[g] * ((float)get(q, i, bits, packed) - zeros[g]);
  }
}

void dopt_qg_quantize_sr(const float *w, size_t n, size_t gsize, uint64_t seed, int64_t step, uint64_t tensor,
                         uint64_t first, uint8_t *q, float *scales, float *zeros) {
  for (size_t g = 0, lo = 0; lo < n; g++, lo += gsize) {
    size_t len = n - lo < gsize ? n - lo : gsize;
    grid(w + lo, len, 255.0f, &scales[g], &zeros[g]);
    for (size_t i = lo; i < lo + len; i++) {
      float x = w[i] / scales[g], down = floorf(x), up = ceilf(x);
      float u = dopt_ctr_uniform(seed, (uint64_t)step, tensor, first + (uint64_t)i);
      float r = u < x - down ? up : down;
      q[i] = (uint8_t)clampf(r + zeros[g], 0.0f, 255.0f);
    }
  }
}

float dopt_qg_cosine(const float *a, size_t sa, const float *b, size_t sb, size_t n) {
  double dot = 0.0, na = 0.0, nb = 0.0;
  for (size_t i = 0; i < n; i++) {
    double x = a[i * sa], y = b[i * sb];
    dot += x * y;
    na += x * x;
    nb += y * y;
  }
  double den = sqrt(na) * sqrt(nb);
  return (float)(dot / (den > 1e-8 ? den : 1e-8));
}

double dopt_qg_lazy_push(double *queue, int *count, int queue_size, float cos, double threshold, double gamma,
                         double gap) {
  if (*count == queue_size) {
    memmove(queue, queue + 1, (size_t)(queue_size - 1) * sizeof *queue);
    (*count)--;
  }
  queue[(*count)++] = (double)cos;
  if (*count < queue_size) return gap;
  double sum = 0.0;
  for (int i = 0; i < queue_size; i++) sum += queue[i];
  if (sum / queue_size < threshold) return gap;
  double g = floor(gap * gamma);
  return g < 1.0 ? 1.0 : g > 9007199254740992.0 ? 9007199254740992.0 : g;
}
