"""distopt.NumpyOptimizer: a registry optimizer over float32 numpy arrays, without torch."""
import ctypes

import numpy as np

from . import _lib
from ._core import Handle

# dopt_dtype code -> numpy dtype (bf16 has none: its bits as uint16)
_NP = {0: np.float32, 1: np.float64, 2: np.uint16, 3: np.float16, 4: np.int32, 5: np.int64, 6: np.uint8, 7: np.int8}


def _check_array(a, what, writable):
    if not isinstance(a, np.ndarray):
        raise TypeError(f"distopt: {what} is a {type(a).__name__}, not a numpy.ndarray")
    if a.dtype != np.float32:
        raise TypeError(f"distopt: {what} is {a.dtype}; only float32 arrays are supported")
    if not a.flags.c_contiguous or not a.flags.aligned:
        raise ValueError(f"distopt: {what} is not C-contiguous and aligned (np.ascontiguousarray makes a copy)")
    if writable and not a.flags.writeable:
        raise ValueError(f"distopt: {what} is read-only")
    if a.size == 0:
        raise ValueError(f"distopt: {what} is empty")


class NumpyOptimizer:
    """A registry optimizer (distopt.list()) stepping float32 numpy arrays in place, zero-copy: the library
    updates each parameter array's own memory, so keep the arrays (this object holds a reference to each).

        opt = distopt.NumpyOptimizer("adamw", lr=1e-3, weight_decay=0.01)   # group 0 = these values
        nodecay = opt.add_group(weight_decay=0.0)                            # group 1: overrides
        w = opt.add_param(weights)                                          # -> parameter id 0
        b = opt.add_param(bias, group=nodecay, name="fc.bias")
        opt.step([grad_w, None])                                            # None: no gradient (skipped)

    Hyperparameters use distopt's keys (`distopt.describe(name)`); errors of the library raise distopt.Error.
    A handle must not be used by two threads at once.
    """

    def __init__(self, name, **hparams):
        self._h = Handle(name, hparams)
        self._arrays = []
        self._names = []
        self._where = []  # (address, bytes) of each parameter when added

    @property
    def name(self):
        return self._h.name

    def close(self):
        """Frees the library's optimizer (states); the parameter arrays stay as they are."""
        self._h.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def add_group(self, **overrides):
        """A new parameter group: group 0's values with these overrides. Returns its index."""
        return self._h.add_group(overrides)

    @property
    def num_groups(self):
        return self._h.num_groups()

    def hparams(self, group=0):
        """{key: value} of a group (bool, None for an unset optional key, an enum's name, else float)."""
        return self._h.read_group(group)

    def get_hparam(self, key, group=0):
        return self._h.get(group, key)

    def set_hparam(self, key, value, group=0):
        """Changes one hyperparameter of a group (e.g. an lr schedule); validated by the library."""
        self._h.set(group, key, value)

    def add_param(self, array, group=0, name=None):
        """Registers a float32 C-contiguous writable array as a parameter (updated in place). Returns its id.
        `name` (default "param<id>") appears in error messages and gives layer-wise optimizers (lisa) the
        layer index of names like "model.layers.3.mlp.weight"."""
        pid = len(self._arrays)
        name = f"param{pid}" if name is None else str(name)
        _check_array(array, f"parameter '{name}'", True)
        got = self._h.add_param(group, array.ctypes.data, array.shape, name)
        self._where.append((array.ctypes.data, array.nbytes))  # where the library writes: checked every step
        self._arrays.append(array)
        self._names.append(name)
        return got

    @property
    def params(self):
        return list(self._arrays)

    @property
    def param_names(self):
        return list(self._names)

    def step(self, grads):
        """One step. grads[i] is parameter i's gradient (float32, the parameter's shape) or None."""
        grads = list(grads)
        if len(grads) != len(self._arrays):
            raise ValueError(f"distopt {self.name}: {len(grads)} gradients for {len(self._arrays)} parameters")
        for i, (p, (addr, nbytes)) in enumerate(zip(self._arrays, self._where)):
            if p.ctypes.data != addr or p.nbytes != nbytes:  # resized or reallocated (ndarray.resize, refcheck off)
                raise _lib.invalid(f"distopt {self.name}: parameter '{self._names[i]}' moved or was resized since "
                                   f"add_param ({nbytes} bytes at {addr:#x}, now {p.nbytes} at {p.ctypes.data:#x}): "
                                   f"the library would write freed memory; create the optimizer again")
        keep, addrs = [], []
        for i, (g, p) in enumerate(zip(grads, self._arrays)):
            if g is None:
                addrs.append(None)
                continue
            if not isinstance(g, np.ndarray):
                raise TypeError(f"distopt: gradient {i} is a {type(g).__name__}, not a numpy.ndarray")
            if g.dtype != np.float32:
                raise TypeError(f"distopt: gradient {i} is {g.dtype}; only float32 is supported")
            if g.shape != p.shape:
                raise ValueError(f"distopt: gradient {i} has shape {g.shape}, its parameter {p.shape}")
            g = np.ascontiguousarray(g)
            keep.append(g)
            addrs.append(g.ctypes.data)
        self._h.step(addrs)  # under the handle's lock (one step at a time, close() waits for it)

    def get_step(self, param):
        return self._h.get_step(param)

    def counters(self, param):
        """What parameter param's steps did, {name: count} since creation (docs/api.md "Counters": steps,
        galore.refreshes, muon.ns, q8.steps, ...)."""
        return self._h.counters(param)[1]

    def state(self, param):
        """Copies of a parameter's states {name: ndarray} and its step count under "step" ({} before its first
        step). Names are upstream's state_dict keys (exp_avg, exp_avg_sq_row, RMS, ...)."""
        out = {}
        views = self._h.views(param)
        if not views:
            return out
        out["step"] = self._h.get_step(param)
        for n, d, shape, addr, nbytes in views:
            buf = (ctypes.c_char * nbytes).from_address(addr)
            out[n] = np.frombuffer(buf, dtype=_NP[d]).reshape(shape).copy()
        return out

    def load_state(self, param, state):
        """Writes a parameter's states from {name: array, "step": int} (as state() returns): allocates them,
        checks every name, dtype and shape, then copies. A missing or extra name raises ValueError."""
        state = dict(state)
        if "step" not in state:
            raise ValueError(f"distopt {self.name}: the state of parameter {param} has no 'step'")
        step = state.pop("step")  # checked as a count by set_step
        self._h.init_state(param)
        views = self._h.views(param)
        extra = set(state) - {v[0] for v in views}
        if extra:
            raise ValueError(f"distopt {self.name}: parameter {param} has no state {sorted(extra)}")
        for n, d, shape, addr, nbytes in views:
            if n not in state:
                raise ValueError(f"distopt {self.name}: state '{n}' of parameter {param} missing")
            a = np.array(state[n], dtype=_NP[d], order="C")  # a copy (ascontiguousarray would make 0-d 1-d)
            if a.shape != shape:
                raise ValueError(f"distopt {self.name}: state '{n}' of parameter {param} has shape {a.shape}, "
                                 f"expected {shape}")
            ctypes.memmove(addr, a.ctypes.data, nbytes)
        self._h.set_step(param, step)

    def state_bytes(self, param=-1):
        """(allocated, full): the exact state memory of a parameter (or all, -1) now and once all stepped."""
        return self._h.state_bytes(param)

    @property
    def gstep(self):
        return self._h.get_gstep()


__all__ = ["NumpyOptimizer"]
