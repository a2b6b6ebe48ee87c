/* distopt — the transport interface: the collectives the distributed
 * optimizers use, behind a small vtable so distributed/ runs unchanged on the
 * pthread simulator (sim/, dopt_sim_transport) and on NCCL (cuda/).
 *
 * A dopt_transport is one rank's handle on one process group (TP, DP/ZeRO or
 * the world). Buffers are in the memory of the device the caller uses (host
 * memory for the CPU device). Every call is collective over the group and
 * returns a dopt_status; a failure on one rank fails the call on all ranks
 * (the backends guarantee it: validation, timeouts, abort).
 *
 * Bitwise equality with the reference needs reductions in a fixed order
 * (rank order 0..n-1) for floating-point sums; distributed/ only relies on that for
 * the data-parallel gradient sum. Every optimizer statistic is reduced as
 * MAX (F64) and SUM (I64), which are exact in any order. */
#ifndef DISTOPT_TRANSPORT_H
#define DISTOPT_TRANSPORT_H

#include <stddef.h>

#include "distopt/dtype.h"
#include "distopt/export.h"
#include "distopt/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Reduction operators. AVG = SUM in the backend's order, then one division
 * by the group size. */
typedef enum dopt_redop {
  DOPT_SUM = 0,
  DOPT_PROD = 1,
  DOPT_MAX = 2,
  DOPT_MIN = 3,
  DOPT_AVG = 4,
  DOPT_REDOP_COUNT_
} dopt_redop;

typedef struct dopt_transport_ops {
  dopt_status (*all_reduce)(void *comm, const void *send, void *recv, size_t count, dopt_dtype dt, dopt_redop op);
  /* recv gets this rank's recvcount elements of the reduced send[size·recvcount] */
  dopt_status (*reduce_scatter)(void *comm, const void *send, void *recv, size_t recvcount, dopt_dtype dt,
                                dopt_redop op);
  /* recv[size·sendcount] = concatenation of every rank's send[sendcount] in rank order */
  dopt_status (*all_gather)(void *comm, const void *send, void *recv, size_t sendcount, dopt_dtype dt);
  dopt_status (*broadcast)(void *comm, const void *send, void *recv, size_t count, dopt_dtype dt, int root);
} dopt_transport_ops;

typedef struct dopt_transport {
  const dopt_transport_ops *ops;
  void *comm; /* backend communicator (dopt_sim_comm*, an NCCL communicator, ...) */
  int rank;
  int size;
} dopt_transport;

#ifdef __cplusplus
}
#endif
#endif
