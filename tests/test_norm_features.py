"""A norm over the gathered dim: activations sharded along their features are all-gathered along
them, normalised over them (RMS norm, layer norm) and fed to matmuls contracting over them.  The
norm's statistic is a sum over the gathered dim, so each device sums its own features, an
all_reduce adds the shares, the shard is normalised, and the gather becomes the dots'
contracting-dim ring.  In the backward the input gradient's scatter along the features reads the
norm's backward, which spreads sums over the features back over them: those sums are
all_reduced after the scatter's ring and their terms added to each device's own block.  Each
precondition has a program that breaks it (left as written) beside its legal twin (rewritten),
and every rewritten program is compared with the original."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import cmatmul_pass
from cmatmul_pass import ir_utils
from conftest import assert_same_numbers
from tools.samples_layers import feature_norm

MESH = jax.make_mesh((8,), ("model",))
#: features-sharded activations, a replicated gain and bias, a column-parallel projection
SPECS = (P(None, "model"), P(), P(), P(None, "model"))


def gathered(x):
    return jax.lax.all_gather(x, "model", axis=1, tiled=True)


def program(body, tokens=32, hidden=64, dtype=jnp.bfloat16, grad=False):
    f = jax.shard_map(body, mesh=MESH, in_specs=SPECS, out_specs=P(None, "model"), check_vma=False)
    shapes = [((tokens, hidden), dtype), ((hidden,), jnp.float32), ((hidden,), jnp.float32), ((hidden, 128), dtype)]
    args = [jax.ShapeDtypeStruct(s, t, sharding=NamedSharding(MESH, sp)) for (s, t), sp in zip(shapes, SPECS)]
    if grad:
        return jax.jit(jax.value_and_grad(lambda *a: jnp.mean(f(*a).astype(jnp.float32) ** 2),
                                          argnums=(0, 1, 3))).lower(*args).as_text()
    return jax.jit(f).lower(*args).as_text()


def normed(kind, scale=lambda g: g):
    return lambda x, g, b, w: feature_norm(gathered(x), scale(g), b, kind) @ w


def gather_site(result):
    (site,) = [s for s in result.report.sites if s.kind == "all_gather_dot"]
    return site


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("variant", ["uni", "unroll2", "bidi-full"])
@pytest.mark.parametrize("kind, sums", [("rms", 1), ("layer", 2)])
def test_the_norm_runs_on_the_shard_and_the_gather_rings(kind, sums, variant, dtype):
    text = program(normed(kind), dtype=dtype)
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(variant=variant))
    site = gather_site(result)
    assert site.rewritten and site.dim_role == "contracting", site.summary_line()
    assert f"({sums} of them sums over the gathered dim" in site.notes[0], site.notes
    found = ir_utils.ops_named(result.module, "stablehlo.all_gather", "stablehlo.all_reduce", "stablehlo.rsqrt")
    assert not found["stablehlo.all_gather"]
    # one all_reduce per statistic, of one float per row; the statistic's rsqrt per row as before
    assert [list(ir_utils.ranked_tensor(op.result).shape) for op in found["stablehlo.all_reduce"]] == [[32]] * sums
    (rsqrt,) = found["stablehlo.rsqrt"]
    assert list(ir_utils.ranked_tensor(rsqrt.result).shape) == [32, 1]
    assert_same_numbers(text, result)


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_training_parity_through_the_decorator(kind):
    """value_and_grad of a loss over the block (rematerialised, as a scan over layers remats it)
    through cmatmul_pass.jit: the forward's gather moves past the norm and rings; loss and
    gradients as jax.jit's.  The backward's gather of the recomputed rows stays: the norm's
    backward reads the rows whole.  (Without remat the forward hands the gathered rows to the
    backward as a residual, and its gather stays too:
    test_a_residual_of_the_gathered_rows_keeps_the_gather.)"""
    f = jax.shard_map(jax.checkpoint(normed(kind)), mesh=MESH, in_specs=SPECS, out_specs=P(None, "model"),
                      check_vma=False)

    def loss(x, g, b, w):
        return jnp.mean(f(x, g, b, w) ** 2)

    rng = np.random.default_rng(0)
    shapes = [(32, 64), (64,), (64,), (64, 128)]
    args = [jax.device_put(rng.normal(size=s).astype(np.float32), NamedSharding(MESH, sp))
            for s, sp in zip(shapes, SPECS)]
    step = cmatmul_pass.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
    mine, base = step(*args), jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(*args)
    for a, b in zip(jax.tree.leaves(mine), jax.tree.leaves(base)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6)
    moved = [s for s in step.report.sites if s.kind == "all_gather_dot" and s.rewritten
             and any("sums over the gathered dim" in n for n in s.notes)]
    assert len(moved) == 1, "\n".join(s.summary_line() for s in step.report.sites)
    # the backward's input gradient: the norm's backward spreads a sum over the features back over
    # them before the scatter; the sums are all_reduced after its ring
    (dx,) = [s for s in step.report.sites if s.kind == "dot_reduce_scatter"]
    assert dx.rewritten and "all_reduced after the scatter" in dx.notes[0], dx.summary_line()


@pytest.mark.parametrize("kind, sums", [("rms", 1), ("layer", 2)])
def test_a_residual_of_the_gathered_rows_is_assembled_by_the_ring(kind, sums):
    """Differentiated without remat, the forward returns the gathered rows for the backward, so
    the gather cannot move past the norm (the rows would cross the wire twice): the norm's sums
    over the gathered features are computed from the shard and added up by an all_reduce, the
    ring applies the rest of the norm to each block it receives and assembles the raw rows.  The
    backward's input-gradient scatter rings too: its spread sums read the forward's residuals,
    which the backward region's arguments carry (each device reads back what it returned)."""
    text = program(normed(kind), dtype=jnp.float32, grad=True)
    result = cmatmul_pass.rewrite(text)
    site = gather_site(result)
    assert site.rewritten and "assembles the gathered value" in site.summary_line(), site.summary_line()
    assert f"{sums} sum(s) over the gathered dim" in site.notes[0], site.notes
    (dx,) = [s for s in result.report.sites if s.kind == "dot_reduce_scatter"]
    assert dx.rewritten, dx.summary_line()
    assert_same_numbers(text, result)


def test_a_sum_of_a_device_varying_value_stays_before_the_ring():
    """The statistic sums the gathered rows scaled by the device's own factor: the shards' sums
    would each be scaled by their own device's, not the reader's, so the sum is not moved and the
    gather stays (its legal twin: the test above)."""
    def body(x, g, b, w):
        h = gathered(x)
        ms = jnp.mean(h * h * (1.0 + jax.lax.axis_index("model")), axis=-1, keepdims=True)
        return (h * jax.lax.rsqrt(ms + 1e-6) * g) @ w, h

    f = jax.shard_map(body, mesh=MESH, in_specs=SPECS, out_specs=(P(None, "model"), P()), check_vma=False)
    shapes = [(32, 64), (64,), (64,), (64, 128)]
    args = [jax.ShapeDtypeStruct(s, jnp.float32, sharding=NamedSharding(MESH, sp)) for s, sp in zip(shapes, SPECS)]
    text = jax.jit(f).lower(*args).as_text()
    result = cmatmul_pass.rewrite(text)
    assert not gather_site(result).rewritten, gather_site(result).summary_line()
    assert result.text == ir_utils.print_module(ir_utils.parse(text))


def test_a_sum_from_a_nonzero_start_stays():
    """A sum of squares started from 1.0 is not the sum of the devices' partial sums (each would
    count the 1.0): the gather stays where it is."""
    text = program(normed("offset"))
    site = gather_site(cmatmul_pass.rewrite(text))
    assert not site.rewritten and site.reason_code == "layout", site.summary_line()
    assert "gathered whole for stablehlo.reduce" in site.reason


def test_a_gain_that_differs_between_devices_is_applied_per_block_not_moved():
    """Each device scales all the rows it gathered by its own gain: moved before the gather, a
    device's features would arrive scaled by the sender's, so the norm does not move; the ring
    applies it to each block it receives with the device's own gain's block, its statistic
    summed from the shards first (the legal twin of the move: the first test)."""
    text = program(normed("rms", lambda g: g * (1.0 + jax.lax.axis_index("model"))))
    result = cmatmul_pass.rewrite(text)
    site = gather_site(result)
    assert site.rewritten and not any(n.startswith("moved to its dot") for n in site.notes), site.notes
    assert "1 sum(s) over the gathered dim" in site.notes[0], site.notes
    assert_same_numbers(text, result)


@pytest.mark.parametrize("hidden, moves", [(8, False), (16, True), (64, True)])
def test_the_statistic_moves_at_most_an_eighth_of_the_gathered_bytes(hidden, moves):
    """The per-row sum's all_reduce (32 floats, each sent about twice) against the gathered rows:
    with 8 features a row (f32) it is a quarter of the bytes the gather brings, and the gather
    stays and says so; from 16 features it is at most an eighth, and the gather moves."""
    text = program(normed("rms"), hidden=hidden, dtype=jnp.float32)
    site = gather_site(cmatmul_pass.rewrite(text))
    assert site.rewritten is moves, site.summary_line()
    if not moves:
        assert ("their sums over the gathered dim would all_reduce 128 B (each byte about twice on the wire), more "
                "than 1/8 of the 1024 B the gather brings") in site.reason


def test_the_statistic_read_elsewhere_is_the_summed_one():
    """The statistic is also an output: it reads the all_reduced sum, the same value on every
    device, as the original's sum of the gathered rows was."""
    def body(x, g, b, w):
        h = gathered(x).astype(jnp.float32)
        ms = jnp.mean(h * h, axis=-1, keepdims=True)
        return ((h * jax.lax.rsqrt(ms + 1e-6) * g).astype(x.dtype) @ w, ms)

    f = jax.shard_map(body, mesh=MESH, in_specs=SPECS, out_specs=(P(None, "model"), P()), check_vma=False)
    shapes = [((32, 64), jnp.float32), ((64,), jnp.float32), ((64,), jnp.float32), ((64, 128), jnp.float32)]
    args = [jax.ShapeDtypeStruct(s, t, sharding=NamedSharding(MESH, sp)) for (s, t), sp in zip(shapes, SPECS)]
    text = jax.jit(f).lower(*args).as_text()
    result = cmatmul_pass.rewrite(text)
    assert gather_site(result).rewritten
    assert_same_numbers(text, result)


def scan_step(kind, dtype):
    """A training step over a scan of two remat'd layers: features-sharded activations gathered,
    normed (f32 statistics), projected up (column-parallel), gelu, projected down (row-parallel)
    and scattered back along the features, a residual add; value_and_grad of a mean square."""
    def layer(x, p):
        g, b, w1, w2 = p
        h = feature_norm(gathered(x), g, b, kind)
        return x + jax.lax.psum_scatter(jax.nn.gelu(h @ w1) @ w2, "model", scatter_dimension=1, tiled=True), None

    specs = (P(None, "model"), P(), P(), P(None, None, "model"), P(None, "model", None))
    f = jax.shard_map(lambda x, *p: jax.lax.scan(jax.checkpoint(layer), x, p)[0], mesh=MESH, in_specs=specs,
                      out_specs=P(None, "model"), check_vma=False)
    shapes = [((32, 64), dtype), ((2, 64), jnp.float32), ((2, 64), jnp.float32), ((2, 64, 128), dtype),
              ((2, 128, 64), dtype)]
    rng = np.random.default_rng(1)
    args = [jax.device_put((rng.normal(size=s) * (0.2 if len(s) == 3 else 1.0)).astype(t), NamedSharding(MESH, sp))
            for (s, t), sp in zip(shapes, specs)]
    return jax.value_and_grad(lambda *a: jnp.mean(f(*a).astype(jnp.float32) ** 2), argnums=(0, 1, 2, 3, 4)), args


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_a_scan_of_remat_layers_rings_its_gathers_and_scatters_forward_and_backward(kind):
    """Every collective of the step but the psums of whole-loop gradients is rewritten, in each
    trip: the forward's gather (the norm on the shard, its gain a scan argument), the down
    projection's scatter, the backward's gather of the recomputed rows (the norm's statistic
    summed from the shards, the rows assembled for the norm's backward), the backward's gather of
    the output gradient and the input gradient's scatter (the norm's spread sums taken out); loss
    and gradients as jax.jit's."""
    grad, args = scan_step(kind, jnp.float32)
    step = cmatmul_pass.jit(grad)
    mine, base = step(*args), jax.jit(grad)(*args)
    for a, b in zip(jax.tree.leaves(mine), jax.tree.leaves(base)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6)
    left = [s for s in step.report.sites if not s.rewritten and s.kind != "dot_all_reduce"]
    assert not left, "\n".join(s.summary_line() for s in left)
    scatters = [s for s in step.report.sites if s.kind == "dot_reduce_scatter"]
    assert len(scatters) == 2 and all(s.rewritten for s in scatters)
    assert sum(any("all_reduced after the scatter" in n for n in s.notes) for s in scatters) == 1


def test_the_bf16_step_is_checked_against_its_own_error():
    """bf16 activations and weights, f32 norms: the rewritten step's numbers as check judges them."""
    grad, args = scan_step("rms", jnp.bfloat16)
    text = jax.jit(grad).lower(*args).as_text()
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(variant="bidi"))
    assert sum(s.rewritten for s in result.report.sites if s.kind == "dot_reduce_scatter") == 2
    assert_same_numbers(text, result)


def test_a_residual_that_differs_between_devices_keeps_the_scatter():
    """The gathered rows scaled by the device's own factor before the norm: the backward reads
    them as a residual (a region argument the forward returned), and they scale the spread sum's
    term, so the devices' terms are not one term of the summed statistic: the input gradient's
    scatter stays as written (its legal twin: test_a_residual_of_the_gathered_rows_...)."""
    def body(x, g, b, w):
        h = gathered(x) * (1.0 + jax.lax.axis_index("model"))
        return (h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6) * g) @ w

    text = program(body, dtype=jnp.float32, grad=True)
    result = cmatmul_pass.rewrite(text)
    (dx,) = [s for s in result.report.sites if s.kind == "dot_reduce_scatter"]
    assert not dx.rewritten and "may differ between devices" in dx.reason, dx.summary_line()
    assert "a product of two values" in dx.reason, dx.reason
    assert_same_numbers(text, result)


def test_a_sum_reading_another_statistic_of_the_gathered_rows_stays():
    """The rows centred by their max over the gathered features before the sum of squares: the
    sum's other operand is computed from the gathered value by an op that is not moved (a max),
    so the sum is not computed from the shards and the gather stays, the raw rows returned."""
    def body(x, g, b, w):
        h = gathered(x)
        c = h - jnp.max(h, axis=-1, keepdims=True)
        return (h * jax.lax.rsqrt(jnp.mean(c * c, axis=-1, keepdims=True) + 1e-6) * g) @ w, h

    f = jax.shard_map(body, mesh=MESH, in_specs=SPECS, out_specs=(P(None, "model"), P()), check_vma=False)
    shapes = [(32, 64), (64,), (64,), (64, 128)]
    args = [jax.ShapeDtypeStruct(s, jnp.float32, sharding=NamedSharding(MESH, sp)) for s, sp in zip(shapes, SPECS)]
    text = jax.jit(f).lower(*args).as_text()
    result = cmatmul_pass.rewrite(text)
    site = gather_site(result)
    assert not site.rewritten and site.reason_code == "layout", site.summary_line()
    assert result.text == ir_utils.print_module(ir_utils.parse(text))


def gqa_block_step():
    """A scan of two remat'd transformer blocks on features-sharded activations (bf16 weights, f32
    RMS norms): gathered, normed, Q/K/V (2 query heads over 1 KV head a device, repeated), causal
    attention, the output projection scattered back along the features, a residual add; then
    gathered, normed, gate and up, SiLU, down, scattered, added.  value_and_grad over everything."""
    tokens, hidden, head, ffn = 16, 64, 8, 128
    dt = jnp.bfloat16

    def layer(x, p):
        g1, wq, wk, wv, wo, g2, wg, wu, wd = p
        h = feature_norm(gathered(x), g1, None, "rms")
        q, k, v = ((h @ w).reshape(tokens, -1, head) for w in (wq, wk, wv))
        k, v = (jnp.repeat(t, q.shape[1] // k.shape[1], axis=1) for t in (k, v))
        s = jnp.einsum("thd,shd->hts", q, k).astype(jnp.float32) / np.sqrt(head)
        s = jnp.where(jnp.tril(jnp.ones((tokens, tokens), bool)), s, -1e9)
        a = jnp.einsum("hts,shd->thd", jax.nn.softmax(s, -1).astype(dt), v).reshape(tokens, -1)
        x = x + jax.lax.psum_scatter(a @ wo, "model", scatter_dimension=1, tiled=True)
        h = feature_norm(gathered(x), g2, None, "rms")
        u = jax.nn.silu(h @ wg) * (h @ wu)
        return x + jax.lax.psum_scatter(u @ wd, "model", scatter_dimension=1, tiled=True), None

    col, row = P(None, None, "model"), P(None, "model", None)
    specs = (P(None, "model"), P(), col, col, col, row, P(), col, col, row)
    f = jax.shard_map(lambda x, *p: jax.lax.scan(jax.checkpoint(layer), x, p)[0], mesh=MESH, in_specs=specs,
                      out_specs=P(None, "model"), check_vma=False)
    shapes = [((tokens, hidden), dt), ((2, hidden), jnp.float32), ((2, hidden, 16 * head), dt),
              ((2, hidden, 8 * head), dt), ((2, hidden, 8 * head), dt), ((2, 16 * head, hidden), dt),
              ((2, hidden), jnp.float32), ((2, hidden, ffn), dt), ((2, hidden, ffn), dt), ((2, ffn, hidden), dt)]
    args = [jax.ShapeDtypeStruct(s, t, sharding=NamedSharding(MESH, sp)) for (s, t), sp in zip(shapes, specs)]
    grad = jax.value_and_grad(lambda *a: jnp.mean(f(*a).astype(jnp.float32) ** 2), argnums=tuple(range(10)))
    return jax.jit(grad).lower(*args).as_text()


def test_a_gqa_transformer_on_feature_sharded_activations_rings_every_gather_and_scatter():
    """Each block's two gathers and two scatters, forward and backward (the recomputed gathers'
    rows assembled for the norms' backward; the input gradients' scatters with their spread sums
    taken out), are rewritten; only the psums of whole-loop gradients stay; check OK."""
    text = gqa_block_step()
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(variant="unroll2"))
    sites = [s for s in result.report.sites if s.kind in ("all_gather_dot", "dot_reduce_scatter")]
    assert len(sites) == 11 and all(s.rewritten for s in sites), "\n".join(s.summary_line() for s in sites)
    assert_same_numbers(text, result)


@pytest.mark.parametrize("psum_first, rings", [(True, False), (False, True)])
def test_a_collective_reading_the_rows_before_the_statistic_keeps_its_place(psum_first, rings):
    """The gathered rows' readers before the norm's last sum move after it when the sums are
    computed from the shards; a psum of them there (an op with an effect of its own: a
    collective) is not moved, so neither are the sums and the gather stays.  Its legal twin, the
    psum after the statistic, is left in place and the gather rings."""
    def body(x, g, b, w):
        h = gathered(x)
        if psum_first:
            t = jax.lax.psum(h[:, :1], "model")
        ms = jnp.mean(h * h, axis=-1, keepdims=True)
        if not psum_first:
            t = jax.lax.psum(h[:, :1], "model")
        return (h * jax.lax.rsqrt(ms + 1e-6) * g) @ w, h + t

    f = jax.shard_map(body, mesh=MESH, in_specs=SPECS, out_specs=(P(None, "model"), P()), check_vma=False)
    shapes = [(32, 64), (64,), (64,), (64, 128)]
    args = [jax.ShapeDtypeStruct(s, jnp.float32, sharding=NamedSharding(MESH, sp)) for s, sp in zip(shapes, SPECS)]
    text = jax.jit(f).lower(*args).as_text()
    result = cmatmul_pass.rewrite(text)
    assert gather_site(result).rewritten is rings, gather_site(result).summary_line()
    assert_same_numbers(text, result)
