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
 * MAX (F64) and SUM (I64), which are exact in any order.
 *
 * Bytes (the accounting of docs/sim.md and the benchmarks): a collective counts
 * its message as nccl-tests does (all_reduce, reduce, broadcast: count·size;
 * reduce_scatter, all_gather: count·size·n); all_to_allv, a set of
 * point-to-point messages, counts what point-to-point does, the bytes sent:
 * the most that any one rank sends to the others (its own region excluded),
 * bus factor 1. */
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
  /* recv[count] on rank root = the reduction of every rank's send[count] (in the order all_reduce uses); recv
   * is only written, and only needed, on the root. NULL: distributed/ uses all_reduce instead. */
  dopt_status (*reduce)(void *comm, const void *send, void *recv, size_t count, dopt_dtype dt, dopt_redop op,
                        int root);
  /* Personalised exchange (MPI_Alltoallv; NCCL's grouped send/recv): to every rank r this rank sends
   * scounts[r] elements starting at send + sdispls[r], and from every rank r it receives rcounts[r] elements
   * into recv + rdispls[r] (counts and displacements in elements of dt; arrays of the group's size). A rank's
   * rcounts[r] equals rank r's scounts[for it]; the send and receive regions must not overlap. NULL:
   * distributed/ uses broadcasts instead. */
  dopt_status (*all_to_allv)(void *comm, const void *send, const size_t *scounts, const size_t *sdispls, void *recv,
                             const size_t *rcounts, const size_t *rdispls, dopt_dtype dt);
  /* Optional, appended in 0.3.0, for ranks that share one address space (the simulator's threads; an MPI
   * shared-memory window could offer it): all_to_allv by reference. The arguments of all_to_allv, with `views`
   * (a host array of the group's size) in place of recv and rdispls: nothing is copied, views[r] receives the
   * address, inside rank r's send buffer, of the rcounts[r] elements rank r sends to this rank (NULL where
   * rcounts[r] is 0). Accounted as the all_to_allv it replaces. The views may be read, and every rank's sent
   * regions must stay unchanged, until the group's view_release (a barrier), which every rank calls once it has
   * finished reading. Only for buffers the caller can read directly (host memory). A rank that fails between
   * the two (a timeout) returns at once while a peer may still be reading its regions: free them only after
   * every rank has returned (the simulator's launch). NULL: distributed/ uses all_to_allv. */
  dopt_status (*all_to_allv_view)(void *comm, const void *send, const size_t *scounts, const size_t *sdispls,
                                  const void **views, const size_t *rcounts, dopt_dtype dt);
  dopt_status (*view_release)(void *comm);
  /* Optional, appended in 0.4.0, under the same conditions: all_gather by reference. views (a host array of the
   * group's size) receives, for every rank r, the address of rank r's send buffer (sendcount elements; NULL
   * where sendcount is 0); nothing is copied. Accounted as the all_gather it replaces; the views are read, and
   * every rank's send buffer stays unchanged, until the group's view_release. NULL: distributed/ uses
   * all_gather. */
  dopt_status (*all_gather_view)(void *comm, const void *send, const void **views, size_t sendcount, dopt_dtype dt);
  /* Optional, appended in 0.5.0, under the same conditions: nb all_to_allv by reference in one call, exchange b
   * sent from its own buffer sends[b] (every rank passes the same nb). scounts, sdispls, rcounts and views hold
   * nb arrays of the group's size one after the other: exchange b's at [b·size, (b+1)·size); views[b·size + r]
   * receives the address of the rcounts[b·size + r] elements rank r's exchange b sends this rank (NULL where 0).
   * Accounted as one all_to_allv of all nb exchanges' elements; released by view_release. The dp sum reads a
   * bucket's parameters' gradients where they lie with it instead of packing them into one buffer. NULL:
   * distributed/ packs the bucket and uses all_to_allv_view. */
  dopt_status (*all_to_allv_view_n)(void *comm, int nb, const void *const *sends, const size_t *scounts,
                                    const size_t *sdispls, const void **views, const size_t *rcounts, dopt_dtype dt);
  /* Optional, appended in 0.5.0, under the same conditions: nb all_gather by reference in one call, gather b of
   * counts[b] elements from sends[b] (every rank the same nb and counts); views[b·size + r] receives the address
   * of rank r's sends[b] (NULL where counts[b] is 0). Accounted as one all_gather of all nb gathers' elements;
   * released by view_release. The ZeRO 1/2 weight gather reads a bucket's shards where they lie with it. NULL:
   * distributed/ packs the bucket and uses all_gather_view. */
  dopt_status (*all_gather_view_n)(void *comm, int nb, const void *const *sends, const size_t *counts,
                                   const void **views, dopt_dtype dt);
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
