#!/bin/sh
# How `distopt compare` scales with ranks: peak memory in model copies and CPU per step, at tp x dp
# = 2x2, 4x4 and 8x8 (ZeRO 2), against the reference side's own work in the same run.
#
# usage: bench/compare_scale.sh [DISTOPT] [MODEL_ARGS]
#   DISTOPT     the CLI (default build/cli/distopt)
#   MODEL_ARGS  the model (default "--model 20m"); "" runs the built-in model
# Environment: OPT (default adamw), LAYOUTS (default "2x2 4x4 8x8"), STEPS (default 10), PARAMS (the model's
# parameter count, when MODEL_ARGS is not a --model the CLI's `mem` can size), REPS (default 3).
#
# Peak RSS (/usr/bin/time's maximum resident set) over the model's fp32 bytes; CPU per step and the reference's
# own work from the run's --json "cpu_seconds" (over the steps after the first: the process's CPU, and the
# reference's dp x micro gradients, their exact sum and its optimizer step on its one thread: --threads 1);
# "x ref work" = process / reference. Medians of REPS runs.
set -eu
BIN=${1:-build/cli/distopt}
MODEL=${2---model 20m}
OPT=${OPT:-adamw}
LAYOUTS=${LAYOUTS:-"2x2 4x4 8x8"}
STEPS=${STEPS:-10}
REPS=${REPS:-3}
command -v /usr/bin/time >/dev/null 2>&1 || { echo "needs /usr/bin/time (Debian: time)" >&2; exit 2; }
if [ -z "${PARAMS:-}" ]; then
  spec=$(printf '%s\n' "$MODEL" | sed -n 's/.*--model \([^ ]*\).*/\1/p')
  [ -n "$spec" ] || { echo "PARAMS (the parameter count) is needed without --model" >&2; exit 2; }
  PARAMS=$("$BIN" mem --model "$spec" | sed -n '1s/.* B parameters (\([0-9]*\);.*/\1/p')
fi
tmp=${TMPDIR:-/tmp}/dopt_scale.$$
median() { sort -n | awk '{a[NR] = $1} END {print a[int((NR + 1) / 2)]}'; }
run() { # tp dp -> "max_rss_kb process_cpu_per_step reference_cpu_per_step"
  /usr/bin/time -f "%M" -o "$tmp.t" "$BIN" compare --optimizer "$OPT" $MODEL --steps "$STEPS" --tp "$1" --dp "$2" \
    --zero 2 --threads 1 --quiet --json "$tmp.json" >/dev/null 2>&1 || true
  python3 -c 'import json,sys; c=json.load(open(sys.argv[1]))["cpu_seconds"]; print(open(sys.argv[2]).read().split()[-1], c["process"]/c["steps"], c["reference"]/c["steps"])' "$tmp.json" "$tmp.t"
}
mb=$(awk -v p="$PARAMS" 'BEGIN {printf "%.1f", p * 4 / 1e6}')
echo "compare $OPT $MODEL --zero 2 --threads 1 --steps $STEPS: $PARAMS parameters ($mb MB fp32), medians of $REPS runs"
printf '%8s %6s %10s %8s %12s %14s %12s\n' "tp x dp" ranks "peak MiB" copies "CPU s/step" "ref work s/st" "x ref work"
for l in $LAYOUTS; do
  tp=${l%x*}; dp=${l#*x}
  rss=""; cpu=""; ref=""; rat=""
  for k in $(seq "$REPS"); do
    set -- $(run "$tp" "$dp")
    rss="$rss $1"; cpu="$cpu $2"; ref="$ref $3"; rat="$rat $(awk -v a="$2" -v b="$3" 'BEGIN {printf "%.3f", a / b}')"
  done
  m=$(echo $rss | tr ' ' '\n' | median); c=$(echo $cpu | tr ' ' '\n' | median)
  r=$(echo $ref | tr ' ' '\n' | median); q=$(echo $rat | tr ' ' '\n' | median)
  awk -v tp="$tp" -v dp="$dp" -v m="$m" -v p="$PARAMS" -v c="$c" -v r="$r" -v q="$q" 'BEGIN {
    printf "%8s %6d %10.0f %8.1f %12.3f %14.3f %12.2f\n", tp "x" dp, tp * dp, m / 1024, m * 1024 / (p * 4), c, r, q }'
done
rm -f "$tmp.t" "$tmp.json"
