"""Regions over gathered columns, decided and rewritten as passes of rings
(:mod:`.analysis.column_passes`, :mod:`.rewrites.column_ring`): attention's backward, where K
and V are gathered along the sequence, statistics of the scores are taken over it and dK and dV
are scattered back.

The cost model prices the region as written (its gathers, its matmuls over the whole sequence,
its scatters: one after the other) against the passes: each pass ``n`` rounds, a round's block
transfers (the shards the pass reads; the travelling partial sums of the last) in flight while
the previous block's matmuls compute.  A pass recomputes the column values its statistics read,
so the passes do more matmul work than the region as written (attention's backward: the scores
and ``dO·Vᵀ`` twice); elementwise work is not priced.  Under ``--policy auto`` a region is left
as written where the passes do not beat it by the margin; its memory figures (the largest
column value, as written and a block of it) are reported either way.
"""

from __future__ import annotations

from . import cost, ir_utils, step_guard
from .attention import too_big
from ._jax_private import ir
from .analysis.column_passes import BlockColumns, ColumnPlan, plan
from .errors import Decline
from .matchers import DeclinedSite, ModuleInfo
from .matchers.common import collective_ring
from .report import SiteReport, collective_entry, tensor_bytes
from .rewrites.column_ring import check_inputs, insertion_point, rewrite_column_passes
from .rewrites.schedule import RewriteContext
from .sites import dot_flops, guarded

KIND = "column_passes"


def inline_statistic_calls(found: dict[str, list]) -> list[str]:
    """A private function taking statistics (a reduce inside: ``jax.nn.log_softmax``, a
    ``custom_jvp``, holds its max and sum in functions of its own) called on a value computed from
    an all_gather in a block that also scatters back is inlined there, as XLA inlines it: the
    region's ops then share the block its passes are planned in.  Only functions of pure ops and no
    collectives.  To run before the pipeline collects the module's collectives; returns the names of
    the functions inlined."""
    from .rewrites.column_ring import PURE
    from .rewrites.sink import _Functions, inline

    scatters, gathers = found.get("stablehlo.reduce_scatter", []), found.get("stablehlo.all_gather", [])
    homes = {s.operation.parent for s in scatters} & {g.operation.parent for g in gathers}
    calls = [c for c in found.get("func.call", []) if c.operation.parent in homes]
    if not calls:
        return []
    module = calls[0].operation
    while module.parent is not None:
        module = module.parent
    by_name = {ir_utils.symbol_name(f): f for f in module.regions[0].blocks[0].operations
               if f.operation.name == "func.func"}
    functions, names = None, []
    for call in calls:
        f = by_name.get(ir.FlatSymbolRefAttr(call.operation.attributes["callee"]).value)
        if f is None or not ir_utils.is_private(f) or len(f.regions[0].blocks) != 1:
            continue
        body = [o.operation.name for o in f.regions[0].blocks[0].operations][:-1]
        # (PURE: no collective either)
        if "stablehlo.reduce" not in body or not set(body) <= PURE or not _from_gather(call):
            continue
        functions = functions or _Functions(call)
        names.append(inline(call, functions, functions.private(call)))
    return list(dict.fromkeys(names))


def _from_gather(call: ir.OpView, limit: int = 256) -> bool:
    """Is an operand of ``call`` computed, in its block, from an all_gather (at most ``limit`` ops back)?"""
    seen, frontier = set(), list(call.operation.operands)
    while frontier and len(seen) < limit:
        op = ir_utils.producer(frontier.pop())
        if op is None or op.operation in seen or op.operation.block != call.operation.block:
            continue
        if op.operation.name == "stablehlo.all_gather":
            return True
        seen.add(op.operation)
        frontier.extend(op.operation.operands)
    return False


def match_column_passes(op: ir.OpView, info: ModuleInfo, columns: BlockColumns | None = None
                        ) -> ColumnPlan | DeclinedSite | None:
    """The passes of the region ``op`` (an all_gather) is in, declined with the reason, or None
    where it is not such a region (``columns``: its block's walk, where one is at hand)."""
    try:
        ring, region = collective_ring(op, info)
        found = plan(op, ring, region, columns)
        if found is not None:
            check_inputs(found, insertion_point(found))
        return found
    except Decline as e:
        return DeclinedSite(KIND, op, e.code, e.message)


def _pass_flops(p: ColumnPlan, pass_: int) -> float:
    ops, stats, _ = p.needed(pass_)
    return sum(dot_flops(o) for o in ops if o.operation.name == "stablehlo.dot_general") + \
        sum(dot_flops(s.op) for s in stats if s.op.operation.name == "stablehlo.dot_general")


def predict(p: ColumnPlan, hw: cost.Hardware) -> dict:
    """The region as written and as passes (seconds), and the speed-up."""
    n = p.ring.size
    element = str(ir.RankedTensorType(p.gathers[0].operation.operands[0].type).element_type)
    rate = hw.throughput(element)
    shards = [tensor_bytes(ir_utils.ranked_tensor(g.operation.operands[0])) for g in p.gathers]
    scattered = [tensor_bytes(ir_utils.ranked_tensor(s.operation.results[0])) for s in p.scatters]
    compute = (sum(dot_flops(o) for o in p.column_ops if o.operation.name == "stablehlo.dot_general") +
               sum(dot_flops(s.op) for s in p.statistics if s.op.operation.name == "stablehlo.dot_general")) / rate
    serial = sum(cost.gather_seconds(b, n, hw) for b in shards + scattered) + compute
    passes = 0.0
    pass_compute = 0.0
    for q in range(1, p.passes + 1):
        flops = _pass_flops(p, q) / rate
        pass_compute += flops
        ops, stats, scatters = p.needed(q)
        reads = {v for o in ops for v in o.operation.operands} | {v for s in stats for v in s.op.operation.operands}
        moved = sum(b for g, b in zip(p.gathers, shards) if g.operation.results[0] in reads) + \
            (sum(scattered) if scatters else 0)
        per_block, transfer = flops / n, moved / hw.bandwidth + hw.step
        passes += per_block + (n - 1) * max(per_block, transfer) + (transfer if scatters else 0.0)
    # (compute_s: the matmuls as written, which the step's schedule already counts; the passes' own beyond)
    return {"serial_s": serial, "ring_s": passes, "compute_s": compute, "passes_compute_s": pass_compute,
            "speedup": serial / passes if passes else 1.0, "hardware": hw.name, "variant": "uni"}


def memory(p: ColumnPlan) -> dict:
    """Per device, bytes: the largest column value (the scores, the probabilities and their
    gradients), as written and a block of it in the passes."""
    largest = max((tensor_bytes(ir_utils.ranked_tensor(r)) for o in p.column_ops for r in o.operation.results
                   if ir_utils.ranked_tensor(r) is not None), default=0)
    return {"columns_before": largest, "columns_after": largest // p.ring.size}


def decide_column_passes(site: ColumnPlan | DeclinedSite, info: ModuleInfo, ctx: RewriteContext, options,
                         hw: cost.Hardware, source: str) -> SiteReport:
    """``site``'s entry, rewritten where the options and the cost model say so."""
    ring = site.ring
    entry = collective_entry(KIND, site.anchor, ring, source)
    if isinstance(site, DeclinedSite):
        entry.reason, entry.reason_code = site.message, site.code
        return entry
    entry.collective_dim = ir_utils.int_attr(site.anchor, "all_gather_dim")
    entry.dim_role = "free"
    entry.bytes_moved = sum(2 * (ring.size - 1) * tensor_bytes(ir_utils.ranked_tensor(g.operation.operands[0]))
                            for g in site.gathers)
    entry.absorbs = [ir_utils.render_location(o.location, source) for o in (*site.gathers[1:], *site.scatters)]
    prediction = predict(site, hw)
    entry.attention = {"passes": site.passes, "blocks": ring.size, "block_keys": site.block,
                       "memory": memory(site), "prediction": prediction,
                       "statistics": len(site.statistics),
                       "merged": sum(1 for s in site.statistics if s.online is not None),
                       "scattered": len(site.scatters)}
    if options.min_bytes and entry.bytes_moved < options.min_bytes:
        entry.reason_code, entry.reason = "min_bytes", f"moves {entry.bytes_moved} B per device, under --min-bytes " \
                                                       f"{options.min_bytes}"
        return entry
    largest = entry.attention["memory"]["columns_before"]
    if options.policy == "auto" and prediction["speedup"] < 1 + options.margin and hw.holds(largest):
        entry.reason_code = "policy"
        m = entry.attention["memory"]
        entry.reason = (f"predicted speed-up {prediction['speedup']:.3f}x ({site.passes} passes) on {hw.name} is "
                        f"under 1 + {options.margin:g} (the largest column value {m['columns_before']:.3g} B as "
                        f"written, {m['columns_after']:.3g} B in the passes)")
        return entry
    declined = step_guard.verdict(entry) if hw.holds(largest) else None
    if declined:
        entry.reason_code, entry.reason = declined
        return entry
    ctx.bidirectional = False
    ctx.unroll = cost.VARIANTS[options.variant][1] if options.variant in cost.VARIANTS else 1
    applied = guarded(entry, rewrite_column_passes, site, ctx)
    entry.rewritten = True
    entry.channel_handles = list(applied.channel_handles)
    entry.notes = list(applied.notes)
    if not hw.holds(largest):
        entry.notes.append(too_big(largest, hw, "the column values"))
    if options.variant in ("bidi", "bidi-unroll2", "bidi-full"):
        entry.notes.append(f"variant {options.variant}: one direction (the passes' rings)")
    entry.schedule = {"variant": "uni", "directions": 1, "rounds": applied.stats.rounds,
                      "loop_trips": applied.stats.loop_trips, "rounds_per_trip": applied.stats.rounds_per_trip,
                      "peeled_rounds": applied.stats.peeled, "permutes": applied.permutes,
                      "streams_annotated": ctx.annotator.enabled}
    return entry


def column_phase(phases, gathers: list, scatters: list) -> tuple[list, list]:
    """Each region over gathered columns that reads statistics back (attention's backward)
    rewritten as passes of rings, before the scatters and gathers are matched one by one
    (``phases``: the pass's :class:`~cmatmul_pass.phases.Phases`); returns the gathers and
    scatters left.  A region left as written says why on its first gather's entry."""
    taken: set[int] = set()  # indices into gathers and (offset by len(gathers)) scatters
    why: dict[str, tuple[str, str]] = {}
    if not scatters:
        return gathers, scatters
    walks: dict = {}  # BlockColumns.key -> the block's walk, until a rewrite changes the block
    worth: dict = {}  # a key -> whether its block takes a max over the gathered length at all
    for index, op in enumerate(gathers):
        if index in taken:
            continue
        key = BlockColumns.key(op)
        if key[2] is None or len(op.operation.operands) != 1:
            continue
        if key not in worth:
            worth[key] = BlockColumns.worth_walking(op)
        if not worth[key]:
            continue
        if key not in walks:
            walks[key] = BlockColumns(op)
        site = match_column_passes(op, phases.info, walks[key])
        if site is None:
            continue
        with phases.attempts.on(op):
            if phases.attempts.left(op, ir_utils.enclosing_func_name(op)) is not None:
                continue
            since, place = len(phases.report.sites), phases.place_of(op)
            claimed = set() if isinstance(site, DeclinedSite) else \
                {g.operation for g in site.gathers} | {s.operation for s in site.scatters}
            # (asked before the rewrite erases them)
            indices = {i for i, o in enumerate([*gathers, *scatters])
                       if i not in taken and o.operation in claimed}
            entry = decide_column_passes(site, phases.info, phases.ctx, phases.options, phases.hw, phases.source)
            if not entry.rewritten:
                why[entry.location] = (entry.reason_code, f"column passes: {entry.reason} [{entry.reason_code}]")
                continue
            phases.report.sites.append(entry)
            phases.tag(place, since)
            taken |= indices
            walks = {k: w for k, w in walks.items() if k[0] != key[0]}
            worth = {k: w for k, w in worth.items() if k[0] != key[0]}
    phases.column_notes.update(why)
    return [g for i, g in enumerate(gathers) if i not in taken], \
        [s for i, s in enumerate(scatters) if len(gathers) + i not in taken]


def say_why(report, why: dict[str, tuple[str, str]]) -> None:
    """Each region left as written: its first gather's entries say why (a note, and the reason
    code in ``attention["passes_declined"]``)."""
    for entry in report.sites:
        if entry.location in why and entry.kind == "all_gather_dot":
            code, note = why[entry.location]
            entry.notes.append(note)
            entry.attention = {**entry.attention, "passes_declined": code}


def explain_lines(site: SiteReport) -> list[str]:
    """``explain``'s lines of a region rewritten as passes: the passes, the memory, the prediction."""
    from .cost import readable_seconds

    a = site.attention
    m, p = a["memory"], a["prediction"]
    return [f"  passes: {a['passes']} over {a['blocks']} blocks of {a['block_keys']} columns; {a['statistics']} "
            f"statistics ({a['merged']} merged into their max's pass), {a['scattered']} scattered back; absorbs "
            f"{', '.join(site.absorbs)}",
            f"  memory per device: the largest column value {m['columns_before']} B -> {m['columns_after']} B a block",
            f"  predicted on {p['hardware']}: as written {readable_seconds(p['serial_s'])} (matmuls "
            f"{readable_seconds(p['compute_s'])}); passes {readable_seconds(p['ring_s'])} (matmuls "
            f"{readable_seconds(p['passes_compute_s'])}) ({p['speedup']:.2f}x)"]
