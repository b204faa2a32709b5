"""Decline reasons checked against the IR: the op a reason names is what stops the rewrite, and
what its hint says would change it does (the samples lm_fsdp_tp_scan and fsdp_tp_grad).

A reduction in two stages (``psum_scatter`` over one mesh axis of a ``psum`` over another) was
declined as a scatter of "stablehlo.all_gather ... which the ring cannot apply block by block":
the all_gather the pass had made itself when it split the psum.  Of a dot's product, the scatter
now moves before the psum and rings with the dot (tests/test_two_stage_reduction.py); where it
cannot, the reason says the value is already summed over the other axis's devices, and what would
be one ring: one psum_scatter over both axes (checked below: that program is rewritten, one ring
over every device).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import cmatmul_pass
from cmatmul_pass import execute, ir_utils
from conftest import module_line, sample

MESH = jax.make_mesh((2, 4), ("data", "model"))


def two_stage(one_collective: bool = False, scatter_rows: int = 32) -> str:
    """A row-parallel dot's product summed over 'model', then sum-scattered over 'data' (FSDP x TP:
    a gradient's two reductions), or (``one_collective``) sum-scattered over both axes at once."""
    def body(x, w):
        y = x @ w
        if one_collective:
            return jax.lax.psum_scatter(y, ("data", "model"), scatter_dimension=0, tiled=True)
        return jax.lax.psum_scatter(jax.lax.psum(y, "model"), "data", scatter_dimension=0, tiled=True)

    specs = (P(None, ("data", "model")), P(("data", "model"), None))
    out = P(("data", "model")) if one_collective else P("data")
    f = jax.shard_map(body, mesh=MESH, in_specs=specs, out_specs=out, check_vma=False)
    args = [jax.ShapeDtypeStruct(s, jnp.float32, sharding=NamedSharding(MESH, sp))
            for s, sp in zip([(scatter_rows, 64), (64, 16)], specs)]
    return jax.jit(f).lower(*args).as_text()


def scatter_entry(result):
    (entry,) = [s for s in result.report.sites if s.kind == "dot_reduce_scatter"]
    return entry


def test_the_hint_of_a_two_stage_reduction_is_true():
    """The one psum_scatter over both axes the reason suggests is rewritten: one ring over 8."""
    result = cmatmul_pass.rewrite(two_stage(one_collective=True))
    entry = scatter_entry(result)
    assert entry.rewritten and len(entry.replica_groups[0]) == 8, entry.summary_line()


def test_the_sample_two_stage_scatters_say_what_they_are():
    """lm_fsdp_tp_scan: the scatter at module line +106 of the psum at +101 of a dot's product
    moves before the psum and rings with the dot (tests/test_two_stage_reduction.py); the scatter
    at +192 reads the psum at +187 of an embedding gradient's stablehlo.scatter (no dot: no ring
    for either stage, and nothing moves)."""
    text = sample("lm_fsdp_tp_scan").read_text()
    result = cmatmul_pass.rewrite(text)
    line = {k: module_line("lm_fsdp_tp_scan", k) for k in (101, 106, 182, 187, 192)}
    by_line = {s.location.rsplit(":", 2)[-2]: s for s in result.report.sites if s.kind == "dot_reduce_scatter"}
    first, second = by_line[str(line[106])], by_line[str(line[192])]
    assert first.rewritten and first.notes[0].startswith(f"moved before the psum at <input>:{line[101]}:13"), first.notes
    assert not any(s.location.endswith(f":{line[101]}:13") for s in result.report.sites)  # no longer a psum of a dot
    assert second.reason_code == "producer_not_dot"
    assert f"stablehlo.all_reduce at <input>:{line[187]}:13 (a psum)" in second.reason, second.reason
    assert f"the first stage sums stablehlo.scatter at <input>:{line[182]}:13, not a matmul's product, so no ring " \
           "applies to either stage" in second.reason, second.reason
    assert "not moved" not in second.reason  # the move was tried and undone: nothing to say of it


def test_a_scatter_of_a_psum_over_the_same_devices_says_so():
    """psum then psum_scatter over one axis: no second axis to name."""
    m = jax.make_mesh((8,), ("m",))
    f = jax.shard_map(lambda x, w: jax.lax.psum_scatter(jax.lax.psum(x @ w, "m"), "m", scatter_dimension=0,
                                                        tiled=True),
                      mesh=m, in_specs=(P(None, "m"), P("m", None)), out_specs=P("m"), check_vma=False)
    args = [jax.ShapeDtypeStruct(s, jnp.float32, sharding=NamedSharding(m, sp))
            for s, sp in [((32, 64), P(None, "m")), ((64, 16), P("m", None))]]
    result = cmatmul_pass.rewrite(jax.jit(f).lower(*args).as_text(), cmatmul_pass.Options(all_reduce="keep"))
    reason = scatter_entry(result).reason
    assert reason.startswith("the scattered value is already summed over the same devices: "), reason
    assert "two mesh axes" not in reason


@pytest.mark.parametrize("variant", ["auto", "bidi-full"])
def test_lost_to_ring_does_not_depend_on_the_ring_variant(variant):
    """Which collective gets the ring is decided by slack before any variant applies: bidi-full
    leaves the same sites lost_to_ring in both samples, and lost_to_ring's hint does not offer a
    bidirectional variant as serving both collectives."""
    from cmatmul_pass.reasons import REASONS

    for name, line in (("fsdp_tp", "218:12"), ("fsdp_tp_grad", "524:13")):
        result = cmatmul_pass.rewrite(sample(name).read_text(), cmatmul_pass.Options(variant=variant))
        (entry,) = [s for s in result.report.sites if s.location.endswith(line)]
        assert entry.reason_code == "lost_to_ring", entry.summary_line()
    hint = REASONS["lost_to_ring"].hint
    assert "serve both" not in hint and "prefetchable" in hint


def _lookup(one_hot: bool) -> str:
    """An embedding table sharded by vocabulary over 'm', gathered whole, then looked up in (or,
    ``one_hot``, multiplied by the ids' one-hot rows), and the rows projected by a matmul."""
    m = jax.make_mesh((8,), ("m",))

    def body(ids, table, w):
        full = jax.lax.all_gather(table, "m", axis=0, tiled=True)
        rows = jax.nn.one_hot(ids, 64, dtype=full.dtype) @ full if one_hot else full[ids]
        return rows @ w

    f = jax.shard_map(body, mesh=m, in_specs=(P(), P("m", None), P()), out_specs=P(), check_vma=False)
    args = [jax.ShapeDtypeStruct((16,), jnp.int32, sharding=NamedSharding(m, P())),
            jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=NamedSharding(m, P("m", None))),
            jax.ShapeDtypeStruct((32, 8), jnp.float32, sharding=NamedSharding(m, P()))]
    return jax.jit(f).lower(*args).as_text()


def test_a_gathered_table_looked_up_in_says_so_and_its_one_hot_form_is_rewritten():
    """The embedding lookup's decline (sample lm_fsdp_tp_scan, module line +4) names the lookup and
    what avoids gathering the table; the one-hot matmul it offers is a contracting-dim ring."""
    result = cmatmul_pass.rewrite(sample("lm_fsdp_tp_scan").read_text())
    (entry,) = [s for s in result.report.sites if s.location.endswith(f":{module_line('lm_fsdp_tp_scan', 4)}:12")]
    assert entry.reason_code == "user_not_dot"
    assert entry.reason.startswith(f"the gathered value is a table that stablehlo.gather at "
                                   f"<input>:{module_line('lm_fsdp_tp_scan', 13)}:13 looks rows up in (an embedding "
                                   "lookup)"), entry.reason
    (entry,) = [s for s in cmatmul_pass.rewrite(_lookup(False)).report.sites if s.kind == "all_gather_dot"]
    assert "(an embedding lookup)" in entry.reason and "one-hot matmul" in entry.reason, entry.reason
    text = _lookup(True)
    result = cmatmul_pass.rewrite(text)
    (entry,) = [s for s in result.report.sites if s.kind == "all_gather_dot"]
    assert entry.rewritten and "contracting" in entry.summary_line(), entry.summary_line()
    outcome = execute.check_numerics(ir_utils.parse(text), result.module)
    assert outcome.ok, outcome.format()


def test_a_gather_not_moved_past_its_norm_says_why():
    """rs_norm_backward: the forward's row gather (4 lines into the module) reaches its dot through an RMS norm, and the
    gathered rows also leave the region whole (the backward's residual). Moved past the norm
    they would cross the wire twice, so the gather rings with its dot instead, the
    ring applying the norm to each block and assembling the raw rows (tests/test_gather_norm_ring.py).
    Without assembling (--no-assemble) neither is possible, and the reason says why: what the
    ring cannot apply, and why the gather does not move."""
    text = sample("rs_norm_backward").read_text()
    gather, ret = module_line("rs_norm_backward", 4), module_line("rs_norm_backward", 60)
    (entry,) = [s for s in cmatmul_pass.rewrite(text).report.sites if s.location.endswith(f":{gather}:13")]
    assert entry.rewritten and f"sdy.return at <input>:{ret}:7" in entry.assembled_for, entry.summary_line()
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(assemble=False))
    (entry,) = [s for s in result.report.sites if s.location.endswith(f":{gather}:13")]
    assert entry.reason_code == "layout"
    assert entry.reason.endswith("; not moved to its dot: moved past the row-wise ops to its dot, it would still be "
                                 f"gathered whole for sdy.return at <input>:{ret}:7 (not a dot), so the rows would "
                                 "cross the wire twice"), entry.reason


def test_a_gather_whose_move_would_gather_more_bytes_says_so():
    """The norm of the gathered rows and its tanh each feed a dot: moved past them, both results
    would need a gather, twice the bytes, so the gather does not move; the ring applies the norm
    and the tanh to each block it receives instead, and its note says why it did not move."""
    m = jax.make_mesh((8,), ("m",))

    def body(x, w1, w2):
        h = jax.lax.all_gather(x, "m", axis=0, tiled=True)
        a = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6)
        return a @ w1 + jnp.tanh(a) @ w2

    f = jax.shard_map(body, mesh=m, in_specs=(P("m"), P(), P()), out_specs=P(), check_vma=False)
    args = [jax.ShapeDtypeStruct(s, jnp.float32, sharding=NamedSharding(m, sp))
            for s, sp in [((64, 32), P("m")), ((32, 16), P()), ((32, 16), P())]]
    text = jax.jit(f).lower(*args).as_text()
    for assemble in (True, False):  # (nothing is assembled: the raw rows feed the two dots only)
        (entry,) = cmatmul_pass.rewrite(text, cmatmul_pass.Options(assemble=assemble)).report.sites
        assert entry.rewritten and len(entry.consumers) == 2 and not entry.assembled_for, entry.summary_line()
        assert entry.notes[0] == ("rung with the row-wise ops before its dots applied to each block it receives, not "
                                  "moved past them: moved past the row-wise ops, 2 of their results would each be "
                                  "gathered for its dots, more bytes than the one gather moves now (where it stood: "
                                  "declined [layout])"), entry.notes


def test_an_moe_block_in_the_dense_form_the_ragged_dot_hint_names_is_rewritten():
    """The ragged_dot decline's hint: the capacity-padded dense form of an MoE block (a one-hot
    dispatch einsum, the experts' einsums, a combine einsum) puts dense matmuls next to the
    tokens' gather and the output's psum_scatter, and both ring."""
    from cmatmul_pass.reasons import REASONS

    assert "dense form" in REASONS["ragged_dot"].hint
    mesh = jax.make_mesh((8,), ("m",))
    tokens, hidden, ffn, experts, capacity = 64, 32, 128, 4, 32

    def block(x, dispatch, w1, w2):
        xs = jax.lax.all_gather(x, "m", axis=0, tiled=True)
        xe = jnp.einsum("tec,th->ech", dispatch, xs)
        ye = jnp.einsum("ecf,efh->ech", jax.nn.gelu(jnp.einsum("ech,ehf->ecf", xe, w1)), w2)
        return jax.lax.psum_scatter(jnp.einsum("tec,ech->th", dispatch, ye), "m", scatter_dimension=0, tiled=True)

    specs = (P("m", None), P(), P(None, None, "m"), P(None, "m", None))
    f = jax.shard_map(block, mesh=mesh, in_specs=specs, out_specs=P("m", None), check_vma=False)
    shapes = [(tokens, hidden), (tokens, experts, capacity), (experts, hidden, ffn), (experts, ffn, hidden)]
    args = [jax.ShapeDtypeStruct(s, jnp.float32, sharding=NamedSharding(mesh, sp)) for s, sp in zip(shapes, specs)]
    text = jax.jit(f).lower(*args).as_text()
    result = cmatmul_pass.rewrite(text)
    assert sorted(s.kind for s in result.report.rewritten) == ["all_gather_dot", "dot_reduce_scatter"]
    assert len(result.report.sites) == 2
    outcome = execute.check_numerics(ir_utils.parse(text), result.module)
    assert outcome.ok, outcome.format()
