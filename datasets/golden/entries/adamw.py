"""AdamW: torch.optim.AdamW of Debian's python3-torch 1.13.1 (CPU), single-tensor path."""

OPTIMIZER = "adamw"
PINS = []                  # torch itself is Debian's python3-torch (the venv's system site-packages)
UPSTREAM = ["torch"]

# distopt hparam key -> upstream kwarg; (kwarg, i) = element i of a tuple kwarg
HPARAMS = {"lr": "lr", "beta1": ("betas", 0), "beta2": ("betas", 1), "eps": "eps",
           "weight_decay": "weight_decay", "amsgrad": "amsgrad"}
# upstream's defaults in distopt's names (checked against upstream's signature);
# the order is the order of the metadata's hparams string
DEFAULTS = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2, amsgrad=False)
REQUIRED = []
# distopt state key -> upstream optimizer.state[p] key ("step" is compared with the step count)
STATES = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "max_exp_avg_sq": "max_exp_avg_sq"}
# not hyperparameters: the single-tensor kernels (torch 1.13 resolves foreach=None
# to False as well, so the defaults-only case, which passes nothing, runs the same path)
FIXED = {"foreach": False}


def build(ctx, params, kwargs):
    return ctx.torch.optim.AdamW(params, **kwargs)


CASES = [
    dict(name="adamw_default"),
    dict(name="adamw_nowd", hparams=dict(weight_decay=0.0, lr=1e-2)),
    dict(name="adamw_amsgrad", hparams=dict(amsgrad=True, lr=5e-3, beta2=0.99)),
    # a large lr*wd (0.05) makes the decay's place visible: decaying after the update
    # instead of before differs by lr*wd*lr*u, ~1e-2 relative here (1e-8 at the defaults)
    dict(name="adamw_strong_decay", hparams=dict(lr=0.1, weight_decay=0.5)),
    # torch.optim.AdamW(params): nothing passed; distopt gets no hparams
    dict(name="adamw_defaults", defaults_only=True, record_every=2),
    dict(name="adamw_long", inputs="long", steps=200, record_every=10,
         hparams=dict(lr=1e-2, weight_decay=0.1),
         # 200 steps (every 10th recorded), all params but `wide`. Measured against
         # ref/adamw.c (test_golden): params 1.9e-7, states 3.2e-7 normwise over all
         # recorded steps -- the per-step roundings do not build up here -- so the
         # 20-step tolerances hold with margins 5.3x and 31x
         tol_param=1e-6, tol_state=1e-5),
]
