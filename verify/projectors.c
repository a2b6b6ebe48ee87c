/* distopt verify, GaLore projectors (verifier.h): each recorded projector checked against ours (sin theta)
 * and adopted (APOLLO's random projections adopted as drawn), and the recorded refreshes against ours. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "galore_proj.h" /* the projector check: dopt_galore_svd */
#include "registry.h"    /* SOAP's basis check: dopt__soap_basis_check */
#include "verifier.h"

/* ---- GaLore projectors: the recorded one checked against ours and adopted --------------------
 *
 * At a refresh the recorded run's projector Q_rec (galore_torch: torch.linalg.svd's top-r singular vectors)
 * and ours Q (LAPACK sgesdd, our sign convention) span the top-r singular subspace of the same fp32
 * gradient G up to rounding. Both SVDs are backward stable: each computed subspace is exact for G + E with
 * ||E||_2 <= p(m,n)·u·sigma_1 (LAPACK's error bounds, p a modest function of the size: we take max(m, n)),
 * and by Wedin's theorem sin theta(computed, exact) <= ||E||_2 / (sigma_r - sigma_{r+1}). So
 *   sin theta(Q_rec, Q) <= 2·max(m, n)·u·sigma_1 / (sigma_r - sigma_{r+1}),   u = 2^-24,
 * the largest principal angle, computed from the residual R = Q_rec - Q (Qᵀ Q_rec) as ||R||_2. Q_rec must be
 * orthonormal within the same p(m,n)·u (a scaled projector spans the subspace but scales the update). A
 * projector beyond the bound is a divergence at that step (tensor P/vf_sin_theta(KEY)); within it, it is
 * adopted, so a stock galore_torch run verifies whatever signs its SVD chose. With no gap (sigma_r =
 * sigma_{r+1}) the subspace is not unique and the bound is infinite: any orthonormal projector passes. */

#define PROJ_P(m, n) ((double)((m) > (n) ? (m) : (n)))
#define PROJ_U 5.9604644775390625e-8 /* 2^-24 */

/* Largest singular value of R [m, r] (ld r, double): power iteration on RᵀR (r x r). */
static double norm2(const double *R, size_t m, size_t r) {
  double *G = calloc(r * r, sizeof *G), *x = malloc(r * sizeof *x), *y = malloc(r * sizeof *y), lam = 0;
  if (!G || !x || !y) {
    free(G), free(x), free(y);
    return INFINITY;
  }
  for (size_t i = 0; i < m; i++)
    for (size_t a = 0; a < r; a++)
      for (size_t b = 0; b < r; b++) G[a * r + b] += R[i * r + a] * R[i * r + b];
  for (size_t a = 0; a < r; a++) x[a] = 1.0 + 0.01 * (double)a;
  for (int it = 0; it < 300; it++) {
    double nn = 0;
    for (size_t a = 0; a < r; a++) {
      y[a] = 0;
      for (size_t b = 0; b < r; b++) y[a] += G[a * r + b] * x[b];
      nn += y[a] * y[a];
    }
    nn = sqrt(nn);
    if (!(nn > 0)) break;
    for (size_t a = 0; a < r; a++) x[a] = y[a] / nn;
    lam = nn;
  }
  free(G), free(x), free(y);
  return sqrt(lam);
}

/* sin of the largest principal angle between span(Q [rows, r], column j at Q[i*ldq + j]) and span(P, same
 * layout, ld r), and the orthonormality defect max|PᵀP - I| of P. `tr`: both are given as [r, rows] rows.
 * The inner products of the fp32 columns are exact sums (products of floats are exact in double; the
 * exact reduction adds them); the residual's norm is an r x r power iteration in double, in a fixed order. */
double vf_sin_theta(const float *Q, size_t ldq, const float *P, size_t rows, size_t r, int tr, double *defect) {
#define QE(i, j) ((double)(tr ? Q[(j) * ldq + (i)] : Q[(i) * ldq + (j)]))
#define PE(i, j) ((double)(tr ? P[(j) * rows + (i)] : P[(i) * r + (j)]))
  double *M = calloc(r * r, sizeof *M), *R = malloc(rows * r * sizeof *R), worst = 0, amax = 0;
  if (!M || !R) {
    free(M), free(R);
    return INFINITY;
  }
  for (size_t i = 0; i < rows; i++)
    for (size_t a = 0; a < r; a++) {
      double q = fabs(QE(i, a)), p = fabs(PE(i, a));
      amax = fmax(amax, fmax(q, p));
    }
  const double scale = dopt_xsum_scale(amax * amax); /* every product is at most amax^2 */
  for (size_t a = 0; a < r; a++)
    for (size_t b = 0; b < r; b++) {
      dopt_xacc qa = {{0}}, pa = {{0}};
      for (size_t i = 0; i < rows; i++) {
        dopt_xacc_add(&qa, scale, QE(i, a) * PE(i, b));
        dopt_xacc_add(&pa, scale, PE(i, a) * PE(i, b));
      }
      double qp = dopt_xacc_value(&qa, scale), pp = dopt_xacc_value(&pa, scale);
      M[a * r + b] = qp;
      double d = fabs(pp - (a == b ? 1.0 : 0.0));
      if (!(d <= worst)) worst = d;
    }
  for (size_t i = 0; i < rows; i++)
    for (size_t b = 0; b < r; b++) {
      double v = PE(i, b);
      for (size_t a = 0; a < r; a++) v -= QE(i, a) * M[a * r + b];
      R[i * r + b] = v;
    }
#undef QE
#undef PE
  double sn = norm2(R, rows, r);
  free(M), free(R);
  *defect = worst;
  return sn;
}

/* ---- counters: the recorded refreshes against ours ---------------------------------------------
 *
 * A recording with projectors holds one at every refresh of the recorded run (proj/STEP/PARAM/...): after each
 * replayed step, each parameter's galore.refreshes count (dopt_optim_counters) must equal the recording's
 * (0 or 1). A statistic events(galore.refreshes) per parameter that ever refreshed on either side: the
 * difference of the counts, bound 0. */

/* The recorded projector `which` ("projector", "projector_left", ...) of parameter p at step t: its elements
 * (*numel) on the first rank holding a piece of p that has it (*owner), or NULL. key[cap]: its tensor name. */
static const void *recorded_projector(vctx *c, int p, long t, const char *which, int *owner, size_t *numel, char *key,
                                      size_t cap) {
  const vr_index *ix = &c->rd.ix;
  snprintf(key, cap, "proj/%ld/%s/%s", t, ix->params[p].name, which);
  for (int rk = 0; rk < ix->world_size; rk++) {
    const void *x = vr_rank_piece(ix, rk, p) ? vr_reader_f32(&c->rd, rk, t, key, numel) : NULL;
    if (x) {
      *owner = rk;
      return x;
    }
  }
  return NULL;
}

/* Whether the recording holds a projector of parameter p at step t (its refresh); *owner: the rank that does. */
static int recorded_refresh(vctx *c, int p, long t, int *owner) {
  char key[VR_MAX_NAME + 128];
  size_t numel;
  return recorded_projector(c, p, t, "projector", owner, &numel, key, sizeof key) ||
         recorded_projector(c, p, t, "projector_left", owner, &numel, key, sizeof key);
}

int vf_check_refreshes(vctx *c, long t) {
  const vr_index *ix = &c->rd.ix;
  for (int p = 0; p < ix->nparams; p++) {
    dopt_counters k = DOPT_COUNTERS_INIT;
    dopt_status s = dopt_optim_counters(c->opt, p, &k);
    if (s != DOPT_OK) return vf_lib_error("the reference's counters", s);
    int owner = -1;
    const int64_t ours = k.last[DOPT_COUNTER_REFRESHES], rec = recorded_refresh(c, p, t, &owner);
    if (ours == 0 && rec == 0 && c->ev_stat[p] < 0) continue; /* no refresh yet on either side */
    if (c->ev_stat[p] < 0) { /* a row of the recording's rank (or the first holding a piece) */
      for (int rk = 0; owner < 0 && rk < ix->world_size; rk++)
        if (vr_rank_piece(ix, rk, p)) owner = rk;
      const int pi = owner >= 0 ? vf_piece_index(c, owner, p) : -1;
      vpiece_keys *pk = pi >= 0 ? &c->rt[owner].keys[pi] : NULL;
      const int si = pk && pk->nkeys < VR_MAX_KEYS ? vf_new_stat(c, owner, &ix->ranks[owner].pieces[pi],
                                                               "events(galore.refreshes)")
                                                    : -1;
      if (si < 0) return cli_errorf(CMD, "parameter '%s': no room for its counters' statistic", ix->params[p].name);
      pk->stat[++pk->nkeys] = si; /* a row of the table, after its piece's states */
      c->ev_stat[p] = si;
    }
    vstat *st = &c->st[c->ev_stat[p]];
    const double d = (double)(ours > rec ? ours - rec : rec - ours);
    if (d > 0 && !st->first_beyond) st->ev_ours = ours, st->ev_rec = rec;
    if (d > st->max_abs) st->max_abs = d;
    vf_record_result(c, c->ev_stat[p], t, d, 0.0);
  }
  return CLI_OK;
}

/* The recorded projector(s) rec[0] (left [m, r]) / rec[1] (right [r, n]) into the hook's outputs: adopted. */
static int adopt_recorded(vctx *c, const void *const rec[2], int64_t m, int64_t n, int64_t r, float *left,
                          float *right) {
  for (int side = 0; side < 2; side++)
    if (rec[side]) memcpy(side ? right : left, rec[side], (size_t)(side ? r * n : m * r) * sizeof(float));
  c->proj_adopted++;
  return 1;
}

/* The projector hook (dopt_projector_fn): the recorded projector of this refresh, checked and adopted. */
int vf_proj_hook(void *user, int param, int64_t step, const float *grad, int64_t m, int64_t n, int64_t r,
                    float *left, float *right) {
  vctx *c = user;
  const vr_index *ix = &c->rd.ix;
  const char *pn = ix->params[param].name;
  const char *keys[2] = {left && right ? "projector_left" : "projector", left && right ? "projector_right" : "projector"};
  const void *rec[2] = {NULL, NULL};
  int owner = -1;
  for (int side = 0; side < 2; side++) {
    if (!(side ? right : left)) continue;
    char key[VR_MAX_NAME + 128];
    size_t numel = 0;
    rec[side] = recorded_projector(c, param, (long)step, keys[side], &owner, &numel, key, sizeof key);
    if (!rec[side]) {
      c->proj_none++;
      return 0; /* not recorded at this step: our own SVD */
    }
    if ((int64_t)numel != (side ? r * n : m * r)) {
      snprintf(c->hook_err, sizeof c->hook_err, "%s: tensor '%s' has %zu elements, expected %lld ([%lld, %lld])",
               c->rd.index_path, key, numel, (long long)(side ? r * n : m * r), (long long)(side ? r : m),
               (long long)(side ? n : r));
      return -1;
    }
  }
  if (strcmp(ix->optimizer, "apollo") == 0) { /* a random projection (upstream's draws): no subspace to check it
                                                * against, adopted as recorded (docs/verify.md) */
    return adopt_recorded(c, rec, m, n, r, left, right);
  }
  const size_t k = (size_t)(r < (m < n ? m : n) ? r + 1 : r); /* sigma_{r+1} too, when there is one */
  float *U = malloc((size_t)m * k * sizeof *U), *S = malloc(k * sizeof *S), *Vt = malloc(k * (size_t)n * sizeof *Vt);
  float *P = malloc((size_t)(m > n ? m : n) * (size_t)r * sizeof *P);
  const dopt_svd_opts so = {DOPT_SVD_EXACT, -1, 0, 0, step - 1};
  unsigned ev = 0;
  if (!U || !S || !Vt || !P || dopt_galore_svd((size_t)m, (size_t)n, k, grad, &so, left != NULL, U, S, Vt, &ev) != DOPT_OK) {
    free(U), free(S), free(Vt), free(P);
    snprintf(c->hook_err, sizeof c->hook_err, "step %lld: parameter '%s': the SVD for the projector check failed",
             (long long)step, pn);
    return -1;
  }
  const double gap = (double)S[r - 1] - (k > (size_t)r ? (double)S[r] : 0.0);
  const double bound = gap > 0 ? 2.0 * PROJ_P(m, n) * PROJ_U * (double)S[0] / gap : INFINITY;
  double worst = 0, defect = 0;
  for (int side = 0; side < 2; side++) {
    if (!rec[side]) continue;
    const size_t rows = (size_t)(side ? n : m);
    memcpy(P, rec[side], rows * (size_t)r * sizeof *P);
    double d = INFINITY, sn = side ? vf_sin_theta(Vt, (size_t)n, P, rows, (size_t)r, 1, &d) : vf_sin_theta(U, k, P, rows, (size_t)r, 0, &d);
    if (!(sn <= worst)) worst = sn;
    if (!(d <= defect)) defect = d;
  }
  free(U), free(S), free(Vt);
  /* its statistic: a row of the owner rank's piece, created at the first refresh */
  if (c->proj_stat[param] < 0) {
    const vr_rank *rk = &ix->ranks[owner];
    int pi = -1;
    for (int i = 0; i < rk->npieces; i++)
      if (rk->pieces[i].param == param) pi = i;
    vpiece_keys *pk = &c->rt[owner].keys[pi];
    char sk[VR_MAX_KEY + 1];
    snprintf(sk, sizeof sk, "sin_theta(%s)", left && right ? "projectors" : "projector");
    int si = pk->nkeys < VR_MAX_KEYS ? vf_new_stat(c, owner, &rk->pieces[pi], sk) : -1;
    if (si < 0) {
      free(P);
      snprintf(c->hook_err, sizeof c->hook_err, "parameter '%s': no room for its projector's statistic", pn);
      return -1;
    }
    pk->stat[++pk->nkeys] = si;
    c->proj_stat[param] = si;
  }
  const double orth_bound = 2.0 * PROJ_P(m, n) * PROJ_U;
  /* an orthonormality defect beyond its bound fails as an infinite angle: the projector would scale the update */
  const double measured = defect <= orth_bound ? worst : INFINITY;
  vstat *s = &c->st[c->proj_stat[param]];
  if (measured > s->max_abs || isnan(measured)) s->max_abs = measured;
  vf_record_result(c, c->proj_stat[param], (long)step, measured, bound);
  if (!(measured <= bound)) {
    free(P);
    return 0; /* named by the verdict; the replay goes on with our own projector */
  }
  free(P);
  return adopt_recorded(c, rec, m, n, r, left, right);
}

/* --reference: REF holds, for the run's parameters (same names, shapes), the reference values at the steps the
 * run records; one rank, whole pieces. */

/* ---- SOAP's bases: the recorded ones checked and adopted -----------------------------------------------------
 *
 * A SOAP run's first basis is its LAPACK's eigendecomposition (its signs, and on a degenerate eigenspace its
 * vectors, are that LAPACK's choice) and every later one a QR refresh of it: a replay with our own first basis
 * follows another, equally valid, trajectory. So, as the golden test does, each recorded basis that changed at
 * step t is checked against ours (dopt__soap_basis_check: orthonormal; the first an eigenbasis of our GG<k> in
 * descending order; a refresh's columns within the QR's derived bound of ours) and adopted. The statistic
 * bases(Q) of a parameter holds the largest check / its bound (1 = at the bound; a different step of change on
 * the two sides: infinite). */

/* The recorded F32 state `key` of parameter p after step t, on the first rank that holds a piece of p. */
static const float *recorded_state(vctx *c, int p, long t, const char *key, size_t *numel) {
  const vr_index *ix = &c->rd.ix;
  char name[VR_MAX_NAME + VR_MAX_KEY + 64];
  if (t == ix->start_step) snprintf(name, sizeof name, "init_state/%s/%s", ix->params[p].name, key);
  else snprintf(name, sizeof name, "state/%ld/%s/%s", t, ix->params[p].name, key);
  for (int rk = 0; rk < ix->world_size; rk++) {
    const void *x = vr_rank_piece(ix, rk, p) ? vr_reader_f32(&c->rd, rk, t == ix->start_step ? t + 1 : t, name, numel) : NULL;
    if (x) return x;
  }
  return NULL;
}

/* parameter p's bases(Q) statistic, made on its first rank's piece at first use; -1 when there is no room */
static int bases_stat(vctx *c, int p) {
  if (c->proj_stat[p] >= 0) return c->proj_stat[p];
  const vr_index *ix = &c->rd.ix;
  for (int rk = 0; rk < ix->world_size; rk++) {
    const int pi = vr_rank_piece(ix, rk, p) ? vf_piece_index(c, rk, p) : -1;
    if (pi < 0) continue;
    vpiece_keys *pk = &c->rt[rk].keys[pi];
    const int si = pk->nkeys < VR_MAX_KEYS ? vf_new_stat(c, rk, &ix->ranks[rk].pieces[pi], "bases(Q)") : -1;
    if (si >= 0) pk->stat[++pk->nkeys] = si;
    return c->proj_stat[p] = si;
  }
  return -1;
}

int vf_adopt_bases(vctx *c, long t) {
  const vr_index *ix = &c->rd.ix;
  if (strcmp(ix->optimizer, "soap") != 0) return CLI_OK;
  if (!c->basis_prev && !(c->basis_prev = calloc((size_t)ix->nparams * DOPT_MAX_STATES, sizeof *c->basis_prev)))
    return cli_errorf(CMD, "out of memory");
  for (int p = 0; p < ix->nparams; p++) {
    int64_t step = 0;
    if (dopt_optim_get_step(c->opt, p, &step) != DOPT_OK) continue;
    for (int s = 0; s < dopt_optim_num_states(c->opt, p) && s < DOPT_MAX_STATES; s++) {
      dopt_state_view v;
      if (dopt_optim_state(c->opt, p, s, &v) != DOPT_OK || v.name[0] != 'Q' || v.ndim != 2) continue;
      const size_t d = (size_t)v.shape[0], bytes = d * d * sizeof(float);
      float **prev = &c->basis_prev[(size_t)p * DOPT_MAX_STATES + (size_t)s];
      size_t numel = 0;
      if (!*prev && t - 1 == ix->start_step && ix->start_step > 0) {
        const float *init = recorded_state(c, p, t - 1, v.name, &numel); /* a window's start: its recorded basis */
        if (init && numel == d * d && (*prev = malloc(bytes))) memcpy(*prev, init, bytes);
      }
      const float *rec = recorded_state(c, p, t, v.name, &numel);
      if (!rec)
        return cli_errorf(CMD, "%s: soap: step %ld has no recorded '%s' of '%s': verify adopts SOAP's bases where "
                               "they change, so it needs the states of every step (distopt.record every=1)",
                          c->rd.index_path, t, v.name, ix->params[p].name);
      if (numel != d * d)
        return cli_errorf(CMD, "%s: soap: the recorded '%s' of '%s' at step %ld has %zu elements, expected %zu",
                          c->rd.index_path, v.name, ix->params[p].name, t, numel, d * d);
      const int theirs = !*prev || memcmp(*prev, rec, bytes) != 0;
      const int ours = !*prev || memcmp(*prev, v.data, bytes) != 0;
      const int si = theirs || ours ? bases_stat(c, p) : -1;
      if (theirs != ours) {
        if (si >= 0) vf_record_result(c, si, t, INFINITY, 1.0);
      } else if (theirs) {
        const float *A = NULL; /* Q<k> is GG<k>'s */
        for (int s2 = 0; s2 < dopt_optim_num_states(c->opt, p); s2++) {
          dopt_state_view g;
          if (dopt_optim_state(c->opt, p, s2, &g) == DOPT_OK && g.name[0] == 'G' && strcmp(g.name + 2, v.name + 1) == 0)
            A = g.data;
        }
        char why[256];
        double w = 0;
        const int bad = !A || dopt__soap_basis_check(d, A, step == 1 ? NULL : *prev, rec, v.data, &w, why, sizeof why);
        if (si >= 0) {
          if (w > c->st[si].max_abs) c->st[si].max_abs = w;
          vf_record_result(c, si, t, bad ? INFINITY : w, 1.0);
        }
        if (!bad) memcpy(v.data, rec, bytes), c->bases_adopted++;
      }
      if (!*prev && !(*prev = malloc(bytes))) return cli_errorf(CMD, "out of memory");
      memcpy(*prev, rec, bytes);
    }
  }
  return CLI_OK;
}
