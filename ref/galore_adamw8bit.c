/* GaLore-AdamW8bit as galore_torch's GaLoreAdamW8bit (adamw8bit.py on
 * bitsandbytes' blockwise 8-bit Adam; docs/galore.md), fp32 parameters: the
 * GaLore projection (ref/galore.c) with inner adamw8bit fixed, i.e.
 * galore(inner=adamw8bit) under its own name and keys. For a matrix in a
 * group with rank > 0 the 8-bit (or, below min_8bit_size *of the low-rank
 * size*, fp32) Adam kernel steps a zero low-rank parameter U with decay off,
 * P ← P + scale·project_back(U), then P ← P + (−lr·wd)·P; rank 0 and
 * non-matrix parameters are plain AdamW8bit. */
#include "distopt/quant8.h"
#include "galore_proj.h"
#include "registry.h"

/* hp[0..7] are AdamW8bit's, then the projector's */
enum { PROJ = DOPT_ADAMW8BIT_NHP, NHP = PROJ + DOPT_GP_COUNT };

static const dopt_hp_def hps[NHP] = {
    DOPT_GALORE8_HPS(DOPT_Q8_BLOCK_DEFAULT, "quantisation block (256; 2048 = bnb <= 0.43)"),
    DOPT_GALORE_HPS_CORE("projection rank (0 = plain AdamW8bit for this group)", DOPT_GALORE_GAP_DOC),
    DOPT_GALORE_HPS_SVD,
};

static dopt_galore_spec spec(const double *hp) {
  (void)hp;
  dopt_galore_spec sp = {"galore_adamw8bit", &dopt_impl_adamw8bit, 0, PROJ, DOPT_GP_COUNT, -1, -1, NULL, -1, -1, -1};
  dopt_galore_spec_keys(&sp);
  return sp;
}

static dopt_status validate(const double *hp) {
  DOPT_TRY(dopt__adamw8bit_validate("galore_adamw8bit", hp));
  dopt_galore_spec sp = spec(hp);
  return dopt_galore_validate(&sp, hp);
}
DOPT_GALORE_FORM_FUNCTIONS

/* settings that exercise every path (dopt_optim_impl.example/grid): low rank, refreshes, 8-bit states on the projected moments */
static const char *const grid[] = {
    "lr=1e-2,rank=3,update_proj_gap=9,min_8bit_size=8,block_size=256,proj_type=left",
    NULL,
};

const dopt_optim_impl dopt_impl_galore_adamw8bit = {
    .name = "galore_adamw8bit",
    .summary = "GaLore-AdamW8bit as galore_torch (bitsandbytes 8-bit Adam on the low-rank projected gradient)",
    .hp = hps,
    .nhp = NHP,
    DOPT_GALORE_FORM_IMPL,
    .example = "rank=4,update_proj_gap=2,min_8bit_size=64",
    .grid = grid,
};
