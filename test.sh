#!/usr/bin/env bash
# Builds distopt with warnings as errors and runs every test; then the same
# tests under AddressSanitizer + UndefinedBehaviorSanitizer, a short run of
# every fuzz harness (tests/fuzz, clang), and the simulator tests and the threaded
# reference (label threads) under
# ThreadSanitizer. `./test.sh --quick` runs only the first part; `./test.sh --long`
# runs the full equivalence grid (DOPT_GRID_FULL=1: every tp, dp 1..4 x zero 0..3
# layout and grid setting) in the regular pass and every item of the CI grids
# under both sanitizers.
# The sanitizer passes run a rotating part of the long grids (DOPT_TEST_SUBSET,
# seeded by the commit: every 4th layout (ASan; TSan every 8th) of each optimizer
# setting from a seeded offset, at least one; test_threads' settings and optimizers likewise; the
# regular pass runs them all) to stay within CI's 18 minutes on 2 cores.
# Installs missing Debian packages when run as root.
set -euo pipefail
cd "$(dirname "$0")"
bash cmake/deps.sh --python # python3, numpy, venv, torch 1.13, and the torch 2 venv where it runs
# The interpreter of tests/python, tests/verify and the interop tests (DOPT_TEST_PYTHON): the pinned torch 2
# venv (cmake/torch2.sh, outside the clone) where it installed, else Debian's python3 with torch 1.13.
py=$(bash cmake/torch2.sh --path)
if [ -n "$py" ]; then pyarg=("-DDOPT_TEST_PYTHON=$py"); else pyarg=(-UDOPT_TEST_PYTHON); fi
jobs=$(nproc)
quick=0 long=0
case "${1:-}" in
  --quick) quick=1 ;;
  --long) long=1 ;;
  "") ;;
  *) echo "test.sh: unknown option '$1' (--quick, --long)" >&2; exit 2 ;;
esac
# the sanitizer passes' rotating subset: SEED/N, SEED the commit (a tree without git: 0)
seed=$(git rev-parse --short=12 HEAD 2>/dev/null || echo 0)
subset() { [ $long -eq 1 ] && echo "" || echo "$seed/$1"; }
unset DOPT_TEST_SUBSET

step() { printf '\n=== %s\n' "$*"; }

step "build (Release, -Werror) and all tests"
# --long: the full grid takes ~12 min of dist_grid alone, so its timeouts stretch (a cache value: reset here)
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DDOPT_WERROR=ON -DDOPT_TIMEOUT_SCALE=$([ $long -eq 1 ] && echo 4 || echo 1) \
  "${pyarg[@]}" >/dev/null
cmake --build build -j"$jobs" >/dev/null
DOPT_GRID_FULL=$long ctest --test-dir build --output-on-failure -j"$jobs"
[ $quick -eq 1 ] && exit 0

# The device kit (docs/cuda.md): what a lent GPU runs is built and dry-run here whenever a CUDA compiler is
# installed (~45 s); CI's bare Debian has none (the toolkit is not a Debian main package), so it says so.
step "device kit: cuda/kit.sh and the dry run of cuda/check.sh"
if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
  PATH=$PATH:/usr/local/cuda/bin bash cuda/kit.sh
  OUT=build/kit-dry-run bash cuda/check.sh >/dev/null
  head -1 build/kit-dry-run/summary.txt
else
  echo "skipped: no CUDA compiler (nvcc) on this machine"
fi

# The `mpi` tests (mpirun; tests/mpi) run in the regular pass only: under
# LeakSanitizer OpenMPI's own allocations, never freed at MPI_Finalize, fail
# every mpi test at exit, so the sanitizer passes leave them out (-LE mpi here;
# the TSan pass runs only the sim label). The `tutorial` test builds its own,
# uninstrumented copy of the project: the regular pass runs it. The `stream`
# test runs the CLI under an address-space limit, which ASan's shadow memory
# cannot live in: the regular pass runs it.
step "AddressSanitizer + UndefinedBehaviorSanitizer: all tests but mpi, tutorial and stream"
cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DDOPT_WERROR=ON -DDOPT_SANITIZE=address,undefined \
  -DDOPT_TIMEOUT_SCALE=4 >/dev/null
cmake --build build-asan -j"$jobs" >/dev/null
echo "rotating subset of the long grids: DOPT_TEST_SUBSET=$(subset 4) (empty: all)"
DOPT_TEST_SUBSET=$(subset 4) ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --test-dir build-asan --output-on-failure -j"$jobs" -LE "mpi|tutorial|stream"

step "fuzz smoke: every loader's libFuzzer harness for ${DOPT_FUZZ_SECONDS:-30} s (clang, ASan+UBSan)"
bash cmake/deps.sh --fuzz
bash tests/fuzz/run.sh "${DOPT_FUZZ_SECONDS:-30}"

if ctest --test-dir build -N -L sim 2>/dev/null | grep -q "Total Tests: [1-9]"; then
  step "ThreadSanitizer: simulator tests and the threaded reference"
  cmake -S . -B build-tsan -DCMAKE_BUILD_TYPE=Debug -DDOPT_WERROR=ON -DDOPT_SANITIZE=thread \
    -DDOPT_TIMEOUT_SCALE=8 >/dev/null
  cmake --build build-tsan -j"$jobs" >/dev/null
  # 1 in 8 here (1 in 4 under ASan): races show in any layout, and TSan's dist_grid at 1 in 4 took 196 s
  echo "rotating subset of the long grids: DOPT_TEST_SUBSET=$(subset 8) (empty: all)"
  DOPT_TEST_SUBSET=$(subset 8) TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 ctest --test-dir build-tsan --output-on-failure -L "sim|threads" -j"$jobs"
fi
