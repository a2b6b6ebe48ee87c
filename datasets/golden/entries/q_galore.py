"""Q-GaLore: q_galore_torch 1.0's pure-torch parts -- the projector quantiser and the
lazy subspace refresh (quant.safetensors, lazy_*.safetensors) -- made by
gen_qgalore.py and checked by tests/unit/test_qgalore.c. The optimizer step itself
is bitsandbytes' CUDA 8-bit Adam (see adamw8bit.py and docs/q_galore.md): no CPU
upstream step exists."""

OPTIMIZER = "q_galore"
UPSTREAM_LABEL = "q-galore-torch==1.0 (q_galore_projector.py, quantisation)"
CHECKED_BY = {"checked_by": "tests/unit/test_qgalore.c", "data": "datasets/golden/qgalore",
              "generator": "datasets/golden/gen_qgalore.py",
              "note": "quantiser and lazy projector refresh; the 8-bit Adam step is CUDA-only upstream"}
