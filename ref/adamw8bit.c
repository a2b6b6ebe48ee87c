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
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>

#include "distopt/quant8.h"
#include "quant8_fast.h"
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

/* The states of an 8-bit Adam over a tensor of this shape (hp[0..7]). The
 * codes are elementwise (sharded like the parameter) and the absmax values
 * blockwise (a piece holds the blocks its elements fall in). */
int dopt__adamw8bit_layout(const double *hp, int ndim, const int64_t *shape, dopt_state_spec *out) {
  const size_t numel = dopt_numel(ndim, shape);
  int n = 0;
  if (use_8bit(hp, numel)) {
    dopt_state_def_dtype(&out[n++], "state1", DOPT_U8, ndim, shape, 1);
    dopt_state_def_dtype(&out[n++], "state2", DOPT_U8, ndim, shape, 1);
    dopt_state_def_blocks(&out[n++], "absmax1", DOPT_F32, numel, (size_t)hp[BLOCK]);
    dopt_state_def_blocks(&out[n++], "absmax2", DOPT_F32, numel, (size_t)hp[BLOCK]);
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

/* ---- the step on a piece ---------------------------------------------------------------
 * Stages (docs/adamw8bit.md, docs/distributed.md "8-bit blocks"):
 *   percentile clipping only: 0 posts the MAX of ‖g‖²'s exact sum, 1 its
 *   words; 2 updates gnorm_vec and takes the gradient scale, then goes on as
 *   the first stage below;
 *   fp32 states (numel < min_8bit_size, decided on the logical numel): the
 *   elementwise kernel, done;
 *   8-bit: every block whose elements all lie in this piece steps whole
 *   (dopt_q8_adam_update); for the blocks it shares with other pieces
 *   (a->shared) the piece posts the maxima of its elements' new states
 *   (dopt_q8_adam_absmax), and in the next stage applies the update with
 *   their MAX (dopt_q8_adam_apply) and stores it as the blocks' absmax. */
typedef struct q8_frame {
  dopt_ss_stat ss; /* percentile clipping: Σg² */
  float gscale;    /* its gradient scale (1: none) */
} q8_frame;

static size_t frame(const double *hp, const dopt_piece *pc) {
  (void)hp, (void)pc;
  return sizeof(q8_frame);
}

/* A range of whole 8-bit blocks, for dopt_par. */
typedef struct q8_part {
  float *p;
  const float *g;
  uint8_t *s1, *s2;
  float *a1, *a2;
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
  t->st[i] = dopt_q8_adam_update(t->p + lo, t->g + lo, t->s1 + lo, t->s2 + lo, t->a1 + b0, t->a2 + b0, hi - lo, t->k,
                                 &t->bad[i]);
  if (t->st[i] != DOPT_OK) snprintf(t->msg[i], sizeof t->msg[i], "%s", dopt_last_error());
}

/* n elements from the start of a block: whole blocks (the last may end with the tensor), over par's threads
 * when there are many */
static dopt_status whole_blocks(float *p, const float *g, uint8_t *s1, uint8_t *s2, float *a1, float *a2, size_t n,
                                const dopt_q8_adam_hp *k, const dopt_par *par, size_t *bad) {
  const size_t nblocks = dopt_q8_num_blocks(n, k->block);
  size_t b = 0;
  if (!par || par->threads < 2 || nblocks < 2 * DOPT_PAR_MIN_BLOCKS) {
    DOPT_TRY(dopt_q8_adam_update(p, g, s1, s2, a1, a2, n, k, &b));
    *bad += b;
    return DOPT_OK;
  }
  q8_part t = {.p = p, .g = g, .s1 = s1, .s2 = s2, .a1 = a1, .a2 = a2, .n = n, .block = k->block, .k = k};
  t.parts = nblocks / DOPT_PAR_MIN_BLOCKS;
  if (t.parts > (size_t)par->threads) t.parts = (size_t)par->threads;
  if (t.parts > DOPT_PAR_MAX) t.parts = DOPT_PAR_MAX;
  par->run(par->ctx, t.parts, q8_part_task, &t);
  for (size_t i = 0; i < t.parts; i++) {
    if (t.st[i] != DOPT_OK) return dopt__fail(t.st[i], "%s", t.msg[i]);
    *bad += t.bad[i];
  }
  return DOPT_OK;
}

/* Walks the piece's blocks in order. Phase 0: whole blocks step, shared blocks' maxima into sh->max. Phase 1:
 * shared blocks apply the MAX of those maxima and store it. t: the block's index among the piece's blocks (its
 * absmax slot); si: its index in the shared list. */
static dopt_status walk_blocks(const dopt_step_args *a, const dopt_q8_adam_hp *k, int phase, size_t *bad) {
  const dopt_piece *pc = a->piece;
  const dopt_block_share *sh = a->shared && a->shared->n ? a->shared : NULL;
  const size_t B = k->block, numel = pc->numel, nb = dopt_q8_num_blocks(numel, B);
  uint8_t *s1 = a->state[0], *s2 = a->state[1];
  float *a1 = a->state[2], *a2 = a->state[3];
  if (sh && sh->block != B)
    return dopt__fail(DOPT_ERR_STATE, "adamw8bit: shared blocks of %zu elements, block_size=%zu", sh->block, B);
  size_t t = 0, last = SIZE_MAX, si = 0, off = 0, pend = SIZE_MAX; /* pend: phase 1's block awaiting its absmax */
  float pm1 = 0.0f, pm2 = 0.0f;
  dopt_run r;
  while (dopt_piece_next_run(pc, &off, &r)) {
    for (size_t pos = r.at, end = r.at + r.len; pos < end;) {
      const size_t blk = pos / B, o = r.off + (pos - r.at);
      if (blk != last) {
        if (last != SIZE_MAX) t++;
        last = blk;
      }
      while (sh && si < sh->n && sh->idx[si] < blk) si++;
      if (sh && si < sh->n && sh->idx[si] == blk) { /* a block other pieces hold elements of */
        const size_t e = end < (blk + 1) * B ? end : (blk + 1) * B, n = e - pos;
        if (phase == 0) {
          const size_t pad = blk == nb - 1 && numel % B ? B - numel % B : 0;
          float m1 = -FLT_MAX, m2 = -FLT_MAX;
          DOPT_TRY(dopt_q8_adam_absmax(a->grad + o, s1 + o, s2 + o, a1[t], a2[t], n, pad, k, &m1, &m2, bad));
          if ((double)m1 > sh->max[2 * si]) sh->max[2 * si] = m1;
          if ((double)m2 > sh->max[2 * si + 1]) sh->max[2 * si + 1] = m2;
        } else {
          if (pend != SIZE_MAX && pend != t) a1[pend] = pm1, a2[pend] = pm2;
          pend = t, pm1 = (float)sh->max[2 * si], pm2 = (float)sh->max[2 * si + 1];
          DOPT_TRY(dopt_q8_adam_apply(a->param + o, a->grad + o, s1 + o, s2 + o, a1[t], a2[t], pm1, pm2, n, k));
        }
        pos = e;
        continue;
      }
      /* whole blocks up to the run's end or the next shared block */
      size_t stop = end;
      if (sh && si < sh->n && sh->idx[si] * B < stop) stop = sh->idx[si] * B;
      if (pos % B || (stop % B && stop != numel))
        return dopt__fail(DOPT_ERR_STATE, "adamw8bit: the piece holds part of block %zu of %zu elements (logical [%zu, %zu)) "
                          "that is not in its shared list", pos % B ? blk : (stop - 1) / B, B, pos, stop);
      if (phase == 0)
        DOPT_TRY(whole_blocks(a->param + o, a->grad + o, s1 + o, s2 + o, a1 + t, a2 + t, stop - pos, k, a->par, bad));
      last = (stop - 1) / B;
      t += last - blk;
      pos = stop;
    }
  }
  if (pend != SIZE_MAX) a1[pend] = pm1, a2[pend] = pm2;
  return DOPT_OK;
}

static dopt_status step(const dopt_step_args *a) {
  const double *hp = a->hp;
  const int pct = hp[PCT] < 100, q8 = use_8bit(hp, a->piece->numel); /* the logical tensor's, never the piece's */
  q8_frame *f = a->frame;
  int stage = a->stage;
  if (pct) {
    if (stage < 2) {
      *a->more = 1;
      return stage == 0 ? dopt_ss_begin(&f->ss, a->grad, a->piece->len, a->red)
                        : dopt_ss_accum(&f->ss, a->grad, a->piece->len, a->red);
    }
    if (stage == 2) {
      int clipped = 0;
      f->gscale = dopt__q8_percentile_scale(dopt_ss_value(&f->ss), a->state[q8 ? 4 : 2], a->step, (int)hp[PCT],
                                            &clipped);
      if (clipped) dopt_count(a, DOPT_COUNTER_CLIPPED, 1);
    }
    stage -= 2;
  } else if (stage == 0) {
    f->gscale = 1.0f;
  }
  const dopt_q8_adam_hp k = {
      .lr = (float)hp[LR],
      .beta1 = (float)hp[BETA1],
      .beta2 = (float)hp[BETA2],
      .eps = (float)hp[EPS],
      .weight_decay = (float)hp[WD],
      .gnorm_scale = f->gscale,
      .step = a->step,
      .block = (size_t)hp[BLOCK],
  };
  if (!q8) {
    if (*a->more == 0) dopt_count(a, DOPT_COUNTER_Q8_FP32_STEPS, 1); /* the last stage */
    return dopt_q8_adam32_update(a->param, a->grad, a->state[0], a->state[1], a->piece->len, &k);
  }
  size_t bad = 0;
  const dopt_block_share *sh = a->shared && a->shared->n ? a->shared : NULL;
  if (stage == 0) {
    for (size_t i = 0; sh && i < 2 * sh->n; i++) sh->max[i] = -INFINITY; /* blocks this piece has no element of */
    DOPT_TRY(walk_blocks(a, &k, 0, &bad));
    if (sh && a->red) {
      *a->more = 1;
      DOPT_TRY(a->red->post_max_f64(a->red->ctx, sh->max, 2 * sh->n));
    } else if (sh) { /* one piece: its maxima are the totals */
      DOPT_TRY(walk_blocks(a, &k, 1, &bad));
    }
  } else {
    DOPT_TRY(walk_blocks(a, &k, 1, &bad));
  }
  if (*a->more) return DOPT_OK; /* the counts once, at the last stage */
  dopt_count(a, DOPT_COUNTER_Q8_STEPS, 1);
  if (bad) { /* the kernels' count depends on how the blocks were walked: the elements, counted once */
    size_t n = 0;
    for (size_t i = 0; i < a->piece->len; i++) n += isfinite(a->grad[i]) ? 0u : 1u;
    dopt_count(a, DOPT_COUNTER_NONFINITE_RESETS, (int64_t)n);
  }
  return DOPT_OK;
}

static int layout(const double *hp, int ndim, const int64_t *shape, dopt_state_spec *out) {
  return dopt__adamw8bit_layout(hp, ndim, shape, out);
}

/* settings that exercise every path (dopt_optim_impl.example/grid): 8-bit states on small tensors; blocks of 64
 * that the grid's tensors (up to 169 elements) straddle across ZeRO and TP edges, with their padding; one partial
 * block of 256 per tensor, shared by every piece; percentile clipping (the norm of the whole gradient) */
static const char *const grid[] = {
    "lr=1e-2,min_8bit_size=16,block_size=64",
    "lr=1e-2,min_8bit_size=16,block_size=256",
    "lr=1e-2,min_8bit_size=16,percentile_clipping=5,block_size=64,weight_decay=0.01",
    NULL,
};

const dopt_optim_impl dopt_impl_adamw8bit = {
    .name = "adamw8bit",
    .summary = "bitsandbytes AdamW8bit (<= 0.49, CUDA kernel semantics): blockwise 8-bit states, decay after the step",
    .hp = hps,
    .nhp = NHP,
    .validate = validate,
    .layout = layout,
    .frame = frame,
    .step = step,
    .distributable = 1,
    .example = "min_8bit_size=64",
    .grid = grid,
    .grid_ci = 2,
};
