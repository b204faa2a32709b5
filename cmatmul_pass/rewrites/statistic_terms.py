"""A row statistic of the product spread back over the scattered dim, taken out of the scatter.

The backward of a norm over features that are gathered before it (activations sharded along their
features, gathered, RMS- or layer-normalised, projected) scatters the input gradient along those
features, and the norm's backward reads a sum over them:

    dx = psum_scatter(rs*g*dy - x * rs^3/F * sum_f(g*dy*x), features)      (dy = the product)

The sum over the scattered dim is spread back over it (a ``broadcast_in_dim``), so no block of the
product gives a block of the scattered value and the scatter has no ring.  :func:`split_terms`
rewrites the scatter's operand ``V = L1(P) + L2(b)``, with ``b = spread(post(s))`` and ``s`` the sums
over the scattered dim, into

    reduce_scatter(V)  =  reduce_scatter(L1(P))  +  L2(spread(post(all_reduce(s))))[own block]

**Identity.**  ``V`` is linear in ``b`` (every op from a spread to the scattered value adds,
subtracts, negates, converts, or scales a value computed from ``b`` by one that is not), so
``V = V|b=0 + L2(b)``, ``L2`` being those ops with every other addend zero.  The scatter sums the
devices' values, each device's ``b`` is its own ``b_d``: ``sum_d L2(b_d)[own] = L2(sum_d b_d)[own]``
when ``L2``'s scales are the same on every device, and ``sum_d spread(post(s_d)) =
spread(post(sum_d s_d))`` when ``post`` (the ops from the sums to the spreads) is linear in the sums
with scales the same on every device.  ``sum_d s_d`` is an ``all_reduce`` of one value per row (the
sums of one element type concatenated into one all_reduce); ``L2``
is elementwise, so its own block reads each scale's own block.  ``V|b=0`` is the product's blocks
under ops the scatter ring applies block by block (its sums over the scattered dim are added up
block by block, then summed over the devices by that ``all_reduce``).

**Side conditions**, checked by :func:`statistic_terms` (each failure a reason; the site stays):

- every op from a spread to the scattered value is elementwise on the scattered value's shape and
  linear in the spread values (add, subtract, negate, convert; multiply by, divide by, a value
  computed apart from them), and every such scale is the same on every device of the scatter's
  group (:meth:`~cmatmul_pass.analysis.variance.Variance.identical`);
- a spread is a ``broadcast_in_dim`` onto that shape along the scattered dim of a value that may
  differ between devices; every such value on the way back from a spread is a linear function
  (add, subtract of two; multiply, divide by one the same on every device; negate, convert,
  reshape, transpose, broadcast, a sum from zero) of *sums*: reduces summing, from zero, the
  scattered dim of a value of the scattered value's shape (an affine term would be counted once
  per device);
- something of the scattered value is left when the spread values are zero (else no product
  remains to ring).

Made only where the scatter is then rewritten (:mod:`cmatmul_pass.attempts` undoes it otherwise).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .. import ir_utils
from .._jax_private import hlo, ir
from ..analysis.variance import Variance
from ..errors import Decline
from ..layout import invariant_source
from ..matchers.common import describe_op
from ..matchers.scatter_terms import is_sum_from_zero, producers_first
from ..ring import Ring
from .builders import Builder, erase_dead
from .dot_all_reduce import sum_all_reduce

#: ops linear in one operand (or in each of two, for add and subtract) from a spread to the scatter
TERM_OPS = frozenset(f"stablehlo.{name}" for name in ("add", "subtract", "multiply", "divide", "negate", "convert")
                     ) | {"sdy.sharding_constraint"}  # (a partial-manual region's hint: dropped from the block)
#: and from the sums to the spreads: those, layout ops, broadcasts and sums
POST_OPS = TERM_OPS | frozenset(f"stablehlo.{name}" for name in ("reshape", "transpose", "broadcast_in_dim",
                                                                 "reduce"))
BROADCAST = "stablehlo.broadcast_in_dim"


@dataclass(frozen=True)
class StatisticTerms:
    """A scatter whose operand spreads sums over the scattered dim back over it (:func:`statistic_terms`)."""

    reduce_scatter: ir.OpView
    dim: int
    #: the reduces summing the scattered dim: all_reduced after the scatter
    sums: tuple[ir.OpView, ...]
    #: the ops from the sums to the spreads, producers first
    post: tuple[ir.OpView, ...]
    #: the broadcasts spreading a value computed from the sums along the scattered dim
    spreads: tuple[ir.OpView, ...]
    #: the ops from the spreads to the scattered value, producers first
    terms: tuple[ir.OpView, ...]


def statistic_terms(rs: ir.OpView, variance: Variance, ring: Ring) -> StatisticTerms | str | None:
    """The scatter ``rs``'s operand as terms spreading sums over the scattered dim; a reason they
    cannot be taken out (str); or None (no spread of a value that differs between devices)."""
    root = rs.operation.operands[0]
    if isinstance(root.owner, ir.Block):
        return None
    block = rs.operation.block
    shape = list(ir.RankedTensorType(root.type).shape)
    dim = ir_utils.int_attr(rs, "scatter_dimension")

    def elementwise(op: ir.OpView) -> bool:
        return (op.operation.block == block and op.operation.name in TERM_OPS
                and list(ir.RankedTensorType(op.result.type).shape) == shape)

    # back from the scattered value through elementwise ops of its shape: the spreads they read
    seen: dict[ir.Operation, ir.OpView] = {}
    spreads: dict[ir.Operation, ir.OpView] = {}
    stack = [root.owner]
    while stack:
        op = stack.pop()
        if op.operation in seen or op.operation in spreads:
            continue
        if _spread(op, block, shape, dim) and not variance.identical(op.operation.operands[0], ring):
            spreads[op.operation] = op
        elif elementwise(op):
            seen[op.operation] = op
            stack += [v.owner for v in op.operation.operands if not isinstance(v.owner, ir.Block)]
    if not spreads:
        return None
    # the spreads of linear functions of sums over the scattered dim (another varying value spread,
    # an axis index say, is a scale like any other)
    sums: dict[ir.Operation, ir.OpView] = {}
    post: dict[ir.Operation, ir.OpView] = {}
    failed: list[tuple[bool, str]] = []  # (whether it spreads a sum, why not), the spreads' that fail
    for key, spread in list(spreads.items()):
        found_sums, found_post = dict(sums), dict(post)
        why = _post_linear(spread.operation.operands[0], block, shape, dim, variance, ring, found_sums, found_post, {})
        if why:
            failed.append((_reaches_sum(spread.operation.operands[0], block, shape, dim),
                           f"{describe_op(spread)} spreads {why}"))
            del spreads[key]
        else:
            sums, post = found_sums, found_post
    if not spreads:  # (say why a spread of a sum fails, before another varying value's)
        return sorted(failed, key=lambda f: not f[0])[0][1]
    # forward from the spreads: the terms (each linear in the spread values it reads)
    on_b = set(spreads)
    terms = []
    for op in producers_first(seen.values()):
        read = [not isinstance(v.owner, ir.Block) and v.owner.operation in on_b for v in op.operation.operands]
        if not any(read):
            continue
        why = _term_linear(op, read, variance, ring)
        if why:
            return why
        on_b.add(op.operation)
        terms.append(op)
    if _zero_when_spreads_are(terms, spreads, root):
        return (f"{describe_op(root.owner)} is made only of spread sums over the scattered dim: no product is "
                "left for a ring")
    return StatisticTerms(rs, dim, producers_first(sums.values()),
                          producers_first(post.values()),
                          producers_first(spreads.values()), tuple(terms))


def _spread(op: ir.OpView, block: ir.Block, shape: list[int], dim: int) -> bool:
    """Is ``op`` a broadcast onto ``shape`` along ``dim`` (one value for the dim's every element)?"""
    if op.operation.block != block or op.operation.name != BROADCAST or shape[dim] == 1:
        return False
    if list(ir.RankedTensorType(op.result.type).shape) != shape:
        return False
    try:
        invariant_source(op, op.result, dim)  # (the broadcast's blocks along ``dim`` are all alike)
    except Decline:
        return False
    return True


def _term_linear(op: ir.OpView, read: list[bool], variance: Variance, ring: Ring) -> str | None:
    """Why ``op`` (reading spread values where ``read``) is not linear in them with scales the same
    on every device (None: it is)."""
    name = op.operation.name
    operands = list(op.operation.operands)
    if name in ("stablehlo.add", "stablehlo.subtract", "stablehlo.negate", "stablehlo.convert",
                "sdy.sharding_constraint"):
        return None
    if ((name == "stablehlo.multiply" and read.count(True) == 1)
            or (name == "stablehlo.divide" and read == [True, False])):
        scale = operands[read.index(False)]
        if variance.identical(scale, ring):
            return None
        what = "a region argument" if isinstance(scale.owner, ir.Block) else describe_op(scale.owner)
        return (f"{describe_op(op)} scales a spread sum over the scattered dim by {what}, which may differ between "
                "devices: the scatter's sum of the devices' terms is no term of the summed statistic")
    return f"{describe_op(op)} is not linear in the spread sums over the scattered dim it reads"


def _zero_when_spreads_are(terms: list[ir.OpView], spreads: dict, root: ir.Value) -> bool:
    """Is the scattered value zero when every spread value is (nothing left for the product)?"""
    zero = set(spreads)
    for op in terms:
        read = [not isinstance(v.owner, ir.Block) and v.owner.operation in zero for v in op.operation.operands]
        if all(read) if op.operation.name in ("stablehlo.add", "stablehlo.subtract") else any(read):
            zero.add(op.operation)  # (a scale is never a spread value: any() reads the scaled operand)
    return root.owner.operation in zero


def _post_linear(value: ir.Value, block: ir.Block, shape: list[int], dim: int, variance: Variance, ring: Ring,
                 sums: dict, post: dict, memo: dict) -> str | None:
    """Why ``value`` (which may differ between devices) is not a linear function of sums over the
    scattered dim with scales the same on every device (None: it is; ``sums``, ``post`` gain the
    ops it is made of)."""
    owner = value.owner
    if isinstance(owner, ir.Block) or owner.operation.block != block:
        return "a value from outside the scatter's block that may differ between devices"
    if owner.operation in memo:
        return memo[owner.operation]
    memo[owner.operation] = None  # (a DAG: each op once)
    name = owner.operation.name
    operands = list(owner.operation.operands)
    if name == "stablehlo.reduce" and _sums_dim(owner, shape, dim):
        sums[owner.operation] = owner
        return None
    varying = ([] if name not in POST_OPS else  # (the reduce's init is its own: not asked)
               [not variance.identical(v, ring) for v in operands[:1 if name == "stablehlo.reduce" else None]])
    if name not in POST_OPS or (name == "stablehlo.reduce" and not is_sum_from_zero(owner)):
        why = f"{describe_op(owner)}, not linear in sums over the scattered dim"
    elif name in ("stablehlo.add", "stablehlo.subtract") and not all(varying):
        why = (f"{describe_op(owner)}, which adds a value the same on every device to a sum over the scattered "
               "dim (the scatter would count it once per device)")
    elif name == "stablehlo.multiply" and all(varying):
        why = f"{describe_op(owner)}, a product of two values that may differ between devices"
    elif name == "stablehlo.divide" and varying[1]:
        why = f"{describe_op(owner)}, a division by a value that may differ between devices"
    else:
        why = None
        for operand, varies in zip(operands, varying):
            if varies:
                why = why or _post_linear(operand, block, shape, dim, variance, ring, sums, post, memo)
        if why is None:
            post[owner.operation] = owner
    memo[owner.operation] = why
    return why


def _reaches_sum(value: ir.Value, block: ir.Block, shape: list[int], dim: int) -> bool:
    """Is ``value`` computed (in ``block``) from a sum over the scattered dim?"""
    seen: set = set()
    stack = [value]
    while stack:
        owner = stack.pop().owner
        if isinstance(owner, ir.Block) or owner.operation.block != block or owner.operation in seen:
            continue
        seen.add(owner.operation)
        if owner.operation.name == "stablehlo.reduce" and _sums_dim(owner, shape, dim):
            return True
        stack += list(owner.operation.operands)
    return False


def _sums_dim(op: ir.OpView, shape: list[int], dim: int) -> bool:
    """Is ``op`` a sum from zero over ``dim`` of a value of ``shape``?"""
    operand = op.operation.operands[0]
    return (is_sum_from_zero(op) and list(ir.RankedTensorType(operand.type).shape) == shape
            and dim in ir_utils.i64s(op, "dimensions"))


def split_terms(plan: StatisticTerms, ring: Ring, region, constants: dict, take_channel) -> None:
    """Rewrite ``plan``'s scatter into the scatter of its operand with the spread values zero, plus
    the spread terms' own block computed from the all_reduced sums (the module's identity), built
    after the scatter at its location; ``take_channel()``: a fresh channel for each all_reduce."""
    rs, dim = plan.reduce_scatter, plan.dim
    root = rs.operation.operands[0]
    with ir.InsertionPoint(rs.operation):
        kept = _rebuild(plan.terms, {op.operation for op in plan.spreads}, {}, lambda v, op: v, lambda v, t: t)
    rs.operation.operands[0] = kept[root]
    b = Builder(rs.location, constants)
    with ir.InsertionPoint.after(rs.operation):
        summed = _all_reduced(plan.sums, rs.attributes["replica_groups"], take_channel, b)
        for op in plan.post:
            clone = op.operation.clone()
            for i, operand in enumerate(op.operation.operands):
                if operand in summed:
                    clone.operands[i] = summed[operand]
            summed[op.result] = clone.results[0]
        width = ir.RankedTensorType(rs.result.type).shape[dim]
        offset = b.scaled(b.position_in_ring(ring, region), width)
        own = {op.result: hlo.BroadcastInDimOp(ir_utils.with_dim(ir.RankedTensorType(op.result.type), dim, width),
                                               summed[op.operation.operands[0]], op.attributes["broadcast_dimensions"],
                                               loc=op.location).result for op in plan.spreads}

        def scale(value: ir.Value, op: ir.OpView) -> ir.Value:  # the scale's own block
            return b.at(op.location).dynamic_slice(value, dim, offset, width)

        built = _rebuild(plan.terms, set(), own, scale, lambda v, t: ir_utils.with_dim(t, dim, width))
        total = hlo.AddOp(rs.result, built[root], loc=rs.location)
    rs.result.replace_all_uses_with(total.result)
    total.operation.operands[0] = rs.result
    erase_dead(list(reversed(plan.terms)) + list(plan.spreads) + list(reversed(plan.post)))


def _all_reduced(sums: tuple[ir.OpView, ...], groups: ir.Attribute, take_channel, b: Builder) -> dict:
    """Each sum's result -> its all_reduce over ``groups``: one all_reduce where the sums have one
    element type (each flattened, concatenated, and sliced back out: one latency, not several)."""
    types = [ir.RankedTensorType(op.result.type) for op in sums]
    if len(sums) == 1 or len({t.element_type for t in types}) != 1:
        return {op.result: sum_all_reduce(op.result, groups, take_channel(), op.location).result for op in sums}
    sizes = [math.prod(t.shape) for t in types]
    flat = [op.result if t.rank == 1 else
            b.create("stablehlo.reshape", [ir.RankedTensorType.get([size], t.element_type)], [op.result]).result
            for op, t, size in zip(sums, types, sizes)]
    total = sum_all_reduce(b.concatenate(flat, 0), groups, take_channel(), b.loc).result
    out, start = {}, 0
    for op, t, size in zip(sums, types, sizes):
        piece = b.slice(total, 0, start, size)
        out[op.result] = piece if t.rank == 1 else b.create("stablehlo.reshape", [t], [piece]).result
        start += size
    return out


def _rebuild(terms, zero: set, blocks: dict, scale, result_type) -> dict:
    """The terms rebuilt at the insertion point: each value of ``zero`` (ops) read as zero, each of
    ``blocks`` (values) as its replacement; a term's other operands read through ``scale(value,
    op)`` where they scale, as zero where they are added; ``result_type(value, type)``: each
    rebuilt op's type.  Returns each term's value -> its rebuilt value (None: zero)."""
    made: dict = {}

    def read(value: ir.Value):
        if value in blocks:
            return blocks[value]
        if value in made:
            return made[value]
        if not isinstance(value.owner, ir.Block) and value.owner.operation in zero:
            return None
        return value

    on = set(zero) | {v.owner.operation for v in blocks if not isinstance(v.owner, ir.Block)}
    for op in terms:
        name, loc = op.operation.name, op.location
        operands = list(op.operation.operands)
        tracked = [v in made or v in blocks or (not isinstance(v.owner, ir.Block) and v.owner.operation in on)
                   for v in operands]
        args = [read(v) if t else v for v, t in zip(operands, tracked)]
        out_t = result_type(op.result, op.result.type)
        if name in ("stablehlo.add", "stablehlo.subtract"):
            if blocks and not all(tracked):  # (the spread terms alone: the other addend is zero)
                args = [a if t else None for a, t in zip(args, tracked)]
            x, y = args
            if x is None and y is None:
                value = None
            elif y is None:
                value = x
            elif x is None:
                value = y if name == "stablehlo.add" else hlo.NegOp(y, loc=loc).result
            else:
                value = ir.Operation.create(name, results=[out_t], operands=[x, y], loc=loc).result
        elif name in ("stablehlo.multiply", "stablehlo.divide"):
            i = tracked.index(True)
            if args[i] is None:
                value = None
            else:
                args = [a if t else scale(a, op) for a, t in zip(args, tracked)]
                value = ir.Operation.create(name, results=[out_t], operands=args, loc=loc).result
        elif name == "sdy.sharding_constraint":  # a hint about the whole value
            value = args[0]
        else:  # negate, convert
            value = None if args[0] is None else ir.Operation.create(name, results=[out_t], operands=args,
                                                                     loc=loc).result
        made[op.result] = value
        on.add(op.operation)
    return made
