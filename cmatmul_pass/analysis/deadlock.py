"""Deadlock freedom of what the pass built: every collective it made runs alike on its group.

A collective completes only when every device of its group reaches it.  A device that skips
it (a branch not taken, a loop that stops a trip early) leaves the others waiting for ever
(on a GPU the program hangs; on CPU XLA aborts after its rendezvous timeout).  The rewrites
check this before they move a collective (:meth:`.variance.Variance.uniform_control`); this
module checks it again on their output, as the verifier checks types: each collective the pass
made — its channel handle is one the pass took, above the input's — must sit in control flow
whose trip counts and branch predicates the variance analysis proves identical on the
collective's group, in its function and, for a function the pass made (a shared ring, a
replayed layer), at each of its calls.  The groups of a ``collective_permute`` are the cycles of
its source → target pairs.
"""

from __future__ import annotations

import numpy as np

from .. import ir_utils
from .._jax_private import hlo, ir
from ..errors import Decline
from ..matchers.common import ModuleInfo, replica_groups
from ..ring import Ring
from .variance import Variance


def misplaced(module: ir.Module, info: ModuleInfo, first_handle: int) -> list[tuple[ir.Operation, str]]:
    """The collectives with a channel handle of at least ``first_handle`` that some device of
    their group may not execute as often as the others, each with why (empty: none)."""
    found = ir_utils.ops_named(module, "func.call", *ir_utils.CHANNEL_OPS)
    callers: dict[str, list[ir.Operation]] = {}
    for call in found["func.call"]:
        callers.setdefault(ir.FlatSymbolRefAttr(call.attributes["callee"]).value, []).append(call.operation)
    variance = Variance(info)
    checked: dict[tuple, str | None] = {}
    bad = []
    for name in ir_utils.CHANNEL_OPS:
        for op in found[name]:
            op = op.operation
            if "channel_handle" not in op.attributes or hlo.ChannelHandle(op.attributes["channel_handle"]).handle < first_handle:
                continue
            ring = _groups(op, info)
            why = "its groups cannot be read" if ring is None else _placed(op, ring, variance, callers, checked, 0)
            if why:
                bad.append((op, why))
    return bad


def _placed(op: ir.Operation, ring: Ring, variance: Variance, callers: dict, checked: dict, depth: int) -> str | None:
    """Why ``op`` may run unlike on ``ring``'s groups, in its function or at a call of it (the
    answer is the same for every op of one block: the permutes of one ring share it)."""
    place = (op.parent, ring.groups)
    if place not in checked:
        checked[place] = None  # (a recursion meets this: judged at its other calls)
        checked[place] = variance.uniform_control(op, None, ring) or _called_alike(op, ring, variance, callers,
                                                                                   checked, depth)
    return checked[place]


def _called_alike(op: ir.Operation, ring: Ring, variance: Variance, callers: dict, checked: dict,
                  depth: int) -> str | None:
    """Why some call of ``op``'s function (a private one the pass made) may run unlike."""
    function = op.parent
    while function is not None and function.name != "func.func":
        function = function.parent
    name = ir_utils.symbol_name(function) if function is not None else None
    if name is None or not ir_utils.is_private(function):
        return None  # an entry point: every device runs it
    if depth > 16:
        return "it is called through more than 16 nested functions"
    key = (name, ring.groups)
    if key not in checked:
        checked[key] = None  # a recursion meets this: judged at its other calls
        checked[key] = next((f"at the call of @{name} at {ir_utils.render_location(call.location, '')}: {why}"
                             for call in callers.get(name, [])
                             if (why := _placed(call, ring, variance, callers, checked, depth + 1))), None)
    return checked[key]


def _groups(op: ir.Operation, info: ModuleInfo) -> Ring | None:
    """The groups of devices that run ``op`` together (None where they cannot be read)."""
    partitions = info.num_partitions or 0
    if op.name == "stablehlo.collective_permute":
        pairs = np.array(ir.DenseIntElementsAttr(op.attributes["source_target_pairs"])).reshape(-1, 2)
        return Ring(_cycles(pairs), partitions)
    try:
        groups = replica_groups(op.attributes["replica_groups"], info)
    except (Decline, KeyError):
        return None
    return Ring(tuple(tuple(int(p) for p in group if p >= 0) for group in np.asarray(groups)), partitions)


def _cycles(pairs: np.ndarray) -> tuple[tuple[int, ...], ...]:
    """The devices a permute connects, as groups: the connected parts of its source → target graph."""
    parent: dict[int, int] = {}

    def root(p: int) -> int:
        while parent.setdefault(p, p) != p:
            p = parent[p]
        return p

    for source, target in pairs.tolist():
        parent[root(source)] = root(target)
    groups: dict[int, list[int]] = {}
    for p in sorted(parent):
        groups.setdefault(root(p), []).append(p)
    return tuple(tuple(g) for g in groups.values())
