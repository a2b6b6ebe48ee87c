"""adam_mini: PyPI adam-mini 1.1.1's Adam_mini (Zhang et al. 2024), on the project's torch-2 venv.

Upstream takes named parameters and derives each one's block from its name (embed/lm_head/v_proj/mlp/o_proj:
one second moment per row; q_proj/k_proj: per head of dim*dim/n_heads elements; bias: plain Adam; anything
else: one per tensor) and zeroes the weight decay of names with norm, ln or bias. distopt takes the block as a
group key (block, head_numel). Here the golden parameters get names that put them in every category (dim=16,
n_heads=4: a head is 64 elements, 4 rows of `sq`), and each case's groups give distopt the same blocks and
decays: the driver's group overrides (block, head_numel, weight_decay) reach build() in the group dicts, which it
drops, building upstream from the names alone. The defaults-only case names every parameter neutrally (no
category: one block per tensor, distopt's default).
"""

OPTIMIZER = "adam_mini"
TORCH = "2"
PINS = ["adam-mini==1.1.1"]
UPSTREAM = ["adam-mini"]

HPARAMS = {"lr": "lr", "beta1": ("betas", 0), "beta2": ("betas", 1), "eps": "eps", "weight_decay": "weight_decay",
           "block": "block", "head_numel": "head_numel"}
# block/head_numel: distopt's group keys (upstream reads the name); tensor is upstream's block for an unnamed one
DEFAULTS = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, block="tensor", head_numel=0)
REQUIRED = []
STATES = {"m": "m", "v": "v", "vmean": "vmean"}
# upstream's bookkeeping per parameter (the block count it viewed the gradient with, its all-gathered numel, a
# flag), not state its step evolves
IGNORE_STATES = ("head_per_gpu", "neuron_per_gpu", "block_numel")
FIXED = dict(dim=16, n_heads=4, verbose=False)

# name -> (upstream name, distopt group overrides)
NAMES = {
    "vec": "model.norm.weight",              # tensor block, no decay (norm)
    "row": "lm_head.weight",                 # neurons: 1 row of 37
    "small": "layers.0.mlp.up.weight",       # neurons (no gradient at step 3: upstream skips it too)
    "tall": "embed_tokens.weight",           # neurons: 13 rows
    "wide": "layers.0.attn.v_proj.weight",   # neurons: 33 rows of 65
    "sq": "layers.0.attn.q_proj.weight",     # heads: 4 of 64 elements
    "t3": "layers.0.attn.bias",              # plain Adam, no decay (bias)
    "zeros": "layers.0.gate.weight",         # tensor block, with decay
}
GROUPS = [(["vec"], dict(block="tensor", weight_decay=0.0)),
          (["row", "small", "tall", "wide"], dict(block="neuron")),
          (["sq"], dict(block="head", head_numel=64)),
          (["t3"], dict(block="elementwise", weight_decay=0.0)),
          (["zeros"], dict(block="tensor"))]


def check_defaults(ctx, opt):
    """Upstream's signature defaults for the keys it has (block/head_numel are distopt's)."""
    import inspect
    sig = inspect.signature(type(opt).__init__).parameters
    want = dict(lr=sig["lr"].default, beta1=sig["betas"].default[0], beta2=sig["betas"].default[1],
                eps=sig["eps"].default, weight_decay=sig["weight_decay"].default)
    for k, v in want.items():
        if DEFAULTS[k] != v:
            raise SystemExit("adam_mini: DEFAULTS[%s] = %r but upstream's default is %r" % (k, DEFAULTS[k], v))


def build(ctx, params, kwargs):
    from adam_mini import Adam_mini
    kw = {k: v for k, v in kwargs.items() if k not in ("block", "head_numel")}
    named = []
    for item in params:
        for p in (item["params"] if isinstance(item, dict) else [item]):
            n = ctx.names[id(p)]
            grouped = any(isinstance(i, dict) for i in params)
            named.append((NAMES[n] if grouped else "p." + n, p))
    return Adam_mini(named, **kw)


CASES = [
    dict(name="adam_mini_default", groups=GROUPS, hparams=dict(weight_decay=0.1)),
    dict(name="adam_mini_betas", groups=GROUPS, hparams=dict(lr=1e-2, beta1=0.8, beta2=0.95, eps=1e-6,
                                                             weight_decay=0.05)),
    dict(name="adam_mini_defaults", defaults_only=True, record_every=2),
    dict(name="adam_mini_long", inputs="long", steps=200, record_every=10, hparams=dict(weight_decay=0.01),
         groups=[(["vec"], dict(block="tensor", weight_decay=0.0)),
                 (["row", "small", "tall"], dict(block="neuron")),
                 (["sq"], dict(block="head", head_numel=64)),
                 (["t3"], dict(block="elementwise", weight_decay=0.0)),
                 (["zeros"], dict(block="tensor"))]),
]
