"""Finders: walk a module, return typed match records (or declines with reasons).

Nothing here mutates IR.  Each ``find_*`` returns one record per candidate
collective: a ``*Match`` the rewriter can apply, or a :class:`DeclinedSite` saying
why the site stays as it is.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import ir_utils
from ._jax_private import hlo, ir, sdy
from .errors import Decline
from .ring import Ring, ring_from_replica_groups

ALL_GATHER_DOT = "all_gather_dot"


@dataclass(frozen=True)
class ModuleInfo:
    """Module-level facts every matcher needs.

    ``meshes``: Shardy mesh name -> {axis: size}.  ``partial_manual_funcs``: legacy
    ``@shmap_body``-style functions entered through ``SPMDFullToShardShape`` with a
    sharding other than ``{manual}`` (a partial-manual shard_map).
    """

    num_partitions: int | None
    num_replicas: int
    meshes: dict[str, dict[str, int]]
    partial_manual_funcs: frozenset[str]

    @classmethod
    def of(cls, module: ir.Module) -> "ModuleInfo":
        op = module.operation
        replicas = ir_utils.int_attr(op, "mhlo.num_replicas")
        return cls(
            ir_utils.int_attr(op, "mhlo.num_partitions"),
            1 if replicas is None else replicas,
            _meshes(module),
            _partial_manual_funcs(module),
        )


def _meshes(module: ir.Module) -> dict[str, dict[str, int]]:
    meshes = {}
    for op in module.body.operations:
        if op.operation.name == "sdy.mesh":
            axes = [sdy.MeshAxisAttr(a) for a in sdy.MeshAttr(op.attributes["mesh"]).axes]
            meshes[ir.StringAttr(op.attributes["sym_name"]).value] = {a.name: a.size for a in axes}
    return meshes


def _partial_manual_funcs(module: ir.Module) -> frozenset[str]:
    names = set()
    for op in ir_utils.walk(module.operation):
        if op.operation.name != "func.call":
            continue
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


def check_fully_manual(op: ir.OpView, info: ModuleInfo) -> None:
    """Decline sites in partial-manual shard_map regions.

    There XLA partitions the remaining mesh axes itself and rejects a bare
    ``partition_id`` ("ambiguous"), which the ring needs for its position.
    """
    manual: set[str] = set()
    mesh_name = None
    parent = op.operation.parent
    while parent is not None:
        if parent.name == "sdy.manual_computation":
            axes = sdy.ManualAxesAttr(parent.attributes["manual_axes"])
            manual.update(axes[i] for i in range(len(axes)))
            mesh_name = mesh_name or _manual_computation_mesh(parent)
        elif parent.name == "func.func":
            func_name = ir.StringAttr(parent.attributes["sym_name"]).value
            if func_name in info.partial_manual_funcs:
                raise Decline("partial_manual", f"the site is in a partial-manual shard_map body (@{func_name}); not rewritten yet")
        parent = parent.parent
    if mesh_name is None and len(info.meshes) == 1:
        mesh_name = next(iter(info.meshes))
    if not manual or mesh_name not in info.meshes:
        return
    free = [axis for axis, size in info.meshes[mesh_name].items() if size > 1 and axis not in manual]
    if free:
        raise Decline(
            "partial_manual",
            f"the site is in a shard_map region manual over {sorted(manual)} only; mesh axes {free} stay automatic "
            "and partition_id is ambiguous there; not rewritten yet",
        )


def _manual_computation_mesh(op: ir.Operation) -> str | None:
    for key in ("in_shardings", "out_shardings"):
        shardings = sdy.TensorShardingPerValueAttr(op.attributes[key]).shardings
        if len(shardings):
            ref = sdy.TensorShardingAttr(shardings[0]).mesh_or_ref
            try:
                return ir.FlatSymbolRefAttr(ref).value
            except ValueError:  # an inline mesh: no name to look up
                return None
    return None


@dataclass(frozen=True, eq=False)
class AllGatherDotMatch:
    """``all_gather(x) -> dot_general`` where the gathered dim is a free dim of the dot.

    ``operand_index`` says which dot operand is gathered (0: lhs, 1: rhs);
    ``result_dim`` is the dot result dimension the gathered dimension becomes.
    """

    all_gather: ir.OpView
    dot: ir.OpView
    operand_index: int
    gather_dim: int
    result_dim: int
    ring: Ring

    kind = ALL_GATHER_DOT

    @property
    def anchor(self) -> ir.OpView:
        return self.all_gather


@dataclass(frozen=True, eq=False)
class DeclinedSite:
    kind: str
    anchor: ir.OpView
    code: str
    message: str
    ring: Ring | None = None


Site = AllGatherDotMatch | DeclinedSite


def find_all_gather_dot(module: ir.Module, info: ModuleInfo | None = None) -> list[Site]:
    """Every ``stablehlo.all_gather`` in ``module`` (all functions, all nested regions).

    ``info`` is the module's :class:`ModuleInfo` when the caller already has it.
    """
    info = info or ModuleInfo.of(module)
    sites: list[Site] = []
    for op in ir_utils.walk(module.operation):
        if op.operation.name != "stablehlo.all_gather":
            continue
        ring = None
        try:
            ring = _all_gather_ring(op, info)
            sites.append(_match_all_gather_dot(op, ring))
        except Decline as d:
            sites.append(DeclinedSite(ALL_GATHER_DOT, op, d.code, d.message, ring))
    return sites


def _all_gather_ring(ag: ir.OpView, info: ModuleInfo) -> Ring:
    if len(ag.operation.operands) != 1:
        raise Decline("variadic", f"all_gather has {len(ag.operation.operands)} operands; only single-operand gathers are rewritten")
    check_partition_mode(ag, info)
    check_fully_manual(ag, info)
    return ring_from_replica_groups(ir_utils.dense_ints(ag.attributes["replica_groups"]), info.num_partitions)


def check_partition_mode(op: ir.OpView, info: ModuleInfo) -> None:
    """Accept only collectives whose groups are global partition ids of a 1-replica program."""
    if info.num_partitions is None:
        raise Decline("no_num_partitions", "the module has no mhlo.num_partitions attribute; the ring cannot be sized")
    if info.num_replicas != 1:
        raise Decline("replicas", f"the module has mhlo.num_replicas = {info.num_replicas}; only 1 replica is supported")
    attrs = op.attributes
    if "channel_handle" not in attrs or "use_global_device_ids" not in attrs:
        raise Decline(
            "cross_replica",
            "collective without channel_handle + use_global_device_ids groups replicas, not partitions",
        )


def _match_all_gather_dot(ag: ir.OpView, ring: Ring) -> AllGatherDotMatch:
    operand_t = ir_utils.ranked_tensor(ag.operation.operands[0])
    result_t = ir_utils.ranked_tensor(ag.result)
    if operand_t is None or result_t is None or not (ir_utils.is_static(operand_t) and ir_utils.is_static(result_t)):
        raise Decline("dynamic_shape", "all_gather on a dynamically shaped or unranked tensor")
    gather_dim = ir_utils.int_attr(ag, "all_gather_dim")
    if result_t.shape[gather_dim] != operand_t.shape[gather_dim] * ring.size:
        raise Decline("shape", f"gathered dim {gather_dim} is not {ring.size}x the shard's")

    users = ir_utils.users(ag.result)
    if not users:
        raise Decline("no_users", "the gathered value is unused")
    if len(users) > 1:
        names = ", ".join(u.operation.name for u in users)
        raise Decline("multiple_users", f"the gathered value has {len(users)} users ({names}); one dot_general is required")
    dot = users[0]
    if dot.operation.name != "stablehlo.dot_general":
        raise Decline("user_not_dot", f"the gathered value feeds {dot.operation.name}, not stablehlo.dot_general")
    operands = list(dot.operation.operands)
    sides = [i for i, v in enumerate(operands) if v == ag.result]
    if len(sides) != 1:
        raise Decline("both_operands", "the gathered value is both operands of the dot")
    if dot.operation.block != ag.operation.block:
        raise Decline("other_block", "the dot is in a different block from the all_gather")
    result_dim = gathered_result_dim(dot, sides[0], gather_dim)
    return AllGatherDotMatch(ag, dot, sides[0], gather_dim, result_dim, ring)


def gathered_result_dim(dot: ir.OpView, operand_index: int, dim: int) -> int:
    """The dot result dim that operand dim ``dim`` becomes, or Decline if it is not a free dim.

    dot_general orders its result as [batch..., lhs free..., rhs free...].
    """
    dnums = hlo.DotDimensionNumbers(dot.attributes["dot_dimension_numbers"])
    side = "lhs" if operand_index == 0 else "rhs"
    batch = list(getattr(dnums, f"{side}_batching_dimensions"))
    contracting = list(getattr(dnums, f"{side}_contracting_dimensions"))
    if dim in batch:
        raise Decline("batch_dim", f"the gathered dim {dim} is a batch dim of the dot's {side}")
    if dim in contracting:
        raise Decline(
            "contracting_dim",
            f"the gathered dim {dim} is contracted by the dot ({side}); contracting-dim gathers are not rewritten yet",
        )
    rank = ir_utils.ranked_tensor(dot.operation.operands[operand_index]).rank
    free = [d for d in range(rank) if d not in batch and d not in contracting]
    offset = len(batch)
    if operand_index == 1:
        lhs_rank = ir_utils.ranked_tensor(dot.operation.operands[0]).rank
        offset += lhs_rank - len(dnums.lhs_batching_dimensions) - len(dnums.lhs_contracting_dimensions)
    return offset + free.index(dim)
