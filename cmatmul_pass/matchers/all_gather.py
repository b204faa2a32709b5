"""``all_gather`` feeding dots: one ring per gather, computing every dot it can.

The gathered value (or layout ops of it, see :mod:`cmatmul_pass.layout`) may feed
several ``dot_general`` ops — q/k/v projections, gate and up, a forward dot and a
weight-gradient dot.  Each dot that can run at the point of the first one is a
:class:`Consumer` of the ring, in one of two roles:

* ``free``: the ring dim is a free dim of the dot operand; each step's partial dot is
  written at its block of the result (``dynamic_update_slice``);
* ``contracting``: the ring dim is contracted; each step's partial dot is the
  contraction over one block and the partials are summed (the "async gather" of
  feature-sharded activations).

Every other reader of the gathered value (a non-dot op, a dot that needs values
computed later, a dot in another region) is *kept*: the loop also assembles the
gathered value from the shards it sees, as XLA's windowed einsum caches it, and those
readers get the assembled copy — never a second all_gather.  With
``assemble=False`` such sites are declined instead.

Where no dot is reached through layout and elementwise ops alone, but through a DAG of ops that
work row by row along the gathered dim (a norm of the gathered rows: a statistic of each row,
broadcast back), and something besides those dots reads the rows (a residual), the ring applies
the DAG to each block before its dot and assembles the raw rows (:func:`.gather_rows.row_dag`); so it does
where some dots read the rows directly and others through such a DAG (the DAG's ring then
computes them all, where it computes more dots than the tree's).  With
``dag_alone`` (asked once moving the gather past the DAG was refused: it would gather more
bytes, or gather a value whole for a reader that is not a dot) the ring applies the DAG even
where only the DAG reads the raw rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import ir_utils
from .._jax_private import ir
from ..errors import Decline
from ..layout import LayoutStep, elementwise_step, forward_dim, is_elementwise, is_layout_op, path_sources
from ..ring import Ring
from . import causes
from .common import (
    DeclinedSite,
    DotDims,
    ManualRegion,
    ModuleInfo,
    collective_ring,
    describe_op,
    static_tensor,
)

ALL_GATHER_DOT = "all_gather_dot"
DOT = "stablehlo.dot_general"
BROADCAST = "stablehlo.broadcast_in_dim"


def broadcast_dim(op: ir.OpView, dim: int) -> int:
    """The result dim a ``broadcast_in_dim`` puts its operand's ring dim ``dim`` at, where it keeps
    it whole (a broadcast along other dims: grouped-query attention repeating K/V heads), so each
    block of the result is the broadcast of that block of the operand:
    ``broadcast(all_gather(x))[block k] = broadcast(x_k)``.  Decline otherwise."""
    target = ir_utils.i64s(op, "broadcast_dimensions")[dim]
    src, dst = ir_utils.ranked_tensor(op.operation.operands[0]), ir_utils.ranked_tensor(op.result)
    if src is None or dst is None or src.shape[dim] != dst.shape[target]:
        raise Decline("layout", f"{describe_op(op)} spreads the gathered dim {dim} (size 1) along result dim {target}")
    return target


@dataclass(frozen=True, eq=False)
class Consumer:
    """One dot computed by the ring.

    ``path``: layout ops from the gathered value to the dot operand; ``dim``: the ring
    dim as the dot operand sees it; ``result_dim`` (free and batch roles): the dot result
    dim it becomes; ``other_dim`` (contracting and batch roles): the other operand's
    paired dim, sliced block by block as the shards arrive.
    """

    dot: ir.OpView
    path: tuple[LayoutStep, ...]
    operand_index: int
    dim: int
    role: str
    result_dim: int | None = None
    other_dim: int | None = None
    #: ``path`` is a DAG (a norm of the gathered rows: steps in block order, each reading the
    #: gathered value or earlier steps' results), applied to each block by :func:`.layout.apply_dag`
    dag: bool = False


@dataclass(frozen=True, eq=False)
class AllGatherSite:
    all_gather: ir.OpView
    ring: Ring
    region: ManualRegion
    gather_dim: int
    consumers: tuple[Consumer, ...]
    #: every layout op reachable from the gathered value, parents before children
    nodes: tuple[LayoutStep, ...] = ()
    #: ops that still read the gathered value (or a layout of it) after the rewrite
    kept_users: tuple[ir.OpView, ...] = field(default_factory=tuple)
    #: where the ring goes: the first of its dots and of the readers of the assembled value (the
    #: ``nodes`` before it move after the ring, reading the value it assembles)
    insert_before: ir.Operation | None = None
    #: pure ops after ``insert_before`` computing a later dot's other operand (a weight cast to
    #: the compute type where it is used), in block order: moved just before it when the site is
    #: rewritten, so that the ring can compute that dot too (:func:`hoist`)
    hoist: tuple[ir.Operation, ...] = ()

    kind = ALL_GATHER_DOT

    @property
    def anchor(self) -> ir.OpView:
        return self.all_gather

    @property
    def assembles(self) -> bool:
        return bool(self.kept_users)


def find_all_gather_dot(
    module: ir.Module, info: ModuleInfo | None = None, *, assemble: bool = True
) -> list[AllGatherSite | DeclinedSite]:
    """Every ``stablehlo.all_gather`` in ``module`` (all functions, all nested regions), matched."""
    info = info or ModuleInfo.of(module)
    return [match_all_gather(op, info, assemble=assemble) for op in all_gathers(module)]


def all_gathers(module: ir.Module) -> list[ir.OpView]:
    return ir_utils.ops_named(module, "stablehlo.all_gather")["stablehlo.all_gather"]


def match_all_gather(op: ir.OpView, info: ModuleInfo, *, assemble: bool = True, dag_alone: bool = False
                     ) -> AllGatherSite | DeclinedSite:
    ring = None
    try:
        ring, region = collective_ring(op, info)
        return _match(op, ring, region, assemble, info, dag_alone)
    except Decline as d:
        return DeclinedSite(ALL_GATHER_DOT, op, d.code, d.message, ring)


@dataclass(eq=False)
class _Use:
    """One reader in the tree of the gathered value: a dot candidate, a layout node, or another op."""

    op: ir.OpView
    #: what it reads: the gathered value or a layout of it, with the ring dim there
    value: ir.Value | None = None
    dim: int = -1
    consumer: Consumer | None = None
    step: LayoutStep | None = None
    children: list["_Use"] = field(default_factory=list)

    def alive(self, included: set[Consumer]) -> bool:
        """Does this reader still read the gathered value once ``included`` dots are in the loop?"""
        if self.consumer is not None:
            return self.consumer not in included
        if self.step is not None:
            return any(child.alive(included) for child in self.children)
        return True

    def walk(self):
        """This use and every use below it."""
        yield self
        for child in self.children:
            yield from child.walk()

    def leaves(self):
        return (use for use in self.walk() if use.step is None)

    def readers(self, included: set[Consumer], past_elementwise: bool = False):
        """The ops that will read the assembled value along this use, once ``included`` dots
        are in the loop: the readers past layout ops (which only relabel it), and an
        elementwise node itself (it computes from it: the tanh, not whatever reads the tanh).
        ``past_elementwise``: the ops past the elementwise nodes too, which read what is computed
        from the value: where the ring may go, since every node is a pure op of the gathered value
        and block-invariant operands and can run anywhere between the ring and those ops (the
        rewrite moves the nodes standing before the ring after it)."""
        if not self.alive(included):
            return
        if self.step is None or (is_elementwise(self.op) and not past_elementwise):
            yield self.op
            return
        for child in self.children:
            yield from child.readers(included, past_elementwise)


@dataclass
class _Tree:
    info: ModuleInfo
    roots: list[_Use] = field(default_factory=list)
    candidates: list[Consumer] = field(default_factory=list)
    rejected: list[Decline] = field(default_factory=list)
    nodes: list[LayoutStep] = field(default_factory=list)
    #: the first dot :func:`_schedulable` dropped, a value it needs that is not there, and where
    #: the ring would go
    blocked: tuple[Consumer, ir.Value, ir.Operation] | None = None


def _match(ag: ir.OpView, ring: Ring, region: ManualRegion, assemble: bool, info: ModuleInfo,
           dag_alone: bool = False) -> AllGatherSite:
    shard_t = static_tensor(ag.operation.operands[0], "the all_gather operand")
    result_t = static_tensor(ag.result, "the all_gather result")
    gather_dim = ir_utils.int_attr(ag, "all_gather_dim")
    if result_t.shape[gather_dim] != shard_t.shape[gather_dim] * ring.size:
        raise Decline("shape", f"gathered dim {gather_dim} is not {ring.size}x the shard's")
    if not list(ag.result.uses):
        raise Decline("no_users", "the gathered value is unused")

    from .gather_rows import row_dag  # (the row DAG builds on this module's site records)

    tree = _Tree(info)
    block = ag.operation.block
    tree.roots = _visit(tree, ag.result, gather_dim, (), block, ring.size)
    _drop_dots_reading_twice(tree)
    if not tree.candidates:
        declined = _no_dot(tree, ag, ring.size)
        site = row_dag(ag, ring, region, gather_dim, info, dag_alone, assemble) \
            if (assemble or dag_alone) and declined.code in ("layout", "user_not_dot") else None
        if site is None:
            raise declined
        return site

    consumers, first, hoisted = _schedulable(tree, block, ag)
    if not consumers:
        raise _unschedulable(tree, block, ag)
    included = set(consumers)
    kept = [op for r in tree.roots for op in r.readers(included)]
    if kept:  # a reader of the rows may lead, row by row, to more dots (a norm into another projection)
        wider = row_dag(ag, ring, region, gather_dim, info, True, assemble)
        if wider is not None and len(wider.consumers) > len(consumers):
            return wider
    if kept and not assemble:
        names = ", ".join(describe_op(u) for u in kept)
        raise Decline(
            "multiple_users",
            f"the gathered value is also read by {names}; assembling it in the loop is switched off",
        )
    # in block order (parents before children still): the users' order of a value is its use
    # list's, which a copy of the same ops (a shared ring's function) may hold reversed
    nodes = tuple(sorted(tree.nodes, key=lambda step: ir_utils.BlockOrder(step.op)))
    return AllGatherSite(ag, ring, region, gather_dim, tuple(consumers), nodes, tuple(kept), first, hoisted)


def _visit(tree: _Tree, value: ir.Value, dim: int, path: tuple[LayoutStep, ...], block: ir.Block, n: int) -> list[_Use]:
    uses = []
    for user in ir_utils.users(value):
        name = user.operation.name
        use = _Use(user, value, dim)
        uses.append(use)
        dot = name == DOT or ir_utils.is_grouped_dot(user)
        if user.operation.block != block:
            if dot:
                tree.rejected.append(Decline("other_block", f"the dot reading the gathered value, {describe_op(user)}, "
                                                            "is in another region"))
        elif dot:
            try:
                use.consumer = _consumer(user, value, dim, path, tree.info)
                tree.candidates.append(use.consumer)
            except Decline as d:
                tree.rejected.append(d)
        elif is_layout_op(user) or is_elementwise(user) or name == BROADCAST:
            try:
                step = elementwise_step(user, value, dim) if is_elementwise(user) else \
                    LayoutStep(user, dim, broadcast_dim(user, dim) if name == BROADCAST else forward_dim(user, dim, n))
            except Decline as d:
                tree.rejected.append(_why_not_blockwise(d, user, value, dim))
                continue
            use.step = step
            tree.nodes.append(step)
            use.children = _visit(tree, user.result, step.out_dim, path + (step,), block, n)
    return uses


def _why_not_blockwise(declined: Decline, op: ir.OpView, value: ir.Value, dim: int) -> Decline:
    """A ``layout`` decline of an elementwise op on the path, saying what its other operand is."""
    others = [v for v in op.operation.operands if v != value]
    if declined.code != "layout" or not is_elementwise(op) or len(others) != 1:
        return declined
    what = causes.why_varies(others[0], dim, value, "the gathered value")
    return Decline("layout", f"{describe_op(op)} between the all_gather and the dot: its other operand, {what}, differs "
                             f"from block to block of the gathered dim {dim}; the ring applies an op to one block only "
                             "when its other operands are the same in every block (a scalar, a value broadcast along "
                             "the gathered dim)")


def _no_dot(tree: _Tree, ag: ir.OpView, n: int) -> Decline:
    """Why no dot can take the ring: what the gathered value feeds instead, the first true cause of
    a grouped matmul, a prefetch for a later region, a reshard, or the op the ring cannot apply."""
    leaves = [u for r in tree.roots for u in r.leaves()]
    ragged = next(filter(None, (causes.ragged_dot_after(u.value) for u in leaves)), None)
    if ragged is not None and all(d.code == "layout" for d in tree.rejected):
        return causes.ragged_dot_decline(ragged, "the gathered value feeds")
    if tree.rejected:
        return tree.rejected[0]
    region = leaves[0].op.operation.parent if leaves else None
    if region is not None and region.name == causes.MANUAL and all(u.op.operation.name == "sdy.return" for u in leaves):
        later = next(filter(None, (causes.dot_in_later_region(u.value, region) for u in leaves)), None)
        if later is not None:
            return Decline("prefetchable", f"the gathered value leaves its shard_map region (sdy.return) for "
                                           f"{describe_op(later)} in a later region: the program gathers it ahead of "
                                           "its use (a prefetch, as FSDP code writes it), so the transfer is already "
                                           "off that matmul's critical path")
    resharded = _reshard(leaves, n)
    if resharded is not None:
        return resharded
    names = ", ".join(dict.fromkeys(_reader_name(u.op) for u in leaves))
    if leaves and all(u.op.operation.name == "stablehlo.all_gather" for u in leaves):
        outer = leaves[0].op
        return Decline("two_stage", f"the gathered value feeds {describe_op(outer)}, a second gather over other device "
                                    "groups (a weight sharded over two mesh axes, gathered in two stages): that stage, "
                                    "whose value the dot reads, takes the ring, and this one stays a plain gather "
                                    "ahead of it, unless the two merge into one gather (--policy all)")
    dot = next(filter(None, (causes.find_near(u.value, True, lambda op: op.operation.name == DOT) for u in leaves)),
               None)
    if dot is None:
        return Decline("user_not_dot", f"the gathered value feeds {names}, no stablehlo.dot_general")
    held = causes.collectives_in(dot) if dot.operation.name == "func.call" else []
    if held:  # a nested jit's function holding collectives of its own (a scan's step under jax 0.10 is inlined first)
        callee = ir.FlatSymbolRefAttr(dot.attributes["callee"]).value
        return Decline("user_not_dot", f"the gathered value reaches its dot inside @{callee} ({describe_op(dot)}), "
                                       f"a function that holds collectives of its own ({', '.join(held)}): the pass "
                                       "rewrites those where they stand and does not inline such a function, so no "
                                       "dot is in this block for a ring (its body written where it is called, a nested "
                                       "jax.jit's body say, would put the dot here)")
    lookup = next((u.op for u in leaves if u.op.operation.name == "stablehlo.gather"
                   and u.op.operation.operands[0] == u.value), None)
    if lookup is not None:  # an embedding table gathered whole, then looked up in
        return Decline("user_not_dot", f"the gathered value is a table that {describe_op(lookup)} looks rows up in (an "
                                       f"embedding lookup), and reaches {describe_op(dot)} only through the rows it "
                                       "picks: a ring splits a matmul, not a lookup. Gathering the table is avoidable: "
                                       "look the ids up in this device's shard of it and combine the rows (a vocabulary "
                                       "shard: zero the rows of ids outside it and psum them; a feature shard: gather "
                                       "the rows), so rows cross the wire, not the table; or write the lookup as a "
                                       "one-hot matmul (jax.nn.one_hot(ids, vocab) @ table), whose gather the ring "
                                       "takes, at vocab times the lookup's work")
    return Decline("user_not_dot", f"the gathered value feeds {names}, which the ring cannot apply block by block "
                                   f"(only layout ops and elementwise ops do), and reaches {describe_op(dot)} only "
                                   "through it")


def _unschedulable(tree: _Tree, block: ir.Block, ag: ir.OpView) -> Decline:
    """No place for the ring: which dot needs which value, and why that value comes too late."""
    consumer, needed, first = tree.blocked
    what = "a region argument" if isinstance(needed.owner, ir.Block) else describe_op(needed.owner)
    derived, through = causes.computed_from(needed, ag.result)
    if derived:
        how = f" through {describe_op(through)}" if through is not None and through.operation != needed.owner.operation \
            else ""  # (not the op that computes it: named already)
        return Decline("schedule", f"{describe_op(consumer.dot)} needs {what}, computed from the gathered value "
                                   f"itself{how}: it exists only once the whole value is gathered, so no ring can "
                                   "compute that dot")
    return Decline("schedule", f"{describe_op(consumer.dot)} needs {what}, computed after {describe_op(first)} (another "
                               "reader of the gathered value) by ops the pass does not move: no single place for the "
                               "ring")


def _reader_name(op: ir.OpView) -> str:
    """An op's name; for a call, with its function and the ops in it that do the work."""
    if op.operation.name != "func.call":
        return op.operation.name
    callee = ir.FlatSymbolRefAttr(op.attributes["callee"]).value
    inner = causes.callee_work(op)
    return f"func.call @{callee}" + (f" ({', '.join(inner)} inside)" if inner else "")


def _reshard(leaves: list[_Use], n: int) -> Decline | None:
    """Every reader is a dynamic_slice that keeps the gathered dim whole and takes this device's
    1/n of another dim (its offset read from partition_id): a reshard, an all_to_all in disguise."""
    found = []
    for use in leaves:
        op = use.op
        if op.operation.name != "stablehlo.dynamic_slice" or op.operation.operands[0] != use.value:
            return None
        t = ir_utils.ranked_tensor(use.value)
        if t is None:
            return None
        shape, sizes = list(t.shape), ir_utils.i64s(op, "slice_sizes")
        cut = [k for k, (size, full) in enumerate(zip(sizes, shape)) if k != use.dim and size * n == full
               and causes.find_near(op.operation.operands[1 + k], False, causes.is_partition_id)]
        if sizes[use.dim] != shape[use.dim] or not cut:
            return None
        found.append((op, use.dim, cut[0]))
    if not found:
        return None
    op, dim, cut = found[0]
    return Decline("reshard", f"the gathered value is only sliced, by {describe_op(op)}, which keeps the gathered dim "
                              f"{dim} whole and takes this device's 1/{n} of dim {cut}: a reshard (an all_to_all in "
                              f"disguise, which would move 1/{n} of the bytes): the gathered value as a whole is no "
                              "matmul's input")


def _drop_dots_reading_twice(tree: _Tree) -> None:
    """A dot reading the gathered value through two paths (``g @ transpose(g)``) is no consumer."""
    seen: dict = {}
    for c in tree.candidates:
        seen.setdefault(c.dot.operation, []).append(c)
    twice = {c for group in seen.values() if len(group) > 1 for c in group}
    if not twice:
        return
    tree.candidates = [c for c in tree.candidates if c not in twice]
    tree.rejected.append(Decline("both_operands", "the gathered value reaches both operands of the dot"))

    def demote(use: _Use) -> None:
        if use.consumer in twice:
            use.consumer = None  # a plain reader: it keeps reading the (assembled) gathered value
        for child in use.children:
            demote(child)

    for root in tree.roots:
        demote(root)


def _consumer(dot: ir.OpView, value: ir.Value, dim: int, path: tuple[LayoutStep, ...], info: ModuleInfo) -> Consumer:
    operands = list(dot.operation.operands)
    sides = [i for i, v in enumerate(operands) if v == value]
    if len(sides) != 1:
        raise Decline("both_operands", "the gathered value is both operands of the dot")
    index = sides[0]
    if index > 1:
        raise Decline("ragged_dot", f"the gathered value is the group sizes of {describe_op(dot)}, a grouped matmul")
    dims = DotDims.of(dot, info)
    dims.grouped_decline(index, dim, "the gathered dim", dot)
    batch, contracting = dims.batch[index], dims.contracting[index]
    if dim in batch:  # each round computes one block of the batch: its shard against that block of the other
        position = batch.index(dim)
        return Consumer(dot, path, index, dim, "batch", result_dim=position, other_dim=dims.batch[1 - index][position])
    if dim in contracting:
        other_dim = dims.contracting[1 - index][contracting.index(dim)]
        return Consumer(dot, path, index, dim, "contracting", other_dim=other_dim)
    result_dim = dims.free_result_offset(index) + dims.free(index).index(dim)
    return Consumer(dot, path, index, dim, "free", result_dim=result_dim)


def _schedulable(tree: _Tree, block: ir.Block, ag: ir.OpView) -> tuple[list[Consumer], ir.Operation | None,
                                                                        tuple[ir.Operation, ...]]:
    """The dots the loop computes, in block order, the op the loop goes before, and the pure
    ops to move before that op (:func:`_hoistable`, in block order).

    The loop must also precede every op that will read the assembled gathered value (the
    layout and elementwise nodes on the way to those readers follow the loop), and a dot joins
    only if its other operand exists at that point, or can be computed there by moving a few
    pure ops up (a weight cast to the compute type just before its dot); a weight gradient
    needs the backward's incoming gradient, computed later from the dots' results: it reads the
    assembled value instead.  Dropping a dot can only move the loop
    earlier, so iterate to a fixed point.
    """
    in_tree = {ag.operation, *(u.op.operation for r in tree.roots for u in r.walk())}
    included = sorted(tree.candidates, key=_dot_order)
    while included:
        chosen = set(included)
        readers = [ir_utils.ancestor_in(op, block) for u in tree.roots for op in u.readers(chosen, True)]
        first = min([c.dot.operation for c in included] + readers, key=ir_utils.BlockOrder)
        kept, hoisted = [], {}
        for c in included:
            # what the ring reads besides the shards: the dot's other operand (and a grouped
            # matmul's group sizes), and the operands its path's elementwise ops rebuild per block
            # (their sources' own operands)
            needed = [c.dot.operation.operands[1 - c.operand_index], *list(c.dot.operation.operands)[2:]]
            needed += [v for source in path_sources(c.path) for v in source.operation.operands]
            missing = [v for v in needed if not ir_utils.defined_before(v, first)]
            moves = [_hoistable(v, first, in_tree, HOIST_LIMIT - len(hoisted)) for v in missing]
            if all(ops is not None for ops in moves):
                kept.append(c)
                hoisted.update(dict.fromkeys(op for ops in moves for op in ops))
            elif tree.blocked is None:
                tree.blocked = c, next(v for v, ops in zip(missing, moves) if ops is None), first
        if len(kept) == len(included):
            return included, first, tuple(sorted(hoisted, key=ir_utils.BlockOrder))
        included = kept
    return [], None, ()


#: ops a site may move up so that its ring can compute a dot: side-effect free, no regions; the
#: ops that prepare a weight for a dot (casts, reshapes, slices, scaling)
HOISTABLE = frozenset(f"stablehlo.{name}" for name in (
    "convert", "reshape", "transpose", "broadcast_in_dim", "slice", "dynamic_slice", "concatenate", "constant",
    "iota", "add", "subtract", "multiply", "divide", "negate", "abs", "maximum", "minimum", "select", "compare",
    "clamp", "pad", "reverse", "bitcast_convert", "sqrt", "rsqrt", "exponential", "tanh", "logistic",
)) | {"sdy.sharding_constraint", "chlo.square"}  # (a hint: partial-manual regions put one after every op)
#: the most ops one site moves (a bound on the walk, not a limit real weight preparation meets)
HOIST_LIMIT = 32


def _hoistable(value: ir.Value, first: ir.Operation, in_tree: set, limit: int) -> list[ir.Operation] | None:
    """The ops after ``first`` that compute ``value``, if all are pure (:data:`HOISTABLE`), read
    nothing of the gathered value's tree (``in_tree``: the all_gather and every op reading it or
    its layouts) and number at most ``limit``: moved before ``first`` in block order, they make
    ``value`` available there without changing what any op computes.  None: not so."""
    found: dict[ir.Operation, None] = {}
    pending = [value]
    while pending:
        v = pending.pop()
        if ir_utils.defined_before(v, first):
            continue
        op = v.owner.operation  # not a block argument: those are defined before everything in the block
        if op in found:
            continue
        if op in in_tree or op.name not in HOISTABLE or len(op.regions) or len(found) >= limit:
            return None
        found[op] = None
        pending.extend(op.operands)
    return list(found)


def _dot_order(consumer: Consumer) -> ir_utils.BlockOrder:
    return ir_utils.BlockOrder(consumer.dot.operation)
