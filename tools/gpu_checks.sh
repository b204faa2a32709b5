#!/usr/bin/env bash
# The GPU checks of docs/gpu.md in one go, on a machine with one NVIDIA GPU and jax with CUDA:
#   bash tools/gpu_checks.sh OUTDIR [h100|h200]
# 1. split efficiency and loop-trip cost at 70B and 8B MLP shapes (tools/gpu_calibrate.py);
# 2. the training step compiled for a mocked 8-GPU topology, original and every variant, read
#    for overlap, async streams and compile time (tools/gpu_topology.py; a tiny model first, as
#    a quick check that the mocked topology works, then 8B shapes).
# Each step has its own time limit, so one that hangs leaves the others' results.
set -uo pipefail
out=${1:?usage: gpu_checks.sh OUTDIR [profile]}
profile=${2:-h100}
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.used --format=csv
$py -c 'import jax; print("jax", jax.__version__, jax.devices())'
for model in 70b 8b; do
  timeout 150 $py tools/gpu_calibrate.py --model "$model" --profile "$profile" --out "$out/calibrate_$model.json"
done
timeout 90 $py tools/gpu_topology.py --model tiny --out /tmp/topology_tiny.json
timeout 330 $py tools/gpu_topology.py --model 8b --out "$out/topology_8b.json" --dump-hlo "$out/hlo"
