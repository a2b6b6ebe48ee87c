/* distopt verify --continues PREV (verifier.h): a window's start checked against the recording it continues.
 *
 * A run resumed from a checkpoint and recorded as a window (start_step k) starts its replay from the values its
 * window recorded at the start (init/, init_state/): taken as the truth, they hide a resume that carried a
 * state over wrongly (resharded to another layout in the wrong order, a state dropped, the step counter
 * reset). With --continues PREV, the recording of the run up to step k, every element of every piece the
 * window's ranks recorded at its start must be the element PREV's ranks recorded after step k, bit for bit
 * (a carried-over value is a copy; NaN equals NaN as docs/nan-policy.md says), whatever each side's world
 * size and layout: elements are matched by their index in the parameter's (or the state's) global tensor.
 * Every state PREV recorded after step k must be in the window's start too. The first difference (by
 * parameter, then key, then rank) is the verdict at step k; one that cannot be judged (no common element, a
 * state one side cannot place) is exit 2. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "files.h"
#include "verifier.h"

/* The flat range of a recorded tensor of `got` elements of piece pc of a parameter of numel elements — the
 * parameter itself (key "") or a state — by verify's one rule (vf_piece_state_range): no reference tells the
 * state's size here, so it is `got` for a whole piece (any state) and numel otherwise (a declared range, or the
 * piece's own elements). -1: it cannot be placed, or the tensor is not that range. */
static int span(const vr_piece *pc, int64_t numel, const char *key, int64_t got, int64_t *lo, int64_t *len,
                int *mapped) {
  const int whole = pc->lp.block_dim < 0 && pc->lp.lo == 0 && pc->lp.len == numel;
  return vf_piece_state_range(pc, numel, key, whole ? got : numel, lo, len, mapped) || got != *len ? -1 : 0;
}

static void tensor_name(char *buf, size_t cap, int prev, long k, const char *param, const char *key) {
  if (prev && key[0]) snprintf(buf, cap, "state/%ld/%.255s/%.63s", k, param, key);
  else if (prev) snprintf(buf, cap, "param/%ld/%.255s", k, param);
  else if (key[0]) snprintf(buf, cap, "init_state/%.255s/%.63s", param, key);
  else snprintf(buf, cap, "init/%.255s", param);
}

/* The state keys of parameter `param` in one rank's loaded file: tensors named PREFIX<key>, added to keys[]
 * (n of them, at most VR_MAX_KEYS + 1) when new. */
static void add_keys(const dopt_st_file *f, const char *prefix, char keys[][VR_MAX_KEY + 1], int *n) {
  const size_t pl = strlen(prefix);
  for (int i = 0; f && i < dopt_st_count(f); i++) {
    dopt_st_tensor x;
    if (dopt_st_get(f, i, &x) != DOPT_OK || strncmp(x.name, prefix, pl) != 0) continue;
    const char *key = x.name + pl;
    if (!key[0] || strchr(key, '/') || strlen(key) > VR_MAX_KEY) continue;
    int seen = 0;
    for (int j = 0; j < *n && !seen; j++) seen = strcmp(keys[j], key) == 0;
    if (!seen && *n <= VR_MAX_KEYS) snprintf(keys[(*n)++], VR_MAX_KEY + 1, "%s", key);
  }
}

static void note_difference(vctx *c, int rank, const char *param, const char *key, int64_t elem, int64_t ndiff,
                            int64_t n, float here, float there, int missing) {
  if (c->cont_step) return;
  c->cont_step = c->rd.ix.start_step, c->cont_rank = rank;
  snprintf(c->cont_tensor, sizeof c->cont_tensor, "%.255s%s%.63s", param, key[0] ? "/" : "", key);
  if (missing)
    snprintf(c->cont_why, sizeof c->cont_why, "the window's start has no state '%.63s', which --continues' recording "
             "holds after step %ld", key, c->cont_step);
  else
    snprintf(c->cont_why, sizeof c->cont_why, "%lld of the %lld elements the window starts from are not --continues' "
             "recording's after step %ld; the first, element %lld: %.9g here, %.9g there", (long long)ndiff,
             (long long)n, c->cont_step, (long long)elem, (double)here, (double)there);
}

static int same_bits(float a, float b) {
  return memcmp(&a, &b, sizeof a) == 0 || (isnan(a) && isnan(b));
}

/* One key of one parameter: PREV's elements after step k into g (mask: recorded), then every window piece's
 * elements at its start compared with them. */
static int check_key(vctx *c, int p, int q, const char *key, float *g, unsigned char *mask) {
  const vr_index *ix = &c->rd.ix, *px = &c->cont.ix;
  const long k = ix->start_step;
  const vr_param *vp = &ix->params[p];
  const int64_t numel = vp->numel;
  char name[VR_MAX_NAME + VR_MAX_KEY + 64];
  tensor_name(name, sizeof name, 1, k, vp->name, key);
  memset(mask, 0, (size_t)numel);
  int prev_any = 0;
  double prev_step = 0;
  for (int r = 0; r < px->world_size; r++) {
    const vr_piece *pc = vr_rank_piece(px, r, q);
    dopt_st_tensor x;
    if (!pc || vr_reader_seek(&c->cont, r, k) != DOPT_OK) {
      if (pc) return cli_errorf(CMD, "--continues: %s", c->cont.err);
      continue;
    }
    if (dopt_st_find(c->cont.f[r], name, &x) != DOPT_OK) continue;
    if (strcmp(key, "step") == 0) {
      prev_step = vf_scalar_value(&x), prev_any = 1;
      break;
    }
    if (x.dtype != DOPT_F32) continue;
    int64_t lo, len;
    int mapped;
    if (span(pc, numel, key, (int64_t)x.numel, &lo, &len, &mapped) || (!mapped && lo + len > numel))
      return cli_errorf(CMD, "--continues %s: rank %d's '%s' (%zu elements) does not fit '%s' (%lld elements)",
                        c->cont.index_path, r, name, x.numel, vp->name, (long long)numel);
    for (int64_t i = 0; i < len; i++) {
      const int64_t e = mapped ? vr_piece_elem(pc, i) : lo + i;
      if (!mask[e]) memcpy(g + e, (const unsigned char *)x.data + 4 * i, sizeof(float)), mask[e] = 1;
    }
    prev_any = 1;
  }
  int here_any = 0;
  int64_t ndiff = 0, n = 0, first = -1;
  float fa = 0, fb = 0;
  int first_rank = -1;
  tensor_name(name, sizeof name, 0, k, vp->name, key);
  for (int r = 0; r < ix->world_size; r++) {
    const vr_piece *pc = vr_rank_piece(ix, r, p);
    dopt_st_tensor x;
    if (!pc) continue;
    if (vf_file_for_step(c, r, k + 1)) return CLI_USAGE;
    if (dopt_st_find(c->rd.f[r], name, &x) != DOPT_OK) continue;
    here_any = 1;
    if (!prev_any)
      return cli_errorf(CMD, "--continues %s: no rank recorded '%s' of '%s' after step %ld, which %s's rank %d starts "
                             "from", c->cont.index_path, key[0] ? key : "the parameter", vp->name, k, c->rd.index_path, r);
    if (strcmp(key, "step") == 0) {
      const double here = vf_scalar_value(&x);
      c->cont_compared++;
      if (here != prev_step && !c->cont_step) {
        note_difference(c, r, vp->name, key, 0, 1, 1, (float)here, (float)prev_step, 0);
        snprintf(c->cont_why, sizeof c->cont_why, "the window's step count is %.17g, --continues' recording's after "
                 "step %ld is %.17g", here, k, prev_step);
      }
      continue;
    }
    if (x.dtype != DOPT_F32) continue;
    int64_t lo, len;
    int mapped;
    if (span(pc, numel, key, (int64_t)x.numel, &lo, &len, &mapped) || (!mapped && lo + len > numel))
      return cli_errorf(CMD, "%s: rank %d's '%s' (%zu elements) does not fit '%s' (%lld elements)", c->rd.index_path,
                        r, name, x.numel, vp->name, (long long)numel);
    int64_t rd = 0, rfirst = -1;
    float ra = 0, rb = 0;
    for (int64_t i = 0; i < len; i++) {
      const int64_t e = mapped ? vr_piece_elem(pc, i) : lo + i;
      if (!mask[e])
        return cli_errorf(CMD, "--continues %s: no rank recorded element %lld of '%s' of '%s' after step %ld, which "
                               "%s's rank %d starts from", c->cont.index_path, (long long)e,
                          key[0] ? key : "the parameter", vp->name, k, c->rd.index_path, r);
      float a;
      memcpy(&a, (const unsigned char *)x.data + 4 * i, sizeof a);
      if (!same_bits(a, g[e]) && rd++ == 0) rfirst = e, ra = a, rb = g[e];
    }
    c->cont_compared += len;
    if (rd && first < 0) first = rfirst, fa = ra, fb = rb, first_rank = r, ndiff = rd, n = len;
  }
  if (first >= 0) note_difference(c, first_rank, vp->name, key, first, ndiff, n, fa, fb, 0);
  if (prev_any && !here_any && key[0]) { /* a state the resume dropped */
    int r = 0;
    while (r < ix->world_size && !vr_rank_piece(ix, r, p)) r++;
    note_difference(c, r < ix->world_size ? r : 0, vp->name, key, 0, 0, 0, 0, 0, 1);
  }
  return CLI_OK;
}

int vf_check_continues(vctx *c) {
  const vr_index *ix = &c->rd.ix;
  const long k = ix->start_step;
  if (k == 0)
    return cli_errorf(CMD, "--continues %s: %s is no window (start_step 0): it starts from its own initial values and "
                           "continues nothing", c->cont_path, c->rd.index_path);
  if (vr_reader_open(&c->cont, c->cont_path) != DOPT_OK) return cli_errorf(CMD, "--continues: %s", c->cont.err);
  const vr_index *px = &c->cont.ix;
  if (k <= px->start_step || k > px->steps)
    return cli_errorf(CMD, "--continues %s: it records steps %ld..%ld, and %s starts after step %ld", c->cont.index_path,
                      px->start_step + 1, px->steps, c->rd.index_path, k);
  if (!px->record_params || !px->record_states || k % px->every != 0)
    return cli_errorf(CMD, "--continues %s: the parameters and states after step %ld are not recorded (record.params "
                           "%s, record.states %s, every=%ld)", c->cont.index_path, k, px->record_params ? "true" : "false",
                      px->record_states ? "true" : "false", px->every);
  if (strcmp(px->optimizer, ix->optimizer) != 0 || px->nparams != ix->nparams)
    return cli_errorf(CMD, "--continues %s: optimizer '%s' with %d parameters, %s's is '%s' with %d",
                      c->cont.index_path, px->optimizer[0] ? px->optimizer : "null", px->nparams, c->rd.index_path,
                      ix->optimizer[0] ? ix->optimizer : "null", ix->nparams);
  int64_t maxn = 1;
  for (int p = 0; p < ix->nparams; p++) {
    const vr_param *vp = &ix->params[p];
    const int q = vr_index_find_param(px, vp->name);
    if (q < 0 || px->params[q].ndim != vp->ndim || memcmp(px->params[q].shape, vp->shape, sizeof vp->shape[0] *
                                                          (size_t)vp->ndim) != 0)
      return cli_errorf(CMD, "--continues %s: parameter '%s' is %s", c->cont.index_path, vp->name,
                        q < 0 ? "missing" : "of another shape");
    if (vp->numel > maxn) maxn = vp->numel;
  }
  float *g = malloc((size_t)maxn * sizeof *g);
  unsigned char *mask = malloc((size_t)maxn);
  if (!g || !mask) {
    free(g);
    free(mask);
    return cli_errorf(CMD, "--continues: out of memory (%lld elements)", (long long)maxn);
  }
  int rc = CLI_OK;
  char prefix[VR_MAX_NAME + 64];
  for (int p = 0; p < ix->nparams && rc == CLI_OK; p++) {
    const vr_param *vp = &ix->params[p];
    const int q = vr_index_find_param(px, vp->name);
    char keys[VR_MAX_KEYS + 2][VR_MAX_KEY + 1];
    int nk = 1;
    keys[0][0] = '\0'; /* the parameter */
    snprintf(prefix, sizeof prefix, "state/%ld/%s/", k, vp->name);
    for (int r = 0; r < px->world_size && rc == CLI_OK; r++)
      if (vr_rank_piece(px, r, q)) {
        if (vr_reader_seek(&c->cont, r, k) != DOPT_OK) rc = cli_errorf(CMD, "--continues: %s", c->cont.err);
        else add_keys(c->cont.f[r], prefix, keys, &nk);
      }
    snprintf(prefix, sizeof prefix, "init_state/%s/", vp->name);
    for (int r = 0; r < ix->world_size && rc == CLI_OK; r++)
      if (vr_rank_piece(ix, r, p)) {
        if (vf_file_for_step(c, r, k + 1)) rc = CLI_USAGE;
        else add_keys(c->rd.f[r], prefix, keys, &nk);
      }
    for (int j = 0; j < nk && rc == CLI_OK; j++) rc = check_key(c, p, q, keys[j], g, mask);
  }
  free(g);
  free(mask);
  if (rc == CLI_OK && c->cont_compared == 0)
    return cli_errorf(CMD, "--continues %s: no element of %s's start was recorded by it after step %ld (nothing to "
                           "compare)", c->cont.index_path, c->rd.index_path, k);
  return rc;
}
