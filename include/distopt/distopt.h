/* distopt — the umbrella header: the whole public API (docs/api.md).
 *   single device   status.h, dtype.h, optim.h (registry, groups, params, states), quant8.h, galore.h, xsum.h
 *                   (exact sums), digest.h, checkpoint.h (reshardable checkpoints), safetensors.h, files.h
 *   layouts         layout.h (pieces, the TP split, world-rank coordinates)
 *   distributed     dist.h (distributed optimizers, the plugin table), dpsum.h (the exact dp sum), transport.h,
 *                   device.h
 *   transports      sim.h (the collective simulator), mpi.h, cuda.h (CUDA device and NCCL), launch.h
 * Each header also stands alone. */
#ifndef DISTOPT_H
#define DISTOPT_H
#include "distopt/status.h"
#include "distopt/dtype.h"
#include "distopt/optim.h"
#include "distopt/quant8.h"
#include "distopt/galore.h"
#include "distopt/xsum.h"
#include "distopt/digest.h"
#include "distopt/checkpoint.h"
#include "distopt/safetensors.h"
#include "distopt/files.h"
#include "distopt/layout.h"
#include "distopt/device.h"
#include "distopt/transport.h"
#include "distopt/dpsum.h"
#include "distopt/dist.h"
#include "distopt/sim.h"
#include "distopt/mpi.h"
#include "distopt/cuda.h"
#include "distopt/launch.h"
#define DOPT_VERSION_MAJOR 0
#define DOPT_VERSION_MINOR 5
#define DOPT_VERSION_PATCH 0
#endif
