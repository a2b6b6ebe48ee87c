/* Fuzz target: the hyperparameter and group parser: the first byte picks a
 * registry optimizer, the rest up to a '\n' is its "k=v,..." string, the
 * remainder a group override; a created optimizer also takes a parameter. */
#include <string.h>

#include "distopt/optim.h"
#include "fuzzcommon.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1) return 0;
  const char *name = dopt_optim_registry_name(data[0] % dopt_optim_registry_count());
  char *text = malloc(size);
  if (!text) return 0;
  memcpy(text, data + 1, size - 1);
  text[size - 1] = '\0';
  char *group = strchr(text, '\n');
  if (group) *group++ = '\0';
  dopt_optim *o = NULL;
  if (dopt_optim_create(name, text, &o) == DOPT_OK) {
    int g = 0;
    if (group) (void)dopt_optim_add_group(o, group, &g);
    float w[6] = {0.1f, -0.2f, 0.3f, 0.4f, -0.5f, 0.6f}, gr[6] = {0.01f, 0.02f, -0.03f, 0.04f, 0.05f, -0.06f};
    dopt_param_config pc = DOPT_PARAM_CONFIG_INIT;
    pc.name = "w";
    pc.ndim = 2;
    pc.shape[0] = 2;
    pc.shape[1] = 3;
    pc.data = w;
    if (dopt_optim_add_param(o, g, &pc, NULL) == DOPT_OK) {
      const float *grads[1] = {gr};
      (void)dopt_optim_step(o, grads); /* valid hyperparameters must step without crashing */
    }
    dopt_optim_destroy(o);
  }
  free(text);
  return 0;
}
