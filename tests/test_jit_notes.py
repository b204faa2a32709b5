"""cmatmul_pass.jit says what the command line says of a module with no candidate site: on a
function jax.jit shards by itself (in_shardings, no shard_map), that the pass rewrites only
shard_map collectives and XLA's own collective-matmul flags, in ``report.summary()`` and in one
warning per function."""

import warnings

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import cmatmul_pass
from cmatmul_pass.cli import WINDOWED_EINSUM_FLAGS

MESH = Mesh(np.array(jax.devices()[:8]), ("model",))  # automatic axes: jax.jit partitions the program
ROWS, COLS = NamedSharding(MESH, P("model", None)), NamedSharding(MESH, P(None, "model"))


def matmul(x, w):
    return x @ w


def test_an_auto_sharded_function_is_explained_in_the_summary_and_one_warning():
    f = cmatmul_pass.jit(matmul, in_shardings=(ROWS, COLS), out_shardings=ROWS)
    w = jax.device_put(np.ones((32, 64), np.float32), COLS)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for rows in (64, 128):  # two signatures, one warning
            x = jax.device_put(np.ones((rows, 32), np.float32), ROWS)
            np.testing.assert_allclose(np.asarray(f(x, w)), np.full((rows, 64), 32.0))
    messages = [str(r.message) for r in record if "shard_map" in str(r.message)]
    assert len(messages) == 1, messages
    assert messages[0].startswith("cmatmul_pass.jit: matmul: 0 of 0 candidate site(s) rewritten: the module has "
                                  "no shard_map (manual) region")
    assert WINDOWED_EINSUM_FLAGS in messages[0]
    summary = f.report.summary()
    assert summary.startswith("0 of 0 candidate site(s) rewritten")
    assert "note: the module has no shard_map (manual) region" in summary and WINDOWED_EINSUM_FLAGS in summary
    assert f.report.to_dict()["notes"] == f.report.notes and len(f.report.notes) == 1
    assert f.lower(x, w).report.notes == f.report.notes


def test_a_shard_map_without_candidates_is_noted_without_a_warning():
    """A shard_map region with only a ppermute: the census of its collectives in the summary, as
    the command line notes it; no warning (it is a shard_map program)."""
    mesh = jax.make_mesh((8,), ("model",))
    shift = [(i, (i + 1) % 8) for i in range(8)]
    f = cmatmul_pass.jit(jax.shard_map(lambda x: jax.lax.ppermute(x, "model", shift), mesh=mesh,
                                       in_specs=P("model"), out_specs=P("model")))
    x = jax.device_put(np.ones((64,), np.float32), NamedSharding(mesh, P("model")))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        f(x)
    assert not [r for r in record if "candidate" in str(r.message)]
    assert "note: no candidate site: the shard_map regions hold 0 all_reduce, 0 all_gather, 0 reduce_scatter, 0 all_to_all, 1 collective_permute" in f.report.summary()


def test_a_program_with_sites_has_no_notes():
    mesh = jax.make_mesh((8,), ("model",))
    f = cmatmul_pass.jit(jax.shard_map(lambda x, w: jax.lax.all_gather(x, "model", axis=0, tiled=True) @ w,
                                       mesh=mesh, in_specs=(P("model", None), P(None, "model")),
                                       out_specs=P(None, "model")), policy="all")
    f(jax.device_put(np.ones((64, 32), np.float32), NamedSharding(mesh, P("model", None))),
      jax.device_put(np.ones((32, 64), np.float32), NamedSharding(mesh, P(None, "model"))))
    assert f.report.rewritten and "note:" not in f.report.summary() and not hasattr(f.report, "notes")
