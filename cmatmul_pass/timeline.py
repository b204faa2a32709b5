"""The predicted schedule of each site as a Gantt chart (``explain --plot timeline.png``).

Per site, a panel: the original program (the whole collective on the collective stream and its
synchronisation, then the dots on the compute stream — or the dots first for a scatter) above,
and the rewritten ring below (each round's dots on the compute stream while its permutes run on
the collective stream, then the round's synchronisation and loop trip), on the cost model's time
axis (:mod:`cmatmul_pass.cost`), in one unit for the whole chart.  Sites drawn alike (a model's
layers) share a panel; a panel with nothing to draw is left out.
"""

from __future__ import annotations

from pathlib import Path

from . import cost
from .errors import CmatmulError
from .report import Report, time_unit

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


#: the panels one chart draws at most (sites drawn alike share one: a model's layers)
MAX_PANELS = 24
SYNC = "#B0B0B0"


def _sync_bars(shape: cost.SiteShape, hw: cost.Hardware, bidirectional: bool, unroll: int | None):
    """The ring's synchronisation and loop trips (the time of each round after its permutes and
    dots are done, to the next round's start) as (start, length) bars."""
    bars = []
    for s in cost.schedule(shape, hw, bidirectional, unroll):
        done = max(s.start + s.transfer, s.compute_start + s.compute)
        if s.end > done:
            bars.append((done, s.end - done))
    return bars


def _site_lanes(site, shape: cost.SiteShape | None, hw: cost.Hardware):
    """(lanes, the variant's label, the ring size) of one site: each lane (name, bars, colour)."""
    if _prefetched(site):
        return _prefetch_lanes(site, hw)
    if site.all_reduce:
        return _all_reduce_lanes(site, shape, hw)
    t_c, t_m, variant = site.cost["compute_s"], site.cost["transfer_s"], site.cost["variant"]
    if shape.kind == "all_gather_dot":
        base_comp, base_comm, base_sync = [(t_m + hw.step, t_c)], [(0.0, t_m)], [(t_m, hw.step)]
    else:
        base_comp, base_comm, base_sync = [(0.0, t_c)], [(t_c, t_m)], [(t_c + t_m, hw.step)]
    ring_comp, ring_comm = _ring_bars(shape, hw, *cost.VARIANTS[variant])
    lanes = [  # (a lane's synchronisation on its collective's row)
        ("original: compute", base_comp, COMPUTE), ("original: collective", base_comm, COLLECTIVE),
        ("original: collective", base_sync, SYNC),
        ("ring: compute", ring_comp, COMPUTE), ("ring: permutes", ring_comm, COLLECTIVE),
        ("ring: permutes", _sync_bars(shape, hw, *cost.VARIANTS[variant]), SYNC),
    ]
    return lanes, variant, shape.ring


def drawable(site) -> bool:
    """Whether the chart has a panel for ``site``: one the cost model sized (a ring's or a psum's
    prediction), or a gather left to be prefetched."""
    return bool(site.cost or site.all_reduce or _prefetched(site))


def _panels(report: Report, hw: cost.Hardware) -> list[tuple[str, list]]:
    """(title, lanes) of each panel to draw: one per site the cost model sized, sites drawn alike
    (a model's layers: one location, kind and decision, the same bars) sharing one, panels with
    nothing to draw left out."""
    panels: dict[tuple, list] = {}
    for site in report.sites:
        if not drawable(site):
            continue
        shape = cost.SiteShape.from_dict(site.cost["site"]) if site.cost else None
        lanes, variant, ring = _site_lanes(site, shape, hw)
        if not any(length > 0 for _, bars, _ in lanes for _, length in bars):
            continue
        decision = "rewritten" if site.rewritten else f"left unchanged [{site.reason_code}]"
        title = f"{site.location}  {site.kind}, ring {ring}, {variant}: {decision}"
        key = (title, tuple((name, tuple(bars)) for name, bars, _ in lanes))
        if key in panels:
            panels[key][0] += 1
        else:
            panels[key] = [1, title, lanes]
    return [(title + (f"  ({count} sites)" if count > 1 else ""), lanes) for count, title, lanes in panels.values()]


def plot(report: Report, hw: cost.Hardware, path: str | Path) -> Path:
    """Draw :func:`figure` into a PNG at ``path``."""
    fig = figure(report, hw)
    path = Path(path)
    fig.savefig(path, dpi=90)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def figure(report: Report, hw: cost.Hardware):
    """Every site the cost model sized (``SiteReport.cost``, predicted on ``hw``), each as the
    variant the pass asked for at that site (``cost["variant"]``), as a matplotlib figure (Agg):
    one panel per site (sites drawn alike share one, at most :data:`MAX_PANELS`), one time unit
    for the whole chart, the one its longest schedule reads best in."""
    try:
        import matplotlib
    except ImportError:
        raise CmatmulError("drawing the timeline needs matplotlib: pip install 'cmatmul_pass[plot]'") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    panels = _panels(report, hw)
    if not panels:
        raise ValueError("no site to draw: the module has no candidate site the cost model can size")
    title = f"predicted schedule on {hw.name}"
    if len(panels) > MAX_PANELS:
        title += f" (the first {MAX_PANELS} of {len(panels)} panels; explain lists every site)"
        panels = panels[:MAX_PANELS]
    longest = max(abs(a + b) for _, lanes in panels for _, bars, _ in lanes for a, b in bars)
    unit, scale = time_unit(longest)
    heights = [0.32 * len({label for label, _, _ in lanes}) + 0.9 for _, lanes in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, sum(heights) + 0.9), squeeze=False, layout="constrained",
                             gridspec_kw={"height_ratios": heights})
    for ax, (panel_title, lanes) in zip(axes[:, 0], panels):
        rows = list(dict.fromkeys(label for label, _, _ in lanes))  # lanes of one label share a row
        for label, bars, color in lanes:
            y = len(rows) - 1 - rows.index(label)
            ax.broken_barh([(a / scale, b / scale) for a, b in bars], (y - 0.35, 0.7), facecolors=color,
                           edgecolor="white", linewidth=0.5)
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels(rows[::-1], fontsize=8)
        ax.set_ylim(-0.6, len(rows) - 0.4)
        ax.tick_params(axis="x", labelsize=8)
        ax.set_xlabel(f"{unit} (predicted)", fontsize=8)
        ax.set_title(panel_title, fontsize=9, loc="left")
    fig.suptitle(title, fontsize=10)
    fig.legend(handles=[Patch(color=COMPUTE, label="dots"), Patch(color=COLLECTIVE, label="transfer"),
                        Patch(color=SYNC, label="synchronisation, loop trips")],
               loc="outside lower center", ncols=3, fontsize=8, frameon=False)
    return fig
