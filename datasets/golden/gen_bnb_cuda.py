#!/usr/bin/env python3
"""Record what bitsandbytes' CUDA AdamW8bit does, for a later comparison with
distopt's adamw8bit. NEEDS A CUDA GPU; not run in CI (no GPU there).

For each pinned bitsandbytes version (each in its own venv, installed from
PyPI with ``--no-deps`` on top of an existing CUDA torch):

    bitsandbytes==0.43.1   -> 8-bit block size 2048 (<= 0.43.x)
    bitsandbytes==0.45.5   -> 8-bit block size 256  (>= 0.44.0)

it runs ``bnb.optim.AdamW8bit`` (defaults: lr 1e-3, betas (0.9, 0.999), eps
1e-8, weight_decay 1e-2, min_8bit_size 4096, percentile_clipping 100, plus a
``pclip5`` case with percentile_clipping=5) on fp32 CUDA parameters for STEPS
steps with deterministic inputs, and writes ``bnb_cuda_<version>.safetensors``
next to this file:

  init/<p>                 F32  initial parameter
  grad/<t>/<p>             F32  gradient of step t (1-based)
  <case>/param/<t>/<p>     F32  parameter after step t
  <case>/state1/<t>/<p>    U8 (8-bit) or F32 (fp32 fallback), likewise state2
  <case>/absmax1/<t>/<p>   F32 (8-bit only), likewise absmax2
  <case>/gnorm_vec/<t>/<p> F32 (pclip5 only)

The metadata records versions, the GPU name and the block size. Parameters
(``numel``) straddle min_8bit_size and block boundaries: 4095 (fp32 path),
4096, 4097, 63x80, 33x200; step 7 and 8 are all-zero gradients, step 12 puts
NaN/inf into three elements of each 8-bit parameter.

A later test can replay init/grad through distopt (block_size from the
metadata) and compare: state bytes equal except rare midpoint flips, and
parameters within a few ulp (fast-math pow/divide/sqrt on the GPU).

Usage on the GPU machine (torch with CUDA already installed):

    python3 datasets/golden/gen_bnb_cuda.py            # both versions
    python3 datasets/golden/gen_bnb_cuda.py --inner    # (internal) one version, current env
"""

import json
import os
import struct
import subprocess
import sys

VERSIONS = ["0.43.1", "0.45.5"]
HERE = os.path.dirname(os.path.abspath(__file__))
SEED = 20240229
STEPS = 24
SHAPES = [("n4095", [4095]), ("n4096", [4096]), ("n4097", [4097]), ("m63x80", [63, 80]), ("m33x200", [33, 200])]
CASES = [("default", {}), ("pclip5", {"percentile_clipping": 5})]


def write_safetensors(path, tensors, metadata):
    import numpy as np
    header, blobs, off = {}, [], 0
    for name, arr in tensors:
        arr = np.ascontiguousarray(arr)
        dt = {"float32": "F32", "uint8": "U8"}[str(arr.dtype)]
        b = arr.astype("<f4" if dt == "F32" else "u1").tobytes()
        header[name] = {"dtype": dt, "shape": list(arr.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * ((-len(hb)) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for b in blobs:
            f.write(b)


def make_inputs(torch):
    gen = torch.Generator().manual_seed(SEED)
    init, grads = {}, {}
    for name, shape in SHAPES:
        init[name] = torch.randn(shape, generator=gen) * 0.5
    for t in range(1, STEPS + 1):
        for name, shape in SHAPES:
            g = torch.randn(shape, generator=gen)
            flat = g.view(-1)
            idx = torch.randint(0, flat.numel(), (3,), generator=gen)
            flat[idx] *= torch.exp(1 + 4 * torch.rand(3, generator=gen))
            if t in (7, 8):
                g.zero_()
            if t == 12 and flat.numel() >= 4096:
                flat[0] = float("nan")
                flat[flat.numel() // 2] = float("inf")
                flat[-1] = float("-inf")
            grads[(t, name)] = g
    return init, grads


def inner(out_path):
    import torch
    import bitsandbytes as bnb
    import importlib.metadata
    version = importlib.metadata.version("bitsandbytes")
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    init, grads = make_inputs(torch)
    tensors = [("init/" + n, init[n].numpy()) for n, _ in SHAPES]
    tensors += [("grad/%d/%s" % (t, n), grads[(t, n)].numpy()) for t in range(1, STEPS + 1) for n, _ in SHAPES]
    block = None
    for case, kw in CASES:
        params = {n: torch.nn.Parameter(init[n].clone().cuda()) for n, _ in SHAPES}
        opt = bnb.optim.AdamW8bit(list(params.values()), **kw)
        for t in range(1, STEPS + 1):
            for n, _ in SHAPES:
                params[n].grad = grads[(t, n)].clone().cuda()
            opt.step()
            torch.cuda.synchronize()
            for n, _ in SHAPES:
                p = params[n]
                st = opt.state[p]
                tensors.append(("%s/param/%d/%s" % (case, t, n), p.detach().cpu().numpy()))
                for key in ("state1", "state2", "absmax1", "absmax2", "gnorm_vec"):
                    if key in st:
                        tensors.append(("%s/%s/%d/%s" % (case, key, t, n), st[key].detach().cpu().numpy()))
                if "absmax1" in st and block is None:
                    block = -(-p.numel() // st["absmax1"].numel())  # ceil
                    block = 1 << (block - 1).bit_length()
    meta = {"generator": "datasets/golden/gen_bnb_cuda.py", "bitsandbytes": version, "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(0), "block_size": block, "steps": STEPS, "seed": SEED,
            "params": ",".join(n for n, _ in SHAPES), "cases": ",".join(c for c, _ in CASES)}
    write_safetensors(out_path, tensors, meta)
    print("wrote", out_path, "block", block)


def main():
    if "--inner" in sys.argv:
        inner(sys.argv[sys.argv.index("--inner") + 1])
        return
    for v in VERSIONS:
        venv = os.path.join(os.path.dirname(os.path.dirname(HERE)), ".venv-bnb-cuda-" + v)  # git-ignored
        py = os.path.join(venv, "bin", "python")
        if not os.path.exists(py):
            subprocess.check_call([sys.executable, "-m", "venv", "--system-site-packages", venv])
            subprocess.check_call([py, "-m", "pip", "install", "-q", "--no-deps", "bitsandbytes==" + v])
        out = os.path.join(HERE, "bnb_cuda_%s.safetensors" % v)
        subprocess.check_call([py, os.path.abspath(__file__), "--inner", out])


if __name__ == "__main__":
    main()
