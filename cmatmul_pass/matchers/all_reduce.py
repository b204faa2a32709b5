"""``dot_general`` (or a sum of them) feeding a sum ``all_reduce``: Megatron's row-parallel matmul.

``%y = all_reduce(sum)(path(d1 + d2 + ...))`` — ``jax.lax.psum(h @ w2, 'model')`` — is
``all_gather(reduce_scatter(...))`` along any dim ``D`` of ``%y`` whose size the group
size divides.  The pass picks a ``D`` along which one block of the product is the dot
of one block of an operand (a free dim, as a reduce_scatter ring needs: the same look-
through as :mod:`.reduce_scatter`), preferring the rows of the activation operand (the
operand that is not a shard_map argument: the weight is), the dim sequence parallelism
shards.  The site record says which; the rewrite (:mod:`cmatmul_pass.rewrites.dot_all_reduce`)
then splits the all_reduce there or chunks the dot along it.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import ir_utils
from .._jax_private import ir
from ..errors import Decline
from ..layout import ROW_OPS, SCATTER, LayoutStep, is_elementwise, is_layout_op
from ..ring import Ring
from .common import DeclinedSite, ManualRegion, ModuleInfo, collective_ring, describe_op, is_dot, static_tensor
from .reduce_scatter import Term, not_blockwise, ragged_producer, read_early, region_is_sum, trace_product

DOT_ALL_REDUCE = "dot_all_reduce"
#: declines that do not depend on the dim tried (the product has other readers, is no dot, ...)
STRUCTURAL = frozenset({"multiple_users", "other_block", "dynamic_shape"})


@dataclass(frozen=True, eq=False)
class AllReduceSite:
    """``all_reduce(path(d1 + d2 + ...))`` reducible block by block along ``dim`` of its result:
    ``terms``, ``adds``, ``path`` (a chain, or a DAG: a norm's backward) and ``moved`` as a
    :class:`.reduce_scatter.ReduceScatterSite`'s."""

    all_reduce: ir.OpView
    terms: tuple[Term, ...]
    adds: tuple[ir.OpView, ...]
    path: tuple[LayoutStep, ...]
    ring: Ring
    region: ManualRegion
    dim: int
    #: ops before the all_reduce that read a sum over the rows computed from the product (a
    #: norm gain's gradient, :attr:`LayoutStep.sums_rows`), producers first: the rewrite moves
    #: them after the all_reduce's place, where the sum is whole
    moved: tuple[ir.OpView, ...] = ()

    kind = DOT_ALL_REDUCE

    @property
    def anchor(self) -> ir.OpView:
        return self.all_reduce

    @property
    def block_type(self) -> ir.RankedTensorType:
        """One device's block of the result along :attr:`dim` (what a reduce_scatter would return)."""
        t = ir.RankedTensorType(self.all_reduce.result.type)
        with self.all_reduce.location:  # callable outside the pass's own context managers
            return ir_utils.with_dim(t, self.dim, t.shape[self.dim] // self.ring.size)


def all_reduces(module: ir.Module) -> list[ir.OpView]:
    return ir_utils.ops_named(module, "stablehlo.all_reduce")["stablehlo.all_reduce"]


def find_dot_all_reduce(module: ir.Module, info: ModuleInfo | None = None) -> list[AllReduceSite | DeclinedSite]:
    info = info or ModuleInfo.of(module)
    return [match_all_reduce(op, info) for op in all_reduces(module)]


def match_all_reduce(op: ir.OpView, info: ModuleInfo) -> AllReduceSite | DeclinedSite:
    ring = None
    try:
        ring, region = collective_ring(op, info)
        return _match(op, ring, region, info)
    except Decline as d:
        return DeclinedSite(DOT_ALL_REDUCE, op, d.code, d.message, ring)


def _match(ar: ir.OpView, ring: Ring, region: ManualRegion, info: ModuleInfo) -> AllReduceSite:
    if not region_is_sum(ar):
        raise Decline("not_sum", "the all_reduce's reduction is not a sum (stablehlo.add of its two arguments)")
    chunks = _chunks_of(ar)
    if chunks:
        raise Decline("chunked", f"the all_reduce is one of {chunks} sums whose results are concatenated (a psum "
                                 "already in row chunks: the chunk strategy's output, or chunked by hand): each "
                                 "chunk's all_reduce already overlaps the next chunk's dot")
    operand = ar.operation.operands[0]
    shape = list(static_tensor(operand, "the all_reduce operand").shape)
    try:
        return _match_sum(ar, operand, shape, ring, region, info)
    except Decline as declined:
        # a psum of a sum over the rows (a norm gain's gradient) whose product has other readers
        # (the psum of the rows beside it, or the ring or chunks that psum became, which then
        # compute the product: the decline's words depended on which): say what it sums
        summed = _row_sum(operand) if shape and declined.code in ("multiple_users", "producer_not_dot") else None
        if not summed:
            raise
        reduce, dims, _ = summed
        in_ring = reduce.operation.parent.name == "stablehlo.while"
        if declined.code == "producer_not_dot" and not in_ring:  # no dot at all, or a map the ring cannot apply
            raise
        raise Decline("producer_not_dot", (
            f"the summed value is a sum over rows, not a matmul's rows: {describe_op(reduce)} sums dim"
            f"{'s' if len(dims) > 1 else ''} {', '.join(map(str, dims))} of a value computed from the rows (a norm "
            "gain's gradient, say), so no block of the rows gives a block of it, only a partial sum of all of it; "
            "and what it is computed from is also read outside this sum, so it is not split along its own dims "
            f"either: it stays a psum (of {'x'.join(map(str, shape))} elements per device)")) from None


def _chunks_of(ar: ir.OpView) -> int:
    """How many sum all_reduces over ``ar``'s groups are concatenated with ``ar``'s result (its only
    reader), ``ar`` included; 0 where it is not so concatenated."""
    results = list(ar.operation.results)
    uses = list(results[0].uses) if len(results) == 1 else []
    if len(uses) != 1 or uses[0].owner.operation.name != "stablehlo.concatenate":
        return 0
    concat = uses[0].owner.operation
    groups = ar.operation.attributes["replica_groups"]
    for value in concat.operands:
        owner = value.owner
        if isinstance(owner, ir.Block) or owner.operation.name != "stablehlo.all_reduce" \
                or owner.operation.attributes["replica_groups"] != groups or not region_is_sum(owner):
            return 0
    return len(concat.operands) if len(concat.operands) > 1 else 0


def _match_sum(ar: ir.OpView, operand: ir.Value, shape: list[int], ring: Ring, region: ManualRegion,
               info: ModuleInfo) -> AllReduceSite:
    n = ring.size
    _reaches_a_dot(operand)
    if not shape:
        raise Decline("no_dim", "the all_reduce sums a scalar: there is no dim to split it along")
    found: list[tuple[tuple, int, tuple]] = []
    reasons: list[str] = []
    declines: list[Decline] = []
    for dim, size in enumerate(shape):
        if size % n or size < n:
            reasons.append(f"dim {dim} ({size}) is not a multiple of {n}")
            continue
        try:
            # a chain, or a DAG (a norm's backward, a residual's cotangent added to it: affine): the
            # scatter side's tracer, its checks and moves
            traced = trace_product(ar, operand, dim, info, ring, dag=True, affine=True)
            moved = read_early(traced[2], ar)
        except Decline as d:
            d = Decline(d.code, as_psum(d.message))
            declines.append(d)
            reasons.append(f"dim {dim}: {d.message}")
            continue
        found.append((_preference(traced[0], dim), dim, traced, moved))
        if not any(found[-1][0][:-1]):  # the best a dim can be, and later dims lose the tie: none is traced
            break
    if not found:
        structural = [d for d in declines if d.code in STRUCTURAL]
        if not structural and len(declines) == len(shape) and len({d.code for d in declines}) == 1:
            structural = declines  # every dim declined alike (the product is no dot, say)
        if structural:
            raise Decline(structural[0].code, structural[0].message)
        raise Decline(
            "no_dim",
            f"no dim of the summed product {shape} can be split over the {n} devices ({'; '.join(reasons)}); "
            f"a row (token) count that is a multiple of {n} would make it eligible",
        )
    _, dim, (terms, adds, path), moved = min(found, key=lambda item: item[:2])
    return AllReduceSite(ar, terms, adds, path, ring, region, dim, moved)


def as_psum(message: str) -> str:
    """A message of the scatter side's tracer, said of the all_reduce (no scatter stands there)."""
    for scatter, psum in (("unscattered", "unsummed"), ("scattered value", "summed value"), ("scattered", "split"),
                          ("the scatter", "the all_reduce")):
        message = message.replace(scatter, psum)
    return message


def _reaches_a_dot(value: ir.Value) -> None:
    """Decline (``producer_not_dot``) a sum whose value is computed from no dot_general through
    the ops a product may pass (layout and elementwise ops, adds; a norm backward's sums over
    other dims and broadcasts back over the rows, which keep a dim to split along): a psum of a
    loss, of a norm's statistics.  Which dim to split along does not matter then."""
    seen, stack, stops = set(), [value], []
    while stack:
        owner = stack.pop().owner
        if isinstance(owner, ir.Block) or owner.operation in seen:
            continue
        seen.add(owner.operation)
        if is_dot(owner):
            return
        if owner.operation.name == SCATTER:  # (its updates: the product, un-permuted)
            stack.append(owner.operation.operands[-1])
        elif is_layout_op(owner) or is_elementwise(owner) or (
                owner.operation.name in ROW_OPS and _keeps_a_dim(owner)):
            stack.extend(owner.operation.operands)
        else:
            stops.append(owner)
    ragged = ragged_producer(value, "the summed value")
    if ragged is not None:
        raise ragged
    if not stops:
        raise Decline("producer_not_dot", "the summed value comes from region arguments (computed outside this "
                                          "shard_map region), not from a stablehlo.dot_general")
    # name what computes the value, not a constant it is scaled by (a mean's divisor)
    stops = [op for op in stops if op.operation.name != "stablehlo.constant"] or stops
    raise Decline("producer_not_dot", not_blockwise(stops[0]).message.replace("scattered", "summed"))


#: :func:`_row_sum`'s answer for a loop's accumulator (the sum so far, itself a sum over rows)
_CARRIED = ()


def _row_sum(value: ir.Value, depth: int = 0, carried: ir.Value | None = None):
    """The sum over rows ``value`` is, through layout ops, sums over size-1 dims, adds of such
    sums (a chunked psum adds its chunks' shares) and a ring loop's accumulator of them (``acc +
    a block's sum``; ``carried``: that accumulator inside its body): (a reduce summing dims of
    more than one element, those dims, its operand's shape), or None when ``value`` is no such
    sum (a reduce whose body is not an add is none)."""
    while depth < 64:
        if carried is not None and value == carried:
            return _CARRIED
        if isinstance(value.owner, ir.Block):
            return None
        op, depth = value.owner, depth + 1
        name = op.operation.name
        if is_layout_op(op):
            value = op.operation.operands[0]
            continue
        if name == "stablehlo.add":  # shares of one sum, each a sum over rows (or the sum so far)
            parts = [_row_sum(v, depth, carried) for v in op.operation.operands]
            if any(p is None for p in parts):
                return None
            return next((p for p in parts if p), _CARRIED)
        if name == "stablehlo.while":  # a ring adding up the sum block by block
            index = ir.OpResult(value).result_number
            body = op.operation.regions[1].blocks[0]
            found = _row_sum(list(body.operations)[-1].operands[index], depth, body.arguments[index])
            return found or None
        if name != "stablehlo.reduce" or len(op.operation.operands) != 2:
            return None
        source = ir_utils.ranked_tensor(op.operation.operands[0])
        if not region_is_sum(op) or source is None or not source.has_static_shape:
            return None
        dims = ir_utils.i64s(op, "dimensions")
        if any(source.shape[d] > 1 for d in dims):
            return op, dims, list(source.shape)
        value = op.operation.operands[0]
    return None


def _keeps_a_dim(op: ir.OpView) -> bool:
    """Does ``op`` (a reduce, a broadcast) give a value of one ranked result with a dim to split
    along (a sum to a scalar, a loss, has none)?"""
    results = list(op.operation.results)
    t = ir_utils.ranked_tensor(results[0]) if len(results) == 1 else None
    return t is not None and t.rank > 0


def _preference(terms: tuple[Term, ...], dim: int) -> tuple:
    """Sort key of a candidate dim (smallest first): blocks not cut from an all_gather's value
    (its ring computes that dot: cutting it would leave the gathered value assembled), then the
    rows of an activation (an operand that is not a region argument, such as a weight, or a
    layout op of one), then a free dim over a paired batch dim, then the outer dim."""
    sliced = [_strip_layout(t.dot.operation.operands[t.operand_index]) for t in terms]
    gathered = any(not isinstance(v.owner, ir.Block) and v.owner.operation.name == "stablehlo.all_gather"
                   for v in sliced)
    weight = isinstance(sliced[0].owner, ir.Block)
    return (gathered, weight, terms[0].role != "free", dim)


def _strip_layout(value: ir.Value) -> ir.Value:
    while not isinstance(value.owner, ir.Block) and is_layout_op(value.owner):
        value = value.owner.operation.operands[0]
    return value
