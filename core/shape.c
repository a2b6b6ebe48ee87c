/* Shapes and pieces: element counts, the [b, h, w] view, state descriptions,
 * the piece of a whole tensor (distopt/device.h). Below both the optimizer
 * framework (core/optim.c) and the piece statistics (core/stats.c). Declared
 * in core/piece.h (pieces), core/zero_range.h (ZeRO ranges, Gemini's chunks)
 * and core/optim_impl.h (state specs). */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "grid.h"
#include "optim_impl.h"
#include "piece.h"
#include "zero_range.h"

size_t dopt_numel(int ndim, const int64_t *shape) {
  size_t n = 1;
  for (int i = 0; i < ndim; i++) n *= (size_t)shape[i];
  return n;
}

void dopt_split_bhw(int ndim, const int64_t *shape, size_t *b, size_t *h, size_t *w) {
  *b = dopt_numel(ndim - 2, shape);
  *h = (size_t)shape[ndim - 2];
  *w = (size_t)shape[ndim - 1];
}

void dopt_state_def(dopt_state_spec *spec, const char *name, int ndim, const int64_t *shape, int elementwise) {
  dopt_state_def_dtype(spec, name, DOPT_F32, ndim, shape, elementwise);
}

void dopt_state_def_dtype(dopt_state_spec *spec, const char *name, dopt_dtype dtype, int ndim, const int64_t *shape,
                          int elementwise) {
  memset(spec, 0, sizeof *spec);
  spec->kind = elementwise ? DOPT_STATE_ELEMENTWISE : DOPT_STATE_WHOLE;
  dopt_state_view *v = &spec->v;
  v->name = name;
  v->dtype = dtype;
  v->ndim = ndim;
  for (int i = 0; i < ndim; i++) v->shape[i] = shape[i];
  v->bytes = dopt_numel(ndim, shape) * dopt_dtype_size(dtype);
}

void dopt_state_def_blocks(dopt_state_spec *spec, const char *name, dopt_dtype dtype, size_t numel, size_t block) {
  const int64_t nb = (int64_t)(block ? (numel + block - 1) / block : 0);
  dopt_state_def_dtype(spec, name, dtype, 1, &nb, 0);
  spec->kind = DOPT_STATE_BLOCKWISE;
  spec->block = block;
}

long long dopt_layout_block(const dopt_state_spec *spec, int n) {
  long long b = 0;
  for (int k = 0; k < n; k++) {
    if (spec[k].kind != DOPT_STATE_BLOCKWISE) continue;
    if (b && (size_t)b != spec[k].block) return -1;
    b = (long long)spec[k].block;
  }
  return b;
}

int dopt_piece_next_run(const dopt_piece *pc, size_t *off, dopt_run *r) {
  if (*off >= pc->len) return 0;
  const size_t j = pc->lo + *off, per = pc->hl * pc->wl;
  size_t n = pc->wl - j % pc->wl;                  /* to the end of its TP-local row */
  if (pc->wl == pc->w) n = per - j % per;          /* whole rows: to the end of the batch's block */
  if (pc->wl == pc->w && pc->hl == pc->h) n = pc->len - *off; /* whole batches: to the end */
  if (n > pc->len - *off) n = pc->len - *off;
  r->off = *off;
  r->at = dopt_grid_logical(pc, j);
  r->len = n;
  *off += n;
  return 1;
}

size_t dopt_piece_blocks(const dopt_piece *pc, size_t block, size_t *out) {
  size_t count = 0, last = SIZE_MAX, off = 0;
  dopt_run r;
  while (block && dopt_piece_next_run(pc, &off, &r))
    for (size_t k = r.at / block; k <= (r.at + r.len - 1) / block; k++) {
      if (k == last) continue; /* the previous run ended in this block */
      if (out) out[count] = k;
      count++;
      last = k;
    }
  return count;
}

void dopt_chunk_range(dopt_chunk_slot s, size_t n, size_t q, size_t *lo, size_t *len) {
  /* the shard [q·S, (q+1)·S) of the chunk, in the block's own coordinates (the block starts at off) */
  const size_t a = q * s.shard > s.off ? q * s.shard - s.off : 0;
  const size_t b = (q + 1) * s.shard > s.off ? (q + 1) * s.shard - s.off : 0;
  *lo = a < n ? a : n;
  *len = (b < n ? b : n) - *lo;
}

void dopt_chunk_pack(const size_t *n, size_t np, size_t chunk, size_t dp, dopt_chunk_slot *out) {
  const size_t C = (chunk + dp - 1) / dp * dp;
  size_t fill = 0;
  int open = 0;
  for (size_t i = 0; i < np; i++) {
    if (n[i] == 0) {
      out[i] = (dopt_chunk_slot){0, 1};
    } else if (n[i] > C) { /* a chunk of its own */
      out[i] = (dopt_chunk_slot){0, (n[i] + dp - 1) / dp};
      open = 0;
    } else {
      if (!open || fill + n[i] > C) open = 1, fill = 0;
      out[i] = (dopt_chunk_slot){fill, C / dp};
      fill += n[i];
    }
  }
}

void dopt_piece_full(int ndim, const int64_t *shape, dopt_piece *pc) {
  memset(pc, 0, sizeof *pc);
  pc->numel = dopt_numel(ndim, shape);
  pc->factored = ndim >= 2;
  if (pc->factored) {
    dopt_split_bhw(ndim, shape, &pc->b, &pc->h, &pc->w);
  } else {
    pc->b = 1;
    pc->h = 1;
    pc->w = pc->numel;
  }
  pc->hl = pc->h;
  pc->wl = pc->w;
  pc->len = pc->numel;
}

int dopt_layer_from_name(const char *name) {
  for (const char *s = name ? strstr(name, "layers.") : NULL; s; s = strstr(s + 1, "layers.")) {
    if (s != name && s[-1] != '.' && s[-1] != '/') continue;
    const char *d = s + 7;
    long v = 0;
    int nd = 0;
    while (*d >= '0' && *d <= '9' && nd < 9) v = v * 10 + (*d++ - '0'), nd++;
    if (nd > 0 && (*d == '.' || *d == '\0')) return (int)v;
  }
  return -1;
}

void dopt__shape_text(int ndim, const int64_t *shape, char *out, size_t cap) {
  size_t off = 0;
  out[0] = '\0';
  off += (size_t)snprintf(out, cap, "[");
  for (int d = 0; d < ndim && off < cap; d++)
    off += (size_t)snprintf(out + off, cap - off, "%s%lld", d ? "," : "", (long long)shape[d]);
  if (off < cap) snprintf(out + off, cap - off, "]");
}
