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
import hashlib
import inspect
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import jax
import numpy as np

from . import execute
from ._jax_private import (cpp_dispatcher, executable_cache_miss, is_ref, lowered_module, lowered_with_module,
                           trace_context, under_trace)
from .compile_budget import DEFAULT_BUDGET
from .cost import VARIANTS
from .errors import NumericsMismatch
from .jit_check import check_call, comparable, gathered  # noqa: F401 (decorator.comparable)
from .transform import Overlap
from .pipeline import Options, RewriteResult, rewrite_copy
from .report import Report, duration


def jit(
    fun: Callable | None = None,
    *,
    bidirectional: bool | None = None,
    unroll: int | str | None = None,
    variant: str | None = None,
    annotate_streams: bool = False,
    share_rings: bool = True,
    merge_dots: bool = True,
    tie_rounds: bool = True,
    assemble: bool = True,
    policy: str | None = None,
    hardware: str = "auto",
    min_bytes: int = 0,
    all_reduce: str | None = None,
    chunks: int | None = None,
    compile_budget: float | None = DEFAULT_BUDGET,
    check: bool = False,
    gpu_options: bool = True,
    measure_runs: int = 5,
    strict: bool = False,
    **jit_kwargs: Any,
):
    """Like ``jax.jit(fun, **jit_kwargs)``, running the rewritten program.

    Usable as ``@cmatmul_pass.jit`` and ``@cmatmul_pass.jit(bidirectional=True, ...)``.
    ``variant``: a ring variant by name (``"bidi-unroll2"``), or ``"auto"`` (the default,
    unless ``bidirectional`` or ``unroll`` name one): per site, the one the cost model predicts
    fastest on ``hardware``, or on a machine no profile describes (a CPU) ``full`` on a ring of
    up to 8 (``uni`` for a scatter of 8 MiB of partial sums or more) and ``unroll2`` on longer
    ones (``cost.fallback_variant``, :class:`~cmatmul_pass.Options`),
    or ``"measure"``: on the first call of each input signature, compile every variant and
    the original, time each on that call's inputs (median of ``measure_runs`` after a
    warm-up, in turn, on copies of donated inputs) and keep the fastest variant if it beats
    the original by more than the noise, else the original program (:func:`choose`: the noise
    is the spread, max - min, of the original's own ``measure_runs`` timings; 0 with one run).
    ``.measurement`` holds the times, the noise and the pick (``.measured``: the times,
    ``.picked``: a variant or ``"original"``).  Over several processes (``jax.distributed``)
    each candidate's time is its slowest process's and the noise the largest, so every
    process keeps the same program.
    ``policy``: as :class:`Options`: by default ``"auto"`` (``$CMATMUL_PASS_POLICY`` may name
    another), which leaves a site the cost model predicts slower; ``"all"`` rewrites every site.
    ``hardware`` (for ``variant="auto"`` and ``policy="auto"``): by default ``"auto"``, the
    cost-model profile of jax's default device (H100, H200, A100, TPU v5e; else the H100's,
    which ``policy="auto"`` uses and the report's ``cost.hardware`` says was assumed), or a
    profile by name.
    ``all_reduce`` and ``chunks``: what becomes of a psum of a matmul (``Options.all_reduce``:
    ``"split"``, ``"chunk"``, ``"keep"``, or by default ``"auto"``: the cost model's pick, two
    chunks where no profile describes the machine).
    ``check=True`` also runs the unrewritten program on the first call of each input
    signature and raises :class:`~cmatmul_pass.errors.NumericsMismatch` (naming the
    rewritten sites and the outputs that differ) where the rewrite is less accurate than the
    original beyond what a reordering explains: the verdict of ``check`` (docs/numerics.md,
    against the original evaluated in f64), both programs compiled for that without excess
    precision (execute.CHECK_COMPILER_OPTIONS); ``.checked`` holds the result (None where an
    argument's sharding is reduced or unreduced: skipped with a warning).  Over several
    processes each compares the shards it holds and all agree on one verdict: a mismatch on
    any process raises on every process, naming the process and the output
    (docs/decorator.md, "Multiple hosts").  There, every process also checks that all compiled
    the same program (a hash of the rewritten module) and raises :class:`DifferentPrograms`
    where not.
    ``compile_budget``: as :class:`~cmatmul_pass.Options` has it (the rewritten program's
    predicted XLA compile time at most this many times the original's, under policy auto).
    ``gpu_options``: on a GPU, compile a program with rewritten sites with the XLA options
    its rings need to overlap (:func:`ring_compiler_options`), except those you set yourself
    in ``compiler_options`` or ``XLA_FLAGS``.
    ``strict``: raise where the pass fails on a module or XLA rejects the rewritten one;
    by default the original program runs instead, with one warning per reason
    (``.stats["fallbacks"]`` counts them).
    Called under a JAX transformation (``jax.grad``, ``jax.vmap``, an enclosing ``jax.jit``,
    ``lax.scan``, ``jax.eval_shape``, ...), it stages :func:`cmatmul_pass.overlap` of ``fun``
    (``.overlap``: its reports), so the enclosing program's lowering holds the rings.
    """
    if measure_runs < 1:
        raise ValueError(f"measure_runs must be at least 1, not {measure_runs}")
    measure = variant == MEASURE
    options = Options(
        bidirectional=bidirectional, unroll=unroll, variant=None if measure else variant, annotate_streams=annotate_streams, share_rings=share_rings,
        assemble=assemble, merge_dots=merge_dots, tie_rounds=tie_rounds,
        hardware=hardware, min_bytes=min_bytes, all_reduce=all_reduce, chunks=chunks, compile_budget=compile_budget,
        **({} if policy is None else {"policy": policy}),
    )
    if measure and (bidirectional is not None or unroll is not None):
        raise ValueError("variant='measure' times every variant; it cannot be combined with bidirectional or unroll")
    make = functools.partial(_make, options=options, check=check, gpu_options=gpu_options, jit_kwargs=jit_kwargs,
                             measure_runs=measure_runs if measure else 0, strict=strict)
    return make if fun is None else make(fun)


def _make(fun: Callable, *, options: Options, check: bool, gpu_options: bool, jit_kwargs: dict,
          measure_runs: int = 0, strict: bool = False) -> "JittedFunction":
    return JittedFunction(fun, options, check, jit_kwargs, gpu_options, measure_runs, strict)


#: ``cmatmul_pass.jit(variant=MEASURE)``: time every variant on the devices, keep the fastest
MEASURE = "measure"
#: the candidate of ``variant="measure"`` that is the program as jax lowered it
ORIGINAL = "original"


@dataclass(frozen=True)
class Measurement:
    """What ``variant="measure"`` measured for one input signature: ``times``, each candidate's
    median seconds (the variants and ``"original"``; over several processes the slowest
    process's), ``noise`` (seconds: the spread of the original's runs, the largest over
    processes), ``picked`` (a variant, or ``"original"`` where none beat it by more than the
    noise), how many ``processes`` took part, and ``runs``: this process's timed runs of each
    candidate (seconds, the warm-up left out), which the medians and the noise come from."""

    times: dict[str, float]
    noise: float
    picked: str
    processes: int = 1
    runs: dict[str, tuple[float, ...]] = field(default_factory=dict)
    #: each candidate's XLA compile time (seconds; over several processes the slowest process's;
    #: the original compiled first, so that it, not a variant, pays for XLA's own start)
    compile_s: dict[str, float] = field(default_factory=dict)

    def compile_line(self) -> str:
        """The picked program's compile time against the original's; empty where not measured."""
        base = self.compile_s.get(ORIGINAL)
        if not base or self.picked not in self.compile_s:
            return ""
        if self.picked != ORIGINAL:
            t = self.compile_s[self.picked]
            return f"compile: original {duration(base)}, {self.picked} {duration(t)} ({t / base:.2f}x)"
        ratios = [t / base for name, t in self.compile_s.items() if name != ORIGINAL]
        return f"compile: original {duration(base)}, the variants {min(ratios):.2f}x to {max(ratios):.2f}x of it"

    def summary(self) -> str:
        times = ", ".join(f"{name} {duration(t)}" for name, t in sorted(self.times.items(), key=lambda kv: kv[1]))
        fastest = min((n for n in self.times if n != ORIGINAL), key=self.times.__getitem__)
        if self.picked == ORIGINAL and self.times[fastest] >= self.times[ORIGINAL]:
            why = f"kept the original: no variant is faster (the fastest, {fastest}, is not)"
        elif self.picked == ORIGINAL:
            why = (f"kept the original: the fastest variant, {fastest}, is not faster by more than the noise "
                   f"({duration(self.noise)})")
        else:
            gain = self.times[ORIGINAL] - self.times[self.picked]
            why = f"picked {self.picked}: {duration(gain)} faster than the original (noise {duration(self.noise)})"
        where = f" over {self.processes} processes" if self.processes > 1 else ""
        compiled = self.compile_line()
        return f"{why}; medians{where}: {times}" + (f"; {compiled}" if compiled else "")


def choose(times: dict[str, float], noise: float) -> str:
    """The candidate ``variant="measure"`` keeps: the fastest variant if its median time is
    below the original's by more than ``noise``, else ``"original"``.  A ring that only ties
    the original within its own run-to-run spread is not worth its compile and its risk."""
    variants = [name for name in times if name != ORIGINAL]
    fastest = min(variants, key=times.__getitem__)
    return fastest if times[ORIGINAL] - times[fastest] > noise else ORIGINAL


def ring_compiler_options(report: Report, platform: str, user_options: dict | None = None,
                          xla_flags: str = "") -> dict:
    """The XLA options a program with rings needs on ``platform`` to overlap them, less those
    the user set (``user_options``: jax.jit's ``compiler_options``; ``xla_flags``: the
    ``XLA_FLAGS`` text).  Measured on an H100 compile (docs/gpu.md, check 2):

    * ``xla_gpu_enable_latency_hiding_scheduler``: the scheduler that places a ring's dot
      between its permute's start and done;
    * ``xla_gpu_experimental_parallel_collective_overlap_limit=2`` when a ring goes both
      ways (the report's ``schedule.directions``), its rounds having two permutes in flight:
      with the default of one, one direction's permute per round is left exposed (36 of 54
      permutes hidden; 49 with the option).

    Nothing on other platforms, or when no site was rewritten."""
    if platform != "gpu" or not report.rewritten:
        return {}
    wanted: dict[str, Any] = {"xla_gpu_enable_latency_hiding_scheduler": True}
    if any(site.schedule.get("directions", 1) > 1 for site in report.rewritten):
        wanted["xla_gpu_experimental_parallel_collective_overlap_limit"] = 2
    in_flags = {flag.split("=", 1)[0].lstrip("-") for flag in xla_flags.split()}
    return {k: v for k, v in wanted.items() if k not in (user_options or {}) and k not in in_flags}


class Lowered:
    """A rewritten lowering: ``.as_text()`` is the rewritten StableHLO, ``.compile()`` the
    rewritten executable (its ``.as_text()`` is the optimised HLO), ``.report`` the pass's
    per-site report, ``.original`` jax's own (unrewritten) ``Lowered``."""

    def __init__(self, lowered: Any, report: Report, original: Any, compiler_options: dict | None = None):
        self._lowered = lowered
        self.report = report
        self.original = original
        #: what .compile() adds to the compiler options it is given (ring_compiler_options)
        self.compiler_options = dict(compiler_options or {})

    def as_text(self, dialect: str | None = None, **kwargs: Any) -> str:
        return self._lowered.as_text(dialect, **kwargs)

    def compile(self, compiler_options: dict | None = None, **kwargs: Any):
        merged = {**self.compiler_options, **(compiler_options or {})}
        return self._lowered.compile(merged or None, **kwargs)

    def compiler_ir(self, dialect: str | None = None):
        return self._lowered.compiler_ir(dialect)


@dataclass
class JitReport(Report):
    """The report of a module :func:`jit` lowered where the pass found no candidate site, with
    ``notes``: what the command line says of such a module (``cli.module_notes``: that it has no
    shard_map region and the XLA flags of XLA's own collective matmul for a program jax.jit
    shards by itself, or which collectives its shard_map regions hold), printed by
    :meth:`summary` and written by :meth:`to_dict`."""

    notes: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, report: Report, notes: list[str]) -> "JitReport":
        return cls(**{f.name: getattr(report, f.name) for f in fields(report) if f.init}, notes=list(notes))

    def summary(self) -> str:
        return super().summary() + "".join(f"\nnote: {note}" for note in self.notes)

    def to_dict(self) -> dict:
        return {**super().to_dict(), **({"notes": self.notes} if self.notes else {})}


class Traced:
    """jax's ``Traced`` (attributes read through), whose ``.lower()`` rewrites."""

    def __init__(self, traced: Any, owner: "JittedFunction"):
        self._traced = traced
        self._owner = owner

    def __getattr__(self, name: str):
        return getattr(self._traced, name)

    def lower(self, *args: Any, **kwargs: Any) -> Lowered:
        self._owner.stats["lowerings"] += 1
        return self._owner._lower(self._traced.lower(*args, **kwargs), self._owner.options)


@dataclass
class _Entry:
    compiled: Any
    lowered: Lowered
    _miss: Any = None

    def run(self, args: tuple, kwargs: dict) -> tuple:
        """Run the executable: ``(outputs, fast-path data or None, False)``, what jax's C++
        dispatcher caches (:func:`~cmatmul_pass._jax_private.cpp_dispatcher`)."""
        if self._miss is None:
            self._miss = executable_cache_miss(self.compiled) or self._without_fast_path
        return self._miss(*args, **kwargs)

    def _without_fast_path(self, *args: Any, **kwargs: Any) -> tuple:
        return self.compiled(*args, **kwargs), None, False


def rewrite_lowered(lowered: Any, options: Options, source: str) -> RewriteResult:
    """The pass on a ``jax.stages.Lowered``'s program, as :func:`jit` runs it: on a copy in
    jax's own context (the rewritten module is compiled there anyway, and a C++ clone costs a
    tenth of a copy into a context of the pass's own), never touching jax's cached module."""
    return rewrite_copy(lowered_module(lowered), options, source)


class JittedFunction:
    """The wrapped function.  Called, it runs in jax.jit's C++ dispatcher: a signature called
    before runs its executable with no Python work.  ``.report``: the report of the latest
    signature lowered or compiled (later calls leave it; ``.lower(*args).report`` is any
    signature's); ``.stats``: how often it traced+lowered, rewrote, compiled, checked and
    measured, and ``"misses"``, how many calls the dispatcher sent to Python (a signature's
    first call, calls under a JAX transformation, an executable without a fast path);
    ``.measurement`` (``variant="measure"``): the latest measured signature's times, noise and
    pick (:class:`Measurement`); ``.measured`` its median seconds per variant and for the
    original, and ``.picked`` the variant kept or ``"original"``."""

    def __init__(self, fun: Callable, options: Options, check: bool, jit_kwargs: dict, gpu_options: bool = True,
                 measure_runs: int = 0, strict: bool = False):
        # first, as jax.jit does: fun's attributes, then ours over them (a function jax.grad or
        # shard_map wrapped around a decorated one carries that one's attributes: _fun, _jitted, ...)
        functools.update_wrapper(self, fun)
        self._fun = fun
        self.strict = strict
        #: what a call under a JAX transformation stages (its ``.reports``: each lowered function's)
        self.overlap = Overlap(fun, options, strict)
        self._staged = jax.jit(self.overlap, **jit_kwargs)
        self._gpu_options = gpu_options
        self._user_compiler_options = dict(jit_kwargs.get("compiler_options") or {})
        self._jitted = jax.jit(fun, **jit_kwargs)
        self.options = options
        self.check = check
        self._static = _StaticArgs(fun, jit_kwargs.get("static_argnums"), jit_kwargs.get("static_argnames"))
        self._donates = bool(jit_kwargs.get("donate_argnums") or jit_kwargs.get("donate_argnames"))
        self._cache: dict = {}
        self.report: Report | None = None
        self.stats: Counter = Counter()
        self._measure_runs = measure_runs
        self._picked: dict = {}  # signature -> the variant measured fastest
        self.measured: dict[str, float] | None = None
        self.picked: str | None = None
        #: ``variant="measure"``: the latest measured signature's :class:`Measurement`
        self.measurement: Measurement | None = None
        #: ``check=True``: the latest check's :class:`execute.CheckResult`
        self.checked: execute.CheckResult | None = None
        #: jax.jit's C++ dispatcher: a signature called before runs its executable with no Python
        self._dispatch = cpp_dispatcher(getattr(fun, "__name__", "jit"), fun, self._cache_miss, self._jitted)

    def lower(self, *args: Any, **kwargs: Any) -> Lowered:
        """The rewritten lowering (under ``variant="measure"``: with the variant measured for
        this signature, once a call has measured it; the default ring before)."""
        picked = self._picked.get(self._key(args, kwargs)[0])
        original = self._jax_lower(args, kwargs)
        if picked == ORIGINAL:
            return Lowered(original, Report(getattr(self._fun, "__qualname__", "<jit>"), None), original)
        options = self.options.with_variant(picked) if picked else self.options
        return self._lower(original, options)

    def trace(self, *args: Any, **kwargs: Any) -> "Traced":
        """jax.jit's ``.trace``: ``.jaxpr``, ``.out_info`` ...; its ``.lower()`` is :meth:`lower`'s."""
        return Traced(self._jitted.trace(*args, **kwargs), self)

    def eval_shape(self, *args: Any, **kwargs: Any):
        return self._staged.eval_shape(*args, **kwargs)

    def clear_cache(self) -> None:
        """As ``jax.jit``'s: forget every signature's executable (the dispatcher's, the
        decorator's, and jax's lowerings of ``fun``); the next call of each lowers, rewrites and
        compiles again."""
        self._dispatch._clear_cache()
        self._cache.clear()
        self._picked.clear()
        self._jitted.clear_cache()
        self._staged.clear_cache()

    def _jax_lower(self, args: tuple, kwargs: dict):
        self.stats["lowerings"] += 1
        return self._jitted.lower(*args, **kwargs)

    def _lower(self, original: Any, options: Options) -> Lowered:
        source = getattr(self._fun, "__qualname__", "<jit>")
        try:
            result = rewrite_lowered(original, options, source)
            rewritten = lowered_with_module(original, result.module)
        except Exception as failure:  # noqa: BLE001 - any failure of the pass (a matcher's bug too)
            self._fall_back(failure, f"the pass failed on {source}")
            return Lowered(original, Report(source, None), original)
        self.stats["rewrites"] += 1
        report = self.report = self._noted(result, source)
        extra = {}
        if self._gpu_options:
            extra = ring_compiler_options(report, jax.default_backend(),
                                          self._user_compiler_options, os.environ.get("XLA_FLAGS", ""))
        return Lowered(rewritten, report, original, extra)

    def _noted(self, result: RewriteResult, source: str) -> Report:
        """``result``'s report, with what the command line says of a module with no candidate
        site (:class:`JitReport`); a program jax.jit shards by itself over several devices (no
        shard_map region) also gets one warning per function, naming XLA's own flags."""
        from .cli import WINDOWED_EINSUM_FLAGS, module_notes

        notes = module_notes(result)
        if not notes:
            return result.report
        if (result.report.num_partitions or 1) > 1 and any(WINDOWED_EINSUM_FLAGS in note for note in notes):
            self.overlap.warn_once("auto-sharded", f"cmatmul_pass.jit: {source}: 0 of 0 candidate site(s) "
                                   f"rewritten: {notes[0]}")
        return JitReport.of(result.report, notes)

    def _key(self, args: tuple, kwargs: dict) -> tuple:
        dynamic_args, dynamic_kwargs, statics = self._static.split(args, kwargs)
        # (jax's configuration too: under jax.enable_x64() a call is another program, as under jax.jit)
        return (statics, _signature((dynamic_args, dynamic_kwargs)), trace_context()), dynamic_args, dynamic_kwargs

    def _fall_back(self, failure: Exception, what: str) -> None:
        """The original program runs instead of the rewrite (``strict``: raise ``failure``)."""
        if self.strict:
            raise failure
        self.stats["fallbacks"] += 1
        self.overlap.warn_once(f"{what}: {failure}", f"cmatmul_pass.jit: {what} ({type(failure).__name__}: "
                               f"{failure}); running the original program (strict=True raises)")

    def _compile(self, lowered: Lowered):
        """``lowered.compile()``, or the original's where XLA rejects the rewritten module."""
        try:
            return lowered.compile()
        except Exception as failure:  # XLA's errors have no common public type across versions
            if lowered._lowered is lowered.original:
                raise
            sites = "; ".join(f"{s.kind} at {s.location}" for s in lowered.report.rewritten)
            self._fall_back(failure, f"XLA rejected the rewritten program (rewritten sites: {sites or 'none'})")
            lowered.report = Report(lowered.report.source, lowered.report.num_partitions)
            lowered._lowered = lowered.original
            return lowered.original.compile()

    def __call__(self, *args: Any, **kwargs: Any):
        return self._dispatch(*args, **kwargs)

    def _cache_miss(self, *args: Any, **kwargs: Any) -> tuple:
        """What the C++ dispatcher calls where it has no executable for a call: under a JAX
        transformation, the staged call; else the signature's entry (lowered, rewritten,
        compiled, measured and checked on its first call) run, with its fast-path data, which
        the dispatcher keeps for the next call of the signature (``(outputs, fast-path data or
        None, False)``)."""
        self.stats["misses"] += 1
        if under_trace():
            return self._staged(*args, **kwargs), None, False
        key, dynamic_args, dynamic_kwargs = self._key(args, kwargs)
        entry = self._cache.get(key)
        if entry is None:
            if self._measure_runs:
                entry = self._measure(key, args, kwargs, dynamic_args, dynamic_kwargs)
            else:
                lowered = self.lower(*args, **kwargs)
                entry = _Entry(self._compile(lowered), lowered)
                self.stats["compiles"] += 1
            if jax.process_count() > 1:
                _assert_same_program(entry.lowered, getattr(self._fun, "__qualname__", "function"))
            self._cache[key] = entry
            self.report = entry.lowered.report
            if self.check:
                return self._checked(key, entry, dynamic_args, dynamic_kwargs), None, False
        self.report = entry.lowered.report
        return entry.run(dynamic_args, dynamic_kwargs)

    def _measure(self, key: tuple, args: tuple, kwargs: dict, dynamic_args: tuple, dynamic_kwargs: dict) -> _Entry:
        """Compile every variant and the original, time them in turn on this call's inputs, keep
        the fastest variant if it beats the original by more than the noise, else the original
        (:func:`choose`)."""
        original = self._jax_lower(args, kwargs)
        entries = {}
        compile_s: dict[str, float] = {}
        programs: dict[str, Callable] = {}

        def compiled(name: str, compile_: Callable):
            start = time.perf_counter()
            out = compile_()
            compile_s[name] = time.perf_counter() - start
            return out

        for name in VARIANTS:
            lowered = self._lower(original, self.options.with_variant(name))
            if not lowered.report.rewritten and all(s.reason_code not in ("policy", "compile_budget")
                                                    for s in lowered.report.sites):
                # no ring, and only declines no variant changes (the policy's depend on it): nothing to choose
                self.stats["compiles"] += 1
                self.measured, self.picked, self.measurement = None, None, None
                return _Entry(self._compile(lowered), lowered)
            if ORIGINAL not in programs:  # first: XLA's own start is the original's to pay
                programs[ORIGINAL] = compiled(ORIGINAL, original.compile)
            entries[name] = _Entry(compiled(name, lambda: self._compile(lowered)), lowered)
            self.stats["compiles"] += 1
        programs.update((name, entry.compiled) for name, entry in entries.items())

        def prepare():  # a program may donate its inputs: each run gets its own copies
            if not self._donates:
                return dynamic_args, dynamic_kwargs
            return jax.block_until_ready(jax.tree.map(_copy, (dynamic_args, dynamic_kwargs)))

        samples: dict[str, list[float]] = {name: [] for name in programs}

        def timed(name: str, run: Callable) -> Callable:
            def call(given):
                start = time.perf_counter()
                jax.block_until_ready(run(*given[0], **given[1]))
                samples[name].append(time.perf_counter() - start)
            return call

        medians = execute.interleaved_medians({name: timed(name, run) for name, run in programs.items()},
                                              self._measure_runs, warmup=1, prepare=prepare)
        runs = samples[ORIGINAL][1:]  # the warm-up's run left out
        noise = max(runs) - min(runs) if runs else 0.0
        medians, noise, compile_s = _slowest_process(medians, noise, compile_s)
        self.stats["measurements"] += 1
        picked = choose(medians, noise)
        self.measurement = Measurement(medians, noise, picked, jax.process_count(),
                                       {name: tuple(times[1:]) for name, times in samples.items()}, compile_s)
        self.measured, self.picked = medians, picked
        self._picked[key] = picked
        if picked != ORIGINAL:
            return entries[picked]
        self.stats["kept_original"] += 1
        timed_report = next(iter(entries.values())).lowered.report
        report = Report(timed_report.source, timed_report.num_partitions)  # nothing rewritten
        return _Entry(programs[ORIGINAL], Lowered(original, report, original))

    def _checked(self, key: tuple, entry: _Entry, args: tuple, kwargs: dict):
        """Judge the rewrite on this call's inputs (:func:`~cmatmul_pass.jit_check.check_call`:
        original and rewrite compiled without excess precision, float outputs judged against the
        original evaluated in f64, or, for a program that calls back into Python, both run
        through jax's dispatch); then run the program the caller gets.  A program the check
        cannot compare runs unchecked, with one warning; where the check itself fails, the
        original program runs instead (``strict``: raise).  Over several processes all agree."""
        name = getattr(self._fun, "__qualname__", "function")
        self.checked = None
        try:
            self.checked = check_call(entry.lowered, args, kwargs, name, self._donates)
        except NumericsMismatch as mismatch:
            self.stats["checks"] += 1
            self.checked = getattr(mismatch, "result", None)
            raise
        except execute.CannotCheck as why:
            if self.strict:
                raise
            self.stats["unchecked"] += 1
            self.overlap.warn_once(f"check: {why}", f"cmatmul_pass.jit: check=True could not check {name} "
                                   f"({why}); running the rewritten program unchecked (strict=True raises)")
        except Exception as failure:  # noqa: BLE001 - a bug of the check: never worse than jax.jit
            self._fall_back(failure, f"check=True failed on {name}")
            entry = self._cache[key] = self._original_entry(entry)
            self.report = entry.lowered.report
        else:
            self.stats["checks"] += 1
            if not self.checked.complete:  # outputs the original itself leaves inf/NaN: not judged
                unchecked = self.checked.unchecked
                self.overlap.warn_once(
                    f"domain: {name}", f"cmatmul_pass.jit: check=True could not check output(s) "
                    f"{', '.join(str(o.index) for o in unchecked)} of {name} on this call's arguments "
                    f"({unchecked[0].outside}): outside the program's domain, not judged; no mismatch elsewhere")
        return entry.compiled(*args, **kwargs)

    def _original_entry(self, entry: _Entry) -> _Entry:
        """``entry``'s signature with jax's own program (nothing rewritten)."""
        original = entry.lowered.original
        report = Report(entry.lowered.report.source, entry.lowered.report.num_partitions)
        self.stats["compiles"] += 1
        return _Entry(original.compile(), Lowered(original, report, original))


class DifferentPrograms(RuntimeError):
    """Processes of one ``jax.distributed`` job compiled different programs for one call: their
    collectives would hang or mix data."""


# ------------------------------------------------------------------ several processes (jax.distributed)
# Every function here is a collective over the processes: each must call it at the same point.


def _slowest_process(medians: dict[str, float], noise: float, compile_s: dict[str, float]
                     ) -> tuple[dict[str, float], float, dict[str, float]]:
    """Each candidate's time and compile time on its slowest process and the largest noise: the
    same numbers, hence the same choice and summary, on every process (unchanged with one)."""
    if jax.process_count() == 1:
        return medians, noise, compile_s
    names = sorted(medians)  # the same order everywhere
    rows = gathered(np.array([medians[n] for n in names] + [compile_s.get(n, 0.0) for n in names] + [noise],
                             np.float32))
    worst = rows.max(axis=0)
    k = len(names)
    return ({n: float(t) for n, t in zip(names, worst[:k])}, float(worst[-1]),
            {n: float(t) for n, t in zip(names, worst[k:2 * k]) if n in compile_s})


def _assert_same_program(lowered: Lowered, name: str) -> None:
    """Raise :class:`DifferentPrograms` on every process unless all hold the same module
    (a hash of its text: a variant, a fallback or a cost profile chosen differently shows)."""
    digest = hashlib.sha256(lowered.as_text().encode()).digest()
    rows = gathered(np.frombuffer(digest, np.uint8).astype(np.int32))
    differ = [p for p in range(len(rows)) if not np.array_equal(rows[p], rows[0])]
    if differ:
        raise DifferentPrograms(
            f"cmatmul_pass.jit: {name}: process(es) {differ} compiled a different program from process 0 "
            f"(sha256 of the rewritten module differs); running them would hang or mix data. Give every "
            f"process the same options, jax version and hardware profile (hardware='h100', not 'auto', on "
            f"mixed hosts)")


def _copy(x):
    """A copy of a jax array (an input a program may donate); anything else as it is."""
    return x.copy() if isinstance(x, jax.Array) else x


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
        if not self.argnums and not self.argnames:  # the usual case, on every call: nothing to split
            return args, kwargs, ((), ())
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
    weak type and (for arrays) sharding.  Computed on every call, so made of values whose
    hashing and comparison run in C (about 1 µs a leaf; the aval's text took 7)."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple(map(_leaf_key, leaves))


def _leaf_key(x) -> tuple:
    if isinstance(x, jax.Array):  # a concrete array's aval is its shape, dtype and weak type
        # (typed PRNG key arrays have no weak type: their dtype is the key's)
        return (x.shape, x.dtype, getattr(x, "weak_type", False), x.sharding)
    if isinstance(x, np.ndarray | np.generic):
        return ("numpy", x.shape, x.dtype)
    if is_ref(x):  # a mutable array reference (jax.new_ref): its value's type and sharding
        return ("ref", x.shape, x.dtype, x.sharding)
    return ("python", type(x))
