#!/usr/bin/env python3
"""Golden data for distopt's 8-bit blockwise states: bitsandbytes' dynamic maps.

Writes ``bnb_maps.safetensors`` next to this file with two F32 [256] tensors,
``signed`` = ``bitsandbytes.functional.create_dynamic_map(signed=True)`` (the
first-moment map of the 8-bit optimizers) and ``unsigned`` =
``create_dynamic_map(signed=False)`` (the second-moment map).  Nothing here
reimplements the map: the values are what the installed package returns.

Environment (the same as gen_golden.py): Debian's python3-torch 1.13 in
``<repo>/.golden-venv/bnb`` (``/usr/bin/python3 -m venv --system-site-packages``)
plus ``pip install --no-deps bitsandbytes==0.43.1``.  On a machine without
CUDA ``import bitsandbytes`` only warns ("compiled without GPU support") and
``create_dynamic_map`` is pure torch (torch.linspace, fp32 tensor arithmetic,
Python sort), so the package is imported normally.  If a future pin refuses
to import without CUDA, ``load_create_dynamic_map`` falls back to executing
only the source of that one function, taken from the installed
``bitsandbytes/functional.py`` with ``ast``, in a namespace holding torch
(the function uses nothing else); the metadata then says ``loaded=isolated``.

The maps are identical in bitsandbytes 0.43.x and current releases (the
function has not changed since the 0.41.1 indentation fix).  They are built
on the CPU, so they depend on torch's CPU linspace kernel: the metadata
records the torch version and its CPU capability line.

Usage:  python3 datasets/golden/gen_bnb.py
"""

import ast
import json
import os
import struct
import subprocess
import sys

BNB_VERSION = "0.43.1"
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
VENV = os.path.join(REPO, ".golden-venv", "bnb")
VENV_PY = os.path.join(VENV, "bin", "python")
OUT = os.path.join(HERE, "bnb_maps.safetensors")


def bootstrap():
    sys_py = "/usr/bin/python3"
    if subprocess.run([sys_py, "-c", "import torch, venv"], capture_output=True).returncode != 0:
        sys.exit("need Debian packages: apt-get install -y python3-torch python3-venv")
    if not os.path.exists(VENV_PY):
        subprocess.check_call([sys_py, "-m", "venv", "--system-site-packages", VENV])
    have = subprocess.run([VENV_PY, "-m", "pip", "show", "bitsandbytes"], capture_output=True, text=True).stdout
    if ("Version: " + BNB_VERSION) not in have:
        subprocess.check_call([VENV_PY, "-m", "pip", "--disable-pip-version-check", "install", "-q",
                               "--no-deps", "bitsandbytes==" + BNB_VERSION])
    os.execv(VENV_PY, [VENV_PY, os.path.abspath(__file__)] + sys.argv[1:])


def load_create_dynamic_map():
    import torch
    try:
        import bitsandbytes.functional as F
        return F.create_dynamic_map, "import"
    except Exception:  # pragma: no cover - only if the import needs CUDA
        import importlib.util
        spec = importlib.util.find_spec("bitsandbytes")
        src_path = os.path.join(os.path.dirname(spec.origin), "functional.py")
        tree = ast.parse(open(src_path).read())
        fn = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "create_dynamic_map"][0]
        ns = {"torch": torch}
        exec(compile(ast.Module(body=[fn], type_ignores=[]), src_path, "exec"), ns)
        return ns["create_dynamic_map"], "isolated"


def write_safetensors(path, tensors, metadata):
    import numpy as np
    header, blobs, off = {}, [], 0
    for name, arr in tensors:
        b = np.asarray(arr, dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(np.shape(arr)), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    header["__metadata__"] = dict(metadata)
    hb = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hb += b" " * ((-len(hb)) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for b in blobs:
            f.write(b)


def main():
    if os.path.realpath(sys.prefix) != os.path.realpath(VENV):
        bootstrap()
    import torch
    torch.set_num_threads(1)
    import importlib.metadata
    fn, how = load_create_dynamic_map()
    s = fn(signed=True).to(torch.float32).numpy()
    u = fn(signed=False).to(torch.float32).numpy()
    assert s.shape == (256,) and u.shape == (256,)
    cap = [ln.strip() for ln in torch.__config__.show().splitlines() if "CPU capability" in ln]
    meta = {
        "generator": "datasets/golden/gen_bnb.py",
        "upstream": "bitsandbytes==%s create_dynamic_map(signed, max_exponent_bits=7, total_bits=8)"
                    % importlib.metadata.version("bitsandbytes"),
        "torch": torch.__version__,
        "torch_cpu": cap[0] if cap else "unknown",
        "loaded": how,
    }
    write_safetensors(OUT, [("signed", s), ("unsigned", u)], meta)
    print("wrote", OUT, "signed[128]=%r signed[254]=%r unsigned[1]=%r" % (float(s[128]), float(s[254]), float(u[1])))


if __name__ == "__main__":
    main()
