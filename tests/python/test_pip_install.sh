#!/usr/bin/env bash
# CTest python_pip_install: the documented install, `pip install ./python`, into a fresh venv
# (python3 -m venv --system-site-packages, so Debian's torch and numpy stay visible), then, from another
# directory and without DISTOPT_LIBRARY or PYTHONPATH, the installed package: imported from the venv, its
# library loaded from inside the package, the registry listed, one AdamW step on a numpy array checked
# against the update computed here, and (with nothing else built: no DISTOPT_CLI, no build tree on PATH)
# the five-minute verdict of docs/python.md: a torch AdamW run recorded and verified by the CLI the wheel
# ships, and the `distopt` console command. Prints how long each part took.
# Usage: test_pip_install.sh SOURCE_DIR WORK_DIR PYTHON. Exit 77 (skipped) when PYTHON cannot make a venv
# with pip (Debian python3-venv) or scikit-build-core cannot be downloaded (no network or no PyPI).
set -euo pipefail
src=$1 work=$2 py=$3
skip() { echo "skipped: $*"; exit 77; }
fail() { echo "python_pip_install: FAILED: $*" >&2; exit 1; }
[ -x "$py" ] || skip "$py not found"
"$py" -c "import venv, ensurepip" 2>/dev/null || skip "$py has no venv/ensurepip (Debian python3-venv)"
rm -rf "$work"
mkdir -p "$work"
t0=$(date +%s)
"$py" -m venv --system-site-packages "$work/venv" >"$work/venv.log" 2>&1 || skip "$py -m venv failed: $(tail -1 "$work/venv.log")"
vpy=$work/venv/bin/python
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
unset DISTOPT_LIBRARY DISTOPT_CLI PYTHONPATH PIP_NO_INDEX PIP_FIND_LINKS
if ! timeout 120 "$vpy" -m pip download --retries 1 --timeout 20 --no-deps --dest "$work/probe" "scikit-build-core>=0.8" >"$work/probe.log" 2>&1; then
  skip "scikit-build-core cannot be downloaded (no network or no PyPI): $(grep -m1 '^ERROR' "$work/probe.log" || tail -1 "$work/probe.log")"
fi
t1=$(date +%s)
files() { (cd "$src/python" && find . -path '*/__pycache__' -prune -o -type f -print | sort); }
before=$(files)
if ! timeout 270 "$vpy" -m pip install "$src/python" >"$work/install.log" 2>&1; then
  tail -40 "$work/install.log"
  fail "pip install $src/python (log: $work/install.log)"
fi
t2=$(date +%s)
mkdir -p "$work/elsewhere"
cd "$work/elsewhere"
"$vpy" - <<'PY' || fail "the installed package"
import os, sys
import distopt
here = os.path.dirname(distopt.__file__)
assert here.startswith(sys.prefix), f"distopt imported from {here}, not from the venv {sys.prefix}"
assert os.path.dirname(distopt.library_path) == here, f"library {distopt.library_path} is not the package's"
names = distopt.list()
assert "adamw" in names, names
try:
    import numpy as np
except ImportError:
    np = None
if np is not None:
    opt = distopt.NumpyOptimizer("adamw", lr=0.1, weight_decay=0.0)
    w = np.array([1.0, -2.0], dtype=np.float32)
    opt.add_param(w)
    opt.step([np.array([0.5, -0.25], dtype=np.float32)])
    # first AdamW step without decay: w - lr * g / (|g| + eps) = w - lr * sign(g), up to eps and rounding
    want = np.array([1.0 - 0.1, -2.0 + 0.1])
    assert np.abs(w - want).max() < 1e-6, w
from distopt.verify import find_cli
exe = find_cli()
assert exe == os.path.join(here, "bin", "distopt"), f"verify runs {exe}, not the package's CLI"
try:
    import torch
except ImportError:
    torch = None
verdict = "no torch: not recorded"
if torch is not None:  # docs/python.md, "Five minutes to a verdict on your own training run"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with distopt.record(opt, "run.rec", names=model):
        for _ in range(4):
            opt.zero_grad()
            model(torch.randn(5, 6)).pow(2).sum().backward()
            opt.step()
    res = distopt.verify("run.rec")
    assert res.returncode == 0 and res.verdict["kind"] == "within_tolerance", (res, res.stdout, res.stderr)
    verdict = res.verdict["kind"]
print(f"installed: {distopt.__file__}, library {distopt.library_path}, {len(names)} optimizers"
      + ("" if np is None else ", numpy step ok") + f", verify with the packaged CLI: {verdict}")
PY
# (the whole output first: a reader that stops early, grep -q, would end the tool by SIGPIPE under pipefail)
listing=$("$work/venv/bin/distopt" list 2>&1) || fail "the distopt console command: exit $?: $(echo "$listing" | head -3)"
grep -q '^adamw' <<<"$listing" || fail "the distopt console command: $(echo "$listing" | head -3)"
t3=$(date +%s)
echo "times: venv + PyPI probe $((t1 - t0)) s, pip install ./python $((t2 - t1)) s, checks $((t3 - t2)) s"
[ "$before" = "$(files)" ] || fail "pip install left files in the source tree: $(diff <(echo "$before") <(files) | head -5)"
echo "python_pip_install: passed"
