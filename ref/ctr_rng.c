/* The counter-based generator (splitmix64 finaliser chained over the keys).
 * Semantics and users in ref/ctr_rng.h. */
#include "ctr_rng.h"

#include <math.h>

uint64_t dopt_ctr_mix64(uint64_t z) { /* splitmix64 finaliser */
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

uint64_t dopt_ctr_u64(uint64_t seed, uint64_t a, uint64_t b, uint64_t c) {
  return dopt_ctr_mix64(dopt_ctr_mix64(dopt_ctr_mix64(dopt_ctr_mix64(seed) ^ a) ^ b) ^ c);
}

float dopt_ctr_uniform(uint64_t seed, uint64_t a, uint64_t b, uint64_t c) {
  return (float)(dopt_ctr_u64(seed, a, b, c) >> 40) * 0x1p-24f;
}

float dopt_ctr_normal(uint64_t h) {
  double u1 = ((double)(h >> 11) + 1.0) * 0x1.0p-53;
  double u2 = (double)(dopt_ctr_mix64(h) >> 11) * 0x1.0p-53;
  return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

float dopt_ctr_gauss(uint64_t seed, uint64_t a, uint64_t b, uint64_t c) {
  return dopt_ctr_normal(dopt_ctr_u64(seed, a, b, c));
}
