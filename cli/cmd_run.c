/* distopt run: apply a registered optimizer to parameters and a sequence of
 * gradients read from safetensors files, write parameters and states.
 *
 *   distopt run --params P.safetensors [--grads G.safetensors] --out OUT.safetensors
 *               [--optimizer NAME] [--hparams k=v,...] [--group 'GLOB:k=v,...']... [--steps N]
 *               [--save CKPT [--save-every K] [--start-over]] [--resume CKPT]
 *
 * Parameters: the F32 tensors of P named "init/<name>" if any, otherwise every
 * tensor whose name does not start with grad/, param/ or state/. Gradients:
 * tensors "grad/<t>/<name>" (t = 1..N) of G (default: P); a missing one means
 * "no gradient" for that parameter at that step. Optimizer, hyperparameters and
 * groups default to P's metadata (optimizer, hparams, groups, group_hparams)
 * when --optimizer is not given; a file with only param/ and state/ tensors
 * and an "inputs" metadata entry (the golden case files) takes parameters and
 * gradients from that file. Groups: each --group adds a parameter group
 * whose overrides apply to parameters matching GLOB (first match wins; others
 * stay in group 0).
 * Output: "param/<name>", "state/<name>/<key>" and "state/<name>/step" (I64).
 * Bad input: one-line error, exit 2, no output file; a failure while
 * computing or writing: exit 1, no output file. */
#include <fnmatch.h>
#include <sys/stat.h>
#include <unistd.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "files.h"

#define MAX_GROUPS 64

typedef struct run_param {
  char name[256];
  float *data;
  float *grad;
  double rms0; /* RMS of the initial parameter, for the summary */
  int ndim;
  int64_t shape[DOPT_MAX_DIMS];
  size_t numel;
  int id;
  int finite_before; /* every value finite before the current step */
} run_param;

typedef struct run_ctx {
  const char *params_path, *grads_path, *out_path, *optimizer, *hparams;
  const char *mf_path; /* the file given as --params (a golden case file when it names its inputs) */
  const char *group_spec[MAX_GROUPS];
  int ngroups;
  long steps;
  int quiet;
  int apply_nonfinite; /* --nonfinite apply: step on non-finite gradients as upstream (default: skip the step) */
  long skipped;        /* steps skipped for a non-finite gradient */
  long first_skipped;
  dopt_st_file *pf, *gf;
  dopt_st_file *mf; /* metadata source: the --params file (a golden case file points to its inputs) */
  char *inputs_path;
  const char *save_path, *resume_path; /* checkpoints (docs/checkpoints.md) */
  long save_every;                     /* also save after every K-th step (0: only after the last) */
  long threads;                        /* --threads (0: the library's default) */
  long start;                          /* the step the resumed checkpoint was saved after (0: none) */
  char resume_gen[4096], resume_dir[4096]; /* the generation --resume names and its checkpoint folder */
  int save_into_resumed;               /* --save is that folder: generations are added to it */
  int start_over;                      /* --start-over: the --save folder's generations are removed first */
  run_param *p;
  int np;
  run_param **by_name; /* [np] sorted by name: lookups in O(log n) (80 000-tensor files) */
  dopt_optim *opt;
} run_ctx;

static const char *const CMD = "run";

static void run_usage(FILE *f) {
  fputs("usage: distopt run --params P.safetensors [--grads G.safetensors] --out OUT.safetensors\n"
        "                   [--optimizer NAME] [--hparams k=v,...] [--group 'GLOB:k=v,...']... [--steps N] [--quiet]\n"
        "                   [--nonfinite skip|apply] [--save CKPT [--save-every K] [--start-over]] [--resume CKPT]\n"
        "                   [--threads N]\n"
        "  parameters: tensors init/<name> of P (or every tensor not under grad/, param/, state/)\n"
        "  gradients:  tensors grad/<t>/<name> of G (default P), t = 1..N; missing = no gradient\n"
        "  optimizer, hparams and groups default to P's metadata; see 'distopt list' for keys\n"
        "  layer index (lisa): N of a 'layers.N.' in the parameter name, else -1 (always trained)\n"
        "  --save CKPT: a checkpoint generation after the last step (and every K steps); --out is then optional.\n"
        "  CKPT holds only this run's generations (its latest: the same optimizer, hyperparameters and parameters),\n"
        "  each save after its latest; --start-over removes CKPT's generations first\n"
        "  --resume CKPT: load a checkpoint (CKPT or CKPT/step-N) and run its steps + 1 .. N\n"
        "  --threads N: threads of the step, 1..256 (default: DOPT_NUM_THREADS, else the cores); the same bits\n",
        f);
}

static int has_prefix(const char *s, const char *p) { return strncmp(s, p, strlen(p)) == 0; }

static int parse_args(run_ctx *c, int argc, char **argv) {
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
      run_usage(stdout);
      exit(CLI_OK);
    }
    if (strcmp(a, "--quiet") == 0) {
      c->quiet = 1;
      continue;
    }
    if (strcmp(a, "--start-over") == 0) {
      c->start_over = 1;
      continue;
    }
    if (i + 1 >= argc) return cli_errorf(CMD, "option '%s' needs a value (or is unknown)", a);
    const char *v = argv[++i];
    if (strcmp(a, "--params") == 0) c->params_path = v;
    else if (strcmp(a, "--grads") == 0) c->grads_path = v;
    else if (strcmp(a, "--out") == 0) c->out_path = v;
    else if (strcmp(a, "--save") == 0) c->save_path = v;
    else if (strcmp(a, "--resume") == 0) c->resume_path = v;
    else if (strcmp(a, "--save-every") == 0) {
      char *end;
      c->save_every = strtol(v, &end, 10);
      if (*end || c->save_every <= 0 || c->save_every > 100000000)
        return cli_errorf(CMD, "--save-every '%s': expected a positive integer", v);
    }
    else if (strcmp(a, "--optimizer") == 0) c->optimizer = v;
    else if (strcmp(a, "--hparams") == 0) c->hparams = v;
    else if (strcmp(a, "--nonfinite") == 0) {
      if (strcmp(v, "skip") != 0 && strcmp(v, "apply") != 0)
        return cli_errorf(CMD, "--nonfinite '%s': expected skip or apply", v);
      c->apply_nonfinite = strcmp(v, "apply") == 0;
    }
    else if (strcmp(a, "--group") == 0) {
      if (c->ngroups == MAX_GROUPS) return cli_errorf(CMD, "--group: more than %d groups", MAX_GROUPS);
      if (!strchr(v, ':')) return cli_errorf(CMD, "--group '%s': expected GLOB:key=value,...", v);
      c->group_spec[c->ngroups++] = v;
    } else if (strcmp(a, "--threads") == 0) {
      char *end;
      c->threads = strtol(v, &end, 10);
      if (*end || end == v || c->threads < 1 || c->threads > 256)
        return cli_errorf(CMD, "--threads '%s': expected an integer in [1, 256]", v);
    } else if (strcmp(a, "--steps") == 0) {
      char *end;
      c->steps = strtol(v, &end, 10);
      if (*end || c->steps <= 0 || c->steps > 100000000)
        return cli_errorf(CMD, "--steps '%s': expected a positive integer", v);
    } else {
      return cli_errorf(CMD, "unknown option '%s' (see --help)", a);
    }
  }
  if (!c->params_path) return cli_errorf(CMD, "--params is required (see --help)");
  if (!c->out_path && !c->save_path) return cli_errorf(CMD, "--out is required (see --help)");
  if (c->save_every && !c->save_path) return cli_errorf(CMD, "--save-every needs --save");
  if (c->start_over && !c->save_path) return cli_errorf(CMD, "--start-over needs --save");
  if (c->hparams && !c->optimizer) return cli_errorf(CMD, "--hparams needs --optimizer");
  return CLI_OK;
}

static int cmp_param_name(const void *a, const void *b) {
  return strcmp((*(run_param *const *)a)->name, (*(run_param *const *)b)->name);
}

static int load_params(run_ctx *c) {
  int n = dopt_st_count(c->pf), use_init = 0;
  dopt_st_tensor t;
  for (int i = 0; i < n; i++)
    if (dopt_st_get(c->pf, i, &t) == DOPT_OK && has_prefix(t.name, "init/")) use_init = 1;
  c->p = calloc(n > 0 ? (size_t)n : 1, sizeof *c->p);
  if (!c->p) return cli_errorf(CMD, "out of memory");
  for (int i = 0; i < n; i++) {
    dopt_st_get(c->pf, i, &t);
    const char *nm;
    if (use_init) {
      if (!has_prefix(t.name, "init/")) continue;
      nm = t.name + 5;
    } else {
      if (has_prefix(t.name, "grad/") || has_prefix(t.name, "param/") || has_prefix(t.name, "state/")) continue;
      nm = t.name;
    }
    if (t.dtype != DOPT_F32)
      return cli_errorf(CMD, "%s: parameter '%s' is %s; only F32 parameters are supported", c->params_path, nm,
                        dopt_dtype_name(t.dtype));
    if (strlen(nm) >= sizeof c->p[0].name)
      return cli_errorf(CMD, "%s: parameter name '%.40s...' is %zu bytes, more than the limit of %zu", c->params_path, nm,
                        strlen(nm), sizeof c->p[0].name - 1);
    run_param *p = &c->p[c->np++];
    strcpy(p->name, nm);
    p->ndim = t.ndim;
    memcpy(p->shape, t.shape, sizeof p->shape);
    p->numel = t.numel;
    p->data = malloc((p->numel ? p->numel : 1) * sizeof(float));
    p->grad = malloc((p->numel ? p->numel : 1) * sizeof(float));
    if (!p->data || !p->grad) return cli_errorf(CMD, "out of memory for '%s'", nm);
    memcpy(p->data, t.data, p->numel * sizeof(float));
    p->rms0 = sqrt(dopt_xsum_sq(p->data, p->numel) / (double)p->numel);
    p->finite_before = 1;
    for (size_t k = 0; k < p->numel && p->finite_before; k++) p->finite_before = isfinite(p->data[k]);
    if (p->numel == 0) return cli_errorf(CMD, "%s: parameter '%s' is empty", c->params_path, nm);
  }
  if (c->np == 0) return cli_errorf(CMD, "%s: no parameters found", c->params_path);
  c->by_name = malloc((size_t)c->np * sizeof *c->by_name);
  if (!c->by_name) return cli_errorf(CMD, "out of memory");
  for (int i = 0; i < c->np; i++) c->by_name[i] = &c->p[i];
  qsort(c->by_name, (size_t)c->np, sizeof *c->by_name, cmp_param_name);
  return CLI_OK;
}

static run_param *find_param(run_ctx *c, const char *name) {
  int lo = 0, hi = c->np;
  while (lo < hi) {
    int mid = lo + (hi - lo) / 2, r = strcmp(c->by_name[mid]->name, name);
    if (r == 0) return c->by_name[mid];
    if (r < 0) lo = mid + 1;
    else hi = mid;
  }
  return NULL;
}

/* The largest step a gradient file may name: every step up to it runs, even
 * without gradients (a wrapper's clock counts them), so an unbounded one is a hang. */
#define RUN_MAX_STEPS 10000000

/* Validates every grad/<t>/<name> tensor up front (unknown names, shapes,
 * dtypes, step range) so that no work is done on bad input. */
static int check_grads(run_ctx *c) {
  long max_t = 0;
  dopt_st_tensor t;
  for (int i = 0; i < dopt_st_count(c->gf); i++) {
    dopt_st_get(c->gf, i, &t);
    if (!has_prefix(t.name, "grad/")) continue;
    /* the step: decimal digits, no sign, space or leading zero (grad/01/w would never be looked up) */
    const char *digits = t.name + 5;
    long step = 0;
    int nd = 0;
    while (digits[nd] >= '0' && digits[nd] <= '9' && nd < 10) step = step * 10 + (digits[nd] - '0'), nd++;
    if (nd == 0 || digits[nd] != '/' || digits[0] == '0')
      return cli_errorf(CMD, "%s: tensor '%s': expected grad/<step>/<param> with step a decimal integer >= 1",
                        c->grads_path, t.name);
    if (step > RUN_MAX_STEPS)
      return cli_errorf(CMD, "%s: tensor '%s': step %ld is beyond the limit of %d steps", c->grads_path, t.name, step,
                        RUN_MAX_STEPS);
    const char *end = digits + nd;
    run_param *p = find_param(c, end + 1);
    if (!p) return cli_errorf(CMD, "%s: gradient '%s' names no parameter", c->grads_path, t.name);
    if (t.dtype != DOPT_F32) return cli_errorf(CMD, "%s: gradient '%s' is %s, expected F32", c->grads_path, t.name, dopt_dtype_name(t.dtype));
    int same = t.ndim == p->ndim;
    for (int d = 0; same && d < t.ndim; d++) same = t.shape[d] == p->shape[d];
    if (!same) {
      char a[128] = "", b[128] = "";
      for (int d = 0; d < t.ndim; d++) snprintf(a + strlen(a), sizeof a - strlen(a), "%s%lld", d ? "," : "", (long long)t.shape[d]);
      for (int d = 0; d < p->ndim; d++) snprintf(b + strlen(b), sizeof b - strlen(b), "%s%lld", d ? "," : "", (long long)p->shape[d]);
      return cli_errorf(CMD, "%s: gradient '%s' has shape [%s] but parameter '%s' has [%s]", c->grads_path, t.name,
                        a, p->name, b);
    }
    if (step > max_t) max_t = step;
  }
  if (max_t == 0) return cli_errorf(CMD, "%s: no gradients (grad/<step>/<param>) found", c->grads_path);
  if (c->steps == 0) c->steps = max_t;
  if (c->steps > max_t)
    return cli_errorf(CMD, "--steps %ld but %s has gradients for %ld steps", c->steps, c->grads_path, max_t);
  return CLI_OK;
}

/* Builds the optimizer and its groups from the options or the metadata. */
static int build_optimizer(run_ctx *c) {
  const char *name = c->optimizer, *hp = c->hparams;
  const char *meta_groups = NULL, *meta_ghp = NULL;
  if (!name) {
    name = dopt_st_meta(c->mf, "optimizer");
    hp = dopt_st_meta(c->mf, "hparams");
    meta_groups = dopt_st_meta(c->mf, "groups");
    meta_ghp = dopt_st_meta(c->mf, "group_hparams");
    if (!name) return cli_errorf(CMD, "--optimizer is required (%s has no 'optimizer' metadata)", c->params_path);
  }
  dopt_status s = dopt_optim_create(name, hp, &c->opt);
  if (s == DOPT_OK) s = dopt_optim_set_threads(c->opt, (int)c->threads);
  if (s != DOPT_OK) return cli_error(CMD, s);
  int *gid = calloc(c->np > 0 ? (size_t)c->np : 1, sizeof *gid);
  if (!gid) return cli_errorf(CMD, "out of memory");
  int rc = CLI_OK;
  if (c->ngroups == 0 && meta_groups && meta_ghp) {
    /* metadata groups: "a,b|c,d" with "k=v|k=v,k=v": the same number of fields, none empty */
    int ng = 1, nh = 1;
    for (const char *q = meta_groups; *q; q++) ng += *q == '|';
    for (const char *q = meta_ghp; *q; q++) nh += *q == '|';
    if (ng != nh)
      rc = cli_errorf(CMD, "%s: metadata 'groups' has %d groups but 'group_hparams' has %d", c->params_path, ng, nh);
    char *gs = strdup(meta_groups), *hs = strdup(meta_ghp);
    char *gtok = gs, *htok = hs;
    for (int k = 0; rc == CLI_OK && gs && hs && k < ng; k++) {
      char *gnext = strchr(gtok, '|'), *hnext = strchr(htok, '|');
      if (gnext) *gnext = '\0';
      if (hnext) *hnext = '\0';
      int g;
      if ((s = dopt_optim_add_group(c->opt, htok, &g)) != DOPT_OK) {
        rc = cli_error(CMD, s);
        break;
      }
      char *pn = gtok;
      for (;;) {
        char *comma = strchr(pn, ',');
        if (comma) *comma = '\0';
        run_param *p = *pn ? find_param(c, pn) : NULL;
        if (!p) {
          rc = cli_errorf(CMD, "%s: metadata group %d names %s parameter '%s'", c->params_path, k + 1,
                          *pn ? "unknown" : "an empty", pn);
          break;
        }
        gid[p - c->p] = g;
        if (!comma) break;
        pn = comma + 1;
      }
      if (gnext) gtok = gnext + 1;
      if (hnext) htok = hnext + 1;
    }
    free(gs);
    free(hs);
  }
  for (int k = 0; k < c->ngroups && rc == CLI_OK; k++) {
    const char *spec = c->group_spec[k], *colon = strchr(spec, ':');
    char glob[256];
    size_t gl = (size_t)(colon - spec);
    if (gl >= sizeof glob) {
      rc = cli_errorf(CMD, "--group '%s': pattern too long", spec);
      break;
    }
    memcpy(glob, spec, gl);
    glob[gl] = '\0';
    int g;
    if ((s = dopt_optim_add_group(c->opt, colon + 1, &g)) != DOPT_OK) {
      rc = cli_error(CMD, s);
      break;
    }
    int matched = 0, any = 0;
    for (int i = 0; i < c->np; i++) {
      int m = fnmatch(glob, c->p[i].name, 0);
      if (m != 0 && m != FNM_NOMATCH) {
        rc = cli_errorf(CMD, "--group '%s': malformed pattern '%s'", spec, glob);
        break;
      }
      any |= m == 0;
      if (gid[i] == 0 && m == 0) gid[i] = g, matched++;
    }
    if (rc == CLI_OK && !any)
      rc = cli_errorf(CMD, "--group '%s': the pattern '%s' matches no parameter", spec, glob);
    else if (rc == CLI_OK && !matched)
      rc = cli_errorf(CMD, "--group '%s': every parameter '%s' matches is already in an earlier group", spec, glob);
  }
  for (int i = 0; i < c->np && rc == CLI_OK; i++) {
    dopt_param_config pc = DOPT_PARAM_CONFIG_INIT;
    pc.name = c->p[i].name;
    pc.ndim = c->p[i].ndim;
    memcpy(pc.shape, c->p[i].shape, sizeof pc.shape);
    pc.data = c->p[i].data;
    pc.layer = dopt_layer_from_name(c->p[i].name);
    if ((s = dopt_optim_add_param(c->opt, gid[i], &pc, &c->p[i].id)) != DOPT_OK) rc = cli_error(CMD, s);
  }
  free(gid);
  return rc;
}

/* A checkpoint generation after step t (docs/checkpoints.md): the optimizer, t and the skipped steps. */
static int save_ckpt(run_ctx *c, long t) {
  dopt_ckpt_info info = DOPT_CKPT_INFO_INIT;
  info.global_step = t;
  info.skipped_steps = c->skipped;
  dopt_status s = dopt_optim_save(c->opt, c->save_path, &info);
  if (s == DOPT_OK) return CLI_OK;
  return cli_error(CMD, s); /* the computation ran; writing its result failed: an I/O failure, 2 */
}

/* Whether a generation is saved after step t: after the last step (also when it is the resumed one), and after
 * every --save-every-th step in between. */
static int saves_after(const run_ctx *c, long t) {
  return t == c->steps || (c->save_every && t > c->start && t < c->steps && t % c->save_every == 0);
}

/* --save into the resumed checkpoint's folder: no save of this run may land on the generation being read
 * (step-N with N the step it was saved after, normally the resumed step itself). */
static int check_save_into_resumed(const run_ctx *c) {
  const char *base = strrchr(c->resume_gen, '/');
  base = base ? base + 1 : c->resume_gen;
  char *end;
  long n = strncmp(base, "step-", 5) == 0 ? strtol(base + 5, &end, 10) : -1;
  if (n < 0 || *end) return CLI_OK;
  if (saves_after(c, n))
    return cli_errorf(CMD, "--save '%s' with --resume '%s': the save after step %ld would rewrite the generation being "
                      "read (%s); run to a later step or save elsewhere", c->save_path, c->resume_path, n, c->resume_gen);
  return CLI_OK;
}

/* --resume: the checkpoint's parameters, states and step counts replace the
 * initial ones (same optimizer, hyperparameters, groups and parameters, or a
 * one-line error); the run continues after its global step. */
static int resume(run_ctx *c) {
  dopt_ckpt_reader *r;
  const dopt_ckpt_meta *m;
  const char *gen = c->resume_gen; /* the generation checked before the run (resume_gen) */
  dopt_status s = dopt_ckpt_open(gen, &r);
  if (s != DOPT_OK) return cli_error(CMD, s);
  dopt_ckpt_read_meta(r, &m);
  c->start = (long)m->global_step;
  c->skipped = (long)m->skipped_steps;
  const long taken = (long)m->optimizer_steps;
  dopt_ckpt_close(r);
  /* run counts every step as taken or skipped: a checkpoint that says otherwise would resume another clock */
  if (taken + c->skipped != c->start)
    return cli_errorf(CMD, "--resume %s: index.json says global_step %ld but optimizer_steps %ld + skipped_steps %ld = "
                      "%ld (the counters disagree: edited or not written by distopt run)", gen, c->start, taken,
                      c->skipped, taken + c->skipped);
  if (c->start > c->steps)
    return cli_errorf(CMD, "--resume %s: the checkpoint is at step %ld, beyond the last step %ld", gen, c->start,
                      c->steps);
  if (c->save_into_resumed && check_save_into_resumed(c) != CLI_OK) return CLI_USAGE;
  if ((s = dopt_optim_load(c->opt, gen)) != DOPT_OK) return cli_error(CMD, s);
  for (int i = 0; i < c->np; i++) {
    run_param *p = &c->p[i];
    p->finite_before = 1;
    for (size_t k = 0; k < p->numel && p->finite_before; k++) p->finite_before = isfinite(p->data[k]);
    p->rms0 = sqrt(dopt_xsum_sq(p->data, p->numel) / (double)p->numel); /* "rms before": the resumed values */
  }
  return CLI_OK;
}

/* --save: the folder holds only this run's generations, each save after its latest (dopt_ckpt_claim); with
 * --start-over its generations are removed first. After the resume, before the steps. */
static int claim_save(run_ctx *c) {
  long first = c->steps; /* the first t with saves_after: a multiple of --save-every after the start, else the last */
  if (c->save_every) {
    const long k = (c->start / c->save_every + 1) * c->save_every;
    if (k < c->steps) first = k;
  }
  dopt_status s;
  if (c->start_over) {
    if (c->save_into_resumed)
      return cli_errorf(CMD, "--start-over with --save '%s': it would remove the generation --resume reads (%s)",
                        c->save_path, c->resume_gen);
    return (s = dopt_ckpt_clear(c->save_path)) == DOPT_OK ? CLI_OK : cli_error(CMD, s);
  }
  dopt_ckpt_meta *m;
  if ((s = dopt_ckpt_meta_from_optim(c->opt, NULL, &m)) != DOPT_OK) return cli_error(CMD, s);
  s = dopt_ckpt_claim(c->save_path, m, first);
  dopt_ckpt_meta_free(m);
  if (s != DOPT_OK) {
    char why[1024];
    snprintf(why, sizeof why, "%s", dopt_last_error());
    return cli_error(CMD, dopt__fail(s, "--save: %s (save elsewhere, or --start-over to remove its generations first)",
                                     why));
  }
  return CLI_OK;
}

static int run_steps(run_ctx *c) {
  const float **grads = calloc(c->np > 0 ? (size_t)c->np : 1, sizeof *grads);
  if (!grads) return cli_errorf(CMD, "out of memory");
  int rc = CLI_OK;
  char key[320];
  for (long t = c->start + 1; t <= c->steps && rc == CLI_OK; t++) {
    /* --save-every: a generation after every K-th step but the last (saved by the caller) */
    if (c->save_path && saves_after(c, t - 1) && (rc = save_ckpt(c, t - 1)) != CLI_OK) break;
    for (int i = 0; i < c->np; i++) {
      dopt_st_tensor g;
      snprintf(key, sizeof key, "grad/%ld/%s", t, c->p[i].name);
      grads[c->p[i].id] = NULL;
      if (dopt_st_find(c->gf, key, &g) != DOPT_OK) continue;
      memcpy(c->p[i].grad, g.data, c->p[i].numel * sizeof(float));
      grads[c->p[i].id] = c->p[i].grad;
    }
    /* the numerical input policy (docs/nan-policy.md): a step with a NaN/Inf gradient is skipped whole and
     * counted, as the distributed optimizers do (skip_nonfinite); --nonfinite apply steps on it as upstream */
    int finite = 1;
    for (int i = 0; finite && i < c->np; i++)
      for (size_t k = 0; grads[c->p[i].id] && k < c->p[i].numel; k++)
        if (!isfinite(c->p[i].grad[k])) {
          finite = 0;
          break;
        }
    if (!finite && !c->apply_nonfinite) {
      if (c->skipped++ == 0) c->first_skipped = t;
      continue;
    }
    dopt_status s = dopt_optim_step(c->opt, grads);
    if (s != DOPT_OK) {
      fprintf(stderr, "distopt run: step %ld: %s\n", t, dopt_last_error());
      rc = CLI_USAGE; /* run compares nothing: a failing step is a runtime failure, 2 */
    }
    /* finite gradients that give a non-finite parameter: the update overflowed (an lr, or gradients whose
     * squares overflow fp32) */
    for (int i = 0; rc == CLI_OK && i < c->np; i++) {
      run_param *p = &c->p[i];
      if (!grads[p->id]) continue;
      int now_finite = 1;
      for (size_t k = 0; k < p->numel && now_finite; k++) now_finite = isfinite(p->data[k]);
      int overflow = finite && p->finite_before && !now_finite;
      p->finite_before = now_finite;
      if (overflow)
        rc = cli_errorf(CMD, "step %ld: parameter '%s' became non-finite with finite gradients: the hyperparameters "
                             "or the gradient magnitudes overflow the update (nothing written)",
                        t, p->name);
    }
  }
  free(grads);
  return rc;
}

static int write_output(run_ctx *c) {
  dopt_st_writer *w;
  dopt_status s = dopt_st_writer_create(&w);
  if (s != DOPT_OK) return cli_error(CMD, s);
  char key[400], buf[64];
  for (int i = 0; i < c->np && s == DOPT_OK; i++) {
    run_param *p = &c->p[i];
    snprintf(key, sizeof key, "param/%s", p->name);
    s = dopt_st_writer_add(w, key, DOPT_F32, p->ndim, p->shape, p->data);
    for (int k = 0; s == DOPT_OK && k < dopt_optim_num_states(c->opt, p->id); k++) {
      dopt_state_view v;
      s = dopt_optim_state(c->opt, p->id, k, &v);
      snprintf(key, sizeof key, "state/%s/%s", p->name, v.name);
      if (s == DOPT_OK) s = dopt_st_writer_add(w, key, v.dtype, v.ndim, v.shape, v.data);
    }
    int64_t step = 0;
    if (s == DOPT_OK && dopt_optim_num_states(c->opt, p->id) > 0) {
      dopt_optim_get_step(c->opt, p->id, &step);
      snprintf(key, sizeof key, "state/%s/step", p->name);
      s = dopt_st_writer_add(w, key, DOPT_I64, 0, NULL, &step);
    }
  }
  if (s == DOPT_OK) s = dopt_st_writer_meta(w, "optimizer", dopt_optim_name(c->opt));
  snprintf(buf, sizeof buf, "%ld", c->steps);
  if (s == DOPT_OK) s = dopt_st_writer_meta(w, "steps", buf);
  snprintf(buf, sizeof buf, "%ld", c->skipped);
  if (s == DOPT_OK) s = dopt_st_writer_meta(w, "skipped_steps", buf);
  const char *hp = c->hparams ? c->hparams : (c->optimizer ? NULL : dopt_st_meta(c->mf, "hparams"));
  if (s == DOPT_OK) s = dopt_st_writer_meta(w, "hparams", hp ? hp : "");
  for (int k = 0; k < c->ngroups && s == DOPT_OK; k++) {
    snprintf(key, sizeof key, "group%d", k + 1);
    s = dopt_st_writer_meta(w, key, c->group_spec[k]);
  }
  if (s == DOPT_OK) s = dopt_st_writer_meta(w, "generator", "distopt run");
  if (s == DOPT_OK) s = dopt_st_writer_save(w, c->out_path);
  dopt_st_writer_free(w);
  if (s == DOPT_OK) return CLI_OK;
  return cli_error(CMD, s); /* the computation ran; writing its result failed: an I/O failure, 2 */
}

/* One line per parameter: shape, group, steps taken, RMS before/after, state bytes. */
static void print_summary(const run_ctx *c) {
  size_t total = 0;
  printf("distopt run: %s, %ld steps, %d parameters -> %s\n", dopt_optim_name(c->opt), c->steps, c->np,
         c->out_path ? c->out_path : c->save_path);
  if (c->resume_path) printf("resumed after step %ld from %s\n", c->start, c->resume_path);
  if (c->save_path) printf("checkpoint: %s/step-%09ld\n", c->save_path, c->steps);
  printf("%-24s %-14s %6s %12s %12s %12s\n", "parameter", "shape", "steps", "rms before", "rms after", "state bytes");
  for (int i = 0; i < c->np; i++) {
    const run_param *p = &c->p[i];
    char shape[64] = "";
    for (int d = 0; d < p->ndim; d++)
      snprintf(shape + strlen(shape), sizeof shape - strlen(shape), "%s%lld", d ? "x" : "", (long long)p->shape[d]);
    int64_t steps = 0;
    size_t bytes = 0;
    dopt_optim_get_step(c->opt, p->id, &steps);
    dopt_optim_state_bytes(c->opt, p->id, &bytes, NULL);
    total += bytes;
    printf("%-24s %-14s %6lld %12.6g %12.6g %12zu\n", p->name, shape[0] ? shape : "scalar", (long long)steps, p->rms0,
           sqrt(dopt_xsum_sq(p->data, p->numel) / (double)p->numel), bytes);
  }
  printf("total optimizer state: %zu bytes\n", total);
  if (c->skipped)
    printf("skipped %ld of %ld steps for a non-finite gradient (first: step %ld; --nonfinite apply steps on them)\n",
           c->skipped, c->steps, c->first_skipped);
}

/* A golden case file holds no parameters but names its inputs file
 * (metadata "inputs", relative to the case file): parameters and gradients
 * then come from there, optimizer/hparams/groups from the case file. */
static int follow_inputs(run_ctx *c) {
  const char *inputs = dopt_st_meta(c->pf, "inputs");
  dopt_st_tensor t;
  for (int i = 0; i < dopt_st_count(c->pf); i++)
    if (dopt_st_get(c->pf, i, &t) == DOPT_OK && !has_prefix(t.name, "param/") && !has_prefix(t.name, "state/"))
      return CLI_OK; /* it has parameters or gradients of its own */
  if (!inputs) return CLI_OK;
  const char *slash = strrchr(c->params_path, '/');
  size_t dl = slash ? (size_t)(slash - c->params_path) + 1 : 0;
  c->inputs_path = malloc(dl + strlen(inputs) + 1);
  if (!c->inputs_path) return cli_errorf(CMD, "out of memory");
  memcpy(c->inputs_path, c->params_path, dl);
  strcpy(c->inputs_path + dl, inputs);
  dopt_status s = dopt_st_load(c->inputs_path, &c->pf);
  if (s != DOPT_OK) {
    c->pf = c->mf;
    return cli_error(CMD, s);
  }
  c->params_path = c->inputs_path;
  return CLI_OK;
}

/* 1 when a and b name the same existing file or folder (links and ./ spellings included). */
static int same_file(const char *a, const char *b) {
  struct stat x, y;
  return a && b && stat(a, &x) == 0 && stat(b, &y) == 0 && x.st_dev == y.st_dev && x.st_ino == y.st_ino;
}

/* The generation --resume names (CKPT's latest, or CKPT/step-N) and its checkpoint folder. */
static int resume_gen(run_ctx *c) {
  dopt_ckpt_reader *r;
  dopt_status s = dopt_ckpt_open(c->resume_path, &r);
  if (s != DOPT_OK) return cli_error(CMD, s);
  snprintf(c->resume_gen, sizeof c->resume_gen, "%s", dopt_ckpt_path(r));
  dopt_ckpt_close(r);
  dopt__path_parent(c->resume_gen, c->resume_dir);
  c->save_into_resumed = c->save_path && same_file(c->save_path, c->resume_dir);
  return CLI_OK;
}

/* Outputs and inputs by the one rule (cli_check_paths), before the steps run: --out and --save
 * are not, and do not hold or lie inside, an input, nor the same path. One exception: --save into the folder of the
 * checkpoint being resumed adds generations to it (resume() refuses a save that would rewrite the
 * generation being read). */
static int check_paths(const run_ctx *c) {
  const cli_path ins[] = {
      {"--params", c->mf_path, 0},
      {"--params (its inputs)", c->inputs_path, 0},
      {"--grads", c->grads_path, 0},
      {"--resume", c->resume_path, 1},
      {"--resume (the generation it names)", c->resume_gen[0] ? c->resume_gen : NULL, 1},
      {"--resume (its checkpoint folder)", c->resume_dir[0] ? c->resume_dir : NULL, 1},
  };
  const int nin = (int)(sizeof ins / sizeof ins[0]);
  const cli_path out = {"--out", c->out_path, 0}, save = {"--save", c->save_path, 1};
  int rc = cli_check_paths(CMD, &out, 1, ins, nin);
  if (rc == CLI_OK) rc = cli_check_paths(CMD, &save, 1, ins, c->save_into_resumed ? nin - 3 : nin);
  const cli_path both[] = {out, save};
  if (rc == CLI_OK) rc = cli_check_outputs(CMD, both, 2);
  return rc;
}

int cmd_run(int argc, char **argv) {
  run_ctx c;
  memset(&c, 0, sizeof c);
  int rc = parse_args(&c, argc, argv);
  dopt_status s;
  if (rc == CLI_OK && (s = dopt_st_load(c.params_path, &c.pf)) != DOPT_OK) rc = cli_error(CMD, s);
  c.mf = c.pf;
  c.mf_path = c.params_path;
  if (rc == CLI_OK) rc = follow_inputs(&c);
  if (rc == CLI_OK) {
    if (!c.grads_path || strcmp(c.grads_path, c.params_path) == 0) {
      c.grads_path = c.params_path;
      c.gf = c.pf;
    } else if ((s = dopt_st_load(c.grads_path, &c.gf)) != DOPT_OK) {
      rc = cli_error(CMD, s);
    }
  }
  if (rc == CLI_OK && c.resume_path) rc = resume_gen(&c);
  if (rc == CLI_OK) rc = check_paths(&c);
  if (rc == CLI_OK) rc = load_params(&c);
  if (rc == CLI_OK) rc = check_grads(&c);
  if (rc == CLI_OK && c.save_path && (s = dopt_ckpt_check_dir(c.save_path, c.steps)) != DOPT_OK)
    rc = cli_error(CMD, s); /* the last save's slots, before the steps run */
  if (rc == CLI_OK) rc = build_optimizer(&c);
  if (rc == CLI_OK && c.resume_path) rc = resume(&c);
  if (rc == CLI_OK && c.save_path) rc = claim_save(&c);
  if (rc == CLI_OK) rc = run_steps(&c);
  if (rc == CLI_OK && c.save_path) rc = save_ckpt(&c, c.steps);
  if (rc == CLI_OK && c.out_path) rc = write_output(&c);
  if (rc == CLI_OK && !c.quiet) print_summary(&c);
  for (int i = 0; i < c.np; i++) {
    free(c.p[i].data);
    free(c.p[i].grad);
  }
  free(c.p);
  free(c.by_name);
  dopt_optim_destroy(c.opt);
  if (c.gf != c.pf) dopt_st_free(c.gf);
  if (c.mf != c.pf) dopt_st_free(c.mf);
  dopt_st_free(c.pf);
  free(c.inputs_path);
  return rc;
}
