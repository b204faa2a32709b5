"""What a scatter's product is made of: its terms (one dot each), read by the matchers of
:mod:`.reduce_scatter` and :mod:`.scatter_dag`, and the declines both give.

A :class:`Term` is one dot of the sum a ``reduce_scatter`` scatters, with the operand whose free
dim carries the scattered dim; :func:`region_is_sum` checks the scatter's region adds.
"""

from __future__ import annotations

from dataclasses import dataclass


from .. import ir_utils
from .._jax_private import ir
from ..errors import Decline
from ..ring import Ring
from . import causes
from .common import DotDims, ModuleInfo, collective_ring, describe_op, is_dot


SHARDING_CONSTRAINT = "sdy.sharding_constraint"


@dataclass(frozen=True, eq=False)
class Term:
    """One dot of the scattered sum: its ``result_dim`` (the scattered dim) is free dim
    ``operand_dim`` of operand ``operand_index``; or, with ``other_dim``, batch dim
    ``operand_dim`` of the lhs paired with batch dim ``other_dim`` of the rhs (each block
    of the product then takes that block of both operands)."""

    dot: ir.OpView
    result_dim: int
    operand_index: int
    operand_dim: int
    other_dim: int | None = None

    @property
    def role(self) -> str:
        return "free" if self.other_dim is None else "batch"

    def sliced(self) -> list[tuple[int, int]]:
        """(operand index, dim) of each operand a block of the product slices."""
        pairs = [(self.operand_index, self.operand_dim)]
        return pairs if self.other_dim is None else pairs + [(1 - self.operand_index, self.other_dim)]


class LatestFirst:
    """An op ordered by its place in its block (for a heap: the latest first)."""

    __slots__ = ("op",)

    def __init__(self, op: ir.OpView):
        self.op = op

    def __lt__(self, other: "LatestFirst") -> bool:
        return other.op.operation.is_before_in_block(self.op.operation)


def producers_first(ops) -> tuple[ir.OpView, ...]:
    """``ops`` (of one block) in block order."""
    return tuple(sorted(ops, key=LatestFirst, reverse=True))


def operand_side(value: ir.Value) -> str:
    """A value computed apart from the product, in words."""
    owner = value.owner
    return f"region argument #{value.arg_number}" if isinstance(owner, ir.Block) else describe_op(owner)


def product_of(op: ir.OpView) -> ir.Value | None:
    """The dot_general result ``op`` is computed from, if one is (for saying what a value is)."""
    for result in op.operation.results:  # a loop's, a call's: several
        dot = causes.find_near(result, False, is_dot)
        if dot is not None:  # the dot, or a call of a function holding one (its results: several)
            return dot.operation.results[0]
    return None


def not_blockwise(op: ir.OpView) -> Decline:
    """The scattered value comes from an op the ring cannot apply block by block."""
    if op.operation.name == "stablehlo.while":  # a loop's carry: the dot computing it is in the body
        return Decline("producer_not_dot", f"the scattered value is a result of {describe_op(op)}, a loop's carry "
                                           "(a scan's input gradient, say): the dot computing it runs in the loop's "
                                           "body, trip by trip, so the collective can run only after the last trip "
                                           "and has no dot beside it to split")
    product = product_of(op)
    if product is None:
        return Decline("producer_not_dot", f"the scattered value comes from {describe_op(op)}, not from a "
                                           "stablehlo.dot_general")
    held = causes.collectives_in(op) if op.operation.name == "func.call" else []
    if held:  # a nested jit's function holding collectives of its own (a scan's step under jax 0.10 is inlined first)
        callee = ir.FlatSymbolRefAttr(op.attributes["callee"]).value
        return Decline("producer_not_dot", f"the scattered value is computed by a dot inside @{callee} "
                                           f"({describe_op(op)}), a function that holds collectives of its own "
                                           f"({', '.join(held)}): the pass rewrites those where they stand and does "
                                           "not inline such a function, so no dot is in this block for a ring (its "
                                           "body written where it is called, a nested jax.jit's body say, would put the "
                                           "dot here)")
    return Decline("producer_not_dot", f"the scattered value comes from {describe_op(op)}, which the ring cannot "
                                       f"apply block by block (only layout ops and elementwise ops do), of "
                                       f"{describe_op(product.owner)}")


def dot_term(dot: ir.OpView, dim: int, rs: ir.OpView, info: ModuleInfo, ring: Ring) -> Term:
    if dot.operation.block != rs.operation.block:
        raise Decline("other_block", "the dot is in a different block from the reduce_scatter")
    dims = DotDims.of(dot, info)
    role, index, operand_dim = dims.result_dim_source(dim)
    if role == "group":
        raise Decline("ragged_dot", f"the scattered dim is the group dim of {describe_op(dot)}'s result (a grouped "
                                    "matmul's one matrix per group, summed from each group's rows): its ring goes "
                                    "along a free dim")
    dims.grouped_decline(index, operand_dim, "the scattered dim", dot)
    other_dim = dims.batch[1][dims.batch[0].index(operand_dim)] if role == "batch" else None
    term = Term(dot, dim, index, operand_dim, other_dim)
    for i, sliced_dim in term.sliced():
        producer = dot.operation.operands[i].owner
        if (
            not isinstance(producer, ir.Block)
            and producer.operation.name == "stablehlo.all_gather"
            and ir_utils.int_attr(producer, "all_gather_dim") == sliced_dim
            and producer.operation not in info.plain_gathers  # (left plain: the ring slices its value)
        ):
            raise Decline(
                "gathered_operand",
                f"the scattered dim is the dim the dot's operand was all_gathered on ({_gathered_how(producer, ring, info)}); "
                "the all_gather's ring takes this dot instead",
            )
    return term


def _gathered_how(all_gather: ir.OpView, ring: Ring, info: ModuleInfo) -> str:
    """Why a scatter on the gathered dim is left to the gather: over the same device groups the
    pair is an all-reduce in disguise; over other groups (another mesh axis) the two rings would
    have to nest, which the pass does not build."""
    try:
        gathered, _ = collective_ring(all_gather, info)
    except Decline:
        return "by a collective the pass does not rewrite"
    if {frozenset(g) for g in gathered.groups} == {frozenset(g) for g in ring.groups}:
        return "an all-reduce in disguise"
    return f"over other device groups, a ring of {gathered.size}: the two rings would nest, which the pass does not build"


def strip_constraints(value: ir.Value) -> ir.Value:
    while not isinstance(value.owner, ir.Block) and value.owner.operation.name == SHARDING_CONSTRAINT:
        value = value.owner.operation.operands[0]
    return value


def region_is_sum(op: ir.OpView) -> bool:
    """The reduction region is ``return add(arg0, arg1)`` (sharding constraints allowed anywhere)."""
    blocks = list(op.operation.regions[0].blocks)
    if len(blocks) != 1:
        return False
    block = blocks[0]
    args = list(block.arguments)
    ops = list(block.operations)
    if len(args) != 2 or not ops or ops[-1].operation.name != "stablehlo.return":
        return False
    returned = list(ops[-1].operation.operands)
    if len(returned) != 1:
        return False
    total = strip_constraints(returned[0])
    if isinstance(total.owner, ir.Block) or total.owner.operation.name != "stablehlo.add":
        return False
    a, b = (strip_constraints(v) for v in total.owner.operation.operands)
    return (a == args[0] and b == args[1]) or (a == args[1] and b == args[0])


def is_sum_from_zero(op: ir.OpView) -> bool:
    """Is ``op`` (a ``reduce``) one sum of one value from a zero constant?"""
    operands = list(op.operation.operands)
    return len(operands) == 2 and region_is_sum(op) and ir_utils.is_zero_splat(operands[1])
