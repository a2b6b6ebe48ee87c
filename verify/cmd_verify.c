/* distopt verify: replay a recorded PyTorch run (distopt.record, docs/verify.md)
 * through the reference optimizer and compare.
 *
 *   distopt verify TRACE [--stepwise] [--reference REF] [--rtol X] [--json FILE] [--plot FILE.svg] [--quiet]
 *
 * TRACE is the recording's directory (or its index.json). The reference
 * optimizer is created with the recorded name, hyperparameters and groups;
 * the initial parameters and, every step, the gradients are assembled from
 * the ranks' pieces (the lowest rank of identical pieces supplies them); after
 * every step each recorded parameter and state piece of every rank is
 * compared with the reference's elements: max abs error, max ULP distance and
 * the normwise relative error max|rec - ref| / max|ref| (docs/golden.md's
 * metric), against the optimizer's declared tolerance (verify_tolerances
 * below) or --rtol. Step counters ("step" states) must be equal.
 *
 * --stepwise (teacher-forced): before each step the reference takes the
 * recorded parameters and states of the step before (assembled from the
 * ranks' pieces), so each comparison measures one step's rounding and the
 * verdict names the step where the computations first parted; the per-step
 * tolerances below apply. --reference REF: the reference is not the C
 * optimizer but a recording REF of the reference values (distopt.replay
 * writes it from the user's own single-device torch optimizer); the same
 * comparison and report. A window (start_step > 0) starts the reference from
 * the recorded states at its start; GaLore recordings with projectors have
 * each recorded projector checked against ours (sin theta) and adopted.
 *
 * The recording is read through verify/verify_reader.c (verify.h; shared with
 * `distopt compare --trace` on a recording): one loaded block per rank.
 *
 * Exit 0: every compared tensor within tolerance at every recorded step;
 * 1: one is not (the verdict names the first step, tensor and rank);
 * 2: bad usage or input (one line; the reference could not replay it). */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "cli.h"
#include "compare.h" /* cmp_xml_text */
#include "files.h"
#include "galore_proj.h" /* the projector check: dopt_galore_svd */
#include "verify.h"

static const char *const CMD = "verify";

/* ---- declared tolerances --------------------------------------------------------------
 *
 * Normwise relative error max|rec - ref| / max|ref| of a parameter and of a
 * state piece, after every recorded step. Each entry is docs/golden.md's
 * tolerance for the same upstream class, justified there by the operations
 * that round differently (torch fuses add_(alpha=) and sums means and norms in
 * fp32; distopt does not fuse and sums exactly): ~10 one-ulp differences per
 * step (6e-8 each) over ~20 steps give ~1.2e-5 on the update, damped by the
 * learning rate (<= 1e-2 of the parameter) to ~1e-7 on parameters; states are
 * undamped. Measured by test_golden (torch 1.13 AVX2; docs/golden.md, docs/precision.md)
 * for all four: parameters 6e-8 .. 3.3e-7 (20-step cases <= 3.3e-7, 200-step <= 2.2e-7),
 * states <= 5.5e-7 (20 steps) and <= 6.9e-7 (200 steps); adafactor's 200-step case
 * 1.5e-7 / 3.3e-7. Against 1e-6 / 1e-5: margins >= 3 (parameters) and >= 14 (states).
 * Measured by distopt verify itself on real clients (tests/verify, docs/verify.md):
 *   torch AdamW, MLP, 30 steps       params 1.6e-7, states 2.7e-7
 *   ZeRO(AdamW), 2 gloo ranks, 20     params 1.5e-7, states 3.2e-7
 *   HF Adafactor 4.36.2, 30 steps     params 1.7e-7, states 2.9e-7
 *   sharded Adafactor (all_reduce)    params 1.1e-7, states 1.2e-7
 * margins >= 5.9 (params) and >= 31 (states); the planted local-statistics
 * bug gives 0.9 on exp_avg_sq_col at step 1.
 * A wrong formula (a missing bias correction, eps misplaced, a mean over the
 * wrong rows) shows at 1e-3 or worse. The bound is for runs of the golden
 * length (<= 200 steps) at training learning rates; longer runs may need
 * --rtol (roundings compound at worst linearly with the steps).
 * Optimizers without an entry (8-bit, GaLore, Q-GaLore, LISA: discontinuous
 * or projected updates, no golden bound against torch here) need --rtol. */
typedef struct verify_tol {
  const char *optimizer;
  double param, state;           /* accumulated (the default mode) */
  double step_param, step_state; /* --stepwise: one step from the recorded states (0: no declared bound) */
} verify_tol;

/* --stepwise tolerances (docs/verify.md, "Per-step tolerances"): one step from the same parameters, states and
 * gradient differs only by the roundings of that step's operations. Elementwise optimizers (adamw): each
 * output element is a chain of at most k = 8 fp32 operations (mul, add, addcmul, sqrt, add eps, div, the
 * update and the weight decay), each rounded once on either side (torch fuses add_(alpha=): one rounding
 * where distopt has two), so |rec - ref| <= 2k·u·(the magnitudes in the chain), u = 2^-24; normwise
 * relative 2·8·2^-24 = 9.5e-7 -> 1e-6 for states; parameters p - lr·update: the p term's roundings dominate,
 * <= 4u = 2.4e-7 of max|p| plus lr·(the update's error) -> 1e-6 too, and at the declared accumulated
 * bounds the two modes agree. Factored and norm-based optimizers (adafactor, came, lamb) add torch's fp32
 * reductions over a row, column or tensor of n elements: torch sums in fp32 with a cascade of vector
 * lanes, error <= (log2 n + 8)·u relative for sums of squares; through rsqrt and the update's RMS clipping
 * it enters every element, so states 2·(log2 n + 16)·u: n <= 2^24 -> 80u = 4.8e-6 -> 1e-5, parameters
 * (damped by lr) 1e-6. Measured (tests/verify, torch 1.13 AVX2): AdamW 3 000 steps stepwise <= 1.0e-7
 * (params) and 1.2e-7 (states), margins >= 8 (docs/verify.md). A bug that changes one step by more than the bound is
 * named at that step however long the run. */
static const verify_tol verify_tolerances[] = {
    {"adamw", 1e-6, 1e-5, 1e-6, 1e-6},
    {"adafactor", 1e-6, 1e-5, 1e-6, 1e-5},
    {"came", 1e-6, 1e-5, 1e-6, 1e-5},
    {"lamb", 1e-6, 1e-5, 1e-6, 1e-5},
};

static const verify_tol *find_tol(const char *name) {
  for (size_t i = 0; i < sizeof verify_tolerances / sizeof verify_tolerances[0]; i++)
    if (strcmp(verify_tolerances[i].optimizer, name) == 0) return &verify_tolerances[i];
  return NULL;
}

/* ---- state of one run ------------------------------------------------------------------- */

#define VR_MAX_KEYS 32               /* distinct state keys per piece */
#define VR_MAX_POINTS (16L << 20)    /* per-step errors kept for --json and --plot, all tensors together */
#define VR_JSON_SCHEMA 4              /* 2: mode, reference, start_step, grads, not_replayed, tolerance per stat; 3: the events verdict and rows; 4: tensors' stage, expert, the hparams verdict */

typedef struct vstat {
  int rank, param;
  const vr_piece *pc;
  char key[VR_MAX_KEY + 1]; /* "" = the parameter itself */
  double max_abs, max_rel;
  uint64_t max_ulp;
  uint64_t nan_pairs;       /* elements NaN in both (equal, docs/nan-policy.md) */
  long compared;            /* recorded steps compared */
  long first_beyond;        /* first step beyond tolerance (0: never) */
  int no_ref;               /* the reference has no state of this key: not compared */
  double tol_first;         /* the tolerance at first_beyond (a projector's sin theta bound varies per refresh) */
  int64_t ev_ours, ev_rec;  /* an events(...) statistic at first_beyond: our count and the recording's */
  long npts, cappts;
  long *pt_step;
  double *pt_rel;
} vstat;

typedef struct vpiece_keys {
  int nkeys;
  int stat[VR_MAX_KEYS + 1]; /* [0] the parameter; then one per state key, in first-seen order */
} vpiece_keys;

typedef struct vrank_rt {
  vpiece_keys *keys;   /* [npieces] */
} vrank_rt;

typedef struct vctx {
  const char *trace;
  const char *json_path, *svg_path;
  const char *ref_path;   /* --reference: a recording of the reference values (distopt.replay) */
  double rtol;         /* > 0: --rtol */
  int quiet;
  int stepwise;           /* --stepwise: teacher-forced */
  vr_reader rd;         /* the recording: its index, source pieces and one open file per rank */
  vr_reader ref;          /* --reference's recording */
  int *proj_stat;         /* [nparams] the sin theta statistic of a GaLore parameter's projector (-1: none yet) */
  int *ev_stat;           /* [nparams] its events(galore.refreshes) statistic (-1: none yet) */
  /* record.grad_agree: the first step at which two ranks' gradients of a parameter differ (0: none), the
   * parameter, the rank and the lowest rank it differs from; steps whose digests were compared */
  long agree_step, agree_checked;
  int agree_param, agree_rank, agree_base;
  float *scratch;         /* the largest parameter's elements: a reference tensor of --reference, a state */
  float *gath;            /* as many: a block piece's reference elements, gathered to compare */
  unsigned char *mask;    /* as many flags: which elements the ranks' pieces covered */
  size_t scratch_n;
  long not_replayed;      /* --stepwise: steps skipped (only a gradient digest, or no recorded state before) */
  long proj_adopted, proj_none; /* recorded projectors adopted / refreshes with no recorded projector */
  char hook_err[5120];    /* the projector hook's failure (exit 2) */
  double tol_param, tol_state;
  const char *tol_source;
  dopt_optim *opt;
  float **data, **grad;   /* [nparams] */
  const float **gptr;     /* [nparams] by optimizer id (= index order) */
  vrank_rt *rt;           /* [world_size] */
  vstat *st;
  int nst, capst;
  long points;
  int truncated;
  long verdict_step;      /* 0: within tolerance */
  int verdict_stat;
  double verdict_value;
  long compared_steps;
} vctx;

static void usage(FILE *f) {
  fputs("usage: distopt verify TRACE [--stepwise] [--reference REF] [--rtol X] [--json FILE] [--plot FILE.svg] "
        "[--quiet]\n"
        "  Replays a run recorded by distopt.record (TRACE: its directory, or its index.json; docs/verify.md)\n"
        "  through the reference optimizer: the recorded initial parameters and gradients, step by step, and\n"
        "  compares every recorded parameter and state (per rank for sharded recordings) with the reference:\n"
        "  max abs error, max ULP distance, normwise relative error max|rec-ref|/max|ref|, first step beyond the\n"
        "  tolerance. Tolerance: the optimizer's declared one (normwise relative, parameters and states), or\n"
        "  --rtol X for both. Step counters must be equal.\n"
        "  --stepwise: teacher-forced; each step starts from the recorded parameters and states of the step before,\n"
        "  so the error is one step's rounding and the verdict names the step where the computations parted.\n"
        "  --reference REF: compare with REF, a recording of reference values (distopt.replay), not the C reference.\n"
        "  --json FILE: the per-step record (\"schema_version\": 4); --plot FILE.svg: error vs step per tensor.\n"
        "  Exit: 0 within tolerance, 1 diverged (names the first step, tensor and rank), 2 bad usage or input.\n",
        f);
}

static int lib_error(const char *what, dopt_status s) {
  const char *msg = dopt_last_error();
  return cli_errorf(CMD, "%s%s%s", what ? what : "", what ? ": " : "", *msg ? msg : dopt_status_str(s));
}

static int parse_args(vctx *c, int argc, char **argv) {
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
      usage(stdout);
      exit(CLI_OK);
    }
    if (strcmp(a, "--quiet") == 0) {
      c->quiet = 1;
      continue;
    }
    if (strcmp(a, "--stepwise") == 0) {
      c->stepwise = 1;
      continue;
    }
    if (a[0] == '-' && a[1] == '-') {
      if (i + 1 >= argc) return cli_errorf(CMD, "option '%s' needs a value (or is unknown)", a);
      const char *v = argv[++i];
      if (strcmp(a, "--json") == 0) c->json_path = v;
      else if (strcmp(a, "--plot") == 0) c->svg_path = v;
      else if (strcmp(a, "--reference") == 0) c->ref_path = v;
      else if (strcmp(a, "--rtol") == 0) {
        char *end;
        errno = 0;
        c->rtol = strtod(v, &end);
        if (end == v || *end || errno || !(c->rtol > 0.0) || !isfinite(c->rtol))
          return cli_errorf(CMD, "--rtol '%s': expected a positive number", v);
      } else return cli_errorf(CMD, "unknown option '%s' (see --help)", a);
      continue;
    }
    if (c->trace) return cli_errorf(CMD, "more than one TRACE given ('%s' and '%s')", c->trace, a);
    c->trace = a;
  }
  if (!c->trace) return cli_errorf(CMD, "TRACE (a recording's directory) is required (see --help)");
  if (c->json_path && !c->json_path[0]) return cli_errorf(CMD, "--json: empty path");
  if (c->svg_path && !c->svg_path[0]) return cli_errorf(CMD, "--plot: empty path");
  if (c->ref_path && !c->ref_path[0]) return cli_errorf(CMD, "--reference: empty path");
  /* the one rule for outputs; neither may be, or lie inside, the recording (its folder) */
  char rec[4096];
  struct stat st;
  if (stat(c->trace, &st) == 0 && !S_ISDIR(st.st_mode)) dopt__path_parent(c->trace, rec); /* TRACE/index.json */
  else snprintf(rec, sizeof rec, "%s", c->trace);
  char refdir[4096];
  if (c->ref_path && stat(c->ref_path, &st) == 0 && !S_ISDIR(st.st_mode)) dopt__path_parent(c->ref_path, refdir);
  else snprintf(refdir, sizeof refdir, "%s", c->ref_path ? c->ref_path : "");
  const cli_path outs[] = {{"--json", c->json_path, 0}, {"--plot", c->svg_path, 0}};
  const cli_path ins[] = {{"TRACE", rec, 1}, {"--reference", c->ref_path ? refdir : NULL, 1}};
  return cli_check_paths(CMD, outs, 2, ins, 2);
}

/* ---- the index ---------------------------------------------------------------------- */

static int load_index(vctx *c) {
  if (vr_reader_open(&c->rd, c->trace) != DOPT_OK) return cli_errorf(CMD, "%s", c->rd.err);
  if (c->rd.ix.steps == c->rd.ix.start_step)
    return cli_errorf(CMD, "%s: steps: %ld: the recording holds no step (nothing to verify)", c->rd.index_path,
                      c->rd.ix.steps);
  return CLI_OK;
}

/* ---- statistics --------------------------------------------------------------------- */

static int new_stat(vctx *c, int rank, const vr_piece *pc, const char *key) {
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

static void add_point(vctx *c, vstat *s, long step, double rel) {
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
 * normwise relative error max|rec - ref| / max|ref| of this step. */
static double compare_f32(vstat *s, const void *rec_bytes, const float *ref, size_t n) {
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
  return rel;
}

static void record_result(vctx *c, int si, long t, double rel, double tol) {
  vstat *s = &c->st[si];
  s->compared++;
  if (rel > s->max_rel || isnan(rel)) s->max_rel = rel;
  add_point(c, s, t, rel);
  int beyond = !(rel <= tol);
  if (beyond && !s->first_beyond) s->first_beyond = t, s->tol_first = tol;
  if (beyond && !c->verdict_step) {
    c->verdict_step = t;
    c->verdict_stat = si;
    c->verdict_value = rel;
  }
}

/* ---- tensor files ------------------------------------------------------------------- */

static int piece_index(const vctx *c, int r, int param) {
  const vr_rank *rk = &c->rd.ix.ranks[r];
  for (int i = 0; i < rk->npieces; i++)
    if (rk->pieces[i].param == param) return i;
  return -1;
}

/* The state key's statistic of rank r's piece i, created at first sight (the reader calls this for
 * every state tensor of a file it loads). */
static int key_stat(void *user, int r, int i, const char *key, const char *fpath, const char *tname, char *err,
                    size_t cap) {
  vctx *c = user;
  vpiece_keys *k = &c->rt[r].keys[i];
  for (int j = 1; j <= k->nkeys; j++)
    if (strcmp(c->st[k->stat[j]].key, key) == 0) return 0;
  if (k->nkeys == VR_MAX_KEYS) {
    snprintf(err, cap, "%s: tensor '%s': more than %d state keys for one parameter (the limit)", fpath, tname,
             VR_MAX_KEYS);
    return -1;
  }
  int si = new_stat(c, r, &c->rd.ix.ranks[r].pieces[i], key);
  if (si < 0) {
    snprintf(err, cap, "out of memory");
    return -1;
  }
  k->stat[++k->nkeys] = si;
  return 0;
}

/* Makes rank r's open file the one holding step t. */
static int file_for_step(vctx *c, int r, long t) {
  return vr_reader_seek(&c->rd, r, t) == DOPT_OK ? CLI_OK : cli_errorf(CMD, "%s", c->rd.err);
}

/* ---- setup -------------------------------------------------------------------------- */

/* The reference's parameter p after step t: the optimizer's (c->data[p]) or, with --reference, REF's
 * param/<t>/<p> copied into c->data[p]; NULL when REF lacks it. */
static const float *ref_param(vctx *c, int p, long t) {
  if (!c->ref_path) return c->data[p];
  char key[VR_MAX_NAME + 64];
  size_t n = 0;
  snprintf(key, sizeof key, "param/%ld/%s", t, c->rd.ix.params[p].name);
  const void *b = vr_reader_f32(&c->ref, 0, t, key, &n);
  if (!b || (int64_t)n != c->rd.ix.params[p].numel) return NULL;
  memcpy(c->data[p], b, n * sizeof(float));
  return c->data[p];
}

/* A scalar tensor's value (a step count: F32, F64, I32 or I64). */
static double scalar_value(const dopt_st_tensor *x) {
  if (x->dtype == DOPT_F32) {
    float v;
    memcpy(&v, x->data, sizeof v);
    return v;
  }
  if (x->dtype == DOPT_F64) {
    double v;
    memcpy(&v, x->data, sizeof v);
    return v;
  }
  if (x->dtype == DOPT_I64) {
    int64_t v;
    memcpy(&v, x->data, sizeof v);
    return (double)v;
  }
  int32_t v;
  memcpy(&v, x->data, sizeof v);
  return v;
}

static int state_range(const vctx *c, const vr_piece *pc, const char *key, int64_t n, int64_t *lo, int64_t *len,
                       int *mapped);

/* The recorded tensor names of the state before step t+1 (t = the window's start: init/, init_state/). */
static void before_names(const vctx *c, long t, int p, const char *key, char *buf, size_t cap) {
  const char *pn = c->rd.ix.params[p].name;
  if (t == c->rd.ix.start_step) {
    if (key) snprintf(buf, cap, "init_state/%s/%s", pn, key);
    else snprintf(buf, cap, "init/%s", pn);
  } else {
    if (key) snprintf(buf, cap, "state/%ld/%s/%s", t, pn, key);
    else snprintf(buf, cap, "param/%ld/%s", t, pn);
  }
}

/* Sets the reference's parameters and states to those recorded after step t (the window's start: its initial
 * ones): parameters from their source pieces; each F32 state of the reference from every rank's recorded range
 * (the lowest rank's value where ranges overlap), every element covered; the step counts. A state no rank
 * records keeps the reference's value (a GaLore projector, adopted at refreshes) unless `strict` (a window's
 * start: the reference has no value of its own). */
static int force_states(vctx *c, long t, int strict) {
  const vr_index *ix = &c->rd.ix;
  vr_reader *rd = &c->rd;
  const long at = t == ix->start_step ? t + 1 : t; /* the file holding the names */
  char key[VR_MAX_NAME + VR_MAX_KEY + 64];
  for (int r = 0; r < ix->world_size; r++)
    if (ix->ranks[r].npieces && file_for_step(c, r, at)) return CLI_USAGE;
  for (int p = 0; p < ix->nparams; p++) {
    const vr_param *vp = &ix->params[p];
    if (t > ix->start_step) { /* (the window's start: vr_reader_init has set them) */
      before_names(c, t, p, NULL, key, sizeof key);
      for (int k = 0; k < rd->nsrc[p]; k++) {
        const vr_source *sr = &rd->src[p][k];
        dopt_st_tensor x;
        if (dopt_st_find(rd->f[sr->rank], key, &x) != DOPT_OK)
          return cli_errorf(CMD, "%s: --stepwise: rank %d's file for step %ld has no '%s' (the state to start step %ld "
                                 "from)", rd->index_path, sr->rank, at, key, t + 1);
        vr_piece_put(sr->pc, x.data, c->data[p]);
      }
    }
    /* the step count (any rank's piece), which also says whether the recorded run had states for p */
    before_names(c, t, p, "step", key, sizeof key);
    int have = 0;
    double step = 0;
    for (int r = 0; r < ix->world_size && !have; r++) {
      const vr_piece *pc = vr_rank_piece(ix, r, p);
      dopt_st_tensor x;
      if (pc && dopt_st_find(rd->f[r], key, &x) == DOPT_OK) have = 1, step = scalar_value(&x);
    }
    if (!have) continue; /* the recorded run had no state for p yet: neither has the reference */
    dopt_status s = DOPT_OK;
    if (dopt_optim_num_states(c->opt, p) == 0) s = dopt_optim_init_state(c->opt, p);
    if (s == DOPT_OK) s = dopt_optim_set_step(c->opt, p, (int64_t)step);
    if (s != DOPT_OK) return lib_error(vp->name, s);
    int nst = dopt_optim_num_states(c->opt, p);
    for (int k = 0; k < nst; k++) {
      dopt_state_view v;
      if (dopt_optim_state(c->opt, p, k, &v) != DOPT_OK || v.dtype != DOPT_F32) continue;
      int64_t n = 1;
      for (int d = 0; d < v.ndim; d++) n *= v.shape[d];
      if ((size_t)n > c->scratch_n)
        return cli_errorf(CMD, "state '%s' of '%s' has %lld elements, more than its parameter's", v.name, vp->name,
                          (long long)n);
      before_names(c, t, p, v.name, key, sizeof key);
      memset(c->mask, 0, (size_t)n);
      int64_t covered = 0;
      int any = 0;
      for (int r = 0; r < ix->world_size; r++) {
        const vr_piece *pc = vr_rank_piece(ix, r, p);
        dopt_st_tensor x;
        int64_t lo, len;
        int mapped;
        if (!pc || dopt_st_find(rd->f[r], key, &x) != DOPT_OK) continue;
        any = 1;
        if (state_range(c, pc, v.name, n, &lo, &len, &mapped) || (!mapped && lo + len > n) || (int64_t)x.numel != len)
          return cli_errorf(CMD, "%s: rank %d: tensor '%s' (%zu elements) does not fit the reference's state of %lld "
                                 "elements", rd->index_path, r, key, x.numel, (long long)n);
        for (int64_t i = 0; i < len; i++) {
          const int64_t e = mapped ? vr_piece_elem(pc, i) : lo + i;
          if (!c->mask[e]) {
            c->mask[e] = 1;
            memcpy(c->scratch + e, (const unsigned char *)x.data + 4 * i, sizeof(float));
            covered++;
          }
        }
      }
      if (!any && !strict) continue;
      if (covered != n) {
        int64_t i = 0;
        while (i < n && c->mask[i]) i++;
        return cli_errorf(CMD, "%s: %s: state '%s' of '%s' after step %ld: element %lld of %lld is recorded by no "
                               "rank (the reference cannot start from it)", rd->index_path,
                          strict ? "the window's start" : "--stepwise", v.name, vp->name, t, (long long)i,
                          (long long)n);
      }
      memcpy(v.data, c->scratch, (size_t)n * sizeof(float));
    }
  }
  if (dopt_optim_set_gstep(c->opt, t) != DOPT_OK) return lib_error("gstep", DOPT_ERR_INVALID_ARG);
  return CLI_OK;
}

/* ---- GaLore projectors: the recorded one checked against ours and adopted --------------------
 *
 * At a refresh the recorded run's projector Q_rec (galore_torch: torch.linalg.svd's top-r singular vectors)
 * and ours Q (LAPACK sgesdd, our sign convention) span the top-r singular subspace of the same fp32
 * gradient G up to rounding. Both SVDs are backward stable: each computed subspace is exact for G + E with
 * ||E||_2 <= p(m,n)·u·sigma_1 (LAPACK's error bounds, p a modest function of the size: we take max(m, n)),
 * and by Wedin's theorem sin theta(computed, exact) <= ||E||_2 / (sigma_r - sigma_{r+1}). So
 *   sin theta(Q_rec, Q) <= 2·max(m, n)·u·sigma_1 / (sigma_r - sigma_{r+1}),   u = 2^-24,
 * the largest principal angle, computed from the residual R = Q_rec - Q (Qᵀ Q_rec) as ||R||_2. Q_rec must be
 * orthonormal within the same p(m,n)·u (a scaled projector spans the subspace but scales the update). A
 * projector beyond the bound is a divergence at that step (tensor P/sin_theta(KEY)); within it, it is
 * adopted, so a stock galore_torch run verifies whatever signs its SVD chose. With no gap (sigma_r =
 * sigma_{r+1}) the subspace is not unique and the bound is infinite: any orthonormal projector passes. */

#define PROJ_P(m, n) ((double)((m) > (n) ? (m) : (n)))
#define PROJ_U 5.9604644775390625e-8 /* 2^-24 */

/* Largest singular value of R [m, r] (ld r, double): power iteration on RᵀR (r x r). */
static double norm2(const double *R, size_t m, size_t r) {
  double *G = calloc(r * r, sizeof *G), *x = malloc(r * sizeof *x), *y = malloc(r * sizeof *y), lam = 0;
  if (!G || !x || !y) {
    free(G), free(x), free(y);
    return INFINITY;
  }
  for (size_t i = 0; i < m; i++)
    for (size_t a = 0; a < r; a++)
      for (size_t b = 0; b < r; b++) G[a * r + b] += R[i * r + a] * R[i * r + b];
  for (size_t a = 0; a < r; a++) x[a] = 1.0 + 0.01 * (double)a;
  for (int it = 0; it < 300; it++) {
    double nn = 0;
    for (size_t a = 0; a < r; a++) {
      y[a] = 0;
      for (size_t b = 0; b < r; b++) y[a] += G[a * r + b] * x[b];
      nn += y[a] * y[a];
    }
    nn = sqrt(nn);
    if (!(nn > 0)) break;
    for (size_t a = 0; a < r; a++) x[a] = y[a] / nn;
    lam = nn;
  }
  free(G), free(x), free(y);
  return sqrt(lam);
}

/* sin of the largest principal angle between span(Q [rows, r], column j at Q[i*ldq + j]) and span(P, same
 * layout, ld r), and the orthonormality defect max|PᵀP - I| of P. `tr`: both are given as [r, rows] rows.
 * The inner products of the fp32 columns are exact sums (products of floats are exact in double; the
 * exact reduction adds them); the residual's norm is an r x r power iteration in double, in a fixed order. */
static double sin_theta(const float *Q, size_t ldq, const float *P, size_t rows, size_t r, int tr, double *defect) {
#define QE(i, j) ((double)(tr ? Q[(j) * ldq + (i)] : Q[(i) * ldq + (j)]))
#define PE(i, j) ((double)(tr ? P[(j) * rows + (i)] : P[(i) * r + (j)]))
  double *M = calloc(r * r, sizeof *M), *R = malloc(rows * r * sizeof *R), worst = 0, amax = 0;
  if (!M || !R) {
    free(M), free(R);
    return INFINITY;
  }
  for (size_t i = 0; i < rows; i++)
    for (size_t a = 0; a < r; a++) {
      double q = fabs(QE(i, a)), p = fabs(PE(i, a));
      amax = fmax(amax, fmax(q, p));
    }
  const double scale = dopt_xsum_scale(amax * amax); /* every product is at most amax^2 */
  for (size_t a = 0; a < r; a++)
    for (size_t b = 0; b < r; b++) {
      dopt_xacc qa = {{0}}, pa = {{0}};
      for (size_t i = 0; i < rows; i++) {
        dopt_xacc_add(&qa, scale, QE(i, a) * PE(i, b));
        dopt_xacc_add(&pa, scale, PE(i, a) * PE(i, b));
      }
      double qp = dopt_xacc_value(&qa, scale), pp = dopt_xacc_value(&pa, scale);
      M[a * r + b] = qp;
      double d = fabs(pp - (a == b ? 1.0 : 0.0));
      if (!(d <= worst)) worst = d;
    }
  for (size_t i = 0; i < rows; i++)
    for (size_t b = 0; b < r; b++) {
      double v = PE(i, b);
      for (size_t a = 0; a < r; a++) v -= QE(i, a) * M[a * r + b];
      R[i * r + b] = v;
    }
#undef QE
#undef PE
  double sn = norm2(R, rows, r);
  free(M), free(R);
  *defect = worst;
  return sn;
}

/* ---- counters: the recorded refreshes against ours ---------------------------------------------
 *
 * A recording with projectors holds one at every refresh of the recorded run (proj/STEP/PARAM/...): after each
 * replayed step, each parameter's galore.refreshes count (dopt_optim_counters) must equal the recording's
 * (0 or 1). A statistic events(galore.refreshes) per parameter that ever refreshed on either side: the
 * difference of the counts, bound 0. */

/* The recorded projector `which` ("projector", "projector_left", ...) of parameter p at step t: its elements
 * (*numel) on the first rank holding a piece of p that has it (*owner), or NULL. key[cap]: its tensor name. */
static const void *recorded_projector(vctx *c, int p, long t, const char *which, int *owner, size_t *numel, char *key,
                                      size_t cap) {
  const vr_index *ix = &c->rd.ix;
  snprintf(key, cap, "proj/%ld/%s/%s", t, ix->params[p].name, which);
  for (int rk = 0; rk < ix->world_size; rk++) {
    const void *x = vr_rank_piece(ix, rk, p) ? vr_reader_f32(&c->rd, rk, t, key, numel) : NULL;
    if (x) {
      *owner = rk;
      return x;
    }
  }
  return NULL;
}

/* Whether the recording holds a projector of parameter p at step t (its refresh); *owner: the rank that does. */
static int recorded_refresh(vctx *c, int p, long t, int *owner) {
  char key[VR_MAX_NAME + 128];
  size_t numel;
  return recorded_projector(c, p, t, "projector", owner, &numel, key, sizeof key) ||
         recorded_projector(c, p, t, "projector_left", owner, &numel, key, sizeof key);
}

static int check_refreshes(vctx *c, long t) {
  const vr_index *ix = &c->rd.ix;
  for (int p = 0; p < ix->nparams; p++) {
    dopt_counters k = DOPT_COUNTERS_INIT;
    dopt_status s = dopt_optim_counters(c->opt, p, &k);
    if (s != DOPT_OK) return lib_error("the reference's counters", s);
    int owner = -1;
    const int64_t ours = k.last[DOPT_COUNTER_REFRESHES], rec = recorded_refresh(c, p, t, &owner);
    if (ours == 0 && rec == 0 && c->ev_stat[p] < 0) continue; /* no refresh yet on either side */
    if (c->ev_stat[p] < 0) { /* a row of the recording's rank (or the first holding a piece) */
      for (int rk = 0; owner < 0 && rk < ix->world_size; rk++)
        if (vr_rank_piece(ix, rk, p)) owner = rk;
      const int pi = owner >= 0 ? piece_index(c, owner, p) : -1;
      vpiece_keys *pk = pi >= 0 ? &c->rt[owner].keys[pi] : NULL;
      const int si = pk && pk->nkeys < VR_MAX_KEYS ? new_stat(c, owner, &ix->ranks[owner].pieces[pi],
                                                               "events(galore.refreshes)")
                                                    : -1;
      if (si < 0) return cli_errorf(CMD, "parameter '%s': no room for its counters' statistic", ix->params[p].name);
      pk->stat[++pk->nkeys] = si; /* a row of the table, after its piece's states */
      c->ev_stat[p] = si;
    }
    vstat *st = &c->st[c->ev_stat[p]];
    const double d = (double)(ours > rec ? ours - rec : rec - ours);
    if (d > 0 && !st->first_beyond) st->ev_ours = ours, st->ev_rec = rec;
    if (d > st->max_abs) st->max_abs = d;
    record_result(c, c->ev_stat[p], t, d, 0.0);
  }
  return CLI_OK;
}

/* The projector hook (dopt_projector_fn): the recorded projector of this refresh, checked and adopted. */
static int proj_hook(void *user, int param, int64_t step, const float *grad, int64_t m, int64_t n, int64_t r,
                     float *left, float *right) {
  vctx *c = user;
  const vr_index *ix = &c->rd.ix;
  const char *pn = ix->params[param].name;
  const char *keys[2] = {left && right ? "projector_left" : "projector", left && right ? "projector_right" : "projector"};
  const void *rec[2] = {NULL, NULL};
  int owner = -1;
  for (int side = 0; side < 2; side++) {
    if (!(side ? right : left)) continue;
    char key[VR_MAX_NAME + 128];
    size_t numel = 0;
    rec[side] = recorded_projector(c, param, (long)step, keys[side], &owner, &numel, key, sizeof key);
    if (!rec[side]) {
      c->proj_none++;
      return 0; /* not recorded at this step: our own SVD */
    }
    if ((int64_t)numel != (side ? r * n : m * r)) {
      snprintf(c->hook_err, sizeof c->hook_err, "%s: tensor '%s' has %zu elements, expected %lld ([%lld, %lld])",
               c->rd.index_path, key, numel, (long long)(side ? r * n : m * r), (long long)(side ? r : m),
               (long long)(side ? n : r));
      return -1;
    }
  }
  const size_t k = (size_t)(r < (m < n ? m : n) ? r + 1 : r); /* sigma_{r+1} too, when there is one */
  float *U = malloc((size_t)m * k * sizeof *U), *S = malloc(k * sizeof *S), *Vt = malloc(k * (size_t)n * sizeof *Vt);
  float *P = malloc((size_t)(m > n ? m : n) * (size_t)r * sizeof *P);
  const dopt_svd_opts so = {DOPT_SVD_EXACT, -1, 0, 0, step - 1};
  unsigned ev = 0;
  if (!U || !S || !Vt || !P || dopt_galore_svd((size_t)m, (size_t)n, k, grad, &so, left != NULL, U, S, Vt, &ev) != DOPT_OK) {
    free(U), free(S), free(Vt), free(P);
    snprintf(c->hook_err, sizeof c->hook_err, "step %lld: parameter '%s': the SVD for the projector check failed",
             (long long)step, pn);
    return -1;
  }
  const double gap = (double)S[r - 1] - (k > (size_t)r ? (double)S[r] : 0.0);
  const double bound = gap > 0 ? 2.0 * PROJ_P(m, n) * PROJ_U * (double)S[0] / gap : INFINITY;
  double worst = 0, defect = 0;
  for (int side = 0; side < 2; side++) {
    if (!rec[side]) continue;
    const size_t rows = (size_t)(side ? n : m);
    memcpy(P, rec[side], rows * (size_t)r * sizeof *P);
    double d = INFINITY, sn = side ? sin_theta(Vt, (size_t)n, P, rows, (size_t)r, 1, &d) : sin_theta(U, k, P, rows, (size_t)r, 0, &d);
    if (!(sn <= worst)) worst = sn;
    if (!(d <= defect)) defect = d;
  }
  free(U), free(S), free(Vt);
  /* its statistic: a row of the owner rank's piece, created at the first refresh */
  if (c->proj_stat[param] < 0) {
    const vr_rank *rk = &ix->ranks[owner];
    int pi = -1;
    for (int i = 0; i < rk->npieces; i++)
      if (rk->pieces[i].param == param) pi = i;
    vpiece_keys *pk = &c->rt[owner].keys[pi];
    char sk[VR_MAX_KEY + 1];
    snprintf(sk, sizeof sk, "sin_theta(%s)", left && right ? "projectors" : "projector");
    int si = pk->nkeys < VR_MAX_KEYS ? new_stat(c, owner, &rk->pieces[pi], sk) : -1;
    if (si < 0) {
      free(P);
      snprintf(c->hook_err, sizeof c->hook_err, "parameter '%s': no room for its projector's statistic", pn);
      return -1;
    }
    pk->stat[++pk->nkeys] = si;
    c->proj_stat[param] = si;
  }
  const double orth_bound = 2.0 * PROJ_P(m, n) * PROJ_U;
  /* an orthonormality defect beyond its bound fails as an infinite angle: the projector would scale the update */
  const double measured = defect <= orth_bound ? worst : INFINITY;
  vstat *s = &c->st[c->proj_stat[param]];
  if (measured > s->max_abs || isnan(measured)) s->max_abs = measured;
  record_result(c, c->proj_stat[param], (long)step, measured, bound);
  if (!(measured <= bound)) {
    free(P);
    return 0; /* named by the verdict; the replay goes on with our own projector */
  }
  for (int side = 0; side < 2; side++)
    if (rec[side]) memcpy(side ? right : left, rec[side], (size_t)(side ? r * n : m * r) * sizeof(float));
  free(P);
  c->proj_adopted++;
  return 1;
}

/* --reference: REF holds, for the run's parameters (same names, shapes), the reference values at the steps the
 * run records; one rank, whole pieces. */
static int open_reference(vctx *c) {
  const vr_index *ix = &c->rd.ix;
  if (vr_reader_open(&c->ref, c->ref_path) != DOPT_OK) return cli_errorf(CMD, "--reference: %s", c->ref.err);
  const vr_index *rx = &c->ref.ix;
  if (rx->world_size != 1)
    return cli_errorf(CMD, "--reference %s: world_size %d, expected 1 (the single-device reference)", c->ref.index_path,
                      rx->world_size);
  if (rx->nparams != ix->nparams)
    return cli_errorf(CMD, "--reference %s: %d parameters, the recording has %d", c->ref.index_path, rx->nparams,
                      ix->nparams);
  for (int p = 0; p < ix->nparams; p++) {
    int q = vr_index_find_param(rx, ix->params[p].name);
    if (q < 0 || rx->params[q].numel != ix->params[p].numel)
      return cli_errorf(CMD, "--reference %s: parameter '%s' is %s", c->ref.index_path, ix->params[p].name,
                        q < 0 ? "missing" : "of another size");
  }
  if (rx->start_step != ix->start_step || rx->steps < ix->steps)
    return cli_errorf(CMD, "--reference %s: steps %ld..%ld, the recording's are %ld..%ld", c->ref.index_path,
                      rx->start_step + 1, rx->steps, ix->start_step + 1, ix->steps);
  return CLI_OK;
}

static int setup(vctx *c) {
  const vr_index *ix = &c->rd.ix;
  if (!c->ref_path && !ix->optimizer[0])
    return cli_errorf(CMD, "%s: optimizer.name is null: %s has no distopt optimizer; replay it with your own "
                           "(distopt.replay, docs/verify.md) and give --reference", c->rd.index_path,
                      ix->upstream[0] ? ix->upstream : "the recorded class");
  const verify_tol *tol = find_tol(ix->optimizer);
  if (c->rtol > 0.0) {
    c->tol_param = c->tol_state = c->rtol;
    c->tol_source = "--rtol";
  } else if (tol && (!c->stepwise || tol->step_param > 0)) {
    c->tol_param = c->stepwise ? tol->step_param : tol->param;
    c->tol_state = c->stepwise ? tol->step_state : tol->state;
    c->tol_source = c->stepwise ? "declared per step" : "declared";
  } else {
    return cli_errorf(CMD, "%s: optimizer.name '%s' has no declared%s tolerance (give --rtol)", c->rd.index_path,
                      ix->optimizer[0] ? ix->optimizer : "null", c->stepwise ? " per-step" : "");
  }
  if (ix->grads == VR_GRADS_BF16 && c->rtol <= 0.0)
    return cli_errorf(CMD, "%s: record.grads is BF16: the replay's gradients are the recorded run's rounded to bf16, "
                           "so the declared tolerances do not apply (give --rtol; docs/verify.md)", c->rd.index_path);
  if (c->stepwise && (!ix->record_params || !ix->record_states))
    return cli_errorf(CMD, "%s: --stepwise starts each step from the recorded parameters and states, but record.%s is "
                           "false", c->rd.index_path, !ix->record_params ? "params" : "states");
  int np = ix->nparams;
  size_t maxn = 1;
  for (int p = 0; p < np; p++)
    if ((size_t)ix->params[p].numel > maxn) maxn = (size_t)ix->params[p].numel;
  dopt_status s;
  if (c->ref_path) {
    int rc = open_reference(c);
    if (rc) return rc;
  } else {
    if ((s = dopt_optim_create(ix->optimizer, ix->group_hparams[0], &c->opt)) != DOPT_OK)
      return lib_error(c->rd.index_path, s);
    for (int g = 1; g < ix->ngroups; g++) {
      int gid;
      if ((s = dopt_optim_add_group(c->opt, ix->group_hparams[g], &gid)) != DOPT_OK) {
        char what[4400];
        snprintf(what, sizeof what, "%s: groups[%d].hparams", c->rd.index_path, g);
        return lib_error(what, s);
      }
    }
  }
  c->data = calloc((size_t)np, sizeof *c->data);
  c->grad = calloc((size_t)np, sizeof *c->grad);
  c->gptr = calloc((size_t)np, sizeof *c->gptr);
  c->rt = calloc((size_t)ix->world_size, sizeof *c->rt);
  c->proj_stat = malloc((size_t)np * sizeof *c->proj_stat);
  c->ev_stat = malloc((size_t)np * sizeof *c->ev_stat);
  c->gath = malloc(maxn * sizeof *c->gath);
  if (!c->data || !c->grad || !c->gptr || !c->rt || !c->proj_stat || !c->ev_stat || !c->gath)
    return cli_errorf(CMD, "out of memory");
  for (int p = 0; p < np; p++) {
    c->proj_stat[p] = -1, c->ev_stat[p] = -1;
    size_t n = (size_t)ix->params[p].numel;
    if (n > SIZE_MAX / sizeof(float) / 2) return cli_errorf(CMD, "parameter '%s': too large", ix->params[p].name);
    c->data[p] = malloc(n * sizeof(float));
    c->grad[p] = c->ref_path ? NULL : malloc(n * sizeof(float));
    if (!c->data[p] || (!c->ref_path && !c->grad[p]))
      return cli_errorf(CMD, "out of memory for parameter '%s' (%zu elements)", ix->params[p].name, n);
  }
  for (int r = 0; r < ix->world_size; r++) {
    const vr_rank *rk = &ix->ranks[r];
    c->rt[r].keys = calloc(rk->npieces > 0 ? (size_t)rk->npieces : 1, sizeof *c->rt[r].keys);
    if (!c->rt[r].keys) return cli_errorf(CMD, "out of memory");
    for (int i = 0; i < rk->npieces; i++) {
      const vr_piece *pc = &rk->pieces[i];
      int si = new_stat(c, r, pc, "");
      if (si < 0) return cli_errorf(CMD, "out of memory");
      c->rt[r].keys[i].stat[0] = si;
    }
  }
  /* every rank's first file (checked, its state keys seen), then the initial parameters: init/<p> of
   * each source piece, in its rank's first file */
  c->rd.on_state = key_stat;
  c->rd.user = c;
  c->rd.allow_digest = 1;
  for (int r = 0; r < ix->world_size; r++) {
    if (ix->ranks[r].npieces == 0) continue;
    int rc = file_for_step(c, r, ix->start_step + 1);
    if (rc) return rc;
  }
  for (int p = 0; p < np; p++)
    if (vr_reader_init(&c->rd, p, c->data[p]) != DOPT_OK) return cli_errorf(CMD, "%s", c->rd.err);
  if (c->ref_path) return CLI_OK;
  for (int p = 0; p < np; p++) {
    const vr_param *vp = &ix->params[p];
    dopt_param_config pc = DOPT_PARAM_CONFIG_INIT;
    pc.name = vp->name;
    pc.ndim = vp->ndim;
    memcpy(pc.shape, vp->shape, sizeof pc.shape);
    pc.data = c->data[p];
    pc.layer = dopt_layer_from_name(vp->name);
    int id;
    if ((s = dopt_optim_add_param(c->opt, vp->group, &pc, &id)) != DOPT_OK) return lib_error(c->rd.index_path, s);
  }
  if (ix->projectors && (s = dopt_optim_set_projector_hook(c->opt, proj_hook, c)) != DOPT_OK)
    return lib_error("record.projectors is true", s);
  /* states are as large as their parameter at most (elementwise, factored, low-rank); checked when forced */
  c->scratch_n = maxn;
  c->scratch = malloc(maxn * sizeof *c->scratch);
  c->mask = malloc(maxn);
  if (!c->scratch || !c->mask) return cli_errorf(CMD, "out of memory");
  if (ix->start_step > 0) return force_states(c, ix->start_step, 1); /* a window: its recorded start */
  return CLI_OK;
}

/* ---- the replay ---------------------------------------------------------------------- */

/* Step t's gradients; 1 when some parameter has only a digest (the step cannot be replayed). */
static int assemble_grads(vctx *c, long t, int *digest_only) {
  *digest_only = 0;
  for (int p = 0; p < c->rd.ix.nparams; p++) {
    int present = 0;
    if (vr_reader_grad(&c->rd, p, t, c->grad[p], &present) != DOPT_OK) return cli_errorf(CMD, "%s", c->rd.err);
    if (present < 0) *digest_only = 1;
    c->gptr[p] = present > 0 ? c->grad[p] : NULL;
  }
  return CLI_OK;
}

/* The flat range of `key`'s reference state (n elements) rank r's piece records; *mapped: its elements are
 * the piece's own (an elementwise state of a block piece: element i at vr_piece_elem(pc, i)), len of them. */
static int state_range(const vctx *c, const vr_piece *pc, const char *key, int64_t n, int64_t *lo, int64_t *len,
                       int *mapped) {
  const vr_param *vp = &c->rd.ix.params[pc->param];
  *mapped = 0;
  for (int i = 0; i < pc->nstates; i++)
    if (strcmp(pc->states[i].key, key) == 0) {
      *lo = pc->states[i].lo;
      *len = pc->states[i].len;
      return 0;
    }
  if (pc->lp.block_dim < 0 && pc->lp.lo == 0 && pc->lp.len == vp->numel) { /* the whole parameter: the whole state */
    *lo = 0;
    *len = n;
    return 0;
  }
  if (n == vp->numel) { /* elementwise */
    *lo = pc->lp.lo;
    *len = pc->lp.len;
    *mapped = pc->lp.block_dim >= 0;
    return 0;
  }
  return -1;
}

/* The reference's state `key` of parameter p after step t: its elements (*n) and 1; 0 when the reference keeps
 * no such F32 state (*none: it keeps no state at all for p: it never stepped). */
static int ref_state(vctx *c, int p, long t, const char *key, const float **data, int64_t *n, int *none) {
  *none = 0;
  if (c->ref_path) {
    char name[VR_MAX_NAME + VR_MAX_KEY + 64];
    size_t numel = 0;
    snprintf(name, sizeof name, "state/%ld/%s/%s", t, c->rd.ix.params[p].name, key);
    const void *b = vr_reader_f32(&c->ref, 0, t, name, &numel);
    if (!b) return 0;
    if (numel > c->scratch_n) { /* a reference state larger than the largest parameter: its own buffer */
      float *s = realloc(c->scratch, numel * sizeof *s);
      unsigned char *m = realloc(c->mask, numel);
      if (s) c->scratch = s;
      if (m) c->mask = m;
      if (!s || !m) return 0;
      c->scratch_n = numel;
    }
    memcpy(c->scratch, b, numel * sizeof(float));
    *data = c->scratch;
    *n = (int64_t)numel;
    return 1;
  }
  int nst = dopt_optim_num_states(c->opt, p);
  *none = nst == 0;
  for (int k = 0; k < nst; k++) {
    dopt_state_view v;
    if (dopt_optim_state(c->opt, p, k, &v) == DOPT_OK && strcmp(v.name, key) == 0) {
      if (v.dtype != DOPT_F32) return 0;
      *n = 1;
      for (int d = 0; d < v.ndim; d++) *n *= v.shape[d];
      *data = v.data;
      return 1;
    }
  }
  return 0;
}

/* The reference's step count of parameter p after step t; 0 when it has none to compare (--reference: REF
 * records none). */
static int ref_step(vctx *c, int p, long t, double *out) {
  if (!c->ref_path) {
    int64_t v = 0;
    dopt_optim_get_step(c->opt, p, &v);
    *out = (double)v;
    return 1;
  }
  char name[VR_MAX_NAME + 64];
  snprintf(name, sizeof name, "state/%ld/%s/step", t, c->rd.ix.params[p].name);
  dopt_st_tensor x;
  if (vr_reader_seek(&c->ref, 0, t) != DOPT_OK || dopt_st_find(c->ref.f[0], name, &x) != DOPT_OK) return 0;
  *out = scalar_value(&x);
  return 1;
}

static int compare_step(vctx *c, long t) {
  char key[VR_MAX_NAME + 128];
  if (c->ref_path && vr_reader_seek(&c->ref, 0, t) != DOPT_OK) return cli_errorf(CMD, "--reference: %s", c->ref.err);
  for (int r = 0; r < c->rd.ix.world_size; r++) {
    const vr_rank *rk = &c->rd.ix.ranks[r];
    const dopt_st_file *f = c->rd.f[r];
    for (int i = 0; i < rk->npieces; i++) {
      const vr_piece *pc = &rk->pieces[i];
      const vr_param *vp = &c->rd.ix.params[pc->param];
      const vpiece_keys *pk = &c->rt[r].keys[i];
      dopt_st_tensor rec;
      /* states first: they feed the parameter's update, so at the first divergent step the verdict
       * names the state where the computations parted (a wrong statistic), not its consequence */
      for (int j = 1; j <= pk->nkeys; j++) {
        vstat *s = &c->st[pk->stat[j]];
        snprintf(key, sizeof key, "state/%ld/%s/%s", t, vp->name, s->key);
        if (dopt_st_find(f, key, &rec) != DOPT_OK) continue;
        if (strcmp(s->key, "step") == 0) {
          double ref = 0, got = scalar_value(&rec);
          if (!ref_step(c, pc->param, t, &ref)) {
            s->no_ref = 1;
            continue;
          }
          double d = fabs(got - ref);
          if (!(d <= s->max_abs)) s->max_abs = d;
          s->compared++;
          double rel = d == 0.0 ? 0.0 : (ref != 0.0 ? d / fabs(ref) : INFINITY);
          if (rel > s->max_rel) s->max_rel = rel;
          add_point(c, s, t, rel);
          if (d != 0.0) {
            if (!s->first_beyond) s->first_beyond = t;
            if (!c->verdict_step) {
              c->verdict_step = t;
              c->verdict_stat = (int)(s - c->st);
              c->verdict_value = rel;
            }
          }
          continue;
        }
        const float *data = NULL;
        int64_t n = 0, lo, len;
        int none = 0;
        if (!ref_state(c, pc->param, t, s->key, &data, &n, &none)) {
          if (!none) { /* a key the reference does not keep: listed, not compared */
            s->no_ref = 1;
            continue;
          }
          /* torch has state, the reference none: the parameter never stepped here */
          s->compared++;
          s->max_abs = INFINITY;
          record_result(c, pk->stat[j], t, INFINITY, c->tol_state);
          continue;
        }
        int mapped;
        if (state_range(c, pc, s->key, n, &lo, &len, &mapped)) {
          char el[96];
          dopt_layout_piece_text(&pc->lp, el, sizeof el);
          return cli_errorf(CMD, "%s: rank %d records state '%s' of '%s' for elements %s of the parameter but "
                                 "declares no range of the state (ranks[%d].pieces[].states)",
                            c->rd.index_path, r, s->key, vp->name, el, r);
        }
        if (mapped) { /* an elementwise state of a block: the piece's elements, gathered */
          vr_piece_get(pc, data, c->gath);
          data = c->gath, lo = 0;
        }
        if (lo + len > n && !mapped)
          return cli_errorf(CMD, "%s: rank %d, state '%s' of '%s': range [%lld, %lld) is outside the reference's %lld "
                                 "elements", c->rd.index_path, r, s->key, vp->name, (long long)lo, (long long)(lo + len),
                            (long long)n);
        if ((int64_t)rec.numel != len)
          return cli_errorf(CMD, "rank %d: tensor '%s' has %zu elements, expected %lld (the state range [%lld, %lld))",
                            r, key, rec.numel, (long long)len, (long long)lo, (long long)(lo + len));
        double rel = compare_f32(s, rec.data, data + lo, (size_t)len);
        record_result(c, pk->stat[j], t, rel, c->tol_state);
      }
      snprintf(key, sizeof key, "param/%ld/%s", t, vp->name);
      if (dopt_st_find(f, key, &rec) == DOPT_OK) {
        vstat *s = &c->st[pk->stat[0]];
        const float *ref = ref_param(c, pc->param, t);
        if (!ref)
          return cli_errorf(CMD, "--reference %s: no '%s' (the recording compares it)", c->ref.index_path, key);
        if (pc->lp.block_dim >= 0) { /* a block: its elements gathered */
          vr_piece_get(pc, ref, c->gath);
          ref = c->gath;
        }
        double rel = compare_f32(s, rec.data, pc->lp.block_dim >= 0 ? ref : ref + pc->lp.lo, (size_t)pc->lp.len);
        record_result(c, pk->stat[0], t, rel, c->tol_param);
      } else if (c->rd.ix.record_params && t % c->rd.ix.every == 0) {
        /* a recorded step without the parameter: a lost or wrong block would otherwise pass unchecked */
        return cli_errorf(CMD, "%s: rank %d's file for step %ld has no '%s' (record.params is true and every=%ld)",
                          c->rd.index_path, r, t, key, c->rd.ix.every);
      }
    }
  }
  return CLI_OK;
}

/* record.grad_agree: every rank that has a whole gradient of parameter p at step t recorded the SHA-256 of it
 * (grad_agree/<t>/<p>); those ranks hold copies of the same gradient (DDP replicas, ZeRO: the dp average), so
 * every digest must equal the lowest such rank's (a rank without one, a pipeline stage that does not hold p,
 * is not compared). The first difference, by step, parameter and rank, is a divergence. */
static void check_agreement(vctx *c, long t) {
  const vr_index *ix = &c->rd.ix;
  if (!ix->grad_agree || c->agree_step) return;
  c->agree_checked++;
  char key[VR_MAX_NAME + 64];
  for (int p = 0; p < ix->nparams; p++) {
    snprintf(key, sizeof key, "grad_agree/%ld/%s", t, ix->params[p].name);
    const unsigned char *base = NULL;
    int b = -1;
    for (int r = 0; r < ix->world_size; r++) {
      const unsigned char *d = vr_reader_digest(&c->rd, r, t, key);
      if (!d) continue; /* no whole gradient of p there (another pipeline stage's, or none this step) */
      if (!base) {
        base = d, b = r;
        continue;
      }
      if (memcmp(d, base, 32) != 0) {
        c->agree_step = t, c->agree_param = p, c->agree_rank = r, c->agree_base = b;
        return;
      }
    }
  }
}

/* A verdict found before the values: the recorder's hyperparameter disagreement (schema 4), or the gradients'
 * digests; the first of them at or before the values' first divergence, at its step the hyperparameters
 * first (a cause precedes its consequences: a wrong gradient, values). */
typedef struct early {
  const char *kind; /* "hparams", "gradients"; NULL: none */
  long step;
  int rank;
  const char *tensor; /* the key or the parameter */
  char text[VR_MAX_NAME + 160];
} early;

static void hp_value_text(double v, char *buf, size_t cap) {
  if (isnan(v)) snprintf(buf, cap, "unset");
  else snprintf(buf, cap, "%.9g", v);
}

static int early_verdict(const vctx *c, early *e) {
  const long hs = c->rd.ix.disagree.step, as = c->agree_step, vs = c->verdict_step;
  memset(e, 0, sizeof *e);
  if (hs && (!vs || hs <= vs) && (!as || hs <= as)) {
    char a[40], b[40];
    hp_value_text(c->rd.ix.disagree.value, a, sizeof a);
    hp_value_text(c->rd.ix.disagree.rank0, b, sizeof b);
    e->kind = "hparams", e->step = hs, e->rank = c->rd.ix.disagree.rank, e->tensor = c->rd.ix.disagree.key;
    snprintf(e->text, sizeof e->text, "DIVERGED at step %ld (hyperparameters: rank %d's %s of group %d is %s, rank "
             "0's %s, which the replay uses)", hs, e->rank, e->tensor, c->rd.ix.disagree.group, a, b);
  } else if (as && (!vs || as <= vs)) {
    e->kind = "gradients", e->step = as, e->rank = c->agree_rank, e->tensor = c->rd.ix.params[c->agree_param].name;
    snprintf(e->text, sizeof e->text, "DIVERGED at step %ld (gradient of %s: rank %d differs from rank %d)", as,
             e->tensor, c->agree_rank, c->agree_base);
  }
  return e->kind != NULL;
}

/* --stepwise: the state after step t was recorded (parameters and states), so step t+1 can start from it. */
static int recorded_after(const vctx *c, long t) {
  return t == c->rd.ix.start_step || (c->rd.ix.record_params && c->rd.ix.record_states && t % c->rd.ix.every == 0);
}

static int replay(vctx *c) {
  const vr_index *ix = &c->rd.ix;
  long ch = 0;
  int synced = 1; /* --stepwise: the reference's state is the recorded run's (0 after a skipped step) */
  for (long t = ix->start_step + 1; t <= ix->steps; t++) {
    int rc;
    /* --stepwise: from the state recorded after step t-1 (read before moving to step t's block) */
    if (c->stepwise && !c->ref_path && t - 1 > ix->start_step && recorded_after(c, t - 1)) {
      if ((rc = force_states(c, t - 1, 0))) return rc;
      synced = 1;
    }
    for (int r = 0; r < ix->world_size; r++)
      if ((rc = file_for_step(c, r, t))) return rc;
    check_agreement(c, t);
    for (; !c->ref_path && ch < ix->nchanges && ix->changes[ch].step == t; ch++) {
      const vr_change *h = &ix->changes[ch];
      dopt_status s = dopt_optim_set_hparam(c->opt, h->group, h->key, h->value);
      if (s != DOPT_OK) {
        char what[4400];
        snprintf(what, sizeof what, "%s: hparam_changes[%ld] (step %ld)", c->rd.index_path, ch, t);
        return lib_error(what, s);
      }
    }
    if (!c->ref_path) {
      int digest_only = 0;
      if ((rc = assemble_grads(c, t, &digest_only))) return rc;
      if (digest_only && !c->stepwise)
        return cli_errorf(CMD, "%s: step %ld keeps only gradient digests: the accumulated replay needs every step's "
                               "gradient (--stepwise replays the steps whose gradients are kept)", c->rd.index_path, t);
      if (c->stepwise) {
        if (digest_only || !synced) { /* not replayed: the next step starts from its recorded state again */
          c->not_replayed++;
          synced = 0;
          continue;
        }
      }
      dopt_status s = dopt_optim_step(c->opt, c->gptr);
      if (c->hook_err[0]) return cli_errorf(CMD, "%s", c->hook_err);
      if (s != DOPT_OK) {
        char what[64];
        snprintf(what, sizeof what, "step %ld: the reference step failed", t);
        return lib_error(what, s);
      }
      if (ix->projectors && (rc = check_refreshes(c, t))) return rc;
    }
    long before = 0;
    for (int i = 0; i < c->nst; i++) before += c->st[i].compared;
    if ((rc = compare_step(c, t))) return rc;
    long after = 0;
    for (int i = 0; i < c->nst; i++) after += c->st[i].compared;
    if (after > before) c->compared_steps++;
  }
  long compared = 0;
  for (int i = 0; i < c->nst; i++) compared += c->st[i].compared;
  if (compared == 0)
    return cli_errorf(CMD, "%s: no recorded parameter or state (param/<t>/..., state/<t>/...) to compare", c->rd.index_path);
  return CLI_OK;
}

/* ---- reports ------------------------------------------------------------------------- */

static void stat_name(const vctx *c, const vstat *s, char *buf, size_t cap) {
  const char *pn = c->rd.ix.params[s->param].name;
  if (s->key[0]) snprintf(buf, cap, "%s/%s", pn, s->key);
  else snprintf(buf, cap, "%s", pn);
}

static void piece_text(const vctx *c, const vstat *s, char *buf, size_t cap) {
  const vr_param *vp = &c->rd.ix.params[s->param];
  const dopt_layout_piece *lp = &s->pc->lp;
  int k;
  if (lp->block_dim < 0 && lp->lo == 0 && lp->len == vp->numel) k = snprintf(buf, cap, "whole");
  else if (lp->block_dim < 0) k = snprintf(buf, cap, "[%lld,%lld)", (long long)lp->lo, (long long)(lp->lo + lp->len));
  else if (lp->lo == 0 && lp->len == dopt_layout_piece_extent(vp->ndim, vp->shape, lp))
    k = snprintf(buf, cap, "d%d[%lld,%lld)", lp->block_dim, (long long)lp->block_lo, (long long)(lp->block_lo + lp->block_len));
  else k = snprintf(buf, cap, "d%d[%lld,%lld)[%lld,%lld)", lp->block_dim, (long long)lp->block_lo,
                    (long long)(lp->block_lo + lp->block_len), (long long)lp->lo, (long long)(lp->lo + lp->len));
  if (k >= 0 && (size_t)k < cap && lp->stage >= 0) k += snprintf(buf + k, cap - (size_t)k, " s%d", lp->stage);
  if (k >= 0 && (size_t)k < cap && lp->expert >= 0) snprintf(buf + k, cap - (size_t)k, " e%d", lp->expert);
}

static int text_width(const char *s) {
  int w = 0;
  for (; *s; s++) w += ((unsigned char)*s & 0xC0) != 0x80;
  return w;
}

/* Rows: parameters in index order, each rank's piece, its states indented. */
static int *row_order(const vctx *c) {
  int *o = malloc((size_t)(c->nst > 0 ? c->nst : 1) * sizeof *o), k = 0;
  if (!o) return NULL;
  for (int p = 0; p < c->rd.ix.nparams; p++)
    for (int r = 0; r < c->rd.ix.world_size; r++) {
      int i = piece_index(c, r, p);
      if (i < 0) continue;
      const vpiece_keys *pk = &c->rt[r].keys[i];
      for (int j = 0; j <= pk->nkeys; j++) o[k++] = pk->stat[j];
    }
  return o;
}

static void print_table(const vctx *c) {
  const vr_index *ix = &c->rd.ix;
  printf("verify: %s %s%s%s\n", ix->optimizer[0] ? ix->optimizer : "(no distopt optimizer)",
         ix->group_hparams[0][0] ? ix->group_hparams[0] : "(defaults)", ix->upstream[0] ? " | recorded from " : "",
         ix->upstream);
  for (int g = 1; g < ix->ngroups; g++) printf("  group %d: %s\n", g, ix->group_hparams[g]);
  printf("  torch %s (CPU capability %s) | world size %d | %ld step%s, parameters and states every %ld | %s%s\n",
         ix->torch_version[0] ? ix->torch_version : "?", ix->cpu_capability[0] ? ix->cpu_capability : "?",
         ix->world_size, ix->steps, ix->steps == 1 ? "" : "s", ix->every, c->trace,
         ix->complete ? "" : " (interrupted: a prefix)");
  if (c->ref_path) printf("  reference: %s (a recording of reference values, distopt.replay)\n", c->ref_path);
  printf("  mode: %s\n", c->stepwise ? "stepwise (teacher-forced: each step starts from the recorded state before it)"
                                     : "accumulated (the reference runs freely from the recorded start)");
  if (ix->start_step) printf("  window: steps %ld..%ld (the reference starts from the states recorded at step %ld)\n",
                             ix->start_step + 1, ix->steps, ix->start_step);
  if (ix->grads == VR_GRADS_BF16) printf("  gradients recorded as bf16 (the replay's gradients are rounded)\n");
  if (c->not_replayed) printf("  %ld step%s not replayed (only gradient digests, or no recorded state before)\n",
                              c->not_replayed, c->not_replayed == 1 ? "" : "s");
  if (c->proj_adopted || c->proj_none)
    printf("  GaLore projectors: %ld recorded one%s adopted after the subspace check, %ld refresh%s without one (our "
           "SVD)\n", c->proj_adopted, c->proj_adopted == 1 ? "" : "s", c->proj_none, c->proj_none == 1 ? "" : "es");
  if (ix->nchanges && !c->ref_path)
    printf("  %ld hyperparameter change%s replayed (an lr schedule)\n", ix->nchanges, ix->nchanges == 1 ? "" : "s");
  printf("  tolerance (normwise relative max|rec-ref|/max|ref|): parameters %g, states %g (%s%s%s); step counts exact\n",
         c->tol_param, c->tol_state, c->tol_source, strncmp(c->tol_source, "declared", 8) == 0 ? " for " : "",
         strncmp(c->tol_source, "declared", 8) == 0 ? ix->optimizer : "");
  int *order = row_order(c);
  int namew = 6;
  char name[VR_MAX_NAME + VR_MAX_KEY + 2], piece[128];
  for (int i = 0; i < c->nst; i++) {
    stat_name(c, &c->st[i], name, sizeof name);
    int w = text_width(name) + (c->st[i].key[0] ? 2 : 0);
    if (w > namew) namew = w;
  }
  printf("%4s  %-*s  %-13s  %11s  %10s  %11s  %2s  %s\n", "rank", namew, "tensor", "piece", "max abs err", "max ULP",
         "max rel err", "ok", "first beyond");
  for (int k = 0; k < c->nst; k++) {
    const vstat *s = &c->st[order ? order[k] : k];
    if (s->compared == 0 && !s->no_ref) continue; /* nothing recorded for it */
    stat_name(c, s, name, sizeof name);
    piece_text(c, s, piece, sizeof piece);
    int ind = s->key[0] ? 2 : 0;
    printf("%4d  %*s%s%*s  %-13s", s->rank, ind, "", name, namew - ind - text_width(name), "", s->key[0] ? "" : piece);
    if (s->no_ref) {
      printf("  (not compared: the reference keeps no F32 state '%s')\n", s->key);
      continue;
    }
    char first[24] = "-";
    if (s->first_beyond) snprintf(first, sizeof first, "%ld", s->first_beyond);
    printf("  %11.3g  %10llu  %11.3g  %s   %s\n", s->max_abs, (unsigned long long)s->max_ulp, s->max_rel,
           s->first_beyond ? "\xE2\x9C\x97" : "\xE2\x9C\x93", first);
  }
  free(order);
  uint64_t nan = 0;
  for (int i = 0; i < c->nst; i++) nan += c->st[i].nan_pairs;
  if (nan) printf("NaN on both sides (equal under the NaN policy): %llu element-steps at most\n", (unsigned long long)nan);
  double wp = 0, ws = 0;
  int ncmp = 0, np = 0, ns = 0;
  for (int i = 0; i < c->nst; i++) {
    const vstat *s = &c->st[i];
    if (!s->compared) continue;
    ncmp++;
    if (strcmp(s->key, "step") == 0) continue;
    if (s->key[0]) ws = s->max_rel > ws ? s->max_rel : ws, ns++;
    else wp = s->max_rel > wp ? s->max_rel : wp, np++;
  }
  if (c->rd.ix.grad_agree)
    printf("gradients: every rank's digest of each parameter's gradient compared at %ld step%s%s\n", c->agree_checked,
           c->agree_checked == 1 ? "" : "s", c->agree_step ? " (until the first difference)" : ", all equal");
  early e;
  if (early_verdict(c, &e)) {
    printf("verdict: %s\n", e.text);
  } else if (!c->verdict_step) {
    char pw[64] = "none recorded", sw[64] = "none recorded";
    if (np) snprintf(pw, sizeof pw, "%.3g of %g", wp, c->tol_param);
    if (ns) snprintf(sw, sizeof sw, "%.3g of %g", ws, c->tol_state);
    printf("verdict: WITHIN TOLERANCE (worst normwise relative error: parameters %s, states %s; "
           "%d tensor%s, %ld recorded step%s, %d rank%s)\n",
           pw, sw, ncmp, ncmp == 1 ? "" : "s", c->compared_steps, c->compared_steps == 1 ? "" : "s", ix->world_size,
           ix->world_size == 1 ? "" : "s");
  } else {
    const vstat *s = &c->st[c->verdict_stat];
    stat_name(c, s, name, sizeof name);
    if (strcmp(s->key, "step") == 0)
      printf("verdict: DIVERGED at step %ld (tensor %s, rank %d: the step count differs from the reference's)\n",
             c->verdict_step, name, s->rank);
    else if (strncmp(s->key, "sin_theta(", 10) == 0)
      printf("verdict: DIVERGED at step %ld (tensor %s, rank %d: the recorded projector's subspace is %.3g from ours, "
             "beyond the bound %.3g)\n", c->verdict_step, name, s->rank, c->verdict_value, s->tol_first);
    else if (strncmp(s->key, "events(", 7) == 0)
      printf("verdict: DIVERGED at step %ld (events: galore.refreshes of %s: reference %lld, recorded %lld)\n",
             c->verdict_step, ix->params[s->param].name, (long long)s->ev_ours, (long long)s->ev_rec);
    else
      printf("verdict: DIVERGED at step %ld (tensor %s, rank %d: normwise relative error %.3g > %g)\n", c->verdict_step,
             name, s->rank, c->verdict_value, s->key[0] ? c->tol_state : c->tol_param);
  }
}

/* --json / --plot after the replay: written atomically by the one rule for outputs (core/files.h); a failure
 * here is the run's (exit 1), its input was checked before the replay. */
static int write_output(const vctx *c, const char *path, int (*body)(FILE *f, const void *ctx), const char *what) {
  dopt_status s = dopt__write_stream(path, DOPT_W_OUTPUT, body, c);
  if (s == DOPT_OK) return CLI_OK;
  lib_error(what, s);
  return CLI_FAIL;
}

static int json_body(FILE *f, const void *ctx) {
  const vctx *c = ctx;
  const vr_index *ix = &c->rd.ix;
  cJSON *root = cJSON_CreateObject();
  if (!root) return 0;
  char name[VR_MAX_NAME + VR_MAX_KEY + 2];
  cJSON_AddNumberToObject(root, "schema_version", VR_JSON_SCHEMA);
  cJSON_AddStringToObject(root, "kind", "distopt-verify");
  cJSON_AddStringToObject(root, "trace", c->trace);
  cJSON_AddStringToObject(root, "optimizer", ix->optimizer);
  cJSON *groups = cJSON_AddArrayToObject(root, "hparams");
  for (int g = 0; groups && g < ix->ngroups; g++) cJSON_AddItemToArray(groups, cJSON_CreateString(ix->group_hparams[g]));
  cJSON_AddStringToObject(root, "upstream", ix->upstream);
  cJSON_AddStringToObject(root, "torch_version", ix->torch_version);
  cJSON_AddStringToObject(root, "cpu_capability", ix->cpu_capability);
  cJSON_AddNumberToObject(root, "world_size", ix->world_size);
  cJSON_AddNumberToObject(root, "steps", (double)ix->steps);
  cJSON_AddBoolToObject(root, "complete", ix->complete);
  cJSON_AddStringToObject(root, "mode", c->stepwise ? "stepwise" : "accumulated");
  cJSON_AddStringToObject(root, "reference", c->ref_path ? "recording" : "distopt");
  cJSON_AddNumberToObject(root, "start_step", (double)ix->start_step);
  cJSON_AddStringToObject(root, "grads", ix->grads == VR_GRADS_BF16 ? "BF16" : "F32");
  cJSON_AddNumberToObject(root, "not_replayed", (double)c->not_replayed);
  cJSON_AddNumberToObject(root, "projectors_adopted", (double)c->proj_adopted);
  cJSON *tol = cJSON_AddObjectToObject(root, "tolerance");
  if (tol) {
    cJSON_AddStringToObject(tol, "metric", "normwise_relative");
    cJSON_AddNumberToObject(tol, "param", c->tol_param);
    cJSON_AddNumberToObject(tol, "state", c->tol_state);
    cJSON_AddStringToObject(tol, "source", c->tol_source);
  }
  cJSON_AddBoolToObject(root, "per_step_truncated", c->truncated);
  cJSON *ts = cJSON_AddArrayToObject(root, "tensors");
  int *order = row_order(c);
  for (int k = 0; ts && k < c->nst; k++) {
    const vstat *s = &c->st[order ? order[k] : k];
    if (s->compared == 0 && !s->no_ref) continue;
    cJSON *o = cJSON_CreateObject();
    if (!o) break;
    cJSON_AddItemToArray(ts, o);
    stat_name(c, s, name, sizeof name);
    cJSON_AddStringToObject(o, "name", name);
    cJSON_AddStringToObject(o, "param", ix->params[s->param].name);
    if (s->key[0]) cJSON_AddStringToObject(o, "state", s->key);
    else cJSON_AddNullToObject(o, "state");
    cJSON_AddNumberToObject(o, "rank", s->rank);
    cJSON_AddNumberToObject(o, "lo", (double)s->pc->lp.lo);
    cJSON_AddNumberToObject(o, "len", (double)s->pc->lp.len);
    if (s->pc->lp.block_dim >= 0) {
      cJSON *bj = cJSON_AddObjectToObject(o, "block");
      if (bj) {
        cJSON_AddNumberToObject(bj, "dim", s->pc->lp.block_dim);
        cJSON_AddNumberToObject(bj, "lo", (double)s->pc->lp.block_lo);
        cJSON_AddNumberToObject(bj, "len", (double)s->pc->lp.block_len);
      }
    }
    if (s->pc->lp.stage >= 0) cJSON_AddNumberToObject(o, "stage", s->pc->lp.stage);
    if (s->pc->lp.expert >= 0) cJSON_AddNumberToObject(o, "expert", s->pc->lp.expert);
    cJSON_AddBoolToObject(o, "compared", !s->no_ref);
    cJSON_AddNumberToObject(o, "max_abs", s->max_abs);
    cJSON_AddNumberToObject(o, "max_ulp", (double)s->max_ulp); /* above 2^53 rounded; UINT64_MAX: NaN vs number */
    cJSON_AddNumberToObject(o, "max_rel", s->max_rel);
    cJSON_AddNumberToObject(o, "nan_pairs", (double)s->nan_pairs);
    if (s->first_beyond) cJSON_AddNumberToObject(o, "first_beyond", (double)s->first_beyond);
    else cJSON_AddNullToObject(o, "first_beyond");
    if (s->first_beyond) cJSON_AddNumberToObject(o, "tolerance_at_first_beyond", s->tol_first);
    cJSON *st = cJSON_AddArrayToObject(o, "steps"), *rl = cJSON_AddArrayToObject(o, "rel_per_step");
    for (long i = 0; st && rl && i < s->npts; i++) {
      cJSON_AddItemToArray(st, cJSON_CreateNumber((double)s->pt_step[i]));
      cJSON_AddItemToArray(rl, cJSON_CreateNumber(s->pt_rel[i]));
    }
  }
  free(order);
  cJSON *v = cJSON_AddObjectToObject(root, "verdict");
  cJSON_AddBoolToObject(root, "gradients_compared", c->rd.ix.grad_agree != 0);
  early e;
  if (v && early_verdict(c, &e)) {
    cJSON_AddStringToObject(v, "kind", e.kind);
    cJSON_AddNumberToObject(v, "step", (double)e.step);
    cJSON_AddStringToObject(v, "tensor", e.tensor);
    cJSON_AddNumberToObject(v, "rank", e.rank);
  } else if (v && !c->verdict_step) {
    cJSON_AddStringToObject(v, "kind", "within_tolerance");
    cJSON_AddNullToObject(v, "step");
    cJSON_AddNullToObject(v, "tensor");
    cJSON_AddNullToObject(v, "rank");
  } else if (v) {
    const vstat *s = &c->st[c->verdict_stat];
    stat_name(c, s, name, sizeof name);
    cJSON_AddStringToObject(v, "kind", strcmp(s->key, "step") == 0                ? "step_counter"
                                       : strncmp(s->key, "sin_theta(", 10) == 0 ? "projector"
                                       : strncmp(s->key, "events(", 7) == 0     ? "events"
                                                                                : "diverged");
    cJSON_AddNumberToObject(v, "step", (double)c->verdict_step);
    cJSON_AddStringToObject(v, "tensor", name);
    cJSON_AddNumberToObject(v, "rank", s->rank);
    cJSON_AddNumberToObject(v, "rel", c->verdict_value);
  }
  char *text = cJSON_Print(root);
  cJSON_Delete(root);
  if (!text) return 0;
  int ok = fputs(text, f) >= 0 && fputc('\n', f) != EOF;
  free(text);
  return ok;
}

/* ---- SVG: normwise relative error against step, per tensor, with the tolerances ------------- */


#define SV_W 960
#define SV_H 540
#define SV_L 80.0
#define SV_R 660.0
#define SV_T 70.0
#define SV_B 470.0

static double sv_y(double v, int dlo, int dhi) {
  if (!(v > 0.0)) return SV_B;
  if (isinf(v)) return SV_T;
  double y = SV_B - (log10(v) - dlo) / (double)(dhi - dlo) * (SV_B - SV_T);
  return y < SV_T ? SV_T : y > SV_B ? SV_B : y;
}

static int svg_body(FILE *f, const void *ctx) {
  const vctx *c = ctx;
  static const char *const pal[] = {"#1f77b4", "#d62728", "#ff7f0e", "#9467bd", "#2ca02c",
                                    "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f"};
  double mn = INFINITY, mx = 0;
  for (int i = 0; i < c->nst; i++)
    for (long k = 0; k < c->st[i].npts; k++) {
      double v = c->st[i].pt_rel[k];
      if (v > 0 && isfinite(v)) {
        if (v < mn) mn = v;
        if (v > mx) mx = v;
      }
    }
  double lo_t = c->tol_param < c->tol_state ? c->tol_param : c->tol_state;
  double hi_t = c->tol_param > c->tol_state ? c->tol_param : c->tol_state;
  if (lo_t < mn) mn = lo_t;
  if (hi_t > mx) mx = hi_t;
  int dlo = (int)floor(log10(mn)), dhi = (int)ceil(log10(mx));
  if (dhi <= dlo) dhi = dlo + 1;
  double x0 = 1, x1 = c->rd.ix.steps > 1 ? (double)c->rd.ix.steps : 2;
#define SX(s) (SV_L + ((double)(s) - x0) / (x1 - x0) * (SV_R - SV_L))
  char name[VR_MAX_NAME + VR_MAX_KEY + 2];
  fprintf(f, "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" "
             "height=\"%d\" viewBox=\"0 0 %d %d\" font-family=\"sans-serif\" font-size=\"12\">\n",
          SV_W, SV_H, SV_W, SV_H);
  fprintf(f, "<rect width=\"%d\" height=\"%d\" fill=\"#ffffff\"/>\n<text x=\"%.0f\" y=\"26\" font-size=\"16\" "
             "font-weight=\"bold\">distopt verify: ", SV_W, SV_H, SV_L);
  cmp_xml_text(f, c->rd.ix.optimizer, 0);
  fputs(c->rd.ix.upstream[0] ? " vs recorded " : "", f);
  cmp_xml_text(f, c->rd.ix.upstream, 0);
  fprintf(f, " (world size %d)</text>\n<text x=\"%.0f\" y=\"46\" fill=\"#444444\">normwise relative error "
             "max|recorded \xE2\x88\x92 reference| / max|reference| per recorded step (log scale); dashed: tolerances</text>\n",
          c->rd.ix.world_size, SV_L);
  fprintf(f, "<rect x=\"%.0f\" y=\"%.0f\" width=\"%.0f\" height=\"%.0f\" fill=\"none\" stroke=\"#333333\"/>\n", SV_L,
          SV_T, SV_R - SV_L, SV_B - SV_T);
  for (int d = dlo; d <= dhi; d++) {
    double y = sv_y(pow(10.0, d), dlo, dhi);
    fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#e4e4e4\"/><text x=\"%.1f\" y=\"%.1f\" "
               "text-anchor=\"end\">1e%d</text>\n", SV_L, y, SV_R, y, SV_L - 6, y + 4, d);
  }
  fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">0</text>\n", SV_L - 6, SV_B + 4);
  fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">1</text><text x=\"%.1f\" y=\"%.1f\" "
             "text-anchor=\"middle\">%ld</text><text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">step</text>\n",
          SX(1), SV_B + 18, SX(x1), SV_B + 18, (long)x1, (SV_L + SV_R) / 2, SV_B + 36);
  fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#b00000\" stroke-dasharray=\"6 4\"/>"
             "<text x=\"%.1f\" y=\"%.1f\" fill=\"#b00000\" font-size=\"10\">parameters %g</text>\n",
          SV_L, sv_y(c->tol_param, dlo, dhi), SV_R, sv_y(c->tol_param, dlo, dhi), SV_L + 4,
          sv_y(c->tol_param, dlo, dhi) - 3, c->tol_param);
  fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#e6a100\" stroke-dasharray=\"2 3\"/>"
             "<text x=\"%.1f\" y=\"%.1f\" fill=\"#a07000\" font-size=\"10\">states %g</text>\n",
          SV_L, sv_y(c->tol_state, dlo, dhi), SV_R, sv_y(c->tol_state, dlo, dhi), SV_L + 140,
          sv_y(c->tol_state, dlo, dhi) - 3, c->tol_state);
  int drawn = 0;
  double ly = SV_T + 4;
  for (int i = 0; i < c->nst; i++) {
    const vstat *s = &c->st[i];
    if (s->npts == 0 || strcmp(s->key, "step") == 0) continue;
    const char *col = pal[drawn % 10];
    fprintf(f, "<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"1.4\"%s points=\"", col,
            s->key[0] ? " stroke-dasharray=\"5 2\"" : "");
    for (long k = 0; k < s->npts; k++)
      fprintf(f, "%s%.1f,%.1f", k ? " " : "", SX(s->pt_step[k]), sv_y(s->pt_rel[k], dlo, dhi));
    stat_name(c, s, name, sizeof name);
    fprintf(f, "\"><title>rank %d ", s->rank);
    cmp_xml_text(f, name, 0);
    fputs("</title></polyline>\n", f);
    if (drawn < 24) {
      fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"%s\" stroke-width=\"2\"/><text x=\"%.1f\" "
                 "y=\"%.1f\" font-size=\"11\">rank %d ", SV_R + 16, ly - 4, SV_R + 36, ly - 4, col, SV_R + 42, ly, s->rank);
      cmp_xml_text(f, name, 0);
      fputs("</text>\n", f);
      ly += 16;
    }
    drawn++;
  }
  if (drawn > 24) fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" font-size=\"11\">\xE2\x80\xA6 and %d more</text>\n", SV_R + 42, ly, drawn - 24);
  early e;
  if (early_verdict(c, &e)) {
    fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#b00000\"/>\n", SX(e.step), SV_T,
            SX(e.step), SV_B);
    fprintf(f, "<text x=\"%.0f\" y=\"%d\" font-weight=\"bold\" fill=\"#b00000\">verdict: ", SV_L, SV_H - 14);
    cmp_xml_text(f, e.text, 0);
    fputs("</text>\n", f);
  } else if (c->verdict_step) {
    const vstat *s = &c->st[c->verdict_stat];
    stat_name(c, s, name, sizeof name);
    fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#b00000\"/>\n", SX(c->verdict_step), SV_T,
            SX(c->verdict_step), SV_B);
    fprintf(f, "<text x=\"%.0f\" y=\"%d\" font-weight=\"bold\" fill=\"#b00000\">verdict: DIVERGED at step %ld (tensor ",
            SV_L, SV_H - 14, c->verdict_step);
    cmp_xml_text(f, name, 0);
    fprintf(f, ", rank %d)</text>\n", s->rank);
  } else {
    fprintf(f, "<text x=\"%.0f\" y=\"%d\" font-weight=\"bold\" fill=\"#2a7a2a\">verdict: WITHIN TOLERANCE</text>\n", SV_L,
            SV_H - 14);
  }
#undef SX
  fputs("</svg>\n", f);
  return !ferror(f);
}

/* ---- entry --------------------------------------------------------------------------- */

static void cleanup(vctx *c) {
  for (int p = 0; p < c->rd.ix.nparams; p++) {
    if (c->data) free(c->data[p]);
    if (c->grad) free(c->grad[p]);
  }
  free(c->data);
  free(c->grad);
  free(c->gptr);
  for (int r = 0; c->rt && r < c->rd.ix.world_size; r++) free(c->rt[r].keys);
  free(c->rt);
  for (int i = 0; i < c->nst; i++) {
    free(c->st[i].pt_step);
    free(c->st[i].pt_rel);
  }
  free(c->st);
  free(c->proj_stat);
  free(c->ev_stat);
  free(c->scratch);
  free(c->gath);
  free(c->mask);
  dopt_optim_destroy(c->opt);
  vr_reader_close(&c->rd);
  if (c->ref_path) vr_reader_close(&c->ref);
}

int cmd_verify(int argc, char **argv) {
  vctx c;
  memset(&c, 0, sizeof c);
  int rc = parse_args(&c, argc, argv);
  if (rc == CLI_OK) rc = load_index(&c);
  if (rc == CLI_OK) rc = setup(&c);
  if (rc == CLI_OK) rc = replay(&c);
  if (rc == CLI_OK && !c.quiet) print_table(&c);
  if (rc == CLI_OK && c.json_path) rc = write_output(&c, c.json_path, json_body, "--json");
  if (rc == CLI_OK && c.svg_path) rc = write_output(&c, c.svg_path, svg_body, "--plot");
  if (rc == CLI_OK && c.quiet) {
    /* the verdict line alone */
    early e;
    if (early_verdict(&c, &e)) {
      printf("verdict: %s\n", e.text);
    } else if (c.verdict_step) {
      char name[VR_MAX_NAME + VR_MAX_KEY + 2];
      stat_name(&c, &c.st[c.verdict_stat], name, sizeof name);
      printf("verdict: DIVERGED at step %ld (tensor %s, rank %d)\n", c.verdict_step, name, c.st[c.verdict_stat].rank);
    } else {
      printf("verdict: WITHIN TOLERANCE\n");
    }
  }
  if (rc == CLI_OK && (c.verdict_step || c.agree_step || c.rd.ix.disagree.step)) rc = CLI_FAIL;
  fflush(stdout);
  cleanup(&c);
  return rc;
}
