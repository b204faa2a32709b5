"""One yes/no fact per value, decided from its operands' (the analyses' shared walk).

A step looks at one value (or op) and returns either the operands (ops) it still needs
decided, or none and the answer.  :func:`decide` runs the steps depth-first without recursion
(a chain of elementwise ops can be thousands long) and remembers every answer in ``memo``.
:class:`Dependents` decides, op by op, which ops of a block read given values.
"""

from __future__ import annotations

from typing import Callable, Iterable

from .. import ir_utils
from .._jax_private import ir

Step = Callable[[ir.Value], tuple[list[ir.Value], bool]]


def decide(value: ir.Value, step: Step, memo: dict) -> bool:
    """``value``'s answer (and every answer on the way, in ``memo``)."""
    stack = [value]
    while stack:
        top = stack[-1]
        if top in memo:
            stack.pop()
            continue
        pending, answer = step(top)
        if pending:
            stack.extend(pending)
            continue
        memo[top] = answer
        stack.pop()
    return memo[value]


def all_of(values: Iterable[ir.Value], memo: dict) -> tuple[list[ir.Value], bool]:
    """A step's result that is true when every one of ``values`` is: those still undecided,
    or none and the answer."""
    values = list(values)
    pending = [v for v in values if v not in memo]
    return (pending, False) if pending else ([], all(memo[v] for v in values))


class Dependents:
    """The ops of ``block`` that read ``values``, directly or through other ops (a use inside a
    nested region counts as its ancestor in ``block``), and ``also``: asked op by op (``op in
    dependents``), each answer walking back from the op only through ops after the first of
    ``values``' producers, and remembered.  Far cheaper than the forward closure where a few ops
    are asked about and the values are read by the rest of a long block (a layer's gathered rows)."""

    def __init__(self, values, block: ir.Block, also=()):
        self.values = set(values)
        self.block = block
        self.memo: dict[ir.Operation, bool] = {op.operation: True for op in also}
        producers = [v.owner.operation for v in self.values
                     if not isinstance(v.owner, ir.Block) and v.owner.operation.block == block]
        # ops up to the first producer read none of the values (block arguments: no such bound)
        self.start = min(producers, key=ir_utils.BlockOrder) if len(producers) == len(self.values) else None

    def __contains__(self, op: ir.Operation | ir.OpView) -> bool:
        op = op.operation
        return op.block == self.block and decide(op, self._step, self.memo)

    def _step(self, op: ir.Operation) -> tuple[list[ir.Operation], bool]:
        """Reads ``op`` one of the values, or an op that does (those still undecided first)?"""
        pending = []
        read = list(op.operands) + (ir_utils.captured(op) if len(op.regions) else [])
        for value in read:
            if value in self.values:
                return [], True
            owner = value.owner
            if isinstance(owner, ir.Block):
                continue
            owner = owner.operation
            if owner.block != self.block or (self.start is not None and not self.start.is_before_in_block(owner)):
                continue  # outside the block, or not after the first producer
            known = self.memo.get(owner)
            if known:
                return [], True
            if known is None:
                pending.append(owner)
        return pending, False
