"""The environment a GPU tool sets before jax starts a backend: the XLA flags the rings need on a
GPU, and a mocked 8-GPU topology on one GPU (or that many virtual CPU devices).

``tools/bench.py`` and ``tools/gpu_topology.py`` both import it; neither imports the other for it.
"""

from __future__ import annotations

import os

#: XLA flags docs/variants.md's "On a GPU" section names: annotated calls become async computations
#: on their own streams; the latency-hiding scheduler places work between a start and its done.
GPU_XLA_FLAGS = "--xla_gpu_experimental_stream_annotation=true --xla_gpu_enable_latency_hiding_scheduler=true"
#: Sharded autotuning splits the GEMM autotuning among the processes and waits for the others'
#: results: with mocked processes nobody answers and the compile hangs (seen with jax 0.11.2).
MOCK_XLA_FLAGS = "--xla_gpu_shard_autotuning=false"


def configure_environment(platform: str, devices: int, extra_flags: str = "", readme_flags: bool = True) -> None:
    """Before jax starts a backend: mock a ``devices``-GPU topology (gpu: one slice of
    ``devices`` hosts with one GPU each; ``jax_mock_gpu_topology`` is a config option jax does
    not read from the environment), or ask for that many virtual CPU devices (cpu); add the GPU
    scheduling flags."""
    flags = f'{os.environ.get("XLA_FLAGS", "")} {extra_flags}'.strip()
    if platform == "gpu":
        os.environ["XLA_FLAGS"] = f"{flags} {GPU_XLA_FLAGS if readme_flags else ''} {MOCK_XLA_FLAGS}".strip()
        import jax

        jax.config.update("jax_mock_gpu_topology", f"1x{devices}x1")
    else:
        os.environ["JAX_PLATFORMS"] = "cpu"
        if "xla_force_host_platform_device_count" not in flags:
            os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
