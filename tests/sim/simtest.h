/* Helpers for the simulator tests: exact integer-valued test data in every
 * dtype, and a launcher wrapper. Rank bodies never assert; they return a
 * status and fill result slots that the main thread checks. */
#ifndef DOPT_SIMTEST_H
#define DOPT_SIMTEST_H

#include "testutil.h"

#include "distopt/sim.h"
#include "internal.h" /* DOPT_TRY */

#include <stdio.h>
#include <stdlib.h>
#include <time.h>

/* Round float to bf16, nearest-even (independent of the library's). */
static inline uint16_t st_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  uint32_t lsb = (u >> 16) & 1u;
  return (uint16_t)((u + 0x7fffu + lsb) >> 16);
}

static inline float st_from_bf16(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

/* Stores an exactly representable value v as element i of buf. */
static inline void st_put(dopt_dtype dt, void *buf, size_t i, double v) {
  switch (dt) {
  case DOPT_F32: ((float *)buf)[i] = (float)v; break;
  case DOPT_F64: ((double *)buf)[i] = v; break;
  case DOPT_BF16: ((uint16_t *)buf)[i] = st_bf16((float)v); break;
  case DOPT_I32: ((int32_t *)buf)[i] = (int32_t)v; break;
  case DOPT_I64: ((int64_t *)buf)[i] = (int64_t)v; break;
  case DOPT_U8: ((uint8_t *)buf)[i] = (uint8_t)v; break;
  default: break;
  }
}

/* Element e of rank r's input: small integers, so every reduction is exact. */
static inline double st_value(dopt_dtype dt, dopt_redop op, int r, size_t e) {
  if (op == DOPT_PROD)
    return ((size_t)r + e) % 3 == 0 ? 2.0 : 1.0;
  double v = (double)(((size_t)r * 7 + e * 3) % 5) + 1.0;
  return dt == DOPT_U8 ? v : v - 3.0;
}

/* Expected reduction over ranks 0..n-1 of st_value(.., e), stored at out[i]. */
static inline void st_expect_reduce(dopt_dtype dt, dopt_redop op, int n, size_t e, void *out,
                                    size_t i) {
  double acc = st_value(dt, op, 0, e);
  for (int j = 1; j < n; j++) {
    double v = st_value(dt, op, j, e);
    switch (op) {
    case DOPT_PROD: acc *= v; break;
    case DOPT_MAX: acc = v > acc ? v : acc; break;
    case DOPT_MIN: acc = v < acc ? v : acc; break;
    default: acc += v; break;
    }
  }
  if (op == DOPT_AVG) {
    switch (dt) {
    case DOPT_F32: ((float *)out)[i] = (float)acc / (float)n; return;
    case DOPT_BF16: ((uint16_t *)out)[i] = st_bf16((float)acc / (float)n); return;
    case DOPT_F64: acc /= n; break;
    default: acc = (double)((long long)acc / n); break; /* truncating */
    }
  }
  st_put(dt, out, i, acc);
}

/* Runs body on a fresh world built from cfg; statuses land in status[],
 * wall time in *elapsed_s; the world is kept in *keep when non-NULL. */
static inline void st_run(const dopt_sim_config *cfg, dopt_sim_rank_fn body, void *user,
                          dopt_status *status, double *elapsed_s, dopt_sim_world **keep) {
  dopt_sim_world *w = NULL;
  assert_ok(dopt_sim_world_create(cfg, &w));
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  (void)dopt_sim_launch(w, body, user, status);
  clock_gettime(CLOCK_MONOTONIC, &t1);
  if (elapsed_s != NULL)
    *elapsed_s = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-9;
  if (keep != NULL)
    *keep = w;
  else
    dopt_sim_world_destroy(w);
}

#endif
