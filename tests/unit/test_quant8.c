/* 8-bit blockwise quantisation with bitsandbytes' CUDA semantics
 * (distopt/quant8.h): the dynamic maps against the real package
 * (datasets/golden/bnb_maps.safetensors, gen_bnb.py), the CUDA search and its
 * tie rule, blockwise quantise/dequantise on given inputs. */
#include "testutil.h"

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "distopt/quant8.h"
#include "distopt/safetensors.h"

static void test_maps_golden(void **st) {
  (void)st;
  char path[1024];
  snprintf(path, sizeof path, "%s/datasets/golden/bnb_maps.safetensors", dt_source_dir());
  dopt_st_file *f;
  assert_ok(dopt_st_load(path, &f));
  const char *names[2] = {"unsigned", "signed"};
  for (int s = 0; s < 2; s++) {
    float gold[256], mine[256];
    assert_ok(dopt_st_read_f32(f, names[s], gold, 256));
    dopt_q8_create_dynamic_map(s, mine);
    for (int i = 0; i < 256; i++)
      if (dt_ulp_distance(gold[i], mine[i]) != 0 || signbit(gold[i]) != signbit(mine[i]))
        fail_msg("%s map[%d]: %a, bitsandbytes %a", names[s], i, (double)mine[i], (double)gold[i]);
    assert_memory_equal(dopt_q8_map(s), gold, sizeof gold);
  }
  dopt_st_free(f);
}

/* Values of bitsandbytes' dynamic maps (docs/adamw8bit.md), and the maps' shape. */
static void test_maps_shape(void **st) {
  (void)st;
  const float *c = dopt_q8_map(1), *u = dopt_q8_map(0);
  assert_true(c[127] == 0.0f && !signbit(c[127]));
  assert_true(c[128] == (float)(1e-6f * 0.55f));
  assert_true(c[126] == -c[128]);
  assert_true(c[254] == 0.99296875f && c[0] == -0.99296875f);
  assert_true(c[255] == 1.0f);
  for (int i = 0; i < 127; i++) assert_true(c[i] == -c[254 - i]); /* symmetric, no -1.0 */
  assert_true(u[0] == 0.0f && u[255] == 1.0f);
  assert_true(fabs((double)u[1] - 3.25e-7) < 1e-13);
  for (int i = 0; i < 255; i++) assert_true(c[i] < c[i + 1] && u[i] < u[i + 1]);
}

/* Every code maps to itself; outside [-1, 1] saturates; NaN → 0. */
static void test_search_codes(void **st) {
  (void)st;
  for (int s = 0; s < 2; s++) {
    const float *c = dopt_q8_map(s);
    for (int i = 0; i < 256; i++) assert_int_equal(dopt_q8_search(c, c[i]), i);
    assert_int_equal(dopt_q8_search(c, 2.0f), 255);
    assert_int_equal(dopt_q8_search(c, INFINITY), 255);
    assert_int_equal(dopt_q8_search(c, NAN), 0);
    assert_int_equal(dopt_q8_search(c, -2.0f), 0);
  }
  const float *c = dopt_q8_map(1);
  assert_int_equal(dopt_q8_search(c, 0.0f), 127);
  assert_int_equal(dopt_q8_search(c, -0.0f), 127);
  assert_int_equal(dopt_q8_search(c, -1.0f), 0); /* no -1.0: the most negative code */
  assert_int_equal(dopt_q8_search(dopt_q8_map(0), -0.5f), 0);
}

/* Ties: the binary search from 127 moves by ±64, ±32, …, ±1, so its final
 * pivot is always even, and a value exactly on the midpoint of two codes
 * goes to the final pivot: the even index of the pair. (Upstream's rule is
 * stated as "ties go to the final pivot"; the parity is our derivation and is
 * checked here on every pair whose midpoint is exactly representable.) Off a
 * tie the result is the nearest code. */
static void test_search_ties_and_nearest(void **st) {
  (void)st;
  int ties = 0, down = 0, up = 0;
  for (int s = 0; s < 2; s++) {
    const float *c = dopt_q8_map(s);
    for (int i = 0; i < 255; i++) {
      const double exact = ((double)c[i] + (double)c[i + 1]) / 2;
      const float mid = (c[i] + c[i + 1]) * 0.5f;
      if ((double)mid != exact) continue;
      ties++;
      const int got = dopt_q8_search(c, mid), even = (i % 2 == 0) ? i : i + 1;
      if (got != even) fail_msg("map %d: tie between %d and %d went to %d", s, i, i + 1, got);
      if (got == i) down++;
      else up++;
      /* one ulp either side: the nearest */
      assert_int_equal(dopt_q8_search(c, nextafterf(mid, -INFINITY)), i);
      assert_int_equal(dopt_q8_search(c, nextafterf(mid, INFINITY)), i + 1);
    }
    uint64_t rng = 99 + (uint64_t)s;
    for (int k = 0; k < 20000; k++) {
      float x = (float)(dt_rand_uniform(&rng) * 2 - 1);
      if (k % 3 == 0) x = (float)(x * pow(10.0, -6.0 * dt_rand_uniform(&rng))); /* small values too */
      if (!s) x = fabsf(x);
      int best = 0;
      for (int j = 1; j < 256; j++)
        if (fabs((double)c[j] - x) < fabs((double)c[best] - x)) best = j;
      const int got = dopt_q8_search(c, x);
      if (got != best && fabs(fabs((double)c[got] - x) - fabs((double)c[best] - x)) > 1e-7 * fabs(x))
        fail_msg("map %d: x=%a → %d, nearest %d", s, (double)x, got, best);
    }
  }
  /* both directions occur: path-dependent, not a uniform round-half-down */
  assert_true(ties > 100 && down > 0 && up > 0);
}

/* quantize_blockwise on given inputs: negatives, zeros, NaN, an exact tie,
 * an all-zero block and a partial last block; dequantize = code·absmax. */
static void test_quantize_blockwise(void **st) {
  (void)st;
  const size_t B = 64, n = 64 * 3 + 5;
  const float *c = dopt_q8_map(1);
  float x[197] = {0}, absmax[4], back[197];
  uint8_t q[197];
  /* block 0: absmax 2, a few given values */
  x[0] = 2.0f;                                /* → 1.0 → 255 */
  x[1] = -2.0f;                               /* → -1 → 0 (-0.993) */
  x[2] = 0.0f;                                /* → 127 */
  x[3] = NAN;                                 /* → 0; absmax ignores it */
  x[4] = (c[200] + c[201]) * 0.5f * 2.0f;     /* the exact midpoint 200|201 → the even 200 */
  x[5] = (c[201] + c[202]) * 0.5f * 2.0f;     /* midpoint 201|202 → 202 */
  x[6] = -1.0f;                               /* -0.5 → nearest negative code */
  for (size_t i = 7; i < 64; i++) x[i] = (float)i / 64.0f;
  /* block 1: all zeros (absmax 0: 0·(1/0) = NaN → byte 0, dequantises to -0) */
  /* block 2: negatives only */
  for (size_t i = 128; i < 192; i++) x[i] = -(float)(i - 127) * 0.01f;
  /* block 3 (5 valid items): absmax over the valid items only */
  for (size_t i = 192; i < n; i++) x[i] = (float)(i - 191) * 1e-3f;
  assert_ok(dopt_q8_quantize_blockwise(c, x, n, B, q, absmax));
  assert_true(absmax[0] == 2.0f && absmax[1] == 0.0f && absmax[2] == 64.0f * 0.01f && absmax[3] == 5.0f * 1e-3f);
  assert_int_equal(q[0], 255);
  assert_int_equal(q[1], 0);
  assert_int_equal(q[2], 127);
  assert_int_equal(q[3], 0);
  assert_int_equal(q[4], 200);
  assert_int_equal(q[5], 202);
  assert_int_equal(q[6], dopt_q8_search(c, -0.5f));
  assert_true(c[q[6]] < 0);
  for (size_t i = 64; i < 128; i++) assert_int_equal(q[i], 0);
  assert_int_equal(q[191], 0);
  assert_int_equal(q[196], 255);
  for (size_t i = 0; i < n; i++) {
    const float inv = 1.0f / absmax[i / B];
    if (i / B != 1 && i != 3) assert_int_equal(q[i], dopt_q8_search(c, x[i] * inv));
  }
  assert_ok(dopt_q8_dequantize_blockwise(c, q, absmax, n, B, back));
  for (size_t i = 0; i < n; i++) assert_true(back[i] == c[q[i]] * absmax[i / B]);
  assert_true(back[64] == 0.0f && signbit(back[64])); /* all-zero block → -0.0 */
  assert_true(back[3] == c[0] * 2.0f);                /* NaN came back as the most negative code */
  /* round-off bound: within half the widest code gap (≈ 0.0141/2) times absmax */
  for (size_t i = 0; i < n; i++)
    if (i != 3) assert_true(fabsf(back[i] - x[i]) <= 0.0071f * absmax[i / B]);
  /* unsigned map and other block sizes */
  const float *u = dopt_q8_map(0);
  float y[5000], am[80], yb[5000];
  uint8_t qy[5000];
  uint64_t rng = 5;
  for (int i = 0; i < 5000; i++) y[i] = (float)(dt_rand_uniform(&rng) * 3);
  for (size_t b = 64; b <= 4096; b *= 2) {
    assert_ok(dopt_q8_quantize_blockwise(u, y, 5000, b, qy, am));
    assert_ok(dopt_q8_dequantize_blockwise(u, qy, am, 5000, b, yb));
    for (int i = 0; i < 5000; i++) assert_true(fabsf(yb[i] - y[i]) <= 0.0071f * am[(size_t)i / b]);
    assert_int_equal(dopt_q8_num_blocks(5000, b), (5000 + b - 1) / b);
  }
  assert_status(dopt_q8_quantize_blockwise(c, x, n, 100, q, absmax), DOPT_ERR_INVALID_ARG, "block=100");
  assert_status(dopt_q8_quantize_blockwise(c, x, n, 8192, q, absmax), DOPT_ERR_INVALID_ARG, "block=8192");
  assert_status(dopt_q8_dequantize_blockwise(c, q, absmax, n, 32, back), DOPT_ERR_INVALID_ARG, "block=32");
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_maps_golden),
      cmocka_unit_test(test_maps_shape),
      cmocka_unit_test(test_search_codes),
      cmocka_unit_test(test_search_ties_and_nearest),
      cmocka_unit_test(test_quantize_blockwise),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
