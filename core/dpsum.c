/* The exact data-parallel sum (include/distopt/dpsum.h): the CPU kernels over
 * a piece (used by the CPU device) and the whole-tensor sum the reference
 * steps on. Element arithmetic: core/grid.h; the AVX2 segment kernels:
 * core/grid_avx2.c. */
#include <stdlib.h>
#include <string.h>

#include "grid.h"
#include "internal.h"

size_t dopt_grid_blocks(size_t numel) { return (numel + DOPT_GRID_BLOCK - 1) / DOPT_GRID_BLOCK; }

/* ---- the portable segment kernels: the element functions of core/grid.h ---- */

static int32_t code_portable(const float *x, size_t n, int64_t *nonfinite) {
  int32_t c = 0;
  int64_t bad = 0;
  for (size_t i = 0; i < n; i++) {
    const int32_t e = dopt_grid_code(x[i]);
    c = e > c ? e : c;
    bad += !isfinite(x[i]);
  }
  *nonfinite += bad;
  return c;
}

static void encode_portable(const float *x, size_t n, int32_t code, int words, int k, int add, int64_t *w) {
  for (size_t i = 0; i < n; i++) {
    int64_t q[DOPT_DP_SUM_WORDS_MAX];
    dopt_grid_encode(x[i], code, words, k, q);
    for (int t = 0; t < words; t++) { /* unsigned: the words' sums stay below 2^62, no wrap */
      int64_t *o = &w[i * (size_t)words + (size_t)t];
      *o = add ? (int64_t)((uint64_t)*o + (uint64_t)q[t]) : q[t];
    }
  }
}

static void decode_portable(const int64_t *w, size_t n, int32_t code, int words, int k, float *x) {
  for (size_t i = 0; i < n; i++) x[i] = dopt_grid_decode(w + i * (size_t)words, 0, code, words, k);
}

int32_t dopt__grid_code_min(const float *x, size_t n, int64_t *nonfinite, int32_t *cmin) {
  int32_t m = *cmin;
  for (size_t i = 0; i < n; i++) {
    uint32_t u;
    memcpy(&u, &x[i], sizeof u);
    const int32_t e = (int32_t)((u >> 23) & 0xffu);
    if ((u & 0x7fffffffu) != 0 && e != 0xff && e < m) m = e;
  }
  *cmin = m;
  return code_portable(x, n, nonfinite);
}

void dopt__grid_sum_double(const float *const *parts, int nparts, size_t lo, size_t n, float *out) {
  for (size_t i = 0; i < n; i++) {
    double a = 0.0;
    for (int d = 0; d < nparts; d++) a = DOPT_DADD(a, (double)parts[d][lo + i]);
    out[i] = a == 0.0 ? 0.0f : (float)a;
  }
}

/* no sum_double: the portable set is the words path the tests compare the vector sets' double path with */
static const dopt__grid_kern kern_portable = {code_portable, encode_portable, decode_portable, dopt__grid_code_min,
                                              NULL};

const dopt__grid_kern *dopt__grid_kernels(int impl) {
  if (impl == DOPT_GRID_IMPL_PORTABLE) return &kern_portable;
  const dopt__grid_kern *v2 = dopt__grid_kern_avx2(), *v5 = dopt__grid_kern_avx512();
  if (impl == DOPT_GRID_IMPL_AVX2) return v2;
  if (impl == DOPT_GRID_IMPL_AVX512) return v5;
  return v5 ? v5 : v2 ? v2 : &kern_portable;
}

/* ---- the piece kernels ---- */

/* Walks the piece's elements in segments: storage j.. and logical k.. both
 * contiguous for n elements, within one logical block (a row of the TP block
 * is contiguous in the logical tensor; no division per element). */
#define FOR_SEGMENTS(pc, j, k, n, body)                                                 \
  do {                                                                                  \
    if ((pc)->len == 0) break;                                                          \
    size_t row_ = (pc)->lo / (pc)->wl, col_ = (pc)->lo % (pc)->wl;                      \
    size_t k0_ = dopt_grid_logical((pc), (pc)->lo) - col_;                              \
    for (size_t j0_ = 0; j0_ < (pc)->len;) {                                            \
      const size_t run_ = (pc)->wl - col_ < (pc)->len - j0_ ? (pc)->wl - col_ : (pc)->len - j0_; \
      for (size_t o_ = 0; o_ < run_;) {                                                 \
        const size_t j = j0_ + o_, k = k0_ + col_ + o_;                                 \
        const size_t room_ = DOPT_GRID_BLOCK - k % DOPT_GRID_BLOCK;                     \
        const size_t n = run_ - o_ < room_ ? run_ - o_ : room_;                         \
        body;                                                                           \
        o_ += n;                                                                        \
      }                                                                                 \
      j0_ += run_;                                                                      \
      col_ = 0;                                                                         \
      row_++;                                                                           \
      if (j0_ < (pc)->len) k0_ = dopt_grid_logical((pc), row_ * (pc)->wl);              \
    }                                                                                   \
  } while (0)

void dopt__grid_codes_k(const dopt__grid_kern *kn, const float *x, const dopt_piece *pc, int32_t *codes,
                        int64_t *nonfinite) {
  int64_t bad = 0;
  FOR_SEGMENTS(pc, j, k, n, {
    const int32_t c = kn->code(x + j, n, &bad);
    int32_t *b = &codes[k / DOPT_GRID_BLOCK];
    if (c > *b) *b = c;
  });
  *nonfinite = bad;
}

/* cls[i] (+)= the class of x[i] for n elements: only for tensors with a
 * non-finite value somewhere */
static void add_classes(const float *x, size_t n, int add, int64_t *cls) {
  for (size_t i = 0; i < n; i++) cls[i] = (add ? cls[i] : 0) + dopt_grid_class(x[i]);
}

/* x[i] for the elements whose class count is not 0 (NaN, ±inf) */
static void decode_classes(const int64_t *w, const int64_t *cls, size_t n, int32_t code, int words, int k, float *x) {
  for (size_t i = 0; i < n; i++)
    if (cls[i]) x[i] = dopt_grid_decode(w + i * (size_t)words, cls[i], code, words, k);
}

void dopt__grid_encode_k(const dopt__grid_kern *kn, const float *x, const dopt_piece *pc, const int32_t *codes,
                         int words, int k, int add, int64_t *w, int64_t *cls) {
  FOR_SEGMENTS(pc, j, l, n, {
    kn->encode(x + j, n, codes[l / DOPT_GRID_BLOCK], words, k, add, w + j * (size_t)words);
    if (cls) add_classes(x + j, n, add, cls + j);
  });
}

void dopt__grid_decode_k(const dopt__grid_kern *kn, const int64_t *w, const int64_t *cls, const dopt_piece *pc,
                         const int32_t *codes, int words, int k, float *x) {
  FOR_SEGMENTS(pc, j, l, n, {
    const int32_t c = codes[l / DOPT_GRID_BLOCK];
    kn->decode(w + j * (size_t)words, n, c, words, k, x + j);
    if (cls) decode_classes(w + j * (size_t)words, cls + j, n, c, words, k, x + j);
  });
}

void dopt__grid_codes(const float *x, const dopt_piece *pc, int32_t *codes, int64_t *nonfinite) {
  dopt__grid_codes_k(dopt__grid_kernels(DOPT_GRID_IMPL_AUTO), x, pc, codes, nonfinite);
}

void dopt__grid_encode(const float *x, const dopt_piece *pc, const int32_t *codes, int words, int k, int add,
                       int64_t *w, int64_t *cls) {
  dopt__grid_encode_k(dopt__grid_kernels(DOPT_GRID_IMPL_AUTO), x, pc, codes, words, k, add, w, cls);
}

void dopt__grid_decode(const int64_t *w, const int64_t *cls, const dopt_piece *pc, const int32_t *codes, int words,
                       int k, float *x) {
  dopt__grid_decode_k(dopt__grid_kernels(DOPT_GRID_IMPL_AUTO), w, cls, pc, codes, words, k, x);
}

/* ---- the whole-tensor sum ---- */

/* The four steps of the distributed sum fused per logical block, with no
 * collective between them: the block's code over every part (the MAX), every
 * part's words added as integers (the SUM; every partial sum of a word stays
 * below 2^62 in magnitude), decoded. The block's words stay in L1. */
dopt_status dopt__dp_sum_k(const dopt__grid_kern *kn, const float *const *parts, int nparts, int words, size_t numel,
                           float *out) {
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
  const int h = dopt_grid_headroom(nparts), k = 62 - h;
  int64_t acc[DOPT_GRID_BLOCK * DOPT_DP_SUM_WORDS_MAX], cls[DOPT_GRID_BLOCK];
  for (size_t lo = 0; lo < numel; lo += DOPT_GRID_BLOCK) {
    const size_t n = numel - lo < DOPT_GRID_BLOCK ? numel - lo : DOPT_GRID_BLOCK;
    int32_t code = 0, cmin = 0xff;
    int64_t bad = 0;
    for (int d = 0; d < nparts; d++) {
      const int32_t c = kn->sum_double ? kn->code_min(parts[d] + lo, n, &bad, &cmin) : kn->code(parts[d] + lo, n, &bad);
      code = c > code ? c : code;
    }
    /* The exact double path: every element of the block is below 2^top (top = max(code, 1) − 126), so every
     * partial sum of the parts is below 2^(top + h), and a multiple of the smallest nonzero element's unit
     * 2^(cmin − 150); at most 53 bits apart when cmin ≥ max(code, 1) + h − 29, so each double addition is exact
     * and the one conversion to fp32 rounds the exact sum once — as decode does, whose words then hold the same
     * exact sum (each element's unit, ≥ 2^(top + h − 53), is above the grid's 2^(top + h − 62)). Not with a
     * non-finite value, nor a subnormal one (cmin 0: a caller's DAZ would read it as zero in the conversion). */
    if (kn->sum_double && !bad && cmin >= 1 && cmin >= (code > 1 ? code : 1) + h - 29) {
      kn->sum_double(parts, nparts, lo, n, out + lo);
      continue;
    }
    for (int d = 0; d < nparts; d++) {
      kn->encode(parts[d] + lo, n, code, words, k, d > 0, acc);
      if (bad) add_classes(parts[d] + lo, n, d > 0, cls);
    }
    kn->decode(acc, n, code, words, k, out + lo);
    if (bad) decode_classes(acc, cls, n, code, words, k, out + lo);
  }
  return DOPT_OK;
}

dopt_status dopt_dp_sum(const float *const *parts, int nparts, int words, size_t numel, float *out) {
  return dopt__dp_sum_k(dopt__grid_kernels(DOPT_GRID_IMPL_AUTO), parts, nparts, words, numel, out);
}
