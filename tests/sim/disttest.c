#include "disttest.h"

#include "checkdev.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "distopt/checkpoint.h"
#include "distopt/device.h"
#include "distopt/digest.h"
#include "distopt/dist.h"
#include "distopt/dpsum.h"
#include "distopt/xsum.h"
#include "internal.h"
#include "optim_impl.h"

int dt_basic_transport;
int dt_host_steps;
const dopt_optim_impl *dt_dist_impl;
int dt_step_per_micro;

static size_t numel_of(const dt_param *p) {
  size_t n = 1;
  for (int i = 0; i < p->ndim; i++) n *= (size_t)p->shape[i];
  return n;
}

int dt_dp_words(const dt_case *c) {
  return c->dp_sum < 0 ? DOPT_DP_SUM_RANK_ORDER : c->dp_sum == 0 ? DOPT_DP_SUM_DEFAULT_WORDS : c->dp_sum;
}

int dt_ep;
const int *dt_experts;
int dt_nexperts;

/* Whether dp rank d holds (and gives a gradient of) parameter i: every rank, or an expert's ep rank's only (a
 * stack: every rank, its TP block). */
static int dt_holds(int i, int d) {
  if (dt_ep <= 1 || !dt_experts || dt_experts[i] < 0) return 1;
  return d % dt_ep == dopt_dist_expert_rank(dt_experts[i], dt_nexperts, dt_ep);
}

/* A stack split over ep (DOPT_DIST_EXPERT_STACK): dp rank d's gradient g [n] counts for its ep rank's experts
 * only (the other slices zero, as the library takes them). */
static int dt_ep_stack(int i) { return dt_ep > 1 && dt_experts && dt_experts[i] == DOPT_DIST_EXPERT_STACK; }
static void dt_own_experts(int d, size_t n, float *g) {
  const size_t per = n / (size_t)dt_nexperts;
  for (int f = 0; f < dt_nexperts; f++)
    if (dopt_dist_expert_rank(f, dt_nexperts, dt_ep) != d % dt_ep) memset(g + (size_t)f * per, 0, per * sizeof *g);
}

const char *dt_plugin(const dt_layout *l) {
  if (dt_ep > 1) return "moe_hybrid";
  if (l->zero == 3) return "fsdp";
  if (l->tp == 1 && l->zero == 0) return "ddp";
  if (l->tp == 1) return "zero";
  return "hybrid";
}

static uint64_t mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/* Low rank + noise, heavy-tailed rows, some exact zeros: realistic enough to
 * make every statistic matter, and fully determined by the counters. */
void dt_gradient(const dt_case *c, int p, int step, int micro, int dprank, float *out) {
  const dt_param *pp = &c->params[p];
  if (c->batch_invariant) { /* one global batch: micro-batch g = dprank·micro + m, however it is split */
    micro = dprank * c->micro + micro;
    dprank = 0;
  }
  size_t n = numel_of(pp), w = pp->ndim >= 1 ? (size_t)pp->shape[pp->ndim - 1] : 1;
  uint64_t key = mix(c->seed ^ mix(((uint64_t)p << 48) ^ ((uint64_t)step << 24) ^ ((uint64_t)micro << 12) ^ (uint64_t)dprank));
  double a = (double)(mix(key) >> 11) * 0x1.0p-53 - 0.5, b = (double)(mix(key + 1) >> 11) * 0x1.0p-53 - 0.5;
  for (size_t i = 0; i < n; i++) {
    uint64_t h = mix(key + 0x9E3779B97F4A7C15ull * (i + 2));
    double u = 0;
    for (int k = 0; k < 4; k++) u += (double)((h >> (16 * k)) & 0xffff) / 65536.0;
    double noise = u - 2.0; /* ~N(0, 1/3) */
    size_t row = i / w, col = i % w;
    double lowrank = a * sin(0.7 * (double)row + 0.3) * cos(0.4 * (double)col) + b * (double)((row + col) % 3);
    double rowscale = (row % 5 == 1) ? 8.0 : 1.0; /* heavy-tailed rows */
    double v = c->grad_scale * rowscale * (lowrank + 0.5 * noise);
    /* wide: each element keeps its own scale, 2^0..2^-63, in every micro-batch and rank, so small elements
     * stay small in the sum and their bits are decided by the shared block grid */
    if (c->wide) v = ldexp(v, -(int)(mix(((uint64_t)p << 32) ^ (uint64_t)i) % 64));
    if ((h >> 60) == 0) v = 0.0; /* ~6% exact zeros */
    out[i] = (float)v;
  }
  if (c->nan_step == step && p == 0 && dprank == 0 && micro == 0) out[n / 2] = NAN;
}

static dopt_status build_plain(const dt_case *c, const dopt_optim_impl *im, float **data, float **master,
                               uint16_t **work, dopt_optim **out) {
  dopt_optim *o;
  DOPT_TRY(im ? dopt__optim_create_impl(im, c->hparams, &o) : dopt_optim_create(c->optimizer, c->hparams, &o));
  int g1;
  dopt_status s = dopt_optim_add_group(o, c->group1 ? c->group1 : "weight_decay=0", &g1);
  for (int i = 0; s == DOPT_OK && i < c->nparams; i++) {
    const dt_param *pp = &c->params[i];
    size_t n = numel_of(pp);
    data[i] = malloc(n * sizeof(float));
    master[i] = NULL;
    work[i] = NULL;
    /* initial values: seeded, with one all-zero parameter to hit RMS 0 */
    for (size_t k = 0; k < n; k++) {
      uint64_t h = mix(c->seed * 31 + (uint64_t)i * 1000003 + k);
      data[i][k] = strcmp(pp->name, "zeros") == 0 ? 0.0f : (float)((double)(h >> 11) * 0x1.0p-53 - 0.5);
    }
    dopt_param_config pc = DOPT_PARAM_CONFIG_INIT;
    pc.name = pp->name;
    pc.ndim = pp->ndim;
    for (int k = 0; k < pp->ndim; k++) pc.shape[k] = pp->shape[k];
    pc.data = data[i];
    pc.layer = dopt_layer_from_name(pp->name); /* LISA: "layers.N." */
    if (c->bf16) {
      master[i] = data[i];
      work[i] = malloc(n * sizeof(uint16_t));
      for (size_t k = 0; k < n; k++) work[i][k] = dopt_f32_to_bf16(data[i][k]);
      pc.dtype = DOPT_BF16;
      pc.data = work[i];
      pc.master = master[i];
    }
    s = dopt_optim_add_param(o, pp->group ? g1 : 0, &pc, NULL);
  }
  if (s != DOPT_OK) {
    dopt_optim_destroy(o);
    return s;
  }
  *out = o;
  return DOPT_OK;
}

dopt_status dt_build_plain(const dt_case *c, float **data, float **master, uint16_t **work, dopt_optim **out) {
  return build_plain(c, NULL, data, master, work, out);
}

static int is_checkpoint(const dt_case *c, int t) { return t == c->steps || (c->check_every > 0 && t % c->check_every == 0); }

static float *dup_f32(const float *x, size_t n) {
  float *y = malloc((n ? n : 1) * sizeof *y);
  if (y) memcpy(y, x, n * sizeof *y);
  return y;
}

dopt_status dt_run_reference(const dt_case *c, int dp, dt_result *r) { return dt_run_reference_from(c, dp, NULL, 1, r); }

dopt_status dt_run_reference_from(const dt_case *c, int dp, const char *load_dir, int t_first, dt_result *r) {
  memset(r, 0, sizeof *r);
  float *data[DT_MAXP], *master[DT_MAXP], *avg[DT_MAXP], *acc[DT_MAXP], *g = NULL;
  uint16_t *work[DT_MAXP];
  const float *gp[DT_MAXP];
  dopt_optim *o;
  DOPT_TRY(dt_build_plain(c, data, master, work, &o));
  size_t maxn = 1;
  for (int i = 0; i < c->nparams; i++) {
    size_t n = numel_of(&c->params[i]);
    maxn = n > maxn ? n : maxn;
    avg[i] = malloc(n * sizeof(float));
    acc[i] = malloc((size_t)dp * (size_t)(c->micro > 0 ? c->micro : 1) * n * sizeof(float));
    gp[i] = avg[i];
  }
  g = malloc(maxn * sizeof(float));
  const size_t nc = (size_t)c->nparams * DOPT_NCOUNTERS;
  r->counts = calloc((size_t)(c->steps + 1) * nc + 1, sizeof *r->counts);
  dopt_status s = r->counts ? DOPT_OK : DOPT_ERR_NO_MEMORY;
  if (s == DOPT_OK && load_dir) s = dopt_optim_load(o, load_dir);
  for (int i = 0; s == DOPT_OK && load_dir && i < c->nparams; i++) { /* the loaded totals: row 0, the base */
    dopt_counters k = DOPT_COUNTERS_INIT;
    s = dopt_optim_counters(o, i, &k);
    for (int q = 0; s == DOPT_OK && q < DOPT_NCOUNTERS; q++) r->counts[(size_t)i * DOPT_NCOUNTERS + (size_t)q] = k.total[q];
  }
  double ss[DT_MAXP];
  for (int t = t_first; t <= c->steps && s == DOPT_OK; t++) {
    int bad = 0;
    for (int i = 0; i < c->nparams; i++) {
      size_t n = numel_of(&c->params[i]);
      const float *parts[DT_MAXRANKS * 8];
      int np = 0, nd = 0;
      for (int d = 0; d < dp; d++) {
        if (!dt_holds(i, d)) continue; /* MoE: another ep rank's expert */
        nd++;
        if (c->batch_invariant) { /* every micro-batch gradient is a part */
          for (int m = 0; m < c->micro; m++) {
            float *a = acc[i] + (size_t)np * n;
            dt_gradient(c, i, t, m, d, a);
            if (dt_ep_stack(i)) dt_own_experts(d, n, a);
            parts[np++] = a;
          }
          continue;
        }
        /* rank d's accumulator: g_0 + g_1 + ... (micro-batch order) */
        float *a = acc[i] + (size_t)np * n;
        for (int m = 0; m < c->micro; m++) {
          dt_gradient(c, i, t, m, d, g);
          for (size_t k = 0; k < n; k++) a[k] = m == 0 ? g[k] : a[k] + g[k];
        }
        if (dt_ep_stack(i)) dt_own_experts(d, n, a);
        parts[np++] = a;
      }
      if (s == DOPT_OK) s = dopt_dp_sum(parts, np, dt_dp_words(c), n, avg[i]);
      const float denom = (float)((double)(dt_ep_stack(i) ? dp / dt_ep : nd) * (double)c->micro);
      for (size_t k = 0; k < n; k++) {
        avg[i][k] = avg[i][k] / denom;
        bad |= !isfinite(avg[i][k]);
      }
    }
    if (bad && !c->apply_nonfinite) { /* skip: nothing updated, no step counted */
      r->skipped++;
    } else {
      if (c->max_grad_norm > 0) {
        for (int i = 0; i < c->nparams; i++) ss[i] = dopt_xsum_sq(avg[i], numel_of(&c->params[i]));
        float coef = dopt_clip_coef(ss, c->nparams, c->max_grad_norm, NULL);
        for (int i = 0; i < c->nparams; i++)
          for (size_t k = 0; k < numel_of(&c->params[i]); k++) avg[i][k] = avg[i][k] * coef;
      }
      s = dopt_optim_step(o, gp);
    }
    for (int i = 0; s == DOPT_OK && i < c->nparams; i++) { /* this step's counts: the totals' change */
      dopt_counters k = DOPT_COUNTERS_INIT;
      s = dopt_optim_counters(o, i, &k);
      int64_t *row = r->counts + (size_t)t * nc + (size_t)i * DOPT_NCOUNTERS;
      for (int q = 0; s == DOPT_OK && q < DOPT_NCOUNTERS; q++) row[q] = k.total[q] - r->counts[(size_t)i * DOPT_NCOUNTERS + (size_t)q];
      for (int q = 0; s == DOPT_OK && q < DOPT_NCOUNTERS; q++) r->counts[(size_t)i * DOPT_NCOUNTERS + (size_t)q] = k.total[q];
    }
    if (s != DOPT_OK || !is_checkpoint(c, t)) continue;
    /* an optimizer with train/eval points (adamw_schedulefree) is captured in evaluation mode, and set back to
     * train: both swaps run at every checkpoint, on the whole tensors here and on every rank's shards below */
    const int modes = dopt_optim_set_mode(o, 1) == DOPT_OK;
    int ck = r->nck++;
    r->ck_step[ck] = t;
    for (int i = 0; i < c->nparams; i++) {
      size_t n = numel_of(&c->params[i]);
      r->param[ck][i] = dup_f32(data[i], n);
      if (work[i]) {
        r->work[ck][i] = malloc(n * sizeof(uint16_t));
        memcpy(r->work[ck][i], work[i], n * sizeof(uint16_t));
      }
      dopt_optim_get_step(o, i, &r->step[ck][i]);
      r->nstates[i] = dopt_optim_num_states(o, i);
      for (int k = 0; k < r->nstates[i]; k++) {
        dopt_state_view v;
        dopt_optim_state(o, i, k, &v);
        snprintf(r->state_name[i][k], sizeof r->state_name[i][k], "%s", v.name);
        r->state_bytes[i][k] = v.bytes;
        r->state[ck][i][k] = malloc(v.bytes ? v.bytes : 1);
        if (r->state[ck][i][k]) memcpy(r->state[ck][i][k], v.data, v.bytes);
      }
    }
    if (modes) s = dopt_optim_set_mode(o, 0);
  }
  dopt_optim_state_bytes(o, -1, &r->ref_state_mem, NULL);
  dopt_optim_destroy(o);
  for (int i = 0; i < c->nparams; i++) {
    free(data[i]);
    free(work[i]);
    free(avg[i]);
    free(acc[i]);
  }
  (void)master;
  free(g);
  return s;
}

/* ---- the distributed run ----------------------------------------------------------- */

typedef struct run_ctx {
  const dt_case *c;
  const dt_layout *l;
  dt_result *r; /* written by world rank 0 only */
  int t_first, t_last;          /* the steps this world runs */
  const char *load_dir, *save_dir; /* checkpoint loaded before t_first / saved after t_last (NULL: none) */
  const int64_t *ref_counts;       /* the reference's counts per step (dt_result.counts), or NULL */
} run_ctx;

int dt_pp;
size_t dt_chunk;

int dt_stage(int i, int n, int pp) { return pp > 1 && n > 0 ? (int)((long)i * pp / n) : 0; }

_Thread_local int dt_thread_rank = -1;

static dopt_status rank_body(dopt_sim_comm *world, int rank, void *user) {
  dt_thread_rank = rank;
  run_ctx *x = user;
  const dt_case *c = x->c;
  const dt_layout *l = x->l;
  const int npp = dt_pp > 1 ? dt_pp : 1;
  dopt_sim_comm *tpc = NULL, *dpc = NULL, *ppc = NULL, *epc = NULL, *mdc = NULL;
  /* Megatron: TP groups are contiguous ranks; DP groups stride by tp within a stage; the pipeline group holds
   * the ranks of every stage with the same tp and dp ranks (world rank (stage · dp + dp rank) · tp + tp rank) */
  DOPT_TRY(dopt_sim_comm_split_labeled(world, rank / l->tp, rank, "tp", &tpc));
  DOPT_TRY(dopt_sim_comm_split_labeled(world, rank / (l->tp * l->dp) * l->tp + rank % l->tp, rank, "dp", &dpc));
  if (npp > 1) DOPT_TRY(dopt_sim_comm_split_labeled(world, rank % (l->tp * l->dp), rank, "pp", &ppc));
  /* MoE: dp rank q = moe_dp rank · ep + ep rank; the ep group varies the ep rank, moe_dp the moe_dp rank */
  const int q = rank / l->tp % l->dp, tr = rank % l->tp, stg = rank / (l->tp * l->dp);
  if (dt_ep > 1) {
    DOPT_TRY(dopt_sim_comm_split_labeled(world, (stg * (l->dp / dt_ep) + q / dt_ep) * l->tp + tr, rank, "ep", &epc));
    DOPT_TRY(dopt_sim_comm_split_labeled(world, (stg * dt_ep + q % dt_ep) * l->tp + tr, rank, "moe_dp", &mdc));
  }
  dopt_dist_config cfg = DOPT_DIST_CONFIG_INIT;
  cfg.plugin = dt_chunk ? "gemini" : dt_plugin(l);
  cfg.chunk_elems = dt_chunk;
  cfg.zero_stage = l->zero;
  cfg.max_grad_norm = c->max_grad_norm;
  cfg.bucket_bytes = l->bucket_bytes;
  cfg.dp_sum_words = dt_dp_words(c);
  cfg.skip_nonfinite = !c->apply_nonfinite;
  cfg.batch_invariant = c->batch_invariant;
  /* the checking device: every kernel argument and collective buffer must be
   * device memory (its arena), as on a GPU */
  dopt_transport tpt, dpt, ppt;
  DOPT_TRY(dopt_sim_transport(tpc, &tpt));
  DOPT_TRY(dopt_sim_transport(dpc, &dpt));
  if (ppc) DOPT_TRY(dopt_sim_transport(ppc, &ppt));
  dopt_transport ept, mdt;
  if (epc) DOPT_TRY(dopt_sim_transport(epc, &ept));
  if (mdc) DOPT_TRY(dopt_sim_transport(mdc, &mdt));
  cfg.experts = dt_ep > 1 ? dt_experts : NULL;
  cfg.num_experts = dt_ep > 1 ? dt_nexperts : 0;
  int stages[DT_MAXP];
  for (int i = 0; i < c->nparams; i++) stages[i] = dt_stage(i, c->nparams, npp);
  cfg.stages = stages;
  dt_checkdev *chk = NULL;
  DOPT_TRY(dt_checkdev_create(&chk));
  cfg.device = dt_checkdev_device(chk);
  dopt_status ws = dt_checkdev_wrap(chk, &tpt, &cfg.tp);
  if (ws == DOPT_OK) ws = dt_checkdev_wrap(chk, &dpt, &cfg.dp);
  if (ws == DOPT_OK && ppc) ws = dt_checkdev_wrap(chk, &ppt, &cfg.pp);
  if (ws == DOPT_OK && epc) ws = dt_checkdev_wrap(chk, &ept, &cfg.ep);
  if (ws == DOPT_OK && mdc) ws = dt_checkdev_wrap(chk, &mdt, &cfg.moe_dp);
  dt_checkdev_host_steps(chk, dt_host_steps);
  if (ws == DOPT_OK && dt_basic_transport) {
    dt_checkdev_basic_ops(&cfg.tp);
    dt_checkdev_basic_ops(&cfg.dp);
    if (mdc) dt_checkdev_basic_ops(&cfg.moe_dp);
  }
  if (ws != DOPT_OK) {
    dt_checkdev_destroy(chk);
    return ws;
  }
  float *data[DT_MAXP], *master[DT_MAXP];
  uint16_t *work[DT_MAXP];
  dopt_optim *plain;
  DOPT_TRY(build_plain(c, dt_dist_impl, data, master, work, &plain));
  dopt_tp_role roles[DT_MAXP];
  for (int i = 0; i < c->nparams; i++) roles[i] = c->params[i].role;
  dopt_dist_optim *d = NULL;
  dopt_status s = dopt_dist_create(plain, &cfg, roles, &d);
  size_t maxn = 1;
  for (int i = 0; i < c->nparams; i++) maxn = numel_of(&c->params[i]) > maxn ? numel_of(&c->params[i]) : maxn;
  float *full = malloc(maxn * sizeof(float)), *loc[DT_MAXP];
  const float *lp[DT_MAXP];
  for (int i = 0; i < c->nparams; i++) {
    loc[i] = malloc(maxn * sizeof(float));
    lp[i] = loc[i];
  }
  const int dprank = cfg.dp.rank, tprank = cfg.tp.rank, stage = ppc ? cfg.pp.rank : 0;
  for (int i = 0; i < c->nparams; i++) /* another stage's, another ep rank's expert: none */
    lp[i] = stages[i] == stage && dt_holds(i, dprank) ? loc[i] : NULL;
  if (s == DOPT_OK && x->load_dir) s = dopt_dist_load(d, plain, x->load_dir);
  for (int t = x->t_first; t <= x->t_last && s == DOPT_OK; t++) {
    for (int m = 0; m < c->micro && s == DOPT_OK; m++) {
      const float *gp[DT_MAXP];
      for (int i = 0; i < c->nparams; i++) {
        gp[i] = lp[i];
        if (!lp[i]) continue;
        /* this rank's TP block of the logical micro-batch gradient: on odd steps written in place into the
         * accumulator where dopt_dist_grad_buffer offers it (the first micro-batch), else into loc (copied) */
        float *dst = loc[i];
        if (t % 2 == 1) {
          float *in = NULL;
          if ((s = dopt_dist_grad_buffer(d, i, &in)) != DOPT_OK) break;
          if (in) dst = in, gp[i] = in;
        }
        const dt_param *pp = &c->params[i];
        dt_gradient(c, i, t, m, dprank, full);
        dopt_piece pc;
        dopt_piece_full(pp->ndim, pp->shape, &pc);
        size_t h0 = 0, hl = pc.h, w0 = 0, wl = pc.w;
        if (l->tp > 1 && pp->role != DOPT_TP_REPLICATED) {
          int rowsplit = pp->role == DOPT_TP_COLUMN && pp->ndim >= 2;
          size_t n = rowsplit ? pc.h : pc.w, base = n / (size_t)l->tp, rem = n % (size_t)l->tp, r = (size_t)tprank;
          size_t len = base + (r < rem), off = r * base + (r < rem ? r : rem);
          if (rowsplit) h0 = off, hl = len;
          else w0 = off, wl = len;
        }
        for (size_t bi = 0; bi < pc.b; bi++)
          for (size_t ii = 0; ii < hl; ii++)
            memcpy(dst + (bi * hl + ii) * wl, full + (bi * pc.h + h0 + ii) * pc.w + w0, wl * sizeof(float));
      }
      if (s == DOPT_OK) s = dopt_dist_backward(d, gp);
      if (s == DOPT_OK && dt_step_per_micro && m + 1 < c->micro) s = dopt_dist_step(d, NULL); /* a planted bug */
    }
    dopt_sim_stats before[2] = {DOPT_SIM_STATS_INIT, DOPT_SIM_STATS_INIT}, after[2] = {DOPT_SIM_STATS_INIT, DOPT_SIM_STATS_INIT};
    if (s == DOPT_OK) s = dopt_sim_comm_stats(tpc, &before[0]);
    if (s == DOPT_OK) s = dopt_sim_comm_stats(dpc, &before[1]);
    if (s == DOPT_OK) s = dopt_dist_step(d, NULL);
    if (s == DOPT_OK) s = dopt_sim_comm_stats(tpc, &after[0]);
    if (s == DOPT_OK) s = dopt_sim_comm_stats(dpc, &after[1]);
    for (int g = 0; s == DOPT_OK && rank < DT_MAXRANKS && g < 2; g++)
      for (int k = 0; k < DOPT_SIM_KIND_COUNT; k++) x->r->step_ops[rank][k] += after[g].ops[k] - before[g].ops[k];
    if (s == DOPT_OK && x->ref_counts) { /* every step's counters against the reference's (collective) */
      dopt_counter_diff df;
      s = dopt_dist_check_counters(d, x->ref_counts + (size_t)t * (size_t)c->nparams * DOPT_NCOUNTERS, &df);
      if (s == DOPT_OK && rank == 0 && df.param >= 0 && x->r->counter_step == 0) {
        x->r->counter_step = t, x->r->counter_param = df.param, x->r->counter_id = df.counter;
        x->r->counter_rank = df.rank, x->r->counter_ref = df.reference, x->r->counter_dist = df.distributed;
      }
    }
    if (s != DOPT_OK || !is_checkpoint(c, t)) continue;
    /* gather (collective); world rank 0 keeps the result (only it touches
     * x->r: with only replicated tensors no collective orders the other
     * ranks' reads after its nck++) */
    int keep = rank == 0, ck = keep ? x->r->nck : 0;
    const int modes = dopt_dist_set_mode(d, 1) == DOPT_OK; /* as the reference: captured in evaluation mode */
    uint8_t rep[DT_MAXP][DOPT_DIGEST_BYTES]; /* this rank's copy of each parameter, digested */
    for (int i = 0; i < c->nparams && s == DOPT_OK; i++) {
      size_t n = numel_of(&c->params[i]);
      dopt_digest *dg = NULL;
      s = dopt_digest_create(&dg);
      float *buf = malloc(n * sizeof(float));
      if (s == DOPT_OK) s = dopt_dist_gather_param(d, i, buf);
      if (s == DOPT_OK) s = dopt_digest_bytes(dg, buf, n * sizeof(float));
      if (keep) x->r->param[ck][i] = buf;
      else free(buf);
      if (s == DOPT_OK && c->bf16) {
        uint16_t *wb = malloc(n * sizeof(uint16_t));
        s = dopt_dist_gather_work(d, i, wb);
        if (s == DOPT_OK) s = dopt_digest_bytes(dg, wb, n * sizeof(uint16_t));
        if (keep) x->r->work[ck][i] = wb;
        else free(wb);
      }
      int64_t stp = 0;
      if (s == DOPT_OK) s = dopt_dist_get_step(d, i, &stp);
      if (s == DOPT_OK) s = dopt_digest_bytes(dg, &stp, sizeof stp);
      if (keep) x->r->step[ck][i] = stp;
      /* every state, by the reference's names (same layout), whole */
      for (int k = 0; s == DOPT_OK && k < x->r->nstates[i]; k++) {
        size_t sbytes = 0;
        s = dopt_dist_state_bytes(d, i, x->r->state_name[i][k], &sbytes);
        if (s == DOPT_ERR_NOT_FOUND) { /* the distributed side has no such state: a difference dt_compare names
                                        * (after the values, which it compares first), not a failed run */
          s = DOPT_OK;
          continue;
        }
        float *sb = s == DOPT_OK ? malloc(sbytes ? sbytes : 1) : NULL;
        if (s == DOPT_OK && !sb) s = DOPT_ERR_NO_MEMORY;
        if (s == DOPT_OK) s = dopt_dist_gather_state(d, i, x->r->state_name[i][k], sb);
        if (s == DOPT_OK) s = dopt_digest_bytes(dg, sb, sbytes);
        if (keep) x->r->state[ck][i][k] = sb;
        else free(sb);
      }
      if (s == DOPT_OK) s = dopt_digest_final(dg, rep[i], NULL);
      dopt_digest_destroy(dg);
    }
    int drank = -1;
    size_t doff = 0;
    if (s == DOPT_OK) s = dopt_dist_check_replicas(d, rep, (size_t)c->nparams * DOPT_DIGEST_BYTES, &drank, &doff);
    if (s == DOPT_OK && modes) s = dopt_dist_set_mode(d, 0);
    if (s == DOPT_OK && keep && drank >= 0 && x->r->drift_step == 0) {
      x->r->drift_step = t;
      x->r->drift_rank = drank;
      x->r->drift_param = (int)(doff / DOPT_DIGEST_BYTES);
    }
    if (keep) {
      x->r->ck_step[ck] = t;
      x->r->nck++;
    }
  }
  if (s == DOPT_OK && x->save_dir) s = dopt_dist_save(d, plain, x->save_dir, x->t_last);
  if (rank == 0 && d) x->r->skipped = dopt_dist_skipped_steps(d);
  if (d && rank < DT_MAXRANKS) { /* own slots */
    for (int i = 0; i < c->nparams && s == DOPT_OK; i++) s = dopt_dist_layout(d, i, &x->r->layout[rank][i]);
    x->r->stat_collectives[rank] = dopt_dist_stat_collectives(d);
    dopt_dist_memory m;
    if (dopt_dist_memory_usage(d, &m) == DOPT_OK) x->r->state_mem[rank] = m.state_bytes;
  }
  for (int i = 0; i < c->nparams; i++) {
    free(loc[i]);
    free(data[i]);
    free(work[i]);
  }
  (void)master;
  free(full);
  dopt_dist_destroy(d);
  dopt_optim_destroy(plain);
  /* everything the optimizer allocated on the device was freed */
  if (s == DOPT_OK && dt_checkdev_live(chk) != 0)
    s = dopt__fail(DOPT_ERR_STATE, "checking device: %zu allocations still live after dopt_dist_destroy",
                   dt_checkdev_live(chk));
  dt_checkdev_destroy(chk);
  return s;
}

dopt_status dt_run_dist(const dt_case *c, const dt_layout *l, dt_result *out, char *err, size_t errcap) {
  return dt_run_dist_steps(c, l, 1, c->steps, NULL, NULL, out, err, errcap);
}

dopt_status dt_run_dist_steps(const dt_case *c, const dt_layout *l, int t_first, int t_last, const char *load_dir,
                              const char *save_dir, dt_result *out, char *err, size_t errcap) {
  /* the state names come from the reference layout (same registry layout) */
  char names[DT_MAXP][DT_MAXS][32];
  int nst[DT_MAXP];
  memcpy(names, out->state_name, sizeof names);
  memcpy(nst, out->nstates, sizeof nst);
  const int64_t *ref_counts = out->ref_counts;
  memset(out, 0, sizeof *out);
  memcpy(out->state_name, names, sizeof names);
  memcpy(out->nstates, nst, sizeof nst);
  dopt_sim_config cfg = DOPT_SIM_CONFIG_INIT;
  cfg.nranks = (dt_pp > 1 ? dt_pp : 1) * l->tp * l->dp;
  cfg.timeout_ms = 20000;
  cfg.mode = c->ring_order ? DOPT_SIM_ORDER_RING : DOPT_SIM_ORDER_RANK;
  dopt_sim_world *w;
  DOPT_TRY(dopt_sim_world_create(&cfg, &w));
  run_ctx x;
  memset(&x, 0, sizeof x);
  x.c = c;
  x.l = l;
  x.r = out;
  x.t_first = t_first;
  x.t_last = t_last;
  x.load_dir = load_dir;
  x.save_dir = save_dir;
  x.ref_counts = ref_counts;
  out->nlayout = cfg.nranks < DT_MAXRANKS ? cfg.nranks : DT_MAXRANKS;
  dopt_status st[64];
  dopt_status s = dopt_sim_launch(w, rank_body, &x, st);
  for (int r = 0; s == DOPT_OK && r < cfg.nranks; r++)
    if (st[r] != DOPT_OK) {
      s = st[r];
      snprintf(err, errcap, "rank %d: %s: %s", r, dopt_status_name(st[r]), dopt_sim_world_rank_error(w, r));
    }
  if (s != DOPT_OK && err[0] == '\0') snprintf(err, errcap, "%s: %s", dopt_status_name(s), dopt_last_error());
  dopt_sim_world_destroy(w);
  return s;
}

static int first_diff32(const float *a, const float *b, size_t n, size_t *at) {
  for (size_t i = 0; i < n; i++)
    if (memcmp(&a[i], &b[i], sizeof(float)) != 0) {
      *at = i;
      return 1;
    }
  return 0;
}

/* The ranks' pieces of every parameter (dopt_dist_layout) tile it by the layout rule: 0, or 1 with msg. */
static int layout_differs(const dt_case *c, const dt_result *got, char *msg, size_t cap) {
  for (int i = 0; i < c->nparams; i++) {
    dopt_layout_piece pcs[DT_MAXRANKS];
    int ranks[DT_MAXRANKS];
    size_t n = 0;
    for (int r = 0; r < got->nlayout && r < DT_MAXRANKS; r++)
      if (got->layout[r][i].len > 0) pcs[n] = got->layout[r][i], ranks[n++] = r;
    const dt_param *pp = &c->params[i];
    for (size_t k = 0; k < n; k++)
      if (dopt_layout_piece_check(pp->ndim, pp->shape, &pcs[k]) != DOPT_OK) {
        snprintf(msg, cap, "dopt_dist_layout of %s on rank %d: %s", pp->name, ranks[k], dopt_last_error());
        return 1;
      }
    if (dopt_layout_cover(pp->name, pp->ndim, pp->shape, pcs, ranks, n, NULL) != DOPT_OK) {
      snprintf(msg, cap, "dopt_dist_layout: %s", dopt_last_error());
      return 1;
    }
  }
  return 0;
}

int dt_compare(const dt_case *c, const dt_result *ref, const dt_result *got, char *msg, size_t cap) {
  if (got->nlayout && layout_differs(c, got, msg, cap)) return 1;
  if (ref->nck != got->nck) {
    snprintf(msg, cap, "checkpoints: reference %d, distributed %d", ref->nck, got->nck);
    return 1;
  }
  if (ref->skipped != got->skipped) {
    snprintf(msg, cap, "skipped steps: reference %lld, distributed %lld", (long long)ref->skipped, (long long)got->skipped);
    return 1;
  }
  for (int k = 0; k <= ref->nck; k++) {
    /* the counters first: a difference at or before this checkpoint names the work that went wrong */
    if (got->counter_step != 0 && (k == ref->nck || got->counter_step <= ref->ck_step[k])) {
      char who[32] = "in total over the pieces";
      if (got->counter_rank >= 0) snprintf(who, sizeof who, "on rank %d", got->counter_rank);
      snprintf(msg, cap, "DIVERGED at step %d (events: %s of %s: reference %lld, distributed %lld %s)",
               got->counter_step, dopt_counter_name(got->counter_id), c->params[got->counter_param].name,
               (long long)got->counter_ref, (long long)got->counter_dist, who);
      return 1;
    }
    if (k == ref->nck) break;
    /* every rank's own copy is rank 0's (which is compared in full below) */
    if (got->drift_step != 0 && got->drift_step == ref->ck_step[k]) {
      snprintf(msg, cap, "step %d: rank %d's copy of %s (values, states or step counter) differs from rank 0's: "
               "replica drift", got->drift_step, got->drift_rank, c->params[got->drift_param].name);
      return 1;
    }
    for (int i = 0; i < c->nparams; i++) {
      size_t n = numel_of(&c->params[i]), at = 0;
      const char *pn = c->params[i].name;
      if (ref->step[k][i] != got->step[k][i]) {
        snprintf(msg, cap, "step %d: %s step counter %lld vs %lld", ref->ck_step[k], pn, (long long)ref->step[k][i],
                 (long long)got->step[k][i]);
        return 1;
      }
      if (first_diff32(ref->param[k][i], got->param[k][i], n, &at)) {
        snprintf(msg, cap, "step %d: param %s[%zu] %.9g vs %.9g", ref->ck_step[k], pn, at, (double)ref->param[k][i][at],
                 (double)got->param[k][i][at]);
        return 1;
      }
      if (ref->work[k][i] && memcmp(ref->work[k][i], got->work[k][i], n * sizeof(uint16_t)) != 0) {
        snprintf(msg, cap, "step %d: bf16 working copy of %s differs", ref->ck_step[k], pn);
        return 1;
      }
      for (int s = 0; s < ref->nstates[i]; s++) {
        /* byte for byte over the reference's size (fp32 or not) */
        const char *sname = ref->state_name[i][s];
        const unsigned char *a = (const unsigned char *)ref->state[k][i][s], *b = (const unsigned char *)got->state[k][i][s];
        if (!a) continue; /* freed in the reference at this checkpoint (LISA reset) */
        size_t bytes = ref->state_bytes[i][s], j = 0;
        if (b)
          while (j < bytes && a[j] == b[j]) j++;
        if (!b || j < bytes) {
          size_t e = j / 4;
          snprintf(msg, cap, "step %d: state %s/%s byte %zu of %zu (as fp32 [%zu]: %.9g vs %.9g)", ref->ck_step[k], pn,
                   sname, j, bytes, e, (double)ref->state[k][i][s][e], b ? (double)got->state[k][i][s][e] : NAN);
          return 1;
        }
      }
    }
  }
  if (got->drift_step != 0) { /* not at one of the reference's checkpoints: still a drift */
    snprintf(msg, cap, "step %d: rank %d's copy of %s differs from rank 0's: replica drift", got->drift_step,
             got->drift_rank, c->params[got->drift_param].name);
    return 1;
  }
  return 0;
}

void dt_expect(dt_result *got, const dt_result *ref) {
  memcpy(got->state_name, ref->state_name, sizeof got->state_name);
  memcpy(got->nstates, ref->nstates, sizeof got->nstates);
  got->ref_counts = ref->counts;
}

int dt_diverges(const dt_case *c, const dt_layout *l, const dt_result *ref, int counters, char *msg, size_t cap) {
  dt_result got;
  dt_expect(&got, ref);
  if (!counters) got.ref_counts = NULL;
  char err[512] = "";
  msg[0] = '\0';
  dopt_status s = dt_run_dist(c, l, &got, err, sizeof err);
  const int diverged = s != DOPT_OK ? (snprintf(msg, cap, "failed: %s", err), 1) : dt_compare(c, ref, &got, msg, cap);
  dt_result_free(&got);
  return diverged;
}

void dt_result_free(dt_result *r) {
  for (int k = 0; k < r->nck; k++)
    for (int i = 0; i < DT_MAXP; i++) {
      free(r->param[k][i]);
      free(r->work[k][i]);
      for (int s = 0; s < DT_MAXS; s++) free(r->state[k][i][s]);
    }
  free(r->counts);
  memset(r, 0, sizeof *r);
}
