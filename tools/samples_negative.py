"""Samples the pass declines (tools/gen_samples.py): programs JAX lowers with a reason the pass
names, and real lowered programs changed in one place through the MLIR bindings for the reasons
JAX never produces on its own."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from tools.samples_common import Sample, arg, gather, lower, mesh_1d, mesh_2x4, scatter, smap, under_legacy_partitioner
from tools.samples_gather import mesh2x4_model, partial_manual
from tools.samples_scatter import rs_on, rs_padded
from tools.samples_layers import feature_norm_before_dot, moe_expert_parallel


# ---------------------------------------------------------------- negative samples

def user_not_dot() -> str:
    mesh = mesh_2x4()
    body = lambda x, w: jnp.sort(gather(x, "model", 0), axis=0) @ w  # noqa: E731
    f = smap(body, mesh=mesh, in_specs=(P("model", None), P(None, "model")), out_specs=P(None, "model"))
    return lower(f, arg(mesh, (64, 32), P("model", None)), arg(mesh, (32, 64), P(None, "model")))


def crop_returned() -> str:
    """The gathered cotangent cropped to 60 rows (a padding's transpose), read by a matmul and
    returned as well: the crop cannot move past its readers."""
    mesh = mesh_1d()

    def body(dy, w):
        c = jax.lax.pad(gather(dy, "model", 0), jnp.float32(0), [(0, -4, 0), (0, 0, 0)])
        return c @ w.T, c

    f = smap(body, mesh=mesh, in_specs=(P("model", None), P("model", None)), out_specs=(P(None, "model"), P()))
    return lower(f, arg(mesh, (64, 32), P("model", None)), arg(mesh, (64, 32), P("model", None)))


def both_operands() -> str:
    mesh = mesh_2x4()

    def body(x):
        g = gather(x, "model", 0)
        return jnp.einsum("ik,jk->ij", g, g)

    f = smap(body, mesh=mesh, in_specs=(P("model", None),), out_specs=P())
    return lower(f, arg(mesh, (32, 16), P("model", None)))


def both_operands_transposed() -> str:
    """g @ g.T: the gathered value reaches both dot operands, once through a transpose (found when two
    paths led to one dot; it must be declined, never rewritten twice)."""
    mesh = mesh_2x4()

    def body(x):
        g = gather(x, "model", 0)
        return g @ jnp.transpose(g)

    f = smap(body, mesh=mesh, in_specs=(P("model", None),), out_specs=P())
    return lower(f, arg(mesh, (32, 16), P("model", None)))


def dot_in_cond_branch() -> str:
    """The gathered value is read by a dot inside a lax.cond branch (another region)."""
    mesh = mesh_2x4()

    def body(x, w, p):
        g = gather(x, "model", 0)
        return jax.lax.cond(p[0] > 0, lambda: g @ w, lambda: jnp.zeros((64, 16)))

    f = smap(body, mesh=mesh, in_specs=(P("model", None), P(None, "model"), P()), out_specs=P(None, "model"))
    return lower(f, arg(mesh, (64, 32), P("model", None)), arg(mesh, (32, 64), P(None, "model")), arg(mesh, (1,), P()))


def no_place_for_the_ring() -> str:
    """g @ sort(g).T: the dot's other operand needs the whole gathered value first."""
    mesh = mesh_2x4()

    def body(x):
        g = gather(x, "model", 0)
        return g @ jnp.sort(g, axis=0).T

    f = smap(body, mesh=mesh, in_specs=(P("model", None),), out_specs=P())
    return lower(f, arg(mesh, (32, 16), P("model", None)))


def rs_producer_not_dot() -> str:
    mesh = mesh_2x4()
    body = lambda x, w: scatter(jnp.sort(x @ w, axis=0), "model", 0)  # noqa: E731
    f = smap(body, mesh=mesh, in_specs=(P(None, "model"), P("model", None)), out_specs=P("model", None))
    return lower(f, arg(mesh, (64, 64), P(None, "model")), arg(mesh, (64, 32), P("model", None)))


def rs_multiple_users() -> str:
    mesh = mesh_2x4()

    def body(x, w):
        y = x @ w
        return scatter(y, "model", 0), jnp.cumsum(y, axis=0)[-1]

    f = smap(body, mesh=mesh, in_specs=(P(None, "model"), P("model", None)), out_specs=(P("model", None), P("model")))
    return lower(f, arg(mesh, (64, 64), P(None, "model")), arg(mesh, (64, 32), P("model", None)))


def reshape_splits_ring_dim() -> str:
    """Gathered on the minor dim, then flattened into rows of another width: shards are not row blocks."""
    mesh = mesh_2x4()
    body = lambda x, w: gather(x, "model", 1).reshape(4, 64) @ w  # noqa: E731
    f = smap(body, mesh=mesh, in_specs=(P(None, "model"), P()), out_specs=P())
    return lower(f, arg(mesh, (8, 32), P(None, "model")), arg(mesh, (64, 16), P()))


def prefetched_weight() -> str:
    """FSDP prefetch written by hand: one shard_map gathers the next layer's weight, the next one
    multiplies by it (the gathered value leaves through sdy.return)."""
    mesh = mesh_1d()
    prefetch = smap(lambda w: gather(w, "model", 0), mesh=mesh, in_specs=(P("model", None),), out_specs=P())
    layer = smap(lambda x, w: jnp.tanh(x @ w), mesh=mesh, in_specs=(P("model", None), P()), out_specs=P("model", None))
    return lower(lambda x, w: layer(x, prefetch(w)), arg(mesh, (64, 32), P("model", None)),
                 arg(mesh, (32, 32), P("model", None)))


def ragged_dot_scatter() -> str:
    """An MoE block's down projection: a grouped matmul (jax.lax.ragged_dot) of expert weights
    sharded on their contraction, summed and scattered over the tokens.  Lowered for GPU, where
    jax emits chlo.ragged_dot (on CPU it expands the grouped matmul into a masked dot_general)."""
    mesh = mesh_1d()

    def body(h, w, group_sizes):
        return scatter(jax.lax.ragged_dot(h, w, group_sizes), "model", 0)

    specs = (P(None, "model"), P(None, "model", None), P())
    f = smap(body, mesh=mesh, in_specs=specs, out_specs=P("model", None))
    args = (arg(mesh, (64, 128), specs[0]), arg(mesh, (4, 128, 32), specs[1]), arg(mesh, (4,), P(), jnp.int32))
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def reshard_by_gather() -> str:
    """Sequence-sharded rows gathered, then each device slices its own features: a reshard."""
    mesh = mesh_1d()

    def body(x):
        return jax.lax.dynamic_slice_in_dim(gather(x, "model", 0), jax.lax.axis_index("model") * 4, 4, axis=1)

    f = smap(body, mesh=mesh, in_specs=(P("model", None),), out_specs=P(None, "model"))
    return lower(f, arg(mesh, (64, 32), P("model", None)))


# ---------------------------------------------------------------- derived negative samples
# Reasons JAX never produces on its own (it always emits partition-mode, single-operand gathers in a
# module that names its partitions).  Each sample is a real lowered program changed in exactly one
# place through the MLIR bindings, so the module is still generated, never hand-edited.
def derived(base: Callable[[], str], mutate: Callable) -> Callable[[], str]:
    def build() -> str:
        from cmatmul_pass import ir_utils
        from cmatmul_pass._jax_private import ir

        module = ir_utils.parse(base())
        with module.context, ir.Location.unknown():
            mutate(module)
            module.operation.verify()
        return ir_utils.print_module(module)

    return build


def the_all_gather(module):
    from cmatmul_pass import ir_utils

    (ag,) = [op for op in ir_utils.walk(module.operation) if op.operation.name == "stablehlo.all_gather"]
    return ag


def drop_num_partitions(module) -> None:
    del module.operation.attributes["mhlo.num_partitions"]


def two_replicas(module) -> None:
    from cmatmul_pass._jax_private import ir

    module.operation.attributes["mhlo.num_replicas"] = ir.IntegerAttr.get(ir.IntegerType.get_signless(32), 2)


def cross_replica_groups(module) -> None:
    ag = the_all_gather(module)
    del ag.attributes["use_global_device_ids"]
    del ag.attributes["channel_handle"]


def max_scatter(module) -> None:
    """The reduce_scatter's region computes a max instead of a sum."""
    from cmatmul_pass import ir_utils
    from cmatmul_pass._jax_private import hlo, ir

    (rs,) = [op for op in ir_utils.walk(module.operation) if op.operation.name == "stablehlo.reduce_scatter"]
    block = list(rs.operation.regions[0].blocks)[0]
    add = list(block.operations)[0]
    with ir.InsertionPoint(add):
        new = hlo.MaxOp(*add.operation.operands, loc=add.location)
    add.result.replace_all_uses_with(new.result)
    add.operation.erase()


def variadic_gather(module) -> None:
    """Gather the shard twice in one op; the dot reads the first result."""
    from cmatmul_pass._jax_private import hlo, ir

    ag = the_all_gather(module)
    x = ag.operation.operands[0]
    with ir.InsertionPoint(ag):
        pair = hlo.AllGatherOp(
            [ag.result.type] * 2, [x, x], ag.attributes["all_gather_dim"], ag.attributes["replica_groups"],
            channel_handle=ag.attributes["channel_handle"], use_global_device_ids=True, loc=ag.location,
        )
    ag.result.replace_all_uses_with(pair.results[0])
    ag.operation.erase()


NEG = ["CHECK: stablehlo.all_gather", "CHECK-NOT: stablehlo.while"]
NEG_RS = ["CHECK: stablehlo.reduce_scatter", "CHECK-NOT: stablehlo.while"]


#: the samples of this family (tools/gen_samples.py writes them in this order)
SAMPLES_LIST = [
    Sample("neg_partial_manual_legacy", "partial-manual shard_map under the legacy partitioner: declined.",
           under_legacy_partitioner(partial_manual), "unchanged partial_manual",
           ["CHECK-LABEL: func.func private @shmap_body", "CHECK: stablehlo.all_gather", "CHECK-NOT: stablehlo.while"]),
    Sample("neg_norm_offset_features", "as ag_rms_features_dot, but the sum of squares over the gathered features "
           "starts from 1.0: n partial sums would count it n times, so the gather stays.",
           feature_norm_before_dot("offset"), "unchanged layout", NEG),
    Sample("neg_ag_crop_returned", "the gathered rows cropped (a padding's transpose) and read by a matmul and returned "
           "as well: the crop cannot move past its readers, so the gather stays (rs_ag_padded_grad's backward moves it).",
           crop_returned, "unchanged user_not_dot", ["CHECK: stablehlo.all_gather", "CHECK-NOT: stablehlo.while"]),
    Sample("neg_user_not_dot", "the gathered value is sorted along the gathered dim (not blockwise) before the dot.",
           user_not_dot, "unchanged user_not_dot", NEG),
    Sample("neg_no_num_partitions", "derived: the 2x4 'model' program without its mhlo.num_partitions attribute.",
           derived(mesh2x4_model, drop_num_partitions), "unchanged no_num_partitions",
           NEG),
    Sample("neg_two_replicas", "derived: the 2x4 'model' program claiming mhlo.num_replicas = 2.",
           derived(mesh2x4_model, two_replicas), "unchanged replicas",
           NEG),
    Sample("neg_cross_replica", "derived: the gather without channel_handle / use_global_device_ids (replica groups).",
           derived(mesh2x4_model, cross_replica_groups), "unchanged cross_replica",
           NEG),
    Sample("neg_variadic", "derived: one all_gather with two operands feeding the dot.",
           derived(mesh2x4_model, variadic_gather), "unchanged variadic",
           NEG),
    Sample("neg_both_operands", "the gathered value is both operands of the dot (a Gram matrix).",
           both_operands, "unchanged both_operands", NEG),
    # ---- declined
    Sample("neg_both_operands_transposed", "g @ transpose(g): the gathered value reaches both dot operands.",
           both_operands_transposed, "unchanged both_operands", NEG),
    Sample("neg_other_block", "the only dot reading the gathered value sits in a lax.cond branch.",
           dot_in_cond_branch, "unchanged other_block", NEG),
    Sample("neg_schedule", "g @ sort(g).T: no point where the ring could compute the dot.",
           no_place_for_the_ring, "unchanged schedule", NEG),
    Sample("neg_rs_not_sum", "derived: the reduce_scatter's region is a max.",
           derived(rs_on(0), max_scatter), "unchanged not_sum", NEG_RS),
    Sample("neg_rs_producer_not_dot", "the scattered value is the product sorted along the scattered dim (not blockwise).",
           rs_producer_not_dot, "unchanged producer_not_dot", NEG_RS),
    Sample("neg_rs_pad_nonzero", "the product padded with ones (not zeros) before the sum-scatter: the padding cannot "
           "move onto the lhs (a row of ones times W is no row of ones), so the scatter stays (rs_dot_padded pads "
           "with zeros).",
           rs_padded(1.0), "unchanged producer_not_dot", NEG_RS),
    Sample("neg_rs_multiple_users", "the full product is also read locally, by a running sum over its rows.",
           rs_multiple_users, "unchanged multiple_users", NEG_RS),
    Sample("neg_reshape_splits_ring_dim", "gathered on the minor dim, then flattened: shards are not blocks of the dot operand.",
           reshape_splits_ring_dim, "unchanged layout", NEG),
    Sample("neg_prefetch", "FSDP prefetch by hand: the weight gathered in one shard_map is multiplied in the next; "
           "the transfer is already off the matmul's critical path.",
           prefetched_weight, "unchanged prefetchable", NEG),
    Sample("neg_rs_ragged_dot", "an MoE down projection (chlo.ragged_dot, lowered for GPU) summed and scattered "
           "along the tokens: the grouped matmul's ragged rows, which its group sizes assign to experts by position, "
           "cannot be cut into blocks.",
           ragged_dot_scatter, "unchanged ragged_dot", NEG_RS),
    Sample("neg_a2a_region", "an expert-parallel MoE block whose hidden activations are centred over every local "
           "expert's slots at once between the dispatch and the combine all_to_all: a reduce over the experts and "
           "the capacity, the dims chunks would keep apart (the features are contracted by the experts' matmuls).",
           moe_expert_parallel(mixing=True), "unchanged a2a_region",
           ['CHECK: "stablehlo.all_to_all"', "CHECK-NOT: stablehlo.concatenate"]),
    Sample("neg_reshard", "all_gather of the rows, then each device's slice of the features: a reshard (an all_to_all "
           "in disguise), not a matmul input.",
           reshard_by_gather, "unchanged reshard", NEG),

]
