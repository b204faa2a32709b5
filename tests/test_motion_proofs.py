"""Every motion of a collective is proven against device-varying values: for each side
condition a program that breaks it (the collective stays where it is, with a true reason,
and the rewritten program computes what the original does) and its legal twin (still moved,
and still right).

- sink: ``slice(all_gather(w), k) == all_gather(slice(w, k))`` needs ``k`` identical on the
  gather's group, and the slice run alike by the group (a loop's trip count, a branch);
- hoist: ``rs(dus(b, u, k)) == dus(rs(b), rs(u), k)`` needs the same of the update's slot ``k``
  and of the loop;
- moves past row-wise ops and the psum split's carry: every operand the moved ops read beside
  the rows (a gain) identical on the group, seen through composites' decompositions.
"""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import cmatmul_pass
from cmatmul_pass import execute, ir_utils
from conftest import ROOT, run_cli

MESH = jax.make_mesh((8,), ("model",))
L, H = 4, 32


def _layer(stack, i):
    return jax.lax.dynamic_index_in_dim(stack, i, 0, keepdims=False)


def sink_program(kind: str, twin: bool):
    """A stacked [L, H, H] weight gathered before a loop that reads one layer per trip, with a
    device-varying index, trip count or branch predicate (``twin``: an identical one)."""

    def body(x, ws):
        stack = jax.lax.all_gather(ws, "model", axis=2, tiled=True)
        ax = jax.lax.axis_index("model")
        if kind == "index":
            return jax.lax.fori_loop(0, L, lambda i, h: jnp.tanh(h @ _layer(stack, i if twin else (i + ax) % L)), x)
        if kind == "trip":
            return jax.lax.fori_loop(0, L if twin else L - ax % 2, lambda i, h: jnp.tanh(h @ _layer(stack, i)), x)
        scan = lambda h: jax.lax.fori_loop(0, L, lambda i, h: jnp.tanh(h @ _layer(stack, i)), h)  # noqa: E731
        return jax.lax.cond(x[0, 0] > 0 if twin else ax < 4, scan, lambda h: h * 2.0, x)

    spec = P(None, None, "model")
    f = jax.shard_map(body, mesh=MESH, in_specs=(P(), spec), out_specs=P(), check_vma=False)
    return f, [jax.ShapeDtypeStruct((16, H), jnp.float32),
               jax.ShapeDtypeStruct((L, H, H), jnp.float32, sharding=NamedSharding(MESH, spec))]


def hoist_program(kind: str, twin: bool):
    """A loop writing one [16, H] layer per trip into a zero [L, 16, H] buffer, scattered
    after it, at a device-varying slot or for a device-varying trip count (``nested``: written
    with dynamic_update_index_in_dim, two nested calls, at slot i)."""

    def body(x, w):
        ax = jax.lax.axis_index("model")

        def step(i, buf):
            g = jnp.tanh(x @ w) * (i + 1)
            if kind == "nested":
                return jax.lax.dynamic_update_index_in_dim(buf, g, i, 0)
            k = (i + ax) % L if kind == "index" and not twin else i
            return jax.lax.dynamic_update_slice(buf, g[None], (k, 0, 0))

        trips = L - ax % 2 if kind == "trip" and not twin else L
        buf = jax.lax.fori_loop(0, trips, step, jnp.zeros((L, 16, H), jnp.float32))
        return jax.lax.psum_scatter(buf, "model", scatter_dimension=2, tiled=True)

    f = jax.shard_map(body, mesh=MESH, in_specs=(P(), P()), out_specs=P(None, None, "model"), check_vma=False)
    return f, [jax.ShapeDtypeStruct((16, H), jnp.float32), jax.ShapeDtypeStruct((H, H), jnp.float32)]


def _gain(gain, twin: bool):
    """``gain`` scaled inside a ``jax.lax.composite`` whose decomposition reads the device's
    index (``twin``: by 1)."""
    def scaled(g):
        return g * (1.0 if twin else 1.0 + jax.lax.axis_index("model").astype(jnp.float32))
    return jax.lax.composite(scaled, name="test.gain")(gain)


def gain_program(split: bool, twin: bool):
    """Rows gathered, RMS-normalised and scaled by a composite's gain before a dot; or
    (``split``) a psum of a dot, scaled so, into the next dot."""

    def norm(x, w1, gain):
        h = jax.lax.all_gather(x, "model", axis=0, tiled=True)
        h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6) * _gain(gain, twin)
        return h @ w1

    def psum(x, w1, w2, gain):
        return (jax.lax.psum(x @ w1, "model") * _gain(gain, twin)) @ w2

    def sharded(shape, spec):
        return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(MESH, spec))

    if split:
        specs = (P(None, "model"), P("model", None), P(None, "model"), P())
        f = jax.shard_map(psum, mesh=MESH, in_specs=specs, out_specs=P(None, "model"), check_vma=False)
        return f, [sharded((64, 64), specs[0]), sharded((64, H), specs[1]), sharded((H, 64), specs[2]),
                   jax.ShapeDtypeStruct((H,), jnp.float32)]
    specs = (P("model"), P(), P())
    f = jax.shard_map(norm, mesh=MESH, in_specs=specs, out_specs=P(), check_vma=False)
    return f, [sharded((64, H), specs[0]), jax.ShapeDtypeStruct((H, H), jnp.float32),
               jax.ShapeDtypeStruct((H,), jnp.float32)]


def rewritten(program, options=None):
    f, args = program
    text = jax.jit(f).lower(*args).as_text()
    result = cmatmul_pass.rewrite(text, options)
    outcome = execute.check_numerics(ir_utils.parse(text), result.module)
    assert outcome.ok, outcome.format()
    return result


def notes(result) -> str:
    return "\n".join(f"{s.reason}\n" + "\n".join(s.notes) for s in result.report.sites)


@pytest.mark.parametrize("kind,why", [
    ("index", "the loop slices it at an index that may differ between the devices of the gather's group"),
    ("trip", "a loop whose trip count may differ between the devices encloses it"),
    ("cond", "a case whose index may differ between the devices encloses it"),
])
def test_a_gather_sinks_only_where_the_group_reads_alike(kind, why):
    result = rewritten(sink_program(kind, twin=False))
    (site,) = result.report.sites
    assert not site.rewritten and why in site.reason, site.reason
    twin = rewritten(sink_program(kind, twin=True))
    (site,) = twin.report.sites
    assert site.rewritten and site.notes[0].startswith("sunk into the loop"), notes(twin)


@pytest.mark.parametrize("kind,why", [
    ("index", "the loop writes each layer at a slot that may differ between the devices of the scatter's group"),
    ("trip", "a loop whose trip count may differ between the devices encloses it"),
])
def test_a_scatter_hoists_only_where_the_group_writes_alike(kind, why):
    result = rewritten(hoist_program(kind, twin=False))
    assert not result.report.rewritten and f"not hoisted into the loop: " in notes(result)
    assert why in notes(result)
    twin = rewritten(hoist_program(kind, twin=True))
    (site,) = twin.report.rewritten
    assert site.notes[0].startswith("hoisted into the loop"), notes(twin)


def test_a_scatter_hoists_through_nested_calls():
    """dynamic_update_index_in_dim is a call of a call around the update: both are inlined."""
    result = rewritten(hoist_program("nested", twin=True))
    (site,) = result.report.rewritten
    assert site.notes[0].startswith("hoisted into the loop")
    assert not ir_utils.ops_named(result.module, "func.call")["func.call"]


def test_a_gather_moves_past_a_gain_only_when_the_group_shares_it():
    """The gain is a composite whose decomposition reads axis_index: not identical, so the
    gather is rung with the row-wise ops per block instead of moved past them."""
    result = rewritten(gain_program(split=False, twin=False))
    assert not any(n.startswith("moved to its dot") for s in result.report.sites for n in s.notes), notes(result)
    twin = rewritten(gain_program(split=False, twin=True))
    assert any(n.startswith("moved to its dot past") for s in twin.report.sites for n in s.notes), notes(twin)


def test_a_split_psum_carries_its_gather_past_a_gain_only_when_the_group_shares_it():
    options = cmatmul_pass.Options(all_reduce="split")
    result = rewritten(gain_program(split=True, twin=False), options)
    assert "gathered before stablehlo.multiply" in result.report.sites[0].summary_line()
    twin = rewritten(gain_program(split=True, twin=True), options)
    assert "row-wise op(s) after it now run on this device's rows" in notes(twin)


def test_a_motion_whose_ring_is_declined_is_not_made():
    """All or nothing: with --min-bytes above the layer's size the sunk gathers would not ring,
    so the stack is not sunk either, the module stays as written and says why."""
    f, args = sink_program("index", twin=True)
    text = jax.jit(f).lower(*args).as_text()
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(min_bytes=10**9))
    (site,) = result.report.sites
    assert not site.rewritten and "not sunk into the loop: where it would go, no ring formed" in site.reason
    assert "[min_bytes]" in site.reason and not result.changed
    assert result.text == ir_utils.print_module(ir_utils.parse(text))


def test_a_hoist_whose_ring_is_declined_is_not_made():
    f, args = hoist_program("index", twin=True)
    text = jax.jit(f).lower(*args).as_text()
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(min_bytes=10**9))
    (site,) = result.report.sites
    assert "not hoisted into the loop: where it would go, no ring formed" in site.reason, site.reason
    assert result.text == ir_utils.print_module(ir_utils.parse(text))


def test_a_failure_on_one_collective_leaves_it_as_written_and_rewrites_the_rest(monkeypatch):
    """An exception while one site is rewritten (here: every scatter's ring) is a bug of the
    pass; the collective stays as written (``pass_error``), the others are rewritten, the
    module verifies and computes what the original does."""
    from cmatmul_pass import sites

    def broken(*args, **kwargs):
        raise IndexError("list index out of range")

    monkeypatch.setattr(sites, "rewrite_dot_reduce_scatter", broken)
    text = (ROOT / "hlo_samples" / "sp_mlp.mlir").read_text()
    result = cmatmul_pass.rewrite(text)
    codes = {s.kind: s.reason_code for s in result.report.sites}
    assert codes["dot_reduce_scatter"] == "pass_error" and codes["all_gather_dot"] == ""
    (left,) = [s for s in result.report.sites if s.reason_code == "pass_error"]
    assert "IndexError: list index out of range" in left.reason and "a cmatmul_pass bug" in left.reason
    assert execute.check_numerics(ir_utils.parse(text), result.module).ok


def test_the_cli_says_a_failure_in_one_line_and_writes_the_rest(monkeypatch, tmp_path, capsys):
    from cmatmul_pass import sites

    monkeypatch.setattr(sites, "rewrite_dot_reduce_scatter", lambda *a, **k: [][0])
    out = tmp_path / "out.mlir"
    assert run_cli("rewrite", ROOT / "hlo_samples" / "sp_mlp.mlir", "-o", out) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err and "[pass_error]" in err or "pass_error" in err
    assert "collective_permute" in out.read_text()


MESH_2X4 = jax.make_mesh((2, 4), ("data", "model"))


@jax.jit
def _gather_dot(x, w):
    return jax.lax.all_gather(x, "model", axis=0, tiled=True) @ w


def _manual_call(partial: bool):
    """A shard_map calling a nested jax.jit function that gathers and multiplies (manual over
    'model' only when ``partial``)."""
    return jax.shard_map(lambda x, w: _gather_dot(x, w), mesh=MESH_2X4, in_specs=(P("model", None), P(None, "model")),
                         out_specs=P(None, "model"), check_vma=False, **({"axis_names": {"model"}} if partial else {}))


def _lowered_2x4(f) -> str:
    args = [jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=NamedSharding(MESH_2X4, P("model", None))),
            jax.ShapeDtypeStruct((32, 64), jnp.float32, sharding=NamedSharding(MESH_2X4, P(None, "model")))]
    return jax.jit(f).lower(*args).as_text()


@pytest.mark.parametrize("partial", [True, False])
def test_a_site_in_a_function_takes_its_callers_manual_axes(partial):
    """In a partial-manual region the ring reads its position inside a nested manual region over
    the free axes, also where the site is in a function the region calls (a bare partition_id
    there is refused by XLA's partitioner)."""
    text = _lowered_2x4(_manual_call(partial))
    result = cmatmul_pass.rewrite(text)
    (site,) = result.report.sites
    assert site.rewritten and site.function == "_gather_dot"
    outcome = execute.check_numerics(ir_utils.parse(text), result.module)
    assert outcome.ok, outcome.format()


def test_a_function_called_from_regions_manual_over_different_axes_is_declined():
    a, b = _manual_call(True), _manual_call(False)
    text = _lowered_2x4(lambda x, w: a(x, w) + b(x, w))
    assert text.count("func.call @_gather_dot_0(") == 1
    text = text.replace("func.call @_gather_dot_0(", "func.call @_gather_dot(")  # both regions call one function
    result = cmatmul_pass.rewrite(text)
    (site,) = [s for s in result.report.sites if s.function == "_gather_dot"]
    assert site.reason_code == "partial_manual" and "called from regions manual over different mesh axes" in site.reason


def test_with_no_site_rewritten_the_output_is_the_input(tmp_path, capsys):
    """check's "nothing to check" is true: the module it would check is the input itself (here
    jax 0.10's scan step, which the pass inlines before it looks for rings, stays a call)."""
    f, args = sink_program("index", twin=True)
    path = tmp_path / "m.mlir"
    path.write_text(jax.jit(f).lower(*args).as_text())
    assert run_cli("check", path, "--min-bytes", 10**9) == 0
    said = capsys.readouterr()
    assert "nothing to check: no site was rewritten" in said.out + said.err
    out = tmp_path / "o.mlir"
    assert run_cli("rewrite", path, "--min-bytes", 10**9, "-o", out) == 0
    assert out.read_text() == ir_utils.print_module(ir_utils.parse(path.read_text()))


def test_a_buffer_returned_in_a_second_carried_value_is_not_hoisted():
    """The loop hands its updated buffer on in two carried values: scattering one of them would
    change the other's type; declined with a reason, the program runs as written."""

    def body(x, w):
        def step(i, carry):
            new = jax.lax.dynamic_update_slice(carry[0], (jnp.tanh(x @ w) * (i + 1))[None], (i, 0, 0))
            return new, new

        buf, other = jax.lax.fori_loop(0, L, step, (jnp.zeros((L, 16, H)), jnp.zeros((L, 16, H))))
        return jax.lax.psum_scatter(buf, "model", scatter_dimension=2, tiled=True), other

    f = jax.shard_map(body, mesh=MESH, in_specs=(P(), P()), out_specs=(P(None, None, "model"), P()), check_vma=False)
    result = rewritten((f, [jax.ShapeDtypeStruct((16, H), jnp.float32), jax.ShapeDtypeStruct((H, H), jnp.float32)]))
    (site,) = result.report.sites
    assert "not hoisted into the loop: the loop body returns something else than its update" in site.reason


def test_an_unexpected_exception_is_one_line_never_a_traceback(monkeypatch, capsys):
    """A failure outside any one collective's work (here: the loop scan before the sites) is an
    internal error: exit 3, one line naming the bug, no traceback; the input is left as it was."""
    from cmatmul_pass import pipeline

    def broken(*args, **kwargs):
        raise KeyError("boom")

    monkeypatch.setattr(pipeline.replay, "walk", broken)
    assert run_cli("rewrite", ROOT / "hlo_samples" / "sp_mlp.mlir") == 3
    err = capsys.readouterr().err
    assert "Traceback" not in err and "internal error: the pass failed (a cmatmul_pass bug): KeyError" in err


@pytest.mark.parametrize("twin", [False, True])
def test_an_index_of_another_mesh_axis_is_the_same_on_each_group(twin):
    """``axis_index('d')`` differs between devices but is one number on each group of the 'm'
    axis of a 2×4 mesh: a gather over 'm' sinks into a loop indexing by it (evaluated at every
    partition id: analysis/by_partition.py); ``axis_index('m') // 2`` differs inside the group."""

    def body(x, ws):
        stack = jax.lax.all_gather(ws, "m", axis=2, tiled=True)
        shift = jax.lax.axis_index("d") if twin else jax.lax.axis_index("m") // 2
        return jax.lax.fori_loop(0, L, lambda i, h: jnp.tanh(h @ _layer(stack, (i + shift) % L)), x)

    mesh = jax.make_mesh((2, 4), ("d", "m"))
    spec = P(None, None, "m")
    f = jax.shard_map(body, mesh=mesh, in_specs=(P(), spec), out_specs=P(), check_vma=False)
    result = rewritten((f, [jax.ShapeDtypeStruct((16, H), jnp.float32),
                            jax.ShapeDtypeStruct((L, H, H), jnp.float32, sharding=NamedSharding(mesh, spec))]))
    (site,) = result.report.sites
    assert site.rewritten == twin, site.reason


def test_a_trip_count_the_same_on_each_group_only_is_not_enough():
    """``L - axis_index('d')`` is one number on each group of 'm' on a 2×4 mesh, but the ring's
    permute is one rendezvous of all 8 devices: a loop whose trip count differs between groups
    may not hold it (it would deadlock where the original, gathering before the loop, runs)."""

    def body(x, ws):
        stack = jax.lax.all_gather(ws, "m", axis=2, tiled=True)
        trips = L - jax.lax.axis_index("d")
        return jax.lax.fori_loop(0, trips, lambda i, h: jnp.tanh(h @ _layer(stack, i)), x)

    mesh = jax.make_mesh((2, 4), ("d", "m"))
    spec = P(None, None, "m")
    f = jax.shard_map(body, mesh=mesh, in_specs=(P(), spec), out_specs=P(mesh.axis_names), check_vma=False)
    result = rewritten((f, [jax.ShapeDtypeStruct((16, H), jnp.float32),
                            jax.ShapeDtypeStruct((L, H, H), jnp.float32, sharding=NamedSharding(mesh, spec))]))
    (site,) = result.report.sites
    assert not site.rewritten and "a loop whose trip count may differ between the devices" in site.reason


def called_gain_program(twin: bool):
    """A norm-and-projection function (a private function: ``jax.jit`` inside the region) called
    twice, its gain a function argument: the second call passes a gain scaled by the device's
    axis index (``twin``: by 2, the same on every device)."""
    proj = jax.jit(lambda x, w1, gain: (
        lambda h: h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6) * gain)(
            jax.lax.all_gather(x, "model", axis=0, tiled=True)) @ w1)

    def body(x, w1, gain):
        other = gain * (2.0 if twin else 1.0 + jax.lax.axis_index("model"))
        return proj(x, w1, gain) + proj(x, w1, other)

    f = jax.shard_map(body, mesh=MESH, in_specs=(P("model"), P(), P()), out_specs=P(), check_vma=False)
    return f, [jax.ShapeDtypeStruct((64, H), jnp.float32, sharding=NamedSharding(MESH, P("model"))),
               jax.ShapeDtypeStruct((H, H), jnp.float32), jax.ShapeDtypeStruct((H,), jnp.float32)]


def test_a_function_argument_is_identical_only_where_every_call_passes_one_that_is():
    """A private function's gain is the same on every device only where each of its calls passes
    one that is: with one call passing a device-varying gain, the gather in the function is not
    moved past the gain (its ring applies the norm per block instead); its twin moves it."""
    program = called_gain_program(twin=False)
    assert "func.call" in jax.jit(program[0]).lower(*program[1]).as_text()
    result = rewritten(program)
    assert not any(n.startswith("moved to its dot") for s in result.report.sites for n in s.notes), notes(result)
    twin = rewritten(called_gain_program(twin=True))
    assert any(n.startswith("moved to its dot past") for s in twin.report.sites for n in s.notes), notes(twin)
