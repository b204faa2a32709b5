"""Finders: found and declined sites, with their reasons, on samples and on small inline modules."""

import jax
import jax.numpy as jnp
import networkx as nx
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import cmatmul_pass
from cmatmul_pass import ir_utils, matchers
from cmatmul_pass.matchers import AllGatherSite, DeclinedSite, find_all_gather_dot
from cmatmul_pass.ring import Ring, ring_from_replica_groups
from cmatmul_pass.errors import Decline
from conftest import POSITIVE, sample

AG_ATTRS = (
    "all_gather_dim = 0 : i64, channel_handle = #stablehlo.channel_handle<handle = 1, type = 1>, "
    "replica_groups = dense<{groups}> : tensor<{gshape}xi64>, use_global_device_ids"
)


def small_module(groups="[[0, 1, 2, 3]]", gshape="1x4", attrs=None, module_attrs="mhlo.num_partitions = 4 : i32, mhlo.num_replicas = 1 : i32",
                 shard="2x8", gathered="8x8", variadic=False):
    attrs = attrs if attrs is not None else AG_ATTRS.format(groups=groups, gshape=gshape)
    if variadic:
        gather = (f'%0:2 = "stablehlo.all_gather"(%arg0, %arg0) <{{{attrs}}}> : (tensor<{shard}xf32>, tensor<{shard}xf32>) '
                  f"-> (tensor<{gathered}xf32>, tensor<{gathered}xf32>)")
        lhs = "%0#0"
    else:
        gather = f'%0 = "stablehlo.all_gather"(%arg0) <{{{attrs}}}> : (tensor<{shard}xf32>) -> tensor<{gathered}xf32>'
        lhs = "%0"
    rows = gathered.split("x")[0]
    return f"""
module @m attributes {{{module_attrs}}} {{
  func.func public @main(%arg0: tensor<{shard}xf32>, %arg1: tensor<8x4xf32>) -> tensor<{rows}x4xf32> {{
    {gather}
    %1 = stablehlo.dot_general {lhs}, %arg1, contracting_dims = [1] x [0] : (tensor<{gathered}xf32>, tensor<8x4xf32>) -> tensor<{rows}x4xf32>
    return %1 : tensor<{rows}x4xf32>
  }}
}}"""


def sites_of(text):
    module = ir_utils.parse(text)
    with module.context:
        return find_all_gather_dot(module)


def only_decline(text) -> DeclinedSite:
    (site,) = sites_of(text)
    assert isinstance(site, DeclinedSite), site
    return site


def test_small_module_matches():
    (site,) = sites_of(small_module())
    assert isinstance(site, AllGatherSite)
    (c,) = site.consumers
    assert (c.operand_index, site.gather_dim, c.result_dim, c.role, site.ring.size) == (0, 0, 0, "free", 4)


@pytest.mark.parametrize(
    "kwargs, code",
    [
        (dict(variadic=True), "variadic"),
        (dict(attrs="all_gather_dim = 0 : i64, replica_groups = dense<[[0, 1, 2, 3]]> : tensor<1x4xi64>"), "cross_replica"),
        (dict(module_attrs="mhlo.num_replicas = 1 : i32"), "no_num_partitions"),
        (dict(module_attrs="mhlo.num_partitions = 4 : i32, mhlo.num_replicas = 2 : i32"), "replicas"),
        (dict(groups="[[0, 1], [2, 3]]", gshape="2x2", gathered="4x8",
              module_attrs="mhlo.num_partitions = 8 : i32, mhlo.num_replicas = 1 : i32"), "replica_groups"),
        (dict(groups="[[0], [1], [2], [3]]", gshape="4x1", gathered="2x8"), "ring_size_1"),
    ],
)
def test_declines_with_reason(kwargs, code):
    site = only_decline(small_module(**kwargs))
    assert site.code == code and site.message


def test_groups_the_verifier_rejects_are_input_errors():
    with pytest.raises(cmatmul_pass.InputError, match=r"^m.mlir:4:10: replica id #3 not seen"):
        cmatmul_pass.rewrite(small_module(groups="[[0, 1], [2, 7]]", gshape="2x2", gathered="4x8"), source="m.mlir")


def test_declined_module_is_left_unchanged():
    text = small_module(variadic=True)
    result = cmatmul_pass.rewrite(text)
    assert result.text == ir_utils.print_module(ir_utils.parse(text))
    assert result.report.sites[0].reason_code == "variadic"


@pytest.mark.parametrize(
    "name, operand, gather_dim, result_dim",
    [("ag_dot_rhs", 1, 1, 1), ("ag_dot_bsh", 0, 1, 1), ("ag_dot_mesh2x4_model", 0, 0, 0)],
)
def test_dimension_roles(name, operand, gather_dim, result_dim):
    (site,) = sites_of(sample(name).read_text())
    (c,) = site.consumers
    assert (c.operand_index, site.gather_dim, c.result_dim) == (operand, gather_dim, result_dim)


@pytest.mark.parametrize(
    "name, groups",
    [
        ("ag_dot_mesh2x4_data_strided", ((0, 4), (1, 5), (2, 6), (3, 7))),
        ("ag_dot_permuted_groups", ((0, 4, 1, 5, 2, 6, 3, 7),)),
        ("ag_dot_mesh2x4_model", ((0, 1, 2, 3), (4, 5, 6, 7))),
    ],
)
def test_ring_follows_the_group_order(name, groups):
    (site,) = sites_of(sample(name).read_text())
    assert site.ring.groups == groups


def test_finder_does_not_mutate():
    text = sample("ag_dot_1d").read_text()
    module = ir_utils.parse(text)
    before = ir_utils.print_module(module)
    with module.context:
        find_all_gather_dot(module)
    assert ir_utils.print_module(module) == before


def test_position_table_and_pairs():
    ring = Ring(((0, 4, 1, 5), (2, 6, 3, 7)), 8)
    assert ring.position_table().tolist() == [0, 2, 0, 2, 1, 3, 1, 3]
    assert ring.shift_pairs(-1).tolist() == [[0, 5], [4, 0], [1, 4], [5, 1], [2, 7], [6, 2], [3, 6], [7, 3]]


def test_ring_rejects_bad_groups():
    with pytest.raises(Decline, match="every partition"):
        ring_from_replica_groups(np.array([[0, 1], [1, 2]]), 4)
    with pytest.raises(Decline, match="partition 9"):
        ring_from_replica_groups(np.array([[0, 9]]), 4)


def permute_pairs(module) -> list[np.ndarray]:
    return [
        ir_utils.dense_ints(op.attributes["source_target_pairs"])
        for op in ir_utils.walk(module.operation)
        if op.operation.name == "stablehlo.collective_permute"
    ]


@pytest.mark.parametrize(
    "options",
    [cmatmul_pass.Options(), cmatmul_pass.Options(bidirectional=True, unroll=2, annotate_streams=True),
     cmatmul_pass.Options(bidirectional=True, unroll="full")],
    ids=["uni", "bidi-unroll2-streams", "bidi-full"],
)
@pytest.mark.parametrize("path", POSITIVE, ids=lambda p: p.stem)
def test_every_permute_forms_the_groups_rings(path, options):
    """Deadlock freedom: each permute's pairs are exactly one directed cycle per replica group."""
    result = cmatmul_pass.rewrite(path.read_text(), options)
    # each site's groups (a module may ring over several mesh axes: a data-parallel psum's 'data')
    site_groups = [sorted(sorted(g) for g in s.replica_groups) for s in result.report.rewritten]
    all_pairs = permute_pairs(result.module)
    # one permute op per channel handle (sites calling a shared ring report its handles)
    assert len(all_pairs) == len({h for s in result.report.rewritten for h in s.channel_handles
                                  if s.all_reduce.get("strategy") != "chunk" and not s.all_to_all})
    for pairs in all_pairs:
        graph = nx.DiGraph([tuple(p) for p in pairs.tolist()])
        cycles = [sorted(c) for c in nx.simple_cycles(graph)]
        assert all(graph.out_degree(n) == 1 and graph.in_degree(n) == 1 for n in graph)
        assert sorted(cycles) in site_groups


def test_new_ops_carry_the_matched_ops_locations():
    mesh = jax.make_mesh((2, 4), ("data", "model"))

    def body(x, w):
        gathered = jax.lax.all_gather(x, "model", axis=0, tiled=True)  # GATHER-LINE
        return gathered @ w  # DOT-LINE

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("model", None), P(None, "model")), out_specs=P(None, "model"), check_vma=False))
    args = [jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=NamedSharding(mesh, P("model", None))),
            jax.ShapeDtypeStruct((32, 64), jnp.float32, sharding=NamedSharding(mesh, P(None, "model")))]
    text = f.lower(*args).as_text(debug_info=True)
    source = open(__file__).read().splitlines()
    gather_line = next(i for i, l in enumerate(source, 1) if l.rstrip().endswith("# GATHER-LINE"))
    dot_line = next(i for i, l in enumerate(source, 1) if l.rstrip().endswith("# DOT-LINE"))
    result = cmatmul_pass.rewrite(text)
    assert result.report.sites[0].location.endswith(f"test_matchers.py:{gather_line}:19")
    lines = {}
    for op in ir_utils.walk(result.module.operation):
        found = ir_utils.first_file_location(op.location)
        if found is not None:
            lines.setdefault(op.operation.name, set()).add(found.start_line)
    assert lines["stablehlo.collective_permute"] == {gather_line}
    assert lines["stablehlo.dot_general"] == {dot_line}
    assert "stablehlo.all_gather" not in lines


def test_report_json_fields():
    report = cmatmul_pass.rewrite(sample("ag_dot_mesh2x4_model").read_text(), cmatmul_pass.Options(variant="uni"),
                                  source="x.mlir").report.to_dict()
    (site,) = report["sites"]
    assert site["kind"] == "all_gather_dot" and site["rewritten"] is True and site["reason"] == ""
    assert site["ring_size"] == 4 and site["replica_groups"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert site["location"].startswith("x.mlir:") and site["operand"] == "lhs" and site["dim_role"] == "free"
    assert site["shard_shape"] == [8, 32] and site["bytes_moved"] == 3 * 8 * 32 * 4
    assert site["channel_handles"] == [2]


def test_module_info_reads_meshes():
    module = ir_utils.parse(sample("ag_dot_mesh2x4_model").read_text())
    with module.context:
        info = matchers.ModuleInfo.of(module)
    assert info.meshes == {"mesh": {"data": 2, "model": 4}} and info.num_partitions == 8
