"""all_gather → dot_general(s), as one windowed ring.

Before (ring of n; the gathered value feeds one or more dots, possibly through
layout ops)::

    %g  = stablehlo.all_gather(%x) {all_gather_dim = d, replica_groups = G}
    %y1 = dot_general(%g, %w1)            // free role: d is a free dim of the operand
    %y2 = dot_general(%g, %w2)            // contracting role: d is contracted

After (unidirectional, one round per trip)::

    %pos = table[partition_id]            // my position in my group of G
    %held, %acc1, %acc2 [, %full] = while (%i = 0; %i < n-1; %i++)
            carry (%x, zeros, zeros [, zeros]) {
        %next = collective_permute(%held)   // position k sends to k-1: I receive shard pos+i+1
        %k    = (pos + i) mod n             // the shard I hold now
        %acc1 = dynamic_update_slice(%acc1, dot(%held, %w1), offset = k * block)
        %acc2 = %acc2 + dot(%held, dynamic_slice(%w2, k * block))
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

``%full`` is built only when some op other than the loop's dots still reads the
gathered value (it then reads ``%full``).  Contracting partials of bf16/f16 dots are
summed in f32 and converted once at the end.  Compute ops carry their dot's location,
the permutes the all_gather's.
"""

from __future__ import annotations


from .._jax_private import ir
from ..cost import gather_streams
from ..layout import LayoutStep
from ..matchers import AllGatherSite, Consumer
from .builders import Builder, erase_dead, shard_type
from .schedule import Applied, RewriteContext, Round, ScheduleStats, emit_rounds, ring_position

#: Each step receives the shard of the next position: position k sends to k-1.
RECEIVE_FROM_NEXT = -1

_NARROW_FLOATS = (ir.BF16Type, ir.F16Type)


class _Plan:
    """How one consumer dot accumulates over the ring."""

    def __init__(self, consumer: Consumer, n: int, b: Builder, ctx: RewriteContext):
        self.c = consumer
        self.n = n
        self.ctx = ctx
        self.compute = b.at(consumer.dot.location)
        self.result_t = ir.RankedTensorType(consumer.dot.result.type)
        if consumer.role == "free":
            self.acc_t = self.result_t
            self.partial_t = shard_type(self.result_t, consumer.result_dim, n)
        else:
            element = self.result_t.element_type
            if isinstance(element, _NARROW_FLOATS) and "algorithm" not in consumer.dot.attributes:
                element = ir.F32Type.get()  # sum the n partial contractions in f32
            self.acc_t = ir.RankedTensorType.get(self.result_t.shape, element)
            self.partial_t = self.acc_t

    def init(self) -> ir.Value:
        return self.compute.zeros(self.acc_t)

    def update(self, acc: ir.Value, block: ir.Value, k: ir.Value, stream: int, dots: list) -> ir.Value:
        c, b = self.c, self.compute
        operands = list(c.dot.operation.operands)
        operands[c.operand_index] = block
        if c.role == "contracting":
            width = ir.RankedTensorType(block.type).shape[c.dim]
            other = operands[1 - c.operand_index]
            operands[1 - c.operand_index] = b.dynamic_slice(other, c.other_dim, b.scaled(k, width), width)
        partial = self.ctx.annotator.dot(b, c.dot, self.partial_t, operands[0], operands[1], stream)
        dots.append(partial.owner)
        if c.role == "contracting":
            return b.add(acc, partial)
        rows = self.partial_t.shape[c.result_dim]
        return b.dynamic_update_slice(acc, partial, c.result_dim, b.scaled(k, rows))

    def finish(self, acc: ir.Value) -> ir.Value:
        return self.compute.convert(acc, self.result_t.element_type)


def rewrite_all_gather_dot(site: AllGatherSite, ctx: RewriteContext) -> Applied:
    """Replace ``site``'s all_gather and its consumer dots by one ring."""
    ag, n, dim = site.all_gather, site.ring.size, site.gather_dim
    shard = ag.operation.operands[0]
    shard_rows = ir.RankedTensorType(shard.type).shape[dim]
    streams = gather_streams(n, ctx.bidirectional)
    # stream i's permutes: shift +1 holds pos + r (receives from the next position), -1 the other way
    pairs = [site.ring.shift_pairs(RECEIVE_FROM_NEXT * s.shift) for s in streams]
    rounds = streams[0].last + 1
    signatures = [tuple((s.computes(r), s.sends(r)) for s in streams) for r in range(rounds)]

    loop_b = Builder(ir.Location.fused([ag.location] + [c.dot.location for c in site.consumers]), ctx.constants)
    comm = loop_b.at(ag.location)
    plans = [_Plan(c, n, loop_b, ctx) for c in site.consumers]

    def compute(held: ir.Value, k: ir.Value, state: list[ir.Value], stream: int, dots: list) -> list[ir.Value]:
        blocks: dict[LayoutStep, ir.Value] = {}

        def through(path: tuple[LayoutStep, ...]) -> ir.Value:
            value = held
            for node in path:  # shared path prefixes are applied once per shard
                if node not in blocks:
                    blocks[node] = node.apply(value, n)
                value = blocks[node]
            return value

        new = [plan.update(acc, through(plan.c.path), k, stream, dots) for plan, acc in zip(plans, state)]
        if site.assembles:
            new.append(comm.dynamic_update_slice(state[-1], held, dim, comm.scaled(k, shard_rows)))
        return new

    def round_fn(rnd: Round, carried: list[ir.Value]) -> list[ir.Value]:
        held, state = carried[: len(streams)], carried[len(streams) :]
        received = list(held)
        permutes: list = [None] * len(streams)
        dots: list[list] = [[] for _ in streams]
        for i, (stream, (_, sends)) in enumerate(zip(streams, rnd.signature)):
            if sends:
                channels.append(ctx.take_channel())
                received[i] = comm.collective_permute(held[i], pairs[i], channels[-1])
                permutes[i] = received[i].owner
        for i, (stream, (computes, _)) in enumerate(zip(streams, rnd.signature)):
            if computes:
                k = ring_position(loop_b, position, rnd, n, shift=stream.shift)
                state = compute(held[i], k, state, 1 + rnd.slot * len(streams) + i, dots[i])
        for permute, group in zip(permutes, dots):
            ctx.annotator.group(permute, group)
        return received + state

    stats = ScheduleStats()
    channels: list[int] = []  # a fresh handle for every permute op emitted
    with ir.InsertionPoint(site.insert_before):
        position = loop_b.position_in_ring(site.ring, site.region)
        inits = [plan.init() for plan in plans]
        if site.assembles:
            inits.append(comm.zeros(ir.RankedTensorType(ag.result.type)))
        final = emit_rounds(loop_b, signatures, [shard] * len(streams) + inits, round_fn, ctx.unroll, stats)
        state = final[len(streams) :]
        results = [plan.finish(acc) for plan, acc in zip(plans, state)]

    for plan, result in zip(plans, results):
        plan.c.dot.result.replace_all_uses_with(result)
        plan.c.dot.operation.erase()
    erase_dead([node.op for node in reversed(site.nodes)])
    if site.assembles:
        ag.result.replace_all_uses_with(state[-1])
    ag.operation.erase()
    notes = ["bidirectional: a ring of 2 needs one direction"] if ctx.bidirectional and n == 2 else []
    return Applied(
        channels,
        len(streams),
        stats,
        sum(s.sends(r) for s in streams for r in range(rounds)),
        notes,
    )

