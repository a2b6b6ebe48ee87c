/* distopt compare: run an optimizer under a plugin and layout beside the
 * single-device reference and report, per parameter and state tensor, how far
 * apart they are (see compare/compare.h, docs/cli.md).
 *   exit 0: equivalent within the optimizer's declared tolerance (bitwise for
 *           every current optimizer); 1: not; 2: bad usage or input. */
#include <stdarg.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli.h"
#include "files.h"
#include "compare.h"
#include "model.h"
#include "distopt/mpi.h"
#include "registry.h"

static const char *const CMD = "compare";

/* A library error as one line, control characters of echoed input escaped (cli_errorf). */
static int lib_error(dopt_status s) {
  const char *msg = dopt_last_error();
  return cli_errorf(CMD, "%s", *msg ? msg : dopt_status_str(s));
}

static void compare_usage(FILE *f) {
  fputs("usage: distopt compare [--config run.yaml] [--optimizer NAME] [--hparams k=v,...]\n"
        "         [--group 'GLOB:k=v,...']... [--plugin ddp|zero|hybrid|fsdp|gemini|moe_hybrid] [--tp N] [--dp N]\n"
        "         [--zero 0-3] [--pp N [--layers-per-stage N,N,...]] [--chunk-size N] [--ep N] [--expert-stacks GLOB]\n"
        "         [--ranks N] [--steps N] [--accumulation N] [--max-grad-norm X] [--bf16]\n"
        "         [--trace FILE | [--seed N] [--model NAME|COUNT]] [--ring-order] [--dp-sum exact|exact2|rank-order] [--batch-invariant]\n"
        "         [--checkpoint-at K [--resume-plugin P] [--resume-tp T] [--resume-dp D] [--resume-zero Z] [--resume-pp N]\n"
        "          [--resume-chunk-size N] [--resume-ep N]\n"
        "          [--checkpoint-dir DIR [--start-over]]] [--json FILE] [--plot FILE.svg] [--quiet]\n"
        "         [--backend sim|nccl|mpi] [--device cpu|cuda] [--threads N]\n"
        "       distopt compare --matrix [--steps N]\n"
        "       distopt compare --sweep [--max-tp N] [--max-dp N] [--max-pp N] [--optimizer NAME] [--hparams k=v,...] [--steps N]\n"
        "         [gradient, accumulation, dp-sum and bf16 options as above] [--json FILE]\n"
        "  Runs the distributed optimizer on tp*dp simulated ranks beside the single-device reference on\n"
        "  the same gradients (a recorded trace, or seeded synthetic gradients) and prints, per parameter\n"
        "  and state, max abs error, max ULP distance, bitwise yes/no and the first divergent step.\n"
        "  Defaults: adafactor, hybrid tp=2 dp=2 zero=2, 100 steps, synthetic gradients; without --hparams the\n"
        "  upstream defaults, or the optimizer's registry example when those are not a valid optimizer (CAME's lr).\n"
        "  --plugin sets what it implies unless given: ddp tp=1 zero=0; zero tp=1 zero=1 (or --zero 2);\n"
        "  hybrid zero=2 (0-2); fsdp zero=3. A given value the plugin does not allow is an error.\n"
        "  --pp N (hybrid): N pipeline stages, the world pp x tp x dp; decoder layers ('layers.N.') split as\n"
        "  ColossalAI's default (or --layers-per-stage), embeddings on the first stage, norm and head on the last.\n"
        "  --plugin gemini --chunk-size N: ColossalAI's Gemini, ZeRO-3 over chunks of N elements (default 2^20)\n"
        "  that pack consecutive tensors, so a rank's shard cuts through them.\n"
        ,
        f);
  fputs(
        "  --plugin moe_hybrid --ep N: ColossalAI's MoE-Hybrid, dp = moe_dp x ep: the experts' tensors (named\n"
        "  'experts.<e>.') each on one ep rank, replicated and ZeRO-sharded over its moe_dp ranks, their gradient\n"
        "  summed over moe_dp only; the other tensors as hybrid (--model mixtral-mini). Stacks of every expert\n"
        "  (>= 3-D, named '...experts.gate_proj', or matching --expert-stacks GLOB) are split over ep by dimension 0.\n"
        "  --sweep: the optimizer in every layout tp 1..max-tp x dp 1..max-dp x zero 0..3 (default 4 x 4 x 4,\n"
        "  at most 8 x 8), a grid of verdicts and 'N of M layouts bitwise'.\n"
        "  --model: synthetic gradients of a LLaMA (9 x layers + 3 tensors): a preset llama-60m, llama-130m,\n"
        "  llama-350m, llama-1b, llama-7b, mixtral-mini, mixtral-8x7b, or a parameter count\n"
        "  COUNT[k|m|b][xLAYERS][eEXPERTS[s]] (100m, 2mx32; eEXPERTS: each MLP E stacked experts [E, f, h] and a\n"
        "  router, 4mx2e8; with s separate tensors per expert as Mixtral's, 4mx2e8s; docs/cli.md, \"Models\");\n"
        "  without it a small built-in transformer (9 tensors, 10 342 parameters).\n"
        "  --ring-order: the simulator sums like a ring all-reduce (as NCCL may) instead of in rank order.\n"
        "  --dp-sum: the data-parallel gradient sum: exact (default; fixed-point, one int64 word per element,\n"
        "  the same bits in any reduction order), exact2 (two words: exact for a wider range of magnitudes)\n"
        "  or rank-order (fp32 in the transport's order; bitwise only while it sums in rank order).\n"
        "  --checkpoint-at K: save after step K (docs/checkpoints.md) and continue from the checkpoint in the\n"
        "  resume layout (default: the same); the reference runs uninterrupted. Bitwise across dp changes needs\n"
        "  --batch-invariant (otherwise the dp sum groups micro-batches by rank). --checkpoint-dir DIR holds only\n"
        "  this run's generations, each save after its latest (refused before any step: another run's folder, or a\n"
        "  generation it would replace); --start-over removes DIR's generations first.\n"
        "  --batch-invariant: every micro-batch gradient is summed on the grid itself (kept until the step), so\n"
        "  the bits do not depend on how the global batch is split into dp x accumulation.\n"
        "  --device cuda: the distributed optimizer runs on the GPU (CUDA device, device-buffer simulator);\n"
        "  --backend nccl: one process per rank under torchrun/mpirun/srun, NCCL collectives (docs/cuda.md).\n"
        "  --backend mpi: one process per rank under mpirun -np tp*dp, MPI collectives, CPU (docs/mpi.md).\n"
        "  --threads N: threads of the reference's step (default: the library's, DOPT_NUM_THREADS or the\n"
        "  cores, with the simulator, whose ranks wait while it steps; 1 with a process per rank).\n"
        "  Exit: 0 equivalent (bitwise where declared), 1 not equivalent, 2 bad usage or input.\n",
        f);
}

static int parse_int(const char *opt, const char *v, int lo, int hi, int *out) {
  char *end;
  long x = strtol(v, &end, 10);
  if (*v == '\0' || *end || x < lo || x > hi) return cli_errorf(CMD, "%s '%s': expected an integer in [%d, %d]", opt, v, lo, hi);
  *out = (int)x;
  return CLI_OK;
}

static int parse_size(const char *opt, const char *v, size_t lo, size_t hi, size_t *out) {
  char *end;
  errno = 0;
  unsigned long long x = strtoull(v, &end, 10);
  if (*v < '0' || *v > '9' || *end || errno || x < lo || x > hi)
    return cli_errorf(CMD, "%s '%s': expected an integer in [%zu, %zu]", opt, v, lo, hi);
  *out = (size_t)x;
  return CLI_OK;
}

static int copy_opt(const char *opt, const char *v, char *dst, size_t cap) {
  if (strlen(v) >= cap) return cli_errorf(CMD, "%s: value too long (%zu bytes, at most %zu)", opt, strlen(v), cap - 1);
  memcpy(dst, v, strlen(v) + 1);
  return CLI_OK;
}

/* The engine's step callback (the lead, after each step): cli_progress's line, with the worst ULP so far. */
static void progress(int step, int steps, double elapsed, uint64_t worst, void *user) {
  (void)elapsed;
  char extra[64];
  if (worst == UINT64_MAX) snprintf(extra, sizeof extra, "worst: NaN mismatch");
  else snprintf(extra, sizeof extra, "worst ULP so far: %llu", (unsigned long long)worst);
  cli_progress_step(user, "compare", step, steps, extra);
}

/* The measured compatibility matrix: every registered optimizer under every
 * plugin in a small default layout. */
static int run_matrix(int steps) {
  static const struct {
    const char *plugin;
    int tp, dp, zero, pp, ep;
  } plugins[] = {{"ddp", 1, 2, 0, 1, 1},    {"zero", 1, 2, 1, 1, 1}, {"zero", 1, 3, 2, 1, 1},
                 {"hybrid", 2, 2, 2, 1, 1}, {"fsdp", 2, 2, 3, 1, 1}, {"hybrid", 2, 2, 1, 3, 1},
                 {"gemini", 1, 3, 3, 1, 1}, {"moe_hybrid", 2, 4, 1, 1, 4}};
  const int np = (int)(sizeof plugins / sizeof plugins[0]);
  printf("measured compatibility (synthetic gradients, %d steps, bitwise against the reference)\n%-17s", steps,
         "optimizer");
  for (int p = 0; p < np; p++) {
    char h[32];
    if (plugins[p].pp > 1)
      snprintf(h, sizeof h, "%s z%d pp%dx%dx%d", plugins[p].plugin, plugins[p].zero, plugins[p].pp, plugins[p].tp,
               plugins[p].dp);
    else if (plugins[p].ep > 1)
      snprintf(h, sizeof h, "moe z%d %dx%d ep%d", plugins[p].zero, plugins[p].tp, plugins[p].dp, plugins[p].ep);
    else
      snprintf(h, sizeof h, "%s z%d %dx%d", plugins[p].plugin, plugins[p].zero, plugins[p].tp, plugins[p].dp);
    printf(" %-18s", h);
  }
  printf("\n");
  int all = 1, failed = 0; /* a diverged cell: 1; a cell that failed to run: 2 */
  char reasons[4096] = "";
  for (int k = 0; k < dopt_optim_registry_count(); k++) {
    const char *name = dopt_optim_registry_name(k);
    printf("%-17s", name);
    for (int p = 0; p < np; p++) {
      cmp_options o;
      cmp_options_default(&o);
      snprintf(o.optimizer, sizeof o.optimizer, "%s", name);
      dopt_optim_info in; /* the optimizer's example: a rank below the small model's dimensions, an lr CAME needs */
      if (dopt_optim_registry_info(k, &in) == DOPT_OK) snprintf(o.hparams, sizeof o.hparams, "%s", in.example);
      snprintf(o.plugin, sizeof o.plugin, "%s", plugins[p].plugin);
      o.tp = plugins[p].tp;
      o.dp = plugins[p].dp;
      o.zero = plugins[p].zero;
      o.pp = plugins[p].pp; /* the built-in model's 3 layers: one per stage */
      /* Gemini: chunks of 64 elements over dp 3, so shards cut through the built-in model's tensors (32 x 32
       * and larger ones alone in their chunks) */
      o.chunk_size = strcmp(plugins[p].plugin, "gemini") == 0 ? 64 : 0;
      /* MoE-Hybrid: the Mixtral-shaped model (6 experts of w1, w2, w3 per layer) on ep 4, experts 0-1 and 2-3
       * two per ep rank, 4 and 5 one: uneven, each summed over its ep rank's tp x 1 ranks only */
      o.ep = plugins[p].ep;
      if (o.ep > 1) snprintf(o.model, sizeof o.model, "mixtral-mini");
      o.steps = steps;
      cmp_result r;
      dopt_status s = cmp_run(&o, &r, NULL, NULL);
      const char *cell = "\xe2\x9c\x94 bitwise"; /* ✔ */
      char why[256] = "";
      if (s != DOPT_OK) snprintf(why, sizeof why, "%s", dopt_last_error()), failed = 1;
      else if (!r.equivalent) {
        int worst = 0;
        for (int t = 0; t < r.ntensors; t++)
          if (r.t[t].max_ulp > r.t[worst].max_ulp) worst = t;
        snprintf(why, sizeof why, "%s differs from step %d (%llu ULP)", r.t[worst].name, r.t[worst].first_diff,
                 (unsigned long long)r.t[worst].max_ulp);
      }
      if (why[0]) {
        cell = "\xe2\x9c\x98 see below"; /* ✘ */
        all = 0;
        snprintf(reasons + strlen(reasons), sizeof reasons - strlen(reasons), "  %s / %s: %s\n", name,
                 plugins[p].plugin, why);
      }
      printf(" %-20s", cell); /* every cell has one 3-byte UTF-8 symbol: 18 columns */
      if (s == DOPT_OK) cmp_result_free(&r);
      fflush(stdout);
    }
    printf("\n");
  }
  if (reasons[0]) printf("reasons:\n%s", reasons);
  return failed ? CLI_USAGE : all ? CLI_OK : CLI_FAIL;
}

/* --sweep's progress line (cli_progress): layouts done, s/layout, ETA, the layout starting. */
static void sweep_progress(cli_progress *pg, int k, int n, int pp, int tp, int dp, int zero) {
  char extra[96];
  snprintf(extra, sizeof extra, "now pp %d \xC3\x97 tp %d \xC3\x97 dp %d \xC3\x97 zero %d", pp, tp, dp, zero);
  cli_progress_step(pg, "compare --sweep", k, n, extra);
}

/* --sweep: the optimizer of *base in every layout tp x dp x zero, each compared with the reference as a
 * plain compare does (cmp_run: the reference steps in lockstep with each run). A layout a trace cannot
 * split (dp not dividing its shards per step) is skipped and said so. The first layout (1 x 1 x 0) failing
 * is bad input: its one-line error, exit 2. */
static int run_sweep(const cmp_options *base) {
  const int n = base->max_pp * base->max_tp * base->max_dp * 4;
  cmp_sweep_cell *cells = calloc((size_t)n, sizeof *cells);
  if (!cells) return cli_errorf(CMD, "--sweep: out of memory for %d layouts", n);
  int shards = 0; /* a trace's shards per step */
  if (strcmp(base->source, "trace") == 0 && base->trace_path[0] && cmp_trace_is_recording(base->trace_path)) {
    shards = 1; /* a recording: the whole step's gradient (docs/verify.md) */
  } else if (strcmp(base->source, "trace") == 0 && base->trace_path[0]) {
    dopt_st_file *tf = NULL;
    dopt_status s = dopt_st_load(base->trace_path, &tf);
    if (s != DOPT_OK) {
      free(cells);
      return lib_error(s);
    }
    const char *sh = dopt_st_meta(tf, "shards");
    shards = sh ? atoi(sh) : 0;
    dopt_st_free(tf);
  }
  cli_progress pg;
  cli_progress_init(&pg, base->quiet);
  pg.unit = "layout";
  const double t0 = cmp_now_s();
  int rc = CLI_OK, k = 0;
  for (int pp = 1; pp <= base->max_pp; pp++)
  for (int tp = 1; tp <= base->max_tp; tp++)
    for (int dp = 1; dp <= base->max_dp; dp++)
      for (int zero = 0; zero <= 3; zero++, k++) {
        cmp_sweep_cell *c = &cells[k];
        c->tp = tp, c->dp = dp, c->zero = zero, c->pp = pp;
        /* stages: only hybrid pipelines (any tp, zero 0-2) */
        snprintf(c->plugin, sizeof c->plugin, "%s", pp > 1 && zero < 3 ? "hybrid" : cmp_layout_plugin(tp, zero));
        if (pp > 1 && zero == 3) {
          c->kind = CMP_CELL_SKIPPED;
          snprintf(c->message, sizeof c->message, "pp %d: stages need plugin hybrid (zero 0-2), zero 3 is fsdp", pp);
          continue;
        }
        if (shards > 0 && shards % dp != 0) {
          c->kind = CMP_CELL_SKIPPED;
          snprintf(c->message, sizeof c->message, "dp %d does not divide the %d shards per step of the trace", dp,
                   shards);
          continue;
        }
        sweep_progress(&pg, k, n, pp, tp, dp, zero);
        cmp_options o = *base;
        snprintf(o.plugin, sizeof o.plugin, "%s", c->plugin);
        o.tp = tp, o.dp = dp, o.zero = zero, o.ranks = 0, o.pp = pp, o.nlps = 0;
        cmp_result r;
        dopt_status s = cmp_run(&o, &r, NULL, NULL);
        if (s != DOPT_OK && k == 0) {
          cli_progress_end(&pg);
          free(cells);
          return lib_error(s);
        }
        if (s != DOPT_OK) {
          c->kind = CMP_CELL_ERROR;
          snprintf(c->message, sizeof c->message, "%s", dopt_last_error());
          continue;
        }
        cmp_sweep_cell_set(c, &r);
        cmp_result_free(&r);
      }
  cli_progress_end(&pg);
  cmp_print_sweep(stdout, base, cells, n);
  printf("time: %.1f s\n", cmp_now_s() - t0);
  dopt_status s;
  if (base->json_path[0] && (s = cmp_write_sweep_json(base->json_path, base, cells, n)) != DOPT_OK) rc = lib_error(s);
  int all = 1, failed = 0; /* a layout that diverged: 1; one that failed to run, or the JSON's write: 2 */
  for (k = 0; k < n; k++) all &= cells[k].kind != CMP_CELL_DIVERGED, failed |= cells[k].kind == CMP_CELL_ERROR;
  free(cells);
  return rc != CLI_OK || failed ? CLI_USAGE : all ? CLI_OK : CLI_FAIL;
}

/* What --sweep replaces or cannot run, from the command line (cli_given) or anywhere (o): one line, or CLI_OK. */
static int sweep_conflicts(const cmp_options *o, unsigned cli_given, int ranks_given) {
  static const struct {
    unsigned bit;
    const char *opt;
  } L[] = {{CMP_GIVEN_PLUGIN, "--plugin"}, {CMP_GIVEN_TP, "--tp"}, {CMP_GIVEN_DP, "--dp"}, {CMP_GIVEN_ZERO, "--zero"}};
  for (size_t k = 0; k < sizeof L / sizeof L[0]; k++)
    if (cli_given & L[k].bit)
      return cli_errorf(CMD, "--sweep runs every layout: %s is not used with it (bound the grid with --max-tp/--max-dp)",
                        L[k].opt);
  if (ranks_given) return cli_errorf(CMD, "--sweep runs every layout: --ranks is not used with it");
  if (o->pp != 1 || o->nlps)
    return cli_errorf(CMD, "--sweep runs every layout: --pp/--layers-per-stage (plugin.pp) is not used with it (bound "
                      "the grid with --max-pp)");
  if (o->checkpoint_at > 0)
    return cli_errorf(CMD, "--sweep: --checkpoint-at/checkpoint.at %d is not supported with it (resume one layout "
                      "pair with compare --checkpoint-at)", o->checkpoint_at);
  if (strcmp(o->backend, "sim") != 0)
    return cli_errorf(CMD, "--sweep: backend '%s' (the sweep runs on the simulator: --backend sim)", o->backend);
  if (o->svg_path[0]) return cli_errorf(CMD, "--sweep: --plot/output.plot has one run's curves; use --json for the sweep");
  return CLI_OK;
}

/* The one rule for files (cli_check_paths), before any work: --json, --plot and --checkpoint-dir are not,
 * hold or lie inside an input (--config, --trace: a recording's whole folder), nor one another. */
static int check_paths(const cmp_options *o, const char *config) {
  char rec[sizeof o->trace_path];
  snprintf(rec, sizeof rec, "%s", o->trace_path);
  struct stat st;
  if (strcmp(o->source, "trace") == 0 && cmp_trace_is_recording(rec) && stat(rec, &st) == 0 && !S_ISDIR(st.st_mode))
    dopt__path_parent(o->trace_path, rec); /* RECORDING/index.json: the recording is its folder */
  const int trace = strcmp(o->source, "trace") == 0 && rec[0];
  const cli_path outs[] = {{"--json", o->json_path[0] ? o->json_path : NULL, 0},
                           {"--plot", o->svg_path[0] ? o->svg_path : NULL, 0},
                           {"--checkpoint-dir", o->checkpoint_dir[0] ? o->checkpoint_dir : NULL, 1}};
  const cli_path ins[] = {{"--config", config, 0}, {"--trace", trace ? rec : NULL, 1}};
  return cli_check_paths(CMD, outs, 3, ins, 2);
}

/* Backend mpi, after the run (or a refused start): frees the world and
 * finalises MPI; returns rc. */
static int mpi_end(dopt_mpi_comm *world, int rc) {
  dopt_mpi_destroy(world);
  dopt_status s = dopt_mpi_finalize();
  if (s != DOPT_OK && rc == CLI_OK) rc = cli_error(CMD, s);
  return rc;
}

/* Ranks that agree (compare/agree.c), before any other collective: on a disagreement the lowest differing
 * rank prints the one line naming the option and both values, and every rank returns CLI_USAGE. world: the
 * MPI world; NULL: the NCCL launch's TCP rendezvous. */
static int agree(const cmp_options *o, const dopt_transport *world) {
  char *text = malloc(CMP_CONFIG_MAX), msg[1024];
  if (!text) return cli_errorf(CMD, "out of memory for the configuration check");
  int n = cmp_config_text(o, text, CMP_CONFIG_MAX), first = -1;
  dopt_status s = n < 0 ? DOPT_ERR_INVALID_ARG
                        : world ? cmp_config_agree(world, text, (size_t)n, &first, msg, sizeof msg)
                                : cmp_config_agree_tcp(text, (size_t)n, &first, msg, sizeof msg);
  free(text);
  if (s != DOPT_OK) return cli_error(CMD, s);
  if (first < 0) return CLI_OK;
  if (msg[0]) cli_errorf(CMD, "%s", msg); /* only the lowest differing rank has it */
  return CLI_USAGE;
}

/* Backend mpi, before the run: MPI initialised, the ranks' configurations compared (a difference ends
 * every rank with one line, before anything else can go wrong), and this process's world rank known, so
 * that only rank 0 shows progress and reports. A process count other than tp*dp is one line from rank 0
 * (every rank sees it; none waits). */
static int mpi_begin(const cmp_options *o, dopt_mpi_comm **world, int *rank) {
  dopt_transport wt;
  dopt_status s = dopt_mpi_init(120000, world);
  if (s == DOPT_OK) s = dopt_mpi_transport(*world, &wt);
  if (s != DOPT_OK) {
    int rc = cli_error(CMD, s);
    dopt_mpi_abort(*world); /* returns only when MPI is not up */
    return rc;
  }
  *rank = wt.rank;
  int rc = agree(o, &wt);
  if (rc != CLI_OK) return mpi_end(*world, rc);
  const int nw = o->pp * o->tp * o->dp;
  if (wt.size == nw) return CLI_OK;
  if (wt.rank == 0)
    cli_errorf(CMD, "backend mpi: mpirun started %d processes but pp x tp x dp = %d x %d x %d = %d (run mpirun -np %d)",
               wt.size, o->pp, o->tp, o->dp, nw, nw);
  return mpi_end(*world, CLI_USAGE);
}

static int compare_with(cmp_options *o, int argc, char **argv) {
  int matrix = 0, rc = CLI_OK, ranks_given = 0, max_given = 0;
  unsigned cli_given = 0; /* CMP_GIVEN_* bits of the command line */
  const char *config = NULL;
  /* the config file first, so that options given on the command line win */
  for (int i = 1; i + 1 < argc; i++)
    if (strcmp(argv[i], "--config") == 0) config = argv[i + 1];
  if (config) {
    dopt_status s = cmp_load_yaml(config, o);
    if (s != DOPT_OK) return cli_error(CMD, s);
  }
  int steps_given = 0;
  const char *other = config ? "--config" : NULL; /* the first option --matrix would ignore */
  for (int i = 1; i < argc && rc == CLI_OK; i++) {
    const char *a = argv[i];
    if (!other && strcmp(a, "--matrix") != 0 && strcmp(a, "--steps") != 0 && strcmp(a, "--help") != 0 &&
        strcmp(a, "-h") != 0)
      other = a;
    if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
      compare_usage(stdout);
      return CLI_OK;
    }
    if (strcmp(a, "--matrix") == 0) { matrix = 1; continue; }
    if (strcmp(a, "--sweep") == 0) { o->sweep = 1; continue; }
    if (strcmp(a, "--bf16") == 0) { o->bf16 = 1; continue; }
    if (strcmp(a, "--quiet") == 0) { o->quiet = 1; continue; }
    if (strcmp(a, "--ring-order") == 0) { o->ring_order = 1; continue; }
    if (strcmp(a, "--batch-invariant") == 0) { o->batch_invariant = 1; continue; }
    if (strcmp(a, "--start-over") == 0) { o->start_over = 1; continue; }
    if (i + 1 >= argc) return cli_errorf(CMD, "option '%s' needs a value (or is unknown; see --help)", a);
    const char *v = argv[++i];
    if (!*v && (strcmp(a, "--config") == 0 || strcmp(a, "--trace") == 0 || strcmp(a, "--json") == 0 ||
                strcmp(a, "--plot") == 0 || strcmp(a, "--checkpoint-dir") == 0))
      return cli_errorf(CMD, "%s: empty path", a);
    if (strcmp(a, "--config") == 0) continue;
    else if (strcmp(a, "--optimizer") == 0) rc = copy_opt(a, v, o->optimizer, sizeof o->optimizer);
    else if (strcmp(a, "--hparams") == 0) rc = copy_opt(a, v, o->hparams, sizeof o->hparams);
    else if (strcmp(a, "--group") == 0) {
      const char *colon = strchr(v, ':');
      if (!colon) return cli_errorf(CMD, "--group '%s': expected GLOB:key=value,...", v);
      if (cmp_options_add_group(o, v, (size_t)(colon - v), colon + 1) != DOPT_OK)
        rc = cli_errorf(CMD, "--group: %s", dopt_last_error());
    } else if (strcmp(a, "--plugin") == 0) { rc = copy_opt(a, v, o->plugin, sizeof o->plugin); cli_given |= CMP_GIVEN_PLUGIN; }
    else if (strcmp(a, "--tp") == 0) { rc = parse_int(a, v, 1, 64, &o->tp); cli_given |= CMP_GIVEN_TP; }
    else if (strcmp(a, "--dp") == 0) { rc = parse_int(a, v, 1, 64, &o->dp); cli_given |= CMP_GIVEN_DP; }
    else if (strcmp(a, "--zero") == 0) { rc = parse_int(a, v, 0, 3, &o->zero); cli_given |= CMP_GIVEN_ZERO; }
    else if (strcmp(a, "--pp") == 0) rc = parse_int(a, v, 1, CMP_PP_MAX, &o->pp);
    else if (strcmp(a, "--chunk-size") == 0) rc = parse_size(a, v, 1, CMP_CHUNK_MAX, &o->chunk_size);
    else if (strcmp(a, "--resume-chunk-size") == 0) rc = parse_size(a, v, 1, CMP_CHUNK_MAX, &o->resume_chunk_size);
    else if (strcmp(a, "--resume-pp") == 0) rc = parse_int(a, v, 1, CMP_PP_MAX, &o->resume_pp);
    else if (strcmp(a, "--ep") == 0) rc = parse_int(a, v, 1, 64, &o->ep);
    else if (strcmp(a, "--resume-ep") == 0) rc = parse_int(a, v, 1, 64, &o->resume_ep);
    else if (strcmp(a, "--expert-stacks") == 0) {
      if (strlen(v) >= sizeof o->expert_stacks)
        return cli_errorf(CMD, "--expert-stacks: %zu bytes, at most %zu", strlen(v), sizeof o->expert_stacks - 1);
      snprintf(o->expert_stacks, sizeof o->expert_stacks, "%s", v);
    }
    else if (strcmp(a, "--layers-per-stage") == 0) {
      if (cmp_parse_layers_per_stage(v, o) != DOPT_OK) return cli_errorf(CMD, "--layers-per-stage: %s", dopt_last_error());
    }
    else if (strcmp(a, "--ranks") == 0) { rc = parse_int(a, v, 1, 64, &o->ranks); ranks_given = 1; }
    else if (strcmp(a, "--max-tp") == 0) { rc = parse_int(a, v, 1, CMP_SWEEP_MAX, &o->max_tp); max_given = 1; }
    else if (strcmp(a, "--max-dp") == 0) { rc = parse_int(a, v, 1, CMP_SWEEP_MAX, &o->max_dp); max_given = 1; }
    else if (strcmp(a, "--max-pp") == 0) { rc = parse_int(a, v, 1, CMP_SWEEP_MAX, &o->max_pp); max_given = 1; }
    else if (strcmp(a, "--threads") == 0) rc = parse_int(a, v, 0, 256, &o->threads);
    else if (strcmp(a, "--steps") == 0) { rc = parse_int(a, v, 1, 1000000, &o->steps); steps_given = 1; }
    else if (strcmp(a, "--accumulation") == 0) rc = parse_int(a, v, 1, 1024, &o->micro);
    else if (strcmp(a, "--max-grad-norm") == 0) {
      char *end;
      o->max_grad_norm = strtod(v, &end);
      if (*end || !(o->max_grad_norm >= 0)) return cli_errorf(CMD, "--max-grad-norm '%s': expected a number >= 0", v);
    } else if (strcmp(a, "--trace") == 0) {
      rc = copy_opt(a, v, o->trace_path, sizeof o->trace_path);
      snprintf(o->source, sizeof o->source, "trace");
    } else if (strcmp(a, "--model") == 0) {
      cmp_model m;
      if (cmp_model_parse(v, &m) != DOPT_OK) return cli_errorf(CMD, "%s", dopt_last_error());
      rc = copy_opt(a, v, o->model, sizeof o->model);
      snprintf(o->source, sizeof o->source, "synthetic");
    } else if (strcmp(a, "--seed") == 0) {
      int seed = 0;
      rc = parse_int(a, v, 0, 2147483647, &seed);
      o->seed = (uint64_t)seed;
      snprintf(o->source, sizeof o->source, "synthetic");
    } else if (strcmp(a, "--backend") == 0) {
      if (strcmp(v, "sim") != 0 && strcmp(v, "nccl") != 0 && strcmp(v, "mpi") != 0)
        return cli_errorf(CMD, "--backend '%s': expected sim, nccl or mpi", v);
      rc = copy_opt(a, v, o->backend, sizeof o->backend);
    } else if (strcmp(a, "--checkpoint-at") == 0) rc = parse_int(a, v, 1, 1000000, &o->checkpoint_at);
    else if (strcmp(a, "--resume-tp") == 0) { rc = parse_int(a, v, 1, 64, &o->resume_tp); cli_given |= CMP_GIVEN_RESUME_TP; }
    else if (strcmp(a, "--resume-dp") == 0) { rc = parse_int(a, v, 1, 64, &o->resume_dp); cli_given |= CMP_GIVEN_RESUME_DP; }
    else if (strcmp(a, "--resume-zero") == 0) { rc = parse_int(a, v, 0, 3, &o->resume_zero); cli_given |= CMP_GIVEN_RESUME_ZERO; }
    else if (strcmp(a, "--resume-plugin") == 0) {
      rc = copy_opt(a, v, o->resume_plugin, sizeof o->resume_plugin);
      cli_given |= CMP_GIVEN_RESUME_PLUGIN;
    }
    else if (strcmp(a, "--checkpoint-dir") == 0) rc = copy_opt(a, v, o->checkpoint_dir, sizeof o->checkpoint_dir);
    else if (strcmp(a, "--dp-sum") == 0) {
      o->dp_sum_words = cmp_parse_dp_sum(v);
      if (o->dp_sum_words < 0) return cli_errorf(CMD, "--dp-sum '%s': expected exact, exact2 or rank-order", v);
    } else if (strcmp(a, "--device") == 0) {
      if (strcmp(v, "cpu") != 0 && strcmp(v, "cuda") != 0) return cli_errorf(CMD, "--device '%s': expected cpu or cuda", v);
      rc = copy_opt(a, v, o->device, sizeof o->device);
    } else if (strcmp(a, "--json") == 0) rc = copy_opt(a, v, o->json_path, sizeof o->json_path);
    else if (strcmp(a, "--plot") == 0) rc = copy_opt(a, v, o->svg_path, sizeof o->svg_path);
    else return cli_errorf(CMD, "unknown option '%s' (see --help)", a);
  }
  if (rc != CLI_OK) return rc;
  /* the command line's layout values win over the file's */
  o->given |= cli_given;
  o->given_yaml &= ~cli_given;
  if (matrix && o->sweep) return cli_errorf(CMD, "--matrix and --sweep: choose one");
  if (max_given && !o->sweep) return cli_errorf(CMD, "--max-tp/--max-dp/--max-pp only apply with --sweep");
  if (matrix && other)
    return cli_errorf(CMD, "--matrix runs its own grid (every optimizer in every layout; only --steps applies): "
                      "'%s' would be ignored", other);
  if (matrix) return run_matrix(steps_given ? o->steps : 20);
  if ((rc = check_paths(o, config)) != CLI_OK) return rc;
  /* no hyperparameters given: upstream's defaults, or the registry's example where those are not an optimizer */
  if (!o->hparams[0]) snprintf(o->hparams, sizeof o->hparams, "%s", cli_default_hparams(o->optimizer));
  if (o->sweep) {
    if ((rc = sweep_conflicts(o, cli_given, ranks_given)) != CLI_OK) return rc;
    return run_sweep(o);
  }
  dopt_status ps = cmp_apply_plugin(o);
  if (ps != DOPT_OK) return lib_error(ps);
  dopt_mpi_comm *mpi_world = NULL; /* backend mpi: MPI is up from here to mpi_end */
  int mpi_rank = 0;
  if (strcmp(o->backend, "mpi") == 0 && (rc = mpi_begin(o, &mpi_world, &mpi_rank)) != CLI_OK) return rc;
  if (strcmp(o->backend, "nccl") == 0 && (rc = agree(o, NULL)) != CLI_OK) return rc;
  cmp_result r;
  cli_progress pg;
  cli_progress_init(&pg, o->quiet || mpi_rank != 0);
  dopt_status s = cmp_run(o, &r, pg.on ? progress : NULL, &pg);
  cli_progress_end(&pg);
  if (s != DOPT_OK) {
    if (mpi_world && r.before_work) { /* refused by its checks on some rank, agreed by all: one line, exit 2 */
      rc = r.said_elsewhere ? CLI_USAGE : cli_error(CMD, s);
      return mpi_end(mpi_world, rc);
    }
    rc = cli_error(CMD, s); /* bad input, or the run failed (a rank, a checkpoint's write): 2 either way */
    if (mpi_world) dopt_mpi_abort(mpi_world); /* the whole job stops: no peer waits for its timeout */
    return rc;
  }
  if (r.rank != 0) { /* backends nccl and mpi: rank 0 reports (with mpi: every rank's measurements) */
    cmp_result_free(&r);
    return mpi_world ? mpi_end(mpi_world, CLI_OK) : CLI_OK;
  }
  cmp_print_table(stdout, o, &r);
  if (o->json_path[0] && (s = cmp_write_json(o->json_path, o, &r)) != DOPT_OK) rc = cli_error(CMD, s);
  if (rc == CLI_OK && o->svg_path[0] && (s = cmp_write_svg(o->svg_path, o, &r)) != DOPT_OK) rc = cli_error(CMD, s);
  int eq = r.equivalent;
  cmp_result_free(&r);
  if (rc == CLI_OK && !eq) rc = CLI_FAIL; /* a failed --json or --plot write stays 2: the result was not delivered */
  return mpi_world ? mpi_end(mpi_world, rc) : rc;
}

int cmd_compare(int argc, char **argv) {
  cmp_options o;
  cmp_options_default(&o);
  const int rc = compare_with(&o, argc, argv);
  cmp_options_free(&o);
  return rc;
}
