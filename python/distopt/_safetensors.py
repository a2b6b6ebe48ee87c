"""Writes safetensors files through the library's own writer (dopt_st_writer_*: names and shapes validated,
the file written atomically), from numpy arrays or torch tensors: the one safetensors writer of the package
(distopt.record's blocks, the tests' input files); and write_bytes, the library's atomic write of any file
(distopt.record's index.json)."""
import ctypes

from . import _lib

_P = ctypes.c_void_p
_CODES = {"F32": 0, "I64": 5}  # dopt_dtype values (include/distopt/dtype.h; _lib.DTYPES)


def _fn(name, res, args):
    f = _lib.lib[name]  # a fresh function object: these prototypes do not touch _lib's
    f.restype = res
    f.argtypes = args
    return f


_create = _fn("dopt_st_writer_create", ctypes.c_int, [ctypes.POINTER(_P)])
_free = _fn("dopt_st_writer_free", None, [_P])
_add = _fn("dopt_st_writer_add", ctypes.c_int,
           [_P, ctypes.c_char_p, ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int64), _P])
_meta = _fn("dopt_st_writer_meta", ctypes.c_int, [_P, ctypes.c_char_p, ctypes.c_char_p])
_save = _fn("dopt_st_writer_save", ctypes.c_int, [_P, ctypes.c_char_p])
_write_file = _fn("dopt_write_file", ctypes.c_int, [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t])


def write_bytes(path, data):
    """path <- data (bytes) through the library's one rule for outputs (docs/files.md): atomic, a link's target
    replaced in its own folder, a FIFO, socket or folder refused."""
    _lib.call(_write_file, path.encode(), data, len(data))


def _view(a, name):
    """(dtype name, shape, data address) of a C-contiguous CPU float32/int64 torch tensor or numpy array."""
    if hasattr(a, "data_ptr"):  # torch (imported by whoever made the tensor)
        dt = {"torch.float32": "F32", "torch.int64": "I64"}.get(str(a.dtype))
        ok = dt and a.device.type == "cpu" and a.is_contiguous()
        shape, addr = tuple(a.shape), a.data_ptr()
    else:  # numpy
        dt = {"float32": "F32", "int64": "I64"}.get(str(a.dtype))
        ok = dt and a.flags["C_CONTIGUOUS"]
        shape, addr = a.shape, a.ctypes.data
    if not ok:
        raise ValueError(f"safetensors: tensor '{name}': expected a contiguous CPU float32 or int64 array, "
                         f"got {a.dtype}")
    return dt, shape, addr


def write(path, tensors, metadata=None):
    """tensors: a dict or (name, array) pairs, in file order; metadata: {key: value} (written as str)."""
    items = list(tensors.items()) if isinstance(tensors, dict) else list(tensors)
    w = _P()
    _lib.call(_create, ctypes.byref(w))
    try:
        for name, a in items:  # the arrays stay referenced by `items` until the file is written
            dt, shape, addr = _view(a, name)
            dims = (ctypes.c_int64 * max(1, len(shape)))(*shape)
            _lib.call(_add, w, name.encode(), _CODES[dt], len(shape), dims, ctypes.c_void_p(addr))
        for k, v in (metadata or {}).items():
            _lib.call(_meta, w, k.encode(), str(v).encode())
        _lib.call(_save, w, path.encode())
    finally:
        _free(w)
