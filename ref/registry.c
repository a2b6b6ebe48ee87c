/* The registry: the table that names every reference optimizer, and the
 * public calls that take an optimizer's name (include/distopt/optim.h). They
 * look the name up here and hand the implementation to core/optim.c. */
#include <string.h>

#include "registry.h"

static const dopt_optim_impl *const registry[] = {
    &dopt_impl_adamw,
    &dopt_impl_adafactor,
    &dopt_impl_came,
    &dopt_impl_lamb,
    &dopt_impl_adamw8bit,
    &dopt_impl_galore_adamw,
    &dopt_impl_galore_adamw8bit,
    &dopt_impl_q_galore,
    &dopt_impl_lisa,
};
#define NREG ((int)(sizeof registry / sizeof registry[0]))

int dopt_optim_registry_count(void) { return NREG; }
const char *dopt_optim_registry_name(int i) { return i >= 0 && i < NREG ? registry[i]->name : NULL; }

const dopt_optim_impl *dopt_find_impl(const char *name) {
  for (int i = 0; name && i < NREG; i++)
    if (strcmp(registry[i]->name, name) == 0) return registry[i];
  return NULL;
}

dopt_status dopt_optim_create(const char *name, const char *hparams, dopt_optim **out) {
  DOPT_CHECK_ARG(out != NULL, "dopt_optim_create: out=NULL");
  *out = NULL;
  DOPT_CHECK_ARG(name != NULL, "dopt_optim_create: name=NULL");
  const dopt_optim_impl *im = dopt_find_impl(name);
  if (!im) {
    char known[128] = "";
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
