"""Look-through of layout ops between a collective and its dot.

A ring never materialises the gathered (or the unscattered) value: it works on one
ring block at a time.  Ops that only relabel or convert elements — ``convert``,
``transpose``, ``reshape``, ``sdy.sharding_constraint`` — may sit between the
collective and the dot; each is re-applied to one block, provided that the block of
its operand along the collective dimension is exactly a block of its result along
some dimension.  :func:`forward_dim` / :func:`backward_dim` find that dimension or
raise :class:`~cmatmul_pass.errors.Decline` (the site then stays as it is).

Rules (``n`` equal blocks):

* ``convert``, ``sdy.sharding_constraint``: the same dimension.
* ``transpose``: result dim ``j`` is operand dim ``permutation[j]``.
* ``reshape`` of shape ``S`` (block dim ``g``) into ``T``: block ``k`` of ``S`` along
  ``g`` is block ``k`` of ``T`` along ``t`` iff ``prod(S[:g]) == prod(T[:t])`` and
  ``n`` divides ``T[t]`` (row-major: both blocks are the same contiguous range of
  every outer row).  This covers ``tiled=False`` collectives, whose size-1 ring
  dimension is merged into or split from its neighbour.

On the scatter side the ops between the dots and the scatter may form a DAG (a norm's
backward reads the product twice): :data:`ROW_OPS` (a reduce over other dims, a broadcast
back over the row) join the elementwise and layout ops there, and :func:`apply_dag` applies
such a path to one block, each step reading its operands' blocks; a step that
:attr:`~LayoutStep.sums_rows` gives its block's share of a sum over the ring dim, and one that
:attr:`~LayoutStep.assembles` gives its block of a reduce over other dims read beside the
scatter (the ring puts each block in its place of the whole result).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from . import ir_utils
from ._jax_private import hlo, ir
from .errors import Decline

LAYOUT_OPS = frozenset({"stablehlo.convert", "stablehlo.transpose", "stablehlo.reshape", "sdy.sharding_constraint"})

#: elementwise ops a gathered value may pass through on its way to a dot (a dequantisation's
#: scale, an activation): each block of the result is the op applied to that block of its
#: operands, so the ring applies it per shard, its other operands' blocks rebuilt at block size
#: where they are the same in every block (:func:`elementwise_step`)
ELEMENTWISE_OPS = frozenset(f"stablehlo.{name}" for name in (
    "negate", "abs", "exponential", "log", "tanh", "logistic", "sqrt", "rsqrt", "sine", "cosine", "floor", "ceil",
    "sign", "add", "subtract", "multiply", "divide", "maximum", "minimum", "power",
))


#: an elementwise op the scatter side applies per block too: ``select(m, P, z)``, each block of
#: each device's product masked with that block of the mask before the sum (a zero padding moved
#: onto the dot's operand, :mod:`cmatmul_pass.rewrites.pad_motion`)
SELECT = "stablehlo.select"
#: the elementwise ops a step applies per block (the matchers admit ``select`` on the scatter side only)
STEP_ELEMENTWISE = ELEMENTWISE_OPS | {SELECT}

#: a scatter-add into an invariant value along dims its indices do not address (a MoE block's
#: un-permute of the expert outputs into token order, an embedding's gradient): each block of the
#: result along such a dim is the scatter of that block of the updates (:func:`scatter_window_dim`)
SCATTER = "stablehlo.scatter"

#: ops a product may pass between its dot and a scatter when the path is a DAG (a norm's
#: backward): each keeps the ring dim, at the same size, and computes a block of its result from
#: the same block of its operand (:func:`row_dim`)
ROW_OPS = frozenset({"stablehlo.reduce", "stablehlo.broadcast_in_dim"})


def row_dim(op: ir.OpView, dim: int) -> int | None:
    """The operand dim of a :data:`ROW_OPS` op whose blocks make the result's blocks along ``dim``,
    or None where the op does not work row by row along it.  A reduce (over dims that are not
    ``dim``, by construction: result dim ``dim`` is the operand's ``dim``-th dim not reduced)
    keeps it; a broadcast_in_dim must take it from its operand at full size, not spread one
    value along it."""
    if op.operation.name == "stablehlo.reduce":
        reduced = set(ir_utils.i64s(op, "dimensions"))
        rank = ir.RankedTensorType(op.operation.operands[0].type).rank
        return [d for d in range(rank) if d not in reduced][dim]
    dims = ir_utils.i64s(op, "broadcast_dimensions")
    source_t = ir.RankedTensorType(op.operation.operands[0].type)
    if dim not in dims or source_t.shape[dims.index(dim)] != ir.RankedTensorType(op.result.type).shape[dim]:
        return None
    return dims.index(dim)


def scatter_window_dim(op: ir.OpView, dim: int) -> int | None:
    """The updates dim carrying result dim ``dim`` of ``op`` (a one-input scatter) whole: a window
    dim the indices do not address (not inserted, not indexed, not batched), of which the updates
    hold all of it.  Then ``scatter(x, i, u)[.., block, ..] = scatter(x[block], i, u[block])``
    along ``dim``: every update starts at 0 along it and covers it.  None where there is none."""
    if op.operation.name != SCATTER or len(op.operation.operands) != 3 or len(op.operation.results) != 1:
        return None
    numbers = hlo.ScatterDimensionNumbers(op.attributes["scatter_dimension_numbers"])
    excluded = {*numbers.inserted_window_dims, *numbers.input_batching_dims}
    if dim in excluded or dim in numbers.scattered_dims_to_operand_dims:
        return None
    shapes = [ir_utils.ranked_tensor(v) for v in (op.operation.operands[0], op.operation.operands[2])]
    if any(t is None or not ir_utils.is_static(t) for t in shapes):
        return None
    window = [d for d in range(shapes[0].rank) if d not in excluded]
    updates_dim = list(numbers.update_window_dims)[window.index(dim)]
    return updates_dim if shapes[1].shape[updates_dim] == shapes[0].shape[dim] else None


def is_layout_op(op: ir.OpView) -> bool:
    return op.operation.name in LAYOUT_OPS


def is_elementwise(op: ir.OpView) -> bool:
    return op.operation.name in ELEMENTWISE_OPS


def short_name(op: ir.OpView) -> str:
    return op.operation.name.split(".", 1)[1]


def _shapes(op: ir.OpView) -> tuple[list[int], list[int]]:
    src = ir_utils.ranked_tensor(op.operation.operands[0])
    dst = ir_utils.ranked_tensor(op.result)
    if src is None or dst is None or not (ir_utils.is_static(src) and ir_utils.is_static(dst)):
        raise Decline("dynamic_shape", f"{op.operation.name} between the collective and the dot is dynamically shaped")
    return list(src.shape), list(dst.shape)


def _permutation(op: ir.OpView) -> list[int]:
    return ir_utils.i64s(op, "permutation")


def _reshape_dim(src: list[int], dim: int, dst: list[int], parts: int) -> int | None:
    if src[dim] % parts:
        return None
    outer = math.prod(src[:dim])
    for t in range(len(dst)):
        if math.prod(dst[:t]) == outer and dst[t] % parts == 0 and dst[t] >= parts:
            return t
    return None


def forward_dim(op: ir.OpView, dim: int, parts: int) -> int:
    """The result dim whose ``parts`` blocks are the op applied to the operand's blocks along ``dim``."""
    return _map_dim(op, dim, parts, forward=True)


def backward_dim(op: ir.OpView, dim: int, parts: int) -> int:
    """The operand dim whose ``parts`` blocks the op maps onto the result's blocks along ``dim``."""
    return _map_dim(op, dim, parts, forward=False)


def _map_dim(op: ir.OpView, dim: int, parts: int, forward: bool) -> int:
    name = op.operation.name
    if name == "stablehlo.transpose":
        perm = _permutation(op)
        return perm.index(dim) if forward else perm[dim]
    if name == "stablehlo.reshape":
        src, dst = _shapes(op)
        found = _reshape_dim(src, dim, dst, parts) if forward else _reshape_dim(dst, dim, src, parts)
        if found is None:
            side = "operand" if forward else "result"
            raise Decline(
                "layout",
                f"reshape {src} -> {dst}: blocks of the ring dimension {dim} of its {side} are not blocks of "
                "one dimension on the other side",
            )
        return found
    return dim


@dataclass(frozen=True, eq=False)
class Sliced:
    """An elementwise op's operand that differs from block to block along the ring dim (a per-row
    factor between a dot and its scatter): each block reads that block of it.  Valid where the op
    is applied to each device's own product before the sum, as the scatter side's path is:
    ``f(P_d, s_d)[b] = f(P_d[b], s_d[b])`` on every device ``d``."""

    value: ir.Value


@dataclass(eq=False)
class LayoutStep:
    """One layout op on the ring's path, with the ring dimension before (``in_dim``) and after (``out_dim``).

    An elementwise op's ``sources``, per operand: None for the value on the path, the op
    producing an operand that is the same in every block along the ring dim (a broadcast that
    does not vary along it, a splat constant), rebuilt at block size for each block, or a
    :class:`Sliced` operand, of which each block reads its own block."""

    op: ir.OpView
    in_dim: int
    out_dim: int | None  # None: a sum over the ring dim (:attr:`sums_rows`)
    sources: tuple[ir.OpView | Sliced | None, ...] = ()
    #: a reduce over other dims than the ring dim, read beside the scatter (a norm gain's gradient
    #: where the features are scattered): each block gives its block of the result, which the ring
    #: puts in place (:attr:`~LayoutStep.out_dim`: the ring dim in the result)
    assembles: bool = False

    @property
    def slices(self) -> bool:
        """Does :meth:`apply` need the block's place (a :class:`Sliced` operand)?"""
        return any(isinstance(source, Sliced) for source in self.sources)

    @property
    def name(self) -> str:
        return short_name(self.op)

    @property
    def sums_rows(self) -> bool:
        """A reduce that sums the ring dim away (a gain's gradient, read apart from the scatter):
        applied to a block it gives that block's share of the sum (:meth:`apply`), which the ring
        adds up over the blocks it computes."""
        return self.out_dim is None

    @property
    def handed_over(self) -> bool:
        """Is the step's result the ring's to hand over once every block is done (a sum over the
        rows, an assembled reduce), read beside the scatter?"""
        return self.sums_rows or self.assembles

    def valid_for(self, parts: int) -> bool:
        """Do the same dims still map ``parts`` blocks (finer blocks, for split rings)?"""
        if self.sums_rows:
            return True
        if self.op.operation.name in ROW_OPS or self.op.operation.name == SCATTER:  # the ring dim keeps its size
            return ir.RankedTensorType(self.op.result.type).shape[self.out_dim] % parts == 0
        try:
            return forward_dim(self.op, self.in_dim, parts) == self.out_dim
        except Decline:
            return False

    def block_type(self, parts: int) -> ir.RankedTensorType:
        t = ir.RankedTensorType(self.op.result.type)
        if self.sums_rows:
            return t  # the ring dim is summed away: a block's share has the whole sum's type
        return ir_utils.with_dim(t, self.out_dim, t.shape[self.out_dim] // parts)

    def apply(self, value: ir.Value | None, parts: int, block_of_sliced=None, blocks: dict | None = None) -> ir.Value:
        """The op applied to one block ``value`` (built at the current insertion point, at the op's
        location); ``block_of_sliced(operand, dim, width)``: that block of a :class:`Sliced`
        operand (the caller knows which block it computes).  ``blocks`` (a path that is a DAG,
        :func:`apply_dag`): the block of each operand on the path, by the original value, in
        place of ``value``."""
        op, loc = self.op, self.op.location
        name = op.operation.name
        if blocks is not None and name not in STEP_ELEMENTWISE:  # one operand, on the path
            value = blocks[op.operation.operands[2 if name == SCATTER else 0]]
        if name == "sdy.sharding_constraint":
            return value  # a hint about the whole value; the block needs none
        out_t = self.block_type(parts)
        if name == "stablehlo.broadcast_in_dim":  # a row statistic spread back over its row
            return hlo.BroadcastInDimOp(out_t, value, op.attributes["broadcast_dimensions"], loc=loc).result
        if name == "stablehlo.reduce":  # over dims other than the ring dim: each block's rows reduced alone
            # the same reducer region, dims and init value (``sources``: the init's constant), at the op's location
            init = op.operation.operands[1].owner
            constant = not isinstance(init, ir.Block) and init.operation.name == "stablehlo.constant"
            init = init.operation.clone().results[0] if constant else None  # rebuilt where the block is reduced
            clone = op.operation.clone()
            clone.operands[0] = value
            if init is not None:
                clone.operands[1] = init
            clone.results[0].set_type(out_t)
            return clone.results[0]
        if name == SCATTER:  # the updates' block into the input's (the same in every block), the indices whole
            into = block_of(self.sources[0], self.out_dim, parts, loc)  # (built before the clone: it reads it)
            clone = op.operation.clone()
            clone.operands[0] = into
            clone.operands[2] = value
            clone.results[0].set_type(out_t)
            return clone.results[0]
        if name == "stablehlo.convert":
            return ir.Operation.create(name, results=[out_t], operands=[value], loc=loc).result
        if name == "stablehlo.transpose":  # (the op's own permutation attribute)
            return ir.Operation.create(name, results=[out_t], operands=[value],
                                       attributes={"permutation": op.attributes["permutation"]}, loc=loc).result
        if name == "stablehlo.reshape":
            return ir.Operation.create(name, results=[out_t], operands=[value], loc=loc).result
        if name in STEP_ELEMENTWISE:
            width = ir.RankedTensorType(op.result.type).shape[self.out_dim] // parts
            operands = []
            for operand, source in zip(op.operation.operands, self.sources):
                if source is None:
                    operands.append(value if blocks is None else blocks[operand])
                elif isinstance(source, Sliced):
                    if block_of_sliced is None:
                        raise AssertionError(f"{name} reads an operand per block: the caller must say which block")
                    operands.append(block_of_sliced(source.value, self.out_dim, width))
                else:
                    operands.append(block_of(source, self.out_dim, parts, loc))
            attributes = {a.name: a.attr for a in op.operation.attributes}
            return ir.Operation.create(name, results=[out_t], operands=operands, attributes=attributes, loc=loc).result
        raise AssertionError(f"not a layout op: {name}")

    @property
    def source_ops(self) -> list[ir.OpView]:
        """The ops whose blocks :meth:`apply` rebuilds (an elementwise op's other operands')."""
        return [source for source in self.sources if source is not None and not isinstance(source, Sliced)]


def path_sources(steps) -> list[ir.OpView]:
    """The ops whose blocks ``steps``' elementwise ops rebuild (:attr:`LayoutStep.source_ops`),
    each once, in step order (one broadcast may feed several steps)."""
    return list({source.operation: source for step in steps for source in step.source_ops}.values())


def elementwise_step(op: ir.OpView, value: ir.Value, dim: int, sliced: bool = False) -> LayoutStep:
    """``op`` (elementwise, :data:`ELEMENTWISE_OPS`) on the ring's path: ``value`` is the path's
    value at the op and ``dim`` its ring dim.  Every other operand must be the same in every
    block along ``dim`` (:func:`invariant_source`), or :class:`Decline` (``layout``); with
    ``sliced`` (the scatter side, where the op runs on each device's own product) one that is
    not is read block by block (:class:`Sliced`)."""
    _shapes(op)  # static shapes, or Decline
    sources = []
    for operand in op.operation.operands:
        if operand == value:
            sources.append(None)
            continue
        try:
            sources.append(invariant_source(op, operand, dim))
        except Decline:
            if not sliced:
                raise
            sources.append(Sliced(operand))
    return LayoutStep(op, dim, dim, tuple(sources))


def path_operand(op: ir.OpView, dim: int) -> ir.Value | None:
    """An elementwise ``op``'s one operand that is not the same in every block along ``dim``
    (the value the ring computes block by block); None unless exactly one is."""
    varying = []
    for operand in op.operation.operands:
        try:
            invariant_source(op, operand, dim)
        except Decline:
            varying.append(operand)
    return varying[0] if len(varying) == 1 else None


def invariant_source(op: ir.OpView, operand: ir.Value, dim: int) -> ir.OpView:
    """The op producing ``operand`` (through sharding constraints) when its blocks along ``dim``
    are all the same: a broadcast_in_dim that does not vary along ``dim`` (the dim is broadcast,
    or comes from a size-1 dim), or a splat constant of a real element type.  Else Decline."""
    owner = operand.owner
    while not isinstance(owner, ir.Block) and owner.operation.name == "sdy.sharding_constraint":
        owner = owner.operation.operands[0].owner  # a hint (partial-manual regions): what it constrains
    if not isinstance(owner, ir.Block):
        name = owner.operation.name
        if name == "stablehlo.broadcast_in_dim":
            dims = ir_utils.i64s(owner, "broadcast_dimensions")
            source_t = ir_utils.ranked_tensor(owner.operation.operands[0])
            if source_t is not None and ir_utils.is_static(source_t) and (
                    dim not in dims or source_t.shape[dims.index(dim)] == 1):
                return owner
        if name == "stablehlo.constant":
            value = ir.DenseElementsAttr(owner.attributes["value"])
            element = ir.RankedTensorType(owner.result.type).element_type
            if value.is_splat and not isinstance(element, ir.ComplexType):
                return owner
    raise Decline("layout", f"{op.operation.name} between the all_gather and the dot: its other operand is not the "
                            "same in every block of the ring dim (a broadcast not along it, or a splat constant)")


def block_of(source: ir.OpView, dim: int, parts: int, loc: ir.Location) -> ir.Value:
    """One block of ``source``'s result along ``dim`` (all blocks are the same)."""
    t = ir.RankedTensorType(source.result.type)
    block_t = ir_utils.with_dim(t, dim, t.shape[dim] // parts)
    if source.operation.name == "stablehlo.constant":
        splat = ir.DenseElementsAttr(source.attributes["value"]).get_splat_value()
        return hlo.ConstantOp(ir.DenseElementsAttr.get_splat(block_t, splat), loc=loc).result
    dims = ir.DenseI64ArrayAttr(source.attributes["broadcast_dimensions"])
    return hlo.BroadcastInDimOp(block_t, source.operation.operands[0], dims, loc=loc).result


def apply_dag(path: tuple[LayoutStep, ...], blocks: dict, parts: int, block_of_sliced=None) -> None:
    """Apply ``path`` (steps in an order where producers come first, each reading any earlier
    step's result or a value ``blocks`` holds) to one block: ``blocks`` maps each original value
    on the path to its block, and gains each step's."""
    for step in path:
        blocks[step.op.result] = step.apply(None, parts, block_of_sliced, blocks)


def apply_path(path: tuple[LayoutStep, ...], value: ir.Value, parts: int) -> ir.Value:
    for step in path:
        value = step.apply(value, parts)
    return value
