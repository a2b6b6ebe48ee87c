/* distopt — the data-parallel gradient sum that no reduction order can change
 * (docs/dp-sum.md).
 *
 * Each data-parallel rank holds its accumulated gradient of a tensor; the
 * step needs their sum. A floating-point sum depends on the order in which a
 * collective combines the ranks (NCCL's ring and tree orders change with the
 * channel count and the message size). Here every rank's values are first
 * rounded to integers on a fixed-point grid that all ranks share, the integers
 * are summed with the transport's integer SUM (associative: any algorithm,
 * order or channel count gives the same words), and the integer total is
 * rounded to fp32 once.
 *
 * Grid. The logical tensor (row-major, flat index k) is cut in blocks of
 * DOPT_GRID_BLOCK elements (block k / DOPT_GRID_BLOCK), independent of any
 * layout. A block's code c is the largest fp32 exponent field of its finite
 * elements over every rank (0: all zero; subnormals count as 1), combined by
 * a MAX collective; every finite element of the block satisfies
 * |x| < 2^e, e = max(c, 1) − 126. With n contributions, h = ⌈log2 n⌉ bits of
 * headroom and K = 62 − h, an element becomes v = rint(x · 2^(W·K − e)),
 * |v| < 2^(W·K), stored in W int64 words:
 *   W = 1: v;
 *   W = 2: v = hi·2^K + lo with hi = trunc(v / 2^K), lo the remainder (same sign).
 * Each word of n contributions sums to less than 2^62 in magnitude. The
 * summed words give the exact integer total Q (up to 126 bits) and the
 * result is Q · 2^(e − W·K) rounded once to fp32, nearest-even (overflow: ±inf).
 *
 * Precision. An element whose exponent is within W·K − 24 of its block's top
 * exponent is on the grid, so its contribution is exact: with W = 1 every
 * element within 2^(38−h) of its block's largest, with W = 2 within 2^(100−2h)
 * (dp = 8: 2^35 and 2^94).
 * Smaller elements are rounded to the nearest grid point (error ≤ 2^(e−W·K−1)
 * each); the final fp32 rounding is the only other one.
 *
 * Non-finite values. NaN and ±inf take no part in the grid; if any rank has
 * one in a tensor, a second integer SUM counts, per element, the NaN, +inf and
 * −inf contributions (packed in one int64, 21 bits each): an element with a
 * NaN or both infinities is the canonical NaN 0x7fc00000, one kind of
 * infinity gives that infinity, others are the exact finite sum.
 *
 * One contribution (n = 1) is returned unchanged (no grid). */
#ifndef DISTOPT_DPSUM_H
#define DISTOPT_DPSUM_H

#include <stddef.h>
#include <stdint.h>

#include "distopt/export.h"
#include "distopt/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DOPT_GRID_BLOCK 256
#define DOPT_DP_SUM_WORDS_MAX 2
#define DOPT_DP_SUM_MAX_PARTS (1 << 18) /* 21-bit class counts; h ≤ 18 */

/* The dp-sum modes: 0 = the fp32 sum in rank order ((x0 + x1) + x2) + ...
 * (kept for comparison; bitwise only with a transport that sums in rank
 * order), 1 or 2 = the exact sum with that many int64 words per element. */
#define DOPT_DP_SUM_RANK_ORDER 0
#define DOPT_DP_SUM_DEFAULT_WORDS 1

/* The number of logical blocks of a tensor of numel elements. */
DOPT_API size_t dopt_grid_blocks(size_t numel);

/* out[numel] = the sum of parts[0..nparts)[numel] (logical, whole tensors) in
 * the given mode — what the distributed step computes across dp ranks. out
 * may alias no part. Errors: nparts outside [1, DOPT_DP_SUM_MAX_PARTS], words
 * outside [0, 2], NULL pointers. */
DOPT_API dopt_status dopt_dp_sum(const float *const *parts, int nparts, int words, size_t numel, float *out);

#ifdef __cplusplus
}
#endif
#endif
