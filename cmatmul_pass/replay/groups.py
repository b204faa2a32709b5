"""The groups of identical regions (:class:`Group`) and a module's plan (:class:`Plan`): which regions
the pipeline rewrites, which it leaves for replay, and the calls that replace them once the
rewritten ones are done (:meth:`Plan.finish`).  A joiner, the region before a twin that returns
fewer of its own inputs, is found here too (:func:`_joins`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .. import ir_utils
from .._jax_private import hlo, ir, sdy
from ..report import Report, SiteReport
from ..rewrites.builders import forget_inside
from .entries import _entry, _Replay
from .regions import (MANUAL, _body, _call, _channel_ops, _layer_name, _located_places, _locations, _outline,
                      _types, pass_through)
from .trimming import Trim, _reads_around, _trimmed_function

if TYPE_CHECKING:
    from .fingerprint import _Fingerprint


@dataclass(eq=False)
class Group:
    """Top-level regions with one body, in program order, and what the twin and the probe
    were before the pass."""

    members: list[ir.Operation]
    #: whether the last member is the probe (:data:`CHECK`), rewritten the usual way to check the group
    checked: bool = False
    #: the region just before the twin, when its body is the twin's but it returns fewer of its
    #: own inputs (:func:`pass_through`): a model's first layer, whose inputs the caller holds
    joiners: list[ir.Operation] = field(default_factory=list)
    #: each joiner's results as the twin's: result index -> the twin's result index (by body)
    result_maps: dict = field(default_factory=dict)
    # the twin's and the probe's (locations in walk order, types) before the pass
    twin_before: tuple = ()
    probe_before: tuple = ()
    # where each of the twin's ops was before the pass, in walk order: (region, block, op) indices from the
    # twin (None until read: a copy's are the twin's, op for op)
    twin_places: list | None = None
    #: the region just after the group, when its body is the twin's without some results and the
    #: ops only they need (:func:`_trims`): a model's first layer's backward, which returns no
    #: gradient for the model's input
    trims: list["Trim"] = field(default_factory=list)
    #: the members located as the twin at every op before the pass (their bodies; their bytecode with
    #: locations is the twin's: :func:`plan`)
    located_as_twin: set = field(default_factory=set)

    @property
    def twin(self) -> ir.Operation:
        return self.members[0]

    @property
    def probe(self) -> ir.Operation | None:
        # the last: its context (what reads its results) the least like the twin's
        return self.members[-1] if self.checked else None

    @property
    def rewritten(self) -> list[ir.Operation]:
        """The regions the pipeline rewrites the usual way: the twin, and the probe if any."""
        return self.members[:1] + self.members[-1:] if self.checked else self.members[:1]

    @property
    def rest(self) -> list[ir.Operation]:
        """The group's regions after the twin (before the probe, if any)."""
        return self.members[1:-1] if self.checked else self.members[1:]

    @property
    def copies(self) -> list[ir.Operation]:
        """The regions that become calls of the twin's function without being rewritten."""
        return self.joiners + self.rest


class Plan:
    """The groups of one module, and which regions the pipeline leaves for replay."""

    def __init__(self, groups: list[Group], fingerprint: "_Fingerprint"):
        self.groups = groups
        self.fingerprint = fingerprint  # how the groups were found: the probe's check compares the same way
        # a trimmed twin is left for replay too; with the check on, it is rewritten and checked like a probe
        trimmed = {_body(t.region): g.checked for g in groups for t in g.trims}
        self.deferred = {_body(m) for g in groups for m in g.copies} | {r for r, checked in trimmed.items() if not checked}
        self.checked = {_body(m) for g in groups for m in g.rewritten} | {r for r, checked in trimmed.items() if checked}
        for g in groups:
            if g.checked:  # the probe's check reads the twin's places (else a copy gives them, if needed)
                locations, g.twin_places = _located_places(g.twin)
                g.probe_before = (_locations(g.probe), _types(g.probe))
            else:
                locations = _locations(g.twin)
            g.twin_before = (locations, _types(g.twin))
            for trim in g.trims if g.checked else ():  # rewritten the usual way: read it before
                trim.before = _located_places(trim.region)
        #: (name, location, result types) of each op of a twin with a trimmed region -> whether that region
        #: lacks it (None: ops it lacks and ops it holds are both so); read by those, not by
        #: the op, whose address (which the bindings compare) an op the pass makes may take once it is erased
        self._lacked: dict[tuple, bool | None] = {}
        for g in groups:
            for trim in g.trims:
                for key, lost in trim.lacked.items():
                    self._lacked[key] = lost if self._lacked.get(key, lost) == lost else None

    def lacked(self, op: ir.Operation | ir.OpView) -> bool | None:
        """Whether the region trimmed from a twin lacks the collective so named, located and typed
        (None: no collective of a twin with a trimmed region is, or ops it holds and ops it lacks
        both are)."""
        if not self._lacked:
            return None
        op = op.operation
        return self._lacked.get((op.name, op.location.attr, *(r.type for r in op.results)))

    def _trim(self, g: Group, trim: Trim, name: str, indices: list[int], report: Report, by_region: dict,
              inserted: dict, source: str, lacking: dict[int, bool], take_channel: Callable[[], int],
              phases: list) -> bool:
        """Make ``trim.region`` a call of the group's rewritten twin (``name``'s) trimmed, in a function
        of its own; its report entries are the twin's (at ``indices`` in the report) for the sites it
        holds (each a site whose collective it holds: ``lacking``, by entry), read with its locations
        (with :data:`CHECK`: it was rewritten the usual way, and must have come out so).  False where
        it cannot be (nothing changed)."""
        region = trim.region
        twin_entries = [report.sites[i] for i in indices]
        locations = g.twin_before[0]
        held = []  # the twin's entries for sites the region holds
        for k, entry in enumerate(twin_entries):
            lost = lacking.get(id(entry))
            if lost is None or _reads_around(entry):
                return False  # a site of a collective the pass made (which region's is it), or one whose rewrite
                # depends on the ops around it, which the region has fewer of
            if not lost:
                held.append(k)
        trimmed_name = _layer_name(g.twin)
        final = _trimmed_function(g.twin, trim, trimmed_name)
        if final is None:
            return False
        handles = {}  # the twin's channel handles -> the trimmed copy's own
        for op in _channel_ops(final):
            old = hlo.ChannelHandle(op.attributes["channel_handle"])
            handles[old.handle] = fresh = take_channel()
            op.attributes["channel_handle"] = hlo.ChannelHandle.get(fresh, old.channel_type)
        held_entries = [_entry(vars(twin_entries[k]).copy(), handles) for k in held]  # with the copy's handles
        view = Group([final])  # the trimmed twin, as the region's entries are read from it
        view.twin_before = ([loc for p, loc in enumerate(locations) if p not in trim.dropped], g.twin_before[1])
        if g.checked:  # rewritten the usual way: the region must have come out as the trimmed twin
            view.twin_places = trim.before[1]
            reading = _Replay(view, held_entries, source)
            agreed = reading.agrees(region, trim.before[0], [report.sites[i] for i in by_region.get(_body(region), [])],
                                    self.fingerprint)
            report.layer_checks.append({"first": ir_utils.render_location(g.twin.location, source),
                                        "last": ir_utils.render_location(region.location, source),
                                        "agreed": agreed, "trimmed": True})
            if not agreed:
                final.parent.operation.erase()  # (the function)
                return False
            forget_inside(region)
        else:
            entries = _Replay(view, held_entries, source).entries(region)
            if entries is None:
                final.parent.operation.erase()
                return False
            made = dict(zip(held, entries))
            for run in _runs(indices, phases):  # after the twin's (and copies')
                inserted.setdefault(indices[run[-1]] + 1, ([], []))[0].extend(made[k] for k in run if k in made)
        report.trimmed[f"@{trimmed_name}"] = {"of": f"@{name}", "called_at": ir_utils.render_location(region.location, source)}
        _call(region, trimmed_name, [r.type for r in region.results])
        return True

    def top_level(self, op: ir.Operation | ir.OpView) -> ir.Block | None:
        """The body of the top-level region holding ``op`` (None: ``op`` is in none)."""
        op = op.operation
        body = None
        while True:
            parent = op.parent
            if parent is None or parent.name == "func.func":
                return body if op.name == MANUAL else None
            body = op.block
            op = parent.operation

    def copies_of(self, op: ir.Operation | ir.OpView) -> int:
        """How many times the program holds ``op`` once replay is done: a twin's op, once per
        member and joiner of its group; a probe's, 0 (its twin's count holds it); else 1."""
        top = self.top_level(op)
        if top is None or top not in self.checked:
            return 1
        for g in self.groups:
            if _body(g.twin) == top:
                return len(g.members) + len(g.joiners)
            if g.probe is not None and _body(g.probe) == top:
                return 0
        return 1

    def inline_rings(self, op: ir.Operation | ir.OpView) -> bool:
        """Does ``op``'s ring stay inline, unshared (:mod:`cmatmul_pass.sharing`)?  So it does in the
        regions the pipeline rewrites for a group (a twin, which becomes the function its copies call;
        a probe, a checked trimmed region, each checked against a copy of the twin)."""
        return self.checked_region(op) is not None

    def checked_region(self, op: ir.Operation | ir.OpView) -> ir.Block | None:
        """The body of the region holding ``op`` if the pipeline rewrites it for a group (a twin, a probe)."""
        top = self.top_level(op)
        return top if top in self.checked else None

    def only(self, regions: list[ir.Operation], names: tuple[str, ...]) -> dict[str, list]:
        """The ops named ``names`` in ``regions`` (left for replay, so not walked before), region
        by region, each as :func:`ir_utils.ops_named` gives them."""
        out: dict[str, list] = {name: [] for name in names}
        for region in regions:
            for name, ops in ir_utils.ops_named(region, *names).items():
                out[name] += ops
        return out

    def finish(self, report: Report, regions_of: dict[int, ir.Block], competing: set, source: str,
               lacking: dict[int, bool], take_channel: Callable[[], int], phase_of: dict[int, int]) -> list[ir.Operation]:
        """Replace the regions of each group (whose probe, if any, agrees with its twin) by calls
        of the twin's rewritten region, and its trimmed region by a call of a trimmed copy, adding
        their report entries; returns the regions to rewrite the usual way instead.  ``lacking``:
        each twin entry (by id) -> whether the trimmed region lacks its site; ``phase_of``: each
        entry (by id) -> the pipeline's phase that made it; ``take_channel``: a fresh handle."""
        leftover: list[ir.Operation] = []
        phases = [phase_of.get(id(entry)) for entry in report.sites]  # by report index (the report stays until the end)
        by_region: dict[ir.Block, list[int]] = {}  # a region's body -> its entries' indices
        for index, entry in enumerate(report.sites):
            region = regions_of.get(id(entry))
            if region is not None:
                by_region.setdefault(region, []).append(index)
        # report index -> the entries that go before it: those following the run just before it
        # (a twin's, then its copies'), then those preceding the run it starts (a joiner's, a copy's
        # before a probe's)
        inserted: dict[int, tuple[list[SiteReport], list[SiteReport]]] = {}
        for g in self.groups:
            rewritten = [_body(m) for m in g.rewritten]
            replay = (_Replay.of(g, [report.sites[i] for i in by_region.get(rewritten[0], [])], source)
                      if not (set(rewritten) & competing) else None)
            if replay is not None and g.checked:
                agreed = replay.agrees(g.probe, g.probe_before[0],
                                       [report.sites[i] for i in by_region.get(rewritten[-1], [])], self.fingerprint)
                report.layer_checks.append({"first": ir_utils.render_location(g.twin.location, source),
                                            "last": ir_utils.render_location(g.probe.location, source),
                                            "agreed": agreed})
                replay = replay if agreed else None
            if replay is None:
                leftover += g.copies + [t.region for t in g.trims if not g.checked]
                continue
            copies: dict[ir.Block, list[SiteReport]] = {}  # a region's body -> its entries
            for region in g.copies:
                entries = replay.entries(region)
                if entries is None:
                    leftover.append(region)
                else:
                    copies[_body(region)] = entries
            called = [m for m in (*g.joiners, *g.members) if _body(m) in copies or _body(m) in rewritten]
            # each run of the twin's consecutive entries is preceded by the same run of every
            # joiner, and followed by that of every other copy (or, with a probe, the probe's run
            # is preceded by it): where the usual order (phase by phase, in program order) puts them
            for anchor, regions, after in ((rewritten[0], g.joiners, False), (rewritten[-1], g.rest, not g.checked)):
                made = [copies[_body(r)] for r in regions if _body(r) in copies]
                indices = by_region.get(anchor, [])
                for run in _runs(indices, phases):
                    at = indices[run[-1]] + 1 if after else indices[run[0]]
                    inserted.setdefault(at, ([], []))[0 if after else 1].extend(
                        e for entries in made for e in (entries[k] for k in run))
            name = _layer_name(g.twin)
            report.layers[f"@{name}"] = [ir_utils.render_location(region.location, source) for region in called]
            returns = [r.type for r in g.twin.results]  # the function's
            for region in g.rewritten[1:]:  # the probe, built in, about to be erased (copies never were)
                forget_inside(region)
            for region in called:
                if region is not g.twin:
                    _call(region, name, returns, g.result_maps.get(_body(region)))
            _outline(g.twin, name)
            for trim in g.trims:
                if not self._trim(g, trim, name, by_region.get(rewritten[0], []), report, by_region, inserted, source,
                                  lacking, take_channel, phases) and not g.checked:
                    leftover.append(trim.region)
        if inserted:
            sites = []
            for index, entry in enumerate(report.sites):
                for entries in inserted.get(index, ()):
                    sites.extend(entries)
                sites.append(entry)
            for entries in inserted.get(len(report.sites), ()):
                sites.extend(entries)
            report.sites[:] = sites
        return leftover


def _runs(indices: list[int], phases: list) -> list[list[int]]:
    """The runs of consecutive numbers in ``indices`` (ascending) of one phase (``phases``: by
    number), as lists of positions in it."""
    runs: list[list[int]] = []
    for k, index in enumerate(indices):
        if runs and index == indices[k - 1] + 1 and phases[index] == phases[index - 1]:
            runs[-1].append(k)
        else:
            runs.append([k])
    return runs


def _joins(region: ir.Operation, twin: ir.Operation, fingerprint: "_Fingerprint") -> list[int] | None:
    """Where the twin's function returns each result of ``region`` (its index among the twin's
    results), when ``region`` is the twin but for returning fewer of its own inputs; else None.
    Then a call of the function, reading ``region``'s operands, computes what ``region`` does (and
    returns the other inputs too, which no one reads)."""
    if len(region.results) >= len(twin.results) or _types(region)[0] != _types(twin)[0]:
        return None
    mine, theirs = pass_through(region), pass_through(twin)
    if not theirs:
        return None
    with region.context:
        outs = sdy.TensorShardingPerValueAttr(region.attributes["out_shardings"]).shardings
        twin_outs = sdy.TensorShardingPerValueAttr(twin.attributes["out_shardings"]).shardings
    returned = {(argument, twin_outs[j], twin.results[j].type): j for j, argument in theirs.items()}
    core, twin_core = ([i for i in range(len(r.results)) if i not in through]
                       for r, through in ((region, mine), (twin, theirs)))
    if len(core) != len(twin_core):
        return None
    where = dict(zip(core, twin_core))
    for i, argument in mine.items():
        j = returned.get((argument, outs[i], region.results[i].type))
        if j is None:
            return None
        where[i] = j
    if fingerprint(region, mine) != fingerprint(twin, theirs):
        return None
    return [where[i] for i in range(len(region.results))]
