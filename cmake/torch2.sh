#!/usr/bin/env bash
# The Python tests' torch 2 interpreter: a venv holding the wheels cmake/torch2.txt pins (torch 2.15.0, the
# four CUDA libraries the image lacks, the upstream optimizers tests/verify imports), every one --no-deps and
# checked against its hash. It lives outside the clone, so fresh clones on one machine share it:
#   ${XDG_CACHE_HOME:-$HOME/.cache}/distopt/wheels/           the downloaded wheels
#   ${XDG_CACHE_HOME:-$HOME/.cache}/distopt/torch2-KEY/       the venv; KEY: the SHA-256 of torch2.txt and
#                                                             of the Python version, its first 16 digits
# A venv is used only when its stamp (written last) holds KEY and its python imports what the tests need;
# otherwise it is rebuilt in a temporary folder and renamed into place (an interrupted build leaves nothing
# that passes). A wheel whose hash does not match its pin is downloaded again (once).
#
#   torch2.sh           ensure the venv (install when missing or broken); print its python on stdout and one
#                       line on stderr; exit 0 also where torch 2 cannot run here (nothing on stdout then:
#                       the tests run on Debian's torch 1.13, docs/python.md)
#   torch2.sh --path    print the python of a valid venv, else nothing; installs nothing
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
pins=$here/torch2.txt
mode=${1:-ensure}
case "$mode" in ensure | --path) ;; *) echo "torch2.sh: unknown option '$mode' (--path)" >&2; exit 2 ;; esac
say() { echo "deps: $*" >&2; }

py=/usr/bin/python3
[ -x "$py" ] || { [ "$mode" = ensure ] && say "torch 2: no /usr/bin/python3; the Python tests are skipped"; exit 0; }
ver=$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
if [ "$ver" != 3.11 ]; then  # the pinned wheels are cp311 (Debian 12's Python)
  [ "$mode" = ensure ] && say "torch 2: the pinned wheels are for Python 3.11, $py is $ver: the Python tests run on Debian's torch (docs/python.md)"
  exit 0
fi
# the CUDA 13 runtime torch 2.15's libraries link to (readelf -d torch/lib/*.so), all but the four pinned
missing=() libs=$(/sbin/ldconfig -p 2>/dev/null || true)
for so in libcudart.so.13 libcupti.so.13 libcublas.so.13 libcublasLt.so.13 libcusparse.so.12 libcufft.so.12 \
  libcusolver.so.12 libcudnn.so.9 libnvrtc.so.13; do
  grep -q "^[[:space:]]*$so " <<<"$libs" || missing+=("$so")
done
if [ ${#missing[@]} -gt 0 ]; then
  [ "$mode" = ensure ] && say "torch 2: no CUDA 13 runtime here (ldconfig finds no ${missing[*]}): the Python tests run on Debian's torch 1.13, the torch-2 ones skipped"
  exit 0
fi

home=${HOME:-$(getent passwd "$(id -u)" 2>/dev/null | cut -d: -f6)}  # CI's environment may lack HOME
root=${XDG_CACHE_HOME:-${home:-/var/tmp}/.cache}/distopt
key=$( (cat "$pins"; echo "python $ver") | sha256sum | cut -c1-16)
venv=$root/torch2-$key
probe='import torch, numpy, torch.distributed.tensor, torch.distributed.fsdp, came_pytorch, torch_optimizer, pytorch_ranger, transformers.optimization, schedulefree, adam_mini, pytorch_optimizer, importlib.util
assert importlib.util.find_spec("apollo_torch"), "apollo_torch"
assert importlib.util.find_spec("deepspeed"), "deepspeed"
assert torch.__version__.split("+")[0] == "2.15.0", torch.__version__'

valid() {
  [ -f "$venv/distopt-stamp" ] && [ "$(cat "$venv/distopt-stamp")" = "$key" ] &&
    (cd / && OMP_NUM_THREADS=1 "$venv/bin/python" -W ignore -c "$probe") >/dev/null 2>&1
}

if [ "$mode" = --path ]; then
  valid && echo "$venv/bin/python"
  exit 0
fi

mkdir -p "$root/wheels"
exec 9>"$root/lock"
flock 9  # one builder at a time; the others find its venv done
if valid; then
  say "torch 2.15.0 (cached): $venv"
  echo "$venv/bin/python"
  exit 0
fi
t0=$(date +%s)
tmp=$root/torch2-$key.tmp.$$
rm -rf "$tmp"
trap 'rm -rf "$tmp"' EXIT
"$py" -m venv "$tmp" >/dev/null
pip=("$tmp/bin/python" -m pip --disable-pip-version-check --no-input)
install() {
  # --no-build-isolation: DeepSpeed's source release is built here with the venv's setuptools (no index)
  PIP_FIND_LINKS='' DS_BUILD_OPS=0 "${pip[@]}" install -q --no-deps --no-compile --no-index --no-build-isolation \
    --find-links "$root/wheels" --require-hashes -r "$pins" >"$tmp/install.log" 2>&1
}
fetch() {
  PIP_FIND_LINKS='' timeout 900 "${pip[@]}" download -q --no-deps --require-hashes -r "$pins" -d "$root/wheels" \
    >"$tmp/download.log" 2>&1
}
if ! install; then
  # a wheel missing, or cached but corrupt: a download (pip checks every hash) and one more try
  grep -q "THESE PACKAGES DO NOT MATCH THE HASHES" "$tmp/install.log" && rm -f "$root"/wheels/*.whl "$root"/wheels/*.tar.gz
  if ! fetch; then
    say "torch 2: downloading the pinned wheels failed ($(grep -m1 ERROR "$tmp/download.log" || tail -1 "$tmp/download.log")): the Python tests run on Debian's torch 1.13"
    exit 0
  fi
  if ! install; then
    say "torch 2: installing the pinned wheels failed ($(grep -m1 ERROR "$tmp/install.log" || tail -1 "$tmp/install.log")): the Python tests run on Debian's torch 1.13"
    exit 0
  fi
fi
# bytecode now, once: the tests run with PYTHONDONTWRITEBYTECODE, and compiling torch's modules from source
# in every process took 5 of a spawned rank's 8 s (a few files of the upstream packages do not compile:
# templates, Python 2; the probe below decides)
"$tmp/bin/python" -m compileall -q -j2 "$tmp/lib" >/dev/null 2>&1 || true
if ! (cd / && OMP_NUM_THREADS=1 "$tmp/bin/python" -W ignore -c "$probe") >"$tmp/probe.log" 2>&1; then
  say "torch 2: the new venv does not import torch ($(tail -1 "$tmp/probe.log")): the Python tests run on Debian's torch 1.13"
  exit 0
fi
echo "$key" >"$tmp/distopt-stamp"  # last: only a finished venv has it
rm -rf "$venv"
mv -T "$tmp" "$venv"  # scripts in bin/ keep the temporary path in their #! line; the tests run python -m
trap - EXIT
# older keys' venvs (changed pins) are removed: one torch 2 venv per machine
for old in "$root"/torch2-*; do
  [ "$old" = "$venv" ] || rm -rf "$old"
done
say "torch 2.15.0 installed in $(($(date +%s) - t0)) s: $venv"
echo "$venv/bin/python"
