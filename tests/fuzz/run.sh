#!/usr/bin/env bash
# Builds the libFuzzer harnesses with clang (ASan + UBSan) in build-fuzz/ and
# runs each for SECONDS (default 30) from its seed corpus (a copy: the
# committed seeds stay as they are), with its dictionary. Prints, per target,
# the executions, the coverage (libFuzzer's cov: edges) and the corpus size;
# exits non-zero when a target finds a crash, a leak or an undefined
# behaviour (the reproducer is left in build-fuzz/findings/). The targets run
# side by side, as many at a time as there are cores (DOPT_FUZZ_JOBS
# overrides; libFuzzer's run is one thread): each still fuzzes SECONDS.
#   tests/fuzz/run.sh [SECONDS] [TARGET...]      TARGET: safetensors yaml hparams trace ckpt verify agree paths escape
set -euo pipefail
cd "$(dirname "$0")/../.."
secs=${1:-30}
shift || true
targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(safetensors yaml hparams trace ckpt verify agree paths escape)
command -v clang >/dev/null || { echo "fuzz: clang is not installed (cmake/deps.sh --fuzz)" >&2; exit 1; }
CC=clang cmake -S . -B build-fuzz -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDOPT_FUZZ=ON -DDOPT_BUILD_TESTS=OFF \
  -DDOPT_CUDA=OFF -DDOPT_MPI=OFF >/dev/null
cmake --build build-fuzz -j"$(nproc)" --target $(printf 'fuzz_%s ' "${targets[@]}") >/dev/null
mkdir -p build-fuzz/findings
# one target: fuzz it, then write its table line (result "FOUND ..." on a finding) to build-fuzz/result-<target>
fuzz_one() {
  local t=$1 work=build-fuzz/corpus-$1 log=build-fuzz/fuzz-$1.log out=build-fuzz/result-$1 rc
  rm -rf "$work" && mkdir -p "$work" && cp tests/fuzz/corpus/$t/* "$work"/
  local dict=()
  [ -f tests/fuzz/$t.dict ] && dict=(-dict=tests/fuzz/$t.dict)
  set +e
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
    ./build-fuzz/tests/fuzz/fuzz_$t "$work" "${dict[@]}" -max_total_time="$secs" -max_len=65536 -rss_limit_mb=2048 \
    -timeout=20 -artifact_prefix=build-fuzz/findings/$t- -print_final_stats=1 >"$log" 2>&1
  rc=$?
  set -e
  local runs cov res=ok
  runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo '?')
  cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1 | grep -o '[0-9]*' || echo '?')
  [ $rc -ne 0 ] && res="FOUND (exit $rc, see $log)"
  printf '%-12s %10s %8s %8s %s\n' "$t" "$runs" "$cov" "$(ls "$work" | wc -l)" "$res" >"$out"
}
jobs=${DOPT_FUZZ_JOBS:-$(nproc)}
[ "$jobs" -ge 1 ] 2>/dev/null || jobs=1
running=0
for t in "${targets[@]}"; do
  rm -f build-fuzz/result-$t
  if [ $running -ge "$jobs" ]; then wait -n || true; running=$((running - 1)); fi
  fuzz_one "$t" &
  running=$((running + 1))
done
wait || true
fail=0
printf '%-12s %10s %8s %8s %s\n' target runs cov corpus result
for t in "${targets[@]}"; do
  if [ -f build-fuzz/result-$t ]; then cat build-fuzz/result-$t; else printf '%-12s did not report\n' "$t"; fail=1; fi
  grep -q FOUND build-fuzz/result-$t 2>/dev/null && fail=1
done
exit $fail
