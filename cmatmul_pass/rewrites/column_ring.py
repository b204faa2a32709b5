"""The passes of a region over gathered columns as rings of column blocks
(:class:`~cmatmul_pass.analysis.column_passes.ColumnPlan`, whose module states the identities
and their side conditions).

Before (attention's backward, recomputed: ``P`` = 2 passes after the merges)::

    %K = all_gather(%k)   %V = all_gather(%v)
    %M = max_J(x(K))   %L = Σ_J e   %U = Σ_J dP·e / L²  ...   // statistics over the columns
    %dQ = Σ_J ds·K                                             // a statistic too
    %dK = reduce_scatter(dsᵀ·Q)   %dV = reduce_scatter(Pᵀ·dO)   // columns scattered back

After: each pass one ring of ``n`` rounds over the gathered shards (the block held in round
``r`` is the one of ring position ``pos + r``)::

    pass 1:  for each round: m' = max(m, max_J x(K_k)); the merged sums rescaled by exp(r - r'),
             plus their block's terms; the next K, V blocks in flight
    between: the row values the columns read back (1/L², ...), from the statistics
    pass 2:  for each round: dQ += ds_k·K_k; the travelling partial dK, dV of block k
             += this device's terms, sent on with the block (one more hop home after the last)

so the column values live a block at a time (``S_local × S/n``).  Nothing moves into control
flow: every device runs every pass's ``n`` rounds.
"""

from __future__ import annotations

from .. import ir_utils
from .._jax_private import hlo, ir
from ..analysis.column_passes import ColumnPlan, Statistic, contracted_sides
from ..analysis.separable import POINTWISE, REBUILD, SLICE
from ..errors import Decline
from ..ring_plan import gather_streams
from .all_gather_dot import RECEIVE_FROM_NEXT
from .block_operands import _mapped, block as side_block
from .blockwise import block_type, clone_on_block
from .builders import Builder, erase_dead
from .schedule import Applied, RewriteContext, Round, ScheduleStats, emit_rounds, ring_position

#: ops an input of the region computed after its first result is read may be copied earlier through
PURE = POINTWISE | frozenset(f"stablehlo.{n}" for n in (
    "constant", "iota", "broadcast_in_dim", "reshape", "transpose", "slice", "concatenate", "pad", "reduce",
    "dot_general", "partition_id", "replica_id"))


def _hoistable(op: ir.OpView) -> bool:
    """Can ``op`` be copied earlier: a pure op, or a call of a function of pure ops (jnp.where's ``@_where``)?"""
    if op.operation.name != "func.call":
        return op.operation.name in PURE
    callee = ir_utils.Symbols(op).callee(op)
    return callee is not None and all(inner.operation.name in PURE | {"func.return"}
                                      for block in callee.regions[0].blocks for inner in block.operations)


def _narrow(t: ir.RankedTensorType) -> bool:
    return isinstance(t.element_type, ir.FloatType) and ir.FloatType(t.element_type).width < 32


def _wide(t: ir.RankedTensorType) -> ir.RankedTensorType:
    return ir.RankedTensorType.get(t.shape, ir.F32Type.get()) if _narrow(t) else t


def _splat(b: Builder, t: ir.RankedTensorType, scalar: ir.Value) -> ir.Value:
    return b.create("stablehlo.broadcast_in_dim", [t], [scalar],
                    {"broadcast_dimensions": ir.DenseI64ArrayAttr.get([])}).result


def _binary(b: Builder, name: str, x: ir.Value, y: ir.Value) -> ir.Value:
    return b.create(name, [x.type], [x, y]).result


def _places(stat: ir.OpView, index: int) -> list[int | None]:
    """Where each dim of ``stat``'s operand ``index`` stands in its result (None: reduced)."""
    rank = ir.RankedTensorType(stat.operation.operands[index].type).rank
    if stat.operation.name == "stablehlo.reduce":
        reduced = set(ir_utils.i64s(stat, "dimensions"))
        kept = [d for d in range(rank) if d not in reduced]
        return [kept.index(d) if d in kept else None for d in range(rank)]
    numbers = hlo.DotDimensionNumbers(stat.operation.attributes["dot_dimension_numbers"])
    batch = (list(numbers.lhs_batching_dimensions), list(numbers.rhs_batching_dimensions))
    contracting = (list(numbers.lhs_contracting_dimensions), list(numbers.rhs_contracting_dimensions))
    ranks = [ir.RankedTensorType(v.type).rank for v in stat.operation.operands[:2]]
    free = [[d for d in range(ranks[s]) if d not in batch[s] and d not in contracting[s]] for s in (0, 1)]
    offset = len(batch[0]) + (len(free[0]) if index == 1 else 0)
    return [batch[index].index(d) if d in batch[index] else None if d in contracting[index]
            else offset + free[index].index(d) for d in range(rank)]


class _Emitter:
    """Builds the passes at the insertion point (the first op reading a result of the region)."""

    def __init__(self, plan: ColumnPlan, ctx: RewriteContext, at: ir.OpView):
        self.plan, self.ctx, self.at = plan, ctx, at
        self.n = plan.ring.size
        self.b = Builder(ir.Location.fused([g.location for g in plan.gathers]), ctx.constants)
        self.rows: dict = {}  # a row value of the region -> its value in the rewritten program
        self.hoisted: dict = {}
        self.order = {o: i for i, o in enumerate(at.operation.block.operations)}
        self.channels: list[int] = []
        self.stats = ScheduleStats()
        self.sends = 0
        self.clones: list[ir.OpView] = []

    # ---------------------------------------------------------------- values from outside
    def outside(self, v: ir.Value) -> ir.Value:
        """``v`` where the passes can read it: itself, or a copy before the insertion point."""
        op = ir_utils.producer(v)
        if op is None or op.operation.block != self.at.operation.block or \
                self.order[op.operation] < self.order[self.at.operation]:
            return v
        if v in self.hoisted:
            return self.hoisted[v]
        if not _hoistable(op):
            raise Decline("cols_region", f"{op.operation.name} at {ir_utils.render_location(op.location)} computes "
                                         "an input of the region after a result of it is read")
        operands = [self.outside(w) for w in op.operation.operands]
        clone = op.operation.clone()
        for i, w in enumerate(operands):
            clone.operands[i] = w
        for old, new in zip(op.operation.results, clone.results):
            self.hoisted[old] = new
        return self.hoisted[v]

    def row(self, v: ir.Value) -> ir.Value:
        if v in self.plan.rows:
            return self.rows[v]
        return self.outside(v)

    # ---------------------------------------------------------------- the passes
    def emit(self) -> dict:
        """Every pass, the row values between them; returns the statistics' and scatters' new values."""
        plan, b = self.plan, self.b
        with ir.InsertionPoint(self.at.operation):
            self._hoist_inputs()
            self.position = b.position_in_ring(plan.ring, plan.region)
            results: dict = {}
            pending, rows = [], list(plan.row_ops)  # statistics and row ops still to place
            for p in range(1, plan.passes + 1):
                accs = self._pass(p)
                pending += [s for s in plan.statistics if s.level == p]
                results.update((s.operation.results[0], accs[s.operation.results[0]]) for s in plan.scatters
                               if s.operation.results[0] in accs)
                progress = True
                while progress:  # each as soon as what it reads is known, in program order
                    progress = False
                    for stat in list(pending):
                        if all(self._known(f.operation.operands[i]) for f, i in stat.factors):
                            results[stat.op.result] = self.rows[stat.op.result] = self._finish(stat, accs[stat.op.result])
                            pending.remove(stat)
                            progress = True
                    for op in list(rows):
                        if all(self._known(v) for v in op.operation.operands):
                            self._clone_row(op)
                            rows.remove(op)
                            progress = True
        return results

    def _known(self, v: ir.Value) -> bool:
        """Is ``v`` known between the passes (a row value computed, or from outside)?"""
        return v not in self.plan.rows or v in self.rows

    def _hoist_inputs(self) -> None:
        """Copies, before the insertion point, of the inputs computed after it (none are then built inside a loop)."""
        for v in _inputs(self.plan):
            self.outside(v)

    def _clone_row(self, op: ir.OpView) -> None:
        clone = op.operation.clone()
        for i, v in enumerate(op.operation.operands):
            clone.operands[i] = self.row(v)
        for old, new in zip(op.operation.results, clone.results):
            self.rows[old] = new
        self.clones.append(clone.opview)

    def _pass(self, p: int) -> dict:
        plan, n, b = self.plan, self.n, self.b
        ops, stats, scatters = plan.needed(p)
        reads = {v for o in ops for v in o.operation.operands} | \
            {v for s in stats for v in s.op.operation.operands} | {s.operation.operands[0] for s in scatters}
        gathers = [g for g in plan.gathers if g.operation.results[0] in reads]
        (stream,) = gather_streams(n, False)
        pairs = plan.ring.shift_pairs(RECEIVE_FROM_NEXT * stream.shift)
        accs = [self._initial(s) for s in stats] + [b.zeros(_wide(ir.RankedTensorType(s.operation.results[0].type)))
                                                    for s in scatters]
        shards = [self.outside(g.operation.operands[0]) for g in gathers]
        comm = b.at(plan.gathers[0].location)
        tops = {s.online.top.operation for s in stats if s.online is not None}

        def round_fn(rnd: Round, carried: list[ir.Value]) -> list[ir.Value]:
            held, state = carried[:len(gathers)], carried[len(gathers):]
            received = list(held)
            permutes = []
            if rnd.signature == "send":
                for i, v in enumerate(held):
                    self.channels.append(self.ctx.take_channel())
                    received[i] = comm.collective_permute(v, pairs, self.channels[-1])
                    permutes.append(received[i].owner)
            k = ring_position(b, self.position, rnd, n, shift=stream.shift, ring=plan.ring, region=plan.region)
            blocks = _Blocks(self, {g.operation.results[0]: h for g, h in zip(gathers, held)}, k)
            new = list(state)
            before: dict = {}
            for i, s in enumerate(stats):  # the plain statistics (a merged sum's max among them) first
                if s.online is None:
                    if s.op.operation in tops:
                        before[s.op.operation] = state[i]
                    new[i] = self._fold(s, state[i], blocks.partial(s))
            rescaled: dict = {}  # a max (its operation) -> its rescale and reference this round
            for i, s in enumerate(stats):
                if s.online is not None:
                    top = s.online.top.operation
                    if top not in rescaled:
                        j = next(j for j, t in enumerate(stats) if t.op.operation == top)
                        rescaled[top] = self._rescale(s, before[top], new[j])
                    alpha, reference = rescaled[top]
                    partial = blocks.partial(s, reference)
                    scaled = b.mul(state[i], self._spread(s, alpha, state[i]))
                    new[i] = b.add(scaled, b.convert(partial, ir.RankedTensorType(state[i].type).element_type))
            for i, s in enumerate(scatters):
                at = len(stats) + i
                update = blocks.column(s.operation.operands[0])
                total = b.add(state[at], b.convert(update, ir.RankedTensorType(state[at].type).element_type))
                self.channels.append(self.ctx.take_channel())
                new[at] = comm.collective_permute(total, pairs, self.channels[-1])
                permutes.append(new[at].owner)
            self._annotate(rnd, permutes, blocks.dots)
            return received + new

        signatures = ["send"] * (n - 1) + ["last"]
        stats_ = ScheduleStats()
        final = emit_rounds(b, signatures, shards + accs, round_fn, self.ctx.unroll, stats_)
        self.stats = stats_
        self.sends += (n - 1) * len(gathers) + n * len(scatters)
        out = final[len(gathers):]
        results = {s.op.result: acc for s, acc in zip(stats, out)}
        for s, acc in zip(scatters, out[len(stats):]):
            results[s.operation.results[0]] = b.convert(acc, ir.RankedTensorType(s.operation.results[0].type).element_type)
        return results

    def _annotate(self, rnd: Round, permutes: list, dots: list) -> None:
        """With ``--annotate-streams``: the round's dots on its slot's compute stream, each permute
        grouped with a share of them (a round's transfers beside its matmuls)."""
        annotator = self.ctx.annotator
        if not annotator.enabled:
            return
        for dot in dots:
            annotator.mark(dot, 1 + rnd.slot)
        for i, permute in enumerate(permutes):
            annotator.group(permute, dots[i::len(permutes)])

    # ---------------------------------------------------------------- statistics
    def _initial(self, s: Statistic) -> ir.Value:
        t = ir.RankedTensorType(s.op.operation.results[0].type)
        if s.op.operation.name == "stablehlo.reduce":
            if s.combine == "stablehlo.add":
                return self.b.zeros(_wide(t))
            return _splat(self.b, t, self.outside(s.op.operation.operands[1]))
        return self.b.zeros(_wide(t))

    def _fold(self, s: Statistic, acc: ir.Value, partial: ir.Value) -> ir.Value:
        partial = self.b.convert(partial, ir.RankedTensorType(acc.type).element_type)
        return _binary(self.b, s.combine, acc, partial)

    def _reference(self, s: Statistic, m: ir.Value) -> ir.Value:
        """``g(m)``, -inf taken as 0 (a row whose columns so far are all masked)."""
        b = self.b
        chain = s.online.top.result
        for op in s.online.g:
            m = _binary(b, op.operation.name, *[m if v == chain else self.outside(v) for v in op.operation.operands])
            chain = op.result
        t = ir.RankedTensorType(m.type)
        infinity = b.constant_of(ir.DenseElementsAttr.get_splat(
            ir.RankedTensorType.get([], t.element_type), ir.FloatAttr.get(t.element_type, float("-inf"))))
        masked = b.create("stablehlo.compare", [ir.RankedTensorType.get(t.shape, ir.IntegerType.get_signless(1))],
                          [m, _splat(b, t, infinity)],
                          {"comparison_direction": hlo.ComparisonDirectionAttr.get("EQ")}).result
        return b.create("stablehlo.select", [t], [masked, b.zeros(t), m]).result

    def _rescale(self, s: Statistic, m_old: ir.Value, m_new: ir.Value) -> tuple[ir.Value, ir.Value]:
        """``exp(r_old - r_new)`` per row and the running reference ``r_new``."""
        old, new = self._reference(s, m_old), self._reference(s, m_new)
        alpha = self.b.create("stablehlo.exponential", [old.type], [_binary(self.b, "stablehlo.subtract", old, new)])
        return alpha.result, new

    def _spread(self, s: Statistic, row: ir.Value, like: ir.Value) -> ir.Value:
        """A per-row value (the max's dims) broadcast to the statistic ``like``'s shape."""
        x = s.online.subtract.operation.operands[0]
        j = self.plan.dims[x]
        places = _places(s.op, s.summand)
        dims = [places[d] for d in range(ir.RankedTensorType(x.type).rank) if d != j]
        t = ir.RankedTensorType(like.type)
        row = self.b.convert(row, t.element_type)
        return self.b.create("stablehlo.broadcast_in_dim", [t], [row],
                             {"broadcast_dimensions": ir.DenseI64ArrayAttr.get(dims)}).result

    def _finish(self, s: Statistic, acc: ir.Value) -> ir.Value:
        """The statistic from its accumulator: its own type, the row factors left out applied."""
        b = self.b.at(s.op.location)
        t = ir.RankedTensorType(s.op.operation.results[0].type)
        value = b.convert(acc, t.element_type)
        places = _places(s.op, s.summand)
        for op, index in s.factors:
            spread = ir_utils.producer(op.operation.operands[index])
            source = self.row(spread.operation.operands[0])
            mapping = ir_utils.i64s(spread, "broadcast_dimensions")
            shape = ir.RankedTensorType(source.type).shape
            keep = [i for i in range(len(shape)) if places[mapping[i]] is not None]
            if len(keep) < len(shape):
                source = b.create("stablehlo.reshape", [ir.RankedTensorType.get(
                    [shape[i] for i in keep], ir.RankedTensorType(source.type).element_type)], [source]).result
            factor = b.create("stablehlo.broadcast_in_dim", [ir.RankedTensorType.get(
                t.shape, ir.RankedTensorType(source.type).element_type)], [source],
                {"broadcast_dimensions": ir.DenseI64ArrayAttr.get([places[mapping[i]] for i in keep])}).result
            value = _binary(b, op.operation.name, value, b.convert(factor, t.element_type))
        return value


class _Blocks:
    """One round's blocks: column values of the block held, partial statistics."""

    def __init__(self, emitter: _Emitter, held: dict, k: ir.Value):
        self.e, self.held, self.k = emitter, held, k
        self.plan = emitter.plan
        self.start = emitter.b.scaled(k, self.plan.block)
        self.memo: dict = {}
        self.sides: dict = {}
        self.dots: list = []  # the round's matmuls, for stream annotation

    def partial(self, s: Statistic, reference: ir.Value | None = None) -> ir.Value:
        """``s`` over this block (a merged sum: its exponential against ``reference``)."""
        override = {}
        if reference is not None:  # (one broadcast of the reference for the sums that share it)
            shifted = s.online.subtract.operation.operands[1]
            if ("reference", shifted, reference) not in self.sides:
                x = s.online.subtract.operation.operands[0]
                j = self.plan.dims[x]
                t = block_type(x, j, self.e.n)
                self.sides[("reference", shifted, reference)] = self.e.b.create(
                    "stablehlo.broadcast_in_dim", [ir.RankedTensorType.get(t.shape, ir.RankedTensorType(
                        reference.type).element_type)], [reference],
                    {"broadcast_dimensions": ir.DenseI64ArrayAttr.get([d for d in range(t.rank) if d != j])}).result
            override[shifted] = self.sides[("reference", shifted, reference)]
        variant = (s.skipped, reference)
        spanning = dict(contracted_sides(s.op, self.plan.dims))  # a dot's operand read at the block's columns
        operands = []
        for v in s.op.operation.operands:
            if v in self.plan.dims:
                operands.append(self.column(v, variant if (s.skipped or override) else None, override))
            elif v in spanning:
                operands.append(self._side(v, spanning[v]))
            else:
                operands.append(self.e.row(v))
        clone = s.op.operation.clone()
        for i, v in enumerate(operands):
            clone.operands[i] = v
        if clone.name == "stablehlo.dot_general":
            self.dots.append(clone)
        return clone.results[0]

    def column(self, v: ir.Value, variant=None, override: dict | None = None) -> ir.Value:
        """Column value ``v``'s block (``variant``: a statistic's left-out factors and reference)."""
        if v in self.held:
            return self.held[v]
        key = (v, variant)
        if key in self.memo:
            return self.memo[key]
        if variant is not None and not self._affected(v, variant, override):
            return self.column(v)
        op = ir_utils.producer(v)
        skipped = variant[0] if variant is not None else frozenset()
        if op.operation in skipped:
            on_way = next(w for w in op.operation.operands if w in self.plan.dims)
            result = self.column(on_way, variant, override)
            self.memo[key] = result
            return result
        step = self.plan.steps[op.operation]
        operands = []
        for value, side in zip(op.operation.operands, step.sides):
            if override and value in override:
                operands.append(override[value])
            elif side is None:
                operands.append(self.column(value, variant, override))
            elif side[0] == SLICE:
                operands.append(self._side(value, side[1]))
            elif side[0] == REBUILD:
                operands.append(self._rebuilt(value, side[1]))
            else:
                operands.append(self.e.row(value))
        results = clone_on_block(step, operands, self.e.n)
        if op.operation.name == "stablehlo.dot_general":
            self.dots.append(results[0].owner)
        for r, made in zip(op.operation.results, results):
            self.memo[(r, variant)] = made
        return self.memo[key]

    def _affected(self, v: ir.Value, variant, override) -> bool:
        """Does ``v``'s block differ under ``variant`` (it reads a left-out op or the reference)?"""
        skipped = variant[0]
        cache = self.memo.setdefault(("affected", variant), {})
        if v in cache:
            return cache[v]
        op = ir_utils.producer(v)
        if v in self.held or op is None or op.operation not in self.plan.steps:
            result = False
        else:
            result = op.operation in skipped or any(
                (override and w in override) or (w in self.plan.dims and self._affected(w, variant, override))
                for w in op.operation.operands)
        cache[v] = result
        return result

    def _side(self, value: ir.Value, dim: int) -> ir.Value:
        """A side operand spanning J, at the block's columns: through broadcasts of row values, or
        (computed without the statistics) recomputed or sliced by :func:`.block_operands.block`."""
        key = (value, dim)
        if key in self.sides:
            return self.sides[key]
        b = self.e.b
        if value in self.plan.rows:
            op = ir_utils.producer(value)
            mapped = _mapped(op, dim)
            source = op.operation.operands[0]
            inner = self._side(source, mapped) if mapped is not None else self.e.row(source)
            made = b.create("stablehlo.broadcast_in_dim", [block_type(value, dim, self.e.n)], [inner],
                            {"broadcast_dimensions": op.operation.attributes["broadcast_dimensions"]}).result
        else:
            made = side_block(value, dim, self.e.n, self.start, b, self.sides, self.e.outside)
        self.sides[key] = made
        return made

    def _rebuilt(self, value: ir.Value, dim: int) -> ir.Value:
        op = ir_utils.producer(value)
        return self.e.b.create("stablehlo.broadcast_in_dim", [block_type(value, dim, self.e.n)],
                               [self.e.row(op.operation.operands[0])],
                               {"broadcast_dimensions": op.operation.attributes["broadcast_dimensions"]}).result


def _inputs(plan: ColumnPlan) -> list[ir.Value]:
    """The values the region reads from outside it."""
    region = {o.operation for o in (*plan.column_ops, *plan.row_ops, *plan.gathers)}
    region |= {s.op.operation for s in plan.statistics} | {s.operation for s in plan.scatters}
    found = []
    for op in [*plan.column_ops, *plan.row_ops, *(s.op for s in plan.statistics), *plan.gathers]:
        for v in op.operation.operands:
            owner = ir_utils.producer(v)
            if v not in plan.rows and v not in plan.dims and (owner is None or owner.operation not in region):
                found.append(v)
    return found


def check_inputs(plan: ColumnPlan, at: ir.OpView) -> None:
    """Decline (``cols_region``) where an input of the region computed after ``at`` (the
    insertion point) cannot be copied before it (an op with effects, a loop, a collective)."""
    block = at.operation.block
    order = {o: i for i, o in enumerate(block.operations)}
    seen: set = set()
    frontier = _inputs(plan)
    while frontier:
        op = ir_utils.producer(frontier.pop())
        if op is None or op.operation.block != block or op.operation in seen or \
                order[op.operation] < order[at.operation]:
            continue
        seen.add(op.operation)
        if not _hoistable(op):
            raise Decline("cols_region", f"{op.operation.name} at {ir_utils.render_location(op.location)} computes "
                                         "an input of the region after a result of it is read")
        frontier.extend(op.operation.operands)


def insertion_point(plan: ColumnPlan) -> ir.OpView:
    """The first op left after the rewrite that reads a result of the region (or the op after
    the region's last)."""
    block = plan.anchor.operation.block
    ops = [o.opview for o in block.operations]
    order = {o.operation: i for i, o in enumerate(ops)}
    region = {o.operation for o in (*plan.column_ops, *plan.gathers, *plan.scatters)} | \
        {s.op.operation for s in plan.statistics}
    dead = set(region)
    changed = True
    read_back = {o.operation for o in plan.row_ops}
    while changed:  # the row ops only the region's ops read go with it
        changed = False
        for op in plan.row_ops:
            o = op.operation
            if o not in dead and all(ir_utils.ancestor_in(u.owner, block) in dead for r in o.results for u in r.uses):
                dead.add(o)
                changed = True
    readers = [ir_utils.ancestor_in(u.owner, block) for o in region for r in o.results for u in r.uses]
    readers += [ir_utils.ancestor_in(u.owner, block) for o in read_back for r in o.results for u in r.uses]
    first = min((order[r] for r in readers if r is not None and r not in dead), default=None)
    if first is None:
        first = max(order[o] for o in region) + 1
    return ops[first]


def rewrite_column_passes(plan: ColumnPlan, ctx: RewriteContext) -> Applied:
    """Replace the region of ``plan`` by its passes (module docstring)."""
    at = insertion_point(plan)
    emitter = _Emitter(plan, ctx, at)
    results = emitter.emit()
    for value, new in results.items():
        value.replace_all_uses_with(new)
    erase_dead([*plan.scatters, *(s.op for s in plan.statistics), *reversed(plan.column_ops),
                *reversed(plan.row_ops), *plan.gathers])
    erase_dead(list(reversed(emitter.clones)))
    # the inputs copied before the passes, where the region alone read them (users first)
    erase_dead(list(dict.fromkeys(ir_utils.producer(v).operation for v in reversed(list(emitter.hoisted)))))
    stats = sum(1 for s in plan.statistics)
    merged = sum(1 for s in plan.statistics if s.online is not None)
    return Applied(emitter.channels, 1, emitter.stats, emitter.sends,
                   [f"{plan.passes} passes over {plan.ring.size} column blocks of {plan.block}: {stats} statistics "
                    f"({merged} merged into their max's pass), {len(plan.scatters)} scattered back"])
