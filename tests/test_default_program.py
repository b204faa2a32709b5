"""The default (``cmatmul_pass.jit(f)``, no options, on these CPU devices, which no cost-model
profile describes) compiles a column- or row-parallel layer to the program a user writes by hand
with ``ppermute`` (the JAX docs' technique, ``tools/bench.py``'s hand-written rings, unrolled in
Python): the same dots, slices, permutes and fusions, no loop, no copy, and no more instructions
(its ring positions are table lookups, the hand-written ring's are index arithmetic). That is why the benchmark's default / hand-written ratio
sits at 1.0 within the noise of a run (docs/variants.md)."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import cmatmul_pass
from tools import bench, gpu_topology

#: what the programs compute and move, op by op: these counts must be equal
WORK = ("dot", "dynamic-slice", "dynamic-update-slice", "collective-permute", "fusion", "while", "copy",
        "all-gather", "reduce-scatter", "concatenate")


def _layer(kind: str, mesh):
    """(the plain layer, the ring written by hand, x's and w's shardings)."""
    if kind == "column":
        specs = dict(in_specs=(P("model", None), P(None, "model")), out_specs=P(None, "model"), check_vma=False)
        plain = lambda x, w: jax.lax.all_gather(x, "model", axis=0, tiled=True) @ w  # noqa: E731
        return plain, bench.hand_written_ring(mesh, "model"), specs
    specs = dict(in_specs=(P(None, "model"), P("model", None)), out_specs=P("model", None), check_vma=False)
    plain = lambda x, w: jax.lax.psum_scatter(x @ w, "model", scatter_dimension=0, tiled=True)  # noqa: E731
    return plain, bench.hand_written_scatter(mesh, "model"), specs


def _opcodes(compiled) -> dict:
    """Instructions by opcode; a ring position read from a table (a ``u32[1]`` dynamic-slice at
    ``partition_id``, one per straight-line round: index arithmetic, not a slice of data) counts
    as ``position-lookup``."""
    module = gpu_topology.optimized_module(compiled)
    opcodes = gpu_topology.analyse(module)["opcodes"]
    lookups = sum(1 for comp in gpu_topology.ModuleReader(module).computations.values()
                  for i in comp.instructions()
                  if gpu_topology.opcode_name(i) == "dynamic-slice" and " u32[1]{0} dynamic-slice(" in i.to_string())
    opcodes = dict(opcodes, **{"dynamic-slice": opcodes.get("dynamic-slice", 0) - lookups})
    return {**opcodes, "position-lookup": lookups}


@pytest.mark.parametrize("kind, rows, hidden, out", bench.RING_SHAPES[:1] + bench.RING_SHAPES[3:5])
def test_the_default_compiles_to_the_ring_a_user_writes_by_hand(kind, rows, hidden, out):
    mesh = jax.make_mesh((8,), ("model",))
    plain, by_hand, specs = _layer(kind, mesh)
    x = jax.ShapeDtypeStruct((rows, hidden), np.float32, sharding=NamedSharding(mesh, specs["in_specs"][0]))
    w = jax.ShapeDtypeStruct((hidden, out), np.float32, sharding=NamedSharding(mesh, specs["in_specs"][1]))
    default = cmatmul_pass.jit(jax.shard_map(plain, mesh=mesh, **specs))
    ours = _opcodes(default.lower(x, w).compile())
    hand = _opcodes(jax.jit(jax.shard_map(by_hand, mesh=mesh, **specs)).lower(x, w).compile())
    assert [s.rewritten for s in default.report.sites] == [True]
    assert {op: ours.get(op, 0) for op in WORK} == {op: hand.get(op, 0) for op in WORK}
    assert ours["collective-permute"] == 7 and ours["dot"] == 8
    assert sum(ours.values()) <= sum(hand.values())



@pytest.mark.parametrize("kind, out, variant, loops", [("row", 1024, "uni", 1), ("row", 512, "full", 0),
                                                      ("column", 1024, "full", 0)])
def test_a_large_scatters_default_is_the_one_way_loop(kind, out, variant, loops):
    """From 8 MiB of partial sums per device (cost.FALLBACK_LOOPED_SCATTER_BYTES: 2048 x 1024 f32)
    the CPU default scatters in a one-way loop, which the benchmark times faster than the straight
    line the hand-written ring compiles to (docs/variants.md); at 4 MiB a scatter, and a gather of
    any size, stay straight-line."""
    mesh = jax.make_mesh((8,), ("model",))
    plain, _, specs = _layer(kind, mesh)
    x = jax.ShapeDtypeStruct((2048, 1024), np.float32, sharding=NamedSharding(mesh, specs["in_specs"][0]))
    w = jax.ShapeDtypeStruct((1024, out), np.float32, sharding=NamedSharding(mesh, specs["in_specs"][1]))
    default = cmatmul_pass.jit(jax.shard_map(plain, mesh=mesh, **specs))
    lowered = default.lower(x, w)
    assert [s.schedule["variant"] for s in default.report.rewritten] == [variant]
    assert _opcodes(lowered.compile()).get("while", 0) == loops
