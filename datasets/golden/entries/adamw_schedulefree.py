"""adamw_schedulefree: schedulefree 1.4.1's AdamWScheduleFree (Defazio et al., "The Road Less Scheduled").

Runs on torch 2 (the project's torch-2 venv): schedulefree needs typing_extensions and torch's foreach lerp, and
its users are on torch 2. Upstream keeps its clock (k) and the average's weights (weight_sum, lr_max) per param
group; distopt keeps them per parameter, which is the same while every parameter of a group has a gradient at
every step: the cases leave out `small` (no gradient at step 3 of the base inputs, 150-151 of the long ones), whose
group clock upstream advances without it (docs/optimizers.md). The default foreach=True path runs (CPU and CUDA
alike); its single-tensor path computes the same operations. mode="eval" cases record the parameters in
evaluation mode (optimizer.eval() after each step, train() before the next): the average x, through the swap.
"""

OPTIMIZER = "adamw_schedulefree"
TORCH = "2"
PINS = ["schedulefree==1.4.1"]
UPSTREAM = ["schedulefree"]

HPARAMS = {"lr": "lr", "beta1": ("betas", 0), "beta2": ("betas", 1), "eps": "eps", "weight_decay": "weight_decay",
           "warmup_steps": "warmup_steps", "r": "r", "weight_lr_power": "weight_lr_power"}
DEFAULTS = dict(lr=0.0025, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0, warmup_steps=0, r=0.0,
                weight_lr_power=2.0)
REQUIRED = []
STATES = {"z": "z", "exp_avg_sq": "exp_avg_sq"}
# distopt's per-parameter states that upstream keeps in the param group (compared through the parameters)
EXTRA_STATES = {"weight_sum": "param_groups[g]['weight_sum'] (double)", "lr_max": "param_groups[g]['lr_max']"}

BASE = ["vec", "row", "tall", "wide", "sq", "t3", "zeros"]
LONG = ["vec", "row", "tall", "sq", "t3", "zeros"]


def build(ctx, params, kwargs):
    import schedulefree
    opt = schedulefree.AdamWScheduleFree(params, **kwargs)
    opt.train()  # upstream starts in eval mode and refuses to step there; distopt starts in train mode
    return opt


CASES = [
    dict(name="adamw_schedulefree_default", params=BASE),
    dict(name="adamw_schedulefree_wd_warmup", params=BASE,
         hparams=dict(lr=1e-2, weight_decay=0.05, warmup_steps=5, r=0.5)),
    dict(name="adamw_schedulefree_eval", params=BASE, mode="eval",
         hparams=dict(lr=3e-2, beta1=0.5, weight_decay=0.01, warmup_steps=3)),
    dict(name="adamw_schedulefree_groups", params=BASE,
         groups=[(["vec", "t3"], dict(weight_decay=0.0)),
                 (["row", "tall", "wide", "sq", "zeros"], dict(weight_decay=0.1, lr=1e-2))]),
    dict(name="adamw_schedulefree_defaults", params=BASE, defaults_only=True, record_every=2),
    dict(name="adamw_schedulefree_long", params=LONG, inputs="long", steps=200, record_every=10, mode="eval",
         hparams=dict(lr=1e-2, weight_decay=0.01, warmup_steps=20)),
]
