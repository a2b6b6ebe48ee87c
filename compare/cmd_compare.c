/* distopt compare: run an optimizer under a plugin and layout beside the
 * single-device reference and report, per parameter and state tensor, how far
 * apart they are (see compare/compare.h, docs/cli.md).
 *   exit 0: equivalent within the optimizer's declared tolerance (bitwise for
 *           every current optimizer); 1: not; 2: bad usage or input. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"
#include "compare.h"
#include "distopt/mpi.h"
#include "registry.h"

static const char *const CMD = "compare";

static void compare_usage(FILE *f) {
  fputs("usage: distopt compare [--config run.yaml] [--optimizer NAME] [--hparams k=v,...]\n"
        "         [--group 'GLOB:k=v,...']... [--plugin ddp|zero|hybrid|fsdp] [--tp N] [--dp N] [--zero 0-3]\n"
        "         [--ranks N] [--steps N] [--accumulation N] [--max-grad-norm X] [--bf16]\n"
        "         [--trace FILE | --seed N] [--ring-order] [--dp-sum exact|exact2|rank-order] [--batch-invariant]\n"
        "         [--checkpoint-at K [--resume-plugin P] [--resume-tp T] [--resume-dp D] [--resume-zero Z]\n"
        "          [--checkpoint-dir DIR]] [--json FILE] [--plot FILE.svg] [--quiet]\n"
        "         [--backend sim|nccl|mpi] [--device cpu|cuda]\n"
        "       distopt compare --matrix [--steps N]\n"
        "  Runs the distributed optimizer on tp*dp simulated ranks beside the single-device reference on\n"
        "  the same gradients (a recorded trace, or seeded synthetic gradients) and prints, per parameter\n"
        "  and state, max abs error, max ULP distance, bitwise yes/no and the first divergent step.\n"
        "  Defaults: adafactor, hybrid tp=2 dp=2 zero=2, 100 steps, synthetic gradients.\n"
        "  --ring-order: the simulator sums like a ring all-reduce (as NCCL may) instead of in rank order.\n"
        "  --dp-sum: the data-parallel gradient sum: exact (default; fixed-point, one int64 word per element,\n"
        "  the same bits in any reduction order), exact2 (two words: exact for a wider range of magnitudes)\n"
        "  or rank-order (fp32 in the transport's order; bitwise only while it sums in rank order).\n"
        "  --checkpoint-at K: save after step K (docs/checkpoints.md) and continue from the checkpoint in the\n"
        "  resume layout (default: the same); the reference runs uninterrupted. Bitwise across dp changes needs\n"
        "  --batch-invariant (otherwise the dp sum groups micro-batches by rank).\n"
        "  --batch-invariant: every micro-batch gradient is summed on the grid itself (kept until the step), so\n"
        "  the bits do not depend on how the global batch is split into dp x accumulation.\n"
        "  --device cuda: the distributed optimizer runs on the GPU (CUDA device, device-buffer simulator);\n"
        "  --backend nccl: one process per rank under torchrun/mpirun/srun, NCCL collectives (docs/cuda.md).\n"
        "  --backend mpi: one process per rank under mpirun -np tp*dp, MPI collectives, CPU (docs/mpi.md).\n"
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

static int copy_opt(const char *opt, const char *v, char *dst, size_t cap) {
  if (strlen(v) >= cap) return cli_errorf(CMD, "%s: value too long (%zu bytes, at most %zu)", opt, strlen(v), cap - 1);
  memcpy(dst, v, strlen(v) + 1);
  return CLI_OK;
}

static void progress(int step, int steps, double elapsed, uint64_t worst, void *user) {
  (void)user;
  if (worst == UINT64_MAX) printf("\rstep %d/%d  %.1f s  worst: NaN mismatch   ", step, steps, elapsed);
  else printf("\rstep %d/%d  %.1f s  worst ULP so far: %llu   ", step, steps, elapsed, (unsigned long long)worst);
  if (step == steps) printf("\r%60s\r", "");
  fflush(stdout);
}

/* The measured compatibility matrix: every registered optimizer under every
 * plugin in a small default layout. */
/* Hyperparameters of a --matrix row: the defaults, except what the small
 * synthetic block needs to exercise the optimizer (GaLore projects with a
 * rank below its dimensions and refreshes several times; 8-bit states reach
 * their threshold; CAME needs an lr). */
static const char *matrix_hparams(const char *name) {
  static const struct {
    const char *name, *hp;
  } H[] = {{"came", "lr=2e-4"},
           {"adamw8bit", "min_8bit_size=64"},
           {"galore_adamw", "rank=4,update_proj_gap=2"},
           {"galore_adamw8bit", "rank=4,update_proj_gap=2,min_8bit_size=64"},
           {"q_galore", "rank=4,update_proj_gap=2,proj_group_size=-1"},
           {"lisa", "inner=adamw,n_layers=1,interval=2"}};
  for (size_t k = 0; k < sizeof H / sizeof H[0]; k++)
    if (strcmp(H[k].name, name) == 0) return H[k].hp;
  return "";
}

static int run_matrix(int steps) {
  static const struct {
    const char *plugin;
    int tp, dp, zero;
  } plugins[] = {{"ddp", 1, 2, 0}, {"zero", 1, 2, 1}, {"zero", 1, 3, 2}, {"hybrid", 2, 2, 2}, {"fsdp", 2, 2, 3}};
  const int np = (int)(sizeof plugins / sizeof plugins[0]);
  printf("measured compatibility (synthetic gradients, %d steps, bitwise against the reference)\n%-17s", steps,
         "optimizer");
  for (int p = 0; p < np; p++) {
    char h[32];
    snprintf(h, sizeof h, "%s z%d %dx%d", plugins[p].plugin, plugins[p].zero, plugins[p].tp, plugins[p].dp);
    printf(" %-18s", h);
  }
  printf("\n");
  int all = 1;
  char reasons[4096] = "";
  for (int k = 0; k < dopt_optim_registry_count(); k++) {
    const char *name = dopt_optim_registry_name(k);
    printf("%-17s", name);
    for (int p = 0; p < np; p++) {
      cmp_options o;
      cmp_options_default(&o);
      snprintf(o.optimizer, sizeof o.optimizer, "%s", name);
      snprintf(o.hparams, sizeof o.hparams, "%s", matrix_hparams(name));
      snprintf(o.plugin, sizeof o.plugin, "%s", plugins[p].plugin);
      o.tp = plugins[p].tp;
      o.dp = plugins[p].dp;
      o.zero = plugins[p].zero;
      o.steps = steps;
      cmp_result r;
      dopt_status s = cmp_run(&o, &r, NULL, NULL);
      const char *cell = "\xe2\x9c\x94 bitwise"; /* ✔ */
      char why[256] = "";
      if (s != DOPT_OK) snprintf(why, sizeof why, "%s", dopt_last_error());
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
  return all ? CLI_OK : CLI_FAIL;
}

/* Backend mpi, after the run (or a refused start): frees the world and
 * finalises MPI; returns rc. */
static int mpi_end(dopt_mpi_comm *world, int rc) {
  dopt_mpi_destroy(world);
  dopt_status s = dopt_mpi_finalize();
  if (s != DOPT_OK && rc == CLI_OK) rc = cli_error(CMD, s);
  return rc;
}

/* Backend mpi, before the run: MPI initialised and this process's world rank
 * known, so that only rank 0 shows progress and reports. A process count
 * other than tp*dp is one line from rank 0 (every rank sees it; none waits). */
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
  if (wt.size == o->tp * o->dp) return CLI_OK;
  if (wt.rank == 0)
    cli_errorf(CMD, "backend mpi: mpirun started %d processes but tp x dp = %d x %d = %d (run mpirun -np %d)", wt.size,
               o->tp, o->dp, o->tp * o->dp, o->tp * o->dp);
  return mpi_end(*world, CLI_USAGE);
}

int cmd_compare(int argc, char **argv) {
  cmp_options o;
  cmp_options_default(&o);
  int matrix = 0, rc = CLI_OK;
  const char *config = NULL;
  /* the config file first, so that options given on the command line win */
  for (int i = 1; i + 1 < argc; i++)
    if (strcmp(argv[i], "--config") == 0) config = argv[i + 1];
  if (config) {
    dopt_status s = cmp_load_yaml(config, &o);
    if (s != DOPT_OK) return cli_error(CMD, s);
  }
  int steps_given = 0;
  for (int i = 1; i < argc && rc == CLI_OK; i++) {
    const char *a = argv[i];
    if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
      compare_usage(stdout);
      return CLI_OK;
    }
    if (strcmp(a, "--matrix") == 0) { matrix = 1; continue; }
    if (strcmp(a, "--bf16") == 0) { o.bf16 = 1; continue; }
    if (strcmp(a, "--quiet") == 0) { o.quiet = 1; continue; }
    if (strcmp(a, "--ring-order") == 0) { o.ring_order = 1; continue; }
    if (strcmp(a, "--batch-invariant") == 0) { o.batch_invariant = 1; continue; }
    if (i + 1 >= argc) return cli_errorf(CMD, "option '%s' needs a value (or is unknown; see --help)", a);
    const char *v = argv[++i];
    if (strcmp(a, "--config") == 0) continue;
    else if (strcmp(a, "--optimizer") == 0) rc = copy_opt(a, v, o.optimizer, sizeof o.optimizer);
    else if (strcmp(a, "--hparams") == 0) rc = copy_opt(a, v, o.hparams, sizeof o.hparams);
    else if (strcmp(a, "--group") == 0) {
      const char *colon = strchr(v, ':');
      if (!colon) return cli_errorf(CMD, "--group '%s': expected GLOB:key=value,...", v);
      if (o.ngroups == CMP_MAX_GROUPS) return cli_errorf(CMD, "--group: more than %d groups", CMP_MAX_GROUPS);
      if ((size_t)(colon - v) >= sizeof o.group_glob[0]) return cli_errorf(CMD, "--group '%s': pattern too long", v);
      memcpy(o.group_glob[o.ngroups], v, (size_t)(colon - v));
      o.group_glob[o.ngroups][colon - v] = '\0';
      rc = copy_opt(a, colon + 1, o.group_hp[o.ngroups], sizeof o.group_hp[0]);
      o.ngroups++;
    } else if (strcmp(a, "--plugin") == 0) rc = copy_opt(a, v, o.plugin, sizeof o.plugin);
    else if (strcmp(a, "--tp") == 0) rc = parse_int(a, v, 1, 64, &o.tp);
    else if (strcmp(a, "--dp") == 0) rc = parse_int(a, v, 1, 64, &o.dp);
    else if (strcmp(a, "--zero") == 0) rc = parse_int(a, v, 0, 3, &o.zero);
    else if (strcmp(a, "--ranks") == 0) rc = parse_int(a, v, 1, 64, &o.ranks);
    else if (strcmp(a, "--steps") == 0) { rc = parse_int(a, v, 1, 1000000, &o.steps); steps_given = 1; }
    else if (strcmp(a, "--accumulation") == 0) rc = parse_int(a, v, 1, 1024, &o.micro);
    else if (strcmp(a, "--max-grad-norm") == 0) {
      char *end;
      o.max_grad_norm = strtod(v, &end);
      if (*end || !(o.max_grad_norm >= 0)) return cli_errorf(CMD, "--max-grad-norm '%s': expected a number >= 0", v);
    } else if (strcmp(a, "--trace") == 0) {
      rc = copy_opt(a, v, o.trace_path, sizeof o.trace_path);
      snprintf(o.source, sizeof o.source, "trace");
    } else if (strcmp(a, "--seed") == 0) {
      int seed = 0;
      rc = parse_int(a, v, 0, 2147483647, &seed);
      o.seed = (uint64_t)seed;
      snprintf(o.source, sizeof o.source, "synthetic");
    } else if (strcmp(a, "--backend") == 0) {
      if (strcmp(v, "sim") != 0 && strcmp(v, "nccl") != 0 && strcmp(v, "mpi") != 0)
        return cli_errorf(CMD, "--backend '%s': expected sim, nccl or mpi", v);
      rc = copy_opt(a, v, o.backend, sizeof o.backend);
    } else if (strcmp(a, "--checkpoint-at") == 0) rc = parse_int(a, v, 1, 1000000, &o.checkpoint_at);
    else if (strcmp(a, "--resume-tp") == 0) rc = parse_int(a, v, 1, 64, &o.resume_tp);
    else if (strcmp(a, "--resume-dp") == 0) rc = parse_int(a, v, 1, 64, &o.resume_dp);
    else if (strcmp(a, "--resume-zero") == 0) rc = parse_int(a, v, 0, 3, &o.resume_zero);
    else if (strcmp(a, "--resume-plugin") == 0) rc = copy_opt(a, v, o.resume_plugin, sizeof o.resume_plugin);
    else if (strcmp(a, "--checkpoint-dir") == 0) rc = copy_opt(a, v, o.checkpoint_dir, sizeof o.checkpoint_dir);
    else if (strcmp(a, "--dp-sum") == 0) {
      o.dp_sum_words = cmp_parse_dp_sum(v);
      if (o.dp_sum_words < 0) return cli_errorf(CMD, "--dp-sum '%s': expected exact, exact2 or rank-order", v);
    } else if (strcmp(a, "--device") == 0) {
      if (strcmp(v, "cpu") != 0 && strcmp(v, "cuda") != 0) return cli_errorf(CMD, "--device '%s': expected cpu or cuda", v);
      rc = copy_opt(a, v, o.device, sizeof o.device);
    } else if (strcmp(a, "--json") == 0) rc = copy_opt(a, v, o.json_path, sizeof o.json_path);
    else if (strcmp(a, "--plot") == 0) rc = copy_opt(a, v, o.svg_path, sizeof o.svg_path);
    else return cli_errorf(CMD, "unknown option '%s' (see --help)", a);
  }
  if (rc != CLI_OK) return rc;
  if (matrix) return run_matrix(steps_given ? o.steps : 20);
  dopt_mpi_comm *mpi_world = NULL; /* backend mpi: MPI is up from here to mpi_end */
  int mpi_rank = 0;
  if (strcmp(o.backend, "mpi") == 0 && (rc = mpi_begin(&o, &mpi_world, &mpi_rank)) != CLI_OK) return rc;
  cmp_result r;
  int tty = !o.quiet && isatty(STDOUT_FILENO) && mpi_rank == 0;
  dopt_status s = cmp_run(&o, &r, tty ? progress : NULL, NULL);
  if (s != DOPT_OK) {
    rc = cli_error(CMD, s);
    if (mpi_world) dopt_mpi_abort(mpi_world); /* the whole job stops: no peer waits for its timeout */
    return rc;
  }
  if (r.rank != 0) { /* backends nccl and mpi: rank 0 reports (with mpi: every rank's measurements) */
    cmp_result_free(&r);
    return mpi_world ? mpi_end(mpi_world, CLI_OK) : CLI_OK;
  }
  cmp_print_table(stdout, &o, &r);
  if (o.json_path[0] && (s = cmp_write_json(o.json_path, &o, &r)) != DOPT_OK) rc = cli_error(CMD, s);
  if (rc == CLI_OK && o.svg_path[0] && (s = cmp_write_svg(o.svg_path, &o, &r)) != DOPT_OK) rc = cli_error(CMD, s);
  int eq = r.equivalent;
  cmp_result_free(&r);
  rc = rc != CLI_OK || !eq ? CLI_FAIL : CLI_OK;
  return mpi_world ? mpi_end(mpi_world, rc) : rc;
}
