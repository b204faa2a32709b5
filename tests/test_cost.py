"""The cost model against hand-computed cases, the auto policy and byte threshold, the timeline plot
(the model's picks, variant="auto" and a psum's strategy: test_cost_picks.py)."""

import json
import statistics

from dataclasses import replace

import pytest

import cmatmul_pass
from cmatmul_pass import cost
from cmatmul_pass.pipeline import variant_options
from cmatmul_pass.ring_plan import gather_signatures, gather_streams
from conftest import ROOT, SAMPLES, run_cli, sample

# 1 TFLOP/s, 1 GB/s links, no synchronisation or loop cost: times are easy to compute by hand
TOY = cost.Hardware("toy", {"f32": 1e12}, 1e9, step=0.0, loop_trip=0.0)


def gather(ring=4, flops=4e9, step_bytes=1_000_000):
    return cost.SiteShape("all_gather_dot", ring, flops, step_bytes, "f32")


def test_compute_bound_gather():
    # t_c = 4 ms (1 ms per shard), 1 ms per permute: serial 4 + 3; ring: 3 rounds of max(1, 1) + the last dot
    p = cost.predict(gather(), TOY)
    assert p.compute_s == pytest.approx(4e-3) and p.transfer_s == pytest.approx(3e-3)
    assert p.serial_s == pytest.approx(7e-3)
    assert p.overlapped_s["uni"] == pytest.approx(4e-3)
    assert p.speedup["uni"] == pytest.approx(7 / 4)


def test_comm_bound_gather_and_both_directions():
    shape = gather(step_bytes=4_000_000)  # 4 ms per permute
    p = cost.predict(shape, TOY)
    assert p.serial_s == pytest.approx(16e-3)
    assert p.overlapped_s["uni"] == pytest.approx(3 * 4e-3 + 1e-3)  # 13 ms
    # both ways, ring of 4: round 0 (own shard, sends both ways) 4 ms, round 1 (two shards, sends down) 4 ms,
    # round 2 (one shard) 1 ms
    assert p.overlapped_s["bidi"] == pytest.approx(9e-3)
    assert p.speedup["bidi"] > p.speedup["uni"] > 1


def test_split_scatter_sends_halves():
    shape = cost.SiteShape("dot_reduce_scatter", 4, 4e9, 4_000_000, "f32")
    p = cost.predict(shape, TOY)
    assert p.overlapped_s["uni"] == pytest.approx(1e-3 + 3 * 4e-3)  # first block, then 3 x max(1, 4)
    assert p.overlapped_s["bidi"] == pytest.approx(1e-3 + 3 * 2e-3)  # half the bytes each way


def test_a_scatter_that_cannot_be_halved_is_timed_one_way():
    # the rewrite keeps such a scatter one-directional under --bidirectional; so does the model
    shape = cost.SiteShape("dot_reduce_scatter", 4, 4e9, 4_000_000, "f32", halvable=False)
    p = cost.predict(shape, TOY)
    assert p.overlapped_s["bidi"] == pytest.approx(p.overlapped_s["uni"]) == pytest.approx(13e-3)
    assert cost.SiteShape.from_dict(shape.to_dict()) == shape


def test_step_and_loop_costs_penalise_tiny_sites():
    hw = cost.Hardware("toy", {"f32": 1e12}, 1e9, step=5e-6, loop_trip=4e-6)
    tiny = gather(flops=4e3, step_bytes=8)
    p = cost.predict(tiny, hw, False, 1)
    assert p.speedup["uni"] < 1  # seven rounds of synchronisation cost more than they hide
    assert p.overlapped_s["full"] < p.overlapped_s["unroll2"] < p.overlapped_s["uni"]  # fewer loop trips


def test_split_efficiency_slows_only_the_ring():
    shape = gather()
    calibrated = cost.Hardware("toy", {"f32": 1e12}, 1e9, step=0.0, loop_trip=0.0, split_efficiency=0.8)
    base, slower = cost.predict(shape, TOY), cost.predict(shape, calibrated)
    assert slower.serial_s == base.serial_s  # the original's one big dot keeps its throughput
    # each of the 4 rounds computes 1 ms / 0.8 = 1.25 ms against a 1 ms permute
    assert slower.overlapped_s["uni"] == pytest.approx(4 * 1.25e-3)
    assert cost.hardware("h100:split_efficiency=0.9").split_efficiency == 0.9
    for bad in ("h100:split_efficiency=0", "h100:bandwidth=-1", "h100:bf16=inf"):
        with pytest.raises(cmatmul_pass.CmatmulError, match="must be a positive"):
            cost.hardware(bad)
    assert cost.hardware("h100:step=0").step == 0


def test_split_efficiency_follows_the_size_of_a_step():
    """Measured points per site kind, interpolated in log(FLOPs of one step's dot), the nearest
    point's outside them; a kind with none keeps the whole dot's throughput."""
    hw = replace(TOY, split_efficiency={"all_gather_dot": ((1e11, 0.9), (1e9, 0.5))})
    assert hw.split("all_gather_dot", 1e10) == pytest.approx(0.7)  # halfway in log(FLOPs)
    assert hw.split("all_gather_dot", 1e8) == 0.5 and hw.split("all_gather_dot", 1e12) == 0.9
    assert hw.split("dot_reduce_scatter", 1e10) == 1.0
    # a ring of 4 over 4e10 FLOPs: 1e10 per step, so each round's 10 ms dot takes 10 / 0.7 ms
    p = cost.predict(gather(flops=4e10), hw)
    assert p.split_efficiency["uni"] == pytest.approx(0.7)
    assert p.overlapped_s["uni"] == pytest.approx(4 * 10e-3 / 0.7)
    assert p.serial_s == pytest.approx(40e-3 + 3e-3)  # the original's one dot keeps its throughput
    # a bidirectional scatter halves its blocks: its dots are half as large and keep less
    hw = replace(TOY, split_efficiency={"dot_reduce_scatter": ((1e9, 0.5), (1e11, 0.9))})
    scatter = cost.SiteShape("dot_reduce_scatter", 4, 4e10, 1_000_000, "f32")
    p = cost.predict(scatter, hw)
    assert p.split_efficiency["uni"] == pytest.approx(0.7)
    assert p.split_efficiency["bidi"] == pytest.approx(0.7 - 0.4 * 0.5 * 0.3010299956639812)  # log10(2) lower
    unhalvable = replace(scatter, halvable=False)
    assert cost.predict(unhalvable, hw).split_efficiency["bidi"] == pytest.approx(0.7)


def test_a_round_of_several_dots_keeps_what_each_dot_keeps():
    """Unmerged dots (a scatter's terms, gathers under --no-merge-dots) are each their own size:
    the ring's time is the sum of each dot's time at its own split efficiency."""
    hw = replace(TOY, split_efficiency={"all_gather_dot": ((1e9, 0.5), (1e11, 0.9))})
    # a ring of 4: per step one dot of 1e11 FLOPs (keeps 0.9) and one of 1e9 (keeps 0.5)
    shape = cost.SiteShape("all_gather_dot", 4, 4.04e11, 1_000_000, "f32", dots=(4e11, 4e9))
    assert cost.step_dot_flops(shape, False) == (1e11, 1e9)
    p = cost.predict(shape, hw)
    assert p.split_efficiency["uni"] == pytest.approx(1.01e11 / (1e11 / 0.9 + 1e9 / 0.5))
    assert p.overlapped_s["uni"] == pytest.approx(4 * (0.1 / 0.9 + 1e-3 / 0.5))  # compute-bound: every round's dots
    # the same FLOPs in one dot keep more; a single dot is stored as no split at all
    merged = replace(shape, dots=())
    assert cost.predict(merged, hw).split_efficiency["uni"] > p.split_efficiency["uni"]
    assert replace(shape, dots=(4.04e11,)) == merged
    assert cost.SiteShape.from_dict(shape.to_dict()) == shape and shape.to_dict()["dots"] == [4e11, 4e9]
    assert cost.SiteShape.from_dict(merged.to_dict()) == merged


@pytest.mark.parametrize("merge", [True, False])
def test_the_model_sizes_the_dots_the_rewrite_emits(merge):
    """q/k/v merged into one dot per round, or (--no-merge-dots) three; a scatter over a sum of
    dots computes each term's dot: the report's site lists the dots, and their efficiency."""
    options = cmatmul_pass.Options(merge_dots=merge)
    (gather_site,) = cmatmul_pass.rewrite(sample("ag_dot_qkv").read_text(), options).report.rewritten
    dots = gather_site.cost["site"]["dots"]
    assert len(dots) == (1 if merge else 3) and sum(dots) == gather_site.cost["site"]["flops"]
    (scatter_site,) = cmatmul_pass.rewrite(sample("rs_dot_sum").read_text(), options).report.rewritten
    assert len(scatter_site.cost["site"]["dots"]) == 3  # three terms, whatever merge_dots says
    # on a profile whose small dots keep little, three dots keep less than their merged one
    profile = "h100:split.gather=1:0.1/1e12:1"
    split = cmatmul_pass.rewrite(sample("ag_dot_qkv").read_text(),
                                 cmatmul_pass.Options(merge_dots=merge, hardware=profile)).report.rewritten[0]
    step = gather_site.cost["site"]["flops"] / gather_site.cost["site"]["ring"]
    merged_split = cost.hardware(profile).split("all_gather_dot", step)
    assert (split.cost["split_efficiency"]["uni"] == pytest.approx(merged_split)) is merge
    assert split.cost["split_efficiency"]["uni"] <= merged_split + 1e-12


def test_explain_counts_the_dots_of_a_round(capsys):
    assert run_cli("explain", sample("ag_dot_qkv"), "--no-merge-dots") == 0
    assert "the ring's 3 dots per round keep" in capsys.readouterr().out
    assert run_cli("explain", sample("ag_dot_qkv")) == 0
    out = capsys.readouterr().out
    assert "the ring's dots keep" in out and "contracting" not in out


def test_explain_says_a_contracting_dots_split_is_unmeasured(capsys, monkeypatch):
    """A profile whose split points were measured on free roles only (a profile with no role
    points): explain says so where a ring's dots contract the gathered dim, and
    not where no split is charged, nor where the profile has the role's own points (the h100
    and h200 profiles now do)."""
    h100 = cost.PROFILES["h100"]
    free_only = replace(h100, split_efficiency={k: v for k, v in h100.split_efficiency.items() if "/" not in k})
    monkeypatch.setitem(cost.PROFILES, "free-only", free_only)
    assert run_cli("explain", sample("ag_dot_contracting"), "--hardware", "free-only") == 0
    assert "a contracting dot's split is the free role's: unmeasured" in capsys.readouterr().out
    assert run_cli("explain", sample("ag_dot_contracting")) == 0
    assert "unmeasured" not in capsys.readouterr().out
    assert run_cli("explain", sample("ag_dot_contracting"), "--hardware", "h100:split_efficiency=1") == 0
    assert "unmeasured" not in capsys.readouterr().out
    # a profile with the role's own points: measured, and used
    assert run_cli("explain", sample("ag_dot_contracting"), "--hardware", "h100:split.gather/contracting=1:0.5") == 0
    out = capsys.readouterr().out
    assert "unmeasured" not in out and "the ring's dots keep 0.50 of its throughput" in out


def test_the_profiles_split_is_what_the_gpu_measured():
    """The h100 and h200 profiles' points are the straight-line efficiencies and loop-trip costs
    that tools/gpu_calibrate.py measured (tools/gpu_measurements/), at each run's step size: a free role's
    split and loop trip are its kind's points, another role's split is that role's own (a run
    that names no role measured free roles only)."""
    from test_gpu_checks import calibration_runs, runs_by_model

    for profile in ("h100", "h200"):
        hw = cost.PROFILES[profile]
        # the H100's 3B shapes were run three times: their medians
        for model, runs in runs_by_model(calibration_runs(profile)).items():
            for sites in zip(*[run["sites"] for run in runs]):
                site = sites[0]
                step, role = site["flops"] / runs[0]["ring"], site.get("role", "free")
                assert hw.has_role_points("split_efficiency", site["kind"], role), (profile, model, role)
                split = statistics.median(s["efficiency_unrolled"] for s in sites)
                assert hw.split(site["kind"], step, role) == round(split, 3), (profile, model, site["kind"], role)
                if role == "free":
                    trip = statistics.median(s["loop_trip_s"] for s in sites)
                    assert hw.trip(site["kind"], step) == float(f"{trip:.3g}")


def test_loop_trips_cost_what_their_kind_measured():
    """Loop-trip points per site kind, interpolated in log(FLOPs of a step) as the split is; one
    number for every trip still works, and the points are overridable."""
    hw = replace(TOY, loop_trip={"all_gather_dot": ((1e9, 2e-3),), "dot_reduce_scatter": ((1e9, 1e-3), (1e11, 3e-3))})
    assert hw.trip("dot_reduce_scatter", 1e10) == pytest.approx(2e-3)  # halfway in log(FLOPs)
    assert hw.trip("all_gather_dot", 1e12) == 2e-3 and cost.hardware("tpu-v5e").trip("all_gather_dot", 1.0) == 1e-6
    # a ring of 4 over 4e10 FLOPs (1e10 per step): uni's 3 trips cost the kind's 2 ms each
    scatter = cost.SiteShape("dot_reduce_scatter", 4, 4e10, 1_000_000, "f32")
    assert cost.predict(scatter, hw).overlapped_s["uni"] == pytest.approx(cost.predict(scatter, TOY).overlapped_s["uni"]
                                                                           + 3 * 2e-3)
    assert cost.predict(gather(flops=4e10), hw).overlapped_s["unroll2"] == pytest.approx(
        cost.predict(gather(flops=4e10), TOY).overlapped_s["unroll2"] + 2e-3)  # one two-round trip
    # the h100 profile: a 70B-sized scatter's trips measured cheaper than the gather's
    h100 = cost.PROFILES["h100"]
    assert h100.trip("dot_reduce_scatter", cost.STEP_70B) < h100.trip("all_gather_dot", cost.STEP_70B)
    over = cost.hardware("h100:loop_trip.scatter=1e9:0/1e11:2e-5")
    assert over.trip("dot_reduce_scatter", 1e10) == pytest.approx(1e-5)
    assert over.loop_trip["all_gather_dot"] == h100.loop_trip["all_gather_dot"]
    assert cost.hardware("h100:loop_trip=3e-6").trip("dot_reduce_scatter", cost.STEP_70B) == 3e-6
    for bad, message in (("h100:loop_trip.gather=1e9:-1", "FLOPS:SECONDS"), ("h100:loop_trip.all=1e9:1e-6", "no site kind"),
                         ("h100:loop_trip.gather=1e9:1e-6/1e9:2e-6", "same FLOPs")):
        with pytest.raises(cmatmul_pass.CmatmulError, match=message):
            cost.hardware(bad)


def test_split_overrides():
    hw = cost.hardware("h100:split.gather=1e9:0.5/1e11:0.9")
    assert hw.split("all_gather_dot", 1e10) == pytest.approx(0.7)
    assert hw.split_efficiency["dot_reduce_scatter"] == cost.PROFILES["h100"].split_efficiency["dot_reduce_scatter"]
    # a profile with one fraction for every dot keeps it for the kind not overridden
    hw = cost.hardware("a100:split_efficiency=0.8,split.scatter=1e9:0.6")
    assert hw.split("all_gather_dot", 1e12) == 0.8 and hw.split("dot_reduce_scatter", 1e12) == 0.6
    # one fraction replaces the points
    assert cost.hardware("h100:split.gather=1e9:0.5,split_efficiency=0.9").split("all_gather_dot", 1e9) == 0.9
    for bad, message in (("h100:split.attention=1e9:0.5", "no site kind"), ("h100:split.gather=0.5", "FLOPS:FRACTION"),
                         ("h100:split.gather=1e9:0", "FLOPS:FRACTION"), ("h100:split.gather=1e9:x", "FLOPS:FRACTION"),
                         ("h100:split.gather=1e9:0.5/1e9:0.6", "same FLOPs")):
        with pytest.raises(cmatmul_pass.CmatmulError, match=message):
            cost.hardware(bad)


def test_a_dot_role_takes_its_own_split_points_where_measured():
    """By hand: a round of a free dot (4e9 FLOPs over a ring of 4) and a contracting one (8e9).
    With points for the contracting role it keeps 0.5 and the free dot the kind's 0.8; the
    round's split is their FLOPs over their times.  Without the role's points it gets the kind's."""
    shape = cost.SiteShape("all_gather_dot", 4, 12e9, 1000, "bf16", dots=(4e9, 8e9), roles=("free", "contracting"))
    assert shape.dot_roles == ("free", "contracting")
    measured = cost.hardware("a100:split.gather=1:0.8,split.gather/contracting=1:0.5")
    assert measured.split("all_gather_dot", 2e9, "contracting") == 0.5 and measured.split("all_gather_dot", 2e9) == 0.8
    assert measured.split("dot_reduce_scatter", 2e9, "contracting") == 1.0  # no scatter points: 1.0 as before
    assert cost.split_efficiency(shape, measured, False) == pytest.approx(12e9 / (4e9 / 0.8 + 8e9 / 0.5))
    unmeasured = cost.hardware("a100:split.gather=1:0.8")
    assert cost.split_efficiency(shape, unmeasured, False) == pytest.approx(0.8)
    assert not unmeasured.has_role_points("split_efficiency", "all_gather_dot", "contracting")
    assert measured.has_role_points("split_efficiency", "all_gather_dot", "contracting")
    assert measured.has_role_points("split_efficiency", "all_gather_dot", "free")
    # one dot, one role; every dot free is no roles; the report's dict round-trips
    one = cost.SiteShape("all_gather_dot", 4, 8e9, 1000, "bf16", roles=("contracting",))
    assert one.dots == () and one.dot_roles == ("contracting",)
    assert cost.SiteShape("all_gather_dot", 4, 8e9, 1000, "bf16", roles=("free",)).roles == ()
    for s in (shape, one):
        assert cost.SiteShape.from_dict(json.loads(json.dumps(s.to_dict()))) == s
    with pytest.raises(ValueError, match="2 roles for 1 dots"):
        cost.SiteShape("all_gather_dot", 4, 8e9, 1000, "bf16", roles=("free", "contracting"))


def test_role_split_overrides():
    """``split.gather/contracting=...`` adds the role's points beside the kind's, which either
    override leaves alone; a loop trip is the ring's, and the free role's points are the kind's."""
    hw = cost.hardware("h100:split.gather/contracting=1e9:0.4/1e11:0.6,split.gather=1e9:0.9")
    assert hw.split("all_gather_dot", 1e10, "contracting") == pytest.approx(0.5)
    assert hw.split("all_gather_dot", 1e10) == 0.9
    assert hw.split_efficiency["dot_reduce_scatter"] == cost.PROFILES["h100"].split_efficiency["dot_reduce_scatter"]
    for bad, message in (("h100:split.gather/free=1e9:0.5", "role's own points"),
                         ("h100:split.gather/diagonal=1e9:0.5", "role's own points"),
                         ("h100:loop_trip.gather/contracting=1e9:1e-5", "only a split"),
                         ("h100:split.attention/contracting=1e9:0.5", "no site kind 'attention'")):
        with pytest.raises(cmatmul_pass.CmatmulError, match=message):
            cost.hardware(bad)


def test_the_report_gives_each_dot_its_role():
    """The model sees each of a ring's dots in its role (sites.site_shape): a gather whose
    shard one dot contracts and another keeps free (a training step's backward), and a contracting
    one alone; with the role's own points the contracting dot keeps what they say.  (The data-parallel
    psums of the weight gradients are kept: split, their scatter rings would take one of those dots.)"""
    keep = cmatmul_pass.Options(all_reduce="keep")
    (mixed,) = [s for s in cmatmul_pass.rewrite(sample("sp_mlp_grad").read_text(), keep).report.rewritten
                if s.dim_role == "contracting+free"]
    assert mixed.cost["site"]["roles"] == [c["dim_role"] for c in mixed.consumers] == ["contracting", "free"]
    (alone,) = cmatmul_pass.rewrite(sample("ag_dot_contracting").read_text(),
                                    cmatmul_pass.Options(hardware="h100:split.gather/contracting=1:0.3")).report.rewritten
    assert alone.cost["site"]["roles"] == ["contracting"] and alone.cost["split_efficiency"]["uni"] == 0.3


def test_exposed_permutes_add_their_transfer():
    """With a variant's ``overlap`` h, a round costs h * max(compute, transfer) + (1 - h) * their sum."""
    half = replace(TOY, overlap={"uni": 0.5})
    # compute-bound: 3 sending rounds of 0.5 * 1 + 0.5 * 2 ms, then the last dot, 1 ms
    p = cost.predict(gather(), half)
    assert p.overlapped_s["uni"] == pytest.approx(3 * 1.5e-3 + 1e-3)
    assert p.overlapped_s["unroll2"] == pytest.approx(4e-3)  # a variant not listed hides every permute
    # comm-bound (4 ms per permute): 3 x (0.5 * 4 + 0.5 * 5) + 1
    assert cost.predict(gather(step_bytes=4_000_000), half).overlapped_s["uni"] == pytest.approx(3 * 4.5e-3 + 1e-3)
    # nothing hidden: every round waits for its transfer, as the original waits for the collective
    none = replace(TOY, overlap={"uni": 0.0})
    assert cost.predict(gather(), none).overlapped_s["uni"] == pytest.approx(p.serial_s)
    # the schedule lays it out: each round's dots start after the exposed half of its transfer
    slots = cost.schedule(gather(), half, False, 1)
    assert [(s.start, s.compute_start, s.end) for s in slots[:2]] == [
        pytest.approx((0.0, 0.5e-3, 1.5e-3)), pytest.approx((1.5e-3, 2e-3, 3e-3))]
    assert slots[-1].transfer == 0 and slots[-1].end == pytest.approx(p.overlapped_s["uni"])


def test_loop_trips_are_the_rewrites_and_each_costs_loop_trip():
    """The model loops over the rounds the rewrite loops over (cost.loop_run is the rewrite's):
    a ring of 4 gathers in 3 one-round trips (the last round after the loop), or one two-round
    trip after a remainder round; each trip costs ``loop_trip``."""
    trip = replace(TOY, loop_trip=1e-3)
    p = cost.predict(gather(), trip)
    assert p.overlapped_s["uni"] == pytest.approx(4e-3 + 3e-3)
    assert p.overlapped_s["unroll2"] == pytest.approx(4e-3 + 1e-3)
    assert p.overlapped_s["full"] == pytest.approx(4e-3)
    assert [cost.loop_trips(gather(ring=n), False, 1) for n in (2, 3, 4, 8)] == [0, 2, 3, 7]
    # (a ring of 2 has one sending round: no loop)


def test_the_model_counts_the_trips_the_rewrite_emits():
    """Every sample's rewritten sites under every variant: the model's loop trips are the report's."""
    checked = 0
    for path in SAMPLES:
        text = path.read_text()
        for name, (bidirectional, unroll) in cost.VARIANTS.items():
            options = variant_options(name, all_reduce="split")  # every psum a ring too
            for site in cmatmul_pass.rewrite(text, options, source=path.name).report.rewritten:
                if site.all_to_all or site.all_reduce.get("picked") == "summed value":  # chunks; a plain scatter
                    continue
                if site.kind == "column_passes":  # one direction; each pass n - 1 rounds sending, the last not
                    signatures = ["send"] * (site.ring_size - 1) + ["last"]
                    lo, hi = cost.loop_run(signatures, unroll)
                    assert site.schedule["loop_trips"] == (hi - lo) // (unroll or 1), (path.name, name)
                    continue
                if site.attention:  # a gather ring's rounds, each with its K and V blocks
                    signatures = gather_signatures(gather_streams(site.ring_size, bidirectional))
                    lo, hi = cost.loop_run(signatures, unroll)
                    assert site.schedule["loop_trips"] == (hi - lo) // (unroll or 1), (path.name, name)
                    continue
                shape = cost.SiteShape.from_dict(site.cost["site"])
                assert cost.loop_trips(shape, bidirectional, unroll) == site.schedule["loop_trips"], (path.name, name)
                checked += 1
    assert checked > 100


def test_overlap_overrides():
    hw = cost.hardware("h100:overlap.bidi=0.5,overlap.full=1")
    assert hw.hidden("bidi") == 0.5 and hw.hidden("full") == 1.0 and hw.hidden("uni") == 1.0
    assert cost.PROFILES["h100"].hidden("bidi") < 1  # the profile itself is untouched
    with pytest.raises(cmatmul_pass.CmatmulError, match="no variant 'sideways'"):
        cost.hardware("h100:overlap.sideways=0.5")
    with pytest.raises(cmatmul_pass.CmatmulError, match="fraction from 0 to 1"):
        cost.hardware("h100:overlap.uni=1.5")
    assert cost.hardware("h100:overlap.uni=0").hidden("uni") == 0.0


def test_hardware_profiles_and_overrides():
    assert {"h100", "h200", "a100", "tpu-v5e"} <= set(cost.PROFILES)
    hw = cost.hardware("h100:bandwidth=400e9,bf16=700e12,step=8e-6")
    assert (hw.bandwidth, hw.flops["bf16"], hw.step) == (400e9, 700e12, 8e-6)
    with pytest.raises(cmatmul_pass.CmatmulError, match="unknown hardware"):
        cost.hardware("h300")
    with pytest.raises(cmatmul_pass.CmatmulError, match="not a number"):
        cost.hardware("h100:bandwidth=fast")


@pytest.mark.parametrize("dtype, key", [
    ("bf16", "bf16"), ("f8E4M3FN", "f8"), ("f8E5M2", "f8"), ("f8E4M3FNUZ", "f8"), ("f64", "f64"),
    ("i8", "i8"), ("ui8", "i8"), ("ui32", "i32"),
])
def test_a_dot_is_priced_at_its_element_types_rate(dtype, key):
    """Every fp8 type at the profile's f8 rate, an unsigned integer at its signed width's:
    not at the default (bf16) rate, which is twice too slow for fp8 and 15x too fast for f64."""
    hw = cost.PROFILES["h100"]
    shape = cost.SiteShape("all_gather_dot", 8, 8e12, 1_000_000, dtype)
    p = cost.predict(shape, hw)
    assert cost.dtype_family(dtype) == key and hw.knows(dtype)
    assert p.throughput == hw.flops[key] and not p.throughput_assumed
    assert p.compute_s == pytest.approx(8e12 / hw.flops[key])


def test_the_gpus_rates_by_element_type():
    """The H100's and H200's rates are what XLA's dot measured on each (tools/gpu_measurements/*_calibrate_*.json:
    the median over the runs of each type's throughput, bf16's over the free sites' full dots,
    as tools/gpu_profile.py merges them).  What the measurement refuted stays refuted: fp8 is
    not twice bf16 under XLA, and an i32 dot runs at a hundredth of it or less.  On A100 and TPU
    v5e, which have no fp8 units, fp8 is at bf16's rate."""
    from test_gpu_checks import calibration_runs, free_full_dots, runs_by_model

    for name in ("h100", "h200"):
        by_model = runs_by_model(calibration_runs(name))  # a model's repeated runs count as one: their medians
        hw = cost.PROFILES[name]
        full_dots = statistics.median(free_full_dots(by_model))
        for key in ("bf16", "f16", "f32", "f8", "f64", "i8", "i32"):
            measured = full_dots if key in ("bf16", "f16") else statistics.median(
                statistics.median(run["element_rates"]["rates"][key]["throughput"] for run in runs)
                for runs in by_model.values())
            assert hw.flops[key] == float(f"{measured:.3g}"), (name, key)
        rate = hw.throughput
        assert rate("bf16") < rate("f8E4M3FN") < 1.5 * rate("bf16")
        assert rate("i32") < rate("bf16") / 100 and rate("f64") < rate("bf16") / 10
    for name in ("a100", "tpu-v5e"):
        assert cost.PROFILES[name].throughput("f8E5M2") == cost.PROFILES[name].throughput("bf16")


def test_a_dtype_the_profile_does_not_price_is_priced_at_the_default_and_said(capsys, monkeypatch):
    tpu = cost.PROFILES["tpu-v5e"]
    p = cost.predict(cost.SiteShape("dot_reduce_scatter", 8, 8e12, 1_000_000, "f64"), tpu)
    assert not tpu.knows("f64") and p.throughput_assumed and p.throughput == tpu.flops["default"]
    # an override gives it a rate; a type's own entry wins over its family's
    assert not cost.predict(cost.SiteShape("dot_reduce_scatter", 8, 8e12, 1, "f64"),
                            cost.hardware("tpu-v5e:f64=1e12")).throughput_assumed
    assert cost.hardware("h100:f8E5M2=3e15").throughput("f8E5M2") == 3e15
    assert cost.hardware("h100:f8E5M2=3e15").throughput("f8E4M3FN") == cost.PROFILES["h100"].flops["f8"]
    # explain says so, in the site's prediction line (an f32 sample, and a profile without f32)
    assert run_cli("explain", sample("rs_dot_1d"), "--hardware", "a100") == 0
    assert "throughput in the profile" not in capsys.readouterr().out
    monkeypatch.setitem(cost.PROFILES, "bf16-only", cost.Hardware("bf16-only", {"bf16": 1e12, "default": 1e12}, 1e9))
    assert run_cli("explain", sample("rs_dot_1d"), "--hardware", "bf16-only") == 0
    assert "(no f32 throughput in the profile: priced at its default, 1 TFLOP/s)" in capsys.readouterr().out


def test_mlp_block_sanity():
    """Llama-3-70B-like and 8B-like SwiGLU MLP blocks on 8xH100.  With ideal overlap (the ring's
    dots as efficient as the whole dot, loop trips free) the block gains, at most by hiding all
    of its transfer; the calibrated profile (split efficiency and loop-trip cost measured on an
    H100) predicts less, for every variant."""
    calibrated = cost.PROFILES["h100"]
    ideal = replace(calibrated, split_efficiency=1.0, loop_trip=0.0)
    for hidden, ffn in ((8192, 28672), (4096, 14336)):
        for bidirectional, unroll in ((False, 1), (False, 2), (True, 2), (True, None)):
            best = cost.mlp_block(ideal, hidden, ffn, 8192, bidirectional=bidirectional, unroll=unroll)
            assert 1.05 < best["speedup"] < 1 + 1 / best["compute_to_transfer"] + 0.05
            measured = cost.mlp_block(calibrated, hidden, ffn, 8192, bidirectional=bidirectional, unroll=unroll)
            assert measured["speedup"] < best["speedup"]
        # each site its own best variant beats every variant used for both sites
        auto = cost.mlp_block(calibrated, hidden, ffn, 8192, variant="auto")
        assert len(auto["variants"]) == 2 and all(v in cost.VARIANTS for v in auto["variants"])
        for bidirectional, unroll in cost.VARIANTS.values():
            uniform = cost.mlp_block(calibrated, hidden, ffn, 8192, bidirectional=bidirectional, unroll=unroll)
            assert auto["speedup"] >= uniform["speedup"] - 1e-12
    # the 70B block is more compute-bound than the 8B one
    big = cost.mlp_block(calibrated, 8192, 28672, 8192)
    small = cost.mlp_block(calibrated, 4096, 14336, 8192)
    assert big["compute_to_transfer"] > small["compute_to_transfer"]


def test_the_docs_quote_the_models_mlp_table():
    """docs/performance.md's "Predicted on 8×H100" MLP table is `cost.mlp_block` on the `h100`
    profile: a profile that moves (a new calibration) fails here until the table is regenerated."""
    readme = (ROOT / "docs" / "performance.md").read_text()
    header = "| shapes | compute / transfer | uni | unroll 2 | full | bidi + unroll 2 | bidi + full | `--variant auto` |"
    assert header in readme
    columns = {"uni": (False, 1), "unroll 2": (False, 2), "full": (False, None),
               "bidi + unroll 2": (True, 2), "bidi + full": (True, None)}
    table = readme[readme.index(header):].split("\n\n", 1)[0]
    rows = {line.split(" | ")[0].lstrip("| "): line for line in table.splitlines() if line.startswith("| Llama-3-")}
    shapes = {"Llama-3-70B-like (hidden 8192, ffn 28672)": (8192, 28672),
              "Llama-3-8B-like (hidden 4096, ffn 14336)": (4096, 14336)}
    assert set(rows) == set(shapes)
    hw = cost.PROFILES["h100"]
    for name, (hidden, ffn) in shapes.items():
        blocks = [cost.mlp_block(hw, hidden, ffn, 8192, bidirectional=b, unroll=u) for b, u in columns.values()]
        blocks.append(cost.mlp_block(hw, hidden, ffn, 8192, variant="auto"))
        expected = [name, f"{blocks[0]['compute_to_transfer']:.1f}", *(f"{b['speedup']:.2f}x" for b in blocks)]
        assert rows[name].strip("| ").split(" | ") == expected


def test_report_carries_the_prediction_and_the_site_size():
    result = cmatmul_pass.rewrite(sample("sp_mlp").read_text(), cmatmul_pass.Options(variant="uni"))
    gather_site = next(s for s in result.report.sites if s.kind == "all_gather_dot")
    # one dot: per device [2, 32, 16] = [2, 32(gathered), 16] x [16, 16]: 2 * 2*32*16 * 16 FLOPs
    assert gather_site.cost["site"]["flops"] == 2 * 2 * 32 * 16 * 16
    assert gather_site.cost["site"]["step_bytes"] == 2 * 8 * 16 * 4
    assert gather_site.cost["hardware"].startswith("H100") and gather_site.cost["variant"] == "uni"
    # the share of each variant's permutes the profile expects hidden (measured in XLA's H100 schedule)
    assert gather_site.cost["overlap"]["bidi"] == pytest.approx(298 / 308) and gather_site.cost["overlap"]["uni"] == 1.0


def test_auto_policy_and_byte_threshold(tmp_path, capsys):
    text = sample("sp_mlp").read_text()
    auto = cmatmul_pass.rewrite(text, cmatmul_pass.Options(policy="auto"))
    assert [s.reason_code for s in auto.report.sites] == ["policy", "policy"] and not auto.changed
    slow = cmatmul_pass.Options(policy="auto", hardware="h100:f32=1e9,bandwidth=1e8,split_efficiency=1,loop_trip=0")
    assert len(cmatmul_pass.rewrite(text, slow).report.rewritten) == 2  # now the ring pays off
    threshold = cmatmul_pass.rewrite(text, cmatmul_pass.Options(min_bytes=4096))
    assert {s.reason_code for s in threshold.report.sites} == {"min_bytes"}
    assert len(cmatmul_pass.rewrite(text, cmatmul_pass.Options(min_bytes=3072)).report.rewritten) == 2
    rep = tmp_path / "r.json"
    assert run_cli("rewrite", sample("sp_mlp"), "--policy", "auto", "-o", tmp_path / "o.mlir", "--report-json", rep, "-q") == 0
    assert {s["reason_code"] for s in json.loads(rep.read_text())["sites"]} == {"policy"}
    assert run_cli("rewrite", sample("sp_mlp"), "--hardware", "h999", "-o", tmp_path / "x.mlir") == 2
    assert "unknown hardware profile" in capsys.readouterr().err


def test_decorator_takes_the_policy():
    import jax

    from test_jit import F, inputs

    g = cmatmul_pass.jit(F, policy="auto")
    x, w = inputs()
    import numpy as np

    np.testing.assert_allclose(np.asarray(g(x, w)), np.asarray(jax.jit(F)(x, w)), rtol=1e-5)
    assert [s.reason_code for s in g.report.sites] == ["policy"]


@pytest.mark.parametrize("seconds, text", [
    (2.5, "2.5 s"), (1.0, "1 s"), (0.0123, "12.3 ms"), (4.5e-6, "4.5 µs"), (1e-6, "1 µs"),
    (6.83e-9, "6.83 ns"), (8.19e-14, "8.19e-05 ns"), (0.0, "0 ns"), (9.996e-4, "1 ms"), (-2e-6, "-2 µs"),
])
def test_durations_print_in_a_readable_unit(seconds, text):
    from cmatmul_pass.report import duration

    assert duration(seconds) == text


def test_explain_prints_predictions_and_draws_the_timeline(tmp_path, capsys):
    png = tmp_path / "timeline.png"
    assert run_cli("explain", sample("sp_mlp"), "--plot", png, "--bidirectional") == 0
    out = capsys.readouterr().out
    assert "predicted on H100" in out and "best:" in out and f"timeline: {png}" in out
    # one unit per line, the largest value's: 3072 B per device at 450 GB/s (6.83 ns) beside a 6 µs serial time
    assert "transfer <0.1 µs, serial 6.0 µs;" in out and "e-0" not in out
    predicted = [line for line in out.splitlines() if "predicted on H100" in line]
    assert predicted and not any(" ns" in line for line in predicted)
    scatter = [s for s in cmatmul_pass.rewrite(sample("sp_mlp").read_text()).report.sites if s.kind == "dot_reduce_scatter"]
    assert scatter[0].cost["transfer_s"] == pytest.approx(3072 / 450e9)
    assert "97 % of permutes hidden" in out  # the bidi ring the sample gets: 298 of 308 in the H100 compiles
    # tiny sites: below the smallest step measured, the smallest step's split (the 3B step's
    # medians: the gather's 0.744, the halved scatter's 0.817)
    assert "the ring's dots keep 0.74 of its throughput" in out and "the ring's dots keep 0.82 of its throughput" in out
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5_000
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert 600 <= width <= 2000 and 200 <= height <= 2000
