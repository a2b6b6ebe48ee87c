/* Internal fast paths of the exact sums (core/xsum.c). Every function here
 * adds exactly the integer total (hi·2^32 + lo, and the NaN/+inf/-inf
 * counts) and the maxima of the straightforward per-element definition in
 * include/distopt/xsum.h:
 *   q = (int64_t)rint(x·scale);  lo = q mod 2^32 as a signed value in [-2^31, 2^31);
 *   hi += (q - lo) / 2^32;  acc lo += lo,
 * non-finite x counted in the NaN/+inf/-inf words; the split of a tie
 * (q ≡ 2^31 mod 2^32) between the two words may differ (core/xsum.c), which
 * no value read from the words can see. tests/unit/test_xsum_fast.c checks
 * the carry-normalised words bitwise against a scalar transcription of that
 * definition. The column scratch holds hi·2^32 (multiples of 2^32). */
#ifndef DISTOPT_XSUM_FAST_H
#define DISTOPT_XSUM_FAST_H

#include <stddef.h>

#include "distopt/xsum.h"

/* acc += x[0..n) (contiguous), squared first if sq (x² exact in double). */
void dopt__xacc_add_run(dopt_xacc *acc, double scale, const float *x, size_t n, int sq);

/* Column sums a row at a time, in double scratch sh[n], sl[n] (exact integers
 * while at most DOPT__COLSUM_ROWS rows are added between flushes): adds the
 * words of x[j] at scale cs[j] for j < n and returns 0; returns 1 and adds
 * nothing when a value is not finite (the caller adds that row per element
 * with dopt_xacc_add); returns -1 when |x[j]·cs[j]| >= 2^63 for some j (a
 * scale smaller than the data's own maximum asks for: the scratch is spoilt). */
#define DOPT__COLSUM_ROWS ((size_t)1 << 18)
int dopt__colsum_row(double *sh, double *sl, const double *cs, const float *x, size_t n);
/* cacc[j] += the scratch's words (wrapping, as per-element int64 additions); zeroes the scratch */
void dopt__colsum_flush(dopt_xacc *cacc, double *sh, double *sl, size_t n);

/* Largest finite |x[i]| of a contiguous run as float (0 when none). */
float dopt__absmax_run(const float *x, size_t n);

/* Row and column maxima of finite |r[j]|: returns the row max, and
 * cmax[j] = max(cmax[j], |r[j]|) (float). */
float dopt__absmax_row_cols(const float *r, size_t w, float *cmax);

#endif
