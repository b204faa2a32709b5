"""Rounds, loops, unrolling and multi-stream annotation shared by every ring.

A ring rewrite is written as ``R`` *rounds*: round ``r`` issues this round's permutes
and computes this round's partial dots.  Rounds differ only at the edges (the first
round has nothing to receive, the last has nothing to send, a bidirectional ring's
two directions stop at different rounds), so each rewrite describes every round by a
hashable *signature* — which streams send, which compute — and :func:`emit_rounds`
puts the longest run of equal signatures in a ``stablehlo.while`` (``unroll`` rounds
per trip, the remainder peeled after it) and emits every other round straight-line
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
from .._jax_private import func, ir
from .builders import Builder, counted_loop

STREAM_ANNOTATION = "_xla_stream_annotation"
SCHEDULING_GROUP = "_scheduling_group_id"
FRONTEND_ATTRIBUTES = "mhlo.frontend_attributes"


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


def _loop_run(signatures: Sequence[Hashable], unroll: int | None) -> tuple[int, int]:
    """The [lo, hi) run of equal signatures to loop over: the longest, first on ties."""
    if unroll is None or not signatures:
        return 0, 0
    best = (0, 0)
    start = 0
    for r in range(1, len(signatures) + 1):
        if r == len(signatures) or signatures[r] != signatures[start]:
            if r - start > best[1] - best[0]:
                best = (start, r)
            start = r
    lo, hi = best
    trips = (hi - lo) // unroll
    if trips < 1 or hi - lo < 2:
        return 0, 0
    return lo, lo + trips * unroll


def emit_rounds(
    b: Builder,
    signatures: Sequence[Hashable],
    state: list[ir.Value],
    round_fn: Callable[[Round, list[ir.Value]], list[ir.Value]],
    unroll: int | None,
    stats: ScheduleStats | None = None,
) -> list[ir.Value]:
    """Run ``round_fn`` over ``len(signatures)`` rounds, looping over the longest uniform run."""
    lo, hi = _loop_run(signatures, unroll)
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


@dataclass
class Annotator:
    """Outlines dots onto compute streams and groups permutes with the dots they overlap.

    One per pass run: function names and group ids are unique in the module.
    """

    module: ir.Module
    enabled: bool = False
    _next_group: int = 0
    _functions: dict = field(default_factory=dict)
    _names: set = field(default_factory=set)

    def __post_init__(self) -> None:
        groups = [-1]
        for op in ir_utils.walk(self.module.operation):
            name = ir_utils.symbol_name(op)
            if name:
                self._names.add(name)
            attrs = op.attributes
            if FRONTEND_ATTRIBUTES in attrs:
                entries = ir.DictAttr(attrs[FRONTEND_ATTRIBUTES])
                if SCHEDULING_GROUP in entries:
                    try:
                        groups.append(int(ir.StringAttr(entries[SCHEDULING_GROUP]).value))
                    except ValueError:
                        pass
        self._next_group = max(groups) + 1

    def dot(self, b: Builder, template: ir.OpView, result_type: ir.Type, lhs: ir.Value, rhs: ir.Value, stream: int) -> ir.Value:
        """A partial dot: plain, or (annotating) a call to an outlined copy on compute stream ``stream``."""
        if not self.enabled:
            return b.dot_like(template, result_type, lhs, rhs)
        callee = self._outlined(b, template, result_type, lhs.type, rhs.type)
        call = func.CallOp([result_type], ir.FlatSymbolRefAttr.get(callee), [lhs, rhs], loc=b.loc)
        set_frontend_attributes(call, {STREAM_ANNOTATION: str(stream), "inlineable": "false"})
        return call.result

    def group(self, permute: ir.OpView | ir.Operation | None, dots: Sequence[ir.OpView | ir.Operation]) -> None:
        """Put a permute and the dots it overlaps in one fresh scheduling group.

        XLA drops groups of one and allows one async collective per group, so a round
        without a permute (or without dots) gets no group.
        """
        if not self.enabled or permute is None or not dots:
            return
        gid = str(self._next_group)
        self._next_group += 1
        for op in [permute, *dots]:
            set_frontend_attributes(op, {SCHEDULING_GROUP: gid})

    def _outlined(self, b: Builder, template: ir.OpView, result_type, lhs_type, rhs_type) -> str:
        key = (template.operation, str(result_type), str(lhs_type), str(rhs_type))
        if key in self._functions:
            return self._functions[key]
        index = len(self._functions)
        while f"cmatmul_dot_{index}" in self._names:
            index += 1
        name = f"cmatmul_dot_{index}"
        self._names.add(name)
        with ir.InsertionPoint(self.module.body):
            f = func.FuncOp(name, ir.FunctionType.get([lhs_type, rhs_type], [result_type]), visibility="private", loc=b.loc)
            entry = f.add_entry_block()
            with ir.InsertionPoint(entry):
                func.ReturnOp([b.dot_like(template, result_type, *entry.arguments)], loc=b.loc)
        self._functions[key] = name
        return name


def ring_position(b: Builder, position: ir.Value, rnd: Round, n: int, shift: int = 1, offset: int = 0) -> ir.Value:
    """``(position + shift * r + offset) mod n`` for round ``r``; constants folded."""
    moved = (shift * rnd.offset + offset) % n
    if rnd.trip is None:
        if moved == 0:
            return position
        return b.rem(b.add(position, b.i32(moved)), b.i32(n))
    return b.ring_index(position, rnd.trip, n, shift=shift * rnd.per_trip, offset=moved)


@dataclass
class RewriteContext:
    """What every ring rewrite of one pass run shares."""

    take_channel: Callable[[], int]
    annotator: Annotator
    bidirectional: bool = False
    unroll: int | None = 1


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


