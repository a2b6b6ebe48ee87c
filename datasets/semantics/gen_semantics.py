#!/usr/bin/env python3
"""Torch's own answers for the plugin semantics distopt claims to share.

Writes ``semantics.safetensors`` next to this file; ``tests/unit/test_semantics.c``
compares distopt with it. Only Debian's ``python3-torch`` (1.13, CPU) is needed:

    /usr/bin/python3 datasets/semantics/gen_semantics.py

What it records (fp32, CPU, one thread, seeded):

* ``clip/<case>/in/<p>``, ``clip/<case>/out/<p>``, ``clip/<case>/total_norm``:
  gradients before and after ``torch.nn.utils.clip_grad_norm_(params,
  max_norm, norm_type=2)`` and the total norm it returned. Cases: clipping
  active, inactive, an ``inf`` element, a ``NaN`` element, and finite
  gradients whose fp32 norm overflows (1e20).
* ``accum/g/<m>/<p>``: micro-batch gradients m = 0..M-1;
  ``accum/loop/<p>``: ``p.grad`` after torch's accumulation loop, each
  micro-batch loss divided by M before ``backward()``;
  ``accum/documented/<p>``: the project's documented order (docs/dp-sum.md):
  micro-batches added in fp32 in order, then divided by M.
  ``accum/dp/<r>/<p>``: per-rank sums for R data-parallel ranks and
  ``accum/dp_avg/<p>``: their exact sum (float64, exact for these values),
  rounded to fp32 once, divided by R·M.
* ``bf16/in`` and ``bf16/out``: fp32 values (ties, subnormals, overflow to
  inf, infinities, NaNs of both signs) and ``x.to(torch.bfloat16)``'s bits.
"""
import json
import os
import struct
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "semantics.safetensors")
SEED = 20261130
SHAPES = {"a": [7, 13], "b": [33], "c": [16, 16], "z": [5]}
SCALE = {"a": 1.0, "b": 1e-3, "c": 10.0, "z": 0.0}
M, R = 3, 4


def cpu_capability():
    for line in torch.__config__.show().splitlines():
        if "CPU capability" in line:
            return line.split(":", 1)[1].strip()
    return "unknown"


def write(path, tensors, meta):
    header, blobs, off = {}, [], 0
    for name, t in tensors:
        t = t.detach().contiguous()
        if t.dtype == torch.float32:
            dt, b = "F32", t.numpy().astype("<f4").tobytes()
        elif t.dtype == torch.bfloat16:
            dt, b = "BF16", t.view(torch.int16).numpy().astype("<i2").tobytes()
        else:
            raise TypeError(t.dtype)
        header[name] = {"dtype": dt, "shape": list(t.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    header["__metadata__"] = meta
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * ((-len(hb)) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(hb)) + hb + b"".join(blobs))
    os.replace(tmp, path)


def main():
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(SEED)
    out = []

    def grads(scale_over=None):
        d = {}
        for p, shp in SHAPES.items():
            s = SCALE[p] if scale_over is None else scale_over.get(p, SCALE[p])
            d[p] = torch.randn(shp, generator=g) * s
        return d

    # --- clipping -------------------------------------------------------------
    cases = [("active", 1.0, None), ("inactive", 1e4, None), ("inf", 1.0, "inf"), ("nan", 1.0, "nan"),
             ("overflow", 1.0, "big")]
    for name, max_norm, special in cases:
        gr = grads()
        if special == "inf":
            gr["a"][2, 3] = float("inf")
        elif special == "nan":
            gr["c"][5, 7] = float("nan")
        elif special == "big":
            gr["b"] = gr["b"] * 1e23  # ~1e20: the squares overflow fp32
        params = []
        for p in SHAPES:
            t = torch.zeros(SHAPES[p], requires_grad=True)
            t.grad = gr[p].clone()
            params.append(t)
            out.append(("clip/%s/in/%s" % (name, p), gr[p]))
        total = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=2.0)
        for p, t in zip(SHAPES, params):
            out.append(("clip/%s/out/%s" % (name, p), t.grad))
        out.append(("clip/%s/total_norm" % name, total.reshape([]).float()))
        out.append(("clip/%s/max_norm" % name, torch.tensor(max_norm, dtype=torch.float32)))

    # --- accumulation ---------------------------------------------------------
    micro = [grads() for _ in range(M)]
    for m in range(M):
        for p in SHAPES:
            out.append(("accum/g/%d/%s" % (m, p), micro[m][p]))
    for p in SHAPES:
        w = torch.zeros(SHAPES[p], requires_grad=True)
        for m in range(M):  # loss_m / M, backward: p.grad accumulates in micro-batch order
            loss = (w * micro[m][p]).sum() / M
            loss.backward()
        out.append(("accum/loop/%s" % p, w.grad))
        acc = micro[0][p].clone()
        for m in range(1, M):
            acc += micro[m][p]
        out.append(("accum/documented/%s" % p, acc / M))
    ranks = [grads({"b": 1e-3, "c": 10.0}) for _ in range(R)]  # per-rank sums of M micro-batches
    for r in range(R):
        for p in SHAPES:
            out.append(("accum/dp/%d/%s" % (r, p), ranks[r][p]))
    for p in SHAPES:
        exact = torch.stack([ranks[r][p].double() for r in range(R)]).sum(0)  # exact: <= 4 terms, < 2^29 apart
        out.append(("accum/dp_avg/%s" % p, exact.float() / float(R * M)))

    # --- bf16 rounding --------------------------------------------------------
    bits = [0x3F808000, 0x3F818000, 0x3F80C000, 0x3F807FFF, 0x00000001, 0x00008000, 0x00018000, 0x807F8000,
            0x7F7FFFFF, 0x7F7F8000, 0xFF7FC000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001,
            0x7FA00000, 0xFFFFFFFF, 0x00000000, 0x80000000, 0x3EAAAAAB, 0xC0490FDB]
    x = torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)
    rnd = torch.randn([1000], generator=g) * torch.exp2(torch.randint(-140, 128, [1000], generator=g).float())
    x = torch.cat([x, rnd])
    out.append(("bf16/in", x))
    out.append(("bf16/out", x.to(torch.bfloat16)))

    meta = {"generator": "datasets/semantics/gen_semantics.py", "torch": torch.__version__,
            "cpu_capability": cpu_capability(), "seed": str(SEED), "micro_batches": str(M), "dp": str(R),
            "params": ",".join(SHAPES)}
    write(OUT, out, meta)
    print("wrote %s: %d tensors" % (OUT, len(out)))


if __name__ == "__main__":
    sys.exit(main())
