#!/usr/bin/env bash
# Mutation score of the test suite (docs/mutation.md).
#
#   bash tests/mutation/run.sh [--only PATTERN] [--labels unit,sim] [--jobs N]
#                              [--list FILE] [--work DIR] [--all-tests]
#                              [--timeout-factor F] [--check]
#
# Applies ONE single-line mutation at a time (tests/mutation/mutations.txt) to a
# private copy of the tree (build-mutation/src), rebuilds it incrementally
# (build-mutation/build), runs the selected tests cheapest first and stops at
# the first failing one; prints per mutation caught / survived and the first
# catching test, then a summary table and the mutation score, and writes
# build-mutation/results.tsv and results.json (schema_version 1).
#
# The working tree is only read: `git ls-files` (tracked and untracked, not
# ignored) is copied, and every mutation is applied to and restored in the copy.
# Before any mutation the unmutated copy must build and pass the chosen tests
# (the baseline); otherwise nothing is scored (exit 2).
#
# Exit status: 0 every non-equivalent mutation caught and none stale; 1 a
# survivor, a stale or unbuildable mutation; 2 usage error or failed baseline.
set -uo pipefail

SCHEMA_VERSION=1
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
LIST=$ROOT/tests/mutation/mutations.txt
WORK=$ROOT/build-mutation
ONLY=""
LABELS="unit,sim"
JOBS=$(nproc 2>/dev/null || echo 2)
ALL_TESTS=0
CHECK_ONLY=0
TFACTOR=4
# the classes a mutation may name (docs/mutation.md#classes)
CLASSES="dropped-reduction logical-count group-size zero-padding sharding exact-sum dp-sum clipping defaults
replica-drift step-counter bias-correction wd-order quantiser galore lisa checkpoint digest nonfinite rounding
loader simulator bucketing harness config train-eval formula eigenbasis"

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; exit "${1:-2}"; }
die() { printf 'mutation: %s\n' "$*" >&2; exit 2; }

while [ $# -gt 0 ]; do
  case $1 in
  --only) ONLY=${2:?--only needs a pattern}; shift 2 ;;
  --labels) LABELS=${2:?--labels needs a list}; shift 2 ;;
  --jobs | -j) JOBS=${2:?--jobs needs a number}; shift 2 ;;
  --list) LIST=$(cd "$(dirname "$2")" && pwd)/$(basename "$2"); shift 2 ;;
  --work) mkdir -p "$2" && WORK=$(cd "$2" && pwd); shift 2 ;;
  --all-tests) ALL_TESTS=1; shift ;;
  --timeout-factor) TFACTOR=${2:?}; shift 2 ;;
  --check) CHECK_ONLY=1; shift ;;
  -h | --help) usage 0 ;;
  *) printf 'mutation: unknown option %s\n' "$1" >&2; usage ;;
  esac
done
[[ $JOBS =~ ^[1-9][0-9]*$ ]] || die "--jobs $JOBS: a positive integer"
[[ $TFACTOR =~ ^[1-9][0-9]*$ ]] || die "--timeout-factor $TFACTOR: a positive integer"
[ -f "$LIST" ] || die "no mutation list $LIST"
for t in git cmake ctest awk timeout cmp md5sum; do command -v $t >/dev/null || die "needs $t"; done

now() { date +%s.%N; }
secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'; }

# ---- the list ------------------------------------------------------------------------
# Records of `key: value` lines separated by blank lines; '#' starts a comment
# line. Keys: id class file find replace desc [equivalent] [tests].
M_ID=() M_CLASS=() M_FILE=() M_FIND=() M_REPL=() M_DESC=() M_EQUIV=() M_TESTS=() M_LINE=()
parse_list() {
  local n=0 ln=0 line key val rec_line=0
  local -A seen=() cur=()
  flush_rec() {
    [ ${#cur[@]} -eq 0 ] && return 0
    local k
    for k in id class file find replace desc; do
      [ -n "${cur[$k]+x}" ] || die "$LIST:$rec_line: record without '$k:'"
    done
    [[ ${cur[id]} =~ ^[a-z0-9][a-z0-9._-]*$ ]] || die "$LIST:$rec_line: id '${cur[id]}': use [a-z0-9._-]"
    [ -z "${seen[${cur[id]}]+x}" ] || die "$LIST:$rec_line: duplicate id ${cur[id]}"
    seen[${cur[id]}]=1
    [[ " $(echo $CLASSES) " == *" ${cur[class]} "* ]] || die "$LIST:$rec_line: ${cur[id]}: unknown class '${cur[class]}' (one of: $(echo $CLASSES))"
    [ -n "${cur[find]}" ] || die "$LIST:$rec_line: ${cur[id]}: empty find"
    [ "${cur[find]}" != "${cur[replace]}" ] || die "$LIST:$rec_line: ${cur[id]}: replace equals find"
    local eq=${cur[equivalent]:-no}
    [[ $eq == no || $eq == yes:* ]] || die "$LIST:$rec_line: ${cur[id]}: equivalent must be 'no' or 'yes: <reason>'"
    M_ID[n]=${cur[id]} M_CLASS[n]=${cur[class]} M_FILE[n]=${cur[file]} M_FIND[n]=${cur[find]}
    M_REPL[n]=${cur[replace]} M_DESC[n]=${cur[desc]} M_EQUIV[n]=$eq M_TESTS[n]=${cur[tests]:-} M_LINE[n]=$rec_line
    n=$((n + 1))
    cur=()
  }
  while IFS= read -r line || [ -n "$line" ]; do
    ln=$((ln + 1))
    case $line in
    '#'*) continue ;;
    '') flush_rec; continue ;;
    esac
    [[ $line =~ ^([a-z]+):(.*)$ ]] || die "$LIST:$ln: expected 'key: value', got: $line"
    key=${BASH_REMATCH[1]} val=${BASH_REMATCH[2]}
    val=${val# }
    case $key in id | class | file | find | replace | desc | equivalent | tests) ;;
    *) die "$LIST:$ln: unknown key '$key'" ;;
    esac
    [ ${#cur[@]} -eq 0 ] && rec_line=$ln
    [ -z "${cur[$key]+x}" ] || die "$LIST:$ln: '$key' twice in one record"
    cur[$key]=$val
  done <"$LIST"
  flush_rec
}
parse_list
NM=${#M_ID[@]}
[ "$NM" -gt 0 ] || die "$LIST: no mutations"

SEL=()
for ((i = 0; i < NM; i++)); do
  if [ -z "$ONLY" ] || [[ ${M_ID[i]} =~ $ONLY ]] || [[ ${M_CLASS[i]} =~ $ONLY ]]; then SEL+=("$i"); fi
done
[ ${#SEL[@]} -gt 0 ] || die "--only '$ONLY' selects none of the $NM mutations"

# Lines of file $1 containing the literal $2: "<count> <first line number>".
match_lines() {
  MUT_FIND=$2 awk 'BEGIN { f = ENVIRON["MUT_FIND"] } index($0, f) { c++; if (!l) l = NR } END { print c + 0, l + 0 }' "$1"
}
# Rewrites line $3 of file $1, replacing the first literal $2 with $4 (to $5).
apply_mutation() {
  MUT_FIND=$2 MUT_REPL=$4 awk -v ln="$3" 'BEGIN { f = ENVIRON["MUT_FIND"]; r = ENVIRON["MUT_REPL"] }
    NR == ln { i = index($0, f); $0 = substr($0, 1, i - 1) r substr($0, i + length(f)) } { print }' "$1" >"$5"
}

if [ $CHECK_ONLY -eq 1 ]; then # the list against the working tree, nothing built
  bad=0
  for i in "${SEL[@]}"; do
    f=$ROOT/${M_FILE[i]}
    if [ -f "$f" ]; then read -r c l < <(match_lines "$f" "${M_FIND[i]}"); else c=0 l=0; fi
    if [ "$c" -eq 1 ]; then st="ok ${M_FILE[i]}:$l"; else st="STALE (matches $c lines)"; bad=1; fi
    printf '%-28s %s\n' "${M_ID[i]}" "$st"
  done
  exit $bad
fi

# ---- the scratch tree ----------------------------------------------------------------
mkdir -p "$WORK" || die "cannot create $WORK"
exec 9>"$WORK/.lock"
if command -v flock >/dev/null && ! flock -n 9; then die "another run holds $WORK/.lock"; fi
SRC=$WORK/src BLD=$WORK/build LOGS=$WORK/logs
mkdir -p "$SRC" "$BLD" "$LOGS"
rm -f "$LOGS"/*.log

T_START=$(now)
echo "== mutation run: $(date -u +%Y-%m-%dT%H:%M:%SZ), ${#SEL[@]} of $NM mutations, labels $LABELS, jobs $JOBS"
echo "== copying the working tree to $SRC (files that differ get a new mtime, so make rebuilds them)"
(cd "$ROOT" && git ls-files -z -co --exclude-standard) >"$WORK/files.z" || die "git ls-files failed in $ROOT"
copied=0
: >"$WORK/files.txt"
while IFS= read -r -d '' f; do
  case $f in build-mutation/*) continue ;; esac
  [ -f "$ROOT/$f" ] || continue # deleted in the working tree
  printf '%s\n' "$f" >>"$WORK/files.txt"
  if ! cmp -s "$ROOT/$f" "$SRC/$f"; then
    mkdir -p "$SRC/$(dirname "$f")" && cp "$ROOT/$f" "$SRC/$f" || die "cannot copy $f"
    copied=$((copied + 1))
  fi
done <"$WORK/files.z"
removed=0
while IFS= read -r f; do rm -f "$SRC/$f"; removed=$((removed + 1)); done < <(
  comm -23 <(cd "$SRC" && find . -type f | sed 's|^\./||' | LC_ALL=C sort) <(LC_ALL=C sort "$WORK/files.txt"))
echo "   $(wc -l <"$WORK/files.txt") files, $copied copied, $removed removed"

# ---- configure, baseline build -------------------------------------------------------
want_label() { [[ ",$LABELS," == *",$1,"* ]]; }
CUDA=OFF MPI=OFF
want_label gpu && CUDA=AUTO
want_label mpi && MPI=AUTO
echo "== configure (Release, no -Werror, DOPT_CUDA=$CUDA DOPT_MPI=$MPI)"
cmake -S "$SRC" -B "$BLD" -DCMAKE_BUILD_TYPE=Release -DDOPT_WERROR=OFF -DDOPT_FUZZ=OFF -DDOPT_CUDA=$CUDA \
  -DDOPT_MPI=$MPI >"$LOGS/configure.log" 2>&1 || { tail -20 "$LOGS/configure.log"; die "configure failed ($LOGS/configure.log)"; }

build() { cmake --build "$BLD" -j "$JOBS" >"$1" 2>&1; }
t0=$(now)
if ! build "$LOGS/baseline.build.log"; then
  grep -m 20 -E 'error|Error' "$LOGS/baseline.build.log"
  die "baseline build failed ($LOGS/baseline.build.log): the tree does not build as copied (someone's edit in progress?); retry later"
fi
T_BASE_BUILD=$(secs "$t0" "$(now)")
echo "   baseline build ${T_BASE_BUILD} s"
# object checksums: a mutation whose objects come out identical is equivalent by construction
(cd "$BLD" && find . -name '*.o' -path '*CMakeFiles*' -print0 | xargs -0 -r md5sum) >"$WORK/objects.md5"

# ---- the tests -----------------------------------------------------------------------
label_re=$(echo "$LABELS" | sed 's/,/|/g')
excl=()
for l in mpi tutorial gpu; do want_label $l || excl+=("$l"); done
excl_re=$(
  IFS='|'
  echo "${excl[*]}"
)
listing=$(ctest --test-dir "$BLD" -N -L "^($label_re)\$" ${excl_re:+-LE "^($excl_re)\$"}) || die "ctest -N failed"
TESTS=()
while read -r name; do TESTS+=("$name"); done < <(printf '%s\n' "$listing" | sed -n 's/^ *Test *#[0-9]*: *//p')
[ ${#TESTS[@]} -gt 0 ] || die "no test has the labels $LABELS"
# each test's labels among the chosen ones (the score per label, below)
declare -A T_LABELS=()
for l in ${LABELS//,/ }; do
  while read -r name; do T_LABELS[$name]+=" $l"; done < <(ctest --test-dir "$BLD" -N -L "^$l\$" |
    sed -n 's/^ *Test *#[0-9]*: *//p')
done

# run_test NAME LIMIT LOG: ctest on one test under a wall-clock limit; sets RT_RC, RT_SECS
# (in the background and waited for: `timeout` runs the test in its own process group, out of reach of
# a Ctrl-C, and a trapped signal interrupts `wait` at once; the trap then stops it through RT_PID)
RT_PID=""
run_test() {
  local t0
  t0=$(now)
  timeout -k 10 "$2" ctest --test-dir "$BLD" -R "^$1\$" --no-tests=error --output-on-failure >"$3" 2>&1 9>&- &
  RT_PID=$!
  wait "$RT_PID"
  RT_RC=$?
  RT_PID=""
  RT_SECS=$(secs "$t0" "$(now)")
}

R_STATUS=() R_TEST=() R_TSECS=() R_BSECS=() R_NRUN=() R_WALL=() R_WHERE=() R_DETAIL=()
ORIG=$WORK/.orig CUR_FILE=""
restore() {
  if [ -n "$CUR_FILE" ]; then
    cp "$ORIG" "$SRC/$CUR_FILE" # a new mtime: the next build compiles the original again
    CUR_FILE=""
  fi
}
stop_test() { # a test still running: TERM to `timeout`, which passes it on to the test
  if [ -n "$RT_PID" ]; then
    kill -TERM "$RT_PID" 2>/dev/null
    wait "$RT_PID" 2>/dev/null
    RT_PID=""
  fi
}
trap 'stop_test; restore' EXIT
trap 'stop_test; restore; echo "mutation: interrupted; $SRC restored" >&2; exit 130' INT TERM

declare -A BASE_T=()
echo "== baseline: ${#TESTS[@]} tests (labels $LABELS), one at a time"
t0=$(now)
fail=0
for t in "${TESTS[@]}"; do
  run_test "$t" 1800 "$LOGS/baseline.$t.log"
  BASE_T[$t]=$RT_SECS
  if [ $RT_RC -ne 0 ]; then
    printf '   FAIL %-28s %6s s (%s)\n' "$t" "$RT_SECS" "$LOGS/baseline.$t.log"
    fail=1
  fi
done
T_BASE_TESTS=$(secs "$t0" "$(now)")
if [ $fail -ne 0 ]; then
  die "the unmutated baseline fails (above): nothing scored. Fix the tree or wait for the edit in progress, then rerun"
fi
ORDER=()
while read -r _ t; do ORDER+=("$t"); done < <(for t in "${TESTS[@]}"; do echo "${BASE_T[$t]} $t"; done | sort -n -k1,1)
echo "   baseline tests ${T_BASE_TESTS} s; order (s):"
for t in "${ORDER[@]}"; do printf '%s(%s) ' "$t" "${BASE_T[$t]}"; done | fold -s -w 110 | sed 's/^/     /'
echo

# per-test limit under a mutation: F × its baseline time + 20 s (a hang is caught, as "timeout")
limit_of() { awk -v b="${BASE_T[$1]}" -v f="$TFACTOR" 'BEGIN { printf "%d", b * f + 20 }'; }

# ---- the mutations -------------------------------------------------------------------
objects_identical() { # every object compiled from source $1 is byte-identical to the baseline's
  local base objs o
  base=$(basename "$1")
  objs=$(grep -F "/$base.o" "$WORK/objects.md5" | awk '{ print $2 }')
  [ -n "$objs" ] || return 1
  for o in $objs; do
    [ -f "$BLD/$o" ] || return 1
    grep -qF "$(cd "$BLD" && md5sum "$o")" "$WORK/objects.md5" || return 1
  done
  return 0
}

k=0
for i in "${SEL[@]}"; do
  k=$((k + 1))
  id=${M_ID[i]} file=${M_FILE[i]}
  tm0=$(now)
  R_STATUS[i]="" R_TEST[i]="" R_TSECS[i]=0 R_BSECS[i]=0 R_NRUN[i]=0 R_WHERE[i]="$file" R_DETAIL[i]=""
  c=0 l=0
  [ -f "$SRC/$file" ] && read -r c l < <(match_lines "$SRC/$file" "${M_FIND[i]}")
  if [ "$c" -ne 1 ]; then
    R_STATUS[i]=STALE R_DETAIL[i]="find matches $c lines"
  else
    R_WHERE[i]="$file:$l"
    cp "$SRC/$file" "$ORIG"
    CUR_FILE=$file
    apply_mutation "$ORIG" "${M_FIND[i]}" "$l" "${M_REPL[i]}" "$SRC/$file"
    tb0=$(now)
    if ! build "$LOGS/$id.build.log"; then
      R_BSECS[i]=$(secs "$tb0" "$(now)")
      R_STATUS[i]=BUILD_ERROR R_DETAIL[i]="see logs/$id.build.log"
    else
      R_BSECS[i]=$(secs "$tb0" "$(now)")
      rm -f "$LOGS/$id.build.log"
      if objects_identical "$file"; then
        R_STATUS[i]=IDENTICAL R_DETAIL[i]="the compiled objects equal the baseline's"
      else
        # hints first, then every test cheapest first
        run=()
        declare -A done_t=()
        for t in ${M_TESTS[i]} "${ORDER[@]}"; do
          [ -n "${BASE_T[$t]+x}" ] && [ -z "${done_t[$t]+x}" ] && run+=("$t") && done_t[$t]=1
        done
        unset done_t
        ts0=$(now)
        R_STATUS[i]=SURVIVED
        for t in "${run[@]}"; do
          R_NRUN[i]=$((R_NRUN[i] + 1))
          lim=$(limit_of "$t")
          run_test "$t" "$lim" "$LOGS/$id.$t.log"
          if [ $RT_RC -eq 0 ]; then
            rm -f "$LOGS/$id.$t.log"
            continue
          fi
          if [ -z "${R_TEST[i]}" ]; then
            R_STATUS[i]=CAUGHT R_TEST[i]=$t
            if [ $RT_RC -eq 124 ] || [ $RT_RC -eq 137 ] || grep -q '\*\*\*Timeout' "$LOGS/$id.$t.log"; then
              R_DETAIL[i]="timeout after $RT_SECS s"
            else
              R_DETAIL[i]="failed in $RT_SECS s"
            fi
          else
            R_TEST[i]="${R_TEST[i]},$t"
          fi
          [ $ALL_TESTS -eq 1 ] || break
        done
        R_TSECS[i]=$(secs "$ts0" "$(now)")
      fi
    fi
    restore
  fi
  R_WALL[i]=$(secs "$tm0" "$(now)")
  eqm=""
  [ "${M_EQUIV[i]}" != no ] && eqm=" [marked equivalent]"
  printf '[%d/%d] %-28s %-11s %-22s build %5s s  tests %6s s (%d run)  %s%s\n' "$k" "${#SEL[@]}" "$id" \
    "${R_STATUS[i]}" "${R_TEST[i]:--}" "${R_BSECS[i]}" "${R_TSECS[i]}" "${R_NRUN[i]}" "${R_DETAIL[i]}" "$eqm"
done
trap - EXIT INT TERM

# ---- summary -------------------------------------------------------------------------
T_TOTAL=$(secs "$T_START" "$(now)")
caught=0 survived=0 stale=0 berr=0 ident=0 eq_caught=0 eq_surv=0
for i in "${SEL[@]}"; do
  eq=0
  [ "${M_EQUIV[i]}" != no ] && eq=1
  case ${R_STATUS[i]} in
  CAUGHT) if [ $eq -eq 1 ]; then eq_caught=$((eq_caught + 1)); else caught=$((caught + 1)); fi ;;
  SURVIVED) if [ $eq -eq 1 ]; then eq_surv=$((eq_surv + 1)); else survived=$((survived + 1)); fi ;;
  STALE) stale=$((stale + 1)) ;;
  BUILD_ERROR) berr=$((berr + 1)) ;;
  IDENTICAL) ident=$((ident + 1)) ;;
  esac
done
scored=$((caught + survived))
score=$(awk -v c=$caught -v s=$scored 'BEGIN { if (s) printf "%.1f", 100 * c / s; else printf "n/a" }')

echo
echo "== summary"
printf '%-28s %-18s %-11s %-22s %-5s %8s  %s\n' id class status first_catching_test equiv wall_s where
for i in "${SEL[@]}"; do
  eq=no
  [ "${M_EQUIV[i]}" != no ] && eq=yes
  printf '%-28s %-18s %-11s %-22s %-5s %8s  %s\n' "${M_ID[i]}" "${M_CLASS[i]}" "${R_STATUS[i]}" "${R_TEST[i]:--}" \
    "$eq" "${R_WALL[i]}" "${R_WHERE[i]}"
done
echo
echo "baseline: build ${T_BASE_BUILD} s, tests ${T_BASE_TESTS} s; total wall ${T_TOTAL} s"
echo "mutation score: $caught / $scored non-equivalent mutations caught = $score %"
echo "  survived (non-equivalent): $survived; marked equivalent: $eq_surv survived, $eq_caught caught;" \
  "identical objects: $ident; stale: $stale; build errors: $berr"
# per label: a scored mutation counts for a label when a test of that label caught it; with --all-tests that is
# the score a run of that label's tests alone would get, else only the first catching test counts
declare -A L_CAUGHT=()
for l in ${LABELS//,/ }; do
  n=0
  for i in "${SEL[@]}"; do
    [ "${R_STATUS[i]}" = CAUGHT ] && [ "${M_EQUIV[i]}" = no ] || continue
    for t in ${R_TEST[i]//,/ }; do
      if [[ " ${T_LABELS[$t]:-} " == *" $l "* ]]; then n=$((n + 1)); break; fi
    done
  done
  L_CAUGHT[$l]=$n
  printf '  label %-9s %d / %d caught by its tests%s\n' "$l" "$n" "$scored" \
    "$([ $ALL_TESTS -eq 1 ] && echo " (its own score)" || echo " (first catching test only; --all-tests: its own score)")"
done
for i in "${SEL[@]}"; do
  if [ "${R_STATUS[i]}" = SURVIVED ] && [ "${M_EQUIV[i]}" = no ]; then echo "  SURVIVOR ${M_ID[i]}: ${M_DESC[i]}"; fi
  if [ "${R_STATUS[i]}" = STALE ]; then echo "  STALE ${M_ID[i]} (${M_FILE[i]}, list line ${M_LINE[i]}): ${R_DETAIL[i]}"; fi
done

# machine-readable results
tsv=$WORK/results.tsv
{
  printf 'schema_version\tid\tclass\tfile\tline\tstatus\tfirst_catching_test\tequivalent\tbuild_s\ttests_s\ttests_run\twall_s\tdetail\tdescription\n'
  for i in "${SEL[@]}"; do
    ln=${R_WHERE[i]##*:}
    [[ $ln =~ ^[0-9]+$ ]] || ln=""
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$SCHEMA_VERSION" "${M_ID[i]}" "${M_CLASS[i]}" \
      "${M_FILE[i]}" "$ln" "${R_STATUS[i]}" "${R_TEST[i]}" "${M_EQUIV[i]%%:*}" "${R_BSECS[i]}" "${R_TSECS[i]}" \
      "${R_NRUN[i]}" "${R_WALL[i]}" "${R_DETAIL[i]}" "${M_DESC[i]}"
  done
} >"$tsv"
jstr() { # a JSON string
  local s=$1
  s=${s//\\/\\\\} s=${s//\"/\\\"} s=${s//$'\t'/\\t} s=${s//$'\r'/\\r} s=${s//$'\n'/\\n}
  printf '"%s"' "$s"
}
json=$WORK/results.json
{
  printf '{\n  "schema_version": %s,\n  "date": %s,\n  "commit": %s,\n  "labels": %s,\n  "jobs": %s,\n' \
    "$SCHEMA_VERSION" "$(jstr "$(date -u +%Y-%m-%dT%H:%M:%SZ)")" \
    "$(jstr "$(cd "$ROOT" && git rev-parse --short HEAD 2>/dev/null)$(cd "$ROOT" && git diff --quiet HEAD 2>/dev/null || echo +dirty)")" \
    "$(jstr "$LABELS")" "$JOBS"
  printf '  "baseline": {"build_s": %s, "tests_s": %s, "tests": [' "$T_BASE_BUILD" "$T_BASE_TESTS"
  sep=""
  for t in "${ORDER[@]}"; do printf '%s{"name": %s, "s": %s}' "$sep" "$(jstr "$t")" "${BASE_T[$t]}"; sep=", "; done
  printf ']},\n  "total_s": %s,\n' "$T_TOTAL"
  printf '  "score": {"caught": %d, "scored": %d, "percent": %s, "survived": %d, "equivalent_survived": %d, "equivalent_caught": %d, "identical": %d, "stale": %d, "build_errors": %d},\n' \
    $caught $scored "$([ $scored -gt 0 ] && echo "$score" || echo null)" $survived $eq_surv $eq_caught $ident $stale $berr
  printf '  "by_label": {'
  sep=""
  for l in ${LABELS//,/ }; do printf '%s%s: {"caught": %d, "scored": %d}' "$sep" "$(jstr "$l")" "${L_CAUGHT[$l]}" $scored; sep=", "; done
  printf '},\n  "by_label_all_tests": %s,\n' "$([ $ALL_TESTS -eq 1 ] && echo true || echo false)"
  printf '  "mutations": [\n'
  sep=""
  for i in "${SEL[@]}"; do
    ln=${R_WHERE[i]##*:}
    [[ $ln =~ ^[0-9]+$ ]] || ln=null
    printf '%s    {"id": %s, "class": %s, "file": %s, "line": %s, "status": %s, "first_catching_test": %s, "equivalent": %s, "build_s": %s, "tests_s": %s, "tests_run": %s, "wall_s": %s, "detail": %s, "description": %s}' \
      "$sep" "$(jstr "${M_ID[i]}")" "$(jstr "${M_CLASS[i]}")" "$(jstr "${M_FILE[i]}")" "$ln" "$(jstr "${R_STATUS[i]}")" \
      "$([ -n "${R_TEST[i]}" ] && jstr "${R_TEST[i]}" || echo null)" \
      "$([ "${M_EQUIV[i]}" = no ] && echo false || echo true)" "${R_BSECS[i]}" "${R_TSECS[i]}" "${R_NRUN[i]}" \
      "${R_WALL[i]}" "$(jstr "${R_DETAIL[i]}")" "$(jstr "${M_DESC[i]}")"
    sep=$',\n'
  done
  printf '\n  ]\n}\n'
} >"$json"
echo "results: $tsv, $json; logs: $LOGS"
[ $survived -eq 0 ] && [ $stale -eq 0 ] && [ $berr -eq 0 ] && exit 0
exit 1
