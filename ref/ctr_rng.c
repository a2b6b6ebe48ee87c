/* The counter-based generator (splitmix64 finaliser chained over the keys)
 * that Q-GaLore's stochastic rounding and LISA's layer sampler draw from.
 * Semantics in ref/ctr_rng.h. */
#include "ctr_rng.h"

static uint64_t mix64(uint64_t z) { /* splitmix64 finaliser */
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

uint64_t dopt_ctr_u64(uint64_t seed, uint64_t a, uint64_t b, uint64_t c) {
  return mix64(mix64(mix64(mix64(seed) ^ a) ^ b) ^ c);
}

float dopt_ctr_uniform(uint64_t seed, uint64_t a, uint64_t b, uint64_t c) {
  return (float)(dopt_ctr_u64(seed, a, b, c) >> 40) * 0x1p-24f;
}
