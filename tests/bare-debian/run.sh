#!/usr/bin/env bash
# Proves the README's two commands on a bare Debian: a `debootstrap
# --variant=minbase bookworm` root (no compiler, no libc6-dev, nothing but the
# essential packages and apt), a clean copy of the repository's committed HEAD
# placed in it, then, chrooted, as root, from the repository directory:
# `./run.sh` and `./test.sh`. Each command is timed and logged outside the root;
# a table (command, exit, seconds) ends the run; the exit is non-zero when
# either command fails. Run on demand, as root, on a Debian host (not part of
# CI's default path). docs/bare-debian.md.
#
#   tests/bare-debian/run.sh [options] [-- ARGS for ./test.sh, e.g. --quick]
#     --cache DIR      where the pristine minbase root is kept between runs
#                      (default /var/tmp/distopt-bare-debian)
#     --fresh          debootstrap again even when a cached root exists
#     --repo DIR       repository to copy (default: the one holding this script)
#     --rev REV        revision to copy (default HEAD; `git archive`, so only
#                      committed files travel)
#     --mirror URL     Debian mirror (default: the host's own apt source for
#                      bookworm, else http://deb.debian.org/debian)
#     --logs DIR       where logs and the table go (default CACHE/logs/DATE)
#     --run-timeout S  limit for ./run.sh  (default 3600)
#     --test-timeout S limit for ./test.sh (default 10800)
#
# The cached root is never used directly: each run works on a fresh copy of it
# (CACHE/work), so every run starts with nothing installed and nothing built.
set -euo pipefail
{ # (the whole script is read before it runs: editing it meanwhile cannot break a run)

here=$(cd "$(dirname "$0")" && pwd)
cache=/var/tmp/distopt-bare-debian
fresh=0
repo=$(git -C "$here" rev-parse --show-toplevel 2>/dev/null || (cd "$here/../.." && pwd))
rev=HEAD
mirror=
logs=
run_timeout=3600
test_timeout=10800
suite=bookworm
test_args=()

usage() { sed -n '2,25s/^# \{0,1\}//p' "$0"; }
while [ $# -gt 0 ]; do
  case "$1" in
    --cache) cache=$2; shift 2 ;;
    --fresh) fresh=1; shift ;;
    --repo) repo=$2; shift 2 ;;
    --rev) rev=$2; shift 2 ;;
    --mirror) mirror=$2; shift 2 ;;
    --logs) logs=$2; shift 2 ;;
    --run-timeout) run_timeout=$2; shift 2 ;;
    --test-timeout) test_timeout=$2; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    --) shift; test_args=("$@"); break ;;
    *) echo "bare-debian: unknown option $1" >&2; usage >&2; exit 2 ;;
  esac
done

[ "$(id -u)" -eq 0 ] || { echo "bare-debian: must run as root (debootstrap, mount, chroot)" >&2; exit 2; }
command -v git >/dev/null || { echo "bare-debian: git is needed on the host" >&2; exit 2; }
commit=$(git -C "$repo" rev-parse --verify "$rev^{commit}")

# The host's mirror for $suite: deb822 .sources first, then one-line .list files.
host_mirror() {
  local f
  for f in /etc/apt/sources.list.d/*.sources; do
    [ -f "$f" ] || continue
    awk -v s="$suite" '
      /^[[:space:]]*$/ { if (u != "" && ok && deb) { print u; exit } u = ""; ok = 0; deb = 0; next }
      /^URIs:/ { u = $2 }
      /^Types:/ { for (i = 2; i <= NF; i++) if ($i == "deb") deb = 1 }
      /^Suites:/ { for (i = 2; i <= NF; i++) if ($i == s) ok = 1 }
      END { if (u != "" && ok && deb) print u }' "$f"
  done
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
    [ -f "$f" ] || continue
    awk -v s="$suite" '$1 == "deb" { i = 2; if ($2 ~ /^\[/) while ($i !~ /\]$/) i++; if ($2 ~ /^\[/) i++;
      if ($(i + 1) == s) print $i }' "$f"
  done
}
[ -n "$mirror" ] || mirror=$(host_mirror | head -1)
[ -n "$mirror" ] || mirror=http://deb.debian.org/debian

stamp=$(date -u +%Y%m%dT%H%M%SZ)
[ -n "$logs" ] || logs=$cache/logs/$stamp
mkdir -p "$cache" "$logs"
logs=$(cd "$logs" && pwd)
base=$cache/base   # the pristine debootstrapped root (cached)
root=$cache/work   # this run's copy
summary=$logs/summary.txt
rows=()
row() { rows+=("$(printf '%-18s %6s %9s' "$1" "$2" "$3")"); }
now() { date +%s.%N; }
secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'; }

print_table() {
  {
    echo "commit $commit ($rev) from $repo"
    echo "host   $(. /etc/os-release && echo "$PRETTY_NAME"), $(nproc) CPUs, mirror $mirror"
    echo "date   $stamp"
    printf '%-18s %6s %9s\n' command exit seconds
    printf '%s\n' "${rows[@]}"
    echo "logs   $logs"
  } | tee "$summary"
}

# --- mounts: undone on any exit --------------------------------------------
mounted=()
cleanup() {
  local m i
  for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do
    m=${mounted[i]}
    umount -R "$m" 2>/dev/null || umount -R -l "$m" 2>/dev/null || echo "bare-debian: could not unmount $m" >&2
  done
  mounted=()
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# --- 1. the minbase root (cached) --------------------------------------------
if ! command -v debootstrap >/dev/null; then
  echo "bare-debian: installing debootstrap on the host" >&2
  DEBIAN_FRONTEND=noninteractive apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap >/dev/null
fi
if [ $fresh -eq 1 ] || [ ! -f "$base/.distopt-bootstrap-done" ]; then
  rm -rf "$base"
  echo "bare-debian: debootstrap --variant=minbase $suite $base $mirror" >&2
  t0=$(now)
  set +e
  debootstrap --variant=minbase "$suite" "$base" "$mirror" >"$logs/debootstrap.log" 2>&1
  rc=$?
  set -e
  row debootstrap "$rc" "$(secs "$t0" "$(now)")"
  if [ $rc -ne 0 ]; then
    tail -20 "$logs/debootstrap.log" >&2
    print_table
    exit 1
  fi
  date -u +%Y-%m-%dT%H:%M:%SZ >"$base/.distopt-bootstrap-done"
else
  row debootstrap cached "-"
  echo "bare-debian: using the cached root $base (from $(cat "$base/.distopt-bootstrap-done"); --fresh to redo)" >&2
fi

# --- this run's copy of the root, with the host's apt configuration ----------
t0=$(now)
rm -rf "$root"
cp -a "$base" "$root"
rm -f "$root/.distopt-bootstrap-done"
# Sources: the host's own (its mirror is the one this machine reaches); hooks
# that call host tools (Post-Invoke and the like) stay behind.
cp /etc/resolv.conf "$root/etc/resolv.conf" 2>/dev/null || true
# (debootstrap's own sources.list goes: the host's, where it has one, replaces it)
rm -f "$root/etc/apt/sources.list"
[ -f /etc/apt/sources.list ] && cp /etc/apt/sources.list "$root/etc/apt/sources.list"
for f in /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
  [ -f "$f" ] || continue
  cp "$f" "$root/etc/apt/sources.list.d/"
  # a keyring the root does not have (Signed-By) comes from the host
  for k in $(awk '/^Signed-By:/ { print $2 } { for (i = 1; i <= NF; i++) if ($i ~ /^signed-by=/) { sub(/^signed-by=/, "", $i); sub(/\]$/, "", $i); print $i } }' "$f"); do
    [ -f "$k" ] && [ ! -f "$root$k" ] && mkdir -p "$root$(dirname "$k")" && cp "$k" "$root$k"
  done
done
for f in /etc/apt/apt.conf.d/*; do
  [ -f "$f" ] || continue
  grep -q 'Invoke' "$f" && continue
  cp "$f" "$root/etc/apt/apt.conf.d/"
done

# --- 2. a clean copy of the committed tree -----------------------------------
src=/root/distopt
mkdir -p "$root$src"
git -C "$repo" archive "$commit" | tar -x -C "$root$src"
echo "$commit" >"$logs/commit"
row "copy root+src" 0 "$(secs "$t0" "$(now)")"
echo "bare-debian: $commit copied to $root$src" >&2

# the root is bare: no compiler, no C library headers, no build tools
for p in gcc libc6-dev cmake make; do
  if chroot "$root" dpkg -s "$p" >/dev/null 2>&1; then
    echo "bare-debian: $p is installed in $base: not a bare root (--fresh)" >&2
    exit 1
  fi
done

# --- 3. mounts, chroot, the two commands -------------------------------------
mnt() { # TARGET MOUNT-ARGS...
  local target=$1
  shift
  mount "$@" "$target" || { echo "bare-debian: mount $* $target failed (not permitted here?)" >&2; exit 1; }
  mounted+=("$target")
}
mnt "$root/proc" -t proc proc
mnt "$root/sys" -t sysfs sysfs
mnt "$root/dev" --rbind /dev
mount --make-rslave "$root/dev"

in_root() { # LIMIT LOG COMMAND...
  local limit=$1 log=$2
  shift 2
  timeout --kill-after=60 "$limit" chroot "$root" /usr/bin/env -i HOME=/root LANG=C.UTF-8 TERM=dumb \
    PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    /bin/bash -c 'cd "$0" && exec "$@"' "$src" "$@" 2>&1 | tee "$log"
  return "${PIPESTATUS[0]}"
}

fail=0
for cmd in run test; do
  if [ $cmd = run ]; then limit=$run_timeout; args=(./run.sh); else limit=$test_timeout; args=(./test.sh "${test_args[@]}"); fi
  echo "bare-debian: === ${args[*]} (limit ${limit}s)" >&2
  t0=$(now)
  set +e
  in_root "$limit" "$logs/$cmd.log" "${args[@]}"
  rc=$?
  set -e
  row "${args[*]}" "$rc" "$(secs "$t0" "$(now)")"
  [ $rc -eq 0 ] || fail=1
done

cleanup
# what the root had to install, for the record
chroot "$root" dpkg-query -W -f '${Package} ${Version}\n' >"$logs/packages-after.txt" 2>/dev/null || true
chroot "$base" dpkg-query -W -f '${Package} ${Version}\n' >"$logs/packages-before.txt" 2>/dev/null || true
echo
print_table
exit $fail
}
