/* The plugins' layouts (ColossalAI's booster names; docs/distributed.md "Plugins"): the one table that
 * dopt_dist_check_layout judges by and that the CLI reads for what a plugin implies. */
#include <stdio.h>
#include <string.h>

#include "dist_internal.h"

static const dopt_dist_plugin PLUGINS[] = {
    {"ddp", 1, 0, 0, 0, "tensor parallelism is hybrid or fsdp, ZeRO 1-2 the zero plugin"},
    {"zero", 1, 1, 2, 1, "tensor parallelism is hybrid or fsdp, zero 0 ddp"},
    {"hybrid", 0, 0, 2, 2, "zero 3 is the fsdp plugin"},
    {"fsdp", 0, 3, 3, 3, "zero 0-2 is the hybrid plugin"},
    {"gemini", 0, 3, 3, 3, "its chunks are sharded (ZeRO-3); zero 0-2 is the hybrid plugin"},
    {"moe_hybrid", 0, 0, 2, 2, "as ColossalAI's MoeHybridParallelPlugin; zero 3 is the fsdp plugin; its experts go over ep"},
};
enum { NPLUGINS = (int)(sizeof PLUGINS / sizeof PLUGINS[0]) };

const dopt_dist_plugin *dopt_dist_plugin_at(int i) { return i >= 0 && i < NPLUGINS ? &PLUGINS[i] : NULL; }

const dopt_dist_plugin *dopt_dist_plugin_find(const char *name) {
  for (int i = 0; name && i < NPLUGINS; i++)
    if (strcmp(PLUGINS[i].name, name) == 0) return &PLUGINS[i];
  return NULL;
}

int dopt_dist_plugin_allows(const dopt_dist_plugin *p, int tp, int zero) {
  return p && (!p->tp_one || tp == 1) && zero >= p->zero_lo && zero <= p->zero_hi;
}

dopt_status dopt_dist_check_layout(const char *plugin, int tp, int dp, int zero) {
  DOPT_CHECK_ARG(tp >= 1 && dp >= 1, "layout: tp=%d dp=%d must be >= 1", tp, dp);
  DOPT_CHECK_ARG(zero >= 0 && zero <= 3, "layout: zero_stage=%d outside [0, 3]", zero);
  const dopt_dist_plugin *p = dopt_dist_plugin_find(plugin);
  if (!p) {
    char names[128] = "";
    for (int i = 0; i < NPLUGINS; i++)
      strncat(names, PLUGINS[i].name, sizeof names - strlen(names) - 3), strcat(names, i + 1 < NPLUGINS ? ", " : "");
    return dopt__fail(DOPT_ERR_NOT_FOUND, "unknown plugin '%s' (%s)", plugin ? plugin : "", names);
  }
  if (dopt_dist_plugin_allows(p, tp, zero)) return DOPT_OK;
  char zs[32];
  if (p->zero_lo == p->zero_hi) snprintf(zs, sizeof zs, "zero=%d", p->zero_lo);
  else snprintf(zs, sizeof zs, "zero %d-%d", p->zero_lo, p->zero_hi);
  return dopt__fail(DOPT_ERR_INVALID_ARG, "plugin %s: needs %s%s (got tp=%d zero=%d; %s)", p->name,
                    p->tp_one ? "tp=1 and " : "", zs, tp, zero, p->hint);
}
