/* Accounting of simulated operations: per-communicator counters, the
 * operation log, nccl-tests bandwidth factors and the alpha-beta projection
 * onto a target cluster. */
#include "sim_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Message size as nccl-tests reports it. */
static uint64_t op_bytes(const sim_sig *s, int n) {
  uint64_t b = (uint64_t)s->count * dopt_dtype_size((dopt_dtype)s->dtype);
  switch (s->kind) {
  case DOPT_SIM_KIND_REDUCE_SCATTER:
  case DOPT_SIM_KIND_ALL_GATHER:
  case DOPT_SIM_KIND_ALL_TO_ALL:
    return b * (uint64_t)n;
  case DOPT_SIM_KIND_BARRIER:
  case DOPT_SIM_KIND_SPLIT:
    return 0;
  default:
    return b;
  }
}

void dopt__sim_account(sim_group *g, const sim_sig *s, int rank) {
  uint64_t bytes = op_bytes(s, g->n);
  g->stats.ops[s->kind]++;
  g->stats.bytes[s->kind] += bytes;
  if (s->kind == DOPT_SIM_KIND_RECV || s->kind == DOPT_SIM_KIND_SPLIT)
    return;
  dopt_sim_world *w = g->w;
  if (w->nlog == w->caplog) {
    size_t cap = w->caplog ? 2 * w->caplog : 64;
    sim_logent *p = realloc(w->log, cap * sizeof *p);
    if (p == NULL) {
      w->log_truncated = 1;
      return;
    }
    w->log = p;
    w->caplog = cap;
  }
  sim_logent *e = &w->log[w->nlog++];
  memset(e, 0, sizeof *e);
  e->rec.kind = s->kind;
  e->rec.bytes = bytes;
  e->rec.nranks = g->n;
  e->rec.comm_id = g->id;
  snprintf(e->rec.label, sizeof e->rec.label, "%s", g->label);
  e->g = g;
  e->src_wrank = s->kind == DOPT_SIM_KIND_SEND ? g->wranks[rank] : -1;
  e->dst_wrank = s->kind == DOPT_SIM_KIND_SEND ? g->wranks[s->root] : -1;
}

/* Queries lock the world mutex of a const world: the lock is not part of the
 * observable state. */
static pthread_mutex_t *world_mu(const dopt_sim_world *w) { return (pthread_mutex_t *)&w->mu; }

dopt_status dopt_sim_comm_stats(const dopt_sim_comm *c, dopt_sim_stats *out) {
  DOPT_CHECK_ARG(c != NULL && out != NULL, "sim_comm_stats: comm=%p out=%p must not be NULL",
                 (const void *)c, (void *)out);
  DOPT_CHECK_ARG(out->struct_size == sizeof *out,
                 "sim_comm_stats: out->struct_size=%u (want %zu; use DOPT_SIM_STATS_INIT)",
                 out->struct_size, sizeof *out);
  pthread_mutex_lock(world_mu(c->g->w));
  *out = c->g->stats;
  pthread_mutex_unlock(world_mu(c->g->w));
  return DOPT_OK;
}

double dopt_sim_busbw_factor(dopt_sim_kind kind, int nranks) {
  if (nranks < 1)
    return 0.0;
  double n = (double)nranks;
  switch (kind) {
  case DOPT_SIM_KIND_ALL_REDUCE:
    return 2.0 * (n - 1.0) / n;
  case DOPT_SIM_KIND_REDUCE_SCATTER:
  case DOPT_SIM_KIND_ALL_GATHER:
  case DOPT_SIM_KIND_ALL_TO_ALL:
    return (n - 1.0) / n;
  case DOPT_SIM_KIND_BROADCAST:
  case DOPT_SIM_KIND_REDUCE:
  case DOPT_SIM_KIND_SEND:
  case DOPT_SIM_KIND_RECV:
  case DOPT_SIM_KIND_ALL_TO_ALLV:
    return 1.0;
  default:
    return 0.0;
  }
}

dopt_status dopt_sim_bandwidth(dopt_sim_kind kind, int nranks, uint64_t bytes, double seconds,
                               double *algbw, double *busbw) {
  DOPT_CHECK_ARG(algbw != NULL && busbw != NULL, "sim_bandwidth: algbw and busbw must not be NULL");
  DOPT_CHECK_ARG(seconds > 0.0, "sim_bandwidth: seconds=%g must be > 0", seconds);
  DOPT_CHECK_ARG(nranks >= 1, "sim_bandwidth: nranks=%d must be >= 1", nranks);
  *algbw = (double)bytes / seconds;
  *busbw = *algbw * dopt_sim_busbw_factor(kind, nranks);
  return DOPT_OK;
}

size_t dopt_sim_world_record_count(const dopt_sim_world *w) {
  if (w == NULL)
    return 0;
  pthread_mutex_lock(world_mu(w));
  size_t n = w->nlog;
  pthread_mutex_unlock(world_mu(w));
  return n;
}

dopt_status dopt_sim_world_record(const dopt_sim_world *w, size_t i, dopt_sim_record *out) {
  DOPT_CHECK_ARG(w != NULL && out != NULL, "sim_world_record: w and out must not be NULL");
  pthread_mutex_lock(world_mu(w));
  size_t n = w->nlog;
  if (i < n)
    *out = w->log[i].rec;
  pthread_mutex_unlock(world_mu(w));
  DOPT_CHECK_ARG(i < n, "sim_world_record: i=%zu out of range [0,%zu)", i, n);
  return DOPT_OK;
}

double dopt_sim_cost(dopt_sim_kind kind, int nranks, uint64_t bytes, const dopt_sim_link *link) {
  if (link == NULL || link->bandwidth_Bps <= 0.0)
    return 0.0;
  double a = link->latency_s, t = (double)bytes / link->bandwidth_Bps, n = (double)nranks;
  if (kind == DOPT_SIM_KIND_SEND)
    return a + t;
  if (nranks <= 1)
    return 0.0;
  switch (kind) {
  case DOPT_SIM_KIND_ALL_REDUCE:
    return 2.0 * (n - 1.0) * a + 2.0 * (n - 1.0) / n * t;
  case DOPT_SIM_KIND_REDUCE_SCATTER:
  case DOPT_SIM_KIND_ALL_GATHER:
  case DOPT_SIM_KIND_ALL_TO_ALL:
    return (n - 1.0) * a + (n - 1.0) / n * t;
  case DOPT_SIM_KIND_BROADCAST:
  case DOPT_SIM_KIND_REDUCE:
  case DOPT_SIM_KIND_ALL_TO_ALLV: /* the busiest sender's bytes, one peer after another */
    return (n - 1.0) * a + t;
  case DOPT_SIM_KIND_BARRIER:
    return 2.0 * (n - 1.0) * a;
  default:
    return 0.0;
  }
}

static int group_has(const sim_group *g, int wrank) {
  for (int i = 0; i < g->n; i++)
    if (g->wranks[i] == wrank)
      return 1;
  return 0;
}

static const dopt_sim_link *link_for(const dopt_sim_cluster *cl, const char *label) {
  for (size_t i = 0; i < cl->nlinks; i++)
    if (cl->links[i].label != NULL && strcmp(cl->links[i].label, label) == 0)
      return &cl->links[i];
  return &cl->fallback;
}

dopt_status dopt_sim_project(const dopt_sim_world *w, int rank, const dopt_sim_cluster *cl,
                             dopt_sim_projection *out) {
  DOPT_CHECK_ARG(w != NULL && cl != NULL && out != NULL,
                 "sim_project: w, cluster and out must not be NULL");
  DOPT_CHECK_ARG(cl->struct_size == sizeof *cl,
                 "sim_project: cluster->struct_size=%u (want %zu; use DOPT_SIM_CLUSTER_INIT)",
                 cl->struct_size, sizeof *cl);
  DOPT_CHECK_ARG(out->struct_size == sizeof *out,
                 "sim_project: out->struct_size=%u (want %zu; use DOPT_SIM_PROJECTION_INIT)",
                 out->struct_size, sizeof *out);
  DOPT_CHECK_ARG(rank >= 0 && rank < w->n, "sim_project: rank=%d out of range [0,%d)", rank, w->n);
  DOPT_CHECK_ARG(cl->nlinks == 0 || cl->links != NULL, "sim_project: links=NULL with nlinks=%zu",
                 cl->nlinks);
  for (size_t i = 0; i < cl->nlinks; i++)
    DOPT_CHECK_ARG(cl->links[i].bandwidth_Bps > 0.0 && cl->links[i].latency_s >= 0.0 &&
                       cl->links[i].group_size >= 0,
                   "sim_project: links[%zu] bandwidth_Bps=%g latency_s=%g group_size=%d invalid", i,
                   cl->links[i].bandwidth_Bps, cl->links[i].latency_s, cl->links[i].group_size);
  DOPT_CHECK_ARG(cl->fallback.bandwidth_Bps > 0.0 && cl->fallback.latency_s >= 0.0,
                 "sim_project: fallback bandwidth_Bps=%g latency_s=%g invalid",
                 cl->fallback.bandwidth_Bps, cl->fallback.latency_s);
  dopt_sim_projection p = DOPT_SIM_PROJECTION_INIT;
  pthread_mutex_lock(world_mu(w));
  for (size_t i = 0; i < w->nlog; i++) {
    const sim_logent *e = &w->log[i];
    int mine = e->rec.kind == DOPT_SIM_KIND_SEND
                   ? (e->src_wrank == rank || e->dst_wrank == rank)
                   : group_has(e->g, rank);
    if (!mine)
      continue;
    const dopt_sim_link *l = link_for(cl, e->rec.label);
    int n = l->group_size > 0 ? l->group_size : e->rec.nranks;
    double t = dopt_sim_cost(e->rec.kind, n, e->rec.bytes, l);
    p.seconds[e->rec.kind] += t;
    p.ops[e->rec.kind]++;
    p.total_s += t;
  }
  int truncated = w->log_truncated;
  pthread_mutex_unlock(world_mu(w));
  if (truncated)
    return dopt__fail(DOPT_ERR_NO_MEMORY, "sim_project: the operation log is incomplete (out of memory while recording)");
  *out = p;
  return DOPT_OK;
}
