"""The attention kind of the differential fuzzer, the fixed-seed slice CI runs (``tools/fuzz.py
--kind attention`` runs a campaign): context-parallel attention over gathered K and V, causal or
not, GQA and MQA, segment ids, the einsum and ``jax.nn.dot_product_attention`` forms, bf16 and
f32, forward and training step (with and without remat), and the near misses the matcher
declines, under every variant."""

from hypothesis import HealthCheck, given, settings

from tools import fuzz_attention, fuzz_programs


def run(spec, variants=fuzz_programs.VARIANTS):
    tally = fuzz_attention.check(spec, variants=variants)
    assert not tally.crashes, tally.crashes
    assert not tally.mismatches, tally.mismatches
    return tally


@settings(max_examples=4, derandomize=True, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(fuzz_attention.attention_specs())
def test_random_attentions_under_every_variant(spec):
    tally = run(spec)
    assert tally.runs == len(fuzz_programs.VARIANTS)


def spec(**changes):
    base = dict(ring=4, batch=1, seq=4, heads=2, kv_heads=1, head_dim=4, causal=True, segments=False, dpa=False,
                dtype="f32", grad=False, remat=False, near_miss="")
    return fuzz_attention.AttentionSpec(**{**base, **changes})


def test_each_near_miss_is_declined_with_its_reason():
    for near_miss in ("sqrt", "key_padding"):
        run(spec(near_miss=near_miss), {"uni": fuzz_programs.VARIANTS["uni"]})
