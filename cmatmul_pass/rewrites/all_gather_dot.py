"""all_gather → dot_general on a free dimension, as a windowed ring loop.

Before (ring of n, the gathered operand on the lhs, gathered on a free dim)::

    %g = stablehlo.all_gather(%x) {all_gather_dim = d, replica_groups = G}   // [.., n*s, ..]
    %y = stablehlo.dot_general(%g, %w)                                       // [.., n*s', ..]

After::

    %pos  = table[partition_id]                   // my position in my group of G
    %acc0 = zeros like %y
    %held, %acc = while (%i = 0; %i < n-1; %i++) carry (%held = %x, %acc = %acc0) {
        %next = collective_permute(%held)         // position k sends to k-1: I receive shard pos+i+1
        %p    = dot_general(%held, %w)            // the partial result of shard (pos+i) mod n
        %acc' = dynamic_update_slice(%acc, %p, offset = ((pos+i) mod n) * s')
        yield %next, %acc'
    }
    %p_last = dot_general(%held, %w)              // peeled: no permute after the last shard
    %y'     = dynamic_update_slice(%acc, %p_last, offset = ((pos+n-1) mod n) * s')

n-1 permutes for a ring of n; the permute of step i and the dot of step i are
independent, so a scheduler can overlap them.  Compute ops carry the dot's location,
the permute the all_gather's.
"""

from __future__ import annotations

from .._jax_private import ir
from ..matchers import AllGatherDotMatch
from .builders import Builder, counted_loop, shard_type

#: Each step receives the shard of the next position: position k sends to k-1.
RECEIVE_FROM_NEXT = -1


def rewrite_all_gather_dot(match: AllGatherDotMatch, channel: int) -> ir.Value:
    """Replace ``match``'s all_gather+dot by a ring loop; returns the value replacing the dot."""
    ag, dot, n = match.all_gather, match.dot, match.ring.size
    shard = ag.operation.operands[0]
    operands = list(dot.operation.operands)
    result_t = ir.RankedTensorType(dot.result.type)
    partial_t = shard_type(result_t, match.result_dim, n)
    rows = partial_t.shape[match.result_dim]
    pairs = match.ring.shift_pairs(RECEIVE_FROM_NEXT)

    loop_b = Builder(ir.Location.fused([ag.location, dot.location]))
    compute = Builder(dot.location)
    comm = Builder(ag.location)

    def partial_dot(held: ir.Value) -> ir.Value:
        operands[match.operand_index] = held
        return compute.dot_like(dot, partial_t, operands[0], operands[1])

    def write(acc: ir.Value, partial: ir.Value, step: ir.Value) -> ir.Value:
        index = loop_b.ring_index(position, step, n)
        return compute.dynamic_update_slice(acc, partial, match.result_dim, loop_b.mul(index, loop_b.i32(rows)))

    def body(step: ir.Value, carried: list[ir.Value]) -> list[ir.Value]:
        held, acc = carried
        received = comm.collective_permute(held, pairs, channel)
        return [received, write(acc, partial_dot(held), step)]

    with ir.InsertionPoint(dot):
        position = loop_b.position_in_ring(match.ring)
        held, acc = counted_loop(loop_b, n - 1, [shard, loop_b.zeros(result_t)], body)
        result = write(acc, partial_dot(held), loop_b.i32(n - 1))

    dot.result.replace_all_uses_with(result)
    dot.operation.erase()
    ag.operation.erase()
    return result
