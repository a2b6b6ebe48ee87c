/* distopt — the MPI transport (docs/mpi.md): one process per rank under
 * mpirun, host buffers (the CPU device). Built as the separate library
 * distopt_mpi when CMake finds MPI (DOPT_MPI=AUTO|ON|OFF); without MPI the
 * same symbols exist and return DOPT_ERR_UNSUPPORTED with a message.
 *
 * Collectives (dopt_transport_ops): all_reduce, reduce_scatter, all_gather,
 * broadcast, reduce (rank order as all_reduce; MPI_Igather to the root for
 * the exchanged kinds) and all_to_allv (MPI_Ialltoallv: counts and region
 * ends up to INT_MAX elements) on F32, F64, BF16, I32, I64, U8 (moves: every dtype); ops SUM,
 * PROD, MAX, MIN, AVG. Floating-point SUM/PROD/AVG, and every BF16
 * reduction, are computed in rank order 0..n-1 — every rank's contribution
 * is exchanged (MPI_Allgather / MPI_Alltoall), then summed locally as
 * x0 + x1 + ... + x(n-1) (BF16 accumulated in fp32, rounded once), AVG then
 * divided once by n — so the result is bitwise the simulator's and the
 * reference's. I32/I64 ops and F32/F64 MAX/MIN use MPI's native reductions
 * (exact in any order); U8 SUM/PROD/AVG are exchanged and wrap (OpenMPI's
 * AVX uint8 sum saturates). In place: all_reduce send == recv, reduce_scatter
 * recv == send + rank·recvcount, all_gather send == recv + rank·sendcount,
 * broadcast send == recv.
 *
 * Timeouts: every collective is nonblocking (MPI_Iallreduce, ...), polled
 * with MPI_Test until the communicator's timeout; then DOPT_ERR_TIMEOUT and
 * the communicator is unusable (later calls: DOPT_ERR_ABORTED). MPI cannot
 * cancel a collective: the timed-out operation stays pending and may still
 * write its receive buffer if the late peers arrive. The library never exits,
 * aborts or prints; dopt_mpi_abort is the caller's choice.
 *
 * Calls on one communicator must come from one thread at a time (MPI is
 * initialised with MPI_THREAD_SERIALIZED requested). */
#ifndef DISTOPT_MPI_H
#define DISTOPT_MPI_H

#include <stddef.h>
#include <stdint.h>

#include "distopt/export.h"
#include "distopt/status.h"
#include "distopt/transport.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct dopt_mpi_comm dopt_mpi_comm;

/* 1 when distopt was built with MPI, else 0. */
DOPT_API int dopt_mpi_available(void);

/* Initialises MPI if it is not yet (MPI_Init_thread) and returns *world, a
 * duplicate of MPI_COMM_WORLD whose collectives time out after timeout_ms
 * (inherited by its splits). May be called again (another duplicate, e.g. with
 * another timeout). Collective over MPI_COMM_WORLD. */
DOPT_API dopt_status dopt_mpi_init(uint32_t timeout_ms, dopt_mpi_comm **world);
/* MPI_Comm_split: ranks with the same color form a communicator ordered by
 * key; color < 0 gives *out = NULL. Collective over comm (the arrival of every
 * rank is awaited with the timeout before MPI_Comm_split is called). */
DOPT_API dopt_status dopt_mpi_split(dopt_mpi_comm *comm, int color, int key, dopt_mpi_comm **out);
/* The communicator as a dopt_transport (borrowed; buffers are host memory). */
DOPT_API dopt_status dopt_mpi_transport(dopt_mpi_comm *comm, dopt_transport *out);
/* Elements per MPI call (default and maximum INT_MAX: counts above it are
 * split into chunks). Tests set it small to exercise the chunking. Inherited
 * by later splits. */
DOPT_API dopt_status dopt_mpi_set_chunk(dopt_mpi_comm *comm, size_t elems);
/* MPI_Abort of the whole job (every process of MPI_COMM_WORLD, exit code 1);
 * comm may be NULL. For a tool's error path, so that peers stop at once
 * instead of waiting for their timeouts. Returns only when MPI is not
 * initialised (DOPT_ERR_STATE) or distopt was built without MPI. */
DOPT_API dopt_status dopt_mpi_abort(dopt_mpi_comm *comm);
/* Frees the communicator (MPI_Comm_free); NULL is a no-op. Does not wait: the
 * scratch of a timed-out collective that is still pending is leaked. */
DOPT_API void dopt_mpi_destroy(dopt_mpi_comm *comm);
/* MPI_Finalize, if dopt_mpi_init initialised MPI and it is not finalised yet
 * (an application that initialised MPI itself finalises it). Collective. */
DOPT_API dopt_status dopt_mpi_finalize(void);

#ifdef __cplusplus
}
#endif
#endif
