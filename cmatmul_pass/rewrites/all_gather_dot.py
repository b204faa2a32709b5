"""all_gather → dot_general(s), as one windowed ring loop.

Before (ring of n; the gathered value feeds one or more dots, possibly through
layout ops)::

    %g  = stablehlo.all_gather(%x) {all_gather_dim = d, replica_groups = G}
    %y1 = dot_general(%g, %w1)            // free role: d is a free dim of the operand
    %y2 = dot_general(%g, %w2)            // contracting role: d is contracted

After::

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
    ... the same step once more for k = (pos + n-1) mod n, without a permute (peeled)

n-1 permutes for a ring of n; the permute of a step does not depend on its dots, so a
scheduler can overlap them.  ``%full`` is built only when some op other than the
loop's dots still reads the gathered value (it then reads ``%full``).  Contracting
partials of bf16/f16 dots are summed in f32 and converted once at the end.  Compute
ops carry their dot's location, the permute the all_gather's.
"""

from __future__ import annotations

from .._jax_private import ir
from ..layout import LayoutStep
from ..matchers import AllGatherSite, Consumer
from .builders import Builder, counted_loop, erase_dead, shard_type

#: Each step receives the shard of the next position: position k sends to k-1.
RECEIVE_FROM_NEXT = -1

_NARROW_FLOATS = (ir.BF16Type, ir.F16Type)


class _Plan:
    """How one consumer dot accumulates over the ring."""

    def __init__(self, consumer: Consumer, n: int, b: Builder):
        self.c = consumer
        self.n = n
        self.compute = b.at(consumer.dot.location)
        self.result_t = ir.RankedTensorType(consumer.dot.result.type)
        dot_attrs = consumer.dot.attributes
        if consumer.role == "free":
            self.acc_t = self.result_t
            self.partial_t = shard_type(self.result_t, consumer.result_dim, n)
        else:
            element = self.result_t.element_type
            if isinstance(element, _NARROW_FLOATS) and "algorithm" not in dot_attrs:
                element = ir.F32Type.get()  # sum the n partial contractions in f32
            self.acc_t = ir.RankedTensorType.get(self.result_t.shape, element)
            self.partial_t = self.acc_t

    def init(self) -> ir.Value:
        return self.compute.zeros(self.acc_t)

    def update(self, acc: ir.Value, block: ir.Value, k: ir.Value) -> ir.Value:
        c, b = self.c, self.compute
        operands = list(c.dot.operation.operands)
        operands[c.operand_index] = block
        if c.role == "free":
            partial = b.dot_like(c.dot, self.partial_t, *operands)
            rows = self.partial_t.shape[c.result_dim]
            return b.dynamic_update_slice(acc, partial, c.result_dim, b.mul(k, b.i32(rows)))
        width = ir.RankedTensorType(block.type).shape[c.dim]
        other = operands[1 - c.operand_index]
        operands[1 - c.operand_index] = b.dynamic_slice(other, c.other_dim, b.mul(k, b.i32(width)), width)
        return b.add(acc, b.dot_like(c.dot, self.partial_t, *operands))

    def finish(self, acc: ir.Value) -> ir.Value:
        return self.compute.convert(acc, self.result_t.element_type)


def rewrite_all_gather_dot(site: AllGatherSite, channel: int) -> None:
    """Replace ``site``'s all_gather and its consumer dots by one ring loop."""
    ag, n, dim = site.all_gather, site.ring.size, site.gather_dim
    shard = ag.operation.operands[0]
    shard_rows = ir.RankedTensorType(shard.type).shape[dim]
    pairs = site.ring.shift_pairs(RECEIVE_FROM_NEXT)
    loop_b = Builder(ir.Location.fused([ag.location] + [c.dot.location for c in site.consumers]))
    comm = loop_b.at(ag.location)
    plans = [_Plan(c, n, loop_b) for c in site.consumers]

    def step(held: ir.Value, k: ir.Value, state: list[ir.Value]) -> list[ir.Value]:
        blocks: dict[LayoutStep, ir.Value] = {}

        def through(path: tuple[LayoutStep, ...]) -> ir.Value:
            value = held
            for node in path:  # shared path prefixes are applied once per step
                if node not in blocks:
                    blocks[node] = node.apply(value, n)
                value = blocks[node]
            return value

        new = [plan.update(acc, through(plan.c.path), k) for plan, acc in zip(plans, state)]
        if site.assembles:
            new.append(comm.dynamic_update_slice(state[-1], held, dim, comm.mul(k, comm.i32(shard_rows))))
        return new

    def body(i: ir.Value, carried: list[ir.Value]) -> list[ir.Value]:
        held, *state = carried
        received = comm.collective_permute(held, pairs, channel)
        return [received, *step(held, loop_b.ring_index(position, i, n), state)]

    with ir.InsertionPoint(site.consumers[0].dot.operation):
        position = loop_b.position_in_ring(site.ring, site.region)
        inits = [plan.init() for plan in plans]
        if site.assembles:
            inits.append(comm.zeros(ir.RankedTensorType(ag.result.type)))
        held, *state = counted_loop(loop_b, n - 1, [shard, *inits], body)
        state = step(held, loop_b.ring_index(position, loop_b.i32(n - 1), n), state)
        results = [plan.finish(acc) for plan, acc in zip(plans, state)]

    for plan, result in zip(plans, results):
        plan.c.dot.result.replace_all_uses_with(result)
        plan.c.dot.operation.erase()
    erase_dead([node.op for node in reversed(site.nodes)])
    if site.assembles:
        ag.result.replace_all_uses_with(state[-1])
    ag.operation.erase()
