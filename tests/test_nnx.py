"""Flax NNX's native style under ``cmatmul_pass.nnx_jit``: a train step that takes the model and
the optimizer and updates them in place (``optimizer.update(model, grads)``) trains as it does
under ``nnx.jit``, with the model's shard_map collectives rewritten; and what nnx_jit refuses."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import cmatmul_pass

MESH = jax.make_mesh((8,), ("model",))
HIDDEN, FFN, TOKENS, STEPS = 32, 64, 64, 4


def _sharded(value, spec):
    return jax.device_put(value, NamedSharding(MESH, spec))


def sp_mlp(x, w1, w2):
    """A sequence-parallel MLP on this device's rows: gather them, matmul, gelu, matmul, scatter."""
    h = jax.nn.gelu(jax.lax.all_gather(x, "model", axis=0, tiled=True) @ w1)
    return jax.lax.psum_scatter(h @ w2, "model", scatter_dimension=0, tiled=True)


class Block(nnx.Module):
    """The MLP as an NNX module: its weights are variables holding global, sharded arrays; its
    ``__call__`` runs the shard_map over them."""

    def __init__(self, rngs: nnx.Rngs, count: bool = True):
        self.count = count  # a static attribute: in the graph definition
        self.up = nnx.Param(_sharded(jax.random.normal(rngs.params(), (HIDDEN, FFN)) * 0.2, P(None, "model")))
        self.down = nnx.Param(_sharded(jax.random.normal(rngs.params(), (FFN, HIDDEN)) * 0.2, P("model", None)))
        self.calls = nnx.Variable(jnp.zeros((), jnp.int32))  # state the step updates besides the weights

    def __call__(self, x):
        if self.count:
            self.calls[...] += 1
        layer = jax.shard_map(sp_mlp, mesh=MESH, in_specs=(P("model"), P(None, "model"), P("model", None)),
                              out_specs=P("model"))
        return x + layer(x, self.up[...], self.down[...])


def train_step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    optimizer.update(model, grads)
    return loss


def _data():
    rng = np.random.default_rng(0)
    return [_sharded(rng.normal(size=(TOKENS, HIDDEN)).astype(np.float32), P("model")) for _ in range(2)]


def _train(jit, steps: int = STEPS):
    model = Block(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    step = jit(train_step)
    x, y = _data()
    losses = [float(step(model, optimizer, x, y)) for _ in range(steps)]
    return losses, step, model, optimizer


def test_an_nnx_native_train_step_trains_as_under_nnx_jit():
    """Losses, weights, optimizer state and the step counter equal nnx.jit's after a few steps;
    the forward's and the backward's collectives are rewritten, and checked."""
    base, _, base_model, base_opt = _train(nnx.jit)
    mine, step, model, optimizer = _train(cmatmul_pass.nnx_jit(policy="all", check=True))
    np.testing.assert_allclose(mine, base, rtol=1e-5)
    assert base[-1] < base[0]
    for got, want in zip(jax.tree.leaves(nnx.state((model, optimizer))), jax.tree.leaves(nnx.state((base_model, base_opt)))):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    assert int(model.calls[...]) == STEPS and int(optimizer.step[...]) == STEPS
    assert model.up[...].sharding.spec == P(None, "model")  # the updated weights keep their shardings
    # the forward's gather and scatter, the backward's gather (of the scatter's cotangent; the
    # input's gradient, the forward gather's scatter, is not asked for)
    kinds = sorted(s.kind for s in step.report.rewritten)
    assert kinds == ["all_gather_dot", "all_gather_dot", "dot_reduce_scatter"], step.report.summary()
    # two signatures, as under jax.jit: the first call's step counters live on one device, the
    # counters it returns on the mesh; every later step runs the second's executable
    assert step.stats["compiles"] == 2 and step.stats["checks"] == 2
    assert "collective_permute" in step.lower(model, optimizer, *_data()).as_text()


def test_static_and_donated_arguments():
    """A static argument goes with the graph definition (another value compiles anew); donating
    the model and the optimizer donates their state, not the batch."""
    def step(model, optimizer, x, y, scale):
        loss, grads = nnx.value_and_grad(lambda m: scale * jnp.mean((m(x) - y) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    model = Block(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(1e-2), wrt=nnx.Param)
    jitted = cmatmul_pass.nnx_jit(step, static_argnums=4, donate_argnums=(0, 1), policy="all")
    x, y = _data()
    losses = [float(jitted(model, optimizer, x, y, 1.0)) for _ in range(3)]  # two signatures (see above)
    assert jitted.stats["compiles"] == 2 and losses[2] < losses[0]
    doubled = float(jitted(model, optimizer, x, y, 2.0))
    assert jitted.stats["compiles"] == 3 and 1.5 * losses[2] < doubled < 2 * losses[2]
    assert not x.is_deleted() and not y.is_deleted()  # the batch is not donated
    assert jitted._donation((model, optimizer, x, y, 1.0), {}) == (True, False)


def test_what_nnx_jit_refuses():
    with pytest.raises(TypeError, match="does not take in_shardings"):
        cmatmul_pass.nnx_jit(train_step, in_shardings=None or NamedSharding(MESH, P()))

    def grows(model, x):
        model.extra = nnx.Param(jnp.ones(()))
        return x

    model = Block(nnx.Rngs(0))
    x, _ = _data()
    with pytest.raises(ValueError, match="changed the structure"):
        cmatmul_pass.nnx_jit(grows, policy="all")(model, x)
    with pytest.raises(TypeError, match="returns a graph node"):
        cmatmul_pass.nnx_jit(lambda model, x: model, policy="all")(Block(nnx.Rngs(0)), x)


def test_the_functional_style_split_and_merge_around_a_shard_map():
    """nnx.split outside, nnx.merge inside the jitted function, the state returned: the plain
    cmatmul_pass.jit, as for any pytree of arrays; equal to jax.jit's."""
    model = Block(nnx.Rngs(0), count=False)  # a pure forward: jax.grad traces it
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    x, y = _data()

    def loss(params, rest, x, y):
        return jnp.mean((nnx.merge(graphdef, params, rest)(x) - y) ** 2)

    def sgd(params, rest, x, y):
        value, grads = jax.value_and_grad(loss)(params, rest, x, y)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), value

    results = [jit(sgd)(params, rest, x, y) for jit in (jax.jit, cmatmul_pass.jit(policy="all"))]
    np.testing.assert_allclose(float(results[1][1]), float(results[0][1]), rtol=1e-6)
    for got, want in zip(jax.tree.leaves(results[1][0]), jax.tree.leaves(results[0][0])):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
