"""A broadcast along a dim other than the gathered one between a gather and its dot: grouped-query
attention gathers K and V over the sequence and repeats their heads to the query heads
(``jnp.repeat``: a ``broadcast_in_dim`` and a reshape) before the score and output einsums.  Each
block of the repeated value is the repeat of that block, so the rings apply it per block; in a
training step the repeated value is also the backward's residual, which the ring assembles."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import cmatmul_pass
from cmatmul_pass import execute, ir_utils
from tools.samples_layers import gqa_attention

MESH = jax.make_mesh((8,), ("model",))
SPEC = P(None, "model", None, None)
HEADS = (8, 2, 2)  # query heads, key and value heads


def attention():
    return jax.shard_map(gqa_attention, mesh=MESH, in_specs=(SPEC,) * 3, out_specs=SPEC, check_vma=False)


def loss(q, k, v):
    return jnp.mean(attention()(q, k, v).astype(jnp.float32) ** 2)


def lowered(dtype, grad: bool) -> str:
    args = [jax.ShapeDtypeStruct((2, 64, h, 16), dtype, sharding=NamedSharding(MESH, SPEC)) for h in HEADS]
    f = jax.value_and_grad(loss, argnums=(0, 1, 2)) if grad else attention()
    return jax.jit(f).lower(*args).as_text()


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("variant", ["uni", "unroll2", "bidi-full"])
def test_the_head_repeat_runs_on_each_block(variant, grad):
    text = lowered(jnp.bfloat16, grad)
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(variant=variant))
    outcome = execute.check_numerics(ir_utils.parse(text), result.module)
    assert outcome.ok, outcome.format()
    if not grad:  # the forward alone: one ring with an online softmax, each block's heads repeated in it
        (site,) = result.report.sites
        assert site.kind == "ring_attention" and site.rewritten, site.summary_line()
        return
    gathers = [s for s in result.report.sites if s.kind == "all_gather_dot"]
    assert [(s.rewritten, s.dim_role) for s in gathers] == [(True, "free"), (True, "contracting")], \
        "\n".join(s.summary_line() for s in gathers)
    for site in gathers:  # the repeat is on the way to the dot, applied per block
        assert any("broadcast_in_dim" in c["look_through"] for c in site.consumers), site.consumers
        assert bool(site.assembled_for) is grad  # the backward's residual: the repeated value, whole
    assert all(s.rewritten for s in result.report.sites)


def test_training_parity_through_the_decorator():
    rng = np.random.default_rng(0)
    args = [jax.device_put(rng.normal(size=(2, 64, h, 16)).astype(np.float32), NamedSharding(MESH, SPEC))
            for h in HEADS]
    step = cmatmul_pass.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    mine, base = step(*args), jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(*args)
    for a, b in zip(jax.tree.leaves(mine), jax.tree.leaves(base)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-6)
    assert sorted(s.kind for s in step.report.rewritten) == ["all_gather_dot"] * 2 + ["dot_reduce_scatter"] * 2
