"""``all_to_all`` → ops → ``all_to_all``: an expert-parallel MoE block's dispatch, its experts
and its combine (capacity-padded), or Ulysses attention's heads ↔ sequence exchange and back.

Each collective waits for its whole transfer before the ops after it start.  Cut into ``k``
chunks along a dim ``d`` of the dispatch's operand ``x`` that the ops between keep apart, each
chunk's exchange can run while the previous chunk's ops compute (the rewrite,
:mod:`cmatmul_pass.rewrites.all_to_all`).  The identity, for chunks ``J_0 .. J_{k-1}`` of ``d``
and ``R`` the ops between the two collectives::

    a2a₂(R(a2a₁(x))) = concatenate_j a2a₂(R(a2a₁(x[J_j along d])))   along d'

where ``d'`` is the dim ``R`` carries ``d`` to, and either

* (**free**) ``d`` is neither the dispatch's split nor its concat dim, and ``d'`` neither the
  combine's: each exchange acts alike on every index of the dim; or
* (**exchanged**) ``d`` is the dispatch's concat dim (the capacity of a MoE dispatch: each
  device's rows for the local experts, device-major) and ``d'`` the combine's split dim: the
  dispatch of chunk ``j`` brings every device's chunk-``j`` rows, in device order, and the
  combine sends each device back exactly those, so its result is chunk ``j`` of the original's
  along ``d'``.

Side conditions, each checked here (a site failing one is declined, saying which):

1. the two collectives are over the same device groups, in one block, the combine reached from
   the dispatch's result only through ``R`` (``a2a_unpaired`` otherwise);
2. every op of ``R`` (every op reading, directly or not, the dispatch's result before the
   combine) has one result and carries the tracked dim to one dim of its result, index for
   index: elementwise ops, ``convert``, ``select``, ``compare``, ``transpose``, a ``reshape``
   keeping the dim whole, a ``slice`` or ``reduce`` along other dims, a ``broadcast_in_dim``
   along it, a ``dot_general`` where it is a free or batch dim; or a ``dot_general`` contracting
   it (a weight's gradient in a training step's backward), each chunk's product a partial sum,
   added up over the chunks, read before the pair's end only by a transpose, reshape or negate
   (linear: applied to each share) (``a2a_region``);
3. a value of the pair read outside it (a residual a training step saves for its backward) is
   read after the combine: the rewrite reassembles it there from the chunks, in the original's
   order (``a2a_region`` where a reader stands before the combine);
4. an operand of an ``R`` op not computed from the dispatch (a weight, a mask, a residual the
   forward saved) that spans the tracked dim is read per chunk at the chunk's rows: a slice
   (free), or along the exchanged dim each device's rows of the chunk, device-major, as the
   dispatch lays them out; a broadcast not along the dim is rebuilt at the chunk's size;
5. ``d``'s size divides into the chunks (``a2a_no_dim`` where no dim does).

Nothing moves into control flow: the ``k`` pairs stand where the pair stood, every device runs
them in the same order, so no device-variance condition arises.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .. import ir_utils
from .._jax_private import hlo, ir
from ..errors import Decline
from ..layout import ELEMENTWISE_OPS
from ..ring import Ring
from .common import DeclinedSite, ManualRegion, ModuleInfo, collective_ring

ALL_TO_ALL = "all_to_all_chunk"
A2A = "stablehlo.all_to_all"
#: ops applied index for index along every dim (operands of the result's shape)
POINTWISE = ELEMENTWISE_OPS | frozenset(f"stablehlo.{n}" for n in (
    "convert", "select", "compare", "clamp", "and", "or", "xor", "not", "remainder", "atan2", "exponential_minus_one",
    "log_plus_one", "round_nearest_even", "round_nearest_afz", "is_finite", "cbrt", "tan", "real", "imag"))
#: ops a partial sum over the chunks may pass through, each chunk's share alone (linear in it)
LINEAR = frozenset({"stablehlo.transpose", "stablehlo.reshape", "stablehlo.negate"})
#: a side operand's plan: read whole, sliced along a dim per chunk, or rebuilt (a broadcast) at the chunk's size
WHOLE, SLICE, REBUILD = "whole", "slice", "rebuild"


@dataclass(frozen=True, eq=False)
class Step:
    """One op of ``R``: the tracked dim of its result, and per operand None (on the path) or a
    side operand's plan ``(WHOLE | SLICE | REBUILD, dim)``."""

    op: ir.OpView
    out_dim: int | None  # None: a dot contracting the tracked dim (a weight's gradient): summed over the chunks
    sides: tuple[tuple[str, int] | None, ...]

    @property
    def sums(self) -> bool:
        return self.out_dim is None


@dataclass(frozen=True, eq=False)
class AllToAllSite:
    dispatch: ir.OpView
    combine: ir.OpView
    steps: tuple[Step, ...]
    #: the tracked dim: of the dispatch's operand (and result), of the combine's operand (and result)
    dim: int
    out_dim: int
    exchanged: bool  # d is the dispatch's concat dim, d' the combine's split dim
    ring: Ring
    region: ManualRegion
    #: values of the pair read after it (a training step's residuals): reassembled whole from the chunks
    escapes: tuple[ir.Value, ...] = ()

    kind = ALL_TO_ALL

    @property
    def anchor(self) -> ir.OpView:
        return self.dispatch

    def chunk_counts(self, counts) -> list[int]:
        """Those of ``counts`` the tracked dim divides into (every sliced operand's too: along
        the exchanged dim, each device's rows of it)."""
        size = ir.RankedTensorType(self.dispatch.operation.operands[0].type).shape[self.dim]
        per = self.ring.size if self.exchanged else 1
        return [k for k in counts if k > 1 and size % k == 0 and all(
            ir.RankedTensorType(s.op.operation.operands[i].type).shape[plan[1]] % (k * per) == 0
            for s in self.steps for i, plan in enumerate(s.sides) if plan and plan[0] == SLICE)]


def _attr(op: ir.OpView, name: str) -> int:
    return ir.IntegerAttr(op.operation.attributes[name]).value


def match_all_to_all(op: ir.OpView, info: ModuleInfo, counts=(2, 4, 8)) -> AllToAllSite | DeclinedSite:
    """``op`` as the dispatch of a pair (module docstring), or why not."""
    ring = None
    try:
        ring, region = collective_ring(op, info)
        return _match(op, ring, region, counts)
    except Decline as d:
        return DeclinedSite(ALL_TO_ALL, op, d.code, d.message, ring)


def combine_of(op: ir.OpView) -> ir.OpView | None:
    """The all_to_all the ops after ``op`` reach first in its block (the pair's combine), if any."""
    try:
        return _region(op)[1]
    except Decline:
        return None


def _region(dispatch: ir.OpView) -> tuple[list[ir.OpView], ir.OpView]:
    """The ops between the exchanges, in block order: those reading the dispatch's result
    (directly or not) up to the all_to_all they reach (their values may leave the pair too:
    a training step's residuals), and that all_to_all."""
    block = dispatch.operation.block
    reached: dict[ir.Operation, ir.OpView] = {}
    combines: dict[ir.Operation, ir.OpView] = {}
    frontier = [dispatch.operation.results[0]]
    while frontier:
        value = frontier.pop()
        for use in value.uses:
            user = use.owner
            user = user.opview if isinstance(user, ir.Operation) else user
            if user.operation.block != block:
                raise Decline("a2a_region", f"{user.operation.name} in a nested region reads a value between the "
                                            "exchanges: the chunks would have to make it whole")
            if user.operation.name == A2A:
                combines[user.operation] = user
                continue
            if user.operation not in reached:
                reached[user.operation] = user
                frontier.extend(user.operation.results)
    if not combines:
        raise Decline("a2a_unpaired", "no all_to_all after it reads the ops it feeds (a lone exchange has no partner "
                                      "to overlap its chunks with)")
    # the first all_to_all reached is the combine; what stands after it only reads the pair's values
    combine = next(o for o in block.operations if o.operation in combines)
    combine = combine.opview if isinstance(combine, ir.Operation) else combine
    ops = [o.opview if isinstance(o, ir.Operation) else o for o in block.operations
           if o.operation in reached and o.operation.is_before_in_block(combine.operation)]
    return ops, combine


def _escapes(dispatch: ir.OpView, ops: list[ir.OpView], combine: ir.OpView) -> tuple[ir.Value, ...]:
    """The values of the pair (the dispatch's result, the ops' results) read by other ops, which
    the rewrite reassembles whole from the chunks (residuals a training step saves); Decline
    where such a reader stands before the combine (the chunks are computed where it stands)."""
    inside = {o.operation for o in ops} | {combine.operation}
    escaping = []
    for value in [dispatch.operation.results[0]] + [r for o in ops for r in o.operation.results]:
        readers = [u.owner.operation if isinstance(u.owner, ir.OpView) else u.owner for u in value.uses]
        outside = [r for r in readers if r not in inside]
        for reader in outside:
            if reader.block != combine.operation.block or reader.is_before_in_block(combine.operation):
                raise Decline("a2a_region", f"a value between the exchanges is also read by {reader.name} before "
                                            "the exchange back: the chunks would have to make it whole there")
        if outside:
            escaping.append(value)
    return tuple(escaping)


def _match(dispatch: ir.OpView, ring: Ring, region: ManualRegion, counts) -> AllToAllSite:
    ops, combine = _region(dispatch)
    if combine.operation.attributes["replica_groups"] != dispatch.operation.attributes["replica_groups"]:
        raise Decline("a2a_unpaired", "the all_to_all after it exchanges over other device groups")
    escapes = _escapes(dispatch, ops, combine)
    x = ir.RankedTensorType(dispatch.operation.operands[0].type)
    split, concat = _attr(dispatch, "split_dimension"), _attr(dispatch, "concat_dimension")
    c_split, c_concat = _attr(combine, "split_dimension"), _attr(combine, "concat_dimension")
    reasons = []
    for dim in sorted(range(x.rank), key=lambda d: (d != concat, -x.shape[d])):  # the capacity first
        if dim == split or not any(x.shape[dim] % k == 0 for k in counts if k > 1):
            continue
        try:
            steps, out_dim = _track(dispatch, ops, combine, dim, exchanged=dim == concat)
        except Decline as d:
            reasons.append((dim, d))
            continue
        exchanged = dim == concat
        if exchanged and out_dim != c_split:
            reasons.append((dim, Decline("a2a_no_dim", f"dim {dim}, the exchange's concat dim, reaches the all_to_all "
                                                       f"after as its dim {out_dim}, not its split dim {c_split}")))
            continue
        if not exchanged and out_dim in (c_split, c_concat):
            reasons.append((dim, Decline("a2a_no_dim", f"dim {dim} reaches the all_to_all after as its "
                                                       f"{'split' if out_dim == c_split else 'concat'} dim")))
            continue
        site = AllToAllSite(dispatch, combine, tuple(steps), dim, out_dim, exchanged, ring, region, escapes)
        if site.chunk_counts(counts):
            return site
        reasons.append((dim, Decline("a2a_no_dim", f"dim {dim} does not divide into {', '.join(map(str, counts))} "
                                                   "chunks with every operand sliced along it")))
    if not reasons:
        raise Decline("a2a_no_dim", f"no dim of the exchanged {list(x.shape)} but its split dim divides into chunks")
    code = next((d.code for _, d in reasons if d.code == "a2a_region"), reasons[0][1].code)
    raise Decline(code, "; ".join(f"along dim {dim}: {d.message}" for dim, d in reasons))


def _track(dispatch: ir.OpView, ops: list[ir.OpView], combine: ir.OpView, dim: int,
           exchanged: bool) -> tuple[list[Step], int]:
    """Each op's step with ``dim`` of the dispatch's result tracked through ``ops``; the dim it
    reaches in the combine's operand."""
    dims: dict[ir.Value, int] = {dispatch.operation.results[0]: dim}
    partial: set = set()  # dots' results summed over the chunks: whole only after the last
    steps = []
    for op in ops:
        if any(v in partial for v in op.operation.operands):
            if op.operation.name not in LINEAR or len(op.operation.operands) != 1:  # sum(f(p_j)) = f(sum(p_j))
                raise Decline("a2a_region", f"{_where(op)} reads a sum over the chunked dim before its last chunk")
            steps.append(Step(op, None, (None,)))
            partial.add(op.result)
            continue
        on_path = [dims.get(v) for v in op.operation.operands]
        steps.append(_step(op, on_path, exchanged))
        if steps[-1].sums:
            partial.add(op.result)
        else:
            dims[op.result] = steps[-1].out_dim
    out = dims.get(combine.operation.operands[0])
    if out is None:
        raise Decline("a2a_unpaired", "the all_to_all after it does not read the ops' result")
    return steps, out


def _where(op: ir.OpView) -> str:
    return f"the {op.operation.name} at {ir_utils.render_location(op.location)}"


def _step(op: ir.OpView, on_path: list[int | None], exchanged: bool) -> Step:
    name = op.operation.name
    if len(op.operation.results) != 1:
        raise Decline("a2a_region", f"{_where(op)} between the exchanges has {len(op.operation.results)} results")
    result = ir_utils.ranked_tensor(op.result)
    if result is None or not ir_utils.is_static(result):
        raise Decline("dynamic_shape", f"{_where(op)} between the exchanges is dynamically shaped")
    tracked = [d for d in on_path if d is not None]
    if name in POINTWISE:
        if len(set(tracked)) != 1 or any(ir.RankedTensorType(v.type).rank != result.rank
                                         for v in op.operation.operands):
            raise Decline("a2a_region", f"{_where(op)} reads the exchanged values along different dims")
        d = tracked[0]
        return Step(op, d, tuple(None if p is not None else _side(op, i, d, exchanged) for i, p in enumerate(on_path)))
    if len(tracked) != 1 and name != "stablehlo.dot_general":
        raise Decline("a2a_region", f"{_where(op)} reads {len(tracked)} exchanged values")
    if name in ("stablehlo.reduce",):
        (d,) = tracked
        if on_path[0] is None or len(op.operation.operands) != 2:
            raise Decline("a2a_region", f"{_where(op)} reduces several values")
        reduced = ir_utils.i64s(op, "dimensions")
        if d in reduced:
            raise Decline("a2a_region", f"{_where(op)} reduces over the chunked dim {d}")
        return Step(op, d - sum(1 for r in reduced if r < d), (None, (WHOLE, 0)))
    if name == "stablehlo.transpose":
        return Step(op, ir_utils.i64s(op, "permutation").index(tracked[0]), (None,))
    if name == "stablehlo.slice":  # along other dims (q, k and v from one exchanged value)
        d = tracked[0]
        size = ir.RankedTensorType(op.operation.operands[0].type).shape[d]
        if (ir_utils.i64s(op, "start_indices")[d], ir_utils.i64s(op, "limit_indices")[d],
                ir_utils.i64s(op, "strides")[d]) != (0, size, 1):
            raise Decline("a2a_region", f"{_where(op)} slices the chunked dim {d}")
        return Step(op, d, (None,))
    if name == "stablehlo.broadcast_in_dim":
        out = ir_utils.i64s(op, "broadcast_dimensions")[tracked[0]]
        if result.shape[out] != ir.RankedTensorType(op.operation.operands[0].type).shape[tracked[0]]:
            raise Decline("a2a_region", f"{_where(op)} broadcasts the chunked dim")
        return Step(op, out, (None,))
    if name == "stablehlo.reshape":
        src = ir.RankedTensorType(op.operation.operands[0].type).shape
        d = tracked[0]
        for t in range(result.rank):
            if result.shape[t] == src[d] and math.prod(result.shape[:t]) == math.prod(src[:d]):
                return Step(op, t, (None,))
        raise Decline("a2a_region", f"{_where(op)} reshapes {list(src)} into {list(result.shape)}, merging or "
                                    f"splitting the chunked dim {d}")
    if name == "stablehlo.dot_general":
        return _dot_step(op, on_path, exchanged)
    raise Decline("a2a_region", f"{_where(op)} between the exchanges is not an op the chunks can apply alone")


def _side(op: ir.OpView, index: int, dim: int, exchanged: bool) -> tuple[str, int]:
    """How each chunk reads the side operand ``index`` of a pointwise op (condition 4)."""
    value = op.operation.operands[index]
    producer = value.owner
    producer = producer.opview if isinstance(producer, ir.Operation) else producer
    if isinstance(producer, ir.OpView) and producer.operation.name == "stablehlo.broadcast_in_dim" \
            and dim not in ir_utils.i64s(producer, "broadcast_dimensions"):
        return (REBUILD, dim)
    return (SLICE, dim)


def _dot_step(op: ir.OpView, on_path: list[int | None], exchanged: bool) -> Step:
    numbers = hlo.DotDimensionNumbers(op.operation.attributes["dot_dimension_numbers"])
    batch = (numbers.lhs_batching_dimensions, numbers.rhs_batching_dimensions)
    contracting = (numbers.lhs_contracting_dimensions, numbers.rhs_contracting_dimensions)
    ranks = [ir.RankedTensorType(v.type).rank for v in op.operation.operands[:2]]
    free = [[d for d in range(ranks[s]) if d not in batch[s] and d not in contracting[s]] for s in (0, 1)]
    outs, sides = [], []
    for s, d in enumerate(on_path[:2]):
        if d is None:
            continue
        if d in contracting[s]:  # a partial product per chunk, summed over them (a weight's gradient)
            other = contracting[1 - s][list(contracting[s]).index(d)]
            if on_path[1 - s] is None:
                sides.append((1 - s, (SLICE, other)))
            elif on_path[1 - s] != other:
                raise Decline("a2a_region", f"{_where(op)} reads both operands chunked along unmatched dims")
            outs.append(None)
            continue
        if d in batch[s]:
            b = list(batch[s]).index(d)
            outs.append(b)
            other = batch[1 - s][b]
            if on_path[1 - s] is None:
                sides.append((1 - s, (SLICE, other)))
            elif on_path[1 - s] != other:
                raise Decline("a2a_region", f"{_where(op)} reads both operands chunked along unmatched dims")
        else:
            outs.append(len(batch[0]) + (0 if s == 0 else len(free[0])) + free[s].index(d))
            if on_path[1 - s] is not None:
                raise Decline("a2a_region", f"{_where(op)} multiplies two chunked values along a free dim")
            sides.append((1 - s, (WHOLE, 0)))
    if len(set(outs)) != 1:
        raise Decline("a2a_region", f"{_where(op)} reads both operands chunked along unmatched dims")
    plans: list = [None] * len(op.operation.operands)
    for s, plan in sides:
        plans[s] = plan
    return Step(op, outs[0], tuple(plans))
