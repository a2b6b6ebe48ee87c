/* The layout description (distopt/layout.h): a piece's geometry, its elements,
 * and the coverage rule every recording and plugin layout obeys. */
#include "distopt/layout.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* The parameter seen as [outer, dimlen, inner] around the piece's block dimension (dimlen = numel, inner = 1
 * without a block). */
static void geometry(int ndim, const int64_t *shape, const dopt_layout_piece *pc, int64_t *outer, int64_t *dimlen,
                     int64_t *inner) {
  int64_t o = 1, d = 1, i = 1;
  for (int k = 0; k < ndim; k++) {
    if (pc->block_dim < 0 || k == pc->block_dim) d *= shape[k];
    else if (k < pc->block_dim) o *= shape[k];
    else i *= shape[k];
  }
  *outer = o, *dimlen = d, *inner = i;
}

int64_t dopt_layout_piece_extent(int ndim, const int64_t *shape, const dopt_layout_piece *pc) {
  int64_t o, d, i;
  geometry(ndim, shape, pc, &o, &d, &i);
  return pc->block_dim < 0 ? o * d * i : o * pc->block_len * i;
}

int64_t dopt_layout_piece_order(int ndim, const int64_t *shape, const dopt_layout_piece *pc) {
  int64_t o, d, i;
  geometry(ndim, shape, pc, &o, &d, &i);
  return (pc->block_dim < 0 ? 0 : o * pc->block_lo * i) + pc->lo;
}

int64_t dopt_layout_piece_elem(int ndim, const int64_t *shape, const dopt_layout_piece *pc, int64_t j) {
  const int64_t e = pc->lo + j;
  if (pc->block_dim < 0) return e;
  int64_t o, d, i;
  geometry(ndim, shape, pc, &o, &d, &i);
  const int64_t span = pc->block_len * i, row = e / span, rem = e % span;
  return (row * d + pc->block_lo + rem / i) * i + rem % i;
}

void dopt_layout_piece_text(const dopt_layout_piece *pc, char *buf, size_t cap) {
  if (!buf || !cap) return;
  if (pc->block_dim < 0) snprintf(buf, cap, "[%lld, %lld)", (long long)pc->lo, (long long)(pc->lo + pc->len));
  else
    snprintf(buf, cap, "dim %d [%lld, %lld) [%lld, %lld)", pc->block_dim, (long long)pc->block_lo,
             (long long)(pc->block_lo + pc->block_len), (long long)pc->lo, (long long)(pc->lo + pc->len));
}

dopt_status dopt_layout_piece_check(int ndim, const int64_t *shape, dopt_layout_piece *pc) {
  DOPT_CHECK_ARG(pc && (shape || ndim == 0), "dopt_layout_piece_check: NULL argument");
  DOPT_CHECK_ARG(pc->struct_size >= sizeof *pc && pc->version == DOPT_LAYOUT_PIECE_VERSION,
                 "dopt_layout_piece_check: struct_size %u version %u (start from DOPT_LAYOUT_PIECE_INIT, version %d)",
                 (unsigned)pc->struct_size, (unsigned)pc->version, DOPT_LAYOUT_PIECE_VERSION);
  DOPT_CHECK_ARG(ndim >= 0 && ndim <= DOPT_MAX_DIMS, "dopt_layout_piece_check: ndim %d outside [0, %d]", ndim,
                 DOPT_MAX_DIMS);
  for (int k = 0; k < ndim; k++)
    DOPT_CHECK_ARG(shape[k] >= 1, "dopt_layout_piece_check: shape[%d] = %lld (dimensions are >= 1)", k,
                   (long long)shape[k]);
  if (pc->block_dim >= 0) {
    DOPT_CHECK_ARG(pc->block_dim < ndim, "block dim %d: the tensor has %d dimensions", pc->block_dim, ndim);
    const int64_t dl = shape[pc->block_dim];
    DOPT_CHECK_ARG(pc->block_lo >= 0 && pc->block_len >= 1 && pc->block_lo <= dl - pc->block_len,
                   "block dim %d [%lld, %lld) is outside [0, %lld)", pc->block_dim, (long long)pc->block_lo,
                   (long long)(pc->block_lo + pc->block_len), (long long)dl);
  } else {
    DOPT_CHECK_ARG(pc->block_dim == -1, "block dim %d (-1: none)", pc->block_dim);
  }
  const int64_t extent = dopt_layout_piece_extent(ndim, shape, pc);
  DOPT_CHECK_ARG(pc->lo >= 0 && pc->lo < extent, "lo %lld is outside [0, %lld)%s", (long long)pc->lo,
                 (long long)extent, pc->block_dim >= 0 ? " (the block)" : "");
  if (pc->len < 0) pc->len = extent - pc->lo;
  DOPT_CHECK_ARG(pc->len >= 1 && pc->len <= extent - pc->lo, "elements [%lld, %lld) are outside its %lld%s",
                 (long long)pc->lo, (long long)(pc->lo + pc->len), (long long)extent,
                 pc->block_dim >= 0 ? " (the block)" : "");
  DOPT_CHECK_ARG(pc->stage >= -1, "stage %d (-1: none)", pc->stage);
  DOPT_CHECK_ARG(pc->expert >= -1, "expert %d (-1: dense)", pc->expert);
  return DOPT_OK;
}

typedef struct cover_ref {
  int64_t order, len;
  int rank;
  size_t at; /* index into the caller's arrays */
} cover_ref;

static int cmp_cover(const void *a, const void *b) {
  const cover_ref *x = a, *y = b;
  if (x->order != y->order) return x->order < y->order ? -1 : 1;
  if (x->len != y->len) return x->len < y->len ? -1 : 1;
  if (x->rank != y->rank) return x->rank < y->rank ? -1 : 1;
  return x->at < y->at ? -1 : x->at > y->at;
}

/* A name for a message: at most 60 bytes (dopt__fail escapes control characters). */
static const char *short_name(const char *name, char *buf, size_t cap) {
  snprintf(buf, cap, "%.60s%s", name ? name : "?", name && strlen(name) > 60 ? "..." : "");
  return buf;
}

dopt_status dopt_layout_cover(const char *name, int ndim, const int64_t *shape, const dopt_layout_piece *pieces,
                              const int *ranks, size_t n, int *source) {
  DOPT_CHECK_ARG((pieces && ranks) || n == 0, "dopt_layout_cover: NULL argument");
  DOPT_CHECK_ARG(shape || ndim == 0, "dopt_layout_cover: NULL shape");
  char nm[80], da[96], db[96];
  short_name(name, nm, sizeof nm);
  int64_t numel = 1;
  for (int k = 0; k < ndim; k++) numel *= shape[k];
  /* one block dimension per parameter; flat ranges mix only with blocks of dimension 0 (whose block-major
   * order is the tensor's own) */
  long blk = -1, flat = -1, expert_at = -1;
  for (size_t j = 0; j < n; j++) {
    const dopt_layout_piece *pc = &pieces[j];
    if (pc->block_dim < 0) flat = flat < 0 ? (long)j : flat;
    else if (blk < 0) blk = (long)j;
    if (blk >= 0 && pc->block_dim >= 0 && pc->block_dim != pieces[blk].block_dim)
      return dopt__fail(DOPT_ERR_INVALID_ARG, "parameter %s: rank %d's piece is a block of dimension %d, rank %d's of "
                        "dimension %d (one dimension per parameter)", nm, ranks[j], pc->block_dim, ranks[blk],
                        pieces[blk].block_dim);
    if (blk >= 0 && flat >= 0 && pieces[blk].block_dim != 0)
      return dopt__fail(DOPT_ERR_INVALID_ARG, "parameter %s: rank %d's piece is a block of dimension %d, rank %d's a "
                        "flat range of the whole tensor (give it as a block too)", nm, ranks[blk],
                        pieces[blk].block_dim, ranks[flat]);
    if (expert_at < 0) expert_at = (long)j;
    else if (pc->expert != pieces[expert_at].expert)
      return dopt__fail(DOPT_ERR_INVALID_ARG, "parameter %s: rank %d's piece is of expert %d, rank %d's of expert %d "
                        "(a parameter belongs to one expert or none)", nm, ranks[j], pc->expert, ranks[expert_at],
                        pieces[expert_at].expert);
  }
  cover_ref *all = malloc((n ? n : 1) * sizeof *all);
  if (!all) return dopt__fail(DOPT_ERR_NO_MEMORY, "parameter %s: %zu pieces", nm, n);
  for (size_t j = 0; j < n; j++)
    all[j] = (cover_ref){dopt_layout_piece_order(ndim, shape, &pieces[j]), pieces[j].len, ranks[j], j};
  qsort(all, n, sizeof *all, cmp_cover);
  if (source)
    for (size_t j = 0; j < n; j++) source[j] = 0;
  dopt_status s = DOPT_OK;
  int64_t end = 0;
  long prev = -1, staged = -1; /* staged: a piece that is not a whole-tensor replica, its stage the parameter's */
  size_t i = 0;
  for (; i < n; i++) {
    const dopt_layout_piece *pc = &pieces[all[i].at];
    if (!(all[i].order == 0 && all[i].len == numel)) {
      if (staged < 0) staged = (long)i;
      else if (pc->stage != pieces[all[staged].at].stage) {
        s = dopt__fail(DOPT_ERR_INVALID_ARG, "parameter %s: rank %d's piece is on stage %d, rank %d's on stage %d (a "
                       "parameter lives on one stage; only whole replicas, a tied embedding, may be on two)", nm,
                       all[i].rank, pc->stage, all[staged].rank, pieces[all[staged].at].stage);
        break;
      }
    }
    if (prev >= 0 && all[prev].order == all[i].order && all[prev].len == all[i].len) continue; /* a replica */
    if (all[i].order != end) {
      if (all[i].order > end) break; /* a gap: reported below */
      dopt_layout_piece_text(pc, da, sizeof da);
      dopt_layout_piece_text(&pieces[all[prev].at], db, sizeof db);
      s = dopt__fail(DOPT_ERR_INVALID_ARG, "parameter %s: rank %d's elements %s overlap rank %d's %s partially (pieces "
                     "of a parameter are disjoint or identical)", nm, all[i].rank, da, all[prev].rank, db);
      break;
    }
    if (source) source[all[i].at] = 1;
    end = all[i].order + all[i].len;
    prev = (long)i;
  }
  if (s == DOPT_OK && end != numel)
    s = dopt__fail(DOPT_ERR_INVALID_ARG, "parameter %s: elements [%lld, %lld)%s are held by no rank", nm,
                   (long long)end, (long long)(i < n ? all[i].order : numel),
                   prev >= 0 && pieces[all[prev].at].block_dim >= 0 ? " (in block-major order)" : "");
  free(all);
  return s;
}

dopt_status dopt_layout_from_piece(const dopt_piece *dp, int ndim, dopt_layout_piece *out) {
  DOPT_CHECK_ARG(dp && out, "dopt_layout_from_piece: NULL argument");
  const dopt_layout_piece init = DOPT_LAYOUT_PIECE_INIT;
  *out = init;
  const int rows = dp->hl != dp->h, cols = dp->wl != dp->w;
  DOPT_CHECK_ARG(!(rows && cols), "dopt_layout_from_piece: rows [%zu, %zu) and columns [%zu, %zu) both split (a TP "
                 "block splits one dimension)", dp->h0, dp->h0 + dp->hl, dp->w0, dp->w0 + dp->wl);
  if (rows) out->block_dim = ndim - 2, out->block_lo = (int64_t)dp->h0, out->block_len = (int64_t)dp->hl;
  if (cols) out->block_dim = ndim >= 2 ? ndim - 1 : 0, out->block_lo = (int64_t)dp->w0, out->block_len = (int64_t)dp->wl;
  out->lo = (int64_t)dp->lo;
  out->len = (int64_t)dp->len;
  return DOPT_OK;
}

/* ---- distopt's own layout rules ------------------------------------------------------------------------ */

void dopt_split_range(size_t n, int parts, int r, size_t *off, size_t *len) {
  size_t base = n / (size_t)parts, rem = n % (size_t)parts, ur = (size_t)r;
  *len = base + (ur < rem);
  *off = ur * base + (ur < rem ? ur : rem);
}

void dopt_tp_block(int ndim, const int64_t *shape, dopt_tp_role role, int tp, int r, dopt_piece *out) {
  dopt_piece_full(ndim, shape, out);
  if (tp > 1 && role == DOPT_TP_COLUMN && ndim >= 2) dopt_split_range(out->h, tp, r, &out->h0, &out->hl);
  else if (tp > 1 && (role == DOPT_TP_COLUMN || role == DOPT_TP_ROW)) dopt_split_range(out->w, tp, r, &out->w0, &out->wl);
  out->lo = 0;
  out->len = out->b * out->hl * out->wl;
}

dopt_rank_coords dopt_rank_coords_of(int64_t w, int tp, int dp, int ep) {
  dopt_rank_coords c;
  c.tp = (int)(w % tp);
  c.dp = (int)(w / tp % dp);
  c.stage = (int)(w / ((int64_t)tp * dp));
  c.ep = c.dp % ep;
  c.moe_dp = c.dp / ep;
  return c;
}

int64_t dopt_world_rank_of(const dopt_rank_coords *c, int tp, int dp) {
  return ((int64_t)c->stage * dp + c->dp) * tp + c->tp;
}
