"""``cmatmul_pass.jit(check=True)``: a signature's rewritten program judged against jax's own on
the inputs of its first call.

Two routes, the first that applies:

* **the modules** (:class:`execute.Reference`): the original and the rewritten module compiled
  without excess precision and run on the call's inputs (read to the host), float outputs judged
  against the original evaluated in f64 (docs/numerics.md);
* **jax's dispatch**, where the modules cannot run on their own: a program that calls back into
  Python (``jax.debug.print``, ``jax.pure_callback``, ``io_callback``: only jax's dispatch keeps
  the callbacks alive and hands them to the executable), or an argument the modules' route
  cannot lay out (a reduced or unreduced sharding).  Both programs are compiled through jax
  (without excess precision) and called as jax.jit calls them, on copies of donated inputs;
  their output shards are compared with the dtypes' fixed tolerances (no f64 evaluation: a
  callback would see f64 values).  The callbacks run once more for each program.

What neither route can compare (a mutable array reference argument whose programs call back
into Python) raises :class:`execute.CannotCheck`.  Over several processes each process judges
the shards it holds and all agree on one verdict (:func:`agreed_verdict`).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from . import execute, ir_utils
from ._jax_private import has_host_callbacks, ir, is_ref, lowered_arguments, lowered_module
from .errors import NumericsMismatch

#: what a check through jax's dispatch says instead of "f64" (CheckResult.reference)
THROUGH_JAX = "both programs run through jax's dispatch"


class CheckFailed(RuntimeError):
    """The check itself failed on some process of a multi-process job (not a verdict)."""


def check_call(lowered: Any, args: tuple, kwargs: dict, name: str, donates: bool) -> execute.CheckResult:
    """Judge ``lowered`` (a :class:`~cmatmul_pass.decorator.Lowered`) against its original on a
    call's dynamic ``args`` and ``kwargs``.  Returns the :class:`execute.CheckResult`; raises
    :class:`NumericsMismatch` (naming the rewritten sites and the outputs that differ),
    :class:`execute.CannotCheck` where neither route can compare the programs, and whatever
    else failed (a bug of the check; over several processes :class:`CheckFailed` on every one)."""
    sites = "; ".join(f"{s.kind} at {s.location}" for s in lowered.report.rewritten) or "none"
    outcome, failure, count = None, None, 0
    try:
        outcome, count = _judge(lowered, args, kwargs, donates)
    except Exception as exc:  # noqa: BLE001 - over several processes every one must hear of it
        if jax.process_count() == 1:
            raise
        failure = exc
        count = _output_count(lowered_module(lowered.original))
    if jax.process_count() > 1:
        agreed_verdict(outcome, failure, count, name, sites)
    bad = [c for c in outcome.outputs if not c.ok]
    if bad:
        outputs = "; ".join(c.line() for c in bad)
        mismatch = NumericsMismatch(
            f"{name}: the rewritten program is less accurate than "
            f"the original beyond what a reordering explains ({outputs}); rewritten sites: {sites}"
        )
        mismatch.result = outcome  # the verdict, for the decorator's ``.checked``
        raise mismatch
    return outcome


def _judge(lowered: Any, args: tuple, kwargs: dict, donates: bool) -> tuple[execute.CheckResult, int]:
    """The check by the first route that applies, and how many outputs it compares."""
    original = lowered.original
    module = lowered_module(original)
    target = execute.host_callback_target(module)
    if has_host_callbacks(original) or target is not None:
        why = f"the program calls back into Python{f' (custom_call @{target})' if target else ''}"
    else:
        try:
            return _through_modules(lowered, module, args, kwargs), _output_count(module)
        except execute.CannotCheck as exc:
            why = str(exc)
    return _through_jax(lowered, module, args, kwargs, donates, why)


def _through_modules(lowered: Any, module: ir.Module, args: tuple, kwargs: dict) -> execute.CheckResult:
    """Original and rewrite run as modules on the call's inputs, judged against the f64 evaluation."""
    kept, devices = lowered_arguments(lowered.original)
    leaves = [comparable(x) for x in jax.tree.leaves((args, kwargs))]
    given = [x for i, x in enumerate(leaves) if kept is None or i in kept]
    if any(x is None for x in given):  # its devices' values are not one array
        raise execute.CannotCheck("an argument has a reduced or unreduced sharding")
    inputs = execute.as_module_inputs(module, given)
    n = ir_utils.int_attr(module.operation, "mhlo.num_partitions") or 1
    reference = execute.Reference.of(module, inputs=inputs, devices=devices or jax.devices()[:n])
    return reference.check(lowered.compiler_ir("stablehlo"))


def _through_jax(lowered: Any, module: ir.Module, args: tuple, kwargs: dict, donates: bool,
                 why: str) -> tuple[execute.CheckResult, int]:
    """Original and rewrite compiled and called through jax (as jax.jit calls them), their
    output shards compared with fixed tolerances; ``why``: why the modules could not run."""
    if any(is_ref(x) for x in jax.tree.leaves((args, kwargs))):
        raise execute.CannotCheck(f"{why}, and an argument is a mutable array reference (each program "
                                  "would update it)")
    options = dict(execute.CHECK_COMPILER_OPTIONS)
    programs = [lowered.original.compile(options), lowered.compile(options)]

    def outputs(compiled) -> list[list[np.ndarray]]:
        given_args, given_kwargs = _copies((args, kwargs)) if donates else (args, kwargs)
        return [_shards(x) for x in jax.tree.leaves(compiled(*given_args, **given_kwargs))]

    expected, actual = (outputs(p) for p in programs)
    extra = execute.reduction_tolerance(module)
    compared = tuple(execute.compare(i, e, a, extra) for i, (e, a) in enumerate(zip(expected, actual)))
    n = ir_utils.int_attr(module.operation, "mhlo.num_partitions") or 1
    return execute.CheckResult(compared, n, f"no f64 reference: {why}; {THROUGH_JAX}"), len(compared)


def _shards(x) -> list[np.ndarray]:
    """An output of a program run through jax: this process's shards, in device order."""
    dtype = getattr(x, "dtype", None)
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    elif dtype == jax.dtypes.float0:
        return [np.zeros(np.shape(x), np.bool_)]
    if isinstance(x, jax.Array):
        return [np.asarray(s.data) for s in sorted(x.addressable_shards, key=lambda s: s.device.id)]
    return [np.asarray(x)]


def comparable(x) -> np.ndarray | None:
    """What ``check=True`` compares of a value jax.jit takes or returns: a typed PRNG key array
    as its key data, a float0 (nothing to compare) as booleans of its shape, a 0-d array as a
    0-d numpy array, a mutable array reference as its current value; None for an array whose
    sharding is reduced or unreduced on an explicit-sharding mesh (its per-device values are not
    one array: such a call is checked through jax's dispatch).  An array spanning several
    processes (not fully addressable) is gathered to its whole value on every process: a
    collective, which every process must make in the same order."""
    if is_ref(x):
        x = x[...]
    dtype = getattr(x, "dtype", None)
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return _host_value(jax.random.key_data(x))
    if dtype == jax.dtypes.float0:
        return np.zeros(np.shape(x), np.bool_)
    spec = getattr(getattr(x, "sharding", None), "spec", None)
    if getattr(spec, "unreduced", None) or getattr(spec, "reduced", None):
        return None
    return _host_value(x)


def _host_value(x) -> np.ndarray:
    """``x`` on the host, read shard by shard: no computation is traced or compiled (a copy
    would be one more jit program), and ``x`` itself caches no host value (jax 0.11 then no
    longer donates it: donate_argnums would silently keep it alive)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    if isinstance(x, jax.Array):
        value = np.empty(x.shape, x.dtype)
        for shard in x.addressable_shards:
            value[shard.index] = np.asarray(shard.data)
        return value
    return np.asarray(x)


def _copies(tree):
    """``tree`` with every jax array copied (inputs a program may donate)."""
    return jax.tree.map(lambda x: x.copy() if isinstance(x, jax.Array) else x, tree)


# ------------------------------------------------------------------ several processes (jax.distributed)
# Every function here is a collective over the processes: each must call it at the same point.


def gathered(values: np.ndarray) -> np.ndarray:
    """``values`` (the same shape on every process) from every process, stacked: row p is process p's."""
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(np.asarray(values), tiled=False))


def _output_count(module) -> int:
    entry = execute.entry_function(module)
    return len(ir.FunctionType(ir.TypeAttr(entry.attributes["function_type"]).value).results)


#: a process's first entry in :func:`agreed_verdict`: its verdict, or why it has none
_OK, _MISMATCH, _FAILED, _CANNOT = 0, 1, 2, 3


def agreed_verdict(outcome: "execute.CheckResult | None", failure: Exception | None, outputs: int,
                   name: str, sites: str) -> None:
    """One verdict for every process: each contributes, per output, whether its shards agree, the
    rewritten error and the allowed one (or that it could not check); a mismatch or a failure on
    any process raises on every process, naming the process(es) and the output(s): a failure of
    the check as :class:`CheckFailed`, a program it cannot compare as :class:`execute.CannotCheck`."""
    local = np.zeros(1 + 3 * outputs, np.float32)
    if failure is not None or outcome is None or len(outcome.outputs) != outputs:
        local[0] = _CANNOT if isinstance(failure, execute.CannotCheck) else _FAILED
    else:
        for c in outcome.outputs:
            local[1 + 3 * c.index: 4 + 3 * c.index] = (0 if c.ok else 1, c.rel_error, c.tolerance)
        local[0] = _OK if outcome.ok else _MISMATCH
    rows = gathered(local)
    me = jax.process_index()
    unable = [p for p in range(len(rows)) if rows[p][0] in (_FAILED, _CANNOT)]
    if unable:
        kind = CheckFailed if any(rows[p][0] == _FAILED for p in unable) else execute.CannotCheck
        if failure is not None:
            raise kind(f"{name}: check=True failed on process {me} ({type(failure).__name__}: "
                       f"{failure}); process(es) {unable} could not check") from failure
        raise kind(f"{name}: check=True could not check on process(es) {unable} (their stderr says why); "
                   "no verdict")
    bad = [(p, i, rows[p][2 + 3 * i], rows[p][3 + 3 * i]) for p in range(len(rows)) for i in range(outputs)
           if rows[p][1 + 3 * i]]
    if bad:
        where = "; ".join(f"process {p}: output {i} (rel err {err:.2e}, allowed {tol:.2e})"
                          for p, i, err, tol in bad)
        raise NumericsMismatch(
            f"{name}: the rewritten program is less accurate than the original beyond what a reordering "
            f"explains on {len({p for p, *_ in bad})} of {len(rows)} processes ({where}); rewritten sites: {sites}")
