/* Q-GaLore's building blocks (internal; semantics in docs/q_galore.md): q_galore_torch's asymmetric min-max
 * quantiser (int4 / int8, groups), int4 packing, stochastic rounding with the
 * counter-based generator of ref/ctr_rng.h, and the lazy subspace-refresh
 * rule. The q_galore optimizer itself is ref/q_galore.c; the GaLore engine
 * that calls these is ref/galore.c. */
#ifndef DISTOPT_Q_GALORE_QUANT_H
#define DISTOPT_Q_GALORE_QUANT_H

#include <stddef.h>
#include <stdint.h>

/* ---- quantiser (q_galore_torch `_quantize`) ---------------------------------------
 * Elements of the row-major flattened tensor in consecutive groups of gsize
 * (a positive group size, or the row length for upstream's group_size = −1).
 * Per group, fp32: scales = max(max − min, 1e-5f) / qmax (qmax = 2^bits − 1);
 * zeros = clamp(−rint(min / scales), 0, qmax); q = clamp(rint(w / scales) +
 * zeros, 0, qmax) (rint: half to even, as torch.round). Dequantised value:
 * scales·(q − zeros). packed (bits = 4 only): element 2i in the low nibble of
 * byte i, 2i + 1 in the high nibble (⌈n/2⌉ bytes); else one code per byte. */
size_t dopt_qg_code_bytes(size_t n, int bits, int packed);
void dopt_qg_quantize(const float *w, size_t n, size_t gsize, int bits, int packed, uint8_t *q, float *scales,
                      float *zeros);
void dopt_qg_dequantize(const uint8_t *q, size_t n, size_t gsize, int bits, int packed, const float *scales,
                        const float *zeros, float *out);
/* 8-bit re-gridding with stochastic rounding (`_quantize_stochastic_round`):
 * the same scales/zeros; x = w / scales; q = ⌈x⌉ if U < x − ⌊x⌋ else ⌊x⌋,
 * U = dopt_ctr_uniform(seed, step, tensor, first + i) for w[i] (first: the
 * logical index of w[0], so a group-aligned slice quantised anywhere draws
 * the same numbers); q = clamp(q + zeros, 0, 255). */
void dopt_qg_quantize_sr(const float *w, size_t n, size_t gsize, uint64_t seed, int64_t step, uint64_t tensor,
                         uint64_t first, uint8_t *q, float *scales, float *zeros);

/* ---- lazy subspace refresh -----------------------------------------------------------
 * torch.nn.functional.cosine_similarity(a, b, dim=0) (eps 1e-8), computed in
 * double and rounded to fp32 (upstream keeps `.item()` of an fp32 result). */
float dopt_qg_cosine(const float *a, size_t stride_a, const float *b, size_t stride_b, size_t n);
/* One refresh's queue update: pushes cos into the FIFO queue[*count] of
 * queue_size (oldest dropped); if the queue is full and its mean (sequential
 * double sum / queue_size) >= threshold, returns floor(gap·gamma) (at least
 * 1, at most 2^53), else gap. The queue is never cleared. */
double dopt_qg_lazy_push(double *queue, int *count, int queue_size, float cos, double threshold, double gamma,
                         double gap);

#endif
