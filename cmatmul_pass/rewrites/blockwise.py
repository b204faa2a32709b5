"""One op of a separable region (:mod:`cmatmul_pass.analysis.separable`) applied to a block of
the tracked dim: the all_to_all pair's chunks and ring attention's blocks of keys.

The block is ``1/parts`` of the tracked dim; each op is cloned with its own attributes, regions
and location at the current insertion point, its result the block's share of the dim, each
side operand read whole, at the block's rows (the caller's ``rows``), or (a broadcast not along
the dim) rebuilt at the block's size.
"""

from __future__ import annotations

from collections.abc import Callable

from .. import ir_utils
from .._jax_private import ir
from ..analysis.separable import REBUILD, SLICE, Step, result_permutation
from .builders import Builder


def block_type(value: ir.Value, dim: int, parts: int) -> ir.RankedTensorType:
    """``value``'s type with ``1/parts`` of ``dim``."""
    t = ir.RankedTensorType(value.type)
    return ir_utils.with_dim(t, dim, t.shape[dim] // parts)


def apply_step(step: Step, env: dict, parts: int, rows: Callable[[ir.Value, int, Builder], ir.Value],
               b: Builder) -> list[ir.Value]:
    """``step``'s op on the block: a clone reading ``env``'s blocks of the tracked operands and
    ``rows(value, dim, builder)`` of each side operand the step reads at the block's rows."""
    operands = []
    for value, plan in zip(step.op.operation.operands, step.sides):
        if plan is None:
            operands.append(env[value])
        elif plan[0] == SLICE:
            operands.append(rows(value, plan[1], b.at(step.op.location)))
        elif plan[0] == REBUILD:
            producer = value.owner.opview if isinstance(value.owner, ir.Operation) else value.owner
            rebuilt = producer.operation.clone()
            rebuilt.results[0].set_type(block_type(value, plan[1], parts))
            operands.append(rebuilt.results[0])
        else:
            operands.append(value)
    return clone_on_block(step, operands, parts)


def clone_on_block(step: Step, operands: list[ir.Value], parts: int) -> list[ir.Value]:
    """``step``'s op cloned at the insertion point on ``operands`` (its operands' blocks and side
    operands as the block reads them), its results the block's."""
    if step.body:  # a pointwise function's body on the block, at the call's place
        return _inlined(step, operands, parts)
    op = step.op.operation.clone()
    for i, v in enumerate(operands):
        op.operands[i] = v
    if not step.sums:  # (a partial product has the whole product's type)
        op.results[0].set_type(block_type(step.op.operation.results[0], step.out_dim, parts))
    if op.name == "stablehlo.slice":  # whole along the tracked dim (the analysis' condition): the block's end
        limits = ir_utils.i64s(op, "limit_indices")
        limits[step.out_dim] //= parts
        op.attributes["limit_indices"] = ir.DenseI64ArrayAttr.get(limits)
    return [op.results[0]]


def _inlined(step: Step, operands: list[ir.Value], parts: int) -> list[ir.Value]:
    """The body of the pointwise function ``step`` calls, cloned on the block's ``operands``:
    every value of the call's shape at the block's (scalars, and an argument of another shape
    before its broadcast or transpose, as they are; a splat of a scalar rebuilt at its size)."""
    callee_block = step.body[0].operation.block
    mapping = dict(zip(callee_block.arguments, operands))
    full = ir.RankedTensorType(step.op.operation.results[0].type).shape
    dim = step.out_dim
    body = list(step.body)
    permutation = result_permutation(body + [list(callee_block.operations)[-1]])
    tail = None
    if permutation is not None:  # (the body read at the transposed value's shape, its transpose last)
        tail, body = body[-1], body[:-1]
        full, dim = [full[permutation.index(d)] for d in range(len(full))], permutation[dim]
    scalar_of: dict = {}  # a splat in the body -> the scalar it holds
    for inner in body:
        results = inner.operation.results
        source = inner.operation.operands[0] if len(inner.operation.operands) else None
        if inner.operation.name == "stablehlo.broadcast_in_dim" and (
                ir.RankedTensorType(source.type).rank == 0 or source in scalar_of):
            scalar = scalar_of.get(source, source)
            scalar_of[results[0]] = scalar
            t = block_type(results[0], dim, parts) if ir.RankedTensorType(results[0].type).shape == full \
                else results[0].type
            mapping[results[0]] = ir.Operation.create(
                "stablehlo.broadcast_in_dim", results=[t], operands=[mapping.get(scalar, scalar)],
                attributes={"broadcast_dimensions": ir.DenseI64ArrayAttr.get([])}, loc=inner.location).results[0]
            continue
        clone = inner.operation.clone()
        for i, v in enumerate(inner.operation.operands):
            clone.operands[i] = mapping.get(v, v)
        for old, new in zip(results, clone.results):
            if ir.RankedTensorType(old.type).shape == full and full:
                new.set_type(block_type(old, dim, parts))
            mapping[old] = new
    if tail is not None:
        clone = tail.operation.clone()
        clone.operands[0] = mapping[tail.operation.operands[0]]
        clone.results[0].set_type(block_type(tail.operation.results[0], step.out_dim, parts))
        mapping[tail.operation.results[0]] = clone.results[0]
    returned = list(callee_block.operations)[-1].operation.operands
    return [mapping.get(v, v) for v in returned]
