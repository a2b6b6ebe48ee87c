/* Each CUDA kernel against the CPU device, bitwise (label gpu; skipped
 * without a CUDA device): the vector kernels, the exact sum of squares, and
 * several steps of adamw, adafactor, came and lamb on whole tensors and on
 * pieces (TP blocks and ZeRO ranges, no reducer: the partial statistics of a
 * piece are themselves defined exactly); every other optimizer's step
 * through the host (core/hoststep.c) likewise. */
#include <math.h>
#include <string.h>

#include "gpucommon.h"
#include "registry.h"
#include "testutil.h"

static dopt_device *G;
static const dopt_device *C;

static void *up(const void *host, size_t bytes) {
  void *d;
  assert_int_equal(G->ops->alloc(G->ctx, bytes, &d), DOPT_OK);
  assert_int_equal(G->ops->upload(G->ctx, d, host, bytes), DOPT_OK);
  return d;
}
static void down_eq(const void *dev, const void *host, size_t bytes, const char *what) {
  unsigned char *h = malloc(bytes ? bytes : 1);
  assert_int_equal(G->ops->download(G->ctx, h, dev, bytes), DOPT_OK);
  if (memcmp(h, host, bytes) != 0) fail_msg("%s: GPU and CPU differ", what);
  free(h);
}

static void fill(float *x, size_t n, uint64_t seed, int specials) {
  uint64_t s = seed;
  for (size_t i = 0; i < n; i++) x[i] = (float)(dt_rand_normal(&s) * (i % 7 == 3 ? 30.0 : 0.02));
  if (specials && n > 10) {
    x[1] = 0.0f;
    x[2] = -0.0f;
    x[5] = 1e-40f; /* subnormal */
  }
}

static void test_vector_kernels(void **st) {
  (void)st;
  const size_t n = 100003;
  float *a = malloc(n * 4), *b = malloc(n * 4);
  uint16_t *h16 = malloc(n * 2);
  fill(a, n, 1, 1);
  fill(b, n, 2, 1);
  float *da = up(a, n * 4), *db = up(b, n * 4);
  C->ops->add(NULL, a, b, n);
  assert_int_equal(G->ops->add(G->ctx, da, db, n), DOPT_OK);
  down_eq(da, a, n * 4, "add");
  C->ops->scale(NULL, a, 0.37f, n);
  assert_int_equal(G->ops->scale(G->ctx, da, 0.37f, n), DOPT_OK);
  down_eq(da, a, n * 4, "scale");
  a[17] = INFINITY;
  a[99] = NAN;
  assert_int_equal(G->ops->upload(G->ctx, da, a, n * 4), DOPT_OK);
  int64_t bc, bg;
  C->ops->average(NULL, a, 6.0f, n, &bc);
  assert_int_equal(G->ops->average(G->ctx, da, 6.0f, n, &bg), DOPT_OK);
  assert_int_equal(bc, 2);
  assert_int_equal(bg, bc);
  a[99] = 1.5f; /* NaN payloads may differ (canonical NaN on the GPU) */
  assert_int_equal(G->ops->upload(G->ctx, da, a, n * 4), DOPT_OK);
  C->ops->to_bf16(NULL, a, h16, n);
  uint16_t *d16;
  assert_int_equal(G->ops->alloc(G->ctx, n * 2, (void **)&d16), DOPT_OK);
  assert_int_equal(G->ops->to_bf16(G->ctx, da, d16, n), DOPT_OK);
  down_eq(d16, h16, n * 2, "to_bf16");
  double sc, sg;
  a[17] = 3.0f;
  assert_int_equal(G->ops->upload(G->ctx, da, a, n * 4), DOPT_OK);
  for (size_t m = 0; m <= n; m = m ? m * 3 : 1) {
    C->ops->sumsq(NULL, a, m, &sc);
    assert_int_equal(G->ops->sumsq(G->ctx, da, m, &sg), DOPT_OK);
    if (memcmp(&sc, &sg, 8) != 0) fail_msg("sumsq(n=%zu): %.17g vs %.17g", m, sc, sg);
  }
  G->ops->free(G->ctx, da);
  G->ops->free(G->ctx, db);
  G->ops->free(G->ctx, d16);
  free(a);
  free(b);
  free(h16);
}

/* several steps of one optimizer on one piece, CPU vs GPU */
static void run_piece(const char *name, const char *hps, int ndim, const int64_t *shape, const dopt_piece *pc) {
  const dopt_optim_impl *im = dopt_find_impl(name);
  assert_non_null(im);
  double hp[DOPT_MAX_HPARAMS];
  dopt_optim *o; /* "k=v,..." parsed as the library does */
  assert_int_equal(dopt_optim_create(name, hps ? hps : "", &o), DOPT_OK);
  for (int k = 0; k < im->nhp; k++) assert_int_equal(dopt_optim_get_hparam(o, 0, im->hp[k].key, &hp[k]), DOPT_OK);
  dopt_optim_destroy(o);
  dopt_state_spec spec[DOPT_MAX_STATES];
  int ns = im->layout(hp, ndim, shape, spec);
  size_t n = pc->len;
  dopt_step_args fa = {.impl = im, .hp = hp, .step = 1, .piece = pc};
  size_t cfb = C->ops->frame_bytes(NULL, &fa), gfb = G->ops->frame_bytes(G->ctx, &fa);
  float *w = malloc((n ? n : 1) * 4), *g = malloc((n ? n : 1) * 4);
  void *ws = calloc(cfb ? cfb : 1, 1), *zeros = calloc(gfb ? gfb : 1, 1);
  fill(w, n, 11, 0);
  void *cs[DOPT_MAX_STATES], *gs[DOPT_MAX_STATES];
  size_t sb[DOPT_MAX_STATES];
  for (int k = 0; k < ns; k++) {
    const size_t es = dopt_dtype_size(spec[k].v.dtype);
    sb[k] = spec[k].kind == DOPT_STATE_ELEMENTWISE ? n * es
            : spec[k].kind == DOPT_STATE_BLOCKWISE ? dopt_piece_blocks(pc, spec[k].block, NULL) * es
                                                    : spec[k].v.bytes;
    cs[k] = calloc(sb[k] ? sb[k] : 1, 1);
    gs[k] = up(cs[k], sb[k]);
  }
  float *dw = up(w, n * 4), *dg = up(w, n * 4);
  void *dws = up(zeros, gfb ? gfb : 1);
  free(zeros);
  for (int t = 1; t <= 4; t++) {
    fill(g, n, 100 + (uint64_t)t, 1);
    assert_int_equal(G->ops->upload(G->ctx, dg, g, n * 4), DOPT_OK);
    dopt_step_args ca = {.impl = im, .hp = hp, .step = t, .piece = pc, .param = w, .grad = g, .state = cs, .frame = ws};
    dopt_step_args ga = {.impl = im, .hp = hp, .step = t, .piece = pc, .param = dw, .grad = dg, .state = gs,
                         .frame = dws};
    assert_int_equal(dopt__run_stages(C, &ca), DOPT_OK);
    assert_int_equal(dopt__run_stages(G, &ga), DOPT_OK);
    char what[160];
    snprintf(what, sizeof what, "%s step %d param (piece lo=%zu len=%zu)", name, t, pc->lo, pc->len);
    down_eq(dw, w, n * 4, what);
    for (int k = 0; k < ns; k++) {
      snprintf(what, sizeof what, "%s step %d state %s", name, t, spec[k].v.name);
      down_eq(gs[k], cs[k], sb[k], what);
    }
  }
  for (int k = 0; k < ns; k++) {
    free(cs[k]);
    G->ops->free(G->ctx, gs[k]);
  }
  G->ops->free(G->ctx, dw);
  G->ops->free(G->ctx, dg);
  G->ops->free(G->ctx, dws);
  free(w);
  free(g);
  free(ws);
}

static void test_steps(void **st) {
  (void)st;
  static const struct {
    const char *name, *hp;
  } opts[] = {{"adamw", NULL}, {"adamw", "amsgrad=1"}, {"adafactor", NULL}, {"adafactor", "beta1=0.9"},
              {"came", "lr=2e-4"}, {"lamb", "weight_decay=0.01"}};
  static const int64_t s2[] = {67, 129}, s3[] = {3, 17, 33}, s1[] = {1000}, s2b[] = {4096, 3};
  for (size_t o = 0; o < sizeof opts / sizeof opts[0]; o++) {
    dopt_piece pc;
    dopt_piece_full(2, s2, &pc);
    run_piece(opts[o].name, opts[o].hp, 2, s2, &pc);
    /* a TP block (rows 10..40, cols 5..105) and a ZeRO range of it */
    pc.h0 = 10, pc.hl = 30, pc.w0 = 5, pc.wl = 100, pc.lo = 37, pc.len = 30 * 100 - 37 - 250;
    run_piece(opts[o].name, opts[o].hp, 2, s2, &pc);
    dopt_piece_full(3, s3, &pc);
    run_piece(opts[o].name, opts[o].hp, 3, s3, &pc);
    pc.lo = 100, pc.len = 600;
    run_piece(opts[o].name, opts[o].hp, 3, s3, &pc);
    dopt_piece_full(1, s1, &pc);
    run_piece(opts[o].name, opts[o].hp, 1, s1, &pc);
    dopt_piece_full(2, s2b, &pc);
    run_piece(opts[o].name, opts[o].hp, 2, s2b, &pc);
  }
}

/* Every optimizer without a kernel steps through its CPU step on host copies (core/hoststep.c): bitwise the
 * CPU device by construction, here on the device's real copies (whole tensors, a ZeRO range, a 1-D tensor). */
static void test_host_steps(void **st) {
  (void)st;
  static const int64_t s2[] = {67, 129}, s1[] = {1000};
  int ran = 0;
  for (int i = 0; i < dopt_optim_registry_count(); i++) {
    dopt_optim_info in;
    assert_int_equal(dopt_optim_registry_info(i, &in), DOPT_OK);
    const dopt_optim_impl *im = dopt_find_impl(in.name);
    if (!im->step || !strcmp(in.name, "adamw") || !strcmp(in.name, "adafactor") || !strcmp(in.name, "came") ||
        !strcmp(in.name, "lamb"))
      continue; /* a wrapper (LISA steps its inner), or a kernel (test_steps) */
    dopt_piece pc;
    dopt_piece_full(2, s2, &pc);
    run_piece(in.name, in.grid[0], 2, s2, &pc);
    if (in.distributable && !in.wrapper) { /* piecewise: a ZeRO range too */
      pc.lo = 300, pc.len = 67 * 129 - 300 - 1000;
      run_piece(in.name, in.grid[0], 2, s2, &pc);
    }
    dopt_piece_full(1, s1, &pc);
    run_piece(in.name, in.grid[0], 1, s1, &pc);
    ran++;
  }
  assert_true(ran >= 5);
}

int main(void) {
  gpu_or_skip("gpu_cuda_kernels");
  C = dopt_device_cpu();
  if (dopt_device_cuda(0, &G) != DOPT_OK) {
    fprintf(stderr, "dopt_device_cuda: %s\n", dopt_last_error());
    return 1;
  }
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_vector_kernels),
      cmocka_unit_test(test_steps),
      cmocka_unit_test(test_host_steps),
  };
  int rc = cmocka_run_group_tests(tests, NULL, NULL);
  dopt_device_cuda_destroy(G);
  return rc;
}
