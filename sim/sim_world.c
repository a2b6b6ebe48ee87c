/* The simulator's worlds and communicators: creating and destroying a world
 * and its groups (the fault plan resolved at creation), the launcher that
 * runs one thread per rank and poisons the world when one fails, and the
 * communicator queries, timeout, abort and destroy. The rendezvous protocol,
 * the split, the collectives and the groups they make are sim/sim.c's; this
 * file calls into them through dopt__sim_group_new_locked (the world's group)
 * and dopt__sim_poison_locked (sim_internal.h), and nothing there calls here. */
#include "sim_internal.h"

#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- world and communicators ------------------------------------------------------ */

/* splitmix64: resolves the ANY fields of the fault plan from the seed. */
static uint64_t splitmix64(uint64_t *s) {
  uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

static dopt_status resolve_faults(dopt_sim_world *w, const dopt_sim_config *cfg) {
  if (cfg->nfaults == 0)
    return DOPT_OK;
  DOPT_CHECK_ARG(cfg->faults != NULL, "sim_world_create: faults=NULL with nfaults=%zu", cfg->nfaults);
  w->faults = calloc(cfg->nfaults, sizeof *w->faults);
  if (w->faults == NULL)
    return dopt__fail(DOPT_ERR_NO_MEMORY, "sim_world_create: nfaults=%zu", cfg->nfaults);
  w->nfaults = cfg->nfaults;
  uint64_t state = cfg->seed;
  for (size_t i = 0; i < cfg->nfaults; i++) {
    dopt_sim_fault f = cfg->faults[i];
    DOPT_CHECK_ARG(f.kind > DOPT_SIM_FAULT_NONE && f.kind <= DOPT_SIM_FAULT_BACKEND,
                   "sim_world_create: faults[%zu].kind=%d is not a fault kind", i, (int)f.kind);
    if (f.rank == DOPT_SIM_FAULT_ANY_RANK)
      f.rank = (int)(splitmix64(&state) % (uint64_t)cfg->nranks);
    DOPT_CHECK_ARG(f.rank >= 0 && f.rank < cfg->nranks,
                   "sim_world_create: faults[%zu].rank=%d out of range [0,%d)", i, f.rank, cfg->nranks);
    if (f.bit == DOPT_SIM_FAULT_ANY_BIT)
      f.bit = (uint32_t)(splitmix64(&state) % 64u);
    w->faults[i] = f;
  }
  return DOPT_OK;
}

dopt_status dopt_sim_world_create(const dopt_sim_config *cfg, dopt_sim_world **out) {
  DOPT_CHECK_ARG(out != NULL, "sim_world_create: out=NULL");
  *out = NULL;
  DOPT_CHECK_ARG(cfg != NULL, "sim_world_create: cfg=NULL");
  /* the sizes before memops and before copy_exchanges were appended are accepted too (their defaults) */
  DOPT_CHECK_ARG((cfg->struct_size == sizeof *cfg || cfg->struct_size == offsetof(dopt_sim_config, memops) ||
                  cfg->struct_size == offsetof(dopt_sim_config, copy_exchanges)) &&
                     cfg->version == DOPT_SIM_CONFIG_VERSION,
                 "sim_world_create: cfg struct_size=%u version=%u (want %zu, %u; use DOPT_SIM_CONFIG_INIT)",
                 cfg->struct_size, cfg->version, sizeof *cfg, DOPT_SIM_CONFIG_VERSION);
  DOPT_CHECK_ARG(cfg->nranks >= 1 && cfg->nranks <= 4096,
                 "sim_world_create: nranks=%d must be in [1, 4096]", cfg->nranks);
  DOPT_CHECK_ARG(cfg->timeout_ms >= 1, "sim_world_create: timeout_ms=%u must be >= 1",
                 cfg->timeout_ms);
  DOPT_CHECK_ARG(cfg->mode == DOPT_SIM_ORDER_RANK || cfg->mode == DOPT_SIM_ORDER_RING,
                 "sim_world_create: mode=%d is not a dopt_sim_mode", (int)cfg->mode);
  dopt_sim_world *w = calloc(1, sizeof *w);
  if (w == NULL)
    return dopt__fail(DOPT_ERR_NO_MEMORY, "sim_world_create: nranks=%d", cfg->nranks);
  w->n = cfg->nranks;
  w->mode = cfg->mode;
  w->timeout_ms = cfg->timeout_ms;
  w->mem = cfg->struct_size > offsetof(dopt_sim_config, memops) ? cfg->memops : NULL;
  const int copying = cfg->struct_size == sizeof *cfg && cfg->copy_exchanges != 0;
  w->views_ok = !copying && w->mem == NULL && cfg->nfaults == 0;
  if (pthread_mutex_init(&w->mu, NULL) != 0) {
    free(w);
    return dopt__fail(DOPT_ERR_BACKEND, "sim_world_create: pthread_mutex_init failed");
  }
  dopt_status s = resolve_faults(w, cfg);
  if (s != DOPT_OK) {
    dopt_sim_world_destroy(w);
    return s;
  }
  w->ranks = calloc((size_t)w->n, sizeof *w->ranks);
  sim_group *g = w->ranks ? dopt__sim_group_new_locked(w, w->n, "world") : NULL;
  if (g == NULL) {
    dopt_sim_world_destroy(w);
    return dopt__fail(DOPT_ERR_NO_MEMORY, "sim_world_create: nranks=%d", cfg->nranks);
  }
  for (int r = 0; r < w->n; r++) {
    g->wranks[r] = r;
    g->handles[r].wrank = r;
    g->handles[r].timeout_ms = w->timeout_ms;
  }
  *out = w;
  return DOPT_OK;
}

void dopt_sim_world_destroy(dopt_sim_world *w) {
  if (w == NULL)
    return;
  for (sim_group *g = w->groups; g != NULL;) {
    sim_group *next = g->next;
    dopt__sim_group_free(g);
    g = next;
  }
  pthread_mutex_destroy(&w->mu);
  free(w->faults);
  free(w->ranks);
  free(w->log);
  free(w);
}

int dopt_sim_world_size(const dopt_sim_world *w) { return w != NULL ? w->n : 0; }

dopt_status dopt_sim_world_comm(dopt_sim_world *w, int rank, dopt_sim_comm **out) {
  DOPT_CHECK_ARG(w != NULL && out != NULL, "sim_world_comm: w=%p out=%p must not be NULL",
                 (void *)w, (void *)out);
  DOPT_CHECK_ARG(rank >= 0 && rank < w->n, "sim_world_comm: rank=%d out of range [0,%d)", rank,
                 w->n);
  *out = &w->groups->handles[rank];
  return DOPT_OK;
}

dopt_status dopt_sim_world_fault(const dopt_sim_world *w, size_t i, dopt_sim_fault *out) {
  DOPT_CHECK_ARG(w != NULL && out != NULL, "sim_world_fault: w and out must not be NULL");
  DOPT_CHECK_ARG(i < w->nfaults, "sim_world_fault: i=%zu out of range [0,%zu)", i, w->nfaults);
  *out = w->faults[i];
  return DOPT_OK;
}

const char *dopt_sim_world_rank_error(const dopt_sim_world *w, int rank) {
  if (w == NULL || rank < 0 || rank >= w->n)
    return "";
  return w->ranks[rank].err;
}

/* ---- launcher -------------------------------------------------------------------- */

typedef struct sim_thread_arg {
  dopt_sim_world *w;
  dopt_sim_rank_fn fn;
  void *user;
  int rank;
  dopt_status status;
} sim_thread_arg;

static void *rank_main(void *p) {
  sim_thread_arg *a = p;
  dopt_sim_world *w = a->w;
  dopt_clear_error();
  a->status = a->fn(&w->groups->handles[a->rank], a->rank, a->user);
  sim_rank *me = &w->ranks[a->rank];
  if (a->status != DOPT_OK) {
    snprintf(me->err, sizeof me->err, "%s", dopt_last_error());
    pthread_mutex_lock(&w->mu);
    dopt__sim_poison_locked(w, "world rank %d returned %s: %s", a->rank, dopt_status_name(a->status), me->err);
    pthread_mutex_unlock(&w->mu);
  } else {
    me->err[0] = '\0';
  }
  return NULL;
}

dopt_status dopt_sim_launch(dopt_sim_world *w, dopt_sim_rank_fn fn, void *user,
                            dopt_status *rank_status) {
  DOPT_CHECK_ARG(w != NULL && fn != NULL && rank_status != NULL,
                 "sim_launch: w=%p fn=%s rank_status=%p must not be NULL", (void *)w,
                 fn ? "set" : "NULL", (void *)rank_status);
  pthread_mutex_lock(&w->mu);
  int busy = w->launched;
  w->launched = 1;
  pthread_mutex_unlock(&w->mu);
  if (busy)
    return dopt__fail(DOPT_ERR_STATE, "sim_launch: the world is already running");
  sim_thread_arg *args = calloc((size_t)w->n, sizeof *args);
  pthread_t *th = calloc((size_t)w->n, sizeof *th);
  dopt_status s = DOPT_OK;
  int started = 0;
  if (args == NULL || th == NULL) {
    s = dopt__fail(DOPT_ERR_NO_MEMORY, "sim_launch: nranks=%d", w->n);
  } else {
    for (; started < w->n; started++) {
      args[started] = (sim_thread_arg){w, fn, user, started, DOPT_OK};
      if (pthread_create(&th[started], NULL, rank_main, &args[started]) != 0) {
        pthread_mutex_lock(&w->mu);
        dopt__sim_poison_locked(w, "sim_launch: could not start the thread of rank %d", started);
        pthread_mutex_unlock(&w->mu);
        s = dopt__fail(DOPT_ERR_BACKEND, "sim_launch: pthread_create failed for rank %d", started);
        break;
      }
    }
  }
  for (int r = 0; r < started; r++)
    pthread_join(th[r], NULL);
  for (int r = 0; r < w->n; r++)
    rank_status[r] = r < started ? args[r].status : DOPT_ERR_ABORTED;
  /* the root cause: the lowest rank that failed on its own, not one aborted because a peer failed */
  int first = -1;
  for (int r = 0; r < w->n && first < 0; r++)
    if (rank_status[r] != DOPT_OK && rank_status[r] != DOPT_ERR_ABORTED) first = r;
  for (int r = 0; r < w->n && first < 0; r++)
    if (rank_status[r] != DOPT_OK) first = r;
  if (s == DOPT_OK && first >= 0)
    s = dopt__fail(rank_status[first], "sim_launch: rank %d: %s", first, w->ranks[first].err);
  free(args);
  free(th);
  pthread_mutex_lock(&w->mu);
  w->launched = 0;
  pthread_mutex_unlock(&w->mu);
  return s;
}

/* ---- communicator queries and management ----------------------------------------- */

#define SIM_CHECK_COMM(c, fn) DOPT_CHECK_ARG((c) != NULL, "%s: comm=NULL", fn)

dopt_status dopt_sim_comm_rank(const dopt_sim_comm *c, int *rank) {
  SIM_CHECK_COMM(c, "sim_comm_rank");
  DOPT_CHECK_ARG(rank != NULL, "sim_comm_rank: rank=NULL");
  *rank = c->rank;
  return DOPT_OK;
}

dopt_status dopt_sim_comm_size(const dopt_sim_comm *c, int *size) {
  SIM_CHECK_COMM(c, "sim_comm_size");
  DOPT_CHECK_ARG(size != NULL, "sim_comm_size: size=NULL");
  *size = c->g->n;
  return DOPT_OK;
}

dopt_status dopt_sim_comm_world_rank(const dopt_sim_comm *c, int *world_rank) {
  SIM_CHECK_COMM(c, "sim_comm_world_rank");
  DOPT_CHECK_ARG(world_rank != NULL, "sim_comm_world_rank: world_rank=NULL");
  *world_rank = c->wrank;
  return DOPT_OK;
}

const char *dopt_sim_comm_label(const dopt_sim_comm *c) { return c != NULL ? c->g->label : ""; }

dopt_status dopt_sim_comm_set_timeout(dopt_sim_comm *c, uint32_t timeout_ms) {
  SIM_CHECK_COMM(c, "sim_comm_set_timeout");
  DOPT_CHECK_ARG(timeout_ms >= 1, "sim_comm_set_timeout: timeout_ms=%u must be >= 1", timeout_ms);
  c->timeout_ms = timeout_ms;
  return DOPT_OK;
}

dopt_status dopt_sim_comm_shard(const dopt_sim_comm *c, size_t total_count, size_t *per_rank) {
  SIM_CHECK_COMM(c, "sim_comm_shard");
  DOPT_CHECK_ARG(per_rank != NULL, "sim_comm_shard: per_rank_count=NULL");
  if (total_count % (size_t)c->g->n != 0)
    return dopt__fail(DOPT_ERR_NOT_DIVISIBLE,
                      "sim_comm_shard: total_count=%zu is not divisible by the size %d of comm '%s'",
                      total_count, c->g->n, c->g->label);
  *per_rank = total_count / (size_t)c->g->n;
  return DOPT_OK;
}

dopt_status dopt_sim_comm_abort(dopt_sim_comm *c) {
  SIM_CHECK_COMM(c, "sim_comm_abort");
  pthread_mutex_lock(&c->g->w->mu);
  dopt__sim_poison_locked(c->g->w, "rank %d aborted comm '%s'", c->rank, c->g->label);
  pthread_mutex_unlock(&c->g->w->mu);
  return DOPT_OK;
}

dopt_status dopt_sim_comm_destroy(dopt_sim_comm *c) {
  SIM_CHECK_COMM(c, "sim_comm_destroy");
  DOPT_CHECK_ARG(!c->destroyed, "sim_comm_destroy: comm '%s' rank %d already destroyed",
                 c->g->label, c->rank);
  c->destroyed = 1;
  return DOPT_OK;
}
