"""psum after a matmul (dot → all_reduce): the matcher, the variance analysis, split and chunk,
the gathers carried forward, numerics in every variant, the CLI and training parity."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import cmatmul_pass
from cmatmul_pass import cost, execute, ir_utils
from cmatmul_pass._jax_private import ir
from cmatmul_pass.analysis.variance import Variance, varying_axes
from cmatmul_pass.matchers import ModuleInfo
from cmatmul_pass.matchers.all_reduce import AllReduceSite, find_dot_all_reduce
from cmatmul_pass.ring import Ring
from conftest import run_cli, sample
from tools import train_tp_mlp

SPLIT_SAMPLES = ["ar_megatron_mlp", "ar_megatron_mlp_grad", "ar_megatron_ln_stack", "ar_megatron_mesh2x4",
                 "ar_megatron_row_mixing", "ar_megatron_bf16"]


def lower_smap(body, in_specs, shapes, out_specs=P(), mesh=None, dtype=jnp.float32, grad=False):
    mesh = mesh or jax.make_mesh((8,), ("model",))
    f = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    args = [jax.ShapeDtypeStruct(s, dtype, sharding=NamedSharding(mesh, spec)) for s, spec in zip(shapes, in_specs)]
    if grad:
        return jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) ** 2), argnums=tuple(range(len(args))))).lower(*args).as_text()
    return jax.jit(f).lower(*args).as_text()


MLP_SPECS = (P(), P(None, "model"), P("model", None))
MLP_SHAPES = [(64, 32), (32, 128), (128, 32)]


def mlp(x, w1, w2):
    return jax.lax.psum(jax.nn.gelu(x @ w1) @ w2, "model")


def rewrite(text, **options):
    return cmatmul_pass.rewrite(text, cmatmul_pass.Options(**options))


def ops(result, name):
    return len(ir_utils.ops_named(result.module, name)[name])


def numerics_ok(text, result):
    outcome = execute.check_numerics(ir_utils.parse(text), result.module)
    assert outcome.ok, outcome.format()
    return outcome


# ---------------------------------------------------------------- the matcher
def test_the_match_prefers_the_activation_rows():
    module = ir_utils.parse(sample("ar_megatron_mlp").read_text())  # kept alive: sites point into it
    (site,) = find_dot_all_reduce(module)
    assert isinstance(site, AllReduceSite)
    assert site.dim == 0 and site.terms[0].operand_index == 0 and site.terms[0].operand_dim == 0
    assert list(site.block_type.shape) == [8, 32]


def test_the_backward_psum_is_split_along_the_input_gradient_rows():
    module = ir_utils.parse(sample("ar_megatron_mlp_grad").read_text())
    sites = find_dot_all_reduce(module)
    assert [s.dim for s in sites] == [0, 0] and all(isinstance(s, AllReduceSite) for s in sites)


def test_rows_that_do_not_divide_fall_back_to_another_free_dim():
    """12 tokens on a ring of 8: the features (32) split instead, with the same numbers."""
    text = lower_smap(mlp, MLP_SPECS, [(12, 32), (32, 128), (128, 32)])
    result = rewrite(text, all_reduce="split")
    (entry,) = result.report.sites
    assert entry.rewritten and entry.all_reduce["dim"] == 1 and ops(result, "stablehlo.all_reduce") == 0
    numerics_ok(text, result)


@pytest.mark.parametrize("body, code", [
    (lambda x, w1, w2: jax.lax.psum(jnp.sum(x @ w1) * jnp.ones((4, 4)), "model"), "producer_not_dot"),
    (lambda x, w1, w2: (lambda y: jax.lax.psum(y, "model") + y)(x @ w1 @ w2), "multiple_users"),
    (lambda x, w1, w2: jax.lax.pmax(x @ w1 @ w2, "model"), None),  # not a sum: not an all_reduce of add
], ids=["not_a_dot", "product_read_twice", "pmax"])
def test_declines_leave_the_module_unchanged(body, code):
    text = lower_smap(body, MLP_SPECS, MLP_SHAPES)
    result = rewrite(text)
    assert not result.changed
    assert result.text == ir_utils.print_module(ir_utils.parse(text))
    if code is None:
        assert all(s.reason_code == "not_sum" for s in result.report.sites if s.kind == "dot_all_reduce")
    else:
        (entry,) = [s for s in result.report.sites if s.kind == "dot_all_reduce"]
        assert entry.reason_code == code and entry.reason


def test_the_no_dim_decline_says_what_would_make_it_eligible():
    (entry,) = rewrite(sample("neg_ar_not_divisible").read_text()).report.sites
    assert entry.reason_code == "no_dim" and "multiple of 8" in entry.reason and "eligible" in entry.reason


# ---------------------------------------------------------------- device variance
def test_variance_reads_the_shard_map_in_shardings():
    module = ir_utils.parse(sample("ar_megatron_mlp").read_text())
    info = ModuleInfo.of(module)
    (site,) = find_dot_all_reduce(module, info)
    variance = Variance(info)
    body = site.all_reduce.operation.block
    x, w1, w2 = body.arguments
    assert variance.identical(x, site.ring)  # in_specs P(): replicated over 'model'
    assert not variance.identical(w1, site.ring) and not variance.identical(w2, site.ring)
    assert variance.identical(site.all_reduce.result, site.ring)  # the sum is everyone's
    assert not variance.identical(site.terms[0].dot.result, site.ring)  # x @ w1 @ w2: w's vary


def test_variance_on_a_2d_mesh_is_per_axis():
    """The batch sharded over 'data' is identical across the 'model' groups, not across 'data' ones."""
    module = ir_utils.parse(sample("ar_megatron_mesh2x4").read_text())
    info = ModuleInfo.of(module)
    (site,) = find_dot_all_reduce(module, info)
    x = site.all_reduce.operation.block.arguments[0]
    variance = Variance(info)
    assert variance.identical(x, site.ring)
    across_data = Ring(((0, 4), (1, 5), (2, 6), (3, 7)), 8)
    assert not variance.identical(x, across_data)
    assert varying_axes({"data": 2, "model": 4}, [], site.ring) == {"model"}
    assert varying_axes({"data": 2, "model": 4}, [], across_data) == {"data"}


def test_a_device_varying_operand_stops_the_move():
    """``psum(...) * (1 + axis_index)`` differs per device: computing the multiply on rows would give
    device k's rows the factor of device k, not of the reader.  The gather stays before it."""
    def body(x, w1, w2):
        return mlp(x, w1, w2) * (1.0 + jax.lax.axis_index("model").astype(jnp.float32))

    text = lower_smap(body, MLP_SPECS, MLP_SHAPES)
    result = rewrite(text)
    (entry,) = result.report.sites
    assert entry.rewritten and entry.all_reduce["gathers"] == [
        g for g in entry.all_reduce["gathers"] if g.startswith("before stablehlo.multiply")]
    numerics_ok(text, result)


# ---------------------------------------------------------------- split: gathers carried forward
def test_the_ln_stack_gathers_into_the_next_ring_and_once_at_the_return():
    text = sample("ar_megatron_ln_stack").read_text()
    result = rewrite(text, all_reduce="split")
    kinds = [(s.kind, s.rewritten) for s in result.report.sites]
    assert kinds == [("dot_all_reduce", True), ("dot_all_reduce", True), ("all_gather_dot", True)]
    first = result.report.sites[0].all_reduce["gathers"]
    assert first[0].startswith("into the ring of stablehlo.dot_general") and first[1].startswith("before sdy.return")
    # the second block's psum reaches only the return's gather: the next ring's gather reads the
    # residual before that psum (both psums' rows are one carried stream after it)
    second = result.report.sites[1].all_reduce["gathers"]
    assert len(second) == 1 and second[0].startswith("before sdy.return"), second
    assert ops(result, "stablehlo.all_reduce") == 0 and ops(result, "stablehlo.all_gather") == 1
    # the second block's layer norm runs on 8 of the 64 rows
    reduces = ir_utils.ops_named(result.module, "stablehlo.reduce")["stablehlo.reduce"]
    assert sorted(ir_utils.ranked_tensor(r.operation.operands[0]).shape[0] for r in reduces) == [8, 8, 64, 64]
    numerics_ok(text, result)


def test_carrying_never_gathers_more_bytes_than_the_psums_moved():
    """In a training step the forward's psum feeds residuals the backward reads whole: carrying them
    would gather several values for one psum, so the gather stays after the ring (and says why)."""
    def stack(x, w1a, w2a, w1b, w2b):
        x = x + mlp(x, w1a, w2a)
        return x + mlp(jnp.tanh(x), w1b, w2b)

    text = lower_smap(stack, MLP_SPECS + MLP_SPECS[1:], MLP_SHAPES + MLP_SHAPES[1:], grad=True)
    result = rewrite(text, all_reduce="split")
    # the forward's two psums of a dot are split, and the backward's psum of a product plus a value
    # other readers need whole (read block by block); check_vma=False's backward sums the incoming
    # cotangent too, which the backward's matmuls read: split for their gather ring
    split = [s for s in result.report.sites if s.kind == "dot_all_reduce" and s.rewritten]
    assert len(split) == 4
    assert [s.all_reduce["picked"] for s in split].count("summed value") == 1
    gathered_bytes = sum(execute_bytes(op) for op in ir_utils.ops_named(result.module, "stablehlo.all_gather")[
        "stablehlo.all_gather"])
    psum_bytes = sum(s.bytes_per_step * s.ring_size for s in split)  # each psum's whole value
    assert gathered_bytes <= psum_bytes
    assert any("gather stays" in note for s in split for note in s.notes)
    numerics_ok(text, result)


def execute_bytes(op):
    from cmatmul_pass.report import tensor_bytes
    return tensor_bytes(ir_utils.ranked_tensor(op.result))


# ---------------------------------------------------------------- numerics, every variant and strategy
@pytest.mark.parametrize("variant", list(cost.VARIANTS))
@pytest.mark.parametrize("name", ["ar_megatron_mlp_grad", "ar_megatron_ln_stack", "ar_megatron_mesh2x4"])
def test_split_matches_the_original_in_every_variant(name, variant):
    text = sample(name).read_text()
    result = rewrite(text, variant=variant, all_reduce="split")
    assert any(s.kind == "dot_all_reduce" and s.rewritten for s in result.report.sites)
    assert ops(result, "stablehlo.all_reduce") == 0
    numerics_ok(text, result)


@pytest.mark.parametrize("chunks", [2, 4, 8])
@pytest.mark.parametrize("name", ["ar_megatron_mlp", "ar_megatron_mlp_grad", "ar_megatron_ln_stack",
                                  "ar_megatron_mesh2x4", "ar_megatron_bf16"])
def test_chunk_matches_the_original(name, chunks):
    text = sample(name).read_text()
    result = rewrite(text, all_reduce="chunk", chunks=chunks)
    entries = [s for s in result.report.sites if s.kind == "dot_all_reduce"]
    assert entries and all(s.rewritten and s.all_reduce["chunks"] == chunks for s in entries)
    assert ops(result, "stablehlo.all_reduce") == chunks * len(entries)
    numerics_ok(text, result)


@pytest.mark.parametrize("annotated", [False, True])
def test_each_chunk_sums_its_rows_on_a_channel_of_its_own(annotated):
    """A chunk's all_reduce is a copy of the matched psum (its groups and sum), reading the
    chunk; a psum carrying more than that (a frontend attribute) gets chunks built anew,
    without it (two collectives would share the psum's scheduling group)."""
    text = sample("ar_megatron_mlp").read_text()
    if annotated:
        module = ir_utils.parse(text)
        with module.context:
            for op in ir_utils.ops_named(module, "stablehlo.all_reduce")["stablehlo.all_reduce"]:
                op.operation.attributes["mhlo.frontend_attributes"] = ir.DictAttr.get(
                    {"_scheduling_group_id": ir.StringAttr.get("0")})
        text = str(module)
    before = ir_utils.parse(text)
    groups = {str(op.attributes["replica_groups"])
              for op in ir_utils.ops_named(before, "stablehlo.all_reduce")["stablehlo.all_reduce"]}
    result = rewrite(text, all_reduce="chunk", chunks=4)
    chunks = ir_utils.ops_named(result.module, "stablehlo.all_reduce")["stablehlo.all_reduce"]
    assert len(chunks) == 4
    handles = set()
    for op in chunks:
        assert str(op.attributes["replica_groups"]) in groups
        assert "mhlo.frontend_attributes" not in op.operation.attributes
        assert sorted(name for name, _ in op.operation.attributes.items()) == ["channel_handle", "replica_groups",
                                                                   "use_global_device_ids"]
        assert op.operation.operands[0].type == op.operation.results[0].type
        body = op.operation.regions[0].blocks[0]
        assert [o.operation.name for o in body.operations] == ["stablehlo.add", "stablehlo.return"]
        handles.add(str(op.attributes["channel_handle"]))
    assert len(handles) == 4
    numerics_ok(text, result)


def test_chunks_are_grouped_with_the_next_chunks_dots_for_streams():
    result = rewrite(sample("ar_megatron_mlp").read_text(), all_reduce="chunk", chunks=4, annotate_streams=True)
    groups = {}
    for op in ir_utils.walk(result.module.operation):
        attrs = op.operation.attributes
        if "mhlo.frontend_attributes" in attrs:
            entries = {a.name: str(a.attr) for a in attrs["mhlo.frontend_attributes"]}
            if "_scheduling_group_id" in entries:
                groups.setdefault(entries["_scheduling_group_id"], []).append(op.operation.name)
    # chunk i's all_reduce with chunk i+1's dot (outlined onto a stream): 3 groups for 4 chunks
    assert len(groups) == 3
    assert all(sorted(members) == ["func.call", "stablehlo.all_reduce"] for members in groups.values())


def test_keep_leaves_every_all_reduce():
    text = sample("ar_megatron_ln_stack").read_text()
    result = rewrite(text, all_reduce="keep")
    assert not result.changed and result.text == ir_utils.print_module(ir_utils.parse(text))


# ---------------------------------------------------------------- the cost model's choice
def test_policy_auto_picks_among_leaving_split_and_chunk():
    text = sample("ar_megatron_mlp").read_text()
    # tiny shapes on an H100: neither beats the all_reduce
    (tiny,) = rewrite(text, policy="auto").report.sites
    assert not tiny.rewritten and tiny.reason_code == "policy"
    # an all_reduce 1e5x slower than the links: both win; the faster is taken
    (slow,) = rewrite(text, policy="auto", hardware="h100:all_reduce_bandwidth=4.5e6").report.sites
    prediction = slow.all_reduce["prediction"]
    assert slow.rewritten and slow.all_reduce["strategy"] == max(prediction["speedup"], key=prediction["speedup"].get)


def test_the_default_says_when_the_model_predicts_a_slowdown():
    (entry,) = rewrite(sample("ar_megatron_mlp").read_text()).report.sites
    assert entry.rewritten and any("policy all rewrites it anyway" in n for n in entry.notes)


def test_the_default_takes_the_strategy_the_model_predicts_faster():
    """No all_reduce= named: the faster of split and chunk by the model, even where neither beats
    the psum (policy all rewrites it); where the all_reduce is slow, split (no all_reduce at all)."""
    text = sample("ar_megatron_mlp").read_text()
    (tiny,) = rewrite(text).report.sites
    speedup = tiny.all_reduce["prediction"]["speedup"]
    assert tiny.rewritten and tiny.all_reduce["picked"] == "model"
    assert tiny.all_reduce["strategy"] == "chunk" and speedup["chunk"] > speedup["split"] and speedup["chunk"] < 1
    (slow,) = rewrite(text, hardware="h100:all_reduce_bandwidth=4.5e6").report.sites
    speedup = slow.all_reduce["prediction"]["speedup"]
    assert slow.all_reduce["strategy"] == "split" and speedup["split"] > speedup["chunk"]
    (named,) = rewrite(text, all_reduce="split").report.sites
    assert named.all_reduce["strategy"] == "split" and named.all_reduce["picked"] == "named"


def test_the_samples_default_picks_are_what_patterns_md_says():
    """docs/patterns.md: on the h100 profile the default chunks every ar_* sample's psums, and
    sp_mlp_grad's data-parallel gradient psums (rings of 2) too, where split is ahead by under
    0.01 %: a tie (cost.TIE), which chunk takes."""
    doc = " ".join((sample("sp_mlp_grad").parent.parent / "docs" / "patterns.md").read_text().split())
    assert "chunk at every shape of docs/performance.md's Megatron table and in every `ar_*` sample" in doc
    for path in sorted(sample("ar_megatron_mlp").parent.glob("ar_*.mlir")):
        psums = [s for s in rewrite(path.read_text()).report.sites if s.kind == "dot_all_reduce"
                 and s.all_reduce.get("picked") != "summed value"]  # (a psum of no matmul: split or left)
        assert psums and all(s.rewritten and s.all_reduce["strategy"] == "chunk" for s in psums), path.name
    psums = [s for s in rewrite(sample("sp_mlp_grad").read_text()).report.sites if s.kind == "dot_all_reduce"]
    assert "where split is ahead by 0.01 %: within `cost.TIE`, 1 %, the two tie" in doc and cost.TIE == 0.01
    assert len(psums) == 2 and all(s.all_reduce["strategy"] == "chunk" and s.ring_size == 2 for s in psums)
    for s in psums:
        prediction = s.all_reduce["prediction"]
        assert 0 < prediction["speedup"]["split"] / prediction["speedup"]["chunk"] - 1 < 1e-4  # "ahead by 0.01 %"
        assert prediction["tied"]


def test_without_a_profile_the_default_chunks_in_two(capsys):
    """hardware="auto" on this CPU: no profile describes it, so auto takes cost.fallback_all_reduce
    (as the ring variant takes its fallback), and explain says so."""
    text = sample("ar_megatron_ln_stack").read_text()
    result = rewrite(text, hardware="auto")
    psums = [s for s in result.report.sites if s.kind == "dot_all_reduce"]
    assert len(psums) == 2
    assert all(s.rewritten and s.all_reduce["strategy"] == "chunk" and s.all_reduce["chunks"] == cost.FALLBACK_CHUNKS
               and s.all_reduce["picked"] == "fallback" for s in psums)
    numerics_ok(text, result)
    assert run_cli("explain", sample("ar_megatron_ln_stack"), "--hardware", "auto") == 0
    assert "all_reduce: chunk along dim 0 into 2 chunks (auto's fallback: no profile describes this machine)" in \
        capsys.readouterr().out


def test_a_second_run_leaves_the_chunks():
    """The chunk strategy's output is a fixed point: each chunk's all_reduce, concatenated with the
    others, is declined as already chunked (a psum chunked by hand too)."""
    text = sample("ar_megatron_mlp").read_text()
    for options in ({}, {"all_reduce": "chunk", "chunks": 4}):
        once = rewrite(text, **options)
        twice = rewrite(once.text, **options)
        assert twice.text == once.text and not twice.report.rewritten
        assert [s.reason_code for s in twice.report.sites] == ["chunked"] * (options.get("chunks") or 2)


def test_the_all_reduce_costs_less_on_nvls_hardware():
    h100, a100 = cost.hardware("h100"), cost.hardware("a100")
    assert h100.all_reduce_seconds(1e9, 8) < 2 * 7 / 8 * 1e9 / h100.bandwidth
    assert a100.all_reduce_seconds(1e9, 8) == pytest.approx(2 * 7 / 8 * 1e9 / a100.bandwidth + a100.step)


def test_chunking_pays_where_the_dot_and_the_all_reduce_are_alike():
    """A 70B-like MLP block on 8 H100s: 8192 tokens; chunks hide most of the all_reduce."""
    tokens, hidden, ffn, n = 8192, 8192, 28672, 8
    shape = cost.SiteShape("dot_reduce_scatter", n, 2 * tokens * (ffn // n) * hidden, tokens // n * hidden * 2, "bf16")
    p = cost.predict_all_reduce(shape, cost.hardware("h100"), "uni")
    assert p.speedup("chunk") > 1.1 and p.chunks in cost.CHUNK_COUNTS


# ---------------------------------------------------------------- the CLI and the decorator
def test_explain_says_where_every_gather_went(capsys):
    assert run_cli("explain", sample("ar_megatron_ln_stack"), "--all-reduce", "split") == 0
    out = capsys.readouterr().out
    assert "all_reduce: split along dim 0\n" in out  # named, so no pick is credited
    assert "gathered: into the ring of stablehlo.dot_general at" in out and "gathered: before sdy.return at" in out


def test_the_cli_takes_the_strategy(tmp_path):
    out = tmp_path / "out.mlir"
    assert run_cli("rewrite", sample("ar_megatron_mlp"), "--all-reduce", "chunk", "--chunks", "2", "-o", out) == 0
    result = cmatmul_pass.rewrite(out.read_text(), cmatmul_pass.Options(all_reduce="keep"))
    assert ops(result, "stablehlo.all_reduce") == 2


def test_the_decorator_rewrites_a_megatron_layer():
    mesh = jax.make_mesh((8,), ("model",))
    f = jax.shard_map(mlp, mesh=mesh, in_specs=MLP_SPECS, out_specs=P())
    rng = np.random.default_rng(0)
    args = [jax.device_put(rng.standard_normal(s).astype(np.float32), NamedSharding(mesh, spec))
            for s, spec in zip(MLP_SHAPES, MLP_SPECS)]
    ours = cmatmul_pass.jit(f, check=True)
    np.testing.assert_allclose(np.asarray(ours(*args)), np.asarray(jax.jit(f)(*args)), rtol=1e-5, atol=1e-5)
    (site,) = ours.report.rewritten
    # on this CPU no profile describes the machine: the default's fallback, two chunks
    assert site.kind == "dot_all_reduce" and (site.all_reduce["strategy"], site.all_reduce["picked"]) == ("chunk", "fallback")


def test_megatron_training_parity_with_jax_jit():
    """Megatron blocks (psum, no sequence parallelism) train to the same losses under cmatmul_pass.jit."""
    steps = 8
    base, base_acc, _ = train_tp_mlp.train(jax.jit, steps, megatron=True)
    mine, mine_acc, step = train_tp_mlp.train(cmatmul_pass.jit, steps, megatron=True)
    np.testing.assert_allclose(mine, base, rtol=1e-5)
    assert base[-1] < 0.6 * base[0] and mine_acc == base_acc
    split = [s for s in step.report.sites if s.kind == "dot_all_reduce"]
    assert len(split) == 8 and all(s.rewritten for s in split)  # 2 blocks: forward, dx, dW1, dW2 psums


@pytest.mark.parametrize("strategy", ["split", "chunk"])
def test_the_timeline_draws_psum_sites_in_their_strategy(tmp_path, monkeypatch, strategy):
    """Every psum site gets its lanes: the original's dots then all_reduce, and the split's ring
    and gather or the chunks' pipeline, which ends at the predicted time."""
    from cmatmul_pass import timeline

    drawn = []
    real = timeline._all_reduce_lanes
    monkeypatch.setattr(timeline, "_all_reduce_lanes", lambda *a: drawn.append(real(*a)) or drawn[-1])
    result = rewrite(sample("ar_megatron_ln_stack").read_text(), all_reduce=strategy, chunks=2 if strategy == "chunk" else None)
    png = timeline.plot(result.report, cost.hardware("h100"), tmp_path / "t.png")
    assert png.read_bytes()[:4] == b"\x89PNG"
    psums = [s for s in result.report.sites if s.kind == "dot_all_reduce"]
    assert len(drawn) == len(psums) == 2
    for (lanes, label, ring), site in zip(drawn, psums):
        assert label.startswith(strategy) and ring == 8
        prediction = site.all_reduce["prediction"]
        end = max(start + length for _, bars, _ in lanes[2:] for start, length in bars)
        expected = prediction["split_s"] if strategy == "split" else prediction["chunk_s"]["2"]
        assert end == pytest.approx(expected)
        assert lanes[1][1] == [(pytest.approx(prediction["serial_s"] - prediction["all_reduce_s"]),
                                pytest.approx(prediction["all_reduce_s"]))]


def test_the_chunk_pipeline_ends_where_the_model_says():
    """k dots back to back; each all_reduce starts when its dot and the previous all_reduce are done."""
    dots, reduces = cost.chunk_pipeline(2.0, 3.0, 3)
    assert dots == [(0.0, 2.0), (2.0, 2.0), (4.0, 2.0)]
    assert reduces == [(2.0, 3.0), (5.0, 3.0), (8.0, 3.0)]  # collective-bound: piece + k * reduce
    dots, reduces = cost.chunk_pipeline(3.0, 1.0, 3)
    assert reduces[-1] == (9.0, 1.0)  # compute-bound: k * piece + reduce


@pytest.mark.parametrize("model", ["megatron", "sequence_parallel"])
def test_a_second_run_of_the_pass_finds_nothing_left_to_ring(model):
    """The pass's output, rewritten again, has no site left to rewrite: in the Megatron step the
    split psums' gathers that stay before the residual add and the norm feeding the gate and up
    projections (the move would gather the rows whole for the region's return too) are rung with
    those ops applied per block in the first run (they had been left plain, and a second run rang
    them); and the output computes what the original does."""
    from tools import bench

    fn, args = bench.MODELS[model](5, hidden=32, ffn=64, tokens=32)
    text = fn.lower(*args).as_text()
    first = cmatmul_pass.rewrite(text, cmatmul_pass.Options(all_reduce="split"))
    again = cmatmul_pass.rewrite(first.text, cmatmul_pass.Options(all_reduce="split"))
    assert not again.report.rewritten, [s.summary_line() for s in again.report.rewritten]
    ringed = [s for s in first.report.rewritten if any(n.startswith("rung with the row-wise ops") for n in s.notes)]
    assert bool(ringed) == (model == "megatron"), [s.summary_line() for s in ringed]
    outcome = execute.check_numerics(ir_utils.parse(text), first.module)
    assert outcome.ok, outcome.format()


def test_explain_says_when_chunk_took_a_tie(capsys):
    """explain names the tie (cost.TIE) where the model's pick was one: sp_mlp_grad's gradient psums."""
    assert run_cli("explain", sample("sp_mlp_grad")) == 0
    out = capsys.readouterr().out
    assert out.count("(the cost model's pick: split and chunk tie within 1%, and chunk takes a tie)") == 2
    assert run_cli("explain", sample("ar_megatron_mlp")) == 0  # chunk ahead by more: the plain words
    out = capsys.readouterr().out
    assert "(the cost model's pick)" in out and "tie within" not in out


def test_a_tie_goes_to_split_where_its_gather_goes_on_to_a_matmul(monkeypatch, capsys):
    """cost.TIE: chunk takes a tie, but where the psum's value goes on through row-wise ops to a
    matmul (a stacked block's residual and norm, then the next block's dot), split takes it: its
    gather rings with that dot, which the per-site prediction does not count.  Every psum made a
    tie here (TIE widened); the stack's first psum goes on, its last is returned."""
    monkeypatch.setattr(cost, "TIE", 10.0)
    text = sample("ar_megatron_ln_stack").read_text()
    result = rewrite(text)
    psums = [s for s in result.report.sites if s.kind == "dot_all_reduce"]
    assert [(s.all_reduce["strategy"], s.all_reduce["tie_to_split"], s.all_reduce["prediction"]["tied"])
            for s in psums] == [("split", True, True), ("chunk", False, True)]
    # the split's gather rings with the next block's dot (here left after the scatter ring, then
    # rung with the residual's and the norm's ops applied to each block)
    assert [s.location for s in result.report.sites if s.kind == "all_gather_dot" and s.rewritten] == [psums[0].location]
    numerics_ok(text, result)
    assert run_cli("explain", sample("ar_megatron_ln_stack")) == 0
    out = capsys.readouterr().out
    assert "split takes this one: its gather goes on to a matmul, whose ring hides it)" in out
    assert "split and chunk tie within 1000%, and chunk takes a tie)" in out
    # named strategies and the fallback pay no heed to ties
    assert all(s.all_reduce["strategy"] == "chunk" and "tie_to_split" not in s.all_reduce
               for s in rewrite(text, hardware="auto").report.sites if s.kind == "dot_all_reduce")
