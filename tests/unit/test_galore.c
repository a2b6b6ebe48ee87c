/* GaLore: golden vectors against galore_torch 1.0 (datasets/golden/galore/,
 * gen_galore.py), and unit tests of the projector and galore_adamw: the
 * proj-type table, rank clamp, refresh schedule, moments kept across
 * refreshes, SVD fallback/failure, non-matrix parameters, memory formula,
 * determinism (runs, BLAS threads, randomized seeds), grouping helper.
 *
 * Golden tolerance. The C side repeats upstream's fp32 operations in order;
 * what differs is rounding: LAPACK sgesdd vs torch's SVD (singular vectors
 * agree to ~κ·u with κ = σ1/(σj − σj+1) ≈ 3–5 for the test spectra, whose
 * gaps are 30%: ~1e-6 relative), OpenBLAS GEMMs vs torch's (different
 * summation order: a few ulp on R and on the back-projection) and torch's
 * FMA-contracted a + α·b. The projector error feeds R and the update
 * linearly; the update is lr·scale·N ≈ 5e-3 of a weight of size ~1, so
 * over 24 steps parameters stay within 1e-6 normwise (measured ≤ 1.5e-7).
 * Projectors: 1e-5 (measured: bitwise equal, as Debian's torch runs the same
 * LAPACK sgesdd; another LAPACK would differ by ~κ·u ≈ 1e-6). Moments live in
 * projector coordinates and carry R's GEMM rounding without lr damping:
 * 1e-5 (measured ≤ 3.3e-7). A wrong side, a missing scale, a reset moment or
 * a wrong refresh step would change results at the 1e-3 level or more
 * (expected from the update size, not measured here). The GaLoreAdafactor
 * cases (galore inner=adafactor) hold the same bounds with more margin:
 * Adafactor's update is lr·RMS(W)·N with N clipped to RMS 1, the same size
 * (params ≤ 1.7e-7 over 24 and 200 steps, moments ≤ 4.3e-7); decaying after
 * the update instead of before shows at 2.8e-6 on step 1, RMS from the
 * low-rank numel or from U instead of W at 1 (both measured). */
#include "testutil.h"

#include <cblas.h>
#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "distopt/distopt.h"
#include "distopt/galore.h"
#include "distopt/safetensors.h"
#include "galore_proj.h"
#include "optim_impl.h"
#include "registry.h"

#define TOL_PARAM 1e-6
#define TOL_PROJ 1e-5
#define TOL_MOMENT 1e-5
#define MAXP 16

static double normwise(const float *a, const float *b, size_t n) {
  double maxd = 0, maxb = 0;
  for (size_t i = 0; i < n; i++) {
    double d = fabs((double)a[i] - (double)b[i]);
    if (!(d <= maxd)) maxd = d;
    if (fabs((double)b[i]) > maxb) maxb = fabs((double)b[i]);
  }
  return maxd == 0 ? 0 : (maxb > 0 ? maxd / maxb : INFINITY);
}

/* ---- golden ------------------------------------------------------------------------ */

static void run_golden(const char *path, const char *file, double worst[3]) {
  dopt_st_file *f;
  assert_ok(dopt_st_load(path, &f));
  dopt_optim *o;
  const char *opt = dopt_st_meta(f, "optimizer"); /* GaLoreAdamW, or GaLoreAdafactor as galore inner=adafactor */
  if (!opt || (strcmp(opt, "galore_adamw") != 0 && strcmp(opt, "galore") != 0))
    fail_msg("%s: optimizer '%s' is not galore_adamw or galore", file, opt ? opt : "(none)");
  assert_ok(dopt_optim_create(opt, dopt_st_meta(f, "hparams"), &o));
  int g1;
  assert_ok(dopt_optim_add_group(o, dopt_st_meta(f, "group_hparams"), &g1));
  char names[MAXP][32], key[256];
  const char *ev = dopt_st_meta(f, "record_every"); /* the long cases record every 10th step */
  int np = 0, steps = atoi(dopt_st_meta(f, "steps")), every = ev ? atoi(ev) : 1;
  assert_true(every >= 1 && steps % every == 0);
  char *tmp = strdup(dopt_st_meta(f, "params")), *save = NULL;
  for (char *t = strtok_r(tmp, ",", &save); t; t = strtok_r(NULL, ",", &save)) snprintf(names[np++], 32, "%s", t);
  free(tmp);
  const char *gl = dopt_st_meta(f, "groups");
  float *data[MAXP], *grad[MAXP];
  const float *gp[MAXP];
  size_t numel[MAXP];
  for (int i = 0; i < np; i++) {
    dopt_st_tensor t;
    snprintf(key, sizeof key, "init/%s", names[i]);
    assert_ok(dopt_st_find(f, key, &t));
    numel[i] = t.numel;
    data[i] = malloc(t.numel * sizeof(float));
    grad[i] = malloc(t.numel * sizeof(float));
    memcpy(data[i], t.data, t.numel * sizeof(float));
    dopt_param_config pc = DOPT_PARAM_CONFIG_INIT;
    pc.name = names[i];
    pc.ndim = t.ndim;
    memcpy(pc.shape, t.shape, sizeof pc.shape);
    pc.data = data[i];
    char needle[40];
    snprintf(needle, sizeof needle, ",%s,", names[i]);
    char hay[256];
    snprintf(hay, sizeof hay, ",%s,", gl);
    assert_ok(dopt_optim_add_param(o, strstr(hay, needle) ? g1 : 0, &pc, NULL));
  }
  float *gold = malloc(4096 * sizeof(float));
  for (int t = 1; t <= steps; t++) {
    for (int i = 0; i < np; i++) {
      snprintf(key, sizeof key, "grad/%d/%s", t, names[i]);
      assert_ok(dopt_st_read_f32(f, key, grad[i], numel[i]));
      gp[i] = grad[i];
    }
    assert_ok(dopt_optim_step(o, gp));
    for (int i = 0; i < np && t % every == 0; i++) {
      snprintf(key, sizeof key, "param/%d/%s", t, names[i]);
      assert_ok(dopt_st_read_f32(f, key, gold, numel[i]));
      double e = normwise(data[i], gold, numel[i]);
      if (e > worst[0]) worst[0] = e;
      if (!(e <= TOL_PARAM)) fail_msg("%s: %s normwise %.3g > %g", file, key, e, TOL_PARAM);
      int ns = dopt_optim_num_states(o, i), seen = 0;
      snprintf(key, sizeof key, "state/%d/%s/", t, names[i]);
      size_t kl = strlen(key);
      for (int k = 0; k < dopt_st_count(f); k++) {
        dopt_st_tensor st;
        dopt_st_get(f, k, &st);
        if (strncmp(st.name, key, kl) != 0) continue;
        const char *sk = st.name + kl;
        if (strcmp(sk, "step") == 0) {
          int64_t mine;
          assert_ok(dopt_optim_get_step(o, i, &mine));
          assert_true((double)mine == (double)((const float *)st.data)[0]);
          continue;
        }
        seen++;
        int found = 0;
        for (int s = 0; s < ns; s++) {
          dopt_state_view v;
          assert_ok(dopt_optim_state(o, i, s, &v));
          if (strcmp(v.name, sk) != 0) continue;
          found = 1;
          if (v.bytes / 4 != st.numel || v.ndim != st.ndim)
            fail_msg("%s: %s: %zu elements here, %zu upstream", file, st.name, v.bytes / 4, st.numel);
          for (int d = 0; d < v.ndim; d++) assert_int_equal(v.shape[d], st.shape[d]);
          memcpy(gold, st.data, st.numel * sizeof(float));
          double es = normwise(v.data, gold, st.numel);
          int proj = strncmp(sk, "projector", 9) == 0;
          if (es > worst[proj ? 1 : 2]) worst[proj ? 1 : 2] = es;
          double tol = proj ? TOL_PROJ : TOL_MOMENT;
          if (!(es <= tol)) fail_msg("%s: %s normwise %.3g > %g", file, st.name, es, tol);
        }
        if (!found) fail_msg("%s: upstream state %s has no counterpart", file, st.name);
      }
      if (seen != ns) fail_msg("%s: %s step %d: %d states here, %d upstream", file, names[i], t, ns, seen);
    }
  }
  for (int i = 0; i < np; i++) free(data[i]), free(grad[i]);
  free(gold);
  dopt_optim_destroy(o);
  dopt_st_free(f);
}

static void test_golden(void **st) {
  (void)st;
  char dir[1024];
  snprintf(dir, sizeof dir, "%s/datasets/golden/galore", dt_source_dir());
  DIR *d = opendir(dir);
  if (!d) fail_msg("golden directory %s missing", dir);
  struct dirent *e;
  int n = 0;
  printf("%-42s %12s %12s %12s\n", "case", "param rel", "proj rel", "moment rel");
  while ((e = readdir(d))) {
    size_t l = strlen(e->d_name);
    if (l < 13 || strcmp(e->d_name + l - 12, ".safetensors") != 0) continue;
    char path[1400];
    snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
    double worst[3] = {0, 0, 0};
    run_golden(path, e->d_name, worst);
    printf("%-42s %12.3g %12.3g %12.3g\n", e->d_name, worst[0], worst[1], worst[2]);
    n++;
  }
  closedir(d);
  assert_true(n >= 14); /* 7 GaLoreAdamW and 7 GaLoreAdafactor cases */
}

/* ---- helpers ------------------------------------------------------------------------- */

static void fill_normal(float *x, size_t n, uint64_t seed, float scale) {
  uint64_t s = seed;
  for (size_t i = 0; i < n; i++) x[i] = (float)dt_rand_normal(&s) * scale;
}

typedef struct run1 {
  dopt_optim *o;
  float *w;
  int64_t shape[2];
} run1;

static void run1_init_opt(run1 *r, const char *opt, const char *hp, int64_t m, int64_t n) {
  assert_ok(dopt_optim_create(opt, hp, &r->o));
  r->shape[0] = m;
  r->shape[1] = n;
  r->w = malloc((size_t)(m * n) * sizeof(float));
  fill_normal(r->w, (size_t)(m * n), 7, 0.5f);
  dopt_param_config pc = DOPT_PARAM_CONFIG_INIT;
  pc.name = "w";
  pc.ndim = 2;
  pc.shape[0] = m;
  pc.shape[1] = n;
  pc.data = r->w;
  assert_ok(dopt_optim_add_param(r->o, 0, &pc, NULL));
}
static void run1_init(run1 *r, const char *hp, int64_t m, int64_t n) { run1_init_opt(r, "galore_adamw", hp, m, n); }
static void run1_free(run1 *r) {
  dopt_optim_destroy(r->o);
  free(r->w);
}
static dopt_status run1_step(run1 *r, uint64_t seed) {
  size_t n = (size_t)(r->shape[0] * r->shape[1]);
  float *g = malloc(n * sizeof *g);
  fill_normal(g, n, seed, 1e-2f);
  const float *gp[1] = {g};
  dopt_status s = dopt_optim_step(r->o, gp);
  free(g);
  return s;
}
static dopt_state_view state_of(run1 *r, const char *name) {
  for (int i = 0; i < dopt_optim_num_states(r->o, 0); i++) {
    dopt_state_view v;
    assert_ok(dopt_optim_state(r->o, 0, i, &v));
    if (strcmp(v.name, name) == 0) return v;
  }
  fail_msg("no state %s", name);
  dopt_state_view none = {0};
  return none;
}
static unsigned events_of(run1 *r) {
  unsigned e;
  assert_ok(dopt_optim_events(r->o, 0, &e));
  return e;
}

/* ---- unit tests ---------------------------------------------------------------------- */

/* The projector hook (dopt_optim_set_projector_hook): what it is told, when, and what it supplies. */
typedef struct hook_log {
  int calls, mode; /* mode 0: decline, 1: supply `given`, -1: fail */
  int64_t steps[8], m, n, r;
  int param, left, right;
  const float *given;
} hook_log;
static int hook_fn(void *user, int param, int64_t step, const float *grad, int64_t m, int64_t n, int64_t r,
                   float *left, float *right) {
  hook_log *h = user;
  if (h->calls < 8) h->steps[h->calls] = step;
  h->calls++;
  h->param = param, h->m = m, h->n = n, h->r = r, h->left = left != NULL, h->right = right != NULL;
  if (!grad) return -1;
  if (h->mode == 1) memcpy(left ? left : right, h->given, (size_t)(left ? m * r : r * n) * sizeof(float));
  return h->mode;
}

static void test_projector_hook(void **st) {
  (void)st;
  const char *hp = "inner=adafactor,rank=3,update_proj_gap=4,beta1=0.9";
  run1 a, b, c;
  run1_init_opt(&a, "galore", hp, 12, 8); /* m >= n: std projects the right side, B [3, 8] */
  run1_init_opt(&b, "galore", hp, 12, 8);
  hook_log hb = {0};
  assert_ok(dopt_optim_set_projector_hook(b.o, hook_fn, &hb));
  for (int t = 1; t <= 9; t++) {
    assert_ok(run1_step(&a, 100 + (uint64_t)t));
    assert_ok(run1_step(&b, 100 + (uint64_t)t));
  }
  /* declined: the SVD's result, bit for bit; called at the refreshes only (steps 1, 5, 9), with the plan's shape */
  assert_memory_equal(a.w, b.w, 96 * sizeof(float));
  dopt_state_view pa = state_of(&a, "projector"), pb = state_of(&b, "projector");
  assert_memory_equal(pa.data, pb.data, pa.bytes);
  assert_int_equal(hb.calls, 3);
  assert_true(hb.steps[0] == 1 && hb.steps[1] == 5 && hb.steps[2] == 9);
  assert_true(hb.m == 12 && hb.n == 8 && hb.r == 3 && !hb.left && hb.right && hb.param == 0);
  /* supplied: the state holds exactly the caller's projector, and the run follows it (not the SVD's) */
  float given[24];
  memset(given, 0, sizeof given);
  for (int k = 0; k < 3; k++) given[k * 8 + (7 - k)] = 1.0f; /* rows e7, e6, e5 */
  run1_init_opt(&c, "galore", hp, 12, 8);
  hook_log hc = {0};
  hc.mode = 1;
  hc.given = given;
  assert_ok(dopt_optim_set_projector_hook(c.o, hook_fn, &hc));
  assert_ok(run1_step(&c, 101));
  dopt_state_view pc = state_of(&c, "projector");
  assert_memory_equal(pc.data, given, sizeof given);
  run1_free(&a);
  run1_init_opt(&a, "galore", hp, 12, 8);
  assert_ok(run1_step(&a, 101));
  if (memcmp(a.w, c.w, 96 * sizeof(float)) == 0) fail_msg("the supplied projector changed nothing");
  /* the caller's projector moves only its 3 columns of each row: columns 0..4 keep their values */
  run1 z;
  run1_init_opt(&z, "galore", hp, 12, 8);
  for (int i = 0; i < 12; i++)
    for (int j = 0; j < 5; j++) assert_true(c.w[i * 8 + j] == z.w[i * 8 + j]);
  run1_free(&z);
  /* failing: one line naming the parameter and the step; another optimizer refuses the hook */
  hc.mode = -1;
  run1_free(&c);
  run1_init_opt(&c, "galore", hp, 12, 8);
  assert_ok(dopt_optim_set_projector_hook(c.o, hook_fn, &hc));
  assert_status(run1_step(&c, 101), DOPT_ERR_INVALID_ARG, "parameter 0 at step 1");
  dopt_optim *o;
  assert_ok(dopt_optim_create("adamw", NULL, &o));
  assert_status(dopt_optim_set_projector_hook(o, hook_fn, &hc), DOPT_ERR_UNSUPPORTED, "'adamw'");
  dopt_optim_destroy(o);
  assert_ok(dopt_optim_create("q_galore", NULL, &o)); /* its quantised path asks too (test_qgalore) */
  assert_ok(dopt_optim_set_projector_hook(o, hook_fn, &hc));
  dopt_optim_destroy(o);
  assert_ok(dopt_optim_create("lamb", NULL, &o));
  assert_status(dopt_optim_set_projector_hook(o, hook_fn, &hc), DOPT_ERR_UNSUPPORTED, "'lamb'");
  dopt_optim_destroy(o);
  assert_ok(dopt_optim_create("lisa", "inner=galore_adamw,rank=2", &o));
  assert_ok(dopt_optim_set_projector_hook(o, hook_fn, &hc));
  dopt_optim_destroy(o);
  run1_free(&a);
  run1_free(&b);
  run1_free(&c);
}

static void test_registry_hparams(void **st) {
  (void)st;
  assert_non_null(strstr("adamw adafactor came lamb galore_adamw", "galore_adamw"));
  int found = 0;
  for (int i = 0; i < dopt_optim_registry_count(); i++) found |= strcmp(dopt_optim_registry_name(i), "galore_adamw") == 0;
  assert_true(found);
  dopt_optim *o = NULL;
  assert_ok(dopt_optim_create("galore_adamw", NULL, &o));
  double v;
  assert_ok(dopt_optim_get_hparam(o, 0, "eps", &v));
  assert_true(v == 1e-6);
  assert_ok(dopt_optim_get_hparam(o, 0, "update_proj_gap", &v));
  assert_true(v == 200);
  assert_ok(dopt_optim_get_hparam(o, 0, "oversample", &v));
  assert_true(v == -1); /* auto: as many extra columns as the rank */
  assert_ok(dopt_optim_get_hparam(o, 0, "power_iters", &v));
  assert_true(v == 4);
  dopt_optim_destroy(o);
  assert_status(dopt_optim_create("galore_adamw", "proj_type=sideways", &o), DOPT_ERR_INVALID_ARG, "sideways");
  assert_status(dopt_optim_create("galore_adamw", "rank=2.5", &o), DOPT_ERR_INVALID_ARG, "rank=2.5");
  assert_status(dopt_optim_create("galore_adamw", "update_proj_gap=0", &o), DOPT_ERR_INVALID_ARG, "update_proj_gap=0");
  assert_status(dopt_optim_create("galore_adamw", "power_iters=-1", &o), DOPT_ERR_INVALID_ARG, "power_iters=-1");
  assert_status(dopt_optim_create("galore_adamw", "oversample=-2", &o), DOPT_ERR_INVALID_ARG, "oversample=-2");
  assert_ok(dopt_optim_create("galore_adamw", "proj_type=full,svd=randomized", &o));
  assert_ok(dopt_optim_get_hparam(o, 0, "proj_type", &v));
  assert_true(v == DOPT_PROJ_FULL);
  dopt_optim_destroy(o);
  /* the composite galore: inner.KEY names a key of the inner only, under one prefix (inner.rank went to the
   * projector's rank and inner.inner.lr to lr; LISA refuses both alike) */
  assert_ok(dopt_optim_create("galore", "inner=adamw,inner.lr=0.01,rank=2", &o));
  assert_ok(dopt_optim_get_hparam(o, 0, "inner.lr", &v));
  assert_true(v == 0.01);
  assert_ok(dopt_optim_get_hparam(o, 0, "rank", &v));
  assert_true(v == 2);
  dopt_optim_destroy(o);
  assert_status(dopt_optim_create("galore", "inner=adamw,inner.rank=3", &o), DOPT_ERR_NOT_FOUND, "'inner.rank'");
  assert_status(dopt_optim_create("galore", "inner=adamw,inner.inner.lr=0.1", &o), DOPT_ERR_NOT_FOUND,
                "'inner.inner.lr'");
}

/* Under a wrapper (galore, lisa) every key of the inner optimizer has the inner's default, in group 0 and in a
 * group added with no overrides, for every inner the wrapper takes (a default read from another optimizer's table
 * — Muon's lr for a group of another inner — changed results and no test saw it). The inner created alone with
 * the same keys is the reference. */
static void test_wrapped_defaults(void **st) {
  (void)st;
  static const char *const wrappers[] = {"galore", "lisa"};
  int checked = 0;
  for (int w = 0; w < 2; w++)
    for (int i = 0; i < dopt_optim_registry_count(); i++) {
      const char *name = dopt_optim_registry_name(i);
      const dopt_optim_impl *im = dopt_find_impl(name);
      dopt_optim *x = NULL, *o = NULL;
      const char *ex;
      char hp[512];
      dt_wrapped_hparams(name, hp, sizeof hp, &ex);
      if (dopt_optim_create(wrappers[w], hp, &o) != DOPT_OK) continue; /* an inner this wrapper refuses */
      assert_ok(dopt_optim_create(name, ex, &x));
      int go, gx;
      assert_ok(dopt_optim_add_group(o, "", &go));
      assert_ok(dopt_optim_add_group(x, "", &gx));
      for (int k = 0; k < im->nhp; k++) {
        char key[96];
        snprintf(key, sizeof key, "inner.%s", im->hp[k].key);
        for (int g = 0; g < 2; g++) {
          double a, b;
          assert_ok(dopt_optim_get_hparam(x, g ? gx : 0, im->hp[k].key, &a));
          if (dopt_optim_get_hparam(o, g ? go : 0, key, &b) != DOPT_OK)
            fail_msg("%s(%s): no %s: %s", wrappers[w], hp, key, dopt_last_error());
          if (!(a == b || (isnan(a) && isnan(b))))
            fail_msg("%s(%s) group %d: %s is %g, %s alone has %g", wrappers[w], hp, g ? go : 0, key, b, name, a);
          checked++;
        }
      }
      dopt_optim_destroy(o);
      dopt_optim_destroy(x);
    }
  printf("wrapped defaults: %d (wrapper, inner, group, key) checked\n", checked);
  assert_true(checked > 100);
}

/* Muon's lr none under galore: 0.02 in a Muon group, aux Adam's 3e-4 in a use_muon=false group, as Muon alone
 * resolves it — the run with lr none is bitwise the run with that lr given (the low-rank decay factor took
 * Muon's 0.02 in every group once: the digest changed and no test saw it). */
static void test_wrapped_muon_lr_default(void **st) {
  (void)st;
  static const struct {
    const char *group, *lr;
  } c[] = {{"use_muon=auto", "0.02"}, {"use_muon=true", "0.02"}, {"use_muon=false", "3e-4"}};
  for (size_t k = 0; k < sizeof c / sizeof c[0]; k++) {
    char a[256], b[300];
    snprintf(a, sizeof a, "inner=muon,rank=2,update_proj_gap=2,inner.weight_decay=0.1,%s", c[k].group);
    snprintf(b, sizeof b, "%s,inner.lr=%s", a, c[k].lr);
    run1 x, y;
    run1_init_opt(&x, "galore", a, 9, 6);
    run1_init_opt(&y, "galore", b, 9, 6);
    for (uint64_t t = 1; t <= 3; t++) {
      assert_ok(run1_step(&x, t));
      assert_ok(run1_step(&y, t));
    }
    if (memcmp(x.w, y.w, 9 * 6 * sizeof(float)) != 0)
      fail_msg("galore(%s): lr none is not lr=%s after 3 steps", a, c[k].lr);
    run1_free(&x);
    run1_free(&y);
  }
}

/* galore_torch's projector rule (docs/galore.md): projected side and low-rank shape. */
static void test_plan_table(void **st) {
  (void)st;
  static const struct {
    int type;
    size_t m, n;
    int left, right;
    size_t rows, cols;
  } c[] = {
      {DOPT_PROJ_STD, 24, 16, 0, 1, 24, 4},         {DOPT_PROJ_STD, 16, 24, 1, 0, 4, 24},
      {DOPT_PROJ_STD, 20, 20, 0, 1, 20, 4},         {DOPT_PROJ_REVERSE_STD, 24, 16, 1, 0, 4, 16},
      {DOPT_PROJ_REVERSE_STD, 16, 24, 0, 1, 16, 4}, {DOPT_PROJ_LEFT, 16, 24, 1, 0, 4, 24},
      {DOPT_PROJ_LEFT, 24, 16, 1, 0, 4, 16},        {DOPT_PROJ_RIGHT, 16, 24, 0, 1, 16, 4},
      {DOPT_PROJ_FULL, 24, 16, 1, 1, 4, 4},
  };
  for (size_t i = 0; i < sizeof c / sizeof c[0]; i++) {
    dopt_galore_plan p;
    dopt_galore_plan_make(c[i].type, c[i].m, c[i].n, 4, &p);
    assert_int_equal(p.left, c[i].left);
    assert_int_equal(p.right, c[i].right);
    assert_int_equal(p.rows, c[i].rows);
    assert_int_equal(p.cols, c[i].cols);
    assert_false(p.clamped);
  }
}

/* rank > min(m, n): clamped, reported, state shapes use the clamped rank;
 * state memory = 2·r·max(m,n)·4 + r·min(m,n)·4 (std). */
static void test_rank_clamp_and_memory(void **st) {
  (void)st;
  run1 r;
  run1_init(&r, "rank=12,lr=1e-2", 9, 5);
  assert_ok(run1_step(&r, 1));
  assert_true(events_of(&r) & DOPT_EVENT_RANK_CLAMPED);
  dopt_state_view p = state_of(&r, "projector"), m = state_of(&r, "exp_avg");
  assert_int_equal(p.shape[0], 5);
  assert_int_equal(p.shape[1], 5);
  assert_int_equal(m.shape[0], 9);
  assert_int_equal(m.shape[1], 5);
  run1_free(&r);
  run1_init(&r, "rank=3", 40, 17);
  size_t full;
  assert_ok(dopt_optim_state_bytes(r.o, 0, NULL, &full));
  assert_int_equal(full, 2 * 3 * 40 * 4 + 3 * 17 * 4);
  assert_ok(run1_step(&r, 2));
  assert_int_equal(events_of(&r), 0);
  run1_free(&r);
}

/* Refresh at 0-based iterations 0, T, 2T: 1-based steps 1, T+1, 2T+1. */
static void test_refresh_schedule(void **st) {
  (void)st;
  run1 r;
  run1_init(&r, "rank=3,update_proj_gap=3,proj_type=left", 12, 10);
  float prev[36];
  for (int t = 1; t <= 10; t++) {
    assert_ok(run1_step(&r, (uint64_t)(100 + t)));
    dopt_state_view p = state_of(&r, "projector");
    assert_int_equal(p.shape[0], 12);
    int changed = t == 1 || memcmp(prev, p.data, sizeof prev) != 0;
    assert_int_equal(changed, (t - 1) % 3 == 0);
    memcpy(prev, p.data, sizeof prev);
  }
  run1_free(&r);
}

/* A refresh neither resets nor rotates the moments: m ← β1·m + (1−β1)·R_new
 * with R_new projected on the new basis (bitwise: the same fp32 operations). */
static void test_moments_kept(void **st) {
  (void)st;
  run1 r;
  run1_init(&r, "rank=4,update_proj_gap=2,beta1=0.8", 16, 12);
  assert_ok(run1_step(&r, 11));
  assert_ok(run1_step(&r, 12));
  dopt_state_view m = state_of(&r, "exp_avg");
  float mb[16 * 4], g[16 * 12], R[16 * 4];
  memcpy(mb, m.data, sizeof mb);
  assert_ok(run1_step(&r, 13)); /* step 3: iter 2 → refresh */
  fill_normal(g, 16 * 12, 13, 1e-2f);
  dopt_galore_plan pl;
  dopt_galore_plan_make(DOPT_PROJ_STD, 16, 12, 4, &pl);
  dopt_galore_project(&pl, g, NULL, state_of(&r, "projector").data, R, NULL);
  const float *ma = state_of(&r, "exp_avg").data;
  for (int i = 0; i < 16 * 4; i++) assert_true(ma[i] == mb[i] * 0.8f + (float)(1.0 - 0.8) * R[i]);
  int64_t t;
  assert_ok(dopt_optim_get_step(r.o, 0, &t));
  assert_int_equal(t, 3);
  run1_free(&r);
}

static int all_finite(const float *x, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (!isfinite(x[i])) return 0;
  return 1;
}

static void test_svd_fallback_and_failure(void **st) {
  (void)st;
  run1 r;
  /* sgesdd "fails" once: sgesvd is used, same subspace, event */
  run1_init(&r, "rank=3,update_proj_gap=2", 14, 9);
  dopt__galore_inject_svd_failures(1);
  assert_ok(run1_step(&r, 21));
  assert_int_equal(events_of(&r), DOPT_EVENT_SVD_FALLBACK);
  float B[27];
  memcpy(B, state_of(&r, "projector").data, sizeof B);
  run1_free(&r);
  run1_init(&r, "rank=3,update_proj_gap=2", 14, 9);
  assert_ok(run1_step(&r, 21));
  assert_int_equal(events_of(&r), 0);
  assert_true(normwise(state_of(&r, "projector").data, B, 27) < 1e-5);
  /* both fail at a later refresh: previous projector kept, params finite */
  assert_ok(run1_step(&r, 22));
  memcpy(B, state_of(&r, "projector").data, sizeof B);
  dopt__galore_inject_svd_failures(2);
  assert_ok(run1_step(&r, 23)); /* step 3 = iter 2: refresh */
  assert_int_equal(events_of(&r), DOPT_EVENT_SVD_FALLBACK | DOPT_EVENT_SVD_FAILED);
  assert_memory_equal(state_of(&r, "projector").data, B, sizeof B);
  assert_true(all_finite(r.w, 14 * 9));
  /* a NaN gradient at a refresh: both LAPACK drivers refuse it; the
   * projector is kept (finite, unchanged); the update itself is upstream's
   * HF AdamW, which has no non-finite guard (docs/galore.md) */
  assert_ok(run1_step(&r, 24));
  memcpy(B, state_of(&r, "projector").data, sizeof B);
  float g[14 * 9];
  fill_normal(g, 14 * 9, 25, 1e-2f);
  g[17] = NAN;
  const float *gp[1] = {g};
  assert_ok(dopt_optim_step(r.o, gp)); /* step 5 = iter 4: refresh */
  assert_true(events_of(&r) & DOPT_EVENT_SVD_FAILED);
  assert_memory_equal(state_of(&r, "projector").data, B, sizeof B);
  run1_free(&r);
  /* no previous projector: a clear error */
  run1_init(&r, "rank=3", 14, 9);
  dopt__galore_inject_svd_failures(2);
  assert_status(run1_step(&r, 26), DOPT_ERR_NUMERIC, "no previous projector");
  assert_true(all_finite(r.w, 14 * 9));
  dopt__galore_inject_svd_failures(0);
  run1_free(&r);
}

/* Non-matrix parameters in a GaLore group are plain HF AdamW; [1, m, n] is a matrix. */
static void test_non_matrix_params(void **st) {
  (void)st;
  dopt_optim *o, *ref;
  assert_ok(dopt_optim_create("galore_adamw", "rank=2,weight_decay=0.1", &o));
  assert_ok(dopt_optim_create("galore_adamw", "rank=0,weight_decay=0.1", &ref));
  float v1[7], v2[7], t1[40], t2[40], u[30], g1[7], g3[40], gu[30];
  fill_normal(v1, 7, 1, 1), fill_normal(t1, 40, 2, 1), fill_normal(u, 30, 3, 1);
  memcpy(v2, v1, sizeof v1), memcpy(t2, t1, sizeof t1);
  dopt_param_config pc = DOPT_PARAM_CONFIG_INIT;
  pc.ndim = 1, pc.shape[0] = 7, pc.data = v1;
  assert_ok(dopt_optim_add_param(o, 0, &pc, NULL));
  pc.data = v2;
  assert_ok(dopt_optim_add_param(ref, 0, &pc, NULL));
  pc.ndim = 3, pc.shape[0] = 2, pc.shape[1] = 4, pc.shape[2] = 5, pc.data = t1;
  assert_ok(dopt_optim_add_param(o, 0, &pc, NULL));
  pc.data = t2;
  assert_ok(dopt_optim_add_param(ref, 0, &pc, NULL));
  pc.shape[0] = 1, pc.shape[1] = 6, pc.shape[2] = 5, pc.data = u;
  assert_ok(dopt_optim_add_param(o, 0, &pc, NULL));
  for (int t = 0; t < 3; t++) {
    fill_normal(g1, 7, (uint64_t)(10 + t), 0.1f), fill_normal(g3, 40, (uint64_t)(20 + t), 0.1f);
    fill_normal(gu, 30, (uint64_t)(30 + t), 0.1f);
    const float *ga[3] = {g1, g3, gu}, *gb[2] = {g1, g3};
    assert_ok(dopt_optim_step(o, ga));
    assert_ok(dopt_optim_step(ref, gb));
  }
  assert_memory_equal(v1, v2, sizeof v1);
  assert_memory_equal(t1, t2, sizeof t1);
  assert_int_equal(dopt_optim_num_states(o, 2), 3); /* [1,6,5]: exp_avg [6,2], exp_avg_sq, projector [2,5] */
  dopt_state_view sv;
  assert_ok(dopt_optim_state(o, 2, 0, &sv));
  assert_int_equal(sv.shape[0], 6);
  assert_int_equal(sv.shape[1], 2);
  dopt_optim_destroy(o);
  dopt_optim_destroy(ref);
}

/* bitwise: the same run twice, and with OpenBLAS at 1 and 4 threads (the
 * library pins one thread around its calls and restores the count). */
static void run_big(const char *hp, int threads, float *out_w, float *out_p, size_t np) {
  openblas_set_num_threads(threads);
  run1 r;
  run1_init(&r, hp, 160, 128);
  for (int t = 0; t < 4; t++) assert_ok(run1_step(&r, (uint64_t)(40 + t)));
  assert_int_equal(openblas_get_num_threads(), threads);
  memcpy(out_w, r.w, 160 * 128 * sizeof(float));
  dopt_state_view p = state_of(&r, "projector");
  assert_int_equal(p.bytes, np * sizeof(float));
  memcpy(out_p, p.data, p.bytes);
  run1_free(&r);
  openblas_set_num_threads(1);
}

static void test_determinism(void **st) {
  (void)st;
  const char *hps[] = {"rank=24,update_proj_gap=2", "rank=24,update_proj_gap=2,svd=randomized,seed=5"};
  for (int k = 0; k < 2; k++) {
    size_t nw = 160 * 128, np = 24 * 128;
    float *w1 = malloc(nw * 4), *w2 = malloc(nw * 4), *p1 = malloc(np * 4), *p2 = malloc(np * 4);
    run_big(hps[k], 1, w1, p1, np);
    run_big(hps[k], 1, w2, p2, np);
    assert_memory_equal(w1, w2, nw * 4);
    assert_memory_equal(p1, p2, np * 4);
    run_big(hps[k], 4, w2, p2, np);
    assert_memory_equal(w1, w2, nw * 4);
    assert_memory_equal(p1, p2, np * 4);
    free(w1), free(w2), free(p1), free(p2);
  }
}

/* sin of the largest principal angle between span(A) and span(B), both [m, r] orthonormal */
static double sin_theta(const float *A, const float *B, size_t m, size_t r) {
  float *M = malloc(r * r * sizeof *M), *s = malloc(r * sizeof *s);
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)r, (int)r, (int)m, 1.0f, A, (int)r, B, (int)r, 0.0f, M,
              (int)r);
  dopt_svd_opts ex = {DOPT_SVD_EXACT, 0, 0, 0, 0};
  assert_ok(dopt_galore_svd(r, r, r, M, &ex, 1, NULL, s, NULL, NULL));
  double c = s[r - 1] < 1 ? s[r - 1] : 1;
  free(M), free(s);
  return sqrt(1 - c * c);
}

static void test_randomized_svd(void **st) {
  (void)st;
  const size_t m = 120, n = 90, r = 10;
  float *g = malloc(m * n * 4), *U0 = malloc(m * r * 4), *U1 = malloc(m * r * 4), *U2 = malloc(m * r * 4);
  float *U3 = malloc(m * r * 4);
  /* decaying spectrum: G = Σ σ_i x_i y_iᵀ with σ_i = i^-1.5, plus noise */
  float *x = malloc(m * 30 * 4), *y = malloc(n * 30 * 4);
  fill_normal(x, m * 30, 51, 1), fill_normal(y, n * 30, 52, 1), fill_normal(g, m * n, 53, 1e-4f);
  for (size_t i = 0; i < 30; i++)
    for (size_t a = 0; a < m; a++)
      for (size_t b = 0; b < n; b++) g[a * n + b] += (float)pow((double)i + 1, -1.5) * x[a * 30 + i] * y[b * 30 + i];
  dopt_svd_opts ex = {DOPT_SVD_EXACT, 0, 0, 0, 0}, rs = {DOPT_SVD_RANDOMIZED, 8, 2, 7, 3};
  assert_ok(dopt_galore_svd(m, n, r, g, &ex, 1, U0, NULL, NULL, NULL));
  assert_ok(dopt_galore_svd(m, n, r, g, &rs, 1, U1, NULL, NULL, NULL));
  assert_ok(dopt_galore_svd(m, n, r, g, &rs, 1, U2, NULL, NULL, NULL));
  assert_memory_equal(U1, U2, m * r * 4); /* same seed and step: same bits */
  rs.seed = 8;
  assert_ok(dopt_galore_svd(m, n, r, g, &rs, 1, U3, NULL, NULL, NULL));
  assert_true(memcmp(U1, U3, m * r * 4) != 0); /* another seed: another sketch */
  double s1 = sin_theta(U0, U1, m, r), s3 = sin_theta(U0, U3, m, r);
  printf("randomized vs exact: sin theta %.3g (seed 7), %.3g (seed 8)\n", s1, s3);
  assert_true(s1 < 0.05 && s3 < 0.05);
  /* the generator: a pure function of (seed, step, index) */
  assert_true(dopt_galore_gauss(1, 2, 3) == dopt_galore_gauss(1, 2, 3));
  assert_true(dopt_galore_gauss(1, 2, 3) != dopt_galore_gauss(1, 3, 3));
  /* sign convention: largest-magnitude component of each kept vector > 0 */
  for (size_t j = 0; j < r; j++) {
    float best = 0;
    for (size_t a = 0; a < m; a++)
      if (fabsf(U1[a * r + j]) > fabsf(best)) best = U1[a * r + j];
    assert_true(best > 0);
  }
  free(g), free(U0), free(U1), free(U2), free(U3), free(x), free(y);
}

static void test_groups_helper(void **st) {
  (void)st;
  assert_int_equal(dopt_galore_classify("layer.0.attn.q_proj.weight", 2), DOPT_GALORE_CLASS_GALORE);
  assert_int_equal(dopt_galore_classify("layer.0.attn.q_proj.bias", 1), DOPT_GALORE_CLASS_NODECAY);
  assert_int_equal(dopt_galore_classify("encoder.LayerNorm.weight", 1), DOPT_GALORE_CLASS_NODECAY);
  assert_int_equal(dopt_galore_classify("model.norm.weight", 1), DOPT_GALORE_CLASS_NODECAY);
  assert_int_equal(dopt_galore_classify("conv.weight", 4), DOPT_GALORE_CLASS_DECAY);
  assert_int_equal(dopt_galore_classify("scale", 1), DOPT_GALORE_CLASS_DECAY);
  assert_int_equal(dopt_galore_classify(NULL, 2), -1);
  dopt_optim *o;
  assert_ok(dopt_optim_create("galore_adamw", "weight_decay=0.05", &o));
  int g, d, nd;
  assert_ok(dopt_galore_add_groups(o, "rank=64,scale=0.5", &g, &d, &nd));
  double v;
  assert_ok(dopt_optim_get_hparam(o, g, "rank", &v));
  assert_true(v == 64);
  assert_ok(dopt_optim_get_hparam(o, g, "scale", &v));
  assert_true(v == 0.5);
  assert_ok(dopt_optim_get_hparam(o, g, "update_proj_gap", &v));
  assert_true(v == 200);
  assert_ok(dopt_optim_get_hparam(o, g, "weight_decay", &v));
  assert_true(v == 0.05);
  assert_ok(dopt_optim_get_hparam(o, d, "rank", &v));
  assert_true(v == 0);
  assert_ok(dopt_optim_get_hparam(o, d, "weight_decay", &v));
  assert_true(v == 0.05);
  assert_ok(dopt_optim_get_hparam(o, nd, "weight_decay", &v));
  assert_true(v == 0);
  assert_status(dopt_galore_add_groups(o, "rank=0", NULL, NULL, NULL), DOPT_ERR_INVALID_ARG, "rank=0");
  assert_status(dopt_galore_add_groups(o, "bogus=1", NULL, NULL, NULL), DOPT_ERR_NOT_FOUND, "bogus");
  dopt_optim_destroy(o);
  assert_ok(dopt_optim_create("adamw", NULL, &o));
  assert_status(dopt_galore_add_groups(o, NULL, NULL, NULL, NULL), DOPT_ERR_INVALID_ARG, "rank");
  dopt_optim_destroy(o);
}

/* The cost model that balances owners (docs/distributed.md "Owners by cost"), transcribed: per projector side
 * 2·m·n·r (project, back), 4·m·n, the inner's step on the low-rank shape (8 per element for AdamW) and the
 * SVD over the gap (dense 4·m·n·min(m, n); randomized (2 + 2q)·m·n·k); an unprojected parameter the inner's. */
static void test_cost_model(void **st) {
  (void)st;
  static const struct {
    const char *opt, *hp;
    int64_t m, n;
    double want;
  } C[] = {
      /* std on a wide matrix: left side, R [r, n] */
      {"galore_adamw", "rank=8,update_proj_gap=200", 64, 256,
       2.0 * 64 * 256 * 8 + 4.0 * 64 * 256 + 8.0 * 8 * 256 + 4.0 * 64 * 256 * 64 / 200},
      /* tall, right side, gap 10 */
      {"galore_adamw", "rank=4,update_proj_gap=10", 300, 40,
       2.0 * 300 * 40 * 4 + 4.0 * 300 * 40 + 8.0 * 300 * 4 + 4.0 * 300 * 40 * 40 / 10},
      /* full: both sides, R [r, r] */
      {"galore", "inner=adamw,rank=4,update_proj_gap=50,proj_type=full", 30, 20,
       2.0 * 30 * 20 * 4 * 2 + 4.0 * 30 * 20 + 8.0 * 4 * 4 + 4.0 * 30 * 20 * 20 / 50},
      /* randomized: k = r + oversample (default r), q = 2 */
      {"galore", "inner=adamw,rank=4,update_proj_gap=20,svd=randomized,power_iters=2", 100, 60,
       2.0 * 100 * 60 * 4 + 4.0 * 100 * 60 + 8.0 * 100 * 4 + (2.0 + 2.0 * 2) * 100 * 60 * 8 / 20},
      /* rank 0: unprojected, the inner's elementwise step */
      {"galore_adamw", "rank=0", 64, 256, 8.0 * 64 * 256},
      {"adamw", NULL, 64, 256, 8.0 * 64 * 256},
  };
  for (size_t k = 0; k < sizeof C / sizeof C[0]; k++) {
    dopt_optim *o = NULL;
    assert_ok(dopt_optim_create(C[k].opt, C[k].hp, &o));
    const int64_t shape[2] = {C[k].m, C[k].n};
    const double got = dopt__impl_cost(dopt__optim_impl(o), dopt__optim_group_hp(o, 0), 2, shape);
    if (fabs(got - C[k].want) > 1e-9 * C[k].want)
      fail_msg("%s [%s] on [%lld, %lld]: cost %.17g, the formula %.17g", C[k].opt, C[k].hp ? C[k].hp : "",
               (long long)C[k].m, (long long)C[k].n, got, C[k].want);
    dopt_optim_destroy(o);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_cost_model),
      cmocka_unit_test(test_registry_hparams), cmocka_unit_test(test_wrapped_defaults), cmocka_unit_test(test_wrapped_muon_lr_default),   cmocka_unit_test(test_plan_table),
      cmocka_unit_test(test_projector_hook),
      cmocka_unit_test(test_rank_clamp_and_memory), cmocka_unit_test(test_refresh_schedule),
      cmocka_unit_test(test_moments_kept),       cmocka_unit_test(test_svd_fallback_and_failure),
      cmocka_unit_test(test_non_matrix_params),  cmocka_unit_test(test_determinism),
      cmocka_unit_test(test_randomized_svd),     cmocka_unit_test(test_groups_helper),
      cmocka_unit_test(test_golden),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
