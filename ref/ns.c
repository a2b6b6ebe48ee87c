/* The Newton–Schulz orthogonalisation of Muon and its fixed-order GEMM (ns.h, docs/muon.md). */
#include "ns.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

float dopt_round_bf16(float x) { return dopt_bf16_to_f32(dopt_f32_to_bf16(x)); }

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

typedef struct gemm_job {
  size_t M, N, K, npanels, nblocks, parts;
  const float *A, *B;
  float *C, *pack;
  ns_kernel kern;
} gemm_job;

/* panels [p0, p1) of B into pack: panel p is [K][NR], B[k][p·NR + j], zero beyond N */
static void pack_panels(const gemm_job *g, size_t p0, size_t p1) {
  for (size_t p = p0; p < p1; p++) {
    float *dst = g->pack + p * g->K * NR;
    const size_t j0 = p * NR, nb = g->N - j0 < NR ? g->N - j0 : NR;
    for (size_t k = 0; k < g->K; k++) {
      memcpy(dst + k * NR, g->B + k * g->N + j0, nb * sizeof(float));
      for (size_t j = nb; j < NR; j++) dst[k * NR + j] = 0.0f;
    }
  }
}

/* row blocks [b0, b1) of C (MR rows each), every column */
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
        for (size_t j = j0; j < jend; j += NR) {
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
  compute_blocks(g, g->nblocks * p / g->parts, g->nblocks * (p + 1) / g->parts);
}

dopt_status dopt_gemm_nn(size_t M, size_t N, size_t K, const float *A, const float *B, float *C, const dopt_par *par) {
  if (M == 0 || N == 0) return DOPT_OK;
  if (K == 0) { /* empty sums: +0 */
    memset(C, 0, M * N * sizeof *C);
    return DOPT_OK;
  }
  gemm_job g = {M, N, K, (N + NR - 1) / NR, (M + MR - 1) / MR, 1, A, B, C, NULL, pick_kernel()};
  g.pack = malloc(g.npanels * K * NR * sizeof *g.pack);
  if (!g.pack) return dopt__fail(DOPT_ERR_NO_MEMORY, "muon: the packed %zu x %zu operand of a product", K, N);
  /* threads only where each gets real work: 2^20 multiply-adds (the split changes no bit) */
  size_t parts = par && par->threads > 1 ? (size_t)par->threads : 1;
  if (parts > DOPT_PAR_MAX) parts = DOPT_PAR_MAX;
  while (parts > 1 && (g.nblocks < parts || M * N * K / parts < ((size_t)1 << 20))) parts--;
  g.parts = parts < g.npanels ? parts : 1;
  if (g.parts > 1) par->run(par->ctx, g.parts, pack_task, &g);
  else pack_panels(&g, 0, g.npanels);
  g.parts = parts;
  if (g.parts > 1) par->run(par->ctx, g.parts, compute_task, &g);
  else compute_blocks(&g, 0, g.nblocks);
  free(g.pack);
  return DOPT_OK;
}

/* out[cols, rows] = in[rows, cols]ᵀ */
static void transpose(const float *in, size_t rows, size_t cols, float *out) {
  for (size_t i = 0; i < rows; i++)
    for (size_t j = 0; j < cols; j++) out[j * rows + i] = in[i * cols + j];
}

static void round_all(float *x, size_t n, int bf16) {
  for (size_t i = 0; bf16 && i < n; i++) x[i] = dopt_round_bf16(x[i]);
}

/* out = f·x + y per element, as torch's bf16 `f * x + y` with a Python scalar f (each product rounded to bf16
 * first, the sum rounded again; fp32: plain); out may be x or y. */
static void scale_add(float *out, float f, const float *x, const float *y, size_t n, int bf16) {
  for (size_t i = 0; i < n; i++) {
    float fx = f * x[i];
    if (bf16) fx = dopt_round_bf16(fx);
    out[i] = fx + y[i];
  }
  round_all(out, n, bf16);
}

/* out = bf16?(P + f·Y) per element, the fp32 combination of torch's addmm(Y, ·, ·, beta=f) (alpha 1) or of
 * addmm(A, A, A, beta=f, alpha=fc) with P already scaled: each product rounded to fp32, the sum to fp32, then
 * once to bf16; out may be P or Y. */
static void fp32_combine(float *out, const float *P, float fp, float f, const float *Y, size_t n, int bf16) {
  for (size_t i = 0; i < n; i++) {
    const float v = fp * P[i] + f * Y[i];
    out[i] = bf16 ? dopt_round_bf16(v) : v;
  }
}

/* X / the normalisation's divisor: separate, bf16(bf16(sqrt(bf16(sum of bf16 squares))) + eps); addmm,
 * max(bf16(sqrt(sum of exact squares)), bf16(eps)) (torch 2's vector norm, then clamp(min=eps): a NaN norm
 * stays NaN) */
static void normalize(float *X, float *T, size_t rc, const dopt_ns_spec *ns) {
  const int bf16 = ns->bf16;
  for (size_t i = 0; i < rc; i++) T[i] = X[i] * X[i];
  if (ns->form == DOPT_NS_SEPARATE) round_all(T, rc, bf16);
  float ss = (float)dopt_xsum(T, rc);
  if (bf16 && ns->form == DOPT_NS_SEPARATE) ss = dopt_round_bf16(ss);
  float nrm = sqrtf(ss);
  if (bf16) nrm = dopt_round_bf16(nrm);
  float den;
  if (ns->form == DOPT_NS_SEPARATE) {
    den = nrm + (float)ns->eps;
    if (bf16) den = dopt_round_bf16(den);
  } else {
    const float e = bf16 ? dopt_round_bf16((float)ns->eps) : (float)ns->eps;
    den = nrm < e ? e : nrm;
  }
  for (size_t i = 0; i < rc; i++) X[i] = X[i] / den;
  round_all(X, rc, bf16);
}

dopt_status dopt_ns_orthogonalize(float *g, size_t h, size_t w, const dopt_ns_spec *ns, const dopt_par *par) {
  const int tall = h > w; /* upstream iterates X = Gᵀ, so that X·Xᵀ is the small side */
  const size_t r = tall ? w : h, c = tall ? h : w, rc = r * c, rr = r * r;
  const int bf16 = ns->bf16, sep = ns->form == DOPT_NS_SEPARATE;
  if (rc == 0) return DOPT_OK;
  float *buf = malloc((3 * rc + 3 * rr) * sizeof *buf);
  if (!buf)
    return dopt__fail(DOPT_ERR_NO_MEMORY, "muon: Newton-Schulz buffers for a [%zu, %zu] matrix (%zu bytes)", h, w,
                      (3 * rc + 3 * rr) * sizeof *buf);
  float *X = buf, *XT = X + rc, *T = XT + rc, *A = T + rc, *CA = A + rr, *B = CA + rr;
  /* scalar factors: muon-optimizer's are Python scalars in bf16 tensor arithmetic (torch rounds them to bf16),
   * addmm's alpha and beta are fp32 */
  const float fa = bf16 && sep ? dopt_round_bf16((float)ns->a) : (float)ns->a;
  const float fb = bf16 && sep ? dopt_round_bf16((float)ns->b) : (float)ns->b;
  const float fc = bf16 && sep ? dopt_round_bf16((float)ns->c) : (float)ns->c;
  if (tall) transpose(g, h, w, X);
  else memcpy(X, g, rc * sizeof *X);
  round_all(X, rc, bf16); /* G.bfloat16() */
  normalize(X, T, rc, ns);
  dopt_status st = DOPT_OK;
  for (int s = 0; s < ns->steps && st == DOPT_OK; s++) {
    /* A = X·Xᵀ [r, r] */
    transpose(X, r, c, XT);
    st = dopt_gemm_nn(r, r, c, X, XT, A, par);
    round_all(A, rr, bf16);
    if (sep) {
      /* B = b·A + c·A·A, which Python evaluates as (b·A) + ((c·A)·A) */
      for (size_t i = 0; i < rr; i++) CA[i] = fc * A[i];
      round_all(CA, rr, bf16);
      if (st == DOPT_OK) st = dopt_gemm_nn(r, r, r, CA, A, B, par);
      round_all(B, rr, bf16);
      scale_add(B, fb, A, B, rr, bf16);
      /* X = a·X + B·X */
      if (st == DOPT_OK) st = dopt_gemm_nn(r, c, r, B, X, T, par);
      round_all(T, rc, bf16);
      scale_add(X, fa, X, T, rc, bf16);
    } else {
      /* B = addmm(A, A, A, beta=b, alpha=c): c·(A·A) + b·A rounded once */
      if (st == DOPT_OK) st = dopt_gemm_nn(r, r, r, A, A, B, par);
      fp32_combine(B, B, fc, fb, A, rr, bf16);
      /* X = addmm(X, B, X, beta=a): B·X + a·X rounded once */
      if (st == DOPT_OK) st = dopt_gemm_nn(r, c, r, B, X, T, par);
      fp32_combine(X, T, 1.0f, fa, X, rc, bf16);
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
