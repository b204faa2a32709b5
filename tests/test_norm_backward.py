"""A norm's backward between the dot and the scatter (the scatter side).

``jax.grad`` of a sequence-parallel layer ``all_gather -> RMS norm / layer norm -> dot`` scatters the
input gradient (``psum_scatter``, the transpose of the gather) after the norm's backward applied to
the cotangent ``dy = g @ w1^T``: ``dx = rs*dy - x*rs^3/n * sum_j(dy*x)`` per row, which reads the
product twice (a DAG, not a chain).  The ring applies that map to every block it computes; these
tests compare the rewritten program with the original on random inputs, in every ring variant,
through the library and ``cmatmul_pass.jit``, and check what must stay declined."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import cmatmul_pass
from cmatmul_pass import execute, ir_utils
from cmatmul_pass._jax_private import ir
from cmatmul_pass.cost import VARIANTS

MESH = jax.make_mesh((8,), ("model",))
SPECS = (P("model", None), P(), P(None, "model"), P("model", None))
SHAPES = [(64, 32), (32,), (32, 128), (128, 32)]


def rms_norm(h, g):
    return h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6) * g


def layer_norm(h, g):
    mean = h.mean(-1, keepdims=True)
    return (h - mean) * jax.lax.rsqrt(((h - mean) ** 2).mean(-1, keepdims=True) + 1e-5) * g


NORMS = {"rms": rms_norm, "layer": layer_norm}


def layer(norm):
    """An SP MLP block with the norm of the gathered rows before the up projection."""
    def body(x, g, w1, w2):
        h = norm(jax.lax.all_gather(x, "model", axis=0, tiled=True), g)
        return jax.lax.psum_scatter(jax.nn.gelu(h @ w1) @ w2, "model", scatter_dimension=0, tiled=True)

    return jax.shard_map(body, mesh=MESH, in_specs=SPECS, out_specs=P("model", None), check_vma=False)


def loss_of(norm):
    f = layer(norm)
    return lambda x, g, w1, w2: jnp.mean(f(x, g, w1, w2) ** 2)


def abstract_args():
    return [jax.ShapeDtypeStruct(s, jnp.float32, sharding=NamedSharding(MESH, sp)) for s, sp in zip(SHAPES, SPECS)]


def concrete_args(seed=0):
    rng = np.random.default_rng(seed)
    return [jax.device_put(rng.normal(size=s).astype(np.float32), NamedSharding(MESH, sp))
            for s, sp in zip(SHAPES, SPECS)]


#: the gain trained (its gradient, a sum over the rows of the product times the normed input, is
#: read beside the scatter: the ring adds up each block's share), or not (left out of argnums)
ARGNUMS = {"trained_gain": (0, 1, 2, 3), "frozen_gain": (0, 2, 3)}


def grad_text(norm, argnums=ARGNUMS["trained_gain"]):
    return jax.jit(jax.value_and_grad(loss_of(norm), argnums=argnums)).lower(*abstract_args()).as_text()


def norm_backward_site(report):
    """The backward's input-gradient scatter: the one whose path holds a reduce."""
    return [s for s in report.sites if s.kind == "dot_reduce_scatter"
            and any("reduce" in c["look_through"] for c in s.consumers)]


@pytest.mark.parametrize("gain", sorted(ARGNUMS))
@pytest.mark.parametrize("norm", sorted(NORMS))
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_the_norm_backward_is_applied_per_block_in_every_variant(norm, variant, gain):
    text = grad_text(NORMS[norm], ARGNUMS[gain])
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(variant=variant))
    scatters = [s for s in result.report.sites if s.kind == "dot_reduce_scatter"]
    assert len(scatters) == 2 and all(s.rewritten for s in scatters), [s.summary_line() for s in scatters]
    (site,) = norm_backward_site(result.report)
    look = site.consumers[0]["look_through"]
    assert look.count("reduce") >= 2 and "broadcast_in_dim" in look, look
    assert not ir_utils.ops_named(result.module, "stablehlo.reduce_scatter")["stablehlo.reduce_scatter"]
    outcome = execute.check_numerics(ir_utils.parse(text), result.module)
    assert outcome.ok, outcome.format()


def test_the_ring_reduces_block_rows_not_the_whole_product():
    """In the ring, the norm backward's sums over the hidden dim run on blocks of 8 rows (of 64),
    and so does the gain gradient's sum over the rows: the loop carries its running total."""
    text = grad_text(rms_norm)
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(variant="uni"))
    # the scatter's loop: the one carrying the gain gradient's total (the forward's gather ring
    # normalises its blocks too: tests/test_gather_norm_ring.py)
    (loop,) = [w for w in ir_utils.ops_named(result.module, "stablehlo.while")["stablehlo.while"]
               if "tensor<32xf32>" in [str(t) for t in w.operation.results.types]]
    reduces = ir_utils.ops_named(loop, "stablehlo.reduce")["stablehlo.reduce"]
    shapes = {tuple(ir_utils.ranked_tensor(r.operation.operands[0]).shape) for r in reduces}
    assert shapes and all(shape[0] == 8 for shape in shapes), shapes
    over_rows = [r for r in reduces if 0 in list(ir.DenseI64ArrayAttr(r.attributes["dimensions"]))]
    assert len(over_rows) == 1  # the gain's gradient: this block's share of the sum over the rows
    assert [str(t) for t in loop.operation.results.types].count("tensor<32xf32>") == 1  # its running total
    # the original sums the whole product over the rows, the rewrite never materialises it
    assert not [r for r in ir_utils.ops_named(result.module, "stablehlo.reduce")["stablehlo.reduce"]
                if list(ir_utils.ranked_tensor(r.operation.operands[0]).shape) == [64, 32]
                and list(ir.DenseI64ArrayAttr(r.attributes["dimensions"])) == [0]]
    module = ir_utils.parse(text)  # kept alive while its ops are read
    original = ir_utils.ops_named(module, "stablehlo.reduce")["stablehlo.reduce"]
    assert [r for r in original if list(ir_utils.ranked_tensor(r.operation.operands[0]).shape) == [64, 32]
            and list(ir.DenseI64ArrayAttr(r.attributes["dimensions"])) == [0]]


@pytest.mark.parametrize("gain", sorted(ARGNUMS))
@pytest.mark.parametrize("norm", sorted(NORMS))
def test_jit_of_the_grad_matches_jax_jit(norm, gain):
    grad_fn = jax.value_and_grad(loss_of(NORMS[norm]), argnums=ARGNUMS[gain])
    step = cmatmul_pass.jit(grad_fn, check=True)
    args = concrete_args()
    value, grads = step(*args)
    want_value, want_grads = jax.jit(grad_fn)(*args)
    np.testing.assert_allclose(float(value), float(want_value), rtol=1e-5)
    for got, want in zip(grads, want_grads):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-6)
    assert len(norm_backward_site(step.report)) == 1 and all(
        s.rewritten for s in step.report.sites if s.kind == "dot_reduce_scatter")


def residual_block(x, g, w1, w2):
    """A pre-RMS-norm SP MLP block with its residual add (the layer's input shard)."""
    return x + layer(rms_norm)(x, g, w1, w2)


@pytest.mark.parametrize("shape", ["stack", "scan_remat"])
def test_layers_of_norm_backwards(shape):
    """Three residual blocks in a row, or a scan over three stacked layers under jax.checkpoint (the
    backward inside the loop body): every scatter rewritten, the numbers those of the original."""
    x, g, w1, w2 = abstract_args()
    if shape == "stack":
        def loss(x, layers):
            for weights in layers:
                x = residual_block(x, *weights)
            return jnp.mean(x ** 2)

        args = (x, [(g, w1, w2)] * 3)
    else:
        def loss(x, layers):
            def step(h, weights):
                return jax.checkpoint(residual_block)(h, *weights), None

            return jnp.mean(jax.lax.scan(step, x, layers)[0] ** 2)

        stacked = [jax.ShapeDtypeStruct((3, *t.shape), t.dtype, sharding=NamedSharding(MESH, P(None, *spec)))
                   for t, spec in zip((g, w1, w2), SPECS[1:])]
        args = (x, tuple(stacked))
    text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(*args).as_text()
    result = cmatmul_pass.rewrite(text)
    scatters = [s for s in result.report.sites if s.kind == "dot_reduce_scatter"]
    assert len(scatters) == (6 if shape == "stack" else 2) and all(s.rewritten for s in scatters), (
        [s.summary_line() for s in scatters])
    assert len(norm_backward_site(result.report)) == len(scatters) // 2
    assert not ir_utils.ops_named(result.module, "stablehlo.reduce_scatter")["stablehlo.reduce_scatter"]
    outcome = execute.check_numerics(ir_utils.parse(text), result.module)
    assert outcome.ok, outcome.format()


def layer_norm_with_bias(h, g, b):
    mean = h.mean(-1, keepdims=True)
    return (h - mean) * jax.lax.rsqrt(((h - mean) ** 2).mean(-1, keepdims=True) + 1e-5) * g + b


def rms_norm_f32_statistics(h, g, b):
    """As models write it in bf16: the mean square in f32, the normed rows cast back."""
    return (h * jax.lax.rsqrt(jnp.mean(h.astype(jnp.float32) ** 2, -1, keepdims=True) + 1e-6)).astype(h.dtype) * g


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("mlp", ["gelu", "swiglu"])
@pytest.mark.parametrize("norm", [layer_norm_with_bias, rms_norm_f32_statistics], ids=["ln_bias", "rms_f32"])
def test_model_shaped_layers(norm, mlp, dtype):
    """A layer norm with a trained bias too (its gradient a second sum over the rows), an RMS norm
    whose statistics are taken in f32 (casts on the way), SwiGLU (gate and up: two dots' input
    gradients summed before the norm's backward), bf16 weights accumulating in f32."""
    def body(x, g, b, w1, w3, w2):
        h = norm(jax.lax.all_gather(x, "model", axis=0, tiled=True), g, b)
        a = jnp.dot(h, w1, preferred_element_type=jnp.float32)
        a = jax.nn.silu(a) * jnp.dot(h, w3, preferred_element_type=jnp.float32) if mlp == "swiglu" else jax.nn.gelu(a)
        y = jnp.dot(a.astype(dtype), w2, preferred_element_type=jnp.float32)
        return jax.lax.psum_scatter(y, "model", scatter_dimension=0, tiled=True)

    specs = (P("model", None), P(), P(), P(None, "model"), P(None, "model"), P("model", None))
    f = jax.shard_map(body, mesh=MESH, in_specs=specs, out_specs=P("model", None), check_vma=False)
    shapes = [(64, 32), (32,), (32,), (32, 128), (32, 128), (128, 32)]
    args = [jax.ShapeDtypeStruct(s, dtype, sharding=NamedSharding(MESH, sp)) for s, sp in zip(shapes, specs)]
    text = jax.jit(jax.value_and_grad(lambda *a: jnp.mean(f(*a) ** 2), argnums=tuple(range(6)))).lower(*args).as_text()
    result = cmatmul_pass.rewrite(text)
    scatters = [s for s in result.report.sites if s.kind == "dot_reduce_scatter"]
    assert len(scatters) == 2 and all(s.rewritten for s in scatters), [s.summary_line() for s in scatters]
    assert len(norm_backward_site(result.report)) == 1
    outcome = execute.check_numerics(ir_utils.parse(text), result.module)
    assert outcome.ok, outcome.format()


# ---------------------------------------------------------------- what stays declined
def scatter_program(prepare, beside=False):
    """``psum_scatter(prepare(x @ w, r))`` of a row-parallel dot; ``r``: a per-row value.  ``beside``:
    ``prepare`` returns the scattered value and another, returned as it is (each device's own)."""
    def body(x, w, r):
        if beside:
            scattered, other = prepare(x @ w, r)
            return jax.lax.psum_scatter(scattered, "model", scatter_dimension=0, tiled=True), other[None]
        return jax.lax.psum_scatter(prepare(x @ w, r), "model", scatter_dimension=0, tiled=True)

    out_specs = (P("model"), P("model")) if beside else P("model")
    f = jax.shard_map(body, mesh=MESH, in_specs=(P(None, "model"), P("model", None), P()), out_specs=out_specs,
                      check_vma=False)
    args = [jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(MESH, spec))
            for shape, spec in [((64, 64), P(None, "model")), ((64, 32), P("model")), ((64,), P())]]
    return jax.jit(f).lower(*args).as_text()


def norm_backward(dy, x):
    """An RMS norm's backward applied to ``dy`` (the map jax's transpose builds), with ``x`` a row
    statistic's source."""
    rs = jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)
    return rs * dy - x * rs ** 3 / x.shape[-1] * jnp.sum(dy * x, axis=-1, keepdims=True)


@pytest.mark.parametrize("variant", ["uni", "bidi-unroll2", "full"])
def test_a_hand_written_norm_backward_of_a_row_parallel_product(variant):
    """The map itself, written by hand on the product of a row-parallel dot, with a per-row
    operand (a [64] vector spread over the columns) as the statistic's source."""
    text = scatter_program(lambda y, r: norm_backward(y, jnp.broadcast_to(r[:, None], y.shape) + 1.0))
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(variant=variant))
    (site,) = result.report.sites
    assert site.rewritten, site.summary_line()
    outcome = execute.check_numerics(ir_utils.parse(text), result.module)
    assert outcome.ok, outcome.format()


@pytest.mark.parametrize("variant", ["uni", "bidi", "full"])
def test_a_sum_over_the_scattered_rows_spread_back_is_summed_after_the_ring(variant):
    """``y - mean_rows(y)`` scattered along the rows: no block of the product gives the mean, but the
    scatter of it is the mean of the summed product, so the mean's sum is all_reduced after the
    ring and subtracted from the device's own block (:mod:`cmatmul_pass.rewrites.statistic_terms`)."""
    text = scatter_program(lambda y, r: y - jnp.mean(y, axis=0, keepdims=True))
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(variant=variant))
    (site,) = result.report.sites
    assert site.rewritten and site.moved_from == "producer_not_dot", site.summary_line()
    assert "all_reduced after the scatter" in site.notes[0], site.notes
    found = ir_utils.ops_named(result.module, "stablehlo.all_reduce", "stablehlo.reduce_scatter")
    assert not found["stablehlo.reduce_scatter"]
    assert [list(ir_utils.ranked_tensor(op.result).shape) for op in found["stablehlo.all_reduce"]] == [[32]]
    outcome = execute.check_numerics(ir_utils.parse(text), result.module)
    assert outcome.ok, outcome.format()


@pytest.mark.parametrize("prepare, code, says", [
    # a sum over the scattered rows spread back with a constant added: counted once per device
    (lambda y, r: y - (jnp.mean(y, axis=0, keepdims=True) + 1.0), "producer_not_dot",
     "which adds a value the same on every device to a sum over the scattered dim"),
    # spread back and scaled by a value that differs between devices
    (lambda y, r: y - jnp.mean(y, axis=0, keepdims=True) * (jnp.ones_like(y) + jax.lax.axis_index("model")),
     "producer_not_dot", "which may differ between devices: the scatter's sum of the devices' terms"),
    # a statistic that is no sum (a max over the scattered rows), spread back
    (lambda y, r: y - jnp.max(y, axis=0, keepdims=True), "producer_not_dot",
     "not linear in sums over the scattered dim"),
    # spread back through a product of two sums: not linear in them
    (lambda y, r: y - jnp.mean(y, axis=0, keepdims=True) * jnp.sum(y, axis=0, keepdims=True), "producer_not_dot",
     "a product of two values that may differ between devices"),
    # not linear in the product: left as written, the message naming what reads the product twice
    (lambda y, r: y * jnp.sum(y, axis=-1, keepdims=True), "producer_not_dot", "nor are the ops from the dot to the scatter linear in the product"),
    # an op no block gives, on the way from a norm's backward (which alone the ring would apply)
    (lambda y, r: jnp.cumsum(norm_backward(y, jnp.broadcast_to(r[:, None], y.shape) + 1.0), axis=0),
     "producer_not_dot", "(@cumsum, stablehlo.reduce_window inside), which the ring cannot apply block by block"),
    # a sum from a nonzero start is affine, not linear
    (lambda y, r: y + jnp.sum(y, axis=-1, keepdims=True) * 0 + jax.lax.reduce(
        y, 1.0, jax.lax.add, (1,))[:, None], "producer_not_dot", "not a sum from zero"),
])
def test_what_the_ring_cannot_apply_per_block_stays_declined(prepare, code, says):
    text = scatter_program(prepare)
    result = cmatmul_pass.rewrite(text)
    (site,) = result.report.sites
    assert not site.rewritten and site.reason_code == code, site.summary_line()
    assert says in site.reason, site.reason
    assert result.text == ir_utils.print_module(ir_utils.parse(text))


# ---------------------------------------------------------------- the fuzzer's programs
@pytest.mark.parametrize("spec", [
    # a sum of two products scaled, in a partially manual region (sharding constraints on the way),
    # untiled (a reshape after the norm), bf16, the scatter on the rhs side's free dim with a batch dim
    dict(mesh_shape=(2, 4), devices=(3, 1, 0, 2, 7, 5, 4, 6), axes=("y",), dim="n", side=1, batch=True, tiled=False,
         dtype="bf16", consumers=2, partial_manual=True, sizes=(2, 3, 4, 2), scale=True),
    # twice in a row (the second call's rings shared), a ring of 7, the batch dim scattered
    dict(mesh_shape=(7,), devices=(1, 2, 4, 5, 7, 0, 3), axes=("x",), dim="b", side=1, batch=True, tiled=False,
         dtype="f32", consumers=1, partial_manual=False, sizes=(2, 4, 4, 2), repeat=2),
    # the norm over the scattered dim (spread sums taken out), a sum of two products in a partially
    # manual region, bf16, its gain's gradient (a sum over the other dims) put together block by block
    dict(mesh_shape=(2, 4), devices=(3, 1, 0, 2, 7, 5, 4, 6), axes=("y",), dim="n", side=1, batch=True, tiled=True,
         dtype="bf16", consumers=2, partial_manual=True, sizes=(2, 3, 4, 2), scale=True, spread=True),
    # the same twice in a row on a ring of 7, the batch dim scattered, the gain frozen
    dict(mesh_shape=(7,), devices=(1, 2, 4, 5, 7, 0, 3), axes=("x",), dim="b", side=0, batch=True, tiled=True,
         dtype="f32", consumers=1, partial_manual=False, sizes=(2, 4, 4, 2), repeat=2, spread=True, gain=False),
])
def test_fuzz_programs_with_a_norm_backward_before_the_scatter(spec):
    from tools import fuzz_programs

    spec = fuzz_programs.Spec(kind="rs", reader=False, norm=True, **spec)
    tally = fuzz_programs.check(spec)
    assert not tally.crashes, tally.crashes
    assert not tally.mismatches, tally.mismatches
    assert tally.sites_rewritten == spec.repeat * len(fuzz_programs.VARIANTS)


@pytest.mark.parametrize("variant", ["uni", "bidi-full"])
def test_a_sum_over_the_rows_beside_the_scatter_is_added_up_block_by_block(variant):
    """The product read beside the scatter by a sum over the scattered rows (as a gain's gradient
    reads it): the ring adds up each block's share; each device's sum is the original's."""
    text = scatter_program(lambda y, r: (y * r[:, None], jnp.sum(y * 3.0, axis=0)), beside=True)
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(variant=variant))
    (site,) = result.report.sites
    assert site.rewritten, site.summary_line()
    assert not [r for r in ir_utils.ops_named(result.module, "stablehlo.reduce")["stablehlo.reduce"]
                if list(ir_utils.ranked_tensor(r.operation.operands[0]).shape) == [64, 32]]
    outcome = execute.check_numerics(ir_utils.parse(text), result.module)
    assert outcome.ok, outcome.format()


@pytest.mark.parametrize("beside, says", [
    # a max over the rows is no sum the ring could add up block by block
    (lambda y: jnp.max(y, axis=0), "other than by a sum from zero"),
    # a running sum over the rows needs them all, in order
    (lambda y: jnp.cumsum(y, axis=0), "the full unscattered product is needed elsewhere"),
])
def test_the_product_needed_whole_beside_the_scatter_stays_declined(beside, says):
    text = scatter_program(lambda y, r: (y * 2.0, beside(y)), beside=True)
    result = cmatmul_pass.rewrite(text)
    (site,) = result.report.sites
    assert not site.rewritten and site.reason_code == "multiple_users", site.summary_line()
    assert says in site.reason, site.reason
    assert result.text == ir_utils.print_module(ir_utils.parse(text))


@pytest.mark.parametrize("variant", ["uni", "bidi-unroll2"])
def test_a_sum_over_other_dims_beside_the_scatter_is_put_together_block_by_block(variant):
    """A sum over the columns read beside a row scatter keeps the rows: each block the ring
    computes gives that block of it, put in its place (the device's own product's, returned)."""
    text = scatter_program(lambda y, r: (y * 2.0, jnp.sum(y, axis=1)), beside=True)
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(variant=variant))
    (site,) = result.report.sites
    assert site.rewritten, site.summary_line()
    outcome = execute.check_numerics(ir_utils.parse(text), result.module)
    assert outcome.ok, outcome.format()
