"""The ops between a scatter's dots and the scatter, traced as a DAG (a norm's backward).

Where the product is read more than once on its way to the scatter (``dx = rs*g*dy - x*rs^3/n *
sum_j(g*dy*x)``), :func:`trace_dag` checks that every op on the path works row by row along the
scattered dim and is linear in the product, so the ring can apply the DAG to one block at a
time; :class:`Nonlinear` says which op is not.
"""

from __future__ import annotations

import heapq


from .. import ir_utils
from .._jax_private import ir
from ..errors import Decline
from ..layout import (
    ROW_OPS,
    LayoutStep,
    Sliced,
    backward_dim,
    forward_dim,
    invariant_source,
    is_elementwise,
    is_layout_op,
    row_dim,
)
from ..ring import Ring
from . import causes
from .common import ModuleInfo, describe_op
from .scatter_terms import LatestFirst, Term, dot_term, not_blockwise, operand_side, product_of, region_is_sum


class Nonlinear(Decline):
    """The DAG holds an op that is not linear in the product; ``detail``: which, in a few words."""

    def __init__(self, op: ir.OpView, detail: str):
        self.op = op
        super().__init__("producer_not_dot", f"the scattered value comes from {detail}: the ring applies a DAG of ops "
                                             "between the dot and the scatter per block only where it is linear in "
                                             "the product (a norm's backward, which reads the product twice)")


def trace_dag(
    anchor: ir.OpView, operand: ir.Value, dim: int, info: ModuleInfo, ring: Ring, chain: Decline,
    affine: bool = False, assemble: bool = False,
) -> tuple[tuple[Term, ...], tuple[ir.OpView, ...], tuple[LayoutStep, ...]]:
    """The ops from the dots to ``operand`` as a DAG (a norm's backward applied to the cotangent:
    ``dx = rs*g*dy - x*rs^3/n * sum_j(g*dy*x)``, the product read twice).  Valid block by block
    when every op computed from a product (the *path*) works row by row along the ring dim — an
    elementwise op, a layout op, a reduce over other dims, a broadcast_in_dim taking the ring dim
    from its operand — its other operands read at the block's rows (or the same in every block):
    then block ``b`` of the scattered value on each device is the path applied to block ``b`` of
    each product.  The pass also asks that the path be linear in the products (a backward pass's
    shape): adds of two path values, a path value scaled (multiplied, divided) by another value,
    a negation, a sum over other dims from zero.

    The path is the ops of the *cone* (those whose every result is read, in the end, only by
    ``operand``) computed from a dot of the cone, and the *branches*: ops computed from a path
    value that lead only to sums over the ring dim from zero (a norm gain's gradient,
    ``sum_i(x_i*rs_i*dy_i)`` over the rows), each a step that :attr:`~LayoutStep.sums_rows` (the
    ring adds up its blocks' shares).  ``chain``: the chain tracer's decline, raised where the
    DAG is no better (no dot in the cone; a nonlinear op, which ``chain`` names).  ``affine``:
    an add of a path value and a value computed apart from the product is taken (:func:`_linear`).
    ``assemble``: a branch may also end in a reduce over other dims than the ring dim (a norm
    gain's gradient where the features are scattered), whose blocks the ring puts in place."""
    n = ring.size
    root = operand.owner
    block = anchor.operation.block
    if isinstance(root, ir.Block) or root.operation.block != block:
        raise chain

    reach = _cone(root, block, None)  # every op back from the scatter through the ops a product may pass
    branches: dict[ir.Operation, ir.OpView] = {}  # path ops that lead only to sums over the rows
    while True:
        cone = _cone(root, block, set(branches) | {anchor.operation})
        ops = {**cone, **branches}
        path_ops = _from_dots(ops)  # the ops computed from one of the cone's dots, producers first
        if root.operation in path_ops:
            inside = ops
            read = path_ops
        else:  # a value on the way from a dot is read elsewhere too: by a branch (a gain's gradient), or Decline
            inside = {**reach, **branches}
            read = _from_dots(inside)
        outside = [(op, u.owner) for op in read.values() if not _sums_away(op, branches, cone)
                   for r in op.operation.results for u in r.uses
                   if u.owner.operation not in inside and u.owner.operation != anchor.operation]
        if not outside:
            if root.operation not in path_ops:
                raise _escaped(root, cone, block, anchor, branches) or chain
            break
        for op, reader in outside:  # a value of the path read apart from the scatter: a branch, or Decline
            _branch(op, reader, block, inside, branches, anchor)

    def on_path(value: ir.Value) -> bool:
        return not isinstance(value.owner, ir.Block) and value.owner.operation in path_ops

    for op in path_ops.values():
        _static(op)
        for value in op.operation.operands:  # a sum over the rows is the ring's only when every block is done
            if on_path(value) and _sums_away(value.owner, branches, cone):
                raise Decline("producer_not_dot", f"{describe_op(op)}, computed from the product, reads "
                                                  f"{describe_op(value.owner)}, a sum over the scattered rows of the "
                                                  "product: the ring has that sum only when every block is done")

    # the ring dim of every path value: from the scattered value back to the dots, then forward
    # from the path into the branches
    dims: dict[ir.Value, int] = {operand: dim}
    steps: dict[ir.Operation, LayoutStep] = {}
    terms: list[Term] = []
    for op in reversed(list(path_ops.values())):
        if op.operation not in cone:
            continue
        out_dim = dims[op.result]
        _cut(op, out_dim, n)
        name = op.operation.name
        if name == "stablehlo.dot_general":
            read = [v for v in op.operation.operands if on_path(v)]
            if read:
                raise Decline("producer_not_dot", f"{describe_op(op)} multiplies a value computed from another "
                                                  f"product ({describe_op(read[0].owner)}) on the way to the "
                                                  "scatter: the ring computes one dot's block from its operands")
            terms.append(dot_term(op, out_dim, anchor, info, ring))
            continue
        if is_layout_op(op):
            in_dims = {op.operation.operands[0]: backward_dim(op, out_dim, n)}
            step = LayoutStep(op, in_dims[op.operation.operands[0]], out_dim)
        elif name in ROW_OPS:
            step = _row_step(op, out_dim, on_path)
            in_dims = {op.operation.operands[0]: step.in_dim}
        elif is_elementwise(op):
            _linear(op, on_path, affine)
            in_dims = {v: out_dim for v in op.operation.operands if on_path(v)}
            step = _elementwise(op, out_dim, on_path)
        else:
            raise not_blockwise(op)
        for value, in_dim in in_dims.items():
            _agree(dims, value, in_dim, op)
        steps[op.operation] = step
    for op in path_ops.values():
        if op.operation not in cone:
            steps[op.operation] = _branch_step(op, dims, on_path, branches, n, affine, assemble)
    for op in path_ops.values():  # what the ring reads beside the path: there before it
        for value in op.operation.operands:
            if not on_path(value):
                _read_beside(value, op, anchor)
    ordered = [steps[op] for op in path_ops if op in steps]
    return tuple(reversed(terms)), (), tuple(ordered)


def _from_dots(ops: dict) -> dict[ir.Operation, ir.OpView]:
    """The ``ops`` that are dots or computed from one of them through ``ops``, producers first."""
    found: dict[ir.Operation, ir.OpView] = {}
    for op in sorted(ops.values(), key=LatestFirst, reverse=True):
        if op.operation.name == "stablehlo.dot_general" or any(
                not isinstance(v.owner, ir.Block) and v.owner.operation in found for v in op.operation.operands):
            found[op.operation] = op
    return found


def _cone(root: ir.OpView, block: ir.Block, inside: set | None) -> dict[ir.Operation, ir.OpView]:
    """The ops whose every result is read only by ``root``'s cone or ``inside`` (``root`` first),
    found from ``root`` back through the ops a product may pass, latest first; a dot's operands
    are not followed (the ring slices them), nor any other op's (read as a whole value).
    ``inside`` None: every op found that way, whoever reads it."""
    cone: dict[ir.Operation, ir.OpView] = {}
    heap, queued = [LatestFirst(root)], {root.operation}
    while heap:
        op = heapq.heappop(heap).op
        if inside is not None and op.operation != root.operation and not all(
                u.owner.operation in cone or u.owner.operation in inside for r in op.operation.results for u in r.uses):
            continue
        cone[op.operation] = op
        if op.operation.name == "stablehlo.dot_general" or not _passes(op):
            continue
        for value in op.operation.operands:
            owner = value.owner
            if not isinstance(owner, ir.Block) and owner.operation not in queued and owner.operation.block == block:
                queued.add(owner.operation)
                heapq.heappush(heap, LatestFirst(owner))
    return cone


def _sums_away(op: ir.OpView, branches: dict, cone: dict) -> bool:
    """Is ``op`` a branch's sum (its result read by anything: the ring hands it the whole sum)?"""
    return op.operation in branches and op.operation not in cone and op.operation.name == "stablehlo.reduce"


def _branch(start: ir.OpView, reader: ir.OpView, block: ir.Block, ops: dict, branches: dict,
            anchor: ir.OpView) -> None:
    """Add to ``branches`` the ops from ``reader`` (which reads ``start``'s value, a path value,
    apart from the scatter) forward to the reduces they end in, or Decline: every op on the way
    a product may pass (layout, elementwise, broadcast), every value read only on the way."""
    stack = [reader]
    while stack:
        op = stack.pop()
        if op.operation in ops or op.operation in branches or op.operation == anchor.operation:
            continue
        if op.operation.block != block or not (_passes(op) or op.operation.name == "stablehlo.reduce"):
            what = (f"the product of {describe_op(start)}" if start.operation.name == "stablehlo.dot_general" else
                    f"{describe_op(start)}, computed from the product,")
            raise Decline("multiple_users", f"{what} is also read, through {describe_op(reader)}, by "
                                            f"{describe_op(op)}, outside the ops that feed the scatter (and no sum "
                                            "over the scattered rows, which the ring would add up block by block): "
                                            "the full unscattered product is needed elsewhere")
        branches[op.operation] = op
        if op.operation.name == "stablehlo.reduce":
            continue  # a sum over the rows (checked with the dims): its result is read by anything
        stack += [u.owner for r in op.operation.results for u in r.uses]


def _branch_step(op: ir.OpView, dims: dict, on_path, branches: dict, n: int, affine: bool = False,
                 assemble: bool = False) -> LayoutStep:
    """The step of a branch op, its ring dim taken forward from its path operands' (producers
    come first); a reduce must sum the ring dim away, from zero, or (``assemble``) reduce other
    dims only, one value at a time: then each block gives its block of the result
    (:attr:`~cmatmul_pass.layout.LayoutStep.assembles`)."""
    read = [v for v in op.operation.operands if on_path(v)]
    in_dims = {dims.get(v) for v in read}
    if None in in_dims or len(in_dims) != 1:
        raise Decline("producer_not_dot", f"{describe_op(op)} reads values computed from the product with the "
                                          "scattered rows along different dims: no block of it is a block of each")
    (in_dim,) = in_dims
    name = op.operation.name
    if name == "stablehlo.reduce":
        reduced = set(ir_utils.i64s(op, "dimensions"))
        if in_dim not in reduced and assemble and len(op.operation.operands) == 2:
            # each block of the ring dim reduced alone is that block of the result: assembled
            out_dim = in_dim - sum(1 for d in reduced if d < in_dim)
            dims[op.result] = out_dim
            _cut(op, out_dim, n)
            return LayoutStep(op, in_dim, out_dim, (None, op.operation.operands[1].owner), assembles=True)
        if in_dim not in reduced:
            raise Decline("multiple_users", f"{describe_op(op)} sums a value computed from the product over other "
                                            f"dims than the scattered dim {in_dim}, outside the ops that feed the "
                                            "scatter: its rows are needed whole elsewhere")
        try:
            _sum_from_zero(op, on_path)
        except Nonlinear:
            raise Decline("multiple_users", f"a value computed from the product is also read by {describe_op(op)}, "
                                            "outside the ops that feed the scatter, which reduces it over the "
                                            f"scattered dim {in_dim} other than by a sum from zero (a sum the ring "
                                            "would add up block by block): the full unscattered product is needed "
                                            "elsewhere") from None
        return LayoutStep(op, in_dim, None, (None, op.operation.operands[1].owner))
    if is_layout_op(op):
        out_dim = forward_dim(op, in_dim, n)
        step = LayoutStep(op, in_dim, out_dim)
    elif name == "stablehlo.broadcast_in_dim":
        out_dim = ir_utils.i64s(op, "broadcast_dimensions")[in_dim]
        if row_dim(op, out_dim) != in_dim:
            raise Decline("producer_not_dot", f"{describe_op(op)} spreads a value computed from the product: no "
                                              "block of it is a block of its operand")
        step = LayoutStep(op, in_dim, out_dim)
    else:
        _linear(op, on_path, affine)
        out_dim = in_dim
        step = _elementwise(op, out_dim, on_path)
    dims[op.result] = out_dim
    _cut(op, out_dim, n)
    return step


def _read_beside(value: ir.Value, op: ir.OpView, anchor: ir.OpView) -> None:
    """Decline where the ring (built where the scatter is) could not read ``value``, an operand of
    the path op ``op`` that is not on the path: defined after the scatter (a constant is rebuilt)."""
    owner = value.owner
    if isinstance(owner, ir.Block) or owner.operation.block != anchor.operation.block:
        return  # an argument, or a value of an enclosing block: there before the ring
    if owner.operation.name == "stablehlo.constant":
        return  # rebuilt where the ring reads it
    if not owner.operation.is_before_in_block(anchor.operation):
        raise Decline("producer_not_dot", f"{describe_op(op)}, computed from the product, reads "
                                          f"{describe_op(owner)}, which comes after the scatter: the ring, built "
                                          "where the scatter is, cannot read it")


def _static(op: ir.OpView) -> None:
    """Decline an op of the path with other than one result, or with a value not statically shaped."""
    results = list(op.operation.results)
    if len(results) != 1:
        raise Decline("producer_not_dot", f"{describe_op(op)}, computed from the product, has {len(results)} results "
                                          "(a variadic reduce): the ring applies ops of one result per block")
    for value in [*op.operation.operands, *results]:
        t = ir_utils.ranked_tensor(value)
        if t is None or not ir_utils.is_static(t):
            raise Decline("dynamic_shape", f"{describe_op(op)} between the dot and the scatter is dynamically shaped")


def _cut(op: ir.OpView, out_dim: int, n: int) -> None:
    """Decline unless ``op``'s result is static and its ring dim cuts into ``n`` blocks."""
    result_t = ir_utils.ranked_tensor(op.result)
    if result_t is None or not ir_utils.is_static(result_t):
        raise Decline("dynamic_shape", f"{describe_op(op)} between the dot and the scatter is dynamically shaped")
    size = result_t.shape[out_dim]
    if size % n or size < n:
        raise Decline("layout", f"{describe_op(op)} on the way from the dot to the scatter: its dim {out_dim} "
                                f"({size}), the scattered rows, cannot be cut in {n} blocks")


def _agree(dims: dict, value: ir.Value, in_dim: int, op: ir.OpView) -> None:
    if dims.setdefault(value, in_dim) != in_dim:
        raise Decline("producer_not_dot", f"{describe_op(value.owner)} is read with the scattered rows along its dim "
                                          f"{dims[value]} by one op and along dim {in_dim} by {describe_op(op)}: no "
                                          "block of it is a block of both")


def _elementwise(op: ir.OpView, dim: int, on_path) -> LayoutStep:
    return LayoutStep(op, dim, dim, tuple(_source(op, v, dim, on_path) for v in op.operation.operands))


#: how far back :func:`_escaped` looks for the dot behind an op the ring cannot apply
_LOOK_BACK = 256


def _escaped(root: ir.OpView, cone: dict, block: ir.Block, anchor: ir.OpView, branches: dict) -> Decline | None:
    """Why no dot is in the cone of ``root``: an op computed from a product on the way to the
    scatter that the ring cannot apply block by block (the latest, nearest the scatter); else the
    latest value on the way from a dot that something outside the cone reads too; None where no
    dot reaches the scatter (through any ops of this block but collectives)."""
    seen: dict[ir.Operation, ir.OpView] = {}
    stack = [root]
    while stack and len(seen) < _LOOK_BACK:
        op = stack.pop()
        if op.operation in seen:
            continue
        seen[op.operation] = op
        if op.operation.name != "stablehlo.dot_general" and op.operation.name not in _COLLECTIVES:
            stack += [v.owner for v in op.operation.operands
                      if not isinstance(v.owner, ir.Block) and v.owner.operation.block == block]
    from_dot = _from_dots({**seen, **branches})
    if not from_dot:
        return None
    dot = next(iter(from_dot.values()))
    blocking = [op for op in from_dot.values() if op.operation.name != "stablehlo.dot_general"
                and not _passes(op) and op.operation not in branches]
    if blocking:
        op = blocking[-1]
        return Decline("producer_not_dot", f"the scattered value is computed from the product of {describe_op(dot)} "
                                           f"through {_described(op)}, which the ring cannot apply block by block "
                                           "(it applies layout and elementwise ops, sums over other dims and "
                                           "broadcasts back over the rows)")
    inside = set(cone) | set(branches) | {anchor.operation}
    read_outside = [(op, [u.owner for r in op.operation.results for u in r.uses if u.owner.operation not in inside])
                    for op in from_dot.values()]
    read_outside = [(op, outside) for op, outside in read_outside if outside]
    if not read_outside:
        return None
    op, outside = read_outside[-1]
    readers = ", ".join(dict.fromkeys(describe_op(u) for u in outside))
    what = f"the product of {describe_op(op)}" if op.operation.name == "stablehlo.dot_general" else \
        f"{describe_op(op)}, computed from the product of {describe_op(dot)},"
    return Decline("multiple_users", f"{what} is also read by {readers}, outside the ops that feed the scatter: the "
                                     "full unscattered product is needed elsewhere (the ring computes it one block "
                                     "at a time)")


def _described(op: ir.OpView) -> str:
    """``op`` in words; a call with its function and the ops in it that do the work."""
    if op.operation.name != "func.call":
        return describe_op(op)
    inner = causes.callee_work(op)
    callee = ir.FlatSymbolRefAttr(op.attributes["callee"]).value
    return f"{describe_op(op)} (@{callee}" + (f", {', '.join(inner)} inside)" if inner else ")")


_COLLECTIVES = frozenset(f"stablehlo.{name}" for name in (
    "all_gather", "all_reduce", "reduce_scatter", "all_to_all", "collective_permute", "collective_broadcast"))


def _passes(op: ir.OpView) -> bool:
    """Can a product pass ``op`` on its way to the scatter (in a DAG)?"""
    return is_layout_op(op) or is_elementwise(op) or op.operation.name in ROW_OPS


def _source(op: ir.OpView, value: ir.Value, dim: int, on_path) -> ir.OpView | Sliced | None:
    """How a DAG step reads an operand: None, on the path; the op of a value the same in every
    block (rebuilt at block size); else that block of it (:class:`Sliced`)."""
    if on_path(value):
        return None
    try:
        return invariant_source(op, value, dim)
    except Decline:
        return Sliced(value)


def _row_step(op: ir.OpView, out_dim: int, on_path) -> LayoutStep:
    """A reduce over dims other than the scattered one, or a broadcast_in_dim taking it from its
    operand: a step of the DAG, or Decline."""
    in_dim = row_dim(op, out_dim)
    if in_dim is None:
        raise Decline("producer_not_dot", f"{describe_op(op)} spreads a value computed from the product along the "
                                          f"scattered dim {out_dim} (one value for many rows: the rows were summed "
                                          "before it), which no single block of the product gives")
    if op.operation.name == "stablehlo.broadcast_in_dim":
        return LayoutStep(op, in_dim, out_dim)
    _sum_from_zero(op, on_path)
    return LayoutStep(op, in_dim, out_dim, (None, op.operation.operands[1].owner))


def _sum_from_zero(op: ir.OpView, on_path) -> None:
    """Decline (:class:`Nonlinear`) a reduce that is not one sum from a zero constant."""
    operands = list(op.operation.operands)
    if len(operands) != 2:
        raise Decline("producer_not_dot", f"{describe_op(op)} reduces {len(operands) // 2} values at once (a "
                                          "variadic reduce) on the way from the dot to the scatter")
    init = operands[1]
    zero = False
    if not on_path(init) and not isinstance(init.owner, ir.Block) and init.owner.operation.name == "stablehlo.constant":
        value = ir.DenseElementsAttr(init.owner.attributes["value"])
        zero = value.is_splat and _is_zero(value.get_splat_value())
    if not zero or not region_is_sum(op):
        raise Nonlinear(op, f"{describe_op(op)}, which is not a sum from zero, so not linear in the product")


def _is_zero(attr: ir.Attribute) -> bool:
    """Is ``attr`` a float or integer zero (any width: bf16, fp8 too)?"""
    for kind in (ir.FloatAttr, ir.IntegerAttr):
        try:
            return kind(attr).value == 0
        except (ValueError, TypeError):
            continue
    return False  # a complex value, or another kind of element


def _linear(op: ir.OpView, on_path, affine: bool = False) -> None:
    """Decline (:class:`Nonlinear`) an elementwise DAG step that is not linear in its path operands;
    with ``affine``, an add (subtract) of a path value and a value computed apart from the product
    is taken too (a residual's cotangent added to a norm's backward: a psum's operand in the
    backward of ``x + psum(f(norm(x)))`` under ``check_vma=False``), read at the block's rows
    as a chain reads a residual: each device adds its own before the sum."""
    read = [on_path(v) for v in op.operation.operands]
    name = op.operation.name
    if name in ("stablehlo.add", "stablehlo.subtract") and (all(read) or affine):
        return
    if name == "stablehlo.multiply" and read.count(True) == 1:
        return
    if name == "stablehlo.divide" and read == [True, False]:
        return
    if name == "stablehlo.negate":
        return
    product = product_of(op)
    what = " and ".join(causes.why_varies(v, -1, product, "the product") if on or product is None
                        else operand_side(v) for v, on in zip(op.operation.operands, read))
    raise Nonlinear(op, f"{describe_op(op)} of {what}, not linear in the product")
