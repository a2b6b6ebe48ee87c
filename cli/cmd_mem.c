/* distopt mem: exact optimizer-state memory of a model description, per
 * registered optimizer, from the optimizers' own state layouts
 * (dopt_optim_state_bytes_for), compared with the GaLore paper's figures. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "compare.h"
#include "model.h"
#include "registry.h"

static const char *const CMD = "mem";

typedef struct pclass {
  const char *what;
  int ndim;
  int64_t shape[3];
  long count;
  int projected; /* GaLore applies (attention and MLP linears, as the paper) */
  dopt_tp_role role; /* tensor-parallel: 0 replicated, 1 COLUMN (dim -2), 2 ROW (dim -1) */
  int expert;    /* 1: separate experts' tensors, count over all E experts (moe_hybrid splits them over ep) */
} pclass;

/* The tensors of pipeline stage `stage` of pp (docs/distributed.md "Pipeline stages"): its decoder layers
 * (ColossalAI's default partition), the embedding on the first stage, the final norm and head on the last;
 * pp 1: the whole model. */
typedef struct stage_sel {
  int stage, pp;
} stage_sel;

static int classes_of(const cmp_model *m, stage_sel ss, pclass *c) {
  int n = 0;
  int64_t h = m->hidden, f = m->inter, v = m->vocab;
  long L = m->layers;
  const int first = ss.stage == 0, last = ss.stage == ss.pp - 1;
  if (ss.pp > 1) {
    long per[CMP_PP_MAX];
    cmp_layers_per_stage(m->layers, ss.pp, per);
    L = per[ss.stage];
  }
  const int64_t kv = m->kv ? m->kv : h;
  c[n++] = (pclass){"embed + lm_head", 2, {v, h}, first + last, 0, 1, 0}; /* vocab-parallel */
  if (kv == h) {
    c[n++] = (pclass){"attn q,k,v", 2, {h, h}, 3 * L, 1, 1, 0};
  } else { /* grouped-query k and v */
    c[n++] = (pclass){"attn q", 2, {h, h}, L, 1, 1, 0};
    c[n++] = (pclass){"attn k,v", 2, {kv, h}, 2 * L, 1, 1, 0};
  }
  c[n++] = (pclass){"attn o", 2, {h, h}, L, 1, 2, 0};
  if (m->experts > 0 && m->separate) { /* Mixtral's separate experts w1, w3 [f, h], w2 [h, f] and the router */
    const int64_t E = m->experts;
    c[n++] = (pclass){"moe router", 2, {E, h}, L, 0, 0, 0};
    c[n++] = (pclass){"experts w1,w3", 2, {f, h}, 2 * L * E, 1, 1, 1};
    c[n++] = (pclass){"experts w2", 2, {h, f}, L * E, 1, 2, 1};
  } else if (m->experts > 0) { /* stacked experts [E, f, h] / [E, h, f] (TP within each expert) and the router */
    const int64_t E = m->experts;
    c[n++] = (pclass){"moe router", 2, {E, h}, L, 0, 0, 0};
    c[n++] = (pclass){"experts gate,up", 3, {E, f, h}, 2 * L, 0, 1, 0};
    c[n++] = (pclass){"experts down", 3, {E, h, f}, L, 0, 2, 0};
  } else {
    c[n++] = (pclass){"mlp gate,up", 2, {f, h}, 2 * L, 1, 1, 0};
    c[n++] = (pclass){"mlp down", 2, {h, f}, L, 1, 2, 0};
  }
  c[n++] = (pclass){"norms", 1, {h, 0}, 2 * L + last, 0, 0, 0};
  return n;
}
#define MAX_CLASSES 10

static int classes(const cmp_model *m, pclass *c) { return classes_of(m, (stage_sel){0, 1}, c); }

/* 1 when optimizer opt projects gradients at a `rank` (GaLore's forms, Q-GaLore, APOLLO): it has the key. */
static int projects(const char *opt) {
  dopt_optim *o;
  double v;
  if (dopt_optim_create(opt, NULL, &o) != DOPT_OK) return strstr(opt, "galore") != NULL; /* needs keys (q_galore) */
  const int has = dopt_optim_get_hparam(o, 0, "rank", &v) == DOPT_OK;
  dopt_optim_destroy(o);
  return has;
}

/* The hyperparameters of optimizer opt for one tensor: hp, and for a projecting optimizer its rank on the
 * projected tensors (the attention and MLP linears, as the GaLore paper) and 0, no projection, on the others;
 * a rank already in hp (APOLLO-Mini's 1) is kept. */
static void tensor_hparams(const char *opt, const char *hp, int projected, int rank, char *h, size_t cap) {
  if (!hp) hp = "";
  const int own = strncmp(hp, "rank=", 5) == 0 || strstr(hp, ",rank=") != NULL; /* hp names a rank */
  if (!projects(opt) || (own && projected)) snprintf(h, cap, "%s", hp);
  else snprintf(h, cap, "%s%srank=%d", hp, hp[0] ? "," : "", projected ? rank : 0); /* a later key wins */
}

/* Named settings that get a row of their own after their optimizer's (the paper's memory figure). */
static const struct {
  const char *opt, *hp, *label;
} SETTINGS[] = {
    {"apollo", "rank=1,scale_type=tensor,scale=128", "rank=1, tensor (APOLLO-Mini)"},
};

/* Total state bytes of the model for one optimizer; -1 if unavailable. */
static double model_state_bytes(const cmp_model *m, const char *opt, const char *hp, int rank, int *ok) {
  pclass c[MAX_CLASSES];
  int n = classes(m, c);
  double total = 0;
  *ok = 1;
  for (int i = 0; i < n; i++) {
    char h[256];
    tensor_hparams(opt, hp, c[i].projected, rank, h, sizeof h);
    size_t b;
    if (dopt_optim_state_bytes_for(opt, h, c[i].ndim, c[i].shape, &b) != DOPT_OK) {
      *ok = 0;
      return -1;
    }
    total += (double)b * (double)c[i].count;
  }
  return total;
}


/* ---- per rank (--tp --dp --zero): what distributed/ allocates ----------------------------
 * fp32 parameters. A tensor steps piecewise or in owner mode, as
 * dopt_dist_create decides per parameter (dopt__impl_whole: GaLore's projected
 * matrices). Piecewise: the TP-local block (largest TP rank's: ceil of the
 * split dim), ZeRO-padded; elementwise states sharded like the parameter,
 * blockwise ones (8-bit absmax) the blocks of each rank's own piece, the
 * others whole on every rank. Owner mode: every state whole on
 * its owner, owners assigned as dopt_dist_create does (largest first to the
 * least loaded of the tp·dp ranks), plus the owner's logical fp32 copy. */
typedef struct rank_mem {
  double params, grads, states_max, states_min, states_sum, owner_copy_max;
  double cost_max, cost_sum; /* step cost (multiply-adds, dopt__impl_cost): the most loaded rank's, all ranks' */
  long owned, piecewise;     /* tensors in each mode */
} rank_mem;

static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }


/* The blocks of B elements that world rank w's piece of a tensor of class c falls in, as distributed/ lays it
 * out: the TP block of tp rank w mod tp, the ZeRO range of dp rank w / tp. */
static size_t rank_blocks(const pclass *c, int tp, int dp, int zero, int w, size_t B) {
  dopt_piece pc;
  dopt_tp_block(c->ndim, c->shape, c->role, tp, w % tp, &pc); /* as distributed/ cuts it */
  const size_t ln = pc.len;
  if (zero >= 1) dopt_chunk_range((dopt_chunk_slot){0, (ln + (size_t)dp - 1) / (size_t)dp}, ln, (size_t)(w / tp), &pc.lo, &pc.len);
  return dopt_piece_blocks(&pc, B, NULL);
}

/* One tp x D grid of ranks (a stage's tp x dp, or an ep rank's tp x moe_dp): classes c[0, n) with cnt[i] of
 * each tensor on it (0: none), ZeRO over D. Per slot w (tp rank w mod tp, grid rank w / tp): st[w] state bytes,
 * copy[w] the owners' fp32 copies, work[w] the step cost, each added to; the largest TP block's parameter and
 * gradient bytes and the tensors in each mode (piecewise, owner) added to out. */
static int tally(const pclass *c, int n, const double *cnt, const char *opt, const char *hp, int grank, int tp, int D,
                 int zero, double *st, double *copy, double *work, rank_mem *out) {
  const int world = tp * D;
  long total = 0; /* owner items: a tensor, or (owner units) up to `world` runs of an expert stack's units */
  for (int i = 0; i < n; i++)
    total += (long)cnt[i] * (c[i].ndim >= 3 && c[i].shape[0] > 1 ? (c[i].shape[0] < world ? c[i].shape[0] : world) : 1);
  const size_t na = total > 0 ? (size_t)total : 1;
  double *tb = malloc(na * sizeof *tb), *tn = malloc(na * sizeof *tn), *tc = malloc(na * sizeof *tc);
  int *slot = malloc(na * sizeof *slot);
  int ok = tb && tn && tc && slot;
  long nt = 0;
  for (int i = 0; ok && i < n; i++) {
    if (cnt[i] <= 0) continue;
    char h[256];
    tensor_hparams(opt, hp, c[i].projected, grank, h, sizeof h);
    dopt_optim *o;
    if (dopt_optim_create(opt, h, &o) != DOPT_OK) {
      ok = 0;
      break;
    }
    const dopt_optim_impl *im = dopt__optim_impl(o);
    const int owned = dopt__impl_whole(im, dopt__optim_group_hp(o, 0), c[i].ndim, c[i].shape);
    dopt_state_spec sp[DOPT_MAX_STATES];
    int ns = im->layout(dopt__optim_group_hp(o, 0), c[i].ndim, c[i].shape, sp);
    /* the largest TP block: TP rank 0's (dopt_tp_block: the first ranks hold one more) */
    dopt_piece blk0;
    dopt_tp_block(c[i].ndim, c[i].shape, c[i].role, tp, 0, &blk0);
    const int64_t lnumel = (int64_t)blk0.len, numel = (int64_t)blk0.numel;
    int64_t chunk = zero >= 1 ? ceil_div(lnumel, D) : lnumel, padded = zero >= 1 ? chunk * D : lnumel;
    out->params += cnt[i] * (double)(zero == 3 ? chunk : padded) * 4;
    out->grads += cnt[i] * (double)padded * 4;
    double whole = 0, piece = 0;
    for (int k = 0; k < ns; k++) {
      const double es = (double)dopt_dtype_size(sp[k].v.dtype);
      whole += (double)sp[k].v.bytes;
      if (sp[k].kind == DOPT_STATE_ELEMENTWISE) piece += (double)chunk * es;
      else if (sp[k].kind == DOPT_STATE_WHOLE) piece += (double)sp[k].v.bytes;
      else if (!owned) /* blockwise: the blocks of each rank's own piece */
        for (int w = 0; w < world; w++)
          st[w] += cnt[i] * (double)rank_blocks(&c[i], tp, D, zero, w, sp[k].block) * es;
    }
    const double cost = dopt__impl_cost(im, dopt__optim_group_hp(o, 0), c[i].ndim, c[i].shape);
    if (owned) { /* as dopt_dist_create: min(units, world) items of consecutive units (every state elementwise) */
      int64_t nu = dopt__impl_units(im, dopt__optim_group_hp(o, 0), c[i].ndim, c[i].shape);
      for (int k = 0; k < ns; k++)
        if (sp[k].kind != DOPT_STATE_ELEMENTWISE) nu = 1;
      const int64_t G = nu < world ? nu : world;
      out->owned += (long)cnt[i];
      for (long k = 0; k < (long)cnt[i]; k++)
        for (int64_t g = 0; g < G; g++) {
          const double share = (double)((g + 1) * nu / G - g * nu / G) / (double)nu;
          tb[nt] = whole * share, tc[nt] = cost * share, tn[nt++] = (double)numel * share;
        }
    } else { /* the piece's share of the step (the largest TP block's ZeRO extent) */
      out->piecewise += (long)cnt[i];
      for (int w = 0; w < world; w++) st[w] += cnt[i] * piece;
      for (int w = 0; w < world; w++) work[w] += cnt[i] * cost * (double)chunk / (double)numel;
    }
    dopt_optim_destroy(o);
  }
  ok = ok && dopt__assign_owners((int)nt, tc, tb, world, slot) == 0; /* distributed/'s owners */
  for (long k = 0; ok && k < nt; k++) {
    const int r = slot[k];
    work[r] += tc[k];
    copy[r] += tn[k] * 4;
    st[r] += tb[k];
  }
  free(tb), free(tn), free(tc), free(slot);
  return ok;
}

/* Per world rank of stage ss under tp x dp x zero, and moe_hybrid's ep (dividing dp; 1: none): the dense
 * tensors over the stage's tp x dp ranks, each ep rank's experts (the first E mod ep ranks one more, as
 * dopt_dist_expert_rank) over its tp x moe_dp ranks, owners assigned apart as distributed/ does; world rank
 * w = dp rank · tp + tp rank, dp rank = moe_dp rank · ep + ep rank. Parameters and gradients: the busiest ep
 * rank's. */
static int per_rank(const cmp_model *m, stage_sel ss, const char *opt, const char *hp, int grank, int tp, int dp,
                    int ep, int zero, rank_mem *out) {
  pclass c[MAX_CLASSES];
  const int n = classes_of(m, ss, c), world = tp * dp, md = dp / ep, E = m->experts;
  memset(out, 0, sizeof *out);
  double dense[MAX_CLASSES], mine[MAX_CLASSES];
  for (int i = 0; i < n; i++) {
    dense[i] = ep > 1 && c[i].expert ? 0 : (double)c[i].count;
  }
  double *st = calloc((size_t)world * 3, sizeof *st), *copy = st ? st + world : NULL, *work = st ? st + 2 * world : NULL;
  double *est = calloc((size_t)(tp * md) * 3, sizeof *est);
  int ok = st && est && tally(c, n, dense, opt, hp, grank, tp, dp, zero, st, copy, work, out);
  rank_mem busiest = {0};
  for (int e = 0; ok && ep > 1 && e < ep; e++) { /* ep rank e's experts over its tp x moe_dp grid */
    size_t e0, held; /* ep rank e's experts: dopt_split_range, as distributed/ splits an expert stack */
    dopt_split_range((size_t)E, ep, e, &e0, &held);
    for (int i = 0; i < n; i++) mine[i] = c[i].expert ? (double)c[i].count / E * (double)held : 0;
    memset(est, 0, (size_t)(tp * md) * 3 * sizeof *est);
    rank_mem em = {0};
    ok = tally(c, n, mine, opt, hp, grank, tp, md, zero, est, est + tp * md, est + 2 * tp * md, &em);
    if (em.params > busiest.params) busiest = em;
    out->owned += em.owned, out->piecewise += em.piecewise; /* every ep rank's experts: each expert's tensors once */
    for (int w = 0; ok && w < world; w++) {
      const dopt_rank_coords x = dopt_rank_coords_of(w, tp, dp, ep);
      if (x.ep != e) continue;
      const int sl = x.moe_dp * tp + x.tp; /* its slot in ep rank e's tp x moe_dp grid */
      st[w] += est[sl], copy[w] += est[tp * md + sl], work[w] += est[2 * tp * md + sl];
    }
  }
  out->params += busiest.params, out->grads += busiest.grads;
  for (int r = 0; ok && r < world; r++) {
    out->states_sum += st[r];
    out->states_max = r == 0 || st[r] > out->states_max ? st[r] : out->states_max;
    out->states_min = r == 0 || st[r] < out->states_min ? st[r] : out->states_min;
    out->owner_copy_max = copy[r] > out->owner_copy_max ? copy[r] : out->owner_copy_max;
    out->cost_sum += work[r];
    out->cost_max = work[r] > out->cost_max ? work[r] : out->cost_max;
  }
  free(st), free(est);
  return ok;
}

static int print_per_rank(const cmp_model *m, int grank, int pp, int tp, int dp, int ep, int zero) {
  const double gib = 1024.0 * 1024.0 * 1024.0;
  if (ep > 1)
    printf("\nper rank, tp=%d x dp=%d (moe_dp=%d x ep=%d) x zero=%d (fp32 parameters; the largest TP block; "
           "distributed/'s moe_hybrid layout:\nthe dense tensors over dp, each ep rank's experts (%d of %d on the "
           "busiest) over its moe_dp; params and grads of the busiest ep rank):\n", tp, dp, dp / ep, ep, zero,
           m->experts / ep + (m->experts % ep != 0), m->experts);
  else if (pp > 1)
    printf("\nper rank, pp=%d x tp=%d x dp=%d x zero=%d (fp32 parameters; the largest TP block; distributed/'s layout;\n"
           "the stage whose ranks hold the most parameters and states; layers per stage as ColossalAI's default):\n",
           pp, tp, dp, zero);
  else
    printf("\nper rank, tp=%d x dp=%d x zero=%d (fp32 parameters; the largest TP block; distributed/'s layout):\n", tp,
           dp, zero);
  printf("| optimizer |%s tensors piecewise / owner | params GiB | grads GiB | states GiB (max rank) | states GiB (min rank) "
         "| max / mean | states bytes (max) | states bytes (all ranks) | step cost max / mean |\n"
         "|---|%s---|---:|---:|---:|---:|---:|---:|---:|---:|\n", pp > 1 ? " stage |" : "", pp > 1 ? "---:|" : "");
  for (int k = 0; k < dopt_optim_registry_count(); k++) {
    const char *name = dopt_optim_registry_name(k);
    const char *h = cli_default_hparams(name);
    rank_mem r, best;
    int bs = -1;
    double all = 0; /* every rank's state bytes, every stage */
    for (int s = 0; s < pp; s++) {
      if (!per_rank(m, (stage_sel){s, pp}, name, h, grank, tp, dp, ep, zero, &r)) {
        bs = -1;
        break;
      }
      all += r.states_sum;
      if (bs < 0 || r.params + r.owner_copy_max + r.states_max > best.params + best.owner_copy_max + best.states_max)
        best = r, bs = s;
    }
    if (bs < 0) {
      printf("| %s |%s n/a | | | | | | | | |\n", name, pp > 1 ? " |" : "");
      continue;
    }
    r = best;
    char stage[16] = "";
    if (pp > 1) snprintf(stage, sizeof stage, " %d |", bs);
    const double mean = r.states_sum / (double)(tp * dp), cmean = r.cost_sum / (double)(tp * dp);
    printf("| %s |%s %ld / %ld | %.2f | %.2f | %.3f | %.3f | %.3f | %.0f | %.0f | %.3f |\n", name, stage, r.piecewise,
           r.owned, (r.params + r.owner_copy_max) / gib, r.grads / gib, r.states_max / gib, r.states_min / gib,
           mean > 0 ? r.states_max / mean : 1.0, r.states_max, all, cmean > 0 ? r.cost_max / cmean : 1.0);
  }
  printf("owner mode (GaLore's projected matrices, Muon's matrices): every state of the tensor whole on one rank, an\n"
         "expert stack's per expert on its owners (params include the owner's fp32 copy, max rank); piecewise: elementwise states (8-bit codes too) sharded like\n"
         "the parameter, blockwise ones (8-bit absmax) by the blocks of each rank's piece, factored/scalar ones whole\n"
         "on every rank.\n");
  return CLI_OK;
}

/* ---- per rank under Gemini (--chunk-size): ZeRO-3 over chunks (docs/distributed.md "Gemini") -------------
 * The model's tensors in order (cmp_model_tensor_at), TP rank 0's blocks packed into chunks of C = chunk
 * rounded up to a multiple of dp (a block larger than C alone in a chunk of its size rounded up), rank q
 * holding [q·S, (q+1)·S) of each chunk; as distributed/ lays it out (dd_shard). Per world rank: the fp32
 * master shard, the TP block's gradient accumulator, elementwise states over its shard, blockwise ones over
 * the blocks of its piece, the others whole; owner mode as per_rank (every state whole on its owner). */
static void tensor_piece(const cmp_model_tensor *t, int tp, int r, dopt_piece *pc) {
  dopt_tp_block(t->ndim, t->shape, t->role, tp, r, pc);
}

static int print_gemini(const cmp_model *m, int grank, int tp, int dp, size_t chunk) {
  const double gib = 1024.0 * 1024.0 * 1024.0;
  const int T = cmp_model_ntensors(m), world = tp * dp;
  const size_t D = (size_t)dp, C = (chunk + D - 1) / D * D;
  size_t *n0 = malloc((size_t)T * sizeof *n0);
  dopt_chunk_slot *cs = malloc((size_t)T * sizeof *cs);
  double *st = malloc((size_t)world * sizeof *st), *par = malloc((size_t)world * sizeof *par);
  double *tb = malloc((size_t)T * sizeof *tb), *tc = malloc((size_t)T * sizeof *tc);
  int *slot = malloc((size_t)T * sizeof *slot), *own = malloc((size_t)T * sizeof *own);
  if (!n0 || !cs || !st || !par || !tb || !tc || !slot || !own) {
    free(n0), free(cs), free(st), free(par), free(tb), free(tc), free(slot), free(own);
    return cli_errorf(CMD, "gemini: %d tensors", T);
  }
  size_t grads = 0;
  for (int i = 0; i < T; i++) { /* TP rank 0's blocks (the largest) make the chunks, as in distributed/ */
    cmp_model_tensor t;
    dopt_piece pc;
    cmp_model_tensor_at(m, i, &t);
    tensor_piece(&t, tp, 0, &pc);
    grads += n0[i] = pc.len;
  }
  dopt_chunk_pack(n0, (size_t)T, chunk, D, cs);
  printf("\nper rank, gemini chunk %zu (%zu as a multiple of dp) x tp=%d x dp=%d (fp32 masters sharded by chunk; "
         "distributed/'s layout):\n", chunk, C, tp, dp);
  printf("| optimizer | params GiB (max rank) | grads GiB | states GiB (max rank) | states GiB (min rank) | max / mean "
         "| states bytes (all ranks) |\n|---|---:|---:|---:|---:|---:|---:|\n");
  for (int k = 0; k < dopt_optim_registry_count(); k++) {
    const char *name = dopt_optim_registry_name(k), *hp = cli_default_hparams(name);
    int ok = 1, nown = 0;
    for (int w = 0; w < world; w++) st[w] = par[w] = 0;
    for (int i = 0; ok && i < T; i++) {
      cmp_model_tensor t;
      cmp_model_tensor_at(m, i, &t);
      char h[256];
      tensor_hparams(name, hp, t.projected, grank, h, sizeof h);
      dopt_optim *o;
      if (dopt_optim_create(name, h, &o) != DOPT_OK) {
        ok = 0;
        break;
      }
      const dopt_optim_impl *im = dopt__optim_impl(o);
      const double *ghp = dopt__optim_group_hp(o, 0);
      dopt_state_spec sp[DOPT_MAX_STATES];
      const int ns = im->layout(ghp, t.ndim, t.shape, sp);
      const int owned = dopt__impl_whole(im, ghp, t.ndim, t.shape);
      double whole = 0;
      for (int q = 0; q < ns; q++) whole += (double)sp[q].v.bytes;
      if (owned) { /* every state whole on one owner (a unit per tensor: the expert stacks are not split here) */
        tb[nown] = whole, tc[nown] = dopt__impl_cost(im, ghp, t.ndim, t.shape), own[nown++] = i;
      }
      for (int w = 0; w < world; w++) { /* world rank w: tp rank w mod tp, dp rank w / tp */
        dopt_piece pc;
        tensor_piece(&t, tp, w % tp, &pc);
        dopt_chunk_range(cs[i], pc.len, (size_t)(w / tp), &pc.lo, &pc.len);
        par[w] += (double)pc.len * 4;
        if (owned) continue;
        for (int e = 0; e < ns; e++) {
          const double es = (double)dopt_dtype_size(sp[e].v.dtype);
          if (sp[e].kind == DOPT_STATE_ELEMENTWISE) st[w] += (double)pc.len * es;
          else if (sp[e].kind == DOPT_STATE_WHOLE) st[w] += (double)sp[e].v.bytes;
          else st[w] += (double)dopt_piece_blocks(&pc, sp[e].block, NULL) * es; /* the logical blocks of its piece */
        }
      }
      dopt_optim_destroy(o);
    }
    if (ok && nown && dopt__assign_owners(nown, tc, tb, world, slot) != 0) ok = 0;
    for (int j = 0; ok && j < nown; j++) { /* the owner's states and its fp32 copy of the tensor */
      cmp_model_tensor t;
      cmp_model_tensor_at(m, own[j], &t);
      int64_t n = 1;
      for (int q = 0; q < t.ndim; q++) n *= t.shape[q];
      st[slot[j]] += tb[j], par[slot[j]] += (double)n * 4;
    }
    if (!ok) {
      printf("| %s | n/a | | | | | |\n", name);
      continue;
    }
    double mx = 0, mn = 0, all = 0, pm = 0;
    for (int w = 0; w < world; w++) {
      all += st[w];
      mx = w == 0 || st[w] > mx ? st[w] : mx;
      mn = w == 0 || st[w] < mn ? st[w] : mn;
      pm = par[w] > pm ? par[w] : pm;
    }
    printf("| %s | %.3f | %.3f | %.3f | %.3f | %.3f | %.0f |\n", name, pm / gib, (double)grads * 4 / gib, mx / gib,
           mn / gib, all > 0 ? mx / (all / world) : 1.0, all);
  }
  printf("Gemini shards chunks, so a rank's share of a chunk that is not full can be padding only: max / mean over\n"
         "1 where chunks are large against the model (docs/distributed.md, \"Gemini\").\n");
  free(n0), free(cs), free(st), free(par), free(tb), free(tc), free(slot), free(own);
  return CLI_OK;
}

int cmd_mem(int argc, char **argv) {
  const char *which = "llama-7b";
  int rank = 0, tp = 0, dp = 0, zero = -1, pp = 0, ep = 0;
  size_t chunk = 0;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
      printf("usage: distopt mem [--model llama-60m|llama-130m|llama-350m|llama-1b|llama-7b|COUNT[k|m|b][xLAYERS][eEXPERTS]]\n"
             "                  [--rank R] [--tp T --dp D --zero Z --pp P] [--chunk-size N] [--ep E]\n"
             "  exact optimizer-state bytes of the model for every registered optimizer (GaLore on the\n"
             "  attention/MLP linears with rank R, default the paper's rank for the size), and the GaLore\n"
             "  paper's weights+states figures (BF16) next to the same accounting here. With --tp/--dp/--zero\n"
             "  (any one given; the others default to 1, 1, 0): the bytes per rank of parameters, gradients\n"
             "  and states in distributed/'s layout (piecewise or owner mode); --pp: per rank of the busiest\n"
             "  pipeline stage (layers as ColossalAI's default); --chunk-size: Gemini's chunked ZeRO-3 per rank;\n"
             "  --ep: moe_hybrid, each ep rank's experts over its moe_dp = dp / ep ranks (mixtral-8x7b --ep 8); a stack's\n"
             "  states over dp in ranges of each ep rank's experts, counted as the dense layout's (within a padding).\n"
             "  A COUNT (100m, 1.5b, 2mx32) is a\n"
             "  LLaMA of about that many parameters, eEXPERTS a MoE one (4mx2e8; docs/cli.md, \"Models\").\n");
      return CLI_OK;
    }
    if (i + 1 >= argc) return cli_errorf(CMD, "option '%s' needs a value (or is unknown)", argv[i]);
    if (strcmp(argv[i], "--model") == 0) which = argv[++i];
    else if (strcmp(argv[i], "--chunk-size") == 0) {
      const char *v = argv[++i];
      char *end;
      unsigned long long x = strtoull(v, &end, 10);
      if (*v < '0' || *v > '9' || *end || x < 1 || x > CMP_CHUNK_MAX)
        return cli_errorf(CMD, "--chunk-size '%s': expected an integer in [1, %zu]", v, CMP_CHUNK_MAX);
      chunk = (size_t)x;
    }
    else if (strcmp(argv[i], "--rank") == 0) {
      rank = atoi(argv[++i]);
      if (rank <= 0) return cli_errorf(CMD, "--rank '%s': expected a positive integer", argv[i]);
    } else if (strcmp(argv[i], "--tp") == 0 || strcmp(argv[i], "--dp") == 0 || strcmp(argv[i], "--zero") == 0 ||
               strcmp(argv[i], "--pp") == 0 || strcmp(argv[i], "--ep") == 0) {
      const char *opt = argv[i], *v = argv[++i];
      char *end;
      long x = strtol(v, &end, 10);
      int is_zero = strcmp(opt, "--zero") == 0;
      if (*v == '\0' || *end || x < (is_zero ? 0 : 1) || x > (is_zero ? 3 : 4096))
        return cli_errorf(CMD, "%s '%s': expected an integer in [%d, %d]", opt, v, is_zero ? 0 : 1, is_zero ? 3 : 4096);
      if (is_zero) zero = (int)x;
      else if (strcmp(opt, "--pp") == 0) pp = (int)x;
      else if (strcmp(opt, "--ep") == 0) ep = (int)x;
      else if (strcmp(opt, "--tp") == 0) tp = (int)x;
      else dp = (int)x;
    } else return cli_errorf(CMD, "unknown option '%s' (see --help)", argv[i]);
  }
  cmp_model mm;
  if (cmp_model_parse(which, &mm) != DOPT_OK) return cli_errorf(CMD, "%s", dopt_last_error());
  const cmp_model *m = &mm;
  if (rank == 0) rank = m->galore_rank;
  const double params = cmp_model_params(m), gib = 1024.0 * 1024.0 * 1024.0;
  char moe[32] = "";
  if (m->experts > 0) snprintf(moe, sizeof moe, ", %d experts", m->experts);
  printf("%s: %.3f B parameters (%.0f; hidden %d, intermediate %d, %d layers%s, vocab %d); weights %.2f GiB bf16, %.2f GiB fp32\n",
         m->name, params / 1e9, params, m->hidden, m->inter, m->layers, moe, m->vocab, params * 2 / gib, params * 4 / gib);
  printf("%-18s %-28s %12s %10s %10s\n", "optimizer", "hyperparameters", "states GiB", "B/param", "vs adamw");
  int okw;
  double adamw = model_state_bytes(m, "adamw", "", rank, &okw);
  char hp[64];
  for (int k = 0; k < dopt_optim_registry_count(); k++) {
    const char *name = dopt_optim_registry_name(k);
    const char *h = cli_default_hparams(name);
    int ok;
    if (strcmp(name, "galore") == 0) { /* a row per inner it can wrap (the others refuse: not a row) */
      for (int j = 0; j < dopt_optim_registry_count(); j++) {
        const char *in = dopt_optim_registry_name(j), *ih = cli_default_hparams(in);
        char hx[512];
        snprintf(hx, sizeof hx, "inner=%s%s%s", in, *ih ? "," : "", ih);
        double b = model_state_bytes(m, name, hx, rank, &ok);
        if (!ok) continue;
        snprintf(hp, sizeof hp, "%s, rank=%d", in, rank);
        printf("%-18s %-28s %12.2f %10.2f %9.1f%%\n", name, hp, b / gib, b / params, okw ? 100.0 * b / adamw : 0.0);
      }
      continue;
    }
    double b = model_state_bytes(m, name, h, rank, &ok);
    if (!ok) {
      printf("%-18s %-28s %12s\n", name, h, "n/a");
      continue;
    }
    snprintf(hp, sizeof hp, "%s", h);
    if (projects(name)) snprintf(hp, sizeof hp, "rank=%d (attn+mlp)", rank);
    if (strcmp(name, "lisa") == 0) snprintf(hp, sizeof hp, "adamw, all layers seen");
    printf("%-18s %-28s %12.2f %10.2f %9.1f%%\n", name, hp, b / gib, b / params, okw ? 100.0 * b / adamw : 0.0);
    for (size_t j = 0; j < sizeof SETTINGS / sizeof SETTINGS[0]; j++) {
      if (strcmp(SETTINGS[j].opt, name) != 0) continue;
      b = model_state_bytes(m, name, SETTINGS[j].hp, rank, &ok);
      if (ok)
        printf("%-18s %-28s %12.2f %10.2f %9.1f%%\n", name, SETTINGS[j].label, b / gib, b / params,
               okw ? 100.0 * b / adamw : 0.0);
    }
  }
  /* the GaLore paper's Table 2 accounting: BF16 weights and states (2 bytes) */
  if (m->paper_full_gb > 0) {
    int ok1, ok2;
    double full = params * 2 + adamw / 2; /* fp32 states here -> bf16 */
    double gal = model_state_bytes(m, "galore_adamw", "", rank, &ok2);
    (void)ok1;
    printf("\nGaLore paper, Table 2 (weights + optimizer states, BF16, %s, rank %d):\n", m->name, rank);
    printf("  full-rank Adam: paper %.2f G, here %.2f G\n", m->paper_full_gb, full / 1e9);
    if (ok2) printf("  GaLore:         paper %.2f G, here %.2f G\n", m->paper_galore_gb, (params * 2 + gal / 2) / 1e9);
    else printf("  GaLore:         paper %.2f G (galore_adamw not registered in this build)\n", m->paper_galore_gb);
  }
  if (pp > CMP_PP_MAX || pp > m->layers)
    return cli_errorf(CMD, "--pp %d: at most %d stages and the model's %d layers", pp, CMP_PP_MAX, m->layers);
  if (ep > 1) {
    const int d = dp ? dp : 1;
    if (m->experts < 1)
      return cli_errorf(CMD, "--ep %d: the model has no experts to split (a Mixtral preset, COUNT...eE or eEs)", ep);
    if (d % ep != 0 || zero == 3 || chunk || pp > 1)
      return cli_errorf(CMD, "--ep %d: moe_hybrid needs dp a multiple of ep (dp=%d), zero 0-2 and no --pp or "
                        "--chunk-size", ep, d);
  }
  if (chunk) {
    if ((zero >= 0 && zero != 3) || pp > 1)
      return cli_errorf(CMD, "--chunk-size (gemini) is ZeRO-3 without stages: not with --zero %d or --pp %d", zero, pp);
    return print_gemini(m, rank, tp ? tp : 1, dp ? dp : 1, chunk);
  }
  if (tp || dp || zero >= 0 || pp || ep)
    return print_per_rank(m, rank, pp ? pp : 1, tp ? tp : 1, dp ? dp : 1, ep ? ep : 1, zero >= 0 ? zero : 0);
  return CLI_OK;
}
