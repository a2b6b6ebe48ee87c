/* distopt_cuda without CUDA and/or NCCL: the public symbols of
 * distopt/cuda.h answer DOPT_ERR_UNSUPPORTED with a message, so tools (the
 * distopt CLI) build and report clearly on machines without them. */
#include "distopt/cuda.h"
#include "internal.h"

#ifndef DOPT_HAVE_CUDA
int dopt_cuda_device_count(const char **why) {
  if (why) *why = "distopt was built without CUDA (configure with -DDOPT_CUDA=ON on a machine with nvcc)";
  return 0;
}

dopt_status dopt_device_cuda(int device, dopt_device **out) {
  (void)device;
  if (out) *out = NULL;
  return dopt__fail(DOPT_ERR_UNSUPPORTED, "cuda device: distopt was built without CUDA (DOPT_CUDA=OFF or no nvcc)");
}

void dopt_device_cuda_destroy(dopt_device *dev) { (void)dev; }

const dopt_sim_memops *dopt_cuda_sim_memops(void) { return NULL; }
#endif

#ifndef DOPT_HAVE_NCCL
static dopt_status no_nccl(const char *fn) {
  return dopt__fail(DOPT_ERR_UNSUPPORTED, "%s: distopt was built without NCCL (DOPT_NCCL=OFF or NCCL not found)", fn);
}

dopt_status dopt_nccl_unique_id(unsigned char id[DOPT_NCCL_ID_BYTES]) {
  (void)id;
  return no_nccl("dopt_nccl_unique_id");
}
dopt_status dopt_nccl_init(const unsigned char id[DOPT_NCCL_ID_BYTES], int nranks, int rank, int device,
                           uint32_t timeout_ms, dopt_nccl_comm **out) {
  (void)id, (void)nranks, (void)rank, (void)device, (void)timeout_ms;
  if (out) *out = NULL;
  return no_nccl("dopt_nccl_init");
}
dopt_status dopt_nccl_init_env(uint32_t timeout_ms, dopt_nccl_comm **out) {
  (void)timeout_ms;
  if (out) *out = NULL;
  return no_nccl("dopt_nccl_init_env");
}
dopt_status dopt_nccl_split(dopt_nccl_comm *comm, int color, int key, dopt_nccl_comm **out) {
  (void)comm, (void)color, (void)key;
  if (out) *out = NULL;
  return no_nccl("dopt_nccl_split");
}
dopt_status dopt_nccl_set_native_float_sums(dopt_nccl_comm *comm, int on) {
  (void)comm, (void)on;
  return no_nccl("dopt_nccl_set_native_float_sums");
}
dopt_status dopt_nccl_transport(dopt_nccl_comm *comm, dopt_transport *out) {
  (void)comm, (void)out;
  return no_nccl("dopt_nccl_transport");
}
dopt_status dopt_nccl_abort(dopt_nccl_comm *comm) {
  (void)comm;
  return no_nccl("dopt_nccl_abort");
}
void dopt_nccl_destroy(dopt_nccl_comm *comm) { (void)comm; }
#endif
