"""The differential fuzzer's oracle, shared by its kinds (tools/fuzz_programs.py,
tools/fuzz_moe.py, tools/fuzz_attention.py): the option sets a program is rewritten under,
the checks of each rewrite (the module verifies, every permute is one cycle per group of a
rewritten site, the kind's expectations hold, the numbers are the original's on CPU) and the
:class:`Tally` a campaign reports."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import networkx as nx

import cmatmul_pass
from cmatmul_pass import cost, execute, ir_utils
from cmatmul_pass.pipeline import variant_options

# each ring variant; a psum of a matmul split (its reduce-scatter ring in that variant)
VARIANTS = {name: variant_options(name, all_reduce="split") for name in cost.VARIANTS}
VARIANTS["streams-unroll2"] = variant_options("unroll2", annotate_streams=True, all_reduce="split")
VARIANTS["streams-bidi-noassemble"] = variant_options("bidi", annotate_streams=True, assemble=False, all_reduce="split")
# the defaults: each site the variant (and each psum the strategy) the cost model picks
VARIANTS["auto"] = variant_options("auto")
# a psum of a matmul in row chunks, each chunk's all_reduce behind the next chunk's dot
VARIANTS["chunk"] = variant_options("uni", all_reduce="chunk")

@dataclass
class Tally:
    programs: int = 0
    runs: int = 0
    sites_rewritten: int = 0
    sites_shared: int = 0  # rewritten sites that call a shared ring function
    layer_calls: int = 0  # regions that became calls of a replayed layer (cmatmul_pass.replay)
    layer_checks: int = 0  # groups of identical regions checked against their last, trimmed regions too (replay.CHECK)
    trimmed: int = 0  # regions that became calls of a trimmed copy of a replayed layer (replay.Trim)
    differed: list = field(default_factory=list)  # (spec, variant, message): a last region unlike the first
    declined: Counter = field(default_factory=Counter)
    dtypes: Counter = field(default_factory=Counter)  # programs per element type
    mismatches: list = field(default_factory=list)
    crashes: list = field(default_factory=list)

    def record(self, spec, variant: str, result, outcome) -> None:
        """A run's sites rewritten, shared and declined, and its mismatch if any."""
        self.sites_rewritten += len(result.report.rewritten)
        self.sites_shared += sum(1 for s in result.report.rewritten if s.shared_ring)
        self.declined.update(s.reason_code for s in result.report.declined)
        if not outcome.ok:
            self.mismatches.append((spec, variant, outcome.format()))

    def summary(self) -> str:
        reasons = ", ".join(f"{code} {count}" for code, count in sorted(self.declined.items())) or "none"
        dtypes = ", ".join(f"{name} {count}" for name, count in sorted(self.dtypes.items()))
        return (
            f"programs {self.programs} ({dtypes}), variant runs {self.runs}, sites rewritten {self.sites_rewritten} "
            f"({self.sites_shared} calling a shared ring), regions replayed as layer calls {self.layer_calls}"
            + (f" and as trimmed copies {self.trimmed}" if self.trimmed else "")
            + (f" (groups checked {self.layer_checks}, differed {len(self.differed)})" if self.layer_checks else "")
            + f", sites declined by reason: {reasons}; mismatches {len(self.mismatches)}, crashes {len(self.crashes)}"
        )


def rewrite_checked(text: str, options) -> "cmatmul_pass.RewriteResult":
    """``text`` rewritten under ``options``: the module verifies, and its permutes form the
    rewritten sites' rings (AssertionError otherwise)."""
    result = cmatmul_pass.rewrite(text, options)
    result.module.operation.verify()
    groups = [frozenset(tuple(sorted(g)) for g in s.replica_groups) for s in result.report.rewritten]
    assert ring_property_holds(result.module, groups), "a permute is not one cycle per group"
    return result


def check_variants(spec, text: str, devices, tally: "Tally", variants: dict, expected, after=None) -> "Tally":
    """``text`` (``spec``'s program, for ``len(devices)`` partitions) rewritten under each of
    ``variants``, checked (:func:`rewrite_checked`), ``expected(name, result)``'s list of what is
    wrong asserted empty, and run against the original on ``devices``: each run recorded in
    ``tally`` (and passed to ``after(name, result)``), a failure as a crash with its program."""
    tally.programs += 1
    tally.dtypes[spec.dtype] += 1
    reference = execute.Reference.of(ir_utils.parse(text), devices=devices)
    for name, options in variants.items():
        tally.runs += 1
        try:
            result = rewrite_checked(text, options)
            wrong = expected(name, result)
            assert not wrong, "; ".join(wrong)
            outcome = reference.check(result.module)
        except Exception as exc:  # noqa: BLE001 - every failure is recorded with its program
            tally.crashes.append((spec, name, f"{type(exc).__name__}: {exc}"))
            continue
        tally.record(spec, name, result, outcome)
        if after is not None:
            after(name, result)
    return tally


def ring_property_holds(module, site_groups: list[frozenset]) -> bool:
    """Every collective_permute's pairs form exactly one directed cycle per replica group of one
    rewritten site (``site_groups``: each site's groups; a 2-D program rings over two axes)."""
    for op in ir_utils.walk(module.operation):
        if op.operation.name != "stablehlo.collective_permute":
            continue
        pairs = ir_utils.dense_ints(op.attributes["source_target_pairs"]).tolist()
        graph = nx.DiGraph([tuple(p) for p in pairs])
        if not all(graph.out_degree(v) == 1 and graph.in_degree(v) == 1 for v in graph):
            return False
        cycles = {tuple(sorted(c)) for c in nx.simple_cycles(graph)}
        if cycles not in site_groups:
            return False
    return True
