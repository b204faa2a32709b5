"""Device variance: which values are the same on every device of a ring's groups.

Inside a shard_map body every device runs the same program on its own data.  A value
is *identical across a group* when every device of the group holds the same array: a
constant; an argument of the ``sdy.manual_computation`` whose in-sharding names none of
the mesh axes along which the group's devices differ (JAX's ``vma`` type says the same
thing, seed 003); the result of an ``all_reduce`` or ``all_gather`` whose groups contain
the ring's; and any pure op computed only from such values.  Everything else — a value
read from ``partition_id``, a collective permute, a loop's carried values, an argument
sharded along the group's axes, anything the analysis cannot see into — may differ.

The answer is conservative: ``False`` means "not proven identical".  A rewrite that moves
work across devices (computing block ``k`` of a value on device ``k`` instead of every
block on every device: :mod:`cmatmul_pass.rewrites.sequence_parallel`) may only read,
besides the values it moves, values this analysis proves identical.
"""

from __future__ import annotations

import numpy as np

from .._jax_private import ir, sdy
from ..errors import Decline
from .dataflow import all_of, decide
from ..matchers.common import ModuleInfo, manual_computation_mesh, replica_groups
from ..ring import Ring

#: ops whose result depends on which device runs them, or that the analysis does not see into
DEVICE_DEPENDENT = frozenset({
    "stablehlo.partition_id", "stablehlo.replica_id", "stablehlo.collective_permute",
    "stablehlo.reduce_scatter", "stablehlo.all_to_all", "stablehlo.collective_broadcast",
    "stablehlo.rng", "stablehlo.rng_bit_generator", "stablehlo.custom_call", "stablehlo.infeed",
    "stablehlo.recv", "stablehlo.send", "stablehlo.while", "stablehlo.if", "stablehlo.case",
    "stablehlo.optimization_barrier", "func.call", "sdy.manual_computation",
})
#: ops with regions that only combine their operands' elements (a reduction's body)
PURE_REGION_OPS = frozenset({
    "stablehlo.reduce", "stablehlo.reduce_window", "stablehlo.sort", "stablehlo.map",
    "stablehlo.scatter", "stablehlo.select_and_scatter",
})
GROUP_COLLECTIVES = frozenset({"stablehlo.all_reduce", "stablehlo.all_gather"})


class Variance:
    """Answers :meth:`identical` for one module, remembering every answer until :meth:`forget`
    (values do not change while a rewrite asks; new values it builds are never asked about)."""

    def __init__(self, info: ModuleInfo):
        self.info = info
        self._memo: dict[tuple, dict[ir.Value, bool]] = {}  # per ring's groups: value -> identical
        self._axes: dict[tuple, frozenset[str] | None] = {}

    def forget(self) -> None:
        """Drop the answers about values (call it before the questions of a rewrite that follows
        another): the memo is by value, a value by its address, and an erased op's address may
        be a new op's, which would inherit the erased one's answer."""
        self._memo.clear()

    def identical(self, value: ir.Value, ring: Ring) -> bool:
        """Is ``value`` the same array on every device of each of ``ring``'s groups?"""
        memo = self._memo.setdefault(ring.groups, {})
        return decide(value, lambda v: self._step(v, ring, memo), memo)

    def _step(self, value: ir.Value, ring: Ring, memo: dict) -> tuple[list[ir.Value], bool]:
        """(operands still to decide, or [] and the answer)."""
        owner = value.owner
        if isinstance(owner, ir.Block):
            return self._argument(value, owner, ring, memo)
        name = owner.operation.name
        if name in DEVICE_DEPENDENT:
            return [], False
        if name in GROUP_COLLECTIVES and self._groups_contain(owner, ring):
            return [], True
        if name not in PURE_REGION_OPS and len(owner.operation.regions):
            return [], False
        return all_of(owner.operation.operands, memo)

    def _argument(self, value: ir.Value, block: ir.Block, ring: Ring, memo: dict) -> tuple[list[ir.Value], bool]:
        parent = block.owner
        if parent is None or parent.name != "sdy.manual_computation":
            return [], False  # a function's or a loop's argument: not known
        index = ir.BlockArgument(value).arg_number
        sharding = sdy.TensorShardingAttr(sdy.TensorShardingPerValueAttr(parent.attributes["in_shardings"]).shardings[index])
        if self._names_varying_axis(sharding, parent, ring):
            return [], False
        if _nested(parent):  # the value entering a nested region must itself be identical
            return all_of([parent.operands[index]], memo)
        return [], True

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


def _nested(op: ir.Operation) -> bool:
    parent = op.parent
    while parent is not None:
        if parent.name == "sdy.manual_computation":
            return True
        if parent.name == "func.func":
            return False
        parent = parent.parent
    return False
