"""The programs tools/bench.py measures and the options it rewrites them under: the
sequence-parallel transformer and Megatron training steps (``MODELS``), with the rings written by
hand with ``ppermute`` that the run times and compile times are compared against.

Importing it sets XLA's CPU device count and the pass's policy (before jax and the pass load):
tools/bench.py and tools/bench_measure.py import it first.
"""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
# the models are sized for a CPU, far too small for the cost model to predict a ring faster on an
# H100: they are measured under policy "all", every ring built
os.environ.setdefault("CMATMUL_PASS_POLICY", "all")
ROOT = Path(__file__).resolve().parent.parent
#: where partial runs and the profile go by default: bench/ holds only the full run, results.json
SCRATCH = ROOT / "build" / "bench"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import cmatmul_pass  # noqa: E402
from cmatmul_pass import cost  # noqa: E402
from cmatmul_pass.pipeline import Options, variant_options  # noqa: E402

#: each ring variant, a psum of a matmul split (its reduce-scatter ring in that variant)
VARIANTS = {name: variant_options(name, all_reduce="split") for name in cost.VARIANTS}
#: the default but for its psums, every one split (the default's auto chunks where the two tie: cost.TIE)
SPLIT_PSUMS = Options(all_reduce="split")
#: the options ``cmatmul_pass.jit`` runs the pass with by default (``hardware="auto"``: jax's default
#: device's profile; on a CPU, which none describes, the fallbacks), where the CLI's are ``Options()``
JIT_OPTIONS = cmatmul_pass.jit(lambda x: x).options


# ---------------------------------------------------------------------------- the training steps, rings by hand
def gather_matmuls(h, weights, axis: str, n: int):
    """``[all_gather(h) @ w for w in weights]`` as a ring hand-written with ``ppermute`` in a
    ``fori_loop`` (the JAX shard_map docs' collective-matmul technique): each step multiplies
    the shard it holds and passes it on to the previous position."""
    index, rows = jax.lax.axis_index(axis), h.shape[0]
    pairs = [(j, (j - 1) % n) for j in range(n)]

    def place(outs, held, step):
        offset = ((index + step) % n) * rows
        return [jax.lax.dynamic_update_slice_in_dim(o, held @ w, offset, 0) for o, w in zip(outs, weights)]

    def body(step, carry):
        held, outs = carry
        return jax.lax.ppermute(held, axis, pairs), place(outs, held, step)

    outs = [jnp.zeros((rows * n, w.shape[1]), h.dtype) for w in weights]
    held, outs = jax.lax.fori_loop(0, n - 1, body, (h, outs))
    return place(outs, held, n - 1)


def matmul_scatter(a, w, axis: str, n: int):
    """``psum_scatter(a @ w, scatter_dimension=0)`` as a hand-written ring: in each step a
    position adds its product block to the partial sum it received and passes it on."""
    index, rows = jax.lax.axis_index(axis), a.shape[0] // n
    pairs = [(j, (j - 1) % n) for j in range(n)]

    def block(c):
        return jax.lax.dynamic_slice_in_dim(a, c * rows, rows) @ w

    def body(step, acc):
        return jax.lax.ppermute(acc, axis, pairs) + block((index + step + 2) % n)

    return jax.lax.fori_loop(0, n - 1, body, block((index + 1) % n))


def transformer_step(layers: int, hidden=64, ffn=128, tokens=64, hand_written: bool = False,
                     mesh_shape: tuple[int, int] = (2, 4), dtype=jnp.float32):
    """(function, args): value_and_grad of a loss over ``layers`` sequence-parallel TP blocks,
    on a ``("data", "model")`` mesh of ``mesh_shape`` (the rings run over "model").

    ``hand_written``: the same model with every all_gather → dots and dot → psum_scatter
    written as the ppermute rings users write by hand today (the reference for the compile
    time of the pass's output)."""
    mesh = jax.make_mesh(mesh_shape, ("data", "model"))
    rows = P(("data", "model"), None)
    n = mesh.shape["model"]

    def gathered(h, *ws):
        if hand_written:
            return gather_matmuls(h, ws, "model", n)
        g = jax.lax.all_gather(h, "model", axis=0, tiled=True)
        return [g @ w for w in ws]

    def scattered(a, w):
        if hand_written:
            return matmul_scatter(a, w, "model", n)
        return jax.lax.psum_scatter(a @ w, "model", scatter_dimension=0, tiled=True)

    def block(h, wq, wk, wv, wo, w1, w3, w2):
        q, k, v = gathered(h, wq, wk, wv)
        a = jax.nn.softmax(q * k, axis=-1) * v  # a cheap stand-in for attention, per head slice
        h = h + scattered(a, wo)
        g1, g3 = gathered(h, w1, w3)
        return h + scattered(jax.nn.silu(g1) * g3, w2)

    col, row = P(None, "model"), P("model", None)
    smap = jax.shard_map(block, mesh=mesh, in_specs=(rows, col, col, col, row, col, col, row), out_specs=rows,
                         check_vma=not hand_written)

    def loss(params, x):
        h = x
        for p in params:
            h = smap(h, *p)
        return jnp.mean(h.astype(jnp.float32) ** 2)

    shapes = [(hidden, hidden), (hidden, hidden), (hidden, hidden), (hidden, hidden), (hidden, ffn), (hidden, ffn), (ffn, hidden)]
    specs = [col, col, col, row, col, col, row]
    params = [[jax.ShapeDtypeStruct(s, dtype, sharding=NamedSharding(mesh, sp)) for s, sp in zip(shapes, specs)]
              for _ in range(layers)]
    x = jax.ShapeDtypeStruct((tokens, hidden), dtype, sharding=NamedSharding(mesh, rows))
    return jax.jit(jax.value_and_grad(loss)), (params, x)


def megatron_step(layers: int, hidden=64, ffn=128, tokens=64, mesh_shape: tuple[int, int] = (2, 4),
                  dtype=jnp.float32):
    """(function, args): value_and_grad of a loss over ``layers`` Megatron blocks without sequence
    parallelism on a ``("data", "model")`` mesh: the rows split over "data" only, replicated over
    "model"; attention projections and a SwiGLU MLP, each ending in ``psum(... @ w, "model")``
    after a pre-norm, with residual adds (the psum-after-matmul sites: 4 per layer forward,
    and the backward's)."""
    mesh = jax.make_mesh(mesh_shape, ("data", "model"))
    rows = P("data", None)

    def norm(h):
        return h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6)

    def block(h, wq, wk, wv, wo, w1, w3, w2):
        x = norm(h)
        q, k, v = x @ wq, x @ wk, x @ wv
        a = jax.nn.softmax(q * k, axis=-1) * v
        h = h + jax.lax.psum(a @ wo, "model")
        x = norm(h)
        return h + jax.lax.psum((jax.nn.silu(x @ w1) * (x @ w3)) @ w2, "model")

    col, row = P(None, "model"), P("model", None)
    smap = jax.shard_map(block, mesh=mesh, in_specs=(rows, col, col, col, row, col, col, row), out_specs=rows)

    def loss(params, x):
        h = x
        for p in params:
            h = smap(h, *p)
        return jnp.mean(h.astype(jnp.float32) ** 2)

    shapes = [(hidden, hidden)] * 4 + [(hidden, ffn), (hidden, ffn), (ffn, hidden)]
    specs = [col, col, col, row, col, col, row]
    params = [[jax.ShapeDtypeStruct(s, dtype, sharding=NamedSharding(mesh, sp)) for s, sp in zip(shapes, specs)]
              for _ in range(layers)]
    x = jax.ShapeDtypeStruct((tokens, hidden), dtype, sharding=NamedSharding(mesh, rows))
    return jax.jit(jax.value_and_grad(loss)), (params, x)


MODELS = {"sequence_parallel": transformer_step, "megatron": megatron_step}


def hand_written_ring(mesh, axis: str):
    """A column-parallel layer as a ppermute ring written by hand (the shard_map docs' technique):
    each step multiplies the shard it holds and passes it on, n-1 permutes, unrolled in Python."""
    n = mesh.shape[axis]

    def body(x, w):
        index = jax.lax.axis_index(axis)
        rows = x.shape[0]
        out = jnp.zeros((rows * n, w.shape[1]), x.dtype)
        held = x
        for step in range(n):
            block = (index + step) % n
            out = jax.lax.dynamic_update_slice_in_dim(out, held @ w, block * rows, 0)
            if step < n - 1:
                held = jax.lax.ppermute(held, axis, [(j, (j - 1) % n) for j in range(n)])
        return out

    return body


def hand_written_scatter(mesh, axis: str):
    """A row-parallel layer (``psum_scatter(x @ w)`` over rows) as a ppermute ring written by hand,
    unrolled in Python as the shard_map docs write theirs: each step adds this device's product
    block for the partial sum it holds and passes the sum on; after n-1 permutes the sum a device
    holds is its own block's."""
    n = mesh.shape[axis]

    def body(x, w):
        index = jax.lax.axis_index(axis)
        rows = x.shape[0] // n
        pairs = [(j, (j - 1) % n) for j in range(n)]

        def block(step):  # the block the partial sum held at ``step`` is for
            return jax.lax.dynamic_slice_in_dim(x, ((index + step + 1) % n) * rows, rows) @ w

        acc = block(0)
        for step in range(1, n):
            acc = jax.lax.ppermute(acc, axis, pairs) + block(step)
        return acc

    return body
