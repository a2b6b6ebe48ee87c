"""torch_adafactor: torch's own torch.optim.Adafactor (torch >= 2.5), on the project's torch-2 venv.

The upstream is torch itself: the pinned PyPI torch of cmake/torch2.sh (no other package). On the CPU,
Adafactor's foreach=None takes the single-tensor step (_single_tensor_adafactor), the one ref/torch_adafactor.c
follows; maximize (a sign flip of the gradient) is not a distopt key: distopt.record refuses maximize=True.
"""

OPTIMIZER = "torch_adafactor"
TORCH = "2"
PINS = []
UPSTREAM = ["torch"]

HPARAMS = {"lr": "lr", "beta2_decay": "beta2_decay", "eps1": ("eps", 0), "eps2": ("eps", 1), "d": "d",
           "weight_decay": "weight_decay"}
# None = not set (eps1: torch.finfo(p.dtype).eps, fp32's here)
DEFAULTS = dict(lr=1e-2, beta2_decay=-0.8, eps1=None, eps2=1e-3, d=1.0, weight_decay=0.0)
REQUIRED = []
STATES = {"row_var": "row_var", "col_var": "col_var", "variance": "variance"}


def build(ctx, params, kwargs):
    import torch
    return torch.optim.Adafactor(params, **kwargs)


CASES = [
    dict(name="torch_adafactor_default"),
    dict(name="torch_adafactor_wd", hparams=dict(weight_decay=0.05, beta2_decay=-0.5)),
    # eps1 large enough to clamp the row normaliser and the variance of the small gradients; a clip above 1
    dict(name="torch_adafactor_eps_clip", hparams=dict(lr=0.05, eps1=1e-3, eps2=1e-2, d=2.0)),
    dict(name="torch_adafactor_groups",
         groups=[(["vec", "small", "t3"], dict(weight_decay=0.0)),
                 (["row", "tall", "wide", "sq", "zeros"], dict(weight_decay=0.1, lr=3e-3))]),
    # Adafactor(params): every default
    dict(name="torch_adafactor_defaults", defaults_only=True, record_every=2),
    # every default again, on gradients of ~1e-8: their squares lie below the default eps1² (fp32 eps², 1.4e-14),
    # so the variance floor and its default decide the update
    dict(name="torch_adafactor_tiny_defaults", inputs="tiny", defaults_only=True),
    dict(name="torch_adafactor_long", inputs="long", steps=200, record_every=10, hparams=dict(weight_decay=0.01)),
]
