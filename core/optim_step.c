/* The optimizer object's step (core/optim.c owns the object): the staged step
 * loop, which runs a step's stages for every parameter as work items over the
 * thread pool with the pieces' posts reduced between stages, the wrapper's
 * schedule (LISA) applied before it, and dopt__run_stages, the same stages
 * back to back for one tensor on a device (docs/threads.md). */
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>

#include "elem.h"
#include "optim_impl.h"
#include "optim_object.h"
#include "pool.h"

dopt_status dopt__run_stages(const dopt_device *dev, const dopt_step_args *a) {
  dopt_step_args s = *a;
  for (int stage = 0;; stage++) {
    int again = 0;
    s.stage = stage;
    s.more = &again;
    DOPT_TRY(dev ? dev->ops->step(dev->ctx, &s) : s.impl->step(&s));
    if (!again) return DOPT_OK;
  }
}

/* A wrapper's schedule (LISA) for this step: frozen flags, and the state reset. */
static dopt_status apply_schedule(dopt_optim *o) {
  const size_t n = o->nparams > 0 ? (size_t)o->nparams : 1;
  int *layer = malloc(n * sizeof *layer);
  unsigned char *frozen = calloc(n, 1);
  int reset = 0;
  dopt_status s = layer && frozen ? DOPT_OK : dopt__fail(DOPT_ERR_NO_MEMORY, "%s: %d parameters", o->wrapper->name,
                                                           o->nparams);
  for (int i = 0; s == DOPT_OK && i < o->nparams; i++) layer[i] = o->params[i].layer;
  if (s == DOPT_OK) s = o->wrapper->wrap->schedule(o->whp, o->gstep, o->nparams, layer, frozen, &reset);
  for (int i = 0; s == DOPT_OK && i < o->nparams; i++) {
    o->params[i].frozen = frozen[i];
    o->params[i].cnt_last[DOPT_COUNTER_FROZEN] = frozen[i] != 0;
    if (reset && o->params[i].layer >= 0) {
      dopt__optim_free_states(o, i);
      o->params[i].cnt_last[DOPT_COUNTER_RESETS] = 1;
    }
  }
  free(layer);
  free(frozen);
  return s;
}

/* Elements below which a parameter is not split further (128 KiB of fp32):
 * smaller pieces cost more in reductions and wake-ups than they save. */
#define DOPT_MIN_CHUNK ((size_t)1 << 15)

/* ---- the step: work items over a thread pool -----------------------------------
 * A step is a list of work items: one per parameter that has a gradient, or,
 * for a distributable optimizer (impl->distributable) and a parameter of at
 * least 2·min_chunk elements, up to `threads` items, each a flat range of the
 * tensor: a piece as distributed/ gives a ZeRO-sharded rank. The items of one
 * parameter run each stage in parallel with a reducer that records what they
 * post; between stages the posted arrays are reduced over the pieces as a
 * collective would (MAX over doubles, wrapping integer SUM over the exact
 * sums' words) and the result is written back to each piece. The statistics
 * are exact, so a parameter's result is bitwise the one-piece result for any
 * number of pieces, i.e. for any thread count (docs/threads.md). Elementwise
 * states are sliced like the parameter; the others (row/column statistics, a
 * scalar RMS) are whole in every piece, which computes the same values: piece
 * 0 works on the parameter's own copy, the others on private copies. */

dopt_status dopt_optim_set_projector_hook(dopt_optim *o, dopt_projector_fn fn, void *user) {
  DOPT_CHECK_ARG(o != NULL, "dopt_optim_set_projector_hook: optimizer=NULL");
  if (!o->impl->projector_hook)
    return dopt__fail(DOPT_ERR_UNSUPPORTED, "dopt_optim_set_projector_hook: optimizer '%s' has no projector a caller "
                      "can supply (galore, galore_adamw, galore_adamw8bit, or lisa around one)", o->impl->name);
  o->hook.fn = fn;
  o->hook.user = user;
  return DOPT_OK;
}

dopt_status dopt_optim_set_threads(dopt_optim *o, int nthreads) {
  DOPT_CHECK_ARG(o != NULL, "dopt_optim_set_threads: optimizer=NULL");
  DOPT_CHECK_ARG(nthreads >= 0 && nthreads <= DOPT_MAX_THREADS,
                 "dopt_optim_set_threads: nthreads=%d must be in 0..%d (0: the default)", nthreads, DOPT_MAX_THREADS);
  if (nthreads != o->threads) {
    dopt__pool_destroy(o->pool);
    o->pool = NULL;
  }
  o->threads = nthreads;
  return DOPT_OK;
}

int dopt_optim_get_threads(const dopt_optim *o) {
  if (!o) return 0;
  if (o->pool) return dopt__pool_threads(o->pool);
  int n = 1;
  if (o->threads > 0) return o->threads;
  return dopt__default_threads(&n) == DOPT_OK ? n : 0;
}

void dopt__optim_set_min_chunk(dopt_optim *o, size_t elements) { o->min_chunk = elements; }
int dopt__optim_last_parts(const dopt_optim *o) { return o->last_parts; }

/* The pool for the thread count (created at the first step that needs it). */
static dopt_status ensure_pool(dopt_optim *o, int *threads) {
  int n = o->threads;
  if (n == 0) DOPT_TRY(dopt__default_threads(&n));
  *threads = n;
  if (o->pool && dopt__pool_threads(o->pool) == n) return DOPT_OK;
  dopt__pool_destroy(o->pool); /* another count (DOPT_NUM_THREADS changed between steps) */
  o->pool = NULL;
  return n == 1 ? DOPT_OK : dopt__pool_create(n, &o->pool);
}

static dopt_status record_post(item *it, int sum, void *x, size_t n) {
  if (it->nposts == it->posts_cap) {
    int cap = it->posts_cap ? 2 * it->posts_cap : 8;
    post *q = realloc(it->posts, (size_t)cap * sizeof *q);
    if (!q) return dopt__fail(DOPT_ERR_NO_MEMORY, "step: %d posted reductions", cap);
    it->posts = q;
    it->posts_cap = cap;
  }
  it->posts[it->nposts++] = (post){sum, x, n};
  return DOPT_OK;
}
static dopt_status post_max(void *ctx, double *x, size_t n) { return record_post(ctx, 0, x, n); }
static dopt_status post_sum(void *ctx, int64_t *x, size_t n) { return record_post(ctx, 1, x, n); }

static dopt_status grow(void **buf, size_t *cap, size_t bytes, const char *what, const char *pname) {
  if (bytes <= *cap) return DOPT_OK;
  void *b = realloc(*buf, bytes);
  if (!b) return dopt__fail(DOPT_ERR_NO_MEMORY, "step: %s of %zu bytes for '%s'", what, bytes, pname);
  *buf = b;
  *cap = bytes;
  return DOPT_OK;
}

/* Item it of parameter i, piece part of parts: its piece, frame and states. */
static dopt_status setup_item(dopt_optim *o, item *it, int i, int part, int parts) {
  dopt_param *p = &o->params[i];
  const double *hp = o->groups[p->group].hp;
  it->param = i, it->part = part, it->parts = parts;
  memset(it->counts, 0, sizeof it->counts);
  it->stage = 0, it->more = 0, it->nposts = 0, it->st = DOPT_OK, it->solo = 0;
  dopt_piece_full(p->ndim, p->shape, &it->pc);
  /* pieces of whole blocks when the parameter has blockwise states: no block is shared between them */
  const size_t B = p->qblock ? p->qblock : 1, nb = (p->numel + B - 1) / B;
  const size_t b0 = nb * (size_t)part / (size_t)parts, b1 = nb * (size_t)(part + 1) / (size_t)parts;
  it->pc.lo = b0 * B < p->numel ? b0 * B : p->numel;
  it->pc.len = (b1 * B < p->numel ? b1 * B : p->numel) - it->pc.lo;
  DOPT_TRY(grow(&it->frame, &it->frame_cap, o->impl->frame ? o->impl->frame(hp, &it->pc) : 0, "step frame", p->name));
  size_t whole = 0;
  for (int k = 0; part > 0 && k < p->nstates; k++)
    if (p->kind[k] == DOPT_STATE_WHOLE) whole += (p->st[k].bytes + 15) & ~(size_t)15;
  DOPT_TRY(grow(&it->whole, &it->whole_cap, whole, "state copies", p->name));
  unsigned char *w = it->whole;
  for (int k = 0; k < p->nstates; k++) {
    if (p->kind[k] == DOPT_STATE_ELEMENTWISE) {
      it->state[k] = (unsigned char *)p->st[k].data + it->pc.lo * dopt_dtype_size(p->st[k].dtype);
    } else if (p->kind[k] == DOPT_STATE_BLOCKWISE) { /* this piece's blocks [b0, b1) */
      it->state[k] = (unsigned char *)p->st[k].data + b0 * dopt_dtype_size(p->st[k].dtype);
    } else if (part == 0) {
      it->state[k] = p->st[k].data;
    } else {
      memcpy(w, p->st[k].data, p->st[k].bytes);
      it->state[k] = w;
      w += (p->st[k].bytes + 15) & ~(size_t)15;
    }
  }
  return DOPT_OK;
}

typedef struct step_run {
  dopt_optim *o;
  const void *const *grads;
  const dopt_dtype *gdt; /* [nparams] the gradients' types (NULL: every one fp32) */
  int *todo;  /* item_task: the items of this round */
  int *split; /* reduce_task: the first items of the split parameters of this round */
  dopt_par par; /* for solo items */
} step_run;

/* dopt_par.run for solo items (ctx: the step_run); counts the parts as pieces */
static void par_run(void *ctx, size_t n, void (*task)(void *arg, size_t i), void *arg) {
  dopt_optim *o = ((struct step_run *)ctx)->o;
  if ((int)n > o->last_parts) o->last_parts = (int)n;
  dopt__pool_run(o->pool, n, task, arg);
}

typedef struct range_job {
  void (*fn)(void *arg, size_t lo, size_t hi);
  void *arg;
  size_t n, parts;
} range_job;

static void range_task(void *arg, size_t p) {
  const range_job *j = arg;
  j->fn(j->arg, j->n * p / j->parts, j->n * (p + 1) / j->parts);
}

size_t dopt__par_parts(const dopt_par *par) {
  const size_t parts = par && par->threads > 1 ? (size_t)par->threads : 1;
  return parts > DOPT_PAR_MAX ? DOPT_PAR_MAX : parts;
}

void dopt__par_ranges(const dopt_par *par, size_t n, size_t min, void (*fn)(void *arg, size_t lo, size_t hi),
                      void *arg) {
  size_t parts = dopt__par_parts(par);
  while (parts > 1 && n / parts < min) parts--;
  if (parts <= 1) {
    fn(arg, 0, n);
    return;
  }
  range_job j = {fn, arg, n, parts};
  par->run(par->ctx, parts, range_task, &j);
}

/* ---- bf16 parameters and gradients -------------------------------------------------------------------------
 * A bf16 parameter steps its fp32 master (p->data) and keeps its working copy (p->work) the master rounded to
 * nearest even. Before the step, an element whose working copy is no longer its master rounded was written
 * outside the optimizer (a loaded model, p.data.copy_): its master takes the working copy's value; elements
 * nobody wrote keep their master's low bits. A bf16 gradient is widened to fp32, exactly. The loops are compiled
 * also for AVX2 and AVX-512 and picked per call (the same bits: integer operations and exact widening). */
static inline __attribute__((always_inline)) void bf16_in_body(float *m, const uint16_t *w, const uint16_t *gb,
                                                               float *g, size_t n) {
  if (w)
    for (size_t k = 0; k < n; k++) {
      uint32_t u, wu = (uint32_t)w[k] << 16;
      memcpy(&u, &m[k], sizeof u);
      u = dopt_bf16_of_bits(u) == w[k] ? u : wu;
      memcpy(&m[k], &u, sizeof u);
    }
  if (gb)
    for (size_t k = 0; k < n; k++) {
      const uint32_t u = (uint32_t)gb[k] << 16;
      memcpy(&g[k], &u, sizeof u);
    }
}

static inline __attribute__((always_inline)) void bf16_out_body(const float *m, uint16_t *w, size_t n) {
  for (size_t k = 0; k < n; k++) {
    uint32_t u;
    memcpy(&u, &m[k], sizeof u);
    w[k] = dopt_bf16_of_bits(u);
  }
}

#if defined(__GNUC__) && defined(__x86_64__)
__attribute__((target("avx512f,avx512bw"))) static void bf16_in_avx512(float *m, const uint16_t *w,
                                                                      const uint16_t *gb, float *g, size_t n) {
  bf16_in_body(m, w, gb, g, n);
}
__attribute__((target("avx2"))) static void bf16_in_avx2(float *m, const uint16_t *w, const uint16_t *gb, float *g,
                                                         size_t n) {
  bf16_in_body(m, w, gb, g, n);
}
__attribute__((target("avx512f,avx512bw"))) static void bf16_out_avx512(const float *m, uint16_t *w, size_t n) {
  bf16_out_body(m, w, n);
}
__attribute__((target("avx2"))) static void bf16_out_avx2(const float *m, uint16_t *w, size_t n) {
  bf16_out_body(m, w, n);
}
#endif

/* Elements [0, n): the master m follows its working copy w where that was written outside (w NULL: an fp32
 * parameter), and the bf16 gradient gb is widened into g (gb NULL: none). */
static void bf16_in(float *m, const uint16_t *w, const uint16_t *gb, float *g, size_t n) {
#if defined(__GNUC__) && defined(__x86_64__)
  if (__builtin_cpu_supports("avx512bw")) {
    bf16_in_avx512(m, w, gb, g, n);
    return;
  }
  if (__builtin_cpu_supports("avx2")) {
    bf16_in_avx2(m, w, gb, g, n);
    return;
  }
#endif
  bf16_in_body(m, w, gb, g, n);
}

/* Elements [0, n): the working copy w ← the master m rounded to nearest even. */
static void bf16_out(const float *m, uint16_t *w, size_t n) {
#if defined(__GNUC__) && defined(__x86_64__)
  if (__builtin_cpu_supports("avx512bw")) {
    bf16_out_avx512(m, w, n);
    return;
  }
  if (__builtin_cpu_supports("avx2")) {
    bf16_out_avx2(m, w, n);
    return;
  }
#endif
  bf16_out_body(m, w, n);
}

/* Elements per run of a pointwise step on a bf16 parameter or gradient: its gradient run, parameter, states
 * and working copy stay in L1/L2 between widening, stepping and rounding. */
enum { BF16_RUN = 8192 };

/* A pointwise optimizer's step (dopt_optim_impl.pointwise) on item it of a bf16 parameter or with a bf16
 * gradient, in runs of BF16_RUN elements: per run the master follows outside writes, the gradient is widened,
 * the run is stepped as a piece of its own and its working copy rounded. a: the item's arguments. */
static dopt_status pointwise_runs(const dopt_param *p, const item *it, const dopt_step_args *a, const float *gf,
                                  const uint16_t *gb) {
  float g[BF16_RUN];
  void *st[DOPT_MAX_STATES];
  dopt_step_args r = *a;
  dopt_piece sub = it->pc;
  const size_t lo = it->pc.lo;
  for (size_t off = 0; off < it->pc.len; off += BF16_RUN) {
    const size_t n = it->pc.len - off < BF16_RUN ? it->pc.len - off : BF16_RUN;
    sub.lo = lo + off, sub.len = n;
    for (int k = 0; k < p->nstates; k++) /* pointwise: every state is elementwise */
      st[k] = (unsigned char *)it->state[k] + off * dopt_dtype_size(p->st[k].dtype);
    r.piece = &sub, r.param = p->data + lo + off, r.state = st;
    r.grad = gb ? g : gf + lo + off;
    bf16_in(p->data + lo + off, p->work ? p->work + lo + off : NULL, gb ? gb + lo + off : NULL, g, n);
    DOPT_TRY(dopt__run_stages(NULL, &r));
    if (p->work) bf16_out(p->data + lo + off, p->work + lo + off, n);
  }
  return DOPT_OK;
}

/* One round's task for one item: a whole parameter runs all its stages; a
 * piece runs its next stage. */
static void item_task(void *ctx, size_t t) {
  step_run *r = ctx;
  dopt_optim *o = r->o;
  item *it = &o->items[r->todo[t]];
  dopt_param *p = &o->params[it->param];
  const size_t lo = it->pc.lo;
  const int gbf = r->gdt && r->gdt[it->param] == DOPT_BF16;
  const float *gf = gbf ? NULL : r->grads[it->param];
  const uint16_t *gb = gbf ? r->grads[it->param] : NULL;
  it->red = (dopt_reducer){it, post_max, post_sum}; /* here: the items array moves while it grows */
  dopt_step_args a = {.impl = o->impl,
                      .hp = o->groups[p->group].hp,
                      .step = p->step,
                      .piece = &it->pc,
                      .param = p->data + lo,
                      .grad = gbf ? it->g32 : gf + lo,
                      .state = it->state,
                      .frame = it->frame,
                      .red = it->parts > 1 ? &it->red : NULL,
                      .counts = it->counts,
                      .tensor = (uint64_t)it->param,
                      .stage = it->stage,
                      .more = &it->more,
                      .par = it->solo ? &r->par : NULL,
                      .proj_hook = o->hook.fn ? &o->hook : NULL,
                      .ndim = p->ndim,
                      .shape = p->shape};
  dopt_status s;
  const int runs = o->impl->pointwise && (p->work || gbf);
  if (!runs && it->stage == 0 && (p->work || gbf)) /* the master follows outside writes; the gradient widened */
    bf16_in(p->data + lo, p->work ? p->work + lo : NULL, gb ? gb + lo : NULL, it->g32, it->pc.len);
  if (runs) {
    s = pointwise_runs(p, it, &a, gf, gb);
    it->more = 0;
  } else if (it->parts == 1) {
    s = dopt__run_stages(NULL, &a); /* no reducer: the stages follow each other directly */
    it->more = 0;
  } else {
    it->more = 0;
    it->nposts = 0;
    s = o->impl->step(&a);
  }
  if (s != DOPT_OK) {
    it->st = s;
    snprintf(it->msg, sizeof it->msg, "%s", dopt_last_error());
    return;
  }
  /* mixed precision: the working bf16 copy is the rounded master */
  if (!runs && !it->more && p->work) bf16_out(p->data + lo, p->work + lo, it->pc.len);
}

/* The reduction between two stages of one split parameter whose first piece
 * is item f: every piece posted the same arrays (same order, kinds, sizes). */
static void reduce_task(void *ctx, size_t t) {
  step_run *r = ctx;
  item *its = &r->o->items[r->split[t]];
  const int parts = its[0].parts;
  for (int q = 1; q < parts; q++)
    if (its[q].nposts != its[0].nposts) its[0].st = DOPT_ERR_STATE;
  for (int j = 0; its[0].st == DOPT_OK && j < its[0].nposts; j++) {
    const post *p0 = &its[0].posts[j];
    for (int q = 1; q < parts; q++)
      if (its[q].posts[j].sum != p0->sum || its[q].posts[j].n != p0->n) its[0].st = DOPT_ERR_STATE;
    if (its[0].st != DOPT_OK) break;
    if (p0->sum) {
      uint64_t *acc = p0->x; /* wrapping, as the transports' integer sums */
      for (int q = 1; q < parts; q++) {
        const int64_t *x = its[q].posts[j].x;
        for (size_t e = 0; e < p0->n; e++) acc[e] += (uint64_t)x[e];
      }
    } else {
      double *acc = p0->x; /* the transports' MAX: the later operand when it is larger */
      for (int q = 1; q < parts; q++) {
        const double *x = its[q].posts[j].x;
        for (size_t e = 0; e < p0->n; e++) acc[e] = x[e] > acc[e] ? x[e] : acc[e];
      }
    }
    const size_t bytes = p0->n * (p0->sum ? sizeof(int64_t) : sizeof(double));
    for (int q = 1; q < parts; q++) memcpy(its[q].posts[j].x, p0->x, bytes);
  }
  if (its[0].st != DOPT_OK)
    snprintf(its[0].msg, sizeof its[0].msg, "step: the %d pieces of '%.200s' posted different reductions", parts,
             r->o->params[its[0].param].name);
}

/* The first failing item's status and message, if any (lowest item first). */
static dopt_status first_failure(const dopt_optim *o) {
  for (int k = 0; k < o->nitems; k++)
    if (o->items[k].st != DOPT_OK) return dopt__fail(o->items[k].st, "%s", o->items[k].msg);
  return DOPT_OK;
}

dopt_status dopt_optim_step(dopt_optim *o, const float *const *grads) {
  return dopt_optim_step_typed(o, (const void *const *)grads, NULL);
}

dopt_status dopt_optim_set_mode(dopt_optim *o, int eval) {
  DOPT_CHECK_ARG(o != NULL, "dopt_optim_set_mode: optimizer=NULL");
  DOPT_CHECK_ARG(eval == 0 || eval == 1, "dopt_optim_set_mode: eval=%d (0 train, 1 evaluation)", eval);
  if (!o->impl->swap)
    return dopt__fail(DOPT_ERR_UNSUPPORTED, "dopt_optim_set_mode: optimizer '%s' has one point for training and "
                      "evaluation (no modes; adamw_schedulefree has two)", o->impl->name);
  if (o->eval == eval) return DOPT_OK;
  for (int i = 0; i < o->nparams; i++) {
    dopt_param *p = &o->params[i];
    if (p->nstates == 0 || p->step < 1) continue; /* never stepped: upstream has no z for it */
    void *st[DOPT_MAX_STATES];
    for (int k = 0; k < p->nstates; k++) st[k] = p->st[k].data;
    if (p->work) bf16_in(p->data, p->work, NULL, NULL, p->numel); /* outside writes first, as a step */
    o->impl->swap(o->groups[p->group].hp, eval, p->step, p->numel, p->data, st);
    p->cnt_total[DOPT_COUNTER_SWAPS]++; /* not a step's: the totals only */
    if (p->work) bf16_out(p->data, p->work, p->numel);
  }
  o->eval = eval;
  return DOPT_OK;
}

int dopt_optim_get_mode(const dopt_optim *o) { return o ? o->eval : 0; }

dopt_status dopt_optim_declare_mode(dopt_optim *o, int eval) {
  DOPT_CHECK_ARG(o != NULL, "dopt_optim_declare_mode: optimizer=NULL");
  DOPT_CHECK_ARG(eval == 0 || eval == 1, "dopt_optim_declare_mode: eval=%d (0 train, 1 evaluation)", eval);
  if (!o->impl->swap && eval)
    return dopt__fail(DOPT_ERR_UNSUPPORTED, "dopt_optim_declare_mode: optimizer '%s' has no evaluation mode",
                      o->impl->name);
  o->eval = eval;
  return DOPT_OK;
}

dopt_status dopt_optim_step_typed(dopt_optim *o, const void *const *grads, const dopt_dtype *dtypes) {
  DOPT_CHECK_ARG(o != NULL, "dopt_optim_step: optimizer=NULL");
  if (o->eval)
    return dopt__fail(DOPT_ERR_STATE, "dopt_optim_step: optimizer '%s' is in evaluation mode (set train mode with "
                      "dopt_optim_set_mode(o, 0) before stepping)", o->impl->name);
  DOPT_CHECK_ARG(grads != NULL || o->nparams == 0, "dopt_optim_step: grads=NULL");
  for (int i = 0; dtypes && i < o->nparams; i++)
    if (grads[i] && dtypes[i] != DOPT_F32 && dtypes[i] != DOPT_BF16)
      return dopt__fail(DOPT_ERR_INVALID_ARG, "dopt_optim_step: the gradient of parameter %d ('%s') is %s; F32 or BF16",
                        i, o->params[i].name, dopt_dtype_name(dtypes[i]));
  int threads = 1;
  DOPT_TRY(ensure_pool(o, &threads));
  for (int i = 0; i < o->nparams; i++) memset(o->params[i].cnt_last, 0, sizeof o->params[i].cnt_last);
  if (o->wrapper) DOPT_TRY(apply_schedule(o));
  const size_t chunk = o->min_chunk ? o->min_chunk : DOPT_MIN_CHUNK;
  /* the items: pieces of a parameter are consecutive */
  o->nitems = 0;
  o->last_parts = 0;
  for (int i = 0; i < o->nparams; i++) {
    dopt_param *p = &o->params[i];
    if (!grads[i] || p->frozen) continue; /* grad None (or frozen by a wrapper): untouched, as torch */
    DOPT_TRY(dopt__optim_alloc_states(o, p));
    size_t parts = 1;
    const int whole = dopt__impl_whole(o->impl, o->groups[p->group].hp, p->ndim, p->shape);
    if (!whole && threads > 1 && p->numel / chunk >= 2)
      parts = p->numel / chunk < (size_t)threads ? p->numel / chunk : (size_t)threads;
    if (o->nitems + (int)parts > o->items_cap) {
      int cap = o->items_cap ? o->items_cap : 16;
      while (cap < o->nitems + (int)parts) cap *= 2;
      item *q = realloc(o->items, (size_t)cap * sizeof *q);
      if (!q) return dopt__fail(DOPT_ERR_NO_MEMORY, "dopt_optim_step: %d work items", cap);
      memset(q + o->items_cap, 0, (size_t)(cap - o->items_cap) * sizeof *q);
      o->items = q;
      o->items_cap = cap;
    }
    p->step++;
    p->cnt_last[DOPT_COUNTER_STEPS] = 1;
    for (size_t k = 0; k < parts; k++) {
      item *it = &o->items[o->nitems++];
      DOPT_TRY(setup_item(o, it, i, (int)k, (int)parts));
      if (dtypes && dtypes[i] == DOPT_BF16 && !o->impl->pointwise) /* widened for the whole step: its stages */
        DOPT_TRY(grow((void **)&it->g32, &it->g32_cap, (it->pc.len ? it->pc.len : 1) * sizeof(float), "gradient",
                      p->name));
    }
    /* a large whole tensor steps alone, its independent blocks over the threads */
    o->items[o->nitems - 1].solo = threads > 1 && whole && p->numel / chunk >= 2;
    if ((int)parts > o->last_parts) o->last_parts = (int)parts;
  }
  int *todo = malloc(2 * (size_t)(o->nitems > 0 ? o->nitems : 1) * sizeof *todo), *split = todo + o->nitems;
  if (!todo) return dopt__fail(DOPT_ERR_NO_MEMORY, "dopt_optim_step: %d work items", o->nitems);
  step_run run = {o, grads, dtypes, todo, split, {NULL, threads, par_run}};
  run.par.ctx = &run;
  /* the solo items one after the other; round 0: every other item; then the
   * split parameters' later stages */
  int n = 0;
  dopt_status s = DOPT_OK;
  for (int k = 0; k < o->nitems && s == DOPT_OK; k++) {
    if (!o->items[k].solo) continue;
    todo[0] = k;
    item_task(&run, 0);
    s = first_failure(o);
  }
  for (int k = 0; k < o->nitems; k++)
    if (!o->items[k].solo) todo[n++] = k;
  if (s != DOPT_OK) n = 0;
  while (n > 0) {
    dopt__pool_run(o->pool, (size_t)n, item_task, &run);
    if ((s = first_failure(o)) != DOPT_OK) break;
    int nr = 0; /* the split parameters that asked for another stage */
    for (int k = 0; k < o->nitems; k += o->items[k].parts) {
      const int parts = o->items[k].parts;
      int more = 0;
      for (int q = 0; q < parts; q++) more += o->items[k + q].more != 0;
      if (parts == 1 || more == 0) continue;
      if (more != parts) {
        s = dopt__fail(DOPT_ERR_STATE, "dopt_optim_step: the pieces of '%s' disagree on the number of stages",
                       o->params[o->items[k].param].name);
        break;
      }
      split[nr++] = k;
    }
    if (s != DOPT_OK) break;
    dopt__pool_run(o->pool, (size_t)nr, reduce_task, &run);
    if ((s = first_failure(o)) != DOPT_OK) break;
    n = 0;
    for (int r = 0; r < nr; r++)
      for (int q = 0; q < o->items[split[r]].parts; q++) {
        o->items[split[r] + q].stage++;
        todo[n++] = split[r] + q;
      }
  }
  free(todo);
  for (int k = 0; k < o->nitems; k++) dopt_counts_merge(o->params[o->items[k].param].cnt_last, o->items[k].counts);
  for (int i = 0; i < o->nparams; i++) dopt_counts_add(o->params[i].cnt_total, o->params[i].cnt_last);
  if (s == DOPT_OK) o->gstep++;
  return s;
}
