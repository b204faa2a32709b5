#!/usr/bin/env python
"""Where XLA's CPU compile of a rewritten module spends its time, per variant and depth.

For the bench's training steps (``tools/bench.py``'s ``MODELS``) at each L, the original module
and the pass's output per variant, compiled for the 8 virtual CPU devices:

- the compile time (median of ``--repeats``, the programs of one L interleaved) and its ratio
  to the original's;
- XLA's own phases, from one compile traced with ``jax.profiler`` (XLA's TraceMe events): the HLO
  passes (SPMD partitioning, shardy, the pipelines up to and after layout assignment), the thunk
  emitter, the MLIR fusion emitters (``FusionCompiler::Compile``, summed over the codegen
  threads) and LLVM's code generation (``Codegen``: the fusion emitters' kernels through LLVM,
  wall time);
- what the optimised module holds: loop fusions (one LLVM kernel each), dot fusions
  (XNNPACK/YNNPACK calls), while loops, collective permutes, copies, dynamic slices and updates;
- what the pass emitted: optimization barriers, constants, distinct dot shapes;
- how many sites each variant rewrote and the compile milliseconds each added over the original.

    python tools/compile_profile.py [--model sequence_parallel] [--layers 1 4 32]
        [--variants auto uni unroll2 full bidi bidi-unroll2 bidi-full] [--repeats 3]
        [--hardware h100] [--policy all] [--shape small|7b] [--no-trace] [--json out.json]

``auto`` is ``Options(variant="auto")`` with ``--hardware`` (h100 by default: the CLI's) and
``--policy`` (all by default, as the tests run; the library's default is auto).
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import statistics
import sys
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

import cmatmul_pass  # noqa: E402
from cmatmul_pass import ir_utils  # noqa: E402
from cmatmul_pass._jax_private import compile_module  # noqa: E402
from tools import bench  # noqa: E402

VARIANTS = ["auto", "uni", "unroll2", "full", "bidi", "bidi-unroll2", "bidi-full"]

#: XLA TraceMe events summed into a phase (compile thread; ``FusionCompiler`` over every thread)
PHASES = {
    "hlo": ("spmd-partitioner", "shardy-xla", "HLO passes through layout assignment",
            "HLO passes after layout assignment", "copy-insertion"),
    "thunks": ("ThunkEmitter::EmitEntryComputation", "ThunkEmitter::ConsumeKernels"),
    "mlir_emit": ("FusionCompiler::Compile",),
    "codegen": ("Codegen",),
}


def _devices():
    return jax.devices("cpu")[:8]


def compile_seconds(module) -> float:
    start = time.perf_counter()
    compile_module(module, 8, _devices())
    return time.perf_counter() - start


def traced_phases(module) -> dict:
    """Seconds per phase (``PHASES``) of one compile of ``module`` traced by ``jax.profiler``,
    and how many kernels the MLIR fusion emitters compiled."""
    from jax.profiler import ProfileData

    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        try:
            compile_module(module, 8, _devices())
        finally:
            jax.profiler.stop_trace()
        (path,) = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
        data = ProfileData.from_file(path)
    totals: collections.Counter = collections.Counter()
    counts: collections.Counter = collections.Counter()
    for plane in data.planes:
        for line in plane.lines:
            for event in line.events:
                for phase, prefixes in PHASES.items():
                    if event.name.startswith(prefixes):
                        totals[phase] += event.duration_ns / 1e9
                        counts[phase] += 1
    out = {phase: round(totals[phase], 3) for phase in PHASES}
    out["mlir_kernels"] = counts["mlir_emit"]
    return out


def optimised_counts(module) -> dict:
    """What XLA's optimised module holds (the compiled executable's HLO text)."""
    hlo = compile_module(module, 8, _devices()).hlo_modules()[0].to_string()
    kinds = collections.Counter(re.findall(r" fusion\([^\n]*kind=(k\w+)", hlo))
    ops = collections.Counter(re.findall(r"\s([a-z][a-z\-]*)\(", hlo))
    return {"loop_fusions": kinds["kLoop"] + kinds["kInput"] + kinds["kOutput"], "dot_fusions": kinds["kCustom"],
            "while": ops["while"], "permutes": ops["collective-permute"], "copies": ops["copy"],
            "dynamic_slices": ops["dynamic-slice"], "dynamic_updates": ops["dynamic-update-slice"]}


def emitted_counts(module) -> dict:
    """What the module handed to XLA holds (StableHLO)."""
    names = collections.Counter(op.name for op in ir_utils.walk(module.operation))
    shapes = set()
    for op in ir_utils.walk(module.operation):
        if op.name == "stablehlo.dot_general":
            shapes.add((str(op.operands[0].type), str(op.operands[1].type)))
    return {"ops": sum(names.values()), "barriers": names["stablehlo.optimization_barrier"],
            "constants": names["stablehlo.constant"], "dots": names["stablehlo.dot_general"],
            "dot_shapes": len(shapes)}


def profile(model: str, layers: int, variants: list[str], repeats: int, hardware: str, policy: str,
            trace: bool, shape: str = "small") -> dict:
    if shape == "7b":  # make bench's compile section's shape (bf16), where the cost model's choices are a GPU's
        from tools.bench_measure import _step_text

        text = _step_text(model, layers)
    else:
        fn, args = bench.MODELS[model](layers)
        text = fn.lower(*args).as_text()
    modules = {"original": lambda: ir_utils.parse(text)}
    sites: dict[str, int] = {}
    for v in variants:
        result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(policy=policy, variant=v, hardware=hardware))
        modules[v] = (lambda m=result.module: m)
        sites[v] = len(result.report.rewritten)
    built = {name: make() for name, make in modules.items()}
    compile_seconds(built["original"])  # warm-up: the first compile pays for XLA's own start
    times: dict[str, list[float]] = {name: [] for name in built}
    for _ in range(repeats):  # interleaved: the machine's load moves them alike
        for name, module in built.items():
            times[name].append(compile_seconds(module))
    rows = {}
    base = statistics.median(times["original"])
    for name, module in built.items():
        t = statistics.median(times[name])
        row = {"compile_s": round(t, 3), "ratio": round(t / base, 2), **emitted_counts(module),
               **optimised_counts(module)}
        if name in sites:  # and what each rewritten site added to the original's compile
            row["sites"] = sites[name]
            row["ms_per_site"] = round(1e3 * (t - base) / sites[name], 1) if sites[name] else ""
        if trace:
            row.update(traced_phases(module))
        rows[name] = row
    return {"model": model, "layers": layers, "repeats": repeats, "rows": rows}


COLUMNS = ["compile_s", "ratio", "sites", "ms_per_site", "hlo", "thunks", "mlir_emit", "codegen", "mlir_kernels", "loop_fusions",
           "dot_fusions", "while", "permutes", "copies", "dynamic_slices", "dynamic_updates", "ops", "barriers",
           "constants", "dots", "dot_shapes"]


def table(result: dict) -> str:
    columns = [c for c in COLUMNS if any(c in row for row in result["rows"].values())]
    lines = [f"{result['model']}, L = {result['layers']} (median of {result['repeats']})",
             "| module | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for name, row in result["rows"].items():
        lines.append(f"| {name} | " + " | ".join(str(row.get(c, "")) for c in columns) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="sequence_parallel", choices=sorted(bench.MODELS))
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 4, 32])
    parser.add_argument("--variants", nargs="+", default=VARIANTS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hardware", default="h100")
    parser.add_argument("--policy", default="all")
    parser.add_argument("--shape", choices=["small", "7b"], default="small",
                        help="the bench models' CPU sizes, or make bench's compile shape (hidden 4096, ffn 16384, "
                             "16384 tokens, bf16: with --policy auto, the sites and variants the default picks "
                             "for --hardware)")
    parser.add_argument("--no-trace", action="store_true", help="leave out XLA's phases (one traced compile each)")
    parser.add_argument("--json", help="also write the results here")
    a = parser.parse_args(argv)
    results = []
    for layers in a.layers:
        result = profile(a.model, layers, a.variants, a.repeats, a.hardware, a.policy, not a.no_trace, a.shape)
        results.append(result)
        print(table(result), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
