/* The simulator behind the transport interface (distopt/transport.h). */
#include "distopt/sim.h"
#include "sim_internal.h"

static dopt_status t_all_reduce(void *c, const void *s, void *r, size_t n, dopt_dtype dt, dopt_redop op) {
  return dopt_sim_all_reduce(s, r, n, dt, op, c);
}
static dopt_status t_reduce_scatter(void *c, const void *s, void *r, size_t n, dopt_dtype dt, dopt_redop op) {
  return dopt_sim_reduce_scatter(s, r, n, dt, op, c);
}
static dopt_status t_all_gather(void *c, const void *s, void *r, size_t n, dopt_dtype dt) {
  return dopt_sim_all_gather(s, r, n, dt, c);
}
static dopt_status t_broadcast(void *c, const void *s, void *r, size_t n, dopt_dtype dt, int root) {
  return dopt_sim_broadcast(s, r, n, dt, root, c);
}

static dopt_status t_reduce(void *c, const void *s, void *r, size_t n, dopt_dtype dt, dopt_redop op, int root) {
  return dopt_sim_reduce(s, r, n, dt, op, root, c);
}
static dopt_status t_all_to_allv(void *c, const void *s, const size_t *sc, const size_t *sd, void *r, const size_t *rc,
                                 const size_t *rd, dopt_dtype dt) {
  return dopt_sim_all_to_allv(s, sc, sd, r, rc, rd, dt, c);
}

static dopt_status t_all_to_allv_view(void *c, const void *s, const size_t *sc, const size_t *sd, const void **v,
                                      const size_t *rc, dopt_dtype dt) {
  return dopt_sim_all_to_allv_view(s, sc, sd, v, rc, dt, c);
}
static dopt_status t_view_release(void *c) { return dopt_sim_barrier(c); }
static dopt_status t_all_gather_view(void *c, const void *s, const void **v, size_t n, dopt_dtype dt) {
  return dopt_sim_all_gather_view(s, v, n, dt, c);
}

static dopt_status t_all_to_allv_view_n(void *c, int nb, const void *const *s, const size_t *sc, const size_t *sd,
                                        const void **v, const size_t *rc, dopt_dtype dt) {
  return dopt_sim_all_to_allv_view_n(nb, s, sc, sd, v, rc, dt, c);
}

static dopt_status t_all_gather_view_n(void *c, int nb, const void *const *s, const size_t *n, const void **v,
                                       dopt_dtype dt) {
  return dopt_sim_all_gather_view_n(nb, s, n, v, dt, c);
}

static const dopt_transport_ops sim_ops = {t_all_reduce, t_reduce_scatter, t_all_gather, t_broadcast, t_reduce,
                                           t_all_to_allv, NULL, NULL, NULL, NULL, NULL};
/* a world whose ranks may read each other's send buffers in place (host buffers, no fault plan) */
static const dopt_transport_ops sim_view_ops = {t_all_reduce, t_reduce_scatter, t_all_gather, t_broadcast, t_reduce,
                                                t_all_to_allv, t_all_to_allv_view, t_view_release,
                                                t_all_gather_view, t_all_to_allv_view_n, t_all_gather_view_n};

dopt_status dopt_sim_transport(dopt_sim_comm *comm, dopt_transport *out) {
  DOPT_CHECK_ARG(comm != NULL && out != NULL, "dopt_sim_transport: comm/out NULL");
  out->ops = dopt__sim_views_ok(comm) ? &sim_view_ops : &sim_ops;
  out->comm = comm;
  DOPT_TRY(dopt_sim_comm_rank(comm, &out->rank));
  return dopt_sim_comm_size(comm, &out->size);
}
