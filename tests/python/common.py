"""Helpers shared by the Python tests (tests/python/): skipping, the run of a unittest module as a CTest
test, the normwise relative error, and a minimal safetensors reader/writer for the CLI cross-check."""
import json
import os
import struct
import sys
import unittest

SKIP = 77  # CTest SKIP_RETURN_CODE


def skip(reason):
    print(f"skipped: {reason}")
    sys.exit(SKIP)


def require(*modules):
    """Exit 77 (skipped) with the reason when one of the modules cannot be imported."""
    for m in modules:
        try:
            __import__(m)
        except ImportError as e:
            skip(f"{sys.executable} cannot import {m} ({e}); Debian: python3-torch python3-numpy")


def main():
    """Runs the calling module's unittest cases; exit 0 only when every case passed and at least one ran."""
    mod = sys.modules["__main__"]
    suite = unittest.defaultTestLoader.loadTestsFromModule(mod)
    result = unittest.TextTestRunner(verbosity=2, stream=sys.stdout).run(suite)
    ran = result.testsRun - len(result.skipped)
    print(f"{ran - len(result.failures) - len(result.errors)} passed, "
          f"{len(result.failures) + len(result.errors)} failed, {len(result.skipped)} skipped")
    sys.exit(0 if result.wasSuccessful() and ran > 0 else 1)


def normwise_rel(a, b):
    """max|a - b| / max|b| (docs/precision.md: the project's measure against upstream)."""
    import numpy as np
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    den = np.abs(b).max()
    return float(np.abs(a - b).max() / den) if den > 0 else float(np.abs(a - b).max())


# ---- safetensors (https://github.com/huggingface/safetensors format), only what the tests need ----------

_DT = {"F32": ("<f4", 4), "I64": ("<i8", 8), "F64": ("<f8", 8), "U8": ("|u1", 1)}


def st_write(path, tensors, metadata=None):
    """tensors: {name: numpy array (float32)} in file order; through the package's writer (the library's)."""
    import numpy as np
    from distopt import _safetensors
    _safetensors.write(path, {k: np.ascontiguousarray(a, dtype=np.float32) for k, a in tensors.items()}, metadata)


def st_read(path):
    """{name: numpy array} of a safetensors file (F32, F64, I64, U8)."""
    import numpy as np
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    base = 8 + n
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        dt, _ = _DT[t["dtype"]]
        b, e = t["data_offsets"]
        out[name] = np.frombuffer(data[base + b:base + e], dtype=dt).reshape(t["shape"]).copy()
    return out


def source_dir():
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def doc_block(marker):
    """The ```python block of docs/python.md that contains `marker` (the page's examples run as written)."""
    with open(os.path.join(source_dir(), "docs", "python.md")) as f:
        text = f.read()
    blocks = [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]
    found = [b for b in blocks if marker in b]
    if len(found) != 1:
        raise AssertionError(f"docs/python.md: {len(found)} python blocks contain {marker!r}")
    return found[0]
