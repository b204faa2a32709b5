"""A scatter and a gather over other device groups that meet at one dot: which gets the ring.

On a 2-D mesh a dot's operand may be ``all_gather``-ed over one axis along the dim its product
is ``reduce_scatter``-ed over the other (the forward: a weight's FSDP gather over 'data', the
product scattered over 'model'; the backward: the cotangent's gather over 'model', the weight
gradient scattered over 'data').  Both rings would slice the dot along the same dim, nested; the
pass builds one of them.  The scatter matcher declines such a scatter (``gathered_operand``)
and :func:`resolve` decides, for each, whether the scatter takes the dot instead:

* **prefetched** — the gather has independent compute before the dot to hide behind
  (:mod:`.analysis.slack`): it stays a plain ``all_gather``, which XLA's latency-hiding
  scheduler sends early, and the scatter, which can start only after the dot, has the ring.
* **shared** — the gather has nothing to hide behind but its ring has other dots to compute
  (the backward's ``dx`` beside ``dW``): the gather's ring computes those and assembles the
  gathered value, and the scatter's ring slices that value for its own dot.  Identity: the
  gathered value is the same whether assembled whole or received block by block, so
  ``rs(G·b) = ring_rs(assembled(G)·b)``; the rings run one after the other (the scatter's reads
  the gather's assembled value), never nested, so each group's permutes are in the order every
  device issues them.  Taken where the cost model predicts the pair faster so than with the
  gather's ring computing every dot and the scatter plain:
  ``ring(G, others) + ring(S) < ring(G, all) + plain(S)``, by more than :data:`.cost.TIE`.

Side conditions checked: the two collectives' groups differ (over the same groups the pair is
an all-reduce in disguise, left to the gather); the gather matches as a ring site now; the
rematched scatter is a ring site with the gather treated as a plain value
(``ModuleInfo.plain_gathers``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from . import cost
from ._jax_private import ir
from .analysis.slack import SiteSlack, Slack
from .errors import Decline
from .matchers import AllGatherSite, DeclinedSite, ModuleInfo, ReduceScatterSite, Site, match_all_gather, match_reduce_scatter
from .matchers.common import collective_ring
from .matchers.reduce_scatter import first_dot
from .profiles import Hardware
from .sites import dot_flops, site_shape

if TYPE_CHECKING:
    from .pipeline import Options


@dataclass(frozen=True)
class Paired:
    """The gather a scatter took the ring from, and how it fares (:func:`resolve`)."""

    gather: ir.OpView
    how: str  # "prefetched" | "shared" | "kept" (the gather keeps the dot: the pair's rings would not pay)
    slack: SiteSlack
    #: "shared": the pair's predicted seconds, the gather's ring computing every dot (the scatter
    #: plain) and the two rings (the gather's over its other dots)
    seconds: tuple[float, float] | None = None


def resolve(op: ir.OpView, site: Site, info: ModuleInfo, hw: Hardware, options: "Options") -> tuple[Site, Paired | None]:
    """A scatter declined ``gathered_operand`` over other groups than its operand's gather:
    the site to apply instead and the gather it is paired with, or ``site`` and None (the
    gather keeps the dot).  The pair's rings are priced in ``options.variant`` ("auto": each in
    its fastest), under policy all as built, else each no slower than left as written; without
    ``options.assemble`` the gather's ring could not assemble the value, and no pair is shared."""
    if not isinstance(site, DeclinedSite) or site.code != "gathered_operand" or site.ring is None:
        return site, None
    dot = first_dot(op.operation.operands[0])
    if dot is None:
        return site, None
    slack = Slack(dot_flops)
    for operand in dot.operation.operands:
        gather = operand.owner
        if isinstance(gather, ir.Block) or gather.operation.name != "stablehlo.all_gather":
            continue
        try:
            ring, _ = collective_ring(gather, info)
        except Decline:
            continue
        if {frozenset(g) for g in ring.groups} == {frozenset(g) for g in site.ring.groups}:
            continue  # the same groups: gather and scatter are an all-reduce in disguise
        hidden = slack.of(gather, [dot])
        whole = None if hidden.hiding_flops > 0 else match_all_gather(gather, info)
        if whole is not None and not (options.assemble and _others(whole, dot)):
            continue  # nothing to send it behind and no other dot: its own ring hides it, as before
        info.plain_gathers.add(gather.operation)
        again = match_reduce_scatter(op, info)
        if isinstance(again, ReduceScatterSite):
            if whole is None:
                return again, Paired(gather, "prefetched", hidden)
            seconds = _pair_seconds(whole, dot, again, hw, options.variant, options.policy == "all")
            if seconds[1] < seconds[0] * (1 - cost.TIE):
                return again, Paired(gather, "shared", hidden, seconds)
            info.plain_gathers.discard(gather.operation)
            return site, Paired(gather, "kept", hidden, seconds)
        info.plain_gathers.discard(gather.operation)
    return site, None


def _others(site: Site, dot: ir.OpView) -> tuple:
    """The dots of a gather's ring other than ``dot`` (none where it does not match)."""
    if not isinstance(site, AllGatherSite):
        return ()
    return tuple(c for c in site.consumers if c.dot.operation != dot.operation)


def _pair_seconds(gather: AllGatherSite, dot: ir.OpView, scatter: ReduceScatterSite, hw: Hardware,
                  variant: str, forced: bool) -> tuple[float, float]:
    """(the gather's ring over every dot + the scatter plain, the gather's ring over its other
    dots + the scatter's ring), as the cost model predicts them."""
    whole = cost.predict(site_shape(gather), hw)
    rest = cost.predict(site_shape(replace(gather, consumers=_others(gather, dot))), hw)
    ring = cost.predict(site_shape(scatter), hw)
    plain = ring.serial_s - ring.compute_s
    return (_ring_s(whole, variant, forced) + plain,
            _ring_s(rest, variant, forced) + _ring_s(ring, variant, forced))


def _ring_s(prediction: cost.Prediction, variant: str, forced: bool) -> float:
    """A site's predicted seconds in ``variant`` (else its fastest); not ``forced``: no slower
    than left as written, as policy auto leaves a ring that does not pay."""
    times = prediction.overlapped_s
    ring = times[variant] if variant in times else min(times.values())
    return ring if forced else min(ring, prediction.serial_s)


def describe(paired: Paired, where: str) -> str:
    """The scatter's note on the gather it is paired with (at ``where``): why it has the ring, or
    (``kept``) why not."""
    if paired.how == "prefetched":
        return (f"the gather of its dot's operand at {where} (over other device groups) stays a plain all_gather, "
                f"sent early behind {paired.slack.hiding_flops:.3g} FLOP of compute before the dot; this scatter, "
                "which can start only after the dot, has the ring")
    before, after = paired.seconds
    if paired.how == "kept":
        return (f"its ring would slice the gathered value the gather's ring (at {where}) assembles over its other "
                f"dots: predicted {cost.readable_seconds(after)} for the two rings against "
                f"{cost.readable_seconds(before)} with the gather's ring computing this dot too, which it keeps")
    return (f"the gather of its dot's operand at {where} (over other device groups, nothing before the dot to send "
            "it behind) rings over its other dots and assembles the gathered value, which this scatter's ring "
            f"slices: predicted {cost.readable_seconds(after)} for the two rings against "
            f"{cost.readable_seconds(before)} with the gather's ring computing this dot too and the scatter plain")
