"""Layers that repeat: rewrite two, check the last, replay the rest.

A model whose layers are a Python loop over a ``jax.shard_map``'d block lowers to one
``sdy.manual_computation`` per layer (and one per layer again in the backward), each with the
same body: at 32 layers the pass meets about 480 sites in 64 regions, but only two distinct
bodies.  What the pass does to a region depends on its body, its shardings and what earlier
regions left behind (the shared ring functions of :mod:`cmatmul_pass.sharing`, the cost
model's cached predictions); so every region of a group of identical ones, after the second,
comes out as the second did.

A group is at least :data:`MIN_MEMBERS` top-level regions whose op prints the same without
locations and with its outside operands anonymous.  The pipeline rewrites its first region
(where each ring pattern first appears, inline), its second (the *twin*: its sites call the
shared rings) and its last (the *probe*) the usual way, and leaves the others alone.  Then the
probe must have come out as the twin did: the same ops, attributes and types (channel handles
aside), the same region types, and the same report entries once the twin's locations are read
as the probe's.  If it did, each region in between is replaced by a copy of the twin that reads
the region's own operands and carries its own locations (a location the pass built from several
of the twin's ops, fused, is rebuilt from the region's ops at the same places), with fresh
channel handles; the twin's report entries, read the same way, become the region's.  If the
probe differs, or a region's locations cannot be mapped one to one, those regions are rewritten
the usual way after all.  Either way the module and the report are what the pass gives without
replay, channel handle numbers aside (``tests/test_replay.py`` compares them).

Not replayed: modules with a ``stablehlo.while`` (sinking and hoisting move collectives across
loops and regions), groups whose gathers compete with another collective for a dot (which one
gets the ring depends on what comes before the region: :mod:`.analysis.slack`), groups whose
region types the pass changed, and runs that annotate streams or do not share rings.
"""

from __future__ import annotations

import marshal
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from . import ir_utils
from ._jax_private import hlo, ir
from .report import Report, SiteReport
from .sharing import structure

#: the first region (each ring pattern's inline ring), the twin, at least one to replay, the probe
MIN_MEMBERS = 4
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
    # the twin's and the probe's (locations in walk order, types) before the pass
    twin_before: tuple = ()
    probe_before: tuple = ()

    @property
    def twin(self) -> ir.Operation:
        return self.members[1]

    @property
    def probe(self) -> ir.Operation:
        return self.members[-1]  # the last: its context (what reads its results) the least like the twin's

    @property
    def rest(self) -> list[ir.Operation]:
        return self.members[2:-1]


def _locations(region: ir.Operation) -> list[ir.Location]:
    """The locations of ``region`` and every op nested in it, in pre-order (one C++ walk)."""
    found: list[ir.Location] = []

    def visit(op: ir.Operation) -> ir.WalkResult:
        found.append(op.location)
        return ir.WalkResult.ADVANCE

    region.walk(visit, ir.WalkOrder.PRE_ORDER)
    return found


def _types(region: ir.Operation) -> tuple:
    return tuple(v.type for v in region.operands), tuple(r.type for r in region.results)


class Plan:
    """The groups of one module, and which regions the pipeline leaves for replay."""

    def __init__(self, groups: list[Group]):
        self.groups = groups
        self.deferred = {_body(m) for g in groups for m in g.rest}
        self.checked = {_body(m) for g in groups for m in (g.twin, g.probe)}
        self.leading = {_body(g.members[0]) for g in groups}
        for g in groups:
            g.twin_before = (_locations(g.twin), _types(g.twin))
            g.probe_before = (_locations(g.probe), _types(g.probe))

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

    def leads(self, op: ir.Operation | ir.OpView) -> bool:
        """Is ``op`` in a group's first region (whose twin, identical, comes next)?"""
        return self.top_level(op) in self.leading

    def checked_region(self, op: ir.Operation | ir.OpView) -> ir.Block | None:
        """The body of the twin or probe region holding ``op``, if any."""
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

    def finish(self, report: Report, regions_of: dict[int, ir.Block], competing: set, take_channel: Callable[[], int],
               source: str) -> list[ir.Operation]:
        """Replay each group whose probe agrees with its twin into its remaining regions, adding
        their report entries; returns the regions to rewrite the usual way instead."""
        leftover: list[ir.Operation] = []
        by_region: dict[ir.Block, list[int]] = {}  # a region's body -> its entries' indices
        for index, entry in enumerate(report.sites):
            region = regions_of.get(id(entry))
            if region is not None:
                by_region.setdefault(region, []).append(index)
        inserted: dict[int, list[SiteReport]] = {}  # after report index -> entries
        for g in self.groups:
            twin, probe = _body(g.twin), _body(g.probe)
            twin_entries = [report.sites[i] for i in by_region.get(twin, [])]
            probe_indices = by_region.get(probe, [])
            replay = _Replay.of(g, twin_entries, source) if not ({twin, probe} & competing) else None
            if replay is None or not replay.agrees(g.probe, g.probe_before[0],
                                                   [report.sites[i] for i in probe_indices]):
                leftover += g.rest
                continue
            copies: list[list[SiteReport]] = []
            for region in g.rest:
                entries = replay.into(region, take_channel)
                if entries is None:
                    leftover.append(region)
                else:
                    copies.append(entries)
            # each run of the probe's consecutive entries is preceded by the same run of every copy:
            # where the usual order (phase by phase, in program order) puts them
            runs: list[list[int]] = []
            for k, index in enumerate(probe_indices):
                if runs and index == probe_indices[k - 1] + 1:
                    runs[-1].append(k)
                else:
                    runs.append([k])
            for run in runs:
                before = probe_indices[run[0]]
                inserted.setdefault(before, []).extend(e for entries in copies for e in (entries[k] for k in run))
        if inserted:
            sites = []
            for index, entry in enumerate(report.sites):
                sites.extend(inserted.get(index, ()))
                sites.append(entry)
            report.sites[:] = sites
        return leftover


class _Replay:
    """The twin's rewritten region and report entries, ready to be given another region's
    operands and locations.

    Read once from the twin: where each op of its rewritten copy takes its location from
    (:func:`_recipe`: a place among the twin's locations before the pass, or several such
    places fused), and which ops hold a channel handle; a region then costs one walk of its
    own locations and one of its copy."""

    def __init__(self, group: Group, entries: list[SiteReport], source: str, recipe: list | None):
        self.group = group
        self.twin = group.twin
        self.source = source
        self.locations, _ = group.twin_before
        self.recipe = recipe
        #: the twin's ops holding a channel handle, as a copy located as the twin renews them: by
        #: op class (in the order the classes first appear), each class's in pre-order; each as
        #: its place in the copy (:func:`_channel_places`), its handle and its channel type
        self.channels = _channel_places(group.twin)
        first: dict = {}  # a twin location -> the first place it is at
        # places locating like an earlier place in the twin: a region must locate them alike too
        self.alike: list[tuple[int, int]] = []
        for position, loc in enumerate(self.locations):
            at = first.setdefault(loc.attr, position)
            if at != position:
                self.alike.append((at, position))
        # each rendered location of the twin's ops, and the first place it is at
        self.rendered: dict[str, int] = {}
        for position, loc in enumerate(self.locations):
            self.rendered.setdefault(ir_utils.render_location(loc, source), position)
        # the longest first, and never a prefix of a longer line or column number
        pattern = re.compile("|".join(re.escape(s) for s in sorted(self.rendered, key=len, reverse=True))
                             + r"(?![0-9])") if self.rendered else None
        self.templates = [_template(entry, pattern) for entry in entries]

    @classmethod
    def of(cls, group: Group, entries: list[SiteReport], source: str) -> "_Replay | None":
        twin = group.twin
        if _types(twin) != group.twin_before[1] or _types(group.probe) != group.probe_before[1]:
            return None  # the pass changed a region's types: its users outside changed too
        return cls(group, entries, source, _recipe(twin, group.twin_before[0]))

    def agrees(self, probe: ir.Operation, probe_locations: list[ir.Location], probe_entries: list[SiteReport]) -> bool:
        """Did the probe come out as the twin, read with the probe's locations?"""
        if structure(self.twin) != structure(probe):
            return False
        if len(probe_entries) != len(self.templates):
            return False
        relocation = self._relocation(probe_locations)
        if relocation is None:
            return False
        handles = dict(zip(_handles(self.twin), _handles(probe)))
        return all(vars(template.make(relocation.text, handles)) == vars(entry)
                   for template, entry in zip(self.templates, probe_entries))

    def into(self, region: ir.Operation, take_channel: Callable[[], int]) -> list[SiteReport] | None:
        """Replace ``region`` by a copy of the twin with its operands and locations; its report
        entries, or None (``region`` left as it was) where a location cannot be mapped.

        A region located exactly as the twin (layers written as a Python loop over one block
        function: every layer's ops come from the same source lines) keeps the copy's locations
        as they are, and its entries are the twin's but for channel handles."""
        locations = _locations(region)
        same = locations == self.locations
        relocation = None if same else self._relocation(locations)
        if (relocation is None and not same) or self.recipe is None:
            return None
        copy = self.twin.clone(ir.InsertionPoint(region)).operation
        handles: dict[int, int] = {}

        def renew(op: ir.Operation) -> None:  # a fresh handle for every channel op
            attrs = op.attributes
            if "channel_handle" not in attrs:
                return
            old = hlo.ChannelHandle(attrs["channel_handle"])
            handles[old.handle] = take_channel()
            attrs["channel_handle"] = hlo.ChannelHandle.get(handles[old.handle], old.channel_type)

        if relocation is not None:
            steps = iter(self.recipe)
            locate = relocation.ir

            def visit(op: ir.Operation) -> ir.WalkResult:
                where, channel = next(steps)
                if where is not None:
                    op.location = locate(where)
                if channel:
                    renew(op)
                return ir.WalkResult.ADVANCE

            copy.walk(visit, ir.WalkOrder.PRE_ORDER)
        else:  # located as the twin: only the channel ops are visited, found by their places
            for place, handle, channel_type in self.channels:
                op = copy
                for r, b, i in place:
                    op = op.regions[r].blocks[b].operations[i]
                handles[handle] = take_channel()
                op.operation.attributes["channel_handle"] = hlo.ChannelHandle.get(handles[handle], channel_type)
        for index, value in enumerate(region.operands):
            copy.operands[index] = value
        for old, new in zip(region.results, copy.results):
            old.replace_all_uses_with(new)
        region.erase()
        if same:
            return [template.make_same(handles) for template in self.templates]
        return [template.make(relocation.text, handles) for template in self.templates]

    def _relocation(self, locations: list[ir.Location]) -> "_Relocation | None":
        if len(locations) != len(self.locations):
            return None
        if any(locations[at] != locations[position] for at, position in self.alike):
            return None  # one twin location at two places the region locates differently
        return _Relocation(self, locations)


def _recipe(twin: ir.Operation, before: list[ir.Location]) -> list | None:
    """Per op of the rewritten ``twin`` (pre-order): where its location comes from (a place
    among ``before``, a tuple of such for a location fused from several, or None: unknown,
    kept), and whether it holds a channel handle.  None where a location is none of these."""
    first: dict = {}
    for position, loc in enumerate(before):
        first.setdefault(loc.attr, position)
    unknown = ir.Location.unknown().attr
    resolved: dict = {}

    def where(attr) -> object:
        if attr in resolved:
            return resolved[attr]
        found = first.get(attr)
        if found is None and attr != unknown:
            concrete = ir.Location.from_attr(attr)
            if hasattr(concrete, "locations"):  # a fused location the pass built from the twin's ops
                parts = tuple(where(part.attr) for part in concrete.locations)
                found = _UNMAPPED if any(p is _UNMAPPED for p in parts) else parts
            else:
                found = _UNMAPPED
        resolved[attr] = found
        return found

    recipe: list = []

    def visit(op: ir.Operation) -> ir.WalkResult:
        recipe.append((where(op.location.attr), "channel_handle" in op.attributes))
        return ir.WalkResult.ADVANCE

    twin.walk(visit, ir.WalkOrder.PRE_ORDER)
    return None if any(step is _UNMAPPED for step, _ in recipe) else recipe


#: a location :func:`_recipe` cannot read as the twin's
_UNMAPPED = object()


class _Relocation:
    """The twin's locations read as another region's: as IR locations, and as rendered text."""

    def __init__(self, replay: _Replay, locations: list[ir.Location]):
        self.replay = replay
        self.locations = locations
        self._fused: dict[tuple, ir.Location] = {}
        self._text: dict[str, str] = {}

    def ir(self, where: int | tuple | None) -> ir.Location:
        """The region's location at place ``where`` of the twin's (a tuple: those places fused;
        None: unknown)."""
        if isinstance(where, int):
            return self.locations[where]
        if where is None:
            return ir.Location.unknown()
        built = self._fused.get(where)
        if built is None:
            built = self._fused[where] = ir.Location.fused([self.ir(part) for part in where])
        return built

    def text(self, rendered: str) -> str:
        """The region's rendering of a location the twin renders as ``rendered``."""
        if rendered not in self._text:
            position = self.replay.rendered[rendered]
            self._text[rendered] = ir_utils.render_location(self.locations[position], self.replay.source)
        return self._text[rendered]


class _Template:
    """A report entry with its location strings and channel handles as holes."""

    def __init__(self, data: dict, holes: list):
        self.shared = data  # the twin's fields, a copy of its own never edited: shared by every entry made
        self.holes = holes  # paths into data of strings holding locations: (path, parts)
        # what make does, worked out once: the containers on the way to a hole (parents first),
        # which the entry gets its own copies of; and per hole, its container's path, its key, its
        # pieces and which of them are location strings
        self.copies = sorted({path[:depth] for path, _ in holes for depth in range(1, len(path))}, key=len)
        self.fills = [(path[:-1], path[-1], [piece for _, piece in parts],
                       [i for i, (kind, _) in enumerate(parts) if kind == "loc"]) for path, parts in holes]

    def make_same(self, handles: dict[int, int]) -> SiteReport:
        """:meth:`make` for a region located as the twin: its strings are the twin's, and its
        lists and dicts (but its channel handles) are one copy shared by every such region's
        entry (a report is read, not edited: :class:`~cmatmul_pass.report.SiteReport`)."""
        return _entry(dict(self.shared), handles)

    def make(self, text: Callable[[str], str], handles: dict[int, int]) -> SiteReport:
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
        return _entry(data, handles)


def _entry(data: dict, handles: dict[int, int]) -> SiteReport:
    """The report entry of ``data`` (a template's fields), its channel handles renamed by ``handles``."""
    data["channel_handles"] = [handles.get(h, h) for h in data["channel_handles"]]
    entry = SiteReport.__new__(SiteReport)
    entry.__dict__.update(data)
    return entry


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


def _channel_places(region: ir.Operation) -> list[tuple[tuple, int, int]]:
    """The ops in ``region`` holding a channel handle, grouped by op class (the classes in the
    order they first appear, each class's ops in pre-order): each as its place (the (region,
    block, op) indices leading to it from ``region``), its handle and its channel type.  One
    Python pass over ``region``'s ops (once per group: a copy then reaches its few channel ops
    by their places instead of walking)."""
    found: list[tuple[type, tuple, int, int]] = []

    def visit(op: ir.Operation, place: tuple) -> None:
        for r, inner in enumerate(op.regions):
            for b, block in enumerate(inner.blocks):
                for i, child in enumerate(block.operations):
                    child = child.operation
                    at = (*place, (r, b, i))
                    attributes = child.attributes
                    if "channel_handle" in attributes:
                        old = hlo.ChannelHandle(attributes["channel_handle"])
                        found.append((type(child.opview), at, old.handle, old.channel_type))
                    visit(child, at)

    visit(region, ())  # (``region`` itself, a manual computation, holds no handle)
    rank = {kind: k for k, kind in enumerate(dict.fromkeys(kind for kind, *_ in found))}
    return [(place, handle, channel_type)
            for _, place, handle, channel_type in sorted(found, key=lambda f: rank[f[0]])]


def _handles(region: ir.Operation) -> list[int]:
    """The channel handles in ``region``, in pre-order."""
    return [hlo.ChannelHandle(op.attributes["channel_handle"]).handle for op in _channel_ops(region)]


def walk(module: ir.Module, names: tuple[str, ...], replayable: bool) -> tuple[dict[str, list[ir.OpView]], Plan | None]:
    """The ops named ``names`` (which must hold ``stablehlo.while``), as
    :func:`ir_utils.ops_named` gives them, and the plan.  With ``replayable``, identical
    top-level regions are grouped first and the walk skips those left for replay: they print as their twin does, so they hold the same ops,
    channel handles and callees, and the pipeline never reads them before they are replaced
    (:meth:`Plan.only` walks them where the probe disagrees).  A module with a loop is not
    replayed, and is walked whole."""
    layers = plan(_top_level_regions(module)) if replayable else None
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


def plan(regions: list[ir.Operation]) -> Plan | None:
    """The groups of identical regions among ``regions`` (top-level, in program order), or None
    when nothing is to be replayed."""
    if len(regions) < MIN_MEMBERS:
        return None
    # a region prints its operands and its results' count, so regions that print alike have as many
    # of each: regions whose counts fewer than MIN_MEMBERS share are in no group, and not printed
    counts = [(len(region.operands), len(region.results)) for region in regions]
    shared = Counter(counts)
    by_body: dict[bytes, list[ir.Operation]] = {}
    for region, count in zip(regions, counts):
        if shared[count] < MIN_MEMBERS:
            continue
        text = region.get_asm(binary=True, use_local_scope=True, assume_verified=True)
        by_body.setdefault(text, []).append(region)
    groups = [Group(members) for members in by_body.values() if len(members) >= MIN_MEMBERS]
    return Plan(groups) if groups else None
