"""Samples of whole layers (tools/gen_samples.py): both collectives around one dot, the
sequence-parallel MLP block (its gradient, repeated layers), norms before a gather's dot and in a
scatter's backward, two-stage and stacked gathers, FSDP x tensor parallel, a language model's
training step."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from tools.golden import SPLIT_ARGS
from tools.samples_common import (
    Sample, Variant, smap, arg, lower, mesh_1d, mesh_2x4, gather, scatter, gone, STREAMS, PERMUTE, pairs_same,
    PAIRS_2X4_MODEL_UP, PAIRS_2X4_MODEL, PAIRS_2X4_DATA,
)


def chain_one_dot() -> str:
    """Both collectives around one matmul: features gathered (contracted), output columns scattered."""
    mesh = mesh_2x4()
    body = lambda x, w: scatter(gather(x, "model", 1) @ w, "model", 1)  # noqa: E731
    f = smap(body, mesh=mesh, in_specs=(P("data", "model"), P()), out_specs=P("data", "model"))
    return lower(f, arg(mesh, (32, 64), P("data", "model")), arg(mesh, (64, 64), P()))


def chain_same_dim() -> str:
    """Rows gathered, and the product scattered on the same rows: the scatter's block of the dot is the
    gathered shard itself.  The gather's ring takes the dot; the scatter is declined."""
    mesh = mesh_2x4()
    body = lambda x, w: scatter(gather(x, "model", 0) @ w, "model", 0)  # noqa: E731
    f = smap(body, mesh=mesh, in_specs=(P("model", None), P()), out_specs=P("model", None))
    return lower(f, arg(mesh, (64, 32), P("model", None)), arg(mesh, (32, 32), P()))


def sp_mlp_body(x, w1, w2):
    """A sequence-parallel MLP block: x [B, S/4, H] gathered over the sequence, column-parallel w1,
    row-parallel w2, the product summed and scattered back over the sequence."""
    h = jax.nn.gelu(jnp.einsum("bsh,hf->bsf", gather(x, "model", 1), w1))
    return scatter(jnp.einsum("bsf,fh->bsh", h, w2), "model", 1)


def sp_mlp_args(mesh):
    return (
        arg(mesh, (4, 32, 16), P("data", "model", None)),
        arg(mesh, (16, 64), P(None, "model")),
        arg(mesh, (64, 16), P("model", None)),
    )


def sp_mlp_fn(mesh):
    specs = (P("data", "model", None), P(None, "model"), P("model", None))
    return jax.shard_map(sp_mlp_body, mesh=mesh, in_specs=specs, out_specs=P("data", "model", None))


def sp_mlp() -> str:
    mesh = mesh_2x4()
    return lower(sp_mlp_fn(mesh), *sp_mlp_args(mesh))


def sp_mlp_grad() -> str:
    """jax.value_and_grad of a loss over the SP MLP: the backward gathers the incoming gradient (the
    transpose of the scatter) for the input-gradient and weight-gradient dots and scatters the input
    gradient (the transpose of the gather); the forward's gathered input is a residual."""
    mesh = mesh_2x4()
    f = sp_mlp_fn(mesh)

    def loss(x, w1, w2):
        return jnp.mean(f(x, w1, w2) ** 2)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(*sp_mlp_args(mesh)).as_text()


def sp_mlp_layers() -> str:
    """Three SP MLP blocks with the same shapes, one after another: the repeated layers of a model."""
    mesh = mesh_2x4()
    f = sp_mlp_fn(mesh)
    x, w1, w2 = sp_mlp_args(mesh)

    def layers(x, *weights):
        for i in range(0, len(weights), 2):
            x = f(x, weights[i], weights[i + 1])
        return x

    return lower(layers, x, w1, w2, w1, w2, w1, w2)


def _sp_rms_block(x, g, w1, w2):
    """A sequence-parallel MLP block whose gathered rows are RMS-normalised (with a gain) first."""
    h = gather(x, "model", 0)
    h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6) * g
    return jax.lax.psum_scatter(jax.nn.gelu(h @ w1) @ w2, "model", scatter_dimension=0, tiled=True)


#: _sp_rms_block's in_specs: rows, a replicated gain, column- and row-parallel weights
SP_RMS_SPECS = (P("model", None), P(), P(None, "model"), P("model", None))


def gqa_attention(q, k, v, axis: str = "model"):
    """Grouped-query attention of local queries ``[B, S/n, H, D]`` over keys and values
    ``[B, S/n, KV, D]`` gathered along the sequence, their heads repeated to the queries'
    (``jnp.repeat``: a broadcast_in_dim and a reshape), scores and softmax in f32."""
    k, v = gather(k, axis, 1), gather(v, axis, 1)
    groups = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / jnp.sqrt(jnp.float32(q.shape[-1]))
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1).astype(v.dtype), v)


def gqa_grad() -> str:
    """value_and_grad of a loss over :func:`gqa_attention` (bf16, 8 query heads over 2 KV heads,
    the sequence split 8 ways): the forward gathers K and V, and the backward scatters their
    gradients (the transposes of the gathers)."""
    mesh = mesh_1d()
    spec = P(None, "model", None, None)
    f = smap(gqa_attention, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec)
    args = [arg(mesh, (2, 64, heads, 16), spec, jnp.bfloat16) for heads in (8, 2, 2)]
    loss = jax.value_and_grad(lambda q, k, v: jnp.mean(f(q, k, v).astype(jnp.float32) ** 2), argnums=(0, 1, 2))
    return lower(loss, *args)


def padded_rows_grad() -> str:
    """value_and_grad of a loss over a row-parallel bf16 layer on a sequence of 60 tokens, padded
    with zero rows to 64 before its psum_scatter over 8 devices (jnp.pad): the backward gathers the
    output's cotangent and crops it back to 60 rows (jnp.pad's transpose: a call of ``@_pad``)
    before dx's and dw's matmuls."""
    mesh = mesh_1d()
    specs = (P(None, "model"), P("model", None))

    def layer(x, w):
        return jax.lax.psum_scatter(jnp.pad(x @ w, ((0, 4), (0, 0))), "model", scatter_dimension=0, tiled=True)

    f = smap(layer, mesh=mesh, in_specs=specs, out_specs=P("model", None))
    loss = jax.value_and_grad(lambda x, w: jnp.mean(jnp.tanh(f(x, w).astype(jnp.float32))), argnums=(0, 1))
    return lower(loss, arg(mesh, (60, 128), specs[0], jnp.bfloat16), arg(mesh, (128, 32), specs[1], jnp.bfloat16))


def feature_norm(h, g, b, kind: str):
    """A ``kind`` norm of ``h`` over its last dim (the features), statistics in f32, the result in
    ``h``'s type: "rms", "layer" (mean and variance, a bias), or "offset" (the sum of squares
    started from 1.0 instead of 0, so not a sum of per-device partial sums)."""
    h32 = h.astype(jnp.float32)
    if kind == "layer":
        mean = jnp.mean(h32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(h32 - mean), axis=-1, keepdims=True)
        return ((h32 - mean) * jax.lax.rsqrt(var + 1e-5) * g + b).astype(h.dtype)
    if kind == "offset":
        total = jax.lax.reduce(h32 * h32, jnp.float32(1.0), jax.lax.add, (h32.ndim - 1,))[..., None]
    else:
        total = jnp.sum(h32 * h32, axis=-1, keepdims=True)
    return (h32 * jax.lax.rsqrt(total / h.shape[-1] + 1e-6) * g).astype(h.dtype)


def feature_norm_before_dot(kind: str) -> Callable[[], str]:
    """Activations sharded along their features (bf16) gathered along them, normalised over them
    (:func:`feature_norm`, a replicated gain and bias), then a projection contracting over them."""
    def build() -> str:
        mesh = mesh_1d()
        specs = (P(None, "model"), P(), P(), P(None, "model"))

        def body(x, g, b, w):
            return feature_norm(gather(x, "model", 1), g, b, kind) @ w

        f = smap(body, mesh=mesh, in_specs=specs, out_specs=P(None, "model"))
        return lower(f, arg(mesh, (32, 64), specs[0], jnp.bfloat16), arg(mesh, (64,), P()), arg(mesh, (64,), P()),
                     arg(mesh, (64, 128), specs[3], jnp.bfloat16))
    return build


def feature_norm_grad(kind: str) -> Callable[[], str]:
    """value_and_grad of :func:`feature_norm_before_dot`'s block, rematerialised (as a scan over
    layers remats it), f32, the gain trained."""
    def build() -> str:
        mesh = mesh_1d()
        specs = (P(None, "model"), P(), P(), P(None, "model"))

        def body(x, g, b, w):
            return feature_norm(gather(x, "model", 1), g, b, kind) @ w

        f = smap(jax.checkpoint(body), mesh=mesh, in_specs=specs, out_specs=P(None, "model"))
        loss = jax.value_and_grad(lambda *a: jnp.mean(f(*a) ** 2), argnums=(0, 1, 3))
        args = [arg(mesh, (32, 64), specs[0]), arg(mesh, (64,), P()), arg(mesh, (64,), P()),
                arg(mesh, (64, 128), specs[3])]
        return jax.jit(loss).lower(*args).as_text()
    return build


def sp_rms_norm_before_dot() -> str:
    """A sequence-parallel MLP block whose gathered rows are RMS-normalised (with a replicated
    gain) before the up projection: the norm runs on the shard's rows, the gather moves to the dot."""
    mesh = mesh_1d()
    specs = SP_RMS_SPECS
    f = smap(_sp_rms_block, mesh=mesh, in_specs=specs, out_specs=P("model", None))
    return lower(f, arg(mesh, (64, 32), specs[0]), arg(mesh, (32,), P()), arg(mesh, (32, 128), specs[2]),
                 arg(mesh, (128, 32), specs[3]))


def sp_rms_norm_grad() -> str:
    """value_and_grad of the RMS-norm-before-dot SP MLP block (``sp_rms_norm_before_dot``'s program,
    its replicated gain trained too): the backward scatters the input gradient after the norm's
    backward applied to the cotangent, ``dx = rs*g*dy - x*rs^3/n * sum_j(g*dy*x)`` per row, which
    reads the product twice; the gain's gradient sums the product times the normed rows over the
    rows, beside the scatter."""
    mesh = mesh_1d()
    specs = SP_RMS_SPECS
    f = smap(_sp_rms_block, mesh=mesh, in_specs=specs, out_specs=P("model", None))

    def loss(x, g, w1, w2):
        return jnp.mean(f(x, g, w1, w2) ** 2)

    args = (arg(mesh, (64, 32), specs[0]), arg(mesh, (32,), P()), arg(mesh, (32, 128), specs[2]),
            arg(mesh, (128, 32), specs[3]))
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3))).lower(*args).as_text()


def scan_stacked(sliced_dim: int = 0) -> Callable[[], str]:
    """Stacked layer weights [L, H, F] sharded on F, gathered before a ``lax.scan`` over layers
    whose body multiplies layer i (``sliced_dim`` 0); with ``sliced_dim`` 2 the body instead takes
    a block of F from every layer (a slice along the gathered dim: not sinkable)."""
    def build() -> str:
        mesh = mesh_1d()

        def body(x, ws):
            stack = gather(ws, "model", 2)

            def step(h, i):
                if sliced_dim == 0:
                    w = jax.lax.dynamic_index_in_dim(stack, i, 0, keepdims=False)
                else:
                    w = jax.lax.dynamic_slice_in_dim(stack, i * 32, 32, 2)[0]
                return jnp.tanh(h @ w), None

            h, _ = jax.lax.scan(step, x, jnp.arange(3))
            return h

        specs = (P(), P(None, None, "model"))
        f = smap(body, mesh=mesh, in_specs=specs, out_specs=P())
        return lower(f, arg(mesh, (16, 32), P()), arg(mesh, (3, 32, 32 if sliced_dim == 0 else 96), specs[1]))
    return build


def two_stage_gather() -> str:
    """A weight sharded over both axes of a 2x4 mesh, gathered over 'data', then over 'model'."""
    mesh = mesh_2x4()

    def body(x, w):
        w = gather(gather(w, "data", 1), "model", 1)
        return x @ w

    f = smap(body, mesh=mesh, in_specs=(P(), P(None, ("model", "data"))), out_specs=P())
    return lower(f, arg(mesh, (16, 32), P()), arg(mesh, (32, 64), P(None, ("model", "data"))))


def fsdp_tp(grad: bool) -> Callable[[], str]:
    """Two dense blocks on a 2x4 (data, model) mesh: weights sharded over 'data' (FSDP: gathered
    where used) and 'model' (tensor parallel), the sequence over 'model' (gathered before the up
    projection, scattered after the down projection); the first block fed straight from the
    arguments; ``grad``: value_and_grad of a mean-square loss."""

    def build() -> str:
        mesh = mesh_2x4()

        def block(x, w1, w2):
            w1f, w2f = gather(w1, "data", 0), gather(w2, "data", 1)
            h = jax.nn.gelu(gather(x, "model", 1) @ w1f)
            return jax.lax.psum_scatter(h @ w2f, "model", scatter_dimension=1, tiled=True)

        specs = (P("data", "model", None), P("data", "model"), P("model", "data"))
        f = jax.shard_map(block, mesh=mesh, in_specs=specs, out_specs=specs[0])

        def model(x, w1a, w2a, w1b, w2b):
            x = x + f(x, w1a, w2a)
            return x + f(x, w1b, w2b)

        fn = jax.value_and_grad(lambda *a: jnp.mean(model(*a) ** 2), argnums=(0, 1, 2, 3, 4)) if grad else model
        shapes = [(4, 32, 16)] + [(16, 64), (64, 16)] * 2
        return lower(fn, *(arg(mesh, s, sp) for s, sp in zip(shapes, specs + specs[1:])))

    return build


def fsdp_tp_hidden(up: bool = True, grad: bool = False, sizes: tuple[int, int, int] = (32, 64, 128)
                   ) -> Callable[[], str]:
    """An MLP block on a 2x4 (data, model) mesh, rows over 'data': the up projection's weight
    FSDP-gathered over 'data' (contracting), the down projection's over 'data' along the hidden dim,
    and its product psum_scatter'ed over 'model' along that same hidden dim.  ``up=False``: the down
    projection reads the block's input directly (no compute before it); ``grad``: value_and_grad of
    a mean-square loss (the backward gathers the cotangent over 'model' for both of the down
    projection's gradient dots, and scatters its weight's gradient over 'data' along the dim that
    gather is along); ``sizes``: (tokens, hidden, ffn)."""

    def build() -> str:
        mesh = mesh_2x4()
        tokens, hidden, ffn = sizes

        def block(x, w_up, w_down):
            h = jax.nn.gelu(x @ gather(w_up, "data", 0)) if up else x
            return jax.lax.psum_scatter(h @ gather(w_down, "data", 1), "model", scatter_dimension=1, tiled=True)

        specs = (P("data", None if up else "model"), P("data", "model"), P("model", "data"))
        f = jax.shard_map(block, mesh=mesh, in_specs=specs, out_specs=P("data", "model"))
        fn = jax.value_and_grad(lambda *a: jnp.mean(f(*a) ** 2), argnums=(0, 1, 2)) if grad else f
        return lower(fn, arg(mesh, (tokens, hidden if up else ffn), specs[0]), arg(mesh, (hidden, ffn), specs[1]),
                     arg(mesh, (ffn, hidden), specs[2]))

    return build


def moe_fsdp_grad() -> str:
    """A training step (value_and_grad of a mean-square loss over the expert weights) of an MoE
    block with FSDP'd experts, exported for GPU (``jax.export``: each ``ragged_dot`` a composite):
    top-1 routing, the tokens sorted by expert, a SwiGLU expert FFN of grouped matmuls over the
    expert weights gathered over 'data' (gate and up along their columns, down along its rows),
    the tokens un-sorted."""
    mesh = mesh_1d(name="data")
    experts, hidden, ffn, tokens = 4, 64, 128, 256

    def block(x, router, w_gate, w_up, w_down):
        ids = jnp.argmax(x @ router, axis=-1)
        order = jnp.argsort(ids)
        sizes = jnp.bincount(ids, length=experts).astype(jnp.int32)
        xs = x[order]
        gate = jax.lax.ragged_dot(xs, gather(w_gate, "data", 2), sizes)
        h = jax.nn.silu(gate) * jax.lax.ragged_dot(xs, gather(w_up, "data", 2), sizes)
        return jax.lax.ragged_dot(h, gather(w_down, "data", 1), sizes)[jnp.argsort(order)]

    specs = (P("data"), P(), P(None, None, "data"), P(None, None, "data"), P(None, "data", None))
    f = jax.shard_map(block, mesh=mesh, in_specs=specs, out_specs=P("data"))
    step = jax.value_and_grad(lambda *a: jnp.mean(f(*a) ** 2), argnums=(2, 3, 4))
    shapes = [(tokens, hidden), (hidden, experts), (experts, hidden, ffn), (experts, hidden, ffn),
              (experts, ffn, hidden)]
    args = [arg(mesh, shape, spec) for shape, spec in zip(shapes, specs)]
    return jax.export.export(jax.jit(step), platforms=["cuda"])(*args).mlir_module()


def moe_expert_parallel(grad: bool = False, mixing: bool = False) -> Callable[[], str]:
    """An expert-parallel MoE block on 8 devices over 'expert' (16 experts, 2 per device): top-1
    routing into 16 capacity slots (one-hot dispatch and combine einsums), the slots exchanged
    (``all_to_all``: split along the experts, concatenated along the capacity), a GELU FFN per
    local expert (batched einsums), exchanged back. ``grad``: value_and_grad over the tokens and
    the expert weights; ``mixing``: the hidden activations centred over every local expert's
    slots at once between the exchanges (a reduce over the experts and the capacity)."""
    def build() -> str:
        mesh = mesh_1d(name="expert")
        experts, capacity, hidden, ffn, tokens = 16, 16, 32, 64, 256

        def block(x, router, w1, w2):
            ids = jnp.argmax(x @ router, -1)
            onehot = jax.nn.one_hot(ids, experts, dtype=x.dtype)
            slot = ((jnp.cumsum(onehot, 0) - 1) * onehot).sum(-1).astype(jnp.int32)
            disp = onehot[:, :, None] * jax.nn.one_hot(slot, capacity, dtype=x.dtype)[:, None, :]
            y = jax.lax.all_to_all(jnp.einsum("tec,th->ech", disp, x), "expert", 0, 1, tiled=True)
            h = jnp.einsum("ech,ehf->ecf", y, w1)
            h = h - jnp.mean(h, axis=(0, 1), keepdims=True) if mixing else jax.nn.gelu(h)
            back = jax.lax.all_to_all(jnp.einsum("ecf,efh->ech", h, w2), "expert", 1, 0, tiled=True)
            return jnp.einsum("tec,ech->th", disp, back)

        specs = (P("expert"), P(), P("expert"), P("expert"))
        f = jax.shard_map(block, mesh=mesh, in_specs=specs, out_specs=P("expert"))
        fn = jax.value_and_grad(lambda *a: jnp.mean(f(*a) ** 2), argnums=(0, 2, 3)) if grad else f
        shapes = [(tokens, hidden), (hidden, experts), (experts, hidden, ffn), (experts, ffn, hidden)]
        return lower(fn, *(arg(mesh, shape, spec) for shape, spec in zip(shapes, specs)))

    return build


def lm_fsdp_tp_scan() -> str:
    """A training step (value_and_grad of the mean cross-entropy loss) of a 2-layer language model on a
    2x4 (data, model) mesh, written as a JAX user would: every weight FSDP-sharded over 'data' and
    gathered where it is used; the token embedding gathered and looked up; the stacked per-layer
    weights [L, ...] (RMS gains replicated, w1 [L, H, F] and w2 [L, F, H] also tensor-parallel over
    'model') gathered over 'data' before a ``lax.scan`` over the layers, whose body is under
    ``jax.checkpoint``; each layer a pre-RMS-norm sequence-parallel MLP (the normed rows gathered over
    'model' before the column-parallel matmul, the row-parallel product psum_scatter'ed); then a final
    RMS norm, the output projection and the mean cross-entropy, pmean'd over the mesh."""
    mesh = mesh_2x4()
    layers, vocab, hidden, ffn, batch, seq = 2, 64, 32, 64, 2, 64  # 16 tokens per device

    def rms(x, g):
        return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * g

    def step(params, ids, labels):
        embed, gains, w1s, w2s, gain_f, w_out = params
        h = gather(embed, "data", 0)[ids]  # [b, s, H]: this device's tokens
        w1f, w2f = gather(w1s, "data", 1), gather(w2s, "data", 2)  # [L, H, F/4], [L, F/4, H]

        @jax.checkpoint
        def layer(h, ws):
            g, w1, w2 = ws
            x = gather(rms(h, g), "model", 1)  # [b, 4s, H]: the rows of the 'model' group
            y = jax.nn.gelu(x @ w1) @ w2  # partial sums over 'model'
            return h + jax.lax.psum_scatter(y, "model", scatter_dimension=1, tiled=True), None

        h, _ = jax.lax.scan(layer, h, (gains, w1f, w2f))
        logp = jax.nn.log_softmax(rms(h, gain_f) @ gather(w_out, "data", 0))
        nll = -jnp.sum(jax.nn.one_hot(labels, vocab) * logp, axis=-1)
        return jax.lax.pmean(jnp.mean(nll), ("data", "model"))

    specs = (P("data", None), P(), P(None, "data", "model"), P(None, "model", "data"), P(), P("data", None))
    tokens = P("data", "model")
    f = jax.shard_map(step, mesh=mesh, in_specs=(specs, tokens, tokens), out_specs=P())
    shapes = [(vocab, hidden), (layers, hidden), (layers, hidden, ffn), (layers, ffn, hidden), (hidden,),
              (hidden, vocab)]
    params = tuple(arg(mesh, shape, spec) for shape, spec in zip(shapes, specs))
    ids = arg(mesh, (batch, seq), tokens, jnp.int32)
    return lower(jax.value_and_grad(f), params, ids, ids)
#: every gather and scatter a ring; the two data-parallel psums split, their gathers just before the return
SP_MLP_GRAD_CHECKS = gone("reduce_scatter", "all_reduce") + [
    "CHECK-NOT: stablehlo.all_gather", "CHECK: sdy.return",
    'CHECK: "stablehlo.all_gather"', 'CHECK-NEXT: "stablehlo.all_gather"', "CHECK-NEXT: sdy.return"]


#: the samples of this family (tools/gen_samples.py writes them in this order)
SAMPLES_LIST = [
    # ---- chains and a whole layer
    Sample("chain_one_dot", "all_gather -> dot -> reduce_scatter around one matmul: both rings.",
           chain_one_dot, "rewritten 2", gone("all_gather", "reduce_scatter"),
           # with outlined dots, the gather ring still finds the scatter ring's peeled dot
           [Variant("STREAMS", ["--annotate-streams", "--variant", "uni"],
                    gone("all_gather", "reduce_scatter") + ["CHECK: func.call @cmatmul_dot_0",
                                                            "CHECK: func.func private @cmatmul_dot_0"])]),
    Sample("chain_same_dim", "rows gathered and the product scattered on the same rows: the scatter is declined "
           "(gathered_operand), the gather's ring takes the dot.",
           chain_same_dim, "rewritten 1", ["CHECK: stablehlo.while", "CHECK: stablehlo.reduce_scatter"]),
    Sample("sp_mlp", "sequence-parallel MLP block: all_gather -> dot -> gelu -> dot -> reduce_scatter.",
           sp_mlp, "rewritten 2", gone("all_gather", "reduce_scatter"),
           # --variant auto on the h100 profile: at these tiny shapes per-round and per-trip costs
           # decide; the gather gets bidi (a ring of 4 both ways needs no loop), the scatter
           # bidi-full (half-blocks both ways, concatenated): one module, two variants
           [Variant("AUTO", ["--variant", "auto"],
                    ["CHECK-NOT: stablehlo.while",
                     PERMUTE, pairs_same(PAIRS_2X4_MODEL),
                     'CHECK-NEXT: "stablehlo.collective_permute"', pairs_same(PAIRS_2X4_MODEL_UP),
                     PERMUTE, pairs_same(PAIRS_2X4_MODEL),
                     "CHECK: stablehlo.tanh",
                     *[line for _ in range(3) for line in (PERMUTE, pairs_same(PAIRS_2X4_MODEL),
                                                           PERMUTE, pairs_same(PAIRS_2X4_MODEL_UP))],
                     "CHECK: stablehlo.concatenate",
                     "CHECK-NOT: stablehlo.while"] + gone("all_gather", "reduce_scatter"))]),
    Sample("sp_mlp_grad", "value_and_grad of the SP MLP: forward and backward gathers and scatters, all rewritten; "
           "the weight gradients' psums over 'data' split (a scatter ring each, gathered at the return).",
           sp_mlp_grad, "rewritten 6", SP_MLP_GRAD_CHECKS, main_args=SPLIT_ARGS),
    # jax >= 0.11 names a collective's groups by mesh axes (#stablehlo.replica_group_mesh_axes)
    Sample("sp_mlp_grad_jax011", "value_and_grad of the SP MLP as jax 0.11 lowers it: every collective's groups "
           "name the mesh axis 'model' instead of listing devices.",
           sp_mlp_grad, "rewritten 6", SP_MLP_GRAD_CHECKS, jax="0.11", main_args=SPLIT_ARGS),
    Sample("sp_mlp_layers", "three SP MLP blocks of one shape: identical regions, so the first is rewritten (with "
           "CMATMUL_PASS_CHECK_REPLAY=1 the last too, checked against it), and all three become calls of one "
           "rewritten block (@cmatmul_layer_0, as a "
           "nested jax.jit lowers), which holds the block's two rings inline (a ring function there would be "
           "called once); without ring sharing there is no layer function, and each block keeps its own rings "
           "inline.",
           sp_mlp_layers, "rewritten 6",
           gone("all_gather", "reduce_scatter")
           + ["CHECK: call @cmatmul_layer_0(", "CHECK: call @cmatmul_layer_0(", "CHECK: call @cmatmul_layer_0(",
              "CHECK-NOT: @cmatmul_ring_", "CHECK: func.func private @cmatmul_layer_0(",
              "CHECK: sdy.manual_computation", "CHECK: stablehlo.while", "CHECK: stablehlo.collective_permute",
              "CHECK: stablehlo.while", "CHECK: stablehlo.collective_permute", "CHECK-NOT: @cmatmul_ring_"],
           [Variant("OWN", ["--no-share-rings", "--variant", "uni"], ["CHECK-NOT: call @cmatmul_ring"]),
            Variant("STREAMS", STREAMS, ["CHECK-NOT: call @cmatmul_ring"])]),
    Sample("ag_norm_dot", "gather, RMS norm of the gathered rows (a replicated gain), then the dot: the norm runs on "
           "the shard's rows and the gather moves to the dot, whose ring it becomes.",
           sp_rms_norm_before_dot, "rewritten 2",
           ["CHECK: stablehlo.rsqrt", "CHECK-SAME: tensor<8x1xf32>", "CHECK: stablehlo.while",
            "CHECK-NOT: stablehlo.all_gather", "CHECK-NOT: stablehlo.reduce_scatter"]),
    Sample("ag_gqa_grad", "value_and_grad of grouped-query attention over K and V gathered along the sequence, "
           "their 2 heads repeated to the 8 query heads (a broadcast_in_dim and a reshape) before the score and "
           "output einsums: the repeat runs on each block the rings receive (V's ring contracting over the "
           "sequence), each gather's repeated value assembled for the backward, and the backward's K and V "
           "gradients scattered by rings.",
           gqa_grad, "rewritten 4",
           ["CHECK: stablehlo.while", "CHECK: stablehlo.broadcast_in_dim", "CHECK-SAME: tensor<2x8x2x4x16xbf16>",
            "CHECK-NOT: stablehlo.all_gather", "CHECK-NOT: stablehlo.reduce_scatter"]),
    Sample("rs_ag_padded_grad", "value_and_grad of a row-parallel bf16 layer on 60 tokens padded to 64 before its "
           "psum_scatter: the forward's zero padding moves onto the lhs (its rows masked back to zero in each block) "
           "and the scatter rings; the backward's crop of the gathered cotangent (jnp.pad's transpose) moves past dx's "
           "and dw's matmuls (dx's product cropped, dw's other operand padded with zeros, each shard's cropped rows "
           "zeroed before the gather) and the gather rings over both dots.",
           padded_rows_grad, "rewritten 2",
           ["CHECK: stablehlo.pad {{.*}} high = [4, 0]", "CHECK-SAME: (tensor<60x16xbf16>, tensor<bf16>) -> tensor<64x16xbf16>",
            "CHECK: stablehlo.select", "CHECK: stablehlo.while", "CHECK: stablehlo.partition_id",
            "CHECK: stablehlo.select", "CHECK-SAME: tensor<8x32xi1>, tensor<8x32xbf16>",
            "CHECK: stablehlo.pad {{.*}} high = [4, 0]", "CHECK-SAME: (tensor<60x16xbf16>, tensor<bf16>) -> tensor<64x16xbf16>",
            "CHECK: stablehlo.while", "CHECK: stablehlo.slice {{.*}} [0:60, 0:16]",
            "CHECK-NOT: stablehlo.all_gather", "CHECK-NOT: stablehlo.reduce_scatter", "CHECK-NOT: func.func private @_pad"]),
    Sample("ag_rms_features_dot", "activations sharded along their features, gathered along them and RMS-normalised "
           "over them (f32 statistics of bf16 values, a replicated gain), then a projection contracting over them: "
           "each device sums its own features' squares, one all_reduce adds the partial sums (32 floats), the shard "
           "is normalised, and the gather becomes the dot's contracting-dim ring.",
           feature_norm_before_dot("rms"), "rewritten 1",
           ["CHECK: stablehlo.reduce", 'CHECK: "stablehlo.all_reduce"', "CHECK: }) : (tensor<32xf32>) -> tensor<32xf32>",
            "CHECK: stablehlo.rsqrt", "CHECK: stablehlo.while", "CHECK-NOT: stablehlo.all_gather"]),
    Sample("ag_layernorm_features_dot", "as ag_rms_features_dot with a layer norm (a gain and a bias): the mean's "
           "and then the variance's partial sums each added by an all_reduce.",
           feature_norm_before_dot("layer"), "rewritten 1",
           ['CHECK: "stablehlo.all_reduce"', "CHECK: }) : (tensor<32xf32>) -> tensor<32xf32>",
            'CHECK: "stablehlo.all_reduce"', "CHECK: }) : (tensor<32xf32>) -> tensor<32xf32>",
            "CHECK: stablehlo.while", "CHECK-NOT: stablehlo.all_gather"]),
    Sample("rs_norm_features_grad", "value_and_grad of ag_rms_features_dot's block in f32, rematerialised, its "
           "gain trained: the forward's gather moves past the norm and rings; the backward's input gradient, "
           "scattered along the features after the norm's backward (which spreads a sum over the features back "
           "over them), rings with the spread term taken out: its sum over the features is added up block by "
           "block, all_reduced after the ring (32 floats) and its term added to the device's own block. The "
           "backward's gather of the recomputed rows, which the norm's backward reads whole, rings with the norm "
           "applied to each block it receives (the statistic summed from the shards first) and assembles them.",
           feature_norm_grad("rms"), "rewritten 3",
           ['CHECK: "stablehlo.all_reduce"', "CHECK: }) : (tensor<32xf32>) -> tensor<32xf32>",
            "CHECK: stablehlo.while", "CHECK: stablehlo.while",
            'CHECK: "stablehlo.all_reduce"', "CHECK: }) : (tensor<32xf32>) -> tensor<32xf32>",
            "CHECK: stablehlo.dynamic_slice", "CHECK-SAME: sizes = [32, 8]",
            "CHECK-NOT: stablehlo.reduce_scatter"]),
    Sample("rs_norm_backward", "value_and_grad of the RMS-norm-before-dot SP MLP, its gain trained: the input "
           "gradient's scatter follows the norm's backward of the cotangent (the product read twice: scaled per "
           "row, and summed over the row then scaled); the ring applies it to each 8-row block it computes, its "
           "sums over the hidden dim and the per-row factors taken at the block's rows, and carries the gain "
           "gradient's sum over the rows, adding each block's share. The forward's gather, whose gathered rows "
           "are also the backward's residual, rings with its dot through the RMS norm: the ring normalises each "
           "block it receives before its dot and assembles the raw rows for the residual. (The gain gradient's "
           "psum stays: it sums a sum over the rows, not a product.)",
           sp_rms_norm_grad, "rewritten 4",
           ["CHECK-NOT: stablehlo.reduce_scatter", "CHECK-NOT: stablehlo.all_gather",
            # the forward's gather ring: the shard, the product's blocks and the raw rows assembled
            "CHECK: stablehlo.while{{.*}} : tensor<ui32>, tensor<8x32xf32>, tensor<64x16xf32>, tensor<64x32xf32>",
            "CHECK: } do {", 'CHECK: "stablehlo.collective_permute"',
            # the norm's sum over the hidden dim, of the block's 8 rows, before the block's dot
            "CHECK: stablehlo.reduce({{.*}}) applies stablehlo.add across dimensions = [1] : "
            "(tensor<8x32xf32>, tensor<f32>) -> tensor<8xf32>",
            "CHECK: stablehlo.dot_general {{.*}} -> tensor<8x16xf32>",
            # the loop carries the partial sum and the gain gradient's total
            "CHECK: stablehlo.while{{.*}} : tensor<ui32>, tensor<8x32xf32>, tensor<32xf32>", "CHECK: } do {",
            'CHECK: "stablehlo.collective_permute"', "CHECK: stablehlo.dot_general {{.*}} -> tensor<8x32xf32>",
            "CHECK: stablehlo.dynamic_slice {{.*}} sizes = [8, 32]",
            "CHECK: stablehlo.reduce({{.*}}) applies stablehlo.add across dimensions = [0] : "
            "(tensor<8x32xf32>, tensor<f32>) -> tensor<32xf32>",
            "CHECK: stablehlo.reduce({{.*}}) applies stablehlo.add across dimensions = [1] : "
            "(tensor<8x32xf32>, tensor<f32>) -> tensor<8xf32>",
            "CHECK: stablehlo.broadcast_in_dim {{.*}} : (tensor<8xf32>) -> tensor<8x32xf32>",
            "CHECK: stablehlo.return", "CHECK-NOT: stablehlo.reduce_scatter", "CHECK-NOT: stablehlo.all_gather"], main_args=SPLIT_ARGS),
    Sample("ag_two_stage", "a weight sharded over two mesh axes, gathered in two stages along one dim: the stages "
           "merge into one gather over both axes' groups, which becomes one ring over the 8 devices.",
           two_stage_gather, "rewritten 1",
           ["CHECK-NOT: stablehlo.all_gather", "CHECK: stablehlo.collective_permute",
            "CHECK-SAME: source_target_pairs = dense<{{.*}}> : tensor<8x2xi64>", "CHECK-NOT: stablehlo.all_gather"]),
    Sample("ag_scan_stacked", "stacked layer weights gathered before a scan over layers: the gather sinks into the "
           "loop, each trip gathering the one layer it reads, and becomes a ring with the body's dot.",
           scan_stacked(0), "rewritten 1",
           ["CHECK-NOT: stablehlo.all_gather", "CHECK: stablehlo.while", "CHECK-SAME: tensor<3x32x4xf32>",
            "CHECK: stablehlo.dynamic_slice {{.*}} sizes = [1, 32, 4]", "CHECK: stablehlo.collective_permute",
            "CHECK-NOT: func.call"]),
    Sample("neg_scan_gathered_dim", "stacked weights gathered before a scan whose body slices along the gathered dim: "
           "a slice of the gathered value is not the gather of a slice; left, and explain says why it was not sunk.",
           scan_stacked(2), "unchanged user_not_dot",
           ['CHECK: "stablehlo.all_gather"', "CHECK: stablehlo.while", "CHECK-NOT: stablehlo.collective_permute"]),
    Sample("fsdp_tp", "FSDP x tensor parallel, two blocks on a 2x4 mesh: where a weight's gather over 'data' and "
           "the activation's over 'model' meet at one dot, the one with less slack gets the ring: the second block's "
           "weight gather is prefetchable behind the first block; in the first block, both read straight from the "
           "arguments, neither has more slack and the program's order stands (the activation's is lost_to_ring).",
           fsdp_tp(False), "rewritten 6",
           ["CHECK-COUNT-2: stablehlo.all_gather", "CHECK-NOT: stablehlo.reduce_scatter"]),
    Sample("fsdp_tp_hidden", "an MLP block on a 2x4 mesh whose down projection's product is psum_scatter'ed over "
           "'model' along the hidden dim, the dim its weight is FSDP-gathered along over 'data': the two rings would "
           "nest, so one collective is left plain; the weight's gather has the up projection to hide behind "
           "(analysis.slack), so it stays a plain all_gather, prefetchable, and the scatter, which can start only "
           "after the dot, has the ring (the up projection's weight gather rings as ever).",
           fsdp_tp_hidden(), "rewritten 2",
           ["CHECK-NOT: all_gather_dim = 0", 'CHECK: "stablehlo.all_gather"', "CHECK-SAME: all_gather_dim = 1",
            "CHECK: stablehlo.while", "CHECK-NOT: stablehlo.reduce_scatter"]),
    Sample("fsdp_tp_hidden_no_slack", "fsdp_tp_hidden without the up projection: no compute precedes the down "
           "projection to send its weight's gather behind, so the weight's gather keeps the ring and the scatter "
           "along the same dim stays (gathered_operand).",
           fsdp_tp_hidden(up=False), "rewritten 1",
           ['CHECK: "stablehlo.reduce_scatter"', "CHECK-NOT: stablehlo.all_gather"]),
    Sample("fsdp_tp_hidden_grad", "value_and_grad of fsdp_tp_hidden at 2048 tokens: the backward gathers the "
           "cotangent over 'model' for the down projection's two gradient dots (dx and dW), and scatters dW over "
           "'data' along the dim that gather is along; the gather has nothing before its dots to hide behind, so "
           "its ring computes dx and assembles the gathered value, and the scatter's ring computes dW from it "
           "(ring_pairs: the two rings predicted faster than the gather's ring over both dots and the scatter plain).",
           fsdp_tp_hidden(grad=True, sizes=(2048, 1024, 4096)), "rewritten 6",
           ["CHECK-NOT: stablehlo.reduce_scatter", "CHECK: stablehlo.collective_permute"]),
    Sample("moe_fsdp_grad", "a training step of an MoE block with FSDP'd expert weights, exported for GPU (each "
           "ragged_dot a stablehlo.composite): the three expert weights' gathers ring with their grouped matmuls (gate "
           "and up along their columns, down along its rows), and the three weight gradients (grouped matmuls "
           "contracting each expert's tokens) scatter in rings along their columns; each ring step a grouped matmul "
           "of blocks whose decomposition pads them and calls the original's.",
           moe_fsdp_grad, "rewritten 6",
           ["CHECK-NOT: stablehlo.all_gather", "CHECK-NOT: stablehlo.reduce_scatter",
            'CHECK: stablehlo.composite "chlo.ragged_dot"', "CHECK: stablehlo.collective_permute"]),
    Sample("moe_ep_a2a_grad", "a training step of an expert-parallel MoE block (capacity-padded): the dispatch "
           "all_to_all, the local experts' GELU FFN and the combine all_to_all are cut into chunks along the capacity "
           "(the dispatch's concat dim, the combine's split dim), each chunk's exchanges beside another chunk's "
           "matmuls; the values the backward reads are reassembled after the pair; the backward's pair (the "
           "cotangent exchanged back and forth) is chunked too, its weight gradients (contracting the capacity) "
           "summed over the chunks.",
           moe_expert_parallel(grad=True), "rewritten 2",
           ['CHECK: "stablehlo.all_to_all"', "CHECK: stablehlo.concatenate"]),
    Sample("fsdp_tp_grad", "value_and_grad of fsdp_tp: every collective over 'model' rewritten, forward and "
           "backward; the weight gathers over 'data' the activations' rings took are prefetchable or lost.",
           fsdp_tp(True), "rewritten 14",
           ["CHECK-NOT: stablehlo.reduce_scatter", "CHECK: stablehlo.while"]),
    Sample("lm_fsdp_tp_scan", "value_and_grad of a 2-layer LM on a 2x4 (data, model) mesh: embedding and output "
           "projection FSDP over 'data', stacked layer weights gathered over 'data' before a lax.scan with "
           "jax.checkpoint, pre-RMS-norm sequence-parallel MLP layers. jax 0.10 puts the scan's step in "
           "@closed_call, holding the layer's collectives: the pass inlines it into the loops (as jax 0.11 "
           "lowers it). Rings: every row gather and psum_scatter over 'model' in both loops (forward, remat's "
           "recompute and backward), the output projection's gather over 'data', its gradient's psum_scatter over "
           "'data' moved before the psum over 'model' (the two commute: the psum then sums half the bytes), "
           "the stacked gradients' scatters moved into the backward's loop (one layer per trip). "
           "The second weight's stacked gather sinks into both loops (one layer per trip): in the forward's, "
           "its layer rings with its dot (its reshape follows the ring); in the backward's it meets the rows' "
           "rings and stays plain under --variant uni (the rows' gathers, computed in the trip, have the rings; "
           "auto's straight-line rings let them ring the rounds' dots). The first weight's layers would meet the "
           "rows' rings at their dots in both loops, so its stack is not sunk (a motion with no ring where it "
           "goes is not made) and is gathered whole before the forward's loop. Left: "
           "the embedding's gather (read by a gather, not a dot) and its gradient's psum and scatter, the "
           "norm gains' and the loss's psums.",
           lm_fsdp_tp_scan, "rewritten 10",
           ["CHECK: sdy.manual_computation",
            # the embedding's gather stays: a gather (the lookup) reads it, not a dot
            'CHECK: "stablehlo.all_gather"', "CHECK-SAME: (tensor<32x32xf32>) -> tensor<64x32xf32>",
            'CHECK: "stablehlo.gather"',
            # the first weight's stack, gathered whole: its layers' gathers would ring nowhere
            'CHECK: "stablehlo.all_gather"', "CHECK-SAME: all_gather_dim = 1",
            "CHECK-SAME: (tensor<2x16x16xf32>) -> tensor<2x32x16xf32>",
            # the forward's loop, the step inlined: it gathers only its layer of the second weight
            "CHECK: stablehlo.while", "CHECK: } do {",
            # the layer's row gather over 'model' is a ring in the loop's body; the second weight's layer
            # gather over 'data' a ring of 2 with its dot (the reshape the backward's trip reads follows it)
            "CHECK: stablehlo.while", PERMUTE, pairs_same(PAIRS_2X4_MODEL),
            'CHECK-NOT: "stablehlo.all_gather"', PERMUTE, pairs_same(PAIRS_2X4_DATA),
            # and the row scatter over 'model'
            "CHECK: stablehlo.while", PERMUTE, pairs_same(PAIRS_2X4_MODEL),
            # the output projection's gather over 'data': a ring of 2
            PERMUTE, pairs_same(PAIRS_2X4_DATA), 'CHECK: "stablehlo.all_reduce"', "CHECK: sdy.return",
            # the backward: the output projection gradient's psum_scatter over 'data' moved before its psum
            # over 'model', onto the dot: a ring of 2, then the psum of the scattered half (16 of 32 rows)
            "CHECK: sdy.manual_computation", "CHECK-NOT: stablehlo.while", PERMUTE, pairs_same(PAIRS_2X4_DATA),
            'CHECK: "stablehlo.all_reduce"', "CHECK-SAME: replica_groups = dense<{{\\[\\[}}0, 1, 2, 3], [4, 5, 6, 7]]>",
            "CHECK: }) : (tensor<16x64xf32>) -> tensor<16x64xf32>",
            # the backward's loop gathers its layer of the second weight too; its three row rings over
            # 'model', the gain gradient's psum, then each layer's weight gradients scattered over 'data'
            # by rings of 2
            "CHECK: stablehlo.while", "CHECK: } do {",
            'CHECK: "stablehlo.all_gather"', "CHECK-SAME: (tensor<1x16x16xf32>) -> tensor<1x16x32xf32>",
            "CHECK: stablehlo.while", PERMUTE, "CHECK: stablehlo.while", PERMUTE, "CHECK: stablehlo.while", PERMUTE,
            'CHECK: "stablehlo.all_reduce"', "CHECK-NOT: stablehlo.reduce_scatter",
            PERMUTE, pairs_same(PAIRS_2X4_DATA), PERMUTE, pairs_same(PAIRS_2X4_DATA),
            "CHECK: stablehlo.dynamic_update_slice", "CHECK: stablehlo.return",
            # the embedding's gradient: a scatter-add, psum'd over 'model' and scattered over 'data'
            'CHECK: "stablehlo.scatter"', 'CHECK: "stablehlo.all_reduce"', 'CHECK: "stablehlo.reduce_scatter"',
            "CHECK: sdy.return", "CHECK-NOT: func.func private @closed_call"], main_args=SPLIT_ARGS),

]
