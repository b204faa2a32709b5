"""The pass's time at an earlier commit against this checkout's, in one process.

A shared machine's speed drifts by tens of percent within minutes, more than a change to the
pass is worth, so two benchmark runs minutes apart do not compare.  This puts both versions
in one process (the earlier one's package copied out of git under another name) and runs them
alternately on the same lowered program, as ``cmatmul_pass.jit`` runs the pass (a clone of jax's
module, the decorator's own options): each pair of runs sees the same machine, and the median
of the paired ratios (this checkout's time over the earlier one's) is the change.

    python tools/ab_pass.py 4991bae --layers 4 8 --runs 30 --out build/bench/ab_pass.json
    python tools/ab_pass.py 4991bae --path text    # the pass on the lowered text: parse, rewrite, print
"""

from __future__ import annotations

import argparse
import importlib
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
# the models are sized for a CPU, far too small for the cost model to predict a ring faster on an
# H100: they are measured under policy "all", every ring built
os.environ.setdefault("CMATMUL_PASS_POLICY", "all")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402

import cmatmul_pass  # noqa: E402
from tools import bench  # noqa: E402

#: the name the earlier commit's package is imported under
BASE_PACKAGE = "cmatmul_pass_base"


def load_base(rev: str, into: Path):
    """``rev``'s ``cmatmul_pass`` package (from ``git archive``), imported as :data:`BASE_PACKAGE`
    (its imports are relative: it runs as it did at ``rev``, beside this checkout's)."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "cmatmul_pass"], check=True,
                             capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    (into / "cmatmul_pass").rename(into / BASE_PACKAGE)
    sys.path.insert(0, str(into))
    return importlib.import_module(BASE_PACKAGE)


#: what each run times: the pass as ``cmatmul_pass.jit`` runs it (a clone of jax's module, the
#: decorator's options), or on the lowered program's text as the CLI and ``rewrite`` take it
#: (parsed, rewritten with the default options, printed)
PATHS = ("jit", "text")


def compare(rev: str, layers_list: list[int], runs: int, model: str = "sequence_parallel",
            path: str = "jit") -> dict:
    """Per L: both versions' median seconds and the paired ratios' median and quartiles."""
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], check=True,
                          capture_output=True, text=True).stdout.strip()
    out = {"base": rev, "head": head, "dirty": bool(subprocess.run(
        ["git", "-C", str(ROOT), "status", "--porcelain", "cmatmul_pass"], check=True, capture_output=True,
        text=True).stdout.strip()), "model": model, "path": path, "runs": runs, "jax": jax.__version__,
        "per_layers": []}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            _compare(load_base(rev, Path(tmp)), rev, head, layers_list, runs, model, path, out)
        finally:  # the earlier package goes with its directory
            if tmp in sys.path:
                sys.path.remove(tmp)
            for name in [name for name in sys.modules if name.split(".")[0] == BASE_PACKAGE]:
                del sys.modules[name]
    return out


def _runner(package, path: str, lowered) -> Callable[[], object]:
    """One run of ``package``'s pass on ``lowered`` along ``path`` (:data:`PATHS`)."""
    if path == "text":
        text = lowered.as_text()
        return lambda: package.rewrite(text).text
    rewrite_lowered = importlib.import_module(f"{package.__name__}.decorator").rewrite_lowered
    options = package.jit(lambda x: x).options
    return lambda: rewrite_lowered(lowered, options, "ab")


def _compare(base, rev: str, head: str, layers_list: list[int], runs: int, model: str, path: str,
             out: dict) -> None:
    """Time ``base``'s pass and this checkout's, alternately, at each L (rows into ``out``)."""
    for layers in layers_list:
        fn, args = bench.MODELS[model](layers)
        lowered = fn.lower(*args)
        old, new = _runner(base, path, lowered), _runner(cmatmul_pass, path, lowered)
        for _ in range(2):  # warm-up
            old()
            new()
        before, after = [], []
        for _ in range(runs):
            t0 = time.perf_counter()
            old()
            t1 = time.perf_counter()
            new()
            t2 = time.perf_counter()
            before.append(t1 - t0)
            after.append(t2 - t1)
        ratios = sorted(b / a for a, b in zip(before, after))
        quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
        row = {"layers": layers, "base_median_s": statistics.median(before),
               "head_median_s": statistics.median(after), "ratio_median": statistics.median(ratios),
               "ratio_q25": quartiles[0], "ratio_q75": quartiles[2]}
        out["per_layers"].append(row)
        print(f"  L={layers:>2}: {rev} {1e3 * row['base_median_s']:.1f} ms, {head} "
              f"{1e3 * row['head_median_s']:.1f} ms; paired ratio {row['ratio_median']:.3f} "
              f"(quartiles {row['ratio_q25']:.3f}-{row['ratio_q75']:.3f})", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rev", help="the earlier commit")
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--runs", type=int, default=30, help="pairs of runs per L")
    parser.add_argument("--model", choices=sorted(bench.MODELS), default="sequence_parallel")
    parser.add_argument("--path", choices=PATHS, default="jit",
                        help="jit: the pass as cmatmul_pass.jit runs it (default); text: parse, rewrite, print")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    results = compare(args.rev, args.layers, args.runs, args.model, args.path)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
