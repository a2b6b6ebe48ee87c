/* Exact statistics of a piece of a logical [b, h, w] tensor (see
 * distopt/device.h): the sums of squares, row/column means and factored
 * update shared by Adafactor, CAME and LAMB, each in the two reduction phases
 * of a staged step (core/optim_impl.h); declared in core/piece_stats.h. The
 * whole tensor is the piece with h0 = w0 = lo = 0; a distributed rank passes
 * its shard and a reducer, and gets bitwise the same statistics. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "elem.h"
#include "optim_impl.h"
#include "piece_stats.h"
#include "twice.h"
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

void dopt_seg_take(dopt_frame *f, size_t numel, size_t S, dopt_seg_stat *out) {
  out->S = S ? S : 1;
  out->nseg = numel / out->S;
  out->m = dopt_frame_take(f, (out->nseg ? out->nseg : 1) * sizeof *out->m);
  out->acc = dopt_frame_take(f, (out->nseg ? out->nseg : 1) * sizeof *out->acc);
}

void dopt_seg_parts(size_t S, const dopt_piece *pc, void (*fn)(void *ctx, size_t k, size_t off, size_t n), void *ctx) {
  size_t off = 0;
  dopt_run run;
  while (dopt_piece_next_run(pc, &off, &run)) { /* local [run.off, +len) lies at logical [run.at, +len) */
    for (size_t j = 0; j < run.len;) {
      const size_t at = run.at + j, k = at / S, left = (k + 1) * S - at;
      const size_t n = left < run.len - j ? left : run.len - j;
      fn(ctx, k, run.off + j, n);
      j += n;
    }
  }
}

typedef struct seg_ctx {
  dopt_seg_stat *s;
  const float *x;
} seg_ctx;
static void seg_max(void *ctx, size_t k, size_t off, size_t n) {
  const seg_ctx *c = ctx;
  const double a = (double)dopt__absmax_run(c->x + off, n);
  if (a * a > c->s->m[k]) c->s->m[k] = a * a; /* exact in double */
}
static void seg_words(void *ctx, size_t k, size_t off, size_t n) {
  const seg_ctx *c = ctx;
  dopt_xacc_add_sq_n(&c->s->acc[k], dopt_xsum_scale(c->s->m[k]), c->x + off, n);
}

dopt_status dopt_seg_begin(dopt_seg_stat *s, const float *x, const dopt_piece *pc, const dopt_reducer *red) {
  for (size_t k = 0; k < s->nseg; k++) s->m[k] = 0.0;
  seg_ctx c = {s, x};
  dopt_seg_parts(s->S, pc, seg_max, &c);
  return red ? red->post_max_f64(red->ctx, s->m, s->nseg) : DOPT_OK;
}

dopt_status dopt_seg_accum(dopt_seg_stat *s, const float *x, const dopt_piece *pc, const dopt_reducer *red) {
  memset(s->acc, 0, s->nseg * sizeof *s->acc);
  seg_ctx c = {s, x};
  dopt_seg_parts(s->S, pc, seg_words, &c);
  return red ? red->post_sum_i64(red->ctx, &s->acc[0].w[0], s->nseg * DOPT_XSUM_WORDS) : DOPT_OK;
}

double dopt_seg_value(const dopt_seg_stat *s, size_t k) { return dopt_xacc_value(&s->acc[k], dopt_xsum_scale(s->m[k])); }

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

/* ---- generated runs -------------------------------------------------------------------
 * The statistics below read their values run by run from a generator (a few
 * KiB in cache) rather than from a piece-sized buffer: the optimizers produce
 * U from the gradient each time a stage needs it, so a stage reads the
 * gradient instead of writing U and reading it back. */

const float *dopt_gen_array(void *ctx, size_t off, size_t r, size_t c, size_t len, float *buf) {
  (void)r, (void)c, (void)len, (void)buf;
  return (const float *)ctx + off;
}

DOPT_BODY const float *dopt_gen_factored_body(void *ctx, size_t off, size_t r, size_t c, size_t len, float *buf) {
  const dopt_fact_gen *g = ctx;
  const float rf = g->rf[r], *cf = g->cf + c, *x = g->x + off;
  for (size_t j = 0; j < len; j++) buf[j] = dopt_factored_elem(rf, cf[j], x[j]);
  return buf;
}
DOPT_TWICE(, const float *, dopt_gen_factored, (void *ctx, size_t off, size_t r, size_t c, size_t len, float *buf),
           (ctx, off, r, c, len, buf))

void dopt_piece_gen_each(const dopt_piece *pc, dopt_gen_fn gen, void *gctx, dopt_use_fn use, void *uctx) {
  float buf[DOPT_RUN];
  piece_block blk;
  size_t k = pc->lo;
  while (next_block(pc, &k, &blk)) {
    const size_t r0 = blk_row(pc, &blk), c0 = blk_col(pc, &blk);
    for (size_t r = 0; r < blk.rows; r++)
      for (size_t j = 0; j < blk.cols; j += DOPT_RUN) {
        const size_t len = blk.cols - j < DOPT_RUN ? blk.cols - j : DOPT_RUN, off = blk.off + r * blk.cols + j;
        use(uctx, gen ? gen(gctx, off, r0 + r, c0 + j, len, buf) : NULL, off, r0 + r, c0 + j, len);
      }
  }
}

static void use_absmax(void *ctx, const float *x, size_t off, size_t r, size_t c, size_t len) {
  (void)off, (void)r, (void)c;
  float *m = ctx;
  *m = dopt_absmax_tile(*m, x, len);
}

float dopt_gen_absmax(const dopt_piece *pc, dopt_gen_fn gen, void *gctx) {
  float m = 0.0f;
  dopt_piece_gen_each(pc, gen, gctx, use_absmax, &m);
  return m;
}

typedef struct ss_use {
  dopt_xacc *acc;
  double scale;
} ss_use;
static void use_sumsq(void *ctx, const float *x, size_t off, size_t r, size_t c, size_t len) {
  (void)off, (void)r, (void)c;
  const ss_use *u = ctx;
  dopt_xacc_add_sq_n(u->acc, u->scale, x, len);
}

dopt_status dopt_ss_accum_gen(dopt_ss_stat *s, const dopt_piece *pc, dopt_gen_fn gen, void *gctx,
                              const dopt_reducer *red) {
  memset(&s->acc, 0, sizeof s->acc);
  ss_use u = {&s->acc, dopt_xsum_scale(s->m)};
  dopt_piece_gen_each(pc, gen, gctx, use_sumsq, &u);
  return red ? red->post_sum_i64(red->ctx, s->acc.w, DOPT_XSUM_WORDS) : DOPT_OK;
}

/* Phase 1: row and column maxima of |U| (float maxima are exact; the
 * conversion to double is monotone), posted for MAX. */
typedef struct rc_max_use {
  double *rmax;
  float *cmax;
} rc_max_use;
static void use_rc_max(void *ctx, const float *x, size_t off, size_t r, size_t c, size_t len) {
  (void)off;
  const rc_max_use *u = ctx;
  const double m = (double)dopt__absmax_row_cols(x, len, u->cmax + c);
  u->rmax[r] = m > u->rmax[r] ? m : u->rmax[r];
}

dopt_status dopt_rc_begin_gen(dopt_rc_stat *s, const dopt_piece *pc, const dopt_reducer *red, dopt_gen_fn gen,
                              void *gctx) {
  const size_t nr = pc->b * pc->h, nc = pc->b * pc->w;
  float *cmax = calloc(nc ? nc : 1, sizeof *cmax);
  if (!cmax) return dopt__fail(DOPT_ERR_NO_MEMORY, "row/column statistics: %zu column maxima", nc);
  double *scale = s->scale;
  for (size_t r = 0; r < nr; r++) scale[r] = 0.0;
  rc_max_use u = {scale, cmax};
  dopt_piece_gen_each(pc, gen, gctx, use_rc_max, &u);
  for (size_t c = 0; c < nc; c++) scale[nr + c] = (double)cmax[c];
  free(cmax);
  return red ? red->post_max_f64(red->ctx, scale, nr + nc) : DOPT_OK;
}

dopt_status dopt_rc_begin(dopt_rc_stat *s, const float *u, const dopt_piece *pc, const dopt_reducer *red) {
  return dopt_rc_begin_gen(s, pc, red, dopt_gen_array, (void *)u);
}

/* Phase 2: the shared scales and the fixed-point row and column sums, posted
 * for SUM. One pass: each run adds to its row's words and to its columns'
 * double scratch (dopt__colsum_row), flushed into the columns' words at the
 * end of each block of rows (and every DOPT__COLSUM_ROWS rows). */
dopt_status dopt_rc_accum_gen(dopt_rc_stat *s, const dopt_piece *pc, const dopt_reducer *red, dopt_gen_fn gen,
                              void *gctx) {
  const size_t nr = pc->b * pc->h, nacc = nr + pc->b * pc->w;
  double *ws = calloc(pc->wl ? 2 * pc->wl : 1, sizeof *ws); /* column scratch: hi, lo words */
  if (!ws) return dopt__fail(DOPT_ERR_NO_MEMORY, "row/column statistics: %zu columns", pc->wl);
  double *sh = ws, *sl = ws + pc->wl;
  double *scale = s->scale;
  dopt_xacc *acc = s->acc;
  for (size_t i = 0; i < nacc; i++) scale[i] = dopt_xsum_scale(scale[i]);
  memset(acc, 0, nacc * sizeof *acc);
  float buf[DOPT_RUN];
  piece_block blk;
  size_t k = pc->lo;
  int bad = 0;
  while (!bad && next_block(pc, &k, &blk)) {
    const size_t r0 = blk_row(pc, &blk), c0 = blk_col(pc, &blk);
    for (size_t r = 0; r < blk.rows && !bad; r++) {
      for (size_t j = 0; j < blk.cols; j += DOPT_RUN) {
        const size_t len = blk.cols - j < DOPT_RUN ? blk.cols - j : DOPT_RUN, c = c0 + j;
        const float *x = gen(gctx, blk.off + r * blk.cols + j, r0 + r, c, len, buf);
        dopt__xacc_add_run(&acc[r0 + r], scale[r0 + r], x, len, 0);
        const int st = dopt__colsum_row(sh + j, sl + j, scale + nr + c, x, len);
        if (st < 0) bad = 1;
        for (size_t t = 0; st > 0 && t < len; t++) dopt_xacc_add(&acc[nr + c + t], scale[nr + c + t], (double)x[t]);
      }
      if ((r + 1) % DOPT__COLSUM_ROWS == 0 || r + 1 == blk.rows) dopt__colsum_flush(acc + nr + c0, sh, sl, blk.cols);
    }
  }
  free(ws);
  if (bad)
    return dopt__fail(DOPT_ERR_STATE, "row/column statistics: a column's scale is below its own maximum (the MAX "
                      "reduction before the sums lost a value)");
  return red ? red->post_sum_i64(red->ctx, &acc[0].w[0], nacc * DOPT_XSUM_WORDS) : DOPT_OK;
}

dopt_status dopt_rc_accum(dopt_rc_stat *s, const float *u, const dopt_piece *pc, const dopt_reducer *red) {
  return dopt_rc_accum_gen(s, pc, red, dopt_gen_array, (void *)u);
}

size_t dopt_update_frame_map(void *base, const dopt_piece *pc, int rowcol, dopt_update_frame *f) {
  dopt_frame fr = {base, 0};
  memset(f, 0, sizeof *f);
  f->pss = dopt_frame_take(&fr, sizeof *f->pss);
  f->uss = dopt_frame_take(&fr, sizeof *f->uss);
  if (rowcol && pc->factored) { /* U is generated from the gradient run by run: no [len] buffer */
    f->rmean = dopt_frame_take(&fr, pc->b * pc->h * sizeof *f->rmean);
    f->cmean = dopt_frame_take(&fr, pc->b * pc->w * sizeof *f->cmean);
    f->rf = dopt_frame_take(&fr, pc->b * pc->h * sizeof *f->rf);
    f->cf = dopt_frame_take(&fr, pc->b * pc->w * sizeof *f->cf);
    dopt_rc_take(&fr, pc, &f->rc);
  } else {
    f->u = dopt_frame_take(&fr, pc->len * sizeof *f->u);
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

typedef struct sq_gen {
  const float *g;
  float eps1;
} sq_gen;
DOPT_BODY const float *gen_sq_body(void *ctx, size_t off, size_t r, size_t c, size_t len, float *buf) {
  (void)r, (void)c;
  const sq_gen *q = ctx;
  const float *g = q->g + off;
  for (size_t i = 0; i < len; i++) buf[i] = dopt_sq_eps_elem(g[i], q->eps1);
  return buf;
}
DOPT_TWICE(static, const float *, gen_sq, (void *ctx, size_t off, size_t r, size_t c, size_t len, float *buf),
           (ctx, off, r, c, len, buf))

dopt_status dopt_second_moment_stage(const dopt_step_args *a, int stage, dopt_update_frame *f, float *row,
                                     float *col, float b, float omb, float eps1) {
  const dopt_piece *pc = a->piece;
  const size_t n = pc->len;
  const float *g = a->grad, *w;
  size_t nw, numel_w;
  dopt_wstat(a, &w, &nw, &numel_w); /* ‖w‖²: of the piece, or of a projection wrapper's full weight */
  float *u = f->u;
  sq_gen sq = {g, eps1};
  dopt_fact_gen fg = {f->rf, f->cf, g};
  switch (stage) {
  case 0:
    DOPT_TRY(dopt_ss_begin(f->pss, w, nw, a->red));
    if (pc->factored) return dopt_rc_begin_gen(&f->rc, pc, a->red, gen_sq, &sq); /* U = G² + eps1 */
    for (size_t i = 0; i < n; i++) u[i] = dopt_sq_eps_elem(g[i], eps1);
    for (size_t i = 0; i < n; i++) { /* 1-D: the unfactored second moment (row is v), then stage 2's ‖U‖² */
      row[i] = dopt_ema_elem(row[i], b, omb, u[i]);
      u[i] = dopt_unfactored_elem(row[i], g[i]);
    }
    return dopt_ss_begin(f->uss, u, n, a->red);
  case 1:
    DOPT_TRY(dopt_ss_accum(f->pss, w, nw, a->red));
    return dopt_rc_accum_gen(&f->rc, pc, a->red, gen_sq, &sq);
  case 2:
    if (!pc->factored) { /* 1-D: stage 1's words and stage 3's together */
      DOPT_TRY(dopt_ss_accum(f->pss, w, nw, a->red));
      return dopt_ss_accum(f->uss, u, n, a->red);
    }
    dopt_rc_means(&f->rc, pc, f->rmean, f->cmean);
    for (size_t i = 0; i < pc->b * pc->h; i++) row[i] = dopt_ema_elem(row[i], b, omb, f->rmean[i]);
    for (size_t i = 0; i < pc->b * pc->w; i++) col[i] = dopt_ema_elem(col[i], b, omb, f->cmean[i]);
    dopt_factors(row, col, pc, f->rf, f->cf);
    return dopt_ss_begin_absmax(f->uss, dopt_gen_absmax(pc, dopt_gen_factored, &fg), a->red);
  default: /* 3 */
    return dopt_ss_accum_gen(f->uss, pc, dopt_gen_factored, &fg, a->red);
  }
}

/* Finalisation: the means over the logical extents (in the stage after the SUM). */
void dopt_rc_means(const dopt_rc_stat *s, const dopt_piece *pc, float *row_mean, float *col_mean) {
  const size_t nr = pc->b * pc->h, nc = pc->b * pc->w;
  for (size_t i = 0; i < nr; i++) row_mean[i] = dopt_mean_elem(dopt_xacc_value(&s->acc[i], s->scale[i]), (double)pc->w);
  for (size_t i = 0; i < nc; i++)
    col_mean[i] = dopt_mean_elem(dopt_xacc_value(&s->acc[nr + i], s->scale[nr + i]), (double)pc->h);
}

void dopt_factors(const float *row, const float *col, const dopt_piece *pc, float *rf, float *cf) {
  for (size_t bi = 0; bi < pc->b; bi++) {
    /* normaliser: mean of the (whole) row statistic over the h rows of each batch */
    const float rmean = dopt_mean_elem(dopt_xsum(row + bi * pc->h, pc->h), (double)pc->h);
    for (size_t i = 0; i < pc->h; i++) rf[bi * pc->h + i] = dopt_row_factor(row[bi * pc->h + i], rmean);
  }
  for (size_t c = 0; c < pc->b * pc->w; c++) cf[c] = dopt_rsqrt_elem(col[c]);
}
