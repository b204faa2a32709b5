"""Samples of dot → reduce_scatter (tools/gen_samples.py): the scattered dim free or batch, a sum of
products, scaled, transposed, converted or reshaped products, partial-manual regions."""

from __future__ import annotations


import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from tools.samples_common import (
    Sample, Variant, smap, arg, lower, mesh_1d, mesh_2x4, scatter, loop_checks, rs_checks, gone, BIDI, UNROLL2,
    FULL, STREAMS, HLO, PERMUTE, pairs_same, unroll2_checks, full_checks, streams_checks, hlo_checks,
    PAIRS_1D_8_UP, PAIRS_2X4_MODEL, PAIRS_1D_8,
)


def rs_1d() -> str:
    """Row-parallel layer on 8 devices: local partial product, summed and scattered over rows."""
    mesh = mesh_1d()
    body = lambda x, w: scatter(x @ w, "model", 0)  # noqa: E731
    f = smap(body, mesh=mesh, in_specs=(P(None, "model"), P("model", None)), out_specs=P("model", None))
    return lower(f, arg(mesh, (64, 128), P(None, "model")), arg(mesh, (128, 32), P("model", None)))


def rs_on(dim, dtype=jnp.float32, **dot_kwargs):
    """2x4 mesh, dot then psum_scatter over 'model' on result dim ``dim`` (0: lhs rows, 1: rhs columns)."""

    def build() -> str:
        mesh = mesh_2x4()

        def body(x, w):
            return scatter(jnp.dot(x, w, **dot_kwargs), "model", dim)

        out = P(("data", "model"), None) if dim == 0 else P("data", "model")
        f = smap(body, mesh=mesh, in_specs=(P("data", "model"), P("model", None)), out_specs=out)
        return lower(f, arg(mesh, (64, 64), P("data", "model"), dtype), arg(mesh, (64, 32), P("model", None), dtype))

    return build


def rs_scaled() -> str:
    """Row-parallel layer whose partial product is scaled per tensor and biased per column on each
    device before the sum (y * s + b, then psum_scatter over rows)."""
    mesh = mesh_2x4()

    def body(x, w, s, b):
        return scatter(jnp.dot(x, w) * s[0] + b[None, :], "model", 0)

    f = smap(body, mesh=mesh, in_specs=(P("data", "model"), P("model", None), P(), P()),
             out_specs=P(("data", "model"), None))
    return lower(f, arg(mesh, (64, 64), P("data", "model")), arg(mesh, (64, 32), P("model", None)),
                 arg(mesh, (1,), P()), arg(mesh, (32,), P()))


def rs_sum_of_dots() -> str:
    """The scattered value is a sum of three row-parallel products (how the backward of a gather read
    by q, k and v projections adds their input gradients): one ring, three dots per block."""
    mesh = mesh_2x4()

    def body(a, b, c, wa, wb, wc):
        return scatter(a @ wa + b @ wb + c @ wc, "model", 0)

    x, w = P(None, "model"), P("model", None)
    f = smap(body, mesh=mesh, in_specs=(x, x, x, w, w, w), out_specs=P("model", None))
    return lower(f, *[arg(mesh, (64, 64), x)] * 3, *[arg(mesh, (64, 32), w)] * 3)


def rs_untiled() -> str:
    """psum_scatter(tiled=False): the product is reshaped to [4, rows/4, cols], scattered on the new
    size-4 dim, and the size-1 dim is dropped after (reshape look-through, both sides)."""
    mesh = mesh_2x4()

    def body(x, w):
        y = (x @ w).reshape(4, x.shape[0] // 4, w.shape[1])
        return scatter(y, "model", 0, tiled=False)

    f = smap(body, mesh=mesh, in_specs=(P("data", "model"), P("model", None)), out_specs=P(("data", "model"), None))
    return lower(f, arg(mesh, (64, 64), P("data", "model")), arg(mesh, (64, 32), P("model", None)))


def rs_transposed() -> str:
    """The product is transposed before the scatter (look-through of stablehlo.transpose)."""
    mesh = mesh_2x4()
    body = lambda x, w: scatter((x @ w).T, "model", 0)  # noqa: E731
    f = smap(body, mesh=mesh, in_specs=(P("data", "model"), P("model", None)), out_specs=P(("model",), "data"))
    return lower(f, arg(mesh, (64, 64), P("data", "model")), arg(mesh, (64, 32), P("model", None)))


def rs_converted() -> str:
    """bf16 operands, f32 product converted back to bf16 before the scatter (convert look-through)."""
    mesh = mesh_2x4()

    def body(x, w):
        return scatter(jnp.dot(x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16), "model", 0)

    f = smap(body, mesh=mesh, in_specs=(P("data", "model"), P("model", None)), out_specs=P(("data", "model"), None))
    return lower(f, arg(mesh, (64, 64), P("data", "model"), jnp.bfloat16), arg(mesh, (64, 32), P("model", None), jnp.bfloat16))


def rs_partial_manual() -> str:
    """Partial-manual shard_map (manual over 'model' only): sharding constraints sit between the dot and
    the scatter and inside the scatter's sum region."""
    mesh = mesh_2x4()
    body = lambda x, w: scatter(x @ w, "model", 0)  # noqa: E731
    f = smap(body, mesh=mesh, in_specs=(P(None, "model"), P("model", None)), out_specs=P("model", None), axis_names={"model"})
    return lower(f, arg(mesh, (64, 64), P(None, "model")), arg(mesh, (64, 32), P("model", None)))


def rs_batch_dim() -> str:
    mesh = mesh_2x4()
    body = lambda x, w: scatter(jnp.einsum("bij,bjk->bik", x, w), "model", 0)  # noqa: E731
    specs = (P(None, None, "model"), P(None, "model", None))
    f = smap(body, mesh=mesh, in_specs=specs, out_specs=P("model", None, None))
    return lower(f, arg(mesh, (8, 16, 64), specs[0]), arg(mesh, (8, 64, 16), specs[1]))


#: the samples of this family (tools/gen_samples.py writes them in this order)
def rs_padded(value=0.0):
    """A row-parallel bf16 layer over a sequence that does not divide the 8 devices (60 tokens):
    the product is padded with ``value`` to 64 rows (jnp.pad: a call of ``@_pad``), then summed and
    scattered over the rows."""

    def build() -> str:
        mesh = mesh_1d()

        def body(x, w):
            y = jnp.pad(x @ w, ((0, 4), (0, 0)), constant_values=value)
            return scatter(y, "model", 0)

        f = smap(body, mesh=mesh, in_specs=(P(None, "model"), P("model", None)), out_specs=P("model", None))
        return lower(f, arg(mesh, (60, 128), P(None, "model"), jnp.bfloat16),
                     arg(mesh, (128, 32), P("model", None), jnp.bfloat16))

    return build


SAMPLES_LIST = [
    # ---- dot -> reduce_scatter
    Sample("rs_dot_scaled", "each device's partial product scaled and biased before the sum-scatter: the ring "
           "applies both to each block it adds (the scale and bias broadcasts rebuilt at block size).",
           rs_scaled, "rewritten 1",
           ["CHECK: stablehlo.dot_general {{.*}} -> tensor<8x32xf32>",
            "CHECK-NEXT: stablehlo.broadcast_in_dim {{.*}} -> tensor<8x32xf32>",
            "CHECK-NEXT: stablehlo.multiply {{.*}} : tensor<8x32xf32>",
            "CHECK-NEXT: stablehlo.broadcast_in_dim {{.*}} -> tensor<8x32xf32>",
            "CHECK-NEXT: stablehlo.add {{.*}} : tensor<8x32xf32>",
            "CHECK: } do {", 'CHECK: "stablehlo.collective_permute"'] + gone("reduce_scatter")),
    Sample("rs_dot_padded", "a sequence of 60 tokens on 8 devices: the bf16 product is padded with zero rows to 64 "
           "before the sum-scatter; the padding moves onto the lhs (pad(a.b, 0) = select(m, pad(a, 0).b, 0)) and "
           "the ring masks each block's pad rows back to zero.",
           rs_padded(), "rewritten 1",
           ["CHECK-NOT: stablehlo.reduce_scatter",
            "CHECK: stablehlo.pad {{.*}} low = [0, 0], high = [4, 0], interior = [0, 0]",
            "CHECK-SAME: (tensor<60x16xbf16>, tensor<bf16>) -> tensor<64x16xbf16>",
            "CHECK: stablehlo.iota dim = 0 : tensor<64xi32>",
            "CHECK: stablehlo.broadcast_in_dim {{.*}} dims = [0] : (tensor<64xi1>) -> tensor<64x32xi1>",
            "CHECK: stablehlo.dot_general", "CHECK-SAME: (tensor<8x16xbf16>, tensor<16x32xbf16>) -> tensor<8x32xbf16>",
            "CHECK-NEXT: stablehlo.dynamic_slice {{.*}} sizes = [8, 32]", "CHECK: stablehlo.select",
            "CHECK: } do {", 'CHECK: "stablehlo.collective_permute"', "CHECK: stablehlo.select",
            "CHECK-NOT: func.func private @_pad"] + gone("reduce_scatter")),
    Sample("rs_dot_1d", "1-D mesh of 8, row-parallel layer: partial x @ W summed and scattered over rows.",
           rs_1d, "rewritten 1", rs_checks(PAIRS_1D_8, 7, "(tensor<8x16xf32>, tensor<16x32xf32>) -> tensor<8x32xf32>"),
           [Variant("BIDI", BIDI,
                    # half-blocks: [4, 16] slices, [4, 32] partial sums both ways, concatenated at the end
                    ["CHECK-NOT: stablehlo.reduce_scatter", *loop_checks(PAIRS_1D_8, 7),
                     "CHECK-SAME: (tensor<4x32xf32>) -> tensor<4x32xf32>",
                     "CHECK: stablehlo.dot_general", "CHECK-SAME: (tensor<4x16xf32>, tensor<16x32xf32>) -> tensor<4x32xf32>",
                     PERMUTE, pairs_same(PAIRS_1D_8_UP), "CHECK: stablehlo.dot_general", "CHECK: stablehlo.return",
                     "CHECK: stablehlo.concatenate", "CHECK-SAME: dim = 0",
                     "CHECK-SAME: (tensor<4x32xf32>, tensor<4x32xf32>) -> tensor<8x32xf32>",
                     "CHECK-NOT: stablehlo.reduce_scatter"]),
            Variant("UNROLL2", UNROLL2, unroll2_checks("reduce_scatter", PAIRS_1D_8, 3)),
            Variant("FULL", FULL, full_checks("reduce_scatter", 7, 8)),
            Variant("STREAMS", STREAMS, streams_checks("reduce_scatter")),
            Variant("HLO", HLO, hlo_checks())]),
    Sample("rs_dot_rows", "2x4 mesh, the product's rows (a free dim of the lhs) scattered over 'model'.",
           rs_on(0), "rewritten 1", rs_checks(PAIRS_2X4_MODEL, 3, "(tensor<8x16xf32>, tensor<16x32xf32>) -> tensor<8x32xf32>")),
    Sample("rs_dot_rhs", "2x4 mesh, the product's columns (a free dim of the rhs) scattered over 'model'.",
           rs_on(1), "rewritten 1", rs_checks(PAIRS_2X4_MODEL, 3, "(tensor<32x16xf32>, tensor<16x8xf32>) -> tensor<32x8xf32>")),
    Sample("rs_dot_bf16", "bf16 product summed and scattered in bf16 (the partial sum travels as bf16).",
           rs_on(0, jnp.bfloat16), "rewritten 1", rs_checks(PAIRS_2X4_MODEL, 3, "-> tensor<8x32xbf16>")),
    Sample("rs_dot_int32", "an integer product scattered (compared exactly).",
           rs_on(0, jnp.int32), "rewritten 1", rs_checks(PAIRS_2X4_MODEL, 3, "-> tensor<8x32xi32>")),
    Sample("rs_dot_sum", "psum_scatter(a @ wa + b @ wb + c @ wc): one ring over the sum, three dots per block.",
           rs_sum_of_dots, "rewritten 1",
           ["CHECK-NOT: stablehlo.reduce_scatter", "CHECK: } do {", 'CHECK: "stablehlo.collective_permute"',
            "CHECK: stablehlo.dot_general", "CHECK: stablehlo.dot_general", "CHECK: stablehlo.add",
            "CHECK: stablehlo.dot_general", "CHECK: stablehlo.add", "CHECK: stablehlo.add", "CHECK: stablehlo.return"]
           + gone("reduce_scatter")),
    Sample("rs_dot_untiled", "psum_scatter(tiled=False): reshape to [4, rows/4, cols] before the scatter, reshape after.",
           rs_untiled, "rewritten 1",
           rs_checks(PAIRS_2X4_MODEL, 3)[:-3] + ["CHECK-NEXT: stablehlo.reshape {{.*}} -> tensor<1x8x32xf32>",
                                                  "CHECK-NEXT: stablehlo.add"] + gone("reduce_scatter")),
    Sample("rs_dot_transpose", "the product is transposed before the scatter.",
           rs_transposed, "rewritten 1",
           rs_checks(PAIRS_2X4_MODEL, 3)[:-3] + ["CHECK-NEXT: stablehlo.transpose", "CHECK-NEXT: stablehlo.add"]
           + gone("reduce_scatter")),
    Sample("rs_dot_convert", "bf16 x bf16 -> f32 product cast to bf16 before the scatter.",
           rs_converted, "rewritten 1",
           rs_checks(PAIRS_2X4_MODEL, 3, "(tensor<8x16xbf16>, tensor<16x32xbf16>) -> tensor<8x32xf32>")),
    Sample("rs_dot_partial_manual", "partial-manual region: sharding constraints between dot and scatter and in its region.",
           rs_partial_manual, "rewritten 1",
           ["CHECK: manual_axes={\"data\"}"] + rs_checks(PAIRS_2X4_MODEL, 3)),
    Sample("rs_dot_batch", "the scattered dim is a batch dim of the dot: each block of the product slices that "
           "block of both operands' batch dims.",
           rs_batch_dim, "rewritten 1",
           ["CHECK-NOT: stablehlo.reduce_scatter", "CHECK: stablehlo.partition_id",
            "CHECK: stablehlo.dynamic_slice {{.*}} sizes = [2, 16, 16]",  # the peeled round's block
            "CHECK-NEXT: stablehlo.dynamic_slice {{.*}} sizes = [2, 16, 16]",
            "CHECK-NEXT: stablehlo.dot_general {{.*}} batching_dims = [0] x [0]",
            "CHECK-SAME: (tensor<2x16x16xf32>, tensor<2x16x16xf32>) -> tensor<2x16x16xf32>",
            *loop_checks(PAIRS_2X4_MODEL, 3),
            "CHECK: stablehlo.dynamic_slice {{.*}} sizes = [2, 16, 16]",
            "CHECK-NEXT: stablehlo.dynamic_slice {{.*}} sizes = [2, 16, 16]",
            "CHECK-NEXT: stablehlo.dot_general {{.*}} batching_dims = [0] x [0]",
            "CHECK-NEXT: stablehlo.add", "CHECK: stablehlo.return", "CHECK-NOT: stablehlo.reduce_scatter"]),

]
