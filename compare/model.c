/* LLaMA-shaped model descriptions (compare/model.h). */
#include "model.h"

#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* LLaMA shapes as in the GaLore repository's configs; the paper's rank and Table 2. */
static const cmp_model PRESETS[] = {
    {"llama-60m", 512, 1376, 8, 32000, 128, 0.36, 0.24, 0, 0, 0},
    {"llama-130m", 768, 2048, 12, 32000, 256, 0.76, 0.52, 0, 0, 0},
    {"llama-350m", 1024, 2736, 24, 32000, 256, 2.06, 1.22, 0, 0, 0},
    {"llama-1b", 2048, 5461, 24, 32000, 512, 7.80, 4.38, 0, 0, 0},
    {"llama-7b", 4096, 11008, 32, 32000, 1024, 0, 0, 0, 0, 0},
    /* Mixtral-shaped (Hugging Face's MixtralForCausalLM layout: separate experts, grouped-query k and v) */
    {"mixtral-mini", 64, 160, 2, 128, 16, 0, 0, 6, 1, 16},
    {"mixtral-8x7b", 4096, 14336, 32, 32000, 1024, 0, 0, 8, 1, 1024},
};
#define NPRESETS ((int)(sizeof PRESETS / sizeof PRESETS[0]))

int cmp_model_npresets(void) { return NPRESETS; }

double cmp_model_params(const cmp_model *m) {
  const double h = m->hidden, f = m->inter, v = m->vocab, L = m->layers, E = m->experts, kv = m->kv ? m->kv : h;
  const double mlp = E > 0 ? E * (3 * h * f + h) : 3 * h * f; /* the experts and the router, or one MLP */
  return 2 * v * h + L * (2 * h * h + 2 * kv * h + mlp) + (2 * L + 1) * h;
}

static int per_layer(const cmp_model *m) { return m->experts > 0 ? (m->separate ? 7 + 3 * m->experts : 10) : 9; }

int cmp_model_ntensors(const cmp_model *m) { return per_layer(m) * m->layers + 3; }

void cmp_model_tensor_at(const cmp_model *m, int i, cmp_model_tensor *t) {
  static const struct {
    const char *what;
    int kind; /* 0 [h,h], 1 [f,h], 2 [h,f], 3 [h] */
    dopt_tp_role role;
  } LAYER[9] = {{"self_attn.q_proj.weight", 0, DOPT_TP_COLUMN},   {"self_attn.k_proj.weight", 0, DOPT_TP_COLUMN},
                {"self_attn.v_proj.weight", 0, DOPT_TP_COLUMN},   {"self_attn.o_proj.weight", 0, DOPT_TP_ROW},
                {"mlp.gate_proj.weight", 1, DOPT_TP_COLUMN},      {"mlp.up_proj.weight", 1, DOPT_TP_COLUMN},
                {"mlp.down_proj.weight", 2, DOPT_TP_ROW},         {"input_layernorm.weight", 3, DOPT_TP_REPLICATED},
                {"post_attention_layernorm.weight", 3, DOPT_TP_REPLICATED}};
  const int64_t h = m->hidden, f = m->inter, v = m->vocab, kv = m->kv ? m->kv : m->hidden;
  memset(t, 0, sizeof *t);
  t->expert = -1;
  const int last = cmp_model_ntensors(m) - 1;
  if (i == 0 || i == last) { /* vocab-parallel: the rows of [vocab, hidden] */
    snprintf(t->name, sizeof t->name, "%s", i == 0 ? "model.embed_tokens.weight" : "lm_head.weight");
    t->ndim = 2, t->shape[0] = v, t->shape[1] = h, t->role = DOPT_TP_COLUMN;
    return;
  }
  if (i == last - 1) {
    snprintf(t->name, sizeof t->name, "model.norm.weight");
    t->ndim = 1, t->shape[0] = h, t->role = DOPT_TP_REPLICATED;
    return;
  }
  const int layer = (i - 1) / per_layer(m), k = (i - 1) % per_layer(m), E3 = 3 * m->experts;
  if (m->experts > 0 && m->separate && k >= 4 && k <= 4 + E3) { /* Mixtral's block_sparse_moe: router, experts */
    if (k == 4) {
      snprintf(t->name, sizeof t->name, "model.layers.%d.block_sparse_moe.gate.weight", layer);
      t->ndim = 2, t->shape[0] = m->experts, t->shape[1] = h, t->role = DOPT_TP_REPLICATED;
      return;
    }
    const int e = (k - 5) / 3, w = (k - 5) % 3; /* w1 [f, h], w2 [h, f], w3 [f, h] */
    snprintf(t->name, sizeof t->name, "model.layers.%u.block_sparse_moe.experts.%u.w%u.weight", (unsigned short)layer,
             (unsigned short)e, (unsigned char)(w + 1)); /* layers and experts <= 256 */
    t->ndim = 2, t->shape[0] = w == 1 ? h : f, t->shape[1] = w == 1 ? f : h;
    t->role = w == 1 ? DOPT_TP_ROW : DOPT_TP_COLUMN, t->projected = 1, t->expert = e;
    return;
  }
  if (m->experts > 0 && !m->separate && k >= 4 && k <= 7) { /* the MoE block in the MLP's place: router, then the stacks */
    static const char *const WHAT[4] = {"mlp.router.weight", "mlp.experts.gate_proj", "mlp.experts.up_proj",
                                        "mlp.experts.down_proj"};
    const int64_t E = m->experts;
    snprintf(t->name, sizeof t->name, "model.layers.%d.%s", layer, WHAT[k - 4]);
    if (k == 4) t->ndim = 2, t->shape[0] = E, t->shape[1] = h, t->role = DOPT_TP_REPLICATED;
    else if (k < 7) t->ndim = 3, t->shape[0] = E, t->shape[1] = f, t->shape[2] = h, t->role = DOPT_TP_COLUMN;
    else t->ndim = 3, t->shape[0] = E, t->shape[1] = h, t->shape[2] = f, t->role = DOPT_TP_ROW;
    return; /* not projected: GaLore's projection is for matrices */
  }
  const int kk = m->experts > 0 && k > 7 ? k - (m->separate ? E3 - 2 : 1) : k; /* the norms after the MoE block */
  snprintf(t->name, sizeof t->name, "model.layers.%d.%s", layer, LAYER[kk].what);
  t->role = LAYER[kk].role;
  t->projected = LAYER[kk].kind != 3;
  switch (LAYER[kk].kind) {
  case 0: t->ndim = 2, t->shape[0] = kk == 1 || kk == 2 ? kv : h, t->shape[1] = h; break;
  case 1: t->ndim = 2, t->shape[0] = f, t->shape[1] = h; break;
  case 2: t->ndim = 2, t->shape[0] = h, t->shape[1] = f; break;
  default: t->ndim = 1, t->shape[0] = h; break;
  }
}

/* The model of hidden size h for a count n (layers: 0 = from h). */
static cmp_model sized(int h, int layers, int experts, double n) {
  cmp_model m;
  memset(&m, 0, sizeof m);
  m.hidden = h;
  m.experts = experts;
  m.layers = layers ? layers : h / 64 < 2 ? 2 : h / 64 > 32 ? 32 : h / 64;
  m.inter = 32 * (int)ceil(8.0 * h / (3.0 * 32));
  m.vocab = 32000;
  if (2.0 * m.vocab * h > n / 2) { /* the embedding and head half of the count */
    const double v = floor(n / (4.0 * h) / 64) * 64;
    m.vocab = v < 64 ? 64 : (int)v;
  }
  m.galore_rank = h / 4 < 8 ? 8 : h / 4;
  return m;
}

/* After a one-letter tag at *p: 1..256 in decimal digits only; *p moves past them. */
static int small_int(char **p, long *v) {
  const char *q = *p + 1;
  long x = 0;
  int nd = 0;
  while (*q >= '0' && *q <= '9' && nd < 4) x = x * 10 + (*q++ - '0'), nd++;
  if (nd == 0 || (*q >= '0' && *q <= '9') || x < 1 || x > 256) return 0;
  *p = (char *)(uintptr_t)q;
  *v = x;
  return 1;
}

dopt_status cmp_model_parse(const char *spec, cmp_model *out) {
  DOPT_CHECK_ARG(spec != NULL && out != NULL, "cmp_model_parse: spec=%p out=%p", (const void *)spec, (void *)out);
  for (int k = 0; k < NPRESETS; k++)
    if (strcmp(PRESETS[k].name, spec) == 0) {
      *out = PRESETS[k];
      return DOPT_OK;
    }
  const char *why = "expected a preset (llama-60m, llama-130m, llama-350m, llama-1b, llama-7b, mixtral-mini, "
                    "mixtral-8x7b) or a parameter count COUNT[k|m|b][xLAYERS][eEXPERTS[s]] from 10k to 100b, e.g. "
                    "100m, 1.5b, 2mx32, 4mx2e8, 4mx2e8s (s: separate expert tensors)";
  /* COUNT: digits with at most one '.', read by strtod on that span only (no sign, space or exponent: an 'e'
   * after the count names experts) */
  size_t nd = 0, dots = 0;
  while ((spec[nd] >= '0' && spec[nd] <= '9') || (spec[nd] == '.' && dots++ == 0)) nd++;
  char num[32];
  if (nd == 0 || nd >= sizeof num) return dopt__fail(DOPT_ERR_INVALID_ARG, "--model '%.60s': %s", spec, why);
  memcpy(num, spec, nd);
  num[nd] = '\0';
  char *end = NULL;
  errno = 0;
  const double x = strtod(num, &end);
  double n = x;
  if (*end != '\0' || errno != 0 || !(x > 0)) return dopt__fail(DOPT_ERR_INVALID_ARG, "--model '%.60s': %s", spec, why);
  end = (char *)(uintptr_t)(spec + nd);
  switch (*end) {
  case 'k': case 'K': n *= 1e3, end++; break;
  case 'm': case 'M': n *= 1e6, end++; break;
  case 'b': case 'B': n *= 1e9, end++; break;
  default: break;
  }
  long layers = 0, experts = 0;
  if (*end == 'x' && !small_int(&end, &layers))
    return dopt__fail(DOPT_ERR_INVALID_ARG, "--model '%.60s': layers after 'x' must be 1..256", spec);
  if (*end == 'e' && !small_int(&end, &experts))
    return dopt__fail(DOPT_ERR_INVALID_ARG, "--model '%.60s': experts after 'e' must be 1..256", spec);
  const int separate = experts > 0 && *end == 's';
  end += separate;
  if (*end != '\0' || !(n >= 1e4 && n <= 1e11))
    return dopt__fail(DOPT_ERR_INVALID_ARG, "--model '%.60s': %s", spec, why);
  cmp_model best;
  double err = INFINITY;
  for (int h = 64; h <= 16384; h += 64) {
    const cmp_model m = sized(h, (int)layers, (int)experts, n);
    const double e = fabs(cmp_model_params(&m) - n);
    if (e < err) err = e, best = m;
  }
  best.separate = separate;
  snprintf(best.name, sizeof best.name, "%s", spec);
  *out = best;
  return DOPT_OK;
}
