/* distopt_mpi without MPI: the public symbols of distopt/mpi.h answer
 * DOPT_ERR_UNSUPPORTED with a message, so the distopt CLI builds and reports
 * clearly on machines without MPI. */
#include "distopt/mpi.h"
#include "internal.h"

static dopt_status no_mpi(const char *fn) {
  return dopt__fail(DOPT_ERR_UNSUPPORTED,
                    "%s: distopt was built without MPI (DOPT_MPI=OFF or no MPI found; install libopenmpi-dev)", fn);
}

int dopt_mpi_available(void) { return 0; }
dopt_status dopt_mpi_init(uint32_t timeout_ms, dopt_mpi_comm **world) {
  (void)timeout_ms;
  if (world) *world = NULL;
  return no_mpi("dopt_mpi_init");
}
dopt_status dopt_mpi_split(dopt_mpi_comm *comm, int color, int key, dopt_mpi_comm **out) {
  (void)comm, (void)color, (void)key;
  if (out) *out = NULL;
  return no_mpi("dopt_mpi_split");
}
dopt_status dopt_mpi_transport(dopt_mpi_comm *comm, dopt_transport *out) {
  (void)comm, (void)out;
  return no_mpi("dopt_mpi_transport");
}
dopt_status dopt_mpi_set_chunk(dopt_mpi_comm *comm, size_t elems) {
  (void)comm, (void)elems;
  return no_mpi("dopt_mpi_set_chunk");
}
dopt_status dopt_mpi_abort(dopt_mpi_comm *comm) {
  (void)comm;
  return no_mpi("dopt_mpi_abort");
}
void dopt_mpi_destroy(dopt_mpi_comm *comm) { (void)comm; }
dopt_status dopt_mpi_finalize(void) { return DOPT_OK; }
