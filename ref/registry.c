/* The registry: the table of every reference optimizer (built from
 * ref/optimizers.def and the configure-time extras), and the public calls
 * that take an optimizer's name (include/distopt/optim.h). They look the name
 * up here and hand the implementation to core/optim.c. */
#include <string.h>

#include "registry.h"

/* dopt_impl_<name> of every registered optimizer, defined in ref/<name>.c */
#define DOPT_OPTIMIZER(n) extern const dopt_optim_impl dopt_impl_##n;
#include "optimizers.def"
#include "extra_optimizers.def"
#undef DOPT_OPTIMIZER

static const dopt_optim_impl *const registry[] = {
#define DOPT_OPTIMIZER(n) &dopt_impl_##n,
#include "optimizers.def"
#include "extra_optimizers.def"
#undef DOPT_OPTIMIZER
};
const char *const dopt__registry_names[] = {
#define DOPT_OPTIMIZER(n) #n,
#include "optimizers.def"
#include "extra_optimizers.def"
#undef DOPT_OPTIMIZER
    NULL,
};
#define NREG ((int)(sizeof registry / sizeof registry[0]))

int dopt_optim_registry_count(void) { return NREG; }
const char *dopt_optim_registry_name(int i) { return i >= 0 && i < NREG ? registry[i]->name : NULL; }

const dopt_optim_impl *dopt_find_impl(const char *name) {
  for (int i = 0; name && i < NREG; i++)
    if (strcmp(registry[i]->name, name) == 0) return registry[i];
  return NULL;
}

dopt_status dopt_optim_registry_info(int i, dopt_optim_info *out) {
  DOPT_CHECK_ARG(out != NULL, "dopt_optim_registry_info: out=NULL");
  DOPT_CHECK_ARG(i >= 0 && i < NREG, "dopt_optim_registry_info: i=%d outside [0, %d)", i, NREG);
  static const char *const defaults_only[] = {"", NULL};
  const dopt_optim_impl *im = registry[i];
  *out = (dopt_optim_info){DOPT_OPTIM_INFO_VERSION, im->name, im->summary, im->distributable, im->wrap != NULL,
                           im->example ? im->example : "", im->grid ? im->grid : defaults_only, 0, 0};
  while (out->grid[out->grid_count]) out->grid_count++;
  out->grid_ci = im->grid_ci < 1 ? 1 : im->grid_ci > out->grid_count ? out->grid_count : im->grid_ci;
  return DOPT_OK;
}

dopt_status dopt_optim_create(const char *name, const char *hparams, dopt_optim **out) {
  DOPT_CHECK_ARG(out != NULL, "dopt_optim_create: out=NULL");
  *out = NULL;
  DOPT_CHECK_ARG(name != NULL, "dopt_optim_create: name=NULL");
  const dopt_optim_impl *im = dopt_find_impl(name);
  if (!im) {
    char known[512] = "";
    for (int i = 0; i < NREG; i++) {
      strncat(known, i ? ", " : "", sizeof known - strlen(known) - 1);
      strncat(known, registry[i]->name, sizeof known - strlen(known) - 1);
    }
    return dopt__fail(DOPT_ERR_NOT_FOUND, "unknown optimizer '%s' (registered: %s)", name, known);
  }
  return dopt__optim_create_impl(im, hparams, out);
}

dopt_status dopt_optim_state_bytes_for(const char *name, const char *hparams, int ndim, const int64_t *shape,
                                       size_t *bytes) {
  DOPT_CHECK_ARG(bytes != NULL && (shape != NULL || ndim == 0), "dopt_optim_state_bytes_for: NULL argument");
  DOPT_CHECK_ARG(ndim >= 0 && ndim <= DOPT_MAX_DIMS, "dopt_optim_state_bytes_for: ndim=%d", ndim);
  const dopt_optim_impl *im = dopt_find_impl(name);
  if (!im) return dopt__fail(DOPT_ERR_NOT_FOUND, "unknown optimizer '%s'", name ? name : "(null)");
  return dopt__impl_state_bytes(im, hparams, ndim, shape, bytes);
}

dopt_status dopt_optim_describe(const char *name, char *buf, size_t cap) {
  DOPT_CHECK_ARG(buf != NULL && cap > 0, "dopt_optim_describe: buf=NULL or cap=0");
  const dopt_optim_impl *im = dopt_find_impl(name);
  if (!im) return dopt__fail(DOPT_ERR_NOT_FOUND, "unknown optimizer '%s'", name ? name : "(null)");
  return dopt__impl_describe(im, buf, cap);
}
