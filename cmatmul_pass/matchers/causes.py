"""What actually stopped a site: the facts a decline states, found through the bindings.

A matcher declines a site on the first property it cannot prove.  These helpers look further,
so that the reason says what is true:

* a gathered value that leaves its shard_map region (``sdy.return``) for a dot in a later one,
  and a scattered value computed by a dot in an earlier one: the user already keeps that
  transfer apart from its matmul (:func:`dot_in_later_region`, :func:`dot_in_earlier_region`);
* a grouped matmul (``jax.lax.ragged_dot``: ``chlo.ragged_dot``, or the ``stablehlo.composite``
  ``jax.export`` writes for it) next to the collective (:func:`ragged_dot_after`,
  :func:`ragged_dot_before`);
* the op that makes an operand differ from block to block of the ring dim (:func:`why_varies`).

Each returns None where its fact does not hold; the caller keeps its own decline then.  Nothing
here mutates IR.
"""

from __future__ import annotations

from .. import ir_utils
from .._jax_private import ir
from ..errors import Decline
from ..layout import is_elementwise, is_layout_op
from .common import describe_op

DOT = "stablehlo.dot_general"
MANUAL = "sdy.manual_computation"
#: ops whose one region takes their operands as its arguments and returns their results (sdy.return)
REGIONS = frozenset({MANUAL, "sdy.named_computation"})
RAGGED_DOT = "chlo.ragged_dot"
#: collectives a value may pass on its way between a dot and a later region's scatter (a data-
#: parallel psum of a gradient, a gather of it)
THROUGH_COLLECTIVES = frozenset({"stablehlo.all_reduce", "stablehlo.all_gather"})
#: the most values one search visits (a bound on the walk, not a limit real programs meet)
LIMIT = 512


def is_ragged_dot(op: ir.OpView | ir.Operation) -> bool:
    name = op.name if isinstance(op, ir.Operation) else op.operation.name
    if name == RAGGED_DOT:
        return True
    attrs = op.attributes
    return name == "stablehlo.composite" and "name" in attrs and ir.StringAttr(attrs["name"]).value == RAGGED_DOT


def _in_manual_region(op: ir.OpView | ir.Operation) -> bool:
    walk = op.operation.parent if isinstance(op, ir.OpView) else op.parent
    while walk is not None:
        if walk.name == MANUAL:
            return True
        walk = walk.parent
    return False


def _terminator(region: ir.Region) -> ir.Operation:
    return list(region.blocks[0].operations)[-1].operation


def dot_in_later_region(returned: ir.Value, region: ir.Operation) -> ir.OpView | None:
    """A dot_general in a shard_map region that reads ``returned`` — a value the ``sdy.return`` of
    ``region`` (an ``sdy.manual_computation``) hands out — after it leaves: followed through the
    region's result to another region's argument, a loop's carried state (the next trip), a
    call's argument or result, through layout and elementwise ops; None if no dot reads it."""
    symbols = None
    ret = _terminator(region.regions[0])
    pending = [region.results[i] for i, v in enumerate(ret.operands) if v == returned]
    seen: set = set()
    while pending and len(seen) < LIMIT:
        value = pending.pop(0)
        if value in seen:
            continue
        seen.add(value)
        for use in value.uses:
            op, i = use.owner, use.operand_number
            name = op.operation.name
            if name == DOT:
                if _in_manual_region(op):
                    return op
            elif is_layout_op(op) or is_elementwise(op):
                pending.append(op.result)
            elif name == "sdy.return":
                pending.append(op.operation.parent.results[i])
            elif name in REGIONS:
                pending.append(op.operation.regions[0].blocks[0].arguments[i])
            elif name == "stablehlo.while":
                pending += [op.operation.regions[1].blocks[0].arguments[i], op.operation.results[i]]
            elif name == "stablehlo.return" and op.operation.parent.name == "stablehlo.while":
                loop = op.operation.parent
                if op.operation.block == loop.regions[1].blocks[0]:  # the body: the next trip's state
                    pending += [loop.regions[1].blocks[0].arguments[i], loop.results[i]]
            elif name in ("func.call", "func.return"):
                symbols = symbols or ir_utils.Symbols(region)
                if name == "func.call":
                    pending += symbols.entry_args(op)[i:i + 1]
                else:
                    func_name = ir_utils.symbol_name(op.operation.parent)
                    pending += [call.results[i] for call in symbols.calls.get(func_name, [])]
    return None


def dot_in_earlier_region(argument: ir.Value) -> tuple[ir.OpView, list[str]] | None:
    """The dot_general, in another shard_map region, that computes ``argument`` (a block argument
    of the region holding a collective), and the collectives on the way (``describe_op`` of each);
    followed back through the region's operand, another region's ``sdy.return``, a loop's carried
    state, calls, layout and elementwise ops and :data:`THROUGH_COLLECTIVES`.  None if no dot."""
    symbols = None
    pending, seen, via = [argument], set(), []
    while pending and len(seen) < LIMIT:
        value = pending.pop(0)
        if value in seen:
            continue
        seen.add(value)
        owner = value.owner
        if isinstance(owner, ir.Block):
            parent, i = owner.owner, value.arg_number
            if parent.name in REGIONS:
                pending.append(parent.operands[i])
            elif parent.name == "stablehlo.while" and owner == parent.regions[1].blocks[0]:
                pending += [parent.operands[i], _terminator(parent.regions[1]).operands[i]]
            elif parent.name == "func.func":
                symbols = symbols or ir_utils.Symbols(parent)
                pending += [call.operands[i] for call in symbols.calls.get(ir_utils.symbol_name(parent), [])]
            continue
        name, i = owner.operation.name, value.result_number
        if name == DOT:
            if value != argument and _in_manual_region(owner):
                return owner, via
        elif is_layout_op(owner) or is_elementwise(owner) or name in THROUGH_COLLECTIVES:
            if name in THROUGH_COLLECTIVES:
                via.append(describe_op(owner))
            pending += list(owner.operation.operands)
        elif name in REGIONS:
            pending.append(_terminator(owner.operation.regions[0]).operands[i])
        elif name == "stablehlo.while":
            pending += [owner.operation.operands[i], _terminator(owner.operation.regions[1]).operands[i]]
        elif name == "func.call":
            symbols = symbols or ir_utils.Symbols(owner)
            pending += symbols.returned(owner, i)
    return None


def find_near(start: ir.Value, forward: bool, match) -> ir.OpView | None:
    """An op ``match(op)`` accepts among those computed from ``start`` (``forward``) or that
    ``start`` is computed from, in its block, through any ops but dot_general (a dense matmul on
    the way is the dot the matchers look for: the search stops there); a call matches when its
    function holds a matching op."""
    symbols = None
    pending, seen = [start], set()
    while pending and len(seen) < LIMIT:
        value = pending.pop(0)
        if value in seen:
            continue
        seen.add(value)
        ops = ir_utils.users(value) if forward else ([] if isinstance(value.owner, ir.Block) else [value.owner])
        for op in ops:
            if match(op):
                return op
            if op.operation.name == DOT:
                continue
            if op.operation.name == "func.call":
                symbols = symbols or ir_utils.Symbols(op)
                callee = symbols.callee(op)
                if callee is not None and any(match(inner) for inner in ir_utils.walk(callee)):
                    return op
            pending += list(op.operation.results) if forward else list(op.operation.operands)
    return None


def is_partition_id(op: ir.OpView) -> bool:
    return op.operation.name == "stablehlo.partition_id"


def _called_ops(call: ir.OpView, nested: bool):
    """The ops of ``call``'s function and of the functions it calls (eight at most), calls aside;
    ``nested``: the ops inside their regions too."""
    symbols, pending, seen = ir_utils.Symbols(call), [call], set()
    while pending and len(seen) < 8:
        callee = ir.FlatSymbolRefAttr(pending.pop(0).attributes["callee"]).value
        if callee in seen or callee not in symbols.funcs:
            continue
        seen.add(callee)
        function = symbols.funcs[callee]
        for op in ir_utils.walk(function) if nested else list(function.regions[0].blocks[0].operations):
            if op.operation.name == "func.call":
                pending.append(op)
            else:
                yield op


def callee_work(call: ir.OpView) -> list[str]:
    """The names of the ops in a called function (and the functions it calls) that are neither
    layout, elementwise nor plain copies: what the call does (``stablehlo.sort``), at most three."""
    names = [op.operation.name for op in _called_ops(call, nested=False)
             if op.operation.name not in PLAIN | BOOKKEEPING and not is_layout_op(op) and not is_elementwise(op)]
    return list(dict.fromkeys(names))[:3]


def collectives_in(call: ir.OpView) -> list[str]:
    """The collectives in ``call``'s function (and the functions it calls), by name."""
    return list(dict.fromkeys(op.operation.name for op in _called_ops(call, nested=True)
                              if op.operation.name in ir_utils.CHANNEL_OPS))


#: ops of a function body that do no work on the data (its return, index arithmetic)
BOOKKEEPING = frozenset({"func.return", "stablehlo.iota", "stablehlo.compare", "stablehlo.select"})


def ragged_dot_after(value: ir.Value) -> ir.OpView | None:
    """A grouped matmul reading ``value`` (through ops other than a dense dot), or None."""
    return find_near(value, True, is_ragged_dot)


def ragged_dot_before(value: ir.Value) -> ir.OpView | None:
    """A grouped matmul ``value`` is computed from (through ops other than a dense dot), or None."""
    return find_near(value, False, is_ragged_dot)


def ragged_dot_decline(op: ir.OpView, role: str) -> Decline:
    """``role``: how the collective's value meets it ("the gathered value feeds", ...)."""
    inside = "" if op.operation.name == RAGGED_DOT else (
        ' ("chlo.ragged_dot", as jax.export writes it)' if is_ragged_dot(op)
        else " (a call of a function that holds chlo.ragged_dot)")
    return Decline("ragged_dot", f"{role} {describe_op(op)}{inside}: a grouped matmul (jax.lax.ragged_dot, an MoE "
                                 "block's expert matmul) past ops the ring cannot apply block by block (a ring takes "
                                 "a grouped matmul that reads the gathered value, or whose product it scatters, "
                                 "through layout and elementwise ops only)")


def computed_from(value: ir.Value, origin: ir.Value | None) -> tuple[bool, ir.OpView | None]:
    """Is ``value`` computed (in its block) from ``origin``, and through which op that is neither
    layout nor elementwise (a reduction: what makes it a statistic of ``origin``; None when only
    elementwise ops lie between, as in an activation)?"""
    if origin is None:
        return False, None
    pending, seen = [(value, None)], set()
    while pending and len(seen) < LIMIT:
        v, through = pending.pop(0)
        if v == origin:
            return True, through
        if v in seen or isinstance(v.owner, ir.Block):
            continue
        seen.add(v)
        op = v.owner
        if through is None and not (is_layout_op(op) or is_elementwise(op) or op.operation.name in PLAIN):
            through = op
        pending += [(operand, through) for operand in op.operation.operands]
        if len(op.operation.regions):  # a loop reads values of its block inside its body too
            pending += [(captured, through) for captured in ir_utils.captured(op)]
    return False, None


#: ops that only copy values around (a statistic broadcast back over its row)
PLAIN = frozenset({"stablehlo.broadcast_in_dim", "stablehlo.constant", "sdy.sharding_constraint"})


def why_varies(operand: ir.Value, dim: int, origin: ir.Value | None, what: str) -> str:
    """What ``operand`` is, which differs from block to block along ``dim``: the op that makes it
    so, and whether it is computed from ``origin`` (``what``: "the gathered value", "the
    product"); a noun phrase for a decline message."""
    owner = operand.owner
    while not isinstance(owner, ir.Block) and owner.operation.name == "sdy.sharding_constraint":
        operand, owner = owner.operation.operands[0], owner.operation.operands[0].owner
    if origin is not None and operand == origin:
        return f"{what} itself"
    if isinstance(owner, ir.Block):
        t = ir_utils.ranked_tensor(operand)
        return f"region argument #{operand.arg_number} {list(t.shape) if t is not None else ''}".rstrip()
    derived, through = computed_from(operand, origin)
    if derived:
        if through is None:
            how = "elementwise: an activation of it"
        elif through.operation.name == "stablehlo.reduce":
            how = f"through {describe_op(through)}: a statistic of each row, as a norm's"
        elif through.operation.name == "stablehlo.dot_general":
            how = f"through {describe_op(through)}: a matmul's product of it"
        else:
            how = f"through {describe_op(through)}, which is neither elementwise nor a layout op"
        return f"{describe_op(owner)}, computed from {what} itself ({how})"
    dims = ir_utils.i64s(owner, "broadcast_dimensions") \
        if owner.operation.name == "stablehlo.broadcast_in_dim" else []
    source = ir_utils.ranked_tensor(owner.operation.operands[0]) if dims else None
    if dim in dims and (source is None or source.shape[dims.index(dim)] > 1):
        return (f"{describe_op(owner)} of a {list(source.shape) if source is not None else '?'} value along dim "
                f"{dim} (one value per index of dim {dim}: a per-row or per-column scale or bias)")
    if owner.operation.name == "stablehlo.constant":
        return f"{describe_op(owner)}, a constant that is not a splat"
    return describe_op(owner)
