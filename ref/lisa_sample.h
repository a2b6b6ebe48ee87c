/* LISA's layer sampler (internal; semantics in docs/lisa.md), drawn from the
 * counter-based generator of ref/ctr_rng.h. */
#ifndef DISTOPT_LISA_SAMPLE_H
#define DISTOPT_LISA_SAMPLE_H

#include <stdint.h>

/* k of n indices sampled uniformly without replacement (partial Fisher–Yates
 * with unbiased rejection draws keyed (seed, interval, draw)): out[k] in
 * sampling order. k <= n; ws: n ints. */
void dopt_lisa_sample(uint64_t seed, int64_t interval, int n, int k, int *ws, int *out);

#endif
