"""Carry a split all_reduce's row shards forward: automatic sequence parallelism.

After :func:`.dot_all_reduce.split_all_reduce` each device holds its rows ``%s`` of the
summed product and ``%y = all_gather(%s)`` rebuilds the whole value.  What reads ``%y``
row by row — the residual add, a layer norm or RMS norm, a bias, an activation — gives
the same rows whether it runs on the whole value or on each device's rows, so it can run
on ``%s`` (1/n of the work) and the gather move past it::

    %y  = all_gather(%s)                    %x1s = dynamic_slice(%x0, rows of this device) + %s
    %x1 = %x0 + %y                  ==>     %hs  = layer_norm(%x1s)
    %h  = layer_norm(%x1)                   %h   = all_gather(%hs)      // the next matmul's ring
    %z  = dot(%h, %w1)                      %z   = dot(%h, %w1)
    return %x1 ...                          return all_gather(%x1s)     // once, at the return

The gather of a value is *materialised* once, just before its first reader that does not
work row by row (a ``dot_general`` — whose all_gather → dot site the pipeline then
rewrites as a ring —, the return, an op that mixes rows such as attention scores or a
cumsum), and shared by all such readers.

Moving work from "every device computes every row" to "device ``k`` computes block ``k``"
is only right when every other value an op reads is the same on every device of the
group (:class:`~cmatmul_pass.analysis.variance.Variance`): those are sliced to the
device's rows (or rebuilt at block size when every block is the same).  An op reading
a value that may differ between devices stops the move: the gather is materialised
before it.

A sum over the gathered dim (a norm's statistic over the features a feature-sharded
activation was gathered along, a mean over the rows) is a sum of each device's partial sum:
``reduce_add(all_gather(x), d) == all_reduce(reduce_add(x, d))`` for a sum from zero over dims
that include the gathered dim ``d``.  The move computes the partial sum on the rows and sums it
over the group; what reads the sum (the statistic broadcast back over the rows) then reads a
value the same on every device, as before::

    %g = all_gather(%x), dim 1               %ss = all_reduce(reduce_add(%x * %x, dims = [1]))
    %ss = reduce_add(%g * %g, dims = [1])    %hs = %x * rsqrt(%ss / H + eps) * slice(%scale)
    %h = %g * rsqrt(%ss / H + eps) * %scale  %h = all_gather(%hs), dim 1   // the dot's ring
    %z = dot(%h, %w), contracting dim 1      %z = dot(%h, %w)

The move never adds bytes on the wire: when a connected set of carried values would need
more gathered bytes than the all_gathers it started from, the set stays where it was; the sums
it adds move one value per row (at most 1/:data:`STATISTIC_SHARE` of the gathered bytes on the wire).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import ir_utils
from .._jax_private import hlo, ir
from ..analysis.variance import Variance
from ..errors import Decline
from ..layout import ELEMENTWISE_OPS, block_of, invariant_source, forward_dim
from ..matchers.common import ManualRegion
from ..matchers.scatter_terms import region_is_sum
from ..report import tensor_bytes
from ..ring import Ring
from .builders import Builder, shard_type
from .dot_all_reduce import sum_all_reduce

#: ops that compute each element from the same element of their operands (same shapes; a
#: rank-0 operand of ``select`` / ``clamp`` is one value for every element)
ROWWISE_ELEMENTWISE = ELEMENTWISE_OPS | frozenset(f"stablehlo.{name}" for name in (
    "convert", "select", "clamp", "compare", "and", "or", "xor", "not", "exponential_minus_one",
    "log_plus_one", "cbrt", "round_nearest_even", "round_nearest_afz", "remainder", "atan2", "is_finite",
    "tan", "real", "imag", "complex", "reduce_precision", "shift_left", "shift_right_arithmetic",
    "shift_right_logical", "popcnt", "count_leading_zeros",
)) | frozenset({"chlo.erf", "chlo.erf_inv", "chlo.tan", "chlo.square"})
SHARDING_CONSTRAINT = "sdy.sharding_constraint"
#: a carried set's sums over the gathered dim may put at most 1/STATISTIC_SHARE of the bytes its
#: gathers brought on the wire (a norm's statistic: one value per row; an all_reduce sends each
#: byte about twice), which holds from 16 features per row
STATISTIC_SHARE = 8


def statistic_too_big(summed: int, gathered: int) -> bool:
    """Would all_reduces of ``summed`` bytes (each byte about twice on the wire) put more than
    1/:data:`STATISTIC_SHARE` of the ``gathered`` bytes on the wire?"""
    return 2 * summed * STATISTIC_SHARE > gathered


@dataclass(eq=False)
class Seed:
    """The all_gather a split left after the reduce-scatter ring, and the ring it gathers over."""

    all_gather: ir.OpView
    ring: Ring
    region: ManualRegion
    dim: int
    site: int  # the index of the all_reduce site (in the report) it came from


@dataclass
class Materialised:
    """One gather the move left: ``all_gather`` (in the module) of a value carried from the
    ``seeds`` sites, placed before ``reader`` (the first reader that needs the whole value)."""

    all_gather: ir.OpView
    reader: str  # "stablehlo.dot_general at file:line"
    feeds_dot: bool  # a dot_general reads the gathered value (an all_gather → dot site)
    seeds: frozenset[int]
    moved_ops: int  # ops that now run on the rows
    #: of them, sums over the gathered dim: each a partial sum on the rows added up by an all_reduce
    summed: int = 0


@dataclass
class Carry:
    """What :func:`carry_forward` did."""

    materialised: list[Materialised] = field(default_factory=list)
    #: the seeds' all_gathers left where the split put them, read by a dot
    kept: list[ir.OpView] = field(default_factory=list)
    #: the others left where the split put them (no dot reads them: their dots may lie past a norm)
    left: list[ir.OpView] = field(default_factory=list)
    #: the seed sites whose gather stayed right after their reduce-scatter ring
    stayed: set[int] = field(default_factory=set)
    #: per seed site: a note (kept in place, and why; or how many ops now run on rows, what was sliced)
    notes: dict[int, list[str]] = field(default_factory=dict)


@dataclass(eq=False)
class _Carried:
    dim: int
    ring: Ring
    region: ManualRegion
    component: int
    op: ir.OpView | None  # the op computing the whole value (None: a seed's all_gather)


def carry_forward(seeds: list[Seed], variance: Variance, take_channel, constants: dict, source: str | None) -> Carry:
    """Move each seed's gather forward as far as rows allow (module docstring)."""
    carry = Carry()
    by_block: dict = {}
    for seed in seeds:
        by_block.setdefault(seed.all_gather.operation.block, []).append(seed)
    for block, group in by_block.items():
        _carry_block(block, group, variance, take_channel, constants, source, carry)
    return carry


def move_gather_forward(seed: Seed, variance: Variance, take_channel, constants: dict, source: str | None
                        ) -> Carry | str | None:
    """A program's own all_gather whose value reaches its dots only through row-wise ops (a norm
    of the gathered rows, a convert, a bias): run those ops on this device's rows and gather
    their results just before the dots, ``op(all_gather(x)) == all_gather(op(x))`` for an op that
    works row by row along the gathered dim and reads nothing else that differs between the
    group's devices.  Built only when some op moves, every gather left is read by a
    ``dot_general`` (an all_gather → dot site) and no more bytes are gathered than before;
    otherwise why not (None: no row-wise op to move past), and the module is untouched."""
    block = seed.all_gather.operation.block
    plan = _Plan.of(block, [seed], variance)
    if not plan.roles:
        return None
    readers = plan.outside_readers(block)
    if not readers:
        return None
    others = [reader for reader in readers.values() if reader.name != "stablehlo.dot_general"]
    if others:
        where = ", ".join(dict.fromkeys(f"{r.name} at {ir_utils.render_location(r.location, source)}"
                                        for r in others))
        return (f"moved past the row-wise ops to its dot, it would still be gathered whole for {where} (not a "
                "dot), so the rows would cross the wire twice")
    summed, budget = sum(plan.summed().values()), sum(plan.budget().values())
    if statistic_too_big(summed, budget):
        return (f"moved past the row-wise ops, their sums over the gathered dim would all_reduce {summed} B (each "
                f"byte about twice on the wire), more than 1/{STATISTIC_SHARE} of the {budget} B the gather brings")
    if plan.over_budget(readers):
        return (f"moved past the row-wise ops, {len(readers)} of their results would each be gathered for its dots, "
                "more bytes than the one gather moves now")
    carry = Carry()
    _build(plan, readers, block, take_channel, constants, source, carry)
    return carry


def _carry_block(block: ir.Block, seeds: list[Seed], variance: Variance, take_channel, constants: dict,
                 source: str | None, carry: Carry) -> None:
    plan = _Plan.of(block, seeds, variance)
    readers = plan.outside_readers(block)
    kept = plan.over_budget(readers)
    for seed in seeds:
        if plan.component(seed.all_gather.result) in kept:
            carry.notes.setdefault(seed.site, []).append(
                "the gather stays after the reduce-scatter ring: carrying its rows forward would gather more bytes "
                "than the all_reduce moved")
            carry.stayed.add(seed.site)
    plan.drop(kept)
    # the dropped components' values stay where they are, and so do their readers
    readers = {value: reader for value, reader in readers.items() if value in plan.carried}
    stays = [seed.all_gather for seed in seeds if seed.all_gather.result not in plan.carried]
    carry.kept += [op for op in stays if _feeds_dot(op)]
    carry.left += [op for op in stays if not _feeds_dot(op)]
    if not plan.carried:
        return
    _build(plan, readers, block, take_channel, constants, source, carry)


class _Plan:
    """Which values of a block are carried as rows, decided before anything is built."""

    def __init__(self, seeds: list[Seed], variance: Variance):
        self.variance = variance
        self.seeds = {seed.all_gather.result: seed for seed in seeds}
        self.carried: dict[ir.Value, _Carried] = {}
        self.parent = list(range(len(seeds)))  # union-find over seeds: values mixing two seeds join them
        self.seed_of_component = {i: seed for i, seed in enumerate(seeds)}
        #: per carried op: its operands' roles ("carried", "slice", "block", "keep")
        self.roles: dict[ir.Operation, list[str]] = {}
        #: sums over a carried dim (:func:`_sums_carried_dim`): each a partial sum on the rows and an
        #: all_reduce over the group; the operand they read, carried
        self.reduced: dict[ir.Operation, _Carried] = {}
        for i, seed in enumerate(seeds):
            self.carried[seed.all_gather.result] = _Carried(seed.dim, seed.ring, seed.region, i, None)
        self.seed_ops = {seed.all_gather.operation for seed in seeds}

    @classmethod
    def of(cls, block: ir.Block, seeds: list[Seed], variance: Variance) -> "_Plan":
        """The plan of ``block``: every op visited in order (the variance's answers from before
        are forgotten: they may name values a rewrite since erased, whose addresses new values take)."""
        variance.forget()
        plan = cls(seeds, variance)
        for op in block.operations:
            plan.visit(op)
        return plan

    def find(self, i: int) -> int:
        while self.parent[i] != i:
            self.parent[i] = self.parent[self.parent[i]]
            i = self.parent[i]
        return i

    def component(self, value: ir.Value) -> int:
        return self.find(self.carried[value].component)

    def visit(self, op: ir.OpView) -> None:
        if op.operation in self.seed_ops or len(op.operation.results) != 1:
            return
        operands = list(op.operation.operands)
        carried = [self.carried[v] for v in operands if v in self.carried]
        if not carried:
            return
        first = carried[0]
        if any(c.ring.groups != first.ring.groups for c in carried):
            return
        dims = {i: self.carried[v].dim for i, v in enumerate(operands) if v in self.carried}
        if _sums_carried_dim(op, dims):
            self.reduced[op.operation] = _Carried(dims[0], first.ring, first.region, self.find(first.component), op)
            return
        try:
            out_dim, roles = _rowwise(op, dims, first.ring, self.variance)
        except Decline:
            return
        root = self.find(first.component)
        for c in carried[1:]:
            self.parent[self.find(c.component)] = root
        self.carried[op.result] = _Carried(out_dim, first.ring, first.region, root, op)
        self.roles[op.operation] = roles

    def outside_readers(self, block: ir.Block) -> dict[ir.Value, ir.Operation]:
        """Per carried value, its first reader in ``block`` that is not carried (None: none)."""
        carried_ops = {c.op.operation for c in self.carried.values() if c.op is not None} | set(self.reduced)
        first: dict[ir.Value, ir.Operation] = {}
        for value in self.carried:
            for use in value.uses:
                reader = ir_utils.ancestor_in(use.owner, block)
                if reader is None or reader in carried_ops:
                    continue
                if value not in first or reader.is_before_in_block(first[value]):
                    first[value] = reader
        return first

    def over_budget(self, readers: dict[ir.Value, ir.Operation]) -> set[int]:
        """Components whose materialised gathers would move more bytes than their seeds' gathers,
        or whose sums' all_reduces (each byte on the wire about twice: a reduce-scatter and a gather)
        more than 1/:data:`STATISTIC_SHARE` of them."""
        gathered: dict[int, int] = {}
        for value, c in self.carried.items():
            if value in readers:
                root = self.find(c.component)
                gathered[root] = gathered.get(root, 0) + tensor_bytes(ir.RankedTensorType(value.type))
        budget = self.budget()
        return ({root for root, total in gathered.items() if total > budget.get(root, 0)}
                | {root for root, total in self.summed().items() if statistic_too_big(total, budget.get(root, 0))})

    def budget(self) -> dict[int, int]:
        """Per component, the bytes its seeds' gathers move."""
        out: dict[int, int] = {}
        for value, c in self.carried.items():
            if c.op is None:
                root = self.find(c.component)
                out[root] = out.get(root, 0) + tensor_bytes(ir.RankedTensorType(value.type))
        return out

    def summed(self) -> dict[int, int]:
        """Per component, the bytes its sums over the gathered dim would all_reduce."""
        out: dict[int, int] = {}
        for op, c in self.reduced.items():
            root = self.find(c.component)
            out[root] = out.get(root, 0) + tensor_bytes(ir.RankedTensorType(op.results[0].type))
        return out

    def drop(self, components: set[int]) -> None:
        self.carried = {v: c for v, c in self.carried.items() if self.find(c.component) not in components}
        self.reduced = {op: c for op, c in self.reduced.items() if self.find(c.component) not in components}


def _rowwise(op: ir.OpView, dims: dict[int, int], ring: Ring, variance: Variance) -> tuple[int, list[str]]:
    """The result dim along which ``op``'s result rows are its carried operands' rows (``dims``:
    operand index -> carried dim), and each operand's role; or Decline when the op mixes rows
    or reads a value that may differ between devices."""
    name = op.operation.name
    operands = list(op.operation.operands)
    result_t = ir_utils.ranked_tensor(op.operation.results[0])
    if result_t is None or not ir_utils.is_static(result_t):
        raise Decline("layout", "dynamic shape")
    if name in ROWWISE_ELEMENTWISE or name == SHARDING_CONSTRAINT:
        dim = _one(dims)
        roles = []
        for i, v in enumerate(operands):
            if i in dims:
                roles.append("carried")
                continue
            _identical(v, ring, variance)
            t = ir.RankedTensorType(v.type)
            if t.rank == 0:
                roles.append("keep")
            elif list(t.shape) != list(result_t.shape):
                raise Decline("layout", "operand shapes differ")
            else:
                roles.append(_slice_role(op, v, dim))
        return dim, roles
    if name == "stablehlo.broadcast_in_dim":
        dim = dims[0]
        target = ir_utils.i64s(op, "broadcast_dimensions")[dim]
        if ir.RankedTensorType(operands[0].type).shape[dim] != result_t.shape[target]:
            raise Decline("layout", "broadcast along the carried dim")
        return target, ["carried"]
    if name == "stablehlo.transpose":
        return ir_utils.i64s(op, "permutation").index(dims[0]), ["carried"]
    if name == "stablehlo.reshape":
        return forward_dim(op, dims[0], ring.size), ["carried"]
    if name == "stablehlo.reduce" and len(operands) == 2 and set(dims) == {0}:
        reduced = ir_utils.i64s(op, "dimensions")
        dim = dims[0]
        if dim in reduced:
            raise Decline("layout", "reduces the carried dim")
        _identical(operands[1], ring, variance)
        return dim - sum(1 for d in reduced if d < dim), ["carried", "keep"]
    raise Decline("layout", f"{name} is not row-wise")


def _sums_carried_dim(op: ir.OpView, dims: dict[int, int]) -> bool:
    """Is ``op`` one sum from zero (``stablehlo.reduce`` of its carried operand, an ``add`` region, a
    zero init) over dims that include the carried one?  Then it is the sum of each device's
    partial sum over its rows."""
    operands = list(op.operation.operands)
    if op.operation.name != "stablehlo.reduce" or len(operands) != 2 or set(dims) != {0}:
        return False
    if dims[0] not in ir_utils.i64s(op, "dimensions") or not ir_utils.is_zero_splat(operands[1]):
        return False
    return region_is_sum(op)


def _one(dims: dict[int, int]) -> int:
    values = set(dims.values())
    if len(values) != 1:
        raise Decline("layout", "operands carried along different dims")
    return values.pop()


def _identical(value: ir.Value, ring: Ring, variance: Variance) -> None:
    if not variance.identical(value, ring):
        raise Decline("varies", "reads a value that may differ between the group's devices")


def _slice_role(op: ir.OpView, value: ir.Value, dim: int) -> str:
    """"block": the same in every block along ``dim`` (rebuilt at block size); "slice": this
    device's rows of it are cut out."""
    try:
        invariant_source(op, value, dim)
        return "block"
    except Decline:
        return "slice"


def _seeds_in(plan: _Plan, value: ir.Value) -> frozenset[int]:
    """The split sites whose rows ``value`` holds: the seeds it is computed from through carried
    ops (its component may hold more: a residual stream joins every block's psum, but the value
    before the second block's psum holds only the first's)."""
    found, pending, seen = set(), [value], set()
    while pending:
        v = pending.pop()
        c = plan.carried.get(v)
        if c is None or v in seen:
            continue
        seen.add(v)
        if c.op is None:
            found.add(plan.seeds[v].site)
        else:
            pending += list(c.op.operation.operands)
    return frozenset(found)


def _build(plan: _Plan, readers: dict[ir.Value, ir.Operation], block: ir.Block, take_channel, constants: dict,
           source: str | None, carry: Carry) -> None:
    rows: dict[ir.Value, ir.Value] = {}  # carried value -> this device's rows of it
    moved: dict[int, int] = {}
    sliced: dict[int, list[str]] = {}
    sums: dict[int, int] = {}  # per component: its sums over the gathered dim, now partial sums all_reduced
    for value, c in plan.carried.items():
        if c.op is None:
            rows[value] = plan.seeds[value].all_gather.operation.operands[0]
    carried_ops = [c.op for c in plan.carried.values() if c.op is not None]
    keep_sources = {op.operation for op in carried_ops}
    for op in list(block.operations):
        if op.operation in plan.reduced:
            root = plan.find(plan.reduced[op.operation].component)
            moved[root] = moved.get(root, 0) + 1
            template = plan.seed_of_component[root].all_gather
            with ir.InsertionPoint(op.operation):
                summed = _sum_rows(op, rows, template, take_channel())
            op.result.replace_all_uses_with(summed)
            sums[root] = sums.get(root, 0) + 1
            _erase_with_dead_sources(op, keep_sources)
        elif op.operation in plan.roles and op.result in plan.carried:
            c = plan.carried[op.result]
            root = plan.find(c.component)
            moved[root] = moved.get(root, 0) + 1
            with ir.InsertionPoint(op.operation):
                rows[op.result] = _on_rows(op, plan.roles[op.operation], rows, c, constants, sliced.setdefault(root, []),
                                           source)
    # gather each value that a reader needs whole, once, before its first such reader
    for value, reader in readers.items():
        c = plan.carried[value]
        seed = plan.seed_of_component[plan.find(c.component)]
        loc = seed.all_gather.location
        with ir.InsertionPoint(reader):
            ag = hlo.AllGatherOp([value.type], [rows[value]], c.dim, seed.all_gather.attributes["replica_groups"],
                                 channel_handle=hlo.ChannelHandle.get(take_channel(), 1),
                                 use_global_device_ids=True, loc=loc)
        keep = {op.operation for op in carried_ops}
        for use in list(value.uses):
            if use.owner not in keep:
                use.owner.operands[use.operand_number] = ag.results[0]
        seeds = _seeds_in(plan, value)
        carry.materialised.append(Materialised(
            ag, f"{reader.name} at {ir_utils.render_location(reader.location, source)}",
            _feeds_dot(ag), seeds, moved.get(plan.find(c.component), 0), sums.get(plan.find(c.component), 0)))
    for op in reversed(carried_ops):
        _erase_with_dead_sources(op, keep_sources)
    for seed in plan.seeds.values():
        if seed.all_gather.result in plan.carried:
            seed.all_gather.operation.erase()
    for i, seed in plan.seed_of_component.items():
        root = plan.find(i)
        if root not in moved:
            continue
        note = f"{moved.get(root, 0)} row-wise op(s) after it now run on this device's rows"
        if sums.get(root):
            note += (f", {sums[root]} sum(s) over the gathered dim as partial sums over the rows, each summed over "
                     "the group by an all_reduce")
        if sliced.get(root):
            note += f"; sliced to the device's rows: {', '.join(dict.fromkeys(sliced[root]))}"
        carry.notes.setdefault(seed.site, []).append(note)


def _on_rows(op: ir.OpView, roles: list[str], rows: dict, c: _Carried, constants: dict, sliced: list[str],
             source: str | None) -> ir.Value:
    """``op`` built again on rows: carried operands replaced by their rows, values the same on
    every device cut to this device's rows."""
    n = c.ring.size
    b = Builder(op.location, constants)
    operands = list(op.operation.operands)
    if op.operation.name == SHARDING_CONSTRAINT:
        return rows[operands[0]]  # a hint about the whole value; the rows need none
    new = []
    for value, role in zip(operands, roles):
        if role == "carried":
            new.append(rows[value])
        elif role == "keep":
            new.append(value)
        elif role == "block":
            new.append(block_of(invariant_source(op, value, c.dim), c.dim, n, op.location))
        else:
            width = ir.RankedTensorType(value.type).shape[c.dim] // n
            offset = b.scaled(b.position_in_ring(c.ring, c.region), width)
            new.append(b.dynamic_slice(value, c.dim, offset, width))
            sliced.append(_describe(value, source))
    clone = op.operation.clone(ip=ir.InsertionPoint(op.operation))
    for i, value in enumerate(new):
        clone.operands[i] = value
    clone.results[0].set_type(shard_type(ir.RankedTensorType(op.result.type), c.dim, n))
    return clone.results[0]


def _sum_rows(op: ir.OpView, rows: dict, template: ir.OpView, channel: int) -> ir.Value:
    """``op`` (a sum over the carried dim, :func:`_sums_carried_dim`) on this device's rows, summed
    over ``template``'s (the seed all_gather's) groups: the same value on every device of the group."""
    partial = op.operation.clone(ip=ir.InsertionPoint(op.operation))
    partial.operands[0] = rows[op.operation.operands[0]]
    return sum_all_reduce(partial.results[0], template.attributes["replica_groups"], channel, op.location).result


def _feeds_dot(op: ir.OpView) -> bool:
    return any(use.owner.name == "stablehlo.dot_general" for r in op.operation.results for use in r.uses)


def _describe(value: ir.Value, source: str | None) -> str:
    owner = value.owner
    if isinstance(owner, ir.Block):
        return f"argument {ir.BlockArgument(value).arg_number}"
    return f"{owner.operation.name} at {ir_utils.render_location(owner.location, source)}"


def _erase_with_dead_sources(op: ir.OpView, carried: set) -> None:
    """Erase ``op`` (unused now) and the broadcasts and constants only it read (not ``carried``
    ops: they are erased in their turn)."""
    # each source once, told apart while all are alive: ``op`` may read one twice (``clamp %b, %x, %b``),
    # and the bindings may hand out two objects for it, the second dangling once the first erases it
    sources = list(dict.fromkeys(v.owner.operation for v in op.operation.operands if not isinstance(v.owner, ir.Block)))
    op.operation.erase()
    for owner in sources:
        if owner not in carried and owner.name in ("stablehlo.broadcast_in_dim", "stablehlo.constant") and \
                not any(list(r.uses) for r in owner.results):
            owner.erase()
