/* Numerics shared by Adafactor and CAME: exact row/column statistics of a
 * [b, h, w] tensor (leading dims folded into b) and the factored
 * second-moment approximation. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "optim_impl.h"
#include "xsum_fast.h"

float dopt_rms_from_ss(double ss, size_t n) {
  float norm = (float)sqrt(ss);
  return norm / (float)sqrt((double)n);
}

void dopt_factored_state_defs(const char *row_name, const char *col_name, int ndim, const int64_t *shape,
                              dopt_state_view *out, int *n) {
  int64_t col[DOPT_MAX_DIMS];
  for (int i = 0; i < ndim - 2; i++) col[i] = shape[i];
  col[ndim - 2] = shape[ndim - 1];
  dopt_state_def(&out[(*n)++], row_name, ndim - 1, shape);
  dopt_state_def(&out[(*n)++], col_name, ndim - 1, col);
}

size_t dopt_factored_scratch(int ndim, const int64_t *shape) {
  size_t numel = dopt_numel(ndim, shape);
  if (ndim < 2) return numel;
  size_t b, h, w;
  dopt_split_bhw(ndim, shape, &b, &h, &w);
  return numel + b * h + b * w; /* U, mean_w(U), mean_h(U) */
}

double dopt_sumsq(const float *x, size_t n) { return dopt_xsum_sq(x, n); }

void dopt_rowcol_absmax(const float *u, size_t b, size_t h, size_t w, double *rmax, double *cmax) {
  float *cm = malloc((w ? w : 1) * sizeof *cm);
  for (size_t k = 0; k < b; k++) {
    double *cmk = cmax + k * w;
    if (!cm) { /* no scratch: the per-element definition */
      for (size_t j = 0; j < w; j++) cmk[j] = 0.0;
      for (size_t i = 0; i < h; i++) {
        const float *r = u + (k * h + i) * w;
        float m = 0.0f;
        for (size_t j = 0; j < w; j++) {
          float a = fabsf(r[j]);
          if (!(a <= 3.4028234664e38f)) continue; /* non-finite: counted in phase 2 */
          m = a > m ? a : m;
          cmk[j] = (double)a > cmk[j] ? (double)a : cmk[j];
        }
        rmax[k * h + i] = (double)m;
      }
      continue;
    }
    /* float maxima (exact; the double conversion is monotone) */
    for (size_t j = 0; j < w; j++) cm[j] = 0.0f;
    for (size_t i = 0; i < h; i++) rmax[k * h + i] = (double)dopt__absmax_row_cols(u + (k * h + i) * w, w, cm);
    for (size_t j = 0; j < w; j++) cmk[j] = (double)cm[j];
  }
  free(cm);
}

void dopt_rowcol_accum(const float *u, size_t b, size_t h, size_t w, const double *rscale,
                       const double *cscale, dopt_xacc *racc, dopt_xacc *cacc) {
  double *ws = malloc((w ? 2 * w : 1) * sizeof *ws); /* NULL: slow path */
  for (size_t k = 0; k < b; k++) {
    const float *uk = u + k * h * w;
    for (size_t i = 0; i < h; i++) dopt__xacc_add_run(racc + k * h + i, rscale[k * h + i], uk + i * w, w, 0);
    dopt__xacc_add_cols_block(cacc + k * w, cscale + k * w, uk, h, w, ws);
  }
  free(ws);
}

dopt_status dopt_row_col_means(const float *u, size_t b, size_t h, size_t w, float *row_mean,
                               float *col_mean) {
  size_t nr = b * h, nc = b * w;
  double *scale = malloc((nr + nc) * sizeof *scale);
  dopt_xacc *acc = calloc(nr + nc, sizeof *acc);
  if (!scale || !acc) {
    free(scale);
    free(acc);
    return dopt__fail(DOPT_ERR_NO_MEMORY, "row/column statistics: %zu accumulators", nr + nc);
  }
  dopt_rowcol_absmax(u, b, h, w, scale, scale + nr);
  for (size_t i = 0; i < nr + nc; i++) scale[i] = dopt_xsum_scale(scale[i]);
  dopt_rowcol_accum(u, b, h, w, scale, scale + nr, acc, acc + nr);
  for (size_t i = 0; i < nr; i++) row_mean[i] = (float)(dopt_xacc_value(&acc[i], scale[i]) / (double)w);
  for (size_t i = 0; i < nc; i++)
    col_mean[i] = (float)(dopt_xacc_value(&acc[nr + i], scale[nr + i]) / (double)h);
  free(scale);
  free(acc);
  return DOPT_OK;
}

dopt_status dopt_factored_apply(const float *row, const float *col, const float *x, size_t b, size_t h,
                                size_t w, float *out) {
  float *cf = malloc(w * sizeof *cf);
  if (!cf) return dopt__fail(DOPT_ERR_NO_MEMORY, "factored update: %zu column factors", w);
  for (size_t k = 0; k < b; k++) {
    const float *rk = row + k * h;
    /* normaliser: mean of the row statistic over the h rows of this batch */
    float rmean = (float)(dopt_xsum(rk, h) / (double)h);
    for (size_t j = 0; j < w; j++) cf[j] = 1.0f / sqrtf(col[k * w + j]);
    for (size_t i = 0; i < h; i++) {
      float rf = 1.0f / sqrtf(rk[i] / rmean);
      const float *xr = x + (k * h + i) * w;
      float *orow = out + (k * h + i) * w;
      for (size_t j = 0; j < w; j++) orow[j] = (rf * cf[j]) * xr[j];
    }
  }
  free(cf);
  return DOPT_OK;
}
