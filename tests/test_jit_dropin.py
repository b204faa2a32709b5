"""cmatmul_pass.jit as a drop-in for jax.jit on shard_map programs jax.jit runs, check=True
included: host callbacks, functions that wrap a decorated one (jax.grad, shard_map), reduced and
unreduced shardings, mutable array references, no trace or compile on a cache hit that jax.jit
would not make, and any failure of the pass or of the check falling back to jax.jit's program
with one warning.  Every result is compared with jax.jit's."""

import json
import os
import subprocess
import sys
import warnings
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import cmatmul_pass
from cmatmul_pass import decorator, execute, transform
from conftest import ROOT

MESH = jax.make_mesh((2, 4), ("data", "model"))  # explicit axes (jax 0.10's default)


def put(array, spec, mesh=MESH):
    return jax.device_put(np.asarray(array, dtype=np.float32), NamedSharding(mesh, spec))


def gather(x, w):
    return jax.lax.all_gather(x, "model", axis=0, tiled=True) @ w


LAYER = jax.shard_map(gather, mesh=MESH, in_specs=(P("model", None), P(None, "model")),
                      out_specs=P(None, "model"), check_vma=False)


def inputs(seed=0):
    rng = np.random.default_rng(seed)
    return put(rng.normal(size=(64, 32)), P("model", None)), put(rng.normal(size=(32, 64)), P(None, "model"))


def assert_same(got, want, rtol=1e-5, atol=1e-5):
    """The same pytree, shardings and values (per device) as jax.jit's outputs."""
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert g.sharding == w.sharding, (g.sharding, w.sharding)
        for a, b in zip(sorted(g.addressable_shards, key=lambda s: s.device.id),
                        sorted(w.addressable_shards, key=lambda s: s.device.id)):
            np.testing.assert_allclose(np.asarray(a.data), np.asarray(b.data), rtol=rtol, atol=atol)


def one_warning(record, text):
    """The cmatmul_pass warnings recorded: exactly one, saying ``text``."""
    ours = [str(w.message) for w in record if "cmatmul_pass" in str(w.message)]
    assert len(ours) == 1 and text in ours[0], ours


# ------------------------------------------------------------------ host callbacks under check=True
CALLBACKS = r"""
import json, os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax, jax.numpy as jnp, numpy as np
from jax.experimental import io_callback
from jax.sharding import NamedSharding, PartitionSpec as P
import cmatmul_pass
from cmatmul_pass import execute

mesh = jax.make_mesh((8,), ("model",))
seen = []

def body(kind):
    def f(x, w):
        y = jax.lax.all_gather(x, "model", axis=0, tiled=True) @ w
        if kind == "debug_print":
            jax.debug.print("partial sum {s}", s=jnp.sum(y))
        elif kind == "pure_callback":
            y = jax.pure_callback(lambda a: np.tanh(a), jax.ShapeDtypeStruct(y.shape, y.dtype), y)
        else:
            io_callback(lambda a: seen.append(float(a)), None, jnp.sum(y), ordered=True)
        return y
    return jax.shard_map(f, mesh=mesh, in_specs=(P("model", None), P(None, "model")), out_specs=P(None, "model"))

rng = np.random.default_rng(0)
x = jax.device_put(rng.normal(size=(64, 32)).astype(np.float32), NamedSharding(mesh, P("model", None)))
w = jax.device_put(rng.normal(size=(32, 64)).astype(np.float32), NamedSharding(mesh, P(None, "model")))
for kind in ("debug_print", "pure_callback", "io_callback"):
    g = cmatmul_pass.jit(body(kind), check=True)
    got, again, want = g(x, w), g(x, w), jax.jit(body(kind))(x, w)
    text = jax.jit(body(kind)).lower(x, w).as_text()
    try:
        execute.check_numerics(cmatmul_pass.ir_utils.parse(text), cmatmul_pass.ir_utils.parse(text))
        refused = None
    except execute.CannotCheck as why:
        refused = str(why)
    print(json.dumps(dict(kind=kind, err=float(np.abs(np.asarray(got) - np.asarray(want)).max()),
                          again=float(np.abs(np.asarray(again) - np.asarray(want)).max()),
                          rewritten=len(g.report.rewritten), checks=g.stats["checks"],
                          ok=g.checked is not None and g.checked.ok,
                          reference=g.checked.reference if g.checked else None, refused=refused)))
jax.effects_barrier()
print(json.dumps(dict(io_calls=len(seen))))
"""


def test_host_callbacks_are_checked_through_jax_dispatch():
    """debug.print, pure_callback and io_callback in a rewritten shard_map under check=True: the
    check runs both programs through jax's dispatch (run as modules, the callbacks find no
    Python function: a segfault), the results are jax.jit's, and execute's own route refuses
    such a module (could not check) instead of crashing.  In a subprocess: a crash fails the
    test, not pytest."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    proc = subprocess.run([sys.executable, "-c", CALLBACKS], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr[-3000:]}"
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    results, (calls,) = rows[:-1], rows[-1:]
    assert [r["kind"] for r in results] == ["debug_print", "pure_callback", "io_callback"]
    for r in results:
        assert r["err"] < 1e-4 and r["again"] < 1e-4, r
        assert r["rewritten"] == 1 and r["checks"] == 1 and r["ok"], r
        assert "calls back into Python" in r["reference"] and "jax's dispatch" in r["reference"], r
        assert "calls back into Python (custom_call @xla_ffi_python_cpu_callback)" in r["refused"], r
    # io_callback (ordered) on 8 devices: the checked original, the checked rewrite, 2 calls; jax.jit's 1
    assert calls["io_calls"] == 8 * 5


# ------------------------------------------------------------------ functions wrapping a decorated one
def test_a_decorated_function_under_grad_and_decorated_again():
    """jax.grad (and jax.shard_map) copy the wrapped function's attributes onto their wrapper;
    decorating that wrapper must not take the inner decorated function's state (it returned the
    forward's 0-d loss for the gradients: 'iteration over a 0-d array')."""
    def loss(x, w):
        return jax.lax.psum(jnp.sum(gather(x, w) ** 2), "model")

    scalar = jax.shard_map(loss, mesh=MESH, in_specs=(P("model", None), P(None, "model")), out_specs=P(),
                           check_vma=False)
    x, w = inputs()
    inner = cmatmul_pass.jit(scalar, check=True)
    assert_same(inner(x, w), jax.jit(scalar)(x, w), rtol=1e-4)
    grads = cmatmul_pass.jit(jax.grad(inner, argnums=(0, 1)), check=True)
    assert_same(grads(x, w), jax.jit(jax.grad(jax.jit(scalar), argnums=(0, 1)))(x, w), rtol=1e-4, atol=1e-3)
    assert grads.report.rewritten and grads.checked.ok
    both = cmatmul_pass.jit(jax.value_and_grad(inner, argnums=1), check=True)
    assert_same(both(x, w), jax.jit(jax.value_and_grad(scalar, argnums=1))(x, w), rtol=1e-4, atol=1e-3)


def test_a_shard_map_of_a_jitted_function_under_vmap():
    """shard_map of jnp.dot (itself a jax.jit function) carries jnp.dot's attributes: decorated,
    its calls and its vmap are the shard_map's, not a bare dot's."""
    mesh = jax.make_mesh((2, 2), ("i", "j"), axis_types=(jax.sharding.AxisType.Auto,) * 2,
                         devices=jax.devices()[:4])
    f = jax.shard_map(jnp.dot, mesh=mesh, in_specs=(P("i", "j"), P("j", None)), out_specs=P(None, ("i", "j")))
    a, b = jnp.arange(5 * 4 * 4.).reshape(5, 4, 4), jnp.arange(4 * 8.).reshape(4, 8)
    g = cmatmul_pass.jit(f, check=True)
    np.testing.assert_array_equal(np.asarray(g(a[0], b)), np.asarray(jax.jit(f)(a[0], b)))
    np.testing.assert_array_equal(np.asarray(jax.vmap(g, (0, None))(a, b)),
                                  np.asarray(jax.vmap(jax.jit(f), (0, None))(a, b)))


# ------------------------------------------------------------------ reduced / unreduced shardings
def test_unreduced_outputs_keep_their_sharding():
    """A rewritten gather whose output is left unreduced over 'model' (a partial sum per
    device): jax.jit's sharding and per-device values, checked shard by shard."""
    def partial_sum(x, w):
        return jax.lax.all_gather(x, "data", axis=0, tiled=True) @ w

    f = jax.shard_map(partial_sum, mesh=MESH, in_specs=(P("data", "model"), P("model", None)),
                      out_specs=P(None, None, unreduced={"model"}), check_vma=False)
    rng = np.random.default_rng(1)
    x, w = put(rng.normal(size=(64, 32)), P("data", "model")), put(rng.normal(size=(32, 16)), P("model", None))
    g = cmatmul_pass.jit(f, check=True)
    got = g(x, w)
    assert got.sharding.spec.unreduced == {"model"}
    assert_same(got, jax.jit(f)(x, w))
    assert g.report.rewritten and g.checked.ok and g.checked.reference == "f64"


def test_gradients_of_reduced_arguments_are_unreduced_as_under_jax_jit():
    """A reduced argument's gradient comes back unreduced (P(None, unreduced={'x'})), as from
    jax.jit; the check, which cannot read a reduced argument as one array, runs both programs
    through jax's dispatch instead of skipping."""
    mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
    arr = jax.device_put(np.arange(8.0, dtype=np.float32), NamedSharding(mesh, P(None, reduced={"x"})))

    def varying(x):
        return jax.lax.pcast(x, "x", to="varying")

    f = jax.shard_map(varying, mesh=mesh, out_specs=P("x"))
    with jax.set_mesh(mesh):
        inner = cmatmul_pass.jit(f, check=True)
        assert_same(inner(arr), jax.jit(f)(arr))
        assert inner.checked.ok and "jax's dispatch" in inner.checked.reference
        grad = cmatmul_pass.jit(jax.grad(lambda x: inner(x).sum()), check=True)
        got, want = grad(arr), jax.jit(jax.grad(lambda x: jax.jit(f)(x).sum()))(arr)
    assert got.sharding.spec == P(None, unreduced={"x"})
    assert_same(got, want)


# ------------------------------------------------------------------ mutable array references
def test_a_mutable_array_argument_is_updated_as_under_jax_jit():
    """A jax.new_ref argument accumulating a rewritten gather's result: updated as jax.jit
    updates it, call after call, and checked (its update is an output of the module)."""
    def layer(x, w, acc):
        acc[...] += gather(x, w)
        return acc[...]

    f = jax.shard_map(layer, mesh=MESH, in_specs=(P("model", None), P(None, "model"), P(None, "model")),
                      out_specs=P(None, "model"), check_vma=False)
    x, w = inputs()
    results = []
    for jit in (jax.jit, lambda f: cmatmul_pass.jit(f, check=True)):
        acc = jax.new_ref(put(np.ones((64, 64)), P(None, "model")))
        g = jit(f)
        outs = [g(x, w, acc), g(x, w, acc)]
        results.append((outs, acc[...]))
    assert_same(results[1], results[0], rtol=1e-5, atol=1e-4)
    assert g.report.rewritten and g.checked.ok and g.stats["compiles"] == 1


def test_mutable_arrays_inside_a_decorated_function_under_an_eager_shard_map():
    """jax.new_ref inside a decorated function that an eager shard_map calls: its call primitive
    has a state-discharge rule (it had none: 'No state discharge rule implemented for
    primitive: cmatmul_overlap')."""
    mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
    x = jax.device_put(np.arange(8, dtype=np.float32), NamedSharding(mesh, P("x")))

    def f(x):
        ref = jax.new_ref(x)
        ref[...] += 1.0
        return jax.freeze(ref)

    with jax.set_mesh(mesh):
        got = jax.shard_map(cmatmul_pass.jit(f, check=True), out_specs=P("x"), check_vma=False)(x)
        want = jax.shard_map(jax.jit(f), out_specs=P("x"), check_vma=False)(x)
    assert_same(got, want)


# ------------------------------------------------------------------ no extra trace or compile
def _jax_events():
    """jax's own count of traces, lowerings and backend compiles (jax.monitoring)."""
    seen = Counter()
    wanted = ("jaxpr_trace_duration", "jaxpr_to_mlir_module_duration", "backend_compile_duration")

    def listener(event, duration, **kwargs):
        name = event.rsplit("/", 1)[-1]
        if name in wanted:
            seen[name] += 1

    jax.monitoring.register_event_duration_secs_listener(listener)
    return seen


@pytest.mark.parametrize("check", [False, True])
def test_no_trace_or_compile_beyond_jax_jits(check):
    """The calls of jax's own test of a cache hit (the same abstract mesh on other devices):
    jax.jit traces and lowers once and compiles once per device set; so does cmatmul_pass.jit,
    with check=True too (its reading of the inputs compiled a copy per device set)."""
    mesh1 = jax.sharding.Mesh(jax.devices()[:2], "i")
    mesh2 = jax.sharding.Mesh(jax.devices()[2:4], "i")

    def program():  # a function of its own for each jit: no cache of one serves the other
        def f(x):
            x = jax.shard_map(lambda x: x, mesh=mesh1.abstract_mesh, in_specs=P("i"), out_specs=P("i"))(x)
            return jax.lax.sin(x)
        return f

    a = jax.device_put(np.arange(8.0), NamedSharding(mesh1, P()))
    b = jax.device_put(np.arange(8.0), NamedSharding(mesh2, P()))
    seen = _jax_events()
    counts, outs = {}, {}
    for name, jit in (("jax", jax.jit), ("cmatmul", lambda f: cmatmul_pass.jit(f, check=check))):
        g = jit(program())
        for call, arg in enumerate((a, a, b, b)):
            seen.clear()
            outs[name, call] = g(arg)
            counts[name, call] = dict(seen)
    for call in range(4):
        assert_same(outs["cmatmul", call], outs["jax", call])
    assert [counts["cmatmul", i] for i in range(4)] == [counts["jax", i] for i in range(4)]
    assert counts["jax", 1] == counts["jax", 3] == {}


# ------------------------------------------------------------------ failures fall back to jax.jit's program
def test_any_exception_of_the_pass_falls_back_with_one_warning(monkeypatch):
    """A matcher's or rewriter's bug (any exception, not only InternalError): jax.jit's program
    runs, one RuntimeWarning names it, however many signatures meet it; strict=True raises."""
    def broken(*args, **kwargs):
        raise IndexError("list index out of range")

    monkeypatch.setattr(decorator, "rewrite_copy", broken)
    g = cmatmul_pass.jit(LAYER, check=True)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for rows in (64, 128):
            x, w = inputs()
            x = put(np.resize(np.asarray(x), (rows, 32)), P("model", None))
            assert_same(g(x, w), jax.jit(LAYER)(x, w))
    one_warning(record, "the pass failed")
    assert g.stats["fallbacks"] == 2 and not g.report.rewritten
    with pytest.raises(IndexError):
        cmatmul_pass.jit(LAYER, strict=True)(*inputs())


def test_an_exception_of_the_pass_under_a_transformation_falls_back(monkeypatch):
    """The same where a call is staged (under jax.grad): the function stays as jax lowered it."""
    def broken(*args, **kwargs):
        raise KeyError("a matcher's bug")

    monkeypatch.setattr(transform, "rewrite", broken)
    g = cmatmul_pass.jit(LAYER)
    x, w = inputs()
    with warnings.catch_warnings(record=True) as record, jax.set_mesh(MESH):
        warnings.simplefilter("always")
        got = jax.jit(jax.grad(lambda w: jnp.sum(g(x, w) ** 2)))(w)
        want = jax.jit(jax.grad(lambda w: jnp.sum(LAYER(x, w) ** 2)))(w)
    one_warning(record, "the pass failed")
    assert_same(got, want, rtol=1e-5, atol=1e-4)
    assert g.overlap.stats["fallbacks"] >= 1 and not g.overlap.reports


def test_a_failing_check_runs_the_original_program_with_one_warning(monkeypatch):
    """A bug of the check itself (not a verdict): the original program runs for that signature,
    with one warning; strict=True raises."""
    def broken(*args, **kwargs):
        raise RuntimeError("the check's own bug")

    monkeypatch.setattr(execute.Reference, "of", broken)
    g = cmatmul_pass.jit(LAYER, check=True)
    x, w = inputs()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got = [g(x, w), g(x, w)]
    one_warning(record, "check=True failed")
    for out in got:
        assert_same(out, jax.jit(LAYER)(x, w), rtol=0, atol=0)  # jax's own program: exactly its numbers
    assert g.stats["fallbacks"] == 1 and not g.report.rewritten and g.checked is None
    with pytest.raises(RuntimeError, match="own bug"):
        cmatmul_pass.jit(LAYER, check=True, strict=True)(x, w)


def test_a_program_the_check_cannot_compare_runs_unchecked_with_one_warning():
    """A mutable array argument of a program that calls back into Python: the modules cannot run
    on their own, and through jax's dispatch each program would update the reference: the
    rewritten program runs unchecked, with one warning, as jax.jit's would."""
    def layer(x, w, acc):
        acc[...] += jax.pure_callback(np.tanh, jax.ShapeDtypeStruct((64, 16), jnp.float32), gather(x, w))
        return acc[...]

    f = jax.shard_map(layer, mesh=MESH, in_specs=(P("model", None), P(None, "model"), P(None, "model")),
                      out_specs=P(None, "model"), check_vma=False)
    x, w = inputs()
    results = []
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for jit in (jax.jit, lambda f: cmatmul_pass.jit(f, check=True)):
            acc = jax.new_ref(put(np.ones((64, 64)), P(None, "model")))
            g = jit(f)
            results.append(([g(x, w, acc), g(x, w, acc)], acc[...]))
    one_warning(record, "could not check")
    assert_same(results[1], results[0], rtol=1e-5, atol=1e-4)
    assert g.report.rewritten and g.checked is None and g.stats["unchecked"] == 1 and not g.stats["fallbacks"]
