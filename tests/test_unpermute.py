"""A row permutation between a matmul and its psum: a MoE block's un-permute scatter-adds the
expert outputs back into token order, then psums them over the tensor axis.  The scatter keeps the
hidden dim whole (every update row covers it), so the psum splits (or chunks) along it, each block
un-permuted in the ring.  Each precondition has a program that breaks it (left as written) beside
its legal twin (rewritten), and every rewritten program is compared with the original."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import cmatmul_pass
from cmatmul_pass import ir_utils
from conftest import assert_same_numbers

MESH = jax.make_mesh((8,), ("model",))
TOKENS, ROWS, FFN, HIDDEN = 32, 64, 128, 64
SPECS = (P(None, "model"), P("model", None), P())


def program(unpermute, dtype=jnp.float32, out_specs=P()):
    def body(h, w, token):
        return jax.lax.psum(unpermute(h @ w, token), "model")

    f = jax.shard_map(body, mesh=MESH, in_specs=SPECS, out_specs=out_specs, check_vma=False)
    shapes = (((ROWS, FFN), dtype), ((FFN, HIDDEN), dtype), ((ROWS,), jnp.int32))
    args = [jax.ShapeDtypeStruct(s, t, sharding=NamedSharding(MESH, sp)) for (s, t), sp in zip(shapes, SPECS)]
    return jax.jit(f).lower(*args).as_text()


def into_tokens(y, token):
    return jnp.zeros((TOKENS, y.shape[1]), y.dtype).at[token].add(y)


def psum_site(result):
    (site,) = [s for s in result.report.sites if s.kind == "dot_all_reduce"]
    return site


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32])
@pytest.mark.parametrize("strategy, variant", [("split", "uni"), ("split", "bidi-full"), ("chunk", "uni")])
def test_the_psum_splits_along_the_hidden_dim_and_each_block_is_unpermuted(strategy, variant, dtype):
    text = program(into_tokens, dtype)
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(all_reduce=strategy, variant=variant))
    site = psum_site(result)
    assert site.rewritten and "dim 1" in site.summary_line(), site.summary_line()
    found = ir_utils.ops_named(result.module, "stablehlo.scatter", "stablehlo.all_reduce")
    # the scatter runs on a block of the hidden dim: 8 ring blocks (halved both ways) or 2 chunks
    widths = {ir_utils.ranked_tensor(op.operation.results[0]).shape[1] for op in found["stablehlo.scatter"]}
    split = HIDDEN // 8 // (2 if variant.startswith("bidi") else 1)
    assert widths == ({split} if strategy == "split" else {HIDDEN // 2}), widths
    assert_same_numbers(text, result)


def test_the_router_weights_and_a_batched_expert_matmul_ride_along():
    """The sample's shape: experts as a batch dim, the rows reshaped, weighted by the gates per row."""
    from tools.samples_megatron import moe_unpermute

    text = moe_unpermute()
    for strategy in ("split", "chunk"):
        result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(all_reduce=strategy, variant="uni"))
        assert psum_site(result).rewritten, psum_site(result).summary_line()
        assert_same_numbers(text, result)


def scatter_2d(y, token):  # each element to its own (row, column): the hidden dim is addressed too
    cols = jnp.broadcast_to(jnp.arange(y.shape[1]), y.shape)
    return jnp.zeros((TOKENS, y.shape[1]), y.dtype).at[token[:, None], cols].add(y)


@pytest.mark.parametrize("unpermute, why", [
    (lambda y, t: jnp.zeros((TOKENS, y.shape[1]), y.dtype).at[t].set(y), "other than by a sum"),
    (lambda y, t: jnp.zeros((TOKENS, y.shape[1]), y.dtype).at[t].max(y), "other than by a sum"),
    (scatter_2d, "with its indices"),
    (lambda y, t: jnp.arange(TOKENS * y.shape[1], dtype=y.dtype).reshape(TOKENS, -1).at[t].add(y),
     "differs from block to block"),
])
def test_what_is_no_scatter_add_along_other_dims_stays(unpermute, why):
    """A scatter that sets or takes the max (blocks would not sum alike), one that addresses the
    hidden dim too, one into a value that varies along it: the psum stays as written."""
    text = program(unpermute)
    site = psum_site(cmatmul_pass.rewrite(text))
    assert not site.rewritten, site.summary_line()
    assert why in site.reason, site.reason


def test_a_permutation_of_the_columns_splits_along_the_rows():
    """The twin that scatters the hidden dim (columns reversed) and keeps the rows: the psum splits
    or chunks along the rows instead."""
    def reversed_columns(y, token):
        return jnp.zeros(y.shape, y.dtype).at[:, jnp.arange(y.shape[1])[::-1]].add(y)

    text = program(reversed_columns)
    for strategy in ("split", "chunk"):
        result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(all_reduce=strategy, variant="uni"))
        site = psum_site(result)
        assert site.rewritten and "dim 0" in site.summary_line(), site.summary_line()
        assert_same_numbers(text, result)


def test_training_parity_through_the_decorator():
    """value_and_grad of a loss over the un-permuted psum through cmatmul_pass.jit: the forward's
    psum is rewritten; loss and gradients as jax.jit's."""
    f = jax.shard_map(lambda h, w, t: jax.lax.psum(into_tokens(h @ w, t), "model"), mesh=MESH, in_specs=SPECS,
                      out_specs=P(), check_vma=False)

    def loss(h, w, token):
        return jnp.mean(jnp.tanh(f(h, w, token)) ** 2)

    rng = np.random.default_rng(0)
    arrays = [rng.normal(size=(ROWS, FFN)).astype(np.float32), rng.normal(size=(FFN, HIDDEN)).astype(np.float32),
              rng.integers(0, TOKENS, ROWS).astype(np.int32)]
    args = [jax.device_put(a, NamedSharding(MESH, sp)) for a, sp in zip(arrays, SPECS)]
    grad = jax.value_and_grad(loss, argnums=(0, 1))
    step = cmatmul_pass.jit(grad, all_reduce="split")
    mine, base = step(*args), jax.jit(grad)(*args)
    for a, b in zip(jax.tree.leaves(mine), jax.tree.leaves(base)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6)
    assert any(s.kind == "dot_all_reduce" and s.rewritten for s in step.report.sites), \
        "\n".join(s.summary_line() for s in step.report.sites)
