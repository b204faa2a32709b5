"""Why a candidate site was left unchanged, and what the user can change to get it rewritten.

Every reason code the pass can put in a report (``SiteReport.reason_code``: a matcher's or a
rewrite's :class:`~cmatmul_pass.errors.Decline`, or the options' verdict: ``policy``,
``min_bytes``, ``chunks``) has one :class:`Reason` here; ``explain`` prints its hint after each
declined site, and ``docs/reasons.md`` is the same table for readers (a test keeps the two and
the code in step).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Reason:
    code: str
    #: what the pass found, in one sentence
    meaning: str
    #: what the user can change so that the site is rewritten (or why nothing can)
    hint: str
    #: ``explain``'s arguments on a bundled file that shows the code (``()``: none bundled)
    example: tuple[str, ...] = ()


REASONS: dict[str, Reason] = {r.code: r for r in (
    # ---- the module
    Reason("no_num_partitions", "the module has no `mhlo.num_partitions`, so the ring cannot be sized",
           "lower the program with jax (`jax.jit(f).lower(...)`) on a mesh of several devices; the attribute is "
           "written by the lowering",
           ("hlo_samples/neg_no_num_partitions.mlir",)),
    Reason("replicas", "the module runs several replicas (`mhlo.num_replicas` > 1)",
           "use one replica and partition over the devices (a shard_map over a mesh), as jax does by default",
           ("hlo_samples/neg_two_replicas.mlir",)),
    Reason("cross_replica", "the collective groups replicas, not partitions (no `channel_handle` with "
                            "`use_global_device_ids`)",
           "write the collective inside `jax.shard_map` (lax.all_gather / psum_scatter / psum over a mesh axis); "
           "pmap-style cross-replica collectives are not rewritten",
           ("hlo_samples/neg_cross_replica.mlir",)),
    Reason("partial_manual", "a partial-manual shard_map region where the ring position cannot be proven the same "
                             "on the free mesh axes (the legacy partitioner's bodies, or groups mixing positions "
                             "along an automatic axis)",
           "lower with Shardy, jax's default partitioner (`jax_use_shardy_partitioner=True`), or make the shard_map "
           "manual over every mesh axis (`axis_names` unset)",
           ("hlo_samples/neg_partial_manual_legacy.mlir",)),
    # ---- the collective
    Reason("variadic", "the collective has several operands (one all_gather of a tuple)",
           "gather or scatter each array with its own collective (one `lax.all_gather` per array)",
           ("hlo_samples/neg_variadic.mlir",)),
    Reason("replica_groups", "the replica groups are not equal-size groups listing every partition exactly once, "
                             "or name a mesh or axis the pass cannot read",
           "collect over whole mesh axes of one `jax.make_mesh` mesh (`lax.all_gather(x, 'model')`), so that every "
           "device is in exactly one group of equal size",
           ("tests/bad_inputs/groups_miss_partitions.mlir",)),
    Reason("ring_size_1", "every replica group has one member: nothing is communicated",
           "nothing to gain: a collective over a mesh axis of size 1 moves no data",
           ("tests/bad_inputs/ring_of_one.mlir",)),
    Reason("dynamic_shape", "a value on the path is dynamically shaped or unranked",
           "lower with static shapes (concrete input shapes, no `jax.export` symbolic dims)",
           ("tests/bad_inputs/dynamic_shapes.mlir",)),
    Reason("shape", "the gathered or scattered dim is not the ring size times the shard's",
           "make the collective's dim a multiple of the mesh axis size (pad the sequence or batch)",
           ("tests/bad_inputs/scatter_not_a_multiple.mlir",)),
    Reason("not_sum", "the reduce_scatter's or all_reduce's reduction is not a sum",
           "only sums are rewritten: `psum_scatter` / `psum` (a `pmax` or a product stays a collective)",
           ("hlo_samples/neg_rs_not_sum.mlir",)),
    # ---- all_gather → dot
    Reason("no_users", "the gathered value is unused",
           "nothing to overlap: remove the all_gather (jax normally drops it)",
           ("tests/bad_inputs/gather_unused.mlir",)),
    Reason("user_not_dot", "the gathered value feeds no dot_general",
           "only gathers whose value feeds a matmul are rewritten; move the op between the gather and the dot "
           "before the gather (apply it to the shard), or inline the called function",
           ("hlo_samples/neg_user_not_dot.mlir",)),
    Reason("two_stage", "the gathered value feeds a second all_gather over other device groups (a weight sharded "
                        "over two mesh axes, gathered in two stages) and the two were not merged into one: this one "
                        "stays a plain gather ahead of the second stage, whose value the dot reads and which has the "
                        "ring (the stages gather along different dims and cannot merge, or `--policy auto` predicts "
                        "that ring alone faster than the merged one), or under `--policy auto` stays a plain gather "
                        "too (no ring pays); the reason gives each option's predicted time",
           "`--policy all` merges two stages along one dim into one gather and one ring (the default, `--policy "
           "auto`, merges where the merged ring pays); by hand, gather over both axes at once "
           "(`jax.lax.all_gather(w, ('model', 'data'), axis=..., tiled=True)`), the weight sharded over both along "
           "that dim",
           ("hlo_samples/ag_two_stage.mlir", "--policy", "auto")),
    Reason("both_operands", "the gathered value reaches both operands of the dot (`g @ g.T`)",
           "gather the two operands separately (two `lax.all_gather` calls) or compute the product from the shard",
           ("hlo_samples/neg_both_operands.mlir",)),
    Reason("other_block", "the dot and the collective are in different regions (a loop body, a branch)",
           "put the collective and the matmul in the same function body (inside the same `lax.scan` step)",
           ("hlo_samples/neg_other_block.mlir",)),
    Reason("layout", "an op between the collective and the dot does not keep blocks of the ring dim whole (a "
                     "reshape that splits it, an elementwise op whose other operand varies along it)",
           "reshape before the gather or after the dot, and scale per row after the dot rather than before it; a "
           "row-wise op after a gather (a norm of the gathered rows) is moved past where its ring is rewritten, "
           "the gather then ringing with the dot; where the gathered rows are also read elsewhere (a residual), the "
           "ring applies the norm to each block and assembles the rows, unless `--no-assemble`",
           ("hlo_samples/neg_reshape_splits_ring_dim.mlir",)),
    Reason("schedule", "the dots reading the gathered value need values computed after another reader of it: no "
                       "single place for the ring",
           "compute what the dots need (their other operands) before the gather's other readers, or give the "
           "dots their own gather",
           ("hlo_samples/neg_schedule.mlir",)),
    Reason("multiple_users", "the product or the gathered value is also read elsewhere, and the pass was asked not "
                             "to assemble it (`--no-assemble`), or a scattered product is needed whole",
           "drop `--no-assemble` / `assemble=False`; for a scatter, read the scattered result instead of the "
           "full product",
           ("hlo_samples/neg_rs_multiple_users.mlir",)),
    # ---- dot → reduce_scatter, dot → all_reduce
    Reason("producer_not_dot", "the scattered or summed value is not a dot_general's (or a sum of dots')",
           "scatter or psum the matmul's result itself; a per-row op along the scattered dim goes after the "
           "collective. A sum of what no matmul computes in this block (a loss, a norm's statistics, a loop's "
           "carry) has no ring: it stays as written; where matmuls alone read such a psum (an incoming "
           "cotangent), it is split and its gather rings with them, unless that ring is declined (then it says so)",
           ("hlo_samples/neg_rs_producer_not_dot.mlir",)),
    Reason("ragged_dot", "the ring would cut a grouped matmul (`jax.lax.ragged_dot`: `chlo.ragged_dot`, an MoE "
                         "block's expert matmul) along its ragged rows (the tokens, which the group sizes assign to "
                         "experts by position), its experts or a batch dim; or a grouped matmul stands past ops the "
                         "ring cannot apply per block (an un-permute of the tokens)",
           "a grouped matmul rings along its expert weights' columns or rows (FSDP over the weights' features) "
           "and its product's features: gather or scatter those; the tokens' collectives stay. The "
           "capacity-padded dense form of the block (GShard, Switch: a one-hot dispatch einsum of the tokens "
           "into [experts, capacity, hidden], the experts' einsums, a combine einsum back) puts dense matmuls "
           "next to the collectives, and the rings take them",
           ("hlo_samples/neg_rs_ragged_dot.mlir",)),
    Reason("reshard", "the all_gather's value is only sliced by `dynamic_slice` along another dim, each device "
                      "keeping its own part: a reshard (an all_to_all in disguise), no matmul input",
           "nothing to overlap: write it as `jax.lax.all_to_all` (it moves 1/n of the bytes), or let the "
           "next matmul read the gathered value itself",
           ("hlo_samples/neg_reshard.mlir",)),
    Reason("gathered_operand", "the scattered dim is the dim the dot's operand was all_gathered on: the gather's ring "
                               "takes this dot instead (over other device groups, where that gather has compute before "
                               "the dot to hide behind, it stays a plain, prefetchable all_gather and this scatter "
                               "rings instead)",
           "nothing to change: the all_gather's ring computes the dot (scatter along another dim to get both rings)",
           ("hlo_samples/chain_same_dim.mlir",)),
    Reason("no_dim", "no dim of the psum's product can be split over the ring (a scalar, or no dim the group "
                     "size divides)",
           "make the token (row) count a multiple of the mesh axis size",
           ("hlo_samples/neg_ar_not_divisible.mlir",)),
    Reason("chunks", "`--all-reduce chunk`: the rows cannot be cut into equal chunks that every op after the dot "
                     "keeps whole",
           "pick a `--chunks` K that divides the rows, or use `--all-reduce split`",
           ("hlo_samples/ar_megatron_mlp.mlir", "--all-reduce", "chunk", "--chunks", "3")),
    Reason("chunked", "the psum (or all_to_all pair) is already in chunks: its collective is one of several whose "
                      "results are concatenated (the chunk strategy's output, or chunked by hand), each already "
                      "overlapping a neighbouring chunk's compute",
           "none needed (a second run of the pass leaves its own chunks); for a psum's ring instead, psum the whole "
           "product once and use `--all-reduce split`",
           ("hlo_samples/neg_ar_chunked.mlir",)),
    Reason("varies", "a row-wise op after a split psum reads a value that may differ between the group's devices: "
                     "the gather cannot move past it",
           "none needed: the gather is placed before that op (explain's `gathered:` line says where)"),
    # ---- two collectives at one dot (a 2-D mesh: analysis.slack)
    Reason("prefetchable", "the transfer is already off its matmul's critical path: the dot's other collective (the "
                           "activation's) has the ring and this one (a weight's) can be sent early, behind compute "
                           "that precedes the dot; or the program moves the value between shard_map regions itself (a "
                           "gather for a dot in a later region, a scatter of a dot's result from an earlier one: a "
                           "hand-written prefetch)",
           "none needed: on GPU XLA's latency-hiding scheduler (`--xla_gpu_enable_latency_hiding_scheduler=true`) "
           "issues it early and hides it behind that compute",
           ("hlo_samples/fsdp_tp.mlir", "--variant", "uni")),
    Reason("lost_to_ring", "the dot's other collective has the ring (the larger transfer); no compute precedes the dot "
                           "that could hide this one",
           "none needed for the larger transfer, which the other ring hides; which collective gets the ring is "
           "decided by slack, not by the ring `--variant` (bidi-full leaves this one too). With compute before the dot "
           "(in a model, an earlier layer's), this one would be `prefetchable`: issued early behind that compute",
           ("hlo_samples/fsdp_tp.mlir",)),
    # ---- the pass itself
    Reason("pass_error", "the pass failed while working on this collective (an exception, IR that does not verify, "
                         "or a collective it would put where its group may not run it alike); it left the collective "
                         "as written and rewrote the others",
           "a cmatmul_pass bug: please report it with the module (`--report-json` names the failure); the rest of "
           "the module is rewritten and checked as usual"),
    # ---- all_to_all pairs
    Reason("a2a_unpaired", "an all_to_all whose values reach no single all_to_all over the same devices (a lone "
                           "exchange, or several after it)",
           "nothing to chunk it with: the pass overlaps an all_to_all pair (an MoE block's dispatch and combine, "
           "Ulysses' exchange and its return) with the ops between them"),
    Reason("a2a_region", "an op between the two all_to_alls mixes the rows the chunks would keep apart (a reduce or "
                         "a contraction over them, a reshape merging them), is read outside the pair, or reads a "
                         "value that a chunk could only take strided over the devices' rows",
           "keep the ops between the exchanges per row of a dim the exchanges do not split (the capacity of an MoE "
           "dispatch, the batch): the reason names the op",
           ("hlo_samples/neg_a2a_region.mlir",)),
    Reason("a2a_no_dim", "no dim of the exchanged value divides into 2, 4 or 8 chunks (or `--chunks`) that both "
                         "exchanges keep whole",
           "pad the capacity (or the dim the ops keep apart) to a multiple of the chunk count"),
    # ---- attention over gathered keys and values
    Reason("attn_region", "an attention's gathered K or V is read by something other than its matmul (through ops "
                          "that keep the sequence apart), or V comes from another gather than K's groups",
           "read the gathered keys and values only in the attention (a mask from positions, not from the keys); "
           "its two gathers get rings of their own meanwhile"),
    Reason("attn_softmax", "the softmax over the gathered sequence is not `max`, `exp(s - max)`, `sum`, divide, "
                           "or the probabilities reach `P·V` through an op that is not linear in them",
           "write the softmax as `jax.nn.softmax` (or `exp(s - max) / sum`) over the keys' axis, with masks and "
           "scales applied to the scores before it; the reason names the op",
           ("hlo_samples/neg_attn_softmax.mlir", "--policy", "all")),
    Reason("attn_residual", "a value of the attention (the probabilities, the scores, the gathered K or V) is also "
                            "read after it: a training step's forward saving residuals for its backward",
           "the online softmax never holds the whole probability matrix its backward reads; the attention keeps "
           "two rings (scores, then `P·V`). Wrap the attention in `jax.checkpoint` so the backward recomputes it",
           ("hlo_samples/attn_cp_grad.mlir", "--policy", "all")),
    # ---- regions over gathered columns (attention's backward)
    Reason("cols_region", "a region that gathers along a dim, takes statistics over it and reads them back "
                          "(attention's backward) holds a value the passes cannot compute a block at a time: a "
                          "column value read after the region or inside a loop, an op that is not separable along "
                          "the dim, a statistic's row value computed by an op with effects",
           "the reason names the op; the region's gathers and scatters get rings of their own meanwhile",
           ("hlo_samples/neg_cols_region.mlir", "--policy", "all")),
    # ---- the options' verdict
    Reason("policy", "`--policy auto`: the cost model predicts too small a gain on `--hardware`",
           "use `--policy all`, another `--variant` (the reason names one that would pass, if any), "
           "or a `--hardware` profile that describes your machine",
           ("hlo_samples/sp_mlp.mlir", "--policy", "auto")),
    Reason("step", "`--policy auto`: the site's own prediction pays, but the whole step's schedule is predicted "
                   "slower with its place's rings than without (its collective already runs beside other work, "
                   "which the ring, holding both streams, would delay)",
           "nothing to gain on `--hardware` by the cost model; `--policy all` rewrites it anyway (measure with "
           "`cmatmul_pass.jit(variant=\"measure\")` or `bench` on the machine)",
           ("hlo_samples/ag_gqa_grad.mlir", "--policy", "auto", "--hardware", "h100:bandwidth=1e8,bf16=1e9,step=1e-9")),
    Reason("min_bytes", "the site moves fewer bytes per device than `--min-bytes`",
           "lower `--min-bytes` (0, the default, rewrites every size)",
           ("hlo_samples/sp_mlp.mlir", "--min-bytes", "1000000")),
    Reason("compile_budget", "`--policy auto`: the site's ring, in every variant that pays, would take the rewritten "
                             "program's predicted XLA compile time past `--compile-budget` times the original's "
                             "(sites are taken in program order; the earlier ones spent it)",
           "raise `--compile-budget` (or `none`), or accept the original's serial collective here; with "
           "`--policy all` every legal site is rewritten whatever its size",
           ("hlo_samples/sp_mlp.mlir", "--policy", "auto", "--compile-budget", "1",
            "--hardware", "h100:bandwidth=1e7,f32=1e9,step=1e-9")),
)}


def hint(code: str) -> str:
    """What the user can change about a site declined with ``code`` ("" for an unknown code)."""
    reason = REASONS.get(code)
    return reason.hint if reason else ""
