"""The columns kind of the differential fuzzer, the fixed-seed slice CI runs (``tools/fuzz.py
--kind columns`` runs a campaign): contrastive losses over gathered negatives with their
gradients (log-sum-exp, written out, log_softmax's cross-entropy, an entropy term; one direction
or both; inside the shard_map or under remat; bf16 and f32), and the near misses the plan
declines, under every variant."""

from hypothesis import HealthCheck, given, settings

from tools import fuzz_columns, fuzz_programs


def run(spec, variants=fuzz_programs.VARIANTS):
    tally = fuzz_columns.check(spec, variants=variants)
    assert not tally.crashes, tally.crashes
    assert not tally.mismatches, tally.mismatches
    return tally


@settings(max_examples=3, derandomize=True, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(fuzz_columns.columns_specs())
def test_random_contrastive_losses_under_every_variant(spec):
    tally = run(spec)
    assert tally.runs == len(fuzz_programs.VARIANTS)


def spec(**changes):
    base = dict(ring=4, rows=4, dim=4, dtype="f32", loss="lse", learned=False, symmetric=False, inside=True,
                near_miss="")
    return fuzz_columns.ColumnsSpec(**{**base, **changes})


def test_each_loss_and_near_miss():
    uni = {"uni": fuzz_programs.VARIANTS["uni"]}
    for loss in fuzz_columns.LOSSES:
        run(spec(loss=loss, symmetric=True), uni)
    for near_miss in ("returns_logits", "flip", "cumsum"):
        run(spec(near_miss=near_miss), uni)
