/* distopt — exact, order- and partition-independent sums ("xsum").
 *
 * Every cross-element sum that a distributed optimizer splits across ranks
 * (row/column means, the row-mean normaliser, RMS, norms) goes through this
 * primitive, so its result does not depend on how the elements are
 * partitioned or ordered. Design (docs/exact-reductions.md):
 *
 *   1. absmax: M = max |x_i| over the finite values of the segment. Combining
 *      partial maxima is exact in any order (collective: MAX on fp64/fp32).
 *   2. accumulate: with the shared scale 2^s chosen from M (|x|·2^s < 2^62),
 *      every x_i is rounded to the integer q_i = rint(x_i·2^s) (a per-element
 *      operation, hence partition-independent) and the q_i are added as
 *      integers in two int64 words (lo = q mod 2^32 taken in [-2^31, 2^31),
 *      hi = (q - lo)/2^32).
 *      Integer addition is associative, so partial accumulators combine
 *      exactly in any order (collective: integer SUM on int64). Non-finite
 *      inputs are counted in three extra words (NaN, +inf, -inf).
 *   3. finalize: carry-normalise, convert to double, scale by 2^-s.
 *
 * Error: each q_i is within 2^-63·2^e of x_i·2^s·2^-s, where 2^(e-1) <= M < 2^e,
 * so |sum - exact| <= N·2^(e-63); for a sum of non-negative values (squares,
 * means of g²+eps) that is <= N·2^-62 relative, i.e. < 2^-30 for N < 2^32 —
 * far below fp32 epsilon. A non-negative sum with a non-zero element is never
 * rounded to zero (the largest element is represented with 62 bits).
 * Limit: at most 2^32 - 1 elements per segment in total over all ranks.
 */
#ifndef DISTOPT_XSUM_H
#define DISTOPT_XSUM_H

#include <stddef.h>
#include <stdint.h>

#include "distopt/export.h"

#ifdef __cplusplus
extern "C" {
#endif

/* int64 words in one segment accumulator: hi, lo, #NaN, #+inf, #-inf. An
 * array of accumulators is a plain int64 array of DOPT_XSUM_WORDS·nseg words,
 * ready for an integer-sum all-reduce. */
#define DOPT_XSUM_WORDS 5

typedef struct dopt_xacc {
  int64_t w[DOPT_XSUM_WORDS];
} dopt_xacc;

/* The power-of-two scale 2^s for a segment whose (global) finite absmax is M.
 * Identical on every rank given the same M. M = 0 gives 1. */
DOPT_API double dopt_xsum_scale(double absmax);

/* Adds one value (double so that exact fp32 squares can be passed). */
DOPT_API void dopt_xacc_add(dopt_xacc *acc, double scale, double x);
/* Adds n values x[i·stride]. */
DOPT_API void dopt_xacc_add_n(dopt_xacc *acc, double scale, const float *x, size_t n, size_t stride);
/* Adds n squares x[i]² (squares formed exactly in double). */
DOPT_API void dopt_xacc_add_sq_n(dopt_xacc *acc, double scale, const float *x, size_t n);
/* acc += other (what an integer-sum collective does word by word). */
DOPT_API void dopt_xacc_merge(dopt_xacc *acc, const dopt_xacc *other);
/* The sum. NaN if any NaN or both infinities were added, ±inf if one kind of
 * infinity was added, else the exact-by-construction fixed-point sum. */
DOPT_API double dopt_xacc_value(const dopt_xacc *acc, double scale);

/* Convenience for one local segment (both phases here). */
DOPT_API double dopt_xsum(const float *x, size_t n);
DOPT_API double dopt_xsum_sq(const float *x, size_t n);
/* Largest finite |x[i·stride]| (0 when none). */
DOPT_API double dopt_absmax(const float *x, size_t n, size_t stride);

#ifdef __cplusplus
}
#endif
#endif
