/* The optimizer API: registry, key=value hyperparameters and their
 * validation, groups, grad-None skipping, state layout and exact memory
 * accounting, determinism and edge cases (zero weights, zero gradients). */
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "distopt/device.h"
#include "grid.h"
#include "optim_impl.h"
#include "distopt/distopt.h"

static void test_registry(void **st) {
  (void)st;
  const char *want[] = {"adamw", "adafactor", "came", "lamb"};
  assert_true(dopt_optim_registry_count() >= 4); /* the first four; later optimizers are appended */
  for (int i = 0; i < 4; i++) assert_string_equal(dopt_optim_registry_name(i), want[i]);
  assert_null(dopt_optim_registry_name(dopt_optim_registry_count()));
  dopt_optim *o = (dopt_optim *)1;
  assert_status(dopt_optim_create("adamx", NULL, &o), DOPT_ERR_NOT_FOUND, "'adamx'");
  assert_null(o);
  assert_true(strstr(dopt_last_error(), "adafactor") != NULL); /* lists what exists */
  char buf[2048];
  assert_ok(dopt_optim_describe("came", buf, sizeof buf));
  assert_non_null(strstr(buf, "beta3"));
}

/* Every rejection names the key and the offending value. */
static void test_hparam_parsing(void **st) {
  (void)st;
  dopt_optim *o = NULL;
  assert_status(dopt_optim_create("adamw", "lrr=1", &o), DOPT_ERR_NOT_FOUND, "'lrr'");
  assert_status(dopt_optim_create("adamw", "lr=nan", &o), DOPT_ERR_INVALID_ARG, "lr=nan");
  assert_status(dopt_optim_create("adamw", "lr=inf", &o), DOPT_ERR_INVALID_ARG, "lr=inf");
  assert_status(dopt_optim_create("adamw", "lr=1e-3x", &o), DOPT_ERR_INVALID_ARG, "lr='1e-3x'");
  assert_status(dopt_optim_create("adamw", "lr", &o), DOPT_ERR_INVALID_ARG, "'lr'");
  assert_status(dopt_optim_create("adamw", "lr=none", &o), DOPT_ERR_INVALID_ARG, "lr=none");
  assert_status(dopt_optim_create("adamw", "amsgrad=2", &o), DOPT_ERR_INVALID_ARG, "amsgrad=2");
  assert_status(dopt_optim_create("adamw", "lr=-1", &o), DOPT_ERR_INVALID_ARG, "lr=-1");
  assert_status(dopt_optim_create("adamw", "beta1=1", &o), DOPT_ERR_INVALID_ARG, "beta1=1");
  assert_status(dopt_optim_create("lamb", "eps=-1e-6", &o), DOPT_ERR_INVALID_ARG, "eps=-1e-06");
  assert_ok(dopt_optim_create("adamw", " lr = 0.01 , amsgrad=true,weight_decay=0 ", &o));
  double v;
  assert_ok(dopt_optim_get_hparam(o, 0, "lr", &v));
  assert_true(v == 0.01);
  assert_ok(dopt_optim_get_hparam(o, 0, "amsgrad", &v));
  assert_true(v == 1.0);
  assert_ok(dopt_optim_get_hparam(o, 0, "eps", &v));
  assert_true(v == 1e-8); /* torch default */
  dopt_optim_destroy(o);
}

/* Adafactor: what upstream rejects and what it misses. */
static void test_adafactor_validation(void **st) {
  (void)st;
  dopt_optim *o = NULL;
  assert_status(dopt_optim_create("adafactor", "lr=1e-3", &o), DOPT_ERR_INVALID_ARG, "relative_step");
  assert_status(dopt_optim_create("adafactor", "warmup_init=true,relative_step=false,lr=1e-3", &o),
                DOPT_ERR_INVALID_ARG, "warmup_init");
  assert_status(dopt_optim_create("adafactor", "relative_step=false", &o), DOPT_ERR_INVALID_ARG, "lr=none");
  assert_status(dopt_optim_create("adafactor", "decay_rate=0.8", &o), DOPT_ERR_INVALID_ARG, "decay_rate=0.8");
  assert_status(dopt_optim_create("adafactor", "decay_rate=0", &o), DOPT_ERR_INVALID_ARG, "decay_rate=0");
  assert_status(dopt_optim_create("adafactor", "clip_threshold=0", &o), DOPT_ERR_INVALID_ARG, "clip_threshold=0");
  assert_status(dopt_optim_create("adafactor", "eps1=-1e-30", &o), DOPT_ERR_INVALID_ARG, "eps1=-1e-30");
  assert_status(dopt_optim_create("adafactor", "eps2=-1", &o), DOPT_ERR_INVALID_ARG, "eps2=-1");
  assert_status(dopt_optim_create("adafactor", "beta1=1.5", &o), DOPT_ERR_INVALID_ARG, "beta1=1.5");
  assert_ok(dopt_optim_create("adafactor", "relative_step=false,lr=1e-3,beta1=none", &o));
  dopt_optim_destroy(o);
  assert_status(dopt_optim_create("came", NULL, &o), DOPT_ERR_INVALID_ARG, "lr=none");
  assert_status(dopt_optim_create("came", "lr=0", &o), DOPT_ERR_INVALID_ARG, "lr=0");
  assert_status(dopt_optim_create("came", "lr=1e-4,beta3=1.1", &o), DOPT_ERR_INVALID_ARG, "beta3=1.1");
  /* a group override is validated on top of the defaults */
  assert_ok(dopt_optim_create("adafactor", NULL, &o));
  int g;
  assert_status(dopt_optim_add_group(o, "lr=0.1", &g), DOPT_ERR_INVALID_ARG, "relative_step");
  assert_int_equal(dopt_optim_num_groups(o), 1);
  dopt_optim_destroy(o);
}

static float *make_param(size_t n, uint64_t seed) {
  float *p = malloc(n * sizeof *p);
  for (size_t i = 0; i < n; i++) p[i] = (float)dt_rand_normal(&seed);
  return p;
}

static int add(dopt_optim *o, int g, const char *name, int ndim, const int64_t *shape, float *data) {
  dopt_param_config pc = DOPT_PARAM_CONFIG_INIT;
  pc.name = name;
  pc.ndim = ndim;
  for (int i = 0; i < ndim; i++) pc.shape[i] = shape[i];
  pc.data = data;
  int id = -1;
  assert_ok(dopt_optim_add_param(o, g, &pc, &id));
  return id;
}

static void test_add_param_errors(void **st) {
  (void)st;
  dopt_optim *o;
  assert_ok(dopt_optim_create("adamw", NULL, &o));
  float buf[16];
  dopt_param_config pc = DOPT_PARAM_CONFIG_INIT;
  pc.name = "w";
  pc.ndim = 2;
  pc.shape[0] = 4;
  pc.shape[1] = 0;
  pc.data = buf;
  assert_status(dopt_optim_add_param(o, 0, &pc, NULL), DOPT_ERR_INVALID_ARG, "shape[1]=0");
  pc.shape[1] = 4;
  pc.dtype = DOPT_F16;
  assert_status(dopt_optim_add_param(o, 0, &pc, NULL), DOPT_ERR_UNSUPPORTED, "F16");
  pc.dtype = DOPT_BF16;
  assert_status(dopt_optim_add_param(o, 0, &pc, NULL), DOPT_ERR_INVALID_ARG, "needs master");
  pc.dtype = DOPT_F32;
  assert_status(dopt_optim_add_param(o, 3, &pc, NULL), DOPT_ERR_INVALID_ARG, "group=3");
  pc.version = 99;
  assert_status(dopt_optim_add_param(o, 0, &pc, NULL), DOPT_ERR_INVALID_ARG, "version=99");
  pc.version = DOPT_PARAM_CONFIG_VERSION;
  assert_ok(dopt_optim_add_param(o, 0, &pc, NULL));
  pc.name = "alias";
  assert_status(dopt_optim_add_param(o, 0, &pc, NULL), DOPT_ERR_INVALID_ARG, "'w'");
  dopt_optim_destroy(o);
}

/* Exact state memory, before and after the first step, per layout. */
static void test_state_bytes(void **st) {
  (void)st;
  struct {
    const char *name, *hp;
    size_t full_2d, full_1d, full_3d; /* [64,48], [100], [2,3,5] */
  } cases[] = {
      {"adamw", NULL, 8 * 64 * 48, 8 * 100, 8 * 30},
      {"adamw", "amsgrad=true", 12 * 64 * 48, 12 * 100, 12 * 30},
      {"adafactor", NULL, 4 * (64 + 48) + 4, 4 * 100 + 4, 4 * (6 + 10) + 4},
      {"adafactor", "beta1=0.9", 4 * 64 * 48 + 4 * (64 + 48) + 4, 8 * 100 + 4, 4 * 30 + 4 * 16 + 4},
      {"came", "lr=1e-4", 4 * 64 * 48 + 8 * (64 + 48) + 4, 8 * 100 + 4, 4 * 30 + 8 * 16 + 4},
      {"lamb", NULL, 8 * 64 * 48, 8 * 100, 8 * 30},
  };
  const int64_t s2[2] = {64, 48}, s1[1] = {100}, s3[3] = {2, 3, 5};
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
    dopt_optim *o;
    assert_ok(dopt_optim_create(cases[c].name, cases[c].hp, &o));
    float *a = make_param(64 * 48, 1), *b = make_param(100, 2), *d = make_param(30, 3);
    float *ga = make_param(64 * 48, 4), *gb = make_param(100, 5), *gd = make_param(30, 6);
    add(o, 0, "a", 2, s2, a);
    add(o, 0, "b", 1, s1, b);
    add(o, 0, "d", 3, s3, d);
    size_t alloc, full;
    assert_ok(dopt_optim_state_bytes(o, -1, &alloc, &full));
    assert_int_equal(alloc, 0);
    assert_int_equal(full, cases[c].full_2d + cases[c].full_1d + cases[c].full_3d);
    const float *g[3] = {ga, NULL, gd};
    assert_ok(dopt_optim_step(o, g));
    assert_ok(dopt_optim_state_bytes(o, 0, &alloc, &full));
    assert_int_equal(alloc, cases[c].full_2d);
    assert_int_equal(full, cases[c].full_2d);
    assert_ok(dopt_optim_state_bytes(o, 1, &alloc, NULL));
    assert_int_equal(alloc, 0); /* grad None: no state yet, as torch */
    assert_ok(dopt_optim_state_bytes(o, -1, &alloc, NULL));
    assert_int_equal(alloc, cases[c].full_2d + cases[c].full_3d);
    (void)gb;
    dopt_optim_destroy(o);
    free(a), free(b), free(d), free(ga), free(gb), free(gd);
  }
}

/* Planning without allocating: the same bytes as a real optimizer's layout. */
static void test_state_bytes_for(void **st) {
  (void)st;
  const int64_t big[2] = {11008, 4096}, v[1] = {4096};
  size_t b;
  assert_ok(dopt_optim_state_bytes_for("adamw", NULL, 2, big, &b));
  assert_int_equal(b, (size_t)8 * 11008 * 4096);
  assert_ok(dopt_optim_state_bytes_for("adafactor", "beta1=0.9", 2, big, &b));
  assert_int_equal(b, (size_t)4 * 11008 * 4096 + 4 * (11008 + 4096) + 4);
  assert_ok(dopt_optim_state_bytes_for("came", "lr=1e-4", 1, v, &b));
  assert_int_equal(b, (size_t)8 * 4096 + 4);
  assert_status(dopt_optim_state_bytes_for("came", NULL, 1, v, &b), DOPT_ERR_INVALID_ARG, "lr=none");
  assert_status(dopt_optim_state_bytes_for("nope", NULL, 1, v, &b), DOPT_ERR_NOT_FOUND, "'nope'");
}

/* Factored statistics of a 3-D parameter: leading dims are batch. */
static void test_factored_shapes(void **st) {
  (void)st;
  const char *opts[] = {"adafactor", "came"};
  for (int k = 0; k < 2; k++) {
    dopt_optim *o;
    assert_ok(dopt_optim_create(opts[k], k ? "lr=1e-4" : NULL, &o));
    const int64_t s3[3] = {2, 3, 5};
    float *p = make_param(30, 9), *g = make_param(30, 10);
    add(o, 0, "t3", 3, s3, p);
    const float *gg[1] = {g};
    assert_ok(dopt_optim_step(o, gg));
    int found = 0;
    for (int s = 0; s < dopt_optim_num_states(o, 0); s++) {
      dopt_state_view v;
      assert_ok(dopt_optim_state(o, 0, s, &v));
      if (strstr(v.name, "_row")) {
        assert_int_equal(v.ndim, 2);
        assert_int_equal(v.shape[0], 2);
        assert_int_equal(v.shape[1], 3);
        found++;
      } else if (strstr(v.name, "_col")) {
        assert_int_equal(v.ndim, 2);
        assert_int_equal(v.shape[0], 2);
        assert_int_equal(v.shape[1], 5);
        found++;
      }
    }
    assert_int_equal(found, k ? 4 : 2);
    dopt_optim_destroy(o);
    free(p), free(g);
  }
}

/* Groups: a no-decay group equals a separate optimizer built with wd=0, bit
 * for bit; grad None leaves parameter, state and step untouched. */
static void test_groups_and_skip(void **st) {
  (void)st;
  const int64_t s[2] = {9, 7};
  for (int k = 0; k < dopt_optim_registry_count(); k++) {
    const char *name = dopt_optim_registry_name(k);
    int came = strcmp(name, "came") == 0;
    dopt_optim *o, *ref;
    assert_ok(dopt_optim_create(name, came ? "lr=1e-3,weight_decay=0.1" : "weight_decay=0.1", &o));
    assert_ok(dopt_optim_create(name, came ? "lr=1e-3,weight_decay=0" : "weight_decay=0", &ref));
    int g;
    assert_ok(dopt_optim_add_group(o, "weight_decay=0", &g));
    assert_int_equal(g, 1);
    float *a = make_param(63, 11), *b = make_param(63, 12), *r = make_param(63, 12);
    float *b0 = make_param(63, 12);
    add(o, 0, "decayed", 2, s, a);
    add(o, 1, "bias", 2, s, b);
    add(ref, 0, "bias", 2, s, r);
    float *ga = make_param(63, 13), *gb = make_param(63, 14);
    for (int t = 0; t < 5; t++) {
      const float *g2[2] = {ga, t == 2 ? NULL : gb};
      const float *g1[1] = {gb};
      assert_ok(dopt_optim_step(o, g2));
      if (t != 2) assert_ok(dopt_optim_step(ref, g1));
      if (t == 0) {
        int64_t step;
        assert_ok(dopt_optim_get_step(o, 1, &step));
        assert_int_equal(step, 1);
      }
    }
    int64_t sa, sb;
    assert_ok(dopt_optim_get_step(o, 0, &sa));
    assert_ok(dopt_optim_get_step(o, 1, &sb));
    assert_int_equal(sa, 5);
    assert_int_equal(sb, 4);
    if (memcmp(b, r, 63 * sizeof(float)) != 0) fail_msg("%s: no-decay group differs from a wd=0 optimizer", name);
    assert_true(memcmp(b, b0, 63 * sizeof(float)) != 0);
    dopt_optim_destroy(o);
    dopt_optim_destroy(ref);
    free(a), free(b), free(r), free(b0), free(ga), free(gb);
  }
}

/* Zero weights and zero gradients never produce NaN/Inf; the run is
 * bitwise reproducible. */
static void test_zero_edges_and_determinism(void **st) {
  (void)st;
  const int64_t s[2] = {5, 8};
  for (int k = 0; k < dopt_optim_registry_count(); k++) {
    const char *name = dopt_optim_registry_name(k);
    float out[2][40];
    for (int run = 0; run < 2; run++) {
      dopt_optim *o;
      assert_ok(dopt_optim_create(name, strcmp(name, "came") == 0 ? "lr=1e-3" : NULL, &o));
      float p[40] = {0}, z[40] = {0};
      float *g = make_param(40, 77);
      add(o, 0, "zeros", 2, s, p);
      for (int t = 0; t < 6; t++) {
        const float *gg[1] = {t % 2 ? z : g};
        assert_ok(dopt_optim_step(o, gg));
      }
      for (int i = 0; i < 40; i++)
        if (!isfinite(p[i])) fail_msg("%s: non-finite parameter %d after zero weights/gradients", name, i);
      for (int sidx = 0; sidx < dopt_optim_num_states(o, 0); sidx++) {
        dopt_state_view v;
        assert_ok(dopt_optim_state(o, 0, sidx, &v));
        const float *d = v.data;
        for (size_t i = 0; i < v.bytes / 4; i++)
          if (!isfinite(d[i])) fail_msg("%s: state %s non-finite", name, v.name);
      }
      memcpy(out[run], p, sizeof p);
      dopt_optim_destroy(o);
      free(g);
    }
    assert_memory_equal(out[0], out[1], sizeof out[0]);
  }
}

static void test_set_hparam(void **st) {
  (void)st;
  dopt_optim *o;
  assert_ok(dopt_optim_create("adafactor", "relative_step=false,lr=0.01", &o));
  const int64_t s[2] = {3, 4};
  float *p = make_param(12, 1), *g = make_param(12, 2);
  add(o, 0, "w", 2, s, p);
  const float *gg[1] = {g};
  assert_ok(dopt_optim_step(o, gg));
  assert_ok(dopt_optim_set_hparam(o, 0, "lr", 0.005));
  assert_status(dopt_optim_set_hparam(o, 0, "lr", NAN), DOPT_ERR_INVALID_ARG, "lr");
  assert_status(dopt_optim_set_hparam(o, 0, "beta1", 0.9), DOPT_ERR_STATE, "beta1");
  assert_status(dopt_optim_set_hparam(o, 0, "decay_rate", 1.0), DOPT_ERR_INVALID_ARG, "decay_rate=1");
  assert_status(dopt_optim_set_hparam(o, 5, "lr", 1.0), DOPT_ERR_INVALID_ARG, "group=5");
  double v;
  assert_ok(dopt_optim_get_hparam(o, 0, "lr", &v));
  assert_true(v == 0.005);
  assert_ok(dopt_optim_get_hparam(o, 0, "beta1", &v));
  assert_true(isnan(v));
  dopt_optim_destroy(o);
  free(p), free(g);
}

/* Mixed precision: a bf16 working parameter with fp32 master weights; the
 * optimizer steps the master exactly as an fp32 parameter and the working
 * copy is the master rounded to bf16 (nearest even). */
static void test_bf16_master(void **st) {
  (void)st;
  const int64_t s[2] = {6, 10};
  for (int k = 0; k < dopt_optim_registry_count(); k++) {
    const char *name = dopt_optim_registry_name(k);
    const char *hp = strcmp(name, "came") == 0 ? "lr=1e-3" : NULL;
    dopt_optim *mp, *fp;
    assert_ok(dopt_optim_create(name, hp, &mp));
    assert_ok(dopt_optim_create(name, hp, &fp));
    float *master = make_param(60, 3), *ref = make_param(60, 3), *g = make_param(60, 4);
    uint16_t work[60];
    for (int i = 0; i < 60; i++) work[i] = dopt_f32_to_bf16(master[i]);
    dopt_param_config pc = DOPT_PARAM_CONFIG_INIT;
    pc.name = "w";
    pc.ndim = 2;
    pc.shape[0] = s[0];
    pc.shape[1] = s[1];
    pc.dtype = DOPT_BF16;
    pc.data = work;
    pc.master = master;
    assert_ok(dopt_optim_add_param(mp, 0, &pc, NULL));
    add(fp, 0, "w", 2, s, ref);
    const float *gg[1] = {g};
    for (int t = 0; t < 4; t++) {
      assert_ok(dopt_optim_step(mp, gg));
      assert_ok(dopt_optim_step(fp, gg));
    }
    assert_memory_equal(master, ref, 60 * sizeof(float));
    for (int i = 0; i < 60; i++) {
      uint16_t want = dopt_f32_to_bf16(master[i]);
      if (work[i] != want) fail_msg("%s: work[%d]=%04x want %04x", name, i, work[i], want);
    }
    dopt_optim_destroy(mp);
    dopt_optim_destroy(fp);
    free(master), free(ref), free(g);
  }
  /* rounding: nearest even, NaN stays NaN */
  assert_int_equal(dopt_f32_to_bf16(1.0f), 0x3f80);
  assert_int_equal(dopt_f32_to_bf16(1.00390625f), 0x3f80);  /* tie -> even */
  assert_int_equal(dopt_f32_to_bf16(1.01171875f), 0x3f82);  /* tie -> even (up) */
  assert_true(dopt_bf16_to_f32(dopt_f32_to_bf16(NAN)) != dopt_bf16_to_f32(dopt_f32_to_bf16(NAN)));
}

/* A piece's runs and blocks (core/shape.c) against a brute force over every local element: the runs cover the
 * piece in order, each logically contiguous, maximal (the logical neighbours of a run are not in the piece),
 * and the blocks are exactly the set of element / block, for random TP blocks (rows, columns or both cut),
 * ZeRO ranges, batch dims and block sizes. */
static void test_piece_runs_and_blocks(void **st) {
  (void)st;
  uint64_t rng = 5;
  int cases = 0;
  for (int it = 0; it < 3000; it++) {
    dopt_piece pc;
    memset(&pc, 0, sizeof pc);
    pc.b = 1 + dt_rand_u64(&rng) % 3, pc.h = 1 + dt_rand_u64(&rng) % 9, pc.w = 1 + dt_rand_u64(&rng) % 13;
    pc.numel = pc.b * pc.h * pc.w;
    pc.factored = 1;
    const int cut = (int)(dt_rand_u64(&rng) % 4); /* 0 none, 1 rows, 2 columns, 3 both */
    pc.hl = pc.h, pc.wl = pc.w;
    if (cut & 1) pc.hl = dt_rand_u64(&rng) % (pc.h + 1), pc.h0 = dt_rand_u64(&rng) % (pc.h - pc.hl + 1);
    if (cut & 2) pc.wl = dt_rand_u64(&rng) % (pc.w + 1), pc.w0 = dt_rand_u64(&rng) % (pc.w - pc.wl + 1);
    const size_t ln = pc.b * pc.hl * pc.wl;
    pc.lo = dt_rand_u64(&rng) % (ln + 1);
    pc.len = dt_rand_u64(&rng) % (ln - pc.lo + 1);
    const size_t B = 1 + dt_rand_u64(&rng) % 17;
    unsigned char in[3 * 9 * 13] = {0}, blk[3 * 9 * 13] = {0};
    for (size_t j = 0; j < pc.len; j++) in[dopt_grid_logical(&pc, pc.lo + j)] = 1;
    size_t off = 0, next = 0;
    dopt_run r;
    while (dopt_piece_next_run(&pc, &off, &r)) {
      assert_int_equal(r.off, next);
      assert_true(r.len > 0);
      for (size_t k = 0; k < r.len; k++) assert_int_equal(dopt_grid_logical(&pc, pc.lo + r.off + k), r.at + k);
      if (r.at > 0) assert_false(in[r.at - 1]);                  /* maximal at its start */
      if (r.at + r.len < pc.numel) assert_false(in[r.at + r.len]); /* and at its end */
      next = r.off + r.len;
    }
    assert_int_equal(next, pc.len);
    size_t want = 0, got[3 * 9 * 13];
    for (size_t L = 0; L < pc.numel; L++)
      if (in[L] && !blk[L / B]) blk[L / B] = 1, want++;
    assert_int_equal(dopt_piece_blocks(&pc, B, NULL), want);
    assert_int_equal(dopt_piece_blocks(&pc, B, got), want);
    for (size_t k = 0, q = 0; k < (pc.numel + B - 1) / B; k++)
      if (blk[k]) assert_int_equal(got[q++], k);
    cases++;
  }
  printf("piece runs and blocks: %d random pieces against the brute force\n", cases);
}

/* Owners by cost and state bytes (dopt__assign_owners): the largest cost first, each where the larger of its
 * two shares stays smallest. One step 10× the others goes alone while the rest fill the other rank; equal items
 * spread evenly; at equal costs the state bytes decide; the answer depends on the inputs only. */
static void test_assign_owners(void **st) {
  (void)st;
  const double cost[7] = {1, 1, 10, 1, 1, 1, 1}, bytes[7] = {1, 1, 10, 1, 1, 1, 1}; /* states grow with the work */
  int own[7], again[7];
  assert_int_equal(dopt__assign_owners(7, cost, bytes, 2, own), 0);
  for (int k = 0; k < 7; k++)
    if (k != 2) assert_int_not_equal(own[k], own[2]); /* the heavy step alone */
  assert_int_equal(dopt__assign_owners(7, cost, bytes, 2, again), 0);
  assert_memory_equal(own, again, sizeof own);
  /* 8 equal items on 4 ranks: 2 each */
  const double one[8] = {1, 1, 1, 1, 1, 1, 1, 1};
  int o8[8], per[4] = {0};
  assert_int_equal(dopt__assign_owners(8, one, one, 4, o8), 0);
  for (int k = 0; k < 8; k++) per[o8[k]]++;
  for (int r = 0; r < 4; r++) assert_int_equal(per[r], 2);
  /* equal costs: the state bytes decide (two big states never share a rank of two) */
  const double c4[4] = {1, 1, 1, 1}, b4[4] = {100, 1, 100, 1};
  int o4[4];
  assert_int_equal(dopt__assign_owners(4, c4, b4, 2, o4), 0);
  assert_int_not_equal(o4[0], o4[2]);
  assert_int_equal(dopt__assign_owners(0, NULL, NULL, 3, o4), 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_registry),
      cmocka_unit_test(test_piece_runs_and_blocks),
      cmocka_unit_test(test_assign_owners),
      cmocka_unit_test(test_hparam_parsing),
      cmocka_unit_test(test_adafactor_validation),
      cmocka_unit_test(test_add_param_errors),
      cmocka_unit_test(test_state_bytes),
      cmocka_unit_test(test_factored_shapes),
      cmocka_unit_test(test_state_bytes_for),
      cmocka_unit_test(test_groups_and_skip),
      cmocka_unit_test(test_zero_edges_and_determinism),
      cmocka_unit_test(test_set_hparam),
      cmocka_unit_test(test_bf16_master),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
