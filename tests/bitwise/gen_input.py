#!/usr/bin/env python3
"""Writes a safetensors file for the bitwise before/after check
(tests/bitwise/check_bitwise.sh): init/<p> and grad/<t>/<p> (t = 1..STEPS) for
parameters of several ranks and shapes, with awkward values in the gradients
(exact zeros, zero rows/columns, subnormals, wide magnitude ranges, and, in
parameter 'nonfinite' only, ±inf and NaN). Pure standard library.

usage: gen_input.py OUT.safetensors [STEPS]"""
import json
import math
import random
import struct
import sys

SHAPES = {
    "mat": [96, 130],
    "tall": [257, 7],
    "wide": [5, 301],
    "batch3d": [3, 17, 33],
    "vec": [1001],
    "one": [1, 1],
    "big": [512, 384],
    "nonfinite": [24, 40],
}


def numel(s):
    n = 1
    for d in s:
        n *= d
    return n


def f32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


def rand_value(rng, kind):
    r = rng.random()
    if kind == "init":
        return rng.gauss(0.0, 0.05)
    if r < 0.03:
        return 0.0
    if r < 0.05:
        return rng.choice([1e-40, -3e-42, 1.4e-45, -1.4e-45])  # fp32 subnormals
    if r < 0.07:
        return rng.gauss(0.0, 1.0) * 10.0 ** rng.uniform(-30, 10)  # wide magnitudes
    return rng.gauss(0.0, 1e-3)


def main():
    out = sys.argv[1]
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    rng = random.Random(1234)
    tensors = []
    for name, shape in SHAPES.items():
        n = numel(shape)
        tensors.append(("init/" + name, shape, [rand_value(rng, "init") for _ in range(n)]))
    for t in range(1, steps + 1):
        for name, shape in SHAPES.items():
            n = numel(shape)
            g = [rand_value(rng, "grad") for _ in range(n)]
            if len(shape) >= 2:
                w = shape[-1]
                h = shape[-2]
                r = rng.randrange(h)
                for j in range(w):  # a zero row
                    g[r * w + j] = 0.0
                c = rng.randrange(w)
                for i in range(n // w):  # a zero column
                    g[i * w + c] = 0.0
            if name == "nonfinite" and t >= 3:
                g[rng.randrange(n)] = [math.inf, -math.inf, math.nan][t % 3]
            tensors.append((f"grad/{t}/{name}", shape, g))
    header = {}
    blobs = []
    off = 0
    for name, shape, vals in tensors:
        b = struct.pack(f"<{len(vals)}f", *[f32(v) if math.isfinite(v) else v for v in vals])
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    header["__metadata__"] = {"generator": "tests/bitwise/gen_input.py"}
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * ((8 - len(hb) % 8) % 8)
    with open(out, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for b in blobs:
            f.write(b)


if __name__ == "__main__":
    main()
