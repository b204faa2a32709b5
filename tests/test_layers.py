"""A whole tensor-parallel layer: dot→reduce_scatter rings, contracting-dim gathers, look-through of
layout ops, one ring for several dots, chains, and the backward of value_and_grad.

Every positive sample is also executed by test_numerics.py; here each capability is checked for its
structure (what the report and the module say) and, where the program is built in the test, executed
against the unrewritten program on 8 CPU devices (f32: normwise relative 1e-5; ints exact).
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax.sharding import NamedSharding, PartitionSpec as P

import cmatmul_pass
from cmatmul_pass import execute, ir_utils, layout
from cmatmul_pass.matchers import FULLY_MANUAL, ReduceScatterSite, find_dot_reduce_scatter, region_is_sum
from cmatmul_pass.rewrites import all_gather_dot, builders, dot_reduce_scatter
from conftest import assert_only_split_gathers_left, context_parallel_attention, sample


def rewrite_sample(name, **options):
    """The sample rewritten; ring structure is counted on the ``uni`` ring unless a variant is named."""
    if not {"variant", "bidirectional", "unroll"} & set(options):
        options["variant"] = "uni"
    text = sample(name).read_text()
    return text, cmatmul_pass.rewrite(text, cmatmul_pass.Options(**options), source=name)


def op_counts(module) -> dict[str, int]:
    counts: dict[str, int] = {}
    for op in ir_utils.walk(module.operation):
        counts[op.operation.name] = counts.get(op.operation.name, 0) + 1
    return counts


def numerics(original_text, module, **kwargs):
    outcome = execute.check_numerics(ir_utils.parse(original_text), module, **kwargs)
    assert outcome.ok, outcome.format()
    return outcome


def mesh_2x4():
    return jax.make_mesh((2, 4), ("data", "model"))


def arg(mesh, shape, spec, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


# ------------------------------------------------------------------ dot -> reduce_scatter
@pytest.mark.parametrize(
    "name, operand, operand_dim, scatter_dim, path",
    [
        ("rs_dot_rows", 0, 0, 0, []),
        ("rs_dot_rhs", 1, 1, 1, []),
        ("rs_dot_untiled", 0, 0, 0, ["reshape"]),
        ("rs_dot_transpose", 1, 1, 0, ["transpose"]),
        ("rs_dot_convert", 0, 0, 0, ["convert"]),
        ("rs_dot_partial_manual", 0, 0, 0, ["sharding_constraint"]),
    ],
)
def test_reduce_scatter_site_roles(name, operand, operand_dim, scatter_dim, path):
    module = ir_utils.parse(sample(name).read_text())
    with module.context:
        (site,) = find_dot_reduce_scatter(module)
    assert isinstance(site, ReduceScatterSite), site
    (term,) = site.terms
    assert (term.operand_index, term.operand_dim, site.scatter_dim) == (operand, operand_dim, scatter_dim)
    assert [step.name for step in site.path] == path


def test_reduce_scatter_ring_uses_n_minus_1_permutes_and_n_dots():
    _, result = rewrite_sample("rs_dot_1d")
    counts = op_counts(result.module)
    assert counts.get("stablehlo.reduce_scatter", 0) == 0
    # one permute in the loop body (7 trips); the peeled first block and the loop's block: 2 dots
    assert counts["stablehlo.collective_permute"] == 1 and counts["stablehlo.dot_general"] == 2
    (site,) = result.report.sites
    assert site.kind == "dot_reduce_scatter" and site.ring_size == 8 and site.bytes_per_step == 8 * 32 * 4


def test_sum_region_recognised_through_sharding_constraints():
    module = ir_utils.parse(sample("rs_dot_partial_manual").read_text())
    (rs,) = [op for op in ir_utils.walk(module.operation) if op.operation.name == "stablehlo.reduce_scatter"]
    names = [op.operation.name for op in list(rs.operation.regions[0].blocks)[0].operations]
    assert "sdy.sharding_constraint" in names and region_is_sum(rs)


def test_max_region_is_declined():
    _, result = rewrite_sample("neg_rs_not_sum")
    (site,) = result.report.sites
    assert not site.rewritten and site.reason_code == "not_sum"


@pytest.mark.parametrize("name", ["rs_dot_rows", "rs_dot_int32", "rs_dot_transpose"])
def test_a_wrong_scatter_direction_is_caught(name, monkeypatch):
    """Blocks computed for the wrong ring neighbour: the partial sums reach the wrong owners."""
    right = dot_reduce_scatter.ring_position
    monkeypatch.setattr(
        dot_reduce_scatter, "ring_position",
        lambda b, pos, rnd, n, shift, offset, **where: right(b, pos, rnd, n, -shift, -offset, **where)
    )
    text, result = rewrite_sample(name)
    outcome = execute.check_numerics(ir_utils.parse(text), result.module)
    assert not outcome.ok and "MISMATCH" in outcome.format()


# ------------------------------------------------------------------ contracting-dim gathers
def test_contracting_gather_reports_its_role_and_sums_partials():
    text, result = rewrite_sample("ag_dot_contracting")
    (site,) = result.report.sites
    assert site.rewritten and site.dim_role == "contracting" and site.collective_dim == 1
    assert op_counts(result.module).get("stablehlo.all_gather", 0) == 0
    numerics(text, result.module)


def test_bf16_contracting_gather_accumulates_in_f32():
    text, result = rewrite_sample("ag_dot_contracting_bf16")
    dots = [op for op in ir_utils.walk(result.module.operation) if op.operation.name == "stablehlo.dot_general"]
    assert {str(ir_utils.ranked_tensor(d.result).element_type) for d in dots} == {"f32"}
    outcome = numerics(text, result.module)
    assert [o.dtype for o in outcome.outputs] == ["bf16"]


@pytest.mark.parametrize("name", ["ag_dot_contracting", "ag_dot_contracting_int32"])
def test_a_wrong_contracting_ring_is_caught(name, monkeypatch):
    monkeypatch.setattr(all_gather_dot, "RECEIVE_FROM_NEXT", +1)
    text, result = rewrite_sample(name)
    assert not execute.check_numerics(ir_utils.parse(text), result.module).ok


# ------------------------------------------------------------------ look-through
@pytest.mark.parametrize(
    "name, look_through",
    [("ag_dot_untiled", ["reshape"]), ("ag_dot_convert", ["convert"]), ("ag_dot_transpose", ["transpose"]),
     ("ag_dot_partial_manual_convert", ["convert", "sharding_constraint"])],
)
def test_gather_look_through_is_reported(name, look_through):
    _, result = rewrite_sample(name)
    (site,) = result.report.sites
    assert site.rewritten and [c["look_through"] for c in site.consumers] == [look_through]


def test_converted_gather_moves_the_narrow_dtype():
    _, result = rewrite_sample("ag_dot_convert")
    (permute,) = [op for op in ir_utils.walk(result.module.operation) if op.operation.name == "stablehlo.collective_permute"]
    assert str(ir_utils.ranked_tensor(permute.result).element_type) == "bf16"


def test_reshape_that_splits_the_ring_dim_is_declined():
    _, result = rewrite_sample("neg_reshape_splits_ring_dim")
    (site,) = result.report.sites
    assert not site.rewritten and site.reason_code == "layout" and "reshape" in site.reason


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_reshape_block_rule_matches_numpy(data):
    """layout's reshape rule says block k of the operand is block k of the result exactly when it is."""
    n = data.draw(st.sampled_from([2, 3, 4]))
    src = data.draw(st.lists(st.sampled_from([1, 2, 3, 4, 6]), min_size=1, max_size=4))
    dim = data.draw(st.integers(0, len(src) - 1))
    src[dim] *= n
    total = math.prod(src)
    # a random factorisation of the same element count
    dst, rest = [], total
    for _ in range(data.draw(st.integers(0, 3))):
        divisors = [d for d in range(1, rest + 1) if rest % d == 0]
        d = data.draw(st.sampled_from(divisors))
        dst.append(d)
        rest //= d
    dst.append(rest)
    found = layout._reshape_dim(src, dim, dst, n)
    a = np.arange(total).reshape(src)
    full = a.reshape(dst)
    blocks = np.split(a, n, axis=dim)

    def works(t):
        if dst[t] % n:
            return False
        out_blocks = np.split(full, n, axis=t)
        return all(
            np.array_equal(blocks[k].reshape(out_blocks[k].shape), out_blocks[k]) for k in range(n)
        )

    if found is None:
        assert not any(works(t) for t in range(len(dst)) if dst[t] >= n)
    else:
        assert works(found)


# ------------------------------------------------------------------ one ring, several dots
def test_qkv_share_one_ring():
    text, result = rewrite_sample("ag_dot_qkv")
    (site,) = result.report.sites
    assert site.rewritten and len(site.consumers) == 3 and not site.assembled_for
    counts = op_counts(result.module)
    assert counts["stablehlo.collective_permute"] == 1 and counts.get("stablehlo.all_gather", 0) == 0
    # q, k and v share one dot per round, on their weights concatenated once before the ring: one
    # in the loop body and one in the peeled step, into one accumulator sliced three ways after it
    assert counts["stablehlo.dot_general"] == 2 and counts["stablehlo.concatenate"] == 1
    assert counts["stablehlo.slice"] == 3
    numerics(text, result.module)
    _, separate = rewrite_sample("ag_dot_qkv", merge_dots=False)
    counts = op_counts(separate.module)
    assert counts["stablehlo.dot_general"] == 6 and "stablehlo.concatenate" not in counts
    numerics(text, separate.module)


@pytest.mark.parametrize("variant", ["uni", "unroll2", "bidi-full"])
def test_weights_cast_where_used_move_up_so_the_ring_computes_every_dot(variant):
    """Each weight cast to bf16 just before its dot (and the gathered value cast too): without
    moving the k and v casts up, the ring could only go before the gathered value's cast, where no
    dot's weight exists, and the site was declined (schedule).  The casts move; nothing else does."""
    text, result = rewrite_sample("ag_dot_qkv_cast", variant=variant)
    (site,) = result.report.sites
    assert site.rewritten and len(site.consumers) == 3 and not site.assembled_for
    assert site.notes[-1] == "moved 2 op(s) computing its dots' other operands up to the ring: stablehlo.convert x2"
    assert op_counts(result.module).get("stablehlo.all_gather", 0) == 0
    numerics(text, result.module)


def hoist_program(prepare_k) -> str:
    """q = g @ wq, then k = g @ prepare_k(wk, q): the k weight prepared after the q projection."""
    mesh = mesh_2x4()

    def body(x, wq, wk):
        g = jax.lax.all_gather(x, "model", axis=0, tiled=True)
        q = g @ wq
        return q, g @ prepare_k(wk, q)

    w = P(None, "model")
    f = jax.shard_map(body, mesh=mesh, in_specs=(P("model"), w, w), out_specs=(w, w), check_vma=False)
    return jax.jit(f).lower(arg(mesh, (64, 32), P("model")), arg(mesh, (32, 64), w), arg(mesh, (32, 64), w)).as_text()


@pytest.mark.parametrize("prepare_k, moved", [
    (lambda wk, q: wk * 2.0, True),
    # reads the q projection, computed by the ring: k reads the assembled value instead
    (lambda wk, q: wk * jnp.sum(q), False),
    # an op not known to be pure stays where it is
    (lambda wk, q: jax.lax.optimization_barrier(wk), False),
    # more ops than a site moves (HOIST_LIMIT)
    (lambda wk, q: functools.reduce(lambda w, _: w * 1.5, range(20), wk), False),
])
def test_what_moves_up_for_the_ring(prepare_k, moved):
    text = hoist_program(prepare_k)
    result = cmatmul_pass.rewrite(text)
    (site,) = result.report.sites
    assert site.rewritten and len(site.consumers) == (2 if moved else 1)
    assert bool(site.assembled_for) != moved and any("moved" in n for n in site.notes) == moved
    numerics(text, result.module)


def test_a_longer_preparation_moves_under_a_higher_limit(monkeypatch):
    """The 20 scalings above are 60 ops (constant, broadcast, multiply): the limit alone kept them."""
    from cmatmul_pass.matchers import all_gather

    monkeypatch.setattr(all_gather, "HOIST_LIMIT", 60)
    text = hoist_program(lambda wk, q: functools.reduce(lambda w, _: w * 1.5, range(20), wk))
    (site,) = cmatmul_pass.rewrite(text).report.sites
    assert len(site.consumers) == 2 and site.notes[-1].startswith("moved 60 op(s)")


def test_a_site_left_unchanged_moves_nothing():
    """Ops move only when the site is rewritten: a site the policy declines leaves the module as it was."""
    text = hoist_program(lambda wk, q: wk * 2.0)
    before = str(ir_utils.parse(text))
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(policy="auto"))
    assert [s.reason_code for s in result.report.sites] == ["policy"]
    assert str(result.module) == before


def elementwise_program(prepare, dtype=jnp.float32) -> str:
    """prepare(gathered x, scale s [1], per-feature c [32], per-row r [64]) @ w on a ring of 4."""
    mesh = mesh_2x4()

    def body(x, s, c, r, w):
        return prepare(jax.lax.all_gather(x, "model", axis=0, tiled=True), s, c, r) @ w

    f = jax.shard_map(body, mesh=mesh, in_specs=(P("model"), P(), P(), P(), P()), out_specs=P(), check_vma=False)
    return jax.jit(f).lower(arg(mesh, (64, 32), P("model"), dtype), arg(mesh, (1,), P()), arg(mesh, (32,), P()),
                            arg(mesh, (64,), P()), arg(mesh, (32, 16), P())).as_text()


@pytest.mark.parametrize("variant", ["uni", "unroll2", "bidi", "bidi-full"])
@pytest.mark.parametrize("name, prepare, dtype, through", [
    # fp8 activations gathered, dequantised by a per-tensor scale (the scale's reshape moves up)
    ("dequant", lambda g, s, c, r: g.astype(jnp.float32) * s[0], jnp.float8_e4m3fn, ["convert", "multiply"]),
    ("per_feature", lambda g, s, c, r: jnp.tanh(g * c[None, :] + 1.0), jnp.float32, ["multiply", "add", "tanh"]),
    ("square", lambda g, s, c, r: g * g, jnp.float32, ["multiply"]),
])
def test_elementwise_ops_between_gather_and_dot_are_applied_per_shard(name, prepare, dtype, through, variant):
    text = elementwise_program(prepare, dtype)
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(variant=variant))
    (site,) = result.report.sites
    assert site.rewritten and [c["look_through"] for c in site.consumers] == [through]
    assert op_counts(result.module).get("stablehlo.all_gather", 0) == 0
    numerics(text, result.module)


def test_an_elementwise_op_needing_the_whole_gathered_value_is_declined():
    """g * max(g): the scale needs every shard, so neither the ring nor moving the gather to the
    dot can apply it per shard; the site is declined and the module left as it was, even where
    the cost model says a ring would pay."""
    text = elementwise_program(lambda g, s, c, r: g * jnp.max(g))
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(policy="auto", hardware="h100:bandwidth=1e6"))
    (site,) = result.report.sites
    assert site.reason_code == "schedule" and str(result.module) == str(ir_utils.parse(text))


@pytest.mark.parametrize("policy", [
    cmatmul_pass.Options(),  # the suite's policy, all
    cmatmul_pass.Options(policy="auto", hardware="h100:bandwidth=1e6"),  # a network slow enough for the ring to pay
], ids=["all", "auto"])
@pytest.mark.parametrize("prepare", [
    lambda g, s, c, r: g * r[:, None],  # a per-row scale: the same on every device, sliced to the rows
    lambda g, s, c, r: g * jnp.tanh(g),  # the value itself, row by row
], ids=["per_row_scale", "g_tanh_g"])
def test_row_wise_ops_the_ring_cannot_apply_per_shard_move_the_gather_to_the_dot(prepare, policy):
    """What the ring declines [layout] works row by row: the ops run on the shard's rows and the
    gather, moved to the dot, becomes its ring (phases.MOVABLE_DECLINES), under either policy."""
    text = elementwise_program(prepare)
    result = cmatmul_pass.rewrite(text, policy)
    (site,) = result.report.sites
    assert site.rewritten and "declined [layout]" in site.notes[0]
    assert op_counts(result.module).get("stablehlo.all_gather", 0) == 0
    numerics(text, result.module)


def test_a_motion_under_auto_is_not_made_where_its_ring_does_not_pay():
    """All or nothing: on a fast network the ring would not pay, so the gather is not moved either."""
    text = elementwise_program(lambda g, s, c, r: g * r[:, None])
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(policy="auto"))
    (site,) = result.report.sites
    assert not site.rewritten and str(result.module) == str(ir_utils.parse(text))


@pytest.mark.parametrize("variant", ["uni", "bidi-unroll2", "full"])
@pytest.mark.parametrize("prepare, through, rewritten", [
    (lambda y, s, c, r: y * s[0], ["multiply"], True),  # a per-tensor scale of each device's product
    (lambda y, s, c, r: jnp.tanh(y + c[None, :]), ["add", "tanh"], True),  # a per-column bias, an activation
    (lambda y, s, c, r: y * r[:, None], ["multiply"], True),  # a per-row scale: each block reads its rows of it
])
def test_elementwise_ops_between_dot_and_scatter_are_applied_per_block(prepare, through, rewritten, variant):
    """Each device's product goes through the op before the sum, in the original and in the ring:
    any elementwise op whose other operands are the same in every block may come between."""
    mesh = mesh_2x4()

    def body(a, b, s, c, r):
        return jax.lax.psum_scatter(prepare(a @ b, s, c, r), "model", scatter_dimension=0, tiled=True)

    f = jax.shard_map(body, mesh=mesh, in_specs=(P(None, "model"), P("model"), P(), P(), P()),
                      out_specs=P("model"), check_vma=False)
    text = jax.jit(f).lower(arg(mesh, (64, 32), P(None, "model")), arg(mesh, (32, 16), P("model")),
                            arg(mesh, (1,), P()), arg(mesh, (16,), P()), arg(mesh, (64,), P())).as_text()
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(variant=variant))
    (site,) = result.report.sites
    assert site.rewritten == rewritten
    if rewritten:
        assert [step for c in site.consumers for step in c["look_through"]] == through
        assert op_counts(result.module).get("stablehlo.reduce_scatter", 0) == 0
        numerics(text, result.module)
    else:
        assert site.reason_code == "producer_not_dot" and str(result.module) == str(ir_utils.parse(text))


def test_a_splat_constant_operand_is_rebuilt_per_block():
    """jax broadcasts a scalar; a canonicalised module holds the splat constant itself (made
    here with the bindings from jax's lowering)."""
    from cmatmul_pass._jax_private import hlo, ir

    module = ir_utils.parse(elementwise_program(lambda g, s, c, r: g * 2.0))
    (mul,) = ir_utils.ops_named(module, "stablehlo.multiply")["stablehlo.multiply"]
    broadcast = mul.operation.operands[1].owner
    assert broadcast.name == "stablehlo.broadcast_in_dim"
    with ir.InsertionPoint(broadcast), broadcast.location:
        t = ir.RankedTensorType(broadcast.result.type)
        splat = hlo.ConstantOp(ir.DenseElementsAttr.get_splat(t, ir.FloatAttr.get(t.element_type, 2.0))).result
    broadcast.result.replace_all_uses_with(splat)
    broadcast.erase()
    text = str(module)
    result = cmatmul_pass.rewrite(text)
    (site,) = result.report.sites
    assert site.rewritten and [c["look_through"] for c in site.consumers] == [["multiply"]]
    numerics(text, result.module)


def test_a_non_dot_reader_gets_the_assembled_value():
    text, result = rewrite_sample("ag_dot_assembled")
    (site,) = result.report.sites
    assert site.rewritten and site.assembled_for and site.assembled_for[0].startswith("stablehlo.tanh")
    assert op_counts(result.module).get("stablehlo.all_gather", 0) == 0
    numerics(text, result.module)


def test_assembling_can_be_switched_off():
    text, result = rewrite_sample("ag_dot_assembled", assemble=False)
    (site,) = result.report.sites
    assert not site.rewritten and site.reason_code == "multiple_users" and "tanh" in site.reason
    assert not result.changed


def test_a_dot_that_needs_a_later_value_reads_the_assembled_copy():
    """y = g @ w is computed by the ring; z = g.T @ tanh(y) needs y, so it cannot run in the same loop:
    it reads the gathered value the loop assembles (the forward dot / weight-gradient shape)."""
    mesh = mesh_2x4()

    def body(x, w):
        g = jax.lax.all_gather(x, "model", axis=0, tiled=True)
        y = g @ w
        return y, g.T @ jnp.tanh(y)

    f = jax.shard_map(body, mesh=mesh, in_specs=(P("model", None), P(None, "model")),
                      out_specs=(P(None, "model"), P(None, "model")), check_vma=False)
    text = jax.jit(f).lower(arg(mesh, (64, 32), P("model", None)), arg(mesh, (32, 64), P(None, "model"))).as_text()
    result = cmatmul_pass.rewrite(text)
    (site,) = result.report.sites
    assert site.rewritten and len(site.consumers) == 1
    assert [r.split(" at ")[0] for r in site.assembled_for] == ["stablehlo.dot_general"]
    numerics(text, result.module)


# ------------------------------------------------------------------ partial-manual regions
def test_partial_manual_position_needs_the_nested_manual_computation(monkeypatch):
    """Without the nested sdy.manual_computation, XLA refuses the bare partition_id: the wrapper matters."""
    text, result = rewrite_sample("ag_dot_partial_manual")
    numerics(text, result.module)
    plain = builders.Builder.position_in_ring
    monkeypatch.setattr(builders.Builder, "position_in_ring",
                        lambda self, ring, region=FULLY_MANUAL, moved=0: plain(self, ring, moved=moved))
    broken = cmatmul_pass.rewrite(text).module
    with pytest.raises(cmatmul_pass.ExecutionError, match="PartitionId"):
        execute.check_numerics(ir_utils.parse(text), broken)


def test_partial_manual_scatter_runs():
    text, result = rewrite_sample("rs_dot_partial_manual")
    assert result.report.sites[0].rewritten
    numerics(text, result.module)


# ------------------------------------------------------------------ chains, the SP MLP, backward
@pytest.mark.parametrize("variant", ["uni", "unroll2", "full", "bidi", "bidi-unroll2", "bidi-full"])
def test_both_collectives_around_one_dot_are_rewritten(variant):
    """In every variant: the scatter's ring, rewritten first, leaves one dot reading the gathered
    value as it is (its first piece; the others read it through their rounds' barriers), and
    the gather's ring computes that dot (were every piece tied, the gather would be left
    unchanged, user_not_dot)."""
    text, result = rewrite_sample("chain_one_dot", variant=variant)
    kinds = sorted((s.kind, s.rewritten) for s in result.report.sites)
    assert kinds == [("all_gather_dot", True), ("dot_reduce_scatter", True)]
    counts = op_counts(result.module)
    assert counts.get("stablehlo.all_gather", 0) == 0 and counts.get("stablehlo.reduce_scatter", 0) == 0
    numerics(text, result.module)


@pytest.mark.parametrize("variant", ["uni", "unroll2", "full", "bidi", "bidi-unroll2", "bidi-full"])
def test_a_matmul_of_two_gathered_operands_gets_both_rings(variant):
    """x's rows gathered over one mesh axis, w's columns over the other (a 2-D sharded matmul):
    the first gather's ring leaves a dot reading w's gathered value as it is (its block's first
    piece), which the second gather's ring computes; the ring's other dots read the copy it
    assembles."""
    mesh = mesh_2x4()

    def body(x, w):
        return (jax.lax.all_gather(x, "data", axis=0, tiled=True)
                @ jax.lax.all_gather(w, "model", axis=1, tiled=True))

    f = jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P(None, "model")), out_specs=P(), check_vma=False)
    text = jax.jit(f).lower(arg(mesh, (16, 8), P("data")), arg(mesh, (8, 16), P(None, "model"))).as_text()
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(variant=variant))
    assert [s.rewritten for s in result.report.sites] == [True, True], [s.summary_line() for s in result.report.sites]
    assert op_counts(result.module).get("stablehlo.all_gather", 0) == 0
    numerics(text, result.module)


@pytest.mark.parametrize("variant, both", [("uni", False), ("unroll2", True), ("bidi", True), ("full", True)])
def test_two_gathered_operands_on_a_ring_of_4(variant, both):
    """Both over the ring of 4 (3 sending rounds): `uni` loops over round 0 too, so the only
    dot left reading w's gathered value waits for that loop, which reads the value: w's gather
    stays (`schedule`); the other variants peel round 0 and rewrite both.  Called twice: the
    second x ring is not shared (its call would read w's gathered value), the second w ring is."""
    mesh = mesh_2x4()

    def body(x, w):
        return (jax.lax.all_gather(x, "model", axis=0, tiled=True)
                @ jax.lax.all_gather(w, "model", axis=1, tiled=True))

    f = jax.shard_map(body, mesh=mesh, in_specs=(P("model"), P(None, "model")), out_specs=P(), check_vma=False)
    text = jax.jit(lambda x, w: (f(x, w), f(x, w))).lower(
        arg(mesh, (16, 8), P("model")), arg(mesh, (8, 16), P(None, "model"))).as_text()
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(variant=variant))
    declined = sorted(s.reason_code for s in result.report.declined)
    assert declined == ([] if both else ["schedule", "schedule"]), [s.summary_line() for s in result.report.sites]
    assert len(result.report.rewritten) == (4 if both else 2)
    # the second call's x ring keeps its own ring (a call would read w's gathered value); its w ring may share
    assert [s.operand for s in result.report.rewritten if s.shared_ring] == (["rhs"] if both else [])
    numerics(text, result.module)


def test_scatter_on_the_gathered_dim_is_left_to_the_gather():
    _, result = rewrite_sample("chain_same_dim")
    by_kind = {s.kind: s for s in result.report.sites}
    assert by_kind["dot_reduce_scatter"].reason_code == "gathered_operand"
    assert by_kind["all_gather_dot"].rewritten


def test_scatter_on_the_gathered_dim_says_whether_it_is_an_all_reduce():
    """Over the same device groups the pair is an all-reduce in disguise; a 2-D layer that gathers
    rows over one mesh axis and scatters them over the other is not: its reason says the rings
    would nest.  Either way the gather's ring computes the dot, and the numbers are the original's."""
    _, same = rewrite_sample("chain_same_dim")
    (declined,) = same.report.declined
    assert "(an all-reduce in disguise)" in declined.reason
    mesh = mesh_2x4()

    def body(a, w):
        return jax.lax.psum_scatter(jax.lax.all_gather(a, "data", axis=0, tiled=True) @ w, "model",
                                    scatter_dimension=0, tiled=True)

    f = jax.shard_map(body, mesh=mesh, in_specs=(P("data", "model"), P("model", "data")),
                      out_specs=P("model", "data"), check_vma=False)
    text = jax.jit(f).lower(arg(mesh, (16, 32), P("data", "model")), arg(mesh, (32, 16), P("model", "data"))).as_text()
    result = cmatmul_pass.rewrite(text)
    by_kind = {s.kind: s for s in result.report.sites}
    scatter = by_kind["dot_reduce_scatter"]
    assert scatter.reason_code == "gathered_operand" and "disguise" not in scatter.reason
    assert "over other device groups, a ring of 2: the two rings would nest" in scatter.reason
    assert by_kind["all_gather_dot"].rewritten
    numerics(text, result.module)


def test_sp_mlp_forward_has_no_collective_left():
    text, result = rewrite_sample("sp_mlp")
    counts = op_counts(result.module)
    assert counts.get("stablehlo.all_gather", 0) == 0 and counts.get("stablehlo.reduce_scatter", 0) == 0
    numerics(text, result.module)


def test_value_and_grad_of_sp_mlp():
    """Forward and backward collectives are counted in the original and gone after the rewrite; the loss
    and the three gradients match the unrewritten program."""
    mesh = mesh_2x4()
    specs = (P("data", "model", None), P(None, "model"), P("model", None))

    def block(x, w1, w2):
        h = jax.nn.gelu(jnp.einsum("bsh,hf->bsf", jax.lax.all_gather(x, "model", axis=1, tiled=True), w1))
        return jax.lax.psum_scatter(jnp.einsum("bsf,fh->bsh", h, w2), "model", scatter_dimension=1, tiled=True)

    f = jax.shard_map(block, mesh=mesh, in_specs=specs, out_specs=P("data", "model", None))

    def loss(x, w1, w2):
        return jnp.mean(jnp.sin(f(x, w1, w2)))

    args = (arg(mesh, (4, 32, 16), specs[0]), arg(mesh, (16, 64), specs[1]), arg(mesh, (64, 16), specs[2]))
    text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(*args).as_text()
    before = op_counts(ir_utils.parse(text))
    assert (before["stablehlo.all_gather"], before["stablehlo.reduce_scatter"]) == (2, 2)
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(variant="uni", all_reduce="split"))
    after = op_counts(result.module)
    assert after.get("stablehlo.reduce_scatter", 0) == 0 and after.get("stablehlo.all_reduce", 0) == 0
    # the weight gradients' psums over 'data' are split (as asked): each leaves one gather, before the return
    split = [s for s in result.report.rewritten if s.kind == "dot_all_reduce"]
    assert len(split) == 2 and after.get("stablehlo.all_gather", 0) == 2
    assert all(s.all_reduce["gathers"][0].startswith("before sdy.return") for s in split)
    assert len(result.report.rewritten) == 6 == len(result.report.sites)
    # each ring's dots' roles (in any order: the split's row slices, moved up, can reorder the dots)
    roles = sorted("+".join(sorted(s.dim_role.split("+"))) for s in result.report.rewritten if s.kind != "dot_all_reduce")
    assert roles == ["contracting+free", "free", "free", "free"]
    outcome = numerics(text, result.module, seed=3)
    assert len(outcome.outputs) == 4  # the loss and three gradients


def test_a_sum_of_dots_is_scattered_by_one_ring():
    text, result = rewrite_sample("rs_dot_sum")
    (site,) = result.report.sites
    assert site.rewritten and len(site.consumers) == 3
    assert op_counts(result.module)["stablehlo.collective_permute"] == 1
    numerics(text, result.module)


def test_backward_of_a_shared_gather_sums_input_gradients_into_one_ring():
    """value_and_grad through q/k/v projections of one gathered input: the backward scatters
    dq @ wq.T + dk @ wk.T + dv @ wv.T; it is one site, rewritten, and the gradients match."""
    mesh = mesh_2x4()

    def body(x, wq, wk, wv):
        g = jax.lax.all_gather(x, "model", axis=0, tiled=True)
        return jnp.tanh(g @ wq) * jnp.tanh(g @ wk) + g @ wv

    col = P(None, "model")
    f = jax.shard_map(body, mesh=mesh, in_specs=(P("model", None), col, col, col), out_specs=P(None, "model"))
    args = [arg(mesh, (32, 16), P("model", None))] + [arg(mesh, (16, 32), col)] * 3
    loss = lambda *a: jnp.mean(f(*a) ** 2)  # noqa: E731
    text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3))).lower(*args).as_text()
    result = cmatmul_pass.rewrite(text)
    scatters = [s for s in result.report.sites if s.kind == "dot_reduce_scatter"]
    assert len(scatters) == 1 and scatters[0].rewritten and len(scatters[0].consumers) == 3
    assert all(s.rewritten for s in result.report.sites)
    numerics(text, result.module, seed=2)


# ------------------------------------------------------------------ batch dims
@pytest.mark.parametrize("variant", list(cmatmul_pass.cost.VARIANTS))
@pytest.mark.parametrize("name", ["ag_dot_batch", "rs_dot_batch"])
def test_batch_dim_rings_under_every_variant(name, variant):
    """The collective's dim is a batch dim of the dot: a gather's round multiplies its shard by the
    same batch block of the other operand; a scatter's block slices that block of both operands."""
    text = sample(name).read_text()
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(variant=variant))
    (site,) = result.report.sites
    assert site.rewritten and site.dim_role == "batch" and [c["dim_role"] for c in site.consumers] == ["batch"]
    numerics(text, result.module)


def test_one_ring_computes_batch_and_free_dots_in_bf16():
    """One gathered value read by a batch-role dot (through a transpose) and a free-role dot: one
    ring, both roles; bf16 (normwise relative 1e-2)."""
    mesh = mesh_2x4()

    def body(x, wb, w):
        g = jax.lax.all_gather(x, "model", axis=0, tiled=True)  # [B, S, H]: B is a batch dim below
        per_batch = jnp.einsum("shb,bhk->bsk", jnp.transpose(g, (1, 2, 0)), wb)
        shared = jnp.einsum("bsh,hk->bsk", g, w)  # B is a free dim of this dot
        return per_batch, shared

    specs = (P("model", None, None), P(), P())
    f = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=(P(), P()), check_vma=False)
    args = (arg(mesh, (8, 16, 32), specs[0], jnp.bfloat16), arg(mesh, (8, 32, 16), P(), jnp.bfloat16),
            arg(mesh, (32, 16), P(), jnp.bfloat16))
    text = jax.jit(f).lower(*args).as_text()
    for variant in ("uni", "bidi-unroll2"):
        result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(variant=variant))
        (site,) = result.report.sites
        assert site.rewritten and sorted(c["dim_role"] for c in site.consumers) == ["batch", "free"]
        assert [c["look_through"] for c in site.consumers if c["dim_role"] == "batch"] == [["transpose"]]
        assert op_counts(result.module).get("stablehlo.all_gather", 0) == 0
        numerics(text, result.module)


def test_a_batch_scatter_of_an_operand_gathered_on_that_batch_dim_is_left_to_the_gather():
    """Scattering the batch dim the rhs was gathered on is an all-reduce in disguise: the scatter is
    declined (gathered_operand) and the gather's ring computes the dot with the batch role."""
    mesh = mesh_2x4()

    def body(x, w):
        g = jax.lax.all_gather(w, "model", axis=0, tiled=True)
        return jax.lax.psum_scatter(jnp.einsum("bsh,bhk->bsk", x, g), "model", scatter_dimension=0, tiled=True)

    specs = (P(), P("model", None, None))
    f = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P("model", None, None), check_vma=False)
    text = jax.jit(f).lower(arg(mesh, (8, 16, 32), P()), arg(mesh, (8, 32, 16), specs[1])).as_text()
    result = cmatmul_pass.rewrite(text)
    by_kind = {s.kind: s for s in result.report.sites}
    assert by_kind["dot_reduce_scatter"].reason_code == "gathered_operand"
    assert by_kind["all_gather_dot"].rewritten and by_kind["all_gather_dot"].dim_role == "batch"
    numerics(text, result.module)


# ------------------------------------------------------------------ remat and scanned layers
def _remat_training_step(scan: bool, remat: bool, layers: int = 3) -> str:
    """value_and_grad of a bf16 SwiGLU block (sequence parallel: gather, gate and up, scatter),
    each layer under ``jax.checkpoint`` (the backward recomputes the forward, its gather
    included) and/or the layers under ``lax.scan`` (one body, looped)."""
    mesh = mesh_2x4()
    rows = P(("data", "model"), None)

    def block(h, w1, w3, w2):
        g = jax.lax.all_gather(h, "model", axis=0, tiled=True)
        return h + jax.lax.psum_scatter((jax.nn.silu(g @ w1) * (g @ w3)) @ w2, "model",
                                        scatter_dimension=0, tiled=True)

    smap = jax.shard_map(block, mesh=mesh, in_specs=(rows, P(None, "model"), P(None, "model"), P("model", None)),
                         out_specs=rows)
    layer = jax.checkpoint(smap) if remat else smap

    def loss(params, x):
        if scan:
            h, _ = jax.lax.scan(lambda h, p: (layer(h, *p), None), x, params)
        else:
            h = x
            for i in range(layers):
                h = layer(h, *(p[i] for p in params))
        return jnp.mean(h.astype(jnp.float32) ** 2)

    params = [arg(mesh, (layers, 64, 128), P(None, None, "model"), jnp.bfloat16),
              arg(mesh, (layers, 64, 128), P(None, None, "model"), jnp.bfloat16),
              arg(mesh, (layers, 128, 64), P(None, "model", None), jnp.bfloat16)]
    return jax.jit(jax.value_and_grad(loss)).lower(params, arg(mesh, (64, 64), rows, jnp.bfloat16)).as_text()


@pytest.mark.parametrize("scan, remat, sites", [(False, True, 14), (True, False, 4), (True, True, 5)],
                         ids=["remat", "scan", "scan+remat"])
@pytest.mark.parametrize("variant", ["uni", "bidi-unroll2"])
def test_rematerialised_and_scanned_layers(scan, remat, sites, variant):
    """Large models recompute each layer's forward in the backward (jax.checkpoint) and loop
    over their layers (lax.scan): every gather and scatter is rewritten, the recomputed
    forward's among them (3 layers: 14 sites with remat, against 11 without), and the loss
    and gradients match (inputs scaled by 0.15 so that three bf16 layers do not overflow)."""
    from cmatmul_pass.pipeline import variant_options

    text = _remat_training_step(scan, remat)
    result = cmatmul_pass.rewrite(text, variant_options(variant))
    rings = [s for s in result.report.sites if s.kind != "dot_all_reduce"]
    assert len(rings) == sites and all(s.rewritten for s in rings)
    assert_only_split_gathers_left(result)  # no collective left for any layer, recomputed or looped
    original = ir_utils.parse(text)
    inputs = [(x * 0.15).astype(x.dtype) for x in execute.random_inputs(original, 0)]
    outcome = execute.Reference.of(original, inputs=inputs).check(result.module)
    assert outcome.ok, outcome.format()


def _llama_like_training_step(layers: int = 2) -> str:
    """value_and_grad of a small Llama-like model as tensor-parallel JAX code writes it: bf16
    activations [batch, seq, hidden] sequence-parallel over "model", f32 parameters cast to
    bf16 where used, RMS norms, fused q/k/v and gate/up projections, 8 heads of 8 split over
    the ring, softmax attention, each layer under jax.checkpoint."""
    mesh = mesh_2x4()
    bf = jnp.bfloat16

    def rms(x, g):
        x32 = x.astype(jnp.float32)
        return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6) * g).astype(bf)

    def scatter(y):
        return jax.lax.psum_scatter(y, "model", scatter_dimension=1, tiled=True)

    def block(x, g1, wqkv, wo, g2, w13, w2):
        hg = jax.lax.all_gather(rms(x, g1), "model", axis=1, tiled=True)
        q, k, v = (t.reshape(*t.shape[:2], -1, 8) for t in
                   jnp.split(jnp.einsum("bsh,hd->bsd", hg, wqkv.astype(bf)), 3, axis=-1))
        att = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / np.sqrt(8), -1).astype(bf)
        o = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(*q.shape[:2], -1)
        x = x + scatter(jnp.einsum("bsd,dh->bsh", o, wo.astype(bf)))
        hg = jax.lax.all_gather(rms(x, g2), "model", axis=1, tiled=True)
        gate, up = jnp.split(jnp.einsum("bsh,hf->bsf", hg, w13.astype(bf)), 2, axis=-1)
        return x + scatter(jnp.einsum("bsf,fh->bsh", jax.nn.silu(gate) * up, w2.astype(bf)))

    act, cols, rows = P("data", "model", None), P(None, "model"), P("model", None)
    smap = jax.shard_map(block, mesh=mesh, in_specs=(act, P(), cols, rows, P(), cols, rows), out_specs=act)

    def loss(params, x):
        for p in params:
            x = jax.checkpoint(smap)(x, *p)
        return jnp.mean(x.astype(jnp.float32) ** 2)

    layer = [arg(mesh, (64,), P()), arg(mesh, (64, 192), cols), arg(mesh, (64, 64), rows), arg(mesh, (64,), P()),
             arg(mesh, (64, 256), cols), arg(mesh, (128, 64), rows)]
    return jax.jit(jax.value_and_grad(loss)).lower([layer] * layers, arg(mesh, (2, 32, 64), act, bf)).as_text()


def test_a_llama_like_training_step():
    """Every gather and scatter of the forward, the recomputed forward and the backward (22
    over two layers) becomes a ring; the loss and the f32 gradients match (bf16 sums across
    the ring: the reduction tolerance; inputs scaled by 0.2)."""
    text = _llama_like_training_step()
    result = cmatmul_pass.rewrite(text)
    rings = [s for s in result.report.sites if s.kind != "dot_all_reduce"]
    assert len(rings) == 22 and all(s.rewritten for s in rings)
    assert {s.kind for s in rings} == {"all_gather_dot", "dot_reduce_scatter"}
    assert_only_split_gathers_left(result)
    original = ir_utils.parse(text)
    inputs = [(x * 0.2).astype(x.dtype) for x in execute.random_inputs(original, 0)]
    outcome = execute.Reference.of(original, inputs=inputs).check(result.module)
    assert outcome.ok and len(outcome.outputs) == 13, outcome.format()


@pytest.mark.parametrize("variant", ["uni", "bidi-full"])
def test_context_parallel_attention_gathering_keys_and_values(variant):
    """Context parallelism by gathering keys and values over the sequence (each device keeps
    its queries): the scores' ring computes q @ k^T block by block (k's sequence is a free dim
    of that dot), the output's ring contracts p @ v over the gathered sequence, and in the
    backward the key and value gradients' psum_scatters become rings too."""
    from cmatmul_pass.pipeline import variant_options

    f, qkv = context_parallel_attention()
    text = jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v) ** 2), argnums=(0, 1, 2))).lower(*qkv).as_text()
    result = cmatmul_pass.rewrite(text, variant_options(variant))
    roles = sorted((s.kind, s.dim_role) for s in result.report.rewritten)
    assert roles == [("all_gather_dot", "contracting"), ("all_gather_dot", "free"),
                     ("dot_reduce_scatter", "free"), ("dot_reduce_scatter", "free")]
    assert len(result.report.sites) == 4
    numerics(text, result.module)
