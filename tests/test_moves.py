"""Collectives moved to their matmuls (issue 31): a program's all_gather whose rows reach the dots
only through row-wise ops (a norm of the gathered rows) is moved past them, the ops run on the
shard's rows, and the gather becomes the dot's ring.  What may not move stays as it was."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import cmatmul_pass
from cmatmul_pass import execute, ir_utils
from conftest import sample

SPECS = (P("model", None), P(), P(None, "model"), P("model", None))
SHAPES = [(64, 32), (32,), (32, 128), (128, 32)]


def rms(h, g):
    return h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6) * g


def lower(body, out_specs=P("model", None)):
    mesh = jax.make_mesh((8,), ("model",))
    f = jax.shard_map(body, mesh=mesh, in_specs=SPECS, out_specs=out_specs, check_vma=False)
    args = [jax.ShapeDtypeStruct(s, jnp.float32, sharding=NamedSharding(mesh, sp)) for s, sp in zip(SHAPES, SPECS)]
    return jax.jit(f).lower(*args).as_text()


def gathered(x):
    return jax.lax.all_gather(x, "model", axis=0, tiled=True)


def scattered(y):
    return jax.lax.psum_scatter(y, "model", scatter_dimension=0, tiled=True)


def unchanged(text, result):
    return result.text == ir_utils.print_module(ir_utils.parse(text))


def test_a_norm_between_the_gather_and_the_dot_runs_on_the_rows():
    text = sample("ag_norm_dot").read_text()
    result = cmatmul_pass.rewrite(text)
    assert len(result.report.rewritten) == len(result.report.sites) == 2
    (moved,) = [s for s in result.report.sites if s.kind == "all_gather_dot"]
    assert moved.notes[0].startswith("moved to its dot past") and "declined [layout]" in moved.notes[0]
    left = ir_utils.ops_named(result.module, "stablehlo.all_gather", "stablehlo.rsqrt")
    assert not left["stablehlo.all_gather"]
    (rsqrt,) = left["stablehlo.rsqrt"]  # the norm's statistics of this device's 8 rows, not of all 64
    assert list(ir_utils.ranked_tensor(rsqrt.result).shape) == [8, 1]
    outcome = execute.check_numerics(ir_utils.parse(text), result.module)
    assert outcome.ok, outcome.format()


@pytest.mark.parametrize("variant", ["uni", "bidi-full"])
def test_the_moved_gather_rings_in_every_variant(variant):
    text = lower(lambda x, g, w1, w2: scattered(jax.nn.gelu(jnp.tanh(rms(gathered(x), g)) @ w1) @ w2))
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(variant=variant))
    assert [s.rewritten for s in result.report.sites] == [True, True]
    outcome = execute.check_numerics(ir_utils.parse(text), result.module)
    assert outcome.ok, outcome.format()


@pytest.mark.parametrize("body, why", [
    # a factor that differs per device: on the rows it would scale device k's block by k's factor
    (lambda x, g, w1, w2: scattered(rms(gathered(x), g * (1.0 + jax.lax.axis_index("model"))) @ w1 @ w2), "varies"),
    # the normalised rows are first read whole by an op that mixes them (a cumulative sum over rows)
    (lambda x, g, w1, w2: (lambda h: (jnp.cumsum(h, axis=0), scattered(h @ w1 @ w2))[::-1])(rms(gathered(x), g)),
     "read whole"),
    # a softmax over the gathered (row) dim mixes rows
    (lambda x, g, w1, w2: scattered(jax.nn.softmax(gathered(x), axis=0) @ w1 @ w2), "mixes rows"),
], ids=["device_varying_factor", "also_read_whole", "mixes_rows"])
def test_what_may_not_move_stays_as_it_was(body, why):
    out_specs = (P("model", None), P()) if why == "read whole" else P("model", None)
    text = lower(body, out_specs)
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(all_reduce="keep"))
    gathers = [s for s in result.report.sites if s.kind == "all_gather_dot"]
    assert len(gathers) == 1 and not gathers[0].rewritten
    assert len(ir_utils.ops_named(result.module, "stablehlo.all_gather")["stablehlo.all_gather"]) == 1
    outcome = execute.check_numerics(ir_utils.parse(text), result.module)
    assert outcome.ok, outcome.format()


def test_a_moved_gather_also_read_whole_is_assembled_by_its_ring():
    """The normalised rows feed the dot and are returned: one gather, before the dot, whose ring
    assembles the whole value for the return."""
    text = lower(lambda x, g, w1, w2: (lambda h: (scattered(h @ w1 @ w2), h))(rms(gathered(x), g)),
                 (P("model", None), P()))
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(all_reduce="keep"))
    (site,) = [s for s in result.report.sites if s.kind == "all_gather_dot"]
    assert site.rewritten and len(site.assembled_for) == 1 and site.notes[0].startswith("moved to its dot")
    assert not ir_utils.ops_named(result.module, "stablehlo.all_gather")["stablehlo.all_gather"]
    outcome = execute.check_numerics(ir_utils.parse(text), result.module)
    assert outcome.ok, outcome.format()


def test_policy_auto_never_moves_a_gather_it_then_leaves():
    text = sample("ag_norm_dot").read_text()
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(policy="auto"))
    assert not result.report.rewritten and unchanged(text, result)
