"""normuon: pytorch-optimizer 4.1.0's NorMuon (arXiv 2510.05491), on the project's torch-2 venv.

The paper's reference code (microsoft/dion) is not on PyPI; pytorch-optimizer carries NorMuon (the issue's pin,
checked: emerging-optimizers 0.3.0 is not needed). Its Newton-Schulz is torch.optim.Muon's addmm form (distopt's
DOPT_NS_ADDMM), in bf16 by default; ns_dtype=fp32 cases run upstream's own zero_power_via_newton_schulz_5 with
dtype=float32 (patched at run time, never copied). Upstream's groups need use_muon; its AdamW groups take
adamw_lr/adamw_betas/adamw_wd/adamw_eps defaults, which distopt's keys (lr none, beta1, beta2, weight_decay, eps)
reach per group. foreach=False: the single-tensor path (upstream's foreach path batches same-shape matrices
through baddbmm). The step clock is upstream's group clock; every parameter of inputs_matrices has a gradient at
every step, so it is each parameter's.
"""

OPTIMIZER = "normuon"
TORCH = "2"
PINS = ["pytorch-optimizer==4.1.0"]
UPSTREAM = ["pytorch-optimizer"]

HPARAMS = {k: k for k in ("lr", "momentum", "beta1", "beta2", "weight_decay", "eps", "use_muon", "nesterov",
                          "ns_steps", "ns_dtype", "ns_a", "ns_b", "ns_c", "update_scale", "use_adjusted_lr",
                          "weight_decouple")}
DEFAULTS = dict(lr=None, momentum=0.95, beta1=0.9, beta2=0.95, weight_decay=0.0, eps=1e-10, use_muon="auto",
                nesterov=True, ns_steps=5, ns_dtype="bf16", ns_a=3.4445, ns_b=-4.7750, ns_c=2.0315,
                update_scale="preserve_norm", use_adjusted_lr=False, weight_decouple=True)
REQUIRED = []
STATES = {"momentum_buffer": "momentum_buffer", "second_momentum_buffer": "second_momentum_buffer",
          "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
MUON_KEYS = ("lr", "momentum", "beta2", "weight_decay", "eps", "nesterov", "ns_steps", "update_scale",
             "use_adjusted_lr")
AUX_KEYS = ("lr", "weight_decay", "eps")


def _module(ctx, ns_dtype):
    import torch
    from pytorch_optimizer.optimizer.muon import normuon
    if "orig" not in ctx.cache:
        ctx.cache["orig"] = normuon.zero_power_via_newton_schulz_5
    orig = ctx.cache["orig"]
    if ns_dtype == "fp32":
        normuon.zero_power_via_newton_schulz_5 = lambda g, **kw: orig(g, dtype=torch.float32, **kw)
    else:
        normuon.zero_power_via_newton_schulz_5 = orig
    return normuon


def build(ctx, params, kwargs):
    kw = dict(kwargs)
    normuon = _module(ctx, kw.pop("ns_dtype", "bf16"))
    coeffs = (kw.pop("ns_a", 3.4445), kw.pop("ns_b", -4.7750), kw.pop("ns_c", 2.0315))
    decouple = kw.pop("weight_decouple", True)
    groups = []
    for g in params if isinstance(params[0], dict) else [dict(params=params, use_muon="true")]:
        d = dict(kw)
        d.update(g)
        use = d.pop("use_muon", "auto")
        if use not in ("true", "false"):
            raise SystemExit("normuon: upstream needs use_muon per group (true or false), got %r" % use)
        if use == "true":
            out = {k: d[k] for k in MUON_KEYS if d.get(k) is not None}
        else:
            out = {k: d[k] for k in AUX_KEYS if d.get(k) is not None}
            out["betas"] = (d.get("beta1", 0.9), d.get("beta2", 0.95))
        groups.append(dict(out, params=d["params"], use_muon=use == "true"))
    return normuon.NorMuon(groups, ns_coeffs=coeffs, weight_decouple=decouple, foreach=False)


def check_defaults(ctx, opt):
    """Upstream's signature against DEFAULTS (lr per kind: 2e-2 / adamw_lr 3e-4; the AdamW groups' betas, eps
    and decay from adamw_*)."""
    import inspect
    from pytorch_optimizer.optimizer.muon.normuon import NorMuon
    from pytorch_optimizer.optimizer.utils.matrix import get_newton_schulz_weights
    s = {k: v.default for k, v in inspect.signature(NorMuon.__init__).parameters.items()}
    want = dict(lr=2e-2, momentum=DEFAULTS["momentum"], beta2=DEFAULTS["beta2"], weight_decay=DEFAULTS["weight_decay"],
                weight_decouple=DEFAULTS["weight_decouple"], nesterov=DEFAULTS["nesterov"],
                ns_steps=DEFAULTS["ns_steps"], update_scale=DEFAULTS["update_scale"],
                use_adjusted_lr=DEFAULTS["use_adjusted_lr"], adamw_lr=3e-4,
                adamw_betas=(DEFAULTS["beta1"], DEFAULTS["beta2"]), adamw_wd=DEFAULTS["weight_decay"],
                adamw_eps=DEFAULTS["eps"], eps=DEFAULTS["eps"])
    got = {k: s[k] for k in want}
    if got != want:
        raise SystemExit("normuon: upstream defaults %r, DEFAULTS say %r" % (got, want))
    if get_newton_schulz_weights(s["ns_coeffs"]) != [(DEFAULTS["ns_a"], DEFAULTS["ns_b"], DEFAULTS["ns_c"])]:
        raise SystemExit("normuon: upstream's ns_coeffs %r" % (s["ns_coeffs"],))
    import torch
    zp = ctx.cache["orig"]  # upstream's own (the fp32 cases patch the module's name)
    if inspect.signature(zp).parameters["dtype"].default != torch.bfloat16 or DEFAULTS["ns_dtype"] != "bf16":
        raise SystemExit("normuon: upstream's Newton-Schulz dtype default is not bf16, or DEFAULTS disagree")


MATRICES = ["tall", "wide", "sq", "t3", "zeros", "conv"]
# Every case runs the Newton-Schulz iteration in fp32 on both sides (upstream's own function with
# dtype=float32). In bf16, torch 2.15's GEMM (oneDNN, AVX-512 BF16 here) does not add each fp32 sum in k order,
# so an element within its rounding error of a bf16 midpoint rounds the other way, and the iteration amplifies
# such 1-ulp (2^-8) differences in the directions of small singular values (docs/precision.md, "Muon's
# Newton-Schulz": up to 0.10 of max|O| measured for torch.optim.Muon's form); measured here: 3.5e-3 on a
# parameter that starts at zero after one step, 4.0e-3 on a row second moment at an all-zero-gradient step:
# beyond what a golden bound may be (2e-3). bf16 is the default (checked against upstream's signature in
# check_defaults, and fixed to fp32 in the defaults-only case); distopt's bf16 iteration is torch.optim.Muon's
# (flavor=torch), checked by verify's Muon bound.
DEFAULTS_FIXED = {"ns_dtype": ("fp32", "torch 2's bf16 GEMM is not comparable at golden bounds (above)")}
GROUPS = [(MATRICES, dict(use_muon="true")), (["vec"], dict(use_muon="false"))]
# fp32 Newton-Schulz: torch's blocked fp32 GEMM against distopt's k-order chain of fused multiply-adds differ by
# a few fp32 roundings per product (muon_fp32: 3.8e-7), carried through the quintic's iterations into U, then
# into each row's second moment and the row normalisation (a row whose U² mean is small takes the largest
# relative change). Measured (test_golden, 2026-12-06): params 8.2e-7, states 6.4e-6 (the second moments) over
# the 20-step cases, 5.1e-7 / 1.2e-6 over 200 steps; the declared 1e-5 / 1e-4 keep 12x and 15x.
TOL = dict(tol_param=1e-5, tol_state=1e-4)
CASES = [
    dict(name="normuon_default", inputs="matrices", steps=20, hparams=dict(ns_dtype="fp32"), groups=GROUPS, **TOL),
    dict(name="normuon_wd", inputs="matrices", steps=20, hparams=dict(ns_dtype="fp32"), **TOL,
         groups=[(MATRICES, dict(use_muon="true", weight_decay=0.05)),
                 (["vec"], dict(use_muon="false", weight_decay=0.01, lr=1e-2))]),
    dict(name="normuon_match_rms", inputs="matrices", steps=20, hparams=dict(ns_dtype="fp32"), **TOL,
         groups=[(MATRICES, dict(use_muon="true", update_scale="match_rms", beta2=0.9, nesterov=False)),
                 (["vec"], dict(use_muon="false", beta1=0.8))]),
    dict(name="normuon_adjusted", inputs="matrices", steps=20, **TOL,
         hparams=dict(ns_dtype="fp32", use_adjusted_lr=True, weight_decouple=False, momentum=0.9),
         groups=[(MATRICES, dict(use_muon="true", weight_decay=0.05, ns_steps=3)), (["vec"], dict(use_muon="false"))]),
    # NorMuon(params), every parameter a Muon matrix: every default but the iteration's dtype (DEFAULTS_FIXED)
    dict(name="normuon_defaults", inputs="matrices", steps=20, params=MATRICES, defaults_only=True, **TOL),
    dict(name="normuon_long", inputs="matrices", steps=200, record_every=10, hparams=dict(ns_dtype="fp32"), **TOL,
         groups=[(MATRICES, dict(use_muon="true", weight_decay=0.01)), (["vec"], dict(use_muon="false"))]),
]
