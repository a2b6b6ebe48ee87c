/* LISA's layer sampler (ref/lisa.c draws its trained layers with it).
 * Semantics in ref/lisa_sample.h. */
#include "lisa_sample.h"

#include "ctr_rng.h"

void dopt_lisa_sample(uint64_t seed, int64_t interval, int n, int k, int *ws, int *out) {
  for (int i = 0; i < n; i++) ws[i] = i;
  for (int j = 0; j < k; j++) {
    uint64_t range = (uint64_t)(n - j), reject = (0 - range) % range, x; /* reject x < 2^64 mod range */
    uint64_t attempt = 0;
    do x = dopt_ctr_u64(seed, (uint64_t)interval, (uint64_t)j, attempt++);
    while (x < reject);
    int r = j + (int)(x % range), t = ws[j];
    ws[j] = ws[r];
    ws[r] = t;
    out[j] = ws[j];
  }
}
