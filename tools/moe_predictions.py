"""The cost model's predictions for expert-parallel MoE layers on 8 GPUs: a capacity-padded
SwiGLU MoE block (top-k routing, one-hot dispatch and combine, the slots exchanged with
``all_to_all`` over 8 devices, each device's experts' gate, up and down matmuls), its training
step (value_and_grad over the tokens and the experts' weights) lowered at published models'
shapes for these CPU devices (never run) and rewritten with ``--chunks`` unset: each pair's
serial time (dispatch + experts' matmuls + combine) against the best of 2, 4 and 8 chunks
pipelined (``cmatmul_pass.exchanges``), the forward's pair and the backward's.

    python tools/moe_predictions.py [--hardware h100] [--tokens 4096]

Prints a markdown table (docs/performance.md holds the latest).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import cmatmul_pass  # noqa: E402
from cmatmul_pass.cost import readable_seconds  # noqa: E402

#: name -> (hidden, expert ffn, experts, top-k)
MODELS = {
    "Mixtral-8x7B-like": (4096, 14336, 8, 2),
    "Qwen3-235B-A22B-like": (4096, 1536, 128, 8),
    "DeepSeek-V3-like": (7168, 2048, 256, 8),
}
DEVICES = 8


def moe_layer(hidden: int, ffn: int, experts: int, top_k: int, tokens: int, grad: bool) -> str:
    """The layer's program (module docstring), ``tokens`` per device, capacity factor 1."""
    mesh = jax.make_mesh((DEVICES,), ("expert",))
    capacity = max(tokens * top_k // experts, 1)

    def block(x, router, w_gate, w_up, w_down):
        _, ids = jax.lax.top_k(x @ router, top_k)
        onehot = jax.nn.one_hot(ids, experts, dtype=x.dtype).sum(1)
        slot = ((jnp.cumsum(onehot, 0) - 1) * onehot).astype(jnp.int32)
        disp = onehot[:, :, None] * jax.nn.one_hot(slot, capacity, dtype=x.dtype)
        y = jax.lax.all_to_all(jnp.einsum("tec,th->ech", disp, x), "expert", 0, 1, tiled=True)
        h = jax.nn.silu(jnp.einsum("ech,ehf->ecf", y, w_gate)) * jnp.einsum("ech,ehf->ecf", y, w_up)
        back = jax.lax.all_to_all(jnp.einsum("ecf,efh->ech", h, w_down), "expert", 1, 0, tiled=True)
        return jnp.einsum("tec,ech->th", disp, back)

    specs = (P("expert"), P(), P("expert"), P("expert"), P("expert"))
    fn = jax.shard_map(block, mesh=mesh, in_specs=specs, out_specs=P("expert"), check_vma=False)
    if grad:
        layer = fn

        def fn(x, router, *w):  # the tokens' gradient too: the backward's pair exchanges it back
            return jax.value_and_grad(lambda x, *w: jnp.mean(layer(x, router, *w).astype(jnp.float32) ** 2),
                                      argnums=(0, 1, 2, 3))(x, *w)
    shapes = [(tokens * DEVICES, hidden), (hidden, experts), (experts, hidden, ffn), (experts, hidden, ffn),
              (experts, ffn, hidden)]
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=NamedSharding(mesh, sp)) for s, sp in zip(shapes, specs)]
    return jax.jit(fn).lower(*args).as_text()


def rows(hardware: str, tokens: int) -> list[str]:
    lines = ["| model (hidden, expert ffn, experts, top-k) | pair | exchanges | experts' matmuls | serial | "
             "chunked (k) | speed-up |", "|---|---|---|---|---|---|---|"]
    for name, (hidden, ffn, experts, top_k) in MODELS.items():
        text = moe_layer(hidden, ffn, experts, top_k, tokens, grad=True)
        result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(policy="all", hardware=hardware))
        pairs = [s for s in result.report.sites if s.kind == "all_to_all_chunk" and s.all_to_all.get("prediction")]
        for index, site in enumerate(pairs):
            p = site.all_to_all["prediction"]
            k = site.all_to_all["chunks"]
            chunked = p["chunks_s"][str(k)]
            lines.append(
                f"| {name} ({hidden}, {ffn}, {experts}, {top_k}) | {'forward' if index == 0 else 'backward'} | "
                f"{readable_seconds(p['dispatch_s'] + p['combine_s'])} | {readable_seconds(p['compute_s'])} | "
                f"{readable_seconds(p['serial_s'])} | {readable_seconds(chunked)} ({k}) | {p['serial_s'] / chunked:.2f}x |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hardware", default="h100")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per device")
    args = parser.parse_args(argv)
    print("\n".join(rows(args.hardware, args.tokens)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
