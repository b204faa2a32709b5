"""Samples of all_gather → dot (tools/gen_samples.py): the gathered operand on either side, free,
contracting and batch dims, meshes and groups, dtypes, look-through and several consumers."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from tools.golden import escape
from tools.samples_common import (
    Sample, Variant, smap, arg, lower, mesh_1d, mesh_2x4, gather, loop_checks, ring_checks, contracting_checks,
    gone, BIDI, UNROLL2, FULL, STREAMS, HLO, unroll2_checks, full_checks, bidi_gather_loop_checks,
    bidi_gather_4_checks, streams_checks, hlo_checks, PAIRS_1D_8_UP, PAIRS_2X4_MODEL_UP, PAIRS_2X4_MODEL,
    PAIRS_1D_8, PAIRS_2X4_DATA, PAIRS_MODEL_DATA, under_legacy_partitioner,
)


ROWS_MODEL, COLS_MODEL = P("model", None), P(None, "model")


def gathered_matmul(mesh, axes, x, w, out_specs, *, dim=0, dtype=jnp.float32, w_dtype=None, cast=None, **smap_kwargs):
    """``gather(x, axes, dim) @ w`` in a shard_map over ``mesh`` (``cast``: the gathered value's dtype
    for the dot); ``x``, ``w``: (global shape, PartitionSpec)."""

    def body(a, b):
        g = gather(a, axes, dim)
        return (g if cast is None else g.astype(cast)) @ b

    body.__name__ = "<lambda>"  # the module name (jit__lambda) the samples have always had
    f = smap(body, mesh=mesh, in_specs=(x[1], w[1]), out_specs=out_specs, **smap_kwargs)
    return lower(f, arg(mesh, *x, dtype), arg(mesh, *w, w_dtype or dtype))


def column_parallel_1d() -> str:
    return gathered_matmul(mesh_1d(), "model", ((128, 64), ROWS_MODEL), ((64, 128), COLS_MODEL), COLS_MODEL)


def mesh2x4_model() -> str:
    rows = P(("data", "model"), None)
    return gathered_matmul(mesh_2x4(), "model", ((64, 32), rows), ((32, 64), COLS_MODEL), P("data", "model"))


def mesh2x4_data_strided() -> str:
    return gathered_matmul(mesh_2x4(), "data", ((64, 32), P("data", None)), ((32, 64), COLS_MODEL), COLS_MODEL)


def permuted_groups() -> str:
    rows = P(("model", "data"), None)
    return gathered_matmul(mesh_2x4(), ("model", "data"), ((64, 32), rows), ((32, 16), P()), P())


def gathered_rhs() -> str:
    mesh = mesh_2x4()
    body = lambda x, w: x @ gather(w, "model", 1)  # noqa: E731
    f = smap(body, mesh=mesh, in_specs=(P("data", None), P(None, "model")), out_specs=P("data", None))
    return lower(f, arg(mesh, (32, 64), P("data", None)), arg(mesh, (64, 128), P(None, "model")))


def bf16_f32_accumulation() -> str:
    mesh = mesh_2x4()

    def body(x, w):
        return jnp.dot(gather(x, "model", 0), w, preferred_element_type=jnp.float32)

    f = smap(body, mesh=mesh, in_specs=(P("model", None), P(None, "model")), out_specs=P(None, "model"))
    return lower(f, arg(mesh, (64, 32), P("model", None), jnp.bfloat16), arg(mesh, (32, 64), P(None, "model"), jnp.bfloat16))


def activations_bsh() -> str:
    mesh = mesh_2x4()

    def body(x, w):
        return jnp.einsum("bsh,hf->bsf", gather(x, "model", 1), w)

    f = smap(
        body, mesh=mesh, in_specs=(P("data", "model", None), P(None, "model")), out_specs=P("data", None, "model")
    )
    return lower(f, arg(mesh, (4, 64, 32), P("data", "model", None)), arg(mesh, (32, 64), P(None, "model")))


def exported() -> str:
    mesh = mesh_1d()
    body = lambda x, w: gather(x, "model", 0) @ w  # noqa: E731
    f = jax.jit(smap(body, mesh=mesh, in_specs=(P("model", None), P(None, "model")), out_specs=P(None, "model")))
    exp = jax.export.export(f)(arg(mesh, (64, 32), P("model", None)), arg(mesh, (32, 64), P(None, "model")))
    # mlir_module() carries the generator's absolute file:line locations; keep the module, drop those.
    from cmatmul_pass import ir_utils

    return ir_utils.print_module(ir_utils.parse(exp.mlir_module()))


def partial_manual() -> str:
    return gathered_matmul(mesh_2x4(), "model", ((64, 32), ROWS_MODEL), ((32, 64), COLS_MODEL), COLS_MODEL,
                           axis_names={"model"})


def inside_scan() -> str:
    """A layer loop (lax.scan over stacked weights): the site sits in a while body."""
    mesh = mesh_2x4()

    def body(x, ws):
        def layer(h, w):
            y = jnp.tanh(gather(h, "model", 0) @ w)
            return jax.lax.dynamic_slice_in_dim(y, jax.lax.axis_index("model") * h.shape[0], h.shape[0], 0), None

        return jax.lax.scan(layer, x, ws)[0]

    f = smap(body, mesh=mesh, in_specs=(P("model", None), P(None, None, None)), out_specs=P("model", None))
    return lower(f, arg(mesh, (32, 16), P("model", None)), arg(mesh, (3, 16, 16), P()))


def two_sites() -> str:
    mesh = mesh_2x4()

    def body(x, y, w1, w2):
        return gather(x, "model", 0) @ w1 + gather(y, "model", 0) @ w2

    f = smap(body, mesh=mesh, in_specs=(P("model", None),) * 2 + (P(None, "model"),) * 2, out_specs=P(None, "model"))
    return lower(
        f,
        arg(mesh, (64, 32), P("model", None)),
        arg(mesh, (64, 16), P("model", None)),
        arg(mesh, (32, 64), P(None, "model")),
        arg(mesh, (16, 64), P(None, "model")),
    )


def int32_matmul() -> str:
    return gathered_matmul(mesh_2x4(), "model", ((32, 16), ROWS_MODEL), ((16, 32), COLS_MODEL), COLS_MODEL, dtype=jnp.int32)


def ag_contracting(dtype=jnp.float32) -> Callable[[], str]:
    """The "async gather" of feature-sharded activations: x [B, H/4] gathered on its features, which
    the dot contracts: the ring sums x_j @ W[rows of block j]."""

    def build() -> str:
        x, w = ((32, 64), P("data", "model")), ((64, 64), COLS_MODEL)
        return gathered_matmul(mesh_2x4(), "model", x, w, P("data", "model"), dim=1, dtype=dtype)

    return build


def ag_partial_manual_convert() -> str:
    """Partial-manual region, bf16 shards cast to f32: convert and sdy.sharding_constraint sit between the
    gather and the dot."""
    return gathered_matmul(mesh_2x4(), "model", ((64, 32), ROWS_MODEL), ((32, 64), COLS_MODEL), COLS_MODEL,
                           dtype=jnp.bfloat16, w_dtype=jnp.float32, cast=jnp.float32, axis_names={"model"})


def ag_untiled() -> str:
    """all_gather(tiled=False): [4, rows/4, H] reshaped to [rows, H] before the dot."""
    mesh = mesh_2x4()

    def body(x, w):
        g = jax.lax.all_gather(x, "model", axis=0, tiled=False)
        return g.reshape(-1, x.shape[1]) @ w

    f = smap(body, mesh=mesh, in_specs=(P("model", None), P(None, "model")), out_specs=P(None, "model"))
    return lower(f, arg(mesh, (64, 32), P("model", None)), arg(mesh, (32, 64), P(None, "model")))


def ag_converted() -> str:
    """bf16 activations gathered, then cast to f32 for the dot: the ring moves bf16 and casts each shard."""
    return gathered_matmul(mesh_2x4(), "model", ((64, 32), ROWS_MODEL), ((32, 64), COLS_MODEL), COLS_MODEL,
                           dtype=jnp.bfloat16, w_dtype=jnp.float32, cast=jnp.float32)


def ag_transposed() -> str:
    """The gathered [S, H] is transposed before it meets the dot as its rhs: w [F, H] @ g.T."""
    mesh = mesh_2x4()
    body = lambda x, w: w @ gather(x, "model", 0).T  # noqa: E731
    f = smap(body, mesh=mesh, in_specs=(P("model", None), P("model", None)), out_specs=P("model", None))
    return lower(f, arg(mesh, (64, 32), P("model", None)), arg(mesh, (64, 32), P("model", None)))


def ag_qkv() -> str:
    """One gather feeding the q, k and v projections: one ring computes all three dots."""
    mesh = mesh_2x4()

    def body(x, wq, wk, wv):
        g = gather(x, "model", 0)
        return g @ wq, g @ wk, g @ wv

    w = P(None, "model")
    f = smap(body, mesh=mesh, in_specs=(P("model", None), w, w, w), out_specs=(w, w, w))
    weights = [arg(mesh, (32, 64), w) for _ in range(3)]
    return lower(f, arg(mesh, (64, 32), P("model", None)), *weights)


def ag_qkv_cast() -> str:
    """Mixed precision as layers write it: the gathered f32 activations and each weight cast to
    bf16 where they are used; the k and v weights' casts come after the q projection."""
    mesh = mesh_2x4()

    def body(x, wq, wk, wv):
        g = gather(x, "model", 0).astype(jnp.bfloat16)
        return tuple(g @ w.astype(jnp.bfloat16) for w in (wq, wk, wv))

    w = P(None, "model")
    f = smap(body, mesh=mesh, in_specs=(P("model", None), w, w, w), out_specs=(w, w, w))
    weights = [arg(mesh, (32, 64), w) for _ in range(3)]
    return lower(f, arg(mesh, (64, 32), P("model", None)), *weights)


def ag_dequant() -> str:
    """fp8 activations gathered (half the bytes of bf16) and dequantised where they are used:
    cast to bf16 and multiplied by a per-tensor scale before the dot."""
    mesh = mesh_2x4()

    def body(x, s, w):
        return (gather(x, "model", 0).astype(jnp.bfloat16) * s[0].astype(jnp.bfloat16)) @ w

    w = P(None, "model")
    f = smap(body, mesh=mesh, in_specs=(P("model", None), P(), w), out_specs=w)
    return lower(f, arg(mesh, (64, 32), P("model", None), jnp.float8_e4m3fn), arg(mesh, (1,), P()),
                 arg(mesh, (32, 64), w, jnp.bfloat16))


def ag_assembled() -> str:
    """The gathered value feeds a dot and a tanh: the loop computes the dot and assembles the gathered
    value for the tanh (no second all_gather)."""
    mesh = mesh_2x4()

    def body(x, w):
        g = gather(x, "model", 0)
        return g @ w, jnp.tanh(g)

    f = smap(body, mesh=mesh, in_specs=(P("model", None), P(None, "model")), out_specs=(P(None, "model"), P()))
    return lower(f, arg(mesh, (64, 32), P("model", None)), arg(mesh, (32, 64), P(None, "model")))


# ---------------------------------------------------------------- batch dims
def batch_dim() -> str:
    mesh = mesh_2x4()
    body = lambda x, w: jnp.einsum("bij,bjk->bik", gather(x, "model", 0), w)  # noqa: E731
    f = smap(body, mesh=mesh, in_specs=(P("model", None, None), P()), out_specs=P())
    return lower(f, arg(mesh, (8, 16, 32), P("model", None, None)), arg(mesh, (8, 32, 16), P()))


#: the samples of this family (tools/gen_samples.py writes them in this order)
SAMPLES_LIST = [
    Sample("ag_dot_1d", "1-D mesh of 8, column-parallel layer: all_gather rows of x, then x @ W[:, shard].",
           column_parallel_1d, "rewritten 1", ring_checks(PAIRS_1D_8, 7),
           [Variant("BIDI", BIDI, bidi_gather_loop_checks(PAIRS_1D_8, PAIRS_1D_8_UP, 2)),
            Variant("UNROLL2", UNROLL2, unroll2_checks("all_gather", PAIRS_1D_8, 3)),
            Variant("FULL", FULL, full_checks("all_gather", 7, 8)),
            Variant("STREAMS", STREAMS, streams_checks("all_gather")),
            Variant("HLO", HLO, hlo_checks())]),
    Sample("ag_dot_mesh2x4_model", "2x4 (data, model) mesh, sequence-parallel rows gathered over 'model'.",
           mesh2x4_model, "rewritten 1", ring_checks(PAIRS_2X4_MODEL, 3)),
    Sample("ag_dot_mesh2x4_data_strided", "2x4 mesh gathering over the non-minor axis 'data': strided groups [[0,4],...].",
           mesh2x4_data_strided, "rewritten 1",
           # a ring of 2 has one round per shard and one permute: straight-line, no loop
           ["CHECK-NOT: stablehlo.while", 'CHECK: "stablehlo.collective_permute"',
            f"CHECK-SAME: source_target_pairs = dense<{escape(PAIRS_2X4_DATA)}>",
            "CHECK: stablehlo.dot_general", "CHECK: stablehlo.dynamic_update_slice",
            "CHECK: stablehlo.dot_general", "CHECK: stablehlo.dynamic_update_slice"] + gone("all_gather", "while")),
    Sample("ag_dot_permuted_groups", "gather over ('model', 'data'): one non-monotonic group [0,4,1,5,2,6,3,7].",
           permuted_groups, "rewritten 1", ring_checks(PAIRS_MODEL_DATA, 7)),
    Sample("ag_dot_rhs", "the gathered operand is the dot's rhs (weight columns gathered over 'model').",
           gathered_rhs, "rewritten 1", ring_checks(PAIRS_2X4_MODEL, 3)),
    Sample("ag_dot_bf16_f32acc", "bf16 operands with preferred_element_type=f32: partial dots keep (bf16, bf16) -> f32.",
           bf16_f32_accumulation, "rewritten 1",
           ring_checks(PAIRS_2X4_MODEL, 3, "(tensor<16x32xbf16>, tensor<32x16xbf16>) -> tensor<16x16xf32>")),
    Sample("ag_dot_bsh", "3-D activations [B, S, H] gathered on S, einsum bsh,hf->bsf.",
           activations_bsh, "rewritten 1", ring_checks(PAIRS_2X4_MODEL, 3)),
    Sample("ag_dot_legacy", "the legacy (non-Shardy) partitioner: the body is func.func private @shmap_body.",
           under_legacy_partitioner(mesh2x4_model), "rewritten 1",
           ["CHECK-LABEL: func.func private @shmap_body"] + ring_checks(PAIRS_2X4_MODEL, 3)),
    Sample("ag_dot_export", "jax.export's module (main wraps the jitted function).",
           exported, "rewritten 1", ring_checks(PAIRS_1D_8, 7)),
    Sample("ag_dot_partial_manual",
           "partial-manual shard_map (axis_names={'model'}) on a 2x4 mesh: the ring reads its position in a nested "
           "sdy.manual_computation over the free axis 'data', as lax.axis_index does.",
           partial_manual, "rewritten 1",
           ["CHECK: sdy.manual_computation() in_shardings=[] out_shardings=[<@mesh, []>] manual_axes={\"data\"}"]
           + ring_checks(PAIRS_2X4_MODEL, 3)),
    Sample("ag_dot_in_scan", "a layer loop: the site sits inside lax.scan's while body.",
           inside_scan, "rewritten 1", ["CHECK: stablehlo.while"] + ring_checks(PAIRS_2X4_MODEL, 3)),
    Sample("ag_dot_two_sites", "two independent gathers, each feeding its own dot: two rings, fresh channel handles.",
           two_sites, "rewritten 2",
           ["CHECK-NOT: stablehlo.all_gather",
            "CHECK: channel_handle = #stablehlo.channel_handle<handle = 2, type = 1>",
            "CHECK: channel_handle = #stablehlo.channel_handle<handle = 3, type = 1>",
            "CHECK-NOT: stablehlo.all_gather"]),
    Sample("ag_dot_int32", "an integer matmul (compared exactly).",
           int32_matmul, "rewritten 1", ring_checks(PAIRS_2X4_MODEL, 3)),
    Sample("ag_dot_batch", "the gathered dim is a batch dim of the dot: each round multiplies the shard it holds by "
           "the same block of the other operand's batch dim and writes that block of the result.",
           batch_dim, "rewritten 1",
           ["CHECK-NOT: stablehlo.all_gather", "CHECK: stablehlo.partition_id", *loop_checks(PAIRS_2X4_MODEL, 3),
            "CHECK: stablehlo.dynamic_slice {{.*}} sizes = [2, 32, 16]",
            "CHECK-NEXT: stablehlo.dot_general {{.*}} batching_dims = [0] x [0]",
            "CHECK-SAME: (tensor<2x16x32xf32>, tensor<2x32x16xf32>) -> tensor<2x16x16xf32>",
            "CHECK-NEXT: stablehlo.dynamic_update_slice", "CHECK: stablehlo.return",
            "CHECK: stablehlo.dynamic_slice {{.*}} sizes = [2, 32, 16]",
            "CHECK-NEXT: stablehlo.dot_general {{.*}} batching_dims = [0] x [0]",
            "CHECK-NEXT: stablehlo.dynamic_update_slice", "CHECK-NOT: stablehlo.all_gather"]),
    # ---- all_gather on the contracting dim, look-through, several consumers
    Sample("ag_dot_contracting", "features gathered and contracted (ViT-22b's async gather): partials summed.",
           ag_contracting(), "rewritten 1", contracting_checks(PAIRS_2X4_MODEL, 3),
           [Variant("BIDI", BIDI, bidi_gather_4_checks(PAIRS_2X4_MODEL, PAIRS_2X4_MODEL_UP)),
            Variant("UNROLL2", UNROLL2, unroll2_checks("all_gather", PAIRS_2X4_MODEL, 1, tied=False)),
            Variant("FULL", FULL, full_checks("all_gather", 3, 4)),
            Variant("STREAMS", STREAMS, streams_checks("all_gather"))]),
    Sample("ag_dot_contracting_bf16", "bf16 contracting gather: partial contractions summed in f32, cast once.",
           ag_contracting(jnp.bfloat16), "rewritten 1",
           contracting_checks(PAIRS_2X4_MODEL, 3) + ["CHECK: stablehlo.convert {{.*}} -> tensor<16x16xbf16>"]),
    Sample("ag_dot_contracting_int32", "integer contracting gather (compared exactly).",
           ag_contracting(jnp.int32), "rewritten 1", contracting_checks(PAIRS_2X4_MODEL, 3)),
    Sample("ag_dot_untiled", "all_gather(tiled=False): [4, rows/4, H] reshaped to [rows, H] for the dot.",
           ag_untiled, "rewritten 1", ring_checks(PAIRS_2X4_MODEL, 3)),
    Sample("ag_dot_convert", "bf16 shards gathered and cast to f32: the ring moves bf16 and casts each shard.",
           ag_converted, "rewritten 1",
           ['CHECK: "stablehlo.collective_permute"', "CHECK-SAME: (tensor<16x32xbf16>) -> tensor<16x32xbf16>",
            "CHECK-NEXT: stablehlo.add", "CHECK-NEXT: stablehlo.remainder",
            "CHECK-NEXT: stablehlo.convert {{.*}} (tensor<16x32xbf16>) -> tensor<16x32xf32>",
            "CHECK-NEXT: stablehlo.dot_general"] + ring_checks(PAIRS_2X4_MODEL, 3)[-4:]),
    Sample("ag_dot_partial_manual_convert", "partial-manual region: convert + sharding_constraint between gather and dot.",
           ag_partial_manual_convert, "rewritten 1",
           ["CHECK: manual_axes={\"data\"}", 'CHECK: "stablehlo.collective_permute"',
            "CHECK-SAME: (tensor<16x32xbf16>) -> tensor<16x32xbf16>"] + gone("all_gather")),
    Sample("ag_dot_transpose", "the gathered [S, H] is transposed and used as the dot's rhs.",
           ag_transposed, "rewritten 1",
           ["CHECK: stablehlo.while", "CHECK: stablehlo.transpose", "CHECK-NEXT: stablehlo.dot_general"] + gone("all_gather")),
    Sample("ag_dot_qkv", "one gather feeding q, k and v projections: one ring, one dot per step on the "
           "weights concatenated before it, one accumulator sliced into q, k and v after it.",
           ag_qkv, "rewritten 1",
           ["CHECK: stablehlo.concatenate", "CHECK: } do {", 'CHECK: "stablehlo.collective_permute"',
            "CHECK: stablehlo.dot_general", "CHECK-NOT: stablehlo.dot_general", "CHECK: stablehlo.return",
            "CHECK: stablehlo.dot_general", "CHECK: stablehlo.slice", "CHECK: stablehlo.slice",
            "CHECK: stablehlo.slice"]
           + gone("all_gather"),
           [Variant("BIDI", BIDI, bidi_gather_4_checks(PAIRS_2X4_MODEL, PAIRS_2X4_MODEL_UP)),
            Variant("UNROLL2", UNROLL2, unroll2_checks("all_gather", PAIRS_2X4_MODEL, 1)),
            Variant("FULL", FULL, full_checks("all_gather", 3, 12)),
            Variant("STREAMS", STREAMS, streams_checks("all_gather"))]),
    Sample("ag_dot_qkv_cast", "q, k and v projections of the gathered value cast to bf16, each weight cast where "
           "it is used: the k and v weights' casts move up before the ring, which computes all three dots.",
           ag_qkv_cast, "rewritten 1",
           ["CHECK-COUNT-3: stablehlo.convert {{.*}} (tensor<32x16xf32>) -> tensor<32x16xbf16>",
            "CHECK: stablehlo.concatenate", "CHECK: } do {", 'CHECK: "stablehlo.collective_permute"',
            "CHECK-SAME: (tensor<16x32xf32>) -> tensor<16x32xf32>",
            "CHECK: stablehlo.convert {{.*}} (tensor<16x32xf32>) -> tensor<16x32xbf16>",
            "CHECK-NEXT: stablehlo.dot_general", "CHECK-NOT: stablehlo.dot_general", "CHECK: stablehlo.return",
            "CHECK: stablehlo.dot_general", "CHECK: stablehlo.slice"] + gone("all_gather")),
    Sample("ag_dot_dequant", "fp8 activations gathered, then cast to bf16 and scaled per tensor before the dot: "
           "the ring moves fp8 shards and dequantises each (the scale's broadcast rebuilt at shard size).",
           ag_dequant, "rewritten 1",
           ['CHECK: } do {', 'CHECK: "stablehlo.collective_permute"',
            "CHECK-SAME: (tensor<16x32xf8E4M3FN>) -> tensor<16x32xf8E4M3FN>",
            "CHECK: stablehlo.convert {{.*}} (tensor<16x32xf8E4M3FN>) -> tensor<16x32xbf16>",
            "CHECK-NEXT: stablehlo.broadcast_in_dim {{.*}} -> tensor<16x32xbf16>",
            "CHECK-NEXT: stablehlo.multiply {{.*}} : tensor<16x32xbf16>",
            "CHECK-NEXT: stablehlo.dot_general"] + gone("all_gather")),
    Sample("ag_dot_assembled", "the gathered value feeds a dot and a tanh: the loop also assembles it for the tanh.",
           ag_assembled, "rewritten 1",
           ["CHECK: } do {", 'CHECK: "stablehlo.collective_permute"', "CHECK: stablehlo.dot_general",
            "CHECK: stablehlo.dynamic_update_slice", "CHECK: stablehlo.dynamic_update_slice",
            "CHECK: stablehlo.tanh"] + gone("all_gather")),
    # jax >= 0.11 names a collective's groups by mesh axes (#stablehlo.replica_group_mesh_axes)
    Sample("ag_dot_mesh2x4_data_strided_jax011", "jax 0.11: gather over the non-minor mesh axis 'data', groups "
           "by mesh axes; the ring is the strided one [[0,4],...].",
           mesh2x4_data_strided, "rewritten 1",
           ["CHECK-NOT: stablehlo.while", 'CHECK: "stablehlo.collective_permute"',
            f"CHECK-SAME: source_target_pairs = dense<{escape(PAIRS_2X4_DATA)}>"] + gone("all_gather", "while"),
           jax="0.11"),
    Sample("ag_dot_permuted_groups_jax011", "jax 0.11: gather over ('model', 'data'), groups by mesh axes in that "
           "order; the ring is [0,4,1,5,2,6,3,7].",
           permuted_groups, "rewritten 1", ring_checks(PAIRS_MODEL_DATA, 7), jax="0.11"),

]
