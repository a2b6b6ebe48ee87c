/* distopt verify: replay a recorded PyTorch run (distopt.record, docs/verify.md)
 * through the reference optimizer and compare.
 *
 *   distopt verify TRACE [--rtol X] [--json FILE] [--plot FILE.svg] [--quiet]
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
 * The recording is read through compare/verify_reader.c (verify.h; shared with
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
  double param, state;
} verify_tol;

static const verify_tol verify_tolerances[] = {
    {"adamw", 1e-6, 1e-5},
    {"adafactor", 1e-6, 1e-5},
    {"came", 1e-6, 1e-5},
    {"lamb", 1e-6, 1e-5},
};

static const verify_tol *find_tol(const char *name) {
  for (size_t i = 0; i < sizeof verify_tolerances / sizeof verify_tolerances[0]; i++)
    if (strcmp(verify_tolerances[i].optimizer, name) == 0) return &verify_tolerances[i];
  return NULL;
}

/* ---- state of one run ------------------------------------------------------------------- */

#define VR_MAX_KEYS 32               /* distinct state keys per piece */
#define VR_MAX_POINTS (16L << 20)    /* per-step errors kept for --json and --plot, all tensors together */
#define VR_JSON_SCHEMA 1

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
  double rtol;         /* > 0: --rtol */
  int quiet;
  vr_reader rd;         /* the recording: its index, source pieces and one open file per rank */
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
  fputs("usage: distopt verify TRACE [--rtol X] [--json FILE] [--plot FILE.svg] [--quiet]\n"
        "  Replays a run recorded by distopt.record (TRACE: its directory, or its index.json; docs/verify.md)\n"
        "  through the reference optimizer: the recorded initial parameters and gradients, step by step, and\n"
        "  compares every recorded parameter and state (per rank for sharded recordings) with the reference:\n"
        "  max abs error, max ULP distance, normwise relative error max|rec-ref|/max|ref|, first step beyond the\n"
        "  tolerance. Tolerance: the optimizer's declared one (normwise relative, parameters and states), or\n"
        "  --rtol X for both. Step counters must be equal.\n"
        "  --json FILE: the per-step record (\"schema_version\": 1); --plot FILE.svg: error vs step per tensor.\n"
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
    if (a[0] == '-' && a[1] == '-') {
      if (i + 1 >= argc) return cli_errorf(CMD, "option '%s' needs a value (or is unknown)", a);
      const char *v = argv[++i];
      if (strcmp(a, "--json") == 0) c->json_path = v;
      else if (strcmp(a, "--plot") == 0) c->svg_path = v;
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
  /* the one rule for outputs; neither may be, or lie inside, the recording (its folder) */
  char rec[4096];
  struct stat st;
  if (stat(c->trace, &st) == 0 && !S_ISDIR(st.st_mode)) dopt__path_parent(c->trace, rec); /* TRACE/index.json */
  else snprintf(rec, sizeof rec, "%s", c->trace);
  const cli_path outs[] = {{"--json", c->json_path, 0}, {"--plot", c->svg_path, 0}};
  const cli_path ins[] = {{"TRACE", rec, 1}};
  return cli_check_paths(CMD, outs, 2, ins, 1);
}

/* ---- the index ---------------------------------------------------------------------- */

static int load_index(vctx *c) {
  if (vr_reader_open(&c->rd, c->trace) != DOPT_OK) return cli_errorf(CMD, "%s", c->rd.err);
  if (c->rd.ix.steps == 0)
    return cli_errorf(CMD, "%s: steps: 0: the recording holds no step (nothing to verify)", c->rd.index_path);
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
  if (beyond && !s->first_beyond) s->first_beyond = t;
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

static int setup(vctx *c) {
  const vr_index *ix = &c->rd.ix;
  const verify_tol *tol = find_tol(ix->optimizer);
  if (c->rtol > 0.0) {
    c->tol_param = c->tol_state = c->rtol;
    c->tol_source = "--rtol";
  } else if (tol) {
    c->tol_param = tol->param;
    c->tol_state = tol->state;
    c->tol_source = "declared";
  } else {
    return cli_errorf(CMD, "%s: optimizer.name '%s' has no declared tolerance (give --rtol)", c->rd.index_path,
                      ix->optimizer);
  }
  dopt_status s = dopt_optim_create(ix->optimizer, ix->group_hparams[0], &c->opt);
  if (s != DOPT_OK) return lib_error(c->rd.index_path, s);
  for (int g = 1; g < ix->ngroups; g++) {
    int gid;
    if ((s = dopt_optim_add_group(c->opt, ix->group_hparams[g], &gid)) != DOPT_OK) {
      char what[4400];
      snprintf(what, sizeof what, "%s: groups[%d].hparams", c->rd.index_path, g);
      return lib_error(what, s);
    }
  }
  int np = ix->nparams;
  c->data = calloc((size_t)np, sizeof *c->data);
  c->grad = calloc((size_t)np, sizeof *c->grad);
  c->gptr = calloc((size_t)np, sizeof *c->gptr);
  c->rt = calloc((size_t)ix->world_size, sizeof *c->rt);
  if (!c->data || !c->grad || !c->gptr || !c->rt) return cli_errorf(CMD, "out of memory");
  for (int p = 0; p < np; p++) {
    size_t n = (size_t)ix->params[p].numel;
    if (n > SIZE_MAX / sizeof(float) / 2) return cli_errorf(CMD, "parameter '%s': too large", ix->params[p].name);
    c->data[p] = malloc(n * sizeof(float));
    c->grad[p] = malloc(n * sizeof(float));
    if (!c->data[p] || !c->grad[p])
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
  for (int r = 0; r < ix->world_size; r++) {
    if (ix->ranks[r].npieces == 0) continue;
    int rc = file_for_step(c, r, 1);
    if (rc) return rc;
  }
  for (int p = 0; p < np; p++)
    if (vr_reader_init(&c->rd, p, c->data[p]) != DOPT_OK) return cli_errorf(CMD, "%s", c->rd.err);
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
  return CLI_OK;
}

/* ---- the replay ---------------------------------------------------------------------- */

static int assemble_grads(vctx *c, long t) {
  for (int p = 0; p < c->rd.ix.nparams; p++) {
    int present = 0;
    if (vr_reader_grad(&c->rd, p, t, c->grad[p], &present) != DOPT_OK) return cli_errorf(CMD, "%s", c->rd.err);
    c->gptr[p] = present ? c->grad[p] : NULL;
  }
  return CLI_OK;
}

/* The flat range of `key`'s reference state (n elements) rank r's piece records. */
static int state_range(const vctx *c, const vr_piece *pc, const char *key, int64_t n, int64_t *lo, int64_t *len) {
  const vr_param *vp = &c->rd.ix.params[pc->param];
  for (int i = 0; i < pc->nstates; i++)
    if (strcmp(pc->states[i].key, key) == 0) {
      *lo = pc->states[i].lo;
      *len = pc->states[i].len;
      return 0;
    }
  if (pc->lo == 0 && pc->len == vp->numel) { /* the whole parameter: the whole state */
    *lo = 0;
    *len = n;
    return 0;
  }
  if (n == vp->numel) { /* elementwise */
    *lo = pc->lo;
    *len = pc->len;
    return 0;
  }
  return -1;
}

static int compare_step(vctx *c, long t) {
  char key[VR_MAX_NAME + 128];
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
        int nst = dopt_optim_num_states(c->opt, pc->param);
        if (strcmp(s->key, "step") == 0) {
          int64_t ref = 0;
          dopt_optim_get_step(c->opt, pc->param, &ref);
          double got = 0;
          if (rec.dtype == DOPT_F32) {
            float v;
            memcpy(&v, rec.data, sizeof v);
            got = v;
          } else if (rec.dtype == DOPT_F64) memcpy(&got, rec.data, sizeof got);
          else if (rec.dtype == DOPT_I64) {
            int64_t v;
            memcpy(&v, rec.data, sizeof v);
            got = (double)v;
          } else {
            int32_t v;
            memcpy(&v, rec.data, sizeof v);
            got = v;
          }
          double d = fabs(got - (double)ref);
          if (!(d <= s->max_abs)) s->max_abs = d;
          s->compared++;
          double rel = d == 0.0 ? 0.0 : (ref ? d / fabs((double)ref) : INFINITY);
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
        dopt_state_view v;
        int found = 0;
        for (int k = 0; k < nst && !found; k++)
          if (dopt_optim_state(c->opt, pc->param, k, &v) == DOPT_OK && strcmp(v.name, s->key) == 0) found = 1;
        if (!found && nst > 0) { /* a key the reference does not keep: listed, not compared */
          s->no_ref = 1;
          continue;
        }
        if (!found) { /* torch has state, the reference none: the parameter never stepped here */
          s->compared++;
          s->max_abs = INFINITY;
          record_result(c, pk->stat[j], t, INFINITY, c->tol_state);
          continue;
        }
        if (v.dtype != DOPT_F32) {
          s->no_ref = 1;
          continue;
        }
        int64_t n = 1, lo, len;
        for (int d = 0; d < v.ndim; d++) n *= v.shape[d];
        if (state_range(c, pc, s->key, n, &lo, &len))
          return cli_errorf(CMD, "%s: rank %d records state '%s' of '%s' for elements [%lld, %lld) of the parameter but "
                                 "declares no range of the state (ranks[%d].pieces[].states)",
                            c->rd.index_path, r, s->key, vp->name, (long long)pc->lo, (long long)(pc->lo + pc->len), r);
        if (lo + len > n)
          return cli_errorf(CMD, "%s: rank %d, state '%s' of '%s': range [%lld, %lld) is outside the reference's %lld "
                                 "elements", c->rd.index_path, r, s->key, vp->name, (long long)lo, (long long)(lo + len),
                            (long long)n);
        if ((int64_t)rec.numel != len)
          return cli_errorf(CMD, "rank %d: tensor '%s' has %zu elements, expected %lld (the state range [%lld, %lld))",
                            r, key, rec.numel, (long long)len, (long long)lo, (long long)(lo + len));
        double rel = compare_f32(s, rec.data, (const float *)v.data + lo, (size_t)len);
        record_result(c, pk->stat[j], t, rel, c->tol_state);
      }
      snprintf(key, sizeof key, "param/%ld/%s", t, vp->name);
      if (dopt_st_find(f, key, &rec) == DOPT_OK) {
        vstat *s = &c->st[pk->stat[0]];
        double rel = compare_f32(s, rec.data, c->data[pc->param] + pc->lo, (size_t)pc->len);
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

static int replay(vctx *c) {
  long ch = 0;
  for (long t = 1; t <= c->rd.ix.steps; t++) {
    for (int r = 0; r < c->rd.ix.world_size; r++) {
      int rc = file_for_step(c, r, t);
      if (rc) return rc;
    }
    for (; ch < c->rd.ix.nchanges && c->rd.ix.changes[ch].step == t; ch++) {
      const vr_change *h = &c->rd.ix.changes[ch];
      dopt_status s = dopt_optim_set_hparam(c->opt, h->group, h->key, h->value);
      if (s != DOPT_OK) {
        char what[4400];
        snprintf(what, sizeof what, "%s: hparam_changes[%ld] (step %ld)", c->rd.index_path, ch, t);
        return lib_error(what, s);
      }
    }
    int rc = assemble_grads(c, t);
    if (rc) return rc;
    dopt_status s = dopt_optim_step(c->opt, c->gptr);
    if (s != DOPT_OK) {
      char what[64];
      snprintf(what, sizeof what, "step %ld: the reference step failed", t);
      return lib_error(what, s);
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
  if (s->pc->lo == 0 && s->pc->len == vp->numel) snprintf(buf, cap, "whole");
  else snprintf(buf, cap, "[%lld,%lld)", (long long)s->pc->lo, (long long)(s->pc->lo + s->pc->len));
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
  printf("verify: %s %s%s%s\n", ix->optimizer, ix->group_hparams[0][0] ? ix->group_hparams[0] : "(defaults)",
         ix->upstream[0] ? " | recorded from " : "", ix->upstream);
  for (int g = 1; g < ix->ngroups; g++) printf("  group %d: %s\n", g, ix->group_hparams[g]);
  printf("  torch %s (CPU capability %s) | world size %d | %ld step%s, parameters and states every %ld | %s%s\n",
         ix->torch_version[0] ? ix->torch_version : "?", ix->cpu_capability[0] ? ix->cpu_capability : "?",
         ix->world_size, ix->steps, ix->steps == 1 ? "" : "s", ix->every, c->trace,
         ix->complete ? "" : " (interrupted: a prefix)");
  if (ix->nchanges) printf("  %ld hyperparameter change%s replayed (an lr schedule)\n", ix->nchanges, ix->nchanges == 1 ? "" : "s");
  printf("  tolerance (normwise relative max|rec-ref|/max|ref|): parameters %g, states %g (%s%s%s); step counts exact\n",
         c->tol_param, c->tol_state, c->tol_source, strcmp(c->tol_source, "declared") == 0 ? " for " : "",
         strcmp(c->tol_source, "declared") == 0 ? ix->optimizer : "");
  int *order = row_order(c);
  int namew = 6;
  char name[VR_MAX_NAME + VR_MAX_KEY + 2], piece[64];
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
  if (!c->verdict_step) {
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
    cJSON_AddNumberToObject(o, "lo", (double)s->pc->lo);
    cJSON_AddNumberToObject(o, "len", (double)s->pc->len);
    cJSON_AddBoolToObject(o, "compared", !s->no_ref);
    cJSON_AddNumberToObject(o, "max_abs", s->max_abs);
    cJSON_AddNumberToObject(o, "max_ulp", (double)s->max_ulp); /* above 2^53 rounded; UINT64_MAX: NaN vs number */
    cJSON_AddNumberToObject(o, "max_rel", s->max_rel);
    cJSON_AddNumberToObject(o, "nan_pairs", (double)s->nan_pairs);
    if (s->first_beyond) cJSON_AddNumberToObject(o, "first_beyond", (double)s->first_beyond);
    else cJSON_AddNullToObject(o, "first_beyond");
    cJSON *st = cJSON_AddArrayToObject(o, "steps"), *rl = cJSON_AddArrayToObject(o, "rel_per_step");
    for (long i = 0; st && rl && i < s->npts; i++) {
      cJSON_AddItemToArray(st, cJSON_CreateNumber((double)s->pt_step[i]));
      cJSON_AddItemToArray(rl, cJSON_CreateNumber(s->pt_rel[i]));
    }
  }
  free(order);
  cJSON *v = cJSON_AddObjectToObject(root, "verdict");
  if (v && !c->verdict_step) {
    cJSON_AddStringToObject(v, "kind", "within_tolerance");
    cJSON_AddNullToObject(v, "step");
    cJSON_AddNullToObject(v, "tensor");
    cJSON_AddNullToObject(v, "rank");
  } else if (v) {
    const vstat *s = &c->st[c->verdict_stat];
    stat_name(c, s, name, sizeof name);
    cJSON_AddStringToObject(v, "kind", strcmp(s->key, "step") == 0 ? "step_counter" : "diverged");
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
  if (c->verdict_step) {
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
  dopt_optim_destroy(c->opt);
  vr_reader_close(&c->rd);
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
    if (c.verdict_step) {
      char name[VR_MAX_NAME + VR_MAX_KEY + 2];
      stat_name(&c, &c.st[c.verdict_stat], name, sizeof name);
      printf("verdict: DIVERGED at step %ld (tensor %s, rank %d)\n", c.verdict_step, name, c.st[c.verdict_stat].rank);
    } else {
      printf("verdict: WITHIN TOLERANCE\n");
    }
  }
  if (rc == CLI_OK && c.verdict_step) rc = CLI_FAIL;
  fflush(stdout);
  cleanup(&c);
  return rc;
}
