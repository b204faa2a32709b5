"""An all_to_all pair chunked (:class:`~cmatmul_pass.matchers.all_to_all.AllToAllSite`, whose
docstring states the identity and its side conditions)::

    %y = all_to_all(%x)            // the dispatch
    %w = R(%y)                     // the experts (ops between)
    %z = all_to_all(%w)            // the combine

becomes, for ``k`` chunks of the tracked dim::

    %y0 = all_to_all(%x[chunk 0])
    %y1 = all_to_all(%x[chunk 1])        // in flight while R computes chunk 0
    %z0 = all_to_all(R(%y0))
    %y2 = ...
    %z  = concatenate(%z0, ..., %z{k-1}, dim d')

in that order: chunk ``j+1``'s dispatch is issued before chunk ``j``'s ops, chunk ``j``'s
combine after them, so a scheduler that runs collectives asynchronously (XLA's on GPU) overlaps
each exchange with a neighbouring chunk's matmuls (with ``--annotate-streams``, chunk ``j+1``'s
dispatch and chunk ``j``'s matmuls share a scheduling group).  Each op of ``R`` is cloned per chunk with
its own attributes, regions and location, its result the chunk's share of the tracked dim;
each side operand is read whole, sliced, or (a broadcast) rebuilt at the chunk's size, as the
site says (along the exchanged dim, each device's rows of the chunk).  Along the dispatch's
split dim each chunk takes the chunk's share of every destination's block (a strided slice), and
the combines' results interleave back in the same order.  A dot contracting the
tracked dim (a weight's gradient) gives a partial product per chunk, added up after the last.
A value of the pair read after it (a residual a training step saves) is reassembled
from its chunks in the original's order, after the last combine.
"""

from __future__ import annotations

from .._jax_private import hlo, ir
from .. import ir_utils
from ..matchers.all_to_all import EXCHANGED, SPLIT, AllToAllSite
from .blockwise import apply_step
from .builders import Builder, erase_dead
from .schedule import Applied, RewriteContext, ScheduleStats


def _exchange(template: ir.OpView, value: ir.Value, result_type: ir.Type, channel: int) -> ir.Value:
    """``template``'s all_to_all of ``value`` (at the current insertion point, its location)."""
    op = template.operation.clone()
    op.operands[0] = value
    op.results[0].set_type(result_type)
    op.attributes["channel_handle"] = hlo.ChannelHandle.get(channel, 1)
    return op.results[0]


def _chunk_type(value: ir.Value, dim: int, chunks: int) -> ir.RankedTensorType:
    t = ir.RankedTensorType(value.type)
    return ir_utils.with_dim(t, dim, t.shape[dim] // chunks)


def chunk_all_to_all(site: AllToAllSite, ctx: RewriteContext, chunks: int) -> Applied:
    """The pair in ``chunks`` chunks (module docstring)."""
    dispatch, combine = site.dispatch, site.combine
    b = Builder(dispatch.location, ctx.constants)
    x = dispatch.operation.operands[0]
    width = ir.RankedTensorType(x.type).shape[site.dim] // chunks
    channels: list[int] = []
    pieces: list[ir.Value] = []
    with ir.InsertionPoint(combine.operation):
        def send(j: int) -> ir.Value:
            channels.append(ctx.take_channel())
            part = (_strided_rows(x, site.dim, j, chunks, site.ring.size, b) if site.mode == SPLIT
                    else b.slice(x, site.dim, j * width, width))
            return _exchange(dispatch, part, _chunk_type(dispatch.operation.results[0], site.dim, chunks), channels[-1])

        dims = {dispatch.operation.results[0]: site.dim,
                **{r: step.out_dim for step in site.steps for r in step.op.operation.results}}
        # each escaping value's chunks: a partial product's to be added up, any other's reassembled
        kept_sums: dict = {value: [] for value in site.escapes if dims[value] is None}
        kept: dict = {value: [] for value in site.escapes if dims[value] is not None}
        arrived = send(0)
        for j in range(chunks):
            following = send(j + 1) if j + 1 < chunks else None
            env = {dispatch.operation.results[0]: arrived}
            for step in site.steps:
                env.update(zip(step.op.operation.results, _apply(step, env, j, chunks, site, b)))
            dots = [env[step.op.operation.results[0]].owner for step in site.steps
                    if step.op.operation.name == "stablehlo.dot_general"]
            if following is not None:  # (--annotate-streams) the next chunk's dispatch beside these dots
                ctx.annotator.group(following.owner, dots)
            for value, parts in (*kept.items(), *kept_sums.items()):
                parts.append(env[value])
            done = env[combine.operation.operands[0]]
            channels.append(ctx.take_channel())
            pieces.append(_exchange(combine, done, _chunk_type(combine.operation.results[0], site.out_dim, chunks),
                                    channels[-1]))
            arrived = following
        result = (_interleaved(pieces, site.out_dim, site.ring.size, b.at(combine.location)) if site.mode == SPLIT
                  else b.at(combine.location).concatenate(pieces, site.out_dim))
        wholes = {value: _interleaved(parts, dims[value], site.ring.size, b) if site.exchanged
                  else b.concatenate(parts, dims[value]) for value, parts in kept.items()}
        for value, parts in kept_sums.items():  # partial products added up, in chunk order
            total = parts[0]
            for part in parts[1:]:
                total = b.at(value.owner.location).add(total, part)
            wholes[value] = total
    combine.operation.results[0].replace_all_uses_with(result)
    combine.operation.erase()
    for value, whole in wholes.items():  # its readers after the pair (the ops of the pair are erased below)
        value.replace_all_uses_with(whole)
    erase_dead([step.op for step in reversed(site.steps)] + [dispatch])
    stats = ScheduleStats(rounds=chunks, peeled=chunks)
    how = {EXCHANGED: "the exchanged dim", SPLIT: "the split dim"}.get(site.mode, "dim")
    return Applied(channels, 1, stats, 0, [f"chunked into {chunks} all_to_all pairs along {how} {site.dim}"])


def _interleaved(parts: list[ir.Value], dim: int, n: int, b: Builder) -> ir.Value:
    """The whole of a value whose chunks each hold the chunk's rows of every device's block
    along ``dim``, device-major: ``[n, w]`` per chunk, concatenated along ``w``."""
    t = ir.RankedTensorType(parts[0].type)
    shape = list(t.shape)
    split = shape[:dim] + [n, shape[dim] // n] + shape[dim + 1:]
    grouped = [b.create("stablehlo.reshape", [ir.RankedTensorType.get(split, t.element_type)], [p]).result
               for p in parts]
    joined = b.concatenate(grouped, dim + 1)
    whole = shape[:dim] + [shape[dim] * len(parts)] + shape[dim + 1:]
    return b.create("stablehlo.reshape", [ir.RankedTensorType.get(whole, t.element_type)], [joined]).result


def _strided_rows(value: ir.Value, dim: int, j: int, chunks: int, n: int, b: Builder) -> ir.Value:
    """Chunk ``j`` of each of the ``n`` blocks of ``value`` along ``dim``, device-major (``[n, m]``
    sliced along ``m``)."""
    t = ir.RankedTensorType(value.type)
    shape = list(t.shape)
    rows = shape[dim] // n
    width = rows // chunks
    split = b.create("stablehlo.reshape", [ir.RankedTensorType.get(shape[:dim] + [n, rows] + shape[dim + 1:],
                                                                    t.element_type)], [value]).result
    part = b.slice(split, dim + 1, j * width, width)
    return b.create("stablehlo.reshape", [ir.RankedTensorType.get(shape[:dim] + [n * width] + shape[dim + 1:],
                                                                   t.element_type)], [part]).result


def _rows(value: ir.Value, dim: int, j: int, chunks: int, site: AllToAllSite, b: Builder) -> ir.Value:
    """Chunk ``j``'s rows of a side operand between the exchanges along ``dim``: a slice, or
    along the exchanged dim each device's rows of the chunk, device-major."""
    if site.exchanged:
        return _strided_rows(value, dim, j, chunks, site.ring.size, b)
    width = ir.RankedTensorType(value.type).shape[dim] // chunks
    return b.slice(value, dim, j * width, width)


def _apply(step, env: dict, j: int, chunks: int, site: AllToAllSite, b: Builder) -> list[ir.Value]:
    """``step``'s op on chunk ``j``: a clone reading the chunk's operands."""
    return apply_step(step, env, chunks, lambda value, dim, at: _rows(value, dim, j, chunks, site, at), b)
