"""all_gather → dot_general(s), as one windowed ring.

Before (ring of n; the gathered value feeds one or more dots, possibly through
layout ops)::

    %g  = stablehlo.all_gather(%x) {all_gather_dim = d, replica_groups = G}
    %y1 = dot_general(%g, %w1)            // free role: d is a free dim of the operand
    %y2 = dot_general(%g, %w2)            // contracting role: d is contracted
    %y3 = dot_general(%g, %w3)            // batch role: d is a batch dim (paired with %w3's e)

After (unidirectional, one round per trip)::

    %pos = table[partition_id]            // my position in my group of G
    %held, %acc1, %acc2 [, %full] = while (%i = 0; %i < n-1; %i++)
            carry (%x, zeros, zeros [, zeros]) {
        %next = collective_permute(%held)   // position k sends to k-1: I receive shard pos+i+1
        %k    = (pos + i) mod n             // the shard I hold now
        %acc1 = dynamic_update_slice(%acc1, dot(%held, %w1), offset = k * block)
        %acc2 = %acc2 + dot(%held, dynamic_slice(%w2, k * block))
        %acc3 = dynamic_update_slice(%acc3, dot(%held, dynamic_slice(%w3, e, k * block)), offset = k * block)
        [%full = dynamic_update_slice(%full, %held, offset = k * shard)]
        yield %next, ...
    }
    ... the same round once more for k = (pos + n-1) mod n, without a permute (peeled)

Bidirectional: a second stream of shards travels the other way (position k sends to
k+1, so it holds shard pos-r in round r); round 0 computes the own shard and starts
both streams, later rounds compute one shard from each direction, and each stream
stops sending as soon as its last shard has arrived: ⌈(n-1)/2⌉ permute rounds,
n-1 permutes in all.  Unrolling and straight-line emission come from
:mod:`.schedule`.

Dots that differ only in their other operand, along its one free dim (q/k/v, gate and
up), are one dot per round on those operands concatenated before the ring
(:class:`_DotGroup`).  Where a block holds several rounds (unrolled, straight-line,
bidirectional), each round's dot reads its operands through an optimization barrier (but
one: :class:`.schedule.DotBarriers`) and each round sends its shard through
one with the previous round's dot (``tie_rounds``): XLA neither merges the rounds' dots nor
starts a transfer during the previous round's dot.

``%full`` is built only when some op other than the loop's dots still reads the
gathered value (it then reads ``%full``).  Contracting partials of floats narrower than
f32 (bf16, f16, fp8) are summed in f32 and converted once at the end.  Compute ops carry their dot's location,
the permutes the all_gather's.
"""

from __future__ import annotations


from .. import ir_utils
from .._jax_private import ir
from ..cost import gather_signatures, gather_streams
from ..layout import LayoutStep, apply_dag, path_sources
from ..matchers import AllGatherSite, Consumer
from ..matchers.common import DotDims
from .builders import TRANSIENT_MARK_PREFIX, Builder, erase_dead, shard_type
from .schedule import Applied, DotBarriers, RewriteContext, Round, ScheduleStats, emit_rounds, ring_position

#: Each step receives the shard of the next position: position k sends to k-1.
RECEIVE_FROM_NEXT = -1

class _Plan:
    """How one consumer dot accumulates over the ring."""

    def __init__(self, consumer: Consumer, n: int, b: Builder, ctx: RewriteContext):
        self.c = consumer
        self.n = n
        self.ctx = ctx
        self.compute = b.at(consumer.dot.location)
        self.result_t = ir.RankedTensorType(consumer.dot.result.type)
        if consumer.role != "contracting":  # free, batch: each round writes its block of the result
            self.acc_t = self.result_t
            self.partial_t = shard_type(self.result_t, consumer.result_dim, n)
        else:
            self.acc_t = ir.RankedTensorType.get(self.result_t.shape, _partial_element_type(consumer))
            self.partial_t = self.acc_t

    @property
    def other(self) -> ir.Value:
        """The dot's operand that is not the gathered value (the same in every round)."""
        return _other(self.c)

    def accumulate(self, acc: ir.Value, partial: ir.Value, k: ir.Value) -> ir.Value:
        """Add this round's partial dot (of shard ``k``) to the accumulator."""
        c, b = self.c, self.compute
        if c.role == "contracting":
            return b.add(acc, partial)
        rows = self.partial_t.shape[c.result_dim]
        return b.dynamic_update_slice(acc, partial, c.result_dim, b.scaled(k, rows))

    def finish(self, acc: ir.Value) -> ir.Value:
        return self.compute.convert(acc, self.result_t.element_type)


class _DotGroup:
    """Consumers the ring computes with one dot per round: one consumer, or several whose dots
    differ only in their other operand, and there only along its one free dim (q/k/v, gate and
    up).  Those other operands are concatenated once, before the loop; each round's dot goes
    into one accumulator for the group, sliced per consumer after the ring.  XLA's dot merger
    would merge the dots anyway, but inside the loop, concatenating the same operands again in
    every round (measured, docs/gpu.md)."""

    def __init__(self, plans: list[_Plan], merge_dim: int | None = None, result_dim: int | None = None):
        self.plans = plans
        self.lead = plans[0]
        self.merge_dim = merge_dim  # the other operands' dim that is concatenated (None: one plan)
        self.result_dim = result_dim  # where that dim is in the dot result
        self.partial_t, self.acc_t = self.lead.partial_t, self.lead.acc_t
        if merge_dim is not None:
            self.sizes = [ir.RankedTensorType(p.other.type).shape[merge_dim] for p in plans]
            self.partial_t = ir_utils.with_dim(self.partial_t, result_dim, sum(self.sizes))
            self.acc_t = ir_utils.with_dim(self.acc_t, result_dim, sum(self.sizes))
        self.other: ir.Value | None = None

    def prepare(self) -> ir.Value:
        """Build the (concatenated) other operand, before the ring; the accumulator's zeros."""
        others = [p.other for p in self.plans]
        self.other = others[0] if self.merge_dim is None else self.lead.compute.concatenate(others, self.merge_dim)
        return self.lead.compute.zeros(self.acc_t)

    def accumulate(self, acc: ir.Value, block: ir.Value, k: ir.Value, stream: int, dots: list,
                   barriers: DotBarriers) -> ir.Value:
        """This round's dot of ``block`` (shard ``k``), added to the accumulator.  ``barriers``:
        whether a free dot's operands go through an optimization barrier, so that XLA does not
        merge the dots of different rounds or directions (they share the other operand), which
        would make one dot wait for every round's transfer."""
        c, b = self.lead.c, self.lead.compute
        other = self.other
        tied = barriers.tied()
        if c.role != "free":  # contracting, batch: the other operand's block that pairs with this shard
            width = ir.RankedTensorType(block.type).shape[c.dim]
            other = b.dynamic_slice(other, c.other_dim, b.scaled(k, width), width)
        elif tied:
            block, other = b.tied([block, other])
        operands = [other, other]
        operands[c.operand_index] = block
        partial = self.lead.ctx.annotator.dot(b, c.dot, self.partial_t, operands[0], operands[1], stream)
        dots.append(partial.owner)
        return self.lead.accumulate(acc, partial, k)  # the same dims, wider along result_dim

    def finish(self, acc: ir.Value) -> list[ir.Value]:
        """Each plan's result."""
        if self.merge_dim is None:
            return [self.lead.finish(acc)]
        b = self.lead.compute
        starts = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        return [plan.finish(b.slice(acc, self.result_dim, start, size))
                for plan, start, size in zip(self.plans, starts, self.sizes)]


def _other(c: Consumer) -> ir.Value:
    """The consumer dot's operand that is not the gathered value."""
    return c.dot.operation.operands[1 - c.operand_index]


def _partial_element_type(c: Consumer) -> ir.Type:
    """The element type of a round's partial dot: the result's; f32 where partial contractions
    in a float narrower than f32 (bf16, f16, the f8 types) are summed (a contracting role
    without an explicit algorithm)."""
    element = ir.RankedTensorType(c.dot.result.type).element_type
    if (c.role == "contracting" and isinstance(element, ir.FloatType) and element.width < 32
            and "algorithm" not in c.dot.attributes):
        return ir.F32Type.get()
    return element


def _merge_key(c: Consumer) -> tuple[tuple, int, int] | None:
    """What must be equal for consumers to share one dot, the other operand's one free dim (the
    one that may differ) and where that dim is in the dot result; None: this dot cannot share."""
    dot = c.dot
    other_t = ir.RankedTensorType(_other(c).type)
    dims = DotDims.of(dot)
    side = 1 - c.operand_index
    free = dims.free(side)
    if len(free) != 1:
        return None
    masked = tuple(-1 if d == free[0] else size for d, size in enumerate(other_t.shape))
    # (attributes and types are uniqued in their context: equal exactly when the same object)
    attributes = tuple(sorted(((name, value) for name, value in dot.attributes.items()
                               if not name.startswith(TRANSIENT_MARK_PREFIX)), key=lambda item: item[0]))
    key = (c.path, c.operand_index, c.role, c.dim, c.result_dim, c.other_dim, attributes,
           _partial_element_type(c), other_t.element_type, masked)
    return key, free[0], dims.free_result_offset(side)


def merge_groups(consumers: list[Consumer], merge: bool) -> list[tuple[list[int], tuple[int, int] | None]]:
    """The consumers (by index) the ring computes with one dot per round, in the order of each
    group's first consumer, with the merged group's (other operand's dim, result dim); one
    consumer per group when ``merge`` is off or its dot cannot share.  The rewrite builds its
    :class:`_DotGroup` from this, the cost model sizes the ring's dots by it."""
    groups: dict[tuple, list[int]] = {}
    order: list[tuple[list[int], tuple[int, int] | None]] = []
    for i, c in enumerate(consumers):
        found = _merge_key(c) if merge else None
        if found is None:
            order.append(([i], None))
        elif found[0] in groups:
            groups[found[0]].append(i)
        else:
            groups[found[0]] = [i]
            order.append((groups[found[0]], found[1:]))
    return order


def _dot_groups(plans: list[_Plan], merge: bool, merged: list | None = None) -> list[_DotGroup]:
    """The plans grouped as :func:`merge_groups` groups their consumers (``merged``: its answer
    for them, where the caller has it)."""
    if merged is None:
        merged = merge_groups([p.c for p in plans], merge)
    return [_DotGroup([plans[i] for i in members], *dims) if len(members) > 1 else _DotGroup([plans[members[0]]])
            for members, dims in merged]


def rewrite_all_gather_dot(site: AllGatherSite, ctx: RewriteContext, merged: list | None = None) -> Applied:
    """Replace ``site``'s all_gather and its consumer dots by one ring (``merged``: its consumers'
    :func:`merge_groups` under ``ctx.merge_dots``, where the caller worked them out; a copy of the
    site in a ring function groups as the site does)."""
    ag, n, dim = site.all_gather, site.ring.size, site.gather_dim
    shard = ag.operation.operands[0]
    shard_rows = ir.RankedTensorType(shard.type).shape[dim]
    streams = gather_streams(n, ctx.bidirectional)
    # stream i's permutes: shift +1 holds pos + r (receives from the next position), -1 the other way
    pairs = [site.ring.shift_pairs(RECEIVE_FROM_NEXT * s.shift) for s in streams]
    signatures = gather_signatures(streams)

    loop_b = Builder(ir.Location.fused([ag.location] + [c.dot.location for c in site.consumers]), ctx.constants)
    comm = loop_b.at(ag.location)
    plans = [_Plan(c, n, loop_b, ctx) for c in site.consumers]
    groups = _dot_groups(plans, ctx.merge_dots, merged)
    # more than one round or direction computing in one block: keep their dots apart
    tie = ctx.tie_rounds and (len(streams) > 1 or ctx.unroll != 1)
    barriers = DotBarriers(tie, site.insert_before.block)

    def compute(held: ir.Value, k: ir.Value, state: list[ir.Value], stream: int, dots: list) -> list[ir.Value]:
        blocks: dict[LayoutStep, ir.Value] = {}
        values: dict[ir.Value, ir.Value] = {ag.result: held}  # a DAG's values' blocks (shard k's rows)

        def through(c: Consumer) -> ir.Value:
            if c.dag:  # a norm of the rows: each step reads its operands' blocks, once per shard
                b = loop_b.at(c.dot.location)

                def rows_of(value: ir.Value, at: int, width: int) -> ir.Value:  # shard k's rows of a value
                    return b.dynamic_slice(value, at, b.scaled(k, width), width)

                apply_dag(tuple(step for step in c.path if step.op.result not in values), values, n, rows_of)
                return values[c.dot.operation.operands[c.operand_index]]
            value = held
            for node in c.path:  # shared path prefixes are applied once per shard
                if node not in blocks:
                    blocks[node] = node.apply(value, n)
                value = blocks[node]
            return value

        new = [group.accumulate(acc, through(group.lead.c), k, stream, dots, barriers)
               for group, acc in zip(groups, state)]
        if site.assembles:
            new.append(comm.dynamic_update_slice(state[-1], held, dim, comm.scaled(k, shard_rows)))
        return new

    previous: dict = {}  # the block of the round emitted last, and one of its dots

    def round_fn(rnd: Round, carried: list[ir.Value]) -> list[ir.Value]:
        held, state = carried[: len(streams)], carried[len(streams) :]
        received = list(held)
        permutes: list = [None] * len(streams)
        dots: list[list] = [[] for _ in streams]
        block = ir.InsertionPoint.current.block
        # in a block of several rounds, a round's transfer starts after the previous round's dot:
        # else XLA's scheduler may start it during that dot, leaving the previous transfer with
        # no dot of its own (an H100 compile left the first permute of each gate/up trip exposed)
        after = previous["dot"] if tie and previous and previous["block"] == block else None
        for i, (stream, (_, sends)) in enumerate(zip(streams, rnd.signature)):
            if sends:
                channels.append(ctx.take_channel())
                sent = comm.tied([held[i], after])[0] if after is not None else held[i]
                received[i] = comm.collective_permute(sent, pairs[i], channels[-1])
                permutes[i] = received[i].owner
        for i, (stream, (computes, _)) in enumerate(zip(streams, rnd.signature)):
            if computes:
                k = ring_position(loop_b, position, rnd, n, shift=stream.shift, ring=site.ring, region=site.region)
                state = compute(held[i], k, state, 1 + rnd.slot * len(streams) + i, dots[i])
        for permute, group in zip(permutes, dots):
            ctx.annotator.group(permute, group)
        emitted = [op for group in dots for op in group]
        previous.update(block=block, dot=emitted[0].result if emitted else None)
        return received + state

    stats = ScheduleStats()
    channels: list[int] = []  # a fresh handle for every permute op emitted
    with ir.InsertionPoint(site.insert_before):
        position = loop_b.position_in_ring(site.ring, site.region)
        inits = [group.prepare() for group in groups]
        if site.assembles:
            inits.append(comm.zeros(ir.RankedTensorType(ag.result.type)))
        final = emit_rounds(loop_b, signatures, [shard] * len(streams) + inits, round_fn, ctx.unroll, stats)
        state = final[len(streams) :]
        results = [result for group, acc in zip(groups, state) for result in group.finish(acc)]
    # nodes of the gathered value that stood before the ring's place (a reshape or a scaling of
    # the whole value that a later op reads) now read the assembled value: they follow the ring
    # (parents before children: the order they keep)
    for node in site.nodes:
        if node.op.operation.is_before_in_block(site.insert_before):
            node.op.operation.move_before(site.insert_before)

    for plan, result in zip([plan for group in groups for plan in group.plans], results):
        plan.c.dot.result.replace_all_uses_with(result)
        plan.c.dot.operation.erase()
    erase_dead([node.op for node in reversed(site.nodes)] + path_sources(site.nodes))
    if site.assembles:
        ag.result.replace_all_uses_with(state[-1])
    ag.operation.erase()
    notes = ["bidirectional: a ring of 2 needs one direction"] if ctx.bidirectional and n == 2 else []
    return Applied(
        channels,
        len(streams),
        stats,
        sum(sends for signature in signatures for _, sends in signature),
        notes,
    )

