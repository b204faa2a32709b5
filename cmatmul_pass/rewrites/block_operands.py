"""A side operand's block along a dim, recomputed from its producers rather than sliced from
the whole value: a causal or segment mask ``compare(q_pos, iota(S))`` becomes
``compare(q_pos, iota(S/n) + k·S/n)`` in block ``k``'s round, so the ring never holds the whole
``[S_local, S]`` mask (the original computes it fused into its consumer; computed once before a
ring and sliced there, it would be held whole).

The identities, for block ``K = [k·w, (k+1)·w)`` of dim ``d`` of each op's result:

* ``iota`` along ``d``: ``iota[K] = iota_w + k·w``; along another dim, ``iota`` at the block's shape;
* a pointwise op (its operands of its shape, or scalars): ``f(x, y)[K] = f(x[K], y[K])``;
* ``broadcast_in_dim`` of an operand whose dim ``d'`` maps to ``d`` at full size:
  ``broadcast(x)[K] = broadcast(x[K along d'])``; where none does (or it is of size 1), the
  broadcast of the whole operand at the block's shape;
* a splat constant: the splat at the block's shape;
* anything else (a gathered segment-id vector, an argument): sliced, ``x[K]``, at that value:
  a leaf, not the mask.
"""

from __future__ import annotations

from .. import ir_utils
from .._jax_private import ir
from ..analysis.separable import POINTWISE
from ..layout import block_of as layout_block
from .builders import Builder

#: values a block is recomputed through; anything else is sliced where it stands
_THROUGH = POINTWISE | {"stablehlo.broadcast_in_dim", "stablehlo.iota", "stablehlo.constant"}


def _splat(op: ir.OpView) -> bool:
    attr = op.operation.attributes["value"]
    return isinstance(attr, ir.DenseElementsAttr) and attr.is_splat


def _sliced(value: ir.Value) -> bool:
    """Is ``value`` a leaf, sliced where it stands rather than recomputed through its producer
    (an op not in ``_THROUGH``, a constant that is no splat, a pointwise op reading an operand of
    another rank that is no scalar)?"""
    op = ir_utils.producer(value)
    if op is None or op.operation.name not in _THROUGH or len(op.operation.results) != 1 or \
            op.operation.name == "stablehlo.constant" and not _splat(op):
        return True
    if op.operation.name in ("stablehlo.iota", "stablehlo.constant", "stablehlo.broadcast_in_dim"):
        return False
    rank = ir.RankedTensorType(value.type).rank
    return any(ir.RankedTensorType(v.type).rank not in (0, rank) for v in op.operation.operands)


def leaves(value: ir.Value, dim: int) -> set[ir.Value]:
    """The values :func:`block` slices to recompute ``value``'s block along ``dim`` (``value``
    itself where it is not recomputed)."""
    if _sliced(value):
        return {value}
    op = ir_utils.producer(value)
    name = op.operation.name
    if name in ("stablehlo.iota", "stablehlo.constant"):
        return set()
    if name == "stablehlo.broadcast_in_dim":
        mapped = _mapped(op, dim)
        return leaves(op.operation.operands[0], mapped) if mapped is not None else set()
    rank = ir.RankedTensorType(value.type).rank
    return set().union(*(leaves(v, dim) for v in op.operation.operands if ir.RankedTensorType(v.type).rank == rank))


def _mapped(op: ir.OpView, dim: int) -> int | None:
    """The operand dim a broadcast carries to ``dim`` at full size, or None (it spreads the operand along ``dim``)."""
    mapping = ir_utils.i64s(op, "broadcast_dimensions")
    if dim not in mapping:
        return None
    source = mapping.index(dim)
    full = ir.RankedTensorType(op.result.type).shape[dim]
    return source if ir.RankedTensorType(op.operation.operands[0].type).shape[source] == full else None


def block(value: ir.Value, dim: int, parts: int, start: ir.Value, b: Builder, memo: dict,
          resolve=None) -> ir.Value:
    """``value``'s block along ``dim`` (``1/parts`` of it, from index ``start``, a ui32 scalar),
    recomputed through its producers (module docstring), the leaves sliced; ``memo`` shares the
    values one round builds; ``resolve`` (if given) maps each value read whole or sliced to the
    one to read instead (a copy placed earlier)."""
    resolve = resolve or (lambda v: v)
    key = (value, dim)
    if key in memo:
        return memo[key]
    t = ir.RankedTensorType(value.type)
    width = t.shape[dim] // parts
    out_t = ir_utils.with_dim(t, dim, width)
    op = ir_utils.producer(value)
    if _sliced(value):
        made = b.dynamic_slice(resolve(value), dim, start, width)
    elif op.operation.name == "stablehlo.iota":
        made = b.create("stablehlo.iota", [out_t], [], {"iota_dimension": op.operation.attributes["iota_dimension"]}).result
        if ir_utils.int_attr(op, "iota_dimension") == dim:
            offset = b.convert(start, t.element_type)
            made = b.add(made, b.create("stablehlo.broadcast_in_dim", [out_t], [offset],
                                        {"broadcast_dimensions": ir.DenseI64ArrayAttr.get([])}).result)
    elif op.operation.name == "stablehlo.constant":
        made = layout_block(op, dim, parts, b.loc)
    elif op.operation.name == "stablehlo.broadcast_in_dim":
        source = op.operation.operands[0]
        mapped = _mapped(op, dim)
        inner = block(source, mapped, parts, start, b, memo, resolve) if mapped is not None else resolve(source)
        made = b.create("stablehlo.broadcast_in_dim", [out_t], [inner],
                        {"broadcast_dimensions": op.operation.attributes["broadcast_dimensions"]}).result
    else:  # pointwise: its operands' blocks first (built before it, in order)
        operands = [block(operand, dim, parts, start, b, memo, resolve)
                    if ir.RankedTensorType(operand.type).rank == t.rank else resolve(operand)
                    for operand in op.operation.operands]
        clone = op.operation.clone()
        for i, operand in enumerate(operands):
            clone.operands[i] = operand
        clone.results[0].set_type(out_t)
        made = clone.results[0]
    memo[key] = made
    return made
