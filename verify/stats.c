/* distopt verify, the tolerances and the statistics (verifier.h): the declared tolerance of each optimizer,
 * accumulated and per step, and each recorded tensor's statistics against the reference (max abs error, ULPs,
 * normwise relative error, the first step beyond its tolerance). */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "files.h"
#include "verifier.h"

/* --stepwise tolerances (docs/verify.md, "Per-step tolerances"): one step from the same parameters, states and
 * gradient differs only by the roundings of that step's operations. Elementwise optimizers (adamw): each
 * output element is a chain of at most k = 8 fp32 operations (mul, add, addcmul, sqrt, add eps, div, the
 * update and the weight decay), each rounded once on either side (torch fuses add_(alpha=): one rounding
 * where distopt has two), so |rec - ref| <= 2k·u·(the magnitudes in the chain), u = 2^-24; normwise
 * relative 2·8·2^-24 = 9.5e-7 of the chain's magnitudes; the metric divides a moment's error by max|m| while
 * the chain holds (1 - β1)|g| and (torch 2's lerp) |g - m|, and max|g| / max|m| grows as the gradients' noise
 * averages out of m (fused AdamW, 1 000 steps: 1.69e-6 on exp_avg): states 1e-5; parameters p - lr·update: the
 * p term's roundings dominate, <= 4u = 2.4e-7 of max|p| plus lr·(the update's error) -> 1e-6, and at the
 * declared accumulated
 * bounds the two modes agree. Factored and norm-based optimizers (adafactor, came, lamb) add torch's fp32
 * reductions over a row, column or tensor of n elements: torch sums in fp32 with a cascade of vector
 * lanes, error <= (log2 n + 8)·u relative for sums of squares; through rsqrt and the update's RMS clipping
 * it enters every element, so states 2·(log2 n + 16)·u: n <= 2^24 -> 80u = 4.8e-6 -> 1e-5, parameters
 * (damped by lr) 1e-6. Measured (tests/verify, torch 1.13 AVX2): AdamW 3 000 steps stepwise <= 1.0e-7
 * (params) and 1.2e-7 (states), margins >= 8 (docs/verify.md). A bug that changes one step by more than the bound is
 * named at that step however long the run. */
/* Exact states: Muon's momentum is one lerp per element in fp32, the same operation in muon-optimizer 0.1.0,
 * torch.optim.Muon and distopt (M <- M + (1 - momentum)(G - M), torch's lerp_ rounding once as distopt does),
 * so its recorded value equals the reference's bit for bit whatever the orthogonalised update's bf16 error
 * (measured: exact over 20 steps against torch.optim.Muon, docs/muon.md); a corrupted momentum is then named
 * at its step even under a loose --rtol for the parameters. Fused AdamW's moments are not exact (torch's
 * kernel fuses the lerp and the addcmul). */
/* Muon: the orthogonalised update O is computed in bf16 by both sides with the same roundings (flavor=torch:
 * torch.optim.Muon's addmm form; muon-optimizer's separate operations) except the order in which each product's
 * fp32 accumulator adds its K exact bf16 products (torch's oneDNN/BLAS kernels block k by ISA; distopt adds in k
 * order); that changes an intermediate's bf16 rounding only where its value lies within (K - 1)·2^-24 relative
 * of a bf16 rounding boundary, by one bf16 ulp (2^-8), and the remaining iterations carry it on, amplified by up
 * to the quintic's slope at 0, a = 3.4445, per iteration (a^5 = 485 over 5) in the directions of small singular
 * values. The parameter then differs by lr'·ΔO per step and the differences add up (the update depends on the
 * gradients only, which are replayed): the bound is the fp32 chain's 1e-6 of max|P| plus MUON_UPDATE of each
 * step's change of the reference's parameter (lr'·max|O| + lr·wd·max|P|), summed over the steps. MUON_UPDATE =
 * 2^-1: the worst measured ΔO is 0.104 of max|O| (26.5 ulps; low rank plus noise, where the amplification
 * acts), 0.0175 on Gaussian matrices (bench/muon_ns_margins.py, torch 2.15 against flavor=torch, 303 matrices,
 * AVX-512 with AVX512-BF16, oneDNN forced to AVX512_CORE, and AVX2 forced), margin 4.8 (docs/precision.md
 * "Muon's Newton-Schulz"). The aux Adam parameters (no Newton-Schulz: counter muon.ns 0) keep the plain
 * bound. */
#define MUON_UPDATE 0.5
#define NORMUON_STATE 0.5
static const verify_tol verify_tolerances[] = {
    {"adamw", 1e-6, 1e-5, 1e-6, 1e-5, NULL, NULL, 0, -1}, /* per-step states: 1e-5 (the |g| / |m| note above) */
    {"adafactor", 1e-6, 1e-5, 1e-6, 1e-5, NULL, NULL, 0, -1},
    /* torch.optim.Adafactor: the factored bound above (its row/column norms and ‖U‖ are torch's fp32 reductions;
     * its lerps fused as distopt's); golden, 200 steps: params 2.4e-7, states 3.7e-7 */
    {"torch_adafactor", 1e-6, 1e-5, 1e-6, 1e-5, NULL, NULL, 0, -1},
    /* Schedule-Free AdamW: elementwise as adamw (at most 10 fp32 operations per element, lerp and add(alpha=)
     * fused as torch's); golden, 200 steps, recorded in eval mode: params 2.4e-7, states 1.4e-7 */
    {"adamw_schedulefree", 1e-6, 1e-5, 1e-6, 1e-5, NULL, NULL, 0, -1},
    /* Adam-mini: adamw's chain per element, one fp32 block mean (torch's reduction) per head, row or tensor as
     * the factored ones; golden, 200 steps: params 1.0e-7, states 1.9e-7 */
    {"adam_mini", 1e-6, 1e-5, 1e-6, 1e-5, NULL, NULL, 0, -1},
    /* APOLLO: adamw's chain per element on R = G·Pᵀ (or Pᵀ·G), the projection replayed from the recording
     * (upstream's draws, through the projector hook); R's elements are fp32 dot products of K = n (or m) terms,
     * summed in k order here and in blocks by torch's GEMM: a random-walk error of about √K·u relative, so the
     * low-rank moments keep the state bound for K <= 2^14 (128·6e-8 = 7.7e-6 < 1e-5; wider matrices: give
     * --rtol-state); the scaling factor is a ratio of norms over r or n elements of R and N, its error averaged,
     * and reaches the parameter damped by lr. Golden, 200 steps: params 3.4e-7, states 7.8e-7 */
    {"apollo", 1e-6, 1e-5, 1e-6, 1e-5, NULL, NULL, 0, -1},
    /* SOAP: the recorded bases adopted where they change (checked against ours: dopt__soap_basis_check, statistic
     * bases(Q)), the rest is Adam's elementwise chain between mode products (fp32 dot products of d terms, in k
     * order here and in blocks by torch's GEMM: about √d·u relative) and the preconditioners' outer products
     * (numel/d terms): the state bound holds for d and numel/d <= 2^14 as APOLLO's; golden, 200 steps: params
     * 4.5e-7, states 6.3e-7 */
    {"soap", 1e-6, 1e-5, 1e-6, 1e-5, NULL, NULL, 0, -1},
    {"came", 1e-6, 1e-5, 1e-6, 1e-5, NULL, NULL, 0, -1},
    {"lamb", 1e-6, 1e-5, 1e-6, 1e-5, NULL, NULL, 0, -1},
    {"muon", 1e-6, 1e-5, 1e-6, 1e-5, NULL, "momentum_buffer", MUON_UPDATE, DOPT_COUNTER_NS},
    /* NorMuon: Muon's bound for the parameters (its bf16 Newton-Schulz is torch.optim.Muon's form) and its exact
     * momentum; the rows' second moment is a mean of the orthogonalised update's squares, so it carries ΔO
     * (up to 0.10 of max|O|, squared: 0.21): states NORMUON_STATE, the momentum still bitwise and every
     * parameter (the AdamW groups' included) at the parameter bounds */
    {"normuon", 1e-6, NORMUON_STATE, 1e-6, NORMUON_STATE, NULL, "momentum_buffer", MUON_UPDATE, DOPT_COUNTER_NS},
};

const verify_tol *vf_find_tol(const char *name) {
  for (size_t i = 0; i < sizeof verify_tolerances / sizeof verify_tolerances[0]; i++)
    if (strcmp(verify_tolerances[i].optimizer, name) == 0 && verify_tolerances[i].param > 0)
      return &verify_tolerances[i];
  return NULL;
}

const char *vf_exact_states(const char *name, const char *upstream) {
  for (size_t i = 0; i < sizeof verify_tolerances / sizeof verify_tolerances[0]; i++) {
    const verify_tol *t = &verify_tolerances[i];
    if (strcmp(t->optimizer, name) == 0 && t->exact &&
        (!t->upstream || strncmp(upstream, t->upstream, strlen(t->upstream)) == 0))
      return t->exact;
  }
  return NULL;
}

double vf_state_tol(const vctx *c, const char *key) {
  const char *e = c->exact_states;
  const size_t n = strlen(key);
  while (e && *e) {
    const char *comma = strchr(e, ',');
    const size_t len = comma ? (size_t)(comma - e) : strlen(e);
    if (len == n && strncmp(e, key, n) == 0) return 0.0;
    e = comma ? comma + 1 : NULL;
  }
  return c->tol_state;
}

/* ---- statistics --------------------------------------------------------------------- */

int vf_new_stat(vctx *c, int rank, const vr_piece *pc, const char *key) {
  if (c->nst == c->capst) {
    int cap = c->capst ? 2 * c->capst : 64;
    vstat *s = realloc(c->st, (size_t)cap * sizeof *s);
    if (!s) return -1;
    c->st = s;
    c->capst = cap;
  }
  vstat *s = &c->st[c->nst];
  memset(s, 0, sizeof *s);
  s->rank = rank;
  s->param = pc->param;
  s->pc = pc;
  snprintf(s->key, sizeof s->key, "%s", key);
  return c->nst++;
}

void vf_add_point(vctx *c, vstat *s, long step, double rel) {
  if (c->truncated) return;
  if (c->points >= VR_MAX_POINTS) {
    c->truncated = 1;
    return;
  }
  if (s->npts == s->cappts) {
    long cap = s->cappts ? 2 * s->cappts : 16;
    long *ps = realloc(s->pt_step, (size_t)cap * sizeof *ps);
    if (!ps) {
      c->truncated = 1;
      return;
    }
    s->pt_step = ps;
    double *pr = realloc(s->pt_rel, (size_t)cap * sizeof *pr);
    if (!pr) {
      c->truncated = 1;
      return;
    }
    s->pt_rel = pr;
    s->cappts = cap;
  }
  s->pt_step[s->npts] = step;
  s->pt_rel[s->npts++] = rel;
  c->points++;
}

/* Ordered integer of a float: adjacent floats differ by 1, -0 and +0 by 1. */
static int64_t ordered(float x) {
  uint32_t u;
  memcpy(&u, &x, sizeof u);
  return (u & 0x80000000u) ? -(int64_t)(u & 0x7fffffffu) - 1 : (int64_t)u;
}

/* Compares rec (recorded, n elements, possibly unaligned) with ref; updates s; returns the
 * normwise relative error max|rec - ref| / max|ref| of this step (max|ref| in *maxref_out, when not NULL). */
double vf_compare_f32(vstat *s, const void *rec_bytes, const float *ref, size_t n, double *maxref_out) {
  double maxdiff = 0.0, maxref = 0.0;
  uint64_t maxulp = 0, nanpairs = 0;
  const unsigned char *rb = rec_bytes;
  for (size_t i = 0; i < n; i++) {
    float a, b = ref[i];
    memcpy(&a, rb + 4 * i, sizeof a);
    double ab = fabs((double)b);
    if (ab > maxref && !isnan(b)) maxref = ab;
    if (isnan(a) || isnan(b)) {
      if (isnan(a) && isnan(b)) nanpairs++;
      else {
        maxdiff = INFINITY;
        maxulp = UINT64_MAX;
      }
      continue;
    }
    if (a == b && signbit(a) == signbit(b)) continue;
    double d = a == b ? 0.0 : fabs((double)a - (double)b); /* +0 / -0: 0 apart, 1 ULP */
    if (isnan(d)) d = INFINITY;                          /* inf against -inf */
    if (d > maxdiff) maxdiff = d;
    int64_t oa = ordered(a), ob = ordered(b);
    uint64_t u = oa > ob ? (uint64_t)(oa - ob) : (uint64_t)(ob - oa);
    if (u > maxulp) maxulp = u;
  }
  double rel = maxdiff == 0.0 ? 0.0 : maxref > 0.0 ? maxdiff / maxref : INFINITY;
  if (isnan(rel)) rel = INFINITY; /* an infinite reference element against a different value */
  if (maxdiff > s->max_abs || isnan(s->max_abs)) s->max_abs = maxdiff;
  if (maxulp > s->max_ulp) s->max_ulp = maxulp;
  if (nanpairs > s->nan_pairs) s->nan_pairs = nanpairs;
  if (maxref_out) *maxref_out = maxref;
  return rel;
}

void vf_record_result(vctx *c, int si, long t, double rel, double tol) {
  vstat *s = &c->st[si];
  s->compared++;
  if (rel > s->max_rel || isnan(rel)) s->max_rel = rel;
  vf_add_point(c, s, t, rel);
  int beyond = !(rel <= tol);
  if (beyond && !s->first_beyond) s->first_beyond = t, s->tol_first = tol;
  if (beyond && !c->verdict_step) {
    c->verdict_step = t;
    c->verdict_stat = si;
    c->verdict_value = rel;
  }
}

int vf_lib_error(const char *what, dopt_status s) {
  const char *msg = dopt_last_error();
  return cli_errorf(CMD, "%s%s%s", what ? what : "", what ? ": " : "", *msg ? msg : dopt_status_str(s));
}
