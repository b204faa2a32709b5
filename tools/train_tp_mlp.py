#!/usr/bin/env python
"""Training parity: a tensor-parallel MLP classifier under jax.jit and under cmatmul_pass.jit.

The founding notebook's experiment, on a 2x4 (data x model) mesh of CPU devices: an embedding, two
sequence-parallel MLP blocks written with plain ``all_gather`` / ``psum_scatter`` inside
``jax.shard_map`` (the non-async baseline), a classification head, optax AdamW, a synthetic task.
The same train step runs twice from the same seeds — once under ``jax.jit``, once under
``cmatmul_pass.jit`` — and the script prints both loss curves, the final accuracies and the pass's
report (every forward and backward gather/scatter rewritten).

``--megatron`` writes the blocks as Megatron does without sequence parallelism: rows split over
'data' only, each block ``psum(gelu(h @ w1) @ w2, 'model')``; the pass rewrites every psum of a
matmul (forward and backward) in the default strategy (on a CPU, which no cost profile describes,
two chunks each; ``all_reduce="split"`` would make each a reduce-scatter ring and a gather).

    python tools/train_tp_mlp.py [--steps 20] [--bidirectional] [--unroll 2] [--variant auto] [--megatron]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import cmatmul_pass  # noqa: E402

BATCH, FEATURES, HIDDEN, FFN, CLASSES, BLOCKS = 64, 16, 32, 64, 4, 2
ROWS = P(("data", "model"), None)  # activations: rows split over both mesh axes (sequence parallel)


def make_mesh():
    return jax.make_mesh((2, 4), ("data", "model"))


def sp_block(h, w1, w2):
    """One sequence-parallel MLP block on a shard: gather rows over 'model', column- then row-parallel
    matmuls, sum-scatter the rows back; residual outside."""
    g = jax.lax.all_gather(h, "model", axis=0, tiled=True)
    u = jax.nn.gelu(g @ w1)
    return jax.lax.psum_scatter(u @ w2, "model", scatter_dimension=0, tiled=True)


def megatron_block(h, w1, w2):
    """One Megatron MLP block on a shard: the rows replicated over 'model', column- then row-parallel
    matmuls, the product summed over 'model'."""
    return jax.lax.psum(jax.nn.gelu(h @ w1) @ w2, "model")


def model_fn(mesh, megatron: bool = False):
    rows, body = (P("data", None), megatron_block) if megatron else (ROWS, sp_block)
    block = jax.shard_map(body, mesh=mesh, in_specs=(rows, P(None, "model"), P("model", None)), out_specs=rows)

    def apply(params, x):
        h = x @ params["embed"]
        for w1, w2 in params["blocks"]:
            h = h + block(h, w1, w2)
        return h @ params["head"]

    return apply


def init(mesh, seed, megatron: bool = False):
    keys = jax.random.split(jax.random.key(seed), 2 + 2 * BLOCKS + 2)
    scale = lambda fan_in: 1.0 / np.sqrt(fan_in)  # noqa: E731
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
    params = {
        "embed": put(jax.random.normal(keys[0], (FEATURES, HIDDEN)) * scale(FEATURES), P()),
        "blocks": [
            (
                put(jax.random.normal(keys[2 + 2 * i], (HIDDEN, FFN)) * scale(HIDDEN), P(None, "model")),
                put(jax.random.normal(keys[3 + 2 * i], (FFN, HIDDEN)) * scale(FFN), P("model", None)),
            )
            for i in range(BLOCKS)
        ],
        "head": put(jax.random.normal(keys[1], (HIDDEN, CLASSES)) * scale(HIDDEN), P()),
    }
    x = jax.random.normal(keys[-2], (BATCH, FEATURES))
    teacher = jax.random.normal(keys[-1], (FEATURES, CLASSES))
    y = jnp.argmax(jnp.tanh(x @ teacher) + 0.1 * x[:, :CLASSES], axis=-1)
    rows = P("data", None) if megatron else ROWS
    return params, put(x, rows), put(y, P(rows[0]))


def make_step(apply, optimizer):
    def loss_fn(params, x, y):
        logits = apply(params, x)
        # one-hot rather than optax's integer-label gather: with jax >= 0.11's sharding in types, the
        # gather's gradient (a scatter into the batch-sharded logits) has no unambiguous sharding
        return optax.softmax_cross_entropy(logits, jax.nn.one_hot(y, CLASSES)).mean()

    def train_step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step


def train(jit, steps: int = 20, seed: int = 0, megatron: bool = False):
    """Train with ``jit`` (jax.jit or a cmatmul_pass.jit variant); returns (losses, accuracy, step_fn)."""
    mesh = make_mesh()
    apply = model_fn(mesh, megatron)
    optimizer = optax.adamw(3e-3, weight_decay=1e-4)
    params, x, y = init(mesh, seed, megatron)
    opt_state = optimizer.init(params)
    step = jit(make_step(apply, optimizer), donate_argnums=(0, 1))
    losses = []
    for _ in range(steps):
        params, opt_state, loss = step(params, opt_state, x, y)
        losses.append(float(loss))
    accuracy = float(jnp.mean(jnp.argmax(jax.jit(apply)(params, x), -1) == y))
    return losses, accuracy, step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--bidirectional", action="store_true")
    parser.add_argument("--unroll", choices=["1", "2", "full"])
    parser.add_argument("--variant", help="a ring variant by name, or auto (instead of the two above)")
    parser.add_argument("--megatron", action="store_true", help="Megatron blocks (psum), no sequence parallelism")
    args = parser.parse_args(argv)
    unroll = None if args.unroll is None else "full" if args.unroll == "full" else int(args.unroll)

    def ours(fun, **kw):
        return cmatmul_pass.jit(fun, bidirectional=args.bidirectional or None, unroll=unroll, variant=args.variant, **kw)

    base, base_acc, _ = train(jax.jit, args.steps, megatron=args.megatron)
    mine, mine_acc, step = train(ours, args.steps, megatron=args.megatron)
    print(f"{'step':>4}  {'jax.jit loss':>14}  {'cmatmul_pass.jit loss':>22}  {'rel diff':>9}")
    for i, (a, b) in enumerate(zip(base, mine)):
        print(f"{i:>4}  {a:>14.6f}  {b:>22.6f}  {abs(a - b) / abs(a):>9.2e}")
    print(f"final accuracy: jax.jit {base_acc:.3f}, cmatmul_pass.jit {mine_acc:.3f}")
    print(step.report.summary())
    for site in step.report.sites:
        print("  " + site.summary_line())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
