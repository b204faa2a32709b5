"""The whole step's answer under ``--policy auto``: no rewrite that the step's prediction says
makes the step slower.

Under ``--policy auto`` each site is taken where its own prediction pays (:mod:`.cost`). That
prediction prices the site's collective as the step waits for it; the step's schedule
(:mod:`.program_cost`) may find it running beside independent work instead (a backward's psum
of ``dx`` beside the ``dW`` dots, a scatter behind the next layer's matmuls), and the ring that
replaces it holds both streams: its gain there is negative. So after a try whose sites are all
decided, the pass schedules the step before and after. Where *after* is longer than *before*,
every place (a location in the source) whose rewritten sites, left as written, shorten *after*
is declined (``step``) and the pass runs again from the input; after :data:`ROUNDS` such
rounds, a step still predicted slower keeps every collective as written. The answer is then
never a slower step by the cost model: *after* ≤ *before*, or nothing rewritten.

This is a choice among legal rewrites, not a motion: it relies on no identity, and a site it
declines is left exactly as a ``policy`` decline leaves it. Where the step cannot be scheduled
(``program_cost`` failed on the module) the sites' own predictions stand.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar

from .report import SiteReport, durations

#: rounds of declining losing places before every place is declined
ROUNDS = 3
#: a place counts as slowing the step when leaving it as written shortens it by more than this
#: fraction of the step (schedules of the same graph differ by rounding only)
RESOLUTION = 1e-9

#: the places declined in this try: rendered location -> reason
_DECLINED: ContextVar[dict[str, str]] = ContextVar("cmatmul_pass_step_declined", default={})


@contextlib.contextmanager
def declining(places: dict[str, str]):
    """Within: the sites at ``places`` are declined (:func:`verdict`)."""
    token = _DECLINED.set(places)
    try:
        yield
    finally:
        _DECLINED.reset(token)


def verdict(entry: SiteReport) -> tuple[str, str] | None:
    """("step", why) where the whole step's prediction declined ``entry``'s place, else None."""
    why = _DECLINED.get().get(entry.location)
    return ("step", why) if why is not None else None


def losing_places(program, report, round_: int) -> dict[str, str]:
    """The places to decline after the ``round_``-th try (rendered location -> reason): none
    where ``program`` (:class:`.program_cost.Program`, the input) is not predicted slower with
    ``report``'s rings; after :data:`ROUNDS` rounds, every rewritten place; after that, none (what
    is still rewritten is not a place's to decline)."""
    from . import program_cost

    if round_ > ROUNDS + 1:  # every place declined already: what is left rewritten is no place's to decline
        return {}
    before, after, changes = program_cost.step_changes(program, report)
    if after <= before * (1 + RESOLUTION):
        return {}
    texts = durations(after, before, *(abs(c) for c in changes.values()))
    added = dict(zip(changes, texts[2:]))
    hardware = f"{program.partitions}×{program.hw.name}" if program.partitions > 1 else program.hw.name
    slower = f"with the rings taken, this step on {hardware} is predicted {texts[0]} against {texts[1]} as written"
    if round_ > ROUNDS:
        return {site.location: f"{slower}, and declining the places that slow it did not make it faster: every "
                               "collective stays as written"
                for site in report.rewritten}
    losers = {location: f"{slower}; this place's rings add {added[location]} to it (its collective runs beside "
                        "other work in the step as written)"
              for location, change in changes.items() if change < -before * RESOLUTION}
    if not losers:  # the step is slower as a whole, though no one place is: leave the worst for next round
        worst = min(changes, key=changes.get, default=None)
        if worst is not None:
            losers[worst] = f"{slower}; this place's rings add the most to it"
    return losers
