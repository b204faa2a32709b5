"""The adversarial fuzz kind (``tools/fuzz.py --kind adversarial``), its fixed-seed slice.

Programs that break each precondition of each collective motion (a per-device slice index, trip
count, branch predicate, gain or bias, buffer slot, partially manual region around a nested call),
each beside its twin where the condition holds: the adversary must come out right (rewritten
correctly, or left as written), the twin must still show the motion.  Every run executes in a
worker process with a time limit, so a deadlock is reported as a hang and a segfault as a crash.
"""

import json
import random

import pytest

from tools import fuzz_adversarial as fa

#: one adversarial program and its twin per class (26 programs, two option sets each)
SEED = 59


def test_the_adversarial_campaign_has_no_failures():
    specs = fa.pairs(2 * len(fa.CLASSES), SEED)
    assert {s.cls for s in specs} == set(fa.CLASSES) and sum(s.twin for s in specs) == len(fa.CLASSES)
    tally = fa.run_campaign(specs, jobs=2, limit=60)
    assert tally.programs == len(specs) and not tally.errors, tally.report()
    assert tally.failed == 0, tally.summary() + "\n" + tally.report()
    for cls in fa.CLASSES:  # each twin shows its motion (the class's rule; second_carry may decline)
        row = tally.by_class[cls]
        assert row["twin_moved"] == 1 or not fa.CLASSES[cls][1], (cls, tally.summary())


@pytest.mark.parametrize("seed", [0, 1])
def test_every_class_lowers_and_its_twin_differs_only_in_the_condition(seed):
    rng = random.Random(seed)
    for cls in fa.CLASSES:
        state = rng.getstate()
        adversary = fa.draw(rng, cls, False)
        rng.setstate(state)
        twin = fa.draw(rng, cls, True)
        assert (adversary.twin, twin.twin) == (False, True)
        assert {k: v for k, v in vars(adversary).items() if k not in ("twin", "vary")} == \
            {k: v for k, v in vars(twin).items() if k not in ("twin", "vary")}
        assert twin.vary in ("none", "group") and (twin.vary == "none" or cls not in fa.CONTROL)
        for spec in (adversary, twin):
            assert "stablehlo" in fa.lower(spec)
            assert fa.Spec.from_json(json.loads(json.dumps(spec.to_json()))) == spec


def test_the_oracle_catches_a_gather_sunk_past_a_per_device_index(monkeypatch):
    """With the variance analysis told that every value is the same on every device, the gather
    is sunk into the loop although each device reads another layer: a mismatch (run here, not in
    a worker, so that the patch applies)."""
    from cmatmul_pass.analysis import variance

    for name in ("identical", "identical_in"):  # whichever the motions ask
        if hasattr(variance.Variance, name):
            monkeypatch.setattr(variance.Variance, name, lambda self, value, ring, *a, **k: True)
    spec = fa.Spec(cls="slice_index", twin=False, mesh_shape=(8,), axis="x", dtype="f32", layers=3, rows=2,
                   width=2, form="scan", vary="shift", dim=2)
    results = fa.check(spec, ("uni",))
    assert results["uni"]["status"] == "mismatch" and results["uni"]["moved"], results


def test_a_run_that_does_not_answer_is_a_hang_and_the_next_program_goes_on(tmp_path):
    spec = fa.Spec(cls="gain", twin=True, mesh_shape=(8,), axis="x", dtype="f32", layers=2, rows=1, width=2,
                   form="composite", vary="none", norm=True)
    worker = fa.Worker(tmp_path)
    try:
        results, error = worker.run(spec, ["uni"], limit=0.01)  # the worker cannot even start in time
        assert error.startswith("hang running the original") and not results
        results, error = worker.run(spec, ["uni"], limit=120)  # a fresh worker takes over
        assert error is None and results["uni"]["status"] == "ok" and results["uni"]["moved"], results
    finally:
        worker.stop()


def test_the_tally_counts_per_class():
    tally = fa.Tally()
    spec = fa.Spec(cls="sink_trips", twin=False, mesh_shape=(8,), axis="x", dtype="f32", layers=2, rows=1, width=2)
    twin = fa.Spec(**{**vars(spec), "twin": True, "vary": "none"})
    entry = {"status": "ok", "moved": False, "message": "", "sites": []}
    tally.add(spec, {"default": entry, "uni": {**entry, "status": "hang", "moved": None}}, None)
    tally.add(twin, {"default": {**entry, "status": "twin_declined"}, "uni": {**entry, "moved": True}}, None)
    row = tally.by_class["sink_trips"]
    assert (row["adv_kept"], row["twin_moved"], row["hang"], row["twin_declined"]) == (1, 0, 1, 1)
    assert tally.failed == 2 and "sink_trips" in tally.summary() and "hang" in tally.report()


def test_a_dead_workers_log_is_cut_to_its_fatal_lines():
    log = "\n".join(["E1206 waiting", "F1206 rendezvous.cc:161] Termination timeout for `collective permute`",
                     "*** Check failure stack trace: ***", "    @     0x7f  absl::Flush()"])
    essence = fa._essence(log)
    assert "Termination timeout" in essence and "0x7f" not in essence
    assert any(marker in essence for marker in fa.HANG_MARKERS)
