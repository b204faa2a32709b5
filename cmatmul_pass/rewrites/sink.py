"""Sink the gather of stacked layer weights into the loop that reads one layer at a time.

A scan over layers (``jax.lax.scan``, ``nn.scan``) of FSDP- or TP-sharded stacked weights
gathers the whole ``[L, ...]`` stack before its ``stablehlo.while``; the body reads layer ``i``
with a ``dynamic_slice`` (jax wraps it in ``func.call @dynamic_index_in_dim``) and multiplies it
(in ``func.call @closed_call``)::

    %w = all_gather(%shard), dim g                 // [L, H, F]: every layer's whole weight alive
    while(%w, %i, %h) { %wi = dynamic_slice(%w, %i, 0, 0) sizes [1, H, F] ...  dot(%h, %wi) }

A ``dynamic_slice`` that keeps dim ``g`` whole commutes with the gather along ``g``:
``slice(all_gather(w)) == all_gather(slice(w))`` (the slice's start along ``g`` is clamped to 0
in both, its sizes elsewhere pick the same elements of every shard).  So the loop carries the
shard instead, and each trip gathers only the layer it reads::

    while(%shard, %i, %h) { %wi = all_gather(dynamic_slice(%shard, %i, 0, 0) sizes [1, H, F/n]) ... }

which the gather pass then rings with the body's dot (the calls between the gather and the dot
are inlined at their call sites, as XLA inlines them anyway).  Peak memory holds one layer's
gathered weight instead of all ``L``; the bytes on the wire are the same.  In a training step
the backward's loop reads the same stacked value: each loop that reads it gets its own gathers
(the backward re-gathers each layer instead of keeping the forward's whole stack alive).

Built only when every reader of the gathered value is a ``stablehlo.while`` that passes it
through unchanged, never reads it in its condition or after the loop, and in its body reads it
only through such slices (directly or through private functions); otherwise the module is left
as it was and :func:`plan` says why.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import ir_utils
from .._jax_private import hlo, ir
from ..analysis.variance import Variance
from ..ring import Ring
from ..layout import is_layout_op
from .builders import forget_inside, zeros_attr
from .dot_all_reduce import sum_region

WHILE, CALL, SLICE = "stablehlo.while", "func.call", "stablehlo.dynamic_slice"
MANUAL, RETURN, CONSTRAINT = "sdy.manual_computation", "sdy.return", "sdy.sharding_constraint"


@dataclass
class Loop:
    """One loop reading the gathered stack: ``operand`` is its operand index."""

    op: ir.OpView
    operand: int


@dataclass
class Sunk:
    """What :func:`sink` built: the gathers now in the loop bodies (one per slice read)."""

    all_gathers: list[ir.OpView]
    loops: list[ir.OpView]
    handed: int = 0  # regions the shard is handed to instead of the stack (a backward)


@dataclass
class Handoff:
    """The gathered stack leaving its region (``sdy.return`` operand ``operand`` of ``region``)
    for later regions, each reading it (their argument) only in loops: ``targets`` holds
    (region, operand index, its loops); ``constraints``, the sharding constraints the global
    value passes on the way (jax 0.11 adds one).  A training step's forward hands the stack to
    the backward this way (a residual)."""

    region: ir.OpView
    operand: int
    targets: list[tuple[ir.OpView, int, list[Loop]]]
    constraints: list[ir.Operation] = field(default_factory=list)


@dataclass
class Plan:
    loops: list[Loop]  # in the gather's own region
    handoffs: list[Handoff]


def plan(all_gather: ir.OpView, variance: Variance, ring: Ring) -> Plan | str:
    """Where the gather can sink (the loops reading the stack, here and in the regions it is
    handed to), or why it cannot (a sentence).

    Side conditions, each checked (``variance``: over ``ring``, the gather's groups):
    every reader of the stack is a loop that carries it unchanged and reads it only through
    slices keeping dim ``g`` whole (so the gather and the slice commute elementwise); each
    slice's start indices are identical on every device of the group (device ``d``'s gathered
    slice is made of every member's slice at *its* start: the same rows only if the starts
    agree); and every device of the group executes each slice equally often (each loop
    between it and the gather runs an identical trip count, each ``case``/``if`` between
    takes an identical branch): a gather put in control flow that the group's devices run
    differently would wait for partners that never come."""
    variance.forget()  # (earlier rewrites may have erased ops it remembers)
    dim = ir_utils.int_attr(all_gather.operation, "all_gather_dim")
    full = ir.RankedTensorType(all_gather.result.type).shape[dim]
    handoffs: list[Handoff] = []
    slices: list[tuple] = []  # (slice, the calls reaching it from its loop's block, that block)
    loops = _loops_reading(all_gather.result, dim, full, handoffs, slices)
    if isinstance(loops, str):
        return loops
    for slice_op, calls, block in slices:
        starts = [v for i, v in enumerate(slice_op.operands[1:]) if i != dim]
        if not all(variance.identical_in(v, ring, calls) for v in starts):
            return "the loop slices it at an index that may differ between the devices of the gather's group"
        why = variance.uniform_control(slice_op, block, ring, calls)
        if why:
            return f"the slice's place is not run alike on the gather's group: {why}"
    # one loop reached twice (a later region taking the stack as two arguments, both carried by one
    # loop) would be rebuilt twice, the second time from the loop the first erased
    every = [loop.op.operation for loop in loops] + \
        [loop.op.operation for h in handoffs for _, _, reached in h.targets for loop in reached]
    if len(set(every)) < len(every):
        return "a loop takes it twice"
    return Plan(loops, handoffs) if loops or handoffs else "nothing reads it"


def feeds_a_loop(all_gather: ir.OpView) -> bool:
    """Is the gathered value read by a loop, in its region or in one it is handed to?"""
    for use in all_gather.result.uses:
        owner = use.owner.operation
        if owner.name == WHILE:
            return True
        region = owner.parent if owner.name == RETURN else None
        if region is None or region.name != MANUAL:
            continue
        if any(u.owner.operation.name == WHILE for reader, index in _handed_to(region.results[use.operand_number], [])
               if reader.name == MANUAL for u in reader.regions[0].blocks[0].arguments[index].uses):
            return True
    return False


def _handed_to(value: ir.Value, constraints: list[ir.Operation]) -> list[tuple[ir.Operation, int]]:
    """The (op, operand index) reading a region's result ``value`` past the sharding constraints
    on it (jax 0.11+ puts one there; collected into ``constraints``)."""
    readers, values = [], [value]
    while values:
        for use in values.pop().uses:
            user = use.owner.operation
            if user.name == CONSTRAINT:
                constraints.append(user)
                values.append(user.results[0])
            else:
                readers.append((user, use.operand_number))
    return readers


def _loops_reading(value: ir.Value, dim: int, full: int, handoffs: list[Handoff] | None,
                   slices: list) -> list[Loop] | str:
    """The loops ``value`` (the stack) is read by, each only through slices of single layers
    (and, with ``handoffs``, the regions it is returned to); or why not.  Each slice is added
    to ``slices`` with the calls on the way to it and ``value``'s block."""
    loops: list[Loop] = []
    for use in value.uses:
        owner = use.owner.operation
        if owner.name == RETURN and handoffs is not None:
            why = _handoff(owner, use.operand_number, dim, full, handoffs, slices)
            if why:
                return why
            continue
        if owner.name != WHILE:
            return f"it is also read by {owner.name}"
        if any(loop.op.operation == owner for loop in loops):
            return "a loop takes it twice"
        k = use.operand_number
        while_op = owner.opview
        cond, body = (region.blocks[0] for region in while_op.regions)
        if list(cond.arguments[k].uses):
            return "the loop's condition reads it"
        if _terminator(body).operands[k] != body.arguments[k]:
            return "the loop body changes it"
        if sum(v == body.arguments[k] for v in _terminator(body).operands) != 1:
            return "the loop body hands it to the next trip in another carried value too"
        if list(while_op.results[k].uses):
            return "it is read after the loop"
        loop = Loop(while_op, k)
        found: list = []
        why = _read_by_slices(body.arguments[k], dim, full, _Functions(while_op), _terminator(body), found=found)
        home = value.owner if isinstance(value.owner, ir.Block) else value.owner.operation.block
        slices += [(slice_op, calls, home) for slice_op, calls in found]
        if why:
            return why
        loops.append(loop)
    return loops


def _handoff(ret: ir.Operation, operand: int, dim: int, full: int, handoffs: list[Handoff], slices: list) -> str | None:
    region = ret.parent
    if region is None or region.name != MANUAL:
        return f"it is also read by {ret.name}"
    targets, constraints = [], []  # the constraints: on the global value, it keeps its sharding, takes the new type
    for reader, index in _handed_to(region.results[operand], constraints):
        if reader.name != MANUAL:
            return f"it leaves its shard_map region for {reader.name}"
        loops = _loops_reading(reader.regions[0].blocks[0].arguments[index], dim, full, None, slices)
        if isinstance(loops, str):
            return f"it leaves its region for a later one (a training step's backward), where {loops}"
        targets.append((reader.opview, index, loops))
    handoffs.append(Handoff(region.opview, operand, targets, constraints))
    return None


class _Functions:
    """The module's private functions by name."""

    def __init__(self, op: ir.OpView):
        module = op.operation
        while module.parent is not None:
            module = module.parent
        self.module = module
        self.by_name = {ir_utils.symbol_name(f): f for f in ir_utils.ops_named(module, "func.func")["func.func"]}
        self._collectives: dict[str, bool] = {}

    def callee(self, call: ir.OpView) -> ir.OpView | None:
        """The private one-block function ``call`` calls, if it holds no collective: inlining
        one would erase ops the pass has already collected (and met again as clones)."""
        f = self.private(call)
        return None if f is None or self.holds_collectives(f) else f

    def private(self, call: ir.OpView) -> ir.OpView | None:
        """The private one-block function ``call`` calls, if it is one."""
        f = self.by_name.get(ir.FlatSymbolRefAttr(call.attributes["callee"]).value)
        return f if f is not None and len(f.regions[0].blocks) == 1 and ir_utils.is_private(f) else None

    def holds_collectives(self, f: ir.OpView) -> bool:
        name = ir_utils.symbol_name(f)
        if name not in self._collectives:
            found = ir_utils.ops_named(f, *ir_utils.CHANNEL_OPS)
            self._collectives[name] = any(found[n] for n in ir_utils.CHANNEL_OPS)
        return self._collectives[name]


def _read_by_slices(value: ir.Value, dim: int, full: int, functions: _Functions,
                    passes: ir.Operation | None = None, depth: int = 0, found: list | None = None,
                    calls: tuple = ()) -> str | None:
    """None when every reader of ``value`` is a dynamic_slice keeping ``dim`` whole, directly or
    in a private function it is passed to (which :func:`sink` inlines), or ``passes`` (the loop
    body's terminator, handing it to the next trip unchanged); else why not.  Each slice goes
    to ``found`` with the calls on the way to it (``calls``: those to ``value``'s function)."""
    if depth > 8:
        return "it is passed through more than 8 nested calls"
    for use in value.uses:
        user = use.owner.operation
        if passes is not None and user == passes:
            continue
        if user.name == SLICE and use.operand_number == 0:
            if _sizes(user)[dim] != full:
                return f"the loop slices it along the gathered dim {dim}"
            if found is not None:
                found.append((user, calls))
            continue
        if user.name == CALL:
            callee = functions.callee(user.opview)
            if callee is None:
                return "it is passed to a function that is not a private one-block func.func without collectives"
            param = callee.regions[0].blocks[0].arguments[use.operand_number]
            why = _read_by_slices(param, dim, full, functions, depth=depth + 1, found=found, calls=(*calls, user))
            if why:
                return why
            continue
        return f"the loop reads it with {user.name}, not only through slices of single layers"
    return None


def sink(all_gather: ir.OpView, where: Plan, take_channel) -> Sunk:
    """Carry ``all_gather``'s shard through the loops of ``where`` (from :func:`plan`), handing
    the shard instead of the stack to later regions, and gather each slice the bodies read, in
    the body; erase the gather."""
    dim = ir_utils.int_attr(all_gather.operation, "all_gather_dim")
    shard = all_gather.operation.operands[0]
    n = ir.RankedTensorType(all_gather.result.type).shape[dim] // ir.RankedTensorType(shard.type).shape[dim]
    sunk = Sunk([], [])
    functions = _Functions(all_gather)
    for handoff in where.handoffs:
        terminator = _terminator(handoff.region.regions[0].blocks[0])
        terminator.replace_uses_of_with(all_gather.result, shard)
        handed = handoff.region.operation.results[handoff.operand]
        handed.set_type(_divided(handed.type, dim, n))  # the global value: the same sharding, 1/n of dim
        for constraint in handoff.constraints:
            constraint.results[0].set_type(handed.type)
        sunk.handed += len(handoff.targets)
        for region, index, loops in handoff.targets:
            arg = region.regions[0].blocks[0].arguments[index]
            arg.set_type(shard.type)
            _sink_loops(loops, arg, all_gather, dim, n, take_channel, functions, sunk)
    _sink_loops(where.loops, shard, all_gather, dim, n, take_channel, functions, sunk)
    all_gather.operation.erase()
    for i, gathered in enumerate(sunk.all_gathers):  # the calls between each new gather and its dot
        while (call := _call_reached(gathered.result, functions)) is not None:
            inline(call, functions)
        sunk.all_gathers[i] = _past_barrier(gathered)
    return sunk


BARRIER = "stablehlo.optimization_barrier"


def _past_barrier(gathered: ir.OpView) -> ir.OpView:
    """A gather whose layer reaches its dots through remat's ``optimization_barrier`` (through
    single-use layout ops): the barrier takes the shard instead, and the gather (and those ops)
    follow it; the barrier is the identity on each value, so every reader sees what it did.
    Returns the gather now in use."""
    chain, value = [gathered.operation], gathered.result
    while True:
        uses = list(value.uses)
        if len(uses) != 1:
            return gathered
        user = uses[0].owner.operation
        if user.name == BARRIER:
            index = uses[0].operand_number
            break
        if not is_layout_op(user.opview) or len(user.results) != 1 or len(user.operands) != 1:
            return gathered
        chain.append(user)
        value = user.results[0]
    operands = list(user.operands)
    operands[index] = gathered.operation.operands[0]
    with ir.InsertionPoint(user):
        barrier = hlo.OptimizationBarrierOp(operands, results=[v.type for v in operands], loc=user.location)
    with ir.InsertionPoint.after(barrier.operation):
        moved = ir_utils.clone_mapped(chain, {gathered.operation.operands[0]: barrier.results[index]})
    for i, (before, after) in enumerate(zip(user.results, barrier.results)):
        before.replace_all_uses_with(moved[-1].results[0] if i == index else after)
    user.erase()
    for op in reversed(chain):
        op.erase()
    return moved[0].opview


def _sink_loops(loops: list[Loop], shard: ir.Value, template: ir.OpView, dim: int, n: int, take_channel,
                functions: "_Functions", sunk: Sunk) -> None:
    """Each loop of ``loops`` carrying ``shard`` instead of the stack: the calls the stack
    passes into inlined, the loop rebuilt with the shard's type, each slice a gather."""
    for loop in loops:
        stack = loop.op.operation.operands[loop.operand]
        if stack != shard:
            loop.op.operation.replace_uses_of_with(stack, shard)
        body = loop.op.regions[1].blocks[0]
        while True:  # the calls the stack passes into, outermost first, each at this call site
            call = _call_of(body.arguments[loop.operand], functions)
            if call is None:
                break
            inline(call, functions)
        new = _retyped_loop(loop.op, loop.operand)
        sunk.loops.append(new)
        carried = new.regions[1].blocks[0].arguments[loop.operand]
        for use in list(carried.uses):
            if use.owner.operation.name == SLICE:
                sunk.all_gathers.append(_gathered_slice(use.owner.operation.opview, carried, template, dim, n, take_channel))


def _divided(t: ir.Type, dim: int, n: int) -> ir.RankedTensorType:
    t = ir.RankedTensorType(t)
    return ir_utils.with_dim(t, dim, t.shape[dim] // n)


def _call_of(value: ir.Value, functions: _Functions) -> ir.OpView | None:
    for use in value.uses:
        user = use.owner.operation
        if user.name == CALL and functions.callee(user.opview) is not None:
            return user.opview
    return None


def _call_reached(value: ir.Value, functions: _Functions) -> ir.OpView | None:
    """A private call ``value`` reaches through layout ops (the dot inside waits for it)."""
    todo, seen = [value], set()
    while todo:
        v = todo.pop()
        for use in v.uses:
            user = use.owner.operation
            if user.name == CALL and functions.callee(user.opview) is not None:
                return user.opview
            if is_layout_op(user.opview) and user not in seen and len(user.results) == 1:
                seen.add(user)
                todo.append(user.results[0])
    return None


def inline_scan_bodies(found: dict[str, list]) -> list[str]:
    """jax 0.10 lowers a scan's step as a call of a private function (``@closed_call``) from the
    loop's body.  Where such a function holds collectives of its own and a gather of stacked
    weights feeds a loop (what :func:`sink` moves in), inline those calls, as jax 0.11 and later
    lower the body: the layer's dots, its own collectives and the gathers sunk into the loop then
    share one block, where rings form and the slack order chooses between them.  To run before
    the pipeline collects the module's collectives (``found``: its ``stablehlo.all_gather`` and
    ``stablehlo.while`` ops).  Returns the names of the functions inlined."""
    loops = found["stablehlo.while"]
    if not loops or not any(feeds_a_loop(op) for op in found["stablehlo.all_gather"]):
        return []
    functions = _Functions(loops[0])
    # the function each loop is in (named while all are alive): a loop in a function erased once its
    # last call is inlined is gone (its object dangling), and its body's calls with it
    home = [ir_utils.enclosing_func_name(loop) for loop in loops]
    names = []
    for loop, where in zip(loops, home):
        if where not in functions.by_name:
            continue
        body = loop.operation.regions[1].blocks[0]
        for _ in range(8):  # a remat'd step calls its own function again: inline it too
            calls = [op for op in body.operations if op.operation.name == CALL and
                     (f := functions.private(op)) is not None and functions.holds_collectives(f)]
            if not calls:
                break
            names += [inline(call, functions, functions.private(call)) for call in calls]
    return list(dict.fromkeys(names))


def inline(call: ir.OpView, functions: _Functions, callee: ir.OpView | None = None) -> str:
    """Replace ``call`` by a copy of its callee's body (the callee stays while others call it;
    erased once none does).  Returns the callee's name.  ``callee``: the function, where it may
    hold collectives (by default only one that holds none)."""
    callee = callee or functions.callee(call)
    name = ir_utils.symbol_name(callee)
    block = callee.regions[0].blocks[0]
    mapping = dict(zip(block.arguments, call.operation.operands))
    ops = list(block.operations)
    with ir.InsertionPoint(call.operation):
        ir_utils.clone_mapped(ops[:-1], mapping)
    returned = [mapping.get(v, v) for v in ops[-1].operation.operands]
    for old, new in zip(call.operation.results, returned):
        old.replace_all_uses_with(new)
    call.operation.erase()
    if not any(ir.FlatSymbolRefAttr(c.attributes["callee"]).value == name
               for c in ir_utils.ops_named(functions.module, CALL)[CALL]):
        forget_inside(callee)
        callee.operation.erase()
        del functions.by_name[name]
    return name


def _retyped_loop(old: ir.OpView, k: int, erase: bool = True) -> ir.OpView:
    """``old`` rebuilt for the type its operand ``k`` has now (the shard's): its regions moved
    over, their argument ``k`` retyped, its other results' readers moved over; ``old`` erased
    (``erase=False``: left for the caller, once its result ``k`` has no reader)."""
    operands = list(old.operation.operands)
    shard = operands[k]
    types = [v.type for v in operands]
    with ir.InsertionPoint(old.operation):
        new = hlo.WhileOp(types, operands, loc=old.location)
    for attr in old.operation.attributes:
        new.operation.attributes[attr.name] = attr.attr
    for region, moved in zip(old.operation.regions, new.operation.regions):
        block = region.blocks[0]
        block.append_to(moved)
        block.arguments[k].set_type(shard.type)
    for before, after in zip(old.operation.results, new.operation.results):
        if before.result_number != k:
            before.replace_all_uses_with(after)
    if erase:
        old.operation.erase()
    return new


def _gathered_slice(slice_op: ir.OpView, carried: ir.Value, all_gather: ir.OpView, dim: int, n: int,
                    take_channel) -> ir.OpView:
    """``slice_op`` (of the gathered stack) as the gather of the same slice of the shard."""
    sizes = _sizes(slice_op.operation)
    sizes[dim] //= n
    attrs = all_gather.operation.attributes
    with ir.InsertionPoint(slice_op.operation):
        small = hlo.DynamicSliceOp(carried, list(slice_op.operation.operands[1:]), sizes, loc=slice_op.location)
        gathered = hlo.AllGatherOp(
            [slice_op.result.type], [small.result], dim, attrs["replica_groups"],
            channel_handle=hlo.ChannelHandle.get(take_channel(), 1),
            use_global_device_ids="use_global_device_ids" in attrs, loc=all_gather.location)
    slice_op.result.replace_all_uses_with(gathered.results[0])
    slice_op.operation.erase()
    return gathered


def _sizes(slice_op: ir.Operation) -> list[int]:
    return ir_utils.i64s(slice_op, "slice_sizes")


def _terminator(block: ir.Block) -> ir.Operation:
    return list(block.operations)[-1].operation


# ---------------------------------------------------------------------------- the scatter, hoisted
#: the mirror of the sink: a loop assembling a stacked gradient layer by layer with
#: ``dynamic_update_slice`` into a zero buffer, reduce_scattered after the loop, scatters each
#: layer's block in the body instead, into a buffer of the shard's size:
#:     reduce_scatter(dus(...dus(0, u_1, i_1)..., u_L, i_L)) = dus(...dus(0, rs(u_1), i_1)..., rs(u_L), i_L)
#: (the scatter is linear and works slot by slot; an update covering the scattered dim whole
#: lands in the same slots of every block; the zero buffer scatters to zeros).
DUS = "stablehlo.dynamic_update_slice"


@dataclass
class Hoist:
    """A reduce_scatter of a loop's stacked result: ``loop`` assembles it in operand ``operand``."""

    reduce_scatter: ir.OpView
    loop: ir.OpView
    operand: int


@dataclass
class Hoisted:
    reduce_scatters: list[ir.OpView]  # in the loop body, one per layer update
    loop: ir.OpView


def hoist_plan(reduce_scatter: ir.OpView, variance: Variance, ring: Ring) -> Hoist | str | None:
    """Whether the scatter can move into the loop that assembles its operand: the plan, why not
    (a sentence), or None (its operand is no loop's result).

    Side conditions, each checked (``variance``: over ``ring``, the scatter's groups): the
    buffer starts as zeros and the loop's only use of it is one ``dynamic_update_slice`` per
    trip that writes whole layers along the scattered dim (so each slot holds one update, and
    scattering it is scattering that update); the update's start indices are identical on
    every device of the group (device ``d``'s block of slot ``k`` sums every member's update
    written at ``k``: the same slot only if the indices agree); the loop runs an identical
    trip count on the group, and every ``case``/``if`` or loop between the update and the loop
    body takes an identical path (the scatter waits for every member); the scatter follows the
    loop in the loop's own block (it runs whenever the loop does)."""
    value = reduce_scatter.operation.operands[0]
    owner = value.owner
    if isinstance(owner, ir.Block) or owner.operation.name != WHILE:
        return None
    variance.forget()  # (earlier rewrites may have erased ops it remembers)
    loop, k = owner.operation.opview, value.result_number
    dim = ir_utils.int_attr(reduce_scatter.operation, "scatter_dimension")
    full = ir.RankedTensorType(value.type).shape[dim]
    if len(list(value.uses)) != 1:
        return "the loop's stacked result is also read elsewhere"
    if reduce_scatter.operation.block != loop.operation.block:
        return "the scatter is not in the loop's own block"
    if not ir_utils.is_zero_splat(loop.operation.operands[k]):
        return "the loop's stacked buffer does not start as zeros"
    cond, body = (region.blocks[0] for region in loop.regions)
    if list(cond.arguments[k].uses):
        return "the loop's condition reads the stacked buffer"
    functions = _Functions(loop)
    update = _single_update(body.arguments[k], _terminator(body), k, functions)
    if isinstance(update, str):
        return update
    update, calls = update
    sizes = ir.RankedTensorType(update.operation.operands[1].type).shape
    if sizes[dim] != full:
        return f"the loop writes blocks of the scattered dim {dim}, not whole layers"
    starts = [v for i, v in enumerate(update.operation.operands[2:]) if i != dim]
    if not all(variance.identical_in(v, ring, calls) for v in starts):
        return "the loop writes each layer at a slot that may differ between the devices of the scatter's group"
    why = variance.uniform_control(update, loop.operation.block, ring, calls)
    if why:
        return f"the update's place is not run alike on the scatter's group: {why}"
    return Hoist(reduce_scatter, loop, k)


def _single_update(arg: ir.Value, terminator: ir.Operation, k: int, functions: _Functions, calls: tuple = ()):
    """(the dynamic_update_slice writing the buffer ``arg``, the calls on the way to it) when the
    body's only use of it is one update whose result the body returns at ``k`` (the op itself,
    or inside the private functions it is passed to); else why not."""
    uses = [u for u in arg.uses]
    if len(uses) != 1:
        return "the loop body reads the stacked buffer other than by one update per trip"
    user = uses[0].owner.operation
    returned = [r for r in user.results if terminator.operands[k] == r]
    if len(returned) != 1 or sum(v == returned[0] for v in terminator.operands) != 1:
        return "the loop body returns something else than its update of the stacked buffer"
    if len(list(returned[0].uses)) != 1:  # the return's: nothing else reads the updated buffer
        return "the loop body reads its update of the stacked buffer again"
    if user.name == DUS and uses[0].operand_number == 0:
        return user.opview, list(calls)
    if user.name == CALL and (callee := functions.callee(user.opview)) is not None and len(calls) < 8:
        block = callee.regions[0].blocks[0]
        return _single_update(block.arguments[uses[0].operand_number], _terminator(block),
                              ir.OpResult(returned[0]).result_number, functions, (*calls, user))
    return f"the loop body writes the stacked buffer with {user.name}"


def hoist(where: Hoist, take_channel) -> Hoisted:
    """Scatter each layer's update in the loop body into a shard-sized zero buffer; the loop's
    result replaces the reduce_scatter."""
    rs, loop, k = where.reduce_scatter, where.loop, where.operand
    functions = _Functions(loop)
    body = loop.regions[1].blocks[0]
    while (first := list(body.arguments[k].uses)[0].owner.operation).name == CALL:  # to the update
        inline(first.opview, functions)
    block_t = ir.RankedTensorType(rs.result.type)
    with ir.InsertionPoint(loop.operation):
        zeros = hlo.ConstantOp(zeros_attr(block_t), loc=loop.location).result
    dim = ir_utils.int_attr(rs.operation, "scatter_dimension")
    n = ir.RankedTensorType(rs.operation.operands[0].type).shape[dim] // block_t.shape[dim]
    loop.operation.replace_uses_of_with(loop.operation.operands[k], zeros)
    new = _retyped_loop(loop, k, erase=False)
    rs.result.replace_all_uses_with(new.operation.results[k])
    location, attrs = rs.location, rs.operation.attributes
    body = new.regions[1].blocks[0]
    (use,) = list(body.arguments[k].uses)
    update = use.owner.operation
    original = update.operands[1]
    value = _as_reshape(original)
    with ir.InsertionPoint(update):
        piece_t = _divided(value.type, dim, n)
        scattered = hlo.ReduceScatterOp(piece_t, value, dim, attrs["replica_groups"],
                                        channel_handle=hlo.ChannelHandle.get(take_channel(), 1),
                                        use_global_device_ids="use_global_device_ids" in attrs, loc=location)
        sum_region(scattered, location)  # a sum: the matcher declined it past that check
    update.replace_uses_of_with(original, scattered.result)
    update.results[0].set_type(body.arguments[k].type)  # the buffer's shard-sized type
    if value != original and not list(original.uses):
        original.owner.operation.erase()
    rs.operation.erase()
    loop.operation.erase()
    while (call := _call_feeding(scattered.operation.operands[0], functions)) is not None:
        inline(call, functions)
    return Hoisted([scattered], new)


def _as_reshape(value: ir.Value) -> ir.Value:
    """``value``, or where it is a broadcast_in_dim that only adds size-1 dims (jax's
    ``dynamic_update_index_in_dim`` makes its layer [1, ...] so), the same as a reshape (a layout
    op the scatter ring looks through)."""
    owner = value.owner
    if isinstance(owner, ir.Block) or owner.operation.name != "stablehlo.broadcast_in_dim":
        return value
    source = owner.operation.operands[0]
    before, after = ir.RankedTensorType(source.type), ir.RankedTensorType(value.type)
    if [d for d in after.shape if d != 1] != [d for d in before.shape if d != 1] or \
            (dims := ir_utils.i64s(owner, "broadcast_dimensions")) != sorted(dims):
        return value
    with ir.InsertionPoint(owner.operation):
        return hlo.ReshapeOp(after, source, loc=owner.location).result


def _call_feeding(value: ir.Value, functions: _Functions) -> ir.OpView | None:
    """A private call whose result reaches ``value`` through layout ops (its dot makes it)."""
    while not isinstance(value.owner, ir.Block):
        owner = value.owner.operation
        if owner.name == CALL and functions.callee(owner.opview) is not None:
            return owner.opview
        if not is_layout_op(owner.opview) or len(owner.operands) != 1:
            return None
        value = owner.operands[0]
    return None
