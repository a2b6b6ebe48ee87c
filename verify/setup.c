/* distopt verify, setup (verifier.h): the recording's index and tensor files, the reference optimizer created
 * with the recorded name, hyperparameters and groups and started from the recorded values or states. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "files.h"
#include "verifier.h"

/* ---- the index ---------------------------------------------------------------------- */

int vf_load_index(vctx *c) {
  if (vr_reader_open(&c->rd, c->trace) != DOPT_OK) return cli_errorf(CMD, "%s", c->rd.err);
  if (c->rd.ix.steps == c->rd.ix.start_step)
    return cli_errorf(CMD, "%s: steps: %ld: the recording holds no step (nothing to verify)", c->rd.index_path,
                      c->rd.ix.steps);
  return CLI_OK;
}

/* ---- tensor files ------------------------------------------------------------------- */

int vf_piece_index(const vctx *c, int r, int param) {
  const vr_rank *rk = &c->rd.ix.ranks[r];
  for (int i = 0; i < rk->npieces; i++)
    if (rk->pieces[i].param == param) return i;
  return -1;
}

/* The state key's statistic of rank r's piece i, created at first sight (the reader calls this for
 * every state tensor of a file it loads). */
static int key_stat(void *user, int r, int i, const char *key, const char *fpath, const char *tname, char *err,
                    size_t cap) {
  vctx *c = user;
  vpiece_keys *k = &c->rt[r].keys[i];
  for (int j = 1; j <= k->nkeys; j++)
    if (strcmp(c->st[k->stat[j]].key, key) == 0) return 0;
  if (k->nkeys == VR_MAX_KEYS) {
    snprintf(err, cap, "%s: tensor '%s': more than %d state keys for one parameter (the limit)", fpath, tname,
             VR_MAX_KEYS);
    return -1;
  }
  int si = vf_new_stat(c, r, &c->rd.ix.ranks[r].pieces[i], key);
  if (si < 0) {
    snprintf(err, cap, "out of memory");
    return -1;
  }
  k->stat[++k->nkeys] = si;
  return 0;
}

/* Makes rank r's open file the one holding step t. */
int vf_file_for_step(vctx *c, int r, long t) {
  return vr_reader_seek(&c->rd, r, t) == DOPT_OK ? CLI_OK : cli_errorf(CMD, "%s", c->rd.err);
}

/* ---- setup -------------------------------------------------------------------------- */

/* The reference's parameter p after step t: the optimizer's (c->data[p]) or, with --reference, REF's
 * param/<t>/<p> copied into c->data[p]; NULL when REF lacks it. */
const float *vf_ref_param(vctx *c, int p, long t) {
  if (!c->ref_path) return c->data[p];
  char key[VR_MAX_NAME + 64];
  size_t n = 0;
  snprintf(key, sizeof key, "param/%ld/%s", t, c->rd.ix.params[p].name);
  const void *b = vr_reader_f32(&c->ref, 0, t, key, &n);
  if (!b || (int64_t)n != c->rd.ix.params[p].numel) return NULL;
  memcpy(c->data[p], b, n * sizeof(float));
  return c->data[p];
}

/* A scalar tensor's value (a step count: F32, F64, I32 or I64). */
double vf_scalar_value(const dopt_st_tensor *x) {
  if (x->dtype == DOPT_F32) {
    float v;
    memcpy(&v, x->data, sizeof v);
    return v;
  }
  if (x->dtype == DOPT_F64) {
    double v;
    memcpy(&v, x->data, sizeof v);
    return v;
  }
  if (x->dtype == DOPT_I64) {
    int64_t v;
    memcpy(&v, x->data, sizeof v);
    return (double)v;
  }
  int32_t v;
  memcpy(&v, x->data, sizeof v);
  return v;
}


/* The recorded tensor names of the state before step t+1 (t = the window's start: init/, init_state/). */
static void before_names(const vctx *c, long t, int p, const char *key, char *buf, size_t cap) {
  const char *pn = c->rd.ix.params[p].name;
  if (t == c->rd.ix.start_step) {
    if (key) snprintf(buf, cap, "init_state/%s/%s", pn, key);
    else snprintf(buf, cap, "init/%s", pn);
  } else {
    if (key) snprintf(buf, cap, "state/%ld/%s/%s", t, pn, key);
    else snprintf(buf, cap, "param/%ld/%s", t, pn);
  }
}

/* Sets the reference's parameters and states to those recorded after step t (the window's start: its initial
 * ones): parameters from their source pieces; each F32 state of the reference from every rank's recorded range
 * (the lowest rank's value where ranges overlap), every element covered; the step counts. A state no rank
 * records keeps the reference's value (a GaLore projector, adopted at refreshes) unless `strict` (a window's
 * start: the reference has no value of its own). */
int vf_force_states(vctx *c, long t, int strict) {
  const vr_index *ix = &c->rd.ix;
  vr_reader *rd = &c->rd;
  const long at = t == ix->start_step ? t + 1 : t; /* the file holding the names */
  char key[VR_MAX_NAME + VR_MAX_KEY + 64];
  for (int r = 0; r < ix->world_size; r++)
    if (ix->ranks[r].npieces && vf_file_for_step(c, r, at)) return CLI_USAGE;
  for (int p = 0; p < ix->nparams; p++) {
    const vr_param *vp = &ix->params[p];
    if (t > ix->start_step) { /* (the window's start: vr_reader_init has set them) */
      before_names(c, t, p, NULL, key, sizeof key);
      for (int k = 0; k < rd->nsrc[p]; k++) {
        const vr_source *sr = &rd->src[p][k];
        dopt_st_tensor x;
        if (dopt_st_find(rd->f[sr->rank], key, &x) != DOPT_OK)
          return cli_errorf(CMD, "%s: --stepwise: rank %d's file for step %ld has no '%s' (the state to start step %ld "
                                 "from)", rd->index_path, sr->rank, at, key, t + 1);
        vr_piece_put(sr->pc, x.data, c->data[p]);
      }
    }
    /* the step count (any rank's piece), which also says whether the recorded run had states for p */
    before_names(c, t, p, "step", key, sizeof key);
    int have = 0;
    double step = 0;
    for (int r = 0; r < ix->world_size && !have; r++) {
      const vr_piece *pc = vr_rank_piece(ix, r, p);
      dopt_st_tensor x;
      if (pc && dopt_st_find(rd->f[r], key, &x) == DOPT_OK) have = 1, step = vf_scalar_value(&x);
    }
    if (!have) continue; /* the recorded run had no state for p yet: neither has the reference */
    dopt_status s = DOPT_OK;
    if (dopt_optim_num_states(c->opt, p) == 0) s = dopt_optim_init_state(c->opt, p);
    if (s == DOPT_OK) s = dopt_optim_set_step(c->opt, p, (int64_t)step);
    if (s != DOPT_OK) return vf_lib_error(vp->name, s);
    int nst = dopt_optim_num_states(c->opt, p);
    for (int k = 0; k < nst; k++) {
      dopt_state_view v;
      if (dopt_optim_state(c->opt, p, k, &v) != DOPT_OK || v.dtype != DOPT_F32) continue;
      int64_t n = 1;
      for (int d = 0; d < v.ndim; d++) n *= v.shape[d];
      if ((size_t)n > c->scratch_n)
        return cli_errorf(CMD, "state '%s' of '%s' has %lld elements, more than its parameter's", v.name, vp->name,
                          (long long)n);
      before_names(c, t, p, v.name, key, sizeof key);
      memset(c->mask, 0, (size_t)n);
      int64_t covered = 0;
      int any = 0;
      for (int r = 0; r < ix->world_size; r++) {
        const vr_piece *pc = vr_rank_piece(ix, r, p);
        dopt_st_tensor x;
        int64_t lo, len;
        int mapped;
        if (!pc || dopt_st_find(rd->f[r], key, &x) != DOPT_OK) continue;
        any = 1;
        if (vf_state_range(c, pc, v.name, n, &lo, &len, &mapped) || (!mapped && lo + len > n) || (int64_t)x.numel != len)
          return cli_errorf(CMD, "%s: rank %d: tensor '%s' (%zu elements) does not fit the reference's state of %lld "
                                 "elements", rd->index_path, r, key, x.numel, (long long)n);
        for (int64_t i = 0; i < len; i++) {
          const int64_t e = mapped ? vr_piece_elem(pc, i) : lo + i;
          if (!c->mask[e]) {
            c->mask[e] = 1;
            memcpy(c->scratch + e, (const unsigned char *)x.data + 4 * i, sizeof(float));
            covered++;
          }
        }
      }
      if (!any && !strict) continue;
      if (covered != n) {
        int64_t i = 0;
        while (i < n && c->mask[i]) i++;
        return cli_errorf(CMD, "%s: %s: state '%s' of '%s' after step %ld: element %lld of %lld is recorded by no "
                               "rank (the reference cannot start from it)", rd->index_path,
                          strict ? "the window's start" : "--stepwise", v.name, vp->name, t, (long long)i,
                          (long long)n);
      }
      memcpy(v.data, c->scratch, (size_t)n * sizeof(float));
    }
  }
  if (dopt_optim_set_gstep(c->opt, t) != DOPT_OK) return vf_lib_error("gstep", DOPT_ERR_INVALID_ARG);
  return CLI_OK;
}

int vf_single_device_of(const vctx *c, const vr_reader *other, const char *opt, const char *what) {
  const vr_index *ix = &c->rd.ix, *rx = &other->ix;
  if (rx->world_size != 1)
    return cli_errorf(CMD, "%s %s: world_size %d, expected 1 (%s)", opt, other->index_path, rx->world_size, what);
  if (rx->nparams != ix->nparams)
    return cli_errorf(CMD, "%s %s: %d parameters, the recording has %d", opt, other->index_path, rx->nparams,
                      ix->nparams);
  for (int p = 0; p < ix->nparams; p++) {
    const vr_param *a = &ix->params[p];
    int q = vr_index_find_param(rx, a->name);
    if (q < 0) return cli_errorf(CMD, "%s %s: parameter '%s' is missing", opt, other->index_path, a->name);
    const vr_param *b = &rx->params[q];
    int same = b->ndim == a->ndim && b->group == a->group;
    for (int d = 0; same && d < a->ndim; d++) same = b->shape[d] == a->shape[d];
    if (!same) {
      char sa[160], sb[160];
      dopt__shape_text(a->ndim, a->shape, sa, sizeof sa);
      dopt__shape_text(b->ndim, b->shape, sb, sizeof sb);
      return cli_errorf(CMD, "%s %s: parameter '%s' is %s in group %d, the recording's %s in group %d", opt,
                        other->index_path, a->name, sb, b->group, sa, a->group);
    }
  }
  if (rx->start_step > ix->start_step || rx->steps < ix->steps)
    return cli_errorf(CMD, "%s %s: steps %ld..%ld, the recording's are %ld..%ld", opt, other->index_path,
                      rx->start_step + 1, rx->steps, ix->start_step + 1, ix->steps);
  return CLI_OK;
}

static int open_reference(vctx *c) {
  const vr_index *ix = &c->rd.ix;
  if (vr_reader_open(&c->ref, c->ref_path) != DOPT_OK) return cli_errorf(CMD, "--reference: %s", c->ref.err);
  const vr_index *rx = &c->ref.ix;
  /* the same computation: every parameter's shape and group, the optimizer, hyperparameters of every group; what
   * a single-device twin legitimately differs in passes (its world size, a longer window, its gradients' dtype) */
  int rc = vf_single_device_of(c, &c->ref, "--reference", "the single-device reference");
  if (rc) return rc;
  if (strcmp(rx->optimizer, ix->optimizer) != 0)
    return cli_errorf(CMD, "--reference %s: optimizer '%s', the recording's is '%s'", c->ref.index_path,
                      rx->optimizer[0] ? rx->optimizer : "null", ix->optimizer[0] ? ix->optimizer : "null");
  if (rx->ngroups != ix->ngroups)
    return cli_errorf(CMD, "--reference %s: %d parameter groups, the recording has %d", c->ref.index_path, rx->ngroups,
                      ix->ngroups);
  for (int g = 0; g < ix->ngroups; g++)
    if (strcmp(rx->group_hparams[g], ix->group_hparams[g]) != 0)
      return cli_errorf(CMD, "--reference %s: group %d's hyperparameters '%.200s', the recording's '%.200s'",
                        c->ref.index_path, g, rx->group_hparams[g], ix->group_hparams[g]);
  return CLI_OK;
}

int vf_setup(vctx *c) {
  const vr_index *ix = &c->rd.ix;
  if (!c->ref_path && !ix->optimizer[0])
    return cli_errorf(CMD, "%s: optimizer.name is null: %s has no distopt optimizer; replay it with your own "
                           "(distopt.replay, docs/verify.md) and give --reference", c->rd.index_path,
                      ix->upstream[0] ? ix->upstream : "the recorded class");
  const verify_tol *tol = vf_find_tol(ix->optimizer);
  if (!c->ref_path) c->exact_states = vf_exact_states(ix->optimizer, ix->upstream);
  if (c->rtol_param > 0.0 || c->rtol_state > 0.0) { /* per kind: the other kind from --rtol, else declared */
    const double dp = c->rtol > 0 ? c->rtol : tol ? (c->stepwise ? tol->step_param : tol->param) : 0;
    const double ds = c->rtol > 0 ? c->rtol : tol ? (c->stepwise ? tol->step_state : tol->state) : 0;
    c->tol_param = c->rtol_param > 0 ? c->rtol_param : dp;
    c->tol_state = c->rtol_state > 0 ? c->rtol_state : ds;
    c->tol_source = "--rtol-param/--rtol-state";
    if (!(c->tol_param > 0) || !(c->tol_state > 0))
      return cli_errorf(CMD, "%s: optimizer.name '%s' has no declared%s tolerance for %s (give --rtol-%s or --rtol)",
                        c->rd.index_path, ix->optimizer[0] ? ix->optimizer : "null", c->stepwise ? " per-step" : "",
                        c->tol_param > 0 ? "states" : "parameters", c->tol_param > 0 ? "state" : "param");
  } else if (c->rtol > 0.0) {
    c->tol_param = c->tol_state = c->rtol;
    c->tol_source = "--rtol";
  } else if (c->ref_path) { /* a replay of the same code on the same machine: bitwise, unless --rtol says why not */
    c->tol_param = c->tol_state = 0.0;
    c->tol_source = "exact: --reference replays the same code (--rtol for a reference that is not)";
  } else if (tol && (!c->stepwise || tol->step_param > 0)) {
    c->tol_param = c->stepwise ? tol->step_param : tol->param;
    c->tol_state = c->stepwise ? tol->step_state : tol->state;
    c->tol_source = c->stepwise ? "declared per step" : "declared";
    c->tol_update = tol->update, c->update_counter = tol->update_counter;
  } else {
    return cli_errorf(CMD, "%s: optimizer.name '%s' has no declared%s tolerance (give --rtol)", c->rd.index_path,
                      ix->optimizer[0] ? ix->optimizer : "null", c->stepwise ? " per-step" : "");
  }
  if (ix->grads == VR_GRADS_BF16 && c->rtol <= 0.0 && c->rtol_param <= 0.0 && c->rtol_state <= 0.0)
    return cli_errorf(CMD, "%s: record.grads is BF16: the replay's gradients are the recorded run's rounded to bf16, "
                           "so the declared tolerances do not apply (give --rtol; docs/verify.md)", c->rd.index_path);
  if (c->stepwise && (!ix->record_params || !ix->record_states))
    return cli_errorf(CMD, "%s: --stepwise starts each step from the recorded parameters and states, but record.%s is "
                           "false", c->rd.index_path, !ix->record_params ? "params" : "states");
  int np = ix->nparams;
  size_t maxn = 1;
  for (int p = 0; p < np; p++)
    if ((size_t)ix->params[p].numel > maxn) maxn = (size_t)ix->params[p].numel;
  dopt_status s;
  if (c->ref_path) {
    int rc = open_reference(c);
    if (rc) return rc;
    if (ix->clip_max_norm > 0)
      return cli_errorf(CMD, "%s: recorded before clipping (record.clip): --reference's replay does not clip; verify it "
                             "against the C reference", c->rd.index_path);
  } else {
    int rc = vf_twin_open(c);
    if (rc) return rc;
    if ((s = dopt_optim_create(ix->optimizer, ix->group_hparams[0], &c->opt)) != DOPT_OK)
      return vf_lib_error(c->rd.index_path, s);
    for (int g = 1; g < ix->ngroups; g++) {
      int gid;
      if ((s = dopt_optim_add_group(c->opt, ix->group_hparams[g], &gid)) != DOPT_OK) {
        char what[4400];
        snprintf(what, sizeof what, "%s: groups[%d].hparams", c->rd.index_path, g);
        return vf_lib_error(what, s);
      }
    }
  }
  c->data = calloc((size_t)np, sizeof *c->data);
  c->grad = calloc((size_t)np, sizeof *c->grad);
  c->gptr = calloc((size_t)np, sizeof *c->gptr);
  c->rt = calloc((size_t)ix->world_size, sizeof *c->rt);
  c->proj_stat = malloc((size_t)np * sizeof *c->proj_stat);
  c->ev_stat = malloc((size_t)np * sizeof *c->ev_stat);
  c->gath = malloc(maxn * sizeof *c->gath);
  if (!c->data || !c->grad || !c->gptr || !c->rt || !c->proj_stat || !c->ev_stat || !c->gath)
    return cli_errorf(CMD, "out of memory");
  for (int p = 0; p < np; p++) {
    c->proj_stat[p] = -1, c->ev_stat[p] = -1;
    size_t n = (size_t)ix->params[p].numel;
    if (n > SIZE_MAX / sizeof(float) / 2) return cli_errorf(CMD, "parameter '%s': too large", ix->params[p].name);
    c->data[p] = malloc(n * sizeof(float));
    c->grad[p] = c->ref_path ? NULL : malloc(n * sizeof(float));
    if (!c->data[p] || (!c->ref_path && !c->grad[p]))
      return cli_errorf(CMD, "out of memory for parameter '%s' (%zu elements)", ix->params[p].name, n);
  }
  if (c->tol_update > 0 && !c->ref_path) { /* the update allowance: each step's change of the reference */
    c->prev = calloc((size_t)np, sizeof *c->prev);
    c->stepped_ns = calloc((size_t)np, sizeof *c->stepped_ns);
    c->gath_prev = malloc(maxn * sizeof *c->gath_prev);
    if (!c->prev || !c->stepped_ns || !c->gath_prev) return cli_errorf(CMD, "out of memory");
    for (int p = 0; p < np; p++)
      if (!(c->prev[p] = malloc((size_t)ix->params[p].numel * sizeof(float) + 1)))
        return cli_errorf(CMD, "out of memory for parameter '%s' (%lld elements)", ix->params[p].name,
                          (long long)ix->params[p].numel);
  }
  for (int r = 0; r < ix->world_size; r++) {
    const vr_rank *rk = &ix->ranks[r];
    c->rt[r].keys = calloc(rk->npieces > 0 ? (size_t)rk->npieces : 1, sizeof *c->rt[r].keys);
    if (!c->rt[r].keys) return cli_errorf(CMD, "out of memory");
    for (int i = 0; i < rk->npieces; i++) {
      const vr_piece *pc = &rk->pieces[i];
      int si = vf_new_stat(c, r, pc, "");
      if (si < 0) return cli_errorf(CMD, "out of memory");
      c->rt[r].keys[i].stat[0] = si;
    }
  }
  /* every rank's first file (checked, its state keys seen), then the initial parameters: init/<p> of
   * each source piece, in its rank's first file */
  c->rd.on_state = key_stat;
  c->rd.user = c;
  c->rd.allow_digest = 1;
  for (int r = 0; r < ix->world_size; r++) {
    if (ix->ranks[r].npieces == 0) continue;
    int rc = vf_file_for_step(c, r, ix->start_step + 1);
    if (rc) return rc;
  }
  for (int p = 0; p < np; p++)
    if (vr_reader_init(&c->rd, p, c->data[p]) != DOPT_OK) return cli_errorf(CMD, "%s", c->rd.err);
  if (c->ref_path) return CLI_OK;
  for (int p = 0; p < np; p++) {
    const vr_param *vp = &ix->params[p];
    dopt_param_config pc = DOPT_PARAM_CONFIG_INIT;
    pc.name = vp->name;
    pc.ndim = vp->ndim;
    memcpy(pc.shape, vp->shape, sizeof pc.shape);
    pc.data = c->data[p];
    pc.layer = dopt_layer_from_name(vp->name);
    int id;
    if ((s = dopt_optim_add_param(c->opt, vp->group, &pc, &id)) != DOPT_OK) return vf_lib_error(c->rd.index_path, s);
  }
  if (ix->projectors && (s = dopt_optim_set_projector_hook(c->opt, vf_proj_hook, c)) != DOPT_OK)
    return vf_lib_error("record.projectors is true", s);
  /* states are as large as their parameter at most (elementwise, factored, low-rank); checked when forced */
  c->scratch_n = maxn;
  c->scratch = malloc(maxn * sizeof *c->scratch);
  c->mask = malloc(maxn);
  if (!c->scratch || !c->mask) return cli_errorf(CMD, "out of memory");
  if (ix->start_step > 0) return vf_force_states(c, ix->start_step, 1); /* a window: its recorded start */
  return CLI_OK;
}

/* The flat range of `key`'s state (n elements) that piece pc of a parameter of numel elements records: a
 * declared range, the whole state of a whole piece, or (n == numel) the piece's own elements; *mapped: those of
 * a block piece (element i at vr_piece_elem(pc, i)). -1: none of these. */
int vf_piece_state_range(const vr_piece *pc, int64_t numel, const char *key, int64_t n, int64_t *lo, int64_t *len,
                         int *mapped) {
  *mapped = 0;
  for (int i = 0; i < pc->nstates; i++)
    if (strcmp(pc->states[i].key, key) == 0) {
      *lo = pc->states[i].lo;
      *len = pc->states[i].len;
      return 0;
    }
  if (pc->lp.block_dim < 0 && pc->lp.lo == 0 && pc->lp.len == numel) { /* the whole parameter: the whole state */
    *lo = 0;
    *len = n;
    return 0;
  }
  if (n == numel) { /* elementwise */
    *lo = pc->lp.lo;
    *len = pc->lp.len;
    *mapped = pc->lp.block_dim >= 0;
    return 0;
  }
  return -1;
}

/* The range of `key`'s reference state (n elements) rank r's piece records (vf_piece_state_range). */
int vf_state_range(const vctx *c, const vr_piece *pc, const char *key, int64_t n, int64_t *lo, int64_t *len,
                   int *mapped) {
  return vf_piece_state_range(pc, c->rd.ix.params[pc->param].numel, key, n, lo, len, mapped);
}
