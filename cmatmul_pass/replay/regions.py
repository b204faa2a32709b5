"""Top-level regions (``sdy.manual_computation`` ops directly in a function) as replay reads and
reshapes them.

Reading, no op changed: a region's body block, which stands for the region in dicts and sets
(:func:`_body`); its ops' locations in pre-order and each op's place, the indices leading to it
(:func:`_located_places`, :func:`_locations_at`); its operand and result types; its ops holding a
channel handle; the results it returns as they came in (:func:`pass_through`).  Reshaping: a
region without some of its results or operands (:func:`_reshaped`, :func:`without_pass_through`),
a region moved into a function of its own (:func:`_outline`), a region replaced by a call of one
(:func:`_call`).
"""

from __future__ import annotations

from .. import ir_utils
from .._jax_private import ir, sdy

#: the functions holding a replayed layer
LAYER_PREFIX = "cmatmul_layer_"
MANUAL = "sdy.manual_computation"


def _body(region: ir.Operation) -> ir.Block:
    """A region's identity for dicts and sets: its body block (an Operation's hash changes with
    its attributes; a Block's is its address)."""
    return region.regions[0].blocks[0]


def _locations(region: ir.Operation) -> list[ir.Location]:
    """The locations of ``region`` and every op nested in it, in pre-order (one C++ walk)."""
    found: list[ir.Location] = []

    def visit(op: ir.Operation) -> ir.WalkResult:
        found.append(op.location)
        return ir.WalkResult.ADVANCE

    region.walk(visit, ir.WalkOrder.PRE_ORDER)
    return found


def _located_places(region: ir.Operation) -> tuple[list[ir.Location], list[tuple]]:
    """:func:`_locations` of ``region``, and each op's place: the (region, block, op) indices
    leading to it from ``region`` (``region`` itself: ())."""
    locations, places = [region.location], [()]

    def visit(op: ir.Operation, place: tuple) -> None:
        for r, inner in enumerate(op.regions):
            for b, block in enumerate(inner.blocks):
                for i, child in enumerate(block.operations):
                    child = child.operation
                    at = (*place, (r, b, i))
                    locations.append(child.location)
                    places.append(at)
                    visit(child, at)

    visit(region, ())
    return locations, places


def _at(region: ir.Operation, place: tuple) -> ir.Operation:
    """The op at ``place`` (:func:`_located_places`) in ``region``."""
    op = region
    for r, b, i in place:
        op = op.regions[r].blocks[b].operations[i].operation
    return op


def _locations_at(region: ir.Operation, places: list[tuple]) -> list[ir.Location]:
    """The locations of the ops at ``places`` (:func:`_located_places`) in ``region``, each
    reached by its indices, each block's op list read once (a layer's report reads 6 to 55 of its
    45 to 131 ops, most in the region's body, the rest a collective's reduction: fewer steps than
    a walk of them all)."""
    lists: dict[tuple, object] = {}  # (the place of an op, region, block) -> that block's op list
    found = []
    for place in places:
        r, b, i = place[-1]
        key = (place[:-1], r, b)
        ops = lists.get(key)
        if ops is None:
            ops = lists[key] = _at(region, place[:-1]).regions[r].blocks[b].operations
        found.append(ops[i].location)
    return found


def _types(region: ir.Operation) -> tuple:
    return tuple(v.type for v in region.operands), tuple(r.type for r in region.results)


def _channel_ops(region: ir.Operation) -> list[ir.Operation]:
    """The ops in ``region`` holding a channel handle, in pre-order."""
    found: list[ir.Operation] = []

    def visit(op: ir.Operation) -> ir.WalkResult:
        if "channel_handle" in op.attributes:
            found.append(op)
        return ir.WalkResult.ADVANCE

    region.walk(visit, ir.WalkOrder.PRE_ORDER)
    return found


def _top_level_regions(module: ir.Module) -> list[ir.Operation]:
    """The ``sdy.manual_computation`` ops directly in a function's body, in program order."""
    return [op.operation
            for f in module.body.operations if f.operation.name == "func.func"
            for block in f.regions[0].blocks
            for op in block.operations if op.operation.name == MANUAL]


def _module_body(op: ir.Operation) -> ir.Block:
    """The body of the module holding ``op``."""
    while op.name != "builtin.module":
        op = op.parent
    return op.regions[0].blocks[0]


def _nested_count(op: ir.Operation) -> int:
    return sum(1 + _nested_count(inner.operation) for region in op.regions for block in region.blocks
               for inner in block.operations)


def pass_through(region: ir.Operation) -> dict[int, int]:
    """The results of ``region`` that return one of its block arguments as it came in: result
    index -> argument index.  JAX returns a layer's inputs this way for the backward (each
    device's block, stacked), but for the inputs the caller already holds (a first layer's)."""
    body = _body(region)
    terminator = body.operations[len(body.operations) - 1]
    return {index: ir.BlockArgument(value).arg_number for index, value in enumerate(terminator.operands)
            if isinstance(value.owner, ir.Block) and value.owner == body}


def without_pass_through(region: ir.Operation, through: dict[int, int]) -> ir.Operation:
    """``region`` without the results ``through`` (:func:`pass_through`): a new op before it with
    the same operands, attributes and body (moved out of ``region``, which is left empty for the
    caller to erase once its results are read no more), and the other results, in order."""
    return _reshaped(region, [i for i in range(len(region.results)) if i not in through])


def _reshaped(region: ir.Operation, results: list[int], arguments: list[int] | None = None,
              operands: list[ir.Value] | None = None, at: ir.InsertionPoint | None = None,
              returning: bool = True) -> ir.Operation:
    """``region`` (a top-level region) returning only its results ``results``, and taking only its
    operands ``arguments`` (None: all; the body must read no other block argument), which read
    ``operands`` (None: the region's own): a new op (at ``at``; by default before ``region``) with
    the same attributes, their shardings for those, and the body, moved out of ``region`` (left
    empty for the caller to erase once its results are read no more).  ``returning`` false: the
    body returns those results already (:func:`_return_only`)."""
    kept = range(len(region.operands)) if arguments is None else arguments
    with region.context, region.location:
        attributes = {named.name: named.attr for named in (region.attributes[i] for i in range(len(region.attributes)))}
        for key, indices in (("out_shardings", results), ("in_shardings", None if arguments is None else arguments)):
            if indices is not None:
                shardings = sdy.TensorShardingPerValueAttr(attributes[key]).shardings
                attributes[key] = sdy.TensorShardingPerValueAttr.get([shardings[i] for i in indices])
        if operands is None:
            operands = [region.operands[i] for i in kept]
        with at or ir.InsertionPoint(region):
            core = ir.Operation.create(MANUAL, results=[region.results[i].type for i in results],
                                       operands=operands, attributes=attributes, regions=1)
        body = region.regions[0].blocks[0]
        body.append_to(core.regions[0])
        if returning:
            _return_only(body, results)
        if arguments is not None:
            for index in sorted(set(range(len(body.arguments))) - set(arguments), reverse=True):
                body.erase_argument(index)
    return core


def _return_only(body: ir.Block, results: list[int]) -> list[ir.Value]:
    """Make ``body``'s return return only its values for ``results``; returns the others."""
    terminator = body.operations[len(body.operations) - 1]
    returned = list(terminator.operands)
    with ir.InsertionPoint(terminator):
        sdy.ReturnOp([returned[i] for i in results], loc=terminator.location)
    terminator.erase()
    kept = set(results)
    return [value for i, value in enumerate(returned) if i not in kept]


def _layer_name(twin: ir.Operation) -> str:
    """The name of the function :func:`_outline` moves ``twin`` into: ``LAYER_PREFIX<k>``, the
    first ``k`` no symbol of the module holds (the same until it is outlined)."""
    names = {ir.StringAttr(op.operation.attributes["sym_name"]).value
             for op in _module_body(twin).operations if "sym_name" in op.operation.attributes}
    index = 0
    while f"{LAYER_PREFIX}{index}" in names:
        index += 1
    return f"{LAYER_PREFIX}{index}"


def _outline(twin: ir.Operation, name: str) -> None:
    """Move ``twin`` (a top-level region) into a new private function ``name`` of its operands
    (:func:`_layer_name`), which returns its results, and call the function where ``twin`` stood
    (its results' readers read the call's).  Moved, not copied: the values the pass's builders
    share per block (:mod:`cmatmul_pass.rewrites.builders`) stay where they are, valid."""
    body = _module_body(twin)
    loc = twin.location
    returns = [r.type for r in twin.results]
    _, entry = ir_utils.private_function(body, name, [v.type for v in twin.operands], returns, loc)
    with ir.InsertionPoint(twin):
        call = ir_utils.call(name, list(twin.operands), returns, loc)
    for old, new in zip(twin.results, call.results):
        old.replace_all_uses_with(new)
    twin.detach_from_parent()
    ir.InsertionPoint(entry).insert(twin)
    with ir.InsertionPoint(entry):
        ir_utils.function_return(list(twin.results), loc)
    for index, argument in enumerate(entry.arguments):  # by position: two operands may be one value
        twin.operands[index] = argument


def _call(region: ir.Operation, name: str, types: list[ir.Type], result_map: list[int] | None = None) -> None:
    """Replace ``region`` by a call of ``name`` (returning ``types``) with its operands, at its
    location; ``result_map`` (a joiner's): the call's result standing for each of ``region``'s
    (else the call's results are its own, in order)."""
    with ir.InsertionPoint(region):
        call = ir_utils.call(name, list(region.operands), types, region.location)
    new = list(call.results)
    for index, old in enumerate(region.results):
        old.replace_all_uses_with(new[result_map[index] if result_map else index])
    region.erase()
