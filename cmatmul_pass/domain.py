"""Inputs in a program's domain, for the numerics check.

Random normal inputs can take a program out of its domain: an Adam step whose second moments
are drawn negative takes their square root, a classifier whose integer labels are drawn past
the number of classes gathers outside its logits (jax then fills NaN).  The original itself is
then inf or NaN, and a check on those outputs says nothing about the rewrite.

Where that happens, :func:`rules` finds the arguments one of two simple rules keeps in the
domain, from the module's data flow:

* **non-negative**: a float argument that reaches the operand of ``sqrt``, ``rsqrt``, ``log``,
  ``log_plus_one`` or the base of ``power`` through ops that keep a non-negative value
  non-negative (sums, products of other values, quotients' numerators, layout and sharding
  ops, collectives, calls, shard_map regions).  A product of a value with itself, an ``abs``
  or an ``exp`` is non-negative whatever its operands are: the search stops there;
* **indices**: an integer argument that reaches the start indices of a ``gather`` or
  ``scatter`` or a start index of ``dynamic_slice`` / ``dynamic_update_slice`` through
  layout, select and add ops (jax's wrap of negative indices), drawn within the bounds of
  every one it reaches (``[0, dim - slice + 1)``, the smallest).

And one rule every draw takes, since small random integers are legal group sizes that leave most
rows in no group: **group sizes**, an integer argument that is a grouped matmul's group sizes
(``chlo.ragged_dot``'s third operand, through reshapes, converts, sharding ops, calls and
shard_map regions), drawn as non-negative sizes summing to its row count (empty groups as they
fall).

:func:`draw` redraws those arguments (a normal draw's magnitudes; uniform indices), the other
arguments as they were.  :func:`input_spec` lists the arguments a module takes, for an
``--inputs`` file of one's own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import ir_utils
from ._jax_private import hlo, ir

NON_NEGATIVE = "non-negative"
INDICES = "indices"
GROUP_SIZES = "group sizes"
#: ops a grouped matmul's group sizes keep their values through (what the group-sizes rule looks
#: back through, besides calls, regions and barriers)
_SIZES_THROUGH = frozenset({"stablehlo.convert", "stablehlo.reshape", "stablehlo.copy", "sdy.sharding_constraint",
                            "sdy.reshard", "mhlo.copy"})

#: ops whose operand must be non-negative (operand 0): what the rule looks back from
_NON_NEGATIVE_SINKS = ("stablehlo.sqrt", "stablehlo.rsqrt", "stablehlo.log", "stablehlo.log_plus_one",
                       "stablehlo.power")
#: ops that pass their operand 0 on unchanged in sign and value range (layout, sharding, movement)
_PASS_THROUGH = frozenset({
    "stablehlo.convert", "stablehlo.broadcast_in_dim", "stablehlo.reshape", "stablehlo.transpose",
    "stablehlo.slice", "stablehlo.reverse", "stablehlo.pad", "stablehlo.copy", "stablehlo.reduce_precision",
    "stablehlo.dynamic_slice", "stablehlo.gather", "stablehlo.all_gather", "stablehlo.collective_permute",
    "stablehlo.all_to_all", "sdy.sharding_constraint", "sdy.reshard", "mhlo.copy",
})
#: ops that index an operand with values (what the indices rule looks back from)
_INDEXING = frozenset({"stablehlo.gather", "stablehlo.scatter", "stablehlo.dynamic_slice",
                       "stablehlo.dynamic_update_slice"})
#: custom_calls that only mark a value's sharding (legacy partitioner)
_SHARDING_CALLS = frozenset({"Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape"})


@dataclass(frozen=True)
class Rule:
    """How argument ``argument`` of the entry function is drawn to keep the program in its
    domain: ``kind`` :data:`NON_NEGATIVE`, :data:`INDICES` (integers in ``[0, bound)``) or
    :data:`GROUP_SIZES` (non-negative integers summing to ``bound`` along the last dim);
    ``name`` the argument's name where the module records it (jax's ``debug_info``), ``op``
    the op that needs it (``stablehlo.sqrt at file:line:col``)."""

    argument: int
    kind: str
    op: str
    name: str = ""
    bound: int | None = None

    def what(self) -> str:
        if self.kind == GROUP_SIZES:
            return f"group sizes summing to {self.bound}"
        return "non-negative" if self.kind == NON_NEGATIVE else f"integers in [0, {self.bound})"

    def why(self, many: bool = False) -> str:
        if self.kind == INDICES:
            return f"the indices of {self.op}"
        if self.kind == GROUP_SIZES:
            return f"the group sizes of {self.op}"
        return f"{'they flow' if many else 'it flows'} into {self.op}"

    def label(self) -> str:
        return f"arg{self.argument}{f' ({self.name})' if self.name else ''}"

    def describe(self) -> str:
        return f"{self.label()} {self.what()} ({self.why()})"


def describe(found: list[Rule]) -> str:
    """The rules, one clause per rule and op: ``arg5 (nu['w1']), arg6 (nu['w2']) non-negative
    (they flow into stablehlo.sqrt at optax/_src/transform.py:300:49 (<lambda>))``."""
    groups: dict[tuple, list[Rule]] = {}
    for rule in found:
        groups.setdefault((rule.kind, rule.bound, rule.op), []).append(rule)
    return "; ".join(f"{', '.join(r.label() for r in group)} {group[0].what()} ({group[0].why(len(group) > 1)})"
                     for group in groups.values())


def entry_arguments(module: ir.Module) -> list:
    """The entry function's arguments (``execute.entry_function``'s)."""
    from .execute import entry_function

    return list(entry_function(module).regions[0].blocks[0].arguments)


def argument_name(arg) -> str:
    """The name jax gave an argument (``params['w1']``: its location, with ``debug_info``), else ''."""
    try:
        return arg.location.name_str
    except (AttributeError, ValueError):
        return ""


def rules(module: ir.Module, source: str | None = None) -> list[Rule]:
    """The arguments of ``module``'s entry function that a rule keeps in the domain, by argument."""
    from .execute import entry_function

    entry = entry_function(module)
    walker = _Walker(module, entry, source)
    found: dict[int, Rule] = {}
    for op in ir_utils.walk(module.operation):
        name = op.operation.name
        if name in _NON_NEGATIVE_SINKS:
            where = _where(op, source)
            for arg in walker.arguments(op.operands[0], NON_NEGATIVE):
                found.setdefault(arg, Rule(arg, NON_NEGATIVE, where, walker.name(arg)))
        if ir_utils.is_grouped_dot(op) and len(op.operands) > 2:
            numbers, lhs = ir_utils.ragged_numbers(op), ir_utils.ranked_tensor(op.operands[0])
            if numbers and len(numbers[4]) == 1 and lhs is not None and ir_utils.is_static(lhs):
                for arg in walker.arguments(op.operands[2], GROUP_SIZES):
                    found[arg] = Rule(arg, GROUP_SIZES, _where(op, source), walker.name(arg), lhs.shape[numbers[4][0]])
        for operand, bound in _index_operands(op):
            where = _where(op, source)
            for arg in walker.arguments(operand, INDICES):
                old = found.get(arg)
                if old is None or (old.kind == INDICES and bound < old.bound):
                    found[arg] = Rule(arg, INDICES, where, walker.name(arg), bound)
    return [found[arg] for arg in sorted(found)]


def draw(inputs: list[np.ndarray], found: list[Rule], seed: int = 0) -> list[np.ndarray]:
    """``inputs`` (a random draw) with the arguments ``found`` names redrawn by their rules: a
    non-negative one as the magnitudes of its draw, indices uniform in ``[0, bound)``."""
    rng = np.random.default_rng(seed + 1)
    redrawn = list(inputs)
    for rule in found:
        x = redrawn[rule.argument]
        if rule.kind == NON_NEGATIVE:
            redrawn[rule.argument] = np.abs(x).astype(x.dtype)
        elif rule.kind == GROUP_SIZES:
            groups = x.shape[-1] if x.ndim else 1
            sizes = rng.multinomial(rule.bound, [1 / groups] * groups, size=x.shape[:-1] if x.ndim else None)
            redrawn[rule.argument] = np.asarray(sizes).reshape(x.shape).astype(x.dtype)
        else:
            redrawn[rule.argument] = rng.integers(0, max(rule.bound, 1), x.shape).astype(x.dtype)
    return redrawn


def input_spec(module: ir.Module, source: str | None = None) -> list[str]:
    """One line per argument of the entry function: ``argN``, its global type, its name where
    the module records it, its sharding, and the rule a random draw of ``check`` may take."""
    by_arg = {rule.argument: rule for rule in rules(module, source)}
    lines = []
    for arg in entry_arguments(module):
        i = arg.arg_number
        t = ir_utils.ranked_tensor(arg)
        what = f"{t.element_type}{list(t.shape)}" if t is not None else str(arg.type)
        name = argument_name(arg)
        line = f"arg{i}: {what}{f'  {name}' if name else ''}"
        owner = arg.owner.owner
        attrs = ir.DictAttr(ir.ArrayAttr(owner.attributes["arg_attrs"])[i]) if "arg_attrs" in owner.attributes \
            else None
        for key in ("sdy.sharding", "mhlo.sharding"):
            if attrs is not None and key in attrs:
                line += f"  sharding {attrs[key]}"
                break
        if i in by_arg:
            rule = by_arg[i]
            when = "" if rule.kind == GROUP_SIZES else " where random inputs leave the original inf/NaN"
            line += f"  (drawn {rule.what()}{when}: {rule.why()})"
        lines.append(line)
    return lines


def _where(op: ir.OpView, source: str | None) -> str:
    """``stablehlo.sqrt at file:line:col``: the op and its innermost frame."""
    return f"{op.operation.name} at {ir_utils.render_location(op.location, source).split(' ← ')[0]}"


def _index_operands(op: ir.OpView) -> list[tuple[ir.Value, int]]:
    """(index operand, the largest index in bounds + 1) of an op that indexes with values."""
    name = op.operation.name
    if name not in _INDEXING:
        return []
    operands = list(op.operation.operands)
    if any(t is None or not ir_utils.is_static(t) for t in map(ir_utils.ranked_tensor, operands)):
        return []  # bounds of a dynamic shape: no rule
    if name == "stablehlo.gather":
        shape = ir.RankedTensorType(operands[0].type).shape
        dims = hlo.GatherDimensionNumbers(op.attributes["dimension_numbers"])
        sizes = list(ir.DenseI64ArrayAttr(op.attributes["slice_sizes"]))
        bounds = [shape[d] - sizes[d] + 1 for d in dims.start_index_map]
        return [(operands[1], min(bounds))] if bounds else []
    if name == "stablehlo.scatter":
        inputs = (len(operands) - 1) // 2
        shape = ir.RankedTensorType(operands[0].type).shape
        dims = hlo.ScatterDimensionNumbers(op.attributes["scatter_dimension_numbers"])
        bounds = [shape[d] for d in dims.scattered_dims_to_operand_dims]
        return [(operands[inputs], min(bounds))] if bounds else []
    if name == "stablehlo.dynamic_slice":
        shape = ir.RankedTensorType(operands[0].type).shape
        sizes = list(ir.DenseI64ArrayAttr(op.attributes["slice_sizes"]))
        return [(index, shape[d] - sizes[d] + 1) for d, index in enumerate(operands[1:])]
    if name == "stablehlo.dynamic_update_slice":
        shape = ir.RankedTensorType(operands[0].type).shape
        update = ir.RankedTensorType(operands[1].type).shape
        return [(index, shape[d] - update[d] + 1) for d, index in enumerate(operands[2:])]
    return []


class _Walker:
    """Follows a value back through the ops a rule looks through to the entry function's arguments."""

    def __init__(self, module: ir.Module, entry: ir.OpView, source: str | None):
        self.symbols = ir_utils.Symbols(module.operation)
        self.entry = entry
        self.source = source
        self.args = list(entry.regions[0].blocks[0].arguments)

    def name(self, index: int) -> str:
        return argument_name(self.args[index])

    def arguments(self, value: ir.Value, kind: str) -> list[int]:
        """The entry arguments ``value`` comes from by ops that keep ``kind``'s property."""
        found: list[int] = []
        seen: set = set()
        stack = [value]
        while stack:
            v = stack.pop()
            if v in seen:
                continue
            seen.add(v)
            if isinstance(v, ir.BlockArgument):
                stack += self._block_argument(v, kind, found)
            elif isinstance(v, ir.OpResult):
                stack += self._producer_operands(v, kind)
        return sorted(set(found))

    def _block_argument(self, arg: ir.BlockArgument, kind: str, found: list[int]) -> list[ir.Value]:
        owner = arg.owner.owner
        name = owner.operation.name if owner is not None else ""
        if name == "func.func":
            if owner.operation == self.entry.operation:
                t = ir_utils.ranked_tensor(arg)
                wanted = ir.FloatType if kind == NON_NEGATIVE else ir.IntegerType
                if t is not None and isinstance(t.element_type, wanted):
                    found.append(arg.arg_number)
                return []
            calls = self.symbols.calls.get(ir_utils.symbol_name(owner), [])
            return [call.operands[arg.arg_number] for call in calls]
        if name in ("sdy.manual_computation", "stablehlo.while"):
            return [owner.operation.operands[arg.arg_number]]
        return []

    def _producer_operands(self, result: ir.OpResult, kind: str) -> list[ir.Value]:
        op = result.owner
        name = op.name
        operands = list(op.operands)
        if name == "func.call":
            return self.symbols.returned(op.opview, result.result_number)
        if name == "sdy.manual_computation":
            body = op.regions[0].blocks[0]
            return [list(body.operations)[-1].operands[result.result_number]]
        if name == "stablehlo.optimization_barrier":
            return [operands[result.result_number]]
        if kind == GROUP_SIZES:
            return operands[:1] if name in _SIZES_THROUGH else []
        if name == "stablehlo.custom_call":
            target = ir.StringAttr(op.attributes["call_target_name"]).value
            return operands[:1] if target in _SHARDING_CALLS else []
        if name in _PASS_THROUGH:
            return operands[:1]
        if name in ("stablehlo.concatenate", "stablehlo.add", "stablehlo.all_reduce", "stablehlo.reduce_scatter"):
            return operands
        if name == "stablehlo.select":
            return operands[1:]
        if kind == NON_NEGATIVE:
            if name == "stablehlo.multiply":  # x * x is non-negative whatever x is
                return [] if operands[0] == operands[1] else operands
            if name == "stablehlo.divide":
                return operands[:1]
            if name == "stablehlo.reduce":
                return operands[:len(operands) // 2]
            return []
        if name == "stablehlo.subtract":
            return operands
        if name == "stablehlo.clamp":
            return operands[1:2]
        return []
