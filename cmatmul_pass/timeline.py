"""The predicted schedule of each site as a Gantt chart (``explain --plot timeline.png``).

Per site, two lanes pairs: the original program (the whole collective on the collective
stream, then the dots on the compute stream — or the dots first for a scatter) above, and
the rewritten ring below (each round's dots on the compute stream while its permutes run
on the collective stream), on the cost model's time axis (:mod:`cmatmul_pass.cost`).
"""

from __future__ import annotations

from pathlib import Path

from . import cost
from .errors import CmatmulError
from .report import Report

COMPUTE, COLLECTIVE = "#4C72B0", "#DD8452"


def _ring_bars(shape: cost.SiteShape, hw: cost.Hardware, bidirectional: bool, unroll: int | None):
    """(compute bars, transfer bars) of the ring as (start, length) in seconds: the cost
    model's own schedule (:func:`cmatmul_pass.cost.schedule`), so the last bar ends at the
    predicted time."""
    slots = cost.schedule(shape, hw, bidirectional, unroll)
    compute = [(s.compute_start, s.compute) for s in slots]
    transfer = [(s.start, s.transfer) for s in slots if s.transfer]
    return compute, transfer


def _all_reduce_lanes(site, shape: cost.SiteShape | None, hw: cost.Hardware):
    """A psum-of-a-matmul site's lanes: the original (the dots, then the all_reduce) and its
    strategy's schedule: "split" (the reduce-scatter ring, then the gather, which the next
    matmul's ring hides where the gather reached one) or "chunk" (:func:`cost.chunk_pipeline`).
    Returns (lanes, the strategy's label, the ring size)."""
    a = site.all_reduce
    p = a["prediction"]
    t_ar = p["all_reduce_s"]
    t_dot = p["serial_s"] - t_ar
    lanes = [("original: compute", [(0.0, t_dot)], COMPUTE), ("original: all_reduce", [(t_dot, t_ar)], COLLECTIVE)]
    if a["strategy"] == "chunk" or shape is None:
        k = a["chunks"] or p["chunks"]
        if k is None:  # the rows cut into no chunk count: nothing to draw beside the original
            return lanes, "all_reduce", site.ring_size
        dots, reduces = cost.chunk_pipeline(*p["chunk_stages"][str(k)], k)
        return lanes + [("chunks: compute", dots, COMPUTE), ("chunks: all_reduces", reduces, COLLECTIVE)], \
            f"chunk {k}", site.ring_size
    variant = p["variant"]
    ring_comp, ring_comm = _ring_bars(shape, hw, *cost.VARIANTS[variant])
    end = max(a + b for a, b in ring_comp + ring_comm)
    gather = [(end, max(p["split_s"] - end, 0.0))]
    return lanes + [("split: compute", ring_comp, COMPUTE), ("split: permutes, gather", ring_comm + gather, COLLECTIVE)], \
        f"split {variant}", shape.ring


def _prefetched(site) -> bool:
    return site.reason_code == "prefetchable" and bool(site.bytes_moved)


def _prefetch_lanes(site, hw: cost.Hardware):
    """A gather left ``prefetchable`` (analysis.slack): its whole transfer on the collective
    stream, issued ahead of its dot (at 0, where the dot starts), behind the compute that
    precedes it; nothing of it is on the compute stream's path."""
    t_m = site.bytes_moved / hw.bandwidth + hw.step
    return [("prefetched: collective", [(-t_m, t_m)], COLLECTIVE)], "prefetched ahead of its dot", site.ring_size


def plot(report: Report, hw: cost.Hardware, path: str | Path) -> Path:
    """Draw every site the cost model sized (``SiteReport.cost``, predicted on ``hw``) into a
    PNG at ``path``, each as the variant the pass asked for at that site (``cost["variant"]``)."""
    try:
        import matplotlib
    except ImportError:
        raise CmatmulError("drawing the timeline needs matplotlib: pip install 'cmatmul_pass[plot]'") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sites = [(s, cost.SiteShape.from_dict(s.cost["site"]) if s.cost else None) for s in report.sites
             if s.cost or s.all_reduce or _prefetched(s)]
    if not sites:
        raise ValueError("no site to draw: the module has no candidate site the cost model can size")
    fig, axes = plt.subplots(len(sites), 1, figsize=(10, 1.9 * len(sites) + 0.6), squeeze=False)
    for ax, (site, shape) in zip(axes[:, 0], sites):
        scale = 1e6  # µs
        if _prefetched(site):
            lanes, variant, ring = _prefetch_lanes(site, hw)
        elif site.all_reduce:
            lanes, variant, ring = _all_reduce_lanes(site, shape, hw)
        else:
            t_c, t_m, variant = site.cost["compute_s"], site.cost["transfer_s"], site.cost["variant"]
            if shape.kind == "all_gather_dot":
                base_comm, base_comp = [(0.0, t_m)], [(t_m + hw.step, t_c)]
            else:
                base_comp, base_comm = [(0.0, t_c)], [(t_c, t_m)]
            ring_comp, ring_comm = _ring_bars(shape, hw, *cost.VARIANTS[variant])
            lanes = [
                ("original: compute", base_comp, COMPUTE), ("original: collective", base_comm, COLLECTIVE),
                ("ring: compute", ring_comp, COMPUTE), ("ring: permutes", ring_comm, COLLECTIVE),
            ]
            ring = shape.ring
        for y, (label, bars, color) in enumerate(reversed(lanes)):
            ax.broken_barh([(a * scale, b * scale) for a, b in bars], (y - 0.35, 0.7), facecolors=color, edgecolor="white")
        ax.set_yticks(range(len(lanes)))
        ax.set_yticklabels([label for label, _, _ in reversed(lanes)], fontsize=8)
        ax.set_xlabel("µs (predicted)", fontsize=8)
        decision = "rewritten" if site.rewritten else f"left unchanged [{site.reason_code}]"
        ax.set_title(f"{site.location}  {site.kind}, ring {ring}, {variant}: {decision}", fontsize=9, loc="left")
    fig.suptitle(f"predicted schedule on {hw.name}", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
