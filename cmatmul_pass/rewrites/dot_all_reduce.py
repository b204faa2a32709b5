"""dot_general → all_reduce(sum): split into a reduce-scatter ring and a gather, or chunk the rows.

**split** (``all_reduce = all_gather ∘ reduce_scatter`` along dim ``D`` of the product,
:class:`~cmatmul_pass.matchers.all_reduce.AllReduceSite`)::

    %y = all_reduce(sum)(dot(%h, %w))                  // [T, H], the same on every device

becomes::

    %s = reduce_scatter(sum, dim D)(dot(%h, %w))      // [T/n, H]: this device's rows
    %y = all_gather(dim D)(%s)                         // [T, H]

The pipeline then rewrites the reduce_scatter as a ring (every variant), and
:mod:`.sequence_parallel` carries ``%s`` forward past the row-wise ops that read ``%y``
(residual adds, norms), gathering only where a value must be whole: into the next
matmul's gather ring, or once before the return.  The same bytes cross the wire as a ring
all_reduce moves.

**chunk** (``k`` chunks of ``D``)::

    %y = concatenate(all_reduce(dot(%h[0:T/k], %w)), ..., all_reduce(dot(%h[(k-1)T/k:], %w)), dim D)

Chunk ``i``'s all_reduce can run while chunk ``i+1``'s dot computes (with
``--annotate-streams`` the pair shares a ``_scheduling_group_id``); the all_reduce
primitive stays, which NVLink-SHARP hardware runs faster than a ring.  A second run of the
pass leaves the chunks: the matcher declines an all_reduce concatenated with other sums
(``chunked``).
"""

from __future__ import annotations

from .._jax_private import hlo, ir
from ..layout import path_sources
from ..matchers.all_reduce import AllReduceSite
from .builders import Builder, erase_dead, shard_type
from .dot_reduce_scatter import path_block
from .schedule import Applied, RewriteContext, ScheduleStats


def chunk_dims_ok(site: AllReduceSite, chunks: int) -> bool:
    """Can the product be cut into ``chunks`` equal pieces along the site's dim (every sliced
    operand dim divisible, every look-through op keeping the pieces whole)?"""
    if chunks < 2:
        return False
    for term in site.terms:
        for index, dim in term.sliced():
            if ir.RankedTensorType(term.dot.operation.operands[index].type).shape[dim] % chunks:
                return False
    return all(step.valid_for(chunks) for step in site.path)


def split_all_reduce(site: AllReduceSite, take_channel) -> tuple[ir.OpView, ir.OpView]:
    """Replace the all_reduce by ``all_gather(reduce_scatter(operand))`` along ``site.dim``, built
    where it stood; returns (reduce_scatter, all_gather)."""
    rs, ag = split_sum(site.all_reduce, site.dim, site.block_type, take_channel)
    move_after(site.moved, ag.operation)
    return rs, ag


def split_sum(ar: ir.OpView, dim: int, block_type: ir.RankedTensorType, take_channel) -> tuple[ir.OpView, ir.OpView]:
    """``all_reduce(sum) = all_gather ∘ reduce_scatter(sum)`` along ``dim`` (``block_type``: one
    device's block), over the all_reduce's groups, built where it stood; returns (reduce_scatter,
    all_gather)."""
    loc = ar.location
    groups = ar.attributes["replica_groups"]
    with ir.InsertionPoint(ar.operation):
        rs = hlo.ReduceScatterOp(block_type, ar.operation.operands[0], dim, groups,
                                 channel_handle=hlo.ChannelHandle.get(take_channel(), 1),
                                 use_global_device_ids=True, loc=loc)
        sum_region(rs, loc)
        ag = hlo.AllGatherOp([ar.result.type], [rs.result], dim, groups,
                             channel_handle=hlo.ChannelHandle.get(take_channel(), 1),
                             use_global_device_ids=True, loc=loc)
    ar.result.replace_all_uses_with(ag.results[0])
    ar.operation.erase()
    return rs, ag


def move_after(ops, after: ir.Operation) -> None:
    """Move ``ops`` (producers first: the readers of a sum over the rows the rewrite computes
    with the product, :attr:`AllReduceSite.moved`) after ``after``, keeping their order."""
    for op in ops:
        op.operation.move_after(after)
        after = op.operation


def sum_region(op: ir.OpView, loc: ir.Location) -> None:
    """Give a reducing collective its ``add`` region over scalars of its element type."""
    scalar = ir.RankedTensorType.get([], ir.RankedTensorType(op.operation.operands[0].type).element_type)
    block = op.operation.regions[0].blocks.append(scalar, scalar, arg_locs=[loc, loc])
    with ir.InsertionPoint(block):
        hlo.ReturnOp([hlo.AddOp(*block.arguments, loc=loc).result], loc=loc)


def sum_all_reduce(value: ir.Value, replica_groups: ir.Attribute, channel: int, loc: ir.Location) -> ir.OpView:
    """A sum all_reduce of ``value`` over ``replica_groups`` (device ids), on ``channel``."""
    op = hlo.AllReduceOp([value.type], [value], replica_groups, channel_handle=hlo.ChannelHandle.get(channel, 1),
                         use_global_device_ids=True, loc=loc)
    sum_region(op, loc)
    return op


def all_reduce_like(template: ir.OpView, value: ir.Value, channel: int, loc: ir.Location) -> ir.OpView:
    """A sum all_reduce of ``value`` over ``template``'s groups, with a fresh channel: a copy of
    ``template`` (a matched sum of one operand: its reduction, one C++ clone) reading ``value``, of
    its type; built anew where ``template`` carries more than its groups, channel and device-id
    flag (a frontend attribute, say, which the chunks do not inherit)."""
    op = template.operation
    if len(op.operands) != 1 or len(op.attributes) != 3 or template.location != loc:
        return sum_all_reduce(value, template.attributes["replica_groups"], channel, loc)
    op = op.clone()  # at the insertion point
    op.operands[0] = value
    op.results[0].set_type(value.type)
    op.attributes["channel_handle"] = hlo.ChannelHandle.get(channel, 1)
    return op.opview


def chunk_all_reduce(site: AllReduceSite, ctx: RewriteContext, chunks: int) -> Applied:
    """The product in ``chunks`` row chunks, each summed by its own all_reduce (module docstring)."""
    ar = site.all_reduce
    b = Builder(ar.location, ctx.constants)
    channels: list[int] = []
    pieces: list[ir.Value] = []
    previous = None
    sums = [step for step in site.path if step.sums_rows]  # a gain's gradient: each chunk's share added up
    totals: list = [None] * len(sums)
    with ir.InsertionPoint(ar.operation):
        for i in range(chunks):
            dots: list = []

            def product(term, i=i, dots=dots) -> ir.Value:
                compute = b.at(term.dot.location)
                args = list(term.dot.operation.operands)
                for index, dim in term.sliced():
                    width = ir.RankedTensorType(args[index].type).shape[dim] // chunks
                    args[index] = compute.slice(args[index], dim, i * width, width)
                piece_t = shard_type(ir.RankedTensorType(term.dot.result.type), term.result_dim, chunks)
                value = ctx.annotator.dot(compute, term.dot, piece_t, args[0], args[1], 1)
                dots.append(value.owner)
                return value

            # the path (a chain, or a DAG: a norm's backward) applied to this chunk's rows, a
            # per-row operand read at them
            total, shares = path_block(site, (product(term) for term in site.terms), chunks,
                                       lambda v, d, w, i=i: b.slice(v, d, i * w, w), b.add)
            totals = [share if t is None else b.at(step.op.location).add(t, share)
                      for step, t, share in zip(sums, totals, shares)]
            ctx.annotator.group(previous, dots)  # the previous chunk's sum overlaps these dots
            channels.append(ctx.take_channel())
            previous = all_reduce_like(ar, total, channels[-1], ar.location)
            pieces.append(previous.result)
        result = b.concatenate(pieces, site.dim)
    for step, total in zip(sums, totals):  # each device's sum over all its rows, as the original's
        step.op.result.replace_all_uses_with(total)
    ar.result.replace_all_uses_with(result)
    move_after(site.moved, ar.operation)  # they read those sums, now computed where the all_reduce is
    ar.operation.erase()
    erase_dead([step.op for step in reversed(site.path)] + path_sources(site.path) + list(site.adds)
               + [t.dot for t in site.terms])
    stats = ScheduleStats(rounds=chunks, peeled=chunks)
    return Applied(channels, 1, stats, 0, [f"chunked into {chunks} all_reduces along dim {site.dim}"])
