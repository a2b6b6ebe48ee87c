"""soap: pytorch-optimizer 4.1.0's SOAP (Vyas et al. 2024), on the project's torch-2 venv.

The authors' repository is not on PyPI; pytorch-optimizer carries SOAP (the issue's pin; heavyball's ForeachSOAP
did not match the official SOAP, HeavyBall #40). Its preconditioners GG and eigenbases Q are lists with one
tensor per dimension ([] for a dimension it does not precondition): the generator records them as GG0, GG1, ...
and Q0, Q1, ...

The first basis is torch.linalg.eigh's: its signs, and on a degenerate eigenspace (the first step's G·Gᵀ of a
non-square matrix has rank min(m, n)) the basis itself, are LAPACK's choice, and SOAP's later steps depend on
it (v is kept per coordinate of the basis). So the cases adopt upstream's first basis (ADOPT_STATES: test_golden
checks that it is orthonormal and diagonalises distopt's own GG, then copies it in); every later basis (the QR
refreshes: power iteration, the sort by estimated eigenvalue, v permuted with it) is distopt's own and compared
at the golden bounds.

Upstream's clock is the group's; distopt's the parameter's: the cases leave out `small` (no gradient at step 3).
max_precondition_dim keeps every preconditioned GG full rank by the first QR refresh (a power iteration on a
rank-deficient GG has columns of rounding noise, on both sides): `row`'s 37 columns (rank 1 per step) and `wide`
stay unpreconditioned (dims > 16), Adam on the identity bases.
"""

OPTIMIZER = "soap"
TORCH = "2"
PINS = ["pytorch-optimizer==4.1.0"]
UPSTREAM = ["pytorch-optimizer"]

HPARAMS = {"lr": "lr", "beta1": ("betas", 0), "beta2": ("betas", 1), "shampoo_beta": "shampoo_beta",
           "weight_decay": "weight_decay", "precondition_frequency": "precondition_frequency",
           "max_precondition_dim": "max_precondition_dim", "merge_dims": "merge_dims",
           "precondition_1d": "precondition_1d", "correct_bias": "correct_bias",
           "normalize_gradient": "normalize_gradient", "eps": "eps"}
DEFAULTS = dict(lr=3e-3, beta1=0.95, beta2=0.95, shampoo_beta=None, weight_decay=1e-2, precondition_frequency=10,
                max_precondition_dim=10000, merge_dims=False, precondition_1d=False, correct_bias=True,
                normalize_gradient=False, eps=1e-8)
REQUIRED = []
STATES = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "GG0": "GG0", "GG1": "GG1", "GG2": "GG2",
          "Q0": "Q0", "Q1": "Q1", "Q2": "Q2"}
# copies of the group's settings in each parameter's state
IGNORE_STATES = ("precondition_frequency", "shampoo_beta")
ADOPT_STATES = ("Q0", "Q1", "Q2")
# max_precondition_dim=16 (above): the defaults-only case keeps upstream's 10000, so its parameters are the ones
# whose every dimension is small
BASE = ["vec", "tall", "sq", "t3", "zeros"]
LONG = ["vec", "tall", "sq", "t3", "zeros"]


def build(ctx, params, kwargs):
    from pytorch_optimizer import SOAP
    return SOAP(params, **kwargs)


CASES = [
    dict(name="soap_default", params=BASE, hparams=dict(lr=1e-2, max_precondition_dim=16)),
    dict(name="soap_refresh", params=BASE + ["row", "wide"],
         hparams=dict(lr=1e-2, beta1=0.9, beta2=0.99, shampoo_beta=0.9, weight_decay=0.05, precondition_frequency=4,
                      max_precondition_dim=16, eps=1e-7)),
    # a vector's g·gᵀ has rank 1 a step: no refresh within the 20 steps (its power iteration would run on a
    # rank-deficient GG), the first basis adopted
    dict(name="soap_1d_normalize", params=BASE,
         hparams=dict(lr=3e-3, precondition_frequency=25, max_precondition_dim=16, precondition_1d=True,
                      normalize_gradient=True, correct_bias=False, weight_decay=0.0)),
    dict(name="soap_groups", params=BASE,
         hparams=dict(lr=1e-2, precondition_frequency=6, max_precondition_dim=16),
         groups=[(["vec", "tall"], dict(weight_decay=0.0)), (["sq", "t3", "zeros"], dict(beta2=0.9))]),
    dict(name="soap_defaults", params=["vec", "tall", "sq", "t3", "zeros"], defaults_only=True, record_every=2),
    dict(name="soap_long", inputs="long", params=LONG, steps=200, record_every=10,
         hparams=dict(lr=1e-2, precondition_frequency=10, max_precondition_dim=16)),
]
