/* distopt — multi-process launch helpers (plain C, no CUDA needed):
 * the launcher's environment and a TCP rendezvous that hands a small blob
 * (the NCCL unique id) from rank 0 to every rank (docs/cuda.md). */
#ifndef DISTOPT_LAUNCH_H
#define DISTOPT_LAUNCH_H

#include <stddef.h>
#include <stdint.h>

#include "distopt/export.h"
#include "distopt/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct dopt_launch_env {
  int rank, world_size, local_rank;
  char master_addr[256]; /* "" when not given */
  int master_port;       /* 0 when not given */
  const char *launcher;  /* "torchrun", "openmpi", "slurm" */
  /* The port of distopt's own rendezvous: DOPT_RDZV_PORT, else MASTER_PORT + 1
   * (torchrun's TCPStore already listens on MASTER_PORT); 0 when neither. */
  int rdzv_port;
} dopt_launch_env;

/* Reads the launcher's variables through getenv-like `get` (NULL: getenv):
 *   torchrun  RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT
 *   OpenMPI   OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_RANK
 *   SLURM     SLURM_PROCID, SLURM_NPROCS or SLURM_NTASKS, SLURM_LOCALID
 * first match in that order; MASTER_ADDR/MASTER_PORT (and DOPT_RDZV_PORT) are
 * read for all three.
 * DOPT_ERR_NOT_FOUND when none is set, DOPT_ERR_INVALID_ARG for a malformed
 * or inconsistent value (named in the message). */
typedef const char *(*dopt_getenv_fn)(const char *name, void *user);
DOPT_API dopt_status dopt_launch_env_parse(dopt_getenv_fn get, void *user, dopt_launch_env *out);

/* The CUDA device of a process with this local rank on a node where it sees
 * ndev devices: local_rank mod ndev (srun --gpus-per-task 1 shows each task
 * one device, numbered 0; torchrun on an 8-GPU node shows all 8). -1 when
 * ndev < 1 or local_rank < 0. */
DOPT_API int dopt_launch_device(int local_rank, int ndev);

/* Rendezvous: rank 0 listens on port (every local address: the name peers use
 * for the master may resolve differently on the master itself) and sends blob[bytes] to each of
 * the nranks-1 others (which connect with retries); every rank returns with
 * the blob or fails within timeout_ms (DOPT_ERR_TIMEOUT / DOPT_ERR_IO). */
DOPT_API dopt_status dopt_rendezvous_blob(const char *addr, int port, int rank, int nranks, void *blob, size_t bytes,
                                          uint32_t timeout_ms);

#ifdef __cplusplus
}
#endif
#endif
