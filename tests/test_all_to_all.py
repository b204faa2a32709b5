"""All_to_all pairs chunked (``exchanges``, ``matchers/all_to_all``): an expert-parallel MoE
block's dispatch → experts → combine (capacity-padded) along the capacity, Ulysses attention's
heads ↔ sequence exchange along the batch; forward and training step, the numbers as the
original's; each side condition's breach declined with its reason beside its legal twin."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import cmatmul_pass
from cmatmul_pass import exchanges, ir_utils
from cmatmul_pass._jax_private import ir
from tests.conftest import assert_same_numbers

ALL = cmatmul_pass.Options(policy="all")
N = 8


def mesh(n=N, names=("expert",)):
    return Mesh(np.array(jax.devices()[:n]).reshape(-1 if len(names) == 1 else (2, n // 2)), names)


def lower(fn, shapes, specs, m, dtype=jnp.float32) -> str:
    args = [jax.ShapeDtypeStruct(s, dtype, sharding=NamedSharding(m, sp)) for s, sp in zip(shapes, specs)]
    return jax.jit(fn).lower(*args).as_text()


def moe_block(experts: int, capacity: int, between=None):
    """Top-1 routing into capacity slots (one-hot dispatch and combine einsums), the experts'
    tokens exchanged over 'expert' (split along the experts, concatenated along the capacity),
    a GELU FFN per local expert, exchanged back. ``between(h, extra)``: an op between the
    exchanges instead of the activation (the near misses)."""
    def block(x, router, w1, w2, extra):
        ids = jnp.argmax(x @ router, -1)
        onehot = jax.nn.one_hot(ids, experts, dtype=x.dtype)
        slot = ((jnp.cumsum(onehot, 0) - 1) * onehot).sum(-1).astype(jnp.int32)
        disp = onehot[:, :, None] * jax.nn.one_hot(slot, capacity, dtype=x.dtype)[:, None, :]  # [T, E, C]
        y = jax.lax.all_to_all(jnp.einsum("tec,th->ech", disp, x), "expert", 0, 1, tiled=True)
        h = jnp.einsum("ech,ehf->ecf", y, w1)
        h = jax.nn.gelu(h) if between is None else between(h, extra)
        back = jax.lax.all_to_all(jnp.einsum("ecf,efh->ech", h, w2), "expert", 1, 0, tiled=True)
        return jnp.einsum("tec,ech->th", disp, back)
    return block


def moe_program(grad=False, experts=16, capacity=16, hidden=32, ffn=64, tokens=32, between=None,
                extra_spec=P("expert"), dtype=jnp.float32) -> str:
    m = mesh()
    specs = (P("expert"), P(), P("expert"), P("expert"), extra_spec)
    f = jax.shard_map(moe_block(experts, capacity, between), mesh=m, in_specs=specs, out_specs=P("expert"),
                      check_vma=False)
    fn = jax.value_and_grad(lambda *a: jnp.mean(f(*a).astype(jnp.float32) ** 2), argnums=(0, 2, 3)) if grad else f
    shapes = [(tokens * N, hidden), (hidden, experts), (experts, hidden, ffn), (experts, ffn, hidden),
              (experts, N * capacity, ffn)]
    return lower(fn, shapes, specs, m, dtype)


def pairs(result):
    return [s for s in result.report.sites if s.kind == "all_to_all_chunk"]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_an_expert_parallel_moe_block_chunks_its_dispatch_and_combine(dtype):
    """Chunked along the capacity (the dispatch's concat dim, the combine's split dim): the
    chunks' exchanges and matmuls interleaved, the result as the original's."""
    text = moe_program(dtype=dtype)
    result = cmatmul_pass.rewrite(text, ALL)
    (site,) = pairs(result)
    assert site.rewritten and site.all_to_all["mode"] == "exchanged" and site.all_to_all["dim"] == 1, site.summary_line()
    k = site.all_to_all["chunks"]
    found = ir_utils.ops_named(result.module, "stablehlo.all_to_all", "stablehlo.dot_general")
    assert len(found["stablehlo.all_to_all"]) == 2 * k
    assert len(set(site.channel_handles)) == 2 * k
    assert_same_numbers(text, result)


@pytest.mark.parametrize("mode", ["exchanged", "split", "free"])
def test_a_second_run_leaves_the_chunks(mode):
    """The chunked pairs (each chunk a pair of its own, their results concatenated or
    interleaved) are declined 'chunked' by a second run, which changes nothing."""
    text = {"exchanged": moe_program(), "free": ulysses_program(),
            "split": ulysses_program(batch=1)}[mode]
    once = cmatmul_pass.rewrite(text, ALL)
    assert pairs(once)[0].rewritten and pairs(once)[0].all_to_all["mode"] == mode
    twice = cmatmul_pass.rewrite(once.text, ALL)
    assert not twice.report.rewritten and twice.text == once.text
    assert {s.reason_code for s in pairs(twice)} == {"chunked"}, [s.summary_line() for s in twice.report.sites]


@pytest.mark.parametrize("chunks", [2, 4, 8])
def test_every_chunk_count_computes_the_original(chunks):
    text = moe_program()
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(policy="all", chunks=chunks))
    (site,) = pairs(result)
    assert site.rewritten and site.all_to_all["chunks"] == chunks
    assert_same_numbers(text, result)


def test_streams_annotated_group_each_next_dispatch_with_this_chunks_matmuls():
    text = moe_program()
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(policy="all", chunks=4, annotate_streams=True))
    (site,) = pairs(result)
    assert site.rewritten
    found = ir_utils.ops_named(result.module, "stablehlo.all_to_all", "stablehlo.dot_general")
    grouped = [op for op in found["stablehlo.all_to_all"] if "mhlo.frontend_attributes" in op.operation.attributes]
    assert len(grouped) == 3  # chunks 1..3's dispatches, beside chunks 0..2's matmuls
    assert_same_numbers(text, result)


def test_the_training_step_chunks_its_backward_pairs_too():
    """value_and_grad over the tokens and the expert weights: the forward pair is chunked, its
    values the backward reads reassembled; the backward exchanges the cotangents back and forth
    (the pair transposed) and is chunked as well, the weights' gradients (dots contracting the
    capacity) summed over the chunks; loss and gradients as the original's."""
    text = moe_program(grad=True)
    result = cmatmul_pass.rewrite(text, ALL)
    chunked = [s for s in pairs(result) if s.rewritten]
    assert len(chunked) >= 2, [s.summary_line() for s in result.report.sites]
    adds = ir_utils.ops_named(result.module, "stablehlo.add")["stablehlo.add"]
    assert all(list(op.operation.results[0].uses) for op in adds)  # partial sums added only where read
    assert_same_numbers(text, result)


def test_training_parity_through_the_decorator():
    m = mesh()
    experts, capacity, hidden, ffn, tokens = 16, 16, 32, 64, 32
    specs = (P("expert"), P(), P("expert"), P("expert"), P("expert"))
    f = jax.shard_map(moe_block(experts, capacity), mesh=m, in_specs=specs, out_specs=P("expert"), check_vma=False)

    def train_step(x, router, w1, w2, extra):
        loss, (g1, g2) = jax.value_and_grad(lambda a, b: jnp.mean(f(x, router, a, b, extra) ** 2),
                                            argnums=(0, 1))(w1, w2)
        return loss, w1 - 0.1 * g1, w2 - 0.1 * g2

    rng = np.random.default_rng(0)
    shapes = [(tokens * N, hidden), (hidden, experts), (experts, hidden, ffn), (experts, ffn, hidden),
              (experts, N * capacity, ffn)]
    args = [jax.device_put(rng.normal(size=s).astype(np.float32), NamedSharding(m, sp)) for s, sp in zip(shapes, specs)]
    step = cmatmul_pass.jit(train_step, policy="all")
    mine, base = step(*args), jax.jit(train_step)(*args)
    for a, b in zip(jax.tree.leaves(mine), jax.tree.leaves(base)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6)
    assert any(s.rewritten for s in step.report.sites if s.kind == "all_to_all_chunk")


def ulysses_attention(dim):
    """One device's Ulysses attention over 'seq': q, k, v stacked ``[3, B, S/n, H, D]``."""
    def attention(qkv):
        qkv = jax.lax.all_to_all(qkv, "seq", 3, 2, tiled=True)  # [3, B, S, H/n, D]
        q, k, v = qkv[0], qkv[1], qkv[2]
        p = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(dim), axis=-1)
        o = jnp.einsum("bhqk,bkhd->bqhd", p, v)
        return jax.lax.all_to_all(o, "seq", 1, 2, tiled=True)  # [B, S/n, H, D]
    return attention


def ulysses_program(batch=2, seq=64, heads=16, dim=8, grad=False) -> str:
    """Ulysses attention: q, k, v stacked, exchanged from sequence-sharded to head-sharded (split
    the heads, concatenate the sequence), softmax attention per head, exchanged back. ``grad``:
    value_and_grad of a mean-square loss in the stacked q, k, v (their gradients stacked back by
    pads along the stack's dim before the backward's exchange)."""
    m = mesh(names=("seq",))
    f = jax.shard_map(ulysses_attention(dim), mesh=m, in_specs=(P(None, None, "seq"),), out_specs=P(None, "seq"),
                      check_vma=False)
    fn = jax.value_and_grad(lambda qkv: jnp.mean(f(qkv) ** 2)) if grad else f
    return lower(fn, [(3, batch, seq, heads, dim)], (P(None, None, "seq"),), m)


def test_ulysses_attention_chunks_along_the_batch():
    """The exchanges split and concatenate heads and sequence: the batch is free in both, and the
    attention keeps it apart (a batch dim of both matmuls, the softmax over the keys)."""
    text = ulysses_program()
    result = cmatmul_pass.rewrite(text, ALL)
    (site,) = pairs(result)
    assert site.rewritten and site.all_to_all["mode"] == "free" and site.all_to_all["dim"] == 1, site.summary_line()
    assert_same_numbers(text, result)


def test_ulysses_attention_of_one_sequence_chunks_along_the_heads():
    """Batch 1 (long-context training): the heads are the dispatch's split dim, and the combine's
    concat dim: each chunk takes a slice of every destination's heads, the chunks' outputs
    interleave back into the heads' order."""
    text = ulysses_program(batch=1)
    result = cmatmul_pass.rewrite(text, ALL)
    (site,) = pairs(result)
    assert site.rewritten and site.all_to_all["mode"] == "split" and site.all_to_all["dim"] == 3, site.summary_line()
    assert_same_numbers(text, result)


@pytest.mark.parametrize("batch,mode,dim", [(2, "free", 0), (1, "split", 2)], ids=["batch", "heads"])
def test_a_ulysses_training_step_chunks_its_backward_pair(batch, mode, dim):
    """The backward exchanges the output's cotangent to head-sharded, runs attention's VJP per
    head and stacks dq, dk, dv (pads along the stack's dim, none along the chunked one) before
    exchanging them back: chunked like the forward (along the batch; at batch 1 the heads)."""
    text = ulysses_program(batch=batch, seq=32, grad=True)
    result = cmatmul_pass.rewrite(text, ALL)
    assert len(pairs(result)) == 2 and all(s.rewritten for s in pairs(result)), \
        [s.summary_line() for s in result.report.sites]
    backward = pairs(result)[1]
    assert backward.all_to_all["mode"] == mode and backward.all_to_all["dim"] == dim, backward.summary_line()
    assert "stablehlo.pad" in ir_utils.ops_named(result.module, "stablehlo.pad")
    assert_same_numbers(text, result)


def test_ulysses_training_parity_through_the_decorator():
    """A step of gradient descent on the stacked q, k, v through cmatmul_pass.jit: both pairs
    chunked, loss and update as jax.jit's."""
    m = mesh(names=("seq",))
    f = jax.shard_map(ulysses_attention(8), mesh=m, in_specs=(P(None, None, "seq"),), out_specs=P(None, "seq"),
                      check_vma=False)

    def train_step(qkv):
        loss, g = jax.value_and_grad(lambda a: jnp.mean(f(a) ** 2))(qkv)
        return loss, qkv - 0.1 * g

    qkv = jax.device_put(np.random.default_rng(1).normal(size=(3, 2, 32, 16, 8)).astype(np.float32),
                         NamedSharding(m, P(None, None, "seq")))
    step = cmatmul_pass.jit(train_step, policy="all")
    mine, base = step(qkv), jax.jit(train_step)(qkv)
    for a, b in zip(jax.tree.leaves(mine), jax.tree.leaves(base)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6)
    assert sum(s.rewritten for s in step.report.sites if s.kind == "all_to_all_chunk") == 2


# ------------------------------------------------------------------ near misses and their twins
@pytest.mark.parametrize("form", ["lax", "jnp"])
def test_a_pad_of_another_dim_is_chunked_a_pad_of_the_chunked_dim_is_not(form):
    """Between the exchanges, a pad along the hidden dim (sliced back, the padding read) keeps the
    capacity's rows apart: chunked along the capacity. The same pad along the capacity shifts
    every row into its neighbour's place, across chunks: the capacity is not chunked; the experts
    (a batch dim of both matmuls, the pad's unpadded dim) are, the numbers as the original's."""
    def along(axis):  # lax.pad, or jnp.pad (a call of a function of its own, @_pad)
        def between(h, extra):
            widths = [(0, 0, 0)] * 3
            widths[axis] = (1, 0, 0)
            padded = jax.lax.pad(h, jnp.float32(0.5), widths) if form == "lax" else \
                jnp.pad(h, [w[:2] for w in widths], constant_values=0.5)
            return jax.nn.gelu(padded[tuple(slice(None, -1) if a == axis else slice(None) for a in range(3))])
        return between

    legal = moe_program(between=along(2))
    result = cmatmul_pass.rewrite(legal, ALL)
    (site,) = pairs(result)
    assert site.rewritten and site.all_to_all["mode"] == "exchanged" and site.all_to_all["dim"] == 1, \
        site.summary_line()
    assert_same_numbers(legal, result)
    shifted = moe_program(between=along(1))
    result = cmatmul_pass.rewrite(shifted, ALL)
    (site,) = pairs(result)
    assert site.rewritten and site.all_to_all["dim"] == 0, site.summary_line()
    assert_same_numbers(shifted, result)


def test_a_lone_exchange_has_no_pair():
    m = mesh()
    f = jax.shard_map(lambda x, w: jax.lax.all_to_all(x, "expert", 0, 1, tiled=True) @ w, mesh=m,
                      in_specs=(P("expert"), P()), out_specs=P("expert"), check_vma=False)
    result = cmatmul_pass.rewrite(lower(f, [(N * 16, 16, 8), (8, 8)], (P("expert"), P()), m), ALL)
    (site,) = pairs(result)
    assert not site.rewritten and site.reason_code == "a2a_unpaired", site.summary_line()


def test_a_reduction_over_the_capacity_chunks_along_the_experts():
    """Each expert's activations centred over its slots: the capacity's rows are mixed, but each
    local expert is apart from the others (a batch dim of the matmuls, the mean within it): the
    pair is chunked along the experts (the dispatch's split dim, the combine's concat dim)."""
    text = moe_program(between=lambda h, extra: h - jnp.mean(h, axis=1, keepdims=True))
    result = cmatmul_pass.rewrite(text, ALL)
    (site,) = pairs(result)
    assert site.rewritten and site.all_to_all["mode"] == "split" and site.all_to_all["dim"] == 0, site.summary_line()
    assert_same_numbers(text, result)


def test_a_reduction_over_the_experts_and_the_capacity_is_declined():
    """Centred over every local expert's slots at once: no dim is kept apart (the hidden dim is
    contracted, the experts and the capacity reduced): declined, naming the reduce."""
    text = moe_program(between=lambda h, extra: h - jnp.mean(h, axis=(0, 1), keepdims=True))
    result = cmatmul_pass.rewrite(text, ALL)
    (site,) = pairs(result)
    assert not site.rewritten and site.reason_code == "a2a_region", site.summary_line()
    assert "reduces over the chunked dim 1" in site.reason and "reduces over the chunked dim 0" in site.reason
    assert result.text == ir_utils.print_module(ir_utils.parse(text))


@pytest.mark.parametrize("before", [False, True], ids=["after", "before"])
def test_a_value_between_read_elsewhere_is_reassembled_after_the_pair(before):
    """The dispatched tokens and the hidden activations also leave the block (as a training step
    saves them): read after the combine, each is reassembled from the chunks (in the original's
    order along the exchanged capacity); a sum over them computed between the exchanges would
    need them whole there: declined."""
    m = mesh()

    def block(x, w1, w2):
        y = jax.lax.all_to_all(x, "expert", 0, 1, tiled=True)
        h = jnp.einsum("ech,ehf->ecf", y, w1)
        aux = jnp.sum(h) if before else None
        z = jax.lax.all_to_all(jnp.einsum("ecf,efh->ech", jnp.tanh(h), w2), "expert", 1, 0, tiled=True)
        return z, (aux if before else y), h

    specs = (P("expert"), P("expert"), P("expert"))
    out = (P("expert"), P() if before else P("expert"), P("expert"))
    f = jax.shard_map(block, mesh=m, in_specs=specs, out_specs=out, check_vma=False)
    text = lower(f, [(16 * N, 16, 32), (16, 32, 64), (16, 64, 32)], specs, m)
    result = cmatmul_pass.rewrite(text, ALL)
    (site,) = pairs(result)
    if before:
        assert not site.rewritten and site.reason_code == "a2a_region" and "reduces over the chunked dim 1" in site.reason
    else:
        assert site.rewritten, site.summary_line()
        assert_same_numbers(text, result)


@pytest.mark.parametrize("spec", [P("expert"), P()], ids=["per-row mask", "broadcast"])
def test_a_side_operand_along_the_exchanged_dim_is_read_at_each_chunks_rows(spec):
    """A mask over the exchanged capacity read between the exchanges: each chunk reads every
    device's rows of that chunk, device-major, as the dispatch laid them out (a wrong order
    shows in the numbers: the mask differs row by row); a mask broadcast along the capacity is
    rebuilt at the chunk's size."""
    def masked(h, extra):
        scale = extra if spec == P("expert") else jnp.broadcast_to(extra[: h.shape[0], :1, :], h.shape)
        return jax.nn.gelu(h) * scale

    text = moe_program(between=masked, extra_spec=spec)
    result = cmatmul_pass.rewrite(text, ALL)
    (site,) = pairs(result)
    assert site.rewritten and site.all_to_all["mode"] == "exchanged", site.summary_line()
    assert_same_numbers(text, result)


def test_the_oracle_catches_rows_read_in_the_wrong_order(monkeypatch):
    """Read a per-row mask's chunk contiguously instead of each device's rows: a mismatch."""
    from cmatmul_pass.execute import check_numerics
    from cmatmul_pass.rewrites import all_to_all as rewrite

    def contiguous(value, dim, j, chunks, n, b):
        width = ir.RankedTensorType(value.type).shape[dim] // chunks
        return b.slice(value, dim, j * width, width)

    monkeypatch.setattr(rewrite, "_strided_rows", contiguous)
    text = moe_program(between=lambda h, extra: jax.nn.gelu(h) * extra)
    result = cmatmul_pass.rewrite(text, ALL)
    assert pairs(result)[0].rewritten
    assert not check_numerics(ir_utils.parse(text), result.module).ok


def test_exchanges_over_different_axes_are_no_pair():
    m = mesh(names=("x", "y"))

    def block(a, w):
        y = jax.lax.all_to_all(a, "x", 0, 1, tiled=True)
        return jax.lax.all_to_all(jnp.einsum("ech,ehf->ecf", y, w), "y", 1, 0, tiled=True)

    specs = (P(("x", "y")), P(("x", "y")))
    f = jax.shard_map(block, mesh=m, in_specs=specs, out_specs=P(("x", "y")), check_vma=False)
    text = lower(f, [(16 * N, 16, 8), (16 * N // 2, 8, 8)], specs, m)
    sites = pairs(cmatmul_pass.rewrite(text, ALL))
    assert sites[0].reason_code == "a2a_unpaired" and "other device groups" in sites[0].reason, sites[0].reason


# ------------------------------------------------------------------ the cost model
def test_the_pipeline_of_k_chunks():
    """One chunk is the serial pair; many chunks approach the longer stream's time."""
    assert exchanges.pipelined(3.0, 5.0, 2.0, 1, 0.0) == pytest.approx(10.0)
    assert exchanges.pipelined(3.0, 5.0, 2.0, 4, 0.0) == pytest.approx(3 / 4 + 5 + 2 / 4)
    assert exchanges.pipelined(3.0, 1.0, 3.0, 8, 0.0) < 3.0 + 1.0 + 3.0


def test_the_default_chunks_a_production_moe_block_where_it_pays():
    """64 experts of a 4096-wide model, 1024 slots each, bf16 on 8 devices: the H100 profile
    predicts the chunked pair faster, so the default (policy auto) takes it; the same block at
    toy sizes is left as written ([policy])."""
    big = moe_program(experts=64, capacity=1024, hidden=4096, ffn=14336, tokens=8192, dtype=jnp.bfloat16)
    result = cmatmul_pass.rewrite(big, cmatmul_pass.Options(policy="auto"))
    (site,) = pairs(result)
    p = site.all_to_all["prediction"]
    assert site.rewritten and p["speedup"] > 1.02, site.summary_line()
    assert result.report.program["after_s"] < result.report.program["before_s"]
    (small,) = pairs(cmatmul_pass.rewrite(moe_program(), cmatmul_pass.Options(policy="auto")))
    assert not small.rewritten and small.reason_code == "policy", small.summary_line()


def test_the_performance_page_holds_the_moe_predictions():
    """docs/performance.md's expert-parallel table is what tools/moe_predictions.py prints."""
    from pathlib import Path

    from tools import moe_predictions

    lines = moe_predictions.rows("h100", 4096)
    assert len(lines) == 2 + 2 * len(moe_predictions.MODELS)
    page = (Path(__file__).resolve().parents[1] / "docs" / "performance.md").read_text()
    assert "\n".join(lines) in page
