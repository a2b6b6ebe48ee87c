#!/usr/bin/env python3
"""Golden vectors for distopt's `galore_adamw` from upstream galore_torch.

Runs galore_torch 1.0 (PyPI `galore-torch==1.0`, installed with --no-deps)
`GaLoreAdamW` in fp32 on CPU with one thread, on matrices of several shapes
with every proj_type, and records every parameter and every state tensor
after every step into self-contained safetensors files in
datasets/golden/galore/ (each file holds its own init/ and grad/ tensors).

The ONE intervention: torch's SVD returns singular vectors with arbitrary
signs, so `GaLoreProjector.get_orthogonal_matrix` is wrapped to apply
distopt's sign convention to what it returns (for each kept vector, the
largest-magnitude component is made positive, ties to the lowest index; for
'full' the sign is fixed on the left vector and the same flip is applied to
the matching right vector). A flip multiplies a singular vector by -1,
which is exact; both signs are equally valid SVD outputs, so this changes
nothing but the arbitrary sign choice. Nothing else is patched; the
optimizer math is upstream's.

galore_torch/__init__.py imports the 8-bit optimizer (needs bitsandbytes),
so the package is registered without running __init__ and only
galore_torch.adamw / galore_torch.galore_projector are imported.

Usage:  python3 datasets/golden/gen_galore.py
"""

import importlib.util
import json
import os
import struct
import subprocess
import sys

GALORE_VERSION = "1.0"
REQUIREMENTS = [
    "galore-torch==" + GALORE_VERSION,
    # `galore_torch.adamw` imports transformers.utils.versions (require_version)
    "transformers==4.36.2", "huggingface-hub==0.20.1", "tqdm==4.66.1", "regex==2023.12.25",
    "packaging==23.2", "filelock==3.13.1", "fsspec==2023.12.2",
    "safetensors==0.4.1",  # transformers' import-time version check requires it
]
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
VENV = os.environ.get("DOPT_GOLDEN_VENV", os.path.join(REPO, ".golden-venv", "galore_adamw"))
VENV_PY = os.path.join(VENV, "bin", "python")
OUT = os.path.join(HERE, "galore")
SEED = 20240311
STEPS = 24
GAP = 10  # refreshes at 0-based steps 0, 10, 20: three SVDs in 24 steps

SHAPES = [("a", [24, 16]), ("b", [16, 24]), ("c", [20, 20]), ("d", [33, 7])]
PLAIN = [("vec", [16]), ("mat", [6, 9])]  # rank-0 group: plain HF AdamW
BASE = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-6, weight_decay=1e-2, correct_bias=True)
CASES = [  # name, proj_type, rank, scale, base overrides
    ("galore_std", "std", 6, 0.5, {}),
    ("galore_reverse_std", "reverse_std", 6, 0.5, {}),
    ("galore_left", "left", 6, 0.5, {}),
    ("galore_right", "right", 6, 0.5, {}),
    ("galore_full", "full", 5, 0.25, {}),
    ("galore_clamp", "std", 12, 2.0, {"correct_bias": False}),  # d [33,7]: rank 12 -> 7
    # upstream's defaults only: GaLoreAdamW(groups) with no keyword, and the
    # group's projector keys at GaLoreProjector's own defaults (galore_torch
    # requires them in the group); distopt gets no hparams and "rank=6"
    ("galore_defaults", "std", 6, 1.0, None),
]
DEFAULT_GAP = 200  # GaLoreProjector's update_proj_gap default


def in_venv():
    return os.path.realpath(sys.prefix) == os.path.realpath(VENV)


def bootstrap():
    if not os.path.exists(VENV_PY):
        subprocess.check_call(["/usr/bin/python3", "-m", "venv", "--system-site-packages", VENV])
    probe = "import importlib.util as u, sys; sys.exit(0 if u.find_spec('galore_torch') and u.find_spec('transformers') and u.find_spec('safetensors') else 1)"
    if subprocess.call([VENV_PY, "-c", probe]) != 0:
        subprocess.check_call([VENV_PY, "-m", "pip", "install", "--no-deps"] + REQUIREMENTS)
    os.execv(VENV_PY, [VENV_PY, os.path.abspath(__file__)] + sys.argv[1:])


def load_galore():
    spec = importlib.util.find_spec("galore_torch")
    pkgdir = list(spec.submodule_search_locations)[0]
    pkg_spec = importlib.util.spec_from_file_location("galore_torch", os.path.join(pkgdir, "__init__.py"),
                                                      submodule_search_locations=[pkgdir])
    pkg = importlib.util.module_from_spec(pkg_spec)
    sys.modules["galore_torch"] = pkg  # registered, __init__ not executed
    import galore_torch.galore_projector as gp
    import galore_torch.adamw as ga
    return gp, ga, pkgdir


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


def main():
    import hashlib
    import torch
    torch.set_num_threads(1)
    gp, ga, pkgdir = load_galore()

    def sign_normalise(vectors_as_rows):
        idx = torch.argmax(vectors_as_rows.abs(), dim=1)  # first maximal value: ties -> lowest index
        return torch.sign(vectors_as_rows.gather(1, idx[:, None]))[:, 0]

    orig = gp.GaLoreProjector.get_orthogonal_matrix

    def normalised(self, weights, rank, type):
        out = orig(self, weights, rank, type)
        if type == "right":
            s = sign_normalise(out)
            return out * s[:, None]
        if type == "left":
            s = sign_normalise(out.t())
            return out * s[None, :]
        A, B = out
        s = sign_normalise(A.t())
        return [A * s[None, :], B * s[:, None]]

    gp.GaLoreProjector.get_orthogonal_matrix = normalised

    gen = torch.Generator().manual_seed(SEED)

    def ortho(n, k):
        q, _ = torch.linalg.qr(torch.randn(n, k, generator=gen, dtype=torch.float64))
        return q

    def spectral_grad(m, n, scale):
        # well-separated spectrum: s_j = scale * 0.7^j (30% gaps), exact rank min(m, n)
        k = min(m, n)
        s = scale * 0.7 ** torch.arange(k, dtype=torch.float64)
        return ((ortho(m, k) * s) @ ortho(n, k).t()).float()

    os.makedirs(OUT, exist_ok=True)
    shas = {f: hashlib.sha256(open(os.path.join(pkgdir, f), "rb").read()).hexdigest()[:16]
            for f in ("adamw.py", "galore_projector.py")}
    all_params = SHAPES + PLAIN
    inits = {n: torch.randn(*sh, generator=gen) * 0.5 for n, sh in all_params}
    grads = {}
    for t in range(1, STEPS + 1):
        for n, sh in all_params:
            if len(sh) == 2 and n != "mat":
                grads[(t, n)] = spectral_grad(sh[0], sh[1], 1e-4)
            else:
                grads[(t, n)] = torch.randn(*sh, generator=gen) * 1e-4
    only = [a for a in sys.argv[1:] if not a.startswith("-")]  # case names (default: all)
    for case, proj, rank, scale, over in CASES:
        if only and case not in only:
            continue
        defaults = over is None
        gap = DEFAULT_GAP if defaults else GAP
        hp = dict(BASE, **(over or {}))
        ps = {n: torch.nn.Parameter(inits[n].clone()) for n, _ in all_params}
        groups = [
            {"params": [ps[n] for n, _ in SHAPES], "rank": rank, "update_proj_gap": gap, "scale": scale,
             "proj_type": proj},
            {"params": [ps[n] for n, _ in PLAIN]},
        ]
        opt = ga.AdamW(groups, no_deprecation_warning=True, **({} if defaults else hp))
        tensors = [("init/%s" % n, inits[n]) for n, _ in all_params]
        for t in range(1, STEPS + 1):
            for n, _ in all_params:
                ps[n].grad = grads[(t, n)].clone()
                tensors.append(("grad/%d/%s" % (t, n), grads[(t, n)]))
            opt.step()
            for n, _ in all_params:
                tensors.append(("param/%d/%s" % (t, n), ps[n].data.clone()))
                st = opt.state[ps[n]]
                for k, v in st.items():
                    key = "state/%d/%s/" % (t, n)
                    if k == "step":
                        tensors.append((key + "step", torch.tensor(float(v))))
                    elif k == "projector":
                        om = v.ortho_matrix
                        if isinstance(om, list):
                            tensors.append((key + "projector_left", om[0].clone()))
                            tensors.append((key + "projector_right", om[1].clone()))
                        else:
                            tensors.append((key + "projector", om.clone()))
                    else:
                        tensors.append((key + k, v.clone()))
        b = lambda x: "true" if x else "false"
        meta = {
            "optimizer": "galore_adamw",
            "hparams": "" if defaults else "lr=%r,beta1=%r,beta2=%r,eps=%r,weight_decay=%r,correct_bias=%s" % (
                hp["lr"], hp["betas"][0], hp["betas"][1], hp["eps"], hp["weight_decay"], b(hp["correct_bias"])),
            "groups": ",".join(n for n, _ in SHAPES),
            "group_hparams": ("rank=%d" % rank) if defaults else
            "rank=%d,update_proj_gap=%d,scale=%r,proj_type=%s" % (rank, GAP, scale, proj),
            "params": ",".join(n for n, _ in all_params),
            "steps": str(STEPS),
            "seed": str(SEED),
            "case": case,
            "defaults_only": "1" if defaults else "0",
            "upstream": "galore-torch==%s (adamw.py %s, galore_projector.py %s) torch==%s" % (
                GALORE_VERSION, shas["adamw.py"], shas["galore_projector.py"], torch.__version__),
            "intervention": "get_orthogonal_matrix wrapped: sign convention (largest-|x| component positive)",
            "generator": "datasets/golden/gen_galore.py",
        }
        path = os.path.join(OUT, case + ".safetensors")
        write_safetensors(path, tensors, meta)
        print("%-22s %5d tensors %9d bytes" % (case, len(tensors), os.path.getsize(path)))


if __name__ == "__main__":
    if not in_venv():
        bootstrap()
    main()
