"""GaLore-AdamW: golden vectors from galore_torch 1.0 (galore_torch.adamw.AdamW with
GaLoreProjector), made by the specialised generator gen_galore.py (self-contained
files with their own inputs, one intervention: the SVD sign convention) and
checked after every step by tests/unit/test_galore.c. Its case galore_defaults is the
defaults-only case (upstream's constructor defaults, distopt with no hyperparameters)."""

OPTIMIZER = "galore_adamw"
UPSTREAM_LABEL = "galore-torch==1.0 (adamw.py, galore_projector.py)"
CHECKED_BY = {"checked_by": "tests/unit/test_galore.c", "data": "datasets/golden/galore",
              "generator": "datasets/golden/gen_galore.py"}
