"""A zero padding between a matmul and its scatter (a sequence that does not divide the devices,
padded before the sum-scatter) moves onto the matmul's operand: pad(a·b, 0) = select(m, pad(a, 0)·b, 0),
and the scatter rings there.  Each precondition has a program that breaks it (left as written)
beside its legal twin (rewritten), and every rewritten program is compared with the original."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import cmatmul_pass
from cmatmul_pass import execute, ir_utils
from conftest import assert_same_numbers

MESH = jax.make_mesh((8,), ("model",))
IN_SPECS = (P(None, "model"), P("model", None))
MOVED = "moved onto the matmul's operand"


def scattered(y, dim=0):
    return jax.lax.psum_scatter(y, "model", scatter_dimension=dim, tiled=True)


def program(body, x_shape=(60, 64), w_shape=(64, 32), dtype=jnp.float32, out_specs=P("model", None),
            in_specs=IN_SPECS):
    f = jax.shard_map(body, mesh=MESH, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    args = [jax.ShapeDtypeStruct(s, dtype, sharding=NamedSharding(MESH, sp))
            for s, sp in zip((x_shape, w_shape), in_specs)]
    return jax.jit(f).lower(*args).as_text()


def padded_rows(value=0.0, rows=4):
    return lambda x, w: scattered(jnp.pad(x @ w, ((0, rows), (0, 0)), constant_values=value))


def scatter_site(result):
    (site,) = [s for s in result.report.sites if s.kind == "dot_reduce_scatter"]
    return site


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32])
@pytest.mark.parametrize("variant", ["uni", "unroll2", "bidi-full"])
def test_the_padding_moves_onto_the_operand_and_the_scatter_rings(variant, dtype):
    text = program(padded_rows(), dtype=dtype)
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(variant=variant))
    site = scatter_site(result)
    assert site.rewritten and site.moved_from == "producer_not_dot", site.summary_line()
    assert MOVED in site.notes[0], site.notes
    found = ir_utils.ops_named(result.module, "stablehlo.reduce_scatter", "stablehlo.pad", "func.func")
    assert not found["stablehlo.reduce_scatter"]
    (pad,) = found["stablehlo.pad"]  # on the lhs shard, not on the product
    assert list(ir_utils.ranked_tensor(pad.operation.operands[0]).shape) == [60, 8]
    assert [ir_utils.symbol_name(f) for f in found["func.func"]] == ["main"]  # @_pad called nowhere now: gone
    assert_same_numbers(text, result)


@pytest.mark.parametrize("pads, dim", [
    (((0, 0), (2, 6)), 1),  # the rhs's free dim, scattered
    (((1, 3), (0, 0)), 0),  # padded before and after
    (((0, 4), (3, 5)), 0),  # both dims: both operands padded, one mask over both
])
def test_padding_of_either_operands_free_dims_moves(pads, dim):
    text = program(lambda x, w: scattered(jnp.pad(x @ w, pads), dim),
                   out_specs=P("model", None) if dim == 0 else P(None, "model"))
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(variant="uni"))
    site = scatter_site(result)
    assert site.rewritten and MOVED in site.notes[0], site.summary_line()
    assert_same_numbers(text, result)


def test_the_pad_rows_stay_exactly_zero_where_the_weight_is_not_finite():
    """0 * inf is NaN: a padded operand alone would put NaN in the pad rows where the original has
    zeros; the mask keeps them zero."""
    text = program(padded_rows())
    original = ir_utils.parse(text)
    rewritten = cmatmul_pass.rewrite(text, cmatmul_pass.Options(variant="uni")).module
    x, w = execute.random_inputs(original, 0)
    w[3, 5], w[40, 7] = np.inf, np.nan
    devices = execute.cpu_devices(8)
    (want,), (got,) = (execute.run(m, [x, w], devices) for m in (original, rewritten))
    want, got = np.concatenate(want), np.concatenate(got)
    assert np.all(want[60:] == 0) and np.array_equal(want[60:], got[60:])
    np.testing.assert_array_equal(np.isnan(want), np.isnan(got))


@pytest.mark.parametrize("body, why", [
    (padded_rows(value=1.0), "not a zero constant"),
    (lambda x, w: scattered(jax.lax.pad(x @ w, jnp.float32(0), [(0, 12, 0), (0, 0, 0)])[8:]), "stablehlo.slice"),
    (lambda x, w: scattered(jax.lax.pad(x @ w, jnp.float32(0), [(-4, 8, 0), (0, 0, 0)])), "crops"),
    (lambda x, w: scattered(jax.lax.pad(x @ w, jnp.float32(0), [(0, 1, 1), (0, 0, 0)])), "between elements"),
])
def test_what_is_no_zero_padding_at_the_product_stays(body, why):
    """Padding with ones, a slice after the pad, a crop, interior padding: the scatter stays as written."""
    text = program(body)
    site = scatter_site(cmatmul_pass.rewrite(text))
    assert not site.rewritten and site.reason_code == "producer_not_dot", site.summary_line()
    assert why in site.reason, site.reason


def test_a_padded_batch_dim_stays():
    """The batch dim of a batched matmul comes from both operands: no one operand to pad."""
    def body(x, w):
        y = jnp.einsum("bsk,bkn->bsn", x, w)
        return scattered(jnp.pad(y, ((0, 4), (0, 0), (0, 0))))

    specs = (P(None, None, "model"), P(None, "model", None))
    text = program(body, (4, 16, 64), (4, 64, 32), out_specs=P("model", None, None), in_specs=specs)
    site = scatter_site(cmatmul_pass.rewrite(text))
    assert not site.rewritten and "batch dim" in site.reason, site.summary_line()


@pytest.mark.parametrize("read_twice", ["product", "padded"])
def test_a_product_read_elsewhere_stays(read_twice):
    def body(x, w):
        y = x @ w
        padded = jnp.pad(y, ((0, 4), (0, 0)))
        other = y if read_twice == "product" else padded
        return scattered(padded), jnp.sum(other, axis=0, keepdims=True)

    text = program(body, out_specs=(P("model", None), P("model", None)))
    site = scatter_site(cmatmul_pass.rewrite(text))
    assert not site.rewritten, site.summary_line()


def test_under_policy_auto_a_ring_that_does_not_pay_leaves_the_pad_where_it_was():
    """The motion is made only for a ring: where the cost model declines it, the program is the input."""
    text = program(padded_rows())
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(policy="auto"))
    site = scatter_site(result)
    assert not site.rewritten and site.reason_code == "producer_not_dot", site.summary_line()
    assert "its zero padding not moved onto the matmul's operand: where it would go, no ring formed" in site.reason
    assert site.reason.count("[policy]") == 1, site.reason
    assert not result.changed
    assert ir_utils.ops_named(result.module, "stablehlo.reduce_scatter")["stablehlo.reduce_scatter"]


# ---------------------------------------------------------------------------- the backward's crop
def gathered(dy):
    return jax.lax.all_gather(dy, "model", axis=0, tiled=True)


CROPS = {
    "pad": lambda g: jax.lax.pad(g, jnp.zeros((), g.dtype), [(0, -4, 0), (0, 0, 0)]),  # the padding's transpose
    "slice": lambda g: g[2:62],
    "call": lambda g: jax.jit(lambda v: v[1:61])(g),  # a nested jit: a call of a private function
}
#: dy's rows sharded, x replicated rows with features sharded, w the layer's weight shard
BACKWARD_SPECS = (P("model", None), P(None, "model"), P("model", None))


def backward(crop, readers=("dx", "dw")):
    def body(dy, x, w):
        c = crop(gathered(dy))
        out = {"dx": lambda: c @ w.T, "dw": lambda: x.T @ c}
        return tuple(out[r]() for r in readers)

    return body


def backward_program(body, dtype=jnp.float32, out_specs=(P(None, "model"), P("model", None))):
    f = jax.shard_map(body, mesh=MESH, in_specs=BACKWARD_SPECS, out_specs=out_specs, check_vma=False)
    shapes = ((64, 32), (60, 64), (64, 32))
    args = [jax.ShapeDtypeStruct(s, dtype, sharding=NamedSharding(MESH, sp)) for s, sp in zip(shapes, BACKWARD_SPECS)]
    return jax.jit(f).lower(*args).as_text()


def gather_site(result):
    (site,) = [s for s in result.report.sites if s.kind == "all_gather_dot"]
    return site


UNCROPPED = "moved past its matmuls"


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32])
@pytest.mark.parametrize("variant", ["uni", "unroll2", "bidi-full"])
@pytest.mark.parametrize("crop", sorted(CROPS))
def test_the_crop_moves_past_the_backward_matmuls_and_the_gather_rings(crop, variant, dtype):
    text = backward_program(backward(CROPS[crop]), dtype)
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(variant=variant))
    site = gather_site(result)
    assert site.rewritten and site.moved_from == "user_not_dot", site.summary_line()
    assert UNCROPPED in site.notes[0] and "zeroed before the gather" in site.notes[0], site.notes
    found = ir_utils.ops_named(result.module, "stablehlo.all_gather", "func.func")
    assert not found["stablehlo.all_gather"]
    assert [ir_utils.symbol_name(f) for f in found["func.func"]] == ["main"]
    assert_same_numbers(text, result)


@pytest.mark.parametrize("crop", sorted(CROPS))
def test_under_policy_auto_a_gather_ring_that_does_not_pay_leaves_the_crop_where_it_was(crop):
    """The crop moves only for a ring: where the cost model declines it, the program is the input
    (the contracting reader's padded operand, built for the moved dots, gone with them)."""
    text = backward_program(backward(CROPS[crop]))
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(policy="auto"))
    site = gather_site(result)
    assert not site.rewritten and "[policy]" in site.reason, site.summary_line()
    assert not result.changed
    result.module.operation.verify()


@pytest.mark.parametrize("readers", [("dx", "dw"), ("dw", "dx"), ("dw",)])
def test_the_moved_crop_verifies_before_any_ring(readers):
    """The motion alone (no ring built after it, as where the cost model then declines the gather's
    ring at a large shape) leaves IR that verifies: each new dot's operands come before it."""
    from cmatmul_pass.matchers import ModuleInfo
    from cmatmul_pass.matchers.common import collective_ring
    from cmatmul_pass.rewrites.pad_motion import cropped_gather, move_crop

    out_specs = tuple(P(None, "model") if r == "dx" else P("model", None) for r in readers)
    module = ir_utils.parse(backward_program(backward(CROPS["slice"], readers), out_specs=out_specs))
    (ag,) = ir_utils.ops_named(module, "stablehlo.all_gather")["stablehlo.all_gather"]
    plan = cropped_gather(ag)
    with module.context, ag.location:
        ring, region = collective_ring(ag, ModuleInfo.of(module))
        move_crop(plan, ring, region, {})
    module.operation.verify()
    assert not ir_utils.ops_named(module, "stablehlo.slice")["stablehlo.slice"] or "dx" in readers


def test_a_crop_read_only_by_free_dims_needs_no_mask():
    text = backward_program(backward(CROPS["pad"], ("dx",)), out_specs=P(None, "model"))
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(variant="uni"))
    site = gather_site(result)
    assert site.rewritten and UNCROPPED in site.notes[0] and "zeroed" not in site.notes[0], site.notes
    assert not ir_utils.ops_named(result.module, "stablehlo.select")["stablehlo.select"]
    assert_same_numbers(text, result)


def test_the_cropped_rows_cannot_poison_the_contraction():
    """An inf in a cropped row of the cotangent: the original never reads it; the moved crop
    contracts that row with a zero of the padded operand, so the row is zeroed first (0 * inf is NaN)."""
    text = backward_program(backward(CROPS["slice"]))
    original = ir_utils.parse(text)
    rewritten = cmatmul_pass.rewrite(text, cmatmul_pass.Options(variant="uni")).module
    dy, x, w = execute.random_inputs(original, 0)
    dy[0, 3], dy[63, 7], dy[62, 0] = np.inf, np.nan, -np.inf  # rows 0, 62, 63 are cropped (rows 2..61 kept)
    devices = execute.cpu_devices(8)
    want, got = (execute.run(m, [dy, x, w], devices) for m in (original, rewritten))
    for a, b in zip(want, got):
        assert np.all(np.isfinite(np.concatenate(a))) and np.all(np.isfinite(np.concatenate(b)))
        np.testing.assert_allclose(np.concatenate(b), np.concatenate(a), rtol=1e-4, atol=1e-4)


def cropped_and(other):
    def body(dy, x, w):
        g = gathered(dy)
        c = CROPS["pad"](g)
        return c @ w.T, other(g, c)

    return body


@pytest.mark.parametrize("other, why", [
    (lambda g, c: c, "not only as one operand of matmuls"),  # the cropped rows returned too
    (lambda g, c: g[:, :1] * 2, None),  # the gathered rows read beside the crop
    (lambda g, c: jnp.einsum("sd,sd->sd", c, c)[:, :1], "not only as one operand"),  # both operands of one dot
    (lambda g, c: jnp.einsum("sd,sk->sdk", c, jnp.ones((60, 8), c.dtype))[:, :1, 0], "as a batch dim"),
])
def test_a_crop_read_elsewhere_stays(other, why):
    """The cropped or gathered rows read by more than matmuls (each reading them once): the gather stays."""
    text = backward_program(cropped_and(other), out_specs=(P(None, "model"), P()))
    site = gather_site(cmatmul_pass.rewrite(text))
    assert not site.rewritten, site.summary_line()
    if why:
        assert why in site.reason, site.reason


def test_training_parity_with_the_backward_crop_through_the_decorator():
    """value_and_grad over the padded layer: the forward's scatter and the backward's gather (its
    crop moved past dx's and dw's matmuls) both ring; loss and gradients as jax.jit's."""
    f = jax.shard_map(padded_rows(), mesh=MESH, in_specs=IN_SPECS, out_specs=P("model", None), check_vma=False)

    def loss(x, w):
        return jnp.mean(jnp.tanh(f(x, w)) ** 2)

    rng = np.random.default_rng(1)
    args = [jax.device_put(rng.normal(size=s).astype(np.float32), NamedSharding(MESH, sp))
            for s, sp in zip(((60, 64), (64, 32)), IN_SPECS)]
    step = cmatmul_pass.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    mine, base = step(*args), jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(*args)
    for a, b in zip(jax.tree.leaves(mine), jax.tree.leaves(base)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6)
    notes = {s.kind: s.notes for s in step.report.sites if s.rewritten}
    assert MOVED in notes["dot_reduce_scatter"][0] and UNCROPPED in notes["all_gather_dot"][0], notes


# ---------------------------------------------------------------------------- in a scanned, remat'd layer
def scanned_layer_step(pad_value=None):
    """value_and_grad over a scan of 2 remat'd layers, each padding its product to 64 rows before a
    psum_scatter and gathering the sum back, cropped to 60 rows, onto the residual.  jax hoists the
    pad's zero out of the loop and passes it through the scan's and remat's functions; ``pad_value``:
    pad with the loop's carried value instead, one more each trip (0 on the first)."""
    def layer(x, w1, w2, value):
        h = jax.nn.gelu(x @ w1)
        y = jnp.pad(h @ w2, ((0, 4), (0, 0)), constant_values=0.0 if value is None else value)
        full = gathered(scattered(y))[:60]
        return x + full

    def model(x, w1s, w2s):
        def step(carry, ws):
            x, value = carry
            return (jax.checkpoint(layer)(x, *ws, None if pad_value is None else value), value + 1), None
        (x, _), _ = jax.lax.scan(step, (x, jnp.float32(0)), (w1s, w2s))
        return x

    specs = (P(), P(None, None, "model"), P(None, "model", None))
    f = jax.shard_map(model, mesh=MESH, in_specs=specs, out_specs=P(), check_vma=False)
    loss = jax.value_and_grad(lambda x, a, b: jnp.mean(f(x, a, b) ** 2), argnums=(1, 2))
    args = [jax.ShapeDtypeStruct(s, jnp.float32, sharding=NamedSharding(MESH, sp))
            for s, sp in zip(((60, 64), (2, 64, 128), (2, 128, 64)), specs)]
    return jax.jit(loss).lower(*args).as_text()


def test_in_a_scanned_remat_layer_the_zero_is_traced_through_the_loop_and_both_motions_ring():
    """The forward's scatter (its pad's zero reached through remat's function, the scan's function and
    the loop's unchanged carry) and the backward's gather (its crop moved past dx's and dw's matmuls)
    ring; the gathers onto the residual and the backward's padded cotangent (no matmul) stay."""
    text = scanned_layer_step()
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(variant="uni"))
    moved = sorted((s.kind, s.rewritten) for s in result.report.sites)
    assert moved == [("all_gather_dot", False), ("all_gather_dot", True),
                     ("dot_reduce_scatter", False), ("dot_reduce_scatter", True)], \
        "\n".join(s.summary_line() for s in result.report.sites)
    assert_same_numbers(text, result)


def test_a_pad_value_a_loop_changes_is_no_zero():
    """The pad's value carried by the loop and changed every trip (0 only on the first): not moved."""
    text = scanned_layer_step(pad_value=True)
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(variant="uni"))
    forward = [s for s in result.report.sites if s.kind == "dot_reduce_scatter" and "not a zero constant" in s.reason]
    assert forward and not any(s.rewritten for s in result.report.sites if s.kind == "dot_reduce_scatter"), \
        "\n".join(s.summary_line() for s in result.report.sites)
    assert_same_numbers(text, result)
