#!/usr/bin/env bash
# The GPU checks of docs/gpu.md, on a machine with one NVIDIA GPU and jax with CUDA, in parts that
# each end within 9 minutes (docs/gpu.md, "Running them"):
#
#   bash tools/gpu_checks.sh OUTDIR [h100|h200] PART
#
# PART        limit  what it runs                                                   writes under OUTDIR
# calibrate   480 s  tools/gpu_calibrate.py at 70B and 8B MLP shapes: split        P_calibrate_{70b,8b}.json,
#                    efficiency, loop trips, the rings, element types' rates        gpu_checks_calibrate.log
# topology    525 s  tools/gpu_topology.py: a tiny model (is the mocked topology    P_topology_{tiny,8b,70b}.json,
#                    working?), then the 8B and 70B training steps compiled for 8   hlo/8b_{original,uni}.hlo.txt,
#                    GPUs: the original and every variant (uni, unroll2, full,      gpu_checks_topology.log
#                    bidi, bidi-unroll2, bidi-full, auto, streams, no-share,
#                    uni-dsf): async and overlapped permutes, loop and slice copies
# extras      485 s  calibrate at 3B shapes, at 70B with XLA's dynamic slice        P_calibrate_3b.json,
#                    fusion, and the 8B step compiled with no XLA flags             P_calibrate_70b_dsf.json,
#                                                                                   P_topology_8b_no_flags.json,
#                                                                                   gpu_checks_extras.log
# passcost    395 s  tools/bench.py --only-pass-cost compiled for 8 GPUs: the       P_pass_cost.json,
#                    pass's share of lower + compile at each of make bench's        gpu_checks_passcost.log
#                    layer counts, both models (not in the profile)
# profile     120 s  on any machine, no GPU: tools/gpu_profile.py over the JSONs    P_profile.txt
#                    above in OUTDIR: the cost.PROFILES fields and --hardware
#                    override they imply, and what moved against the profile
# all                calibrate, topology, extras and profile (over 25 minutes: a machine of your own)
#
# (P: the profile's name.)  "limit" is the sum of the part's steps' time limits (each step's
# `timeout`, plus 5 s for a kill): a step that hangs is stopped, the others still run and keep
# their results, and the part ends well inside a 600 s call.  calibrate and topology are what
# the profile needs (at most 1005 s together; about 3 and 5 minutes when last estimated);
# extras is for when there is time left.  GPU_CHECKS_DRY_RUN=1 prints each step
# ("step", its limit, the command) instead of running it (tests/test_gpu_checks.py reads it).
# Exit status: the number of steps that failed or ran out of time.
set -uo pipefail
out=${1:?usage: gpu_checks.sh OUTDIR [h100|h200] calibrate|topology|extras|passcost|profile|all}
profile=${2:-h100}
part=${3:-all}
py=${PYTHON:-python3}
# the profile part runs on the development machine, whose python3 may lack jax: the repo's .venv
# (make test's) when there is one
if [ "$part" = profile ] && [ -z "${PYTHON:-}" ] && [ -x "$(dirname "$0")/../.venv/bin/python" ]; then
  py=$(cd "$(dirname "$0")/.." && pwd -P)/.venv/bin/python
fi
case "$part" in calibrate|topology|extras|passcost|profile|all) ;; *) echo "unknown part $part" >&2; exit 2;; esac
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
failed=0

step() {  # step SECONDS COMMAND...: COMMAND under a time limit (dry run: print it, shell-quoted)
  local limit=$1; shift
  if [ -n "${GPU_CHECKS_DRY_RUN:-}" ]; then
    printf 'step\t%s\t' "$limit"; printf '%q ' "$@"; printf '\n'
    return 0
  fi
  echo "== $(date +%T) [limit ${limit} s] $*"
  timeout --kill-after=5 "$limit" "$@"
  local rc=$?
  if [ $rc != 0 ]; then
    echo "== FAILED (exit $rc$([ $rc = 124 ] || [ $rc = 137 ] && echo ": out of time")): $*"
    failed=$((failed + 1))
  fi
}

setup() {  # what runs here: the GPU, its clocks, jax and its devices
  step 10 nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.used --format=csv
  step 30 "$py" -c 'import jax; print("jax", jax.__version__, jax.devices())'
}

calibrate() {
  setup
  step 240 "$py" tools/gpu_calibrate.py --model 70b --profile "$profile" --out "$out/${profile}_calibrate_70b.json"
  step 180 "$py" tools/gpu_calibrate.py --model 8b --profile "$profile" --out "$out/${profile}_calibrate_8b.json"
}

topology() {
  setup
  # a tiny model first (is the mocked topology working?), at 4 layers: each step's three identical
  # regions become calls of one rewritten layer (replay/)
  step 60 "$py" tools/gpu_topology.py --model tiny --layers 4 --repeats 1 --profile "$profile" --programs uni auto \
    --out "$out/${profile}_topology_tiny.json"
  # every variant of cost.VARIANTS, auto's picks for the profile, and the A/B programs; two
  # compiles each (the first autotunes new GEMM shapes; the second is the warm compile time)
  local model dump
  for model in 8b 70b; do
    dump=()
    [ "$model" = 8b ] && dump=(--dump-hlo "$out/hlo" --dump original uni)
    step 200 "$py" tools/gpu_topology.py --model "$model" --repeats 2 --profile "$profile" \
      --programs uni unroll2 full bidi bidi-unroll2 bidi-full auto uni-no-share uni-streams bidi-streams uni-dsf \
      "${dump[@]}" --out "$out/${profile}_topology_${model}.json"
  done
}

extras() {
  setup
  # below the profiles' smallest measured step (6.4 GFLOP a step)
  step 130 "$py" tools/gpu_calibrate.py --model 3b --profile "$profile" --out "$out/${profile}_calibrate_3b.json"
  # the 70B sites with XLA's dynamic slice fusion (GEMMs reading the rounds' blocks in place):
  # compare the scatter's, contracting and batch roles' straight-line splits (never merged)
  step 180 env XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_dynamic_slice_fusion=true" "$py" tools/gpu_calibrate.py \
    --model 70b --profile "$profile" --out "$out/${profile}_calibrate_70b_dsf.json"
  # what XLA does by default, and what cmatmul_pass.jit's own compiler options add
  step 110 "$py" tools/gpu_topology.py --model 8b --no-flags --repeats 1 --profile "$profile" \
    --programs uni uni-no-gpu-options bidi bidi-no-gpu-options uni-streams --out "$out/${profile}_topology_8b_no_flags.json"
}

passcost() {
  setup
  # what the pass costs beside what a GPU user's jax.jit spends before the first call (lower and a
  # compile for 8 GPUs), at make bench's layer counts (its table's CPU figures: docs/performance.md)
  step 340 "$py" tools/bench.py --only-pass-cost --platform gpu --repeats 3 --out "$out/${profile}_pass_cost.json"
}

profile_part() {  # the profile the runs in $out imply; a 3B run where extras wrote one
  local runs=("$out/${profile}_calibrate_70b.json" "$out/${profile}_calibrate_8b.json")
  [ -e "$out/${profile}_calibrate_3b.json" ] && runs+=("$out/${profile}_calibrate_3b.json")
  runs+=("$out/${profile}_topology_8b.json" "$out/${profile}_topology_70b.json")
  step 120 "$py" tools/gpu_profile.py --profile "$profile" --out "$out/${profile}_profile.txt" "${runs[@]}"
}

run_part() {
  case "$1" in
    calibrate) calibrate ;;
    topology) topology ;;
    extras) extras ;;
    passcost) passcost ;;
    profile) profile_part ;;
    all) calibrate; topology; extras; profile_part ;;
  esac
  [ -n "${GPU_CHECKS_DRY_RUN:-}" ] || echo "== $(date +%T) part $1: $failed step(s) failed"
  return $((failed > 125 ? 125 : failed))
}

mkdir -p "$out"
if [ -n "${GPU_CHECKS_DRY_RUN:-}" ] || [ "$part" = profile ]; then
  run_part "$part"
else  # the whole output, also in OUTDIR (it comes back with the results)
  run_part "$part" 2>&1 | tee "$out/gpu_checks_$part.log"
fi
