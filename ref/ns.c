/* The Newton–Schulz orthogonalisation of Muon and its fixed-order GEMM (ns.h, docs/muon.md). */
#include "ns.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

float dopt_round_bf16(float x) { return dopt_bf16_to_f32(dopt_f32_to_bf16(x)); }

/* The product in register tiles of MR rows × NR columns of C: per tile, the accumulators over all of k in
 * order, A's MR rows broadcast and B's NR columns read once per k (the column block of B stays in L2 while
 * the row tiles pass). The same k-order sum per element as a plain loop: only the loop nest is blocked. */
#define MR 4
#define NR 16

static void tile(size_t K, size_t N, const float *A, const float *B, float *C) {
  float acc[MR][NR];
  for (size_t ii = 0; ii < MR; ii++)
    for (size_t jj = 0; jj < NR; jj++) acc[ii][jj] = 0.0f;
  for (size_t k = 0; k < K; k++) {
    const float *b = B + k * N;
    for (size_t ii = 0; ii < MR; ii++) {
      const float a = A[ii * K + k];
      for (size_t jj = 0; jj < NR; jj++) acc[ii][jj] = acc[ii][jj] + a * b[jj];
    }
  }
  for (size_t ii = 0; ii < MR; ii++) memcpy(C + ii * N, acc[ii], sizeof acc[ii]);
}

#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
#include <immintrin.h>
#define NS_AVX2 1
/* tile() on AVX2: the same multiply, then add, per element and k (no fused multiply-add), so the same bits */
__attribute__((target("avx2"))) static void tile_avx2(size_t K, size_t N, const float *A, const float *B, float *C) {
  __m256 c[MR][2];
  for (size_t ii = 0; ii < MR; ii++) c[ii][0] = _mm256_setzero_ps(), c[ii][1] = _mm256_setzero_ps();
  for (size_t k = 0; k < K; k++) {
    const __m256 b0 = _mm256_loadu_ps(B + k * N), b1 = _mm256_loadu_ps(B + k * N + 8);
    for (size_t ii = 0; ii < MR; ii++) {
      const __m256 a = _mm256_broadcast_ss(A + ii * K + k);
      c[ii][0] = _mm256_add_ps(c[ii][0], _mm256_mul_ps(a, b0));
      c[ii][1] = _mm256_add_ps(c[ii][1], _mm256_mul_ps(a, b1));
    }
  }
  for (size_t ii = 0; ii < MR; ii++) {
    _mm256_storeu_ps(C + ii * N, c[ii][0]);
    _mm256_storeu_ps(C + ii * N + 8, c[ii][1]);
  }
}
#endif

/* one element, k in order (the tiles' edges) */
static float dot(size_t K, size_t N, const float *a, const float *b) {
  float acc = 0.0f;
  for (size_t k = 0; k < K; k++) acc = acc + a[k] * b[k * N];
  return acc;
}

/* rows [i0, i1) of C = A·B */
static void gemm_rows(size_t N, size_t K, const float *A, const float *B, float *C, size_t i0, size_t i1) {
  const size_t nfull = N / NR * NR;
  size_t i = i0;
#ifdef NS_AVX2
  const int avx2 = __builtin_cpu_supports("avx2") != 0;
#else
  const int avx2 = 0;
#endif
  for (size_t j = 0; j < nfull; j += NR)
    for (i = i0; i + MR <= i1; i += MR) {
#ifdef NS_AVX2
      if (avx2) {
        tile_avx2(K, N, A + i * K, B + j, C + i * N + j);
        continue;
      }
#endif
      tile(K, N, A + i * K, B + j, C + i * N + j);
    }
  (void)avx2;
  for (size_t r = i; r < i1; r++) /* the last rows */
    for (size_t j = 0; j < nfull; j++) C[r * N + j] = dot(K, N, A + r * K, B + j);
  for (size_t r = i0; r < i1; r++) /* the last columns */
    for (size_t j = nfull; j < N; j++) C[r * N + j] = dot(K, N, A + r * K, B + j);
}

typedef struct gemm_job {
  size_t M, N, K, parts;
  const float *A, *B;
  float *C;
} gemm_job;

static void gemm_part(void *arg, size_t p) {
  const gemm_job *g = arg;
  gemm_rows(g->N, g->K, g->A, g->B, g->C, g->M * p / g->parts, g->M * (p + 1) / g->parts);
}

void dopt_gemm_nn(size_t M, size_t N, size_t K, const float *A, const float *B, float *C, const dopt_par *par) {
  /* threads only where each gets real work: at least 32 rows and 2^20 multiply-adds */
  size_t parts = par && par->threads > 1 ? (size_t)par->threads : 1;
  while (parts > 1 && (M / parts < 32 || M / parts * N * K < ((size_t)1 << 20))) parts--;
  if (parts > DOPT_PAR_MAX) parts = DOPT_PAR_MAX;
  if (parts <= 1) {
    gemm_rows(N, K, A, B, C, 0, M);
    return;
  }
  gemm_job g = {M, N, K, parts, A, B, C};
  par->run(par->ctx, parts, gemm_part, &g);
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

dopt_status dopt_ns_orthogonalize(float *g, size_t h, size_t w, int steps, int bf16, const dopt_par *par) {
  const int tall = h > w; /* upstream iterates X = Gᵀ, so that X·Xᵀ is the small side */
  const size_t r = tall ? w : h, c = tall ? h : w, rc = r * c, rr = r * r;
  if (rc == 0) return DOPT_OK;
  float *buf = malloc((3 * rc + 3 * rr) * sizeof *buf);
  if (!buf)
    return dopt__fail(DOPT_ERR_NO_MEMORY, "muon: Newton-Schulz buffers for a [%zu, %zu] matrix (%zu bytes)", h, w,
                      (3 * rc + 3 * rr) * sizeof *buf);
  float *X = buf, *XT = X + rc, *T = XT + rc, *A = T + rc, *CA = A + rr, *B = CA + rr;
  /* scalar factors in the matrices' arithmetic (torch rounds a Python scalar factor to bf16) */
  const float fa = bf16 ? dopt_round_bf16((float)DOPT_NS_A) : (float)DOPT_NS_A;
  const float fb = bf16 ? dopt_round_bf16((float)DOPT_NS_B) : (float)DOPT_NS_B;
  const float fc = bf16 ? dopt_round_bf16((float)DOPT_NS_C) : (float)DOPT_NS_C;
  if (tall) transpose(g, h, w, X);
  else memcpy(X, g, rc * sizeof *X);
  round_all(X, rc, bf16); /* G.bfloat16() */
  /* X / (‖X‖_F + eps), as torch 1.13's frobenius_norm: sqrt(sum(X·X)) in the tensors' arithmetic (bf16: the
   * squares, their sum and its square root each rounded to bf16), the sum exact and rounded to fp32 first
   * (torch's own float accumulation rounds in its order); + eps, an fp32 scalar addend */
  for (size_t i = 0; i < rc; i++) T[i] = X[i] * X[i];
  round_all(T, rc, bf16);
  float ss = (float)dopt_xsum(T, rc);
  if (bf16) ss = dopt_round_bf16(ss);
  float nrm = sqrtf(ss);
  if (bf16) nrm = dopt_round_bf16(nrm);
  float den = nrm + (float)DOPT_NS_EPS;
  if (bf16) den = dopt_round_bf16(den);
  for (size_t i = 0; i < rc; i++) X[i] = X[i] / den;
  round_all(X, rc, bf16);
  for (int s = 0; s < steps; s++) {
    /* A = X·Xᵀ [r, r] */
    transpose(X, r, c, XT);
    dopt_gemm_nn(r, r, c, X, XT, A, par);
    round_all(A, rr, bf16);
    /* B = b·A + c·A·A, which Python evaluates as (b·A) + ((c·A)·A) */
    for (size_t i = 0; i < rr; i++) CA[i] = fc * A[i];
    round_all(CA, rr, bf16);
    dopt_gemm_nn(r, r, r, CA, A, B, par);
    round_all(B, rr, bf16);
    scale_add(B, fb, A, B, rr, bf16);
    /* X = a·X + B·X */
    dopt_gemm_nn(r, c, r, B, X, T, par);
    round_all(T, rc, bf16);
    scale_add(X, fa, X, T, rc, bf16);
  }
  if (tall) transpose(X, r, c, g);
  else memcpy(g, X, rc * sizeof *X);
  free(buf);
  return DOPT_OK;
}

double dopt_ns_cost(size_t h, size_t w, int steps) {
  const double r = (double)(h < w ? h : w), c = (double)(h < w ? w : h);
  return (double)steps * (2.0 * r * r * c + r * r * r + 4.0 * r * c + 4.0 * r * r) + 4.0 * r * c;
}
