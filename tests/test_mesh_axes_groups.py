"""Replica groups named by mesh axes (``#stablehlo.replica_group_mesh_axes``, how jax >= 0.11 lowers
shard_map collectives): the explicit groups they stand for, and the pass reading them.

The expected groups below follow XLA's definition (``MeshAxesReplicaGroupList``): a group holds the
devices that agree on every mesh coordinate the listed axes leave out, ordered row-major over the
listed axes (the first listed the most major); a sub-axis ``a:(pre)size`` is the middle factor of
axis ``a`` split row-major into ``pre x size x rest``; an explicit device list maps mesh positions
to devices.
"""

import itertools

import numpy as np
import pytest

import cmatmul_pass
from cmatmul_pass import ir_utils
from cmatmul_pass._jax_private import hlo, ir
from cmatmul_pass.errors import Decline
from cmatmul_pass.ring import groups_from_mesh_axes
from conftest import sample


def groups(sizes, axes, device_ids=()):
    """``axes``: (axis index, pre_size, size), or an axis index for the whole axis."""
    refs = [(a, 1, sizes[a]) if isinstance(a, int) else a for a in axes]
    return groups_from_mesh_axes(sizes, list(device_ids), refs).tolist()


def test_whole_axes_of_a_2x2_mesh():
    assert groups([2, 2], [0]) == [[0, 2], [1, 3]]
    assert groups([2, 2], [1]) == [[0, 1], [2, 3]]
    assert groups([2, 2], [0, 1]) == [[0, 1, 2, 3]]
    assert groups([2, 2], [1, 0]) == [[0, 2, 1, 3]]  # listed order: axis 1 is the major one


def test_the_2x4_meshes_of_the_samples():
    assert groups([2, 4], [1]) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # "model"
    assert groups([2, 4], [0]) == [[0, 4], [1, 5], [2, 6], [3, 7]]  # "data": strided
    assert groups([2, 4], [1, 0]) == [[0, 4, 1, 5, 2, 6, 3, 7]]  # ("model", "data")


def test_sub_axes_of_a_6x6_mesh():
    assert groups([6, 6], [(0, 1, 2)])[:3] == [[0, 18], [1, 19], [2, 20]]
    assert groups([6, 6], [(0, 3, 2)])[:2] == [[0, 6], [1, 7]]
    assert groups([6, 6], [(1, 1, 3)])[:2] == [[0, 2, 4], [1, 3, 5]]
    assert groups([6, 6], [(1, 3, 2)])[:2] == [[0, 1], [2, 3]]
    assert groups([6, 6], [(0, 1, 2), (1, 1, 2)])[0] == [0, 3, 18, 21]
    assert groups([6, 6], [(1, 1, 3), (0, 1, 3)])[0] == [0, 12, 24, 2, 14, 26, 4, 16, 28]


def test_two_sub_axes_of_one_axis():
    # an 8-axis split 2 x 2 x 2: the outer and the inner factor together
    assert groups([8], [(0, 1, 2), (0, 4, 2)]) == [[0, 1, 4, 5], [2, 3, 6, 7]]


def test_explicit_device_order():
    assert groups([2, 2], [0], device_ids=[3, 1, 0, 2]) == [[3, 0], [1, 2]]
    assert groups([2, 2], [1], device_ids=[3, 1, 0, 2]) == [[3, 1], [0, 2]]


@pytest.mark.parametrize(
    "sizes, axes, device_ids, match",
    [
        ([10], [(0, 8, 2)], (), "does not divide"),
        ([10], [(0, 2, 8)], (), "does not divide"),
        ([30], [(0, 6, 5), (0, 10, 3)], (), "overlap"),
        ([4], [0, 0], (), "overlap"),
        ([2, 2], [0], [0, 1, 2], "3 device ids for 4"),
    ],
)
def test_groups_that_do_not_fit_the_mesh_are_declined(sizes, axes, device_ids, match):
    with pytest.raises(Decline, match=match):
        groups(sizes, axes, device_ids)


def with_mesh_axes_groups(text: str, axes: list[str]) -> ir.Module:
    """``text`` with every all_gather's and reduce_scatter's groups replaced by the mesh-axes form
    over ``axes`` of the module's mesh (through the bindings, as jax >= 0.11 would write them)."""
    module = ir_utils.parse(text)
    with module.context:
        mesh = ir.FlatSymbolRefAttr.get("mesh")
        refs = ir.ArrayAttr.get([hlo.AxisRefAttr.get(a) for a in axes])
        by_axes = hlo.ReplicaGroupMeshAxesAttr.get(mesh, refs)
        for op in ir_utils.walk(module.operation):
            if op.operation.name in ("stablehlo.all_gather", "stablehlo.reduce_scatter"):
                op.operation.attributes["replica_groups"] = by_axes
    module.operation.verify()
    return module


@pytest.mark.parametrize(
    "name, axes",
    [("sp_mlp", ["model"]), ("ag_dot_mesh2x4_data_strided", ["data"]), ("ag_dot_permuted_groups", ["model", "data"])],
)
def test_mesh_axes_groups_give_the_dense_groups_rings(name, axes):
    """The same module with its groups by mesh axes is rewritten into the same rings (the same
    permute pairs, in the same order) as with the dense groups jax 0.10 writes."""
    text = sample(name).read_text()
    dense = cmatmul_pass.rewrite(text)
    by_axes = cmatmul_pass.rewrite(with_mesh_axes_groups(text, axes))
    assert by_axes.report.rewritten and len(by_axes.report.rewritten) == len(dense.report.rewritten)
    assert [s.replica_groups for s in by_axes.report.sites] == [s.replica_groups for s in dense.report.sites]

    def pairs(module):
        return [ir_utils.dense_ints(op.attributes["source_target_pairs"]).tolist()
                for op in ir_utils.walk(module.operation) if op.operation.name == "stablehlo.collective_permute"]

    assert pairs(by_axes.module) == pairs(dense.module)


def test_unknown_mesh_or_axis_is_declined_with_a_reason():
    text = sample("sp_mlp").read_text()
    module = with_mesh_axes_groups(text, ["model"])
    with module.context:
        wrong = hlo.ReplicaGroupMeshAxesAttr.get(
            ir.FlatSymbolRefAttr.get("mesh"), ir.ArrayAttr.get([hlo.AxisRefAttr.get("pipeline")]))
        for op in ir_utils.walk(module.operation):
            if op.operation.name == "stablehlo.all_gather":
                op.operation.attributes["replica_groups"] = wrong
    result = cmatmul_pass.rewrite(module)
    (declined,) = result.report.declined
    assert declined.reason_code == "replica_groups" and "'pipeline'" in declined.reason


def test_jax011_samples_record_mesh_axes_groups():
    """The samples lowered by jax 0.11 do carry groups by mesh axes (what the tests above stand in for)."""
    paths = sorted(sample("sp_mlp").parent.glob("*_jax011.mlir"))
    assert len(paths) == 3
    for path in paths:
        module = ir_utils.parse(path.read_text())
        found = ir_utils.ops_named(module, "stablehlo.all_gather", "stablehlo.reduce_scatter")
        collectives = found["stablehlo.all_gather"] + found["stablehlo.reduce_scatter"]
        assert collectives and all(
            hlo.ReplicaGroupMeshAxesAttr.isinstance(op.attributes["replica_groups"]) for op in collectives)


def gathered_partition_ids(mesh, group_size, replica_groups) -> list[list[int]]:
    """What XLA itself makes of ``replica_groups``: a shard_map program over ``mesh`` whose every
    device holds its own id and all_gathers ``group_size`` of them (over mesh axes with that many
    devices), run on the 8 CPU devices with its groups set to
    ``replica_groups(module, the all_gather)``; the result on device d lists d's group in its order."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from cmatmul_pass import execute

    shape, names = mesh
    gathered_axes = next(axes for k in range(1, len(names) + 1) for axes in itertools.combinations(names, k)
                         if int(np.prod([shape[names.index(a)] for a in axes])) == group_size)
    jax_mesh = jax.make_mesh(shape, names)

    def body(x):
        return jax.lax.all_gather(x, gathered_axes, axis=0, tiled=True)

    f = jax.shard_map(body, mesh=jax_mesh, in_specs=P(names), out_specs=P(), check_vma=False)
    arg = jax.ShapeDtypeStruct((8,), jnp.int32, sharding=NamedSharding(jax_mesh, P(names)))
    module = ir_utils.parse(jax.jit(f).lower(arg).as_text())
    with module.context:
        (gather,) = ir_utils.ops_named(module, "stablehlo.all_gather")["stablehlo.all_gather"]
        gather.operation.attributes["replica_groups"] = replica_groups(module, gather)
    module.operation.verify()
    (per_device,) = execute.run(module, [np.arange(8, dtype=np.int32)], execute.cpu_devices(8))
    return [shard.tolist() for shard in per_device]


def mesh_axes_attr(refs):
    """The groups over ``refs`` ((name, pre_size, size) or a name) of the program's mesh (the one
    the gather's groups name already, with jax >= 0.11), built in the module's context."""
    def build(module, gather):
        current = gather.operation.attributes["replica_groups"]
        if hlo.ReplicaGroupMeshAxesAttr.isinstance(current):
            mesh = hlo.ReplicaGroupMeshAxesAttr(current).mesh
        else:
            (mesh_op,) = [op for op in module.body.operations if op.operation.name == "sdy.mesh"]
            mesh = ir.FlatSymbolRefAttr.get(ir_utils.symbol_name(mesh_op))
        axis_refs = [hlo.AxisRefAttr.get(r) if isinstance(r, str)
                     else hlo.AxisRefAttr.get(r[0], hlo.SubAxisInfoAttr.get(r[1], r[2])) for r in refs]
        return hlo.ReplicaGroupMeshAxesAttr.get(mesh, ir.ArrayAttr.get(axis_refs))
    return build


CUBE = ((2, 2, 2), ("a", "b", "c"))
MESH_2X4 = ((2, 4), ("a", "b"))


@pytest.mark.parametrize(
    "mesh, refs",
    [
        (CUBE, ["a"]), (CUBE, ["c"]), (CUBE, ["b", "a"]), (CUBE, ["a", "c"]), (CUBE, ["c", "a", "b"]),
        (MESH_2X4, [("b", 1, 2)]), (MESH_2X4, [("b", 2, 2)]), (MESH_2X4, [("b", 2, 2), "a"]),
        (MESH_2X4, ["a", ("b", 1, 2)]), (MESH_2X4, [("b", 2, 2), ("b", 1, 2)]),
    ],
    ids=lambda v: str(v) if isinstance(v, list) else "x".join(map(str, v[0])),
)
def test_groups_match_what_xla_gathers(mesh, refs):
    """The groups the pass derives are the groups XLA runs (membership and order), for whole axes
    in any order and for sub-axes."""
    shape, names = mesh
    axes = [(names.index(r), 1, shape[names.index(r)]) if isinstance(r, str) else (names.index(r[0]), r[1], r[2])
            for r in refs]
    expected = groups_from_mesh_axes(list(shape), [], axes)
    by_device = {d: group for group in expected.tolist() for d in group}
    got = gathered_partition_ids(mesh, expected.shape[1], mesh_axes_attr(refs))
    assert got == [by_device[d] for d in range(8)]
