"""One of the processes tests/test_multiprocess.py starts: ``python multiprocess_worker.py PORT
PROCESS_ID OUT_DIR`` joins a 2-process jax.distributed job of 4 CPU devices each (gloo
collectives over loopback) and runs a data x sequence-parallel training step under
``cmatmul_pass.jit``: with ``check=True``, with ``variant="measure"``, with a mismatch only
process 1 sees, and with a different program on process 1.  It writes what each gave to
OUT_DIR/process<ID>.json (and the outputs, gathered, to OUT_DIR/outputs<ID>.npz).

Imported (by the test), it only defines the step and its inputs, for the single-process run.
"""

import json
import os
import sys
from pathlib import Path

if __name__ == "__main__":  # before jax is imported
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

BATCH, SEQ, DIM, HIDDEN = 4, 16, 8, 16


def make_step(mesh: Mesh):
    """An SGD step of a sequence-parallel MLP block (gather the sequence, two matmuls, scatter it
    back) on a ("data", "model") mesh: returns the new weights and the block's output, sharded
    over both axes (so over both processes)."""

    def block(x, w1, w2):
        full = jax.lax.all_gather(x, "model", axis=1, tiled=True)
        h = jnp.tanh(full @ w1)
        return jax.lax.psum_scatter(h @ w2, "model", scatter_dimension=1, tiled=True)

    layer = jax.shard_map(block, mesh=mesh, in_specs=(P("data", "model"), P(None, "model"), P("model", None)),
                          out_specs=P("data", "model"), check_vma=False)

    def loss(params, x):
        y = layer(x, *params)
        return jnp.mean((y - x) ** 2), y

    def step(params, x):
        (value, y), grads = jax.value_and_grad(loss, has_aux=True)(params, x)
        return tuple(p - 0.1 * g for p, g in zip(params, grads)), y, value

    return step


def make_inputs(mesh: Mesh):
    rng = np.random.default_rng(0)
    values = [rng.normal(size=(DIM, HIDDEN)) / DIM**0.5, rng.normal(size=(HIDDEN, DIM)) / HIDDEN**0.5,
              rng.normal(size=(BATCH, SEQ, DIM))]
    specs = [P(None, "model"), P("model", None), P("data", "model")]
    arrays = [jax.make_array_from_callback(v.shape, NamedSharding(mesh, s), lambda i, v=v: v[i].astype(np.float32))
              for v, s in zip(values, specs)]
    return (arrays[0], arrays[1]), arrays[2]


def mesh_of(devices) -> Mesh:
    return Mesh(np.array(devices).reshape(2, 4), ("data", "model"))


def main(port: str, process_id: int, out: Path) -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import cmatmul_pass
    from cmatmul_pass import decorator, execute
    from jax.experimental import multihost_utils

    mesh = mesh_of(jax.devices())
    step = make_step(mesh)
    params, x = make_inputs(mesh)
    result: dict = {"process_index": jax.process_index(), "addressable": x.is_fully_addressable}

    checked = cmatmul_pass.jit(step, check=True)
    outputs = checked(params, x)
    result["check"] = {"ok": checked.checked.ok, "rewritten": len(checked.report.rewritten),
                       "checks": checked.stats["checks"]}
    np.savez(out / f"outputs{process_id}.npz", *multihost_utils.process_allgather(jax.tree.leaves(outputs), tiled=True))

    measured = cmatmul_pass.jit(step, variant="measure", measure_runs=2, check=True)
    again = measured(params, x)
    result["measure"] = {"picked": measured.picked, "times": measured.measured,
                         "noise": measured.measurement.noise, "processes": measured.measurement.processes,
                         "summary": measured.measurement.summary(), "ok": measured.checked.ok}
    np.savez(out / f"measured{process_id}.npz", *multihost_utils.process_allgather(jax.tree.leaves(again), tiled=True))

    # each process's clock favours another variant: the slowest process's times decide, for both
    real_medians = execute.interleaved_medians
    # process 0: uni 1 s, full 2 s; process 1: uni 4 s, full 1 s; the rest 3 s, the original 5 s
    clock = {"uni": 1.0, "full": 2.0} if process_id == 0 else {"uni": 4.0, "full": 1.0}

    def clock_of_this_process(programs, runs, warmup=1, prepare=None):
        return {name: clock.get(name, 5.0 if name == "original" else 3.0) for name in programs}

    execute.interleaved_medians = clock_of_this_process
    try:
        faked = cmatmul_pass.jit(step, variant="measure")
        faked(params, x)
        result["faked_measure"] = {"picked": faked.picked, "times": faked.measured}
    finally:
        execute.interleaved_medians = real_medians

    # a mismatch only process 1's shards show: every process must raise, none may hang
    real_compare = execute.compare

    def wrong_on_process_1(index, expected, actual, *args, **kwargs):
        c = real_compare(index, expected, actual, *args, **kwargs)
        if jax.process_index() == 1 and index == 0:
            return execute.OutputComparison(c.index, c.dtype, c.shape, 1.0, 1.0, c.tolerance or 1e-6, c.original_error)
        return c

    execute.compare = wrong_on_process_1
    try:
        cmatmul_pass.jit(step, check=True)(params, x)
        result["mismatch"] = None
    except cmatmul_pass.NumericsMismatch as exc:
        result["mismatch"] = str(exc)
    finally:
        execute.compare = real_compare

    # process 1 asks for another ring: the programs differ, every process must say so
    options = {"bidirectional": True} if process_id == 1 else {}
    try:
        cmatmul_pass.jit(step, **options)(params, x)
        result["different"] = None
    except decorator.DifferentPrograms as exc:
        result["different"] = str(exc)

    (out / f"process{process_id}.json").write_text(json.dumps(result))
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]))
