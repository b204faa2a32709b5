"""The benchmark script runs and writes its results (smoke tests: no timing is asserted here —
performance numbers come from `make bench`); the stored record, bench/results.json, has the
schema the script writes, its verdicts are what the script computes from its values, and
docs/performance.md quotes it (tools/gen_bench_doc.py)."""

import json
import statistics
from pathlib import Path

import numpy as np
import pytest

from tools import bench, gen_bench_doc

RECORD = bench.ROOT / "bench" / "results.json"
PER_LAYER = {"layers", "sites", "rewritten", "kinds", "shared", "ring_functions", "lower_s", "compile_s", "pass_s",
             "parse_print_s", "pass_over_lower_compile", "parse_print_over_lower_compile", "jit_pass_s",
             "jit_pass_over_lower_compile", "pass_split_psums_s"}
RING_ROW = {"kind", "shape", "runs", "hand_written_s", "default_variant", "default_is", "hand_written_over_plain",
            "hand_written_again", "over_hand_written", *(f"{name}_{what}" for name in ("default", "default_program",
                                                                                    "hand_written_again")
                                                        for what in ("paired", "interval", "verdict"))}
DISPATCH_ROW = {"leaves", "runs", "calls_per_round", "us_per_call", "misses", "cmatmul_pass_jit_over_jax_jit",
                "cmatmul_pass_jit_interval", "python_dispatch_over_jax_jit", "python_dispatch_interval"}


def check_record(results: dict, full: bool = True) -> None:
    """``results`` has what ``make bench`` writes (``full``: the ring and dispatch parts too, which
    ``--ring-runs 0`` skips), and its targets are what :func:`bench.targets` makes of its values."""
    head = {"date", "cpus", "jax", "devices", "runs", "layer_runs", "pass_cost", "samples", "layer",
            "samples_median_ratio", "fastest_variant", "within_5_percent_of_fastest", "megatron", "targets", "compile"}
    assert set(results) == head | ({"rings", "dispatch"} if full else set())
    assert isinstance(results["date"], str) and results["cpus"] > 0 and results["devices"]
    cost_ = results["pass_cost"]
    keys = {"model", "per_layers", "repeats", "scaling_32_over_8", "profile"}
    assert set(cost_) == (keys if full else keys - {"scaling_32_over_8"} | set(cost_) & keys)
    for model in (cost_, results["megatron"]["pass_cost"]):
        assert model["per_layers"] and all(set(row) == PER_LAYER for row in model["per_layers"])
    compile_ = results["compile"]
    assert set(compile_) == {"shape", "hardware", "repeats", "by_layers"} and compile_["by_layers"]
    for row in compile_["by_layers"].values():
        assert set(row) == set(bench.MODELS)
        for model, m in row.items():
            assert set(m) == {"original_s", "ratios", "default_sites", "predicted"} and m["original_s"] > 0
            assert set(m["predicted"]) == {"default", "every site"} and m["predicted"]["default"] >= 1
            extra = {*bench.VARIANTS, "hand_written_rings"} if model == "sequence_parallel" else set()
            assert set(m["ratios"]) == {"default", "every site", *extra}
            assert 0 <= m["default_sites"][0] <= m["default_sites"][1]
    assert set(results["layer"]) == {"shape", "plain_s", "hand_written_ring_over_plain", "timing", "variants"}
    assert all(set(v) == {"over_plain", "over_hand_written"} for v in results["layer"]["variants"].values())
    assert set(results["samples_median_ratio"]) == set(bench.VARIANTS)
    runtime = results["megatron"]["runtime"]
    assert set(runtime) == {"shape", "original_s", "over_original", "default_is", "default_sites"}
    assert set(runtime["over_original"]) == set(gen_bench_doc.STRATEGIES)
    if full:
        assert results["rings"] and all(set(row) == RING_ROW for row in results["rings"])
        assert set(results["rings"][0]["over_hand_written"]) == {"default", *bench.VARIANTS}
        assert results["dispatch"] and all(set(row) == DISPATCH_ROW for row in results["dispatch"])
    assert [t["target"] for t in results["targets"]] == [name for name, _ in bench.TARGETS]
    assert results["targets"] == json.loads(json.dumps(bench.targets(results)))


def test_the_stored_record_is_a_whole_make_bench_run():
    """bench/results.json, the one benchmark record, is a whole ``make bench`` run: every part, the
    schema the script writes today, and the verdicts the script draws from its values; the pass
    measured at 1 to 32 layers on both models."""
    results = json.loads(RECORD.read_text())
    check_record(results)
    assert [r["layers"] for r in results["pass_cost"]["per_layers"]] == bench.build_parser().parse_args([]).layers
    assert sorted(p.name for p in RECORD.parent.iterdir() if p.is_file()) == ["results.json"]


def test_the_performance_page_quotes_the_stored_record():
    """docs/performance.md's tables are what tools/gen_bench_doc.py writes from bench/results.json:
    commit a new run with `make bench-doc`."""
    text = gen_bench_doc.DOC.read_text()
    assert text == gen_bench_doc.updated(text), "docs/performance.md is stale: run `make bench-doc`"
    results = json.loads(RECORD.read_text())
    at_32 = {r["layers"]: r for r in results["pass_cost"]["per_layers"]}[32]
    assert f"| 32 | {at_32['sites']} |" in text and f"{100 * at_32['jit_pass_over_lower_compile']:.2f} %" in text


def test_rings_against_a_hand_written_ring():
    """The ring benchmark: per layer, the default and every variant over the hand-written ring,
    which computes what the plain layer does (ring_runtime asserts that before timing)."""
    rows = bench.ring_runtime(1, shapes=(("column", 64, 32, 64), ("row", 64, 32, 64)))
    assert [(r["kind"], r["shape"]) for r in rows] == [("column", [64, 32, 64]), ("row", [64, 32, 64])]
    for row in rows:
        assert set(row["over_hand_written"]) == {"default", *bench.VARIANTS}
        assert all(v > 0 for v in row["over_hand_written"].values()) and row["hand_written_s"] > 0
        assert row["hand_written_again"] > 0  # the A/A control: the same ring timed as another program
        for name in ("default", "hand_written_again", "default_program"):  # per-round ratio, its 95 % interval
            low, high = row[f"{name}_interval"]
            assert 0 < low <= row[f"{name}_paired"] <= high
            assert row[f"{name}_verdict"] in ("faster", "level", "slower")
    # on the CPU (no profile) the default is auto's fallback, full on a ring of 8 for both kinds: the
    # very module that variant gives, so one program timed once
    assert [r["default_variant"] for r in rows] == [["full"], ["full"]]
    assert [r["default_is"] for r in rows] == ["full", "full"]
    assert all(r["over_hand_written"]["default"] == r["over_hand_written"][r["default_is"]] for r in rows)


def test_dispatch_against_jax_jit():
    """The dispatch benchmark times cmatmul_pass.jit, jax.jit and the Python dispatch it replaced on
    the same calls; every timed call of the decorator hit the C++ dispatcher (one miss: the first)."""
    rows = bench.dispatch_runtime(2, leaves=(1, 3), calls=2)
    assert [r["leaves"] for r in rows] == [1, 3]
    for row in rows:
        assert set(row["us_per_call"]) == {"jax_jit", "cmatmul_pass_jit", "python_dispatch"}
        assert all(v > 0 for v in row["us_per_call"].values())
        assert row["misses"] == 1
        for name in ("cmatmul_pass_jit", "python_dispatch"):
            low, high = row[f"{name}_interval"]
            assert 0 < low <= row[f"{name}_over_jax_jit"] <= high


def test_bench_smoke(tmp_path):
    out = tmp_path / "results.json"
    assert bench.main(["--layers", "1", "--compile-layers", "1", "--runs", "1", "--layer-runs", "1", "--repeats", "1",
                       "--samples", "ag_dot_1d", "rs_dot_1d",
                       "--layer", "64", "32", "64", "--ring-runs", "0", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    check_record(results, full=False)
    # the pass's profile lands beside the results, not in the repository's bench/
    assert results["pass_cost"]["profile"] == str(tmp_path / "profile_sequence_parallel_L1.txt")
    assert (tmp_path / "profile_sequence_parallel_L1.txt").stat().st_size > 0
    assert "rings" not in results  # --ring-runs 0 skips them (test_rings_against_a_hand_written_ring runs them)
    (row,) = results["pass_cost"]["per_layers"]
    assert row["layers"] == 1 and row["rewritten"] == row["sites"] > 0
    assert 0 <= row["ring_functions"] <= row["shared"] < row["sites"]
    assert row["parse_print_s"] > 0 and row["parse_print_over_lower_compile"] > 0
    assert row["jit_pass_s"] > 0 and row["jit_pass_over_lower_compile"] == row["jit_pass_s"] / (row["lower_s"] + row["compile_s"])
    # the default on the H100 profile rewrites the 7B-class sequence-parallel step's sites that pay
    compiled = results["compile"]["by_layers"]["1"]
    assert compiled["sequence_parallel"]["default_sites"][0] > 0
    assert set(results["samples"]) == {"ag_dot_1d", "rs_dot_1d"}
    assert set(results["layer"]["variants"]) == set(bench.VARIANTS)
    ratios, fastest = results["samples_median_ratio"], results["fastest_variant"]
    assert ratios[fastest] == min(ratios.values())
    assert results["within_5_percent_of_fastest"] == [
        k for k in bench.VARIANTS if k != fastest and ratios[k] <= 1.05 * ratios[fastest]]
    # the run judges itself against the targets; L = 32 was not run, so those two are unmeasured
    rows = {row["target"]: row for row in results["targets"]}
    assert [row["target"] for row in results["targets"]] == [name for name, _ in bench.TARGETS]
    assert rows["pass time / (lower + compile) at L = 32"]["met"] is None
    assert rows["pass time(32) / time(8)"]["met"] is None
    compile_row = rows["compile time, rewritten / original, every variant at every L measured"]
    assert compile_row["value"] == {v: compiled["sequence_parallel"]["ratios"][v] for v in bench.VARIANTS}
    assert compile_row["above"] == [k for k, v in compile_row["value"].items() if v > 2.0]
    assert compile_row["met"] is (not compile_row["above"])
    default_row = rows["compile time, the default / original, each model at every L measured"]
    assert default_row["value"] == {f"{m} L=1": compiled[m]["ratios"]["default"] for m in bench.MODELS}


def test_targets_name_the_variants_above_each_limit():
    results = {
        "pass_cost": {"per_layers": [{"layers": 8, "pass_over_lower_compile": 0.07},
                                     {"layers": 32, "pass_over_lower_compile": 0.048}],
                      "scaling_32_over_8": 4.5},
        "compile": {"by_layers": {"4": {
            "sequence_parallel": {"ratios": {"default": 1.4} | {name: 1.9 for name in bench.VARIANTS} | {"full": 2.3}},
            "megatron": {"ratios": {"default": 1.6}}}}},
        "layer": {"variants": {"uni": {"over_plain": 1.2, "over_hand_written": 0.99},
                               "full": {"over_plain": 0.9, "over_hand_written": 1.0}}},
    }
    rows = bench.targets(results)
    assert [(r["met"], r["above"]) for r in rows] == [
        (True, []),  # 0.048 <= 0.05 (L = 32's row, not L = 8's)
        (False, []),  # 4.5 > 4.4
        (False, ["megatron L=4"]),  # the default, per model and L
        (False, ["full"]),
        (False, ["uni"]),
        (True, []),  # 1.0 is within a limit of 1.0
        (False, []),  # the tighter 3 %: 0.048 > 0.03
        (None, []),  # the pass as cmatmul_pass.jit runs it: not in these results
        (None, []),  # the rings against the hand-written one: not run
    ]
    # the ring target: per shape, the low end of the default's interval (not measurably slower)
    rings = [{"kind": "column", "shape": [8, 4, 8], "default_interval": [0.97, 1.02]},
             {"kind": "row", "shape": [8, 4, 8], "default_interval": [1.01, 1.04]}]
    ring_row = bench.targets({"rings": rings})[-1]
    assert ring_row["value"] == {"column 8x4x8": 0.97, "row 8x4x8": 1.01}
    assert (ring_row["met"], ring_row["above"]) == (False, ["row 8x4x8"])
    assert bench.targets({"rings": rings[:1]})[-1]["met"] is True
    assert bench.targets({})[0]["met"] is None
    # compile ratios at several L: each variant's worst
    by_layers = {layers: {"sequence_parallel": {"ratios": {"default": 1.2} | {name: 1.1 for name in bench.VARIANTS}}}
                 for layers in ("4", "32")}
    by_layers["32"]["sequence_parallel"]["ratios"]["uni"] = 2.5
    compile_row = bench.targets({"compile": {"by_layers": by_layers}})[3]
    assert compile_row["value"]["uni"] == 2.5 and compile_row["above"] == ["uni"]


def test_gpu_calibration_runs_on_any_backend(tmp_path):
    """tools/gpu_calibrate.py at tiny shapes on CPU: the decompositions are checked against the
    full dot before timing, and the override it prints is a valid --hardware profile."""
    from cmatmul_pass import cost
    from tools import gpu_calibrate

    out = tmp_path / "calibration.json"
    assert gpu_calibrate.main(["--dims", "64", "32", "128", "--ring", "4", "--dtype", "bf16", "--runs", "1",
                               "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [(s["kind"], s["role"]) for s in result["sites"]] == [
        ("all_gather_dot", "free"), ("dot_reduce_scatter", "free"), ("all_gather_dot", "free"),
        ("all_gather_dot", "contracting"), ("all_gather_dot", "batch")]
    gather, scatter, merged, contracting, batch = result["sites"]
    assert gather["shapes"] == [[64, 32], [32, 32]] and scatter["shapes"] == [[64, 32], [32, 32]]
    # gate and up in one dot, on their weights concatenated, as the pass merges them
    assert merged["shapes"] == [[64, 32], [32, 64]] and merged["merged_dots"] == 2
    assert contracting["shapes"] == [[64, 32], [64, 32]]  # a [T, F/n]^T @ dy [T, H]
    assert batch["shapes"] == [[4, 16, 32], [4, 32, 32]]  # x [n, T/n, H] @ w [n, H, F/n], batch dims paired
    assert {s["flops"] for s in result["sites"] if s is not merged} == {2.0 * 64 * 32 * 32}
    assert merged["flops"] == 2 * gather["flops"] and "merged_dots" not in gather
    for site in result["sites"]:
        assert site["efficiency_loop"] == site["full_s"] / site["loop_s"] > 0
        assert site["timing"] == "interleaved"  # full, loop and steps in turn, round by round
        assert max(site["max_relative_error"].values()) <= gpu_calibrate.TOLERANCE["bf16"]
    hw = cost.hardware(result["hardware_override"])
    # the profile's split comes from the straight-line dots, per kind at this run's step size;
    # the loop's extra cost is its trips; the kinds' points are the free roles' (the contracting
    # role is reported beside what those points give for it); the target's measure is every site's
    assert result["loop_efficiency"] == min(s["efficiency_loop"] for s in result["sites"])
    free = [gather, scatter, merged]
    assert result["split_efficiency"] == min(s["efficiency_unrolled"] for s in free)
    # the contracting and batch roles' splits become points of their own, beside the gather's
    for site in (contracting, batch):
        step = site["flops"] / 4
        assert hw.split("all_gather_dot", step, site["role"]) == pytest.approx(site["efficiency_unrolled"], abs=5e-4)
    assert result["roles"] == {f"all_gather_dot {site['role']}": {
        "split": site["efficiency_unrolled"], "split_from_points": hw.split("all_gather_dot", site["flops"] / 4),
        "loop_trip_s": site["loop_trip_s"], "loop_trip_from_points": hw.trip("all_gather_dot", site["flops"] / 4)}
        for site in (contracting, batch)}
    # each kind's points at this run's step sizes, in order: the gather's single and merged dots
    assert result["split_points"] == {
        "all_gather_dot": [[s["flops"] / 4, s["efficiency_unrolled"]] for s in (gather, merged)],
        "dot_reduce_scatter": [[scatter["flops"] / 4, scatter["efficiency_unrolled"]]]}
    assert result["loop_trip_points"] == {
        "all_gather_dot": [[s["flops"] / 4, s["loop_trip_s"]] for s in (gather, merged)],
        "dot_reduce_scatter": [[scatter["flops"] / 4, scatter["loop_trip_s"]]]}
    for site in free:
        assert hw.split(site["kind"], site["flops"] / 4) == pytest.approx(site["efficiency_unrolled"], abs=5e-4)
        # the override keeps the h100 profile's points (measured at the 8B and 70B step sizes)
        for flops, fraction in cost.PROFILES["h100"].split_efficiency[site["kind"]]:
            assert hw.split(site["kind"], flops) == fraction
    assert result["loop_trip_s"] == max(max(0.0, (s["loop_s"] - s["unrolled_s"]) / 4) for s in free)
    # each kind's loop trip, at this run's step sizes, among the profile's measured points
    for site in free:
        assert hw.trip(site["kind"], site["flops"] / 4) == pytest.approx(site["loop_trip_s"], rel=5e-3, abs=1e-15)
        for flops, seconds in cost.PROFILES["h100"].loop_trip[site["kind"]]:
            assert hw.trip(site["kind"], flops) == seconds
    # the gather's dot alone at a shard's rows (T/n), two shards' and half (the same here) and all of T
    dots = result["step_dots"]
    assert dots["shapes"] == gather["shapes"] and set(dots["rows"]) == {"16", "32", "64"}
    for rows, r in dots["rows"].items():
        assert r["throughput"] == pytest.approx(2.0 * int(rows) * 32 * 32 / r["seconds"])
        assert r["efficiency"] == pytest.approx(r["throughput"] / dots["rows"]["64"]["throughput"])
    # the gather's full dot in every element type the profiles price, and an override setting them
    rates = result["element_rates"]
    assert rates["shapes"] == gather["shapes"] and rates["flops"] == gather["flops"]
    assert list(rates["rates"]) == list(gpu_calibrate.RATE_TYPES)
    timed = cost.hardware(rates["hardware_override"])
    for key, r in rates["rates"].items():
        assert cost.PROFILES["h100"].knows(key)  # a key the profiles price a dtype under
        assert r["throughput"] == pytest.approx(rates["flops"] / r["seconds"])
        assert r["over_bf16"] == pytest.approx(r["throughput"] / rates["rates"]["bf16"]["throughput"])
        assert timed.flops[key] == pytest.approx(r["throughput"], rel=5e-3)
    # each kind's ring loops (permutes to the device itself), checked before being timed, and
    # the cost model's prediction for them beside each
    for key in ("gather_rings", "scatter_rings"):
        rings = result[key]
        for name in ("ring_uni", "ring_unroll2"):
            assert rings[name]["max_relative_error"] <= gpu_calibrate.TOLERANCE["bf16"]
            assert rings[name]["efficiency"] == rings["full_s"] / rings[name]["seconds"] > 0
            assert rings[name]["measured_over_model"] == rings[name]["seconds"] / rings[name]["model_s"] > 0


@pytest.mark.parametrize("profile", ["h100", "h200"])
def test_merging_the_stored_runs_gives_the_profiles_points(profile):
    """gpu_calibrate --merge over the stored 70B, 8B (and, for the H200, 3B) runs (tools/gpu_measurements/)
    gives exactly the split and loop-trip points the profile holds, its throughput is the median
    of the runs' free sites' full dots, and its element rates the runs' medians."""
    from cmatmul_pass import cost
    from tools import gpu_calibrate

    from test_gpu_checks import calibration_runs, free_full_dots, runs_by_model

    paths = [str(path) for path in calibration_runs(profile)]
    merged = gpu_calibrate.merge(paths, profile)
    stored = cost.PROFILES[profile]
    assert merged["fields"] == {"split_efficiency": stored.split_efficiency, "loop_trip": stored.loop_trip}
    hw = cost.hardware(merged["hardware_override"])
    assert hw.split_efficiency == stored.split_efficiency and hw.loop_trip == stored.loop_trip
    by_model = runs_by_model(paths)  # repeated runs of a model count as one: their medians
    assert merged["throughput"] == statistics.median(free_full_dots(by_model))
    for key, rate in merged["rates"].items():  # each type's median over the models, a model's over its runs
        assert rate == statistics.median(statistics.median(r["element_rates"]["rates"][key]["throughput"] for r in runs)
                                         for runs in by_model.values())
    assert {"f8", "f64", "i8", "i32"} <= set(merged["rates"]) and merged["rates_override"].startswith(f"{profile}:")


def test_merging_adds_a_runs_roles_and_replaces_a_point_at_its_step(tmp_path):
    """A run at a new step size adds its points (the merged gather's at its own step, the
    contracting and batch roles' as their own), one at the same step as an earlier run replaces
    it, and runs of two dtypes are refused."""
    from cmatmul_pass import cost
    from tools import gpu_calibrate

    def site(kind, role, flops, split, trip):
        return {"kind": kind, "role": role, "flops": flops, "efficiency_unrolled": split, "loop_trip_s": trip,
                "full_throughput": 6e14}

    step = 4e9  # a 3B-like step, below the profile's 8B point
    first = {"dtype": "bf16", "ring": 8, "sites": [
        site("all_gather_dot", "free", 8 * step, 0.6, 2e-5), site("dot_reduce_scatter", "free", 8 * step, 0.7, 1e-5),
        site("all_gather_dot", "free", 16 * step, 0.62, 2.5e-5),  # gate and up merged: twice the step
        site("all_gather_dot", "contracting", 8 * step, 0.5, 3e-5), site("all_gather_dot", "batch", 8 * step, 0.55, 0)]}
    again = {"dtype": "bf16", "ring": 4, "sites": [site("all_gather_dot", "free", 4 * step, 0.65, 1.5e-5)]}
    paths = []
    for name, run in (("first", first), ("again", again)):
        paths.append(str(tmp_path / f"{name}.json"))
        Path(paths[-1]).write_text(json.dumps(run))
    merged = gpu_calibrate.merge(paths, "h100")
    hw, stored = cost.hardware(merged["hardware_override"]), cost.PROFILES["h100"]
    gather = stored.split_efficiency["all_gather_dot"]
    # the later run's point at that step, the merged dot's at twice it
    assert hw.split_efficiency["all_gather_dot"] == tuple(sorted({**dict(gather), step: 0.65, 2 * step: 0.62}.items()))
    assert hw.loop_trip["all_gather_dot"] == tuple(sorted({**dict(stored.loop_trip["all_gather_dot"]), step: 1.5e-5,
                                                           2 * step: 2.5e-5}.items()))
    assert hw.split_efficiency["dot_reduce_scatter"] == ((step, 0.7), *stored.split_efficiency["dot_reduce_scatter"])
    # roles: the run's points among the profile's own role points (the gather's stand-ins are
    # not kept), and no loop trips of their own
    contracting, batch = (stored.split_efficiency[f"all_gather_dot/{r}"] for r in ("contracting", "batch"))
    assert contracting and batch and all(flops > step for flops, _ in contracting + batch)
    assert hw.split_efficiency["all_gather_dot/contracting"] == ((step, 0.5), *contracting)
    assert hw.split_efficiency["all_gather_dot/batch"] == ((step, 0.55), *batch)
    assert set(hw.loop_trip) == {"all_gather_dot", "dot_reduce_scatter"}
    assert merged["fields"]["split_efficiency"]["all_gather_dot/batch"] == ((step, 0.55), *batch)
    assert merged["rates"] == {}
    # element types' rates: each the median of the runs that timed it
    rates = [{"bf16": 6e14, "f8": 1.2e15}, {"bf16": 7e14, "f64": 4e13}, {"bf16": 8e14, "f8": 1.4e15}]
    for i, run in enumerate(rates):
        Path(tmp_path / f"rates{i}.json").write_text(json.dumps(
            {**again, "element_rates": {"rates": {k: {"throughput": v} for k, v in run.items()}}}))
    merged = gpu_calibrate.merge([str(tmp_path / f"rates{i}.json") for i in range(3)], "h100")
    assert merged["rates"] == {"bf16": 7e14, "f8": 1.3e15, "f64": 4e13}
    assert cost.hardware(merged["rates_override"]).flops == {**stored.flops, "bf16": 7e14, "f8": 1.3e15, "f64": 4e13}
    Path(paths[1]).write_text(json.dumps({**again, "dtype": "f32"}))
    with pytest.raises(SystemExit, match="different dtypes"):
        gpu_calibrate.merge(paths, "h100")


def test_merging_takes_the_median_of_a_models_repeated_runs(tmp_path):
    """Three runs of one model (the same ``model``) count as one run of their medians, point by
    point, full dot by full dot and rate by rate; another model's run at the same step still
    replaces it (a later model's point wins)."""
    from cmatmul_pass import cost
    from tools import gpu_calibrate

    def run(model, split, trip, full, f8):
        return {"dtype": "bf16", "ring": 8, "model": model, "element_rates": {"rates": {"f8": {"throughput": f8}}},
                "sites": [{"kind": "dot_reduce_scatter", "role": "free", "flops": 8 * 4e9, "efficiency_unrolled": split,
                           "loop_trip_s": trip, "full_throughput": full}]}

    paths = []
    for i, r in enumerate([run("3b", 0.91, 2e-5, 5e14, 4e14), run("3b", 0.77, 3e-5, 6e14, 5e14),
                           run("3b", 0.82, 1e-5, 7e14, 9e14)]):
        paths.append(str(tmp_path / f"r{i}.json"))
        Path(paths[-1]).write_text(json.dumps(r))
    merged = gpu_calibrate.merge(paths, "h100")
    hw = cost.hardware(merged["hardware_override"])
    assert hw.split("dot_reduce_scatter", 4e9) == 0.82 and hw.trip("dot_reduce_scatter", 4e9) == 2e-5
    assert merged["throughput"] == 6e14 and merged["rates"] == {"f8": 5e14}
    Path(tmp_path / "other.json").write_text(json.dumps(run("other", 0.7, 4e-5, 8e14, 1e15)))
    merged = gpu_calibrate.merge([*paths, str(tmp_path / "other.json")], "h100")
    assert cost.hardware(merged["hardware_override"]).split("dot_reduce_scatter", 4e9) == 0.7
    assert merged["throughput"] == 7e14 and merged["rates"] == {"f8": 7.5e14}  # the medians of two models


@pytest.mark.parametrize("site", ["all_gather_dot free", "dot_reduce_scatter free", "all_gather_dot contracting",
                                  "all_gather_dot batch"])
def test_each_calibrated_sites_steps_compute_its_full_dot(site):
    """gpu_calibrate's loop and straight-line decompositions of every site (SITES) give what the
    full dot gives, through the site's reference (a scatter: the sum of the product's row
    blocks).  Exact: small integers in f32, n = 4; a batch role's operands are [n, T/n, K] and
    [n, K, M], the others' [T, K] and [K, M] (a contracting role's [T, K] and [T, M])."""
    import jax
    import jax.numpy as jnp

    from tools import gpu_calibrate

    kind, role = site.split()
    n = 4
    shapes = {"free": [(8, 3), (3, 5)], "contracting": [(8, 3), (8, 5)], "batch": [(n, 2, 3), (n, 3, 5)]}[role]
    args = [(jnp.arange(float(np.prod(s))).reshape(s) * (i + 2)) % 7 - 3 for i, s in enumerate(shapes)]
    full, loop, unrolled, reference = gpu_calibrate.SITES[kind, role](n)
    expected = reference(jax.jit(full)(*args))
    for name, fn in (("loop", loop), ("unrolled", unrolled)):
        got = jax.jit(fn)(*args).astype(jnp.float32)
        assert got.shape == expected.shape and jnp.array_equal(got, expected), (site, name)
    if role == "batch":  # batch i of the product pairs x's batch i with w's batch i
        x, w = args
        np.testing.assert_array_equal(np.asarray(expected), np.einsum("btk,bkm->btm", np.asarray(x), np.asarray(w)))


@pytest.mark.parametrize("n", [4, 5, 8])
def test_calibration_rings_send_and_compute_like_the_pass(n):
    """The one-device rings of gpu_calibrate: n - 1 permutes executed, n dots; a gather ring's
    every block is the shard's product, a scatter ring's result the sum of the product's row
    blocks; unroll2 ties each round's dot operands (an optimization barrier).  Exact: small
    integers in f32."""
    import jax
    import jax.numpy as jnp

    from tools import gpu_calibrate

    device = jax.devices("cpu")[0]
    cases = {"gather": (gpu_calibrate.ring_programs(n, device), (jnp.arange(12.0).reshape(3, 4), jnp.ones((4, 2)))),
             "scatter": (gpu_calibrate.scatter_ring_programs(n, device),
                         (jnp.arange(6.0 * n).reshape(2 * n, 3) % 7, jnp.arange(6.0).reshape(3, 2)))}
    for kind, ((programs, reference), args) in cases.items():
        for name, fn in programs.items():
            text = jax.jit(fn).lower(*args).as_text()
            loops = text.count("stablehlo.while")
            per_trip = 2 if name == "ring_unroll2" else 1
            permutes = text.count("stablehlo.collective_permute")
            assert loops == 1 and permutes == (n - 1) % per_trip + per_trip, (kind, name, loops, permutes)
            # tied operands are tensors of floats; a scatter ring's run-time offsets go through barriers too
            ties = [line for line in text.splitlines() if "optimization_barrier" in line and "xf32>" in line]
            assert bool(ties) == (name == "ring_unroll2"), (kind, name)
            assert jnp.array_equal(fn(*args).astype(jnp.float32), reference(*args)), (kind, name)


@pytest.mark.parametrize("kind", ["all_gather_dot", "dot_reduce_scatter"])
def test_the_model_of_the_one_device_rings_is_its_rounds_steps_and_trips(kind):
    """ring_model, by hand: n = 4, no transfers, the full dot's throughput, split 0.5, step 2 µs,
    loop trip 10 µs.  Both kinds run 3 permute rounds (each pays the step) and their dots take
    full_s / 0.5; uni loops over 3 trips, unroll2 over 1 (its remainder round goes before it)."""
    from tools import gpu_calibrate

    full_s = 1e-3
    rings = {"full_s": full_s, "ring_uni": {"seconds": 3e-3}, "ring_unroll2": {"seconds": 2e-3}}
    shapes = [(64, 32), (32, 16)]
    model = gpu_calibrate.ring_model(kind, rings, 4, shapes, "bf16", "h100:split_efficiency=0.5,step=2e-6,loop_trip=1e-5")
    expected = {"ring_uni": 2 * full_s + 3 * 2e-6 + 3 * 1e-5, "ring_unroll2": 2 * full_s + 3 * 2e-6 + 1 * 1e-5}
    for name, seconds in expected.items():
        assert model[name]["model_s"] == pytest.approx(seconds, rel=1e-12)
        assert model[name]["measured_over_model"] == pytest.approx(rings[name]["seconds"] / seconds, rel=1e-12)


def test_gpu_calibration_refuses_a_wrong_decomposition(tmp_path, monkeypatch):
    from tools import gpu_calibrate

    real = gpu_calibrate.gather_programs

    def broken(n):
        full, loop, unrolled, reference = real(n)
        return full, (lambda x, w: loop(x, w) * 1.5), unrolled, reference

    monkeypatch.setitem(gpu_calibrate.SITES, ("all_gather_dot", "free"), broken)
    with pytest.raises(SystemExit, match="loop decomposition is off"):
        gpu_calibrate.main(["--dims", "32", "16", "32", "--ring", "4", "--dtype", "f32", "--runs", "1",
                            "--out", str(tmp_path / "c.json")])


def test_hand_written_rings_compute_the_same_training_step():
    """The bench's compile-time reference (every collective matmul as a hand-written ppermute
    ring) computes what the plain model does: loss and every gradient, f32, rtol 1e-5."""
    import jax
    import numpy as np

    plain, args = bench.transformer_step(2)
    by_hand, _ = bench.transformer_step(2, hand_written=True)
    text = by_hand.lower(*args).as_text()
    assert "stablehlo.all_gather" not in text and "stablehlo.reduce_scatter" not in text
    assert "stablehlo.collective_permute" in text
    rng = np.random.default_rng(0)
    params, x = jax.tree.map(
        lambda s: jax.device_put((0.1 * rng.standard_normal(s.shape)).astype(np.float32), s.sharding), args)
    (loss_a, grads_a), (loss_b, grads_b) = plain(params, x), by_hand(params, x)
    np.testing.assert_allclose(np.asarray(loss_b), np.asarray(loss_a), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(grads_a), jax.tree.leaves(grads_b)):
        a, b = np.asarray(a), np.asarray(b)
        assert np.abs(a - b).max() <= 1e-5 * np.abs(a).max()


def test_interleaved_medians_time_every_program_in_turn():
    """Each round runs every program once, in an order drawn afresh (so no program always runs
    after the same one), the same orders on every call (every process of a multi-process run
    issues its collectives alike); no timing asserted."""
    from cmatmul_pass.execute import interleaved_medians

    def orders():
        calls = []
        programs = {name: (lambda name=name: calls.append(name)) for name in "abcd"}
        medians = interleaved_medians(programs, runs=12, warmup=2)
        assert set(medians) == set("abcd") and all(t >= 0 for t in medians.values())
        assert calls[:8] == list("aabbccdd")  # the warm-ups, untimed
        rounds = [calls[i:i + 4] for i in range(8, len(calls), 4)]
        assert len(rounds) == 12 and all(sorted(r) == list("abcd") for r in rounds)
        return rounds

    rounds = orders()
    assert orders() == rounds
    before = {r[r.index(name) - 1] for r in rounds for name in "b" if r.index(name) > 0}
    assert len(before) > 1  # "b" follows more than one program


def test_a_ratio_interval_holds_one_only_where_the_run_cannot_tell_two_programs_apart():
    """Synthetic paired rounds: a drift shared by both programs (the machine's speed) widens
    neither program's lead; one program 3 % slower in every round is told apart, two draws of
    one program are not."""
    from cmatmul_pass.execute import paired_ratio, ratio_interval

    rng = np.random.default_rng(1)
    drift = 1.0 + 0.2 * np.sin(np.linspace(0, 6, 101))  # shared by both programs, round by round
    a = drift * (1.0 + 0.01 * rng.standard_normal(101))
    same = drift * (1.0 + 0.01 * rng.standard_normal(101))
    slower = 1.03 * drift * (1.0 + 0.01 * rng.standard_normal(101))
    low, high = ratio_interval(list(same), list(a))
    assert low < paired_ratio(list(same), list(a)) < high
    assert low < 1.0 < high and high - low < 0.02
    low, high = ratio_interval(list(slower), list(a))
    assert 1.0 < low < 1.03 < high
    assert bench._verdict((low, high)) == "slower" and bench._verdict(ratio_interval(list(same), list(a))) == "level"
    assert bench._verdict(ratio_interval(list(a), list(slower))) == "faster"
    with pytest.raises(ValueError):
        ratio_interval([1.0, 2.0], [1.0])


def test_bench_megatron_smoke(tmp_path):
    """The psum-after-matmul part of the benchmark: a Megatron training step's pass cost (every
    psum of a matmul rewritten, in the strategy the default picks) and the blocks' run time per
    strategy."""
    out = tmp_path / "megatron.json"
    assert bench.main(["--only-megatron", "--layers", "1", "--repeats", "1", "--layer-runs", "1",
                       "--megatron", "64", "32", "64", "--out", str(out)]) == 0
    results = json.loads(out.read_text())["megatron"]
    (row,) = results["pass_cost"]["per_layers"]
    assert results["pass_cost"]["model"] == "megatron"
    assert row["rewritten"] == row["sites"] and row["kinds"]["dot_all_reduce"] >= 4
    runtime = results["runtime"]
    assert set(runtime["over_original"]) == {
        "split-uni", "split-unroll2", "split-full", "split-bidi", "chunk-2", "chunk-4", "chunk-8", "default"}
    assert all(v > 0 for v in runtime["over_original"].values())
    # cmatmul_pass.jit's own module on this CPU, which no profile describes: every psum in two
    # chunks (cost.fallback_all_reduce), the chunk-2 strategy's very module
    assert runtime["default_sites"] == [["chunk", None]] and runtime["default_is"] == "chunk-2"


def test_bench_pass_cost_alone(tmp_path):
    """``--only-pass-cost``: the pass's share of lower + compile on both models, both paths, nothing else."""
    out = tmp_path / "pass_cost.json"
    assert bench.main(["--only-pass-cost", "--layers", "1", "--repeats", "1", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert {key for key in results if key.startswith("pass_cost")} == {f"pass_cost_{m}" for m in bench.MODELS}
    for model in bench.MODELS:
        (row,) = results[f"pass_cost_{model}"]["per_layers"]
        assert results[f"pass_cost_{model}"]["model"] == model and row["layers"] == 1
        assert row["pass_over_lower_compile"] > 0 and row["jit_pass_over_lower_compile"] > 0
    assert "samples" not in results and "megatron" not in results


def test_the_pass_profile_names_where_the_time_goes(tmp_path):
    """``make bench`` saves the pass's cProfile: the decorator's entry point and the
    rewrite's phases appear, sorted both ways."""
    from tools.bench import profile_pass

    out = profile_pass(1, out=tmp_path / "profile.txt")
    text = out.read_text()
    assert text.startswith("# the pass on the sequence_parallel model at L = 1")
    assert "rewrite_lowered" in text and "rewrite_sites" in text
    assert "Ordered by: cumulative time" in text and "Ordered by: internal time" in text


def test_bench_warm_pass_cost(tmp_path):
    """``--only-warm``: the pass warm on both paths and the decorator's share per phase, each
    phase's functions really called (a share above zero where the step has rings to build)."""
    out = tmp_path / "warm.json"
    real = bench.warm_pass_cost
    try:
        bench.warm_pass_cost = lambda layers, runs=15, model="sequence_parallel": real(layers, 1, model)
        assert bench.main(["--only-warm", "--layers", "1", "--out", str(out)]) == 0
    finally:
        bench.warm_pass_cost = real
    (row,) = json.loads(out.read_text())["pass_warm"]["per_layers"]
    assert row["layers"] == 1 and row["jit_pass_s"] > 0 and row["pass_s"] > 0
    assert set(row["shares"]) == set(bench.WARM_PHASES)
    assert 0 < row["shares"]["building rings"] < 1 and 0 < row["shares"]["matching"] < 1
    assert sum(row["shares"].values()) < 1
    # the functions timed are the ones the pipeline calls (patched back afterwards)
    from cmatmul_pass import sites
    assert sites.rewrite_dot_reduce_scatter.__module__ == "cmatmul_pass.rewrites.dot_reduce_scatter"


def test_ab_pass_times_an_earlier_commit_beside_this_checkout(tmp_path):
    """tools/ab_pass.py: the earlier commit's package, out of git under another name, run
    alternately with this checkout's on one lowered program; paired ratios; nothing left behind."""
    import sys

    from tools import ab_pass

    out = tmp_path / "ab.json"
    path = list(sys.path)
    assert ab_pass.main(["HEAD", "--layers", "1", "--runs", "3", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["base"] == "HEAD" and results["runs"] == 3
    (row,) = results["per_layers"]
    assert row["layers"] == 1 and row["base_median_s"] > 0 and row["head_median_s"] > 0
    assert row["ratio_q25"] <= row["ratio_median"] <= row["ratio_q75"]
    assert results["path"] == "jit"
    assert not any(name.startswith(ab_pass.BASE_PACKAGE) for name in sys.modules)
    assert sys.path == path
    # on the text (parse, rewrite, print): the same, the text's pass is timed
    assert ab_pass.main(["HEAD", "--layers", "1", "--runs", "3", "--path", "text", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    (row,) = results["per_layers"]
    assert results["path"] == "text" and row["base_median_s"] > 0 and row["head_median_s"] > 0
    assert not any(name.startswith(ab_pass.BASE_PACKAGE) for name in sys.modules)
