"""The higher-precision reference: a module with its float element types promoted to f64.

The numerics check judges a rewritten program by how far it is from the exact result,
next to how far the original is (:mod:`.numerics`).  The exact result is estimated by
the original module itself, evaluated in f64: every float tensor type (f8 to f32, and
complex<f32>) becomes f64 (complex<f64>), on the same inputs (which f64 represents
exactly).  Its own error is that of f64, 2^29 times smaller than f32's unit roundoff.

The promotion is done on the IR through the bindings, never on text:

* every value's type (op results, block arguments of every region: reduction bodies,
  loops, manual computations) and every function's signature is promoted;
* a constant keeps its element type and is converted to f64 after it (its value is
  exact in f64);
* an op whose meaning depends on the float width (``bitcast_convert``; a
  ``custom_call`` other than the partitioner's sharding markers) keeps its original
  types: its float operands are converted back to them and its float results up to f64
  (the reference is then as precise there as the original, no more);
* a dot's ``algorithm`` (which names its operands' types) is dropped.

Where the promoted module does not verify, :class:`NoReference` says why.
"""

from __future__ import annotations

from . import ir_utils
from ._jax_private import hlo, ir, make_context
from .errors import CmatmulError


class NoReference(CmatmulError):
    """The module cannot be promoted to f64 (an op the promotion does not know)."""


#: custom_calls that only mark shardings for the partitioner: any element type
_SHARDING_MARKERS = frozenset({"Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape",
                               "MoveToHost", "MoveToDevice", "xla.sdy.FuncResultSharding",
                               "xla.sdy.GlobalToLocalShape", "xla.sdy.LocalToGlobalShape"})


def wide(element: ir.Type) -> ir.Type | None:
    """The f64 counterpart of a float or complex element type narrower than 64 bits (None: keep)."""
    if isinstance(element, ir.ComplexType):
        return None if isinstance(ir.ComplexType(element).element_type, ir.F64Type) \
            else ir.ComplexType.get(ir.F64Type.get())
    if isinstance(element, ir.FloatType) and not isinstance(element, ir.F64Type):
        return ir.F64Type.get()
    return None


def narrow(element: ir.Type) -> ir.Type | None:
    """The f32 counterpart of an f64 or complex<f64> element type (None: keep)."""
    if isinstance(element, ir.ComplexType):
        return ir.ComplexType.get(ir.F32Type.get()) if isinstance(ir.ComplexType(element).element_type, ir.F64Type) \
            else None
    return ir.F32Type.get() if isinstance(element, ir.F64Type) else None


def _retyped_type(t: ir.Type, element_map) -> ir.Type | None:
    if not isinstance(t, ir.RankedTensorType):
        return None
    element = element_map(ir.RankedTensorType(t).element_type)
    return None if element is None else ir.RankedTensorType.get(ir.RankedTensorType(t).shape, element)


def _width_bound(op: ir.OpView) -> bool:
    """An op to keep in its original types (its meaning depends on the float width)."""
    name = op.operation.name
    if name == "stablehlo.bitcast_convert":
        return True
    if name == "stablehlo.custom_call":
        target = ir.StringAttr(op.attributes["call_target_name"]).value
        return target not in _SHARDING_MARKERS
    return False


def promote_to_f64(module: ir.Module) -> ir.Module:
    """A copy of ``module`` computing in f64 wherever it computes in a narrower float type."""
    return _Retype(wide).copy(module)


def demote_to_f32(module: ir.Module) -> ir.Module:
    """A copy of ``module`` computing in f32 wherever it computes in f64: for a module that already
    computes in f64, whose f64 evaluation is itself, a run at lower precision shows how much the
    program magnifies rounding (:func:`.numerics.judge_float`)."""
    return _Retype(narrow).copy(module)


class _Retype:
    """A copy of a module with every float element type mapped by ``element_map`` (None: kept)."""

    def __init__(self, element_map):
        self.element_map = element_map

    def type(self, t: ir.Type) -> ir.Type | None:
        return _retyped_type(t, self.element_map)

    def copy(self, module: ir.Module) -> ir.Module:
        copy = ir_utils.copy_module(module, make_context())
        with copy.context, ir.Location.unknown(copy.context):
            ops = _every_op(copy)
            bound = [op for op in ops if _width_bound(op)]
            kept = {id(op.operation): [v.type for v in op.operation.operands] for op in bound}
            for op in ops:
                for region in op.operation.regions:
                    for block in region.blocks:
                        for arg in block.arguments:
                            self._set(arg)
                if op.operation.name in ("func.func",):
                    continue
                for result in op.operation.results:
                    if op.operation.name != "stablehlo.constant" and id(op.operation) not in kept:
                        self._set(result)
            for op in ops:
                name = op.operation.name
                if name == "func.func":
                    self._retype_function(op)
                elif name == "stablehlo.constant":
                    self._convert_results(op)
                elif id(op.operation) in kept:
                    self._keep_types(op, kept[id(op.operation)])
                elif name == "stablehlo.dot_general" and "algorithm" in op.attributes:
                    del op.attributes["algorithm"]
            try:
                copy.operation.verify()
            except ir.MLIRError as exc:
                target = "f64" if self.element_map is wide else "f32"
                raise NoReference(f"the module retyped to {target} does not verify: "
                                  f"{' '.join(str(exc).split())[:300]}") from None
        return copy

    def _set(self, value: ir.Value) -> None:
        t = self.type(value.type)
        if t is not None:
            value.set_type(t)

    def _retype_function(self, func_op: ir.OpView) -> None:
        """The function's type from its (retyped) entry block and return."""
        body = func_op.regions[0]
        old = ir.FunctionType(ir.TypeAttr(func_op.attributes["function_type"]).value)
        if not body.blocks:  # a declaration: retype its signature
            inputs = [self.type(t) or t for t in old.inputs]
        else:
            inputs = [a.type for a in body.blocks[0].arguments]
        results = [self.type(t) or t for t in old.results]
        func_op.attributes["function_type"] = ir.TypeAttr.get(ir.FunctionType.get(inputs, results))

    def _convert_results(self, op: ir.OpView) -> None:
        """Every use of ``op``'s float results reads them converted, just after ``op``."""
        anchor = op.operation
        for result in list(op.operation.results):
            t = self.type(result.type)
            if t is None:
                continue
            uses = [(u.owner, u.operand_number) for u in result.uses]
            with ir.InsertionPoint(op.operation):
                convert = hlo.ConvertOp(t, result, loc=op.location)
            convert.operation.move_after(anchor)
            anchor = convert.operation
            for owner, index in uses:
                owner.operands[index] = convert.result

    def _keep_types(self, op: ir.OpView, operand_types: list[ir.Type]) -> None:
        """``op`` computes in its original types: operands converted back, results retyped."""
        operation = op.operation
        with ir.InsertionPoint(operation):
            for i, (operand, original) in enumerate(zip(list(operation.operands), operand_types)):
                if operand.type != original:
                    operation.operands[i] = hlo.ConvertOp(original, operand, loc=op.location).result
        self._convert_results(op)


def _every_op(module: ir.Module) -> list[ir.OpView]:
    """Every op nested in ``module`` (one MLIR walk)."""
    found: list[ir.OpView] = []

    def visit(op: ir.Operation) -> ir.WalkResult:
        found.append(op.opview)
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    return found[:-1]  # post-order: the module itself comes last
