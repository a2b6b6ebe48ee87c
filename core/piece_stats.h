/* Exact statistics of a piece (core/stats.c): the cross-element statistics an
 * optimizer step needs (Σx², row and column means, the factored second moment
 * of Adafactor and CAME) computed in fixed-point words (distopt/xsum.h) and
 * reduced over the pieces of a tensor through the step's reducer in two
 * phases, so a sharded step gives the single device's bits; with the step
 * frame's bump allocator they live in, and the run generators that feed them
 * without a piece-sized buffer. The step interface they serve is
 * core/optim_impl.h, which includes this header. */
#ifndef DISTOPT_PIECE_STATS_H
#define DISTOPT_PIECE_STATS_H

#include <stddef.h>
#include <stdint.h>

#include "distopt/device.h"
#include "distopt/status.h"
#include "distopt/xsum.h"

struct dopt_step_args; /* core/optim_impl.h */

/* ---- exact statistics of a piece (core/stats.c) --------------------------------------
 * Each statistic is reduced in two phases, each a stage boundary of the step:
 * _begin computes the local maxima and posts them (MAX), _accum turns them
 * into the shared scales, accumulates the local fixed-point words and posts
 * them (SUM), and the value is read in the next stage. The state lives in the
 * step's frame (dopt_frame_take); with red = NULL the three calls may follow
 * each other directly. */

/* A bump allocator over a step's frame: the same sequence of takes sizes the
 * frame (base NULL: only counts, returns NULL) and maps it. 16-byte aligned. */
typedef struct dopt_frame {
  unsigned char *base;
  size_t off;
} dopt_frame;
void *dopt_frame_take(dopt_frame *f, size_t bytes);

/* RMS as upstream computes it from a sum of squares ss over n elements:
 * fp32 norm, then divided by fp32 sqrt(n). */
float dopt_rms_from_ss(double ss, size_t n);

/* Σx² over a piece's n local elements. */
typedef struct dopt_ss_stat {
  double m;       /* max of the squares (after _begin's MAX: over all ranks) */
  dopt_xacc acc;  /* fixed-point words (after _accum's SUM: over all ranks) */
} dopt_ss_stat;
dopt_status dopt_ss_begin(dopt_ss_stat *s, const float *x, size_t n, const dopt_reducer *red);
/* _begin from the largest finite |x| of the piece, when a loop that wrote x
 * took it tile by tile (dopt_absmax_tile) instead of reading x again */
dopt_status dopt_ss_begin_absmax(dopt_ss_stat *s, float absmax, const dopt_reducer *red);
/* max(m, largest finite |x[i]| of n): the maxima of tiles combine exactly */
float dopt_absmax_tile(float m, const float *x, size_t n);
dopt_status dopt_ss_accum(dopt_ss_stat *s, const float *x, size_t n, const dopt_reducer *red);
double dopt_ss_value(const dopt_ss_stat *s);

/* ---- generated runs ----
 * A statistic's values produced run by run instead of read from a piece-sized
 * buffer: gen writes the values of the local elements [off, off+len) (one run
 * inside one local row: logical row r of the b·h rows, logical column c of
 * the b·w columns at its first element; len <= DOPT_RUN) into buf and returns
 * buf, or returns where they already lie. use consumes one run. */
#define DOPT_RUN 2048
typedef const float *(*dopt_gen_fn)(void *ctx, size_t off, size_t r, size_t c, size_t len, float *buf);
typedef void (*dopt_use_fn)(void *ctx, const float *x, size_t off, size_t r, size_t c, size_t len);
/* every run of the piece, in order: use(gen(run)), or use(NULL) without gen */
void dopt_piece_gen_each(const dopt_piece *pc, dopt_gen_fn gen, void *gctx, dopt_use_fn use, void *uctx);
/* gen of a materialised array: ctx is the piece's const float[len] */
const float *dopt_gen_array(void *ctx, size_t off, size_t r, size_t c, size_t len, float *buf);
/* gen of the factored update (HF _approx_sq_grad) times x: (rf[r]·cf[c])·x */
typedef struct dopt_fact_gen {
  const float *rf, *cf, *x; /* [b·h], [b·w] (dopt_factors), the piece's [len] */
} dopt_fact_gen;
const float *dopt_gen_factored(void *ctx, size_t off, size_t r, size_t c, size_t len, float *buf);
/* the largest finite |value| generated */
float dopt_gen_absmax(const dopt_piece *pc, dopt_gen_fn gen, void *gctx);
/* dopt_ss_accum of the generated values */
dopt_status dopt_ss_accum_gen(dopt_ss_stat *s, const dopt_piece *pc, dopt_gen_fn gen, void *gctx,
                              const dopt_reducer *red);

/* Row and column means of U over the logical [b, h, w], U given as the
 * piece's local elements (or generated): row_mean[b·h] = Σ_w U / w,
 * col_mean[b·w] = Σ_h U / h (fp32), identical on every rank. Each phase reads
 * U once (rows and columns together). */
typedef struct dopt_rc_stat {
  double *scale;  /* [b·h + b·w]: maxima, then scales */
  dopt_xacc *acc; /* [b·h + b·w] */
} dopt_rc_stat;
void dopt_rc_take(dopt_frame *f, const dopt_piece *pc, dopt_rc_stat *out);
dopt_status dopt_rc_begin(dopt_rc_stat *s, const float *u, const dopt_piece *pc, const dopt_reducer *red);
dopt_status dopt_rc_begin_gen(dopt_rc_stat *s, const dopt_piece *pc, const dopt_reducer *red, dopt_gen_fn gen,
                              void *gctx);
dopt_status dopt_rc_accum(dopt_rc_stat *s, const float *u, const dopt_piece *pc, const dopt_reducer *red);
dopt_status dopt_rc_accum_gen(dopt_rc_stat *s, const dopt_piece *pc, const dopt_reducer *red, dopt_gen_fn gen,
                              void *gctx);
void dopt_rc_means(const dopt_rc_stat *s, const dopt_piece *pc, float *row_mean, float *col_mean);

/* Σx² per segment: the logical flattened tensor cut into nseg segments of S consecutive elements (Adam-mini's
 * heads and neurons, one segment for the whole tensor), x given as the piece's local elements; two phases as
 * dopt_ss_* (MAX of each segment's largest square, then SUM of its words), every rank posting all nseg segments,
 * so the sums are identical on every rank whatever the pieces. */
typedef struct dopt_seg_stat {
  size_t S, nseg;
  double *m;      /* [nseg] max of the squares */
  dopt_xacc *acc; /* [nseg] */
} dopt_seg_stat;
/* Maps (f->base NULL: sizes) the arrays of nseg = numel / S segments. */
void dopt_seg_take(dopt_frame *f, size_t numel, size_t S, dopt_seg_stat *out);
dopt_status dopt_seg_begin(dopt_seg_stat *s, const float *x, const dopt_piece *pc, const dopt_reducer *red);
dopt_status dopt_seg_accum(dopt_seg_stat *s, const float *x, const dopt_piece *pc, const dopt_reducer *red);
double dopt_seg_value(const dopt_seg_stat *s, size_t k);
/* The piece's local elements cut at segment boundaries (segments of S logical elements): fn(ctx, k, off, n) for
 * each part, local [off, off + n) of segment k, in order. The statistics above and a step that applies a
 * per-segment value (Adam-mini's update) walk the same parts. */
void dopt_seg_parts(size_t S, const dopt_piece *pc, void (*fn)(void *ctx, size_t k, size_t off, size_t n), void *ctx);

/* The frame of the update-norm steps (Adafactor, CAME, LAMB): Σw² and Σu²;
 * with row/column statistics on a factored piece (Adafactor and CAME) their
 * means, reduction and factors, the update being generated from them (no
 * piece-sized buffer); otherwise the update u [len]. */
typedef struct dopt_update_frame {
  dopt_ss_stat *pss, *uss;
  float *u;             /* [len] (not rowcol, or not factored) */
  float *rmean, *cmean; /* [b·h], [b·w] (rowcol and factored) */
  float *rf, *cf;       /* [b·h], [b·w]: the factors of dopt_factors (rowcol and factored) */
  dopt_rc_stat rc;      /* (rowcol and factored) */
} dopt_update_frame;
/* Maps the frame at base (NULL: only sizes it); returns its bytes. */
size_t dopt_update_frame_map(void *base, const dopt_piece *pc, int rowcol, dopt_update_frame *f);
/* impl->frame of the steps with / without row-column statistics */
size_t dopt_update_frame_rowcol(const double *hp, const dopt_piece *pc);
size_t dopt_update_frame_norms(const double *hp, const dopt_piece *pc);

/* Stages 0-3 of the steps that precondition with a (factored) second moment,
 * Adafactor's and CAME's: stage 0 posts the maxima of ‖w‖² and of the row and
 * column sums of U = G² + eps1, stage 1 their words, stage 2 updates
 * row/col ← b·stat + omb·mean, sets the factors f->rf, f->cf of
 * U = factored(row, col) ⊙ G and posts the maximum of ‖U‖², stage 3 its
 * words; after stage 3, f->pss and f->uss hold ‖w‖² and ‖U‖², and U is
 * generated by dopt_gen_factored from {f->rf, f->cf, G}. U = G² + eps1 and
 * the update are generated where a stage reads them: the gradient is read
 * once per stage, nothing piece-sized is written. A 1-D piece keeps the
 * unfactored v in row (col NULL) and U in f->u, and runs stages 0 and 2 only,
 * as the callers number them (their 1-D stage k is stage 2k here). */
dopt_status dopt_second_moment_stage(const struct dopt_step_args *a, int stage, dopt_update_frame *f,
                                     float *row, float *col, float b, float omb, float eps1);

/* The factors of the factored second-moment approximation (HF
 * _approx_sq_grad) of the whole row [b·h] and column [b·w] statistics:
 * rf = rsqrt(row / rmean[b]) with rmean[b] the mean of batch b's rows (exact
 * sum / h), cf = rsqrt(col). */
void dopt_factors(const float *row, const float *col, const dopt_piece *pc, float *rf, float *cf);

/* Exact sum of squares of a local array x[n] (double). */
double dopt_sumsq(const float *x, size_t n);

#endif
