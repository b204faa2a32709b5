"""A copy of a module that XLA:CPU compiles, for ``check`` and the CPU runs of a module lowered
for GPU or TPU.

Two kinds of op such a module holds have no XLA:CPU lowering: a grouped matmul
(``jax.lax.ragged_dot``) as jax lowers it for GPU (``chlo.ragged_dot``, which XLA makes a
``ragged-dot`` instruction XLA:CPU's emitter rejects) and as ``jax.export`` writes it
(``stablehlo.composite "chlo.ragged_dot"``).  :func:`for_cpu` replaces

* every ``stablehlo.composite`` by a ``func.call`` of its ``decomposition`` function, which by
  the composite's definition computes the same values;
* every ``chlo.ragged_dot`` by a call of the function jax lowers ``jax.lax.ragged_dot_general``
  to on CPU for the same operand types, dimension numbers and result type (its dense form: a
  masked product per group).

The module itself is only read.
"""

from __future__ import annotations

import numpy as np

from . import ir_utils
from ._jax_private import ir

COMPOSITE = "stablehlo.composite"


def for_cpu(module: ir.Module) -> ir.Module:
    """``module``, or where it holds a composite or a ``chlo.ragged_dot``, a copy with each a call
    (see the module's docstring)."""
    found = ir_utils.ops_named(module.operation, COMPOSITE, ir_utils.RAGGED_DOT)
    if not found[COMPOSITE] and not found[ir_utils.RAGGED_DOT]:
        return module
    copy = ir_utils.clone_module(module)
    found = ir_utils.ops_named(copy.operation, COMPOSITE, ir_utils.RAGGED_DOT)
    made: dict = {}  # (operand and result types, dimension numbers) -> the function jax lowered
    with copy.context:
        for op in found[COMPOSITE]:
            _replace_by_call(op, ir.FlatSymbolRefAttr(op.operation.attributes["decomposition"]).value)
        for op in found[ir_utils.RAGGED_DOT]:
            key = (tuple(str(v.type) for v in op.operation.operands), str(op.operation.results[0].type),
                   ir_utils.ragged_numbers(op))
            if key not in made:
                made[key] = _import_lowering(copy, op, len(made))
            _replace_by_call(op, made[key])
    return copy


def _replace_by_call(op: ir.OpView, callee: str) -> None:
    operation = op.operation
    with ir.InsertionPoint(operation):
        call = ir_utils.call(callee, list(operation.operands), [r.type for r in operation.results], operation.location)
    for old, new in zip(operation.results, call.results):
        old.replace_all_uses_with(new)
    operation.erase()


def _import_lowering(module: ir.Module, op: ir.OpView, index: int) -> str:
    """jax's CPU lowering of ``op`` (a ``chlo.ragged_dot``) as private functions of ``module``
    (each renamed under one prefix); the name of the one computing it."""
    import jax
    from jax import lax

    from .execute import numpy_dtype

    numbers = ir_utils.ragged_numbers(op)
    if numbers is None:
        raise ValueError(f"cannot read the dimension numbers of chlo.ragged_dot at {op.location}")
    lhs_batch, rhs_batch, lhs_contracting, rhs_contracting, ragged, group = numbers
    dims = lax.RaggedDotDimensionNumbers(dot_dimension_numbers=((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch)),
                                         lhs_ragged_dimensions=list(ragged), rhs_group_dimensions=list(group))
    types = [ir.RankedTensorType(v.type) for v in op.operation.operands]
    result = ir.RankedTensorType(op.operation.results[0].type)
    structs = [jax.ShapeDtypeStruct(tuple(t.shape), numpy_dtype(t.element_type)) for t in types]
    wide = any(np.dtype(s.dtype).itemsize == 8 for s in structs) or numpy_dtype(result.element_type).itemsize == 8
    with jax.enable_x64(wide):
        text = jax.jit(lambda x, w, g: lax.ragged_dot_general(
            x, w, g, dims, preferred_element_type=numpy_dtype(result.element_type))).lower(*structs).as_text()
    lowered = ir_utils.parse(text, context=module.context)
    prefix = f"cmatmul_cpu_ragged_dot_{index}_"
    functions = [f for f in lowered.body.operations if f.operation.name == "func.func"]
    renamed = {ir_utils.symbol_name(f): prefix + ir_utils.symbol_name(f) for f in functions}
    for call in ir_utils.ops_named(lowered.operation, "func.call")["func.call"]:
        callee = ir.FlatSymbolRefAttr(call.operation.attributes["callee"]).value
        call.operation.attributes["callee"] = ir.FlatSymbolRefAttr.get(renamed[callee])
    body = ir.InsertionPoint(module.body)
    for f in functions:
        f.operation.attributes["sym_name"] = ir.StringAttr.get(renamed[ir_utils.symbol_name(f)])
        f.operation.attributes["sym_visibility"] = ir.StringAttr.get("private")
        f.operation.detach_from_parent()
        body.insert(f.operation)
    return renamed["main"]
