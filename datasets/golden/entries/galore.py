"""GaLore around an inner optimizer: the inner=adafactor form is galore_torch 1.0's
GaLoreAdafactor (galore_torch.adafactor.Adafactor with GaLoreProjector), made by the
specialised generator gen_galore.py (its galore_adafactor_* cases, self-contained
files with the same inputs and the same one intervention as galore_adamw's: the
SVD sign convention) and checked after every step by tests/unit/test_galore.c.
Other inners have no upstream (galore_torch ships AdamW, AdamW8bit and Adafactor
only); galore_adamw and galore_adamw8bit have their own entries."""

OPTIMIZER = "galore"
UPSTREAM_LABEL = "galore-torch==1.0 (adafactor.py, galore_projector.py)"
CHECKED_BY = {"checked_by": "tests/unit/test_galore.c", "data": "datasets/golden/galore",
              "generator": "datasets/golden/gen_galore.py",
              "note": "inner=adafactor (GaLoreAdafactor); other inners have no upstream"}
