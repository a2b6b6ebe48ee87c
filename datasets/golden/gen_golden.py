#!/usr/bin/env python3
"""Generate golden test vectors for distopt's single-device optimizers.

Runs the *upstream* optimizer implementations (torch.optim.AdamW,
transformers' Adafactor, came_pytorch's CAME, ColossalAI's Lamb) in fp32 on
CPU with one thread.  It writes the shared inputs (initial parameters and
every step's gradients) once to ``inputs.safetensors`` and one safetensors
file per case (parameters and optimizer state after every step) into this
folder.  Nothing here reimplements optimizer math: the generator only builds
parameters/gradients, calls ``optimizer.step()`` and records what upstream
produced.

Usage (from anywhere):

    python3 datasets/golden/gen_golden.py            # set up env + regenerate
    python3 datasets/golden/gen_golden.py --check    # also verify the files read back

On first run it creates ``<repo>/.golden-venv`` (``/usr/bin/python3 -m venv
--system-site-packages`` on top of Debian's ``python3-torch``), pip-installs
the pinned packages below with ``--no-deps``, downloads the pinned ColossalAI
sdist (``pip download --no-deps``) and extracts the single file
``colossalai/nn/optimizer/lamb.py`` from it, then re-executes itself inside
that venv.  Output is deterministic (seeded generator, single thread).
"""

import hashlib
import json
import os
import struct
import subprocess
import sys

# --------------------------------------------------------------------------
# Pinned upstream versions (recorded in every file's metadata).
# --------------------------------------------------------------------------
DEBIAN_APT = ["python3-torch", "python3-venv"]  # torch 1.13.1+dfsg (CPU)
TORCH_EXPECTED = "1.13"                          # Debian 1.13.1 reports 1.13.0a0
TRANSFORMERS_VERSION = "4.36.2"
CAME_VERSION = "0.1.3"
COLOSSALAI_VERSION = "0.4.0"
COLOSSALAI_LAMB_PATH = "colossalai/nn/optimizer/lamb.py"
# Installed with --no-deps.  The non-optimizer packages are only what
# `import transformers.optimization` needs at import time (transformers'
# runtime dependency-version check); none of them touch optimizer math.
REQUIREMENTS = [
    "transformers==" + TRANSFORMERS_VERSION,
    "huggingface-hub==0.20.1",
    "tqdm==4.66.1",
    "regex==2023.12.25",
    "packaging==23.2",
    "filelock==3.13.1",
    "fsspec==2023.12.2",
    "came-pytorch==" + CAME_VERSION,
    "safetensors==0.4.1",  # only used by --check to read files back
]

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
VENV = os.path.join(REPO, ".golden-venv")
VENV_PY = os.path.join(VENV, "bin", "python")
DOWNLOADS = os.path.join(VENV, "downloads")
LAMB_FILE = os.path.join(DOWNLOADS, "colossalai-%s-lamb.py" % COLOSSALAI_VERSION)
STAMP = os.path.join(VENV, "golden-requirements.txt")
GENERATOR_REL = "datasets/golden/gen_golden.py"
INPUTS_NAME = "inputs.safetensors"
INPUTS = os.path.join(HERE, INPUTS_NAME)

SEED = 20240229
STEPS = 20
PARAM_SHAPES = [
    ("vec", [13]),
    ("row", [1, 37]),
    ("small", [7, 13]),
    ("tall", [13, 7]),
    ("wide", [33, 65]),
    ("sq", [16, 16]),
    ("t3", [2, 3, 5]),
    ("zeros", [5, 8]),
]
# per-parameter gradient scale (1e-3 .. 1)
GRAD_SCALE = {"vec": 1.0, "row": 0.3, "small": 0.1, "tall": 3e-2,
              "wide": 1e-2, "sq": 3e-3, "t3": 1e-3, "zeros": 0.5}
ZERO_GRAD_STEPS = (7, 8)      # every param gets an all-zero gradient
NONE_GRAD = {3: ("small",)}   # grad=None (absent) at these steps
SQ_ZEROS_STEP = 5             # `sq` gradient has some exact zeros
SQ_ZEROS = ((0, 0), (3, 11), (11, 11), (15, 5), (15, 15), (7, 0))


# --------------------------------------------------------------------------
# Environment bootstrap
# --------------------------------------------------------------------------
def _run(cmd, **kw):
    print("+ " + " ".join(cmd), flush=True)
    subprocess.check_call(cmd, **kw)


def bootstrap():
    """Make sure the venv exists with the pinned packages, then re-exec in it."""
    sys_py = "/usr/bin/python3"
    probe = subprocess.run([sys_py, "-c", "import torch, venv"],
                           capture_output=True)
    if probe.returncode != 0:
        if os.geteuid() == 0:
            _run(["apt-get", "update", "-qq"])
            _run(["apt-get", "install", "-y", "-qq"] + DEBIAN_APT,
                 env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"))
        else:
            sys.exit("need Debian packages: apt-get install -y " + " ".join(DEBIAN_APT))
    if not os.path.exists(VENV_PY):
        _run([sys_py, "-m", "venv", "--system-site-packages", VENV])
    wanted = "\n".join(REQUIREMENTS + ["colossalai==" + COLOSSALAI_VERSION]) + "\n"
    have = open(STAMP).read() if os.path.exists(STAMP) else ""
    if have != wanted or not os.path.exists(LAMB_FILE):
        pip = [VENV_PY, "-m", "pip", "--disable-pip-version-check"]
        _run(pip + ["install", "-q", "--no-deps"] + REQUIREMENTS)
        os.makedirs(DOWNLOADS, exist_ok=True)
        _run(pip + ["download", "-q", "--no-deps", "--no-build-isolation",
                    "-d", DOWNLOADS, "colossalai==" + COLOSSALAI_VERSION])
        extract_lamb()
        with open(STAMP, "w") as f:
            f.write(wanted)
    os.execv(VENV_PY, [VENV_PY, os.path.abspath(__file__)] + sys.argv[1:])


def extract_lamb():
    import tarfile
    import zipfile
    stem = "colossalai-" + COLOSSALAI_VERSION
    for name in sorted(os.listdir(DOWNLOADS)):
        full = os.path.join(DOWNLOADS, name)
        if name.startswith(stem) and name.endswith(".tar.gz"):
            with tarfile.open(full) as tf:
                data = tf.extractfile(stem + "/" + COLOSSALAI_LAMB_PATH).read()
            break
        if name.startswith(stem.replace("-", "_")) and name.endswith(".whl"):
            with zipfile.ZipFile(full) as zf:
                data = zf.read(COLOSSALAI_LAMB_PATH)
            break
    else:
        sys.exit("colossalai %s archive not found in %s" % (COLOSSALAI_VERSION, DOWNLOADS))
    with open(LAMB_FILE, "wb") as f:
        f.write(data)


def in_venv():
    return os.path.realpath(sys.prefix) == os.path.realpath(VENV)


# --------------------------------------------------------------------------
# safetensors writer / reader (format written by hand: 8-byte LE header
# length, JSON header, raw little-endian data)
# --------------------------------------------------------------------------
def write_safetensors(path, tensors, metadata):
    """tensors: list of (name, float32 numpy array) in file order."""
    import numpy as np
    header = {}
    blobs = []
    off = 0
    for name, arr in tensors:
        arr = np.array(arr, dtype="<f4", order="C")  # (ascontiguousarray would make 0-d 1-d)
        b = arr.tobytes()
        header[name] = {"dtype": "F32", "shape": list(arr.shape),
                        "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    header["__metadata__"] = dict(metadata)
    hb = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hb += b" " * ((-len(hb)) % 8)  # pad so the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for b in blobs:
            f.write(b)


def read_safetensors(path):
    import numpy as np
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    meta = header.pop("__metadata__", {})
    base = 8 + n
    out = {}
    for name, info in header.items():
        assert info["dtype"] == "F32", name
        b, e = info["data_offsets"]
        out[name] = np.frombuffer(raw[base + b:base + e], dtype="<f4").reshape(info["shape"])
    return meta, out


# --------------------------------------------------------------------------
# Upstream optimizers
# --------------------------------------------------------------------------
def sha256_file(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def load_upstream():
    import importlib.util
    import inspect
    import torch
    from transformers.optimization import Adafactor
    import transformers
    import came_pytorch
    from came_pytorch import CAME

    spec = importlib.util.spec_from_file_location("colossalai_lamb", LAMB_FILE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    Lamb = mod.Lamb
    if "adam" not in inspect.signature(Lamb.__init__).parameters or \
            "bias_correction" not in inspect.signature(Lamb.__init__).parameters:
        sys.exit("ColossalAI Lamb lacks adam/bias_correction flags")

    came_src = inspect.getsource(CAME.step)
    came_fix = "exp_avg.clone()" in came_src

    assert transformers.__version__ == TRANSFORMERS_VERSION, transformers.__version__
    assert torch.__version__.startswith(TORCH_EXPECTED), torch.__version__
    try:
        deb = subprocess.run(["dpkg-query", "-W", "-f=${Version}", "python3-torch"],
                             capture_output=True, text=True).stdout.strip()
    except OSError:
        deb = ""
    torch_pin = "torch==1.13.1" + (" (debian python3-torch %s, torch.__version__=%s)"
                                   % (deb, torch.__version__) if deb else "")
    return {
        "torch": torch,
        "Adafactor": Adafactor,
        "CAME": CAME,
        "Lamb": Lamb,
        "came_fix": came_fix,
        "came_sha": sha256_file(inspect.getsourcefile(CAME)),
        "lamb_sha": sha256_file(LAMB_FILE),
        "torch_pin": torch_pin,
    }


# distopt defaults (registry key names); used to fill the "hparams" string.
DEFAULTS = {
    "adamw": dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2, amsgrad=False),
    "adafactor": dict(lr=None, eps1=1e-30, eps2=1e-3, clip_threshold=1.0, decay_rate=-0.8,
                      beta1=None, weight_decay=0.0, scale_parameter=True,
                      relative_step=True, warmup_init=False),
    "came": dict(lr=None, eps1=1e-30, eps2=1e-16, clip_threshold=1.0, beta1=0.9,
                 beta2=0.999, beta3=0.9999, weight_decay=0.0),
    "lamb": dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.0,
                 adam=False, bias_correction=False),
}

# name -> (optimizer, overrides, groups or None)
CASES = [
    ("adamw_default", "adamw", {}, None),
    ("adamw_nowd", "adamw", dict(weight_decay=0.0, lr=1e-2), None),
    ("adamw_amsgrad", "adamw", dict(amsgrad=True, lr=5e-3, beta2=0.99), None),
    ("adafactor_default", "adafactor", {}, None),
    ("adafactor_beta1_wd", "adafactor", dict(beta1=0.9, weight_decay=0.01), None),
    ("adafactor_warmup", "adafactor", dict(warmup_init=True), None),
    ("adafactor_noscale", "adafactor", dict(scale_parameter=False), None),
    ("adafactor_lr", "adafactor", dict(relative_step=False, lr=1e-2, scale_parameter=False), None),
    ("adafactor_lr_scale", "adafactor", dict(relative_step=False, lr=1e-2), None),
    ("adafactor_clip", "adafactor", dict(relative_step=False, lr=1e-1, clip_threshold=0.5,
                                         decay_rate=-0.5), None),
    ("adafactor_groups", "adafactor", {},
     [(["vec", "small"], dict(weight_decay=0.0)),
      (["row", "tall", "wide", "sq", "t3", "zeros"], dict(weight_decay=0.05, beta1=0.9))]),
    ("came_default", "came", dict(lr=2e-4), None),
    ("came_wd", "came", dict(lr=1e-3, weight_decay=1e-2, beta1=0.9, beta2=0.95, beta3=0.999), None),
    ("lamb_default", "lamb", {}, None),
    ("lamb_bc_wd", "lamb", dict(bias_correction=True, weight_decay=0.01, lr=1e-2), None),
    ("lamb_adam", "lamb", dict(adam=True, weight_decay=0.01), None),
]


def fmt_value(v):
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return repr(v)
    return str(v)


def fmt_hparams(hp):
    """All used keys (None = 'not set', omitted)."""
    return ",".join("%s=%s" % (k, fmt_value(v)) for k, v in hp.items() if v is not None)


def upstream_kwargs(opt, hp):
    """Map distopt key names to the upstream constructor's arguments."""
    if opt == "adamw":
        return dict(lr=hp["lr"], betas=(hp["beta1"], hp["beta2"]), eps=hp["eps"],
                    weight_decay=hp["weight_decay"], amsgrad=hp["amsgrad"], foreach=False)
    if opt == "adafactor":
        return dict(lr=hp["lr"], eps=(hp["eps1"], hp["eps2"]), clip_threshold=hp["clip_threshold"],
                    decay_rate=hp["decay_rate"], beta1=hp["beta1"],
                    weight_decay=hp["weight_decay"], scale_parameter=hp["scale_parameter"],
                    relative_step=hp["relative_step"], warmup_init=hp["warmup_init"])
    if opt == "came":
        return dict(lr=hp["lr"], eps=(hp["eps1"], hp["eps2"]), clip_threshold=hp["clip_threshold"],
                    betas=(hp["beta1"], hp["beta2"], hp["beta3"]),
                    weight_decay=hp["weight_decay"])
    if opt == "lamb":
        return dict(lr=hp["lr"], betas=(hp["beta1"], hp["beta2"]), eps=hp["eps"],
                    weight_decay=hp["weight_decay"], adam=hp["adam"],
                    bias_correction=hp["bias_correction"])
    raise ValueError(opt)


def group_kwargs(opt, base_hp, override):
    """Per-group constructor options: every upstream argument whose value
    changes when the group's overrides are applied on top of `base_hp`
    (plus the overridden ones themselves)."""
    hp = dict(base_hp)
    hp.update(override)
    base = upstream_kwargs(opt, base_hp)
    kw = upstream_kwargs(opt, hp)
    if opt == "lamb" and kw["adam"] != base["adam"]:
        raise ValueError("Lamb's `adam` is optimizer-wide, not per group")
    touched = {"adamw": {"beta1": "betas", "beta2": "betas"},
               "came": {"beta1": "betas", "beta2": "betas", "beta3": "betas",
                        "eps1": "eps", "eps2": "eps"},
               "lamb": {"beta1": "betas", "beta2": "betas"},
               "adafactor": {"eps1": "eps", "eps2": "eps"}}[opt]
    keys = {touched.get(k, k) for k in override}
    return {k: v for k, v in kw.items()
            if k not in ("foreach", "adam") and (k in keys or v != base[k])}


# --------------------------------------------------------------------------
# Inputs (shared by every case)
# --------------------------------------------------------------------------
def make_inputs(torch):
    g = torch.Generator().manual_seed(SEED)
    init = {}
    for name, shape in PARAM_SHAPES:
        t = torch.randn(shape, generator=g, dtype=torch.float32) * 0.5
        init[name] = torch.zeros(shape) if name == "zeros" else t
    grads = {}  # (t, name) -> tensor ; missing = grad None
    for t in range(1, STEPS + 1):
        for name, shape in PARAM_SHAPES:
            gr = torch.randn(shape, generator=g, dtype=torch.float32)
            # heavy-tailed rows: a couple of rows (elements for 1-D) get a
            # large multiplier drawn from a wide range
            lead = shape[0] if len(shape) == 1 else int(torch.tensor(shape[:-1]).prod())
            flat = gr.reshape(lead, -1) if len(shape) > 1 else gr.reshape(-1, 1)
            k = int(torch.randint(1, 3, (1,), generator=g))
            idx = torch.randint(0, lead, (k,), generator=g)
            mult = torch.exp(torch.rand(k, generator=g) * 4.0 + 1.0)  # e^1 .. e^5
            for i in range(k):
                flat[idx[i]] *= mult[i]
            gr = flat.reshape(shape) * GRAD_SCALE[name]
            if t in ZERO_GRAD_STEPS:
                gr = torch.zeros(shape)
            if name == "sq" and t == SQ_ZEROS_STEP:
                for (r, c) in SQ_ZEROS:
                    gr[r, c] = 0.0
            if name in NONE_GRAD.get(t, ()):
                continue
            grads[(t, name)] = gr.contiguous()
    return init, grads


def inputs_tensors(torch, init, grads):
    order = [n for n, _ in PARAM_SHAPES]
    tensors = [("init/" + n, to_np(torch, init[n])) for n in order]
    for t in range(1, STEPS + 1):
        for n in order:
            if (t, n) in grads:
                tensors.append(("grad/%d/%s" % (t, n), to_np(torch, grads[(t, n)])))
    return tensors


def inputs_meta():
    return {
        "params": ",".join(n for n, _ in PARAM_SHAPES),
        "steps": str(STEPS),
        "seed": str(SEED),
        "generator": GENERATOR_REL,
    }


def load_inputs(torch):
    """Read inputs.safetensors back; every case runs on exactly these tensors."""
    meta, data = read_safetensors(INPUTS)
    assert meta == inputs_meta(), meta
    init = {}
    grads = {}
    for key, arr in data.items():
        parts = key.split("/")
        x = torch.from_numpy(arr.copy())
        if parts[0] == "init":
            init[parts[1]] = x
        elif parts[0] == "grad":
            grads[(int(parts[1]), parts[2])] = x
        else:
            raise ValueError(key)
    return init, grads


# --------------------------------------------------------------------------
# Running a case
# --------------------------------------------------------------------------
def to_np(torch, v):
    if isinstance(v, torch.Tensor):
        return v.detach().to(torch.float32).contiguous().numpy().copy()
    import numpy as np
    return np.asarray(float(v), dtype=np.float32).reshape(())


def run_case(U, name, opt, overrides, groups, init, grads):
    torch = U["torch"]
    hp = dict(DEFAULTS[opt])
    hp.update(overrides)
    if opt == "came" and hp["lr"] is None:
        raise ValueError("came needs lr")
    params = {n: torch.nn.Parameter(init[n].clone()) for n, _ in PARAM_SHAPES}
    order = [n for n, _ in PARAM_SHAPES]
    cls = {"adamw": torch.optim.AdamW, "adafactor": U["Adafactor"],
           "came": U["CAME"], "lamb": U["Lamb"]}[opt]
    if groups is None:
        pg = [params[n] for n in order]
    else:
        pg = []
        for names, ov in groups:
            d = {"params": [params[n] for n in names]}
            d.update(group_kwargs(opt, hp, ov))
            pg.append(d)
    optim = cls(pg, **upstream_kwargs(opt, hp))

    tensors = []
    for t in range(1, STEPS + 1):
        for n in order:
            g = grads.get((t, n))
            params[n].grad = None if g is None else g.clone()
        optim.step()
        for n in order:
            tensors.append(("param/%d/%s" % (t, n), to_np(torch, params[n])))
        for n in order:
            st = optim.state.get(params[n], {})
            for k, v in st.items():
                if isinstance(v, bool) or not isinstance(v, (torch.Tensor, int, float)):
                    continue
                tensors.append(("state/%d/%s/%s" % (t, n, k), to_np(torch, v)))

    upstream = {
        "adamw": U["torch_pin"],
        "adafactor": "transformers==%s %s" % (TRANSFORMERS_VERSION, U["torch_pin"]),
        "came": "came-pytorch==%s %s" % (CAME_VERSION, U["torch_pin"]),
        "lamb": "colossalai==%s (%s, class Lamb) %s" % (COLOSSALAI_VERSION,
                                                         COLOSSALAI_LAMB_PATH, U["torch_pin"]),
    }[opt]
    meta = {
        "optimizer": opt,
        "hparams": fmt_hparams(hp),
        "steps": str(STEPS),
        "params": ",".join(order),
        "upstream": upstream,
        "generator": GENERATOR_REL,
        "case": name,
        "seed": str(SEED),
        "dtype": "float32 cpu torch.set_num_threads(1)",
        "inputs": INPUTS_NAME,
    }
    if opt == "came":
        meta["upstream_sha256"] = U["came_sha"]
        meta["came_1d_exp_avg_clone_fix"] = "true" if U["came_fix"] else "false"
    if opt == "lamb":
        meta["upstream_sha256"] = U["lamb_sha"]
    if groups is not None:
        meta["groups"] = "|".join(",".join(names) for names, _ in groups)
        meta["group_hparams"] = "|".join(fmt_hparams(ov) for _, ov in groups)
    return tensors, meta


def check_files(names):
    """Read every file back with the safetensors package and our own reader,
    and check the layout: inputs only in inputs.safetensors, and every case
    file holding param/<t>/<p> for every step and param plus state/... only."""
    from safetensors import safe_open
    from safetensors.numpy import load_file
    import numpy as np
    order = [n for n, _ in PARAM_SHAPES]

    def read_both(path):
        ref = load_file(path)
        with safe_open(path, framework="numpy") as f:
            meta_ref = f.metadata()
        meta, mine = read_safetensors(path)
        assert meta == meta_ref, path
        assert set(ref) == set(mine), path
        for k in ref:
            assert ref[k].dtype == np.float32 and np.array_equal(ref[k], mine[k]), (path, k)
        assert all(np.isfinite(v).all() for v in mine.values()), path
        return meta, mine

    print("%-20s %-10s %8s %10s" % ("file", "optimizer", "tensors", "bytes"))
    meta, inp = read_both(INPUTS)
    assert meta == inputs_meta(), meta
    want = {"init/" + n for n in order}
    want |= {"grad/%d/%s" % (t, n) for t in range(1, STEPS + 1) for n in order
             if n not in NONE_GRAD.get(t, ())}
    assert set(inp) == want, sorted(set(inp) ^ want)
    total = os.path.getsize(INPUTS)
    print("%-20s %-10s %8d %10d" % ("inputs", "-", len(inp), total))
    for name in names:
        path = os.path.join(HERE, name + ".safetensors")
        meta, mine = read_both(path)
        assert meta["inputs"] == INPUTS_NAME, name
        for k in ("params", "steps", "seed", "generator"):
            assert meta[k] == inputs_meta()[k], (name, k)
        params = {"param/%d/%s" % (t, n) for t in range(1, STEPS + 1) for n in order}
        assert params <= set(mine), name
        assert all(k in params or k.startswith("state/") for k in mine), name
        size = os.path.getsize(path)
        total += size
        print("%-20s %-10s %8d %10d" % (name, meta["optimizer"], len(mine), size))
    print("%-20s %-10s %8s %10d" % ("TOTAL", "", "", total))


def main():
    if not in_venv():
        bootstrap()  # does not return
    import torch
    torch.set_num_threads(1)
    torch.manual_seed(0)
    U = load_upstream()
    if not U["came_fix"]:
        print("WARNING: came-pytorch %s lacks the 1-D exp_avg.clone() fix" % CAME_VERSION)
    init, grads = make_inputs(torch)
    tensors = inputs_tensors(torch, init, grads)
    write_safetensors(INPUTS, tensors, inputs_meta())
    print("wrote inputs (%d tensors)" % len(tensors), flush=True)
    # run every case on what was written, so the file is exactly what they used
    init, grads = load_inputs(torch)
    only = [a for a in sys.argv[1:] if not a.startswith("--")]
    unknown = set(only) - {c[0] for c in CASES}
    if unknown:
        sys.exit("unknown case(s): " + " ".join(sorted(unknown)))
    names = []
    for name, opt, ov, groups in CASES:
        if only and name not in only:
            continue
        tensors, meta = run_case(U, name, opt, ov, groups, init, grads)
        write_safetensors(os.path.join(HERE, name + ".safetensors"), tensors, meta)
        names.append(name)
        print("wrote %s (%d tensors)" % (name, len(tensors)), flush=True)
    if "--check" in sys.argv:
        check_files(names)


if __name__ == "__main__":
    main()
