/* Muon's orthogonalisation: the quintic Newton–Schulz iteration on one
 * matrix, in either upstream's form (dopt_ns_spec.form), with our own
 * fixed-order GEMM (docs/muon.md).
 *
 * DOPT_NS_SEPARATE, muon-optimizer 0.1.0 (zeropower_via_newtonschulz5):
 * bf16 mode, as upstream runs it in torch's bf16 arithmetic: every tensor
 * is rounded to bf16 (nearest even) after every operation; a product of two
 * matrices accumulates its exact bf16·bf16 products in fp32 in increasing k
 * and rounds the sum once (torch 1.13's CPU path for m·n·k > 4096; below it
 * accumulates in bf16); a Python scalar factor is rounded to bf16 first
 * (3.4445 → 3.4375), a scalar addend is not (the norm's + 1e-7); the
 * Frobenius norm is the exact sum of squares, rounded to fp32, its fp32
 * square root rounded to bf16.
 *
 * DOPT_NS_ADDMM, torch.optim.Muon (torch >= 2.9, _zeropower_via_newtonschulz):
 * B = addmm(A, A, A, beta=b, alpha=c) and X = addmm(X, B, X, beta=a) each
 * round once: the product's fp32 sum P, then fp32 c·P + b·A (resp. P + a·X)
 * with the scalars in fp32 (not rounded to bf16), then bf16; the norm is
 * torch 2's vector norm of a bf16 tensor (the squares exact in fp32, their
 * sum rounded to fp32, its fp32 square root rounded to bf16), clamped below
 * at bf16(eps) instead of eps added (docs/precision.md, "Muon's
 * Newton–Schulz").
 *
 * fp32 mode: the same operations in fp32, nothing rounded to bf16, scalars in
 * fp32.
 *
 * Every element of every product is one chain of fused multiply-adds in a
 * fixed k order computed by one thread, so the result does not depend on the
 * thread count or the CPU (AVX2+FMA, the portable fmaf, or two k per
 * AVX512-BF16 vdpbf16ps where that adds as the chain does: ns.c); nothing
 * else is contracted (the build's -ffp-contract=off). */
#ifndef DISTOPT_NS_H
#define DISTOPT_NS_H

#include <stddef.h>

#include "optim_impl.h"

/* upstream's coefficients (a, b, c) of X ← a·X + (b·A + c·A·A)·X, A = X·Xᵀ (both upstreams' defaults) */
#define DOPT_NS_A 3.4445
#define DOPT_NS_B (-4.7750)
#define DOPT_NS_C 2.0315
#define DOPT_NS_EPS 1e-7 /* X ← X / (‖X‖_F + eps), torch: X / max(‖X‖_F, eps) */

enum { DOPT_NS_SEPARATE, DOPT_NS_ADDMM };

/* One orthogonalisation's settings. */
typedef struct dopt_ns_spec {
  int steps;       /* iterations, 0..100 */
  int bf16;        /* the iteration in bf16 arithmetic (else fp32) */
  int form;        /* DOPT_NS_SEPARATE (muon-optimizer) or DOPT_NS_ADDMM (torch.optim.Muon) */
  double a, b, c;  /* the quintic's coefficients */
  double eps;      /* the normalisation's */
} dopt_ns_spec;

/* muon-optimizer's iteration with `steps` iterations in bf16 or fp32 */
#define DOPT_NS_SPEC(steps, bf16) ((dopt_ns_spec){(steps), (bf16), DOPT_NS_SEPARATE, DOPT_NS_A, DOPT_NS_B, DOPT_NS_C, DOPT_NS_EPS})

/* bf16 round to nearest even of an fp32 value, as an fp32 value (NaN kept) */
float dopt_round_bf16(float x);

/* C[M, N] = A[M, K] · B[K, N], all row-major fp32; each C[i][j] = fmaf(A[i][k], B[k][j], acc) over k = 0..K-1
 * in order from +0 (bf16 operands: the exact products' fp32 sum). par: NULL or threads for blocks of rows of C
 * (no bit depends on them). DOPT_ERR_NO_MEMORY: the packed copy of B (K · N rounded up to 16 floats). */
dopt_status dopt_gemm_nn(size_t M, size_t N, size_t K, const float *A, const float *B, float *C, const dopt_par *par);

/* dopt_gemm_nn with hints that change no bit: DOPT_GEMM_BF16, every operand holds a bf16 value (two k per
 * instruction where the CPU's vdpbf16ps is checked to add as the chain does, ns.c); DOPT_GEMM_SYM, C is
 * symmetric (A·Aᵀ given as A and Aᵀ, or A·A of a symmetric A): the tiles from the diagonal's on are computed,
 * the rest mirrored (each C[i][j] the same products as C[j][i], in the same order). */
#define DOPT_GEMM_BF16 1u
#define DOPT_GEMM_SYM 2u
#define DOPT_GEMM_AAT 4u /* C = A·Aᵀ (M = N; B unused, may be NULL): symmetric, and no transpose of A is made where
                            the pairs kernel runs */
dopt_status dopt_gemm_ex(size_t M, size_t N, size_t K, const float *A, const float *B, float *C, unsigned flags,
                         const dopt_par *par);
/* 1 where DOPT_GEMM_BF16 products run two k per instruction on this CPU (vdpbf16ps, checked), else 0 */
int dopt_gemm_pairs(void);

/* Orthogonalises g [h, w] (row-major) in place as ns says (bf16: the result holds bf16 values). A tall matrix is
 * iterated transposed, as both upstreams do. */
dopt_status dopt_ns_orthogonalize(float *g, size_t h, size_t w, const dopt_ns_spec *ns, const dopt_par *par);

/* Multiply-adds of dopt_ns_orthogonalize on [h, w]: per iteration r·r·c (X·Xᵀ), r³ (A·A), r·r·c (B·X), r =
 * min(h, w), c = max(h, w), plus the elementwise passes. */
double dopt_ns_cost(size_t h, size_t w, int steps);

#endif
