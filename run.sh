#!/usr/bin/env bash
# The main job: build distopt (installing Debian dependencies when root) and
# run the reference Adafactor for 20 steps on the bundled gradient trace.
set -euo pipefail
cd "$(dirname "$0")"
bash cmake/deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$(nproc)" --target distopt_cli >/dev/null
./build/compare/distopt run --params datasets/golden/inputs.safetensors \
  --optimizer adafactor --hparams beta1=0.9,weight_decay=0.01 --group 'vec:weight_decay=0' \
  --steps 20 --out build/example-out.safetensors "$@"
