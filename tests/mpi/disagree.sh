#!/usr/bin/env bash
# MPI ranks that disagree stop in one line (docs/mpi.md), and so do ranks a check refuses after they started: `distopt compare --backend mpi` under
# `mpirun -np 2` through a wrapper that gives rank 1 extra options. For each option the job must exit 2
# within the timeout, print exactly one line from distopt (naming the option and both values) and
# nothing on stdout; the control (no extra option) must run and print its verdict.
#   disagree.sh DISTOPT MPIRUN [MPIRUN ARGS...]      (the launcher's rank variable: OMPI_COMM_WORLD_RANK,
#                                                    PMI_RANK or PMIX_RANK)
set -u
distopt=$1
shift
work=$(mktemp -d "${TMPDIR:-/tmp}/dopt_disagree.XXXXXX")
trap 'rm -rf "$work"' EXIT
cat >"$work/wrap.sh" <<'WRAP'
#!/bin/sh
# rank 1 gets the extra options "$@"; every rank the base ones ($BASE)
r=${OMPI_COMM_WORLD_RANK:-${PMI_RANK:-${PMIX_RANK:-}}}
if [ "$r" = 1 ] && [ -n "${RANK1_ENV:-}" ]; then export "$RANK1_ENV"; fi
if [ "$r" = 1 ]; then exec "$DISTOPT" compare $BASE "$@"; fi
exec "$DISTOPT" compare $BASE
WRAP
chmod +x "$work/wrap.sh"
export DISTOPT=$distopt
fail=0
run() { # label, base, key, extra...
  local label=$1 base=$2 key=$3
  shift 3
  export BASE="--backend mpi --optimizer adamw --steps 3 --quiet $base"
  timeout 120 "${mpirun[@]}" "$work/wrap.sh" "$@" >"$work/out" 2>"$work/err" </dev/null
  local rc=$?
  local lines
  lines=$(grep -c '^distopt' "$work/err")
  if [ -z "$key" ]; then # the control: every rank agrees
    if [ $rc -ne 0 ] || ! grep -q 'verdict: EQUIVALENT (bitwise' "$work/out"; then
      echo "FAIL control ($base): exit $rc"; cat "$work/out" "$work/err"; fail=1
    else echo "ok   control ($base): exit 0, bitwise"; fi
    return
  fi
  if [ $rc -ne 2 ] || [ "$lines" -ne 1 ] || ! grep -q "^distopt compare: .*$key is '.*' on rank 1, '.*' on rank 0" "$work/err" \
     || [ -s "$work/out" ]; then
    echo "FAIL $label: exit $rc, $lines distopt lines (want exit 2, one line naming $key):"; cat "$work/err" "$work/out"
    fail=1
  else
    echo "ok   $label: $(grep '^distopt' "$work/err")"
  fi
}
# refused by the checks after the ranks start (options every rank agrees on; or one rank's own memory): every
# rank stops, exit 2, one distopt line (the lowest refusing rank's), nothing on stdout; before, each rank printed
# it and MPI_Abort gave exit 1
refuse() { # label, base (every rank), needle, rank 1's environment ("" none)
  local label=$1 base=$2 needle=$3
  export BASE="--backend mpi --optimizer adamw --steps 3 --quiet $base" RANK1_ENV=$4
  timeout 120 "${mpirun[@]}" "$work/wrap.sh" >"$work/out" 2>"$work/err" </dev/null
  local rc=$?
  local lines
  lines=$(grep -c '^distopt' "$work/err")
  if [ $rc -ne 2 ] || [ "$lines" -ne 1 ] || ! grep -q "^distopt compare: .*$needle" "$work/err" || [ -s "$work/out" ]; then
    echo "FAIL $label: exit $rc, $lines distopt lines (want exit 2, one line naming '$needle'):"; cat "$work/err" "$work/out"
    fail=1
  else
    echo "ok   $label: $(grep '^distopt' "$work/err")"
  fi
  RANK1_ENV=
}
mpirun=("$@" -np 2)
zero="--plugin zero --tp 1 --dp 2 --zero 1"
hybrid="--plugin hybrid --tp 1 --dp 2 --zero 2"
run control "$zero" ""
run optimizer "$zero" --optimizer --optimizer came
run plugin "$zero" --plugin --plugin hybrid --zero 2
run bf16 "$zero" --bf16 --bf16
run tp "$hybrid" --tp --tp 3
run max-grad-norm "$zero" --max-grad-norm --max-grad-norm 1
run steps "$zero" --steps --steps 5
run hparams "$zero" --hparams --hparams lr=1e-3
run seed "$zero" --seed --seed 7
run accumulation "$zero" --accumulation --accumulation 2
refuse pp-deeper-than-layers "--plugin hybrid --pp 2 --tp 1 --dp 1 --model 2mx1" "pp=2: the model has 1 decoder layers" ""
refuse chunk-size-elsewhere "$zero --chunk-size 64" "chunk_size=64 is Gemini's chunk" ""
refuse ep-not-dividing-dp "--plugin moe_hybrid --tp 1 --dp 2 --zero 1 --ep 4 --model mixtral-mini" "ep" ""
refuse rank1-memory "$zero --model 2mx2" "more than the 0.00 GiB available (DOPT_MEM_AVAILABLE)" DOPT_MEM_AVAILABLE=1000
refuse resume-fewer-ranks "$zero --checkpoint-at 2 --checkpoint-dir $work/ck --resume-dp 1" \
  "backend mpi resumes in the processes mpirun started" ""
refuse resume-no-folder "$zero --checkpoint-at 2" "backend mpi needs checkpoint_dir" ""
exit $fail
