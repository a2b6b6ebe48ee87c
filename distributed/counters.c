/* What each rank's steps did (dopt_counters), and their check against the
 * reference's counts of the same step (docs/api.md "Counters"). */
#include <stdlib.h>
#include <string.h>

#include "dist_internal.h"

/* Whether this rank holds a piece of p that it steps, and whether that piece is its first copy: a
 * TP-replicated tensor's piece repeats on every tp rank, a piecewise one at ZeRO 0 on every rank of its dp group; owner
 * units are held once. */
static void holding(const dopt_dist_optim *d, const dist_param *p, int *held, int *primary) {
  if (p->owned) {
    *held = *primary = p->u1 > p->u0;
    return;
  }
  *held = p->pc.len > 0;
  *primary = *held && (p->role != DOPT_TP_REPLICATED || d->tp.rank == 0) && (d->zero >= 1 || dd_dpg(d, p)->rank == 0);
}

dopt_status dopt_dist_counters(const dopt_dist_optim *d, int i, dopt_counters *out) {
  DOPT_TRY(dd_check_param(d, i, "dopt_dist_counters"));
  int held, primary;
  holding(d, &d->p[i], &held, &primary);
  return dopt__counters_fill(out, d->p[i].cnt_last, d->p[i].cnt_total, held, primary);
}

/* The counts since the previous check, per parameter and counter: [np · DOPT_NCOUNTERS], row-major.
 * Compared: EACH counters on every rank that holds a piece, SUM counters as their total over the primary
 * pieces. The first difference is the lowest (parameter, counter), then the lowest rank; one broadcast of the
 * reference's counts, one SUM and one MIN over the world, and one more MAX only when something differs. */
dopt_status dopt_dist_check_counters(dopt_dist_optim *d, const int64_t *ref, dopt_counter_diff *out) {
  DOPT_CHECK_ARG(d != NULL && out != NULL, "dopt_dist_check_counters: NULL argument");
  const int wr = (int)dd_world_rank(d), NC = DOPT_NCOUNTERS;
  DOPT_CHECK_ARG(ref != NULL || wr != 0, "dopt_dist_check_counters: ref=NULL on world rank 0");
  *out = (dopt_counter_diff){-1, -1, -1, 0, 0};
  const size_t n = (size_t)d->np * (size_t)NC;
  int64_t *all = malloc(3 * (n ? n : 1) * sizeof *all), *mine = all + n, *sum = mine + n;
  void *buf = NULL;
  if (!all) return dopt__fail(DOPT_ERR_NO_MEMORY, "dopt_dist_check_counters: %d parameters", d->np);
  /* the reference's counts, from world rank 0 */
  dopt_status s = DEV(d)->alloc(DCTX(d), (n ? n : 1) * sizeof *all, &buf);
  if (s == DOPT_OK && wr == 0) s = DEV(d)->upload(DCTX(d), buf, ref, n * sizeof *all);
  if (s == DOPT_OK && n) s = dd_from_world0(d, buf, n, DOPT_I64);
  if (s == DOPT_OK) s = DEV(d)->download(DCTX(d), all, buf, n * sizeof *all);
  if (buf) DEV(d)->free(DCTX(d), buf);
  /* this rank's counts since the last check; the primaries' SUM counters */
  int64_t key = INT64_MAX; /* (parameter · NC + counter) << 24 | world rank (0xffffff: the total) */
  for (int i = 0; s == DOPT_OK && i < d->np; i++) {
    dist_param *p = &d->p[i];
    int held, primary;
    holding(d, p, &held, &primary);
    for (int c = 0; c < NC; c++) {
      const size_t at = (size_t)i * (size_t)NC + (size_t)c;
      mine[at] = p->cnt_total[c] - p->cnt_seen[c];
      p->cnt_seen[c] = p->cnt_total[c];
      const int each = dopt_counter_scope(c) == DOPT_COUNT_EACH;
      sum[at] = !each && primary ? mine[at] : 0;
      const int64_t k = ((int64_t)at << 24) | (int64_t)wr;
      if (each && held && mine[at] != all[at] && k < key) key = k;
    }
  }
  if (s == DOPT_OK && n) s = dd_world_reduce(d, sum, n, DOPT_SUM);
  for (size_t at = 0; s == DOPT_OK && at < n; at++)
    if (dopt_counter_scope((int)(at % (size_t)NC)) == DOPT_COUNT_SUM && sum[at] != all[at]) {
      const int64_t k = ((int64_t)at << 24) | 0xffffff;
      if (k < key) key = k;
      break;
    }
  if (s == DOPT_OK) s = dd_world_reduce(d, &key, 1, DOPT_MIN);
  if (s == DOPT_OK && key != INT64_MAX) {
    const size_t at = (size_t)(key >> 24);
    const int r = (int)(key & 0xffffff);
    out->param = (int)(at / (size_t)NC), out->counter = (int)(at % (size_t)NC);
    out->reference = all[at];
    if (r == 0xffffff) {
      out->rank = -1, out->distributed = sum[at];
    } else { /* the named rank's count reaches every rank */
      int64_t v = r == wr ? mine[at] : INT64_MIN;
      s = dd_world_reduce(d, &v, 1, DOPT_MAX);
      out->rank = r, out->distributed = v;
    }
  }
  free(all);
  return s;
}
