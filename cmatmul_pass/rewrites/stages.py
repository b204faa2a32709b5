"""Collectives in two stages over two mesh axes, made into one the ring can take.

**Gathers merged**: a weight sharded over two mesh axes and gathered over one, then
the other, along the same dim.

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

from collections.abc import Callable

import numpy as np

from .. import ir_utils
from .._jax_private import hlo, ir
from ..errors import Decline
from ..matchers.common import DeclinedSite, ModuleInfo, replica_groups
from ..matchers.reduce_scatter import ReduceScatterSite, match_reduce_scatter, region_is_sum
from ..report import tensor_bytes
from .builders import zeros_attr
from .dot_all_reduce import sum_region

GATHER = "stablehlo.all_gather"
ALL_REDUCE = "stablehlo.all_reduce"


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


# ---- two-stage reductions: the scatter moved before the psum
#
# ``reduce_scatter(all_reduce(x, groups A), groups B)`` (``psum_scatter(psum(x, 'model'), 'data')``,
# as an FSDP x TP gradient lowers): device ``d`` gets block ``pos_B(d)`` of
# ``sum_{b in B(d)} sum_{a in A(b)} x_a``.  Scattered first, ``all_reduce(reduce_scatter(x, B), A)``
# gives ``d`` the sum over ``e in A(d)`` of block ``pos_B(e)`` of ``sum_{b in B(e)} x_b``.  The two
# agree when every ``e`` of ``A(d)`` holds the same position in its B-group as ``d`` (the block
# summed is one block) and ``A(d)``'s B-groups cover the devices ``B(d)``'s A-groups do, each as
# often: both hold for two mesh axes' groups, and :func:`commuting_groups` checks them device by
# device.  The scatter then reads the product, where a ring can take it with its dot, and the psum
# sums 1/|B| of the bytes it summed before.


def commuting_groups(a: np.ndarray, b: np.ndarray) -> str | None:
    """Why a sum over groups ``a`` followed by a scatter over groups ``b`` is not the scatter
    followed by the sum (None: it is)."""
    group_a = {int(d): [int(x) for x in row] for row in a for d in row}
    group_b = {int(d): [int(x) for x in row] for row in b for d in row}
    if set(group_a) != set(group_b):
        return "the psum's groups and the scatter's do not cover the same devices"
    for d in group_a:
        position = group_b[d].index(d)
        if any(group_b[e].index(e) != position for e in group_a[d]):
            return (f"device {d}'s psum group {group_a[d]} holds devices at other positions of their scatter groups, "
                    "so the psum would add different blocks")
        before = sorted(x for e in group_b[d] for x in group_a[e])
        after = sorted(x for e in group_a[d] for x in group_b[e])
        if before != after:
            return f"the two orders sum device {d}'s result over different devices"
    return None


#: ops between the psum and the scatter that the move carries along: the same permutation of
#: elements on every device, so they commute with a sum across devices
_CARRIED = frozenset({"stablehlo.reshape", "stablehlo.transpose"})


def swap_plan(rs: ir.OpView, info: ModuleInfo
              ) -> tuple[ir.OpView, list[ir.OpView], np.ndarray, np.ndarray] | str | None:
    """The psum a reduce_scatter ``rs`` may move before (the all_reduce it reads, through
    reshapes and transposes, each read only on the way), with those ops in program order and
    the psum's and the scatter's groups; why it may not; or None (``rs`` does not read a psum).
    Builds nothing."""
    chain: list[ir.OpView] = []
    owner = rs.operation.operands[0].owner
    while not isinstance(owner, ir.Block) and owner.operation.name in _CARRIED:
        if len(list(owner.operation.results[0].uses)) != 1:
            return None
        chain.insert(0, owner.operation.opview)
        owner = owner.operation.operands[0].owner
    if isinstance(owner, ir.Block) or owner.operation.name != ALL_REDUCE:
        return None
    ar = owner.operation.opview
    if len(ar.operation.operands) != 1 or not region_is_sum(ar) or not region_is_sum(rs):
        return None
    if len(list(ar.result.uses)) != 1:
        return "the psum's result is also read elsewhere, so it must stay whole"
    if any(op.operation.block != rs.operation.block for op in (ar, *chain)):
        return "the psum and the scatter are in different blocks"
    if any("use_global_device_ids" not in op.operation.attributes for op in (ar, rs)):
        return "a stage does not name its groups by global device ids"
    try:
        a = replica_groups(ar.attributes["replica_groups"], info)
        b = replica_groups(rs.attributes["replica_groups"], info)
    except Decline as declined:
        return declined.message
    why = commuting_groups(a, b)
    return why if why else (ar, chain, a, b)


class Swap:
    """``all_reduce(reduce_scatter(L(x)))`` built beside ``rs`` = ``reduce_scatter(L(all_reduce(x)))``
    (as :func:`swap_plan` found them; ``L``: its reshapes and transposes, cloned), each collective
    with its original's groups, channel handle and location.  Nothing reads the new pair yet,
    and ``ar`` reads a zero placeholder instead of ``x`` meanwhile, so that ``x``'s one reader is
    the moved chain, as it will be; then :meth:`keep` or :meth:`undo`."""

    def __init__(self, rs: ir.OpView, ar: ir.OpView, chain: list[ir.OpView]):
        self.rs, self.ar, self.chain = rs, ar, chain
        x = ar.operation.operands[0]
        dim = ir_utils.int_attr(rs.operation, "scatter_dimension")
        with ir.InsertionPoint(rs.operation):
            self.clones = ir_utils.clone_mapped(chain, {ar.result: x})
            read = self.clones[-1].results[0] if self.clones else x
            self.scatter = hlo.ReduceScatterOp(rs.result.type, read, dim, rs.attributes["replica_groups"],
                                               channel_handle=rs.attributes["channel_handle"],
                                               use_global_device_ids=True, loc=rs.location)
            sum_region(self.scatter, rs.location)
            self.psum = hlo.AllReduceOp([rs.result.type], [self.scatter.result], ar.attributes["replica_groups"],
                                        channel_handle=ar.attributes["channel_handle"],
                                        use_global_device_ids=True, loc=ar.location)
            sum_region(self.psum, ar.location)
        with ir.InsertionPoint(ar.operation):
            self.placeholder = hlo.ConstantOp(zeros_attr(ir.RankedTensorType(x.type)), loc=ar.location)
        self.x = x
        ar.operation.operands[0] = self.placeholder.result

    def redirect(self) -> None:
        """``rs``'s readers read the moved pair's psum (as they will if it is kept)."""
        self.rs.result.replace_all_uses_with(self.psum.result)

    def keep(self) -> None:
        """The moved pair stays (holding the original's channel handles): the original goes."""
        for op in [self.rs, *reversed(self.chain), self.ar, self.placeholder]:
            op.operation.erase()

    def undo(self) -> None:
        """Put the module back as it was: ``rs``'s readers read it again, ``ar`` reads ``x``,
        and the moved ops and the placeholder are erased."""
        self.psum.result.replace_all_uses_with(self.rs.result)
        self.ar.operation.operands[0] = self.x
        for op in [self.psum, self.scatter, *reversed(self.clones), self.placeholder]:
            op.operation.erase()


def swap_reductions(scatters: list, all_reduces: list, info: ModuleInfo, source: str | None,
                    ring: Callable[[ReduceScatterSite, str], str | None]) -> dict[int, str]:
    """Move each scatter of ``scatters`` that reads a psum before it, where the two commute and
    the moved scatter's ring is built: ``ring(site, note)`` rewrites the moved scatter's site
    (reporting it with ``note``), and returns None, or why it did not.  Where it did not, or
    the moved scatter is no dot → reduce_scatter site at all, the module is put back as it was.
    The lists lose the moved pairs (their sites are done); returns why each other scatter of a
    psum was not moved (by id: the scatter's own site is then matched as it stands)."""
    kept: dict[int, str] = {}
    for rs in list(scatters):
        planned = swap_plan(rs, info)
        if planned is None:
            continue
        if isinstance(planned, str):
            kept[id(rs)] = planned
            continue
        ar, chain, groups, scatter_groups = planned
        moved = Swap(rs, ar, chain)
        site = match_reduce_scatter(moved.scatter, info)
        if isinstance(site, DeclinedSite):
            moved.undo()  # no ring for the product either way: the program stays as written
            continue
        where = ir_utils.render_location(ar.location, source)
        groups, parts = groups.tolist(), len(scatter_groups[0])
        before, after = tensor_bytes(ar.result.type), tensor_bytes(rs.result.type)
        note = (f"moved before the psum at {where} (over {groups}): a sum over one set of devices and a scatter over "
                f"another commute, so this scatter takes the product and the psum then sums this device's 1/{parts} "
                f"of it ({after} B instead of {before} B per device)")
        moved.redirect()
        why = ring(site, note)
        if why is None:
            all_reduces[:] = [op for op in all_reduces if op.operation != ar.operation]
            scatters[:] = [op for op in scatters if op.operation != rs.operation]
            moved.keep()
        else:
            moved.undo()
            kept[id(rs)] = f"its ring there would not be built either: {why}"
    return kept
