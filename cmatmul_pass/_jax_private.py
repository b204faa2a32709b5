"""The one module that touches ``jax._src``.

Everything cmatmul_pass needs from JAX's private API (the MLIR context factory, the
dialect bindings, compile plumbing and sharding conversion) is imported here and only
here, so a JAX upgrade that moves things breaks exactly one file.  Supported range:
``jax>=0.10.2,<0.13``.
"""

from __future__ import annotations

import copy
import io
from collections.abc import Sequence
from typing import Any

import numpy as np

from jax._src import compiler as _compiler
from jax._src import core as _core
from jax._src import xla_bridge as _xla_bridge
from jax._src.interpreters import mlir as _jmlir
from jax._src.lib import xla_client as _xla_client
from jax._src.lib.mlir import dialects as _dialects
from jax._src.lib.mlir import ir  # noqa: F401  (re-exported)
from jax._src.lib.mlir.dialects import chlo, func, hlo, sdy  # noqa: F401  (re-exported)

try:  # moved between releases; keep the fallback here, nowhere else
    from jax._src.sharding_impls import GSPMDSharding as _GSPMDSharding
except ImportError:  # pragma: no cover - depends on the installed jax
    from jax._src.sharding_impls import _op_sharding_to_pos_sharding as _to_pos

    def _GSPMDSharding(devices, op_sharding):  # type: ignore[misc]
        return _to_pos(op_sharding, tuple(devices))


__all__ = [
    "ir",
    "chlo",
    "hlo",
    "func",
    "sdy",
    "make_context",
    "deserialize_portable_artifact",
    "module_to_bytecode",
    "compile_module",
    "sharding_for_devices",
    "module_to_hlo_text",
    "lowered_module",
    "lowered_with_module",
    "hlo_module_from_text",
    "lowered_arguments",
    "has_host_callbacks",
    "is_ref",
]


def make_context() -> ir.Context:
    """A fresh context with every dialect JAX emits (stablehlo, sdy, func, chlo, ...) registered,
    as jax's own lowering context has them.

    Built here rather than by ``make_ir_context``: jax 0.11 hands out one context per thread for
    ten lowerings, which this module must not change.  The upstream dialects are registered, not
    loaded: a module loads those it uses as it is parsed (jax loads all of them, 0.9 of its 1.8 ms).
    Single-threaded: the pass parses, verifies and prints one module, whose bulk is one
    function, so MLIR's thread pool only adds its synchronisation (measured at 32 layers:
    parsing and verifying take 2 ms less without it).
    """
    context = _jmlir.JaxIrContext()
    context.append_dialect_registry(_jmlir.upstream_dialects)
    context.enable_multithreading(False)
    for register in (_dialects.sdy.register_dialect, _dialects.mpmd.register_dialect,
                     _dialects.mhlo.register_mhlo_dialect, _dialects.chlo.register_dialect,
                     _dialects.hlo.register_dialect):
        register(context)
    return context


def deserialize_portable_artifact(context: ir.Context, data: bytes) -> ir.Module:
    """Parse a StableHLO portable artifact (VHLO bytecode, as ``jax.export`` serialises)."""
    return hlo.deserialize_portable_artifact(context, data)


def module_to_bytecode(module: ir.Module) -> bytes:
    buf = io.BytesIO()
    module.operation.write_bytecode(buf)
    return buf.getvalue()


def compile_module(module: ir.Module, num_partitions: int, devices: Sequence[Any],
                   compiler_options: dict[str, Any] | None = None):
    """Compile ``module`` for ``num_partitions`` SPMD partitions on ``devices``.

    ``devices[i]`` runs logical partition ``i``; a permuted list is a permuted
    device assignment.  ``compiler_options``: XLA debug options for this compile (as
    ``jax.jit``'s ``compiler_options``).  Returns a loaded executable.
    """
    backend = _xla_bridge.get_backend(devices[0].platform)
    assignment = np.array(list(devices), dtype=object).reshape(1, num_partitions)
    options = _compiler.get_compile_options(
        num_replicas=1, num_partitions=num_partitions, device_assignment=assignment, backend=backend,
        env_options_overrides=dict(compiler_options) if compiler_options else None,
    )
    device_list = _xla_client.DeviceList(tuple(devices))
    return backend.compile_and_load(module, executable_devices=device_list, compile_options=options)


def sharding_for_devices(devices: Sequence[Any], op_sharding: Any):
    """A ``jax.sharding.Sharding`` for an XLA ``OpSharding`` over ``devices`` (partition order)."""
    return _GSPMDSharding(tuple(devices), op_sharding)


def module_to_hlo_text(module_text: str) -> str:
    """Pre-optimisation HLO text of a StableHLO module (for inspection)."""
    computation = _xla_client._xla.mlir.mlir_module_to_xla_computation(module_text)
    return computation.as_hlo_text()


def lowered_module(lowered: Any) -> ir.Module:
    """The StableHLO module inside a ``jax.stages.Lowered`` (jax's own, cached object: read only)."""
    return lowered.compiler_ir("stablehlo")


def lowered_with_module(lowered: Any, module: ir.Module) -> Any:
    """A copy of ``lowered`` (a ``jax.stages.Lowered``) whose program is ``module``.

    Only the copy's lowering is touched: its ``_hlo`` is replaced and its cached
    executable dropped, so ``.compile()`` compiles ``module`` with everything else jax
    worked out (shardings, donation, kept arguments, pytrees).  jax's own Lowered and
    its cached module stay as they were.
    """
    lowering = getattr(lowered, "_lowering", None)
    if lowering is None or not hasattr(lowering, "_hlo") or not hasattr(lowering, "_executable"):
        raise RuntimeError(
            f"this jax ({_jax_version()}) keeps its lowered program differently from jax 0.10/0.11; "
            "cmatmul_pass.jit cannot swap in the rewritten module (use cmatmul_pass.rewrite on the text)"
        )
    new_lowering = copy.copy(lowering)
    new_lowering._hlo = module
    new_lowering._executable = None
    new = copy.copy(lowered)
    new._lowering = new_lowering
    return new


def lowered_arguments(lowered: Any) -> tuple[set[int] | None, list | None]:
    """What a ``jax.stages.Lowered``'s module takes: the indices of the flattened dynamic
    arguments it kept (jax drops unused ones), and the devices of its partitions in order
    (its device assignment); None where this jax keeps them elsewhere."""
    args = getattr(getattr(lowered, "_lowering", None), "compile_args", None) or {}
    kept = args.get("kept_var_idx")
    devices = None
    for sharding in args.get("in_shardings") or ():
        assignment = getattr(sharding, "_device_assignment", None)
        if assignment:
            devices = list(assignment)
            break
    return (set(kept) if kept is not None else None), devices


# ------------------------------------------------------------------ dispatch (cmatmul_pass.jit's calls)


def cpp_dispatcher(name: str, fun: Any, cache_miss: Any, jitted: Any) -> Any:
    """jax.jit's own C++ dispatcher around ``cache_miss``: a call whose signature (the
    arguments' avals, shardings and static values, jax's configuration) it has seen runs the
    executable ``cache_miss`` returned fast-path data for, with no Python on the way; any other
    call (a new signature, tracers, an executable without a fast path) calls
    ``cache_miss(*args, **kwargs)``, which returns ``(outputs, fast-path data or None, False)``.
    The static arguments are ``jitted``'s (a ``jax.jit`` of the same function and options), as
    jax resolved them; under ``jax.disable_jit()`` it calls ``fun`` itself, as jax.jit does.
    Its cache is its own (as for an AOT-compiled function's call)."""
    from jax._src import tree_util
    from jax._src.interpreters import pxla
    from jax._src.lib import _jax

    info = jitted._jit_info
    return _jax.pjit(name, fun, cache_miss, list(info.static_argnums), list(info.static_argnames),
                     pxla.JitGlobalCppCacheKeys(), tree_util.dispatch_registry, pxla.cc_shard_arg)


def trace_context() -> tuple:
    """The part of jax's configuration a trace depends on (x64, the default matmul precision, the
    context mesh, ...), as jax.jit's own caches key on it: a call under ``jax.enable_x64()`` or
    ``jax.default_matmul_precision(...)`` is another program."""
    from jax._src import config

    return config.trace_context()


def has_host_callbacks(lowered: Any) -> bool:
    """Whether a ``jax.stages.Lowered``'s program calls back into Python (``jax.debug.print``,
    ``jax.pure_callback``, ``io_callback``): its executable runs only through jax's dispatch,
    which keeps the callbacks alive and passes them in.  (Where this jax keeps them elsewhere,
    :func:`cmatmul_pass.execute.host_callback_target` still finds them in the module.)"""
    args = getattr(getattr(lowered, "_lowering", None), "compile_args", None) or {}
    return bool(args.get("host_callbacks"))


def is_ref(x: Any) -> bool:
    """Whether ``x`` is a mutable array reference (``jax.new_ref``)."""
    import jax

    ref_type = getattr(jax, "Ref", None) or getattr(_core, "Ref", None)
    return ref_type is not None and isinstance(x, ref_type)


def executable_cache_miss(compiled: Any) -> Any:
    """A ``jax.stages.Compiled``'s own cache miss, for :func:`cpp_dispatcher`: called with the
    executable's (dynamic) arguments it runs it and returns ``(outputs, fast-path data or None,
    False)``; None where jax gives the executable no C++ call (unordered effects, host
    callbacks)."""
    call = compiled._executable.create_cpp_call(compiled._params)
    return None if call is None else call._cache_miss


def _jax_version() -> str:
    import jax

    return jax.__version__


def hlo_module_from_text(text: str):
    """jaxlib's ``HloModule`` (computations, instructions, schedule) parsed from HLO text."""
    try:
        from jaxlib import _hlo as hlo_bindings
    except ImportError:  # pragma: no cover - older jaxlib kept it in the extension
        hlo_bindings = _xla_client._xla
    return hlo_bindings.hlo_module_from_text(text)


# ------------------------------------------------------------------ the overlap call primitive
# (cmatmul_pass.overlap: composition under jax transformations)


def under_trace() -> bool:
    """Whether a JAX transformation (jit, grad, vmap, scan, eval_shape, shard_map, ...) is
    tracing the caller: a call then has to be staged, not run."""
    return not _core.trace_state_clean()


def make_call_primitive(name: str, rewrite_callee) -> Any:
    """A call primitive named ``name`` that behaves like jax's own ``closed_call`` under every
    transformation (its JVP, linearisation, partial evaluation, batching and transpose re-bind
    this same primitive around the transformed jaxpr, so derivatives and batched versions stay
    wrapped), and lowers as ``closed_call`` does (a private func and a ``func.call``) before
    ``rewrite_callee(module, func_name, params, manual)`` rewrites that func in the enclosing
    module under construction (``params``: the bind's, plus a ``name`` vmap may add;
    ``manual``: where the call sits, :func:`_manual_context`).  Bind it with :func:`bind_call`;
    ``params`` must be hashable (jax caches on them)."""
    from jax._src import core

    if hasattr(core, "ClosedCallPrimitive"):  # jax 0.10: closed_call is a final-style call primitive
        primitive = _closed_call_style_primitive(name)
    else:  # jax 0.11+: closed_call is eval_jaxpr_p, whose rules any primitive can take
        from jax._src.lax import eval_jaxpr as _eval_jaxpr_rules

        primitive = core.Primitive(name)
        # name=None: no lowering registered there (ours follows); the JVP, linearisation,
        # transpose, batching, partial eval, DCE and discharge rules re-bind ``primitive``
        _eval_jaxpr_rules.register_call_primitive_rules(primitive, name=None)
        _register_checkify_rule(primitive)

    def lower(ctx, *args, call_jaxpr, **params):
        outs = _jmlir.core_call_lowering(ctx, *args, name=name, call_jaxpr=call_jaxpr)
        call = _call_op(outs)
        if call is not None:
            callee = ir.FlatSymbolRefAttr(call.attributes["callee"]).value
            rewrite_callee(ctx.module_context.module, callee, params, _manual_context(ctx))
        return outs

    _jmlir.register_lowering(primitive, lower, cacheable=False)
    return primitive


def _register_checkify_rule(primitive: Any) -> None:
    """jax 0.11+: checkify's default rule for a primitive with a ``call_jaxpr`` re-binds it with
    ``subfuns`` (final style), which a primitive with eval_jaxpr's rules does not take (and
    eval_jaxpr_p's own rule inlines the call, dropping the rewrite).  This rule checkifies the
    call's jaxpr and re-binds ``primitive`` around it (as checkify does for a nested jit): the
    error values are the call's first inputs and outputs."""
    from jax._src import checkify, core, tree_util

    if not hasattr(checkify, "jaxpr_to_checkify_jaxpr"):  # pragma: no cover - depends on the installed jax
        return

    def error_check(ctx, error, enabled_errors, *vals_in, call_jaxpr, **params):
        err_vals, err_tree = tree_util.tree_flatten(error)
        new_vals_in = [*err_vals, *vals_in]
        checked, out_tree, _ = checkify.jaxpr_to_checkify_jaxpr(
            ctx, call_jaxpr, enabled_errors, err_tree, *map(core.typeof, new_vals_in))
        return tree_util.tree_unflatten(out_tree, primitive.bind(*new_vals_in, call_jaxpr=checked, **params))

    checkify.error_checks[primitive] = error_check


def _closed_call_style_primitive(name: str) -> Any:
    """jax 0.10's rules: a ``ClosedCallPrimitive`` with closed_call's partial eval, DCE and
    transpose (the latter re-binding this primitive)."""
    from jax._src import core
    from jax._src.interpreters import ad, partial_eval as pe

    primitive = core.ClosedCallPrimitive(name)
    primitive.def_impl(core.call_impl)
    primitive.def_effectful_abstract_eval(
        lambda *_, call_jaxpr, **__: (call_jaxpr.out_avals, core.positional_effects(call_jaxpr)))
    pe.partial_eval_jaxpr_custom_rules[primitive] = pe.partial_eval_jaxpr_custom_rules[core.closed_call_p]
    pe.dce_rules[primitive] = pe.dce_rules[core.closed_call_p]

    def transpose(ct, *args, call_jaxpr, **params):  # jax's closed_call transpose, re-binding this primitive
        ad.call_transpose_fancy(primitive, ct, *call_jaxpr.consts, *args,
                                call_jaxpr=pe.convert_constvars_jaxpr(call_jaxpr.jaxpr), **params)

    ad.fancy_transposes[primitive] = transpose
    _register_discharge_rule(primitive)
    return primitive


def _register_discharge_rule(primitive: Any) -> None:
    """jax 0.10: closed_call's state-discharge rule, re-binding ``primitive``: where the call's
    jaxpr reads or writes mutable array references (``jax.new_ref``), discharging it (as jit
    and an eager shard_map do) turns each reference input into a value input and appends its
    final value to the outputs; the call stays this primitive around the discharged jaxpr
    (its constants become its first inputs, as :func:`traced_call_jaxpr` makes them)."""
    from jax._src import core
    from jax._src.interpreters import partial_eval as pe
    from jax._src.state import discharge
    from jax._src.state.types import AbstractRef

    def discharge_rule(in_avals, _out_avals, *args, call_jaxpr, **params):
        discharged = discharge.discharge_state(call_jaxpr)
        num_outs = len(call_jaxpr.out_avals)
        jaxpr = core.ClosedJaxpr(pe.convert_constvars_jaxpr(discharged.jaxpr), ())
        outs = bind_call(primitive, (*discharged.consts, *args), jaxpr, **params)
        refs = iter(outs[num_outs:])
        new_inputs = tuple(next(refs) if isinstance(aval, AbstractRef) else None for aval in in_avals)
        return new_inputs, outs[:num_outs]

    discharge.register_discharge_rule(primitive)(discharge_rule)


def _manual_context(ctx) -> str:
    """Where a lowering rule's call sits: ``""`` outside any shard_map, ``"manual"`` in a
    shard_map manual over every mesh axis, ``"partial-manual"`` in one manual over some."""
    axis_context = ctx.module_context.axis_context
    manual = set(getattr(axis_context, "manual_axes", ()) or ())
    if not manual:
        return ""
    mesh = getattr(axis_context, "mesh", None)
    every = {name for name, size in zip(mesh.axis_names, mesh.axis_sizes) if size > 1} if mesh is not None else None
    return "manual" if every is not None and every <= manual else "partial-manual"


#: ops jax may wrap a call's results in (jax 0.11+'s core_call_lowering constrains each result
#: to its aval's sharding where the mesh has explicit axes)
_SHARDING_WRAPPERS = ("sdy.sharding_constraint", "stablehlo.custom_call")


def _call_op(outs) -> ir.Operation | None:
    """The ``func.call`` whose results ``outs`` are, looking through a sharding constraint jax
    put on a result (None for a call without results)."""
    for value in outs:
        for v in value if isinstance(value, (list, tuple)) else (value,):
            for _ in range(2):  # the result itself, or the operand of the op wrapping it
                owner = v.owner
                if not (isinstance(owner, ir.Operation) or hasattr(owner, "operation")):
                    break
                op = owner.operation if hasattr(owner, "operation") else owner
                if op.name == "func.call":
                    return op
                if op.name not in _SHARDING_WRAPPERS or len(op.operands) != 1:
                    break
                if op.name == "stablehlo.custom_call" and \
                        ir.StringAttr(op.attributes["call_target_name"]).value != "Sharding":
                    break
                v = op.operands[0]
    return None


def lift_inlined_meshes(module: ir.Module) -> None:
    """Shardy's ``sdy-lift-inlined-meshes``: the meshes jax inlines into shardings while it
    lowers become ``sdy.mesh`` symbols (as jax itself does once a module is lowered)."""
    from jax._src.lib.mlir import passmanager

    with module.context:
        passmanager.PassManager.parse("builtin.module(sdy-lift-inlined-meshes)").run(module.operation)


def location_stripper(context: ir.Context):
    """MLIR's ``strip-debuginfo`` as a function of a module of ``context``: every location in it
    becomes unknown (in C++; the module is not verified, so it may hold symbol references it
    does not define).  Build it once for many modules: parsing the pipeline costs more than
    running it on a small module."""
    from jax._src.lib.mlir import passmanager

    with context:
        manager = passmanager.PassManager.parse("builtin.module(strip-debuginfo)")
    manager.enable_verifier(False)
    return lambda module: manager.run(module.operation)


def traced_call_jaxpr(fun, flat_args: Sequence[Any]) -> tuple[Any, list, Any]:
    """``fun``'s jaxpr on ``flat_args`` for a call primitive: a ClosedJaxpr without constants
    (they become its first inputs: closed-over tracers of an enclosing trace may be among them),
    those constants, and the output pytree's structure."""
    import jax
    from jax._src import core
    from jax._src.interpreters import partial_eval as pe

    closed, shapes = jax.make_jaxpr(fun, return_shape=True)(*flat_args)
    jaxpr = pe.convert_constvars_jaxpr(closed.jaxpr)
    closed_type = getattr(core, "ClosedJaxpr", None)
    if closed_type is not None and closed_type is not core.Jaxpr:  # jax 0.10: a Jaxpr wrapped with its consts
        jaxpr = closed_type(jaxpr, ())
    # jax 0.11+ (ClosedJaxpr merged into Jaxpr, an alias in 0.11, gone in 0.12): a Jaxpr carries
    # its consts, and convert_constvars_jaxpr's result carries none
    return jaxpr, list(closed.consts), jax.tree.structure(shapes)


def bind_call(primitive: Any, args: Sequence[Any], call_jaxpr: Any, **params: Any) -> list:
    """Bind a call primitive of :func:`make_call_primitive` around ``call_jaxpr``."""
    return primitive.bind(*args, **primitive.get_bind_params(dict(params, call_jaxpr=call_jaxpr)))
