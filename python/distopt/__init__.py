"""distopt: the C reference optimizers from Python (ctypes over libdistopt.so; docs/python.md).

    import distopt
    distopt.list()                                   # registered optimizer names
    opt = distopt.Optimizer("adamw", model.parameters(), lr=1e-3)   # a torch.optim.Optimizer (needs torch)
    np_opt = distopt.NumpyOptimizer("adamw", lr=1e-3)                 # float32 numpy arrays (needs numpy)
    with distopt.record(torch_optimizer, "run.rec"): ...           # record a torch run (docs/verify.md)
    distopt.verify("run.rec")                        # replay it through the reference (the distopt CLI)
    distopt.replay("run.rec", make_optimizer)        # ... or through your own single-device torch optimizer

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


def __getattr__(attr):
    if attr == "Optimizer":
        from ._torch_api import Optimizer  # imports torch
        return Optimizer
    if attr == "NumpyOptimizer":
        from ._numpy_api import NumpyOptimizer  # imports numpy
        return NumpyOptimizer
    raise AttributeError(f"module 'distopt' has no attribute {attr!r}")


__all__ = ["Error", "Optimizer", "NumpyOptimizer", "list", "describe", "hparams", "library_path", "record", "verify", "replay",
           "dtensor_layout",
           "__version__"]
