"""Adafactor: HF transformers 4.36.2 transformers.optimization.Adafactor."""

OPTIMIZER = "adafactor"
# transformers with --no-deps, plus what `import transformers.optimization`
# needs at import time (its runtime dependency-version check); none of these
# touch optimizer math
PINS = ["transformers==4.36.2", "huggingface-hub==0.20.1", "tqdm==4.66.1", "regex==2023.12.25",
        "packaging==23.2", "filelock==3.13.1", "fsspec==2023.12.2", "safetensors==0.4.1"]
UPSTREAM = ["transformers"]

HPARAMS = {"lr": "lr", "eps1": ("eps", 0), "eps2": ("eps", 1), "clip_threshold": "clip_threshold",
           "decay_rate": "decay_rate", "beta1": "beta1", "weight_decay": "weight_decay",
           "scale_parameter": "scale_parameter", "relative_step": "relative_step",
           "warmup_init": "warmup_init"}
# None = not set (omitted from the hparams string; distopt's optional keys)
DEFAULTS = dict(lr=None, eps1=1e-30, eps2=1e-3, clip_threshold=1.0, decay_rate=-0.8,
                beta1=None, weight_decay=0.0, scale_parameter=True,
                relative_step=True, warmup_init=False)
REQUIRED = []
STATES = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "exp_avg_sq_row": "exp_avg_sq_row",
          "exp_avg_sq_col": "exp_avg_sq_col", "RMS": "RMS"}


def build(ctx, params, kwargs):
    from transformers.optimization import Adafactor
    return Adafactor(params, **kwargs)


CASES = [
    dict(name="adafactor_default"),
    dict(name="adafactor_beta1_wd", hparams=dict(beta1=0.9, weight_decay=0.01)),
    dict(name="adafactor_warmup", hparams=dict(warmup_init=True)),
    dict(name="adafactor_noscale", hparams=dict(scale_parameter=False)),
    dict(name="adafactor_lr", hparams=dict(relative_step=False, lr=1e-2, scale_parameter=False)),
    dict(name="adafactor_lr_scale", hparams=dict(relative_step=False, lr=1e-2)),
    dict(name="adafactor_clip", hparams=dict(relative_step=False, lr=1e-1, clip_threshold=0.5,
                                             decay_rate=-0.5)),
    dict(name="adafactor_groups",
         groups=[(["vec", "small"], dict(weight_decay=0.0)),
                 (["row", "tall", "wide", "sq", "t3", "zeros"], dict(weight_decay=0.05, beta1=0.9))]),
    # Adafactor(params): relative step, parameter scaling, no momentum
    dict(name="adafactor_defaults", defaults_only=True, record_every=2),
    dict(name="adafactor_long", inputs="long", steps=200, record_every=10,
         hparams=dict(beta1=0.9, weight_decay=0.01),
         # 200 steps (every 10th recorded), all params but `wide`. Measured against
         # ref/adafactor.c (test_golden): params 1.5e-7, states 3.3e-7 normwise over all
         # recorded steps -- the per-step roundings do not build up here -- so the
         # 20-step tolerances hold with margins 6.7x and 30x
         tol_param=1e-6, tol_state=1e-5),
]
