"""The compile budget: the rewritten program's size in the ops XLA compiles (compile_budget.program_weight),
kept within Options.compile_budget times the original's predicted compile time under policy auto."""

from __future__ import annotations

import functools
import json

import pytest

import cmatmul_pass
from cmatmul_pass import compile_budget, cost, ir_utils
from cmatmul_pass.compile_budget import LOOP_WEIGHT, compile_ratio, program_weight, ring_units
from conftest import ROOT, assert_same_numbers, run_cli
from tools import bench

#: a profile under which the bench's tiny layers' rings pay (slow links, slow dots, no per-step cost):
#: policy auto then rewrites most sites, in straight-line rings
SLOW = "h100:bandwidth=1e7,all_reduce_bandwidth=1e7,f32=1e9,step=1e-9"


@functools.lru_cache(maxsize=None)
def step_text(model: str, layers: int = 6) -> str:
    fn, args = bench.MODELS[model](layers, hidden=32, ffn=64, tokens=32)
    return fn.lower(*args).as_text()


def rewrite(text: str, **options) -> cmatmul_pass.RewriteResult:
    return cmatmul_pass.rewrite(text, cmatmul_pass.Options(**{"policy": "auto", "hardware": SLOW, **options}))


# ---------------------------------------------------------------------------- the weight
WEIGHED = """
module @m attributes {mhlo.num_partitions = 1 : i32} {
  func.func public @main(%x: tensor<4xf32>) -> tensor<4xf32> {
    %c = stablehlo.constant dense<1.0> : tensor<4xf32>
    %a = stablehlo.add %x, %c : tensor<4xf32>
    %r = stablehlo.reshape %a : (tensor<4xf32>) -> tensor<2x2xf32>
    %b = stablehlo.reshape %r : (tensor<2x2xf32>) -> tensor<4xf32>
    %d = func.call @twice(%b) : (tensor<4xf32>) -> tensor<4xf32>
    %e = func.call @twice(%d) : (tensor<4xf32>) -> tensor<4xf32>
    %i0 = stablehlo.constant dense<0> : tensor<i32>
    %w:2 = stablehlo.while(%i = %i0, %v = %e) : tensor<i32>, tensor<4xf32>
     cond {
      %n = stablehlo.constant dense<TRIPS> : tensor<i32>
      %p = stablehlo.compare LT, %i, %n : (tensor<i32>, tensor<i32>) -> tensor<i1>
      stablehlo.return %p : tensor<i1>
    } do {
      %one = stablehlo.constant dense<1> : tensor<i32>
      %j = stablehlo.add %i, %one : tensor<i32>
      %m = stablehlo.multiply %v, %v : tensor<4xf32>
      stablehlo.return %j, %m : tensor<i32>, tensor<4xf32>
    }
    return %w#1 : tensor<4xf32>
  }
  func.func private @twice(%y: tensor<4xf32>) -> tensor<4xf32> {
    %s = stablehlo.add %y, %y : tensor<4xf32>
    %t = stablehlo.multiply %s, %s : tensor<4xf32>
    return %t : tensor<4xf32>
  }
}
"""


def test_the_weight_counts_calls_as_their_callees_and_a_loop_body_once():
    # add; two calls of two ops; the loop's compare, add and multiply once, and the loop itself
    assert program_weight(ir_utils.parse(WEIGHED.replace("TRIPS", "5"))) == 1 + 2 * 2 + 3 + LOOP_WEIGHT
    # a loop of one trip, which XLA removes: its body only
    assert program_weight(ir_utils.parse(WEIGHED.replace("TRIPS", "1"))) == 1 + 2 * 2 + 3


def test_the_predicted_ratio_has_the_compile_s_fixed_part():
    assert compile_ratio(1000, 1000) == 1.0
    assert 1.0 < compile_ratio(1000, 2000) < 2.0  # the fixed part does not double
    assert compile_ratio(1000, 2000) > compile_ratio(2000, 3000)


@pytest.mark.parametrize("kind", ["all_gather_dot", "dot_reduce_scatter"])
def test_a_loop_form_writes_fewer_rounds_than_a_straight_line_ring(kind):
    shape = cost.SiteShape(kind, 8, 1e9, 1 << 20, "bf16")
    full, full_loops = ring_units(shape, "full")
    uni, uni_loops = ring_units(shape, "uni")
    assert (full, full_loops) == (8, False)  # every round's dot, no loop
    assert uni_loops and uni < full
    bidi_full, _ = ring_units(shape, "bidi-full")
    assert bidi_full >= full  # (a scatter's halved blocks: two dots a round)


# ---------------------------------------------------------------------------- the budget
@pytest.mark.parametrize("model", list(bench.MODELS))
def test_the_default_keeps_the_program_within_its_budget(model):
    text = step_text(model)
    unbounded = rewrite(text, compile_budget=None)
    assert unbounded.report.compile["predicted_ratio"] > 2  # the slow profile's straight-line rings everywhere
    assert unbounded.report.compile["budget"] is None
    for budget in (1.2, 1.4):
        result = rewrite(text, compile_budget=budget)
        figure = result.report.compile
        assert figure["budget"] == budget and figure["original_ops"] == unbounded.report.compile["original_ops"]
        # priced before each ring is built: the first ring of a shape may overshoot by its own error;
        # a program may always grow by FLOOR_OPS
        original = figure["original_ops"]
        bound = max(budget, compile_ratio(original, original + compile_budget.FLOOR_OPS))
        assert figure["predicted_ratio"] <= bound + 0.02, figure
        assert 0 < len(result.report.rewritten) < len(unbounded.report.rewritten)
        left = [s for s in result.report.sites if s.reason_code == "compile_budget"]
        assert left and all("compile budget" in s.reason for s in left)
    assert rewrite(text).report.compile["budget"] == compile_budget.DEFAULT_BUDGET


def test_nothing_is_rewritten_at_a_budget_of_one():
    result = rewrite(step_text("sequence_parallel"), compile_budget=1.0)
    assert not result.report.rewritten
    assert "compile_budget" in {s.reason_code for s in result.report.sites} <= {"policy", "compile_budget"}


def test_policy_all_has_no_budget():
    text = step_text("sequence_parallel")
    every = rewrite(text, policy="all", compile_budget=1.0)
    assert every.report.compile["budget"] is None
    assert not any(s.reason_code == "compile_budget" for s in every.report.sites)
    assert every.report.compile["predicted_ratio"] > 2


def test_a_site_past_the_budget_takes_a_smaller_variant_that_still_pays():
    """Where the preferred ring does not fit and a smaller variant pays, the site is built in it,
    saying why; with the variant named, it is left as written instead."""
    # a profile whose loops cost nothing per trip: every variant pays
    hw = SLOW + ",loop_trip=0"
    text = step_text("sequence_parallel")
    result = rewrite(text, hardware=hw, compile_budget=1.3)
    smaller = [s for s in result.report.rewritten if any("compile budget" in n for n in s.notes)]
    assert smaller, [s.schedule for s in result.report.rewritten]
    for site in smaller:
        built, preferred = site.schedule["variant"], site.cost["variant"]
        assert built != preferred and site.cost["speedup"][built] >= 1.02
        shape = cost.SiteShape.from_dict(site.cost["site"])
        assert ring_units(shape, built) < ring_units(shape, preferred)
    named = rewrite(text, hardware=hw, compile_budget=1.3, variant="bidi-full")
    assert not any(any("compile budget" in n for n in s.notes) for s in named.report.rewritten)
    assert any(s.reason_code == "compile_budget" for s in named.report.sites)


@pytest.mark.parametrize("model", list(bench.MODELS))
def test_the_budgeted_program_computes_what_the_original_does(model):
    text = step_text(model, 3)
    result = rewrite(text, compile_budget=1.3)
    assert result.report.rewritten and any(s.reason_code == "compile_budget" for s in result.report.sites)
    assert_same_numbers(text, result)


def test_replayed_layers_are_priced_for_all_their_copies():
    """Identical layers rewritten once and called: the twin's ring is priced for every copy, so
    the program stays within the budget; all copies take the twin's choice."""
    text = step_text("sequence_parallel", 12)
    result = rewrite(text, compile_budget=1.4)
    assert result.report.layers  # replayed
    assert result.report.compile["predicted_ratio"] <= 1.42
    by_place: dict = {}
    for s in result.report.sites:
        by_place.setdefault((s.kind, s.function, s.location), set()).add(
            (s.rewritten, (s.schedule or {}).get("variant"), s.reason_code))
    assert all(len(choices) == 1 for choices in by_place.values()), by_place


def test_options_and_the_command_line_check_the_budget(tmp_path):
    with pytest.raises(ValueError, match="compile_budget"):
        cmatmul_pass.Options(compile_budget=0.5)
    path = tmp_path / "step.mlir"
    path.write_text(step_text("sequence_parallel", 2))
    with pytest.raises(SystemExit) as info:  # argparse's usage error
        run_cli("rewrite", path, "--compile-budget", "0.5", "-o", tmp_path / "out.mlir")
    assert info.value.code == 2
    assert not (tmp_path / "out.mlir").exists()
    report = tmp_path / "report.json"
    assert run_cli("rewrite", path, "--policy", "auto", "--hardware", SLOW, "--compile-budget", "none", "-o", tmp_path / "a.mlir",
                   "--report-json", report) == 0
    assert json.loads(report.read_text())["compile"]["budget"] is None
    assert run_cli("rewrite", path, "--policy", "auto", "--hardware", SLOW, "--compile-budget", "1.1", "-o", tmp_path / "b.mlir",
                   "--report-json", report) == 0
    assert json.loads(report.read_text())["compile"]["budget"] == 1.1


def test_explain_states_the_predicted_compile_ratio(tmp_path, capsys):
    path = tmp_path / "step.mlir"
    path.write_text(step_text("sequence_parallel", 2))
    assert run_cli("explain", path, "--policy", "auto", "--hardware", SLOW) == 0
    out = capsys.readouterr().out
    assert "XLA compile time: predicted" in out and "budget 1.4x" in out


@pytest.mark.parametrize("name", ["ag_scan_stacked", "rs_dot_padded", "rs_ag_padded_grad"])
def test_a_motion_whose_ring_the_budget_declines_is_not_made(name):
    """A collective moved to its matmul (sunk into a scan, past a pad or a crop) is moved only
    where its ring is then built: with no room in the budget the module is left as it was."""
    text = (ROOT / "hlo_samples" / f"{name}.mlir").read_text()
    free = rewrite(text, compile_budget=None)
    assert free.report.rewritten and any(s.moved_from or s.notes for s in free.report.rewritten)
    none = rewrite(text, compile_budget=1.0)
    assert not none.report.rewritten
    # the site says why it stayed: its own decline where it stands, and the motion's ring declined
    assert any("compile_budget" in s.reason + " ".join(s.notes) for s in none.report.sites), \
        [(s.reason_code, s.reason, s.notes) for s in none.report.sites]
    assert ir_utils.print_module(none.module) == ir_utils.print_module(ir_utils.parse(text))
    assert_same_numbers(text, free)
