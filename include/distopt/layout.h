/* distopt — the layout description: which elements of one logical parameter a
 * rank holds, on which pipeline stage, for which expert. One form for every
 * layout users run (docs/layout.md): recordings (`distopt verify`, JSON
 * "pieces"), the distributed optimizer's pieces (dopt_layout_from_piece) and
 * the plugins.
 *
 * A piece of a parameter of shape [d0, ..., dn-1]:
 *   - block_dim < 0: the flat elements [lo, lo + len) of the tensor (row-major);
 *     a ZeRO / FSDP flat shard;
 *   - block_dim = k: the tensor-parallel block of indices [block_lo,
 *     block_lo + block_len) of dimension k (a column-parallel weight [out, in]:
 *     k = 0, a row-parallel one: k = 1, uneven splits included), seen as
 *     [outer, block_len, inner] row-major; lo, len: a flat range of that
 *     block (the whole block, or a ZeRO shard of it).
 *   - stage: the pipeline stage the rank holding it belongs to (-1: none);
 *     expert: the expert a per-expert parameter (`experts.<e>.`) belongs to
 *     (-1: dense). A 3-D expert stack [E, ...] split over expert-parallel
 *     ranks is a block of dimension 0: its experts are the block's indices.
 *
 * Block-major order: the elements of a parameter ordered block by block along
 * the pieces' block dimension (for block_dim 0 or none: the tensor's own
 * order). A parameter's pieces over all ranks are disjoint or identical
 * (replicas) and tile [0, numel) in that order (dopt_layout_cover). JSON:
 *   {"param": name, "block": {"dim": k, "lo": a, "len": b}, "lo": x, "len": y,
 *    "stage": s, "expert": e}        (block, lo/len, stage, expert optional)
 */
#ifndef DISTOPT_LAYOUT_H
#define DISTOPT_LAYOUT_H

#include <stddef.h>
#include <stdint.h>

#include "distopt/device.h"
#include "distopt/dtype.h"
#include "distopt/export.h"
#include "distopt/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DOPT_LAYOUT_PIECE_VERSION 1

/* Versioned (append-only; always start from DOPT_LAYOUT_PIECE_INIT). */
typedef struct dopt_layout_piece {
  uint32_t struct_size;
  uint32_t version;
  int block_dim;              /* -1: no block (lo, len are the tensor's) */
  int64_t block_lo, block_len;
  int64_t lo, len;            /* len < 0: to the end of the block (or tensor) */
  int stage;                  /* -1: not pipelined */
  int expert;                 /* -1: dense */
} dopt_layout_piece;

#define DOPT_LAYOUT_PIECE_INIT {sizeof(dopt_layout_piece), DOPT_LAYOUT_PIECE_VERSION, -1, 0, 0, 0, -1, -1, -1}

/* The piece inside a parameter of shape[ndim] (a block inside its dimension,
 * the range inside the block, len ≥ 1 once resolved, stage and expert ≥ -1):
 * DOPT_OK, or DOPT_ERR_INVALID_ARG with one line naming the field and value.
 * A len < 0 is resolved in *pc to the end of the block. */
DOPT_API dopt_status dopt_layout_piece_check(int ndim, const int64_t *shape, dopt_layout_piece *pc);

/* Elements of the piece's block (of the tensor when it has none). */
DOPT_API int64_t dopt_layout_piece_extent(int ndim, const int64_t *shape, const dopt_layout_piece *pc);
/* Where the piece starts in the parameter's block-major order. */
DOPT_API int64_t dopt_layout_piece_order(int ndim, const int64_t *shape, const dopt_layout_piece *pc);
/* The parameter's flat (row-major) index of the piece's element j, 0 ≤ j < len. */
DOPT_API int64_t dopt_layout_piece_elem(int ndim, const int64_t *shape, const dopt_layout_piece *pc, int64_t j);
/* "[lo, hi)" or "dim K [blo, bhi) [lo, hi)" into buf (NUL-terminated, cut to cap). */
DOPT_API void dopt_layout_piece_text(const dopt_layout_piece *pc, char *buf, size_t cap);

/* One parameter's pieces over all ranks (pieces[n], ranks[n] the rank of
 * each, checked pieces): one block dimension per parameter (flat ranges mix
 * only with blocks of dimension 0), disjoint or identical, covering every
 * element; the pieces that are not whole-tensor replicas on one pipeline
 * stage; one expert id. source (optional, [n]): 1 for the lowest rank's copy
 * of each distinct range (what supplies its elements), else 0. Else
 * DOPT_ERR_INVALID_ARG with one line: "parameter NAME: ..." naming the ranks
 * and their ranges (name escaped). */
DOPT_API dopt_status dopt_layout_cover(const char *name, int ndim, const int64_t *shape, const dopt_layout_piece *pieces,
                                       const int *ranks, size_t n, int *source);

/* ---- distopt's own layout rules: one author for the library, compare, mem and the benches ---- */

/* A parameter's tensor-parallel role (Megatron-LM's): column-parallel weights are cut by rows, row-parallel
 * ones by columns, the rest are whole on every TP rank. */
typedef enum dopt_tp_role {
  DOPT_TP_REPLICATED = 0,
  DOPT_TP_COLUMN = 1,
  DOPT_TP_ROW = 2,
} dopt_tp_role;

/* The uneven split of n items over `parts` (≥ 1): part r (0 ≤ r < parts) gets [*off, *off + *len) with
 * len = n / parts + (r < n mod parts) — the first n mod parts parts one more. TP blocks and the experts of an
 * ep-split stack are cut this way. */
DOPT_API void dopt_split_range(size_t n, int parts, int r, size_t *off, size_t *len);

/* TP rank r of tp's block of a parameter of shape[ndim] seen as [b, h, w] (dopt_piece_full): rows
 * [h0, h0 + hl) for DOPT_TP_COLUMN with ndim ≥ 2, columns [w0, w0 + wl) for DOPT_TP_ROW and for a 1-D
 * DOPT_TP_COLUMN (its only dimension), cut by dopt_split_range; the whole tensor when replicated or tp = 1.
 * *out: that block with lo = 0 and len = b · hl · wl (the whole block).
 *
 * This is distopt's TP split, not torch's DTensor rule. Shard(d) over k ranks gives rank r the
 * ceil(n / k) indices from r · ceil(n / k), the last ranks short or empty (python's dtensor_layout describes a
 * recording with that rule, because the pieces are torch's); distopt's own split keeps every block within one
 * index of the others and is what its layouts, checkpoints and digests were defined with. The two agree when
 * k divides n; they are different rules on purpose, and neither is used for the other's pieces. */
DOPT_API void dopt_tp_block(int ndim, const int64_t *shape, dopt_tp_role role, int tp, int r, dopt_piece *out);

/* Where a world rank stands in a layout of pipeline stages × dp × tp, with expert parallelism inside dp
 * (ColossalAI's MoeHybridParallelPlugin: dp = moe_dp · ep): world rank = (stage · dp + dp rank) · tp + tp rank,
 * dp rank = moe_dp rank · ep + ep rank. Without experts ep = 1 (ep rank 0, moe_dp rank = dp rank). */
typedef struct dopt_rank_coords {
  int stage, dp, tp; /* pipeline stage, data-parallel rank, tensor-parallel rank */
  int ep, moe_dp;    /* expert-parallel rank, expert-data-parallel rank (dp = moe_dp · ep + ep) */
} dopt_rank_coords;

/* The coordinates of world rank w (tp, dp, ep ≥ 1, ep dividing dp). */
DOPT_API dopt_rank_coords dopt_rank_coords_of(int64_t w, int tp, int dp, int ep);
/* The world rank at coordinates c (c->stage, c->dp, c->tp; ep and moe_dp are inside c->dp). */
DOPT_API int64_t dopt_world_rank_of(const dopt_rank_coords *c, int tp, int dp);

/* The layout description of a distributed piece (distopt/device.h) of a
 * parameter of ndim dimensions: its TP block as a block of dimension ndim-2
 * (split rows) or ndim-1 (split columns; dimension 0 of a 1-D tensor), its
 * flat range unchanged; stage and expert -1. DOPT_ERR_INVALID_ARG when both
 * dimensions are split (not a TP layout). */
DOPT_API dopt_status dopt_layout_from_piece(const dopt_piece *dp, int ndim, dopt_layout_piece *out);

#ifdef __cplusplus
}
#endif

#endif
