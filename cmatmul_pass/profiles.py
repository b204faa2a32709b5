"""Hardware profiles: what a machine's dots, links and loops cost.

:class:`Hardware` holds a machine's numbers (dense throughput per element type, link
bandwidth, a cost per round and per loop trip, how much of the full dot's throughput a ring
step's smaller dot keeps, the share of each variant's permutes the compiler's schedule hides);
:data:`PROFILES` the machines the cost model knows, the H100 and H200 measured on one GPU of
each (docs/gpu.md); :func:`hardware` reads ``--hardware`` (a profile's name, ``auto``, and
overrides).  The per-site predictions that use them are in :mod:`.cost`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

from .errors import CmatmulError
from .ring_plan import VARIANTS

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
    #: one device's memory (bytes; 0: not known): a region whose single value as written is larger
    #: cannot run as written, which ``--policy auto`` weighs above the predicted time
    memory: float = 0.0

    def holds(self, nbytes: float) -> bool:
        """Whether one value of ``nbytes`` fits in a device's memory (True where it is not known)."""
        return not self.memory or nbytes <= self.memory

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


#: Read from XLA's schedule of the training steps compiled for 8 H100s (tools/gpu_topology.py,
#: jax 0.11.2, ring_compiler_options): the 8B step (tools/gpu_measurements/h100_topology_8b.json,
#: 2026-11-26) and the 70B step (h100_topology_70b.json, 2026-11-27), permutes overlapped with a dot
#: as executed, pooled. uni and unroll2 hid every permute.
H100_OVERLAP = {"full": 202 / 210, "bidi": 298 / 308, "bidi-unroll2": 289 / 308, "bidi-full": 304 / 308}

#: The same, read from the 8B and 70B steps compiled for 8 H200s
#: (tools/gpu_measurements/h200_topology_{8b,70b}.json, the same flags), both models pooled: uni and unroll2 hid
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
    # tools/gpu_measurements/h100_calibrate_{70b,8b,3b}.json (the 3B file: three runs of 2026-11-27),
    # merged by tools/gpu_profile.py, the three 3B runs by their medians): XLA's bf16 dot at 634 TFLOP/s (989
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
                     all_reduce_bandwidth=NVLS_ALL_REDUCE * 450e9, memory=80e9),
    # Calibrated on an H200 (tools/gpu_checks.sh calibrate + extras, jax 0.11.2;
    # tools/gpu_measurements/h200_calibrate_{70b,8b,3b}.json, merged by tools/gpu_profile.py): the straight-line
    # splits at each step's FLOPs, the gate and up dots merged at their own step (12.9, 30.1 and
    # 120 GFLOP), the contracting and batch roles' own points, loop trips per kind, and every
    # element type's rate measured as XLA's dot (the medians over the three runs): fp8 reached
    # only 1.2x bf16, i32 a hundredth of it (no integer tensor-core path for i32 dots).  NVLink 4 as
    # H100 (not measured: one GPU).  Overlap: read from XLA's schedule of the 8B and 70B steps
    # compiled for 8 H200s (tools/gpu_measurements/h200_topology_{8b,70b}.json), H200_OVERLAP.
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
                     all_reduce_bandwidth=NVLS_ALL_REDUCE * 450e9, memory=141e9),
    # 312 TFLOP/s bf16 peak (~250 achieved), 19.5 f64 (~15.6); no f8 units: f8 dots run
    # converted, at bf16's rate.  NVLink 3: 300 GB/s per direction.
    "a100": Hardware("A100 SXM (NVLink 3)", {"bf16": 250e12, "f16": 250e12, "f32": 125e12, "f8": 250e12,
                                            "f64": 15.6e12, "i8": 500e12, "i32": 20e12, "default": 250e12},
                     300e9, memory=80e9),
    # 197 TFLOP/s bf16 peak (~160 achieved); no f8 units (f8 at bf16's rate) and no f64 ones (f64
    # is emulated; no figure, so it is priced at the default and the report says so).  ICI ~50 GB/s
    # per direction per link (assumed; override it).
    "tpu-v5e": Hardware("TPU v5e (ICI)", {"bf16": 160e12, "f32": 40e12, "f8": 160e12, "i8": 320e12,
                                          "default": 160e12}, 50e9, step=3e-6, loop_trip=1e-6, memory=16e9),
}


#: ``device_kind`` substrings (as jax reports them, e.g. "NVIDIA H100 80GB HBM3", "TPU v5 lite")
#: and the profile each selects, for ``hardware("auto")``
DEVICE_KINDS = (("h200", "h200"), ("h100", "h100"), ("a100", "a100"), ("tpu v5 lite", "tpu-v5e"), ("tpu v5e", "tpu-v5e"))
#: what ``"auto"`` falls back to on a device no profile describes (a CPU, say)
FALLBACK_PROFILE = "h100"


def profile_for(device_kind: str) -> str | None:
    """The profile describing a device of this ``device_kind``; None: no profile does."""
    kind = device_kind.lower()
    return next((name for needle, name in DEVICE_KINDS if needle in kind), None)


def _device_kind() -> str:
    import jax

    return jax.devices()[0].device_kind


#: the overrides that set one number of a profile
SCALAR_OVERRIDES = ("bandwidth", "all_reduce_bandwidth", "step", "loop_trip", "split_efficiency", "memory")
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
        may_be_zero = key in ("step", "loop_trip", "memory")
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
