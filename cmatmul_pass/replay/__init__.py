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
region but the gathers that compete for a dot (:mod:`cmatmul_pass.analysis.slack`, whose groups
are not replayed), and :data:`CHECK` tests it (``tests/test_replay.py``, fuzz campaigns): the group's
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

A *trimmed* region is the region just after a group when its body is the twin's without some
of its results and the ops and operands only those need (JAX's backward of a model's first layer,
which returns no gradient for the model's input): it becomes a call of the twin's rewritten region
trimmed alike, in a function of its own (:mod:`.trimming`, which says when that is sound).

Not replayed: modules with a ``stablehlo.while`` (sinking and hoisting move collectives across
loops and regions), groups whose gathers compete with another collective for a dot (which one
gets the ring depends on what comes before the region: :mod:`cmatmul_pass.analysis.slack`),
groups whose region types the pass changed, and runs that annotate streams or do not share rings.

The package: :mod:`.regions` reads a top-level region (its body, its ops' locations and places,
its types) and reshapes it (fewer results or operands, moved into a function, replaced by a call);
:mod:`.fingerprint` writes a region's identity as bytecode; :mod:`.groups` holds :class:`Group`
and :class:`Plan`, whose :meth:`Plan.finish` replaces the copies by calls; :mod:`.entries` reads
the twin's report entries with another region's locations; :mod:`.trimming` finds and builds
trimmed regions.  This module holds the entry points (:func:`walk`, :func:`plan`) and the
settings tests and tools set, :data:`MIN_MEMBERS` and :data:`CHECK`, which the entry points read
from here when they run; the names the pipeline, tools and tests use (``replay.Plan``,
``replay.Trim``, ``replay.pass_through``, ...) are importable from here.
"""

from __future__ import annotations

import os
from collections import Counter

from .. import ir_utils
from .._jax_private import ir
# the names the pipeline, tools and tests read as replay.NAME
from .entries import _location_pattern, _Replay, _template  # noqa: F401
from .fingerprint import _Fingerprint
from .groups import Group, Plan, _joins
from .regions import (LAYER_PREFIX, MANUAL, _body, _locations, _top_level_regions, pass_through,  # noqa: F401
                      without_pass_through)
from .trimming import OWN_DECLINES, Trim, _erase_unread, _pure, _reads_around, _trims  # noqa: F401

#: the twin and at least two regions more (with :data:`CHECK`, the probe among them): below that replay would
#: save one region's rewrite, and two identical regions are common in small programs, whose output the twin's
#: inline, unrecorded rings (:mod:`cmatmul_pass.sharing`) change even where the group is then not replayed
#: (competing gathers: the copies' rings are shared from the second on)
MIN_MEMBERS = 3
#: rewrite each group's last region (the probe) the usual way too and replay the group only where it comes out
#: as the twin did: the check that the pass made the same choices in every region of a group (tests and fuzz
#: campaigns set it; ``CMATMUL_PASS_CHECK_REPLAY=1``).  Off, the pass saves a region's rewrite per group
#: (at 32 layers about 5 ms of 39, both bench models)
CHECK = os.environ.get("CMATMUL_PASS_CHECK_REPLAY", "") not in ("", "0")


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
