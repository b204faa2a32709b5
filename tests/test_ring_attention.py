"""Ring attention: attention over all-gathered K and V becomes one ring with an online softmax.

Each program is written as context-parallel JAX code writes it (tools/samples_attention.py);
each rewritten module is run against the original (check_numerics), and each side condition of
the matcher has a program that breaks it next to its legal twin."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import cmatmul_pass
from cmatmul_pass import ir_utils
from cmatmul_pass._jax_private import ir
from tools.samples_attention import AXIS, attention, cp_attention, dropout
from tools.samples_common import arg, gather, lower, mesh_1d, smap


def rewritten(text: str, **options):
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(policy="all", **options))
    check = cmatmul_pass.check_numerics(ir_utils.parse(text), ir_utils.parse(result.text))
    assert check.ok, check
    return result


def attention_sites(result):
    return [s for s in result.report.sites if s.kind == "ring_attention"]


@pytest.mark.parametrize("causal,kv_heads,dtype,segments", [
    (True, 2, jnp.bfloat16, False),  # causal GQA, bf16 inputs, f32 softmax
    (False, 4, jnp.float32, False),  # bidirectional, multi-head, f32
    (True, 1, jnp.float32, True),  # multi-query, documents packed: segment ids gathered too
    (False, 2, jnp.bfloat16, True),
])
def test_attention_over_gathered_keys_is_one_ring(causal, kv_heads, dtype, segments):
    text = cp_attention(causal=causal, kv_heads=kv_heads, dtype=dtype, segments=segments)
    result = rewritten(text, variant="uni")
    (site,) = attention_sites(result)
    assert site.rewritten and site.attention["blocks"] == 8
    # the scores' memory: a block of the keys at a time
    memory = site.attention["memory"]
    assert memory["scores_after"] * 8 == memory["scores_before"]
    # a mask from positions is recomputed a block at a time; gathered segment ids are held whole
    assert (memory["held_whole"] > 0) == segments
    out = ir_utils.parse(result.text)
    gathers = ir_utils.ops_named(out.operation, "stablehlo.all_gather")["stablehlo.all_gather"]
    # what is left gathered: the keys' segment ids (a mask's operand, read a block at a time)
    assert [ir.RankedTensorType(g.operation.results[0].type).element_type for g in gathers] == \
        ([ir.IntegerType.get_signless(32, out.context)] if segments else [])
    # one loop: K's and V's permutes in its body
    assert len(ir_utils.ops_named(out.operation, "stablehlo.collective_permute")["stablehlo.collective_permute"]) == 2


def test_auto_takes_the_faster_direction():
    # toy sizes: the transfers dominate, so both directions; 32k tokens: the matmuls do, one
    (site,) = attention_sites(rewritten(cp_attention()))
    assert site.schedule["variant"] == "bidi" and site.schedule["directions"] == 2
    assert site.attention["memory"]["keys_values_after"] == 4 * site.attention["memory"]["keys_values_before"] // 8





@pytest.mark.parametrize("causal,dtype,segments", [(True, jnp.bfloat16, False), (False, jnp.float32, False),
                                                   (True, jnp.bfloat16, True)])
def test_dot_product_attention_is_one_ring(causal, dtype, segments):
    # jax.nn.dot_product_attention's XLA form: grouped heads without a repeat, the softmax in a
    # transposed layout, the mask applied by a jnp.where that transposes the scores
    result = rewritten(cp_attention(dpa=True, causal=causal, dtype=dtype, segments=segments))
    (site,) = attention_sites(result)
    assert site.rewritten


@pytest.mark.parametrize("variant", ["uni", "unroll2", "full", "bidi", "bidi-unroll2", "bidi-full"])
def test_every_variant(variant):
    result = rewritten(cp_attention(kv_heads=1, seq=48, n=6), variant=variant)
    (site,) = attention_sites(result)
    assert site.schedule["variant"] == variant
    assert site.schedule["permutes"] == 2 * 5  # K and V, n - 1 blocks each


def test_a_ring_of_two_and_a_ring_of_four():
    for n in (2, 4):
        (site,) = attention_sites(rewritten(cp_attention(n=n, seq=8 * n)))
        assert site.ring_size == n


def test_a_linear_op_on_the_probabilities_is_ringed_but_not_a_nonlinear_one():
    # legal twin: a scale of the probabilities (linear: the division by the sum waits for the end)
    (site,) = attention_sites(rewritten(cp_attention(after=lambda p: p * 0.5)))
    assert site.rewritten
    # a square root is not linear in them: the attention keeps two rings, the keys' gather says why
    result = rewritten(cp_attention(after=jnp.sqrt))
    assert not attention_sites(result)
    keys = [s for s in result.report.sites if s.attention.get("two_rings")]
    assert [s.attention["two_rings"] for s in keys] == ["attn_softmax"]
    assert all(s.rewritten for s in result.report.sites)


@pytest.mark.parametrize("where", [True, False], ids=["where", "multiply"])
def test_dropout_with_a_device_varying_key_is_one_ring(where):
    """The mask is computed as the original computes it (before the ring, each device its own)
    and read a block of keys at a time; a select between the probabilities and zero and a
    division by the keep rate are linear in them, so the division by the row sum still waits
    for the ring's end. The numbers as the original's."""
    (site,) = attention_sites(rewritten(cp_attention(after=dropout(where=where), dtype=jnp.float32)))
    assert site.rewritten


@pytest.mark.parametrize("after,says", [
    (dropout(keep_value=0.5), "func.call at"),  # dropped entries set to a constant: affine, not linear
    (lambda p: 0.01 / (p * 2.0), "stablehlo.divide at"),  # the probabilities a divisor
    (lambda p: p * p, "2 ops read the probabilities"),  # a product of two of them
    (lambda p: p + 1e-3, "stablehlo.add at"),  # a bias
], ids=["where-nonzero", "divisor", "square", "bias"])
def test_an_op_on_the_probabilities_that_is_not_linear_keeps_two_rings(after, says):
    result = rewritten(cp_attention(after=after, causal=False, dtype=jnp.float32))
    assert not attention_sites(result)
    keys = [s for s in result.report.sites if s.attention]
    assert [s.attention["two_rings"] for s in keys] == ["attn_softmax"]
    assert any(says in note for note in keys[0].notes), keys[0].notes


@pytest.mark.parametrize("positions", ["gathered", "table"])
def test_a_zig_zag_layout_is_one_ring(positions):
    """Load-balanced context parallelism: device p holds chunks p and 2n-1-p of 2n, the causal
    mask compares positions: the keys' gathered with them (read a block at a time) or looked up
    in a constant zig-zag table (read at the block's columns). One ring, the original's numbers."""
    n, seq = 8, 128
    chunk = seq // (2 * n)
    order = np.concatenate([np.r_[p * chunk:(p + 1) * chunk, (2 * n - 1 - p) * chunk:(2 * n - p) * chunk]
                            for p in range(n)]).astype(np.int32)
    mesh = mesh_1d(n, AXIS)
    spec = P(None, AXIS)

    def local(q, k, v, pos):
        kg, vg = gather(k, AXIS, 1), gather(v, AXIS, 1)
        s = jnp.einsum("bqhd,bkhd->bhqk", q, kg) / np.sqrt(q.shape[-1])
        if positions == "gathered":
            mask = pos[:, None, :, None] >= gather(pos, AXIS, 1)[:, None, None, :]
        else:
            table = jnp.asarray(order)
            mask = jax.lax.dynamic_slice(table, (jax.lax.axis_index(AXIS) * 2 * chunk,), (2 * chunk,))[:, None] \
                >= table[None, :]
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1), vg)

    f = smap(local, mesh=mesh, in_specs=(spec,) * 4, out_specs=spec)
    text = lower(f, *[arg(mesh, (2, seq, 2, 8), spec)] * 3, arg(mesh, (2, seq), spec, jnp.int32))
    (site,) = attention_sites(rewritten(text))
    assert site.rewritten and site.ring_size == n


def test_a_softmax_over_the_queries_is_no_ring_attention():
    def over_queries(s, axis):
        return jax.nn.softmax(s, axis=-2)

    result = rewritten(cp_attention(causal=False, softmax=over_queries))
    assert not attention_sites(result)
    assert not any(s.attention for s in result.report.sites)  # not an attention along the ring at all
    assert sum(s.rewritten for s in result.report.sites) == 2  # the scores' ring and P·V's


def masked_attention(mask, batch=2) -> str:
    """Attention over gathered K and V whose scores ``mask(s, kg, q)`` masks (f32, 2 KV heads)."""
    mesh = mesh_1d(8, AXIS)
    spec = P(None, AXIS)

    def local(q, k, v):
        kg, vg = gather(k, AXIS, 1), gather(v, AXIS, 1)
        s = mask(jnp.einsum("bqhd,bkhd->bhqk", q, kg), kg, q)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), vg)

    f = smap(local, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
    return lower(f, *[arg(mesh, (batch, 64, 2, 8), spec)] * 3)


def test_a_mask_reading_the_gathered_keys_is_declined():
    def padding(s, kg, q):  # keys that are all zero: padding, read from the keys themselves
        return jnp.where(jnp.all(kg == 0, axis=(2, 3))[:, None, None, :], -jnp.inf, s)

    result = rewritten(masked_attention(padding))
    assert not attention_sites(result)
    assert [s.attention["two_rings"] for s in result.report.sites if s.attention] == ["attn_region"]


def test_a_training_step_keeps_two_rings_and_says_why():
    result = rewritten(cp_attention(grad=True))
    assert not attention_sites(result)
    (keys,) = [s for s in result.report.sites if s.attention]
    assert keys.attention["two_rings"] == "attn_residual" and keys.rewritten
    assert any("ring attention:" in note for note in keys.notes)


def test_a_rematerialised_training_step_rings_its_forward():
    result = rewritten(cp_attention(grad=True, remat=True))
    assert len(attention_sites(result)) == 1  # the forward; the backward's recompute keeps its two rings


def test_training_parity_through_the_decorator():
    mesh = mesh_1d(8, AXIS)
    spec = P(None, AXIS)
    body = jax.checkpoint(lambda q, k, v: attention(q, k, v, causal=True))
    f = smap(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)

    def train_step(q, k, v):
        loss, grads = jax.value_and_grad(lambda *a: jnp.mean(f(*a) ** 2), argnums=(0, 1, 2))(q, k, v)
        return loss, [x - 0.1 * g for x, g in zip((q, k, v), grads)]

    rng = np.random.default_rng(0)
    shapes = [(2, 64, 4, 8), (2, 64, 2, 8), (2, 64, 2, 8)]
    args = [jax.device_put(rng.normal(size=s).astype(np.float32), NamedSharding(mesh, spec)) for s in shapes]
    step = cmatmul_pass.jit(train_step, policy="all")
    mine, base = step(*args), jax.jit(train_step)(*args)
    for a, b in zip(jax.tree.leaves(mine), jax.tree.leaves(base)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6)
    # the forward one ring; the backward's recompute two passes (tests/test_column_passes.py)
    assert [s.kind for s in step.report.sites if s.rewritten] == ["column_passes", "ring_attention"]


@pytest.mark.parametrize("guarded", [True, False])
def test_a_fully_masked_row_stays_nan_and_a_late_first_key_is_exact(guarded, monkeypatch):
    # queries whose every key is masked give NaN as the original does; a row whose first visible
    # key is in the last block gets no NaN from the earlier, fully masked blocks
    def late(s, kg, q):
        keys = jnp.arange(kg.shape[1])
        row = jnp.arange(q.shape[1]) + jax.lax.axis_index(AXIS) * q.shape[1]
        visible = (keys[None, :] >= kg.shape[1] - 1 - (row[:, None] % 9)) & (row[:, None] % 9 != 8)
        return jnp.where(visible, s, -jnp.inf)

    text = masked_attention(late, batch=1)
    if not guarded:
        from cmatmul_pass.rewrites import ring_attention

        monkeypatch.setattr(ring_attention._Block, "_finite", lambda self, b, reference: reference)
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(policy="all"))
    assert attention_sites(result)
    rng = np.random.default_rng(1)
    data = [rng.normal(size=(1, 64, 2, 8)).astype(np.float32) for _ in range(3)]
    from cmatmul_pass import execute

    devices = execute.cpu_devices(8)
    (want,), (got,) = (execute.run(ir_utils.parse(t), data, devices) for t in (text, result.text))
    want, got = np.concatenate(want, axis=1), np.concatenate(got, axis=1)
    if not guarded:  # the mutant: a row's -inf running max not taken as 0 gives NaN where the original has none
        assert np.isnan(got).sum() > np.isnan(want).sum()
        return
    assert np.array_equal(np.isnan(want), np.isnan(got)) and np.isnan(want).any()
    np.testing.assert_allclose(got[~np.isnan(got)], want[~np.isnan(want)], rtol=1e-5, atol=1e-6)


def test_the_default_rings_a_long_context_attention():
    # 32k tokens over 8 devices, 32 query and 8 KV heads of 128, bf16 (docs/patterns.md's figure)
    text = cp_attention(batch=1, seq=32768, heads=32, kv_heads=8, head_dim=128)
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(policy="auto", hardware="h100"))
    (site,) = attention_sites(result)
    assert site.rewritten and site.attention["prediction"]["speedup"] > 1.02
    assert site.schedule["variant"] == "uni"  # the matmuls hide either direction's transfers
    memory = site.attention["memory"]
    assert memory["scores_before"] == 16 * 2**30 and memory["scores_after"] == 2 * 2**30
    # at toy sizes the gathers are cheaper than the ring's steps: left with them
    assert not attention_sites(cmatmul_pass.rewrite(cp_attention(), cmatmul_pass.Options(policy="auto")))


def test_streams_annotated():
    # each round's K permute shares a scheduling group with its scores matmul, its V permute with P·V
    result = rewritten(cp_attention(), variant="bidi", annotate_streams=True)

    def group(op):
        attrs = op.operation.attributes
        if "mhlo.frontend_attributes" not in attrs:
            return None
        entries = ir.DictAttr(attrs["mhlo.frontend_attributes"])
        return ir.StringAttr(entries["_scheduling_group_id"]).value if "_scheduling_group_id" in entries else None

    ops = ir_utils.walk(result.module.operation)
    permutes = {group(op) for op in ops if op.operation.name == "stablehlo.collective_permute"} - {None}
    dots = {group(op) for op in ops if op.operation.name == "func.call"} - {None}
    assert permutes and permutes <= dots
