/* The exact data-parallel sum (include/distopt/dpsum.h): the CPU kernels over
 * a piece (used by the CPU device) and the whole-tensor sum the reference
 * steps on. Element arithmetic: core/grid.h. */
#include <stdlib.h>
#include <string.h>

#include "grid.h"
#include "internal.h"

size_t dopt_grid_blocks(size_t numel) { return (numel + DOPT_GRID_BLOCK - 1) / DOPT_GRID_BLOCK; }

/* Walks the piece's elements in storage order with their logical index (no
 * division per element: a row of the TP block is contiguous in the logical
 * tensor). body(j, k): j from 0 (element lo), k logical. */
#define FOR_PIECE(pc, j, k, body)                                                      \
  do {                                                                                 \
    if ((pc)->len == 0) break;                                                         \
    size_t row_ = (pc)->lo / (pc)->wl, col_ = (pc)->lo % (pc)->wl;                     \
    size_t k0_ = dopt_grid_logical((pc), (pc)->lo) - col_;                             \
    for (size_t j = 0; j < (pc)->len;) {                                               \
      size_t run_ = (pc)->wl - col_ < (pc)->len - j ? (pc)->wl - col_ : (pc)->len - j; \
      for (size_t c_ = 0; c_ < run_; c_++, j++) {                                      \
        size_t k = k0_ + col_ + c_;                                                    \
        body;                                                                          \
      }                                                                                \
      col_ = 0;                                                                        \
      row_++;                                                                          \
      if (j < (pc)->len) k0_ = dopt_grid_logical((pc), row_ * (pc)->wl);               \
    }                                                                                  \
  } while (0)

void dopt__grid_codes(const float *x, const dopt_piece *pc, int32_t *codes, int64_t *nonfinite) {
  int64_t bad = 0;
  FOR_PIECE(pc, j, k, {
    int32_t c = dopt_grid_code(x[j]);
    int32_t *b = &codes[k / DOPT_GRID_BLOCK];
    if (c > *b) *b = c;
    bad += !isfinite(x[j]);
  });
  *nonfinite = bad;
}

void dopt__grid_encode(const float *x, const dopt_piece *pc, const int32_t *codes, int words, int k, int add,
                       int64_t *w, int64_t *cls) {
  FOR_PIECE(pc, j, l, {
    int64_t q[DOPT_DP_SUM_WORDS_MAX];
    dopt_grid_encode(x[j], codes[l / DOPT_GRID_BLOCK], words, k, q);
    for (int t = 0; t < words; t++) /* unsigned: the words' sums stay below 2^62, no wrap */
      w[j * (size_t)words + (size_t)t] = add ? (int64_t)((uint64_t)w[j * (size_t)words + (size_t)t] + (uint64_t)q[t]) : q[t];
    if (cls) cls[j] = (add ? cls[j] : 0) + dopt_grid_class(x[j]);
  });
}

void dopt__grid_decode(const int64_t *w, const int64_t *cls, const dopt_piece *pc, const int32_t *codes, int words,
                       int k, float *x) {
  FOR_PIECE(pc, j, l, {
    x[j] = dopt_grid_decode(w + j * (size_t)words, cls ? cls[j] : 0, codes[l / DOPT_GRID_BLOCK], words, k);
  });
}

dopt_status dopt_dp_sum(const float *const *parts, int nparts, int words, size_t numel, float *out) {
  DOPT_CHECK_ARG(parts != NULL, "dopt_dp_sum: parts=NULL");
  DOPT_CHECK_ARG(out != NULL, "dopt_dp_sum: out=NULL");
  DOPT_CHECK_ARG(nparts >= 1 && nparts <= DOPT_DP_SUM_MAX_PARTS, "dopt_dp_sum: nparts=%d must be in [1, %d]", nparts,
                 DOPT_DP_SUM_MAX_PARTS);
  DOPT_CHECK_ARG(words >= 0 && words <= DOPT_DP_SUM_WORDS_MAX, "dopt_dp_sum: words=%d must be 0, 1 or 2", words);
  for (int d = 0; d < nparts; d++)
    DOPT_CHECK_ARG(parts[d] != NULL || numel == 0, "dopt_dp_sum: parts[%d]=NULL", d);
  if (numel == 0) return DOPT_OK;
  if (nparts == 1 || words == DOPT_DP_SUM_RANK_ORDER) { /* ((x0 + x1) + x2) + ... */
    memcpy(out, parts[0], numel * sizeof(float));
    for (int d = 1; d < nparts; d++)
      for (size_t i = 0; i < numel; i++) out[i] = out[i] + parts[d][i];
    return DOPT_OK;
  }
  dopt_piece whole;
  int64_t shape = (int64_t)numel;
  dopt_piece_full(1, &shape, &whole);
  const size_t nb = dopt_grid_blocks(numel);
  const int k = 62 - dopt_grid_headroom(nparts);
  int32_t *codes = calloc(nb, sizeof *codes);
  int64_t *acc = calloc(numel * (size_t)words, sizeof *acc), *ccls = calloc(numel, sizeof *ccls);
  dopt_status st = DOPT_OK;
  if (!codes || !acc || !ccls) {
    st = dopt__fail(DOPT_ERR_NO_MEMORY, "dopt_dp_sum: scratch for %zu elements x %d words", numel, words);
    goto done;
  }
  /* the block codes over every part (the MAX collective) */
  int64_t bad = 0;
  for (int d = 0; d < nparts; d++) {
    int64_t b;
    dopt__grid_codes(parts[d], &whole, codes, &b);
    bad += b;
  }
  /* every part's words, added as integers (the integer SUM collective; every
   * partial sum of a word stays below 2^62 in magnitude) */
  for (int d = 0; d < nparts; d++) dopt__grid_encode(parts[d], &whole, codes, words, k, 1, acc, bad ? ccls : NULL);
  dopt__grid_decode(acc, bad ? ccls : NULL, &whole, codes, words, k, out);
done:
  free(codes);
  free(acc);
  free(ccls);
  return st;
}
