#!/usr/bin/env bash
# The tutorial test: docs/tutorial-validate.md, done as a reader would do it.
#
#   run_tutorial.sh SRC WORK
#
# Copies the project (without build trees) to WORK/tree and walks the
# tutorial's marked code blocks in order:
#   <!-- tutorial-test: write PATH -->   the next fenced block is the file PATH
#   <!-- tutorial-test: append PATH -->  the next fenced block is appended to PATH
#   <!-- tutorial-test: entry PATH -->   a golden entry: written to PATH, checked as Python when python3 exists
#   <!-- tutorial-test: run -->          the next fenced block runs in the copy (bash -e -o pipefail)
# Nothing else is edited. Then it breaks the tutorial's statistic on purpose
# (the logical count replaced by the local one) and requires --sweep to fail,
# so a sweep that cannot see a sharding bug fails this test.
set -euo pipefail
SRC=$1
WORK=$2
DOC="$SRC/docs/tutorial-validate.md"
TREE="$WORK/tree"
rm -rf "$WORK"
mkdir -p "$TREE"
for e in "$SRC"/* "$SRC"/.ci; do
  b=$(basename "$e")
  case "$b" in build | build-* | kit | .golden-venv) continue ;; esac
  [ -e "$e" ] && cp -a "$e" "$TREE/"
done
# The tutorial's own build line reuses this cache: the library and the CLI, no tests.
cmake -S "$TREE" -B "$TREE/build" -DCMAKE_BUILD_TYPE=Release -DDOPT_BUILD_TESTS=OFF -DDOPT_MPI=OFF -DDOPT_CUDA=OFF \
  >"$WORK/configure.log" 2>&1 || { cat "$WORK/configure.log"; exit 1; }

nblocks=0
mode="" path="" inblock=0 body=""
finish_block() {
  nblocks=$((nblocks + 1))
  case "$mode" in
  write | entry)
    mkdir -p "$(dirname "$TREE/$path")"
    printf '%s' "$body" >"$TREE/$path"
    echo "== tutorial: wrote $path"
    if [ "$mode" = entry ] && command -v python3 >/dev/null; then
      python3 -c 'import ast, sys; ast.parse(open(sys.argv[1]).read(), sys.argv[1])' "$TREE/$path"
    fi
    ;;
  append)
    printf '%s' "$body" >>"$TREE/$path"
    echo "== tutorial: appended to $path: $body"
    ;;
  run)
    echo "== tutorial: running"
    printf '%s' "$body"
    local t0=$SECONDS
    (cd "$TREE" && bash -e -o pipefail -c "$body") || {
      echo "tutorial-validate.md block $nblocks failed"
      exit 1
    }
    echo "== tutorial: block $nblocks done in $((SECONDS - t0)) s"
    ;;
  esac
  mode=""
}
while IFS= read -r line || [ -n "$line" ]; do
  if [ $inblock = 1 ]; then
    if [[ "$line" == '```'* ]]; then
      inblock=0
      finish_block
    else
      body+="$line"$'\n'
    fi
    continue
  fi
  if [[ "$line" =~ ^\<!--\ tutorial-test:\ (write|append|entry|run)\ ?([^ ]*)\ --\>$ ]]; then
    mode=${BASH_REMATCH[1]}
    path=${BASH_REMATCH[2]}
    continue
  fi
  if [ -n "$mode" ] && [[ "$line" == '```'* ]]; then
    inblock=1
    body=""
  fi
done <"$DOC"
[ $nblocks -ge 7 ] || { echo "tutorial-validate.md: only $nblocks marked blocks (expected >= 7)"; exit 1; }

# Golden coverage. Before the generator has run for lion, test_golden must
# name it as uncovered; with the cases the tutorial's entry generated
# (tests/tutorial/golden/: `gen_golden.py lion` with lion-pytorch 0.2.5,
# recorded once; the test cannot reach PyPI) the tutorial's C step must match
# upstream within the entry's declared tolerances.
cmake -S "$TREE" -B "$TREE/build" -DDOPT_BUILD_TESTS=ON >"$WORK/configure-tests.log" 2>&1 ||
  { cat "$WORK/configure-tests.log"; exit 1; }
cmake --build "$TREE/build" -j2 --target unit_test_golden >"$WORK/golden-build.log" 2>&1 ||
  { cat "$WORK/golden-build.log"; exit 1; }
golden=$(find "$TREE/build/tests" -maxdepth 1 -name unit_test_golden -type f | head -1)
set +e
DOPT_SOURCE_DIR="$TREE" "$golden" >"$WORK/golden-before.txt" 2>&1
rc=$?
set -e
if [ $rc -eq 0 ] || ! grep -q "lion is registered but has no golden coverage" "$WORK/golden-before.txt"; then
  cat "$WORK/golden-before.txt"
  echo "test_golden did not report lion as uncovered (exit $rc)"
  exit 1
fi
echo "== tutorial: before its golden cases exist, test_golden fails naming lion"
mkdir -p "$WORK/golden"
cp "$SRC"/tests/tutorial/golden/* "$SRC"/datasets/golden/inputs.safetensors "$SRC"/datasets/golden/inputs_long.safetensors \
  "$WORK/golden/"
DOPT_SOURCE_DIR="$TREE" DOPT_GOLDEN_DIR="$WORK/golden" "$golden" >"$WORK/golden-after.txt" 2>&1 || { cat "$WORK/golden-after.txt"; exit 1; }
grep -E "^lion" "$WORK/golden-after.txt"
# the tutorial says bit for bit: every lion case's four error columns are 0
nlion=$(awk '/^lion_[a-z_]*\.safetensors/ { n++; if ($3 != 0 || $4 != 0 || $5 != 0 || $6 != 0) bad = 1 }
             END { print bad ? -1 : n + 0 }' "$WORK/golden-after.txt")
[ "$nlion" -eq 3 ] || { echo "lion golden cases: expected 3, bitwise; got $nlion"; exit 1; }
echo "== tutorial: the tutorial's lion matches lion-pytorch's golden cases bit for bit"

# The statistic, broken on purpose: the RMS divided by the piece's length
# instead of the logical element count must be caught by --sweep.
sed -i 's/dopt_ss_value(ss), a->piece->numel)/dopt_ss_value(ss), n)/' "$TREE/ref/signsgd.c"
grep -q 'dopt_ss_value(ss), n)' "$TREE/ref/signsgd.c" || { echo "mutation not applied"; exit 1; }
cmake --build "$TREE/build" -j2 >"$WORK/mutant-build.log" 2>&1 || { cat "$WORK/mutant-build.log"; exit 1; }
set +e
"$TREE/build/cli/distopt" compare --optimizer signsgd --hparams lr=1e-2 --sweep --max-tp 2 --max-dp 2 \
  >"$WORK/mutant.txt" 2>&1
rc=$?
set -e
if [ $rc -ne 1 ]; then
  cat "$WORK/mutant.txt"
  echo "the broken statistic was not caught: --sweep exited $rc (expected 1)"
  exit 1
fi
echo "== tutorial: the broken statistic is caught (--sweep exit 1)"
tail -3 "$WORK/mutant.txt"
echo "tutorial: $nblocks blocks, all passed"
