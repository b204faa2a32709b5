"""The walk over a module's collectives, phase by phase (:class:`SiteWalk`).

Order matters: a scatter of a psum over another mesh axis moves before the psum first; the
psums are decided next (a split one leaves a scatter, ringed at once, and a gather carried
forward to where its value is read whole); then the scatters (a stacked gradient's scatter
hoisted into its loop where it can be); then the gathers of stacked weights sink into the loops
that read a layer a trip; then attentions over gathered K and V become one ring each with an
online softmax (:mod:`.attention`); last the gathers, in slack order (:mod:`.analysis.slack`), each merged
with its second stage, moved to its dots past row-wise ops, or ringed where it stands.  Every
collective is worked on inside :meth:`.attempts.Attempts.on`, so a failure names it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import math
from dataclasses import dataclass, replace

from . import cost, ir_utils, ring_pairs
from ._jax_private import ir
from .analysis.slack import SiteSlack, Slack
from .analysis.variance import Variance
from .attempts import Attempts
from .compile_budget import CompileBudget, program_weight
from .matchers import (
    AllGatherSite,
    DeclinedSite,
    ModuleInfo,
    ReduceScatterSite,
    Site,
    match_all_gather,
    match_reduce_scatter,
)
from .matchers.gather_rows import reaches_a_dot_row_wise
from .matchers.all_reduce import match_all_reduce
from .matchers.common import collective_ring
from .report import Report, SiteReport, tensor_bytes
from .rewrites.pad_motion import CroppedGather, PaddedProduct, cropped_gather, move_crop, move_pad, padded_product
from .rewrites.gathered_sums import gathered_sums, move_sums
from .rewrites.schedule import RewriteContext
from .rewrites.statistic_terms import StatisticTerms, split_terms, statistic_terms
from .rewrites.sequence_parallel import Seed, carry_forward, move_gather_forward, statistic_too_big
from .rewrites.sink import Hoisted, Sunk
from .rewrites import stages
from .rewrites.sink import hoist as hoist_scatter
from .rewrites.sink import feeds_a_loop, hoist_plan
from .rewrites.sink import plan as sink_plan
from .rewrites.sink import sink as sink_gather
from .psums import decide_all_reduce, say_where_gathers_went, split_summed_value
from .program_cost import ring_seconds
from .exchanges import decide_all_to_all
from .attention import decide_attention
from .column_rings import column_phase, say_why
from .matchers.attention import match_attention
from .matchers.all_to_all import combine_of
from .sites import VERDICTS, apply_site, dot_flops, site_shape

if TYPE_CHECKING:
    from .pipeline import Options


class SiteWalk:
    """One try's walk over a module's collectives, phase by phase (:meth:`rewrite_sites`): the
    scatters of psums moved before them, the psums, the scatters (hoisted into loops where
    they can be), the stacked gathers (sunk into loops), then the gathers in slack order (merged,
    moved to their dots, or ringed where they stand).  Holds what the phases share: the report,
    the rewrite context, the analyses, and the bookkeeping replay needs of each entry."""

    def __init__(self, module: ir.Module, options: "Options", source: str, info: ModuleInfo, ctx: RewriteContext,
                 verify, attempts: Attempts, layers, rings):
        self.options, self.source, self.info, self.ctx = options, source, info, ctx
        self.verify, self.attempts, self.layers = verify, attempts, layers
        self.report = Report(source, info.num_partitions)
        self.hw = cost.hardware(options.hardware)
        self.predictions: dict = {}  # SiteShape or pattern key -> (SiteShape, Prediction, its report entry)
        self.rings = rings
        self.variance = Variance(info)
        # replay needs the twin's (and the probe's) report entries, and the regions whose gathers compete
        self.regions_of: dict[int, ir.Block] = {}  # an entry (by id) -> its region's body
        self.lacking: dict[int, bool] = {}  # a twin's entry (by id) -> whether the region trimmed from it lacks its site
        # an entry (by id) -> the phase that made it (moved scatters, psums, scatters, gathers: each region's
        # entries of one phase are one run, which replay's copies follow)
        self.phase_of: dict[int, int] = {}
        self.phase = 0
        self.competing: set = set()
        self.column_notes: dict[str, tuple[str, str]] = {}  # a region over gathered columns left as written -> why
        #: gathers left plain for a scatter's ring (their op -> the scatter's location, their slack)
        self.prefetched: dict = {}
        #: psums split only for their matmuls' gather rings: report index -> (the psum's key, its Seed)
        self.summed_splits: dict[int, tuple] = {}
        #: the compile budget sites are built within (policy auto), or None
        self.budget = (CompileBudget(program_weight(module), options.compile_budget, module)
                       if options.policy == "auto" and options.compile_budget is not None else None)

    # ------------------------------------------------------------------ one site
    def rematch(self, op: ir.OpView) -> Site:
        """A site's copy, in its ring function."""
        if op.operation.name == "stablehlo.reduce_scatter":
            return match_reduce_scatter(op, self.info)
        return match_all_gather(op, self.info, assemble=self.options.assemble)

    def apply(self, site: Site, options: "Options | None" = None) -> SiteReport:
        sharing = (self.rings, self.rematch) if self.rings else None
        return apply_site(site, self.verify, self.ctx, self.source, options or self.options, self.hw,
                          self.predictions, sharing, self.budget_of(site.anchor))

    def budget_of(self, op: ir.OpView) -> tuple | None:
        """(the compile budget, how many times the program holds ``op`` once replay is done), or None."""
        if self.budget is None:
            return None
        return self.budget, self.layers.copies_of(op) if self.layers is not None else 1

    def apply_moved(self, new: Site, was: Site, how: str, *more: str, motion: bool = True) -> None:
        """A collective the pass moved to its matmul (where ``was`` declined it), rewritten
        there; its report says ``how``, and what more.  ``motion``: the collective itself
        moved (not only ringed with the ops it stood before), all or nothing (attempts)."""
        entry = self.apply(new)
        entry.moved_from = was.code
        entry.notes[:0] = [f"{how} (where it stood: declined [{was.code}])", *more]
        self.report.sites.append(entry)
        if motion:
            self.attempts.moved(entry)

    def left_as_written(self, op: ir.OpView, motion: tuple | None = None) -> bool:
        """Is ``op`` left as written (an earlier try failed on it)?  Its entry is reported (as
        a site of the motion known by ``motion``, where the op was moved)."""
        entry = self.attempts.left(op, ir_utils.enclosing_func_name(op))
        if entry is not None:
            self.report.sites.append(entry)
            if motion is not None:
                with self.attempts.on_behalf(motion):
                    self.attempts.moved(entry)
        return entry is not None

    def match_gather(self, op: ir.OpView, **kw) -> Site:
        return match_all_gather(op, self.info, assemble=self.options.assemble, **kw)

    # ------------------------------------------------------------------ replay's bookkeeping
    def place_of(self, op: ir.OpView) -> tuple:
        """(the body of the twin (or probe) region holding ``op``, whether the region trimmed from
        that twin lacks ``op`` (None: no such region)), asked before its site is rewritten."""
        return (self.layers.checked_region(op), self.layers.lacked(op)) if self.layers else (None, None)

    def tag(self, place: tuple, since: int, until: int | None = None) -> None:
        """The report's entries from ``since`` on (to ``until``) are the region's at ``place`` (:meth:`place_of`)."""
        region, lacked = place
        if region is not None:
            for entry in self.report.sites[since:until]:
                self.regions_of[id(entry)] = region
                self.phase_of[id(entry)] = self.phase
                if lacked is not None:
                    self.lacking[id(entry)] = lacked

    # ------------------------------------------------------------------ the phases
    def rewrite_sites(self, found: dict[str, list]) -> None:
        """Rewrite the sites of ``found``'s collectives: psums, then scatters, then gathers."""
        gathers = list(found["stablehlo.all_gather"])
        scatters, all_reduces = list(found["stablehlo.reduce_scatter"]), list(found["stablehlo.all_reduce"])
        # a scatter of a psum over another mesh axis moves before it, onto the product, and is
        # ringed there (first: the psum would otherwise be split, its ring and gather ahead
        # of the scatter)
        self.phase += 1
        not_swapped = stages.swap_reductions(scatters, all_reduces, self.info, self.source, self._ring_moved)
        # psums of dots next: a split one leaves a reduce_scatter (ringed at once) and an
        # all_gather, carried forward to where its value is read whole, which the gathers'
        # phase below then finds.
        self.phase += 1
        carried, optional = None, set()
        if self.options.all_reduce_strategy != "keep" and all_reduces:
            carried, more, optional = self._psums(all_reduces)
            gathers += more
        # Scatters first: a dot between an all_gather and a reduce_scatter becomes the
        # scatter ring's peeled dot, which the gather's ring then computes (and the
        # loop reads the gathered value the gather's ring assembles).  Each collective
        # is matched against the IR as the earlier rewrites left it.
        # (the scatter rewrites erase reduce_scatters and dots, never an all_gather)
        self.phase += 1  # (regions reading statistics over gathered columns back: attention's backward)
        gathers, scatters = column_phase(self, gathers, scatters)
        self.phase += 1
        for op in scatters:
            with self.attempts.on(op):
                self._scatter(op, not_swapped)
        # A gather of stacked weights sinks into the loops that read a layer a trip before any
        # gather is matched: each layer's gather then meets the loop body's own collectives at
        # its dot, and the slack order decides which of them the ring takes.
        sunk_from: dict[int, tuple] = {}  # a layer's gather (by id) -> (stack's site, notes, stack's key)
        not_sunk: dict[int, str] = {}  # a gather feeding a loop that could not take it -> why
        if found["stablehlo.while"]:
            gathers = self._sink(gathers, sunk_from, not_sunk)
        self.phase += 1
        gathers, kept_two_rings = self._attention(gathers)
        gathers, deferred = _order_by_slack(gathers, self.info, self.options, self.source)
        self.phase += 1
        gathered = self._gathers(gathers, deferred, optional, sunk_from, not_sunk)
        _say_why_two_rings(self.report, kept_two_rings)
        say_why(self.report, self.column_notes)
        _say_prefetchable(self.report, deferred, gathered)
        if carried is not None:
            say_where_gathers_went(self.report, carried, gathered)
            self._summed_splits_ringed(carried, gathered)
        self.phase += 1
        self._exchanges(found.get("stablehlo.all_to_all", []))

    def _attention(self, gathers: list) -> tuple[list, dict[str, tuple[str, str]]]:
        """Each attention over gathered K and V ringed with an online softmax (its two gathers
        then leave the gathers' phase); returns the gathers left and, by the keys' gather's
        location, why each attention the pass found was not (its gathers get rings of their own)."""
        taken: set[int] = set()  # indices into gathers
        why: dict[str, tuple[str, str]] = {}
        for index, op in enumerate(gathers):
            if index in taken:
                continue
            site = match_attention(op, self.info)
            if site is None:
                continue
            where = ir_utils.render_location(op.location, self.source)
            if isinstance(site, DeclinedSite):
                why[where] = (site.code, f"ring attention: {site.message} [{site.code}]")
                continue
            with self.attempts.on(op):
                if self.attempts.left(op, ir_utils.enclosing_func_name(op)) is not None:
                    continue
                values = next(i for i, g in enumerate(gathers) if g.operation == site.values.operation)
                since, place = len(self.report.sites), self.place_of(op)
                entry = decide_attention(site, self.info, self.ctx, self.options, self.hw, self.source)
                if not entry.rewritten:
                    why[where] = (entry.reason_code, f"ring attention: {entry.reason} [{entry.reason_code}]")
                    continue
                self.report.sites.append(entry)
                self.tag(place, since)
                taken.update((index, values))
        return [g for i, g in enumerate(gathers) if i not in taken], why

    def _exchanges(self, all_to_alls: list) -> None:
        """Each all_to_all as a pair's dispatch: chunked with its combine, or reported declined
        (a pair's combine is no site of its own)."""
        skipped: set[int] = set()  # indices of the pairs' combines (erased where the pair was chunked)
        for index, op in enumerate(all_to_alls):
            if index in skipped:
                continue
            combine = combine_of(op)
            if combine is not None:
                skipped.update(j for j in range(index + 1, len(all_to_alls))
                               if all_to_alls[j].operation == combine.operation)
            with self.attempts.on(op):
                if self.left_as_written(op):
                    continue
                since, place = len(self.report.sites), self.place_of(op)
                self.report.sites.append(decide_all_to_all(op, self.info, self.ctx, self.options, self.hw,
                                                           self.source))
                self.tag(place, since)

    def _ring_moved(self, site: ReduceScatterSite, note: str) -> str | None:
        """stages.swap_reductions' ring: the moved scatter's site rewritten, or why not."""
        since, place = len(self.report.sites), self.place_of(site.anchor)
        with self.attempts.on(site.anchor):
            if (why := self.attempts.left(site.anchor, "")) is not None:
                return why.reason
            entry = self.apply(site)
        if not entry.rewritten:
            return entry.reason
        entry.notes.insert(0, note)
        self.report.sites.append(entry)
        self.tag(place, since)
        return None

    def _psums(self, all_reduces: list) -> tuple:
        """Each psum decided and rewritten; the split ones' gathers carried forward.  Returns
        (the carry, the gathers it leaves for the gathers' phase, those of them that are sites
        only where a ring reaches their dots (by id))."""
        seeds: list[Seed] = []
        for op in all_reduces:
            with self.attempts.on(op):
                if self.left_as_written(op):
                    continue
                since, place = len(self.report.sites), self.place_of(op)
                site = match_all_reduce(op, self.info)
                if isinstance(site, DeclinedSite) and site.code == "producer_not_dot":  # an incoming cotangent
                    key = self.attempts.key(op)  # (asked before the split erases the op)
                    entry, seed = split_summed_value(site, self.info, self.ctx, self.source, self.options, self.hw,
                                                     self.attempts.may_move(op))
                    if seed is not None:
                        self.summed_splits[len(self.report.sites)] = (key, seed)
                else:
                    entry, seed = decide_all_reduce(site, self.ctx, self.source, self.options, self.hw, self.apply,
                                                    self.info, self.predictions, self.budget_of(op))
                if seed is not None:
                    seed.site = len(self.report.sites)
                    seeds.append(seed)
                self.report.sites.append(entry)
                self.tag(place, since)
        carried = carry_forward(seeds, self.variance, self.ctx.take_channel, self.ctx.constants, self.source)
        gathers = carried.kept + [m.all_gather for m in carried.materialised if m.feeds_dot]
        # a gather left before row-wise ops into dots (a residual add and a norm) is rung with
        # them per block where the gathers' turn finds that ring (else left as it is, no entry)
        left = [op for op in carried.left + [m.all_gather for m in carried.materialised if not m.feeds_dot]
                if reaches_a_dot_row_wise(op)]
        return carried, gathers + left, {id(op) for op in left}

    def _summed_splits_ringed(self, carried, gathered: dict) -> None:
        """A psum split only for its matmuls' gather ring (:func:`.psums.split_summed_value`) is a
        motion: where none of the gathers it left was ringed, the next try keeps the psum."""
        for index, (key, seed) in self.summed_splits.items():
            gathers = [id(seed.all_gather)] + [id(m.all_gather) for m in carried.materialised if index in m.seeds]
            entries = [self.report.sites[gathered[g]] for g in gathers if g in gathered]
            if not entries:  # (a motion with no site would never be undone)
                split = self.report.sites[index]
                entries = [SiteReport(kind=split.kind, location=split.location, function=split.function,
                                      rewritten=False, reason="no gather it left reaches a matmul's ring",
                                      reason_code="user_not_dot")]
            with self.attempts.on_behalf(key):
                for entry in entries:
                    self.attempts.moved(entry)
            _count_gather_rings(self.report.sites[index], entries)

    def _scatter(self, op: ir.OpView, not_swapped: dict) -> None:
        """One scatter: hoisted into the loop that assembles its operand, or ringed where it is."""
        if self.left_as_written(op):
            return
        since, place = len(self.report.sites), self.place_of(op)
        site = match_reduce_scatter(op, self.info)
        site, paired = ring_pairs.resolve(op, site, self.info, self.hw, self.options)
        banned = self.attempts.may_move(op)
        unpadded = self._unpad(op, site, banned)
        unspread = self._unspread(op, site, banned) if unpadded == "" else ""
        if unpadded is None or unspread is None:
            self.tag(place, since)
            return
        hoisted = (None if unpadded or unspread else
                   banned or _hoist_scatter(site, self.ctx, self.options, self.variance))
        if isinstance(hoisted, Hoisted):  # each layer's block scattered in the loop, ringed with its dot
            where = ir_utils.render_location(hoisted.loop.location, self.source)
            for scattered in hoisted.reduce_scatters:
                self.apply_moved(match_reduce_scatter(scattered, self.info), site,
                                 f"hoisted into the loop at {where}: each trip scatters the layer it computes into a "
                                 "buffer of this device's block, so the stacked gradient is never whole")
            return
        entry = self.apply(site)
        if hoisted:
            entry.reason += f"; not hoisted into the loop: {hoisted}"
        if unpadded:
            entry.reason += f"; its zero padding not moved onto the matmul's operand: {unpadded}"
        if unspread:
            entry.reason += f"; the sums over the scattered dim it spreads back not taken out: {unspread}"
        if paired is not None and paired.how == "kept":
            entry.reason += f"; {ring_pairs.describe(paired, ir_utils.render_location(paired.gather.location, self.source))}"
        elif paired is not None:
            if entry.rewritten:
                entry.notes.append(ring_pairs.describe(paired, ir_utils.render_location(paired.gather.location,
                                                                                       self.source)))
                if paired.how == "prefetched":
                    self.prefetched[paired.gather.operation] = (entry.location, paired.slack)
            else:
                self.info.plain_gathers.discard(paired.gather.operation)
        if id(op) in not_swapped and not entry.rewritten:
            entry.reason += f"; not moved before the psum: {not_swapped[id(op)]}"
        self.report.sites.append(entry)
        self.tag(place, since)

    def _unpad(self, op: ir.OpView, site: Site, banned: str | None) -> str | None:
        """A scatter of a zero-padded product: the padding moved onto the matmul's operand and the
        scatter ringed there (:mod:`.rewrites.pad_motion`; None).  Else why not ("" where no pad
        stands in the way); ``banned``: why an earlier try's motion was undone."""
        if not isinstance(site, DeclinedSite) or site.code != "producer_not_dot":
            return ""
        plan = padded_product(op)
        if not isinstance(plan, PaddedProduct) or banned:
            return plan if isinstance(plan, str) else banned if plan else ""
        where = ir_utils.render_location(plan.between.location, self.source)
        move_pad(plan)
        self.apply_moved(match_reduce_scatter(op, self.info), site,
                         f"the zero padding of its product (at {where}) moved onto the matmul's operand, the pad "
                         "rows masked back to zero: pad(a·b, 0) = select(m, pad(a, 0)·b, 0)")
        return None

    def _unspread(self, op: ir.OpView, site: Site, banned: str | None) -> str | None:
        """A scatter whose operand spreads sums over the scattered dim back over it (a norm's
        backward over gathered features): those terms taken out after the scatter and the scatter
        ringed (:mod:`.rewrites.statistic_terms`; None).  Else why not ("" where none stands)."""
        if not isinstance(site, DeclinedSite) or site.code != "producer_not_dot" or site.ring is None:
            return ""
        ring, region = collective_ring(op, self.info)
        self.variance.forget()  # (earlier rewrites may have erased ops it remembers)
        plan = statistic_terms(op, self.variance, ring)
        if not isinstance(plan, StatisticTerms) or banned:
            return plan if isinstance(plan, str) else banned if plan else ""
        sums = ", ".join(ir_utils.render_location(s.location, self.source) for s in plan.sums)
        split_terms(plan, ring, region, self.ctx.constants, self.ctx.take_channel)
        self.apply_moved(match_reduce_scatter(op, self.info), site,
                         f"the sums over the scattered dim it spreads back (at {sums}) all_reduced after the scatter, "
                         "their terms added to its own block: RS(A + L(spread(s))) = RS(A) + L(spread(psum(s)))[own]")
        return None

    def _uncrop(self, op: ir.OpView, site: Site, banned: str | None) -> str | None:
        """A gather whose rows are cropped before its matmuls: the crop moved past them and the
        gather ringed at the dots (:mod:`.rewrites.pad_motion`; None).  Else why not ("" where no
        crop stands in the way); ``banned``: why an earlier try's motion was undone."""
        if not isinstance(site, DeclinedSite) or site.code != "user_not_dot" or site.ring is None:
            return ""
        plan = cropped_gather(op)
        if not isinstance(plan, CroppedGather) or banned:
            return plan if isinstance(plan, str) else banned if plan else ""
        where = ir_utils.render_location(plan.crop[0].location, self.source)
        ring, region = collective_ring(op, self.info)
        move_crop(plan, ring, region, self.ctx.constants)
        zeroed = "; each shard's cropped rows zeroed before the gather" if plan.masks else ""
        self.apply_moved(self.match_gather(op), site,
                         f"the crop of its gathered rows (at {where}) moved past its matmuls: crop(G)·b = "
                         f"crop(G·b) for a free dim, crop(G)·b = G'·pad(b, 0) for a contracted one{zeroed}")
        return None

    def _sink(self, gathers: list, sunk_from: dict, not_sunk: dict) -> list:
        """The gathers, each stack's gather that sinks into its loops replaced by its layers' gathers."""
        expanded = []
        for op in gathers:
            with self.attempts.on(op) as stack:
                sunk = None
                if feeds_a_loop(op) and self.attempts.left(op, "") is None:
                    site = self.match_gather(op)
                    sunk = self.attempts.may_move(op) or _sink_gather(site, self.ctx, self.options, self.variance)
                if isinstance(sunk, Sunk):
                    notes = _sunk_notes(sunk, self.source)
                    for layer_gather in sunk.all_gathers:  # each a gather of one layer, read by the body's dot
                        sunk_from[id(layer_gather)] = (site, notes, stack)
                    expanded += sunk.all_gathers
                    continue
                if sunk:
                    not_sunk[id(op)] = sunk
                expanded.append(op)
        return expanded

    def _gathers(self, gathers: list, deferred: dict, optional: set, sunk_from: dict, not_sunk: dict) -> dict:
        """Every gather's site, in slack order; returns the report index of each gather's entry (by id)."""
        marks: list = []  # (first entry index, place_of(op)) per gather processed
        gathered: dict = {}
        merged_away: set[int] = set()  # second stages merged into their first (by index in gathers)
        held: list = []  # (second stage's operation, why): left with a first stage whose pair neither ring pays
        for index, op in enumerate(gathers):
            with self.attempts.on(op):
                if index in merged_away or self.left_as_written(op, sunk_from[id(op)][2] if id(op) in sunk_from else None):
                    continue
                if id(op) in optional:  # left by a split: a site only where a ring reaches its dots
                    self._optional_gather(op, marks, gathered)
                    continue
                if self.layers:  # the entries of this gather's site are its region's (the op may go)
                    place = self.place_of(op)
                    if id(op) in deferred and place[0] is not None:
                        self.competing.add(place[0])
                    marks.append((len(self.report.sites), place))
                gathered[id(op)] = len(self.report.sites)
                site = self.match_gather(op)
                if id(op) in sunk_from:
                    stacked, notes, stack = sunk_from[id(op)]
                    with self.attempts.on_behalf(stack):
                        self.apply_moved(site, stacked, *notes)
                    continue
                self._gather(op, site, index, gathers, merged_away, held, not_sunk)
        for (since, place), (until, _) in zip(marks, [*marks[1:], (len(self.report.sites), None)]):
            self.tag(place, since, until)
        return gathered

    def _optional_gather(self, op: ir.OpView, marks: list, gathered: dict) -> None:
        """A gather a psum split left before row-wise ops: ringed with them where a ring reaches its dots."""
        site = self.match_gather(op)
        ringed = site if isinstance(site, AllGatherSite) else self.match_gather(op, dag_alone=True)
        if not isinstance(ringed, AllGatherSite):
            return  # it stays where the split left it (said there)
        if self.layers:
            marks.append((len(self.report.sites), self.place_of(op)))
        gathered[id(op)] = len(self.report.sites)
        if ringed is site:
            self.report.sites.append(self.apply(site))
        else:
            self.apply_moved(ringed, site, f"{RINGED_WITH_ROW_OPS}: a gather the psum split left short of its dots",
                             motion=False)

    def _gather(self, op: ir.OpView, site: Site, index: int, gathers: list, merged_away: set, held: list,
                not_sunk: dict) -> None:
        """One gather: merged with its second stage, moved to its dots, or ringed where it stands."""
        options, report = self.options, self.report
        prefetched = self.prefetched.get(op.operation)  # (asked before a ring erases the op)
        left = next((why for stage, why in held if stage == op.operation), None)
        if left is not None and not isinstance(site, DeclinedSite):  # a second stage whose pair neither ring pays
            entry = self.apply(site, replace(options, margin=math.inf))  # priced, and left as it is
            if entry.reason_code == "policy":
                entry.reason = left
            report.sites.append(entry)
            return
        may_move = self.attempts.may_move(op)
        merged = None if may_move else _merge_stages(site, self.info, self.ctx, options, self.hw, self.source, held)
        if isinstance(merged, tuple):
            new, outer, choice = merged
            merged_away.update(j for j in range(index + 1, len(gathers)) if gathers[j].operation == outer.operation)
            where = ir_utils.render_location(outer.location, self.source)
            first = ir_utils.render_location(op.location, self.source)
            outer.operation.erase()
            op.operation.erase()
            self.apply_moved(self.match_gather(new), site,
                             f"merged with the second stage at {where}: one gather over both stages' groups",
                             *([choice.note] if choice else []))
            report.sites[-1].absorbs.append(first)
            if choice and report.sites[-1].cost:  # the options' times beside the merged ring's
                report.sites[-1].cost["two_stage"] = choice.pricing.to_dict()
            return
        uncropped = self._uncrop(op, site, may_move)
        if uncropped is None:
            return
        moved = (may_move or _move_gather(site, self.info, self.variance, self.ctx, self.source, options)
                 if not uncropped else None)
        if isinstance(moved, _RingedInstead):  # the move refused: the ring applies the ops per block
            self.apply_moved(moved.site, site, f"{RINGED_WITH_ROW_OPS}, not moved past them: {moved.why}",
                             motion=moved.motion)
            return
        unmoved = moved if isinstance(moved, str) else None  # why the row-wise ops were not moved past
        moved = None if unmoved else moved
        if moved is None:
            entry = self.apply(site)
            sunk = not_sunk.get(id(op))
            if sunk:  # a gather feeding a loop that could not take it: say what stopped it
                entry.reason += f"; not sunk into the loop: {sunk}"
            if unmoved and not entry.rewritten:
                entry.reason += f"; not moved to its dot: {unmoved}"
            if uncropped and not entry.rewritten:
                entry.reason += f"; the crop of its rows not moved past its matmuls: {uncropped}"
            if prefetched is not None and not entry.rewritten:
                where, slack = prefetched
                entry.reason_code, entry.slack = "prefetchable", {**slack.to_dict(), "competes_with": where}
                entry.reason = (f"the scatter of its dot's product at {where} has the ring (it can start only after "
                                f"the dot); this gather has {slack.hiding_flops:.3g} FLOP of compute before its dot"
                                f"{', its operand ready at the start of the step' if slack.early else ''}, and XLA's "
                                "latency-hiding scheduler issues it early, behind that compute")
            if isinstance(merged, _TwoStage):  # the cost model's choice, or why the stages cannot merge
                entry.reason = merged.reason
            report.sites.append(entry)
            return
        for m in moved.materialised:  # each now read by dots: an all_gather → dot site
            summed = (f" ({m.summed} of them sums over the gathered dim: each device sums its own share, an "
                      "all_reduce adds the shares)") if m.summed else ""
            self.apply_moved(self.match_gather(m.all_gather), site,
                             f"moved to its dot past {m.moved_ops} row-wise op(s), which now run on this device's "
                             f"rows{summed}")


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
    slack = Slack(dot_flops)
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


def _say_why_two_rings(report: Report, why: dict[str, tuple[str, str]]) -> None:
    """Each attention left with its gathers: the keys' gather's entries say why (a note, and
    the reason code in ``attention["two_rings"]``)."""
    for entry in report.sites:
        if entry.location in why and entry.kind == "all_gather_dot":
            code, note = why[entry.location]
            entry.notes.append(note)
            entry.attention = {"two_rings": code}


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


#: the note of a gather rung with the row-wise ops before its dots (matchers.gather_rows.row_dag)
RINGED_WITH_ROW_OPS = "rung with the row-wise ops before its dots applied to each block it receives"


def _move_gather(site: Site, info: ModuleInfo, variance: Variance, ctx: RewriteContext, source: str,
                 options: Options):
    """A gather declined because row-wise ops stand between it and its dots: move it past them
    (:func:`.rewrites.sequence_parallel.move_gather_forward`); None when it cannot move; where the
    move is refused, the ring that applies those ops per block (:class:`_RingedInstead`), or why
    not (a string).  Under any policy: a move none of whose gathers then rings is not made
    (:mod:`.attempts`), so a site the cost model leaves leaves the module as it was."""
    if not isinstance(site, DeclinedSite) or site.code not in MOVABLE_DECLINES or site.ring is None:
        return None
    ring, region = collective_ring(site.anchor, info)
    dim = ir_utils.int_attr(site.anchor.operation, "all_gather_dim")
    seed = Seed(site.anchor, ring, region, dim, -1)
    moved = move_gather_forward(seed, variance, ctx.take_channel, ctx.constants, source)
    if isinstance(moved, str):  # refused (the module untouched): a ring applying the ops per block instead?
        ringed = match_all_gather(site.anchor, info, assemble=options.assemble, dag_alone=True)
        if isinstance(ringed, AllGatherSite):
            return _RingedInstead(ringed, moved)
        variance.forget()  # (the move's questions may name values a rewrite since erased)
        sums = gathered_sums(site.anchor, variance, ring)
        summed = sum(tensor_bytes(ir.RankedTensorType(s.reduce.result.type)) for s in sums)
        if sums and not statistic_too_big(summed, tensor_bytes(ir.RankedTensorType(site.anchor.result.type))):
            # a norm's statistic over the gathered dim: summed from the shards first, then that ring
            note = move_sums(site.anchor, sums, ctx.take_channel)
            ringed = match_all_gather(site.anchor, info, assemble=options.assemble, dag_alone=True)
            return _RingedInstead(ringed, f"{moved}; {note}", motion=True)
    return moved


@dataclass
class _RingedInstead:
    """A gather :func:`_move_gather` could not move past the row-wise ops before its dots (``why``),
    matched as a ring applying them to each block it receives (:func:`.matchers.gather_rows.row_dag`)."""

    site: Site  # (declined where a motion made for it, ``motion``, left no ring: the motion is undone)
    why: str
    motion: bool = False


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
    be (a loop reads the value otherwise), or None (no loop reads it).  Under any policy, all or
    nothing, as :func:`_move_gather`."""
    if not isinstance(site, DeclinedSite) or site.code != "user_not_dot" or site.ring is None:
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
    (its operand is no loop's).  Under any policy, all or nothing, as :func:`_move_gather`."""
    if not isinstance(site, DeclinedSite) or site.code != "producer_not_dot" or site.ring is None:
        return None
    where = hoist_plan(site.anchor, variance, site.ring)
    if where is None or isinstance(where, str):
        return where
    return hoist_scatter(where, ctx.take_channel)


def _count_gather_rings(split: SiteReport, gathers: list[SiteReport]) -> None:
    """A psum split for its matmuls' gather rings: its predicted time, the reduce-scatter's plus
    what each ring of the gathers it left leaves exposed beyond its dots (the step's schedule
    takes the psum's place as that)."""
    p = split.all_reduce.get("prediction")
    if not p or "scatter_s" not in p:
        return
    rings = [(g.location, t) for g in gathers if (t := ring_seconds(g)) is not None]
    p["split_s"] = p["scatter_s"] + sum(t for _, t in rings)
    p["speedup"] = {"split": p["all_reduce_s"] / p["split_s"]}
    split.all_reduce["rings"] = [where for where, _ in rings]  # (counted here, not as gathers of the step)
