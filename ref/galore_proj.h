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
#include "optim_impl.h"

/* OpenBLAS pinned to one thread around a BLAS/LAPACK call, in a process-wide critical section (galore_proj.c
 * says why); SOAP's eigendecompositions and QRs (ref/soap.c) take the same pin. Returns the count to restore. */
int dopt_blas_pin(void);
void dopt_blas_unpin(int threads);

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

/* The refresh schedule shared by the GaLore optimizers (Q-GaLore's lazy one
 * aside): 1 when step's projector is to be refreshed, at 0-based iterations
 * 0, T, 2T, ... (iter = step - 1, upstream's pre-increment step) or whenever
 * no projector exists yet (all-zero A/B; *have_prev 0). */
int dopt_galore_due(const dopt_galore_plan *p, int64_t step, int64_t gap, const float *A, const float *B,
                    int *have_prev);

/* ---- the projection around an inner optimizer (ref/galore.c) ------------------------
 * One definition of the projector's keys, used by the `galore` wrapper and
 * by its fixed-inner aliases (galore_adamw, galore_adamw8bit, q_galore), in
 * this order at hp[proj_off]: */
enum { DOPT_GP_RANK, DOPT_GP_GAP, DOPT_GP_SCALE, DOPT_GP_PROJ_TYPE, DOPT_GP_SVD, DOPT_GP_OVERSAMPLE,
       DOPT_GP_POWER_ITERS, DOPT_GP_SEED, DOPT_GP_COUNT };
extern const char *const dopt_galore_proj_types[];
extern const char *const dopt_galore_svd_kinds[];
/* rank, update_proj_gap, scale (every GaLore form; the docs name what rank 0 leaves and how the gap moves) */
#define DOPT_GALORE_HPS_CORE(rank_doc, gap_doc)                                  \
  {"rank", DOPT_HP_INT, 0.0, rank_doc, NULL},                                   \
  {"update_proj_gap", DOPT_HP_INT, 200.0, gap_doc, NULL},                       \
  {"scale", DOPT_HP_REAL, 1.0, "back-projection scale", NULL}
/* proj_type, svd and the randomized range finder's keys (galore_torch's projector; Q-GaLore has std/exact only) */
#define DOPT_GALORE_HPS_SVD                                                                                       \
  {"proj_type", DOPT_HP_ENUM, 0.0, "projected side (docs/galore.md)", dopt_galore_proj_types},                   \
  {"svd", DOPT_HP_ENUM, 0.0, "exact (LAPACK) or randomized range finder", dopt_galore_svd_kinds},              \
  {"oversample", DOPT_HP_INT, -1.0, "randomized SVD: extra columns (-1: as many as the rank)", NULL},         \
  {"power_iters", DOPT_HP_INT, 4.0, "randomized SVD: power iterations", NULL},                                \
  {"seed", DOPT_HP_INT, 0.0, "generator seed (randomized SVD; INT8 weights: stochastic rounding)", NULL}
#define DOPT_GALORE_GAP_DOC "refresh the projector at 0-based steps 0, T, 2T, ..."
/* Q-GaLore's projector keys (q_galore_torch's GaLoreProjector(quant=...) and lazy refresh, INT8 weights), in this
 * order at hp[q_off]; the quantised form is used by q_galore (always lazy) and by `galore` when proj_quant,
 * lazy_refresh or int8_weights is on (docs/q_galore.md). */
enum { DOPT_GQ_QUANT, DOPT_GQ_BITS, DOPT_GQ_GROUP, DOPT_GQ_INT4_PACKED, DOPT_GQ_COS_THRESHOLD, DOPT_GQ_GAMMA,
       DOPT_GQ_QUEUE, DOPT_GQ_ABS_COSINE, DOPT_GQ_INT8_WEIGHTS, DOPT_GQ_WEIGHT_GROUP, DOPT_GQ_STOCH_ROUND,
       DOPT_GQ_COUNT };
#define DOPT_GALORE_HPS_QUANT(quant_def)                                                                             \
  {"proj_quant", DOPT_HP_BOOL, quant_def, "store the projector quantised (upstream quant)", NULL},                   \
  {"proj_bits", DOPT_HP_INT, 4.0, "projector bits: 4 or 8 (upstream quant_n_bit)", NULL},                           \
  {"proj_group_size", DOPT_HP_INT, 256.0, "projector quantisation group (-1 = per row)", NULL},                     \
  {"int4_packed", DOPT_HP_BOOL, 1.0, "two int4 codes per byte (false = one per byte, upstream)", NULL},              \
  {"cos_threshold", DOPT_HP_REAL, 0.4, "lazy refresh: queue mean at or above this grows the gap", NULL},             \
  {"gamma_proj", DOPT_HP_REAL, 2.0, "lazy refresh: gap <- int(gap * gamma_proj)", NULL},                             \
  {"queue_size", DOPT_HP_INT, 5.0, "lazy refresh: cosine FIFO length", NULL},                                       \
  {"abs_cosine", DOPT_HP_BOOL, 0.0, "use |cos| (deviation; upstream: signed)", NULL},                                \
  {"int8_weights", DOPT_HP_BOOL, 0.0, "hold GaLore weights as INT8 codes (optimizer state)", NULL},                  \
  {"weight_group_size", DOPT_HP_INT, 256.0, "INT8 weight group (row-major flattened)", NULL},                       \
  {"stochastic_round", DOPT_HP_BOOL, 1.0, "INT8 weights: stochastic (else nearest) rounding", NULL}

/* How one GaLore form sits in its hyperparameters and what it wraps. */
typedef struct dopt_galore_spec {
  const char *who;                     /* the optimizer's name in messages */
  const dopt_optim_impl *inner;        /* steps every unprojected parameter, and the low-rank gradient */
  int inner_off;                       /* the inner's keys at hp[inner_off], in its table's order */
  int proj_off;                        /* DOPT_GP_* at hp[proj_off] */
  int nproj;                           /* DOPT_GP_COUNT, or 3 (rank, gap, scale: std and exact only) */
  int lr, wd;                          /* the inner's lr and weight_decay keys (indexes in its table; -1: none) */
  /* NULL: the inner steps a zero low-rank parameter U (its decay off) and P
   * gains scale·project_back(U) (galore_torch's GaLoreAdamW8bit and
   * GaLoreAdafactor). Else the inner's normalised update N of the low-rank
   * gradient R[n] (its low-rank states) and the multiplier c it applies:
   * P ← P + c·(scale·project_back(N)) (GaLoreAdamW). */
  float (*direction)(const double *hp, int64_t step, const float *R, void *const *state, float *N, size_t n);
  int q_off;  /* DOPT_GQ_* at hp[q_off]; -1: the form has no quantised projector */
  int q_lazy; /* the lazy_refresh key's index; -1: the lazy refresh is always on (q_galore) */
  int q_seed; /* the stochastic-rounding seed's index */
} dopt_galore_spec;

/* 1 when this group's projector is Q-GaLore's (quantised storage, lazy refresh or INT8 weights): its states are
 * then projector_q/scales/zeros (or projector), projector_prev (lazy only), lazy and weight_q/scales/zeros. */
int dopt_galore_quantised(const dopt_galore_spec *sp, const double *hp);

/* Fills lr/wd of sp from its inner's table. */
void dopt_galore_spec_keys(dopt_galore_spec *sp);
/* One-line checks of the projector keys at hp[sp->proj_off]. */
dopt_status dopt_galore_validate(const dopt_galore_spec *sp, const double *hp);
/* 1 and *pl when this parameter is projected (rank > 0, a matrix with leading dims 1), else 0. */
int dopt_galore_plan_of(const dopt_galore_spec *sp, const double *hp, int ndim, const int64_t *shape,
                        dopt_galore_plan *pl);
/* The states: the inner's of the parameter (unprojected), or the inner's in the low-rank shape (not
 * elementwise) followed, when `projectors`, by projector [m, r] / [r, n] (full: projector_left,
 * projector_right). *ninner: how many are the inner's. */
int dopt_galore_layout(const dopt_galore_spec *sp, const double *hp, int ndim, const int64_t *shape, int projectors,
                       dopt_state_spec *out, int *ninner);
/* 1: the parameter steps whole (projected, or whole for the inner). */
int dopt_galore_whole(const dopt_galore_spec *sp, const double *hp, int ndim, const int64_t *shape);
/* The cost of a step in multiply-adds (dopt_optim_impl.cost; docs/distributed.md "Owners by cost"): the
 * inner's for an unprojected parameter; for a projected [m, n] of rank r: 2·m·n·r per projector side (the
 * gradient projected, the update back), 4·m·n (the full weight's decay and update), the inner's step on the
 * low-rank shape, and the SVD over the refresh gap (dense: 4·m·n·min(m, n); randomized: (2 + 2q)·m·n·k,
 * k = r + oversample). Q-GaLore's lazy gap counts as its first one (the most it refreshes). */
double dopt_galore_cost(const dopt_galore_spec *sp, const double *hp, int ndim, const int64_t *shape);
/* The step's frame: the inner's for an unprojected piece (a projected one allocates its own). */
size_t dopt_galore_frame(const dopt_galore_spec *sp, const double *hp, const dopt_piece *pc);
/* An unprojected piece: runs the inner's stage on it (any piece, with the
 * caller's reducer), sets *st and returns 1. A projected one: checks that
 * the piece is the whole tensor (else *st is the error and 1), reports a
 * clamped rank, fills *pl and returns 0. */
int dopt_galore_begin(const dopt_galore_spec *sp, const dopt_step_args *a, dopt_galore_plan *pl,
                      dopt_status *st);
/* The projected update of the whole weight a->param [m, n] once the
 * projector(s) A/B are current: R = project(G); the inner on R (its states
 * a->state[0..], the low-rank ones); the weight decay of the full weight
 * where the inner places it (dopt_optim_impl.lowrank_decay); P ← P +
 * back-projection. Moments are kept across refreshes (not reset, not
 * rotated), as upstream. */
dopt_status dopt_galore_update(const dopt_galore_spec *sp, const dopt_step_args *a, const dopt_galore_plan *pl,
                               const float *A, const float *B);
/* The whole step of the exact/randomized projector (galore_torch's GaLoreProjector): begin, refresh when
 * due, update. */
dopt_status dopt_galore_step(const dopt_galore_spec *sp, const dopt_step_args *a);

/* The layout, frame, whole and step of a GaLore form, over the form's own
 * `static dopt_galore_spec spec(const double *hp)` (the fixed-inner forms
 * ignore hp; the `galore` wrapper reads its inner there), and the impl fields
 * that name them with the form's `validate`. A parameter steps whole when it
 * is projected (its SVD) or when the inner steps it whole (AdamW8bit's 8-bit
 * blocks); otherwise it is the inner's, on any piece. */
#define DOPT_GALORE_FORM_FUNCTIONS                                                                \
  static int layout(const double *hp, int ndim, const int64_t *shape, dopt_state_spec *out) {     \
    dopt_galore_spec sp = spec(hp);                                                               \
    int ni;                                                                                       \
    return dopt_galore_layout(&sp, hp, ndim, shape, 1, out, &ni);                                 \
  }                                                                                               \
  static size_t frame(const double *hp, const dopt_piece *pc) {                                   \
    dopt_galore_spec sp = spec(hp);                                                               \
    return dopt_galore_frame(&sp, hp, pc);                                                        \
  }                                                                                               \
  static int whole(const double *hp, int ndim, const int64_t *shape) {                            \
    dopt_galore_spec sp = spec(hp);                                                               \
    return dopt_galore_whole(&sp, hp, ndim, shape);                                               \
  }                                                                                               \
  static double cost(const double *hp, int ndim, const int64_t *shape) {                          \
    dopt_galore_spec sp = spec(hp);                                                               \
    return dopt_galore_cost(&sp, hp, ndim, shape);                                                \
  }                                                                                               \
  static dopt_status step(const dopt_step_args *a) {                                              \
    dopt_galore_spec sp = spec(a->hp);                                                            \
    return dopt_galore_step(&sp, a);                                                              \
  }
#define DOPT_GALORE_FORM_IMPL                                                                     \
  .validate = validate, .layout = layout, .frame = frame, .step = step, .distributable = 0, .whole = whole, \
  .cost = cost, .projection = 1, .projector_hook = 1

/* Counter-based standard normal: a pure function of (seed, iter, index). */
float dopt_galore_gauss(uint64_t seed, int64_t iter, uint64_t index);

/* Tests only: make the next n SVD attempts (sgesdd or sgesvd calls) fail. */
void dopt__galore_inject_svd_failures(int n);

#endif
