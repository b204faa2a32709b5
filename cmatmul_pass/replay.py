"""Layers that repeat: rewrite the first, call it from the rest.

A model whose layers are a Python loop over a ``jax.shard_map``'d block lowers to one
``sdy.manual_computation`` per layer (and one per layer again in the backward), each with the
same body: at 32 layers the pass meets about 480 sites in 64 regions, but only two distinct
bodies.  What the pass does to a region depends on its body, its shardings and what earlier
regions left behind (the shared ring functions of :mod:`cmatmul_pass.sharing`, the cost
model's cached predictions); so every region of a group of identical ones comes out as the
first did.

A group is at least :data:`MIN_MEMBERS` top-level regions whose ops are the same but for their
locations and the outside values they read (:class:`_Fingerprint`).  The pipeline rewrites its
first region (the *twin*; its rings stay inline, unshared: it becomes the one copy) the usual
way and leaves the others alone.  Then the twin's rewritten region moves into a private function
``@cmatmul_layer_<k>`` (its operands become the function's arguments), and every region of the
group becomes a ``func.call`` of it, carrying the region's own location; each region's report
entries are the twin's, its locations read as the region's (and its channel handles the
function's).  That is the form JAX itself gives a nested ``jax.jit`` called once per layer; XLA
inlines calls before it optimises, so the compiled program is the one copies would give, and
the pass builds, verifies and prints one rewritten layer instead of thirty.  The ops in the
function carry the twin's locations.  If a region's locations cannot be mapped one to one, that
region is rewritten the usual way after all.

Why a call is sound without rewriting the region itself: the twin's rewritten region computes
what the twin's body computed from any operands its in-shardings allow (every rewrite keeps a
region's values; none reads outside the region but the module's meshes, which every region
shares), and a copy's body is the twin's, op for op.  Whether the pass *would* have made the
same choices in the copy (its report) is a further claim: the pass reads nothing outside a
region but the gathers that compete for a dot (:mod:`.analysis.slack`, whose groups are not
replayed), and :data:`CHECK` tests it (``tests/test_replay.py``, fuzz campaigns): the group's
last region (the *probe*, its context the least like the twin's) is rewritten the usual way
too, and must come out as the twin did: the same ops, attributes and types (channel handles
aside), the same region types, and the same report entries once the twin's locations are read
as the probe's; if it does not, the group's other regions are rewritten the usual way.  Either
way the program and the report's entries are what the pass gives without replay, the layer
function inlined and channel handle numbers aside (``tests/test_replay.py`` compares them); the
report also names each layer function and the regions calling it (``Report.layers``).

A *joiner* is the region just before a group's twin when its body is the twin's but for the
inputs it returns unchanged (:func:`pass_through`): JAX's layers return some inputs for the
backward, and the first layer fewer, since its caller holds them.  It becomes a call of the
twin's function too (which returns the inputs it does not, unread), and its report entries come
first in each run of the twin's.  A group needs two regions of one body (the twin and a copy, or
the probe), and with its joiner :data:`MIN_MEMBERS` regions.

A *trimmed* region (:class:`Trim`) is the region just after a group when its body is the twin's
without some of its results and the ops and operands only those need (:func:`_trims`: the twin's
copy trimmed so, by bytecode): JAX's backward of a model's first layer, which returns no gradient
for the model's input.  It becomes a call of a function of its own holding the twin's rewritten
region trimmed alike (:func:`_trimmed_function`: the dropped results' ops erased where no one reads
them and they are pure), with fresh channel handles; its report entries are the twin's for the
collectives it holds (:meth:`Plan.lacked`), read with its locations.  Sound as a call is: the
rewritten twin computes what its body computes, and trimming keeps the rest.  That the pass
would have chosen the same in it is the further claim again, and weaker: a site's rewrite may
read the ops around it, which the trimmed region has fewer of, so a twin with a split psum (its
gather carried past the ops after it), a collective moved to its matmul or a site declined for
what reads it is not trimmed (:func:`_reads_around`: the region is then rewritten the usual way
after the calls, its entries last), nor any under ``all_reduce="split"``, nor a region whose
lacking ops read a gathered value it holds (:func:`_gathered`: the twin's ring assembles it for
them); with :data:`CHECK` the region is rewritten the usual way too and must come out as the
trimmed copy.

Not replayed: modules with a ``stablehlo.while`` (sinking and hoisting move collectives across
loops and regions), groups whose gathers compete with another collective for a dot (which one
gets the ring depends on what comes before the region: :mod:`.analysis.slack`), groups whose
region types the pass changed, and runs that annotate streams or do not share rings.
"""

from __future__ import annotations

import io
import marshal
import os
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from . import ir_utils
from ._jax_private import hlo, ir, location_stripper, sdy
from .report import Report, SiteReport
from .rewrites.builders import forget_inside
from .layout import LAYOUT_OPS

#: the twin and at least two regions more (with :data:`CHECK`, the probe among them): below that replay would
#: save one region's rewrite, and two identical regions are common in small programs, whose output the twin's
#: inline, unrecorded rings (:mod:`.sharing`) change even where the group is then not replayed (competing
#: gathers: the copies' rings are shared from the second on)
MIN_MEMBERS = 3
#: rewrite each group's last region (the probe) the usual way too and replay the group only where it comes out
#: as the twin did: the check that the pass made the same choices in every region of a group (tests and fuzz
#: campaigns set it; ``CMATMUL_PASS_CHECK_REPLAY=1``).  Off, the pass saves a region's rewrite per group
#: (at 32 layers about 5 ms of 39, both bench models)
CHECK = os.environ.get("CMATMUL_PASS_CHECK_REPLAY", "") not in ("", "0")
#: the functions holding a replayed layer
LAYER_PREFIX = "cmatmul_layer_"
MANUAL = "sdy.manual_computation"


def _body(region: ir.Operation) -> ir.Block:
    """A region's identity for dicts and sets: its body block (an Operation's hash changes with
    its attributes; a Block's is its address)."""
    return region.regions[0].blocks[0]


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


@dataclass(eq=False)
class Trim:
    """A region that is its group's twin trimmed: some of the twin's results dropped, with the ops
    and arguments only they need (:func:`_trims`)."""

    region: ir.Operation
    results: list[int]  # the twin's result standing for each of the region's, ascending
    arguments: list[int]  # the twin's operand standing for each of the region's, ascending
    dropped: frozenset  # the twin's ops it lacks: their positions in the twin's pre-order walk
    lacked: dict  # each of the twin's collectives (Plan.lacked's key) -> whether it lacks it (None: both)
    #: with :data:`CHECK` (the region rewritten the usual way and checked): its locations and places before the pass
    before: tuple = ()


def _locations(region: ir.Operation) -> list[ir.Location]:
    """The locations of ``region`` and every op nested in it, in pre-order (one C++ walk)."""
    found: list[ir.Location] = []

    def visit(op: ir.Operation) -> ir.WalkResult:
        found.append(op.location)
        return ir.WalkResult.ADVANCE

    region.walk(visit, ir.WalkOrder.PRE_ORDER)
    return found


def _located_places(region: ir.Operation) -> tuple[list[ir.Location], list[tuple]]:
    """:func:`_locations` of ``region``, and each op's place: the (region, block, op) indices
    leading to it from ``region`` (``region`` itself: ())."""
    locations, places = [region.location], [()]

    def visit(op: ir.Operation, place: tuple) -> None:
        for r, inner in enumerate(op.regions):
            for b, block in enumerate(inner.blocks):
                for i, child in enumerate(block.operations):
                    child = child.operation
                    at = (*place, (r, b, i))
                    locations.append(child.location)
                    places.append(at)
                    visit(child, at)

    visit(region, ())
    return locations, places


def _at(region: ir.Operation, place: tuple) -> ir.Operation:
    """The op at ``place`` (:func:`_located_places`) in ``region``."""
    op = region
    for r, b, i in place:
        op = op.regions[r].blocks[b].operations[i].operation
    return op


def _locations_at(region: ir.Operation, places: list[tuple]) -> list[ir.Location]:
    """The locations of the ops at ``places`` (:func:`_located_places`) in ``region``, each
    reached by its indices, each block's op list read once (a layer's report reads 6 to 55 of its
    45 to 131 ops, most in the region's body, the rest a collective's reduction: fewer steps than
    a walk of them all)."""
    lists: dict[tuple, object] = {}  # (the place of an op, region, block) -> that block's op list
    found = []
    for place in places:
        r, b, i = place[-1]
        key = (place[:-1], r, b)
        ops = lists.get(key)
        if ops is None:
            ops = lists[key] = _at(region, place[:-1]).regions[r].blocks[b].operations
        found.append(ops[i].location)
    return found


def _types(region: ir.Operation) -> tuple:
    return tuple(v.type for v in region.operands), tuple(r.type for r in region.results)


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

    def inline_rings(self, op: ir.Operation | ir.OpView) -> bool:
        """Does ``op``'s ring stay inline, unshared (:mod:`.sharing`)?  So it does in the regions the
        pipeline rewrites for a group (a twin, which becomes the function its copies call; a probe, a
        checked trimmed region, each checked against a copy of the twin)."""
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


def _reads_around(entry: SiteReport) -> bool:
    """Did the pass decide ``entry``'s site by more than its own ops and what computes them: a psum
    split (its gather carried forward past the row-wise ops after it, to where its value is read
    whole), a collective moved to its matmul (past the row-wise ops before it), or a site declined
    for what reads it (another reader of the product, a reader that is no dot, ...), which a
    trimmed region may lack?"""
    split = entry.all_reduce is not None and entry.all_reduce.get("strategy") == "split"
    declined = not entry.rewritten and entry.reason_code not in OWN_DECLINES
    return split or declined or entry.moved_from is not None


#: the declines that read only the site's own ops, what computes them and its shape
OWN_DECLINES = frozenset({"producer_not_dot", "not_sum", "no_dim", "dynamic_shape", "policy", "min_bytes"})


def _trimmed_function(twin: ir.Operation, trim: Trim, name: str) -> ir.Operation | None:
    """A private function ``name`` of ``trim.region``'s operands holding the twin's rewritten
    region trimmed as ``trim`` says (its results, without the ops no one then reads); returns the
    trimmed region in it, or None (no function made) where what is left reads other operands."""
    region = trim.region
    module_body = _module_body(twin)
    function, entry = ir_utils.private_function(module_body, name, [v.type for v in region.operands],
                                                [r.type for r in region.results], region.location)
    with ir.InsertionPoint(entry):
        copy = twin.clone().operation
    _erase_unread(copy, _return_only(_body(copy), trim.results), module_body)
    if [i for i, a in enumerate(_body(copy).arguments) if any(True for _ in a.uses)] != trim.arguments:
        function.erase()
        return None
    final = _reshaped(copy, trim.results, trim.arguments, list(entry.arguments), returning=False)
    copy.erase()
    with ir.InsertionPoint(entry):
        ir_utils.function_return(list(final.results), region.location)
    return final


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


class _Replay:
    """The twin's rewritten region and report entries, ready to be read with another region's
    locations.

    A region located as the twin at every op (layers written as a Python loop over one block)
    takes the twin's entries as they are: its bytecode with locations, written when the groups
    were found, is the twin's (:attr:`Group.located_as_twin`), or else one walk of its ops'
    locations shows so.  For any other, the entries are read once from the twin
    (:meth:`_read`): which of its locations they render (a
    location string of an entry is a hole, :func:`_template`), and at which places among its ops
    before the pass each such string is rendered; such a region then costs a visit of the ops at
    those places (in a layer of a few hundred ops, a few dozen), not a walk of all of its ops."""

    def __init__(self, group: Group, entries: list[SiteReport], source: str):
        self.group = group
        self.twin = group.twin
        self.source = source
        self._entries = entries
        self._shared: list[dict] | None = None  # the twin's entries' fields (their lists and dicts shared)
        self._templates: list[_Template] | None = None

    def _read(self, copy: ir.Operation | None = None) -> None:
        """Read the twin's entries as templates (once); ``copy``: a region left for replay (the
        twin before the pass, op for op), whose places are the twin's."""
        if self._templates is not None:
            return
        if self.group.twin_places is None:
            self.group.twin_places = _located_places(copy)[1]
        locations, _ = self.group.twin_before
        source = self.source
        # each rendered location of the twin's ops, and the places it is rendered at
        rendered: dict[str, list[int]] = {}
        for position, loc in enumerate(locations):
            rendered.setdefault(ir_utils.render_location(loc, source), []).append(position)
        pattern = _location_pattern(rendered)
        self._templates = [_template(entry, pattern) for entry in self._entries]
        used = {piece for template in self._templates for *_, pieces, holes in template.fills for piece in
                (pieces[i] for i in holes)}
        #: each location string the entries hold -> the positions (walk order) of the twin's ops rendering it
        needed = {text: rendered[text] for text in used}
        self.positions = sorted({p for positions in needed.values() for p in positions})
        self.places = [self.group.twin_places[p] for p in self.positions]
        # each needed string and the indices into positions of the ops rendering it
        index = {p: k for k, p in enumerate(self.positions)}
        self._reads = [(text, [index[p] for p in positions]) for text, positions in needed.items()]
        self.locations = [locations[p] for p in self.positions]

    @property
    def templates(self) -> list[_Template]:
        self._read()
        return self._templates

    @classmethod
    def of(cls, group: Group, entries: list[SiteReport], source: str) -> "_Replay | None":
        if _types(group.twin) != group.twin_before[1] or (
                group.checked and _types(group.probe) != group.probe_before[1]):
            return None  # the pass changed a region's types: its users outside changed too
        return cls(group, entries, source)

    def agrees(self, probe: ir.Operation, probe_locations: list[ir.Location], probe_entries: list[SiteReport],
               fingerprint: "_Fingerprint") -> bool:
        """Did the probe come out as the twin, read with the probe's locations?  If it did, its
        channel handles (and its entries') are the twin's from here on: the probe is about to
        become a call of the twin's function."""
        if len(probe_entries) != len(self.templates) or len(probe_locations) != len(self.group.twin_before[0]):
            return False
        text = self._text([probe_locations[p] for p in self.positions])
        if text is None:
            return False
        ours, theirs = _channel_ops(self.twin), _channel_ops(probe)
        if len(ours) != len(theirs):
            return False
        handles = {}  # the probe's handle -> the twin's
        saved = [op.attributes["channel_handle"] for op in theirs]
        for mine, other, attr in zip(ours, theirs, saved):
            handles[hlo.ChannelHandle(attr).handle] = hlo.ChannelHandle(mine.attributes["channel_handle"]).handle
            other.attributes["channel_handle"] = mine.attributes["channel_handle"]
        if fingerprint(self.twin) != fingerprint(probe) or any(
                vars(template.make(text)) != vars(_entry(vars(entry).copy(), handles))
                for template, entry in zip(self.templates, probe_entries)):
            for op, attr in zip(theirs, saved):  # left as it was, for the usual way
                op.attributes["channel_handle"] = attr
            return False
        for entry in probe_entries:
            entry.channel_handles = [handles.get(h, h) for h in entry.channel_handles]
        return True

    def entries(self, region: ir.Operation) -> list[SiteReport] | None:
        """``region``'s report entries (the twin's, read with its locations), or None where a
        location string cannot be read one way (two of the twin's ops render it, and the
        region's two render differently).  ``region`` is the twin's op for op (it prints as the
        twin did before the pass), so a place leads to the same op in both."""
        if self._templates is None and (_body(region) in self.group.located_as_twin
                                        or _locations(region) == self.group.twin_before[0]):
            # located as the twin at every op (layers written as a Python loop over one block)
            if self._shared is None:  # the twin's fields as they are: its entries are done, and read from here on
                self._shared = [vars(entry) for entry in self._entries]
            return [_entry(dict(data), {}) for data in self._shared]
        self._read(region)
        templates = self._templates
        locations = _locations_at(region, self.places)
        if locations == self.locations:  # located as the twin where the entries read it
            return [template.make_same() for template in templates]
        text = self._text(locations)
        return None if text is None else [template.make(text) for template in templates]

    def _text(self, locations: list[ir.Location]) -> "Callable[[str], str] | None":
        """How a region located ``locations`` (at :attr:`positions`) renders each location
        string of the twin's entries; None where one string would render two ways."""
        render, source = ir_utils.render_location, self.source
        texts: dict[str, str] = {}
        for text, indices in self._reads:
            first = texts[text] = render(locations[indices[0]], source)
            for k in indices[1:]:
                if locations[k] != locations[indices[0]] and render(locations[k], source) != first:
                    return None
        return texts.__getitem__


class _Template:
    """A report entry with its location strings as holes."""

    def __init__(self, data: dict, holes: list):
        self.shared = data  # the twin's fields, a copy of its own never edited: shared by every entry made
        self.holes = holes  # paths into data of strings holding locations: (path, parts)
        # what make does, worked out once: the containers on the way to a hole (parents first),
        # which the entry gets its own copies of; and per hole, its container's path, its key, its
        # pieces and which of them are location strings
        self.copies = sorted({path[:depth] for path, _ in holes for depth in range(1, len(path))}, key=len)
        self.fills = [(path[:-1], path[-1], [piece for _, piece in parts],
                       [i for i, (kind, _) in enumerate(parts) if kind == "loc"]) for path, parts in holes]

    def make_same(self) -> SiteReport:
        """:meth:`make` for a region located as the twin: its strings are the twin's, and its
        lists and dicts are one copy shared by every such region's entry (a report is read, not
        edited: :class:`~cmatmul_pass.report.SiteReport`)."""
        return _entry(dict(self.shared), {})

    def make(self, text: Callable[[str], str]) -> SiteReport:
        """The entry with each location string rendered by ``text``: the lists and dicts on the
        way to a hole are its own, the others shared with every entry made from this template
        (as :meth:`make_same`'s)."""
        data = dict(self.shared)
        own: dict[tuple, object] = {(): data}  # a path -> the entry's own copy of the container there
        for path in self.copies:
            parent = own[path[:-1]]
            inner = parent[path[-1]]
            own[path] = parent[path[-1]] = dict(inner) if type(inner) is dict else list(inner)
        for where, key, pieces, locations in self.fills:
            pieces = pieces.copy()
            for i in locations:
                pieces[i] = text(pieces[i])
            own[where][key] = "".join(pieces)
        return _entry(data, {})


def _entry(data: dict, handles: dict[int, int]) -> SiteReport:
    """The report entry of ``data`` (a template's fields), its channel handles renamed by ``handles``."""
    data["channel_handles"] = [handles.get(h, h) for h in data["channel_handles"]]
    entry = SiteReport.__new__(SiteReport)
    entry.__dict__.update(data)
    return entry


def _location_pattern(rendered) -> re.Pattern | None:
    """A pattern matching each of the location strings ``rendered`` (file:line:col), the longest
    first, and none where it is only the start of a longer line or column number (``f.py:3:1``
    in ``f.py:3:12``, a location outside the twin); None where there are none."""
    if not rendered:
        return None
    return re.compile("(?:" + "|".join(re.escape(s) for s in sorted(rendered, key=len, reverse=True)) + r")(?![0-9])")


#: what :func:`_template` looks into for location strings
_CONTAINERS = frozenset({str, dict, list})


def _template(entry: SiteReport, pattern: re.Pattern | None) -> _Template:
    """``entry`` with each occurrence of ``pattern`` (the twin's rendered locations) a hole."""
    data = marshal.loads(marshal.dumps(vars(entry)))  # its own lists and dicts
    if pattern is None:
        return _Template(data, [])
    holes: list = []

    def visit(value, path):  # (marshal's copy: exact str, dict and list; numbers skipped unvisited)
        kind = type(value)
        if kind is str:
            parts, at = [], 0
            for match in pattern.finditer(value):
                parts.append(("text", value[at:match.start()]))
                parts.append(("loc", match.group()))
                at = match.end()
            if parts:
                parts.append(("text", value[at:]))
                holes.append((path, parts))
        elif kind is dict:
            for key, item in value.items():
                if type(item) in _CONTAINERS:
                    visit(item, (*path, key))
        elif kind is list:
            for index, item in enumerate(value):
                if type(item) in _CONTAINERS:
                    visit(item, (*path, index))

    visit(data, ())
    return _Template(data, holes)


def _channel_ops(region: ir.Operation) -> list[ir.Operation]:
    """The ops in ``region`` holding a channel handle, in pre-order."""
    found: list[ir.Operation] = []

    def visit(op: ir.Operation) -> ir.WalkResult:
        if "channel_handle" in op.attributes:
            found.append(op)
        return ir.WalkResult.ADVANCE

    region.walk(visit, ir.WalkOrder.PRE_ORDER)
    return found


def walk(module: ir.Module, names: tuple[str, ...], replayable: bool,
         trims: bool = True) -> tuple[dict[str, list[ir.OpView]], Plan | None]:
    """The ops named ``names`` (which must hold ``stablehlo.while``), as
    :func:`ir_utils.ops_named` gives them, and the plan.  With ``replayable``, identical
    top-level regions are grouped first and the walk skips those left for replay: they print as their twin does, so they hold the same ops,
    channel handles and callees, and the pipeline never reads them before they are replaced
    (:meth:`Plan.only` walks them where the probe disagrees).  A module with a loop is not
    replayed, and is walked whole."""
    layers = plan(_top_level_regions(module), CHECK, trims) if replayable else None
    if layers is None:
        return ir_utils.ops_named(module, *names), None
    deferred = layers.deferred
    # a loop aside, the ops asked for never nest in one another: their lists come out as a whole walk's
    found = ir_utils.ops_named(module, *names, skip=lambda op: op.name == MANUAL and _body(op) in deferred)
    if found["stablehlo.while"]:
        return ir_utils.ops_named(module, *names), None
    return found, layers


def _top_level_regions(module: ir.Module) -> list[ir.Operation]:
    """The ``sdy.manual_computation`` ops directly in a function's body, in program order."""
    return [op.operation
            for f in module.body.operations if f.operation.name == "func.func"
            for block in f.regions[0].blocks
            for op in block.operations if op.operation.name == MANUAL]


def plan(regions: list[ir.Operation], check: bool = False, trims: bool = True) -> Plan | None:
    """The groups of identical regions among ``regions`` (top-level, in program order), or None
    when nothing is to be replayed; ``check``: each group's last region is its probe
    (:data:`CHECK`)."""
    if len(regions) < MIN_MEMBERS:
        return None
    # a region prints its operands and its results' count, so regions that print alike have as many
    # of each: regions whose counts no other region shares are in no group (but as a joiner), and
    # not printed
    counts = [(len(region.operands), len(region.results)) for region in regions]
    shared = Counter(counts)
    fingerprint = _Fingerprint(regions[0].context)
    # each region's bytecode with its locations (:meth:`_Fingerprint.located`): regions writing the
    # same bytes are one body, located alike op for op (a Python loop's layers).  Only where a count's
    # regions write two or more ways does the body without locations (:meth:`_Fingerprint.__call__`,
    # once per way) tell which are one body; where a count's first two regions are located apart (a
    # text parsed without debug info: each op at its own line), each of its regions is written
    # without locations only
    by_count: dict[tuple, list[ir.Operation]] = {}
    for region, count in zip(regions, counts):
        if shared[count] >= 2:
            by_count.setdefault(count, []).append(region)
    located: dict[ir.Block, bytes] = {}  # a region's body -> its bytecode with locations
    keys: dict[ir.Block, tuple] = {}  # a region's body -> its group's (one body's)
    for count, members in by_count.items():
        first_two = [fingerprint.located(m) for m in members[:2]]
        if first_two[0] != first_two[1]:
            keys.update((_body(m), (count, fingerprint(m))) for m in members)
            continue
        firsts: dict[bytes, ir.Operation] = {}  # each way the count's regions write -> the first
        for m, written in zip(members, first_two + [fingerprint.located(m) for m in members[2:]]):
            located[_body(m)] = written
            firsts.setdefault(written, m)
        body_of = {written: written if len(firsts) == 1 else fingerprint(first) for written, first in firsts.items()}
        keys.update((_body(m), (count, body_of[located[_body(m)]])) for m in members)
    by_body: dict[tuple, list[ir.Operation]] = {}
    for region in regions:
        key = keys.get(_body(region))
        if key is not None:
            by_body.setdefault(key, []).append(region)
    paired = {_body(m) for members in by_body.values() if len(members) > 1 for m in members}
    place = {_body(region): index for index, region in enumerate(regions)}
    groups = []
    for members in by_body.values():
        if len(members) < 2:
            continue
        group = Group(members, check)
        twin_written = located.get(_body(group.twin))
        group.located_as_twin = {_body(m) for m in members
                                 if twin_written is not None and located.get(_body(m)) == twin_written}
        before = place[_body(group.twin)] - 1
        if before >= 0 and _body(regions[before]) not in paired:
            result_map = _joins(regions[before], group.twin, fingerprint)
            if result_map is not None:
                group.joiners.append(regions[before])
                group.result_maps[_body(regions[before])] = result_map
        if len(group.members) + len(group.joiners) >= MIN_MEMBERS:
            groups.append(group)
    joining = {_body(j) for g in groups for j in g.joiners}
    for group in groups if trims else ():
        after = place[_body(group.members[-1])] + 1
        if after < len(regions) and _body(regions[after]) not in paired | joining:
            trim = _trims(regions[after], group.twin, fingerprint)
            if trim is not None:
                group.trims.append(trim)
    return Plan(groups, fingerprint) if groups else None


def pass_through(region: ir.Operation) -> dict[int, int]:
    """The results of ``region`` that return one of its block arguments as it came in: result
    index -> argument index.  JAX returns a layer's inputs this way for the backward (each
    device's block, stacked), but for the inputs the caller already holds (a first layer's)."""
    body = _body(region)
    terminator = body.operations[len(body.operations) - 1]
    return {index: ir.BlockArgument(value).arg_number for index, value in enumerate(terminator.operands)
            if isinstance(value.owner, ir.Block) and value.owner == body}


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


def _trims(region: ir.Operation, twin: ir.Operation, fingerprint: "_Fingerprint") -> Trim | None:
    """``region`` as ``twin`` trimmed (:class:`Trim`), when it is the twin but for returning fewer
    results (the twin's, in order, of the same types and shardings), without the ops and operands
    only those need; else None.  A call of the twin's rewritten region, trimmed alike, then
    computes what ``region`` does."""
    if len(region.results) >= len(twin.results) or len(region.operands) > len(twin.operands):
        return None
    with region.context:
        outs = sdy.TensorShardingPerValueAttr(region.attributes["out_shardings"]).shardings
        twin_outs = sdy.TensorShardingPerValueAttr(twin.attributes["out_shardings"]).shardings
    results, j = [], 0
    for i, result in enumerate(region.results):  # the first of the twin's results alike, in order
        while j < len(twin_outs) and (twin.results[j].type != result.type or twin_outs[j] != outs[i]):
            j += 1
        if j == len(twin_outs):
            return None
        results.append(j)
        j += 1
    data, arguments, erased = fingerprint.trimmed(twin, results)
    if erased.reads_a_gather or len(arguments) != len(region.operands) or fingerprint(region) != data:
        return None
    return Trim(region, results, arguments, erased.positions, erased.lacked)


def without_pass_through(region: ir.Operation, through: dict[int, int]) -> ir.Operation:
    """``region`` without the results ``through`` (:func:`pass_through`): a new op before it with
    the same operands, attributes and body (moved out of ``region``, which is left empty for the
    caller to erase once its results are read no more), and the other results, in order."""
    return _reshaped(region, [i for i in range(len(region.results)) if i not in through])


def _reshaped(region: ir.Operation, results: list[int], arguments: list[int] | None = None,
              operands: list[ir.Value] | None = None, at: ir.InsertionPoint | None = None,
              returning: bool = True) -> ir.Operation:
    """``region`` (a top-level region) returning only its results ``results``, and taking only its
    operands ``arguments`` (None: all; the body must read no other block argument), which read
    ``operands`` (None: the region's own): a new op (at ``at``; by default before ``region``) with
    the same attributes, their shardings for those, and the body, moved out of ``region`` (left
    empty for the caller to erase once its results are read no more).  ``returning`` false: the
    body returns those results already (:func:`_return_only`)."""
    kept = range(len(region.operands)) if arguments is None else arguments
    with region.context, region.location:
        attributes = {named.name: named.attr for named in (region.attributes[i] for i in range(len(region.attributes)))}
        for key, indices in (("out_shardings", results), ("in_shardings", None if arguments is None else arguments)):
            if indices is not None:
                shardings = sdy.TensorShardingPerValueAttr(attributes[key]).shardings
                attributes[key] = sdy.TensorShardingPerValueAttr.get([shardings[i] for i in indices])
        if operands is None:
            operands = [region.operands[i] for i in kept]
        with at or ir.InsertionPoint(region):
            core = ir.Operation.create(MANUAL, results=[region.results[i].type for i in results],
                                       operands=operands, attributes=attributes, regions=1)
        body = region.regions[0].blocks[0]
        body.append_to(core.regions[0])
        if returning:
            _return_only(body, results)
        if arguments is not None:
            for index in sorted(set(range(len(body.arguments))) - set(arguments), reverse=True):
                body.erase_argument(index)
    return core


#: the ops a site is anchored on
_COLLECTIVES = frozenset(ir_utils.CHANNEL_OPS)
#: ops with effects beyond their results: never erased for being unread
_EFFECTS = frozenset({"stablehlo.custom_call", "stablehlo.send", "stablehlo.recv", "stablehlo.infeed",
                      "stablehlo.outfeed"})


def _pure(op: ir.Operation, module_body: ir.Block, memo: dict) -> bool:
    """Does ``op`` only compute its results (a StableHLO or Shardy op but a custom call, send,
    recv, infeed or outfeed, and whatever it nests or calls likewise)?  Collectives count: every
    device runs the trimmed layer, so none waits for one the others left out."""
    name = op.name
    if name in _EFFECTS:
        return False
    if name == "func.call":
        callee = ir.FlatSymbolRefAttr(op.attributes["callee"]).value
        if callee not in memo:
            memo[callee] = False  # (a recursive call: not pure, until shown)
            function = next((f.operation for f in module_body.operations if f.operation.name == "func.func"
                             and ir_utils.symbol_name(f) == callee), None)
            memo[callee] = function is not None and all(
                _pure(inner.operation, module_body, memo) for block in function.regions[0].blocks
                for inner in block.operations)
        return memo[callee]
    if not name.startswith(("stablehlo.", "sdy.")) and name != "func.return":
        return False
    regions = op.regions
    return not len(regions) or all(_pure(inner.operation, module_body, memo) for region in regions
                                   for block in region.blocks for inner in block.operations)


def _erase_unread(region: ir.Operation, dropped: list[ir.Value], module_body: ir.Block,
                  erasing: Callable[[int, ir.Operation, list[ir.Operation]], None] | None = None) -> set[int]:
    """Erase the ops of ``region``'s body that no one reads once its return no longer reads
    ``dropped`` (the ops computing them, then the ops only those read, and so on; pure ones only);
    returns the erased ops (by address).  ``erasing(address, op, producers)`` is told of each op
    just before it goes."""
    memo: dict = {}
    gone: set[int] = set()  # the erased ops, by address (no op is made meanwhile: none takes one)
    # each op by its address, taken when it is pushed: an op read twice (``multiply %x, %x``, or two
    # results of one op) is pushed twice, and the bindings may hand out two objects for it, of which
    # erasing one leaves the other dangling (its hash, and anything read from it, garbage): so the
    # second is looked up by the address it had, never touched
    stack = [(hash(owner), owner) for owner in (v.owner.operation for v in dropped if not isinstance(v.owner, ir.Block))]
    while stack:
        key, op = stack.pop()
        if key in gone:
            continue
        results = op.results
        if not len(results) or any(True for r in results for _ in r.uses) or not _pure(op, module_body, memo):
            continue
        producers = []
        for v in op.operands:
            owner = v.owner  # (read once: each read makes a new object)
            if not isinstance(owner, ir.Block):
                producers.append(owner.operation)
        if erasing is not None:
            erasing(key, op, producers)
        gone.add(key)
        pushed = [(hash(p), p) for p in producers]  # (alive: ``op``, their reader, still is)
        op.erase()
        stack.extend(pushed)
    return gone


def _trimmed_copy(copy: ir.Operation, dropped: list[ir.Value], module_body: ir.Block) -> "_Erased":
    """:func:`_erase_unread` on ``copy`` (a copy of a twin, trimmed to compare with a region),
    and what :class:`_Erased` says of it."""
    spans: dict[int, range] = {}  # a body op (by its hash: its address) -> its and its nested ops' positions in the walk
    collectives = []  # (hash, key) of each collective in the body (:meth:`Plan.lacked`)
    at = 1
    for op in _body(copy).operations:
        op = op.operation
        end = at + 1 + (_nested_count(op) if len(op.regions) else 0)
        spans[hash(op)] = range(at, end)
        name = op.name
        if name in _COLLECTIVES:
            collectives.append((hash(op), (name, op.location.attr, *(r.type for r in op.results))))
        at = end
    erased: set[int] = set()
    read: list = []  # (hash, op) of each op an erased op read

    def erasing(key: int, op: ir.Operation, producers: list[ir.Operation]) -> None:
        erased.update(spans[key])
        read.extend((hash(p), p) for p in producers)

    gone = _erase_unread(copy, dropped, module_body, erasing)
    lacked: dict = {}
    for key, name in collectives:
        lost = key in gone
        lacked[name] = lost if lacked.get(name, lost) == lost else None
    return _Erased(frozenset(erased), lacked, any(_gathered(p) for key, p in read if key not in gone))


@dataclass(frozen=True)
class _Erased:
    """What trimming a copy of a twin erased: the positions of the erased ops (and of the ops nested
    in them) in its pre-order walk; each collective's :meth:`Plan.lacked` key -> whether it was
    erased (None: one erased, one kept); and whether an erased op read a gathered value that was kept
    (:func:`_gathered`)."""

    positions: frozenset
    lacked: dict
    reads_a_gather: bool


def _gathered(op: ir.Operation) -> bool:
    """Is ``op``'s result a gathered value: an all_gather, or layout ops of one?  The twin's ring then
    assembles it for the ops a trimmed region lacks, which its own ring would not (so trimming the
    twin would keep that work)."""
    while op.name in LAYOUT_OPS:
        owner = op.operands[0].owner
        if isinstance(owner, ir.Block):
            return False
        op = owner.operation
    return op.name == "stablehlo.all_gather"


def _return_only(body: ir.Block, results: list[int]) -> list[ir.Value]:
    """Make ``body``'s return return only its values for ``results``; returns the others."""
    terminator = body.operations[len(body.operations) - 1]
    returned = list(terminator.operands)
    with ir.InsertionPoint(terminator):
        sdy.ReturnOp([returned[i] for i in results], loc=terminator.location)
    terminator.erase()
    kept = set(results)
    return [value for i, value in enumerate(returned) if i not in kept]


def _nested_count(op: ir.Operation) -> int:
    return sum(1 + _nested_count(inner.operation) for region in op.regions for block in region.blocks
               for inner in block.operations)


class _Fingerprint:
    """A region's identity without its locations and outside operands: the MLIR bytecode of a
    copy of it, alone in a function of its operand types whose arguments it reads in their
    place, every location unknown.  Bytecode is lossless (it reads back as the module it was
    written from), so two regions write the same bytes exactly when they are the same ops,
    attributes, types and wiring: what printing them without locations, with their outside
    operands anonymous, tells apart, at less than half the cost (a copy is one C++ clone, the
    locations go in C++, and bytecode writes each type and attribute once)."""

    def __init__(self, context: ir.Context):
        self.strip = location_stripper(context)
        # per operand types: a module holding one function of them, whose entry block takes each
        # copy in turn (a module and a function made once, not per region)
        self._scratch: dict[tuple, tuple[ir.Module, ir.Block]] = {}

    def _scratch_for(self, region: ir.Operation, types: tuple | None = None) -> tuple[ir.Module, ir.Block]:
        types = tuple(v.type for v in region.operands) if types is None else types
        held = self._scratch.get(types)
        if held is None:
            with region.context, ir.Location.unknown() as unknown:
                module = ir.Module.create()
                _, entry = ir_utils.private_function(module.body, "region", list(types), [], unknown)
            held = self._scratch[types] = module, entry  # (the module owns the block: kept with it)
        return held

    def __call__(self, region: ir.Operation, through: dict[int, int] | None = None) -> bytes:
        """The fingerprint of ``region``; with ``through`` (:func:`pass_through`), of ``region``
        without those results."""
        return self._written(region, through, strip=True)

    def located(self, region: ir.Operation) -> bytes:
        """The fingerprint of ``region`` with its locations kept: two regions write the same bytes
        exactly when they are one body (as :meth:`__call__` tells) and every op of one, and every
        block argument, is located as the same one of the other."""
        return self._written(region, None, strip=False)

    def _copy(self, region: ir.Operation) -> tuple[ir.Module, ir.Operation]:
        """A copy of ``region`` alone in the scratch function of its operand types, reading its
        arguments by position (two operands may be one value); and the scratch module."""
        module, entry = self._scratch_for(region)
        with region.context, ir.InsertionPoint(entry):
            copy = region.clone().operation
        for index, argument in enumerate(entry.arguments):
            copy.operands[index] = argument
        return module, copy

    def _bytes(self, module: ir.Module, strip: bool = True) -> bytes:
        """``module``'s bytecode (``strip``: every location unknown first)."""
        if strip:
            self.strip(module)
        written = io.BytesIO()
        module.operation.write_bytecode(written)
        return written.getvalue()

    def _written(self, region: ir.Operation, through: dict[int, int] | None, strip: bool) -> bytes:
        module, copy = self._copy(region)
        if through:
            core = without_pass_through(copy, through)
            copy.erase()
            copy = core
        written = self._bytes(module, strip)
        copy.erase()  # the block is empty again, for the next region of these types
        return written

    def trimmed(self, twin: ir.Operation, results: list[int]) -> "tuple[bytes, list[int], _Erased]":
        """The fingerprint of ``twin`` returning only its results ``results``, without the ops no
        one then reads (:func:`_trimmed_copy`) and the operands only they read; and those operands
        (the twin's indices), and what trimming erased (:class:`_Erased`)."""
        _, copy = self._copy(twin)
        erased = _trimmed_copy(copy, _return_only(_body(copy), results), _module_body(twin))
        arguments = [i for i, a in enumerate(_body(copy).arguments) if any(True for _ in a.uses)]
        trimmed_module, trimmed_entry = self._scratch_for(twin, tuple(twin.operands[i].type for i in arguments))
        final = _reshaped(copy, results, arguments, list(trimmed_entry.arguments), ir.InsertionPoint(trimmed_entry),
                          returning=False)
        copy.erase()
        written = self._bytes(trimmed_module)
        final.erase()
        return written, arguments, erased


def _module_body(op: ir.Operation) -> ir.Block:
    """The body of the module holding ``op``."""
    while op.name != "builtin.module":
        op = op.parent
    return op.regions[0].blocks[0]


def _layer_name(twin: ir.Operation) -> str:
    """The name of the function :func:`_outline` moves ``twin`` into: ``LAYER_PREFIX<k>``, the
    first ``k`` no symbol of the module holds (the same until it is outlined)."""
    names = {ir.StringAttr(op.operation.attributes["sym_name"]).value
             for op in _module_body(twin).operations if "sym_name" in op.operation.attributes}
    index = 0
    while f"{LAYER_PREFIX}{index}" in names:
        index += 1
    return f"{LAYER_PREFIX}{index}"


def _outline(twin: ir.Operation, name: str) -> None:
    """Move ``twin`` (a top-level region) into a new private function ``name`` of its operands
    (:func:`_layer_name`), which returns its results, and call the function where ``twin`` stood
    (its results' readers read the call's).  Moved, not copied: the values the pass's builders
    share per block (:mod:`.rewrites.builders`) stay where they are, valid."""
    body = _module_body(twin)
    loc = twin.location
    returns = [r.type for r in twin.results]
    _, entry = ir_utils.private_function(body, name, [v.type for v in twin.operands], returns, loc)
    with ir.InsertionPoint(twin):
        call = ir_utils.call(name, list(twin.operands), returns, loc)
    for old, new in zip(twin.results, call.results):
        old.replace_all_uses_with(new)
    twin.detach_from_parent()
    ir.InsertionPoint(entry).insert(twin)
    with ir.InsertionPoint(entry):
        ir_utils.function_return(list(twin.results), loc)
    for index, argument in enumerate(entry.arguments):  # by position: two operands may be one value
        twin.operands[index] = argument


def _call(region: ir.Operation, name: str, types: list[ir.Type], result_map: list[int] | None = None) -> None:
    """Replace ``region`` by a call of ``name`` (returning ``types``) with its operands, at its
    location; ``result_map`` (a joiner's): the call's result standing for each of ``region``'s
    (else the call's results are its own, in order)."""
    with ir.InsertionPoint(region):
        call = ir_utils.call(name, list(region.operands), types, region.location)
    new = list(call.results)
    for index, old in enumerate(region.results):
        old.replace_all_uses_with(new[result_map[index] if result_map else index])
    region.erase()
