/* Regression tests for the distributed optimizers: one test per known failure
 * class of distributed Adafactor/CAME/LAMB/AdamW (statistics over the wrong
 * extent, replicated parameters in the grad norm, world vs dp size, padding
 * in RMS, CAME state aliasing, empty TP ranks). Each test
 *   (1) proves that its scenario *discriminates*: computed here from the same
 *       inputs (dt_gradient, the reference's checkpointed parameters and
 *       states, dopt_xsum*), the known buggy computation gives a value that
 *       differs from the correct one far above rounding; where possible the
 *       correct value is first checked bitwise against the reference's own
 *       state, so the discriminator is tied to what the reference computes;
 *   (2) runs the distributed optimizer on the simulator in that scenario and
 *       requires bitwise equality with the single-device reference (every
 *       parameter, state and step counter at every checkpoint).
 * Assertions run on the main thread only (the harness returns results). */
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "disttest.h"
#include "registry.h"
#include "distopt/dpsum.h"
#include "optim_impl.h"
#include "distopt/optim.h"
#include "distopt/xsum.h"

#define STEPS 8

/* Tolerance of every discriminating check: the statistics compared here are
 * exact sums (xsum, error < 2^-30 relative) rounded once or a few times to
 * fp32 (~6e-8 relative each), so rounding explains at most ~1e-6 relative.
 * Requiring a relative difference of 1e-2 (0.1% for the padding class, whose
 * effect is sqrt(36/35) - 1 = 1.4%) is >= 10^3 times any rounding effect. */
#define DISCRIM 1e-2

/* ---- helpers ------------------------------------------------------------------------ */

static size_t nel(const dt_param *p) {
  size_t n = 1;
  for (int i = 0; i < p->ndim; i++) n *= (size_t)p->shape[i];
  return n;
}

/* The uneven split of dist.h: part r of n items over `parts`. */
static void split(size_t n, int parts, int r, size_t *off, size_t *len) {
  size_t base = n / (size_t)parts, rem = n % (size_t)parts, ur = (size_t)r;
  *len = base + (ur < rem);
  *off = ur * base + (ur < rem ? ur : rem);
}

/* The averaged gradient the reference steps on at step t (before clipping),
 * computed exactly as the harness does: per dp rank g_0 + g_1 + ..., their
 * dp sum (dopt_dp_sum, the case's mode), divided once by dp·micro. */
static float *avg_grad(const dt_case *c, int p, int t, int dp) {
  size_t n = nel(&c->params[p]), n1 = n ? n : 1;
  float *out = calloc(n1, sizeof *out), *g = malloc(n1 * sizeof *g), *acc = calloc((size_t)dp * n1, sizeof *acc);
  const float *parts[DT_MAXRANKS];
  assert_non_null(out);
  assert_non_null(g);
  assert_non_null(acc);
  for (int d = 0; d < dp; d++) {
    float *a = acc + (size_t)d * n1;
    for (int m = 0; m < c->micro; m++) {
      dt_gradient(c, p, t, m, d, g);
      for (size_t k = 0; k < n; k++) a[k] = a[k] + g[k];
    }
    parts[d] = a;
  }
  assert_int_equal(dopt_dp_sum(parts, dp, dt_dp_words(c), n, out), DOPT_OK);
  const float denom = (float)((double)dp * (double)c->micro);
  for (size_t k = 0; k < n; k++) out[k] = out[k] / denom;
  free(g);
  free(acc);
  return out;
}

static int state_idx(const dt_result *r, int p, const char *name) {
  for (int k = 0; k < r->nstates[p]; k++)
    if (strcmp(r->state_name[p][k], name) == 0) return k;
  fail_msg("parameter %d has no state '%s'", p, name);
  return -1;
}

/* max_i |a_i - b_i| / max(|a_i|, |b_i|) (pairs of zeros skipped) */
static double max_rel(const float *a, const float *b, size_t n) {
  double worst = 0.0;
  for (size_t i = 0; i < n; i++) {
    double x = (double)a[i], y = (double)b[i], den = fmax(fabs(x), fabs(y));
    if (den > 0.0 && fabs(x - y) / den > worst) worst = fabs(x - y) / den;
  }
  return worst;
}

/* max_rel of a/mean(a) and b/mean(b): a difference that no global rescaling
 * of the statistic explains (Adafactor/CAME use row/mean(row)). */
static double shape_rel(const float *a, const float *b, size_t n) {
  double sa = 0, sb = 0;
  for (size_t i = 0; i < n; i++) sa += (double)a[i], sb += (double)b[i];
  float *na = malloc(n * sizeof *na), *nb = malloc(n * sizeof *nb);
  assert_non_null(na);
  assert_non_null(nb);
  for (size_t i = 0; i < n; i++) {
    na[i] = (float)((double)a[i] / (sa / (double)n));
    nb[i] = (float)((double)b[i] / (sb / (double)n));
  }
  double r = max_rel(na, nb, n);
  free(na);
  free(nb);
  return r;
}

static int bits_equal(const float *a, const float *b, size_t n) { return memcmp(a, b, n * sizeof *a) == 0; }

/* RMS from an exact sum of squares, as the reference (core/stats.c): fp32
 * norm divided by fp32 sqrt(count). */
static float rms_from_ss(double ss, size_t count) { return (float)sqrt(ss) / (float)sqrt((double)count); }

/* Runs layout l and requires bitwise equality with ref (the reference at l->dp). */
static void expect_bitwise(const dt_case *c, const dt_layout *l, const dt_result *ref) {
  dt_result got;
  dt_expect(&got, ref);
  char err[512] = "", msg[512] = "";
  dopt_status s = dt_run_dist(c, l, &got, err, sizeof err);
  if (s != DOPT_OK) fail_msg("%s tp%d dp%d zero%d (%s): %s", c->optimizer, l->tp, l->dp, l->zero, dt_plugin(l), err);
  if (dt_compare(c, ref, &got, msg, sizeof msg)) {
    dt_result_free(&got);
    fail_msg("%s [%s] tp%d dp%d zero%d (%s): not bitwise equal: %s", c->optimizer, c->hparams ? c->hparams : "", l->tp,
             l->dp, l->zero, dt_plugin(l), msg);
  }
  dt_result_free(&got);
}

/* Bitwise equality on every layout (one reference per dp). */
static void expect_bitwise_all(const dt_case *c, const dt_layout *lays, int n) {
  dt_result ref[5];
  int have[5] = {0};
  for (int i = 0; i < n; i++) {
    int dp = lays[i].dp;
    if (!have[dp]) {
      assert_ok(dt_run_reference(c, dp, &ref[dp]));
      have[dp] = 1;
    }
    expect_bitwise(c, &lays[i], &ref[dp]);
  }
  for (int d = 0; d < 5; d++)
    if (have[d]) dt_result_free(&ref[d]);
}

/* U = g² + eps1 of a gradient, as Adafactor/CAME form it */
static float *sq_plus(const float *g, size_t n, float eps1) {
  float *u = malloc(n * sizeof *u);
  assert_non_null(u);
  for (size_t i = 0; i < n; i++) u[i] = g[i] * g[i] + eps1;
  return u;
}

/* exact row means of U [h, w] over the whole width, fp32 as the reference */
static void row_means(const float *u, size_t h, size_t w, float *out) {
  for (size_t i = 0; i < h; i++) out[i] = (float)(dopt_xsum(u + i * w, w) / (double)w);
}

/* exact column means of U [h, w] over all h rows */
static void col_means(const float *u, size_t h, size_t w, float *out) {
  float *col = malloc(h * sizeof *col);
  assert_non_null(col);
  for (size_t j = 0; j < w; j++) {
    for (size_t i = 0; i < h; i++) col[i] = u[i * w + j];
    out[j] = (float)(dopt_xsum(col, h) / (double)h);
  }
  free(col);
}

/* the factored preconditioner of core/stats.c on a whole [b, h, w] tensor:
 * out = (rsqrt(row / mean_h(row)) · rsqrt(col)) · x */
static void factored_apply(const float *row, const float *col, const float *x, size_t b, size_t h, size_t w, float *out) {
  for (size_t bi = 0; bi < b; bi++) {
    float rmean = (float)(dopt_xsum(row + bi * h, h) / (double)h);
    for (size_t i = 0; i < h; i++) {
      float rf = 1.0f / sqrtf(row[bi * h + i] / rmean);
      for (size_t j = 0; j < w; j++) {
        size_t k = (bi * h + i) * w + j;
        out[k] = (rf * (1.0f / sqrtf(col[bi * w + j]))) * x[k];
      }
    }
  }
}

/* row/column means of every batch of a [b, h, w] tensor */
static void rowcol_means(const float *u, size_t b, size_t h, size_t w, float *rows, float *cols) {
  for (size_t bi = 0; bi < b; bi++) {
    row_means(u + bi * h * w, h, w, rows + bi * h);
    col_means(u + bi * h * w, h, w, cols + bi * w);
  }
}

/* ---- 1. row mean with the local length (Adafactor, ROW split) ------------------------------ */

static const dt_param P_ROWMEAN[] = {
    {"w86", 2, {8, 6}, DOPT_TP_ROW, 0},
    {"w87", 2, {8, 7}, DOPT_TP_ROW, 0},
};

static void test_row_mean_row_split(void **st) {
  (void)st;
  const dt_case c = {"adafactor", "beta1=0.9,weight_decay=0.01", NULL, P_ROWMEAN, 2, STEPS, 1, 0.0, 0, 101, 0.05, 0, 1, 0, 0, 0, 0, 0};
  dt_result ref;
  assert_ok(dt_run_reference(&c, 1, &ref));
  /* w86 at tp = 2 (3 + 3 columns), w87 at tp = 4 (2, 2, 2, 1 columns) */
  const int scen[2][2] = {{0, 2}, {1, 4}};
  for (int s = 0; s < 2; s++) {
    const int p = scen[s][0], tp = scen[s][1];
    const size_t h = 8, w = (size_t)P_ROWMEAN[p].shape[1];
    float *g = avg_grad(&c, p, 1, 1), *u = sq_plus(g, h * w, 1e-30f);
    float correct[8], bug_local[8], bug_full[8];
    row_means(u, h, w, correct);
    /* step 1: beta2_t = 1 - 1^decay = 0, so exp_avg_sq_row is the row mean itself */
    if (!bits_equal(correct, ref.state[0][p][state_idx(&ref, p, "exp_avg_sq_row")], h))
      fail_msg("%s: the exact row mean is not the reference's exp_avg_sq_row at step 1", P_ROWMEAN[p].name);
    for (int r = 0; r < tp; r++) {
      size_t off, len;
      split(w, tp, r, &off, &len);
      for (size_t i = 0; i < h; i++) {
        double part = dopt_xsum(u + i * w + off, len);
        bug_local[i] = (float)(part / (double)len); /* Σ local columns / local width */
        bug_full[i] = (float)(part / (double)w);    /* partial sum / full width */
      }
      /* the raw statistic (a state) and its shape row/mean(row), which scales the update */
      double d_full = max_rel(correct, bug_full, h), d_local = shape_rel(correct, bug_local, h);
      if (d_full < DISCRIM || d_local < DISCRIM)
        fail_msg("%s tp%d rank %d: buggy row means too close (partial/W %.3g, row/mean(row) of local mean %.3g)",
                 P_ROWMEAN[p].name, tp, r, d_full, d_local);
    }
    free(g);
    free(u);
  }
  static const dt_layout lays[] = {{2, 1, 0, 0}, {4, 1, 0, 0}, {4, 2, 2, 0}, {2, 2, 3, 0}};
  expect_bitwise(&c, &lays[0], &ref);
  expect_bitwise(&c, &lays[1], &ref);
  dt_result_free(&ref);
  expect_bitwise_all(&c, lays + 2, 2);
}

/* ---- 2. LAMB trust ratio per shard (COLUMN split) ------------------------------------------ */

static const dt_param P_LAMB[] = {
    {"p86", 2, {8, 6}, DOPT_TP_COLUMN, 0},
    {"q76", 2, {7, 6}, DOPT_TP_COLUMN, 0}, /* uneven: 4 + 3 rows */
    {"bias", 1, {6}, DOPT_TP_COLUMN, 1},
};

static void test_lamb_trust_ratio_per_shard(void **st) {
  (void)st;
  const double lr = 5e-2, b1 = 0.9, b2 = 0.999, eps = 1e-6, wd = 0.01;
  const dt_case c = {"lamb", "lr=5e-2,bias_correction=true,weight_decay=0.01", NULL, P_LAMB, 3, STEPS, 1, 0.0, 0, 207,
                     0.05, 0, 1, 0, 0, 0, 0, 0};
  dt_result ref;
  assert_ok(dt_run_reference(&c, 1, &ref));
  const int p = 0;
  const size_t h = 8, w = 6, n = h * w;
  const int im = state_idx(&ref, p, "exp_avg"), iv = state_idx(&ref, p, "exp_avg_sq");
  double worst_trust = 1.0, worst_param = 1.0;
  /* step t from the reference's own parameter and moments after step t-1 */
  for (int t = 2; t <= STEPS; t++) {
    const float *w0 = ref.param[t - 2][p], *m0 = ref.state[t - 2][p][im], *v0 = ref.state[t - 2][p][iv];
    float *g = avg_grad(&c, p, t, 1), u[48], pred[48], m[48], v[48];
    /* mirror of ref/lamb.c (no FMA contraction: -ffp-contract=off everywhere) */
    for (size_t i = 0; i < n; i++) {
      m[i] = m0[i] * (float)b1 + (float)(1.0 - b1) * g[i];
      v[i] = v0[i] * (float)b2 + ((float)(1.0 - b2) * g[i]) * g[i];
      u[i] = m[i] / (sqrtf(v[i]) + (float)eps) + (float)wd * w0[i];
    }
    double lrt = lr * sqrt(1.0 - pow(b2, (double)t)) / (1.0 - pow(b1, (double)t));
    float trust = (float)sqrt(dopt_xsum_sq(w0, n)) / (float)sqrt(dopt_xsum_sq(u, n));
    for (size_t i = 0; i < n; i++) pred[i] = w0[i] + ((float)(-lrt) * trust) * u[i];
    if (!bits_equal(pred, ref.param[t - 1][p], n)) fail_msg("step %d: the whole-tensor trust ratio does not reproduce the reference", t);
    /* buggy: ‖p_shard‖/‖u_shard‖ on each TP rank's rows */
    float tr[2];
    for (int r = 0; r < 2; r++) {
      size_t off, len;
      split(h, 2, r, &off, &len);
      const float *ws = w0 + off * w, *us = u + off * w;
      tr[r] = (float)sqrt(dopt_xsum_sq(ws, len * w)) / (float)sqrt(dopt_xsum_sq(us, len * w));
      double dt = fabs((double)tr[r] / (double)trust - 1.0);
      worst_trust = dt < worst_trust ? dt : worst_trust;
      double dp = 0.0; /* the parameter the buggy ratio gives, relative to this step's update */
      for (size_t i = off * w; i < (off + len) * w; i++) {
        float bug = w0[i] + ((float)(-lrt) * tr[r]) * u[i];
        double upd = fabs((double)pred[i] - (double)w0[i]);
        if (upd > 0) dp = fmax(dp, fabs((double)bug - (double)pred[i]) / upd);
      }
      worst_param = dp < worst_param ? dp : worst_param;
    }
    free(g);
  }
  /* halves with different ‖p‖/‖u‖ (seed 207: every shard's ratio is >= 13%
   * off at every step): each shard's ratio, and the update it gives, differ
   * from the whole-tensor one at every step */
  if (worst_trust < DISCRIM || worst_param < DISCRIM)
    fail_msg("per-shard trust ratio too close to the whole-tensor one (ratio %.3g, update %.3g)", worst_trust, worst_param);
  static const dt_layout lays[] = {{2, 1, 0, 0}, {2, 1, 2, 0}, {2, 2, 1, 0}, {2, 2, 3, 0}};
  expect_bitwise(&c, &lays[0], &ref);
  expect_bitwise(&c, &lays[1], &ref);
  dt_result_free(&ref);
  expect_bitwise_all(&c, lays + 2, 2);
}

/* ---- 3. column statistics block-local under ZeRO (Adafactor, CAME) ------------------------------ */

static const dt_param P_ZCOL[] = {
    {"a85", 2, {8, 5}, DOPT_TP_REPLICATED, 0}, /* dp 2: shards are rows 0-3 / 4-7 */
    {"b75", 2, {7, 5}, DOPT_TP_REPLICATED, 0}, /* dp 3: chunk 12 cuts rows 2 and 4 mid-row */
};

static void zero_col_case(const char *opt, const char *hp, float omb2) {
  const dt_case c = {opt, hp, NULL, P_ZCOL, 2, STEPS, 1, 0.0, 0, 303, 0.05, 0, 1, 0, 0, 0, 0, 0};
  const int scen[2][2] = {{0, 2}, {1, 3}}; /* param, dp */
  for (int s = 0; s < 2; s++) {
    const int p = scen[s][0], dp = scen[s][1];
    const size_t h = (size_t)P_ZCOL[p].shape[0], w = 5, n = h * w, chunk = (n + (size_t)dp - 1) / (size_t)dp;
    dt_result ref;
    assert_ok(dt_run_reference(&c, dp, &ref));
    float *g = avg_grad(&c, p, 1, dp), *u = sq_plus(g, n, 1e-30f), correct[5], expect[5];
    col_means(u, h, w, correct);
    /* step 1 state: 0·β + (1-β)·mean (Adafactor: 1-β2_1 = 1) */
    for (size_t j = 0; j < w; j++) expect[j] = 0.0f * (1.0f - omb2) + omb2 * correct[j];
    if (!bits_equal(expect, ref.state[0][p][state_idx(&ref, p, "exp_avg_sq_col")], w))
      fail_msg("%s %s: the exact column mean is not the reference's exp_avg_sq_col at step 1", opt, P_ZCOL[p].name);
    for (int r = 0; r < dp; r++) {
      size_t lo = (size_t)r * chunk, hi = lo + chunk < n ? lo + chunk : n;
      float bug[5], colv[8];
      for (size_t j = 0; j < w; j++) {
        size_t k = 0;
        for (size_t e = lo; e < hi; e++)
          if (e % w == j) colv[k++] = u[e];
        assert_true(k > 0);
        bug[j] = (float)(dopt_xsum(colv, k) / (double)k); /* mean over this shard's rows only */
      }
      double d_raw = max_rel(correct, bug, w), d_shape = shape_rel(correct, bug, w);
      if (d_raw < DISCRIM || d_shape < DISCRIM)
        fail_msg("%s %s dp%d shard %d: block-local column mean too close (%.3g, shape %.3g)", opt, P_ZCOL[p].name, dp, r,
                 d_raw, d_shape);
    }
    free(g);
    free(u);
    const dt_layout lays[2] = {{1, dp, 2, 0}, {1, dp, dp == 2 ? 1 : 3, 1}};
    expect_bitwise(&c, &lays[0], &ref);
    expect_bitwise(&c, &lays[1], &ref);
    dt_result_free(&ref);
  }
}

static void test_zero_column_stats_adafactor(void **st) {
  (void)st;
  zero_col_case("adafactor", "beta1=0.9,weight_decay=0.01", 1.0f);
}

static void test_zero_column_stats_came(void **st) {
  (void)st;
  zero_col_case("came", "lr=1e-3,weight_decay=0.01", (float)(1.0 - 0.999));
}

/* ---- 4. replicated parameters counted tp times in the global grad norm ---------------------------- */

static const dt_param P_CLIP[] = {
    {"big", 2, {16, 16}, DOPT_TP_REPLICATED, 0}, /* dominates the norm */
    {"col", 2, {6, 4}, DOPT_TP_COLUMN, 0},
    {"row", 2, {4, 6}, DOPT_TP_ROW, 0},
    {"ln", 1, {5}, DOPT_TP_REPLICATED, 1},
};
#define NCLIP 4

static void test_grad_norm_replicated_once(void **st) {
  (void)st;
  const dt_case c = {"adamw", "lr=1e-2,weight_decay=0.01", NULL, P_CLIP, NCLIP, STEPS, 2, 0.05, 0, 404, 0.05, 0, 1, 0, 0, 0, 0, 0};
  static const dt_layout lays[] = {{2, 1, 0, 0}, {4, 1, 1, 0}, {2, 2, 2, 0}, {2, 2, 3, 0}};
  for (int li = 0; li < 4; li++) {
    const dt_layout *l = &lays[li];
    double worst = 1.0, maxcoef = 0.0;
    for (int t = 1; t <= STEPS; t++) {
      double ss[NCLIP], bug[NCLIP];
      float *g[NCLIP];
      for (int p = 0; p < NCLIP; p++) {
        g[p] = avg_grad(&c, p, t, l->dp);
        ss[p] = dopt_xsum_sq(g[p], nel(&P_CLIP[p]));
        bug[p] = P_CLIP[p].role == DOPT_TP_REPLICATED ? ss[p] * l->tp : ss[p]; /* Σ over tp ranks */
      }
      float coef = dopt_clip_coef(ss, NCLIP, c.max_grad_norm, NULL);
      float cbug = dopt_clip_coef(bug, NCLIP, c.max_grad_norm, NULL);
      maxcoef = fmax(maxcoef, (double)coef);
      worst = fmin(worst, fabs((double)cbug / (double)coef - 1.0));
      if (t == 1 && li == 0) {
        /* tie to the reference: its exp_avg after step 1 is (1-β1)·(g·coef) */
        dt_result r1;
        dt_case c1 = c;
        c1.steps = 1;
        assert_ok(dt_run_reference(&c1, l->dp, &r1));
        for (int p = 0; p < NCLIP; p++) {
          size_t n = nel(&P_CLIP[p]);
          const float *m = r1.state[0][p][state_idx(&r1, p, "exp_avg")];
          for (size_t k = 0; k < n; k++) {
            float want = (float)(1.0 - 0.9) * (g[p][k] * coef), wbug = (float)(1.0 - 0.9) * (g[p][k] * cbug);
            if (memcmp(&want, &m[k], sizeof want) != 0) fail_msg("exp_avg of %s[%zu] is not (1-b1)*g*coef", P_CLIP[p].name, k);
            if (g[p][k] != 0.0f && fabs((double)wbug / (double)want - 1.0) < DISCRIM)
              fail_msg("exp_avg of %s[%zu]: buggy coefficient too close", P_CLIP[p].name, k);
          }
        }
        dt_result_free(&r1);
      }
      for (int p = 0; p < NCLIP; p++) free(g[p]);
    }
    /* clipping happens at every step, and the buggy coefficient differs */
    if (!(maxcoef < 1.0)) fail_msg("tp%d dp%d: clipping inactive at some step (coef %.3g)", l->tp, l->dp, maxcoef);
    if (worst < DISCRIM) fail_msg("tp%d dp%d: replicated-counted-tp-times coefficient too close (%.3g)", l->tp, l->dp, worst);
  }
  expect_bitwise_all(&c, lays, 4);
}

/* ---- 5. world size instead of dp size in the gradient average ------------------------------------- */

static const dt_param P_WS[] = {
    {"w", 2, {6, 8}, DOPT_TP_COLUMN, 0},
    {"o", 2, {8, 6}, DOPT_TP_ROW, 0},
    {"b", 1, {7}, DOPT_TP_REPLICATED, 1},
};

static void test_dp_size_not_world_size(void **st) {
  (void)st;
  /* Adam's update m̂/(√v̂ + eps) is scale invariant unless eps matters: with
   * |g| ~ 1e-3 ≪ eps = 1e-2 the update is ≈ g/eps, linear in g. (Clipping
   * would not help: once active, g·max/‖g‖ forgets the scale.) */
  const dt_case c = {"adamw", "lr=1e-2,eps=1e-2,weight_decay=0.01", NULL, P_WS, 3, STEPS, 1, 0.0, 0, 505, 1e-3, 0, 1, 0, 0, 0, 0, 0};
  /* The buggy average Σg/4 (world) instead of Σg/2 (dp) is bitwise the
   * reference fed gradients at half the scale: halving grad_scale halves
   * every dt_gradient exactly (a power of two, no subnormals at 1e-3), the
   * rank-order sum of halves is the half of the sum, and (s/2)/2 = s/4. */
  dt_case cbug = c;
  cbug.grad_scale = c.grad_scale / 2;
  dt_result ref, bug;
  assert_ok(dt_run_reference(&c, 2, &ref));
  assert_ok(dt_run_reference(&cbug, 2, &bug));
  {
    float *g = avg_grad(&c, 0, 1, 2), *gb = avg_grad(&cbug, 0, 1, 2);
    for (size_t k = 0; k < nel(&P_WS[0]); k++) {
      float half = g[k] / 2.0f;
      if (memcmp(&half, &gb[k], sizeof half) != 0) fail_msg("the half-scale gradient is not sum/4 at %zu", k);
    }
    free(g);
    free(gb);
  }
  /* the parameters move by ~lr·g/eps per step; the buggy ones by half that */
  for (int p = 0; p < 3; p++) {
    size_t n = nel(&P_WS[p]);
    const float *a = ref.param[STEPS - 1][p], *b = bug.param[STEPS - 1][p];
    double d = 0.0;
    for (size_t k = 0; k < n; k++) d = fmax(d, fabs((double)a[k] - (double)b[k]));
    /* 1e-4 absolute on parameters |p| < 0.6 is > 800 ULP */
    if (d < 1e-4) fail_msg("%s: dividing by world size changes the parameters by only %.3g", P_WS[p].name, d);
  }
  dt_result_free(&bug);
  static const dt_layout lays[] = {{2, 2, 0, 0}, {2, 2, 1, 0}, {2, 2, 2, 0}, {2, 2, 3, 0}};
  for (int i = 0; i < 4; i++) expect_bitwise(&c, &lays[i], &ref);
  dt_result_free(&ref);
}

/* ---- 6. ZeRO padding counted in RMS (Adafactor update clipping and param RMS) ----------------------- */

static const dt_param P_PAD[] = {
    {"m57", 2, {5, 7}, DOPT_TP_REPLICATED, 0}, /* 35 = 3·12 - 1 */
    {"v10", 1, {10}, DOPT_TP_REPLICATED, 1},   /* 10 = 3·4 - 2 */
};

static void test_padding_not_in_rms(void **st) {
  (void)st;
  const double clip = 0.5;
  const dt_case c = {"adafactor", "clip_threshold=0.5,scale_parameter=true,beta1=0.9", NULL, P_PAD, 2, STEPS, 1, 0.0,
                     0, 606, 0.05, 0, 1, 0, 0, 0, 0, 0};
  const int dp = 3;
  dt_result ref;
  assert_ok(dt_run_reference(&c, dp, &ref));
  for (int p = 0; p < 2; p++) {
    const size_t n = nel(&P_PAD[p]), padded = ((n + (size_t)dp - 1) / (size_t)dp) * (size_t)dp;
    assert_true(padded > n);
    const int irms = state_idx(&ref, p, "RMS");
    /* (a) parameter RMS (scale_parameter): from the reference's parameters
     * after step t, it is the RMS state of step t+1; divided by the padded
     * count it is sqrt(n/padded) smaller, and α = ρ·RMS since RMS > eps2 */
    for (int t = 1; t < STEPS; t++) {
      double ss = dopt_xsum_sq(ref.param[t - 1][p], n);
      float rms = rms_from_ss(ss, n), rbug = rms_from_ss(ss, padded);
      if (memcmp(&rms, ref.state[t][p][irms], sizeof rms) != 0)
        fail_msg("%s: parameter RMS after step %d is not the reference's RMS state", P_PAD[p].name, t);
      if (!(rms > 1e-3f) || fabs((double)rbug / (double)rms - 1.0) < DISCRIM / 10)
        fail_msg("%s step %d: padded parameter RMS not discriminating (%.9g vs %.9g)", P_PAD[p].name, t + 1, (double)rms,
                 (double)rbug);
    }
    /* (b) update RMS at step 1 (β2_1 = 0: the second moment is U itself) */
    float *g = avg_grad(&c, p, 1, dp), *u = sq_plus(g, n, 1e-30f), *upd = malloc(n * sizeof *upd);
    assert_non_null(upd);
    if (P_PAD[p].ndim == 2) {
      float row[5], col[7];
      rowcol_means(u, 1, 5, 7, row, col);
      factored_apply(row, col, g, 1, 5, 7, upd);
    } else {
      for (size_t k = 0; k < n; k++) upd[k] = (1.0f / sqrtf(u[k])) * g[k];
    }
    double uss = dopt_xsum_sq(upd, n);
    float urms = rms_from_ss(uss, n), ubug = rms_from_ss(uss, padded);
    /* clipping is active with both counts (so the divisor is the RMS itself),
     * and the two divisors differ by sqrt(padded/n) */
    if (!(ubug / (float)clip > 1.0f) || fabs((double)ubug / (double)urms - 1.0) < DISCRIM / 10)
      fail_msg("%s: update RMS %.6g (padded %.6g) does not discriminate at clip %.2g", P_PAD[p].name, (double)urms,
               (double)ubug, clip);
    free(g);
    free(u);
    free(upd);
  }
  static const dt_layout lays[] = {{1, 3, 2, 0}, {1, 3, 1, 0}, {1, 3, 3, 0}, {2, 3, 2, 0}};
  for (int i = 0; i < 4; i++) expect_bitwise(&c, &lays[i], &ref);
  dt_result_free(&ref);
}

/* ---- 7. CAME: second-moment and residual statistics are separate tensors -------------------------- */

static const dt_param P_CAME[] = {
    {"c65", 2, {6, 5}, DOPT_TP_COLUMN, 0},
    {"r47", 2, {4, 7}, DOPT_TP_ROW, 0},
    {"t235", 3, {2, 3, 5, 0}, DOPT_TP_REPLICATED, 0},
};

static void came_distinct(const dt_case *c, const dt_result *r, const char *who) {
  static const char *const pairs[2][2] = {{"exp_avg_sq_row", "exp_avg_res_row"}, {"exp_avg_sq_col", "exp_avg_res_col"}};
  for (int ck = 0; ck < r->nck; ck++) {
    if (r->ck_step[ck] < 3) continue;
    for (int p = 0; p < c->nparams; p++) {
      const dt_param *pp = &c->params[p];
      size_t b = pp->ndim == 3 ? (size_t)pp->shape[0] : 1;
      for (int k = 0; k < 2; k++) {
        size_t len = b * (size_t)pp->shape[pp->ndim - 2 + k];
        const float *sq = r->state[ck][p][state_idx(r, p, pairs[k][0])], *res = r->state[ck][p][state_idx(r, p, pairs[k][1])];
        /* aliasing would make them bitwise identical: no element may be, and
         * the vectors must differ far above rounding */
        for (size_t i = 0; i < len; i++)
          if (memcmp(&sq[i], &res[i], sizeof(float)) == 0)
            fail_msg("%s step %d: %s %s[%zu] and %s are bitwise equal (%.9g)", who, r->ck_step[ck], pp->name,
                     pairs[k][0], i, pairs[k][1], (double)sq[i]);
        for (size_t i = 0; i < len; i++) /* G² + eps1 > 0 and Res ≥ eps2 > 0: both written */
          if (!(sq[i] > 0.0f) || !(res[i] > 0.0f))
            fail_msg("%s step %d: %s %s/%s[%zu] not positive (%.9g, %.9g)", who, r->ck_step[ck], pp->name, pairs[k][0],
                     pairs[k][1], i, (double)sq[i], (double)res[i]);
        if (max_rel(sq, res, len) < DISCRIM)
          fail_msg("%s step %d: %s %s and %s too close", who, r->ck_step[ck], pp->name, pairs[k][0], pairs[k][1]);
      }
    }
  }
}

/* The step-1 statistics of CAME on the whole tensor, mirroring ref/came.c
 * (hyperparameters of the case below: defaults but lr, wd): row/column of
 * G² + eps1 and of the residual Res = (Û - m)² + eps2. */
static void came_step1_stats(const dt_case *c, int p, int dp, float *sq_row, float *sq_col, float *res_row,
                             float *res_col) {
  const dt_param *pp = &c->params[p];
  const size_t b = pp->ndim == 3 ? (size_t)pp->shape[0] : 1, h = (size_t)pp->shape[pp->ndim - 2],
               w = (size_t)pp->shape[pp->ndim - 1], n = b * h * w;
  const float b1 = 0.9f, omb1 = (float)(1.0 - 0.9), omb2 = (float)(1.0 - 0.999), omb3 = (float)(1.0 - 0.9999);
  float *g = avg_grad(c, p, 1, dp), *u = sq_plus(g, n, 1e-30f), *upd = malloc(n * sizeof *upd);
  float rm[16], cm[16];
  assert_non_null(upd);
  rowcol_means(u, b, h, w, rm, cm);
  for (size_t i = 0; i < b * h; i++) sq_row[i] = 0.0f * 0.999f + omb2 * rm[i];
  for (size_t i = 0; i < b * w; i++) sq_col[i] = 0.0f * 0.999f + omb2 * cm[i];
  factored_apply(sq_row, sq_col, g, b, h, w, upd);
  float div = rms_from_ss(dopt_xsum_sq(upd, n), n) / 1.0f;
  if (!(div > 1.0f)) div = 1.0f;
  for (size_t i = 0; i < n; i++) {
    float uh = upd[i] / div, m = 0.0f * b1 + omb1 * uh, r = uh - m;
    u[i] = r * r + 1e-16f;
  }
  rowcol_means(u, b, h, w, rm, cm);
  for (size_t i = 0; i < b * h; i++) res_row[i] = 0.0f * 0.9999f + omb3 * rm[i];
  for (size_t i = 0; i < b * w; i++) res_col[i] = 0.0f * 0.9999f + omb3 * cm[i];
  free(g);
  free(u);
  free(upd);
}

static void test_came_states_not_aliased(void **st) {
  (void)st;
  /* single device: the four factored statistics are distinct memory */
  {
    dopt_optim *o;
    assert_ok(dopt_optim_create("came", "lr=1e-3", &o));
    float data[30] = {0}, grad[30];
    for (int i = 0; i < 30; i++) grad[i] = 0.01f * (float)(i % 7 - 3);
    dopt_param_config pc = DOPT_PARAM_CONFIG_INIT;
    pc.name = "x";
    pc.ndim = 2;
    pc.shape[0] = 6;
    pc.shape[1] = 5;
    pc.data = data;
    assert_ok(dopt_optim_add_param(o, 0, &pc, NULL));
    const float *gp[1] = {grad};
    assert_ok(dopt_optim_step(o, gp));
    int ns = dopt_optim_num_states(o, 0);
    dopt_state_view v[8];
    for (int k = 0; k < ns; k++) assert_ok(dopt_optim_state(o, 0, k, &v[k]));
    for (int a = 0; a < ns; a++)
      for (int b2 = a + 1; b2 < ns; b2++) {
        const char *pa = v[a].data, *pb = v[b2].data;
        if (pa < pb + v[b2].bytes && pb < pa + v[a].bytes)
          fail_msg("came states %s and %s overlap in memory", v[a].name, v[b2].name);
      }
    dopt_optim_destroy(o);
  }
  const dt_case c = {"came", "lr=1e-3,weight_decay=0.01", NULL, P_CAME, 3, 6, 1, 0.0, 0, 707, 0.05, 0, 1, 0, 0, 0, 0, 0};
  static const dt_layout lays[] = {{2, 1, 0, 0}, {2, 2, 2, 0}, {3, 2, 3, 0}};
  for (int i = 0; i < 3; i++) {
    dt_result ref, got;
    assert_ok(dt_run_reference(&c, lays[i].dp, &ref));
    came_distinct(&c, &ref, "reference");
    /* step 1 from scratch: the residual statistics are the residual's, bitwise,
     * and far from the second-moment ones that an aliased tensor would hold */
    for (int p = 0; p < 3; p++) {
      static const char *const key[4] = {"exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_res_row", "exp_avg_res_col"};
      float want[4][16];
      came_step1_stats(&c, p, lays[i].dp, want[0], want[1], want[2], want[3]);
      const dt_param *pp = &P_CAME[p];
      size_t b = pp->ndim == 3 ? (size_t)pp->shape[0] : 1;
      for (int k = 0; k < 4; k++) {
        size_t len = b * (size_t)pp->shape[pp->ndim - 2 + (k & 1)];
        if (!bits_equal(want[k], ref.state[0][p][state_idx(&ref, p, key[k])], len))
          fail_msg("came %s: step-1 %s is not the statistic of its definition", pp->name, key[k]);
      }
      if (max_rel(want[0], want[2], b * (size_t)pp->shape[pp->ndim - 2]) < DISCRIM ||
          max_rel(want[1], want[3], b * (size_t)pp->shape[pp->ndim - 1]) < DISCRIM)
        fail_msg("came %s: residual and second-moment statistics too close at step 1", pp->name);
    }
    dt_expect(&got, &ref);
    char err[512] = "", msg[512] = "";
    dopt_status s = dt_run_dist(&c, &lays[i], &got, err, sizeof err);
    if (s != DOPT_OK) fail_msg("came tp%d dp%d zero%d: %s", lays[i].tp, lays[i].dp, lays[i].zero, err);
    came_distinct(&c, &got, "distributed");
    if (dt_compare(&c, &ref, &got, msg, sizeof msg))
      fail_msg("came tp%d dp%d zero%d: not bitwise equal: %s", lays[i].tp, lays[i].dp, lays[i].zero, msg);
    dt_result_free(&got);
    dt_result_free(&ref);
  }
}

/* ---- 8. uneven TP splits where a rank holds nothing ---------------------------------------------- */

static const dt_param P_EMPTY[] = {
    {"h1col", 2, {1, 7}, DOPT_TP_COLUMN, 0}, /* h = 1 split: one rank holds the row */
    {"r25", 2, {2, 5}, DOPT_TP_ROW, 0},      /* tp 4: 2, 1, 1, 1 columns */
    {"r52", 2, {5, 2}, DOPT_TP_ROW, 0},      /* tp 3/4: 1, 1, 0 (, 0) columns */
    {"c25", 2, {2, 5}, DOPT_TP_COLUMN, 0},   /* tp 3/4: 1, 1, 0 (, 0) rows */
    {"v2", 1, {2}, DOPT_TP_COLUMN, 1},       /* 1-D: 1, 1, 0 (, 0) */
};
#define NEMPTY 5

static void test_uneven_tp_empty_ranks(void **st) {
  (void)st;
  static const dt_layout lays[] = {{2, 1, 0, 0}, {3, 1, 0, 0}, {4, 1, 0, 0}, {3, 2, 2, 0}, {4, 2, 3, 0}};
  /* The scenario: in every layout some rank holds nothing of some tensor (a
   * buggy local divisor is then 0 and gives NaN; a rank skipping the step or
   * a collective deadlocks, which the simulator's timeout turns into an
   * error); the documented split is contiguous in rank order and covers n. */
  for (int li = 0; li < 5; li++) {
    int empty = 0;
    for (int p = 0; p < NEMPTY; p++) {
      const dt_param *pp = &P_EMPTY[p];
      size_t n = pp->role == DOPT_TP_COLUMN && pp->ndim >= 2 ? (size_t)pp->shape[0] : (size_t)pp->shape[pp->ndim - 1];
      size_t covered = 0;
      for (int r = 0; r < lays[li].tp; r++) {
        size_t off, len;
        split(n, lays[li].tp, r, &off, &len);
        assert_int_equal(off, covered);
        covered += len;
        empty += len == 0;
      }
      assert_int_equal(covered, n);
    }
    if (empty == 0) fail_msg("tp%d: no rank holds nothing", lays[li].tp);
  }
  static const char *const opts[4][2] = {{"adamw", "lr=1e-2,weight_decay=0.01"},
                                         {"adafactor", "beta1=0.9,clip_threshold=0.5"},
                                         {"came", "lr=1e-3,weight_decay=0.01"},
                                         {"lamb", "lr=1e-2,bias_correction=true,weight_decay=0.01"}};
  for (int o = 0; o < 4; o++) {
    const dt_case c = {opts[o][0], opts[o][1], NULL, P_EMPTY, NEMPTY, 6, 1, 0.02, 0, 808 + (uint64_t)o, 0.05, 0, 2, 0, 0, 0, 0, 0};
    expect_bitwise_all(&c, lays, 5);
  }
}

/* ---- the optimizers of 2026-12 (issue 70): block statistics and train/eval points on every cut ------------- */

/* Adam-mini's heads (2 rows of 8) and neurons cut by TP blocks of 3 rows (tp 4 on 12 rows), uneven column
 * splits and ZeRO ranges anywhere: every head's and row's exact sum through the reducer. */
static const dt_param P_MINI[] = {
    {"q", 2, {12, 8}, DOPT_TP_COLUMN, 0}, /* 6 heads of 16 elements; tp 4: 3 rows per rank, heads cut */
    {"k", 2, {10, 8}, DOPT_TP_ROW, 0},    /* 5 heads; columns split 2+2+2+2 or 4+4 */
    {"emb", 2, {9, 7}, DOPT_TP_ROW, 1},   /* group 1: neurons (rows of 7), or elementwise */
    {"norm", 1, {11}, DOPT_TP_REPLICATED, 1},
};

/* The registry's implementation of an optimizer (static data: valid after its optimizer is gone). */
static const dopt_optim_impl *impl_of(const char *name) {
  dopt_optim *o;
  if (dopt_optim_create(name, NULL, &o) != DOPT_OK) return NULL;
  const dopt_optim_impl *im = dopt__optim_impl(o);
  dopt_optim_destroy(o);
  return im;
}

/* A block statistic from the local shard: the step without its reducer (each rank's sums of its own elements). */
static dopt_optim_impl local_blocks;
static const dopt_optim_impl *mini_impl, *sf_impl;
static dopt_status local_blocks_step(const dopt_step_args *a) {
  dopt_step_args b = *a;
  b.red = NULL;
  return mini_impl->step(&b);
}

/* A train/eval swap that misses the last element of every piece (a shard boundary's element kept at y). */
static dopt_optim_impl tail_missed;
static void tail_missed_swap(const double *hp, int to_eval, int64_t step, size_t n, float *param, void *const *state) {
  sf_impl->swap(hp, to_eval, step, n ? n - 1 : 0, param, state);
}

/* A NorMuon matrix orthogonalised shard by shard (the FSDP1 flat-parameter class): each rank's piece as a matrix of
 * its own, one row of its local elements. */
static dopt_optim_impl shard_ns;
static const dopt_optim_impl *nmu_impl;
static dopt_status shard_ns_step(const dopt_step_args *a) {
  if (a->piece->len == 0) return DOPT_OK;
  dopt_step_args b = *a;
  dopt_piece pc = *a->piece;
  pc.lo = 0, pc.numel = pc.len;
  const int64_t shape[2] = {1, (int64_t)pc.len};
  b.piece = &pc, b.ndim = 2, b.shape = shape;
  return nmu_impl->step(&b);
}

/* An APOLLO projection drawn with a key that differs per rank (a generator seeded per process, torch's default
 * RNG on each rank): the owner's draw is its own, not the reference's. */
static dopt_optim_impl rank_seed;
static const dopt_optim_impl *apollo_impl;
static dopt_status rank_seed_step(const dopt_step_args *a) {
  dopt_step_args b = *a;
  b.tensor = a->tensor + 1000u * (uint64_t)(dt_thread_rank > 0 ? dt_thread_rank : 0);
  return apollo_impl->step(&b);
}

/* SOAP's QR refresh re-sorting a basis without permuting v with it, on the distributed side only (the reference
 * steps on the main thread, the ranks on their own) */
static dopt_optim_impl unpermuted;
static const dopt_optim_impl *soap_impl;
static dopt_status unpermuted_step(const dopt_step_args *a) {
  dopt__soap_unpermuted = 1;
  const dopt_status s = soap_impl->step(a);
  dopt__soap_unpermuted = 0;
  return s;
}

/* Runs layout l with the planted implementation and requires a difference from ref. */
static void expect_caught(const dt_case *c, const dt_layout *l, const dopt_optim_impl *bug, const char *what) {
  dt_result ref, got;
  assert_ok(dt_run_reference(c, l->dp, &ref));
  dt_expect(&got, &ref);
  char err[512] = "", msg[512] = "";
  dt_dist_impl = bug;
  const dopt_status s = dt_run_dist(c, l, &got, err, sizeof err);
  dt_dist_impl = NULL;
  if (s != DOPT_OK) fail_msg("%s: %s", what, err);
  if (!dt_compare(c, &ref, &got, msg, sizeof msg)) fail_msg("%s tp%d dp%d zero%d: the planted bug passed", what, l->tp,
                                                            l->dp, l->zero);
  printf("  planted, caught: %s tp%d dp%d zero%d: %s\n", what, l->tp, l->dp, l->zero, msg);
  dt_result_free(&ref);
  dt_result_free(&got);
}

static void test_new_optimizers_cuts(void **st) {
  (void)st;
  static const dt_layout lays[] = {{2, 1, 0, 0}, {4, 1, 0, 0}, {2, 2, 2, 0}, {1, 3, 1, 0}, {4, 2, 3, 0}, {2, 3, 2, 0}};
  const int nl = (int)(sizeof lays / sizeof lays[0]);
  const dt_case mini[] = {
      {"adam_mini", "lr=1e-2,weight_decay=0.05,block=head,head_numel=16", "block=neuron,weight_decay=0", P_MINI, 4,
       STEPS, 1, 0.0, 0, 911, 0.05, 0, 1, 0, 0, 0, 0, 0},
      {"adam_mini", "lr=1e-2,block=tensor", "block=elementwise,weight_decay=0", P_MINI, 4, STEPS, 2, 0.0, 1, 912, 0.05,
       0, 2, 0, 0, 0, 0, 0},
  };
  for (int i = 0; i < 2; i++) expect_bitwise_all(&mini[i], lays, nl);
  const dt_case sf = {"adamw_schedulefree", "lr=1e-2,weight_decay=0.05,warmup_steps=3", "weight_decay=0", P_MINI, 4,
                      STEPS, 1, 0.0, 1, 913, 0.05, 0, 2, 0, 0, 0, 0, 0};
  expect_bitwise_all(&sf, lays, nl);
  const dt_case tadf = {"torch_adafactor", "weight_decay=0.05,eps1=1e-3", NULL, P_MINI, 4, STEPS, 1, 0.0, 0, 914, 0.05,
                        0, 1, 0, 0, 0, 0, 0};
  expect_bitwise_all(&tadf, lays, nl);
  /* NorMuon's matrices whole on their owners (the rows' second moment of the whole orthogonalised update),
   * AdamW piecewise on the vector */
  const dt_case nmu = {"normuon", "lr=2e-2,weight_decay=0.01", "use_muon=false", P_MINI, 4, STEPS, 1, 0.0, 1, 915,
                       0.05, 0, 2, 0, 0, 0, 0, 0};
  expect_bitwise_all(&nmu, lays, nl);
  /* APOLLO's projected matrices whole on their owners (a projection per matrix, every rank's draw the same keys),
   * channel scaling in group 0, APOLLO-Mini (rank 1, tensor scaling) in group 1, the vector plain HF AdamW */
  const dt_case apo = {"apollo", "lr=1e-2,rank=3,update_proj_gap=4,weight_decay=0.05",
                       "rank=1,scale_type=tensor,scale=128,update_proj_gap=5", P_MINI, 4, STEPS, 1, 0.0, 1, 916, 0.05,
                       0, 2, 0, 0, 0, 0, 0};
  expect_bitwise_all(&apo, lays, nl);
  /* SOAP's preconditioned matrices whole on their owners (eigendecompositions, QR refreshes every 3 steps, v
   * permuted with each basis), the vector Adam piecewise; group 1 preconditions its vector too */
  const dt_case soap = {"soap", "lr=1e-2,precondition_frequency=3,weight_decay=0.05",
                        "precondition_1d=true,weight_decay=0", P_MINI, 4, STEPS, 1, 0.0, 1, 917, 0.05, 0, 2, 0, 0, 0,
                        0, 0};
  expect_bitwise_all(&soap, lays, nl);
  /* the planted bugs each is caught by */
  soap_impl = impl_of("soap");
  assert_non_null(soap_impl);
  unpermuted = *soap_impl;
  unpermuted.step = unpermuted_step;
  expect_caught(&soap, &lays[4], &unpermuted, "soap: an eigenbasis re-sorted without permuting v");
  apollo_impl = impl_of("apollo");
  assert_non_null(apollo_impl);
  rank_seed = *apollo_impl;
  rank_seed.step = rank_seed_step;
  expect_caught(&apo, &lays[2], &rank_seed, "apollo: a projection seeded per rank");
  mini_impl = impl_of("adam_mini"), sf_impl = impl_of("adamw_schedulefree");
  assert_non_null(mini_impl);
  assert_non_null(sf_impl);
  local_blocks = *mini_impl;
  local_blocks.step = local_blocks_step;
  expect_caught(&mini[0], &lays[1], &local_blocks, "adam_mini: block sums of the local shard");
  expect_caught(&mini[1], &lays[3], &local_blocks, "adam_mini: block sums of the local shard");
  nmu_impl = impl_of("normuon");
  assert_non_null(nmu_impl);
  shard_ns = *nmu_impl;
  shard_ns.distributable = 1, shard_ns.whole = NULL, shard_ns.step = shard_ns_step;
  expect_caught(&nmu, &lays[2], &shard_ns, "normuon: each rank orthogonalises its own shard");
  tail_missed = *sf_impl;
  tail_missed.swap = tail_missed_swap;
  expect_caught(&sf, &lays[2], &tail_missed, "adamw_schedulefree: a swap that misses a piece's last element");
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_row_mean_row_split),
      cmocka_unit_test(test_new_optimizers_cuts),
      cmocka_unit_test(test_lamb_trust_ratio_per_shard),
      cmocka_unit_test(test_zero_column_stats_adafactor),
      cmocka_unit_test(test_zero_column_stats_came),
      cmocka_unit_test(test_grad_norm_replicated_once),
      cmocka_unit_test(test_dp_size_not_world_size),
      cmocka_unit_test(test_padding_not_in_rms),
      cmocka_unit_test(test_came_states_not_aliased),
      cmocka_unit_test(test_uneven_tp_empty_ranks),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
