"""The verdict: is the rewritten program as accurate as the original?

Each float output is judged against an estimate of the exact result, the original module
evaluated in f64 on the same inputs (:mod:`.reference`), not against the original's own
output with a fixed tolerance.  With ``r`` that reference, ``a`` the original's output
and ``b`` the rewritten one's, over the elements the original leaves finite::

    e_orig = ‖a − r‖ / ‖r‖          e_rew = ‖b − r‖ / ‖r‖          (Frobenius norms)
    ok  ⇔  e_rew ≤ FACTOR · e_orig + floor
    floor = n · u_acc + u_out / sqrt(m)

* ``FACTOR`` (:data:`FACTOR`): how much less accurate than the original a correct rewrite may
  be.  A ring computes every output element from the same products as the original; it
  only groups the sums differently (a dot's contraction in ring-size blocks, a sum across
  devices in ring order).  Every grouping of a sum of n terms has the same worst-case bound,
  ``γ_n Σ|x_i|`` (Higham, *Accuracy and Stability*, §4.2), and the typical (root-mean-square)
  error of one grouping differs from another's by a small factor: measured on correct
  rewrites up to 1.6 (docs/numerics.md); ring bugs give ratios of 10² to 10⁸.
* ``floor``: what a reordering may cost where the original happens to be nearly exact.
  ``n · u_acc`` is LAPACK's test ratio's scale (error / (n·eps·‖A‖·‖B‖)) with ``‖r‖`` for
  ``‖A‖·‖B‖``: ``n`` the longest reduction in the module (a dot's contraction, a reduce's
  reduced elements, a sum across a device group), ``u_acc`` the unit roundoff of the type
  sums are carried in (f32 for floats up to 32 bits, as XLA's dots and JAX's reductions
  accumulate them; f64 for f64).  ``u_out / sqrt(m)``: the final rounding to the output's
  type ``u_out``, which both programs make on values that differ by their rounding, averaged
  over the output's ``m`` elements (a scalar loss may be exact in one program by chance and
  a rounding off in the other).
* Sums across devices carried in bf16 or f16 (a reduce_scatter or all_reduce of that type)
  round at each of their ``g − 1`` additions in both programs, in different orders:
  ``(g − 1) · u`` of that type is added to the floor.

An f64 output is its own reference (the original already computes in f64), so ``e_orig``
reads 0 there and only the floor would be left, too tight for a program that magnifies
rounding (a norm after a reordered sum).  Its error is then estimated from the original
computed in f32 (:func:`.reference.demote_to_f32`): ``e_orig ≈ e_f32 · u_f64 / u_f32``, the
same magnification at f64's unit roundoff (first order in the rounding errors).

Integers and bools must be equal.

**Outside the program's domain** (:func:`outside_domain`), an output is not judged: where the
original itself is inf or NaN in any of its elements on the inputs drawn (a square root of a
second moment drawn negative, labels drawn past the classes), or where the rewrite overflows
an element the original leaves within a factor ``n`` of the type's largest finite value (``n``
the longest reduction: a sum of ``n`` terms in another order may overflow where the
original's did not).  Such inputs say nothing about the rewrite: the check reports the output
as not checked, never as a mismatch (docs/numerics.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from . import ir_utils
from ._jax_private import hlo, ir

#: A correct rewrite may be this many times less accurate (normwise, against the f64
#: reference) than the original: measured ratios of correct rewrites stay below 1.6.
FACTOR = 2.0

#: unit roundoff (half the machine epsilon) per element type name
_UNIT_ROUNDOFF = {name: float(ml_dtypes.finfo(t).eps) / 2 for name, t in {
    "f64": np.float64, "f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16,
    "f8E4M3FN": ml_dtypes.float8_e4m3fn, "f8E5M2": ml_dtypes.float8_e5m2,
    "f8E4M3FNUZ": ml_dtypes.float8_e4m3fnuz, "f8E5M2FNUZ": ml_dtypes.float8_e5m2fnuz,
    "f8E4M3B11FNUZ": ml_dtypes.float8_e4m3b11fnuz}.items()}
_LARGEST = {name: float(ml_dtypes.finfo(t).max) for name, t in {
    "f64": np.float64, "f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16,
    "f8E4M3FN": ml_dtypes.float8_e4m3fn, "f8E5M2": ml_dtypes.float8_e5m2,
    "f8E4M3FNUZ": ml_dtypes.float8_e4m3fnuz, "f8E5M2FNUZ": ml_dtypes.float8_e5m2fnuz,
    "f8E4M3B11FNUZ": ml_dtypes.float8_e4m3b11fnuz, "complex<f32>": np.float32, "complex<f64>": np.float64}.items()}
_UNIT_ROUNDOFF["complex<f32>"] = _UNIT_ROUNDOFF["f32"]
_UNIT_ROUNDOFF["complex<f64>"] = _UNIT_ROUNDOFF["f64"]

_CROSS_DEVICE_SUMS = ("stablehlo.reduce_scatter", "stablehlo.all_reduce")


def unit_roundoff(dtype_name: str) -> float | None:
    """The unit roundoff of a float or complex element type by MLIR name (None: not a float)."""
    return _UNIT_ROUNDOFF.get(dtype_name)


@dataclass(frozen=True)
class ErrorModel:
    """What the floor needs to know about a module (see the module docstring)."""

    #: the longest reduction: elements summed into one value
    longest_reduction: int = 1
    #: sum of (group size − 1) · unit roundoff over the narrow-float sums across devices
    narrow_device_sums: float = 0.0

    @classmethod
    def of(cls, module: ir.Module) -> "ErrorModel":
        n, narrow = 1, 0.0
        partitions = ir_utils.int_attr(module.operation, "mhlo.num_partitions") or 1
        found = ir_utils.ops_named(module, "stablehlo.dot_general", "stablehlo.reduce", *_CROSS_DEVICE_SUMS)
        for dot in found["stablehlo.dot_general"]:
            lhs = ir.RankedTensorType(dot.operation.operands[0].type)
            dims = hlo.DotDimensionNumbers(dot.attributes["dot_dimension_numbers"])
            n = max(n, math.prod(lhs.shape[d] for d in dims.lhs_contracting_dimensions))
        for red in found["stablehlo.reduce"]:
            operand = ir.RankedTensorType(red.operation.operands[0].type)
            reduced = ir.DenseI64ArrayAttr(red.attributes["dimensions"])
            n = max(n, math.prod(operand.shape[d] for d in reduced))
        for op in found["stablehlo.reduce_scatter"] + found["stablehlo.all_reduce"]:
            size = _group_size(op.attributes["replica_groups"], partitions)
            n = max(n, size)
            element = str(ir.RankedTensorType(op.operation.results[0].type).element_type)
            if element in ("bf16", "f16"):
                narrow = max(narrow, (size - 1) * _UNIT_ROUNDOFF[element])
        return cls(n, narrow)

    def floor(self, dtype_name: str, elements: int) -> float:
        """The relative error a correct rewrite of an output may have beyond FACTOR times the
        original's, for an output of ``dtype_name`` with ``elements`` compared elements."""
        u_out = _UNIT_ROUNDOFF[dtype_name]
        u_acc = _UNIT_ROUNDOFF["f64"] if dtype_name in ("f64", "complex<f64>") else _UNIT_ROUNDOFF["f32"]
        return self.longest_reduction * u_acc + u_out / math.sqrt(max(elements, 1)) + self.narrow_device_sums


def _group_size(attr: ir.Attribute, partitions: int) -> int:
    """A collective's group size; the partition count (a bound) where the groups name mesh axes."""
    try:
        groups = ir_utils.dense_ints(attr)
    except ValueError:
        return partitions
    return int(groups.shape[-1]) if groups.ndim == 2 else partitions


@dataclass(frozen=True)
class FloatVerdict:
    """One float output judged against the f64 reference (relative Frobenius errors)."""

    original_error: float
    rewritten_error: float
    tolerance: float  # FACTOR · original_error + floor
    compared: int  # elements finite in the original (and the reference)
    nonfinite: int  # elements the original leaves inf or NaN
    nonfinite_mismatch: int  # of those, or of the finite ones, where the rewritten has another value

    @property
    def ok(self) -> bool:
        return not self.nonfinite_mismatch and self.rewritten_error <= self.tolerance

    @property
    def ratio(self) -> float:
        if self.original_error > 0:
            return self.rewritten_error / self.original_error
        return 0.0 if self.rewritten_error == 0 else math.inf


def judge_float(original: np.ndarray, rewritten: np.ndarray, reference: np.ndarray, dtype_name: str,
                model: ErrorModel, demoted: np.ndarray | None = None) -> FloatVerdict:
    """``original`` and ``rewritten`` (any float type, stacked shards), ``reference`` (f64 or
    complex128, the same shape).  An f64 output's reference is the original itself (its
    error reads 0), so its error is estimated from ``demoted``, the original computed in f32:
    ``e_f32 · u_f64 / u_f32``, the same magnification of rounding at f64's unit roundoff."""
    wide = np.complex128 if original.dtype.kind == "c" else np.float64
    a, b, r = original.astype(wide), rewritten.astype(wide), reference.astype(wide)
    a_finite = np.isfinite(a)
    same = (a == b) | (np.isnan(a) & np.isnan(b))
    # an inf/NaN of the original must be the rewritten's too; a finite value must stay finite
    mismatch = int(np.count_nonzero(~a_finite & ~same) + np.count_nonzero(a_finite & ~np.isfinite(b)))
    mask = a_finite & np.isfinite(r) & np.isfinite(b)
    r_m = r[mask]
    scale = float(np.linalg.norm(r_m)) if r_m.size else 0.0
    e_orig, e_rew = _relative(a[mask], r_m, scale), _relative(b[mask], r_m, scale)
    if demoted is not None and dtype_name in ("f64", "complex<f64>"):
        d = demoted.astype(wide)
        estimate = _relative(np.where(np.isfinite(d), d, 0)[mask], r_m, scale)
        e_orig = max(e_orig, estimate * _UNIT_ROUNDOFF["f64"] / _UNIT_ROUNDOFF["f32"])
    tolerance = FACTOR * e_orig + model.floor(dtype_name, int(mask.sum()))
    return FloatVerdict(e_orig, e_rew, tolerance, int(mask.sum()), int(np.count_nonzero(~a_finite)), mismatch)


def _relative(x: np.ndarray, r: np.ndarray, scale: float) -> float:
    err = float(np.linalg.norm(x - r)) if x.size else 0.0
    if scale > 0:
        return err / scale
    return 0.0 if err == 0 else math.inf


def outside_domain(original: np.ndarray, dtype_name: str, model: ErrorModel,
                   rewritten: np.ndarray | None = None) -> str:
    """Why a float output (stacked shards) is outside the program's domain on these inputs, or
    ''.  Outside: the original is inf or NaN in some element; or it is within a factor ``n``
    (the longest reduction) of the type's largest finite value in some element, and the
    ``rewritten`` output is not finite there (without ``rewritten``: near overflow at all, what
    makes the check draw other inputs)."""
    wide = np.complex128 if original.dtype.kind == "c" else np.float64
    a = original.astype(wide)
    finite = np.isfinite(a)
    bad = int(a.size - np.count_nonzero(finite))
    if bad:
        return f"the original is inf/NaN in {bad} of {a.size} elements on these inputs"
    largest = _LARGEST.get(dtype_name)
    if largest is None or not a.size:
        return ""
    n = max(model.longest_reduction, 1)
    near = np.abs(a) >= largest / n
    if rewritten is not None:
        near &= ~np.isfinite(rewritten.astype(wide))
    count = int(np.count_nonzero(near))
    if not count:
        return ""
    where = "the rewrite overflows where " if rewritten is not None else ""
    return (f"{where}the original is within a factor {n} (the longest sum) of {dtype_name}'s largest value "
            f"({largest:.3g}) in {count} of {a.size} elements on these inputs: near overflow")
