"""2-D meshes (FSDP × tensor parallel): where a weight's gather over 'data' and an
activation's collective over 'model' meet at one dot, the collective on the critical path gets
the ring (analysis.slack); the other is left as a plain collective that says why."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import cmatmul_pass
from cmatmul_pass import execute, ir_utils
from cmatmul_pass.analysis.slack import Slack
from cmatmul_pass.matchers import ModuleInfo, match_all_gather
from cmatmul_pass.sites import dot_flops as _dot_flops


def fsdp_tp(layers: int, mesh_shape=(2, 4), axes=("data", "model"), embed: bool = True, bias: bool = False,
            remat: bool = False):
    """Dense blocks: weights sharded over 'data' (FSDP, gathered where used) and 'model'
    (tensor parallel); activations' rows over 'data', their sequence over 'model'.  ``bias``: the
    up projection adds a bias sharded over 'model'; ``remat``: each block under jax.checkpoint
    (the backward gathers the weights again)."""
    data, model = "data", "model"  # ``axes``: their order in the mesh
    mesh = jax.make_mesh(mesh_shape, axes)

    def block(x, w1, w2, b1):
        w1f = jax.lax.all_gather(w1, data, axis=0, tiled=True)
        w2f = jax.lax.all_gather(w2, data, axis=1, tiled=True)
        up = jax.lax.all_gather(x, model, axis=1, tiled=True) @ w1f
        h = jax.nn.gelu(up + b1 if bias else up)
        return jax.lax.psum_scatter(h @ w2f, model, scatter_dimension=1, tiled=True)

    specs = (P(data, model, None), P(data, model), P(model, data), P(model))
    f = jax.shard_map(block, mesh=mesh, in_specs=specs, out_specs=specs[0])
    f = jax.checkpoint(f) if remat else f

    def model_fn(x, w_in, *ws):
        if embed:  # the first block's input is computed (an embedding's stand-in)
            x = jnp.tanh(x @ w_in)
        for w1, w2, b1 in zip(ws[0::3], ws[1::3], ws[2::3]):
            x = x + f(x, w1, w2, b1)
        return x

    shapes = [(4, 32, 16), (16, 16)] + [(16, 64), (64, 16), (64,)] * layers
    args = [jax.ShapeDtypeStruct(s, jnp.float32, sharding=NamedSharding(mesh, sp))
            for s, sp in zip(shapes, specs[:1] + (P(),) + specs[1:] * layers)]
    return mesh, model_fn, args


def lowered(layers, grad=False, **kw):
    mesh, model_fn, args = fsdp_tp(layers, **kw)
    fn = model_fn
    if grad:
        fn = jax.value_and_grad(lambda *a: jnp.mean(model_fn(*a) ** 2), argnums=tuple(range(len(args))))
    return jax.jit(fn).lower(*args).as_text()


def activation_collectives_rewritten(result):
    """Every collective over 'model' (rings of 4) is rewritten; every weight gather over 'data'
    (rings of 2) is rewritten or says why not."""
    by_ring = {4: [], 2: []}
    for site in result.report.sites:
        by_ring[site.ring_size].append(site)
    assert by_ring[4] and all(s.rewritten for s in by_ring[4]), [s.summary_line() for s in by_ring[4]]
    left = [s for s in by_ring[2] if not s.rewritten]
    assert all(s.reason_code in ("prefetchable", "lost_to_ring") for s in left), [s.summary_line() for s in left]
    return left


@pytest.mark.parametrize("variant", ["uni", "unroll2", "bidi-full"])
@pytest.mark.parametrize("grad", [False, True], ids=["forward", "value_and_grad"])
def test_fsdp_tp_rings_every_activation_collective(grad, variant):
    text = lowered(2, grad)
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(variant=variant))
    activation_collectives_rewritten(result)
    outcome = execute.check_numerics(ir_utils.parse(text), result.module)
    assert outcome.ok, outcome.format()


@pytest.mark.parametrize("variant", ["uni", "bidi-unroll2"])
def test_fsdp_tp_training_step_with_biases_and_remat(variant):
    """value_and_grad with a bias in every block and each block rematerialised: the backward
    gathers the weights again. Every collective over 'model' is rewritten; the weights' gathers are
    rewritten or prefetchable / lost_to_ring; the bias gradients' psums over 'data' sum a
    reduction, no dot (producer_not_dot); the numbers match, through the CLI's check too."""
    text = lowered(2, True, bias=True, remat=True)
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(variant=variant))
    model = [s for s in result.report.sites if s.ring_size == 4]
    assert model and all(s.rewritten for s in model), [s.summary_line() for s in model if not s.rewritten]
    left = [s for s in result.report.sites if s.ring_size == 2 and not s.rewritten]
    assert all(s.reason_code in ("prefetchable", "lost_to_ring") if s.kind == "all_gather_dot"
               else s.reason_code == "producer_not_dot" for s in left), [s.summary_line() for s in left]
    assert sum(1 for s in result.report.sites if s.kind == "all_gather_dot" and s.ring_size == 2) >= 8  # remat
    outcome = execute.check_numerics(ir_utils.parse(text), result.module)
    assert outcome.ok, outcome.format()


def test_the_cli_checks_an_fsdp_tp_training_step(tmp_path):
    from conftest import run_cli, sample

    assert run_cli("check", sample("fsdp_tp_grad"), "--report-json", tmp_path / "r.json") == 0


@pytest.mark.parametrize("mesh_shape, axes", [((4, 2), ("data", "model")), ((2, 4), ("model", "data"))],
                         ids=["4x2", "axes_swapped"])
def test_other_meshes_and_axis_orders(mesh_shape, axes):
    text = lowered(2, True, mesh_shape=mesh_shape, axes=axes)
    result = cmatmul_pass.rewrite(text)
    model_ring = mesh_shape[axes.index("model")]
    assert all(s.rewritten for s in result.report.sites if s.ring_size == model_ring)
    assert all(s.rewritten or s.reason_code in ("prefetchable", "lost_to_ring") for s in result.report.sites)
    outcome = execute.check_numerics(ir_utils.parse(text), result.module)
    assert outcome.ok, outcome.format()


def test_the_second_layers_weight_gather_is_prefetchable_behind_the_first_layer():
    """Layer 2's weight is an argument: its gather can be sent while layer 1 computes. Layer 2's
    activation is layer 1's output: nothing but the ring hides its gather."""
    result = cmatmul_pass.rewrite(lowered(2), cmatmul_pass.Options(variant="uni"))  # a looped ring keeps the dot
    prefetchable = [s for s in result.report.sites if s.reason_code == "prefetchable"]
    assert prefetchable, [s.summary_line() for s in result.report.sites]
    for site in prefetchable:
        assert site.slack["early"] and site.slack["hiding_flops"] > 0 and site.slack["competes_with"]
        assert "--xla_gpu_enable_latency_hiding_scheduler=true" in site.reason
    assert not [s for s in result.report.sites if s.reason_code == "lost_to_ring"]


def test_with_both_operands_ready_early_the_program_order_stands():
    """A first layer fed straight from the step's arguments: neither collective has more slack,
    so nothing is reordered; the one first in the program (the weight's) gets the ring and the
    activation's says why it did not."""
    text = lowered(1, embed=False)
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(variant="uni"))
    (lost,) = [s for s in result.report.sites if not s.rewritten]
    assert lost.reason_code == "lost_to_ring" and lost.slack["early"] and lost.slack["hiding_flops"] == 0
    assert lost.ring_size == 4 and "the one first in the program took it" in lost.reason
    outcome = execute.check_numerics(ir_utils.parse(text), result.module)
    assert outcome.ok, outcome.format()


def test_a_tie_that_both_rings_can_serve_keeps_both():
    """x's rows over 'data' and w's columns over 'model', both free dims, both read from the
    arguments: the program's order serves both rings (reordering by size would lose one in uni)."""
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    f = jax.shard_map(lambda x, w: jax.lax.all_gather(x, "data", axis=0, tiled=True)
                      @ jax.lax.all_gather(w, "model", axis=1, tiled=True),
                      mesh=mesh, in_specs=(P("data"), P(None, "model")), out_specs=P(), check_vma=False)
    args = [jax.ShapeDtypeStruct((16, 8), jnp.float32, sharding=NamedSharding(mesh, P("data"))),
            jax.ShapeDtypeStruct((8, 16), jnp.float32, sharding=NamedSharding(mesh, P(None, "model")))]
    result = cmatmul_pass.rewrite(jax.jit(f).lower(*args).as_text(), cmatmul_pass.Options(variant="uni"))
    assert [s.rewritten for s in result.report.sites] == [True, True]


def test_slack_of_an_argument_and_of_a_computed_value():
    module = ir_utils.parse(lowered(2))
    info = ModuleInfo.of(module)
    gathers = ir_utils.ops_named(module, "stablehlo.all_gather")["stablehlo.all_gather"]
    slack = Slack(_dot_flops)
    sites = [match_all_gather(op, info) for op in gathers]
    # the weights enter from the entry function's arguments: early; the activations are computed
    early = [slack.early(s.all_gather.operation.operands[0]) for s in sites]
    assert sorted(early) == [False] * 2 + [True] * 4
    late = next(s for s in sites if not slack.early(s.all_gather.operation.operands[0]))
    assert slack.of(late.all_gather, [c.dot for c in late.consumers]).hiding_flops == 0


def test_a_pure_fsdp_program_keeps_its_weight_rings():
    """No competition (activations not sharded over 'model'): weight gathers are rewritten as before."""
    mesh = jax.make_mesh((8,), ("data",))
    f = jax.shard_map(lambda x, w: x @ jax.lax.all_gather(w, "data", axis=1, tiled=True), mesh=mesh,
                      in_specs=(P("data", None), P(None, "data")), out_specs=P("data", None))
    args = [jax.ShapeDtypeStruct((64, 16), jnp.float32, sharding=NamedSharding(mesh, P("data", None))),
            jax.ShapeDtypeStruct((16, 64), jnp.float32, sharding=NamedSharding(mesh, P(None, "data")))]
    result = cmatmul_pass.rewrite(jax.jit(f).lower(*args).as_text())
    (site,) = result.report.sites
    assert site.rewritten and not site.slack


def test_fsdp_tp_training_parity_under_the_decorator():
    """An FSDP × TP model trained with SGD under cmatmul_pass.jit follows jax.jit's loss curve."""
    mesh, fn, structs = fsdp_tp(2)
    rng = np.random.default_rng(0)
    params = [jax.device_put((0.2 * rng.standard_normal(s.shape)).astype(np.float32), s.sharding) for s in structs]

    def step(params):  # params[0] is the input batch, held fixed; the weights take an SGD step
        loss, grads = jax.value_and_grad(lambda p: jnp.mean(fn(*p) ** 2))(params)
        return loss, [params[0]] + [w - 0.1 * g for w, g in zip(params[1:], grads[1:])]

    def train(jit):
        stepped, ps, losses = jit(step), list(params), []
        for _ in range(4):
            loss, ps = stepped(ps)
            losses.append(float(loss))
        return losses, stepped

    base, _ = train(jax.jit)
    mine, decorated = train(lambda f: cmatmul_pass.jit(f, check=True))
    np.testing.assert_allclose(mine, base, rtol=1e-5)
    assert base[-1] < base[0]
    activation_collectives_rewritten(decorated)


def test_explain_shows_the_slack_of_competing_collectives(capsys):
    from conftest import run_cli, sample

    assert run_cli("explain", sample("fsdp_tp"), "--variant", "uni") == 0
    out = capsys.readouterr().out
    assert "slack: operand ready at the start of the step; 4.92e+04 FLOP of independent compute" in out
    assert "[prefetchable]" in out and "[lost_to_ring]" in out


def test_the_timeline_draws_a_prefetched_gather_ahead_of_its_dot(tmp_path, monkeypatch):
    from cmatmul_pass import cost, timeline
    from conftest import sample

    drawn = []
    real = timeline._prefetch_lanes
    monkeypatch.setattr(timeline, "_prefetch_lanes", lambda *a: drawn.append(real(*a)) or drawn[-1])
    result = cmatmul_pass.rewrite(sample("fsdp_tp").read_text(), cmatmul_pass.Options(variant="uni"))
    hw = cost.hardware("h100")
    assert timeline.plot(result.report, hw, tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"
    (site,) = [s for s in result.report.sites if s.reason_code == "prefetchable"]
    ((lanes, label, ring),) = drawn
    ((name, [(start, length)], _),) = lanes
    assert length == pytest.approx(site.bytes_moved / hw.bandwidth + hw.step) and start + length == pytest.approx(0)
    assert ring == site.ring_size and "prefetched" in label


def _scan_fsdp_tp(remat: bool):
    """A scan over layers whose step gathers its layer's weight over 'data' (FSDP, written in the
    step) and its rows over 'model' (sequence parallel): both gathers feed one dot."""
    mesh = jax.make_mesh((2, 4), ("data", "model"))

    def step(h, w):
        y = jax.lax.all_gather(h, "model", axis=0, tiled=True) @ jax.lax.all_gather(w, "data", axis=1, tiled=True)
        return h + jax.lax.psum_scatter(y, "model", scatter_dimension=0, tiled=True), None

    def block(x, ws):
        return jax.lax.scan(jax.checkpoint(step) if remat else step, x, ws)[0]

    specs = (P(("data", "model"), None), P(None, None, "data"))
    f = jax.shard_map(block, mesh=mesh, in_specs=specs, out_specs=specs[0], check_vma=False)
    args = [jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=NamedSharding(mesh, specs[0])),
            jax.ShapeDtypeStruct((3, 32, 32), jnp.float32, sharding=NamedSharding(mesh, specs[1]))]
    return jax.jit(f).lower(*args).as_text()


@pytest.mark.parametrize("remat", [False, True])
def test_in_a_scan_a_layers_weight_is_early_and_its_rows_are_not(remat):
    """A scan's stacked weights pass through the loop unchanged and its counter counts trips: the
    layer sliced from them is early (through jax's calls, a remat's barrier); the carried
    activation is not. So the rows' gather takes the ring and the weight's says it lost the dot to
    it, ready at the step's start (prefetchable where compute precedes the dot, lost_to_ring here)."""
    text = _scan_fsdp_tp(remat)
    module = ir_utils.parse(text)
    with module.context:
        info = ModuleInfo.of(module)
        slack = Slack(_dot_flops)
        gathers = ir_utils.ops_named(module, "stablehlo.all_gather")["stablehlo.all_gather"]
        axis = {op: "data" if "data" in str(op.attributes["replica_groups"]) or
                match_all_gather(op, info).ring.size == 2 else "model" for op in gathers}
        assert sorted(axis.values()) == ["data", "model"]
        for op in gathers:
            assert slack.early(op.operation.operands[0]) == (axis[op] == "data")
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(variant="uni"))
    by_ring = {s.ring_size: s for s in result.report.sites if s.kind == "all_gather_dot"}
    assert by_ring[4].rewritten
    assert not by_ring[2].rewritten and by_ring[2].reason_code in ("prefetchable", "lost_to_ring"), by_ring[2].reason
    assert "this one's is ready at the step's start" in by_ring[2].reason or "prefetchable" == by_ring[2].reason_code
    assert by_ring[2].slack["early"] and not by_ring[4].slack
    outcome = execute.check_numerics(ir_utils.parse(text), result.module)
    assert outcome.ok, outcome.format()


# ---------------------------------------------------------------------------- a scatter against a weight's gather
def hidden_scatter(up: bool = True, dtype=jnp.float32):
    from tools.samples_layers import fsdp_tp_hidden

    text = fsdp_tp_hidden(up)()
    return text if dtype == jnp.float32 else text.replace("f32", "bf16")


def scatter_and_down_gather(result):
    (scatter,) = [s for s in result.report.sites if s.kind == "dot_reduce_scatter"]
    # the up projection's weight gather contracts (and rings); the other is the down projection's
    (gather,) = [s for s in result.report.sites if s.kind == "all_gather_dot" and s.dim_role != "contracting"]
    return scatter, gather


@pytest.mark.parametrize("variant", ["uni", "unroll2", "bidi-full"])
def test_a_scatter_takes_the_ring_from_a_prefetchable_weight_gather(variant):
    """The down projection's product scattered over 'model' along the hidden dim its weight is
    FSDP-gathered along over 'data': the weight's gather has the up projection before the dot to
    hide behind, so it stays plain (prefetchable) and the scatter, which only the dot's end can
    start, rings; the program's numbers are the original's."""
    text = hidden_scatter()
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(variant=variant))
    scatter, gather = scatter_and_down_gather(result)
    assert scatter.rewritten and "stays a plain all_gather" in scatter.notes[-1], scatter.summary_line()
    assert not gather.rewritten and gather.reason_code == "prefetchable", gather.summary_line()
    assert gather.slack["hiding_flops"] > 0 and gather.slack["early"], gather.slack
    found = ir_utils.ops_named(result.module, "stablehlo.all_gather", "stablehlo.reduce_scatter")
    assert len(found["stablehlo.all_gather"]) == 1 and not found["stablehlo.reduce_scatter"]
    outcome = execute.check_numerics(ir_utils.parse(text), result.module)
    assert outcome.ok, outcome.format()


def test_with_nothing_to_hide_the_weight_gather_behind_it_keeps_the_ring():
    """The twin without the up projection: no compute precedes the dot, so the weight's gather rings
    and the scatter along the same dim stays, as the two rings would nest."""
    result = cmatmul_pass.rewrite(hidden_scatter(up=False))
    scatter, gather = scatter_and_down_gather(result)
    assert not scatter.rewritten and scatter.reason_code == "gathered_operand", scatter.summary_line()
    assert gather.rewritten, gather.summary_line()


def test_when_the_scatter_does_not_pay_the_weight_gather_rings_after_all():
    """Under --policy auto at this small shape the scatter's ring is declined: the gather is not left
    plain for it, and the cost model decides the gather's ring on its own."""
    result = cmatmul_pass.rewrite(hidden_scatter(), cmatmul_pass.Options(policy="auto"))
    scatter, gather = scatter_and_down_gather(result)
    assert not scatter.rewritten and scatter.reason_code == "policy", scatter.summary_line()
    assert gather.reason_code != "prefetchable", gather.summary_line()


def test_training_parity_of_the_hidden_scatter_block_through_the_decorator():
    mesh = jax.make_mesh((2, 4), ("data", "model"))

    def block(x, w_up, w_down):
        h = jax.nn.gelu(x @ jax.lax.all_gather(w_up, "data", axis=0, tiled=True))
        y = h @ jax.lax.all_gather(w_down, "data", axis=1, tiled=True)
        return jax.lax.psum_scatter(y, "model", scatter_dimension=1, tiled=True)

    specs = (P("data", None), P("data", "model"), P("model", "data"))
    f = jax.shard_map(block, mesh=mesh, in_specs=specs, out_specs=P("data", "model"), check_vma=False)

    def loss(x, w_up, w_down):
        return jnp.mean(jnp.tanh(f(x, w_up, w_down)) ** 2)

    rng = np.random.default_rng(0)
    args = [jax.device_put(rng.normal(size=s).astype(np.float32) / 4, NamedSharding(mesh, sp))
            for s, sp in zip(((32, 64), (64, 128), (128, 64)), specs)]
    grad = jax.value_and_grad(loss, argnums=(0, 1, 2))
    step = cmatmul_pass.jit(grad)
    mine, base = step(*args), jax.jit(grad)(*args)
    for a, b in zip(jax.tree.leaves(mine), jax.tree.leaves(base)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6)
    assert any(s.kind == "dot_reduce_scatter" and s.rewritten and "stays a plain all_gather" in " ".join(s.notes)
               for s in step.report.sites), "\n".join(s.summary_line() for s in step.report.sites)
