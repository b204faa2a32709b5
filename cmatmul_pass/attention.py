"""Attention over gathered keys and values, decided and ringed with an online softmax
(:mod:`.matchers.attention`, :mod:`.rewrites.ring_attention`).

The cost model prices the attention as written (K's and V's gathers, then the scores and
``P·V`` matmuls over the whole sequence: one after the other) against the ring: ``n`` blocks,
each round's K and V blocks in flight while the previous block's two matmuls compute (a
bidirectional ring: a block from each side per round, the two sides' transfers concurrent).
The elementwise softmax is not priced (the same work either way).  ``--variant auto`` takes the
faster of the one-directional and the bidirectional ring (the first on a tie).  Under ``--policy auto`` an
attention is left with its gathers where the ring does not beat that by the margin; its memory
figures (the scores' and probabilities' largest value, and K and V as the attention holds them)
are reported either way.
"""

from __future__ import annotations

import math

from . import cost, ir_utils, step_guard
from ._jax_private import ir
from .matchers import DeclinedSite, ModuleInfo
from .analysis.separable import SLICE
from .matchers.attention import AttentionSite
from .report import SiteReport, collective_entry, tensor_bytes
from .rewrites.block_operands import leaves
from .rewrites.ring_attention import rewrite_ring_attention
from .rewrites.schedule import RewriteContext
from .sites import dot_flops, guarded

#: variants whose ring sends a block from each side per round
BIDIRECTIONAL = ("bidi", "bidi-unroll2", "bidi-full")


def predict(site: AttentionSite, hw: cost.Hardware, variant: str) -> dict:
    """The attention as written and as a ring (seconds), and the speed-up."""
    n = site.ring.size
    shards = [tensor_bytes(ir_utils.ranked_tensor(g.operation.operands[0])) for g in (site.keys, site.values)]
    shard = sum(shards)
    element = str(ir.RankedTensorType(site.scores.operation.operands[0].type).element_type)
    compute = sum(dot_flops(d) for d in (site.scores, site.pv)) / hw.throughput(element)
    gathers = sum(cost.gather_seconds(b, n, hw) for b in shards)
    serial = gathers + compute
    per_block, transfer = compute / n, shard / hw.bandwidth + hw.step
    if variant in BIDIRECTIONAL and n > 2:
        ring = per_block + math.ceil((n - 1) / 2) * max(2 * per_block, transfer)
    else:
        ring = per_block + (n - 1) * max(per_block, transfer)
    return {"serial_s": serial, "ring_s": ring, "compute_s": compute, "gathers_s": gathers,
            "speedup": serial / ring if ring else 1.0, "hardware": hw.name, "variant": variant}


def memory(site: AttentionSite, variant: str) -> dict:
    """Per device, bytes: the largest score-shaped value (scores, exponentials, probabilities)
    and the keys and values the attention holds, as written and in the ring (a block each,
    and the next block in flight, per direction); and the side operands the ring reads a block
    at a time but holds whole (a mask, a bias: ``held_whole``)."""
    n = site.ring.size
    streams = 2 if variant in BIDIRECTIONAL and n > 2 else 1
    scores = max(tensor_bytes(ir_utils.ranked_tensor(r)) for op in site.ops
                 if op.operation.name != "stablehlo.reduce" for r in op.operation.results
                 if ir_utils.ranked_tensor(r) is not None and
                 ir.RankedTensorType(r.type).rank == ir.RankedTensorType(site.scores.result.type).rank)
    gathered = sum(tensor_bytes(ir_utils.ranked_tensor(g.operation.results[0])) for g in (site.keys, site.values))
    # what the ring reads a block at a time but holds whole (a mask, a bias): the same either way
    sides = {leaf for step in (*site.score_steps, *site.prob_steps)
             for value, plan in zip(step.op.operation.operands, step.sides) if plan and plan[0] == SLICE
             for leaf in leaves(value, plan[1])}  # (a mask from positions is recomputed per block: none)
    return {"scores_before": scores, "scores_after": scores // n, "keys_values_before": gathered,
            "keys_values_after": 2 * streams * gathered // n,
            "held_whole": sum(tensor_bytes(ir_utils.ranked_tensor(v)) for v in sides)}


def too_big(nbytes: float, hw: cost.Hardware, what: str) -> str:
    """The note of a site taken whatever its prediction: as written, it cannot run."""
    return (f"taken whatever the prediction: {what} as written ({nbytes:.3g} B) exceed one device's memory on "
            f"{hw.name} ({hw.memory:.3g} B)")


def decide_attention(site: AttentionSite | DeclinedSite, info: ModuleInfo, ctx: RewriteContext, options,
                     hw: cost.Hardware, source: str) -> SiteReport:
    """``site``'s entry, ringed where the options and the cost model say so."""
    entry = collective_entry(site.kind, site.anchor, site.ring, source)
    if isinstance(site, DeclinedSite):
        entry.reason, entry.reason_code = site.message, site.code
        return entry
    entry.collective_dim = site.dim
    entry.dim_role = "free"
    entry.bytes_moved = 2 * (site.ring.size - 1) * (entry.bytes_per_step or 0)
    variant = options.variant
    candidates = (("uni", "bidi") if site.ring.size > 2 else ("uni",)) if variant == "auto" else (variant,)
    predictions = {v: predict(site, hw, v) for v in candidates}
    # auto: the faster of one direction and both (a ring of 2 has one), uni on a tie
    variant = max(candidates, key=lambda v: (round(predictions[v]["speedup"], 3), v == "uni"))
    entry.absorbs = [ir_utils.render_location(site.values.location, source)]
    entry.attention = {"values": entry.absorbs[0], "blocks": site.ring.size, "block_keys": site.block,
                       "memory": memory(site, variant), "prediction": predictions[variant]}
    speedup = entry.attention["prediction"]["speedup"]
    if options.min_bytes and entry.bytes_moved < options.min_bytes:
        entry.reason_code, entry.reason = "min_bytes", f"moves {entry.bytes_moved} B per device, under --min-bytes " \
                                                       f"{options.min_bytes}"
        return entry
    largest = entry.attention["memory"]["scores_before"]
    if options.policy == "auto" and speedup < 1 + options.margin and hw.holds(largest):
        entry.reason_code = "policy"
        entry.reason = f"predicted speed-up {speedup:.3f}x ({variant}) on {hw.name} is under 1 + {options.margin:g}"
        return entry
    declined = step_guard.verdict(entry) if hw.holds(largest) else None
    if declined:
        entry.reason_code, entry.reason = declined
        return entry
    ctx.bidirectional, ctx.unroll = cost.VARIANTS[variant]
    applied = guarded(entry, rewrite_ring_attention, site, ctx)
    entry.rewritten = True
    entry.channel_handles = list(applied.channel_handles)
    entry.notes = applied.notes + ([] if hw.holds(largest) else [too_big(largest, hw, "the scores")])
    entry.schedule = {"variant": variant, "directions": applied.directions, "rounds": applied.stats.rounds,
                      "loop_trips": applied.stats.loop_trips, "rounds_per_trip": applied.stats.rounds_per_trip,
                      "peeled_rounds": applied.stats.peeled, "permutes": applied.permutes,
                      "streams_annotated": ctx.annotator.enabled}
    return entry
