"""Context-parallel attention programs, written as public JAX code writes them: the sequence
sharded over a mesh axis, K and V all-gathered along it before ordinary attention (causal or
not, grouped-query heads, segment ids, bf16 inputs with an f32 softmax), forward and training
step; and a contrastive loss over negatives gathered the same way, with its gradient.  The samples
of tools/gen_samples.py and the attention and column-passes tests draw them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from tools.samples_common import Sample, arg, gather, lower, mesh_1d, smap

AXIS = "context"


def attention(q, k, v, *, causal=True, segments=None, softmax=jax.nn.softmax, after=None, dpa=False,
              key_padding=False):
    """One device's attention: q ``[b, s_local, heads, d]``, k and v ``[b, s_local, kv_heads, d]``,
    the keys and values gathered over the context axis; ``segments``: (the queries' ids, the
    keys' ids gathered) masking across documents; ``after``: an op applied to the probabilities;
    ``dpa``: ``jax.nn.dot_product_attention``'s XLA implementation instead of the einsums;
    ``key_padding``: keys that are all zero masked, a mask read from the gathered keys."""
    kg, vg = gather(k, AXIS, 1), gather(v, AXIS, 1)
    mask = None
    if causal:
        s_local = q.shape[1]
        q_pos = jax.lax.axis_index(AXIS) * s_local + jnp.arange(s_local)
        mask = q_pos[:, None] >= jnp.arange(kg.shape[1])[None, :]
    if segments is not None:
        q_seg, k_seg = segments
        same = q_seg[:, None, :, None] == k_seg[:, None, None, :]
        mask = same if mask is None else same & mask[None, None]
    if key_padding:
        real = ~jnp.all(kg == 0, axis=(2, 3))[:, None, None, :]
        mask = real if mask is None else real & mask
    if dpa:
        return jax.nn.dot_product_attention(q, kg, vg, mask=mask, implementation="xla")
    repeat = q.shape[2] // kg.shape[2]
    kg, vg = jnp.repeat(kg, repeat, axis=2), jnp.repeat(vg, repeat, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, kg).astype(jnp.float32) / np.sqrt(q.shape[-1]).astype(np.float32)
    if mask is not None:
        s = jnp.where(mask, s, -jnp.inf)
    p = softmax(s, axis=-1)
    if after is not None:
        p = after(p)
    return jnp.einsum("bhqk,bkhd->bqhd", p.astype(v.dtype), vg)


def dropout(keep_value=None, where=True, rate=0.25):
    """Dropout of the probabilities, the key folded with the device's index (each device its own
    mask): ``jnp.where(keep, p / (1 - rate), 0)``, or (``where=False``) ``p * keep / (1 - rate)``;
    ``keep_value``: what dropped entries take instead of zero (not linear in ``p`` then)."""
    def drop(p):
        key = jax.random.fold_in(jax.random.key(0), jax.lax.axis_index(AXIS))
        keep = jax.random.bernoulli(key, 1 - rate, p.shape)
        if not where:
            return p * keep.astype(p.dtype) / (1 - rate)
        return jnp.where(keep, p / (1 - rate), 0.0 if keep_value is None else keep_value)
    return drop


def cp_attention(causal=True, heads=4, kv_heads=2, dtype=jnp.bfloat16, segments=False, grad=False, remat=False,
                 n=8, batch=2, seq=64, head_dim=16, **kw):
    """The lowered program: forward, or (``grad``) value_and_grad of a squared-output loss in
    q, k and v (``remat``: the attention under jax.checkpoint)."""
    mesh = mesh_1d(n, AXIS)
    spec = P(None, AXIS)

    def local(q, k, v, seg):
        segs = (seg, gather(seg, AXIS, 1)) if segments else None
        return attention(q, k, v, causal=causal, segments=segs, **kw)

    body = jax.checkpoint(local) if remat else local
    f = smap(body, mesh=mesh, in_specs=(spec, spec, spec, spec), out_specs=spec)
    args = [arg(mesh, (batch, seq, heads, head_dim), spec, dtype), arg(mesh, (batch, seq, kv_heads, head_dim), spec, dtype),
            arg(mesh, (batch, seq, kv_heads, head_dim), spec, dtype), arg(mesh, (batch, seq), spec, jnp.int32)]
    if grad:
        def loss(q, k, v, seg):
            return jnp.sum(jnp.square(f(q, k, v, seg).astype(jnp.float32)))

        return lower(jax.value_and_grad(loss, argnums=(0, 1, 2)), *args)
    return lower(f, *args)


def contrastive(temperature=0.1, *, returns_logits=False, nonzero_init=False, flipped=False, max_dims=1,
                between=None, n=8, rows=16, dim=8) -> str:
    """An InfoNCE loss over negatives all-gathered along the batch (each device's queries against
    every device's keys) and its gradient, both inside the shard_map (the gather's transpose a
    psum_scatter of dK): log-sum-exp over the gathered keys (``max_dims``: what the max reduces;
    ``between``: an op on the row max before it is subtracted), the positive read with a one-hot
    from positions (``flipped``: both reversed along the keys); ``nonzero_init``: a diagnostic sum
    over the keys from 1; ``returns_logits``: the logits returned too."""
    mesh = mesh_1d(n, AXIS)
    spec = P(AXIS)

    def loss_of(q, k):
        kg = gather(k, AXIS, 0)
        logits = q @ kg.T / temperature
        top = jax.lax.stop_gradient(jnp.max(logits, axis=max_dims, keepdims=True))
        top = top if between is None else between(top)
        lse = jnp.log(jnp.sum(jnp.exp(logits - top), axis=1)) + top[:, 0]
        labels = jax.lax.axis_index(AXIS) * q.shape[0] + jnp.arange(q.shape[0])
        onehot = labels[:, None] == jnp.arange(kg.shape[0])[None, :]
        if flipped:
            onehot, scores = jnp.flip(onehot, axis=1), jnp.flip(logits, axis=1)
        else:
            scores = logits
        loss = jnp.mean(lse - jnp.sum(jnp.where(onehot, scores, 0.0), axis=1))
        if nonzero_init:
            spread = jax.lax.reduce(jax.lax.stop_gradient(jnp.exp(logits - top)), np.float32(1.0), jax.lax.add, (1,))
            loss = loss + 1e-3 * jnp.mean(spread)
        return loss, logits

    def local(q, k):
        (loss, logits), (dq, dk) = jax.value_and_grad(loss_of, argnums=(0, 1), has_aux=True)(q, k)
        return (loss[None], dq, dk, logits) if returns_logits else (loss[None], dq, dk)

    f = smap(local, mesh=mesh, in_specs=(spec, spec), out_specs=(spec,) * (4 if returns_logits else 3))
    return lower(f, arg(mesh, (n * rows, dim), spec), arg(mesh, (n * rows, dim), spec))


SAMPLES_LIST = [
    Sample("attn_cp", "context-parallel causal attention with grouped-query heads (4 query heads, 2 KV heads), bf16 "
           "inputs and an f32 softmax, K and V all-gathered over the sequence: one ring of K and V blocks with an "
           "online softmax (running max, sum and output per query row), the causal mask read at each block's "
           "columns; the scores never whole.",
           cp_attention, "rewritten 1",
           ["CHECK-NOT: stablehlo.all_gather", "CHECK: stablehlo.while", "CHECK: stablehlo.collective_permute",
            "CHECK: stablehlo.collective_permute", "CHECK: stablehlo.exponential",
            "CHECK-NOT: stablehlo.all_gather"]),
    Sample("attn_cp_grad", "value_and_grad of attn_cp: the forward's probabilities and gathered K and V are the "
           "backward's residuals, which an online softmax never holds whole: the attention keeps two rings "
           "(scores with K's blocks, P·V with V's), the keys' gather saying why [attn_residual]; the backward's "
           "gradient scatters ring too.",
           lambda: cp_attention(grad=True), "rewritten 4",
           ["CHECK-NOT: stablehlo.all_gather", "CHECK-NOT: stablehlo.reduce_scatter"]),
    Sample("attn_cp_remat_grad", "value_and_grad of attn_cp under jax.checkpoint: the forward is one ring with "
           "an online softmax; the backward recomputes the scores from K and V gathered again and scatters dK and "
           "dV back: two passes of rings over the K and V blocks, the first taking the scores' max and the sums "
           "it rescales (the softmax's, and the gradient's sum of dP·e with 1/l² taken out of it), the second dQ "
           "with dK and dV travelling home with their blocks; no score matrix whole.",
           lambda: cp_attention(grad=True, remat=True), "rewritten 2",
           ["CHECK-NOT: stablehlo.all_gather", "CHECK: stablehlo.while", "CHECK: stablehlo.maximum",
            "CHECK: stablehlo.while", "CHECK: stablehlo.collective_permute", "CHECK-NOT: stablehlo.reduce_scatter"]),
    Sample("contrastive_grad", "an InfoNCE loss over negatives all-gathered along the batch and its gradient, "
           "both inside the shard_map (the gather's transpose a psum_scatter of dK): the log-sum-exp over the "
           "gathered keys is a max and a sum, read back by the gradient; two passes of rings over the key "
           "blocks, the max and the sum it rescales, then dQ with dK travelling home with its blocks.",
           contrastive, "rewritten 1",
           ["CHECK-NOT: stablehlo.all_gather", "CHECK: stablehlo.while", "CHECK: stablehlo.while",
            "CHECK-NOT: stablehlo.reduce_scatter"]),
    Sample("neg_cols_region", "contrastive_grad returning its logits too: a value spanning the gathered keys is read "
           "after the region, so its passes would have to hold it whole [cols_region]; the gather and the scatter "
           "keep rings of their own.",
           lambda: contrastive(returns_logits=True), "rewritten 2",
           ["CHECK-NOT: stablehlo.all_gather", "CHECK-NOT: stablehlo.reduce_scatter"]),
    Sample("neg_attn_softmax", "attention over gathered K and V whose probabilities go through a square root "
           "before P·V: not linear in them, so the division by the row sum cannot wait for the ring's end "
           "[attn_softmax]; the scores and P·V keep a ring each.",
           lambda: cp_attention(after=jnp.sqrt), "rewritten 2",
           ["CHECK-NOT: stablehlo.all_gather", "CHECK: stablehlo.sqrt"]),
]
