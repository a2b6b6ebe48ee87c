/* adamw8bit (bitsandbytes AdamW8bit, CUDA kernel semantics) against a float64
 * implementation of the same algorithm written here, step by step: before
 * every step the oracle takes the optimizer's current state (bytes, absmax,
 * parameters), runs the step in double and is compared with the optimizer's
 * result, so differences do not compound and every byte is checked at every
 * step. Also: the fp32 path below min_8bit_size, NaN resets, all-zero blocks,
 * percentile clipping's history, decay after the step, memory.
 *
 * What may differ, and the bounds (eps = 2^-24, one fp32 rounding):
 *  - new states: the optimizer computes m' = β1·m + (1−β1)·g' and
 *    v' = β2·v + ((1−β2)·g')·g' with m, v dequantised in fp32: at most 4
 *    roundings, so |Δs| ≤ 4·eps·T with T = |β1·m| + |(1−β1)·g'| (resp. the
 *    sum of the positive terms for v). absmax is one of the |s|, the division
 *    x = s/absmax adds one rounding: |Δx| ≤ 4·eps·T/absmax + 6·eps·|x|. We
 *    allow 16·eps·(T/absmax + |x|) (a factor ≥ 2.5 over the bound).
 *  - state bytes: equal unless the oracle's x lies within that tolerance of
 *    the midpoint of the two codes the two sides chose (adjacent codes: a
 *    "midpoint flip"), or |x| is within the tolerance of 0 where the state1
 *    sign fix may go either way (bytes 126..128). Every other difference
 *    fails. Flips are counted; they need x within ~1e-6 relative of one of
 *    255 midpoints, so with ~10^5 bytes compared they should be a handful at
 *    most: we require ≤ 1 per 10,000 bytes.
 *  - parameters: p + step_size·s1/(√s2 + c2·eps) then ·(1 − lr·wd): the add
 *    and the decay round (≤ 1 ulp of p together); the update u carries the
 *    state error 8·eps·T·|step_size|/den plus ≤ 8 roundings of its own
 *    (powf, sqrt, division, products: 16·eps·|u|), and the fp32 bias
 *    corrections' cancellation (ss_rel_err). Allowed: 2·ulp(p) +
 *    |step_size|·8·eps·T/den + (16·eps + ss_rel_err)·|u|; we also report the
 *    largest ULP distance seen. */
#include "testutil.h"

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "distopt/distopt.h"
#include "distopt/quant8.h"
#include "quant8_fast.h"
#include "registry.h"

#define EPS32 (1.0 / 16777216.0)
#define NSTEPS 24

typedef struct hpd {
  double lr, b1, b2, eps, wd, gscale;
} hpd;

/* the kernel receives fp32 scalars: the oracle uses those values, in double */
static hpd hp_of(double lr, double b1, double b2, double eps, double wd) {
  hpd h = {(float)lr, (float)b1, (float)b2, (float)eps, (float)wd, 1.0};
  return h;
}

/* nearest code in double; exact midpoints go to the even index (the CUDA
 * search's final pivot is always even); NaN → 0 */
static int nearest(const float *code, double x) {
  if (isnan(x)) return 0;
  if (x <= code[0]) return 0;
  if (x >= code[255]) return 255;
  int i = 0;
  while (!(x >= code[i] && x <= code[i + 1])) i++;
  const double mid = ((double)code[i] + code[i + 1]) / 2;
  if (x < mid) return i;
  if (x > mid) return i + 1;
  return i % 2 == 0 ? i : i + 1;
}

typedef struct cmpstat {
  size_t bytes, flips1, flips2, params;
  uint64_t max_ulp, max_ulp_big; /* all; |p| >= 0.01 */
  double max_pratio;
} cmpstat;

static float ulpf(double v) {
  float f = fabsf((float)v);
  return nextafterf(f, INFINITY) - f;
}

/* Relative error of the kernel's fp32 step size −lr·c2/c1: c_i = 1 − fp32(β_i^t)
 * cancels, so one rounding of β^t (≤ 1 ulp from powf) becomes a relative error
 * of eps·β^t/(1 − β^t) in c_i (halved by the square root for c2): ~500·eps
 * for β2 = 0.999 at t = 2. The GPU's fast pow is worse; this is inherent to
 * computing the bias corrections in fp32, not an implementation error. */
static double ss_rel_err(hpd h, int64_t t) {
  const double p1 = pow(h.b1, (double)t), p2 = pow(h.b2, (double)t);
  return 2 * EPS32 * (4 + p1 / (1 - p1) + p2 / (1 - p2));
}

/* One oracle step on the whole tensor from the pre-step state; compares with
 * the optimizer's post-step state. */
static void check_step_8bit(const float *p0, const float *g, const uint8_t *q10, const uint8_t *q20, const float *a10,
                            const float *a20, const float *p1, const uint8_t *q11, const uint8_t *q21,
                            const float *a11, const float *a21, size_t n, size_t B, int64_t t, hpd h, cmpstat *cs,
                            const char *what) {
  const float *c1 = dopt_q8_map(1), *c2 = dopt_q8_map(0);
  const double omb1 = 1.0 - h.b1, omb2 = 1.0 - h.b2;
  const double k1 = 1.0 - pow(h.b1, (double)t), k2 = sqrt(1.0 - pow(h.b2, (double)t));
  const double ss = -h.lr * k2 / k1, c2eps = k2 * h.eps, decay = 1.0 - h.lr * h.wd;
  const double rss = ss_rel_err(h, t);
  double *s1 = malloc(B * sizeof *s1), *s2 = malloc(B * sizeof *s2), *T1 = malloc(B * sizeof *T1),
         *T2 = malloc(B * sizeof *T2);
  for (size_t b0 = 0, blk = 0; b0 < n; b0 += B, blk++) {
    const size_t valid = n - b0 < B ? n - b0 : B;
    double m1 = 0, m2 = 0, TA1 = 0, TA2 = 0;
    for (size_t j = 0; j < B; j++) {
      const int in = j < valid;
      const double gj = in ? g[b0 + j] : 0.0;
      const int b1 = in ? q10[b0 + j] : 128, b2 = in ? q20[b0 + j] : 0;
      s1[j] = s2[j] = T1[j] = T2[j] = 0;
      if (isfinite(gj)) {
        const double gs = gj * h.gscale, m = (double)c1[b1] * a10[blk], v = (double)c2[b2] * a20[blk];
        s1[j] = h.b1 * m + omb1 * gs;
        s2[j] = h.b2 * v + omb2 * gs * gs;
        T1[j] = fabs(h.b1 * m) + fabs(omb1 * gs);
        T2[j] = s2[j];
      }
      m1 = fmax(m1, fabs(s1[j]));
      m2 = fmax(m2, s2[j]);
      TA1 = fmax(TA1, T1[j]);
      TA2 = fmax(TA2, T2[j]);
    }
    if (fabs(a11[blk] - m1) > 8 * EPS32 * TA1 || fabs(a21[blk] - m2) > 8 * EPS32 * TA2)
      fail_msg("%s t=%lld block %zu: absmax %a %a, oracle %a %a", what, (long long)t, blk, (double)a11[blk],
               (double)a21[blk], m1, m2);
    for (size_t j = 0; j < valid; j++) {
      const size_t i = b0 + j;
      /* parameter */
      double pe = p0[i], tol = 0;
      if (isfinite(g[i])) {
        const double den = sqrt(s2[j]) + c2eps, u = ss * s1[j] / den;
        pe = p0[i] + u;
        if (h.wd > 0) pe *= decay;
        tol = 2.0 * ulpf(pe) + fabs(ss) * 8 * EPS32 * T1[j] / den + (16 * EPS32 + rss) * fabs(u);
      }
      const double d = fabs((double)p1[i] - pe);
      if (d > tol) fail_msg("%s t=%lld: p[%zu] = %a, oracle %a (tol %g)", what, (long long)t, i, (double)p1[i], pe, tol);
      if (tol > 0 && d / tol > cs->max_pratio) cs->max_pratio = d / tol;
      const uint64_t ud = dt_ulp_distance(p1[i], (float)pe);
      if (ud > cs->max_ulp) cs->max_ulp = ud;
      if (fabs(pe) >= 0.01 && ud > cs->max_ulp_big) cs->max_ulp_big = ud;
      cs->params++;
      /* bytes */
      for (int k = 0; k < 2; k++) {
        const double s = k ? s2[j] : s1[j], m = k ? m2 : m1, T = k ? T2[j] : T1[j];
        const float *c = k ? c2 : c1;
        const double x = s / m;
        int qo = nearest(c, x);
        if (!k && (signbit(c[qo]) != 0) != (signbit(s) != 0)) qo = (uint8_t)(s > 0 ? qo + 1 : qo - 1);
        const int qc = k ? q21[i] : q11[i];
        cs->bytes++;
        if (qo == qc) continue;
        const double xtol = 16 * EPS32 * (T / m + fabs(x));
        const int lo = qo < qc ? qo : qc;
        const int flip = abs(qo - qc) == 1 && fabs(x - ((double)c[lo] + c[lo + 1]) / 2) <= xtol;
        const int sign = !k && fabs(x) <= xtol && qo >= 126 && qo <= 128 && qc >= 126 && qc <= 128;
        if (!flip && !sign)
          fail_msg("%s t=%lld: state%d[%zu] byte %d, oracle %d (x=%.9g, codes %.9g %.9g)", what, (long long)t, k + 1,
                   i, qc, qo, x, (double)c[qc], (double)c[qo]);
        if (k) cs->flips2++;
        else cs->flips1++;
      }
    }
  }
  free(s1), free(s2), free(T1), free(T2);
}

/* fp32 path (kOptimizer32bit2State) against double from the same pre-step state */
static void check_step_32(const float *p0, const float *g, const float *m0, const float *v0, const float *p1,
                          const float *m1, const float *v1, size_t n, int64_t t, hpd h, cmpstat *cs) {
  const double k1 = 1.0 - pow(h.b1, (double)t), k2 = sqrt(1.0 - pow(h.b2, (double)t));
  const double ss = -h.lr * k2 / k1, c2eps = k2 * h.eps, decay = 1.0 - h.lr * h.wd;
  const double rss = ss_rel_err(h, t);
  for (size_t i = 0; i < n; i++) {
    const double gs = (double)g[i] * h.gscale;
    const double m = h.b1 * m0[i] + (1 - h.b1) * gs, v = h.b2 * v0[i] + (1 - h.b2) * gs * gs;
    const double T = fabs(h.b1 * m0[i]) + fabs((1 - h.b1) * gs);
    if (fabs(m1[i] - m) > 4 * EPS32 * T || fabs(v1[i] - v) > 4 * EPS32 * v)
      fail_msg("fp32 t=%lld: state[%zu] %a %a, oracle %a %a", (long long)t, i, (double)m1[i], (double)v1[i], m, v);
    const double den = sqrt(v) + c2eps, u = ss * m / den;
    double pe = (p0[i] + u) * (h.wd > 0 ? decay : 1.0);
    const double tol = 2.0 * ulpf(pe) + fabs(ss) * 8 * EPS32 * T / den + (16 * EPS32 + rss) * fabs(u);
    if (fabs(p1[i] - pe) > tol) fail_msg("fp32 t=%lld: p[%zu] %a, oracle %a", (long long)t, i, (double)p1[i], pe);
    const uint64_t ud = dt_ulp_distance(p1[i], (float)pe);
    if (ud > cs->max_ulp) cs->max_ulp = ud;
    if (fabs(pe) >= 0.01 && ud > cs->max_ulp_big) cs->max_ulp_big = ud;
    cs->params++;
  }
}

/* gradient of step t (1-based): N(0,1)·scale, a few heavy elements, steps 7
 * and 8 all zero, non-finite elements at step 12 when `nonfinite` */
static void make_grad(float *g, size_t n, int t, uint64_t seed, double scale, int nonfinite) {
  uint64_t r = seed * 1000003u + (uint64_t)t;
  for (size_t i = 0; i < n; i++) g[i] = (float)(dt_rand_normal(&r) * scale);
  for (int k = 0; k < 3; k++) g[dt_rand_u64(&r) % n] *= (float)exp(1 + 4 * dt_rand_uniform(&r));
  if (t == 7 || t == 8)
    for (size_t i = 0; i < n; i++) g[i] = 0.0f;
  if (t == 12 && nonfinite) {
    g[0] = NAN;
    g[n / 2] = INFINITY;
    g[n - 1] = -INFINITY;
  }
}

static float *make_param(size_t n, uint64_t seed) {
  float *p = malloc(n * sizeof *p);
  uint64_t r = seed;
  for (size_t i = 0; i < n; i++) p[i] = (float)(dt_rand_normal(&r) * 0.5);
  return p;
}

static void add_param(dopt_optim *o, const char *name, int ndim, const int64_t *shape, float *data) {
  dopt_param_config pc = DOPT_PARAM_CONFIG_INIT;
  pc.name = name;
  pc.ndim = ndim;
  for (int i = 0; i < ndim; i++) pc.shape[i] = shape[i];
  pc.data = data;
  assert_ok(dopt_optim_add_param(o, 0, &pc, NULL));
}

static void *state_data(dopt_optim *o, int p, int idx, const char *name, dopt_dtype dt) {
  dopt_state_view v;
  assert_ok(dopt_optim_state(o, p, idx, &v));
  assert_string_equal(v.name, name);
  assert_int_equal(v.dtype, dt);
  return v.data;
}

/* ≥ 20 steps, numel just below/at/above 4096 and not a multiple of B, both
 * block sizes, against the oracle. */
static void test_against_oracle(void **st) {
  (void)st;
  const struct {
    int64_t shape[2];
    int ndim;
  } shapes[] = {{{4095, 0}, 1}, {{4096, 0}, 1}, {{4097, 0}, 1}, {{63, 80}, 2}, {{33, 200}, 2}};
  const size_t blocks[] = {256, 2048};
  const char *hps[] = {"", "lr=3e-3,beta2=0.99,weight_decay=0.1"};
  cmpstat cs = {0}, cs32 = {0};
  for (int bi = 0; bi < 2; bi++)
    for (int hi = 0; hi < 2; hi++)
      for (int si = 0; si < 5; si++) {
        char hp[128];
        snprintf(hp, sizeof hp, "block_size=%zu%s%s", blocks[bi], hps[hi][0] ? "," : "", hps[hi]);
        dopt_optim *o;
        assert_ok(dopt_optim_create("adamw8bit", hp, &o));
        const size_t n = (size_t)(shapes[si].shape[0] * (shapes[si].ndim == 2 ? shapes[si].shape[1] : 1)), B = blocks[bi];
        const int q8 = n >= 4096;
        float *p = make_param(n, 11 + (uint64_t)si), *g = malloc(n * sizeof *g), *p0 = malloc(n * sizeof *p0);
        add_param(o, "w", shapes[si].ndim, shapes[si].shape, p);
        hpd h = hi ? hp_of(3e-3, 0.9, 0.99, 1e-8, 0.1) : hp_of(1e-3, 0.9, 0.999, 1e-8, 1e-2);
        const size_t nb = dopt_q8_num_blocks(n, B);
        uint8_t *q10 = malloc(n), *q20 = malloc(n);
        float *a10 = calloc(nb, 4), *a20 = calloc(nb, 4), *m0 = calloc(n, 4), *v0 = calloc(n, 4);
        memset(q10, 0, n), memset(q20, 0, n);
        char what[200];
        snprintf(what, sizeof what, "n=%zu B=%zu hp=%s", n, B, hp);
        for (int t = 1; t <= NSTEPS; t++) {
          make_grad(g, n, t, (uint64_t)si + 100 * (uint64_t)bi, hi ? 1e-2 : 1.0, q8);
          memcpy(p0, p, n * 4);
          const float *gg[1] = {g};
          assert_ok(dopt_optim_step(o, gg));
          unsigned ev;
          assert_ok(dopt_optim_events(o, 0, &ev));
          assert_int_equal(ev, (q8 && t == 12) ? DOPT_EVENT_NONFINITE_RESET : 0u);
          if (q8) {
            const uint8_t *q11 = state_data(o, 0, 0, "state1", DOPT_U8), *q21 = state_data(o, 0, 1, "state2", DOPT_U8);
            const float *a11 = state_data(o, 0, 2, "absmax1", DOPT_F32), *a21 = state_data(o, 0, 3, "absmax2", DOPT_F32);
            check_step_8bit(p0, g, q10, q20, a10, a20, p, q11, q21, a11, a21, n, B, t, h, &cs, what);
            if (t == 12) { /* non-finite: parameter kept, moments reset to 0 */
              const size_t bad[3] = {0, n / 2, n - 1};
              for (int k = 0; k < 3; k++) {
                assert_true(p[bad[k]] == p0[bad[k]]);
                assert_int_equal(q11[bad[k]], 127);
                assert_int_equal(q21[bad[k]], 0);
              }
            }
            memcpy(q10, q11, n), memcpy(q20, q21, n), memcpy(a10, a11, nb * 4), memcpy(a20, a21, nb * 4);
          } else {
            const float *m1 = state_data(o, 0, 0, "state1", DOPT_F32), *v1 = state_data(o, 0, 1, "state2", DOPT_F32);
            check_step_32(p0, g, m0, v0, p, m1, v1, n, t, h, &cs32);
            memcpy(m0, m1, n * 4), memcpy(v0, v1, n * 4);
          }
        }
        dopt_optim_destroy(o);
        free(p), free(g), free(p0), free(q10), free(q20), free(a10), free(a20), free(m0), free(v0);
      }
  printf("8-bit: %zu bytes, midpoint flips state1 %zu state2 %zu; %zu params, max %llu ulp (%llu where |p| >= 0.01; "
         "%.3g of the bound)\n",
         cs.bytes, cs.flips1, cs.flips2, cs.params, (unsigned long long)cs.max_ulp,
         (unsigned long long)cs.max_ulp_big, cs.max_pratio);
  printf("fp32 path: %zu params, max %llu ulp (%llu where |p| >= 0.01)\n", cs32.params,
         (unsigned long long)cs32.max_ulp, (unsigned long long)cs32.max_ulp_big);
  assert_true(cs.bytes > 1000000);
  assert_true((cs.flips1 + cs.flips2) * 10000 <= cs.bytes);
  /* In ULPs, for |p| >= 0.01 (ulp(p) >= 2^-30): the non-ulp terms of the
   * per-element bound are (16·eps + ss_rel_err)·|u| + state error, with
   * |u| <= lr·|m_hat|/sqrt(v_hat) <~ 3·lr <= 1e-2 here and ss_rel_err <=
   * ~1100·eps at t = 2 (beta2 = 0.999): <= ~7e-10 + 2 ulp, i.e. <= ~3 ulp +
   * 2 ulp; 16 leaves room. Near-zero parameters have tiny ulps, hence the
   * absolute bound above instead. */
  assert_true(cs.max_ulp_big <= 16 && cs32.max_ulp_big <= 16);
}

/* All-zero gradient block: 0/0 = NaN → byte 0, then the sign fix (code1[0]
 * is negative, s1 = +0 is not) moves it to 0 − 1 = 255; state2 stays 0. */
static void test_zero_block_and_padding(void **st) {
  (void)st;
  dopt_optim *o;
  assert_ok(dopt_optim_create("adamw8bit", "block_size=256", &o));
  const size_t n = 4096 + 300;
  const int64_t shape[1] = {(int64_t)n};
  float *p = make_param(n, 3), *g = malloc(n * 4);
  add_param(o, "w", 1, shape, p);
  for (int t = 1; t <= 3; t++) {
    make_grad(g, n, t, 9, 1.0, 0);
    for (size_t i = 256; i < 512; i++) g[i] = 0.0f; /* block 1 */
    const float *gg[1] = {g};
    assert_ok(dopt_optim_step(o, gg));
  }
  const uint8_t *q1 = state_data(o, 0, 0, "state1", DOPT_U8), *q2 = state_data(o, 0, 1, "state2", DOPT_U8);
  const float *a1 = state_data(o, 0, 2, "absmax1", DOPT_F32), *a2 = state_data(o, 0, 3, "absmax2", DOPT_F32);
  assert_true(a1[1] == 0.0f && a2[1] == 0.0f);
  for (size_t i = 256; i < 512; i++) {
    assert_int_equal(q1[i], 255);
    assert_int_equal(q2[i], 0);
  }
  /* the last block (44 valid slots) has absmax at least the padded slots'
   * β1·code1[128]·absmax_old (byte 128 decodes to 5.5e-7) */
  assert_true(a1[17] > 0);
  dopt_optim_destroy(o);
  free(p), free(g);
}

/* Decay after the step, in the kernel's fp32 order: p' = (p + step_size·
 * (s1/(√s2 + c2·eps)))·(1 − lr·wd), from zero states at t = 1, for both
 * paths; torch's decay-before order gives different results. */
static void test_decay_after(void **st) {
  (void)st;
  for (int q8 = 0; q8 < 2; q8++) {
    dopt_optim *o;
    assert_ok(dopt_optim_create("adamw8bit", "lr=0.05,weight_decay=0.5", &o));
    const size_t n = q8 ? 4096 : 100;
    const int64_t shape[1] = {(int64_t)n};
    float *p = make_param(n, 5), *p0 = malloc(n * 4), *g = malloc(n * 4);
    memcpy(p0, p, n * 4);
    make_grad(g, n, 1, 5, 1.0, 0);
    add_param(o, "w", 1, shape, p);
    const float *gg[1] = {g};
    assert_ok(dopt_optim_step(o, gg));
    const float lr = 0.05f, b1 = 0.9f, b2 = 0.999f, eps = 1e-8f, wd = 0.5f;
    const float c1 = 1.0f - powf(b1, 1.0f), c2 = sqrtf(1.0f - powf(b2, 1.0f));
    const float ss = (-lr * c2) / c1, decay = 1.0f - lr * wd;
    int differs = 0;
    for (size_t i = 0; i < n; i++) {
      const float s1 = (1.0f - b1) * g[i];
      const float s2 = q8 ? ((1.0f - b2) * g[i]) * g[i] : (1.0f - b2) * (g[i] * g[i]); /* the kernels' orders */
      const float upd = ss * (s1 / (sqrtf(s2) + c2 * eps));
      const float after = (p0[i] + upd) * decay, before = p0[i] * decay + upd;
      if (p[i] != after) fail_msg("q8=%d p[%zu] = %a, decay-after %a", q8, i, (double)p[i], (double)after);
      differs += after != before;
    }
    assert_true(differs > (int)n / 4);
    dopt_optim_destroy(o);
    free(p), free(p0), free(g);
  }
}

/* fp32 path has no guard: a NaN gradient poisons its element (upstream). */
static void test_fp32_nan_propagates(void **st) {
  (void)st;
  dopt_optim *o;
  assert_ok(dopt_optim_create("adamw8bit", NULL, &o));
  const int64_t shape[1] = {64};
  float *p = make_param(64, 8), g[64] = {0};
  g[3] = NAN;
  g[4] = 1.0f;
  add_param(o, "w", 1, shape, p);
  const float *gg[1] = {g};
  assert_ok(dopt_optim_step(o, gg));
  assert_true(isnan(p[3]) && isfinite(p[4]));
  unsigned ev;
  assert_ok(dopt_optim_events(o, 0, &ev));
  assert_int_equal(ev, 0);
  dopt_optim_destroy(o);
  free(p);
}

/* percentile_clipping=5: the gnorm history (t = 1 fills all 100 slots, then
 * slot t mod 100), the scale clip/current when current > clip, the event, and
 * that the step equals an unclipped step on g·scale, bit for bit. */
static void test_percentile_clipping(void **st) {
  (void)st;
  for (int q8 = 0; q8 < 2; q8++) {
    dopt_optim *o, *ref;
    assert_ok(dopt_optim_create("adamw8bit", "percentile_clipping=5", &o));
    assert_ok(dopt_optim_create("adamw8bit", NULL, &ref));
    const size_t n = q8 ? 5000 : 300;
    const int64_t shape[1] = {(int64_t)n};
    float *p = make_param(n, 21), *pr = make_param(n, 21), *g = malloc(n * 4), *gs = malloc(n * 4);
    add_param(o, "w", 1, shape, p);
    add_param(ref, "w", 1, shape, pr);
    double hist[100];
    int nclipped = 0;
    for (int t = 1; t <= 130; t++) {
      make_grad(g, n, t, 77, 0.1 * (1 + (t % 13)), 0); /* norms vary; 7 and 8 are zero */
      double ss = 0;
      for (size_t i = 0; i < n; i++) ss += (double)g[i] * g[i];
      if (t == 1)
        for (int k = 0; k < 100; k++) hist[k] = (float)ss;
      else
        hist[t % 100] = (float)ss;
      double sorted[100];
      memcpy(sorted, hist, sizeof sorted);
      for (int a = 1; a < 100; a++) /* insertion sort */
        for (int b = a; b > 0 && sorted[b - 1] > sorted[b]; b--) {
          double tmp = sorted[b];
          sorted[b] = sorted[b - 1];
          sorted[b - 1] = tmp;
        }
      const float cur = sqrtf((float)hist[t % 100]), clip = sqrtf((float)sorted[5]);
      const float scale = cur > clip ? clip / cur : 1.0f;
      for (size_t i = 0; i < n; i++) gs[i] = g[i] * scale;
      const float *gg[1] = {g}, *gr[1] = {gs};
      assert_ok(dopt_optim_step(o, gg));
      assert_ok(dopt_optim_step(ref, gr));
      unsigned ev;
      assert_ok(dopt_optim_events(o, 0, &ev));
      assert_int_equal(ev, scale != 1.0f ? DOPT_EVENT_CLIPPED : 0u);
      nclipped += scale != 1.0f;
      const float *hv = state_data(o, 0, q8 ? 4 : 2, "gnorm_vec", DOPT_F32);
      for (int k = 0; k < 100; k++)
        if (hv[k] != (float)hist[k]) fail_msg("t=%d gnorm_vec[%d] = %a, want %a", t, k, (double)hv[k], hist[k]);
      assert_memory_equal(p, pr, n * 4);
      for (int s = 0; s < (q8 ? 4 : 2); s++) {
        dopt_state_view a, b;
        assert_ok(dopt_optim_state(o, 0, s, &a));
        assert_ok(dopt_optim_state(ref, 0, s, &b));
        assert_memory_equal(a.data, b.data, a.bytes);
      }
    }
    assert_true(nclipped > 30 && nclipped < 125);
    dopt_optim_destroy(o);
    dopt_optim_destroy(ref);
    free(p), free(pr), free(g), free(gs);
  }
}

/* Exactly 1 byte per element per state + 4 bytes per block per state for
 * 8-bit, 8 bytes per element below min_8bit_size, + 400 with percentile
 * clipping. */
static void test_memory(void **st) {
  (void)st;
  const struct {
    const char *hp;
    size_t n, want;
  } cases[] = {
      {NULL, 4096, 2 * 4096 + 2 * 4 * 16},
      {NULL, 4097, 2 * 4097 + 2 * 4 * 17},
      {NULL, 4095, 8 * 4095},
      {"block_size=2048", 5000, 2 * 5000 + 2 * 4 * 3},
      {"block_size=64", 5000, 2 * 5000 + 2 * 4 * 79},
      {"percentile_clipping=5", 4096, 2 * 4096 + 2 * 4 * 16 + 400},
      {"percentile_clipping=5", 100, 800 + 400},
      {"min_8bit_size=0", 1, 2 + 8},
  };
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
    dopt_optim *o;
    assert_ok(dopt_optim_create("adamw8bit", cases[c].hp, &o));
    const int64_t shape[1] = {(int64_t)cases[c].n};
    float *p = make_param(cases[c].n, 1);
    add_param(o, "w", 1, shape, p);
    size_t alloc, full;
    assert_ok(dopt_optim_state_bytes(o, 0, &alloc, &full));
    assert_int_equal(alloc, 0);
    assert_int_equal(full, cases[c].want);
    assert_ok(dopt_optim_init_state(o, 0));
    assert_ok(dopt_optim_state_bytes(o, -1, &alloc, &full));
    assert_int_equal(alloc, cases[c].want);
    dopt_optim_destroy(o);
    free(p);
  }
}

static void test_hparams(void **st) {
  (void)st;
  dopt_optim *o = NULL;
  assert_status(dopt_optim_create("adamw8bit", "block_size=100", &o), DOPT_ERR_INVALID_ARG, "block_size=100");
  assert_status(dopt_optim_create("adamw8bit", "block_size=8192", &o), DOPT_ERR_INVALID_ARG, "block_size=8192");
  assert_status(dopt_optim_create("adamw8bit", "percentile_clipping=101", &o), DOPT_ERR_INVALID_ARG,
                "percentile_clipping=101");
  assert_status(dopt_optim_create("adamw8bit", "min_8bit_size=1.5", &o), DOPT_ERR_INVALID_ARG, "min_8bit_size=1.5");
  assert_status(dopt_optim_create("adamw8bit", "beta2=1", &o), DOPT_ERR_INVALID_ARG, "beta2=1");
  assert_ok(dopt_optim_create("adamw8bit", NULL, &o));
  /* a change of the state layout after the first step is refused (absmax size) */
  {
    const int64_t shape[1] = {5000};
    float *p = make_param(5000, 2), *g = make_param(5000, 3);
    add_param(o, "w", 1, shape, p);
    const float *gg[1] = {g};
    assert_ok(dopt_optim_step(o, gg));
    assert_status(dopt_optim_set_hparam(o, 0, "block_size", 64), DOPT_ERR_STATE, "block_size");
    assert_status(dopt_optim_set_hparam(o, 0, "min_8bit_size", 6000), DOPT_ERR_STATE, "min_8bit_size");
    assert_ok(dopt_optim_set_hparam(o, 0, "lr", 2e-3));
    assert_ok(dopt_optim_set_hparam(o, 0, "lr", 1e-3));
    free(p), free(g);
  }
  const char *keys[] = {"lr", "beta1", "beta2", "eps", "weight_decay", "min_8bit_size", "percentile_clipping",
                        "block_size"};
  const double want[] = {1e-3, 0.9, 0.999, 1e-8, 1e-2, 4096, 100, 256};
  for (int k = 0; k < 8; k++) {
    double v;
    assert_ok(dopt_optim_get_hparam(o, 0, keys[k], &v));
    assert_true(v == want[k]);
  }
  dopt_optim_destroy(o);
}

/* ---- the fast kernel is the reference kernel, bit for bit ----------------------- */

static float Fz(float x) { return fabsf(x) < FLT_MIN ? copysignf(0.0f, x) : x; }

/* dopt_q8_adam_update as it was written before the fast kernel (one element
 * at a time, dopt_q8_search): the specification of the fast one */
static void ref_update(float *p, const float *g, uint8_t *state1, uint8_t *state2, float *absmax1, float *absmax2,
                       size_t n, const dopt_q8_adam_hp *hp, size_t *nonfinite) {
  const float *code1 = dopt_q8_map(1), *code2 = dopt_q8_map(0);
  const float t = (float)hp->step;
  const float c1 = Fz(1.0f - Fz(powf(hp->beta1, t))), c2 = Fz(sqrtf(Fz(1.0f - Fz(powf(hp->beta2, t)))));
  const float omb1 = Fz(1.0f - hp->beta1), omb2 = Fz(1.0f - hp->beta2), step_size = Fz(Fz(-hp->lr * c2) / c1);
  const float c2eps = Fz(c2 * hp->eps), decay = Fz(1.0f - Fz(hp->lr * hp->weight_decay));
  const size_t B = hp->block;
  float *s1b = malloc(B * sizeof *s1b), *s2b = malloc(B * sizeof *s2b);
  size_t bad = 0;
  for (size_t b0 = 0, blk = 0; b0 < n; b0 += B, blk++) {
    const size_t valid = n - b0 < B ? n - b0 : B;
    const float a1 = absmax1[blk], a2 = absmax2[blk];
    float m1 = -FLT_MAX, m2 = -FLT_MAX;
    for (size_t j = 0; j < B; j++) {
      const int in = j < valid;
      const float gj = in ? Fz(g[b0 + j]) : 0.0f;
      const uint8_t q1 = in ? state1[b0 + j] : 128, q2 = in ? state2[b0 + j] : 0;
      float s1 = 0.0f, s2 = 0.0f;
      if (isfinite(gj)) {
        const float gs = Fz(gj * hp->gnorm_scale);
        s2 = Fz(code2[q2] * a2);
        s2 = Fz(Fz(s2 * hp->beta2) + Fz(Fz(omb2 * gs) * gs));
        s1 = Fz(code1[q1] * a1);
        s1 = Fz(Fz(s1 * hp->beta1) + Fz(omb1 * gs));
      } else {
        bad++;
      }
      m1 = fmaxf(m1, fabsf(s1));
      m2 = fmaxf(m2, fabsf(s2));
      s1b[j] = s1;
      s2b[j] = s2;
    }
    absmax1[blk] = m1;
    absmax2[blk] = m2;
    for (size_t j = 0; j < valid; j++) {
      const float s1 = s1b[j], s2 = s2b[j];
      if (isfinite(Fz(g[b0 + j]))) {
        float pj = Fz(p[b0 + j]);
        const float den = Fz(Fz(sqrtf(s2)) + c2eps);
        pj = Fz(pj + Fz(step_size * Fz(s1 / den)));
        if (hp->weight_decay > 0.0f) pj = Fz(pj * decay);
        p[b0 + j] = pj;
      }
      uint8_t q1 = dopt_q8_search(code1, Fz(s1 / m1));
      if (signbit(code1[q1]) != signbit(s1)) q1 = (uint8_t)(s1 > 0.0f ? q1 + 1u : q1 - 1u);
      state1[b0 + j] = q1;
      state2[b0 + j] = dopt_q8_search(code2, Fz(s2 / m2));
    }
  }
  free(s1b), free(s2b);
  *nonfinite = bad;
}

/* equal bits, or both NaN: which NaN a parameter gets where two NaN operands
 * meet (a NaN parameter plus a NaN update) is the compiler's choice of
 * operand order in either implementation (C leaves it unspecified); the
 * states never meet two NaNs (one operand of each of their operations is a
 * finite constant or a masked finite gradient), so their bytes are compared
 * exactly */
static int same_param(float a, float b) { return memcmp(&a, &b, sizeof a) == 0 || (isnan(a) && isnan(b)); }

/* mostly N(0, scale²); 1/16 each: ~1e-38 (around FLT_MIN), ~1e-44
 * (subnormal), ±0, ~1e30 (squares overflow), NaN or ±inf */
static float odd_value(uint64_t *r, double scale) {
  const uint64_t u = dt_rand_u64(r);
  switch (u % 16) {
    case 0: return (float)(dt_rand_normal(r) * 1e-38);      /* subnormal or near */
    case 1: return (float)(dt_rand_normal(r) * 1e-44);      /* deep subnormal */
    case 2: return (u >> 8) % 2 ? 0.0f : -0.0f;
    case 3: return (float)(dt_rand_normal(r) * 1e30);       /* overflows when squared */
    case 4: return (u >> 8) % 3 == 0 ? NAN : (u >> 8) % 3 == 1 ? INFINITY : -INFINITY;
    default: return (float)(dt_rand_normal(r) * scale);
  }
}

/* One copy of what an 8-bit step reads and writes: parameters and bytes [n],
 * absmax [nb], and the last step's non-finite count. */
typedef struct q8copy {
  float *p, *a1, *a2;
  uint8_t *q1, *q2;
  size_t n, nb, bad;
} q8copy;

static q8copy q8copy_new(size_t n, size_t nb) {
  q8copy c = {malloc(n * sizeof(float)), malloc(nb * sizeof(float)), malloc(nb * sizeof(float)), malloc(n),
              malloc(n), n, nb, 0};
  assert_non_null(c.p), assert_non_null(c.a1), assert_non_null(c.a2), assert_non_null(c.q1), assert_non_null(c.q2);
  return c;
}

static void q8copy_free(q8copy *c) { free(c->p), free(c->a1), free(c->a2), free(c->q1), free(c->q2); }

static void q8copy_set(q8copy *d, const q8copy *s) {
  memcpy(d->p, s->p, s->n * sizeof(float)), memcpy(d->q1, s->q1, s->n), memcpy(d->q2, s->q2, s->n);
  memcpy(d->a1, s->a1, s->nb * sizeof(float)), memcpy(d->a2, s->a2, s->nb * sizeof(float)), d->bad = s->bad;
}

static dopt_status q8copy_update(q8copy *c, const float *g, const dopt_q8_adam_hp *hp, dopt_q8_impl impl) {
  return dopt__q8_adam_update_impl(c->p, g, c->q1, c->q2, c->a1, c->a2, c->n, hp, &c->bad, impl);
}

/* random states for the kernel tests' modes (0 plain, 1 odd parameters, 2 odd absmax, 3 plain): parameters
 * N(0, 0.25) or odd_value, random bytes, absmax |N(0, 0.1²)| and |N(0, 1e-6)| or odd values a loaded
 * checkpoint may hold */
static void q8copy_fill(q8copy *c, int mode, uint64_t *rng) {
  for (size_t i = 0; i < c->n; i++) {
    c->p[i] = mode == 1 ? odd_value(rng, 0.5) : (float)(dt_rand_normal(rng) * 0.5);
    c->q1[i] = (uint8_t)dt_rand_u64(rng), c->q2[i] = (uint8_t)dt_rand_u64(rng);
  }
  for (size_t b = 0; b < c->nb; b++) {
    c->a1[b] = (float)fabs(dt_rand_normal(rng) * 0.1), c->a2[b] = (float)fabs(dt_rand_normal(rng) * 1e-3);
    if (mode == 2) {
      const float odd[] = {0.0f, -0.0f, -1.0f, 1e-40f, 1e-39f, INFINITY, NAN, 3e38f, 1e-30f};
      c->a1[b] = odd[dt_rand_u64(rng) % 9], c->a2[b] = odd[dt_rand_u64(rng) % 9];
    }
  }
}

/* got has want's parameters (same_param), bytes, absmax and non-finite count, bit for bit; ctx names the case */
static void q8copy_expect(const q8copy *got, const q8copy *want, const char *ctx) {
  for (size_t i = 0; i < got->n; i++)
    if (!same_param(got->p[i], want->p[i]) || got->q1[i] != want->q1[i] || got->q2[i] != want->q2[i])
      fail_msg("%s: element %zu: p %a/%a bytes %d,%d / %d,%d", ctx, i, (double)got->p[i], (double)want->p[i],
               got->q1[i], got->q2[i], want->q1[i], want->q2[i]);
  if (memcmp(got->a1, want->a1, got->nb * sizeof(float)) || memcmp(got->a2, want->a2, got->nb * sizeof(float)) ||
      got->bad != want->bad)
    fail_msg("%s: absmax or non-finite count (%zu, %zu) differ", ctx, got->bad, want->bad);
}

/* Every implementation of the 8-bit kernel (portable, AVX2, AVX-512, AUTO) gives the
 * same parameters, bytes, absmax and non-finite count as ref_update, bit for
 * bit, over chained steps: every block size, partial last blocks, clipping
 * scales, no decay, and inputs that exercise the exact (flush) fallback of the
 * fast vector passes: subnormal gradients and parameters, zeros, NaN/inf,
 * gradients whose square overflows, all-zero blocks and arbitrary absmax
 * states (0, negative, subnormal, inf, NaN), as a loaded checkpoint may hold. */
static void test_fast_kernel_bitwise(void **st) {
  (void)st;
  enum { NV = 5 }; /* the reference, then each implementation */
  const dopt_q8_impl impls[NV] = {DOPT_Q8_IMPL_AUTO, DOPT_Q8_IMPL_SCALAR, DOPT_Q8_IMPL_AVX2, DOPT_Q8_IMPL_AVX512,
                                  DOPT_Q8_IMPL_AUTO};
  const int have[NV] = {1, 1, dopt__q8_have_avx2(), dopt__q8_have_avx512(), 1};
  const size_t sizes[] = {64, 100, 4096, 4096 + 300, 20000};
  const size_t blocks[] = {64, 128, 256, 512, 1024, 2048, 4096};
  uint64_t rng = 77;
  size_t compared = 0;
  for (size_t si = 0; si < sizeof sizes / sizeof *sizes; si++)
    for (size_t bi = 0; bi < sizeof blocks / sizeof *blocks; bi++)
      for (int mode = 0; mode < 4; mode++) { /* 0 plain, 1 odd inputs, 2 odd states, 3 clipped, no decay */
        const size_t n = sizes[si], B = blocks[bi], nb = dopt_q8_num_blocks(n, B);
        float *g = malloc(n * sizeof *g);
        q8copy c[NV];
        for (int v = 0; v < NV; v++) c[v] = q8copy_new(n, nb);
        q8copy_fill(&c[0], mode, &rng);
        if (mode == 0) memset(c[0].q1, 0, n < 64 ? n : 64), memset(c[0].q2, 0, n < 64 ? n : 64);
        for (int v = 1; v < NV; v++) q8copy_set(&c[v], &c[0]);
        dopt_q8_adam_hp hp = {.lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f, .weight_decay = 1e-2f,
                              .gnorm_scale = 1.0f, .step = 1, .block = B};
        if (mode == 3) hp.gnorm_scale = 0.37f, hp.weight_decay = 0.0f, hp.lr = 3e-2f, hp.beta2 = 0.99f;
        for (int t = 1; t <= 3; t++) {
          hp.step = t;
          for (size_t i = 0; i < n; i++)
            g[i] = mode == 1 || mode == 2 ? odd_value(&rng, 1e-2) : (float)(dt_rand_normal(&rng) * 1e-2);
          if (n > 2 * B)
            for (size_t i = B; i < 2 * B; i++) g[i] = 0.0f; /* an all-zero block */
          ref_update(c[0].p, g, c[0].q1, c[0].q2, c[0].a1, c[0].a2, n, &hp, &c[0].bad);
          for (int v = 1; v < NV; v++) {
            if (!have[v]) {
              assert_status(q8copy_update(&c[v], g, &hp, impls[v]), DOPT_ERR_UNSUPPORTED, "not available");
              q8copy_set(&c[v], &c[0]);
              continue;
            }
            assert_ok(q8copy_update(&c[v], g, &hp, impls[v]));
            char ctx[96];
            snprintf(ctx, sizeof ctx, "n=%zu B=%zu mode %d t=%d impl %d", n, B, mode, t, (int)impls[v]);
            q8copy_expect(&c[v], &c[0], ctx);
            compared += n;
          }
        }
        for (int v = 0; v < NV; v++) q8copy_free(&c[v]);
        free(g);
      }
  printf("fast kernels: %zu element updates bitwise equal to the reference (AVX2 %s, AVX-512 %s)\n", compared,
         have[2] ? "tested" : "unavailable", have[3] ? "tested" : "unavailable");
}

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
/* The kernels under a caller's non-default MXCSR (PyTorch's set_flush_denormal
 * sets FTZ and DAZ; a library may change the rounding): the vector kernels then
 * run only their flushed passes. With FTZ|DAZ every implementation still gives
 * the default-mode reference's bits (the flush is ours anyway); with
 * round-toward-zero every implementation gives the portable one's bits under
 * the same mode. The caller's control bits are left as they were. (The fast
 * passes would happen to agree on these data too: the test pins the results
 * and the MXCSR, not the kernels' choice to skip their fast passes.) */
static void test_fast_kernel_mxcsr(void **st) {
  (void)st;
  enum { NV = 4 };
  const dopt_q8_impl impls[NV] = {DOPT_Q8_IMPL_SCALAR, DOPT_Q8_IMPL_AVX2, DOPT_Q8_IMPL_AVX512, DOPT_Q8_IMPL_AUTO};
  const int have[NV] = {1, dopt__q8_have_avx2(), dopt__q8_have_avx512(), 1};
  const unsigned csr0 = _mm_getcsr();
  const unsigned modes[2] = {(csr0 & ~0x3fu) | 0x8040u /* FTZ | DAZ */, (csr0 & ~0x6000u & ~0x3fu) | 0x6000u /* RZ */};
  const size_t n = 4096 + 300, B = 256, nb = dopt_q8_num_blocks(n, B);
  uint64_t rng = 4242;
  size_t compared = 0;
  for (int md = 0; md < 2; md++) {
    float *g = malloc(n * sizeof *g);
    q8copy want = q8copy_new(n, nb), c[NV];
    for (int v = 0; v < NV; v++) c[v] = q8copy_new(n, nb);
    for (size_t i = 0; i < n; i++) {
      want.p[i] = odd_value(&rng, 0.5);
      want.q1[i] = (uint8_t)dt_rand_u64(&rng), want.q2[i] = (uint8_t)dt_rand_u64(&rng);
    }
    for (size_t b = 0; b < nb; b++)
      want.a1[b] = (float)fabs(dt_rand_normal(&rng) * 0.1), want.a2[b] = (float)fabs(dt_rand_normal(&rng) * 1e-3);
    for (int v = 0; v < NV; v++) q8copy_set(&c[v], &want);
    dopt_q8_adam_hp hp = {.lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f, .weight_decay = 1e-2f,
                          .gnorm_scale = 1.0f, .step = 1, .block = B};
    for (int t = 1; t <= 3; t++) {
      hp.step = t;
      for (size_t i = 0; i < n; i++) g[i] = t == 2 ? (float)(dt_rand_normal(&rng) * 1e-2) : odd_value(&rng, 1e-2);
      /* want: FTZ|DAZ: the reference in the default mode; RZ: the portable kernel under RZ (below) */
      if (md == 0) ref_update(want.p, g, want.q1, want.q2, want.a1, want.a2, n, &hp, &want.bad);
      for (int v = 0; v < NV; v++) {
        if (!have[v]) {
          q8copy_set(&c[v], &want);
          continue;
        }
        _mm_setcsr(modes[md]);
        const dopt_status s = q8copy_update(&c[v], g, &hp, impls[v]);
        const unsigned after = _mm_getcsr();
        _mm_setcsr(csr0);
        assert_ok(s);
        assert_int_equal(after & ~0x3fu, modes[md] & ~0x3fu); /* the control bits as the caller set them */
        if (md == 1 && v == 0) q8copy_set(&want, &c[0]); /* RZ: the portable result is what the others must give */
      }
      for (int v = 0; v < NV; v++) {
        if (!have[v]) continue;
        char ctx[64];
        snprintf(ctx, sizeof ctx, "mxcsr %#x t=%d impl %d", modes[md], t, (int)impls[v]);
        q8copy_expect(&c[v], &want, ctx);
        compared += n;
      }
    }
    for (int v = 0; v < NV; v++) q8copy_free(&c[v]);
    q8copy_free(&want);
    free(g);
  }
  printf("non-default MXCSR (FTZ|DAZ, round toward zero): %zu element updates equal (AVX2 %s, AVX-512 %s)\n",
         compared, have[1] ? "tested" : "unavailable", have[2] ? "tested" : "unavailable");
}
#endif

/* dopt_q8_adam_update through the two-phase API, as pieces on several ranks run it: every block cut at up
 * to three random points into sub-runs (the pieces holding its elements), the maxima of each sub-run taken
 * alone (dopt_q8_adam_absmax) and combined by MAX (the padding slots counted by one or two of them: MAX is
 * idempotent), then each sub-run applied (dopt_q8_adam_apply) with the block's old and new absmax. */
static void two_phase_update(float *p, const float *g, uint8_t *q1, uint8_t *q2, float *a1, float *a2, size_t n,
                             const dopt_q8_adam_hp *hp, size_t *bad, uint64_t *rng) {
  const size_t B = hp->block;
  for (size_t b0 = 0, blk = 0; b0 < n; b0 += B, blk++) {
    const size_t valid = n - b0 < B ? n - b0 : B, pad = B - valid;
    size_t cut[5] = {0, 0, 0, 0, valid}, nc = 1 + dt_rand_u64(rng) % 4; /* sub-runs [cut[k], cut[k+1]) */
    for (size_t k = 1; k < nc; k++) cut[k] = (size_t)(dt_rand_u64(rng) % (valid + 1));
    cut[nc] = valid;
    for (size_t i = 1; i < nc; i++) /* sort the inner cuts */
      for (size_t j = i; j > 0 && cut[j] < cut[j - 1]; j--) {
        size_t t = cut[j];
        cut[j] = cut[j - 1], cut[j - 1] = t;
      }
    float m1 = -FLT_MAX, m2 = -FLT_MAX;
    for (size_t k = 0; k < nc; k++) {
      float x1 = -FLT_MAX, x2 = -FLT_MAX;
      const size_t lo = cut[k], len = cut[k + 1] - lo;
      const size_t mypad = k + 1 == nc || dt_rand_u64(rng) % 3 == 0 ? pad : 0; /* the last one, maybe another */
      assert_ok(dopt_q8_adam_absmax(g + b0 + lo, q1 + b0 + lo, q2 + b0 + lo, a1[blk], a2[blk], len, mypad, hp, &x1,
                                    &x2, bad));
      m1 = x1 > m1 ? x1 : m1;
      m2 = x2 > m2 ? x2 : m2;
    }
    for (size_t k = 0; k < nc; k++)
      assert_ok(dopt_q8_adam_apply(p + b0 + cut[k], g + b0 + cut[k], q1 + b0 + cut[k], q2 + b0 + cut[k], a1[blk],
                                   a2[blk], m1, m2, cut[k + 1] - cut[k], hp));
    a1[blk] = m1, a2[blk] = m2;
  }
}

/* The two-phase API is the fused kernel, bit for bit, on the inputs of test_fast_kernel_bitwise (odd values,
 * odd absmax states, clipping, partial last blocks), over chained steps; and its arguments are checked. */
static void test_two_phase_bitwise(void **st) {
  (void)st;
  const size_t sizes[] = {64, 100, 4096 + 300, 9000};
  const size_t blocks[] = {64, 256, 2048};
  uint64_t rng = 91;
  size_t compared = 0;
  for (size_t si = 0; si < sizeof sizes / sizeof *sizes; si++)
    for (size_t bi = 0; bi < sizeof blocks / sizeof *blocks; bi++)
      for (int mode = 0; mode < 4; mode++) { /* 0 plain, 1 odd inputs, 2 odd states, 3 clipped, no decay */
        const size_t n = sizes[si], B = blocks[bi], nb = dopt_q8_num_blocks(n, B);
        float *g = malloc(n * sizeof *g);
        q8copy c[2] = {q8copy_new(n, nb), q8copy_new(n, nb)};
        q8copy_fill(&c[0], mode, &rng);
        q8copy_set(&c[1], &c[0]);
        dopt_q8_adam_hp hp = {.lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f, .weight_decay = 1e-2f,
                              .gnorm_scale = 1.0f, .step = 1, .block = B};
        if (mode == 3) hp.gnorm_scale = 0.37f, hp.weight_decay = 0.0f, hp.lr = 3e-2f, hp.beta2 = 0.99f;
        for (int t = 1; t <= 3; t++) {
          hp.step = t;
          for (size_t i = 0; i < n; i++)
            g[i] = mode == 1 || mode == 2 ? odd_value(&rng, 1e-2) : (float)(dt_rand_normal(&rng) * 1e-2);
          assert_ok(dopt_q8_adam_update(c[0].p, g, c[0].q1, c[0].q2, c[0].a1, c[0].a2, n, &hp, &c[0].bad));
          c[1].bad = 0; /* two_phase_update adds to it */
          two_phase_update(c[1].p, g, c[1].q1, c[1].q2, c[1].a1, c[1].a2, n, &hp, &c[1].bad, &rng);
          char ctx[64];
          snprintf(ctx, sizeof ctx, "n=%zu B=%zu mode %d t=%d", n, B, mode, t);
          q8copy_expect(&c[1], &c[0], ctx);
          compared += n;
        }
        q8copy_free(&c[0]), q8copy_free(&c[1]);
        free(g);
      }
  /* the arguments: more slots than a block, a bad block, NULL arrays */
  dopt_q8_adam_hp hp = {.lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f, .step = 1, .block = 64};
  float x = 0.0f, m1 = 0.0f, m2 = 0.0f;
  uint8_t b = 0;
  assert_status(dopt_q8_adam_absmax(&x, &b, &b, 1.0f, 1.0f, 60, 5, &hp, &m1, &m2, NULL), DOPT_ERR_INVALID_ARG,
                "pad=5");
  assert_status(dopt_q8_adam_apply(&x, &x, &b, &b, 1.0f, 1.0f, 1.0f, 1.0f, 65, &hp), DOPT_ERR_INVALID_ARG, "n=65");
  assert_status(dopt_q8_adam_absmax(NULL, &b, &b, 1.0f, 1.0f, 1, 0, &hp, &m1, &m2, NULL), DOPT_ERR_INVALID_ARG,
                "NULL");
  hp.block = 100;
  assert_status(dopt_q8_adam_apply(&x, &x, &b, &b, 1.0f, 1.0f, 1.0f, 1.0f, 1, &hp), DOPT_ERR_INVALID_ARG,
                "block=100");
  printf("two-phase kernel: %zu element updates bitwise equal to the fused kernel\n", compared);
}

typedef struct posts {
  double *x[4];
  size_t n[4];
  int count;
} posts;
static dopt_status rec_max(void *ctx, double *x, size_t n) {
  posts *p = ctx;
  p->x[p->count] = x, p->n[p->count++] = n;
  return DOPT_OK;
}
static dopt_status rec_sum(void *ctx, int64_t *x, size_t n) {
  (void)ctx, (void)x, (void)n;
  return DOPT_ERR_STATE; /* adamw8bit without percentile clipping posts no sum */
}

/* The piecewise step (ref/adamw8bit.c) on four pieces of one [150] tensor cut inside its blocks of 64, each
 * with its own copy of the blocks it touches and the shared-block list {0, 1, 2}, driven as distributed/
 * drives it (stage 0, a MAX over the four posts, stage 1), is the whole-tensor step bit for bit: parameters,
 * codes, and every piece's copy of every absmax. Twice: random states and gradients; and zero gradients with
 * every code at 127 (m = 0) under absmax 1, where only the last block's padding slots (byte 128) give the new
 * absmax1 (beta1 * code1[128]): the piece holding the end of the tensor must count them. A piece that cuts a
 * block without a shared list is refused. */
static void test_piecewise_step_shared_blocks(void **st) {
  (void)st;
  enum { N = 150, B = 64, NB = 3, NPC = 4 };
  const size_t lo[NPC + 1] = {0, 50, 100, 140, N};
  const size_t idx[3] = {0, 1, 2};
  const dopt_optim_impl *im = dopt_find_impl("adamw8bit");
  dopt_optim *o = NULL;
  assert_ok(dopt_optim_create("adamw8bit", "lr=1e-2,block_size=64,min_8bit_size=16,weight_decay=0.01", &o));
  const double *hp = dopt__optim_group_hp(o, 0);
  uint64_t rng = 4;
  for (int pass = 0; pass < 2; pass++) {
    float p[N], g[N], a1[NB], a2[NB], pp[N];
    uint8_t q1[N], q2[N], pq1[N], pq2[N];
    for (size_t i = 0; i < N; i++) {
      p[i] = (float)dt_rand_normal(&rng);
      g[i] = pass ? 0.0f : (float)(dt_rand_normal(&rng) * 1e-2);
      q1[i] = pass ? 127 : (uint8_t)dt_rand_u64(&rng), q2[i] = pass ? 0 : (uint8_t)dt_rand_u64(&rng);
    }
    for (int b = 0; b < NB; b++) a1[b] = pass ? 1.0f : (float)fabs(dt_rand_normal(&rng)), a2[b] = 1.0f;
    memcpy(pp, p, sizeof p), memcpy(pq1, q1, sizeof q1), memcpy(pq2, q2, sizeof q2);
    float pa1[NPC][NB], pa2[NPC][NB]; /* each piece's blocks, from its first */
    size_t first[NPC], nblk[NPC];
    for (int k = 0; k < NPC; k++) {
      first[k] = lo[k] / B, nblk[k] = (lo[k + 1] - 1) / B - first[k] + 1;
      for (size_t t = 0; t < nblk[k]; t++) pa1[k][t] = a1[first[k] + t], pa2[k][t] = a2[first[k] + t];
    }
    /* the whole tensor */
    const int64_t shape[1] = {N};
    dopt_piece whole;
    dopt_piece_full(1, shape, &whole);
    unsigned char fw[64], fp[NPC][64];
    assert_true(im->frame(hp, &whole) <= sizeof fw);
    void *sw[4] = {q1, q2, a1, a2};
    int more = 0;
    dopt_step_args a = {.impl = im, .hp = hp, .step = 1, .piece = &whole, .param = p, .grad = g, .state = sw,
                        .frame = fw, .more = &more};
    assert_ok(dopt__run_stages(NULL, &a));
    /* the pieces */
    dopt_piece pc[NPC];
    double mx[NPC][6];
    dopt_block_share sh[NPC];
    posts ps = {{NULL}, {0}, 0};
    dopt_reducer red = {&ps, rec_max, rec_sum};
    dopt_step_args pa[NPC];
    int pmore[NPC];
    void *stp[NPC][4];
    for (int k = 0; k < NPC; k++) {
      pc[k] = whole, pc[k].lo = lo[k], pc[k].len = lo[k + 1] - lo[k];
      sh[k] = (dopt_block_share){B, 3, idx, mx[k]};
      stp[k][0] = pq1 + lo[k], stp[k][1] = pq2 + lo[k], stp[k][2] = pa1[k], stp[k][3] = pa2[k];
      pa[k] = (dopt_step_args){.impl = im, .hp = hp, .step = 1, .piece = &pc[k], .param = pp + lo[k],
                               .grad = g + lo[k], .state = stp[k], .frame = fp[k], .red = &red, .more = &pmore[k],
                               .shared = &sh[k]};
      pmore[k] = 0;
      assert_ok(im->step(&pa[k]));
      assert_int_equal(pmore[k], 1);
    }
    assert_int_equal(ps.count, NPC);
    for (int e = 0; e < 6; e++) { /* the MAX a collective does */
      double m = -INFINITY;
      for (int k = 0; k < NPC; k++) m = ps.x[k][e] > m ? ps.x[k][e] : m;
      for (int k = 0; k < NPC; k++) ps.x[k][e] = m;
    }
    for (int k = 0; k < NPC; k++) {
      pa[k].stage = 1, pmore[k] = 0;
      assert_ok(im->step(&pa[k]));
      assert_int_equal(pmore[k], 0);
    }
    for (size_t i = 0; i < N; i++)
      if (!same_param(pp[i], p[i]) || pq1[i] != q1[i] || pq2[i] != q2[i])
        fail_msg("pass %d element %zu: p %a/%a bytes %d,%d / %d,%d", pass, i, (double)pp[i], (double)p[i], pq1[i],
                 pq2[i], q1[i], q2[i]);
    for (int k = 0; k < NPC; k++)
      for (size_t t = 0; t < nblk[k]; t++)
        if (memcmp(&pa1[k][t], &a1[first[k] + t], 4) || memcmp(&pa2[k][t], &a2[first[k] + t], 4))
          fail_msg("pass %d piece %d: block %zu absmax %a, %a; whole %a, %a", pass, k, first[k] + t,
                   (double)pa1[k][t], (double)pa2[k][t], (double)a1[first[k] + t], (double)a2[first[k] + t]);
    if (pass == 1) { /* the padding decided it */
      const float want = 0.9f * (dopt_q8_map(1)[128] * 1.0f);
      assert_memory_equal(&a1[2], &want, 4);
    }
  }
  /* a cut block without a shared list */
  const int64_t shape[1] = {N};
  dopt_piece half;
  dopt_piece_full(1, shape, &half);
  half.lo = 50, half.len = 100;
  float p[N] = {0}, g[N] = {0}, a1[NB] = {0}, a2[NB] = {0};
  uint8_t q1[N] = {0}, q2[N] = {0};
  void *sw[4] = {q1, q2, a1, a2};
  unsigned char fw[64];
  int more = 0;
  dopt_step_args a = {.impl = im, .hp = hp, .step = 1, .piece = &half, .param = p, .grad = g, .state = sw,
                      .frame = fw, .more = &more};
  assert_status(im->step(&a), DOPT_ERR_STATE, "part of block 0");
  dopt_optim_destroy(o);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_against_oracle),     cmocka_unit_test(test_zero_block_and_padding),
      cmocka_unit_test(test_decay_after),        cmocka_unit_test(test_fp32_nan_propagates),
      cmocka_unit_test(test_percentile_clipping), cmocka_unit_test(test_memory),
      cmocka_unit_test(test_hparams),             cmocka_unit_test(test_fast_kernel_bitwise),
      cmocka_unit_test(test_two_phase_bitwise),
#if defined(__x86_64__) || defined(__i386__)
      cmocka_unit_test(test_fast_kernel_mxcsr),
#endif
      cmocka_unit_test(test_piecewise_step_shared_blocks),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
