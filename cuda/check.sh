#!/usr/bin/env bash
# The device kit, part 2: the GPU checks, run on the machine with the GPU
# (one H200) from the repository root, on the binaries that cuda/kit.sh built
# here (kit/distopt-kit.tar.xz, carried). Nothing is built there. Steps, each
# with its own timeout:
#   1. nvidia-smi                          the device and driver
#   2. gpu_cuda_kernels                    every kernel and the step of every
#                                          optimizer with a CUDA step, CUDA vs CPU bitwise
#   3. gpu_cuda_grid                       the equivalence grid on the device-buffer simulator
#   4. compare --device cuda               adamw, adafactor, came, lamb (kernels) and adamw8bit, galore_adamw,
#                                          galore_adamw8bit, q_galore, lisa, muon (their CPU step on host copies,
#                                          core/hoststep.c) at tp2 dp2 zero2 + adamw fsdp bf16
#   5. compare --device cuda --backend nccl, one rank (torchrun-style environment)
#   6. compute-sanitizer memcheck          of gpu_cuda_kernels ("unavailable" when the runtime refuses it)
#   7. dopt_cuda_bench                     bandwidth of every kernel vs a device-to-device copy
#   8. torch fused AdamW                   the same N on the same GPU; the ratio to ours
# Logs go under $OUT (default kit-out/): summary.txt (the summary first, then
# the tables), steps.log (every step's whole output). Without a GPU every
# step reports SKIP and the script exits 0 (a dry run); with one, a skip is a
# failure. About 3-5 minutes on one H200.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/kit-out}
mkdir -p "$OUT"
log=$OUT/steps.log
sum=$OUT/summary.txt
: >"$log"
t0=$(date +%s)
declare -a summary
fail=0

gpu=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then gpu=1; fi

kit=/tmp/distopt-kit
if [ -f kit/distopt-kit.tar.xz ]; then
  rm -rf "$kit" && tar -xJf kit/distopt-kit.tar.xz -C /tmp
else
  echo "no kit/distopt-kit.tar.xz: run cuda/kit.sh on the build machine and carry kit/" | tee -a "$log"
fi
B=$kit/bin
nccl_lib=$(python3 -c 'import nvidia.nccl as m, os; print(os.path.join(list(m.__path__)[0], "lib"))' 2>/dev/null || true)
export LD_LIBRARY_PATH="$kit/lib${nccl_lib:+:$nccl_lib}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export DOPT_SOURCE_DIR=$PWD

# run NAME TIMEOUT CMD...: PASS / FAIL (exit N) / SKIP (no GPU) / UNAVAILABLE (the tool was refused)
run() {
  local name=$1 to=$2
  shift 2
  local s0 rc text
  s0=$(date +%s)
  printf '\n===== %s (timeout %ss): %s\n' "$name" "$to" "$*" >>"$log"
  if [ ! -x "$1" ] && ! command -v "$1" >/dev/null 2>&1; then
    summary+=("UNAVAILABLE  $name ($1 not found)")
    echo "not found: $1" >>"$log"
    return
  fi
  text=$(timeout "$to" "$@" 2>&1)
  rc=$?
  printf '%s\n[exit %d, %ds]\n' "$text" "$rc" $(($(date +%s) - s0)) >>"$log"
  if [ $rc -eq 77 ] || { [ $gpu -eq 0 ] && [ $rc -ne 0 ]; }; then
    if [ $gpu -eq 1 ]; then
      summary+=("FAIL  $name (skipped on a GPU machine)")
      fail=1
    else
      summary+=("SKIP  $name (no GPU)")
    fi
  elif echo "$text" | grep -Eq 'Device not supported|not supported on this|Target application terminated before first instrumented API call|error 999'; then
    summary+=("UNAVAILABLE  $name (the runtime refused the tool; see steps.log)")
  elif [ $rc -eq 0 ]; then
    summary+=("PASS  $name ($(($(date +%s) - s0))s)")
  elif [ $rc -eq 124 ]; then
    summary+=("FAIL  $name (timed out after ${to}s)")
    fail=1
  else
    summary+=("FAIL  $name (exit $rc)")
    fail=1
  fi
  LAST_OUTPUT=$text
}

run "nvidia-smi" 20 nvidia-smi
run "CUDA vs CPU bitwise: kernels and steps (gpu_cuda_kernels)" 150 "$B/gpu_cuda_kernels"
run "equivalence grid on the device-buffer simulator (gpu_cuda_grid)" 240 "$B/gpu_cuda_grid"
for opt in adamw adafactor came lamb; do
  hp=()
  [ "$opt" = came ] && hp=(--hparams lr=2e-4)
  run "compare --device cuda --optimizer $opt (hybrid tp2 dp2 zero2)" 90 \
    "$B/distopt" compare --device cuda --optimizer "$opt" "${hp[@]}" --steps 20 --quiet
done
for opt in adamw8bit galore_adamw galore_adamw8bit q_galore lisa muon; do
  run "compare --device cuda --optimizer $opt (hybrid tp2 dp2 zero2)" 60 \
    "$B/distopt" compare --device cuda --optimizer "$opt" --steps 8 --quiet
done
run "compare --device cuda adamw fsdp zero3 bf16" 90 \
  "$B/distopt" compare --device cuda --optimizer adamw --plugin fsdp --zero 3 --bf16 --steps 20 --quiet
run "compare --device cuda moe_hybrid ep 2 (mixtral-mini, galore_adamw)" 60 \
  "$B/distopt" compare --device cuda --optimizer galore_adamw --plugin moe_hybrid --model mixtral-mini --tp 1 \
  --dp 4 --ep 2 --zero 1 --steps 4 --quiet
run "compare --device cuda --backend nccl, 1 rank (adafactor)" 90 \
  env RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 \
  "$B/distopt" compare --backend nccl --device cuda --plugin ddp --tp 1 --dp 1 --zero 0 --optimizer adafactor \
  --steps 20 --quiet
sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
run "compute-sanitizer memcheck of gpu_cuda_kernels" 300 "$sanitizer" --tool memcheck --error-exitcode 9 \
  "$B/gpu_cuda_kernels"
LAST_OUTPUT=""
run "bandwidth vs a device-to-device copy (dopt_cuda_bench)" 180 "$B/dopt_cuda_bench" --reps 25
bench=$LAST_OUTPUT
LAST_OUTPUT=""
run "torch fused AdamW (same N, same GPU)" 120 python3 cuda/torch_adamw.py --reps 25
torch_line=$(echo "$LAST_OUTPUT" | grep '^torch_fused_adamw n=' || true)

{
  printf 'distopt GPU checks: %d of %d steps passed, %ss%s\n' \
    "$(printf '%s\n' "${summary[@]}" | grep -c '^PASS')" "${#summary[@]}" $(($(date +%s) - t0)) \
    "$([ $gpu -eq 0 ] && echo ' (dry run: no GPU)')"
  printf '%s\n' "${summary[@]}"
  ours=$(echo "$bench" | awk '/^adamw step/ {print $4}')
  theirs=$(echo "$torch_line" | sed -n 's/.*median_ms=\([0-9.]*\).*/\1/p')
  if [ -n "$ours" ] && [ -n "$theirs" ]; then
    echo
    echo "adamw step: distopt $ours ms, torch fused $theirs ms: ratio $(awk -v a="$ours" -v b="$theirs" 'BEGIN {printf "%.2f", a / b}') (distopt / torch)"
  fi
  if [ -n "$bench" ]; then
    echo
    echo "$bench"
  fi
  [ -f "$kit/MANIFEST" ] && { echo; cat "$kit/MANIFEST"; }
} >"$sum"
cat "$sum"
exit $fail
