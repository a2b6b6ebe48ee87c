/* dopt_sim_bench: bus bandwidth of the simulator's all-reduce, reduce-scatter
 * and all-gather (fp32, sum) from 1 KiB to 256 MiB at 2, 4 and 8 ranks, side
 * by side with OpenMPI's shared-memory collectives when built with MPI.
 * Prints a table (median of the iterations), not a test.
 *
 *   dopt_sim_bench [--max-bytes N] [--no-mpi]
 */
#include "distopt/sim.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { NKINDS = 3, MAXSIZES = 16, MAXITERS = 21 };

static const dopt_sim_kind kinds[NKINDS] = {DOPT_SIM_KIND_ALL_REDUCE, DOPT_SIM_KIND_REDUCE_SCATTER,
                                            DOPT_SIM_KIND_ALL_GATHER};

typedef struct bench {
  size_t sizes[MAXSIZES]; /* bytes, nccl-tests convention (full buffer) */
  int nsizes;
  float *send[8], *recv[8];
  double median[NKINDS][MAXSIZES]; /* seconds, filled by rank 0 */
} bench;

static int iters_for(size_t bytes) { return bytes <= (1u << 20) ? 21 : bytes <= (16u << 20) ? 7 : 3; }

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static double median(double *v, int n) {
  qsort(v, (size_t)n, sizeof *v, cmp_double);
  return v[n / 2];
}

static dopt_status run_op(dopt_sim_kind kind, bench *b, int rank, int n, size_t bytes,
                          dopt_sim_comm *c) {
  size_t count = bytes / sizeof(float);
  switch (kind) {
  case DOPT_SIM_KIND_ALL_REDUCE:
    return dopt_sim_all_reduce(b->send[rank], b->recv[rank], count, DOPT_F32, DOPT_SUM, c);
  case DOPT_SIM_KIND_REDUCE_SCATTER:
    return dopt_sim_reduce_scatter(b->send[rank], b->recv[rank], count / (size_t)n, DOPT_F32,
                                   DOPT_SUM, c);
  default:
    return dopt_sim_all_gather(b->send[rank], b->recv[rank], count / (size_t)n, DOPT_F32, c);
  }
}

static dopt_status bench_body(dopt_sim_comm *c, int rank, void *user) {
  bench *b = user;
  int n;
  dopt_status s = dopt_sim_comm_size(c, &n);
  size_t maxb = b->sizes[b->nsizes - 1];
  b->send[rank] = malloc(maxb);
  b->recv[rank] = malloc(maxb);
  if (b->send[rank] == NULL || b->recv[rank] == NULL)
    return DOPT_ERR_NO_MEMORY;
  for (size_t e = 0; e < maxb / sizeof(float); e++) /* first touch by the owner */
    b->send[rank][e] = (float)((e + (size_t)rank) % 7);
  memset(b->recv[rank], 0, maxb);
  for (int k = 0; s == DOPT_OK && k < NKINDS; k++) {
    for (int i = 0; s == DOPT_OK && i < b->nsizes; i++) {
      double t[MAXITERS];
      int iters = iters_for(b->sizes[i]);
      for (int it = -1; s == DOPT_OK && it < iters; it++) { /* it = -1: warm-up */
        s = dopt_sim_barrier(c);
        double t0 = now_s();
        if (s == DOPT_OK)
          s = run_op(kinds[k], b, rank, n, b->sizes[i], c);
        if (it >= 0) /* rank 0 leaves after every rank has finished the data phase */
          t[it] = now_s() - t0;
      }
      if (rank == 0 && s == DOPT_OK)
        b->median[k][i] = median(t, iters);
    }
  }
  return s;
}

/* Runs the MPI bench for n ranks; fills mpi[k][i] (0 when absent). */
static void run_mpi(int n, size_t max_bytes, const bench *b, double mpi[NKINDS][MAXSIZES]) {
  memset(mpi, 0, sizeof(double) * NKINDS * MAXSIZES);
#if defined(DOPT_BENCH_MPIRUN) && defined(DOPT_BENCH_MPI)
  char cmd[1024];
  snprintf(cmd, sizeof cmd, "%s --oversubscribe --allow-run-as-root -np %d %s %zu 2>/dev/null",
           DOPT_BENCH_MPIRUN, n, DOPT_BENCH_MPI, max_bytes);
  FILE *p = popen(cmd, "r");
  if (p == NULL)
    return;
  char line[256];
  while (fgets(line, sizeof line, p) != NULL) {
    int k, nn;
    unsigned long long bytes;
    double sec;
    if (sscanf(line, "%d %d %llu %lf", &k, &nn, &bytes, &sec) != 4 || k < 0 || k >= NKINDS)
      continue;
    for (int i = 0; i < b->nsizes; i++)
      if (b->sizes[i] == bytes)
        mpi[k][i] = sec;
  }
  pclose(p);
#else
  (void)n;
  (void)max_bytes;
  (void)b;
#endif
}

int main(int argc, char **argv) {
  size_t max_bytes = 256u << 20;
  int use_mpi = 1;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--max-bytes") == 0 && i + 1 < argc)
      max_bytes = (size_t)strtoull(argv[++i], NULL, 10);
    else if (strcmp(argv[i], "--no-mpi") == 0)
      use_mpi = 0;
    else {
      fprintf(stderr, "usage: %s [--max-bytes N] [--no-mpi]\n", argv[0]);
      return 2;
    }
  }
#if !(defined(DOPT_BENCH_MPIRUN) && defined(DOPT_BENCH_MPI))
  use_mpi = 0;
#endif
  static const int ranks[] = {2, 4, 8};
  printf("# busbw in GB/s (nccl-tests factors), fp32 sum, median; sim = dopt simulator%s\n",
         use_mpi ? ", mpi = OpenMPI (mpirun --oversubscribe, shared memory)" : "");
  printf("%-15s %2s %10s %10s %10s %8s\n", "kind", "n", "bytes", "sim", use_mpi ? "mpi" : "-",
         use_mpi ? "sim/mpi" : "-");
  for (size_t ri = 0; ri < sizeof ranks / sizeof ranks[0]; ri++) {
    int n = ranks[ri];
    bench *b = calloc(1, sizeof *b);
    if (b == NULL)
      return 1;
    for (size_t s = 1024; s <= max_bytes && b->nsizes < MAXSIZES; s *= 4)
      b->sizes[b->nsizes++] = s;
    if (b->nsizes == 0) {
      free(b);
      return 2;
    }
    dopt_sim_config cfg = DOPT_SIM_CONFIG_INIT;
    cfg.nranks = n;
    cfg.timeout_ms = 600000;
    dopt_sim_world *w;
    dopt_status st[8];
    if (dopt_sim_world_create(&cfg, &w) != DOPT_OK ||
        dopt_sim_launch(w, bench_body, b, st) != DOPT_OK) {
      fprintf(stderr, "sim bench failed at n=%d: %s\n", n, dopt_last_error());
      return 1;
    }
    dopt_sim_world_destroy(w);
    for (int r = 0; r < n; r++) {
      free(b->send[r]);
      free(b->recv[r]);
    }
    double mpi[NKINDS][MAXSIZES];
    if (use_mpi)
      run_mpi(n, b->sizes[b->nsizes - 1], b, mpi);
    for (int k = 0; k < NKINDS; k++) {
      for (int i = 0; i < b->nsizes; i++) {
        double f = dopt_sim_busbw_factor(kinds[k], n), B = (double)b->sizes[i];
        double sim = B / b->median[k][i] * f * 1e-9;
        if (use_mpi && mpi[k][i] > 0.0) {
          double m = B / mpi[k][i] * f * 1e-9;
          printf("%-15s %2d %10zu %10.2f %10.2f %8.2f\n", dopt_sim_kind_name(kinds[k]), n,
                 b->sizes[i], sim, m, sim / m);
        } else {
          printf("%-15s %2d %10zu %10.2f %10s %8s\n", dopt_sim_kind_name(kinds[k]), n, b->sizes[i],
                 sim, "-", "-");
        }
      }
    }
    fflush(stdout);
    free(b);
  }
  return 0;
}
