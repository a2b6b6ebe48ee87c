/* distopt — collective simulator.
 *
 * Runs N ranks as threads of one process behind an NCCL-shaped API so that
 * distributed optimizers run unchanged on one machine and can be compared
 * bitwise with a single-device reference. Host memory only.
 *
 *   dopt_sim_config cfg = DOPT_SIM_CONFIG_INIT;
 *   cfg.nranks = 4;
 *   dopt_sim_world *w;  dopt_sim_world_create(&cfg, &w);
 *   dopt_status st[4];  dopt_sim_launch(w, body, user, st);  // body(comm, rank, user) on 4 threads
 *   dopt_sim_world_destroy(w);
 *
 * Guarantees (see docs/sim.md):
 *  - Deterministic: reductions combine contributions in a fixed order (rank
 *    order 0..n-1, or the ring order of DOPT_SIM_ORDER_RING) regardless of
 *    thread scheduling, so repeated runs are bitwise identical.
 *  - Validated: every collective's signature (kind, count, dtype, op, root) is
 *    compared across the ranks of the communicator; a mismatch, or an argument
 *    error on any one rank, makes the call fail on every rank with the same code.
 *  - No hangs: every wait is bounded by the communicator's timeout. A timeout,
 *    an abort, an injected backend error or a rank body returning an error
 *    poisons the whole world (every communicator split from it): every rank
 *    blocked in, or later entering, a call returns DOPT_ERR_ABORTED.
 *
 * Threading: a communicator handle belongs to one rank; only that rank's thread
 * may call collectives on it. Query functions may be called from any thread.
 */
#ifndef DISTOPT_SIM_H
#define DISTOPT_SIM_H

#include <stddef.h>
#include <stdint.h>

#include "distopt/dtype.h"
#include "distopt/export.h"
#include "distopt/status.h"
#include "distopt/transport.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct dopt_sim_world dopt_sim_world; /* N ranks, their communicators, faults, log */
typedef struct dopt_sim_comm dopt_sim_comm;   /* one rank's handle on one communicator */

/* Element types: dopt_dtype (distopt/dtype.h). Collectives take DOPT_F32,
 * DOPT_F64, DOPT_BF16 (uint16_t storage; reductions accumulate in fp32 in the
 * fixed order and round to bf16 once, nearest-even), DOPT_I32, DOPT_I64
 * (integer sum/prod wrap modulo 2^bits) and DOPT_U8; DOPT_F16 and DOPT_I8 are
 * rejected with DOPT_ERR_UNSUPPORTED. */

/* Reduction operators: dopt_redop (distopt/transport.h): DOPT_SUM, DOPT_PROD,
 * DOPT_MAX, DOPT_MIN, DOPT_AVG (= SUM in the fixed order, then one division by
 * n; integer types: truncating division of the wrapped sum). */

/* Order in which reductions combine the ranks' contributions. */
typedef enum dopt_sim_mode {
  DOPT_SIM_ORDER_RANK = 0, /* every element: x0 + x1 + ... + x(n-1) */
  DOPT_SIM_ORDER_RING = 1, /* ring all-reduce/reduce-scatter: the buffer is cut in
                              n chunks; chunk c starts at rank (c+1) mod n and
                              accumulates around the ring, ending at rank c.
                              reduce: every element starts at (root+1) mod n. */
} dopt_sim_mode;

/* Operation kinds, used for validation messages and accounting. */
typedef enum dopt_sim_kind {
  DOPT_SIM_KIND_ALL_REDUCE = 0,
  DOPT_SIM_KIND_REDUCE_SCATTER,
  DOPT_SIM_KIND_ALL_GATHER,
  DOPT_SIM_KIND_BROADCAST,
  DOPT_SIM_KIND_REDUCE,
  DOPT_SIM_KIND_ALL_TO_ALL,
  DOPT_SIM_KIND_SEND,
  DOPT_SIM_KIND_RECV,
  DOPT_SIM_KIND_BARRIER,
  DOPT_SIM_KIND_SPLIT,
  DOPT_SIM_KIND_ALL_TO_ALLV, /* appended: the kinds above keep their values */
  DOPT_SIM_KIND_COUNT
} dopt_sim_kind;

/* ---- fault injection --------------------------------------------------------
 * op_index counts every call a rank makes on any communicator of the world
 * (collectives, send, recv, barrier, split), from 0, per world rank. */
typedef enum dopt_sim_fault_kind {
  DOPT_SIM_FAULT_NONE = 0,
  DOPT_SIM_FAULT_STOP,    /* rank never arrives at op k: its call returns
                             DOPT_ERR_ABORTED, peers wait (timeout) until the rank
                             body's error return poisons the world */
  DOPT_SIM_FAULT_DELAY,   /* rank arrives delay_ms late at op k */
  DOPT_SIM_FAULT_BITFLIP, /* after op k completes on rank r, bit `bit` of element
                             `elem` (mod the element count) of the data r received
                             is flipped; nothing is reported (silent corruption) */
  DOPT_SIM_FAULT_BACKEND, /* op k returns DOPT_ERR_BACKEND on rank r without
                             arriving and poisons the world (peers: ABORTED) */
} dopt_sim_fault_kind;

#define DOPT_SIM_FAULT_ANY_RANK (-1)        /* rank drawn from the seed */
#define DOPT_SIM_FAULT_ANY_BIT UINT32_MAX   /* bit drawn from the seed */

typedef struct dopt_sim_fault {
  dopt_sim_fault_kind kind;
  int rank;          /* world rank, or DOPT_SIM_FAULT_ANY_RANK */
  uint64_t op_index; /* per-rank operation index (see above) */
  uint32_t delay_ms; /* DELAY */
  uint64_t elem;     /* BITFLIP: element index in the received data */
  uint32_t bit;      /* BITFLIP: bit within the element, or DOPT_SIM_FAULT_ANY_BIT */
} dopt_sim_fault;

/* ---- data movement ------------------------------------------------------------
 * Where rank buffers live. NULL (the default): host memory, memcpy and the
 * fixed-order loops of sim/sim_data.c. A device implementation
 * (dopt_cuda_sim_memops, distopt/cuda.h) lets the ranks pass device buffers:
 * the same three operations, synchronous for the calling thread, with the
 * same fixed combination order. Message buffers of send/recv are host memory,
 * so copy must accept any direction. */
typedef struct dopt_sim_memops {
  void *ctx;
  void (*copy)(void *ctx, void *dst, const void *src, size_t bytes);
  /* out[k] = srcs[o0][off+k] op srcs[o1][off+k] op ..., o_j = (start+j) mod n;
   * as dopt__sim_reduce (sim/sim_internal.h) */
  void (*reduce)(void *ctx, dopt_dtype dt, dopt_redop op, void *out, const void *const *srcs, int n, int start,
                 size_t off, size_t count);
  void (*flip_bit)(void *ctx, void *buf, size_t count, dopt_dtype dt, uint64_t elem, uint32_t bit);
} dopt_sim_memops;

/* ---- world ------------------------------------------------------------------ */
typedef struct dopt_sim_config {
  uint32_t struct_size;
  uint32_t version;
  int nranks;                   /* >= 1 */
  uint32_t timeout_ms;          /* default timeout of every communicator, >= 1 */
  dopt_sim_mode mode;           /* reduction order */
  const dopt_sim_fault *faults; /* fault plan (copied), may be NULL */
  size_t nfaults;
  uint64_t seed;                /* resolves the "ANY" fields of the fault plan */
  /* appended (struct_size tells whether a caller has it): */
  const dopt_sim_memops *memops; /* NULL: host buffers */
  int copy_exchanges;            /* 1: dopt_sim_transport offers no all_to_allv_view, every exchange copies (as
                                    over a network); 0 (default): host-buffer worlds without faults offer it */
} dopt_sim_config;

#define DOPT_SIM_CONFIG_VERSION 1u
#define DOPT_SIM_CONFIG_INIT \
  {(uint32_t)sizeof(dopt_sim_config), DOPT_SIM_CONFIG_VERSION, 1, 10000u, DOPT_SIM_ORDER_RANK, NULL, 0, 0, NULL, 0}

DOPT_API dopt_status dopt_sim_world_create(const dopt_sim_config *cfg, dopt_sim_world **out);
/* Frees the world and every communicator split from it. Not while launched. */
DOPT_API void dopt_sim_world_destroy(dopt_sim_world *w);
DOPT_API int dopt_sim_world_size(const dopt_sim_world *w);
/* The world communicator handle of `rank` (owned by the world). */
DOPT_API dopt_status dopt_sim_world_comm(dopt_sim_world *w, int rank, dopt_sim_comm **out);
/* The i-th fault of the plan with its ANY fields resolved from the seed. */
DOPT_API dopt_status dopt_sim_world_fault(const dopt_sim_world *w, size_t i, dopt_sim_fault *out);

/* Rank body: runs on its own thread with the rank's world communicator. */
typedef dopt_status (*dopt_sim_rank_fn)(dopt_sim_comm *comm, int rank, void *user);

/* Runs fn on nranks threads and joins them; rank_status[r] (array of nranks)
 * receives each body's return value. A body returning an error poisons the
 * world so that peers fail fast instead of waiting for the timeout. Returns
 * DOPT_OK when every rank returned DOPT_OK, else the status of the lowest
 * failing rank (its message is kept: dopt_sim_world_rank_error). */
DOPT_API dopt_status dopt_sim_launch(dopt_sim_world *w, dopt_sim_rank_fn fn, void *user,
                                     dopt_status *rank_status);
/* dopt_last_error() of rank's thread when its body returned ("" if none). */
DOPT_API const char *dopt_sim_world_rank_error(const dopt_sim_world *w, int rank);

/* ---- communicators ---------------------------------------------------------- */
#define DOPT_SIM_SPLIT_NOCOLOR (-1)
#define DOPT_SIM_LABEL_MAX 16

/* Collective on the parent: ranks with the same color form a communicator,
 * ordered by key then parent rank. color == DOPT_SIM_SPLIT_NOCOLOR gives NULL.
 * The label ("tp", "dp", ...; all ranks must pass the same, at most 15 chars)
 * names the group in accounting and picks its link class in projections. */
DOPT_API dopt_status dopt_sim_comm_split_labeled(dopt_sim_comm *comm, int color, int key,
                                                 const char *label, dopt_sim_comm **newcomm);
/* Same with the label "split". */
DOPT_API dopt_status dopt_sim_comm_split(dopt_sim_comm *comm, int color, int key,
                                         dopt_sim_comm **newcomm);
DOPT_API dopt_status dopt_sim_comm_rank(const dopt_sim_comm *comm, int *rank);
DOPT_API dopt_status dopt_sim_comm_size(const dopt_sim_comm *comm, int *size);
DOPT_API dopt_status dopt_sim_comm_world_rank(const dopt_sim_comm *comm, int *world_rank);
DOPT_API const char *dopt_sim_comm_label(const dopt_sim_comm *comm);
/* This rank's timeout for calls on comm (split children inherit it). */
DOPT_API dopt_status dopt_sim_comm_set_timeout(dopt_sim_comm *comm, uint32_t timeout_ms);
/* Per-rank share of total_count on comm; DOPT_ERR_NOT_DIVISIBLE when the size
 * does not divide it (ZeRO-style flat-buffer sharding). */
DOPT_API dopt_status dopt_sim_comm_shard(const dopt_sim_comm *comm, size_t total_count,
                                         size_t *per_rank_count);
/* Poisons the world: every pending and later call returns DOPT_ERR_ABORTED. */
DOPT_API dopt_status dopt_sim_comm_abort(dopt_sim_comm *comm);
/* Releases this rank's handle (later calls on it: DOPT_ERR_STATE). Memory is
 * reclaimed by dopt_sim_world_destroy; accounting stays queryable. */
DOPT_API dopt_status dopt_sim_comm_destroy(dopt_sim_comm *comm);

/* ---- collectives -------------------------------------------------------------
 * NCCL semantics. count 0 is allowed (buffers may then be NULL).
 * In place: all_reduce/broadcast/reduce send == recv; reduce_scatter
 * recv == send + rank*recvcount; all_gather send == recv + rank*sendcount.
 * Any other overlap of send and receive ranges: DOPT_ERR_OVERLAP. all_to_all
 * is never in place. */
DOPT_API dopt_status dopt_sim_all_reduce(const void *send, void *recv, size_t count,
                                         dopt_dtype dt, dopt_redop op, dopt_sim_comm *comm);
/* send: recvcount*n elements; recv: recvcount (block `rank` of the reduction). */
DOPT_API dopt_status dopt_sim_reduce_scatter(const void *send, void *recv, size_t recvcount,
                                             dopt_dtype dt, dopt_redop op,
                                             dopt_sim_comm *comm);
/* send: sendcount elements; recv: sendcount*n, block r from rank r. */
DOPT_API dopt_status dopt_sim_all_gather(const void *send, void *recv, size_t sendcount,
                                         dopt_dtype dt, dopt_sim_comm *comm);
/* send is read on root only. */
DOPT_API dopt_status dopt_sim_broadcast(const void *send, void *recv, size_t count,
                                        dopt_dtype dt, int root, dopt_sim_comm *comm);
/* recv is written on root only. */
DOPT_API dopt_status dopt_sim_reduce(const void *send, void *recv, size_t count,
                                     dopt_dtype dt, dopt_redop op, int root,
                                     dopt_sim_comm *comm);
/* send and recv: count*n elements; block j of send goes to rank j, block j of
 * recv comes from rank j. */
DOPT_API dopt_status dopt_sim_all_to_all(const void *send, void *recv, size_t count,
                                         dopt_dtype dt, dopt_sim_comm *comm);
/* Personalised exchange (MPI_Alltoallv): to rank j this rank sends scounts[j]
 * elements from send + sdispls[j], and receives rcounts[j] elements from rank
 * j into recv + rdispls[j] (elements of dt; arrays of the group's size). Every
 * rank's rcounts[j] must equal rank j's scounts[for it] (else
 * DOPT_ERR_MISMATCH on every rank, naming the pair); never in place. */
DOPT_API dopt_status dopt_sim_all_to_allv(const void *send, const size_t *scounts, const size_t *sdispls,
                                          void *recv, const size_t *rcounts, const size_t *rdispls,
                                          dopt_dtype dt, dopt_sim_comm *comm);
/* all_to_allv by reference (the transport's all_to_allv_view): the same
 * arguments, checks, accounting and log entry as dopt_sim_all_to_allv, but
 * nothing is copied: views[j] (an array of the group's size) receives the
 * address of the rcounts[j] elements rank j sends this rank, inside rank j's
 * send buffer (NULL where rcounts[j] is 0). The ranks read the views and leave
 * their sent regions unchanged until they have all called dopt_sim_barrier on
 * the communicator (the transport's view_release). A rank calling the copying
 * all_to_allv against this one is a mismatch. Refused (DOPT_ERR_UNSUPPORTED) in
 * a world with a fault plan or memops (nothing would be delivered to flip, and
 * device buffers cannot be read in place). */
DOPT_API dopt_status dopt_sim_all_to_allv_view(const void *send, const size_t *scounts, const size_t *sdispls,
                                               const void **views, const size_t *rcounts, dopt_dtype dt,
                                               dopt_sim_comm *comm);
/* nb all_to_allv by reference in one call (the transport's all_to_allv_view_n): exchange b sent from
 * sends[b], its counts, displacements and views at [b·n, (b+1)·n) of scounts, sdispls, rcounts and views (n:
 * the group's size); the checks of dopt_sim_all_to_allv_view for each exchange, every rank the same nb (else
 * DOPT_ERR_MISMATCH), accounted and logged as one all_to_allv of all the elements; the same release rule. */
DOPT_API dopt_status dopt_sim_all_to_allv_view_n(int nb, const void *const *sends, const size_t *scounts,
                                                 const size_t *sdispls, const void **views, const size_t *rcounts,
                                                 dopt_dtype dt, dopt_sim_comm *comm);
/* nb all_gather by reference in one call (the transport's all_gather_view_n): gather b of counts[b] elements
 * from sends[b], views[b·n + j] rank j's sends[b] (NULL where counts[b] is 0); every rank the same nb and counts
 * (else DOPT_ERR_MISMATCH); accounted and logged as one all_gather of all the elements; the same release rule and
 * refusals as dopt_sim_all_gather_view. */
DOPT_API dopt_status dopt_sim_all_gather_view_n(int nb, const void *const *sends, const size_t *counts,
                                                const void **views, dopt_dtype dt, dopt_sim_comm *comm);
/* all_gather by reference (the transport's all_gather_view): the checks,
 * accounting and log entry of dopt_sim_all_gather, but nothing is copied:
 * views[j] (an array of the group's size) receives rank j's send (NULL where
 * sendcount is 0). The same release rule and refusals as
 * dopt_sim_all_to_allv_view; a rank calling the copying all_gather against
 * this one is a mismatch. */
DOPT_API dopt_status dopt_sim_all_gather_view(const void *send, const void **views, size_t sendcount, dopt_dtype dt,
                                              dopt_sim_comm *comm);
/* Point to point, matched by (peer, order). send is eager: it copies the data
 * and returns; recv blocks (bounded by the timeout). A count/dtype mismatch
 * is reported by recv (DOPT_ERR_MISMATCH). */
DOPT_API dopt_status dopt_sim_send(const void *send, size_t count, dopt_dtype dt, int peer,
                                   dopt_sim_comm *comm);
DOPT_API dopt_status dopt_sim_recv(void *recv, size_t count, dopt_dtype dt, int peer,
                                   dopt_sim_comm *comm);
DOPT_API dopt_status dopt_sim_barrier(dopt_sim_comm *comm);

/* This rank's communicator as a dopt_transport (for distributed/). The transport
 * borrows the communicator. */
DOPT_API dopt_status dopt_sim_transport(dopt_sim_comm *comm, dopt_transport *out);

DOPT_API const char *dopt_sim_op_name(dopt_redop op);
DOPT_API const char *dopt_sim_kind_name(dopt_sim_kind kind);

/* ---- accounting ---------------------------------------------------------------
 * bytes follow nccl-tests: all_reduce/broadcast/reduce count*size;
 * reduce_scatter and all_gather the full (n*count) buffer; all_to_all
 * n*count*size; send/recv count*size; all_to_allv the most bytes any one rank
 * sends to the others (its own block excluded; what its link carries). seconds: wall time of the calls as seen
 * by the communicator's rank 0. algbw = bytes/seconds, busbw = algbw*factor. */
typedef struct dopt_sim_stats {
  uint32_t struct_size;
  uint32_t version;
  int nranks;
  char label[DOPT_SIM_LABEL_MAX];
  uint64_t ops[DOPT_SIM_KIND_COUNT];
  uint64_t bytes[DOPT_SIM_KIND_COUNT];
  double seconds[DOPT_SIM_KIND_COUNT];
} dopt_sim_stats;
#define DOPT_SIM_STATS_INIT {(uint32_t)sizeof(dopt_sim_stats), 1u, 0, {0}, {0}, {0}, {0}}

DOPT_API dopt_status dopt_sim_comm_stats(const dopt_sim_comm *comm, dopt_sim_stats *out);
/* nccl-tests bus bandwidth factor: all_reduce 2(n-1)/n; reduce_scatter,
 * all_gather, all_to_all (n-1)/n; broadcast, reduce, send, recv, all_to_allv 1;
 * else 0. */
DOPT_API double dopt_sim_busbw_factor(dopt_sim_kind kind, int nranks);
/* algbw = bytes/seconds and busbw = algbw*factor, in bytes per second. */
DOPT_API dopt_status dopt_sim_bandwidth(dopt_sim_kind kind, int nranks, uint64_t bytes,
                                        double seconds, double *algbw, double *busbw);

/* One logged operation (every successful collective and send of the world, in
 * completion order; recv and split are not logged). */
typedef struct dopt_sim_record {
  dopt_sim_kind kind;
  uint64_t bytes; /* as in dopt_sim_stats */
  int nranks;     /* group size */
  char label[DOPT_SIM_LABEL_MAX];
  int comm_id;    /* distinct per communicator (world = 0) */
} dopt_sim_record;
DOPT_API size_t dopt_sim_world_record_count(const dopt_sim_world *w);
DOPT_API dopt_status dopt_sim_world_record(const dopt_sim_world *w, size_t i, dopt_sim_record *out);

/* ---- projection onto a target cluster (alpha-beta model) --------------------
 * For each logged operation on a communicator containing `rank` (sends: from or
 * to it), with n the group size (or the link's group_size when non-zero), B the
 * bytes above, alpha the link latency and beta its bandwidth:
 *   all_reduce (ring)              2(n-1)*alpha + 2(n-1)/n * B/beta
 *   reduce_scatter, all_gather,
 *   all_to_all                     (n-1)*alpha  + (n-1)/n * B/beta
 *   broadcast, reduce (pipelined),
 *   all_to_allv (busiest sender)   (n-1)*alpha  + B/beta
 *   send                           alpha + B/beta
 *   barrier                        2(n-1)*alpha
 * and 0 when n == 1. The link is the one whose label equals the
 * communicator's, else `fallback`. */
typedef struct dopt_sim_link {
  const char *label;     /* communicator label, e.g. "tp" */
  int group_size;        /* 0: as recorded */
  double bandwidth_Bps;  /* bytes per second, > 0 */
  double latency_s;      /* >= 0 */
} dopt_sim_link;

typedef struct dopt_sim_cluster {
  uint32_t struct_size;
  uint32_t version;
  const dopt_sim_link *links;
  size_t nlinks;
  dopt_sim_link fallback;
} dopt_sim_cluster;
#define DOPT_SIM_CLUSTER_INIT \
  {(uint32_t)sizeof(dopt_sim_cluster), 1u, NULL, 0, {NULL, 0, 1e9, 0.0}}

typedef struct dopt_sim_projection {
  uint32_t struct_size;
  uint32_t version;
  double total_s;
  double seconds[DOPT_SIM_KIND_COUNT];
  uint64_t ops[DOPT_SIM_KIND_COUNT];
} dopt_sim_projection;
#define DOPT_SIM_PROJECTION_INIT {(uint32_t)sizeof(dopt_sim_projection), 1u, 0.0, {0}, {0}}

DOPT_API double dopt_sim_cost(dopt_sim_kind kind, int nranks, uint64_t bytes,
                              const dopt_sim_link *link);
DOPT_API dopt_status dopt_sim_project(const dopt_sim_world *w, int rank,
                                      const dopt_sim_cluster *cluster,
                                      dopt_sim_projection *out);

#ifdef __cplusplus
}
#endif
#endif
