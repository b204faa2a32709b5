"""Row-separability: which dim of a value a chain of ops keeps apart, index for index.

A value ``v`` and a dim ``d`` of it are given, and the ops that read ``v`` (directly or not), in
program order.  The ops are *separable along* ``d`` when each computes, for every index ``i`` of
the tracked dim, its result's row ``i`` (along the dim it carries ``d`` to) from the rows ``i`` of
its tracked operands alone, the other operands read whole or at the same rows: then running the
ops on any subset ``J`` of the rows of ``v`` gives the rows ``J`` of every result,

    R(v)[J along d'] = R(v[J along d]),

which is what chunking a region between two collectives (:mod:`..matchers.all_to_all`) rests
on. :func:`track` proves it op by op or says which op breaks it:

* pointwise ops (elementwise arithmetic, ``convert``, ``select``, ``compare``, ...) and calls of
  functions whose bodies are pointwise over one shape (``jax.nn.silu``, a ``custom_jvp``'s
  rule): the same dim; an operand not computed from ``v`` is read at the same rows (a
  :data:`SLICE`), or, a broadcast not along the dim, rebuilt at the rows' size (:data:`REBUILD`);
* ``transpose``, a ``reshape`` keeping the dim whole, a ``slice`` along other dims, a ``reduce``
  over other dims, a ``broadcast_in_dim`` carrying it, a ``pad`` of other dims (``jnp.stack`` of
  gradients): the dim they map it to;
* ``dot_general`` with the dim free (the other operand read whole) or batched (the other
  operand's batch dim read at the same rows);
* ``dot_general`` contracting the dim (a weight's gradient): not separable but *additive*: over
  a partition ``J_0, .., J_{k-1}`` of the rows, ``R(v) = Σ_j R(v[J_j])``. Its result (and a
  ``transpose``, ``reshape`` or ``negate`` of it, linear) is a partial sum, which no other op may
  read before the sum is complete.

Anything else (a reduce or a contraction over the dim mixing its rows, a reshape merging it, a
gather, a sort, a custom call, a call of anything but a pointwise function) is not separable.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .. import ir_utils
from .._jax_private import hlo, ir
from ..layout import ELEMENTWISE_OPS


class NotSeparable(Exception):
    """An op breaks separability (the message says which and why); ``dynamic``: it is dynamically shaped."""

    def __init__(self, message: str, dynamic: bool = False):
        super().__init__(message)
        self.dynamic = dynamic


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
    """One op: the tracked dim of its results, and per operand None (tracked) or the plan for
    an operand not computed from the tracked value: ``(WHOLE | SLICE | REBUILD, dim)``."""

    op: ir.OpView
    out_dim: int | None  # None: a dot contracting the tracked dim (a weight's gradient): summed over the chunks
    sides: tuple[tuple[str, int] | None, ...]
    #: a call of a pointwise function (jax.nn.silu, a custom_jvp's rule): its body, applied per chunk
    body: tuple[ir.OpView, ...] = ()

    @property
    def sums(self) -> bool:
        return self.out_dim is None


def track(start: ir.Value, dim: int, ops: list[ir.OpView]) -> tuple[list[Step], dict[ir.Value, int]]:
    """Each op's step with ``dim`` of ``start`` tracked through ``ops`` (those reading it,
    directly or not, in program order), and the dim each value computed from it carries (a
    partial sum's value has none); NotSeparable naming the op that breaks it."""
    dims: dict[ir.Value, int] = {start: dim}
    partial: set = set()  # dots' results summed over the chunks: whole only after the last
    steps = []
    for op in ops:
        if any(v in partial for v in op.operation.operands):
            if op.operation.name not in LINEAR or len(op.operation.operands) != 1:  # sum(f(p_j)) = f(sum(p_j))
                raise NotSeparable(f"{_where(op)} reads a sum over the chunked dim before its last chunk")
            steps.append(Step(op, None, (None,)))
            partial.add(op.operation.results[0])
            continue
        on_path = [dims.get(v) for v in op.operation.operands]
        steps.append(_step(op, on_path))
        if steps[-1].sums:
            partial.add(op.operation.results[0])
        else:
            dims.update((r, steps[-1].out_dim) for r in op.operation.results)
    return steps, dims


def _where(op: ir.OpView) -> str:
    return f"the {op.operation.name} at {ir_utils.render_location(op.location)}"


def step_of(op: ir.OpView, on_path: list[int | None]) -> Step:
    """``op``'s step, ``on_path`` the tracked dim of each operand (None: not computed from the
    tracked value); NotSeparable where ``op`` is not separable along it (a dot contracting it
    gives a partial sum's step)."""
    return _step(op, on_path)


def _step(op: ir.OpView, on_path: list[int | None]) -> Step:
    name = op.operation.name
    if name == "func.call":
        return _call_step(op, on_path)
    if len(op.operation.results) != 1:
        raise NotSeparable(f"{_where(op)} has {len(op.operation.results)} results")
    result = ir_utils.ranked_tensor(op.result)
    if result is None or not ir_utils.is_static(result):
        raise NotSeparable(f"{_where(op)} is dynamically shaped", dynamic=True)
    tracked = [d for d in on_path if d is not None]
    if name in POINTWISE:
        if len(set(tracked)) != 1 or any(ir.RankedTensorType(v.type).rank != result.rank
                                         for v in op.operation.operands):
            raise NotSeparable(f"{_where(op)} reads the exchanged values along different dims")
        d = tracked[0]
        return Step(op, d, tuple(None if p is not None else _side(op, i, d) for i, p in enumerate(on_path)))
    if len(tracked) != 1 and name != "stablehlo.dot_general":
        raise NotSeparable(f"{_where(op)} reads {len(tracked)} exchanged values")
    if name in ("stablehlo.reduce",):
        (d,) = tracked
        if on_path[0] is None or len(op.operation.operands) != 2:
            raise NotSeparable(f"{_where(op)} reduces several values")
        reduced = ir_utils.i64s(op, "dimensions")
        if d in reduced:
            raise NotSeparable(f"{_where(op)} reduces over the chunked dim {d}")
        return Step(op, d - sum(1 for r in reduced if r < d), (None, (WHOLE, 0)))
    if name == "stablehlo.transpose":
        return Step(op, ir_utils.i64s(op, "permutation").index(tracked[0]), (None,))
    if name == "stablehlo.slice":  # along other dims (q, k and v from one exchanged value)
        d = tracked[0]
        size = ir.RankedTensorType(op.operation.operands[0].type).shape[d]
        if (ir_utils.i64s(op, "start_indices")[d], ir_utils.i64s(op, "limit_indices")[d],
                ir_utils.i64s(op, "strides")[d]) != (0, size, 1):
            raise NotSeparable(f"{_where(op)} slices the chunked dim {d}")
        return Step(op, d, (None,))
    if name == "stablehlo.broadcast_in_dim":
        out = ir_utils.i64s(op, "broadcast_dimensions")[tracked[0]]
        if result.shape[out] != ir.RankedTensorType(op.operation.operands[0].type).shape[tracked[0]]:
            raise NotSeparable(f"{_where(op)} broadcasts the chunked dim")
        return Step(op, out, (None,))
    if name == "stablehlo.reshape":
        src = ir.RankedTensorType(op.operation.operands[0].type).shape
        d = tracked[0]
        for t in range(result.rank):
            if result.shape[t] == src[d] and math.prod(result.shape[:t]) == math.prod(src[:d]):
                return Step(op, t, (None,))
        raise NotSeparable(f"{_where(op)} reshapes {list(src)} into {list(result.shape)}, merging or "
                                    f"splitting the chunked dim {d}")
    if name == "stablehlo.pad":  # zero padding along the tracked dim (a stacked gradient's place in its stack)
        d = tracked[0]
        if on_path[0] is None:
            raise NotSeparable(f"{_where(op)} pads with an exchanged value")
        if _pads(op, d):
            raise NotSeparable(f"{_where(op)} pads the chunked dim {d}")
        return Step(op, d, (None, (WHOLE, 0)))
    if name == "stablehlo.dot_general":
        return _dot_step(op, on_path)
    raise NotSeparable(f"{_where(op)} is not an op the rows can go through apart")


def _pads(pad: ir.OpView, dim: int) -> bool:
    """Does the ``stablehlo.pad`` ``pad`` pad ``dim`` (at either edge or between its elements)?"""
    return any(ir_utils.i64s(pad, key)[dim] for key in ("edge_padding_low", "edge_padding_high", "interior_padding"))


#: what a pointwise function's body may hold besides pointwise ops: scalars and their splats
SCALAR_OPS = frozenset({"stablehlo.constant", "stablehlo.broadcast_in_dim", "func.return"})


def _call_step(op: ir.OpView, on_path: list[int | None]) -> Step:
    """A call of a private function whose body is pointwise over one shape, the call's result's
    (every value a scalar, a splat of one, or of that shape; an argument of another shape read
    only by one ``broadcast_in_dim`` or ``transpose`` into it: ``jnp.where(mask, x, -inf)``'s
    ``@_where``, which may also transpose ``x``; or by a ``pad`` of other dims than the tracked
    one: ``jnp.pad``'s ``@_pad``): per chunk, its body applied to the chunks, an
    argument read at the rows its broadcast or transpose carries to the result's tracked dim
    (whole where none does, or that dim is of size 1 in it)."""
    callee = ir_utils.Symbols(op).callee(op)
    results = {tuple(t.shape) for v in op.operation.results if (t := ir_utils.ranked_tensor(v)) is not None}
    tracked = {d for d in on_path if d is not None}
    if callee is None or len(results) != 1 or len(tracked) != 1 or len(callee.regions[0].blocks) != 1:
        raise NotSeparable(f"{_where(op)} calls a function the rows cannot go through apart")
    full = list(next(iter(results)))
    block = callee.regions[0].blocks[0]
    body = list(block.operations)
    arguments = list(block.arguments)
    # a function whose one result is a transpose of a pointwise value (jnp.where's transpose in
    # jax.nn.dot_product_attention's backward): the body before it is read at that value's shape
    permutation = result_permutation(body)
    if permutation is not None:
        full = [full[permutation.index(d)] for d in range(len(full))]
        body = body[:-2] + body[-1:]
    maps: dict[int, set] = {i: set() for i in range(len(arguments))}  # argument -> {its dims' places in the result}
    splats: set = set()
    pads = []  # (jnp.pad's @_pad) an argument padded into the result's shape: none along the tracked dim
    for inner in body[:-1]:
        name, operands = inner.operation.name, list(inner.operation.operands)
        shapes = [ir.RankedTensorType(r.type).shape for r in inner.operation.results]
        if name == "stablehlo.pad" and operands[0] in arguments and shapes == [full] and \
                ir.RankedTensorType(operands[1].type).rank == 0:
            maps[arguments.index(operands[0])].add(tuple(range(len(full))))
            pads.append(inner)
            continue
        if name in ("stablehlo.broadcast_in_dim", "stablehlo.transpose") and operands[0] in arguments \
                and shapes == [full] and ir.RankedTensorType(operands[0].type).rank:
            places = (ir_utils.i64s(inner, "broadcast_dimensions") if name == "stablehlo.broadcast_in_dim" else
                      [ir_utils.i64s(inner, "permutation").index(a) for a in range(len(full))])
            maps[arguments.index(operands[0])].add(tuple(places))
            continue
        if name == "stablehlo.broadcast_in_dim" and (ir.RankedTensorType(operands[0].type).rank == 0
                                                     or operands[0] in splats):
            splats.add(inner.operation.results[0])
            continue
        if name not in POINTWISE and name != "stablehlo.constant" or any(
                shape and shape != full for shape in shapes) or any(
                ir.RankedTensorType(v.type).rank and ir.RankedTensorType(v.type).shape != full for v in operands):
            raise NotSeparable(f"{_where(op)} calls a function holding {name} of another shape or not pointwise")
        for v in operands:
            if v in arguments and ir.RankedTensorType(v.type).rank:
                maps[arguments.index(v)].add(tuple(range(len(full))))
    if any(len(found) > 1 for found in maps.values()):
        raise NotSeparable(f"{_where(op)} calls a function reading an argument in two layouts")
    outs = {maps[i] and next(iter(maps[i]))[d] for i, d in enumerate(on_path) if d is not None}
    if len(outs) != 1 or None in outs or set() in outs:
        raise NotSeparable(f"{_where(op)} calls a function that moves the chunked dim apart")
    (out,) = outs
    if any(_pads(pad, out) for pad in pads):
        raise NotSeparable(f"{_where(op)} calls a function padding the chunked dim {out}")
    result_out = out if permutation is None else permutation.index(out)
    sides = []
    for i, p in enumerate(on_path):
        arg_t = ir.RankedTensorType(arguments[i].type)
        places = next(iter(maps[i])) if maps[i] else ()
        if p is not None:
            sides.append(None)
        elif arg_t.rank == 0 or out not in places:
            sides.append((WHOLE, 0))
        elif arg_t.shape == full and places == tuple(range(len(full))):
            sides.append(_side(op, i, out))
        elif arg_t.shape[places.index(out)] == full[out]:
            sides.append((SLICE, places.index(out)))
        else:
            sides.append((WHOLE, 0))
    return Step(op, result_out, tuple(sides), tuple(list(block.operations)[:-1]))


def result_permutation(body: list) -> list[int] | None:
    """The permutation of a function body's last op before its return where that op is a
    ``transpose`` of a value the body computes (not of an argument) and is what it returns alone."""
    if len(body) < 2:
        return None
    tail, returned = body[-2], list(body[-1].operation.operands)
    if tail.operation.name != "stablehlo.transpose" or returned != [tail.operation.results[0]] or \
            isinstance(tail.operation.operands[0].owner, ir.Block):
        return None
    return ir_utils.i64s(tail, "permutation")


def _side(op: ir.OpView, index: int, dim: int) -> tuple[str, int]:
    """How the rows read the operand ``index`` of a pointwise op not computed from the tracked value."""
    value = op.operation.operands[index]
    producer = value.owner
    producer = producer.opview if isinstance(producer, ir.Operation) else producer
    if isinstance(producer, ir.OpView) and producer.operation.name == "stablehlo.broadcast_in_dim" \
            and dim not in ir_utils.i64s(producer, "broadcast_dimensions"):
        return (REBUILD, dim)
    return (SLICE, dim)


def _dot_step(op: ir.OpView, on_path: list[int | None]) -> Step:
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
                raise NotSeparable(f"{_where(op)} reads both operands chunked along unmatched dims")
            outs.append(None)
            continue
        if d in batch[s]:
            b = list(batch[s]).index(d)
            outs.append(b)
            other = batch[1 - s][b]
            if on_path[1 - s] is None:
                sides.append((1 - s, (SLICE, other)))
            elif on_path[1 - s] != other:
                raise NotSeparable(f"{_where(op)} reads both operands chunked along unmatched dims")
        else:
            outs.append(len(batch[0]) + (0 if s == 0 else len(free[0])) + free[s].index(d))
            if on_path[1 - s] is not None:
                raise NotSeparable(f"{_where(op)} multiplies two chunked values along a free dim")
            sides.append((1 - s, (WHOLE, 0)))
    if len(set(outs)) != 1:
        raise NotSeparable(f"{_where(op)} reads both operands chunked along unmatched dims")
    plans: list = [None] * len(op.operation.operands)
    for s, plan in sides:
        plans[s] = plan
    return Step(op, outs[0], tuple(plans))
