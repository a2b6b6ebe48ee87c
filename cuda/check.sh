#!/usr/bin/env bash
# The CUDA checks for a machine with one GPU (written for one H200, arch 90):
#   1. configure and build with CUDA and NCCL required (Release, -Werror)
#   2. the GPU tests (label gpu: every kernel vs the CPU device, the
#      equivalence grid), bitwise
#   3. distopt compare --device cuda for adamw, adafactor, came, lamb
#      (CUDA device + device-buffer simulator vs the CPU reference)
#   4. dopt_cuda_bench: bandwidth of the kernels vs a device-to-device copy
# Prints a summary; exits non-zero on any failure. About 8 minutes at most.
#   CUDA_ARCH=90 BUILD=build-cuda cuda/check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
arch=${CUDA_ARCH:-90}
build=${BUILD:-build-cuda}
jobs=$(nproc)
declare -a summary
fail=0
t0=$(date +%s)
record() { # name rc
  if [ "$2" -eq 0 ]; then summary+=("PASS  $1"); else summary+=("FAIL  $1 (exit $2)"); fail=1; fi
}
step() { printf '\n=== %s\n' "$*"; }

step "configure + build (CUDA arch $arch, NCCL)"
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DDOPT_WERROR=ON -DDOPT_CUDA=ON -DDOPT_NCCL=ON \
  -DCMAKE_CUDA_ARCHITECTURES="$arch" | grep "distopt:" &&
  timeout 300 cmake --build "$build" -j"$jobs" >/dev/null
rc=$?
record "build" $rc
if [ $rc -ne 0 ]; then
  printf '\n%s\n' "${summary[@]}"
  exit 1
fi

step "GPU tests (ctest -L gpu)"
out=$(timeout 300 ctest --test-dir "$build" -L gpu --output-on-failure 2>&1)
rc=$?
echo "$out" | tail -15
if echo "$out" | grep -q "Skipped\|Not Run"; then rc=3; fi # on this machine a skip is a failure
record "gpu tests" $rc

step "distopt compare --device cuda"
for opt in adamw adafactor came lamb; do
  hp=""
  [ "$opt" = came ] && hp="--hparams lr=2e-4"
  timeout 120 "$build/compare/distopt" compare --device cuda --optimizer "$opt" $hp --steps 20 --quiet | tail -1
  record "compare --device cuda --optimizer $opt (hybrid tp2 dp2 zero2)" "${PIPESTATUS[0]}"
done
timeout 120 "$build/compare/distopt" compare --device cuda --optimizer adamw --plugin fsdp --zero 3 --bf16 \
  --steps 20 --quiet | tail -1
record "compare --device cuda adamw fsdp bf16" "${PIPESTATUS[0]}"

step "bandwidth (dopt_cuda_bench)"
timeout 180 "$build/cuda/dopt_cuda_bench" --reps 25
record "bench" $?

printf '\n=== summary (%ss)\n' $(($(date +%s) - t0))
printf '%s\n' "${summary[@]}"
exit $fail
