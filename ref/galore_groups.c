/* GaLore parameter grouping (distopt/galore.h), as ColossalAI's
 * get_galore_param_groups. */
#include <ctype.h>
#include <stdio.h>
#include <string.h>

#include "distopt/galore.h"
#include "internal.h"

static int contains_ci(const char *s, const char *needle) {
  size_t n = strlen(needle);
  for (; *s; s++) {
    size_t i = 0;
    while (i < n && s[i] && tolower((unsigned char)s[i]) == tolower((unsigned char)needle[i])) i++;
    if (i == n) return 1;
  }
  return 0;
}

int dopt_galore_classify(const char *name, int ndim) {
  if (!name || ndim < 0) return -1;
  if (contains_ci(name, "bias") || contains_ci(name, "norm")) return DOPT_GALORE_CLASS_NODECAY;
  return ndim == 2 ? DOPT_GALORE_CLASS_GALORE : DOPT_GALORE_CLASS_DECAY;
}

dopt_status dopt_galore_add_groups(dopt_optim *o, const char *galore_overrides, int *galore_group, int *decay_group,
                                   int *nodecay_group) {
  DOPT_CHECK_ARG(o != NULL, "dopt_galore_add_groups: optimizer=NULL");
  double rank;
  if (dopt_optim_get_hparam(o, 0, "rank", &rank) != DOPT_OK)
    return dopt__fail(DOPT_ERR_INVALID_ARG, "dopt_galore_add_groups: optimizer '%s' has no GaLore 'rank' key",
                      dopt_optim_name(o));
  char buf[1024];
  int len = snprintf(buf, sizeof buf, "rank=256,update_proj_gap=200,scale=0.25,proj_type=std%s%s",
                     galore_overrides && *galore_overrides ? "," : "", galore_overrides ? galore_overrides : "");
  DOPT_CHECK_ARG(len > 0 && (size_t)len < sizeof buf, "dopt_galore_add_groups: galore_overrides too long (%d chars)",
                 len);
  int g0, g1, g2;
  DOPT_TRY(dopt_optim_add_group(o, buf, &g0));
  double r;
  DOPT_TRY(dopt_optim_get_hparam(o, g0, "rank", &r));
  DOPT_CHECK_ARG(r > 0, "dopt_galore_add_groups: galore_overrides set rank=%g; the GaLore group needs rank > 0", r);
  DOPT_TRY(dopt_optim_add_group(o, "rank=0", &g1));
  DOPT_TRY(dopt_optim_add_group(o, "rank=0,weight_decay=0", &g2));
  if (galore_group) *galore_group = g0;
  if (decay_group) *decay_group = g1;
  if (nodecay_group) *nodecay_group = g2;
  return DOPT_OK;
}
