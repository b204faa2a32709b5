"""Collectives moved to their matmuls: a program's all_gather whose rows reach the dots
only through row-wise ops (a norm of the gathered rows) is moved past them, the ops run on the
shard's rows, and the gather becomes the dot's ring.  What may not move stays as it was."""

import jax
import numpy as np
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import cmatmul_pass
from cmatmul_pass import execute, ir_utils, replay
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


@pytest.mark.parametrize("variant", ["uni", "unroll2", "bidi-full"])
def test_a_device_varying_factor_does_not_move_but_rings_with_the_norm(variant):
    """A factor that differs per device may not move onto the rows (device k's block would be
    scaled by k's factor, not by the reader's); the ring applies the norm and the factor to each
    block it receives instead, every device with its own factor, as the original applies it to
    all the rows it gathered."""
    text = lower(lambda x, g, w1, w2: scattered(rms(gathered(x), g * (1.0 + jax.lax.axis_index("model"))) @ w1 @ w2))
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(all_reduce="keep", variant=variant))
    (site,) = [s for s in result.report.sites if s.kind == "all_gather_dot"]
    assert site.rewritten and not site.assembled_for, site.summary_line()
    assert site.notes[0].startswith("rung with the row-wise ops") and "(not a dot)" in site.notes[0], site.notes
    assert not ir_utils.ops_named(result.module, "stablehlo.all_gather")["stablehlo.all_gather"]
    outcome = execute.check_numerics(ir_utils.parse(text), result.module)
    assert outcome.ok, outcome.format()


@pytest.mark.parametrize("variant", ["uni", "bidi-full"])
def test_normalised_rows_first_read_whole_ring_with_the_norm_and_are_assembled(variant):
    """The normalised rows are first read whole by an op that mixes them (a cumulative sum over
    rows, before the dot): the gather cannot move past the norm (it would still be gathered
    whole for the sum), so the ring applies the norm to each block for the dot and assembles the
    raw rows, from which the sum's norm is computed as before."""
    body = lambda x, g, w1, w2: (lambda h: (jnp.cumsum(h, axis=0), scattered(h @ w1 @ w2))[::-1])(rms(gathered(x), g))  # noqa: E731
    text = lower(body, (P("model", None), P()))
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(all_reduce="keep", variant=variant))
    (site,) = [s for s in result.report.sites if s.kind == "all_gather_dot"]
    assert site.rewritten and site.assembled_for, site.summary_line()
    assert site.notes[0].startswith("rung with the row-wise ops") and "func.call" in site.notes[0], site.notes
    assert not ir_utils.ops_named(result.module, "stablehlo.all_gather")["stablehlo.all_gather"]
    outcome = execute.check_numerics(ir_utils.parse(text), result.module)
    assert outcome.ok, outcome.format()


@pytest.mark.parametrize("body, why", [
    # a softmax over the gathered (row) dim mixes rows
    (lambda x, g, w1, w2: scattered(jax.nn.softmax(gathered(x), axis=0) @ w1 @ w2), "mixes rows"),
], ids=["mixes_rows"])
def test_what_may_not_move_stays_as_it_was(body, why):
    text = lower(body, P("model", None))
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(all_reduce="keep"))
    assert not any(s.moved_from for s in result.report.sites)  # the gather is not moved past the softmax
    # (the region, a max over the gathered rows read back and scattered along them, is the column
    # passes': a ring of the row blocks per pass, tests/test_column_passes.py)
    assert [s.kind for s in result.report.sites if s.rewritten] == ["column_passes"]
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


# ------------------------------------------------------------------ the scatter side: per-row factors
def row_factor_program(kind: str, repeat: int = 1) -> str:
    """``psum_scatter`` (or ``psum``) of a row-sharded product times a per-row factor: a replicated
    vector ``s`` (``scale``), or the row's RMS of this device's own columns (``rms``: a factor that
    differs from device to device as well)."""
    mesh = jax.make_mesh((8,), ("model",))

    def body(a, w, s):
        p = a @ w
        p = p * (s[:, None] if kind in ("scale", "psum") else
                 jax.lax.rsqrt(jnp.mean(a * a, axis=-1, keepdims=True) + 1e-6))
        if kind == "psum":
            return jax.lax.psum(p, "model")
        return jax.lax.psum_scatter(p, "model", scatter_dimension=0, tiled=True)

    out = P() if kind == "psum" else P("model", None)
    f = jax.shard_map(body, mesh=mesh, in_specs=(P(None, "model"), P("model", None), P()), out_specs=out,
                      check_vma=False)
    g = (lambda *xs: [f(*xs) for _ in range(repeat)]) if repeat > 1 else f
    args = [jax.ShapeDtypeStruct((64, 128), jnp.float32, sharding=NamedSharding(mesh, P(None, "model"))),
            jax.ShapeDtypeStruct((128, 32), jnp.float32, sharding=NamedSharding(mesh, P("model", None))),
            jax.ShapeDtypeStruct((64,), jnp.float32)]
    return jax.jit(g).lower(*args).as_text()


@pytest.mark.parametrize("variant", ["uni", "unroll2", "full", "bidi", "bidi-full"])
@pytest.mark.parametrize("kind", ["scale", "rms"])
def test_a_per_row_factor_between_the_dot_and_the_scatter_is_read_block_by_block(kind, variant):
    """f(P_d, s_d)[b] = f(P_d[b], s_d[b]) on every device d: each ring block multiplies its rows of
    the product by those rows of the factor, before the sum travels on."""
    text = row_factor_program(kind)
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(variant=variant))
    (site,) = result.report.sites
    assert site.rewritten, site.summary_line()
    assert not ir_utils.ops_named(result.module, "stablehlo.reduce_scatter")["stablehlo.reduce_scatter"]
    outcome = execute.check_numerics(ir_utils.parse(text), result.module)
    assert outcome.ok, outcome.format()


@pytest.mark.parametrize("strategy", ["split", "chunk"])
def test_a_psum_with_a_per_row_factor_splits_or_chunks(strategy):
    text = row_factor_program("psum")
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(variant="uni", all_reduce=strategy, chunks=4))
    (site,) = result.report.sites
    assert site.rewritten and site.all_reduce["strategy"] == strategy
    outcome = execute.check_numerics(ir_utils.parse(text), result.module)
    assert outcome.ok, outcome.format()


@pytest.mark.parametrize("prepare, extra", [
    (lambda y, b: y + b[None, :], (32,)),  # scattered along dim 1: a per-column bias varies along it
    (lambda y, b: y + b[:, None], (64,)),  # a per-row bias
    (lambda y, r: y + r, (64, 32)),  # a residual, an argument of the region
    (lambda y, r: y * r[:, None], (64,)),  # a per-row scale
], ids=["bias_along_dim1", "row_bias", "residual", "row_scale"])
def test_a_bias_or_residual_varying_along_the_scattered_dim_is_added_block_by_block(prepare, extra):
    """The original adds it on every device before the sum; so does the ring, block by block:
    sum_d (P_d + r_d)[b] = sum_d (P_d[b] + r_d[b])."""
    dim = 1 if extra == (32,) else 0
    mesh = jax.make_mesh((8,), ("model",))

    def body(a, w, r):
        return jax.lax.psum_scatter(prepare(a @ w, r), "model", scatter_dimension=dim, tiled=True)

    out = P(None, "model") if dim else P("model", None)
    f = jax.shard_map(body, mesh=mesh, in_specs=(P(None, "model"), P("model", None), P()), out_specs=out,
                      check_vma=False)
    text = jax.jit(f).lower(jax.ShapeDtypeStruct((64, 128), jnp.float32, sharding=NamedSharding(mesh, P(None, "model"))),
                            jax.ShapeDtypeStruct((128, 32), jnp.float32, sharding=NamedSharding(mesh, P("model", None))),
                            jax.ShapeDtypeStruct(extra, jnp.float32)).as_text()
    for variant in ("uni", "bidi-full"):
        result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(variant=variant))
        (site,) = result.report.sites
        assert site.rewritten, site.summary_line()
        outcome = execute.check_numerics(ir_utils.parse(text), result.module)
        assert outcome.ok, outcome.format()


def test_repeated_sites_with_a_per_row_factor_share_a_ring(monkeypatch):
    text = row_factor_program("scale", repeat=3)
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(variant="uni"))
    # the three regions are identical: calls of one rewritten region, its ring inline
    assert len(result.report.rewritten) == 3 and not any(s.shared_ring for s in result.report.rewritten)
    assert [len(calls) for calls in result.report.layers.values()] == [3]
    outcome = execute.check_numerics(ir_utils.parse(text), result.module)
    assert outcome.ok, outcome.format()
    # without replay the second and third regions' sites call the ring function the second built
    monkeypatch.setattr(replay, "MIN_MEMBERS", 10**9)
    alone = cmatmul_pass.rewrite(text, cmatmul_pass.Options(variant="uni"))
    assert [bool(s.shared_ring) for s in alone.report.rewritten] == [False, True, True]
    assert len({s.shared_ring for s in alone.report.rewritten} - {None}) == 1
    outcome = execute.check_numerics(ir_utils.parse(text), alone.module)
    assert outcome.ok, outcome.format()


def weight_reshaped_before_its_dot(x, g, w1, w2, scaled=False):
    """The gathered weight is transposed (for a later dot) before the first dot's other operand
    exists: that operand comes from a cumulative sum, which no ring may move up. ``scaled``: the
    gathered weight is scaled first (a dequantisation's scale), an elementwise op on the way."""
    w = jax.lax.all_gather(w2, "model", axis=0, tiled=True)  # [128, 32]: rows = the dot's contracting dim
    w = w * 0.5 if scaled else w
    wt = w.T  # read by the second dot, which needs the first's result
    h = jnp.cumsum(jnp.tile(x, (1, 4)), axis=1)  # [8, 128]
    y = jnp.tanh(h @ w)
    return y @ wt


@pytest.mark.parametrize("variant,scaled", [("uni", False), ("bidi-full", False), ("uni", True)])
def test_a_layout_op_of_the_gathered_value_follows_the_ring(variant, scaled):
    """A transpose of the gathered weight stood before the first dot's other operand: the ring once
    had no place (it must precede every reader of the assembled value). The transpose only relabels
    the value (a scaling only computes from it and a constant), so it moves after the ring, which
    assembles the weight for it (the remat'd backward of a scanned FSDP layer reshapes its layer's
    weight this way, sample lm_fsdp_tp_scan)."""
    text = lower(lambda *a: weight_reshaped_before_its_dot(*a, scaled=scaled), out_specs=P("model", None))
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(variant=variant))
    (site,) = result.report.sites
    assert site.rewritten, site.summary_line()
    assert site.dim_role == "contracting" and len(site.assembled_for) == 1
    assert not ir_utils.ops_named(result.module, "stablehlo.all_gather")["stablehlo.all_gather"]
    (transpose,) = [op for op in ir_utils.ops_named(result.module, "stablehlo.transpose")["stablehlo.transpose"]
                    if list(ir_utils.ranked_tensor(op.result).shape) == [32, 128]]
    loops = ir_utils.ops_named(result.module, "stablehlo.while")["stablehlo.while"]
    assert all(loop.operation.is_before_in_block(transpose.operation) for loop in loops
               if loop.operation.block == transpose.operation.block)
    outcome = execute.check_numerics(ir_utils.parse(text), result.module)
    assert outcome.ok, outcome.format()


def test_a_layout_op_following_the_ring_through_the_decorator():
    mesh = jax.make_mesh((8,), ("model",))
    f = jax.shard_map(weight_reshaped_before_its_dot, mesh=mesh, in_specs=SPECS, out_specs=P("model", None),
                      check_vma=False)
    rng = np.random.default_rng(0)
    args = [jax.device_put(rng.normal(size=s).astype(np.float32) / 4, NamedSharding(mesh, sp))
            for s, sp in zip(SHAPES, SPECS)]
    ours = cmatmul_pass.jit(f)
    got, want = ours(*args), jax.jit(f)(*args)
    assert [s.rewritten for s in ours.report.sites] == [True]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))


@pytest.mark.parametrize("strategy", ["moved", "split"])
def test_an_op_reading_one_broadcast_twice_moves_with_the_gather(strategy):
    """``clamp(b, h, b)``, one broadcast read twice, between the collective and its dot: the
    carried op and then the broadcast only it read are erased once each (the broadcast was met
    twice, and read again after it was erased: a segfault)."""
    def bounded(h):
        b = jnp.full(h.shape, 0.5, h.dtype)
        return jax.lax.clamp(b, h, b) * h

    if strategy == "moved":
        text = lower(lambda x, g, w1, w2: scattered(jax.nn.gelu(bounded(gathered(x)) @ w1) @ w2))
        options = None
    else:
        text = lower(lambda x, g, w1, w2: bounded(jax.lax.psum(x.T @ x, "model")) @ w1, out_specs=P())
        options = cmatmul_pass.Options(all_reduce="split")
    result = cmatmul_pass.rewrite(text, options)
    assert result.report.rewritten
    outcome = execute.check_numerics(ir_utils.parse(text), result.module)
    assert outcome.ok, outcome.format()
