/* The fast exact 8-bit quantiser behind distopt/quant8.h (internal; ref/ and
 * the unit tests only). docs/adamw8bit.md ("Fast search") explains the method.
 *
 * dopt_q8_search (the CUDA binary search) is the specification; everything
 * here returns the same bytes and the same floats for every input, which
 * tests/unit/test_quant8.c and tests/unit/test_adamw8bit.c check against it. */
#ifndef DISTOPT_QUANT8_FAST_H
#define DISTOPT_QUANT8_FAST_H

#include <stddef.h>
#include <stdint.h>

#include "distopt/quant8.h"

/* Which implementation a call uses: AUTO picks the widest the CPU runs. */
typedef enum dopt_q8_impl {
  DOPT_Q8_IMPL_AUTO = 0,
  DOPT_Q8_IMPL_SCALAR = 1, /* portable C with the lookup table */
  DOPT_Q8_IMPL_AVX2 = 2,   /* x86 AVX2 (8 lanes, gathers); only where dopt__q8_have_avx2() */
  DOPT_Q8_IMPL_AVX512 = 3, /* x86 AVX-512 F/BW/DQ/VL/VBMI (16 lanes, byte-permute dequantisation);
                              only where dopt__q8_have_avx512() */
} dopt_q8_impl;

/* 1 if DOPT_Q8_IMPL_AVX2 (AVX512) is built and this CPU runs it. */
int dopt__q8_have_avx2(void);
int dopt__q8_have_avx512(void);

/* The lookup table of a built-in map (dopt_q8_map(is_signed)): entries for
 * |x| in [2^-23, 1] by the top 16 bits of the float, each
 * base | split << 16 (see quant8.c). NULL if the map failed the table's
 * build-time checks (then every caller uses dopt_q8_search). */
const uint32_t *dopt__q8_lut(int is_signed);

/* dopt_q8_search(dopt_q8_map(is_signed), x) through the table. */
uint8_t dopt__q8_search_lut(int is_signed, float x);

/* q[i] = dopt_q8_search(dopt_q8_map(is_signed), x[i]) for i < n, with the
 * given implementation (AVX2 or AVX512 where unavailable: DOPT_ERR_UNSUPPORTED). */
dopt_status dopt__q8_search_n(int is_signed, const float *x, size_t n, uint8_t *q, dopt_q8_impl impl);

/* dopt_q8_adam_update with the given implementation (AUTO: what
 * dopt_q8_adam_update uses). Every implementation gives the same bits. */
dopt_status dopt__q8_adam_update_impl(float *p, const float *g, uint8_t *state1, uint8_t *state2, float *absmax1,
                                      float *absmax2, size_t n, const dopt_q8_adam_hp *hp, size_t *nonfinite,
                                      dopt_q8_impl impl);

/* dopt_q8_percentile_clipping from ‖g‖² already summed (ss, double: the exact sum of the whole tensor's
 * squares, NaN/+inf for non-finite gradients, as the distributed step reduces it over the pieces). */
float dopt__q8_percentile_scale(double ss, float *gnorm_vec, int64_t step, int percentile, int *clipped);

#endif
