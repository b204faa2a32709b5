"""Regions over gathered columns as passes of rings: attention's backward (K and V gathered
along the sequence, statistics of the scores over it, dK and dV scattered back) and any region of
that shape (a contrastive loss over gathered keys).

Each rewritten module is run against the original (check_numerics); each side condition of the
plan has a program that breaks it next to its legal twin, and the merges (row factors, the
online max) have programs where they do not apply and more passes are the answer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import cmatmul_pass
from cmatmul_pass import ir_utils
from tools.samples_attention import AXIS, attention, contrastive, cp_attention
from tools.samples_common import arg, gather, lower, mesh_1d, smap


def rewritten(text: str, **options):
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(policy="all", **options))
    check = cmatmul_pass.check_numerics(ir_utils.parse(text), ir_utils.parse(result.text))
    assert check.ok, check
    return result


def column_sites(result):
    return [s for s in result.report.sites if s.kind == "column_passes"]


def collectives(text: str, name: str) -> int:
    return len(ir_utils.ops_named(ir_utils.parse(text).operation, name)[name])


def notes(result) -> str:
    return " ".join(n for s in result.report.sites for n in s.notes)


@pytest.mark.parametrize("causal,kv_heads,dtype,segments", [
    (True, 2, jnp.bfloat16, False),  # causal GQA, bf16 inputs, f32 softmax
    (False, 4, jnp.float32, False),  # bidirectional, multi-head
    (True, 1, jnp.float32, True),  # multi-query, documents packed: segment ids gathered too
])
def test_a_rematerialised_attention_backward_is_two_passes(causal, kv_heads, dtype, segments):
    text = cp_attention(causal=causal, kv_heads=kv_heads, dtype=dtype, segments=segments, grad=True, remat=True)
    result = rewritten(text, variant="uni")
    (site,) = column_sites(result)
    a = site.attention
    # the max and the two sums it rescales in pass 1 (the softmax's sum, Σ dP·e with 1/l² taken out);
    # dQ in pass 2 with dK and dV travelling home with their blocks
    assert (a["passes"], a["statistics"], a["merged"], a["scattered"]) == (2, 4, 2, 2)
    assert a["memory"]["columns_after"] * 8 == a["memory"]["columns_before"]
    assert len(site.absorbs) == 3 + segments  # V's gather, the two scatters (the keys' segment ids' gather)
    assert collectives(result.text, "stablehlo.reduce_scatter") == 0
    # the forward's ring reads the keys' segment ids a block at a time from their gather
    assert collectives(result.text, "stablehlo.all_gather") == segments


def test_every_variant():
    text = cp_attention(grad=True, remat=True, dtype=jnp.float32)
    loops = {}
    for variant in ("uni", "unroll2", "full"):
        result = rewritten(text, variant=variant)
        (site,) = column_sites(result)
        loops[variant] = site.schedule["loop_trips"]
    # 8 rounds a pass: 7 sending in a loop and the last peeled; unrolled by two: 3 trips; full: no loop
    assert loops == {"uni": 7, "unroll2": 3, "full": 0}


def test_a_training_step_saving_the_probabilities_is_not_a_region():
    # without remat the backward reads the forward's probabilities: no gather in the backward, and the
    # forward's gathers scatter nothing back: no region (the attention keeps its two rings, as before)
    result = rewritten(cp_attention(grad=True))
    assert not column_sites(result) and "column passes" not in notes(result)


# ---------------------------------------------------------------- any region of that shape

def test_a_contrastive_loss_over_gathered_negatives_is_two_passes():
    result = rewritten(contrastive())
    (site,) = column_sites(result)
    # forward and backward in one region: pass 1 the max and Σ exp(logits - max) (the loss's);
    # pass 2 dq = Σ_J dlogits·K and dK scattered back
    assert (site.attention["passes"], site.attention["merged"], site.attention["scattered"]) == (2, 1, 1)


def test_a_column_value_read_after_the_region_is_declined():
    bad, twin = contrastive(returns_logits=True), contrastive()
    result = rewritten(bad)
    assert not column_sites(result)
    assert "column passes:" in notes(result) and "[cols_region]" in notes(result)
    assert column_sites(rewritten(twin))


def test_a_sum_from_a_nonzero_init_is_declined():
    result = rewritten(contrastive(nonzero_init=True))
    assert not column_sites(result)
    assert "from a nonzero init" in notes(result)


def test_a_reversal_along_the_columns_is_declined():
    bad, twin = contrastive(flipped=True), contrastive()
    result = rewritten(bad)
    assert not column_sites(result)
    assert "stablehlo.reverse" in notes(result) and "[cols_region]" in notes(result)
    assert column_sites(rewritten(twin))


def test_a_max_over_more_than_the_columns_takes_more_passes():
    # the max over the rows too: exp(x - max) is not the online max's form (a row's rescale would need
    # every row's), so the sum waits for the max's pass: three passes, the numbers as the original's
    result = rewritten(contrastive(max_dims=(0, 1)))
    (site,) = column_sites(result)
    assert site.attention["merged"] == 0 and site.attention["passes"] == 3


def test_a_max_through_a_device_varying_op_takes_more_passes():
    # g(M) = M + the device's index is no chain of maxima with constants: no online max
    result = rewritten(contrastive(between=lambda t: t + jax.lax.axis_index(AXIS).astype(t.dtype)))
    (site,) = column_sites(result)
    assert site.attention["merged"] == 0 and site.attention["passes"] == 3


def test_a_row_value_from_a_callback_is_declined():
    # a host callback on the row max before it is read back: an op with effects is not recomputed
    def host(t):
        return jax.pure_callback(lambda x: np.asarray(x), jax.ShapeDtypeStruct(t.shape, t.dtype), t)

    result = cmatmul_pass.rewrite(contrastive(between=host), cmatmul_pass.Options(policy="all"))
    assert not column_sites(result)
    assert "only plain ops are recomputed" in notes(result)


# ---------------------------------------------------------------- the default

def test_the_default_takes_the_passes_only_where_the_columns_do_not_fit():
    text = cp_attention(grad=True, remat=True)
    # at toy sizes the extra matmuls of the passes cost more than the transfers they hide
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(policy="auto"))
    assert not column_sites(result) and "column passes: predicted speed-up" in notes(result)
    # on a device whose memory cannot hold one score matrix, the region as written cannot run
    small = cmatmul_pass.rewrite(text, cmatmul_pass.Options(policy="auto", hardware="h100:memory=4096"))
    (site,) = column_sites(small)
    assert any("taken whatever the prediction" in n for n in site.notes)
    assert [s.kind for s in small.report.sites if s.rewritten] == ["column_passes", "ring_attention"]


def test_the_default_at_long_context():
    # 32 query heads, 8 KV heads of 128, bf16, over 8 H100s (docs/patterns.md's figures)
    def sites(seq, hardware="h100"):
        text = cp_attention(grad=True, remat=True, batch=1, seq=seq, heads=32, kv_heads=8, head_dim=128)
        return cmatmul_pass.rewrite(text, cmatmul_pass.Options(policy="auto", hardware=hardware))

    short = sites(32768)  # 16 GiB a score matrix: the passes' extra matmuls cost more than they hide
    assert not column_sites(short)
    assert "column passes: predicted speed-up 0.754x" in notes(short) and "1.72e+10 B as written" in notes(short)
    assert column_sites(sites(32768, "h100:memory=4e9"))  # a memory budget of 4 GB takes them
    long = sites(131072)  # 256 GiB: as written it cannot run on one H100
    (site,) = column_sites(long)
    assert site.attention["memory"]["columns_before"] == 256 * 2**30
    assert any("taken whatever the prediction" in n for n in site.notes)
    assert "as written the step cannot run: 2 site(s)" in long.report.program_line()  # (the forward's ring too)


def test_streams_annotated():
    text = cp_attention(grad=True, remat=True, dtype=jnp.float32)
    result = rewritten(text, variant="uni", annotate_streams=True)
    (site,) = column_sites(result)
    assert site.schedule["streams_annotated"]
    out = result.text
    # the passes' matmuls outlined onto compute streams, permutes grouped with them
    assert "_xla_stream_annotation" in out and "_scheduling_group_id" in out


def test_two_rematerialised_layers():
    # two attention layers in a row: each backward region its own passes (identical layers: replayed)
    mesh = mesh_1d(8, AXIS)
    spec = P(None, AXIS)
    body = jax.checkpoint(lambda q, k, v: attention(q, k, v, causal=True))
    f = smap(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)

    def loss(q, k, v):
        h = f(q, k, v)
        return jnp.sum(jnp.square(f(h, k, v)))

    args = [arg(mesh, (2, 64, 2, 8), spec), arg(mesh, (2, 64, 2, 8), spec), arg(mesh, (2, 64, 2, 8), spec)]
    result = rewritten(lower(jax.value_and_grad(loss, argnums=(0, 1, 2)), *args))
    assert len(column_sites(result)) == 2


def test_dot_product_attention_backward_is_two_passes():
    # jax.nn.dot_product_attention (implementation="xla"): its mask's VJP is a jnp.where that
    # transposes its result (a pointwise function read at its operand's layout, then the transpose)
    result = rewritten(cp_attention(grad=True, remat=True, dpa=True, kv_heads=1))
    (site,) = column_sites(result)
    assert site.attention["passes"] == 2


def test_an_op_on_the_probabilities_that_is_not_linear_takes_three_passes():
    # sqrt(p) before P·V: its gradient's sum over the keys is not linear in the exponentials, so
    # it waits for the max's pass (the online merge's linearity check, each op on the way)
    result = rewritten(cp_attention(grad=True, remat=True, after=jnp.sqrt, dtype=jnp.float32))
    (site,) = column_sites(result)
    assert site.attention["passes"] == 3 and site.attention["merged"] == 1


def late_masked_step() -> str:
    """A rematerialised attention's value_and_grad whose rows see keys only in the last block: the
    backward's running max is -inf for a row until its last block."""
    mesh = mesh_1d(8, AXIS)
    spec = P(None, AXIS)

    def local(q, k, v):
        kg, vg = gather(k, AXIS, 1), gather(v, AXIS, 1)
        s = jnp.einsum("bqhd,bkhd->bhqk", q, kg)
        keys = jnp.arange(kg.shape[1])
        row = jnp.arange(q.shape[1]) + jax.lax.axis_index(AXIS) * q.shape[1]
        visible = keys[None, :] >= kg.shape[1] - 1 - (row[:, None] % 9)
        p = jax.nn.softmax(jnp.where(visible, s, -jnp.inf), axis=-1)
        return jnp.einsum("bhqk,bkhd->bqhd", p, vg)

    f = smap(jax.checkpoint(local), mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
    step = jax.value_and_grad(lambda q, k, v: jnp.sum(jnp.square(f(q, k, v))), argnums=(0, 1, 2))
    return lower(step, *[arg(mesh, (1, 64, 2, 8), spec)] * 3)


@pytest.mark.parametrize("guarded", [True, False])
def test_a_late_first_key_is_exact_and_the_guard_is_what_makes_it(guarded, monkeypatch):
    # the online max's reference taken as 0 while a row's max is -inf: without it (the mutant) the
    # first rescale is exp(-inf + inf) and the row's sums turn NaN where the original has none
    text = late_masked_step()
    if not guarded:
        from cmatmul_pass.rewrites import column_ring

        def unguarded(self, s, m):
            for op in s.online.g:
                chain = s.online.top.result
                m = column_ring._binary(self.b, op.operation.name,
                                        *[m if v == chain else self.outside(v) for v in op.operation.operands])
            return m
        monkeypatch.setattr(column_ring._Emitter, "_reference", unguarded)
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(policy="all"))
    assert column_sites(result)
    rng = np.random.default_rng(2)
    data = [rng.normal(size=(1, 64, 2, 8)).astype(np.float32) for _ in range(3)]
    from cmatmul_pass import execute

    devices = execute.cpu_devices(8)
    want, got = (execute.run(ir_utils.parse(t), data, devices) for t in (text, result.text))
    want, got = [np.concatenate(w, axis=1) if np.ndim(w[0]) else np.asarray(w) for w in want], \
        [np.concatenate(g, axis=1) if np.ndim(g[0]) else np.asarray(g) for g in got]
    assert not any(np.isnan(w).any() for w in want)
    if not guarded:
        assert any(np.isnan(g).any() for g in got)
        return
    for w, g in zip(want, got):
        np.testing.assert_allclose(g, w, rtol=2e-4, atol=1e-5)


def test_a_scan_over_rematerialised_attention_layers():
    # the backward's region inside the backward scan's loop body, rewritten there (every trip the same)
    mesh = mesh_1d(8, AXIS)
    spec = P(None, AXIS)

    def layer(h, w):
        q, k, v = (jnp.einsum("bshd,de->bshe", h, w[i]) for i in range(3))
        return h + attention(q, k, v, causal=True)

    def model(h, ws):
        return jax.lax.scan(lambda h, w: (jax.checkpoint(layer)(h, w), None), h, ws)[0]

    f = smap(model, mesh=mesh, in_specs=(spec, P()), out_specs=spec)
    step = jax.value_and_grad(lambda h, ws: jnp.sum(jnp.square(f(h, ws))), argnums=(0, 1))
    result = rewritten(lower(step, arg(mesh, (2, 64, 2, 8), spec), arg(mesh, (2, 3, 8, 8), P())))
    (site,) = column_sites(result)
    assert site.layer and "each of the 2 trips" in site.layer


def test_context_parallel_within_a_data_parallel_mesh():
    # a 2×4 mesh: the sequence over 'context' (two groups of four), the batch over 'data'
    mesh = jax.make_mesh((2, 4), ("data", AXIS))
    spec = P("data", AXIS)
    f = smap(jax.checkpoint(lambda q, k, v: attention(q, k, v, causal=True)), mesh=mesh, in_specs=(spec,) * 3,
             out_specs=spec)
    step = jax.value_and_grad(lambda q, k, v: jnp.sum(jnp.square(f(q, k, v))), argnums=(0, 1, 2))
    result = rewritten(lower(step, *[arg(mesh, (2, 32, 2, 8), spec)] * 3))
    (site,) = column_sites(result)
    assert site.replica_groups == [[0, 1, 2, 3], [4, 5, 6, 7]]
