"""Idempotence, determinism, and resource sanity.

* Rewriting a rewritten module changes nothing (there is nothing left to rewrite, and what was
  declined stays declined).
* The same input gives byte-identical output, run after run.
* A module with 1000+ sites rewrites with a constant number of whole-module passes (walks and
  verifications), whatever the number of sites: no work restarted per site.  (Time itself is measured
  by the benchmarks, not here.)
"""

import pytest

import cmatmul_pass
from cmatmul_pass import ir_utils, pipeline
from cmatmul_pass._jax_private import ir
from conftest import POSITIVE, SAMPLES

VARIANTS = [cmatmul_pass.Options(), cmatmul_pass.Options(bidirectional=True, unroll=2, annotate_streams=True)]


@pytest.mark.parametrize("options", VARIANTS, ids=["uni", "bidi-unroll2-streams"])
@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.stem)
def test_rewriting_twice_changes_nothing(path, options):
    once = cmatmul_pass.rewrite(path.read_text(), options)
    twice = cmatmul_pass.rewrite(once.text, options)
    assert twice.text == once.text
    assert not twice.report.rewritten


@pytest.mark.parametrize("path", POSITIVE, ids=lambda p: p.stem)
def test_output_is_deterministic(path):
    text = path.read_text()
    options = VARIANTS[1]
    first = cmatmul_pass.rewrite(text, options)
    second = cmatmul_pass.rewrite(text, options)
    assert first.text == second.text and first.bytecode == second.bytecode
    assert first.report.to_json() == second.report.to_json()


def many_sites(copies: int) -> ir.Module:
    """The SP MLP sample's main function, cloned ``copies`` times (2 sites each)."""
    module = ir_utils.parse((SAMPLES[0].parent / "sp_mlp.mlir").read_text())
    main = next(op for op in module.body.operations if ir_utils.symbol_name(op) == "main")
    with module.context:
        for i in range(copies - 1):
            clone = main.operation.clone(ip=ir.InsertionPoint(module.body))
            clone.attributes["sym_name"] = ir.StringAttr.get(f"copy_{i}")
            clone.attributes["sym_visibility"] = ir.StringAttr.get("private")
    return module


@pytest.mark.parametrize(
    "options",
    [cmatmul_pass.Options(), cmatmul_pass.Options(bidirectional=True, annotate_streams=True)],
    ids=["shared_rings", "bidi_streams"],
)
def test_a_thousand_sites_take_a_constant_number_of_module_passes(monkeypatch, options):
    counts = {"walks": 0, "verifies": 0}
    module = many_sites(520)
    root = module.operation
    walk, ops_named = ir_utils.walk, ir_utils.ops_named

    def counting_walk(op):
        if op == root:
            counts["walks"] += 1
        return walk(op)

    def counting_ops_named(op, *names, **skip):
        if op.operation == root:  # called with the module or its operation
            counts["walks"] += 1
        return ops_named(op, *names, **skip)

    verify = pipeline._verify

    def counting_verify(mod, entry, *placement):
        counts["verifies"] += 1
        return verify(mod, entry, *placement)

    monkeypatch.setattr(ir_utils, "walk", counting_walk)
    monkeypatch.setattr(ir_utils, "ops_named", counting_ops_named)
    monkeypatch.setattr(pipeline, "_verify", counting_verify)
    result = cmatmul_pass.rewrite(module, options)
    assert len(result.report.rewritten) == 1040
    assert counts["verifies"] == 1
    assert 1 <= counts["walks"] <= 8, counts
    # the 520 copies of one function are one replay group: calls of the first region, rewritten with
    # its two rings inline (streams annotated: no replay, every site its own ring)
    replayed = options.share_rings and not options.annotate_streams
    assert [len(calls) for calls in result.report.layers.values()] == ([520] if replayed else [])
    assert not any(s.shared_ring for s in result.report.rewritten)
    module.operation.verify()
