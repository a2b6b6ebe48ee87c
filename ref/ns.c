/* The Newton–Schulz orthogonalisation of Muon and its fixed-order GEMM (ns.h, docs/muon.md). */
#include "ns.h"

#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* dopt_f32_to_bf16 then back, inline and branch-free (the loops over whole matrices vectorise): round to nearest
 * even, a NaN kept quiet (core/elem.h's dopt_bf16_of_bits, bit for bit) */
static inline float round_bf16(float x) {
  uint32_t u;
  memcpy(&u, &x, sizeof u);
  const uint32_t nan = (u & 0x7fffffffu) > 0x7f800000u;
  u = nan ? (u | 0x400000u) & 0xffff0000u : (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  memcpy(&x, &u, sizeof x);
  return x;
}

float dopt_round_bf16(float x) { return round_bf16(x); }

/* The product C = A·B: each C[i][j] is the chain acc = fmaf(A[i][k], B[k][j], acc) over k = 0, 1, ..., K-1
 * from +0, one rounding per k. For bf16 operands (the bf16 iteration) every product is exact in fp32, so
 * this is the exact products' fp32 sum in k order; fmaf keeps it so even where a product would underflow.
 * B is packed into column panels of NR floats (zero beyond N); each block of MR rows of C is computed panel
 * by panel, k in slabs of KC: a tile's accumulators start at +0 (first slab) or at the fp32 values the
 * previous slab stored (storing and reloading an fp32 value is exact), so neither the blocking, nor the
 * threads (whole row blocks each), nor the kernel (AVX2+FMA lanes or the portable loop) changes a bit. */
#define MR 6   /* rows of a register tile */
#define NR 16  /* columns of a register tile: one packed panel */
#define KC 256 /* k per slab: the tile's A rows stay in L1 */
#define NC 256 /* columns per sweep: the slab's panels (KC·NC·4 = 256 KiB) stay in L2 */

/* one MR × NR tile over kb values of k: a (rows lda apart), the packed panel bp [kb][NR], c (rows ldc apart) */
typedef void (*ns_kernel)(size_t kb, const float *a, size_t lda, const float *bp, float *c, size_t ldc, int first);

static void kern_portable(size_t kb, const float *a, size_t lda, const float *bp, float *c, size_t ldc, int first) {
  float acc[MR][NR];
  for (size_t i = 0; i < MR; i++)
    for (size_t j = 0; j < NR; j++) acc[i][j] = first ? 0.0f : c[i * ldc + j];
  for (size_t k = 0; k < kb; k++)
    for (size_t i = 0; i < MR; i++) {
      const float ai = a[i * lda + k];
      for (size_t j = 0; j < NR; j++) acc[i][j] = fmaf(ai, bp[k * NR + j], acc[i][j]);
    }
  for (size_t i = 0; i < MR; i++) memcpy(c + i * ldc, acc[i], sizeof acc[i]);
}

#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
#include <immintrin.h>
/* kern_portable on AVX2+FMA: the same fmaf per element and k. The 12 accumulators are named variables (an
 * array of them would be kept in memory across the k loop). */
#define ROW(i) __m256 c##i##0, c##i##1
#define LOAD(i)                                                                                            \
  c##i##0 = first ? _mm256_setzero_ps() : _mm256_loadu_ps(c + (i) * ldc);                                  \
  c##i##1 = first ? _mm256_setzero_ps() : _mm256_loadu_ps(c + (i) * ldc + 8)
#define FMA(i)                                                                                             \
  do {                                                                                                     \
    const __m256 ai = _mm256_broadcast_ss(a + (i) * lda + k);                                              \
    c##i##0 = _mm256_fmadd_ps(ai, b0, c##i##0);                                                            \
    c##i##1 = _mm256_fmadd_ps(ai, b1, c##i##1);                                                            \
  } while (0)
#define STORE(i)                                                                                           \
  _mm256_storeu_ps(c + (i) * ldc, c##i##0);                                                                \
  _mm256_storeu_ps(c + (i) * ldc + 8, c##i##1)
__attribute__((target("avx2,fma"))) static void kern_avx2(size_t kb, const float *a, size_t lda, const float *bp,
                                                         float *c, size_t ldc, int first) {
  ROW(0); ROW(1); ROW(2); ROW(3); ROW(4); ROW(5);
  LOAD(0); LOAD(1); LOAD(2); LOAD(3); LOAD(4); LOAD(5);
  for (size_t k = 0; k < kb; k++) {
    const __m256 b0 = _mm256_loadu_ps(bp + k * NR), b1 = _mm256_loadu_ps(bp + k * NR + 8);
    FMA(0); FMA(1); FMA(2); FMA(3); FMA(4); FMA(5);
  }
  STORE(0); STORE(1); STORE(2); STORE(3); STORE(4); STORE(5);
}
#undef ROW
#undef LOAD
#undef FMA
#undef STORE
static ns_kernel pick_kernel(void) {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? kern_avx2 : kern_portable;
}
#else
static ns_kernel pick_kernel(void) { return kern_portable; }
#endif

/* ---- bf16 operands: two k at a time through vdpbf16ps (AVX512-BF16) ----------------------------------
 * vdpbf16ps adds to each fp32 lane the two products of a pair of bf16 values, the pair's high half first, each
 * addition rounded once to nearest even (measured, and checked by pairs_ok below before first use), denormals
 * flushed. With A[i][k] and B[k][j] in the high halves and k + 1 in the low ones that is
 * fmaf(a[k+1], b[k+1], fmaf(a[k], b[k], acc)): this file's chain, two k per instruction, wherever nothing is
 * subnormal. dopt_gemm_ex takes this path only when every nonzero operand is a finite bf16 value in
 * [2^-50, 2^50]: its products are then exact fp32 values in [2^-100, 2^100] and every partial sum a multiple of
 * 2^-123, never subnormal (nor does a sum overflow); a pair past K is (x, +0), and adding +0 to a chain that
 * starts at +0 changes nothing (such a chain is never −0). Otherwise, or without the instruction, the fmaf
 * kernel runs: the same bits either way. */
#define KC2 (KC / 2) /* k pairs per slab */

static uint32_t bits_of(float x) {
  uint32_t u;
  memcpy(&u, &x, sizeof u);
  return u;
}

/* the pair (k, k + 1) of bf16 values as vdpbf16ps reads it: k in the high half, added first */
static uint32_t pair_of(float k, float k1) { return (bits_of(k) & 0xffff0000u) | (bits_of(k1) >> 16); }

#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__) && __GNUC__ >= 11
/* MR rows × `panels` (1 or 2) panels of NR columns: 6 or 12 zmm accumulators; a[i·lda + k2] is row i's pair k2,
 * bp[k2·NR + j] panel 0's (the next panel ldb further) */
__attribute__((target("avx512f,avx512bf16"))) static void kern_pairs(size_t kb2, const uint32_t *a, size_t lda,
                                                                    const uint32_t *bp, size_t ldb, float *c,
                                                                    size_t ldc, int first, int panels) {
  __m512 acc[MR][2];
  for (size_t i = 0; i < MR; i++)
    for (int p = 0; p < panels; p++) acc[i][p] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(c + i * ldc + p * NR);
  if (panels == 2) {
    for (size_t k = 0; k < kb2; k++) {
      const __m512bh b0 = (__m512bh)_mm512_loadu_si512(bp + k * NR);
      const __m512bh b1 = (__m512bh)_mm512_loadu_si512(bp + ldb + k * NR);
      for (size_t i = 0; i < MR; i++) {
        const __m512bh ai = (__m512bh)_mm512_set1_epi32((int)a[i * lda + k]);
        acc[i][0] = _mm512_dpbf16_ps(acc[i][0], ai, b0);
        acc[i][1] = _mm512_dpbf16_ps(acc[i][1], ai, b1);
      }
    }
  } else {
    for (size_t k = 0; k < kb2; k++) {
      const __m512bh b0 = (__m512bh)_mm512_loadu_si512(bp + k * NR);
      for (size_t i = 0; i < MR; i++)
        acc[i][0] = _mm512_dpbf16_ps(acc[i][0], (__m512bh)_mm512_set1_epi32((int)a[i * lda + k]), b0);
    }
  }
  for (size_t i = 0; i < MR; i++)
    for (int p = 0; p < panels; p++) _mm512_storeu_ps(c + i * ldc + p * NR, acc[i][p]);
}

/* The instruction does what the file's definition needs, on inputs that tell the alternatives apart: the high
 * half first (1 + (−1)·1 + 2^-30·1 = 2^-30, not 0), each addition rounded (1 + 2^-24 + 2^-24 = 1, not 1 + 2^-23),
 * and random pairs equal the fmaf chain. Decided once; DOPT_NS_KERNEL=fmaf in the environment keeps the fmaf
 * kernel (to time it: no bit changes). */
static int pairs_ok(void) {
  static _Atomic int known = -1;
  int v = atomic_load_explicit(&known, memory_order_relaxed);
  if (v >= 0) return v;
  v = 0;
  const char *force = getenv("DOPT_NS_KERNEL"); /* "fmaf": the other kernel (the same bits), to time it */
  if (!(force && strcmp(force, "fmaf") == 0) && __builtin_cpu_supports("avx512f") &&
      __builtin_cpu_supports("avx512bf16")) {
    uint32_t a[MR * 4], b[2 * NR * 4];
    float c[MR * 2 * NR], want[MR * 2 * NR];
    uint64_t seed = 12345;
    for (size_t i = 0; i < MR; i++)
      for (size_t k = 0; k < 4; k++) {
        float x0, x1;
        if (k == 0) x0 = i % 2 ? 0x1p-24f : -1.0f, x1 = i % 2 ? 0x1p-24f : 0x1p-30f;
        else {
          seed = seed * 6364136223846793005u + 1442695040888963407u;
          x0 = round_bf16((float)(int32_t)(seed >> 32) * 0x1p-31f);
          x1 = round_bf16((float)(int32_t)seed * 0x1p-31f);
        }
        a[i * 4 + k] = pair_of(x0, x1);
      }
    float bv[8][2 * NR];
    for (size_t k = 0; k < 8; k++)
      for (size_t j = 0; j < 2 * NR; j++) {
        seed = seed * 6364136223846793005u + 1442695040888963407u;
        bv[k][j] = k < 2 ? 1.0f : round_bf16((float)(int32_t)(seed >> 32) * 0x1p-31f);
      }
    for (size_t p = 0; p < 2; p++)
      for (size_t k2 = 0; k2 < 4; k2++)
        for (size_t j = 0; j < NR; j++)
          b[p * 4 * NR + k2 * NR + j] = pair_of(bv[2 * k2][p * NR + j], bv[2 * k2 + 1][p * NR + j]);
    for (size_t i = 0; i < MR; i++)
      for (size_t j = 0; j < 2 * NR; j++) {
        float acc = 1.0f;
        for (size_t k = 0; k < 8; k++) {
          const uint32_t pr = a[i * 4 + k / 2];
          const uint32_t hb = k % 2 ? pr << 16 : pr & 0xffff0000u;
          float x;
          memcpy(&x, &hb, sizeof x);
          acc = fmaf(x, bv[k][j], acc);
        }
        want[i * 2 * NR + j] = acc, c[i * 2 * NR + j] = 1.0f;
      }
    kern_pairs(4, a, 4, b, 4 * NR, c, 2 * NR, 0, 2);
    v = memcmp(c, want, sizeof c) == 0;
  }
  atomic_store_explicit(&known, v, memory_order_relaxed);
  return v;
}
#else
static void kern_pairs(size_t kb2, const uint32_t *a, size_t lda, const uint32_t *bp, size_t ldb, float *c,
                       size_t ldc, int first, int panels) { /* never called: pairs_ok() is 0 */
  (void)kb2, (void)a, (void)lda, (void)bp, (void)ldb, (void)c, (void)ldc, (void)first, (void)panels;
}
static int pairs_ok(void) { return 0; }
#endif

typedef struct gemm_job {
  size_t M, N, K, npanels, nblocks, parts;
  const float *A, *B;
  float *C, *pack;
  ns_kernel kern;
  int sym;                /* C is symmetric: only the tiles on or above the diagonal's row block are computed */
  size_t K2;              /* pairs: k pairs, ceil(K / 2) */
  uint32_t *apairs, *bpairs; /* pairs: A as [M][K2], B's panels as [npanels][K2][NR] */
  size_t bstart[DOPT_PAR_MAX + 1]; /* part p computes row blocks [bstart[p], bstart[p + 1]) */
} gemm_job;

/* panels [p0, p1) of B into pack: panel p is [K][NR], B[k][p·NR + j], zero beyond N */
static void pack_panels(const gemm_job *g, size_t p0, size_t p1) {
  for (size_t p = p0; p < p1; p++) {
    if (g->bpairs) { /* the pairs of k (high: k, low: k + 1), +0 beyond N and K */
      uint32_t *dst = g->bpairs + p * g->K2 * NR;
      const size_t j0 = p * NR, nb = g->N - j0 < NR ? g->N - j0 : NR;
      if (!g->B) { /* C = A·Aᵀ: B[k][j] = A[j][k], so a column's pairs are row j's pairs of A */
        for (size_t k2 = 0; k2 < g->K2; k2++)
          for (size_t j = 0; j < NR; j++) dst[k2 * NR + j] = j < nb ? g->apairs[(j0 + j) * g->K2 + k2] : 0u;
        continue;
      }
      for (size_t k2 = 0; k2 < g->K2; k2++) {
        const float *r0 = g->B + 2 * k2 * g->N + j0, *r1 = r0 + g->N;
        uint32_t *d = dst + k2 * NR;
        if (2 * k2 + 1 < g->K)
          for (size_t j = 0; j < nb; j++) d[j] = pair_of(r0[j], r1[j]);
        else
          for (size_t j = 0; j < nb; j++) d[j] = pair_of(r0[j], 0.0f);
        for (size_t j = nb; j < NR; j++) d[j] = 0u;
      }
      continue;
    }
    float *dst = g->pack + p * g->K * NR;
    const size_t j0 = p * NR, nb = g->N - j0 < NR ? g->N - j0 : NR;
    for (size_t k = 0; k < g->K; k++) {
      memcpy(dst + k * NR, g->B + k * g->N + j0, nb * sizeof(float));
      for (size_t j = nb; j < NR; j++) dst[k * NR + j] = 0.0f;
    }
  }
}

/* the first column a row block computes: 0, or (sym) its panel holding the diagonal's first element */
static size_t first_col(const gemm_job *g, size_t blk) { return g->sym ? (blk * MR / NR) * NR : 0; }

/* row blocks [b0, b1) of C (MR rows each), every column (sym: from the diagonal's panel on), two k at a time */
static void compute_blocks_pairs(const gemm_job *g, size_t b0, size_t b1) {
  uint32_t at[MR * KC2];
  float ct[MR * NR];
  for (size_t k0 = 0; k0 < g->K2; k0 += KC2) {
    const size_t kb = g->K2 - k0 < KC2 ? g->K2 - k0 : KC2;
    const int first = k0 == 0;
    for (size_t blk = b0; blk < b1; blk++) {
      const size_t i0 = blk * MR, mr = g->M - i0 < MR ? g->M - i0 : MR;
      const uint32_t *a = g->apairs + i0 * g->K2 + k0;
      size_t lda = g->K2;
      if (mr < MR) {
        for (size_t i = 0; i < MR; i++)
          for (size_t k = 0; k < kb; k++) at[i * KC2 + k] = i < mr ? a[i * g->K2 + k] : 0u;
        a = at, lda = KC2;
      }
      for (size_t j = first_col(g, blk); j < g->N;) {
        const uint32_t *bp = g->bpairs + (j / NR) * g->K2 * NR + k0 * NR;
        float *c = g->C + i0 * g->N + j;
        if (mr == MR && j + 2 * NR <= g->N) {
          kern_pairs(kb, a, lda, bp, g->K2 * NR, c, g->N, first, 2);
          j += 2 * NR;
          continue;
        }
        const size_t nr = g->N - j < NR ? g->N - j : NR;
        if (mr == MR && nr == NR) {
          kern_pairs(kb, a, lda, bp, 0, c, g->N, first, 1);
        } else {
          for (size_t i = 0; i < MR; i++)
            for (size_t jj = 0; jj < NR; jj++) ct[i * NR + jj] = !first && i < mr && jj < nr ? c[i * g->N + jj] : 0.0f;
          kern_pairs(kb, a, lda, bp, 0, ct, NR, first, 1);
          for (size_t i = 0; i < mr; i++) memcpy(c + i * g->N, ct + i * NR, nr * sizeof(float));
        }
        j += NR;
      }
    }
  }
}

/* row blocks [b0, b1) of C (MR rows each), every column (sym: from the diagonal's panel on) */
static void compute_blocks(const gemm_job *g, size_t b0, size_t b1) {
  float at[MR * KC], ct[MR * NR];
  for (size_t k0 = 0; k0 < g->K; k0 += KC) {
    const size_t kb = g->K - k0 < KC ? g->K - k0 : KC;
    const int first = k0 == 0;
    for (size_t j0 = 0; j0 < g->N; j0 += NC) {
      const size_t jend = g->N - j0 < NC ? g->N : j0 + NC;
      for (size_t blk = b0; blk < b1; blk++) {
        const size_t i0 = blk * MR, mr = g->M - i0 < MR ? g->M - i0 : MR;
        const float *a = g->A + i0 * g->K + k0;
        size_t lda = g->K;
        if (mr < MR) { /* the last rows: a zero-padded copy of the tile's A rows */
          for (size_t i = 0; i < MR; i++)
            for (size_t k = 0; k < kb; k++) at[i * KC + k] = i < mr ? a[i * g->K + k] : 0.0f;
          a = at, lda = KC;
        }
        for (size_t j = j0 > first_col(g, blk) ? j0 : first_col(g, blk); j < jend; j += NR) {
          const float *bp = g->pack + (j / NR) * g->K * NR + k0 * NR;
          float *c = g->C + i0 * g->N + j;
          const size_t nr = g->N - j < NR ? g->N - j : NR;
          if (mr == MR && nr == NR) {
            g->kern(kb, a, lda, bp, c, g->N, first);
            continue;
          }
          /* an edge tile: through a full-size copy, its valid part written back */
          for (size_t i = 0; i < MR; i++)
            for (size_t jj = 0; jj < NR; jj++) ct[i * NR + jj] = !first && i < mr && jj < nr ? c[i * g->N + jj] : 0.0f;
          g->kern(kb, a, lda, bp, ct, NR, first);
          for (size_t i = 0; i < mr; i++) memcpy(c + i * g->N, ct + i * NR, nr * sizeof(float));
        }
      }
    }
  }
}

static void pack_task(void *arg, size_t p) {
  const gemm_job *g = arg;
  pack_panels(g, g->npanels * p / g->parts, g->npanels * (p + 1) / g->parts);
}

static void compute_task(void *arg, size_t p) {
  const gemm_job *g = arg;
  if (g->apairs) compute_blocks_pairs(g, g->bstart[p], g->bstart[p + 1]);
  else compute_blocks(g, g->bstart[p], g->bstart[p + 1]);
}

/* the parts' row blocks, equal shares of the columns computed (sym: a block from its diagonal's panel on) */
static void split_blocks(gemm_job *g) {
  double total = 0, acc = 0;
  for (size_t b = 0; b < g->nblocks; b++) total += (double)(g->N - first_col(g, b));
  size_t p = 1;
  g->bstart[0] = 0;
  for (size_t b = 0; b < g->nblocks && p < g->parts; b++) {
    acc += (double)(g->N - first_col(g, b));
    while (p < g->parts && acc >= total * (double)p / (double)g->parts) g->bstart[p++] = b + 1;
  }
  while (p <= g->parts) g->bstart[p++] = g->nblocks;
}

/* A's rows [M·p/parts, M·(p+1)/parts) as pairs of k (high: k, low: k + 1, +0 past K) */
static void pack_a_task(void *arg, size_t p) {
  const gemm_job *g = arg;
  for (size_t i = g->M * p / g->parts; i < g->M * (p + 1) / g->parts; i++) {
    const float *row = g->A + i * g->K;
    uint32_t *d = g->apairs + i * g->K2;
    for (size_t k2 = 0; k2 < g->K / 2; k2++) d[k2] = pair_of(row[2 * k2], row[2 * k2 + 1]);
    if (g->K % 2) d[g->K / 2] = pair_of(row[g->K - 1], 0.0f);
  }
}

/* below the diagonal: each C[i][j], j < i, is C[j][i] (the same products in the same order), in 32 x 32 blocks
 * for the cache; part p takes the bands of 32 rows whose share of the triangle is its */
static void mirror_task(void *arg, size_t p) {
  const gemm_job *g = arg;
  const size_t bands = (g->M + 31) / 32;
  const size_t b0 = (size_t)((double)bands * sqrt((double)p / (double)g->parts));
  const size_t b1 = p + 1 == g->parts ? bands : (size_t)((double)bands * sqrt((double)(p + 1) / (double)g->parts));
  float *C = g->C;
  for (size_t i0 = b0 * 32; i0 < b1 * 32 && i0 < g->M; i0 += 32)
    for (size_t j0 = 0; j0 <= i0; j0 += 32)
      for (size_t i = i0; i < g->M && i < i0 + 32; i++)
        for (size_t j = j0; j < i && j < j0 + 32; j++) C[i * g->N + j] = C[j * g->N + i];
}

/* fn over parts, on the pool when there are several */
static void run_parts(const dopt_par *par, gemm_job *g, void (*fn)(void *, size_t)) {
  if (g->parts > 1) par->run(par->ctx, g->parts, fn, g);
  else fn(g, 0);
}

/* out[cols, rows] = in[rows, cols]ᵀ */
static void transpose(const float *in, size_t rows, size_t cols, float *out) {
  for (size_t i = 0; i < rows; i++)
    for (size_t j = 0; j < cols; j++) out[j * rows + i] = in[i * cols + j];
}

/* every value a bf16 one (its low 16 bits zero), finite, and 0 or of magnitude in [2^-50, 2^50] (the pairs
 * path's condition above) */
static int pairs_safe(const float *x, size_t n) {
  uint32_t bad = 0; /* branch-free, so that it vectorises */
  for (size_t i = 0; i < n; i++) {
    const uint32_t u = bits_of(x[i]), m = u & 0x7fffffffu;
    bad |= (u & 0xffffu) | ((m != 0) & ((m < 0x26800000u) | (m > 0x58800000u))); /* 2^-50, 2^50 */
  }
  return bad == 0;
}

dopt_status dopt_gemm_ex(size_t M, size_t N, size_t K, const float *A, const float *B, float *C, unsigned flags,
                         const dopt_par *par) {
  if (M == 0 || N == 0) return DOPT_OK;
  if (K == 0) { /* empty sums: +0 */
    memset(C, 0, M * N * sizeof *C);
    return DOPT_OK;
  }
  const int aat = (flags & DOPT_GEMM_AAT) != 0;
  if (aat && M != N) return dopt__fail(DOPT_ERR_INVALID_ARG, "dopt_gemm_ex: A·Aᵀ of a %zu x %zu A is %zu x %zu", M, K, M, M);
  gemm_job g = {M, N, K, (N + NR - 1) / NR, (M + MR - 1) / MR, 1, A, aat ? NULL : B, C, NULL, pick_kernel(), 0, 0,
                NULL, NULL, {0}};
  g.sym = (aat || (flags & DOPT_GEMM_SYM)) && M == N;
  const int pairs =
      (flags & DOPT_GEMM_BF16) && pairs_ok() && pairs_safe(A, M * K) && (aat || pairs_safe(B, K * N));
  float *bt = NULL; /* A·Aᵀ on the fmaf kernel: Aᵀ, the B it reads */
  if (aat && !pairs) {
    if (!(bt = malloc(K * M * sizeof *bt)))
      return dopt__fail(DOPT_ERR_NO_MEMORY, "muon: the %zu x %zu transpose of a product's operand", K, M);
    transpose(A, M, K, bt);
    g.B = bt;
  }
  if (pairs) {
    g.K2 = (K + 1) / 2;
    g.apairs = malloc(M * g.K2 * sizeof *g.apairs);
    g.bpairs = malloc(g.npanels * g.K2 * NR * sizeof *g.bpairs);
    if (!g.apairs || !g.bpairs) {
      free(g.apairs), free(g.bpairs);
      return dopt__fail(DOPT_ERR_NO_MEMORY, "muon: the packed %zu x %zu operands of a product", K, N);
    }
  } else {
    g.pack = malloc(g.npanels * K * NR * sizeof *g.pack);
    if (!g.pack) {
      free(bt);
      return dopt__fail(DOPT_ERR_NO_MEMORY, "muon: the packed %zu x %zu operand of a product", K, N);
    }
  }
  /* threads only where each gets real work: 2^20 multiply-adds (the split changes no bit) */
  size_t parts = dopt__par_parts(par);
  while (parts > 1 && (g.nblocks < parts || M * N * K / parts < ((size_t)1 << 20))) parts--;
  g.parts = parts;
  if (g.apairs) run_parts(par, &g, pack_a_task); /* before B's panels: A·Aᵀ's are A's pairs */
  g.parts = parts < g.npanels ? parts : 1;
  run_parts(par, &g, pack_task);
  g.parts = parts;
  split_blocks(&g);
  run_parts(par, &g, compute_task);
  if (g.sym) run_parts(par, &g, mirror_task);
  free(g.pack), free(g.apairs), free(g.bpairs), free(bt);
  return DOPT_OK;
}

dopt_status dopt_gemm_nn(size_t M, size_t N, size_t K, const float *A, const float *B, float *C, const dopt_par *par) {
  return dopt_gemm_ex(M, N, K, A, B, C, 0, par);
}

int dopt_gemm_pairs(void) { return pairs_ok(); }

/* The elementwise passes over whole matrices, split over the pool where each part gets 2^16 elements or more
 * (every element computed on its own: no bit depends on the split). */
enum { EW_ROUND, EW_SCALE_ADD, EW_COMBINE };
typedef struct ew_job {
  int kind, bf16;
  float *out;
  const float *x, *y;
  float f, fp;
  size_t n;
} ew_job;

static void ew_range(void *arg, size_t lo, size_t hi) {
  const ew_job *e = arg;
  float *out = e->out;
  const float *x = e->x, *y = e->y, f = e->f, fp = e->fp;
  if (e->kind == EW_ROUND) {
    for (size_t i = lo; i < hi; i++) out[i] = round_bf16(out[i]);
  } else if (e->kind == EW_SCALE_ADD) {
    for (size_t i = lo; i < hi; i++) out[i] = e->bf16 ? round_bf16(round_bf16(f * x[i]) + y[i]) : f * x[i] + y[i];
  } else {
    for (size_t i = lo; i < hi; i++) {
      const float v = fp * x[i] + f * y[i];
      out[i] = e->bf16 ? round_bf16(v) : v;
    }
  }
}

static void ew_run(const dopt_par *par, ew_job *e) { dopt__par_ranges(par, e->n, (size_t)1 << 16, ew_range, e); }

static void round_all(float *x, size_t n, int bf16, const dopt_par *par) {
  ew_job e = {EW_ROUND, bf16, x, NULL, NULL, 0.0f, 0.0f, n};
  if (bf16) ew_run(par, &e);
}

/* out = f·x + y per element, as torch's bf16 `f * x + y` with a Python scalar f (each product rounded to bf16
 * first, the sum rounded again; fp32: plain); out may be x or y. */
static void scale_add(float *out, float f, const float *x, const float *y, size_t n, int bf16, const dopt_par *par) {
  ew_job e = {EW_SCALE_ADD, bf16, out, x, y, f, 0.0f, n};
  ew_run(par, &e);
}

/* out = bf16?(fp·P + f·Y) per element, the fp32 combination of torch's addmm(Y, ·, ·, beta=f, alpha=fp): each
 * product rounded to fp32, the sum to fp32, then once to bf16; out may be P or Y. */
static void fp32_combine(float *out, const float *P, float fp, float f, const float *Y, size_t n, int bf16,
                         const dopt_par *par) {
  ew_job e = {EW_COMBINE, bf16, out, P, Y, f, fp, n};
  ew_run(par, &e);
}

/* X / the normalisation's divisor: separate, bf16(bf16(sqrt(bf16(sum of bf16 squares))) + eps); addmm,
 * max(bf16(sqrt(sum of exact squares)), bf16(eps)) (torch 2's vector norm, then clamp(min=eps): a NaN norm
 * stays NaN) */
static void normalize(float *X, float *T, size_t rc, const dopt_ns_spec *ns, const dopt_par *par) {
  const int bf16 = ns->bf16;
  for (size_t i = 0; i < rc; i++) T[i] = X[i] * X[i];
  if (ns->form == DOPT_NS_SEPARATE) round_all(T, rc, bf16, par);
  float ss = (float)dopt_xsum(T, rc);
  if (bf16 && ns->form == DOPT_NS_SEPARATE) ss = round_bf16(ss);
  float nrm = sqrtf(ss);
  if (bf16) nrm = round_bf16(nrm);
  float den;
  if (ns->form == DOPT_NS_SEPARATE) {
    den = nrm + (float)ns->eps;
    if (bf16) den = round_bf16(den);
  } else {
    const float e = bf16 ? round_bf16((float)ns->eps) : (float)ns->eps;
    den = nrm < e ? e : nrm;
  }
  for (size_t i = 0; i < rc; i++) X[i] = X[i] / den;
  round_all(X, rc, bf16, par);
}

dopt_status dopt_ns_orthogonalize(float *g, size_t h, size_t w, const dopt_ns_spec *ns, const dopt_par *par) {
  const int tall = h > w; /* upstream iterates X = Gᵀ, so that X·Xᵀ is the small side */
  const size_t r = tall ? w : h, c = tall ? h : w, rc = r * c, rr = r * r;
  const int bf16 = ns->bf16, sep = ns->form == DOPT_NS_SEPARATE;
  const unsigned gf = bf16 ? DOPT_GEMM_BF16 : 0u; /* every product's operands are bf16 values */
  if (rc == 0) return DOPT_OK;
  float *buf = malloc((2 * rc + 3 * rr) * sizeof *buf);
  if (!buf)
    return dopt__fail(DOPT_ERR_NO_MEMORY, "muon: Newton-Schulz buffers for a [%zu, %zu] matrix (%zu bytes)", h, w,
                      (2 * rc + 3 * rr) * sizeof *buf);
  float *X = buf, *T = X + rc, *A = T + rc, *CA = A + rr, *B = CA + rr;
  /* scalar factors: muon-optimizer's are Python scalars in bf16 tensor arithmetic (torch rounds them to bf16),
   * addmm's alpha and beta are fp32 */
  const float fa = bf16 && sep ? round_bf16((float)ns->a) : (float)ns->a;
  const float fb = bf16 && sep ? round_bf16((float)ns->b) : (float)ns->b;
  const float fc = bf16 && sep ? round_bf16((float)ns->c) : (float)ns->c;
  if (tall) transpose(g, h, w, X);
  else memcpy(X, g, rc * sizeof *X);
  round_all(X, rc, bf16, par); /* G.bfloat16() */
  normalize(X, T, rc, ns, par);
  dopt_status st = DOPT_OK;
  for (int s = 0; s < ns->steps && st == DOPT_OK; s++) {
    /* A = X·Xᵀ [r, r] */
    st = dopt_gemm_ex(r, r, c, X, NULL, A, DOPT_GEMM_AAT | gf, par);
    round_all(A, rr, bf16, par);
    if (sep) {
      /* B = b·A + c·A·A, which Python evaluates as (b·A) + ((c·A)·A) */
      for (size_t i = 0; i < rr; i++) CA[i] = fc * A[i];
      round_all(CA, rr, bf16, par);
      if (st == DOPT_OK) st = dopt_gemm_ex(r, r, r, CA, A, B, gf, par);
      round_all(B, rr, bf16, par);
      scale_add(B, fb, A, B, rr, bf16, par);
      /* X = a·X + B·X */
      if (st == DOPT_OK) st = dopt_gemm_ex(r, c, r, B, X, T, gf, par);
      round_all(T, rc, bf16, par);
      scale_add(X, fa, X, T, rc, bf16, par);
    } else {
      /* B = addmm(A, A, A, beta=b, alpha=c): c·(A·A) + b·A rounded once */
      if (st == DOPT_OK) st = dopt_gemm_ex(r, r, r, A, A, B, DOPT_GEMM_SYM | gf, par);
      fp32_combine(B, B, fc, fb, A, rr, bf16, par);
      /* X = addmm(X, B, X, beta=a): B·X + a·X rounded once */
      if (st == DOPT_OK) st = dopt_gemm_ex(r, c, r, B, X, T, gf, par);
      fp32_combine(X, T, 1.0f, fa, X, rc, bf16, par);
    }
  }
  if (st == DOPT_OK && tall) transpose(X, r, c, g);
  else if (st == DOPT_OK) memcpy(g, X, rc * sizeof *X);
  free(buf);
  return st;
}

double dopt_ns_cost(size_t h, size_t w, int steps) {
  const double r = (double)(h < w ? h : w), c = (double)(h < w ? w : h);
  return (double)steps * (2.0 * r * r * c + r * r * r + 4.0 * r * c + 4.0 * r * r) + 4.0 * r * c;
}
