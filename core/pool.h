/* A fork-join thread pool for the reference step (core/optim_step.c): the caller
 * and nthreads-1 workers run the tasks 0..n-1 of one dopt__pool_run call, each
 * task exactly once, in any order on any thread. Results must not depend on
 * which thread runs which task: the reference splits a parameter into pieces
 * whose statistics are reduced exactly (docs/threads.md). */
#ifndef DISTOPT_POOL_H
#define DISTOPT_POOL_H

#include <stddef.h>

#include "internal.h"

#define DOPT_MAX_THREADS 256

typedef struct dopt_pool dopt_pool;

/* nthreads in 1..DOPT_MAX_THREADS, the caller included (1: no worker). */
dopt_status dopt__pool_create(int nthreads, dopt_pool **out);
void dopt__pool_destroy(dopt_pool *p);
int dopt__pool_threads(const dopt_pool *p);

/* Runs task(ctx, i) for every i in [0, n) and returns when all are done. The
 * tasks report their own outcome (this call cannot fail). */
void dopt__pool_run(dopt_pool *p, size_t n, void (*task)(void *ctx, size_t i), void *ctx);

/* The default thread count: DOPT_NUM_THREADS when set (an integer in
 * 1..DOPT_MAX_THREADS, else DOPT_ERR_INVALID_ARG naming the variable and its
 * value), otherwise the cores this process may run on. */
dopt_status dopt__default_threads(int *out);

#endif
