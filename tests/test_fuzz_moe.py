"""The MoE kind of the differential fuzzer, the fixed-seed slice CI runs (``tools/fuzz.py --kind
moe`` runs a campaign): MoE blocks of grouped matmuls over FSDP-gathered expert weights, in the
three forms a lowering takes, top-1 and top-2, skewed routing (empty experts), a shared expert,
bf16 and f32, forward and training step, under every variant; expert-parallel blocks exchanging
capacity-padded slots (all_to_all pairs); and pinned programs."""

from hypothesis import HealthCheck, given, settings

from tools import fuzz_moe, fuzz_programs


def run(spec, variants=fuzz_programs.VARIANTS):
    tally = fuzz_moe.check(spec, variants=variants)
    assert not tally.crashes, tally.crashes
    assert not tally.mismatches, tally.mismatches
    return tally


@settings(max_examples=4, derandomize=True, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(fuzz_moe.moe_specs())
def test_random_moe_blocks_under_every_variant(spec):
    tally = run(spec)
    assert tally.runs == len(fuzz_programs.VARIANTS)


def test_a_bf16_expert_weight_gathered_along_its_rows_rings_in_the_composite_form():
    """A contracting ring of a bf16 grouped matmul accumulates its partial sums in f32: each
    block's composite names a decomposition returning f32 (the template's returns bf16, and the
    block's result is converted), not one that does not verify."""
    spec = fuzz_moe.MoeSpec(form="export", ring=8, experts=4, top_k=2, tokens=16, hidden=16, ffn=16,
                            along=("rows", "cols", "cols"), skew=True, shared=True, dtype="bf16", grad=False)
    tally = run(spec, {"uni": fuzz_programs.VARIANTS["uni"]})
    assert tally.sites_rewritten == 6


def test_the_oracle_catches_a_grouped_block_with_the_wrong_group_sizes(monkeypatch):
    """A ring whose blocks use another group's sizes is reported as a mismatch, not passed."""
    from cmatmul_pass.rewrites import grouped

    real = grouped.grouped_dot

    def reversed_sizes(template, result_type, lhs, rhs, loc, sizes=()):
        from cmatmul_pass._jax_private import ir

        sizes = sizes or tuple(list(template.operation.operands)[2:])
        (counts,) = sizes
        t = ir.RankedTensorType(counts.type)
        flipped = ir.Operation.create("stablehlo.reverse", results=[t], operands=[counts],
                                      attributes={"dimensions": ir.DenseI64ArrayAttr.get([0])}, loc=loc).result
        return real(template, result_type, lhs, rhs, loc, (flipped,))

    monkeypatch.setattr(grouped, "grouped_dot", reversed_sizes)
    spec = fuzz_moe.MoeSpec(form="gpu", ring=4, experts=4, top_k=1, tokens=8, hidden=8, ffn=16,
                            along=("cols", "cols", "rows"), skew=True, shared=False, dtype="f32", grad=False)
    tally = fuzz_moe.check(spec, variants={"uni": fuzz_programs.VARIANTS["uni"]})
    assert len(tally.mismatches) == 1, (tally.crashes, tally.mismatches)


@settings(max_examples=3, derandomize=True, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(fuzz_moe.ep_specs())
def test_random_expert_parallel_blocks(spec):
    run(spec, {name: fuzz_programs.VARIANTS[name] for name in ("uni", "auto")})


def test_an_expert_parallel_training_step_with_silu_calls_chunks_both_pairs():
    """``jax.nn.silu`` under value_and_grad lowers to calls of private functions (its custom_jvp's
    rule, three results): applied per chunk from their bodies; the forward's and the backward's
    pairs chunked, a per-row mask read at each chunk's rows, top-2, bf16."""
    spec = fuzz_moe.EpSpec(ring=4, experts_per_device=2, capacity=8, top_k=2, tokens=8, hidden=8, ffn=16,
                           between="silu_mask", dtype="bf16", grad=True)
    tally = run(spec, {"uni": fuzz_programs.VARIANTS["uni"]})
    assert tally.sites_rewritten == 2


@settings(max_examples=2, derandomize=True, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(fuzz_moe.ulysses_specs())
def test_random_ulysses_attention(spec):
    run(spec, {name: fuzz_programs.VARIANTS[name] for name in ("uni", "auto")})
