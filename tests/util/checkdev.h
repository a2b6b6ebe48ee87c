/* The checking device (tests only): the CPU device, with its memory taken
 * from a tracked arena, so that GPU-only bugs show on a CPU-only runner. Every
 * kernel argument and every buffer handed to a wrapped transport must lie
 * inside one live arena allocation (ranges checked with their sizes); a host
 * pointer (a stack variable, a malloc'd buffer) is reported with the operation,
 * the argument and the call site, and the call fails with
 * DOPT_ERR_INVALID_ARG. On a GPU the same bug reads host memory in a kernel
 * (illegal address, dead context) or inside NCCL.
 *
 * One checker per rank thread; the arithmetic is the CPU device's, so results
 * are bitwise those of dopt_device_cpu(). */
#ifndef DOPT_CHECKDEV_H
#define DOPT_CHECKDEV_H

#include <stddef.h>

#include "distopt/device.h"
#include "distopt/transport.h"

typedef struct dt_checkdev dt_checkdev;

dopt_status dt_checkdev_create(dt_checkdev **out);
void dt_checkdev_destroy(dt_checkdev *c);
/* The device (valid while c lives). */
const dopt_device *dt_checkdev_device(dt_checkdev *c);
/* out: `in` whose every call first checks its buffers against c's arena.
 * `in` must outlive out (it is copied; its communicator is borrowed). */
dopt_status dt_checkdev_wrap(dt_checkdev *c, const dopt_transport *in, dopt_transport *out);
/* A wrapped transport (dt_checkdev_wrap) then offers only the first four collectives: reduce and all_to_allv
 * NULL, as an older or minimal backend (distributed/ falls back to all_reduce and broadcasts). */
void dt_checkdev_basic_ops(dopt_transport *t);
/* on: every step runs through dopt__step_on_host (download, the CPU step on host copies, upload), as the CUDA
 * device runs the steps it has no kernel for; results stay bitwise the CPU device's. */
void dt_checkdev_host_steps(dt_checkdev *c, int on);
/* Violations so far, and the first one's message ("" if none). */
size_t dt_checkdev_violations(const dt_checkdev *c, const char **first);
/* Live arena allocations (a leak check after destroying what used the device). */
size_t dt_checkdev_live(const dt_checkdev *c);

#endif
