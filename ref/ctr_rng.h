/* The counter-based generator (internal): a pure function of a seed and
 * keys, shared by Q-GaLore's stochastic rounding (ref/q_galore_quant.c),
 * LISA's layer sampler (ref/lisa_sample.c), GaLore's randomized range finder
 * (ref/galore_proj.c) and APOLLO's random projection (ref/apollo.c). */
#ifndef DISTOPT_CTR_RNG_H
#define DISTOPT_CTR_RNG_H

#include <stdint.h>

/* Pure functions of their keys: reproducible, and independent of thread
 * count, call order and sharding (an element's draw depends only on its
 * logical index). */
uint64_t dopt_ctr_u64(uint64_t seed, uint64_t a, uint64_t b, uint64_t c);
/* The splitmix64 finaliser the keys are chained through. */
uint64_t dopt_ctr_mix64(uint64_t z);
/* A standard normal from a 64-bit hash h: Box-Muller in double on two 53-bit
 * uniforms, u1 = ((h >> 11) + 1)·2^−53 in (0, 1] and u2 = (mix64(h) >> 11)·2^−53
 * in [0, 1), √(−2 ln u1)·cos(2π u2) rounded once to fp32. */
float dopt_ctr_normal(uint64_t h);
/* dopt_ctr_normal(dopt_ctr_u64(seed, a, b, c)). */
float dopt_ctr_gauss(uint64_t seed, uint64_t a, uint64_t b, uint64_t c);
/* U[0, 1) as fp32 with 24 random bits: (h >> 40)·2^−24. */
float dopt_ctr_uniform(uint64_t seed, uint64_t a, uint64_t b, uint64_t c);

#endif
