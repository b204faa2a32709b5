"""Parsing, printing, walking and small type/attribute helpers over the MLIR bindings."""

from __future__ import annotations

import contextvars
import io
import os
from collections.abc import Callable

import numpy as np

from ._jax_private import chlo, deserialize_portable_artifact, hlo, ir, make_context
from .errors import InputError

BYTECODE_MAGIC = b"ML\xefR"

#: The StableHLO ops that carry a ``channel_handle`` (the spec's collectives and send/recv).
CHANNEL_OPS = (
    "stablehlo.all_gather", "stablehlo.all_reduce", "stablehlo.reduce_scatter", "stablehlo.all_to_all",
    "stablehlo.collective_permute", "stablehlo.collective_broadcast", "stablehlo.send", "stablehlo.recv",
)


def parse(data: str | bytes, *, source: str = "<input>", context: ir.Context | None = None) -> ir.Module:
    """Parse StableHLO text, MLIR bytecode or a portable (VHLO) artifact.

    Raises :class:`InputError` naming ``source`` and the line:col MLIR reports.
    """
    context = context or make_context()
    if isinstance(data, bytes) and not data.startswith(BYTECODE_MAGIC):
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InputError(source, "input is neither UTF-8 text nor MLIR bytecode (a serialized executable or "
                                     f"HLO proto is not read: {SAVE_THIS})") from exc
    if isinstance(data, str) and (what := _other_format(data)):
        raise InputError(source, f"this is {what}, not StableHLO: {SAVE_THIS}", 1, 1)
    if not data or (isinstance(data, str) and not data.strip()):
        raise InputError(source, "empty input: expected a StableHLO module")
    if isinstance(data, str) and "\x00" in data:
        head = data[: data.index("\x00")]
        line, col = head.count("\n") + 1, len(head) - (head.rfind("\n") + 1) + 1
        raise InputError(source, "NUL byte in text input", line, col)
    if isinstance(data, bytes):
        module = _parse_bytecode(data, context, source)
    else:
        try:
            module = ir.Module.parse(data, context=context)
        except ir.MLIRError as exc:
            raise _input_error(source, exc) from None
    if not any(True for _ in module.body.operations):
        raise InputError(source, "module is empty: expected a StableHLO module with functions")
    return module


#: what to save instead of a format the pass does not read
SAVE_THIS = ("save `jax.jit(f).lower(*args).as_text()` (or `jax.export.export(jax.jit(f))(*args)`'s "
             "`mlir_module()`) and give the pass that")


def _other_format(text: str) -> str | None:
    """What ``text`` is when it is a program in a format other than MLIR text that users save
    by mistake (XLA's HLO text, a jaxpr), else None."""
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("//")]
    first = lines[0] if lines else ""
    if first.startswith("HloModule "):
        return "HLO text (what `compiled.as_text()` or an XLA dump prints, after XLA's own passes)"
    if first.startswith("{ lambda ") or (first.startswith("let") and any(line.startswith("in ") for line in lines)):
        return "a jaxpr (`jax.make_jaxpr`)"
    return None


def _parse_bytecode(data: bytes, context: ir.Context, source: str) -> ir.Module:
    """MLIR bytecode, including StableHLO portable artifacts (VHLO, as jax.export serialises).

    The portable-artifact reader also reads plain StableHLO bytecode and upgrades VHLO
    to StableHLO (a plain parse would leave ``vhlo.*`` ops behind).  Untrusted bytecode
    never goes through ``ir.Module.parse``: on corrupt input its error path aborts the
    process (a diagnostic that is not UTF-8 cannot become a Python string).  The
    reader's diagnostics are collected here instead of printed.
    """
    with _Diagnostics(context) as diagnostics:
        try:
            return deserialize_portable_artifact(context, data)
        except Exception:  # noqa: BLE001 - the reader raises ValueError, whatever went wrong
            pass
    reason = diagnostics.messages[0] if diagnostics.messages else "cannot be read"
    raise InputError(source, f"invalid MLIR bytecode (or not a StableHLO module): {reason}")


class _Diagnostics:
    """Collect (and keep from stderr) the diagnostics MLIR emits while the block runs."""

    def __init__(self, context: ir.Context):
        self.context = context
        self.messages: list[str] = []

    def _handle(self, diagnostic) -> bool:
        try:
            self.messages.append(" ".join(str(diagnostic.message).split()))
        except Exception:  # noqa: BLE001 - a message that is not UTF-8
            self.messages.append("(a diagnostic that is not valid text)")
        return True

    def __enter__(self) -> "_Diagnostics":
        self.handler = self.context.attach_diagnostic_handler(self._handle)
        return self

    def __exit__(self, *exc) -> None:
        self.handler.detach()


def _input_error(source: str, exc: ir.MLIRError) -> InputError:
    diagnostics = list(getattr(exc, "error_diagnostics", []) or [])
    if not diagnostics:
        return InputError(source, str(exc).splitlines()[-1] if str(exc) else "cannot parse input")
    diag = diagnostics[0]
    line, col = file_line_col(diag.location)
    return InputError(source, diag.message or "cannot parse input", line, col)


def print_module(module: ir.Module, *, debug_info: bool = False) -> str:
    """Deterministic text of ``module`` (locations only with ``debug_info``).

    Printed as UTF-8 bytes and decoded here: the same text, a fifth faster than asking the
    bindings for a str.  Without locations, printed in the op's local scope (6 % faster, and the
    same text but for the final newline, added back)."""
    if debug_info:  # (local scope would print locations inline instead of as aliases)
        return module.operation.get_asm(binary=True, enable_debug_info=True, assume_verified=True).decode()
    return module.operation.get_asm(binary=True, assume_verified=True, use_local_scope=True).decode() + "\n"


def walk(op: ir.Operation | ir.OpView) -> list[ir.OpView]:
    """Every operation nested in ``op`` (pre-order, ``op`` excluded), as a list.

    The tree is walked by MLIR itself (one C++ walk, no Python recursion).
    """
    found: list[ir.OpView] = []

    def visit(child: ir.Operation) -> ir.WalkResult:
        found.append(child.opview)
        return ir.WalkResult.ADVANCE

    op.operation.walk(visit, ir.WalkOrder.PRE_ORDER)  # (MLIR's default is post-order: ``op`` last)
    return found[1:]


def clone_mapped(ops, mapping: dict) -> list[ir.Operation]:
    """Clone ``ops`` in order at the current insertion point, each clone (and the ops nested in
    it) reading ``mapping[v]`` wherever the original read a value ``v`` that ``mapping`` holds;
    ``mapping`` gains each original result's clone.  Returns the clones."""
    clones = []
    for op in ops:
        clone = op.operation.clone().operation
        for nested in [clone, *(inner.operation for inner in walk(clone))]:
            for old in {v: None for v in nested.operands}:
                if old in mapping:
                    nested.replace_uses_of_with(old, mapping[old])
        mapping.update(zip(op.operation.results, clone.results))
        clones.append(clone)
    return clones


def ops_named(op: ir.Operation | ir.OpView, *names: str,
              skip: Callable[[ir.Operation], bool] | None = None) -> dict[str, list[ir.OpView]]:
    """The operations of ``op``'s tree (``op`` included) with each of ``names``: one walk for
    all.  In MLIR's walk order (post-order: the ops nested in an op before it); with ``skip``,
    in pre-order, and the ops nested in an op for which ``skip`` is true are left out (the op
    itself is not)."""
    found: dict[str, list[ir.OpView]] = {name: [] for name in names}

    def visit(child: ir.Operation) -> ir.WalkResult:
        bucket = found.get(child.name)
        if bucket is not None:
            bucket.append(child.opview)
        return ir.WalkResult.ADVANCE

    def visit_or_skip(child: ir.Operation) -> ir.WalkResult:
        visit(child)
        return ir.WalkResult.SKIP if skip(child) else ir.WalkResult.ADVANCE

    if skip is None:
        op.operation.walk(visit)
    else:
        op.operation.walk(visit_or_skip, ir.WalkOrder.PRE_ORDER)
    return found


def ranked_tensor(value: ir.Value) -> ir.RankedTensorType | None:
    try:
        return ir.RankedTensorType(value.type)
    except ValueError:
        return None


def is_static(t: ir.RankedTensorType) -> bool:
    return t.has_static_shape


def with_dim(t: ir.RankedTensorType, dim: int, size: int) -> ir.RankedTensorType:
    shape = list(t.shape)
    shape[dim] = size
    return ir.RankedTensorType.get(shape, t.element_type)


def int_attr(op: ir.OpView | ir.Operation, name: str) -> int | None:
    attrs = op.attributes
    if name not in attrs:
        return None
    return ir.IntegerAttr(attrs[name]).value


def i64s(op: ir.OpView | ir.Operation, name: str) -> list[int]:
    """The integers of ``op``'s ``name`` attribute, a ``DenseI64ArrayAttr`` (a transpose's
    permutation, a broadcast's dims, a slice's sizes).  Read by index: iterating the binding
    costs about four times as much (it ends each read by raising IndexError)."""
    array = ir.DenseI64ArrayAttr(op.attributes[name])
    return [array[i] for i in range(len(array))]


def dense_ints(attr: ir.Attribute) -> np.ndarray:
    return np.array(ir.DenseIntElementsAttr(attr), dtype=np.int64)


def producer(value: ir.Value) -> ir.OpView | None:
    """The op defining ``value``; None for a block argument."""
    owner = value.owner
    if isinstance(owner, ir.Operation):
        return owner.opview
    return owner if isinstance(owner, ir.OpView) else None


def splat_attribute(value: ir.Value) -> ir.Attribute | None:
    """The element a splat constant (or a broadcast of one) holds everywhere; None for any other value."""
    owner = producer(value)
    if owner is None:
        return None
    if owner.operation.name == "stablehlo.broadcast_in_dim":
        return splat_attribute(owner.operation.operands[0])
    if owner.operation.name != "stablehlo.constant":
        return None
    attr = owner.attributes["value"]
    if not isinstance(attr, ir.DenseElementsAttr) or not attr.is_splat:
        return None
    return attr.get_splat_value()


def is_zero_splat(value: ir.Value) -> bool:
    """Is ``value`` zero everywhere: a splat constant of a float or integer zero, or a broadcast of one?"""
    splat = splat_attribute(value)
    if splat is None:
        return False
    try:
        return float(ir.FloatAttr(splat).value) == 0.0
    except ValueError:
        return int(ir.IntegerAttr(splat).value) == 0


def ancestor_in(op: ir.Operation | ir.OpView, block: ir.Block) -> ir.Operation | None:
    """``op`` itself, or its ancestor that sits in ``block``; None when ``op`` is not nested in it."""
    op = op.operation
    while op.block != block:
        parent = op.parent
        if parent is None:
            return None
        op = parent.operation
    return op


def captured(op: ir.Operation | ir.OpView) -> list[ir.Value]:
    """The values that ops nested in ``op``'s regions read and that are defined outside ``op``
    (a loop body's captures), in walk order."""
    op = op.operation
    nested = [inner.operation for inner in walk(op)]
    inside = {op, *nested}
    found = []
    for inner in nested:
        for value in inner.operands:
            owner = value.owner
            definer = owner.owner.operation if isinstance(owner, ir.Block) else owner.operation
            if definer not in inside:
                found.append(value)
    return found


class BlockOrder:
    """Sort key: an op's position in its block (``min(ops, key=BlockOrder)``: the first)."""

    def __init__(self, op: ir.Operation | ir.OpView):
        self.op = op.operation

    def __lt__(self, other: "BlockOrder") -> bool:
        return self.op.is_before_in_block(other.op)


def defined_before(value: ir.Value, anchor: ir.Operation) -> bool:
    """Is ``value`` available just before ``anchor`` (a value ``anchor``'s block can read)?"""
    owner = value.owner
    if isinstance(owner, ir.Block):
        return True  # a block argument of this block or of an enclosing one
    owner = owner.operation
    if owner.block == anchor.block:
        return owner.is_before_in_block(anchor)
    return True  # defined in an enclosing block: it dominates the whole region


def users(value: ir.Value) -> list[ir.OpView]:
    """Distinct ops using ``value``, in use order."""
    seen: list[ir.OpView] = []
    for use in value.uses:
        owner = use.owner
        if not any(owner == s for s in seen):
            seen.append(owner)
    return seen


def enclosing_func_name(op: ir.OpView) -> str:
    parent = op.operation.parent
    while parent is not None:
        if parent.name == "func.func":
            return ir.StringAttr(parent.attributes["sym_name"]).value
        parent = parent.parent
    return "<module>"


def file_line_col(loc: ir.Location) -> tuple[int | None, int | None]:
    """The (line, col) of the first file location inside ``loc``."""
    found = first_file_location(loc)
    if found is None:
        return None, None
    return found.start_line, found.start_col


def first_file_location(loc: ir.Location):
    """Depth-first search for a FileLineColLoc (the user's frame comes first in JAX's locations)."""
    if type(loc) is ir.Location:  # diagnostics hand out the base class: downcast to the concrete kind
        with loc.context:
            loc = ir.Location.from_attr(loc.attr)
    if hasattr(loc, "start_line") and hasattr(loc, "filename"):
        return loc
    children: list = []
    if hasattr(loc, "child_loc"):  # NameLoc
        children = [loc.child_loc]
    elif hasattr(loc, "callee"):  # CallSiteLoc: the callee is the innermost frame
        children = [loc.callee, loc.caller]
    elif hasattr(loc, "locations"):  # FusedLoc
        children = list(loc.locations)
    for child in children:
        found = first_file_location(child)
        if found is not None:
            return found
    return None


#: the file the pass is reading (set by the pipeline while it runs): what ``render_location``
#: shows the parser's own ``"-"`` locations against when its caller names no ``source``
READING: contextvars.ContextVar[str | None] = contextvars.ContextVar("cmatmul_pass_reading", default=None)


#: render_location's answers while the pipeline runs (it sets a dict here, with :data:`READING`),
#: by (location attribute, ``source``): a model's layers render the same locations again and again
RENDERED: contextvars.ContextVar[dict | None] = contextvars.ContextVar("cmatmul_pass_rendered", default=None)


#: the bindings' class of a ``file:line:col`` location (None where they have none of its own)
_FILE_LINE_COL = getattr(ir, "FileLineColLoc", None)


def render_location(loc: ir.Location, source: str | None = None) -> str:
    """``file:line:col`` of the op for a human.

    A location with a call stack (jax's ``as_text(debug_info=True)`` keeps one where the op was
    made in a function the traced function called) names its innermost frame and its callers,
    :data:`CALL_FRAMES` of them: ``model.py:31:15 (dense) ← model.py:58:9 (block)``, each frame's
    function in parentheses, the innermost frame's file named in full once.  Text parsed without
    debug info carries the parser's own ``"-":line:col`` locations; those are shown against
    ``source`` (the file that was read; by default :data:`READING`'s).
    """
    if type(loc) is _FILE_LINE_COL:  # the usual kind (text parsed without debug info): read at once
        return _file_line_col(loc, source)
    rendered = RENDERED.get()
    if rendered is None:
        return _render_location(loc, source)
    key = (loc.attr, source)
    text = rendered.get(key)
    if text is None:
        text = rendered[key] = _render_location(loc, source)
    return text


#: how many frames of a call stack (jax's ``callsite`` locations, ``as_text(debug_info=True)``)
#: a rendered location names, innermost first
CALL_FRAMES = 3


def _render_location(loc: ir.Location, source: str | None) -> str:
    frames = call_frames(loc)
    if not frames:
        return str(loc)
    if len(frames) == 1:  # no call stack: the plain file:line:col
        return _file_line_col(frames[0][1], source)
    first = frames[0][1].filename
    parts = []
    for name, frame in frames[:CALL_FRAMES]:
        text = _file_line_col(frame, source)
        if parts and frame.filename == first:  # the innermost frame's file, named once in full
            text = text[len(first) - len(os.path.basename(first)):]
        parts.append(f"{text} ({name})" if name else text)
    return " ← ".join(parts)


def innermost_location(loc: ir.Location, source: str | None = None) -> str:
    """The ``file:line:col`` of ``loc``'s innermost frame alone (:func:`render_location` without
    the callers); ``str(loc)`` where it has no file location."""
    frames = call_frames(loc)
    return _file_line_col(frames[0][1], source) if frames else str(loc)


def call_frames(loc: ir.Location) -> list[tuple[str | None, ir.Location]]:
    """The frames of ``loc``'s call stack, innermost first: (the function's name where jax
    recorded one, its ``file:line:col`` location).  One frame for a location without a call
    stack; none where ``loc`` holds no file location.  A frame repeating the one before it
    (``callsite(a at a)``) is left out."""
    if type(loc) is ir.Location:  # diagnostics hand out the base class: downcast to the concrete kind
        with loc.context:
            loc = ir.Location.from_attr(loc.attr)
    if hasattr(loc, "start_line") and hasattr(loc, "filename"):
        return [(None, loc)]
    if hasattr(loc, "child_loc"):  # NameLoc: a function's name over its frame, or an op's over its stack
        child = loc.child_loc
        if type(child) is ir.Location:
            with child.context:
                child = ir.Location.from_attr(child.attr)
        if hasattr(child, "start_line") and hasattr(child, "filename"):
            return [(loc.name_str.rsplit("<locals>.", 1)[-1], child)]
        return call_frames(child)
    if hasattr(loc, "callee"):  # CallSiteLoc: the callee is the inner frame
        frames = call_frames(loc.callee)
        for frame in call_frames(loc.caller):
            if not frames or _place(frames[-1][1]) != _place(frame[1]):
                frames.append(frame)
        return frames
    for child in getattr(loc, "locations", ()):  # FusedLoc: the first child with a file location
        frames = call_frames(child)
        if frames:
            return frames
    return []


def _place(loc: ir.Location) -> tuple[str, int, int]:
    return loc.filename, loc.start_line, loc.start_col


def _file_line_col(loc: ir.Location, source: str | None) -> str:
    """A ``file:line:col`` location as text, the parser's ``"-"`` file shown as ``source``
    (by default :data:`READING`'s)."""
    filename = loc.filename
    if filename in ("-", ""):
        filename = source or READING.get() or filename
    return f"{filename}:{loc.start_line}:{loc.start_col}"


def symbol_name(op: ir.OpView | ir.Operation) -> str | None:
    """The ``sym_name`` of a symbol op (a function, a mesh), else None."""
    attrs = op.operation.attributes
    if "sym_name" not in attrs:
        return None
    return ir.StringAttr(attrs["sym_name"]).value


def is_private(function: ir.OpView | ir.Operation) -> bool:
    """Is ``function`` (a ``func.func``) private to its module?"""
    attributes = function.operation.attributes
    return "sym_visibility" in attributes and ir.StringAttr(attributes["sym_visibility"]).value == "private"


class Symbols:
    """The functions and calls of the module holding ``op``, looked up once (by name)."""

    def __init__(self, op: ir.OpView | ir.Operation):
        module = op.operation
        while module.parent is not None:
            module = module.parent.operation
        found = ops_named(module, "func.func", "func.call")
        self.funcs = {symbol_name(f): f for f in found["func.func"]}
        self.calls: dict[str, list[ir.OpView]] = {}
        for call in found["func.call"]:
            self.calls.setdefault(ir.FlatSymbolRefAttr(call.attributes["callee"]).value, []).append(call)

    def callee(self, call: ir.OpView | ir.Operation) -> ir.OpView | None:
        """The function ``call`` calls, if the module defines it."""
        return self.funcs.get(ir.FlatSymbolRefAttr(call.operation.attributes["callee"]).value)

    def entry_args(self, call: ir.OpView) -> list[ir.Value]:
        func = self.callee(call)
        return list(func.regions[0].blocks[0].arguments) if func is not None else []

    def returned(self, call: ir.OpView, index: int) -> list[ir.Value]:
        func = self.callee(call)
        if func is None:
            return []
        return [list(block.operations)[-1].operands[index] for block in func.regions[0].blocks]


def private_function(at: ir.Block, name: str, inputs: list[ir.Type], results: list[ir.Type],
                     loc: ir.Location) -> tuple[ir.Operation, ir.Block]:
    """A private ``func.func`` ``name`` (``inputs`` -> ``results``) appended to ``at`` (a module's
    body), and its entry block, empty (the generic builder: about half the cost of ``func.FuncOp``
    and its ``add_entry_block``)."""
    op = ir.Operation.create(
        "func.func", regions=1, loc=loc, ip=ir.InsertionPoint(at),
        attributes={"sym_name": ir.StringAttr.get(name), "sym_visibility": ir.StringAttr.get("private"),
                    "function_type": ir.TypeAttr.get(ir.FunctionType.get(inputs, results))})
    return op, op.regions[0].blocks.append(*inputs)


def function_return(values: list[ir.Value], loc: ir.Location) -> ir.Operation:
    """A ``func.return`` of ``values`` at the current insertion point."""
    return ir.Operation.create("func.return", operands=values, loc=loc)


def call(name: str, operands: list[ir.Value], results: list[ir.Type], loc: ir.Location) -> ir.Operation:
    """A ``func.call`` of ``@name`` at the current insertion point."""
    return ir.Operation.create("func.call", results=results, operands=operands, loc=loc,
                               attributes={"callee": ir.FlatSymbolRefAttr.get(name)})


def clone_module(module: ir.Module) -> ir.Module:
    """An independent copy of ``module`` in its own context (one C++ deep clone: no bytecode
    written or read; ``module`` itself is only read)."""
    with module.context, module.operation.location:
        copy = ir.Module.create()
        attributes = module.operation.attributes
        for index in range(len(attributes)):
            named = attributes[index]
            copy.operation.attributes[named.name] = named.attr
        clone = module.operation.clone(False)  # a detached builtin.module: its ops move into ``copy``
        at = ir.InsertionPoint(copy.body)
        for op in list(clone.regions[0].blocks[0].operations):
            op.detach_from_parent()
            at.insert(op)
        clone.erase()
    return copy


def copy_module(module: ir.Module, context: ir.Context) -> ir.Module:
    """An independent copy of ``module`` in ``context`` (through bytecode: locations kept,
    no printing or parsing of text; ``module`` itself is only read)."""
    buf = io.BytesIO()
    module.operation.write_bytecode(buf)
    return ir.Module.parse(buf.getvalue(), context=context)


#: a grouped matmul (``jax.lax.ragged_dot``): the op jax lowers it to for GPU and TPU, and the
#: name of the ``stablehlo.composite`` (computed by its ``decomposition`` function) ``jax.export``
#: writes for that op
RAGGED_DOT = "chlo.ragged_dot"


def is_grouped_dot(op: ir.OpView | ir.Operation) -> bool:
    """Is ``op`` a grouped matmul: ``chlo.ragged_dot``, or a ``stablehlo.composite`` of it?"""
    operation = op.operation if isinstance(op, ir.OpView) else op
    if operation.name == RAGGED_DOT:
        return True
    attrs = operation.attributes
    return (operation.name == "stablehlo.composite" and "name" in attrs
            and ir.StringAttr(attrs["name"]).value == RAGGED_DOT)


def grouped_numbers_attr(op: ir.OpView | ir.Operation) -> ir.Attribute:
    """The attribute holding a grouped matmul's dimension numbers (a composite's attributes)."""
    operation = op.operation if isinstance(op, ir.OpView) else op
    return operation.attributes["ragged_dot_dimension_numbers" if operation.name == RAGGED_DOT
                                else "composite_attributes"]


def ragged_numbers(op: ir.OpView | ir.Operation) -> tuple[tuple[int, ...], ...] | None:
    """A grouped matmul's dimension numbers (lhs batch, rhs batch, lhs contracting, rhs
    contracting, lhs ragged, rhs group): the op's attribute, or as a composite's attributes list
    them; None where they cannot be read."""
    operation = op.operation if isinstance(op, ir.OpView) else op
    try:
        if operation.name == RAGGED_DOT:
            d = chlo.RaggedDotDimensionNumbers(operation.attributes["ragged_dot_dimension_numbers"])
            return tuple(tuple(int(x) for x in dims) for dims in (
                d.lhs_batching_dimensions, d.rhs_batching_dimensions, d.lhs_contracting_dimensions,
                d.rhs_contracting_dimensions, d.lhs_ragged_dimensions, d.rhs_group_dimensions))
        numbers = ir.ArrayAttr(ir.DictAttr(operation.attributes["composite_attributes"])["ragged_dot_dimension_numbers"])
        found = tuple(tuple(int(d) for d in ir.DenseIntElementsAttr(entry)) for entry in numbers)
    except (KeyError, ValueError, TypeError):
        return None
    return found if len(found) == 6 else None


def lhs_contracting_dims(op: ir.OpView | ir.Operation) -> tuple[int, ...]:
    """The lhs contracting dims of a ``dot_general`` or a grouped matmul."""
    operation = op.operation if isinstance(op, ir.OpView) else op
    if is_grouped_dot(operation):
        return (ragged_numbers(operation) or ((),) * 6)[2]
    return tuple(hlo.DotDimensionNumbers(operation.attributes["dot_dimension_numbers"]).lhs_contracting_dimensions)


def result_groups(op: ir.OpView | ir.Operation) -> int:
    """How many of a dot's result elements one product of rows and columns fills: a grouped
    matmul contracting its ragged rows (``ragged_dot``'s weight gradient) leads its result with
    one matrix per group, each row contributing to one of them; 1 for any other dot."""
    operation = op.operation if isinstance(op, ir.OpView) else op
    numbers = ragged_numbers(operation) if is_grouped_dot(operation) else None
    if numbers and len(numbers[4]) == 1 and numbers[4][0] in numbers[2] and not numbers[5]:
        return ranked_tensor(operation.results[0]).shape[0]
    return 1
