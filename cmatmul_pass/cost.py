"""Per-site cost model: what a ring rewrite should save on a given machine.

For a site the model knows, per device: the dots' FLOPs (``2 · M · N · K`` summed over the
ring's dots), the bytes one permute moves, the ring size ``n`` and the element type.  A
:class:`Hardware` profile turns them into times:

* compute ``t_c = flops / throughput(dtype)``, one ``n``-th per ring step;
* transfer ``t_m = bytes / bandwidth`` per permute (full-duplex links: the two directions
  of a bidirectional ring run at once);
* ``step`` seconds of synchronisation per permute round and ``loop_trip`` seconds per
  trip of a ``stablehlo.while`` (a loop condition on a GPU costs a few µs): one number, or
  measured points per site kind, interpolated by the size of a ring step as the split is
  (:meth:`Hardware.trip`);
* ``split_efficiency``: how much of the full dot's throughput the ``1/n``-sized dots of
  the ring keep (1.0: none lost; ``tools/gpu_calibrate.py`` measures it on a GPU): one
  fraction, or measured points per site kind, interpolated by the size of a ring step's dot
  (smaller dots keep less: :meth:`Hardware.split`), each of a round's dots at its own size
  (dots merged by ``merge_dots`` count as one, a scatter's terms as one each) and in its role
  (a contracting dot may have points of its own; where none were measured, its kind's);
* ``overlap``, per variant: the fraction of the ring's permutes that XLA's schedule
  overlaps with a dot (1.0 where not measured; ``tools/gpu_topology.py`` reads it from the
  optimised module).  An exposed permute makes its round's dots wait for the transfer.

*Serial* (the original program) is ``t_c + (n-1)·t_m + step``: the whole collective, then
the dots.  *Overlapped* follows the rounds the rewrite emits (:func:`rounds`: the same
round structure and the same loop, :func:`loop_run`, as the rewrites build): each round
costs ``max(its compute, its transfer)`` when its permute is hidden and their sum when it
is exposed, weighted by the variant's ``overlap``, plus ``step`` when it sends (just its
compute when it sends nothing), plus ``loop_trip`` per loop trip.  :func:`schedule` lays
the rounds out in time (the timeline draws it).  The ratio is the predicted speed-up of the
site.  The H100 and H200 profiles' throughput, split efficiency and loop-trip cost were
measured on one GPU of each (``tools/gpu_calibrate.py``), their overlap in each GPU's own
compile for 8 GPUs (``tools/gpu_topology.py``); bandwidths, ``step`` and the other profiles are
published numbers scaled by achievable fractions (see each profile).
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field, replace

from .errors import CmatmulError


#: measured (FLOPs of a ring step's dot, value) points of one site kind
Points = tuple[tuple[float, float], ...]
#: seconds per loop trip where a profile gives no value for a site kind
DEFAULT_LOOP_TRIP = 4e-6


def interpolate(points: Points, flops: float, default: float) -> float:
    """The value at ``flops``: linear in log(FLOPs) between the points, the nearest point's
    outside them; ``default`` where there are none."""
    points = tuple(sorted(points))
    if not points:
        return default
    if flops <= points[0][0]:
        return points[0][1]
    for (f0, v0), (f1, v1) in zip(points, points[1:]):
        if flops < f1:
            return v0 + (v1 - v0) * math.log(flops / f0) / math.log(f1 / f0)
    return points[-1][1]


@dataclass(frozen=True)
class Hardware:
    """A machine: dense throughput per dtype (FLOP/s), ring-link bandwidth per direction
    (bytes/s), per-round synchronisation and per-loop-trip overhead (s)."""

    name: str
    flops: dict[str, float]
    bandwidth: float
    step: float = 6e-6
    #: one number for every loop trip, or per site kind measured points ((FLOPs of one ring
    #: step's dot, seconds), ...), which :meth:`trip` interpolates
    loop_trip: float | dict[str, Points] = DEFAULT_LOOP_TRIP
    #: throughput of the ring's 1/n-sized dots relative to the whole dot's (measured by
    #: tools/gpu_calibrate.py; 1.0 until a profile is calibrated): one fraction for every
    #: dot, or per site kind (SiteShape.kind) measured points ((FLOPs of one ring step's
    #: dot, fraction), ...), which :meth:`split` interpolates; a key ``"<kind>/<role>"``
    #: (:func:`point_key`) holds a dot role's own points, where they were measured
    split_efficiency: float | dict[str, Points] = 1.0
    #: per variant (VARIANTS): the fraction of the ring's permutes the compiler's schedule
    #: overlaps with a dot (measured by tools/gpu_topology.py); a variant not listed: 1.0
    overlap: dict[str, float] = field(default_factory=dict)
    #: an all_reduce's bus bandwidth (bytes/s; NCCL's "busbw": ``2(n-1)/n`` of the reduced
    #: bytes cross it), where the machine runs all-reduce faster than a ring of its links
    #: (NVLink SHARP); None: ``bandwidth``, a ring all-reduce
    all_reduce_bandwidth: float | None = None
    #: no profile describes the machine (``hardware("auto")`` on a device :data:`DEVICE_KINDS`
    #: does not name): the numbers are :data:`FALLBACK_PROFILE`'s, and ``variant="auto"`` takes
    #: :func:`fallback_variant` instead of trusting them
    assumed: bool = False

    def all_reduce_seconds(self, nbytes: float, n: int) -> float:
        """One all_reduce of ``nbytes`` per device over ``n`` devices (no overlap)."""
        return 2 * (n - 1) / n * nbytes / (self.all_reduce_bandwidth or self.bandwidth) + self.step

    def throughput(self, dtype: str) -> float:
        """Dense FLOP/s for dots on ``dtype`` (an MLIR element type: "bf16", "f8E4M3FN", "ui8"):
        the profile's entry for that type, else for its family (:func:`dtype_family`), else its
        ``default`` (:meth:`knows` tells which)."""
        return self._own_rate(dtype) or self.flops.get("default") or min(self.flops.values())

    def knows(self, dtype: str) -> bool:
        """Whether the profile gives ``dtype`` (or its family) a throughput of its own, rather
        than pricing it at the ``default`` rate."""
        return bool(self._own_rate(dtype))

    def _own_rate(self, dtype: str) -> float | None:
        return self.flops.get(dtype) or self.flops.get(dtype_family(dtype))

    def kind_points(self, field_name: str, kind: str, role: str = "free") -> Points:
        """The (FLOPs, value) points of ``kind`` in ``split_efficiency`` or ``loop_trip``: the
        ``role``'s own where the profile has them (:meth:`has_role_points`), else the kind's;
        one number for every site is one point."""
        value = getattr(self, field_name)
        if not isinstance(value, dict):
            return ((1.0, float(value)),)
        return value.get(point_key(kind, role)) or value.get(kind, ())

    def has_role_points(self, field_name: str, kind: str, role: str) -> bool:
        """Whether ``role``'s dots at ``kind`` sites have measured points of their own (the free
        role's are the kind's)."""
        value = getattr(self, field_name)
        return role == "free" or (isinstance(value, dict) and bool(value.get(point_key(kind, role))))

    def split(self, kind: str, step_flops: float, role: str = "free") -> float:
        """The fraction of the full dot's throughput that a ring step's dot of ``step_flops``
        keeps at a site of ``kind``, for a dot whose gathered or scattered dim plays ``role``
        (:func:`interpolate`, :meth:`kind_points`; a kind with no points: 1.0)."""
        return interpolate(self.kind_points("split_efficiency", kind, role), step_flops, 1.0)

    def trip(self, kind: str, step_flops: float) -> float:
        """Seconds a loop trip of a ring of ``kind`` costs beyond its dots, where one step's dots
        do ``step_flops`` (:func:`interpolate`; a kind with no points: DEFAULT_LOOP_TRIP)."""
        return interpolate(self.kind_points("loop_trip", kind), step_flops, DEFAULT_LOOP_TRIP)

    def hidden(self, variant: str) -> float:
        """The fraction of ``variant``'s permutes whose transfer a dot hides."""
        return self.overlap.get(variant, 1.0)

    def to_dict(self) -> dict:
        return asdict(self)


def dtype_family(dtype: str) -> str:
    """The profile key a dot's element type is priced under: every 8-bit float ("f8E4M3FN",
    "f8E5M2", ...) as "f8", an unsigned integer as the signed one of its width ("ui8" as "i8":
    tensor cores take both); other types as themselves."""
    if dtype.startswith("f8"):
        return "f8"
    if dtype.startswith("ui"):
        return dtype[1:]
    return dtype


VARIANTS = {
    "uni": (False, 1),
    "unroll2": (False, 2),
    "full": (False, None),
    "bidi": (True, 1),
    "bidi-unroll2": (True, 2),
    "bidi-full": (True, None),
}


def variant_name(bidirectional: bool, unroll: int | None) -> str:
    for name, value in VARIANTS.items():
        if value == (bidirectional, unroll):
            return name
    raise ValueError((bidirectional, unroll))


#: Read from XLA's schedule of the training steps compiled for 8 H100s (tools/gpu_topology.py,
#: jax 0.11.2, ring_compiler_options): the 8B step (bench/gpu/h100_topology_8b_20261126.json) and
#: the 70B step (h100_topology_70b_20261127.json), permutes overlapped with a dot as executed,
#: pooled. uni and unroll2 hid every permute.
H100_OVERLAP = {"full": 202 / 210, "bidi": 298 / 308, "bidi-unroll2": 289 / 308, "bidi-full": 304 / 308}

#: The same, read from the 8B and 70B steps compiled for 8 H200s
#: (bench/gpu/h200_topology_{8b,70b}.json, the same flags), both models pooled: uni and unroll2 hid
#: every permute, and bidi-full hid all 154 of each model's (absent here: a variant the table
#: leaves out hides every permute)
H200_OVERLAP = {"full": 202 / 210, "bidi": 298 / 308, "bidi-unroll2": 289 / 308}

#: FLOPs of one ring step's dot at the MLP-block shapes tools/gpu_calibrate.py measures on 8
#: devices (one weight of the gather, the scatter's one dot): 70B-like 2·1024·8192·3584, 8B-like
#: 2·1024·4096·1792
STEP_70B, STEP_8B = 2 * 1024 * 8192 * 3584, 2 * 1024 * 4096 * 1792

#: NVLink SHARP all-reduce against a ring's links on 8 H100s, NCCL's published bus bandwidths
#: (about 480 GB/s against about 370 GB/s for ring reduce-scatter / all-gather): the factor the
#: Hopper profiles' all_reduce_bandwidth applies to their ring bandwidth (not measured here)
NVLS_ALL_REDUCE = 480 / 370

PROFILES: dict[str, Hardware] = {
    # Calibrated on an H100 SXM (tools/gpu_checks.sh calibrate, jax 0.11.2;
    # bench/gpu/h100_calibrate_{70b,8b}.json and h100_calibrate_3b_20261127*.json, merged by
    # tools/gpu_profile.py, the three 3B runs by their medians): XLA's bf16 dot at 634 TFLOP/s (989
    # peak; the median of the models' full dots, the 8B's); the straight-line splits at each step's
    # FLOPs (the gate and up dots merged at 12.9, 30 and 120 GFLOP), the contracting and batch
    # roles' own points, loop trips per kind, and every element type's rate measured as XLA's dot
    # (medians over the models: fp8 1.1x bf16, i32 a hundred-and-fiftieth).  The full dot, loop and
    # straight line timed in turn (timed in separate blocks they read high).  NVLink 4: 450 GB/s
    # per direction.  Overlap: H100_OVERLAP.
    "h100": Hardware("H100 SXM (NVLink 4)", {"bf16": 6.34e14, "f16": 6.34e14, "f32": 3.26e14, "f8": 6.84e14,
                                            "f64": 5.97e13, "i8": 5.79e14, "i32": 4.12e12, "default": 6.34e14},
                     450e9,
                     loop_trip={"all_gather_dot": ((6442450944.0, 1.15e-05), (12884901888.0, 4.58e-06),
                                                   (15032385536.0, 1.23e-05), (30064771072.0, 7.72e-06),
                                                   (60129542144.0, 1.44e-05), (120259084288.0, 2.81e-05)),
                                "dot_reduce_scatter": ((6442450944.0, 2.43e-05), (15032385536.0, 8.21e-06),
                                                       (60129542144.0, 3.1e-06))},
                     overlap=H100_OVERLAP,
                     split_efficiency={"all_gather_dot": ((6442450944.0, 0.744), (12884901888.0, 0.653),
                                                          (15032385536.0, 0.756), (30064771072.0, 0.707),
                                                          (60129542144.0, 0.774), (120259084288.0, 0.828)),
                                       "dot_reduce_scatter": ((6442450944.0, 0.817), (15032385536.0, 0.757),
                                                              (60129542144.0, 0.821)),
                                       "all_gather_dot/contracting": ((6442450944.0, 0.564), (15032385536.0, 0.486),
                                                                      (60129542144.0, 0.519)),
                                       "all_gather_dot/batch": ((6442450944.0, 0.468), (15032385536.0, 0.489),
                                                                (60129542144.0, 0.591))},
                     all_reduce_bandwidth=NVLS_ALL_REDUCE * 450e9),
    # Calibrated on an H200 (tools/gpu_checks.sh calibrate + extras, jax 0.11.2;
    # bench/gpu/h200_calibrate_{70b,8b,3b}.json, merged by tools/gpu_profile.py): the straight-line
    # splits at each step's FLOPs, the gate and up dots merged at their own step (12.9, 30.1 and
    # 120 GFLOP), the contracting and batch roles' own points, loop trips per kind, and every
    # element type's rate measured as XLA's dot (the medians over the three runs): fp8 reached
    # only 1.2x bf16, i32 a hundredth of it (no integer tensor-core path for i32 dots).  NVLink 4 as
    # H100 (not measured: one GPU).  Overlap: read from XLA's schedule of the 8B and 70B steps
    # compiled for 8 H200s (bench/gpu/h200_topology_{8b,70b}.json), H200_OVERLAP.
    "h200": Hardware("H200 (NVLink 4)", {"bf16": 6.68e14, "f16": 6.68e14, "f32": 3.4e14, "f8": 7.91e14,
                                        "f64": 5.96e13, "i8": 7.41e14, "i32": 4.3e12, "default": 6.68e14}, 450e9,
                     loop_trip={"all_gather_dot": ((6442450944.0, 1.02e-05), (12884901888.0, 4.19e-06),
                                                   (15032385536.0, 8.87e-06), (30064771072.0, 8.08e-06),
                                                   (60129542144.0, 1.1e-05), (120259084288.0, 1.93e-05)),
                                "dot_reduce_scatter": ((6442450944.0, 1.71e-05), (15032385536.0, 5.04e-06),
                                                       (60129542144.0, 4.39e-06))},
                     overlap=H200_OVERLAP,
                     split_efficiency={"all_gather_dot": ((6442450944.0, 0.74), (12884901888.0, 0.681),
                                                          (15032385536.0, 0.737), (30064771072.0, 0.738),
                                                          (60129542144.0, 0.779), (120259084288.0, 0.858)),
                                       "dot_reduce_scatter": ((6442450944.0, 0.786), (15032385536.0, 0.777),
                                                              (60129542144.0, 0.867)),
                                       "all_gather_dot/contracting": ((6442450944.0, 0.571), (15032385536.0, 0.541),
                                                                      (60129542144.0, 0.622)),
                                       "all_gather_dot/batch": ((6442450944.0, 0.453), (15032385536.0, 0.48),
                                                                (60129542144.0, 0.624))},
                     all_reduce_bandwidth=NVLS_ALL_REDUCE * 450e9),
    # 312 TFLOP/s bf16 peak (~250 achieved), 19.5 f64 (~15.6); no f8 units: f8 dots run
    # converted, at bf16's rate.  NVLink 3: 300 GB/s per direction.
    "a100": Hardware("A100 SXM (NVLink 3)", {"bf16": 250e12, "f16": 250e12, "f32": 125e12, "f8": 250e12,
                                            "f64": 15.6e12, "i8": 500e12, "i32": 20e12, "default": 250e12},
                     300e9),
    # 197 TFLOP/s bf16 peak (~160 achieved); no f8 units (f8 at bf16's rate) and no f64 ones (f64
    # is emulated; no figure, so it is priced at the default and the report says so).  ICI ~50 GB/s
    # per direction per link (assumed; override it).
    "tpu-v5e": Hardware("TPU v5e (ICI)", {"bf16": 160e12, "f32": 40e12, "f8": 160e12, "i8": 320e12,
                                          "default": 160e12}, 50e9, step=3e-6, loop_trip=1e-6),
}


#: ``device_kind`` substrings (as jax reports them, e.g. "NVIDIA H100 80GB HBM3", "TPU v5 lite")
#: and the profile each selects, for ``hardware("auto")``
DEVICE_KINDS = (("h200", "h200"), ("h100", "h100"), ("a100", "a100"), ("tpu v5 lite", "tpu-v5e"), ("tpu v5e", "tpu-v5e"))
#: what ``"auto"`` falls back to on a device no profile describes (a CPU, say)
FALLBACK_PROFILE = "h100"


#: ``variant="auto"`` (the default) where no profile describes the machine: on a ring of up to
#: :data:`FALLBACK_FULL_UP_TO` devices the straight-line ring, gathers and scatters alike, but a
#: one-way loop for a scatter whose partial sums add up to :data:`FALLBACK_LOOPED_SCATTER_BYTES`
#: or more per device; two rounds per loop trip on longer rings, where a straight-line ring's code
#: grows with the ring.  On the 8 CPU devices the straight-line ring compiles to the program a ring
#: written by hand with ``ppermute`` compiles to (the same dots, slices, permutes and fusions,
#: lighter index arithmetic: tests/test_default_program.py), and a gather loop copies the shard it
#: sends in every trip; the timings (``tools/bench.py --only-rings``, docs/variants.md) put
#: ``full`` as fast as or faster than the loops for scatters of up to 4 MiB of partial sums (``uni``
#: 0.97-1.09 of the hand-written ring, ``full`` 0.96-1.01), but a scatter of 8 MiB or more runs
#: faster as a one-way loop (``uni`` 0.86-1.005 at 8 MiB, median 0.91 over eight runs; 0.63-0.85
#: at 16 MiB, 0.59 at 32; ``full``, the hand-written ring's program, 0.97-1.01): the straight
#: line holds every round's partial product at once.  Gathers keep ``full`` at every size
#: measured (``uni`` 1.05-1.24 at 16-32 MiB).
FALLBACK_VARIANT, FALLBACK_SHORT_RING_VARIANT, FALLBACK_FULL_UP_TO = "unroll2", "full", 8
FALLBACK_LOOPED_SCATTER_VARIANT, FALLBACK_LOOPED_SCATTER_BYTES = "uni", 8 * 2**20


#: What ``all_reduce="auto"`` makes of a psum of a matmul where no profile describes the machine:
#: chunk it in two where its rows cut so (else split).  On the 8 CPU devices, which run every
#: collective synchronously, two pre-norm Megatron MLP blocks (``make bench``'s Megatron run,
#: docs/performance.md) run chunk 2 closest to the plain psum (about 1.05 of it), more chunks and
#: split slower (split 1.2-1.4 in every variant); on the profiled GPUs the model predicts chunk faster
#: than split too, in every row of docs/performance.md's 8xH100 Megatron table.
FALLBACK_CHUNKS = 2


def fallback_all_reduce(prediction: "AllReducePrediction") -> tuple[str, int | None]:
    """(strategy, chunk count) ``all_reduce="auto"`` gives a psum site where no profile
    describes the machine (:data:`FALLBACK_CHUNKS`)."""
    if not prediction.chunk_s:
        return "split", None
    return "chunk", FALLBACK_CHUNKS if FALLBACK_CHUNKS in prediction.chunk_s else min(prediction.chunk_s)


def fallback_variant(shape: "SiteShape") -> str:
    """The variant ``"auto"`` gives a site of ``shape`` where no profile describes the machine."""
    if shape.ring > FALLBACK_FULL_UP_TO:
        return FALLBACK_VARIANT
    if shape.kind == "dot_reduce_scatter" and shape.step_bytes * shape.ring >= FALLBACK_LOOPED_SCATTER_BYTES:
        return FALLBACK_LOOPED_SCATTER_VARIANT
    return FALLBACK_SHORT_RING_VARIANT


def profile_for(device_kind: str) -> str | None:
    """The profile describing a device of this ``device_kind``; None: no profile does."""
    kind = device_kind.lower()
    return next((name for needle, name in DEVICE_KINDS if needle in kind), None)


def _device_kind() -> str:
    import jax

    return jax.devices()[0].device_kind


#: the overrides that set one number of a profile
SCALAR_OVERRIDES = ("bandwidth", "all_reduce_bandwidth", "step", "loop_trip", "split_efficiency")
#: the element types a dot's throughput can be overridden for (MLIR's names; ``f8``: every 8-bit
#: float without an entry of its own, ``default``: a type the profile has no rate for)
DTYPE_OVERRIDES = ("bf16", "f16", "f32", "f64", "f8", "f8E4M3FN", "f8E5M2", "f8E4M3FNUZ", "f8E5M2FNUZ",
                   "f8E4M3B11FNUZ", "f8E4M3", "f8E3M4", "f8E8M0FNU", "f6E2M3FN", "f6E3M2FN", "f4E2M1FN",
                   "i4", "i8", "i16", "i32", "i64", "ui4", "ui8", "ui16", "ui32", "ui64", "default")


def _unknown_override(item: str, key: str) -> CmatmulError:
    return CmatmulError(
        f"hardware override {item!r}: unknown key {key!r}; known: {', '.join(SCALAR_OVERRIDES)}, "
        f"overlap.<variant>, {', '.join(f'{p}.<gather|scatter>' for p in POINT_FIELDS)}, "
        f"or a dtype's throughput ({', '.join(DTYPE_OVERRIDES)})")


def hardware(spec: str) -> Hardware:
    """A profile by name, optionally overridden: ``"h100"``,
    ``"h100:bandwidth=400e9,bf16=700e12,step=8e-6,split_efficiency=0.97,overlap.bidi=0.9"``
    (``split_efficiency``: one fraction for every dot; ``split.gather=1.5e10:0.74/6e10:0.85``
    and ``split.scatter=...``: a kind's measured points, ``split.gather/contracting=...`` a dot
    role's own there, see :meth:`Hardware.split`;
    ``loop_trip``, and ``loop_trip.gather=1.5e10:1.07e-5/...`` likewise, :meth:`Hardware.trip`);
    ``"auto"``: the profile of jax's default device (:data:`DEVICE_KINDS`), or
    :data:`FALLBACK_PROFILE` where none describes it (the name says so)."""
    name, _, overrides = spec.partition(":")
    if name == "auto":
        kind = _device_kind()
        found = profile_for(kind)
        hw = PROFILES[found or FALLBACK_PROFILE]
        hw = replace(hw, name=f"{hw.name}, detected" if found else f"{hw.name}, assumed: no profile for {kind}",
                     assumed=not found)
    elif name not in PROFILES:
        raise CmatmulError(f"unknown hardware profile {name!r}; known: {', '.join(sorted(PROFILES))} or auto")
    else:
        hw = PROFILES[name]
    if overrides:
        hw = replace(hw, name=f"{hw.name}, {overrides}")
    for item in filter(None, overrides.split(",")):
        key, _, value = item.partition("=")
        prefix, dot, short = key.partition(".")
        if key not in SCALAR_OVERRIDES + DTYPE_OVERRIDES and not (dot and prefix in (*POINT_FIELDS, "overlap")):
            raise _unknown_override(item, key)
        if dot and prefix in POINT_FIELDS:
            field_name = POINT_FIELDS[prefix]
            hw = replace(hw, **{field_name: _points_override(hw, field_name, item, short, value)})
            continue
        try:
            number = float(value)
        except ValueError:
            raise CmatmulError(f"hardware override {item!r}: {value!r} is not a number") from None
        if key.startswith("overlap."):
            variant = key.removeprefix("overlap.")
            if variant not in VARIANTS:
                raise CmatmulError(f"hardware override {item!r}: no variant {variant!r}; known: {', '.join(VARIANTS)}")
            if not 0 <= number <= 1:
                raise CmatmulError(f"hardware override {item!r}: an overlap is a fraction from 0 to 1")
            hw = replace(hw, overlap={**hw.overlap, variant: number})
            continue
        may_be_zero = key in ("step", "loop_trip")
        if not math.isfinite(number) or number < 0 or (number == 0 and not may_be_zero):
            raise CmatmulError(f"hardware override {item!r}: {key} must be a {'non-negative' if may_be_zero else 'positive'} number")
        if key in SCALAR_OVERRIDES:
            hw = replace(hw, **{key: number})
        else:  # a dtype's throughput
            hw = replace(hw, flops={**hw.flops, key: number})
    return hw


#: the site kinds by the short names a ``split.<name>`` or ``loop_trip.<name>`` override uses
KIND_NAMES = {"gather": "all_gather_dot", "scatter": "dot_reduce_scatter"}
#: each site kind's short name
SHORT_NAMES = {kind: name for name, kind in KIND_NAMES.items()}
#: the overrides that take points per site kind, and the Hardware field each sets
POINT_FIELDS = {"split": "split_efficiency", "loop_trip": "loop_trip"}
#: the dot roles a split may have points of its own for (``split.gather/contracting=...``); the
#: free role's points are the kind's
POINT_ROLES = ("contracting", "batch")


def point_key(kind: str, role: str) -> str:
    """Where ``role``'s own points for ``kind`` sites are kept in a profile's points (the free
    role's: under the kind)."""
    return kind if role == "free" else f"{kind}/{role}"


def _points_override(hw: Hardware, field_name: str, item: str, name: str, value: str) -> dict:
    """``split.gather=1.5e10:0.74/6e10:0.85`` (FLOPs of a ring step's dot : fraction of the full
    dot's throughput) or ``loop_trip.scatter=1.5e10:8.7e-6/...`` (: seconds per trip): a kind's
    measured points, replacing the profile's for that kind; ``split.gather/contracting=...``: a
    dot role's own split points at that kind (a loop trip is the ring's, whatever its dots)."""
    short, slash, role = name.partition("/")
    kind = KIND_NAMES.get(short, short)
    if kind not in KIND_NAMES.values():
        raise CmatmulError(f"hardware override {item!r}: no site kind {short!r}; known: {', '.join(KIND_NAMES)}")
    if slash and (field_name != "split_efficiency" or role not in POINT_ROLES):
        raise CmatmulError(f"hardware override {item!r}: only a split takes a role's own points, "
                           f"for a role of {', '.join(POINT_ROLES)}")
    trip = field_name == "loop_trip"  # seconds may be 0, a fraction may not
    points = []
    for point in value.split("/"):
        flops, colon, number = point.partition(":")
        try:
            pair = (float(flops), float(number))
        except ValueError:
            pair = None
        if not colon or pair is None or not all(math.isfinite(v) for v in pair) or pair[0] <= 0 \
                or pair[1] < 0 or (pair[1] == 0 and not trip):
            shape = "FLOPS:SECONDS, a positive and a non-negative number" if trip else \
                "FLOPS:FRACTION, both positive numbers"
            raise CmatmulError(f"hardware override {item!r}: each point is {shape}, '/' between points "
                               f"(got {point!r})")
        points.append(pair)
    if len({flops for flops, _ in points}) < len(points):
        raise CmatmulError(f"hardware override {item!r}: two points at the same FLOPs")
    current = getattr(hw, field_name)
    kept = dict(current) if isinstance(current, dict) else {k: hw.kind_points(field_name, k) for k in KIND_NAMES.values()}
    return {**kept, point_key(kind, role if slash else "free"): tuple(sorted(points))}


@dataclass(frozen=True)
class SiteShape:
    """What the model needs to know of a site (per device)."""

    kind: str  # "all_gather_dot" | "dot_reduce_scatter"
    ring: int
    flops: float  # all the ring's dots together, over the whole ring
    step_bytes: int  # what one permute moves in a one-directional ring
    dtype: str  # the dots' operand element type
    #: a scatter whose blocks can be halved (a bidirectional scatter ring splits them; when they
    #: cannot be, the rewrite keeps one direction and so does the model)
    halvable: bool = True
    #: the FLOPs (over the whole ring) of each dot a round computes, when there are several: a
    #: gather's consumers that merge_dots did not merge, a scatter's terms; they add up to
    #: ``flops``.  Empty: one dot.  Smaller dots keep less of the throughput (Hardware.split).
    dots: tuple[float, ...] = ()
    #: the role the gathered or scattered dim plays in each of ``dot_flops``' dots ("free",
    #: "contracting", "batch"; Hardware.split may have points per role).  Empty: every dot free.
    roles: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "dots", tuple(self.dots) if len(self.dots) > 1 else ())  # one dot: ()
        roles = tuple(self.roles)
        if roles and len(roles) != len(self.dot_flops):
            raise ValueError(f"{len(roles)} roles for {len(self.dot_flops)} dots")
        object.__setattr__(self, "roles", () if all(r == "free" for r in roles) else roles)  # all free: ()

    @property
    def transfer_bytes(self) -> int:
        return self.step_bytes * (self.ring - 1)

    @property
    def dot_flops(self) -> tuple[float, ...]:
        """The FLOPs of each dot of a round, over the whole ring."""
        return self.dots or (self.flops,)

    @property
    def dot_roles(self) -> tuple[str, ...]:
        """The role of each of :attr:`dot_flops`' dots."""
        return self.roles or ("free",) * len(self.dot_flops)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "ring": self.ring, "flops": self.flops, "step_bytes": self.step_bytes,
                "dtype": self.dtype, "halvable": self.halvable, "dots": list(self.dot_flops),
                "roles": list(self.dot_roles)}

    @classmethod
    def from_dict(cls, d: dict) -> "SiteShape":
        return cls(d["kind"], d["ring"], d["flops"], d["step_bytes"], d["dtype"], d.get("halvable", True),
                   tuple(d.get("dots", ())), tuple(d.get("roles", ())))


@dataclass(frozen=True)
class Round:
    compute: float  # the round's dots' fraction of the whole ring's compute
    transfers: tuple[float, ...]  # bytes of each permute in the round (they run in parallel, on different links)
    #: what the rewrite's round does (rounds with equal signatures can share a loop body):
    #: gathers, per stream (computes, sends); scatters, whether it receives a partial sum
    signature: tuple | bool = ()


@dataclass(frozen=True)
class GatherStream:
    """Shards travelling one way round a gather ring: in round ``r`` the stream holds the
    shard of position ``pos + shift * r``; it computes in rounds ``first..last`` and sends
    while a later round still needs a shard.  The one description of a gather ring's
    rounds: the rewrite emits it, the model times it."""

    shift: int
    first: int
    last: int

    def computes(self, r: int) -> bool:
        return self.first <= r <= self.last

    def sends(self, r: int) -> bool:
        return r < self.last


def gather_streams(n: int, bidirectional: bool) -> list[GatherStream]:
    """One stream round the whole ring, or (both ways, n >= 3) one each way: the own shard in
    round 0, then a shard from each side per round until they meet."""
    if not bidirectional or n < 3:
        return [GatherStream(1, 0, n - 1)]
    return [GatherStream(1, 0, n // 2), GatherStream(-1, 1, (n - 1) // 2)]


def gather_signatures(streams: list[GatherStream]) -> list[tuple[tuple[bool, bool], ...]]:
    """A gather ring's rounds: per stream, whether it computes and whether it sends."""
    return [tuple((s.computes(r), s.sends(r)) for s in streams) for r in range(streams[0].last + 1)]


def scatter_signatures(n: int) -> list[bool]:
    """A scatter ring's rounds: whether each receives a partial sum (round 0 creates them)."""
    return [r > 0 for r in range(n)]


@functools.lru_cache(maxsize=1024)
def _loop_run(signatures: tuple, unroll: int | None) -> tuple[int, int]:
    """:func:`loop_run` of a :func:`_ring_plan`'s signatures (once per ring and unroll)."""
    return loop_run(list(signatures), unroll)


def loop_run(signatures: list, unroll: int | None) -> tuple[int, int]:
    """The rounds ``[lo, hi)`` the rewrite loops over, ``unroll`` per trip: the longest run of
    equal signatures (the first on ties), less the remainder, which goes before the loop;
    ``(0, 0)`` when there is no loop (straight-line, or fewer than one trip of two rounds)."""
    if unroll is None or not signatures:
        return 0, 0
    best = (0, 0)
    start = 0
    for r in range(1, len(signatures) + 1):
        if r == len(signatures) or signatures[r] != signatures[start]:
            if r - start > best[1] - best[0]:
                best = (start, r)
            start = r
    lo, hi = best
    trips = (hi - lo) // unroll
    if trips < 1 or hi - lo < 2:
        return 0, 0
    # The remainder of the run goes before the loop, not after it.  After the loop, the peeled
    # round's permute is the last transfer of its ring, and XLA GPU's scheduler left it exposed
    # (measured, docs/gpu.md: 27 of 45 permutes hidden for unroll 2; 32 with the remainder first).
    return hi - trips * unroll, hi


def rounds(shape: SiteShape, bidirectional: bool) -> list[Round]:
    """The rounds the rewrite emits (rewrites/all_gather_dot and dot_reduce_scatter)."""
    return list(_plan_of(shape, bidirectional)[0])


def _plan_of(shape: SiteShape, bidirectional: bool) -> tuple[tuple[Round, ...], tuple, bool]:
    """:func:`_ring_plan` of ``shape``'s ring, one way or both."""
    return _ring_plan(shape.kind, shape.ring, shape.step_bytes, _halves(shape, bidirectional), bidirectional)


@functools.lru_cache(maxsize=1024)
def _ring_plan(kind: str, n: int, b: float, halves: bool, bidirectional: bool) -> tuple[tuple[Round, ...], tuple, bool]:
    """:func:`rounds` of a ring of ``n`` moving ``b`` bytes a step (``halves``: a scatter's blocks
    split, :func:`_halves`), their signatures, and whether a round sends both ways: worked out once
    per geometry (a model's layers repeat them; the rounds are frozen)."""
    block = 1.0 / n
    if kind == "all_gather_dot":
        streams = gather_streams(n, bidirectional)
        plan = tuple(
            Round(block * sum(s.computes(r) for s in streams), tuple(b for s in streams if s.sends(r)), signature)
            for r, signature in enumerate(gather_signatures(streams)))
    else:
        sends = (b / 2, b / 2) if halves else (b,)
        plan = tuple(Round(block, sends if receives else (), receives) for receives in scatter_signatures(n))
    return plan, tuple(rnd.signature for rnd in plan), any(len(rnd.transfers) > 1 for rnd in plan)


def _halves(shape: SiteShape, bidirectional: bool) -> bool:
    """A split scatter: each half-block's partial sums travel one way."""
    return shape.kind == "dot_reduce_scatter" and bidirectional and shape.halvable


def step_dot_flops(shape: SiteShape, bidirectional: bool) -> tuple[float, ...]:
    """The FLOPs of each dot of a ring step (the dots :meth:`Hardware.split` is asked about):
    a ring's ``1/n`` of each of the site's dots (merged q/k/v or gate/up count as one), half
    that where a bidirectional scatter splits its blocks."""
    parts = shape.ring * (2 if _halves(shape, bidirectional) else 1)
    return tuple(flops / parts for flops in shape.dot_flops)


def split_efficiency(shape: SiteShape, hw: Hardware, bidirectional: bool) -> float:
    """What the ring's dots keep of the full dot's throughput at this site: with several dots
    per round, the whole ring's FLOPs over the sum of each dot's time at its own efficiency."""
    steps = step_dot_flops(shape, bidirectional)
    roles = shape.dot_roles
    if len(steps) == 1:
        return hw.split(shape.kind, steps[0], roles[0])
    return sum(steps) / sum(flops / hw.split(shape.kind, flops, role) for flops, role in zip(steps, roles))


@dataclass(frozen=True)
class Slot:
    """One round laid out in time (seconds from the ring's start): its permutes run from
    ``start`` for ``transfer``; its dots from ``compute_start`` for ``compute`` (after the
    expected exposed part of the transfer); the next round starts at ``end`` (synchronisation
    and, when the round ends a loop trip, the trip's cost included)."""

    start: float
    transfer: float
    compute_start: float
    compute: float
    end: float


def emitted_variant(shape: SiteShape, bidirectional: bool, unroll: int | None) -> str:
    """The variant the rewrite emits for ``shape``: asked for both directions, a ring of 2 and a
    scatter whose blocks cannot be halved still go one way."""
    return variant_name(_plan_of(shape, bidirectional)[2], unroll)


def _variant_of(plan: list[Round], unroll: int | None) -> str:
    return variant_name(any(len(rnd.transfers) > 1 for rnd in plan), unroll)


def schedule(shape: SiteShape, hw: Hardware, bidirectional: bool, unroll: int | None, *,
             plan: list[Round] | None = None, efficiency: float | None = None) -> list[Slot]:
    """The ring's rounds as the model times them (:func:`overlapped_time` is the last one's end).

    A round whose permute is hidden costs ``max(compute, transfer)``, an exposed one
    ``compute + transfer``; with the variant's ``overlap`` ``h`` the round costs
    ``h·max + (1-h)·sum``: its dots start after ``(1-h)`` of the transfer.  ``plan`` and
    ``efficiency``: :func:`rounds` and :func:`split_efficiency` of ``shape`` one way or both,
    where the caller has them already."""
    layout = _Layout.of(shape, hw, bidirectional, unroll, plan, efficiency)
    return [Slot(start, transfer, start + (1 - layout.hidden) * transfer, compute, end)
            for start, transfer, compute, end in layout.rounds(hw)]


@dataclass(slots=True)
class _Layout:
    """What :func:`schedule` times a ring's rounds by: the plan, a round's full compute time, the
    share of its permutes hidden, the loop's rounds and its trips' cost."""

    plan: list[Round]
    t_c: float
    hidden: float
    lo: int
    hi: int
    per_trip: int
    trip: float

    @classmethod
    def of(cls, shape: SiteShape, hw: Hardware, bidirectional: bool, unroll: int | None,
           plan: list[Round] | None, efficiency: float | None, trip: float | None = None,
           hidden: float | None = None) -> "_Layout":
        if efficiency is None:
            efficiency = split_efficiency(shape, hw, bidirectional)
        t_c = shape.flops / hw.throughput(shape.dtype) / efficiency  # smaller dots
        if plan is None:
            plan = rounds(shape, bidirectional)
        lo, hi = loop_run([rnd.signature for rnd in plan], unroll)
        if trip is None:
            trip = hw.trip(shape.kind, shape.flops / shape.ring)
        if hidden is None:
            hidden = hw.hidden(_variant_of(plan, unroll))
        return cls(plan, t_c, hidden, lo, hi, unroll or 1, trip)

    def rounds(self, hw: Hardware):
        """Per round: (start, transfer, compute, end), each round starting where the last ended."""
        return _timed(_round_costs(self.plan, self.t_c, hw), self.hidden, self.lo, self.hi, self.per_trip, self.trip)


def _round_costs(plan: list[Round], t_c: float, hw: Hardware) -> list[tuple[float, float, float]]:
    """Per round of ``plan``: its transfer's seconds, its dots' (``t_c``: all rounds' dots) and
    its synchronisation's."""
    return [(max(rnd.transfers) / hw.bandwidth if rnd.transfers else 0.0, rnd.compute * t_c,
             hw.step if rnd.transfers else 0.0) for rnd in plan]


def _timed(costs: list[tuple[float, float, float]], hidden: float, lo: int, hi: int, per_trip: int, trip: float):
    """:meth:`_Layout.rounds` of rounds costing ``costs`` (:func:`_round_costs`)."""
    now = 0.0
    for r, (transfer, compute, step) in enumerate(costs):
        length = hidden * max(compute, transfer) + (1 - hidden) * (compute + transfer)
        overhead = step
        if lo <= r < hi and (r - lo) % per_trip == per_trip - 1:  # the last round of a loop trip
            overhead += trip
        end = now + length + overhead
        yield now, transfer, compute, end
        now = end


@dataclass
class Prediction:
    hardware: str
    compute_s: float
    transfer_s: float
    serial_s: float
    overlapped_s: dict[str, float] = field(default_factory=dict)  # per variant
    speedup: dict[str, float] = field(default_factory=dict)
    variant: str = "uni"  # the variant the pass is emitting
    #: per variant, the share of its permutes the profile expects hidden (Hardware.overlap)
    overlap: dict[str, float] = field(default_factory=dict)
    #: per variant, the fraction of the full dot's throughput its ring's dots keep (Hardware.split)
    split_efficiency: dict[str, float] = field(default_factory=dict)
    #: the FLOP/s the dots were priced at, and whether that is the profile's default because it
    #: gives the dots' element type none of its own (Hardware.knows)
    throughput: float = 0.0
    throughput_assumed: bool = False

    def to_dict(self) -> dict:
        return {
            "hardware": self.hardware, "compute_s": self.compute_s, "transfer_s": self.transfer_s,
            "serial_s": self.serial_s, "overlapped_s": dict(self.overlapped_s), "speedup": dict(self.speedup),
            "variant": self.variant, "overlap": dict(self.overlap), "split_efficiency": dict(self.split_efficiency),
            "throughput": self.throughput, "throughput_assumed": self.throughput_assumed,
        }

    @property
    def chosen_speedup(self) -> float:
        return self.speedup[self.variant]

    @property
    def best(self) -> str:
        """The variant predicted fastest; on a tie the simpler one (``max`` keeps the first in
        ``VARIANTS``' order): a ring of 2, or a scatter whose blocks cannot be halved, goes one
        way in every variant."""
        return max(VARIANTS, key=self.speedup.__getitem__)


def overlapped_time(shape: SiteShape, hw: Hardware, bidirectional: bool, unroll: int | None, *,
                    plan: list[Round] | None = None, efficiency: float | None = None,
                    trip: float | None = None, hidden: float | None = None) -> float:
    """The end of :func:`schedule`'s last round (``plan``, ``efficiency``: as it takes them;
    ``trip``: the loop trip's cost, :meth:`Hardware.trip`, ``hidden``: the variant's
    :meth:`Hardware.hidden`, where the caller has them)."""
    return _last_end(_Layout.of(shape, hw, bidirectional, unroll, plan, efficiency, trip, hidden).rounds(hw))


def _last_end(timed) -> float:
    """The end of the last of ``timed``'s rounds (:func:`_timed`); 0 for none."""
    end = 0.0
    for _, _, _, end in timed:
        pass
    return end


def loop_trips(shape: SiteShape, bidirectional: bool, unroll: int | None) -> int:
    """The loop trips the rewrite emits for ``shape`` (the report's ``schedule.loop_trips``)."""
    lo, hi = _loop_run(_plan_of(shape, bidirectional)[1], unroll)
    return (hi - lo) // (unroll or 1)


def predict(shape: SiteShape, hw: Hardware, bidirectional: bool = False, unroll: int | None = 1) -> Prediction:
    rate = hw.throughput(shape.dtype)
    t_c = shape.flops / rate
    t_m = shape.transfer_bytes / hw.bandwidth
    serial = t_c + t_m + hw.step
    prediction = Prediction(hw.name, t_c, t_m, serial, variant=variant_name(bidirectional, unroll),
                            throughput=rate, throughput_assumed=not hw.knows(shape.dtype))
    # one way, both ways: the rounds, their dots' efficiency, each round's costs and signatures
    plans: dict[bool, tuple] = {}
    trip = hw.trip(shape.kind, shape.flops / shape.ring)
    for name, (bidi, unr) in VARIANTS.items():
        if bidi not in plans:
            plan, signatures, two_way = _plan_of(shape, bidi)
            efficiency = split_efficiency(shape, hw, bidi)
            t_c = shape.flops / rate / efficiency  # as _Layout.of
            plans[bidi] = efficiency, _round_costs(plan, t_c, hw), signatures, two_way
        efficiency, costs, signatures, two_way = plans[bidi]
        hidden = prediction.overlap[name] = hw.hidden(variant_name(two_way, unr))  # as emitted_variant
        lo, hi = _loop_run(signatures, unr)
        end = prediction.overlapped_s[name] = _last_end(_timed(costs, hidden, lo, hi, unr or 1, trip))
        prediction.speedup[name] = serial / end
        prediction.split_efficiency[name] = efficiency
    return prediction


def picked_variant(prediction: Prediction, shape: SiteShape, hw: Hardware, variant: str) -> str:
    """The variant a site of ``shape`` is emitted with: ``variant`` as the options name it, or,
    for ``"auto"``, the one predicted fastest (:func:`fallback_variant` where ``hw`` is assumed),
    as the pipeline picks it."""
    if variant != "auto":
        return variant
    return fallback_variant(shape) if hw.assumed else prediction.best


# ---------------------------------------------------------------------------- two-stage gathers
#: the options of a weight gathered in two stages (:func:`predict_two_stage`)
TWO_STAGE_OPTIONS = ("merged", "second", "neither")


def readable_seconds(seconds: float) -> str:
    """``seconds`` in ns, µs, ms or s, three significant digits (as report.duration)."""
    seconds = float(f"{seconds:.3g}")
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if abs(seconds) >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def gather_seconds(shard_bytes: float, n: int, hw: Hardware) -> float:
    """A plain all_gather of ``shard_bytes`` per device over ``n`` devices, nothing hiding it: the
    ring's ``n - 1`` transfers and one round's synchronisation, as :func:`predict` prices the
    original collective."""
    return shard_bytes * (n - 1) / hw.bandwidth + hw.step


@dataclass
class TwoStagePrediction:
    """A weight gathered over one group (``first_ring`` devices), then over another (the second
    stage, whose value the dot reads), priced three ways (per device, seconds):

    * ``merged``: one ring over both stages' groups (``first_ring · second ring`` devices,
      moving the first stage's shard each step): ``merged.overlapped_s[merged_variant]``;
    * ``second``: the first stage a plain all_gather, exposed, then the second stage's ring
      (moving the first stage's result each step): ``first_s + second.overlapped_s[...]``;
    * ``neither``: both plain gathers, then the dot: ``original_s = first_s + second.serial_s``.

    ``merged`` is None where the stages cannot merge."""

    hardware: str
    first_ring: int
    second_ring: int
    first_s: float
    second: Prediction
    second_variant: str
    merged: Prediction | None = None
    merged_variant: str | None = None
    #: the merged ring's own baseline: one plain gather over both groups, then the dot (one
    #: synchronisation less than the two stages'); its site is judged against it
    merged_serial_s: float | None = None
    #: why an option is not available beyond its time (--min-bytes), by option
    excluded: dict[str, str] = field(default_factory=dict)

    @property
    def original_s(self) -> float:
        return self.first_s + self.second.serial_s

    def seconds(self, option: str) -> float | None:
        if option == "merged":
            return self.merged.overlapped_s[self.merged_variant] if self.merged else None
        if option == "second":
            return self.first_s + self.second.overlapped_s[self.second_variant]
        return self.original_s

    def speedup(self, option: str) -> float | None:
        t = self.seconds(option)
        return self.original_s / t if t else None

    def pays(self, option: str, margin: float) -> bool:
        """Whether ``option`` beats the original by more than ``margin`` (``--policy auto``'s
        test); the merged ring also against its own baseline (one gather over both groups), as
        its site is then judged, and the second stage's ring passing this passes its own."""
        t = self.seconds(option)
        if t is None or option == "neither" or option in self.excluded:
            return False
        base = self.original_s if option == "second" else min(self.original_s, self.merged_serial_s)
        return base / t >= 1 + margin

    def choice(self, policy: str, margin: float) -> str:
        """``--policy auto``: the fastest option that pays (:meth:`pays`; the merge on a tie),
        else ``"neither"``.  ``--policy all``: the merge wherever the stages can merge (one ring
        over every transfer, as that policy rewrites every legal site; :meth:`preferred` says
        when the model would rather ring the second stage alone), else the second stage's ring
        (``"neither"`` only where --min-bytes excludes both)."""
        if policy == "auto":
            paying = [o for o in ("merged", "second") if self.pays(o, margin)]
            return min(paying, key=self.seconds) if paying else "neither"
        usable = [o for o in ("merged", "second") if self.seconds(o) is not None and o not in self.excluded]
        return usable[0] if usable else "neither"

    def preferred(self) -> str:
        """The option predicted fastest of the three, whatever the margin (the merge on a tie)."""
        return min((o for o in TWO_STAGE_OPTIONS if self.seconds(o) is not None), key=self.seconds)

    def why_neither(self) -> str:
        """Why no ring pays: the dot too short to hide the transfer, or the rings' own costs."""
        transfer = self.original_s - self.second.compute_s
        if self.second.compute_s < transfer:
            return (f"the dot ({readable_seconds(self.second.compute_s)} of compute) is too small to hide the two "
                    f"gathers ({readable_seconds(transfer)}, their synchronisation included): a ring hides at most "
                    "the compute")
        return ("the rings' own costs (a synchronisation per round, loop trips, the smaller dots' lost throughput) "
                "outweigh the transfer they hide")

    def describe(self) -> str:
        """Each option's predicted time and speed-up against the original, on one line."""
        def one(option: str, what: str, variant: str | None) -> str:
            t = self.seconds(option)
            if t is None:
                return f"{what}: cannot merge"
            extra = f"; {self.excluded[option]}" if option in self.excluded else ""
            return f"{what} {readable_seconds(t)} ({variant}, {self.speedup(option):.2f}x{extra})"
        n2 = self.second_ring
        merged = one("merged", f"merged ring over {self.first_ring * n2} devices", self.merged_variant)
        second = one("second", f"second stage's ring over {n2} devices after this gather "
                               f"({readable_seconds(self.first_s)} exposed)", self.second_variant)
        return (f"on {self.hardware}: {merged}; {second}; both plain gathers then the dot "
                f"{readable_seconds(self.original_s)}")

    def to_dict(self) -> dict:
        return {"hardware": self.hardware, "first_ring": self.first_ring, "second_ring": self.second_ring,
                "first_s": self.first_s, "original_s": self.original_s,
                "seconds": {o: self.seconds(o) for o in TWO_STAGE_OPTIONS},
                "variants": {"merged": self.merged_variant, "second": self.second_variant},
                "excluded": dict(self.excluded)}


def predict_two_stage(second: SiteShape, first_ring: int, first_step_bytes: int, hw: Hardware, variant: str = "auto",
                      mergeable: bool = True, min_bytes: int = 0) -> TwoStagePrediction:
    """Price a two-stage gather (:class:`TwoStagePrediction`): ``second`` is the second stage's
    site (its ring over the second group, each step moving the first stage's result),
    ``first_ring`` and ``first_step_bytes`` the first stage's group size and shard; ``variant``
    as Options.variant; ``mergeable``: whether the stages can be one gather."""
    bidi, unroll = VARIANTS.get(variant, (False, 1))
    ringed = predict(second, hw, bidi, unroll)
    ringed.variant = picked_variant(ringed, second, hw, variant)
    out = TwoStagePrediction(hw.name, first_ring, second.ring, gather_seconds(first_step_bytes, first_ring, hw),
                             ringed, ringed.variant)
    if second.transfer_bytes < min_bytes:
        out.excluded["second"] = f"moves {second.transfer_bytes} B, under --min-bytes {min_bytes}"
    if mergeable:
        shape = replace(second, ring=first_ring * second.ring, step_bytes=first_step_bytes)
        merged = predict(shape, hw, bidi, unroll)
        merged.variant = picked_variant(merged, shape, hw, variant)
        out.merged, out.merged_variant, out.merged_serial_s = merged, merged.variant, merged.serial_s
        if shape.transfer_bytes < min_bytes:
            out.excluded["merged"] = f"moves {shape.transfer_bytes} B, under --min-bytes {min_bytes}"
    return out


# ---------------------------------------------------------------------------- sanity numbers
def mlp_block(hw: Hardware, hidden: int, ffn: int, tokens: int, n: int = 8, dtype: str = "bf16",
              bidirectional: bool = False, unroll: int | None = 1, element_bytes: int = 2,
              variant: str | None = None) -> dict:
    """A sequence-parallel SwiGLU MLP block's two sites on ``n`` devices: the gathered
    activations feed the gate and up projections (one ring, two dots), the down projection
    is sum-scattered.  Returns serial and overlapped times, the block's speed-up and each
    site's variant (``variant="auto"``: each site the one :attr:`Prediction.best` picks)."""
    gather = SiteShape("all_gather_dot", n, 2 * (2 * tokens * hidden * (ffn // n)), (tokens // n) * hidden * element_bytes, dtype)
    scatter = SiteShape("dot_reduce_scatter", n, 2 * tokens * (ffn // n) * hidden, (tokens // n) * hidden * element_bytes, dtype)
    predictions = [predict(shape, hw, bidirectional, unroll) for shape in (gather, scatter)]
    variants = [p.best if variant == "auto" else p.variant for p in predictions]
    serial = sum(p.serial_s for p in predictions)
    overlapped = sum(p.overlapped_s[chosen] for p, chosen in zip(predictions, variants))
    return {"serial_s": serial, "overlapped_s": overlapped, "speedup": serial / overlapped, "variants": variants,
            "compute_to_transfer": predictions[0].compute_s / predictions[0].transfer_s}


# ---------------------------------------------------------------------------- all_reduce sites
#: the chunk counts the "chunk" strategy considers
CHUNK_COUNTS = (2, 4, 8)
ALL_REDUCE_STRATEGIES = ("split", "chunk")
#: split and chunk predicted within this fraction of each other's time tie, and chunk takes the
#: tie: below the model's resolution the lighter rewrite wins (no ring: fewer ops for the pass
#: to build; docs/variants.md), unless split's gather goes on to the next matmul's ring, which
#: hides it where the per-site prediction counts it whole (:meth:`AllReducePrediction.pick`).
#: Every pick of docs/variants.md's profile table is 5 % or more from a tie.
TIE = 0.01


@dataclass
class AllReducePrediction:
    """A dot → all_reduce site on ``hardware``: the original (the dots, then the all_reduce),
    "split" (the reduce-scatter ring of ``variant``, then an all_gather nothing is assumed to
    hide: where the gather reaches the next matmul's ring, that site hides it) and "chunk"
    (``chunks`` pieces, each piece's all_reduce behind the next piece's dot)."""

    hardware: str
    serial_s: float
    all_reduce_s: float
    split_s: float
    chunk_s: dict[int, float]
    variant: str
    ring: Prediction
    #: per chunk count: one chunk's dot and one chunk's all_reduce (the stages of chunk_pipeline)
    chunk_stages: dict[int, tuple[float, float]] = field(default_factory=dict)

    @property
    def chunks(self) -> int | None:
        """The chunk count predicted fastest (None: the dim cuts into none)."""
        return min(self.chunk_s, key=self.chunk_s.__getitem__) if self.chunk_s else None

    def seconds(self, strategy: str, chunks: int | None = None) -> float:
        if strategy == "split":
            return self.split_s
        return self.chunk_s[chunks or self.chunks]

    def speedup(self, strategy: str, chunks: int | None = None) -> float:
        return self.serial_s / self.seconds(strategy, chunks)

    @property
    def fastest(self) -> str:
        """The faster strategy, whether or not it beats the original: split only where it is
        predicted faster than chunk by more than :data:`TIE` (chunk takes a tie)."""
        return self.pick(gather_hidden=False)

    def pick(self, gather_hidden: bool) -> str:
        """:attr:`fastest`, but a tie goes to split where ``gather_hidden``: the psum's value goes
        on to a matmul through row-wise ops, where split's gather rings with it (hidden there;
        ``split_s`` counts it whole, so split is the faster of two that tie)."""
        if self.tied:
            return "split" if gather_hidden else "chunk"
        if self.chunk_s and self.seconds("split") >= self.seconds("chunk"):
            return "chunk"
        return "split"

    @property
    def tied(self) -> bool:
        """Are split and chunk predicted within :data:`TIE` of each other (:meth:`pick` says which takes it)?"""
        return bool(self.chunk_s) and abs(self.seconds("split") - self.seconds("chunk")) <= TIE * min(
            self.seconds("split"), self.seconds("chunk"))

    @property
    def best(self) -> str | None:
        """:attr:`fastest`; None where it does not beat the original."""
        return self.fastest if self.speedup(self.fastest) > 1 else None

    def to_dict(self) -> dict:
        return {"hardware": self.hardware, "serial_s": self.serial_s, "all_reduce_s": self.all_reduce_s,
                "split_s": self.split_s, "chunk_s": {str(k): v for k, v in self.chunk_s.items()},
                "variant": self.variant, "speedup": {"split": self.speedup("split"),
                                                     **({"chunk": self.speedup("chunk")} if self.chunk_s else {})},
                "chunks": self.chunks, "tied": self.tied,
                "chunk_stages": {str(k): list(v) for k, v in self.chunk_stages.items()}}


def chunk_pipeline(piece: float, reduce: float, chunks: int) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """The "chunk" strategy's schedule: ``chunks`` dots of ``piece`` seconds back to back on the
    compute stream, each chunk's all_reduce (``reduce`` seconds) on the collective stream as soon
    as its dot is done and the previous all_reduce has finished.  Returns (dot bars, all_reduce
    bars) as (start, length); the last all_reduce's end is the predicted time."""
    dots, reduces, reduce_end = [], [], 0.0
    for i in range(chunks):
        dots.append((i * piece, piece))
        start = max((i + 1) * piece, reduce_end)
        reduces.append((start, reduce))
        reduce_end = start + reduce
    return dots, reduces


def predict_all_reduce(scatter: SiteShape, hw: Hardware, variant: str, chunk_counts=CHUNK_COUNTS) -> AllReducePrediction:
    """``scatter``: the site as a reduce-scatter ring would see it (its blocks are the rows one
    device keeps); ``chunk_counts``: the counts the product can be cut into."""
    n = scatter.ring
    full_bytes = scatter.step_bytes * n
    t_dot = scatter.flops / hw.throughput(scatter.dtype)
    t_ar = hw.all_reduce_seconds(full_bytes, n)
    ring = predict(scatter, hw, *VARIANTS[variant])
    gather = (n - 1) * scatter.step_bytes / hw.bandwidth + hw.step
    chunk_s, stages = {}, {}
    for k in chunk_counts:
        piece = t_dot / k / hw.split("dot_reduce_scatter", scatter.flops / k)
        reduce = hw.all_reduce_seconds(full_bytes / k, n)
        stages[k] = (piece, reduce)
        start, length = chunk_pipeline(piece, reduce, k)[1][-1]
        chunk_s[k] = start + length
    return AllReducePrediction(hw.name, t_dot + t_ar, t_ar, ring.overlapped_s[variant] + gather, chunk_s, variant, ring,
                               stages)



def megatron_mlp_block(hw: Hardware, hidden: int, ffn: int, tokens: int, n: int = 8, dtype: str = "bf16",
                       variant: str = "uni", element_bytes: int = 2) -> dict:
    """A Megatron MLP block without sequence parallelism on ``n`` devices: the gate and up
    projections of the replicated ``tokens`` rows (no collective), then the down projection
    ``psum``-ed.  The psum site priced as :func:`predict_all_reduce` does (split: the scatter ring
    in ``variant`` and its gather, assumed unhidden; chunk: the fastest of 2, 4, 8 chunks), plus
    the projections' time.  Not priced: the norm and residual work "split" moves onto 1/n of the
    rows (memory-bound, small beside the dots at these shapes).  ``split_stack_s``: the block in
    a stack of such blocks, where the split's gather is carried into the next block's gather ring
    (the steady state is then a sequence-parallel block, :func:`mlp_block` in ``variant``)."""
    down = SiteShape("dot_reduce_scatter", n, 2 * tokens * (ffn // n) * hidden, (tokens // n) * hidden * element_bytes,
                     dtype)
    p = predict_all_reduce(down, hw, variant)
    up = 2 * (2 * tokens * hidden * (ffn // n)) / hw.throughput(dtype)
    serial, split, chunk = up + p.serial_s, up + p.split_s, up + p.chunk_s[p.chunks]
    stack = mlp_block(hw, hidden, ffn, tokens, n, dtype, *VARIANTS[variant], element_bytes=element_bytes)["overlapped_s"]
    return {"serial_s": serial, "split_s": split, "split_stack_s": stack, "chunk_s": chunk, "chunks": p.chunks,
            "split": serial / split, "split_stack": serial / stack, "chunk": serial / chunk,
            "all_reduce_share": p.all_reduce_s / serial}
