/* distopt — umbrella header. */
#ifndef DISTOPT_H
#define DISTOPT_H
#include "distopt/status.h"
#include "distopt/optim.h"
#include "distopt/quant8.h"
#include "distopt/galore.h"
#include "distopt/xsum.h"
#include "distopt/digest.h"
#include "distopt/checkpoint.h"
#include "distopt/files.h"
#define DOPT_VERSION_MAJOR 0
#define DOPT_VERSION_MINOR 4
#define DOPT_VERSION_PATCH 0
#endif
