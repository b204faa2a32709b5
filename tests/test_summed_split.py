"""A psum whose summed value no matmul produces, read by matmuls (an incoming cotangent summed
over the tensor axis, as psum's transpose under check_vma=False gives): split into a
reduce-scatter, which stays a collective, and an all_gather that becomes the matmuls' ring;
left as written where its matmuls are not its only readers, where the gather would ring
nowhere (the motion undone), or where the options keep psums."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import cmatmul_pass
from cmatmul_pass import execute, ir_utils
from tools.samples_common import arg, lower, mesh_1d, smap
from tools.samples_megatron import MEGATRON_SPECS, megatron_args, megatron_mlp_body


def summed_then(after, rows=256) -> str:
    """``after(psum(g), w1, w2)`` of a replicated ``g`` [rows, 128] and two column-parallel weights."""
    mesh = mesh_1d(8, "model")
    spec = P(None, "model")
    f = smap(lambda g, w1, w2: after(jax.lax.psum(g, "model"), w1, w2), mesh=mesh, in_specs=(P(), spec, spec),
             out_specs=(spec, spec))
    return lower(f, arg(mesh, (rows, 128), P()), arg(mesh, (128, 512), spec), arg(mesh, (128, 512), spec))


def rewritten(text, **options):
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(**{"policy": "all", **options}))
    outcome = execute.check_numerics(ir_utils.parse(text), result.module)
    assert outcome.ok, outcome.format()
    return result


def count(result, name):
    return len(ir_utils.ops_named(result.module, name)[name])


def test_a_summed_cotangent_read_by_two_matmuls_is_split_for_their_ring():
    result = rewritten(summed_then(lambda g, w1, w2: (g @ w1, g @ w2)))
    (split,) = [s for s in result.report.sites if s.kind == "dot_all_reduce"]
    assert split.rewritten and split.all_reduce["picked"] == "summed value" and split.all_reduce["dim"] == 0
    assert split.all_reduce["gathers"] == [g for g in split.all_reduce["gathers"] if g.startswith("into the ring of")]
    (ring,) = [s for s in result.report.sites if s.kind == "all_gather_dot"]
    assert ring.rewritten and len(ring.consumers) == 2
    assert count(result, "stablehlo.all_reduce") == 0 and count(result, "stablehlo.reduce_scatter") == 1
    assert count(result, "stablehlo.all_gather") == 0


def test_the_step_prices_the_split_as_its_reduce_scatter_and_the_rings_exposed_time():
    """The whole step's schedule takes the split psum's place as its reduce-scatter plus what the
    gather's ring leaves exposed beyond its dots, not as the psum it was."""
    result = rewritten(summed_then(lambda g, w1, w2: (g @ w1, g @ w2), rows=4096))
    (split,) = [s for s in result.report.sites if s.kind == "dot_all_reduce"]
    (ring,) = [s for s in result.report.sites if s.kind == "all_gather_dot"]
    p, c = split.all_reduce["prediction"], ring.cost
    exposed = max(c["overlapped_s"][c["variant"]] - c["compute_s"], 0.0)
    assert p["split_s"] == p["scatter_s"] + exposed and p["scatter_s"] < p["all_reduce_s"]
    assert p["speedup"]["split"] == p["all_reduce_s"] / p["split_s"]
    program = result.report.program
    assert program["unplaced"] == 0
    # the psum was the step's only collective: the step gains what the split saves
    assert program["before_s"] - program["after_s"] == pytest.approx(p["all_reduce_s"] - p["split_s"], rel=1e-6)


def test_a_statistic_read_by_a_norm_is_not_split():
    # the twin: the summed value reaches its matmul through a tanh, not through layout ops alone
    result = rewritten(summed_then(lambda g, w1, w2: (jnp.tanh(g) @ w1, g @ w2)))
    (psum,) = [s for s in result.report.sites if s.kind == "dot_all_reduce"]
    assert not psum.rewritten and psum.reason_code == "producer_not_dot"
    assert count(result, "stablehlo.all_reduce") == 1


def test_where_the_gather_rings_nowhere_the_psum_stays():
    # a machine whose all_reduce is slow (the split pays) and whose steps are slow (a ring of small
    # matmuls does not): the split's gather ring is declined, so the next try keeps the psum
    text = summed_then(lambda g, w1, w2: (g @ w1, g @ w2), rows=8)
    slow = "h100:all_reduce_bandwidth=1e6,step=1e-3"
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(policy="auto", hardware=slow))
    (psum,) = [s for s in result.report.sites if s.kind == "dot_all_reduce"]
    assert not psum.rewritten and "not split for its matmuls' gather ring" in psum.reason
    assert count(result, "stablehlo.all_reduce") == 1 and count(result, "stablehlo.reduce_scatter") == 0


def test_the_options_that_keep_psums_keep_it():
    text = summed_then(lambda g, w1, w2: (g @ w1, g @ w2))
    for strategy in ("keep", "chunk"):
        result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(policy="all", all_reduce=strategy))
        assert count(result, "stablehlo.all_reduce") >= 1 and count(result, "stablehlo.reduce_scatter") == 0


def test_training_parity_of_a_megatron_step_under_check_vma_false():
    mesh = mesh_1d(8, "model")
    f = smap(megatron_mlp_body, mesh=mesh, in_specs=MEGATRON_SPECS, out_specs=P())

    def train_step(x, w1, w2):
        loss, grads = jax.value_and_grad(lambda *a: jnp.mean(f(*a) ** 2), argnums=(1, 2))(x, w1, w2)
        return loss, w1 - 0.1 * grads[0], w2 - 0.1 * grads[1]

    rng = np.random.default_rng(0)
    args = [jax.device_put(rng.normal(size=a.shape).astype(np.float32), a.sharding) for a in megatron_args(mesh)]
    step = cmatmul_pass.jit(train_step, policy="all", all_reduce="split")
    mine, base = step(*args), jax.jit(train_step)(*args)
    for a, b in zip(jax.tree.leaves(mine), jax.tree.leaves(base)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6)
    assert any(s.rewritten and s.all_reduce.get("picked") == "summed value" for s in step.report.sites)
