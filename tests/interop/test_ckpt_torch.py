#!/usr/bin/env python3
"""CTest interop_ckpt_torch: a distopt AdamW checkpoint loaded into torch.optim.AdamW through
tools/ckpt_torch.py takes the same step as distopt, and a torch state_dict converted back resumes in distopt.

    test_ckpt_torch.py DISTOPT_BINARY SOURCE_DIR WORK_DIR

Exit 77 (CTest SKIP_RETURN_CODE) when torch cannot be imported. safetensors files are read with distopt's
own reader (the package's, as the tool reads them).

Tolerance: docs/golden.md, "How the test compares": the normwise relative error max|a-b| / max|b| of
parameters within 1e-6 and of states within 1e-5 (the tolerances test_golden uses for AdamW against torch;
torch's vectorised kernels fuse multiply-adds and round a few scalars elsewhere, about one ulp each).
Step counts must be equal.
"""
import os
import shutil
import subprocess
import sys

try:
    import torch
except ImportError as e:
    print(f"skipped: {e} (Debian python3-torch)")
    sys.exit(77)
from distopt import _safetensors as st_io  # noqa: E402

PARAM_TOL, STATE_TOL = 1e-6, 1e-5  # docs/golden.md

binary, source, work = sys.argv[1:4]
sys.path.insert(0, os.path.join(source, "tools"))
import ckpt_torch  # noqa: E402

inputs = os.path.join(source, "datasets", "golden", "inputs.safetensors")
shutil.rmtree(work, ignore_errors=True)
os.makedirs(work)
torch.set_num_threads(1)
failures = []


def run(*args):
    cmd = [binary, "run", "--params", inputs, "--quiet", *args]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"FAIL: {' '.join(cmd)}: exit {r.returncode}: {r.stderr.strip()}")


def rel(a, b):
    a, b = a.double(), b.double()
    d = (a - b).abs().max().item() if a.numel() else 0.0
    m = b.abs().max().item() if b.numel() else 0.0
    return d / m if m > 0 else d


def check(what, a, b, tol):
    e = rel(a, b)
    ok = e <= tol and a.shape == b.shape
    print(f"  {what:28s} rel err {e:.3e} (tol {tol:g}) {'ok' if ok else 'FAIL'}")
    if not ok:
        failures.append(what)


def grads(t):
    return {k.split("/", 2)[2]: v for k, v in st_io.read_torch(inputs).items() if k.startswith(f"grad/{t}/")}


# 1. distopt: 5 steps, checkpoint; one more step from it (gradient of step 6), checkpoint
hp = "lr=1e-3,weight_decay=0.01"
ck5, ck6 = os.path.join(work, "ck5"), os.path.join(work, "ck6")
run("--optimizer", "adamw", "--hparams", hp, "--group", "vec:weight_decay=0", "--steps", "5", "--save", ck5)
run("--optimizer", "adamw", "--hparams", hp, "--group", "vec:weight_decay=0", "--resume", ck5, "--steps", "6",
    "--save", ck6)

# 2. torch: the converted step-5 state, one AdamW step on the same gradient
c = ckpt_torch.to_torch(ck5)
names = c["param_names"]
params = [c["params"][n].clone().requires_grad_(True) for n in names]
groups = []
for g in c["optimizer"]["param_groups"]:
    tg = {k: v for k, v in g.items() if k != "params"}
    tg["foreach"] = False  # the golden vectors' setting (docs/golden.md)
    tg["params"] = [params[i] for i in g["params"]]
    groups.append(tg)
opt = torch.optim.AdamW(groups)
sd = c["optimizer"]
for g in sd["param_groups"]:
    g["foreach"] = False
opt.load_state_dict(sd)
g6 = grads(6)
for n, p in zip(names, params):
    p.grad = g6.get(n)
opt.step()

# 3. compare with distopt's step 6
print("distopt step 6 vs torch.optim.AdamW step 6 from the converted checkpoint:")
idx6, t6 = ckpt_torch.read_checkpoint(ck6)
steps6 = {p["name"]: p["step"] for p in idx6["params"]}
for i, (n, p) in enumerate(zip(names, params)):
    check(n, p.detach(), t6[n], PARAM_TOL)
    st = opt.state[p]
    for key in ("exp_avg", "exp_avg_sq"):
        check(f"{n}/{key}", st[key], t6[f"{n}/{key}"], STATE_TOL)
    if int(st["step"].item()) != steps6[n]:
        failures.append(f"{n}/step")
        print(f"  {n}/step torch {int(st['step'].item())} distopt {steps6[n]} FAIL")

# 4. back: torch's state after step 6 -> a distopt checkpoint; distopt resumes from it (step 7) as from its own
back = os.path.join(work, "back")
c6 = {"optimizer": opt.state_dict(), "param_names": names,
      "params": {n: p.detach().clone() for n, p in zip(names, params)}, "bf16": {},
      "distopt": dict(c["distopt"], global_step=6, optimizer_steps=6)}
ckpt_torch.from_torch(c6, back)
ck7a, ck7b = os.path.join(work, "ck7a"), os.path.join(work, "ck7b")
run("--optimizer", "adamw", "--hparams", hp, "--group", "vec:weight_decay=0", "--resume", back, "--steps", "7",
    "--save", ck7a)
run("--optimizer", "adamw", "--hparams", hp, "--group", "vec:weight_decay=0", "--resume", ck6, "--steps", "7",
    "--save", ck7b)
print("distopt step 7 resumed from torch's state vs from its own:")
_, a7 = ckpt_torch.read_checkpoint(ck7a)
_, b7 = ckpt_torch.read_checkpoint(ck7b)
for n in sorted(b7):
    check(n, a7[n], b7[n], STATE_TOL if "/" in n else PARAM_TOL)

# 5. exact round trips distopt -> torch -> distopt for the three optimizers (bitwise, and distopt loads it)
for name, ohp in (("adamw", "lr=1e-3,amsgrad=true"), ("adafactor", "beta1=0.9,weight_decay=0.01"),
                  ("came", "lr=2e-4,weight_decay=0.01")):
    src, dst = os.path.join(work, f"rt_{name}"), os.path.join(work, f"rt_{name}_back")
    run("--optimizer", name, "--hparams", ohp, "--group", "vec:weight_decay=0", "--steps", "4", "--save", src)
    conv = ckpt_torch.to_torch(src)
    ckpt_torch.from_torch(conv, dst)
    i1, x1 = ckpt_torch.read_checkpoint(src)
    i2, x2 = ckpt_torch.read_checkpoint(dst)
    same = sorted(x1) == sorted(x2) and all(torch.equal(x1[k], x2[k]) for k in x1) and \
        [(p["name"], p["step"], p["group"]) for p in i1["params"]] == [(p["name"], p["step"], p["group"]) for p in
                                                                        i2["params"]]
    run("--optimizer", name, "--hparams", ohp, "--group", "vec:weight_decay=0", "--resume", dst, "--steps", "5",
        "--save", os.path.join(work, f"rt_{name}_5"))
    print(f"round trip {name}: {'bitwise' if same else 'DIFFERS'}; distopt resumes from it")
    if not same:
        failures.append(f"round trip {name}")
    # upstream's own class, where installed, loads the converted state_dict
    cls = None
    try:
        if name == "adafactor":
            from transformers.optimization import Adafactor as cls
        elif name == "came":
            from came_pytorch import CAME as cls
    except ImportError:
        print(f"  ({name}: upstream package not installed; its load_state_dict not tried)")
    if cls is not None:
        ps = [conv["params"][n].clone().requires_grad_(True) for n in conv["param_names"]]
        g0 = {k: v for k, v in conv["optimizer"]["param_groups"][0].items() if k != "params"}
        up = cls([{"params": [ps[i] for i in g["params"]]} for g in conv["optimizer"]["param_groups"]], **g0)
        up.load_state_dict(conv["optimizer"])
        print(f"  {name}: {cls.__module__}.{cls.__name__}.load_state_dict accepted it")

# 6. files (docs/files.md): a stale temporary generation that links elsewhere is removed as a link, a link planted
#    at latest's temporary name is never written through, a FIFO at `latest` is refused without waiting, and
#    to-torch refuses an output inside its input checkpoint or a FIFO, writing a link's target in its folder
victim = os.path.join(work, "victim")
os.makedirs(victim, exist_ok=True)
for f in ("a", "b"):
    with open(os.path.join(victim, f), "w") as fh:
        fh.write(f)
lk = os.path.join(work, "links")
os.makedirs(lk, exist_ok=True)
os.symlink("../victim", os.path.join(lk, ".tmp-step-000000006"))
os.symlink("../victim/a", os.path.join(lk, f"latest.tmp-{os.getpid()}-0"))
ckpt_torch.from_torch(c6, lk)
if sorted(os.listdir(victim)) != ["a", "b"] or open(os.path.join(victim, "a")).read() != "a":
    failures.append("from-torch followed a link")
    print("  from-torch changed files through a link: FAIL")
fifo = os.path.join(work, "fifo_ck")
run("--optimizer", "adamw", "--hparams", hp, "--group", "vec:weight_decay=0", "--steps", "2", "--save", fifo)
os.unlink(os.path.join(fifo, "latest"))
os.mkfifo(os.path.join(fifo, "latest"))
for argv, what in (([sys.executable, os.path.join(source, "tools", "ckpt_torch.py"), "show", fifo], "latest: not a regular file"),
                   ([sys.executable, os.path.join(source, "tools", "ckpt_torch.py"), "to-torch", ck6,
                     os.path.join(ck6, "x.pt")], "lies inside, the input"),
                   ([sys.executable, os.path.join(source, "tools", "ckpt_torch.py"), "to-torch", ck6,
                     os.path.join(fifo, "latest")], "not a regular file or character device")):
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if r.returncode == 0 or what not in r.stderr:
        failures.append(f"ckpt_torch {argv[2]} {what}")
        print(f"  ckpt_torch {' '.join(argv[2:])}: exit {r.returncode} {r.stderr.strip()!r} (want {what!r}): FAIL")
real_pt, link_pt = os.path.join(victim, "out.pt"), os.path.join(work, "link.pt")
os.symlink(real_pt, link_pt)
r = subprocess.run([sys.executable, os.path.join(source, "tools", "ckpt_torch.py"), "to-torch", ck6, link_pt],
                   capture_output=True, text=True, timeout=120)
if r.returncode != 0 or not os.path.islink(link_pt) or "optimizer" not in torch.load(real_pt):
    failures.append("to-torch through a link")
    print(f"  to-torch through a link: exit {r.returncode} {r.stderr.strip()!r}: FAIL")
print("files: links never followed into a removal or a write, FIFOs refused, outputs never inside inputs")

if failures:
    sys.exit(f"FAIL: {', '.join(failures)}")
print("interop_ckpt_torch: ok")
