"""GaLore-AdamW8bit: galore_torch 1.0's GaLoreAdamW8bit (bitsandbytes inside)."""

OPTIMIZER = "galore_adamw8bit"
UPSTREAM_LABEL = "galore-torch==1.0 GaLoreAdamW8bit + bitsandbytes (CUDA)"
EXEMPT = """its step is bitsandbytes' CUDA-only 8-bit Adam on the low-rank gradient (see
adamw8bit); the projector is galore_adamw's (golden: datasets/golden/galore) and
rank-0 groups equal adamw8bit bit for bit (tests/unit/test_galore8bit.c)."""
