"""A row-wise DAG between an ``all_gather`` and its dots (a norm of the gathered rows), which the
ring applies to each block it receives (:func:`row_dag`; the module docstring of
:mod:`.all_gather` says where the gather matcher asks for it)."""

from __future__ import annotations

from dataclasses import replace

from .. import ir_utils
from ..analysis.dataflow import Dependents
from .._jax_private import ir
from ..errors import Decline
from ..layout import ROW_OPS, LayoutStep, Sliced, forward_dim, invariant_source, is_elementwise, is_layout_op, row_dim
from ..ring import Ring
from . import all_gather
from .all_gather import DOT, AllGatherSite, _consumer, _hoistable
from .common import ManualRegion, ModuleInfo



def row_dag(ag: ir.OpView, ring: Ring, region: ManualRegion, gather_dim: int, info: ModuleInfo,
             alone: bool = False, assemble: bool = True) -> AllGatherSite | None:
    """The gathered rows reach their dots through ops that work row by row along the gathered dim
    and read them more than once (a norm: ``x * rsqrt(mean(x*x, other dims))`` broadcast back),
    while the raw rows are also read elsewhere (a backward's residual, through ``sdy.return``;
    values of the norm may be too): the ring applies the DAG to each block it receives before that
    block's dot, ``f(all_gather(x))[block k] == f(x_k)``, and assembles the raw blocks for the
    other readers, which compute what they read from the assembled value as before.

    Legal only where every op on the way is row-wise along the ring dim: an elementwise op whose
    other operands are the same in every block (rebuilt at block size) or computed apart from
    the gathered value (read at the block's rows: every device computes every block with its own
    operands, as the original does), a layout op that keeps blocks, a reduce over other dims, a
    broadcast_in_dim taking the ring dim from its operand at full size.  Anything else — an op
    reading other rows of the gathered dim (a reduce over it, a value computed from the gathered
    value by an op outside the DAG, such as a cumulative sum) — and None: the caller's decline
    stands.  The raw rows are the gathered value and its reshapes and sharding constraints in
    the DAG (an untiled gather's rows are the reshape merging its new dim into the rows, which the
    DAG and the other readers share).  None too where nothing but the DAG reads the raw rows (the
    gather then moves to its dots, :func:`.rewrites.sequence_parallel.move_gather_forward`, which
    runs the norm on 1/n of the rows and gathers its result once, also for its other readers),
    unless ``alone``: the caller found that move refused, and the ring then gathers the raw rows
    once for every dot the DAG reaches and assembles nothing (where the DAG's values are read
    by other ops, the raw rows are assembled for them as above; without ``assemble``, None)."""
    dag = _RowDag.trace(ag)
    if dag is None or not (alone or dag.raw_rows_read_elsewhere()) or not dag.check_steps(gather_dim, ring.size):
        return None
    chosen = dag.choose(alone, assemble)
    if chosen is None:
        return None
    included, kept, first, hoisted = chosen
    consumers = []
    for dot in included:
        value = dot.operation.operands[dag.operand_index(dot)]
        try:
            consumer = _consumer(dot, value, dag.dims[value], dag.path_of(value), info)
        except Decline:
            return None
        consumers.append(replace(consumer, dag=True))
    nodes = tuple(dag.steps[op.result] for op in dag.ordered)
    return AllGatherSite(ag, ring, region, gather_dim, tuple(consumers), nodes, tuple(kept), first,
                         tuple(sorted(hoisted, key=ir_utils.BlockOrder)))


def reaches_a_dot_row_wise(ag: ir.OpView) -> bool:
    """Does a ``dot_general`` in ``ag``'s block read its gathered value through row-wise
    candidates only (layout, elementwise, a norm's reduce and broadcast)?  A cheap walk forward,
    without the matcher's messages: where not, no ring of :func:`match_all_gather` can reach a dot."""
    return bool(_row_reach(ag)[1])


def _row_reach(ag: ir.OpView) -> tuple[set[ir.Operation], dict[ir.Operation, ir.OpView]]:
    """The ops of ``ag``'s block reached from its gathered value through row-wise candidates only,
    and the dots they (or the gathered value) feed."""
    block = ag.operation.block
    passable: set[ir.Operation] = set()
    dots: dict[ir.Operation, ir.OpView] = {}
    pending = [ag.result]
    while pending:
        for user in ir_utils.users(pending.pop()):
            op = user.operation
            if op.block != block or op in passable:
                continue
            if op.name == DOT:
                dots[op] = user
            elif _row_candidate(user):
                passable.add(op)
                pending.append(user.result)
    return passable, dots


class _RowDag:
    """The ops from a gathered value ``g`` to the dots it reaches through row-wise candidates
    (:func:`row_dag`): traced (:meth:`trace`), checked step by step (:meth:`check_steps`), and the
    dots the ring can compute chosen (:meth:`choose`)."""

    def __init__(self, ag: ir.OpView, passable: set, targets: list, chain: dict, tainted):
        self.ag = ag
        self.g = ag.result
        self.block = ag.operation.block
        self.passable = passable  # ops reached from the rows through row-wise candidates only
        self.targets = targets  # the dots reading exactly one value on the way, and nothing computed from the rows
        self.chain = chain  # the row-wise ops some target reads through
        self.tainted = tainted  # every op computed from the rows, and the all_gather (analysis.dataflow.Dependents)
        self.ordered = sorted(chain.values(), key=ir_utils.BlockOrder)  # producers first
        self.steps: dict[ir.Value, LayoutStep] = {}  # by the value each step computes
        self.dims: dict[ir.Value, int] = {}

    @classmethod
    def trace(cls, ag: ir.OpView) -> "_RowDag | None":
        """The DAG from ``ag``'s rows to its dots; None where no dot reads the rows through a row-wise op."""
        block, g = ag.operation.block, ag.result
        passable, dots = _row_reach(ag)

        def on_path(value: ir.Value) -> bool:
            return _on_rows(value, g, passable)

        targets = [dot for dot in dots.values() if [on_path(v) for v in dot.operation.operands].count(True) == 1]
        if not targets:
            return None
        # every op computed from the rows (the rest of the block at most: only once a dot is in reach)
        tainted = Dependents([g], block, also=[ag])
        targets = [dot for dot in targets if not any(_owner_in(v, tainted) for v in dot.operation.operands
                                                     if not on_path(v))]
        # the DAG: the row-wise ops some target dot reads through
        chain: dict[ir.Operation, ir.OpView] = {}
        pending = [v for dot in targets for v in dot.operation.operands if on_path(v) and v != g]
        while pending:
            owner = pending.pop().owner
            if owner.operation in chain:
                continue
            chain[owner.operation] = owner
            pending += [v for v in owner.operation.operands if on_path(v) and v != g]
        if not chain:
            return None  # the dots read the rows themselves: the tree's decline stands
        return cls(ag, passable, targets, chain, tainted)

    def on_path(self, value: ir.Value) -> bool:
        return _on_rows(value, self.g, self.passable)

    def operand_index(self, dot: ir.OpView) -> int:
        """Which of ``dot``'s operands is on the way from the rows (exactly one is)."""
        return next(i for i, v in enumerate(dot.operation.operands) if self.on_path(v))

    def raw_rows_read_elsewhere(self) -> bool:
        """Is the gathered value, or its reshape or sharding constraint in the DAG (an untiled
        gather's: the gather on a new dim, then a reshape merging it into the rows, which both the
        DAG and the other readers read; in a partially manual region, constrained), read by
        anything but the DAG and its dots?  If not, moving the gather past the DAG (``--policy
        all``) gathers its values once for the dots and their other readers, the norm on 1/n of
        the rows: the ring here is for raw rows read elsewhere (a residual), or for a refused move."""
        raw, pending = [self.g], [self.g]
        while pending:
            for user in ir_utils.users(pending.pop()):
                if user.operation in self.chain and user.operation.name in ("stablehlo.reshape",
                                                                            "sdy.sharding_constraint"):
                    raw.append(user.result)
                    pending.append(user.result)
        targets = {dot.operation for dot in self.targets}
        return not all(user.operation in self.chain or user.operation in targets
                       for value in raw for user in ir_utils.users(value))

    def check_steps(self, gather_dim: int, n: int) -> bool:
        """Each op of the DAG as a step applied per block (:func:`_dag_step`); False where one is not row-wise."""
        self.dims = {self.g: gather_dim}
        for op in self.ordered:
            step = _dag_step(op, self.on_path, self.dims, self.tainted, n)
            if step is None:
                return False
            self.steps[op.result] = step
            self.dims[op.result] = step.out_dim
        return True

    def path_of(self, value: ir.Value) -> tuple[LayoutStep, ...]:
        """The steps computing ``value`` from the rows, in block order."""
        found: set[ir.Value] = set()
        pending = [value]
        while pending:
            v = pending.pop()
            if v in self.steps and v not in found:
                found.add(v)
                pending += list(v.owner.operation.operands)
        return tuple(self.steps[op.result] for op in self.ordered if op.result in found)

    def choose(self, alone: bool, assemble: bool) -> tuple | None:
        """The dots the ring computes (those that can all run where the ring goes), the rows'
        other readers it assembles them for, where it goes, and the ops hoisted up to it; None
        where none can (or, unless ``alone``, nothing else reads the rows; without ``assemble``,
        something does)."""
        g, block = self.g, self.block
        included = sorted(self.targets, key=ir_utils.BlockOrder)
        in_tree = self.tainted  # (the all_gather itself included)
        while included:
            chosen = {dot.operation for dot in included}
            dead: set[ir.Operation] = set()  # DAG ops read only by the chosen dots and dead DAG ops
            for op in reversed(self.ordered):
                if all(u.owner.operation in chosen or u.owner.operation in dead for u in op.result.uses):
                    dead.add(op.operation)
            kept = [user for user in ir_utils.users(g) if user.operation not in dead and user.operation not in chosen]
            if not kept and not alone:
                return None  # nothing else reads the rows: moving the gather to its dots does better
            if kept and not assemble:
                return None
            readers = [ir_utils.ancestor_in(user, block) for user in kept]
            first = min([dot.operation for dot in included] + readers, key=ir_utils.BlockOrder)
            keep, hoisted = [], {}
            for dot in included:
                index = self.operand_index(dot)
                path = self.path_of(dot.operation.operands[index])
                needed = [dot.operation.operands[1 - index]] + _dag_reads(path)
                missing = [v for v in needed if not ir_utils.defined_before(v, first)]
                moves = [_hoistable(v, first, in_tree, all_gather.HOIST_LIMIT - len(hoisted)) for v in missing]
                if all(ops is not None for ops in moves):
                    keep.append(dot)
                    hoisted.update(dict.fromkeys(op for ops in moves for op in ops))
            if len(keep) == len(included):
                return included, kept, first, hoisted
            included = keep
        return None


def _row_candidate(op: ir.OpView) -> bool:
    """An op the rows may pass on their way to a dot in a DAG (checked row-wise by :func:`_dag_step`)."""
    return (is_layout_op(op) or is_elementwise(op) or op.operation.name in ROW_OPS) and len(op.operation.results) == 1


def _on_rows(value: ir.Value, g: ir.Value, passable: set) -> bool:
    """Is ``value`` the gathered rows ``g``, or computed from them by row-wise candidates only?"""
    return value == g or _owner_in(value, passable)


def _owner_in(value: ir.Value, ops: set) -> bool:
    return not isinstance(value.owner, ir.Block) and value.owner.operation in ops


def _dag_step(op: ir.OpView, on_path, dims: dict, tainted, n: int) -> LayoutStep | None:
    """``op`` as a step of the DAG, its ring dim carried forward from its operands on the path;
    None where it does not work row by row along it or reads a value computed from the rows by
    ops outside the DAG (which may mix them)."""
    for value in [*op.operation.operands, op.result]:
        t = ir_utils.ranked_tensor(value)
        if t is None or not ir_utils.is_static(t):
            return None
    read = [v for v in op.operation.operands if on_path(v)]
    in_dims = {dims.get(v) for v in read}
    if None in in_dims or len(in_dims) != 1:
        return None  # rows along different dims
    (in_dim,) = in_dims
    others = [v for v in op.operation.operands if not on_path(v)]
    if any(_owner_in(v, tainted) for v in others):
        return None
    name = op.operation.name
    if is_layout_op(op):
        try:
            out_dim = forward_dim(op, in_dim, n)
        except Decline:
            return None
        step = LayoutStep(op, in_dim, out_dim)
    elif name == "stablehlo.reduce":
        operands = list(op.operation.operands)
        if len(operands) != 2 or in_dim in ir_utils.i64s(op, "dimensions"):
            return None  # variadic, or a reduce over the gathered rows: it mixes them
        rank = ir.RankedTensorType(operands[0].type).rank
        out_dim = [d for d in range(rank) if d not in ir_utils.i64s(op, "dimensions")].index(in_dim)
        init = operands[1].owner
        constant = not isinstance(init, ir.Block) and init.operation.name == "stablehlo.constant"
        step = LayoutStep(op, in_dim, out_dim, (None, init if constant else None))
    elif name == "stablehlo.broadcast_in_dim":
        out_dim = ir_utils.i64s(op, "broadcast_dimensions")[in_dim]
        if row_dim(op, out_dim) != in_dim:
            return None  # spreads one value along the gathered dim
        step = LayoutStep(op, in_dim, out_dim)
    elif is_elementwise(op):
        sources = []
        for value in op.operation.operands:
            if on_path(value):
                sources.append(None)
                continue
            try:
                sources.append(invariant_source(op, value, in_dim))
            except Decline:
                sources.append(Sliced(value))  # each block reads its rows of it (checked not from the rows above)
        step = LayoutStep(op, in_dim, in_dim, tuple(sources))
    else:
        return None
    size = ir.RankedTensorType(op.result.type).shape[step.out_dim]
    return step if size % n == 0 else None


def _dag_reads(path: tuple[LayoutStep, ...]) -> list[ir.Value]:
    """What the ring reads beside the rows to apply ``path`` to a block: the rebuilt sources'
    operands, the values read block by block, a reduce's init that is no constant."""
    reads: list[ir.Value] = []
    for step in path:
        for value, source in zip(step.op.operation.operands, step.sources or (None,) * len(step.op.operation.operands)):
            if isinstance(source, Sliced):
                reads.append(source.value)
            elif source is not None:
                reads += list(source.operation.operands)
        if step.op.operation.name == "stablehlo.reduce" and step.sources[1] is None:
            reads.append(step.op.operation.operands[1])
    return reads
