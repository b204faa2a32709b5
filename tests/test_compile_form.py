"""What the rewritten module costs XLA to compile: straight-line rounds emitted so that XLA compiles
them as one kernel (each round's block offset a table lookup, not its own constant added to the
position), and ``check`` stating both modules' compile times."""

import json

import numpy as np
import pytest

from cmatmul_pass import execute, ir_utils
from conftest import run_cli, sample
from test_variants import lowered, rewrite

STRAIGHT = ["full", "bidi-full"]



def offset_table(value) -> np.ndarray | None:
    """The table a block offset reads, where it is ``table[partition_id] * rows`` (plus a constant:
    the second half of a block a bidirectional scatter splits), None otherwise."""
    op = value.owner
    if op.name == "stablehlo.add" and op.operands[1].owner.name == "stablehlo.constant":
        op = op.operands[0].owner
    if op.name == "stablehlo.multiply":
        op = op.operands[0].owner
    if op.name != "stablehlo.reshape":
        return None
    lookup = op.operands[0].owner
    if lookup.name != "stablehlo.dynamic_slice" or lookup.operands[1].owner.name != "stablehlo.partition_id":
        return None
    table = lookup.operands[0].owner
    if table.name != "stablehlo.constant":
        return None
    return np.array(ir_utils.ir.DenseElementsAttr(table.attributes["value"]))


@pytest.mark.parametrize("variant", STRAIGHT)
@pytest.mark.parametrize("kind, op_name, at", [
    ("ag_free", "stablehlo.dynamic_update_slice", 2),  # each round writes its block of the product
    ("ag_contracting", "stablehlo.dynamic_slice", 1),  # each round reads the block of the weight it pairs with
    ("rs", "stablehlo.dynamic_slice", 1),  # each round reads the block of the operand it sums
])
def test_straight_line_rounds_read_their_block_offsets_from_tables(kind, op_name, at, variant):
    """Every block a straight-line ring's round reads or writes sits at ``table[partition_id] *
    rows``, one table per round offset: the rounds' ops differ in a constant operand, which XLA
    passes to one kernel, not in a constant it would fuse into a kernel of each round's own.  No
    ring position is computed by arithmetic (remainder) outside a loop."""
    n = 4
    module = rewrite(kind, n, variant).module
    ops = list(ir_utils.walk(module.operation))
    assert not any(op.name == "stablehlo.remainder" for op in ops)
    blocks = [op for op in ops if op.name == op_name and len(op.operands) > at
              and ir_utils.ir.RankedTensorType(op.operands[0].type).rank > 1]
    tables = [offset_table(op.operands[at]) for op in blocks]
    assert blocks and all(t is not None for t in tables)
    distinct = {tuple(t) for t in tables}
    assert 1 < len(distinct) <= n
    for table in distinct:  # each a rotation of the positions 0..n-1 over every group
        assert sorted(table[:n]) == list(range(n))


@pytest.mark.parametrize("variant", STRAIGHT + ["uni", "unroll2"])
def test_the_tables_compute_what_the_arithmetic_did(variant):
    """Numerics of every kind on a ring of 3 (a remainder that is not a mask) under each variant with
    peeled or straight-line rounds."""
    for kind in ("ag_free", "ag_contracting", "rs"):
        outcome = execute.check_numerics(ir_utils.parse(lowered(kind, 3)), rewrite(kind, 3, variant).module)
        assert outcome.ok, outcome.format()


def test_check_states_both_compile_times(tmp_path, capsys):
    report = tmp_path / "report.json"
    assert run_cli("check", sample("sp_mlp"), "--report-json", report) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("compile: original "))
    assert "rewritten" in line and line.rstrip(")").endswith("one compile each")
    compiled = json.loads(report.read_text())["numerics"]["compile_s"]
    assert compiled["original"] > 0 and compiled["rewritten"] > 0
    assert compiled["ratio"] == pytest.approx(compiled["rewritten"] / compiled["original"])
