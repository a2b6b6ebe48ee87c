"""safetensors files through the library's own reader and writer (dopt_st_*: the header validated on read;
names and shapes validated and the file written atomically on write), from and to numpy arrays or torch
tensors: the one safetensors reader and writer of the package (distopt.record's blocks, the tests' input
files, tools/ckpt_torch.py); and write_bytes, the library's atomic write of any file (distopt.record's
index.json)."""
import ctypes

from . import _lib

_P = ctypes.c_void_p
_CODES = {name: code for code, (name, _size) in _lib.DTYPES.items()}  # "F32" -> dopt_dtype 0, ...
_TORCH_NAMES = {"torch.float32": "F32", "torch.float64": "F64", "torch.bfloat16": "BF16", "torch.float16": "F16",
                "torch.int32": "I32", "torch.int64": "I64", "torch.uint8": "U8", "torch.int8": "I8"}
_NUMPY_NAMES = {"float32": "F32", "float64": "F64", "float16": "F16", "int32": "I32", "int64": "I64",
                "uint8": "U8", "int8": "I8"}


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
_load = _fn("dopt_st_load", ctypes.c_int, [ctypes.c_char_p, ctypes.POINTER(_P)])
_st_free = _fn("dopt_st_free", None, [_P])
_count = _fn("dopt_st_count", ctypes.c_int, [_P])
_get_meta = _fn("dopt_st_meta", ctypes.c_char_p, [_P, ctypes.c_char_p])


class _Tensor(ctypes.Structure):  # dopt_st_tensor
    _fields_ = [("name", ctypes.c_char_p), ("dtype", ctypes.c_int), ("ndim", ctypes.c_int),
                ("shape", ctypes.c_int64 * _lib.MAX_DIMS), ("numel", ctypes.c_size_t), ("data", _P),
                ("bytes", ctypes.c_size_t)]


_get = _fn("dopt_st_get", ctypes.c_int, [_P, ctypes.c_int, ctypes.POINTER(_Tensor)])
_write_file = _fn("dopt_write_file", ctypes.c_int, [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t])


def write_bytes(path, data):
    """path <- data (bytes) through the library's one rule for outputs (docs/files.md): atomic, a link's target
    replaced in its own folder, a FIFO, socket or folder refused."""
    _lib.call(_write_file, path.encode(), data, len(data))


def _view(a, name):
    """(dtype name, shape, data address) of a C-contiguous CPU torch tensor or numpy array."""
    if hasattr(a, "data_ptr"):  # torch (imported by whoever made the tensor)
        dt = _TORCH_NAMES.get(str(a.dtype))
        ok = dt and a.device.type == "cpu" and a.is_contiguous()
        shape, addr = tuple(a.shape), a.data_ptr()
    else:  # numpy
        dt = _NUMPY_NAMES.get(str(a.dtype))
        ok = dt and a.flags["C_CONTIGUOUS"]
        shape, addr = a.shape, a.ctypes.data
    if not ok:
        raise ValueError(f"safetensors: tensor '{name}': expected a contiguous CPU array of "
                         f"{', '.join(_CODES)}, got {a.dtype}")
    return dt, shape, addr


def read(path, meta_keys=()):
    """({name: (dtype name, shape, bytes)}, {key: value} for the metadata keys asked for that the file has) of
    a safetensors file, in file order, read and validated by the library (offsets, sizes, overlaps)."""
    f = _P()
    _lib.call(_load, path.encode(), ctypes.byref(f))
    try:
        out = {}
        for i in range(_count(f)):
            t = _Tensor()
            _lib.call(_get, f, i, ctypes.byref(t))
            data = ctypes.string_at(t.data, t.bytes) if t.bytes else b""
            out[t.name.decode()] = (_lib.DTYPES[t.dtype][0], tuple(t.shape[k] for k in range(t.ndim)), data)
        meta = {}
        for key in meta_keys:
            v = _get_meta(f, key.encode())
            if v is not None:
                meta[key] = v.decode("utf-8", "replace")
        return out, meta
    finally:
        _st_free(f)


def read_torch(path):
    """{name: torch tensor} of a safetensors file (copies), via read()."""
    import torch
    from ._torch_api import _TORCH  # dopt_dtype code -> torch dtype
    out = {}
    for name, (dt, shape, data) in read(path)[0].items():
        td = _TORCH[_CODES[dt]]
        t = torch.frombuffer(bytearray(data), dtype=td) if data else torch.zeros(0, dtype=td)
        out[name] = t.reshape(shape)
    return out


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
