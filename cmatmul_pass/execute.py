"""Compile and run original and rewritten modules on CPU devices; compare their outputs.

Inputs are random arrays of the entry function's global shapes, distributed with the
shardings the compiled program declares for its parameters (so a module whose
arguments carry ``sdy.sharding`` / ``mhlo.sharding`` gets exactly those layouts;
replicated where none).  Outputs are compared shard by shard on every device, so a
rewrite that is right on one device and wrong on another cannot hide.
"""

from __future__ import annotations

import functools
import math
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace

import ml_dtypes
import numpy as np

from . import cpu_copy, ir_utils, numerics
from ._jax_private import compile_module, ir, sharding_for_devices
from .errors import ExecutionError
from .reference import NoReference, demote_to_f32, promote_to_f64

#: The 8-bit floats (MLIR's names), whose dots XLA runs on CPU: inputs of fp8 matmuls.
_FLOAT8 = {
    "f8E4M3FN": ml_dtypes.float8_e4m3fn,
    "f8E5M2": ml_dtypes.float8_e5m2,
    "f8E4M3FNUZ": ml_dtypes.float8_e4m3fnuz,
    "f8E5M2FNUZ": ml_dtypes.float8_e5m2fnuz,
    "f8E4M3B11FNUZ": ml_dtypes.float8_e4m3b11fnuz,
}

#: Normwise relative tolerance per float dtype: max|a-b| / max|a| must not exceed it.
#: A rewritten dot computes each output element from the same products as the
#: original, so only accumulation order (CPU tiling) differs: a few ulps of the
#: accumulator for f32/f64, one rounding of the stored result for 16-bit types, and
#: for 8-bit ones (each is its machine epsilon, one ulp at 1.0: both results are the
#: nearest to nearly the same sum).  A complex output takes its parts' tolerance.
FLOAT_TOLERANCES = {"f64": 1e-12, "f32": 1e-5, "f16": 2e-3, "bf16": 1e-2,
                    "complex<f64>": 1e-12, "complex<f32>": 1e-5,
                    **{name: float(ml_dtypes.finfo(t).eps) for name, t in _FLOAT8.items()}}

#: The XLA options the numerics check compiles both programs with.  By default XLA may keep a
#: value of a type narrower than f32 (bf16, f16) in f32 where it fuses the op that makes it
#: with the op that reads it (``xla_allow_excess_precision``), and a rewrite changes what fuses
#: with what: bf16 shards scaled by 3 before an f32-accumulating dot came out rounded to bf16
#: in one program and not in the other, a bf16 ulp (2e-3) apart in f32 outputs, in the plain
#: ring as well as with ``--annotate-streams``.  With it off every op rounds to its own type,
#: as the StableHLO says, in both programs, and those outputs agree to f32's tolerance.
CHECK_COMPILER_OPTIONS = {"xla_allow_excess_precision": False}

#: Ops whose sum across devices a rewrite may reorder (a scatter ring adds the partial sums
#: in ring order; the collective in an order of its own).
_CROSS_DEVICE_SUMS = ("stablehlo.reduce_scatter", "stablehlo.all_reduce")

_NUMPY_DTYPES = {
    "f64": np.float64,
    "f32": np.float32,
    "f16": np.float16,
    "bf16": ml_dtypes.bfloat16,
    **_FLOAT8,
    "complex<f64>": np.complex128,
    "complex<f32>": np.complex64,
    "i1": np.bool_,
    "i8": np.int8,
    "i16": np.int16,
    "i32": np.int32,
    "i64": np.int64,
    "ui8": np.uint8,
    "ui16": np.uint16,
    "ui32": np.uint32,
    "ui64": np.uint64,
}


class CannotCheck(ExecutionError):
    """The check cannot compare the programs (an output or input kind it does not handle)."""


@dataclass(frozen=True)
class OutputComparison:
    """One output of the original and of the rewrite, compared on every device.

    Judged against the original evaluated in f64 (``original_error`` set; :mod:`.numerics`):
    ``rel_error`` is the rewritten output's normwise error against that reference and
    ``tolerance`` what it may be (``FACTOR`` times the original's plus a floor).  Without a
    reference (the fixed-tolerance fallback, :func:`compare`): ``rel_error`` is
    ``max|a-b| / max|a|`` and ``tolerance`` the dtype's.  Exact outputs (integers, bools):
    ``tolerance`` 0.0 and ``max_abs_error`` must be 0."""

    index: int
    dtype: str
    shape: tuple[int, ...]
    max_abs_error: float  # max |rewritten - original| where both are finite; inf: a non-finite mismatch
    rel_error: float
    tolerance: float  # 0.0 means exact
    original_error: float | None = None  # the original's normwise error against the f64 reference
    nonfinite: int = 0  # elements the original leaves inf or NaN
    elements: int = 0  # elements per device times devices
    #: why the output is outside the program's domain on these inputs (numerics.outside_domain):
    #: not judged, neither agreement nor a mismatch; '' where it is judged
    outside: str = ""

    @property
    def ok(self) -> bool:
        """No mismatch (an output outside the domain is not judged: never a mismatch)."""
        if self.outside:
            return True
        if self.max_abs_error == math.inf:
            return False
        return self.rel_error <= self.tolerance if self.tolerance else self.max_abs_error == 0

    @property
    def ratio(self) -> float | None:
        """The rewritten output's error over the original's (against the f64 reference)."""
        if self.original_error is None:
            return None
        if self.original_error > 0:
            return self.rel_error / self.original_error
        return 0.0 if self.rel_error == 0 else math.inf

    @property
    def status(self) -> str:
        """``ok``, ``MISMATCH``, or ``not checked``: outside the program's domain on these
        inputs (``outside`` says why), neither agreement nor a mismatch."""
        if self.outside:
            return "not checked"
        return "ok" if self.ok else "MISMATCH"

    def line(self) -> str:
        head = f"output {self.index} {self.dtype}{list(self.shape)}: "
        if self.outside:
            return (f"{head}not checked: {self.outside}; where both are finite, max abs err {self.max_abs_error:.2e}, "
                    f"rel err {self.rel_error:.2e} (not judged)")
        if not self.tolerance:
            body = f"max abs err {self.max_abs_error:.3e} (exact)"
        elif self.original_error is None:
            body = (f"max abs err {self.max_abs_error:.3e}, rel err {self.rel_error:.3e} "
                    f"(rel tol {self.tolerance:g}, no f64 reference)")
        else:
            ratio = self.ratio
            body = (f"rel err vs f64: original {self.original_error:.2e}, rewritten {self.rel_error:.2e}, "
                    f"ratio {ratio:.2f} (allowed {self.tolerance:.2e}); max abs err vs the original "
                    f"{self.max_abs_error:.2e}")
        return head + body + f" {self.status}"

    def to_dict(self) -> dict:
        return dict(asdict(self), shape=list(self.shape), ok=self.ok, ratio=self.ratio, status=self.status)


@dataclass(frozen=True)
class CheckResult:
    outputs: tuple[OutputComparison, ...]
    num_partitions: int
    #: what float outputs were judged against: "f64" (the original promoted), else why not
    reference: str = "f64"
    #: how the inputs were drawn where random normal ones left the original outside its domain
    #: (:mod:`.domain`'s rules); '' for inputs as drawn or given
    inputs: str = ""
    #: XLA's compile of the original and of the rewritten module, seconds (each compiled once,
    #: with the check's options, on the devices the check runs on; XLA warmed up first), where
    #: the check compiled both
    compile_s: tuple[float, float] | None = None

    @property
    def compile_ratio(self) -> float | None:
        """The rewritten module's compile time over the original's (None: not measured)."""
        if not self.compile_s or self.compile_s[0] <= 0:
            return None
        return self.compile_s[1] / self.compile_s[0]

    @property
    def ok(self) -> bool:
        """No output differs (outputs outside the program's domain are not judged)."""
        return all(o.ok for o in self.outputs)

    @property
    def complete(self) -> bool:
        """Every output was judged (none outside the program's domain on these inputs)."""
        return not any(o.outside for o in self.outputs)

    @property
    def unchecked(self) -> list["OutputComparison"]:
        """The outputs outside the program's domain on these inputs (not judged)."""
        return [o for o in self.outputs if o.outside]

    def to_dict(self) -> dict:
        return {
            "ok": self.ok,
            "complete": self.complete,
            "num_partitions": self.num_partitions,
            "reference": self.reference,
            "inputs": self.inputs,
            "factor": numerics.FACTOR,
            "outputs": [o.to_dict() for o in self.outputs],
            "compile_s": None if self.compile_s is None else {
                "original": self.compile_s[0], "rewritten": self.compile_s[1], "ratio": self.compile_ratio},
        }

    def compile_line(self) -> str:
        """One line: both modules' XLA compile times and their ratio; '' where not measured."""
        if self.compile_ratio is None:
            return ""
        before, after = self.compile_s
        return (f"compile: original {before:.2f} s, rewritten {after:.2f} s ({self.compile_ratio:.2f}x; XLA on "
                f"these {self.num_partitions} devices, one compile each)")

    def format(self) -> str:
        lines = [o.line() for o in self.outputs]
        if self.inputs:
            lines.append(f"inputs: {self.inputs}")
        if not self.ok:
            verdict = "numerics: MISMATCH"
        elif not self.complete:
            outputs = ", ".join(str(o.index) for o in self.unchecked)
            verdict = (f"numerics: INCOMPLETE (no mismatch; output(s) {outputs} not checked: outside the "
                       "program's domain on these inputs)")
        else:
            verdict = "numerics: OK"
        against = "an f64 evaluation of the original" if self.reference == "f64" else \
            f"fixed tolerances ({self.reference})"
        lines.append(f"{verdict} ({len(self.outputs)} output(s), {self.num_partitions} partitions; floats judged "
                     f"against {against})")
        compiled = self.compile_line()
        return "\n".join(lines + ([compiled] if compiled else []))


#: ``custom_call`` targets through which jax calls back into Python (``jax.debug.print``,
#: ``pure_callback``, ``io_callback``; FFI and legacy, CPU and GPU): such a module runs only
#: through jax's dispatch, which hands the executable the Python functions it calls
_HOST_CALLBACK_TARGET = ("python_cpu_callback", "python_gpu_callback", "python_callback")


def host_callback_target(module: ir.Module) -> str | None:
    """The target of the first ``custom_call`` of ``module`` that calls back into Python
    (``xla_ffi_python_cpu_callback``, ...), else None."""
    for op in ir_utils.ops_named(module.operation, "stablehlo.custom_call")["stablehlo.custom_call"]:
        target = ir.StringAttr(op.attributes["call_target_name"]).value
        if any(target.endswith(name) for name in _HOST_CALLBACK_TARGET):
            return target
    return None


def refuse_host_callbacks(module: ir.Module) -> None:
    """Raise :class:`CannotCheck` where ``module`` calls back into Python: run outside jax, its
    callbacks would find no Python function to call (a crash, not an error)."""
    target = host_callback_target(module)
    if target is not None:
        raise CannotCheck(f"the module calls back into Python (custom_call @{target}): it runs only inside "
                          "the JAX program that defines the callback")


def entry_function(module: ir.Module) -> ir.OpView:
    """The public ``main`` (what jax.jit and jax.export produce), else the only public function."""
    funcs = [op for op in module.body.operations if op.operation.name == "func.func"]
    public = [f for f in funcs if "sym_visibility" not in f.attributes
              or ir.StringAttr(f.attributes["sym_visibility"]).value == "public"]
    for f in public:
        if ir.StringAttr(f.attributes["sym_name"]).value == "main":
            return f
    if len(public) == 1:
        return public[0]
    raise ExecutionError("cannot find the entry function (a public func.func @main)")


def numpy_dtype(element_type: ir.Type):
    name = str(element_type)
    if name not in _NUMPY_DTYPES:
        raise ExecutionError(f"cannot make random inputs of element type {name}")
    return np.dtype(_NUMPY_DTYPES[name])


def random_inputs(module: ir.Module, seed: int = 0) -> list[np.ndarray]:
    """One random array per entry-function argument (normal floats and complex parts, small
    ints, coin-flip bools)."""
    rng = np.random.default_rng(seed)
    arrays = []
    for arg in entry_function(module).regions[0].blocks[0].arguments:
        t = ir_utils.ranked_tensor(arg)
        if t is None or not ir_utils.is_static(t):
            raise ExecutionError(f"cannot make inputs for an argument of type {arg.type}")
        dtype = numpy_dtype(t.element_type)
        shape = tuple(t.shape)
        if dtype == np.bool_:
            arrays.append(rng.integers(0, 2, shape).astype(np.bool_))
        elif np.issubdtype(dtype, np.integer):
            arrays.append(rng.integers(0, 8, shape).astype(dtype))
        elif dtype.kind == "c":
            arrays.append((rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype))
        else:
            arrays.append(rng.standard_normal(shape).astype(dtype))
    return arrays


def as_module_inputs(module: ir.Module, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
    """``arrays`` (one per entry-function argument) in the element types the arguments have (a
    Python float jax traced as f32 comes as an f64 array)."""
    params = entry_function(module).regions[0].blocks[0].arguments
    if len(params) != len(arrays):
        raise CannotCheck(f"the module takes {len(params)} arguments, {len(arrays)} were given")
    converted = []
    for arg, x in zip(params, arrays):
        t = ir_utils.ranked_tensor(arg)
        if t is None:
            raise CannotCheck(f"an argument of type {arg.type} cannot be given")
        converted.append(np.asarray(x).astype(numpy_dtype(t.element_type), copy=False))
    return converted


def load_inputs(module: ir.Module, path: str) -> list[np.ndarray]:
    """The entry function's arguments from an ``.npz``: arrays named ``arg0``, ``arg1``, ... or,
    without those names, in the file's order; each of the argument's shape, converted to its
    element type.  Raises :class:`InputError` naming the file."""
    from .errors import InputError

    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {name: npz[name] for name in npz.files}
    except (OSError, ValueError) as exc:
        raise InputError(path, f"cannot read the inputs as an .npz: {exc}") from None
    params = entry_function(module).regions[0].blocks[0].arguments
    names = [f"arg{i}" for i in range(len(params))]
    ordered = [arrays[n] for n in names] if set(names) <= set(arrays) else list(arrays.values())
    if len(ordered) != len(params):
        raise InputError(path, f"holds {len(ordered)} arrays; the module takes {len(params)} arguments")
    for i, (arg, x) in enumerate(zip(params, ordered)):
        t = ir_utils.ranked_tensor(arg)
        if t is not None and tuple(t.shape) != x.shape:
            raise InputError(path, f"argument {i} is {list(x.shape)}; the module takes {arg.type}")
    try:
        return as_module_inputs(module, ordered)
    except (CannotCheck, ExecutionError, ValueError) as exc:
        raise InputError(path, str(exc)) from None


def cpu_devices(count: int) -> list:
    import jax

    devices = jax.devices("cpu")
    if len(devices) < count:
        raise ExecutionError(
            f"the module needs {count} partitions but only {len(devices)} CPU devices exist; set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={count} before jax is imported"
        )
    return devices[:count]


class Program:
    """``module`` compiled for ``len(devices)`` partitions, with ``inputs`` placed on the devices
    as the program's parameter shardings say: ready to run any number of times (:meth:`place`
    puts other inputs in their place; ``inputs`` None: none yet).
    ``compiler_options``: XLA options for the compile (``decorator.ring_compiler_options``);
    ``compile_s``: the wall time XLA took to compile it."""

    def __init__(self, module: ir.Module, inputs: Sequence[np.ndarray] | None, devices: Sequence,
                 compiler_options: dict | None = None):
        refuse_host_callbacks(module)
        if devices and devices[0].platform == "cpu":  # a GPU-lowered module's grouped matmuls and composites
            module = cpu_copy.for_cpu(module)
        start = time.perf_counter()
        try:
            self.executable = compile_module(module, len(devices), devices, compiler_options)
        except Exception as exc:  # XLA raises its own runtime error types
            raise ExecutionError(f"XLA could not compile the module: {' '.join(str(exc).split())[:500]}") from exc
        self.compile_s = time.perf_counter() - start
        self.devices = list(devices)
        self.args: list = []
        if inputs is not None:
            self.place(inputs)

    def place(self, inputs: Sequence[np.ndarray]) -> "Program":
        """Put ``inputs`` on the devices as the program's parameter shardings say (replacing any
        placed before)."""
        import jax

        devices = self.devices
        shardings = self.executable.get_parameter_shardings()
        if shardings is None and len(devices) == 1:  # a module without shardings, on one device
            with jax.enable_x64(True):
                self.args = [jax.device_put(x, devices[0]) for x in inputs]
            return self
        if shardings is None or len(shardings) != len(inputs):
            raise ExecutionError(f"the program takes {len(shardings or ())} parameters, got {len(inputs)} inputs")
        with jax.enable_x64(True):  # else jax would place f64/i64/complex128 inputs as 32-bit arrays
            try:
                self.args = [jax.device_put(x, sharding_for_devices(devices, s)) for x, s in zip(inputs, shardings)]
            except NotImplementedError as exc:  # jax cannot lay out some shardings (unreduced ones)
                raise CannotCheck(f"cannot lay out the inputs with the program's shardings: {exc}") from None
        return self

    def __call__(self) -> list[list]:
        """Run once and wait for it: per output, per device, a shard (device arrays)."""
        outputs = self.executable.execute_sharded(self.args).disassemble_into_single_device_arrays()
        for shards in outputs:
            for shard in shards:
                shard.block_until_ready()
        return outputs

    def outputs(self) -> list[list[np.ndarray]]:
        return [[np.asarray(shard) for shard in per_output] for per_output in self()]


def run(module: ir.Module, inputs: Sequence[np.ndarray], devices: Sequence) -> list[list[np.ndarray]]:
    """Compile ``module`` for ``len(devices)`` partitions and run it: per output, per device, a shard."""
    return Program(module, inputs, devices).outputs()


def interleaved_samples(programs: dict[str, Callable], runs: int, warmup: int = 1,
                        prepare: Callable[[], object] | None = None) -> dict[str, list[float]]:
    """Wall times of each program (each call must wait for its results), timed round by round:
    every round runs each program once, in an order drawn afresh each round, so that the k-th
    time of every program comes from the same round.
    A drift of the machine's speed (other load, frequency) then falls on all programs alike,
    which separate blocks of runs would charge to whichever ran at the time; and no program
    always follows the same one (a rotation keeps each program's predecessor: on 8 CPU
    devices the program after the plain collective runs 3-7 % slower than itself timed after
    another, in an A/A control).  The orders come from a fixed
    seed: every process of a multi-process run times the programs in the same order (their
    collectives must be issued alike).  ``prepare``: called untimed before every call, its
    result passed to the program (fresh copies of inputs a program donates, say); without it
    programs take no argument."""
    names = list(programs)
    orders = random.Random(0)

    def call(name: str) -> float:
        given = () if prepare is None else (prepare(),)
        start = time.perf_counter()
        programs[name](*given)
        return time.perf_counter() - start

    for name in names:
        for _ in range(warmup):
            call(name)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(runs):
        for name in orders.sample(names, len(names)):
            samples[name].append(call(name))
    return samples


def interleaved_medians(programs: dict[str, Callable], runs: int, warmup: int = 1,
                        prepare: Callable[[], object] | None = None) -> dict[str, float]:
    """The median of each program's :func:`interleaved_samples`."""
    samples = interleaved_samples(programs, runs, warmup, prepare)
    return {name: statistics.median(times) for name, times in samples.items()}


def _round_ratios(numerator: list[float], denominator: list[float]) -> np.ndarray:
    """``numerator[k] / denominator[k]``: two programs' times from the same rounds."""
    top, bottom = np.asarray(numerator, dtype=float), np.asarray(denominator, dtype=float)
    if top.shape != bottom.shape or top.size == 0:
        raise ValueError("the two programs' times must come from the same rounds")
    return top / bottom


def paired_ratio(numerator: list[float], denominator: list[float]) -> float:
    """The median of the per-round ratios ``numerator[k] / denominator[k]`` of two programs'
    :func:`interleaved_samples` (the estimate :func:`ratio_interval` brackets)."""
    return float(np.median(_round_ratios(numerator, denominator)))


def ratio_interval(numerator: list[float], denominator: list[float], level: float = 0.95,
                   resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """A bootstrap interval of the median of the per-round ratios ``numerator[k] /
    denominator[k]``, two programs' :func:`interleaved_samples` (the k-th times of both come
    from one round, one state of the machine, whose drift the ratio cancels): the rounds are
    drawn with replacement, and the ``level`` percentile interval is returned.  It holds 1.0
    where the run cannot tell the two programs apart."""
    ratios = _round_ratios(numerator, denominator)
    rounds = np.random.default_rng(seed).integers(0, ratios.size, size=(resamples, ratios.size))
    tail = 100 * (1 - level) / 2
    low, high = np.percentile(np.median(ratios[rounds], axis=1), [tail, 100 - tail])
    return float(low), float(high)


def reduction_tolerance(module: ir.Module) -> float:
    """The normwise tolerance a module's float outputs need beyond their type's when it sums
    16-bit floats (f16, bf16) across devices: each of a sum's n-1 additions over n partitions
    rounds to that type, in an order the collective and a ring choose differently.  Taken as
    ``2 sqrt(n-1) eps`` of that type, the typical spread of n-1 independent roundings on each
    side (not a worst-case bound).  0.0 where the module sums nothing narrower than f32
    across devices; sums in 8-bit floats get none (their eps would make the check vacuous)."""
    n = ir_utils.int_attr(module.operation, "mhlo.num_partitions") or 1
    widest = 0.0
    for ops in ir_utils.ops_named(module, *_CROSS_DEVICE_SUMS).values():
        for op in ops:
            element = ir.RankedTensorType(op.operation.results[0].type).element_type
            if isinstance(element, (ir.F16Type, ir.BF16Type)):
                eps = float(ml_dtypes.finfo(numpy_dtype(element)).eps)
                widest = max(widest, 2 * math.sqrt(n - 1) * eps)
    return widest


def compare(index: int, expected: list[np.ndarray], actual: list[np.ndarray],
            extra_tolerance: float = 0.0, exact: list[np.ndarray] | None = None,
            model: numerics.ErrorModel | None = None, demoted: list[np.ndarray] | None = None) -> OutputComparison:
    """One output, original (``expected``) against rewritten (``actual``), per device.

    ``exact``: the output of the original evaluated in f64 (:mod:`.reference`), with the
    module's ``model``: float outputs are then judged by :func:`numerics.judge_float`.
    Without it (the fallback), by the dtype's fixed normwise tolerance, at least
    ``extra_tolerance`` (:func:`reduction_tolerance`)."""
    a = np.stack(expected)
    b = np.stack(actual)
    name = _dtype_name(a.dtype)
    shape, elements = tuple(a.shape[1:]), int(a.size)
    if a.shape != b.shape or a.dtype != b.dtype:
        return OutputComparison(index, f"{name} vs {_dtype_name(b.dtype)}", shape, math.inf, math.inf, 0.0,
                                elements=elements)
    if name not in FLOAT_TOLERANCES:  # integers and bools: exact
        diff = np.abs(a.astype(np.int64) - b.astype(np.int64)) if a.size else np.zeros(1)
        err = float(diff.max()) if diff.size else 0.0
        return OutputComparison(index, name, shape, err, err, 0.0, elements=elements)
    wide = np.complex128 if a.dtype.kind == "c" else np.float64
    a64, b64 = a.astype(wide), b.astype(wide)
    a_finite = np.isfinite(a64)
    finite = a_finite & np.isfinite(b64)
    nonfinite = int(np.count_nonzero(~a_finite))
    outside = numerics.outside_domain(a64, name, model or numerics.ErrorModel(), b64)
    if outside:  # on these inputs the output says nothing about the rewrite: not judged, only described
        diff = np.abs(a64[finite] - b64[finite])
        max_abs = float(diff.max()) if diff.size else 0.0
        scale = float(np.abs(a64[finite]).max()) if finite.any() else 0.0
        elsewhere = int(np.count_nonzero(~((a64 == b64) | (np.isnan(a64) & np.isnan(b64))) & ~finite))
        if elsewhere:
            outside += f" (the rewrite differs in {elsewhere} of the elements either leaves inf/NaN)"
        return OutputComparison(index, name, shape, max_abs, max_abs / scale if scale > 0 else max_abs,
                                FLOAT_TOLERANCES[name], None, nonfinite, elements, outside)
    # the original is finite throughout: the rewrite must be too
    if not finite.all():
        max_abs = math.inf
    else:
        diff = np.abs(a64 - b64)
        max_abs = float(diff.max()) if diff.size else 0.0
    if exact is not None:
        verdict = numerics.judge_float(a64, b64, np.stack(exact), name, model or numerics.ErrorModel(),
                                       None if demoted is None else np.stack(demoted))
        rel = math.inf if max_abs == math.inf else verdict.rewritten_error
        return OutputComparison(index, name, shape, max_abs, rel, verdict.tolerance, verdict.original_error,
                                nonfinite, elements)
    magnitudes = np.abs(a64[a_finite])
    scale = float(magnitudes.max()) if magnitudes.size else 0.0
    rel = max_abs / scale if scale > 0 else max_abs
    return OutputComparison(index, name, shape, max_abs, rel, max(FLOAT_TOLERANCES[name], extra_tolerance),
                            None, nonfinite, elements)


def _dtype_name(dtype: np.dtype) -> str:
    for name, np_type in _NUMPY_DTYPES.items():
        if np.dtype(np_type) == dtype:
            return name
    return str(dtype)


@dataclass(frozen=True)
class Reference:
    """The original program's outputs on fixed inputs, to compare several rewrites against,
    and the original evaluated in f64 on the same inputs (``exact``), what float outputs are
    judged against (:mod:`.numerics`).

    Both the original and every rewrite it checks are compiled with ``compiler_options``
    (:data:`CHECK_COMPILER_OPTIONS`: no excess precision), so that they differ only where the
    rewrite computes something else, not where XLA fused them differently."""

    inputs: list
    expected: list
    devices: list
    num_partitions: int
    #: the compiled original, with its inputs placed (compiled with ``compiler_options``)
    program: Program | None = field(default=None, compare=False, repr=False)
    #: the original's :func:`reduction_tolerance` (the fallback's)
    extra_tolerance: float = 0.0
    #: what the original was compiled with, and :meth:`check` compiles a module with
    compiler_options: dict = field(default_factory=lambda: dict(CHECK_COMPILER_OPTIONS))
    #: per output, per device: the original evaluated in f64 (None: see ``reference``)
    exact: list | None = field(default=None, compare=False, repr=False)
    #: "f64", or why there is no f64 evaluation (floats then get fixed tolerances)
    reference: str = "f64"
    model: numerics.ErrorModel = field(default_factory=numerics.ErrorModel)
    #: per output, per device: the original computed in f32 where it computes in f64 (a module
    #: with f64 outputs only, whose f64 evaluation is itself: numerics.judge_float); else None
    demoted: list | None = field(default=None, compare=False, repr=False)
    #: how the inputs were drawn where random normal ones took the original outside its domain
    #: (:mod:`.domain`'s rules, and why they were needed); '' for a plain draw or given inputs
    drawn: str = ""

    @classmethod
    def of(
        cls, original: ir.Module, *, seed: int = 0, devices: Sequence | None = None,
        inputs: Sequence[np.ndarray] | None = None, source: str | None = None,
    ) -> "Reference":
        """``inputs``: the arguments to run on.  By default :func:`random_inputs` of ``seed``;
        where those leave an output of the original outside the program's domain (inf/NaN, near
        overflow: :func:`.numerics.outside_domain`) and :func:`.domain.rules` find arguments to
        draw otherwise (non-negative where they flow into a square root or a log, indices
        within the bounds of what they index), those are redrawn and the reference is made on
        the new draw (``drawn`` says how).  ``source``: the file, to name the ops the rules
        follow."""
        from . import domain

        refuse_host_callbacks(original)
        num_partitions = ir_utils.int_attr(original.operation, "mhlo.num_partitions") or 1
        devices = list(devices) if devices is not None else cpu_devices(num_partitions)
        if len(devices) != num_partitions:
            raise ExecutionError(f"the module has {num_partitions} partitions but {len(devices)} devices were given")
        runs = _OriginalRuns(original, devices)
        drawn = random_inputs(original, seed) if inputs is None else list(inputs)
        sizes = [rule for rule in domain.rules(original, source) if rule.kind == domain.GROUP_SIZES] \
            if inputs is None else []
        reference = runs.reference(domain.draw(drawn, sizes, seed) if sizes else drawn)
        if sizes:
            reference = replace(reference, drawn=f"random: {domain.describe(sizes)}")
        outside = reference.outside_domain()
        if inputs is None and outside:
            found = domain.rules(original, source)
            if found:
                first = ", ".join(f"{i}" for i in outside)
                reference = replace(runs.reference(domain.draw(reference.inputs, found, seed)),
                                    drawn=f"random, redrawn after the original was outside its domain on the first "
                                          f"draw (output(s) {first}): {domain.describe(found)}")
        return reference

    def outside_domain(self) -> dict[int, str]:
        """The float outputs of the original outside the program's domain on these inputs (inf/NaN
        or near overflow, :func:`.numerics.outside_domain`): index -> why."""
        found = {}
        for i, shards in enumerate(self.expected):
            a = np.stack(shards)
            name = _dtype_name(a.dtype)
            why = numerics.outside_domain(a, name, self.model) if name in FLOAT_TOLERANCES else ""
            if why:
                found[i] = why
        return found

    def check(self, rewritten: ir.Module) -> CheckResult:
        """Compare ``rewritten`` (compiled here with the original's ``compiler_options``) with the original."""
        program = Program(rewritten, self.inputs, self.devices, self.compiler_options)
        actual = program.outputs()
        if len(self.expected) != len(actual):
            raise ExecutionError(f"original has {len(self.expected)} outputs, rewritten {len(actual)}")
        exact = self.exact if self.exact is not None else [None] * len(actual)
        demoted = self.demoted if self.demoted is not None else [None] * len(actual)
        outputs = tuple(compare(i, e, a, self.extra_tolerance, x, self.model, d)
                        for i, (e, a, x, d) in enumerate(zip(self.expected, actual, exact, demoted)))
        compiled = (self.program.compile_s, program.compile_s) if self.program is not None else None
        return CheckResult(outputs, self.num_partitions, self.reference, self.drawn, compiled)


@functools.cache
def _warm_up_xla() -> None:
    """Compile one tiny program, once per process, so that XLA's own start-up (its first compile
    sets up the compiler) is not counted in the original's compile time."""
    import jax

    jax.jit(lambda x: x + 1).lower(np.zeros(2, np.float32)).compile()


class _OriginalRuns:
    """The original, its f64 evaluation and (for a module with f64 outputs) its f32 one, each
    compiled once with the check's options, run on any inputs (:meth:`reference`)."""

    def __init__(self, original: ir.Module, devices: list):
        self.original, self.devices = original, devices
        self.options = dict(CHECK_COMPILER_OPTIONS)
        _warm_up_xla()  # the first compile of a process pays XLA's start: not the original's time
        self.program = Program(original, None, devices, self.options)
        try:
            self.f64, self.why = Program(promote_to_f64(original), None, devices, self.options), "f64"
        except (NoReference, ExecutionError) as exc:
            self.f64, self.why = None, f"no f64 reference: {exc}"
        self.f32: Program | None | bool = False  # not compiled yet
        self.model = numerics.ErrorModel.of(original)
        self.extra = reduction_tolerance(original)

    def reference(self, inputs: list) -> Reference:
        expected = self.program.place(inputs).outputs()
        exact = demoted = None
        why = self.why
        if self.f64 is not None:
            try:
                exact = self.f64.place([_widened(x) for x in inputs]).outputs()
            except ExecutionError as exc:
                why = f"no f64 reference: {exc}"
        if exact is not None and any(shards and shards[0].dtype in (np.float64, np.complex128) for shards in expected):
            demoted = self._in_f32(inputs)
        return Reference(inputs, expected, self.devices, len(self.devices), self.program, self.extra, self.options,
                         exact, why, self.model, demoted)

    def _in_f32(self, inputs: list) -> list | None:
        if self.f32 is False:
            try:
                self.f32 = Program(demote_to_f32(self.original), None, self.devices, self.options)
            except (NoReference, ExecutionError):
                self.f32 = None
        if self.f32 is None:
            return None
        narrower = {np.dtype(np.float64): np.float32, np.dtype(np.complex128): np.complex64}
        try:
            return self.f32.place([x.astype(narrower.get(x.dtype, x.dtype)) for x in inputs]).outputs()
        except ExecutionError:
            return None


def _widened(x: np.ndarray) -> np.ndarray:
    """A float input as f64 (complex as complex128), exactly; any other as it is."""
    return x.astype(np.complex128 if x.dtype.kind == "c" else np.float64) if _is_float(x.dtype) else x


def evaluate_in_f64(original: ir.Module, inputs: Sequence[np.ndarray],
                    devices: Sequence) -> tuple[list | None, str]:
    """The original promoted to f64 (:func:`.reference.promote_to_f64`), run on ``inputs``
    (float ones widened, exactly): per output, per device, a shard; and "f64".  Where the
    promotion or its compile fails: None and why."""
    try:
        return _run_retyped(promote_to_f64, original, map(_widened, inputs), devices), "f64"
    except (NoReference, ExecutionError) as exc:
        return None, f"no f64 reference: {exc}"


def evaluate_in_f32(original: ir.Module, inputs: Sequence[np.ndarray], devices: Sequence) -> list | None:
    """The original demoted to f32 where it computes in f64 (:func:`.reference.demote_to_f32`), run on
    ``inputs`` rounded to f32: per output, per device, a shard; None where it cannot be built."""
    narrower = {np.dtype(np.float64): np.float32, np.dtype(np.complex128): np.complex64}
    try:
        return _run_retyped(demote_to_f32, original, (x.astype(narrower.get(x.dtype, x.dtype)) for x in inputs),
                            devices)
    except (NoReference, ExecutionError):
        return None


def _run_retyped(retype, original: ir.Module, inputs, devices: Sequence) -> list:
    """``retype(original)`` (a copy in other float types) run on ``inputs`` (cast to match) with the
    check's compiler options."""
    return Program(retype(original), list(inputs), devices, dict(CHECK_COMPILER_OPTIONS)).outputs()


def _is_float(dtype: np.dtype) -> bool:
    return _dtype_name(dtype) in FLOAT_TOLERANCES


def check_numerics(
    original: ir.Module,
    rewritten: ir.Module,
    *,
    seed: int = 0,
    devices: Sequence | None = None,
) -> CheckResult:
    """Run both modules on identical random inputs; compare every output shard."""
    return Reference.of(original, seed=seed, devices=devices).check(rewritten)
