"""``cmatmul_pass.overlap(fn)``: the pass as a JAX transformation, for code that keeps its own
``jax.jit`` (and what ``cmatmul_pass.jit`` does when it is called under a trace).

::

    layer = cmatmul_pass.overlap(layer)          # or @cmatmul_pass.overlap(bidirectional=True)
    step = jax.jit(jax.grad(loss_using_layer))   # the layer's rings, forward and backward

Calling the wrapped function binds a call primitive of this project around ``fn``'s jaxpr.
Under ``grad``/``vjp``/``jvp``, ``vmap``, ``scan``/``while`` bodies, ``remat``, ``eval_shape``
and nested ``jit`` it behaves like jax's own ``closed_call``: its derivative, linearised,
transposed and batched versions are the same primitive around the transformed jaxpr.  When
the enclosing program is lowered, each such call becomes a private function of the module
(as ``closed_call`` does) and the pass rewrites that function and the functions it calls in
place, so the rings sit wherever the call went, backward passes included.

Where the pass fails on a function (an internal error), the function stays as jax lowered
it and a warning says so once (``strict=True`` raises instead).  A call inside a shard_map
body manual over every mesh axis is rewritten like the body itself (its partition ids are
the devices'); inside one manual over some axes only, it is left as jax lowered it, with a
warning (its ops would need the region's shardings).
"""

from __future__ import annotations

import functools
import hashlib
import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any

import jax

from . import ir_utils
from ._jax_private import bind_call, ir, lift_inlined_meshes, make_call_primitive, traced_call_jaxpr
from .pipeline import Options, rewrite
from .report import Report

#: marks a function this module has rewritten (a jaxpr lowered twice is one function)
REWRITTEN_ATTR = "cmatmul_pass.rewritten"


class Overlap:
    """``fn`` with the pass applied wherever a JAX program lowers a call of it.

    ``.reports``: the report of each function rewritten so far (a forward, a backward, a
    batched version are functions of their own); ``.stats``: ``rewrites`` (functions
    rewritten), ``fallbacks`` (functions the pass failed on, left as jax lowered them)."""

    def __init__(self, fun: Callable, options: Options, strict: bool = False, name: str | None = None):
        functools.update_wrapper(self, fun)  # first: fun's attributes (a wrapper's may be ours), then ours
        self._fun = fun
        self.options = options
        self.strict = strict
        self.name = name or getattr(fun, "__qualname__", "overlap")
        self.reports: list[Report] = []
        self.stats: Counter = Counter()
        self._warned: set[str] = set()

    def __call__(self, *args: Any, **kwargs: Any):
        flat, in_tree = jax.tree.flatten((args, kwargs))

        def flat_fun(*leaves):
            given_args, given_kwargs = jax.tree.unflatten(in_tree, leaves)
            return self._fun(*given_args, **given_kwargs)

        if OVERLAP_P is None:
            self.warn_once("jax", f"cmatmul_pass.overlap({self.name}): this jax {jax.__version__} moved what the "
                           f"call primitive needs ({_UNAVAILABLE}); running the plain function, not rewritten")
            return self._fun(*args, **kwargs)
        closed, consts, out_tree = traced_call_jaxpr(flat_fun, flat)
        try:
            outs = bind_call(OVERLAP_P, (*consts, *flat), closed, owner=self)
        except NotImplementedError as missing:  # a transformation without a rule for call primitives
            if self.strict:
                raise
            self.warn_once(f"transform: {missing}", f"cmatmul_pass.overlap({self.name}): a transformation cannot "
                           f"keep the rewrite ({missing}); running the plain function here")
            return self._fun(*args, **kwargs)
        return jax.tree.unflatten(out_tree, outs)

    # --------------------------------------------------------------- the lowering side
    def rewrite_function(self, module: ir.Module, name: str) -> None:
        """Rewrite the private function ``name`` of ``module`` (a module jax is lowering) and
        the functions it calls, in place."""
        table = ir.SymbolTable(module.operation)
        target = table[name]
        if REWRITTEN_ATTR in target.attributes:
            return
        try:
            report = _rewrite_in_place(module, table, name, self.options, self.name)
        except Exception as failure:  # noqa: BLE001 - any failure of the pass (a matcher's bug too)
            if self.strict:
                raise
            self.stats["fallbacks"] += 1
            self.warn_once(f"{type(failure).__name__}: {failure}", f"cmatmul_pass.overlap({self.name}): the pass "
                           f"failed on function @{name}; it runs as jax lowered it ({failure})")
            return
        with module.context:
            target.attributes[REWRITTEN_ATTR] = ir.UnitAttr.get()
        self.stats["rewrites"] += 1
        self.reports.append(report)

    def warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    @property
    def report(self) -> Report | None:
        """The latest function's report."""
        return self.reports[-1] if self.reports else None


def overlap(fun: Callable | None = None, *, strict: bool = False, **options: Any):
    """``fun`` with the collective-matmul pass applied where a JAX program lowers it (see the
    module docstring).  ``options``: :class:`~cmatmul_pass.Options` fields; ``strict``: raise
    where the pass fails instead of warning and keeping jax's function.  Usable as
    ``@overlap`` and ``@overlap(bidirectional=True)``."""
    opts = Options(**options)
    make = functools.partial(Overlap, options=opts, strict=strict)
    return make if fun is None else make(fun)


def _lower_callee(module: ir.Module, name: str, params: dict, manual: str) -> None:
    owner = params["owner"]
    if manual == "partial-manual":  # the function's ops would need the region's shardings: not rewritten
        owner.stats["partial_manual"] += 1
        owner.warn_once(manual, f"cmatmul_pass.overlap({owner.name}): called inside a shard_map manual over only "
                        "some mesh axes; this call is not rewritten (call it outside the shard_map to get rings)")
        return
    owner.rewrite_function(module, name)


try:
    OVERLAP_P, _UNAVAILABLE = make_call_primitive("cmatmul_overlap", _lower_callee), ""
except (AttributeError, ImportError, KeyError, TypeError) as _moved:  # a jax whose internals moved
    OVERLAP_P, _UNAVAILABLE = None, f"{type(_moved).__name__}: {_moved}"



# ------------------------------------------------------------------ rewriting one function in place
def _rewrite_in_place(module: ir.Module, table: ir.SymbolTable, name: str, options: Options, source: str) -> Report:
    """Copy function ``name`` and those it calls into a module of their own (meshes lifted to
    symbols, as the pass expects them), rewrite it, and move the result back: the functions'
    bodies, the ring functions the pass added (renamed where a name is taken) and the meshes
    they name."""
    with module.context, ir.Location.unknown():
        scratch = ir.Module.create()
        for attr in ("mhlo.num_partitions", "mhlo.num_replicas"):
            if attr in module.operation.attributes:
                scratch.operation.attributes[attr] = module.operation.attributes[attr]
        names = _reachable(table, name)
        end = ir.InsertionPoint(scratch.body)
        for n in names:
            table[n].operation.clone(ip=end)
        lift_inlined_meshes(scratch)
        meshes = _rename_meshes(scratch)
        result = rewrite(scratch, options, source=source)
        if not result.report.rewritten:
            return result.report
        renamed = _move_back(module, table, scratch, names, meshes)
    for site in result.report.rewritten:  # the report names ring functions as the module now does
        if site.shared_ring and site.shared_ring[1:] in renamed:
            site.shared_ring = "@" + renamed[site.shared_ring[1:]]
    return result.report


def _reachable(table: ir.SymbolTable, name: str) -> list[str]:
    """``name`` and every function it calls, directly or not."""
    seen, todo = [name], [name]
    while todo:
        for call in ir_utils.ops_named(table[todo.pop()], "func.call")["func.call"]:
            callee = ir.FlatSymbolRefAttr(call.attributes["callee"]).value
            if callee not in seen:
                seen.append(callee)
                todo.append(callee)
    return seen


def _rename_meshes(scratch: ir.Module) -> list[ir.Operation]:
    """Name each lifted mesh after its contents, so that one mesh gets one name in the enclosing
    module however many functions lift it (jax's own lifting at the end names the rest)."""
    meshes, kept = [op.operation for op in scratch.body.operations if op.operation.name == "sdy.mesh"], []
    for op in meshes:
        old = ir.StringAttr(op.attributes["sym_name"]).value
        new = "cmatmul_mesh_" + hashlib.sha1(str(op.attributes["mesh"]).encode()).hexdigest()[:10]
        ir.SymbolTable.replace_all_symbol_uses(old, new, scratch.operation)
        if any(ir.StringAttr(k.attributes["sym_name"]).value == new for k in kept):
            op.erase()  # one mesh lifted twice (jax 0.11's lifting: @mesh and @mesh_0): one symbol
            continue
        op.attributes["sym_name"] = ir.StringAttr.get(new)
        kept.append(op)
    return kept


def _move_back(module: ir.Module, table: ir.SymbolTable, scratch: ir.Module, names: list[str],
               meshes: list[ir.Operation]) -> dict[str, str]:
    """Returns the added functions renamed: old name -> new name."""
    scratch_table = ir.SymbolTable(scratch.operation)
    added = [op.operation for op in scratch.body.operations
             if op.operation.name == "func.func" and ir_utils.symbol_name(op) not in names]
    renamed = {}
    for op in added:  # ring functions: a fresh name where the enclosing module has one already
        old = ir_utils.symbol_name(op)
        new, i = old, 0
        while new in table or (new != old and new in scratch_table):
            i += 1
            new = f"{old}_{i}"
        if new != old:
            ir.SymbolTable.replace_all_symbol_uses(old, new, scratch.operation)
            op.attributes["sym_name"] = ir.StringAttr.get(new)
            renamed[old] = new
    start = ir.InsertionPoint.at_block_begin(module.body)
    for op in meshes:
        if ir.StringAttr(op.attributes["sym_name"]).value not in table:
            op.detach_from_parent()
            start.insert(op)
            table.insert(op)
    end = ir.InsertionPoint(module.body)
    for op in added:
        op.detach_from_parent()
        end.insert(op)
        table.insert(op)
    for n in names:
        _replace_body(table[n], scratch_table[n])
    return renamed


def _replace_body(target: ir.OpView, source: ir.OpView) -> None:
    """Give function ``target`` the body of ``source`` (same signature), keeping ``target``
    itself (jax holds it in its lowering caches)."""
    old, new = target.regions[0].blocks[0], source.regions[0].blocks[0]
    for mine, theirs in zip(old.arguments, new.arguments):
        theirs.replace_all_uses_with(mine)
    for op in reversed(list(old.operations)):
        op.operation.erase()
    end = ir.InsertionPoint(old)
    for op in list(new.operations):
        op.operation.detach_from_parent()
        end.insert(op.operation)


__all__ = ["Overlap", "overlap", "OVERLAP_P", "REWRITTEN_ATTR"]
