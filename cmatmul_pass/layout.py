"""Look-through of layout ops between a collective and its dot.

A ring never materialises the gathered (or the unscattered) value: it works on one
ring block at a time.  Ops that only relabel or convert elements — ``convert``,
``transpose``, ``reshape``, ``sdy.sharding_constraint`` — may sit between the
collective and the dot; each is re-applied to one block, provided that the block of
its operand along the collective dimension is exactly a block of its result along
some dimension.  :func:`forward_dim` / :func:`backward_dim` find that dimension or
raise :class:`~cmatmul_pass.errors.Decline` (the site then stays as it is).

Rules (``n`` equal blocks):

* ``convert``, ``sdy.sharding_constraint``: the same dimension.
* ``transpose``: result dim ``j`` is operand dim ``permutation[j]``.
* ``reshape`` of shape ``S`` (block dim ``g``) into ``T``: block ``k`` of ``S`` along
  ``g`` is block ``k`` of ``T`` along ``t`` iff ``prod(S[:g]) == prod(T[:t])`` and
  ``n`` divides ``T[t]`` (row-major: both blocks are the same contiguous range of
  every outer row).  This covers ``tiled=False`` collectives, whose size-1 ring
  dimension is merged into or split from its neighbour.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from . import ir_utils
from ._jax_private import hlo, ir
from .errors import Decline

LAYOUT_OPS = frozenset({"stablehlo.convert", "stablehlo.transpose", "stablehlo.reshape", "sdy.sharding_constraint"})


def is_layout_op(op: ir.OpView) -> bool:
    return op.operation.name in LAYOUT_OPS


def short_name(op: ir.OpView) -> str:
    return op.operation.name.split(".", 1)[1]


def _shapes(op: ir.OpView) -> tuple[list[int], list[int]]:
    src = ir_utils.ranked_tensor(op.operation.operands[0])
    dst = ir_utils.ranked_tensor(op.result)
    if src is None or dst is None or not (ir_utils.is_static(src) and ir_utils.is_static(dst)):
        raise Decline("dynamic_shape", f"{op.operation.name} between the collective and the dot is dynamically shaped")
    return list(src.shape), list(dst.shape)


def _permutation(op: ir.OpView) -> list[int]:
    return list(ir.DenseI64ArrayAttr(op.attributes["permutation"]))


def _reshape_dim(src: list[int], dim: int, dst: list[int], parts: int) -> int | None:
    if src[dim] % parts:
        return None
    outer = math.prod(src[:dim])
    for t in range(len(dst)):
        if math.prod(dst[:t]) == outer and dst[t] % parts == 0 and dst[t] >= parts:
            return t
    return None


def forward_dim(op: ir.OpView, dim: int, parts: int) -> int:
    """The result dim whose ``parts`` blocks are the op applied to the operand's blocks along ``dim``."""
    return _map_dim(op, dim, parts, forward=True)


def backward_dim(op: ir.OpView, dim: int, parts: int) -> int:
    """The operand dim whose ``parts`` blocks the op maps onto the result's blocks along ``dim``."""
    return _map_dim(op, dim, parts, forward=False)


def _map_dim(op: ir.OpView, dim: int, parts: int, forward: bool) -> int:
    name = op.operation.name
    if name == "stablehlo.transpose":
        perm = _permutation(op)
        return perm.index(dim) if forward else perm[dim]
    if name == "stablehlo.reshape":
        src, dst = _shapes(op)
        found = _reshape_dim(src, dim, dst, parts) if forward else _reshape_dim(dst, dim, src, parts)
        if found is None:
            side = "operand" if forward else "result"
            raise Decline(
                "layout",
                f"reshape {src} -> {dst}: blocks of the ring dimension {dim} of its {side} are not blocks of "
                "one dimension on the other side",
            )
        return found
    return dim


@dataclass(eq=False)
class LayoutStep:
    """One layout op on the ring's path, with the ring dimension before (``in_dim``) and after (``out_dim``)."""

    op: ir.OpView
    in_dim: int
    out_dim: int

    @property
    def name(self) -> str:
        return short_name(self.op)

    def valid_for(self, parts: int) -> bool:
        """Do the same dims still map ``parts`` blocks (finer blocks, for split rings)?"""
        try:
            return forward_dim(self.op, self.in_dim, parts) == self.out_dim
        except Decline:
            return False

    def block_type(self, parts: int) -> ir.RankedTensorType:
        t = ir.RankedTensorType(self.op.result.type)
        return ir_utils.with_dim(t, self.out_dim, t.shape[self.out_dim] // parts)

    def apply(self, value: ir.Value, parts: int) -> ir.Value:
        """The op applied to one block ``value`` (built at the current insertion point, at the op's location)."""
        op, loc = self.op, self.op.location
        name = op.operation.name
        if name == "sdy.sharding_constraint":
            return value  # a hint about the whole value; the block needs none
        out_t = self.block_type(parts)
        if name == "stablehlo.convert":
            return hlo.ConvertOp(out_t, value, loc=loc).result
        if name == "stablehlo.transpose":
            return hlo.TransposeOp(value, _permutation(op), results=[out_t], loc=loc).result
        if name == "stablehlo.reshape":
            return hlo.ReshapeOp(out_t, value, loc=loc).result
        raise AssertionError(f"not a layout op: {name}")


def apply_path(path: tuple[LayoutStep, ...], value: ir.Value, parts: int) -> ir.Value:
    for step in path:
        value = step.apply(value, parts)
    return value
