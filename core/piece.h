/* Pieces of a logical tensor (core/shape.c): a shape's element count and its
 * [b, h, w] view, and a piece's local elements as runs of the logical
 * flattened tensor and as the quantisation blocks they fall in. The piece
 * itself (dopt_piece: the block of the [b, h, w] view a step sees) is public,
 * in distopt/device.h; this header owns what is computed from it. Every layer
 * that cuts or walks pieces (core/optim_step.c's threads, the statistics of
 * core/stats.c, distributed/'s plan and gathers, the 8-bit states) reads it,
 * through core/optim_impl.h or directly. */
#ifndef DISTOPT_PIECE_H
#define DISTOPT_PIECE_H

#include <stddef.h>
#include <stdint.h>

#include "distopt/device.h"

/* Shape helpers. */
size_t dopt_numel(int ndim, const int64_t *shape);
/* Splits a >=2-D shape into batch x rows x cols (leading dims are batch). */
void dopt_split_bhw(int ndim, const int64_t *shape, size_t *b, size_t *h, size_t *w);

/* ---- a piece in logical order ----------------------------------------------------------
 * A piece's local elements, in order, are its logical elements in increasing
 * order, cut into runs that are contiguous in the logical flattened tensor:
 * local [off, off+len) is logical [at, at+len). Runs are maximal (whole TP
 * rows join when the block has every column, whole batches when it has
 * every row), so the logical element just before a run and the one just
 * after it belong to other pieces (or lie outside the tensor). */
typedef struct dopt_run {
  size_t off, at, len;
} dopt_run;
/* The run starting at local offset *off (0 at first); returns 0 at the end (*off advances). */
int dopt_piece_next_run(const dopt_piece *pc, size_t *off, dopt_run *r);
/* The blocks of `block` logical elements a piece's elements fall in: returns how many, and writes their
 * indices (ascending) to out[] when out != NULL. */
size_t dopt_piece_blocks(const dopt_piece *pc, size_t block, size_t *out);

#endif
