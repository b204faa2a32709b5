"""A region's identity without its locations and outside operands, by bytecode (:class:`_Fingerprint`):
how replay finds regions that are copies of each other, a joiner's body within the twin's, and a
trimmed region's within the twin's trimmed.
"""

from __future__ import annotations

import io

from .. import ir_utils
from .._jax_private import ir, location_stripper
from .regions import _body, _module_body, _reshaped, _return_only, without_pass_through
from .trimming import _Erased, _trimmed_copy


class _Fingerprint:
    """A region's identity without its locations and outside operands: the MLIR bytecode of a
    copy of it, alone in a function of its operand types whose arguments it reads in their
    place, every location unknown.  Bytecode is lossless (it reads back as the module it was
    written from), so two regions write the same bytes exactly when they are the same ops,
    attributes, types and wiring: what printing them without locations, with their outside
    operands anonymous, tells apart, at less than half the cost (a copy is one C++ clone, the
    locations go in C++, and bytecode writes each type and attribute once)."""

    def __init__(self, context: ir.Context):
        self.strip = location_stripper(context)
        # per operand types: a module holding one function of them, whose entry block takes each
        # copy in turn (a module and a function made once, not per region)
        self._scratch: dict[tuple, tuple[ir.Module, ir.Block]] = {}

    def _scratch_for(self, region: ir.Operation, types: tuple | None = None) -> tuple[ir.Module, ir.Block]:
        types = tuple(v.type for v in region.operands) if types is None else types
        held = self._scratch.get(types)
        if held is None:
            with region.context, ir.Location.unknown() as unknown:
                module = ir.Module.create()
                _, entry = ir_utils.private_function(module.body, "region", list(types), [], unknown)
            held = self._scratch[types] = module, entry  # (the module owns the block: kept with it)
        return held

    def __call__(self, region: ir.Operation, through: dict[int, int] | None = None) -> bytes:
        """The fingerprint of ``region``; with ``through`` (:func:`pass_through`), of ``region``
        without those results."""
        return self._written(region, through, strip=True)

    def located(self, region: ir.Operation) -> bytes:
        """The fingerprint of ``region`` with its locations kept: two regions write the same bytes
        exactly when they are one body (as :meth:`__call__` tells) and every op of one, and every
        block argument, is located as the same one of the other."""
        return self._written(region, None, strip=False)

    def _copy(self, region: ir.Operation) -> tuple[ir.Module, ir.Operation]:
        """A copy of ``region`` alone in the scratch function of its operand types, reading its
        arguments by position (two operands may be one value); and the scratch module."""
        module, entry = self._scratch_for(region)
        with region.context, ir.InsertionPoint(entry):
            copy = region.clone().operation
        for index, argument in enumerate(entry.arguments):
            copy.operands[index] = argument
        return module, copy

    def _bytes(self, module: ir.Module, strip: bool = True) -> bytes:
        """``module``'s bytecode (``strip``: every location unknown first)."""
        if strip:
            self.strip(module)
        written = io.BytesIO()
        module.operation.write_bytecode(written)
        return written.getvalue()

    def _written(self, region: ir.Operation, through: dict[int, int] | None, strip: bool) -> bytes:
        module, copy = self._copy(region)
        if through:
            core = without_pass_through(copy, through)
            copy.erase()
            copy = core
        written = self._bytes(module, strip)
        copy.erase()  # the block is empty again, for the next region of these types
        return written

    def trimmed(self, twin: ir.Operation, results: list[int]) -> "tuple[bytes, list[int], _Erased]":
        """The fingerprint of ``twin`` returning only its results ``results``, without the ops no
        one then reads (:func:`_trimmed_copy`) and the operands only they read; and those operands
        (the twin's indices), and what trimming erased (:class:`_Erased`)."""
        _, copy = self._copy(twin)
        erased = _trimmed_copy(copy, _return_only(_body(copy), results), _module_body(twin))
        arguments = [i for i, a in enumerate(_body(copy).arguments) if any(True for _ in a.uses)]
        trimmed_module, trimmed_entry = self._scratch_for(twin, tuple(twin.operands[i].type for i in arguments))
        final = _reshaped(copy, results, arguments, list(trimmed_entry.arguments), ir.InsertionPoint(trimmed_entry),
                          returning=False)
        copy.erase()
        written = self._bytes(trimmed_module)
        final.erase()
        return written, arguments, erased
