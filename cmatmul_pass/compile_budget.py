"""The rewritten program's size as XLA compiles it, and the budget the default keeps it within.

XLA's compile time grows with the instructions it compiles: every HLO pass walks them, and on
a CPU the thunks of the entry computation are ordered by a dependency graph whose construction
grows faster than their count.  A ring written straight-line (``full``, ``bidi-full``, a ring
of 4 in ``bidi``) is all of its rounds' slices, dots, adds and permutes in the program; a loop
form is one loop holding one or two rounds.  So the pass measures a program by
:func:`program_weight`, the ops XLA compiles: every op but those it folds away (constants,
reshapes, converts, broadcasts, tuples, barriers, sharding annotations), each call counted as
its callee (XLA inlines calls, so a function called from 32 layers is compiled 32 times), each
loop's body once plus :data:`LOOP_WEIGHT` (a loop of one trip, which XLA removes, plus nothing).

XLA CPU compiles the bench's 7B-class training steps (4 to 32 layers, original and rewritten) in
about 0.7 s + 1.3 ms per op of that weight: :func:`compile_ratio` predicts a rewritten program's
compile time over its original's as ``(FIXED_WEIGHT + rewritten) / (FIXED_WEIGHT + original)``.
Calibrated there, it is within about 20 % of the measured ratio up to about 2x; larger growth
compiles slower than predicted (the entry computation's dependency graph grows faster than its
thunks).

:class:`CompileBudget` is what ``Options(compile_budget=r)`` (default :data:`DEFAULT_BUDGET`)
keeps under ``policy="auto"``: the predicted ratio at most ``r`` (a program may always grow by
:data:`FLOOR_OPS`; at ``r = 1`` by nothing).  Sites are taken in the order the pass meets them
(psums, scatters, gathers; a model's layers in order); each site's ring is priced before it is
built (:meth:`CompileBudget.estimate`: the dots of its rounds outside a loop and of one loop
trip, at the ops per dot its shape's first ring measured, or :data:`OPS_PER_DOT` before any),
and where the variant the cost model prefers does not fit what is left, the site takes the
fastest variant that fits and still pays (a loop form; a psum, fewer chunks), or stays as
written (reason ``compile_budget``).  The first ring of each shape is then measured (its
block's weight before and after) and charged; later ones are charged as priced.  A region
that replay copies (identical layers) is priced once for all its copies; its probe takes its
twin's choice.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from . import cost, ir_utils
from .ring_plan import _halves, _loop_run, _plan_of
from ._jax_private import ir
from .program_cost import _trip_count

#: the default budget: the rewritten program's predicted compile time (:func:`compile_ratio`) at
#: most this many times the original's (under 1.5, as the compile's growth with the program's
#: size is a little steeper than linear on the largest programs)
DEFAULT_BUDGET = 1.4
#: the compile's fixed part, in ops: XLA CPU compiles in about 0.7 s + 1.3 ms per op of
#: :func:`program_weight` (the bench's 7B-class steps at 4 and 32 layers, original and rewritten)
FIXED_WEIGHT = 540
#: what any program may grow by, whatever its budget: a small module's compile is mostly fixed
#: costs, and this many ops are about a third of a second of it
FLOOR_OPS = 256
#: what a loop adds over its body's ops (calibrated on the bench's sequence-parallel step:
#: 32 one-round loops compile as about 16 more ops each would)
LOOP_WEIGHT = 16
#: ops a ring round adds per dot it computes, before a ring of the site's shape was measured
#: (a block's slice, its dot, the add or update of its result; the round's permute and
#: index arithmetic spread over its dots)
OPS_PER_DOT = 6
#: ops a psum's chunk adds, before a chunked psum of the site's shape was measured (its
#: operands' slices, its dot, the ops after it, its all_reduce)
OPS_PER_CHUNK = 8
#: ops XLA folds into the instructions around them, or that annotate: not counted
FOLDED = frozenset({
    "stablehlo.constant", "stablehlo.reshape", "stablehlo.get_tuple_element", "stablehlo.tuple",
    "stablehlo.optimization_barrier", "stablehlo.broadcast_in_dim", "stablehlo.convert", "stablehlo.iota",
    "stablehlo.transpose", "stablehlo.custom_call", "func.return", "stablehlo.return", "sdy.return",
    "sdy.sharding_constraint",
})
#: ops whose regions the weight walks in place (their bodies run where they stand)
INLINE = frozenset({"sdy.manual_computation", "sdy.named_computation", "stablehlo.case", "stablehlo.if"})


def program_weight(module: ir.Module) -> int:
    """The ops XLA compiles for ``module``'s ``main`` (see the module's docstring)."""
    functions = _functions(module)
    main = functions.get("main")
    return 0 if main is None else _Weigher(functions).block(main.regions[0].blocks[0])


def compile_ratio(original: int, rewritten: int) -> float:
    """The rewritten program's predicted compile time over the original's, from their weights."""
    return (FIXED_WEIGHT + rewritten) / (FIXED_WEIGHT + original)


def block_weight(block: ir.Block, module: ir.Module) -> int:
    """:func:`program_weight` of one block of ``module`` (its calls counted as their callees)."""
    return _Weigher(_functions(module)).block(block)


def _functions(module: ir.Module) -> dict[str, ir.Operation]:
    return {ir_utils.symbol_name(op): op.operation for op in module.body.operations
            if op.operation.name == "func.func"}


class _Weigher:
    def __init__(self, functions: dict[str, ir.Operation]):
        self.functions = functions
        self.memo: dict[str, int] = {}

    def block(self, block: ir.Block) -> int:
        total = 0
        for op in block.operations:
            total += self.op(op.operation)
        return total

    def op(self, op: ir.Operation) -> int:
        name = op.name
        if name in FOLDED:
            return 0
        if name == "func.call":
            return self.callee(ir.FlatSymbolRefAttr(op.attributes["callee"]).value)
        if name in INLINE:
            return sum(self.block(b) for r in op.regions for b in r.blocks)
        if name == "stablehlo.while":
            body = sum(self.block(b) for r in op.regions for b in r.blocks)
            return body + (0 if _trip_count(op) == 1 else LOOP_WEIGHT)
        return 1

    def callee(self, name: str) -> int:
        if name not in self.memo:
            f = self.functions.get(name)
            self.memo[name] = 0  # (a recursive call: counted once)
            self.memo[name] = self.block(f.regions[0].blocks[0]) if f is not None and f.regions[0].blocks else 0
        return self.memo[name]


def ring_units(shape: cost.SiteShape, variant: str) -> tuple[int, bool]:
    """(the dots a ring of ``shape`` in ``variant`` writes into the program: those of its rounds
    outside a loop and of one loop trip; whether it has a loop of more than one trip)."""
    bidirectional, unroll = cost.VARIANTS[variant]
    plan, signatures, _ = _plan_of(shape, bidirectional)
    lo, hi = _loop_run(signatures, unroll)
    per_round = [max(1, round(r.compute * shape.ring)) * (2 if _halves(shape, bidirectional) else 1)
                 for r in plan]
    trips = (hi - lo) // (unroll or 1) if hi > lo else 0
    written = [n for r, n in enumerate(per_round) if not lo <= r < hi] + per_round[lo:lo + (unroll or 1)] * bool(trips)
    return sum(written) * len(shape.dot_flops), trips > 1


@dataclass
class CompileBudget:
    """What the rewritten program may still add (in :func:`program_weight`'s ops), and what the
    sites' rings weighed."""

    original: int
    ratio: float
    module: ir.Module | None = field(default=None, repr=False, compare=False)
    spent: int = 0
    #: ("ring", shape) -> ops per written dot, ("chunk", shape) -> ops per psum chunk: as the first
    #: rewrite of each measured them
    per_unit: dict = field(default_factory=dict)
    #: the variant (None: left as written) and note each site key got, for a replayed region's probe
    chosen: dict = field(default_factory=dict)

    @property
    def allowed(self) -> float:
        """The ops the rings may add: :func:`compile_ratio` at most :attr:`ratio`, or
        :data:`FLOOR_OPS` where that is more (none at a ratio of 1)."""
        if self.ratio <= 1:
            return 0.0
        return max((FIXED_WEIGHT + self.original) * (self.ratio - 1), FLOOR_OPS)

    def estimate(self, shape: cost.SiteShape, variant: str) -> float:
        return self._priced(("ring", shape), *ring_units(shape, variant))

    def estimate_chunks(self, shape: cost.SiteShape, chunks: int) -> float:
        return self._priced(("chunk", shape), chunks, False)

    def _priced(self, key: tuple, units: int, looped: bool) -> float:
        default = OPS_PER_DOT if key[0] == "ring" else OPS_PER_CHUNK
        return units * self.per_unit.get(key, default) + LOOP_WEIGHT * looped

    def fits(self, weight: float) -> bool:
        return self.spent + weight <= self.allowed

    def choose(self, key, shape: cost.SiteShape, prediction: cost.Prediction, named: bool, margin: float,
               copies: int) -> tuple[str | None, str]:
        """The variant a site of ``shape`` is built in (None: left as written) and why it is not
        the preferred one ('' when it is).  ``named``: the options name the variant (no other is
        taken); ``copies``: how many times the program holds the site (0: a replayed region's
        probe, which takes what its twin took)."""
        preferred = prediction.variant
        others = [] if named else sorted((v for v in cost.VARIANTS if v != preferred and
                                          prediction.speedup[v] >= 1 + margin), key=lambda v: -prediction.speedup[v])
        return self._pick(key, copies, [preferred, *others], lambda v: self.estimate(shape, v),
                          lambda v: f"{v} (predicted {prediction.speedup[v]:.3f}x)", "its ring")

    def choose_chunks(self, key, shape: cost.SiteShape, prediction: cost.AllReducePrediction, chunks: int,
                      named: bool, margin: float, copies: int) -> tuple[int | None, str]:
        """:meth:`choose` for a psum chunked ``chunks`` ways: that count, or (unless ``named``) a
        smaller one that fits and still pays, or None."""
        fewer = [] if named else sorted((k for k in prediction.chunk_s if k < chunks and
                                         prediction.speedup("chunk", k) >= 1 + margin), reverse=True)
        return self._pick(key, copies, [chunks, *fewer], lambda k: self.estimate_chunks(shape, k),
                          lambda k: f"{k} chunks (predicted {prediction.speedup('chunk', k):.3f}x)", "its chunks")

    def _pick(self, key, copies: int, candidates: list, estimate, name, what: str) -> tuple:
        """The first of ``candidates`` (the preferred first) whose ``estimate`` in every copy fits,
        with the note saying why it is not the preferred one; (None, reason) where none fits.  A
        probe (``copies`` 0) takes what ``key`` took before."""
        if copies == 0 and key in self.chosen:
            return self.chosen[key]
        preferred = candidates[0]
        for candidate in candidates:
            if self.fits(estimate(candidate) * copies):
                why = "" if candidate == preferred else (
                    f"built {name(candidate)}, not {name(preferred)}: that would take the program past the compile "
                    f"budget ({self.describe()})")
                self.chosen[key] = candidate, why
                return self.chosen[key]
        many = f" in its {copies} copies" if copies > 1 else ""
        self.chosen[key] = None, (f"{what} would take the program past the compile budget ({self.describe()}; "
                                  f"{name(preferred)}: about {estimate(preferred) * max(copies, 1):.0f} ops{many})")
        return self.chosen[key]

    def any_ring_fits(self, shape: cost.SiteShape, copies: int) -> bool:
        """Does some variant of a ring of ``shape`` fit what is left?"""
        return any(self.fits(self.estimate(shape, v) * copies) for v in cost.VARIANTS)

    def building_ring(self, block: ir.Block, shape: cost.SiteShape, variant: str, copies: int):
        """:meth:`_building` a ring of ``shape`` in ``variant``."""
        return self._building(block, ("ring", shape), *ring_units(shape, variant), copies)

    def building_chunks(self, block: ir.Block, shape: cost.SiteShape, chunks: int, copies: int):
        """:meth:`_building` a psum of ``shape`` chunked ``chunks`` ways."""
        return self._building(block, ("chunk", shape), chunks, False, copies)

    @contextlib.contextmanager
    def _building(self, block: ir.Block, key: tuple, units: int, looped: bool, copies: int):
        """Run the rewrite inside (in ``block``) and charge what it added, ``copies`` times: the
        first rewrite of ``key`` measured (``block``'s weight before and after; its ops per unit
        learned), later ones priced as it was."""
        known = key in self.per_unit
        before = None if known else block_weight(block, self.module)
        yield
        if known:
            added = round(self._priced(key, units, looped))
        else:
            added = block_weight(block, self.module) - before
            if units:
                self.per_unit[key] = max(1.0, (added - LOOP_WEIGHT * looped) / units)
        self.spent += added * copies

    def describe(self) -> str:
        return (f"{self.ratio:g}x the original's predicted compile time, which {self.allowed:.0f} ops over its "
                f"{self.original} allow; {self.spent} added so far")
