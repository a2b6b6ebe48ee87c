/* distopt — the device interface: memory plus the few kernels the
 * distributed optimizers need, behind a vtable, so distributed/ runs unchanged on
 * the CPU (dopt_device_cpu) and on CUDA (cuda/).
 *
 * Pieces. A distributed parameter is seen by a rank as a *piece* of its
 * logical tensor, viewed as [b, h, w] (the last two dims; leading dims fold
 * into b; 1-D and scalar tensors are [1, 1, numel]):
 *   - the TP block: rows [h0, h0+hl) and columns [w0, w0+wl) of every batch
 *     (the whole tensor when not tensor-parallel);
 *   - the flat range [lo, lo+len) of that block stored row-major as
 *     [b, hl, wl] (the whole block when not ZeRO-sharded).
 * A piece holds exactly len valid elements: ZeRO padding never enters a
 * kernel, a statistic or a count.
 *
 * Reducers and stages. Cross-element statistics are computed with the exact
 * sums of distopt/xsum.h: a MAX over doubles and a SUM over int64 words, both
 * exact in any order. A step never waits for a collective: it runs as stages
 * (docs/architecture.md), and in a stage it *posts* arrays to its reducer for
 * the next MAX or SUM phase; the caller reduces everything posted by every
 * parameter that shares a reducer group in one collective per group and
 * phase, then runs each step's next stage, which finds the reduced values in
 * place. A NULL reducer is the single device: the local values already are
 * the totals and nothing is posted.
 */
#ifndef DISTOPT_DEVICE_H
#define DISTOPT_DEVICE_H

#include <stddef.h>
#include <stdint.h>

#include "distopt/export.h"
#include "distopt/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct dopt_piece {
  size_t b, h, w;        /* logical [b, h, w] view */
  size_t numel;          /* logical element count (b·h·w) */
  int factored;          /* logical ndim >= 2 */
  size_t h0, hl, w0, wl; /* this rank's TP block */
  size_t lo, len;        /* this rank's flat range of the block */
} dopt_piece;

/* The piece of a whole, unsharded tensor. */
DOPT_API void dopt_piece_full(int ndim, const int64_t *shape, dopt_piece *out);

typedef struct dopt_reducer {
  void *ctx;
  /* Posts x[n] (device memory that lives until the step's next stage, i.e.
   * its frame) for the next MAX (F64) / integer SUM (I64) phase across the
   * ranks sharing the tensor; the reduced values are in x when the step's
   * next stage runs. */
  dopt_status (*post_max_f64)(void *ctx, double *x, size_t n);
  dopt_status (*post_sum_i64)(void *ctx, int64_t *x, size_t n);
} dopt_reducer;

struct dopt_step_args; /* internal: one optimizer step on one piece (core/optim_impl.h) */

typedef struct dopt_device_ops {
  const char *name;
  /* memory: alloc returns zero-filled memory */
  dopt_status (*alloc)(void *ctx, size_t bytes, void **out);
  void (*free)(void *ctx, void *ptr);
  dopt_status (*upload)(void *ctx, void *dst, const void *host_src, size_t bytes);
  dopt_status (*download)(void *ctx, void *host_dst, const void *src, size_t bytes);
  dopt_status (*copy)(void *ctx, void *dst, const void *src, size_t bytes);
  /* fp32 vector kernels over n elements */
  dopt_status (*add)(void *ctx, float *acc, const float *x, size_t n); /* acc[i] = acc[i] + x[i] */
  dopt_status (*scale)(void *ctx, float *x, float a, size_t n);         /* x[i] = x[i] * a */
  /* x[i] = x[i] / d, and the number of non-finite results (host) */
  dopt_status (*average)(void *ctx, float *x, float d, size_t n, int64_t *host_nonfinite);
  /* exact Σx² of n local elements (no reduction: the distributed norms are
   * steps, see dopt_step_args) */
  dopt_status (*sumsq)(void *ctx, const float *x, size_t n, double *host_ss);
  /* y[i] = bf16(x[i]), round to nearest even */
  dopt_status (*to_bf16)(void *ctx, const float *x, uint16_t *y, size_t n);
  /* bytes of device memory one step on this piece needs across its stages
   * (its frame; 0: none) */
  size_t (*frame_bytes)(void *ctx, const struct dopt_step_args *args);
  /* one stage of one optimizer step on one piece (args->stage; the step sets
   * *args->more to be called again after the posted reductions) */
  dopt_status (*step)(void *ctx, const struct dopt_step_args *args);
  /* The exact data-parallel sum (distopt/dpsum.h, core/grid.h), over the
   * elements [lo, lo+len) of a piece's TP block; x, w, cls point at element
   * lo, codes[dopt_grid_blocks(numel)] are the logical blocks' codes:
   *   grid_codes   codes[blk] = max(codes[blk], each element's code); the
   *                number of non-finite elements (host)
   *   grid_encode  `words` int64 words per element on the grid of K = k
   *                (and its NaN/±inf class word when cls != NULL); add:
   *                w += (and cls +=) instead of =, a local integer sum
   *   grid_decode  summed words (and class words; cls NULL: all finite) →
   *                fp32, rounded once */
  dopt_status (*grid_codes)(void *ctx, const float *x, const dopt_piece *pc, int32_t *codes, int64_t *host_nonfinite);
  dopt_status (*grid_encode)(void *ctx, const float *x, const dopt_piece *pc, const int32_t *codes, int words, int k,
                             int add, int64_t *w, int64_t *cls);
  dopt_status (*grid_decode)(void *ctx, const int64_t *w, const int64_t *cls, const dopt_piece *pc,
                             const int32_t *codes, int words, int k, float *x);
  /* A device whose kernels run on host memory in program order (the CPU):
   * the elements the distributed dp sum takes at a time so that its words
   * stay in cache, fusing its passes (codes, sum, decode, average) chunk by
   * chunk, rounded up to whole blocks (DOPT_GRID_BLOCK); results are the same
   * bits for any value. 0 (a GPU): one pass per kernel over a whole range. */
  size_t host_chunk;
  /* Optional, a host device's (NULL: the three grid kernels above): the
   * exact sum of nparts parts of n elements that are whole logical blocks in
   * order (the first one starting a block), as dopt_dp_sum computes it with
   * `words`; parts is a host array of device pointers, and out may be one of
   * them (in place). */
  dopt_status (*grid_sum)(void *ctx, const float *const *parts, int nparts, int words, size_t n, float *out);
} dopt_device_ops;

typedef struct dopt_device {
  const dopt_device_ops *ops;
  void *ctx;
} dopt_device;

/* The host CPU: device memory is host memory; kernels are the reference's. */
DOPT_API const dopt_device *dopt_device_cpu(void);

/* bf16 helpers (round to nearest even; NaN stays NaN). */
DOPT_API uint16_t dopt_f32_to_bf16(float x);
DOPT_API float dopt_bf16_to_f32(uint16_t x);

#ifdef __cplusplus
}
#endif
#endif
