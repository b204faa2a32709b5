"""Sites that repeat one pattern share one ring function.

A model's layers repeat the same projections: at 32 transformer layers the pass meets
about 250 sites but only a handful of distinct ones.  The first site of each pattern
gets its ring inline, as ever.  A later site whose pattern is the same (the same ops
with the same attributes and types, wired to each other and to outside values the same
way, with the same results read outside) is replaced by a ``func.call`` of a private
function ``@cmatmul_ring_<k>`` that holds the pattern's ring: built once, from the
second site, and called by every later one.  That is the form JAX gives a nested
``jax.jit`` called from several places; XLA inlines calls before optimising, so the
compiled program is the one the inline rings give, and the pass builds (and prints) a
few rings instead of hundreds.

Where a site's region is itself to become a function that every copy of it calls (the first
of several identical layers' regions, :mod:`cmatmul_pass.replay`'s twin), its sites keep
their rings inline and their patterns are not recorded: the layer function is already the one
copy, and a ring function there would be one more function, clone and call per site, called
once.

The function is made the plain way: the site's ops are cloned into it (their operands
become its arguments, the results read outside its results), and the rewrite runs there on
the site as the pass matched it, its ops and values read as their copies (:func:`mapped`; a
site referring to something else is matched again in the function).  Sharing is therefore
exactly as safe as the pattern's key is complete: ops, attributes, operand and result types
(Attribute and Type objects are uniqued by MLIR, so equal means identical), the wiring,
nested regions, and which results leave the pattern.  :data:`CHECK` matches every copy
too and fails where the mapped site is not what the matcher finds (or, for a site another
matcher found, a psum's split, where the matcher does not decline the original as it
declines the copy).

A site keeps its own ring (no call) when the call could not stand where the ring
would: in a partial-manual region (its ring reads its position through a nested
``sdy.manual_computation``), in a module of the legacy partitioner (which sees only what
``@shmap_body`` holds), a site whose dot reads another all_gather's value (that gather's
ring takes the dot: a scatter's peeled one, a gather's round 0), an operand defined after
the insertion point, or a
result read before it.  Stream annotation turns sharing off: every site's permutes
need their own scheduling groups.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass

from . import ir_utils
from ._jax_private import ir
from .layout import is_layout_op, path_sources
from .errors import InternalError
from .matchers import FULLY_MANUAL, AllGatherSite, ReduceScatterSite, Site
from .matchers.common import DeclinedSite, ManualRegion
from .ring import Ring
from .rewrites.schedule import Applied

FUNCTION_PREFIX = "cmatmul_ring_"
#: match each site's copy in its ring function too, and fail (InternalError) where it is not the
#: site :func:`mapped` gives (the test suite and fuzz campaigns set it; ``CMATMUL_PASS_CHECK_SHARING=1``)
CHECK = os.environ.get("CMATMUL_PASS_CHECK_SHARING", "") not in ("", "0")


@dataclass(eq=False)
class Pattern:
    """One site's ops as a unit a call can replace."""

    ops: list[ir.Operation]  # producers before their users (the order of the key and the clones)
    inputs: list[ir.Value]  # outside values the ops read, in first-use order
    outputs: list[ir.Value]  # results of the ops read outside them
    key: "Key"
    insert_before: ir.Operation
    anchor: ir.OpView


@dataclass(frozen=True)
class SharedRing:
    """A ring function and what building its ring reported."""

    name: str
    applied: Applied


_FIRST = "first"  # seen once: that site's ring stays inline
_UNSHAREABLE = "unshareable"  # the function's re-match differed from the site's: keep rings inline


class RingLibrary:
    """The ring functions of one pass run, by pattern key."""

    def __init__(self, module: ir.Module, shardy: bool):
        """``shardy``: the module was lowered with Shardy (it declares an ``sdy.mesh``); the
        legacy partitioner's modules keep every ring inline."""
        self.module = module
        self.shardy = shardy
        self._by_key: dict[Key, SharedRing | str] = {}
        self._keys: dict[Key, Key] = {}
        self._names: set[str] | None = None
        #: whether a site's anchor sits in a region that is itself to become the function every copy
        #: of it calls (a replay group's twin): its ring stays inline, its pattern unrecorded
        self.inline: Callable[[ir.OpView], bool] | None = None

    def pattern(self, site: AllGatherSite | ReduceScatterSite) -> Pattern | None:
        """``site``'s pattern (:func:`pattern_of`), or None: its ring stays inline, unshared."""
        if not self.shardy or (self.inline is not None and self.inline(site.anchor)):
            return None
        pattern = pattern_of(site)
        if pattern is not None:
            # one key object per pattern: later dict lookups with it compare by identity,
            # not element by element
            pattern.key = self._keys.setdefault(pattern.key, pattern.key)
        return pattern

    def share(
        self,
        site: AllGatherSite | ReduceScatterSite,
        pattern: Pattern,
        match: Callable[[ir.OpView], Site],
        rewrite: Callable[[Site], Applied],
    ) -> SharedRing | None:
        """Replace ``site`` (its ``pattern``) by a call of the pattern's ring function and return
        that function; None: ``site`` gets its own ring (the first of its pattern, or not
        shareable).  ``match`` re-matches the anchor op inside a new function, ``rewrite``
        builds a ring.
        """
        entry = self._by_key.get(pattern.key)
        if entry is None:
            self._by_key[pattern.key] = _FIRST
            return None
        if entry is _FIRST:
            entry = self._by_key[pattern.key] = self._outline(site, pattern, match, rewrite)
        if not isinstance(entry, SharedRing):
            return None
        _replace_by_call(pattern, entry.name)
        return entry

    def _outline(self, site, pattern: Pattern, match, rewrite) -> SharedRing | str:
        name = self._fresh_name()
        loc = pattern.anchor.location
        f, entry = ir_utils.private_function(self.module.body, name, [v.type for v in pattern.inputs],
                                             [v.type for v in pattern.outputs], loc)
        mapping = dict(zip(pattern.inputs, entry.arguments))
        with ir.InsertionPoint(entry):
            clones = dict(zip(pattern.ops, ir_utils.clone_mapped(pattern.ops, mapping)))
            returned = ir_utils.function_return([mapping[v] for v in pattern.outputs], loc)
        inner = mapped(site, clones, mapping, returned)
        if inner is None:  # the ordinary matcher finds the copy's site
            inner = match(clones[pattern.anchor.operation].opview)
            if _shape(inner) != _shape(site):  # defensive: the function must hold the same site
                f.erase()
                return _UNSHAREABLE
        elif CHECK and not _agrees(inner, match(clones[pattern.anchor.operation].opview), pattern.anchor, match):
            raise InternalError(f"the {site.kind} site at {loc} mapped into @{name} is not the site matching its "
                                "copy there finds (sharing.CHECK)")
        return SharedRing(name, rewrite(inner))

    def _fresh_name(self) -> str:
        if self._names is None:
            self._names = {
                ir.StringAttr(op.operation.attributes["sym_name"]).value
                for op in self.module.body.operations
                if "sym_name" in op.operation.attributes
            }
        index = len([n for n in self._names if n.startswith(FUNCTION_PREFIX)])
        while f"{FUNCTION_PREFIX}{index}" in self._names:
            index += 1
        name = f"{FUNCTION_PREFIX}{index}"
        self._names.add(name)
        return name


class _Outside(Exception):
    """A site's field refers to an op or value its pattern's copy does not hold."""


#: classes of a site's fields that hold no op or value (kept as they are)
_PLAIN = (int, float, str, bool, type(None), Ring, ManualRegion)


def mapped(site: AllGatherSite | ReduceScatterSite, ops: dict, values: dict, returned: ir.Operation) -> Site | None:
    """``site`` as it reads among its pattern's copies in a ring function: each op and value
    it refers to replaced by its copy (``ops``: each pattern op's clone; ``values``: each value
    the pattern reads or computes -> the function's; ``returned``: the function's return);
    None where it refers to anything else (ops moved after a scatter's ring, or an op the
    function holds no copy of: the ordinary matcher then finds the copy's site).  The readers
    of a gathered value outside the pattern are the function's return there, and the ops
    hoisted before the ring its arguments.  Objects shared between fields (a layout step on
    the paths of several dots) stay shared.  This is what matching the copy finds, without
    matching it again: the copy holds the same ops, and each value read outside the pattern is
    read there by the function's return, as it was by readers the site did not count."""
    kept, hoisted = getattr(site, "kept_users", ()), getattr(site, "hoist", ())
    if getattr(site, "moved", ()) or any(op in ops for op in hoisted) or \
            any(user.operation in ops for user in kept):
        return None
    memo: dict[int, object] = {}
    if kept:  # read outside the pattern: in the function, by its return (which reads each output once)
        memo[id(kept)] = (kept, (returned.opview,))
    if hoisted:  # computed before the call: the function's arguments
        memo[id(hoisted)] = (hoisted, ())
    try:
        return _map(site, ops, values, memo)
    except _Outside:
        return None


def _map(obj, ops: dict, values: dict, memo: dict):
    kind = _KINDS.get(type(obj))
    if kind is None:
        kind = _KINDS[type(obj)] = _kind(type(obj))
    if kind is _PLAIN_KIND:
        return obj
    if kind is _VALUE:
        found = values.get(obj)
    elif kind is _OPVIEW:
        found = ops.get(obj.operation)
        found = found.opview if found is not None else None
    elif kind is _OPERATION:
        found = ops.get(obj)
    elif kind is _OTHER:
        raise _Outside
    else:
        held = memo.get(id(obj))
        if held is not None:
            return held[1]
        if kind is _SEQUENCE:
            found = type(obj)([_map(item, ops, values, memo) for item in obj])
        else:  # a dataclass holding its fields (``kind``: their names) in its __dict__, and nothing else
            state = obj.__dict__
            if state.keys() != kind:
                raise _Outside
            found = object.__new__(type(obj))
            found.__dict__.update({name: _map(value, ops, values, memo) for name, value in state.items()})
        memo[id(obj)] = (obj, found)  # (the original kept alive: its id is not reused)
    if found is None:
        raise _Outside
    return found


_PLAIN_KIND, _VALUE, _OPVIEW, _OPERATION, _SEQUENCE, _OTHER = "plain", "value", "opview", "operation", "sequence", "other"
#: how :func:`_map` treats objects of a class: one of the kinds above, or a dataclass's field names
_KINDS: dict[type, object] = {}


def _kind(cls: type):
    if issubclass(cls, _PLAIN):
        return _PLAIN_KIND
    if issubclass(cls, ir.Value):
        return _VALUE
    if issubclass(cls, ir.OpView):
        return _OPVIEW
    if issubclass(cls, ir.Operation):
        return _OPERATION
    if cls in (tuple, list):
        return _SEQUENCE
    if dataclasses.is_dataclass(cls) and "__slots__" not in vars(cls):
        return frozenset(f.name for f in dataclasses.fields(cls))
    return _OTHER


def _agrees(inner: Site, again: Site, anchor: ir.OpView, match: Callable[[ir.OpView], Site]) -> bool:
    """:data:`CHECK`'s verdict on ``inner`` (a site mapped into its ring function), given ``again``
    (matching its copy there): the same site; or, where the matcher declines the copy, a site the
    pass matched another way (a psum's split, its scatter traced by the psum's matcher, which also
    passes an affine norm backward), which the matcher then declines at ``anchor`` alike."""
    if not isinstance(again, DeclinedSite):
        return canonical(inner) == canonical(again)
    original = match(anchor)
    return isinstance(original, DeclinedSite) and original.code == again.code


def canonical(obj, order: dict | None = None, seen: dict | None = None):
    """``obj`` (a site) with its ops and values as their places in the function holding them,
    and objects it holds several times numbered: equal for two sites of one function exactly
    when they are the same site (:data:`CHECK`)."""
    if order is None:
        anchor = obj.anchor.operation
        order, seen = {}, {}
        for index, op in enumerate(anchor.block.operations):
            order[op.operation] = index
    if isinstance(obj, _PLAIN):
        return obj
    if isinstance(obj, ir.OpView):
        obj = obj.operation
    if isinstance(obj, ir.Operation):
        return ("op", order.get(obj), obj.name)
    if isinstance(obj, ir.Value):
        owner = obj.owner
        if isinstance(owner, ir.Block):
            return ("arg", ir.BlockArgument(obj).arg_number)
        return ("result", order.get(owner.operation), ir.OpResult(obj).result_number)
    if type(obj) in (tuple, list):
        return tuple(canonical(item, order, seen) for item in obj)
    if id(obj) in seen:
        return ("again", seen[id(obj)])
    seen[id(obj)] = len(seen)
    return (type(obj).__name__, *(canonical(getattr(obj, f.name), order, seen) for f in dataclasses.fields(obj)))


def _shape(site: Site) -> tuple:
    """What must agree between a site and its copy in a ring function."""
    if isinstance(site, AllGatherSite):
        return ("gather", tuple((c.role, c.operand_index, c.dim) for c in site.consumers), site.assembles,
                len(site.nodes))
    if isinstance(site, ReduceScatterSite):
        return ("scatter", tuple((t.operand_index, t.operand_dim, t.other_dim) for t in site.terms), len(site.adds),
                len(site.path))
    return ("declined", site.code)


def _replace_by_call(pattern: Pattern, name: str) -> None:
    with ir.InsertionPoint(pattern.insert_before):
        call = ir_utils.call(name, pattern.inputs, [v.type for v in pattern.outputs], pattern.anchor.location)
    for old, new in zip(pattern.outputs, call.results):
        old.replace_all_uses_with(new)
    for op in reversed(pattern.ops):
        op.erase()


def pattern_of(site: AllGatherSite | ReduceScatterSite) -> Pattern | None:
    """``site`` as a pattern a call can replace, or None where a call could not stand in for it."""
    if site.region != FULLY_MANUAL:
        return None
    # the ops in an order where producers come first (the key and the clones follow it)
    if isinstance(site, AllGatherSite):
        anchor, at = site.all_gather, site.insert_before
        # an elementwise node's block-invariant operands (a broadcast scale) go with it: the ring
        # function's copy of the site must see them as what they are, not as arguments
        sources = [source.operation for source in path_sources(site.nodes)]
        ops = [anchor.operation, *sources, *(s.op.operation for s in site.nodes), *(c.dot.operation for c in site.consumers)]
    else:
        anchor = site.reduce_scatter
        at = anchor.operation
        sources = [source.operation for source in path_sources(site.path)]
        ops = [*sources, *(t.dot.operation for t in site.terms), *(a.operation for a in reversed(site.adds)),
               *(s.op.operation for s in site.path), anchor.operation]
    if at is None:
        return None
    ops = list(dict.fromkeys(ops))  # one dot may be reached along two layout paths
    block = at.block
    index = {}
    for i, op in enumerate(ops):
        if op.block != block:
            return None
        index[op] = i

    signature = _Signature()
    # the scatter's reduction is a sum (its match checked): the key says so instead of walking it
    summed = anchor.operation if isinstance(site, ReduceScatterSite) else None
    key = tuple([signature.op(op, summed=summed is not None and op == summed) for op in ops])
    if signature.captures:
        return None
    hoisted = set(getattr(site, "hoist", ()))  # moved before ``at`` when the site is rewritten
    for value in signature.inputs:
        owner = value.owner
        if isinstance(owner, ir.Block):
            continue  # an argument of this block or an enclosing one: available everywhere in it
        owner = owner.operation
        if owner in index:
            return None  # a producer after its user in ``ops``: not a pattern this module clones
        if owner.block == block and not owner.is_before_in_block(at) and owner not in hoisted:
            return None  # not defined yet where the call would go (outer blocks' values dominate)
    if any(_from_all_gather(v) for v in signature.inputs):
        return None  # a dot reading another all_gather's value: that gather's ring computes it
    outputs, leaving = [], []
    for i, op in enumerate(ops):
        for result in op.results:
            read_outside = False
            for use in result.uses:
                user = use.owner.operation
                if user not in index:
                    if _before(user, at, block):
                        return None  # read before the ring's place
                    read_outside = True
            if read_outside:
                outputs.append(result)
                leaving.append((i, result.result_number))
    return Pattern(ops, signature.inputs, outputs, Key((site.kind, key, tuple(leaving))), at, anchor)


def structure(op: ir.Operation) -> tuple:
    """``op``'s structural key, the ops nested in it included: what a pattern key holds (names,
    attributes, types, wiring; channel handles aside), comparable within one context."""
    return _Signature().op(op)


class Key:
    """A pattern's structural key, hashed once: it holds hundreds of MLIR attributes and types,
    whose hashes are C++ calls, and is looked up more than once per site."""

    __slots__ = ("parts", "_hash")

    def __init__(self, parts: tuple):
        self.parts = parts
        self._hash = hash(parts)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Key) and self._hash == other._hash and self.parts == other.parts


#: A collective's channel handle is its identity, not part of what it computes: the ring replaces
#: the collective and its permutes take fresh handles, so sites differing only there share.
_ANY_CHANNEL = "<channel>"
_CHANNEL_OPS = frozenset(ir_utils.CHANNEL_OPS)


class _Signature:
    """Structural key of a list of ops: outside values become numbered inputs, values
    defined inside become (op number, result number) / (op number, block, argument)."""

    def __init__(self):
        self.inputs: list[ir.Value] = []
        self._tokens: dict[ir.Value, tuple] = {}
        self._count = 0
        self.captures = False  # an op nested in a region reads an outside value

    def op(self, op: ir.Operation, nested: bool = False, summed: bool = False) -> tuple:
        """``op``'s part of the key (``summed``: its one region is a matched sum reduction,
        ``return add(arg0, arg1)``, which its result type determines)."""
        # an operand's type is its producer's result type, or recorded with the input's token
        tokens = self._tokens
        wiring = []
        for value in op.operands:
            token = tokens.get(value)
            if token is None:
                self.captures |= nested
                token = tokens[value] = (len(self.inputs), value.type)
                self.inputs.append(value)
            wiring.append(token)
        number = self._count
        self._count = number + 1
        name = op.name
        attributes = tuple(op.attributes.items())
        if name in _CHANNEL_OPS:
            attributes = tuple((n, _ANY_CHANNEL if n == "channel_handle" else a) for n, a in attributes)
        if summed:
            inner = ("sum",)
        else:
            regions = op.regions
            inner = tuple([self._region(r) for r in regions]) if len(regions) else ()
        types = []
        for i, r in enumerate(op.results):
            tokens[r] = (number, i)
            types.append(r.type)
        return (name, attributes, tuple(wiring), inner, tuple(types))

    def _region(self, region: ir.Region) -> tuple:
        blocks = []
        number = self._count  # a region takes a number of its own, so its arguments' tokens are unique
        self._count += 1
        for b, block in enumerate(region.blocks):
            types = []
            for a, arg in enumerate(block.arguments):
                self._tokens[arg] = (number, b, a)
                types.append(arg.type)
            blocks.append((tuple(types), tuple(self.op(op.operation, nested=True) for op in block.operations)))
        return tuple(blocks)


def _before(user: ir.Operation, at: ir.Operation, block: ir.Block) -> bool:
    """Does ``user`` (or its ancestor in ``block``) come before ``at``?"""
    mine = ir_utils.ancestor_in(user, block)
    return mine is None or mine.is_before_in_block(at)


def _from_all_gather(value: ir.Value) -> bool:
    """Is ``value`` an all_gather's result, possibly through layout ops?"""
    while not isinstance(value.owner, ir.Block):
        owner = value.owner
        if owner.operation.name == "stablehlo.all_gather":
            return True
        if not is_layout_op(owner):
            return False
        value = owner.operation.operands[0]
    return False
