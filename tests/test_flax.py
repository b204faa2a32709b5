"""Flax models trained with optax, written as a Flax user writes tensor parallelism: the layers'
``__call__`` holds the explicit collectives and runs inside ``jax.shard_map``; the parameters are
initialised inside it too (each device its own shard), and the train step is jitted once with
``jax.jit`` and once with ``cmatmul_pass.jit``.  The two must train alike, with every gather and
scatter of the forward and the backward rewritten."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import cmatmul_pass

HIDDEN, FFN, TOKENS, LAYERS, STEPS = 32, 64, 64, 2, 8
ROWS = P(("data", "model"), None)  # activations: rows over both mesh axes (sequence parallel)


def _mesh():
    return jax.make_mesh((2, 4), ("data", "model"))


class SPBlock(nn.Module):
    """A pre-norm sequence-parallel MLP block on this device's rows: gather the rows over
    'model', column-parallel up projection, row-parallel down projection, scatter the sum."""

    ffn: int  # this device's share of the hidden units
    parallel: bool = True  # False: the same parameters without collectives (to read their shapes)

    @nn.compact
    def __call__(self, h):
        x = nn.LayerNorm(name="norm")(h)
        if self.parallel:
            x = jax.lax.all_gather(x, "model", axis=0, tiled=True)
        u = nn.gelu(nn.Dense(self.ffn, use_bias=False, name="up")(x))
        y = nn.Dense(h.shape[-1], use_bias=False, name="down")(u)
        if self.parallel:
            y = jax.lax.psum_scatter(y, "model", scatter_dimension=0, tiled=True)
        return h + y


class Model(nn.Module):
    ffn: int
    parallel: bool = True

    @nn.compact
    def __call__(self, h):
        for i in range(LAYERS):
            h = SPBlock(self.ffn, self.parallel, name=f"block{i}")(h)
        return h


def _spec(path, _) -> P:
    """Where each parameter's global array is split: the up projection's columns and the down
    projection's rows over 'model' (tensor parallel), the norms replicated."""
    names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
    if "up" in names:
        return P(None, "model")
    if "down" in names:
        return P("model", None)
    return P()


def _linen(mesh):
    """(init, apply) of the Flax linen model as shard_map'd functions of global arrays."""
    local = Model(FFN // mesh.shape["model"])
    shapes = jax.eval_shape(Model(FFN // mesh.shape["model"], parallel=False).init, jax.random.key(0),
                            jax.ShapeDtypeStruct((TOKENS // mesh.size, HIDDEN), jnp.float32))
    specs = jax.tree_util.tree_map_with_path(_spec, shapes)

    def init_shard(key, x):  # each device its own shard of the projections
        return local.init(jax.random.fold_in(key, jax.lax.axis_index("model")), x)

    init = jax.jit(jax.shard_map(init_shard, mesh=mesh, in_specs=(P(), ROWS), out_specs=specs, check_vma=False))
    apply = jax.shard_map(local.apply, mesh=mesh, in_specs=(specs, ROWS), out_specs=ROWS)
    return init, apply


class NNXBlock(nnx.Module):
    """The same block in Flax NNX."""

    def __init__(self, hidden: int, ffn: int, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(hidden, rngs=rngs)
        self.up = nnx.Linear(hidden, ffn, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(ffn, hidden, use_bias=False, rngs=rngs)

    def __call__(self, h):
        x = jax.lax.all_gather(self.norm(h), "model", axis=0, tiled=True)
        y = self.down(nnx.gelu(self.up(x)))
        return h + jax.lax.psum_scatter(y, "model", scatter_dimension=0, tiled=True)


class NNXModel(nnx.Module):
    def __init__(self, hidden: int, ffn: int, rngs: nnx.Rngs):
        self.blocks = nnx.List([NNXBlock(hidden, ffn, rngs) for _ in range(LAYERS)])

    def __call__(self, h):
        for block in self.blocks:
            h = block(h)
        return h


def _nnx(mesh):
    """(init, apply) of the NNX model: its state split off (nnx.split) and merged back inside the
    shard_map'd function, as NNX code passes a model through a jax transformation."""
    ffn = FFN // mesh.shape["model"]
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: NNXModel(HIDDEN, ffn, nnx.Rngs(0))))
    specs = jax.tree_util.tree_map_with_path(_spec, abstract)

    def init_shard(key, x):
        key = jax.random.fold_in(key, jax.lax.axis_index("model"))
        return nnx.split(NNXModel(HIDDEN, ffn, nnx.Rngs(key)))[1]

    def apply_shard(state, x):
        return nnx.merge(graphdef, state)(x)

    init = jax.jit(jax.shard_map(init_shard, mesh=mesh, in_specs=(P(), ROWS), out_specs=specs, check_vma=False))
    apply = jax.shard_map(apply_shard, mesh=mesh, in_specs=(specs, ROWS), out_specs=ROWS)
    return init, apply


def _train(build, jit, steps: int = STEPS):
    """Train the model ``build`` makes with ``jit`` (jax.jit or cmatmul_pass.jit); returns (the
    losses, the jitted step)."""
    mesh = _mesh()
    init, apply = build(mesh)
    rng = np.random.default_rng(0)
    put = lambda a: jax.device_put(a.astype(np.float32), NamedSharding(mesh, ROWS))  # noqa: E731
    x, target = put(rng.normal(size=(TOKENS, HIDDEN))), put(rng.normal(size=(TOKENS, HIDDEN)))
    params = init(jax.random.key(0), x)
    optimizer = optax.adamw(3e-3, weight_decay=1e-4)
    opt_state = optimizer.init(params)

    def train_step(params, opt_state, x, target):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean((apply(p, x) - target) ** 2))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    step = jit(train_step)
    losses = []
    for _ in range(steps):
        params, opt_state, loss = step(params, opt_state, x, target)
        losses.append(float(loss))
    return losses, step


@pytest.mark.parametrize("build", [_linen, _nnx], ids=["linen", "nnx"])
def test_a_flax_model_trains_alike_under_cmatmul_pass_jit(build):
    base, _ = _train(build, jax.jit)
    mine, step = _train(build, cmatmul_pass.jit)
    np.testing.assert_allclose(mine, base, rtol=1e-5)
    assert base[-1] < 0.8 * base[0]  # it does learn
    sites = step.report.sites
    # per block: the forward's gather and scatter, the backward's gather (of the cotangent, for the
    # down projection's input gradient) and scatter (the norm's input gradient), all rewritten
    for kind in ("all_gather_dot", "dot_reduce_scatter"):
        of_kind = [s for s in sites if s.kind == kind]
        assert len(of_kind) == 2 * LAYERS and all(s.rewritten for s in of_kind), [s.summary_line() for s in of_kind]
    # the psums over the mesh of each block's parameter gradients: the projections' (a matmul's
    # rows summed) are rewritten (the default's strategy; two chunks on this CPU);
    # the norm's scale and bias (sums over the rows of the
    # scattered cotangent, no matmul's rows) stay psums, saying what produced them
    psums = [s for s in sites if s.kind == "dot_all_reduce"]
    assert len(psums) == 4 * LAYERS
    assert sum(s.rewritten for s in psums) == 2 * LAYERS
    for declined in (s for s in psums if not s.rewritten):
        assert declined.reason_code == "producer_not_dot" and "normalization.py" in declined.location


@pytest.mark.parametrize("remat", [False, True], ids=["residual", "remat"])
@pytest.mark.parametrize("norm", [nn.LayerNorm, nn.RMSNorm], ids=["layer", "rms"])
def test_a_flax_norm_over_gathered_features_rings_forward_and_backward(norm, remat):
    """flax's LayerNorm (mean and mean of squares, a clamped variance) and RMSNorm over features
    gathered along them, into a column-parallel projection; value_and_grad of a mean square:
    the forward's gather, the backward's recomputed gather where remat'd, and the input gradient's
    scatter are all rewritten (the norm's sums computed from the shards; its backward's spread
    sums taken out of the scatter); loss and gradients as jax.jit's."""
    mesh = jax.make_mesh((8,), ("model",))
    layer = norm()
    params = layer.init(jax.random.key(0), jnp.ones((4, 64)))

    def body(x, p, w):
        return layer.apply(p, jax.lax.all_gather(x, "model", axis=1, tiled=True)) @ w

    specs = (P(None, "model"), P(), P(None, "model"))
    f = jax.shard_map(jax.checkpoint(body) if remat else body, mesh=mesh, in_specs=specs,
                      out_specs=P(None, "model"), check_vma=False)
    grad = jax.value_and_grad(lambda x, p, w: jnp.mean(f(x, p, w) ** 2), argnums=(0, 1, 2))
    rng = np.random.default_rng(0)
    args = [jax.device_put(rng.normal(size=(32, 64)).astype(np.float32), NamedSharding(mesh, specs[0])),
            jax.tree.map(lambda a: jax.device_put(a + 0.1, NamedSharding(mesh, P())), params),
            jax.device_put(rng.normal(size=(64, 128)).astype(np.float32), NamedSharding(mesh, specs[2]))]
    step = cmatmul_pass.jit(grad)
    for a, b in zip(jax.tree.leaves(step(*args)), jax.tree.leaves(jax.jit(grad)(*args))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6)
    sites = [s for s in step.report.sites if s.kind in ("all_gather_dot", "dot_reduce_scatter")]
    assert len(sites) == (3 if remat else 2) and all(s.rewritten for s in sites), \
        "\n".join(s.summary_line() for s in sites)
