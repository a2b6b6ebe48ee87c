"""AdamW8bit: bitsandbytes' AdamW8bit."""

OPTIMIZER = "adamw8bit"
UPSTREAM_LABEL = "bitsandbytes 0.43.1 / 0.45.5 AdamW8bit (CUDA)"
EXEMPT = """bitsandbytes' 8-bit optimizer step exists only as a CUDA kernel (its CPU
backend is a different algorithm, docs/adamw8bit.md), so no CPU run can record it.
gen_bnb_cuda.py records real CUDA runs on a GPU machine (not yet run);
bnb_maps.safetensors (gen_bnb.py, the dynamic maps, bit for bit) is checked by
tests/unit/test_quant8.c and the kernel by tests/unit/test_adamw8bit.c against a
float64 model of it."""
