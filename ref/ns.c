/* The Newton–Schulz orthogonalisation of Muon and its fixed-order GEMM (ns.h, docs/muon.md). */
#include "ns.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

float dopt_round_bf16(float x) { return dopt_bf16_to_f32(dopt_f32_to_bf16(x)); }

/* columns of C kept in one accumulator row (L1): 512 fp32 */
#define GEMM_JB 512

/* rows [i0, i1) of C = A·B: per block of columns, each row's accumulators over k in order */
static void gemm_rows(size_t N, size_t K, const float *A, const float *B, float *C, size_t i0, size_t i1) {
  float acc[GEMM_JB];
  for (size_t j0 = 0; j0 < N; j0 += GEMM_JB) {
    const size_t jn = N - j0 < GEMM_JB ? N - j0 : GEMM_JB;
    for (size_t i = i0; i < i1; i++) {
      for (size_t j = 0; j < jn; j++) acc[j] = 0.0f;
      const float *a = A + i * K;
      for (size_t k = 0; k < K; k++) {
        const float ak = a[k], *b = B + k * N + j0;
        for (size_t j = 0; j < jn; j++) acc[j] = acc[j] + ak * b[j];
      }
      memcpy(C + i * N + j0, acc, jn * sizeof *acc);
    }
  }
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
    for (size_t i = 0; i < rr; i++) {
      float ba = fb * A[i];
      if (bf16) ba = dopt_round_bf16(ba);
      B[i] = ba + B[i];
    }
    round_all(B, rr, bf16);
    /* X = a·X + B·X */
    dopt_gemm_nn(r, c, r, B, X, T, par);
    round_all(T, rc, bf16);
    for (size_t i = 0; i < rc; i++) {
      float ax = fa * X[i];
      if (bf16) ax = dopt_round_bf16(ax);
      X[i] = ax + T[i];
    }
    round_all(X, rc, bf16);
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
