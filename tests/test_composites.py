"""A module lowered for GPU holds ``ragged_dot`` as ``chlo.ragged_dot`` (``jax.jit(...).lower``
there) or as a ``stablehlo.composite "chlo.ragged_dot"`` (``jax.export(..., platforms=["cuda"])``),
which XLA:CPU cannot compile (no ``ragged-dot``): ``check`` runs such a module on CPU through
each composite's decomposition and jax's CPU lowering of each ``chlo.ragged_dot``
(``cpu_copy.for_cpu``)."""

import jax
import jax.numpy as jnp
import numpy as np
from jax import export
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from cmatmul_pass import cpu_copy, execute, ir_utils
from tests.conftest import run_cli


def gpu_moe_module() -> str:
    """A gathered-rows projection into a grouped matmul over experts (the expert weights'
    columns split over 'model'), exported for cuda."""
    mesh = Mesh(np.array(jax.devices()[:8]), ("model",))

    def body(x, w, experts, group_sizes):
        h = jax.lax.all_gather(x, "model", axis=0, tiled=True) @ w
        return jax.lax.ragged_dot(h, experts, group_sizes)

    f = jax.shard_map(body, mesh=mesh, in_specs=(P("model"), P(None, "model"), P(None, None, "model"), P()),
                      out_specs=P(None, "model"), check_vma=False)

    def spec(shape, sharding, dtype=jnp.float32):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, sharding))

    args = (spec((64, 32), P("model")), spec((32, 64), P(None, "model")), spec((4, 8, 64), P(None, None, "model")),
            spec((4,), P(), jnp.int32))
    return export.export(jax.jit(f), platforms=["cuda"])(*args).mlir_module()


def test_the_copy_calls_each_decomposition_and_computes_the_same():
    module = ir_utils.parse(gpu_moe_module())
    before = str(module)
    copy = cpu_copy.for_cpu(module)
    assert str(module) == before  # the module itself is only read
    assert not ir_utils.ops_named(copy.operation, "stablehlo.composite")["stablehlo.composite"]
    (call,) = [c for c in ir_utils.ops_named(copy.operation, "func.call")["func.call"]
               if "ragged_dot" in str(c.operation.attributes["callee"])]
    assert copy.operation.verify()
    plain = ir_utils.parse(jax.jit(lambda x, w, g: jax.lax.ragged_dot(x, w, g)).lower(
        jnp.zeros((16, 8)), jnp.zeros((2, 8, 4)), jnp.zeros((2,), jnp.int32)).as_text())
    assert cpu_copy.for_cpu(plain) is plain  # nothing to replace: the module itself


def test_check_runs_a_gpu_lowered_grouped_matmul_module_on_cpu(tmp_path, capsys):
    path = tmp_path / "moe_cuda.mlir"
    path.write_text(gpu_moe_module())
    assert run_cli("check", "--policy", "all", path) == 0
    captured = capsys.readouterr()
    assert "numerics: OK" in captured.out and "rewritten ring=8" in captured.err, captured


def test_the_decomposition_runs_the_grouped_matmul_numbers():
    """The copy run on CPU gives ragged_dot's own numbers (jax's CPU lowering of it), groups of
    uneven sizes and an empty one included."""
    text = export.export(jax.jit(lambda x, w, g: jax.lax.ragged_dot(x, w, g)), platforms=["cuda"])(
        jax.ShapeDtypeStruct((16, 8), jnp.float32), jax.ShapeDtypeStruct((3, 8, 4), jnp.float32),
        jax.ShapeDtypeStruct((3,), jnp.int32)).mlir_module()
    rng = np.random.default_rng(0)
    x, w = rng.normal(size=(16, 8)).astype(np.float32), rng.normal(size=(3, 8, 4)).astype(np.float32)
    sizes = np.array([5, 0, 11], np.int32)
    (out,) = execute.run(ir_utils.parse(text), [x, w, sizes], execute.cpu_devices(1))
    np.testing.assert_allclose(out[0], np.asarray(jax.lax.ragged_dot(x, w, sizes)), rtol=1e-5, atol=1e-5)
