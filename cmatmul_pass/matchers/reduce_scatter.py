"""``dot_general`` (or a sum of them) feeding a sum ``reduce_scatter``.

``%d = dot_general(a, b)`` — or ``d1 + d2 + ...``, as the backward of a gathered
value read by several projections sums their input gradients — (optionally through
layout ops, see :mod:`cmatmul_pass.layout`) ``-> reduce_scatter(sum, scatter_dimension
= r)``: for every dot the scattered dim must trace back to a free dim of ``a`` or ``b``,
so one block of the result is the dot of one block of that operand.  The ring then computes, step by
step, the block some other device owns and adds it to the partial sum travelling
past.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import ir_utils
from .._jax_private import ir
from ..errors import Decline
from ..layout import LayoutStep, backward_dim, elementwise_step, is_elementwise, is_layout_op, path_operand
from ..ring import Ring
from . import causes
from .common import DeclinedSite, DotDims, ManualRegion, ModuleInfo, collective_ring, describe_op, static_tensor

DOT_REDUCE_SCATTER = "dot_reduce_scatter"
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


@dataclass(frozen=True, eq=False)
class ReduceScatterSite:
    """``reduce_scatter(path(d1 + d2 + ...))``: ``terms`` are the dots (one, or the leaves of
    an ``stablehlo.add`` tree, as a backward pass sums the input gradients of several
    projections), ``adds`` the add ops, root first; ``path`` runs from the sum to the
    reduce_scatter's operand.
    """

    reduce_scatter: ir.OpView
    terms: tuple[Term, ...]
    adds: tuple[ir.OpView, ...]
    path: tuple[LayoutStep, ...]
    ring: Ring
    region: ManualRegion
    scatter_dim: int

    kind = DOT_REDUCE_SCATTER

    @property
    def anchor(self) -> ir.OpView:
        return self.reduce_scatter

    @property
    def dot(self) -> ir.OpView:
        return self.terms[0].dot


def find_dot_reduce_scatter(module: ir.Module, info: ModuleInfo | None = None) -> list[ReduceScatterSite | DeclinedSite]:
    info = info or ModuleInfo.of(module)
    return [match_reduce_scatter(op, info) for op in reduce_scatters(module)]


def reduce_scatters(module: ir.Module) -> list[ir.OpView]:
    return ir_utils.ops_named(module, "stablehlo.reduce_scatter")["stablehlo.reduce_scatter"]


def match_reduce_scatter(op: ir.OpView, info: ModuleInfo) -> ReduceScatterSite | DeclinedSite:
    ring = None
    try:
        ring, region = collective_ring(op, info)
        return _match(op, ring, region, info)
    except Decline as d:
        return DeclinedSite(DOT_REDUCE_SCATTER, op, d.code, d.message, ring)


def _match(rs: ir.OpView, ring: Ring, region: ManualRegion, info: ModuleInfo) -> ReduceScatterSite:
    n = ring.size
    if not region_is_sum(rs):
        raise Decline("not_sum", "the reduce_scatter's reduction is not a sum (stablehlo.add of its two arguments)")
    operand = rs.operation.operands[0]
    operand_t = static_tensor(operand, "the reduce_scatter operand")
    result_t = static_tensor(rs.result, "the reduce_scatter result")
    scatter_dim = ir_utils.int_attr(rs, "scatter_dimension")
    if operand_t.shape[scatter_dim] != result_t.shape[scatter_dim] * n:
        raise Decline("shape", f"scattered dim {scatter_dim} is not {n}x the result's")

    try:
        terms, adds, path = trace_product(rs, operand, scatter_dim, info, ring)
    except Decline as declined:
        raise _truer(declined, operand, scatter_dim, n) from None
    return ReduceScatterSite(rs, terms, adds, path, ring, region, scatter_dim)


def _truer(declined: Decline, operand: ir.Value, dim: int, n: int) -> Decline:
    """A ``producer_not_dot`` decline, or what is truer: the scattered value is a grouped
    matmul's, or a dot's in an earlier shard_map region (the program already keeps the scatter
    apart from its matmul)."""
    if declined.code != "producer_not_dot":
        return declined
    ragged = ragged_producer(operand, "the scattered value")
    if ragged is not None:
        return ragged
    source = _path_source(operand, dim, n)
    if isinstance(source.owner, ir.Block) and source.owner.owner.name == causes.MANUAL:
        found = causes.dot_in_earlier_region(source)
        if found is not None:
            dot, via = found
            through = f" (through {', '.join(via)})" if via else ""
            return Decline("prefetchable", f"the scattered value is region argument #{source.arg_number}, computed by "
                                           f"{describe_op(dot)} in an earlier shard_map region{through}: the program "
                                           "already scatters it apart from its matmul, so the transfer is off that "
                                           "matmul's critical path")
    return declined


def ragged_producer(value: ir.Value, what: str) -> Decline | None:
    """``ragged_dot`` when a grouped matmul computes ``value`` (through an MoE block's unpermute);
    ``what``: the value, in words."""
    ragged = causes.ragged_dot_before(value)
    return causes.ragged_dot_decline(ragged, f"{what} is computed by") if ragged is not None else None


def _path_source(value: ir.Value, dim: int, n: int) -> ir.Value:
    """Where the scattered value comes from past the ops the ring applies per block (layout ops,
    elementwise ops with one operand that differs from block to block)."""
    while not isinstance(value.owner, ir.Block):
        owner = value.owner
        if is_elementwise(owner):
            through = path_operand(owner, dim)
            if through is None:
                break
            value = through
        elif is_layout_op(owner):
            try:
                dim = backward_dim(owner, dim, n)
            except Decline:
                break
            value = owner.operation.operands[0]
        else:
            break
    return value


def trace_product(
    anchor: ir.OpView, operand: ir.Value, dim: int, info: ModuleInfo, ring: Ring
) -> tuple[tuple[Term, ...], tuple[ir.OpView, ...], tuple[LayoutStep, ...]]:
    """The dots whose (summed) product a sum-collective ``anchor`` reduces, split into the ring's
    blocks along ``dim`` of ``operand``: (terms, the sum's adds root first, the path from the
    sum to ``operand``); or :class:`Decline`.  Every value on the way has ``anchor`` as its one
    reader, and every block of ``operand`` along ``dim`` is the same ops applied to one block of
    a dot operand's free (or paired batch) dim."""
    n = ring.size
    path: list[LayoutStep] = []
    value = operand
    while True:
        _single_use(value)
        owner = value.owner
        if isinstance(owner, ir.Block):
            raise Decline("producer_not_dot", f"the scattered value is region argument #{value.arg_number}, computed "
                                              "outside this shard_map region, not a dot_general result")
        if owner.operation.name == "stablehlo.dot_general":
            break
        if is_elementwise(owner):  # a scale or a bias on each device's product, before the sum
            through = path_operand(owner, dim)
            sliced = through is None
            if sliced:  # a per-row factor or bias: each block of the product with that block of it
                through = _toward_a_dot(owner)
                if through is None and owner.operation.name == "stablehlo.add":
                    break  # a sum of products: the terms
                if through is None:
                    raise _several_vary(owner, dim)
            path.insert(0, elementwise_step(owner, through, dim, sliced=sliced))
            value = through
            continue
        if not is_layout_op(owner):
            raise not_blockwise(owner)
        in_dim = backward_dim(owner, dim, n)
        path.insert(0, LayoutStep(owner, in_dim, dim))
        value, dim = owner.operation.operands[0], in_dim
    adds: list[ir.OpView] = []
    dots = _sum_leaves(owner, adds, dim)
    terms = tuple(_term(dot, dim, anchor, info, ring) for dot in dots)
    return terms, tuple(adds), tuple(path)


def _toward_a_dot(op: ir.OpView) -> ir.Value | None:
    """The one operand of an elementwise ``op`` whose value comes, read by nothing else, from a
    dot_general through layout and elementwise ops (the product the ring computes block by
    block; the others are read per block); None unless exactly one does."""
    found = [v for v in op.operation.operands if _single_use_product(v, 0)]
    return found[0] if len(found) == 1 else None


def _single_use_product(value: ir.Value, depth: int) -> bool:
    if depth > 16 or isinstance(value.owner, ir.Block) or len(list(value.uses)) != 1:
        return False
    owner = value.owner
    if owner.operation.name == "stablehlo.dot_general":
        return True
    if is_layout_op(owner) or is_elementwise(owner):
        return any(_single_use_product(v, depth + 1) for v in owner.operation.operands)
    return False


def _sum_leaves(op: ir.OpView, adds: list[ir.OpView], dim: int) -> list[ir.OpView]:
    """The dots of a tree of single-use adds (or the dot itself); ``dim``: the scattered dim there."""
    if op.operation.name == "stablehlo.dot_general":
        return [op]
    if op.operation.name not in ("stablehlo.add", SHARDING_CONSTRAINT):
        raise not_blockwise(op)
    adds.append(op)  # an add of the tree, or a sharding constraint inside it: both go with the dots
    dots = []
    for value in op.operation.operands:
        _single_use(value)
        if isinstance(value.owner, ir.Block) or value.owner.operation.name not in (
                "stablehlo.dot_general", "stablehlo.add", SHARDING_CONSTRAINT):
            raise _added(op, value, dim)
        dots += _sum_leaves(value.owner, adds, dim)
    return dots


def _product_of(op: ir.OpView) -> ir.Value | None:
    """The dot_general result ``op`` is computed from, if one is (for saying what a value is)."""
    for result in op.operation.results:  # a loop's, a call's: several
        dot = causes.find_near(result, False, lambda o: o.operation.name == "stablehlo.dot_general")
        if dot is not None:  # the dot, or a call of a function holding one (its results: several)
            return dot.operation.results[0]
    return None


def _several_vary(op: ir.OpView, dim: int) -> Decline:
    """An elementwise op between the dot and the scatter with several operands that differ from
    block to block (a per-row factor, an activation's product with a function of the product)."""
    product = _product_of(op)
    what = "; ".join(causes.why_varies(v, dim, product, "the product") for v in op.operation.operands)
    return Decline("producer_not_dot", f"the scattered value comes from {describe_op(op)} of values that each differ "
                                       f"from block to block of the scattered dim {dim} ({what}): the ring applies an "
                                       "op to one block only when all but one of its operands are the same in every "
                                       "block (a scalar, a bias broadcast along the scattered dim)")


def _added(add: ir.OpView, value: ir.Value, dim: int) -> Decline:
    """A sum between the dot and the scatter that adds something other than dots."""
    what = causes.why_varies(value, dim, _product_of(add), "the product")
    varying = path_operand(add, dim)
    if varying is not None and varying != value:  # the other operand varies, this one is the same everywhere
        return Decline("producer_not_dot", f"{describe_op(add)} adds {what}, the same in every block, to one product "
                                           "of a sum of products: the ring adds such a value only after the whole sum")
    return Decline("producer_not_dot", f"the scattered value is {describe_op(add)} of the product and {what}, which "
                                       f"differs from block to block of the scattered dim {dim} (a bias or a residual "
                                       "along it): the ring adds per block only values the same in every block")


def not_blockwise(op: ir.OpView) -> Decline:
    """The scattered value comes from an op the ring cannot apply block by block."""
    product = _product_of(op)
    if product is None:
        return Decline("producer_not_dot", f"the scattered value comes from {describe_op(op)}, not from a "
                                           "stablehlo.dot_general")
    return Decline("producer_not_dot", f"the scattered value comes from {describe_op(op)}, which the ring cannot "
                                       f"apply block by block (only layout ops and elementwise ops do), of "
                                       f"{describe_op(product.owner)}")


def _term(dot: ir.OpView, dim: int, rs: ir.OpView, info: ModuleInfo, ring: Ring) -> Term:
    if dot.operation.block != rs.operation.block:
        raise Decline("other_block", "the dot is in a different block from the reduce_scatter")
    dims = DotDims.of(dot, info)
    role, index, operand_dim = dims.result_dim_source(dim)
    other_dim = dims.batch[1][dims.batch[0].index(operand_dim)] if role == "batch" else None
    term = Term(dot, dim, index, operand_dim, other_dim)
    for i, sliced_dim in term.sliced():
        producer = dot.operation.operands[i].owner
        if (
            not isinstance(producer, ir.Block)
            and producer.operation.name == "stablehlo.all_gather"
            and ir_utils.int_attr(producer, "all_gather_dim") == sliced_dim
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


def _single_use(value: ir.Value) -> None:
    uses = len(list(value.uses))
    if uses != 1:
        owner = value.owner
        what = "the dot result" if not isinstance(owner, ir.Block) and owner.operation.name == "stablehlo.dot_general" else "the scattered value"
        readers = ", ".join(describe_op(u) for u in ir_utils.users(value))
        raise Decline(
            "multiple_users",
            f"{what} has {uses} uses (read by {readers}); the full unscattered product is needed elsewhere",
        )


def _strip_constraints(value: ir.Value) -> ir.Value:
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
    total = _strip_constraints(returned[0])
    if isinstance(total.owner, ir.Block) or total.owner.operation.name != "stablehlo.add":
        return False
    a, b = (_strip_constraints(v) for v in total.owner.operation.operands)
    return (a == args[0] and b == args[1]) or (a == args[1] and b == args[0])
