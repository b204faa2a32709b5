"""Ring sharing: sites repeating one pattern call one ring function (cmatmul_pass.sharing).

Numerics as in test_numerics (f32: normwise relative 1e-5), against the original program.
"""

import jax
import jax.numpy as jnp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import cmatmul_pass
from cmatmul_pass import cost, execute, ir_utils, replay
from cmatmul_pass._jax_private import ir
from cmatmul_pass.pipeline import Options, variant_options
from cmatmul_pass.sharing import FUNCTION_PREFIX
from conftest import assert_only_split_gathers_left, sample
from tools import bench
from tools.samples_common import arg, gather, lower, mesh_2x4, scatter, smap


def ring_functions(module) -> dict[str, int]:
    """Each @cmatmul_ring_* function of ``module`` -> how many calls it has."""
    found = ir_utils.ops_named(module, "func.func", "func.call")
    names = [ir.StringAttr(f.attributes["sym_name"]).value for f in found["func.func"]]
    calls = [ir.FlatSymbolRefAttr(c.attributes["callee"]).value for c in found["func.call"]]
    return {n: calls.count(n) for n in names if n.startswith(FUNCTION_PREFIX)}


def collectives_left(module) -> int:
    found = ir_utils.ops_named(module, "stablehlo.all_gather", "stablehlo.reduce_scatter")
    return sum(len(v) for v in found.values())


def test_repeated_layers_call_one_ring_per_pattern(monkeypatch):
    """Replay off (the three blocks are identical: by default they become calls of one rewritten
    block, next test): each block's sites share the rings."""
    monkeypatch.setattr(replay, "MIN_MEMBERS", 10**9)
    result = cmatmul_pass.rewrite(sample("sp_mlp_layers").read_text())
    sites = result.report.rewritten
    assert len(sites) == 6
    # the first block's two rings stay inline; blocks 2 and 3 call one function per pattern
    assert [s.shared_ring is not None for s in sites] == [False, True, True, False, True, True]
    assert ring_functions(result.module) == {"cmatmul_ring_0": 2, "cmatmul_ring_1": 2}
    assert {s.shared_ring for s in sites if s.kind == "dot_reduce_scatter"} - {None} == {"@cmatmul_ring_0"}
    assert {s.shared_ring for s in sites if s.kind == "all_gather_dot"} - {None} == {"@cmatmul_ring_1"}
    assert collectives_left(result.module) == 0
    assert result.report.sites_line() == "6 of 6 candidate site(s) rewritten (4 calling 2 shared ring function(s))"
    # a sharing site reports the schedule and channels of the ring it calls
    first, shared = sites[0], sites[1]
    assert shared.schedule == first.schedule and shared.channel_handles
    assert shared.channel_handles == sites[2].channel_handles != first.channel_handles


def test_identical_blocks_are_calls_of_one_block_whose_rings_are_inline():
    """The first block becomes the function the three call: its rings stay inline there (a ring
    function would be called once); without replay the second and third blocks call the first's
    patterns' ring functions."""
    text = sample("sp_mlp_layers").read_text()
    result = cmatmul_pass.rewrite(text)
    sites = result.report.rewritten
    assert len(sites) == 6 and not any(s.shared_ring for s in sites)
    (regions,) = result.report.layers.values()  # the three blocks' regions, one call each
    assert list(result.report.layers) == ["@cmatmul_layer_0"] and len(set(regions)) == 3
    main = next(f for f in result.module.body.operations if ir.StringAttr(f.attributes["sym_name"]).value == "main")
    calls = [op for op in main.regions[0].blocks[0].operations if op.operation.name == "func.call"]
    assert [ir.FlatSymbolRefAttr(c.attributes["callee"]).value for c in calls] == ["cmatmul_layer_0"] * 3
    assert ring_functions(result.module) == {}
    layer = next(f for f in result.module.body.operations if ir.StringAttr(f.attributes["sym_name"]).value == "cmatmul_layer_0")
    permutes = ir_utils.ops_named(layer, "stablehlo.collective_permute")["stablehlo.collective_permute"]
    assert 3 * len(permutes) == sum(s.schedule["permutes"] for s in sites)  # each block's entries: its two rings
    assert collectives_left(result.module) == 0
    assert result.report.sites_line() == ("6 of 6 candidate site(s) rewritten; "
                                       "3 identical layers are calls of 1 rewritten one(s)")
    alone = _without_replay(text)
    assert ring_functions(alone.module) == {"cmatmul_ring_0": 2, "cmatmul_ring_1": 2}
    assert [bool(s.shared_ring) for s in alone.report.rewritten] == [False, True, True] * 2


def _without_replay(text: str, options: Options | None = None):
    saved = replay.MIN_MEMBERS
    replay.MIN_MEMBERS = 10**9
    try:
        return cmatmul_pass.rewrite(text, options)
    finally:
        replay.MIN_MEMBERS = saved


@pytest.fixture(scope="module")
def layers_reference():
    text = sample("sp_mlp_layers").read_text()
    return text, execute.Reference.of(ir_utils.parse(text))


@pytest.mark.parametrize("variant", [*cost.VARIANTS, "auto"])
def test_shared_rings_match_the_original(variant, layers_reference):
    """Each variant, the blocks' rings shared (without replay) and inline in the layer function."""
    text, reference = layers_reference
    shared = _without_replay(text, variant_options(variant))
    assert len(ring_functions(shared.module)) == 2
    for ring in {s.shared_ring for s in shared.report.rewritten} - {None}:  # a ring function has one variant
        assert len({s.schedule["variant"] for s in shared.report.rewritten if s.shared_ring == ring}) == 1
    replayed = cmatmul_pass.rewrite(text, variant_options(variant))
    assert replayed.report.layers and not ring_functions(replayed.module)
    for result in (shared, replayed):
        outcome = reference.check(result.module)
        assert outcome.ok, outcome.format()


def test_transformer_forward_and_backward_share_and_match():
    """Two layers of the bench's transformer step (value_and_grad): backward sums, assembled
    gathers, weight-gradient dots; the second layer's sites call ring functions."""
    fn, args = bench.transformer_step(2)
    text = fn.lower(*args).as_text()
    shared = cmatmul_pass.rewrite(text)
    own = cmatmul_pass.rewrite(text, Options(share_rings=False))
    assert len(shared.report.rewritten) == len(own.report.rewritten) == len(shared.report.sites)
    calls = ring_functions(shared.module)
    assert calls and sum(calls.values()) == sum(1 for s in shared.report.rewritten if s.shared_ring)
    assert not ring_functions(own.module)
    original = ir_utils.parse(text)
    # inputs of a trained model's scale: with standard normal weights the two layers' products reach
    # 1e31, where any change of summation order (XLA's own, between releases) moves the gradients by
    # more than f32's tolerance relative to their largest value
    inputs = [0.1 * x for x in execute.random_inputs(original)]
    reference = execute.Reference.of(original, inputs=inputs)
    for result in (shared, own):
        outcome = reference.check(result.module)
        assert outcome.ok, outcome.format()


def test_sharing_shrinks_a_deep_model():
    """From three repeats of a pattern on, the output is smaller than with a ring per site (the
    first site keeps its ring inline, the second builds the function)."""
    fn, args = bench.transformer_step(4)
    text = fn.lower(*args).as_text()
    shared = cmatmul_pass.rewrite(text)
    own = cmatmul_pass.rewrite(text, Options(share_rings=False))
    assert len(ir_utils.print_module(shared.module)) < 0.9 * len(ir_utils.print_module(own.module))
    assert_only_split_gathers_left(shared)


@pytest.mark.parametrize("options", [Options(annotate_streams=True), Options(share_rings=False)],
                         ids=["annotate_streams", "no_share_rings"])
def test_every_site_keeps_its_own_ring(options):
    result = cmatmul_pass.rewrite(sample("sp_mlp_layers").read_text(), options)
    assert len(result.report.rewritten) == 6
    assert not any(s.shared_ring for s in result.report.sites)
    assert not ring_functions(result.module)


def _two_gathers(second):
    """Two all_gather -> dot sites with equal types; ``second(g, w)`` is the second site's dot."""
    mesh = mesh_2x4()

    def body(x, y, w):
        return gather(x, "model", 0) @ w + second(gather(y, "model", 0), w)

    rows = P("model", None)
    f = smap(body, mesh=mesh, in_specs=(rows, rows, P()), out_specs=P())
    return lower(f, arg(mesh, (64, 16), rows), arg(mesh, (64, 16), rows), arg(mesh, (16, 16), P()))


@pytest.mark.parametrize(
    "second, shares",
    [
        (lambda g, w: g @ w, True),
        (lambda g, w: g @ w.T, True),  # the transpose is an input of the dot: the same pattern
        (lambda g, w: jax.lax.dot_general(g, w, (((1,), (1,)), ((), ()))), False),  # other dimension numbers
        (lambda g, w: jnp.dot(g, w, precision=jax.lax.Precision.HIGHEST), False),  # other precision_config
        (lambda g, w: jnp.dot(g, w, preferred_element_type=jnp.float32) * 2, True),
    ],
    ids=["same", "transposed_input", "contract_rhs_dim_1", "precision", "same_then_scaled"],
)
def test_only_identical_patterns_share(second, shares):
    text = _two_gathers(second)
    result = cmatmul_pass.rewrite(text)
    assert len(result.report.rewritten) == 2
    assert [s.shared_ring is not None for s in result.report.rewritten] == [False, shares]
    outcome = execute.check_numerics(ir_utils.parse(text), result.module)
    assert outcome.ok, outcome.format()


def test_scatter_reading_a_gather_keeps_its_ring_inline():
    """gather -> dot -> scatter, twice: the gather's ring takes each scatter's peeled dot, which a
    call would hide, so the scatters keep their rings inline (the gathers may share)."""
    mesh = mesh_2x4()

    def body(x, w1, w2):
        for w in (w1, w2):
            x = scatter(gather(x, "model", 1) @ w, "model", 1)
        return x

    f = smap(body, mesh=mesh, in_specs=(P(None, "model"), P(), P()), out_specs=P(None, "model"))
    text = lower(f, arg(mesh, (16, 64), P(None, "model")), arg(mesh, (64, 64), P()), arg(mesh, (64, 64), P()))
    result = cmatmul_pass.rewrite(text)
    assert len(result.report.rewritten) == 4
    assert not any(s.shared_ring for s in result.report.rewritten if s.kind == "dot_reduce_scatter")
    outcome = execute.check_numerics(ir_utils.parse(text), result.module)
    assert outcome.ok, outcome.format()


def test_collectives_differing_only_in_channel_handle_share():
    """Exporters other than jax 0.10 number every collective's channel; the ring replaces the
    collective (its permutes take fresh handles), so the handle is no part of the pattern."""
    from cmatmul_pass._jax_private import hlo

    text = sample("sp_mlp_layers").read_text()
    module = ir_utils.parse(text)
    with module.context:
        found = ir_utils.ops_named(module, "stablehlo.all_gather", "stablehlo.reduce_scatter")
        for handle, op in enumerate(found["stablehlo.all_gather"] + found["stablehlo.reduce_scatter"], start=1):
            op.attributes["channel_handle"] = hlo.ChannelHandle.get(handle, 1)
    renumbered = ir_utils.print_module(module)
    assert renumbered != ir_utils.print_module(ir_utils.parse(text))
    result = cmatmul_pass.rewrite(renumbered)
    assert ring_functions(result.module) == {"cmatmul_ring_0": 2, "cmatmul_ring_1": 2}
    outcome = execute.check_numerics(ir_utils.parse(renumbered), result.module)
    assert outcome.ok, outcome.format()


# ---------------------------------------------------------------- property: layer stacks
_LAYER = st.tuples(st.sampled_from([32, 64]), st.sampled_from(["default", "highest"]), st.booleans())


def _stack(layers) -> str:
    """SP MLP blocks, one per (ffn width, precision, relu instead of gelu), applied in turn."""
    mesh = mesh_2x4()
    rows = P("model", None)

    def body(x, *weights):
        for (ffn, precision, relu), w1, w2 in zip(layers, weights[0::2], weights[1::2]):
            prec = jax.lax.Precision.HIGHEST if precision == "highest" else None
            h = jnp.dot(gather(x, "model", 0), w1, precision=prec)
            h = jax.nn.relu(h) if relu else jax.nn.gelu(h)
            x = scatter(jnp.dot(h, w2, precision=prec), "model", 0)
        return x

    specs = [P(None, "model"), P("model", None)] * len(layers)
    f = smap(body, mesh=mesh, in_specs=(rows, *specs), out_specs=rows)
    weights = [arg(mesh, shape, spec) for ffn, _, _ in layers
               for shape, spec in (((16, ffn), P(None, "model")), ((ffn, 16), P("model", None)))]
    return lower(f, arg(mesh, (64, 16), rows), *weights)


@settings(max_examples=8, derandomize=True, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(st.lists(_LAYER, min_size=2, max_size=4))
def test_a_stack_shares_one_ring_per_repeated_pattern(layers):
    """Each (ffn width, precision) seen twice or more gets one gather and one scatter ring
    function; the activation lies outside the patterns, so it does not split them."""
    text = _stack(layers)
    result = cmatmul_pass.rewrite(text)
    assert len(result.report.rewritten) == 2 * len(layers) and collectives_left(result.module) == 0
    patterns = [(ffn, precision) for ffn, precision, _ in layers]
    repeated = {p for p in patterns if patterns.count(p) > 1}
    calls = ring_functions(result.module)
    assert len(calls) == 2 * len(repeated)
    assert sum(calls.values()) == 2 * sum(patterns.count(p) - 1 for p in repeated)
    outcome = execute.check_numerics(ir_utils.parse(text), result.module)
    assert outcome.ok, outcome.format()


def test_sites_in_a_scan_body_share():
    """One pattern before a lax.scan and twice in its body (which jax 0.10 lowers to a private
    function called from the loop, jax 0.11 inline in the loop): the first site keeps its ring,
    the two in the body call the function."""
    mesh = mesh_2x4()

    def layer(h, w):
        y = jnp.tanh(gather(h, "model", 0) @ w)
        return jax.lax.dynamic_slice_in_dim(y, jax.lax.axis_index("model") * h.shape[0], h.shape[0], 0)

    def body(x, w0, ws):
        x = layer(x, w0)
        return jax.lax.scan(lambda h, w: (layer(layer(h, w), w), None), x, ws)[0]

    f = smap(body, mesh=mesh, in_specs=(P("model", None), P(), P()), out_specs=P("model", None))
    text = lower(f, arg(mesh, (32, 16), P("model", None)), arg(mesh, (16, 16), P()), arg(mesh, (3, 16, 16), P()))
    result = cmatmul_pass.rewrite(text)
    assert len(result.report.rewritten) == 3
    assert ring_functions(result.module) == {"cmatmul_ring_0": 2}
    calls = [c for c in ir_utils.ops_named(result.module, "func.call")["func.call"]
             if ir.FlatSymbolRefAttr(c.attributes["callee"]).value == "cmatmul_ring_0"]
    assert len(calls) == 2 and all(in_loop_body(c) for c in calls)
    outcome = execute.check_numerics(ir_utils.parse(text), result.module)
    assert outcome.ok, outcome.format()


def in_loop_body(op) -> bool:
    """Is ``op`` in a stablehlo.while, or in a function other than @main (a scan body jax outlined)?"""
    parent = op.operation.parent
    while parent is not None:
        if parent.name == "stablehlo.while":
            return True
        parent = parent.parent
    return ir_utils.enclosing_func_name(op) != "main"


def test_legacy_partitioner_modules_keep_every_ring_inline():
    """Lowered without Shardy (``@shmap_body`` functions, no sdy.mesh): no ring functions."""
    from tools.samples_common import under_legacy_partitioner
    from tools.samples_layers import sp_mlp_layers

    text = under_legacy_partitioner(sp_mlp_layers)()
    assert "sdy.mesh" not in text and "shmap_body" in text
    result = cmatmul_pass.rewrite(text)
    assert len(result.report.rewritten) == 6
    assert not any(s.shared_ring for s in result.report.sites) and not ring_functions(result.module)
    outcome = execute.check_numerics(ir_utils.parse(text), result.module)
    assert outcome.ok, outcome.format()


def test_a_ring_function_builds_on_the_site_mapped_into_it(monkeypatch):
    """The site in a ring function is the matched site with its ops and values read as their
    copies there (sharing.mapped), not a second match: with the check off, no collective is
    matched again in a ring function; with it on (the suite's default), each mapped site is what
    matching the copy finds (the forward's gathers, whose values the region also returns, and the
    backward's, whose weights' casts were hoisted, included)."""
    from cmatmul_pass import phases, sharing

    fn, args = bench.transformer_step(2)
    text = fn.lower(*args).as_text()
    matched = []

    def counting(match):
        def run(op, *rest, **options):
            matched.append(op.operation.name)
            return match(op, *rest, **options)
        return run

    for name in ("match_all_gather", "match_reduce_scatter"):
        monkeypatch.setattr(phases, name, counting(getattr(phases, name)))
    checked = cmatmul_pass.rewrite(text)
    assert sharing.CHECK
    with_check = len(matched)
    matched.clear()
    monkeypatch.setattr(sharing, "CHECK", False)
    result = cmatmul_pass.rewrite(text)
    functions = ring_functions(result.module)
    assert len(functions) == 7  # the gathers' and scatters' patterns of the forward and the backward
    assert with_check - len(matched) == len(functions)  # the check's matches: one per function
    assert ir_utils.print_module(result.module) == ir_utils.print_module(checked.module)
    assert [vars(s) for s in result.report.sites] == [vars(s) for s in checked.report.sites]


def test_a_site_mapped_wrongly_into_its_ring_function_fails_the_check(monkeypatch):
    """sharing.CHECK compares the mapped site with the copy's match, field by field: a site that
    maps to another dim (a mapping bug) is an internal error, not a wrong ring: those sites are
    left as written (pass_error), the others rewritten."""
    import dataclasses

    from cmatmul_pass import sharing

    mapped = sharing.mapped

    def wrong(site, *args):
        site = mapped(site, *args)
        return dataclasses.replace(site, scatter_dim=1 - site.scatter_dim) if site.kind == "dot_reduce_scatter" else site

    monkeypatch.setattr(sharing, "mapped", wrong)
    monkeypatch.setattr(replay, "MIN_MEMBERS", 10**9)
    result = cmatmul_pass.rewrite(sample("sp_mlp_layers").read_text())
    left = [s for s in result.report.sites if s.reason_code == "pass_error"]
    assert left and all("sharing.CHECK" in s.reason for s in left)
    assert all(s.kind == "dot_reduce_scatter" for s in left) and result.report.rewritten


def test_a_split_psum_whose_scatter_only_its_own_tracer_passes_shares_its_ring(monkeypatch):
    """A psum of a norm's backward with a cotangent added (traced by the psum's matcher, which
    passes that affine DAG; the scatter matcher declines it), split: the later layers' scatter
    rings call one function built from the site mapped into it (not inline, nor its copy
    declined there). sharing.CHECK accepts it because the scatter matcher declines the original
    alike; the numbers match (a program from fuzz campaign 2771)."""
    from cmatmul_pass import sharing
    from cmatmul_pass.matchers import DeclinedSite
    from tools import fuzz_programs

    spec = fuzz_programs.Spec(
        mesh_shape=(2,), devices=(6, 4), axes=("x",), kind="psum", dim="m", side=0, batch=True, tiled=True,
        dtype="f16", consumers=1, reader=False, partial_manual=False, sizes=(2, 1, 4, 2), repeat=3, prep=False,
        early=False, scale=False, between=("tanh",), remat=False, grad=False, norm=True, cotangent=True, gain=True,
        first="", norm_kind="", gain_mode="", bias=False, raw="", upcast=False, data=False)
    text = fuzz_programs.lower(spec)
    verdicts = []
    agrees = sharing._agrees

    def spy(inner, again, anchor, match):
        verdicts.append((isinstance(again, DeclinedSite), agrees(inner, again, anchor, match)))
        return verdicts[-1][1]

    monkeypatch.setattr(sharing, "_agrees", spy)
    monkeypatch.setattr(replay, "MIN_MEMBERS", 10**9)  # the three layers rewritten one by one: sharing alone
    result = cmatmul_pass.rewrite(text, variant_options("uni", all_reduce="split"))
    split = [s for s in result.report.rewritten if s.kind == "dot_all_reduce"]
    assert len(split) == 3 and [s.shared_ring is not None for s in split] == [False, True, True]
    assert (True, True) in verdicts  # the copy declined by the scatter matcher, as the original is
    outcome = execute.check_numerics(ir_utils.parse(text), result.module)
    assert outcome.ok, outcome.format()
