"""Muon: PyPI muon-optimizer 0.1.0 (its one file muon.py: SingleDeviceMuon, SingleDeviceMuonWithAuxAdam).

Runs on inputs_matrices.safetensors: every matrix product of the Newton-Schulz iteration there has
m*n*k > 4096, where torch 1.13's CPU bf16 matmul (this AVX2 build, no AVX512-BF16) accumulates in fp32
in k order and rounds once, as distopt's kernel always does (below 4096 torch accumulates in bf16; the
shared inputs' small matrices would measure that difference, not Muon). muon-optimizer 0.1.0 cannot step
a parameter whose .grad is None (muon_update(None)), so every parameter has a gradient at every step.
distopt's extension keys run against upstream patched at run time (never copied): ns_dtype=fp32 makes
upstream's own zeropower_via_newtonschulz5 see float32 for its G.bfloat16() (a fp32-patched upstream),
nesterov/ns_steps are passed to upstream's own muon_update, whose result is reshaped to the parameter's
shape (upstream's later fix for conv filters: 0.1.0 crashes on a 4-D parameter); adjust_lr_fn (torch.optim.Muon's rules) has
no upstream here and no golden case (tests/unit/test_muon.c transcribes its formula).
"""

OPTIMIZER = "muon"
PINS = ["muon-optimizer==0.1.0"]
UPSTREAM = ["muon-optimizer"]

HPARAMS = {"lr": "lr", "momentum": "momentum", "weight_decay": "weight_decay", "use_muon": "use_muon",
           "beta1": ("betas", 0), "beta2": ("betas", 1), "eps": "eps",
           # distopt's extensions, at upstream's fixed behaviour by default; build() applies them
           "nesterov": "nesterov", "ns_steps": "ns_steps", "ns_dtype": "ns_dtype", "adjust_lr_fn": "adjust_lr_fn"}
# lr None: upstream's per-kind defaults (0.02 Muon, 3e-4 aux Adam); use_muon auto: Muon for every matrix
# (upstream has no default: SingleDeviceMuon is all Muon, SingleDeviceMuonWithAuxAdam needs it per group)
DEFAULTS = dict(lr=None, momentum=0.95, weight_decay=0.0, use_muon="auto", beta1=0.9, beta2=0.95, eps=1e-10,
                nesterov=True, ns_steps=5, ns_dtype="bf16", adjust_lr_fn="none")
REQUIRED = []
STATES = {"momentum_buffer": "momentum_buffer", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}

MUON_KEYS = ("lr", "momentum", "weight_decay")
AUX_KEYS = ("lr", "betas", "eps", "weight_decay")


def _upstream(ctx):
    """muon.py with distopt's extension keys applied through upstream's own functions (saved once: cases run
    one after another in this process)."""
    import muon
    if "orig" not in ctx.cache:
        ctx.cache["orig"] = (muon.muon_update, muon.zeropower_via_newtonschulz5)
    return muon


def _configure(ctx, nesterov, ns_steps, ns_dtype):
    import torch
    muon = _upstream(ctx)
    update, zeropower = ctx.cache["orig"]

    def zeropower_fp32(G, steps):
        real = torch.Tensor.bfloat16
        torch.Tensor.bfloat16 = lambda self: self.float()  # upstream's X = G.bfloat16() stays fp32
        try:
            return zeropower(G, steps)
        finally:
            torch.Tensor.bfloat16 = real

    muon.zeropower_via_newtonschulz5 = zeropower_fp32 if ns_dtype == "fp32" else zeropower
    # 0.1.0 returns a conv filter's update as its 2-D view [o, i*kh*kw], which p.add_ cannot take (a crash);
    # upstream's later fix reshapes it to the parameter's shape, as distopt does: the patched copy
    muon.muon_update = lambda grad, momentum, beta=0.95, ns_steps_=5, nesterov_=True: update(
        grad, momentum, beta=beta, ns_steps=ns_steps, nesterov=nesterov).reshape(grad.shape)
    return muon


def build(ctx, params, kwargs):
    kw = dict(kwargs)
    nesterov, ns_steps = kw.pop("nesterov", True), kw.pop("ns_steps", 5)
    ns_dtype, adjust = kw.pop("ns_dtype", "bf16"), kw.pop("adjust_lr_fn", "none")
    if adjust != "none":
        raise SystemExit("muon: adjust_lr_fn=%s has no upstream in muon-optimizer 0.1.0" % adjust)
    muon = _configure(ctx, nesterov, int(ns_steps), ns_dtype)
    if not isinstance(params[0], dict):  # all Muon: SingleDeviceMuon
        if kw.get("use_muon", "auto") not in ("auto", "true"):
            raise SystemExit("muon: SingleDeviceMuon is Muon only")
        return muon.SingleDeviceMuon(params, **{k: kw[k] for k in MUON_KEYS if kw.get(k) is not None})
    groups = []
    for g in params:
        d = dict(kw)
        d.update(g)
        use = d.pop("use_muon", "auto")
        if use not in ("true", "false"):
            raise SystemExit("muon: upstream needs use_muon per group (true or false), got %r" % use)
        keep = MUON_KEYS if use == "true" else AUX_KEYS
        groups.append(dict({k: d[k] for k in keep if d.get(k) is not None}, params=d["params"], use_muon=use == "true"))
    return muon.SingleDeviceMuonWithAuxAdam(groups)


def check_defaults(ctx, opt):
    """Upstream's defaults sit in SingleDeviceMuon's signature and in the values SingleDeviceMuonWithAuxAdam
    writes into a group that leaves them out: both against DEFAULTS (lr per kind: 0.02 / 3e-4)."""
    import inspect
    import torch
    muon = _upstream(ctx)
    sig = inspect.signature(muon.SingleDeviceMuon.__init__).parameters
    got = {k: sig[k].default for k in MUON_KEYS}
    want = dict(lr=0.02, momentum=DEFAULTS["momentum"], weight_decay=DEFAULTS["weight_decay"])
    if got != want:
        raise SystemExit("muon: SingleDeviceMuon defaults %r, DEFAULTS say %r" % (got, want))
    p, q = torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(2))
    o = muon.SingleDeviceMuonWithAuxAdam([dict(params=[p], use_muon=True), dict(params=[q], use_muon=False)])
    m, a = ({k: v for k, v in g.items() if k != "params"} for g in o.param_groups)
    if m != dict(lr=0.02, momentum=DEFAULTS["momentum"], weight_decay=DEFAULTS["weight_decay"], use_muon=True):
        raise SystemExit("muon: a bare Muon group becomes %r" % m)
    if a != dict(lr=3e-4, betas=(DEFAULTS["beta1"], DEFAULTS["beta2"]), eps=DEFAULTS["eps"],
                 weight_decay=DEFAULTS["weight_decay"], use_muon=False):
        raise SystemExit("muon: a bare aux Adam group becomes %r" % a)


def metadata(ctx):
    import hashlib
    import inspect
    muon = _upstream(ctx)
    with open(inspect.getsourcefile(muon), "rb") as f:
        return {"upstream_sha256": hashlib.sha256(f.read()).hexdigest()}


MATRICES = ["tall", "wide", "sq", "t3", "zeros", "conv"]
BF16_TOL = 2e-3  # measured and justified at muon_long
CASES = [
    dict(name="muon_default", inputs="matrices", steps=20, tol_param=BF16_TOL,
         groups=[(MATRICES, dict(use_muon="true")), (["vec"], dict(use_muon="false"))]),
    dict(name="muon_wd", inputs="matrices", steps=20, tol_param=BF16_TOL,
         groups=[(MATRICES, dict(use_muon="true", lr=0.05, momentum=0.9, weight_decay=0.1)),
                 (["vec"], dict(use_muon="false", lr=1e-2, beta1=0.8, weight_decay=0.01))]),
    # fp32 iteration: torch's fp32 matmul (its own blocking and fused multiply-adds) against our fused k-order
    # chain, 3.8e-7 normwise measured; 1e-5 keeps 26x
    dict(name="muon_fp32", inputs="matrices", steps=20, hparams=dict(ns_dtype="fp32"), tol_param=1e-5,
         groups=[(MATRICES, dict(use_muon="true")), (["vec"], dict(use_muon="false"))]),
    dict(name="muon_plain", inputs="matrices", steps=20, hparams=dict(nesterov=False, ns_steps=3), tol_param=BF16_TOL,
         groups=[(MATRICES, dict(use_muon="true", weight_decay=0.05)), (["vec"], dict(use_muon="false"))]),
    # SingleDeviceMuon(params): every default, the matrices only
    dict(name="muon_defaults", inputs="matrices", steps=20, params=MATRICES, defaults_only=True, tol_param=BF16_TOL),
    dict(name="muon_long", inputs="matrices", steps=200, record_every=10,
         groups=[(MATRICES, dict(use_muon="true", weight_decay=0.01)), (["vec"], dict(use_muon="false"))],
         # 200 steps (every 10th recorded). Most steps agree bit for bit (muon_wd: all 20); now and then
         # torch's bf16 matmul rounds an fp32 sum that lies a hair above a bf16 midpoint the other way (its
         # accumulation order is not k order there; first seen in one element of (c*A) @ A of t3 at step 40 in
         # an earlier draw, 1 of 324), a 1-ulp bf16 difference (2^-8 = 0.39%) in one element of one update,
         # which moves that parameter by lr * 0.39% * |u| <= 1.2e-4 and never feeds back (an update depends on
         # the gradients only). Measured against ref/muon.c (test_golden): params 7.7e-4 normwise here (max abs
         # 7.8e-4, a handful of such events on the worst element), 2.3e-4 in 20 steps; states 0 (the moments
         # depend on the gradients only). BF16_TOL = 2e-3 (TOL_LIMIT) keeps a 2.6x margin and fails a wrong
         # coefficient, scale, order or bias correction at step 1 (2e-4 to 4e-3 there, growing 20x by step 20)
         tol_param=BF16_TOL),
]
