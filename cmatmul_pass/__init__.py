"""cmatmul_pass: collective-matmul rewriting for StableHLO.

``rewrite(module, options)`` turns ``all_gather → dot_general`` pairs in shard_map
(manual) regions into windowed ``stablehlo.while`` ring loops that pass shards with
``stablehlo.collective_permute`` while computing partial dots.

JAX is imported lazily (on first use of ``rewrite`` & co.) so that the command line
can configure XLA's CPU device count before jax starts.
"""

from importlib import import_module

from .errors import CmatmulError, Decline, ExecutionError, InputError, InternalError, NumericsMismatch

_LAZY = {
    "rewrite": "pipeline",
    "Options": "pipeline",
    "RewriteResult": "pipeline",
    "Report": "report",
    "SiteReport": "report",
    "check_numerics": "execute",
    "CheckResult": "execute",
    "jit": "decorator",
    "JittedFunction": "decorator",
    "nnx_jit": "flax_nnx",
    "overlap": "transform",
    "Overlap": "transform",
}

__all__ = ["CmatmulError", "Decline", "ExecutionError", "InputError", "InternalError", "NumericsMismatch", *_LAZY]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
