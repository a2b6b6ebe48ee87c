#!/usr/bin/env python3
"""Record a real gradient trace for distopt's distributed-vs-reference tests.

Trains a small MLP (64 -> 32 -> ReLU -> 10, cross-entropy) on scikit-learn's
bundled ``load_digits`` data (1797 8x8 images, pixels scaled to [0, 1]) for
100 steps with ``torch.optim.AdamW(lr=1e-2)`` in fp32 on CPU with one thread,
and records what 4 data-parallel ranks would see: every step's batch of 64
samples is split into 4 contiguous shards of 16, and the gradient of the mean
loss over each shard is stored as ``grad/<t>/<r>/<param>`` (t = 1..100,
r = 0..3).  The initial parameters are stored as ``init/<param>``.  Between
steps the optimizer is fed the mean of the 4 shard gradients, so the trace is
a genuine training trajectory (the loss per step is in the metadata).

Usage (from anywhere):

    python3 datasets/trace/gen_trace.py            # set up env + regenerate
    python3 datasets/trace/gen_trace.py --check    # also verify the file reads back

On first run it creates ``datasets/trace/.venv`` (``/usr/bin/python3 -m venv
--system-site-packages`` on top of Debian's ``python3-torch`` / ``python3-numpy``),
pip-installs the pinned packages below with ``--no-deps`` (so nothing pulls a
PyPI torch), then re-executes itself inside that venv.  The data set ships
inside the scikit-learn wheel: no network is needed once the venv exists.
Output is byte-for-byte deterministic (fixed seeds, single thread, hand-written
safetensors with a fixed tensor order).
"""

import hashlib
import json
import os
import struct
import subprocess
import sys

# --------------------------------------------------------------------------
# Pinned versions (recorded in the file's metadata).
# --------------------------------------------------------------------------
DEBIAN_APT = ["python3-torch", "python3-venv"]  # torch 1.13.1+dfsg (CPU), numpy 1.24.2
TORCH_EXPECTED = "1.13"                          # Debian 1.13.1 reports 1.13.0a0
NUMPY_EXPECTED = "1.24.2"                        # Debian bookworm python3-numpy
SKLEARN_VERSION = "1.3.2"
# Installed with --no-deps: exactly what `sklearn.datasets.load_digits` needs.
REQUIREMENTS = [
    "scikit-learn==" + SKLEARN_VERSION,
    "scipy==1.11.4",
    "joblib==1.3.2",
    "threadpoolctl==3.2.0",
]

HERE = os.path.dirname(os.path.abspath(__file__))
VENV = os.path.join(HERE, ".venv")
VENV_PY = os.path.join(VENV, "bin", "python")
STAMP = os.path.join(VENV, "trace-requirements.txt")
GENERATOR_REL = "datasets/trace/gen_trace.py"
OUT_NAME = "digits_mlp.safetensors"
OUT = os.path.join(HERE, OUT_NAME)

SEED = 20240301
STEPS = 100
BATCH = 64
SHARDS = 4
LR = 1e-2
PARAMS = [("fc1.weight", [32, 64]), ("fc1.bias", [32]),
          ("fc2.weight", [10, 32]), ("fc2.bias", [10])]
TP_ROLES = [("fc1.weight", "column"), ("fc1.bias", "column"),
            ("fc2.weight", "row"), ("fc2.bias", "replicated")]


# --------------------------------------------------------------------------
# Environment bootstrap
# --------------------------------------------------------------------------
def _run(cmd, **kw):
    print("+ " + " ".join(cmd), flush=True)
    subprocess.check_call(cmd, **kw)


def in_venv():
    return os.path.realpath(sys.prefix) == os.path.realpath(VENV)


def bootstrap():
    """Make sure the venv exists with the pinned packages, then re-exec in it."""
    sys_py = "/usr/bin/python3"
    probe = subprocess.run([sys_py, "-c", "import torch, numpy, venv"],
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
    wanted = "\n".join(REQUIREMENTS) + "\n"
    have = open(STAMP).read() if os.path.exists(STAMP) else ""
    if have != wanted:
        _run([VENV_PY, "-m", "pip", "--disable-pip-version-check", "install", "-q",
              "--no-deps"] + REQUIREMENTS)
        with open(STAMP, "w") as f:
            f.write(wanted)
    os.execv(VENV_PY, [VENV_PY, os.path.abspath(__file__)] + sys.argv[1:])


# --------------------------------------------------------------------------
# safetensors writer / reader (written by hand: 8-byte LE header length,
# JSON header, raw little-endian data)
# --------------------------------------------------------------------------
def write_safetensors(path, tensors, metadata):
    """tensors: list of (name, float32 numpy array) in file order."""
    import numpy as np
    header = {}
    blobs = []
    off = 0
    for name, arr in tensors:
        arr = np.array(arr, dtype="<f4", order="C")
        b = arr.tobytes()
        header[name] = {"dtype": "F32", "shape": list(arr.shape),
                        "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    header["__metadata__"] = dict(metadata)
    hb = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hb += b" " * ((-len(hb)) % 8)  # pad so the data starts 8-byte aligned
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for b in blobs:
            f.write(b)
    os.replace(tmp, path)


def read_safetensors(path):
    import numpy as np
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    meta = header.pop("__metadata__", {})
    base = 8 + n
    out = {}
    end = 0
    for name, info in header.items():
        assert info["dtype"] == "F32", name
        b, e = info["data_offsets"]
        assert b == end, (name, b, end)  # contiguous, in header order
        end = e
        out[name] = np.frombuffer(raw[base + b:base + e], dtype="<f4").reshape(info["shape"])
    assert base + end == len(raw), "trailing bytes"
    return meta, out


def sha256_file(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


# --------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------
def versions():
    import numpy as np
    import scipy
    import sklearn
    import torch
    assert torch.__version__.startswith(TORCH_EXPECTED), torch.__version__
    assert np.__version__ == NUMPY_EXPECTED, np.__version__
    assert sklearn.__version__ == SKLEARN_VERSION, sklearn.__version__
    for req in REQUIREMENTS:
        name, ver = req.split("==")
        mod = {"scikit-learn": sklearn, "scipy": scipy}.get(name)
        if mod is None:
            mod = __import__(name)
        assert mod.__version__ == ver, (name, mod.__version__)
    try:
        deb = subprocess.run(["dpkg-query", "-W", "-f=${Version}", "python3-torch"],
                             capture_output=True, text=True).stdout.strip()
    except OSError:
        deb = ""
    torch_pin = "torch==1.13.1" + (" (debian python3-torch %s, torch.__version__=%s)"
                                   % (deb, torch.__version__) if deb else "")
    return torch_pin + "," + ",".join(REQUIREMENTS) + ",numpy==%s (debian)" % np.__version__


def load_data():
    import numpy as np
    from sklearn.datasets import load_digits
    d = load_digits()
    x = np.asarray(d.data, dtype=np.float64)
    assert x.shape == (1797, 64) and x.min() == 0.0 and x.max() == 16.0, (x.shape, x.max())
    x = (x / 16.0).astype(np.float32)            # pixels 0..16 -> [0, 1] (exact in fp32)
    y = np.asarray(d.target, dtype=np.int64)
    digest = hashlib.sha256(x.tobytes() + y.tobytes()).hexdigest()
    return x, y, digest


def train():
    import numpy as np
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    torch.set_num_threads(1)
    torch.manual_seed(SEED)

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(64, 32)
            self.fc2 = nn.Linear(32, 10)

        def forward(self, x):
            return self.fc2(F.relu(self.fc1(x)))

    model = MLP()  # default nn.Linear init, drawn from the seeded global RNG
    params = dict(model.named_parameters())
    assert [(n, list(p.shape)) for n, p in params.items()] == PARAMS, list(params)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    hp = opt.defaults

    x_all, y_all, data_sha = load_data()
    x_all = torch.from_numpy(x_all)
    y_all = torch.from_numpy(y_all)
    n = x_all.shape[0]
    g = torch.Generator().manual_seed(SEED + 1)  # batch sampling only

    tensors = [("init/" + name, params[name].detach().numpy().copy()) for name, _ in PARAMS]
    losses = []
    per_epoch = n // BATCH                          # 28 full batches, remainder dropped
    shard = BATCH // SHARDS
    perm = None
    for t in range(1, STEPS + 1):
        k = (t - 1) % per_epoch
        if k == 0:
            perm = torch.randperm(n, generator=g)
        idx = perm[k * BATCH:(k + 1) * BATCH]
        xb, yb = x_all[idx], y_all[idx]
        shard_grads = []
        shard_losses = []
        for r in range(SHARDS):
            opt.zero_grad(set_to_none=True)
            xs, ys = xb[r * shard:(r + 1) * shard], yb[r * shard:(r + 1) * shard]
            loss = F.cross_entropy(model(xs), ys)   # mean over the shard's 16 samples
            loss.backward()
            gr = {name: params[name].grad.detach().clone() for name, _ in PARAMS}
            shard_grads.append(gr)
            shard_losses.append(loss.item())
            for name, _ in PARAMS:
                tensors.append(("grad/%d/%d/%s" % (t, r, name), gr[name].numpy()))
        # data-parallel all-reduce mean: ((g0 + g1) + g2) + g3, then / 4, in fp32
        for name, _ in PARAMS:
            acc = shard_grads[0][name].clone()
            for r in range(1, SHARDS):
                acc += shard_grads[r][name]
            params[name].grad = acc / SHARDS
        opt.step()
        # training loss of the step's batch (before the update): mean over shards
        losses.append(sum(shard_losses) / SHARDS)
    return tensors, losses, hp, data_sha


def main():
    if not in_venv():
        bootstrap()
    vers = versions()
    tensors, losses, hp, data_sha = train()
    meta = {
        "format": "distopt gradient trace v1",
        "model": "MLP fc1=Linear(64,32) -> ReLU -> fc2=Linear(32,10), cross-entropy (mean), "
                 "default nn.Linear init, torch.manual_seed(%d)" % SEED,
        "dataset": "sklearn load_digits",
        "dataset_detail": "1797 samples, 8x8 pixels/16 -> [0,1] fp32; batches of %d from a "
                          "per-epoch torch.randperm (Generator seed %d), remainder dropped; "
                          "sha256(x_f32||y_i64)=%s" % (BATCH, SEED + 1, data_sha),
        "optimizer": "torch.optim.AdamW lr=%r betas=%r eps=%r weight_decay=%r amsgrad=%r "
                     "foreach=False, stepped on the mean of the %d shard gradients"
                     % (hp["lr"], tuple(hp["betas"]), hp["eps"], hp["weight_decay"],
                        hp["amsgrad"], SHARDS),
        "params": ",".join(n for n, _ in PARAMS),
        "steps": str(STEPS),
        "shards": str(SHARDS),
        "batch": str(BATCH),
        "tp_roles": ",".join("%s:%s" % r for r in TP_ROLES),
        "layout": "init/<param> = parameters before step 1; grad/<t>/<r>/<param> = "
                  "gradient of the mean loss over shard r (samples 16r..16r+15 of step t's "
                  "batch), t=1..%d, r=0..%d; all F32, C order" % (STEPS, SHARDS - 1),
        "loss": ",".join("%.6g" % v for v in losses),
        "dtype": "float32 cpu torch.set_num_threads(1)",
        "seed": str(SEED),
        "versions": vers,
        "generator": GENERATOR_REL,
    }
    write_safetensors(OUT, tensors, meta)
    print("%s: %d tensors, %d bytes, sha256 %s" % (OUT_NAME, len(tensors), os.path.getsize(OUT),
                                                  sha256_file(OUT)))
    print("loss: first %.6g, last %.6g" % (losses[0], losses[-1]))
    if "--check" in sys.argv:
        check()


def check():
    import numpy as np
    meta, out = read_safetensors(OUT)
    names = meta["params"].split(",")
    shapes = dict(PARAMS)
    steps, shards = int(meta["steps"]), int(meta["shards"])
    expect = ["init/" + p for p in names] + ["grad/%d/%d/%s" % (t, r, p)
                                             for t in range(1, steps + 1)
                                             for r in range(shards) for p in names]
    assert list(out) == expect, "tensor names/order"
    for name, arr in out.items():
        assert list(arr.shape) == shapes[name.rsplit("/", 1)[1]], name
        assert np.isfinite(arr).all(), name
    assert len(meta["loss"].split(",")) == steps
    assert os.path.getsize(OUT) <= 10 * 1024 * 1024
    print("check ok: %d tensors, metadata keys %s" % (len(out), ",".join(sorted(meta))))


if __name__ == "__main__":
    main()
