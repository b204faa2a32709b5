"""A reduction in two stages over two mesh axes (``psum_scatter(psum(x @ w, 'model'), 'data')``,
as an FSDP x TP gradient lowers): the scatter moves before the psum, onto the product, where it
becomes a dot → reduce_scatter ring, and the psum sums the scattered block (the collective
moved to the dot).  Sums over one axis and a scatter over another commute
(``cmatmul_pass.rewrites.stages``); numerics are checked against the original on random inputs,
exactly for integers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import cmatmul_pass
from cmatmul_pass import execute, ir_utils
from cmatmul_pass.rewrites.stages import commuting_groups
from conftest import run_cli

MESH = jax.make_mesh((2, 4), ("data", "model"))
SPECS = (P(None, ("data", "model")), P(("data", "model"), None))


def body(x, w):
    return jax.lax.psum_scatter(jax.lax.psum(x @ w, "model"), "data", scatter_dimension=0, tiled=True)


def program(dtype=jnp.float32, rows: int = 32, also_psum: bool = False) -> str:
    """``x @ w`` with the contraction sharded over both axes: summed over 'model', then
    sum-scattered over 'data' (and, ``also_psum``, the psum returned as well)."""
    def two(x, w):
        y = jax.lax.psum(x @ w, "model")
        return jax.lax.psum_scatter(y, "data", scatter_dimension=0, tiled=True), y

    fn, out = (two, (P("data"), P("data"))) if also_psum else (body, P("data"))
    f = jax.shard_map(fn, mesh=MESH, in_specs=SPECS, out_specs=out, check_vma=False)
    args = [jax.ShapeDtypeStruct(s, dtype, sharding=NamedSharding(MESH, sp))
            for s, sp in zip([(rows, 64), (64, 16)], SPECS)]
    return jax.jit(f).lower(*args).as_text()


def ops(module, name: str) -> list:
    return [op for op in ir_utils.walk(module.operation) if op.operation.name == name]


def scatter_entry(result):
    (entry,) = [s for s in result.report.sites if s.kind == "dot_reduce_scatter"]
    return entry


# every ring variant, floats and integers; and the psums' other strategies
CASES = [(v, d, "split") for v in ("uni", "bidi", "unroll2", "full", "bidi-full", "auto")
         for d in (jnp.float32, jnp.int32)] + [("auto", jnp.float32, "chunk"), ("auto", jnp.float32, "keep")]


@pytest.mark.parametrize("variant, dtype, strategy", CASES)
def test_the_scatter_moves_before_the_psum_and_rings_with_the_dot(variant, dtype, strategy):
    """Whatever the psums' strategy: the scatter moves first, so the psum is never split or
    chunked (a ring and a gather ahead of the scatter) and reads no dot."""
    text = program(dtype)
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(variant=variant, all_reduce=strategy, chunks=2))
    entry = scatter_entry(result)
    assert entry.rewritten, entry.summary_line()
    assert entry.notes[0].startswith("moved before the psum at <input>:"), entry.notes
    assert "this device's 1/2 of it (1024 B instead of 2048 B per device)" in entry.notes[0], entry.notes[0]
    assert not [s for s in result.report.sites if s.kind == "dot_all_reduce"]  # the psum reads no dot now
    (psum,) = ops(result.module, "stablehlo.all_reduce")
    assert ir_utils.ranked_tensor(psum.operation.operands[0]).shape == [16, 16]  # the scattered block
    assert psum.operation.operands[0].owner.operation.name != "stablehlo.dot_general"
    assert not ops(result.module, "stablehlo.reduce_scatter")  # the scatter is a ring of permutes
    outcome = execute.check_numerics(ir_utils.parse(text), result.module)
    assert outcome.ok, outcome.format()


def test_through_cmatmul_pass_jit_the_result_is_the_original():
    f = jax.shard_map(body, mesh=MESH, in_specs=SPECS, out_specs=P("data"), check_vma=False)
    kx, kw = jax.random.split(jax.random.key(3))
    x = jax.device_put(jax.random.randint(kx, (32, 64), -8, 8), NamedSharding(MESH, SPECS[0]))
    w = jax.device_put(jax.random.randint(kw, (64, 16), -8, 8), NamedSharding(MESH, SPECS[1]))
    wrapped = cmatmul_pass.jit(f)
    np.testing.assert_array_equal(np.asarray(wrapped(x, w)), np.asarray(jax.jit(f)(x, w)))
    (entry,) = [s for s in wrapped.report.sites if s.kind == "dot_reduce_scatter"]
    assert entry.rewritten and entry.notes[0].startswith("moved before the psum"), entry.notes


def test_the_cli_says_where_the_psum_went(tmp_path, capsys):
    path = tmp_path / "two_stage.mlir"
    path.write_text(program())
    assert run_cli("explain", path) == 0
    out = capsys.readouterr().out
    assert "moved before the psum at " in out and "1 of 1 candidate site(s) rewritten" in out, out
    assert run_cli("check", path) == 0
    assert "numerics: OK" in capsys.readouterr().out


def test_a_psum_also_read_elsewhere_stays_and_the_scatter_says_why():
    """The psum's whole value is returned too: moving the scatter before it would need the psum
    kept as well (more bytes), so nothing moves and the scatter's reason says why."""
    text = program(also_psum=True)
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(all_reduce="keep"))
    entry = scatter_entry(result)
    assert not entry.rewritten and entry.reason_code == "multiple_users", entry.summary_line()
    assert "read by sdy.return at " in entry.reason, entry.reason
    assert entry.reason.endswith("; not moved before the psum: the psum's result is also read elsewhere, so it "
                                 "must stay whole"), entry.reason


def test_mesh_axes_groups_commute_and_others_do_not():
    model = np.array([[0, 1, 2, 3], [4, 5, 6, 7]])
    data = np.array([[0, 4], [1, 5], [2, 6], [3, 7]])
    assert commuting_groups(model, data) is None and commuting_groups(data, model) is None
    # the same devices twice: the psum would add other devices' blocks
    assert "other positions" in commuting_groups(model, model)
    # data groups listed in another order within a model group: blocks would mix
    assert "other positions" in commuting_groups(model, np.array([[0, 4], [5, 1], [2, 6], [3, 7]]))
    # groups over different devices
    assert "do not cover" in commuting_groups(model[:1], data)


def test_under_policy_auto_a_ring_that_does_not_pay_leaves_the_program_as_written():
    """The move serves the ring: where ``--policy auto`` leaves the moved scatter's ring (a dot
    far too small to hide a transfer), the module is put back exactly as it was, the psum is
    priced as a psum of a dot again, and the scatter says why it did not move."""
    text = program()
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(policy="auto"))
    assert result.text == ir_utils.print_module(ir_utils.parse(text))
    entry = scatter_entry(result)
    assert not entry.rewritten and not entry.notes
    assert "; not moved before the psum: its ring there would not be built either: predicted speed-up " \
        in entry.reason, entry.reason
    (psum,) = [s for s in result.report.sites if s.kind == "dot_all_reduce"]
    assert psum.reason_code == "policy", psum.summary_line()


def test_under_policy_auto_a_ring_that_pays_is_moved():
    """bf16 [8192, 8192] @ [8192, 8192] on h100: the scatter's ring pays, so it moves."""
    f = jax.shard_map(body, mesh=MESH, in_specs=SPECS, out_specs=P("data"), check_vma=False)
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=NamedSharding(MESH, sp))
            for s, sp in zip([(8192, 8192), (8192, 8192)], SPECS)]
    result = cmatmul_pass.rewrite(jax.jit(f).lower(*args).as_text(),
                                  cmatmul_pass.Options(policy="auto", hardware="h100"))
    entry = scatter_entry(result)
    assert entry.rewritten and entry.notes[0].startswith("moved before the psum"), entry.summary_line()


def _simulate(a: np.ndarray, b: np.ndarray, psum_first: bool) -> dict[int, np.ndarray]:
    """Each device's result of ``reduce_scatter(all_reduce(x, a), b)`` (``psum_first``) or of
    ``all_reduce(reduce_scatter(x, b), a)``, on symbolic inputs: device d's x holds a one-hot
    row per block, so the result counts which device's which block was summed."""
    n, parts = int(a.size), b.shape[1]
    x = {d: np.stack([np.eye(n * parts)[d * parts + k] for k in range(parts)]) for d in range(n)}
    group_a = {int(d): [int(e) for e in row] for row in a for d in row}
    group_b = {int(d): [int(e) for e in row] for row in b for d in row}

    def psum(v, groups):
        return {d: sum(v[e] for e in groups[d]) for d in v}

    def scatter(v, groups):
        return {d: sum(v[e] for e in groups[d])[groups[d].index(d)] for d in v}

    return scatter(psum(x, group_a), group_b) if psum_first else psum(scatter(x, group_b), group_a)


from hypothesis import given, settings, strategies as st  # noqa: E402


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([(2, 4), (4, 2), (2, 2, 2), (8,), (1, 8), (2, 3)]), st.data())
def test_the_groups_check_agrees_with_both_orders_computed(mesh_shape, data):
    """For groups over random mesh axes (devices permuted at random, and each group's order
    shuffled at times), ``commuting_groups`` says the two orders agree exactly when a simulation
    of both gives every device the same sum."""
    ids = np.array(data.draw(st.permutations(range(int(np.prod(mesh_shape)))))).reshape(mesh_shape)
    axes = list(range(len(mesh_shape)))
    pick_a = data.draw(st.lists(st.sampled_from(axes), min_size=1, max_size=len(axes), unique=True))
    pick_b = data.draw(st.lists(st.sampled_from(axes), min_size=1, max_size=len(axes), unique=True))

    def groups(picked):
        rest = [ax for ax in axes if ax not in picked]
        rows = np.transpose(ids, rest + picked).reshape(-1, int(np.prod([mesh_shape[ax] for ax in picked])))
        if data.draw(st.booleans()):  # one group listed in another order
            rows = rows.copy()
            rows[0] = rows[0][::-1]
        return rows

    a, b = groups(pick_a), groups(pick_b)
    before, after = _simulate(a, b, True), _simulate(a, b, False)
    agree = all(np.array_equal(before[d], after[d]) for d in before)
    assert (commuting_groups(a, b) is None) == agree, (a.tolist(), b.tolist())


def test_a_reshape_between_the_psum_and_the_scatter_moves_with_the_scatter():
    """``psum_scatter(..., tiled=False)`` lowers with a reshape between the psum and the scatter
    (the rows split into [devices, rows / devices]): the reshape is the same on every device, so
    it moves along, applied to the product, and the scatter still rings with the dot."""
    def untiled(x, w):
        y = jax.lax.psum(x @ w, "model")
        return jax.lax.psum_scatter(y.reshape(2, 16, 16), "data", scatter_dimension=0, tiled=False)

    f = jax.shard_map(untiled, mesh=MESH, in_specs=SPECS, out_specs=P("data"), check_vma=False)
    args = [jax.ShapeDtypeStruct(s, jnp.float32, sharding=NamedSharding(MESH, sp))
            for s, sp in zip([(32, 64), (64, 16)], SPECS)]
    text = jax.jit(f).lower(*args).as_text()
    assert "stablehlo.reshape" in text
    result = cmatmul_pass.rewrite(text)
    entry = scatter_entry(result)
    assert entry.rewritten and entry.notes[0].startswith("moved before the psum"), entry.summary_line()
    (psum,) = ops(result.module, "stablehlo.all_reduce")
    assert psum.operation.operands[0].owner.operation.name != "stablehlo.dot_general"
    outcome = execute.check_numerics(ir_utils.parse(text), result.module)
    assert outcome.ok, outcome.format()
