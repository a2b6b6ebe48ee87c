#!/usr/bin/env python3
"""Golden vectors for distopt's `galore_adamw` and `galore` (inner=adafactor)
from upstream galore_torch.

Runs galore_torch 1.0 (PyPI `galore-torch==1.0`, installed with --no-deps)
`GaLoreAdamW` and `GaLoreAdafactor` in fp32 on CPU with one thread, on matrices of several shapes
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
galore_torch.adamw / .adafactor / .galore_projector are imported.

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
# GaLoreAdafactor (galore_torch/adafactor.py), distopt's `galore` with inner=adafactor: name, proj_type, rank,
# scale, upstream keyword arguments (HF Adafactor's). Each exercises what the wrapper changes: the RMS and the
# relative step from the full weight, decay of the full weight before the update, momentum and the update clip
# in projector coordinates, factored second moments decided on the low-rank shape
# (kind: "" the 24-step set plus a 3-D parameter in the unprojected group, upstream projects matrices only;
# "defaults": GaLoreAdafactor(groups) with no keyword, the group's projector keys at GaLoreProjector's defaults;
# "long": 200 steps on three parameters, every 10th recorded, refreshes at 0, 50, 100, 150)
ADAFACTOR_CASES = [
    ("galore_adafactor_std", "std", 6, 0.5, dict(beta1=0.9, weight_decay=1e-2), ""),
    ("galore_adafactor_reverse_std", "reverse_std", 6, 1.0, dict(beta1=0.9, clip_threshold=0.5), ""),
    ("galore_adafactor_left", "left", 6, 0.5, dict(lr=1e-2, relative_step=False, scale_parameter=False,
                                                     clip_threshold=0.5, weight_decay=0.1), ""),
    ("galore_adafactor_full", "full", 5, 0.25, dict(beta1=0.5, scale_parameter=False), ""),
    ("galore_adafactor_right", "right", 4, 2.0, dict(lr=3e-3, relative_step=False, decay_rate=-0.5), ""),
    ("galore_adafactor_defaults", "std", 6, 1.0, {}, "defaults"),
    ("galore_adafactor_long", "std", 4, 0.5, dict(beta1=0.9, weight_decay=1e-2), "long"),
]
T3 = [("t3", [2, 4, 6])]  # GaLoreAdafactor cases: a 3-D parameter, unprojected
LONG_SHAPES, LONG_PLAIN = [("a", [24, 16]), ("b", [16, 24])], [("vec", [16])]
LONG_STEPS, LONG_EVERY, LONG_GAP = 200, 10, 50
# distopt's adafactor keys for HF's keyword arguments (eps is the pair eps1, eps2)
ADAFACTOR_KEYS = dict(lr="lr", clip_threshold="clip_threshold", decay_rate="decay_rate", beta1="beta1",
                      weight_decay="weight_decay", scale_parameter="scale_parameter",
                      relative_step="relative_step", warmup_init="warmup_init")


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
    import galore_torch.adafactor as gf
    return gp, ga, gf, pkgdir


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
    gp, ga, gf, pkgdir = load_galore()

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
            for f in ("adamw.py", "adafactor.py", "galore_projector.py")}
    all_params = SHAPES + PLAIN
    inits = {n: torch.randn(*sh, generator=gen) * 0.5 for n, sh in all_params}
    grads = {}
    for t in range(1, STEPS + 1):
        for n, sh in all_params:
            if len(sh) == 2 and n != "mat":
                grads[(t, n)] = spectral_grad(sh[0], sh[1], 1e-4)
            else:
                grads[(t, n)] = torch.randn(*sh, generator=gen) * 1e-4
    # drawn after the GaLoreAdamW inputs, which stay as they were: the 3-D parameter, then the long set
    for n, sh in T3:
        inits[n] = torch.randn(*sh, generator=gen) * 0.5
        for t in range(1, STEPS + 1):
            grads[(t, n)] = torch.randn(*sh, generator=gen) * 1e-4
    long_inits = {n: torch.randn(*sh, generator=gen) * 0.5 for n, sh in LONG_SHAPES + LONG_PLAIN}
    long_grads = {}
    for t in range(1, LONG_STEPS + 1):
        for n, sh in LONG_SHAPES:
            long_grads[(t, n)] = spectral_grad(sh[0], sh[1], 1e-4)
        for n, sh in LONG_PLAIN:
            long_grads[(t, n)] = torch.randn(*sh, generator=gen) * 1e-4
    only = [a for a in sys.argv[1:] if not a.startswith("-")]  # case names (default: all)
    b = lambda x: "true" if x else "false"

    def record(case, opt, ps, meta, params=None, groups=SHAPES, init=inits, grad=grads, steps=STEPS, every=1):
        """Steps opt over the gradients and writes every parameter and state after every `every`-th step."""
        params = params or all_params
        tensors = [("init/%s" % n, init[n]) for n, _ in params]
        for t in range(1, steps + 1):
            for n, _ in params:
                ps[n].grad = grad[(t, n)].clone()
                tensors.append(("grad/%d/%s" % (t, n), grad[(t, n)]))
            opt.step()
            if t % every:
                continue
            for n, _ in params:
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
                        tensors.append((key + k, torch.as_tensor(v).clone()))
        meta.update({
            "params": ",".join(n for n, _ in params),
            "groups": ",".join(n for n, _ in groups),
            "steps": str(steps),
            "seed": str(SEED),
            "case": case,
            "intervention": "get_orthogonal_matrix wrapped: sign convention (largest-|x| component positive)",
            "generator": "datasets/golden/gen_galore.py",
        })
        path = os.path.join(OUT, case + ".safetensors")
        if every != 1:
            meta["record_every"] = str(every)
        write_safetensors(path, tensors, meta)
        print("%-22s %5d tensors %9d bytes" % (case, len(tensors), os.path.getsize(path)))

    def groups_of(ps, rank, gap, scale, proj, shapes=SHAPES, plain=PLAIN):
        return [
            {"params": [ps[n] for n, _ in shapes], "rank": rank, "update_proj_gap": gap, "scale": scale,
             "proj_type": proj},
            {"params": [ps[n] for n, _ in plain]},
        ]

    for case, proj, rank, scale, over in CASES:
        if only and case not in only:
            continue
        defaults = over is None
        gap = DEFAULT_GAP if defaults else GAP
        hp = dict(BASE, **(over or {}))
        ps = {n: torch.nn.Parameter(inits[n].clone()) for n, _ in all_params}
        opt = ga.AdamW(groups_of(ps, rank, gap, scale, proj), no_deprecation_warning=True, **({} if defaults else hp))
        record(case, opt, ps, {
            "optimizer": "galore_adamw",
            "hparams": "" if defaults else "lr=%r,beta1=%r,beta2=%r,eps=%r,weight_decay=%r,correct_bias=%s" % (
                hp["lr"], hp["betas"][0], hp["betas"][1], hp["eps"], hp["weight_decay"], b(hp["correct_bias"])),
            "group_hparams": ("rank=%d" % rank) if defaults else
            "rank=%d,update_proj_gap=%d,scale=%r,proj_type=%s" % (rank, GAP, scale, proj),
            "defaults_only": "1" if defaults else "0",
            "upstream": "galore-torch==%s (adamw.py %s, galore_projector.py %s) torch==%s" % (
                GALORE_VERSION, shas["adamw.py"], shas["galore_projector.py"], torch.__version__),
        })
    for case, proj, rank, scale, kw, kind in ADAFACTOR_CASES:
        if only and case not in only:
            continue
        long = kind == "long"
        shapes, plain = (LONG_SHAPES, LONG_PLAIN) if long else (SHAPES, PLAIN + T3)
        gap = {"defaults": DEFAULT_GAP, "long": LONG_GAP}.get(kind, GAP)
        init = long_inits if long else inits
        ps = {n: torch.nn.Parameter(init[n].clone()) for n, _ in shapes + plain}
        opt = gf.Adafactor(groups_of(ps, rank, gap, scale, proj, shapes, plain), **kw)
        mine = ["inner=adafactor"] + ["%s=%s" % (ADAFACTOR_KEYS[k], b(v) if isinstance(v, bool) else repr(v))
                                      for k, v in kw.items()]
        record(case, opt, ps, {
            "optimizer": "galore",
            "hparams": ",".join(mine),
            "group_hparams": ("rank=%d" % rank) if kind == "defaults" else
            "rank=%d,update_proj_gap=%d,scale=%r,proj_type=%s" % (rank, gap, scale, proj),
            "defaults_only": "1" if kind == "defaults" else "0",
            "upstream": "galore-torch==%s (adafactor.py %s, galore_projector.py %s) torch==%s" % (
                GALORE_VERSION, shas["adafactor.py"], shas["galore_projector.py"], torch.__version__),
        }, shapes + plain, shapes, init, long_grads if long else grads, LONG_STEPS if long else STEPS,
            LONG_EVERY if long else 1)

if __name__ == "__main__":
    if not in_venv():
        bootstrap()
    main()
