/* GaLore projector (internal): which side of a gradient G [m, n] is
 * projected, the SVD that builds the orthonormal projector(s) (exact LAPACK
 * sgesdd with an sgesvd fallback, or a seeded randomized range finder), the
 * deterministic sign convention, and the projection / back-projection GEMMs.
 * See docs/galore.md. Every BLAS/LAPACK call runs with OpenBLAS pinned to one
 * thread (restored afterwards), so results do not depend on
 * OPENBLAS_NUM_THREADS. */
#ifndef DISTOPT_GALORE_PROJ_H
#define DISTOPT_GALORE_PROJ_H

#include <stddef.h>
#include <stdint.h>

#include "distopt/status.h"

/* proj_type, in the order of galore_adamw's enum choices */
enum { DOPT_PROJ_STD = 0, DOPT_PROJ_REVERSE_STD, DOPT_PROJ_LEFT, DOPT_PROJ_RIGHT, DOPT_PROJ_FULL, DOPT_PROJ_COUNT_ };
/* svd, in the order of galore_adamw's enum choices */
enum { DOPT_SVD_EXACT = 0, DOPT_SVD_RANDOMIZED = 1 };

/* How a gradient [m, n] is projected at a requested rank. */
typedef struct dopt_galore_plan {
  size_t m, n;
  size_t r;          /* effective rank: min(rank, m, n) */
  int clamped;       /* the requested rank was > min(m, n) */
  int left, right;   /* projectors kept: A = U[:, :r] [m, r]; B = Vh[:r] [r, n] */
  size_t rows, cols; /* the low-rank shape R (and the moments) */
} dopt_galore_plan;

/* Fills *out for a gradient [m, n]; rank >= 1. Table in docs/galore.md:
 * std projects the smaller side (m >= n: right, R = G·Bᵀ [m, r]; else left,
 * R = Aᵀ·G [r, n]), reverse_std the larger one, right/left always that side,
 * full both (R = Aᵀ·G·Bᵀ [r, r]). */
void dopt_galore_plan_make(int proj_type, size_t m, size_t n, size_t rank, dopt_galore_plan *out);

typedef struct dopt_svd_opts {
  int kind;        /* DOPT_SVD_EXACT or DOPT_SVD_RANDOMIZED */
  int oversample;  /* randomized: extra columns p (k = r + p, capped at min(m, n)); -1: p = r */
  int power_iters; /* randomized: power iterations q, each re-orthonormalised by QR */
  uint64_t seed;   /* randomized: generator key */
  int64_t iter;    /* randomized: generator key (the parameter's 0-based refresh iteration) */
} dopt_svd_opts;

/* Top-r singular triplets of G [m, n] (row-major): U [m, r] (ld r), s [r],
 * Vt [r, n]; any output may be NULL. Sign convention: for each j < r the
 * largest-magnitude component of u_j (sign_on_left) or of v_j (otherwise) is
 * made positive, ties to the lowest index, and the same flip is applied to
 * the matching vector of the other side. Returns DOPT_OK, or
 * DOPT_ERR_NUMERIC when every SVD attempt failed (outputs untouched);
 * *events gets DOPT_EVENT_SVD_FALLBACK when sgesdd failed and sgesvd was
 * used. */
dopt_status dopt_galore_svd(size_t m, size_t n, size_t r, const float *g, const dopt_svd_opts *opt, int sign_on_left,
                            float *U, float *s, float *Vt, unsigned *events);

/* Recomputes the projector(s) of plan p from G: A [m, r] if p->left, B [r, n]
 * if p->right (the sign is fixed on A when kept, else on B). If every SVD
 * attempt fails: with have_prev the old A/B are kept and DOPT_EVENT_SVD_FAILED
 * is reported (DOPT_OK); without, DOPT_ERR_NUMERIC with a message. */
dopt_status dopt_galore_refresh(const dopt_galore_plan *p, const float *g, const dopt_svd_opts *opt, int have_prev,
                                float *A, float *B, unsigned *events);

/* R [rows, cols] = projection of G. ws: m·r floats (full only, else NULL ok). */
void dopt_galore_project(const dopt_galore_plan *p, const float *g, const float *A, const float *B, float *R,
                         float *ws);
/* out [m, n] = scale · back-projection of N [rows, cols] (the product first,
 * then an fp32 multiply by scale, as upstream). ws: m·r floats (full only). */
void dopt_galore_project_back(const dopt_galore_plan *p, const float *N, const float *A, const float *B, float scale,
                              float *out, float *ws);

/* GaLore applies to matrices (ndim >= 2 with leading dims 1) in groups with
 * rank > 0: fills *pl and returns 1, else 0 (the plain update). */
int dopt_galore_applies(double rank, int proj_type, int ndim, const int64_t *shape, dopt_galore_plan *pl);

/* The refresh schedule shared by the GaLore optimizers: at 0-based
 * iterations 0, T, 2T, ... (iter = step - 1, upstream's pre-increment step),
 * or whenever no projector exists yet (all-zero A/B), recompute the
 * projector(s) with dopt_galore_refresh. */
dopt_status dopt_galore_refresh_if_due(const dopt_galore_plan *p, const float *g, int64_t step, int64_t gap,
                                       const dopt_svd_opts *opt, float *A, float *B, unsigned *events);

/* The GaLore-8bit update of a matrix P [m, n] once its projector(s) A/B are
 * current (galore_adamw8bit, q_galore): R = project(G); the 8-bit (or fp32)
 * Adam kernel steps a zero low-rank "parameter" U with decay off (U =
 * −lr·bias-corrected update; `state` the low-rank states of
 * dopt__adamw8bit_layout); P ← P + scale·project_back(U); then decoupled
 * decay after the update, P ← P + (−lr·wd)·P. hp[0..7]: AdamW8bit's keys.
 * `who` names the optimizer in messages. */
dopt_status dopt_galore8_update(const char *who, const dopt_galore_plan *p, const double *hp8, double scale,
                                int64_t step, const float *g, const float *A, const float *B, void *const *state,
                                float *w, unsigned *events);

/* Counter-based standard normal: a pure function of (seed, iter, index). */
float dopt_galore_gauss(uint64_t seed, int64_t iter, uint64_t index);

/* Tests only: make the next n SVD attempts (sgesdd or sgesvd calls) fail. */
void dopt__galore_inject_svd_failures(int n);

#endif
