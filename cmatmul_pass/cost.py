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

This module prices a site; the machines are :mod:`.profiles` (:class:`Hardware`, :data:`PROFILES`,
:func:`hardware`) and the rounds of each variant :mod:`.ring_plan` (:class:`SiteShape`,
:func:`rounds`, :func:`loop_run`), both re-exported here: ``cost.PROFILES``, ``cost.SiteShape``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from .profiles import (  # noqa: F401  (re-exported: cost.Hardware, cost.PROFILES, cost.hardware, ...)
    DEFAULT_LOOP_TRIP, DEVICE_KINDS, DTYPE_OVERRIDES, FALLBACK_PROFILE, H100_OVERLAP, H200_OVERLAP, KIND_NAMES,
    NVLS_ALL_REDUCE, POINT_FIELDS, POINT_ROLES, PROFILES, SCALAR_OVERRIDES, SHORT_NAMES, STEP_8B, STEP_70B, Hardware,
    Points, dtype_family, hardware, interpolate, point_key, profile_for)
from .ring_plan import (  # noqa: F401  (re-exported: cost.SiteShape, cost.VARIANTS, cost.rounds, ...)
    VARIANTS, GatherStream, Round, SiteShape, _halves, _loop_run, _plan_of, _ring_plan, _variant_of,
    emitted_variant, gather_signatures, gather_streams, loop_run, loop_trips, rounds, scatter_signatures,
    step_dot_flops, variant_name)

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
