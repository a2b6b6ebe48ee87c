/* distopt verify, the gradient side of a step (verifier.h; docs/verify.md, "Checking a framework end to end"):
 *
 *   clipping   record.clip (schema 6): the recorded gradients are those before clipping. Each rank's recorded total
 *              norm is checked against the exact norm of the assembled gradient, its coefficient against
 *              min(1, max_norm / (norm + 1e-6)) of that norm, and each piece's clipped gradient (its digest) against
 *              the piece times the coefficient; then the replay clips the gradient itself (dopt_clip_coef).
 *   --twin     TWIN, the recording of a single-process twin of the training (distopt.twin): at every step each
 *              parameter's assembled gradient against the twin's, within the rounding of the sum of the twin's
 *              micro-batch gradients (grad_abs/), and every recorded step count against the twin's training steps.
 *
 * The first failure is a verdict of its own, named by category: gradient, then norm/clip, then step counter, each
 * before the values (the update) of the same step (vf_early_verdict). */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "distopt/digest.h"
#include "internal.h"
#include "piece_stats.h"
#include "verifier.h"

#define U32 0x1p-24 /* fp32's unit roundoff */

static void tw_fail(vctx *c, long t, const char *kind, int p, int rank, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 6, 7)))
#endif
    ;

static void tw_fail(vctx *c, long t, const char *kind, int p, int rank, const char *fmt, ...) {
  if (c->tw_step) return; /* the first */
  c->tw_step = t, c->tw_kind = kind, c->tw_param = p, c->tw_rank = rank;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(c->tw_why, sizeof c->tw_why, fmt, ap);
  va_end(ap);
}

/* The rank whose source piece of parameter p holds flat element e (-1: none). */
static int source_rank(const vctx *c, int p, int64_t e) {
  for (int k = 0; k < c->rd.nsrc[p]; k++) {
    const vr_piece *pc = c->rd.src[p][k].pc;
    int64_t at, n;
    for (int64_t j = 0; (n = vr_piece_run(pc, j, &at)) > 0; j += n)
      if (e >= at && e < at + n) return c->rd.src[p][k].rank;
  }
  return -1;
}

int vf_twin_open(vctx *c) {
  if (!c->twin_path) return CLI_OK;
  if (vr_reader_open(&c->twin, c->twin_path) != DOPT_OK) return cli_errorf(CMD, "--twin: %s", c->twin.err);
  if (c->twin.ix.twin_terms <= 0)
    return cli_errorf(CMD, "--twin %s: not a twin's recording (no \"twin\" key: distopt.twin writes one)",
                      c->twin.index_path);
  return vf_single_device_of(c, &c->twin, "--twin", "a single-process twin");
}

/* Step t's assembled gradients (c->gptr) against the twin's: |g - G| <= (terms + 1) u A per element, A the
 * twin's sum of the micro-batch gradients' magnitudes: the run's sum of `terms` terms in any order rounds at most
 * terms - 1 times, each error below u times the magnitudes summed so far (first order; a scaling by a power of two
 * is exact), its conversion to fp32 and the twin's G (the exact fp64 sum rounded once) once each. u is fp32's, or
 * bf16's 2^-8 when the run sums in bf16 (twin.grad_dtype: the twin's micro-batch gradients are then the bf16
 * model's, the same bits as each rank's). */
static int twin_grads(vctx *c, long t) {
  const vr_index *ix = &c->rd.ix;
  const double K = (double)(c->twin.ix.twin_terms + 1) * (c->twin.ix.twin_bf16 ? 0x1p-8 : U32);
  char name[VR_MAX_NAME + 64];
  int all_zero = 1, twin_nonzero = 0;
  int bad_p = -1, bad_rank = -1;
  int64_t bad_e = 0;
  double bad_g = 0, bad_G = 0, bad_b = 0, worst = 0;
  const char *bad_why = NULL;
  for (int p = 0; p < ix->nparams; p++) {
    const int64_t n = ix->params[p].numel;
    size_t ng = 0, na = 0;
    snprintf(name, sizeof name, "grad/%ld/%s", t, ix->params[p].name);
    const void *Gb = vr_reader_f32(&c->twin, 0, t, name, &ng);
    snprintf(name, sizeof name, "grad_abs/%ld/%s", t, ix->params[p].name);
    const void *Ab = vr_reader_f32(&c->twin, 0, t, name, &na);
    const float *g = c->gptr[p];
    /* the file's bytes may be unaligned: copied into aligned buffers (ng and na checked against n below) */
    float *G = NULL, *A = NULL;
    if (Gb && Ab && (int64_t)ng == n && (int64_t)na == n) {
      G = malloc((size_t)n * sizeof *G + 1), A = malloc((size_t)n * sizeof *A + 1);
      if (!G || !A) {
        free(G), free(A);
        return vf_lib_error(NULL, dopt__fail(DOPT_ERR_NO_MEMORY, "--twin: %lld elements of '%s'", (long long)n,
                                             ix->params[p].name));
      }
      memcpy(G, Gb, (size_t)n * sizeof *G), memcpy(A, Ab, (size_t)n * sizeof *A);
    }
    if (Gb && !G) {
      if (bad_p < 0) bad_p = p, bad_why = "the twin's gradient or grad_abs has another element count, or is missing";
      continue;
    }
    if (!G != !g) { /* a gradient on one side only */
      if (bad_p < 0) bad_p = p, bad_why = g ? "the twin has none" : "the recording has none";
      for (int64_t i = 0; g && i < n && all_zero; i++) all_zero = g[i] == 0.0f;
      for (int64_t i = 0; G && i < n && !twin_nonzero; i++) twin_nonzero = G[i] != 0.0f;
      free(G), free(A);
      continue;
    }
    if (!G) continue;
    for (int64_t i = 0; i < n; i++) {
      all_zero &= g[i] == 0.0f;
      twin_nonzero |= G[i] != 0.0f;
      const double d = fabs((double)g[i] - (double)G[i]), b = K * (double)A[i];
      const double r = d == 0 ? 0 : b > 0 ? d / b : INFINITY;
      const int nan = isnan(d) && !(isnan(g[i]) && isnan(G[i])); /* NaN on both sides: equal (nan-policy.md) */
      if (r > worst) worst = r;
      if ((r > 1 || nan) && bad_p < 0) bad_p = p, bad_e = i, bad_g = g[i], bad_G = G[i], bad_b = b;
    }
    c->tw_grad_compared += n;
    free(G), free(A);
  }
  if (worst > c->tw_grad_worst) c->tw_grad_worst = worst;
  if (bad_p < 0) return CLI_OK;
  if (all_zero && twin_nonzero) {
    tw_fail(c, t, "step_counter", 0, -1,
            "step counter: every recorded gradient of step %ld is zero or absent on every rank, the twin's are not: a "
            "zero-gradient warm-up step recorded as a training step (it advances the step counter: the training's "
            "steps are one behind from here); record after it, declared as construction_steps",
            t);
    return CLI_OK;
  }
  if (bad_why) {
    tw_fail(c, t, "gradient", bad_p, -1, "gradient of %s: %s", ix->params[bad_p].name, bad_why);
    return CLI_OK;
  }
  bad_rank = source_rank(c, bad_p, bad_e);
  tw_fail(c, t, "gradient", bad_p, bad_rank,
          "gradient of %s: element %lld (recorded by rank %d) is %.9g, the twin's %.9g: off by %.3g, beyond the bound "
          "%.3g of the sum of %ld micro-batch gradients",
          ix->params[bad_p].name, (long long)bad_e, bad_rank, bad_g, bad_G, fabs(bad_g - bad_G), bad_b,
          c->twin.ix.twin_terms);
  return CLI_OK;
}

/* Step t's recorded step counts (states recorded at t) against the twin's: the training step of recorded step t
 * is t - construction_steps (the recording's), the twin's count that plus its declared construction steps. */
static void twin_counters(vctx *c, long t) {
  const vr_index *ix = &c->rd.ix;
  if (!ix->record_states || t % ix->every != 0) return;
  const long want = t - ix->construction_steps + c->twin.ix.twin_construction;
  char name[VR_MAX_NAME + 64];
  for (int r = 0; r < ix->world_size; r++) {
    if (vr_reader_seek(&c->rd, r, t) != DOPT_OK) continue;
    for (int i = 0; i < ix->ranks[r].npieces; i++) {
      const int p = ix->ranks[r].pieces[i].param;
      snprintf(name, sizeof name, "state/%ld/%s/step", t, ix->params[p].name);
      dopt_st_tensor x;
      if (dopt_st_find(c->rd.f[r], name, &x) != DOPT_OK) continue;
      const double v = vf_scalar_value(&x);
      c->tw_counters_compared++;
      if (v != (double)want) {
        tw_fail(c, t, "step_counter", p, r,
                "step counter: rank %d's step count of %s after step %ld is %.17g, the twin's %ld (training step "
                "%ld%s): %+.17g optimizer steps that were no training step (a warm-up or construction step; "
                "twin(construction_steps=) when the framework takes it by design)",
                r, ix->params[p].name, t, v, want, t - ix->construction_steps,
                c->twin.ix.twin_construction ? " plus the declared construction steps" : "", v - (double)want);
        return;
      }
    }
  }
}

/* record.clip: step t's recorded norms, coefficients and clipped digests; then the assembled gradients are
 * clipped as the replay's input (nothing recorded at t: no clipping at t). */
static int clip_step(vctx *c, long t) {
  const vr_index *ix = &c->rd.ix;
  char name[VR_MAX_NAME + 64];
  int clipped = 0;
  for (int r = 0; r < ix->world_size; r++) {
    snprintf(name, sizeof name, "clip/%ld/norm", t);
    size_t n = 0;
    if (vr_reader_f32(&c->rd, r, t, name, &n)) clipped = 1;
  }
  if (!clipped) return CLI_OK;
  c->clip_steps++;
  int64_t total = 0;
  double ss = 0;
  for (int p = 0; p < ix->nparams; p++)
    if (c->gptr[p]) ss += dopt_sumsq(c->gptr[p], (size_t)ix->params[p].numel), total += ix->params[p].numel;
  double norm;
  const float coef = dopt_clip_coef(&ss, 1, ix->clip_max_norm, &norm);
  /* any order of fp32 squares and sums: relative error of the sum <= total u (first order), halved by the
   * square root, plus the root's own rounding */
  const double nbound = ((double)total / 2 + 2) * U32;
  for (int r = 0; r < ix->world_size; r++) {
    size_t n1 = 0, n2 = 0;
    snprintf(name, sizeof name, "clip/%ld/norm", t);
    const float *rn = vr_reader_f32(&c->rd, r, t, name, &n1);
    snprintf(name, sizeof name, "clip/%ld/coef", t);
    const float *rc = vr_reader_f32(&c->rd, r, t, name, &n2);
    if (!rn || !rc) {
      tw_fail(c, t, "clip", 0, r, "norm/clip: rank %d recorded no clip/%ld/%s while another rank clipped", r, t,
              rn ? "coef" : "norm");
      continue;
    }
    float vn, vc;
    memcpy(&vn, rn, sizeof vn), memcpy(&vc, rc, sizeof vc);
    const double rel = norm > 0 ? fabs((double)vn - norm) / norm : fabs((double)vn);
    if (rel / nbound > c->clip_worst) c->clip_worst = rel / nbound;
    if (!(rel <= nbound) && !(isnan(vn) && isnan(norm)))
      tw_fail(c, t, "clip", 0, r,
              "norm/clip: rank %d's total gradient norm is %.9g, the gradient's %.9g (relative %.3g, bound %.3g: "
              "a norm over a shard, or gradients counted more than once)",
              r, (double)vn, norm, rel, nbound);
    /* fp32 max_norm / (norm + 1e-6) clamped to 1 from the recorded norm: torch's (a reciprocal times max_norm) and
     * DeepSpeed's (a true division, or 1 / ((norm + 1e-6) / max_norm)) round up to three times, ours once */
    const double cw = ix->clip_max_norm / ((double)vn + 1e-6);
    const float want = (float)(cw > 1 ? 1 : cw);
    if (!(fabsf(vc - want) <= 4 * U32 * fabsf(want)) && !(isnan(vc) && isnan(want)))
      tw_fail(c, t, "clip", 0, r,
              "norm/clip: rank %d's clip coefficient is %.9g, min(1, max_norm %g / (its norm %.9g + 1e-6)) = %.9g", r,
              (double)vc, ix->clip_max_norm, (double)vn, (double)want);
    if (ix->grads != VR_GRADS_F32) continue;
    /* each piece's clipped gradient: its recorded gradient times the coefficient, bit for bit */
    if (vr_reader_seek(&c->rd, r, t) != DOPT_OK) continue;
    for (int i = 0; i < ix->ranks[r].npieces; i++) {
      const int p = ix->ranks[r].pieces[i].param;
      snprintf(name, sizeof name, "clipped_digest/%ld/%s", t, ix->params[p].name);
      dopt_st_tensor d, g;
      if (dopt_st_find(c->rd.f[r], name, &d) != DOPT_OK) continue;
      snprintf(name, sizeof name, "grad/%ld/%s", t, ix->params[p].name);
      if (dopt_st_find(c->rd.f[r], name, &g) != DOPT_OK) continue;
      float *buf = malloc(g.numel ? g.numel * sizeof(float) : 1);
      if (!buf) return vf_lib_error(NULL, dopt__fail(DOPT_ERR_NO_MEMORY, "clip: %zu elements", g.numel));
      memcpy(buf, g.data, g.numel * sizeof(float));
      for (size_t k = 0; k < g.numel; k++) buf[k] *= vc;
      uint8_t h[DOPT_DIGEST_BYTES];
      const dopt_status s = dopt_digest_buffer(buf, g.numel * sizeof(float), h, NULL);
      free(buf);
      if (s != DOPT_OK) return vf_lib_error("clip digest", s);
      c->clip_digests++;
      if (memcmp(h, d.data, sizeof h) != 0)
        tw_fail(c, t, "clip", p, r,
                "norm/clip: rank %d's gradient of %s after clipping is not its gradient times the coefficient %.9g "
                "(clipping computed but not applied, or applied twice)",
                r, ix->params[p].name, (double)vc);
    }
  }
  for (int p = 0; p < ix->nparams; p++) /* the replay's input: clipped by the exact norm */
    if (c->gptr[p])
      for (int64_t i = 0; i < ix->params[p].numel; i++) c->grad[p][i] *= coef;
  return CLI_OK;
}

int vf_twin_step(vctx *c, long t) {
  int rc;
  if (c->twin_path && !c->tw_step && (rc = twin_grads(c, t))) return rc;
  if (c->rd.ix.clip_max_norm > 0 && (rc = clip_step(c, t))) return rc;
  if (c->twin_path && !c->tw_step) twin_counters(c, t);
  return CLI_OK;
}
