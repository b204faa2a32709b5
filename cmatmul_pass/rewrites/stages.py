"""Two-stage gathers merged into one: a weight sharded over two mesh axes and gathered over one,
then the other, along the same dim (issue 31, item 4).

``all_gather(all_gather(w, groups A, dim d), groups B, dim d)``: the outer gather on device
``o_b`` (position ``b`` of its B-group) contributes block ``b``, which is the inner gather there:
the shards of ``o_b``'s A-group, in that group's order.  So the pair is one gather over the
groups ``concat_b A-group(o_b)``, provided every device of such a group computes the same list
(as mesh axes' groups do).  As one gather it becomes one ring over all those devices, which hides
both stages' transfers behind the dot, instead of a ring for the second stage with the first
stage's transfer exposed ahead of it.  Whether that pays is the cost model's call
(:func:`.cost.predict_two_stage`, made by the pipeline): :func:`plan` only checks that the pair is
one gather, :func:`build` writes it.
"""

from __future__ import annotations

import numpy as np

from .. import ir_utils
from .._jax_private import hlo, ir
from ..errors import Decline
from ..matchers.common import ModuleInfo, replica_groups

GATHER = "stablehlo.all_gather"


def merged_groups(inner: ir.OpView, outer: ir.OpView, info: ModuleInfo) -> np.ndarray | str:
    """The groups of the one gather the pair is, or why there is none."""
    try:
        a = replica_groups(inner.attributes["replica_groups"], info)
        b = replica_groups(outer.attributes["replica_groups"], info)
    except Decline as declined:
        return declined.message
    group_of = {int(d): [int(x) for x in row] for row in a for d in row}
    combined: dict[frozenset, list[int]] = {}
    for row in b:
        if any(int(d) not in group_of for d in row):
            return "a device of the second stage's groups is in none of the first's"
        devices = [x for d in row for x in group_of[int(d)]]
        key = frozenset(devices)
        if len(key) != len(devices):
            return "the two stages' groups overlap: not one gather over both"
        if combined.setdefault(key, devices) != devices:
            return "the devices of one merged group would order their blocks differently"
    rows = list(combined.values())
    if len({d for row in rows for d in row}) != sum(len(row) for row in rows):
        return "the merged groups overlap"
    return np.array(rows, dtype=np.int64)


def plan(inner: ir.OpView, info: ModuleInfo) -> tuple[ir.OpView, np.ndarray] | str | None:
    """Whether ``inner`` (a first stage: a gather whose one reader is a second gather) and that
    second gather are one gather: (the second gather, the merged groups), why not, or None
    (``inner`` is not such a first stage).  Builds nothing."""
    uses = list(inner.result.uses)
    if len(uses) != 1 or uses[0].owner.operation.name != GATHER:
        return None
    outer = uses[0].owner.operation.opview
    dim = ir_utils.int_attr(inner.operation, "all_gather_dim")
    other = ir_utils.int_attr(outer.operation, "all_gather_dim")
    if other != dim:
        return (f"the two stages gather along different dims (this one dim {dim}, the second dim {other}); they "
                "would merge if both gathered along one dim: the weight sharded over both mesh axes along that dim "
                "(a PartitionSpec such as P(None, ('model', 'data'))) and gathered over one axis, then the other, "
                "along it, or over both at once (jax.lax.all_gather(w, ('model', 'data'), axis=..., tiled=True))")
    if outer.operation.block != inner.operation.block:
        return "the two stages are in different blocks"
    flags = ["use_global_device_ids" in op.operation.attributes for op in (inner, outer)]
    if flags != [True, True]:
        return "a stage does not name its groups by global device ids"
    groups = merged_groups(inner, outer, info)
    if isinstance(groups, str):
        return groups
    return outer, groups


def build(inner: ir.OpView, outer: ir.OpView, groups: np.ndarray, take_channel) -> ir.OpView:
    """The one gather over ``groups`` that ``inner`` and ``outer`` (as :func:`plan` found them)
    are, reading what ``inner`` reads, in ``outer``'s place: ``outer`` is left unread (the caller
    erases it and then ``inner``)."""
    dim = ir_utils.int_attr(inner.operation, "all_gather_dim")
    with ir.InsertionPoint(outer.operation):
        merged = hlo.AllGatherOp([outer.result.type], [inner.operation.operands[0]], dim,
                                 ir.DenseElementsAttr.get(groups),
                                 channel_handle=hlo.ChannelHandle.get(take_channel(), 1),
                                 use_global_device_ids=True, loc=outer.location)
    outer.result.replace_all_uses_with(merged.results[0])
    return merged


def merge(inner: ir.OpView, info: ModuleInfo, take_channel) -> tuple[ir.OpView, ir.OpView] | str | None:
    """:func:`plan`, then :func:`build`: (the new gather, the second gather, now unread), why
    not, or None (``inner`` is not a first stage)."""
    planned = plan(inner, info)
    if planned is None or isinstance(planned, str):
        return planned
    outer, groups = planned
    return build(inner, outer, groups, take_channel), outer
