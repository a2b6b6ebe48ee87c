/* AdamW8bit as bitsandbytes' CUDA `bnb.optim.AdamW8bit` (<= 0.49: block_wise,
 * percentile_clipping; Optimizer2State with the "adam" kernels), fp32
 * parameters. docs/adamw8bit.md has the semantics and where they come from.
 *
 *   numel >= min_8bit_size: blockwise 8-bit states (dopt_q8_adam_update):
 *     state1 U8 [shape] (signed map), state2 U8 [shape] (unsigned map),
 *     absmax1, absmax2 F32 [ceil(numel / block_size)]
 *   else: fp32 state1, state2 [shape] and the 32-bit kernel (dopt_q8_adam32_update)
 *   percentile_clipping < 100: + gnorm_vec F32 [100]
 *
 * All states start as zeros, as upstream initialises them (torch.zeros):
 * state1 byte 0 decodes to code1[0]·absmax = −0.99296875·0 = −0.0, so the
 * first step starts from m = −0, v = 0. (The padding of the last block uses
 * byte 128 for state1; that is the kernel's fill value for slots beyond
 * numel, not the initial value.) The quantisation maps qmap1/qmap2 are
 * constants (dopt_q8_map) and not stored. */
#include <math.h>
#include <stdio.h>

#include "distopt/quant8.h"
#include "registry.h"

enum { LR, BETA1, BETA2, EPS, WD, MIN8, PCT, BLOCK, NHP };

static const dopt_hp_def hps[NHP] = {
    DOPT_ADAMW8BIT_HPS("decoupled weight decay, applied after the step (p *= 1 - lr*wd)",
                       "tensors with fewer elements keep fp32 states",
                       "clip the gradient at this percentile of its last 100 norms (100 = off)", DOPT_Q8_BLOCK_DEFAULT,
                       "quantisation block (256 = bitsandbytes >= 0.44, 2048 = <= 0.43)"),
};
_Static_assert((int)NHP == (int)DOPT_ADAMW8BIT_NHP, "AdamW8bit's keys");

static int is_int(double v) { return v == floor(v); }

/* hp[0..7] in this table's order (galore_adamw8bit shares it); who: the
 * optimizer name for messages. */
dopt_status dopt__adamw8bit_validate(const char *who, const double *hp) {
  if (hp[LR] < 0) return dopt__fail(DOPT_ERR_INVALID_ARG, "%s: lr=%g must be >= 0", who, hp[LR]);
  if (hp[EPS] < 0) return dopt__fail(DOPT_ERR_INVALID_ARG, "%s: eps=%g must be >= 0", who, hp[EPS]);
  if (!(hp[BETA1] >= 0 && hp[BETA1] < 1))
    return dopt__fail(DOPT_ERR_INVALID_ARG, "%s: beta1=%g must be in [0, 1)", who, hp[BETA1]);
  if (!(hp[BETA2] >= 0 && hp[BETA2] < 1))
    return dopt__fail(DOPT_ERR_INVALID_ARG, "%s: beta2=%g must be in [0, 1)", who, hp[BETA2]);
  if (hp[WD] < 0) return dopt__fail(DOPT_ERR_INVALID_ARG, "%s: weight_decay=%g must be >= 0", who, hp[WD]);
  if (!(hp[MIN8] >= 0 && is_int(hp[MIN8])))
    return dopt__fail(DOPT_ERR_INVALID_ARG, "%s: min_8bit_size=%g must be an integer >= 0", who, hp[MIN8]);
  if (!(hp[PCT] >= 0 && hp[PCT] <= 100 && is_int(hp[PCT])))
    return dopt__fail(DOPT_ERR_INVALID_ARG, "%s: percentile_clipping=%g must be an integer in [0, 100]", who,
                      hp[PCT]);
  if (!(hp[BLOCK] >= 1 && hp[BLOCK] <= DOPT_Q8_BLOCK_MAX && is_int(hp[BLOCK]) && dopt_q8_block_ok((size_t)hp[BLOCK])))
    return dopt__fail(DOPT_ERR_INVALID_ARG, "%s: block_size=%g must be a power of two in [64, 4096]", who,
                      hp[BLOCK]);
  return DOPT_OK;
}

static int use_8bit(const double *hp, size_t numel) { return (double)numel >= hp[MIN8]; }

static dopt_status validate(const double *hp) { return dopt__adamw8bit_validate("adamw8bit", hp); }

int dopt__adamw8bit_whole(const double *hp, size_t numel) { return use_8bit(hp, numel) || hp[PCT] < 100; }

static int whole(const double *hp, int ndim, const int64_t *shape) {
  return dopt__adamw8bit_whole(hp, dopt_numel(ndim, shape));
}

/* The states of an 8-bit Adam over a tensor of this shape (hp[0..7]). */
int dopt__adamw8bit_layout(const double *hp, int ndim, const int64_t *shape, dopt_state_spec *out) {
  const size_t numel = dopt_numel(ndim, shape);
  int n = 0;
  if (use_8bit(hp, numel)) {
    const int64_t nb = (int64_t)dopt_q8_num_blocks(numel, (size_t)hp[BLOCK]);
    dopt_state_def_dtype(&out[n++], "state1", DOPT_U8, ndim, shape, 1);
    dopt_state_def_dtype(&out[n++], "state2", DOPT_U8, ndim, shape, 1);
    dopt_state_def(&out[n++], "absmax1", 1, &nb, 0);
    dopt_state_def(&out[n++], "absmax2", 1, &nb, 0);
  } else {
    dopt_state_def(&out[n++], "state1", ndim, shape, 1);
    dopt_state_def(&out[n++], "state2", ndim, shape, 1);
  }
  if (hp[PCT] < 100) {
    const int64_t h = DOPT_Q8_GNORM_HISTORY;
    dopt_state_def(&out[n++], "gnorm_vec", 1, &h, 0);
  }
  return n;
}

/* One 8-bit Adam step of p[n] with gradient g[n] and the states of
 * dopt__adamw8bit_layout (hp[0..7]; wd: the decay the kernel applies). */
/* A range of whole 8-bit blocks, for dopt_par. */
typedef struct q8_part {
  float *p;
  const float *g;
  void *const *state;
  size_t n, block, parts;
  const dopt_q8_adam_hp *k;
  size_t bad[DOPT_PAR_MAX];
  dopt_status st[DOPT_PAR_MAX];
  char msg[DOPT_PAR_MAX][256];
} q8_part;

static void q8_part_task(void *arg, size_t i) {
  q8_part *t = arg;
  const size_t nb = dopt_q8_num_blocks(t->n, t->block), b0 = nb * i / t->parts, b1 = nb * (i + 1) / t->parts;
  const size_t lo = b0 * t->block, hi = b1 * t->block < t->n ? b1 * t->block : t->n;
  t->st[i] = dopt_q8_adam_update(t->p + lo, t->g + lo, (uint8_t *)t->state[0] + lo, (uint8_t *)t->state[1] + lo,
                                 (float *)t->state[2] + b0, (float *)t->state[3] + b0, hi - lo, t->k, &t->bad[i]);
  if (t->st[i] != DOPT_OK) snprintf(t->msg[i], sizeof t->msg[i], "%s", dopt_last_error());
}

dopt_status dopt__adamw8bit_update(const double *hp, double wd, int64_t step, float *p, const float *g, size_t n,
                                   void *const *state, unsigned *events, const dopt_par *par) {
  const int q8 = use_8bit(hp, n);
  dopt_q8_adam_hp k = {
      .lr = (float)hp[LR],
      .beta1 = (float)hp[BETA1],
      .beta2 = (float)hp[BETA2],
      .eps = (float)hp[EPS],
      .weight_decay = (float)wd,
      .gnorm_scale = 1.0f,
      .step = step,
      .block = (size_t)hp[BLOCK],
  };
  unsigned ev = 0;
  if (hp[PCT] < 100) {
    int clipped = 0;
    k.gnorm_scale = dopt_q8_percentile_clipping(g, n, state[q8 ? 4 : 2], step, (int)hp[PCT], &clipped);
    if (clipped) ev |= DOPT_EVENT_CLIPPED;
  }
  const size_t nblocks = q8 ? dopt_q8_num_blocks(n, k.block) : 0;
  if (q8 && par && par->threads > 1 && nblocks >= 2 * DOPT_PAR_MIN_BLOCKS) {
    q8_part t = {.p = p, .g = g, .state = state, .n = n, .block = k.block, .k = &k};
    t.parts = nblocks / DOPT_PAR_MIN_BLOCKS;
    if (t.parts > (size_t)par->threads) t.parts = (size_t)par->threads;
    if (t.parts > DOPT_PAR_MAX) t.parts = DOPT_PAR_MAX;
    par->run(par->ctx, t.parts, q8_part_task, &t);
    size_t bad = 0;
    for (size_t i = 0; i < t.parts; i++) {
      if (t.st[i] != DOPT_OK) return dopt__fail(t.st[i], "%s", t.msg[i]);
      bad += t.bad[i];
    }
    if (bad) ev |= DOPT_EVENT_NONFINITE_RESET;
  } else if (q8) {
    size_t bad = 0;
    DOPT_TRY(dopt_q8_adam_update(p, g, state[0], state[1], state[2], state[3], n, &k, &bad));
    if (bad) ev |= DOPT_EVENT_NONFINITE_RESET;
  } else {
    DOPT_TRY(dopt_q8_adam32_update(p, g, state[0], state[1], n, &k));
  }
  if (events) *events |= ev;
  return DOPT_OK;
}

static int layout(const double *hp, int ndim, const int64_t *shape, dopt_state_spec *out) {
  return dopt__adamw8bit_layout(hp, ndim, shape, out);
}

static dopt_status step(const dopt_step_args *a) {
  return dopt__adamw8bit_update(a->hp, a->hp[WD], a->step, a->param, a->grad, a->piece->len, a->state, a->events,
                                a->par);
}

/* settings that exercise every path (dopt_optim_impl.example/grid): 8-bit states on small tensors; blocks of 256 that the tensors are not multiples of; percentile clipping with blocks of 2048 */
static const char *const grid[] = {
    "lr=1e-2,min_8bit_size=16,block_size=256",
    "lr=1e-2,min_8bit_size=16,percentile_clipping=5",
    NULL,
};

const dopt_optim_impl dopt_impl_adamw8bit = {
    .name = "adamw8bit",
    .summary = "bitsandbytes AdamW8bit (<= 0.49, CUDA kernel semantics): blockwise 8-bit states, decay after the step",
    .hp = hps,
    .nhp = NHP,
    .validate = validate,
    .layout = layout,
    .step = step,
    .distributable = 0,
    .whole = whole,
    .example = "min_8bit_size=64",
    .grid = grid,
};
