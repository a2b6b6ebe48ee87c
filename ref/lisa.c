/* LISA (Layerwise Importance Sampled AdamW) as LMFlow's
 * DynamicLayerActivationCallback (docs/lisa.md), wrapping any registered
 * optimizer. Parameters carry a layer index (dopt_param_config.layer); -1
 * (embeddings, final norm, head) is always trained. At 0-based global steps
 * 0, K, 2K, ... (K = interval) n_layers of the L distinct layer indices >= 0
 * are sampled uniformly without replacement from a counter-based generator
 * keyed (seed, interval index), so every rank draws the same set without
 * communication. Parameters of the other layers are frozen: skipped exactly as
 * a NULL gradient (no decay, no state change, no step count change).
 * reset_states=false keeps a visited layer's state forever (LMFlow);
 * reset_states=true frees every layer's state at each interval start, so a
 * layer restarts from zeros and step 0 each time it is sampled (the paper's
 * per-period runs). The selection is recomputed each step from the
 * registered parameters: register all of them before the first step.
 * docs/lisa.md. */
#include <math.h>
#include <stdlib.h>

#include "lisa_sample.h"
#include "registry.h"

enum { INNER, N_LAYERS, INTERVAL, SEED, RESET_STATES, NHP };

static const dopt_hp_def hps[NHP] = {
    [INNER] = {"inner", DOPT_HP_ENUM, 0.0, "the wrapped optimizer, any registered one but a wrapper (its keys are passed through)",
                dopt__registry_names},
    [N_LAYERS] = {"n_layers", DOPT_HP_INT, 2.0, "layers trained per interval (LMFlow lisa_activated_layers)", NULL},
    [INTERVAL] = {"interval", DOPT_HP_INT, 20.0, "steps between samplings (LMFlow lisa_interval_steps)", NULL},
    [SEED] = {"seed", DOPT_HP_INT, 0.0, "layer-sampling generator seed (inner.seed: the inner optimizer's)", NULL},
    [RESET_STATES] = {"reset_states", DOPT_HP_BOOL, 0.0, "free layer states each interval (false = LMFlow: keep)",
                      NULL},
};

static int is_int(double v, double lo, double hi) { return v == floor(v) && v >= lo && v <= hi; }

static const dopt_optim_impl *inner(const double *whp) { return dopt_find_impl(dopt__registry_names[(int)whp[INNER]]); }

static dopt_status validate(const double *hp) {
  const dopt_optim_impl *in = inner(hp);
  if (!in || in->wrap)
    return dopt__fail(DOPT_ERR_INVALID_ARG, "lisa: inner=%s is a wrapper; choose an optimizer that steps itself",
                      dopt__registry_names[(int)hp[INNER]]);
  if (!is_int(hp[N_LAYERS], 0, 1e6))
    return dopt__fail(DOPT_ERR_INVALID_ARG, "lisa: n_layers=%g must be an integer >= 0", hp[N_LAYERS]);
  if (!is_int(hp[INTERVAL], 1, 1e15))
    return dopt__fail(DOPT_ERR_INVALID_ARG, "lisa: interval=%g must be an integer >= 1", hp[INTERVAL]);
  if (!is_int(hp[SEED], 0, 9007199254740992.0))
    return dopt__fail(DOPT_ERR_INVALID_ARG, "lisa: seed=%g must be an integer in [0, 2^53]", hp[SEED]);
  return DOPT_OK;
}


static int cmp_int(const void *x, const void *y) {
  int a = *(const int *)x, b = *(const int *)y;
  return (a > b) - (a < b);
}

static dopt_status schedule(const double *whp, int64_t gstep, int np, const int *layer, unsigned char *frozen,
                            int *reset) {
  const int64_t K = (int64_t)whp[INTERVAL];
  /* L: the distinct layer indices >= 0, ascending */
  int *layers = malloc((size_t)(np ? np : 1) * 3 * sizeof *layers), L = 0;
  if (!layers) return dopt__fail(DOPT_ERR_NO_MEMORY, "lisa: %d parameters", np);
  for (int i = 0; i < np; i++)
    if (layer[i] >= 0) layers[L++] = layer[i];
  qsort(layers, (size_t)L, sizeof *layers, cmp_int);
  int u = 0;
  for (int i = 0; i < L; i++)
    if (u == 0 || layers[i] != layers[u - 1]) layers[u++] = layers[i];
  L = u;
  int k = (int)whp[N_LAYERS] < L ? (int)whp[N_LAYERS] : L, *ws = layers + np, *pick = layers + 2 * np;
  dopt_lisa_sample((uint64_t)whp[SEED], gstep / K, L, k, ws, pick);
  for (int j = 0; j < k; j++) pick[j] = layers[pick[j]]; /* positions -> layer indices */
  for (int i = 0; i < np; i++) {
    int active = layer[i] < 0;
    for (int j = 0; !active && j < k; j++) active = pick[j] == layer[i];
    frozen[i] = (unsigned char)!active;
  }
  *reset = whp[RESET_STATES] != 0.0 && gstep % K == 0;
  free(layers);
  return DOPT_OK;
}

static const dopt_wrap_ops wrap = {inner, schedule};

/* settings that exercise every path (dopt_optim_impl.example/grid): a piecewise and an owner-mode inner optimizer, kept and reset states */
static const char *const grid[] = {
    "inner=adamw,n_layers=1,interval=7,lr=1e-2",
    "inner=galore_adamw,rank=3,update_proj_gap=5,n_layers=2,interval=11,reset_states=true",
    "inner=adafactor,n_layers=2,interval=9",
    NULL,
};

const dopt_optim_impl dopt_impl_lisa = {
    .name = "lisa",
    .summary = "LISA as LMFlow (n_layers of the middle layers sampled each interval) around any optimizer",
    .hp = hps,
    .nhp = NHP,
    .validate = validate,
    .layout = NULL,
    .step = NULL,
    .distributable = 0,
    .wrap = &wrap,
    .example = "inner=adamw,n_layers=1,interval=2",
    .grid = grid,
    .grid_ci = 2,
};
