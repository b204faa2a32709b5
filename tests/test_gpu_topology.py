"""tools/gpu_topology.py: the GPU compile check, run here on the 8 CPU devices (structure only:
CPU permutes are synchronous), and its reading of a scheduled HLO module written by hand."""

import json

import pytest

from cmatmul_pass import cost
from tools import gpu_topology

SCHEDULED = """
HloModule scheduled, is_scheduled=true

%dot_body (a: f32[4,4], b: f32[4,4]) -> f32[4,4] {
  %a = f32[4,4]{1,0} parameter(0)
  %b = f32[4,4]{1,0} parameter(1)
  ROOT %d = f32[4,4]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (p0: f32[4,4], p1: f32[4,4]) -> (f32[4,4], f32[4,4], f32[4,4], f32[4,4], f32[4,4], f32[4,4]) {
  %p0 = f32[4,4]{1,0} parameter(0)
  %p1 = f32[4,4]{1,0} parameter(1)
  %hidden-start = (f32[4,4]{1,0}, f32[4,4]{1,0}) collective-permute-start(%p0), channel_id=1, source_target_pairs={{0,1},{1,0}}
  %dot.1 = f32[4,4]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %hidden-done = f32[4,4]{1,0} collective-permute-done(%hidden-start)
  %exposed-start = (f32[4,4]{1,0}, f32[4,4]{1,0}) collective-permute-start(%p1), channel_id=2, source_target_pairs={{0,1},{1,0}}
  %negate = f32[4,4]{1,0} negate(%p1)
  %exposed-done = f32[4,4]{1,0} collective-permute-done(%exposed-start)
  %call-start = ((f32[4,4]{1,0}, f32[4,4]{1,0}), f32[4,4]{1,0}) call-start(%p0, %p1), to_apply=%dot_body, frontend_attributes={_scheduling_group_id="0",_xla_stream_annotation="1"}
  %under-stream = f32[4,4]{1,0} collective-permute(%p0), channel_id=3, source_target_pairs={{0,1},{1,0}}, frontend_attributes={_scheduling_group_id="0"}
  %call-done = f32[4,4]{1,0} call-done(%call-start)
  %alone = f32[4,4]{1,0} collective-permute(%p1), channel_id=4, source_target_pairs={{0,1},{1,0}}
  ROOT %t = (f32[4,4]{1,0}, f32[4,4]{1,0}, f32[4,4]{1,0}, f32[4,4]{1,0}, f32[4,4]{1,0}, f32[4,4]{1,0}) tuple(%hidden-done, %exposed-done, %under-stream, %alone, %dot.1, %call-done)
}
"""


def test_overlap_is_read_from_the_schedule():
    """Four permutes: async with a dot between start and done (overlapped); async with only a
    negate between (exposed); synchronous while a stream-annotated dot is in flight
    (overlapped); synchronous with nothing in flight (exposed)."""
    from cmatmul_pass._jax_private import hlo_module_from_text

    result = gpu_topology.analyse(hlo_module_from_text(SCHEDULED))
    assert result["collectives"] == {
        "collective-permute": {"async": 2, "sync": 2, "overlapped": 2, "median_ops_between": 1,
                               "executed": 4, "overlapped_executed": 2}}
    assert result["async_computations"] == {"stream 1": 1}
    assert result["scheduling_groups"] == 1


LOOP = """
HloModule loop, is_scheduled=true

%body (p: (u32[], f32[4,4])) -> (u32[], f32[4,4]) {
  %p = (u32[], f32[4,4]{1,0}) parameter(0)
  %i = u32[] get-tuple-element(%p), index=0
  %x = f32[4,4]{1,0} get-tuple-element(%p), index=1
  %i.copy = u32[] copy(%i)
  %x.copy = f32[4,4]{1,0} copy(%x)
  %one = u32[] constant(1)
  %next = u32[] add(%i.copy, %one)
  %sent = f32[4,4]{1,0} collective-permute(%x.copy), channel_id=1, source_target_pairs={{0,1},{1,0}}
  %neg = f32[4,4]{1,0} negate(%x.copy)
  %cat = f32[8,4]{1,0} concatenate(%neg, %x.copy), dimensions={0}
  ROOT %t = (u32[], f32[4,4]{1,0}) tuple(%next, %sent)
}

%cond (p.1: (u32[], f32[4,4])) -> pred[] {
  %p.1 = (u32[], f32[4,4]{1,0}) parameter(0)
  %i.1 = u32[] get-tuple-element(%p.1), index=0
  %three = u32[] constant(3)
  ROOT %lt = pred[] compare(%i.1, %three), direction=LT
}

ENTRY %main (a: f32[4,4]) -> f32[4,4] {
  %a = f32[4,4]{1,0} parameter(0)
  %zero = u32[] constant(0)
  %init = (u32[], f32[4,4]{1,0}) tuple(%zero, %a)
  %w = (u32[], f32[4,4]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %entry.copy = f32[4,4]{1,0} copy(%a)
  ROOT %r = f32[4,4]{1,0} get-tuple-element(%w), index=1
}
"""


def test_loop_copies_count_what_each_trip_copies():
    """The f32[4,4] copy in the body (64 bytes, 3 trips) counts; the trip counter's scalar copy
    and the copy outside the loop do not."""
    from cmatmul_pass._jax_private import hlo_module_from_text

    module = hlo_module_from_text(LOOP)
    assert gpu_topology.analyse(module)["loop_copies"] == dict(
        loops=1, loops_copying=1, copies=1, bytes_per_trip=64, bytes_executed=192, concatenates=1)
    assert gpu_topology.result_bytes("%c = bf16[2,3]{1,0} copy(%x)") == 12
    assert gpu_topology.result_bytes("%c = (f32[2]{0}, u32[]) copy-start(%x)") == 0


SLICES = """
HloModule slices, is_scheduled=true

%sliced (p0: f32[8,4], p1: u32[]) -> f32[4,4] {
  %p0 = f32[8,4]{1,0} parameter(0)
  %p1 = u32[] parameter(1)
  %z = u32[] constant(0)
  ROOT %ds = f32[4,4]{1,0} dynamic-slice(%p0, %p1, %z), dynamic_slice_sizes={4,4}
}

%placed (q0: f32[8,4], q1: f32[4,4], q2: u32[]) -> f32[8,4] {
  %q0 = f32[8,4]{1,0} parameter(0)
  %q1 = f32[4,4]{1,0} parameter(1)
  %q2 = u32[] parameter(2)
  %z.1 = u32[] constant(0)
  ROOT %dus = f32[8,4]{1,0} dynamic-update-slice(%q0, %q1, %q2, %z.1)
}

%body (p: (u32[], f32[8,4], f32[8,4])) -> (u32[], f32[8,4], f32[8,4]) {
  %p = (u32[], f32[8,4]{1,0}, f32[8,4]{1,0}) parameter(0)
  %i = u32[] get-tuple-element(%p), index=0
  %y = f32[8,4]{1,0} get-tuple-element(%p), index=1
  %acc = f32[8,4]{1,0} get-tuple-element(%p), index=2
  %block = f32[4,4]{1,0} fusion(%y, %i), kind=kLoop, calls=%sliced
  %d = f32[4,4]{1,0} dot(%block, %block), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %acc.1 = f32[8,4]{1,0} fusion(%acc, %d, %i), kind=kLoop, calls=%placed
  %one = u32[] constant(1)
  %next = u32[] add(%i, %one)
  ROOT %t = (u32[], f32[8,4]{1,0}, f32[8,4]{1,0}) tuple(%next, %y, %acc.1)
}

%cond (p.1: (u32[], f32[8,4], f32[8,4])) -> pred[] {
  %p.1 = (u32[], f32[8,4]{1,0}, f32[8,4]{1,0}) parameter(0)
  %i.1 = u32[] get-tuple-element(%p.1), index=0
  %three = u32[] constant(3)
  ROOT %lt = pred[] compare(%i.1, %three), direction=LT
}

ENTRY %main (a: f32[8,4], b: f32[8,4], k: u32[]) -> f32[4,4] {
  %a = f32[8,4]{1,0} parameter(0)
  %b = f32[8,4]{1,0} parameter(1)
  %k = u32[] parameter(2)
  %zero = u32[] constant(0)
  %init = (u32[], f32[8,4]{1,0}, f32[8,4]{1,0}) tuple(%zero, %a, %b)
  %loop = (u32[], f32[8,4]{1,0}, f32[8,4]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %out = f32[8,4]{1,0} get-tuple-element(%loop), index=2
  %z.2 = u32[] constant(0)
  ROOT %last = f32[4,4]{1,0} dynamic-slice(%out, %k, %z.2), dynamic_slice_sizes={4,4}
}
"""


def test_slice_copies_count_the_dynamic_slices_run_as_kernels():
    """The loop body's slice fusion (64 bytes, 3 trips) and the entry's bare dynamic-slice (64
    bytes, once) count; the dynamic-update-slice fusion does not."""
    from cmatmul_pass._jax_private import hlo_module_from_text

    assert gpu_topology.analyse(hlo_module_from_text(SLICES))["slice_copies"] == dict(
        kernels=2, executed=4, bytes_executed=256)


DYNAMIC_SLICE_FUSION = """
HloModule dsf, is_scheduled=true

%address (p0: f32[8,4], p1: f32[4,4], p2: u32[]) -> f32[4,4] {
  %p0 = f32[8,4]{1,0} parameter(0)
  %p1 = f32[4,4]{1,0} parameter(1)
  %p2 = u32[] parameter(2)
  %z = u32[] constant(0)
  %ds = f32[4,4]{1,0} dynamic-slice(%p0, %p2, %z), dynamic_slice_sizes={4,4}
  %g = (f32[4,4]{1,0}, s8[16]{0}) custom-call(%ds, %p1), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"alpha_real":1,"beta":0,"alpha_imag":0}}
  ROOT %r = f32[4,4]{1,0} get-tuple-element(%g), index=0
}

ENTRY %main (a: f32[8,4], b: f32[4,4], k: u32[]) -> f32[4,4] {
  %a = f32[8,4]{1,0} parameter(0)
  %b = f32[4,4]{1,0} parameter(1)
  %k = u32[] parameter(2)
  ROOT %f = f32[4,4]{1,0} fusion(%a, %b, %k), kind=kCustom, calls=%address
}
"""


def test_a_gemm_that_reads_its_block_in_place_is_no_slice_copy():
    """XLA's dynamic slice fusion (the uni-dsf program) puts the slice in the GEMM's fusion: the
    GEMM reads its operand's block at the offset itself, so nothing is copied out."""
    from cmatmul_pass._jax_private import hlo_module_from_text

    result = gpu_topology.analyse(hlo_module_from_text(DYNAMIC_SLICE_FUSION))
    assert result["slice_copies"] == dict(kernels=0, executed=0, bytes_executed=0)
    assert "uni-dsf" in gpu_topology.PROGRAMS and "uni-dsf" not in gpu_topology.DEFAULT_PROGRAMS


RING = """
HloModule ring, is_scheduled=true

%body (p: (u32[], f32[4,4], f32[4,4])) -> (u32[], f32[4,4], f32[4,4]) {
  %p = (u32[], f32[4,4]{1,0}, f32[4,4]{1,0}) parameter(0)
  %i = u32[] get-tuple-element(%p), index=0
  %x = f32[4,4]{1,0} get-tuple-element(%p), index=1
  %w = f32[4,4]{1,0} get-tuple-element(%p), index=2
  %one = u32[] constant(1)
  %next = u32[] add(%i, %one)
  %send = (f32[4,4]{1,0}, f32[4,4]{1,0}) collective-permute-start(%x), channel_id=1, source_target_pairs={{0,1},{1,0}}
  %d = f32[4,4]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %sent = f32[4,4]{1,0} collective-permute-done(%send)
  %acc = f32[4,4]{1,0} add(%d, %sent)
  ROOT %t = (u32[], f32[4,4]{1,0}, f32[4,4]{1,0}) tuple(%next, %acc, %w)
}

%cond (p.1: (u32[], f32[4,4], f32[4,4])) -> pred[] {
  %p.1 = (u32[], f32[4,4]{1,0}, f32[4,4]{1,0}) parameter(0)
  %i.1 = u32[] get-tuple-element(%p.1), index=0
  %three = u32[] constant(3)
  ROOT %lt = pred[] compare(%i.1, %three), direction=LT
}

ENTRY %main (a: f32[4,4], b: f32[4,4]) -> f32[4,4] {
  %a = f32[4,4]{1,0} parameter(0)
  %b = f32[4,4]{1,0} parameter(1)
  %zero = u32[] constant(0)
  %init = (u32[], f32[4,4]{1,0}, f32[4,4]{1,0}) tuple(%zero, %a, %b)
  %loop = (u32[], f32[4,4]{1,0}, f32[4,4]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %out = f32[4,4]{1,0} get-tuple-element(%loop), index=1
  ROOT %last = f32[4,4]{1,0} collective-permute(%out), channel_id=2, source_target_pairs={{0,1},{1,0}}
}
"""


GEMMS = """
HloModule gemms, is_scheduled=true

%body (p: (u32[], f32[4,4], f32[4,4])) -> (u32[], f32[4,4], f32[4,4]) {
  %p = (u32[], f32[4,4]{1,0}, f32[4,4]{1,0}) parameter(0)
  %i = u32[] get-tuple-element(%p), index=0
  %x = f32[4,4]{1,0} get-tuple-element(%p), index=1
  %acc = f32[4,4]{1,0} get-tuple-element(%p), index=2
  %g = (f32[4,4]{1,0}, s8[16]{0}) custom-call(%x, %x, %acc), custom_call_target="__cublas$gemm", output_to_operand_aliasing={{0}: (2, {})}, backend_config={"gemm_backend_config":{"alpha_real":1,"beta":1,"alpha_imag":0}}
  %acc.1 = f32[4,4]{1,0} get-tuple-element(%g), index=0
  %one = u32[] constant(1)
  %next = u32[] add(%i, %one)
  ROOT %t = (u32[], f32[4,4]{1,0}, f32[4,4]{1,0}) tuple(%next, %x, %acc.1)
}

%cond (p.1: (u32[], f32[4,4], f32[4,4])) -> pred[] {
  %p.1 = (u32[], f32[4,4]{1,0}, f32[4,4]{1,0}) parameter(0)
  %i.1 = u32[] get-tuple-element(%p.1), index=0
  %seven = u32[] constant(7)
  ROOT %lt = pred[] compare(%i.1, %seven), direction=LT
}

ENTRY %main (a: f32[4,4], b: f32[4,4]) -> f32[4,4] {
  %a = f32[4,4]{1,0} parameter(0)
  %b = f32[4,4]{1,0} parameter(1)
  %plain = (f32[4,4]{1,0}, s8[16]{0}) custom-call(%a, %b), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"alpha_real":1,"beta":0,"alpha_imag":0}}
  %product = f32[4,4]{1,0} get-tuple-element(%plain), index=0
  %zero = u32[] constant(0)
  %init = (u32[], f32[4,4]{1,0}, f32[4,4]{1,0}) tuple(%zero, %product, %b)
  %loop = (u32[], f32[4,4]{1,0}, f32[4,4]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"7"}}
  ROOT %out = f32[4,4]{1,0} get-tuple-element(%loop), index=2
}
"""


def test_accumulating_gemms_count_the_gemms_that_add_to_an_operand():
    """The loop's GEMM adds its product to the accumulator (beta 1: 7 trips), the entry's does not."""
    from cmatmul_pass._jax_private import hlo_module_from_text

    module = hlo_module_from_text(GEMMS)
    assert gpu_topology.analyse(module)["accumulating_gemms"] == dict(
        gemms=2, accumulating=1, gemms_executed=8, accumulating_executed=7)


def test_overlap_counts_each_trip_and_becomes_the_cost_models():
    """A hidden permute in a loop of 3 trips and an exposed one after it: 2 permute ops, 1
    overlapped; 4 executed, 3 overlapped.  The fraction as executed is the profile's overlap."""
    from cmatmul_pass import cost
    from cmatmul_pass._jax_private import hlo_module_from_text

    row = gpu_topology.analyse(hlo_module_from_text(RING))
    permutes = row["collectives"]["collective-permute"]
    assert (permutes["async"], permutes["sync"], permutes["overlapped"]) == (1, 1, 1)
    assert (permutes["executed"], permutes["overlapped_executed"]) == (4, 3)
    fractions = gpu_topology.overlap_fractions({"original": {"collectives": {}}, "uni": row, "uni-streams": row})
    assert fractions == {"uni": 0.75}
    override = gpu_topology.hardware_override("h200", fractions)
    assert override == "h200:overlap.uni=0.750" and cost.hardware(override).hidden("uni") == 0.75
    # results written before the executed counts: per permute op
    del permutes["executed"], permutes["overlapped_executed"]
    assert gpu_topology.overlap_fractions({"bidi": row}) == {"bidi": 0.5}


def test_unexpected_attributes_are_dropped_before_parsing():
    """XLA's printer writes attributes its parser rejects (jax 0.11.2: output_to_operand_aliasing
    on all-reduce-start); the reader drops each one the parser names, and nothing else."""
    text = SCHEDULED.replace("channel_id=4,", "channel_id=4, made_up_attribute={{1}: (0, {})},")

    class Compiled:
        def as_text(self):
            return text

    from cmatmul_pass._jax_private import hlo_module_from_text

    with pytest.raises(Exception, match="made_up_attribute"):
        hlo_module_from_text(text)
    result = gpu_topology.analyse(gpu_topology.optimized_module(Compiled()))
    assert result["collectives"]["collective-permute"]["sync"] == 2


def test_compiles_the_training_step_and_counts_what_xla_kept(tmp_path):
    """On CPU: every all_gather and reduce_scatter of the original is gone from each variant's
    optimised module, and the permutes XLA kept agree with what the pass reports: one per
    loop body (uni), every permute each device executes (full, straight-line)."""
    out = tmp_path / "topology.json"
    assert gpu_topology.main(["--platform", "cpu", "--model", "tiny", "--repeats", "1",
                              "--programs", "uni", "full", "uni-streams", "auto", "--profile", "h200",
                              "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["devices"] == 8 and result["layers"] == 2
    programs = result["programs"]
    original = programs["original"]["collectives"]
    assert original["all-gather"]["sync"] > 0 and original["reduce-scatter"]["sync"] > 0
    assert "collective-permute" not in original and programs["original"]["while_loops"] == 0
    for name in ("uni", "full", "uni-streams"):
        row = programs[name]
        assert row["rewritten"] == row["sites"] == original["all-gather"]["sync"] + original["reduce-scatter"]["sync"]
        assert "all-gather" not in row["collectives"] and "reduce-scatter" not in row["collectives"]
        assert row["compile_ratio"] > 0 and row["pass_s"] > 0 and 0 < row["pass_over_lower_compile"]
    permutes = {name: programs[name]["collectives"]["collective-permute"]["sync"] for name in programs if "sites" in programs[name]}
    assert permutes["uni"] == programs["uni"]["while_loops"] == programs["uni"]["rewritten"]
    assert permutes["full"] == programs["full"]["permutes_executed"] and programs["full"]["while_loops"] == 0
    for name in ("uni", "full", "auto"):  # counted once per loop trip, the permutes each device runs are the pass's count
        assert programs[name]["collectives"]["collective-permute"]["executed"] == programs[name]["permutes_executed"]
    # auto: each site the variant the model picks for --profile, counted per variant
    auto = programs["auto"]
    assert auto["rewritten"] == programs["uni"]["rewritten"] == sum(auto["variants"].values())
    assert set(auto["variants"]) <= set(cost.VARIANTS) and "auto" not in result["overlap"]
    assert result["overlap"] == {"uni": 0.0, "full": 0.0}  # CPU permutes are synchronous: nothing overlaps
    assert programs["uni-streams"]["scheduling_groups"] == programs["uni-streams"]["rewritten"]
    # XLA CPU's copy insertion copies the shard a one-round trip sends where the permute reads the
    # loop slot itself (here the forward gathers; XLA CPU moves the others' bf16 as f32, and the
    # converted value is a fresh buffer)
    copies = programs["uni"]["loop_copies"]
    assert copies["loops"] == programs["uni"]["while_loops"] and 0 < copies["loops_copying"] <= copies["loops"]
    assert copies["copies"] >= copies["loops_copying"] and copies["bytes_executed"] > copies["bytes_per_trip"] > 0
    assert programs["full"]["loop_copies"] == dict(loops=0, loops_copying=0, copies=0, bytes_per_trip=0, bytes_executed=0,
                                                   concatenates=0)
    # the rings' per-round dynamic slices (the scatters' operand blocks) are kernels of their own on
    # CPU; the original slices nothing; a loop's slices run once per trip, as the straight line's do
    slices = {name: programs[name]["slice_copies"] for name in ("original", "uni", "full")}
    assert slices["original"] == dict(kernels=0, executed=0, bytes_executed=0)
    assert 0 < slices["uni"]["kernels"] < slices["uni"]["executed"] == slices["full"]["executed"] == slices["full"]["kernels"]
    assert slices["uni"]["bytes_executed"] == slices["full"]["bytes_executed"] > 0


@pytest.mark.parametrize("options", [{"variant": v} for v in ("uni", "unroll2", "bidi")], ids=["uni", "unroll2", "bidi"])
def test_a_scatter_ring_copies_nothing_per_trip_where_a_gather_ring_copies_its_shard(options):
    """On CPU (XLA's copy insertion orders by data flow alone there): a scatter ring's partial sum
    is read only by the permute that sends it, and the sum it keeps is made after the receive, so
    its loop copies nothing; a one-round gather loop copies the shard it sends, whose slot the
    trip's dot still reads (docs/gpu.md: 'The per-trip copy of the shard')."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    import cmatmul_pass

    mesh = jax.make_mesh((8,), ("model",))
    col, row = P(None, "model"), P("model", None)

    def typed(shape, spec):
        return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec))

    def scatter(y, w):
        return jax.lax.psum_scatter(y @ w, "model", scatter_dimension=0, tiled=True)

    def gather(x, w):
        return jax.lax.all_gather(x, "model", axis=0, tiled=True) @ w

    programs = {"scatter": (scatter, (col, row), row, (typed((64, 32), col), typed((32, 16), row))),
                "gather": (gather, (row, col), col, (typed((64, 16), row), typed((16, 32), col)))}
    copies = {}
    for name, (body, in_specs, out_specs, args) in programs.items():
        fn = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
        compiled = cmatmul_pass.jit(fn, **options).lower(*args).compile()
        copies[name] = gpu_topology.analyse(gpu_topology.optimized_module(compiled))["loop_copies"]
    assert copies["scatter"]["loops"] == 1 and copies["scatter"]["copies"] == 0
    assert copies["gather"]["loops"] == 1
    if options["variant"] == "uni":  # named: the default variant is not uni
        assert copies["gather"]["copies"] == 1 and copies["gather"]["bytes_per_trip"] == 8 * 16 * 4
