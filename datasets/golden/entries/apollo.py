"""apollo: PyPI apollo-torch 1.0.3's APOLLOAdamW (Zhu et al. 2024), random projection, on the project's torch-2 venv.

Upstream draws each projection with torch's CPU generator (stable_randn(shape, seed), seed = the parameter's
1-based index, then next_seed: 15 randint draws) and divides it by sqrt(rank). distopt draws it from its own
counter-based generator keyed (seed, parameter index, refresh number, element) (ref/apollo.c; docs/optimizers.md),
so the cases adopt distopt's projection on the upstream side, the one intervention: stable_randn and next_seed
are replaced at run time (upstream code never copied) by a port of ref/ctr_rng.c's dopt_ctr_gauss, and every
parameter's state["seed"] carries (refresh << 32 | distopt's index). Everything after the draw (the division by
sqrt(rank), the projection product, Adam in the low-rank space, the scaling, the limiter, the update, the decay)
is upstream's. A wrong port fails every projected case at the first step.

The package's __init__ imports bitsandbytes (for GaLoreAdamW8bit only): the entry imports apollo_torch.apollo
without it (a bare package module), so bitsandbytes and transformers' optimizers are not needed.

Upstream takes the projection keys (rank, update_proj_gap, scale, proj_type, scale_type, proj="random") per
group and projects only the groups that have them; distopt's rank=0 is a group without them. Only 2-D
parameters go into rank groups (upstream fails on others; distopt steps them as plain HF AdamW). Channel scaling
is tested where upstream defines it, with the std side (its norm_dim); scale_front and disable_nl are
constructor-wide upstream (GLOBAL_ONLY).
"""

OPTIMIZER = "apollo"
TORCH = "2"
PINS = ["apollo-torch==1.0.3"]
UPSTREAM = ["apollo-torch"]

HPARAMS = {"lr": "lr", "beta1": ("betas", 0), "beta2": ("betas", 1), "eps": "eps", "weight_decay": "weight_decay",
           "correct_bias": "correct_bias", "scale_front": "scale_front", "disable_nl": "disable_nl",
           "rank": "rank", "update_proj_gap": "update_proj_gap", "scale": "scale", "proj_type": "proj_type",
           "scale_type": "scale_type", "seed": "seed"}
DEFAULTS = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.0, correct_bias=True, scale_front=False,
                disable_nl=False, rank=0, update_proj_gap=200, scale=1.0, proj_type="std", scale_type="channel",
                seed=0)
REQUIRED = []
GLOBAL_ONLY = ("scale_front", "disable_nl")
STATES = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "scaled_grad": "scaled_grad"}
# state["seed"]: the projector's generator key (here distopt's), not state the step evolves
IGNORE_STATES = ("seed",)
# distopt's state that upstream keeps in an object (compared through the parameters)
EXTRA_STATES = {"projector": "state['projector'].ortho_matrix (a GradientProjector)"}
# group keys: upstream has no defaults for them (a group with "rank" must give them all)
GROUP_KEYS = ("rank", "update_proj_gap", "scale", "proj_type", "scale_type", "seed")
# distopt's defaults for the group keys, where upstream's README and paper point: APOLLO's channel scaling, the
# std side, T = 200, scale 1 (APOLLO-Mini: rank=1, scale_type=tensor, scale=128)
UPSTREAM_NOTE = "projection adopted from distopt's generator (entries/apollo.py)"

_M = (1 << 64) - 1


def _mix64(z):  # ref/ctr_rng.c dopt_ctr_mix64
    z = (z + 0x9E3779B97F4A7C15) & _M
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M
    return z ^ (z >> 31)


def _gauss(seed, a, b, c):  # ref/ctr_rng.c dopt_ctr_gauss, in double, rounded to fp32 by the caller
    import math
    h = _mix64(_mix64(_mix64(_mix64(seed) ^ a) ^ b) ^ c)
    u1 = ((h >> 11) + 1.0) * 2.0 ** -53
    u2 = (_mix64(h) >> 11) * 2.0 ** -53
    return math.sqrt(-2.0 * math.log(u1)) * math.cos(6.283185307179586 * u2)


def _upstream(ctx):
    """apollo_torch.apollo and .random_projector without the package's __init__ (bitsandbytes)."""
    if "mod" not in ctx.cache:
        import importlib
        import importlib.util
        import sys
        import types
        spec = importlib.util.find_spec("apollo_torch")
        pkg = types.ModuleType("apollo_torch")
        pkg.__path__ = list(spec.submodule_search_locations)
        sys.modules["apollo_torch"] = pkg
        ctx.cache["mod"] = (importlib.import_module("apollo_torch.apollo"),
                            importlib.import_module("apollo_torch.random_projector"))
    return ctx.cache["mod"]


def check_defaults(ctx, opt):
    """Upstream's constructor defaults for the constructor keys; the group keys have none upstream."""
    import inspect
    sig = inspect.signature(type(opt).__init__).parameters
    want = dict(lr=sig["lr"].default, beta1=sig["betas"].default[0], beta2=sig["betas"].default[1],
                eps=sig["eps"].default, weight_decay=sig["weight_decay"].default,
                correct_bias=sig["correct_bias"].default, scale_front=sig["scale_front"].default,
                disable_nl=sig["disable_nl"].default)
    for k, v in want.items():
        if DEFAULTS[k] != v or type(DEFAULTS[k]) is not type(v):
            raise SystemExit("apollo: DEFAULTS[%s] = %r but upstream's default is %r" % (k, DEFAULTS[k], v))
    for k in GROUP_KEYS:
        if k in sig:
            raise SystemExit("apollo: upstream now has a constructor default for %s: compare it" % k)


def build(ctx, params, kwargs):
    import numpy as np
    import torch
    apollo, rp = _upstream(ctx)
    kw = dict(kwargs)
    top = {k: kw.pop(k) for k in GROUP_KEYS if k in kw}
    index = {pid: i for i, pid in enumerate(ctx.names)}  # distopt's parameter index: the case's order
    seeds = {}
    groups = []
    for g in params if isinstance(params[0], dict) else [dict(params=params)]:
        d = dict(top)
        d.update(g)
        seed = d.pop("seed", 0)
        if d.get("rank", 0) > 0:
            d["proj"] = "random"
            for p in d["params"]:
                seeds[index[id(p)]] = seed
        else:
            for k in GROUP_KEYS:
                d.pop(k, None)
        groups.append(d)
    opt = apollo.AdamW(groups, **kw)

    def stable_randn(shape, seed, device=None, dtype=torch.float32):
        t, q = seed & 0xFFFFFFFF, seed >> 32
        rows, cols = shape
        vals = [_gauss(seeds[t], t, q, e) for e in range(rows * cols)]
        return torch.from_numpy(np.array(vals, dtype=np.float32).reshape(rows, cols)).to(dtype)

    rp.stable_randn = stable_randn
    rp.next_seed = lambda seed, adv=0xF: seed + (1 << 32)
    for g in opt.param_groups:
        for p in g["params"]:
            opt.state[p]["seed"] = index[id(p)]
    return opt


MATS = ["row", "small", "tall", "wide", "sq", "zeros"]
PLAIN = ["vec", "t3"]

CASES = [
    # APOLLO: channel scaling on the std side, refreshes at 0, 7, 14; the plain group is HF AdamW with decay
    dict(name="apollo_channel", hparams=dict(lr=1e-2, weight_decay=0.05),
         groups=[(MATS, dict(rank=3, update_proj_gap=7)), (PLAIN, dict())]),
    # APOLLO-Mini: rank 1, tensor scaling, scale 128, another seed
    dict(name="apollo_mini", hparams=dict(lr=1e-3),
         groups=[(MATS, dict(rank=1, update_proj_gap=9, scale_type="tensor", scale=128.0, seed=5)),
                 (PLAIN, dict())]),
    # every side with tensor scaling, sqrt(scale) before the limiter, a rank above the sides (40), no bias
    # correction, other betas and eps
    dict(name="apollo_sides", hparams=dict(lr=3e-3, beta1=0.8, beta2=0.95, eps=1e-8, correct_bias=False,
                                           scale_front=True, weight_decay=0.1),
         groups=[(["tall", "wide"], dict(rank=2, update_proj_gap=6, proj_type="reverse_std", scale_type="tensor",
                                         scale=4.0)),
                 (["small", "zeros"], dict(rank=3, update_proj_gap=5, proj_type="left", scale_type="tensor")),
                 (["row", "sq"], dict(rank=40, update_proj_gap=11, proj_type="right", scale_type="tensor")),
                 (PLAIN, dict())]),
    # the limiter off, channel scaling with a large rank
    dict(name="apollo_no_limiter", hparams=dict(lr=1e-2, disable_nl=True),
         groups=[(MATS, dict(rank=40, update_proj_gap=4)), (PLAIN, dict(weight_decay=0.01))]),
    # upstream's constructor defaults, no projection (a group without rank)
    dict(name="apollo_defaults", defaults_only=True, record_every=2),
    dict(name="apollo_long", inputs="long", steps=200, record_every=10, hparams=dict(lr=1e-2, weight_decay=0.01),
         groups=[(["row", "small", "tall", "sq", "zeros"], dict(rank=2, update_proj_gap=50)),
                 (PLAIN, dict())]),
]
