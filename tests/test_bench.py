"""The benchmark script runs and writes its results (a smoke test: no timing is asserted here —
performance numbers come from `make bench`)."""

import json
import statistics
from pathlib import Path

import numpy as np
import pytest

from tools import bench


def test_rings_against_a_hand_written_ring():
    """Issue 35's benchmark: per layer, the default and every variant over the hand-written ring,
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
    assert bench.main(["--layers", "1", "--variant-layers", "1", "--runs", "1", "--layer-runs", "1", "--repeats", "1",
                       "--samples", "ag_dot_1d", "rs_dot_1d",
                       "--layer", "64", "32", "64", "--ring-runs", "0", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    # the pass's profile lands beside the results, not in the repository's bench/
    assert results["pass_cost"]["profile"] == str(tmp_path / "profile_sequence_parallel_L1.txt")
    assert (tmp_path / "profile_sequence_parallel_L1.txt").stat().st_size > 0
    assert "rings" not in results  # --ring-runs 0 skips them (test_rings_against_a_hand_written_ring runs them)
    (row,) = results["pass_cost"]["per_layers"]
    assert row["layers"] == 1 and row["rewritten"] == row["sites"] > 0
    assert 0 <= row["ring_functions"] <= row["shared"] < row["sites"]
    assert row["parse_print_s"] > 0 and row["parse_print_over_lower_compile"] > 0
    assert row["jit_pass_s"] > 0 and row["jit_pass_over_lower_compile"] == row["jit_pass_s"] / (row["lower_s"] + row["compile_s"])
    assert set(results["pass_cost"]["compile_ratio"]) == set(bench.VARIANTS)
    assert results["pass_cost"]["compile_ratio_hand_written_rings"] > 0
    assert results["pass_cost"]["compile_ratio_by_layers"]["1"] == {
        **results["pass_cost"]["compile_ratio"], "hand_written_rings": results["pass_cost"]["compile_ratio_hand_written_rings"]}
    assert set(results["samples"]) == {"ag_dot_1d", "rs_dot_1d"}
    assert set(results["layer"]["variants"]) == set(bench.VARIANTS)
    ratios, fastest = results["samples_median_ratio"], results["fastest_variant"]
    assert ratios[fastest] == min(ratios.values())
    assert results["within_5_percent_of_fastest"] == [
        k for k in bench.VARIANTS if k != fastest and ratios[k] <= 1.05 * ratios[fastest]]
    # the run judges itself against issue 7's targets; L = 32 was not run, so those two are unmeasured
    rows = {row["target"]: row for row in results["targets"]}
    assert [row["target"] for row in results["targets"]] == [name for name, _ in bench.TARGETS]
    assert rows["pass time / (lower + compile) at L = 32"]["met"] is None
    assert rows["pass time(32) / time(8)"]["met"] is None
    compile_row = rows["compile time, rewritten / original, every variant at every L measured"]
    assert compile_row["value"] == results["pass_cost"]["compile_ratio"]
    assert compile_row["above"] == [k for k, v in compile_row["value"].items() if v > 1.2]
    assert compile_row["met"] is (not compile_row["above"])


def test_targets_name_the_variants_above_each_limit():
    results = {
        "pass_cost": {"per_layers": [{"layers": 8, "pass_over_lower_compile": 0.07},
                                     {"layers": 32, "pass_over_lower_compile": 0.048}],
                      "scaling_32_over_8": 4.5,
                      "compile_ratio_by_layers": {"4": {name: 1.1 for name in bench.VARIANTS} | {"full": 1.3}}},
        "layer": {"variants": {"uni": {"over_plain": 1.2, "over_hand_written": 0.99},
                               "full": {"over_plain": 0.9, "over_hand_written": 1.0}}},
    }
    rows = bench.targets(results)
    assert [(r["met"], r["above"]) for r in rows] == [
        (True, []),  # 0.048 <= 0.05 (L = 32's row, not L = 8's)
        (False, []),  # 4.5 > 4.4
        (False, ["full"]),
        (False, ["uni"]),
        (True, []),  # 1.0 is within a limit of 1.0
        (False, []),  # issue 35's 3 %: 0.048 > 0.03
        (None, []),  # the pass as cmatmul_pass.jit runs it: not in these results
        (None, []),  # the rings against the hand-written one: not run
    ]
    # issue 35's ring target: per shape, the low end of the default's interval (not measurably slower)
    rings = [{"kind": "column", "shape": [8, 4, 8], "default_interval": [0.97, 1.02]},
             {"kind": "row", "shape": [8, 4, 8], "default_interval": [1.01, 1.04]}]
    ring_row = bench.targets({"rings": rings})[-1]
    assert ring_row["value"] == {"column 8x4x8": 0.97, "row 8x4x8": 1.01}
    assert (ring_row["met"], ring_row["above"]) == (False, ["row 8x4x8"])
    assert bench.targets({"rings": rings[:1]})[-1]["met"] is True
    assert bench.targets({})[0]["met"] is None
    # compile ratios at several L: each variant's worst
    by_layers = {"4": {name: 1.1 for name in bench.VARIANTS}, "32": {name: 1.1 for name in bench.VARIANTS}}
    by_layers["32"]["uni"] = 1.5
    compile_row = bench.targets({"pass_cost": {"compile_ratio_by_layers": by_layers}})[2]
    assert compile_row["value"]["uni"] == 1.5 and compile_row["above"] == ["uni"]


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
    """gpu_calibrate --merge over the stored 70B, 8B (and, for the H200, 3B) runs (bench/gpu/)
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


@pytest.mark.parametrize("model, expected_ms", [("70b", (1.002, 0.945)), ("8b", (0.378, 0.329))])
def test_the_stored_h100_rings_model_is_what_docs_gpu_md_says(model, expected_ms):
    """docs/gpu.md compares the model with the gather rings timed on one H100
    (bench/gpu/h100_calibrate_*_rings.json): the h100 profile, the run's full-dot throughput, no
    transfers.  ring_model reproduces those predictions; when the profile changes, so must the doc."""
    from tools import gpu_calibrate

    stored = json.loads((bench.ROOT / "bench" / "gpu" / f"h100_calibrate_{model}_rings.json").read_text())
    tokens, hidden, ffn = stored["dims"]
    n = stored["ring"]
    model_ = gpu_calibrate.ring_model("all_gather_dot", stored["gather_rings"], n, [(tokens, hidden), (hidden, ffn // n)],
                                      stored["dtype"], "h100")
    assert [round(1e3 * model_[name]["model_s"], 3) for name in ("ring_uni", "ring_unroll2")] == list(expected_ms)


def _readme_performance_summary() -> str:
    readme = (bench.ROOT / "docs" / "performance-summary.md").read_text()  # the README's, before issue 33
    start = readme.index("\n## Performance")
    return readme[start:readme.index("\n## ", start + 1)]


def test_the_readme_summary_quotes_the_stored_bench_run():
    """The README's Performance summary quotes `bench/results.json` (the last `make bench`): a
    run committed without updating the summary fails here, and so does a summary edited by hand."""
    results = json.loads((bench.ROOT / "bench" / "results.json").read_text())
    summary = _readme_performance_summary()
    rows = {line.split(" | ")[0].lstrip("| "): line for line in summary.splitlines() if line.startswith("| ")}
    by_layers = {r["layers"]: r for r in results["pass_cost"]["per_layers"]}
    share = rows["pass time ≤ 5 % of `jax.jit`'s lower + compile, 32 layers (479 sites)"]
    assert f"{100 * by_layers[32]['pass_over_lower_compile']:.2f} %" in share
    assert f"parse + print {100 * by_layers[32]['parse_print_over_lower_compile']:.2f} %" in share
    assert by_layers[32]["sites"] == 479
    assert f"| {results['pass_cost']['scaling_32_over_8']:.2f} |" in rows["pass time(32 layers) / time(8) ≤ 4.4 (linear)"]

    def span(values: dict) -> str:  # "low (`name`) to high (`name`)"
        low, high = min(values, key=values.get), max(values, key=values.get)
        return f"{values[low]:.2f} (`{low}`) to {values[high]:.2f} (`{high}`)"

    compile_row = rows["rewritten module compiles in ≤ 1.2× the original's time, every variant"]
    assert span(results["pass_cost"]["compile_ratio"]) + " at 4 layers" in compile_row
    assert f"hand-written rings {results['pass_cost']['compile_ratio_hand_written_rings']:.1f}" in compile_row
    # the 32-layer span comes from the separate by-layers run the row names
    by_layers_run = json.loads((bench.ROOT / "bench" / "results_compile_by_layers.json").read_text())
    at_32 = dict(by_layers_run["pass_cost"]["compile_ratio_by_layers"]["32"])
    hand_32 = at_32.pop("hand_written_rings")
    assert "`bench/results_compile_by_layers.json`" in compile_row
    assert f"{min(at_32.values()):.1f} to {max(at_32.values()):.1f} at 32" in compile_row
    assert f"and {hand_32:.1f} |" in compile_row
    # the GPU row quotes the stored H100 calibration at 70B shapes (the gather site: the worst)
    gpu = json.loads((bench.ROOT / "bench" / "gpu" / "h100_calibrate_70b.json").read_text())
    split_row = rows["ring's per-step dots keep ≥ 0.95 of the full dot's throughput (H100, 70B shapes)"]
    assert gpu["target"] == 0.95 and gpu["meets_target"] is False and split_row.rstrip(" |").endswith("| no")
    assert (f"| {gpu['split_efficiency']:.2f} straight-line, {gpu['loop_efficiency']:.2f} in the loop"
            in split_row)
    layer = results["layer"]
    plain_row = rows["CPU run time ≤ 1.0 of the plain program, every variant (layer 1024×512×1024)"]
    assert span({k: v["over_plain"] for k, v in layer["variants"].items()}) in plain_row
    assert f"the hand-written ring {layer['hand_written_ring_over_plain']:.2f}" in plain_row
    assert layer["shape"] == [1024, 512, 1024]
    ring_row = rows["CPU run time ≤ 1.0 of the hand-written `ppermute` ring, every variant"]
    assert span({k: v["over_hand_written"] for k, v in layer["variants"].items()}) in ring_row
    medians = results["samples_median_ratio"].values()
    assert (f"the rings take {min(medians):.1f}–{max(medians):.1f}× the original's time (median over samples)"
            in " ".join(summary.split()))
    # the verdicts are the run's own
    verdicts = [row["met"] for row in results["targets"]]  # in bench.TARGETS' order, as the table's rows
    assert len(verdicts) == len(bench.TARGETS) == 8
    names = list(rows)[list(rows).index("target (issues 7 and 35)") + 1:][:8]
    assert names[0].startswith("pass time ≤ 5 %") and names[4].startswith("CPU run time ≤ 1.0 of the hand-written")
    assert names[5].startswith("issue 35: pass time ≤ 3 %") and names[6].startswith("issue 35: the same, as `cmatmul_pass.jit`")
    assert f"| {100 * by_layers[32]['pass_over_lower_compile']:.2f} % |" in rows[names[5]]
    assert f"| {100 * by_layers[32]['jit_pass_over_lower_compile']:.2f} % |" in rows[names[6]]
    assert names[7].startswith("issue 35: the default's CPU run time ≤ 1.0 of the hand-written ring")
    lows = [row["default_interval"][0] for row in results["rings"]]
    assert f"low ends {min(lows):.3f}–{max(lows):.3f}" in rows[names[7]]
    stated = [rows[name].rstrip(" |").rsplit("| ", 1)[1].startswith("yes") for name in names]
    assert stated == verdicts


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
    """``make bench`` saves the pass's cProfile (issue 35): the decorator's entry point and the
    rewrite's phases appear, sorted both ways."""
    from tools.bench import profile_pass

    out = profile_pass(1, out=tmp_path / "profile.txt")
    text = out.read_text()
    assert text.startswith("# the pass on the sequence_parallel model at L = 1")
    assert "rewrite_lowered" in text and "rewrite_sites" in text
    assert "Ordered by: cumulative time" in text and "Ordered by: internal time" in text


def test_the_megatron_table_quotes_the_stored_bench_run():
    """docs/performance.md's "psum after a matmul, measured" row is `bench/results.json`'s Megatron
    run time, and the default it names is the one the run found."""
    runtime = json.loads((bench.ROOT / "bench" / "results.json").read_text())["megatron"]["runtime"]
    doc = (bench.ROOT / "docs" / "performance.md").read_text()
    section = doc[doc.index("**psum after a matmul, measured**"):doc.index("**Megatron blocks without sequence")]
    order = ["split-uni", "split-unroll2", "split-full", "split-bidi", "chunk-2", "chunk-4", "chunk-8", "default"]
    assert set(order) == set(runtime["over_original"])
    assert "| " + " | ".join(f"{runtime['over_original'][name]:.2f}" for name in order) + " |" in section
    assert runtime["default_is"] == "chunk-2" and "The default is chunk 2 here" in section
    assert runtime["shape"] == {"rows": 1024, "hidden": 512, "ffn": 1024, "blocks": 2}


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
    from cmatmul_pass import pipeline
    assert pipeline.rewrite_dot_reduce_scatter.__module__ == "cmatmul_pass.rewrites.dot_reduce_scatter"


def test_the_fixed_cost_paragraph_quotes_the_stored_warm_run():
    """docs/performance.md's "Where the fixed cost goes" is `bench/results_warm.json`."""
    rows = json.loads((bench.ROOT / "bench" / "results_warm.json").read_text())["pass_warm"]["per_layers"]
    doc = " ".join((bench.ROOT / "docs" / "performance.md").read_text().split())
    section = doc[doc.index("**Where the fixed cost goes**"):doc.index("**2026-11-27, fifth session")]
    assert [r["layers"] for r in rows] == [1, 4, 8, 16, 32]
    assert "takes " + ", ".join(f"{1e3 * r['jit_pass_s']:.1f}" for r in rows[:4]) + " ms" in section
    assert "(" + ", ".join(f"{1e3 * r['pass_s']:.1f}" for r in rows[:4]) + " on the text)" in section
    for phase, words in (("building rings", "building the rings is"), ("matching", "matching"),
                         ("walking and replaying", "identical regions")):
        shares = [round(100 * rows[i]["shares"][phase]) for i in (0, 1, 4)]
        assert f"{words} {shares[0]}, {shares[1]} and {shares[2]} %" in section, phase


def test_the_tie_paragraph_quotes_the_stored_bench_run():
    """docs/variants.md's tie paragraph (cost.TIE): the pass on the text at 4 and 32 layers with the
    default's chunks and with every psum split, and the compile ratios, are `bench/results.json`'s."""
    pass_cost = json.loads((bench.ROOT / "bench" / "results.json").read_text())["pass_cost"]
    doc = " ".join((bench.ROOT / "docs" / "variants.md").read_text().split())
    rows = {r["layers"]: r for r in pass_cost["per_layers"]}
    assert (f"{rows[4]['pass_s']:.3f} s at 4 layers and {rows[32]['pass_s']:.3f} s at 32, against "
            f"{rows[4]['pass_split_psums_s']:.3f} and {rows[32]['pass_split_psums_s']:.3f} s with every psum split"
            in doc)
    ratios = pass_cost["compile_ratio_default_by_layers"]["4"]
    assert f"{ratios['default']:.2f} against {ratios['default, psums split']:.2f} times the original's" in doc


def test_the_eleventh_session_paragraph_quotes_its_pass_cost_runs():
    """docs/performance.md's "2026-11-28" table is the two stored `--only-pass-cost` runs', its
    ratios the stored `tools/ab_pass.py` run's; the summary quotes both."""
    doc = " ".join((bench.ROOT / "docs" / "performance.md").read_text().split())
    summary = " ".join((bench.ROOT / "docs" / "performance-summary.md").read_text().split())
    sp = {}
    for when, suffix in (("before", "_before"), ("after", "")):
        stored = json.loads((bench.ROOT / "bench" / f"results_pass_cost_2026-11-28{suffix}.json").read_text())
        for model, name in (("sequence_parallel", "sequence-parallel step"), ("megatron", "Megatron step")):
            rows = stored[f"pass_cost_{model}"]["per_layers"]
            assert [r["layers"] for r in rows] == [1, 4, 8, 16, 32]
            cells = " | ".join(f"{100 * r['jit_pass_over_lower_compile']:.2f} %" for r in rows)
            assert f"| {name}, {when} | {cells} |" in doc, (model, when)
        sp[when] = {r["layers"]: r for r in stored["pass_cost_sequence_parallel"]["per_layers"]}
    share = {layers: f"{100 * sp['after'][layers]['jit_pass_over_lower_compile']:.2f} %" for layers in (4, 8)}
    assert f"({share[4]} and {share[8]} in its stored run" in doc
    assert f"({share[4]} and {share[8]} in its stored run" in summary
    assert (f"its pass took {1e3 * sp['after'][8]['jit_pass_s']:.0f} ms cold where the \"before\" run's took "
            f"{1e3 * sp['before'][8]['jit_pass_s']:.0f}") in doc
    more = [{r["layers"]: r for r in json.loads((bench.ROOT / "bench" / f"results_pass_cost_2026-11-28_after_{i}.json")
                                            .read_text())["pass_cost_sequence_parallel"]["per_layers"]} for i in (2, 3, 4)]
    assert all(sorted(run) == [4, 8] for run in more)
    shares = {layers: [100 * run[layers]["jit_pass_over_lower_compile"] for run in [sp["after"], *more]] for layers in (4, 8)}
    assert (", ".join(f"{v:.2f}" for v in shares[4][1:]) + " % and " + ", ".join(f"{v:.2f}" for v in shares[8][1:])
            + " %") in doc
    assert (f"(4 layers {min(shares[4]):.2f}–{max(shares[4]):.2f} %, 8 layers {min(shares[8]):.2f}–"
            f"{max(shares[8]):.2f} % in the four)") in doc
    by_layers = _ab_ratios_quoted("ab_pass_2026-11-28.json", "4991bae", 30, doc)
    assert f"to {by_layers[4]} and {by_layers[8]} of its time at 4 and 8 layers" in summary


def _ab_ratios_quoted(name: str, base: str, runs: int, text: str) -> dict[int, str]:
    """The stored `tools/ab_pass.py` run ``name`` (against ``base``, ``runs`` pairs, a clean tree):
    its median ratios as ``text`` quotes them; returns them by layers."""
    ab = json.loads((bench.ROOT / "bench" / name).read_text())
    rows = ab["per_layers"]
    assert ab["base"] == base and not ab["dirty"] and ab["runs"] == runs
    ratios = [f"{r['ratio_median']:.3f}" for r in rows]
    assert (f"the pass takes {', '.join(ratios[:-1])} and {ratios[-1]} of its time at "
            f"{', '.join(str(r['layers']) for r in rows[:-1])} and {rows[-1]['layers']} layers") in text
    return {r["layers"]: f"{r['ratio_median']:.3f}" for r in rows}


def _ab_both_paths_quoted(stem: str, base: str, section: str, summary: str) -> None:
    """The stored A/B runs ``<stem>.json`` (the decorator's path, 60 pairs) and ``<stem>_text.json``
    (the text's, 40 pairs) as ``section`` quotes them, and the first's 4-, 8- and 32-layer ratios as
    ``summary`` does."""
    by_layers = _ab_ratios_quoted(f"{stem}.json", base, 60, section)
    assert f"took it to {by_layers[4]} and {by_layers[8]} of that ({by_layers[32]} at 32" in summary
    text = json.loads((bench.ROOT / "bench" / f"{stem}_text.json").read_text())
    assert text["path"] == "text"
    _ab_ratios_quoted(f"{stem}_text.json", base, 40, section)


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


def _session_runs(session: str, until: str, date: str = "2026-11-28") -> tuple:
    """docs/performance.md's ``session`` paragraph (up to the ``until`` one) and the summary, with
    the paragraph's table checked against the stored `--only-pass-cost` run
    (``results_pass_cost_<date>_<session>.json``) and its further runs at 4 and 8 layers
    (``..._{2,3}.json``) and the ranges of the three quoted: returns (section, summary, the first
    run's and the further runs' rows by layers, the ranges' texts)."""
    doc = " ".join((bench.ROOT / "docs" / "performance.md").read_text().split())
    summary = " ".join((bench.ROOT / "docs" / "performance-summary.md").read_text().split())
    section = doc[doc.index(f"**{date}, {session} session"):doc.index(until)]
    stored = json.loads((bench.ROOT / "bench" / f"results_pass_cost_{date}_{session}.json").read_text())
    for model, name in (("sequence_parallel", "sequence-parallel step"), ("megatron", "Megatron step")):
        rows = stored[f"pass_cost_{model}"]["per_layers"]
        assert [r["layers"] for r in rows] == [1, 4, 8, 16, 32]
        cells = " | ".join(f"{100 * r['jit_pass_over_lower_compile']:.2f} %" for r in rows)
        assert f"| {name} | {cells} |" in section, model
    first = {r["layers"]: r for r in stored["pass_cost_sequence_parallel"]["per_layers"]}
    more = [{r["layers"]: r for r in json.loads((bench.ROOT / "bench" / f"results_pass_cost_{date}_{session}_{i}.json")
                                            .read_text())["pass_cost_sequence_parallel"]["per_layers"]} for i in (2, 3)]
    assert all(sorted(run) == [4, 8] for run in more)
    shares = {layers: [100 * run[layers]["jit_pass_over_lower_compile"] for run in [first, *more]] for layers in (4, 8)}
    assert (", ".join(f"{v:.2f}" for v in shares[4][1:]) + " % and " + ", ".join(f"{v:.2f}" for v in shares[8][1:])
            + " %") in section
    ranges = (f"{min(shares[4]):.2f}–{max(shares[4]):.2f} %", f"{min(shares[8]):.2f}–{max(shares[8]):.2f} %")
    assert f"at 4 layers {ranges[0]} and at 8 layers {ranges[1]} in the three" in section
    return section, summary, first, more, shares, ranges


def test_the_fifteenth_session_paragraph_quotes_its_runs():
    """docs/performance.md's fifteenth-session paragraph: its table is the stored `--only-pass-cost`
    run's, its further runs, ranges, margin, compile and pass times, the text's shares and both
    paths' ratios the stored ones'; the summary quotes the ratios and the ranges."""
    section, summary, first, more, shares, ranges = _session_runs(
        "fifteenth", "**2026-11-29, fourteenth session", date="2026-11-29")
    assert f"On the text at 32 layers: {100 * first[32]['pass_over_lower_compile']:.2f} %." in section
    every = shares[4] + shares[8]
    assert max(every) <= 3 and f"under the line in every run, by {3 - max(every):.2f} points at the least" in section
    assert (f"XLA compiled the 4-layer step in {more[1][4]['compile_s']:.2f} s against {first[4]['compile_s']:.2f} s "
            f"in the first, the pass taking {1e3 * more[1][4]['jit_pass_s']:.1f} and {1e3 * first[4]['jit_pass_s']:.1f} ms"
            in section)
    small = [100 * first[layers]["pass_over_lower_compile"] for layers in (1, 4, 8, 16)]
    parse_print = [100 * first[layers]["parse_print_over_lower_compile"] for layers in (1, 4, 8, 16)]
    assert (f"at 1 to 16 layers is {min(small):.2f}–{max(small):.2f} % in the first run, of which parsing and "
            f"printing {min(parse_print):.2f}–{max(parse_print):.2f} %") in section
    _ab_both_paths_quoted("ab_pass_2026-11-29_fifteenth", "dbcb8a0", section, summary)
    assert f"{ranges[0]} and {ranges[1]} in three runs, under the line in every one." in summary
    # the full `make bench` run after it, stored beside the one the summary quotes
    full = json.loads((bench.ROOT / "bench" / "results_2026-11-29_fifteenth_make_bench.json").read_text())
    assert all(t["met"] for t in full["targets"] if "issue 35" in t["target"])
    rows = {r["layers"]: r for r in full["pass_cost"]["per_layers"]}
    lows = [row["default_interval"][0] for row in full["rings"]]
    assert (f"the pass at 32 layers {100 * rows[32]['pass_over_lower_compile']:.2f} % of lower + compile on the "
            f"text and {100 * rows[32]['jit_pass_over_lower_compile']:.2f} % through `cmatmul_pass.jit`") in section
    assert f"(its intervals' low ends {min(lows):.3f}–{max(lows):.3f})" in section
    small = [f"{100 * rows[layers]['jit_pass_over_lower_compile']:.2f}" for layers in (1, 4, 8, 16)]
    assert f"it took {', '.join(small[:3])} and {small[3]} % at 1, 4, 8 and 16 layers there" in section
    assert max(100 * rows[layers]["jit_pass_over_lower_compile"] for layers in rows) <= 3


def test_the_fourteenth_session_paragraph_quotes_its_runs():
    """docs/performance.md's fourteenth-session paragraph: its table is the stored `--only-pass-cost`
    run's, its further runs, ranges, pass times, compile times and both paths' ratios the stored
    ones'; the summary quotes the ratios and the ranges."""
    section, summary, first, more, shares, ranges = _session_runs(
        "fourteenth", "**2026-11-28, thirteenth session", date="2026-11-29")
    assert f"On the text at 32 layers: {100 * first[32]['pass_over_lower_compile']:.2f} %." in section
    assert (f"the pass took {1e3 * more[1][4]['jit_pass_s']:.1f} and {1e3 * more[1][8]['jit_pass_s']:.1f} ms at 4 "
            f"and 8 layers, against {1e3 * first[4]['jit_pass_s']:.1f} and {1e3 * first[8]['jit_pass_s']:.1f} ms in "
            f"the first run, while XLA compiled in {more[1][4]['compile_s']:.2f} and {more[1][8]['compile_s']:.2f} s, "
            f"as in the second ({more[0][4]['compile_s']:.2f} and {more[0][8]['compile_s']:.2f} s)") in section
    assert sum(v <= 3 for v in shares[4]) == 2  # "under the line in two runs of three at 4 layers"
    _ab_both_paths_quoted("ab_pass_2026-11-29_fourteenth", "f8cc19b", section, summary)
    assert f"{ranges[0]} and {ranges[1]} in three runs." in summary


def test_the_thirteenth_session_paragraph_quotes_its_runs():
    """docs/performance.md's thirteenth-session paragraph: its table is the stored `--only-pass-cost`
    run's, its further runs, ranges and ratios the stored ones'; the summary quotes the ratios and
    the ranges."""
    section, summary, first, more, shares, ranges = _session_runs("thirteenth", "**2026-11-28, twelfth session")
    assert f"compiled the 4-layer step in {first[4]['compile_s']:.2f} s there, in " \
           f"{more[0][4]['compile_s']:.2f} and {more[1][4]['compile_s']:.2f} s" in section
    assert f"{ranges[0]} and {ranges[1]} in three runs." in summary
    assert sum(v <= 3 for v in shares[4]) == 2  # "under the line in two runs of three at 4 layers"
    _ab_ratios_quoted("ab_pass_2026-11-28_thirteenth.json", "43daf1e", 60, section)
    by_layers = _ab_ratios_quoted("ab_pass_2026-11-28_thirteenth_trim.json", "43daf1e", 60, section)
    assert f"took it to {by_layers[4]} and {by_layers[8]} of that" in summary
    tried = json.loads((bench.ROOT / "bench" / "ab_pass_2026-11-28_chunk_memo_tried.json").read_text())
    assert tried["dirty"] and tried["runs"] == 40  # measured on the uncommitted change, as the paragraph says
    ratios = [f"{r['ratio_median']:.3f}" for r in tried["per_layers"]]
    assert f"{', '.join(ratios[:-1])} and {ratios[-1]} of the time at 1, 4, 8 and 32 layers" in section


def test_the_twelfth_session_paragraph_quotes_its_runs():
    """docs/performance.md's twelfth-session paragraph: its table is the stored `--only-pass-cost`
    run's, its further runs and ratios the stored ones', its shares the stored profile's; the summary
    quotes the ratios and the ranges."""
    section, summary, first, more, shares, ranges = _session_runs("twelfth", "**2026-11-27, fifth session")
    assert f"compiled the 4-layer step in {first[4]['compile_s']:.2f} s, against " \
           f"{more[1][4]['compile_s']:.2f} and {more[0][4]['compile_s']:.2f} s" in section
    assert f"({ranges[0]} and {ranges[1]} in three runs)" in summary
    by_layers = _ab_ratios_quoted("ab_pass_2026-11-28_twelfth.json", "cdc2f6c", 60, section)
    assert f"to {by_layers[4]} and {by_layers[8]} of that" in summary
    profile = (bench.ROOT / "bench" / "profile_sequence_parallel_L4_pyspy.txt").read_text().splitlines()
    measured = {line.split("%", 1)[1].strip(): line.split("%")[0].strip() for line in profile if not line.startswith("#")}
    for words, key in (("rings", "building the 8 ring functions' rings"), ("the 14 psums", "the 14 psums"),
                       ("matching", "matching them"), ("chunking", "chunking them"),
                       ("identical regions", "grouping the identical regions and replaying them"),
                       ("matching the gathers and scatters", "matching the gathers and scatters"),
                       ("their keys", "their pattern keys"), ("predictions", "their shapes and predictions"),
                       ("verification", "verification")):
        found = next(v for k, v in measured.items() if k.startswith(key))
        assert f"{words} {found} %" in section, words
