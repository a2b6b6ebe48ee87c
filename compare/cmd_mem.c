/* distopt mem: exact optimizer-state memory of a model description, per
 * registered optimizer, from the optimizers' own state layouts
 * (dopt_optim_state_bytes_for), compared with the GaLore paper's figures. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"

static const char *const CMD = "mem";

/* LLaMA shapes as in the GaLore repository's configs. */
typedef struct model {
  const char *name;
  int hidden, inter, layers, vocab;
  int galore_rank;      /* the paper's rank for this size */
  double paper_full_gb; /* GaLore paper Table 2: weights + states, BF16 (0: none) */
  double paper_galore_gb;
} model;

static const model MODELS[] = {
    {"llama-60m", 512, 1376, 8, 32000, 128, 0.36, 0.24},   {"llama-130m", 768, 2048, 12, 32000, 256, 0.76, 0.52},
    {"llama-350m", 1024, 2736, 24, 32000, 256, 2.06, 1.22}, {"llama-1b", 2048, 5461, 24, 32000, 512, 7.80, 4.38},
    {"llama-7b", 4096, 11008, 32, 32000, 1024, 0, 0},
};
#define NMODELS ((int)(sizeof MODELS / sizeof MODELS[0]))

typedef struct pclass {
  const char *what;
  int ndim;
  int64_t shape[2];
  long count;
  int projected; /* GaLore applies (attention and MLP linears, as the paper) */
} pclass;

static int classes(const model *m, pclass *c) {
  int n = 0;
  int64_t h = m->hidden, f = m->inter, v = m->vocab;
  long L = m->layers;
  c[n++] = (pclass){"embed + lm_head", 2, {v, h}, 2, 0};
  c[n++] = (pclass){"attn q,k,v,o", 2, {h, h}, 4 * L, 1};
  c[n++] = (pclass){"mlp gate,up", 2, {f, h}, 2 * L, 1};
  c[n++] = (pclass){"mlp down", 2, {h, f}, L, 1};
  c[n++] = (pclass){"norms", 1, {h, 0}, 2 * L + 1, 0};
  return n;
}

/* Total state bytes of the model for one optimizer; -1 if unavailable. */
static double model_state_bytes(const model *m, const char *opt, const char *hp, int rank, int *ok) {
  pclass c[8];
  int n = classes(m, c), galore = strstr(opt, "galore") != NULL;
  double total = 0;
  *ok = 1;
  for (int i = 0; i < n; i++) {
    char h[256];
    if (galore) snprintf(h, sizeof h, "%s%srank=%d", hp ? hp : "", hp && hp[0] ? "," : "", c[i].projected ? rank : 0);
    else snprintf(h, sizeof h, "%s", hp ? hp : "");
    size_t b;
    if (dopt_optim_state_bytes_for(opt, h, c[i].ndim, c[i].shape, &b) != DOPT_OK) {
      *ok = 0;
      return -1;
    }
    total += (double)b * (double)c[i].count;
  }
  return total;
}

static double model_params(const model *m) {
  pclass c[8];
  int n = classes(m, c);
  double p = 0;
  for (int i = 0; i < n; i++) p += (double)c[i].shape[0] * (double)(c[i].ndim > 1 ? c[i].shape[1] : 1) * (double)c[i].count;
  return p;
}

int cmd_mem(int argc, char **argv) {
  const char *which = "llama-7b";
  int rank = 0;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
      printf("usage: distopt mem [--model llama-60m|llama-130m|llama-350m|llama-1b|llama-7b] [--rank R]\n"
             "  exact optimizer-state bytes of the model for every registered optimizer (GaLore on the\n"
             "  attention/MLP linears with rank R, default the paper's rank for the size), and the GaLore\n"
             "  paper's weights+states figures (BF16) next to the same accounting here.\n");
      return CLI_OK;
    }
    if (i + 1 >= argc) return cli_errorf(CMD, "option '%s' needs a value (or is unknown)", argv[i]);
    if (strcmp(argv[i], "--model") == 0) which = argv[++i];
    else if (strcmp(argv[i], "--rank") == 0) {
      rank = atoi(argv[++i]);
      if (rank <= 0) return cli_errorf(CMD, "--rank '%s': expected a positive integer", argv[i]);
    } else return cli_errorf(CMD, "unknown option '%s' (see --help)", argv[i]);
  }
  const model *m = NULL;
  for (int i = 0; i < NMODELS; i++)
    if (strcmp(MODELS[i].name, which) == 0) m = &MODELS[i];
  if (!m) return cli_errorf(CMD, "--model '%s': unknown (llama-60m, llama-130m, llama-350m, llama-1b, llama-7b)", which);
  if (rank == 0) rank = m->galore_rank;
  const double params = model_params(m), gib = 1024.0 * 1024.0 * 1024.0;
  printf("%s: %.3f B parameters (hidden %d, intermediate %d, %d layers, vocab %d); weights %.2f GiB bf16, %.2f GiB fp32\n",
         m->name, params / 1e9, m->hidden, m->inter, m->layers, m->vocab, params * 2 / gib, params * 4 / gib);
  printf("%-18s %-22s %12s %10s %10s\n", "optimizer", "hyperparameters", "states GiB", "B/param", "vs adamw");
  int okw;
  double adamw = model_state_bytes(m, "adamw", "", rank, &okw);
  char hp[64];
  for (int k = 0; k < dopt_optim_registry_count(); k++) {
    const char *name = dopt_optim_registry_name(k);
    const char *h = strcmp(name, "came") == 0 ? "lr=1e-4" : "";
    int ok;
    double b = model_state_bytes(m, name, h, rank, &ok);
    if (!ok) {
      printf("%-18s %-22s %12s\n", name, h, "n/a");
      continue;
    }
    snprintf(hp, sizeof hp, "%s", h);
    if (strstr(name, "galore")) snprintf(hp, sizeof hp, "rank=%d (attn+mlp)", rank);
    if (strcmp(name, "lisa") == 0) snprintf(hp, sizeof hp, "adamw, all layers seen");
    printf("%-18s %-22s %12.2f %10.2f %9.1f%%\n", name, hp, b / gib, b / params, okw ? 100.0 * b / adamw : 0.0);
  }
  /* the GaLore paper's Table 2 accounting: BF16 weights and states (2 bytes) */
  if (m->paper_full_gb > 0) {
    int ok1, ok2;
    double full = params * 2 + adamw / 2; /* fp32 states here -> bf16 */
    double gal = model_state_bytes(m, "galore_adamw", "", rank, &ok2);
    (void)ok1;
    printf("\nGaLore paper, Table 2 (weights + optimizer states, BF16, %s, rank %d):\n", m->name, rank);
    printf("  full-rank Adam: paper %.2f G, here %.2f G\n", m->paper_full_gb, full / 1e9);
    if (ok2) printf("  GaLore:         paper %.2f G, here %.2f G\n", m->paper_galore_gb, (params * 2 + gal / 2) / 1e9);
    else printf("  GaLore:         paper %.2f G (galore_adamw not registered in this build)\n", m->paper_galore_gb);
  }
  return CLI_OK;
}
