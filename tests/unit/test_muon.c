/* Muon (ref/muon.c, ref/ns.c; docs/muon.md) beyond its golden cases: torch.optim.Muon's adjust_lr_fn rules
 * against a transcription of their documented formulas, the iteration's kernel against a plain loop and
 * against orthogonality, the per-kind defaults and the groups (use_muon), the one-line refusals. */
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "distopt/distopt.h"
#include "ns.h"
#include "optim_impl.h"

static float *filled(size_t n, uint64_t seed, double scale) {
  float *x = malloc(n * sizeof *x);
  for (size_t i = 0; i < n; i++) x[i] = (float)(dt_rand_normal(&seed) * scale);
  return x;
}

/* One step of `hp` on a fresh [h, w] parameter (weights w0, gradient g): the new weights. */
static void one_step(const char *hp, size_t h, size_t w, const float *w0, const float *g, float *out) {
  dopt_optim *o = NULL;
  assert_ok(dopt_optim_create("muon", hp, &o));
  memcpy(out, w0, h * w * sizeof *out);
  dopt_param_config pc = DOPT_PARAM_CONFIG_INIT;
  pc.name = "w", pc.ndim = 2, pc.shape[0] = (int64_t)h, pc.shape[1] = (int64_t)w, pc.data = out;
  assert_ok(dopt_optim_add_param(o, 0, &pc, NULL));
  const float *gp[1] = {g};
  assert_ok(dopt_optim_step(o, gp));
  dopt_optim_destroy(o);
}

/* torch.optim.Muon's documented rules, transcribed. The update is the Newton-Schulz of the Nesterov blend,
 * unscaled; the lr is adjusted: original lr·sqrt(max(1, A/B)), match_rms_adamw lr·0.2·sqrt(max(A, B)),
 * spectral_unclamped lr·sqrt(A/B), A, B the parameter's first two dims; p ← p·(1 − lr·wd) + (−lr')·update.
 * flavor=torch alone: its None (original), its lr default 1e-3 and its addmm-form iteration (ns.h). After one
 * step from zero momentum: M = 0.05·G, U = lerp(G, M, 0.95). */
static void test_adjust_lr_fn(void **st) {
  (void)st;
  const size_t shapes[][2] = {{24, 40}, {40, 24}};
  static const char *const rules[] = {"adjust_lr_fn=original", "adjust_lr_fn=match_rms_adamw",
                                      "adjust_lr_fn=spectral_unclamped", "flavor=torch"};
  for (size_t s = 0; s < 2; s++)
    for (int rule = 0; rule < 4; rule++) {
      const size_t h = shapes[s][0], w = shapes[s][1], n = h * w;
      float *w0 = filled(n, 3 + s, 0.5), *g = filled(n, 5 + s, 1.0), *got = malloc(n * sizeof *got);
      const double lr = rule == 3 ? 1e-3 : 0.02, wd = 0.1;
      char hp[128];
      if (rule == 3) snprintf(hp, sizeof hp, "weight_decay=%g,%s", wd, rules[rule]); /* lr: the flavour's default */
      else snprintf(hp, sizeof hp, "lr=%g,weight_decay=%g,%s", lr, wd, rules[rule]);
      one_step(hp, h, w, w0, g, got);
      /* the transcription */
      float *u = malloc(n * sizeof *u);
      const float wm = (float)(1.0 - 0.95), beta = 0.95f;
      for (size_t i = 0; i < n; i++) {
        const float m = fmaf(wm, g[i] - 0.0f, 0.0f);
        u[i] = fmaf(beta - 1.0f, m - g[i], m); /* lerp(G, M, 0.95): w >= 0.5 */
      }
      dopt_ns_spec ns = DOPT_NS_SPEC(5, 1);
      if (rule == 3) ns.form = DOPT_NS_ADDMM;
      assert_ok(dopt_ns_orthogonalize(u, h, w, &ns, NULL));
      const double A = (double)h, B = (double)w;
      const double adj = rule == 1   ? lr * 0.2 * sqrt(A > B ? A : B)
                         : rule == 2 ? lr * sqrt(A / B)
                                     : lr * sqrt(A / B > 1 ? A / B : 1);
      size_t bad = 0;
      for (size_t i = 0; i < n; i++) {
        const float want = fmaf((float)(-adj), u[i], w0[i] * (float)(1.0 - lr * wd));
        bad += memcmp(&want, &got[i], sizeof want) != 0;
      }
      if (bad) fail_msg("[%zu, %zu] %s: %zu of %zu weights differ from the transcription", h, w, hp, bad, n);
      free(w0), free(g), free(got), free(u);
    }
}

/* dopt_gemm_nn: each element the k-order fmaf chain (a plain loop), K across two slabs, edge tiles; the bf16 iteration's
 * output is close to orthogonal (upstream's iteration leaves the singular values in about [0.5, 1.5]). */
static void test_kernel(void **st) {
  (void)st;
  const size_t M = 70, N = 90, K = 300; /* edge rows (70 = 11·6 + 4) and columns (90 = 5·16 + 10), two k slabs */
  float *A = filled(M * K, 7, 1.0), *B = filled(K * N, 8, 1.0), *C = malloc(M * N * sizeof *C);
  assert_ok(dopt_gemm_nn(M, N, K, A, B, C, NULL));
  for (size_t i = 0; i < M; i++)
    for (size_t j = 0; j < N; j++) {
      float acc = 0.0f;
      for (size_t k = 0; k < K; k++) acc = fmaf(A[i * K + k], B[k * N + j], acc);
      if (memcmp(&acc, &C[i * N + j], sizeof acc)) fail_msg("C[%zu][%zu] = %a, the k-order chain %a", i, j, (double)C[i * N + j], (double)acc);
    }
  /* the hints change no bit: bf16 operands (two k per vdpbf16ps where the CPU has it), a symmetric product
   * (X·Xᵀ: the tiles below the diagonal mirrored), odd K (the last pair padded with +0), two slabs of pairs, edge
   * tiles; an operand below 2^-50 (its products could be subnormal, which the instruction flushes) takes the
   * fmaf kernel: every case equals the plain chain bit for bit */
  for (int tiny = 0; tiny < 2; tiny++) {
    const size_t m = 70, kk = 301, nn = 90;
    float *a = filled(m * kk, 11, 1.0), *b = filled(kk * nn, 12, 1.0), *c = malloc(m * nn * sizeof *c);
    float *at = malloc(kk * m * sizeof *at), *cs = malloc(m * m * sizeof *cs);
    for (size_t i = 0; i < m * kk; i++) a[i] = dopt_round_bf16(a[i]);
    for (size_t i = 0; i < kk * nn; i++) b[i] = dopt_round_bf16(b[i]);
    if (tiny) a[5] = 0x1p-60f;
    for (size_t i = 0; i < m; i++)
      for (size_t k = 0; k < kk; k++) at[k * m + i] = a[i * kk + k];
    assert_ok(dopt_gemm_ex(m, nn, kk, a, b, c, DOPT_GEMM_BF16, NULL));
    assert_ok(dopt_gemm_ex(m, m, kk, a, at, cs, DOPT_GEMM_BF16 | DOPT_GEMM_SYM, NULL));
    float *ca = malloc(m * m * sizeof *ca), *cf = malloc(m * m * sizeof *cf); /* A·Aᵀ without Aᵀ: both kernels */
    assert_ok(dopt_gemm_ex(m, m, kk, a, NULL, ca, DOPT_GEMM_BF16 | DOPT_GEMM_AAT, NULL));
    assert_ok(dopt_gemm_ex(m, m, kk, a, NULL, cf, DOPT_GEMM_AAT, NULL));
    assert_memory_equal(ca, cs, m * m * sizeof *ca);
    assert_memory_equal(cf, cs, m * m * sizeof *cf);
    free(ca), free(cf);
    size_t bad = 0, bads = 0;
    for (size_t i = 0; i < m; i++) {
      for (size_t j = 0; j < nn; j++) {
        float acc = 0.0f;
        for (size_t k = 0; k < kk; k++) acc = fmaf(a[i * kk + k], b[k * nn + j], acc);
        bad += memcmp(&acc, &c[i * nn + j], sizeof acc) != 0;
      }
      for (size_t j = 0; j < m; j++) {
        float acc = 0.0f;
        for (size_t k = 0; k < kk; k++) acc = fmaf(a[i * kk + k], at[k * m + j], acc);
        bads += memcmp(&acc, &cs[i * m + j], sizeof acc) != 0;
      }
    }
    printf("dopt_gemm_ex, bf16 operands%s: %s; %zu and %zu of %zu and %zu elements differ from the chain\n",
           tiny ? " with one below 2^-50" : "",
           dopt_gemm_pairs() && !tiny ? "two k per vdpbf16ps" : "the fmaf kernel", bad, bads, m * nn, m * m);
    assert_int_equal(bad, 0);
    assert_int_equal(bads, 0);
    free(a), free(b), free(c), free(at), free(cs);
  }
  const size_t h = 32, w = 64;
  float *x = filled(h * w, 9, 1.0), *xxt = malloc(h * h * sizeof *xxt), *xt = malloc(w * h * sizeof *xt);
  assert_ok(dopt_ns_orthogonalize(x, h, w, &DOPT_NS_SPEC(5, 1), NULL));
  for (size_t i = 0; i < h * w; i++) assert_true(x[i] == dopt_round_bf16(x[i])); /* bf16 values */
  for (size_t i = 0; i < h; i++)
    for (size_t j = 0; j < w; j++) xt[j * h + i] = x[i * w + j];
  assert_ok(dopt_gemm_nn(h, h, w, x, xt, xxt, NULL));
  for (size_t i = 0; i < h; i++) { /* X·Xᵀ: diagonal (the squared singular values) in [0.25, 2.25], off-diagonal small */
    assert_true(xxt[i * h + i] > 0.25f && xxt[i * h + i] < 2.25f);
    for (size_t j = 0; j < h; j++)
      if (j != i) assert_true(fabsf(xxt[i * h + j]) < 0.5f);
  }
  free(A), free(B), free(C), free(x), free(xxt), free(xt);
}

/* dopt_gemm_ex on small shapes, every hint: M, N, K from 1 to 40 (K odd and even, one pair or many, N below one
 * panel and across two, M below one row block), bf16 operands with exact zeros among them, 2 threads' split
 * through a pool stand-in; each equal to the plain chain, bit for bit. */
static void run_inline(void *ctx, size_t n, void (*task)(void *arg, size_t i), void *arg) {
  (void)ctx;
  for (size_t i = n; i-- > 0;) task(arg, i); /* the parts in reverse order: no bit may depend on it */
}

static void test_gemm_small_shapes(void **st) {
  (void)st;
  uint64_t seed = 99;
  const dopt_par par = {NULL, 2, run_inline};
  for (int trial = 0; trial < 60; trial++) {
    const size_t M = 1 + dt_rand_u64(&seed) % 40, K = 1 + dt_rand_u64(&seed) % 40;
    const size_t N = trial % 2 ? M : 1 + dt_rand_u64(&seed) % 40;
    float *a = filled(M * K, 1000 + (uint64_t)trial, 1.0), *b = malloc(K * N * sizeof *b);
    float *c = malloc(M * N * sizeof *c), *want = malloc(M * N * sizeof *want);
    for (size_t i = 0; i < M * K; i++) a[i] = i % 7 == 3 ? 0.0f : dopt_round_bf16(a[i]);
    /* N == M: B = Aᵀ (a symmetric product); else B random */
    float *br = filled(K * N, 2000 + (uint64_t)trial, 1.0);
    for (size_t k = 0; k < K; k++)
      for (size_t j = 0; j < N; j++) b[k * N + j] = N == M && trial % 2 ? a[j * K + k] : dopt_round_bf16(br[k * N + j]);
    for (size_t i = 0; i < M; i++)
      for (size_t j = 0; j < N; j++) {
        float acc = 0.0f;
        for (size_t k = 0; k < K; k++) acc = fmaf(a[i * K + k], b[k * N + j], acc);
        want[i * N + j] = acc;
      }
    const unsigned flags[] = {0u, DOPT_GEMM_BF16, DOPT_GEMM_SYM, DOPT_GEMM_BF16 | DOPT_GEMM_SYM, DOPT_GEMM_AAT,
                              DOPT_GEMM_BF16 | DOPT_GEMM_AAT};
    for (size_t f = 0; f < sizeof flags / sizeof flags[0]; f++) {
      if ((flags[f] & (DOPT_GEMM_SYM | DOPT_GEMM_AAT)) && !(N == M && trial % 2)) continue;
      for (int threads = 0; threads < 2; threads++) {
        memset(c, 0xff, M * N * sizeof *c);
        assert_ok(dopt_gemm_ex(M, N, K, a, flags[f] & DOPT_GEMM_AAT ? NULL : b, c, flags[f], threads ? &par : NULL));
        if (memcmp(c, want, M * N * sizeof *c))
          fail_msg("[%zu, %zu] x [%zu, %zu], flags %u, %s: differs from the chain", M, K, K, N, flags[f],
                   threads ? "2 parts" : "1 part");
      }
    }
    free(a), free(b), free(br), free(c), free(want);
  }
}

/* use_muon: auto (Muon for matrices, aux Adam for the rest: states by kind), true (a 1-D parameter refused in
 * one line), false (aux Adam for a matrix); the per-kind lr defaults (0.02 / 3e-4) are the step's */
static void test_groups_and_refusals(void **st) {
  (void)st;
  float w[12], b[4], g12[12], g4[4];
  for (int i = 0; i < 12; i++) w[i] = 0.1f * (float)i, g12[i] = 0.3f - 0.05f * (float)i;
  for (int i = 0; i < 4; i++) b[i] = 1.0f, g4[i] = 0.5f;
  dopt_optim *o = NULL;
  assert_ok(dopt_optim_create("muon", NULL, &o));
  int gaux;
  assert_ok(dopt_optim_add_group(o, "use_muon=false", &gaux));
  dopt_param_config pw = DOPT_PARAM_CONFIG_INIT, pb = DOPT_PARAM_CONFIG_INIT;
  pw.name = "w", pw.ndim = 2, pw.shape[0] = 3, pw.shape[1] = 4, pw.data = w;
  pb.name = "b", pb.ndim = 1, pb.shape[0] = 4, pb.data = b;
  assert_ok(dopt_optim_add_param(o, 0, &pw, NULL));
  assert_ok(dopt_optim_add_param(o, 0, &pb, NULL)); /* auto: aux Adam */
  float w2[12];
  memcpy(w2, w, sizeof w2);
  dopt_param_config pa = pw;
  pa.name = "w_aux", pa.data = w2;
  assert_ok(dopt_optim_add_param(o, gaux, &pa, NULL)); /* a matrix in a use_muon=false group: aux Adam */
  const float *g[3] = {g12, g4, g12};
  assert_ok(dopt_optim_step(o, g));
  dopt_state_view v;
  assert_ok(dopt_optim_state(o, 0, 0, &v));
  assert_string_equal(v.name, "momentum_buffer");
  assert_int_equal(dopt_optim_num_states(o, 1), 2);
  assert_ok(dopt_optim_state(o, 1, 0, &v));
  assert_string_equal(v.name, "exp_avg");
  assert_int_equal(dopt_optim_num_states(o, 2), 2);
  assert_ok(dopt_optim_state(o, 2, 0, &v));
  assert_string_equal(v.name, "exp_avg");
  /* the spellings of the enum's choices: "false"/"False" are use_muon's third choice, never 0 (auto) */
  static const struct {
    const char *hp;
    double want;
  } SP[] = {{"use_muon=false", 2}, {"use_muon=False", 2}, {"use_muon=true", 1}, {"use_muon=True", 1}, {"use_muon=auto", 0}};
  for (size_t k = 0; k < sizeof SP / sizeof SP[0]; k++) {
    dopt_optim *q = NULL;
    assert_ok(dopt_optim_create("muon", SP[k].hp, &q));
    const dopt_optim_impl *im = dopt__optim_impl(q);
    int at = -1;
    for (int j = 0; j < im->nhp; j++)
      if (strcmp(im->hp[j].key, "use_muon") == 0) at = j;
    if (dopt__optim_group_hp(q, 0)[at] != SP[k].want) fail_msg("%s -> %g", SP[k].hp, dopt__optim_group_hp(q, 0)[at]);
    dopt_optim_destroy(q);
  }
  /* aux Adam's first step from zero states, as its formula with lr 3e-4 (lr none) */
  const float m1 = fmaf((float)(1.0 - 0.9), 0.5f, 0.0f), v1 = fmaf((float)(1.0 - 0.95), 0.5f * 0.5f, 0.0f);
  const float u1 = (m1 / (float)(1.0 - 0.9)) / (sqrtf(v1 / (float)(1.0 - 0.95)) + (float)1e-10);
  const float want = fmaf((float)(-3e-4), u1, 1.0f * (float)(1.0 - 3e-4 * 0.0));
  if (memcmp(&want, &b[0], sizeof want)) fail_msg("aux Adam with lr none: %a, want %a (lr 3e-4)", (double)b[0], (double)want);
  dopt_optim_destroy(o);
  /* true: a 1-D parameter is refused, naming the fix */
  assert_ok(dopt_optim_create("muon", "use_muon=true", &o));
  assert_ok(dopt_optim_add_param(o, 0, &pb, NULL));
  const float *gb[1] = {g4};
  assert_status(dopt_optim_step(o, gb), DOPT_ERR_SHAPE, "use_muon=false group");
  dopt_optim_destroy(o);
  assert_status(dopt_optim_create("muon", "ns_steps=2.5", &o), DOPT_ERR_INVALID_ARG, "ns_steps=2.5");
  assert_status(dopt_optim_create("muon", "momentum=1", &o), DOPT_ERR_INVALID_ARG, "momentum=1");
  assert_status(dopt_optim_create("muon", "use_muon=maybe", &o), DOPT_ERR_INVALID_ARG, "maybe");
  /* torch.optim.Muon's keys: coefficients finite and within [-1e4, 1e4], the normalisation's eps in [0, 1], the
   * flavour and the lr rule by name */
  assert_status(dopt_optim_create("muon", "ns_b=-2e4", &o), DOPT_ERR_INVALID_ARG,
                "muon: ns_b=-20000 must be finite and within [-1e4, 1e4]");
  assert_status(dopt_optim_create("muon", "ns_eps=2", &o), DOPT_ERR_INVALID_ARG, "muon: ns_eps=2 must be in [0, 1]");
  assert_status(dopt_optim_create("muon", "ns_eps=-1e-7", &o), DOPT_ERR_INVALID_ARG, "ns_eps=-1e-07");
  assert_status(dopt_optim_create("muon", "flavor=pytorch", &o), DOPT_ERR_INVALID_ARG, "pytorch");
  assert_status(dopt_optim_create("muon", "adjust_lr_fn=spectral", &o), DOPT_ERR_INVALID_ARG, "spectral");
}

/* The cost that balances owners: Newton-Schulz multiply-adds per matrix (3-D: per batch index), aux Adam 8
 * per element. */
static void test_cost(void **st) {
  (void)st;
  dopt_optim *o = NULL;
  assert_ok(dopt_optim_create("muon", NULL, &o));
  const dopt_optim_impl *im = dopt__optim_impl(o);
  const double *hp = dopt__optim_group_hp(o, 0);
  const int64_t m[2] = {64, 256}, e[3] = {4, 64, 256}, v[1] = {100};
  const double ns = 5.0 * (2.0 * 64 * 64 * 256 + 64.0 * 64 * 64 + 4.0 * 64 * 256 + 4.0 * 64 * 64) + 4.0 * 64 * 256;
  assert_true(fabs(dopt__impl_cost(im, hp, 2, m) - (ns + 8.0 * 64 * 256)) < 1e-6);
  assert_true(fabs(dopt__impl_cost(im, hp, 3, e) - 4 * (ns + 8.0 * 64 * 256)) < 1e-6);
  assert_true(fabs(dopt__impl_cost(im, hp, 1, v) - 800.0) < 1e-9);
  dopt_optim_destroy(o);
}

/* Owner units (docs/distributed.md#owner-units): a stack of 3 or more dims is one unit per matrix, a conv
 * filter, a matrix and an aux-Adam parameter one; a piece of whole matrices steps to the bits those matrices
 * get in the whole tensor (every lr rule reads the parameter's shape), a piece that cuts a matrix is refused. */
static dopt_status step_piece(const dopt_optim_impl *im, const double *hp, int ndim, const int64_t *shape, size_t lo,
                              size_t len, float *p, const float *g, float *m) {
  dopt_piece pc;
  dopt_piece_full(ndim, shape, &pc);
  pc.lo = lo, pc.len = len;
  void *state[1] = {m};
  dopt_step_args a = {.impl = im, .hp = hp, .step = 1, .piece = &pc, .param = p, .grad = g, .state = state,
                      .ndim = ndim, .shape = shape};
  return dopt__run_stages(dopt_device_cpu(), &a);
}

static void test_units(void **st) {
  (void)st;
  static const char *const H[] = {"", "adjust_lr_fn=original,weight_decay=0.1", "adjust_lr_fn=match_rms_adamw"};
  for (size_t h = 0; h < sizeof H / sizeof H[0]; h++) {
    dopt_optim *o = NULL;
    assert_ok(dopt_optim_create("muon", H[h], &o));
    const dopt_optim_impl *im = dopt__optim_impl(o);
    const double *hp = dopt__optim_group_hp(o, 0);
    const int64_t e[3] = {4, 9, 7}, c[4] = {6, 2, 3, 3}, m2[2] = {9, 7}, v[1] = {9}, five[5] = {2, 3, 1, 9, 7};
    assert_int_equal(dopt__impl_units(im, hp, 3, e), 4);
    assert_int_equal(dopt__impl_units(im, hp, 5, five), 6);
    assert_int_equal(dopt__impl_units(im, hp, 4, c), 1);
    assert_int_equal(dopt__impl_units(im, hp, 2, m2), 1);
    assert_int_equal(dopt__impl_units(im, hp, 1, v), 1);
    const size_t n = 4 * 63;
    float *w0 = filled(n, 11 + h, 0.1), *g = filled(n, 12 + h, 1.0), *mom0 = filled(n, 13 + h, 0.05);
    float *pw = malloc(n * sizeof *pw), *mw = malloc(n * sizeof *mw), *pp = malloc(n * sizeof *pp),
          *mp = malloc(n * sizeof *mp);
    memcpy(pw, w0, n * sizeof *pw), memcpy(mw, mom0, n * sizeof *mw);
    memcpy(pp, w0, n * sizeof *pp), memcpy(mp, mom0, n * sizeof *mp);
    assert_ok(step_piece(im, hp, 3, e, 0, n, pw, g, mw)); /* the whole stack */
    assert_ok(step_piece(im, hp, 3, e, 0, 63, pp, g, mp)); /* expert 0, then experts 1..3 */
    assert_ok(step_piece(im, hp, 3, e, 63, 3 * 63, pp + 63, g + 63, mp + 63));
    assert_memory_equal(pw, pp, n * sizeof *pw);
    assert_memory_equal(mw, mp, n * sizeof *mw);
    assert_true(memcmp(pw, w0, n * sizeof *pw) != 0);
    assert_status(step_piece(im, hp, 3, e, 63, 62, pp + 63, g + 63, mp + 63), DOPT_ERR_UNSUPPORTED, "whole matrices of 63");
    assert_status(step_piece(im, hp, 2, m2, 0, 62, pp, g, mp), DOPT_ERR_UNSUPPORTED, "whole matrices");
    free(w0), free(g), free(mom0), free(pw), free(mw), free(pp), free(mp);
    dopt_optim_destroy(o);
  }
  dopt_optim *o = NULL; /* use_muon=false: aux Adam, elementwise, not owned */
  assert_ok(dopt_optim_create("muon", "use_muon=false", &o));
  const int64_t e[3] = {4, 9, 7};
  assert_int_equal(dopt__impl_units(dopt__optim_impl(o), dopt__optim_group_hp(o, 0), 3, e), 1);
  dopt_optim_destroy(o);
}

/* galore(inner=muon) with weight decay: lr none is the Muon lr (0.02) for the full weight's decay too, bit for
 * bit the run with lr=0.02 given (it was NaN: the wrapper's default decay read the key's none), and the decay
 * acts (weight_decay=0 differs). */
static void test_galore_around_muon(void **st) {
  (void)st;
  static const char *const H[] = {"inner=muon,rank=4,update_proj_gap=2,weight_decay=0.1",
                                  "inner=muon,rank=4,update_proj_gap=2,weight_decay=0.1,lr=0.02",
                                  "inner=muon,rank=4,update_proj_gap=2"};
  float out[3][32 * 16];
  for (int h = 0; h < 3; h++) {
    dopt_optim *o = NULL;
    assert_ok(dopt_optim_create("galore", H[h], &o));
    float *w0 = filled(32 * 16, 21, 0.1);
    memcpy(out[h], w0, sizeof out[h]);
    dopt_param_config pc = DOPT_PARAM_CONFIG_INIT;
    pc.name = "w", pc.ndim = 2, pc.shape[0] = 32, pc.shape[1] = 16, pc.data = out[h];
    assert_ok(dopt_optim_add_param(o, 0, &pc, NULL));
    for (uint64_t t = 0; t < 4; t++) {
      float *g = filled(32 * 16, 30 + t, 1.0);
      const float *gp[1] = {g};
      assert_ok(dopt_optim_step(o, gp));
      free(g);
    }
    for (size_t i = 0; i < 32 * 16; i++)
      if (!isfinite(out[h][i])) fail_msg("[%s] w[%zu] = %g", H[h], i, (double)out[h][i]);
    free(w0);
    dopt_optim_destroy(o);
  }
  assert_memory_equal(out[0], out[1], sizeof out[0]);
  assert_true(memcmp(out[0], out[2], sizeof out[0]) != 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {cmocka_unit_test(test_adjust_lr_fn), cmocka_unit_test(test_kernel),
                                     cmocka_unit_test(test_gemm_small_shapes),
                                     cmocka_unit_test(test_groups_and_refusals), cmocka_unit_test(test_cost),
                                     cmocka_unit_test(test_units), cmocka_unit_test(test_galore_around_muon)};
  return cmocka_run_group_tests(tests, NULL, NULL);
}
