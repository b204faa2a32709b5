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

import heapq
from dataclasses import dataclass


from .. import ir_utils
from .._jax_private import ir
from ..errors import Decline
from ..layout import (
    ELEMENTWISE_OPS, LAYOUT_OPS, ROW_OPS, LayoutStep, Sliced, backward_dim, elementwise_step, forward_dim, invariant_source, is_elementwise,
    is_layout_op, path_operand, row_dim,
)
from ..ring import Ring
from . import causes
from .common import (DeclinedSite, DotDims, ManualRegion, ModuleInfo, collective_ring, describe_op, replica_groups,
                     static_tensor)

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
    #: ops before the scatter that read a sum over the rows the ring computes (a gain's gradient,
    #: :attr:`LayoutStep.sums_rows`): moved after it, producers first, when it is rewritten
    moved: tuple[ir.OpView, ...] = ()

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
        terms, adds, path = trace_product(rs, operand, scatter_dim, info, ring, dag=True)
    except Decline as declined:
        raise _truer(declined, operand, scatter_dim, n, info) from None
    return ReduceScatterSite(rs, terms, adds, path, ring, region, scatter_dim, read_early(path, rs))


#: ops a sum's early reader may be (moved after the scatter): pure, no region of their own but a
#: reduction's
MOVABLE = frozenset({
    "stablehlo.constant", "stablehlo.reduce", "stablehlo.broadcast_in_dim", "stablehlo.all_reduce",
    "stablehlo.all_gather", "stablehlo.reduce_scatter", "stablehlo.concatenate", "stablehlo.slice",
    "stablehlo.dot_general", "stablehlo.select", "stablehlo.compare", "stablehlo.pad",
})


def read_early(path: tuple[LayoutStep, ...], rs: ir.OpView) -> tuple[ir.OpView, ...]:
    """The ops before ``rs`` that read (through each other) a sum the ring computes
    (:attr:`LayoutStep.sums_rows`), producers first; or Decline where one is no op the pass
    moves, or the path reads one."""
    block = rs.operation.block
    found: dict[ir.Operation, ir.OpView] = {}
    for sum_op in [step.op for step in path if step.sums_rows]:
        stack = [u.owner for u in sum_op.result.uses]
        while stack:
            op = ir_utils.ancestor_in(stack.pop(), block)
            if op is None or op in found or not op.is_before_in_block(rs.operation):
                continue
            if not (op.name in MOVABLE or op.name in LAYOUT_OPS or op.name in ELEMENTWISE_OPS):
                raise Decline("producer_not_dot", f"{describe_op(sum_op)}, a sum over the scattered rows of the "
                                                  f"product the ring computes, is read before the scatter by "
                                                  f"{describe_op(op.opview)}, which the pass does not move after it")
            found[op] = op.opview
            stack += [u.owner for r in op.results for u in r.uses]
    for step in path:
        for value in step.op.operation.operands:
            if not isinstance(value.owner, ir.Block) and value.owner.operation in found:
                raise Decline("producer_not_dot", f"{describe_op(step.op)} on the way from the dot to the scatter "
                                                  f"reads {describe_op(value.owner)}, computed from a sum over the "
                                                  "scattered rows of the product: the ring has it only when every "
                                                  "block is done")
    return tuple(sorted(found.values(), key=_Position, reverse=True))


def _truer(declined: Decline, operand: ir.Value, dim: int, n: int, info: ModuleInfo) -> Decline:
    """A ``producer_not_dot`` decline, or what is truer: the scattered value is a grouped
    matmul's, or a dot's in an earlier shard_map region (the program already keeps the scatter
    apart from its matmul)."""
    if declined.code != "producer_not_dot":
        return declined
    ragged = ragged_producer(operand, "the scattered value")
    if ragged is not None:
        return ragged
    source = _path_source(operand, dim, n)
    two_stage = _two_stage(source, operand, dim, n, info)
    if two_stage is not None:
        return two_stage
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


def _groups(op: ir.OpView, info: ModuleInfo) -> list[list[int]]:
    """``op``'s replica groups, in either form jax writes them (a dense list, or mesh axes from
    jax 0.11 on); :class:`Decline` where they cannot be read."""
    return replica_groups(op.attributes["replica_groups"], info).tolist()


def _permutes_ring(op: ir.OpView, groups: list[list[int]]) -> bool:
    """Do ``op``'s source-target pairs run one cycle through each of ``groups``?"""
    pairs = ir_utils.dense_ints(op.attributes["source_target_pairs"]).tolist()
    members = {tuple(sorted(g)) for g in groups}
    following = dict(map(tuple, pairs))
    cycles = set()
    for start in following:
        cycle, at = [start], following[start]
        while at != start and at in following and len(cycle) <= len(following):
            cycle.append(at)
            at = following[at]
        cycles.add(tuple(sorted(cycle)))
    return cycles == members


def _first_stage_sum(op: ir.OpView, info: ModuleInfo) -> tuple[list[list[int]], str] | None:
    """The devices ``op`` (the scattered value's source) already sums over, and how, when it is a
    sum across devices: a psum (an all_reduce of adds), or an all_gather of a value a ring of
    collective_permutes over the gather's own groups sums (a psum split into a reduce-scatter ring
    and that all_gather, as the pass splits one)."""
    name = op.operation.name
    if name == "stablehlo.all_reduce" and region_is_sum(op):
        return _groups(op, info), f"{describe_op(op)} (a psum)"
    if name == "stablehlo.concatenate":  # a psum in row chunks, each chunk's own all_reduce
        parts = [v.owner for v in op.operation.operands]
        if all(not isinstance(p, ir.Block) and p.operation.name == "stablehlo.all_reduce" and region_is_sum(p)
               for p in parts) and all(p.attributes["replica_groups"] == parts[0].attributes["replica_groups"]
                                       for p in parts):  # one group attribute (attributes are uniqued)
            return _groups(parts[0], info), (f"{describe_op(op)} of {len(parts)} all_reduces (a psum in row chunks, as "
                                       "the pass chunks one)")
        return None
    if name != "stablehlo.all_gather":
        return None
    groups = _groups(op, info)
    seen, stack = set(), [op.operation.operands[0]]
    while stack and len(seen) < 2000:
        owner = stack.pop().owner
        if isinstance(owner, ir.Block) or owner.operation in seen:
            continue
        seen.add(owner.operation)
        if owner.operation.name == "stablehlo.collective_permute" and _permutes_ring(owner, groups) and any(
                u.operation.name == "stablehlo.add" for u in ir_utils.users(owner.result)):  # a partial sum passed on
            return groups, (f"{describe_op(op)}, the all_gather of a sum a ring of collective_permutes takes over its "
                            "devices (a psum split into a reduce-scatter ring and an all_gather, as the pass splits "
                            "one)")
        for region in owner.operation.regions:  # a ring's loop: its body's permutes
            for block in region.blocks:
                stack.extend(o.result for o in block.operations if len(o.results) == 1)
        if owner.operation.name not in ("stablehlo.all_reduce", "stablehlo.all_gather", "stablehlo.reduce_scatter",
                                        "stablehlo.dot_general"):  # the sum's own ops, not what its dots read
            stack.extend(owner.operation.operands)
    return None


def _first_dot(value: ir.Value) -> ir.OpView | None:
    """The dot_general ``value`` is computed from through layout and elementwise ops (and a split
    psum's ring: its loop, permutes, slices), if one is."""
    seen, stack = set(), [value]
    while stack and len(seen) < 2000:
        owner = stack.pop().owner
        if isinstance(owner, ir.Block) or owner.operation in seen:
            continue
        seen.add(owner.operation)
        name = owner.operation.name
        if name == "stablehlo.dot_general":
            return owner
        if is_layout_op(owner) or is_elementwise(owner) or name in (
                "stablehlo.collective_permute", "stablehlo.optimization_barrier", "stablehlo.dynamic_slice",
                "stablehlo.concatenate", "stablehlo.while", "stablehlo.all_gather", "stablehlo.all_reduce"):
            stack.extend(owner.operation.operands)
            for region in owner.operation.regions if name == "stablehlo.while" else ():
                for block in region.blocks:
                    stack.extend(o.result for o in block.operations if len(o.results) == 1)
    return None


def _two_stage(source: ir.Value, operand: ir.Value, dim: int, n: int, info: ModuleInfo) -> Decline | None:
    """A scatter of a value already summed across other devices (``psum_scatter`` over one mesh
    axis of a ``psum`` over another: a reduction in two stages), said as such, with what would be
    one ring: one psum_scatter over both axes of the product, where its dim divides."""
    owner = source.owner
    if isinstance(owner, ir.Block):
        return None
    try:
        first = _first_stage_sum(owner, info)
        if first is None:
            return None
        groups, how = first
        rs = next(iter(ir_utils.users(operand)), None)  # the reduce_scatter, for its groups
        scatter_groups = _groups(rs, info) if rs is not None and rs.operation.name == "stablehlo.reduce_scatter" else None
    except Decline:  # groups the pass cannot read: no truer account than the decline's own
        return None
    if scatter_groups is not None and {tuple(sorted(g)) for g in groups} == {tuple(sorted(g)) for g in scatter_groups}:
        return Decline("producer_not_dot", f"the scattered value is already summed over the same devices: {how} sums "
                                           f"it over {groups} before this reduce_scatter sums it over them again; "
                                           "the ring takes a dot's product, not the result of another collective")
    total = n * len(groups[0])
    said = (f"the scattered value is already summed across devices: {how} sums it over {groups} before this "
            f"reduce_scatter sums it over {scatter_groups}, so it is reduced in two stages over two mesh axes, and "
            "the ring takes a dot's product, not the result of another collective")
    dot = _first_dot(owner.operation.operands[0])
    width = ir_utils.ranked_tensor(operand).shape[dim]
    if dot is None:
        stop = owner.operation.operands[0].owner
        what = "region arguments" if isinstance(stop, ir.Block) else describe_op(stop)
        said += f"; the first stage sums {what}, not a matmul's product, so no ring applies to either stage"
    elif width % total:
        said += (f"; one psum_scatter over both axes at once of the product of {describe_op(dot)} would be one ring "
                 f"over all {total} devices if the scattered dim ({width}) were a multiple of {total}")
    else:
        said += (f"; one psum_scatter over both axes at once (a tuple of axis names) of the product of "
                 f"{describe_op(dot)} would be one ring over all {total} devices (its rows then split {total} ways; "
                 "an all_gather over the first axis gives back this layout where it is needed)")
    return Decline("producer_not_dot", said)


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
    anchor: ir.OpView, operand: ir.Value, dim: int, info: ModuleInfo, ring: Ring, dag: bool = False,
    affine: bool = False,
) -> tuple[tuple[Term, ...], tuple[ir.OpView, ...], tuple[LayoutStep, ...]]:
    """The dots whose (summed) product a sum-collective ``anchor`` reduces, split into the ring's
    blocks along ``dim`` of ``operand``: (terms, the sum's adds root first, the path from the
    sum to ``operand``); or :class:`Decline`.  Every value on the way has ``anchor`` as its one
    reader, and every block of ``operand`` along ``dim`` is the same ops applied to one block of
    a dot operand's free (or paired batch) dim.

    With ``dag``, where the ops from the dots to ``operand`` are no chain (a norm's backward
    reads the product twice), they are traced as a DAG (:func:`trace_dag`): then ``adds`` is
    empty, ``path`` holds every op computed from the products, producers first, and a step may
    read several earlier steps' results (:func:`~cmatmul_pass.layout.apply_dag` applies it);
    ``affine``: the DAG may also add a value computed apart from the products (:func:`_linear`)."""
    try:
        return _trace_chain(anchor, operand, dim, info, ring)
    except Decline as chain:
        if not dag or chain.code not in ("producer_not_dot", "multiple_users"):
            raise
        try:
            return trace_dag(anchor, operand, dim, info, ring, chain, affine)
        except _Nonlinear as nonlinear:
            if chain.code != "producer_not_dot":
                raise Decline("producer_not_dot", nonlinear.message) from None
            # the chain's decline names the op that reads the product with another value computed from it
            raise Decline("producer_not_dot", f"{chain.message}; nor are the ops from the dot to the scatter linear "
                                              "in the product, as a norm's backward is, which the ring applies "
                                              f"block by block ({describe_op(nonlinear.op)} is not)") from None


def _trace_chain(
    anchor: ir.OpView, operand: ir.Value, dim: int, info: ModuleInfo, ring: Ring
) -> tuple[tuple[Term, ...], tuple[ir.OpView, ...], tuple[LayoutStep, ...]]:
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


class _Position:
    """An op ordered by its place in its block (for a heap: the latest first)."""

    __slots__ = ("op",)

    def __init__(self, op: ir.OpView):
        self.op = op

    def __lt__(self, other: "_Position") -> bool:
        return other.op.operation.is_before_in_block(self.op.operation)


class _Nonlinear(Decline):
    """The DAG holds an op that is not linear in the product; ``detail``: which, in a few words."""

    def __init__(self, op: ir.OpView, detail: str):
        self.op = op
        super().__init__("producer_not_dot", f"the scattered value comes from {detail}: the ring applies a DAG of ops "
                                             "between the dot and the scatter per block only where it is linear in "
                                             "the product (a norm's backward, which reads the product twice)")


def trace_dag(
    anchor: ir.OpView, operand: ir.Value, dim: int, info: ModuleInfo, ring: Ring, chain: Decline,
    affine: bool = False,
) -> tuple[tuple[Term, ...], tuple[ir.OpView, ...], tuple[LayoutStep, ...]]:
    """The ops from the dots to ``operand`` as a DAG (a norm's backward applied to the cotangent:
    ``dx = rs*g*dy - x*rs^3/n * sum_j(g*dy*x)``, the product read twice).  Valid block by block
    when every op computed from a product (the *path*) works row by row along the ring dim — an
    elementwise op, a layout op, a reduce over other dims, a broadcast_in_dim taking the ring dim
    from its operand — its other operands read at the block's rows (or the same in every block):
    then block ``b`` of the scattered value on each device is the path applied to block ``b`` of
    each product.  The pass also asks that the path be linear in the products (a backward pass's
    shape): adds of two path values, a path value scaled (multiplied, divided) by another value,
    a negation, a sum over other dims from zero.

    The path is the ops of the *cone* (those whose every result is read, in the end, only by
    ``operand``) computed from a dot of the cone, and the *branches*: ops computed from a path
    value that lead only to sums over the ring dim from zero (a norm gain's gradient,
    ``sum_i(x_i*rs_i*dy_i)`` over the rows), each a step that :attr:`~LayoutStep.sums_rows` (the
    ring adds up its blocks' shares).  ``chain``: the chain tracer's decline, raised where the
    DAG is no better (no dot in the cone; a nonlinear op, which ``chain`` names).  ``affine``:
    an add of a path value and a value computed apart from the product is taken (:func:`_linear`)."""
    n = ring.size
    root = operand.owner
    block = anchor.operation.block
    if isinstance(root, ir.Block) or len(list(operand.uses)) != 1 or root.operation.block != block:
        raise chain

    reach = _cone(root, block, None)  # every op back from the scatter through the ops a product may pass
    branches: dict[ir.Operation, ir.OpView] = {}  # path ops that lead only to sums over the rows
    while True:
        cone = _cone(root, block, set(branches) | {anchor.operation})
        ops = {**cone, **branches}
        path_ops = _from_dots(ops)  # the ops computed from one of the cone's dots, producers first
        if root.operation in path_ops:
            inside = ops
            read = path_ops
        else:  # a value on the way from a dot is read elsewhere too: by a branch (a gain's gradient), or Decline
            inside = {**reach, **branches}
            read = _from_dots(inside)
        outside = [(op, u.owner) for op in read.values() if not _sums_away(op, branches, cone)
                   for r in op.operation.results for u in r.uses
                   if u.owner.operation not in inside and u.owner.operation != anchor.operation]
        if not outside:
            if root.operation not in path_ops:
                raise _escaped(root, cone, block, anchor, branches) or chain
            break
        for op, reader in outside:  # a value of the path read apart from the scatter: a branch, or Decline
            _branch(op, reader, block, inside, branches, anchor)

    def on_path(value: ir.Value) -> bool:
        return not isinstance(value.owner, ir.Block) and value.owner.operation in path_ops

    for op in path_ops.values():
        _static(op)
        for value in op.operation.operands:  # a sum over the rows is the ring's only when every block is done
            if on_path(value) and _sums_away(value.owner, branches, cone):
                raise Decline("producer_not_dot", f"{describe_op(op)}, computed from the product, reads "
                                                  f"{describe_op(value.owner)}, a sum over the scattered rows of the "
                                                  "product: the ring has that sum only when every block is done")

    # the ring dim of every path value: from the scattered value back to the dots, then forward
    # from the path into the branches
    dims: dict[ir.Value, int] = {operand: dim}
    steps: dict[ir.Operation, LayoutStep] = {}
    terms: list[Term] = []
    for op in reversed(list(path_ops.values())):
        if op.operation not in cone:
            continue
        out_dim = dims[op.result]
        _cut(op, out_dim, n)
        name = op.operation.name
        if name == "stablehlo.dot_general":
            read = [v for v in op.operation.operands if on_path(v)]
            if read:
                raise Decline("producer_not_dot", f"{describe_op(op)} multiplies a value computed from another "
                                                  f"product ({describe_op(read[0].owner)}) on the way to the "
                                                  "scatter: the ring computes one dot's block from its operands")
            terms.append(_term(op, out_dim, anchor, info, ring))
            continue
        if is_layout_op(op):
            in_dims = {op.operation.operands[0]: backward_dim(op, out_dim, n)}
            step = LayoutStep(op, in_dims[op.operation.operands[0]], out_dim)
        elif name in ROW_OPS:
            step = _row_step(op, out_dim, on_path)
            in_dims = {op.operation.operands[0]: step.in_dim}
        elif is_elementwise(op):
            _linear(op, on_path, affine)
            in_dims = {v: out_dim for v in op.operation.operands if on_path(v)}
            step = _elementwise(op, out_dim, on_path)
        else:
            raise not_blockwise(op)
        for value, in_dim in in_dims.items():
            _agree(dims, value, in_dim, op)
        steps[op.operation] = step
    for op in path_ops.values():
        if op.operation not in cone:
            steps[op.operation] = _branch_step(op, dims, on_path, branches, n, affine)
    for op in path_ops.values():  # what the ring reads beside the path: there before it
        for value in op.operation.operands:
            if not on_path(value):
                _read_beside(value, op, anchor)
    ordered = [steps[op] for op in path_ops if op in steps]
    return tuple(reversed(terms)), (), tuple(ordered)


def _from_dots(ops: dict) -> dict[ir.Operation, ir.OpView]:
    """The ``ops`` that are dots or computed from one of them through ``ops``, producers first."""
    found: dict[ir.Operation, ir.OpView] = {}
    for op in sorted(ops.values(), key=_Position, reverse=True):
        if op.operation.name == "stablehlo.dot_general" or any(
                not isinstance(v.owner, ir.Block) and v.owner.operation in found for v in op.operation.operands):
            found[op.operation] = op
    return found


def _cone(root: ir.OpView, block: ir.Block, inside: set | None) -> dict[ir.Operation, ir.OpView]:
    """The ops whose every result is read only by ``root``'s cone or ``inside`` (``root`` first),
    found from ``root`` back through the ops a product may pass, latest first; a dot's operands
    are not followed (the ring slices them), nor any other op's (read as a whole value).
    ``inside`` None: every op found that way, whoever reads it."""
    cone: dict[ir.Operation, ir.OpView] = {}
    heap, queued = [_Position(root)], {root.operation}
    while heap:
        op = heapq.heappop(heap).op
        if inside is not None and op.operation != root.operation and not all(
                u.owner.operation in cone or u.owner.operation in inside for r in op.operation.results for u in r.uses):
            continue
        cone[op.operation] = op
        if op.operation.name == "stablehlo.dot_general" or not _passes(op):
            continue
        for value in op.operation.operands:
            owner = value.owner
            if not isinstance(owner, ir.Block) and owner.operation not in queued and owner.operation.block == block:
                queued.add(owner.operation)
                heapq.heappush(heap, _Position(owner))
    return cone


def _sums_away(op: ir.OpView, branches: dict, cone: dict) -> bool:
    """Is ``op`` a branch's sum (its result read by anything: the ring hands it the whole sum)?"""
    return op.operation in branches and op.operation not in cone and op.operation.name == "stablehlo.reduce"


def _branch(start: ir.OpView, reader: ir.OpView, block: ir.Block, ops: dict, branches: dict,
            anchor: ir.OpView) -> None:
    """Add to ``branches`` the ops from ``reader`` (which reads ``start``'s value, a path value,
    apart from the scatter) forward to the reduces they end in, or Decline: every op on the way
    a product may pass (layout, elementwise, broadcast), every value read only on the way."""
    stack = [reader]
    while stack:
        op = stack.pop()
        if op.operation in ops or op.operation in branches or op.operation == anchor.operation:
            continue
        if op.operation.block != block or not (_passes(op) or op.operation.name == "stablehlo.reduce"):
            what = (f"the product of {describe_op(start)}" if start.operation.name == "stablehlo.dot_general" else
                    f"{describe_op(start)}, computed from the product,")
            raise Decline("multiple_users", f"{what} is also read, through {describe_op(reader)}, by "
                                            f"{describe_op(op)}, outside the ops that feed the scatter (and no sum "
                                            "over the scattered rows, which the ring would add up block by block): "
                                            "the full unscattered product is needed elsewhere")
        branches[op.operation] = op
        if op.operation.name == "stablehlo.reduce":
            continue  # a sum over the rows (checked with the dims): its result is read by anything
        stack += [u.owner for r in op.operation.results for u in r.uses]


def _branch_step(op: ir.OpView, dims: dict, on_path, branches: dict, n: int, affine: bool = False) -> LayoutStep:
    """The step of a branch op, its ring dim taken forward from its path operands' (producers
    come first); a reduce must sum the ring dim away, from zero."""
    read = [v for v in op.operation.operands if on_path(v)]
    in_dims = {dims.get(v) for v in read}
    if None in in_dims or len(in_dims) != 1:
        raise Decline("producer_not_dot", f"{describe_op(op)} reads values computed from the product with the "
                                          "scattered rows along different dims: no block of it is a block of each")
    (in_dim,) = in_dims
    name = op.operation.name
    if name == "stablehlo.reduce":
        reduced = set(ir_utils.i64s(op, "dimensions"))
        if in_dim not in reduced:
            raise Decline("multiple_users", f"{describe_op(op)} sums a value computed from the product over other "
                                            f"dims than the scattered dim {in_dim}, outside the ops that feed the "
                                            "scatter: its rows are needed whole elsewhere")
        try:
            _sum_from_zero(op, on_path)
        except _Nonlinear:
            raise Decline("multiple_users", f"a value computed from the product is also read by {describe_op(op)}, "
                                            "outside the ops that feed the scatter, which reduces it over the "
                                            f"scattered dim {in_dim} other than by a sum from zero (a sum the ring "
                                            "would add up block by block): the full unscattered product is needed "
                                            "elsewhere") from None
        return LayoutStep(op, in_dim, None, (None, op.operation.operands[1].owner))
    if is_layout_op(op):
        out_dim = forward_dim(op, in_dim, n)
        step = LayoutStep(op, in_dim, out_dim)
    elif name == "stablehlo.broadcast_in_dim":
        out_dim = ir_utils.i64s(op, "broadcast_dimensions")[in_dim]
        if row_dim(op, out_dim) != in_dim:
            raise Decline("producer_not_dot", f"{describe_op(op)} spreads a value computed from the product: no "
                                              "block of it is a block of its operand")
        step = LayoutStep(op, in_dim, out_dim)
    else:
        _linear(op, on_path, affine)
        out_dim = in_dim
        step = _elementwise(op, out_dim, on_path)
    dims[op.result] = out_dim
    _cut(op, out_dim, n)
    return step


def _read_beside(value: ir.Value, op: ir.OpView, anchor: ir.OpView) -> None:
    """Decline where the ring (built where the scatter is) could not read ``value``, an operand of
    the path op ``op`` that is not on the path: defined after the scatter (a constant is rebuilt)."""
    owner = value.owner
    if isinstance(owner, ir.Block) or owner.operation.block != anchor.operation.block:
        return  # an argument, or a value of an enclosing block: there before the ring
    if owner.operation.name == "stablehlo.constant":
        return  # rebuilt where the ring reads it
    if not owner.operation.is_before_in_block(anchor.operation):
        raise Decline("producer_not_dot", f"{describe_op(op)}, computed from the product, reads "
                                          f"{describe_op(owner)}, which comes after the scatter: the ring, built "
                                          "where the scatter is, cannot read it")


def _static(op: ir.OpView) -> None:
    """Decline an op of the path with other than one result, or with a value not statically shaped."""
    results = list(op.operation.results)
    if len(results) != 1:
        raise Decline("producer_not_dot", f"{describe_op(op)}, computed from the product, has {len(results)} results "
                                          "(a variadic reduce): the ring applies ops of one result per block")
    for value in [*op.operation.operands, *results]:
        t = ir_utils.ranked_tensor(value)
        if t is None or not ir_utils.is_static(t):
            raise Decline("dynamic_shape", f"{describe_op(op)} between the dot and the scatter is dynamically shaped")


def _cut(op: ir.OpView, out_dim: int, n: int) -> None:
    """Decline unless ``op``'s result is static and its ring dim cuts into ``n`` blocks."""
    result_t = ir_utils.ranked_tensor(op.result)
    if result_t is None or not ir_utils.is_static(result_t):
        raise Decline("dynamic_shape", f"{describe_op(op)} between the dot and the scatter is dynamically shaped")
    size = result_t.shape[out_dim]
    if size % n or size < n:
        raise Decline("layout", f"{describe_op(op)} on the way from the dot to the scatter: its dim {out_dim} "
                                f"({size}), the scattered rows, cannot be cut in {n} blocks")


def _agree(dims: dict, value: ir.Value, in_dim: int, op: ir.OpView) -> None:
    if dims.setdefault(value, in_dim) != in_dim:
        raise Decline("producer_not_dot", f"{describe_op(value.owner)} is read with the scattered rows along its dim "
                                          f"{dims[value]} by one op and along dim {in_dim} by {describe_op(op)}: no "
                                          "block of it is a block of both")


def _elementwise(op: ir.OpView, dim: int, on_path) -> LayoutStep:
    return LayoutStep(op, dim, dim, tuple(_source(op, v, dim, on_path) for v in op.operation.operands))


#: how far back :func:`_escaped` looks for the dot behind an op the ring cannot apply
_LOOK_BACK = 256


def _escaped(root: ir.OpView, cone: dict, block: ir.Block, anchor: ir.OpView, branches: dict) -> Decline | None:
    """Why no dot is in the cone of ``root``: an op computed from a product on the way to the
    scatter that the ring cannot apply block by block (the latest, nearest the scatter); else the
    latest value on the way from a dot that something outside the cone reads too; None where no
    dot reaches the scatter (through any ops of this block but collectives)."""
    seen: dict[ir.Operation, ir.OpView] = {}
    stack = [root]
    while stack and len(seen) < _LOOK_BACK:
        op = stack.pop()
        if op.operation in seen:
            continue
        seen[op.operation] = op
        if op.operation.name != "stablehlo.dot_general" and op.operation.name not in _COLLECTIVES:
            stack += [v.owner for v in op.operation.operands
                      if not isinstance(v.owner, ir.Block) and v.owner.operation.block == block]
    from_dot = _from_dots({**seen, **branches})
    if not from_dot:
        return None
    dot = next(iter(from_dot.values()))
    blocking = [op for op in from_dot.values() if op.operation.name != "stablehlo.dot_general"
                and not _passes(op) and op.operation not in branches]
    if blocking:
        op = blocking[-1]
        return Decline("producer_not_dot", f"the scattered value is computed from the product of {describe_op(dot)} "
                                           f"through {_described(op)}, which the ring cannot apply block by block "
                                           "(it applies layout and elementwise ops, sums over other dims and "
                                           "broadcasts back over the rows)")
    inside = set(cone) | set(branches) | {anchor.operation}
    read_outside = [(op, [u.owner for r in op.operation.results for u in r.uses if u.owner.operation not in inside])
                    for op in from_dot.values()]
    read_outside = [(op, outside) for op, outside in read_outside if outside]
    if not read_outside:
        return None
    op, outside = read_outside[-1]
    readers = ", ".join(dict.fromkeys(describe_op(u) for u in outside))
    what = f"the product of {describe_op(op)}" if op.operation.name == "stablehlo.dot_general" else \
        f"{describe_op(op)}, computed from the product of {describe_op(dot)},"
    return Decline("multiple_users", f"{what} is also read by {readers}, outside the ops that feed the scatter: the "
                                     "full unscattered product is needed elsewhere (the ring computes it one block "
                                     "at a time)")


def _described(op: ir.OpView) -> str:
    """``op`` in words; a call with its function and the ops in it that do the work."""
    if op.operation.name != "func.call":
        return describe_op(op)
    inner = causes.callee_work(op)
    callee = ir.FlatSymbolRefAttr(op.attributes["callee"]).value
    return f"{describe_op(op)} (@{callee}" + (f", {', '.join(inner)} inside)" if inner else ")")


_COLLECTIVES = frozenset(f"stablehlo.{name}" for name in (
    "all_gather", "all_reduce", "reduce_scatter", "all_to_all", "collective_permute", "collective_broadcast"))


def _passes(op: ir.OpView) -> bool:
    """Can a product pass ``op`` on its way to the scatter (in a DAG)?"""
    return is_layout_op(op) or is_elementwise(op) or op.operation.name in ROW_OPS


def _source(op: ir.OpView, value: ir.Value, dim: int, on_path) -> ir.OpView | Sliced | None:
    """How a DAG step reads an operand: None, on the path; the op of a value the same in every
    block (rebuilt at block size); else that block of it (:class:`Sliced`)."""
    if on_path(value):
        return None
    try:
        return invariant_source(op, value, dim)
    except Decline:
        return Sliced(value)


def _row_step(op: ir.OpView, out_dim: int, on_path) -> LayoutStep:
    """A reduce over dims other than the scattered one, or a broadcast_in_dim taking it from its
    operand: a step of the DAG, or Decline."""
    in_dim = row_dim(op, out_dim)
    if in_dim is None:
        raise Decline("producer_not_dot", f"{describe_op(op)} spreads a value computed from the product along the "
                                          f"scattered dim {out_dim} (one value for many rows: the rows were summed "
                                          "before it), which no single block of the product gives")
    if op.operation.name == "stablehlo.broadcast_in_dim":
        return LayoutStep(op, in_dim, out_dim)
    _sum_from_zero(op, on_path)
    return LayoutStep(op, in_dim, out_dim, (None, op.operation.operands[1].owner))


def _sum_from_zero(op: ir.OpView, on_path) -> None:
    """Decline (:class:`_Nonlinear`) a reduce that is not one sum from a zero constant."""
    operands = list(op.operation.operands)
    if len(operands) != 2:
        raise Decline("producer_not_dot", f"{describe_op(op)} reduces {len(operands) // 2} values at once (a "
                                          "variadic reduce) on the way from the dot to the scatter")
    init = operands[1]
    zero = False
    if not on_path(init) and not isinstance(init.owner, ir.Block) and init.owner.operation.name == "stablehlo.constant":
        value = ir.DenseElementsAttr(init.owner.attributes["value"])
        zero = value.is_splat and _is_zero(value.get_splat_value())
    if not zero or not region_is_sum(op):
        raise _Nonlinear(op, f"{describe_op(op)}, which is not a sum from zero, so not linear in the product")


def _is_zero(attr: ir.Attribute) -> bool:
    """Is ``attr`` a float or integer zero (any width: bf16, fp8 too)?"""
    for kind in (ir.FloatAttr, ir.IntegerAttr):
        try:
            return kind(attr).value == 0
        except (ValueError, TypeError):
            continue
    return False  # a complex value, or another kind of element


def _linear(op: ir.OpView, on_path, affine: bool = False) -> None:
    """Decline (:class:`_Nonlinear`) an elementwise DAG step that is not linear in its path operands;
    with ``affine``, an add (subtract) of a path value and a value computed apart from the product
    is taken too (a residual's cotangent added to a norm's backward: a psum's operand in the
    backward of ``x + psum(f(norm(x)))`` under ``check_vma=False``), read at the block's rows
    as a chain reads a residual: each device adds its own before the sum."""
    read = [on_path(v) for v in op.operation.operands]
    name = op.operation.name
    if name in ("stablehlo.add", "stablehlo.subtract") and (all(read) or affine):
        return
    if name == "stablehlo.multiply" and read.count(True) == 1:
        return
    if name == "stablehlo.divide" and read == [True, False]:
        return
    if name == "stablehlo.negate":
        return
    product = _product_of(op)
    what = " and ".join(causes.why_varies(v, -1, product, "the product") if on or product is None
                        else _side(v) for v, on in zip(op.operation.operands, read))
    raise _Nonlinear(op, f"{describe_op(op)} of {what}, not linear in the product")


def _side(value: ir.Value) -> str:
    """A value computed apart from the product, in words."""
    owner = value.owner
    return f"region argument #{value.arg_number}" if isinstance(owner, ir.Block) else describe_op(owner)


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
                                       "op to one block when all but one of its operands are computed apart from the "
                                       "product (a scale or a bias the same in every block, or one per row, read "
                                       "block by block)")


def _added(add: ir.OpView, value: ir.Value, dim: int) -> Decline:
    """A sum between the dot and the scatter that adds something other than dots."""
    what = causes.why_varies(value, dim, _product_of(add), "the product")
    varying = path_operand(add, dim)
    if varying is not None and varying != value:  # the other operand varies, this one is the same everywhere
        return Decline("producer_not_dot", f"{describe_op(add)} adds {what}, the same in every block, to one product "
                                           "of a sum of products: the ring adds such a value only after the whole sum")
    return Decline("producer_not_dot", f"the scattered value is {describe_op(add)} of the product and {what}, which "
                                       f"differs from block to block of the scattered dim {dim} (a bias or a residual "
                                       "along it): the ring adds such a value only to the whole sum of products")


def not_blockwise(op: ir.OpView) -> Decline:
    """The scattered value comes from an op the ring cannot apply block by block."""
    if op.operation.name == "stablehlo.while":  # a loop's carry: the dot computing it is in the body
        return Decline("producer_not_dot", f"the scattered value is a result of {describe_op(op)}, a loop's carry "
                                           "(a scan's input gradient, say): the dot computing it runs in the loop's "
                                           "body, trip by trip, so the collective can run only after the last trip "
                                           "and has no dot beside it to split")
    product = _product_of(op)
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
