"""The whole step's answer under ``--policy auto`` on a bench model at production shapes
(lowered for these CPU devices, never run): the sites each prediction takes alone, the step's
prediction with them, and the same with the step's answer (``cmatmul_pass.step_guard``).

    python tools/step_answer.py [--model megatron|sequence_parallel] [--layers 4]
        [--shape HIDDEN FFN TOKENS] [--hardware h100]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax.numpy as jnp  # noqa: E402

import cmatmul_pass  # noqa: E402
from cmatmul_pass import step_guard  # noqa: E402
from tools.bench_models import MODELS  # noqa: E402


def answer(text: str, hardware: str, guarded: bool) -> tuple[int, int, float, float]:
    """(sites rewritten, sites declined by the step, before s, after s)."""
    real = step_guard.losing_places
    if not guarded:
        step_guard.losing_places = lambda *a, **k: {}
    try:
        result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(policy="auto", hardware=hardware))
    finally:
        step_guard.losing_places = real
    p = result.report.program
    stepped = sum(1 for s in result.report.sites if s.reason_code == "step")
    return len(result.report.rewritten), stepped, p["before_s"], p["after_s"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="megatron")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--shape", type=int, nargs=3, default=[4096, 14336, 16384], metavar=("HIDDEN", "FFN", "TOKENS"))
    parser.add_argument("--hardware", default="h100")
    args = parser.parse_args(argv)
    hidden, ffn, tokens = args.shape
    fn, fargs = MODELS[args.model](args.layers, hidden=hidden, ffn=ffn, tokens=tokens, dtype=jnp.bfloat16)
    text = fn.lower(*fargs).as_text()
    for label, guarded in (("each site alone", False), ("the step's answer", True)):
        rewritten, stepped, before, after = answer(text, args.hardware, guarded)
        print(f"{label}: {rewritten} sites rewritten, {stepped} declined by the step; "
              f"predicted {before * 1e3:.2f} ms -> {after * 1e3:.2f} ms ({before / after:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
