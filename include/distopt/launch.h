/* distopt — multi-process launch helpers (plain C, no CUDA needed):
 * the launcher's environment and a TCP rendezvous that checks that every rank
 * runs the same configuration and hands a small blob (the NCCL unique id)
 * from rank 0 to every rank (docs/cuda.md). */
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

/* Rendezvous over TCP (no CUDA needed): rank 0 listens on port (every local
 * address: the name peers use for the master may resolve differently on the
 * master itself); the others connect, with retries, and each sends the
 * SHA-256 of its `check` text. Once every rank has connected, rank 0 answers
 * each with the verdict — the lowest rank whose digest differs from rank
 * 0's — its own check text, and its blob. Every rank returns within
 * timeout_ms (DOPT_ERR_TIMEOUT / DOPT_ERR_IO otherwise), and every rank knows
 * the verdict: DOPT_OK with first_differing >= 0 is a disagreement, for the
 * caller to end every rank. Rank 0 holds one connection per rank until it
 * answers (its open-file limit must exceed the world size). A connection of
 * another round (`tag`) or protocol is closed, and its peer retries. */
#define DOPT_RENDEZVOUS_VERSION 1
#define DOPT_RENDEZVOUS_TAG_BLOB 1u   /* the NCCL unique id (dopt_nccl_init_env) */
#define DOPT_RENDEZVOUS_TAG_CONFIG 2u /* distopt compare's configuration check, before any work */
typedef struct dopt_rendezvous {
  uint32_t struct_size, version;
  const char *addr;        /* rank 0's address (MASTER_ADDR) */
  int port;                /* the rendezvous port (dopt_launch_env.rdzv_port) */
  int rank, nranks;
  uint32_t timeout_ms;
  uint32_t tag;            /* what the round is for: DOPT_RENDEZVOUS_TAG_* */
  const char *check;       /* this rank's text (at most 1 MiB; NULL: empty), compared by SHA-256 */
  size_t check_len;
  char *rank0_check;       /* out (ranks > 0): rank 0's text, NUL-terminated, cut to rank0_cap - 1 bytes */
  size_t rank0_cap, rank0_len;
  int first_differing;     /* out: the lowest rank whose check differs from rank 0's; -1 when all agree */
  void *blob;              /* rank 0: sent; the others: received (bytes each, at most 1 MiB) */
  size_t bytes;
} dopt_rendezvous;
#define DOPT_RENDEZVOUS_INIT \
  { sizeof(dopt_rendezvous), DOPT_RENDEZVOUS_VERSION, NULL, 0, 0, 1, 120000, DOPT_RENDEZVOUS_TAG_BLOB, NULL, 0, NULL, 0, 0, -1, NULL, 0 }
DOPT_API dopt_status dopt_rendezvous_run(dopt_rendezvous *r);

/* The blob alone (tag DOPT_RENDEZVOUS_TAG_BLOB, no check): rank 0 sends blob[bytes] to the nranks-1
 * others; every rank returns with the blob or fails within timeout_ms. */
DOPT_API dopt_status dopt_rendezvous_blob(const char *addr, int port, int rank, int nranks, void *blob, size_t bytes,
                                          uint32_t timeout_ms);

#ifdef __cplusplus
}
#endif
#endif
