/* One rank of a comparison (harness.h): the distributed optimizer and, on the lead, the reference side by side
 * for the steps of its world; each step measured, checked and (after the last) digested. */
#include <errno.h>
#include <fnmatch.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "compare.h"
#include "distopt/cuda.h"
#include "distopt/dpsum.h"
#include "distopt/launch.h"
#include "distopt/mpi.h"
#include "distopt/safetensors.h"
#include "distopt/sim.h"
#include "files.h"
#include "internal.h"
#include "model.h"
#include "registry.h"
#include "verify.h"
#include "harness.h"

/* A CPU clock in seconds (CLOCK_THREAD_CPUTIME_ID, CLOCK_PROCESS_CPUTIME_ID). */
static double cpu_now(clockid_t c) {
  struct timespec ts;
  return clock_gettime(c, &ts) == 0 ? (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec : 0.0;
}

/* ---- the optimizer on one rank ---------------------------------------------------------- */

/* The plain optimizer of the source's parameters. data [np]: each parameter's own copy of its initial
 * values (the reference steps on them); data NULL: the source's own (a template that is never stepped:
 * dopt_dist_create, save and load only read it, so the rank threads share one). work [np]: the bf16
 * working copies (with o->bf16; NULL otherwise). */
/* dist: the distributed side's template (cmp_options.dist_impl when a test plants one) */
dopt_status ce_build_plain(const cmp_options *o, const source *s, int dist, float **data, uint16_t **work,
                               dopt_optim **out) {
  dopt_optim *opt;
  DOPT_TRY(dist && o->dist_impl ? dopt__optim_create_impl(o->dist_impl, o->hparams, &opt)
                                 : dopt_optim_create(o->optimizer, o->hparams, &opt));
  int *gid = calloc((size_t)o->ngroups + 1, sizeof *gid);
  dopt_status st = gid ? DOPT_OK : dopt__fail(DOPT_ERR_NO_MEMORY, "compare: %d groups", o->ngroups);
  for (int g = 0; g < o->ngroups && st == DOPT_OK; g++) st = dopt_optim_add_group(opt, o->groups[g].hp, &gid[g]);
  for (int g = 0; g < o->ngroups && st == DOPT_OK; g++) { /* as run: a pattern that matches nothing is refused */
    int hit = 0;
    for (int i = 0; i < s->np && !hit; i++) hit = fnmatch(o->groups[g].glob, s->p[i].name, 0) == 0;
    if (!hit)
      st = dopt__fail(DOPT_ERR_INVALID_ARG, "group '%s': the pattern matches none of the %d parameters (the first: "
                      "'%s')", o->groups[g].glob, s->np, s->np ? s->p[0].name : "");
  }
  for (int i = 0; i < s->np && st == DOPT_OK; i++) {
    int group = 0;
    for (int g = 0; g < o->ngroups; g++)
      if (fnmatch(o->groups[g].glob, s->p[i].name, 0) == 0) {
        group = gid[g];
        break;
      }
    float *vals = s->init[i];
    if (data) {
      data[i] = vals = malloc((s->numel[i] ? s->numel[i] : 1) * sizeof(float));
      if (!vals) {
        st = dopt__fail(DOPT_ERR_NO_MEMORY, "parameter '%s'", s->p[i].name);
        break;
      }
      memcpy(vals, s->init[i], s->numel[i] * sizeof(float));
    }
    work[i] = NULL;
    dopt_param_config pc = DOPT_PARAM_CONFIG_INIT;
    pc.name = s->p[i].name;
    pc.ndim = s->p[i].ndim;
    memcpy(pc.shape, s->p[i].shape, sizeof pc.shape);
    pc.data = vals;
    pc.layer = dopt_layer_from_name(s->p[i].name); /* LISA */
    if (o->bf16) {
      work[i] = malloc(s->numel[i] * sizeof(uint16_t));
      if (!work[i]) {
        st = dopt__fail(DOPT_ERR_NO_MEMORY, "parameter '%s'", s->p[i].name);
        break;
      }
      for (size_t k = 0; k < s->numel[i]; k++) work[i][k] = dopt_f32_to_bf16(vals[k]);
      pc.dtype = DOPT_BF16;
      pc.master = vals;
      pc.data = work[i];
    }
    st = dopt_optim_add_param(opt, group, &pc, NULL);
  }
  free(gid);
  if (st != DOPT_OK) {
    dopt_optim_destroy(opt);
    return st;
  }
  *out = opt;
  return DOPT_OK;
}

/* This rank's TP block (dopt_tp_block, the library's rule) of a logical tensor [b, h, w] into blk. */
static void tp_slice(const cmp_param *p, int tp, int r, const float *full, float *blk) {
  dopt_piece pc;
  dopt_tp_block(p->ndim, p->shape, p->role, tp, r, &pc);
  for (size_t bi = 0; bi < pc.b; bi++)
    for (size_t i = 0; i < pc.hl; i++)
      memcpy(blk + (bi * pc.hl + i) * pc.wl, full + (bi * pc.h + pc.h0 + i) * pc.w + pc.w0, pc.wl * sizeof(float));
}

/* Elements of one reference chunk: the dp · micro parts of a synthetic gradient are generated, summed and averaged
 * a chunk of whole rows at a time, each chunk's start a multiple of the exact
 * sum's 256-element blocks (DOPT_GRID_BLOCK), so its codes — and every bit — are those of the whole tensor's sum,
 * while the reference holds parts × a chunk instead of parts × the largest tensor. */
enum { REF_CHUNK = 1 << 18 };

/* Parameter i's reference chunk: its elements (0: whole — a trace or recording, a tensor with b > 1, one row or an
 * expert stack, or one no larger than a chunk), and the rows per chunk. */
static size_t ref_chunk(const cmp_options *o, const source *s, int i, size_t *rows) {
  dopt_piece pc;
  dopt_piece_full(s->p[i].ndim, s->p[i].shape, &pc);
  *rows = pc.h;
  if (s->trace || s->rec || pc.b != 1 || pc.h == 1 || ce_ep_stack(o, s, i) || s->numel[i] <= REF_CHUNK) return 0;
  size_t g = DOPT_GRID_BLOCK, w = pc.w; /* rows whose elements are whole blocks: a multiple of 256 / gcd(w, 256) */
  for (size_t a = w, b = DOPT_GRID_BLOCK; b;) g = b, b = a % b, a = g;
  const size_t step = DOPT_GRID_BLOCK / g;
  size_t r = REF_CHUNK / w / step * step;
  if (r == 0) r = step;
  if (r >= pc.h) return 0;
  *rows = r;
  return r * w;
}

/* The most elements a reference chunk of any parameter holds (a whole parameter where it is not chunked). */
static size_t ref_chunk_max(const cmp_options *o, const source *s) {
  size_t most = 1, rows;
  for (int i = 0; i < s->np; i++) {
    const size_t c = ref_chunk(o, s, i, &rows), n = c ? c : s->numel[i];
    most = n > most ? n : most;
  }
  return most;
}

/* Part of parameter i's gradient (step t, shard sh): the rows of the chunk at element c0 (ce: its elements, rows
 * per chunk), or the whole tensor (ce 0). */
static dopt_status ref_part(const source *s, int i, int t, int sh, size_t ce, size_t rows, size_t c0, float *out) {
  if (!ce) return ce_shard_grad(s, i, t, sh, out);
  dopt_piece pc;
  dopt_piece_full(s->p[i].ndim, s->p[i].shape, &pc);
  const size_t h0 = c0 / pc.w, hl = pc.h - h0 < rows ? pc.h - h0 : rows;
  (s->fast ? ce_synth_fast : ce_synth_block)(s, i, t, sh, h0, hl, 0, pc.w, out);
  return DOPT_OK;
}

/* The reference's averaged gradients of step t, for each parameter chunk by chunk (ref_chunk): each DP rank's
 * micro-batches summed in order, the dp sum of those (exact, or fp32 in rank order: dopt_dp_sum), one division
 * by dp · micro; batch invariant: the exact sum of all dp · micro micro-batch gradients. moe_hybrid: an expert's
 * over the dp ranks of its ep rank only (its moe_dp group), divided by moe_dp · micro. acc: [dp · micro ·
 * ref_chunk_max]; *nonfinite: a non-finite averaged element. */
static dopt_status reference_grads(const cmp_options *o, const source *s, int t, float **avg, float *acc, float *g,
                                   int *nonfinite) {
  const int micro = ce_micro_of(o, s);
  const float **pv = malloc((size_t)o->dp * (size_t)micro * sizeof *pv);
  if (!pv) return dopt__fail(DOPT_ERR_NO_MEMORY, "compare: %d x %d gradient parts", o->dp, micro);
  dopt_status st = DOPT_OK;
  *nonfinite = 0;
  for (int i = 0; i < s->np; i++) {
    size_t rows, len, c0 = 0;
    const size_t ce = ref_chunk(o, s, i, &rows), n = s->numel[i];
    do { /* once for an empty parameter */
      len = ce ? (n - c0 < ce ? n - c0 : ce) : n;
      int np = 0, nd = 0; /* parts; the dp ranks that hold the parameter (moe_hybrid: an expert's moe_dp group) */
      for (int d = 0; d < o->dp; d++) {
        if (!ce_holds_param(o, s, i, d)) continue;
        nd++;
        if (o->batch_invariant) { /* every micro-batch gradient is a part of its own */
          for (int m = 0; m < micro; m++) {
            float *a = acc + (size_t)np * len;
            if ((st = ref_part(s, i, t, ce_shard_of(o, s, d, m), ce, rows, c0, a)) != DOPT_OK) goto done;
            if (ce_ep_stack(o, s, i)) ce_own_experts_only(o, s, i, d, a);
            pv[np++] = a;
          }
          continue;
        }
        float *a = acc + (size_t)np * len;
        for (int m = 0; m < micro; m++) {
          if ((st = ref_part(s, i, t, ce_shard_of(o, s, d, m), ce, rows, c0, g)) != DOPT_OK) goto done;
          for (size_t k = 0; k < len; k++) a[k] = m == 0 ? g[k] : a[k] + g[k];
        }
        if (ce_ep_stack(o, s, i)) ce_own_experts_only(o, s, i, d, a);
        pv[np++] = a;
      }
      if ((st = dopt_dp_sum(pv, np, o->dp_sum_words, len, avg[i] + c0)) != DOPT_OK) goto done;
      const float denom = (float)((double)(ce_ep_stack(o, s, i) ? o->dp / o->ep : nd) * (double)micro);
      for (size_t k = c0; k < c0 + len; k++) {
        avg[i][k] = avg[i][k] / denom;
        *nonfinite |= !isfinite(avg[i][k]);
      }
      c0 += len;
    } while (c0 < n);
  }
done:
  free(pv);
  return st;
}

/* The final digests (docs/digest.md): on the lead after the last step, each
 * gathered distributed tensor goes into dg and the reference's own into rdg,
 * under the plan's name and in its order. A parameter and its bf16 copy are
 * described by the plan's layout on both sides. */
static dopt_status digest_both(dopt_digest *dg, dopt_digest *rdg, const cmp_tensor_stat *t, const void *got,
                               const void *ref, size_t bytes) {
  DOPT_TRY(dopt_digest_tensor(dg, t->name, t->dtype, t->ndim, t->shape, got, bytes));
  return dopt_digest_tensor(rdg, t->name, t->dtype, t->ndim, t->shape, ref, bytes);
}

/* A parameter's step count, "<p>/step" (an I64 scalar, as `distopt run` writes it). */
static dopt_status digest_steps(int64_t ds, int64_t rs, const char *pname, dopt_digest *dg, dopt_digest *rdg) {
  char name[96];
  snprintf(name, sizeof name, "%s/step", pname);
  DOPT_TRY(dopt_digest_tensor(dg, name, DOPT_I64, 0, NULL, &ds, sizeof ds));
  return dopt_digest_tensor(rdg, name, DOPT_I64, 0, NULL, &rs, sizeof rs);
}

/* One step of the reference on the lead: the averaged gradient of step t (o's
 * layout), skip on a non-finite one, clipping, the step. */
static dopt_status reference_step(const cmp_options *o, const source *s, int t, dopt_optim *ref, float **avg,
                                  float *acc, float *g, int *skipped) {
  int bad = 0;
  DOPT_TRY(reference_grads(o, s, t, avg, acc, g, &bad));
  *skipped = bad;
  if (bad) return DOPT_OK;
  if (o->max_grad_norm > 0) {
    double *ss = malloc((size_t)s->np * sizeof *ss);
    if (!ss) return dopt__fail(DOPT_ERR_NO_MEMORY, "compare: %d squared sums", s->np);
    for (int i = 0; i < s->np; i++) ss[i] = dopt_xsum_sq(avg[i], s->numel[i]);
    float coef = dopt_clip_coef(ss, s->np, o->max_grad_norm, NULL);
    free(ss);
    for (int i = 0; i < s->np; i++)
      for (size_t k = 0; k < s->numel[i]; k++) avg[i][k] = avg[i][k] * coef;
  }
  return dopt_optim_step(ref, (const float *const *)avg);
}

/* One rank's run on its TP and DP transports (either backend). */
/* The reference's counts since the previous call, per parameter and counter (step: [np · DOPT_NCOUNTERS],
 * or NULL); prev holds the totals of the previous call. */
static dopt_status reference_counts(const dopt_optim *ref, int np, int64_t *prev, int64_t *step) {
  for (int i = 0; i < np; i++) {
    dopt_counters c = DOPT_COUNTERS_INIT;
    DOPT_TRY(dopt_optim_counters(ref, i, &c));
    int64_t *pv = prev + (size_t)i * DOPT_NCOUNTERS;
    for (int k = 0; k < DOPT_NCOUNTERS; k++) {
      if (step) step[(size_t)i * DOPT_NCOUNTERS + (size_t)k] = c.total[k] - pv[k];
      pv[k] = c.total[k];
    }
  }
  return DOPT_OK;
}

/* Adds step t's reference counts to the run's totals, and t to the refresh steps when a projector refreshed. */
static dopt_status note_counts(cmp_result *r, int t, int np, const int64_t *step) {
  int refreshed = 0;
  for (int i = 0; i < np; i++)
    for (int k = 0; k < DOPT_NCOUNTERS; k++) {
      const int64_t v = step[(size_t)i * DOPT_NCOUNTERS + (size_t)k];
      r->event_totals[k] += v;
      refreshed |= k == DOPT_COUNTER_REFRESHES && v > 0;
    }
  if (!refreshed) return DOPT_OK;
  int *n = realloc(r->refresh_steps, ((size_t)r->nrefresh + 1) * sizeof *n);
  if (!n) return dopt__fail(DOPT_ERR_NO_MEMORY, "compare: %d refresh steps", r->nrefresh + 1);
  r->refresh_steps = n;
  r->refresh_steps[r->nrefresh++] = t;
  return DOPT_OK;
}
/* One rank's run (ce_rank_run): its distributed optimizer, the lead's reference, and the buffers both use. */
typedef struct rank_state {
  run_ctx *x;
  const cmp_options *o;
  const source *s;
  cmp_result *r;
  int rank, lead, np, micro;
  int sliced;  /* a recording: each gradient read whole, then sliced */
  int to_lead; /* the gathers deliver to the lead only (each rank measures with backend mpi: to every rank) */
  dopt_dist_config cfg;
  size_t maxn, parts;
  /* per parameter: the reference's values, averaged gradient and bf16 copy (lead); this rank's TP block of the
   * gradient (allocated when first needed: the first micro-batch's is written into the distributed optimizer's
   * accumulator, dopt_dist_grad_buffer); the bf16 copies of an own template (without a shared one); TP roles;
   * whether this rank holds each (this stage's, this ep rank's), and the gradients passed */
  float **rdata, **avg, **loc;
  int ref_in_place; /* rdata are the source's initial values (not freed here) */
  size_t *lnumel;
  uint16_t **work, **rwork;
  dopt_tp_role *roles;
  unsigned char *held;
  const float **gp;
  /* whole-tensor buffers (the largest tensor): a recording's gradient before it is sliced (synthetic and trace
   * gradients come as this rank's block); the lead's reference gradients (acc: every dp part), gathers and bf16
   * measurements */
  float *full, *acc, *got, *wf;
  uint16_t *wgot;
  unsigned char *rep; /* every rank's step counters against rank 0's (dopt_dist_check_replicas) */
  size_t repn;
  int64_t *cprev, *cstep; /* the lead's reference counters: totals at the previous step, and this step's counts */
  void *sgot;             /* the lead's gathered state, grown and kept */
  size_t sgot_cap;
  const dopt_optim *plain;
  dopt_optim *own, *ref;
  dopt_dist_optim *d;
  dopt_digest *dg, *rdg; /* the lead's final digests: distributed, reference */
} rank_state;

/* The distributed optimizer's configuration for this rank's groups. */
static void rank_config(const run_ctx *x, const rank_groups *rg, dopt_dist_config *cfg) {
  const cmp_options *o = x->o;
  *cfg = (dopt_dist_config)DOPT_DIST_CONFIG_INIT;
  cfg->plugin = o->plugin;
  cfg->zero_stage = o->zero;
  cfg->max_grad_norm = o->max_grad_norm;
  cfg->dp_sum_words = o->dp_sum_words;
  cfg->batch_invariant = o->batch_invariant;
  cfg->device = x->dev;
  cfg->tp = rg->tp;
  cfg->dp = rg->dp;
  cfg->pp = rg->pp;
  if (ce_moe_of(o, x->s)) { /* the experts (named experts.<e>.) over ep */
    cfg->ep = rg->ep;
    cfg->moe_dp = rg->mdp;
    cfg->experts = x->s->expert;
    cfg->num_experts = x->s->nexperts;
  }
  cfg->chunk_elems = strcmp(o->plugin, "gemini") == 0 ? (o->chunk_size ? o->chunk_size : CMP_GEMINI_CHUNK_DEFAULT) : 0;
  cfg->stages = x->stages;
}

/* The buffers of rank_state (the lead steps the reference and measures: rank 0, or every rank with backend mpi). */
static dopt_status rank_alloc(rank_state *k) {
  const cmp_options *o = k->o;
  const source *s = k->s;
  const int lead = k->lead, np = k->np;
  const size_t npc = np > 0 ? (size_t)np : 1;
  k->rdata = calloc(npc, sizeof *k->rdata), k->avg = calloc(npc, sizeof *k->avg), k->loc = calloc(npc, sizeof *k->loc);
  k->work = calloc(npc, sizeof *k->work), k->rwork = calloc(npc, sizeof *k->rwork);
  k->roles = calloc(npc, sizeof *k->roles);
  k->gp = calloc(npc, sizeof *k->gp);
  k->held = calloc(npc, 1), k->lnumel = calloc(npc, sizeof *k->lnumel);
  k->maxn = 1;
  for (int i = 0; i < np; i++) k->maxn = s->numel[i] > k->maxn ? s->numel[i] : k->maxn;
  k->parts = (size_t)o->dp * (size_t)ce_micro_of(o, s);
  if (k->x->replay && (size_t)k->x->replay->dp * (size_t)ce_micro_of(k->x->replay, s) > k->parts)
    k->parts = (size_t)k->x->replay->dp * (size_t)ce_micro_of(k->x->replay, s);
  const size_t maxn = k->maxn;
  const int whole = lead || k->sliced;
  /* the lead's reference gradients, a chunk at a time (ref_chunk); a recording's gradient before it is sliced */
  size_t chunk = ref_chunk_max(o, s), rchunk = k->x->replay ? ref_chunk_max(k->x->replay, s) : 0;
  if (rchunk > chunk) chunk = rchunk;
  k->full = whole ? malloc((k->sliced ? maxn : chunk) * sizeof(float)) : NULL;
  k->acc = lead ? malloc(k->parts * chunk * sizeof(float)) : NULL;
  k->got = lead ? malloc(maxn * sizeof(float)) : NULL;
  k->wgot = o->bf16 && lead ? malloc(maxn * sizeof(uint16_t)) : NULL;
  k->wf = o->bf16 && lead ? malloc(2 * maxn * sizeof(float)) : NULL;
  k->repn = (size_t)np * sizeof(int64_t);
  k->rep = calloc(k->repn ? k->repn : 1, 1);
  const size_t ncnt = (size_t)np * DOPT_NCOUNTERS;
  k->cprev = lead ? calloc(2 * ncnt + 1, sizeof *k->cprev) : NULL;
  k->cstep = k->cprev ? k->cprev + ncnt : NULL;
  return k->rdata && k->avg && k->loc && k->work && k->rwork && k->roles && k->gp && k->held && k->lnumel &&
                 (k->full || !whole) &&
                 (k->acc || !lead) && (k->got || !lead) && (k->wgot || !o->bf16 || !lead) &&
                 (k->wf || !o->bf16 || !lead) && k->rep && (k->cprev || !lead)
             ? DOPT_OK
             : dopt__fail(DOPT_ERR_NO_MEMORY, "compare buffers: %zu elements x %zu parts and %zu digest bytes", maxn,
                          k->parts, k->repn);
}

/* Every rank thread has created its distributed optimizer (read the shared template's values): one 1-int
 * all_reduce over tp, then dp, then pp — after the three, every rank of the grid has passed the first. Before the
 * reference's first step modifies those values in place. */
static dopt_status created_barrier(rank_state *k) {
  const dopt_transport *g[3] = {&k->cfg.tp, &k->cfg.dp, &k->cfg.pp};
  for (int j = 0; j < 3; j++) {
    int32_t one = 1;
    if (g[j]->size > 1) DOPT_TRY(g[j]->ops->all_reduce(g[j]->comm, &one, &one, 1, DOPT_I32, DOPT_SUM));
  }
  return DOPT_OK;
}

/* The distributed optimizer and the lead's reference; each parameter's block buffer; what this rank passes;
 * resumed: the distributed optimizer loads the checkpoint and the reference replays the steps before it in the
 * saving layout (the uninterrupted run). */
static dopt_status rank_setup(rank_state *k) {
  const cmp_options *o = k->o;
  const source *s = k->s;
  run_ctx *x = k->x;
  dopt_status st = DOPT_OK;
  k->plain = x->plain;
  if (!k->plain) { /* no shared template (a process per rank): this process's own */
    st = ce_build_plain(o, s, 1, NULL, k->work, &k->own);
    k->plain = k->own;
  }
  for (int i = 0; st == DOPT_OK && i < k->np; i++) k->roles[i] = s->p[i].role;
  if (st == DOPT_OK) st = dopt_dist_create(k->plain, &k->cfg, k->roles, &k->d);
  if (st == DOPT_OK && k->to_lead) st = dopt_dist_set_gather(k->d, DOPT_DIST_GATHER_LEAD);
  /* the reference steps the source's initial values in place where no later world replays from them (no
   * checkpoint, no resume); the rank threads reading them through the shared template have all created their
   * optimizers before its first step (ce_rank_run's created_barrier) */
  k->ref_in_place = !x->save_dir && !x->load_dir && !x->replay;
  if (st == DOPT_OK && k->lead) st = ce_build_plain(o, s, 0, k->ref_in_place ? NULL : k->rdata, k->rwork, &k->ref);
  for (int i = 0; st == DOPT_OK && k->lead && k->ref_in_place && i < k->np; i++) k->rdata[i] = s->init[i];
  /* The reference steps on the lead while the other ranks wait for its
   * gather: in the simulator they sleep (condition variables), so it may use
   * every core; other ranks' processes may busy-poll (MPI, NCCL), so there
   * it keeps to one thread unless told otherwise. The bits are the same. */
  if (st == DOPT_OK && k->lead)
    st = dopt_optim_set_threads(k->ref, o->threads ? o->threads : strcmp(o->backend, "sim") == 0 ? 0 : 1);
  for (int i = 0; st == DOPT_OK && i < k->np; i++) {
    int ndim;
    int64_t shape[DOPT_MAX_DIMS];
    size_t lnumel = 0;
    st = dopt_dist_local_shape(k->d, i, &ndim, shape, &lnumel); /* this rank's TP block */
    if (st != DOPT_OK) break;
    k->lnumel[i] = lnumel;
    if (k->lead) k->avg[i] = malloc((s->numel[i] ? s->numel[i] : 1) * sizeof(float));
    if (k->lead && !k->avg[i])
      st = dopt__fail(DOPT_ERR_NO_MEMORY, "compare buffers: parameter '%s' (%zu elements)", s->p[i].name, s->numel[i]);
  }
  /* this rank's parameters: its stage's, and with moe_hybrid of the experts its ep rank's only */
  for (int i = 0; st == DOPT_OK && i < k->np; i++)
    k->held[i] = (x->stages[i] == k->cfg.pp.rank || k->cfg.pp.size <= 1) && ce_holds_param(o, s, i, k->cfg.dp.rank);
  if (st == DOPT_OK && x->load_dir) st = dopt_dist_load(k->d, k->plain, x->load_dir);
  for (int t = 1; st == DOPT_OK && k->lead && x->replay && t < x->t_first; t++) {
    int bad = 0; /* its skips were counted before the save */
    st = reference_step(x->replay, s, t, k->ref, k->avg, k->acc, k->full, &bad);
  }
  if (st == DOPT_OK && k->lead) st = reference_counts(k->ref, k->np, k->cprev, NULL); /* replayed: not compared */
  return st;
}

/* Step t, both sides: this rank's micro-batches into the distributed optimizer and its step; the reference in
 * lockstep on the lead; every parameter's counters against the reference's (collective). */
static dopt_status rank_step(rank_state *k, int t) {
  const cmp_options *o = k->o;
  const source *s = k->s;
  cmp_result *r = k->r;
  dopt_status st = DOPT_OK;
  for (int m = 0; m < k->micro && st == DOPT_OK; m++) {
    for (int i = 0; i < k->np && st == DOPT_OK; i++) {
      k->gp[i] = NULL;
      if (!k->held[i]) continue; /* another stage's parameter */
      float *g = NULL; /* where the gradient goes: in place in the accumulator, or this rank's own buffer */
      if ((st = dopt_dist_grad_buffer(k->d, i, &g)) != DOPT_OK) break;
      if (!g && !k->loc[i] && !(k->loc[i] = malloc((k->lnumel[i] ? k->lnumel[i] : 1) * sizeof(float))))
        st = dopt__fail(DOPT_ERR_NO_MEMORY, "compare buffers: parameter '%s' (%zu elements)", s->p[i].name,
                        k->lnumel[i]);
      if (st != DOPT_OK) break;
      if (!g) g = k->loc[i];
      k->gp[i] = g;
      const int sh = ce_shard_of(o, s, k->cfg.dp.rank, m);
      dopt_piece pc;
      dopt_tp_block(s->p[i].ndim, s->p[i].shape, s->p[i].role, o->tp, k->cfg.tp.rank, &pc);
      if (k->sliced) { /* a recording: read whole, then sliced */
        st = ce_shard_grad(s, i, t, sh, k->full);
        tp_slice(&s->p[i], o->tp, k->cfg.tp.rank, k->full, g);
      } else if (s->trace) { /* a trace: this rank's block alone, from the file */
        char key[200];
        ce_grad_key(key, sizeof key, t, sh, s->p[i].name);
        st = dopt_st_read_f32_block(s->trace, key, pc.b, pc.h, pc.w, pc.h0, pc.hl, pc.w0, pc.wl, g);
      } else { /* synthetic: only this rank's block */
        (s->fast ? ce_synth_fast : ce_synth_block)(s, i, t, sh, pc.h0, pc.hl, pc.w0, pc.wl, g);
      }
    }
    if (st == DOPT_OK) st = dopt_dist_backward(k->d, k->gp);
  }
  dopt_dist_step_info info;
  if (st == DOPT_OK) st = dopt_dist_step(k->d, &info);
  if (st == DOPT_OK && info.skipped && k->lead) r->skipped_dist++;
  if (st == DOPT_OK && k->lead) {
    int bad = 0;
    const double c0 = cpu_now(CLOCK_THREAD_CPUTIME_ID);
    st = reference_step(o, s, t, k->ref, k->avg, k->acc, k->full, &bad);
    if (t > k->x->t_first) r->cpu_reference += cpu_now(CLOCK_THREAD_CPUTIME_ID) - c0;
    if (st == DOPT_OK && bad) r->skipped_ref++;
  }
  if (st == DOPT_OK && k->lead) st = reference_counts(k->ref, k->np, k->cprev, k->cstep);
  if (st == DOPT_OK && k->lead) st = note_counts(r, t, k->np, k->cstep);
  dopt_counter_diff df;
  if (st == DOPT_OK) st = dopt_dist_check_counters(k->d, k->cstep, &df);
  if (st == DOPT_OK && k->lead && df.param >= 0 && r->events_step == 0) {
    r->events_step = t, r->events_rank = df.rank, r->events_counter = df.counter;
    r->events_ref = df.reference, r->events_dist = df.distributed;
    snprintf(r->events_param, sizeof r->events_param, "%s", s->p[df.param].name);
  }
  return st;
}

/* Parameter i's values and bf16 copy gathered (collective), measured on the lead against the reference's, and
 * digested after the last step; *ti: the next tensor of the plan. */
static dopt_status rank_values(rank_state *k, int t, int i, int last, int *ti) {
  const source *s = k->s;
  cmp_result *r = k->r;
  const size_t n = s->numel[i];
  dopt_status st = dopt_dist_gather_param(k->d, i, k->got);
  if (st == DOPT_OK && k->lead) ce_measure(&r->t[*ti], t, k->rdata[i], k->got, n);
  if (st == DOPT_OK && last) st = digest_both(k->dg, k->rdg, &r->t[*ti], k->got, k->rdata[i], n * sizeof(float));
  (*ti)++;
  if (!k->o->bf16 || st != DOPT_OK) return st;
  st = dopt_dist_gather_work(k->d, i, k->wgot);
  if (st == DOPT_OK && k->lead) {
    for (size_t q = 0; q < n; q++) {
      k->wf[q] = dopt_bf16_to_f32(k->rwork[i][q]);
      k->wf[k->maxn + q] = dopt_bf16_to_f32(k->wgot[q]);
    }
    ce_measure(&r->t[*ti], t, k->wf, k->wf + k->maxn, n);
  }
  if (st == DOPT_OK && last) st = digest_both(k->dg, k->rdg, &r->t[*ti], k->wgot, k->rwork[i], n * sizeof(uint16_t));
  (*ti)++;
  return st;
}

/* State `name` of parameter i (tensor ti of the plan) gathered (collective), measured on the lead against the
 * reference's and digested after the last step. */
static dopt_status rank_state_tensor(rank_state *k, int t, int i, int ti, const char *name, int last) {
  cmp_result *r = k->r;
  size_t sbytes = 0;
  dopt_status st = dopt_dist_state_bytes(k->d, i, name, &sbytes);
  /* absent: the distributed layout has no such state (the same on every rank: none gathers it); its digest
   * lacks the tensor, the reference's has it */
  const int absent = st == DOPT_ERR_NOT_FOUND;
  if (absent) st = DOPT_OK;
  if (st == DOPT_OK && !absent && k->lead && (sbytes > k->sgot_cap || !k->sgot)) { /* grown, kept */
    void *nb = realloc(k->sgot, sbytes ? sbytes : 1);
    if (!nb) st = dopt__fail(DOPT_ERR_NO_MEMORY, "state '%s' (%zu bytes)", name, sbytes);
    else k->sgot = nb, k->sgot_cap = sbytes;
  }
  if (st == DOPT_OK && !absent) st = dopt_dist_gather_state(k->d, i, name, k->lead ? k->sgot : NULL);
  const cmp_tensor_stat *pt = &r->t[ti]; /* the distributed side has no state views: the plan's layout */
  if (st == DOPT_OK && last && !absent) {
    const int64_t flat[1] = {(int64_t)sbytes}; /* another size than the plan's: its bytes, as they are */
    st = sbytes == dopt_numel(pt->ndim, pt->shape) * dopt_dtype_size(pt->dtype)
             ? dopt_digest_tensor(k->dg, pt->name, pt->dtype, pt->ndim, pt->shape, k->sgot, sbytes)
             : dopt_digest_tensor(k->dg, pt->name, DOPT_U8, 1, flat, k->sgot, sbytes);
  }
  int found = 0;
  for (int q = 0; st == DOPT_OK && k->lead && q < dopt_optim_num_states(k->ref, i); q++) {
    dopt_state_view v;
    if (dopt_optim_state(k->ref, i, q, &v) != DOPT_OK || strcmp(v.name, name) != 0) continue;
    found = 1;
    if (absent || v.bytes != sbytes) ce_measure_mismatch(&r->t[ti], t);
    else if (v.dtype == DOPT_F32) ce_measure(&r->t[ti], t, v.data, k->sgot, v.bytes / sizeof(float));
    else ce_measure_bytes(&r->t[ti], t, v.data, k->sgot, v.bytes);
    if (st == DOPT_OK && last) st = dopt_digest_tensor(k->rdg, pt->name, v.dtype, v.ndim, v.shape, v.data, v.bytes);
  }
  /* a state the reference does not hold yet (a parameter never stepped: LISA's frozen layers) is its declared
   * initial value, zeros (alloc_states): the distributed one is measured against those, and both digests
   * cover the same tensors */
  if (st == DOPT_OK && k->lead && !found) {
    void *zeros = calloc(1, sbytes ? sbytes : 1);
    if (!zeros) st = dopt__fail(DOPT_ERR_NO_MEMORY, "state '%s' (%zu bytes)", name, sbytes);
    else if (absent) ce_measure_mismatch(&r->t[ti], t);
    else if (pt->dtype == DOPT_F32) ce_measure(&r->t[ti], t, zeros, k->sgot, sbytes / sizeof(float));
    else ce_measure_bytes(&r->t[ti], t, zeros, k->sgot, sbytes);
    if (st == DOPT_OK && last && !absent)
      st = dopt_digest_tensor(k->rdg, pt->name, pt->dtype, pt->ndim, pt->shape, zeros, sbytes);
    free(zeros);
  }
  return st;
}

/* Parameter i's step counter: this rank's into the replica bytes; the lead's against the reference. */
static dopt_status rank_counter(rank_state *k, int t, int i, int last) {
  cmp_result *r = k->r;
  const char *pname = k->s->p[i].name;
  int64_t ds = 0, rs = 0;
  dopt_status st = dopt_dist_get_step(k->d, i, &ds);
  if (st == DOPT_OK) memcpy(k->rep + (size_t)i * sizeof ds, &ds, sizeof ds);
  if (st == DOPT_OK && k->lead) st = dopt_optim_get_step(k->ref, i, &rs);
  if (st == DOPT_OK && k->lead && ds != rs && r->counter_step == 0) {
    r->counter_step = t;
    snprintf(r->counter_param, sizeof r->counter_param, "%s", pname);
    r->counter_ref = rs;
    r->counter_dist = ds;
  }
  if (st == DOPT_OK && last) st = digest_steps(ds, rs, pname, k->dg, k->rdg);
  return st;
}

/* After step t: every tensor gathered (collective) and measured on the lead, in the plan's order (a parameter,
 * its bf16 copy, its states, its counter); after the last step the lead also digests. */
static dopt_status rank_measure(rank_state *k, int t, int last) {
  const source *s = k->s;
  cmp_result *r = k->r;
  dopt_status st = DOPT_OK;
  if (last) st = dopt_digest_create(&k->dg);
  if (st == DOPT_OK && last) st = dopt_digest_create(&k->rdg);
  int ti = 0;
  /* lead mode on the simulator: the lead reads every rank's pieces in place, no collective per tensor */
  if (st == DOPT_OK) st = dopt_dist_gather_begin(k->d);
  for (int i = 0; i < k->np && st == DOPT_OK; i++) {
    st = rank_values(k, t, i, last, &ti);
    /* its states, in the order plan_tensors listed them */
    const size_t pl = strlen(s->p[i].name);
    while (st == DOPT_OK && ti < r->ntensors && r->t[ti].is_state && strncmp(r->t[ti].name, s->p[i].name, pl) == 0 &&
           r->t[ti].name[pl] == '/') {
      st = rank_state_tensor(k, t, i, ti, r->t[ti].name + pl + 1, last);
      ti++;
    }
    if (st == DOPT_OK) st = rank_counter(k, t, i, last);
  }
  const dopt_status se = dopt_dist_gather_end(k->d); /* after a failure too: the other ranks wait in its releases */
  return st == DOPT_OK ? se : st;
}

/* Every rank's copies against the other holders' (the lead compared its gathered ones with the reference):
 * each held piece by digest, then the step counters against rank 0's; the digests after the last step; the
 * lead's progress. */
static dopt_status rank_checks(rank_state *k, int t, int last) {
  cmp_result *r = k->r;
  int drank = -1, dparam = -1;
  char dname[sizeof r->drift_tensor];
  size_t doff = 0;
  dopt_status st = dopt_dist_check_held(k->d, &drank, &dparam, dname, sizeof dname);
  if (st == DOPT_OK && k->lead && drank >= 0 && r->drift_step == 0) {
    r->drift_step = t;
    r->drift_rank = drank;
    snprintf(r->drift_tensor, sizeof r->drift_tensor, "%s", dname);
  }
  if (st == DOPT_OK) st = dopt_dist_check_replicas(k->d, k->rep, k->repn, &drank, &doff);
  if (st == DOPT_OK && k->lead && drank >= 0 && r->drift_step == 0) {
    r->drift_step = t;
    r->drift_rank = drank;
    snprintf(r->drift_tensor, sizeof r->drift_tensor, "%s/step", k->s->p[doff / sizeof(int64_t)].name);
  }
  if (st == DOPT_OK && last) st = dopt_digest_final(k->dg, NULL, r->digest);
  if (st == DOPT_OK && last) st = dopt_digest_final(k->rdg, NULL, r->ref_digest);
  if (st == DOPT_OK && k->lead) {
    r->steps = t;
    uint64_t worst = 0;
    for (int q = 0; q < r->ntensors; q++) worst = r->t[q].max_ulp > worst ? r->t[q].max_ulp : worst;
    if (k->x->progress) k->x->progress(t, k->o->steps, cmp_now_s() - k->x->t0, worst, k->x->user);
  }
  return st;
}

static void rank_free(rank_state *k) {
  for (int i = 0; i < k->np; i++) {
    if (k->work) free(k->work[i]);
    if (k->rdata && !k->ref_in_place) free(k->rdata[i]);
    if (k->rwork) free(k->rwork[i]);
    if (k->avg) free(k->avg[i]);
    if (k->loc) free(k->loc[i]);
  }
  free(k->work), free(k->rdata), free(k->rwork), free(k->avg), free(k->loc);
  free(k->roles), free(k->gp), free(k->held), free(k->lnumel);
  free(k->full), free(k->acc), free(k->got), free(k->wgot), free(k->wf);
  free(k->rep), free(k->cprev), free(k->sgot);
  dopt_digest_destroy(k->dg);
  dopt_digest_destroy(k->rdg);
  dopt_dist_destroy(k->d);
  dopt_optim_destroy(k->own);
  dopt_optim_destroy(k->ref);
}

/* One rank of the comparison: the distributed optimizer and (on the lead) the reference side by side for the
 * steps of this world, each step measured and checked; then the checkpoint it saves and, with backend mpi, the
 * measurements merged. */
dopt_status ce_rank_run(run_ctx *x, int rank, const rank_groups *rg) {
  rank_state k = {0};
  k.x = x, k.o = x->o, k.s = x->s, k.r = x->r, k.rank = rank, k.np = x->s->np, k.micro = ce_micro_of(x->o, x->s);
  k.lead = rank == 0 || x->measure_world != NULL;
  k.sliced = x->s->rec != NULL;
  k.to_lead = x->measure_world == NULL;
  rank_config(x, rg, &k.cfg);
  dopt_status st = rank_alloc(&k);
  if (st == DOPT_OK) st = rank_setup(&k);
  if (st == DOPT_OK && k.ref_in_place && x->plain) st = created_barrier(&k);
  double c0 = 0.0;
  for (int t = x->t_first; t <= x->t_last && st == DOPT_OK; t++) {
    const int last = k.lead && t == k.o->steps;
    st = rank_step(&k, t);
    if (st == DOPT_OK) st = rank_measure(&k, t, last);
    if (st == DOPT_OK) st = rank_checks(&k, t, last);
    if (rank == 0 && t == x->t_first) c0 = cpu_now(CLOCK_PROCESS_CPUTIME_ID);
  }
  if (st == DOPT_OK && rank == 0 && x->t_last > x->t_first) {
    k.r->cpu_process = cpu_now(CLOCK_PROCESS_CPUTIME_ID) - c0;
    k.r->cpu_steps = x->t_last - x->t_first;
  }
  if (st == DOPT_OK && x->save_dir) {
    st = dopt_dist_save(k.d, k.plain, x->save_dir, x->t_last);
    if (st != DOPT_OK && rank == 0) x->save_failed = 1; /* every rank fails with it (the save agrees) */
  }
  if (st == DOPT_OK && x->measure_world) st = ce_merge_measurements(x->measure_world, k.r, k.o->steps);
  rank_free(&k);
  return st;
}
