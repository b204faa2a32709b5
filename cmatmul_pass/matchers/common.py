"""What every matcher shares: module facts, partition-mode and manual-region checks, declines."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .. import ir_utils
from .._jax_private import hlo, ir, sdy
from ..errors import Decline
from ..ring import Ring, groups_from_mesh_axes, ring_from_replica_groups


@dataclass(frozen=True)
class ModuleInfo:
    """Module-level facts every matcher needs.

    ``meshes``: Shardy mesh name -> {axis: size} (axes in mesh order); ``mesh_device_ids``:
    mesh name -> explicit device ids (empty for the default iota order).
    ``stablehlo_meshes``: the same meshes as their ``stablehlo.mesh`` attribute states them (what
    XLA reads for groups named by mesh axes), None where the attribute is missing or says more
    than the axes.  ``partial_manual_funcs``: legacy ``@shmap_body``-style functions entered through
    ``SPMDFullToShardShape`` with a sharding other than ``{manual}`` (a partial-manual
    shard_map).
    """

    num_partitions: int | None
    num_replicas: int
    meshes: dict[str, dict[str, int]]
    mesh_device_ids: dict[str, list[int]]
    partial_manual_funcs: frozenset[str]
    stablehlo_meshes: dict[str, dict[str, int] | None] = field(default_factory=dict)
    #: an op's parent op -> (manual axes, mesh name, legacy partial-manual func) of the regions
    #: around it: walked once per parent, not per site
    regions: dict = field(default_factory=dict, compare=False, repr=False)
    #: replica_groups attribute -> its Ring, or the Decline it raised: built once per distinct groups
    rings: dict = field(default_factory=dict, compare=False, repr=False)
    #: (dot_dimension_numbers, lhs type, rhs type) -> its DotDims: read once
    dot_numbers: dict = field(default_factory=dict, compare=False, repr=False)
    #: a function's name -> the ``func.call`` ops calling it (a site in a function called from a
    #: shard_map region is in that region)
    callers: dict = field(default_factory=dict, compare=False, repr=False)
    #: all_gather operations the pass leaves plain (prefetched) so that a scatter of their dot's
    #: product over other device groups gets the ring: a scatter's dot may read them whole
    plain_gathers: set = field(default_factory=set, compare=False, repr=False)

    @classmethod
    def of(cls, module: ir.Module, calls: list[ir.OpView] | None = None) -> "ModuleInfo":
        """``calls``: the module's ``func.call`` ops, when the caller has walked it already."""
        op = module.operation
        replicas = ir_utils.int_attr(op, "mhlo.num_replicas")
        meshes, device_ids, stablehlo_meshes = _meshes(module)
        calls = ir_utils.ops_named(module, "func.call")["func.call"] if calls is None else calls
        callers: dict[str, list[ir.Operation]] = {}
        for call in calls:
            callers.setdefault(ir.FlatSymbolRefAttr(call.attributes["callee"]).value, []).append(call.operation)
        return cls(
            ir_utils.int_attr(op, "mhlo.num_partitions"),
            1 if replicas is None else replicas,
            meshes,
            device_ids,
            _partial_manual_funcs(calls),
            stablehlo_meshes,
            callers=callers,
        )


def _meshes(module: ir.Module) -> tuple[dict, dict, dict]:
    meshes, device_ids, stablehlo_meshes = {}, {}, {}
    for op in module.body.operations:
        if op.operation.name == "sdy.mesh":
            mesh = sdy.MeshAttr(op.attributes["mesh"])
            name = ir.StringAttr(op.attributes["sym_name"]).value
            meshes[name] = {a.name: a.size for a in (sdy.MeshAxisAttr(x) for x in mesh.axes)}
            device_ids[name] = list(mesh.device_ids)
            stablehlo_meshes[name] = _stablehlo_mesh(op)
    return meshes, device_ids, stablehlo_meshes


def _stablehlo_mesh(op: ir.OpView) -> dict[str, int] | None:
    """``{stablehlo.mesh = {axes = [{name, size}, ...]}}`` of an sdy.mesh op, as {axis: size}."""
    if "stablehlo.mesh" not in op.attributes:
        return None
    try:
        stated = ir.DictAttr(op.attributes["stablehlo.mesh"])
        if len(stated) != 1 or "axes" not in stated:
            return None  # device ids or anything else: not read here
        axes = [ir.DictAttr(a) for a in ir.ArrayAttr(stated["axes"])]
        return {ir.StringAttr(a["name"]).value: ir.IntegerAttr(a["size"]).value for a in axes}
    except (ValueError, KeyError):
        return None


def _partial_manual_funcs(calls: list[ir.OpView]) -> frozenset[str]:
    names = set()
    for op in calls:
        for operand in op.operation.operands:
            producer = operand.owner
            if (
                isinstance(producer, ir.Operation | ir.OpView)
                and producer.name == "stablehlo.custom_call"
                and ir.StringAttr(producer.attributes["call_target_name"]).value == "SPMDFullToShardShape"
                and "mhlo.sharding" in producer.attributes
                and ir.StringAttr(producer.attributes["mhlo.sharding"]).value != "{manual}"
            ):
                names.add(ir.FlatSymbolRefAttr(op.attributes["callee"]).value)
    return frozenset(names)


@dataclass(frozen=True)
class ManualRegion:
    """Where a site sits.  ``free_axes`` are mesh axes the enclosing shard_map leaves automatic
    (a partial-manual region): there ``partition_id`` is only legal inside a nested
    ``sdy.manual_computation`` over those axes, which is where the ring reads its position."""

    mesh: str | None = None
    free_axes: tuple[str, ...] = ()


FULLY_MANUAL = ManualRegion()


@dataclass(frozen=True, eq=False)
class DeclinedSite:
    kind: str
    anchor: ir.OpView
    code: str
    message: str
    ring: Ring | None = None


def collective_ring(op: ir.OpView, info: ModuleInfo) -> tuple[Ring, ManualRegion]:
    """The ring of a single-operand collective in partition mode, and its manual region; or Decline."""
    if len(op.operation.operands) != 1:
        raise Decline(
            "variadic",
            f"{op.operation.name} has {len(op.operation.operands)} operands; only single-operand collectives are rewritten",
        )
    check_partition_mode(op, info)
    groups = op.attributes["replica_groups"]
    ring = info.rings.get(groups)
    if ring is None:
        try:
            ring = ring_from_replica_groups(replica_groups(groups, info), info.num_partitions)
        except Decline as declined:
            ring = declined
        info.rings[groups] = ring
    if isinstance(ring, Decline):
        raise Decline(ring.code, ring.message)
    return ring, manual_region(op, info, ring)


def replica_groups(attr: ir.Attribute, info: ModuleInfo) -> np.ndarray:
    """A collective's groups as an int array: from a dense list (jax <= 0.10), or from
    ``#stablehlo.replica_group_mesh_axes`` (mesh axes of an ``sdy.mesh``; jax >= 0.11)."""
    if hlo.ReplicaGroupMeshAxesAttr.isinstance(attr):
        by_axes = hlo.ReplicaGroupMeshAxesAttr(attr)
        name = ir.FlatSymbolRefAttr(by_axes.mesh).value
        if name not in info.meshes:
            raise Decline("replica_groups", f"the replica groups name mesh @{name}, which is not an sdy.mesh of the module")
        if info.stablehlo_meshes.get(name) != info.meshes[name] or info.mesh_device_ids.get(name):
            raise Decline(
                "replica_groups",
                f"the replica groups name mesh @{name}, whose stablehlo.mesh attribute is missing, lists device ids "
                "or differs from the sdy.mesh: not the mesh XLA would read",
            )
        names = list(info.meshes[name])
        refs = []
        for ref in (hlo.AxisRefAttr(a) for a in by_axes.axes):
            if ref.name not in names:
                raise Decline("replica_groups", f"the replica groups name axis {ref.name!r}, which mesh @{name} lacks")
            axis = names.index(ref.name)
            if ref.sub_axis_info is None:
                refs.append((axis, 1, info.meshes[name][ref.name]))
            else:
                sub = hlo.SubAxisInfoAttr(ref.sub_axis_info)
                refs.append((axis, sub.pre_size, sub.size))
        return groups_from_mesh_axes(list(info.meshes[name].values()), [], refs)
    try:
        return ir_utils.dense_ints(attr)
    except ValueError:
        raise Decline("replica_groups", f"replica_groups {attr} are in a form the pass does not read") from None


def check_partition_mode(op: ir.OpView, info: ModuleInfo) -> None:
    """Accept only collectives whose groups are global partition ids of a 1-replica program."""
    if info.num_partitions is None:
        raise Decline("no_num_partitions", "the module has no mhlo.num_partitions attribute; the ring cannot be sized")
    if info.num_replicas != 1:
        raise Decline("replicas", f"the module has mhlo.num_replicas = {info.num_replicas}; only 1 replica is supported")
    attrs = op.attributes
    # an all_to_all has no use_global_device_ids: with a channel its groups are partition ids
    # (XLA's cross-partition mode), as jax lowers it inside shard_map
    global_ids = "use_global_device_ids" in attrs or op.operation.name == "stablehlo.all_to_all"
    if "channel_handle" not in attrs or not global_ids:
        raise Decline(
            "cross_replica",
            "collective without channel_handle + use_global_device_ids groups replicas, not partitions",
        )


def manual_region(op: ir.OpView, info: ModuleInfo, ring: Ring) -> ManualRegion:
    """The site's region; Decline where the ring position cannot be read legally.

    In a Shardy partial-manual region the position is read inside a nested
    ``sdy.manual_computation`` over the free axes (as ``lax.axis_index`` does) and
    declared replicated over them, so it must not vary along a free axis: checked
    against the mesh.  Legacy partial-manual bodies are declined (XLA's SPMD
    partitioner has no such escape there).
    """
    manual, mesh_name, legacy = _enclosing(op.operation.parent, info)
    if manual is None:
        raise Decline("partial_manual", f"the site is in a function called from regions manual over different "
                                        f"mesh axes ({mesh_name}): one ring cannot read its position in all of them")
    if legacy:
        raise Decline(
            "partial_manual",
            f"the site is in a partial-manual shard_map body (@{legacy}) of the legacy partitioner, "
            "where partition_id is ambiguous; lower with Shardy (the default) to have it rewritten",
        )
    if not manual:
        return FULLY_MANUAL
    if mesh_name is None and len(info.meshes) == 1:
        mesh_name = next(iter(info.meshes))
    if mesh_name not in info.meshes:
        raise Decline("partial_manual", "the shard_map region's mesh is not a named sdy.mesh of the module")
    axes = info.meshes[mesh_name]
    free = tuple(axis for axis, size in axes.items() if size > 1 and axis not in manual)
    if not free:
        return FULLY_MANUAL
    ids = info.mesh_device_ids.get(mesh_name) or []
    sizes = list(axes.values())
    if (ids and ids != list(range(len(ids)))) or int(np.prod(sizes)) != ring.num_partitions:
        raise Decline(
            "partial_manual",
            f"partial-manual region over mesh @{mesh_name} with explicit device ids: the ring position cannot "
            "be proven replicated over the free axes",
        )
    table = ring.position_table().reshape(sizes)
    names = list(axes)
    for axis in free:
        along = names.index(axis)
        if not (table == np.take(table, [0], axis=along)).all():
            raise Decline(
                "partial_manual",
                f"the collective's groups mix positions along the automatic mesh axis {axis!r}",
            )
    return ManualRegion(mesh_name, free)


def _enclosing(parent: ir.Operation | None, info: ModuleInfo,
               depth: int = 0) -> tuple[frozenset[str] | None, str | None, str | None]:
    """(manual axes, mesh name, legacy partial-manual function name or None) of the regions
    around an op whose parent is ``parent``; walked once per parent op.  A private function's
    regions are those around its calls (a nested ``jax.jit`` inside a shard_map): where its
    calls sit in regions manual over different axes, the axes are None (and the mesh names
    them)."""
    if parent in info.regions:
        return info.regions[parent]
    manual: set[str] = set()
    mesh_name = legacy = None
    walk = parent
    while walk is not None:
        if walk.name == "sdy.manual_computation":
            axes = sdy.ManualAxesAttr(walk.attributes["manual_axes"])
            manual.update(axes[i] for i in range(len(axes)))
            mesh_name = mesh_name or manual_computation_mesh(walk)
        elif walk.name == "func.func":
            func_name = ir.StringAttr(walk.attributes["sym_name"]).value
            if func_name in info.partial_manual_funcs and legacy is None:
                legacy = func_name
            calls = info.callers.get(func_name, [])
            if calls and ir_utils.is_private(walk) and depth < 16:
                around = {_enclosing(call.parent, info, depth + 1) for call in calls}
                if len(around) > 1:
                    found = info.regions[parent] = None, ", ".join(sorted(
                        "{" + ", ".join(sorted(axes)) + "}" if axes is not None else "mixed" for axes, _, _ in around)), None
                    return found
                (outer, outer_mesh, outer_legacy), = around
                if outer is None:
                    info.regions[parent] = outer, outer_mesh, None
                    return info.regions[parent]
                manual.update(outer)
                mesh_name = mesh_name or outer_mesh
                legacy = legacy or outer_legacy
            break
        walk = walk.parent
    info.regions[parent] = frozenset(manual), mesh_name, legacy
    return info.regions[parent]


def manual_computation_mesh(op: ir.Operation) -> str | None:
    for key in ("in_shardings", "out_shardings"):
        shardings = sdy.TensorShardingPerValueAttr(op.attributes[key]).shardings
        if len(shardings):
            ref = sdy.TensorShardingAttr(shardings[0]).mesh_or_ref
            try:
                return ir.FlatSymbolRefAttr(ref).value
            except ValueError:  # an inline mesh: no name to look up
                return None
    return None


def is_dot(op: ir.OpView | ir.Operation) -> bool:
    """A matmul a ring can split: a ``dot_general``, or a grouped matmul (``ragged_dot``'s
    composite, :class:`DotDims`)."""
    operation = op.operation if isinstance(op, ir.OpView) else op
    return operation.name == "stablehlo.dot_general" or ir_utils.is_grouped_dot(operation)


def static_tensor(value: ir.Value, what: str) -> ir.RankedTensorType:
    t = ir_utils.ranked_tensor(value)
    if t is None or not ir_utils.is_static(t):
        raise Decline("dynamic_shape", f"{what} is a dynamically shaped or unranked tensor")
    return t


@dataclass(frozen=True)
class DotDims:
    """A dot_general's dimension numbers, read once: (batch, contracting) per operand and the ranks.

    A grouped matmul (``ir_utils.is_grouped_dot``) also has ``ragged``, the lhs dim whose rows
    the group sizes assign to groups in order, in one of two forms: ragged rows against one rhs
    matrix per group (``ragged_dot``: ``group`` is the rhs's group dim, which the result does not
    have), or ragged rows contracted group by group (``ragged_dot``'s weight gradient: the result
    leads with one matrix per group, ``leading`` = 1)."""

    batch: tuple[tuple[int, ...], tuple[int, ...]]
    contracting: tuple[tuple[int, ...], tuple[int, ...]]
    ranks: tuple[int, int]
    ragged: tuple[int, ...] = ()
    group: tuple[int, ...] = ()
    leading: int = 0

    @classmethod
    def of(cls, dot: ir.OpView, info: ModuleInfo | None = None) -> "DotDims":
        """Declines a dot whose operands are not statically shaped tensors, and a grouped matmul
        other than one whose ragged dim is an lhs row dim (the form ``jax.lax.ragged_dot`` and
        an MoE block's expert matmuls take).  ``info`` caches them per distinct attribute and
        operand types (the matchers read many dots)."""
        op = dot.operation
        grouped = ir_utils.is_grouped_dot(op)
        attr = ir_utils.grouped_numbers_attr(op) if grouped else op.attributes["dot_dimension_numbers"]
        lhs, rhs = op.operands[0], op.operands[1]
        key = (attr, lhs.type, rhs.type)  # (uniqued: equal exactly when the same objects)
        found = info.dot_numbers.get(key) if info is not None else None
        if found is not None:
            return found
        lhs_t, rhs_t = (static_tensor(v, "a dot operand") for v in (lhs, rhs))
        if grouped:
            found = cls._grouped(dot, lhs_t.rank, rhs_t.rank)
        else:
            d = hlo.DotDimensionNumbers(attr)
            found = cls((tuple(d.lhs_batching_dimensions), tuple(d.rhs_batching_dimensions)),
                        (tuple(d.lhs_contracting_dimensions), tuple(d.rhs_contracting_dimensions)),
                        (lhs_t.rank, rhs_t.rank))
        if info is not None:  # (a dynamic shape declined above: never kept)
            info.dot_numbers[key] = found
        return found

    @classmethod
    def _grouped(cls, dot: ir.OpView, lhs_rank: int, rhs_rank: int) -> "DotDims":
        numbers = ir_utils.ragged_numbers(dot)
        if numbers is None:
            raise Decline("ragged_dot", f"{describe_op(dot)}: a grouped matmul whose dimension numbers the pass "
                                        "cannot read")
        lhs_batch, rhs_batch, lhs_contracting, rhs_contracting, ragged, group = numbers
        contracted = len(ragged) == 1 and ragged[0] in lhs_contracting and not group
        if len(ragged) != 1 or ragged[0] in lhs_batch or not (contracted or len(group) == 1) or lhs_batch:
            raise Decline("ragged_dot", f"{describe_op(dot)}: a grouped matmul with batch dims or ragged along a "
                                        "batch dim, which the pass does not rewrite")
        return cls((lhs_batch, rhs_batch), (lhs_contracting, rhs_contracting), (lhs_rank, rhs_rank), ragged, group,
                   1 if contracted else 0)

    def free(self, operand_index: int) -> list[int]:
        batch, contracting = self.batch[operand_index], self.contracting[operand_index]
        group = self.group if operand_index == 1 else ()
        return [d for d in range(self.ranks[operand_index]) if d not in batch and d not in contracting
                and d not in group]

    def grouped_by(self, operand_index: int, dim: int) -> tuple[str, str] | None:
        """(which dim, why) a grouped matmul's ``dim`` of an operand cannot be cut into blocks, or None: the
        ragged rows belong to groups by their position, the group dim picks each row's matrix."""
        if operand_index == 0 and dim in self.ragged or operand_index == 1 and self.leading and dim in self.contracting[1]:
            return "ragged row dim", "the group sizes give each group its rows by position, which a block of rows cannot know"
        if operand_index == 1 and dim in self.group:
            return "group dim", "each block of groups would need its own group sizes and rows"
        if self.group and dim in self.batch[operand_index]:
            return "batch dim", "its group sizes are per batch element"
        return None

    def grouped_decline(self, operand_index: int, dim: int, what: str, dot: ir.OpView) -> None:
        """Decline (``ragged_dot``) a ring of a grouped matmul's ``dim`` :meth:`grouped_by` names;
        ``what``: the ring's dim, in words ("the gathered dim")."""
        found = self.grouped_by(operand_index, dim)
        if found is not None:
            raise Decline("ragged_dot", f"{what} is the {found[0]} of {describe_op(dot)}, a grouped matmul "
                                        f"({found[1]}): its ring goes along a free or contracting dim")

    def free_result_offset(self, operand_index: int) -> int:
        """Where an operand's free dims start in the dot result ([groups, batch..., lhs free..., rhs free...])."""
        offset = self.leading + len(self.batch[0])
        if operand_index == 1:
            offset += len(self.free(0))
        return offset

    def result_dim_source(self, result_dim: int) -> tuple[str, int, int]:
        """Which operand dim a dot result dim comes from: ``(role, operand_index, operand_dim)``.

        ``role`` is ``"batch"`` (then ``operand_index`` is 0, the lhs) or ``"free"``; a grouped
        matmul's leading group dim: ``("group", 0, ragged dim)`` (:meth:`grouped_by` declines it).
        """
        if result_dim < self.leading:
            return "group", 0, self.ragged[0]
        result_dim -= self.leading
        batch = self.batch[0]
        if result_dim < len(batch):
            return "batch", 0, batch[result_dim]
        lhs_free = self.free(0)
        k = result_dim - len(batch)
        if k < len(lhs_free):
            return "free", 0, lhs_free[k]
        return "free", 1, self.free(1)[k - len(lhs_free)]


def describe_op(op: ir.OpView, source: str | None = None) -> str:
    return f"{op.operation.name} at {ir_utils.render_location(op.location, source)}"
