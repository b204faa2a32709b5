"""Op builders shared by the ring rewrites.

Every helper builds at the current ``ir.InsertionPoint`` with an explicit location,
so new ops carry the matched ops' source locations.
"""

from __future__ import annotations

import bisect
import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from .. import ir_utils
from .._jax_private import hlo, ir, sdy
from ..matchers import FULLY_MANUAL, ManualRegion
from ..ring import Ring


#: Attributes the pass puts on its ops while it runs and removes before it returns.
TRANSIENT_MARK_PREFIX = "_cmatmul_"

#: the values the builders of the running pass share per block (``RewriteContext.constants``: the
#: pipeline sets it), which :func:`forget_inside` keeps clear of erased blocks
SHARED: contextvars.ContextVar[dict | None] = contextvars.ContextVar("cmatmul_pass_shared", default=None)


@contextlib.contextmanager
def shared_per_block() -> Iterator[dict]:
    """The values one run's builders share per block (``RewriteContext.constants``), published
    in :data:`SHARED` for :func:`forget_inside` while the run lasts."""
    constants: dict = {}
    token = SHARED.set(constants)
    try:
        yield constants
    finally:
        SHARED.reset(token)


def forget_inside(op: ir.Operation | ir.OpView) -> None:
    """Call before erasing ``op``: the values shared per block (:class:`Builder`) drop those of
    the blocks inside it.  They are found by block, a block by its address, and once ``op`` is
    erased its blocks' addresses may be new blocks', which would be handed values that no longer
    exist.  (The blocks are found from ``op`` down: a Python block's ``owner`` is the op it was
    first read from, not the one a move gave it.)"""
    shared = SHARED.get()
    if not shared:
        return
    inside: set[ir.Block] = set()

    def visit(nested: ir.Operation) -> ir.WalkResult:
        for region in nested.regions:
            inside.update(region.blocks)
        return ir.WalkResult.ADVANCE

    op.operation.walk(visit)
    for key in [key for key in shared if key[0] in inside]:
        del shared[key]


def index_element_type() -> ir.IntegerType:
    return ir.IntegerType.get_unsigned(32)


def index_scalar_type() -> ir.RankedTensorType:
    return ir.RankedTensorType.get([], index_element_type())


def zeros_attr(t: ir.RankedTensorType) -> ir.DenseElementsAttr:
    """A splat of zeros of ``t``: integer, float (f8 to f64) or complex elements."""
    element = t.element_type
    if isinstance(element, ir.IntegerType):
        return ir.DenseElementsAttr.get_splat(t, ir.IntegerAttr.get(element, 0))
    if isinstance(element, ir.FloatType):
        return ir.DenseElementsAttr.get_splat(t, ir.FloatAttr.get(element, 0.0))
    if isinstance(element, ir.ComplexType):  # complex<f32> or complex<f64>: no scalar attribute
        parts = ir.ComplexType(element).element_type  # names them, so the splat comes from numpy
        dtype = {32: np.complex64, 64: np.complex128}[ir.FloatType(parts).width]
        return ir.DenseElementsAttr.get(np.zeros(1, dtype), type=element, shape=list(t.shape))
    raise TypeError(f"no zero for element type {element}")


#: a block's key in the shared values' dict for the order of those it holds (:meth:`Builder._cached`)
_ORDER = "order"


def _first(entry: tuple) -> tuple:
    return entry[0]


def _rank(key: tuple) -> tuple:
    """Where the value shared per block under ``key`` stands among a block's (index constants by
    value, then zero tensors and ring positions by what they print): an order of the keys alone."""
    kind = key[0]
    if kind == "index":
        return (0, key[1], "")
    return (1 if kind == "zeros" else 2, 0, repr(key[1:]))


class Builder:
    """Builds stablehlo ops at the current insertion point with location ``loc``.

    Scalar index (ui32) constants, zero tensors and a ring's position (none of which reads a
    value, or another of them) are made once per block, at the start of the block in an order
    of their own (:func:`_rank`), so they dominate every use in it whichever site asks first;
    builders made with :meth:`at`, and all the builders of one pass run when they are given
    the same ``constants`` dict, share them.  The pass only caches values in blocks it inserts
    into, and never erases those (it erases reduce_scatter regions, which it never inserts into).  The same dict
    holds the result types and attributes its slices and permutes repeat (uniqued in the
    context: one run's).
    """

    def __init__(self, loc: ir.Location, _constants: dict | None = None, _site: dict | None = None):
        self.loc = loc
        self._constants = {} if _constants is None else _constants
        #: values one site's rounds share (see scaled); never shared across sites, whose
        #: insertion points need not follow each other in block order
        self._site = {} if _site is None else _site

    def at(self, loc: ir.Location) -> "Builder":
        """A builder for another location, sharing this one's constants and site values."""
        return Builder(loc, self._constants, self._site)

    def _cached(self, key: tuple, make: Callable[[], ir.Value]) -> ir.Value:
        block = ir.InsertionPoint.current.block
        held = (block, *key)
        found = self._constants.get(held)
        if found is None:
            # a block's shared values stand at its start in one order (:func:`_rank`), whichever site
            # asked first: a region rewritten with fewer sites (a trimmed layer) holds what a copy of
            # one rewritten with more holds once the values only those read are erased, op for op
            order = self._constants.get((block, _ORDER))
            if order is None:
                order = self._constants[(block, _ORDER)] = []  # (rank, the value's op: its last), sorted
            rank = _rank(key)
            i = bisect.bisect_left(order, rank, key=_first)
            at = ir.InsertionPoint.after(order[i - 1][1]) if i else ir.InsertionPoint.at_block_begin(block)
            with at:
                found = self._constants[held] = make()
            order.insert(i, (rank, found.owner.operation))
        return found

    def _once(self, key: tuple, make: Callable[[], tuple]) -> tuple:
        """``make()``'s types and attributes, made once per pass run (not per block: they are
        values of the context, read by no op)."""
        found = self._constants.get(key)
        if found is None:
            found = self._constants[key] = make()
        return found

    def create(self, name: str, results: Sequence[ir.Type], operands: Sequence[ir.Value],
               attributes: dict | None = None) -> ir.Operation:
        """The op ``name`` built generically, its result types given: half the cost of the
        dialect's generated builder, which infers them and wraps every attribute anew (the
        rings build hundreds of ops per layer; the verifier checks them once the pass is done)."""
        return ir.Operation.create(name, results=results, operands=operands, attributes=attributes, loc=self.loc)

    def constant_of(self, attr: ir.Attribute) -> ir.Value:
        return self.create("stablehlo.constant", [attr.type], [], {"value": attr}).result

    def constant(self, array: np.ndarray) -> ir.Value:
        return self.constant_of(ir.DenseElementsAttr.get(np.ascontiguousarray(array)))

    def _index_types(self) -> tuple[ir.IntegerType, ir.RankedTensorType]:
        """ui32 and tensor<ui32>, made once per pass run."""
        return self._once(("index types",), lambda: (index_element_type(), index_scalar_type()))

    def index(self, value: int) -> ir.Value:
        """A ui32 index scalar (ring positions, offsets, loop counters: never negative)."""
        def attribute() -> tuple[ir.DenseElementsAttr]:  # (each block's constant: one attribute per run)
            element, scalar = self._index_types()
            return (ir.DenseElementsAttr.get_splat(scalar, ir.IntegerAttr.get(element, int(value))),)

        return self._cached(("index", int(value)),
                            lambda: self.constant_of(self._once(("index attribute", int(value)), attribute)[0]))

    def zeros(self, t: ir.RankedTensorType) -> ir.Value:
        def make() -> ir.Value:
            return self.constant_of(zeros_attr(t))

        return self._cached(("zeros", t), make)

    def add(self, a: ir.Value, b: ir.Value) -> ir.Value:
        return self.create("stablehlo.add", [a.type], [a, b]).result

    def mul(self, a: ir.Value, b: ir.Value) -> ir.Value:
        return self.create("stablehlo.multiply", [a.type], [a, b]).result

    def scaled(self, index: ir.Value, factor: int) -> ir.Value:
        """``index * factor``, built once per (block, index, factor) within one site: the dots
        of a ring round place their blocks at the same offset.  A site emits its ops in
        order at one insertion point, so the first one built dominates the later uses."""
        key = (ir.InsertionPoint.current.block, index, int(factor))
        if key not in self._site:
            self._site[key] = self.mul(index, self.index(factor))
        return self._site[key]

    def per_site(self, key: tuple, make: Callable[[], ir.Value]) -> ir.Value:
        """``make()``, built once per (``key``, insertion point) within one site: the ops a site
        builds at one insertion point follow each other in block order, so the first one built
        dominates the later uses (an insertion point elsewhere builds its own)."""
        at = ir.InsertionPoint.current
        key = (at.block, at.ref_operation, *key)
        found = self._site.get(key)
        if found is None:
            found = self._site[key] = make()
        return found

    def rem(self, a: ir.Value, b: ir.Value) -> ir.Value:
        return self.create("stablehlo.remainder", [a.type], [a, b]).result

    def ring_index(self, position: ir.Value, step: ir.Value, ring_size: int, shift: int = 1, offset: int = 0) -> ir.Value:
        """``(position + shift * step + offset) mod ring_size`` for ``step >= 0`` (never negative)."""
        stride = shift % ring_size
        if stride == 0:
            return self.rem(self.add(position, self.index(offset % ring_size)), self.index(ring_size))
        moved = step if stride == 1 else self.mul(step, self.index(stride))
        if offset % ring_size:
            moved = self.add(moved, self.index(offset % ring_size))
        return self.rem(self.add(position, moved), self.index(ring_size))

    def position_in_ring(self, ring: Ring, region: ManualRegion = FULLY_MANUAL, moved: int = 0) -> ir.Value:
        """This partition's position in its group, ``moved`` on along the ring:
        ``table[partition_id]`` (tensor<ui32>), the table holding ``(position + moved) mod n``.
        A straight-line ring's rounds each read their own table rather than add their round to
        the position: the rounds' ops then differ only in a constant operand, not in a constant
        XLA fuses into them, and XLA compiles one kernel for all of them.

        In a partial-manual region ``partition_id`` is read inside a nested
        ``sdy.manual_computation`` over the free axes, the form ``lax.axis_index``
        lowers to; the position is the same along those axes (checked by the matcher),
        so the nested computation returns it replicated.
        """
        moved %= ring.size
        key = ("position", ring, region) if not moved else ("position", ring, region, moved)
        return self._cached(key, lambda: self._position(ring, region, moved))

    def _position(self, ring: Ring, region: ManualRegion, moved: int) -> ir.Value:
        if not region.free_axes:
            return self._table_lookup(ring, moved)
        index_t = index_scalar_type()
        nested = sdy.ManualComputationOp(
            [index_t],
            [],
            sdy.TensorShardingPerValueAttr.get([]),
            sdy.TensorShardingPerValueAttr.get([sdy.TensorShardingAttr.get(region.mesh, [])]),
            sdy.ManualAxesAttr.get([ir.StringAttr.get(a) for a in region.free_axes]),
            loc=self.loc,
        )
        block = nested.operation.regions[0].blocks.append()
        with ir.InsertionPoint(block):
            sdy.ReturnOp([self._table_lookup(ring, moved)], loc=self.loc)
        return nested.results[0]

    def _table_lookup(self, ring: Ring, moved: int) -> ir.Value:
        def make() -> tuple:  # the table, an entry's type and the slice's attributes: once per ring and run
            element, _ = self._index_types()
            table_type = ir.RankedTensorType.get([ring.num_partitions], element)
            table = (ring.position_table() + np.uint32(moved)) % np.uint32(ring.size)
            return (ir.DenseElementsAttr.get(table, type=table_type),
                    ir.RankedTensorType.get([1], element), {"slice_sizes": ir.DenseI64ArrayAttr.get([1])})

        table_attr, entry_t, attributes = self._once(("position table", ring, moved), make)
        scalar = self._index_types()[1]
        table = self.constant_of(table_attr)
        pid = self.create("stablehlo.partition_id", [scalar], []).result
        entry = self.create("stablehlo.dynamic_slice", [entry_t], [table, pid], attributes).result
        return self.create("stablehlo.reshape", [scalar], [entry]).result

    def convert(self, value: ir.Value, element_type: ir.Type) -> ir.Value:
        t = ir.RankedTensorType(value.type)
        if t.element_type == element_type:
            return value
        return hlo.ConvertOp(ir.RankedTensorType.get(t.shape, element_type), value, loc=self.loc).result

    def collective_permute(self, value: ir.Value, pairs: np.ndarray, channel: int) -> ir.Value:
        (held,) = self._once(("pairs", pairs.shape, pairs.tobytes()),  # (a ring's permutes repeat their pairs)
                             lambda: (ir.DenseIntElementsAttr.get(pairs.astype(np.int64)),))
        attributes = {"source_target_pairs": held, "channel_handle": hlo.ChannelHandle.get(channel, 1)}
        return self.create("stablehlo.collective_permute", [value.type], [value], attributes).result

    def dynamic_update_slice(self, into: ir.Value, update: ir.Value, dim: int, offset: ir.Value) -> ir.Value:
        rank = ir.RankedTensorType(into.type).rank
        zero = self.index(0) if rank > 1 else None
        starts = [offset if d == dim else zero for d in range(rank)]
        return self.create("stablehlo.dynamic_update_slice", [into.type], [into, update, *starts]).result

    def dynamic_slice(self, value: ir.Value, dim: int, offset: ir.Value, size: int) -> ir.Value:
        def make() -> tuple:
            t = ir.RankedTensorType(value.type)
            sizes = [size if d == dim else s for d, s in enumerate(t.shape)]
            return ir.RankedTensorType.get(sizes, t.element_type), {"slice_sizes": ir.DenseI64ArrayAttr.get(sizes)}, t.rank

        # (result type, attributes): the rounds repeat them
        result, attributes, rank = self._once(("dynamic_slice", value.type, dim, size), make)
        zero = self.index(0) if rank > 1 else None
        starts = [offset if d == dim else zero for d in range(rank)]
        return self.create("stablehlo.dynamic_slice", [result], [value, *starts], attributes).result

    def slice(self, value: ir.Value, dim: int, start: int, size: int) -> ir.Value:
        """Elements ``[start, start + size)`` of ``value`` along ``dim`` (static)."""
        def make() -> tuple:
            t = ir.RankedTensorType(value.type)
            shape = t.shape
            starts = [start if d == dim else 0 for d in range(len(shape))]
            limits = [start + size if d == dim else s for d, s in enumerate(shape)]
            sizes = [size if d == dim else s for d, s in enumerate(shape)]
            return ir.RankedTensorType.get(sizes, t.element_type), {
                "start_indices": ir.DenseI64ArrayAttr.get(starts), "limit_indices": ir.DenseI64ArrayAttr.get(limits),
                "strides": ir.DenseI64ArrayAttr.get([1] * len(shape))}

        # (result type, attributes): chunks and sites repeat them
        result, attributes = self._once(("slice", value.type, dim, start, size), make)
        return self.create("stablehlo.slice", [result], [value], attributes).result

    def concatenate(self, values: Sequence[ir.Value], dim: int) -> ir.Value:
        if len(values) == 1:
            return values[0]
        types = [ir.RankedTensorType(v.type) for v in values]
        result = ir_utils.with_dim(types[0], dim, sum(t.shape[dim] for t in types))
        return self.create("stablehlo.concatenate", [result], list(values),
                           {"dimension": ir.IntegerAttr.get(ir.IntegerType.get_signless(64), dim)}).result

    def tied(self, values: Sequence[ir.Value]) -> list[ir.Value]:
        """``values`` through one ``stablehlo.optimization_barrier``: the same values, but each a
        result of this op, so ops reading them here read none of the values other rounds read
        (XLA's dot merger merges only dots that share an operand) and wait for all of them."""
        return list(self.create("stablehlo.optimization_barrier", [v.type for v in values], list(values)).results)

    def dot_like(self, template: ir.OpView, result_type: ir.Type, lhs: ir.Value, rhs: ir.Value,
                 *rest: ir.Value) -> ir.Value:
        """A dot_general with every attribute of ``template`` (dims, precision, algorithm, ...),
        except the pass's own transient marks (``_cmatmul_*``); a grouped matmul of a template
        that is one (:func:`.grouped.grouped_dot`), of group sizes ``rest`` (none: the template's)."""
        if ir_utils.is_grouped_dot(template):
            from .grouped import grouped_dot  # (grouped builds on this module)

            return grouped_dot(template, result_type, lhs, rhs, self.loc, rest)
        key = ("dot attributes", template.operation)  # (a site's rounds repeat its few dots)
        attrs = self._site.get(key)
        if attrs is None:
            attrs = self._site[key] = {name: value for name, value in template.operation.attributes.items()
                                       if not name.startswith(TRANSIENT_MARK_PREFIX)}
        return ir.Operation.create("stablehlo.dot_general", results=[result_type], operands=[lhs, rhs],
                                   attributes=attrs, loc=self.loc).result


def counted_loop(
    b: Builder,
    trip_count: int,
    inits: Sequence[ir.Value],
    body: Callable[[ir.Value, list[ir.Value]], list[ir.Value]],
) -> list[ir.Value]:
    """``for i in range(trip_count): carried = body(i, carried)`` as a ``stablehlo.while``.

    The counter is the first loop-carried value; it is dropped from the results.
    """
    types = [index_scalar_type()] + [v.type for v in inits]
    loop = hlo.WhileOp(types, [b.index(0), *inits], loc=b.loc)
    cond = loop.cond.blocks.append(*types, arg_locs=[b.loc] * len(types))
    with ir.InsertionPoint(cond):
        lt = hlo.CompareOp(
            cond.arguments[0],
            b.index(trip_count),
            hlo.ComparisonDirectionAttr.get("LT"),
            compare_type=hlo.ComparisonTypeAttr.get("UNSIGNED"),
            loc=b.loc,
        )
        hlo.ReturnOp([lt.result], loc=b.loc)
    block = loop.body.blocks.append(*types, arg_locs=[b.loc] * len(types))
    with ir.InsertionPoint(block):
        counter, *carried = block.arguments
        new_carried = body(counter, list(carried))
        hlo.ReturnOp([b.add(counter, b.index(1)), *new_carried], loc=b.loc)
    return list(loop.results)[1:]


def shard_type(t: ir.RankedTensorType, dim: int, ring_size: int) -> ir.RankedTensorType:
    return ir_utils.with_dim(t, dim, t.shape[dim] // ring_size)


def erase_dead(ops: Sequence[ir.OpView]) -> None:
    """Erase each op whose results are all unused (pass users before producers)."""
    for op in ops:
        if all(not list(r.uses) for r in op.operation.results):
            op.operation.erase()
