/* Adam-mini as PyPI adam-mini 1.1.1's Adam_mini (Zhang et al. 2024, "Adam-mini: Use Fewer Learning Rates To
 * Gain More"), fp32: Adam's first moment per element, its second moment one value per block.
 *
 * The block of a parameter is a group key (upstream derives it from the parameter's name and the model's dim and
 * n_heads; distopt.adam_mini_groups applies the same rules, docs/optimizers.md):
 *   block=elementwise  plain Adam (upstream's "bias" parameters): v ← β2·v + (1−β2)·G⊙G per element
 *   block=neuron       one v per row of the [..., h, w] view (upstream: embeddings, output, values, MLPs, the
 *                      attention output): mean over the row's w elements
 *   block=head         one v per head_numel consecutive elements (upstream: queries and keys, dim²/n_heads each)
 *   block=tensor       one v for the whole tensor (upstream's default: norms, anything unnamed)
 * Per step t of a parameter P with gradient G (scalars in double, as Python computes them):
 *   mean_k = Σ_{block k} G² / |block|              (exact sum, rounded once)
 *   vmean_k ← β2·vmean_k + (1−β2)·mean_k          (mul_, then add_(alpha=): one fused multiply-add)
 *   P ← P·(1 − lr·wd)   (wd > 0)
 *   m ← lerp(m, G, 1 − β1)
 *   h_k = √vmean_k / √(1 − β2^t) + eps;  P ← P − lr·(m·((1/h_k)·(1/(1 − β1^t))))
 * (upstream's (1/bc1)/h is torch's scalar / tensor: the reciprocal of h times the scalar). Elementwise blocks
 * take the bias branch's addcdiv: P ← P + (−lr/bc1)·m / h. Every block sum is exact (a segment statistic over
 * the logical tensor), so a sharded step gives the single device's bits whatever cuts the blocks. */
#include <math.h>

#include "elem.h"
#include "registry.h"

enum { LR, BETA1, BETA2, EPS, WD, BLOCK, HEAD_NUMEL, NHP };
enum { B_TENSOR, B_NEURON, B_HEAD, B_ELEMENTWISE };
static const char *const blocks[] = {"tensor", "neuron", "head", "elementwise", NULL};

static const dopt_hp_def hps[NHP] = {
    [LR] = {"lr", DOPT_HP_REAL, 1e-3, "learning rate"},
    [BETA1] = {"beta1", DOPT_HP_REAL, 0.9, "first-moment decay (betas[0])"},
    [BETA2] = {"beta2", DOPT_HP_REAL, 0.999, "second-moment decay (betas[1])"},
    [EPS] = {"eps", DOPT_HP_REAL, 1e-8, "added to the bias-corrected sqrt(vmean)"},
    [WD] = {"weight_decay", DOPT_HP_REAL, 0.0, "decoupled decay p *= 1 - lr*wd (upstream: 0 for norm, ln, bias)"},
    [BLOCK] = {"block", DOPT_HP_ENUM, B_TENSOR,
               "what shares one second moment: tensor, neuron (a row), head (head_numel elements), elementwise",
               blocks},
    [HEAD_NUMEL] = {"head_numel", DOPT_HP_INT, 0.0, "elements per head of block=head (upstream: dim*dim/n_heads)"},
};

static dopt_status validate(const double *hp) {
  if (!(hp[LR] >= 0)) return dopt__fail(DOPT_ERR_INVALID_ARG, "adam_mini: lr=%g must be >= 0", hp[LR]);
  for (int k = BETA1; k <= BETA2; k++)
    if (!(hp[k] >= 0 && hp[k] < 1))
      return dopt__fail(DOPT_ERR_INVALID_ARG, "adam_mini: %s=%g must be in [0, 1)", hps[k].key, hp[k]);
  if (!(hp[EPS] >= 0)) return dopt__fail(DOPT_ERR_INVALID_ARG, "adam_mini: eps=%g must be >= 0", hp[EPS]);
  if (!(hp[WD] >= 0)) return dopt__fail(DOPT_ERR_INVALID_ARG, "adam_mini: weight_decay=%g must be >= 0", hp[WD]);
  if (!(hp[HEAD_NUMEL] >= 0 && hp[HEAD_NUMEL] <= 1e15))
    return dopt__fail(DOPT_ERR_INVALID_ARG, "adam_mini: head_numel=%g must be in [0, 1e15]", hp[HEAD_NUMEL]);
  if ((int)hp[BLOCK] == B_HEAD && hp[HEAD_NUMEL] < 1)
    return dopt__fail(DOPT_ERR_INVALID_ARG, "adam_mini: block=head needs head_numel >= 1 (dim*dim/n_heads)");
  return DOPT_OK;
}

/* Elements per block of a tensor of numel elements whose [b, h, w] view has rows of w (0: elementwise). */
static size_t block_size(const double *hp, int ndim, size_t numel, size_t w) {
  switch ((int)hp[BLOCK]) {
  case B_ELEMENTWISE: return 0;
  case B_HEAD: return (size_t)hp[HEAD_NUMEL];
  case B_NEURON: return ndim >= 2 ? w : numel; /* a vector is one row */
  default: return numel;
  }
}

static int layout(const double *hp, int ndim, const int64_t *shape, dopt_state_spec *out) {
  dopt_state_def(&out[0], "m", ndim, shape, 1);
  if ((int)hp[BLOCK] == B_ELEMENTWISE) {
    dopt_state_def(&out[1], "v", ndim, shape, 1);
    return 2;
  }
  size_t b, h, w;
  const size_t numel = dopt_numel(ndim, shape);
  if (ndim >= 2) dopt_split_bhw(ndim, shape, &b, &h, &w);
  else w = numel;
  const size_t S = block_size(hp, ndim, numel, w);
  if ((int)hp[BLOCK] == B_TENSOR) { /* upstream: a 0-d tensor */
    dopt_state_def(&out[1], "vmean", 0, shape, 0);
  } else { /* upstream: [blocks, 1] */
    const int64_t vs[2] = {(int64_t)(S ? numel / S : 0), 1};
    dopt_state_def(&out[1], "vmean", 2, vs, 0);
  }
  return 2;
}

static size_t frame(const double *hp, const dopt_piece *pc) {
  if ((int)hp[BLOCK] == B_ELEMENTWISE) return 0;
  dopt_frame f = {NULL, 0};
  dopt_seg_stat sg;
  dopt_seg_take(&f, pc->numel, block_size(hp, pc->factored ? 2 : 1, pc->numel, pc->w), &sg);
  return f.off;
}

/* The update of one block's local elements [off, off + n) (block k). */
typedef struct update_parts {
  float *p, *m;
  const float *g, *vmean;
  float decay, omb1, bc2s, eps, c1, lr;
  int use_wd;
} update_parts;
static void update_part(void *ctx, size_t k, size_t off, size_t n) {
  const update_parts *u = ctx;
  const float hk = sqrtf(u->vmean[k]) / u->bc2s + u->eps;
  const float stepsize = (1.0f / hk) * u->c1; /* (1/bc1)/h: h.reciprocal() * (1/bc1) */
  for (size_t i = off; i < off + n; i++) {
    const float pi = u->use_wd ? u->p[i] * u->decay : u->p[i];
    u->m[i] = dopt_lerp_elem(u->m[i], u->g[i], u->omb1);
    u->p[i] = pi + -((u->m[i] * stepsize) * u->lr); /* update = m·stepsize; update.mul_(lr); p.add_(-update) */
  }
}

/* Stages (blocks): S0 MAX the blocks' largest squares; S1 SUM their words; S2 the moments and the update.
 * Elementwise: one stage. */
static dopt_status step(const dopt_step_args *a) {
  const double *hp = a->hp;
  const dopt_piece *pc = a->piece;
  const size_t n = pc->len;
  float *p = a->param, *m = a->state[0];
  const float *g = a->grad;
  const double t = (double)a->step, bc1 = 1.0 - pow(hp[BETA1], t), bc2 = 1.0 - pow(hp[BETA2], t);
  const float decay = (float)(1.0 - hp[LR] * hp[WD]), omb1 = (float)(1.0 - hp[BETA1]);
  const float b2 = (float)hp[BETA2], omb2 = (float)(1.0 - hp[BETA2]), bc2s = (float)sqrt(bc2), eps = (float)hp[EPS];
  const int use_wd = hp[WD] > 0.0;
  if ((int)hp[BLOCK] == B_ELEMENTWISE) { /* upstream's bias branch */
    float *v = a->state[1];
    const float neg_step = (float)(-(hp[LR] / bc1));
    for (size_t i = 0; i < n; i++) {
      v[i] = v[i] * b2 + (omb2 * g[i]) * g[i]; /* mul_(beta2).addcmul_(g, g, value=1 - beta2) */
      const float pi = use_wd ? p[i] * decay : p[i];
      m[i] = dopt_lerp_elem(m[i], g[i], omb1);
      const float hi = sqrtf(v[i]) / bc2s + eps;
      p[i] = pi + (neg_step * m[i]) / hi; /* addcdiv_(m, h, value=-lr/bc1) */
    }
    return DOPT_OK;
  }
  const size_t S = block_size(hp, pc->factored ? 2 : 1, pc->numel, pc->w);
  if (S == 0 || pc->numel % S != 0)
    return dopt__fail(DOPT_ERR_INVALID_ARG, "adam_mini: a parameter of %zu elements is not a whole number of "
                      "blocks of %zu (block=%s, head_numel=%g)", pc->numel, S, blocks[(int)hp[BLOCK]], hp[HEAD_NUMEL]);
  dopt_frame fr = {a->frame, 0};
  dopt_seg_stat sg;
  dopt_seg_take(&fr, pc->numel, S, &sg);
  if (a->stage == 0) {
    *a->more = 1;
    return dopt_seg_begin(&sg, g, pc, a->red);
  }
  if (a->stage == 1) {
    *a->more = 1;
    return dopt_seg_accum(&sg, g, pc, a->red);
  }
  float *vmean = a->state[1];
  for (size_t k = 0; k < sg.nseg; k++) { /* whole on every rank: every block's mean */
    const float mean = (float)(dopt_seg_value(&sg, k) / (double)S);
    vmean[k] = fmaf(mean, omb2, vmean[k] * b2); /* mul_(beta2).add_(mean, alpha=1 - beta2) */
  }
  update_parts u = {p, m, g, vmean, decay, omb1, bc2s, eps, (float)(1.0 / bc1), (float)hp[LR], use_wd};
  dopt_seg_parts(S, pc, update_part, &u);
  return DOPT_OK;
}

/* settings that reach every block kind (the grid's tensors have 1..13 rows and columns: a head of one element
 * divides every one of them) */
static const char *const grid[] = {
    "lr=1e-2,weight_decay=0.05,block=neuron",
    "lr=1e-2,block=tensor",
    "lr=1e-2,block=head,head_numel=1,beta1=0.5",
    "lr=1e-2,block=elementwise,weight_decay=0.1",
    NULL,
};

const dopt_optim_impl dopt_impl_adam_mini = {
    .name = "adam_mini",
    .summary = "Adam-mini as adam-mini's Adam_mini (one second moment per block: tensor, neuron, head)",
    .hp = hps,
    .nhp = NHP,
    .validate = validate,
    .layout = layout,
    .frame = frame,
    .step = step,
    .distributable = 1,
    .grid = grid,
};
