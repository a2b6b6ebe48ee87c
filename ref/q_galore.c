/* Q-GaLore as VITA-Group/Q-GaLore's q_galore_torch (QGaLoreAdamW8bit with
 * GaLoreProjector(quant=...); docs/q_galore.md), fp32 parameters: the GaLore
 * projection (ref/galore.c) with inner adamw8bit fixed and Q-GaLore's
 * projector always on, i.e. galore(inner=adamw8bit, lazy_refresh=true,
 * proj_quant=true) under its own name, keys and defaults:
 *   - a quantised projector (asymmetric min-max, int4 or int8, groups;
 *     int4 packed two per byte unless int4_packed=false), dequantised on
 *     every use;
 *   - the lazy subspace refresh: at a refresh the cosine similarity of the
 *     new first singular vector with the previous one is pushed into a FIFO
 *     of queue_size; a full queue with mean >= cos_threshold multiplies the
 *     parameter's gap by gamma_proj (int()); the queue is never cleared;
 *   - optional INT8 weights (int8_weights=true): the weight is held as uint8
 *     codes with per-group (weight_group_size of the row-major flattened
 *     weight) scales/zeros as optimizer state, dequantised before the step
 *     and re-gridded after it with stochastic rounding keyed (seed, step,
 *     parameter index, element index); the fp32 parameter the caller sees is
 *     the dequantised weight.
 * Only proj_type std exists upstream (asserted there), so it is the only one
 * here; the SVD is the exact one of ref/galore_proj.c. Groups with rank = 0
 * and non-matrix parameters are plain AdamW8bit (no INT8 weights, as
 * upstream keeps embeddings, norms and the head in bf16). */
#include "galore_proj.h"
#include "registry.h"

/* hp[0..7] are AdamW8bit's (shared validation, layout and kernel), then rank, gap, scale, Q-GaLore's keys, seed */
enum { RANK = DOPT_ADAMW8BIT_NHP, QUANT = RANK + 3, SEED = QUANT + DOPT_GQ_COUNT, NHP };

static const dopt_hp_def hps[NHP] = {
    DOPT_GALORE8_HPS(2048, "8-bit state block (2048 = bnb 0.43.1, Q-GaLore's pin)"),
    DOPT_GALORE_HPS_CORE("projection rank (0 = plain AdamW8bit for this group)",
                         "initial refresh gap (grows by gamma_proj, lazy rule)"),
    DOPT_GALORE_HPS_QUANT(1.0),
    [SEED] = {"seed", DOPT_HP_INT, 0.0, "stochastic rounding generator seed", NULL},
};

/* the projection with inner adamw8bit; the projector keys are rank, gap, scale (std, exact), always lazy */
static dopt_galore_spec spec(const double *hp) {
  (void)hp;
  dopt_galore_spec sp = {"q_galore", &dopt_impl_adamw8bit, 0, RANK, 3, -1, -1, NULL, QUANT, -1, SEED};
  dopt_galore_spec_keys(&sp);
  return sp;
}

static dopt_status validate(const double *hp) {
  DOPT_TRY(dopt__adamw8bit_validate("q_galore", hp));
  dopt_galore_spec sp = spec(hp);
  return dopt_galore_validate(&sp, hp);
}
DOPT_GALORE_FORM_FUNCTIONS

/* settings that exercise every path (dopt_optim_impl.example/grid): lazy refreshes, INT8 weights, 8-bit projector */
static const char *const grid[] = {
    "lr=1e-2,rank=3,update_proj_gap=5,proj_group_size=-1,int8_weights=true,weight_group_size=1",
    "lr=1e-2,rank=4,update_proj_gap=3,proj_group_size=-1,proj_bits=8",
    NULL,
};

const dopt_optim_impl dopt_impl_q_galore = {
    .name = "q_galore",
    .summary = "Q-GaLore as q_galore_torch (quantised projector, lazy refresh, optional INT8 weights, 8-bit Adam)",
    .hp = hps,
    .nhp = NHP,
    DOPT_GALORE_FORM_IMPL,
    .example = "rank=4,update_proj_gap=2,proj_group_size=-1",
    .grid = grid,
};
