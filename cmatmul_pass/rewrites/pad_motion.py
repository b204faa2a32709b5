"""Zero padding between a matmul and its scatter, moved onto the matmul's operand; the backward's
crop between a gather and its matmuls, moved past them.

A sequence that does not divide the devices is padded before it is scattered:
``psum_scatter(jnp.pad(x @ w, ((0, p), (0, 0))))``.  The pad stands between the product and
the scatter, and a pad is no row-by-row op (block ``k`` of the padded value is not block ``k``
of the product), so the scatter has no ring there.  :func:`move_pad` rewrites

    reduce_scatter(pad(dot(a, b), 0))  into  reduce_scatter(select(m, dot(pad(a, 0), b), 0))

where ``m`` is true exactly on the product's own rows (a broadcast of an ``iota`` compare along
each padded dim).  The scatter's operand is then a dot through an elementwise select whose mask
differs from row to row, which the scatter ring applies to each block it computes.

**Identity.**  Let ``r`` be a padded dim of the product, a free dim of operand ``a`` (its dim
``i``).  Along ``r`` the product's row ``j`` is ``a``'s row ``j`` (along ``i``) contracted with
``b``, so ``dot(pad(a, 0), b)`` has the product's rows where ``pad(a)`` has ``a``'s and a row of
``0 * b`` where ``pad(a)`` has zeros; ``select(m, ., 0)`` keeps the former and sets the latter to
exactly 0 (``0 * b`` is 0 only where ``b`` is finite: the select keeps the identity exact for an
``inf`` or ``NaN`` in ``b``).  Hence ``select(m, dot(pad(a, 0), b), 0) = pad(dot(a, b), 0)``
element for element, for every element type.  Several padded dims pad their operands alike
(each dim moves to the operand it is free in) and ``m`` is the conjunction of each dim's mask.

**Side conditions**, checked by :func:`padded_product` (each failure a reason; the site then stays):

- the pad's value is a zero constant (through ``convert``; through a private function's argument
  bound to a constant where ``jnp.pad`` lowers to a call of ``@_pad``; through a remat'd or scanned
  layer's function and loop, to the zero every call and trip passes in unchanged);
- every padded dim has ``low, high >= 0`` and no interior padding (a crop is no zero padding);
- every padded dim is a free dim of one of the dot's operands (a batch dim comes from both);
- the product is read only by the pad, and the padded value only by the scatter (sharding
  constraints between them, a partial-manual region's hints, are dropped with the pad).

**The backward.**  The transpose of that padding crops the gathered cotangent before its matmuls:
``dot(crop(all_gather(x)), b)`` (``jnp.pad`` of a negative width: a call of ``@_pad`` holding a pad
and a slice; or a ``slice``).  :func:`move_crop` moves the crop past each dot, so the gather feeds
the dots directly and rings there.  With ``G`` the gathered value and rows ``[l, l + s)`` of its
dim ``g`` kept:

- where ``g`` is a free dim of the dot, ``dot(crop(G), b) = crop(dot(G, b))`` along the product's
  dim that ``g`` becomes (each product row is one row of ``G`` times ``b``);
- where ``g`` is contracted with ``b``'s dim ``j``, ``dot(crop(G), b) = dot(G', pad(b, 0))`` with
  ``b`` padded along ``j`` by the rows cropped before and after, and ``G'`` ``G`` with the cropped
  rows set to zero: each cropped row adds ``0 * 0 = 0`` (``G``'s own cropped rows may hold an
  ``inf``; zeroed, they cannot make a ``NaN``).  ``G'`` is the gather of each shard with its
  cropped rows zeroed: a device's shard holds rows ``p * r`` to ``p * r + r`` of ``G``, ``p`` its
  position in its group, ``r`` the shard's rows (``all_gather`` lays the shards out in group order).

Side conditions (:func:`cropped_gather`): the gathered value's one reader is a chain of crops along
``g`` only (a stride-1 slice, a pad with non-positive edges and no interior, a call of a private
function holding only those, hints), every reader of the cropped value a dot reading it as one
operand, ``g`` not a batch dim of any; a real element type.

Pad and crop bounds, masks and zeros are attributes and constants: the same on every device (the
backward's row mask reads the device's position, as a ring does: data, not control flow), so
neither motion needs the variance analysis.  Each is made only where its collective is then
rewritten (:mod:`cmatmul_pass.attempts` undoes it otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import ir_utils
from .._jax_private import hlo, ir
from ..matchers.common import DotDims, describe_op
from .builders import Builder, zeros_attr

PAD = "stablehlo.pad"
HINT = "sdy.sharding_constraint"


@dataclass(frozen=True)
class PaddedProduct:
    """A scatter's operand that is a dot's product padded with zeros (:func:`padded_product`)."""

    reduce_scatter: ir.OpView
    dot: ir.OpView
    #: what stands between them in the scatter's block: the pad, or the call of a function holding it
    between: ir.OpView
    #: the sharding constraints (partial-manual regions' hints) from the pad to the scatter, and
    #: from the dot to the pad, each run nearest the pad first
    after: tuple[ir.OpView, ...]
    before: tuple[ir.OpView, ...]
    #: per dot operand, per operand dim: the (low, high) padding it takes (None: the operand stays)
    pads: tuple[tuple[tuple[int, int], ...] | None, ...]
    #: per result dim: (low, size) of the product's own rows where the dim is padded, else None
    kept: tuple[tuple[int, int] | None, ...]


def padded_product(rs: ir.OpView) -> PaddedProduct | str | None:
    """The scatter ``rs``'s operand as a zero-padded product; a reason it cannot move (str); or
    None (no pad stands there)."""
    value, after = _through_hints(rs.operation.operands[0])
    between = value.owner
    if isinstance(between, ir.Block):
        return None
    if between.operation.name == PAD:
        pad, call = between, None
    elif between.operation.name == "func.call" and len(between.operation.results) == 1:
        pad, call = _called_pad(between), between
        if pad is None:
            return None
    else:
        return None
    what = describe_op(between)
    if isinstance(ir.RankedTensorType(value.type).element_type, ir.ComplexType):
        return f"{what} pads a complex product (not moved: complex element types are not handled)"
    if len(list(value.uses)) != 1:
        return f"the padded product ({what}) is read elsewhere too"
    if not _zero_pad_value(pad.operation.operands[1], call):
        return f"{what} pads with a value that is not a zero constant"
    product, before = _through_hints(between.operation.operands[0])
    dot = product.owner
    if isinstance(dot, ir.Block) or dot.operation.name != "stablehlo.dot_general":
        return f"{what} pads what no matmul computes"
    if len(list(product.uses)) != 1:
        return f"the product {describe_op(dot)} is read elsewhere too, not only padded"
    low, high, interior = (ir_utils.i64s(pad, name) for name in
                           ("edge_padding_low", "edge_padding_high", "interior_padding"))
    dims = DotDims.of(dot)
    result_t = ir.RankedTensorType(product.type)
    pads: list[list[tuple[int, int]] | None] = [None, None]
    kept: list[tuple[int, int] | None] = [None] * result_t.rank
    for r, (lo, hi, inner) in enumerate(zip(low, high, interior)):
        if (lo, hi, inner) == (0, 0, 0):
            continue
        if lo < 0 or hi < 0 or inner:
            return f"{what} crops or pads between elements along dim {r}: not a zero padding at the edges"
        role, index, operand_dim = dims.result_dim_source(r)
        if role != "free":
            return f"{what} pads the product's {role} dim {r}, not a free dim of one operand"
        if pads[index] is None:
            pads[index] = [(0, 0)] * dims.ranks[index]
        pads[index][operand_dim] = (lo, hi)
        kept[r] = (lo, result_t.shape[r])
    if all(p is None for p in pads):
        return None  # a pad of nothing: nothing to move, and nothing in the way but the op itself
    return PaddedProduct(rs, dot, between, tuple(reversed(after)), tuple(before),
                         tuple(None if p is None else tuple(p) for p in pads), tuple(kept))


def _through_hints(value: ir.Value) -> tuple[ir.Value, list[ir.OpView]]:
    """``value`` past the single-use sharding constraints that produce it (the last one first)."""
    hints = []
    while (not isinstance(value.owner, ir.Block) and value.owner.operation.name == HINT
           and len(list(value.owner.result.uses)) == 1):
        hints.append(value.owner)
        value = value.owner.operation.operands[0]
    return value, hints


def move_pad(plan: PaddedProduct) -> ir.OpView:
    """Rewrite ``plan``'s scatter operand as the masked product of the padded operand (see the
    module's identity); the pad (or its call: its function too, once nothing calls it) and the old
    dot are erased.  Returns the new dot."""
    between, dot = plan.between, plan.dot
    loc = between.location
    padded_t = ir.RankedTensorType(between.operation.results[0].type)
    with ir.InsertionPoint(between.operation):
        operands = list(dot.operation.operands)
        for index, pad in enumerate(plan.pads):
            if pad is not None:
                operands[index] = _zero_padded(operands[index], pad, loc)
        new = dot.operation.clone()
        for index, operand in enumerate(operands):
            new.operands[index] = operand
        new.results[0].set_type(padded_t)
        mask = _kept_mask(padded_t, plan.kept, loc)
        masked = hlo.SelectOp(mask, new.results[0], _zeros(padded_t, loc), loc=loc)
    plan.reduce_scatter.operation.operands[0] = masked.result
    callee = _callee_name(between) if between.operation.name == "func.call" else None
    for op in [*reversed(plan.after), between, *plan.before, dot]:  # each read by nothing now
        op.operation.erase()
    if callee is not None:
        _erase_if_uncalled(plan.reduce_scatter, callee)
    return new.opview


def _zero_padded(value: ir.Value, pad: tuple[tuple[int, int], ...], loc: ir.Location) -> ir.Value:
    t = ir.RankedTensorType(value.type)
    zero = _zeros(ir.RankedTensorType.get([], t.element_type), loc)
    return hlo.PadOp(value, zero, [lo for lo, _ in pad], [hi for _, hi in pad], [0] * t.rank, loc=loc).result


def _kept_mask(t: ir.RankedTensorType, kept: tuple, loc: ir.Location) -> ir.Value:
    """A boolean of shape ``t``, true where every padded dim's index is within its kept rows."""
    i32, i1 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(1)
    full_t = ir.RankedTensorType.get(t.shape, i1)
    mask = None
    for r, rows in enumerate(kept):
        if rows is None:
            continue
        lo, size = rows
        line_t = ir.RankedTensorType.get([t.shape[r]], i32)
        line = _within(hlo.IotaOp(line_t, 0, loc=loc).result, lo, lo + size, loc)
        spread = hlo.BroadcastInDimOp(full_t, line, ir.DenseI64ArrayAttr.get([r]), loc=loc).result
        mask = spread if mask is None else hlo.AndOp(mask, spread, loc=loc).result
    return mask


def _splat(t: ir.RankedTensorType, value: ir.Attribute, loc: ir.Location) -> ir.Value:
    return hlo.ConstantOp(ir.DenseElementsAttr.get_splat(t, value), loc=loc).result


def _zeros(t: ir.RankedTensorType, loc: ir.Location) -> ir.Value:
    return hlo.ConstantOp(zeros_attr(t), loc=loc).result


def _within(index: ir.Value, low: int, high: int, loc: ir.Location) -> ir.Value:
    """``low <= index < high``, element by element, for a vector of indices."""
    t = ir.RankedTensorType(index.type)
    above, below = (hlo.CompareOp(index, _splat(t, ir.IntegerAttr.get(t.element_type, v), loc),
                                  hlo.ComparisonDirectionAttr.get(direction), loc=loc).result
                    for v, direction in ((low, "GE"), (high, "LT")))
    return hlo.AndOp(above, below, loc=loc).result


def _zero_pad_value(value: ir.Value, call: ir.OpView | None, depth: int = 0) -> bool:
    """Is ``value`` (a pad's value) a zero constant: through converts and hints; through the
    argument of the function ``call`` calls to the operand it binds (of a private function no call
    names: to what every call of it binds); through a call, to what its function returns; through
    a loop's carried value that every trip passes on unchanged, to its initial value (a scan's body
    reading the zero jax hoisted out of it)."""
    while depth < 32:
        depth += 1
        owner = value.owner
        if isinstance(owner, ir.Block):
            parent = owner.owner
            name = parent.operation.name
            if name == "func.func" and call is not None:
                value, call = call.operation.operands[value.arg_number], None
                continue
            if name == "func.func":
                callers = _private_callers(parent)
                return bool(callers) and all(
                    _zero_pad_value(c.operation.operands[value.arg_number], None, depth) for c in callers)
            if name == "stablehlo.while":
                passed = list(owner.operations)[-1].operation.operands
                if len(passed) <= value.arg_number or passed[value.arg_number] != value:
                    return False  # (the condition's block, or a value a trip changes)
                value = parent.operation.operands[value.arg_number]
                continue
            return False
        if owner.operation.name in ("stablehlo.convert", HINT):
            value = owner.operation.operands[0]
            continue
        if owner.operation.name == "func.call":  # what the function returns there, its arguments bound
            callee = ir_utils.Symbols(owner).callee(owner)
            if callee is None or len(callee.regions[0].blocks) != 1:
                return False
            returned = list(callee.regions[0].blocks[0].operations)[-1].operation.operands
            value, call = returned[list(owner.operation.results).index(value)], owner
            continue
        return ir_utils.is_zero_splat(value)
    return False


def _private_callers(function: ir.OpView) -> list[ir.OpView]:
    """The calls of ``function`` when it is private (else none: a public one has callers unseen)."""
    if not ir_utils.is_private(function):
        return []
    return ir_utils.Symbols(function).calls.get(ir_utils.symbol_name(function), [])


def _called_pad(call: ir.OpView) -> ir.OpView | None:
    """The pad where ``call`` calls a private function that only pads its first argument
    (``jnp.pad``'s ``@_pad``: the pad, its value's constant and converts, sharding hints); else None."""
    block = _private_body(call)
    if block is None:
        return None
    ops = list(block.operations)
    pads = [op for op in ops if op.operation.name == PAD]
    others = {op.operation.name for op in ops if op.operation.name != PAD}
    if len(pads) != 1 or not others <= {"stablehlo.constant", "stablehlo.convert", HINT, "func.return"}:
        return None
    (pad,) = pads
    returned = [_through_hints(v)[0] for v in ops[-1].operation.operands]
    if returned != [pad.result] or _through_hints(pad.operation.operands[0])[0] != block.arguments[0]:
        return None
    return pad


def _private_body(call: ir.OpView) -> ir.Block | None:
    """The one block of the private function ``call`` calls, if it is one."""
    callee = ir_utils.Symbols(call).callee(call)
    if callee is None or not ir_utils.is_private(callee) or len(callee.regions[0].blocks) != 1:
        return None
    return callee.regions[0].blocks[0]


def _callee_name(call: ir.OpView) -> str:
    return ir.FlatSymbolRefAttr(call.operation.attributes["callee"]).value


def _erase_if_uncalled(anywhere: ir.OpView, name: str) -> None:
    symbols = ir_utils.Symbols(anywhere)
    if not symbols.calls.get(name) and name in symbols.funcs:
        symbols.funcs[name].operation.erase()


# ---------------------------------------------------------------------------- the backward's crop
#: ops of a private function that only crops its first argument (``jnp.pad`` with a negative width,
#: the transpose of a zero padding, lowers to a call of ``@_pad`` holding a pad and a slice)
_CROP_FUNCTION_OPS = frozenset({PAD, "stablehlo.slice", "stablehlo.constant", "stablehlo.convert", HINT, "func.return"})


@dataclass(frozen=True)
class Reader:
    """A dot reading the cropped gathered value as its operand ``index``: the gathered dim is its
    free dim (``role`` "free", the product's dim ``dim``) or contracted with the other operand's dim
    ``dim`` (``role`` "contracting")."""

    dot: ir.OpView
    index: int
    role: str
    dim: int


@dataclass(frozen=True)
class CroppedGather:
    """An all_gather whose gathered rows are cropped (rows ``[low, low + size)`` of dim ``dim`` kept)
    by the ops ``crop`` (in block order; a call of a crop-only function among them) before dots."""

    all_gather: ir.OpView
    dim: int
    low: int
    size: int
    crop: tuple[ir.OpView, ...]
    readers: tuple[Reader, ...]

    @property
    def masks(self) -> bool:
        """Does a reader contract the gathered dim (the cropped rows must then be zeros)?"""
        return any(r.role == "contracting" for r in self.readers)


def cropped_gather(ag: ir.OpView) -> CroppedGather | str | None:
    """The gather ``ag``'s rows cropped before the dots that read them (:func:`move_crop`); a reason
    the crop cannot move (str); or None (no crop stands there)."""
    dim = ir_utils.int_attr(ag.operation, "all_gather_dim")
    value = ag.operation.results[0]
    full = ir.RankedTensorType(value.type).shape[dim]
    low, size, crop = 0, full, []
    while True:
        users = list(value.uses)
        if len(users) != 1:
            break
        op = users[0].owner
        step = _crop_step(op, dim) if op.operation.name != "func.call" else _called_crop(op, dim)
        if step is None:
            break
        low, size = low + step[0], step[1]
        crop.append(op)
        value = op.operation.results[0]
    if not crop or size == full:
        return None
    what = describe_op(crop[0])
    if isinstance(ir.RankedTensorType(value.type).element_type, ir.ComplexType):
        return f"{what} crops a complex value (not moved: complex element types are not handled)"
    readers = []
    for use in value.uses:
        dot = use.owner
        if dot.operation.name != "stablehlo.dot_general" or list(dot.operation.operands).count(value) != 1:
            return f"the cropped rows ({what}) are read by {describe_op(dot)}, not only as one operand of matmuls"
        dims = DotDims.of(dot)
        index = use.operand_number
        other = 1 - index
        if dim in dims.batch[index]:
            return f"{describe_op(dot)} reads the cropped dim {dim} as a batch dim"
        if dim in dims.contracting[index]:
            readers.append(Reader(dot, index, "contracting", dims.contracting[other][dims.contracting[index].index(dim)]))
        else:
            readers.append(Reader(dot, index, "free", dims.free_result_offset(index) + dims.free(index).index(dim)))
    if not readers:
        return None
    return CroppedGather(ag, dim, low, size, tuple(crop), tuple(readers))


def _crop_step(op: ir.OpView, dim: int) -> tuple[int, int] | None:
    """(first row kept, rows kept) along ``dim`` where ``op`` only crops its operand along it (a
    slice of stride 1, a pad of non-positive edges and no interior, other dims whole; a sharding
    hint: (0, all)); else None."""
    name = op.operation.name
    in_t = ir_utils.ranked_tensor(op.operation.operands[0]) if op.operation.operands else None
    if in_t is None or len(op.operation.results) != 1:
        return None
    out_t = ir.RankedTensorType(op.operation.results[0].type)
    if name == HINT:
        return 0, in_t.shape[dim]
    if name == "stablehlo.slice":
        starts, limits, strides = (ir_utils.i64s(op, a) for a in ("start_indices", "limit_indices", "strides"))
        edges = [(s, in_t.shape[d] - l) for d, (s, l) in enumerate(zip(starts, limits))]
        if any(x != 1 for x in strides):
            return None
    elif name == PAD:
        low, high, interior = (ir_utils.i64s(op, a) for a in ("edge_padding_low", "edge_padding_high",
                                                              "interior_padding"))
        if any(interior) or any(x > 0 for x in [*low, *high]):
            return None
        edges = [(-lo, -hi) for lo, hi in zip(low, high)]
    else:
        return None
    if any(e != (0, 0) for d, e in enumerate(edges) if d != dim):
        return None
    return edges[dim][0], out_t.shape[dim]


def _called_crop(call: ir.OpView, dim: int) -> tuple[int, int] | None:
    """:func:`_crop_step` of a call of a private function whose ops only crop its one argument."""
    if len(call.operation.operands) != 1 or len(call.operation.results) != 1:
        return None
    block = _private_body(call)
    if block is None:
        return None
    ops = list(block.operations)
    if not {op.operation.name for op in ops} <= _CROP_FUNCTION_OPS:
        return None
    value, low, size = block.arguments[0], 0, ir.RankedTensorType(block.arguments[0].type).shape[dim]
    while True:
        users = list(value.uses)
        if len(users) != 1:
            return None
        op = users[0].owner
        if op.operation.name == "func.return":
            return low, size
        step = _crop_step(op, dim)
        if step is None:
            return None
        low, size = low + step[0], step[1]
        value = op.operation.results[0]


def move_crop(plan: CroppedGather, ring, region, constants: dict) -> None:
    """Rewrite ``plan``'s crop past its dots (see the module's second identity): each dot reads the
    whole gathered value, a free reader's product cropped after it, a contracting reader's other
    operand padded with zeros, and, where one contracts, every shard's cropped rows zeroed before
    the gather.  The crop ops (a called function too, once nothing calls it) are erased."""
    ag, dim = plan.all_gather, plan.dim
    gathered = ag.operation.results[0]
    full = ir.RankedTensorType(gathered.type).shape[dim]
    if plan.masks:
        _zero_cropped_rows(plan, ring, region, constants)
    for reader in plan.readers:
        dot, loc = reader.dot, reader.dot.location
        with ir.InsertionPoint(dot.operation):
            operands = list(dot.operation.operands)
            operands[reader.index] = gathered
            if reader.role == "contracting":  # (built before the new dot, which reads it)
                other = 1 - reader.index
                widths = [(plan.low, full - plan.low - plan.size) if d == reader.dim else (0, 0)
                          for d in range(ir.RankedTensorType(operands[other].type).rank)]
                operands[other] = _zero_padded(operands[other], tuple(widths), loc)
            new = dot.operation.clone()
            for index, operand in enumerate(operands):
                new.operands[index] = operand
            result = new.results[0]
            if reader.role == "free":
                t = ir.RankedTensorType(dot.result.type)
                result.set_type(ir_utils.with_dim(t, reader.dim, full))
                result = hlo.SliceOp(result, [plan.low if d == reader.dim else 0 for d in range(t.rank)],
                                     [plan.low + plan.size if d == reader.dim else s for d, s in enumerate(t.shape)],
                                     [1] * t.rank, loc=loc).result
        dot.result.replace_all_uses_with(result)
        dot.operation.erase()
    callees = [_callee_name(op) for op in plan.crop if op.operation.name == "func.call"]
    for op in reversed(plan.crop):
        op.operation.erase()
    for name in callees:
        _erase_if_uncalled(ag, name)


def _zero_cropped_rows(plan: CroppedGather, ring, region, constants: dict) -> None:
    """Each device's shard with the rows the crop drops set to zero (their place in the gathered
    value: the device's position in its group times the shard's rows, plus the row)."""
    ag, dim = plan.all_gather, plan.dim
    shard = ag.operation.operands[0]
    t = ir.RankedTensorType(shard.type)
    rows, loc = t.shape[dim], ag.location
    with ir.InsertionPoint(ag.operation):
        b = Builder(loc, constants)
        first = b.scaled(b.position_in_ring(ring, region), rows)  # ui32: the shard's first gathered row
        line_t = ir.RankedTensorType.get([rows], ir.RankedTensorType(first.type).element_type)
        at = hlo.AddOp(hlo.BroadcastInDimOp(line_t, first, [], loc=loc).result,
                       hlo.IotaOp(line_t, 0, loc=loc).result, loc=loc).result
        mask = hlo.BroadcastInDimOp(ir.RankedTensorType.get(t.shape, ir.IntegerType.get_signless(1)),
                                    _within(at, plan.low, plan.low + plan.size, loc), [dim], loc=loc).result
        kept = hlo.SelectOp(mask, shard, _zeros(t, loc), loc=loc).result
    ag.operation.operands[0] = kept
