"""A grouped matmul's block in a ring (``jax.lax.ragged_dot``: ``chlo.ragged_dot`` lowered for GPU
and TPU, which ``jax.export`` writes as ``stablehlo.composite "chlo.ragged_dot"``).

A ring computes a grouped matmul block by block as a grouped matmul of blocks, with the same
group sizes, along any dim but the lhs's ragged rows and the rhs's groups
(``DotDims.grouped_by`` declines those):

* a block of the rhs's free dim: ``ragged_dot(x, w[..., b]) = ragged_dot(x, w)[..., b]`` (each
  output column reads one column of its group's matrix);
* a block of an lhs free dim other than the ragged one: the rows of that block, grouped alike;
* a block of the contracting dim: a partial sum, ``ragged_dot(x, w) = sum_b ragged_dot(x[.., b],
  w[:, b, ..])`` (linear in the contracted dim, for every row's group).

The block is a ``chlo.ragged_dot`` with the template's attributes, or a composite with the
template's name, attributes and version whose ``decomposition`` (what a backend without a
grouped matmul runs: XLA:CPU, where ``check`` runs it) pads the blocks with zeros at their high
end to the template's operand shapes, calls the template's decomposition and slices the block's
result from the low corner: zero columns and rows give only the result columns and rows sliced
away, and zero products in a contracted dim add nothing. Where the ring asks for a wider result
type than the template's (a partial sum accumulated in f32), the block's result is converted to it.
"""

from __future__ import annotations

from .. import ir_utils
from .._jax_private import ir
from .builders import TRANSIENT_MARK_PREFIX, zeros_attr


def grouped_dot(template: ir.OpView, result_type: ir.Type, lhs: ir.Value, rhs: ir.Value,
                loc: ir.Location, sizes: tuple[ir.Value, ...] = ()) -> ir.Value:
    """At the current insertion point: ``template``'s grouped matmul of the blocks ``lhs`` and
    ``rhs`` with group sizes ``sizes`` (none given: the template's), of ``result_type``."""
    op = template.operation
    attributes = {name: value for name, value in op.attributes.items() if not name.startswith(TRANSIENT_MARK_PREFIX)}
    if op.name == "stablehlo.composite":
        decomposition = _block_decomposition(op, lhs.type, rhs.type, result_type)
        attributes["decomposition"] = ir.FlatSymbolRefAttr.get(decomposition)
    return ir.Operation.create(op.name, results=[result_type], operands=[lhs, rhs, *(sizes or list(op.operands)[2:])],
                               attributes=attributes, loc=loc).result


def _block_decomposition(op: ir.Operation, lhs_type: ir.Type, rhs_type: ir.Type, result_type: ir.Type) -> str:
    """The name of a private function computing ``op``'s grouped matmul on blocks of these types
    (made once per module and types): the template's own where the types are its own."""
    original = ir.FlatSymbolRefAttr(op.attributes["decomposition"]).value
    full = [v.type for v in op.operands]
    full_result = op.results[0].type
    if [lhs_type, rhs_type, result_type] == [full[0], full[1], full_result]:
        return original
    shapes = "_".join("x".join(map(str, ir.RankedTensorType(t).shape)) for t in (lhs_type, rhs_type))
    name = f"{original}.cmatmul_block_{shapes}"
    module = op.parent
    while module.name != "builtin.module":
        module = module.parent
    body = module.regions[0].blocks[0]
    if any(ir_utils.symbol_name(f) == name for f in body.operations):
        return name
    loc = op.location
    f, entry = ir_utils.private_function(body, name, [lhs_type, rhs_type, *full[2:]], [result_type], loc)
    with ir.InsertionPoint(entry), loc:
        padded = [_pad_to(arg, ir.RankedTensorType(t)) for arg, t in zip(list(entry.arguments)[:2], full[:2])]
        whole = ir_utils.call(original, padded + list(entry.arguments)[2:], [full_result], loc).result
        part = ir.RankedTensorType(result_type)
        block = _corner(whole, ir.RankedTensorType.get(part.shape, ir.RankedTensorType(full_result).element_type))
        if block.type != result_type:  # a ring accumulating in a wider type than the template's result
            block = ir.Operation.create("stablehlo.convert", results=[result_type], operands=[block]).result
        ir_utils.function_return([block], loc)
    return name


def _pad_to(value: ir.Value, full: ir.RankedTensorType) -> ir.Value:
    """``value`` with zeros after its elements along each dim, to ``full``'s shape."""
    t = ir.RankedTensorType(value.type)
    if t.shape == full.shape:
        return value
    scalar = ir.RankedTensorType.get([], t.element_type)
    zero = ir.Operation.create("stablehlo.constant", results=[scalar], attributes={"value": zeros_attr(scalar)}).result
    high = [whole - part for whole, part in zip(full.shape, t.shape)]
    return ir.Operation.create("stablehlo.pad", results=[full], operands=[value, zero], attributes={
        "edge_padding_low": ir.DenseI64ArrayAttr.get([0] * t.rank),
        "edge_padding_high": ir.DenseI64ArrayAttr.get(high),
        "interior_padding": ir.DenseI64ArrayAttr.get([0] * t.rank)}).result


def _corner(value: ir.Value, part: ir.RankedTensorType) -> ir.Value:
    """The first ``part.shape`` elements of ``value`` along each dim."""
    t = ir.RankedTensorType(value.type)
    if t.shape == part.shape:
        return value
    return ir.Operation.create("stablehlo.slice", results=[part], operands=[value], attributes={
        "start_indices": ir.DenseI64ArrayAttr.get([0] * t.rank),
        "limit_indices": ir.DenseI64ArrayAttr.get(list(part.shape)),
        "strides": ir.DenseI64ArrayAttr.get([1] * t.rank)}).result
