/* Plugin semantics against torch itself (datasets/semantics/semantics.safetensors,
 * made by gen_semantics.py with Debian's torch 1.13 on CPU):
 *
 *  - global-norm clipping against torch.nn.utils.clip_grad_norm_ (norm type 2),
 *    through the distributed optimizer's own step (its grad_norm, its skip) and
 *    dopt_clip_coef, the coefficient the reference and distributed/ share;
 *  - gradient accumulation and the data-parallel average in the documented
 *    order (docs/dp-sum.md) against torch doing the same operations, bit for bit,
 *    and against torch's usual loss/M accumulation loop, within a bound;
 *  - fp32 -> bf16 rounding against x.to(torch.bfloat16), bit for bit for every
 *    non-NaN value (NaN bits are not part of the contract: docs/nan-policy.md).
 */
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "distopt/dist.h"
#include "distopt/distopt.h"
#include "distopt/dpsum.h"
#include "distopt/safetensors.h"
#include "distopt/sim.h"

#define NP 4
static const char *const PN[NP] = {"a", "b", "c", "z"};
static const float U = 5.9604645e-8f; /* 2^-24, fp32 unit roundoff */

static dopt_st_file *F;

static int setup(void **st) {
  (void)st;
  char path[1024];
  snprintf(path, sizeof path, "%s/datasets/semantics/semantics.safetensors", dt_source_dir());
  assert_ok(dopt_st_load(path, &F));
  return 0;
}
static int teardown(void **st) {
  (void)st;
  dopt_st_free(F);
  return 0;
}

static char keybuf[128];
/* GET("clip/%s/in/%s", case, param): the tensor of that name (fails the test if absent) */
#define GET(...) (snprintf(keybuf, sizeof keybuf, __VA_ARGS__), getk(keybuf))
static dopt_st_tensor getk(const char *key) {
  dopt_st_tensor t;
  if (dopt_st_find(F, key, &t) != DOPT_OK) fail_msg("semantics.safetensors: tensor %s missing", key);
  return t;
}
static const float *f32(dopt_st_tensor t) { return (const float *)t.data; }

/* ---- clipping ------------------------------------------------------------------------- */

/* One simulated rank (tp 1, dp 1): AdamW with max_grad_norm, one backward of
 * the case's gradients, one step. Writes the step info and whether any
 * parameter moved. */
typedef struct clip_run {
  const char *cas;
  double max_norm;
  dopt_dist_step_info info;
  int moved;
} clip_run;

static dopt_status clip_rank(dopt_sim_comm *world, int rank, void *user) {
  (void)rank;
  clip_run *x = user;
  float *data[NP], *before[NP];
  const float *g[NP];
  dopt_optim *plain = NULL;
  dopt_status s = dopt_optim_create("adamw", "lr=1e-2,weight_decay=0.1", &plain);
  for (int i = 0; i < NP && s == DOPT_OK; i++) {
    dopt_st_tensor t = GET("clip/%s/in/%s", x->cas, PN[i]);
    data[i] = calloc(t.numel, sizeof(float));
    before[i] = calloc(t.numel, sizeof(float));
    for (size_t k = 0; k < t.numel; k++) data[i][k] = before[i][k] = (float)k * 0.01f - 0.1f;
    g[i] = f32(t);
    dopt_param_config pc = DOPT_PARAM_CONFIG_INIT;
    pc.name = PN[i];
    pc.ndim = t.ndim;
    memcpy(pc.shape, t.shape, sizeof pc.shape);
    pc.data = data[i];
    int id;
    s = dopt_optim_add_param(plain, 0, &pc, &id);
  }
  dopt_transport tp, dp;
  if (s == DOPT_OK) s = dopt_sim_transport(world, &tp);
  if (s == DOPT_OK) s = dopt_sim_transport(world, &dp);
  dopt_dist_config cfg = DOPT_DIST_CONFIG_INIT;
  cfg.plugin = "ddp";
  cfg.zero_stage = 0;
  cfg.max_grad_norm = x->max_norm;
  cfg.tp = tp;
  cfg.dp = dp;
  dopt_tp_role roles[NP] = {DOPT_TP_REPLICATED, DOPT_TP_REPLICATED, DOPT_TP_REPLICATED, DOPT_TP_REPLICATED};
  dopt_dist_optim *d = NULL;
  if (s == DOPT_OK) s = dopt_dist_create(plain, &cfg, roles, &d);
  if (s == DOPT_OK) s = dopt_dist_backward(d, g);
  if (s == DOPT_OK) s = dopt_dist_step(d, &x->info);
  for (int i = 0; i < NP && s == DOPT_OK; i++) {
    dopt_st_tensor t = GET("clip/%s/in/%s", x->cas, PN[i]);
    float *now = malloc(t.numel * sizeof(float));
    s = dopt_dist_gather_param(d, i, now);
    if (s == DOPT_OK) x->moved |= memcmp(now, before[i], t.numel * sizeof(float)) != 0;
    free(now);
  }
  dopt_dist_destroy(d);
  dopt_optim_destroy(plain);
  for (int i = 0; i < NP; i++) {
    free(data[i]);
    free(before[i]);
  }
  return s;
}

static clip_run run_clip(const char *cas) {
  clip_run x = {cas, f32(GET("clip/%s/max_norm", cas))[0], {0, 0, 0}, 0};
  dopt_sim_config sc = DOPT_SIM_CONFIG_INIT;
  sc.nranks = 1;
  sc.timeout_ms = 20000;
  dopt_sim_world *w;
  assert_ok(dopt_sim_world_create(&sc, &w));
  dopt_status st[1];
  assert_ok(dopt_sim_launch(w, clip_rank, &x, st));
  if (st[0] != DOPT_OK) fail_msg("clip %s: rank 0: %s", cas, dopt_sim_world_rank_error(w, 0));
  dopt_sim_world_destroy(w);
  return x;
}

/* dopt_clip_coef of a case's input gradients (exact Σg² per tensor), as the reference and
 * distributed/ compute it; its total norm into *norm. */
static float case_coef(const char *cas, double max_norm, double *norm) {
  double ss[NP];
  for (int i = 0; i < NP; i++) {
    dopt_st_tensor t = GET("clip/%s/in/%s", cas, PN[i]);
    ss[i] = dopt_xsum_sq(f32(t), t.numel);
  }
  return dopt_clip_coef(ss, NP, max_norm, norm);
}

/* Tolerance of the norm. distopt's is exact: Σg² of each tensor exactly, the
 * per-tensor sums added in double, one sqrt. torch 1.13 computes each
 * tensor's 2-norm in fp32 (vectorised partial sums, relative error at most
 * about n·u for n terms; n = 256 here: 1.5e-5) and then the fp32 2-norm of
 * the four norms (a few u more). So |distopt − torch| ≤ 2e-5·torch is the
 * worst case torch's own arithmetic allows; a wrong formula (the squared norm
 * without the root, a missing tensor, a norm per tensor) is off by O(1). The
 * clipped gradients then carry the coefficient's relative difference plus one
 * rounding: the same 2e-5 elementwise. */
#define CLIP_TOL 2e-5

static void test_clip_finite(void **st) {
  (void)st;
  const char *cases[] = {"active", "inactive"};
  for (int c = 0; c < 2; c++) {
    const char *cas = cases[c];
    const double torch_norm = f32(GET("clip/%s/total_norm", cas))[0];
    const double max_norm = f32(GET("clip/%s/max_norm", cas))[0];
    clip_run r = run_clip(cas);
    assert_int_equal(r.info.skipped, 0);
    double rel = fabs(r.info.grad_norm - torch_norm) / torch_norm;
    printf("clip %-8s norm: distopt %.9g torch %.9g (rel %.2g, limit %.0e)\n", cas, r.info.grad_norm, torch_norm, rel,
           CLIP_TOL);
    if (!(rel <= CLIP_TOL)) fail_msg("clip %s: norm %.9g vs torch %.9g (rel %.3g)", cas, r.info.grad_norm, torch_norm, rel);
    /* the coefficient the distributed step used, applied as it applies it */
    double norm;
    float coef = case_coef(cas, max_norm, &norm);
    assert_true(norm == r.info.grad_norm); /* the same exact norm */
    double worst = 0;
    for (int i = 0; i < NP; i++) {
      dopt_st_tensor in = GET("clip/%s/in/%s", cas, PN[i]), out = GET("clip/%s/out/%s", cas, PN[i]);
      for (size_t k = 0; k < in.numel; k++) {
        float mine = f32(in)[k] * coef, theirs = f32(out)[k];
        double d = fabs((double)mine - (double)theirs);
        if (theirs != 0) worst = fmax(worst, d / fabs((double)theirs));
        if (!(d <= CLIP_TOL * fabs((double)theirs)))
          fail_msg("clip %s: %s[%zu] %.9g vs torch %.9g", cas, PN[i], k, (double)mine, (double)theirs);
      }
      if (coef == 1.0f && memcmp(in.data, out.data, in.numel * sizeof(float)) != 0)
        fail_msg("clip %s: %s changed although neither clips", cas, PN[i]);
    }
    assert_true(c == 0 ? coef < 1.0f : coef == 1.0f); /* the cases do what they say */
    printf("clip %-8s gradients: worst rel %.2g\n", cas, worst);
  }
}

/* A NaN or inf gradient: torch's total norm is non-finite and it scales every
 * gradient by NaN (or 0); distopt's distributed step sees the same non-finite
 * gradient and skips the step on every rank: nothing moves. */
static void test_clip_nonfinite(void **st) {
  (void)st;
  const char *cases[] = {"inf", "nan"};
  for (int c = 0; c < 2; c++) {
    const char *cas = cases[c];
    float torch_norm = f32(GET("clip/%s/total_norm", cas))[0];
    if (isfinite(torch_norm)) fail_msg("clip %s: torch's norm %g is finite", cas, (double)torch_norm);
    double norm;
    (void)case_coef(cas, 1.0, &norm);
    if (isfinite(norm)) fail_msg("clip %s: distopt's norm %g is finite, torch's %g", cas, norm, (double)torch_norm);
    clip_run r = run_clip(cas);
    if (r.info.skipped != 1 || r.moved) fail_msg("clip %s: skipped %d, parameters moved %d", cas, r.info.skipped, r.moved);
  }
}

/* Finite gradients near 1e20: their squares overflow fp32, so torch's norm is
 * inf and clip_grad_norm_ multiplies every gradient by 0. distopt's norm is
 * exact (finite, in double) and clips by the true norm: a documented
 * difference (docs/nan-policy.md), checked here against a long-double sum. */
static void test_clip_overflow(void **st) {
  (void)st;
  float torch_norm = f32(GET("clip/overflow/total_norm"))[0];
  if (!isinf(torch_norm)) fail_msg("overflow: torch's norm %g is not inf", (double)torch_norm);
  long double ld = 0;
  for (int i = 0; i < NP; i++) {
    dopt_st_tensor t = GET("clip/overflow/in/%s", PN[i]);
    for (size_t k = 0; k < t.numel; k++) ld += (long double)f32(t)[k] * (long double)f32(t)[k];
  }
  clip_run r = run_clip("overflow");
  assert_int_equal(r.info.skipped, 0);
  assert_true(r.moved);
  double want = sqrt((double)ld);
  if (!(fabs(r.info.grad_norm - want) <= 1e-12 * want))
    fail_msg("overflow: distopt norm %.17g, long double %.17g", r.info.grad_norm, want);
}

/* ---- accumulation and the dp average -------------------------------------------------- */

static void test_accumulation(void **st) {
  (void)st;
  const int M = atoi(dopt_st_meta(F, "micro_batches")), R = atoi(dopt_st_meta(F, "dp"));
  assert_true(M == 3 && R == 4);
  double worst_ulps = 0;
  for (int i = 0; i < NP; i++) {
    dopt_st_tensor doc = GET("accum/documented/%s", PN[i]), loop = GET("accum/loop/%s", PN[i]);
    size_t n = doc.numel;
    float *acc = calloc(n, sizeof(float));
    /* the documented order: micro-batches added in fp32, in order; one division by M */
    for (int m = 0; m < M; m++) {
      const float *g = f32(GET("accum/g/%d/%s", m, PN[i]));
      for (size_t k = 0; k < n; k++) acc[k] = m == 0 ? g[k] : acc[k] + g[k];
    }
    for (size_t k = 0; k < n; k++) acc[k] = acc[k] / (float)M;
    if (memcmp(acc, doc.data, n * sizeof(float)) != 0) fail_msg("accumulation of %s: not torch's bits", PN[i]);
    /* torch's loss/M loop: each micro gradient times fl(1/M), added in order. Against the
     * documented order, per element at most (M + 2) roundings of terms bounded by
     * Σ|g_m|/M apart: |loop − documented| ≤ (M + 2)·u·Σ|g_m|/M. */
    for (size_t k = 0; k < n; k++) {
      double bound = 0;
      for (int m = 0; m < M; m++) {
        bound += fabs((double)f32(GET("accum/g/%d/%s", m, PN[i]))[k]);
      }
      bound *= (M + 2) * (double)U / M;
      double d = fabs((double)f32(loop)[k] - (double)acc[k]);
      if (!(d <= bound)) fail_msg("loop accumulation of %s[%zu]: %.9g vs %.9g (bound %.3g)", PN[i], k,
                                  (double)f32(loop)[k], (double)acc[k], bound);
      if (acc[k] != 0) worst_ulps = fmax(worst_ulps, d / (fabs((double)acc[k]) * U));
    }
    free(acc);
    /* the dp average: the exact sum of the rank sums (dopt_dp_sum, what distributed/
     * computes), one rounding, one division by dp·M: torch's exact float64 sum, rounded,
     * divided, bit for bit */
    const float *parts[8];
    for (int r = 0; r < R; r++) {
      parts[r] = f32(GET("accum/dp/%d/%s", r, PN[i]));
    }
    float *avg = calloc(n, sizeof(float));
    assert_ok(dopt_dp_sum(parts, R, 1, n, avg));
    for (size_t k = 0; k < n; k++) avg[k] = avg[k] / (float)(R * M);
    if (memcmp(avg, f32(GET("accum/dp_avg/%s", PN[i])), n * sizeof(float)) != 0)
      fail_msg("dp average of %s: not torch's exactly summed bits", PN[i]);
    free(avg);
  }
  printf("accumulation: documented order bitwise; torch's loss/M loop within %.1f ulp of it\n", worst_ulps);
}

/* ---- bf16 ----------------------------------------------------------------------------- */

static void test_bf16(void **st) {
  (void)st;
  dopt_st_tensor in = GET("bf16/in"), out = GET("bf16/out");
  assert_int_equal(in.numel, out.numel);
  int nans = 0, nan_bits_differ = 0;
  for (size_t k = 0; k < in.numel; k++) {
    float x = f32(in)[k];
    uint16_t theirs, mine = dopt_f32_to_bf16(x);
    memcpy(&theirs, (const char *)out.data + 2 * k, 2);
    if (isnan(x)) { /* NaN stays NaN; its bits are not part of the contract */
      nans++;
      if ((mine & 0x7f80) != 0x7f80 || (mine & 0x7f) == 0) fail_msg("bf16 of NaN [%zu]: 0x%04x is not a NaN", k, mine);
      nan_bits_differ += mine != theirs;
      continue;
    }
    if (mine != theirs) {
      uint32_t b;
      memcpy(&b, &x, 4);
      fail_msg("bf16 of 0x%08x (%.9g): 0x%04x, torch 0x%04x", b, (double)x, mine, theirs);
    }
  }
  printf("bf16: %zu values bitwise torch's; %d NaNs (bits differ from torch's in %d)\n", in.numel - (size_t)nans, nans,
         nan_bits_differ);
}

int main(void) {
  const struct CMUnitTest tests[] = {cmocka_unit_test(test_clip_finite), cmocka_unit_test(test_clip_nonfinite),
                                     cmocka_unit_test(test_clip_overflow), cmocka_unit_test(test_accumulation),
                                     cmocka_unit_test(test_bf16)};
  return cmocka_run_group_tests(tests, setup, teardown);
}
