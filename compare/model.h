/* LLaMA-shaped model descriptions shared by `distopt mem` and `distopt
 * compare --model` (docs/cli.md, "Models"): the presets of the GaLore
 * repository's configs, or a parameter count in LLaMA proportions. */
#ifndef DOPT_CMP_MODEL_H
#define DOPT_CMP_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "distopt/dist.h"
#include "distopt/distopt.h"

typedef struct cmp_model {
  char name[48];          /* "llama-130m", or the size as given ("100m", "2mx32") */
  int hidden, inter, layers, vocab;
  int galore_rank;        /* the GaLore paper's rank for this size (sizes: hidden / 4, at least 8) */
  double paper_full_gb;   /* GaLore paper Table 2: weights + states, BF16 (0: none) */
  double paper_galore_gb;
  int experts;            /* 0: dense LLaMA; E >= 1: each MLP is E experts and a router (Mixtral-shaped) */
  int separate;           /* with experts: each expert its own tensors (Hugging Face Mixtral's layout; what
                           * plugin moe_hybrid splits over ep); 0: 3-D stacks [E, ...] */
  int kv;                 /* the k and v projections' output rows (grouped-query attention); 0: hidden */
} cmp_model;

int cmp_model_npresets(void);

/* A preset name (llama-60m, llama-130m, llama-350m, llama-1b, llama-7b, mixtral-mini, mixtral-8x7b) or a size
 * COUNT[k|m|b][xLAYERS][eEXPERTS[s]]
 * (a parameter count, decimals allowed: "100m", "1.5b", "2mx32", "4mx2e8"): the hidden size (a multiple of 64)
 * whose model comes closest to the count, layers = hidden / 64 within [2, 32] unless given (1..256),
 * intermediate 8·hidden/3 rounded up to a multiple of 32, vocabulary 32000 or, where that would be more
 * than half the count, the multiple of 64 that makes embedding and head half of it (at least 64).
 * Counts from 10k to 100b; EXPERTS 1..256 (the count includes every expert), stacked, or with 's' separate
 * tensors per expert. DOPT_ERR_INVALID_ARG naming the spec and what is expected. */
dopt_status cmp_model_parse(const char *spec, cmp_model *out);

/* Its parameter tensors, in the order of Hugging Face's LlamaForCausalLM: model.embed_tokens.weight;
 * per layer N model.layers.N.self_attn.{q,k,v,o}_proj.weight, model.layers.N.mlp.{gate,up,down}_proj.weight,
 * model.layers.N.{input,post_attention}_layernorm.weight; model.norm.weight; lm_head.weight
 * (9·layers + 3 tensors). Tensor-parallel roles as Megatron: embedding and head vocab-parallel
 * (COLUMN, rows), q/k/v, gate and up COLUMN, o and down ROW, norms replicated. With E experts the layer's
 * MLP tensors are, in their place, model.layers.N.mlp.router.weight [E, h] (replicated) and the stacks
 * model.layers.N.mlp.experts.{gate,up}_proj [E, f, h] (COLUMN: each expert's rows) and
 * model.layers.N.mlp.experts.down_proj [E, h, f] (ROW: each expert's columns): 10·layers + 3 tensors; with
 * separate experts, Hugging Face Mixtral's: model.layers.N.block_sparse_moe.gate.weight [E, h] (the router,
 * replicated) and per expert e model.layers.N.block_sparse_moe.experts.e.{w1,w3}.weight [f, h] (COLUMN) and
 * .w2.weight [h, f] (ROW), the expert id in `expert`: (7 + 3·E)·layers + 3 tensors. */
int cmp_model_ntensors(const cmp_model *m);
typedef struct cmp_model_tensor {
  char name[64];
  int ndim;
  int64_t shape[3];
  dopt_tp_role role;
  int projected; /* an attention or MLP linear (what GaLore projects in the paper) */
  int expert;    /* the expert id of a separate expert's tensor; -1: dense (stacks included) */
} cmp_model_tensor;
void cmp_model_tensor_at(const cmp_model *m, int i, cmp_model_tensor *t);
double cmp_model_params(const cmp_model *m);

#endif
