/* distopt — the CUDA device, the NCCL transport and multi-process launch
 * (docs/cuda.md). Built as the separate library distopt_cuda when CMake finds
 * nvcc (DOPT_CUDA=AUTO|ON|OFF) and NCCL (DOPT_NCCL); the launch helpers
 * (environment parser, TCP rendezvous) are plain C and always built.
 *
 * The CUDA device performs the reference's fp32 operations in the reference's
 * order (no FMA contraction, IEEE division and square root) and the exact
 * fixed-point sums of distopt/xsum.h with integer atomics, so distributed/ on CUDA
 * is bitwise equal to the CPU reference for finite values (NaN payloads may
 * differ: the GPU produces canonical NaNs).
 *
 * Every call is synchronous with respect to the calling host thread, and
 * each host thread works on its own CUDA stream (cudaStreamPerThread). */
#ifndef DISTOPT_CUDA_H
#define DISTOPT_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "distopt/device.h"
#include "distopt/export.h"
#include "distopt/sim.h"
#include "distopt/status.h"
#include "distopt/transport.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- CUDA device ------------------------------------------------------------------ */

/* Number of usable CUDA devices; 0 when there is no driver, no device or the
 * library was built without CUDA. why (may be NULL) gets a one-line reason
 * when 0 is returned. */
DOPT_API int dopt_cuda_device_count(const char **why);

/* A device on CUDA device `device` (cudaSetDevice'd by every call). Memory is
 * cudaMalloc'd and zero-filled; kernels: add/scale/average/sumsq/to_bf16 and
 * the step of adamw, adafactor, came and lamb (others: DOPT_ERR_UNSUPPORTED).
 * Without CUDA (or without a GPU): DOPT_ERR_UNSUPPORTED with a message. */
DOPT_API dopt_status dopt_device_cuda(int device, dopt_device **out);
DOPT_API void dopt_device_cuda_destroy(dopt_device *dev);

/* The simulator's data movement on device memory (dopt_sim_config.memops):
 * cudaMemcpy copies (any direction), a fixed rank-order reduction kernel and
 * a bit flip in device memory. NULL when built without CUDA. */
DOPT_API const dopt_sim_memops *dopt_cuda_sim_memops(void);

/* ---- NCCL transport ---------------------------------------------------------------- */

#define DOPT_NCCL_ID_BYTES 128

typedef struct dopt_nccl_comm dopt_nccl_comm;

/* A fresh NCCL unique id (rank 0 creates it, every rank passes it to init). */
DOPT_API dopt_status dopt_nccl_unique_id(unsigned char id[DOPT_NCCL_ID_BYTES]);
/* Joins the communicator of nranks on CUDA device `device` (non-blocking
 * init polled until timeout_ms; then ncclCommAbort and DOPT_ERR_TIMEOUT).
 * timeout_ms also bounds every later collective on it and its splits. */
DOPT_API dopt_status dopt_nccl_init(const unsigned char id[DOPT_NCCL_ID_BYTES], int nranks, int rank, int device,
                                    uint32_t timeout_ms, dopt_nccl_comm **out);
/* From the launcher's environment (dopt_launch_env_get): rank 0 creates the
 * id and serves it on MASTER_ADDR:MASTER_PORT, the others fetch it; device =
 * local rank. */
DOPT_API dopt_status dopt_nccl_init_env(uint32_t timeout_ms, dopt_nccl_comm **out);
/* ncclCommSplit: ranks with the same color form a communicator ordered by
 * key; color < 0 gives *out = NULL. Collective over comm. */
DOPT_API dopt_status dopt_nccl_split(dopt_nccl_comm *comm, int color, int key, dopt_nccl_comm **out);
/* The communicator as a dopt_transport (borrowed); buffers are device memory. */
DOPT_API dopt_status dopt_nccl_transport(dopt_nccl_comm *comm, dopt_transport *out);
/* Floating-point SUM/PROD/AVG: by default in rank order (exchange, then a
 * reduction kernel: bitwise the simulator's order, n times the traffic);
 * on != 0 uses NCCL's own reductions (faster, order not fixed). Inherited by
 * later splits. */
DOPT_API dopt_status dopt_nccl_set_native_float_sums(dopt_nccl_comm *comm, int on);
/* ncclCommAbort: pending and later calls fail (DOPT_ERR_ABORTED). */
DOPT_API dopt_status dopt_nccl_abort(dopt_nccl_comm *comm);
DOPT_API void dopt_nccl_destroy(dopt_nccl_comm *comm);

#ifdef __cplusplus
}
#endif
#endif
