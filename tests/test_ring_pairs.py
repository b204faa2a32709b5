"""A scatter and a gather over other device groups at one dot (cmatmul_pass.ring_pairs): in the
backward of a 2-D-mesh MLP the cotangent's gather over 'model' feeds the down projection's dx and
dW dots, and dW is scattered over 'data' along the dim that gather is along.  Where the cost
model predicts the two rings faster, the gather's ring computes dx and assembles the gathered
value and the scatter's ring computes dW from it; else the gather's ring keeps both dots."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import cmatmul_pass
from cmatmul_pass import ir_utils
from tests.conftest import assert_same_numbers
from tools.samples_common import arg, lower, mesh_2x4
from tools.samples_layers import fsdp_tp_hidden

BIG, SMALL = (2048, 1024, 4096), (32, 64, 128)


def by_ring(report, kind: str, ring: int) -> list:
    return [s for s in report.sites if s.kind == kind and s.ring_size == ring]


@pytest.mark.parametrize("variant", ["uni", "bidi-full"])
def test_the_weight_gradient_scatter_rings_beside_the_cotangent_gather(variant):
    text = fsdp_tp_hidden(grad=True, sizes=BIG)()
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(variant=variant, policy="all"))
    (dw,) = [s for s in by_ring(result.report, "dot_reduce_scatter", 2) if s.operand == "lhs"]
    assert dw.rewritten and "rings over its other dots" in dw.notes[-1], dw.summary_line()
    (cotangent,) = by_ring(result.report, "all_gather_dot", 4)
    assert cotangent.rewritten and len(cotangent.consumers) == 1 and cotangent.assembled_for, cotangent.summary_line()
    found = ir_utils.ops_named(result.module, "stablehlo.reduce_scatter", "stablehlo.all_gather")
    assert not found["stablehlo.reduce_scatter"]
    assert len(found["stablehlo.all_gather"]) == 1  # the forward's prefetched weight gather
    assert_same_numbers(text, result)


def test_where_the_two_rings_would_not_pay_the_gather_keeps_both_dots():
    """The same program at toy sizes: per-round costs dominate and the pair's rings are predicted
    no faster, so the scatter stays (gathered_operand) and says the two predictions."""
    text = fsdp_tp_hidden(grad=True, sizes=SMALL)()
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(variant="uni", policy="all"))
    (dw,) = [s for s in by_ring(result.report, "dot_reduce_scatter", 2) if s.reason_code == "gathered_operand"]
    assert "for the two rings against" in dw.reason and "which it keeps" in dw.reason, dw.reason
    (cotangent,) = by_ring(result.report, "all_gather_dot", 4)
    assert cotangent.rewritten and len(cotangent.consumers) == 2 and not cotangent.assembled_for
    assert_same_numbers(text, result)


def test_without_assembling_the_gather_keeps_both_dots():
    """Options(assemble=False): the gather's ring could not hand its value to the scatter's, so the
    pair is not shared (the twin of the first test, at the same sizes)."""
    text = fsdp_tp_hidden(grad=True, sizes=BIG)()
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(variant="uni", policy="all", assemble=False))
    (dw,) = [s for s in by_ring(result.report, "dot_reduce_scatter", 2) if s.reason_code == "gathered_operand"]
    assert "for the two rings against" not in dw.reason, dw.reason
    (cotangent,) = by_ring(result.report, "all_gather_dot", 4)
    assert cotangent.rewritten and len(cotangent.consumers) == 2


def same_axis_program() -> str:
    """A weight gathered over 'model' along its output dim for two dots, one's product scattered
    over 'model' along that dim: gather and scatter over the same groups."""
    mesh = mesh_2x4()

    def block(x, w):
        wg = jax.lax.all_gather(w, "model", axis=1, tiled=True)
        y = jax.lax.psum_scatter(x @ wg, "model", scatter_dimension=1, tiled=True)
        return y, jnp.tanh(x) @ wg

    f = jax.shard_map(block, mesh=mesh, in_specs=(P("data"), P(None, "model")),
                      out_specs=(P("data", "model"), P("data")), check_vma=False)
    return lower(f, arg(mesh, (2048, 1024), P("data")), arg(mesh, (1024, 4096), P(None, "model")))


def test_over_the_same_groups_the_pair_is_an_all_reduce_and_the_gather_keeps_the_dot():
    text = same_axis_program()
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(variant="uni", policy="all"))
    (scatter,) = [s for s in result.report.sites if s.kind == "dot_reduce_scatter"]
    assert not scatter.rewritten and scatter.reason_code == "gathered_operand"
    assert "all-reduce in disguise" in scatter.reason and "for the two rings" not in scatter.reason, scatter.reason
    (gather,) = [s for s in result.report.sites if s.kind == "all_gather_dot"]
    assert gather.rewritten and len(gather.consumers) == 2


def test_training_parity_through_the_decorator():
    """A training step of the block under the default policy on a profile where both rings pay
    and the whole step gains (A100 links at 50 GB/s): loss and updated weights as jax.jit's."""
    mesh = mesh_2x4()
    tokens, hidden, ffn = 1024, 256, 1024

    def block(x, w_up, w_down):
        h = jax.nn.gelu(x @ jax.lax.all_gather(w_up, "data", axis=0, tiled=True))
        down = jax.lax.all_gather(w_down, "data", axis=1, tiled=True)
        return jax.lax.psum_scatter(h @ down, "model", scatter_dimension=1, tiled=True)

    specs = (P("data", None), P("data", "model"), P("model", "data"))
    f = jax.shard_map(block, mesh=mesh, in_specs=specs, out_specs=P("data", "model"))

    def train_step(x, w_up, w_down):
        loss, (g_up, g_down) = jax.value_and_grad(lambda u, d: jnp.mean(f(x, u, d) ** 2), argnums=(0, 1))(w_up, w_down)
        return loss, w_up - 0.1 * g_up, w_down - 0.1 * g_down

    rng = np.random.default_rng(0)
    args = [jax.device_put(rng.normal(size=s).astype(np.float32), NamedSharding(mesh, sp))
            for s, sp in zip([(tokens, hidden), (hidden, ffn), (ffn, hidden)], specs)]
    step = cmatmul_pass.jit(train_step, policy="auto", hardware="a100:bandwidth=5e10",
                            compile_budget=None)
    mine, base = step(*args), jax.jit(train_step)(*args)
    for a, b in zip(jax.tree.leaves(mine), jax.tree.leaves(base)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6)
    paired = [s for s in step.report.sites if s.rewritten and any("rings over its other dots" in n for n in s.notes)]
    assert len(paired) == 1, "\n".join(s.summary_line() for s in step.report.sites)
