"""The benchmark script runs and writes its results (a smoke test: no timing is asserted here —
performance numbers come from `make bench`)."""

import json

from tools import bench


def test_bench_smoke(tmp_path):
    out = tmp_path / "results.json"
    assert bench.main(["--layers", "1", "--variant-layers", "1", "--runs", "1", "--samples", "ag_dot_1d", "rs_dot_1d",
                       "--layer", "64", "32", "64", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    (row,) = results["pass_cost"]["per_layers"]
    assert row["layers"] == 1 and row["rewritten"] == row["sites"] > 0
    assert set(results["pass_cost"]["compile_ratio"]) == set(bench.VARIANTS)
    assert set(results["samples"]) == {"ag_dot_1d", "rs_dot_1d"}
    assert set(results["layer"]["variants"]) == set(bench.VARIANTS)
    assert results["fastest_variant"] in bench.VARIANTS
