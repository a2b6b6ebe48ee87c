"""LAMB: ColossalAI 0.4.0's colossalai/nn/optimizer/lamb.py, class Lamb (that one
file, taken from the sdist; it needs only torch)."""

OPTIMIZER = "lamb"
PINS = []
# PyPI has only an sdist of colossalai 0.4.0 (which would build CUDA kernels):
# download it with --no-deps and extract the single file
FETCH = [dict(requirement="colossalai==0.4.0", member="colossalai/nn/optimizer/lamb.py")]
UPSTREAM = ["colossalai"]
UPSTREAM_NOTE = "(colossalai/nn/optimizer/lamb.py, class Lamb)"

HPARAMS = {"lr": "lr", "beta1": ("betas", 0), "beta2": ("betas", 1), "eps": "eps",
           "weight_decay": "weight_decay", "adam": "adam", "bias_correction": "bias_correction"}
DEFAULTS = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.0,
                adam=False, bias_correction=False)
REQUIRED = []
GLOBAL_ONLY = ["adam"]     # an optimizer attribute (self.adam), not a param-group option
STATES = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}


def build(ctx, params, kwargs):
    import inspect
    Lamb = ctx.load_module("colossalai/nn/optimizer/lamb.py", "colossalai_lamb").Lamb
    sig = inspect.signature(Lamb.__init__).parameters
    if "adam" not in sig or "bias_correction" not in sig:
        raise SystemExit("ColossalAI Lamb lacks adam/bias_correction flags")
    return Lamb(params, **kwargs)


def metadata(ctx):
    import hashlib
    with open(ctx.fetched("colossalai/nn/optimizer/lamb.py"), "rb") as f:
        return {"upstream_sha256": hashlib.sha256(f.read()).hexdigest()}


CASES = [
    dict(name="lamb_default"),
    dict(name="lamb_bc_wd", hparams=dict(bias_correction=True, weight_decay=0.01, lr=1e-2)),
    dict(name="lamb_adam", hparams=dict(adam=True, weight_decay=0.01)),
    # Lamb(params): no bias correction, no decay, trust ratio on
    dict(name="lamb_defaults", defaults_only=True, record_every=2),
    dict(name="lamb_long", inputs="long", steps=200, record_every=10,
         hparams=dict(bias_correction=True, weight_decay=0.01, lr=1e-2),
         # 200 steps (every 10th recorded), all params but `wide`. Measured against
         # ref/lamb.c (test_golden): params 2.2e-7, states 3.2e-7 normwise over all
         # recorded steps -- the per-step roundings do not build up here -- so the
         # 20-step tolerances hold with margins 4.5x and 31x
         tol_param=1e-6, tol_state=1e-5),
]
