/* OpenMPI counterpart of dopt_sim_bench (run by it through mpirun): same
 * kinds, sizes, iteration counts and timing (max over ranks, median).
 * Prints "kind nranks bytes seconds" lines on rank 0.
 *
 *   mpirun -np N dopt_bench_mpi MAX_BYTES
 */
#include <mpi.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { NKINDS = 3, MAXITERS = 21 };

static int iters_for(size_t bytes) { return bytes <= (1u << 20) ? 21 : bytes <= (16u << 20) ? 7 : 3; }

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static void run_op(int kind, const float *send, float *recv, size_t bytes, int n) {
  int count = (int)(bytes / sizeof(float));
  if (kind == 0)
    MPI_Allreduce(send, recv, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  else if (kind == 1)
    MPI_Reduce_scatter_block(send, recv, count / n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  else
    MPI_Allgather(send, count / n, MPI_FLOAT, recv, count / n, MPI_FLOAT, MPI_COMM_WORLD);
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int rank, n;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  size_t max_bytes = argc > 1 ? (size_t)strtoull(argv[1], NULL, 10) : (size_t)1 << 20;
  float *send = malloc(max_bytes), *recv = malloc(max_bytes);
  if (send == NULL || recv == NULL)
    MPI_Abort(MPI_COMM_WORLD, 1);
  for (size_t e = 0; e < max_bytes / sizeof(float); e++)
    send[e] = (float)((e + (size_t)rank) % 7);
  memset(recv, 0, max_bytes);
  for (int k = 0; k < NKINDS; k++) {
    for (size_t bytes = 1024; bytes <= max_bytes; bytes *= 4) {
      double t[MAXITERS];
      int iters = iters_for(bytes);
      for (int it = -1; it < iters; it++) {
        MPI_Barrier(MPI_COMM_WORLD);
        double t0 = MPI_Wtime();
        run_op(k, send, recv, bytes, n);
        double dt = MPI_Wtime() - t0, worst;
        MPI_Reduce(&dt, &worst, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
        if (it >= 0)
          t[it] = worst;
      }
      if (rank == 0) {
        qsort(t, (size_t)iters, sizeof t[0], cmp_double);
        printf("%d %d %zu %.9f\n", k, n, bytes, t[iters / 2]);
        fflush(stdout);
      }
    }
  }
  free(send);
  free(recv);
  MPI_Finalize();
  return 0;
}
