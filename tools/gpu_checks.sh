#!/usr/bin/env bash
# The GPU checks of docs/gpu.md, on a machine with one NVIDIA GPU and jax with CUDA:
#   bash tools/gpu_checks.sh OUTDIR [h100|h200] [all|calibrate|topology]
# calibrate: split efficiency and loop-trip cost at 70B, 8B and 3B MLP shapes, the gather's also with
#            gate and up merged into one dot as the pass runs it (tools/gpu_calibrate.py;
#            each prints the profile's split points with its own added; then --merge prints all
#            three runs' points together, for cost.PROFILES; then 70B again with XLA's dynamic
#            slice fusion);
# topology:  the training step compiled for a mocked 8-GPU topology, original and every variant,
#            read for overlap, async streams and compile time (tools/gpu_topology.py): a tiny
#            model first (a quick check that the mocked topology works), then 8B and 70B
#            shapes, bidi-full, --variant auto and uni-dsf at 8B, then 8B with no XLA flags at all; each run prints the
#            cost model's --hardware override for the share of permutes each variant hides.
# Each step has its own time limit, so one that hangs leaves the others' results. On an H100,
# calibrate took about 1 minute (9 compiles per model; it now makes 21, with the contracting and
# batch roles, the merged gather and the scatter rings) and topology about 8; "all" can exceed a 10-minute call limit.
set -uo pipefail
out=${1:?usage: gpu_checks.sh OUTDIR [profile] [all|calibrate|topology]}
profile=${2:-h100}
part=${3:-all}
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.used --format=csv
$py -c 'import jax; print("jax", jax.__version__, jax.devices())'
if [ "$part" = all ] || [ "$part" = calibrate ]; then
  for model in 70b 8b 3b; do
    timeout 190 $py tools/gpu_calibrate.py --model "$model" --profile "$profile" --out "$out/calibrate_$model.json"
  done
  # all three runs' points in one override, and as cost.PROFILES fields
  $py tools/gpu_calibrate.py --merge "$out"/calibrate_*.json --profile "$profile" | tee "$out/calibrate_merged.txt"
  # the 70B sites again with XLA's dynamic slice fusion (GEMMs reading the rounds' blocks in
  # place): compare the scatter's, contracting and batch roles' straight-line splits (not merged)
  XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_dynamic_slice_fusion=true" timeout 190 $py tools/gpu_calibrate.py \
    --model 70b --profile "$profile" --out "$out/dsf_calibrate_70b.json"
fi
if [ "$part" = all ] || [ "$part" = topology ]; then
  timeout 90 $py tools/gpu_topology.py --model tiny --out /tmp/topology_tiny.json
  timeout 200 $py tools/gpu_topology.py --model 8b --out "$out/topology_8b.json" --dump-hlo "$out/hlo" \
    --dump original uni unroll2 bidi bidi-unroll2 --profile "$profile"
  timeout 200 $py tools/gpu_topology.py --model 70b --out "$out/topology_70b.json" --profile "$profile"
  # the one variant whose overlap the cost model has not measured yet (the profile assumes
  # bidi-unroll2's), --variant auto's per-site picks for the profile, and uni with XLA's dynamic
  # slice fusion (do the GEMMs read the rounds' blocks in place? slice_copies)
  timeout 240 $py tools/gpu_topology.py --model 8b --programs bidi-full auto uni-dsf --repeats 1 \
    --out "$out/topology_8b_bidi_full.json" --profile "$profile"
  # what XLA does by default, and what cmatmul_pass.jit's own compiler options add
  timeout 120 $py tools/gpu_topology.py --model 8b --no-flags --repeats 1 \
    --programs uni uni-no-gpu-options bidi bidi-no-gpu-options uni-streams --out "$out/topology_8b_no_flags.json"
fi
