"""``cmatmul_pass.jit``: ``jax.jit`` with the collective-matmul pass in between.

::

    @cmatmul_pass.jit(bidirectional=True, donate_argnums=(0, 1))
    def train_step(params, opt_state, batch): ...

Each new input signature is lowered by jax, copied into a fresh MLIR context (jax's
cached module is never touched), rewritten, verified, and compiled through jax's own
lowering object, so shardings, donation, pytrees and static arguments behave exactly
as under ``jax.jit``.  Later calls with the same signature go straight to the
compiled executable: no tracing, no rewriting, no compiling (``.stats`` counts them).
"""

from __future__ import annotations

import functools
import inspect
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from . import execute, ir_utils
from ._jax_private import lowered_module, lowered_with_module, make_context
from .errors import NumericsMismatch
from .pipeline import Options, rewrite
from .report import Report


def jit(
    fun: Callable | None = None,
    *,
    bidirectional: bool = False,
    unroll: int | str = 1,
    annotate_streams: bool = False,
    share_rings: bool = True,
    assemble: bool = True,
    policy: str = "all",
    hardware: str = "h100",
    min_bytes: int = 0,
    check: bool = False,
    **jit_kwargs: Any,
):
    """Like ``jax.jit(fun, **jit_kwargs)``, running the rewritten program.

    Usable as ``@cmatmul_pass.jit`` and ``@cmatmul_pass.jit(bidirectional=True, ...)``.
    ``check=True`` also runs the unrewritten program on the first call of each input
    signature and raises :class:`~cmatmul_pass.errors.NumericsMismatch` (naming the
    rewritten sites and the outputs that differ) beyond the dtype's tolerance.
    """
    options = Options(
        bidirectional=bidirectional, unroll=unroll, annotate_streams=annotate_streams, share_rings=share_rings,
        assemble=assemble,
        policy=policy, hardware=hardware, min_bytes=min_bytes,
    )
    if fun is None:
        return functools.partial(_make, options=options, check=check, jit_kwargs=jit_kwargs)
    return _make(fun, options=options, check=check, jit_kwargs=jit_kwargs)


def _make(fun: Callable, *, options: Options, check: bool, jit_kwargs: dict) -> "JittedFunction":
    return JittedFunction(fun, options, check, jit_kwargs)


class Lowered:
    """A rewritten lowering: ``.as_text()`` is the rewritten StableHLO, ``.compile()`` the
    rewritten executable (its ``.as_text()`` is the optimised HLO), ``.report`` the pass's
    per-site report, ``.original`` jax's own (unrewritten) ``Lowered``."""

    def __init__(self, lowered: Any, report: Report, original: Any):
        self._lowered = lowered
        self.report = report
        self.original = original

    def as_text(self, dialect: str | None = None, **kwargs: Any) -> str:
        return self._lowered.as_text(dialect, **kwargs)

    def compile(self, *args: Any, **kwargs: Any):
        return self._lowered.compile(*args, **kwargs)

    def compiler_ir(self, dialect: str | None = None):
        return self._lowered.compiler_ir(dialect)


@dataclass
class _Entry:
    compiled: Any
    lowered: Lowered


class JittedFunction:
    """The wrapped function.  ``.report``: the report of the latest signature lowered or
    called; ``.stats``: how often it traced+lowered, rewrote, compiled and checked."""

    def __init__(self, fun: Callable, options: Options, check: bool, jit_kwargs: dict):
        self._fun = fun
        self._jitted = jax.jit(fun, **jit_kwargs)
        self.options = options
        self.check = check
        self._static = _StaticArgs(fun, jit_kwargs.get("static_argnums"), jit_kwargs.get("static_argnames"))
        self._donates = bool(jit_kwargs.get("donate_argnums") or jit_kwargs.get("donate_argnames"))
        self._cache: dict = {}
        self.report: Report | None = None
        self.stats: Counter = Counter()
        functools.update_wrapper(self, fun)

    def lower(self, *args: Any, **kwargs: Any) -> Lowered:
        original = self._jitted.lower(*args, **kwargs)
        self.stats["lowerings"] += 1
        module = ir_utils.copy_module(lowered_module(original), make_context())
        result = rewrite(module, self.options, source=getattr(self._fun, "__qualname__", "<jit>"))
        self.stats["rewrites"] += 1
        self.report = result.report
        return Lowered(lowered_with_module(original, result.module), result.report, original)

    def __call__(self, *args: Any, **kwargs: Any):
        dynamic_args, dynamic_kwargs, statics = self._static.split(args, kwargs)
        key = (statics, _signature((dynamic_args, dynamic_kwargs)))
        entry = self._cache.get(key)
        if entry is None:
            lowered = self.lower(*args, **kwargs)
            entry = _Entry(lowered.compile(), lowered)
            self.stats["compiles"] += 1
            self._cache[key] = entry
            self.report = lowered.report
            if self.check:
                return self._checked(entry, dynamic_args, dynamic_kwargs)
        self.report = entry.lowered.report
        return entry.compiled(*dynamic_args, **dynamic_kwargs)

    def _checked(self, entry: _Entry, args: tuple, kwargs: dict):
        """Run the original on copies of the inputs (they may be donated), then the rewrite."""
        copies = jax.tree.map(lambda x: x.copy() if isinstance(x, jax.Array) else x, (args, kwargs))
        expected = entry.lowered.original.compile()(*copies[0], **copies[1])
        self.stats["checks"] += 1
        actual = entry.compiled(*args, **kwargs)
        comparisons = [
            execute.compare(i, [np.asarray(a)], [np.asarray(b)])
            for i, (a, b) in enumerate(zip(jax.tree.leaves(expected), jax.tree.leaves(actual)))
        ]
        bad = [c for c in comparisons if not c.ok]
        if bad:
            sites = "; ".join(f"{s.kind} at {s.location}" for s in entry.lowered.report.rewritten)
            outputs = "; ".join(c.line() for c in bad)
            raise NumericsMismatch(
                f"{getattr(self._fun, '__qualname__', 'function')}: the rewritten program differs from the "
                f"original beyond tolerance ({outputs}); rewritten sites: {sites or 'none'}"
            )
        return actual


class _StaticArgs:
    """Which arguments jax.jit treats as static, by position and by name (as jax infers them)."""

    def __init__(self, fun: Callable, argnums, argnames):
        self.argnums = set(_as_tuple(argnums))
        self.argnames = set(_as_tuple(argnames))
        try:
            params = list(inspect.signature(fun).parameters.values())
        except (TypeError, ValueError):
            params = []
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        for i, p in enumerate(positional):
            if p.kind is p.POSITIONAL_OR_KEYWORD:
                if i in self.argnums:
                    self.argnames.add(p.name)
                if p.name in self.argnames:
                    self.argnums.add(i)

    def split(self, args: tuple, kwargs: dict) -> tuple[tuple, dict, tuple]:
        nums = {i % len(args) if i < 0 else i for i in self.argnums} if args else set()
        dynamic_args = tuple(a for i, a in enumerate(args) if i not in nums)
        dynamic_kwargs = {k: v for k, v in kwargs.items() if k not in self.argnames}
        statics = (
            tuple((i, args[i]) for i in sorted(nums) if i < len(args)),
            tuple(sorted((k, v) for k, v in kwargs.items() if k in self.argnames)),
        )
        return dynamic_args, dynamic_kwargs, statics


def _as_tuple(x) -> tuple:
    if x is None:
        return ()
    if isinstance(x, (int, str)):
        return (x,)
    return tuple(x)


def _signature(tree) -> tuple:
    """What jax.jit specialises on: the pytree structure and each leaf's type, shape, dtype,
    weak type and (for arrays) sharding."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple(_leaf_key(x) for x in leaves)


def _leaf_key(x) -> tuple:
    if isinstance(x, jax.Array):
        aval = jax.typeof(x) if hasattr(jax, "typeof") else x.aval
        return ("array", str(aval), x.sharding)
    if isinstance(x, np.ndarray | np.generic):
        return ("numpy", x.shape, str(x.dtype))
    return ("python", type(x))
