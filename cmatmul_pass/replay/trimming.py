"""Regions that are a group's twin trimmed: some of its results dropped, with the ops and operands
only they need.

A *trimmed* region (:class:`Trim`) is the region just after a group when its body is the twin's
without some of its results and the ops and operands only those need (:func:`_trims`: the twin's
copy trimmed so, by bytecode): JAX's backward of a model's first layer, which returns no gradient
for the model's input.  It becomes a call of a function of its own holding the twin's rewritten
region trimmed alike (:func:`_trimmed_function`: the dropped results' ops erased where no one reads
them and they are pure, :func:`_erase_unread`), with fresh channel handles; its report entries are
the twin's for the collectives it holds (:meth:`~cmatmul_pass.replay.groups.Plan.lacked`), read with
its locations.  Sound as a call is: the rewritten twin computes what its body computes, and
trimming keeps the rest.  That the pass would have chosen the same in it is the further claim
again, and weaker: a site's rewrite may read the ops around it, which the trimmed region has fewer
of, so a twin with a split psum (its gather carried past the ops after it), a collective moved to
its matmul or a site declined for what reads it is not trimmed (:func:`_reads_around`: the region
is then rewritten the usual way after the calls, its entries last), nor any under
``all_reduce="split"``, nor a region whose lacking ops read a gathered value it holds
(:func:`_gathered`: the twin's ring assembles it for them); with
:data:`~cmatmul_pass.replay.CHECK` the region is rewritten the usual way too and must come out as
the trimmed copy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .. import ir_utils
from .._jax_private import ir, sdy
from ..layout import LAYOUT_OPS
from ..report import SiteReport
from .regions import _body, _module_body, _nested_count, _reshaped, _return_only

if TYPE_CHECKING:
    from .fingerprint import _Fingerprint


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
