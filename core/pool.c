/* Fork-join pool (core/pool.h). One generation per dopt__pool_run: the
 * caller publishes the tasks, wakes the workers, and every thread (the caller
 * too) takes task indices from one atomic counter until none are left; the
 * caller then waits until every worker has left the generation. */
#define _GNU_SOURCE /* sched_getaffinity, CPU_COUNT */
#include "pool.h"

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <unistd.h>

struct dopt_pool {
  int nthreads;
  pthread_t *workers; /* [nthreads - 1] */
  pthread_mutex_t mu;
  pthread_cond_t wake, done;
  unsigned long gen; /* generation counter (under mu) */
  int busy;          /* workers still inside the current generation (under mu) */
  int quit;
  /* the current generation's work */
  void (*task)(void *ctx, size_t i);
  void *ctx;
  size_t n;
  atomic_size_t next;
};

static void drain(dopt_pool *p) {
  for (;;) {
    size_t i = atomic_fetch_add_explicit(&p->next, 1, memory_order_relaxed);
    if (i >= p->n) return;
    p->task(p->ctx, i);
  }
}

static void *worker(void *arg) {
  dopt_pool *p = arg;
  unsigned long seen = 0;
  pthread_mutex_lock(&p->mu);
  for (;;) {
    while (!p->quit && p->gen == seen) pthread_cond_wait(&p->wake, &p->mu);
    if (p->quit) break;
    seen = p->gen;
    pthread_mutex_unlock(&p->mu);
    drain(p);
    pthread_mutex_lock(&p->mu);
    if (--p->busy == 0) pthread_cond_signal(&p->done);
  }
  pthread_mutex_unlock(&p->mu);
  return NULL;
}

dopt_status dopt__pool_create(int nthreads, dopt_pool **out) {
  *out = NULL;
  if (nthreads < 1 || nthreads > DOPT_MAX_THREADS)
    return dopt__fail(DOPT_ERR_INVALID_ARG, "threads=%d: must be in 1..%d", nthreads, DOPT_MAX_THREADS);
  dopt_pool *p = calloc(1, sizeof *p);
  if (!p) return dopt__fail(DOPT_ERR_NO_MEMORY, "thread pool of %d threads", nthreads);
  p->nthreads = 1;
  if (nthreads > 1 && !(p->workers = calloc((size_t)nthreads - 1, sizeof *p->workers))) {
    free(p);
    return dopt__fail(DOPT_ERR_NO_MEMORY, "thread pool of %d threads", nthreads);
  }
  pthread_mutex_init(&p->mu, NULL);
  pthread_cond_init(&p->wake, NULL);
  pthread_cond_init(&p->done, NULL);
  for (int t = 0; t < nthreads - 1; t++) {
    int e = pthread_create(&p->workers[t], NULL, worker, p);
    if (e) {
      dopt__pool_destroy(p);
      return dopt__fail(DOPT_ERR_NO_MEMORY, "thread pool: starting thread %d of %d failed (error %d)", t + 2,
                        nthreads, e);
    }
    p->nthreads++;
  }
  *out = p;
  return DOPT_OK;
}

void dopt__pool_destroy(dopt_pool *p) {
  if (!p) return;
  pthread_mutex_lock(&p->mu);
  p->quit = 1;
  pthread_cond_broadcast(&p->wake);
  pthread_mutex_unlock(&p->mu);
  for (int t = 0; t < p->nthreads - 1; t++) pthread_join(p->workers[t], NULL);
  pthread_cond_destroy(&p->done);
  pthread_cond_destroy(&p->wake);
  pthread_mutex_destroy(&p->mu);
  free(p->workers);
  free(p);
}

int dopt__pool_threads(const dopt_pool *p) { return p ? p->nthreads : 1; }

void dopt__pool_run(dopt_pool *p, size_t n, void (*task)(void *ctx, size_t i), void *ctx) {
  if (!p || p->nthreads == 1 || n <= 1) {
    for (size_t i = 0; i < n; i++) task(ctx, i);
    return;
  }
  pthread_mutex_lock(&p->mu);
  p->task = task;
  p->ctx = ctx;
  p->n = n;
  atomic_store_explicit(&p->next, 0, memory_order_relaxed);
  p->busy = p->nthreads - 1;
  p->gen++;
  pthread_cond_broadcast(&p->wake);
  pthread_mutex_unlock(&p->mu);
  drain(p);
  pthread_mutex_lock(&p->mu);
  while (p->busy > 0) pthread_cond_wait(&p->done, &p->mu);
  pthread_mutex_unlock(&p->mu);
}

dopt_status dopt__default_threads(int *out) {
  const char *env = getenv("DOPT_NUM_THREADS");
  if (env && *env) {
    char *end;
    errno = 0;
    long v = strtol(env, &end, 10);
    if (errno || *end || end == env || v < 1 || v > DOPT_MAX_THREADS)
      return dopt__fail(DOPT_ERR_INVALID_ARG, "DOPT_NUM_THREADS='%.64s': must be an integer in 1..%d", env,
                        DOPT_MAX_THREADS);
    *out = (int)v;
    return DOPT_OK;
  }
  cpu_set_t set;
  int n = 0;
  if (sched_getaffinity(0, sizeof set, &set) == 0) n = CPU_COUNT(&set);
  if (n < 1) {
    long c = sysconf(_SC_NPROCESSORS_ONLN);
    n = c > 0 ? (int)c : 1;
  }
  *out = n > DOPT_MAX_THREADS ? DOPT_MAX_THREADS : n;
  return DOPT_OK;
}
