/* Simulator internals shared by the sources in sim/ (never installed). */
#ifndef DISTOPT_SIM_INTERNAL_H
#define DISTOPT_SIM_INTERNAL_H

#include "distopt/sim.h"
#include "internal.h"

#include <pthread.h>
#include <time.h>

/* ---- data movement: the only code that reads or writes buffer contents, so
 * that a device-buffer variant can replace these three functions. ---------- */

/* mem: the world's dopt_sim_memops (NULL: host memory, the code below). */
/* memcpy for non-overlapping host ranges. */
void dopt__sim_copy(const dopt_sim_memops *mem, void *dst, const void *src, size_t bytes);
/* out[k] = srcs[o0][off+k] (op) srcs[o1][off+k] (op) ... for k < count, where
 * o_j = (start + j) mod n: a fixed combination order. out may alias
 * srcs[j] + off (in place); it must not partially overlap any source. bf16 is
 * accumulated in fp32 and rounded once; AVG divides the sum by n once. */
void dopt__sim_reduce(const dopt_sim_memops *mem, dopt_dtype dt, dopt_redop op, void *out, const void *const *srcs,
                      int n, int start, size_t off, size_t count);
/* Flips bit `bit` (mod the element width) of element `elem` (mod count) of a
 * little-endian buffer; no-op when count is 0. */
void dopt__sim_flip_bit(const dopt_sim_memops *mem, void *buf, size_t count, dopt_dtype dt, uint64_t elem, uint32_t bit);

/* ---- shared state ------------------------------------------------------------ */

/* What a call looks like, compared across ranks. */
typedef struct sim_sig {
  dopt_sim_kind kind;
  size_t count;
  int dtype;
  int op;   /* -1 when not a reduction */
  int root; /* broadcast/reduce root; send/recv peer; else -1 */
  char label[DOPT_SIM_LABEL_MAX]; /* split only */
  int view; /* all_to_allv by reference (dopt_sim_all_to_allv_view) */
} sim_sig;

/* One rank's deposit at the rendezvous of the current collective. */
typedef struct sim_arrival {
  sim_sig sig;
  const void *send;
  void *recv;
  int color, key;              /* split */
  dopt_status status;          /* argument check result on this rank */
  char msg[192];
  struct dopt_sim_comm *result; /* split: this rank's new handle */
  const size_t *scounts, *sdispls, *rcounts, *rdispls; /* all_to_allv: [nb·n] each (rdispls: [n]) */
  const void **views;                                  /* all_to_allv by reference: [nb·n], filled */
  int nb;                                              /* all_to_allv: exchanges in the call (1; _view_n: nb) */
  const void *const *sends;                            /* all_to_allv_view_n: [nb] send buffers (else NULL) */
} sim_arrival;

/* An eager point-to-point message (data follows the header). */
typedef struct sim_msg {
  struct sim_msg *next;
  size_t count;
  int dtype;
} sim_msg;

/* State of one communicator, shared by its member handles; protected by the
 * world mutex. */
typedef struct sim_group {
  struct dopt_sim_world *w;
  int id, n;
  char label[DOPT_SIM_LABEL_MAX];
  int *wranks;                 /* world rank of each member */
  struct dopt_sim_comm *handles; /* [n] */
  pthread_cond_t cond;
  int bar_count;               /* generation barrier */
  int in_data;                 /* ranks inside the current collective's data phase (they may read
                                  each other's buffers): an aborted rank waits for 0 before it leaves */
  int data_waiters;            /* aborted ranks waiting for in_data to reach 0 */
  uint64_t bar_gen;
  sim_arrival *arr;            /* [n] current collective */
  dopt_status op_err;          /* verdict of the last validation */
  char op_msg[448];
  uint64_t op_seq;             /* collectives validated so far */
  sim_msg **mq_head, **mq_tail; /* [src*n+dst] */
  dopt_sim_stats stats;
  struct sim_group *next;
} sim_group;

struct dopt_sim_comm {
  sim_group *g;
  int rank, wrank;
  uint32_t timeout_ms;        /* touched by the owning rank only */
  int destroyed;
  const void **srcs;          /* [n] scratch for reductions (owning rank only) */
};

typedef struct sim_rank {
  uint64_t ops;    /* operation counter (fault plan index) */
  int stopped;     /* STOP fault fired: every later call fails */
  char err[512];   /* body's last error message */
} sim_rank;

struct dopt_sim_world {
  int n;
  dopt_sim_mode mode;
  uint32_t timeout_ms;
  dopt_sim_fault *faults; /* resolved plan */
  size_t nfaults;
  pthread_mutex_t mu;     /* protects everything below and all groups */
  int poisoned;
  char poison_msg[448];
  sim_group *groups;      /* every communicator, world first */
  int next_id;
  sim_rank *ranks;        /* [n], each touched by its rank's thread only */
  struct sim_logent *log; /* operation log (accounting) */
  size_t nlog, caplog;
  int log_truncated;      /* an append failed for lack of memory */
  int launched;
  const dopt_sim_memops *mem; /* NULL: host buffers */
  int views_ok;               /* all_to_allv by reference allowed: host buffers, no fault plan, not copy_exchanges */
};

/* The world of comm allows all_to_allv by reference (dopt_sim_transport offers it then). */
int dopt__sim_views_ok(const dopt_sim_comm *comm);

/* One logged operation; the group and sender identify whose timeline it is on. */
typedef struct sim_logent {
  dopt_sim_record rec;
  const sim_group *g;
  int src_wrank, dst_wrank; /* sends only */
} sim_logent;

/* Accounting (sim_account.c), world mutex held: counts the operation in the
 * group's stats and logs it. `rank` is the caller's comm rank for sends. */
void dopt__sim_account(sim_group *g, const sim_sig *s, int rank);

/* ---- world and protocol (sim_world.c, sim.c), world mutex held ----------------------------- */
/* A new group registered in the world (lock held, or before any thread runs); sim_world.c. */
sim_group *dopt__sim_group_new_locked(dopt_sim_world *w, int n, const char *label);
void dopt__sim_group_free(sim_group *g);
/* Poisons the world with the first cause and wakes every waiting rank; sim.c. */
void dopt__sim_poison_locked(dopt_sim_world *w, const char *fmt, ...) DOPT_PRINTF(2, 3);

#endif
