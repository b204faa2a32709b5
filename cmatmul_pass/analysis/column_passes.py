"""Passes over gathered columns: a region that reads values all-gathered along one dim ``J`` (the
*columns*), takes statistics over ``J`` and reads them back column by column, planned as ``P``
rings of column blocks (the rewrite: :mod:`cmatmul_pass.rewrites.column_ring`).  Attention's
backward is one: the scores' max and sums over the keys, then per key the gradient of its
probability, summed into dQ and scattered back as dK and dV.

The values of a region, for one group of all_gathers over the same devices and shard length:

* **column values** carry ``J``: the gathered values and what ops separable along ``J`` compute
  from them (:mod:`.separable`: pointwise ops, layout ops, dots with ``J`` free or batched);
* **statistics** take ``J`` away: a ``reduce`` whose dims include ``J`` (``add`` from 0,
  ``maximum``, ``minimum``) and a ``dot_general`` contracting ``J``;
* **row values** are computed from statistics without ``J``;
* the **outputs**: statistics and row values read after the region, and column values scattered
  back by a ``reduce_scatter`` (``add``) along ``J`` over the gathers' devices.

Identity.  Cut ``J`` into the ring's ``n`` blocks ``J_k``.  A column value's block ``k`` depends
only on block ``k`` of the gathered values and on row values (separability); a statistic is
``⊕_k`` of the same statistic over ``J_k`` (``⊕``: its reduce's op, or ``+`` for a dot: exact for
max and min, a reordering of the sum for ``add``); a reduce_scatter's result on the device of
position ``k`` is ``Σ_devices`` of its operand's block ``k``.  Give every value a *level*: 0 for
values from outside the region and for the gathered values, a column or row op the largest of
its operands', a statistic one more than its operand's.  Then pass ``p`` (a ring over the ``n``
blocks) can compute every statistic of level ``p`` once the row values of lower levels are
known, and the last pass every scattered column value, its partial sums travelling around the
ring with the block they belong to.  ``P`` is the largest level (one more for the scatters).

Two identities merge passes:

* **row factors**: for ``c`` constant along the summed dims (a broadcast of a row value),
  ``Σ_J c·y = c·Σ_J y`` and ``Σ_J y/c = (Σ_J y)/c``; the multiplies and divides by row factors
  on the summand's way to a sum (each op on that way reading the summand once: multiplies,
  divides of it, converts, negations, selects between it and zero) are left out of the summand
  and applied to the sum;
* **online max** (flash attention's): where ``e = exp(x - B(g(M)))``, ``M`` the max over ``J`` of
  ``x`` (alone), ``g`` a chain of maxima with constants, ``B`` a broadcast back along ``J``, a
  sum of a summand elementwise linear in ``e`` (its other operands of lower level than ``M``)
  runs in ``M``'s pass: with ``r_t = g(m_t)``, ``m_t`` the running max (``-inf`` taken as 0),
  ``s_t = s_{t-1}·exp(r_{t-1} - r_t) + Σ_{J_t} y(exp(x - r_t))`` ends at the sum against
  ``g(M)``.

Side conditions, each checked here (a region failing one is left as written, with the reason on
its first gather): every reader of a column value is a column op, a statistic or a scatter of
the region (``cols_region``: a residual, a loop, a non-separable op); a side operand spanning
``J`` is computed from outside values, or is a broadcast of a row value (``cols_region``); the
row ops read back are pure, single-result ops without regions (``cols_region``); sums start from
zero (``cols_region``).  The region is taken only where a column value reads a statistic (at
least two passes without the merges) and something is scattered back: one pass is the
gather and scatter rings' work) — and where it takes a max over ``J`` (a softmax's, a
log-sum-exp's: a norm's sums over gathered features are the norm motions' to take, in one ring).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import ir_utils
from .._jax_private import hlo, ir
from ..errors import Decline
from ..matchers.attention import FREE, LIN, ZERO, linear_class
from .separable import REBUILD, SLICE, NotSeparable, Step, step_of

AG, RS, DOT = "stablehlo.all_gather", "stablehlo.reduce_scatter", "stablehlo.dot_general"
#: a statistic's reduce ops (each combines two blocks' partial statistics too)
COMBINE = frozenset({"stablehlo.add", "stablehlo.maximum", "stablehlo.minimum"})
#: ops a summand passes to its sum keeping it linear in it (one operand on the way)
_THROUGH = frozenset({"stablehlo.multiply", "stablehlo.divide", "stablehlo.convert", "stablehlo.negate",
                      "stablehlo.select"})


def _opview(op) -> ir.OpView:
    return op.opview if isinstance(op, ir.Operation) else op


def _where(op: ir.OpView) -> str:
    return f"the {op.operation.name} at {ir_utils.render_location(op.location)}"


@dataclass(eq=False)
class Online:
    """A max over ``J`` whose pass also computes the sums of what is linear in ``exp(x - B(g(M)))``."""

    top: ir.OpView  # M: the reduce max
    g: tuple[ir.OpView, ...]  # maxima with constants, M -> r
    spread: tuple[ir.OpView, ...]  # broadcasts r -> the subtraction's operand
    subtract: ir.OpView
    exp: ir.OpView


@dataclass(eq=False)
class Statistic:
    op: ir.OpView  # a reduce over J or a dot contracting J
    combine: str  # how two blocks' partial statistics combine
    level: int  # its pass
    #: the multiplies and divides by row factors left out of the summand (by operation), applied to the sum
    skipped: frozenset = frozenset()
    factors: tuple[tuple[ir.OpView, int], ...] = ()  # (skipped op, its factor's operand index), innermost first
    online: Online | None = None  # merged into that max's pass, rescaled
    summand: int = 0  # the operand index whose dims the factors and rescales follow (a dot: the one carrying them)


@dataclass(eq=False)
class ColumnPlan:
    gathers: tuple[ir.OpView, ...]  # program order
    dims: dict  # column value -> its J
    steps: dict  # column op (operation) -> Step
    column_ops: tuple[ir.OpView, ...]  # program order
    statistics: tuple[Statistic, ...]
    row_ops: tuple[ir.OpView, ...]  # the row ops read back (program order)
    scatters: tuple[ir.OpView, ...]
    passes: int
    levels: dict = field(default_factory=dict)  # value -> level
    rows: frozenset = frozenset()  # the region's row values
    block: int = 0  # columns per block (a shard's length)
    ring: object = None
    region: object = None  # the manual region (matchers.ManualRegion)

    @property
    def anchor(self) -> ir.OpView:
        return self.gathers[0]

    def needed(self, pass_: int) -> tuple[list[ir.OpView], list[Statistic], list[ir.OpView]]:
        """Pass ``pass_``'s column ops (program order), its statistics and scatters."""
        stats = [s for s in self.statistics if s.level == pass_]
        scatters = list(self.scatters) if pass_ == self.passes else []
        wanted: set = set()
        frontier = [v for s in stats for v in s.op.operation.operands if v in self.dims]
        frontier += [s.operation.operands[0] for s in scatters]
        while frontier:  # (a left-out factor's op included: the pass may read past it or not)
            op = ir_utils.producer(frontier.pop())
            if op is None or op.operation in wanted or op.operation not in self.steps:
                continue
            wanted.add(op.operation)
            frontier.extend(w for w in op.operation.operands if w in self.dims)
        ops = [o for o in self.column_ops if o.operation in wanted]
        return ops, stats, scatters


def _combine(op: ir.OpView) -> str | None:
    body = [o.operation.name for o in op.operation.regions[0].blocks[0].operations]
    return body[0] if len(body) == 2 and body[0] in COMBINE else None


def _same_devices(a: ir.OpView, b: ir.OpView) -> bool:
    return a.operation.attributes["replica_groups"] == b.operation.attributes["replica_groups"]


class _Region:
    """One region: the column values, statistics and scatters one group of gathers reaches."""

    def __init__(self, block: ir.Block, ops: list, shard: int, position: dict):
        self.block, self.ops, self.shard, self.position = block, ops, shard, position
        self.dims: dict = {}  # column value -> its J
        self.steps: dict = {}
        self.column_ops: list = []
        self.stats: list[ir.OpView] = []
        self.scatters: list[ir.OpView] = []
        self.gathers: list[ir.OpView] = []
        self.problem: str | None = None


class BlockColumns:
    """Every region of one block, for the all_gathers over one group of devices with one shard
    length, found in one program-order walk (gathers joined where one op reads both's values)."""

    def __init__(self, gather: ir.OpView):
        self.gather = gather
        self.block = gather.operation.block
        dim = ir_utils.int_attr(gather, "all_gather_dim")
        self.shard = ir.RankedTensorType(gather.operation.operands[0].type).shape[dim]
        self.ops = [_opview(o) for o in self.block.operations]
        self.position = {o.operation: i for i, o in enumerate(self.ops)}
        self.regions: dict = {}  # a gather (operation) -> its region
        self._walk()

    @staticmethod
    def worth_walking(gather: ir.OpView) -> bool:
        """Does ``gather``'s block hold a max reduce over a dim of the gathered length (no region
        without one is taken: :func:`plan`)?"""
        dim = ir_utils.int_attr(gather, "all_gather_dim")
        length = ir.RankedTensorType(gather.operation.results[0].type).shape[dim]
        for op in gather.operation.block.operations:
            if op.operation.name == "stablehlo.reduce" and _combine(op) == "stablehlo.maximum":
                shape = ir.RankedTensorType(op.operation.operands[0].type).shape
                if any(shape[d] == length for d in ir_utils.i64s(op, "dimensions")):
                    return True
        return False

    @staticmethod
    def key(gather: ir.OpView) -> tuple:
        """What a block's walk is shared by: the block (its op), the devices, the shard length."""
        dim = ir_utils.int_attr(gather, "all_gather_dim")
        shard = ir.RankedTensorType(gather.operation.operands[0].type).shape[dim] if dim is not None else None
        return gather.operation.parent, str(gather.operation.attributes["replica_groups"]), shard

    def region(self, gather: ir.OpView) -> _Region:
        return self.regions[gather.operation]

    def _candidate(self, op: ir.OpView) -> bool:
        if op.operation.name != AG or len(op.operation.operands) != 1 or not _same_devices(op, self.gather):
            return False
        d = ir_utils.int_attr(op, "all_gather_dim")
        return d is not None and ir.RankedTensorType(op.operation.operands[0].type).shape[d] == self.shard

    def _walk(self) -> None:
        component = {}  # gather operation -> its representative
        owner: dict = {}  # column value -> gather operation
        dims: dict = {}
        steps: dict = {}

        def find(g):
            while component[g] is not g:
                g = component[g]
            return g

        found: list = []  # (op, kind, a gather it reaches)
        for op in self.ops:
            if self._candidate(op):
                component[op.operation] = op.operation
                dims[op.operation.results[0]] = ir_utils.int_attr(op, "all_gather_dim")
                owner[op.operation.results[0]] = op.operation
                found.append((op, "gather", op.operation))
                continue
            on_path = [dims.get(v) for v in op.operation.operands]
            if all(d is None for d in on_path):
                continue
            gathers = {find(owner[v]) for v in op.operation.operands if v in dims}
            first = next(iter(gathers))
            for g in gathers:
                component[g] = first
            kind, step = self._classify(op, on_path)
            found.append((op, kind, first))
            if kind == "column":
                steps[op.operation] = step
                for r in op.operation.results:
                    dims[r] = step.out_dim
                    owner[r] = first
        regions: dict = {}
        for op, kind, g in found:
            if find(g) not in regions:
                regions[find(g)] = _Region(self.block, self.ops, self.shard, self.position)
            region = regions[find(g)]
            if kind == "gather":
                region.gathers.append(op)
                self.regions[op.operation] = region
            elif kind == "column":
                region.column_ops.append(op)
                region.steps[op.operation] = steps[op.operation]
            elif kind == "statistic":
                region.stats.append(op)
            elif kind == "scatter":
                region.scatters.append(op)
            elif region.problem is None:
                region.problem = kind
        for v, d in dims.items():
            regions[find(owner[v])].dims[v] = d

    def _classify(self, op: ir.OpView, on_path: list) -> tuple[str, Step | None]:
        name = op.operation.name
        if name == RS:
            if len(op.operation.operands) == 1 and _combine(op) == "stablehlo.add" and \
                    ir_utils.int_attr(op, "scatter_dimension") == on_path[0] and _same_devices(op, self.gather):
                return "scatter", None
            return f"{_where(op)} scatters a column value otherwise than summed along the gathered dim over the " \
                   "gathers' devices", None
        if name == "stablehlo.reduce" and len(op.operation.operands) == 2 and on_path[0] is not None \
                and on_path[0] in ir_utils.i64s(op, "dimensions"):
            if _combine(op) is None:
                return f"{_where(op)} reduces over the gathered dim with another op than add, max or min", None
            if _combine(op) == "stablehlo.add" and not ir_utils.is_zero_splat(op.operation.operands[1]):
                return f"{_where(op)} sums over the gathered dim from a nonzero init", None
            return "statistic", None
        if name == DOT and not ir_utils.is_grouped_dot(op):
            numbers = hlo.DotDimensionNumbers(op.operation.attributes["dot_dimension_numbers"])
            contracting = (numbers.lhs_contracting_dimensions, numbers.rhs_contracting_dimensions)
            sides = [s for s in (0, 1) if on_path[s] is not None and on_path[s] in contracting[s]]
            if sides:
                s = sides[0]
                other = contracting[1 - s][list(contracting[s]).index(on_path[s])]
                if on_path[1 - s] is not None and on_path[1 - s] != other:
                    return f"{_where(op)} contracts two column values along unmatched dims", None
                return "statistic", None
        try:
            return "column", step_of(op, on_path)
        except NotSeparable as e:
            return str(e), None


class _Planner:
    """Levels, merges and passes of one region (module docstring)."""

    def __init__(self, region: _Region):
        self.r = region
        self.stats = {o.operation: o for o in region.stats}
        self.column = {o.operation for o in region.column_ops}
        self.scatters = {o.operation for o in region.scatters}
        self.row: set = set()  # row values of the region
        self.row_ops: list[ir.OpView] = []
        self.level: dict = {}
        self.plans: dict = {}  # statistic operation -> Statistic

    def lvl(self, v: ir.Value) -> int:
        return self.level.get(v, 0)

    def run(self) -> None:
        r = self.r
        # (the region's ops lie between its first gather and its last op: only those are read back)
        span = [r.position[o.operation] for o in (*r.gathers, *r.column_ops, *r.stats, *r.scatters)]
        for op in r.ops[min(span):max(span) + 1]:
            o = op.operation
            if o in self.stats:
                plan = self._statistic(op)
                self.plans[o] = plan
                self.level[o.results[0]] = plan.level
                self.row.add(o.results[0])
            elif o in self.column:
                self.level.update((v, max((self.lvl(w) for w in o.operands), default=0)) for v in o.results)
            elif any(v in self.row for v in o.operands) and o not in self.scatters:
                self.row_ops.append(op)
                for v in o.results:
                    self.row.add(v)
                    self.level[v] = max(self.lvl(w) for w in o.operands)

    # ---------------------------------------------------------------- a statistic's level
    def _statistic(self, op: ir.OpView) -> Statistic:
        combine = _combine(op) if op.operation.name == "stablehlo.reduce" else "stablehlo.add"
        operands = [v for v in op.operation.operands[:2] if v in self.r.dims] if op.operation.name == DOT \
            else [op.operation.operands[0]]
        summand = list(op.operation.operands).index(operands[0])
        # (a dot's other operand, a row value, and a reduce's init: known before the pass)
        sides = max((self.lvl(v) for v in op.operation.operands if v not in self.r.dims), default=0)
        plain = max([self._level_of(v, frozenset()) for v in operands] + [sides]) + 1
        if combine != "stablehlo.add":
            return Statistic(op, combine, plain, summand=summand)
        # row factors on the summand's way (one summand's: a dot's other column operand keeps its own)
        candidates = [Statistic(op, combine, plain, summand=summand)]
        for v in operands:
            skipped, factors = self._factors(v, op)
            if factors:
                others = [self._level_of(w, frozenset()) for w in operands if w != v]
                level = max([self._level_of(v, skipped), sides] + others) + 1
                candidates.append(Statistic(op, combine, level, skipped, factors,
                                            summand=list(op.operation.operands).index(v)))
        candidates += [c for c in map(lambda c: self._online(c, operands), list(candidates)) if c is not None]
        # the fewest passes; of those, the fewest factors taken out of the sum (the original's order)
        return min(candidates, key=lambda c: (c.level, len(c.factors)))

    def _level_of(self, v: ir.Value, skipped: frozenset) -> int:
        """``v``'s level with the ops of ``skipped`` read as their summand operand."""
        op = ir_utils.producer(v)
        if op is None or op.operation not in self.column:
            return self.lvl(v)
        if not skipped:
            return self.lvl(v)
        if op.operation in skipped:
            return self._level_of(self._on_way(op), skipped)
        return max(self._level_of(w, skipped) for w in op.operation.operands)

    def _on_way(self, op: ir.OpView) -> ir.Value:
        """The operand of a multiply or divide on the summand's way that is the summand."""
        return next(v for v in op.operation.operands if v in self.r.dims)

    def _factors(self, v: ir.Value, stat: ir.OpView) -> tuple[frozenset, tuple]:
        """The multiplies and divides by row factors (broadcasts of row values constant along the
        summed dims) on the summand ``v``'s way from its producers to ``stat``: the product tree
        below ``v`` through ops of degree one in the branch walked (a multiply's either column
        operand, a divide's dividend, a convert, a negation, a select between it and zero)."""
        skipped, factors = set(), []
        summed = self._summed_dims(stat, v)
        frontier = [v]
        while frontier:
            op = ir_utils.producer(frontier.pop())
            if op is None or op.operation not in self.column or op.operation.name not in _THROUGH:
                continue
            operands = list(op.operation.operands)
            on_way = [i for i, w in enumerate(operands) if w in self.r.dims]
            name = op.operation.name
            if len(set(operands)) != len(operands):
                continue
            if name == "stablehlo.select":
                on_way = [i for i in on_way if i > 0 and ir_utils.is_zero_splat(operands[3 - i])]
            elif name == "stablehlo.divide":
                on_way = [i for i in on_way if i == 0]
            if name in ("stablehlo.multiply", "stablehlo.divide") and len(on_way) == 1 and \
                    self._row_factor(operands[1 - on_way[0]], summed) and \
                    (name == "stablehlo.multiply" or on_way[0] == 0):
                skipped.add(op.operation)
                factors.append((op, 1 - on_way[0]))
            frontier.extend(operands[i] for i in on_way)
        # innermost (latest in program order... applied in any order: they commute) first
        return frozenset(skipped), tuple(reversed(factors))

    def _summed_dims(self, stat: ir.OpView, v: ir.Value) -> set[int]:
        if stat.operation.name == "stablehlo.reduce":
            return set(ir_utils.i64s(stat, "dimensions"))
        numbers = hlo.DotDimensionNumbers(stat.operation.attributes["dot_dimension_numbers"])
        side = list(stat.operation.operands).index(v)
        return set((numbers.lhs_contracting_dimensions, numbers.rhs_contracting_dimensions)[side])

    def _row_factor(self, factor: ir.Value, summed: set[int]) -> bool:
        """Is ``factor`` a broadcast of a row value of the region, constant along ``summed``?"""
        op = ir_utils.producer(factor)
        if op is None or op.operation.name != "stablehlo.broadcast_in_dim":
            return False
        source = op.operation.operands[0]
        if source not in self.row:
            return False
        shape = ir.RankedTensorType(source.type).shape
        mapping = ir_utils.i64s(op, "broadcast_dimensions")
        return all(shape[i] == 1 for i, d in enumerate(mapping) if d in summed)

    # ---------------------------------------------------------------- online max
    def _online(self, stat: Statistic, operands: list[ir.Value]) -> Statistic | None:
        """``stat`` merged into a max's pass where its summand is linear in that max's exponential."""
        summand = stat.op.operation.operands[stat.summand]
        found = self._exponential(summand, stat.skipped)
        if found is None:
            return None
        online, top_level = found
        others = [w for w in stat.op.operation.operands if w != summand]
        linear = self._linear(summand, online.exp.result, stat.skipped, top_level)
        if not linear or any(self._level_of(w, frozenset()) >= top_level for w in others):
            return None
        x = online.subtract.operation.operands[0]
        j = self.r.dims[x]
        # the sum over J alone, of a summand shaped as x (its rows rescaled where x's stand)
        if self._summed_dims(stat.op, summand) != {j} or self.r.dims[summand] != j or \
                ir.RankedTensorType(summand.type).shape != ir.RankedTensorType(x.type).shape:
            return None
        return Statistic(stat.op, stat.combine, top_level, stat.skipped, stat.factors, online, stat.summand)

    def _exponential(self, v: ir.Value, skipped: frozenset) -> tuple[Online, int] | None:
        """The one online pattern ``exp(x - B(g(M)))`` the summand ``v`` is computed from, and M's level."""
        seen, frontier, found = set(), [v], []
        while frontier:
            w = frontier.pop()
            op = ir_utils.producer(w)
            if op is None or op.operation not in self.column or op.operation in seen:
                continue
            seen.add(op.operation)
            if op.operation.name == "stablehlo.exponential":
                pattern = self._pattern(op)
                if pattern is not None:
                    found.append(pattern)
                    continue
            frontier.extend(op.operation.operands)
        if len({p.top.operation for p in found}) != 1:
            return None
        pattern = found[0]
        return pattern, self.plans[pattern.top.operation].level

    def _pattern(self, exp: ir.OpView) -> Online | None:
        subtract = ir_utils.producer(exp.operation.operands[0])
        if subtract is None or subtract.operation.name != "stablehlo.subtract" or subtract.operation not in self.column:
            return None
        x, shifted = subtract.operation.operands
        if x not in self.r.dims:
            return None
        spread, current = [], shifted
        while (op := ir_utils.producer(current)) is not None and op.operation.name in (
                "stablehlo.broadcast_in_dim", "stablehlo.reshape"):
            spread.append(op)
            current = op.operation.operands[0]
        g = []
        while current in self.row and (op := ir_utils.producer(current)) is not None and \
                op.operation.name == "stablehlo.maximum":
            constants = [w for w in op.operation.operands if ir_utils.splat_attribute(w) is not None]
            if len(constants) != 1:
                return None
            g.append(op)
            current = next(w for w in op.operation.operands if w not in constants)
        if (op := ir_utils.producer(current)) is None:
            return None
        top = self.plans.get(op.operation)
        j = self.r.dims[x]
        if top is None or top.combine != "stablehlo.maximum" or op.operation.operands[0] != x or \
                ir_utils.i64s(op, "dimensions") != [j] or top.online is not None:
            return None
        # the spread must carry M's dims back to x's, J apart (a dim of size 1 anywhere)
        shape = ir.RankedTensorType(op.result.type).shape
        places = list(range(len(shape)))
        for b in reversed(spread):
            places = [None if p is None else d for p, d in zip(places, _carried(b, places))]
        wanted = [d for d in range(ir.RankedTensorType(x.type).rank) if d != j]
        if any(p != w and size != 1 for p, w, size in zip(places, wanted, shape)):
            return None
        return Online(op, tuple(reversed(g)), tuple(reversed(spread)), subtract, exp)

    def _linear(self, v: ir.Value, e: ir.Value, skipped: frozenset, top_level: int) -> bool:
        """Is ``v`` elementwise linear in ``e`` (the skipped ops read as their summand), every
        other operand on the way of level below ``top_level``?"""
        memo: dict = {}

        def cls(w: ir.Value) -> str | None:
            if w == e:
                return LIN
            if w in memo:
                return memo[w]
            op = ir_utils.producer(w)
            if op is not None and op.operation in skipped:
                result = cls(self._on_way(op))
            elif op is None or op.operation not in self.column or not self._depends(w, e):
                result = ZERO if ir_utils.is_zero_splat(w) else FREE
                if result == FREE and self._level_of(w, skipped) >= top_level:
                    result = None
            elif op.operation.name == "func.call" or len(op.operation.results) != 1 or any(
                    ir.RankedTensorType(o.type).shape != ir.RankedTensorType(w.type).shape
                    for o in op.operation.operands if ir.RankedTensorType(o.type).rank):
                result = None
            else:
                classes = [cls(o) for o in op.operation.operands]  # (an operand not linear: neither is this)
                result = None if None in classes else linear_class(op.operation.name, classes)
            memo[w] = result
            return result

        return cls(v) == LIN

    def _depends(self, w: ir.Value, e: ir.Value) -> bool:
        seen, frontier = set(), [w]
        while frontier:
            x = frontier.pop()
            if x == e:
                return True
            op = ir_utils.producer(x)
            if op is None or op.operation not in self.column or op.operation in seen:
                continue
            seen.add(op.operation)
            frontier.extend(op.operation.operands)
        return False


def _carried(op: ir.OpView, places: list) -> list:
    """Where a broadcast or a reshape takes each of its operand's dims at ``places`` (None: a dim
    of size 1 a reshape moves or drops; a reshape otherwise keeps the other dims in order)."""
    if op.operation.name == "stablehlo.broadcast_in_dim":
        mapping = ir_utils.i64s(op, "broadcast_dimensions")
        return [None if p is None else mapping[p] for p in places]
    source = ir.RankedTensorType(op.operation.operands[0].type).shape
    target = ir.RankedTensorType(op.result.type).shape
    kept = [d for d, size in enumerate(target) if size != 1]
    if [size for size in source if size != 1] != [target[d] for d in kept]:
        return [None] * len(places)  # (merges or splits dims: no dim of size > 1 is placed)
    big = iter(kept)
    where = {d: next(big) for d, size in enumerate(source) if size != 1}
    return [None if p is None else where.get(p) for p in places]


def plan(gather: ir.OpView, ring=None, manual=None, columns: BlockColumns | None = None) -> ColumnPlan | None:
    """The passes of the region ``gather`` is in (module docstring; ``columns``: its block's walk,
    where one is at hand); None where it is not one this rewrite takes (no statistic read back,
    nothing scattered); Decline(``cols_region``) where it is but a side condition fails."""
    region = (columns or BlockColumns(gather)).region(gather)
    if not region.scatters or not any(_combine(op) == "stablehlo.maximum" for op in region.stats
                                      if op.operation.name == "stablehlo.reduce"):
        return None
    planner = _Planner(region)
    planner.run()
    read_back = any(planner.lvl(v) > 0 for o in region.column_ops for v in o.operation.results)
    if not read_back:
        return None
    if region.problem is not None:
        raise Decline("cols_region", region.problem)
    stats = [planner.plans[o.operation] for o in region.stats]
    scatter_level = max(planner.lvl(s.operation.operands[0]) for s in region.scatters) + 1
    passes = max([s.level for s in stats] + [scatter_level])
    needed = _read_back(planner, region)
    for op in needed:
        o = op.operation
        if len(o.regions) and o.name != "stablehlo.reduce" or len(o.results) != 1 or o.name.startswith("stablehlo.all_") or o.name in (
                "stablehlo.collective_permute", "stablehlo.reduce_scatter", "stablehlo.custom_call",
                "stablehlo.rng", "stablehlo.rng_bit_generator", "func.call", "stablehlo.optimization_barrier"):
            raise Decline("cols_region", f"{_where(op)} computes a row value the columns read back; only plain ops "
                                         "are recomputed between the passes")
    for op in [*region.gathers, *region.column_ops]:
        for r in op.operation.results:
            if any(_opview(u.owner).operation.block != region.block for u in r.uses):
                raise Decline("cols_region", f"{_where(op)}'s value is read inside another op's region")
    spanning = [(op, value, side[1]) for op in region.column_ops
                for value, side in zip(op.operation.operands, region.steps[op.operation].sides)
                if side is not None and side[0] in (SLICE, REBUILD)]
    spanning += [(op, value, dim) for op in region.stats for value, dim in contracted_sides(op, region.dims)]
    for op, value, dim in spanning:
        if not _spanning_ok(value, dim, planner.row):
            raise Decline("cols_region", f"{_where(op)} reads a value spanning the gathered dim that is "
                                         "computed from the region's statistics otherwise than by a broadcast")
    return ColumnPlan(tuple(region.gathers), dict(region.dims), dict(region.steps), tuple(region.column_ops),
                      tuple(stats), tuple(needed), tuple(region.scatters), passes, dict(planner.level),
                      frozenset(planner.row), region.shard, ring, manual)


def _read_back(planner: _Planner, region: _Region) -> list[ir.OpView]:
    """The row ops whose values the column ops, the factors or the online maxima read (program order)."""
    wanted: set = set()
    frontier = [v for o in region.column_ops for v in o.operation.operands if v in planner.row]
    frontier += [f.operation.operands[i] for s in planner.plans.values() for f, i in s.factors]
    frontier += [p.online.top.result for p in planner.plans.values() if p.online]
    row_ops = {o.operation for o in planner.row_ops}
    while frontier:
        op = ir_utils.producer(frontier.pop())
        if op is None or op.operation not in row_ops or op.operation in wanted:
            continue
        wanted.add(op.operation)
        frontier.extend(op.operation.operands)
    return [o for o in planner.row_ops if o.operation in wanted]


def contracted_sides(stat: ir.OpView, dims: dict) -> list[tuple[ir.Value, int]]:
    """A dot statistic's operand that is no column value, and its dim contracted against J."""
    if stat.operation.name != DOT:
        return []
    numbers = hlo.DotDimensionNumbers(stat.operation.attributes["dot_dimension_numbers"])
    contracting = (list(numbers.lhs_contracting_dimensions), list(numbers.rhs_contracting_dimensions))
    operands = list(stat.operation.operands[:2])
    if all(v in dims for v in operands):
        return []
    c = 0 if operands[0] in dims else 1
    return [(operands[1 - c], contracting[1 - c][contracting[c].index(dims[operands[c]])])]


def _spanning_ok(value: ir.Value, dim: int, row: set) -> bool:
    """Can a column block read ``value`` (a side operand spanning ``J`` at ``dim``)? A value
    computed without the region's statistics, or a broadcast of a row value."""
    if not from_rows(value, row):
        return True
    op = ir_utils.producer(value)
    if op is None:
        return False
    if op.operation.name == "stablehlo.broadcast_in_dim":
        mapping = ir_utils.i64s(op, "broadcast_dimensions")
        source = op.operation.operands[0]
        if dim not in mapping or ir.RankedTensorType(source.type).shape[mapping.index(dim)] == 1:
            return True
        return _spanning_ok(source, mapping.index(dim), row)
    return False


def from_rows(value: ir.Value, row: set) -> bool:
    """Is ``value`` computed from the region's row values? (They are the values that depend
    on a statistic, each op reading one is a row op: asking the value itself is enough.)"""
    return value in row
