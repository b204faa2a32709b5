"""A scalar computed from ``partition_id`` alone, evaluated on every partition.

``lax.axis_index('d')`` lowers to ``partition_id`` divided, reduced modulo and converted: a value
that differs between devices, yet is the same on every device of a group along another mesh axis
(on a 2×4 mesh, ``axis_index('d')`` is one number on each group of the ``'m'`` axis).  Where a
scalar integer (or boolean) is computed only from ``partition_id`` and constants through
elementwise arithmetic — in its block or through the private functions jax calls for ``//`` and
``%`` — this module evaluates it at every partition id, so :mod:`.variance` can ask whether it is
constant on each group.  Anything else (a tensor, a float, an argument, an op not listed) gives
None: not evaluated.
"""

from __future__ import annotations

import numpy as np

from .._jax_private import ir

#: binary elementwise ops, on int64 arrays (C semantics for divide and remainder, as StableHLO's)
_BINARY = {
    "stablehlo.add": np.add, "stablehlo.subtract": np.subtract, "stablehlo.multiply": np.multiply,
    "stablehlo.maximum": np.maximum, "stablehlo.minimum": np.minimum, "stablehlo.and": np.bitwise_and,
    "stablehlo.or": np.bitwise_or, "stablehlo.xor": np.bitwise_xor,
}
_COMPARE = {"EQ": np.equal, "NE": np.not_equal, "LT": np.less, "LE": np.less_equal, "GT": np.greater,
            "GE": np.greater_equal}
_PASS_THROUGH = frozenset({"stablehlo.convert", "stablehlo.reshape", "stablehlo.broadcast_in_dim"})
MAX_DEPTH = 64


class ByPartition:
    """Evaluates scalars of one module at every partition id (``count`` of them), remembering each."""

    def __init__(self, count: int, callee):
        self.count = count
        self.callee = callee  # a call op -> its func.func, or None
        self._memo: dict[ir.Value, np.ndarray | None] = {}

    def __call__(self, value: ir.Value, bound: dict | None = None, depth: int = 0) -> np.ndarray | None:
        """``value`` at each partition id (an int64 array of ``count``), or None."""
        if bound is not None and value in bound:
            return bound[value]
        if bound is None and value in self._memo:
            return self._memo[value]
        found = self._evaluate(value, bound, depth) if depth < MAX_DEPTH and _scalar_int(value.type) else None
        if bound is None:
            self._memo[value] = found
        return found

    def _evaluate(self, value: ir.Value, bound: dict | None, depth: int) -> np.ndarray | None:
        owner = value.owner
        if isinstance(owner, ir.Block):
            return None
        op = owner.operation
        name = op.name
        if name == "stablehlo.partition_id":
            return np.arange(self.count, dtype=np.int64)
        if name == "stablehlo.constant":
            attr = ir.DenseElementsAttr(op.attributes["value"])
            if not attr.is_splat:
                return None
            splat = attr.get_splat_value()
            try:
                number = int(ir.IntegerAttr(splat).value)
            except ValueError:
                return None
            return np.full(self.count, number, dtype=np.int64)
        if name == "func.call":
            callee = self.callee(op)
            if callee is None or len(callee.regions[0].blocks) != 1:
                return None
            block = callee.regions[0].blocks[0]
            args = [self(v, bound, depth + 1) for v in op.operands]
            if any(a is None for a in args):
                return None
            returned = list(block.operations)[-1].operation.operands[ir.OpResult(value).result_number]
            return self(returned, dict(zip(block.arguments, args)), depth + 1)
        operands = [self(v, bound, depth + 1) for v in op.operands]
        if any(a is None for a in operands):
            return None
        return _apply(name, op, operands)


def _apply(name: str, op: ir.Operation, a: list[np.ndarray]) -> np.ndarray | None:
    if name in _PASS_THROUGH:
        return a[0]
    if name in _BINARY:
        return _BINARY[name](a[0], a[1])
    if name in ("stablehlo.divide", "stablehlo.remainder"):
        if (a[1] == 0).any():
            return None
        quotient = (np.abs(a[0]) // np.abs(a[1])) * np.sign(a[0]) * np.sign(a[1])
        return quotient if name == "stablehlo.divide" else a[0] - a[1] * quotient
    if name == "stablehlo.negate":
        return -a[0]
    if name == "stablehlo.abs":
        return np.abs(a[0])
    if name == "stablehlo.not":
        return np.logical_not(a[0]).astype(np.int64) if _is_bool(op) else ~a[0]
    if name == "stablehlo.select":
        return np.where(a[0] != 0, a[1], a[2])
    if name == "stablehlo.clamp":
        return np.clip(a[1], a[0], a[2])
    if name == "stablehlo.compare":
        direction = str(op.attributes["comparison_direction"]).split()[-1].rstrip(">")
        fn = _COMPARE.get(direction)
        return fn(a[0], a[1]).astype(np.int64) if fn is not None else None
    return None


def _scalar_int(t: ir.Type) -> bool:
    if not isinstance(t, ir.RankedTensorType):
        try:
            t = ir.RankedTensorType(t)
        except ValueError:
            return False
    return t.rank == 0 and isinstance(t.element_type, ir.IntegerType)


def _is_bool(op: ir.Operation) -> bool:
    return ir.IntegerType(ir.RankedTensorType(op.results[0].type).element_type).width == 1
