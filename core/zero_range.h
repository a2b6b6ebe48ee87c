/* ZeRO's shard ranges (core/shape.c): which elements of a tensor each dp rank
 * holds, per tensor (ZeRO-1/2/3) or inside Gemini's chunks, and Gemini's
 * packing of tensors into chunks as ColossalAI's ChunkManager does it. Pure
 * arithmetic on element counts, so every rank and the harness compute the same
 * ranges; distributed/plan.c is their caller (docs/distributed.md). */
#ifndef DISTOPT_ZERO_RANGE_H
#define DISTOPT_ZERO_RANGE_H

#include <stddef.h>

/* ---- ZeRO ranges: per tensor, or Gemini's chunks (docs/distributed.md "Gemini: chunked ZeRO") ----------
 * A block of n elements lies at offset `off` of a chunk whose dp shards hold `shard` elements each; dp rank q
 * holds [q·shard, (q+1)·shard) of the chunk. Per-tensor ZeRO is the chunk of the block alone: off 0,
 * shard ceil(n / dp). */
typedef struct dopt_chunk_slot {
  size_t off, shard;
} dopt_chunk_slot;
/* dp rank q's range [*lo, *lo + *len) of the block (len 0: none of it). */
void dopt_chunk_range(dopt_chunk_slot s, size_t n, size_t q, size_t *lo, size_t *len);
/* Gemini's packing of blocks of n[0, np) elements, in order, into chunks of `chunk` elements rounded up to a
 * multiple of dp, as ColossalAI's ChunkManager.register_tensor: a block joins the open chunk when it fits, else
 * the next chunk opens; a block larger than a chunk has a chunk of its own (its size rounded up to a multiple
 * of dp) and closes it; an empty block takes no room. out[np]. */
void dopt_chunk_pack(const size_t *n, size_t np, size_t chunk, size_t dp, dopt_chunk_slot *out);

#endif
