#!/bin/sh
# Bitwise before/after check: builds the CLI of a baseline revision in a
# temporary directory and compares, byte for byte (cmp), what both builds
# write for
#   - `distopt run` on the same generated input (tests/bitwise/gen_input.py)
#     for every registry optimizer and several hyperparameter sets;
#   - `distopt run` replaying every golden case file (datasets/golden/);
#   - `distopt compare --json` of every optimizer (piecewise and owner mode) in several
#     layouts (tp, dp, zero, bf16, clipping, accumulation), with the one
#     wall-clock and CPU fields ("seconds", "cpu_seconds") removed, and "schema_version" (a layout
#     bump adds fields; the fields both have must still be equal).
#
# usage: tests/bitwise/check_bitwise.sh [BASE_REV] [NEW_DISTOPT]
#   BASE_REV     git revision to compare against (default: HEAD)
#   NEW_DISTOPT  the distopt binary under test (default: build/cli/distopt)
set -eu
SRC=$(cd "$(dirname "$0")/../.." && pwd)
BASE=${1:-HEAD}
NEW=${2:-$SRC/build/cli/distopt}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
mkdir -p "$TMP/src"
git -C "$SRC" archive "$BASE" | tar -x -C "$TMP/src"
cmake -S "$TMP/src" -B "$TMP/build" -DCMAKE_BUILD_TYPE=Release -DDOPT_BUILD_TESTS=OFF >/dev/null
cmake --build "$TMP/build" -j2 --target distopt_cli >/dev/null
OLD=$TMP/build/cli/distopt
[ -x "$OLD" ] || OLD=$TMP/build/compare/distopt # a baseline from before the CLI moved to cli/
python3 "$SRC/tests/bitwise/gen_input.py" "$TMP/in.safetensors" 5
fail=0
n=0
run_case() { # optimizer hparams
  tag=$1_$n
  n=$((n + 1))
  "$OLD" run --quiet --params "$TMP/in.safetensors" --out "$TMP/old_$tag.st" --optimizer "$1" --hparams "$2" 2>"$TMP/old.err" || true
  "$NEW" run --quiet --params "$TMP/in.safetensors" --out "$TMP/new_$tag.st" --optimizer "$1" --hparams "$2" 2>"$TMP/new.err" || true
  if [ ! -f "$TMP/old_$tag.st" ] && [ ! -f "$TMP/new_$tag.st" ] && cmp -s "$TMP/old.err" "$TMP/new.err"; then
    echo "same $1 [$2] (both refuse: $(cat "$TMP/new.err"))"; return
  fi
  if [ ! -f "$TMP/old_$tag.st" ] && grep -q "unknown optimizer" "$TMP/old.err"; then
    echo "new $1 [$2] (the baseline has no such optimizer)"; return
  fi
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
run_case adamw8bit ""
run_case adamw8bit "min_8bit_size=64,percentile_clipping=5,weight_decay=0.1"
run_case galore_adamw "rank=4,update_proj_gap=2"
run_case galore_adamw8bit "rank=8,update_proj_gap=3,min_8bit_size=16"
run_case q_galore "rank=4,update_proj_gap=2,proj_group_size=-1"
run_case q_galore "rank=4,update_proj_gap=1,proj_group_size=-1,int8_weights=true,weight_group_size=1"
run_case galore "inner=adafactor,rank=4,update_proj_gap=2,beta1=0.9,weight_decay=0.01"
run_case galore "inner=lamb,rank=3,update_proj_gap=3,proj_type=left,lr=1e-2,weight_decay=0.01"
run_case galore "inner=came,rank=3,update_proj_gap=2,lr=1e-3"
run_case lisa ""
run_case lisa "inner=adafactor,n_layers=1,interval=2"
run_case muon ""
run_case muon "ns_dtype=fp32,nesterov=false,weight_decay=0.1"
run_case torch_adafactor "weight_decay=0.05,beta2_decay=-0.5"
run_case adamw_schedulefree "lr=1e-2,weight_decay=0.05,warmup_steps=2,r=0.5"
run_case adam_mini "lr=1e-2,block=neuron,weight_decay=0.1"
run_case adam_mini "lr=1e-2,block=elementwise"
run_case normuon "lr=2e-2,weight_decay=0.01"
run_case normuon "lr=2e-2,ns_dtype=fp32,update_scale=match_rms,weight_decouple=false,weight_decay=0.1"
run_case apollo "lr=1e-2,rank=2,update_proj_gap=3,weight_decay=0.05"
run_case apollo "lr=1e-2,rank=1,scale_type=tensor,scale=128,proj_type=left,scale_front=true"
run_case soap "lr=1e-2,precondition_frequency=3,weight_decay=0.05"
run_case soap "lr=1e-2,precondition_frequency=2,precondition_1d=true,normalize_gradient=true"

# golden case files replayed (their optimizer, hyperparameters and inputs come from the file)
for f in "$SRC"/datasets/golden/*.safetensors "$SRC"/datasets/golden/*/*.safetensors; do
  case $(basename "$f") in inputs*.safetensors|bnb_maps.safetensors|quant.safetensors) continue ;; esac
  tag=golden_$n
  n=$((n + 1))
  "$OLD" run --quiet --params "$f" --out "$TMP/old_$tag.st" 2>/dev/null || true
  "$NEW" run --quiet --params "$f" --out "$TMP/new_$tag.st" 2>/dev/null || true
  [ -f "$TMP/old_$tag.st" ] || { n=$((n - 1)); continue; } # not a replayable case file
  if cmp -s "$TMP/old_$tag.st" "$TMP/new_$tag.st"; then echo "same run ${f#$SRC/}"; else echo "DIFF run ${f#$SRC/}"; fail=1; fi
done

# compare --json, the wall-clock field removed
# (counters that counted nothing are dropped: a counter added since the baseline is not a difference)
strip() { python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); d.pop("seconds",None); d.pop("cpu_seconds",None); d.pop("schema_version",None); t=d.get("events",{}).get("reference_totals"); t is not None and d["events"].update(reference_totals={k: v for k, v in t.items() if v}); print(json.dumps(d,sort_keys=True))' "$1"; }
cmp_case() { # args for distopt compare
  tag=cmp_$n
  n=$((n + 1))
  "$OLD" compare --quiet --steps 12 --json "$TMP/old_$tag.json" "$@" >/dev/null 2>"$TMP/old.err" || true
  "$NEW" compare --quiet --steps 12 --json "$TMP/new_$tag.json" "$@" >/dev/null 2>&1 || true
  if [ ! -f "$TMP/old_$tag.json" ] && grep -q "unknown optimizer" "$TMP/old.err"; then
    echo "new compare $* (the baseline has no such optimizer)"; return
  fi
  if [ ! -f "$TMP/old_$tag.json" ]; then echo "FAIL compare $*: baseline wrote no JSON"; fail=1; return; fi
  if [ -f "$TMP/new_$tag.json" ] && [ "$(strip "$TMP/old_$tag.json")" = "$(strip "$TMP/new_$tag.json")" ]; then
    echo "same compare $*"
  else
    echo "DIFF compare $*"; fail=1
  fi
}
for o in adamw adafactor "came --hparams lr=2e-4" lamb adamw8bit "galore_adamw --hparams rank=4,update_proj_gap=2" \
  "galore_adamw8bit --hparams rank=8,update_proj_gap=3,min_8bit_size=16" \
  "q_galore --hparams rank=4,update_proj_gap=2,proj_group_size=-1" \
  "galore --hparams inner=adafactor,rank=4,update_proj_gap=2,beta1=0.9" lisa muon torch_adafactor \
  "adamw_schedulefree --hparams lr=1e-2,weight_decay=0.05" "adam_mini --hparams lr=1e-2,block=neuron" normuon \
  "apollo --hparams lr=1e-2,rank=2,update_proj_gap=3" "soap --hparams lr=1e-2,precondition_frequency=3"; do
  # shellcheck disable=SC2086
  set -- --optimizer $o
  cmp_case "$@"
  cmp_case "$@" --tp 1 --dp 4 --zero 3 --plugin fsdp --max-grad-norm 0.5
  cmp_case "$@" --tp 4 --dp 2 --zero 1 --bf16 --accumulation 2
  cmp_case "$@" --tp 3 --dp 1 --zero 0
  cmp_case "$@" --tp 2 --dp 2 --zero 2 --trace "$SRC/datasets/trace/digits_mlp.safetensors"
done

if [ $fail -ne 0 ]; then echo "bitwise check FAILED against $BASE"; exit 1; fi
echo "bitwise check passed: $n cases identical to $BASE"
