/* The reference step at any thread count: every registered optimizer, with
 * its example and every grid setting, steps the same parameters at 1, 2, 3
 * and 8 threads, and every output — fp32 values, bf16 working copies, every
 * state tensor, step counters, events — is memcmp-equal to the one-thread
 * run. Pieces down to one element (dopt__optim_set_min_chunk) make every
 * parameter split into as many pieces as threads, ragged rows included; a
 * second set runs the default split on a [64, 4096] parameter. */
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "distopt/distopt.h"
#include "optim_impl.h"

#define STEPS 12
#define NP 7
typedef struct pdef {
  const char *name;
  int ndim;
  int64_t shape[3];
  int bf16;
} pdef;

/* Shapes: 1-D, 0-d, ragged 2-D (13 columns), 3-D, a wide 2-D, a bf16 one. */
static const pdef SMALL[NP] = {
    {"bias", 1, {37}, 0},          {"scale", 0, {0}, 0},       {"w.ragged", 2, {5, 13}, 0},
    {"w.3d", 3, {2, 3, 5}, 0},     {"w.wide", 2, {3, 4096}, 0}, {"w.bf16", 2, {4, 9}, 1},
    {"w.tall", 2, {41, 3}, 0},
};
static const pdef LARGE[1] = {{"w.large", 2, {64, 4096}, 0}};

typedef struct run {
  dopt_optim *o;
  int np;
  size_t numel[NP];
  float *data[NP];
  uint16_t *work[NP];
  float *grad[NP];
} run;

static size_t numel_of(const pdef *d) {
  size_t n = 1;
  for (int k = 0; k < d->ndim; k++) n *= (size_t)d->shape[k];
  return n;
}

/* Gradient element k of parameter i at step t: normal, scaled over 2^±12,
 * with exact zeros (a pure function of its indices, the same for every run). */
static float grad_value(int i, int t, size_t k) {
  uint64_t s = ((uint64_t)i << 48) ^ ((uint64_t)t << 32) ^ (uint64_t)k;
  double z = dt_rand_normal(&s);
  if (dt_rand_uniform(&s) < 0.05) return 0.0f;
  return (float)(z * ldexp(1.0, (int)(dt_rand_u64(&s) % 25) - 12));
}

static void run_create(run *r, const char *opt, const char *hp, const pdef *defs, int np, int threads, size_t chunk) {
  memset(r, 0, sizeof *r);
  assert_ok(dopt_optim_create(opt, hp, &r->o));
  assert_ok(dopt_optim_set_threads(r->o, threads));
  dopt__optim_set_min_chunk(r->o, chunk);
  r->np = np;
  for (int i = 0; i < np; i++) {
    size_t n = numel_of(&defs[i]);
    r->numel[i] = n;
    r->data[i] = malloc(n * sizeof(float));
    r->grad[i] = malloc(n * sizeof(float));
    assert_non_null(r->data[i]);
    assert_non_null(r->grad[i]);
    uint64_t s = 1000 + (uint64_t)i;
    for (size_t k = 0; k < n; k++) r->data[i][k] = (float)(dt_rand_normal(&s) * 0.5);
    dopt_param_config c = DOPT_PARAM_CONFIG_INIT;
    c.name = defs[i].name;
    c.ndim = defs[i].ndim;
    memcpy(c.shape, defs[i].shape, sizeof defs[i].shape);
    c.layer = i % 3;
    if (defs[i].bf16) {
      r->work[i] = malloc(n * sizeof(uint16_t));
      assert_non_null(r->work[i]);
      for (size_t k = 0; k < n; k++) r->work[i][k] = dopt_f32_to_bf16(r->data[i][k]);
      c.dtype = DOPT_BF16;
      c.data = r->work[i];
      c.master = r->data[i];
    } else {
      c.data = r->data[i];
    }
    assert_ok(dopt_optim_add_param(r->o, 0, &c, NULL));
  }
}

static void run_steps(run *r) {
  const float *g[NP];
  for (int t = 1; t <= STEPS; t++) {
    for (int i = 0; i < r->np; i++) {
      for (size_t k = 0; k < r->numel[i]; k++) r->grad[i][k] = grad_value(i, t, k);
      g[i] = t % 5 == 3 && i == 1 ? NULL : r->grad[i]; /* a grad None now and then */
    }
    assert_ok(dopt_optim_step(r->o, g));
  }
}

static void run_free(run *r) {
  for (int i = 0; i < r->np; i++) free(r->data[i]), free(r->work[i]), free(r->grad[i]);
  dopt_optim_destroy(r->o);
}

/* Every output of b equals a's, byte for byte. */
static void assert_same(run *a, run *b, const char *what) {
  for (int i = 0; i < a->np; i++) {
    const char *pn = dopt_optim_param_name(a->o, i);
    if (memcmp(a->data[i], b->data[i], a->numel[i] * sizeof(float)))
      fail_msg("%s: parameter '%s' differs", what, pn);
    if (a->work[i] && memcmp(a->work[i], b->work[i], a->numel[i] * sizeof(uint16_t)))
      fail_msg("%s: bf16 copy of '%s' differs", what, pn);
    int64_t sa, sb;
    assert_ok(dopt_optim_get_step(a->o, i, &sa));
    assert_ok(dopt_optim_get_step(b->o, i, &sb));
    if (sa != sb) fail_msg("%s: step of '%s': %lld vs %lld", what, pn, (long long)sa, (long long)sb);
    unsigned ea, eb;
    assert_ok(dopt_optim_events(a->o, i, &ea));
    assert_ok(dopt_optim_events(b->o, i, &eb));
    if (ea != eb) fail_msg("%s: events of '%s': %#x vs %#x", what, pn, ea, eb);
    dopt_counters ca = DOPT_COUNTERS_INIT, cb = DOPT_COUNTERS_INIT; /* the pieces' counts merge to the same */
    assert_ok(dopt_optim_counters(a->o, i, &ca));
    assert_ok(dopt_optim_counters(b->o, i, &cb));
    for (int c = 0; c < DOPT_NCOUNTERS; c++)
      if (ca.total[c] != cb.total[c])
        fail_msg("%s: counter %s of '%s': %lld vs %lld", what, dopt_counter_name(c), pn, (long long)ca.total[c],
                 (long long)cb.total[c]);
    int ns = dopt_optim_num_states(a->o, i);
    assert_int_equal(ns, dopt_optim_num_states(b->o, i));
    for (int k = 0; k < ns; k++) {
      dopt_state_view va, vb;
      assert_ok(dopt_optim_state(a->o, i, k, &va));
      assert_ok(dopt_optim_state(b->o, i, k, &vb));
      assert_int_equal(va.bytes, vb.bytes);
      if (memcmp(va.data, vb.data, va.bytes)) fail_msg("%s: state '%s' of '%s' differs", what, va.name, pn);
    }
  }
}

/* Some parameter moved (the runs compared are not trivially equal). */
static int moved(const run *r) {
  for (int i = 0; i < r->np; i++) {
    uint64_t s = 1000 + (uint64_t)i;
    for (size_t k = 0; k < r->numel[i]; k++)
      if (r->data[i][k] != (float)(dt_rand_normal(&s) * 0.5)) return 1;
  }
  return 0;
}

/* One optimizer and setting: threads 2, 3, 8 against 1. */
static void check_setting(const char *opt, const char *hp, const pdef *defs, int np, size_t chunk,
                          int want_parts_at_8) {
  run one;
  run_create(&one, opt, hp, defs, np, 1, chunk);
  run_steps(&one);
  assert_int_equal(dopt__optim_last_parts(one.o), 1);
  if (!moved(&one)) fail_msg("%s [%s]: no parameter moved", opt, hp);
  const int counts[] = {2, 3, 8};
  for (int c = 0; c < 3; c++) {
    run r;
    run_create(&r, opt, hp, defs, np, counts[c], chunk);
    run_steps(&r);
    assert_int_equal(dopt_optim_get_threads(r.o), counts[c]);
    /* the split really happened (or, for whole-tensor optimizers, did not; LISA: its inner one's); whole is per
     * parameter (dopt__impl_whole: GaLore's unprojected tensors split, Muon's matrices do not) */
    /* a whole-tensor step may split its own work (dopt_par): Muon's (and NorMuon's) Newton-Schulz products split the 64 rows of
     * [64, 4096] in blocks of 6 rows (11 blocks), each part at least 2^20 multiply-adds (X·Xᵀ: 2^24; ns.c); SOAP's
     * mode products and G·Gᵀ of the 64-row side alike (64·64·4096 = 2^24) */
    const int ns = strcmp(opt, "muon") == 0 || strcmp(opt, "normuon") == 0 || strcmp(opt, "soap") == 0;
    const int par_parts = chunk == 0 && ns ? 11 : 1;
    int split = 0;
    for (int i = 0; i < np; i++)
      split |= numel_of(&defs[i]) >= 2 && !dopt__impl_whole(dopt__optim_impl(r.o), dopt__optim_group_hp(r.o, 0), defs[i].ndim, defs[i].shape);
    int want = !split ? (counts[c] < par_parts ? counts[c] : par_parts) : counts[c] == 8 ? want_parts_at_8 : counts[c];
    if (dopt__optim_last_parts(r.o) != want)
      fail_msg("%s [%s] at %d threads: %d pieces, want %d", opt, hp, counts[c], dopt__optim_last_parts(r.o), want);
    char what[256];
    snprintf(what, sizeof what, "%s [%s] at %d threads", opt, hp, counts[c]);
    assert_same(&one, &r, what);
    run_free(&r);
  }
  run_free(&one);
}

static dopt_optim_info registry_info(int i) {
  dopt_optim_info info;
  memset(&info, 0, sizeof info);
  info.version = DOPT_OPTIM_INFO_VERSION;
  assert_ok(dopt_optim_registry_info(i, &info));
  return info;
}

/* Each optimizer's example and grid settings (under DOPT_TEST_SUBSET, test.sh's ThreadSanitizer
 * pass, a rotating part of them and at least one per optimizer: dt_subset_keep). */
static void test_every_optimizer_small(void **st) {
  (void)st;
  int runs = 0, all = 0;
  for (int i = 0; i < dopt_optim_registry_count(); i++) {
    const dopt_optim_info info = registry_info(i);
    for (int k = -1; k < info.grid_count; k++, all++) {
      if (!dt_subset_keep((uint64_t)0x7468726561647300 + (uint64_t)(unsigned)i, k + 1, info.grid_count + 1)) continue;
      check_setting(info.name, k < 0 ? info.example : info.grid[k], SMALL, NP, 1, 8);
      runs++;
    }
  }
  printf("thread counts 2, 3, 8 against 1: %d of %d settings (%s), equal\n", runs, all, dt_subset_desc());
}

/* The default split: 64·4096 elements in 32768-element pieces = 8 at 8 threads (under
 * DOPT_TEST_SUBSET, a rotating part of the optimizers). */
static void test_every_optimizer_large(void **st) {
  (void)st;
  const int n = dopt_optim_registry_count();
  int runs = 0;
  for (int i = 0; i < n; i++) {
    if (!dt_subset_keep((uint64_t)0x6c61726765, i, n)) continue; /* DOPT_TEST_SUBSET: every N-th optimizer */
    const dopt_optim_info info = registry_info(i);
    check_setting(info.name, info.example, LARGE, 1, 0, 8);
    runs++;
  }
  printf("default split, [64, 4096] at 2, 3, 8 threads against 1: %d of %d optimizers (%s), equal\n", runs, n,
         dt_subset_desc());
}

/* bf16 parameters with bf16 gradients (dopt_optim_step_typed): for every optimizer's example, at 2 threads with
 * pieces down to one element (a pointwise optimizer's runs of BF16_RUN elements inside each piece), against the
 * plain fp32 step at 1 thread on the fp32 master with the gradients widened by the test and the working copy
 * rounded by the test: masters, working copies and every state memcmp-equal. [3, 5000]: runs of 2048 cut rows
 * and pieces; at step 5 some working-copy elements are written outside (the fp32 run's masters take those
 * values, the others keep theirs), and a step passes one gradient as fp32 (mixed types in one step). */
static void test_bf16_typed(void **st) {
  (void)st;
  static const pdef P[2] = {{"w.bf16", 2, {3, 5000}, 1}, {"b.bf16", 1, {37}, 1}};
  int runs = 0;
  for (int oi = 0; oi < dopt_optim_registry_count(); oi++) {
    const dopt_optim_info info = registry_info(oi);
    run a, b; /* a: bf16 typed, 2 threads; b: fp32 at 1 thread */
    run_create(&a, info.name, info.example, P, 2, 2, 1);
    pdef F[2] = {P[0], P[1]};
    F[0].bf16 = F[1].bf16 = 0;
    run_create(&b, info.name, info.example, F, 2, 1, 0);
    uint16_t *gb[2];
    for (int i = 0; i < 2; i++) {
      gb[i] = malloc(a.numel[i] * sizeof(uint16_t));
      assert_non_null(gb[i]);
      for (size_t k = 0; k < a.numel[i]; k++) b.data[i][k] = dopt_bf16_to_f32(a.work[i][k]);
      memcpy(a.data[i], b.data[i], a.numel[i] * sizeof(float)); /* the masters start as their copies */
    }
    for (int t = 1; t <= STEPS; t++) {
      const void *ga[2];
      const float *gf[2];
      dopt_dtype dt[2] = {DOPT_BF16, t == 7 ? DOPT_F32 : DOPT_BF16};
      for (int i = 0; i < 2; i++) {
        for (size_t k = 0; k < a.numel[i]; k++) {
          gb[i][k] = dopt_f32_to_bf16(grad_value(i, t, k));
          b.grad[i][k] = a.grad[i][k] = dopt_bf16_to_f32(gb[i][k]);
        }
        ga[i] = dt[i] == DOPT_BF16 ? (const void *)gb[i] : (const void *)a.grad[i];
        gf[i] = b.grad[i];
      }
      /* written outside: every 7th element of the matrix's working copy at step 5 (bf16 gradients), every 3rd of
       * the vector's at step 7 (its gradient fp32 then) */
      for (int i = 0; i < 2 && (t == 5 || t == 7); i++)
        for (size_t k = 0; i == (t == 7) && k < a.numel[i]; k += i ? 3 : 7) {
          a.work[i][k] = dopt_f32_to_bf16(0.25f + (float)(k % 11) * 0.125f);
          if (a.work[i][k] != dopt_f32_to_bf16(b.data[i][k])) /* a value it already rounds to: unchanged */
            b.data[i][k] = dopt_bf16_to_f32(a.work[i][k]);
        }
      assert_ok(dopt_optim_step_typed(a.o, ga, dt));
      assert_ok(dopt_optim_step(b.o, gf));
    }
    char what[256];
    snprintf(what, sizeof what, "%s [%s], bf16 typed at 2 threads against fp32", info.name, info.example);
    for (int i = 0; i < 2; i++) {
      for (size_t k = 0; k < a.numel[i]; k++)
        if (memcmp(&a.data[i][k], &b.data[i][k], sizeof(float)))
          fail_msg("%s: the master of '%s' differs at [%zu]: %.9g, want %.9g", what, P[i].name, k,
                   (double)a.data[i][k], (double)b.data[i][k]);
      for (size_t k = 0; k < a.numel[i]; k++)
        if (a.work[i][k] != dopt_f32_to_bf16(b.data[i][k]))
          fail_msg("%s: the working copy of '%s' [%zu] is not its master rounded", what, P[i].name, k);
      int ns = dopt_optim_num_states(a.o, i);
      assert_int_equal(ns, dopt_optim_num_states(b.o, i));
      for (int k = 0; k < ns; k++) {
        dopt_state_view va, vb;
        assert_ok(dopt_optim_state(a.o, i, k, &va));
        assert_ok(dopt_optim_state(b.o, i, k, &vb));
        if (va.bytes != vb.bytes || memcmp(va.data, vb.data, va.bytes))
          fail_msg("%s: state '%s' of '%s' differs", what, va.name, P[i].name);
      }
      free(gb[i]);
    }
    if (!moved(&b)) fail_msg("%s: no parameter moved", what);
    run_free(&a);
    run_free(&b);
    runs++;
  }
  /* a gradient type the step does not take: refused, naming the parameter */
  dopt_optim *o;
  float w[4] = {0}, g[4] = {0};
  assert_ok(dopt_optim_create("adamw", NULL, &o));
  dopt_param_config c = DOPT_PARAM_CONFIG_INIT;
  c.name = "w";
  c.ndim = 1;
  c.shape[0] = 4;
  c.data = w;
  assert_ok(dopt_optim_add_param(o, 0, &c, NULL));
  const void *gp[1] = {g};
  const dopt_dtype f16[1] = {DOPT_F16};
  assert_status(dopt_optim_step_typed(o, gp, f16), DOPT_ERR_INVALID_ARG, "parameter 0 ('w') is F16; F32 or BF16");
  dopt_optim_destroy(o);
  printf("bf16 parameters and gradients, typed, 2 threads, against fp32: %d optimizers, equal\n", runs);
}

/* DOPT_NUM_THREADS is the default, checked; set_threads overrides it. */
static void test_thread_count(void **st) {
  (void)st;
  dopt_optim *o;
  assert_ok(dopt_optim_create("adamw", NULL, &o));
  setenv("DOPT_NUM_THREADS", "3", 1);
  assert_int_equal(dopt_optim_get_threads(o), 3);
  setenv("DOPT_NUM_THREADS", "0", 1);
  assert_int_equal(dopt_optim_get_threads(o), 0);
  assert_status(dopt_optim_step(o, NULL), DOPT_ERR_INVALID_ARG, "DOPT_NUM_THREADS='0'");
  setenv("DOPT_NUM_THREADS", "4\n", 1);
  assert_status(dopt_optim_step(o, NULL), DOPT_ERR_INVALID_ARG, "DOPT_NUM_THREADS='4\\x0a'");
  assert_ok(dopt_optim_set_threads(o, 2)); /* an explicit count does not read the variable */
  assert_ok(dopt_optim_step(o, NULL));
  assert_int_equal(dopt_optim_get_threads(o), 2);
  unsetenv("DOPT_NUM_THREADS");
  assert_status(dopt_optim_set_threads(o, 257), DOPT_ERR_INVALID_ARG, "nthreads=257");
  assert_status(dopt_optim_set_threads(o, -1), DOPT_ERR_INVALID_ARG, "nthreads=-1");
  assert_ok(dopt_optim_set_threads(o, 0));
  assert_true(dopt_optim_get_threads(o) >= 1); /* the cores */
  dopt_optim_destroy(o);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_thread_count),
      cmocka_unit_test(test_every_optimizer_small),
      cmocka_unit_test(test_every_optimizer_large),
      cmocka_unit_test(test_bf16_typed),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
