"""A norm of the gathered rows before the dot, the raw rows read elsewhere too (the collective
moved to the dot).

``all_gather -> RMS norm / layer norm -> dot`` whose gathered rows also leave the region (a
backward's residual, through ``sdy.return``): moving the gather past the norm would gather the rows
twice, so the gather rings with its dot, the ring applying the norm (a DAG: the rows are read by the
statistic and by the scale) to each block it receives, ``f(all_gather(x))[block k] == f(x_k)`` for
an ``f`` that works row by row, and assembling the raw blocks for the other readers.  These tests
compare the rewritten module with the original on random inputs in every ring variant (floats
judged against the original's own rounding error, as ``check`` judges them), check that the ring
normalises blocks of rows, and that a chain mixing rows stays declined with the reason it had."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import cmatmul_pass
from cmatmul_pass import execute, ir_utils
from cmatmul_pass._jax_private import ir
from cmatmul_pass.cost import VARIANTS
from conftest import sample

MESH = jax.make_mesh((8,), ("model",))
ROWS, HIDDEN, OUT = 64, 32, 16


def rms_norm(h, g, rows):
    return h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6) * g


def layer_norm(h, g, rows):
    mean = h.mean(-1, keepdims=True)
    return (h - mean) * jax.lax.rsqrt(((h - mean) ** 2).mean(-1, keepdims=True) + 1e-5) * g


def rms_norm_per_row_scale(h, g, rows):
    """Scaled per row by a value computed apart from the gathered rows (this device's own: each
    block reads its rows of it)."""
    return rms_norm(h, g, rows) * rows


def rms_norm_bf16(h, g, rows):
    """Normalised in f32, the dot in bf16 (converts on the way)."""
    return rms_norm(h.astype(jnp.float32), g, rows).astype(jnp.bfloat16)


NORMS = {"rms": rms_norm, "layer": layer_norm, "rms_per_row_scale": rms_norm_per_row_scale,
         "rms_bf16": rms_norm_bf16}


def program(norm, dtype=jnp.float32) -> str:
    """The gathered rows normalised into a dot, and returned raw too (the residual)."""
    def body(x, g, w):
        h = jax.lax.all_gather(x, "model", axis=0, tiled=True)
        # [ROWS, 1], differs per row and per device (this device's mean of its shard)
        rows = (jnp.arange(ROWS, dtype=jnp.float32)[:, None] / ROWS + 1) * jnp.mean(x.astype(jnp.float32))
        n = norm(h, g, rows)
        return jnp.dot(n, w.astype(n.dtype), preferred_element_type=jnp.float32), h

    specs = (P("model", None), P(), P())
    f = jax.shard_map(body, mesh=MESH, in_specs=specs, out_specs=(P(), P("model", None)), check_vma=False)
    shapes = [((ROWS, HIDDEN), dtype), ((HIDDEN,), jnp.float32), ((HIDDEN, OUT), jnp.float32)]
    args = [jax.ShapeDtypeStruct(s, t, sharding=NamedSharding(MESH, sp)) for (s, t), sp in zip(shapes, specs)]
    return jax.jit(f).lower(*args).as_text()


def gather_entry(result):
    (entry,) = [s for s in result.report.sites if s.kind == "all_gather_dot"]
    return entry


def test_the_norm_is_traced_as_a_dag_and_the_raw_rows_assembled():
    result = cmatmul_pass.rewrite(program(rms_norm))
    entry = gather_entry(result)
    assert entry.rewritten, entry.summary_line()
    look = entry.consumers[0]["look_through"]
    assert look.count("broadcast_in_dim") == 2 and "reduce" in look and "rsqrt" in look, look
    assert any(reader.startswith("sdy.return") for reader in entry.assembled_for), entry.assembled_for
    assert not ir_utils.ops_named(result.module, "stablehlo.all_gather")["stablehlo.all_gather"]


@pytest.mark.parametrize("norm", sorted(NORMS))
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_variant_matches_the_original(norm, variant):
    dtype = jnp.bfloat16 if norm.endswith("bf16") else jnp.float32
    text = program(NORMS[norm], dtype)
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(variant=variant))
    entry = gather_entry(result)
    assert entry.rewritten and entry.schedule["variant"] == variant, entry.summary_line()
    assert "reduce" in entry.consumers[0]["look_through"]
    assert not ir_utils.ops_named(result.module, "stablehlo.all_gather")["stablehlo.all_gather"]
    outcome = execute.check_numerics(ir_utils.parse(text), result.module)
    assert outcome.ok, outcome.format()


def line_of(text: str, needle: str) -> int:
    """The 1-based line of the module's first line holding ``needle`` (the header's golden block,
    whose length changes with the pass's output, is skipped: its lines start with ``//``)."""
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line and not line.startswith("//"))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_the_sample_s_forward_gather_rings_in_every_variant(variant):
    """rs_norm_backward (value_and_grad of a sequence-parallel MLP with an RMS norm, the gain
    trained): the forward's row gather (the module's first) rings through the norm; the region's
    raw rows and the norm's values still leave it, computed from the assembled rows."""
    text = sample("rs_norm_backward").read_text()
    gather, ret = line_of(text, '"stablehlo.all_gather"'), line_of(text, "sdy.return")
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(variant=variant))
    (entry,) = [s for s in result.report.sites if s.location.endswith(f":{gather}:13")]
    assert entry.rewritten and entry.schedule["variant"] == variant, entry.summary_line()
    assert entry.consumers[0]["look_through"][:3] == ["multiply", "reduce", "broadcast_in_dim"]
    assert f"sdy.return at <input>:{ret}:7" in entry.assembled_for, entry.assembled_for
    assert all(s.rewritten for s in result.report.sites if s.kind != "dot_all_reduce")
    outcome = execute.check_numerics(ir_utils.parse(text), result.module)
    assert outcome.ok, outcome.format()


def test_the_ring_normalises_blocks_of_rows():
    """In the loop the norm's sum over the hidden dim reads 8 rows (of 64) at a time; the whole
    rows are normalised only outside it, for the residual readers (the assembled value)."""
    result = cmatmul_pass.rewrite(program(rms_norm), cmatmul_pass.Options(variant="uni"))
    (loop,) = ir_utils.ops_named(result.module, "stablehlo.while")["stablehlo.while"]
    reduces = ir_utils.ops_named(loop, "stablehlo.reduce")["stablehlo.reduce"]
    assert reduces
    assert all(list(ir_utils.ranked_tensor(r.operation.operands[0]).shape) == [ROWS // 8, HIDDEN] for r in reduces)
    assert all(list(ir.DenseI64ArrayAttr(r.attributes["dimensions"])) == [1] for r in reduces)


def rows_mixing(kind):
    """A chain from the gathered rows to the dot that reads other rows of the gathered dim."""
    if kind == "sum_over_rows":  # a statistic over the gathered dim (a column norm): a reduce over it
        return lambda h, g, rows: h * jax.lax.rsqrt(jnp.mean(h * h, axis=0, keepdims=True) + 1e-6) * g
    if kind == "cumsum":  # a cumulative sum over the rows (jax outlines it: a func.call)
        return lambda h, g, rows: h * jnp.cumsum(h, axis=0) * g
    if kind == "global":  # one statistic of every row
        return lambda h, g, rows: h / jnp.sum(h * h) * g
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["sum_over_rows", "cumsum", "global"])
def test_a_chain_mixing_rows_stays_declined_with_its_reason(kind):
    """The DAG is tried only as a ring; where an op on the way reads other rows, the site keeps the
    decline it had (the same reason as with assembling off, where the DAG is never tried), and
    the module is unchanged."""
    text = program(rows_mixing(kind))
    result = cmatmul_pass.rewrite(text)
    entry = gather_entry(result)
    assert not entry.rewritten
    assert entry.reason_code in ("layout", "schedule"), entry.reason
    assert "computed from the gathered value itself" in entry.reason, entry.reason
    plain = gather_entry(cmatmul_pass.rewrite(text, cmatmul_pass.Options(assemble=False)))
    assert (entry.reason_code, entry.reason) == (plain.reason_code, plain.reason)
    assert ir_utils.ops_named(result.module, "stablehlo.all_gather")["stablehlo.all_gather"]


def test_without_assembling_the_norm_site_keeps_its_decline():
    """--no-assemble: the raw rows cannot be assembled in the ring, so the site says why it is
    neither ringed nor moved, as before."""
    result = cmatmul_pass.rewrite(program(rms_norm), cmatmul_pass.Options(assemble=False))
    entry = gather_entry(result)
    assert not entry.rewritten and entry.reason_code == "layout"
    assert "so the rows would cross the wire twice" in entry.reason, entry.reason


def test_without_other_readers_the_gather_still_moves_to_its_dot():
    """Nothing but the dot reads the rows: the gather moves past the norm (the norm then runs on
    this device's rows only), as before; the DAG ring is not used."""
    def body(x, g, w):
        return rms_norm(jax.lax.all_gather(x, "model", axis=0, tiled=True), g, None) @ w

    specs = (P("model", None), P(), P())
    f = jax.shard_map(body, mesh=MESH, in_specs=specs, out_specs=P(), check_vma=False)
    args = [jax.ShapeDtypeStruct(s, jnp.float32, sharding=NamedSharding(MESH, sp))
            for s, sp in zip([(ROWS, HIDDEN), (HIDDEN,), (HIDDEN, OUT)], specs)]
    entry = gather_entry(cmatmul_pass.rewrite(jax.jit(f).lower(*args).as_text()))
    assert entry.rewritten and any("moved to its dot past" in note for note in entry.notes), entry.notes
    assert entry.consumers[0]["look_through"] == []


def test_per_row_operand_is_read_at_the_block_s_rows():
    """The per-row factor differs per device and per row: each device's ring reads its own
    factor's rows of the block it computes (a dynamic_slice in the loop), as the original
    multiplies its own factor into the whole gathered rows."""
    result = cmatmul_pass.rewrite(program(rms_norm_per_row_scale), cmatmul_pass.Options(variant="uni"))
    (loop,) = ir_utils.ops_named(result.module, "stablehlo.while")["stablehlo.while"]
    slices = ir_utils.ops_named(loop, "stablehlo.dynamic_slice")["stablehlo.dynamic_slice"]
    # the factor broadcast over the hidden dim, [ROWS, HIDDEN], computed before the loop: 8 rows of it
    (piece,) = [s for s in slices if list(ir_utils.ranked_tensor(s.result).shape) == [ROWS // 8, HIDDEN]]
    factor = piece.operation.operands[0].owner
    assert factor.operation.name == "stablehlo.broadcast_in_dim" and factor.operation.block != piece.operation.block


@pytest.mark.parametrize("layers", [3, 5])
@pytest.mark.parametrize("share", [True, False])
def test_repeated_layers_share_the_norm_ring(share, layers):
    """SP MLP blocks (norm of the gathered rows, gelu, scatter), each returning its raw rows: every
    gather rings through its norm; the later blocks call one shared ring function, or, where the
    regions form a replayed group (cmatmul_pass/replay/), calls of the first, its rings inline."""
    def body(x, g, w):
        h = jax.lax.all_gather(x, "model", axis=0, tiled=True)
        y = jax.nn.gelu(rms_norm(h, g, None) @ w) @ w.T
        return jax.lax.psum_scatter(y, "model", scatter_dimension=0, tiled=True), h

    specs = (P("model", None), P(), P())
    f = jax.shard_map(body, mesh=MESH, in_specs=specs, out_specs=(P("model", None), P("model", None)),
                      check_vma=False)

    def blocks(x, g, w):
        rows = []
        for _ in range(layers):
            x, h = f(x, g, w)
            rows.append(h)
        return x, rows

    args = [jax.ShapeDtypeStruct(s, jnp.float32, sharding=NamedSharding(MESH, sp))
            for s, sp in zip([(ROWS, HIDDEN), (HIDDEN,), (HIDDEN, HIDDEN)], specs)]
    text = jax.jit(blocks).lower(*args).as_text()
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(variant="bidi-full", share_rings=share))
    gathers = [s for s in result.report.sites if s.kind == "all_gather_dot"]
    assert len(gathers) == layers and all(s.rewritten for s in gathers), [s.summary_line() for s in gathers]
    assert all("reduce" in s.consumers[0]["look_through"] for s in gathers)
    replayed = sum(len(calls) for calls in result.report.layers.values())
    assert (replayed >= 3) == share  # (sharing off: no replay either)
    assert [bool(s.shared_ring) for s in gathers[1:]] == [share and not replayed] * (layers - 1)
    outcome = execute.check_numerics(ir_utils.parse(text), result.module)
    assert outcome.ok, outcome.format()


@pytest.mark.parametrize("merge", [True, False])
@pytest.mark.parametrize("variant", ["uni", "bidi-full"])
def test_two_dots_through_one_norm(variant, merge):
    """Gate and up projections of one normalised value (the raw rows returned too): one ring
    computes both dots, the norm applied once per block for the two."""
    def body(x, g, wg, wu):
        h = jax.lax.all_gather(x, "model", axis=0, tiled=True)
        n = rms_norm(h, g, None)
        return jax.nn.silu(n @ wg) * (n @ wu), h

    specs = (P("model", None), P(), P(), P())
    f = jax.shard_map(body, mesh=MESH, in_specs=specs, out_specs=(P(), P("model", None)), check_vma=False)
    args = [jax.ShapeDtypeStruct(s, jnp.float32, sharding=NamedSharding(MESH, sp))
            for s, sp in zip([(ROWS, HIDDEN), (HIDDEN,), (HIDDEN, OUT), (HIDDEN, OUT)], specs)]
    text = jax.jit(f).lower(*args).as_text()
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(variant=variant, merge_dots=merge))
    entry = gather_entry(result)
    assert entry.rewritten and len(entry.consumers) == 2, entry.summary_line()
    (loop,) = ir_utils.ops_named(result.module, "stablehlo.while")["stablehlo.while"] or [None]
    if variant == "uni":  # one norm per block: one reduce over the hidden dim in the loop's body
        assert len(ir_utils.ops_named(loop, "stablehlo.reduce")["stablehlo.reduce"]) == 1
        # merged: one dot of the block against both weights concatenated; else one dot each
        assert len(ir_utils.ops_named(loop, "stablehlo.dot_general")["stablehlo.dot_general"]) == (1 if merge else 2)
    outcome = execute.check_numerics(ir_utils.parse(text), result.module)
    assert outcome.ok, outcome.format()


# ------------------------------------------- the move refused: the ring applies the DAG on its own
def refused_program(case: str) -> str:
    """Gathered rows whose move past the row-wise ops to the dots is refused (the shapes the move
    does not take), nothing returned raw:

    * ``two_gains``: one norm, two dots reading it through two different gains: moved, two
      normalised values would each be gathered, twice the bytes of the rows;
    * ``f32_norm``: bf16 rows normalised in f32 into an f32 dot: moved, the gather would carry f32,
      twice the bytes;

    and one whose move is not refused: ``mixed_reader``, the normalised rows also read by an op
    that mixes rows (a cumulative sum over them), gathered once, after the norm, for the dot's
    ring to assemble for that op."""
    dtype = jnp.bfloat16 if case == "f32_norm" else jnp.float32

    def body(x, g, w1, w2):
        h = jax.lax.all_gather(x, "model", axis=0, tiled=True)
        if case == "two_gains":
            n = rms_norm(h, 1.0, None)
            return (n * g) @ w1 + (n * (g + 1)) @ w2
        if case == "f32_norm":
            return rms_norm(h.astype(jnp.float32), g, None) @ w1
        n = rms_norm(h, g, None)
        return n @ w1, jnp.cumsum(n, axis=0)

    specs = (P("model", None), P(), P(), P())
    outs = (P(), P()) if case == "mixed_reader" else P()
    f = jax.shard_map(body, mesh=MESH, in_specs=specs, out_specs=outs, check_vma=False)
    shapes = [((ROWS, HIDDEN), dtype), ((HIDDEN,), jnp.float32), ((HIDDEN, OUT), jnp.float32),
              ((HIDDEN, OUT), jnp.float32)]
    args = [jax.ShapeDtypeStruct(s, t, sharding=NamedSharding(MESH, sp)) for (s, t), sp in zip(shapes, specs)]
    return jax.jit(f).lower(*args).as_text()


REFUSED = {"two_gains": 2, "f32_norm": 1}  # -> the dots the ring computes


@pytest.mark.parametrize("case", sorted(REFUSED))
@pytest.mark.parametrize("variant", ["uni", "unroll2", "bidi-full"])
def test_a_refused_move_rings_with_the_ops_per_block(case, variant):
    text = refused_program(case)
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(variant=variant))
    entry = gather_entry(result)
    assert entry.rewritten and entry.schedule["variant"] == variant, entry.summary_line()
    (note,) = [n for n in entry.notes if n.startswith("rung with the row-wise ops")]
    assert "more bytes than the one gather moves now" in note and "(where it stood: declined [layout])" in note, note
    assert entry.moved_from == "layout"  # (the report's field, which replay's trims read)
    assert all(e.moved_from is None for e in result.report.sites if e is not entry)
    assert len(entry.consumers) == REFUSED[case] and not entry.assembled_for, entry.summary_line()
    # the rows cross the wire once, raw: no gather is left, and none was added
    assert not ir_utils.ops_named(result.module, "stablehlo.all_gather")["stablehlo.all_gather"]
    (loop,) = ir_utils.ops_named(result.module, "stablehlo.while")["stablehlo.while"] or [None]
    if variant == "uni":  # the norm applied to each block of rows in the loop, once for both dots
        reduces = ir_utils.ops_named(loop, "stablehlo.reduce")["stablehlo.reduce"]
        assert len(reduces) == 1 and list(ir_utils.ranked_tensor(reduces[0].operation.operands[0]).shape)[0] == ROWS // 8
    outcome = execute.check_numerics(ir_utils.parse(text), result.module)
    assert outcome.ok, outcome.format()


def test_normalised_rows_read_by_a_row_mixing_op_move_and_are_assembled_for_it():
    text = refused_program("mixed_reader")
    result = cmatmul_pass.rewrite(text)
    entry = gather_entry(result)
    assert entry.rewritten and any(n.startswith("moved to its dot past") for n in entry.notes), entry.notes
    assert [r.split(" at ")[0] for r in entry.assembled_for] == ["func.call"], entry.assembled_for
    outcome = execute.check_numerics(ir_utils.parse(text), result.module)
    assert outcome.ok, outcome.format()


def test_a_refused_move_stays_declined_without_its_ring_when_the_chain_mixes_rows():
    """The fallback is the DAG's own matcher: a chain that mixes rows before the dot (a statistic
    over the gathered dim) keeps its decline, which names the op, and the module its gather."""
    def body(x, g, w1, w2):
        h = jax.lax.all_gather(x, "model", axis=0, tiled=True)
        n = h * jax.lax.rsqrt(jnp.mean(h * h, axis=0, keepdims=True) + 1e-6)  # a statistic over the rows
        return (n * g) @ w1 + (n * (g + 1)) @ w2

    specs = (P("model", None), P(), P(), P())
    f = jax.shard_map(body, mesh=MESH, in_specs=specs, out_specs=P(), check_vma=False)
    args = [jax.ShapeDtypeStruct(s, jnp.float32, sharding=NamedSharding(MESH, sp))
            for s, sp in zip([(ROWS, HIDDEN), (HIDDEN,), (HIDDEN, OUT), (HIDDEN, OUT)], specs)]
    text = jax.jit(f).lower(*args).as_text()
    result = cmatmul_pass.rewrite(text)
    entry = gather_entry(result)
    assert not entry.rewritten and entry.reason_code in ("layout", "schedule"), entry.summary_line()
    assert "computed from the gathered value itself" in entry.reason, entry.reason
    assert ir_utils.ops_named(result.module, "stablehlo.all_gather")["stablehlo.all_gather"]


@pytest.mark.parametrize("assemble", [True, False])
@pytest.mark.parametrize("variant", ["uni", "unroll2", "bidi-full"])
def test_a_dot_of_the_raw_rows_and_one_of_their_norm_share_the_ring(variant, assemble):
    """One dot reads the gathered rows, another their norm: the ring computes both, applying the
    norm to each block for the second, and assembles nothing (before: the first dot's ring
    assembled the rows for the norm, whose dot waited for them; under --no-assemble, declined)."""
    def body(x, g, w1, w2):
        h = jax.lax.all_gather(x, "model", axis=0, tiled=True)
        return h @ w1 + rms_norm(h, g, None) @ w2

    specs = (P("model", None), P(), P(), P())
    f = jax.shard_map(body, mesh=MESH, in_specs=specs, out_specs=P(), check_vma=False)
    args = [jax.ShapeDtypeStruct(s, jnp.float32, sharding=NamedSharding(MESH, sp))
            for s, sp in zip([(ROWS, HIDDEN), (HIDDEN,), (HIDDEN, OUT), (HIDDEN, OUT)], specs)]
    text = jax.jit(f).lower(*args).as_text()
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(variant=variant, assemble=assemble))
    entry = gather_entry(result)
    assert entry.rewritten and len(entry.consumers) == 2 and not entry.assembled_for, entry.summary_line()
    looks = sorted(len(c["look_through"]) for c in entry.consumers)
    assert looks[0] == 0 and looks[1] > 0, entry.consumers  # the raw dot reads the block itself
    assert not ir_utils.ops_named(result.module, "stablehlo.all_gather")["stablehlo.all_gather"]
    outcome = execute.check_numerics(ir_utils.parse(text), result.module)
    assert outcome.ok, outcome.format()
