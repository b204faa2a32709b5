"""One site: describe it, price it, decide it, rewrite it.

:func:`apply_site` is what every phase of the walk (:mod:`.phases`) calls for a matched
site: the report entry (:func:`describe_site`), the cost model's prediction for the site's
shape (:func:`site_shape`: each of the ring's dots in its role, priced in the type it
multiplies in), the options' verdict (:func:`policy_verdict`), then the ring itself, inline or
shared with the earlier sites of its pattern (:mod:`.sharing`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import contextlib
import math
from collections import Counter
from collections.abc import Callable

from . import cost, ir_utils, step_guard
from ._jax_private import ir
from .errors import InternalError
from .matchers import AllGatherSite, DeclinedSite, ReduceScatterSite, Site
from .matchers.all_reduce import DOT_ALL_REDUCE
from .report import SiteReport, describe_shard, element_bits, tensor_bytes
from .rewrites.all_gather_dot import merge_groups, rewrite_all_gather_dot
from .rewrites.dot_reduce_scatter import halves_blocker, rewrite_dot_reduce_scatter
from .rewrites.schedule import Applied, RewriteContext

if TYPE_CHECKING:
    from .pipeline import Options


def apply_site(
    site: Site, verify: Callable | None, ctx: RewriteContext, source: str, options: Options, hw: cost.Hardware,
    predictions: dict, sharing: tuple | None = None, budget: tuple | None = None,
) -> SiteReport:
    """Rewrite one site (``verify(entry)``: verify the module afterwards; None: the caller verifies at the end).

    ``sharing``: (RingLibrary, re-matcher) when sites of one pattern may share a ring function.
    ``budget``: (CompileBudget, the site's copies in the program) where the program's size is
    kept within a compile budget (:mod:`cmatmul_pass.compile_budget`).
    """
    entry = describe_site(site, source)
    if isinstance(site, DeclinedSite):
        return entry
    rings, rematch = sharing or (None, None)
    pattern = guarded(entry, rings.pattern, site) if rings else None
    # the layers of a model repeat their sites: predict once per pattern, or per site shape
    cached = predictions.get(pattern.key) if pattern else None
    merged = None  # a gather's merge groups, where the cost model needed them too (the ring reads the same)
    if cached is None:
        if isinstance(site, AllGatherSite):
            merged = merge_groups(site.consumers, options.merge_dots)
        shape = site_shape(site, options.merge_dots, merged)
        cached = predictions.get(shape)
        if cached is None:
            prediction = cost.predict(shape, hw, options.bidirectional, options.rounds_per_trip)
            if options.variant == "auto":
                prediction.variant = cost.fallback_variant(shape) if hw.assumed else prediction.best
            cached = predictions[shape] = shape, prediction, {**prediction.to_dict(), "site": shape.to_dict()}
        if pattern:
            predictions[pattern.key] = cached
    shape, prediction, described = cached
    entry.cost = {k: dict(v) if isinstance(v, dict) else v for k, v in described.items()}  # each entry its own
    declined = policy_verdict(options, shape, prediction) or step_guard.verdict(entry)
    if declined:
        entry.reason_code, entry.reason = declined
        return entry

    # the site's variant: the options' own, or the one the cost model picked for its shape (or,
    # past the compile budget, the fastest that fits)
    variant, budget_note = prediction.variant, ""
    if budget is not None:
        # (a split psum's scatter ring comes with policy all: the psum's decision priced it)
        margin = options.margin if options.policy == "auto" else -math.inf
        variant, budget_note = budget[0].choose(pattern.key if pattern else shape, shape, prediction,
                                                options.variant != "auto", margin, budget[1])
        if variant is None:
            entry.reason_code, entry.reason = "compile_budget", budget_note
            return entry
    ctx.bidirectional, ctx.unroll = cost.VARIANTS[variant]

    def build(site: Site) -> Applied:
        if isinstance(site, ReduceScatterSite):
            return rewrite_dot_reduce_scatter(site, ctx)
        return rewrite_all_gather_dot(site, ctx, merged if options.merge_dots == ctx.merge_dots else None)

    moved = guarded(entry, hoist, site)
    with budget[0].building_ring(site.anchor.operation.block, shape, variant, budget[1]) if budget \
            else contextlib.nullcontext():
        shared = guarded(entry, rings.share, site, pattern, rematch, build) if pattern else None
        applied = shared.applied if shared else guarded(entry, build, site)
    if verify is not None:
        verify(entry)
    entry.rewritten = True
    entry.shared_ring = f"@{shared.name}" if shared else None
    entry.channel_handles = list(applied.channel_handles)
    entry.schedule = {
        "variant": variant,  # asked for (see notes)
        "directions": applied.directions,
        "rounds": applied.stats.rounds,
        "loop_trips": applied.stats.loop_trips,
        "rounds_per_trip": applied.stats.rounds_per_trip,
        "peeled_rounds": applied.stats.peeled,
        "permutes": applied.permutes,
        "streams_annotated": ctx.annotator.enabled,
    }
    entry.notes = applied.notes + moved + ([budget_note] if budget_note else [])
    return entry


#: the options' verdicts on a site that matched: not a dot lost to another ring
VERDICTS = frozenset({"policy", "min_bytes", "compile_budget"})


def hoist(site: Site) -> list[str]:
    """Move the pure ops a gather site's later dots need (AllGatherSite.hoist: a weight cast to
    the compute type where it is used) just before the ring's place, in block order, so that
    the ring computes those dots too; each op computes what it did, and every use stays after
    it.  Returns the report's note."""
    ops = getattr(site, "hoist", ())
    for op in ops:
        op.move_before(site.insert_before)
    if not ops:
        return []
    counts = Counter(op.name for op in ops)
    names = ", ".join(f"{name}" + (f" x{count}" if count > 1 else "") for name, count in counts.items())
    # a norm applied per block (Consumer.dag): what moved are the values its ops read (a gain, constants)
    what = "what the ring reads beside the shards" if any(c.dag for c in site.consumers) else \
        "its dots' other operands"
    return [f"moved {len(ops)} op(s) computing {what} up to the ring: {names}"]


def guarded(entry: SiteReport, step, *args):
    """``step(*args)``; any failure while rewriting a site is a bug of the pass: say which site."""
    try:
        return step(*args)
    except Exception as exc:  # noqa: BLE001
        raise InternalError(
            f"rewriting the {entry.kind} site at {entry.location} failed (a cmatmul_pass bug): "
            f"{type(exc).__name__}: {' '.join(str(exc).split())}"
        ) from exc


def describe_site(site: Site, source: str) -> SiteReport:
    anchor = site.anchor
    entry = SiteReport(
        kind=site.kind,
        location=ir_utils.render_location(anchor.location, source),
        function=ir_utils.enclosing_func_name(anchor),
        rewritten=False,
    )
    if site.ring is not None:
        entry.ring_size = site.ring.size
        entry.replica_groups = [list(g) for g in site.ring.groups]
    # The value one permute moves: the gather's shard, the scatter's result block.
    values = anchor.operation.results if site.kind == "dot_reduce_scatter" else anchor.operation.operands
    travelling = values[0] if len(values) else None
    if travelling is not None and site.kind == DOT_ALL_REDUCE:  # the whole value, as a ring all_reduce moves it
        describe_shard(entry, travelling, None)
        if entry.ring_size and entry.bytes_per_step is not None:
            entry.bytes_moved = 2 * (entry.ring_size - 1) * entry.bytes_per_step // entry.ring_size
    elif travelling is not None:
        describe_shard(entry, travelling, entry.ring_size)
    if isinstance(site, DeclinedSite):
        entry.reason, entry.reason_code = site.message, site.code
    elif isinstance(site, AllGatherSite):
        first = site.consumers[0]
        entry.operand = _side(first.operand_index)
        entry.dim_role = "+".join(dict.fromkeys(c.role for c in site.consumers))
        entry.collective_dim = site.gather_dim
        entry.consumers = [_consumer(c.dot, c.operand_index, c.role, c.path, source) for c in site.consumers]
        readers = Counter(f"{op.operation.name} at {ir_utils.render_location(op.location, source)}"
                          for op in site.kept_users)  # (a ring's slices of it share their location)
        entry.assembled_for = [f"{reader} ({count} ops)" if count > 1 else reader for reader, count in readers.items()]
    elif isinstance(site, ReduceScatterSite):
        entry.operand = _side(site.terms[0].operand_index)
        entry.dim_role = "+".join(dict.fromkeys(t.role for t in site.terms))
        entry.collective_dim = site.scatter_dim
        entry.consumers = [_consumer(t.dot, t.operand_index, t.role, site.path, source) for t in site.terms]
    return entry


def _consumer(dot, operand_index: int, role: str, path, source: str) -> dict:
    """One dot of a ring, as the report lists it."""
    return {
        "location": ir_utils.render_location(dot.location, source),
        "operand": _side(operand_index),
        "dim_role": role,
        "look_through": [step.name for step in path],
    }


def _side(operand_index: int) -> str:
    return "lhs" if operand_index == 0 else "rhs"


def policy_verdict(options: Options, shape: cost.SiteShape, prediction: cost.Prediction) -> tuple[str, str] | None:
    """(code, reason) when the options leave a legal site as it is."""
    if shape.transfer_bytes < options.min_bytes:
        return "min_bytes", f"moves {shape.transfer_bytes} B per device, under --min-bytes {options.min_bytes}"
    if options.policy == "auto" and prediction.chosen_speedup < 1 + options.margin:
        best = prediction.best
        hint = (f"; {best} would reach {prediction.speedup[best]:.3f}x (--variant {best} or auto)"
                if prediction.speedup[best] >= 1 + options.margin else "")
        return (
            "policy",
            f"predicted speed-up {prediction.chosen_speedup:.3f}x on {prediction.hardware} "
            f"({prediction.variant}) is under 1 + {options.margin:g}{hint}",
        )
    return None


def site_shape(site: AllGatherSite | ReduceScatterSite, merge_dots: bool = True,
               merged: list | None = None) -> cost.SiteShape:
    """The cost model's view of a matched site (per device); ``merge_dots``: as the rewrite
    will merge the gather's dots (Options.merge_dots), which sizes the ring's dots (``merged``:
    a gather's :func:`merge_groups` so, where the caller has them)."""
    if isinstance(site, AllGatherSite):
        parts = site.consumers
        step = ir_utils.ranked_tensor(site.all_gather.operation.operands[0])
        if merged is None:
            merged = merge_groups(site.consumers, merge_dots)
        groups = [members for members, _ in merged]  # merged: one role
    else:
        return scatter_shape(site, ir_utils.ranked_tensor(site.reduce_scatter.result))
    return _shape(site, parts, step, groups)


def scatter_shape(site, block: ir.RankedTensorType) -> cost.SiteShape:
    """A scatter ring's shape: ``block`` is what one permute moves; each term is its own dot in
    every round."""
    return _shape(site, site.terms, block, [[i] for i in range(len(site.terms))])


def _shape(site, parts, step: ir.RankedTensorType, groups: list[list[int]]) -> cost.SiteShape:
    dots = [part.dot for part in parts]
    each = [dot_flops(d) for d in dots]
    dtype = _priced_dtype(dots[0])
    halvable = isinstance(site, AllGatherSite) or halves_blocker(site) is None
    kind = "dot_reduce_scatter" if site.kind == DOT_ALL_REDUCE else site.kind  # a split psum: a scatter ring
    return cost.SiteShape(kind, site.ring.size, sum(each), tensor_bytes(step), dtype, halvable,
                          tuple(sum(each[i] for i in members) for members in groups),
                          tuple(parts[members[0]].role for members in groups))


def dot_flops(dot) -> float:
    """Real FLOPs: a multiply-add of complex numbers is four real ones."""
    op = dot.operation
    numbers = ir_utils.grouped_numbers_attr(op) if ir_utils.is_grouped_dot(op) else op.attributes["dot_dimension_numbers"]
    key = (op.operands[0].type, op.results[0].type, numbers)
    flops = _FLOPS.get(key)
    if flops is None:  # the layers repeat their dots: worked out once per kind
        lhs, out = (ir.RankedTensorType(t) for t in key[:2])
        contracting = ir_utils.lhs_contracting_dims(op)  # (a grouped matmul's row meets one group's matrix)
        real = 4.0 if isinstance(lhs.element_type, ir.ComplexType) else 1.0
        flops = _FLOPS[key] = (real * 2.0 * math.prod(out.shape) * math.prod(lhs.shape[d] for d in contracting)
                               / ir_utils.result_groups(op))
    return flops


#: dot_flops by (lhs type, result type, dimension numbers), and _priced_dtype by operand types,
#: for one run of the pass
_FLOPS: dict = {}


def _priced_dtype(dot) -> str:
    """:func:`priced_element_type`'s name (worked out once per pair of operand types)."""
    key = tuple(v.type for v in list(dot.operation.operands)[:2])  # (not a grouped matmul's group sizes)
    name = _FLOPS.get(key)
    if name is None:
        name = _FLOPS[key] = str(priced_element_type(dot))
    return name


def priced_element_type(dot) -> ir.Type:
    """The type the cost model prices a dot's FLOPs at: the wider of its operands' (a dot of an
    fp8 operand and a bf16 one runs as bf16), a complex type's parts."""
    types = [ir_utils.ranked_tensor(v).element_type for v in list(dot.operation.operands)[:2]]
    element = max(types, key=element_bits)  # the lhs's on a tie
    return ir.ComplexType(element).element_type if isinstance(element, ir.ComplexType) else element


def forget_dots() -> None:
    """Drop the dots' FLOP counts and priced types remembered during one run of the pass."""
    _FLOPS.clear()
