"""Samples of a psum after a matmul (Megatron without sequence parallelism; tools/gen_samples.py):
the MLP block, its gradient, residual stacks through norms, bf16, a 2x4 mesh, row mixing, and the
psums left as written."""

from __future__ import annotations


import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from tools.golden import SPLIT_ARGS, escape
from tools.samples_common import (
    Sample, Variant, smap, arg, lower, mesh_1d, mesh_2x4, loop_checks, PAIRS_2X4_MODEL, PAIRS_1D_8,
)


# ---------------------------------------------------------------- psum after a matmul (Megatron)
def layer_norm(x):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5)


def rms_norm(x):
    return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6)


def megatron_mlp_body(x, w1, w2):
    """Megatron's MLP without sequence parallelism: column-parallel w1, row-parallel w2, psum."""
    return jax.lax.psum(jax.nn.gelu(x @ w1) @ w2, "model")


MEGATRON_SPECS = (P(), P(None, "model"), P("model", None))


def megatron_args(mesh, tokens=64, hidden=32, ffn=128, dtype=jnp.float32, layers=1):
    weights = [arg(mesh, (hidden, ffn), P(None, "model"), dtype), arg(mesh, (ffn, hidden), P("model", None), dtype)]
    return (arg(mesh, (tokens, hidden), P(), dtype), *weights * layers)


def megatron_mlp() -> str:
    mesh = mesh_1d()
    f = smap(megatron_mlp_body, mesh=mesh, in_specs=MEGATRON_SPECS, out_specs=P())
    return lower(f, *megatron_args(mesh))


def megatron_mlp_grad() -> str:
    """value_and_grad of the Megatron MLP with check_vma on (the default): the forward's psum and the
    backward's psum of the input gradient (the transpose of the replicated input's use)."""
    mesh = mesh_1d()
    f = jax.shard_map(megatron_mlp_body, mesh=mesh, in_specs=MEGATRON_SPECS, out_specs=P())

    def loss(x, w1, w2):
        return jnp.mean(f(x, w1, w2) ** 2)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(*megatron_args(mesh)).as_text()


def megatron_mlp_grad_unchecked() -> str:
    """value_and_grad of the Megatron MLP with check_vma off (``smap``): psum's transpose is a psum,
    so the backward sums the incoming cotangent over 'model' before its two matmuls read it."""
    mesh = mesh_1d()
    f = smap(megatron_mlp_body, mesh=mesh, in_specs=MEGATRON_SPECS, out_specs=P())

    def loss(x, w1, w2):
        return jnp.mean(f(x, w1, w2) ** 2)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(*megatron_args(mesh)).as_text()


def residual_stack(norm, blocks=2):
    def body(x, *weights):
        for i in range(0, len(weights), 2):
            x = x + megatron_mlp_body(norm(x), weights[i], weights[i + 1])
        return x

    return body


def megatron_ln_stack() -> str:
    """Two pre-LN residual Megatron MLP blocks: the first psum's rows are carried through the
    residual add and the second block's layer norm into its column-parallel matmul's ring."""
    mesh = mesh_1d()
    f = smap(residual_stack(layer_norm), mesh=mesh, in_specs=(P(),) + MEGATRON_SPECS[1:] * 2, out_specs=P())
    return lower(f, *megatron_args(mesh, layers=2))


def megatron_rms_stack() -> str:
    mesh = mesh_1d()
    f = smap(residual_stack(rms_norm), mesh=mesh, in_specs=(P(),) + MEGATRON_SPECS[1:] * 2, out_specs=P())
    return lower(f, *megatron_args(mesh, layers=2))


def megatron_bf16() -> str:
    """bf16 weights and activations, the row-parallel product accumulated and summed in f32."""
    mesh = mesh_1d()

    def body(x, w1, w2):
        h = jax.nn.gelu(jnp.dot(x, w1, preferred_element_type=jnp.float32)).astype(jnp.bfloat16)
        return jax.lax.psum(jnp.dot(h, w2, preferred_element_type=jnp.float32), "model")

    f = smap(body, mesh=mesh, in_specs=MEGATRON_SPECS, out_specs=P())
    return lower(f, *megatron_args(mesh, dtype=jnp.bfloat16))


def megatron_mesh2x4() -> str:
    """A data x model mesh: the batch split over 'data', the psum over 'model' only."""
    mesh = mesh_2x4()
    specs = (P("data", None, None), P(None, "model"), P("model", None))

    def body(x, w1, w2):
        return x + megatron_mlp_body(layer_norm(x), w1, w2)

    f = smap(body, mesh=mesh, in_specs=specs, out_specs=P("data", None, None))
    return lower(f, arg(mesh, (4, 16, 32), specs[0]), arg(mesh, (32, 64), specs[1]), arg(mesh, (64, 32), specs[2]))


def megatron_not_divisible() -> str:
    """12 tokens and 12 features on a ring of 8: no dim of the psum's product splits evenly."""
    mesh = mesh_1d()
    f = smap(megatron_mlp_body, mesh=mesh, in_specs=MEGATRON_SPECS, out_specs=P())
    return lower(f, *megatron_args(mesh, tokens=12, hidden=12))


def megatron_chunked_by_hand() -> str:
    """The Megatron MLP with its psum already in two row chunks, concatenated (as the chunk
    strategy writes it): each chunk's all_reduce is left as it is."""
    mesh = mesh_1d()

    def body(x, w1, w2):
        h = jax.nn.gelu(x @ w1)
        half = h.shape[0] // 2
        return jnp.concatenate([jax.lax.psum(h[:half] @ w2, "model"), jax.lax.psum(h[half:] @ w2, "model")])

    f = smap(body, mesh=mesh, in_specs=MEGATRON_SPECS, out_specs=P())
    return lower(f, *megatron_args(mesh))


def megatron_row_mixing() -> str:
    """After the psum and a residual add, a causal cumulative sum over the tokens mixes rows: the
    carried rows are gathered just before it (and the add still runs on rows)."""
    mesh = mesh_1d()

    def body(x, w1, w2):
        y = x + megatron_mlp_body(x, w1, w2)
        return jnp.cumsum(y, axis=0)

    f = smap(body, mesh=mesh, in_specs=MEGATRON_SPECS, out_specs=P())
    return lower(f, *megatron_args(mesh))


def moe_unpermute() -> str:
    """A MoE block's expert down-projection, tensor-parallel over 'model' (each expert's FFN dim
    sharded): 4 experts of capacity 16 (a batched einsum), their rows weighted by the router's
    gates and scatter-added back into the 32 tokens' order (the un-permute), then psum'd."""
    mesh = mesh_1d()
    experts, capacity, tokens, ffn, hidden = 4, 16, 32, 128, 64

    def body(h, w, gates, token):
        y = jnp.einsum("ecf,efd->ecd", h, w).reshape(experts * capacity, hidden)
        unpermuted = jnp.zeros((tokens, hidden), y.dtype).at[token].add(y * gates[:, None])
        return jax.lax.psum(unpermuted, "model")

    specs = (P(None, None, "model"), P(None, "model", None), P(), P())
    f = smap(body, mesh=mesh, in_specs=specs, out_specs=P())
    return lower(f, arg(mesh, (experts, capacity, ffn), specs[0]), arg(mesh, (experts, ffn, hidden), specs[1]),
                 arg(mesh, (experts * capacity,), P()), arg(mesh, (experts * capacity,), P(), jnp.int32))


#: the samples of this family (tools/gen_samples.py writes them in this order)
SAMPLES_LIST = [
    # ---- a psum after a matmul (Megatron without sequence parallelism)
    Sample("ar_megatron_mlp", "Megatron MLP: x @ w1 (column-parallel), gelu, @ w2 (row-parallel), psum over 'model': "
           "split into a reduce-scatter ring over the rows and one gather before the return.",
           megatron_mlp, "rewritten 1",
           ["CHECK-NOT: stablehlo.all_reduce", *loop_checks(PAIRS_1D_8, 7), "CHECK: stablehlo.add",
            "CHECK: } ", 'CHECK: "stablehlo.all_gather"', "CHECK-SAME: all_gather_dim = 0",
            "CHECK-NEXT: sdy.return", "CHECK-NOT: stablehlo.all_reduce"],
           [Variant("CHUNK", ["--all-reduce", "chunk", "--chunks", "4", "--variant", "uni"],
                    ["CHECK-NOT: stablehlo.while",
                     *[line for _ in range(4) for line in (
                         "CHECK: stablehlo.slice", "CHECK: stablehlo.dot_general",
                         "CHECK-SAME: -> tensor<16x32xf32>", 'CHECK: "stablehlo.all_reduce"')],
                     "CHECK: stablehlo.concatenate", "CHECK-SAME: dim = 0", "CHECK-NEXT: sdy.return"]),
            Variant("KEEP", ["--all-reduce", "keep", "--variant", "uni"], ['CHECK: "stablehlo.all_reduce"', "CHECK-NOT: stablehlo.while"]),
            # the default (--all-reduce auto): the cost model's pick on the h100 profile, two chunks
            Variant("AUTO", ["--variant", "auto"],
                    ["CHECK-NOT: stablehlo.while",
                     *[line for _ in range(2) for line in (
                         "CHECK: stablehlo.slice", "CHECK: stablehlo.dot_general",
                         "CHECK-SAME: -> tensor<32x32xf32>", 'CHECK: "stablehlo.all_reduce"')],
                     "CHECK: stablehlo.concatenate", "CHECK-SAME: dim = 0", "CHECK-NEXT: sdy.return"])], main_args=SPLIT_ARGS),
    Sample("ar_moe_unpermute", "a MoE block's expert down-projection (4 experts, a batched einsum) weighted by the "
           "router's gates and scatter-added back into token order, then psum'd over 'model': the scatter keeps the "
           "hidden dim whole, so the psum splits along it (a reduce-scatter ring over the hidden dim, each block's "
           "rows un-permuted in the ring) and the sum is gathered before the return.",
           moe_unpermute, "rewritten 1",
           ["CHECK-NOT: stablehlo.all_reduce", "CHECK: stablehlo.while", "CHECK: stablehlo.dot_general",
            "CHECK-SAME: -> tensor<4x16x8xf32>", 'CHECK: "stablehlo.scatter"',
            "CHECK: }) : (tensor<32x8xf32>, tensor<64x1xi32>, tensor<64x8xf32>) -> tensor<32x8xf32>",
            'CHECK: "stablehlo.all_gather"', "CHECK-SAME: all_gather_dim = 1", "CHECK-NOT: stablehlo.all_reduce"],
           [Variant("CHUNK", ["--all-reduce", "chunk", "--chunks", "2", "--variant", "uni"],
                    ["CHECK-NOT: stablehlo.while",
                     *[line for _ in range(2) for line in (
                         "CHECK: stablehlo.dot_general", "CHECK-SAME: -> tensor<4x16x32xf32>",
                         'CHECK: "stablehlo.scatter"', 'CHECK: "stablehlo.all_reduce"')],
                     "CHECK: stablehlo.concatenate", "CHECK-SAME: dim = 1"])], main_args=SPLIT_ARGS),
    Sample("ar_megatron_mlp_grad", "value_and_grad of the Megatron MLP: the forward's psum and the backward's psum of "
           "the input gradient, both split into reduce-scatter rings.",
           megatron_mlp_grad, "rewritten 2", ["CHECK-NOT: stablehlo.all_reduce", "CHECK: stablehlo.while",
                                              "CHECK: stablehlo.while", "CHECK-NOT: stablehlo.all_reduce"], main_args=SPLIT_ARGS),
    Sample("ar_megatron_grad_unchecked", "value_and_grad of the Megatron MLP under check_vma=False: psum's "
           "transpose is a psum, so the backward sums the incoming cotangent before its two matmuls (the input "
           "gradient's and w2's) read it. No matmul produces that sum: it is split into a reduce-scatter, which stays "
           "a collective, and an all_gather that becomes the two matmuls' ring; the forward's psum and the input "
           "gradient's psum are split into reduce-scatter rings.",
           megatron_mlp_grad_unchecked, "rewritten 4",
           ['CHECK: "stablehlo.reduce_scatter"', "CHECK-NOT: stablehlo.all_reduce"], main_args=SPLIT_ARGS),
    Sample("ar_megatron_ln_stack", "two pre-LN residual Megatron MLP blocks: block 1's psum rows carried through the "
           "residual add and block 2's layer norm into block 2's gather ring; the output gathered once.",
           megatron_ln_stack, "rewritten 3",
           ["CHECK-NOT: stablehlo.all_reduce",
            "CHECK: stablehlo.while",  # block 1's reduce-scatter ring
            "CHECK: stablehlo.dynamic_slice",  # the replicated input's rows of this device
            "CHECK: stablehlo.reduce",  # the layer norm on rows
            "CHECK: stablehlo.while",  # block 2's gather ring
            "CHECK-NOT: stablehlo.all_gather",
            "CHECK: call @cmatmul_ring_0",  # block 2's reduce-scatter ring: block 1's pattern, shared
            'CHECK: "stablehlo.all_gather"', "CHECK-NEXT: sdy.return", "CHECK-NOT: stablehlo.all_reduce"], main_args=SPLIT_ARGS),
    Sample("ar_megatron_rms_stack", "two pre-RMS-norm residual Megatron MLP blocks (RMS norm on the carried rows).",
           megatron_rms_stack, "rewritten 3",
           ["CHECK-NOT: stablehlo.all_reduce", "CHECK: stablehlo.rsqrt", "CHECK: stablehlo.while",
            'CHECK: "stablehlo.all_gather"', "CHECK-NEXT: sdy.return"], main_args=SPLIT_ARGS),
    Sample("ar_megatron_bf16", "bf16 Megatron MLP accumulating in f32: the f32 product's rows are summed round the "
           "ring in f32.",
           megatron_bf16, "rewritten 1",
           ["CHECK-NOT: stablehlo.all_reduce", "CHECK: stablehlo.while", "CHECK: stablehlo.dot_general",
            "CHECK-SAME: (tensor<8x16xbf16>, tensor<16x32xbf16>) -> tensor<8x32xf32>", 'CHECK: "stablehlo.all_gather"'], main_args=SPLIT_ARGS),
    Sample("ar_megatron_mesh2x4", "2x4 (data, model) mesh, pre-LN residual block, psum over 'model' only: rings over "
           "the 'model' groups, the rows of the batch-sharded input sliced per device.",
           megatron_mesh2x4, "rewritten 1",
           ["CHECK-NOT: stablehlo.all_reduce", *loop_checks(PAIRS_2X4_MODEL, 3),
            'CHECK: "stablehlo.all_gather"', f"CHECK-SAME: replica_groups = dense<{escape('[[0, 1, 2, 3], [4, 5, 6, 7]]')}>",
            "CHECK-NEXT: sdy.return"], main_args=SPLIT_ARGS),
    Sample("ar_megatron_row_mixing", "psum, residual add, then a cumulative sum over the tokens: the add runs on rows "
           "and the gather is materialised before the cumsum (not declined).",
           megatron_row_mixing, "rewritten 1",
           ["CHECK-NOT: stablehlo.all_reduce", "CHECK: stablehlo.while", "CHECK: stablehlo.dynamic_slice",
            "CHECK: stablehlo.add", 'CHECK: "stablehlo.all_gather"', "CHECK: stablehlo.reduce_window"], main_args=SPLIT_ARGS),
    Sample("neg_ar_not_divisible", "psum of a [12, 12] product on a ring of 8: no dim splits evenly.",
           megatron_not_divisible, "unchanged no_dim", ['CHECK: "stablehlo.all_reduce"', "CHECK-NOT: stablehlo.while"]),
    Sample("neg_ar_chunked", "a psum already in two row chunks, concatenated (chunked by hand, or the chunk "
           "strategy's output): each chunk's all_reduce stays.",
           megatron_chunked_by_hand, "unchanged chunked chunked",
           ['CHECK: "stablehlo.all_reduce"', 'CHECK: "stablehlo.all_reduce"', "CHECK: stablehlo.concatenate",
            "CHECK-NOT: stablehlo.while"]),

]
