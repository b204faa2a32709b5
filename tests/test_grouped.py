"""Grouped matmuls (``jax.lax.ragged_dot``) in rings: an MoE block's expert weights FSDP-gathered
over 'data' before its grouped matmuls, and their gradients scattered back, in both forms a GPU
lowering takes (``chlo.ragged_dot`` from ``jax.jit(...).lower`` there; the composite ``jax.export``
writes), checked on CPU (``cpu_copy``); the rings along the rows (tokens), the groups (experts)
and the result's group dim are declined with what stops them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import cmatmul_pass
from cmatmul_pass import domain, ir_utils, sites
from cmatmul_pass._jax_private import ir
from tests.conftest import assert_same_numbers

EXPERTS, HIDDEN, FFN, TOKENS = 4, 64, 128, 32  # tokens per device


def mesh():
    return Mesh(np.array(jax.devices()[:8]), ("data",))


def gather(w, dim):
    return jax.lax.all_gather(w, "data", axis=dim, tiled=True)


def moe_block(x, router, w_gate, w_up, w_down):
    """Top-1 routing, the tokens sorted by expert, a SwiGLU expert FFN of grouped matmuls over the
    gathered expert weights (gate and up along their columns, down along its rows), un-sorted."""
    ids = jnp.argmax(x @ router, axis=-1)
    order = jnp.argsort(ids)
    sizes = jnp.bincount(ids, length=EXPERTS).astype(jnp.int32)
    xs = x[order]
    h = jax.nn.silu(jax.lax.ragged_dot(xs, gather(w_gate, 2), sizes)) * jax.lax.ragged_dot(xs, gather(w_up, 2), sizes)
    return jax.lax.ragged_dot(h, gather(w_down, 1), sizes)[jnp.argsort(order)]


SPECS = (P("data"), P(), P(None, None, "data"), P(None, None, "data"), P(None, "data", None))
SHAPES = [(TOKENS * 8, HIDDEN), (HIDDEN, EXPERTS), (EXPERTS, HIDDEN, FFN), (EXPERTS, HIDDEN, FFN),
          (EXPERTS, FFN, HIDDEN)]


def lowered(fn, specs, shapes, form: str, dtypes=None) -> str:
    """``fn`` lowered for cuda: ``chlo.ragged_dot`` ("gpu") or the composite jax.export writes."""
    m = mesh()
    dtypes = dtypes or [jnp.float32] * len(shapes)
    args = [jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(m, sp)) for s, sp, d in zip(shapes, specs, dtypes)]
    jitted = jax.jit(fn)
    if form == "gpu":
        return jitted.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    return jax.export.export(jitted, platforms=["cuda"])(*args).mlir_module()


def moe_program(form: str, grad: bool) -> str:
    f = jax.shard_map(moe_block, mesh=mesh(), in_specs=SPECS, out_specs=P("data"))
    fn = jax.value_and_grad(lambda *a: jnp.mean(f(*a) ** 2), argnums=(2, 3, 4)) if grad else f
    return lowered(fn, SPECS, SHAPES, form)


def by_kind(result, kind: str) -> list:
    return [s for s in result.report.sites if s.kind == kind]


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "training-step"])
@pytest.mark.parametrize("form", ["gpu", "export"])
def test_an_fsdp_moe_blocks_expert_weights_ring_with_their_grouped_matmuls(form, grad):
    """The three expert weights' gathers ring with their grouped matmuls (the gate's and up's
    columns: a free dim; the down projection's rows: contracted); in the training step the
    three weight gradients (grouped matmuls contracting each group's rows) scatter in rings
    along their columns; every output as the original's."""
    text = moe_program(form, grad)
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(variant="uni", policy="all"))
    gathers, scatters = by_kind(result, "all_gather_dot"), by_kind(result, "dot_reduce_scatter")
    assert len(gathers) == 3 and all(s.rewritten for s in gathers), [s.summary_line() for s in gathers]
    assert sorted(s.dim_role for s in gathers) == ["contracting", "free", "free"]
    assert len(scatters) == (3 if grad else 0) and all(s.rewritten for s in scatters), \
        [s.summary_line() for s in scatters]
    found = ir_utils.ops_named(result.module, "stablehlo.all_gather", "stablehlo.reduce_scatter")
    assert not found["stablehlo.all_gather"] and not found["stablehlo.reduce_scatter"]
    assert_same_numbers(text, result)


@pytest.mark.parametrize("variant", ["bidi-full", "unroll2"])
def test_the_grouped_rings_in_other_variants(variant):
    text = moe_program("export", True)
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(variant=variant, policy="all"))
    assert len(result.report.rewritten) == 6, [s.summary_line() for s in result.report.sites]
    assert_same_numbers(text, result)


def test_a_block_of_a_composite_calls_the_templates_decomposition_on_padded_blocks():
    """jax.export's composite: each block's composite keeps the name and attributes and names a
    decomposition of its own types, which pads the blocks, calls the template's and slices."""
    text = moe_program("export", False)
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(variant="uni", policy="all"))
    composites = ir_utils.ops_named(result.module.operation, "stablehlo.composite")["stablehlo.composite"]
    names = {ir.FlatSymbolRefAttr(c.operation.attributes["decomposition"]).value for c in composites}
    blocks = [n for n in names if ".cmatmul_block_" in n]
    assert blocks and all(ir_utils.RAGGED_DOT in n for n in blocks), names
    functions = {ir_utils.symbol_name(f): f for f in result.module.body.operations}
    for name in blocks:
        body = ir_utils.ops_named(functions[name].operation, "stablehlo.pad", "func.call")
        assert body["stablehlo.pad"] and len(body["func.call"]) == 1
    assert result.module.operation.verify()


@pytest.mark.parametrize("strategy", ["split", "chunk"])
def test_a_psum_of_a_grouped_matmul_splits_along_its_features(strategy):
    """An expert FFN's down projection contracted over 'data'-sharded rows of its weights, psum'd:
    split or chunked along the output features (never the tokens, the ragged rows)."""
    def block(h, w_down, sizes):
        return jax.lax.psum(jax.lax.ragged_dot(h, w_down, sizes), "data")

    specs = (P(None, "data"), P(None, "data", None), P())
    f = jax.shard_map(block, mesh=mesh(), in_specs=specs, out_specs=P())
    text = lowered(f, specs, [(TOKENS, FFN), (EXPERTS, FFN, HIDDEN), (EXPERTS,)], "gpu",
                   [jnp.float32, jnp.float32, jnp.int32])
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(variant="uni", policy="all", all_reduce=strategy))
    (site,) = result.report.sites
    assert site.rewritten and site.all_reduce["dim"] == 1, site.summary_line()
    assert_same_numbers(text, result)


def declined_program(gathered: str) -> str:
    """A grouped matmul whose tokens ("rows") or experts ("experts") are gathered, or whose
    product is scattered along the tokens ("scatter rows")."""
    def block(x, w, sizes):
        if gathered == "rows":
            return jax.lax.ragged_dot(gather(x, 0), w, sizes)
        if gathered == "experts":
            return jax.lax.ragged_dot(x, gather(w, 0), sizes)
        return jax.lax.psum_scatter(jax.lax.ragged_dot(x, w, sizes), "data", scatter_dimension=0, tiled=True)

    x_spec = {"rows": P("data"), "experts": P(), "scatter rows": P(None, "data")}[gathered]
    w_spec = {"rows": P(), "experts": P("data"), "scatter rows": P(None, "data", None)}[gathered]
    out_spec = P("data") if gathered == "scatter rows" else P()
    specs = (x_spec, w_spec, P())
    f = jax.shard_map(block, mesh=mesh(), in_specs=specs, out_specs=out_spec, check_vma=False)
    return lowered(f, specs, [(TOKENS * 8, HIDDEN), (8, HIDDEN, FFN), (8,)], "gpu",
                   [jnp.float32, jnp.float32, jnp.int32])


@pytest.mark.parametrize("gathered, says", [
    ("rows", "the gathered dim is the ragged row dim of chlo.ragged_dot"),
    ("experts", "the gathered dim is the group dim of chlo.ragged_dot"),
    ("scatter rows", "the scattered dim is the ragged row dim of chlo.ragged_dot"),
])
def test_a_ring_along_the_tokens_or_the_experts_is_declined(gathered, says):
    text = declined_program(gathered)
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(variant="uni", policy="all"))
    (site,) = result.report.sites
    assert not site.rewritten and site.reason_code == "ragged_dot" and says in site.reason, site.summary_line()
    assert result.text == ir_utils.print_module(ir_utils.parse(text))


def test_a_weight_gradient_scattered_along_its_experts_is_declined():
    """Expert weights sharded along the experts (gathered whole: the group dim, declined) have
    their gradient scattered along the result's group dim: declined too, each saying which."""
    def block(x, w, sizes):
        return jax.lax.ragged_dot(x, gather(w, 0), sizes)

    specs = (P(), P("data"), P())
    f = jax.shard_map(block, mesh=mesh(), in_specs=specs, out_specs=P(), check_vma=False)
    fn = jax.grad(lambda x, w, s: jnp.sum(f(x, w, s) ** 2), argnums=1)
    text = lowered(fn, specs, [(TOKENS, HIDDEN), (8, HIDDEN, FFN), (8,)], "export",
                   [jnp.float32, jnp.float32, jnp.int32])
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(variant="uni", policy="all"))
    (scatter,) = by_kind(result, "dot_reduce_scatter")
    assert not scatter.rewritten and "the group dim of stablehlo.composite" in scatter.reason, scatter.reason
    assert all(s.reason_code == "ragged_dot" for s in result.report.sites), [s.summary_line() for s in result.report.sites]


def test_the_check_draws_group_sizes_that_cover_the_rows():
    """A group-sizes argument is drawn non-negative, summing to the grouped matmul's rows."""
    text = declined_program("rows")
    module = ir_utils.parse(text)
    (rule,) = domain.rules(module)
    assert rule.kind == domain.GROUP_SIZES and rule.argument == 2 and rule.bound == TOKENS * 8
    inputs = [np.zeros(s, np.float32) for s in [(TOKENS * 8, HIDDEN), (8, HIDDEN, FFN)]] + [np.zeros(8, np.int32)]
    (sizes,) = [x for x in domain.draw(inputs, [rule]) if x.dtype == np.int32]
    assert sizes.sum() == TOKENS * 8 and (sizes >= 0).all()


def test_a_grouped_matmuls_flops_count_each_row_once():
    """FLOPs as a dense dot of the rows against one group's matrix: 2·m·k·n for the forward,
    2·m·h·f for the weight gradient (whose result holds one matrix per group)."""
    module = ir_utils.parse(moe_program("gpu", True))
    grouped = ir_utils.ops_named(module.operation, ir_utils.RAGGED_DOT)[ir_utils.RAGGED_DOT]
    sites.forget_dots()
    assert len(grouped) == 7  # forward 3, the hidden activations' gradient 1, the weights' gradients 3
    assert {sites.dot_flops(op) for op in grouped} == {2.0 * TOKENS * HIDDEN * FFN}
