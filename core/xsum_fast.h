/* Internal fast paths of the exact sums (core/xsum.c). Every function here
 * produces exactly the accumulator words (and maxima) of the straightforward
 * per-element definition in include/distopt/xsum.h:
 *   q = (int64_t)rint(x·scale);  lo = q mod 2^32 as a signed value in [-2^31, 2^31);
 *   hi += (q - lo) / 2^32;  acc lo += lo,
 * non-finite x counted in the NaN/+inf/-inf words. tests/unit/test_xsum_fast.c
 * checks them bitwise against a scalar transcription of that definition. */
#ifndef DISTOPT_XSUM_FAST_H
#define DISTOPT_XSUM_FAST_H

#include <stddef.h>

#include "distopt/xsum.h"

/* acc += x[0..n) (contiguous), squared first if sq (x² exact in double). */
void dopt__xacc_add_run(dopt_xacc *acc, double scale, const float *x, size_t n, int sq);

/* Column sums of a row-major [rows, w] block: cacc[j] += u[i, j] with scale
 * cscale[j] for every row i. ws: 2·w doubles of scratch (NULL: slow path). */
void dopt__xacc_add_cols_block(dopt_xacc *cacc, const double *cscale, const float *u, size_t rows, size_t w,
                               double *ws);

/* Largest finite |x[i]| of a contiguous run as float (0 when none). */
float dopt__absmax_run(const float *x, size_t n);

/* Row and column maxima of finite |r[j]|: returns the row max, and
 * cmax[j] = max(cmax[j], |r[j]|) (float). */
float dopt__absmax_row_cols(const float *r, size_t w, float *cmax);

#endif
