"""The whole step's prediction (program_cost: a critical-path schedule of the module before and
after), sites named by their call stack and layer, explain's units and its chart."""

from __future__ import annotations

import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import cmatmul_pass
from cmatmul_pass import cost, ir_utils, program_cost, timeline
from cmatmul_pass._jax_private import make_context
from cmatmul_pass.report import durations
from conftest import ROOT, run_cli, sample, module_line

SOURCE = open(__file__).read().splitlines()


def line_of(marker: str) -> int:
    return next(i for i, text in enumerate(SOURCE, 1) if text.rstrip().endswith(f"# {marker}"))


def dense(x, w, gather):
    if gather:
        return jax.lax.all_gather(x, "model", axis=0, tiled=True) @ w  # DENSE-GATHER
    return jax.lax.psum_scatter(x @ w, "model", scatter_dimension=0, tiled=True)  # DENSE-SCATTER


def block(x, w1, w2):
    return x + dense(jax.nn.gelu(dense(x, w1, True)), w2, False)  # BLOCK


def two_blocks(x, w1, w2, w3, w4):
    x = block(x, w1, w2)  # FIRST-LAYER
    return block(x, w3, w4)  # SECOND-LAYER


def _lowered(f, shapes, specs, dtype=jnp.float32) -> str:
    mesh = jax.make_mesh((8,), ("model",))
    args = [jax.ShapeDtypeStruct(s, dtype, sharding=NamedSharding(mesh, spec)) for s, spec in zip(shapes, specs)]
    return jax.jit(f(mesh)).lower(*args).as_text(debug_info=True)


SPECS = (P("model"), P(None, "model"), P("model", None), P(None, "model"), P("model", None))


def two_blocks_text(t: int, h: int, f: int, dtype=jnp.float32) -> str:
    """Two layers of two matmuls each, all four through one ``dense()`` helper."""
    return _lowered(lambda mesh: jax.shard_map(two_blocks, mesh=mesh, in_specs=SPECS, out_specs=P("model")),
                    [(t, h), (h, f), (f, h), (h, f), (f, h)], SPECS, dtype)


def looped_blocks_text() -> str:
    """The same block as a Python loop over a shard_map'd layer: one region per layer, located alike."""
    def model(mesh):
        layer = jax.shard_map(block, mesh=mesh, in_specs=SPECS[:3], out_specs=P("model"))

        def run(x, w1, w2, w3, w4):
            for a, b in ((w1, w2), (w3, w4)):
                x = layer(x, a, b)
            return x
        return run
    return _lowered(model, [(64, 32), (32, 128), (128, 32), (32, 128), (128, 32)], SPECS)


def scanned_blocks_text() -> str:
    def model(mesh):
        def body(x, w1s, w2s):
            return jax.lax.scan(lambda h, w: (block(h, *w), None), x, (w1s, w2s))[0]  # SCAN
        return jax.shard_map(body, mesh=mesh, in_specs=(P("model"), P(None, None, "model"), P(None, "model", None)),
                             out_specs=P("model"))
    return _lowered(model, [(64, 32), (3, 32, 128), (3, 128, 32)],
                    [P("model"), P(None, None, "model"), P(None, "model", None)])


# ---------------------------------------------------------------------------- names
def test_four_sites_in_one_helper_read_as_four_places():
    result = cmatmul_pass.rewrite(two_blocks_text(64, 32, 128))
    here = __file__.rsplit("/", 1)[-1]
    gather, scatter, block_line = line_of("DENSE-GATHER"), line_of("DENSE-SCATTER"), line_of("BLOCK")
    places = sorted(site.place for site in result.report.sites)
    assert len(places) == 4 and len(set(places)) == 4
    for layer in ("FIRST-LAYER", "SECOND-LAYER"):
        caller = f"{here}:{line_of(layer)}:"
        (g,) = [p for p in places if p.startswith(f"{__file__}:{gather}:") and caller in p]
        (s,) = [p for p in places if p.startswith(f"{__file__}:{scatter}:") and caller in p]
        # the innermost frame in full, then its callers in the same file by name, each with its function
        assert re.fullmatch(rf"{re.escape(__file__)}:{gather}:\d+ \(dense\) ← {here}:{block_line}:\d+ \(block\) ← "
                            rf"{re.escape(caller)}\d+ \(two_blocks\)", g), g
        assert " (dense) ← " in s and f"{here}:{block_line}:" in s
    lines = [site.summary_line() for site in result.report.sites]
    assert len({line.split(": ")[0] for line in lines}) == 4


def test_a_python_loop_of_layers_names_each_sites_layer():
    result = cmatmul_pass.rewrite(looped_blocks_text())
    sites = result.report.sites
    assert len(sites) == 4
    assert sorted((s.kind, s.layer) for s in sites) == [
        ("all_gather_dot", "layer 1 of 2"), ("all_gather_dot", "layer 2 of 2"),
        ("dot_reduce_scatter", "layer 1 of 2"), ("dot_reduce_scatter", "layer 2 of 2")]
    assert len({s.place for s in sites}) == 4 and all(s.summary_line().startswith(s.place + ": ") for s in sites)


def test_a_loop_inside_one_region_numbers_its_sites():
    """Layers as a Python loop inside the shard_map'd function: every layer's op carries the same
    location; the sites say which time round the loop each is."""
    def model(mesh):
        def body(x, w1, w2, w3, w4):
            for a, b in ((w1, w2), (w3, w4)):
                x = block(x, a, b)  # LOOP
            return x
        return jax.shard_map(body, mesh=mesh, in_specs=SPECS, out_specs=P("model"))
    result = cmatmul_pass.rewrite(_lowered(model, [(64, 32), (32, 128), (128, 32), (32, 128), (128, 32)], SPECS))
    sites = result.report.sites
    assert len({s.location for s in sites}) == 2 and len({s.place for s in sites}) == 4
    assert sorted(s.layer for s in sites) == ["occurrence 1 of 2", "occurrence 1 of 2", "occurrence 2 of 2",
                                              "occurrence 2 of 2"]
    assert all(f"test_program_cost.py:{line_of('LOOP')}:" in s.location for s in sites)


def test_a_scanned_layer_names_its_loop():
    result = cmatmul_pass.rewrite(scanned_blocks_text())
    here = __file__.rsplit("/", 1)[-1]
    assert {s.layer for s in result.report.sites} == {f"each of the 3 trips of the loop at {here}:{line_of('SCAN')}:19"}


def test_a_location_without_a_call_stack_stays_file_line_col():
    result = cmatmul_pass.rewrite(sample("sp_mlp").read_text())
    assert [s.location for s in result.report.sites] == [f"<input>:{module_line('sp_mlp', 24)}:13",
                                                         f"<input>:{module_line('sp_mlp', 4)}:12"]
    assert all(s.layer is None and s.place == s.location for s in result.report.sites)


# ---------------------------------------------------------------------------- the step
@pytest.mark.parametrize("name", ["ag_dot_1d", "rs_dot_1d", "ag_dot_qkv", "ar_megatron_mlp"])
def test_a_one_site_step_is_the_sites_prediction(name):
    """One site and nothing else to schedule: before is its serial time, after its chosen time."""
    result = cmatmul_pass.rewrite(sample(name).read_text(), cmatmul_pass.Options(policy="all"))
    (site,) = result.report.sites
    p = result.report.program
    if site.all_reduce:
        prediction = site.all_reduce["prediction"]
        serial, chosen = prediction["serial_s"], prediction["chunk_s"][str(site.all_reduce["chunks"])]
    else:
        serial, chosen = site.cost["serial_s"], site.cost["overlapped_s"][site.cost["variant"]]
    assert p["before_s"] == pytest.approx(serial, rel=1e-3) and p["after_s"] == pytest.approx(chosen, rel=1e-3)
    assert p["places"] == [[site.location, pytest.approx(p["before_s"] - p["after_s"], rel=1e-3)]]


def test_with_no_site_rewritten_before_is_after():
    result = cmatmul_pass.rewrite(sample("sp_mlp").read_text(), cmatmul_pass.Options(policy="auto"))
    assert not result.report.rewritten
    p = result.report.program
    assert p["before_s"] == p["after_s"] > 0 and p["places"] == []
    assert result.report.program_line() == "this step on 8×H100 SXM (NVLink 4): predicted 12.0 µs → 12.0 µs (no site rewritten)"
    assert result.report.summary().splitlines() == [result.report.sites_line(), result.report.program_line()]


def test_the_step_is_a_schedule_not_a_sum_of_site_gains():
    """A gather beside an independent dot: before, the dot hides the gather's transfer (the
    stream takes the dot that is ready first); after, the ring holds both streams, so the step
    gains less than the site alone would say."""
    def model(mesh):
        def body(x, w, a, b):
            return jax.lax.all_gather(x, "model", axis=0, tiled=True) @ w, a @ b
        return jax.shard_map(body, mesh=mesh, in_specs=(P("model"), P(None, "model"), P(), P()),
                             out_specs=(P(None, "model"), P()), check_vma=False)
    text = _lowered(model, [(4096, 1024), (1024, 4096), (2048, 2048), (2048, 2048)],
                    [P("model"), P(None, "model"), P(), P()], jnp.bfloat16)
    hardware = "h100:bandwidth=50e9"
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(policy="all", hardware=hardware))
    (site,) = result.report.sites
    c, hw = site.cost, cost.hardware(hardware)
    t_ab = 2 * 2048**3 / hw.throughput("bf16")
    serial, chosen = c["serial_s"], c["overlapped_s"][c["variant"]]
    gather = serial - c["compute_s"]
    p = result.report.program
    assert p["before_s"] == pytest.approx(max(t_ab, gather) + c["compute_s"], rel=1e-6)
    assert p["after_s"] == pytest.approx(chosen + t_ab, rel=1e-6)
    assert p["before_s"] - p["after_s"] != pytest.approx(serial - chosen, rel=1e-2)


def test_the_places_carrying_the_gain_are_named():
    """Large enough to win on an H100 under the default policy: the step's line names the places."""
    result = cmatmul_pass.rewrite(two_blocks_text(16384, 8192, 32768, jnp.bfloat16), cmatmul_pass.Options(policy="auto"))
    assert len(result.report.rewritten) == 4
    p = result.report.program
    sites = result.report.sites
    chosen = sum(s.cost["overlapped_s"][s.cost["variant"]] for s in sites)
    assert p["after_s"] < p["before_s"] and p["after_s"] == pytest.approx(chosen, rel=1e-3)  # one chain of sites
    assert len(p["places"]) == 3 and {loc for loc, _ in p["places"]} <= {s.location for s in sites}
    line = result.report.program_line()
    assert re.fullmatch(r"this step on 8×H100 SXM \(NVLink 4\): predicted \d\.\d\d ms → \d\.\d\d ms \(1\.\d\dx\); "
                        r"most of the gain: .* \(0\.\d\d ms\), .* \(0\.\d\d ms\), .* \(0\.\d\d ms\)", line), line


def test_a_loops_trips_multiply_its_body():
    result = cmatmul_pass.rewrite(scanned_blocks_text(), cmatmul_pass.Options(policy="all"))
    program = program_cost.Program(ir_utils.parse(scanned_blocks_text(), context=make_context()), "<input>",
                                   cost.hardware("h100"))
    serial = sum(s.cost["serial_s"] for s in result.report.sites)
    assert program.unknown_trips == 0 and program.span({}) == pytest.approx(3 * serial, rel=1e-3)
    assert result.report.program["before_s"] == pytest.approx(3 * serial, rel=1e-3)


def test_the_decorators_summary_ends_with_the_step():
    mesh = jax.make_mesh((8,), ("model",))

    @cmatmul_pass.jit(policy="all")
    @jax.shard_map(mesh=mesh, in_specs=(P("model", None), P(None, "model")), out_specs=P(None, "model"))
    def layer(x, w):
        return jax.lax.all_gather(x, "model", axis=0, tiled=True) @ w

    x = jax.device_put(jnp.ones((64, 32)), NamedSharding(mesh, P("model", None)))
    w = jax.device_put(jnp.ones((32, 64)), NamedSharding(mesh, P(None, "model")))
    layer(x, w)
    first, step = layer.report.summary().splitlines()
    assert first == "1 of 1 candidate site(s) rewritten" and step.startswith("this step on 8×")
    assert "most of the loss: " in step  # tiny: the ring is predicted slower


# ---------------------------------------------------------------------------- explain
def test_explain_ends_with_the_step_in_one_unit_per_line(capsys):
    assert run_cli("explain", sample("sp_mlp")) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith("this step on 8×H100 SXM (NVLink 4): predicted ")
    for line in [line for line in out if "predicted on" in line] + out[-1:]:
        units = set(re.findall(r"\d (ns|µs|ms|s)\b", line))
        assert len(units) == 1, line


def test_durations_share_the_largest_values_unit():
    assert durations(1.234e-3, 5e-5) == ["1.23 ms", "0.05 ms"]
    assert durations(6.02e-6, 5.03e-11, 4.2e-5) == ["6.0 µs", "<0.1 µs", "42.0 µs"]
    assert durations(2.0, 0.5) == ["2.00 s", "0.50 s"]
    assert durations(0.0) == ["0 ns"]


def test_the_readme_quotes_the_step_line_explain_prints(tmp_path):
    """The README's first screen quotes what explain ends with on its snippet's layer."""
    readme = (ROOT / "README.md").read_text()
    snippet = readme.split("```python\n", 1)[1].split("```", 1)[0]
    subprocess.run([sys.executable, "-c", snippet], cwd=tmp_path, check=True, capture_output=True, timeout=300)
    out = subprocess.run([sys.executable, "-m", "cmatmul_pass", "explain", "model.mlir"], cwd=tmp_path, check=True,
                         capture_output=True, text=True, timeout=300,
                         env={k: v for k, v in __import__("os").environ.items() if k != "CMATMUL_PASS_POLICY"}).stdout
    assert f"`{out.splitlines()[-1]}`" in readme


# ---------------------------------------------------------------------------- the chart
def _check_figure(fig, panels: int | None = None) -> None:
    fig.canvas.draw()
    axes = fig.axes
    assert len(axes) == panels if panels is not None else len(axes) > 1
    assert len({ax.get_xlabel() for ax in axes}) == 1  # one unit for the whole chart
    for ax in axes:  # no empty panel
        assert any(path.get_extents().width > 0 for c in ax.collections for path in c.get_paths())
    renderer = fig.canvas.get_renderer()
    title = fig._suptitle.get_window_extent(renderer)
    first = axes[0].title.get_window_extent(renderer)
    assert title.y0 >= first.y1  # the chart's title above the first panel's, not over it


def test_the_chart_draws_one_site(tmp_path):
    result = cmatmul_pass.rewrite(sample("ag_dot_1d").read_text())
    fig = timeline.figure(result.report, cost.hardware("h100"))
    _check_figure(fig, 1)
    assert fig.axes[0].get_xlabel() == "µs (predicted)"
    assert timeline.plot(result.report, cost.hardware("h100"), tmp_path / "one.png").read_bytes()[:4] == b"\x89PNG"


def test_the_chart_draws_many_sites_and_layers_once(tmp_path):
    result = cmatmul_pass.rewrite(looped_blocks_text())
    fig = timeline.figure(result.report, cost.hardware("h100"))
    _check_figure(fig, 2)  # the two layers' sites drawn alike: a panel per kind
    assert all(ax.get_title(loc="left").endswith("(2 sites)") for ax in fig.axes)
    many = cmatmul_pass.rewrite(sample("fsdp_tp_grad").read_text()).report
    fig = timeline.figure(many, cost.hardware("h100"))
    _check_figure(fig)
    assert len(fig.axes) <= len([s for s in many.sites if timeline.drawable(s)])
    assert run_cli("explain", sample("fsdp_tp_grad"), "--plot", tmp_path / "many.png") == 0
    assert (tmp_path / "many.png").stat().st_size > 10_000
