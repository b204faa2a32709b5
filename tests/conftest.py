"""8 virtual CPU devices for every test: must be set before jax is imported."""

import os
import sys
from pathlib import Path

flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tools/ helpers (golden blocks, sample metadata)

import pytest  # noqa: E402

from tools.golden import expectation, sample_paths  # noqa: E402

SAMPLES = sample_paths(ROOT)
POSITIVE = [p for p in SAMPLES if expectation(p.read_text())[0] == "rewritten"]
NEGATIVE = [p for p in SAMPLES if expectation(p.read_text())[0] == "unchanged"]


def run_cli(*argv) -> int:
    """``python -m cmatmul_pass ARGV`` in-process; returns the exit code."""
    from cmatmul_pass import cli

    return cli.main([str(a) for a in argv])


def sample(name: str) -> Path:
    return ROOT / "hlo_samples" / f"{name}.mlir"


@pytest.fixture
def sample_text():
    return lambda name: sample(name).read_text()
