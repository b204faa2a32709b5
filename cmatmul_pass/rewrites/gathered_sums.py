"""Sums over a gathered dim computed from the shards, before the gather: a norm's statistic.

Activations sharded along their features are gathered, then normalised over those features; where
the raw gathered rows are also read elsewhere (a training step's residual, without remat), the
gather cannot move past the norm (the rows would cross the wire twice), and the ring that applies
the norm to each block it receives cannot either, as the norm's statistic sums over the gathered
dim: no block gives it.  :func:`move_sums` computes each such sum from the device's own shard and
adds the shares with an ``all_reduce`` (one value per row), so the norm reads a statistic computed
apart from the gathered value and the ring applies the rest of it per block
(:func:`~cmatmul_pass.matchers.gather_rows.row_dag`), assembling the raw rows for their readers.

**Identity.**  With ``G = all_gather(x)`` along dim ``d`` over a group, ``f`` elementwise whose
other operands are the same in every block along ``d`` and on every device of the group:
``f(G) = all_gather(f(x))`` (block ``k`` of ``f(G)`` is ``f`` of device ``k``'s shard), and a sum
from zero over dims including ``d``: ``reduce(all_gather(y), D) = all_reduce(reduce(y, D))`` (the
gathered dim's sum is the sum of the shards' sums; the other dims of ``D`` are summed per shard).

**Side conditions**, checked by :func:`gathered_sums` (else the site stays as the matcher left it):
every op from ``G`` to the sum is elementwise (or a sharding hint), in ``G``'s block, and each
operand not computed from ``G`` is a splat constant or a broadcast that does not vary along ``d``
(:func:`~cmatmul_pass.layout.invariant_source`) and is identical on the group
(:meth:`~cmatmul_pass.analysis.variance.Variance.identical`); the reduce is one sum from a zero
constant over dims that include ``d``.  The ops reading ``G`` before the last sum move after it
(so the statistics are ready where the ring goes): none of them may have an effect of its own (a
collective, a custom_call, rng, infeed and outfeed).  Made only where the gather is then rewritten
(:mod:`cmatmul_pass.attempts` undoes it otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import ir_utils
from .._jax_private import ir
from ..analysis.variance import Variance
from ..errors import Decline
from ..layout import block_of, invariant_source, is_elementwise
from ..matchers.common import describe_op
from ..matchers.scatter_terms import LatestFirst, is_sum_from_zero, producers_first
from ..ring import Ring
from .builders import erase_dead
from .dot_all_reduce import sum_all_reduce

HINT = "sdy.sharding_constraint"
#: ops whose place in the program matters beyond their operands (not moved past other ops)
SIDE_EFFECTS = frozenset(f"stablehlo.{name}" for name in (
    "custom_call", "infeed", "outfeed", "send", "recv", "rng", "rng_bit_generator", "all_gather", "all_reduce",
    "reduce_scatter", "all_to_all", "collective_permute", "collective_broadcast"))


@dataclass(frozen=True)
class GatheredSum:
    """A sum over the gathered dim of elementwise ops of the gathered value."""

    reduce: ir.OpView
    #: the elementwise ops from the gathered value to the sum, producers first
    ops: tuple[ir.OpView, ...]


def gathered_sums(ag: ir.OpView, variance: Variance, ring: Ring) -> list[GatheredSum]:
    """The sums over ``ag``'s gathered dim its value reaches through elementwise ops whose other
    operands are the same in every block and on every device (the module's side conditions)."""
    block = ag.operation.block
    dim = ir_utils.int_attr(ag, "all_gather_dim")
    from_g: dict[ir.Operation, ir.OpView] = {}  # elementwise ops computed from the gathered value
    sums: list[GatheredSum] = []
    stack = [u.owner for u in ag.result.uses]
    reached: dict[ir.Operation, ir.OpView] = {}
    while stack:
        op = stack.pop()
        if op.operation in reached or op.operation.block != block:
            continue
        reached[op.operation] = op
        if is_elementwise(op) or op.operation.name in ("stablehlo.convert", "chlo.square", HINT):
            from_g[op.operation] = op
            stack += [u.owner for r in op.operation.results for u in r.uses]
    computed = {ag.operation} | set(from_g)

    def on(value: ir.Value) -> bool:
        return not isinstance(value.owner, ir.Block) and value.owner.operation in computed

    for op in reached.values():
        if op.operation.name != "stablehlo.reduce" or not on(op.operation.operands[0]):
            continue
        if dim not in ir_utils.i64s(op, "dimensions") or not is_sum_from_zero(op):
            continue
        cone = _cone(op.operation.operands[0], ag, from_g)
        if all(_reads_alike(step, on, dim, variance, ring) for step in cone):
            sums.append(GatheredSum(op, cone))
    # producers first; what a sum reads beside the gathered value is there before it once its
    # earlier sums are moved
    kept: list[GatheredSum] = []
    for s in sorted(sums, key=lambda s: LatestFirst(s.reduce), reverse=True):
        beside = [v for op in s.ops for v in op.operation.operands if not on(v)]
        if not any(_reads_gathered(v, ag, {k.reduce.operation for k in kept}) for v in beside):
            kept.append(s)
    sums = kept
    if sums and any(op.name in SIDE_EFFECTS for op in _readers_before(ag, sums[-1].reduce.operation)):
        return []  # (the gathered value's readers before the last sum move after it: none with an effect)
    return sums


def _cone(value: ir.Value, ag: ir.OpView, from_g: dict) -> tuple[ir.OpView, ...]:
    """The ops of ``from_g`` that ``value`` is computed from back to the gathered value, producers
    first (values computed apart from them: read beside, checked by the caller)."""
    found: dict[ir.Operation, ir.OpView] = {}
    stack = [value]
    while stack:
        v = stack.pop()
        owner = v.owner
        if isinstance(owner, ir.Block) or owner.operation == ag.operation or owner.operation in found:
            continue
        if owner.operation not in from_g:
            continue
        found[owner.operation] = owner
        stack += list(owner.operation.operands)
    return producers_first(found.values())


def _reads_alike(op: ir.OpView, on, dim: int, variance: Variance, ring: Ring) -> bool:
    """Does every operand of ``op`` not computed from the gathered value read the same in every
    block along ``dim`` and on every device of the group?"""
    for value in op.operation.operands:
        if on(value):
            continue
        try:
            invariant_source(op, value, dim)
        except Decline:
            return False
        if not variance.identical(value, ring):
            return False
    return True


def move_sums(ag: ir.OpView, sums: list[GatheredSum], take_channel) -> str:
    """Each sum computed from the device's shard and all_reduced over the gather's group (the
    module's identity), where it stood; the ops only it read erased.  Returns the note."""
    shard = ag.operation.operands[0]
    dim = ir_utils.int_attr(ag, "all_gather_dim")
    n = ir.RankedTensorType(ag.result.type).shape[dim] // ir.RankedTensorType(shard.type).shape[dim]
    names = ", ".join(describe_op(s.reduce) for s in sums)
    last = None
    for s in sums:
        rows = {ag.result: shard}
        with ir.InsertionPoint(s.reduce.operation):
            for op in s.ops:
                loc = op.location
                if op.operation.name == HINT:  # a hint about the whole value
                    rows[op.result] = rows[op.operation.operands[0]]
                    continue
                operands = [rows[v] if v in rows else block_of(invariant_source(op, v, dim), dim, n, loc)
                            for v in op.operation.operands]
                t = ir_utils.with_dim(ir.RankedTensorType(op.result.type), dim,
                                      ir.RankedTensorType(op.result.type).shape[dim] // n)
                attributes = {a.name: a.attr for a in op.operation.attributes}
                rows[op.result] = ir.Operation.create(op.operation.name, results=[t], operands=operands,
                                                      attributes=attributes, loc=loc).result
            local = s.reduce.operation.clone()
            local.operands[0] = rows[s.reduce.operation.operands[0]]
            summed = sum_all_reduce(local.results[0], ag.attributes["replica_groups"], take_channel(),
                                    s.reduce.location).result
        s.reduce.result.replace_all_uses_with(summed)
        erase_dead([s.reduce] + list(reversed(s.ops)))
        last = summed.owner.operation
    _sink_readers(ag, last)
    return (f"{len(sums)} sum(s) over the gathered dim ({names}) computed from the shard and added up by an "
            "all_reduce before the ring")


def _reads_gathered(value: ir.Value, ag: ir.OpView, moved: set) -> bool:
    """Is ``value`` computed from the gathered value other than through the sums of ``moved``?"""
    seen: set = set()
    stack = [value]
    while stack:
        owner = _owner(stack.pop())
        if owner is None or owner in seen or owner in moved or owner.block != ag.operation.block:
            continue
        if owner == ag.operation:
            return True
        seen.add(owner)
        if not owner.is_before_in_block(ag.operation):
            stack += list(owner.operands) + ir_utils.captured(owner)
    return False


def _readers_before(ag: ir.OpView, last: ir.Operation) -> list[ir.Operation]:
    """The ops between ``ag`` and ``last`` that read the gathered value (through each other,
    captures of their regions included), in block order."""
    tainted = {ag.operation}
    found = []
    started = False
    for op in list(ag.operation.block.operations):
        if op.operation == last:
            break
        if started:
            values = list(op.operation.operands) + ir_utils.captured(op)
            if any(_owner(v) in tainted for v in values):
                tainted.add(op.operation)
                found.append(op.operation)
        started = started or op.operation == ag.operation
    return found


def _sink_readers(ag: ir.OpView, last: ir.Operation) -> None:
    """Move the ops between ``ag`` and ``last`` that read the gathered value after ``last``, in
    their order: the statistics are then ready before the gathered value's first reader, where
    its ring goes.  No op left in place reads one moved (it would read the gathered value too,
    and move), ``last``'s computation reads none of them, and none has an effect of its own
    (:func:`gathered_sums` checked), so every op computes what it did."""
    after = last
    for op in _readers_before(ag, last):
        op.move_after(after)
        after = op


def _owner(value: ir.Value) -> ir.Operation | None:
    owner = value.owner
    return None if isinstance(owner, ir.Block) else owner.operation
