"""analysis.separable: which ops keep a dim's rows apart (and which add them up), op by op."""

import jax
import jax.numpy as jnp
import pytest

from cmatmul_pass import ir_utils
from cmatmul_pass.analysis import separable


def tracked(fn, *shapes, dim=0):
    """``fn`` lowered; its first argument's ``dim`` tracked through the ops of @main that read it."""
    text = jax.jit(fn).lower(*(jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes)).as_text()
    module = ir_utils.parse(text)
    main = next(f for f in module.body.operations if ir_utils.symbol_name(f) == "main")
    block = main.regions[0].blocks[0]
    reached, frontier = set(), [block.arguments[0]]
    while frontier:
        for use in frontier.pop().uses:
            op = use.owner
            if op.operation.name != "func.return" and op.operation not in reached:
                reached.add(op.operation)
                frontier.extend(op.operation.results)
    ops = [op for op in block.operations if op.operation in reached]
    with module.context:
        return separable.track(block.arguments[0], dim, ops), module


def test_an_expert_ffn_keeps_the_capacity_apart():
    """einsum over the hidden dim (the capacity free), gelu, einsum back: every value's rows
    along the capacity (dim 1) are the input's rows."""
    (steps, dims), _ = tracked(lambda y, w1, w2: jnp.einsum("ecf,efh->ech", jax.nn.gelu(jnp.einsum("ech,ehf->ecf", y, w1)), w2),
                               (2, 8, 4), (2, 4, 16), (2, 16, 4), dim=1)
    assert steps and all(s.out_dim == 1 for s in steps)
    assert not any(s.sums for s in steps)


def test_a_side_operand_is_read_at_the_rows():
    (steps, _), _ = tracked(lambda h, mask: h * mask, (8, 4), (8, 4), dim=0)
    (step,) = steps
    assert step.sides == (None, (separable.SLICE, 0))


@pytest.mark.parametrize("fn, says", [
    (lambda h: h - jnp.mean(h, axis=0), "reduces over the chunked dim 0"),
    (lambda h: h.reshape(-1), "merging or splitting the chunked dim 0"),
    (lambda h: jnp.sort(h, axis=0), "stablehlo.sort"),
    (lambda h: jax.lax.reduce_window(h, 0.0, jax.lax.add, (2, 1), (1, 1), "SAME"), "not an op the rows can go"),
    (lambda h: jax.lax.pad(h, 0.0, [(1, 0, 0), (0, 0, 0)]), "pads the chunked dim 0"),
    (lambda h: jax.lax.pad(h, 0.0, [(0, 0, 1), (0, 0, 0)]), "pads the chunked dim 0"),
])
def test_ops_mixing_the_rows_are_not_separable(fn, says):
    with pytest.raises(separable.NotSeparable, match=says):
        tracked(fn, (8, 4))


def test_a_contraction_over_the_rows_is_a_partial_sum_read_by_nothing_but_linear_ops():
    """x^T·g contracts the rows: each chunk's product adds up (a weight's gradient), also
    through a transpose; read by an add before its last chunk, it is not."""
    (steps, dims), _ = tracked(lambda g, x: (x.T @ g).T, (8, 4), (8, 3), dim=0)
    assert [s.sums for s in steps] == [True, True]
    with pytest.raises(separable.NotSeparable, match="reads a sum over the chunked dim"):
        tracked(lambda g, x: x.T @ g + 1.0, (8, 4), (8, 3), dim=0)


def test_a_pad_of_other_dims_keeps_the_rows_apart():
    """jnp.stack's VJP places each gradient in its stack with a pad of a new leading dim: the
    rows keep their dim, the padding value read whole."""
    (steps, dims), _ = tracked(lambda h: jax.lax.pad(h[None], 0.0, [(1, 1, 0), (0, 0, 0), (2, 0, 1)]), (8, 4), dim=0)
    assert [s.op.operation.name for s in steps] == ["stablehlo.broadcast_in_dim", "stablehlo.pad"]
    assert steps[-1].out_dim == 1 and steps[-1].sides == (None, (separable.WHOLE, 0))


def test_jnp_pad_of_other_dims_keeps_the_rows_apart_but_not_of_the_tracked_one():
    """jnp.pad lowers to a call of @_pad (a pad of its argument by a scalar): looked into like a
    pointwise function, separable where it pads other dims only."""
    (steps, dims), _ = tracked(lambda h: jnp.pad(h, ((0, 0), (1, 2)), constant_values=0.5) * 2.0, (8, 4), dim=0)
    assert steps[0].op.operation.name == "func.call" and steps[0].out_dim == 0 and steps[0].body
    with pytest.raises(separable.NotSeparable, match="padding the chunked dim 0"):
        tracked(lambda h: jnp.pad(h, ((1, 0), (0, 0))), (8, 4), dim=0)
