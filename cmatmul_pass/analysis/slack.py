"""Slack: how early a collective's operand is ready, and how much compute could hide it.

On a 2-D mesh (FSDP × tensor parallel) one ``dot_general`` may read two candidate
collectives: the weight's all_gather over the data axis and the activation's all_gather (or
the product's reduce_scatter) over the model axis.  A ring can hide only one of them behind
the dot.  The weight's operand is usually *early*: computed only from the step's arguments
and constants, so it can be sent as soon as the step starts and XLA's latency-hiding
scheduler hides it behind whatever compute comes before its dot (that is how FSDP hides its
gathers: prefetching).  The activation's operand is produced just before the dot; only the
ring can hide it.  So the collective with less slack gets the ring.

A value is **early** when every value it is computed from is an argument of the module's
entry function (into and out of ``sdy.manual_computation`` regions, through remat's
``optimization_barrier`` operand by operand) or a constant, through cheap ops
without regions that read nothing device- or time-dependent: a weight, cast, scaled or
reshaped where it is used.  A value computed by a matmul (an embedding, a layer's output) is
the step's activation, not early; so is an ``rng``'s, a custom call's.  A loop's carried value
is early when its initial value is and each trip computes the next one, through such ops, only
from early values and the loop's other early carried values: a scan's stacked weights, passed
along unchanged, and its trip counter (its layer ``i`` of the weights is then early too); a
carried activation is not.  A call of a private function (jax's ``@dynamic_index_in_dim``,
``@closed_call``) is early where what the function returns there is, given the call's operands.  The **hiding compute** of a collective is the FLOP count of the
``dot_general`` ops of its block that come before its first dot, do not read its result
(directly or through other ops), and — unless its operand is early — come after its operand
is computed: the work a scheduler could run while the collective is in flight.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .._jax_private import ir
from .. import ir_utils
from .dataflow import Dependents, all_of, decide

#: ops whose result is not known at the start of the step, or that the analysis does not see into
NOT_EARLY = frozenset({
    "stablehlo.rng", "stablehlo.rng_bit_generator", "stablehlo.custom_call", "stablehlo.infeed",
    "stablehlo.recv", "stablehlo.while", "stablehlo.if", "stablehlo.case", "func.call",
})
WHILE = "stablehlo.while"
#: the step's compute: a value computed by one of these is an activation, not a prepared weight
COMPUTE = frozenset({"stablehlo.dot_general", "stablehlo.dot", "stablehlo.convolution"})


@dataclass(frozen=True)
class SiteSlack:
    """What :class:`Slack` says of one candidate collective."""

    early: bool
    hiding_flops: float

    @property
    def rank(self) -> tuple:
        """Sort key: the site that should get the ring first (the least compute to hide behind,
        then an operand computed in this step over one ready at its start).  Equal keys: no
        reason to prefer either (the program's order stands)."""
        return (self.hiding_flops, self.early)

    def to_dict(self) -> dict:
        return {"early": self.early, "hiding_flops": self.hiding_flops}


class Slack:
    """Answers :meth:`early` and :meth:`of` for one module; ``flops`` prices a dot_general."""

    def __init__(self, flops: Callable[[ir.OpView], float]):
        self.flops = flops
        self._early: dict[ir.Value, bool] = {}
        self._symbols: ir_utils.Symbols | None = None  # the module's functions and calls, once asked

    def early(self, value: ir.Value) -> bool:
        """Is ``value`` computed only from the entry function's arguments and constants?"""
        return decide(value, lambda v: self._step(v, self._early), self._early)

    def _step(self, value: ir.Value, memo: dict) -> tuple[list[ir.Value], bool]:
        owner = value.owner
        if isinstance(owner, ir.Block):
            parent = owner.owner
            if parent is None:
                return [], False
            if parent.operation.name == "func.func":  # the entry function's argument, or a private one's
                if not ir_utils.is_private(parent):
                    return [], True
                calls = self._symbols_of(parent).calls.get(ir_utils.symbol_name(parent), [])
                index = ir.BlockArgument(value).arg_number  # early where every call passes an early value
                return all_of([call.operands[index] for call in calls], memo) if calls else ([], False)
            if parent.operation.name == "sdy.manual_computation":
                return all_of([parent.operands[ir.BlockArgument(value).arg_number]], memo)
            if parent.operation.name == WHILE and memo is self._early:
                self._carried(parent.operation)  # decides every carried value of the loop at once
                return [], memo[value]
            return [], False  # a region's argument (and, deciding a loop's, another loop's)
        op = owner.operation
        if op.name == "func.call":
            return self._call(op, ir.OpResult(value).result_number, memo)
        if op.name == "stablehlo.optimization_barrier":  # remat's barrier: result i is operand i
            return all_of([op.operands[ir.OpResult(value).result_number]], memo)
        if op.name == "sdy.manual_computation":  # a region's result: what its body returns there
            body = op.regions[0].blocks[0]
            return all_of([list(body.operations)[-1].operands[ir.OpResult(value).result_number]], memo)
        if op.name in NOT_EARLY or op.name in COMPUTE or (len(op.regions) and op.name not in ("stablehlo.all_gather", "stablehlo.all_reduce",
                                                                         "stablehlo.reduce", "stablehlo.reduce_scatter",
                                                                         "stablehlo.sort", "stablehlo.map")):
            return [], False
        return all_of(op.operands, memo)

    def _call(self, call: ir.Operation, index: int, memo: dict) -> tuple[list[ir.Value], bool]:
        """Result ``index`` of ``call``: what its private callee returns there, with the callee's
        arguments as early as the call's operands (decided afresh at every call)."""
        callee = self._symbols_of(call).callee(call)
        if callee is None or not ir_utils.is_private(callee) or len(callee.regions[0].blocks) != 1:
            return [], False
        pending = [v for v in call.operands if v not in memo]
        if pending:
            return pending, False
        block = callee.regions[0].blocks[0]
        inside = {argument: memo[v] for argument, v in zip(block.arguments, call.operands)}
        returned = list(block.operations)[-1].operands[index]
        return [], decide(returned, lambda v: self._step(v, inside), inside)

    def _symbols_of(self, op: ir.OpView | ir.Operation) -> ir_utils.Symbols:
        if self._symbols is None:
            self._symbols = ir_utils.Symbols(op)
        return self._symbols

    def _carried(self, loop: ir.Operation) -> None:
        """Decide the carried values of ``loop`` (its condition's and body's arguments): the
        greatest set whose initial values are early and whose next values the body computes
        from early values and that set alone (assumed early, then dropped where the body's next
        value is not, until none is dropped)."""
        cond, body = (region.blocks[0] for region in loop.regions)
        following = list(body.operations)[-1].operands
        kept = {k for k, init in enumerate(loop.operands) if self.early(init)}
        while True:
            trial = dict(self._early)  # what is known outside the loop, plus the assumption
            for k in range(len(loop.operands)):
                trial[body.arguments[k]] = k in kept
            still = {k for k in kept if decide(following[k], lambda v: self._step(v, trial), trial)}
            if still == kept:
                break
            kept = still
        for block in (cond, body):
            for k, argument in enumerate(block.arguments):
                self._early[argument] = k in kept

    def of(self, collective: ir.OpView, dots: list[ir.OpView]) -> SiteSlack:
        """``collective``'s slack before the first of ``dots`` (module docstring)."""
        operand = collective.operation.operands[0]
        early = self.early(operand)
        block = collective.operation.block
        dependent = Dependents(collective.operation.results, block)
        firsts = [ir_utils.ancestor_in(d.operation, block) for d in dots]
        firsts = [f for f in firsts if f is not None]
        start = None if early or isinstance(operand.owner, ir.Block) else operand.owner.operation
        started = start is None or start.block != block
        flops = 0.0
        for op in block.operations:
            operation = op.operation
            if any(operation == f for f in firsts):
                break
            if not started:
                started = operation == start
                continue
            if operation not in dependent:
                flops += self._flops_within(operation)
        if early:  # sent at the start of the step: what runs before the enclosing regions hides it too
            anchor = block.owner
            while anchor is not None and anchor.operation.name != "func.func":
                for op in anchor.operation.block.operations:
                    if op.operation == anchor.operation:
                        break
                    flops += self._flops_within(op.operation)
                anchor = anchor.operation.block.owner
        return SiteSlack(early, flops)

    def _flops_within(self, operation: ir.Operation) -> float:
        """The dot_generals' FLOPs of ``operation`` and of the ops nested in its regions (a loop
        body counted once)."""
        if operation.name == "stablehlo.dot_general":
            return self.flops(operation.opview)
        total = 0.0
        for region in operation.regions:
            for block in region.blocks:
                for op in block.operations:
                    total += self._flops_within(op.operation)
        return total
