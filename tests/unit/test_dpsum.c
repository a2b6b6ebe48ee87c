/* The exact data-parallel sum (distopt/dpsum.h): correctly rounded against a
 * long-double oracle where the oracle is exact, the same bits for every order
 * of the parts, the documented precision limits, non-finite classes, rounding
 * ties, blocks independent of each other, and the piece kernels (as ranks
 * call them on TP blocks and ZeRO ranges) equal to the whole-tensor sum. */
#include "testutil.h"

#include <fenv.h>
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "distopt/device.h"
#include "distopt/dpsum.h"
#include "grid.h"

static uint32_t bits(float x) {
  uint32_t u;
  memcpy(&u, &x, sizeof u);
  return u;
}

static float sum_of(const float *x, int n, int words) {
  const float *parts[16];
  for (int d = 0; d < n; d++) parts[d] = &x[d];
  float out = -1.0f;
  assert_int_equal(dopt_dp_sum(parts, n, words, 1, &out), DOPT_OK);
  return out;
}

/* Values with exponents in [emin, emin + span): every sum of up to 8 of them
 * needs at most 24 + span + 3 bits, exact in long double (64) for span ≤ 36,
 * so (float) of the long-double sum is the correctly rounded exact sum. */
static void oracle_case(int words, int span, uint64_t *rng) {
  enum { N = 3000 };
  for (int n = 2; n <= 8; n++) {
    float *x = malloc((size_t)n * N * sizeof *x), *out = malloc(N * sizeof *out);
    const float *parts[8];
    int emin = (int)(dt_rand_u64(rng) % 200) - 120;
    if (emin + span > 127) emin = 127 - span;
    for (int d = 0; d < n; d++) {
      for (size_t i = 0; i < N; i++) {
        double m = 1.0 + dt_rand_uniform(rng);
        int e = emin + (int)(dt_rand_u64(rng) % (uint64_t)span);
        float v = (float)ldexp(dt_rand_u64(rng) & 1 ? -m : m, e);
        x[(size_t)d * N + i] = (dt_rand_u64(rng) % 17) == 0 ? 0.0f : v;
      }
      parts[d] = x + (size_t)d * N;
    }
    assert_int_equal(dopt_dp_sum(parts, n, words, N, out), DOPT_OK);
    for (size_t i = 0; i < N; i++) {
      long double s = 0;
      for (int d = 0; d < n; d++) s += (long double)parts[d][i];
      float want = (float)s;
      if (want == 0.0f) want = 0.0f; /* an exact zero is +0 */
      if (bits(out[i]) != bits(want))
        fail_msg("words=%d n=%d span=%d element %zu: got %a, exact sum rounded %a", words, n, span, i, (double)out[i],
                 (double)want);
    }
    free(x);
    free(out);
  }
}

/* Within the documented exact range (2^(38−h) for one word) the sum is the
 * correctly rounded exact sum. */
static void test_oracle_one_word(void **state) {
  (void)state;
  uint64_t rng = 11;
  for (int rep = 0; rep < 4; rep++) oracle_case(1, 35, &rng); /* h ≤ 3 for n ≤ 8: 2^35 */
}

static void test_oracle_two_words(void **state) {
  (void)state;
  uint64_t rng = 12;
  for (int rep = 0; rep < 4; rep++) oracle_case(2, 36, &rng);
}

/* Every order of the parts gives the same bits (wide dynamic range, mixed
 * signs: where an fp32 sum would change with the order). */
static void test_order_free(void **state) {
  (void)state;
  enum { N = 1500, P = 6 };
  uint64_t rng = 13;
  float *x = malloc(P * N * sizeof *x), ref[N], got[N];
  for (size_t i = 0; i < P * N; i++)
    x[i] = (float)(dt_rand_normal(&rng) * pow(10.0, 40.0 * dt_rand_uniform(&rng) - 20.0));
  for (int words = 1; words <= 2; words++) {
    const float *parts[P];
    for (int d = 0; d < P; d++) parts[d] = x + (size_t)d * N;
    assert_int_equal(dopt_dp_sum(parts, P, words, N, ref), DOPT_OK);
    int fp32_differs = 0;
    for (int trial = 0; trial < 20; trial++) {
      for (int d = P - 1; d > 0; d--) {
        int j = (int)(dt_rand_u64(&rng) % (uint64_t)(d + 1));
        const float *t = parts[d];
        parts[d] = parts[j];
        parts[j] = t;
      }
      assert_int_equal(dopt_dp_sum(parts, P, words, N, got), DOPT_OK);
      assert_memory_equal(got, ref, sizeof ref);
      float f0[N], f1[N];
      assert_int_equal(dopt_dp_sum(parts, P, DOPT_DP_SUM_RANK_ORDER, N, f0), DOPT_OK);
      const float *rev[P];
      for (int d = 0; d < P; d++) rev[d] = parts[P - 1 - d];
      assert_int_equal(dopt_dp_sum(rev, P, DOPT_DP_SUM_RANK_ORDER, N, f1), DOPT_OK);
      fp32_differs |= memcmp(f0, f1, sizeof f0) != 0;
    }
    assert_true(fp32_differs); /* the data does exercise order dependence */
  }
  free(x);
}

/* The precision limit, as documented: 2^-40 next to ±2^40 in one block is
 * below one word's grid (unit 2^(41−60)) but on two words' (2^(41−120)). */
static void test_precision_limit(void **state) {
  (void)state;
  float x[3] = {0x1p40f, 0x1p-40f, -0x1p40f};
  assert_true(bits(sum_of(x, 3, 1)) == bits(0.0f));
  assert_true(bits(sum_of(x, 3, 2)) == bits(0x1p-40f));
  /* the fp32 sum in this order loses it too; in another order it keeps it */
  assert_true(sum_of(x, 3, 0) == 0.0f);
  /* at 2^30 below the block maximum one word is still exact (2^(38−2) range) */
  float y[3] = {0x1p40f, 0x1.000002p10f, -0x1p40f};
  assert_true(bits(sum_of(y, 3, 1)) == bits(0x1.000002p10f));
  /* the grid is exactly the documented one: unit 2^(top − K), K = 62 − ⌈log2 n⌉.
   * n = 3 (h = 2): unit 2^(41−60) = 2^-19, so 1.5·2^-19 rounds to the even 2·2^-19;
   * n = 5 (h = 3): unit 2^-18, so 1.5·2^-18 rounds to 2^-17. One headroom bit fewer
   * (a finer grid) would keep them exact, one more would round 2^-18 away. */
  float z3[3] = {0x1p40f, 0x1.8p-19f, -0x1p40f};
  assert_true(bits(sum_of(z3, 3, 1)) == bits(0x1p-18f));
  float z5[5] = {0x1p40f, 0x1.8p-18f, -0x1p40f, 0.0f, 0.0f};
  assert_true(bits(sum_of(z5, 5, 1)) == bits(0x1p-17f));
  float z4[4] = {0x1p40f, 0x1p-18f, -0x1p40f, 0.0f}; /* n = 4 (h = 2): 2^-18 is on the 2^-19 grid */
  assert_true(bits(sum_of(z4, 4, 1)) == bits(0x1p-18f));
}

/* Blocks are independent: a huge value in block 0 leaves block 1's small
 * values exact. */
static void test_blocks_independent(void **state) {
  (void)state;
  enum { N = 3 * DOPT_GRID_BLOCK + 17 };
  float a[N], b[N], out[N];
  for (size_t i = 0; i < N; i++) {
    a[i] = (float)ldexp(1.0 + (double)(i % 7) / 8.0, -60);
    b[i] = (float)ldexp(1.0 + (double)(i % 5) / 4.0, -61);
  }
  a[3] = 1e30f;
  b[3] = -1e30f;
  const float *parts[2] = {a, b};
  assert_int_equal(dopt_dp_sum(parts, 2, 1, N, out), DOPT_OK);
  for (size_t i = DOPT_GRID_BLOCK; i < N; i++) assert_true(bits(out[i]) == bits(a[i] + b[i])); /* exact here */
  assert_true(out[3] == 0.0f);
  assert_true(out[4] == 0.0f); /* block 0: 2^-60 is 2^160 below 1e30: rounded away, as documented */
  assert_true(dopt_grid_blocks(N) == 4);
}

/* Rounding of the total: ties to even, sticky bits, overflow to inf. */
static void test_rounding(void **state) {
  (void)state;
  for (int w = 1; w <= 2; w++) {
    float t1[2] = {1.0f, 0x1p-24f}; /* 1 + half ulp: tie → even (1) */
    assert_true(bits(sum_of(t1, 2, w)) == bits(1.0f));
    float t2[2] = {0x1.000002p0f, 0x1p-24f}; /* odd + half ulp: tie → even (up) */
    assert_true(bits(sum_of(t2, 2, w)) == bits(0x1.000004p0f));
    float t3[3] = {1.0f, 0x1p-24f, 0x1p-40f}; /* above the tie: up */
    assert_true(bits(sum_of(t3, 3, w)) == bits(0x1.000002p0f));
    float t4[3] = {-1.0f, -0x1p-24f, -0x1p-40f};
    assert_true(bits(sum_of(t4, 3, w)) == bits(-0x1.000002p0f));
    float t5[2] = {FLT_MAX, FLT_MAX}; /* exact 2^129 − ...: beyond the range */
    assert_true(isinf(sum_of(t5, 2, w)) && sum_of(t5, 2, w) > 0);
    float t6[2] = {-FLT_MAX, -FLT_MAX};
    assert_true(isinf(sum_of(t6, 2, w)) && sum_of(t6, 2, w) < 0);
    float t7[3] = {FLT_MAX, 0x1p103f, 0.0f}; /* FLT_MAX + half its ulp: tie, odd → inf */
    assert_true(isinf(sum_of(t7, 3, w)));
    float t8[2] = {0x1p-149f, 0x1p-149f}; /* subnormals: exact */
    assert_true(bits(sum_of(t8, 2, w)) == bits(0x1p-148f));
    float t9[2] = {0x1p-126f, -0x1p-149f};
    assert_true(bits(sum_of(t9, 2, w)) == bits(0x1p-126f - 0x1p-149f));
    float t10[2] = {-0.0f, -0.0f}; /* exact zero: +0 */
    assert_true(bits(sum_of(t10, 2, w)) == 0u);
    float t11[4] = {3.0f, -1.5f, 0.25f, -1.75f};
    assert_true(bits(sum_of(t11, 4, w)) == 0u);
  }
}

/* Non-finite contributions: NaN, both infinities → the canonical NaN; one
 * kind of infinity → it; finite neighbours stay exact. */
static void test_nonfinite(void **state) {
  (void)state;
  const float inf = (float)INFINITY;
  float nanv;
  uint32_t payload = 0xffc01234u; /* a negative NaN with a payload */
  memcpy(&nanv, &payload, sizeof nanv);
  for (int w = 1; w <= 2; w++) {
    float a[4] = {1.0f, nanv, inf, 2.0f}, b[4] = {2.0f, 1.0f, 1.0f, -inf}, c[4] = {0.5f, 3.0f, -inf, -inf};
    const float *parts[3] = {a, b, c};
    float out[4];
    assert_int_equal(dopt_dp_sum(parts, 3, w, 4, out), DOPT_OK);
    assert_true(bits(out[0]) == bits(3.5f));
    assert_true(bits(out[1]) == 0x7fc00000u);
    assert_true(bits(out[2]) == 0x7fc00000u); /* +inf and −inf */
    assert_true(isinf(out[3]) && out[3] < 0);
  }
}

/* One part: unchanged (no grid), NaN payloads and −0 included. */
static void test_single_part(void **state) {
  (void)state;
  float x[3] = {-0.0f, 0x1p-149f, 1e30f}, out[3];
  uint32_t payload = 0xffc01234u;
  memcpy(&x[1], &payload, sizeof x[1]);
  const float *parts[1] = {x};
  assert_int_equal(dopt_dp_sum(parts, 1, 1, 3, out), DOPT_OK);
  assert_memory_equal(out, x, sizeof x);
}

static void test_errors(void **state) {
  (void)state;
  float x = 1, out;
  const float *parts[1] = {&x};
  assert_int_equal(dopt_dp_sum(parts, 0, 1, 1, &out), DOPT_ERR_INVALID_ARG);
  assert_int_equal(dopt_dp_sum(parts, 1, 3, 1, &out), DOPT_ERR_INVALID_ARG);
  assert_int_equal(dopt_dp_sum(parts, 1, -1, 1, &out), DOPT_ERR_INVALID_ARG);
  assert_int_equal(dopt_dp_sum(NULL, 1, 1, 1, &out), DOPT_ERR_INVALID_ARG);
  assert_non_null(strstr(dopt_last_error(), "parts"));
}

/* The piece kernels: ranks holding TP blocks (row or column splits, uneven)
 * and ZeRO ranges of them compute codes whose MAX equals the whole tensor's,
 * and words whose SUM decodes to the whole-tensor sum, element by element. */
static void test_pieces(void **state) {
  (void)state;
  enum { B = 2, H = 37, Wd = 300, N = B * H * Wd, DP = 3 };
  uint64_t rng = 14;
  float *x = malloc((size_t)DP * N * sizeof *x), want[N];
  for (size_t i = 0; i < (size_t)DP * N; i++)
    x[i] = (float)(dt_rand_normal(&rng) * pow(2.0, (double)(dt_rand_u64(&rng) % 80) - 40.0));
  const float *parts[DP] = {x, x + N, x + 2 * N};
  for (int words = 1; words <= 2; words++) {
    assert_int_equal(dopt_dp_sum(parts, DP, words, N, want), DOPT_OK);
    int64_t shape[3] = {B, H, Wd};
    for (int split = 0; split < 2; split++) {  /* rows (column-parallel), columns (row-parallel) */
      for (int tp = 1; tp <= 3; tp++) {
        size_t nb = dopt_grid_blocks(N);
        int32_t *codes = calloc(nb, sizeof *codes);
        dopt_piece pcs[3];
        for (int r = 0; r < tp; r++) { /* uneven split: base + (r < rem) */
          dopt_piece *pc = &pcs[r];
          dopt_piece_full(3, shape, pc);
          size_t n = split ? Wd : H, base = n / (size_t)tp, rem = n % (size_t)tp;
          size_t off = (size_t)r * base + ((size_t)r < rem ? (size_t)r : rem), len = base + ((size_t)r < rem);
          if (split) pc->w0 = off, pc->wl = len;
          else pc->h0 = off, pc->hl = len;
          pc->lo = 0;
          pc->len = pc->b * pc->hl * pc->wl;
        }
        /* codes: every rank's TP-local values (gathered from the logical tensors) */
        float *loc = malloc(N * sizeof *loc);
        for (int d = 0; d < DP; d++)
          for (int r = 0; r < tp; r++) {
            for (size_t j = 0; j < pcs[r].len; j++) loc[j] = parts[d][dopt_grid_logical(&pcs[r], j)];
            int64_t bad;
            dopt__grid_codes(loc, &pcs[r], codes, &bad);
            assert_true(bad == 0);
          }
        const int k = 62 - dopt_grid_headroom(DP);
        for (int r = 0; r < tp; r++) {
          const size_t ln = pcs[r].len;
          int64_t *acc = calloc(ln * (size_t)words + 1, sizeof *acc), *w = calloc(ln * (size_t)words + 1, sizeof *w);
          for (int d = 0; d < DP; d++) {
            for (size_t j = 0; j < ln; j++) loc[j] = parts[d][dopt_grid_logical(&pcs[r], j)];
            dopt__grid_encode(loc, &pcs[r], codes, words, k, 0, w, NULL);
            for (size_t q = 0; q < ln * (size_t)words; q++) acc[q] += w[q];
          }
          /* decode in ZeRO ranges of 4 ranks (uneven last) */
          size_t chunk = (ln + 3) / 4;
          for (size_t lo = 0; lo < ln; lo += chunk) {
            dopt_piece z = pcs[r];
            z.lo = lo;
            z.len = ln - lo < chunk ? ln - lo : chunk;
            dopt__grid_decode(acc + lo * (size_t)words, NULL, &z, codes, words, k, loc + lo);
          }
          for (size_t j = 0; j < ln; j++)
            if (bits(loc[j]) != bits(want[dopt_grid_logical(&pcs[r], j)]))
              fail_msg("words=%d split=%d tp=%d rank %d element %zu differs", words, split, tp, r, j);
          free(acc);
          free(w);
        }
        free(loc);
        free(codes);
      }
    }
  }
  free(x);
}

/* ---- the vector kernels (AVX2, AVX-512) against the portable ones, byte for byte ---- */

/* a float of the given kind: 0 wide random (every exponent, subnormals
 * included), 1 subnormal, 2 random with NaN (payloads, both signs) and ±inf
 * mixed in, 3 a block's worth of near-ties: odd multiples of a half unit of
 * a grid far below the block's top (rounding of small elements), 4 zeros and
 * ±0 with a few large values, 5 and 6 random signs and significands within 24 and 28 binades (blocks on
 * dopt_dp_sum's exact double path, or, with more parts, just off it) */
static float vec_value(int kind, uint64_t *rng) {
  const uint64_t r = dt_rand_u64(rng);
  uint32_t u = (uint32_t)r;
  float f;
  switch (kind) {
  case 0: u &= 0xff7fffffu | ((u & 0x40000000u) ? 0u : 0x00800000u); break; /* exponent field ≤ 254 */
  case 1: u &= 0x807fffffu; break;
  case 2:
    if (r % 7 == 0) u |= 0x7f800000u; /* NaN (payload) or inf (zero fraction, 1 in 2^23) */
    else if (r % 11 == 0) u = (u & 0x80000000u) | 0x7f800000u; /* ±inf */
    else u = (u & 0x807fffffu) | (uint32_t)(100 + (r >> 40) % 60) << 23;
    break;
  case 3: {
    const int e = -(int)((r >> 33) % 60); /* 2^0 .. 2^-59 below the top */
    f = (float)ldexp((double)(2 * ((r >> 8) & 0xffff) + 1), e - 17);
    return (r & 1) ? -f : f;
  }
  case 5:
  case 6: u = (u & 0x807fffffu) | (uint32_t)(120 - (int)((r >> 40) % (kind == 5 ? 25u : 29u))) << 23; break;
  default:
    if (r % 13 == 0) u = (u & 0x80000000u) | 0x4f000000u | (u & 0x7fffffu);
    else u &= 0x80000000u;
    break;
  }
  memcpy(&f, &u, sizeof f);
  return f;
}

/* Runs body against the portable kernels for each vector set this CPU and compiler have (AVX2, AVX-512); a set
 * that is missing is said; none at all: skipped. */
typedef void vec_body(const dopt__grid_kern *vk, const char *name);
static void each_vector_set(vec_body *body) {
  static const struct {
    int impl;
    const char *name;
  } sets[] = {{DOPT_GRID_IMPL_AVX2, "avx2"}, {DOPT_GRID_IMPL_AVX512, "avx512"}};
  int ran = 0;
  for (size_t i = 0; i < sizeof sets / sizeof sets[0]; i++) {
    const dopt__grid_kern *vk = dopt__grid_kernels(sets[i].impl);
    if (!vk) {
      print_message("no %s kernels on this CPU/compiler: not compared\n", sets[i].name);
      continue;
    }
    body(vk, sets[i].name);
    ran++;
  }
  if (!ran) skip();
}

/* The whole-tensor sum: same bytes from both kernels for every kind of
 * data, 1..9 parts, both word counts, lengths around block and vector edges. */
static void sum_bitwise(const dopt__grid_kern *vk, const char *name) {
  const dopt__grid_kern *pk = dopt__grid_kernels(DOPT_GRID_IMPL_PORTABLE);
  static const size_t lens[] = {1, 3, 4, 7, 8, 9, 255, 256, 257, 1023, 1024 + 5, 3 * 256 + 13};
  uint64_t rng = 21;
  enum { NMAX = 3 * 256 + 13 + 1024 };
  float *x = malloc(9 * NMAX * sizeof *x), a[NMAX], b[NMAX];
  size_t checked = 0;
  for (int kind = 0; kind < 7; kind++)
    for (size_t li = 0; li < sizeof lens / sizeof lens[0]; li++)
      for (int np = 1; np <= 9; np += (np < 3 ? 1 : 3)) {
        const size_t n = lens[li];
        const float *parts[9];
        for (int d = 0; d < np; d++) {
          for (size_t i = 0; i < n; i++) x[(size_t)d * NMAX + i] = vec_value(kind, &rng);
          parts[d] = x + (size_t)d * NMAX;
        }
        for (int words = 1; words <= 2; words++) {
          memset(a, 0xa5, sizeof a);
          memset(b, 0x5a, sizeof b);
          assert_int_equal(dopt__dp_sum_k(pk, parts, np, words, n, a), DOPT_OK);
          assert_int_equal(dopt__dp_sum_k(vk, parts, np, words, n, b), DOPT_OK);
          for (size_t i = 0; i < n; i++)
            if (bits(a[i]) != bits(b[i]))
              fail_msg("kind %d n=%zu parts=%d words=%d element %zu: portable %08x, %s %08x", kind, n, np, words,
                       i, bits(a[i]), name, bits(b[i]));
          checked += n;
        }
      }
  assert_true(checked > 100000);
  free(x);
}

/* The segment kernels one by one: codes and non-finite counts; the words
 * (set and added) for block codes at and above the elements' own (so every
 * element sits anywhere from on the grid to far below it), every headroom;
 * decode of arbitrary summed words in the kernels' domain (one word |Q| <
 * 2^62; two words |hi| < 2^61, |lo| < 2^62) for every block code, so
 * results cover subnormals, zeros, ties and overflow to inf. */
static void kernels_bitwise(const dopt__grid_kern *vk, const char *name) {
  const dopt__grid_kern *pk = dopt__grid_kernels(DOPT_GRID_IMPL_PORTABLE);
  enum { N = 256 };
  uint64_t rng = 22;
  float x[N], fa[N], fb[N];
  int64_t wa[2 * N], wb[2 * N];
  for (int rep = 0; rep < 400; rep++) {
    const int kind = rep % 7;
    const size_t n = 1 + (size_t)(dt_rand_u64(&rng) % N);
    for (size_t i = 0; i < n; i++) x[i] = vec_value(kind, &rng);
    int64_t ba = 0, bb = 0;
    const int32_t ca = pk->code(x, n, &ba), cb = vk->code(x, n, &bb);
    assert_int_equal(ca, cb);
    assert_true(ba == bb);
    const int h = (int)(dt_rand_u64(&rng) % 19), k = 62 - h;
    int32_t code = ca + (int32_t)(dt_rand_u64(&rng) % 4 == 0 ? dt_rand_u64(&rng) % 70 : 0);
    if (code > 254) code = 254;
    for (int words = 1; words <= 2; words++) {
      for (int add = 0; add <= 1; add++) {
        for (size_t i = 0; i < (size_t)words * n; i++) wa[i] = wb[i] = (int64_t)(dt_rand_u64(&rng) >> 8) - (INT64_C(1) << 55);
        pk->encode(x, n, code, words, k, add, wa);
        vk->encode(x, n, code, words, k, add, wb);
        if (memcmp(wa, wb, (size_t)words * n * sizeof wa[0]) != 0)
          fail_msg("%s encode kind %d n=%zu code %d k=%d words=%d add=%d differs", name, kind, n, code, k, words, add);
      }
      for (size_t i = 0; i < n; i++) {
        const int sh = (int)(dt_rand_u64(&rng) % 64);
        const uint64_t r = dt_rand_u64(&rng);
        int64_t w0 = (int64_t)(r >> 2) >> sh, w1 = (int64_t)(dt_rand_u64(&rng) >> 2) >> (dt_rand_u64(&rng) % 64);
        if (words == 2) w0 >>= 1 + (int)(dt_rand_u64(&rng) % 3 == 0 ? 0 : dt_rand_u64(&rng) % 62);
        if (r & 1) w0 = -w0;
        if (r & 2) w1 = -w1;
        wa[(size_t)words * i] = w0;
        if (words == 2) wa[2 * i + 1] = w1;
      }
      const int32_t dcode = (int32_t)(dt_rand_u64(&rng) % 255);
      pk->decode(wa, n, dcode, words, k, fa);
      vk->decode(wa, n, dcode, words, k, fb);
      for (size_t i = 0; i < n; i++)
        if (bits(fa[i]) != bits(fb[i]))
          fail_msg("decode code %d k=%d words=%d element %zu: portable %08x, %s %08x", dcode, k, words, i,
                   bits(fa[i]), name, bits(fb[i]));
    }
  }
}

/* dopt_dp_sum's double path at its limits, against the words (the portable set) and the exact value: a block
 * whose sum is a tie at fp32's precision plus a tail 2^-54 below its top (the double sum is then inexact and
 * would round the tie to even: the words must be taken), the same tail within range (exact: the double path),
 * and exact zeros, which are +0 in every rounding mode (x + (−x) is −0 rounding downward in double). */
static void double_path(const dopt__grid_kern *vk, const char *name) {
  const dopt__grid_kern *pk = dopt__grid_kernels(DOPT_GRID_IMPL_PORTABLE);
  enum { N = 2 * DOPT_GRID_BLOCK + 16 };
  static float p[3][N];
  const float *parts[3] = {p[0], p[1], p[2]};
  float a[N], b[N];
  for (int far = 0; far <= 1; far++)
    for (int words = 1; words <= 2; words++) {
      memset(p, 0, sizeof p);
      for (size_t i = 0; i < N; i += 37) { /* 1 + 2^-24 + tail: above the tie, rounds up to 1 + 2^-23 */
        p[0][i] = 1.0f, p[1][i] = 0x1p-24f, p[2][i] = far ? 0x1p-54f : 0x1p-27f;
      }
      assert_int_equal(dopt__dp_sum_k(pk, parts, 3, words, N, a), DOPT_OK);
      assert_int_equal(dopt__dp_sum_k(vk, parts, 3, words, N, b), DOPT_OK);
      for (size_t i = 0; i < N; i++) {
        const float want = i % 37 ? 0.0f : 0x1.000002p0f;
        if (bits(a[i]) != bits(want) || bits(b[i]) != bits(want))
          fail_msg("%s tail 2^%d words=%d element %zu: portable %08x, %s %08x, want %08x", name, far ? -54 : -27,
                   words, i, bits(a[i]), name, bits(b[i]), bits(want));
      }
    }
  for (int mode = 0; mode < 2; mode++) {
    for (size_t i = 0; i < N; i++) p[0][i] = (i % 3 == 0) ? -0.0f : 0.75f, p[1][i] = (i % 3 == 0) ? -0.0f : -0.75f;
    const int old = fegetround();
    fesetround(mode ? FE_DOWNWARD : FE_TONEAREST);
    dopt_status s1 = dopt__dp_sum_k(pk, parts, 2, 1, N, a), s2 = dopt__dp_sum_k(vk, parts, 2, 1, N, b);
    fesetround(old);
    assert_int_equal(s1, DOPT_OK);
    assert_int_equal(s2, DOPT_OK);
    for (size_t i = 0; i < N; i++)
      if (bits(a[i]) != 0 || bits(b[i]) != 0)
        fail_msg("%s exact zero, rounding %s, element %zu: portable %08x, %s %08x", name, mode ? "down" : "nearest", i,
                 bits(a[i]), name, bits(b[i]));
  }
}

static void test_double_path(void **state) {
  (void)state;
  each_vector_set(double_path);
}

static void test_vector_sum_bitwise(void **state) {
  (void)state;
  each_vector_set(sum_bitwise);
}

static void test_vector_kernels_bitwise(void **state) {
  (void)state;
  each_vector_set(kernels_bitwise);
}

/* The CPU device's dp average (x / d, and the count of non-finite results), which multiplies by 2^-k where d is a
 * power of two: the division's bits and count for every float class (random bit patterns: NaN payloads,
 * infinities, subnormals, zeros, every exponent), for powers of two whose reciprocal is normal and for other
 * divisors, under round-to-nearest, round-toward-zero and (x86) FTZ|DAZ, each divided here one element at a time. */
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#define HAVE_CSR 1
#endif
static void test_cpu_average(void **state) {
  (void)state;
  enum { N = 50000 };
  const dopt_device *dev = dopt_device_cpu();
  float *x = malloc(N * sizeof *x), *y = malloc(N * sizeof *y);
  assert_non_null(x);
  assert_non_null(y);
  uint64_t rng = 0xA5E1;
  const float ds[] = {1.0f, 2.0f, 4.0f, 8.0f, 64.0f, 0x1p20f, 0.5f, 0x1p126f, 0x1p127f, 3.0f, 6.0f, 12.0f};
  for (int mode = 0; mode < 3; mode++) {
#ifndef HAVE_CSR
    if (mode == 2) break;
#else
    const unsigned csr0 = _mm_getcsr();
#endif
    for (size_t di = 0; di < sizeof ds / sizeof ds[0]; di++) {
      for (size_t i = 0; i < N; i++) { /* odd lengths below: the vector loops' tails */
        const uint32_t u = (uint32_t)dt_rand_u64(&rng);
        memcpy(&x[i], &u, sizeof u);
      }
      x[0] = 0x1p-149f, x[1] = -0x1p-126f, x[2] = FLT_MAX, x[3] = -0.0f, x[4] = INFINITY;
      const size_t n = N - di;
      const int old = fegetround();
      if (mode == 1) fesetround(FE_TOWARDZERO);
#ifdef HAVE_CSR
      if (mode == 2) _mm_setcsr(csr0 | 0x8040u); /* FTZ | DAZ (PyTorch's set_flush_denormal) */
#endif
      int64_t want_bad = 0, bad = -1;
      for (size_t i = 0; i < n; i++) {
        volatile float xi = x[i], di_ = ds[di];
        y[i] = xi / di_;
        want_bad += !isfinite(y[i]);
      }
      const dopt_status st = dev->ops->average(dev->ctx, x, ds[di], n, &bad);
#ifdef HAVE_CSR
      _mm_setcsr(csr0);
#endif
      fesetround(old);
      assert_int_equal(st, DOPT_OK);
      for (size_t i = 0; i < n; i++)
        if (bits(x[i]) != bits(y[i]))
          fail_msg("average by %a, mode %d, element %zu: %08x, the division gives %08x", (double)ds[di], mode, i,
                   bits(x[i]), bits(y[i]));
      assert_int_equal(bad, want_bad);
    }
  }
  free(x);
  free(y);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_oracle_one_word), cmocka_unit_test(test_oracle_two_words),
      cmocka_unit_test(test_order_free),      cmocka_unit_test(test_precision_limit),
      cmocka_unit_test(test_blocks_independent), cmocka_unit_test(test_rounding),
      cmocka_unit_test(test_nonfinite),       cmocka_unit_test(test_single_part),
      cmocka_unit_test(test_errors),          cmocka_unit_test(test_pieces),
      cmocka_unit_test(test_vector_sum_bitwise), cmocka_unit_test(test_vector_kernels_bitwise),
      cmocka_unit_test(test_double_path),     cmocka_unit_test(test_cpu_average),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
