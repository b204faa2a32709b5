"""Gathers of stacked layer weights sunk into the scan loop that reads one layer per trip
(issue 31, item 1): ``dynamic_slice(all_gather(w)) == all_gather(dynamic_slice(w))`` for a
slice that keeps the gathered dim whole."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import cmatmul_pass
from cmatmul_pass import execute, ir_utils
from cmatmul_pass._jax_private import compile_module
from conftest import run_cli, sample

MESH = jax.make_mesh((8,), ("model",))
SPECS = (P(), P(None, None, "model"))


def stacked(layers: int = 3, hidden: int = 32, remat: bool = False, returns_stack: bool = False):
    """A scan over ``layers`` tanh(h @ w_i) layers whose stacked [L, H, H] weight is sharded on
    its last dim and gathered before the loop."""

    def body(x, ws):
        stack = jax.lax.all_gather(ws, "model", axis=2, tiled=True)

        def step(h, w):
            return jnp.tanh(h @ w), None

        h, _ = jax.lax.scan(jax.checkpoint(step) if remat else step, x, stack)
        return (h, stack) if returns_stack else h

    out = (P(), P()) if returns_stack else P()
    return jax.shard_map(body, mesh=MESH, in_specs=SPECS, out_specs=out, check_vma=False), [
        jax.ShapeDtypeStruct((16, hidden), jnp.float32),
        jax.ShapeDtypeStruct((layers, hidden, hidden), jnp.float32, sharding=NamedSharding(MESH, SPECS[1]))]


def lowered(**kw) -> str:
    f, args = stacked(**kw)
    return jax.jit(f).lower(*args).as_text()


@pytest.mark.parametrize("variant", ["uni", "bidi-full", "auto"])
@pytest.mark.parametrize("remat", [False, True])
def test_the_stacked_gather_sinks_into_the_scan_and_rings_there(variant, remat):
    text = lowered(remat=remat)
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(variant=variant))
    (site,) = result.report.sites
    assert site.rewritten and site.notes[0].startswith("sunk into the loop at"), site.summary_line()
    assert "declined [user_not_dot]" in site.notes[0]
    found = ir_utils.ops_named(result.module, "stablehlo.all_gather", "stablehlo.while", "func.call")
    assert not found["stablehlo.all_gather"] and not found["func.call"]  # the calls on the way inlined
    (loop,) = [w for w in found["stablehlo.while"] if w.operation.parent.name == "sdy.manual_computation"]
    assert list(ir_utils.ranked_tensor(loop.operation.operands[0]).shape) == [3, 32, 4]  # the shard, carried
    outcome = execute.check_numerics(ir_utils.parse(text), result.module)
    assert outcome.ok, outcome.format()


def test_the_decorator_sinks_it_and_computes_the_same():
    f, _ = stacked()
    x = jax.random.normal(jax.random.key(0), (16, 32))
    ws = jax.device_put(jax.random.normal(jax.random.key(1), (3, 32, 32)) / 6, NamedSharding(MESH, SPECS[1]))
    g = cmatmul_pass.jit(f)
    got, want = g(x, ws), jax.jit(f)(x, ws)
    assert jnp.allclose(got, want, rtol=1e-5, atol=1e-5)
    (site,) = g.report.rewritten
    assert site.notes[0].startswith("sunk into the loop")


def test_peak_memory_does_not_grow():
    """XLA's own accounting (compiled memory stats): the sunk program keeps one layer's gathered
    weight alive instead of the whole stack."""
    text = lowered(layers=8, hidden=64)
    result = cmatmul_pass.rewrite(text)
    assert result.report.rewritten
    devices = jax.devices("cpu")[:8]

    def temp(module) -> int:
        return compile_module(module, 8, devices).get_compiled_memory_stats().temp_size_in_bytes

    before, after = temp(ir_utils.parse(text)), temp(result.module)
    assert after <= before, (before, after)


def test_a_stack_also_read_after_the_loop_stays_and_says_why(capsys):
    text = lowered(returns_stack=True)
    result = cmatmul_pass.rewrite(text)
    (site,) = result.report.sites
    assert not site.rewritten and site.reason_code == "user_not_dot"
    assert site.reason.endswith("not sunk into the loop: it is also read by sdy.return")
    assert result.text == ir_utils.print_module(ir_utils.parse(text))


def test_explain_says_why_a_slice_along_the_gathered_dim_is_not_sunk(capsys):
    assert run_cli("explain", sample("neg_scan_gathered_dim")) == 0
    out = capsys.readouterr().out
    assert "not sunk into the loop: the loop slices it along the gathered dim 2 [user_not_dot]" in out


def test_policy_auto_never_sinks_what_it_then_leaves():
    """Sinking changes the module before the ring's verdict: only the default policy does it."""
    text = sample("ag_scan_stacked").read_text()
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(policy="auto"))
    assert not result.report.rewritten
    assert result.text == ir_utils.print_module(ir_utils.parse(text))
