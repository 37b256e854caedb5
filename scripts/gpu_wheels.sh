#!/usr/bin/env bash
# bash scripts/gpu_wheels.sh      (on a machine with a package index; fills .wheels/, git-ignored)
# The GPU machine has torch, lightning, torchmetrics, tensorboard, matplotlib and pytest but no package index:
# scripts/gpu_check.sh installs the rest from these pure-Python wheels, offline. Each is fetched with --no-deps,
# so the list names every package that the project needs beyond those.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=(
  hydra-core==1.3.2 omegaconf==2.3.0 antlr4-python3-runtime==4.9.3
  hydra-joblib-launcher==1.2.0 joblib
  hydra-submitit-launcher==1.2.0 submitit cloudpickle typing_extensions
)
mkdir -p .wheels
for wheel in "${WHEELS[@]}"; do
  python3 -m pip download --quiet --no-deps --dest .wheels "$wheel"
done
# antlr4-python3-runtime 4.9.3 is published as a source archive only: build its wheel here, where pip can.
for sdist in .wheels/*.tar.gz; do
  [ -e "$sdist" ] || continue
  python3 -m pip wheel --quiet --no-deps --wheel-dir .wheels "$sdist" && rm "$sdist"
done
ls .wheels
