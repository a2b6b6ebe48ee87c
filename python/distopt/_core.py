"""A dopt_optim handle and the registry, independent of torch and numpy (data travels as addresses)."""
import ctypes
import functools
import math
import threading

from . import _lib
from ._lib import Error, call, lib


def _s(b):
    return b.decode("utf-8", "replace") if b is not None else None


# ---- registry -------------------------------------------------------------------------------------

def names():
    return [_s(lib.dopt_optim_registry_name(i)) for i in range(lib.dopt_optim_registry_count())]


def info(i):
    out = _lib.OptimInfo()
    call(lib.dopt_optim_registry_info, i, ctypes.byref(out))
    return {"name": _s(out.name), "summary": _s(out.summary), "distributable": bool(out.distributable),
            "wrapper": bool(out.wrapper), "example": _s(out.example)}


def describe(name):
    cap = 8192
    while True:
        buf = ctypes.create_string_buffer(cap)
        call(lib.dopt_optim_describe, _text(name, "optimizer name"), buf, cap)
        text = buf.value.decode("utf-8", "replace")
        if len(buf.value) < cap - 1:
            return text
        cap *= 4


class Spec:
    """An optimizer's hyperparameter keys and their kinds, from dopt_optim_describe: one line per key,
    'key default meaning'; the default says the kind: true/false (bool), none (optional number), a whole
    number without a fraction (int: counts, sizes, seeds), a number with one (real), a name (enum); an enum's
    line ends with its choices, '(one of: a, b)', which decides (muon's adjust_lr_fn defaults to 'none')."""

    def __init__(self, name):
        self.name = name
        self.kinds = {}  # key -> "real" | "int" | "bool" | "optional" | "enum"
        self.defaults = {}  # key -> the default as describe prints it
        self.wrapper = False
        for i, n in enumerate(names()):
            if n == name:
                self.wrapper = info(i)["wrapper"]
        for line in describe(name).splitlines()[1:]:
            parts = line.split(None, 2)
            if len(parts) < 2 or parts[0].startswith("("):
                continue
            key, default = parts[0], parts[1]
            if len(parts) > 2 and "(one of: " in parts[2]:  # an enum lists its choices (one may be "none")
                kind = "enum"
            elif default in ("true", "false"):
                kind = "bool"
            elif default == "none":
                kind = "optional"
            elif default.lstrip("-").isdigit():
                kind = "int"
            else:
                try:
                    float(default)
                    kind = "real"
                except ValueError:
                    kind = "enum"
            self.kinds[key] = kind
            self.defaults[key] = default


def _number(v, key):
    if isinstance(v, bool):
        return 1.0 if v else 0.0
    if hasattr(v, "item") and not isinstance(v, (int, float)):  # a 0-d torch tensor or numpy scalar
        try:
            v = v.item()
        except (TypeError, ValueError, RuntimeError):
            raise _lib.invalid(f"hyperparameter {key}: a tensor of {getattr(v, 'numel', lambda: '?')()} "
                               f"elements is not one number") from None
    if not isinstance(v, (int, float)):
        raise _lib.invalid(f"hyperparameter {key}={v!r} is a {type(v).__name__}, not a number (a tuple where "
                           f"one value belongs: another optimizer's settings?)")
    try:
        x = float(v)
    except OverflowError:
        raise _lib.invalid(f"hyperparameter {key}={v!r} does not fit a double") from None
    if x != x:  # the library reads NaN as "unset" (an optional key's default): say None for that, as the CLI does
        raise _lib.invalid(f"hyperparameter {key}=nan is NaN (None unsets an optional key)")
    return x


def _text(s, what):
    """s as the library's C string: refused with one line when it holds a NUL (C would read the prefix)."""
    if not isinstance(s, str):
        raise _lib.invalid(f"{what} is a {type(s).__name__}, not a string")
    if "\0" in s:
        raise _lib.invalid(f"{what} {s.split(chr(0))[0]!r}... holds a NUL character")
    return s.encode()


def _c_int(v, what):
    """v as a C int index (a group): refused with one line outside [0, 2^31) (ctypes would wrap it)."""
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 2**31:
        raise _lib.invalid(f"{what} {v!r} is not an index in [0, 2^31)")
    return v


def format_value(key, v):
    """One value in the syntax of dopt_optim_create (a Python float's repr reads back exactly with strtod)."""
    if v is None:
        return "none"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        if any(c in v for c in ",=\0") or not v.strip():
            raise ValueError(f"distopt: hyperparameter {key}={v!r}: not a valid value")
        return v.strip()
    x = _number(v, key)
    if isinstance(v, int) and x == int(v):  # an integer as one (ns_steps=5, not 5.0)
        return str(int(v))
    return repr(x)


def format_hparams(values):
    out = []
    for k, v in values.items():
        if not isinstance(k, str) or not k or any(c in k for c in ",= \t\0"):
            raise ValueError(f"distopt: {k!r} is not a hyperparameter name")
        out.append(f"{k}={format_value(k, v)}")
    return ",".join(out)


# ---- a handle ------------------------------------------------------------------------------------------

class Handle:
    """Owns one dopt_optim. Parameters are borrowed addresses: whoever adds one keeps its memory alive and
    unmoved for the handle's life (the frontends hold references)."""

    def __init__(self, name, values):
        self.name = name
        self.ptr = None
        # one library call at a time per handle: steps from several threads are serialised, close() waits for a
        # step under way (the library's handle is not thread-safe; ctypes releases the GIL during each call)
        self.lock = threading.RLock()
        ptr = ctypes.c_void_p()
        call(lib.dopt_optim_create, _text(name, "optimizer name"), format_hparams(values).encode(), ctypes.byref(ptr))
        self.ptr = ptr
        self.spec = Spec(name)
        self.enum_names = {}  # (group, key) -> an enum's choice as given
        for k, v in values.items():
            if self.spec.kinds.get(k) == "enum":
                self.enum_names[(0, k)] = v.strip() if isinstance(v, str) else v

    def close(self):
        lock = getattr(self, "lock", None)
        if lock is None:
            return
        with lock:
            ptr, self.ptr = getattr(self, "ptr", None), None
            if ptr:
                lib.dopt_optim_destroy(ptr)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def _live(self):
        if not self.ptr:
            raise ValueError(f"distopt {self.name}: the optimizer is closed")
        return self.ptr

    # groups and hyperparameters
    def add_group(self, values):
        g = ctypes.c_int()
        call(lib.dopt_optim_add_group, self._live(), format_hparams(values).encode(), ctypes.byref(g))
        for k, v in values.items():
            if self.spec.kinds.get(k) == "enum":
                self.enum_names[(g.value, k)] = v.strip() if isinstance(v, str) else v
        return g.value

    def num_groups(self):
        return lib.dopt_optim_num_groups(self._live())

    def keys(self, extra=()):
        keys = list(self.spec.kinds)
        return keys + [k for k in extra if k not in keys]

    def get(self, group, key):
        """A hyperparameter as Python sees it: bool for booleans, None for an unset optional key, an enum's
        choice by name (as given, or the default), int for an integer key (rank, seed, block_size, ...),
        else a float."""
        v = ctypes.c_double()
        call(lib.dopt_optim_get_hparam, self._live(), _c_int(group, "group"), _text(key, "hyperparameter name"),
             ctypes.byref(v))
        kind = self.spec.kinds.get(key, "real")
        x = v.value
        if kind == "bool":
            return x != 0.0
        if math.isnan(x):
            return None
        if kind == "enum":
            for g in (group, 0):
                if (g, key) in self.enum_names:
                    return self.enum_names[(g, key)]
            return self.spec.defaults[key]
        if kind == "int" and x == math.floor(x):
            return int(x)
        return x

    def _enum_index(self, key, choice):
        """The index the library stores for enum `key` = `choice` (read back from a throwaway optimizer)."""
        ptr = ctypes.c_void_p()
        call(lib.dopt_optim_create, self.name.encode(), f"{key}={format_value(key, choice)}".encode(),
             ctypes.byref(ptr))
        try:
            v = ctypes.c_double()
            call(lib.dopt_optim_get_hparam, ptr, 0, key.encode(), ctypes.byref(v))
            return v.value
        finally:
            lib.dopt_optim_destroy(ptr)

    def read_group(self, group, extra=()):
        return {k: self.get(group, k) for k in self.keys(extra)}

    def set(self, group, key, value):
        if isinstance(value, str):
            x = self._enum_index(key, value)
        elif value is None:
            x = math.nan
        else:
            x = _number(value, key)
        call(lib.dopt_optim_set_hparam, self._live(), _c_int(group, "group"), _text(key, "hyperparameter name"), x)
        if self.spec.kinds.get(key) == "enum":
            self.enum_names[(group, key)] = value.strip() if isinstance(value, str) else value

    # parameters
    def add_param(self, group, address, shape, name, master=None):
        """address: the parameter's fp32 storage; or, with master (the address of its fp32 master weights), its
        bf16 working copy, which every step leaves the master rounded (include/distopt/optim.h)."""
        shape = tuple(int(d) for d in shape)
        if len(shape) > _lib.MAX_DIMS:
            raise ValueError(f"distopt: parameter '{name}' has {len(shape)} dimensions (at most {_lib.MAX_DIMS})")
        pc = _lib.ParamConfig()
        pc.struct_size = ctypes.sizeof(_lib.ParamConfig)
        pc.version = _lib.PARAM_CONFIG_VERSION
        bname = _text(name, "parameter name")
        pc.name = bname
        pc.ndim = len(shape)
        for i, d in enumerate(shape):
            pc.shape[i] = d
        pc.dtype = _lib.F32 if master is None else _lib.BF16
        pc.data = address
        pc.master = master
        pc.layer = lib.dopt_layer_from_name(bname)
        pid = ctypes.c_int()
        call(lib.dopt_optim_add_param, self._live(), _c_int(group, "group"), ctypes.byref(pc), ctypes.byref(pid))
        return pid.value

    def num_params(self):
        return lib.dopt_optim_num_params(self._live())

    def step(self, grad_addresses, bf16=None):
        """grad_addresses[i]: the address of parameter i's fp32 gradient, or None (no gradient); bf16[i] true:
        that gradient is bf16 (widened exactly by the library)."""
        n = self.num_params()
        if len(grad_addresses) != n:
            raise ValueError(f"distopt {self.name}: {len(grad_addresses)} gradients for {n} parameters")
        arr = (ctypes.c_void_p * max(n, 1))(*grad_addresses)
        if bf16 is None or not any(bf16):
            call(lib.dopt_optim_step, self._live(), arr if n else None)
            return
        types = (ctypes.c_int * max(n, 1))(*[_lib.BF16 if b else _lib.F32 for b in bf16])
        call(lib.dopt_optim_step_typed, self._live(), arr if n else None, types)

    def set_mode(self, eval_mode):
        """Train (False) or evaluation (True) mode: dopt_optim_set_mode."""
        call(lib.dopt_optim_set_mode, self._live(), 1 if eval_mode else 0)

    def declare_mode(self, eval_mode):
        """The parameters are already in this mode (a loaded checkpoint): dopt_optim_declare_mode."""
        call(lib.dopt_optim_declare_mode, self._live(), 1 if eval_mode else 0)

    def get_mode(self):
        return bool(lib.dopt_optim_get_mode(self._live()))

    # states
    def get_step(self, param):
        v = ctypes.c_int64()
        call(lib.dopt_optim_get_step, self._live(), param, ctypes.byref(v))
        return v.value

    def counters(self, param):
        """Parameter param's counters (docs/api.md "Counters"): ({name: count} of the last step,
        {name: count} since creation)."""
        c = _lib.Counters()
        c.size, c.version = ctypes.sizeof(c), _lib.COUNTERS_VERSION
        call(lib.dopt_optim_counters, self._live(), param, ctypes.byref(c))
        names = [lib.dopt_counter_name(k).decode() for k in range(c.n)]
        return ({n: c.last[k] for k, n in enumerate(names)}, {n: c.total[k] for k, n in enumerate(names)})

    def set_step(self, param, step):
        call(lib.dopt_optim_set_step, self._live(), self.param_index(param), _lib.count(step, "step"))

    def get_gstep(self):
        return int(lib.dopt_optim_get_gstep(self._live()))

    def set_gstep(self, gstep):
        call(lib.dopt_optim_set_gstep, self._live(), _lib.count(gstep, "gstep"))

    def param_index(self, param):
        """param as an index of this optimizer's parameters, else distopt.Error."""
        n = self.num_params()
        if isinstance(param, bool) or not isinstance(param, int) or not 0 <= param < n:
            raise _lib.invalid(f"distopt {self.name}: parameter {param!r} out of range [0, {n})")
        return param

    def init_state(self, param):
        call(lib.dopt_optim_init_state, self._live(), param)

    def views(self, param):
        """[(name, dtype code, shape, address, bytes)] of a parameter's states (empty before its first step)."""
        out = []
        param = self.param_index(param)
        for k in range(lib.dopt_optim_num_states(self._live(), param)):
            v = _lib.StateView()
            call(lib.dopt_optim_state, self.ptr, param, k, ctypes.byref(v))
            out.append((_s(v.name), v.dtype, tuple(v.shape[i] for i in range(v.ndim)), v.data, v.bytes))
        return out

    def state_bytes(self, param=-1):
        a, f = ctypes.c_size_t(), ctypes.c_size_t()
        call(lib.dopt_optim_state_bytes, self._live(), param, ctypes.byref(a), ctypes.byref(f))
        return a.value, f.value

    def export_state(self, param):
        """(step, {name: (dtype, shape, bytes)}) copies, or None when the parameter has no state."""
        views = self.views(param)
        if not views:
            return None
        return self.get_step(param), {n: (d, s, ctypes.string_at(a, b)) for n, d, s, a, b in views}

    def import_state(self, param, exported):
        step, states = exported
        self.init_state(param)
        for n, d, s, a, b in self.views(param):
            if n not in states:
                raise ValueError(f"distopt {self.name}: state '{n}' of parameter {param} missing")
            dt, shape, data = states[n]
            if dt != d or tuple(shape) != s or len(data) != b:
                raise ValueError(f"distopt {self.name}: state '{n}' of parameter {param} does not fit")
            ctypes.memmove(a, data, b)
        self.set_step(param, step)


def _locked(fn):
    @functools.wraps(fn)
    def under_lock(self, *args, **kwargs):
        with self.lock:
            return fn(self, *args, **kwargs)
    return under_lock


for _m in ("add_group", "num_groups", "get", "set", "add_param", "num_params", "step", "get_step", "counters",
           "set_step", "get_gstep", "set_gstep", "param_index", "init_state", "views", "state_bytes", "export_state",
           "import_state"):
    setattr(Handle, _m, _locked(getattr(Handle, _m)))

__all__ = ["Error", "Handle", "Spec", "names", "info", "describe"]
