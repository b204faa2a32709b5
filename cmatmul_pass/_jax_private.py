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
from jax._src import xla_bridge as _xla_bridge
from jax._src.interpreters import mlir as _jmlir
from jax._src.lib import xla_client as _xla_client
from jax._src.lib.mlir import ir  # noqa: F401  (re-exported)
from jax._src.lib.mlir.dialects import func, hlo, sdy  # noqa: F401  (re-exported)

try:  # moved between releases; keep the fallback here, nowhere else
    from jax._src.sharding_impls import GSPMDSharding as _GSPMDSharding
except ImportError:  # pragma: no cover - depends on the installed jax
    from jax._src.sharding_impls import _op_sharding_to_pos_sharding as _to_pos

    def _GSPMDSharding(devices, op_sharding):  # type: ignore[misc]
        return _to_pos(op_sharding, tuple(devices))


__all__ = [
    "ir",
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
]


def make_context() -> ir.Context:
    """A context with every dialect JAX emits (stablehlo, sdy, func, chlo, ...) registered.

    Single-threaded: the pass parses, verifies and prints one module, whose bulk is one
    function, so MLIR's thread pool only adds its synchronisation (measured at 32 layers:
    parsing and verifying take 2 ms less without it).
    """
    context = _jmlir.make_ir_context()
    context.enable_multithreading(False)
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
