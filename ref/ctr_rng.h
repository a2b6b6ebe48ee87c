/* The counter-based generator (internal): a pure function of a seed and three
 * keys, shared by Q-GaLore's stochastic rounding (ref/q_galore_quant.c) and
 * LISA's layer sampler (ref/lisa_sample.c). */
#ifndef DISTOPT_CTR_RNG_H
#define DISTOPT_CTR_RNG_H

#include <stdint.h>

/* Pure functions of their keys: reproducible, and independent of thread
 * count, call order and sharding (an element's draw depends only on its
 * logical index). */
uint64_t dopt_ctr_u64(uint64_t seed, uint64_t a, uint64_t b, uint64_t c);
/* U[0, 1) as fp32 with 24 random bits: (h >> 40)·2^−24. */
float dopt_ctr_uniform(uint64_t seed, uint64_t a, uint64_t b, uint64_t c);

#endif
