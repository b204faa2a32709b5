"""The twin's report entries, read with another region's locations (:class:`_Replay`): each
location string of an entry a hole (:class:`_Template`), filled with the string the region's op at
the same place renders.
"""

from __future__ import annotations

import marshal
import re
from collections.abc import Callable
from typing import TYPE_CHECKING

from .. import ir_utils
from .._jax_private import hlo, ir
from ..report import SiteReport
from .regions import _body, _channel_ops, _located_places, _locations, _locations_at, _types

if TYPE_CHECKING:
    from .fingerprint import _Fingerprint
    from .groups import Group


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
