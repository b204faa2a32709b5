"""Device variance: which values are the same on every device of a ring's groups.

Inside a shard_map body every device runs the same program on its own data.  A value
is *identical across a group* when every device of the group holds the same array: a
constant; an argument of the ``sdy.manual_computation`` whose in-sharding names none of
the mesh axes along which the group's devices differ (JAX's ``vma`` type says the same
thing); the result of an ``all_reduce`` or ``all_gather`` whose groups contain
the ring's; any pure op computed only from such values; and, seen through control flow:

- a ``stablehlo.while``'s carried value ``k`` (in its condition, its body and its result)
  when its initial value is identical and the body hands the next trip an identical value,
  assuming the same of every carried value so proven (the largest such set, found by
  removing values until none fails: an induction over the trips); a result also needs the
  trip count to be identical, which holds when the condition is identical under that
  assumption;
- a ``case``/``if`` result when its index (predicate) is identical and every branch
  returns an identical value;
- a ``func.call``'s (or ``stablehlo.composite``'s, through its decomposition) result when
  the callee returns an identical value given which of its arguments are;
- an argument of a manual computation sharded along the group's axes that an earlier one
  returned with the same sharding (a forward's residual read by its backward): when the value
  returned there is identical (each device reads back its own);
- a private function's argument (a scan's body, a remat'd layer) when the function is only
  called and every call passes an identical value (asked where each call stands; where the
  question comes through known calls, :meth:`Variance.identical_in`, their operands decide).

Everything else — ``partition_id``, a collective permute, a reduce_scatter, an ``rng``, a
``custom_call``, a call of a function the module does not hold, anything the analysis cannot
see into — may differ.  The answer is conservative: ``False`` means "not proven identical".

Rewrites ask it two things: :meth:`Variance.identical` (may a moved op read this value as it
is: a slice index, a gain) and :meth:`Variance.uniform_control` (does every device of the
group execute this place the same number of times: a collective may only be put there).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .. import ir_utils
from .._jax_private import ir, sdy
from ..errors import Decline
from . import by_partition
from .dataflow import all_of, decide
from ..matchers.common import ModuleInfo, manual_computation_mesh, replica_groups
from ..ring import Ring

#: ops whose result depends on which device runs them, or that the analysis does not see into
DEVICE_DEPENDENT = frozenset({
    "stablehlo.partition_id", "stablehlo.replica_id", "stablehlo.collective_permute",
    "stablehlo.reduce_scatter", "stablehlo.all_to_all", "stablehlo.collective_broadcast",
    "stablehlo.rng", "stablehlo.rng_bit_generator", "stablehlo.custom_call", "stablehlo.infeed",
    "stablehlo.recv", "stablehlo.send", "sdy.manual_computation",
})
#: ops with regions that only combine their operands' elements (a reduction's body)
PURE_REGION_OPS = frozenset({
    "stablehlo.reduce", "stablehlo.reduce_window", "stablehlo.sort", "stablehlo.map",
    "stablehlo.scatter", "stablehlo.select_and_scatter",
})
GROUP_COLLECTIVES = frozenset({"stablehlo.all_reduce", "stablehlo.all_gather"})
WHILE, CASE, IF = "stablehlo.while", "stablehlo.case", "stablehlo.if"
CALLS = frozenset({"func.call", "stablehlo.composite"})
#: calls deeper than this (a recursion) are not seen into
MAX_CALL_DEPTH = 16


@dataclass
class _Scope:
    """The answers under one set of assumptions: ``memo`` (value -> identical) seeded with the
    assumed facts (a loop's carried values during its induction, a callee's arguments), and
    the loops whose facts were found under them."""

    memo: dict = field(default_factory=dict)
    loops: dict = field(default_factory=dict)  # while op -> _LoopFacts
    depth: int = 0


@dataclass(frozen=True)
class _LoopFacts:
    carried: frozenset[int]  # the carried values identical on every trip
    uniform: bool  # the trip count is identical (the condition is, given ``carried``)


class Variance:
    """Answers :meth:`identical` for one module, remembering every answer until :meth:`forget`
    (values do not change while a rewrite asks; new values it builds are never asked about)."""

    def __init__(self, info: ModuleInfo):
        self.info = info
        self._scopes: dict[tuple, _Scope] = {}  # per ring's groups: the unassumed answers
        self._axes: dict[tuple, frozenset[str] | None] = {}
        self._calls: dict[tuple, bool] = {}  # (callee, its arguments' facts, result, groups) -> answer
        self._functions: dict[str, ir.Operation] | None = None
        self._evaluators: dict[int, by_partition.ByPartition] = {}
        self._args: dict[tuple, bool] = {}  # (function, argument, groups) -> answer over its calls
        self._callers: dict[str, list[ir.Operation] | None] | None = None  # function -> its calls (None: unknown)

    def forget(self) -> None:
        """Drop the answers about values (call it before the questions of a rewrite that follows
        another): the memo is by value, a value by its address, and an erased op's address may
        be a new op's, which would inherit the erased one's answer."""
        self._scopes.clear()
        self._calls.clear()
        self._functions = None
        self._evaluators.clear()
        self._args.clear()
        self._callers = None

    def _by_partition(self, count: int) -> "by_partition.ByPartition":
        if count not in self._evaluators:
            self._evaluators[count] = by_partition.ByPartition(count, self._callee)
        return self._evaluators[count]

    def identical(self, value: ir.Value, ring: Ring) -> bool:
        """Is ``value`` the same array on every device of each of ``ring``'s groups?"""
        return self._decide(value, ring, self._root(ring))

    def identical_in(self, value: ir.Value, ring: Ring, calls: list = ()) -> bool:
        """:meth:`identical` for a value of a function's body reached through ``calls`` (the
        ``func.call`` ops on the way, outermost first): its arguments are what they pass."""
        return self._decide(value, ring, self._through(calls, ring))

    def loop_uniform(self, loop: ir.OpView | ir.Operation, ring: Ring) -> bool:
        """Does ``loop`` (a ``stablehlo.while``) run the same number of trips on every device of
        each group, wherever it is entered?"""
        return self._loop(loop.operation, ring, self._root(ring)).uniform

    def uniform_control(self, op: ir.Operation | ir.OpView, stop: ir.Block | None, ring: Ring,
                        calls: list = ()) -> str | None:
        """None when every device of ``ring``'s groups (all of them: one collective is one
        rendezvous) executes ``op`` as often as the ops of block ``stop`` (an ancestor's: every
        loop between runs an identical number of trips, every ``case``/``if`` between takes an
        identical branch); else why not, a phrase.  ``stop`` None: up to ``op``'s function.  ``calls``: where ``op`` is in a
        callee, the calls reaching it from ``stop``'s function, outermost first."""
        # one collective op is one rendezvous of every device its groups hold (a ring's permute
        # lists every group's pairs): the control flow around it must be identical on all of them,
        # not only within each group (values it reads need only the latter)
        ring = _everyone(ring)
        calls = [c.operation for c in calls]
        places = [op.operation, *reversed(calls)]  # innermost first: each walked up to its function
        for depth, place in enumerate(places):
            scope = self._through(calls[:len(calls) - depth], ring)
            why = self._walk_up(place, stop if depth == len(calls) else None, ring, scope)
            if why:
                return why
        return None

    def _walk_up(self, op: ir.Operation, stop: ir.Block | None, ring: Ring, scope: "_Scope") -> str | None:
        while stop is None or op.block != stop:
            parent = op.parent
            if parent is None or parent.name in ("func.func", "builtin.module"):
                return None if stop is None else "it would move out of its function"
            name = parent.name
            if name == WHILE:
                if not self._loop(parent, ring, scope).uniform:
                    return "a loop whose trip count may differ between the devices encloses it"
            elif name in (CASE, IF):
                if not self._decide(parent.operands[0], ring, scope):
                    which = "index" if name == CASE else "predicate"
                    return f"a {name.split('.')[1]} whose {which} may differ between the devices encloses it"
            elif name == "sdy.manual_computation":
                if stop is not None:
                    return "it would move across a shard_map region"  # (every device enters the region)
            else:
                return f"it would sit in the region of {name}"
            op = parent
        return None

    def _through(self, calls: list, ring: Ring) -> "_Scope":
        """The scope of the innermost callee of ``calls`` (outermost first): its arguments' answers
        are those of what the calls pass."""
        scope = self._root(ring)
        for call in calls:
            call = call.operation
            callee = self._callee(call)
            if callee is None:
                return _Scope(depth=MAX_CALL_DEPTH)  # nothing known: every argument may differ
            params = callee.regions[0].blocks[0].arguments
            scope = _Scope({p: self._decide(v, ring, scope) for p, v in zip(params, call.operands)},
                           depth=scope.depth + 1)
        return scope

    # ------------------------------------------------------------------ the walk
    def _root(self, ring: Ring) -> _Scope:
        return self._scopes.setdefault(ring.groups, _Scope())

    def _decide(self, value: ir.Value, ring: Ring, scope: _Scope) -> bool:
        return decide(value, lambda v: self._step(v, ring, scope), scope.memo)

    def _step(self, value: ir.Value, ring: Ring, scope: _Scope) -> tuple[list[ir.Value], bool]:
        """(operands still to decide, or [] and the answer)."""
        owner = value.owner
        if isinstance(owner, ir.Block):
            return self._argument(value, owner, ring, scope)
        op = owner.operation
        name = op.name
        if by_partition._scalar_int(value.type):  # (axis_index of another mesh axis: one value per group)
            values = self._by_partition(ring.num_partitions)(value)
            if values is not None:
                return [], all(len(set(values[list(group)].tolist())) == 1 for group in ring.groups)
        if name in DEVICE_DEPENDENT:
            return [], False
        if name in GROUP_COLLECTIVES:
            return [], self._groups_contain(owner, ring)
        if name == WHILE:
            facts = self._loop(op, ring, scope)
            return [], facts.uniform and ir.OpResult(value).result_number in facts.carried
        if name in (CASE, IF):
            return self._branches(op, ir.OpResult(value).result_number, scope)
        if name in CALLS:
            return self._call(op, ir.OpResult(value).result_number, ring, scope)
        if name == "stablehlo.optimization_barrier":  # the identity on each value
            return all_of([op.operands[ir.OpResult(value).result_number]], scope.memo)
        if name not in PURE_REGION_OPS and len(op.regions):
            return [], False
        return all_of(op.operands, scope.memo)

    def _argument(self, value: ir.Value, block: ir.Block, ring: Ring, scope: _Scope) -> tuple[list[ir.Value], bool]:
        parent = block.owner
        if parent is not None and parent.name == WHILE:
            return [], ir.BlockArgument(value).arg_number in self._loop(parent, ring, scope).carried
        if parent is not None and parent.operation.name == "func.func":  # (unless the scope binds it)
            return [], self._passed(parent.operation, ir.BlockArgument(value).arg_number, ring)
        if parent is None or parent.name != "sdy.manual_computation":
            return [], False  # a region's argument: not known
        index = ir.BlockArgument(value).arg_number
        sharding = sdy.TensorShardingAttr(sdy.TensorShardingPerValueAttr(parent.attributes["in_shardings"]).shardings[index])
        if self._names_varying_axis(sharding, parent, ring):
            returned = _returned_alike(parent, index, sharding)
            return ([], False) if returned is None else all_of([returned], scope.memo)
        if _nested(parent):  # the value entering a nested region must itself be identical
            return all_of([parent.operands[index]], scope.memo)
        return [], True

    def _passed(self, function: ir.Operation, index: int, ring: Ring) -> bool:
        """A function's argument ``index``, wherever it is called: identical when the function is
        private, only called (a ``func.call``, a composite's decomposition) and every call passes an
        identical value (each call's operands asked where the call stands, unbound)."""
        key = (ir_utils.symbol_name(function), index, ring.groups)
        if key not in self._args:
            self._args[key] = False  # a recursion meets this: not proven
            calls = self._calls_of(function)
            self._args[key] = bool(calls) and all(
                index < len(call.operands) and self._decide(call.operands[index], ring, self._root(ring))
                for call in calls)
        return self._args[key]

    def _calls_of(self, function: ir.Operation) -> list[ir.Operation]:
        """The calls of ``function`` (func.call, composite), or none where it is public or named by
        another op (a custom_call's called computations: what passes its arguments is unknown)."""
        if not ir_utils.is_private(function):
            return []
        return self._symbols(function)[1].get(ir_utils.symbol_name(function)) or []

    def _symbols(self, op: ir.Operation) -> tuple[dict, dict]:
        """The module's functions by name, and each function's calls by its name (None: named by an
        op that is no call), from one walk of the module holding ``op`` (until :meth:`forget`)."""
        if self._functions is None or self._callers is None:
            module = op
            while module.parent is not None:
                module = module.parent
            found = ir_utils.ops_named(module, "func.func", "func.call", "stablehlo.composite", "stablehlo.custom_call")
            self._functions = {ir_utils.symbol_name(f): f.operation for f in found["func.func"]}
            self._callers = {}
            for name, attr in (("func.call", "callee"), ("stablehlo.composite", "decomposition")):
                for call in found[name]:
                    if attr in call.operation.attributes:
                        callee = ir.FlatSymbolRefAttr(call.operation.attributes[attr]).value
                        self._callers.setdefault(callee, []).append(call.operation)
            for call in found["stablehlo.custom_call"]:
                if "called_computations" in call.operation.attributes:
                    for ref in ir.ArrayAttr(call.operation.attributes["called_computations"]):
                        self._callers[ir.FlatSymbolRefAttr(ref).value] = None
        return self._functions, self._callers

    def _branches(self, op: ir.Operation, k: int, scope: _Scope) -> tuple[list[ir.Value], bool]:
        """A case's (if's) result ``k``: its index and every branch's returned value."""
        values = [op.operands[0]] + [_terminator(region.blocks[0]).operands[k]
                                     for region in op.regions if len(region.blocks)]
        return all_of(values, scope.memo)

    def _loop(self, loop: ir.Operation, ring: Ring, scope: _Scope) -> _LoopFacts:
        """The induction over ``loop``'s trips (under ``scope``'s assumptions, about what enters)."""
        facts = scope.loops.get(loop)
        if facts is not None:
            return facts
        cond, body = (region.blocks[0] for region in loop.regions)
        n = len(loop.operands)
        carried = {k for k in range(n) if self._decide(loop.operands[k], ring, scope)}
        yielded = _terminator(body).operands
        while True:
            trial = self._assuming(loop, carried, scope)
            failed = {k for k in carried if not self._decide(yielded[k], ring, trial)}
            if not failed:
                break
            carried -= failed
        uniform = self._decide(_terminator(cond).operands[0], ring, trial)
        facts = scope.loops[loop] = _LoopFacts(frozenset(carried), uniform)
        return facts

    def _assuming(self, loop: ir.Operation, carried: set[int], scope: _Scope) -> _Scope:
        """A scope where ``loop``'s carried values ``carried`` are identical and the others not
        (what the loop reads from outside keeps its answer in ``scope``)."""
        cond, body = (region.blocks[0] for region in loop.regions)
        memo = dict(scope.memo)
        _forget_inside(loop, memo)
        # the loop's own facts are what is being found; loops inside it are found again under them
        trial = _Scope(memo, {key: facts for key, facts in scope.loops.items() if not _inside(key, loop)}, scope.depth)
        trial.loops[loop] = _LoopFacts(frozenset(carried), True)
        for block in (cond, body):
            for k, arg in enumerate(block.arguments):
                memo[arg] = k in carried
        return trial

    def _call(self, op: ir.Operation, k: int, ring: Ring, scope: _Scope) -> tuple[list[ir.Value], bool]:
        """A call's (composite's) result ``k``: the callee's returned value, given its arguments'."""
        pending, _ = all_of(op.operands, scope.memo)
        if pending:
            return pending, False
        callee = self._callee(op)
        if callee is None or scope.depth >= MAX_CALL_DEPTH or len(callee.regions[0].blocks) != 1:
            return [], False
        facts = tuple(scope.memo[v] for v in op.operands)
        key = (ir_utils.symbol_name(callee), facts, k, ring.groups)
        if key not in self._calls:
            self._calls[key] = False  # a recursion meets this: not seen into
            block = callee.regions[0].blocks[0]
            inner = _Scope(dict(zip(block.arguments, facts)), depth=scope.depth + 1)
            self._calls[key] = self._decide(_terminator(block).operands[k], ring, inner)
        return [], self._calls[key]

    def _callee(self, op: ir.Operation) -> ir.Operation | None:
        op = op.operation
        attr = "decomposition" if op.name == "stablehlo.composite" else "callee"
        if attr not in op.attributes:
            return None
        return self._symbols(op)[0].get(ir.FlatSymbolRefAttr(op.attributes[attr]).value)

    # ------------------------------------------------------------------ mesh axes
    def _names_varying_axis(self, sharding, manual_computation: ir.Operation, ring: Ring) -> bool:
        """Does ``sharding`` split (or leave unreduced) the value along a mesh axis on which the
        ring's group members differ?  Unknown meshes count as varying."""
        axes = self._varying_axes(manual_computation, ring)
        if axes is None:
            return True
        named = [ref for dim in sharding.dimension_shardings for ref in sdy.DimensionShardingAttr(dim).axes]
        named += list(sharding.unreduced_axes)
        return any(sdy.AxisRefAttr(ref).name in axes for ref in named)

    def _varying_axes(self, manual_computation: ir.Operation, ring: Ring) -> frozenset[str] | None:
        mesh = manual_computation_mesh(manual_computation)
        if mesh is None and len(self.info.meshes) == 1:
            mesh = next(iter(self.info.meshes))
        if mesh not in self.info.meshes:
            return None
        key = (mesh, ring.groups)
        if key not in self._axes:
            self._axes[key] = varying_axes(self.info.meshes[mesh], self.info.mesh_device_ids.get(mesh) or [], ring)
        return self._axes[key]

    def _groups_contain(self, collective: ir.OpView, ring: Ring) -> bool:
        """Is each of the ring's groups inside one group of ``collective`` (so its result is the
        same on every device of the ring's group)?"""
        try:
            groups = replica_groups(collective.attributes["replica_groups"], self.info)
        except (Decline, KeyError):
            return False
        if "use_global_device_ids" not in collective.attributes or self.info.num_replicas != 1:
            return False
        where = {int(p): i for i, group in enumerate(groups) for p in group if p >= 0}
        return all(len({where.get(p, -1 - p) for p in group}) == 1 for group in ring.groups)


def varying_axes(axes: dict[str, int], device_ids: list[int], ring: Ring) -> frozenset[str] | None:
    """The mesh axes along which the members of some group of ``ring`` sit at different
    coordinates; None when the mesh does not hold the ring's partitions."""
    sizes = list(axes.values())
    count = int(np.prod(sizes)) if sizes else 1
    if count != ring.num_partitions:
        return None
    order = device_ids or list(range(count))
    coords = {device: np.unravel_index(i, sizes) for i, device in enumerate(order)}
    varying = set()
    for group in ring.groups:
        points = np.array([coords[p] for p in group])
        for i, name in enumerate(axes):
            if len(set(points[:, i].tolist())) > 1:
                varying.add(name)
    return frozenset(varying)


def _everyone(ring: Ring) -> Ring:
    """One group of every device ``ring``'s groups hold."""
    if len(ring.groups) == 1:
        return ring
    return Ring((tuple(sorted(p for group in ring.groups for p in group)),), ring.num_partitions)


def _returned_alike(region: ir.Operation, index: int, sharding) -> ir.Value | None:
    """Where argument ``index`` of the manual computation ``region`` (its in-sharding ``sharding``)
    is what an earlier manual computation of its block returned with the same sharding, over the
    same mesh axes (a forward's residual read by its backward): the value that one returned, of
    which each device reads back its own; else None."""
    operand = region.operands[index]
    source = operand.owner
    if (isinstance(source, ir.Block) or source.operation.name != "sdy.manual_computation"
            or source.operation.block != region.operation.block or _nested(region) or _nested(source.operation)):
        return None
    source = source.operation
    k = ir.OpResult(operand).result_number
    out = sdy.TensorShardingAttr(sdy.TensorShardingPerValueAttr(source.attributes["out_shardings"]).shardings[k])
    if str(out) != str(sharding) or str(source.attributes["manual_axes"]) != str(region.attributes["manual_axes"]):
        return None
    return _terminator(source.regions[0].blocks[0]).operands[k]


def _terminator(block: ir.Block) -> ir.Operation:
    return list(block.operations)[-1].operation


def _forget_inside(loop: ir.Operation, memo: dict) -> None:
    """Drop ``memo``'s answers about the values defined inside ``loop`` (found under other
    assumptions about its carried values)."""
    for inner in ir_utils.walk(loop):
        for result in inner.operation.results:
            memo.pop(result, None)
        for region in inner.operation.regions:
            for block in region.blocks:
                for arg in block.arguments:
                    memo.pop(arg, None)


def _inside(op: ir.Operation, ancestor: ir.Operation) -> bool:
    parent = op.parent
    while parent is not None:
        if parent == ancestor:
            return True
        parent = parent.parent
    return False


def _nested(op: ir.Operation) -> bool:
    parent = op.parent
    while parent is not None:
        if parent.name == "sdy.manual_computation":
            return True
        if parent.name == "func.func":
            return False
        parent = parent.parent
    return False
