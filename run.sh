#!/usr/bin/env bash
# The main job: build distopt (installing Debian dependencies when root) and
# check that the distributed Adafactor — hybrid tensor-parallel 2 × data-parallel
# 2 × ZeRO-2 on 4 simulated ranks — equals the single-device reference bit for
# bit, step by step, on the bundled gradient trace (an MLP trained on
# scikit-learn's digits). Prints the per-tensor table and the verdict, writes
# build/compare.json and build/compare.svg. Extra arguments go to
# `distopt compare` (e.g. --optimizer came --hparams lr=2e-4, --zero 3).
set -euo pipefail
cd "$(dirname "$0")"
bash cmake/deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$(nproc)" --target distopt_cli >/dev/null
exec ./build/cli/distopt compare --trace datasets/trace/digits_mlp.safetensors \
  --json build/compare.json --plot build/compare.svg "$@"
