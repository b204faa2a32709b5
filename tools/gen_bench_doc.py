#!/usr/bin/env python
"""Write docs/performance.md's `make bench` tables from bench/results.json (the latest run).

``python tools/gen_bench_doc.py`` (or ``make bench-doc``, after ``make bench``) replaces what lies
between the two markers in docs/performance.md with the record's figures; nothing outside the
markers changes. ``--check`` writes nothing and exits 1 when the page differs. tests/test_docs.py
compares the page with :func:`updated`, so the page always quotes the committed record.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tools.doc_markers import between, cell, run  # noqa: E402

DOC = ROOT / "docs" / "performance.md"
RECORD = ROOT / "bench" / "results.json"
BEGIN = "<!-- BEGIN bench tables: written by `make bench-doc` from bench/results.json; edit that, not this -->"
END = "<!-- END bench tables -->"
VARIANTS = ("uni", "unroll2", "full", "bidi", "bidi-unroll2", "bidi-full")
STRATEGIES = ("split-uni", "split-unroll2", "split-full", "split-bidi", "chunk-2", "chunk-4", "chunk-8", "default")


def _pct(x: float) -> str:
    return f"{100 * x:.2f} %"


def _value(value) -> str:
    if value is None:
        return "not measured"
    if isinstance(value, dict):
        low, high = min(value, key=value.get), max(value, key=value.get)
        return f"{value[low]:.3f} (`{low}`) to {value[high]:.3f} (`{high}`)"
    return f"{value:.4g}"


def _row(*cells) -> str:
    return "| " + " | ".join(cell(str(c)) for c in cells) + " |"


def targets(r: dict) -> list[str]:
    lines = ["| target | limit | this run | met |", "|---|---|---|---|"]
    for t in r["targets"]:
        met = {True: "yes", False: "no", None: "—"}[t["met"]]
        lines.append(_row(t["target"], f"{t['limit']:g}", _value(t["value"]), met))
    return lines


def pass_cost(r: dict) -> list[str]:
    pc, megatron = r["pass_cost"], {row["layers"]: row for row in r["megatron"]["pass_cost"]["per_layers"]}
    lines = ["| layers | sites | lower (s) | compile (s) | pass on the text (s) | of which parse + print (s) | share "
             "| the same, every psum split (s) | pass as `cmatmul_pass.jit` runs it (s) | share "
             "| Megatron step: sites, share on the text, through `cmatmul_pass.jit` |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in pc["per_layers"]:
        m = megatron.get(row["layers"])
        mega = (f"{m['sites']}, {_pct(m['pass_over_lower_compile'])}, {_pct(m['jit_pass_over_lower_compile'])}"
                if m else "—")
        lines.append(_row(row["layers"], row["sites"], f"{row['lower_s']:.2f}", f"{row['compile_s']:.2f}",
                          f"{row['pass_s']:.3f}", f"{row['parse_print_s']:.3f}", _pct(row["pass_over_lower_compile"]),
                          f"{row['pass_split_psums_s']:.3f}", f"{row['jit_pass_s']:.3f}",
                          _pct(row["jit_pass_over_lower_compile"]), mega))
    lines += ["", f"Pass time(32 layers) / time(8): {pc['scaling_32_over_8']:.2f}."]
    return lines


def compile_ratios(r: dict) -> list[str]:
    c = r["compile"]
    shape = c["shape"]
    head = ["step", "layers", "original (s)", "default (sites rewritten; predicted)", "every site (predicted)", *VARIANTS,
            "rings by hand"]
    lines = [f"**XLA's compile time**, rewritten / original (hidden {shape['hidden']}, ffn {shape['ffn']}, "
             f"{shape['tokens']} tokens, {shape['dtype']}; the default: policy auto on the {c['hardware'].upper()} "
             f"profile, within its compile budget; median of {c['repeats']} interleaved rounds; predicted: the "
             f"budget's model, `explain`'s `XLA compile time` line):", "", _row(*head), "|" + "---|" * len(head)]
    for layers, row in c["by_layers"].items():
        for model, m in row.items():
            ratios = m["ratios"]
            done, total = m["default_sites"]
            predicted = m.get("predicted", {})
            default = f"{ratios['default']:.2f} ({done} of {total}" + (
                f"; {predicted['default']:.2f})" if "default" in predicted else ")")
            every = f"{ratios['every site']:.2f}" + (f" ({predicted['every site']:.2f})" if "every site" in predicted else "")
            lines.append(_row(model.replace("_", " "), layers, f"{m['original_s']:.2f}", default, every,
                              *(f"{ratios[v]:.2f}" if v in ratios else "—" for v in (*VARIANTS, "hand_written_rings"))))
    return lines


def layer_runtime(r: dict) -> list[str]:
    layer = r["layer"]
    rows, cols = layer["shape"], layer["variants"]
    lines = [f"A column-parallel layer {'×'.join(map(str, rows))} (median of {r['layer_runs']} interleaved rounds); "
             f"the hand-written ring takes {layer['hand_written_ring_over_plain']:.2f}× the plain program's time:", "",
             _row("", *VARIANTS), "|---|" + "---|" * len(VARIANTS),
             _row("over the plain program", *(f"{cols[v]['over_plain']:.2f}" for v in VARIANTS)),
             _row("over the hand-written ring", *(f"{cols[v]['over_hand_written']:.2f}" for v in VARIANTS)), ""]
    ratios = r["samples_median_ratio"]
    near = ", ".join(f"`{v}`" for v in r["within_5_percent_of_fastest"]) or "none"
    lines.append(f"The bundled samples, rewritten / original, median over {len(r['samples'])} samples: "
                 + ", ".join(f"`{v}` {ratios[v]:.2f}" for v in VARIANTS)
                 + f"; fastest `{r['fastest_variant']}` (within 5 % of it: {near}).")
    return lines


def rings(r: dict) -> list[str]:
    lines = [_row("layer (rows × hidden × out)", "default", *VARIANTS, "the hand-written ring again",
                  "default, per round [95 % interval]"),
             "|---|---|" + "---|" * len(VARIANTS) + "---|---|"]
    for row in r["rings"]:
        over = row["over_hand_written"]
        low, high = row["default_interval"]
        lines.append(_row(f"{row['kind']} {'×'.join(map(str, row['shape']))}",
                          f"{over['default']:.2f} ({row['default_is']})", *(f"{over[v]:.2f}" for v in VARIANTS),
                          f"{row['hand_written_again']:.2f}",
                          f"{row['default_paired']:.3f} [{low:.3f}, {high:.3f}] {row['default_verdict']}"))
    return lines


def dispatch(r: dict) -> list[str]:
    lines = ["| argument leaves | `jax.jit` (µs a call) | `cmatmul_pass.jit` (µs) | over `jax.jit`, per round "
             "| a dispatch in Python (µs) | over `jax.jit` |", "|---|---|---|---|---|---|"]
    for row in r["dispatch"]:
        us, (low, high) = row["us_per_call"], row["cmatmul_pass_jit_interval"]
        lines.append(_row(row["leaves"], f"{us['jax_jit']:.1f}", f"{us['cmatmul_pass_jit']:.1f}",
                          f"{row['cmatmul_pass_jit_over_jax_jit']:.3f} [{low:.3f}, {high:.3f}]",
                          f"{us['python_dispatch']:.1f}", f"{row['python_dispatch_over_jax_jit']:.2f}"))
    return lines


def megatron(r: dict) -> list[str]:
    rt = r["megatron"]["runtime"]
    shape = rt["shape"]
    return [f"Two pre-norm Megatron MLP blocks (rows {shape['rows']}, hidden {shape['hidden']}, ffn {shape['ffn']}), "
            f"rewritten / original; the default is `{rt['default_is']}` here:", "",
            _row(*STRATEGIES), "|" + "---|" * len(STRATEGIES),
            _row(*(f"{rt['over_original'][s]:.2f}" for s in STRATEGIES))]


def tables(r: dict | None = None) -> str:
    r = r or json.loads(RECORD.read_text())
    parts = [
        [f"`bench/results.json`: {r['date']}, jax {r['jax']}, {r['devices']} on a {r['cpus']}-core machine."],
        ["**Targets** (`bench.TARGETS`; each met where every value is within its limit):", "", *targets(r)],
        ["**The pass's cost** (the sequence-parallel training step; medians of "
         f"{r['pass_cost']['repeats']} cold starts; share: of `jax.jit`'s lower + compile):", "", *pass_cost(r)],
        compile_ratios(r),
        ["**CPU run time.**", "", *layer_runtime(r)],
        ["**Against a ring written by hand** (over it; per round: the default's per-round ratio, its 95 % interval "
         "and verdict):", "", *rings(r)],
        ["**A call's dispatch** (101 rounds of 20 calls):", "", *dispatch(r)],
        ["**psum after a matmul.**", "", *megatron(r)],
    ]
    return "\n\n".join("\n".join(p) for p in parts) + "\n"


def updated(text: str) -> str:
    """``text`` (docs/performance.md) with the tables between the markers written afresh."""
    return between(text, BEGIN, END, tables(), str(DOC.relative_to(ROOT)))


if __name__ == "__main__":
    sys.exit(run(DOC, updated, "bench-doc", sys.argv[1:]))
