"""Attention over gathered keys and values as one ring with an online softmax
(:class:`~cmatmul_pass.matchers.attention.AttentionSite`, whose docstring states the identity
and its side conditions).

Before (ring of ``n``; ``f`` the score ops, ``h`` the probabilities' linear ops)::

    %K = all_gather(%k)   %V = all_gather(%v)
    %s = f(dot(%q, %K))                 // [.., S_local, S]
    %p = softmax(%s) over S
    %o = dot(h(%p), %V)

After (one stream; bidirectional: a second travelling the other way, as for a gather ring)::

    %m, %l, %o = c, 0, 0                // per query row (f32 for l and o)
    for each round r (k = the block held: (pos + r) mod n):
        %k', %v' = collective_permute(%k, %v)       // the next block, in flight
        %s_k = f(dot(%q, K-path(%k)))   // [.., S_local, S/n]; side operands at block k's columns
        %m'  = max(%m, rowmax(%s_k));  %r = g(%m') (0 where -inf);  %c = exp(g(%m) - %r)
        %e   = exp(%s_k - %r)
        %l   = %l * %c + Σ %e
        %o   = %o * %c + dot(h(%e), V-path(%v))     // in f32
    %o = convert(%o / %l)

so the scores and probabilities live a block at a time (``S_local × S/n``), and each round's
transfer of the next K and V blocks runs while this round's two matmuls compute.  The rounds
are emitted by :func:`.schedule.emit_rounds` (a loop, unrolled, or straight-line, as for every
ring); with ``--annotate-streams``, each round's K permute shares a scheduling group with its
scores matmul, its V permute with its ``P·V``.
"""

from __future__ import annotations

from .. import ir_utils
from .._jax_private import hlo, ir
from ..matchers.attention import AttentionSite
from ..ring_plan import gather_signatures, gather_streams
from .all_gather_dot import RECEIVE_FROM_NEXT
from .block_operands import block as block_of
from .blockwise import apply_step, block_type
from .builders import Builder, erase_dead
from .schedule import Applied, RewriteContext, Round, ScheduleStats, emit_rounds, ring_position


def _clone(op: ir.OpView, operands: list[ir.Value], result: ir.Type | None = None) -> ir.Value:
    """``op`` cloned at the insertion point on ``operands`` (its result type ``result``, or its own)."""
    clone = op.operation.clone()
    for i, v in enumerate(operands):
        clone.operands[i] = v
    if result is not None:
        clone.results[0].set_type(result)
    return clone.results[0]


def _splat(b: Builder, t: ir.RankedTensorType, value: float) -> ir.Value:
    scalar = ir.RankedTensorType.get([], t.element_type)
    held = b.constant_of(ir.DenseElementsAttr.get_splat(scalar, ir.FloatAttr.get(t.element_type, value)))
    return b.create("stablehlo.broadcast_in_dim", [t], [held], {"broadcast_dimensions": ir.DenseI64ArrayAttr.get([])}).result


def _broadcast(b: Builder, value: ir.Value, t: ir.RankedTensorType, dims: list[int]) -> ir.Value:
    return b.create("stablehlo.broadcast_in_dim", [t], [value],
                    {"broadcast_dimensions": ir.DenseI64ArrayAttr.get(dims)}).result


class _Block:
    """One block of keys and values folded into the running ``(m, l, o)``."""

    def __init__(self, site: AttentionSite, ctx: RewriteContext, b: Builder):
        self.site, self.ctx, self.b = site, ctx, b
        self.n = site.ring.size
        self.stat_t = ir.RankedTensorType(site.row_max.result.type)
        pv_t = ir.RankedTensorType(site.pv.result.type)
        element = pv_t.element_type
        wide = isinstance(element, ir.FloatType) and ir.FloatType(element).width < 32
        self.out_t = ir.RankedTensorType.get(pv_t.shape, ir.F32Type.get() if wide else element)
        self.f32_stat = ir.RankedTensorType.get(ir.RankedTensorType(site.row_sum.result.type).shape,
                                                self.out_t.element_type)
        numbers = hlo.DotDimensionNumbers(site.pv.operation.attributes["dot_dimension_numbers"])
        side = site.pv_operand
        batch = list((numbers.lhs_batching_dimensions, numbers.rhs_batching_dimensions)[side])
        contracting = list((numbers.lhs_contracting_dimensions, numbers.rhs_contracting_dimensions)[side])
        rank = ir.RankedTensorType(site.pv.operation.operands[side].type).rank
        free = [d for d in range(rank) if d not in batch and d not in contracting]
        other_rank = ir.RankedTensorType(site.pv.operation.operands[1 - side].type).rank
        other_free = other_rank - len(batch) - len(list((numbers.lhs_contracting_dimensions,
                                                          numbers.rhs_contracting_dimensions)[1 - side]))
        offset = len(batch) + (other_free if side == 1 else 0)
        # where each dim of a row statistic (the probabilities' dims but the gathered one) stands in P·V's result
        self.stat_dims = [batch.index(d) if d in batch else offset + free.index(d)
                          for d in range(rank) if d not in contracting]

    def initial(self) -> list[ir.Value]:
        b = self.b
        return [_splat(b, self.stat_t, self.site.max_init), b.zeros(self.f32_stat), b.zeros(self.out_t)]

    def fold(self, keys: ir.Value, values: ir.Value, k: ir.Value, state: list[ir.Value], stream: int,
             dots: list) -> list[ir.Value]:
        """Block ``k`` (``keys``, ``values``: its shards) folded into ``state`` = ``[m, l, o]``."""
        site, n = self.site, self.n
        m, l, o = state
        env = {site.keys.operation.results[0]: keys, site.values.operation.results[0]: values}

        memo: dict = {}

        def rows(value: ir.Value, dim: int, at: Builder) -> ir.Value:  # block k's columns of a side operand
            width = ir.RankedTensorType(value.type).shape[dim] // n
            return block_of(value, dim, n, at.scaled(k, width), at, memo)  # (a mask: recomputed, not sliced)

        for step in (*site.key_steps, *site.value_steps):
            env.update(zip(step.op.operation.results, apply_step(step, env, n, rows, self.b)))
        b = self.b.at(site.scores.location)
        operands = list(site.scores.operation.operands[:2])
        side = 0 if operands[0] in env else 1
        operands[side] = env[operands[side]]
        scores = self.ctx.annotator.dot(b, site.scores, block_type(site.scores.result, site.score_dim, n), *operands,
                                        stream)
        dots.append(scores.owner)
        env[site.scores.result] = scores
        for step in site.score_steps:
            env.update(zip(step.op.operation.results, apply_step(step, env, n, rows, self.b)))
        s = env[site.row_max.operation.operands[0]]
        b = self.b.at(site.row_max.location)
        m_new = b.create("stablehlo.maximum", [m.type], [m, _clone(site.row_max, [s])]).result
        for op in site.layout:  # the scores in the layout the softmax subtracts in
            permutation = ir_utils.i64s(op, "permutation")
            shape = ir.RankedTensorType(s.type).shape
            s = _clone(op, [s], ir.RankedTensorType.get([shape[d] for d in permutation],
                                                        ir.RankedTensorType(s.type).element_type))
        reference, previous, chain = m_new, m, site.row_max.result
        for op in site.max_steps:  # g, on both the new and the previous running max
            reference = _clone(op, [reference if v == chain else v for v in op.operation.operands])
            previous = _clone(op, [previous if v == chain else v for v in op.operation.operands])
            chain = op.result
        reference = self._finite(b, reference)
        shifted = reference
        for op in site.max_broadcast:
            last = op.operation == site.max_broadcast[-1].operation
            shifted = _clone(op, [shifted], block_type(op.result, site.softmax_dim, n) if last else None)
        b = self.b.at(site.exp.location)
        e = _clone(site.exp, [_clone(site.subtract, [s, shifted], ir.RankedTensorType(s.type))],
                   ir.RankedTensorType(s.type))
        correction = b.create("stablehlo.exponential", [m.type], [
            b.create("stablehlo.subtract", [m.type], [previous, reference]).result]).result
        if site.stat_permutation is not None:  # (the max's layout to the sum's)
            shape = ir.RankedTensorType(correction.type).shape
            correction = b.create("stablehlo.transpose", [ir.RankedTensorType.get(
                [shape[d] for d in site.stat_permutation], ir.RankedTensorType(correction.type).element_type)],
                [correction], {"permutation": ir.DenseI64ArrayAttr.get(list(site.stat_permutation))}).result
        correction = b.convert(correction, self.f32_stat.element_type)
        block_sum = b.convert(_clone(site.row_sum, [e]), self.f32_stat.element_type)
        l_new = b.add(b.mul(l, correction), block_sum)
        env[site.divide.result] = e  # h(e): the division by the sum moves to the end
        for step in site.prob_steps:
            env.update(zip(step.op.operation.results, apply_step(step, env, n, rows, self.b)))
        b = self.b.at(site.pv.location)
        operands = [env[v] for v in site.pv.operation.operands[:2]]
        product = self.ctx.annotator.dot(b, site.pv, self.out_t, *operands, stream)
        dots.append(product.owner)
        o_new = b.add(b.mul(o, _broadcast(b, correction, self.out_t, self.stat_dims)), product)
        return [m_new, l_new, o_new]

    def _finite(self, b: Builder, reference: ir.Value) -> ir.Value:
        """``reference`` with -inf (every key so far masked for the row) taken as 0."""
        t = ir.RankedTensorType(reference.type)
        infinite = b.create("stablehlo.compare", [ir.RankedTensorType.get(t.shape, ir.IntegerType.get_signless(1))],
                            [reference, _splat(b, t, float("-inf"))],
                            {"comparison_direction": hlo.ComparisonDirectionAttr.get("EQ")}).result
        return b.create("stablehlo.select", [t], [infinite, b.zeros(t), reference]).result

    def finish(self, state: list[ir.Value]) -> ir.Value:
        b = self.b.at(self.site.pv.location)
        _, l, o = state
        result = b.create("stablehlo.divide", [self.out_t], [o, _broadcast(b, l, self.out_t, self.stat_dims)]).result
        return b.convert(result, ir.RankedTensorType(self.site.pv.result.type).element_type)


def rewrite_ring_attention(site: AttentionSite, ctx: RewriteContext) -> Applied:
    """Replace ``site``'s gathers, softmax and matmuls by one ring (module docstring)."""
    n = site.ring.size
    streams = gather_streams(n, ctx.bidirectional)
    pairs = [site.ring.shift_pairs(RECEIVE_FROM_NEXT * s.shift) for s in streams]
    signatures = gather_signatures(streams)
    loop_b = Builder(ir.Location.fused([site.keys.location, site.pv.location]), ctx.constants)
    comm = loop_b.at(site.keys.location)
    folding = _Block(site, ctx, loop_b)
    channels: list[int] = []

    def round_fn(rnd: Round, carried: list[ir.Value]) -> list[ir.Value]:
        held, state = carried[: 2 * len(streams)], carried[2 * len(streams):]
        received = list(held)
        permutes: list = [None] * len(held)
        for i, (computes, sends) in enumerate(rnd.signature):
            if sends:
                for j in (2 * i, 2 * i + 1):
                    channels.append(ctx.take_channel())
                    received[j] = comm.collective_permute(held[j], pairs[i], channels[-1])
                    permutes[j] = received[j].owner
        for i, (stream, (computes, _)) in enumerate(zip(streams, rnd.signature)):
            if computes:
                k = ring_position(loop_b, position, rnd, n, shift=stream.shift, ring=site.ring, region=site.region)
                dots: list = []
                state = folding.fold(held[2 * i], held[2 * i + 1], k, state, 1 + rnd.slot * len(streams) + i, dots)
                ctx.annotator.group(permutes[2 * i], dots[:1])
                ctx.annotator.group(permutes[2 * i + 1], dots[1:])
        return received + state

    stats = ScheduleStats()
    shards = [site.keys.operation.operands[0], site.values.operation.operands[0]]
    with ir.InsertionPoint(site.pv.operation):
        position = loop_b.position_in_ring(site.ring, site.region)
        final = emit_rounds(loop_b, signatures, shards * len(streams) + folding.initial(), round_fn, ctx.unroll,
                            stats)
        result = folding.finish(final[2 * len(streams):])
    site.pv.result.replace_all_uses_with(result)
    site.pv.operation.erase()
    erase_dead(list(reversed(site.ops)) + [site.keys, site.values])
    sends = sum(sends for signature in signatures for _, sends in signature)
    return Applied(channels, len(streams), stats, 2 * sends,
                   [f"ring attention: {n} blocks of {site.block} keys, online softmax"])
