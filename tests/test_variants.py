"""Pass variants — bidirectional rings, unroll by two, no loop at all, stream annotations — for every
site kind (gather with a free dim, gather with a contracting dim, scatter, one ring for several dots)
and ring sizes 2, 3, 4 and 8 (a 1-D mesh over the first n of the 8 CPU devices).

Numerics: the rewritten module against the original on random inputs; normwise relative f32 1e-5,
bf16 1e-2.  Structure: every emitted permute forms one cycle per replica group (networkx), and the
permutes a device executes — counted through the loops' trip counts — are exactly the ring's n-1 per
direction: no variant wastes or skips one.
"""

import functools

import jax
import jax.numpy as jnp
import networkx as nx
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import cmatmul_pass
from cmatmul_pass import execute, ir_utils
from cmatmul_pass._jax_private import ir
from cmatmul_pass.pipeline import variant_options
from cmatmul_pass.rewrites.schedule import FRONTEND_ATTRIBUTES, SCHEDULING_GROUP, STREAM_ANNOTATION
from conftest import run_cli

VARIANTS = {name: variant_options(name) for name in ("uni", "bidi", "unroll2", "full", "bidi-unroll2", "bidi-full")}
VARIANTS["streams-unroll2"] = variant_options("unroll2", annotate_streams=True)
VARIANTS["streams-bidi"] = variant_options("bidi", annotate_streams=True)
KINDS = ["ag_free", "ag_contracting", "rs", "shared", "merged"]
SIZES = [2, 3, 4, 8]


def gather(x, dim):
    return jax.lax.all_gather(x, "x", axis=dim, tiled=True)


def program(kind, n, dtype):
    """(function, argument specs) of one site kind on a ring of n."""
    if kind == "ag_free":
        return (lambda x, w: gather(x, 0) @ w), [((n * 4, 8), P("x", None)), ((8, 16), P())], P()
    if kind == "ag_contracting":
        return (lambda x, w: gather(x, 1) @ w), [((4, n * 4), P(None, "x")), ((n * 4, 8), P())], P()
    if kind == "rs":
        body = lambda x, w: jax.lax.psum_scatter(x @ w, "x", scatter_dimension=0, tiled=True)  # noqa: E731
        return body, [((n * 4, n * 2), P(None, "x")), ((n * 2, 8), P("x", None))], P("x", None)
    if kind == "shared":

        def body(x, w1, w2):
            g = gather(x, 0)
            return g @ w1, g.T @ w2, jnp.tanh(g)

        specs = [((n * 4, 8), P("x", None)), ((8, 16), P()), ((n * 4, 8), P())]
        return body, specs, (P(), P(), P())
    if kind == "merged":  # gate and up (one dot per round: w1 and w2 concatenated), and one at another precision

        def body(x, w1, w2, w3):
            g = gather(x, 0)
            return g @ w1, g @ w2, jnp.dot(g, w3, precision=jax.lax.Precision.HIGHEST)

        specs = [((n * 4, 8), P("x", None)), ((8, 16), P()), ((8, 8), P()), ((8, 16), P())]
        return body, specs, (P(), P(), P())
    raise ValueError(kind)


@functools.lru_cache(maxsize=None)
def lowered(kind, n, dtype=jnp.float32):
    mesh = Mesh(np.array(jax.devices("cpu")[:n]), ("x",))
    body, args, out_specs = program(kind, n, dtype)
    f = jax.shard_map(body, mesh=mesh, in_specs=tuple(s for _, s in args), out_specs=out_specs, check_vma=False)
    structs = [jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec)) for shape, spec in args]
    return jax.jit(f).lower(*structs).as_text()


def rewrite(kind, n, variant, dtype=jnp.float32):
    result = cmatmul_pass.rewrite(lowered(kind, n, dtype), VARIANTS[variant])
    assert len(result.report.rewritten) == 1, [s.summary_line() for s in result.report.sites]
    return result


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("kind", KINDS)
def test_variant_numerics(kind, n, variant):
    text = lowered(kind, n)
    result = rewrite(kind, n, variant)
    outcome = execute.check_numerics(ir_utils.parse(text), result.module)
    assert outcome.ok, outcome.format()


@pytest.mark.parametrize("variant", ["uni", "bidi", "bidi-unroll2", "full", "streams-bidi"])
@pytest.mark.parametrize("n", [3, 8])
@pytest.mark.parametrize("kind", ["ag_free", "ag_contracting", "rs"])
def test_variant_numerics_bf16(kind, n, variant):
    text = lowered(kind, n, jnp.bfloat16)
    result = rewrite(kind, n, variant, jnp.bfloat16)
    outcome = execute.check_numerics(ir_utils.parse(text), result.module)
    assert outcome.ok and outcome.outputs[0].dtype == "bf16", outcome.format()


# ------------------------------------------------------------------ structure
def trip_count(loop) -> int:
    """The constant bound of a counted stablehlo.while built by the pass (counter < bound)."""
    cond = list(loop.operation.regions[0].blocks)[0]
    compare = [op for op in cond.operations if op.operation.name == "stablehlo.compare"][0]
    bound = compare.operation.operands[1].owner
    return int(np.array(ir_utils.dense_ints(bound.attributes["value"])).reshape(-1)[0])


def executed_permutes(module) -> list[tuple[np.ndarray, int]]:
    """(source_target_pairs, times executed) of every collective_permute."""
    out = []
    for op in ir_utils.walk(module.operation):
        if op.operation.name != "stablehlo.collective_permute":
            continue
        times, parent = 1, op.operation.parent
        while parent is not None:
            if parent.name == "stablehlo.while":
                times *= trip_count(parent.opview)
            parent = parent.parent
        out.append((ir_utils.dense_ints(op.attributes["source_target_pairs"]), times))
    return out


def directions(kind, n, variant) -> int:
    return 2 if VARIANTS[variant].bidirectional and (kind == "rs" or n >= 3) else 1


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("kind", KINDS)
def test_every_variant_sends_each_shard_once_around_a_deadlock_free_ring(kind, n, variant):
    result = rewrite(kind, n, variant)
    (site,) = result.report.rewritten
    permutes = executed_permutes(result.module)
    for pairs, _ in permutes:
        graph = nx.DiGraph([tuple(p) for p in pairs.tolist()])
        assert all(graph.out_degree(v) == 1 and graph.in_degree(v) == 1 for v in graph)
        assert sorted(sorted(c) for c in nx.simple_cycles(graph)) == [list(range(n))]
    total = sum(times for _, times in permutes)
    # gathers move n-1 shards whichever way they travel; a split scatter moves n-1 half-blocks each way
    expected = (n - 1) * (directions(kind, n, variant) if kind == "rs" else 1)
    assert total == expected == site.schedule["permutes"]
    assert site.schedule["directions"] == directions(kind, n, variant)
    loops = [op for op in ir_utils.walk(result.module.operation) if op.operation.name == "stablehlo.while"]
    if VARIANTS[variant].unroll == "full":
        assert not loops and site.schedule["loop_trips"] == 0
    else:
        assert len(loops) <= 1 and site.schedule["loop_trips"] == (trip_count(loops[0]) if loops else 0)


def test_bidirectional_gather_halves_the_permute_rounds():
    for n in SIZES:
        (site,) = rewrite("ag_free", n, "bidi").report.rewritten
        permute_rounds = site.schedule["rounds"] - 1
        assert permute_rounds == -(-(n - 1) // 2), n  # ceil((n-1)/2)


def test_unroll_two_puts_two_rounds_in_each_trip():
    result = rewrite("ag_free", 8, "unroll2")
    (loop,) = [op for op in ir_utils.walk(result.module.operation) if op.operation.name == "stablehlo.while"]
    body = list(loop.operation.regions[1].blocks)[0]
    names = [op.operation.name for op in body.operations]
    assert names.count("stablehlo.collective_permute") == 2 and names.count("stablehlo.dot_general") == 2
    assert trip_count(loop) == 3  # rounds 0..5 in 3 trips; rounds 6 (remainder) and 7 (no send) peeled
    (site,) = result.report.rewritten
    assert (site.schedule["loop_trips"], site.schedule["rounds_per_trip"], site.schedule["peeled_rounds"]) == (3, 2, 2)


def test_odd_scatter_blocks_stay_one_directional_with_a_note():
    mesh = Mesh(np.array(jax.devices("cpu")[:4]), ("x",))
    body = lambda x, w: jax.lax.psum_scatter(x @ w, "x", scatter_dimension=0, tiled=True)  # noqa: E731
    f = jax.shard_map(body, mesh=mesh, in_specs=(P(None, "x"), P("x", None)), out_specs=P("x", None), check_vma=False)
    args = [jax.ShapeDtypeStruct((12, 8), jnp.float32, sharding=NamedSharding(mesh, P(None, "x"))),
            jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=NamedSharding(mesh, P("x", None)))]
    text = jax.jit(f).lower(*args).as_text()  # blocks of 3 rows: no halves
    result = cmatmul_pass.rewrite(text, VARIANTS["bidi"])
    (site,) = result.report.rewritten
    assert site.schedule["directions"] == 1 and "cannot be halved" in site.notes[0]
    assert site.cost["site"]["halvable"] is False  # the prediction is for the ring actually emitted
    assert site.cost["overlapped_s"]["bidi"] == site.cost["overlapped_s"]["uni"]
    assert execute.check_numerics(ir_utils.parse(text), result.module).ok


# ------------------------------------------------------------------ stream annotations
def frontend(op) -> dict:
    if FRONTEND_ATTRIBUTES not in op.attributes:
        return {}
    from cmatmul_pass._jax_private import ir

    return {a.name: ir.StringAttr(a.attr).value for a in ir.DictAttr(op.attributes[FRONTEND_ATTRIBUTES])}


@pytest.mark.parametrize("variant", ["streams-unroll2", "streams-bidi"])
@pytest.mark.parametrize("kind", KINDS)
def test_annotations_pair_each_permute_with_the_dots_it_hides(kind, variant):
    result = rewrite(kind, 8, variant)
    ops = list(ir_utils.walk(result.module.operation))
    calls = [op for op in ops if op.operation.name == "func.call" and "cmatmul_dot" in str(op.attributes["callee"])]
    permutes = [op for op in ops if op.operation.name == "stablehlo.collective_permute"]
    assert calls and not [op for op in ops if op.operation.name == "stablehlo.dot_general" and
                          ir_utils.enclosing_func_name(op) == "main"]
    for call in calls:
        attrs = frontend(call)
        assert attrs[STREAM_ANNOTATION] in {"1", "2", "3", "4"} and attrs["inlineable"] == "false"
    groups: dict[str, list[str]] = {}
    for op in calls + permutes:
        gid = frontend(op).get(SCHEDULING_GROUP)
        if gid is not None:
            groups.setdefault(gid, []).append(op.operation.name)
    assert groups, "no scheduling groups"
    for members in groups.values():  # one permute and the dot(s) it overlaps
        assert members.count("stablehlo.collective_permute") == 1 and "func.call" in members
    # the two dots of one loop trip run on two different streams
    loops = [op for op in ops if op.operation.name == "stablehlo.while"]
    for loop in loops:
        body = list(loop.operation.regions[1].blocks)[0]
        streams = [frontend(op)[STREAM_ANNOTATION] for op in body.operations if op.operation.name == "func.call"]
        assert len(set(streams)) >= 2, streams


def test_plain_variants_carry_no_annotations():
    result = rewrite("ag_free", 8, "bidi-unroll2")
    assert not any(frontend(op) for op in ir_utils.walk(result.module.operation) if op.operation.name in
                   ("stablehlo.collective_permute", "stablehlo.dot_general"))


@pytest.mark.parametrize("kind", KINDS)
def test_cpu_ignores_the_annotations(kind):
    """On CPU the annotations change nothing: integer results are bit-identical to the plain rewrite's;
    float results agree within the f32 tolerance (XLA CPU compiles an outlined, non-inlined dot on its
    own, which may order its inner sum differently: differences of an ulp or so were seen)."""
    for dtype in (jnp.int32, jnp.float32):
        text = lowered(kind, 4, dtype)
        inputs = execute.random_inputs(ir_utils.parse(text), seed=5)
        devices = execute.cpu_devices(4)[:4]
        plain = rewrite(kind, 4, "bidi", dtype).module
        annotated = cmatmul_pass.rewrite(text, cmatmul_pass.Options(bidirectional=True, annotate_streams=True)).module
        if dtype == jnp.int32:
            for a, b in zip(execute.run(plain, inputs, devices), execute.run(annotated, inputs, devices)):
                for x, y in zip(a, b):
                    if np.issubdtype(x.dtype, np.integer):
                        np.testing.assert_array_equal(x, y)
        else:
            outcome = execute.check_numerics(plain, annotated)
            assert outcome.ok, outcome.format()


# ------------------------------------------------------------------ options and CLI
def ops_named(module, name: str) -> list:
    return [op for op in ir_utils.walk(module.operation) if op.operation.name == name]


def dots_sharing_an_operand(module) -> int:
    """Pairs of dot_generals in one block that read the same value: XLA's dot merger merges such
    dots (concatenating their other operands) whenever neither depends on the other."""
    readers: dict = {}
    for op in ops_named(module, "stablehlo.dot_general"):
        for value in op.operation.operands:
            readers.setdefault((op.operation.block, value), []).append(op)
    return sum(len(ops) * (len(ops) - 1) // 2 for ops in readers.values())


def test_merged_dots_concatenate_their_operands_once_before_the_ring():
    """w1 and w2 (same dims, same attributes) become one dot per round on their concatenation,
    built outside the loop, into one accumulator; the HIGHEST-precision dot keeps its own.
    Numbers: test_variant_numerics."""
    result = rewrite("merged", 4, "uni")
    (site,) = result.report.sites
    assert len(site.consumers) == 3
    (concat,) = ops_named(result.module, "stablehlo.concatenate")
    assert concat.operation.parent.name != "stablehlo.while" and ir.RankedTensorType(concat.result.type).shape == [8, 24]
    # two dots per round (the merged one and the HIGHEST one), in the loop and in the peeled round;
    # the merged dot's accumulator is sliced in two once, after the ring
    assert len(ops_named(result.module, "stablehlo.dot_general")) == 4
    slices = ops_named(result.module, "stablehlo.slice")
    assert len(slices) == 2 and all(op.operation.parent.name != "stablehlo.while" for op in slices)
    unmerged = cmatmul_pass.rewrite(lowered("merged", 4), variant_options("uni", merge_dots=False))
    assert len(ops_named(unmerged.module, "stablehlo.dot_general")) == 6
    assert not ops_named(unmerged.module, "stablehlo.concatenate")


@pytest.mark.parametrize("variant", ["bidi", "unroll2", "full", "bidi-unroll2", "bidi-full"])
@pytest.mark.parametrize("kind", ["ag_free", "rs", "merged"])
def test_rounds_sharing_a_block_read_their_operands_through_a_barrier(kind, variant):
    """Where several rounds or directions compute in one block, no two of their dots read the same
    value, so XLA cannot merge them into one dot waiting for every round's transfer (measured on
    an H100 compile: unroll2 hid 30 of 45 permutes without the barriers, 43 with them).  Without
    ``tie_rounds`` they share the other operand.  One-round blocks (uni) get no barrier."""
    result = rewrite(kind, 4, variant)
    assert ops_named(result.module, "stablehlo.optimization_barrier")
    assert dots_sharing_an_operand(result.module) == 0
    untied = cmatmul_pass.rewrite(lowered(kind, 4), variant_options(variant, tie_rounds=False))
    assert not ops_named(untied.module, "stablehlo.optimization_barrier")
    assert dots_sharing_an_operand(untied.module) > 0
    assert not ops_named(rewrite(kind, 4, "uni").module, "stablehlo.optimization_barrier")


@pytest.mark.parametrize("variant, tied", [("uni", 0), ("unroll2", 1), ("full", 2)])
@pytest.mark.parametrize("kind", ["ag_free", "ag_contracting", "merged"])
def test_a_gather_round_sends_after_the_previous_rounds_dot(kind, variant, tied):
    """In a block of several rounds, each round's permute reads the shard through a barrier with
    a dot of the round before (ring of 4: rounds 0-2 send; unroll2 has round 0 before the loop
    and rounds 1-2 in it; full has all of them in one block), so XLA cannot start a transfer
    during the previous round's dot (an H100 compile did, leaving the previous transfer exposed)."""
    module = rewrite(kind, 4, variant).module
    after_dot = 0
    for permute in ops_named(module, "stablehlo.collective_permute"):
        source = permute.operation.operands[0].owner
        if getattr(source, "name", None) == "stablehlo.optimization_barrier":  # not a block argument
            assert source.operands[1].owner.name == "stablehlo.dot_general"
            after_dot += 1
    assert after_dot == tied


def test_options_reject_other_unroll_factors():
    with pytest.raises(ValueError, match="unroll"):
        cmatmul_pass.Options(unroll=3)


def test_cli_variant_flags_and_hlo_emission(tmp_path, capsys):
    src = tmp_path / "ag.mlir"
    src.write_text(lowered("ag_free", 4))
    out = tmp_path / "o.mlir"
    assert run_cli("rewrite", src, "--bidirectional", "--unroll", "2", "--annotate-streams", "-o", out, "-q") == 0
    assert "_xla_stream_annotation" in out.read_text() and "cmatmul_dot_0" in out.read_text()
    hlo = tmp_path / "o.hlo"
    assert run_cli("rewrite", src, "--emit", "hlo", "--unroll", "full", "-o", hlo, "-q") == 0
    assert hlo.read_text().startswith("HloModule") and "collective-permute(" in hlo.read_text()
    assert "while(" not in hlo.read_text()
    assert run_cli("rewrite", src, "--emit", "hlo", "--emit-bytecode", "-o", tmp_path / "x", "-q") == 2
    assert not (tmp_path / "x").exists()
    assert run_cli("check", src, "--bidirectional", "--unroll", "full", "-q") == 0
    assert "numerics: OK" in capsys.readouterr().out
