/* LISA: layer selection, frozen layers exactly as NULL gradients (checked
 * bit for bit against the plain inner optimizer fed NULL gradients), uniform
 * sampling (chi-square), state persistence vs reset, Adafactor / GaLore /
 * Q-GaLore inside, always-trained parameters, key forwarding, memory over time. */
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "distopt/distopt.h"
#include "lisa_sample.h"

#define MAXP 80

typedef struct model {
  dopt_optim *o;
  int np;
  float *w[MAXP];
  size_t n[MAXP];
  int layer[MAXP];
} model;

/* L layers of two params each ([6, 4] and [4]) plus an embedding [10, 4] and a head [4, 10] (layer -1) */
static void build(model *m, const char *name, const char *hp, int L) {
  memset(m, 0, sizeof *m);
  assert_ok(dopt_optim_create(name, hp, &m->o));
  for (int i = 0; i < 2 * L + 2; i++) {
    dopt_param_config pc = DOPT_PARAM_CONFIG_INIT;
    char nm[32];
    if (i == 0 || i == 2 * L + 1) {
      pc.ndim = 2;
      pc.shape[0] = i ? 4 : 10;
      pc.shape[1] = i ? 10 : 4;
      pc.layer = -1;
      snprintf(nm, sizeof nm, i ? "head" : "embed");
    } else {
      int l = (i - 1) / 2;
      pc.ndim = (i - 1) % 2 ? 1 : 2;
      pc.shape[0] = pc.ndim == 2 ? 6 : 4;
      pc.shape[1] = 4;
      pc.layer = l;
      snprintf(nm, sizeof nm, "layers.%d.%s", l, pc.ndim == 2 ? "w" : "b");
    }
    pc.name = nm;
    size_t n = (size_t)pc.shape[0] * (pc.ndim == 2 ? (size_t)pc.shape[1] : 1);
    uint64_t seed = 1000 + (uint64_t)i;
    m->w[i] = malloc(n * sizeof(float));
    for (size_t k = 0; k < n; k++) m->w[i][k] = (float)(0.5 * dt_rand_normal(&seed));
    pc.data = m->w[i];
    m->n[i] = n;
    m->layer[i] = pc.layer;
    assert_ok(dopt_optim_add_param(m->o, 0, &pc, NULL));
    m->np++;
  }
}

static void destroy(model *m) {
  dopt_optim_destroy(m->o);
  for (int i = 0; i < m->np; i++) free(m->w[i]);
}

static void grads_at(const model *m, int t, float **g) {
  for (int i = 0; i < m->np; i++) {
    uint64_t s = 77 + 1000 * (uint64_t)t + (uint64_t)i;
    for (size_t k = 0; k < m->n[i]; k++) g[i][k] = (float)dt_rand_normal(&s);
  }
}

static int active(int layer, uint64_t seed, int64_t gstep, int K, int L, int k) {
  if (layer < 0) return 1;
  int ws[64], pick[64];
  dopt_lisa_sample(seed, gstep / K, L, k < L ? k : L, ws, pick);
  for (int j = 0; j < (k < L ? k : L); j++)
    if (pick[j] == layer) return 1;
  return 0;
}

/* LISA(inner) against the plain inner optimizer given NULL for the frozen layers: bit-identical parameters,
 * step counts and states, every step. */
static void check_against_null_grads(const char *inner, const char *inner_hp, int L, int k, int K, uint64_t seed,
                                     int steps) {
  char hp[512];
  snprintf(hp, sizeof hp, "inner=%s,n_layers=%d,interval=%d,seed=%llu%s%s", inner, k, K, (unsigned long long)seed,
           *inner_hp ? "," : "", inner_hp);
  model a, b;
  build(&a, "lisa", hp, L);
  build(&b, inner, inner_hp, L);
  float *g[MAXP];
  const float *ga[MAXP], *gb[MAXP];
  for (int i = 0; i < a.np; i++) g[i] = malloc(a.n[i] * sizeof(float));
  for (int t = 0; t < steps; t++) {
    grads_at(&a, t, g);
    float *before[MAXP];
    for (int i = 0; i < a.np; i++) {
      ga[i] = g[i];
      gb[i] = active(a.layer[i], seed, t, K, L, k) ? g[i] : NULL;
      before[i] = malloc(a.n[i] * sizeof(float));
      memcpy(before[i], a.w[i], a.n[i] * sizeof(float));
    }
    assert_ok(dopt_optim_step(a.o, ga));
    assert_ok(dopt_optim_step(b.o, gb));
    for (int i = 0; i < a.np; i++) {
      assert_memory_equal(a.w[i], b.w[i], a.n[i] * sizeof(float));
      int changed = memcmp(before[i], a.w[i], a.n[i] * sizeof(float)) != 0;
      if (!gb[i] && changed) fail_msg("%s: frozen param %d changed at step %d", inner, i, t);
      if (gb[i] && !changed) fail_msg("%s: active param %d unchanged at step %d", inner, i, t);
      int64_t sa, sb;
      assert_ok(dopt_optim_get_step(a.o, i, &sa));
      assert_ok(dopt_optim_get_step(b.o, i, &sb));
      assert_true(sa == sb);
      if (a.layer[i] < 0) assert_true(sa == t + 1); /* always trained */
      assert_int_equal(dopt_optim_num_states(a.o, i), dopt_optim_num_states(b.o, i));
      for (int s = 0; s < dopt_optim_num_states(a.o, i); s++) {
        dopt_state_view va, vb;
        assert_ok(dopt_optim_state(a.o, i, s, &va));
        assert_ok(dopt_optim_state(b.o, i, s, &vb));
        assert_int_equal(va.bytes, vb.bytes);
        assert_memory_equal(va.data, vb.data, va.bytes);
      }
      free(before[i]);
    }
  }
  for (int i = 0; i < a.np; i++) free(g[i]);
  destroy(&a);
  destroy(&b);
}

static void test_frozen_is_null_grad_adamw(void **st) {
  (void)st;
  check_against_null_grads("adamw", "lr=1e-2,weight_decay=0.1", 8, 2, 5, 3, 40);
  check_against_null_grads("adamw", "", 3, 5, 4, 1, 12); /* n_layers > L: every layer */
  check_against_null_grads("adamw", "lr=1e-2", 6, 0, 3, 1, 9); /* n_layers 0: only embed/head */
}

static void test_adafactor_galore_inside(void **st) {
  (void)st;
  check_against_null_grads("adafactor", "lr=1e-2,relative_step=false,beta1=0.9,weight_decay=0.01", 6, 2, 4, 9, 24);
  check_against_null_grads("galore_adamw", "lr=1e-2,rank=2,update_proj_gap=3", 6, 2, 4, 9, 24);
  check_against_null_grads("galore_adamw8bit", "lr=1e-2,rank=2,update_proj_gap=3", 5, 1, 3, 2, 12);
  check_against_null_grads("q_galore", "lr=1e-2,rank=2,update_proj_gap=2,proj_group_size=-1", 5, 2, 3, 2, 12);
}

static void test_keys_and_registry(void **st) {
  (void)st;
  dopt_optim *o;
  for (int i = 0; i < dopt_optim_registry_count(); i++) {
    /* every registered optimizer is an inner choice; a wrapper is refused */
    dopt_optim_info in;
    assert_ok(dopt_optim_registry_info(i, &in));
    const char *nm = in.name;
    /* the example's keys as inner.KEY: the inner's, even where LISA has the key too (galore's inner=) */
    char hp[512];
    int off = snprintf(hp, sizeof hp, "inner=%s", nm);
    for (const char *e = in.wrapper ? "" : in.example; *e;) {
      size_t len = strcspn(e, ",");
      off += snprintf(hp + off, sizeof hp - (size_t)off, ",inner.%.*s", (int)len, e);
      e += len + (e[len] == ',');
    }
    assert_true(off < (int)sizeof hp);
    dopt_status s = dopt_optim_create("lisa", hp, &o);
    if (in.wrapper) {
      assert_int_equal(s, DOPT_ERR_INVALID_ARG);
    } else {
      assert_ok(s);
      assert_string_equal(dopt_optim_name(o), "lisa");
      dopt_optim_destroy(o);
    }
  }
  /* seed is LISA's; inner.seed is galore's; other keys go to the inner optimizer */
  assert_ok(dopt_optim_create("lisa", "inner=galore_adamw,seed=3,inner.seed=4,rank=2,lr=0.5", &o));
  double v;
  assert_ok(dopt_optim_get_hparam(o, 0, "seed", &v));
  assert_true(v == 3);
  assert_ok(dopt_optim_get_hparam(o, 0, "inner.seed", &v));
  assert_true(v == 4);
  assert_ok(dopt_optim_get_hparam(o, 0, "lr", &v));
  assert_true(v == 0.5);
  assert_ok(dopt_optim_get_hparam(o, 0, "interval", &v));
  assert_true(v == 20);
  assert_ok(dopt_optim_get_hparam(o, 0, "n_layers", &v));
  assert_true(v == 2);
  assert_ok(dopt_optim_set_hparam(o, 0, "n_layers", 3));
  assert_int_equal(dopt_optim_set_hparam(o, 0, "inner", 0), DOPT_ERR_STATE);
  int g;
  assert_ok(dopt_optim_add_group(o, "lr=0.1,rank=0", &g));
  assert_int_equal(dopt_optim_add_group(o, "n_layers=1", &g), DOPT_ERR_INVALID_ARG);
  dopt_optim_destroy(o);
  assert_int_equal(dopt_optim_create("lisa", "bogus=1", &o), DOPT_ERR_NOT_FOUND);
  assert_int_equal(dopt_optim_create("lisa", "interval=0", &o), DOPT_ERR_INVALID_ARG);
  assert_int_equal(dopt_optim_create("lisa", "inner=adamw,relative_step=true", &o), DOPT_ERR_NOT_FOUND);
  size_t b1, b2;
  assert_ok(dopt_optim_state_bytes_for("lisa", "inner=adafactor", 2, (int64_t[2]){8, 8}, &b1));
  assert_ok(dopt_optim_state_bytes_for("adafactor", "", 2, (int64_t[2]){8, 8}, &b2));
  assert_int_equal(b1, b2);
  char buf[2048];
  assert_ok(dopt_optim_describe("lisa", buf, sizeof buf));
  assert_non_null(strstr(buf, "reset_states"));
}

/* 2 of 32 layers over 20000 intervals: each layer is drawn 1250 times in
 * expectation. Pearson's statistic over the 32 counts has 31 degrees of
 * freedom; its 0.999 quantile is 61.10, the bound used (the seed is fixed,
 * so the test is deterministic; the bound says the sampler is not detectably
 * non-uniform). Pairs are distinct; the ordered pair (first, second) is also
 * checked over its 992 cells (chi-square, 991 dof, 0.999 quantile ~1134). */
static void test_uniform_chi_square(void **st) {
  (void)st;
  enum { L = 32, K = 2, N = 20000 };
  double count[L] = {0}, pairs[L][L];
  memset(pairs, 0, sizeof pairs);
  for (int64_t i = 0; i < N; i++) {
    int ws[L], pick[K];
    dopt_lisa_sample(12345, i, L, K, ws, pick);
    assert_true(pick[0] != pick[1]);
    count[pick[0]]++, count[pick[1]]++;
    pairs[pick[0]][pick[1]]++;
  }
  double chi = 0, e = (double)N * K / L, chi2 = 0, e2 = (double)N / (L * (L - 1));
  for (int l = 0; l < L; l++) chi += (count[l] - e) * (count[l] - e) / e;
  for (int a = 0; a < L; a++)
    for (int b = 0; b < L; b++)
      if (a != b) chi2 += (pairs[a][b] - e2) * (pairs[a][b] - e2) / e2;
  printf("LISA sampling 2 of 32, 20000 intervals: chi2 = %.1f (31 dof, bound 61.10); ordered pairs chi2 = %.1f (991 "
         "dof, bound 1134)\n",
         chi, chi2);
  assert_true(chi < 61.10);
  assert_true(chi2 < 1134);
}

/* Memory over time: 32 layers, n_layers 2, interval 20, 1000 steps; persistence grows toward full AdamW,
 * reset stays at the active layers. */
static void test_persist_vs_reset_memory(void **st) {
  (void)st;
  const int L = 32, K = 20;
  model p, r;
  build(&p, "lisa", "inner=adamw,n_layers=2,interval=20,seed=1", L);
  build(&r, "lisa", "inner=adamw,n_layers=2,interval=20,seed=1,reset_states=true", L);
  float *g[MAXP * 2];
  const float *gg[MAXP * 2];
  for (int i = 0; i < p.np; i++) g[i] = malloc(p.n[i] * sizeof(float)), gg[i] = g[i];
  size_t full, ap, ar, per_layer = 2 * 4 * (6 * 4 + 4), always = 2 * 4 * 80;
  assert_ok(dopt_optim_state_bytes(p.o, -1, NULL, &full));
  assert_int_equal(full, always + (size_t)L * per_layer);
  printf("LISA memory, 32 layers, n_layers 2, interval 20 (AdamW states, fraction of the layers' full AdamW):\n"
         "  %6s %8s %14s %14s\n",
         "step", "visited", "persist", "reset");
  int visited[64] = {0}, nvis = 0;
  for (int t = 0; t < 1000; t++) {
    grads_at(&p, t, g);
    assert_ok(dopt_optim_step(p.o, gg));
    assert_ok(dopt_optim_step(r.o, gg));
    for (int l = 0; l < L; l++)
      if (active(l, 1, t, K, L, 2) && !visited[l]) visited[l] = 1, nvis++;
    assert_ok(dopt_optim_state_bytes(p.o, -1, &ap, NULL));
    assert_ok(dopt_optim_state_bytes(r.o, -1, &ar, NULL));
    assert_int_equal(ap, always + (size_t)nvis * per_layer);       /* visited layers keep their states */
    assert_int_equal(ar, always + 2 * per_layer);                  /* only the active two */
    if (t + 1 == 20 || t + 1 == 100 || t + 1 == 200 || t + 1 == 400 || t + 1 == 1000)
      printf("  %6d %8d %13.1f%% %13.1f%%\n", t + 1, nvis, 100.0 * (double)(ap - always) / (double)((size_t)L * per_layer),
             100.0 * (double)(ar - always) / (double)((size_t)L * per_layer));
    /* reset: an active layer's step count restarts each interval; persist: it resumes */
    for (int i = 0; i < r.np; i++) {
      if (r.layer[i] < 0 || !active(r.layer[i], 1, t, K, L, 2)) continue;
      int64_t s;
      assert_ok(dopt_optim_get_step(r.o, i, &s));
      assert_true(s == t % K + 1);
    }
  }
  /* persistence: some layer was active in two intervals, so its step exceeds one interval */
  int64_t mx = 0, s;
  for (int i = 0; i < p.np; i++)
    if (p.layer[i] >= 0 && dopt_optim_get_step(p.o, i, &s) == DOPT_OK && s > mx) mx = s;
  assert_true(mx > K);
  for (int i = 0; i < p.np; i++) free(g[i]);
  destroy(&p);
  destroy(&r);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_frozen_is_null_grad_adamw),
      cmocka_unit_test(test_adafactor_galore_inside),
      cmocka_unit_test(test_keys_and_registry),
      cmocka_unit_test(test_uniform_chi_square),
      cmocka_unit_test(test_persist_vs_reset_memory),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
