"""Every decline says what is true: for each program, written as a user would,
the reason code and a part of the message that names the op and the property that stopped the
site; each program's module is left as it was.

The ``keeps`` cases pin the other side: where the fact behind a new code does not hold (a
gathered value returned but never multiplied, a scatter of an argument no dot computes, a slice
at a fixed offset), the old code stays.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import cmatmul_pass
from cmatmul_pass import ir_utils
from conftest import module_line, sample


def mesh():
    return jax.make_mesh((8,), ("m",))


def arg(m, shape, spec, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(m, spec))


def smap(body, m, in_specs, out_specs):
    return jax.shard_map(body, mesh=m, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def lower(f, *args, platform=None):
    traced = jax.jit(f).trace(*args)
    return (traced.lower(lowering_platforms=(platform,)) if platform else traced.lower()).as_text()


def ag(x, axis=0):
    return jax.lax.all_gather(x, "m", axis=axis, tiled=True)


def rs(y, dim=0):
    return jax.lax.psum_scatter(y, "m", scatter_dimension=dim, tiled=True)


def rms(x):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


# ---------------------------------------------------------------- programs
def prefetch():
    """FSDP prefetch: each layer's region gathers the next layer's weight."""
    m = mesh()
    layer = smap(lambda x, w, nxt: (jnp.tanh(x @ w), ag(nxt)), m, (P("m", None), P(), P("m", None)),
                 (P("m", None), P()))
    first = smap(ag, m, (P("m", None),), P())

    def model(x, w0, w1, w2):
        x, g1 = layer(x, first(w0), w1)
        return layer(x, g1, w2)[0]

    return lower(model, arg(m, (64, 32), P("m", None)), *[arg(m, (32, 32), P("m", None))] * 3)


def prefetch_in_scan():
    """The same prefetch with the layers under lax.scan: the gathered weight is the loop's state."""
    m = mesh()
    layer = smap(lambda x, w, nxt: (jnp.tanh(x @ w), ag(nxt)), m, (P("m", None), P(), P("m", None)),
                 (P("m", None), P()))
    first = smap(ag, m, (P("m", None),), P())

    def model(ws, x):
        (x, _), _ = jax.lax.scan(lambda carry, nxt: (layer(*carry, nxt), None), (x, first(ws[0])), ws[1:])
        return x

    return lower(model, arg(m, (4, 32, 32), P(None, "m", None)), arg(m, (64, 32), P("m", None)))


def gathered_returned_unused():
    m = mesh()
    gather = smap(ag, m, (P("m", None),), P())
    sort = smap(lambda w: jnp.sort(w, axis=0), m, (P(),), P())
    return lower(lambda w: sort(gather(w)), arg(m, (32, 32), P("m", None)))


def scatter_in_next_region():
    """A hand-written backward: layer 2's weight gradient is scattered in the region of layer 1's."""
    m = mesh()
    bwd2 = smap(lambda dy, x: (dy @ dy.T @ x, x.T @ dy), m, (P("m", None), P("m", None)), (P("m", None), P()))
    bwd1 = smap(lambda dx, x, dw2: (x.T @ dx, rs(dw2)), m, (P("m", None), P("m", None), P()), (P(), P("m", None)))

    def f(dy, x):
        dx, dw2 = bwd2(dy, x)
        return bwd1(dx, x, dw2)

    return lower(f, arg(m, (64, 32), P("m", None)), arg(m, (64, 32), P("m", None)))


def scatter_of_argument():
    m = mesh()
    return lower(smap(rs, m, (P(),), P("m")), arg(m, (64, 32), P()))


def moe_args(m):
    return (arg(m, (64, 32), P()), arg(m, (4, 32, 128), P(None, None, "m")), arg(m, (4,), P(), jnp.int32),
            arg(m, (4, 128, 32), P(None, "m", None)))


MOE_SPECS = (P(), P(None, None, "m"), P(), P(None, "m", None))


def moe_body(x, w, gs, w2):
    return rs(jax.lax.ragged_dot(jax.nn.gelu(jax.lax.ragged_dot(x, w, gs)), w2, gs))


def moe_gpu():
    m = mesh()
    return lower(smap(moe_body, m, MOE_SPECS, P("m")), *moe_args(m), platform="cuda")


def moe_exported():
    """jax.export writes chlo.ragged_dot as a stablehlo.composite with its decomposition."""
    m = mesh()
    exported = jax.export.export(jax.jit(smap(moe_body, m, MOE_SPECS, P("m"))), platforms=("cuda",))(*moe_args(m))
    return exported.mlir_module()


def moe_unpermute_psum():
    m = mesh()

    def body(x, w, gs, w2, perm):
        y = jax.lax.ragged_dot(jax.nn.gelu(jax.lax.ragged_dot(x[perm], w, gs)), w2, gs)
        return jax.lax.psum(y[jnp.argsort(perm)], "m")

    f = smap(body, m, (*MOE_SPECS, P()), P())
    return lower(f, *moe_args(m), arg(m, (64,), P(), jnp.int32), platform="cuda")


def moe_unpermute_psum_cpu():
    """On CPU jax expands ragged_dot into a masked dot_general: the unpermute is what stops it."""
    m = mesh()

    def body(x, w, gs, w2, perm):
        return jax.lax.psum(jax.lax.ragged_dot(x, w, gs)[jnp.argsort(perm)], "m")

    f = smap(body, m, (*MOE_SPECS, P()), P())
    return lower(f, *moe_args(m), arg(m, (64,), P(), jnp.int32))


def tokens_gathered_into_ragged_dot():
    m = mesh()
    f = smap(lambda x, w, gs, perm: jax.lax.ragged_dot(ag(x)[perm], w, gs), m,
             (P("m", None), P(None, None, "m"), P(), P()), P(None, "m"))
    return lower(f, arg(m, (64, 32), P("m", None)), arg(m, (4, 32, 128), P(None, None, "m")),
                 arg(m, (4,), P(), jnp.int32), arg(m, (64,), P(), jnp.int32), platform="cuda")


def scan_input_gradient():
    """value_and_grad of a scan over stacked gathered weights, by the replicated input too: its
    gradient is the backward loop's carry, psum'd once after the loop."""
    from tools.fuzz_programs import Spec, lower as lower_spec

    return lower_spec(Spec(mesh_shape=(8,), devices=tuple(range(8)), axes=("x",), kind="scan", dim="k", side=0,
                           batch=False, tiled=True, dtype="f32", consumers=1, reader=False, partial_manual=False,
                           sizes=(2, 2, 2, 2), grad=True))


def reshard(then_dot: bool):
    """Sequence to features: gather the rows, keep this device's columns."""
    def build():
        m = mesh()

        def body(x, w):
            h = jax.lax.dynamic_slice_in_dim(ag(x), jax.lax.axis_index("m") * 4, 4, axis=1)
            return h @ w if then_dot else h

        f = smap(body, m, (P("m", None), P("m", None)), P() if then_dot else P(None, "m"))
        return lower(f, arg(m, (64, 32), P("m", None)), arg(m, (32, 32), P("m", None)))

    return build


def fixed_slice():
    m = mesh()
    f = smap(lambda x, w: jax.lax.dynamic_slice_in_dim(ag(x), 8, 4, axis=1) @ w, m, (P("m", None), P()), P())
    return lower(f, arg(m, (64, 32), P("m", None)), arg(m, (4, 32), P()))


def before_scatter(prepare, dim=0, extra=(32,)):
    """``psum_scatter(prepare(x @ w, e), dim)``: an op between the row-parallel dot and the scatter."""
    def build():
        m = mesh()
        out = P("m", None) if dim == 0 else P(None, "m")
        f = smap(lambda x, w, e: rs(prepare(x @ w, e), dim), m, (P(None, "m"), P("m", None), P()), out)
        return lower(f, arg(m, (64, 64), P(None, "m")), arg(m, (64, 32), P("m", None)), arg(m, extra, P()))

    return build


def before_dot(prepare, gather_dim=0, policy="all"):
    """``prepare(all_gather(x), e) @ w``: an op between the gather and the dot."""
    def build():
        m = mesh()
        if gather_dim == 0:
            f = smap(lambda x, w, e: prepare(ag(x, 0), e) @ w, m, (P("m", None), P(None, "m"), P()), P(None, "m"))
            return lower(f, arg(m, (64, 32), P("m", None)), arg(m, (32, 64), P(None, "m")), arg(m, (32,), P()))
        f = smap(lambda x, w, e: prepare(ag(x, 1), e) @ w, m, (P(None, "m"), P(), P()), P())
        return lower(f, arg(m, (64, 64), P(None, "m")), arg(m, (64, 32), P()), arg(m, (64,), P()))

    return build


def product_read_twice():
    m = mesh()

    def body(x, w):
        y = x @ w
        return rs(y), jnp.max(y, axis=0)

    f = smap(body, m, (P(None, "m"), P("m", None)), (P("m"), P("m")))
    return lower(f, arg(m, (64, 64), P(None, "m")), arg(m, (64, 32), P("m", None)))


def bias_inside_a_sum():
    """``x @ w1 + (x @ w2 + b)``: a per-column bias (the same in every block of the rows) added to
    one of two products before the sum."""
    m = mesh()
    f = smap(lambda x, w1, w2, b: rs(x @ w1 + (x @ w2 + b[None, :])), m, (P(None, "m"), P("m", None), P("m", None),
                                                                         P()), P("m", None))
    return lower(f, arg(m, (64, 64), P(None, "m")), arg(m, (64, 32), P("m", None)), arg(m, (64, 32), P("m", None)),
                 arg(m, (32,), P()))


def dot_in_a_function_with_collectives(side: str):
    """A nested ``jax.jit`` (a private function the pass does not inline) holding a dot and a
    collective of its own (a psum of a statistic), fed by a gather or scattered after."""
    m = mesh()

    @jax.jit
    def layer(x, w):
        y = x @ w
        return y * jax.lax.psum(jnp.sum(y * y), "m")

    def build():
        if side == "gather":
            f = smap(lambda x, w: layer(ag(x), w), m, (P("m", None), P(None, "m")), P(None, "m"))
            return lower(f, arg(m, (64, 32), P("m", None)), arg(m, (32, 64), P(None, "m")))
        f = smap(lambda x, w: rs(layer(x, w)), m, (P(None, "m"), P("m", None)), P("m", None))
        return lower(f, arg(m, (64, 64), P(None, "m")), arg(m, (64, 32), P("m", None)))

    return build


def psum_of_a_mean():
    """A loss: the mean of a product, psum'd (a reduce, then divided by a constant)."""
    m = mesh()
    f = smap(lambda x, w: jax.lax.psum(jnp.mean(x @ w), "m"), m, (P(None, "m"), P("m", None)), P())
    return lower(f, arg(m, (64, 64), P(None, "m")), arg(m, (64, 32), P("m", None)))


def layernorm(h, g):
    return (h - h.mean(-1, keepdims=True)) * g


CASES = [
    # (program, options, kind, code, what the message must say)
    (prefetch, {}, "all_gather_dot", "prefetchable", "leaves its shard_map region (sdy.return) for stablehlo.dot_general"),
    (prefetch_in_scan, {}, "all_gather_dot", "prefetchable", "in a later region"),
    (scatter_in_next_region, {}, "dot_reduce_scatter", "prefetchable",
     "computed by stablehlo.dot_general at"),
    (moe_gpu, {}, "dot_reduce_scatter", "ragged_dot", "the scattered dim is the ragged row dim of chlo.ragged_dot"),
    (moe_exported, {}, "dot_reduce_scatter", "ragged_dot", "the scattered dim is the ragged row dim of "
     "stablehlo.composite"),
    (moe_unpermute_psum, {}, "dot_all_reduce", "ragged_dot", "the summed value is computed by chlo.ragged_dot"),
    (moe_unpermute_psum_cpu, {}, "dot_all_reduce", "producer_not_dot",
     "comes from stablehlo.gather at"),
    (tokens_gathered_into_ragged_dot, {}, "all_gather_dot", "ragged_dot", "feeds chlo.ragged_dot"),
    (reshard(False), {}, "all_gather_dot", "reshard", "keeps the gathered dim 0 whole and takes this device's 1/8 of dim 1"),
    (reshard(True), {}, "all_gather_dot", "reshard", "an all_to_all in disguise"),
    # (a per-row bias, a residual, a per-row scale: read block by block, test_moves)
    (before_scatter(lambda y, _: rms(y)), {}, "dot_reduce_scatter", "producer_not_dot",
     "computed from the product itself (through stablehlo.reduce"),
    (before_scatter(lambda y, _: jax.nn.gelu(y)), {}, "dot_reduce_scatter", "producer_not_dot",
     "computed from the product itself (elementwise: an activation of it)"),
    (before_dot(lambda h, _: rms(h)), {"policy": "auto"}, "all_gather_dot", "layout",
     "computed from the gathered value itself (through stablehlo.reduce"),
    # (a norm over the gathered features moves where its ring pays, test_norm_features; here none does)
    (before_dot(layernorm, gather_dim=1), {"policy": "auto"}, "all_gather_dot", "layout",
     "value along dim 1 (one value per index of dim 1"),
    (before_dot(lambda h, _: rms(h), gather_dim=1), {"policy": "auto"}, "all_gather_dot", "schedule",
     "computed from the gathered value itself through stablehlo.reduce"),
    (before_dot(lambda h, _: jnp.sort(h, axis=0)), {}, "all_gather_dot", "user_not_dot",
     "func.call @sort (stablehlo.sort inside), which the ring cannot apply block by block"),
    (before_dot(lambda h, _: jnp.cumsum(h, axis=0)), {}, "all_gather_dot", "user_not_dot",
     "(stablehlo.reduce_window inside)"),
    (bias_inside_a_sum, {}, "dot_reduce_scatter", "producer_not_dot",
     "the same in every block, to one product of a sum of products"),
    (product_read_twice, {}, "dot_reduce_scatter", "multiple_users", "read by stablehlo.reduce at"),
    (psum_of_a_mean, {}, "dot_all_reduce", "producer_not_dot", "the summed value comes from stablehlo.reduce at"),
    (dot_in_a_function_with_collectives("gather"), {}, "all_gather_dot", "user_not_dot",
     "reaches its dot inside @layer (func.call at"),
    (dot_in_a_function_with_collectives("scatter"), {}, "dot_reduce_scatter", "producer_not_dot",
     "computed by a dot inside @layer (func.call at"),
    # the fact behind a new code does not hold: the old code stays
    (gathered_returned_unused, {}, "all_gather_dot", "user_not_dot", "feeds sdy.return, no stablehlo.dot_general"),
    (scatter_of_argument, {}, "dot_reduce_scatter", "producer_not_dot",
     "region argument #0, computed outside this shard_map region"),
    (fixed_slice, {}, "all_gather_dot", "user_not_dot", "reaches stablehlo.dot_general at"),
]


@pytest.mark.parametrize("program, options, kind, code, says", CASES,
                         ids=[f"{c[0].__name__ if c[0].__name__ != 'build' else c[0].__qualname__.split('.')[0]}-{i}"
                              for i, c in enumerate(CASES)])
def test_each_decline_names_its_cause(program, options, kind, code, says):
    text = program()
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(**options))
    assert result.text == ir_utils.print_module(ir_utils.parse(text)), "the pass changed a declined program"
    sites = [s for s in result.report.sites if s.kind == kind]
    assert sites and not result.report.rewritten, [s.summary_line() for s in result.report.sites]
    assert all(s.reason_code == code for s in sites), [s.summary_line() for s in sites]
    assert any(says in s.reason for s in sites), [s.reason for s in sites]


def test_the_first_stage_of_a_two_stage_gather_says_why_neither_ring_pays():
    """A weight gathered over one mesh axis, then the other, at a dot far too small to
    hide either (policy auto): the first stage names the second stage and says why both stay (not
    "feeds no dot"), with each option's predicted time; the second stage says it stays with it."""
    result = cmatmul_pass.rewrite(sample("ag_two_stage").read_text(), cmatmul_pass.Options(policy="auto"))
    first, second = result.report.sites
    assert first.reason_code == "two_stage" and not first.rewritten and not second.rewritten
    assert first.reason.startswith("the gathered value feeds the second stage of a two-stage gather")
    assert "both stay plain gathers: neither ring is predicted 0.02 faster than the original: the dot" in first.reason
    assert "is too small to hide the two gathers" in first.reason
    assert "merged ring over 8 devices" in first.reason and "second stage's ring over 4 devices" in first.reason
    assert second.reason_code == "policy" and second.reason.startswith(
        "the second stage of a two-stage gather, left a plain gather with its first stage at "
        f"<input>:{module_line('ag_two_stage', 4)}:12")


def test_two_stages_along_one_dim_merge_into_one_ring_over_both_axes():
    text = sample("ag_two_stage").read_text()
    result = cmatmul_pass.rewrite(text)
    (site,) = result.report.sites
    assert site.rewritten and site.ring_size == 8 and site.notes[0].startswith("merged with the second stage at")
    # the order a gather over both axes at once has: ("model", "data") on the 2x4 mesh
    assert site.replica_groups == [[0, 4, 1, 5, 2, 6, 3, 7]]
    assert not ir_utils.ops_named(result.module, "stablehlo.all_gather")["stablehlo.all_gather"]
    from cmatmul_pass import execute
    outcome = execute.check_numerics(ir_utils.parse(text), result.module)
    assert outcome.ok, outcome.format()


def test_two_stages_along_different_dims_stay_apart_and_say_why():
    m = jax.make_mesh((2, 4), ("data", "model"))

    def body(x, w):
        w = jax.lax.all_gather(jax.lax.all_gather(w, "data", axis=0, tiled=True), "model", axis=1, tiled=True)
        return x @ w

    f = smap(body, m, (P(), P("data", "model")), P())
    text = jax.jit(f).lower(arg(m, (16, 32), P()), arg(m, (32, 64), P("data", "model"))).as_text()
    result = cmatmul_pass.rewrite(text)
    first, second = result.report.sites
    assert second.rewritten and second.ring_size == 4
    assert first.reason_code == "two_stage" and (
        "not merged with it: the two stages gather along different dims (this one dim 0, the second dim 1); they "
        "would merge if both gathered along one dim") in first.reason


def test_a_psum_of_a_loops_result_says_the_dot_is_in_the_loop():
    """The scan's input gradient: the psum after the backward loop is declined, naming the loop and
    why (its dot is in the body), while the stacked weights' gather and scatter ring in the loops."""
    text = scan_input_gradient()
    result = cmatmul_pass.rewrite(text)
    (psum,) = [s for s in result.report.sites if s.kind == "dot_all_reduce"]
    assert psum.reason_code == "producer_not_dot"
    assert psum.reason.startswith("the summed value is a result of stablehlo.while at <input>:"), psum.reason
    assert "a loop's carry (a scan's input gradient, say): the dot computing it runs in the loop's body" in psum.reason
    assert all(s.rewritten for s in result.report.sites if s is not psum)
