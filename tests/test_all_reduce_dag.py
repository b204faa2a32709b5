"""A norm's backward between the dot and a psum (the psum side of the norm backward).

``jax.value_and_grad`` of a Megatron MLP block ``x + psum(gelu(norm(x, g) @ w1) @ w2)`` in a
``shard_map`` with ``check_vma=False`` sums the input gradient ``dy + norm_backward(da @ w1^T)``
with a psum at the region's end: the norm's backward (which reads the product twice: a DAG, not a
chain) and the residual's cotangent stand between the dot and the all_reduce, and a trained gain's
gradient (a sum over the rows of the product times the normed input) is read beside it.  Both
strategies apply that map to a piece of the rows: ``split``'s reduce-scatter ring per block,
``chunk`` per row chunk.  These tests check that the site is matched and rewritten, that its
sums over the hidden dim run on a block's (a chunk's) rows, and that the rewritten program's
outputs are the original's on random inputs, in f32 and bf16."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import cmatmul_pass
from cmatmul_pass import execute, ir_utils
from cmatmul_pass._jax_private import ir
from cmatmul_pass.matchers.all_reduce import AllReduceSite, find_dot_all_reduce
from cmatmul_pass.matchers.common import DeclinedSite
from cmatmul_pass.rewrites.dot_all_reduce import chunk_dims_ok
from conftest import inline_layers
from test_norm_backward import NORMS  # the scatter side's RMS and layer norms

MESH = jax.make_mesh((8,), ("model",))
SPECS = (P(), P(), P(None, "model"), P("model", None))
ROWS, HIDDEN, FFN = 64, 32, 128
SHAPES = [(ROWS, HIDDEN), (HIDDEN,), (HIDDEN, FFN), (FFN, HIDDEN)]


#: the gain trained (its gradient read beside the psum, a sum over the rows) or not
ARGNUMS = {"trained_gain": (0, 1, 2, 3), "frozen_gain": (0, 2, 3)}
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}


def megatron_block(norm):
    """A pre-norm Megatron MLP block (no sequence parallelism): the residual inside the region."""
    def body(x, g, w1, w2):
        return x + jax.lax.psum(jax.nn.gelu(norm(x, g) @ w1) @ w2, "model")

    return jax.shard_map(body, mesh=MESH, in_specs=SPECS, out_specs=P(), check_vma=False)


def abstract_args(dtype):
    return [jax.ShapeDtypeStruct(s, dtype, sharding=NamedSharding(MESH, sp)) for s, sp in zip(SHAPES, SPECS)]


def grad_text(norm: str, gain: str, dtype: str = "f32", layers: int = 1) -> str:
    """value_and_grad of ``layers`` blocks in a row (one shard_map each)."""
    block = megatron_block(NORMS[norm])

    def loss(x, g, w1, w2):
        for _ in range(layers):
            x = block(x, g, w1, w2)
        return jnp.mean(x.astype(jnp.float32) ** 2)

    fn = jax.value_and_grad(loss, argnums=ARGNUMS[gain])
    return jax.jit(fn).lower(*abstract_args(DTYPES[dtype])).as_text()


def norm_backward_sites(module: ir.Module) -> list[AllReduceSite]:
    """The psums whose traced path holds a reduce (the norm backward's sums over the hidden dim)."""
    return [s for s in find_dot_all_reduce(module) if isinstance(s, AllReduceSite)
            and any(step.op.operation.name == "stablehlo.reduce" for step in s.path)]


def reduces(module: ir.Module, shape: list[int], dims: list[int]) -> int:
    """How many reduces sum an operand of ``shape`` over ``dims``."""
    return len([r for r in ir_utils.ops_named(module, "stablehlo.reduce")["stablehlo.reduce"]
                if list(ir_utils.ranked_tensor(r.operation.operands[0]).shape) == shape
                and list(ir.DenseI64ArrayAttr(r.attributes["dimensions"])) == dims])


def all_reduces(module: ir.Module) -> int:
    return len(ir_utils.ops_named(module, "stablehlo.all_reduce")["stablehlo.all_reduce"])


def check(text: str, options: cmatmul_pass.Options, layers: int = 1, gain_trained: bool = True):
    """Rewrite ``text``; assert every norm-backward psum is matched and rewritten, no all_reduce of
    a dot is left but the chunks', the norm backward's sums over the hidden dim and the gain
    gradient's sum over the rows run on pieces of the rows only, and the outputs match."""
    original = ir_utils.parse(text)
    sites = norm_backward_sites(original)
    assert len(sites) == layers, [s.summary_line() for s in cmatmul_pass.rewrite(text).report.sites]
    (site,) = sites[:1]
    # the norm backward's sums over the hidden dim (the row statistics), and the gain's over the rows
    hidden = [s for s in site.path if s.op.operation.name == "stablehlo.reduce" and not s.sums_rows
              and list(ir_utils.ranked_tensor(s.op.operation.operands[0]).shape) == [ROWS, HIDDEN]]
    assert hidden and len([s for s in site.path if s.sums_rows]) == int(gain_trained)
    full_rows = reduces(original, [ROWS, HIDDEN], [1])
    over_rows = reduces(original, [ROWS, HIDDEN], [0])
    locations = {ir_utils.render_location(s.anchor.location, "<input>") for s in sites}  # as the report names them

    result = cmatmul_pass.rewrite(text, options)
    entries = [e for e in result.report.sites if e.kind == "dot_all_reduce"]
    mine = [e for e in entries if e.location in locations]
    assert len(mine) == layers and all(e.rewritten for e in mine), [e.summary_line() for e in entries]
    # each layer's forward psum too (the incoming cotangent's psum, split for the backward's matmuls'
    # gather ring where the pass splits psums, is no dot's: not counted)
    rewritten = [e for e in entries if e.rewritten and e.all_reduce.get("picked") != "summed value"]
    summed = len([e for e in entries if e.rewritten]) - len(rewritten)  # (each leaves a reduce-scatter)
    assert len(rewritten) == 2 * layers, [e.summary_line() for e in entries]
    module = result.module
    inline_layers(module)  # identical layers are calls of one: count each layer's ops
    if options.all_reduce == "chunk":
        k = options.chunks
        assert all(e.all_reduce["chunks"] == k for e in rewritten)
        assert all_reduces(module) == all_reduces(original) - len(rewritten) + k * len(rewritten) - summed
        piece = ROWS // k
    else:  # no all_reduce of a dot is left: each remaining one is declined where it stands
        assert all(isinstance(s, DeclinedSite) for s in find_dot_all_reduce(module))
        assert all_reduces(module) == all_reduces(original) - len(rewritten) - summed
        assert len(ir_utils.ops_named(module, "stablehlo.reduce_scatter")["stablehlo.reduce_scatter"]) == summed
        piece = None
    # the norm backward's row statistics are not taken over the whole product...
    assert reduces(module, [ROWS, HIDDEN], [1]) == full_rows - layers * len(hidden)
    # ...but over a piece of its rows (a chunk; a ring's block or half-block)
    pieces = [r for r in ir_utils.ops_named(module, "stablehlo.reduce")["stablehlo.reduce"]
              if ir_utils.ranked_tensor(r.operation.operands[0]).shape[0] < ROWS
              and list(ir.DenseI64ArrayAttr(r.attributes["dimensions"])) == [1]]
    assert pieces and (piece is None or {ir_utils.ranked_tensor(r.operation.operands[0]).shape[0]
                                         for r in pieces} == {piece})
    # a trained gain's gradient: each piece's share summed over its rows, never the whole product
    assert reduces(module, [ROWS, HIDDEN], [0]) == over_rows - layers * int(gain_trained)
    outcome = execute.check_numerics(ir_utils.parse(text), module)
    assert outcome.ok, outcome.format()
    return result


# ---------------------------------------------------------------- split: the reduce-scatter ring
@pytest.mark.parametrize("variant", ["uni", "bidi", "unroll2", "full"])
@pytest.mark.parametrize("gain", sorted(ARGNUMS))
@pytest.mark.parametrize("norm", sorted(NORMS))
def test_split_applies_the_norm_backward_per_ring_block(norm, gain, variant):
    check(grad_text(norm, gain), cmatmul_pass.Options(all_reduce="split", variant=variant),
          gain_trained=gain == "trained_gain")


def test_split_gathers_the_norm_backward_rows_before_the_return():
    """The ring leaves this device's rows of the input gradient; the all_gather carried forward
    (rewrites/sequence_parallel.py) finds no row-wise reader and is placed before the region's
    return, where the whole value is read; the gain's psum, a sum over the rows, stays a psum."""
    result = check(grad_text("rms", "trained_gain"), cmatmul_pass.Options(all_reduce="split", variant="uni"))
    entries = [e for e in result.report.sites if e.kind == "dot_all_reduce" and e.rewritten
               and e.all_reduce.get("picked") != "summed value"]
    assert all(len(e.all_reduce["gathers"]) == 1 and e.all_reduce["gathers"][0].startswith("before sdy.return")
               for e in entries), [e.all_reduce["gathers"] for e in entries]
    gathers = ir_utils.ops_named(result.module, "stablehlo.all_gather")["stablehlo.all_gather"]
    assert len(gathers) == 2 and all(ir_utils.users(g.result)[0].operation.name == "sdy.return" for g in gathers)


# ---------------------------------------------------------------- chunk: k all_reduces of row chunks
@pytest.mark.parametrize("chunks", [2, 4, 8])
@pytest.mark.parametrize("gain", sorted(ARGNUMS))
@pytest.mark.parametrize("norm", sorted(NORMS))
def test_chunk_applies_the_norm_backward_per_row_chunk(norm, gain, chunks):
    check(grad_text(norm, gain), cmatmul_pass.Options(all_reduce="chunk", chunks=chunks),
          gain_trained=gain == "trained_gain")


def hand_written_psum(mesh_size: int = 4, rows: int = 24) -> str:
    """``psum(reshape(norm_backward(x @ w), (rows/2, 2*hidden)))`` of a row-parallel dot on a ring of
    ``mesh_size``: an RMS norm's backward written by hand (a per-row operand ``r`` its statistic's
    source), then a reshape that merges pairs of rows."""
    mesh = jax.make_mesh((mesh_size,), ("m",), devices=jax.devices()[:mesh_size])

    def body(x, w, r):
        y = x @ w
        s = jnp.broadcast_to(r[:, None], y.shape) + 1.0
        rs = jax.lax.rsqrt(jnp.mean(s * s, axis=-1, keepdims=True) + 1e-6)
        dx = rs * y - s * rs ** 3 / y.shape[-1] * jnp.sum(y * s, axis=-1, keepdims=True)
        return jax.lax.psum(dx.reshape(rows // 2, 2 * HIDDEN), "m")

    specs = (P(None, "m"), P("m", None), P())
    f = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P(), check_vma=False)
    shapes = [(rows, 64), (64, HIDDEN), (rows,)]
    return jax.jit(f).lower(*[jax.ShapeDtypeStruct(s, jnp.float32, sharding=NamedSharding(mesh, sp))
                              for s, sp in zip(shapes, specs)]).as_text()


def test_chunks_a_step_of_the_path_cannot_cut_are_declined():
    """24 rows on a ring of 4, merged in pairs after the norm backward (12 rows): the dot's rows cut
    into 8 chunks, the reshape's do not, so chunk_dims_ok refuses 8 (and the site is declined
    [chunks], unchanged) while 2 and 4 chunks are applied per chunk with the original's numbers."""
    text = hand_written_psum()
    module = ir_utils.parse(text)
    (site,) = find_dot_all_reduce(module)
    assert isinstance(site, AllReduceSite), site.message
    assert site.dim == 0 and [s.op.operation.name for s in site.path][-1] == "stablehlo.reshape"
    assert site.terms[0].dot.operation.operands[0].type.shape[0] % 8 == 0  # the dot's rows would cut
    assert [k for k in (2, 4, 8) if chunk_dims_ok(site, k)] == [2, 4]
    declined = cmatmul_pass.rewrite(text, cmatmul_pass.Options(all_reduce="chunk", chunks=8))
    (entry,) = declined.report.sites
    assert not entry.rewritten and entry.reason_code == "chunks", entry.summary_line()
    assert declined.text == ir_utils.print_module(ir_utils.parse(text))
    for options in (cmatmul_pass.Options(all_reduce="chunk", chunks=4), cmatmul_pass.Options(variant="bidi")):
        result = cmatmul_pass.rewrite(text, options)
        (entry,) = result.report.sites
        assert entry.rewritten, entry.summary_line()
        outcome = execute.check_numerics(ir_utils.parse(text), result.module)
        assert outcome.ok, outcome.format()


# ---------------------------------------------------------------- bf16, layers
@pytest.mark.parametrize("strategy", ["split", "chunk"])
@pytest.mark.parametrize("gain", sorted(ARGNUMS))
@pytest.mark.parametrize("norm", sorted(NORMS))
def test_bf16(norm, gain, strategy):
    options = cmatmul_pass.Options(all_reduce=strategy, chunks=4 if strategy == "chunk" else None, variant="uni")
    check(grad_text(norm, gain, "bf16"), options, gain_trained=gain == "trained_gain")


@pytest.mark.parametrize("strategy", ["split", "chunk"])
def test_three_megatron_layers(strategy):
    """Three blocks, one shard_map each (a Python loop over layers): every layer's backward psum
    through its norm backward is rewritten (the three identical regions are calls of one)."""
    options = cmatmul_pass.Options(all_reduce=strategy, chunks=2 if strategy == "chunk" else None)
    check(grad_text("rms", "trained_gain", layers=3), options, layers=3)


@pytest.mark.parametrize("strategy", ["split", "chunk"])
def test_the_cli_rewrites_the_norm_backward_psum(tmp_path, strategy):
    """``--all-reduce split|chunk`` (Options.all_reduce) on the command line: the written module
    holds no psum of the norm backward's product and computes what the original does."""
    from conftest import run_cli

    text = grad_text("layer", "trained_gain")
    source, out = tmp_path / "step.mlir", tmp_path / "step.cm.mlir"
    source.write_text(text)
    extra = ["--chunks", "2"] if strategy == "chunk" else []
    assert run_cli("rewrite", source, "--all-reduce", strategy, *extra, "--quiet", "-o", out) == 0
    rewritten = ir_utils.parse(out.read_text())
    assert not norm_backward_sites(rewritten) or strategy == "chunk"
    assert reduces(rewritten, [ROWS, HIDDEN], [0]) == 0  # the gain's sum: by pieces of the rows
    outcome = execute.check_numerics(ir_utils.parse(text), rewritten)
    assert outcome.ok, outcome.format()


# ---------------------------------------------------------------- what stays declined
def row_parallel_psum(prepare) -> str:
    """``psum(prepare(x @ w))`` of a row-parallel dot on the 8 devices."""
    def body(x, w):
        return jax.lax.psum(prepare(x @ w), "model")

    specs = (P(None, "model"), P("model", None))
    f = jax.shard_map(body, mesh=MESH, in_specs=specs, out_specs=P(), check_vma=False)
    return jax.jit(f).lower(*[jax.ShapeDtypeStruct(s, jnp.float32, sharding=NamedSharding(MESH, sp))
                              for s, sp in zip([(ROWS, 64), (64, HIDDEN)], specs)]).as_text()


@pytest.mark.parametrize("prepare, says", [
    # not linear (nor affine) in the product: a function of each device's partial sum
    (lambda y: y * jnp.sum(y, axis=-1, keepdims=True), "linear in the product"),
    # a sum over the rows (every dim the psum could split) spread back over them: no piece gives it
    (lambda y: y - jnp.mean(y, axis=0, keepdims=True) - jnp.mean(y, axis=1, keepdims=True),
     "spreads a value computed from the product along the split dim"),
])
def test_what_no_piece_of_the_rows_gives_stays_a_psum(prepare, says):
    text = row_parallel_psum(prepare)
    for strategy in ("split", "chunk"):
        result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(all_reduce=strategy))
        (entry,) = result.report.sites
        assert not entry.rewritten and entry.reason_code in ("producer_not_dot", "no_dim"), entry.summary_line()
        assert says in entry.reason and "scatter" not in entry.reason, entry.reason
        assert result.text == ir_utils.print_module(ir_utils.parse(text))


@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_the_gains_psum_says_it_sums_rows_whatever_became_of_the_input_gradients(norm):
    """The gain's gradient psum (a psum of a sum over the rows) stays a psum beside the input
    gradient's, and its decline says what it sums, the same words under every strategy and ring
    variant (not the op that happens to read the product first: the split ring's
    stablehlo.while or collective_permute, or the chunks' all_reduce)."""
    text = grad_text(norm, "trained_gain")
    reasons = set()
    for strategy in ("split", "chunk"):
        for variant in ("uni", "bidi", "unroll2", "full"):
            result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(all_reduce=strategy, variant=variant))
            gains = [s for s in result.report.sites if s.kind == "dot_all_reduce" and not s.rewritten
                     and "region arguments" not in s.reason]  # the gain's psum; not the forward's of x
            assert len(gains) == 1, [s.summary_line() for s in result.report.sites]
            (gain,) = gains
            assert gain.reason_code == "producer_not_dot", gain.summary_line()
            reasons.add(gain.reason)
    (reason,) = reasons
    assert reason.startswith("the summed value is a sum over rows, not a matmul's rows: stablehlo.reduce at ")
    assert "sums dim 0 of a value computed from the rows" in reason and "(of 32 elements per device)" in reason
    for variant_word in ("stablehlo.while", "collective_permute", "stablehlo.all_reduce"):
        assert variant_word not in reason


def test_a_psum_of_a_row_sum_that_a_column_split_serves_is_still_rewritten():
    """The other side: a psum of a sum over a product's rows whose columns the ring can split (no
    other reader) is rewritten, and one whose columns do not divide keeps its no_dim reason."""
    def text(n):
        f = jax.shard_map(lambda x, w: jax.lax.psum(jnp.sum(x @ w, axis=0), "model"), mesh=MESH,
                          in_specs=(P(None, "model"), P("model", None)), out_specs=P(), check_vma=False)
        args = [jax.ShapeDtypeStruct(s, jnp.float32, sharding=NamedSharding(MESH, sp))
                for s, sp in [((32, 64), P(None, "model")), ((64, n), P("model", None))]]
        return jax.jit(f).lower(*args).as_text()

    (site,) = cmatmul_pass.rewrite(text(64)).report.sites
    assert site.rewritten, site.summary_line()
    (site,) = cmatmul_pass.rewrite(text(12)).report.sites
    assert site.reason_code == "no_dim", site.summary_line()
