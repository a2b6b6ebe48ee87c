#!/usr/bin/env bash
# The device kit, part 1 (run here, on the CPU machine): builds the GPU
# binaries for sm_90 (Release, -Werror, CUDA and NCCL required) and bundles
# them with the shared libraries they need into kit/distopt-kit.tar.xz
# (kit/ is ignored by git; name it in the device tool's `carry`). The GPU
# machine has nvcc, CMake and PyTorch but no Debian -dev libraries and no
# network, so nothing is built there. Not bundled: the C library family and
# libstdc++/libgcc_s (the machine's own, newer), the driver (libcuda) and
# libnccl (found there in PyTorch's nvidia-nccl wheel by cuda/check.sh).
#   cuda/kit.sh            then, on the GPU machine: bash cuda/check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bash cmake/deps.sh
build=${BUILD:-build-kit}
arch=${CUDA_ARCH:-90}
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DDOPT_WERROR=ON -DDOPT_CUDA=ON -DDOPT_NCCL=ON \
  -DCMAKE_CUDA_ARCHITECTURES="$arch" >/dev/null
cmake --build "$build" -j"$(nproc)" --target gpu_cuda_kernels gpu_cuda_grid distopt_cli dopt_cuda_bench >/dev/null
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
k=$stage/distopt-kit
mkdir -p "$k/bin" "$k/lib"
cp "$build/tests/gpu/gpu_cuda_kernels" "$build/tests/gpu/gpu_cuda_grid" "$build/cli/distopt" \
  "$build/cuda/dopt_cuda_bench" "$k/bin/"
skip='^(linux-vdso|ld-linux|libc\.so|libm\.so|libpthread|libdl\.so|librt\.so|libstdc\+\+|libgcc_s|libcuda\.so|libnccl)'
for b in "$k"/bin/*; do
  ldd "$b" | awk '$2 == "=>" && $3 ~ /^\// {print $3}' | while read -r lib; do
    name=$(basename "$lib")
    if ! echo "$name" | grep -Eq "$skip"; then cp -L -n "$lib" "$k/lib/$name"; fi
  done
done
{
  echo "distopt kit: built $(date -u +%Y-%m-%dT%H:%MZ) from $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet 2>/dev/null || echo '+dirty'), sm_$arch"
  echo "nvcc: $(nvcc --version | tail -1)"
  echo "highest GLIBC symbol needed: $(for f in "$k"/bin/* "$k"/lib/*; do objdump -T "$f" 2>/dev/null; done | grep -o 'GLIBC_[0-9.]*' | sort -Vu | tail -1)"
  echo "libraries: $(cd "$k/lib" && ls | tr '\n' ' ')"
} >"$k/MANIFEST"
mkdir -p kit
tar -C "$stage" -cJf kit/distopt-kit.tar.xz distopt-kit
cat "$k/MANIFEST"
# what travels to the GPU machine (carry) is at most 64 MiB
size=$(stat -c %s kit/distopt-kit.tar.xz)
[ "$size" -le $((64 * 1048576)) ] || { echo "kit.sh: the kit ($size bytes) is over the 64 MiB a device run carries" >&2; exit 1; }
echo "kit/distopt-kit.tar.xz: $(du -h kit/distopt-kit.tar.xz | cut -f1) (uncompressed $(du -sh "$k" | cut -f1))"
