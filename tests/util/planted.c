/* Planted bugs for the counters' tests: see planted.h. */
#include "planted.h"

#include <stdlib.h>
#include <string.h>

#include "optim_impl.h"

extern const dopt_optim_impl dopt_impl_galore_adamw, dopt_impl_adamw8bit;

static int hp_index(const dopt_optim_impl *im, const char *key) {
  for (int k = 0; k < im->nhp; k++)
    if (strcmp(im->hp[k].key, key) == 0) return k;
  return -1;
}

static const dopt_optim_impl *galore(void) { return &dopt_impl_galore_adamw; }
static const dopt_optim_impl *q8(void) { return &dopt_impl_adamw8bit; }
static int gap_key = -1, min8_key = -1;

/* Runs im's step of a on copies of its values and states (each state's bytes as the piece holds it:
 * elementwise [len], blockwise its blocks, whole), its stages one after the other with no reducer (a shared
 * block's maxima local), its counts into counts: wasted work, the real values and states untouched. */
static dopt_status step_on_copies(const dopt_optim_impl *im, const dopt_step_args *a, int64_t *counts) {
  const dopt_piece *pc = a->piece;
  dopt_state_spec sp[DOPT_MAX_STATES];
  const int ns = im->layout(a->hp, a->ndim, a->shape, sp);
  void *copy[DOPT_MAX_STATES] = {0};
  float *w = malloc((pc->len ? pc->len : 1) * sizeof *w);
  dopt_status s = w ? DOPT_OK : DOPT_ERR_NO_MEMORY;
  for (int k = 0; s == DOPT_OK && k < ns; k++) {
    const size_t es = dopt_dtype_size(sp[k].v.dtype);
    const size_t bytes = sp[k].kind == DOPT_STATE_ELEMENTWISE ? pc->len * es
                         : sp[k].kind == DOPT_STATE_BLOCKWISE ? dopt_piece_blocks(pc, sp[k].block, NULL) * es
                                                               : sp[k].v.bytes;
    copy[k] = malloc(bytes ? bytes : 1);
    if (!copy[k]) s = DOPT_ERR_NO_MEMORY;
    else memcpy(copy[k], a->state[k], bytes);
  }
  int more = 0;
  if (s == DOPT_OK) {
    memcpy(w, a->param, pc->len * sizeof *w);
    dopt_step_args b = *a;
    b.param = w, b.state = copy, b.red = NULL, b.counts = counts, b.more = &more;
    for (int stage = 0; s == DOPT_OK; stage++) {
      b.stage = stage, more = 0;
      s = im->step(&b);
      if (!more) break;
    }
  }
  for (int k = 0; k < ns; k++) free(copy[k]);
  free(w);
  return s;
}

/* A refresh run twice: at every step the matrix's step is first run on copies of its values and states (so a
 * due refresh computes its SVD twice, on the same gradient: the same projector, the same bits); only that
 * refresh is counted, the copies' other work is not the bug */
static dopt_status twice_step(const dopt_step_args *a) {
  if (a->ndim != 2 || a->piece->len != a->piece->numel || a->stage != 0) return galore()->step(a);
  int64_t cnt[DOPT_NCOUNTERS] = {0};
  dopt_status s = step_on_copies(galore(), a, cnt);
  if (a->counts) a->counts[DOPT_COUNTER_REFRESHES] += cnt[DOPT_COUNTER_REFRESHES];
  return s == DOPT_OK ? galore()->step(a) : s;
}

/* A refresh skipped: after the first, the distributed side never refreshes (a gap it reads as infinite) */
static dopt_status skip_step(const dopt_step_args *a) {
  if (a->step == 1) return galore()->step(a);
  double hp[DOPT_MAX_HPARAMS];
  memcpy(hp, a->hp, (size_t)galore()->nhp * sizeof *hp);
  hp[gap_key] = 1e9;
  dopt_step_args b = *a;
  b.hp = hp;
  return galore()->step(&b);
}

/* A matrix on the plain path: the distributed side sees it flattened (a model built under ZeRO-3 init), so it
 * steps piecewise with the inner AdamW, unprojected */
static int flat(int ndim, const int64_t *shape, int64_t *one) { /* 2-D, or the checking device's [1, h, w] view */
  if (ndim < 2) return 0;
  one[0] = (int64_t)dopt_numel(ndim, shape);
  return 1;
}
static int flat_layout(const double *hp, int ndim, const int64_t *shape, dopt_state_spec *out) {
  int64_t one[1];
  return flat(ndim, shape, one) ? galore()->layout(hp, 1, one, out) : galore()->layout(hp, ndim, shape, out);
}
static int flat_whole(const double *hp, int ndim, const int64_t *shape) {
  int64_t one[1];
  return flat(ndim, shape, one) ? galore()->whole(hp, 1, one) : galore()->whole(hp, ndim, shape);
}
static size_t flat_frame(const double *hp, const dopt_piece *pc) {
  dopt_piece f = *pc;
  f.factored = 0;
  return galore()->frame ? galore()->frame(hp, &f) : 0;
}
static dopt_status flat_step(const dopt_step_args *a) {
  int64_t one[1];
  if (!a->shape || !flat(a->ndim, a->shape, one)) return galore()->step(a);
  dopt_piece f = *a->piece;
  f.factored = 0;
  dopt_step_args b = *a;
  b.ndim = 1, b.shape = one, b.piece = &f;
  return galore()->step(&b);
}

/* The 8-bit decision made on the shard's numel (bitsandbytes #2080, torchao #4912): min_8bit_size compared
 * with numel / dp, dp = 2 */
static const double *shard_hp(const double *hp, size_t numel, double *buf) {
  if ((double)(numel / 2) >= hp[min8_key]) return hp;
  memcpy(buf, hp, (size_t)q8()->nhp * sizeof *buf);
  buf[min8_key] = (double)numel + 1.0; /* fp32 states */
  return buf;
}
static int shard_layout(const double *hp, int ndim, const int64_t *shape, dopt_state_spec *out) {
  double buf[DOPT_MAX_HPARAMS];
  return q8()->layout(shard_hp(hp, dopt_numel(ndim, shape), buf), ndim, shape, out);
}
static size_t shard_frame(const double *hp, const dopt_piece *pc) {
  double buf[DOPT_MAX_HPARAMS];
  return q8()->frame ? q8()->frame(shard_hp(hp, pc->numel, buf), pc) : 0;
}
static dopt_status shard_step(const dopt_step_args *a) {
  double buf[DOPT_MAX_HPARAMS];
  dopt_step_args b = *a;
  b.hp = shard_hp(a->hp, a->piece->numel, buf);
  return q8()->step(&b);
}

/* The tail piece (the one holding the tensor's last element) steps twice: once on copies, counted */
static dopt_status tail_step(const dopt_step_args *a) {
  const dopt_piece *pc = a->piece;
  if (a->stage != 0 || pc->len == 0 || !a->shape || pc->lo + pc->len != pc->b * pc->hl * pc->wl) return q8()->step(a);
  dopt_status s = step_on_copies(q8(), a, a->counts);
  return s == DOPT_OK ? q8()->step(a) : s;
}

const dopt_optim_impl *dt_planted(int which) {
  static dopt_optim_impl im[DT_PLANT_COUNT];
  static int made;
  if (!made) { /* on the main thread, before any run */
    gap_key = hp_index(galore(), "update_proj_gap");
    min8_key = hp_index(q8(), "min_8bit_size");
    im[DT_PLANT_REFRESH_TWICE] = *galore();
    im[DT_PLANT_REFRESH_TWICE].step = twice_step;
    im[DT_PLANT_REFRESH_SKIPPED] = *galore();
    im[DT_PLANT_REFRESH_SKIPPED].step = skip_step;
    im[DT_PLANT_PLAIN_PATH] = *galore();
    im[DT_PLANT_PLAIN_PATH].layout = flat_layout, im[DT_PLANT_PLAIN_PATH].whole = flat_whole;
    im[DT_PLANT_PLAIN_PATH].frame = flat_frame, im[DT_PLANT_PLAIN_PATH].step = flat_step;
    im[DT_PLANT_Q8_SHARD] = *q8();
    im[DT_PLANT_Q8_SHARD].layout = shard_layout, im[DT_PLANT_Q8_SHARD].frame = shard_frame;
    im[DT_PLANT_Q8_SHARD].step = shard_step;
    im[DT_PLANT_Q8_TAIL_TWICE] = *q8();
    im[DT_PLANT_Q8_TAIL_TWICE].step = tail_step;
    made = gap_key >= 0 && min8_key >= 0;
  }
  return made && which >= 0 && which < DT_PLANT_COUNT ? &im[which] : NULL;
}

const char *dt_planted_what(int which) {
  static const char *const what[] = {"a refresh run twice", "a refresh skipped", "a matrix on the plain path",
                                     "an 8-bit decision on the shard's numel", "the tail piece stepped twice"};
  return which >= 0 && which < DT_PLANT_COUNT ? what[which] : "?";
}
