/* The NCCL transport (distopt/cuda.h): communicators from a unique id or the
 * launcher's environment, ncclCommSplit, and the dopt_transport collectives
 * on device buffers (reduce: ncclReduce; all_to_allv: grouped
 * ncclSend/ncclRecv). Communicators are non-blocking: every call
 * is followed by polling ncclCommGetAsyncError and the stream until a
 * deadline, and a timeout aborts the communicator (ncclCommAbort) instead of
 * hanging.
 *
 * Order of floating-point sums. NCCL's ring/tree order is not rank order, so
 * floating-point SUM/AVG/PROD are done by default as an exchange (all-gather,
 * or grouped send/recv for reduce-scatter) followed by a reduction kernel in
 * rank order 0..n-1: bitwise the simulator's and the reference's order, at
 * n times the traffic of a native reduction. dopt_nccl_set_native_float_sums
 * switches to NCCL's own reductions. MAX/MIN and integer ops are exact in any
 * order and always native (I64 SUM, F64 MAX: the optimizer statistics; I32
 * MAX and I64 SUM: the exact data-parallel gradient sum, distopt/dpsum.h).
 * The distributed optimizers issue a float SUM only with the fp32 dp sum
 * (dopt_dist_config.dp_sum_words = 0); by default no gradient is exchanged
 * whole: it travels as integer words through NCCL's own reduce-scatter or
 * all-reduce, whatever algorithm and channel count NCCL picks. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "distopt/cuda.h"
#include "distopt/launch.h"
#include "internal.h"

#define ST cudaStreamPerThread

struct dopt_nccl_comm {
  ncclComm_t comm;
  int rank, size, device;
  uint32_t timeout_ms;
  int aborted;
  int native_float; /* 1: NCCL's own float reductions (not rank order) */
};

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

static void nap(void) {
  struct timespec ts = {0, 20000}; /* 20 µs */
  nanosleep(&ts, NULL);
}

static dopt_status nccl_fail(dopt_nccl_comm *c, ncclResult_t r, const char *what) {
  const char *detail = c && c->comm ? ncclGetLastError(c->comm) : ncclGetLastError(NULL);
  return dopt__fail(DOPT_ERR_BACKEND, "nccl rank %d: %s: %s%s%s", c ? c->rank : -1, what, ncclGetErrorString(r),
                    detail && *detail ? ": " : "", detail ? detail : "");
}

static dopt_status do_abort(dopt_nccl_comm *c) {
  if (!c->aborted && c->comm) ncclCommAbort(c->comm);
  c->aborted = 1;
  c->comm = NULL;
  return DOPT_OK;
}

/* Polls comm's async state until the last call is enqueued (not
 * ncclInProgress), then the stream (if stream) until done; errors and the
 * deadline abort the communicator. */
static dopt_status wait_comm(dopt_nccl_comm *c, ncclResult_t r, int stream, const char *what) {
  if (r != ncclSuccess && r != ncclInProgress) {
    dopt_status s = nccl_fail(c, r, what);
    do_abort(c);
    return s;
  }
  double deadline = now_ms() + (double)c->timeout_ms;
  for (;;) {
    ncclResult_t ae = ncclSuccess;
    ncclResult_t q = ncclCommGetAsyncError(c->comm, &ae);
    if (q != ncclSuccess) ae = q;
    if (ae != ncclSuccess && ae != ncclInProgress) {
      dopt_status s = nccl_fail(c, ae, what);
      do_abort(c);
      return s;
    }
    if (ae == ncclSuccess) {
      if (!stream) return DOPT_OK;
      cudaError_t e = cudaStreamQuery(ST);
      if (e == cudaSuccess) return DOPT_OK;
      if (e != cudaErrorNotReady) {
        do_abort(c);
        return dopt__fail(DOPT_ERR_BACKEND, "nccl rank %d: %s: %s", c->rank, what, cudaGetErrorString(e));
      }
    }
    if (now_ms() > deadline) {
      do_abort(c);
      return dopt__fail(DOPT_ERR_TIMEOUT, "nccl rank %d of %d: %s did not complete within %u ms (communicator aborted)",
                        c->rank, c->size, what, c->timeout_ms);
    }
    nap();
  }
}

static dopt_status enter(dopt_nccl_comm *c, const char *what) {
  if (!c) return dopt__fail(DOPT_ERR_INVALID_ARG, "nccl %s: comm=NULL", what);
  if (c->aborted) return dopt__fail(DOPT_ERR_ABORTED, "nccl rank %d: %s on an aborted communicator", c->rank, what);
  cudaError_t e = cudaSetDevice(c->device);
  if (e != cudaSuccess) return dopt__fail(DOPT_ERR_BACKEND, "nccl %s: cudaSetDevice(%d): %s", what, c->device,
                                          cudaGetErrorString(e));
  return DOPT_OK;
}

dopt_status dopt_nccl_unique_id(unsigned char id[DOPT_NCCL_ID_BYTES]) {
  DOPT_CHECK_ARG(id != NULL, "dopt_nccl_unique_id: id=NULL");
  ncclUniqueId u;
  ncclResult_t r = ncclGetUniqueId(&u);
  if (r != ncclSuccess) return nccl_fail(NULL, r, "ncclGetUniqueId");
  memcpy(id, &u, DOPT_NCCL_ID_BYTES);
  return DOPT_OK;
}

static ncclConfig_t nonblocking(void) {
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;
  return cfg;
}

dopt_status dopt_nccl_init(const unsigned char id[DOPT_NCCL_ID_BYTES], int nranks, int rank, int device,
                           uint32_t timeout_ms, dopt_nccl_comm **out) {
  DOPT_CHECK_ARG(id && out, "dopt_nccl_init: NULL argument");
  *out = NULL;
  DOPT_CHECK_ARG(nranks >= 1 && rank >= 0 && rank < nranks, "dopt_nccl_init: rank %d of %d", rank, nranks);
  DOPT_CHECK_ARG(timeout_ms >= 1, "dopt_nccl_init: timeout_ms=%u must be >= 1", timeout_ms);
  const char *why = "";
  int ndev = dopt_cuda_device_count(&why);
  if (ndev == 0) return dopt__fail(DOPT_ERR_UNSUPPORTED, "dopt_nccl_init: no CUDA device (%s)", why);
  DOPT_CHECK_ARG(device >= 0 && device < ndev, "dopt_nccl_init: device=%d out of range [0, %d)", device, ndev);
  dopt_nccl_comm *c = calloc(1, sizeof *c);
  if (!c) return dopt__fail(DOPT_ERR_NO_MEMORY, "dopt_nccl_init");
  c->rank = rank;
  c->size = nranks;
  c->device = device;
  c->timeout_ms = timeout_ms;
  dopt_status s = enter(c, "init");
  if (s == DOPT_OK) {
    ncclUniqueId u;
    memcpy(&u, id, DOPT_NCCL_ID_BYTES);
    ncclConfig_t cfg = nonblocking();
    ncclResult_t r = ncclCommInitRankConfig(&c->comm, nranks, u, rank, &cfg);
    if (r != ncclSuccess && r != ncclInProgress) s = nccl_fail(c, r, "ncclCommInitRankConfig");
    else s = wait_comm(c, r, 0, "ncclCommInitRankConfig");
  }
  if (s != DOPT_OK) {
    do_abort(c);
    free(c);
    return s;
  }
  *out = c;
  return DOPT_OK;
}

dopt_status dopt_nccl_init_env(uint32_t timeout_ms, dopt_nccl_comm **out) {
  DOPT_CHECK_ARG(out != NULL, "dopt_nccl_init_env: out=NULL");
  *out = NULL;
  dopt_launch_env env;
  DOPT_TRY(dopt_launch_env_parse(NULL, NULL, &env));
  if (env.world_size > 1 && (!env.master_addr[0] || env.rdzv_port == 0))
    return dopt__fail(DOPT_ERR_INVALID_ARG,
                      "dopt_nccl_init_env (%s, %d ranks): MASTER_ADDR and MASTER_PORT (or DOPT_RDZV_PORT) must be set",
                      env.launcher, env.world_size);
  const char *why = "";
  int ndev = dopt_cuda_device_count(&why);
  if (ndev == 0) return dopt__fail(DOPT_ERR_UNSUPPORTED, "dopt_nccl_init_env: no CUDA device (%s)", why);
  unsigned char id[DOPT_NCCL_ID_BYTES] = {0};
  if (env.rank == 0) DOPT_TRY(dopt_nccl_unique_id(id));
  if (env.world_size > 1) /* MASTER_PORT + 1: torchrun's store holds MASTER_PORT */
    DOPT_TRY(dopt_rendezvous_blob(env.master_addr, env.rdzv_port, env.rank, env.world_size, id, sizeof id, timeout_ms));
  return dopt_nccl_init(id, env.world_size, env.rank, dopt_launch_device(env.local_rank, ndev), timeout_ms, out);
}

dopt_status dopt_nccl_split(dopt_nccl_comm *comm, int color, int key, dopt_nccl_comm **out) {
  DOPT_CHECK_ARG(out != NULL, "dopt_nccl_split: out=NULL");
  *out = NULL;
  DOPT_TRY(enter(comm, "split"));
  dopt_nccl_comm *c = calloc(1, sizeof *c);
  if (!c) return dopt__fail(DOPT_ERR_NO_MEMORY, "dopt_nccl_split");
  ncclConfig_t cfg = nonblocking();
  ncclResult_t r = ncclCommSplit(comm->comm, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &c->comm, &cfg);
  dopt_status s = wait_comm(comm, r, 0, "ncclCommSplit");
  if (s == DOPT_OK && c->comm) {
    c->device = comm->device;
    c->timeout_ms = comm->timeout_ms;
    c->native_float = comm->native_float;
    c->rank = -1;
    s = wait_comm(c, ncclInProgress, 0, "ncclCommSplit (new communicator)");
    if (s == DOPT_OK && (r = ncclCommUserRank(c->comm, &c->rank)) != ncclSuccess) s = nccl_fail(c, r, "ncclCommUserRank");
    if (s == DOPT_OK && (r = ncclCommCount(c->comm, &c->size)) != ncclSuccess) s = nccl_fail(c, r, "ncclCommCount");
  }
  if (s != DOPT_OK || !c->comm) {
    if (c->comm) do_abort(c);
    free(c);
    return s;
  }
  *out = c;
  return DOPT_OK;
}

dopt_status dopt_nccl_abort(dopt_nccl_comm *comm) {
  DOPT_CHECK_ARG(comm != NULL, "dopt_nccl_abort: comm=NULL");
  return do_abort(comm);
}

void dopt_nccl_destroy(dopt_nccl_comm *comm) {
  if (!comm) return;
  if (!comm->aborted && comm->comm) {
    cudaSetDevice(comm->device);
    ncclResult_t ae = ncclCommFinalize(comm->comm);
    double deadline = now_ms() + (double)comm->timeout_ms;
    while (ae == ncclInProgress && now_ms() < deadline) {
      nap();
      if (ncclCommGetAsyncError(comm->comm, &ae) != ncclSuccess) break;
    }
    if (ae == ncclSuccess) ncclCommDestroy(comm->comm);
    else ncclCommAbort(comm->comm);
  }
  free(comm);
}

dopt_status dopt_nccl_set_native_float_sums(dopt_nccl_comm *comm, int on) {
  DOPT_CHECK_ARG(comm != NULL, "dopt_nccl_set_native_float_sums: comm=NULL");
  comm->native_float = on != 0;
  return DOPT_OK;
}

/* ---- the transport -------------------------------------------------------------------- */

static dopt_status nccl_type(dopt_dtype dt, ncclDataType_t *t) {
  switch (dt) {
  case DOPT_F32: *t = ncclFloat32; return DOPT_OK;
  case DOPT_F64: *t = ncclFloat64; return DOPT_OK;
  case DOPT_BF16: *t = ncclBfloat16; return DOPT_OK;
  case DOPT_F16: *t = ncclFloat16; return DOPT_OK;
  case DOPT_I32: *t = ncclInt32; return DOPT_OK;
  case DOPT_I64: *t = ncclInt64; return DOPT_OK;
  case DOPT_U8: *t = ncclUint8; return DOPT_OK;
  case DOPT_I8: *t = ncclInt8; return DOPT_OK;
  default: return dopt__fail(DOPT_ERR_UNSUPPORTED, "nccl: dtype %d", (int)dt);
  }
}

static dopt_status nccl_op(dopt_redop op, ncclRedOp_t *o) {
  switch (op) {
  case DOPT_SUM: *o = ncclSum; return DOPT_OK;
  case DOPT_PROD: *o = ncclProd; return DOPT_OK;
  case DOPT_MAX: *o = ncclMax; return DOPT_OK;
  case DOPT_MIN: *o = ncclMin; return DOPT_OK;
  case DOPT_AVG: *o = ncclAvg; return DOPT_OK;
  default: return dopt__fail(DOPT_ERR_UNSUPPORTED, "nccl: reduction op %d", (int)op);
  }
}

/* float SUM/PROD/AVG need the fixed rank order */
static int ordered(const dopt_nccl_comm *c, dopt_dtype dt, dopt_redop op) {
  int fl = dt == DOPT_F32 || dt == DOPT_F64 || dt == DOPT_BF16 || dt == DOPT_F16;
  return !c->native_float && c->size > 1 && fl && (op == DOPT_SUM || op == DOPT_PROD || op == DOPT_AVG);
}

/* out[k] = tmp[0][k] op tmp[1][k] op ... (rank order), tmp: n rows of count */
static dopt_status reduce_rows(dopt_nccl_comm *c, dopt_dtype dt, dopt_redop op, void *out, const void *tmp,
                               size_t count) {
  if (dt == DOPT_F16) return dopt__fail(DOPT_ERR_UNSUPPORTED, "nccl: rank-ordered F16 reductions");
  const void **srcs = malloc((size_t)c->size * sizeof *srcs);
  if (!srcs) return dopt__fail(DOPT_ERR_NO_MEMORY, "nccl: %d ranks", c->size);
  for (int j = 0; j < c->size; j++) srcs[j] = (const char *)tmp + (size_t)j * count * dopt_dtype_size(dt);
  if (count) dopt_cuda_sim_memops()->reduce(NULL, dt, op, out, srcs, c->size, 0, 0, count);
  free(srcs);
  return DOPT_OK;
}

static dopt_status tmp_alloc(size_t bytes, void **p) {
  cudaError_t e = cudaMallocAsync(p, bytes ? bytes : 8, ST);
  if (e != cudaSuccess) return dopt__fail(DOPT_ERR_NO_MEMORY, "nccl: scratch of %zu bytes: %s", bytes, cudaGetErrorString(e));
  return DOPT_OK;
}

static dopt_status t_all_reduce(void *comm, const void *send, void *recv, size_t count, dopt_dtype dt, dopt_redop op) {
  dopt_nccl_comm *c = comm;
  DOPT_TRY(enter(c, "all_reduce"));
  ncclDataType_t t = ncclFloat32;
  ncclRedOp_t o = ncclSum;
  DOPT_TRY(nccl_type(dt, &t));
  DOPT_TRY(nccl_op(op, &o));
  if (!ordered(c, dt, op))
    return wait_comm(c, ncclAllReduce(send, recv, count, t, o, c->comm, ST), 1, "all_reduce");
  void *tmp;
  DOPT_TRY(tmp_alloc(count * dopt_dtype_size(dt) * (size_t)c->size, &tmp));
  dopt_status s = wait_comm(c, ncclAllGather(send, tmp, count, t, c->comm, ST), 1, "all_reduce (gather)");
  if (s == DOPT_OK) s = reduce_rows(c, dt, op, recv, tmp, count);
  cudaFreeAsync(tmp, ST);
  return s;
}

static dopt_status t_reduce_scatter(void *comm, const void *send, void *recv, size_t recvcount, dopt_dtype dt,
                                    dopt_redop op) {
  dopt_nccl_comm *c = comm;
  DOPT_TRY(enter(c, "reduce_scatter"));
  ncclDataType_t t = ncclFloat32;
  ncclRedOp_t o = ncclSum;
  DOPT_TRY(nccl_type(dt, &t));
  DOPT_TRY(nccl_op(op, &o));
  if (!ordered(c, dt, op))
    return wait_comm(c, ncclReduceScatter(send, recv, recvcount, t, o, c->comm, ST), 1, "reduce_scatter");
  const size_t blk = recvcount * dopt_dtype_size(dt);
  void *tmp;
  DOPT_TRY(tmp_alloc(blk * (size_t)c->size, &tmp));
  /* all-to-all of the blocks: row j of tmp = rank j's block `rank` */
  ncclResult_t r = ncclGroupStart();
  for (int j = 0; r == ncclSuccess && j < c->size; j++) {
    r = ncclSend((const char *)send + (size_t)j * blk, recvcount, t, j, c->comm, ST);
    if (r == ncclSuccess || r == ncclInProgress) r = ncclRecv((char *)tmp + (size_t)j * blk, recvcount, t, j, c->comm, ST);
    if (r == ncclInProgress) r = ncclSuccess;
  }
  ncclResult_t r2 = ncclGroupEnd();
  dopt_status s = wait_comm(c, r != ncclSuccess ? r : r2, 1, "reduce_scatter (exchange)");
  if (s == DOPT_OK) s = reduce_rows(c, dt, op, recv, tmp, recvcount);
  cudaFreeAsync(tmp, ST);
  return s;
}

static dopt_status t_all_gather(void *comm, const void *send, void *recv, size_t sendcount, dopt_dtype dt) {
  dopt_nccl_comm *c = comm;
  DOPT_TRY(enter(c, "all_gather"));
  ncclDataType_t t = ncclFloat32;
  DOPT_TRY(nccl_type(dt, &t));
  return wait_comm(c, ncclAllGather(send, recv, sendcount, t, c->comm, ST), 1, "all_gather");
}

static dopt_status t_broadcast(void *comm, const void *send, void *recv, size_t count, dopt_dtype dt, int root) {
  dopt_nccl_comm *c = comm;
  DOPT_TRY(enter(c, "broadcast"));
  DOPT_CHECK_ARG(root >= 0 && root < c->size, "nccl broadcast: root=%d of %d", root, c->size);
  ncclDataType_t t = ncclFloat32;
  DOPT_TRY(nccl_type(dt, &t));
  return wait_comm(c, ncclBroadcast(send, recv, count, t, root, c->comm, ST), 1, "broadcast");
}

static dopt_status t_reduce(void *comm, const void *send, void *recv, size_t count, dopt_dtype dt, dopt_redop op,
                            int root) {
  dopt_nccl_comm *c = comm;
  DOPT_TRY(enter(c, "reduce"));
  DOPT_CHECK_ARG(root >= 0 && root < c->size, "nccl reduce: root=%d of %d", root, c->size);
  ncclDataType_t t = ncclFloat32;
  ncclRedOp_t o = ncclSum;
  DOPT_TRY(nccl_type(dt, &t));
  DOPT_TRY(nccl_op(op, &o));
  if (!ordered(c, dt, op)) return wait_comm(c, ncclReduce(send, recv, count, t, o, root, c->comm, ST), 1, "reduce");
  /* rank order: every rank's buffer to the root (grouped point-to-point), reduced there */
  const size_t blk = count * dopt_dtype_size(dt);
  void *tmp = NULL;
  if (c->rank == root) DOPT_TRY(tmp_alloc(blk * (size_t)c->size, &tmp));
  ncclResult_t r = ncclGroupStart();
  if (r == ncclSuccess && c->rank != root) r = ncclSend(send, count, t, root, c->comm, ST);
  for (int j = 0; c->rank == root && r == ncclSuccess && j < c->size; j++) {
    if (j == root) {
      if (cudaMemcpyAsync((char *)tmp + (size_t)j * blk, send, blk, cudaMemcpyDeviceToDevice, ST) != cudaSuccess) {
        ncclGroupEnd();
        cudaFreeAsync(tmp, ST);
        return dopt__fail(DOPT_ERR_BACKEND, "nccl rank %d: reduce: copy of its own %zu bytes", c->rank, blk);
      }
      continue;
    }
    r = ncclRecv((char *)tmp + (size_t)j * blk, count, t, j, c->comm, ST);
    if (r == ncclInProgress) r = ncclSuccess;
  }
  if (r == ncclInProgress) r = ncclSuccess;
  ncclResult_t r2 = ncclGroupEnd();
  dopt_status s = wait_comm(c, r != ncclSuccess ? r : r2, 1, "reduce (exchange)");
  if (s == DOPT_OK && c->rank == root) s = reduce_rows(c, dt, op, recv, tmp, count);
  if (tmp) cudaFreeAsync(tmp, ST);
  return s;
}

/* Grouped point-to-point: one send and one receive per peer with data; the
 * own block is a device copy. */
static dopt_status t_all_to_allv(void *comm, const void *send, const size_t *scounts, const size_t *sdispls, void *recv,
                                 const size_t *rcounts, const size_t *rdispls, dopt_dtype dt) {
  dopt_nccl_comm *c = comm;
  DOPT_TRY(enter(c, "all_to_allv"));
  DOPT_CHECK_ARG(scounts && sdispls && rcounts && rdispls, "nccl all_to_allv: rank %d: NULL count array", c->rank);
  ncclDataType_t t = ncclFloat32;
  DOPT_TRY(nccl_type(dt, &t));
  const size_t esz = dopt_dtype_size(dt);
  const int me = c->rank;
  if (rcounts[me] != scounts[me])
    return dopt__fail(DOPT_ERR_MISMATCH, "nccl all_to_allv: rank %d: sends itself %zu elements, expects %zu", me,
                      scounts[me], rcounts[me]);
  if (scounts[me] &&
      cudaMemcpyAsync((char *)recv + rdispls[me] * esz, (const char *)send + sdispls[me] * esz, scounts[me] * esz,
                      cudaMemcpyDeviceToDevice, ST) != cudaSuccess)
    return dopt__fail(DOPT_ERR_BACKEND, "nccl rank %d: all_to_allv: copy of its own %zu elements", me, scounts[me]);
  ncclResult_t r = ncclGroupStart();
  for (int j = 0; r == ncclSuccess && j < c->size; j++) {
    if (j == me) continue;
    if (scounts[j]) r = ncclSend((const char *)send + sdispls[j] * esz, scounts[j], t, j, c->comm, ST);
    if (r == ncclInProgress) r = ncclSuccess;
    if (r == ncclSuccess && rcounts[j]) r = ncclRecv((char *)recv + rdispls[j] * esz, rcounts[j], t, j, c->comm, ST);
    if (r == ncclInProgress) r = ncclSuccess;
  }
  ncclResult_t r2 = ncclGroupEnd();
  return wait_comm(c, r != ncclSuccess ? r : r2, 1, "all_to_allv");
}

static const dopt_transport_ops nccl_ops = {t_all_reduce, t_reduce_scatter, t_all_gather, t_broadcast, t_reduce,
                                            t_all_to_allv, NULL, NULL, NULL, NULL, NULL}; /* device buffers on other GPUs: no views */

dopt_status dopt_nccl_transport(dopt_nccl_comm *comm, dopt_transport *out) {
  DOPT_CHECK_ARG(comm && out, "dopt_nccl_transport: NULL argument");
  out->ops = &nccl_ops;
  out->comm = comm;
  out->rank = comm->rank;
  out->size = comm->size;
  return DOPT_OK;
}
