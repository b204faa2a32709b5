"""Rounds, loops, unrolling and multi-stream annotation shared by every ring.

A ring rewrite is written as ``R`` *rounds*: round ``r`` issues this round's permutes
and computes this round's partial dots.  Rounds differ only at the edges (the first
round has nothing to receive, the last has nothing to send, a bidirectional ring's
two directions stop at different rounds), so each rewrite describes every round by a
hashable *signature* — which streams send, which compute — and :func:`emit_rounds`
puts the longest run of equal signatures in a ``stablehlo.while`` (``unroll`` rounds
per trip, the remainder peeled before it: :func:`cmatmul_pass.cost.loop_run`, which the
cost model times) and emits every other round straight-line
with its round number folded into constants.  ``unroll=None`` emits all rounds
straight-line (no loop), as XLA's GPU windowed einsum does after partitioning.

With stream annotation on, each round's partial dots are outlined into private
functions and called with ``mhlo.frontend_attributes = {_xla_stream_annotation =
"<id>", inlineable = "false"}`` (the form ``jax.experimental.compute_on
('gpu_stream:<id>')`` emits), one compute stream per (slot of the round in its loop
trip, ring direction); a permute and the dots it should hide behind share a
``_scheduling_group_id``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

from .. import ir_utils
from ..cost import loop_run
from .._jax_private import func, ir
from ..matchers import ManualRegion
from ..ring import Ring
from .builders import Builder, counted_loop

STREAM_ANNOTATION = "_xla_stream_annotation"
SCHEDULING_GROUP = "_scheduling_group_id"
FRONTEND_ATTRIBUTES = "mhlo.frontend_attributes"
#: collectives XLA runs as async start/done pairs, which a scheduling group may hold one of
ASYNC_COLLECTIVES = frozenset({"stablehlo.collective_permute", "stablehlo.all_reduce", "stablehlo.all_to_all"})


@dataclass(frozen=True)
class Round:
    """One round: number ``trip * per_trip + offset`` (``trip`` is the loop counter, or None
    outside a loop, where the number is just ``offset``); ``slot`` its position in a loop
    trip (0 .. unroll-1), used to pick compute streams; ``signature`` what it does (the
    same for every round of a loop)."""

    trip: ir.Value | None
    per_trip: int
    offset: int
    slot: int
    signature: Hashable

    @classmethod
    def straight(cls, r: int, slot: int, signature: Hashable) -> "Round":
        return cls(None, 0, r, slot, signature)


@dataclass
class ScheduleStats:
    rounds: int = 0
    loop_trips: int = 0
    rounds_per_trip: int = 0
    peeled: int = 0


def emit_rounds(
    b: Builder,
    signatures: Sequence[Hashable],
    state: list[ir.Value],
    round_fn: Callable[[Round, list[ir.Value]], list[ir.Value]],
    unroll: int | None,
    stats: ScheduleStats | None = None,
) -> list[ir.Value]:
    """Run ``round_fn`` over ``len(signatures)`` rounds, looping over the longest uniform run."""
    lo, hi = loop_run(list(signatures), unroll)
    u = unroll or 1
    for r in range(lo):
        state = round_fn(Round.straight(r, r % 2, signatures[r]), state)
    if hi > lo:

        def body(trip: ir.Value, carried: list[ir.Value]) -> list[ir.Value]:
            for j in range(u):
                carried = round_fn(Round(trip, u, lo + j, j, signatures[lo]), carried)
            return carried

        state = counted_loop(b, (hi - lo) // u, state, body)
    for r in range(hi, len(signatures)):
        state = round_fn(Round.straight(r, (r - hi) % u if u > 1 else r % 2, signatures[r]), state)
    if stats is not None:
        stats.rounds = len(signatures)
        stats.loop_trips = (hi - lo) // u
        stats.rounds_per_trip = u if hi > lo else 0
        stats.peeled = len(signatures) - (hi - lo)
    return state


#: Marks the rewrites leave on their ops while the pass runs; :meth:`Annotator.finish` turns them
#: into frontend attributes.  A later site may still consume a marked dot (a gather's ring computing
#: a scatter ring's peeled dot), so nothing is outlined before every site is done.
_STREAM_MARK = "_cmatmul_stream"
_GROUP_MARK = "_cmatmul_group"


@dataclass
class Annotator:
    """Puts dots on compute streams and groups permutes with the dots they overlap.

    During the pass, :meth:`dot` and :meth:`group` only mark ops; :meth:`finish`, run
    once after every site, outlines each marked dot into a private function called with
    ``_xla_stream_annotation`` and gives every group that still has its permute and at
    least one dot a ``_scheduling_group_id`` (numbered consecutively after any the
    module already uses: XLA rejects gaps).
    """

    module: ir.Module
    enabled: bool = False
    _next_mark: int = 0

    def dot(self, b: Builder, template: ir.OpView, result_type: ir.Type, lhs: ir.Value, rhs: ir.Value, stream: int) -> ir.Value:
        """A partial dot, marked for compute stream ``stream`` when annotating."""
        value = b.dot_like(template, result_type, lhs, rhs)
        if self.enabled:
            value.owner.attributes[_STREAM_MARK] = ir.IntegerAttr.get(ir.IntegerType.get_signless(32), stream)
        return value

    def mark(self, dot: ir.OpView | ir.Operation, stream: int) -> None:
        """Mark a dot already built (a region's op cloned on a block) for compute stream ``stream``."""
        if self.enabled:
            dot.operation.attributes[_STREAM_MARK] = ir.IntegerAttr.get(ir.IntegerType.get_signless(32), stream)

    def group(self, permute: ir.OpView | ir.Operation | None, dots: Sequence[ir.OpView | ir.Operation]) -> None:
        """Mark a permute and the dots it overlaps as one scheduling group.

        XLA drops groups of one and allows one async collective per group, so a round
        without a permute (or without dots) gets no group.
        """
        if not self.enabled or permute is None or not dots:
            return
        mark = ir.IntegerAttr.get(ir.IntegerType.get_signless(32), self._next_mark)
        self._next_mark += 1
        for op in [permute, *dots]:
            op.operation.attributes[_GROUP_MARK] = mark

    def finish(self) -> None:
        if not self.enabled:
            return
        names, used_groups, marked = set(), [-1], []
        for op in ir_utils.walk(self.module.operation):
            name = ir_utils.symbol_name(op)
            if name:
                names.add(name)
            attrs = op.operation.attributes
            if FRONTEND_ATTRIBUTES in attrs:
                entries = ir.DictAttr(attrs[FRONTEND_ATTRIBUTES])
                if SCHEDULING_GROUP in entries:
                    try:
                        used_groups.append(int(ir.StringAttr(entries[SCHEDULING_GROUP]).value))
                    except ValueError:
                        pass
            if _STREAM_MARK in attrs or _GROUP_MARK in attrs:
                marked.append(op)
        members: dict[int, list] = {}
        for op in marked:
            if _GROUP_MARK in op.operation.attributes:
                members.setdefault(ir.IntegerAttr(op.operation.attributes[_GROUP_MARK]).value, []).append(op)
        group_ids, next_id = {}, max(used_groups) + 1
        for mark, ops in members.items():
            kinds = [op.operation.name for op in ops]
            if ASYNC_COLLECTIVES & set(kinds) and ("stablehlo.dot_general" in kinds or any(map(ir_utils.is_grouped_dot, ops))):
                group_ids[mark] = str(next_id)
                next_id += 1
        functions: dict = {}
        for op in marked:
            attrs = op.operation.attributes
            entries = {}
            if _GROUP_MARK in attrs:
                gid = group_ids.get(ir.IntegerAttr(attrs[_GROUP_MARK]).value)
                del attrs[_GROUP_MARK]
                if gid is not None:
                    entries[SCHEDULING_GROUP] = gid
            if _STREAM_MARK in attrs:
                stream = ir.IntegerAttr(attrs[_STREAM_MARK]).value
                del attrs[_STREAM_MARK]
                self._outline(op, stream, entries, functions, names)
            elif entries:
                set_frontend_attributes(op, entries)

    def _outline(self, dot: ir.OpView, stream: int, entries: dict, functions: dict, names: set) -> None:
        """Replace ``dot`` by a call of a private function computing it, on compute stream ``stream``."""
        operands = list(dot.operation.operands)
        result_type = dot.result.type
        signature = tuple(str(v.type) for v in operands) + (str(result_type),)
        key = (signature, tuple(sorted((name, str(value)) for name, value in dot.operation.attributes.items())))
        if key not in functions:
            index = len(functions)
            while f"cmatmul_dot_{index}" in names:
                index += 1
            name = f"cmatmul_dot_{index}"
            names.add(name)
            b = Builder(dot.location)
            with ir.InsertionPoint(self.module.body):
                f = func.FuncOp(name, ir.FunctionType.get([v.type for v in operands], [result_type]),
                                visibility="private", loc=dot.location)
                entry = f.add_entry_block()
                with ir.InsertionPoint(entry):
                    func.ReturnOp([b.dot_like(dot, result_type, *entry.arguments)], loc=dot.location)
            functions[key] = name
        with ir.InsertionPoint(dot.operation):
            call = func.CallOp([result_type], ir.FlatSymbolRefAttr.get(functions[key]), operands, loc=dot.location)
        set_frontend_attributes(call, {**entries, STREAM_ANNOTATION: str(stream), "inlineable": "false"})
        dot.result.replace_all_uses_with(call.result)
        dot.operation.erase()


class DotBarriers:
    """Which of one ring's dots read their operands through an optimization barrier
    (``tie_rounds``, where a block holds several rounds or directions): every dot but the
    first built in the ring's own block (``home``, the collective's; loop bodies are others).

    The barriers keep XLA's dot merger from merging dots of different rounds, which share
    the other operand, into one dot that waits for every round's transfer; merging needs a
    shared value, and each tied dot reads its own barrier's results.  The one untied dot
    reads its operands as they are, so an operand that is another collective's value keeps
    a dot reading it in that collective's block: the dot that collective's ring then
    computes (a gather feeding a scatter's dot, a matmul of two gathered operands); tying
    every dot would leave those gathers unchanged (``user_not_dot``).
    """

    def __init__(self, tie: bool, home: ir.Block):
        self.tie = tie
        self.home = home
        self._untied = False  # whether home's first dot is built

    def tied(self) -> bool:
        """For the dot about to be built at the insertion point: whether it reads its operands
        through a barrier (a dot that takes none, the first in ``home``, counts too)."""
        if not self._untied and ir.InsertionPoint.current.block == self.home:
            self._untied = True
            return False
        return self.tie


def ring_position(b: Builder, position: ir.Value, rnd: Round, n: int, shift: int = 1, offset: int = 0, *,
                  ring: Ring, region: ManualRegion) -> ir.Value:
    """``(position + shift * r + offset) mod n`` for round ``r`` (``position``: this partition's in
    ``ring``, :meth:`.Builder.position_in_ring`).  In a loop, index arithmetic on the trip counter,
    built once per site and insertion point (a bidirectional ring's two directions meet the same
    positions).  Outside a loop, a table lookup of its own (:meth:`.Builder.position_in_ring`
    moved on): XLA then compiles the rounds' block slices and updates as one kernel, which it does
    not where each adds its own constant."""
    moved = (shift * rnd.offset + offset) % n
    if rnd.trip is None:
        return position if moved == 0 else b.position_in_ring(ring, region, moved)
    stride = shift * rnd.per_trip
    return b.per_site(("ring position", position, rnd.trip, stride, moved, n),
                      lambda: b.ring_index(position, rnd.trip, n, shift=stride, offset=moved))


@dataclass
class RewriteContext:
    """What every ring rewrite of one pass run shares."""

    take_channel: Callable[[], int]
    annotator: Annotator
    #: the variant of the site being rewritten (the pipeline sets them before each site)
    bidirectional: bool = False
    unroll: int | None = 1
    #: one dot per round for consumers that differ only in their other operand (concatenated once)
    merge_dots: bool = True
    #: an optimization barrier per round ties a dot's operands where rounds share a block
    tie_rounds: bool = True
    #: values every site may share, per block (constants, ring positions): see Builder
    constants: dict = field(default_factory=dict)


@dataclass
class Applied:
    """What a rewrite did, for the report."""

    channel_handles: list[int]
    directions: int
    stats: ScheduleStats
    permutes: int  # collective-permutes executed per device over the whole ring
    notes: list[str] = field(default_factory=list)


def set_frontend_attributes(op: ir.OpView | ir.Operation, entries: dict[str, str]) -> None:
    op = op.operation
    merged = {}
    if FRONTEND_ATTRIBUTES in op.attributes:
        existing = ir.DictAttr(op.attributes[FRONTEND_ATTRIBUTES])
        merged = {a.name: a.attr for a in existing}
    merged.update({k: ir.StringAttr.get(v) for k, v in entries.items()})
    op.attributes[FRONTEND_ATTRIBUTES] = ir.DictAttr.get(merged)


