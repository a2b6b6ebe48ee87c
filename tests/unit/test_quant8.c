/* 8-bit blockwise quantisation with bitsandbytes' CUDA semantics
 * (distopt/quant8.h): the dynamic maps against the real package
 * (datasets/golden/bnb_maps.safetensors, gen_bnb.py), the CUDA search and its
 * tie rule, blockwise quantise/dequantise on given inputs; the fast table
 * search (ref/quant8_fast.h) against the CUDA search on ~10^7 float patterns
 * per map and implementation. */
#include "testutil.h"

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "distopt/quant8.h"
#include "distopt/safetensors.h"
#include "quant8_fast.h"

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

static uint32_t bits_of(float f) {
  uint32_t b;
  memcpy(&b, &f, sizeof b);
  return b;
}

static float float_of(uint32_t b) {
  float f;
  memcpy(&f, &b, sizeof f);
  return f;
}

/* appends b - w … b + w (bit patterns, both signs) */
static size_t around(uint32_t *v, size_t k, uint32_t b, uint32_t w) {
  b &= 0x7fffffffu;
  for (uint32_t d = 0; d <= 2 * w; d++) {
    const uint32_t x = b + d - w; /* wraps below 0: other patterns, also fine */
    v[k++] = x;
    v[k++] = x ^ 0x80000000u;
  }
  return k;
}

/* The fast search (table on the float's bits; AVX2 and portable) gives the
 * CUDA search's byte for every pattern tried: each code and each fp32
 * midpoint F((c[i] + c[i+1])·0.5) ±64 ulps (the ties), every 1/128 of every
 * binade from 2^-40 to 2 ±64 ulps (the table's bucket edges), ±0, the
 * subnormal range, infinities and NaNs, and 10^7 random patterns (half over
 * all 2^32, half over |x| <= 1), both signs, for both maps.
 * DOPT_Q8_EXHAUSTIVE=1 also tries all 2^32 patterns (minutes). */
static void test_fast_search_equivalence(void **st) {
  (void)st;
  const size_t cap = 12u * 1000 * 1000;
  uint32_t *v = malloc(cap * sizeof *v);
  float *x = malloc(cap * sizeof *x);
  uint8_t *q = malloc(cap), *want = malloc(cap);
  assert_non_null(v), assert_non_null(x), assert_non_null(q), assert_non_null(want);
  const int avx2 = dopt__q8_have_avx2(), avx512 = dopt__q8_have_avx512();
  const int exhaustive = getenv("DOPT_Q8_EXHAUSTIVE") && atoi(getenv("DOPT_Q8_EXHAUSTIVE")) > 0;
  for (int s = 0; s < 2; s++) {
    const float *c = dopt_q8_map(s);
    assert_non_null(dopt__q8_lut(s)); /* the built-in maps pass the table's checks */
    size_t k = 0;
    for (int i = 0; i < 256; i++) {
      k = around(v, k, bits_of(c[i]), 64);
      if (i < 255) k = around(v, k, bits_of((c[i] + c[i + 1]) * 0.5f), 64);
    }
    for (uint32_t e = 127 - 40; e <= 128; e++)
      for (uint32_t m = 0; m < 128; m++) k = around(v, k, e << 23 | m << 16, 64);
    for (uint32_t b = 0; b < 4096; b++) v[k++] = b, v[k++] = 0x80000000u | b;              /* 0, tiny subnormals */
    for (uint32_t b = 0x007ff000u; b < 0x00801000u; b++) v[k++] = b, v[k++] = 0x80000000u | b; /* FLT_MIN */
    const uint32_t special[] = {0x7f800000u, 0x7f800001u, 0x7fc00000u, 0x7fffffffu, 0x7f7fffffu, 0x3f800000u};
    for (size_t i = 0; i < sizeof special / sizeof *special; i++) v[k++] = special[i], v[k++] = special[i] | 0x80000000u;
    uint64_t rng = 1234 + (uint64_t)s;
    const size_t nrand = 10u * 1000 * 1000;
    assert_true(k + nrand <= cap);
    for (size_t i = 0; i < nrand; i++) {
      const uint64_t r = dt_rand_u64(&rng);
      v[k++] = i % 2 ? (uint32_t)r : (uint32_t)(r >> 32) % 0x3f800001u | (uint32_t)(r & 0x80000000u);
    }
    for (size_t i = 0; i < k; i++) x[i] = float_of(v[i]);
    for (size_t i = 0; i < k; i++) want[i] = dopt_q8_search(c, x[i]);
    for (int impl = DOPT_Q8_IMPL_SCALAR; impl <= DOPT_Q8_IMPL_AVX512; impl++) {
      if ((impl == DOPT_Q8_IMPL_AVX2 && !avx2) || (impl == DOPT_Q8_IMPL_AVX512 && !avx512)) {
        assert_status(dopt__q8_search_n(s, x, k, q, (dopt_q8_impl)impl), DOPT_ERR_UNSUPPORTED, "not available");
        continue;
      }
      memset(q, 0xaa, k);
      assert_ok(dopt__q8_search_n(s, x, k, q, (dopt_q8_impl)impl));
      for (size_t i = 0; i < k; i++)
        if (q[i] != want[i])
          fail_msg("map %d impl %d: x = %a (0x%08x): fast %d, search %d", s, impl, (double)x[i], (unsigned)v[i], q[i],
                   want[i]);
    }
    for (size_t i = 0; i < 1000; i++) assert_int_equal(dopt__q8_search_lut(s, x[i]), want[i]);
    printf("map %d: %zu patterns equal (portable; AVX2 %s; AVX-512 %s)\n", s, k, avx2 ? "tested" : "unavailable",
           avx512 ? "tested" : "unavailable");
    if (exhaustive) {
      const size_t chunk = cap;
      size_t diff = 0;
      for (uint64_t b0 = 0; b0 < (1ull << 32); b0 += chunk) {
        const size_t m = (size_t)((1ull << 32) - b0 < chunk ? (1ull << 32) - b0 : chunk);
        for (size_t i = 0; i < m; i++) x[i] = float_of((uint32_t)(b0 + i));
        assert_ok(dopt__q8_search_n(s, x, m, q, DOPT_Q8_IMPL_AUTO));
        for (size_t i = 0; i < m; i++) diff += q[i] != dopt_q8_search(c, x[i]);
      }
      printf("map %d: all 2^32 patterns, %zu differ\n", s, diff);
      assert_int_equal(diff, 0);
    }
  }
  free(v), free(x), free(q), free(want);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_maps_golden),
      cmocka_unit_test(test_maps_shape),
      cmocka_unit_test(test_search_codes),
      cmocka_unit_test(test_search_ties_and_nearest),
      cmocka_unit_test(test_quantize_blockwise),
      cmocka_unit_test(test_fast_search_equivalence),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
