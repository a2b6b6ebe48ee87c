/* The MPI transport (distopt/mpi.h): communicators from MPI_COMM_WORLD and
 * MPI_Comm_split, and the dopt_transport collectives on host buffers
 * (reduce: MPI_Ireduce, or the rank-ordered exchange below through
 * MPI_Igather; all_to_allv: MPI_Ialltoallv).
 *
 * Order of floating-point sums. MPI leaves the order of a reduction to the
 * implementation (and OpenMPI picks it by message size and rank count), so
 * F32/F64 SUM/PROD/AVG and every BF16 reduction are an exchange instead:
 * every rank's contribution is gathered (MPI_Allgather; MPI_Alltoall of the
 * blocks for reduce_scatter) and reduced locally in rank order,
 * x0 + x1 + ... + x(n-1), AVG then divided once by n — the simulator's and
 * the reference's order, bitwise, at n times the traffic of a ring. I32/I64
 * ops and F32/F64 MAX/MIN are exact in any order and use MPI's reductions
 * (integer AVG: MPI_SUM, then one division by n here, as the simulator).
 * U8 SUM/PROD/AVG are exchanged too: OpenMPI 4.1's AVX reduction saturates
 * uint8 sums of 16 or more elements where the simulator wraps (measured:
 * 3 × 200 gives 88 at 8 elements, 255 at 16).
 *
 * Timeouts. Every MPI call is nonblocking and polled with MPI_Test until the
 * communicator's timeout. A collective cannot be cancelled, so on a timeout
 * its request and the scratch it uses are kept by the communicator, which
 * refuses every later call. Counts above the chunk (INT_MAX by default: MPI
 * counts are int) are split into several MPI calls, each with its own
 * timeout. */
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <mpi.h>

#include "distopt/device.h"
#include "distopt/mpi.h"
#include "internal.h"

struct dopt_mpi_comm {
  MPI_Comm comm;
  int rank, size;
  uint32_t timeout_ms;
  size_t chunk;        /* elements per MPI call, 1..INT_MAX */
  int broken;          /* a call timed out or failed: the communicator is unusable */
  MPI_Request stuck;   /* the request a timeout left pending (MPI_REQUEST_NULL: none) */
  void *stuck_buf[3];  /* the scratch that request may still use */
};

/* 1 when dopt_mpi_init called MPI_Init_thread (then dopt_mpi_finalize finalises) */
static int g_initialised_here;

/* The scratch buffers of one collective. Freed by the collective, unless a
 * timeout leaves a request pending on them: then the communicator keeps them. */
typedef struct scratch {
  void *p[3];
} scratch;

static void scratch_free(scratch *sc) {
  for (int i = 0; i < 3; i++) free(sc->p[i]);
}

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

static void nap(void) {
  struct timespec ts = {0, 20000}; /* 20 µs: leaves the core to the peers (mpirun --oversubscribe) */
  nanosleep(&ts, NULL);
}

static dopt_status mpi_fail(dopt_mpi_comm *c, int rc, const char *what) {
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, msg, &len) != MPI_SUCCESS) snprintf(msg, sizeof msg, "MPI error %d", rc);
  if (c) c->broken = 1; /* the state of the pending MPI operation is unknown */
  return dopt__fail(DOPT_ERR_BACKEND, "mpi %s: rank %d of %d: %s", what, c ? c->rank : -1, c ? c->size : -1, msg);
}

/* Polls req until it completes or the timeout passes (then the request and
 * sc's buffers go to the communicator, which becomes unusable). */
static dopt_status wait_req(dopt_mpi_comm *c, MPI_Request *req, scratch *sc, const char *what) {
  const double deadline = now_ms() + (double)c->timeout_ms;
  for (unsigned spin = 0;; spin++) {
    int done = 0;
    int rc = MPI_Test(req, &done, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS) return mpi_fail(c, rc, what);
    if (done) return DOPT_OK;
    if (now_ms() > deadline) {
      c->broken = 1;
      c->stuck = *req;
      for (int i = 0; i < 3; i++) {
        c->stuck_buf[i] = sc ? sc->p[i] : NULL;
        if (sc) sc->p[i] = NULL;
      }
      return dopt__fail(DOPT_ERR_TIMEOUT,
                        "mpi %s: rank %d of %d: the peers did not complete it within the timeout of %u ms "
                        "(communicator unusable)",
                        what, c->rank, c->size, c->timeout_ms);
    }
    if (spin >= 64) nap(); /* spin briefly first: most collectives complete in microseconds */
  }
}

/* The status of starting a nonblocking call, then its completion. */
static dopt_status started(dopt_mpi_comm *c, int rc, MPI_Request *req, scratch *sc, const char *what) {
  return rc == MPI_SUCCESS ? wait_req(c, req, sc, what) : mpi_fail(c, rc, what);
}

static dopt_status enter(dopt_mpi_comm *c, const char *what) {
  if (!c) return dopt__fail(DOPT_ERR_INVALID_ARG, "mpi %s: comm=NULL", what);
  int fin = 0;
  MPI_Finalized(&fin);
  if (fin) return dopt__fail(DOPT_ERR_STATE, "mpi %s: rank %d of %d: MPI is already finalised", what, c->rank, c->size);
  if (c->broken)
    return dopt__fail(DOPT_ERR_ABORTED, "mpi %s: rank %d of %d: the communicator is unusable after an earlier timeout "
                      "or MPI error", what, c->rank, c->size);
  return DOPT_OK;
}

static dopt_status new_comm(MPI_Comm mc, uint32_t timeout_ms, size_t chunk, dopt_mpi_comm **out) {
  dopt_mpi_comm *c = calloc(1, sizeof *c);
  if (!c) {
    MPI_Comm_free(&mc);
    return dopt__fail(DOPT_ERR_NO_MEMORY, "mpi: %zu bytes for a communicator", sizeof *c);
  }
  c->comm = mc;
  c->timeout_ms = timeout_ms;
  c->chunk = chunk;
  c->stuck = MPI_REQUEST_NULL;
  MPI_Comm_set_errhandler(mc, MPI_ERRORS_RETURN); /* errors come back as codes, never abort */
  MPI_Comm_rank(mc, &c->rank);
  MPI_Comm_size(mc, &c->size);
  *out = c;
  return DOPT_OK;
}

int dopt_mpi_available(void) { return 1; }

dopt_status dopt_mpi_init(uint32_t timeout_ms, dopt_mpi_comm **world) {
  DOPT_CHECK_ARG(world != NULL, "dopt_mpi_init: world=NULL");
  *world = NULL;
  DOPT_CHECK_ARG(timeout_ms >= 1, "dopt_mpi_init: timeout_ms=%u must be >= 1", timeout_ms);
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  if (fin) return dopt__fail(DOPT_ERR_STATE, "dopt_mpi_init: MPI was already finalised");
  if (!init) {
    int provided = 0;
    int rc = MPI_Init_thread(NULL, NULL, MPI_THREAD_SERIALIZED, &provided);
    if (rc != MPI_SUCCESS)
      return dopt__fail(DOPT_ERR_BACKEND, "dopt_mpi_init: MPI_Init_thread failed (MPI error %d)", rc);
    g_initialised_here = 1;
  }
  /* the duplicate, awaited with the timeout: a missing peer is an error, not a hang */
  dopt_mpi_comm probe = {.comm = MPI_COMM_WORLD, .timeout_ms = timeout_ms, .stuck = MPI_REQUEST_NULL};
  MPI_Comm_rank(MPI_COMM_WORLD, &probe.rank);
  MPI_Comm_size(MPI_COMM_WORLD, &probe.size);
  MPI_Comm dup = MPI_COMM_NULL;
  MPI_Request req;
  DOPT_TRY(started(&probe, MPI_Comm_idup(MPI_COMM_WORLD, &dup, &req), &req, NULL, "init (MPI_Comm_idup)"));
  return new_comm(dup, timeout_ms, INT_MAX, world);
}

dopt_status dopt_mpi_split(dopt_mpi_comm *comm, int color, int key, dopt_mpi_comm **out) {
  DOPT_CHECK_ARG(out != NULL, "dopt_mpi_split: out=NULL");
  *out = NULL;
  DOPT_TRY(enter(comm, "split"));
  /* MPI_Comm_split cannot time out: first make sure every rank has arrived */
  MPI_Request req;
  DOPT_TRY(started(comm, MPI_Ibarrier(comm->comm, &req), &req, NULL, "split (barrier)"));
  MPI_Comm nc = MPI_COMM_NULL;
  int rc = MPI_Comm_split(comm->comm, color < 0 ? MPI_UNDEFINED : color, key, &nc);
  if (rc != MPI_SUCCESS) return mpi_fail(comm, rc, "split");
  if (nc == MPI_COMM_NULL) return DOPT_OK;
  return new_comm(nc, comm->timeout_ms, comm->chunk, out);
}

dopt_status dopt_mpi_set_chunk(dopt_mpi_comm *comm, size_t elems) {
  DOPT_CHECK_ARG(comm != NULL, "dopt_mpi_set_chunk: comm=NULL");
  DOPT_CHECK_ARG(elems >= 1, "dopt_mpi_set_chunk: elems=0 must be >= 1");
  comm->chunk = elems > (size_t)INT_MAX ? (size_t)INT_MAX : elems;
  return DOPT_OK;
}

dopt_status dopt_mpi_abort(dopt_mpi_comm *comm) {
  (void)comm; /* the whole job: a peer in another communicator must stop too */
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  if (!init || fin) return dopt__fail(DOPT_ERR_STATE, "dopt_mpi_abort: MPI is not initialised");
  MPI_Abort(MPI_COMM_WORLD, 1);
  return dopt__fail(DOPT_ERR_BACKEND, "dopt_mpi_abort: MPI_Abort returned");
}

void dopt_mpi_destroy(dopt_mpi_comm *comm) {
  if (!comm) return;
  int fin = 0;
  MPI_Finalized(&fin);
  if (!fin) {
    if (comm->stuck != MPI_REQUEST_NULL) { /* a timed-out collective: its scratch only if it has completed since */
      int done = 0;
      if (MPI_Test(&comm->stuck, &done, MPI_STATUS_IGNORE) == MPI_SUCCESS && done)
        for (int i = 0; i < 3; i++) free(comm->stuck_buf[i]);
    }
    if (comm->comm != MPI_COMM_NULL) MPI_Comm_free(&comm->comm);
  }
  free(comm);
}

dopt_status dopt_mpi_finalize(void) {
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  if (!g_initialised_here || !init || fin) return DOPT_OK;
  int rc = MPI_Finalize();
  if (rc != MPI_SUCCESS)
    return dopt__fail(DOPT_ERR_BACKEND, "dopt_mpi_finalize: MPI_Finalize failed (MPI error %d)", rc);
  return DOPT_OK;
}

/* ---- the transport -------------------------------------------------------------------- */

/* BF16/F16 travel as raw 16-bit words: MPI never computes on them. */
static MPI_Datatype mpi_type(dopt_dtype dt) {
  switch (dt) {
  case DOPT_F32: return MPI_FLOAT;
  case DOPT_F64: return MPI_DOUBLE;
  case DOPT_BF16:
  case DOPT_F16: return MPI_UINT16_T;
  case DOPT_I32: return MPI_INT32_T;
  case DOPT_I64: return MPI_INT64_T;
  case DOPT_U8: return MPI_UINT8_T;
  case DOPT_I8: return MPI_INT8_T;
  default: return MPI_DATATYPE_NULL;
  }
}

static dopt_status check_dtype(const dopt_mpi_comm *c, dopt_dtype dt, const char *what) {
  if ((unsigned)dt >= DOPT_DTYPE_COUNT_)
    return dopt__fail(DOPT_ERR_UNSUPPORTED, "mpi %s: rank %d of %d: dtype %d", what, c->rank, c->size, (int)dt);
  return DOPT_OK;
}

/* How a reduction runs: *exchange = 1 for the rank-ordered exchange, else
 * MPI's reduction *mop (integer AVG: MPI_SUM, divided afterwards). */
static dopt_status plan_reduce(const dopt_mpi_comm *c, dopt_dtype dt, dopt_redop op, const char *what, int *exchange,
                               MPI_Op *mop) {
  DOPT_TRY(check_dtype(c, dt, what));
  if ((unsigned)op >= DOPT_REDOP_COUNT_)
    return dopt__fail(DOPT_ERR_UNSUPPORTED, "mpi %s: rank %d of %d: reduction op %d", what, c->rank, c->size, (int)op);
  switch (op) {
  case DOPT_PROD: *mop = MPI_PROD; break;
  case DOPT_MAX: *mop = MPI_MAX; break;
  case DOPT_MIN: *mop = MPI_MIN; break;
  default: *mop = MPI_SUM; break; /* SUM, AVG */
  }
  switch (dt) {
  case DOPT_F32:
  case DOPT_F64: *exchange = op == DOPT_SUM || op == DOPT_PROD || op == DOPT_AVG; return DOPT_OK;
  case DOPT_BF16: *exchange = 1; return DOPT_OK; /* MPI has no bf16 arithmetic */
  case DOPT_U8: /* OpenMPI 4.1's AVX reduction saturates uint8 sums of 16+ elements instead of wrapping */
    *exchange = op == DOPT_SUM || op == DOPT_PROD || op == DOPT_AVG;
    return DOPT_OK;
  case DOPT_I32:
  case DOPT_I64: *exchange = 0; return DOPT_OK;
  default:
    return dopt__fail(DOPT_ERR_UNSUPPORTED, "mpi %s: rank %d of %d: %s reductions (F32, F64, BF16, I32, I64, U8)", what,
                      c->rank, c->size, dopt_dtype_name(dt));
  }
}

/* out[k] = rows[0][k] op rows[1][k] op ... op rows[n-1][k] (rank order), rows
 * n rows of m elements; AVG divides once by n. The simulator's arithmetic:
 * BF16 accumulates in fp32 and rounds once. */
#define ROWS_LOOP(T, A, LD, ST, COMBINE)                                         \
  for (size_t k = 0; k < m; k++) {                                               \
    A acc = LD(((const T *)rows)[k]);                                            \
    for (int j = 1; j < n; j++) {                                                \
      A v = LD(((const T *)rows)[(size_t)j * m + k]);                            \
      acc = COMBINE(acc, v);                                                     \
    }                                                                            \
    if (op == DOPT_AVG) acc = acc / (A)n;                                        \
    ((T *)out)[k] = ST(acc);                                                     \
  }
#define C_ADD(a, b) ((a) + (b))
#define C_MUL(a, b) ((a) * (b))
#define C_MAX(a, b) ((b) > (a) ? (b) : (a))
#define C_MIN(a, b) ((b) < (a) ? (b) : (a))
#define ID(x) (x)
#define ROWS_ANY_OP(T, A, LD, ST)                                                \
  switch (op) {                                                                  \
  case DOPT_PROD: ROWS_LOOP(T, A, LD, ST, C_MUL) break;                          \
  case DOPT_MAX: ROWS_LOOP(T, A, LD, ST, C_MAX) break;                           \
  case DOPT_MIN: ROWS_LOOP(T, A, LD, ST, C_MIN) break;                           \
  default: ROWS_LOOP(T, A, LD, ST, C_ADD) break;                                 \
  }

/* U8 wraps after every operation (the simulator's uint8 arithmetic) */
static void reduce_rows_u8(dopt_redop op, uint8_t *out, const uint8_t *rows, int n, size_t m) {
  for (size_t k = 0; k < m; k++) {
    unsigned acc = rows[k];
    for (int j = 1; j < n; j++) {
      unsigned v = rows[(size_t)j * m + k];
      switch (op) {
      case DOPT_PROD: acc = (acc * v) & 0xffu; break;
      case DOPT_MAX: acc = v > acc ? v : acc; break;
      case DOPT_MIN: acc = v < acc ? v : acc; break;
      default: acc = (acc + v) & 0xffu; break;
      }
    }
    out[k] = (uint8_t)(op == DOPT_AVG ? acc / (unsigned)n : acc);
  }
}

static void reduce_rows(dopt_dtype dt, dopt_redop op, void *out, const void *rows, int n, size_t m) {
  switch (dt) {
  case DOPT_U8: reduce_rows_u8(op, out, rows, n, m); break;
  case DOPT_F32: ROWS_ANY_OP(float, float, ID, ID) break;
  case DOPT_F64: ROWS_ANY_OP(double, double, ID, ID) break;
  default: ROWS_ANY_OP(uint16_t, float, dopt_bf16_to_f32, dopt_f32_to_bf16) break; /* BF16 */
  }
}

/* Integer AVG: MPI summed (wrapping), one division by n here (the simulator's). */
static void int_average(dopt_dtype dt, void *buf, size_t count, int n) {
  for (size_t k = 0; k < count; k++) {
    if (dt == DOPT_I32) ((int32_t *)buf)[k] = (int32_t)(((int32_t *)buf)[k] / (int32_t)n);
    else if (dt == DOPT_I64) ((int64_t *)buf)[k] = ((int64_t *)buf)[k] / (int64_t)n;
    else ((uint8_t *)buf)[k] = (uint8_t)((unsigned)((uint8_t *)buf)[k] / (unsigned)n);
  }
}

static int overlap(const void *a, size_t na, const void *b, size_t nb) {
  uintptr_t x = (uintptr_t)a, y = (uintptr_t)b;
  return na && nb && x < y + nb && y < x + na;
}

/* sc->p[i] = rows·elems·esz bytes, checked for overflow. */
static dopt_status scratch_alloc(const dopt_mpi_comm *c, scratch *sc, int i, size_t rows, size_t elems, size_t esz,
                                 const char *what) {
  if (elems != 0 && (rows > SIZE_MAX / elems || rows * elems > SIZE_MAX / esz))
    return dopt__fail(DOPT_ERR_NO_MEMORY, "mpi %s: rank %d of %d: %zu x %zu elements overflow", what, c->rank, c->size,
                      rows, elems);
  const size_t bytes = rows * elems * esz;
  sc->p[i] = malloc(bytes != 0 ? bytes : 1);
  if (!sc->p[i])
    return dopt__fail(DOPT_ERR_NO_MEMORY, "mpi %s: rank %d of %d: scratch of %zu bytes", what, c->rank, c->size, bytes);
  return DOPT_OK;
}

/* total·esz bytes without overflow */
static dopt_status byte_count(const dopt_mpi_comm *c, size_t count, size_t esz, size_t mult, const char *what,
                              size_t *bytes) {
  if (count > SIZE_MAX / esz / mult)
    return dopt__fail(DOPT_ERR_INVALID_ARG, "mpi %s: rank %d of %d: count %zu overflows", what, c->rank, c->size,
                      count);
  *bytes = count * esz * mult;
  return DOPT_OK;
}

static size_t min_sz(size_t a, size_t b) { return a < b ? a : b; }

static dopt_status t_all_reduce(void *comm, const void *send, void *recv, size_t count, dopt_dtype dt, dopt_redop op) {
  static const char what[] = "all_reduce";
  dopt_mpi_comm *c = comm;
  DOPT_TRY(enter(c, what));
  int ex = 0;
  MPI_Op mop = MPI_SUM;
  DOPT_TRY(plan_reduce(c, dt, op, what, &ex, &mop));
  if (count == 0) return DOPT_OK;
  DOPT_CHECK_ARG(send && recv, "mpi all_reduce: rank %d: NULL buffer", c->rank);
  const size_t esz = dopt_dtype_size(dt), m0 = min_sz(c->chunk, count);
  size_t bytes = 0;
  DOPT_TRY(byte_count(c, count, esz, 1, what, &bytes));
  const MPI_Datatype t = mpi_type(dt);
  scratch sc = {{NULL, NULL, NULL}};
  const char *src = send;
  dopt_status st = DOPT_OK;
  if (src != recv && overlap(send, bytes, recv, bytes)) { /* partly overlapping: reduce a copy */
    st = scratch_alloc(c, &sc, 0, 1, count, esz, what);
    if (st == DOPT_OK) src = memcpy(sc.p[0], send, bytes);
  }
  if (st == DOPT_OK && ex) st = scratch_alloc(c, &sc, 1, (size_t)c->size, m0, esz, what); /* every rank's chunk */
  for (size_t off = 0, m; st == DOPT_OK && off < count; off += m) {
    m = min_sz(m0, count - off);
    char *dst = (char *)recv + off * esz;
    MPI_Request req;
    if (ex) {
      st = started(c, MPI_Iallgather(src + off * esz, (int)m, t, sc.p[1], (int)m, t, c->comm, &req), &req, &sc,
                   "all_reduce (exchange)");
      if (st == DOPT_OK) reduce_rows(dt, op, dst, sc.p[1], c->size, m);
    } else {
      const void *in = src == (const char *)recv ? MPI_IN_PLACE : (const void *)(src + off * esz);
      st = started(c, MPI_Iallreduce(in, dst, (int)m, t, mop, c->comm, &req), &req, &sc, what);
    }
  }
  if (st == DOPT_OK && !ex && op == DOPT_AVG) int_average(dt, recv, count, c->size);
  scratch_free(&sc);
  return st;
}

static dopt_status t_reduce_scatter(void *comm, const void *send, void *recv, size_t recvcount, dopt_dtype dt,
                                    dopt_redop op) {
  static const char what[] = "reduce_scatter";
  dopt_mpi_comm *c = comm;
  DOPT_TRY(enter(c, what));
  int ex = 0;
  MPI_Op mop = MPI_SUM;
  DOPT_TRY(plan_reduce(c, dt, op, what, &ex, &mop));
  if (recvcount == 0) return DOPT_OK;
  DOPT_CHECK_ARG(send && recv, "mpi reduce_scatter: rank %d: NULL buffer", c->rank);
  const size_t esz = dopt_dtype_size(dt), n = (size_t)c->size, m0 = min_sz(c->chunk, recvcount);
  size_t blk = 0, total = 0;
  DOPT_TRY(byte_count(c, recvcount, esz, 1, what, &blk));
  DOPT_TRY(byte_count(c, recvcount, esz, n, what, &total));
  const MPI_Datatype t = mpi_type(dt);
  scratch sc = {{NULL, NULL, NULL}};
  const char *src = send;
  dopt_status st = DOPT_OK;
  /* in place (distributed/dp_sum.c): recv is this rank's block of send */
  const int inplace = (const char *)recv == src + (size_t)c->rank * blk;
  if (!inplace && overlap(send, total, recv, blk)) { /* any other overlap: work on a copy of send */
    st = scratch_alloc(c, &sc, 0, n, recvcount, esz, what);
    if (st == DOPT_OK) src = memcpy(sc.p[0], send, total);
  }
  /* chunked: block j's chunk is strided in send; packed contiguously (p[1]) */
  const int chunked = m0 < recvcount;
  if (st == DOPT_OK && chunked) st = scratch_alloc(c, &sc, 1, n, m0, esz, what);
  /* p[2]: the exchange's rows, or the native result when it must not land in send yet */
  if (st == DOPT_OK && (ex || inplace)) st = scratch_alloc(c, &sc, 2, ex ? n : 1, m0, esz, what);
  for (size_t off = 0, m; st == DOPT_OK && off < recvcount; off += m) {
    m = min_sz(m0, recvcount - off);
    const void *in = src;
    if (chunked) {
      for (size_t j = 0; j < n; j++)
        memcpy((char *)sc.p[1] + j * m * esz, src + j * blk + off * esz, m * esz);
      in = sc.p[1];
    }
    char *dst = (char *)recv + off * esz;
    MPI_Request req;
    if (ex) { /* row j of p[2] = rank j's contribution to this rank's block */
      st = started(c, MPI_Ialltoall(in, (int)m, t, sc.p[2], (int)m, t, c->comm, &req), &req, &sc,
                   "reduce_scatter (exchange)");
      if (st == DOPT_OK) reduce_rows(dt, op, dst, sc.p[2], c->size, m);
    } else {
      void *out = inplace ? sc.p[2] : dst;
      st = started(c, MPI_Ireduce_scatter_block(in, out, (int)m, t, mop, c->comm, &req), &req, &sc, what);
      if (st == DOPT_OK && inplace) memcpy(dst, out, m * esz);
    }
  }
  if (st == DOPT_OK && !ex && op == DOPT_AVG) int_average(dt, recv, recvcount, c->size);
  scratch_free(&sc);
  return st;
}

static dopt_status t_all_gather(void *comm, const void *send, void *recv, size_t sendcount, dopt_dtype dt) {
  static const char what[] = "all_gather";
  dopt_mpi_comm *c = comm;
  DOPT_TRY(enter(c, what));
  DOPT_TRY(check_dtype(c, dt, what));
  if (sendcount == 0) return DOPT_OK;
  DOPT_CHECK_ARG(send && recv, "mpi all_gather: rank %d: NULL buffer", c->rank);
  const size_t esz = dopt_dtype_size(dt), n = (size_t)c->size, m0 = min_sz(c->chunk, sendcount);
  size_t blk = 0, total = 0;
  DOPT_TRY(byte_count(c, sendcount, esz, 1, what, &blk));
  DOPT_TRY(byte_count(c, sendcount, esz, n, what, &total));
  const MPI_Datatype t = mpi_type(dt);
  scratch sc = {{NULL, NULL, NULL}};
  const char *src = send;
  dopt_status st = DOPT_OK;
  const int inplace = src == (const char *)recv + (size_t)c->rank * blk; /* own block already in place */
  if (!inplace && overlap(send, blk, recv, total)) {
    st = scratch_alloc(c, &sc, 0, 1, sendcount, esz, what);
    if (st == DOPT_OK) src = memcpy(sc.p[0], send, blk);
  }
  for (size_t off = 0, m; st == DOPT_OK && off < sendcount; off += m) {
    m = min_sz(m0, sendcount - off);
    /* one chunk of every rank's block: m elements, then a stride of the whole block */
    MPI_Datatype rt = t, ct = MPI_DATATYPE_NULL;
    int rcount = (int)m, rc = MPI_SUCCESS;
    if (m < sendcount) {
      rc = MPI_Type_contiguous((int)m, t, &ct);
      if (rc == MPI_SUCCESS) rc = MPI_Type_create_resized(ct, 0, (MPI_Aint)blk, &rt);
      if (rc == MPI_SUCCESS) rc = MPI_Type_commit(&rt);
      rcount = 1;
    }
    MPI_Request req;
    const void *in = inplace ? MPI_IN_PLACE : (const void *)(src + off * esz);
    if (rc == MPI_SUCCESS) rc = MPI_Iallgather(in, (int)m, t, (char *)recv + off * esz, rcount, rt, c->comm, &req);
    st = started(c, rc, &req, &sc, what);
    if (ct != MPI_DATATYPE_NULL) { /* a pending operation keeps its types alive */
      MPI_Type_free(&ct);
      if (rt != t && rt != MPI_DATATYPE_NULL) MPI_Type_free(&rt);
    }
  }
  scratch_free(&sc);
  return st;
}

static dopt_status t_broadcast(void *comm, const void *send, void *recv, size_t count, dopt_dtype dt, int root) {
  static const char what[] = "broadcast";
  dopt_mpi_comm *c = comm;
  DOPT_TRY(enter(c, what));
  DOPT_TRY(check_dtype(c, dt, what));
  DOPT_CHECK_ARG(root >= 0 && root < c->size, "mpi broadcast: root=%d of %d", root, c->size);
  if (count == 0) return DOPT_OK;
  DOPT_CHECK_ARG(recv && (c->rank != root || send), "mpi broadcast: rank %d: NULL buffer", c->rank);
  const size_t esz = dopt_dtype_size(dt), m0 = min_sz(c->chunk, count);
  size_t bytes = 0;
  DOPT_TRY(byte_count(c, count, esz, 1, what, &bytes));
  if (c->rank == root && send != recv) memmove(recv, send, bytes); /* the root broadcasts from recv */
  dopt_status st = DOPT_OK;
  for (size_t off = 0, m; st == DOPT_OK && off < count; off += m) {
    m = min_sz(m0, count - off);
    MPI_Request req;
    st = started(c, MPI_Ibcast((char *)recv + off * esz, (int)m, mpi_type(dt), root, c->comm, &req), &req, NULL, what);
  }
  return st;
}

static dopt_status t_reduce(void *comm, const void *send, void *recv, size_t count, dopt_dtype dt, dopt_redop op,
                            int root) {
  static const char what[] = "reduce";
  dopt_mpi_comm *c = comm;
  DOPT_TRY(enter(c, what));
  int ex = 0;
  MPI_Op mop = MPI_SUM;
  DOPT_TRY(plan_reduce(c, dt, op, what, &ex, &mop));
  DOPT_CHECK_ARG(root >= 0 && root < c->size, "mpi reduce: root=%d of %d", root, c->size);
  if (count == 0) return DOPT_OK;
  const int is_root = c->rank == root;
  DOPT_CHECK_ARG(send && (!is_root || recv), "mpi reduce: rank %d: NULL buffer", c->rank);
  const size_t esz = dopt_dtype_size(dt), m0 = min_sz(c->chunk, count);
  size_t bytes = 0;
  DOPT_TRY(byte_count(c, count, esz, 1, what, &bytes));
  const MPI_Datatype t = mpi_type(dt);
  scratch sc = {{NULL, NULL, NULL}};
  const char *src = send;
  dopt_status st = DOPT_OK;
  if (is_root && src != recv && overlap(send, bytes, recv, bytes)) { /* partly overlapping: reduce a copy */
    st = scratch_alloc(c, &sc, 0, 1, count, esz, what);
    if (st == DOPT_OK) src = memcpy(sc.p[0], send, bytes);
  }
  /* the exchange: every rank's chunk gathered on the root, reduced there in rank order */
  if (st == DOPT_OK && ex && is_root) st = scratch_alloc(c, &sc, 1, (size_t)c->size, m0, esz, what);
  for (size_t off = 0, m; st == DOPT_OK && off < count; off += m) {
    m = min_sz(m0, count - off);
    char *dst = is_root ? (char *)recv + off * esz : NULL;
    MPI_Request req;
    if (ex) {
      st = started(c, MPI_Igather(src + off * esz, (int)m, t, sc.p[1], (int)m, t, root, c->comm, &req), &req, &sc,
                   "reduce (exchange)");
      if (st == DOPT_OK && is_root) reduce_rows(dt, op, dst, sc.p[1], c->size, m);
    } else {
      const void *in = is_root && src == (const char *)recv ? MPI_IN_PLACE : (const void *)(src + off * esz);
      st = started(c, MPI_Ireduce(in, dst, (int)m, t, mop, root, c->comm, &req), &req, &sc, what);
    }
  }
  if (st == DOPT_OK && !ex && op == DOPT_AVG && is_root) int_average(dt, recv, count, c->size);
  scratch_free(&sc);
  return st;
}

/* MPI_Ialltoallv: MPI counts and displacements are int, so every count and
 * every end of a region must stay within INT_MAX elements (else
 * DOPT_ERR_UNSUPPORTED, naming the peer and the value). */
static dopt_status t_all_to_allv(void *comm, const void *send, const size_t *scounts, const size_t *sdispls, void *recv,
                                 const size_t *rcounts, const size_t *rdispls, dopt_dtype dt) {
  static const char what[] = "all_to_allv";
  dopt_mpi_comm *c = comm;
  DOPT_TRY(enter(c, what));
  DOPT_TRY(check_dtype(c, dt, what));
  DOPT_CHECK_ARG(scounts && sdispls && rcounts && rdispls, "mpi all_to_allv: rank %d: NULL count array", c->rank);
  const size_t n = (size_t)c->size;
  for (size_t j = 0; j < n; j++) {
    const size_t v[4] = {scounts[j], sdispls[j], rcounts[j], rdispls[j]};
    for (int k = 0; k < 4; k++)
      if (v[k] > (size_t)INT_MAX || (k % 2 == 1 && v[k - 1] > (size_t)INT_MAX - v[k]))
        return dopt__fail(DOPT_ERR_UNSUPPORTED, "mpi all_to_allv: rank %d: peer %zu: %s %zu above INT_MAX elements",
                          c->rank, j, k < 2 ? "send region" : "receive region", v[k]);
  }
  scratch sc = {{NULL, NULL, NULL}};
  DOPT_TRY(scratch_alloc(c, &sc, 0, 4, n, sizeof(int), what)); /* kept with the request on a timeout */
  int *a = sc.p[0];
  for (size_t j = 0; j < n; j++) {
    a[j] = (int)scounts[j];
    a[n + j] = (int)sdispls[j];
    a[2 * n + j] = (int)rcounts[j];
    a[3 * n + j] = (int)rdispls[j];
  }
  const MPI_Datatype t = mpi_type(dt);
  MPI_Request req;
  dopt_status st = started(c, MPI_Ialltoallv(send, a, a + n, t, recv, a + 2 * n, a + 3 * n, t, c->comm, &req), &req,
                           &sc, what);
  scratch_free(&sc);
  return st;
}

static const dopt_transport_ops mpi_ops = {t_all_reduce, t_reduce_scatter, t_all_gather, t_broadcast, t_reduce,
                                           t_all_to_allv, NULL, NULL, NULL, NULL, NULL}; /* no shared address space: no views */

dopt_status dopt_mpi_transport(dopt_mpi_comm *comm, dopt_transport *out) {
  DOPT_CHECK_ARG(comm && out, "dopt_mpi_transport: NULL argument");
  out->ops = &mpi_ops;
  out->comm = comm;
  out->rank = comm->rank;
  out->size = comm->size;
  return DOPT_OK;
}
