"""The benchmark script runs and writes its results (a smoke test: no timing is asserted here —
performance numbers come from `make bench`)."""

import json

import pytest

from tools import bench


def test_bench_smoke(tmp_path):
    out = tmp_path / "results.json"
    assert bench.main(["--layers", "1", "--variant-layers", "1", "--runs", "1", "--repeats", "1", "--samples", "ag_dot_1d", "rs_dot_1d",
                       "--layer", "64", "32", "64", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    (row,) = results["pass_cost"]["per_layers"]
    assert row["layers"] == 1 and row["rewritten"] == row["sites"] > 0
    assert set(results["pass_cost"]["compile_ratio"]) == set(bench.VARIANTS)
    assert set(results["samples"]) == {"ag_dot_1d", "rs_dot_1d"}
    assert set(results["layer"]["variants"]) == set(bench.VARIANTS)
    assert results["fastest_variant"] in bench.VARIANTS


def test_gpu_calibration_runs_on_any_backend(tmp_path):
    """tools/gpu_calibrate.py at tiny shapes on CPU: the decompositions are checked against the
    full dot before timing, and the override it prints is a valid --hardware profile."""
    from cmatmul_pass import cost
    from tools import gpu_calibrate

    out = tmp_path / "calibration.json"
    assert gpu_calibrate.main(["--dims", "64", "32", "128", "--ring", "4", "--dtype", "bf16", "--runs", "1",
                               "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [s["kind"] for s in result["sites"]] == ["all_gather_dot", "dot_reduce_scatter"]
    gather, scatter = result["sites"]
    assert gather["shapes"] == [[64, 32], [32, 32]] and scatter["shapes"] == [[64, 32], [32, 32]]
    for site in result["sites"]:
        assert site["efficiency_loop"] == site["full_s"] / site["loop_s"] > 0
        assert max(site["max_relative_error"].values()) <= gpu_calibrate.TOLERANCE["bf16"]
    hw = cost.hardware(result["hardware_override"])
    assert hw.split_efficiency == round(result["split_efficiency"], 3)


def test_gpu_calibration_refuses_a_wrong_decomposition(tmp_path, monkeypatch):
    from tools import gpu_calibrate

    real = gpu_calibrate.gather_programs

    def broken(n):
        full, loop, unrolled, reference = real(n)
        return full, (lambda x, w: loop(x, w) * 1.5), unrolled, reference

    monkeypatch.setattr(gpu_calibrate, "gather_programs", broken)
    with pytest.raises(SystemExit, match="loop decomposition is off"):
        gpu_calibrate.main(["--dims", "32", "16", "32", "--ring", "4", "--dtype", "f32", "--runs", "1",
                            "--out", str(tmp_path / "c.json")])
