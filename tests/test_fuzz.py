"""Differential fuzzing, the fixed-seed slice CI runs (``make fuzz`` runs the full campaign).

Random shard_map programs — meshes of 2 to 8 devices in 1-3 dims over permuted devices, collectives
over one or two axes, gathered/scattered dims free, contracting or batch, either operand side,
tiled/untiled, f32/bf16/f16/f64/complex64/int32, several consumers and non-dot readers, chains and
SP MLP blocks, partial-manual regions — each rewritten under every pass variant: the result must
verify, its permutes must form the groups' rings, and it must compute the original's numbers.
"""

from hypothesis import HealthCheck, given, settings

from tools import fuzz_programs


@settings(max_examples=16, derandomize=True, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(fuzz_programs.specs())
def test_random_programs_under_every_variant(spec):
    tally = fuzz_programs.check(spec)
    assert not tally.crashes, tally.crashes
    assert not tally.mismatches, tally.mismatches
    assert tally.runs == len(fuzz_programs.VARIANTS)


def test_the_oracle_catches_a_miscompile(monkeypatch):
    """A ring sent the wrong way is reported as a mismatch, not passed."""
    from cmatmul_pass.rewrites import all_gather_dot

    monkeypatch.setattr(all_gather_dot, "RECEIVE_FROM_NEXT", +1)
    spec = fuzz_programs.Spec(mesh_shape=(4,), devices=(0, 1, 2, 3), axes=("x",), kind="ag", dim="m", side=0,
                              batch=False, tiled=True, dtype="f32", consumers=1, reader=False,
                              partial_manual=False, sizes=(2, 2, 2, 1))
    tally = fuzz_programs.check(spec, variants={"uni": fuzz_programs.VARIANTS["uni"]})
    assert len(tally.mismatches) == 1
