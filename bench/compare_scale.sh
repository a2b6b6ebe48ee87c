#!/bin/sh
# How `distopt compare` scales with ranks: peak memory in model copies and CPU per step, at tp x dp
# = 2x2, 4x4 and 8x8 (ZeRO 2), against the reference step on the same number of elements.
#
# usage: bench/compare_scale.sh [DISTOPT] [MODEL_ARGS]
#   DISTOPT     the CLI (default build/cli/distopt)
#   MODEL_ARGS  the model (default "--model 20m"); "" runs the built-in model
# Environment: OPT (default adamw), LAYOUTS (default "2x2 4x4 8x8"), PARAMS (the model's parameter count,
# when MODEL_ARGS is not a --model the CLI's `mem` can size).
#
# Peak RSS (/usr/bin/time's maximum resident set) over the model's fp32 bytes; CPU per step = (user + sys
# of 6 steps - of 2 steps) / 4, so that setup cancels; the reference step: `distopt bench` (one thread)
# on one square fp32 parameter of the same element count. Medians of REPS (default 3) runs.
set -eu
BIN=${1:-build/cli/distopt}
MODEL=${2---model 20m}
OPT=${OPT:-adamw}
LAYOUTS=${LAYOUTS:-"2x2 4x4 8x8"}
REPS=${REPS:-3}
command -v /usr/bin/time >/dev/null 2>&1 || { echo "needs /usr/bin/time (Debian: time)" >&2; exit 2; }
if [ -z "${PARAMS:-}" ]; then
  spec=$(printf '%s\n' "$MODEL" | sed -n 's/.*--model \([^ ]*\).*/\1/p')
  [ -n "$spec" ] || { echo "PARAMS (the parameter count) is needed without --model" >&2; exit 2; }
  PARAMS=$("$BIN" mem --model "$spec" | sed -n '1s/.* B parameters (\([0-9]*\);.*/\1/p')
fi
median() { sort -n | awk '{a[NR] = $1} END {print a[int((NR + 1) / 2)]}'; }
run() { # tp dp steps -> "cpu_seconds max_rss_kb"
  /usr/bin/time -f "%U %S %M" -o /tmp/dopt_scale.$$ "$BIN" compare --optimizer "$OPT" $MODEL --steps "$3" --tp "$1" \
    --dp "$2" --zero 2 --quiet >/dev/null 2>&1 || true
  awk '{printf "%.3f %d\n", $1 + $2, $3}' /tmp/dopt_scale.$$
}
side=$(awk -v p="$PARAMS" 'BEGIN {printf "%d", sqrt(p) + 0.5}')
ref_ms=$("$BIN" bench --size "${side}x${side}" --optimizer "$OPT" --threads 1 --iters 5 | awk -v o="$OPT" '$1 == o {print $2}')
mb=$(awk -v p="$PARAMS" 'BEGIN {printf "%.1f", p * 4 / 1e6}')
echo "compare $OPT $MODEL: $PARAMS parameters ($mb MB fp32); reference step ${ref_ms} ms (distopt bench ${side}x${side}, 1 thread)"
printf '%8s %6s %12s %8s %12s %14s\n' "tp x dp" ranks "peak MB" copies "CPU s/step" "x ref step"
for l in $LAYOUTS; do
  tp=${l%x*}; dp=${l#*x}
  cpus=""; rss=""
  for k in $(seq "$REPS"); do
    a=$(run "$tp" "$dp" 2); b=$(run "$tp" "$dp" 6)
    cpus="$cpus $(echo "$a $b" | awk '{printf "%.4f", ($3 - $1) / 4}')"
    rss="$rss $(echo "$b" | awk '{print $2}')"
  done
  c=$(echo $cpus | tr ' ' '\n' | median); m=$(echo $rss | tr ' ' '\n' | median)
  echo "$tp $dp $m $c" | awk -v p="$PARAMS" -v r="$ref_ms" '{printf "%8s %6d %12.0f %8.1f %12.3f %14.1f\n", $1 "x" $2,
    $1 * $2, $3 / 1024, $3 * 1024 / (p * 4), $4, $4 * 1000 / r}'
done
rm -f /tmp/dopt_scale.$$
