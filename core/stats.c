/* Exact statistics of a piece of a logical [b, h, w] tensor (see
 * distopt/device.h): the sums of squares, row/column means and factored
 * update shared by Adafactor, CAME and LAMB, each in the two reduction phases
 * of a staged step (core/optim_impl.h). The whole tensor is the piece with
 * h0 = w0 = lo = 0; a distributed rank passes its shard and a reducer, and
 * gets bitwise the same statistics. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "elem.h"
#include "optim_impl.h"
#include "xsum_fast.h"

float dopt_rms_from_ss(double ss, size_t n) {
  float norm = (float)sqrt(ss);
  return norm / (float)sqrt((double)n);
}

void dopt_factored_state_defs(const char *row_name, const char *col_name, int ndim, const int64_t *shape,
                              dopt_state_spec *out, int *n) {
  int64_t col[DOPT_MAX_DIMS];
  for (int i = 0; i < ndim - 2; i++) col[i] = shape[i];
  col[ndim - 2] = shape[ndim - 1];
  dopt_state_def(&out[(*n)++], row_name, ndim - 1, shape, 0);
  dopt_state_def(&out[(*n)++], col_name, ndim - 1, col, 0);
}

void *dopt_frame_take(dopt_frame *f, size_t bytes) {
  size_t at = (f->off + 15) & ~(size_t)15;
  f->off = at + bytes;
  return f->base ? f->base + at : NULL;
}

double dopt_sumsq(const float *x, size_t n) { return dopt_xsum_sq(x, n); }

dopt_status dopt_ss_begin(dopt_ss_stat *s, const float *x, size_t n, const dopt_reducer *red) {
  return dopt_ss_begin_absmax(s, dopt__absmax_run(x, n), red);
}

dopt_status dopt_ss_begin_absmax(dopt_ss_stat *s, float absmax, const dopt_reducer *red) {
  double m = (double)absmax;
  s->m = m * m; /* max of the squares, exact in double */
  return red ? red->post_max_f64(red->ctx, &s->m, 1) : DOPT_OK;
}

float dopt_absmax_tile(float m, const float *x, size_t n) {
  float t = dopt__absmax_run(x, n);
  return t > m ? t : m;
}

dopt_status dopt_ss_accum(dopt_ss_stat *s, const float *x, size_t n, const dopt_reducer *red) {
  memset(&s->acc, 0, sizeof s->acc);
  dopt_xacc_add_sq_n(&s->acc, dopt_xsum_scale(s->m), x, n);
  return red ? red->post_sum_i64(red->ctx, s->acc.w, DOPT_XSUM_WORDS) : DOPT_OK;
}

double dopt_ss_value(const dopt_ss_stat *s) { return dopt_xacc_value(&s->acc, dopt_xsum_scale(s->m)); }

/* The Σx² step (dopt__impl_sumsq): the gradient norms of global clipping. */
static dopt_status sumsq_step(const dopt_step_args *a) {
  dopt_ss_stat *s = a->frame;
  const float *x = a->grad;
  const size_t n = a->piece->len;
  switch (a->stage) {
  case 0:
    *a->more = 1;
    return dopt_ss_begin(s, x, n, a->red);
  case 1:
    *a->more = 1;
    return dopt_ss_accum(s, x, n, a->red);
  default:
    *a->host_out = dopt_ss_value(s);
    return DOPT_OK;
  }
}

static size_t sumsq_frame(const double *hp, const dopt_piece *pc) {
  (void)hp, (void)pc;
  return sizeof(dopt_ss_stat);
}

const dopt_optim_impl dopt__impl_sumsq = {
    .name = "sumsq",
    .summary = "exact sum of squares of a piece (global-norm clipping)",
    .frame = sumsq_frame,
    .step = sumsq_step,
    .distributable = 1,
};

/* ---- walking a piece ------------------------------------------------------------------
 * The local range [lo, lo+len) of the row-major [b, hl, wl] block, cut into
 * blocks of whole local rows (within one batch) and partial rows at the two
 * ends. For each block: batch bi, first local row i, rows, first local column
 * j, cols (the row stride of the block's data is cols) and the offset of its
 * first element in the local buffer. */
typedef struct piece_block {
  size_t bi, i, rows, j, cols, off;
} piece_block;

static int next_block(const dopt_piece *pc, size_t *k, piece_block *blk) {
  size_t end = pc->lo + pc->len, plane = pc->hl * pc->wl;
  if (*k >= end || plane == 0) return 0;
  size_t rem = *k % plane;
  blk->bi = *k / plane;
  blk->i = rem / pc->wl;
  blk->j = rem % pc->wl;
  blk->off = *k - pc->lo;
  if (blk->j != 0 || end - *k < pc->wl) { /* a partial row */
    blk->rows = 1;
    blk->cols = pc->wl - blk->j < end - *k ? pc->wl - blk->j : end - *k;
  } else { /* whole rows of this batch */
    size_t rows = (end - *k) / pc->wl;
    blk->rows = rows < pc->hl - blk->i ? rows : pc->hl - blk->i;
    blk->cols = pc->wl;
  }
  *k += blk->rows * blk->cols;
  return 1;
}

/* logical row / column index of a block's first local row / column */
static size_t blk_row(const dopt_piece *pc, const piece_block *b) { return b->bi * pc->h + pc->h0 + b->i; }
static size_t blk_col(const dopt_piece *pc, const piece_block *b) { return b->bi * pc->w + pc->w0 + b->j; }

void dopt_rc_take(dopt_frame *f, const dopt_piece *pc, dopt_rc_stat *out) {
  const size_t nacc = pc->b * pc->h + pc->b * pc->w;
  out->scale = dopt_frame_take(f, nacc * sizeof *out->scale);
  out->acc = dopt_frame_take(f, nacc * sizeof *out->acc);
}

/* Phase 1: row and column maxima of |U| (float maxima are exact; the
 * conversion to double is monotone), posted for MAX. */
dopt_status dopt_rc_begin(dopt_rc_stat *s, const float *u, const dopt_piece *pc, const dopt_reducer *red) {
  return dopt_rc_begin_rows(s, u, pc, red, NULL, NULL);
}

/* The same, each local row segment produced by make (when given) just before
 * its maxima are taken, while it is still in cache. */
dopt_status dopt_rc_begin_rows(dopt_rc_stat *s, const float *u, const dopt_piece *pc, const dopt_reducer *red,
                               void (*make)(void *ctx, size_t off, size_t len), void *ctx) {
  const size_t nr = pc->b * pc->h, nc = pc->b * pc->w;
  float *cmax = calloc(nc ? nc : 1, sizeof *cmax);
  if (!cmax) return dopt__fail(DOPT_ERR_NO_MEMORY, "row/column statistics: %zu column maxima", nc);
  double *scale = s->scale;
  for (size_t r = 0; r < nr; r++) scale[r] = 0.0;
  piece_block blk;
  size_t k = pc->lo;
  while (next_block(pc, &k, &blk)) {
    for (size_t r = 0; r < blk.rows; r++) {
      if (make) make(ctx, blk.off + r * blk.cols, blk.cols);
      double m = (double)dopt__absmax_row_cols(u + blk.off + r * blk.cols, blk.cols, cmax + blk_col(pc, &blk));
      double *rm = &scale[blk_row(pc, &blk) + r];
      *rm = m > *rm ? m : *rm;
    }
  }
  for (size_t c = 0; c < nc; c++) scale[nr + c] = (double)cmax[c];
  free(cmax);
  return red ? red->post_max_f64(red->ctx, scale, nr + nc) : DOPT_OK;
}

/* Phase 2: the shared scales and the fixed-point row and column sums, posted for SUM. */
dopt_status dopt_rc_accum(dopt_rc_stat *s, const float *u, const dopt_piece *pc, const dopt_reducer *red) {
  const size_t nr = pc->b * pc->h, nacc = nr + pc->b * pc->w;
  double *ws = malloc((pc->wl ? 2 * pc->wl : 1) * sizeof *ws); /* column-sum scratch */
  if (!ws) return dopt__fail(DOPT_ERR_NO_MEMORY, "row/column statistics: %zu columns", pc->wl);
  double *scale = s->scale;
  dopt_xacc *acc = s->acc;
  for (size_t i = 0; i < nacc; i++) scale[i] = dopt_xsum_scale(scale[i]);
  memset(acc, 0, nacc * sizeof *acc);
  piece_block blk;
  size_t k = pc->lo;
  while (next_block(pc, &k, &blk)) {
    const float *p = u + blk.off;
    size_t r0 = blk_row(pc, &blk), c0 = blk_col(pc, &blk);
    for (size_t r = 0; r < blk.rows; r++) dopt__xacc_add_run(&acc[r0 + r], scale[r0 + r], p + r * blk.cols, blk.cols, 0);
    dopt__xacc_add_cols_block(acc + nr + c0, scale + nr + c0, p, blk.rows, blk.cols, ws);
  }
  free(ws);
  return red ? red->post_sum_i64(red->ctx, &acc[0].w[0], nacc * DOPT_XSUM_WORDS) : DOPT_OK;
}

size_t dopt_update_frame_map(void *base, const dopt_piece *pc, int rowcol, dopt_update_frame *f) {
  dopt_frame fr = {base, 0};
  memset(f, 0, sizeof *f);
  f->pss = dopt_frame_take(&fr, sizeof *f->pss);
  f->uss = dopt_frame_take(&fr, sizeof *f->uss);
  f->u = dopt_frame_take(&fr, pc->len * sizeof *f->u);
  if (rowcol && pc->factored) {
    f->rmean = dopt_frame_take(&fr, pc->b * pc->h * sizeof *f->rmean);
    f->cmean = dopt_frame_take(&fr, pc->b * pc->w * sizeof *f->cmean);
    dopt_rc_take(&fr, pc, &f->rc);
  }
  return fr.off;
}

size_t dopt_update_frame_rowcol(const double *hp, const dopt_piece *pc) {
  (void)hp;
  dopt_update_frame f;
  return dopt_update_frame_map(NULL, pc, 1, &f);
}

size_t dopt_update_frame_norms(const double *hp, const dopt_piece *pc) {
  (void)hp;
  dopt_update_frame f;
  return dopt_update_frame_map(NULL, pc, 0, &f);
}

typedef struct sq_rows {
  const float *g;
  float *u;
  float eps1;
} sq_rows;
static void make_sq_rows(void *ctx, size_t off, size_t len) {
  const sq_rows *c = ctx;
  const float *g = c->g + off;
  float *u = c->u + off;
  for (size_t i = 0; i < len; i++) u[i] = dopt_sq_eps_elem(g[i], c->eps1);
}

dopt_status dopt_second_moment_stage(const dopt_step_args *a, int stage, dopt_update_frame *f, float *row,
                                     float *col, float b, float omb, float eps1) {
  const dopt_piece *pc = a->piece;
  const size_t n = pc->len;
  const float *g = a->grad, *w;
  size_t nw, numel_w;
  dopt_wstat(a, &w, &nw, &numel_w); /* ‖w‖²: of the piece, or of a projection wrapper's full weight */
  float *u = f->u;
  switch (stage) {
  case 0:
    DOPT_TRY(dopt_ss_begin(f->pss, w, nw, a->red));
    if (pc->factored) { /* U = G² + eps1 row by row, its maxima taken while in cache */
      sq_rows ctx = {g, u, eps1};
      return dopt_rc_begin_rows(&f->rc, u, pc, a->red, make_sq_rows, &ctx);
    }
    for (size_t i = 0; i < n; i++) u[i] = dopt_sq_eps_elem(g[i], eps1);
    for (size_t i = 0; i < n; i++) { /* 1-D: the unfactored second moment (row is v), then stage 2's ‖U‖² */
      row[i] = dopt_ema_elem(row[i], b, omb, u[i]);
      u[i] = dopt_unfactored_elem(row[i], g[i]);
    }
    return dopt_ss_begin(f->uss, u, n, a->red);
  case 1:
    DOPT_TRY(dopt_ss_accum(f->pss, w, nw, a->red));
    return dopt_rc_accum(&f->rc, u, pc, a->red);
  case 2:
    if (!pc->factored) { /* 1-D: stage 1's words and stage 3's together */
      DOPT_TRY(dopt_ss_accum(f->pss, w, nw, a->red));
      return dopt_ss_accum(f->uss, u, n, a->red);
    }
    dopt_rc_means(&f->rc, pc, f->rmean, f->cmean);
    for (size_t i = 0; i < pc->b * pc->h; i++) row[i] = dopt_ema_elem(row[i], b, omb, f->rmean[i]);
    for (size_t i = 0; i < pc->b * pc->w; i++) col[i] = dopt_ema_elem(col[i], b, omb, f->cmean[i]);
    float um = 0.0f; /* max |U| of the rows as they are written */
    DOPT_TRY(dopt_piece_factored_apply(row, col, g, pc, u, &um));
    return dopt_ss_begin_absmax(f->uss, um, a->red);
  default: /* 3 */
    return dopt_ss_accum(f->uss, u, n, a->red);
  }
}

/* Finalisation: the means over the logical extents (in the stage after the SUM). */
void dopt_rc_means(const dopt_rc_stat *s, const dopt_piece *pc, float *row_mean, float *col_mean) {
  const size_t nr = pc->b * pc->h, nc = pc->b * pc->w;
  for (size_t i = 0; i < nr; i++) row_mean[i] = dopt_mean_elem(dopt_xacc_value(&s->acc[i], s->scale[i]), (double)pc->w);
  for (size_t i = 0; i < nc; i++)
    col_mean[i] = dopt_mean_elem(dopt_xacc_value(&s->acc[nr + i], s->scale[nr + i]), (double)pc->h);
}

dopt_status dopt_piece_factored_apply(const float *row, const float *col, const float *x, const dopt_piece *pc,
                                      float *out, float *absmax) {
  float *rmean = malloc(pc->b * sizeof *rmean);
  float *cf = malloc((pc->wl ? pc->wl : 1) * sizeof *cf);
  if (!rmean || !cf) {
    free(rmean);
    free(cf);
    return dopt__fail(DOPT_ERR_NO_MEMORY, "factored update: %zu column factors", pc->wl);
  }
  /* normaliser: mean of the (whole) row statistic over the h rows of each batch */
  for (size_t bi = 0; bi < pc->b; bi++) rmean[bi] = dopt_mean_elem(dopt_xsum(row + bi * pc->h, pc->h), (double)pc->h);
  piece_block blk;
  size_t k = pc->lo;
  while (next_block(pc, &k, &blk)) {
    size_t r0 = blk_row(pc, &blk), c0 = blk_col(pc, &blk);
    for (size_t j = 0; j < blk.cols; j++) cf[j] = dopt_rsqrt_elem(col[c0 + j]);
    for (size_t r = 0; r < blk.rows; r++) {
      const float rf = dopt_row_factor(row[r0 + r], rmean[blk.bi]);
      const float *xr = x + blk.off + r * blk.cols;
      float *orow = out + blk.off + r * blk.cols;
      for (size_t j = 0; j < blk.cols; j++) orow[j] = dopt_factored_elem(rf, cf[j], xr[j]);
      if (absmax) *absmax = dopt_absmax_tile(*absmax, orow, blk.cols);
    }
  }
  free(rmean);
  free(cf);
  return DOPT_OK;
}
