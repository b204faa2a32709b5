"""cmatmul_pass.jit over two processes (jax.distributed, 2 x 4 CPU devices, gloo over loopback):
check=True and variant="measure" on a training step whose outputs span both processes agree with
the single-process run, every process reaches the same verdict and keeps the same program, and a
mismatch or a different program on one process raises on both (tests/multiprocess_worker.py)."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

import multiprocess_worker as worker

WORKER = Path(worker.__file__)
TIMEOUT_S = 240  # the pair takes ~30 s on a loaded 2-core machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """Both children's JSON results and gathered outputs; both killed (and the test failed with
    their stderr) if they run past TIMEOUT_S or either exits with an error."""
    out = tmp_path_factory.mktemp("multiprocess")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    port = free_port()
    logs = [open(out / f"stderr{i}.txt", "w+") for i in range(2)]
    children = [subprocess.Popen([sys.executable, str(WORKER), str(port), str(i), str(out)], env=env,
                                 stdout=logs[i], stderr=subprocess.STDOUT) for i in range(2)]
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while any(c.poll() is None for c in children) and time.monotonic() < deadline:
            if any(c.poll() not in (None, 0) for c in children):
                break  # one failed: the other may wait for it forever
            time.sleep(0.2)
    finally:
        timed_out = any(c.poll() is None for c in children)
        for c in children:
            if c.poll() is None:
                c.kill()
            c.wait()
        text = []
        for i, log in enumerate(logs):
            log.seek(0)
            lines = [line for line in log.read().splitlines() if not line.startswith("[Gloo]")]
            text.append(f"--- process {i} (exit {children[i].returncode}) ---\n" + "\n".join(lines[-40:]))
            log.close()
    if timed_out or any(c.returncode != 0 for c in children):
        pytest.fail(("timed out after %d s\n" % TIMEOUT_S if timed_out else "") + "\n".join(text))
    results = [json.loads((out / f"process{i}.json").read_text()) for i in range(2)]
    arrays = {name: [np.load(out / f"{name}{i}.npz") for i in range(2)] for name in ("outputs", "measured")}
    return results, arrays


def single_process_outputs():
    mesh = worker.mesh_of(jax.devices()[:8])
    params, x = worker.make_inputs(mesh)
    return [np.asarray(leaf) for leaf in jax.tree.leaves(jax.jit(worker.make_step(mesh))(params, x))]


def test_check_and_measure_agree_with_the_single_process_step(two_processes):
    results, arrays = two_processes
    expected = single_process_outputs()
    for name in ("outputs", "measured"):
        for per_process in arrays[name]:
            got = [per_process[f"arr_{i}"] for i in range(len(per_process.files))]
            assert len(got) == len(expected)
            for g, e in zip(got, expected):
                np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)
    for r in results:
        assert r["addressable"] is False  # the batch spans both processes
        assert r["check"] == {"ok": True, "rewritten": r["check"]["rewritten"], "checks": 1}
        assert r["check"]["rewritten"] > 0 and r["measure"]["ok"] is True


def test_every_process_keeps_the_same_measured_program(two_processes):
    results, _ = two_processes
    first, second = (r["measure"] for r in results)
    assert first["processes"] == second["processes"] == 2
    assert first["picked"] == second["picked"] and first["times"] == second["times"]
    assert first["noise"] == second["noise"] and first["summary"] == second["summary"]
    # process 0's clock says uni, process 1's full: each candidate's slowest process decides
    assert [r["faked_measure"]["picked"] for r in results] == ["full", "full"]
    assert results[0]["faked_measure"]["times"]["uni"] == 4.0  # (alone, process 0 would pick uni)


def test_a_mismatch_on_one_process_raises_on_every_process(two_processes):
    results, _ = two_processes
    for r in results:
        assert r["mismatch"] is not None and "on 1 of 2 processes (process 1: output 0" in r["mismatch"]


def test_different_programs_on_the_processes_raise_on_every_process(two_processes):
    results, _ = two_processes
    for r in results:
        assert r["different"] is not None and "process(es) [1] compiled a different program" in r["different"]
