/* GaLore-AdamW8bit: rank-0 groups are AdamW8bit bit for bit; the 8-bit or
 * fp32 choice is made on the low-rank size; the projector refreshes only at
 * 0, T, 2T, ...; decay is applied after the update on the full weight; the
 * memory is the low-rank states plus the projector. (Upstream's 8-bit step
 * runs only on CUDA, so there is no CPU golden run: the kernel itself is
 * tested in test_adamw8bit.c, the projector in test_galore.c.) */
#include "testutil.h"

#include <math.h>
#include <stdlib.h>

#include "distopt/distopt.h"

static float *randn(size_t n, uint64_t seed, double scale) {
  float *x = malloc(n * sizeof *x);
  for (size_t i = 0; i < n; i++) x[i] = (float)(scale * dt_rand_normal(&seed));
  return x;
}

static int add(dopt_optim *o, int g, int64_t m, int64_t n, float *data) {
  dopt_param_config pc = DOPT_PARAM_CONFIG_INIT;
  pc.name = "w";
  pc.ndim = 2;
  pc.shape[0] = m;
  pc.shape[1] = n;
  pc.data = data;
  int id;
  assert_ok(dopt_optim_add_param(o, g, &pc, &id));
  return id;
}

static void test_rank0_is_adamw8bit(void **st) {
  (void)st;
  dopt_optim *a, *b;
  assert_ok(dopt_optim_create("galore_adamw8bit", "lr=1e-2,rank=0", &a));
  assert_ok(dopt_optim_create("adamw8bit", "lr=1e-2", &b));
  float *p = randn(80 * 64, 1, 0.5), *q = randn(80 * 64, 1, 0.5);
  add(a, 0, 80, 64, p);
  add(b, 0, 80, 64, q);
  for (int t = 0; t < 6; t++) {
    float *g = randn(80 * 64, 100 + (uint64_t)t, 1.0);
    const float *gg[1] = {g};
    assert_ok(dopt_optim_step(a, gg));
    assert_ok(dopt_optim_step(b, gg));
    free(g);
  }
  assert_memory_equal(p, q, 80 * 64 * sizeof(float));
  dopt_optim_destroy(a);
  dopt_optim_destroy(b);
  free(p), free(q);
}

/* [64, 100], std projects the smaller side: R = Aᵀ·G is [r, 100]. rank 32:
 * 3200 < 4096 -> fp32 states; rank 48: 4800 -> 8-bit, 256-blocks. */
static void test_low_rank_state_choice_and_memory(void **st) {
  (void)st;
  struct {
    const char *hp;
    dopt_dtype dt;
    size_t bytes;
  } c[] = {
      {"rank=32", DOPT_F32, 8 * 32 * 100 + 4 * 64 * 32},
      {"rank=48", DOPT_U8, 2 * 48 * 100 + 8 * ((48 * 100 + 255) / 256) + 4 * 64 * 48},
  };
  for (int k = 0; k < 2; k++) {
    dopt_optim *o;
    assert_ok(dopt_optim_create("galore_adamw8bit", c[k].hp, &o));
    float *p = randn(6400, 3, 0.5), *g = randn(6400, 4, 1.0);
    add(o, 0, 64, 100, p);
    const float *gg[1] = {g};
    assert_ok(dopt_optim_step(o, gg));
    dopt_state_view v;
    assert_ok(dopt_optim_state(o, 0, 0, &v));
    assert_string_equal(v.name, "state1");
    assert_int_equal(v.dtype, c[k].dt);
    assert_int_equal(v.ndim, 2);
    assert_int_equal(v.shape[0], 64 - (64 - (k ? 48 : 32)));
    assert_int_equal(v.shape[1], 100);
    size_t alloc, full;
    assert_ok(dopt_optim_state_bytes(o, 0, &alloc, &full));
    assert_int_equal(alloc, c[k].bytes);
    assert_int_equal(full, c[k].bytes);
    size_t planned;
    const int64_t shape[2] = {64, 100};
    assert_ok(dopt_optim_state_bytes_for("galore_adamw8bit", c[k].hp, 2, shape, &planned));
    assert_int_equal(planned, c[k].bytes);
    dopt_optim_destroy(o);
    free(p), free(g);
  }
}

/* the projector changes exactly at steps 1, 1+T, 1+2T (0-based 0, T, 2T) */
static void test_refresh_schedule(void **st) {
  (void)st;
  dopt_optim *o;
  assert_ok(dopt_optim_create("galore_adamw8bit", "rank=8,update_proj_gap=3,scale=0.25", &o));
  float *p = randn(40 * 24, 5, 0.5);
  add(o, 0, 40, 24, p);
  float prev[24 * 8];
  int changed[9] = {0};
  for (int t = 1; t <= 9; t++) {
    float *g = randn(40 * 24, 200 + (uint64_t)t, 1.0);
    const float *gg[1] = {g};
    assert_ok(dopt_optim_step(o, gg));
    dopt_state_view v;
    int k = dopt_optim_num_states(o, 0) - 1;
    assert_ok(dopt_optim_state(o, 0, k, &v));
    assert_string_equal(v.name, "projector");
    assert_int_equal(v.bytes, sizeof prev);
    changed[t - 1] = t == 1 || memcmp(prev, v.data, sizeof prev) != 0;
    memcpy(prev, v.data, sizeof prev);
    free(g);
  }
  for (int t = 1; t <= 9; t++) assert_int_equal(changed[t - 1], (t - 1) % 3 == 0);
  dopt_optim_destroy(o);
  free(p);
}

/* zero gradients after a first step: the update is the decaying momentum;
 * with lr·wd > 0 the decay is applied after it, on the full weight. A second
 * optimizer with wd = 0 gives p' = p + U; with wd: (p + U)·(1 − lr·wd) in the
 * form p'' = p' + (−lr·wd)·p'. */
static void test_decay_after_update(void **st) {
  (void)st;
  dopt_optim *a, *b;
  assert_ok(dopt_optim_create("galore_adamw8bit", "lr=1e-2,rank=4,weight_decay=0.1", &a));
  assert_ok(dopt_optim_create("galore_adamw8bit", "lr=1e-2,rank=4,weight_decay=0", &b));
  float *p = randn(30 * 20, 7, 0.5), *q = randn(30 * 20, 7, 0.5), *g = randn(600, 8, 1.0);
  add(a, 0, 30, 20, p);
  add(b, 0, 30, 20, q);
  const float *gg[1] = {g};
  assert_ok(dopt_optim_step(a, gg));
  assert_ok(dopt_optim_step(b, gg));
  /* after one step: q = p0 + U; p = q + (−lr·wd)·q exactly */
  const float neg = (float)(-1e-2 * 0.1);
  for (int i = 0; i < 600; i++) {
    float want = q[i] + neg * q[i];
    if (memcmp(&p[i], &want, sizeof want) != 0) fail_msg("element %d: %.9g vs %.9g", i, (double)p[i], (double)want);
  }
  dopt_optim_destroy(a);
  dopt_optim_destroy(b);
  free(p), free(q), free(g);
}

static void test_validation(void **st) {
  (void)st;
  dopt_optim *o;
  assert_status(dopt_optim_create("galore_adamw8bit", "rank=-1", &o), DOPT_ERR_INVALID_ARG, "rank=-1");
  assert_status(dopt_optim_create("galore_adamw8bit", "block_size=300", &o), DOPT_ERR_INVALID_ARG, "block_size=300");
  assert_status(dopt_optim_create("galore_adamw8bit", "proj_type=diagonal", &o), DOPT_ERR_INVALID_ARG, "diagonal");
  assert_ok(dopt_optim_create("galore_adamw8bit", "rank=128,proj_type=reverse_std,block_size=2048", &o));
  dopt_optim_destroy(o);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_rank0_is_adamw8bit),
      cmocka_unit_test(test_low_rank_state_choice_and_memory),
      cmocka_unit_test(test_refresh_schedule),
      cmocka_unit_test(test_decay_after_update),
      cmocka_unit_test(test_validation),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
