/* distopt — 8-bit blockwise quantisation with bitsandbytes' CUDA semantics.
 *
 * The building blocks of bitsandbytes' 8-bit optimizer states (AdamW8bit,
 * GaLore-AdamW8bit), on plain arrays:
 *
 *  - the dynamic maps of `bitsandbytes.functional.create_dynamic_map`
 *    (signed: first moment; unsigned: second moment), rebuilt in the same
 *    fp32 arithmetic as upstream (torch 1.13's CPU linspace, midpoints,
 *    ×fp32(10^(i−6)), 0 and 1.0 appended, sorted). Equal to the real
 *    package's tensors (datasets/golden/bnb_maps.safetensors);
 *  - blockwise quantise/dequantise with block sizes 64 … 4096 (powers of
 *    two), per-block absmax, and the CUDA kernels' nearest-code search
 *    (`dQuantize`): a 7-step binary search from pivot 127 followed by a
 *    midpoint rule whose ties go to the final pivot (so a value exactly on a
 *    midpoint rounds up or down depending on the search path), NaN → 0;
 *  - the blockwise 8-bit Adam update of `kOptimizerStatic8bit2StateBlockwise`
 *    and the fp32 fallback `kOptimizer32bit2State` ("adam" kernels: decay
 *    after the step), and bitsandbytes' per-tensor `percentile_clipping`.
 *
 * Only the CUDA search is implemented. bitsandbytes' other quantisers give
 * different bytes and are NOT provided: the CPU backend's 65,536-bin lookup
 * table over [−1, 1] (bins of 3e-5 are coarser than the smallest codes, so
 * small values land on other codes), the torch "default" kernel (bucketize
 * against midpoints: every tie goes to the lower index, absmax clamped to
 * 1e-38, an all-zero block gives the index of 0.0) and the generic argmin
 * |x − code| fallback (ties to the first minimum). None of them is what the
 * GPU optimizers store, and docs/adamw8bit.md explains why the CPU backend's
 * optimizer is no oracle either.
 *
 * Arithmetic: exact IEEE fp32 in the kernels' order of operations, with the
 * GPU's flush-to-zero (subnormal inputs and results become ±0). The CUDA
 * build uses fast math (approximate pow, divide, reciprocal and sqrt, FMA
 * contraction); those cannot be reproduced exactly on a CPU, so real bnb
 * differs from these functions by rare few-ulp parameter differences and
 * byte flips of values within a few ulp of a code midpoint.
 */
#ifndef DISTOPT_QUANT8_H
#define DISTOPT_QUANT8_H

#include <stddef.h>
#include <stdint.h>

#include "distopt/export.h"
#include "distopt/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DOPT_Q8_CODES 256
#define DOPT_Q8_BLOCK_MIN 64
#define DOPT_Q8_BLOCK_MAX 4096
#define DOPT_Q8_BLOCK_DEFAULT 256 /* bitsandbytes >= 0.44 optimizers; <= 0.43 (and Q-GaLore) use 2048 */
#define DOPT_Q8_GNORM_HISTORY 100 /* slots of percentile clipping's gnorm_vec */

/* ---- maps ------------------------------------------------------------------ */

/* create_dynamic_map(signed, max_exponent_bits=7, total_bits=8) into code[256].
 * Signed: code[0] = −0.99296875, code[127] = 0, code[128] = 5.5e-7,
 * code[254] = 0.99296875, code[255] = 1.0 (no −1.0). Unsigned: code[0] = 0,
 * code[1] = 3.25e-7, code[255] = 1.0. */
DOPT_API void dopt_q8_create_dynamic_map(int is_signed, float code[DOPT_Q8_CODES]);
/* The same maps, built once per process (thread-safe); never NULL. */
DOPT_API const float *dopt_q8_map(int is_signed);

/* ---- blockwise quantisation ----------------------------------------------- */

/* 1 if block is a power of two in [64, 4096]. */
DOPT_API int dopt_q8_block_ok(size_t block);
/* ceil(n / block): the number of absmax values. */
DOPT_API size_t dopt_q8_num_blocks(size_t n, size_t block);

/* The CUDA nearest-code search (dQuantize / quantize_2D) of x (normally in
 * [−1, 1]) in a sorted 256-entry code. Ties at a midpoint go to the final
 * pivot of the binary search; NaN gives 0. */
DOPT_API uint8_t dopt_q8_search(const float *code, float x);

/* quantize_blockwise (CUDA kQuantizeBlockwise): per block of `block` items,
 * absmax[b] = max |x| over the block's valid items (NaN ignored), each item
 * searched as x·(1/absmax[b]); an all-zero block gives NaN → byte 0.
 * q[n], absmax[ceil(n/block)]. */
DOPT_API dopt_status dopt_q8_quantize_blockwise(const float *code, const float *x, size_t n, size_t block,
                                                uint8_t *q, float *absmax);
/* out[i] = code[q[i]] · absmax[i / block]. */
DOPT_API dopt_status dopt_q8_dequantize_blockwise(const float *code, const uint8_t *q, const float *absmax,
                                                  size_t n, size_t block, float *out);

/* ---- the 8-bit Adam kernel ------------------------------------------------- */

/* The kernel's scalars, fp32 as bitsandbytes passes them (Python floats
 * rounded to float). */
typedef struct dopt_q8_adam_hp {
  float lr, beta1, beta2, eps, weight_decay;
  float gnorm_scale; /* from percentile clipping; 1 = none */
  int64_t step;      /* t, already incremented (>= 1) */
  size_t block;      /* 8-bit path: the quantisation block (dopt_q8_block_ok) */
} dopt_q8_adam_hp;

/* One blockwise 8-bit Adam step (kOptimizerStatic8bit2StateBlockwise,
 * optimizer "adam"; AdamW8bit = weight_decay > 0) on n elements: parameters
 * p[n], gradient g[n], state1[n] (signed map, m), state2[n] (unsigned map,
 * v), absmax1/absmax2[ceil(n/block)]. Per block, with the slots beyond n
 * padded (g = 0, state1 byte 128, state2 byte 0) and taking part in absmax:
 *   finite g:     s2 = β2·v + ((1−β2)·g')·g',  s1 = β1·m + (1−β1)·g'
 *                 (m, v dequantised, g' = g·gnorm_scale)
 *   non-finite g: s1 = s2 = 0, the parameter is left unchanged
 *   absmax_k = max |s_k| over the block's slots (new, unquantised states)
 *   finite g:     p = p + step_size·(s1/(√s2 + c2·eps)), step_size = −lr·c2/c1,
 *                 c1 = 1 − β1^t, c2 = √(1 − β2^t); then, if wd > 0,
 *                 p = p·(1 − lr·wd)   (decoupled decay after the step)
 *   bytes:        search(s_k/absmax_k); state1 sign fix: if signbit(code1[q])
 *                 != signbit(s1), q += 1 if s1 > 0 else q −= 1 (mod 256).
 * *nonfinite (may be NULL) receives the number of non-finite gradient items. */
DOPT_API dopt_status dopt_q8_adam_update(float *p, const float *g, uint8_t *state1, uint8_t *state2, float *absmax1,
                                         float *absmax2, size_t n, const dopt_q8_adam_hp *hp, size_t *nonfinite);

/* The same step on a block whose elements lie in several pieces (ranks), in
 * two phases around a MAX: every holder of elements of the block computes
 * the maximum of their new states (dopt_q8_adam_absmax), the maxima are
 * combined by MAX over the holders, and every holder applies the update of
 * its elements with the combined absmax (dopt_q8_adam_apply) and stores it
 * as the block's absmax. On a whole block the two phases are bitwise
 * dopt_q8_adam_update.
 *
 * dopt_q8_adam_absmax: n elements of ONE block (gradients, their state1 and
 * state2 bytes) under the block's current absmax a1, a2, and `pad` padding
 * slots of that block (the last block's slots beyond the tensor: g = 0,
 * byte 128 / byte 0; MAX is idempotent, so any holder of the last block may
 * count them); n + pad <= hp->block. *m1 = max(*m1, |s1|), *m2 = max(*m2,
 * |s2|) over their new states (NaN ignored; start from -FLT_MAX);
 * *nonfinite (may be NULL) += the non-finite gradients among the n. */
DOPT_API dopt_status dopt_q8_adam_absmax(const float *g, const uint8_t *state1, const uint8_t *state2, float a1,
                                         float a2, size_t n, size_t pad, const dopt_q8_adam_hp *hp, float *m1,
                                         float *m2, size_t *nonfinite);
/* dopt_q8_adam_apply: the parameters and bytes of n elements of one block
 * from the block's current absmax a1, a2 (the one the maxima were taken
 * under) and its new absmax m1, m2 (their MAX over every holder). The caller
 * stores m1, m2 as the block's absmax after its last elements are applied. */
DOPT_API dopt_status dopt_q8_adam_apply(float *p, const float *g, uint8_t *state1, uint8_t *state2, float a1,
                                        float a2, float m1, float m2, size_t n, const dopt_q8_adam_hp *hp);

/* The fp32 fallback for tensors below min_8bit_size (kOptimizer32bit2State,
 * "adam"): the same equations on fp32 states with g' = g·gnorm_scale and
 * (1−β2)·(g'·g'), no guard for non-finite gradients (NaN propagates), decay
 * after the step. hp->block is ignored. */
DOPT_API dopt_status dopt_q8_adam32_update(float *p, const float *g, float *state1, float *state2, size_t n,
                                           const dopt_q8_adam_hp *hp);

/* bitsandbytes' percentile_clipping (<= 0.49) for one tensor at step t >= 1:
 * gnorm_vec[100] is its history of ‖g‖² (fp32). The slot t mod 100 is set to
 * ‖g‖² (every slot at t = 1); current = √slot, clip = √(sorted(history)[percentile])
 * (NaN sorts last); returns clip/current if current > clip, else 1.
 * ‖g‖² is the exact sum rounded once to fp32 (upstream's atomics sum in an
 * unspecified order). percentile in [0, 99]; *clipped (may be NULL) = 1 when
 * the returned scale is not 1. */
DOPT_API float dopt_q8_percentile_clipping(const float *g, size_t n, float *gnorm_vec, int64_t step, int percentile,
                                           int *clipped);

#ifdef __cplusplus
}
#endif
#endif
