"""Ring plans: the rounds a ring of each variant runs, and the loop it puts them in.

What the rewrites emit, seen by the cost model: a site's shape (:class:`SiteShape`), the rounds
of its ring (:func:`rounds`: which direction sends, which computes, the size of each round's
dots), the run of identical rounds that becomes the ``stablehlo.while`` (:func:`loop_run`, the
rewrites' own rule) and what the report's ``schedule`` says of it (:func:`emitted_variant`,
:func:`loop_trips`).  Nothing here knows a machine: :mod:`.profiles` prices the plans,
:mod:`.cost` times them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

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


def emitted_variant(shape: SiteShape, bidirectional: bool, unroll: int | None) -> str:
    """The variant the rewrite emits for ``shape``: asked for both directions, a ring of 2 and a
    scatter whose blocks cannot be halved still go one way."""
    return variant_name(_plan_of(shape, bidirectional)[2], unroll)


def _variant_of(plan: list[Round], unroll: int | None) -> str:
    return variant_name(any(len(rnd.transfers) > 1 for rnd in plan), unroll)


def loop_trips(shape: SiteShape, bidirectional: bool, unroll: int | None) -> int:
    """The loop trips the rewrite emits for ``shape`` (the report's ``schedule.loop_trips``)."""
    lo, hi = _loop_run(_plan_of(shape, bidirectional)[1], unroll)
    return (hi - lo) // (unroll or 1)
