#!/usr/bin/env python
"""Benchmarks (``make bench``): the pass's own cost and the rewritten programs' CPU run time.

Everything is measured in one process and reported as ratios (results in bench/results.json, the
one file bench/ holds; partial runs and the profile go to build/bench/ unless ``--out`` says):

1. **Pass cost.**  Tensor-parallel transformer training steps (per layer: q/k/v projections from
   one gathered input, an output projection, a SwiGLU MLP, sequence parallel, forward and
   backward: 8 sites per layer) with L = 1, 4, 16, 32 layers.  For each (the median of
   ``--repeats`` cold starts): ``jax.jit`` lower and compile time, ``cmatmul_pass.rewrite`` time
   on the lowered text (parse, rewrite, verify, print; and how much of it parsing and printing
   alone take), their ratio and the scaling time(32)/time(8).
   **Compile time** (``--compile-layers``, 4 and 32): XLA's CPU compile of the sequence-parallel
   and Megatron steps at a 7B-class shape, the pass's output over the original's: with the
   default options (policy auto on the H100 profile), every site rewritten, each variant and the
   rings written by hand (median of 3 interleaved rounds).
2. **CPU run time.**  Every positive sample under every variant: rewritten / original wall time
   (median of ``--runs`` runs after a warm-up, on the 8 CPU devices).  And one larger
   column-parallel layer (median of ``--layer-runs``: a run takes milliseconds, and with 7 runs
   its ratios moved by ±10 % between runs of the benchmark, with 51 by at most 6 %) three
   ways: the plain all_gather + dot, the pass's output per variant,
   and a ring hand-written with ``ppermute`` in the style of the JAX shard_map docs'
   collective-matmul section.  CPU permutes are synchronous: this measures overheads, not overlap.
3. **Targets.**  Each target (``TARGETS``) against this run: met or not, and the variants above
   it (``results["targets"]``).

4. **psum after a matmul (Megatron without sequence parallelism).**  The pass cost on a Megatron
   training step (pre-norm attention projections and a SwiGLU MLP per layer, each ending in a
   psum) at the same L, and two Megatron MLP blocks' CPU run time over the original: "split" per
   variant, "chunk" with 2, 4, 8 chunks, and cmatmul_pass.jit's own module ("default";
   ``results["megatron"]``; ``--only-megatron`` runs just this part into
   build/bench/results_megatron.json).

    python tools/bench.py [--layers 1 4 16 32] [--compile-layers 4 32] [--runs 7] [--layer-runs 51] [--quick] [--only-megatron]
    python tools/bench.py --only-pass-cost [--layers 1 4 8 16 32] [--repeats 5]   # 1. alone, both models
    python tools/bench.py --only-pass-cost --platform gpu   # the same compiled for 8 GPUs (a lent GPU)
    python tools/bench.py --only-warm [--layers 1 4 8 16 32]   # the pass warm, where its fixed cost goes
    python tools/bench.py --only-compile [--compile-layers 4 32]   # XLA's compile times alone

The programs and the options they are rewritten under are in tools/bench_models.py, the
measurements in tools/bench_measure.py; this module has the targets, the command line and the record.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# first: it sets XLA's CPU device count and the pass's policy before jax and the pass load
from tools.bench_models import (  # noqa: E402
    MODELS, ROOT, SCRATCH, VARIANTS, hand_written_ring, hand_written_scatter, transformer_step,
)
from tools.bench_measure import (  # noqa: E402
    RING_SHAPES, WARM_PHASES, _verdict, compile_time, dispatch_runtime, layer_runtime, megatron_runtime, pass_cost,
    profile_pass, ring_runtime, samples_runtime, warm_pass_cost,
)

import jax  # noqa: E402

#: what other modules and the tests take from here (the models and measurements re-exported)
__all__ = ["MODELS", "RING_SHAPES", "ROOT", "TARGETS", "VARIANTS", "WARM_PHASES", "_verdict", "build_parser",
           "dispatch_runtime", "hand_written_ring", "hand_written_scatter", "main", "ring_runtime", "targets",
           "transformer_step", "warm_pass_cost", "write_results"]


# ---------------------------------------------------------------------------- 3. the targets
#: (name, limit) of each target; each is met when its value(s) are at most the limit
TARGETS = (
    ("pass time / (lower + compile) at L = 32", 0.05),
    ("pass time(32) / time(8)", 4.4),
    # XLA's CPU compile of the rewritten step over the original's (tools/bench_measure.compile_time)
    ("compile time, the default / original, each model at every L measured", 1.5),
    ("compile time, rewritten / original, every variant at every L measured", 2.0),
    ("layer run time / the plain program's, every variant", 1.0),
    ("layer run time / the hand-written ring's, every variant", 1.0),
    # the tighter limit, on the text (parse, rewrite, verify, print) and as cmatmul_pass.jit runs it
    ("pass time on the text / (lower + compile) at L = 32", 0.03),
    ("pass time as cmatmul_pass.jit runs it / (lower + compile) at L = 32", 0.03),
    # per shape, the low end of the 95 % interval of the default's per-round ratio: at most 1.0
    # where the default is not measurably slower than the hand-written ring (level or faster)
    ("the default's run time / the hand-written ring's, every shape (its interval's low end)", 1.0),
)


def targets(results: dict) -> list[dict]:
    """The targets against this run: per target its limit, the measured value or, per
    variant, values, whether every value is within the limit (None: not measured in this run,
    e.g. without L = 32), and the variants above it."""
    cost_ = results.get("pass_cost", {})
    at_32 = [r["pass_over_lower_compile"] for r in cost_.get("per_layers", []) if r["layers"] == 32]
    jit_at_32 = [r.get("jit_pass_over_lower_compile") for r in cost_.get("per_layers", []) if r["layers"] == 32]
    layer = results.get("layer", {}).get("variants", {})
    by_layers = results.get("compile", {}).get("by_layers", {})
    parallel = [row["sequence_parallel"]["ratios"] for row in by_layers.values()]
    values: list[float | dict | None] = [
        at_32[0] if at_32 else None,
        cost_.get("scaling_32_over_8"),
        {f"{model} L={layers}": row[model]["ratios"]["default"] for layers, row in by_layers.items() for model in row}
        or None,
        # each variant's worst L
        {name: max(ratios[name] for ratios in parallel) for name in VARIANTS} if parallel else None,
        {name: v["over_plain"] for name, v in layer.items()} or None,
        {name: v["over_hand_written"] for name, v in layer.items()} or None,
        at_32[0] if at_32 else None,
        jit_at_32[0] if jit_at_32 else None,
        {_shape_name(row): row["default_interval"][0] for row in results.get("rings", [])} or None,
    ]
    out = []
    for (name, limit), value in zip(TARGETS, values):
        above = [k for k, v in value.items() if v > limit] if isinstance(value, dict) else []
        met = None if value is None else (not above if isinstance(value, dict) else value <= limit)
        out.append({"target": name, "limit": limit, "value": value, "met": met, "above": above})
    return out


def _shape_name(row: dict) -> str:
    return f"{row['kind']} {'x'.join(map(str, row['shape']))}"


def print_targets(rows: list[dict]) -> None:
    for row in rows:
        value = row["value"]
        if value is None:
            shown = "not measured in this run"
        elif isinstance(value, dict):
            best = min(value, key=value.get)
            shown = (f"above it: {', '.join(f'{k} {value[k]:.2f}' for k in row['above'])}; " if row["above"] else "")
            shown += f"best {best} {value[best]:.2f}"
        else:
            shown = f"{value:.4g}"
        verdict = {True: "met", False: "NOT MET", None: "-"}[row["met"]]
        print(f"  {verdict:<7} {row['target']} <= {row['limit']:g}: {shown}", flush=True)


#: how close to the fastest variant's median a variant counts as level with it
NEAR = 0.05


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    parser.add_argument("--compile-layers", type=int, nargs="+", default=[4, 32],
                        help="the L (one or more) at which to compare XLA's compile times (0: skip)")
    parser.add_argument("--runs", type=int, default=7, help="timed runs per sample and variant")
    parser.add_argument("--layer-runs", type=int, default=51, help="timed runs per program on the layer")
    parser.add_argument("--repeats", type=int, default=5, help="cold starts per L for the pass-cost medians")
    parser.add_argument("--quick", action="store_true", help="L = 1, 4 only and 5 runs (a smoke test)")
    parser.add_argument("--samples", nargs="*", help="only these samples (default: every positive one)")
    parser.add_argument("--layer", type=int, nargs=3, default=[1024, 512, 1024], metavar=("ROWS", "HIDDEN", "OUT"))
    parser.add_argument("--megatron", type=int, nargs=3, default=[1024, 512, 1024], metavar=("ROWS", "HIDDEN", "FFN"),
                        help="the Megatron blocks' shape for the psum-after-matmul run times")
    parser.add_argument("--only-megatron", action="store_true",
                        help="only the psum-after-matmul measurements (pass cost, beside the sequence-parallel "
                             "model's, and run time; default out: build/bench/results_megatron.json)")
    parser.add_argument("--ring-runs", type=int, default=101,
                        help="timed runs per program for the layers against a hand-written ring (0: skip them)")
    parser.add_argument("--only-rings", action="store_true",
                        help="only the layers against a hand-written ring (default out: build/bench/results_rings.json)")
    parser.add_argument("--only-profile", action="store_true",
                        help="only the pass's profile at the largest --layers (build/bench/profile_*.txt)")
    parser.add_argument("--only-pass-cost", action="store_true",
                        help="only the pass's cost over lower + compile, on both models (sequence parallel and "
                             "Megatron) at each --layers, --repeats cold starts each, both paths (default out: "
                             "build/bench/results_pass_cost.json)")
    parser.add_argument("--only-warm", action="store_true",
                        help="only the pass warm in one process at each --layers, both paths, and its share spent "
                             "building rings (default out: build/bench/results_warm.json)")
    parser.add_argument("--only-compile", action="store_true",
                        help="only XLA's compile times at --compile-layers, on a machine running nothing else "
                             "(default out: build/bench/results_compile.json)")
    parser.add_argument("--platform", choices=("cpu", "gpu"), default="cpu",
                        help="gpu (with --only-pass-cost): lower and compile for 8 GPUs, a topology mocked on this "
                             "machine's one (tools/gpu_topology.py), what a GPU user's jax.jit spends before the first "
                             "call (default out: build/bench/gpu_pass_cost.json)")
    parser.add_argument("--out")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.compile_layers, args.runs, args.layer_runs, args.repeats = [1, 4], [4], 5, 5, 1
    devices = "8 virtual CPU devices"
    if args.platform == "gpu":
        if not args.only_pass_cost:
            parser.error("--platform gpu times the pass's cost only: add --only-pass-cost")
        from tools.gpu_env import configure_environment

        configure_environment("gpu", 8)  # before jax starts a backend
        devices = f"8 GPUs mocked on one {jax.devices()[0].device_kind}"
    results = {"date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(), "jax": jax.__version__, "devices": devices,
               "runs": args.runs, "layer_runs": args.layer_runs}
    if args.only_rings:
        print("the default and every variant against a hand-written ring", flush=True)
        results["rings"] = ring_runtime(args.ring_runs)
        write_results(args.out or SCRATCH / "results_rings.json", results)
        return 0
    if args.only_warm:
        print("the pass, warm (sequence parallel)", flush=True)
        results["pass_warm"] = warm_pass_cost(args.layers)
        write_results(args.out or SCRATCH / "results_warm.json", results)
        return 0
    if args.only_profile:
        profile_pass(max(args.layers))
        return 0
    if args.only_pass_cost:
        out = args.out or SCRATCH / ("gpu_pass_cost.json" if args.platform == "gpu" else "results_pass_cost.json")
        for model in MODELS:  # each model's written as it ends (a run stopped in the second keeps the first)
            print(f"pass cost ({model})", flush=True)
            results[f"pass_cost_{model}"] = pass_cost(args.layers, args.repeats, model=model)
            write_results(out, results)
        return 0
    if args.only_megatron:  # with the sequence-parallel model's pass cost beside it, from the same run
        print("1. pass cost (sequence parallel)", flush=True)
        results["pass_cost"] = pass_cost(args.layers, args.repeats)
        results["megatron"] = megatron(args)
        write_results(args.out or SCRATCH / "results_megatron.json", results)
        return 0
    if args.only_compile:
        print("XLA's compile time, rewritten / original (median of 3 rounds)", flush=True)
        results["compile"] = compile_time([n for n in args.compile_layers if n], 3)
        write_results(args.out or SCRATCH / "results_compile.json", results)
        return 0
    print("1. pass cost", flush=True)
    results["pass_cost"] = pass_cost(args.layers, args.repeats)
    # the profile beside a run written elsewhere (--out); make bench's in build/bench/, not in bench/
    beside = Path(args.out).parent / f"profile_sequence_parallel_L{max(args.layers)}.txt" if args.out else None
    written = profile_pass(max(args.layers), out=beside)
    results["pass_cost"]["profile"] = str(written.relative_to(ROOT) if written.is_relative_to(ROOT) else written)
    if any(args.compile_layers):
        print("XLA's compile time, rewritten / original (median of 3 rounds)", flush=True)
        results["compile"] = compile_time([n for n in args.compile_layers if n], 3)
    print("2. CPU run time, rewritten / original (median of runs)", flush=True)
    results["samples"] = samples_runtime(args.runs, args.samples)
    results["layer"] = layer_runtime(args.layer_runs, *args.layer)
    if args.ring_runs:
        print("the default and every variant against a hand-written ring", flush=True)
        results["rings"] = ring_runtime(args.ring_runs)
        print("a call's dispatch: cmatmul_pass.jit against jax.jit, by argument leaves", flush=True)
        results["dispatch"] = dispatch_runtime(args.ring_runs)
    ratios = {name: statistics.median(row[name] for row in results["samples"].values()) for name in VARIANTS}
    results["samples_median_ratio"] = ratios
    fastest = results["fastest_variant"] = min(ratios, key=ratios.get)
    # the medians of near-equal variants swap places between runs: name those within NEAR of it
    near = results["within_5_percent_of_fastest"] = [
        k for k, v in ratios.items() if k != fastest and v <= ratios[fastest] * (1 + NEAR)]
    print("median over samples: " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items())
          + f"; fastest: {fastest}" + (f" ({', '.join(near)} within {NEAR:.0%})" if near else ""))
    results["megatron"] = megatron(args)
    print("3. the targets", flush=True)
    results["targets"] = targets(results)
    print_targets(results["targets"])
    write_results(args.out or ROOT / "bench" / "results.json", results)
    return 0


def megatron(args) -> dict:
    """The psum-after-matmul sites: the pass's cost on Megatron training steps (beside the
    sequence-parallel model's at the same L) and the blocks' CPU run time per strategy."""
    print("Megatron (psum after a matmul): pass cost", flush=True)
    out = {"pass_cost": pass_cost(args.layers, args.repeats, model="megatron")}
    print("Megatron: CPU run time, rewritten / original (median of runs)", flush=True)
    out["runtime"] = megatron_runtime(args.layer_runs, *args.megatron)
    return out


def write_results(path: str | Path, results: dict) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    raise SystemExit(main())
