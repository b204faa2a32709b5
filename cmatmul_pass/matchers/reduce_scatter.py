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
from ..layout import (
    ELEMENTWISE_OPS,
    LAYOUT_OPS,
    SCATTER,
    STEP_ELEMENTWISE,
    LayoutStep,
    backward_dim,
    elementwise_step,
    invariant_source,
    is_elementwise,
    is_layout_op,
    path_operand,
    scatter_window_dim,
)
from ..ring import Ring
from . import causes
from .common import (
    DeclinedSite,
    ManualRegion,
    ModuleInfo,
    collective_ring,
    describe_op,
    is_dot,
    replica_groups,
    static_tensor,
)
from .scatter_dag import Nonlinear, trace_dag
from .scatter_terms import (
    SHARDING_CONSTRAINT,
    LatestFirst,
    Term,
    dot_term,
    not_blockwise,
    product_of,
    region_is_sum,
)

DOT_REDUCE_SCATTER = "dot_reduce_scatter"


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
        terms, adds, path = trace_product(rs, operand, scatter_dim, info, ring, dag=True, assemble=True)
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
    for sum_op in [step.op for step in path if step.handed_over]:
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
    return tuple(sorted(found.values(), key=LatestFirst, reverse=True))


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


def first_dot(value: ir.Value) -> ir.OpView | None:
    """The dot_general ``value`` is computed from through layout and elementwise ops (and a split
    psum's ring: its loop, permutes, slices), if one is."""
    seen, stack = set(), [value]
    while stack and len(seen) < 2000:
        owner = stack.pop().owner
        if isinstance(owner, ir.Block) or owner.operation in seen:
            continue
        seen.add(owner.operation)
        name = owner.operation.name
        if is_dot(owner):
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
    dot = first_dot(owner.operation.operands[0])
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
    affine: bool = False, assemble: bool = False,
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
    ``affine``: the DAG may also add a value computed apart from the products (:func:`_linear`);
    ``assemble``: a reduce over other dims may be read beside the sum (:func:`trace_dag`)."""
    try:
        return _trace_chain(anchor, operand, dim, info, ring)
    except Decline as chain:
        if not dag or chain.code not in ("producer_not_dot", "multiple_users") or isinstance(chain, ScatterStep):
            raise
        try:
            return trace_dag(anchor, operand, dim, info, ring, chain, affine, assemble)
        except Nonlinear as nonlinear:
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
        if is_dot(owner):
            break
        if owner.operation.name in STEP_ELEMENTWISE:  # a scale, a bias or a mask on each
            # device's product, before the sum
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
        if owner.operation.name == SCATTER:  # a scatter-add along other dims (an un-permute into token order)
            path.insert(0, _scatter_step(owner, dim, anchor))
            value, dim = owner.operation.operands[2], path[0].in_dim
            continue
        if not is_layout_op(owner):
            raise not_blockwise(owner)
        in_dim = backward_dim(owner, dim, n)
        path.insert(0, LayoutStep(owner, in_dim, dim))
        value, dim = owner.operation.operands[0], in_dim
    adds: list[ir.OpView] = []
    dots = _sum_leaves(owner, adds, dim)
    terms = tuple(dot_term(dot, dim, anchor, info, ring) for dot in dots)
    return terms, tuple(adds), tuple(path)


def _scatter_step(op: ir.OpView, dim: int, anchor: ir.OpView) -> LayoutStep:
    """A scatter-add of the product (its updates) into a value the same in every block along
    ``dim``, along other dims than ``dim`` (:func:`~cmatmul_pass.layout.scatter_window_dim`), with
    indices there before the ring (built where ``anchor`` is): the step applying it per block; or
    Decline.  Each device scatters its own product before the sum, so any indices will do."""
    if not region_is_sum(op):
        raise ScatterStep(f"{describe_op(op)} combines the updates other than by a sum")
    try:
        into = invariant_source(op, op.operation.operands[0], dim)
    except Decline:
        raise ScatterStep(f"{describe_op(op)} scatters into a value that differs from block to block along dim "
                          f"{dim}") from None
    updates_dim = scatter_window_dim(op, dim)
    if updates_dim is None:
        raise ScatterStep(f"{describe_op(op)} addresses dim {dim}, the dim split over the ring, with its indices (or "
                          "its updates do not hold that dim whole): no block of the product gives a block of it")
    indices = op.operation.operands[1].owner
    if not isinstance(indices, ir.Block) and indices.operation.block == anchor.operation.block \
            and not indices.operation.is_before_in_block(anchor.operation):
        raise ScatterStep(f"{describe_op(op)} reads indices computed after {describe_op(anchor)}")
    return LayoutStep(op, updates_dim, dim, (into, None, None))


class ScatterStep(Decline):
    """A scatter on the product's way that the ring cannot apply per block (:func:`_scatter_step`):
    said as it is, no DAG tracing does better."""

    def __init__(self, message: str):
        super().__init__("producer_not_dot", message)


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
    if is_dot(owner):
        return True
    if is_layout_op(owner) or is_elementwise(owner):
        return any(_single_use_product(v, depth + 1) for v in owner.operation.operands)
    return False


def _sum_leaves(op: ir.OpView, adds: list[ir.OpView], dim: int) -> list[ir.OpView]:
    """The dots of a tree of single-use adds (or the dot itself); ``dim``: the scattered dim there."""
    if is_dot(op):
        return [op]
    if op.operation.name not in ("stablehlo.add", SHARDING_CONSTRAINT):
        raise not_blockwise(op)
    adds.append(op)  # an add of the tree, or a sharding constraint inside it: both go with the dots
    dots = []
    for value in op.operation.operands:
        _single_use(value)
        if isinstance(value.owner, ir.Block) or not (is_dot(value.owner) or value.owner.operation.name in (
                "stablehlo.add", SHARDING_CONSTRAINT)):
            raise _added(op, value, dim)
        dots += _sum_leaves(value.owner, adds, dim)
    return dots


def _several_vary(op: ir.OpView, dim: int) -> Decline:
    """An elementwise op between the dot and the scatter with several operands that differ from
    block to block (a per-row factor, an activation's product with a function of the product)."""
    product = product_of(op)
    what = "; ".join(causes.why_varies(v, dim, product, "the product") for v in op.operation.operands)
    return Decline("producer_not_dot", f"the scattered value comes from {describe_op(op)} of values that each differ "
                                       f"from block to block of the scattered dim {dim} ({what}): the ring applies an "
                                       "op to one block when all but one of its operands are computed apart from the "
                                       "product (a scale or a bias the same in every block, or one per row, read "
                                       "block by block)")


def _added(add: ir.OpView, value: ir.Value, dim: int) -> Decline:
    """A sum between the dot and the scatter that adds something other than dots."""
    what = causes.why_varies(value, dim, product_of(add), "the product")
    varying = path_operand(add, dim)
    if varying is not None and varying != value:  # the other operand varies, this one is the same everywhere
        return Decline("producer_not_dot", f"{describe_op(add)} adds {what}, the same in every block, to one product "
                                           "of a sum of products: the ring adds such a value only after the whole sum")
    return Decline("producer_not_dot", f"the scattered value is {describe_op(add)} of the product and {what}, which "
                                       f"differs from block to block of the scattered dim {dim} (a bias or a residual "
                                       "along it): the ring adds such a value only to the whole sum of products")


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
