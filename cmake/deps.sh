#!/usr/bin/env bash
# Installs distopt's build and test dependencies (Debian packages) when run as
# root; otherwise prints the exact apt-get line and fails. --fuzz adds the
# fuzzing toolchain (tests/fuzz/run.sh), --python the Python test interpreters.
set -euo pipefail
here=$(dirname "$0")
pkgs=(cmake make gcc libc6-dev pkg-config libopenblas-dev liblapacke-dev libcmocka-dev libcjson-dev libyaml-dev libssl-dev
  libunistring-dev libopenmpi-dev openmpi-bin) # OpenMPI: the MPI transport and its mpirun tests (docs/mpi.md)
# --fuzz: also clang and its libFuzzer/sanitizer runtime (only a Recommends of clang on bookworm)
# --python: Debian's python3 with numpy, venv and torch (1.13), and then the pinned torch 2 venv
#           (cmake/torch2.sh: outside the clone, where the CUDA 13 runtime its wheel links to exists; one
#           line says which); tests/python, the verify clients (tests/verify) and the interop tests run on
#           torch 2 where it installed, else on Debian's torch 1.13 (docs/python.md); g++, ninja-build and
#           python3-dev for the op DeepSpeed's CPU accelerator JIT-builds at start-up (tests/verify's deepspeed)
python=0
for arg in "$@"; do
  case "$arg" in
    --fuzz) pkgs+=(clang libclang-rt-14-dev) ;;
    --python) pkgs+=(python3 python3-numpy python3-venv python3-torch g++ ninja-build python3-dev) python=1 ;;
    *) echo "deps: unknown option '$arg' (--fuzz, --python)" >&2; exit 2 ;;
  esac
done
missing=()
for p in "${pkgs[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
torch2() {  # never fatal: without it the Python tests run on Debian's torch 1.13
  [ $python -eq 0 ] || bash "$here/torch2.sh" >/dev/null ||
    echo "deps: torch 2: cmake/torch2.sh failed (exit $?): the Python tests run on Debian's torch 1.13" >&2
}
[ ${#missing[@]} -eq 0 ] && { torch2; exit 0; }
if [ "$(id -u)" -eq 0 ]; then
  echo "deps: installing ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  torch2
else
  echo "deps: missing Debian packages; run:" >&2
  echo "  sudo apt-get install -y ${missing[*]}" >&2
  exit 1
fi
