#!/usr/bin/env python3
"""Golden vectors for distopt's `q_galore` from upstream q_galore_torch.

Runs the pure-torch parts of q_galore_torch 1.0 (PyPI `q-galore-torch==1.0`,
installed with --no-deps) in fp32 on CPU with one thread:

  quant.safetensors  GaLoreProjector._quantize (int4/int8, groups and per-row)
                     and AdamW8bit._quantize / _quantize_stochastic_round
                     (the INT8 weight re-gridding, group 256);
  lazy_<case>.safetensors
                     GaLoreProjector.project() over a gradient sequence with
                     quant=True (refresh, lazy gap rule, quantised projector,
                     dequantised projection) and a scripted case whose
                     "SVD" returns prepared matrices (signed cosines of -1).

Interventions (documented in docs/q_galore.md):
  * q_galore_torch/__init__.py and q_galore_adamw8bit.py import bitsandbytes
    (CUDA). The package is registered without running __init__, and stub
    modules `bitsandbytes.optim.optimizer` (Optimizer2State = object) and
    `bitsandbytes.functional` are installed so q_galore_adamw8bit imports;
    only its _quantize* methods are called (they use torch only). torch 1.13
    (Debian) lacks torch._disable_dynamo, a torch-2 decorator on the unused
    zero_grad: it is set to the identity before the import. No bnb code
    runs, so there is no Q-GaLore optimizer step here (bnb's 8-bit kernel is
    CUDA-only; distopt's kernel is tested against bnb in test_adamw8bit.c).
  * torch's SVD signs are arbitrary: get_orthogonal_matrix is wrapped to apply
    distopt's sign convention (largest-|x| component positive), as
    gen_galore.py does; a sign flip is exact and changes nothing else.
  * _quantize_stochastic_round draws torch.rand_like: for the golden run it is
    replaced by distopt's counter-based generator (splitmix64 finaliser keyed
    (seed, step, tensor, element), reimplemented below), so the rounding rule
    is compared exactly.

Usage:  python3 datasets/golden/gen_qgalore.py
"""

import importlib.util
import json
import os
import struct
import subprocess
import sys
import types

QGALORE_VERSION = "1.0"
REQUIREMENTS = ["q-galore-torch==" + QGALORE_VERSION]
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
VENV = os.environ.get("DOPT_GOLDEN_VENV", os.path.join(REPO, ".golden-venv", "q_galore"))
VENV_PY = os.path.join(VENV, "bin", "python")
OUT = os.path.join(HERE, "qgalore")
SEED = 20240607


def in_venv():
    return os.path.realpath(sys.prefix) == os.path.realpath(VENV)


def bootstrap():
    if not os.path.exists(VENV_PY):
        subprocess.check_call(["/usr/bin/python3", "-m", "venv", "--system-site-packages", VENV])
    probe = "import importlib.util as u, sys; sys.exit(0 if u.find_spec('q_galore_torch') else 1)"
    if subprocess.call([VENV_PY, "-c", probe]) != 0:
        subprocess.check_call([VENV_PY, "-m", "pip", "install", "--no-deps"] + REQUIREMENTS)
    os.execv(VENV_PY, [VENV_PY, os.path.abspath(__file__)] + sys.argv[1:])


def load_qgalore():
    # stub bitsandbytes: only names imported at module level
    bnb = types.ModuleType("bitsandbytes")
    optim = types.ModuleType("bitsandbytes.optim")
    optimizer = types.ModuleType("bitsandbytes.optim.optimizer")
    optimizer.Optimizer2State = object
    functional = types.ModuleType("bitsandbytes.functional")
    bnb.optim, bnb.functional, optim.optimizer = optim, functional, optimizer
    for name, mod in (("bitsandbytes", bnb), ("bitsandbytes.optim", optim),
                      ("bitsandbytes.optim.optimizer", optimizer), ("bitsandbytes.functional", functional)):
        sys.modules[name] = mod
    spec = importlib.util.find_spec("q_galore_torch")
    pkgdir = list(spec.submodule_search_locations)[0]
    pkg_spec = importlib.util.spec_from_file_location("q_galore_torch", os.path.join(pkgdir, "__init__.py"),
                                                      submodule_search_locations=[pkgdir])
    sys.modules["q_galore_torch"] = importlib.util.module_from_spec(pkg_spec)  # __init__ not executed
    import torch
    if not hasattr(torch, "_disable_dynamo"):  # torch 2.x decorator on zero_grad (not called here)
        torch._disable_dynamo = lambda f: f
    import q_galore_torch.q_galore_projector as qp
    import q_galore_torch.q_galore_adamw8bit as qa
    return qp, qa, pkgdir


def write_safetensors(path, tensors, metadata):
    header, blobs, off = {"__metadata__": metadata}, [], 0
    for name, t in tensors:
        b = t.detach().contiguous().float().numpy().astype("<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    hb = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hb += b" " * ((8 - (8 + len(hb)) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for b in blobs:
            f.write(b)


M64 = (1 << 64) - 1


def mix64(z):
    z = (z + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def ctr_uniform(seed, a, b, c):
    h = mix64(mix64(mix64(mix64(seed) ^ a) ^ b) ^ c)
    return (h >> 40) * 2.0 ** -24


def main():
    import hashlib
    import torch
    torch.set_num_threads(1)
    qp, qa, pkgdir = load_qgalore()
    gen = torch.Generator().manual_seed(SEED)
    os.makedirs(OUT, exist_ok=True)
    shas = {f: hashlib.sha256(open(os.path.join(pkgdir, f), "rb").read()).hexdigest()[:16]
            for f in ("q_galore_projector.py", "q_galore_adamw8bit.py")}
    upstream = "q-galore-torch==%s (q_galore_projector.py %s, q_galore_adamw8bit.py %s) torch==%s" % (
        QGALORE_VERSION, shas["q_galore_projector.py"], shas["q_galore_adamw8bit.py"], torch.__version__)

    # ---- quantiser ---------------------------------------------------------------
    proj = qp.GaLoreProjector(rank=1)
    tensors, cases = [], []

    def edge():
        rows = [torch.linspace(0.5, 1.0, 16),                        # all positive: zeros 0, saturates
                torch.full((16,), 0.3),                               # constant: range clamped to 1e-5
                0.3 + torch.arange(16) * 1e-7,                        # tiny range
                torch.tensor([0.0, 15.0] + [k + 0.5 for k in range(14)]),  # scales 1: .5 ties, half to even
                -torch.linspace(0.1, 2.0, 16),                        # all negative
                torch.tensor([-7.5, 7.5] + [k - 6.5 for k in range(14)])]
        return torch.stack(rows).float()

    qcases = [("q4_g16", torch.randn(8, 32, generator=gen), 16, 4),
              ("q8_g64", torch.randn(16, 64, generator=gen) * 0.02, 64, 8),
              ("q4_row", torch.randn(6, 40, generator=gen), -1, 4),
              ("q8_row", torch.randn(5, 33, generator=gen) * 3, -1, 8),
              ("q4_edge", edge(), -1, 4),
              ("q8_edge", edge(), -1, 8),
              ("q4_edge_g8", edge(), 8, 4)]
    for name, w, g, bits in qcases:
        q, s, z, _ = proj._quantize(w.clone(), q_group_size=g, n_bit=bits)
        tensors += [("%s/w" % name, w), ("%s/q" % name, q.float()), ("%s/scales" % name, s.flatten()),
                    ("%s/zeros" % name, z.flatten())]
        cases.append("%s:%d:%d" % (name, g, bits))
    # INT8 weights: nearest and stochastic rounding (group 256)
    w = torch.randn(16, 64, generator=gen) * 0.05
    q, s, z = qa.AdamW8bit._quantize(None, w.clone(), q_group_size=256)
    tensors += [("w8/w", w), ("w8/q", q.float()), ("w8/scales", s.flatten()), ("w8/zeros", z.flatten())]
    sr_seed, sr_step, sr_tensor = 7, 3, 2
    orig_rand_like = torch.rand_like

    def ctr_rand_like(x):
        n = x.numel()
        return torch.tensor([ctr_uniform(sr_seed, sr_step, sr_tensor, i) for i in range(n)],
                            dtype=torch.float32).reshape(x.shape)

    torch.rand_like = ctr_rand_like
    try:
        q, s, z = qa.AdamW8bit._quantize_stochastic_round(None, w.clone(), q_group_size=256)
    finally:
        torch.rand_like = orig_rand_like
    tensors += [("w8sr/q", q.float()), ("w8sr/scales", s.flatten()), ("w8sr/zeros", z.flatten())]
    meta = {"cases": ",".join(cases), "sr_key": "%d,%d,%d" % (sr_seed, sr_step, sr_tensor), "upstream": upstream,
            "intervention": "bitsandbytes stubbed (not called); torch.rand_like -> distopt counter generator (w8sr)",
            "generator": "datasets/golden/gen_qgalore.py"}
    path = os.path.join(OUT, "quant.safetensors")
    write_safetensors(path, tensors, meta)
    print("%-22s %5d tensors %9d bytes" % ("quant", len(tensors), os.path.getsize(path)))

    # ---- projector: refresh, lazy rule, quantised projection ---------------------------
    def sign_normalise(rows):
        idx = torch.argmax(rows.abs(), dim=1)
        return torch.sign(rows.gather(1, idx[:, None]))[:, 0]

    orig = qp.GaLoreProjector.get_orthogonal_matrix

    def normalised(self, weights, rank, type):
        out = orig(self, weights, rank, type)
        if type == "right":
            return out * sign_normalise(out)[:, None]
        return out * sign_normalise(out.t())[None, :]

    def ortho(n, k):
        q, _ = torch.linalg.qr(torch.randn(n, k, generator=gen, dtype=torch.float64))
        return q

    def grads(m, n, steps, stable):
        k = min(m, n)
        s = 0.7 ** torch.arange(k, dtype=torch.float64)
        U0, V0 = ortho(m, k), ortho(n, k)
        out = []
        for _ in range(steps):
            if stable:  # same subspace, small perturbation
                G = (U0 * s) @ V0.t() + 1e-3 * torch.randn(m, n, generator=gen, dtype=torch.float64)
            else:
                G = (ortho(m, k) * s) @ ortho(n, k).t()
            out.append(G.float())
        return out

    STEPS = 40
    lcases = [  # name, shape, stable, rank, gap, group, bits, cos_threshold, gamma, queue
        ("stable_right", (24, 16), True, 4, 2, 16, 4, 0.4, 2, 3),
        ("stable_left", (12, 20), True, 3, 2, -1, 8, 0.4, 2, 3),
        ("random_right", (20, 20), False, 4, 2, -1, 4, 0.4, 2, 3),
        ("stable_gamma15", (24, 16), True, 4, 3, 32, 8, 0.9, 1.5, 2),
    ]
    qp.GaLoreProjector.get_orthogonal_matrix = normalised
    for name, (m, n), stable, rank, gap, group, bits, thr, gamma, qs in lcases:
        pr = qp.GaLoreProjector(rank, update_proj_gap=gap, quant=True, group_size=group, n_bit=bits,
                                cos_threshold=thr, gamma_proj=gamma, queue_size=qs)
        gs = grads(m, n, STEPS, stable)
        tensors = []
        for t, G in enumerate(gs):
            R = pr.project(G.clone(), t)
            back = pr.project_back(R)
            key = "step/%d/" % (t + 1)
            queue = pr.queue + [0.0] * (qs - len(pr.queue))
            tensors += [(key + "grad", G), (key + "low_rank", R), (key + "back", back),
                        (key + "q", pr.ortho_matrix.float()), (key + "scales", pr.ortho_matrix_scales.flatten()),
                        (key + "zeros", pr.ortho_matrix_zeros.flatten()),
                        (key + "lazy", torch.tensor([float(pr.update_proj_gap), float(pr.svd_count),
                                                     float(len(pr.queue))] + queue, dtype=torch.float64))]
        meta = {"case": name, "shape": "%d,%d" % (m, n), "steps": str(STEPS),
                "hparams": "rank=%d,update_proj_gap=%d,proj_group_size=%d,proj_bits=%d,cos_threshold=%r,"
                           "gamma_proj=%r,queue_size=%d" % (rank, gap, group, bits, thr, gamma, qs),
                "upstream": upstream, "intervention": "get_orthogonal_matrix wrapped: sign convention",
                "generator": "datasets/golden/gen_qgalore.py"}
        path = os.path.join(OUT, "lazy_%s.safetensors" % name)
        write_safetensors(path, tensors, meta)
        print("%-22s %5d tensors %9d bytes" % (name, len(tensors), os.path.getsize(path)))

    # scripted "SVD": prepared projectors; first vectors alternate in sign (signed cosine -1)
    n, r, qs = 8, 2, 3
    base = ortho(n, r).t().float()
    script = []
    for k in range(12):
        sign = -1.0 if (k % 2 and k < 8) else 1.0
        B = base.clone()
        B[0] *= sign
        B[1] = (B[1] + 0.01 * k * B[0]) if k >= 8 else B[1]
        script.append(B)
    it = iter(script)
    qp.GaLoreProjector.get_orthogonal_matrix = lambda self, w, rank, type: next(it).clone()
    pr = qp.GaLoreProjector(r, update_proj_gap=1, quant=False, cos_threshold=0.4, gamma_proj=2, queue_size=qs)
    tensors, refreshes, t = [], [], 0
    while pr.svd_count < len(script) and t < 4096:
        before = pr.svd_count
        pr.project(torch.zeros(16, n), t)
        if pr.svd_count != before:
            refreshes.append((t, pr.update_proj_gap))
        t += 1
    for k, B in enumerate(script):
        tensors.append(("script/%d" % k, B))
    tensors.append(("refresh_iter", torch.tensor([float(a) for a, _ in refreshes], dtype=torch.float64)))
    tensors.append(("gap_after", torch.tensor([float(b) for _, b in refreshes], dtype=torch.float64)))
    meta = {"case": "scripted", "hparams": "update_proj_gap=1,cos_threshold=0.4,gamma_proj=2,queue_size=%d" % qs,
            "upstream": upstream, "intervention": "get_orthogonal_matrix replaced by a script (right side)",
            "generator": "datasets/golden/gen_qgalore.py"}
    path = os.path.join(OUT, "lazy_scripted.safetensors")
    write_safetensors(path, tensors, meta)
    print("%-22s %5d tensors %9d bytes (refreshes %s)" % ("scripted", len(tensors), os.path.getsize(path), refreshes))


if __name__ == "__main__":
    if not in_venv():
        bootstrap()
    main()
