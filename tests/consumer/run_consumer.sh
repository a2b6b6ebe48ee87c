#!/usr/bin/env bash
# CTest consumer_install (label unit): install the build into a temporary prefix and use it as a program
# outside the project would (tests/consumer/consumer.c):
#   1. the shared library: libdistopt.so -> libdistopt.so.MAJOR (the SONAME) -> libdistopt.so.X.Y.Z, X.Y.Z
#      equal to the installed distopt.h's DOPT_VERSION_*, exporting only public dopt_* symbols;
#   2. cc consumer.c $(pkg-config --cflags --libs distopt): links the .so (DT_NEEDED) and runs;
#   3. cc consumer.c $(pkg-config --cflags --libs distopt-static): links the archive, no libdistopt DT_NEEDED;
#   4. a CMake project with find_package(distopt): distopt::distopt (shared, run through the build-tree
#      RPATH, no LD_LIBRARY_PATH) and distopt::distopt_static.
# Usage: run_consumer.sh BUILD_DIR WORK_DIR LIBDIR SOURCE_DIR CMAKE. Exit 77 (skipped) only when
# pkg-config, the C compiler or readelf/nm is missing.
set -euo pipefail
build=$1 work=$2 libdir=$3 src=$4 cmake=$5
cc=${CC:-cc}
for tool in pkg-config "$cc" readelf nm; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    echo "skipped: '$tool' not found (Debian: pkg-config gcc binutils; cmake/deps.sh)"
    exit 77
  fi
done
fail() { echo "consumer_install: FAILED: $*" >&2; exit 1; }

rm -rf "$work"
mkdir -p "$work"
prefix=$work/prefix
"$cmake" --install "$build" --prefix "$prefix" >"$work/install.log" || fail "cmake --install (see $work/install.log)"
lib=$prefix/$libdir
header=$prefix/include/distopt/distopt.h

# 1. the shared library's names, version and exported symbols
ver=$(for k in MAJOR MINOR PATCH; do sed -n "s/^#define DOPT_VERSION_$k \([0-9]*\).*/\1/p" "$header"; done | paste -sd.)
major=${ver%%.*}
[ -L "$lib/libdistopt.so" ] || fail "$lib/libdistopt.so is not a symbolic link"
[ "$(readlink "$lib/libdistopt.so")" = "libdistopt.so.$major" ] || fail "libdistopt.so -> $(readlink "$lib/libdistopt.so"), not libdistopt.so.$major"
[ "$(readlink "$lib/libdistopt.so.$major")" = "libdistopt.so.$ver" ] ||
  fail "libdistopt.so.$major -> $(readlink "$lib/libdistopt.so.$major"), not libdistopt.so.$ver (distopt.h says $ver)"
real=$lib/libdistopt.so.$ver
[ -f "$real" ] && [ ! -L "$real" ] || fail "$real is missing"
soname=$(readelf -d "$real" | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')
[ "$soname" = "libdistopt.so.$major" ] || fail "SONAME '$soname', expected libdistopt.so.$major"
syms=$(nm -D --defined-only "$real" | awk '{print $3}')
nsyms=$(printf '%s\n' "$syms" | grep -c .)
bad=$(printf '%s\n' "$syms" | grep -Ev '^dopt_[a-z0-9]' || true)
internal=$(printf '%s\n' "$syms" | grep -E '^dopt__' || true)
[ "$nsyms" -gt 50 ] || fail "only $nsyms exported symbols"
[ -z "$bad$internal" ] || fail "exported symbols outside the public API: $(echo $bad $internal | head -c 300)"
for f in dopt_optim_create dopt_optim_step dopt_last_error dopt_st_load; do
  printf '%s\n' "$syms" | grep -qx "$f" || fail "$f is not exported"
done
echo "shared library: $(basename "$real"), SONAME $soname, $nsyms exported symbols, all public dopt_*"

needed() { readelf -d "$1" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p'; }

# 2. pkg-config, shared
export PKG_CONFIG_PATH=$lib/pkgconfig
flags=$(pkg-config --cflags --libs distopt) || fail "pkg-config --cflags --libs distopt"
echo "cc consumer.c $flags"
# shellcheck disable=SC2086
"$cc" -std=c11 -Wall -Wextra -Werror "$src/tests/consumer/consumer.c" $flags -o "$work/consumer_pc" ||
  fail "cc with pkg-config distopt"
needed "$work/consumer_pc" | grep -qx "libdistopt.so.$major" || fail "consumer_pc does not load libdistopt.so.$major"
LD_LIBRARY_PATH=$lib "$work/consumer_pc" || fail "consumer_pc"
[ "$(LD_LIBRARY_PATH=$lib ldd "$work/consumer_pc" | sed -n 's/.*libdistopt.so[^ ]* => \([^ ]*\).*/\1/p')" = "$lib/libdistopt.so.$major" ] ||
  fail "consumer_pc did not load the installed library"

# 3. pkg-config, static
flags=$(pkg-config --cflags --libs distopt-static) || fail "pkg-config --cflags --libs distopt-static"
echo "cc consumer.c $flags"
# shellcheck disable=SC2086
"$cc" -std=c11 -Wall -Wextra -Werror "$src/tests/consumer/consumer.c" $flags -o "$work/consumer_pc_static" ||
  fail "cc with pkg-config distopt-static"
! needed "$work/consumer_pc_static" | grep -q libdistopt || fail "consumer_pc_static depends on libdistopt.so"
"$work/consumer_pc_static" || fail "consumer_pc_static"

# 4. CMake, find_package(distopt)
"$cmake" -S "$src/tests/consumer/project" -B "$work/cmake" -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_C_COMPILER="$cc" \
  -DCMAKE_BUILD_TYPE=Release >"$work/cmake.log" 2>&1 || { cat "$work/cmake.log"; fail "configuring the find_package project"; }
"$cmake" --build "$work/cmake" >>"$work/cmake.log" 2>&1 || { cat "$work/cmake.log"; fail "building the find_package project"; }
needed "$work/cmake/consumer" | grep -qx "libdistopt.so.$major" || fail "cmake consumer does not load libdistopt.so.$major"
! needed "$work/cmake/consumer_static" | grep -q libdistopt || fail "cmake consumer_static depends on libdistopt.so"
env -u LD_LIBRARY_PATH "$work/cmake/consumer" || fail "cmake consumer (distopt::distopt)"
"$work/cmake/consumer_static" || fail "cmake consumer_static (distopt::distopt_static)"
echo "consumer_install: all passed"
