"""The pass pipeline: parse, match and rewrite each site, verify, report."""

from __future__ import annotations

import gc
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from . import cost, ir_utils, replay
from ._jax_private import hlo, ir, make_context, module_to_bytecode, module_to_hlo_text
from .analysis.slack import SiteSlack, Slack
from .analysis.deadlock import misplaced
from .analysis.variance import Variance
from .attempts import MAX_TRIES, MOTION, SITE, Attempts, Bans
from .errors import InternalError
from .matchers import (
    AllGatherSite,
    DeclinedSite,
    ModuleInfo,
    ReduceScatterSite,
    Site,
    match_all_gather,
    match_reduce_scatter,
)
from .matchers.all_gather import reaches_a_dot_row_wise
from .matchers.all_reduce import DOT_ALL_REDUCE, AllReduceSite, match_all_reduce
from .matchers.common import collective_ring
from .report import Report, SiteReport, describe_shard, element_bits, forget_types, tensor_bytes
from .rewrites.all_gather_dot import merge_groups, rewrite_all_gather_dot
from .rewrites.dot_all_reduce import chunk_all_reduce, chunk_dims_ok, split_all_reduce
from .rewrites.dot_reduce_scatter import halves_blocker, rewrite_dot_reduce_scatter
from .rewrites.builders import shared_per_block
from .rewrites.schedule import Annotator, Applied, RewriteContext
from .rewrites.sequence_parallel import Seed, carry_forward, move_gather_forward
from .rewrites.sink import Hoisted, Sunk
from .rewrites import stages
from .rewrites.sink import hoist as hoist_scatter
from .rewrites.sink import feeds_a_loop, hoist_plan, inline_scan_bodies
from .rewrites.sink import plan as sink_plan
from .rewrites.sink import sink as sink_gather
from .sharing import RingLibrary


@dataclass(frozen=True)
class Options:
    """What the pass does.

    ``debug_info``: print locations in :attr:`RewriteResult.text` (off, like ``Lowered.as_text()``).
    ``assemble``: when an all_gather's value is also read by ops the ring does not
    compute (a non-dot op, a dot needing later values), let the loop assemble the
    gathered value for them; with ``False`` such sites are declined (``multiple_users``).
    ``bidirectional``: use both ring directions (gathers: shards travel both ways,
    half the permute rounds; scatters: each block's halves travel opposite ways).
    ``unroll``: rounds per loop trip, 1 or 2 (remainder peeled), or ``"full"``: no
    loop, the whole ring straight-line.
    ``variant``: a ring variant by name (``cost.VARIANTS``: uni, unroll2, full, bidi,
    bidi-unroll2, bidi-full), which sets ``bidirectional`` and ``unroll`` (naming others
    is an error); or ``"auto"`` (the default when neither ``bidirectional`` nor ``unroll`` is
    given): per site, the variant the cost model predicts fastest on ``hardware`` (sites of one
    shape get the same one), or, where no profile describes the machine (``hardware="auto"`` on
    a CPU, say), ``cost.fallback_variant``: ``full`` on a ring of up to 8 devices (``uni``
    for a scatter of 8 MiB of partial sums or more), ``unroll2`` on longer ones.  ``bidirectional`` / ``unroll`` alone name a variant as well (the other taking one
    direction, one round per trip): ``Options(unroll=1)`` is ``uni``.
    ``annotate_streams``: outline each round's dots onto compute streams
    (``_xla_stream_annotation``) and group each permute with the dots it overlaps
    (``_scheduling_group_id``); XLA GPU honours them, CPU ignores them.
    ``share_rings``: a site repeating an earlier site's pattern calls one shared ring
    function instead of getting its own ring (:mod:`cmatmul_pass.sharing`); off while
    annotating streams.
    ``merge_dots``: a gather's dots that differ only in their other operand, along its one
    free dim (q/k/v, gate and up), become one dot per round on those operands concatenated
    once before the ring (XLA's dot merger would concatenate them in every round).
    ``tie_rounds``: where several rounds or directions compute in one block (unrolled,
    straight-line and bidirectional rings), pass each round's dot operands through an
    ``optimization_barrier`` (all but the first outside a loop: :class:`.rewrites.schedule.DotBarriers`),
    so that XLA does not merge dots of different rounds (which share an operand) into one
    that waits for every round's transfer; and send a gather
    round's shard through a barrier with the previous round's dot, so that its transfer
    starts after that dot (the scheduler otherwise may start it during that dot).
    ``policy``: ``"all"`` rewrites every legal site; ``"auto"`` only those whose
    predicted speed-up on ``hardware`` (a :mod:`cmatmul_pass.cost` profile, e.g.
    ``"h100"`` or ``"h100:bandwidth=400e9"``, or ``"auto"``: jax's default device's) exceeds
    ``1 + margin``.  ``min_bytes``:
    leave sites moving fewer bytes per device than this (XLA's windowed-einsum
    threshold, in bytes).  Every site's prediction goes into the report either way.
    ``all_reduce``: what becomes of a ``dot → all_reduce(sum)`` (a psum after a matmul):
    ``"split"`` (a reduce-scatter ring, then the gather carried forward to the next matmul's
    ring or to where the whole value is read: :mod:`.rewrites.sequence_parallel`),
    ``"chunk"`` (the rows in ``chunks`` pieces, each piece's all_reduce overlapping the next
    piece's dot), ``"auto"`` (per site, the one the cost model predicts faster on
    ``hardware``; on a tie within ``cost.TIE`` chunk, or split where the value goes on to a
    matmul, whose ring hides split's gather; where no profile describes the machine,
    ``cost.fallback_all_reduce``: two chunks), ``"keep"`` (left as they are).  None (the default): ``"auto"``; under
    ``policy="auto"`` it also leaves a site where neither beats the all_reduce.
    ``chunks``: the chunk count (2 to 8); None: the cost model's pick of 2, 4 or 8.
    """

    debug_info: bool = False
    assemble: bool = True
    bidirectional: bool | None = None
    unroll: int | str | None = None
    variant: str | None = None
    annotate_streams: bool = False
    share_rings: bool = True
    merge_dots: bool = True
    tie_rounds: bool = True
    policy: str = "all"
    hardware: str = "h100"
    min_bytes: int = 0
    margin: float = 0.02
    all_reduce: str | None = None
    chunks: int | None = None

    def __post_init__(self) -> None:
        if self.all_reduce not in (None, "split", "chunk", "auto", "keep"):
            raise ValueError(f"all_reduce must be 'split', 'chunk', 'auto' or 'keep', not {self.all_reduce!r}")
        if self.chunks is not None and not 2 <= self.chunks <= 8:
            raise ValueError(f"chunks must be from 2 to 8, not {self.chunks!r}")
        if self.unroll not in (None, 1, 2, "full"):
            raise ValueError(f"unroll must be 1, 2 or 'full', not {self.unroll!r}")
        if self.variant is None:  # bidirectional / unroll name one; neither: the default, auto
            given = self.bidirectional is not None or self.unroll is not None
            unroll = None if self.unroll == "full" else (self.unroll or 1)
            object.__setattr__(self, "variant", cost.variant_name(bool(self.bidirectional), unroll) if given else "auto")
        if self.variant != "auto" and self.variant not in cost.VARIANTS:
            raise ValueError(f"variant must be one of {', '.join(cost.VARIANTS)} or 'auto', not {self.variant!r}")
        bidirectional, unroll = cost.VARIANTS.get(self.variant, (False, 1))  # auto: one way's, to predict from
        named = bidirectional, "full" if unroll is None else unroll
        if (self.bidirectional not in (None, named[0]) or self.unroll not in (None, named[1])) and not (
                self.variant == "auto" and (self.bidirectional, self.unroll) == (False, 1)):  # auto's own, as replace() passes it
            raise ValueError(f"variant={self.variant!r} decides bidirectional and unroll; "
                             f"it contradicts bidirectional={self.bidirectional}, unroll={self.unroll!r}")
        object.__setattr__(self, "bidirectional", named[0])
        object.__setattr__(self, "unroll", named[1])
        if self.unroll not in (1, 2, "full"):
            raise ValueError(f"unroll must be 1, 2 or 'full', not {self.unroll!r}")
        if self.policy not in ("all", "auto"):
            raise ValueError(f"policy must be 'all' or 'auto', not {self.policy!r}")

    def with_variant(self, name: str) -> "Options":
        """These options with ring variant ``name`` (``bidirectional`` and ``unroll`` follow it)."""
        return replace(self, variant=name, bidirectional=None, unroll=None)

    @property
    def all_reduce_strategy(self) -> str:
        """What becomes of dot → all_reduce sites: split, chunk, auto (the default) or keep."""
        return self.all_reduce or "auto"

    @property
    def rounds_per_trip(self) -> int | None:
        """Rounds per loop trip; None: no loop (the whole ring straight-line)."""
        return None if self.unroll == "full" else int(self.unroll)


def variant_options(name: str, **extra) -> Options:
    """The Options of a named ring variant (``cost.VARIANTS``: uni, unroll2, full, bidi,
    bidi-unroll2, bidi-full, or ``"auto"``), plus any other option."""
    return Options(variant=name, **extra)


@dataclass
class RewriteResult:
    module: ir.Module
    report: Report
    options: Options = field(default_factory=Options)

    @property
    def text(self) -> str:
        return ir_utils.print_module(self.module, debug_info=self.options.debug_info)

    @property
    def bytecode(self) -> bytes:
        return module_to_bytecode(self.module)

    @property
    def hlo_text(self) -> str:
        """The rewritten module as (pre-optimisation) HLO text: loops, permutes and frontend
        attributes as XLA sees them."""
        return module_to_hlo_text(ir_utils.print_module(self.module))

    @property
    def changed(self) -> bool:
        """Does the module differ from the input?  Exactly when a site was rewritten: a motion
        whose sites all declined is not made, and a module with no site rewritten is the input."""
        return bool(self.report.rewritten)


class ChannelAllocator:
    """Fresh channel handles, above every handle already in the module (``found``: its
    ir_utils.CHANNEL_OPS by name, when the caller has walked it already)."""

    def __init__(self, module: ir.Module, found: dict[str, list[ir.OpView]] | None = None):
        found = found if found is not None else ir_utils.ops_named(module, *ir_utils.CHANNEL_OPS)
        handles = [
            hlo.ChannelHandle(op.operation.attributes["channel_handle"]).handle
            for name in ir_utils.CHANNEL_OPS
            for op in found[name]
            if "channel_handle" in op.operation.attributes
        ]
        self._next = self.first = max(handles, default=0) + 1

    def take(self) -> int:
        handle = self._next
        self._next += 1
        return handle


def rewrite(
    module: str | bytes | ir.Module,
    options: Options | None = None,
    *,
    source: str = "<input>",
    context: ir.Context | None = None,
) -> RewriteResult:
    """Apply the collective-matmul pass.

    ``module`` is StableHLO text, MLIR bytecode / a portable artifact, or a parsed
    ``ir.Module`` (rewritten in place, as MLIR passes do).  Raises
    :class:`~cmatmul_pass.errors.InputError` for unreadable input.
    """
    options = options or Options()
    if isinstance(module, ir.Module):
        snapshot = ir_utils.clone_module(module)  # to give the caller's module back as it was on a bug
        given = module

        def restore() -> None:
            _restore(given, snapshot)

        def again() -> ir.Module:
            restore()
            return given

        return _rewrite(module, options, source, again, restore)
    text = module
    module = ir_utils.parse(text, source=source, context=context or make_context())
    return _rewrite(module, options, source,
                    lambda: ir_utils.parse(text, source=source, context=context or make_context()), None)


def rewrite_copy(module: ir.Module, options: Options, source: str) -> RewriteResult:
    """:func:`rewrite` on a copy of ``module``, which stays as it is (``cmatmul_pass.jit`` on
    jax's module): no snapshot is kept, since a failure is retried on a fresh copy."""
    return _rewrite(ir_utils.clone_module(module), options, source, lambda: ir_utils.clone_module(module), None)


def _rewrite(module: ir.Module, options: Options, source: str, again: Callable[[], ir.Module],
             restore: Callable[[], None] | None) -> RewriteResult:
    """The pass on ``module``; on a failure, the pass again on ``again()`` (the input as it
    was), verifying after every site to name the one that broke the module, then
    ``restore()`` (when given: put the caller's module back as it was)."""
    reading = ir_utils.READING.set(source)  # messages built deep in the matchers name this file
    rendered = ir_utils.RENDERED.set({})  # (and render the same locations again and again)
    bans = Bans()
    try:
        for _ in range(MAX_TRIES):
            try:
                with _no_cyclic_gc():
                    result, undone = _run(module, options, source, verify_each=False, bans=bans)
            except Exception as exc:  # noqa: BLE001 - a bug of the pass, never a traceback for the user
                # The fast path verifies once, at the end.  On a failure, run again from the input,
                # verifying after every site, to name the collective that broke the module; the
                # next try leaves it as written (cmatmul_pass.attempts).
                failure = _internal(exc)
                try:
                    _run(again(), options, source, verify_each=True, bans=bans)
                except Exception as pinpointed:  # noqa: BLE001
                    failure = _internal(pinpointed)
                key = getattr(failure, "key", None)
                if key is None or key in bans.by_key:
                    if restore is not None:
                        restore()
                    raise failure from failure.__cause__
                bans.add(key, SITE, str(failure))
                module = again()
                continue
            if not undone:
                if not result.report.rewritten:  # nothing rewritten: the output is the input, as it was
                    result.module = again()      # (no scan body inlined, nothing moved)
                return result
            for key, why in undone.items():  # moved, then no ring where it went: not moved next time
                bans.add(key, MOTION, why)
            module = again()
        if restore is not None:
            restore()
        raise InternalError(f"the pass left {len(bans.by_key)} collectives as written and still failed "
                            "(a cmatmul_pass bug)")
    finally:
        ir_utils.READING.reset(reading)
        ir_utils.RENDERED.reset(rendered)
        forget_types()
        _FLOPS.clear()


def _run(module: ir.Module, options: Options, source: str, *, verify_each: bool,
         bans: Bans) -> tuple[RewriteResult, dict]:
    """One try of the pass on ``module``: its result, and the motions to leave undone next time
    (:meth:`Attempts.undone`)."""
    # Unknown is only the default for type construction; every op gets an explicit loc.
    with module.context, ir.Location.unknown(), shared_per_block() as constants:
        names = ("func.call", *ir_utils.CHANNEL_OPS, replay.MANUAL, "stablehlo.while")
        # identical layers: all but two are left for replay (cmatmul_pass.replay), and not walked;
        # it needs ring sharing (the layers become calls of one function, as the rings do) and one
        # verification
        replayable = options.share_rings and not options.annotate_streams and not verify_each
        # (a layer trimmed from a twin, replay.Trim, only where psums are not all split: a split carries
        # its gather past the ops after it, which such a layer has fewer of)
        found, layers = replay.walk(module, names, replayable, options.all_reduce_strategy != "split")
        # jax 0.10's scan bodies in functions holding collectives: inline, as later jax lowers them
        if options.policy == "all" and found["stablehlo.while"] and inline_scan_bodies(found):
            found = ir_utils.ops_named(module, *names)
        info = ModuleInfo.of(module, found["func.call"])
        report = Report(source, info.num_partitions)
        channels = ChannelAllocator(module, found)
        hw = cost.hardware(options.hardware)
        ctx = RewriteContext(
            channels.take,
            Annotator(module, enabled=options.annotate_streams),
            merge_dots=options.merge_dots,
            tie_rounds=options.tie_rounds,
            constants=constants,
        )
        placement = (info, channels.first)  # the collectives the pass makes must run alike on their groups
        verify = (lambda entry: _verify(module, entry, placement)) if verify_each else None
        predictions: dict = {}  # SiteShape or pattern key -> (SiteShape, Prediction, its report entry)
        rings = RingLibrary(module, bool(info.meshes)) if options.share_rings and not options.annotate_streams else None
        if rings is not None and layers is not None:  # a group's twin keeps its rings inline (it becomes the
            rings.inline = layers.inline_rings         # layer function, the one copy), and its probe likewise

        def rematch(op: ir.OpView) -> Site:  # a site's copy, in its ring function
            if op.operation.name == "stablehlo.reduce_scatter":
                return match_reduce_scatter(op, info)
            return match_all_gather(op, info, assemble=options.assemble)

        def apply(site: Site, opts: Options | None = None) -> SiteReport:
            return _apply(site, verify, ctx, source, opts or options, hw, predictions, (rings, rematch) if rings else None)

        def apply_moved(new: Site, was: Site, how: str, *more: str, motion: bool = True) -> None:
            """A collective the pass moved to its matmul (where ``was`` declined it), rewritten
            there; its report says ``how``, and what more.  ``motion``: the collective itself
            moved (not only ringed with the ops it stood before), all or nothing (attempts)."""
            entry = apply(new)
            entry.moved_from = was.code
            entry.notes[:0] = [f"{how} (where it stood: declined [{was.code}])", *more]
            report.sites.append(entry)
            if motion:
                attempts.moved(entry)

        def left_as_written(op: ir.OpView, motion: tuple | None = None) -> bool:
            """Is ``op`` left as written (an earlier try failed on it)?  Its entry is reported (as
            a site of the motion known by ``motion``, where the op was moved)."""
            entry = attempts.left(op, ir_utils.enclosing_func_name(op))
            if entry is not None:
                report.sites.append(entry)
                if motion is not None:
                    with attempts.on_behalf(motion):
                        attempts.moved(entry)
            return entry is not None

        variance = Variance(info)
        attempts = Attempts(source, bans)
        # replay needs the twin's (and the probe's) report entries, and the regions whose gathers compete
        regions_of: dict[int, ir.Block] = {}  # an entry (by id) -> its region's body
        lacking: dict[int, bool] = {}  # a twin's entry (by id) -> whether the region trimmed from it lacks its site
        # an entry (by id) -> the phase that made it (moved scatters, psums, scatters, gathers: each region's
        # entries of one phase are one run, which replay's copies follow)
        phase_of: dict[int, int] = {}
        phase = [0]
        competing: set = set()

        def place_of(op: ir.OpView) -> tuple:
            """(the body of the twin (or probe) region holding ``op``, whether the region trimmed from
            that twin lacks ``op`` (None: no such region)), asked before its site is rewritten."""
            return (layers.checked_region(op), layers.lacked(op)) if layers else (None, None)

        def tag(place: tuple, since: int, until: int | None = None) -> None:
            """The report's entries from ``since`` on (to ``until``) are the region's at ``place`` (:func:`place_of`)."""
            region, lacked = place
            if region is not None:
                for entry in report.sites[since:until]:
                    regions_of[id(entry)] = region
                    phase_of[id(entry)] = phase[0]
                    if lacked is not None:
                        lacking[id(entry)] = lacked

        def rewrite_sites(found: dict[str, list]) -> None:
            """Rewrite the sites of ``found``'s collectives: psums, then scatters, then gathers."""
            # psums of dots first: a split one leaves a reduce_scatter (ringed at once) and an
            # all_gather, carried forward to where its value is read whole, which the gathers'
            # pass below then finds.
            gathers = list(found["stablehlo.all_gather"])
            scatters, all_reduces = list(found["stablehlo.reduce_scatter"]), list(found["stablehlo.all_reduce"])
            optional: set[int] = set()  # gathers a psum split left short of their dots (by id)
            # a scatter of a psum over another mesh axis moves before it, onto the product, and is
            # ringed there (first: the psum would otherwise be split, its ring and gather ahead
            # of the scatter)

            def ring_moved(site: ReduceScatterSite, note: str) -> str | None:
                since, place = len(report.sites), place_of(site.anchor)
                with attempts.on(site.anchor):
                    if (why := attempts.left(site.anchor, "")) is not None:
                        return why.reason
                    entry = apply(site)
                if not entry.rewritten:
                    return entry.reason
                entry.notes.insert(0, note)
                report.sites.append(entry)
                tag(place, since)
                return None

            phase[0] += 1
            not_swapped = stages.swap_reductions(scatters, all_reduces, info, source, ring_moved)
            phase[0] += 1
            if options.all_reduce_strategy != "keep" and all_reduces:
                seeds: list[Seed] = []
                for op in all_reduces:
                    with attempts.on(op):
                        if left_as_written(op):
                            continue
                        since, place = len(report.sites), place_of(op)
                        entry, seed = _all_reduce(match_all_reduce(op, info), ctx, source, options, hw, apply, info,
                                                  predictions)
                        if seed is not None:
                            seed.site = len(report.sites)
                            seeds.append(seed)
                        report.sites.append(entry)
                        tag(place, since)
                carried = carry_forward(seeds, variance, ctx.take_channel, ctx.constants, source)
                gathers += carried.kept + [m.all_gather for m in carried.materialised if m.feeds_dot]
                # a gather left before row-wise ops into dots (a residual add and a norm) is rung with
                # them per block where the gathers' turn finds that ring (else left as it is, no entry)
                left = [op for op in carried.left + [m.all_gather for m in carried.materialised if not m.feeds_dot]
                        if reaches_a_dot_row_wise(op)]
                optional = {id(op) for op in left}
                gathers += left
            # Scatters first: a dot between an all_gather and a reduce_scatter becomes the
            # scatter ring's peeled dot, which the gather's ring then computes (and the
            # loop reads the gathered value the gather's ring assembles).  Each collective
            # is matched against the IR as the earlier rewrites left it.
            # (the scatter rewrites erase reduce_scatters and dots, never an all_gather)
            phase[0] += 1
            for op in scatters:
                with attempts.on(op):
                    if left_as_written(op):
                        continue
                    since, place = len(report.sites), place_of(op)
                    site = match_reduce_scatter(op, info)
                    hoisted = attempts.may_move(op) or _hoist_scatter(site, ctx, options, variance)
                    if isinstance(hoisted, Hoisted):  # each layer's block scattered in the loop, ringed with its dot
                        where = ir_utils.render_location(hoisted.loop.location, source)
                        for scattered in hoisted.reduce_scatters:
                            apply_moved(match_reduce_scatter(scattered, info), site,
                                        f"hoisted into the loop at {where}: each trip scatters the layer it computes into a "
                                        "buffer of this device's block, so the stacked gradient is never whole")
                        continue
                    entry = apply(site)
                    if hoisted:
                        entry.reason += f"; not hoisted into the loop: {hoisted}"
                    if id(op) in not_swapped and not entry.rewritten:
                        entry.reason += f"; not moved before the psum: {not_swapped[id(op)]}"
                    report.sites.append(entry)
                    tag(place, since)
            # A gather of stacked weights sinks into the loops that read a layer a trip before any
            # gather is matched: each layer's gather then meets the loop body's own collectives at
            # its dot, and the slack order decides which of them the ring takes.
            sunk_from: dict[int, tuple[Site, list[str]]] = {}  # a layer's gather (by id) -> (stack's site, notes)
            not_sunk: dict[int, str] = {}  # a gather feeding a loop that could not take it -> why
            if found["stablehlo.while"] and options.policy == "all":
                expanded = []
                for op in gathers:
                    with attempts.on(op) as stack:
                        sunk = None
                        if feeds_a_loop(op) and attempts.left(op, "") is None:
                            site = match_all_gather(op, info, assemble=options.assemble)
                            sunk = attempts.may_move(op) or _sink_gather(site, ctx, options, variance)
                        if isinstance(sunk, Sunk):
                            notes = _sunk_notes(sunk, source)
                            for layer_gather in sunk.all_gathers:  # each a gather of one layer, read by the body's dot
                                sunk_from[id(layer_gather)] = (site, notes, stack)
                            expanded += sunk.all_gathers
                            continue
                        if sunk:
                            not_sunk[id(op)] = sunk
                        expanded.append(op)
                gathers = expanded
            gathers, deferred = _order_by_slack(gathers, info, options, source)
            phase[0] += 1
            marks: list = []  # (first entry index, place_of(op)) per gather processed
            gathered = {}
            merged_away: set[int] = set()  # second stages merged into their first (by index in gathers)
            held: list = []  # (second stage's operation, why): left with a first stage whose pair neither ring pays
            for index, op in enumerate(gathers):
                with attempts.on(op):
                    if index in merged_away or left_as_written(op, sunk_from[id(op)][2] if id(op) in sunk_from else None):
                        continue
                    if id(op) in optional:  # left by a split: a site only where a ring reaches its dots
                        site = match_all_gather(op, info, assemble=options.assemble)
                        ringed = site if isinstance(site, AllGatherSite) else \
                            match_all_gather(op, info, assemble=options.assemble, dag_alone=True)
                        if not isinstance(ringed, AllGatherSite):
                            continue  # it stays where the split left it (said there)
                        if layers:
                            marks.append((len(report.sites), place_of(op)))
                        gathered[id(op)] = len(report.sites)
                        if ringed is site:
                            report.sites.append(apply(site))
                        else:
                            apply_moved(ringed, site, f"{RINGED_WITH_ROW_OPS}: a gather the psum split left short of its dots",
                                        motion=False)
                        continue
                    if layers:  # the entries of this gather's site are its region's (the op may go)
                        place = place_of(op)
                        if id(op) in deferred and place[0] is not None:
                            competing.add(place[0])
                        marks.append((len(report.sites), place))
                    gathered[id(op)] = len(report.sites)
                    site = match_all_gather(op, info, assemble=options.assemble)
                    if id(op) in sunk_from:
                        stacked, notes, stack = sunk_from[id(op)]
                        with attempts.on_behalf(stack):
                            apply_moved(site, stacked, *notes)
                        continue
                    left = next((why for stage, why in held if stage == op.operation), None)
                    if left is not None and not isinstance(site, DeclinedSite):  # a second stage whose pair neither ring pays
                        entry = apply(site, replace(options, margin=math.inf))  # priced, and left as it is
                        if entry.reason_code == "policy":
                            entry.reason = left
                        report.sites.append(entry)
                        continue
                    merged = None if attempts.may_move(op) else _merge_stages(site, info, ctx, options, hw, source, held)
                    if isinstance(merged, tuple):
                        new, outer, choice = merged
                        merged_away.update(j for j in range(index + 1, len(gathers)) if gathers[j].operation == outer.operation)
                        where = ir_utils.render_location(outer.location, source)
                        outer.operation.erase()
                        op.operation.erase()
                        apply_moved(match_all_gather(new, info, assemble=options.assemble), site,
                                    f"merged with the second stage at {where}: one gather over both stages' groups",
                                    *([choice.note] if choice else []))
                        if choice and report.sites[-1].cost:  # the options' times beside the merged ring's
                            report.sites[-1].cost["two_stage"] = choice.pricing.to_dict()
                        continue
                    moved = attempts.may_move(op) or _move_gather(site, info, variance, ctx, source, options)
                    if isinstance(moved, _RingedInstead):  # the move refused: the ring applies the ops per block
                        apply_moved(moved.site, site, f"{RINGED_WITH_ROW_OPS}, not moved past them: {moved.why}",
                                    motion=False)
                        continue
                    unmoved = moved if isinstance(moved, str) else None  # why the row-wise ops were not moved past
                    moved = None if unmoved else moved
                    sunk = not_sunk.get(id(op)) if moved is None else None
                    if moved is None:
                        entry = apply(site)
                        if sunk:  # a gather feeding a loop that could not take it: say what stopped it
                            entry.reason += f"; not sunk into the loop: {sunk}"
                        if unmoved and not entry.rewritten:
                            entry.reason += f"; not moved to its dot: {unmoved}"
                        if isinstance(merged, _TwoStage):  # the cost model's choice, or why the stages cannot merge
                            entry.reason = merged.reason
                        report.sites.append(entry)
                        continue
                    for m in moved.materialised:  # each now read by dots: an all_gather → dot site
                        apply_moved(match_all_gather(m.all_gather, info, assemble=options.assemble), site,
                                    f"moved to its dot past {m.moved_ops} row-wise op(s), which now run on this device's rows")
            for (since, place), (until, _) in zip(marks, [*marks[1:], (len(report.sites), None)]):
                tag(place, since, until)
            _say_prefetchable(report, deferred, gathered)
            if options.all_reduce_strategy != "keep" and all_reduces:
                _say_where_gathers_went(report, carried, gathered)

        rewrite_sites(found)  # (the regions left for replay are not in it)
        if layers is not None:
            leftover = layers.finish(report, regions_of, competing, source, lacking, channels.take, phase_of)
            if leftover:  # regions whose locations do not map, or a group whose probe differed: the usual way
                rewrite_sites(layers.only(leftover, names))
        if report.rewritten:
            ctx.annotator.finish()
            _verify(module, None, placement)
    return RewriteResult(module, report, options), attempts.undone()


def _apply(
    site: Site, verify: Callable | None, ctx: RewriteContext, source: str, options: Options, hw: cost.Hardware,
    predictions: dict, sharing: tuple | None = None,
) -> SiteReport:
    """Rewrite one site (``verify(entry)``: verify the module afterwards; None: the caller verifies at the end).

    ``sharing``: (RingLibrary, re-matcher) when sites of one pattern may share a ring function.
    """
    entry = _describe(site, source)
    if isinstance(site, DeclinedSite):
        return entry
    rings, rematch = sharing or (None, None)
    pattern = _guarded(entry, rings.pattern, site) if rings else None
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
    declined = _policy(options, shape, prediction)
    if declined:
        entry.reason_code, entry.reason = declined
        return entry

    # the site's variant: the options' own, or the one the cost model picked for its shape
    ctx.bidirectional, ctx.unroll = cost.VARIANTS[prediction.variant]

    def build(site: Site) -> Applied:
        if isinstance(site, ReduceScatterSite):
            return rewrite_dot_reduce_scatter(site, ctx)
        return rewrite_all_gather_dot(site, ctx, merged if options.merge_dots == ctx.merge_dots else None)

    moved = _guarded(entry, hoist, site)
    shared = _guarded(entry, rings.share, site, pattern, rematch, build) if pattern else None
    applied = shared.applied if shared else _guarded(entry, build, site)
    if verify is not None:
        verify(entry)
    entry.rewritten = True
    entry.shared_ring = f"@{shared.name}" if shared else None
    entry.channel_handles = list(applied.channel_handles)
    entry.schedule = {
        "variant": prediction.variant,  # asked for (see notes)
        "directions": applied.directions,
        "rounds": applied.stats.rounds,
        "loop_trips": applied.stats.loop_trips,
        "rounds_per_trip": applied.stats.rounds_per_trip,
        "peeled_rounds": applied.stats.peeled,
        "permutes": applied.permutes,
        "streams_annotated": ctx.annotator.enabled,
    }
    entry.notes = applied.notes + moved
    return entry


#: the options' verdicts on a site that matched: not a dot lost to another ring
VERDICTS = frozenset({"policy", "min_bytes"})


@dataclass
class _Deferred:
    """A gather whose dot another collective with less slack competes for (analysis.slack): it
    is matched after that one, and said ``prefetchable`` if that one's ring took the dot."""

    slack: SiteSlack
    winner: str  # the competing collective's location
    winner_slack: SiteSlack
    moved: bool  # matched after the winner for its slack (False: a tie, the program's order)


def _order_by_slack(gathers: list, info: ModuleInfo, options: Options, source: str) -> tuple[list, dict[int, _Deferred]]:
    """``gathers`` with, where gathers over different device groups meet at one dot (a 2-D mesh:
    the weight's over 'data', the activation's over 'model'), the one with more slack after the
    other, so that the critical-path collective gets the ring (analysis.slack).  Returns the
    order and the deferred gathers (by ``id`` of their op)."""
    if len(gathers) < 2 or len({op.attributes["replica_groups"] for op in gathers}) < 2:
        return gathers, {}  # one set of device groups (MLIR uniques attributes): nothing competes
    sites = [match_all_gather(op, info, assemble=options.assemble) for op in gathers]
    sites = [s for s in sites if isinstance(s, AllGatherSite)]
    if len({s.ring.groups for s in sites}) < 2:
        return gathers, {}
    slack = Slack(_dot_flops)
    at_dot: dict = {}
    for site in sites:
        for consumer in site.consumers:
            at_dot.setdefault(consumer.dot.operation, []).append(site)
    measured: dict = {}

    def of(site: AllGatherSite) -> SiteSlack:
        if id(site) not in measured:
            measured[id(site)] = slack.of(site.all_gather, [c.dot for c in site.consumers])
        return measured[id(site)]

    deferred: dict[int, _Deferred] = {}
    for competing in at_dot.values():
        if len({s.ring.groups for s in competing}) < 2:
            continue
        ranked = sorted(competing, key=lambda s: of(s).rank)  # stable: a tie keeps the program's order
        winner = ranked[0]
        for site in ranked[1:]:
            if site.ring.groups != winner.ring.groups and id(site.all_gather) not in deferred:
                deferred[id(site.all_gather)] = _Deferred(
                    of(site), ir_utils.render_location(winner.all_gather.location, source), of(winner),
                    of(site).rank != of(winner).rank)
    moved = {key for key, d in deferred.items() if d.moved}
    order = [op for op in gathers if id(op) not in moved] + [op for op in gathers if id(op) in moved]
    return order, deferred


def _say_prefetchable(report: Report, deferred: dict[int, _Deferred], gathered: dict) -> None:
    """A deferred gather that lost its dot to the other collective's ring: ``prefetchable``."""
    for key, d in deferred.items():
        entry = report.sites[gathered[key]]
        entry.slack = {**d.slack.to_dict(), "competes_with": d.winner}
        # it matched before the other ring was built (_order_by_slack): a decline now is that ring's doing
        if entry.rewritten or entry.reason_code in VERDICTS:
            continue
        was = f"(matched after that ring: {entry.reason})"
        if d.slack.hiding_flops > 0:
            why = (f"it is on the critical path ({d.winner_slack.hiding_flops:.3g} FLOP of compute could hide it)"
                   if d.moved else "the first in the program, with as much slack")
            entry.reason_code = "prefetchable"
            entry.reason = (f"the dot's other collective at {d.winner} has the ring: {why}; this one has "
                            f"{d.slack.hiding_flops:.3g} FLOP of compute before its dot"
                            f"{', its operand ready at the start of the step' if d.slack.early else ''}, and XLA's "
                            "latency-hiding scheduler (--xla_gpu_enable_latency_hiding_scheduler=true) issues it early, "
                            f"behind that compute {was}")
        else:
            entry.reason_code = "lost_to_ring"
            why = ("its operand is computed in this step, this one's is ready at the step's start" if d.moved else
                   "neither has more slack (both operands " +
                   ("ready at the step's start" if d.slack.early else "computed in this step") +
                   "), so the one first in the program took it")
            entry.reason = (f"the dot's other collective at {d.winner} has the ring: {why}; no compute precedes the "
                            f"dot to hide this one behind {was}")


#: declines of a gather whose value may reach its dots through row-wise ops (a norm, a bias)
MOVABLE_DECLINES = frozenset({"layout", "user_not_dot"})
#: the note of a gather rung with the row-wise ops before its dots (matchers.all_gather._row_dag)
RINGED_WITH_ROW_OPS = "rung with the row-wise ops before its dots applied to each block it receives"


def _move_gather(site: Site, info: ModuleInfo, variance: Variance, ctx: RewriteContext, source: str,
                 options: Options):
    """A gather declined because row-wise ops stand between it and its dots: move it past them
    (:func:`.rewrites.sequence_parallel.move_gather_forward`); None when it cannot move; where the
    move is refused, the ring that applies those ops per block (:class:`_RingedInstead`), or why
    not (a string).  Only
    under ``policy="all"``: a site the cost model then leaves must leave the module as it was."""
    if not isinstance(site, DeclinedSite) or site.code not in MOVABLE_DECLINES or site.ring is None \
            or options.policy != "all":
        return None
    ring, region = collective_ring(site.anchor, info)
    dim = ir_utils.int_attr(site.anchor.operation, "all_gather_dim")
    seed = Seed(site.anchor, ring, region, dim, -1)
    moved = move_gather_forward(seed, variance, ctx.take_channel, ctx.constants, source)
    if isinstance(moved, str):  # refused (the module untouched): a ring applying the ops per block instead?
        ringed = match_all_gather(site.anchor, info, assemble=options.assemble, dag_alone=True)
        if isinstance(ringed, AllGatherSite):
            return _RingedInstead(ringed, moved)
    return moved


@dataclass
class _RingedInstead:
    """A gather :func:`_move_gather` could not move past the row-wise ops before its dots (``why``),
    matched as a ring applying them to each block it receives (:func:`.matchers.all_gather._row_dag`)."""

    site: AllGatherSite
    why: str


@dataclass
class _TwoStage:
    """What :func:`_merge_stages` decided for a first stage: the merge's note (merged), or the
    first stage's whole reason (left); ``pricing``: the options' predicted times, where priced."""

    pricing: cost.TwoStagePrediction | None
    note: str = ""
    reason: str = ""


def _merge_stages(site: Site, info: ModuleInfo, ctx: RewriteContext, options: Options, hw: cost.Hardware,
                  source: str, held: list):
    """The first stage of a two-stage gather (:mod:`.rewrites.stages`): merge the stages into one
    gather, whose ring then covers both, or leave this stage a plain gather ahead of the second
    stage's ring, or (``--policy auto``) leave both, as the cost model prices the three
    (:func:`.cost.predict_two_stage`, :meth:`.cost.TwoStagePrediction.choice`).  Returns (new
    gather, second stage, :class:`_TwoStage` or None) when merged, a :class:`_TwoStage` saying
    why this stage stays, or None (not a first stage).  A second stage left too goes on ``held``
    with its reason."""
    if not isinstance(site, DeclinedSite) or site.code != "two_stage":
        return None
    planned = stages.plan(site.anchor, info)
    if planned is None:
        return None
    if isinstance(planned, str):
        return _TwoStage(None, reason=f"{site.message}; not merged with it: {planned}")
    outer, groups = planned
    where = ir_utils.render_location(outer.location, source)
    head = (f"the gathered value feeds the second stage of a two-stage gather (a weight sharded over two mesh axes, "
            f"gathered over one, then the other), the all_gather at {where}")
    second = match_all_gather(outer, info, assemble=options.assemble)
    if isinstance(second, DeclinedSite):  # no ring for the second stage: nothing to price
        if options.policy == "all":  # one gather for two all the same, as ever
            return stages.build(site.anchor, outer, groups, ctx.take_channel), outer, None
        return _TwoStage(None, reason=f"{head}, which no ring can take either ([{second.code}] {second.message}): "
                                      "not merged (--policy auto merges only for a ring that pays; --policy all "
                                      "would merge them into one plain gather)")
    first_ring = len(groups[0]) // second.ring.size
    shard = tensor_bytes(ir_utils.ranked_tensor(site.anchor.operation.operands[0]))
    pricing = cost.predict_two_stage(site_shape(second, options.merge_dots), first_ring, shard, hw, options.variant,
                                     min_bytes=options.min_bytes)
    choice = pricing.choice(options.policy, options.margin)
    numbers = pricing.describe()
    if choice == "merged":
        best = pricing.preferred()
        if best == "merged":
            verdict = "merged, the fastest"
        else:  # only --policy all merges against the model's preference
            other = {"second": "ringing only the second stage", "neither": "leaving both plain gathers"}[best]
            verdict = (f"merged as --policy all merges every pair it can, although the model predicts {other} faster"
                       f" ({cost.readable_seconds(pricing.seconds(best))} against {cost.readable_seconds(pricing.seconds('merged'))}); "
                       "--policy auto follows the model")
        return (stages.build(site.anchor, outer, groups, ctx.take_channel), outer,
                _TwoStage(pricing, note=f"two-stage choice {numbers}: {verdict}"))
    if choice == "second":
        if options.policy == "all":  # the merged ring excluded (--min-bytes)
            why = f"the merged ring {pricing.excluded.get('merged', 'is not available')}"
        elif pricing.pays("merged", options.margin):
            why = "the second stage's ring alone is predicted faster than the merged ring"
        else:
            why = (f"the second stage's ring pays and the merge does not (under 1 + {options.margin:g} against the "
                   "original)")
        return _TwoStage(pricing, reason=f"{head}, which has the ring; this stage stays a plain gather ahead of it: "
                                         f"{why}; {numbers}")
    if set(pricing.excluded) >= {"merged", "second"}:
        why = "both rings move fewer bytes than --min-bytes"
    else:
        why = f"neither ring is predicted {options.margin:g} faster than the original: {pricing.why_neither()}"
    held.append((outer.operation, f"the second stage of a two-stage gather, left a plain gather with its first stage "
                                   f"at {ir_utils.render_location(site.anchor.location, source)}: {why}; {numbers}"))
    return _TwoStage(pricing, reason=f"{head}; both stay plain gathers: {why}; {numbers}")


def _sink_gather(site: Site, ctx: RewriteContext, options: Options, variance: Variance) -> Sunk | str | None:
    """A gather of stacked weights whose loop reads one layer per trip (a scan over layers):
    sink it into the loop (:mod:`.rewrites.sink`).  Returns what was built, why it could not
    be (a loop reads the value otherwise), or None (no loop reads it).  Only under
    ``policy="all"``, as :func:`_move_gather`."""
    if not isinstance(site, DeclinedSite) or site.code != "user_not_dot" or site.ring is None \
            or options.policy != "all":
        return None
    if not feeds_a_loop(site.anchor):
        return None
    where = sink_plan(site.anchor, variance, site.ring)
    if isinstance(where, str):
        return where
    return sink_gather(site.anchor, where, ctx.take_channel)


def _sunk_notes(sunk: Sunk, source: str) -> list[str]:
    """What the report of each layer's gather says of the stack it was sunk from."""
    where = ", ".join(dict.fromkeys(ir_utils.render_location(loop.location, source) for loop in sunk.loops))
    handed = [f"the stack was also kept for {sunk.handed} later region(s) (a backward): they get the "
              "shard and gather each layer again, so the layers cross the wire once per loop instead of "
              "once (memory for bytes, as FSDP trades)"] if sunk.handed else []
    return [f"sunk into the loop{'s' if len(sunk.loops) > 1 else ''} at {where}: each trip gathers only the layer it "
            "reads, so one layer's gathered weight is alive instead of the whole stack", *handed]


def _hoist_scatter(site: Site, ctx: RewriteContext, options: Options, variance: Variance) -> Hoisted | str | None:
    """A scatter of a stacked gradient a loop assembles layer by layer (a scan's backward): move it
    into the loop (:func:`.rewrites.sink.hoist`).  What was built, why it could not be, or None
    (its operand is no loop's).  Only under ``policy="all"``."""
    if not isinstance(site, DeclinedSite) or site.code != "producer_not_dot" or site.ring is None \
            or options.policy != "all":
        return None
    where = hoist_plan(site.anchor, variance, site.ring)
    if where is None or isinstance(where, str):
        return where
    return hoist_scatter(where, ctx.take_channel)


def _all_reduce(site, ctx: RewriteContext, source: str, options: Options, hw: cost.Hardware, apply,
                info: ModuleInfo, predictions: dict) -> tuple[SiteReport, Seed | None]:
    """Decide and rewrite one dot → all_reduce site (Options.all_reduce); returns its report
    entry and, when split, the gather to carry forward (``predictions``: the pass's cache)."""
    entry = _describe(site, source)
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
    if declined:
        entry.reason_code, entry.reason = declined
        return entry, None
    slower = prediction.speedup(strategy, chunks)
    if slower < 1:
        entry.notes.append(f"{strategy} is predicted {slower:.2f}x the all_reduce's speed on {prediction.hardware} "
                           "(policy all rewrites it anyway; --policy auto would leave it)")
    if strategy == "chunk":
        applied = _guarded(entry, chunk_all_reduce, site, ctx, chunks)
        entry.rewritten = True
        entry.channel_handles = list(applied.channel_handles)
        entry.notes += applied.notes
        return entry, None
    reduce_scatter, all_gather = _guarded(entry, split_all_reduce, site, ctx.take_channel)
    # the split's reduce_scatter sums the product the all_reduce's match traced, along the same
    # dim, in the same block: its site is that match's, anchored on it (no second trace)
    ring_site = ReduceScatterSite(reduce_scatter, site.terms, site.adds, site.path, site.ring, site.region, site.dim)
    ringed = apply(ring_site, replace(options, policy="all", min_bytes=0))  # decided above
    ringed.kind, ringed.all_reduce, ringed.notes = DOT_ALL_REDUCE, entry.all_reduce, entry.notes + ringed.notes
    return ringed, Seed(all_gather, site.ring, site.region, site.dim, -1)


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
    return _scatter_shape(site, site.block_type)


def _say_where_gathers_went(report: Report, carried, gathered: dict) -> None:
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


def _guarded(entry: SiteReport, step, *args):
    """``step(*args)``; any failure while rewriting a site is a bug of the pass: say which site."""
    try:
        return step(*args)
    except Exception as exc:  # noqa: BLE001
        raise InternalError(
            f"rewriting the {entry.kind} site at {entry.location} failed (a cmatmul_pass bug): "
            f"{type(exc).__name__}: {' '.join(str(exc).split())}"
        ) from exc


def _describe(site: Site, source: str) -> SiteReport:
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
        entry.assembled_for = [
            f"{op.operation.name} at {ir_utils.render_location(op.location, source)}" for op in site.kept_users
        ]
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


def _internal(exc: Exception) -> InternalError:
    """``exc`` as the InternalError it is (a bug of the pass, whatever its type)."""
    if isinstance(exc, InternalError):
        return exc
    failure = InternalError(f"the pass failed (a cmatmul_pass bug): {type(exc).__name__}: {' '.join(str(exc).split())}")
    failure.__cause__ = exc
    return failure


def _verify(module: ir.Module, entry: SiteReport | None, placement: tuple | None = None) -> None:
    """MLIR's verifier, and (``placement``: the module's info and the first channel handle the
    pass took) the deadlock rule: every collective the pass made runs alike on its group
    (:mod:`.analysis.deadlock`)."""
    what = f"rewriting the {entry.kind} site at {entry.location}" if entry else "the rewrite"
    try:
        module.operation.verify()
    except ir.MLIRError as exc:
        raise InternalError(
            f"{what} produced IR that does not verify (a cmatmul_pass bug): {' '.join(str(exc).split())}"
        ) from exc
    bad = misplaced(module, *placement) if placement else []
    if bad:
        op, why = bad[0]
        raise InternalError(f"{what} put a {op.name} where its group may not run it alike ({why}): it could "
                            "deadlock (a cmatmul_pass bug)")


def _restore(module: ir.Module, snapshot: ir.Module) -> None:
    """Put ``module``'s body back as it was (a copy of ``snapshot``'s, which stays as it is), in place."""
    original = ir_utils.clone_module(snapshot)
    body = module.body
    for op in reversed(list(body.operations)):
        op.operation.erase()
    end = ir.InsertionPoint(body)
    for op in list(original.body.operations):
        op.operation.detach_from_parent()
        end.insert(op.operation)


def _policy(options: Options, shape: cost.SiteShape, prediction: cost.Prediction) -> tuple[str, str] | None:
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
        return _scatter_shape(site, ir_utils.ranked_tensor(site.reduce_scatter.result))
    return _shape(site, parts, step, groups)


def _scatter_shape(site, block: ir.RankedTensorType) -> cost.SiteShape:
    """A scatter ring's shape: ``block`` is what one permute moves; each term is its own dot in
    every round."""
    return _shape(site, site.terms, block, [[i] for i in range(len(site.terms))])


def _shape(site, parts, step: ir.RankedTensorType, groups: list[list[int]]) -> cost.SiteShape:
    dots = [part.dot for part in parts]
    each = [_dot_flops(d) for d in dots]
    dtype = _priced_dtype(dots[0])
    halvable = isinstance(site, AllGatherSite) or halves_blocker(site) is None
    kind = "dot_reduce_scatter" if site.kind == DOT_ALL_REDUCE else site.kind  # a split psum: a scatter ring
    return cost.SiteShape(kind, site.ring.size, sum(each), tensor_bytes(step), dtype, halvable,
                          tuple(sum(each[i] for i in members) for members in groups),
                          tuple(parts[members[0]].role for members in groups))


def _dot_flops(dot) -> float:
    """Real FLOPs: a multiply-add of complex numbers is four real ones."""
    op = dot.operation
    key = (op.operands[0].type, op.results[0].type, op.attributes["dot_dimension_numbers"])
    flops = _FLOPS.get(key)
    if flops is None:  # the layers repeat their dots: worked out once per kind
        lhs, out = (ir.RankedTensorType(t) for t in key[:2])
        contracting = hlo.DotDimensionNumbers(key[2]).lhs_contracting_dimensions
        real = 4.0 if isinstance(lhs.element_type, ir.ComplexType) else 1.0
        flops = _FLOPS[key] = real * 2.0 * math.prod(out.shape) * math.prod(lhs.shape[d] for d in contracting)
    return flops


#: _dot_flops by (lhs type, result type, dimension numbers), and _priced_dtype by operand types,
#: for one run of the pass
_FLOPS: dict = {}


def _priced_dtype(dot) -> str:
    """:func:`_priced_element_type`'s name (worked out once per pair of operand types)."""
    key = tuple(v.type for v in dot.operation.operands)
    name = _FLOPS.get(key)
    if name is None:
        name = _FLOPS[key] = str(_priced_element_type(dot))
    return name


def _priced_element_type(dot) -> ir.Type:
    """The type the cost model prices a dot's FLOPs at: the wider of its operands' (a dot of an
    fp8 operand and a bf16 one runs as bf16), a complex type's parts."""
    types = [ir_utils.ranked_tensor(v).element_type for v in dot.operation.operands]
    element = max(types, key=element_bits)  # the lhs's on a tie
    return ir.ComplexType(element).element_type if isinstance(element, ir.ComplexType) else element


class _no_cyclic_gc:
    """Pause Python's cyclic garbage collector while the pass builds IR.

    The bindings allocate many short-lived Python objects per op; the collector's
    generation-0 sweeps then cost more than the rewriting (measured: a quarter of the
    pass at 255 sites).  Nothing the pass creates forms reference cycles that must be
    reclaimed before it returns; the previous state is restored afterwards.
    """

    def __enter__(self) -> None:
        self.was_enabled = gc.isenabled()
        gc.disable()

    def __exit__(self, *exc) -> None:
        if self.was_enabled:
            gc.enable()
