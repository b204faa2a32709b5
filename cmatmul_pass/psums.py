"""A psum after a matmul (dot → all_reduce): which strategy (split into a reduce-scatter ring
and a gather carried forward, or chunked rows), how many chunks, within the options' policy
and compile budget; and, once the gathers are placed, where each split psum's gather went."""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import TYPE_CHECKING

from . import cost, ir_utils, step_guard
from .matchers import DeclinedSite, ModuleInfo, ReduceScatterSite
from .matchers.gather_rows import reaches_a_dot_row_wise
from .matchers.all_reduce import DOT_ALL_REDUCE, AllReduceSite
from .matchers.common import collective_ring
from .matchers.scatter_terms import region_is_sum
from .report import Report, SiteReport, tensor_bytes
from .rewrites.dot_all_reduce import chunk_all_reduce, chunk_dims_ok, split_all_reduce, split_sum
from .rewrites.schedule import RewriteContext
from .rewrites.sequence_parallel import Seed
from .sites import describe_site, guarded, scatter_shape

if TYPE_CHECKING:
    from .pipeline import Options


def decide_all_reduce(site, ctx: RewriteContext, source: str, options: Options, hw: cost.Hardware, apply,
                info: ModuleInfo, predictions: dict, budget: tuple | None = None) -> tuple[SiteReport, Seed | None]:
    """Decide and rewrite one dot → all_reduce site (Options.all_reduce); returns its report
    entry and, when split, the gather to carry forward (``predictions``: the pass's cache;
    ``budget``: as :meth:`SiteWalk.budget_of` gives it)."""
    entry = describe_site(site, source)
    if isinstance(site, DeclinedSite):
        return entry, None
    shape = all_reduce_shape(site)
    variant = cost.variant_name(options.bidirectional, options.rounds_per_trip)
    if options.variant == "auto" and hw.assumed:
        variant = cost.fallback_variant(shape)
    elif options.variant == "auto":
        if ("best", shape) not in predictions:
            predictions[("best", shape)] = cost.predict(shape, hw).best
        variant = predictions[("best", shape)]
    counts = [k for k in ([options.chunks] if options.chunks else cost.CHUNK_COUNTS) if chunk_dims_ok(site, k)]
    key = ("all_reduce", shape, variant, tuple(counts))  # layers repeat their shapes: predict once per shape
    if key not in predictions:
        made = cost.predict_all_reduce(shape, hw, variant, counts)
        predictions[key] = made, made.to_dict()  # (the dict: shared by the entries, which are read, not edited)
    prediction, described = predictions[key]
    picked = _all_reduce_pick(options, hw)
    tie = picked == "model" and prediction.tied  # the model's tie (cost.TIE): split where its gather goes on
    onward = tie and reaches_a_dot_row_wise(site.all_reduce)
    strategy, chunks, declined = _all_reduce_strategy(options, shape, prediction, picked, onward)
    entry.all_reduce = {"strategy": strategy, "dim": site.dim, "chunks": chunks, "gathers": [],
                        "picked": picked, "prediction": described}
    if tie:
        entry.all_reduce["tie_to_split"] = onward
    declined = declined or step_guard.verdict(entry)
    if budget is not None and not declined:
        chunks, declined = _within_budget(budget, shape, prediction, strategy, chunks, options, entry)
    if declined:
        entry.reason_code, entry.reason = declined
        return entry, None
    slower = prediction.speedup(strategy, chunks)
    if slower < 1:
        entry.notes.append(f"{strategy} is predicted {slower:.2f}x the all_reduce's speed on {prediction.hardware} "
                           "(policy all rewrites it anyway; --policy auto would leave it)")
    if strategy == "chunk":
        with budget[0].building_chunks(site.all_reduce.operation.block, shape, chunks, budget[1]) if budget \
                else contextlib.nullcontext():
            applied = guarded(entry, chunk_all_reduce, site, ctx, chunks)
        entry.rewritten = True
        entry.channel_handles = list(applied.channel_handles)
        entry.notes += applied.notes
        return entry, None
    reduce_scatter, all_gather = guarded(entry, split_all_reduce, site, ctx.take_channel)
    # the split's reduce_scatter sums the product the all_reduce's match traced, along the same
    # dim, in the same block: its site is that match's, anchored on it (no second trace)
    ring_site = ReduceScatterSite(reduce_scatter, site.terms, site.adds, site.path, site.ring, site.region, site.dim)
    ringed = apply(ring_site, replace(options, policy="all", min_bytes=0))  # decided above
    ringed.kind, ringed.all_reduce, ringed.notes = DOT_ALL_REDUCE, entry.all_reduce, entry.notes + ringed.notes
    return ringed, Seed(all_gather, site.ring, site.region, site.dim, -1)


def split_summed_value(site: DeclinedSite, info: ModuleInfo, ctx: RewriteContext, source: str, options: Options,
                       hw: cost.Hardware, banned: str | None) -> tuple[SiteReport, Seed | None]:
    """A psum whose summed value no matmul produces (declined ``producer_not_dot``: an incoming
    cotangent summed over the tensor axis, as ``psum``'s transpose under ``check_vma=False``
    gives) but whose value matmuls read, directly or through row-wise ops: split, its
    all_gather carried to those matmuls' gather ring.  The identity::

        all_reduce(x) = all_gather(reduce_scatter(x))   along any dim D the group size divides

    (a sum is a sum of its blocks, each device keeping one and gathering the rest).  The
    reduce_scatter stays a collective (no product to ring it with); the gather's ring hides the
    other half of the transfer behind the matmuls.  Side conditions: a sum over one operand of a
    static shape (else the decline stands); every reader of the value a ``dot_general``, through
    layout ops at most (a statistic's psum, whose value a norm reads, stays); ``D``, the lowest dim the group size divides; ``--all-reduce auto`` or
    ``split``; under ``--policy auto`` the reduce_scatter alone predicted faster than the
    all_reduce by the margin (the all_gather hidden: where its ring does not form, the next try
    keeps the psum as written, ``banned`` saying why).  Returns the entry and the gather to carry."""
    entry = describe_site(site, source)
    op = site.anchor
    t = ir_utils.ranked_tensor(op.operation.results[0])
    n = site.ring.size if site.ring is not None else 0
    dims = [d for d in range(t.rank) if t.shape[d] % n == 0] if n > 1 and t is not None and ir_utils.is_static(t) \
        else []
    if site.code != "producer_not_dot" or options.all_reduce_strategy not in ("auto", "split") or not dims or \
            len(op.operation.operands) != 1 or not region_is_sum(op) or not _read_by_matmuls(op.operation.results[0]):
        return entry, None
    if banned:
        entry.reason += f"; not split for its matmuls' gather ring: {banned}"
        return entry, None
    nbytes = tensor_bytes(t)
    if nbytes * (n - 1) // n < options.min_bytes:
        entry.reason += f"; moves {nbytes * (n - 1) // n} B per device, under --min-bytes {options.min_bytes}"
        return entry, None
    all_reduce_s = hw.all_reduce_seconds(nbytes, n)
    scatter_s = cost.gather_seconds(nbytes / n, n, hw)
    speedup = all_reduce_s / scatter_s
    declined = step_guard.verdict(entry)
    if options.policy == "auto" and speedup < 1 + options.margin:
        declined = ("policy", f"the reduce-scatter a split leaves ({cost.readable_seconds(scatter_s)}) is predicted "
                              f"{speedup:.3f}x the all_reduce's speed ({cost.readable_seconds(all_reduce_s)}) on "
                              f"{hw.name}, under 1 + {options.margin:g}")
    if declined:
        entry.reason_code, entry.reason = declined
        return entry, None
    dim = dims[0]
    _, region = collective_ring(op, info)  # (the ring's: matched before the decline)
    _, all_gather = guarded(entry, split_sum, op, dim, ir_utils.with_dim(t, dim, t.shape[dim] // n), ctx.take_channel)
    entry.rewritten, entry.reason, entry.reason_code = True, "", ""
    entry.collective_dim = dim
    # the step's schedule (program_cost) takes the psum as its reduce-scatter; the gathers' rings,
    # once decided, add what they leave exposed (Phases._summed_splits_ringed)
    entry.all_reduce = {"strategy": "split", "dim": dim, "chunks": None, "gathers": [], "picked": "summed value",
                        "prediction": {"hardware": hw.name, "serial_s": all_reduce_s, "all_reduce_s": all_reduce_s,
                                       "scatter_s": scatter_s, "split_s": scatter_s,
                                       "speedup": {"split": speedup}}}
    entry.notes.append(f"split into a reduce-scatter and an all_gather along dim {dim}: no matmul produces the summed "
                       f"value, so the reduce-scatter stays a collective ({cost.readable_seconds(scatter_s)}, against "
                       f"the all_reduce's {cost.readable_seconds(all_reduce_s)}); the gather goes to the matmuls "
                       "that read it, as their ring")
    return entry, Seed(all_gather, site.ring, region, dim, -1)


#: ops between a split psum's value and its matmuls (psums.split_summed_value)
_LAYOUT = frozenset({"stablehlo.reshape", "stablehlo.transpose", "stablehlo.convert"})


def _read_by_matmuls(value) -> bool:
    """Is every reader of ``value`` a ``dot_general``, directly or through layout ops (one at least)?"""
    readers = ir_utils.users(value)
    return bool(readers) and all(
        r.operation.name == "stablehlo.dot_general" and not ir_utils.is_grouped_dot(r)
        or r.operation.name in _LAYOUT and _read_by_matmuls(r.operation.results[0]) for r in readers)


def _within_budget(budget: tuple, shape: cost.SiteShape, prediction: cost.AllReducePrediction, strategy: str,
                   chunks: int | None, options: Options, entry: SiteReport) -> tuple[int | None, tuple[str, str] | None]:
    """A psum's chunk count within the compile budget (or, split, whether some ring of its
    reduce-scatter fits): (chunks, None), or (chunks, (code, reason)) where it stays as written."""
    spend, copies = budget
    if strategy == "chunk":
        fitted, why = spend.choose_chunks(("chunk", shape), shape, prediction, chunks, options.chunks is not None,
                                          options.margin, copies)
        if fitted is None:
            return chunks, ("compile_budget", why)
        if why:
            entry.notes.append(why)
        entry.all_reduce["chunks"] = fitted
        return fitted, None
    if copies and not spend.any_ring_fits(shape, copies):
        return chunks, ("compile_budget", f"its reduce-scatter's ring would take the program past the compile "
                                          f"budget ({spend.describe()})")
    return chunks, None


def _all_reduce_pick(options: Options, hw: cost.Hardware) -> str:
    """Who chose a psum site's strategy: ``"named"`` (``all_reduce=`` named it), ``"model"``
    (auto: the cost model's pick) or ``"fallback"`` (auto where no profile describes the
    machine: ``cost.fallback_all_reduce``)."""
    if options.all_reduce_strategy != "auto":
        return "named"
    return "fallback" if hw.assumed else "model"


def _all_reduce_strategy(options: Options, shape: cost.SiteShape, prediction: cost.AllReducePrediction,
                         picked: str, onward: bool = False) -> tuple[str, int | None, tuple[str, str] | None]:
    """(strategy, chunk count, (code, reason) when the site stays as it is); ``picked``: who
    chooses it (:func:`_all_reduce_pick`); ``onward``: the psum's value goes on to a matmul
    through row-wise ops (a tie then goes to split: :meth:`cost.AllReducePrediction.pick`)."""
    asked = options.all_reduce_strategy
    chunks = options.chunks or prediction.chunks
    if picked == "fallback":
        asked, fallback_chunks = cost.fallback_all_reduce(prediction)
        chunks = options.chunks or fallback_chunks or chunks
    elif picked == "model":
        asked = prediction.pick(onward)
    if asked == "chunk" and not prediction.chunk_s:
        return asked, None, ("chunks", f"the rows cannot be cut into {options.chunks or '2, 4 or 8'} equal chunks "
                                       "that every op after the dot keeps whole")
    if shape.transfer_bytes < options.min_bytes:
        return asked, chunks, ("min_bytes", f"moves {shape.transfer_bytes} B per device, under --min-bytes "
                                            f"{options.min_bytes}")
    speedup = prediction.speedup(asked, chunks)
    if options.policy == "auto" and speedup < 1 + options.margin:
        return asked, chunks, ("policy", f"predicted speed-up {speedup:.3f}x ({asked}) on {prediction.hardware} is "
                                         f"under 1 + {options.margin:g}")
    return asked, chunks if asked == "chunk" else None, None


def all_reduce_shape(site: AllReduceSite) -> cost.SiteShape:
    """The cost model's view of a dot → all_reduce site as the reduce-scatter ring a split makes."""
    return scatter_shape(site, site.block_type)


def say_where_gathers_went(report: Report, carried, gathered: dict) -> None:
    """Tell each split site where the gathers of its rows ended (the carried values' readers)."""
    for m in carried.materialised:
        entry = report.sites[gathered[id(m.all_gather)]] if m.feeds_dot else None
        if entry is None:
            how = f"before {m.reader}"
        elif entry.rewritten:
            how = f"into the ring of {m.reader}"
        else:
            how = f"before {m.reader} (no ring: {entry.reason} [{entry.reason_code}])"
        for index in sorted(m.seeds):
            report.sites[index].all_reduce["gathers"].append(how)
    for index in carried.stayed:
        report.sites[index].all_reduce["gathers"].append("right after its reduce-scatter ring")
    for index, notes in carried.notes.items():
        report.sites[index].notes += notes
