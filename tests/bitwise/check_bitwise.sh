#!/bin/sh
# Bitwise before/after check of the reference optimizers: builds the CLI of a
# baseline revision (default: the commit before the optimisation work) in a
# temporary directory, runs `distopt run` of both builds on the same generated
# input (tests/bitwise/gen_input.py) for every optimizer and several
# hyperparameter sets, and compares the output files byte for byte (cmp).
#
# usage: tests/bitwise/check_bitwise.sh [BASE_REV] [NEW_DISTOPT]
#   BASE_REV     git revision to compare against (default: bench~0 of the tree)
#   NEW_DISTOPT  the distopt binary under test (default: build/compare/distopt)
set -eu
SRC=$(cd "$(dirname "$0")/../.." && pwd)
BASE=${1:-HEAD}
NEW=${2:-$SRC/build/compare/distopt}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
mkdir -p "$TMP/src"
git -C "$SRC" archive "$BASE" | tar -x -C "$TMP/src"
cmake -S "$TMP/src" -B "$TMP/build" -DCMAKE_BUILD_TYPE=Release -DDOPT_BUILD_TESTS=OFF >/dev/null
cmake --build "$TMP/build" -j2 --target distopt_cli >/dev/null
OLD=$TMP/build/compare/distopt
python3 "$SRC/tests/bitwise/gen_input.py" "$TMP/in.safetensors" 5
fail=0
n=0
run_case() { # optimizer hparams
  tag=$1_$n
  n=$((n + 1))
  "$OLD" run --params "$TMP/in.safetensors" --out "$TMP/old_$tag.st" --optimizer "$1" --hparams "$2" 2>"$TMP/old.err" || true
  "$NEW" run --params "$TMP/in.safetensors" --out "$TMP/new_$tag.st" --optimizer "$1" --hparams "$2" 2>"$TMP/new.err" || true
  if [ ! -f "$TMP/old_$tag.st" ]; then
    echo "FAIL $1 [$2]: baseline produced no output: $(cat "$TMP/old.err")"; fail=1; return
  fi
  if cmp -s "$TMP/old_$tag.st" "$TMP/new_$tag.st"; then
    echo "same $1 [$2]"
  else
    echo "DIFF $1 [$2]"; fail=1
  fi
}
run_case adamw ""
run_case adamw "amsgrad=true,weight_decay=0"
run_case adafactor ""
run_case adafactor "beta1=0.9,weight_decay=0.01"
run_case adafactor "relative_step=false,lr=1e-3,scale_parameter=false,clip_threshold=0.5"
run_case adafactor "warmup_init=true"
run_case came "lr=2e-4"
run_case came "lr=1e-3,weight_decay=0.1,eps2=1e-10"
run_case lamb ""
run_case lamb "weight_decay=0.01,bias_correction=true"
run_case lamb "adam=true,weight_decay=0.1"
if [ $fail -ne 0 ]; then echo "bitwise check FAILED against $BASE"; exit 1; fi
echo "bitwise check passed: $n cases identical to $BASE"
