/* Determinism: random fp32 reductions are bitwise identical across runs and
 * equal a serial reference in the documented order; ring order differs from
 * rank order on such data but is itself reproducible; bf16 accumulates in
 * fp32 and rounds once. */
#include "simtest.h"

enum { MAXN = 8, COUNT = 4099 };

typedef struct det_ctx {
  float in[MAXN][COUNT];
  float out[MAXN][COUNT];
  float rs[MAXN][COUNT];
} det_ctx;

static dopt_status det_body(dopt_sim_comm *c, int rank, void *user) {
  det_ctx *d = user;
  int n;
  DOPT_TRY(dopt_sim_comm_size(c, &n));
  for (int i = 0; i < 3; i++) /* repeated calls on the same communicator */
    DOPT_TRY(dopt_sim_all_reduce(d->in[rank], d->out[rank], COUNT, DOPT_F32, DOPT_SUM, c));
  return dopt_sim_reduce_scatter(d->in[rank], d->rs[rank], COUNT / (size_t)n, DOPT_F32,
                                 DOPT_SUM, c);
}

static void fill_random(det_ctx *d, int n, uint64_t seed) {
  for (int r = 0; r < n; r++)
    for (int e = 0; e < COUNT; e++) /* mixed magnitudes so the order matters */
      d->in[r][e] = (float)(dt_rand_normal(&seed) * (e % 3 == 0 ? 1e4 : 1.0));
}

static void run_mode(det_ctx *d, int n, dopt_sim_mode mode) {
  dopt_sim_config cfg = DOPT_SIM_CONFIG_INIT;
  cfg.nranks = n;
  cfg.mode = mode;
  dopt_status s[MAXN];
  st_run(&cfg, det_body, d, s, NULL, NULL);
  for (int r = 0; r < n; r++)
    assert_int_equal(s[r], DOPT_OK);
  for (int r = 1; r < n; r++) /* every rank holds the same bits */
    assert_memory_equal(d->out[0], d->out[r], sizeof d->out[0]);
}

/* Serial reference: element e starts at rank start(e) and walks the ring. */
static float serial(const det_ctx *d, int n, int e, int start) {
  float acc = d->in[start][e];
  for (int j = 1; j < n; j++)
    acc += d->in[(start + j) % n][e];
  return acc;
}

static int ring_start(int n, int e) {
  /* chunk c of n balanced chunks holds e; it starts at rank (c+1) mod n */
  int base = COUNT / n, rem = COUNT % n;
  int c = e < rem * (base + 1) ? e / (base + 1) : rem + (e - rem * (base + 1)) / base;
  return (c + 1) % n;
}

static void check_n(int n) {
  det_ctx *a = calloc(1, sizeof *a), *b = calloc(1, sizeof *b);
  assert_non_null(a);
  assert_non_null(b);
  fill_random(a, n, 42);
  fill_random(b, n, 42);
  run_mode(a, n, DOPT_SIM_ORDER_RANK);
  run_mode(b, n, DOPT_SIM_ORDER_RANK);
  assert_memory_equal(a->out, b->out, sizeof a->out);
  for (int e = 0; e < COUNT; e++) {
    float want = serial(a, n, e, 0);
    assert_memory_equal(&a->out[0][e], &want, sizeof want);
  }
  for (int r = 0; r < n; r++) /* reduce_scatter block r == the all-reduce's block */
    assert_memory_equal(a->rs[r], &a->out[0][(size_t)r * (COUNT / (size_t)n)],
                        (COUNT / (size_t)n) * sizeof(float));
  /* ring order: reproducible, equals its serial model, differs from rank order */
  run_mode(b, n, DOPT_SIM_ORDER_RING);
  det_ctx *c = calloc(1, sizeof *c);
  assert_non_null(c);
  fill_random(c, n, 42);
  run_mode(c, n, DOPT_SIM_ORDER_RING);
  assert_memory_equal(b->out, c->out, sizeof b->out);
  int differ = 0;
  for (int e = 0; e < COUNT; e++) {
    float want = serial(b, n, e, ring_start(n, e));
    assert_memory_equal(&b->out[0][e], &want, sizeof want);
    differ += memcmp(&b->out[0][e], &a->out[0][e], sizeof want) != 0;
  }
  if (n >= 3)
    assert_true(differ > 0);
  free(a);
  free(b);
  free(c);
}

static void test_rank_vs_ring(void **st) {
  (void)st;
  check_n(2);
  check_n(3);
  check_n(5);
  check_n(8);
}

/* bf16: 1 + 2^-8 + 2^-8 is 1 + 2^-7 in fp32 (representable in bf16), while a
 * bf16 accumulator would round 1 + 2^-8 to even (1.0) twice. */
typedef struct bf16_ctx {
  uint16_t in[3], out[3];
} bf16_ctx;

static dopt_status bf16_body(dopt_sim_comm *c, int rank, void *user) {
  bf16_ctx *b = user;
  return dopt_sim_all_reduce(&b->in[rank], &b->out[rank], 1, DOPT_BF16, DOPT_SUM, c);
}

static void test_bf16_rounds_once(void **st) {
  (void)st;
  bf16_ctx b = {{st_bf16(1.0f), st_bf16(0.00390625f), st_bf16(0.00390625f)}, {0}};
  dopt_sim_config cfg = DOPT_SIM_CONFIG_INIT;
  cfg.nranks = 3;
  dopt_status s[3];
  st_run(&cfg, bf16_body, &b, s, NULL, NULL);
  for (int r = 0; r < 3; r++) {
    assert_int_equal(s[r], DOPT_OK);
    assert_true(st_from_bf16(b.out[r]) == 1.0078125f);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_rank_vs_ring),
      cmocka_unit_test(test_bf16_rounds_once),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
