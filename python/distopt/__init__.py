"""distopt: the C reference optimizers from Python (ctypes over libdistopt.so; docs/python.md).

    import distopt
    distopt.list()                                   # registered optimizer names
    opt = distopt.Optimizer("adamw", model.parameters(), lr=1e-3)   # a torch.optim.Optimizer (needs torch)
    np_opt = distopt.NumpyOptimizer("adamw", lr=1e-3)                 # float32 numpy arrays (needs numpy)
    with distopt.record(torch_optimizer, "run.rec"): ...           # record a torch run (docs/verify.md)
    distopt.verify("run.rec")                        # replay it through the reference (the distopt CLI)
    distopt.replay("run.rec", make_optimizer)        # ... or through your own single-device torch optimizer
    distopt.twin("run.rec", make_model, loss_fn, batches, world=2)  # ... and its gradients against a twin

Importing distopt needs neither torch nor numpy: distopt.Optimizer imports torch, distopt.NumpyOptimizer
numpy, on first use. Every failing library call raises distopt.Error (a RuntimeError) with the library's
one-line message.
"""
from . import _core
from ._lib import Error
from ._lib import path as library_path
from .record import dtensor_layout, record, verify  # noqa: F401 (torch is imported on first use; docs/verify.md)
# `python3 -m distopt.replay` runs replay.py as __main__ after this package imported it as distopt.replay (for
# distopt.replay, the function): runpy's warning about the module being in sys.modules already is about
# modules that rely on their own identity, which replay.py does not (its main() uses its own namespace)
import warnings as _warnings
_warnings.filterwarnings("ignore", message=r"'distopt\.replay' found in sys\.modules after import of package",
                         category=RuntimeWarning)
from .replay import replay  # noqa: F401,E402 (your own torch optimizer as the reference; docs/verify.md)
from .twin import twin  # noqa: F401,E402 (a single-process twin of a distributed training; docs/verify.md)

__version__ = "0.5.0"  # = include/distopt/distopt.h DOPT_VERSION_* (tests/python checks it)


def list(details=False):  # noqa: A001 (distopt.list, as the CLI's `distopt list`)
    """The registered optimizers' names, in registry order; with details=True one dict per optimizer:
    name, summary, distributable, wrapper, example (the library's dopt_optim_registry_info)."""
    names = _core.names()
    if not details:
        return names
    return [_core.info(i) for i in range(len(names))]


def describe(name):
    """The library's description of an optimizer: a summary line, then one line per key (default, meaning)."""
    return _core.describe(name)


def hparams(name, **overrides):
    """{key: value} of an optimizer's hyperparameters (upstream defaults, with these overrides), validated
    by the library; distopt's key names."""
    h = _core.Handle(name, overrides)
    try:
        return h.read_group(0, overrides)
    finally:
        h.close()


def adam_mini_groups(named_parameters, dim=2048, n_heads=32, n_kv_heads=None, weight_decay=0.0):
    """Param groups for distopt.Optimizer("adam_mini", ...) from a model's named parameters, by adam-mini 1.1.1's
    rules (docs/optimizers.md "Adam-mini"): a name with bias steps plain Adam (block=elementwise), q_proj/k_proj/
    wq/wk/query/key one second moment per head of dim*dim/n_heads elements, embed/lm_head/v_proj/mlp/o_proj/...
    one per row (neuron), anything else one per tensor; names with norm, ln or bias get weight_decay 0. Frozen
    parameters (requires_grad False) are left out, as upstream does. Parameters with the same settings share a
    group, in first-seen order."""
    if n_kv_heads is not None and n_heads % n_kv_heads:
        raise ValueError(f"adam_mini_groups: n_heads={n_heads} is not a multiple of n_kv_heads={n_kv_heads}")
    head_numel = dim * dim // n_heads
    from . import _upstream
    groups, at = [], {}
    for name, p in named_parameters:
        if not getattr(p, "requires_grad", True):
            continue
        block, hn, decays = _upstream.adam_mini_block(name, head_numel)
        key = (block, hn, decays)
        if key not in at:
            at[key] = len(groups)
            g = {"params": [], "block": block, "weight_decay": weight_decay if decays else 0.0}
            if block == "head":
                g["head_numel"] = hn
            groups.append(g)
        groups[at[key]]["params"].append(p)
    return groups


def __getattr__(attr):
    if attr == "Optimizer":
        from ._torch_api import Optimizer  # imports torch
        return Optimizer
    if attr == "NumpyOptimizer":
        from ._numpy_api import NumpyOptimizer  # imports numpy
        return NumpyOptimizer
    raise AttributeError(f"module 'distopt' has no attribute {attr!r}")


__all__ = ["Error", "Optimizer", "NumpyOptimizer", "list", "describe", "hparams", "library_path", "record", "verify", "replay", "twin",
           "dtensor_layout",
           "__version__"]
