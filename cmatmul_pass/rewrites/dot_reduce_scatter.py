"""dot_general → reduce_scatter(sum), as a windowed ring loop.

Before (ring of n; the scattered dim of the product is free dim ``e`` of operand
``a``; layout ops may sit between the dot and the reduce_scatter)::

    %d = dot_general(%a, %b)                                        // [.., n*s, ..]
    %r = stablehlo.reduce_scatter(%d) {scatter_dimension = r, sum}  // [.., s, ..]

After::

    %pos = table[partition_id]
    %acc = block((pos + 1) mod n)               // peeled first step: nothing to receive yet
    %acc = while (%i = 0; %i < n-1; %i++) carry (%acc) {
        %recv = collective_permute(%acc)        // position k sends to k-1
        yield %recv + block((pos + i + 2) mod n)
    }
    // block(c) = layout ops of dot_general(dynamic_slice(%a, e, c*s, s), %b): block c of the product

At step ``i`` position ``p`` adds its share of block ``p+i+1`` to the partial sum
that position ``p+1`` started for it, so after ``n-1`` permutes every position
holds the full sum of its own block.  The permute of a step and its dot are
independent; the first step is the one peeled, so no zeros are ever sent.  The
partial sum travels in the reduce_scatter's own element type (the bytes the
reduce_scatter would move).
"""

from __future__ import annotations

from .._jax_private import ir
from ..layout import apply_path
from ..matchers import ReduceScatterSite
from .builders import Builder, counted_loop, erase_dead, shard_type

#: The partial sum travels to the previous position (position k sends to k-1).
SEND_TO_PREVIOUS = -1


def rewrite_dot_reduce_scatter(site: ReduceScatterSite, channel: int) -> None:
    rs, dot, n = site.reduce_scatter, site.dot, site.ring.size
    operands = list(dot.operation.operands)
    sliced = operands[site.operand_index]
    width = ir.RankedTensorType(sliced.type).shape[site.operand_dim] // n
    block_t = shard_type(ir.RankedTensorType(dot.result.type), site.result_dim, n)
    pairs = site.ring.shift_pairs(SEND_TO_PREVIOUS)

    loop_b = Builder(ir.Location.fused([dot.location, rs.location]))
    compute = loop_b.at(dot.location)
    comm = loop_b.at(rs.location)

    def block(index: ir.Value) -> ir.Value:
        args = list(operands)
        args[site.operand_index] = compute.dynamic_slice(sliced, site.operand_dim, compute.mul(index, compute.i32(width)), width)
        return apply_path(site.path, compute.dot_like(dot, block_t, *args), n)

    def body(i: ir.Value, carried: list[ir.Value]) -> list[ir.Value]:
        (acc,) = carried
        received = comm.collective_permute(acc, pairs, channel)
        return [comm.add(received, block(loop_b.ring_index(position, i, n, offset=2)))]

    with ir.InsertionPoint(rs.operation):
        position = loop_b.position_in_ring(site.ring, site.region)
        first = block(loop_b.ring_index(position, loop_b.i32(1), n))
        (result,) = counted_loop(loop_b, n - 1, [first], body)

    rs.result.replace_all_uses_with(result)
    rs.operation.erase()
    erase_dead([step.op for step in reversed(site.path)] + [dot])
