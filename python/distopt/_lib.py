"""The C library through ctypes: loading, prototypes, structs, status checking.

The library is, in this order: the file named by the environment variable DISTOPT_LIBRARY (a build tree's
libdistopt.so), the libdistopt.so installed inside this package (pip install ./python), or the system's
(ctypes.util.find_library, e.g. after cmake --install into a prefix the dynamic linker searches).
"""
import ctypes
import ctypes.util
import os

MAX_DIMS = 8  # DOPT_MAX_DIMS (include/distopt/dtype.h)
PARAM_CONFIG_VERSION = 1  # DOPT_PARAM_CONFIG_VERSION (include/distopt/optim.h)
OPTIM_INFO_VERSION = 1  # DOPT_OPTIM_INFO_VERSION

# dopt_dtype (include/distopt/dtype.h): value -> (safetensors name, bytes per element)
DTYPES = {0: ("F32", 4), 1: ("F64", 8), 2: ("BF16", 2), 3: ("F16", 2), 4: ("I32", 4), 5: ("I64", 8),
          6: ("U8", 1), 7: ("I8", 1)}
F32 = 0
BF16 = 2


class Error(RuntimeError):
    """A call into the library returned a status other than DOPT_OK.

    str(error) is the library's one-line message (dopt_last_error(): "DOPT_ERR_...: detail");
    `status` is the numeric code, `status_name` its name ("DOPT_ERR_INVALID_ARG"), `message` the line.
    """

    def __init__(self, status, status_name, message):
        super().__init__(message)
        self.status = status
        self.status_name = status_name
        self.message = message


Error.__module__ = "distopt"  # shown as distopt.Error in tracebacks


def invalid(message):
    """A distopt.Error for a bad argument caught before the library is called (DOPT_ERR_INVALID_ARG)."""
    return Error(1, "DOPT_ERR_INVALID_ARG", f"DOPT_ERR_INVALID_ARG: {message}")


INT64_MAX = 2**63 - 1


def count(value, what):
    """value as a non-negative int64 count (a step, a clock): an integral int, float or 0-d tensor in
    [0, 2^63 - 1], else distopt.Error naming `what` (ctypes would wrap 2**70 or 1e30 silently)."""
    v = value
    if hasattr(v, "item") and not isinstance(v, (int, float)):
        try:
            v = v.item()
        except (TypeError, ValueError, RuntimeError):
            raise invalid(f"{what} is {type(value).__name__} of several values, not a count") from None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise invalid(f"{what} is {v!r}, not a count")
    if isinstance(v, float) and (v != v or v in (float("inf"), float("-inf")) or v != int(v)):
        raise invalid(f"{what} is {v!r}, not a whole number")
    if not 0 <= int(v) <= INT64_MAX:
        raise invalid(f"{what} is {v!r}, outside [0, 2^63 - 1]")
    return int(v)

class ParamConfig(ctypes.Structure):  # dopt_param_config, version 1
    _fields_ = [("struct_size", ctypes.c_uint32), ("version", ctypes.c_uint32), ("name", ctypes.c_char_p),
                ("ndim", ctypes.c_int), ("shape", ctypes.c_int64 * MAX_DIMS), ("dtype", ctypes.c_int),
                ("data", ctypes.c_void_p), ("master", ctypes.c_void_p), ("layer", ctypes.c_int)]


class StateView(ctypes.Structure):  # dopt_state_view
    _fields_ = [("name", ctypes.c_char_p), ("dtype", ctypes.c_int), ("ndim", ctypes.c_int),
                ("shape", ctypes.c_int64 * MAX_DIMS), ("data", ctypes.c_void_p), ("bytes", ctypes.c_size_t)]


COUNTERS_MAX = 32  # DOPT_COUNTERS_MAX (include/distopt/optim.h)
COUNTERS_VERSION = 1


class Counters(ctypes.Structure):  # dopt_counters
    _fields_ = [("size", ctypes.c_size_t), ("version", ctypes.c_int), ("n", ctypes.c_int), ("held", ctypes.c_int),
                ("primary", ctypes.c_int), ("last", ctypes.c_int64 * COUNTERS_MAX),
                ("total", ctypes.c_int64 * COUNTERS_MAX)]


class OptimInfo(ctypes.Structure):  # dopt_optim_info
    _fields_ = [("version", ctypes.c_int), ("name", ctypes.c_char_p), ("summary", ctypes.c_char_p),
                ("distributable", ctypes.c_int), ("wrapper", ctypes.c_int), ("example", ctypes.c_char_p),
                ("grid", ctypes.POINTER(ctypes.c_char_p)), ("grid_count", ctypes.c_int), ("grid_ci", ctypes.c_int)]


LAYOUT_PIECE_VERSION = 1  # DOPT_LAYOUT_PIECE_VERSION (include/distopt/layout.h)


class LayoutPiece(ctypes.Structure):  # dopt_layout_piece: one rank's piece of a parameter (docs/layout.md)
    _fields_ = [("struct_size", ctypes.c_uint32), ("version", ctypes.c_uint32), ("block_dim", ctypes.c_int),
                ("block_lo", ctypes.c_int64), ("block_len", ctypes.c_int64), ("lo", ctypes.c_int64),
                ("len", ctypes.c_int64), ("stage", ctypes.c_int), ("expert", ctypes.c_int)]

    @classmethod
    def new(cls, block=None, lo=0, len=-1, stage=-1, expert=-1):  # noqa: A002 (the C field's name)
        """DOPT_LAYOUT_PIECE_INIT with the given fields; block: {"dim", "lo", "len"} or None."""
        b = block or {}
        return cls(ctypes.sizeof(cls), LAYOUT_PIECE_VERSION, int(b.get("dim", -1)), int(b.get("lo", 0)),
                   int(b.get("len", 0)), int(lo), int(len), int(stage), int(expert))


def _find():
    env = os.environ.get("DISTOPT_LIBRARY")
    if env:
        if not os.path.isfile(env):
            raise ImportError(f"distopt: DISTOPT_LIBRARY={env!r} is not a file (point it at a built libdistopt.so)")
        return env
    here = os.path.dirname(os.path.abspath(__file__))
    for name in ("libdistopt.so", "libdistopt.so.0", "libdistopt.dylib"):
        path = os.path.join(here, name)
        if os.path.isfile(path):
            return path
    found = ctypes.util.find_library("distopt")
    if found:
        return found
    raise ImportError("distopt: libdistopt.so not found: install the package (pip install ./python), "
                      "or set DISTOPT_LIBRARY=/path/to/build/libdistopt.so")


path = _find()
try:
    lib = ctypes.CDLL(path)
except OSError as e:
    raise ImportError(f"distopt: cannot load {path}: {e}") from None

_P = ctypes.c_void_p
_S = ctypes.c_char_p
_I = ctypes.c_int
_PROTOTYPES = {
    "dopt_status_name": (_S, [_I]),
    "dopt_status_str": (_S, [_I]),
    "dopt_last_error": (_S, []),
    "dopt_clear_error": (None, []),
    "dopt_dtype_size": (ctypes.c_size_t, [_I]),
    "dopt_optim_registry_count": (_I, []),
    "dopt_optim_registry_name": (_S, [_I]),
    "dopt_optim_registry_info": (_I, [_I, ctypes.POINTER(OptimInfo)]),
    "dopt_optim_describe": (_I, [_S, ctypes.c_char_p, ctypes.c_size_t]),
    "dopt_optim_create": (_I, [_S, _S, ctypes.POINTER(_P)]),
    "dopt_optim_destroy": (None, [_P]),
    "dopt_optim_add_group": (_I, [_P, _S, ctypes.POINTER(_I)]),
    "dopt_optim_num_groups": (_I, [_P]),
    "dopt_optim_get_hparam": (_I, [_P, _I, _S, ctypes.POINTER(ctypes.c_double)]),
    "dopt_optim_set_hparam": (_I, [_P, _I, _S, ctypes.c_double]),
    "dopt_optim_add_param": (_I, [_P, _I, ctypes.POINTER(ParamConfig), ctypes.POINTER(_I)]),
    "dopt_optim_num_params": (_I, [_P]),
    "dopt_optim_step": (_I, [_P, ctypes.POINTER(_P)]),
    "dopt_optim_step_typed": (_I, [_P, ctypes.POINTER(_P), ctypes.POINTER(ctypes.c_int)]),
    "dopt_optim_set_mode": (_I, [_P, _I]),
    "dopt_optim_get_mode": (_I, [_P]),
    "dopt_optim_declare_mode": (_I, [_P, _I]),
    "dopt_optim_num_states": (_I, [_P, _I]),
    "dopt_optim_state": (_I, [_P, _I, _I, ctypes.POINTER(StateView)]),
    "dopt_optim_init_state": (_I, [_P, _I]),
    "dopt_optim_get_step": (_I, [_P, _I, ctypes.POINTER(ctypes.c_int64)]),
    "dopt_optim_set_step": (_I, [_P, _I, ctypes.c_int64]),
    "dopt_optim_get_gstep": (ctypes.c_int64, [_P]),
    "dopt_optim_set_gstep": (_I, [_P, ctypes.c_int64]),
    "dopt_optim_state_bytes": (_I, [_P, _I, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)]),
    "dopt_layer_from_name": (_I, [_S]),
    "dopt_optim_counters": (_I, [_P, _I, ctypes.POINTER(Counters)]),
    "dopt_counter_name": (_S, [_I]),
    "dopt_layout_piece_check": (_I, [_I, ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(LayoutPiece)]),
    "dopt_layout_piece_extent": (ctypes.c_int64, [_I, ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(LayoutPiece)]),
    "dopt_layout_cover": (_I, [_S, _I, ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(LayoutPiece),
                               ctypes.POINTER(_I), ctypes.c_size_t, ctypes.POINTER(_I)]),
}
for _name, (_res, _args) in _PROTOTYPES.items():
    _fn = getattr(lib, _name)
    _fn.restype = _res
    _fn.argtypes = _args


def _text(b):
    return b.decode("utf-8", "replace") if b is not None else ""


def status_name(status):
    return _text(lib.dopt_status_name(status))


def check(status):
    """Raises Error for a status other than DOPT_OK (0), with the library's message."""
    if status == 0:
        return
    name = status_name(status)
    msg = _text(lib.dopt_last_error()) or f"{name}: {_text(lib.dopt_status_str(status))}"
    raise Error(status, name, msg)


def call(fn, *args):
    """fn(*args) for a function that returns a dopt_status; the message is this call's (cleared first)."""
    lib.dopt_clear_error()
    check(fn(*args))
