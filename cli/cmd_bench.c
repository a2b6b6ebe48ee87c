/* distopt bench: time one optimizer step of each registered optimizer on one
 * fp32 [H, W] parameter and compare the memory traffic it implies with the
 * machine's streaming bandwidth, measured in the same run.
 *
 *   distopt bench [--size HxW] [--iters N] [--warmup N] [--optimizer NAME] [--threads N] [--torch PYTHON]
 *                 [--galore RANK]
 *
 * Per optimizer: median and minimum ms/step over N timed steps (after the
 * warm-up steps, which also allocate the states) at --threads threads, the
 * bytes one step must move under the minimum-traffic model below, achieved
 * GB/s = bytes / median time, and that bandwidth as a fraction of the floor
 * at the same thread count. The floor is a STREAM-style triad a[i] = b[i] +
 * s*c[i] over arrays of the parameter's size (3*4*n bytes counted, median
 * over N runs), on one thread and split over the threads, and a memcpy
 * (2*4*n bytes counted). Times are wall clock (CLOCK_MONOTONIC). --torch
 * PYTHON runs cli/bench_torch.py with that interpreter at the same thread
 * count and adds PyTorch CPU eager ms/step and our speed-up. --galore RANK
 * prints instead the projection wrapper around each inner (bench_galore).
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli.h"
#include "compare.h"

static const char *const CMD = "bench";

/* ---- the minimum-traffic model -------------------------------------------------
 * The bytes one step cannot avoid moving, whatever the implementation: the
 * gradient read once (4n), the parameter read and written once (8n), and
 * every state tensor read and written once (2 x its bytes, from the
 * optimizer's own state layout: 8-bit codes and their block scales, GaLore's
 * low-rank moments and projector, factored row/column statistics). Passes an
 * implementation adds beyond that (the exact sums' max-then-accumulate reads,
 * a preconditioned-update array) are what the model charges it for; write-
 * allocate traffic is not counted (as STREAM does not). Every registered
 * optimizer has this model, so every row has a %floor. */
static double min_traffic(size_t n, size_t state_bytes) { return 12.0 * (double)n + 2.0 * (double)state_bytes; }

/* ---- timing helpers ------------------------------------------------------------- */


static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static double median(double *v, int n) {
  qsort(v, (size_t)n, sizeof *v, cmp_double);
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* deterministic pseudo-random fill (xorshift), roughly N(0, sd²) */
static void fill_random(float *x, size_t n, uint64_t seed, float sd) {
  uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
  for (size_t i = 0; i < n; i++) {
    double acc = 0;
    for (int k = 0; k < 4; k++) {
      s ^= s << 13;
      s ^= s >> 7;
      s ^= s << 17;
      acc += (double)(s >> 11) * (1.0 / 9007199254740992.0);
    }
    x[i] = (float)((acc - 2.0) * 1.7320508 * sd); /* sum of 4 U(0,1): var 1/3 */
  }
}

/* ---- the floor ------------------------------------------------------------------- */

typedef struct floor_result {
  double triad_gbs, triad_ms, copy_gbs, copy_ms; /* one thread */
  double triad_all_gbs, triad_all_ms;            /* split over the bench's threads */
} floor_result;

/* volatile scalar so that the triad is not folded into something cheaper */
static volatile float triad_s = 3.0f;

static void triad(float *restrict a, const float *restrict b, const float *restrict c, size_t n) {
  const float s = triad_s;
  for (size_t i = 0; i < n; i++) a[i] = b[i] + s * c[i];
}

typedef struct triad_part {
  float *a;
  const float *b, *c;
  size_t n;
} triad_part;

static void *triad_thread(void *arg) {
  triad_part *p = arg;
  triad(p->a, p->b, p->c, p->n);
  return NULL;
}

/* The triad split into `threads` contiguous parts, one thread each (the
 * caller runs the first); thread start-up is inside the timed region, as the
 * optimizer's pool wake-up is. */
static void triad_threads(float *a, const float *b, const float *c, size_t n, int threads) {
  pthread_t tid[256];
  triad_part part[256];
  char started[256] = {0};
  if (threads < 1 || threads > 256) threads = 1;
  for (int t = 0; t < threads; t++) {
    size_t lo = n * (size_t)t / (size_t)threads, hi = n * (size_t)(t + 1) / (size_t)threads;
    part[t] = (triad_part){a + lo, b + lo, c + lo, hi - lo};
  }
  for (int t = 1; t < threads; t++)
    if (pthread_create(&tid[t], NULL, triad_thread, &part[t]) == 0) started[t] = 1;
    else triad_thread(&part[t]); /* no thread: run it here (the floor is then lower, not wrong) */
  triad_thread(&part[0]);
  for (int t = 1; t < threads; t++)
    if (started[t]) pthread_join(tid[t], NULL);
}

static int measure_floor(size_t n, int iters, int threads, floor_result *r) {
  float *a = malloc(n * sizeof *a), *b = malloc(n * sizeof *b), *c = malloc(n * sizeof *c);
  double *t = malloc((size_t)(iters + 1) * 2 * sizeof *t);
  if (!a || !b || !c || !t) {
    free(a), free(b), free(c), free(t);
    return cli_errorf(CMD, "out of memory for the bandwidth floor (3 x %zu floats)", n);
  }
  fill_random(b, n, 11, 1.0f);
  fill_random(c, n, 12, 1.0f);
  memset(a, 0, n * sizeof *a);
  triad(a, b, c, n); /* warm-up: page faults, caches */
  for (int k = 0; k < iters; k++) {
    double t0 = cmp_now_s();
    triad(a, b, c, n);
    t[k] = cmp_now_s() - t0;
  }
  double tri = median(t, iters);
  triad_threads(a, b, c, n, threads);
  for (int k = 0; k < iters; k++) {
    double t0 = cmp_now_s();
    triad_threads(a, b, c, n, threads);
    t[k] = cmp_now_s() - t0;
  }
  double tri_all = median(t, iters);
  memcpy(a, b, n * sizeof *a);
  for (int k = 0; k < iters; k++) {
    double t0 = cmp_now_s();
    memcpy(a, k % 2 ? b : c, n * sizeof *a);
    t[k] = cmp_now_s() - t0;
  }
  double cp = median(t, iters);
  r->triad_ms = 1e3 * tri;
  r->triad_gbs = 3.0 * 4.0 * (double)n / tri * 1e-9;
  r->triad_all_ms = 1e3 * tri_all;
  r->triad_all_gbs = 3.0 * 4.0 * (double)n / tri_all * 1e-9;
  r->copy_ms = 1e3 * cp;
  r->copy_gbs = 2.0 * 4.0 * (double)n / cp * 1e-9;
  free(a), free(b), free(c), free(t);
  return CLI_OK;
}

/* ---- one optimizer ----------------------------------------------------------------- */

typedef struct opt_result {
  const char *name;
  double med_ms, min_ms;
  double bytes; /* per step, the minimum-traffic model */
  size_t state_bytes;
  double torch_ms; /* NAN if not measured */
} opt_result;

/* hp NULL: the optimizer's bench setting (cli_default_hparams). */
static int bench_one(const char *name, const char *hp, int64_t h, int64_t w, int warmup, int iters, int threads,
                     float *param, const float *init, const float *grad, opt_result *r) {
  size_t n = (size_t)h * (size_t)w;
  memcpy(param, init, n * sizeof *param);
  dopt_optim *o = NULL;
  dopt_status s = dopt_optim_create(name, hp ? hp : cli_default_hparams(name), &o);
  if (s != DOPT_OK) return cli_error(CMD, s);
  dopt_param_config pc = DOPT_PARAM_CONFIG_INIT;
  pc.name = "weight";
  pc.ndim = 2;
  pc.shape[0] = h;
  pc.shape[1] = w;
  pc.data = param;
  int pid;
  double *t = malloc((size_t)iters * sizeof *t);
  if (!t) {
    dopt_optim_destroy(o);
    return cli_errorf(CMD, "out of memory");
  }
  int rc = CLI_OK;
  if ((s = dopt_optim_set_threads(o, threads)) != DOPT_OK) rc = cli_error(CMD, s);
  if (rc == CLI_OK && (s = dopt_optim_add_param(o, 0, &pc, &pid)) != DOPT_OK) rc = cli_error(CMD, s);
  const float *grads[1] = {grad};
  for (int k = 0; k < warmup && rc == CLI_OK; k++)
    if ((s = dopt_optim_step(o, grads)) != DOPT_OK) rc = cli_error(CMD, s);
  for (int k = 0; k < iters && rc == CLI_OK; k++) {
    double t0 = cmp_now_s();
    s = dopt_optim_step(o, grads);
    t[k] = cmp_now_s() - t0;
    if (s != DOPT_OK) rc = cli_error(CMD, s);
  }
  if (rc == CLI_OK) {
    r->name = name;
    r->med_ms = 1e3 * median(t, iters);
    r->min_ms = 1e3 * t[0]; /* sorted by median() */
    dopt_optim_state_bytes(o, -1, NULL, &r->state_bytes);
    r->bytes = min_traffic(n, r->state_bytes);
    r->torch_ms = NAN;
    /* sanity: the step must leave finite parameters */
    for (size_t i = 0; i < n; i += n / 97 + 1)
      if (!isfinite(param[i])) {
        rc = cli_errorf(CMD, "%s: non-finite parameter after %d steps", name, warmup + iters);
        break;
      }
  }
  free(t);
  dopt_optim_destroy(o);
  return rc;
}

/* ---- PyTorch comparison (optional) ---------------------------------------------------- */

/* Runs cli/bench_torch.py; fills torch_ms of the results it reports
 * ("name ms" lines). Returns 0 if it ran, -1 (after a message) if not. */
/* --torch's interpreter: a path to an executable regular file, or a name found on PATH. */
static int executable(const char *prog) {
  struct stat st;
  if (!*prog) return 0;
  if (strchr(prog, '/')) return stat(prog, &st) == 0 && S_ISREG(st.st_mode) && access(prog, X_OK) == 0;
  const char *path = getenv("PATH");
  char dir[4096], full[8192];
  for (const char *p = path ? path : "/usr/bin:/bin"; *p;) {
    size_t n = strcspn(p, ":");
    snprintf(dir, sizeof dir, "%.*s", (int)n, p);
    snprintf(full, sizeof full, "%s/%s", n ? dir : ".", prog);
    if (stat(full, &st) == 0 && S_ISREG(st.st_mode) && access(full, X_OK) == 0) return 1;
    p += n + (p[n] == ':');
  }
  return 0;
}

static int run_torch(const char *python, int64_t h, int64_t w, int warmup, int iters, int threads, opt_result *res,
                     int nres) {
  /* the script: $DOPT_BENCH_TORCH_SCRIPT, else next to this source file, else ./cli/ */
  const char *script = NULL;
  const char *env = getenv("DOPT_BENCH_TORCH_SCRIPT");
  char here[4096];
  snprintf(here, sizeof here, "%s", __FILE__);
  char *slash = strrchr(here, '/');
  if (slash) slash[1] = '\0';
  else here[0] = '\0';
  char cand[3][4200];
  snprintf(cand[0], sizeof cand[0], "%s", env ? env : "");
  snprintf(cand[1], sizeof cand[1], "%sbench_torch.py", here);
  snprintf(cand[2], sizeof cand[2], "cli/bench_torch.py");
  for (int i = 0; i < 3 && !script; i++) {
    struct stat st; /* a regular, readable file (never opened here: a FIFO would block) */
    if (cand[i][0] && stat(cand[i], &st) == 0 && S_ISREG(st.st_mode) && access(cand[i], R_OK) == 0) script = cand[i];
  }
  if (!script) {
    fprintf(stderr, "distopt bench: --torch: bench_torch.py not found (set DOPT_BENCH_TORCH_SCRIPT); skipping PyTorch\n");
    return -1;
  }
  if (strchr(python, '\'') || strchr(script, '\'')) {
    fprintf(stderr, "distopt bench: --torch: quotes in paths are not supported; skipping PyTorch\n");
    return -1;
  }
  char cmd[16384], names[256] = "";
  for (int i = 0; i < nres; i++)
    snprintf(names + strlen(names), sizeof names - strlen(names), "%s%s", i ? "," : "", res[i].name);
  snprintf(cmd, sizeof cmd, "'%s' '%s' --size %lldx%lld --warmup %d --iters %d --threads %d --optimizers %s 2>&1",
           python, script, (long long)h, (long long)w, warmup, iters, threads, names);
  fflush(stdout);
  FILE *p = popen(cmd, "r");
  if (!p) {
    fprintf(stderr, "distopt bench: --torch: cannot run %s; skipping PyTorch\n", python);
    return -1;
  }
  char line[1024];
  int got = 0;
  while (fgets(line, sizeof line, p)) {
    char nm[64];
    double ms;
    if (sscanf(line, "RESULT %63s %lf", nm, &ms) == 2) {
      for (int i = 0; i < nres; i++)
        if (strcmp(res[i].name, nm) == 0) res[i].torch_ms = ms;
      got++;
    } else if (strncmp(line, "SKIP", 4) == 0 || strncmp(line, "NOTE", 4) == 0) {
      fprintf(stderr, "distopt bench: torch: %s", line + 5);
    } else {
      fprintf(stderr, "distopt bench: torch: %s", line);
    }
  }
  int st = pclose(p);
  if (got == 0) {
    fprintf(stderr, "distopt bench: --torch: no PyTorch timings (exit status %d); skipping PyTorch\n", st);
    return -1;
  }
  return 0;
}

/* ---- --galore RANK: the projection around each inner ------------------------------------
 * Per optimizer galore can wrap (a registered one that steps itself): the
 * inner alone, galore(inner=X) at rank 0 (nothing projected: the inner's
 * step through the wrapper) and at rank RANK (the randomized range finder,
 * refreshed in the first warm-up step only, so the timed steps are
 * project → the inner's low-rank step → back-project), each with its
 * ratio to the inner in the same run. */
static int bench_galore(long rank, int64_t h, int64_t w, int warmup, int iters, int threads, float *param,
                        const float *init, const float *grad) {
  printf("%-11s %10s %12s %9s %14s %9s %12s\n", "inner", "inner_ms", "rank0_ms", "vs_inner", "projected_ms",
         "vs_inner", "state_MiB");
  int rc = CLI_OK;
  for (int i = 0; i < dopt_optim_registry_count() && rc == CLI_OK; i++) {
    const char *name = dopt_optim_registry_name(i);
    char hp0[512], hpr[768]; /* the inner's bench setting (CAME needs an lr) inside the wrapper's */
    const char *ih = cli_default_hparams(name);
    snprintf(hp0, sizeof hp0, "inner=%s%s%s", name, *ih ? "," : "", ih);
    dopt_optim *probe = NULL;
    if (dopt_optim_create("galore", hp0, &probe) != DOPT_OK) continue; /* a wrapper or a GaLore form itself */
    dopt_optim_destroy(probe);
    snprintf(hpr, sizeof hpr, "%s,rank=%ld,svd=randomized,update_proj_gap=1000000", hp0, rank);
    opt_result a, b, c;
    rc = bench_one(name, NULL, h, w, warmup, iters, threads, param, init, grad, &a);
    if (rc == CLI_OK) rc = bench_one("galore", hp0, h, w, warmup, iters, threads, param, init, grad, &b);
    if (rc == CLI_OK) rc = bench_one("galore", hpr, h, w, warmup > 0 ? warmup : 1, iters, threads, param, init, grad, &c);
    if (rc == CLI_OK)
      printf("%-11s %10.2f %12.2f %8.2fx %14.2f %8.2fx %12.2f\n", name, a.med_ms, b.med_ms, b.med_ms / a.med_ms,
             c.med_ms, c.med_ms / a.med_ms, (double)c.state_bytes / 1048576.0);
  }
  if (rc == CLI_OK)
    printf("rank0 = galore(inner=X) with nothing projected (target <= 1.1x the inner); projected = rank %ld, "
           "randomized range finder refreshed in warm-up only; state_MiB = the projected run's states\n", rank);
  return rc;
}

/* ---- the command ----------------------------------------------------------------------- */

static void bench_usage(FILE *f) {
  fputs("usage: distopt bench [--size HxW] [--iters N] [--warmup N] [--optimizer NAME] [--threads N]\n"
        "                    [--torch PYTHON] [--galore RANK]\n"
        "  times one step of each registered optimizer (or NAME) on one fp32 [H, W] parameter\n"
        "  (default 4096x4096, 10 timed steps after 2 warm-up steps; median and min reported) and\n"
        "  compares the bytes a step must move (gradient, parameter and states once) with a triad\n"
        "  bandwidth floor measured in the same run on one thread and on N threads.\n"
        "  --threads N: threads of the step and of the floor (default: DOPT_NUM_THREADS, else the cores)\n"
        "  --torch PYTHON: also time PyTorch CPU eager steps at the same thread count (cli/bench_torch.py)\n"
        "  --galore RANK: instead, each optimizer galore can wrap: alone, galore(inner=X) at rank 0 and at RANK\n",
        f);
}

static int parse_int(const char *opt, const char *v, long lo, long hi, long *out) {
  char *end;
  long x = strtol(v, &end, 10);
  if (*end || end == v || x < lo || x > hi) return cli_errorf(CMD, "%s '%s': expected an integer in [%ld, %ld]", opt, v, lo, hi);
  *out = x;
  return CLI_OK;
}

int cmd_bench(int argc, char **argv) {
  long h = 4096, w = 4096, iters = 10, warmup = 2, threads = 0, galore_rank = -1;
  const char *only = NULL, *python = NULL;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
      bench_usage(stdout);
      return CLI_OK;
    }
    if (i + 1 >= argc) return cli_errorf(CMD, "option '%s' needs a value (or is unknown)", a);
    const char *v = argv[++i];
    int rc = CLI_OK;
    if (strcmp(a, "--size") == 0) {
      char *end;
      h = strtol(v, &end, 10);
      if (end == v || (*end != 'x' && *end != 'X')) return cli_errorf(CMD, "--size '%s': expected HxW, e.g. 4096x4096", v);
      const char *ws = end + 1;
      w = strtol(ws, &end, 10);
      if (end == ws || *end || h <= 0 || w <= 0 || h > 1L << 20 || w > 1L << 20 || (double)h * (double)w > 1e9)
        return cli_errorf(CMD, "--size '%s': expected HxW with positive sides and at most 1e9 elements", v);
    } else if (strcmp(a, "--iters") == 0) {
      rc = parse_int(a, v, 1, 100000, &iters);
    } else if (strcmp(a, "--warmup") == 0) {
      rc = parse_int(a, v, 0, 100000, &warmup);
    } else if (strcmp(a, "--optimizer") == 0) {
      only = v;
    } else if (strcmp(a, "--threads") == 0) {
      rc = parse_int(a, v, 1, 256, &threads);
    } else if (strcmp(a, "--galore") == 0) {
      rc = parse_int(a, v, 1, 1L << 20, &galore_rank);
    } else if (strcmp(a, "--torch") == 0) {
      python = v;
      if (!executable(python))
        return cli_errorf(CMD, "--torch '%s': no such executable (give a Python interpreter, e.g. python3)", v);
    } else {
      return cli_errorf(CMD, "unknown option '%s' (see --help)", a);
    }
    if (rc != CLI_OK) return rc;
  }
  int nreg = dopt_optim_registry_count(), found = 0;
  for (int i = 0; only && i < nreg; i++) found |= strcmp(dopt_optim_registry_name(i), only) == 0;
  if (only && !found) return cli_errorf(CMD, "--optimizer '%s': not registered (see 'distopt list')", only);

  if (threads == 0) { /* the library's default: DOPT_NUM_THREADS, else the cores */
    dopt_optim *probe = NULL;
    dopt_status s = dopt_optim_create("adamw", NULL, &probe);
    threads = s == DOPT_OK ? dopt_optim_get_threads(probe) : 0;
    dopt_optim_destroy(probe);
    if (threads < 1) return cli_errorf(CMD, "DOPT_NUM_THREADS='%s': expected an integer in [1, 256]",
                                       getenv("DOPT_NUM_THREADS") ? getenv("DOPT_NUM_THREADS") : "");
  }
  size_t n = (size_t)h * (size_t)w;
  float *init = malloc(n * sizeof *init), *param = malloc(n * sizeof *param), *grad = malloc(n * sizeof *grad);
  opt_result *res = calloc((size_t)nreg, sizeof *res);
  if (!init || !param || !grad || !res) {
    free(init), free(param), free(grad), free(res);
    return cli_errorf(CMD, "out of memory for a %ldx%ld parameter", h, w);
  }
  fill_random(init, n, 1, 0.02f);
  fill_random(grad, n, 2, 1e-3f);

  printf("distopt bench: one fp32 [%ld, %ld] parameter (%.1f MiB), %ld warm-up + %ld timed steps, median, %ld thread%s\n",
         h, w, (double)n * 4.0 / 1048576.0, warmup, iters, threads, threads == 1 ? "" : "s");
  fflush(stdout);
  if (galore_rank > 0) {
    if (only || python) {
      free(init), free(param), free(grad), free(res);
      return cli_errorf(CMD, "--galore: times every inner itself (without --optimizer and --torch)");
    }
    int grc = bench_galore(galore_rank, h, w, (int)warmup, (int)iters, (int)threads, param, init, grad);
    free(init), free(param), free(grad), free(res);
    return grc;
  }
  floor_result fl = {0, 0, 0, 0, 0, 0};
  int rc = measure_floor(n, (int)(iters < 5 ? 5 : iters), (int)threads, &fl);
  int nres = 0;
  for (int i = 0; i < nreg && rc == CLI_OK; i++) {
    const char *name = dopt_optim_registry_name(i);
    if (only && strcmp(name, only) != 0) continue;
    rc = bench_one(name, NULL, h, w, (int)warmup, (int)iters, (int)threads, param, init, grad, &res[nres]);
    if (rc == CLI_OK) nres++;
  }
  int have_torch = 0;
  if (rc == CLI_OK && python) have_torch = run_torch(python, h, w, (int)warmup, (int)iters, (int)threads, res, nres) == 0;

  if (rc == CLI_OK) {
    printf("%-17s %10s %10s %12s %8s %8s %12s", "optimizer", "median_ms", "min_ms", "min_MB/step", "GB/s", "%floor",
           "state_MiB");
    if (have_torch) printf(" %10s %9s", "torch_ms", "vs_torch");
    printf("\n");
    for (int i = 0; i < nres; i++) {
      const opt_result *r = &res[i];
      printf("%-17s %10.2f %10.2f ", r->name, r->med_ms, r->min_ms);
      double gbs = r->bytes / (r->med_ms * 1e-3) * 1e-9;
      printf("%12.1f %8.2f %7.1f%%", r->bytes / 1e6, gbs, 100.0 * gbs / fl.triad_all_gbs);
      printf(" %12.2f", (double)r->state_bytes / 1048576.0);
      if (have_torch) {
        if (isnan(r->torch_ms)) printf(" %10s %9s", "-", "-");
        else printf(" %10.2f %8.2fx", r->torch_ms, r->torch_ms / r->med_ms);
      }
      printf("\n");
    }
    printf("floor: triad a=b+s*c on %ld thread%s %.2f GB/s (%.2f ms, 12 B/elem), on 1 thread %.2f GB/s (%.2f ms); "
           "memcpy %.2f GB/s (%.2f ms, 8 B/elem)\n"
           "min_MB/step = gradient read + parameter and states read and written once; "
           "%%floor = GB/s / triad GB/s on %ld thread%s; vs_torch = torch_ms / median_ms\n",
           threads, threads == 1 ? "" : "s", fl.triad_all_gbs, fl.triad_all_ms, fl.triad_gbs, fl.triad_ms, fl.copy_gbs,
           fl.copy_ms, threads, threads == 1 ? "" : "s");
  }
  free(init), free(param), free(grad), free(res);
  return rc;
}
