"""cmatmul_pass.jit in place of jax.jit: composed with grad, vmap, scan, remat,
eval_shape and an enclosing jit it runs, equals plain JAX, and the enclosing program's lowering
keeps the rings; the jax.jit surface (trace, eval_shape, statics, donation, shardings, keys,
float0, None leaves, 0-d outputs); the original program where the pass or XLA fails.

The programs are shard_map layers in the style of JAX's own shard_map tests: a column-parallel
gather then matmul, a row-parallel matmul then scatter, a Megatron MLP (psum after the second
matmul), a two-layer sequence-parallel block."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import cmatmul_pass
from cmatmul_pass import decorator, ir_utils, transform
from cmatmul_pass._jax_private import ir
from cmatmul_pass.errors import InternalError

MESH = jax.make_mesh((2, 4), ("data", "model"))  # explicit axis types
AUTO_MESH = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))  # auto-sharded kind


def smap(body, in_specs, out_specs, mesh=MESH):
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def gather_dot(x, w):  # column parallel: rows gathered, columns of w local
    return jax.lax.all_gather(x, "model", axis=0, tiled=True) @ w


def dot_scatter(h, w):  # row parallel: contraction local, product scattered by rows
    return jax.lax.psum_scatter(h @ w, "model", scatter_dimension=0, tiled=True)


def megatron(x, w1, w2):  # psum after the row-parallel matmul
    return jax.lax.psum(jax.nn.relu(x @ w1) @ w2, "model")


def sp_block(x, w1, w2):  # sequence parallel: gather, two matmuls, scatter
    h = jax.nn.gelu(jax.lax.all_gather(x, "model", axis=0, tiled=True) @ w1)
    return jax.lax.psum_scatter(h @ w2, "model", scatter_dimension=0, tiled=True)


GATHER = smap(gather_dot, (P("model", None), P(None, "model")), P(None, "model"))
SCATTER = smap(dot_scatter, (P(None, "model"), P("model", None)), P("model", None))
MEGATRON = smap(megatron, (P(), P(None, "model"), P("model", None)), P())
SP = smap(sp_block, (P("model", None), P(None, "model"), P("model", None)), P("model", None))


def put(shape, spec, seed=0, mesh=MESH, dtype=np.float32):
    value = np.random.default_rng(seed).normal(size=shape).astype(dtype)
    return jax.device_put(value, NamedSharding(mesh, spec))


def gather_inputs(mesh=MESH):
    return put((64, 32), P("model", None), 0, mesh), put((32, 64), P(None, "model"), 1, mesh)


def sp_inputs():
    return put((64, 32), P("model", None), 0), put((32, 64), P(None, "model"), 1), put((64, 32), P("model", None), 2)


def assert_close(got, want, tol=1e-4):
    got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
    assert jax.tree.structure(got) == jax.tree.structure(want) and len(got_leaves) == len(want_leaves)
    for g, w in zip(got_leaves, want_leaves):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=tol, atol=tol)


def ring_ops(lowered) -> dict[str, list]:
    """The collectives and loops of the lowered StableHLO (read through the bindings)."""
    names = ("stablehlo.collective_permute", "stablehlo.while", "stablehlo.all_gather", "stablehlo.reduce_scatter")
    found = ir_utils.ops_named(lowered.compiler_ir("stablehlo"), *names)
    return {name.split(".")[1]: ops for name, ops in found.items()}


def assert_rings(lowered):
    """Rings are there (permutes: a straight-line ring, the default on CPU for a gather, has no
    loop), no reduce_scatter is left, and no all_gather left feeds a dot (a split psum's gather,
    carried to where the whole value is read, may stay)."""
    ops = ring_ops(lowered)
    counts = {name: len(found) for name, found in ops.items()}
    assert counts["collective_permute"] > 0 and not counts["reduce_scatter"], counts
    assert not any(u.name == "stablehlo.dot_general" for g in ops["all_gather"] for u in ir_utils.users(g.result))


# ------------------------------------------------------------------ composition keeps the rings
def test_grad_of_a_decorated_loss_rewrites_forward_and_backward():
    loss = cmatmul_pass.jit(lambda x, w: jnp.sum(GATHER(x, w) ** 2), strict=True)
    plain = lambda x, w: jnp.sum(GATHER(x, w) ** 2)  # noqa: E731
    x, w = gather_inputs()
    with jax.set_mesh(MESH):
        assert_close(jax.grad(loss, argnums=(0, 1))(x, w), jax.jit(jax.grad(plain, argnums=(0, 1)))(x, w))
        lowered = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, w)
    # the forward's gather and the backward's scatter became rings (the weight gradient's psum
    # over 'data' is split: its gather is carried to where the whole value is read)
    assert_rings(lowered)
    assert not ring_ops(jax.jit(jax.grad(plain, argnums=(0, 1))).lower(x, w))["collective_permute"]
    kinds = sorted(s.kind for r in loss.overlap.reports for s in r.rewritten)
    assert "all_gather_dot" in kinds and "dot_reduce_scatter" in kinds


def test_called_inside_another_jit_and_inside_another_decorated_function():
    layer = cmatmul_pass.jit(GATHER, strict=True)
    x, w = gather_inputs()
    outer = jax.jit(lambda x, w: layer(x, w) * 2)
    assert_close(outer(x, w), jax.jit(GATHER)(x, w) * 2)
    assert_rings(outer.lower(x, w))
    nested = cmatmul_pass.jit(lambda x, w: layer(x, w) + 1, strict=True, check=True)
    assert_close(nested(x, w), jax.jit(GATHER)(x, w) + 1)
    assert_rings(nested.lower(x, w))
    assert nested.stats["checks"] == 1


def test_vmap_over_a_decorated_function_batches_inside_the_ring():
    layer = cmatmul_pass.jit(GATHER, strict=True)
    x, w = gather_inputs()
    ws = jnp.stack([w, 2 * w, -w])
    want = jax.jit(jax.vmap(GATHER, in_axes=(None, 0)))(x, ws)
    assert_close(jax.vmap(layer, in_axes=(None, 0))(x, ws), want)
    assert_rings(jax.jit(jax.vmap(layer, in_axes=(None, 0))).lower(x, ws))


def test_eval_shape_and_trace():
    layer = cmatmul_pass.jit(SP, strict=True)
    args = sp_inputs()
    want = jax.eval_shape(SP, *args)
    assert jax.eval_shape(layer, *args) == want
    assert layer.eval_shape(*args) == want
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding) for a in args]
    traced = layer.trace(*specs)
    assert traced.out_info.shape == want.shape and traced.jaxpr.eqns
    lowered = traced.lower()
    assert_rings(lowered)
    assert len(lowered.report.rewritten) == 2 and layer.stats["compiles"] == 0
    assert_close(lowered.compile()(*args), jax.jit(SP)(*args))


def test_scan_over_layers_calling_a_decorated_block():
    block = cmatmul_pass.jit(SP, strict=True)

    def model(apply, x, w1s, w2s):
        def body(h, ws):
            return h + apply(h, *ws), None

        return jax.lax.scan(body, x, (w1s, w2s))[0]

    x, w1, w2 = sp_inputs()
    w1s, w2s = jnp.stack([w1, 0.5 * w1]), jnp.stack([w2, -w2])
    mine = jax.jit(lambda *a: model(block, *a))
    assert_close(mine(x, w1s, w2s), jax.jit(lambda *a: model(SP, *a))(x, w1s, w2s))
    assert_rings(mine.lower(x, w1s, w2s))


def test_remat_of_a_decorated_loss_under_grad():
    loss = cmatmul_pass.jit(lambda x, w1, w2: jnp.sum(SP(x, w1, w2) ** 2), strict=True)
    plain = lambda x, w1, w2: jnp.sum(SP(x, w1, w2) ** 2)  # noqa: E731
    args = sp_inputs()
    with jax.set_mesh(MESH):
        step = jax.jit(jax.grad(jax.checkpoint(loss), argnums=(1, 2)))
        assert_close(step(*args), jax.jit(jax.grad(plain, argnums=(1, 2)))(*args), 1e-3)
        assert_rings(step.lower(*args))


def test_megatron_psum_under_value_and_grad_on_an_auto_mesh():
    mesh_megatron = smap(megatron, (P(), P(None, "model"), P("model", None)), P(), mesh=AUTO_MESH)
    loss = cmatmul_pass.jit(lambda x, w1, w2: jnp.mean(mesh_megatron(x, w1, w2) ** 2), strict=True,
                            all_reduce="split")  # a ring, which the permutes below show
    plain = lambda x, w1, w2: jnp.mean(mesh_megatron(x, w1, w2) ** 2)  # noqa: E731
    args = (put((32, 16), P(), 0, AUTO_MESH), put((16, 64), P(None, "model"), 1, AUTO_MESH),
            put((64, 16), P("model", None), 2, AUTO_MESH))
    step = jax.jit(jax.value_and_grad(loss, argnums=(1, 2)))
    assert_close(step(*args), jax.jit(jax.value_and_grad(plain, argnums=(1, 2)))(*args), 1e-3)
    assert ring_ops(step.lower(*args))["collective_permute"]


def test_static_and_donated_arguments_at_top_level_and_nested():
    def scaled(x, w, power):
        return GATHER(x, w) ** power, x * 2  # x's buffer can hold the second output

    layer = cmatmul_pass.jit(scaled, static_argnums=2, donate_argnums=0, strict=True, check=True)
    plain = jax.jit(scaled, static_argnums=2, donate_argnums=0)
    x, w = gather_inputs()
    given, theirs = x.copy(), x.copy()
    want = plain(theirs, w, 2)
    assert_close(layer(given, w, 2), want)
    assert given.is_deleted() and theirs.is_deleted()  # donated, as jax.jit does
    assert_close(jax.jit(lambda x, w: layer(x, w, 2))(x, w), want)  # donation ignored inside a jit, as jax does
    assert_close(jax.jit(lambda x, w: layer(x, w, power=3))(x, w), jax.jit(scaled, static_argnums=2)(x, w, 3))
    assert not x.is_deleted()


def test_pytrees_with_none_leaves_and_0d_outputs():
    def fn(params, batch):
        y = GATHER(batch["x"], params["w"])
        return {"y": y, "nothing": None, "total": jnp.sum(y), "pair": (None, jnp.max(y))}

    mine = cmatmul_pass.jit(fn, strict=True, check=True)
    x, w = gather_inputs()
    params, batch = {"w": w, "unused": None}, {"x": x}
    got = mine(params, batch)
    assert got["nothing"] is None and got["pair"][0] is None and got["total"].shape == ()
    assert_close(got, jax.jit(fn)(params, batch))
    assert mine.report.rewritten


def test_typed_random_keys_in_and_out():
    def noisy(key, x, w):
        key, sub = jax.random.split(key)
        return key, GATHER(x + 0.01 * jax.random.normal(sub, x.shape), w)

    mine = cmatmul_pass.jit(noisy, strict=True)
    x, w = gather_inputs()
    key = jax.random.key(0)
    got_key, got = mine(key, x, w)
    want_key, want = jax.jit(noisy)(key, x, w)
    assert jax.dtypes.issubdtype(got_key.dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(jax.random.key_data(got_key), jax.random.key_data(want_key))
    assert_close(got, want)
    assert mine.report.rewritten
    assert_close(jax.jit(lambda k, x, w: mine(k, x, w)[1])(key, x, w), want)


def test_float0_gradients_of_integer_inputs():
    def loss(x, w, steps):
        return jnp.sum(GATHER(x, w) ** 2) * steps

    step = cmatmul_pass.jit(jax.grad(loss, argnums=(1, 2), allow_int=True), strict=True)
    x, w = gather_inputs()
    steps = jnp.int32(3)
    with jax.set_mesh(MESH):
        got_w, got_steps = step(x, w, steps)
        want_w, _ = jax.jit(jax.grad(loss, argnums=(1, 2), allow_int=True))(x, w, steps)
    assert got_steps.dtype == jax.dtypes.float0
    assert_close(got_w, want_w, 1e-3)
    assert step.report.rewritten


def test_in_out_shardings_and_keep_unused():
    replicated = NamedSharding(MESH, P())
    mine = cmatmul_pass.jit(lambda x, w, unused: GATHER(x, w), out_shardings=replicated, keep_unused=True,
                            strict=True)
    x, w = gather_inputs()
    got = mine(x, w, jnp.ones(3))
    assert got.sharding.is_equivalent_to(replicated, got.ndim)
    assert_close(got, jax.jit(GATHER)(x, w))
    main = ir.SymbolTable(mine.lower(x, w, jnp.ones(3)).compiler_ir("stablehlo").operation)["main"]
    assert len(main.arguments) == 3  # the unused argument kept


# ------------------------------------------------------------------ never worse than jax.jit
def broken_rewrite(*args, **kwargs):
    raise InternalError("rewriting the all_gather_dot site at test.py:1 produced IR that does not verify")


def test_a_failing_pass_runs_the_original_program_and_warns_once(monkeypatch):
    monkeypatch.setattr(decorator, "rewrite_copy", broken_rewrite)
    monkeypatch.setattr(transform, "rewrite", broken_rewrite)
    x, w = gather_inputs()
    want = jax.jit(GATHER)(x, w)
    mine = cmatmul_pass.jit(GATHER)
    with pytest.warns(RuntimeWarning, match="all_gather_dot site at test.py:1"):
        assert_close(mine(x, w), want)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per reason
        assert_close(mine(*gather_inputs()[::-1][::-1]), want)
        mine.lower(x, w)
    assert mine.stats["fallbacks"] == 2 and not mine.report.sites
    with pytest.warns(RuntimeWarning, match="the pass failed on function"):
        assert_close(jax.jit(lambda x, w: mine(x, w) * 2)(x, w), want * 2)  # under a trace too
    assert mine.overlap.stats["fallbacks"] == 1
    with pytest.raises(InternalError):
        cmatmul_pass.jit(GATHER, strict=True)(x, w)
    with pytest.raises(InternalError):
        jax.jit(cmatmul_pass.jit(GATHER, strict=True)).lower(x, w)


def test_a_rewrite_xla_rejects_runs_the_original_program(monkeypatch):
    real = decorator.Lowered.compile

    def reject_rewritten(self, *args, **kwargs):
        if self._lowered is not self.original:
            raise RuntimeError("INVALID_ARGUMENT: a stand-in for XLA rejecting the rewritten module")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(decorator.Lowered, "compile", reject_rewritten)
    x, w = gather_inputs()
    mine = cmatmul_pass.jit(GATHER)
    with pytest.warns(RuntimeWarning, match=r"XLA rejected the rewritten program \(rewritten sites: all_gather_dot"):
        assert_close(mine(x, w), jax.jit(GATHER)(x, w))
    assert mine.stats["fallbacks"] == 1 and not mine.report.rewritten
    with pytest.raises(RuntimeError, match="stand-in"):
        cmatmul_pass.jit(GATHER, strict=True)(x, w)


def test_overlap_is_a_light_transform_for_your_own_jit():
    layer = cmatmul_pass.overlap(SP, bidirectional=True, strict=True)
    args = sp_inputs()
    step = jax.jit(layer)
    assert_close(step(*args), jax.jit(SP)(*args))
    assert_rings(step.lower(*args))
    assert layer.report.rewritten and all(s.schedule["directions"] == 2 for s in layer.report.rewritten)
    with pytest.raises(ValueError, match="unroll"):
        cmatmul_pass.overlap(SP, unroll=3)


def test_called_inside_a_shard_map_body():
    """Inside a body manual over every mesh axis the call's function is rewritten (its partition
    ids are the devices'); inside one manual over some axes it stays as jax lowered it, with a
    warning: rewritten as if fully manual, XLA would reject it (partition ids in an SPMD region)."""
    x, w = gather_inputs()
    specs = dict(in_specs=(P("model", None), P(None, "model")), out_specs=P(None, "model"), check_vma=False)
    inner = cmatmul_pass.jit(gather_dot, strict=True)
    full = jax.jit(jax.shard_map(lambda x, w: inner(x, w), mesh=MESH, **specs))
    assert_close(full(x, w), jax.jit(GATHER)(x, w))
    assert_rings(full.lower(x, w))
    partial_inner = cmatmul_pass.jit(gather_dot, strict=True)
    partial = jax.jit(jax.shard_map(lambda x, w: partial_inner(x, w), mesh=MESH, axis_names={"model"}, **specs))
    plain = jax.jit(jax.shard_map(gather_dot, mesh=MESH, axis_names={"model"}, **specs))
    with pytest.warns(RuntimeWarning, match="manual over only some mesh axes"):
        assert_close(partial(x, w), plain(x, w))
    assert not ring_ops(partial.lower(x, w))["collective_permute"]
    assert partial_inner.overlap.stats["partial_manual"] >= 1 and not partial_inner.overlap.reports


def test_other_transformations_of_a_decorated_function():
    """jvp, linearize, vjp, a Hessian-vector product, while and cond bodies, checkify, custom_vjp,
    vmap of grad and grad of vmap: each equals plain JAX."""
    from jax.experimental import checkify

    layer = cmatmul_pass.jit(GATHER, strict=True)
    loss = cmatmul_pass.jit(lambda x, w: jnp.sum(GATHER(x, w) ** 2), strict=True)
    plain = lambda x, w: jnp.sum(GATHER(x, w) ** 2)  # noqa: E731
    x, w = gather_inputs()
    ws = jnp.stack([w, -w])

    @jax.custom_vjp
    def custom(x, w):
        return loss(x, w)

    custom.defvjp(lambda x, w: (loss(x, w), (x, w)), lambda res, g: jax.grad(loss, argnums=(0, 1))(*res))
    cases = {
        "jvp": (lambda f: jax.jvp(f, (x, w), (x, w)), layer, GATHER),
        "linearize": (lambda f: jax.linearize(f, x, w)[1](x, w), layer, GATHER),
        "vjp": (lambda f: jax.vjp(f, x, w)[1](jax.jit(GATHER)(x, w)), layer, GATHER),
        "hvp": (lambda f: jax.jvp(jax.grad(f), (x, w), (x, w))[1], loss, plain),
        "while": (lambda f: jax.lax.fori_loop(0, 2, lambda i, c: c + f(x, w), 0.0), loss, plain),
        "cond": (lambda f: jax.lax.cond(True, f, plain, x, w), loss, plain),
        "checkify": (lambda f: checkify.checkify(f)(x, w)[1], loss, plain),
        "custom_vjp": (lambda f: jax.grad(f, argnums=(0, 1))(x, w), custom, plain),
        "vmap_of_grad": (lambda f: jax.vmap(jax.grad(f, argnums=1), in_axes=(None, 0))(x, ws), loss, plain),
        "grad_of_vmap": (lambda f: jax.grad(lambda ws: jnp.sum(jax.vmap(f, in_axes=(None, 0))(x, ws)))(ws), loss, plain),
    }
    with jax.set_mesh(MESH):
        for name, (transform_of, mine, theirs) in cases.items():
            assert_close(transform_of(mine), transform_of(theirs), 1e-3), name
    assert loss.overlap.stats["rewrites"] >= 8 and not loss.overlap.stats["fallbacks"]


def test_what_check_compares_of_each_value_jax_jit_returns():
    key = jax.random.key(3)
    np.testing.assert_array_equal(decorator.comparable(key), np.asarray(jax.random.key_data(key)))
    zero = jax.grad(lambda x, n: x * n, argnums=1, allow_int=True)(1.0, 3)
    assert decorator.comparable(zero).dtype == np.bool_ and decorator.comparable(zero).shape == ()
    scalar = decorator.comparable(jnp.float32(2.5))
    assert scalar.shape == () and scalar == 2.5
    x, _ = gather_inputs()
    np.testing.assert_array_equal(decorator.comparable(x), np.asarray(x))
    with jax.set_mesh(MESH):
        unreduced = jax.jit(lambda a, b: jnp.dot(a, b, out_sharding=P(None, None, unreduced={"model"})))(
            put((8, 32), P(None, "model")), put((32, 8), P("model", None)))
    assert decorator.comparable(unreduced) is None


def test_shared_ring_functions_of_two_calls_get_names_of_their_own():
    """Two calls of a function with two identical blocks: each call's function shares ring
    functions between its blocks; moved into the enclosing module, the second call's are renamed."""
    def two_blocks(x, w1, w2):
        return SP(SP(x, w1, w2), w1, w2)

    layer = cmatmul_pass.overlap(two_blocks, strict=True)
    args = sp_inputs()
    step = jax.jit(lambda *a: layer(*a) + 0.5 * layer(*a))
    assert_close(step(*args), jax.jit(lambda *a: 1.5 * two_blocks(*a))(*args), 2e-3)
    module = step.lower(*args).compiler_ir("stablehlo")
    names = [ir_utils.symbol_name(op) for op in module.body.operations if op.operation.name == "func.func"]
    assert len(names) == len(set(names))
    shared = {s.shared_ring for r in layer.reports for s in r.rewritten if s.shared_ring}
    assert len(shared) == 4 and all(name[1:] in names for name in shared)
