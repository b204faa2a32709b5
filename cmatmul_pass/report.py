"""The per-site report: what the pass found, what it did and why."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

from . import ir_utils
from ._jax_private import ir


class _OnFirstRead:
    """A dataclass field that may be set to a function of no arguments: called when the field is
    first read, its result kept (the step's prediction schedules the whole step, several times;
    a caller that never reads it does not pay for it).  Unset, the field reads ``{}``."""

    def __set_name__(self, owner, name: str) -> None:
        self.attr = f"_{name}"

    def __get__(self, obj, owner=None):
        if obj is None:
            return None  # what the dataclass takes for the field's default (read as {})
        value = obj.__dict__.get(self.attr)
        if value is None:
            return {}
        if callable(value):
            value = obj.__dict__[self.attr] = value()
        return value

    def __set__(self, obj, value) -> None:
        obj.__dict__[self.attr] = value


@dataclass
class SiteReport:
    """One site: what the pass found, did and predicted.  Read it, do not edit it: the entries of
    identical layers' regions that the pass replayed (:mod:`cmatmul_pass.replay`) share their
    lists and dicts, channel handles aside."""

    kind: str
    location: str
    function: str
    rewritten: bool
    reason: str = ""
    reason_code: str = ""
    ring_size: int | None = None
    replica_groups: list[list[int]] | None = None
    operand: str | None = None  # "lhs" / "rhs": which dot operand the collective feeds
    dim_role: str | None = None  # "free" / "contracting" / "batch"
    collective_dim: int | None = None
    shard_shape: list[int] | None = None
    dtype: str | None = None
    bytes_per_step: int | None = None  # one shard, as one permute moves it
    bytes_moved: int | None = None  # per device, over the whole ring
    channel_handles: list[int] = field(default_factory=list)
    # the private function holding this site's ring when it repeats an earlier site's
    # pattern (the site became a func.call of it; see cmatmul_pass.sharing)
    shared_ring: str | None = None
    # the dots the ring computes: {location, operand, dim_role, look_through: [layout op names]}
    consumers: list[dict] = field(default_factory=list)
    # readers of the gathered value outside the ring, fed by the copy the loop assembles
    assembled_for: list[str] = field(default_factory=list)
    # how the ring was emitted: directions, rounds, loop trips, rounds per trip, peeled rounds,
    # permutes executed per device, whether streams are annotated
    schedule: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # variant options that could not apply, and why
    # the cost model's prediction (cmatmul_pass.cost): compute/transfer/serial seconds, overlapped
    # seconds and speed-up per variant, the variant emitted, the hardware profile
    cost: dict = field(default_factory=dict)
    # a dot → all_reduce site: {strategy: split/chunk, dim, chunks, gathers: [where each gather
    # of its rows went], prediction: cost.AllReducePrediction.to_dict()}; empty for other kinds
    all_reduce: dict = field(default_factory=dict)
    # an all_to_all pair (kind all_to_all_chunk): {dim, combine, combine_dim, exchanged, chunks,
    # prediction: exchanges.predict's seconds}; empty for other kinds
    all_to_all: dict = field(default_factory=dict)
    # an attention ringed with an online softmax (kind ring_attention): {values: V's gather,
    # blocks, block_keys, memory: attention.memory's bytes, prediction: attention.predict's seconds};
    # on the keys' gather of an attention left with two rings: {two_rings: the reason code}; on the
    # first gather of a region over gathered columns left as written: {passes_declined: the reason code};
    # a region over gathered columns (kind column_passes): {passes, blocks, block_keys, statistics, merged,
    # scattered, memory: column_rings.memory's bytes, prediction: column_rings.predict's seconds}
    attention: dict = field(default_factory=dict)
    # a gather another collective competed with for its dot (analysis.slack): {early, hiding_flops,
    # competes_with: that collective's location}; empty where none did
    slack: dict = field(default_factory=dict)
    # a collective the pass moved to its matmul (merged with a second stage, hoisted, sunk into a
    # loop, carried past row-wise ops): the reason code it was declined for where it stood; None
    # for any other
    moved_from: str | None = None
    #: other collectives of the input this site replaces, where they stood (a two-stage gather's
    #: first stage merged into its ring; an all_to_all pair's combine): gone with the site's own
    absorbs: list[str] = field(default_factory=list)
    #: which of the sites a model repeats at this location this one is, where the module says:
    #: "layer 2 of 4" (the k-th shard_map region at one place; a backward's counted from the end)
    #: or "each of the 4 trips of the loop at f.py:9:3" (cmatmul_pass.program_cost.annotate)
    layer: str | None = None

    @property
    def place(self) -> str:
        """The location, and the layer where one is known: what the site's lines name."""
        return f"{self.location}, {self.layer}" if self.layer else self.location

    def summary_line(self) -> str:
        ring = f" ring={self.ring_size}" if self.ring_size else ""
        if self.rewritten:
            dots = f", {len(self.consumers)} dots" if len(self.consumers) > 1 else ""
            kept = f", assembles the gathered value for {len(self.assembled_for)} other reader(s)" if self.assembled_for else ""
            shared = f", calls the shared ring {self.shared_ring}" if self.shared_ring else ""
            if self.kind == "all_to_all_chunk":
                a = self.all_to_all
                return (f"{self.place}: {self.kind}: rewritten{ring} (chunk: {a['chunks']} all_to_all pairs along "
                        f"{'' if a['mode'] == 'free' else 'the ' + a['mode'] + ' '}dim {a['dim']})")
            if self.kind == "ring_attention":
                a = self.attention
                return (f"{self.place}: {self.kind}: rewritten{ring} (one ring of {a['blocks']} blocks of "
                        f"{a['block_keys']} keys and values, online softmax; V gathered at {a['values']})")
            if self.kind == "column_passes":
                a = self.attention
                return (f"{self.place}: {self.kind}: rewritten{ring} ({a['passes']} passes over {a['blocks']} "
                        f"blocks of {a['block_keys']} columns: {a['statistics']} statistics, {a['merged']} merged "
                        f"into their max's pass, {a['scattered']} scattered back; absorbs {len(self.absorbs)} "
                        "collectives)")
            if self.all_reduce.get("strategy") == "chunk":
                return f"{self.place}: {self.kind}: rewritten{ring} (chunk: {self.all_reduce['chunks']} all_reduces along dim {self.all_reduce['dim']})"
            if self.all_reduce.get("picked") == "summed value":  # (psums.split_summed_value)
                gathers = "; ".join(self.all_reduce["gathers"]) or "none left"
                return (f"{self.place}: {self.kind}: rewritten{ring} (split along dim {self.all_reduce['dim']}: a "
                        f"reduce-scatter, no matmul producing the summed value; gathered {gathers})")
            if self.all_reduce:
                gathers = "; ".join(self.all_reduce["gathers"]) or "none left"
                shared += f"; split: reduce-scatter ring along dim {self.all_reduce['dim']}, gathered {gathers}"
            return (
                f"{self.place}: {self.kind}: rewritten{ring} "
                f"({self.operand} operand, {self.dim_role} dim {self.collective_dim}{dots}{kept}{shared})"
            )
        left = "moved, then not rewritten" if self.moved_from is not None else "left unchanged"
        return f"{self.place}: {self.kind}: {left}{ring}: {self.reason} [{self.reason_code}]"


@dataclass
class Report:
    source: str
    num_partitions: int | None
    sites: list[SiteReport] = field(default_factory=list)
    #: identical layers' regions rewritten once: each function holding a rewritten layer
    #: (``@cmatmul_layer_<k>``, :mod:`cmatmul_pass.replay`) -> the locations of the regions calling it
    layers: dict[str, list[str]] = field(default_factory=dict)
    #: with ``replay.CHECK``: each group's check, ``{"first": location, "last": location, "agreed": bool}``
    #: (the last region rewritten the usual way too, against the first; not agreed: the group's
    #: regions are rewritten the usual way)
    layer_checks: list[dict] = field(default_factory=list)
    #: layers rewritten as a trimmed copy of another (``replay.Trim``: a first layer's backward, which
    #: returns no input gradient): each such function -> {"of": the function it trims, "called_at": location}
    trimmed: dict[str, dict] = field(default_factory=dict)
    #: the whole step's predicted time before and after the rewrite on the options' hardware
    #: (:class:`cmatmul_pass.program_cost.ProgramPrediction` as a dict); empty where none was made;
    #: computed when first read
    program: dict = _OnFirstRead()
    #: the program's size in the ops XLA compiles, before and after, and the compile-time ratio
    #: it predicts (:mod:`cmatmul_pass.compile_budget`): ``{"original_ops", "rewritten_ops",
    #: "predicted_ratio", "budget"}``; computed when first read
    compile: dict = _OnFirstRead()

    @property
    def rewritten(self) -> list[SiteReport]:
        return [s for s in self.sites if s.rewritten]

    @property
    def declined(self) -> list[SiteReport]:
        return [s for s in self.sites if not s.rewritten]

    def to_dict(self) -> dict:
        return {
            "source": self.source,
            "num_partitions": self.num_partitions,
            "sites": [asdict(s) for s in self.sites],
            "layers": self.layers,
            **({"layer_checks": self.layer_checks} if self.layer_checks else {}),
            **({"trimmed": self.trimmed} if self.trimmed else {}),
            **({"program": self.program} if self.program else {}),
            **({"compile": self.compile} if self.compile else {}),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    def summary(self) -> str:
        """One line: the sites rewritten, of how many; then, where the pass predicted it, the
        step's time before and after (:meth:`program_line`)."""
        program = self.program_line()
        return self.sites_line() + (f"\n{program}" if program else "")

    def program_line(self) -> str:
        """The step's predicted time before → after on the hardware, and the places carrying
        most of the difference; empty where no prediction was made."""
        p = self.program
        if not p or "before_s" not in p:
            return ""
        before, after = p["before_s"], p["after_s"]
        devices = f"{p['partitions']}×" if p.get("partitions", 1) > 1 else ""
        places = p.get("places", [])
        texts = durations(before, after, *(abs(seconds) for _, seconds in places))
        line = f"this step on {devices}{p['hardware']}: predicted {texts[0]} → {texts[1]}"
        if not self.rewritten:
            return line + " (no site rewritten)"
        line += f" ({before / after:.2f}x)" if after else ""
        if places:
            most = "gain" if after < before else "loss"
            line += f"; most of the {most}: " + ", ".join(f"{loc} ({text})" for (loc, _), text in zip(places, texts[2:]))
        notes = []
        stepped = sum(1 for site in self.sites if site.reason_code == "step")
        if stepped:
            notes.append(f"{stepped} site(s) left as written by the step's answer [step]")
        too_big = sum(1 for site in self.rewritten if any(n.startswith("taken whatever the prediction")
                                                          for n in site.notes))
        if too_big:
            notes.append(f"as written the step cannot run: {too_big} site(s) hold a value larger than one "
                         "device's memory")
        if p.get("unknown_trips"):
            notes.append(f"{p['unknown_trips']} loop(s) of unknown trip count counted once")
        if p.get("unplaced"):
            notes.append(f"{p['unplaced']} rewritten site(s) not placed in the schedule")
        return line + (f" ({'; '.join(notes)})" if notes else "")

    def compile_line(self) -> str:
        """The rewritten program's predicted compile time over the original's, and its budget."""
        c = self.compile
        if not c:
            return ""
        budget = f"; budget {c['budget']:g}x" if c.get("budget") else ""
        return (f"XLA compile time: predicted {c['predicted_ratio']:.2f}x the original's ({c['original_ops']} → "
                f"{c['rewritten_ops']} ops XLA compiles{budget})")

    def sites_line(self) -> str:
        """How many candidate sites were rewritten, shared, replayed as layers."""
        line = f"{len(self.rewritten)} of {len(self.sites)} candidate site(s) rewritten"
        shared = [s.shared_ring for s in self.rewritten if s.shared_ring]
        if shared:
            line += f" ({len(shared)} calling {len(set(shared))} shared ring function(s))"
        if self.layers:
            calls = sum(map(len, self.layers.values()))
            line += f"; {calls} identical layers are calls of {len(self.layers)} rewritten one(s)"
        if self.trimmed:
            line += f"; {len(self.trimmed)} more a trimmed copy of one (fewer results, no ops only those need)"
        for trimmed, what in ((False, "group(s) checked against their last layer"),
                              (True, "trimmed layer(s) checked against a rewrite of their own")):
            checks = [check for check in self.layer_checks if bool(check.get("trimmed")) == trimmed]
            if checks:
                line += f"; {len(checks)} {what}, {sum(1 for check in checks if not check['agreed'])} differed"
        return line


def duration(seconds: float) -> str:
    """``seconds`` in the unit that keeps it readable (ns, µs, ms, s), three significant digits."""
    unit, scale = time_unit(seconds)
    return f"{float(f'{seconds:.3g}') / scale:.3g} {unit}"


def time_unit(seconds: float) -> tuple[str, float]:
    """The unit (s, ms, µs, ns) ``seconds`` reads best in, and its scale: ``("µs", 1e-6)``."""
    seconds = float(f"{seconds:.3g}")  # rounded first: 999.6 µs is 1 ms, not 1e+03 µs
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if abs(seconds) >= scale:
            return unit, scale
    return "ns", 1e-9


def durations(*seconds: float) -> list[str]:
    """Each of ``seconds`` in one unit, the one the largest reads best in, to the decimals that
    give the largest three significant digits: ``1.23 ms``, ``0.05 ms``; a value too small to
    show at them is ``<0.01 ms``."""
    largest = max((abs(s) for s in seconds), default=0.0)
    unit, scale = time_unit(largest)
    decimals = max(0, 2 - math.floor(math.log10(float(f"{largest / scale:.3g}")))) if largest else 0
    least = 10.0 ** -decimals
    texts = []
    for s in seconds:
        value = s / scale
        if value and abs(value) < least / 2:
            texts.append(f"{'-' if value < 0 else ''}<{least:.{decimals}f} {unit}")
        else:
            texts.append(f"{value:.{decimals}f} {unit}")
    return texts


def element_bits(element_type: ir.Type) -> int:
    """Bits per element: a complex number's two parts, an integer's or float's width (i4 and
    f4E2M1FN are 4)."""
    if isinstance(element_type, ir.ComplexType):
        return 2 * element_bits(ir.ComplexType(element_type).element_type)
    return getattr(element_type, "width", 0)


#: _shard_facts' answers by type: a model's layers repeat a few types (MLIR uniques them, so the
#: type is its own key).  A type keeps its context alive: :func:`forget_types` empties it after
#: each pass run.
_FACTS: dict = {}


def _shard_facts(t: ir.Type) -> tuple[tuple[int, ...], str, int] | None:
    """(shape, element type, bytes) of a static tensor type; None for any other."""
    if t in _FACTS:
        return _FACTS[t]
    try:
        ranked = ir.RankedTensorType(t)
    except ValueError:
        ranked = None
    facts = None
    if ranked is not None and ranked.has_static_shape:
        facts = tuple(ranked.shape), str(ranked.element_type), tensor_bytes(ranked)
    _FACTS[t] = facts
    return facts


def forget_types() -> None:
    """Drop the cached type facts (and the contexts their types keep alive)."""
    _FACTS.clear()


def tensor_bytes(t: ir.RankedTensorType) -> int:
    """Bytes of the tensor's elements, sub-byte elements packed (as XLA stores them on GPUs)."""
    count = 1
    for d in t.shape:
        count *= d
    return -(-count * element_bits(t.element_type) // 8)


def collective_entry(kind: str, op: ir.OpView, ring, source: str) -> SiteReport:
    """A not-yet-rewritten entry for the collective ``op`` of a site of ``kind`` over ``ring``
    (None: unknown): its place, its groups and its operand's shape and bytes."""
    entry = SiteReport(kind=kind, location=ir_utils.render_location(op.location, source),
                       function=ir_utils.enclosing_func_name(op), rewritten=False)
    if ring is not None:
        entry.ring_size = ring.size
        entry.replica_groups = [list(g) for g in ring.groups]
    describe_shard(entry, op.operation.operands[0], None)
    return entry


def describe_shard(site: SiteReport, shard: ir.Value, ring_size: int | None) -> None:
    """Fill the shape/dtype/bytes fields from the value a ring passes around."""
    facts = _shard_facts(shard.type)
    if facts is None:
        return
    shape, site.dtype, site.bytes_per_step = facts
    site.shard_shape = list(shape)
    if ring_size:
        site.bytes_moved = site.bytes_per_step * (ring_size - 1)
