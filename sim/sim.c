/* The collective simulator's call protocol: rendezvous, validation,
 * timeouts, fault injection, the split and the collectives' data phases
 * (worlds, communicators and the launcher: sim/sim_world.c).
 *
 * Protocol of a collective on a communicator of n ranks (one world mutex):
 *  1. arrival barrier: each rank deposits its signature and buffer pointers;
 *     the last to arrive validates all deposits (argument errors, signature
 *     mismatch) and accounts the operation, then wakes the others. A failed
 *     validation makes every rank return the same error.
 *  2. data phase, outside the lock: each rank reads the deposited buffers and
 *     writes only its own output (or its own slice of the root's), combining
 *     contributions in a fixed order (dopt__sim_reduce).
 *  3. final barrier: no rank returns (and may reuse its buffers) before every
 *     rank has finished reading them.
 * Every wait is a pthread_cond_timedwait on CLOCK_MONOTONIC with the call's
 * deadline; a timeout, abort or failing rank "poisons" the world and wakes all.
 */
#include "sim_internal.h"

#include <errno.h>
#include <stddef.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- small helpers ------------------------------------------------------------- */

static const char *const kind_names[DOPT_SIM_KIND_COUNT] = {
    "all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce",
    "all_to_all", "send",           "recv",       "barrier",   "split", "all_to_allv"};

const char *dopt_sim_kind_name(dopt_sim_kind kind) {
  return (unsigned)kind < DOPT_SIM_KIND_COUNT ? kind_names[kind] : "unknown";
}

/* Element size of a dtype the collectives support; 0 for the others. */
static size_t sim_dtype_size(dopt_dtype dt) {
  return dt == DOPT_F16 || dt == DOPT_I8 ? 0 : dopt_dtype_size(dt);
}

const char *dopt_sim_op_name(dopt_redop op) {
  static const char *const names[DOPT_REDOP_COUNT_] = {"sum", "prod", "max", "min", "avg"};
  return (unsigned)op < DOPT_REDOP_COUNT_ ? names[op] : "op?";
}

static void sig_format(const sim_sig *s, char *buf, size_t len) {
  const char *k = dopt_sim_kind_name(s->kind);
  const char *dt = dopt_dtype_name((dopt_dtype)s->dtype);
  const char *op = dopt_sim_op_name((dopt_redop)s->op);
  switch (s->kind) {
  case DOPT_SIM_KIND_ALL_REDUCE:
  case DOPT_SIM_KIND_REDUCE_SCATTER:
    snprintf(buf, len, "%s(count=%zu,%s,%s)", k, s->count, dt, op);
    break;
  case DOPT_SIM_KIND_REDUCE:
    snprintf(buf, len, "%s(count=%zu,%s,%s,root=%d)", k, s->count, dt, op, s->root);
    break;
  case DOPT_SIM_KIND_BROADCAST:
    snprintf(buf, len, "%s(count=%zu,%s,root=%d)", k, s->count, dt, s->root);
    break;
  case DOPT_SIM_KIND_SEND:
  case DOPT_SIM_KIND_RECV:
    snprintf(buf, len, "%s(count=%zu,%s,peer=%d)", k, s->count, dt, s->root);
    break;
  case DOPT_SIM_KIND_BARRIER:
    snprintf(buf, len, "%s()", k);
    break;
  case DOPT_SIM_KIND_SPLIT:
    snprintf(buf, len, "%s(label=%s)", k, s->label);
    break;
  case DOPT_SIM_KIND_ALL_TO_ALLV:
    snprintf(buf, len, "%s(%s,%s)", k, s->view ? "by reference" : "copied", dt);
    break;
  case DOPT_SIM_KIND_ALL_GATHER:
    snprintf(buf, len, "%s(count=%zu,%s%s)", k, s->count, dt, s->view ? ",by reference" : "");
    break;
  default:
    snprintf(buf, len, "%s(count=%zu,%s)", k, s->count, dt);
    break;
  }
}

static int sig_equal(const sim_sig *a, const sim_sig *b) {
  return a->kind == b->kind && a->count == b->count && a->dtype == b->dtype && a->op == b->op &&
         a->root == b->root && a->view == b->view && strcmp(a->label, b->label) == 0;
}

static int ranges_overlap(const void *a, size_t alen, const void *b, size_t blen) {
  if (alen == 0 || blen == 0)
    return 0;
  uintptr_t x = (uintptr_t)a, y = (uintptr_t)b;
  return x < y + blen && y < x + alen;
}

static void arg_fail(sim_arrival *a, dopt_status s, const char *fmt, ...) DOPT_PRINTF(3, 4);
static void arg_fail(sim_arrival *a, dopt_status s, const char *fmt, ...) {
  if (a->status != DOPT_OK)
    return; /* keep the first */
  a->status = s;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(a->msg, sizeof a->msg, fmt, ap);
  va_end(ap);
}

static struct timespec deadline_after(uint32_t ms) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  t.tv_sec += (time_t)(ms / 1000u);
  t.tv_nsec += (long)(ms % 1000u) * 1000000L;
  if (t.tv_nsec >= 1000000000L) {
    t.tv_sec += 1;
    t.tv_nsec -= 1000000000L;
  }
  return t;
}

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static void sleep_ms(uint32_t ms) {
  struct timespec t = {(time_t)(ms / 1000u), (long)(ms % 1000u) * 1000000L};
  while (nanosleep(&t, &t) != 0 && errno == EINTR) {
  }
}

/* ---- poisoning -------------------------------------------------------------------- */

void dopt__sim_poison_locked(dopt_sim_world *w, const char *fmt, ...) {
  if (w->poisoned)
    return; /* the first cause is kept */
  w->poisoned = 1;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(w->poison_msg, sizeof w->poison_msg, fmt, ap);
  va_end(ap);
  for (sim_group *g = w->groups; g != NULL; g = g->next)
    pthread_cond_broadcast(&g->cond);
}

/* The error every rank gets once the world is poisoned (lock held). */
static dopt_status aborted_locked(const dopt_sim_comm *c) {
  return dopt__fail(DOPT_ERR_ABORTED, "comm '%s' rank %d: world aborted: %s", c->g->label, c->rank,
                    c->g->w->poison_msg);
}

/* ---- calls: entry, faults, waits ---------------------------------------------- */

typedef struct sim_call {
  dopt_sim_comm *c;
  sim_group *g;
  dopt_sim_world *w;
  dopt_sim_kind kind;
  struct timespec deadline;
  uint64_t op_index;
  double t0;
  const dopt_sim_fault *flip; /* pending BITFLIP fault */
} sim_call;

/* Common entry: handle checks, operation counter, fault plan, deadline. */
static dopt_status call_begin(sim_call *k, dopt_sim_comm *c, dopt_sim_kind kind) {
  if (c == NULL)
    return dopt__fail(DOPT_ERR_INVALID_ARG, "%s: comm=NULL", dopt_sim_kind_name(kind));
  if (c->destroyed)
    return dopt__fail(DOPT_ERR_STATE, "%s: comm '%s' rank %d was destroyed",
                      dopt_sim_kind_name(kind), c->g->label, c->rank);
  memset(k, 0, sizeof *k);
  k->c = c;
  k->g = c->g;
  k->w = c->g->w;
  k->kind = kind;
  k->t0 = now_s();
  sim_rank *me = &k->w->ranks[c->wrank];
  if (me->stopped)
    return dopt__fail(DOPT_ERR_ABORTED, "%s: world rank %d was stopped by fault injection",
                      dopt_sim_kind_name(kind), c->wrank);
  k->op_index = me->ops++;
  for (size_t i = 0; i < k->w->nfaults; i++) {
    const dopt_sim_fault *f = &k->w->faults[i];
    if (f->rank != c->wrank || f->op_index != k->op_index)
      continue;
    switch (f->kind) {
    case DOPT_SIM_FAULT_STOP:
      me->stopped = 1;
      return dopt__fail(DOPT_ERR_ABORTED, "%s: fault injection: world rank %d stopped at op %llu",
                        dopt_sim_kind_name(kind), c->wrank, (unsigned long long)k->op_index);
    case DOPT_SIM_FAULT_BACKEND:
      pthread_mutex_lock(&k->w->mu);
      dopt__sim_poison_locked(k->w, "fault injection: backend error on world rank %d at op %llu (%s)",
                    c->wrank, (unsigned long long)k->op_index, dopt_sim_kind_name(kind));
      pthread_mutex_unlock(&k->w->mu);
      return dopt__fail(DOPT_ERR_BACKEND, "%s: fault injection: backend error on world rank %d at op %llu",
                        dopt_sim_kind_name(kind), c->wrank, (unsigned long long)k->op_index);
    case DOPT_SIM_FAULT_DELAY:
      sleep_ms(f->delay_ms);
      break;
    case DOPT_SIM_FAULT_BITFLIP:
      k->flip = f;
      break;
    default:
      break;
    }
  }
  k->deadline = deadline_after(c->timeout_ms);
  return DOPT_OK;
}

/* The calling rank gave up waiting: poison the world, report TIMEOUT (lock held). */
static dopt_status timeout_locked(sim_call *k, const char *what) {
  dopt__sim_poison_locked(k->w, "world rank %d timed out after %u ms in %s on comm '%s' (%s)", k->c->wrank,
                k->c->timeout_ms, dopt_sim_kind_name(k->kind), k->g->label, what);
  return dopt__fail(DOPT_ERR_TIMEOUT, "%s: comm '%s' rank %d timed out after %u ms (%s)",
                    dopt_sim_kind_name(k->kind), k->g->label, k->c->rank, k->c->timeout_ms, what);
}

/* Waits on the group's condition until the barrier generation moves past
 * `seen`, the world is poisoned or the deadline passes (lock held). */
static dopt_status wait_gen_locked(sim_call *k, uint64_t seen) {
  while (k->g->bar_gen == seen) {
    if (k->w->poisoned)
      return aborted_locked(k->c);
    int rc = pthread_cond_timedwait(&k->g->cond, &k->w->mu, &k->deadline);
    if (rc == ETIMEDOUT && k->g->bar_gen == seen && !k->w->poisoned)
      return timeout_locked(k, "waiting for the other ranks");
  }
  return DOPT_OK;
}

typedef void (*on_last_fn)(sim_group *g);

/* Generation barrier over the group; the last arriver runs on_last first
 * (lock held). */
static dopt_status barrier_locked(sim_call *k, on_last_fn on_last) {
  sim_group *g = k->g;
  if (k->w->poisoned)
    return aborted_locked(k->c);
  uint64_t gen = g->bar_gen;
  if (++g->bar_count == g->n) {
    if (on_last != NULL)
      on_last(g);
    g->bar_count = 0;
    g->bar_gen++;
    pthread_cond_broadcast(&g->cond);
    return DOPT_OK;
  }
  return wait_gen_locked(k, gen);
}

static dopt_status barrier(sim_call *k) {
  pthread_mutex_lock(&k->w->mu);
  dopt_status s = barrier_locked(k, NULL);
  pthread_mutex_unlock(&k->w->mu);
  return s;
}

/* ---- validation (last arriver, lock held) -------------------------------------- */

/* Split: builds the new groups from the deposited colors and keys. */
static void split_locked(sim_group *g) {
  int n = g->n;
  int *members = malloc((size_t)n * sizeof *members);
  char *done = calloc((size_t)n, 1);
  if (members == NULL || done == NULL) {
    g->op_err = DOPT_ERR_NO_MEMORY;
    snprintf(g->op_msg, sizeof g->op_msg, "split on comm '%s': out of memory", g->label);
    free(members);
    free(done);
    return;
  }
  for (int i = 0; i < n; i++)
    g->arr[i].result = NULL;
  for (int i = 0; i < n; i++) {
    if (done[i] || g->arr[i].color == DOPT_SIM_SPLIT_NOCOLOR)
      continue;
    int m = 0;
    for (int j = i; j < n; j++) {
      if (done[j] || g->arr[j].color != g->arr[i].color)
        continue;
      done[j] = 1;
      int p = m++; /* insertion by (key, parent rank); j increases */
      while (p > 0 && g->arr[members[p - 1]].key > g->arr[j].key) {
        members[p] = members[p - 1];
        p--;
      }
      members[p] = j;
    }
    sim_group *ng = dopt__sim_group_new_locked(g->w, m, g->arr[i].sig.label);
    if (ng == NULL) {
      g->op_err = DOPT_ERR_NO_MEMORY;
      snprintf(g->op_msg, sizeof g->op_msg, "split on comm '%s': out of memory", g->label);
      break;
    }
    for (int r = 0; r < m; r++) {
      const dopt_sim_comm *parent = &g->handles[members[r]];
      ng->wranks[r] = parent->wrank;
      ng->handles[r].wrank = parent->wrank;
      ng->handles[r].timeout_ms = parent->timeout_ms;
      g->arr[members[r]].result = &ng->handles[r];
    }
  }
  free(members);
  free(done);
}

static void validate_locked(sim_group *g) {
  g->op_err = DOPT_OK;
  g->op_msg[0] = '\0';
  uint64_t seq = g->op_seq++;
  for (int j = 0; j < g->n; j++) {
    if (g->arr[j].status != DOPT_OK) {
      g->op_err = g->arr[j].status;
      snprintf(g->op_msg, sizeof g->op_msg, "comm '%s' op %llu: rank %d: %s", g->label,
               (unsigned long long)seq, j, g->arr[j].msg);
      return;
    }
  }
  for (int j = 1; j < g->n; j++) {
    if (!sig_equal(&g->arr[0].sig, &g->arr[j].sig)) {
      char a[96], b[96];
      sig_format(&g->arr[0].sig, a, sizeof a);
      sig_format(&g->arr[j].sig, b, sizeof b);
      g->op_err = DOPT_ERR_MISMATCH;
      snprintf(g->op_msg, sizeof g->op_msg, "comm '%s' op %llu: rank 0 %s vs rank %d %s", g->label,
               (unsigned long long)seq, a, j, b);
      return;
    }
  }
  sim_sig acc = g->arr[0].sig;
  if (acc.kind == DOPT_SIM_KIND_ALL_GATHER) /* by reference in nb gathers: every rank the same nb and counts */
    for (int j = 1; j < g->n; j++) {
      const sim_arrival *x = &g->arr[0], *y = &g->arr[j];
      int same = (x->sends != NULL) == (y->sends != NULL) && (!x->sends || x->nb == y->nb);
      for (int b = 0; same && x->sends && b < x->nb; b++) same = x->scounts[b] == y->scounts[b];
      if (!same) {
        g->op_err = DOPT_ERR_MISMATCH;
        snprintf(g->op_msg, sizeof g->op_msg, "comm '%s' op %llu: all_gather by reference: rank 0 gathers %d tensors, "
                 "rank %d %d, or their counts differ", g->label, (unsigned long long)seq, x->sends ? x->nb : 1, j,
                 y->sends ? y->nb : 1);
        return;
      }
    }
  if (acc.kind == DOPT_SIM_KIND_ALL_TO_ALLV) { /* every pair agrees; accounted: the busiest sender's elements */
    size_t most = 0;
    const int nb = g->arr[0].nb; /* the same on every rank (in the signature) */
    for (int i = 0; i < g->n; i++) {
      size_t off = 0;
      for (int b = 0; b < nb; b++)
        for (int j = 0; j < g->n; j++) {
          const size_t at = (size_t)b * (size_t)g->n, sent = g->arr[i].scounts[at + (size_t)j],
                       expected = g->arr[j].rcounts[at + (size_t)i];
          if (sent != expected) {
            g->op_err = DOPT_ERR_MISMATCH;
            snprintf(g->op_msg, sizeof g->op_msg,
                     "comm '%s' op %llu: all_to_allv: rank %d sends %zu elements to rank %d, which expects %zu%s",
                     g->label, (unsigned long long)seq, i, sent, j, expected, nb > 1 ? " (in one of its exchanges)" : "");
            return;
          }
          off += j != i ? sent : 0;
        }
      most = off > most ? off : most;
    }
    acc.count = most;
  }
  dopt__sim_account(g, &acc, -1);
  if (g->arr[0].sig.kind == DOPT_SIM_KIND_SPLIT)
    split_locked(g);
}

/* Deposits this rank's arrival and waits for the verdict. */
/* Last arriver of a data collective: validation, then every rank enters the data phase. */
static void arrive_last_locked(sim_group *g) {
  validate_locked(g);
  g->in_data = g->op_err == DOPT_OK ? g->n : 0;
}

static dopt_status arrive(sim_call *k, const sim_arrival *a) {
  pthread_mutex_lock(&k->w->mu);
  k->g->arr[k->c->rank] = *a;
  dopt_status s = barrier_locked(k, arrive_last_locked);
  if (s == DOPT_OK && k->g->op_err != DOPT_OK)
    s = dopt__fail(k->g->op_err, "%s", k->g->op_msg);
  pthread_mutex_unlock(&k->w->mu);
  return s;
}

/* Successful end of a call: bit-flip fault on the received data, timing. */
static dopt_status call_end(sim_call *k, void *recv, size_t count, dopt_dtype dt) {
  if (k->flip != NULL && recv != NULL)
    dopt__sim_flip_bit(k->w->mem, recv, count, dt, k->flip->elem, k->flip->bit);
  if (k->c->rank == 0 && k->kind != DOPT_SIM_KIND_SPLIT) {
    double dt_s = now_s() - k->t0;
    pthread_mutex_lock(&k->w->mu);
    k->g->stats.seconds[k->kind] += dt_s;
    pthread_mutex_unlock(&k->w->mu);
  }
  return DOPT_OK;
}

/* ---- argument checks (local; reported through the arrival) ------------------- */

static void check_common(sim_arrival *a, const dopt_sim_comm *c, int scale_by_n, int reduces) {
  const sim_sig *s = &a->sig;
  const char *k = dopt_sim_kind_name(s->kind);
  size_t esz = sim_dtype_size((dopt_dtype)s->dtype);
  if (esz == 0) {
    arg_fail(a, (unsigned)s->dtype < DOPT_DTYPE_COUNT_ ? DOPT_ERR_UNSUPPORTED : DOPT_ERR_INVALID_ARG,
             "%s: dtype=%d (%s) is not supported by collectives", k, s->dtype, dopt_dtype_name((dopt_dtype)s->dtype));
    return;
  }
  if (reduces && (unsigned)s->op >= DOPT_REDOP_COUNT_)
    arg_fail(a, DOPT_ERR_INVALID_ARG, "%s: op=%d is not a dopt_redop", k, s->op);
  size_t n = scale_by_n ? (size_t)c->g->n : 1u;
  if (s->count > SIZE_MAX / esz / n)
    arg_fail(a, DOPT_ERR_INVALID_ARG, "%s: count=%zu times %zu ranks overflows size_t", k, s->count,
             n);
}

static void check_root(sim_arrival *a, const dopt_sim_comm *c) {
  if (a->sig.root < 0 || a->sig.root >= c->g->n)
    arg_fail(a, DOPT_ERR_INVALID_ARG, "%s: root=%d out of range [0,%d)",
             dopt_sim_kind_name(a->sig.kind), a->sig.root, c->g->n);
}

static void check_ptr(sim_arrival *a, const void *p, const char *name) {
  if (p == NULL && a->sig.count != 0)
    arg_fail(a, DOPT_ERR_INVALID_ARG, "%s: %s=NULL with count=%zu", dopt_sim_kind_name(a->sig.kind),
             name, a->sig.count);
}

/* send/recv ranges [send, +sbytes) and [recv, +rbytes) may only overlap in
 * the allowed in-place form send == inplace_send (0: never allowed). */
static void check_overlap(sim_arrival *a, size_t sbytes, size_t rbytes, uintptr_t inplace_send) {
  if (!ranges_overlap(a->send, sbytes, a->recv, rbytes))
    return;
  if (inplace_send != 0 && (uintptr_t)a->send == inplace_send)
    return;
  arg_fail(a, DOPT_ERR_OVERLAP,
           "%s: send=%p (%zu bytes) and recv=%p (%zu bytes) overlap and are not in place",
           dopt_sim_kind_name(a->sig.kind), a->send, sbytes, (void *)a->recv, rbytes);
}

static sim_arrival arrival_init(dopt_sim_kind kind, const void *send, void *recv, size_t count,
                                dopt_dtype dt, int op, int root) {
  sim_arrival a;
  memset(&a, 0, sizeof a);
  a.sig.kind = kind;
  a.sig.count = count;
  a.sig.dtype = (int)dt;
  a.sig.op = op;
  a.sig.root = root;
  a.send = send;
  a.recv = recv;
  return a;
}

/* ---- split (a collective: the protocol above) ----------------------------------------- */

dopt_status dopt_sim_comm_split_labeled(dopt_sim_comm *comm, int color, int key, const char *label,
                                        dopt_sim_comm **newcomm) {
  sim_call k;
  DOPT_CHECK_ARG(newcomm != NULL, "split: newcomm=NULL");
  *newcomm = NULL;
  DOPT_TRY(call_begin(&k, comm, DOPT_SIM_KIND_SPLIT));
  sim_arrival a = arrival_init(DOPT_SIM_KIND_SPLIT, NULL, NULL, 0, DOPT_U8, -1, -1);
  a.color = color;
  a.key = key;
  if (label == NULL || label[0] == '\0' || strlen(label) >= DOPT_SIM_LABEL_MAX)
    arg_fail(&a, DOPT_ERR_INVALID_ARG, "split: label='%s' must have 1 to %d characters",
             label ? label : "(null)", DOPT_SIM_LABEL_MAX - 1);
  else
    snprintf(a.sig.label, sizeof a.sig.label, "%s", label);
  if (color < 0 && color != DOPT_SIM_SPLIT_NOCOLOR)
    arg_fail(&a, DOPT_ERR_INVALID_ARG, "split: color=%d must be >= 0 or DOPT_SIM_SPLIT_NOCOLOR",
             color);
  DOPT_TRY(arrive(&k, &a));
  /* our slot's result is only rewritten by a later split, which needs us */
  pthread_mutex_lock(&k.w->mu);
  *newcomm = k.g->arr[comm->rank].result;
  pthread_mutex_unlock(&k.w->mu);
  return call_end(&k, NULL, 0, DOPT_U8);
}

dopt_status dopt_sim_comm_split(dopt_sim_comm *comm, int color, int key, dopt_sim_comm **newcomm) {
  return dopt_sim_comm_split_labeled(comm, color, key, "split", newcomm);
}

/* ---- collectives ---------------------------------------------------------------- */

/* First element of slice i when count elements are cut into n balanced slices. */
static size_t slice_lo(size_t count, int n, int i) {
  size_t base = count / (size_t)n, rem = count % (size_t)n;
  return (size_t)i * base + ((size_t)i < rem ? (size_t)i : rem);
}

/* Reduction order start for the slice owned by `owner` (ring mode: owner+1). */
static int order_start(const sim_call *k, int owner) {
  return k->w->mode == DOPT_SIM_ORDER_RING ? (owner + 1) % k->g->n : 0;
}

static const void *const *deposited_sends(sim_call *k) {
  for (int j = 0; j < k->g->n; j++)
    k->c->srcs[j] = k->g->arr[j].send;
  return k->c->srcs;
}

/* Leaves the data phase. On an abort (a barrier of the phase returned early
 * because the world was poisoned), peers may still be reading this rank's
 * send buffer or writing its receive buffer (a reduce into the root):
 * wait until every rank has left the phase, so the caller may free them.
 * No rank blocks inside the phase once the world is poisoned. */
static dopt_status leave_data(sim_call *k, dopt_status s) {
  if (s == DOPT_OK) return s; /* the phase's final barrier completed: every rank has left it (data_done) */
  pthread_mutex_lock(&k->w->mu);
  sim_group *g = k->g;
  /* only the last rank out wakes, and only when an aborted rank waits: a wake per leaving rank would
   * wake every rank already waiting in the group's next collective, n times per collective */
  if (--g->in_data == 0 && g->data_waiters > 0) pthread_cond_broadcast(&g->cond);
  g->data_waiters++;
  while (g->in_data > 0) pthread_cond_wait(&g->cond, &k->w->mu);
  g->data_waiters--;
  pthread_mutex_unlock(&k->w->mu);
  return s;
}

static dopt_status run_data(sim_call *k, const sim_arrival *a);

/* Last arriver of a data phase's final barrier: every rank is done with the others' buffers. */
static void data_done_locked(sim_group *g) { g->in_data = 0; }

/* Runs arrival, the kind's data phase and the final barrier. */
static dopt_status run_collective(sim_call *k, const sim_arrival *a) {
  DOPT_TRY(arrive(k, a));
  dopt_status s = run_data(k, a);
  return leave_data(k, s);
}

/* The data phase of a collective, every rank of the group inside it. */
static dopt_status run_data(sim_call *k, const sim_arrival *a) {
  sim_group *g = k->g;
  const sim_arrival *arr = g->arr; /* stable until the final barrier */
  int n = g->n, i = k->c->rank;
  dopt_dtype dt = (dopt_dtype)a->sig.dtype;
  dopt_redop op = (dopt_redop)a->sig.op;
  size_t cnt = a->sig.count, esz = sim_dtype_size(dt), blk = cnt * esz;
  char *recv = a->recv;
  switch (a->sig.kind) {
  case DOPT_SIM_KIND_ALL_REDUCE: {
    /* reduce own slice from every send buffer, then gather the others' slices */
    size_t lo = slice_lo(cnt, n, i), hi = slice_lo(cnt, n, i + 1);
    dopt__sim_reduce(k->w->mem, dt, op, recv + lo * esz, deposited_sends(k), n, order_start(k, i), lo, hi - lo);
    DOPT_TRY(barrier(k));
    for (int j = 0; j < n; j++) {
      size_t jlo = slice_lo(cnt, n, j), jhi = slice_lo(cnt, n, j + 1);
      if (j != i)
        dopt__sim_copy(k->w->mem, recv + jlo * esz, (const char *)arr[j].recv + jlo * esz, (jhi - jlo) * esz);
    }
    break;
  }
  case DOPT_SIM_KIND_REDUCE_SCATTER:
    dopt__sim_reduce(k->w->mem, dt, op, recv, deposited_sends(k), n, order_start(k, i), (size_t)i * cnt, cnt);
    break;
  case DOPT_SIM_KIND_ALL_GATHER:
    if (a->views && a->sends) { /* nb gathers by reference: where rank j's elements of gather b are */
      for (int b = 0; b < a->nb; b++)
        for (int j = 0; j < n; j++)
          a->views[(size_t)b * (size_t)n + (size_t)j] = a->scounts[b] ? arr[j].sends[b] : NULL;
      break;
    }
    if (a->views) { /* by reference: where rank j's elements are */
      for (int j = 0; j < n; j++) a->views[j] = cnt ? arr[j].send : NULL;
      break;
    }
    for (int j = 0; j < n; j++)
      dopt__sim_copy(k->w->mem, recv + (size_t)j * blk, arr[j].send, blk);
    break;
  case DOPT_SIM_KIND_BROADCAST:
    dopt__sim_copy(k->w->mem, recv, arr[a->sig.root].send, blk);
    break;
  case DOPT_SIM_KIND_REDUCE: {
    /* every rank reduces its slice straight into the root's buffer */
    int root = a->sig.root;
    size_t lo = slice_lo(cnt, n, i), hi = slice_lo(cnt, n, i + 1);
    int start = k->w->mode == DOPT_SIM_ORDER_RING ? (root + 1) % n : 0;
    dopt__sim_reduce(k->w->mem, dt, op, (char *)arr[root].recv + lo * esz, deposited_sends(k), n, start, lo,
                     hi - lo);
    recv = i == root ? recv : NULL;
    break;
  }
  case DOPT_SIM_KIND_ALL_TO_ALL:
    for (int j = 0; j < n; j++)
      dopt__sim_copy(k->w->mem, recv + (size_t)j * blk, (const char *)arr[j].send + (size_t)i * blk, blk);
    break;
  case DOPT_SIM_KIND_ALL_TO_ALLV: /* from rank j's send at its sdispls[i] into this rank's recv at rdispls[j] */
    cnt = 0;
    if (a->views) { /* by reference: where rank j's elements for this rank are (exchange b: in its send b) */
      for (int b = 0; b < a->nb; b++)
        for (int j = 0; j < n; j++) {
          const size_t at = (size_t)b * (size_t)n;
          const char *base = arr[j].sends ? (const char *)arr[j].sends[b] : (const char *)arr[j].send;
          a->views[at + (size_t)j] = a->rcounts[at + (size_t)j] ? base + arr[j].sdispls[at + (size_t)i] * esz : NULL;
        }
      break;
    }
    for (int j = 0; j < n; j++) {
      size_t c = a->rcounts[j];
      if (c)
        dopt__sim_copy(k->w->mem, recv + a->rdispls[j] * esz,
                       (const char *)arr[j].send + arr[j].sdispls[i] * esz, c * esz);
      size_t end = a->rdispls[j] + c;
      cnt = c && end > cnt ? end : cnt; /* the received extent, for a bit-flip fault */
    }
    break;
  default:
    break;
  }
  pthread_mutex_lock(&k->w->mu);
  dopt_status fin = barrier_locked(k, data_done_locked);
  pthread_mutex_unlock(&k->w->mu);
  DOPT_TRY(fin);
  size_t rcount = a->sig.kind == DOPT_SIM_KIND_ALL_GATHER || a->sig.kind == DOPT_SIM_KIND_ALL_TO_ALL
                      ? cnt * (size_t)n
                      : cnt;
  return call_end(k, recv, rcount, dt);
}

/* Entry of every data collective: local argument checks (delivered to all
 * ranks through the rendezvous), then the collective itself. */
static dopt_status collective(dopt_sim_comm *comm, dopt_sim_kind kind, const void *send, void *recv,
                              size_t count, dopt_dtype dt, int op, int root) {
  sim_call k;
  DOPT_TRY(call_begin(&k, comm, kind));
  size_t n = (size_t)comm->g->n, r = (size_t)comm->rank;
  int rooted = kind == DOPT_SIM_KIND_BROADCAST || kind == DOPT_SIM_KIND_REDUCE;
  int uses_send = kind != DOPT_SIM_KIND_BROADCAST || root == comm->rank; /* bcast: root only */
  int uses_recv = kind != DOPT_SIM_KIND_REDUCE || root == comm->rank;    /* reduce: root only */
  int reduces = kind == DOPT_SIM_KIND_ALL_REDUCE || kind == DOPT_SIM_KIND_REDUCE_SCATTER ||
                kind == DOPT_SIM_KIND_REDUCE;
  int scaled = kind == DOPT_SIM_KIND_REDUCE_SCATTER || kind == DOPT_SIM_KIND_ALL_GATHER ||
               kind == DOPT_SIM_KIND_ALL_TO_ALL;
  sim_arrival a = arrival_init(kind, uses_send ? send : NULL, uses_recv ? recv : NULL, count, dt,
                               reduces ? op : -1, rooted ? root : -1);
  check_common(&a, comm, scaled, reduces);
  if (rooted)
    check_root(&a, comm);
  if (uses_send)
    check_ptr(&a, send, "send");
  if (uses_recv)
    check_ptr(&a, recv, "recv");
  if (a.status == DOPT_OK && uses_send && uses_recv) {
    size_t b = count * dopt_dtype_size(dt);
    switch (kind) {
    case DOPT_SIM_KIND_REDUCE_SCATTER: /* in place: recv == send + rank*count */
      check_overlap(&a, b * n, b, (uintptr_t)recv - (uintptr_t)(r * b));
      break;
    case DOPT_SIM_KIND_ALL_GATHER: /* in place: send == recv + rank*count */
      check_overlap(&a, b, b * n, (uintptr_t)recv + (uintptr_t)(r * b));
      break;
    case DOPT_SIM_KIND_ALL_TO_ALL: /* never in place, one buffer as both not even when empty */
      if (send == recv)
        arg_fail(&a, DOPT_ERR_OVERLAP, "all_to_all: rank %d passes send=recv=%p: overlap and are not in place "
                 "(never allowed, even empty)", comm->rank, send);
      check_overlap(&a, b * n, b * n, 0);
      break;
    default: /* in place: send == recv */
      check_overlap(&a, b, b, (uintptr_t)recv);
      break;
    }
  }
  return run_collective(&k, &a);
}

dopt_status dopt_sim_all_reduce(const void *send, void *recv, size_t count, dopt_dtype dt,
                                dopt_redop op, dopt_sim_comm *comm) {
  return collective(comm, DOPT_SIM_KIND_ALL_REDUCE, send, recv, count, dt, (int)op, -1);
}

dopt_status dopt_sim_reduce_scatter(const void *send, void *recv, size_t recvcount,
                                    dopt_dtype dt, dopt_redop op, dopt_sim_comm *comm) {
  return collective(comm, DOPT_SIM_KIND_REDUCE_SCATTER, send, recv, recvcount, dt, (int)op, -1);
}

dopt_status dopt_sim_all_gather(const void *send, void *recv, size_t sendcount, dopt_dtype dt,
                                dopt_sim_comm *comm) {
  return collective(comm, DOPT_SIM_KIND_ALL_GATHER, send, recv, sendcount, dt, -1, -1);
}

/* The checks every collective by reference makes: a world whose ranks may read each other's buffers, and views. */
static void check_by_ref(sim_arrival *a, const dopt_sim_comm *c, const void **views) {
  const char *k = dopt_sim_kind_name(a->sig.kind);
  if (!c->g->w->views_ok)
    arg_fail(a, DOPT_ERR_UNSUPPORTED, "%s by reference: not in a world with a fault plan, memops or copy_exchanges", k);
  if (!views) arg_fail(a, DOPT_ERR_INVALID_ARG, "%s by reference: views=NULL", k);
}

dopt_status dopt_sim_all_gather_view(const void *send, const void **views, size_t sendcount, dopt_dtype dt,
                                     dopt_sim_comm *comm) {
  sim_call k;
  DOPT_TRY(call_begin(&k, comm, DOPT_SIM_KIND_ALL_GATHER));
  sim_arrival a = arrival_init(DOPT_SIM_KIND_ALL_GATHER, send, NULL, sendcount, dt, -1, -1);
  a.sig.view = 1;
  a.views = views;
  check_common(&a, comm, 1, 0);
  check_by_ref(&a, comm, views);
  check_ptr(&a, send, "send");
  return run_collective(&k, &a);
}

dopt_status dopt_sim_all_gather_view_n(int nb, const void *const *sends, const size_t *counts, const void **views,
                                       dopt_dtype dt, dopt_sim_comm *comm) {
  sim_call k;
  DOPT_TRY(call_begin(&k, comm, DOPT_SIM_KIND_ALL_GATHER));
  size_t total = 0;
  for (int b = 0; counts && b < nb; b++) total += counts[b];
  sim_arrival a = arrival_init(DOPT_SIM_KIND_ALL_GATHER, NULL, NULL, total, dt, -1, -1);
  a.sig.view = 1;
  a.views = views;
  a.nb = nb;
  a.sends = sends;
  a.scounts = counts;
  check_common(&a, comm, 1, 0);
  check_by_ref(&a, comm, views);
  if (nb < 1 || !sends || !counts)
    arg_fail(&a, DOPT_ERR_INVALID_ARG, "all_gather_view_n: nb=%d sends=%p counts=%p", nb, (const void *)sends,
             (const void *)counts);
  for (int b = 0; a.status == DOPT_OK && b < nb; b++)
    if (counts[b] && !sends[b]) arg_fail(&a, DOPT_ERR_INVALID_ARG, "all_gather_view_n: sends[%d]=NULL with %zu elements", b, counts[b]);
  return run_collective(&k, &a);
}

dopt_status dopt_sim_broadcast(const void *send, void *recv, size_t count, dopt_dtype dt,
                               int root, dopt_sim_comm *comm) {
  return collective(comm, DOPT_SIM_KIND_BROADCAST, send, recv, count, dt, -1, root);
}

dopt_status dopt_sim_reduce(const void *send, void *recv, size_t count, dopt_dtype dt,
                            dopt_redop op, int root, dopt_sim_comm *comm) {
  return collective(comm, DOPT_SIM_KIND_REDUCE, send, recv, count, dt, (int)op, root);
}

dopt_status dopt_sim_all_to_all(const void *send, void *recv, size_t count, dopt_dtype dt,
                                dopt_sim_comm *comm) {
  return collective(comm, DOPT_SIM_KIND_ALL_TO_ALL, send, recv, count, dt, -1, -1);
}

/* Extent in elements of the regions [displs[j], +counts[j]) (0 when all are
 * empty); *bad: an end overflows or exceeds SIZE_MAX bytes. */
static size_t extent(const size_t *counts, const size_t *displs, int n, size_t esz, int *bad) {
  size_t hi = 0;
  for (int j = 0; j < n; j++) {
    if (counts[j] == 0)
      continue;
    if (displs[j] > SIZE_MAX - counts[j] || displs[j] + counts[j] > SIZE_MAX / esz)
      *bad = 1;
    else if (displs[j] + counts[j] > hi)
      hi = displs[j] + counts[j];
  }
  return hi;
}

/* all_to_allv, copied into recv at rdispls, or (by_ref) by reference into views; sends non-NULL: nb exchanges by
 * reference, each from its own send buffer (dopt_sim_all_to_allv_view_n). */
static dopt_status all_to_allv(const void *send, const size_t *scounts, const size_t *sdispls, void *recv,
                               const size_t *rcounts, const size_t *rdispls, const void **views, int by_ref,
                               int multi, int nb, const void *const *sends, dopt_dtype dt, dopt_sim_comm *comm) {
  sim_call k;
  DOPT_TRY(call_begin(&k, comm, DOPT_SIM_KIND_ALL_TO_ALLV));
  sim_arrival a = arrival_init(DOPT_SIM_KIND_ALL_TO_ALLV, send, recv, multi ? (size_t)(nb > 0 ? nb : 0) : 0, dt, -1, -1);
  a.sig.view = by_ref;
  a.nb = multi && nb > 0 ? nb : 1;
  a.sends = multi ? sends : NULL;
  a.scounts = scounts;
  a.sdispls = sdispls;
  a.rcounts = rcounts;
  a.rdispls = rdispls; /* by reference: NULL (no receive buffer) */
  a.views = by_ref ? views : NULL;
  check_common(&a, comm, 0, 0);
  const int n = comm->g->n;
  if (by_ref) check_by_ref(&a, comm, views);
  /* reported to every rank before any count is read */
  if (!scounts || !sdispls || !rcounts || (!by_ref && !rdispls))
    arg_fail(&a, DOPT_ERR_INVALID_ARG, "all_to_allv: scounts=%p sdispls=%p rcounts=%p rdispls=%p must not be NULL",
             (const void *)scounts, (const void *)sdispls, (const void *)rcounts, (const void *)rdispls);
  if (multi && a.status == DOPT_OK) { /* nb exchanges by reference: each send buffer against its own counts */
    if (nb < 1) arg_fail(&a, DOPT_ERR_INVALID_ARG, "all_to_allv_view_n: nb=%d must be >= 1", nb);
    else if (!sends) arg_fail(&a, DOPT_ERR_INVALID_ARG, "all_to_allv_view_n: sends=NULL");
    for (int b = 0; a.status == DOPT_OK && b < nb; b++) {
      int bad = 0;
      const size_t at = (size_t)b * (size_t)n, sn = extent(scounts + at, sdispls + at, n, dopt_dtype_size(dt), &bad);
      if (bad) arg_fail(&a, DOPT_ERR_INVALID_ARG, "all_to_allv_view_n: exchange %d: a displacement plus its count overflows", b);
      else if (sn && !sends[b])
        arg_fail(&a, DOPT_ERR_INVALID_ARG, "all_to_allv_view_n: exchange %d: sends[%d]=NULL with %zu elements", b, b, sn);
    }
  } else if (a.status == DOPT_OK) {
    int bad = 0;
    size_t esz = dopt_dtype_size(dt);
    size_t sn = extent(scounts, sdispls, n, esz, &bad), rn = by_ref ? 0 : extent(rcounts, rdispls, n, esz, &bad);
    if (bad)
      arg_fail(&a, DOPT_ERR_INVALID_ARG, "all_to_allv: a displacement plus its count overflows");
    else if ((sn && !send) || (rn && !recv))
      arg_fail(&a, DOPT_ERR_INVALID_ARG, "all_to_allv: send=%p (%zu elements) recv=%p (%zu elements): NULL with data",
               send, sn, recv, rn);
    else if (!by_ref && send && (const void *)send == (const void *)recv)
      /* MPI and NCCL have no in-place all_to_allv here: one buffer as both is refused even with nothing to send
       * (Open MPI's non-blocking path hangs on it), not only when the ranges meet */
      arg_fail(&a, DOPT_ERR_OVERLAP, "all_to_allv: rank %d passes send=recv=%p (%zu and %zu elements): overlap and "
               "are not in place (never allowed, even empty)", comm->rank, send, sn, rn);
    else if (!by_ref)
      check_overlap(&a, sn * esz, rn * esz, 0);
  }
  return run_collective(&k, &a);
}

dopt_status dopt_sim_all_to_allv(const void *send, const size_t *scounts, const size_t *sdispls, void *recv,
                                 const size_t *rcounts, const size_t *rdispls, dopt_dtype dt,
                                 dopt_sim_comm *comm) {
  return all_to_allv(send, scounts, sdispls, recv, rcounts, rdispls, NULL, 0, 0, 1, NULL, dt, comm);
}

dopt_status dopt_sim_all_to_allv_view(const void *send, const size_t *scounts, const size_t *sdispls,
                                      const void **views, const size_t *rcounts, dopt_dtype dt,
                                      dopt_sim_comm *comm) {
  return all_to_allv(send, scounts, sdispls, NULL, rcounts, NULL, views, 1, 0, 1, NULL, dt, comm);
}

dopt_status dopt_sim_all_to_allv_view_n(int nb, const void *const *sends, const size_t *scounts,
                                        const size_t *sdispls, const void **views, const size_t *rcounts,
                                        dopt_dtype dt, dopt_sim_comm *comm) {
  return all_to_allv(NULL, scounts, sdispls, NULL, rcounts, NULL, views, 1, 1, nb, sends, dt, comm);
}

int dopt__sim_views_ok(const dopt_sim_comm *comm) { return comm && comm->g && comm->g->w->views_ok; }

dopt_status dopt_sim_barrier(dopt_sim_comm *comm) {
  sim_call k;
  DOPT_TRY(call_begin(&k, comm, DOPT_SIM_KIND_BARRIER));
  sim_arrival a = arrival_init(DOPT_SIM_KIND_BARRIER, NULL, NULL, 0, DOPT_U8, -1, -1);
  DOPT_TRY(arrive(&k, &a));
  return call_end(&k, NULL, 0, DOPT_U8);
}

/* ---- point to point ---------------------------------------------------------------- */

/* Entry of send/recv: checks are local (there is no rendezvous). */
static dopt_status p2p_begin(sim_call *k, sim_arrival *a, dopt_sim_comm *comm, dopt_sim_kind kind,
                             const void *send, void *recv, size_t count, dopt_dtype dt,
                             int peer) {
  DOPT_TRY(call_begin(k, comm, kind));
  *a = arrival_init(kind, send, recv, count, dt, -1, peer);
  check_common(a, comm, 0, 0);
  if (peer < 0 || peer >= comm->g->n)
    arg_fail(a, DOPT_ERR_INVALID_ARG, "%s: peer=%d out of range [0,%d)", dopt_sim_kind_name(kind),
             peer, comm->g->n);
  if (kind == DOPT_SIM_KIND_SEND)
    check_ptr(a, send, "send");
  else
    check_ptr(a, recv, "recv");
  if (a->status != DOPT_OK)
    return dopt__fail(a->status, "comm '%s' rank %d: %s", comm->g->label, comm->rank, a->msg);
  return DOPT_OK;
}

dopt_status dopt_sim_send(const void *send, size_t count, dopt_dtype dt, int peer,
                          dopt_sim_comm *comm) {
  sim_call k;
  sim_arrival a;
  DOPT_TRY(p2p_begin(&k, &a, comm, DOPT_SIM_KIND_SEND, send, NULL, count, dt, peer));
  size_t bytes = count * dopt_dtype_size(dt);
  sim_msg *m = malloc(sizeof *m + bytes);
  if (m == NULL)
    return dopt__fail(DOPT_ERR_NO_MEMORY, "send: count=%zu", count);
  m->next = NULL;
  m->count = count;
  m->dtype = (int)dt;
  dopt__sim_copy(k.w->mem, m + 1, send, bytes);
  sim_group *g = k.g;
  pthread_mutex_lock(&k.w->mu);
  if (k.w->poisoned) {
    dopt_status s = aborted_locked(comm);
    pthread_mutex_unlock(&k.w->mu);
    free(m);
    return s;
  }
  size_t q = (size_t)comm->rank * (size_t)g->n + (size_t)peer;
  if (g->mq_tail[q] != NULL)
    g->mq_tail[q]->next = m;
  else
    g->mq_head[q] = m;
  g->mq_tail[q] = m;
  dopt__sim_account(g, &a.sig, comm->rank);
  pthread_cond_broadcast(&g->cond);
  pthread_mutex_unlock(&k.w->mu);
  return call_end(&k, NULL, 0, dt);
}

dopt_status dopt_sim_recv(void *recv, size_t count, dopt_dtype dt, int peer,
                          dopt_sim_comm *comm) {
  sim_call k;
  sim_arrival a;
  DOPT_TRY(p2p_begin(&k, &a, comm, DOPT_SIM_KIND_RECV, NULL, recv, count, dt, peer));
  sim_group *g = k.g;
  size_t q = (size_t)peer * (size_t)g->n + (size_t)comm->rank;
  pthread_mutex_lock(&k.w->mu);
  dopt_status s = DOPT_OK;
  while (g->mq_head[q] == NULL) {
    if (k.w->poisoned) {
      s = aborted_locked(comm);
      break;
    }
    int rc = pthread_cond_timedwait(&g->cond, &k.w->mu, &k.deadline);
    if (rc == ETIMEDOUT && g->mq_head[q] == NULL && !k.w->poisoned) {
      char what[48];
      snprintf(what, sizeof what, "no message from peer %d", peer);
      s = timeout_locked(&k, what);
      break;
    }
  }
  sim_msg *m = NULL;
  if (s == DOPT_OK) {
    m = g->mq_head[q];
    g->mq_head[q] = m->next;
    if (m->next == NULL)
      g->mq_tail[q] = NULL;
    dopt__sim_account(g, &a.sig, comm->rank);
  }
  pthread_mutex_unlock(&k.w->mu);
  if (s != DOPT_OK)
    return s;
  if (m->count != count || m->dtype != (int)dt) {
    char sa[96], ra[96];
    sim_sig ss = a.sig;
    ss.kind = DOPT_SIM_KIND_SEND;
    ss.count = m->count;
    ss.dtype = m->dtype;
    ss.root = comm->rank;
    sig_format(&ss, sa, sizeof sa);
    sig_format(&a.sig, ra, sizeof ra);
    free(m);
    return dopt__fail(DOPT_ERR_MISMATCH, "comm '%s': rank %d %s vs rank %d %s", g->label, peer, sa,
                      comm->rank, ra);
  }
  dopt__sim_copy(k.w->mem, recv, m + 1, count * dopt_dtype_size(dt));
  free(m);
  return call_end(&k, recv, count, dt);
}

/* Frees a group, its message queues and handles (a failed creation, a world's destroy). */
void dopt__sim_group_free(sim_group *g) {
  if (g == NULL)
    return;
  if (g->mq_head != NULL) {
    for (size_t i = 0; i < (size_t)g->n * (size_t)g->n; i++) {
      for (sim_msg *m = g->mq_head[i]; m != NULL;) {
        sim_msg *next = m->next;
        free(m);
        m = next;
      }
    }
  }
  if (g->handles != NULL)
    for (int i = 0; i < g->n; i++)
      free((void *)g->handles[i].srcs);
  pthread_cond_destroy(&g->cond);
  free(g->wranks);
  free(g->handles);
  free(g->arr);
  free(g->mq_head);
  free(g->mq_tail);
  free(g);
}

/* A new group registered in the world (lock held, or before any thread runs). */
sim_group *dopt__sim_group_new_locked(dopt_sim_world *w, int n, const char *label) {
  sim_group *g = calloc(1, sizeof *g);
  if (g == NULL)
    return NULL;
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  int rc = pthread_cond_init(&g->cond, &ca);
  pthread_condattr_destroy(&ca);
  if (rc != 0) {
    free(g);
    return NULL;
  }
  size_t nn = (size_t)n * (size_t)n;
  g->w = w;
  g->n = n;
  snprintf(g->label, sizeof g->label, "%s", label);
  g->wranks = calloc((size_t)n, sizeof *g->wranks);
  g->handles = calloc((size_t)n, sizeof *g->handles);
  g->arr = calloc((size_t)n, sizeof *g->arr);
  g->mq_head = calloc(nn, sizeof *g->mq_head);
  g->mq_tail = calloc(nn, sizeof *g->mq_tail);
  int ok = g->wranks && g->handles && g->arr && g->mq_head && g->mq_tail;
  for (int i = 0; ok && i < n; i++) {
    g->handles[i].g = g;
    g->handles[i].rank = i;
    g->handles[i].srcs = calloc((size_t)n, sizeof(void *));
    ok = g->handles[i].srcs != NULL;
  }
  if (!ok) {
    dopt__sim_group_free(g);
    return NULL;
  }
  g->stats.struct_size = (uint32_t)sizeof g->stats;
  g->stats.version = 1;
  g->stats.nranks = n;
  snprintf(g->stats.label, sizeof g->stats.label, "%s", label);
  g->id = w->next_id++;
  /* append: the world group stays first */
  sim_group **tail = &w->groups;
  while (*tail != NULL)
    tail = &(*tail)->next;
  *tail = g;
  return g;
}
