"""The cost model's picks: ``variant="auto"`` (each site the variant the model predicts fastest),
the default variant with and without a profile for the device, and a psum's strategy (split or
chunk, ties, the Megatron tables the docs quote).  The model's predictions themselves: test_cost.py."""

from dataclasses import replace

import pytest

import cmatmul_pass
from cmatmul_pass import cost, profiles
from cmatmul_pass.pipeline import variant_options
from conftest import ROOT, run_cli, sample
from test_cost import TOY, gather


# ------------------------------------------------------------------ variant="auto": the model picks per site
def fastest(shape: cost.SiteShape, hw: cost.Hardware) -> str:
    """The predicted fastest variant, the first in VARIANTS' order on a tie (computed here
    from overlapped_time, not from Prediction.best)."""
    best, best_time = None, None
    for name, (bidi, unroll) in cost.VARIANTS.items():
        t = cost.overlapped_time(shape, hw, bidi, unroll)
        if best_time is None or t < best_time:
            best, best_time = name, t
    return best


def test_prediction_best_breaks_ties_towards_the_simpler_variant():
    two = gather(ring=2)  # a ring of 2 goes one way whatever is asked: bidi times as uni
    p = cost.predict(two, TOY)
    assert p.speedup["bidi"] == p.speedup["uni"]
    assert p.best == fastest(two, TOY) and not p.best.startswith("bidi")
    comm_bound = gather(ring=8, flops=1e6)  # both directions halve the rounds
    assert cost.predict(comm_bound, TOY).best.startswith("bidi") and fastest(comm_bound, TOY).startswith("bidi")


def test_auto_variant_gives_each_site_its_predicted_fastest():
    text = sample("sp_mlp").read_text()
    # bidi-full's overlap a little below the h100 profile's 304 of 308 (the 8B and 70B compiles)
    override = "h100:overlap.bidi-full=0.95"
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(variant="auto", hardware=override))
    hw = cost.hardware(override)
    picks = []
    for site in result.report.rewritten:
        shape = cost.SiteShape.from_dict(site.cost["site"])
        picks.append(fastest(shape, hw))
        assert site.cost["variant"] == site.schedule["variant"] == picks[-1]
        assert site.schedule["directions"] == (2 if picks[-1].startswith("bidi") else 1)
    # at these tiny shapes the per-round costs and the exposed permutes decide, and there they
    # decide differently for the scatter and the gather: one module, two variants (with the
    # profile as measured, bidi-full for both)
    assert len(result.report.rewritten) == 2 and len(set(picks)) == 2, picks
    from cmatmul_pass import execute, ir_utils

    outcome = execute.Reference.of(ir_utils.parse(text)).check(result.module)
    assert outcome.ok, outcome.format()


@pytest.mark.parametrize("name", ["ag_dot_1d", "rs_dot_rows"])
def test_auto_variant_emits_what_naming_its_pick_emits(name):
    text = sample(name).read_text()
    for hw in ("h100", "tpu-v5e", "h100:bandwidth=1e6"):
        auto = cmatmul_pass.rewrite(text, cmatmul_pass.Options(variant="auto", hardware=hw))
        (site,) = auto.report.rewritten
        assert site.cost["variant"] == fastest(cost.SiteShape.from_dict(site.cost["site"]), cost.hardware(hw))
        named = cmatmul_pass.rewrite(text, variant_options(site.cost["variant"], hardware=hw))
        assert auto.text == named.text


def test_auto_variant_under_the_auto_policy_judges_the_pick():
    text = sample("sp_mlp").read_text()
    declined = cmatmul_pass.rewrite(text, cmatmul_pass.Options(variant="auto", policy="auto"))
    assert [s.reason_code for s in declined.report.sites] == ["policy", "policy"]
    for site in declined.report.sites:  # the reason names the pick, the best the model has
        assert f"({site.cost['variant']})" in site.reason
        assert site.cost["speedup"][site.cost["variant"]] == max(site.cost["speedup"].values())


def test_options_and_cli_name_variants():
    assert cmatmul_pass.Options(variant="bidi-unroll2") == cmatmul_pass.Options(bidirectional=True, unroll=2, variant="bidi-unroll2")
    named = cmatmul_pass.Options(variant="bidi-full")
    assert (named.bidirectional, named.unroll) == (True, "full")
    with pytest.raises(ValueError, match="variant must be"):
        cmatmul_pass.Options(variant="bidi-unroll3")
    with pytest.raises(ValueError, match="contradicts"):
        cmatmul_pass.Options(variant="uni", unroll=2)
    with pytest.raises(ValueError, match="contradicts"):
        cmatmul_pass.Options(variant="auto", bidirectional=True)


def test_cli_variant_flag(tmp_path, capsys):
    src = sample("ag_dot_1d")
    by_name, by_flags = tmp_path / "a.mlir", tmp_path / "b.mlir"
    assert run_cli("rewrite", src, "--variant", "bidi-unroll2", "-o", by_name, "-q") == 0
    assert run_cli("rewrite", src, "--bidirectional", "--unroll", "2", "-o", by_flags, "-q") == 0
    assert by_name.read_text() == by_flags.read_text()
    bad = tmp_path / "c.mlir"
    assert run_cli("rewrite", src, "--variant", "uni", "--unroll", "2", "-o", bad, "-q") == 2
    assert "cannot be combined" in capsys.readouterr().err and not bad.exists()
    assert run_cli("explain", src, "--variant", "auto") == 0
    assert "(the cost model's pick)" in capsys.readouterr().out


def test_decorator_takes_the_variant():
    import jax
    import numpy as np

    from cmatmul_pass.decorator import ring_compiler_options
    from test_jit import LHS, OVERLAP, F, inputs

    x, w = inputs()
    g = cmatmul_pass.jit(F, variant="auto", hardware="h100")  # on the CPU "auto" hardware has no profile
    # atol as test_jit's comparisons of a rewritten F: jax 0.12's CPU dot sums a ring's blocks in another order
    np.testing.assert_allclose(np.asarray(g(x, w)), np.asarray(jax.jit(F)(x, w)), rtol=1e-5, atol=1e-5)
    (site,) = g.report.rewritten
    assert site.schedule["variant"] == fastest(cost.SiteShape.from_dict(site.cost["site"]), cost.hardware("h100"))
    # a pick going both ways gets the GPU option its two permutes per round need
    both = site.schedule["directions"] == 2
    assert ring_compiler_options(g.report, "gpu") == ({LHS: True, OVERLAP: 2} if both else {LHS: True})
    named = cmatmul_pass.jit(F, variant="full")
    np.testing.assert_allclose(np.asarray(named(x, w)), np.asarray(jax.jit(F)(x, w)), rtol=1e-5, atol=1e-5)
    assert named.report.rewritten[0].schedule["variant"] == "full"


def test_a_policy_decline_names_the_variant_that_would_pass():
    text = sample("sp_mlp").read_text()
    # links so slow that every ring pays; the default uni ring less than the margin asks
    slow = "h100:f32=1e9,bandwidth=1e8,split_efficiency=1,loop_trip=0"
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(policy="auto", hardware=slow, margin=0.3, variant="uni"))
    for site in result.report.sites:
        c = site.cost
        best = max(c["speedup"], key=c["speedup"].get)
        assert site.reason_code == "policy" and c["speedup"]["uni"] < 1.3
        would = c["speedup"][best] >= 1.3
        assert (f"; {best} would reach" in site.reason) == would, (site.reason, c["speedup"])
    assert any("would reach" in s.reason for s in result.report.sites)
    # under --variant auto nothing better is left to name
    picked = cmatmul_pass.rewrite(text, cmatmul_pass.Options(policy="auto", hardware=slow, margin=0.3, variant="auto"))
    assert all("would reach" not in s.reason for s in picked.report.sites)


def test_hardware_auto_follows_the_device_kind(monkeypatch):
    for kind, name in [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"), ("NVIDIA A100-SXM4-80GB", "a100"),
                       ("TPU v5 lite", "tpu-v5e"), ("cpu", None), ("NVIDIA GeForce RTX 4090", None)]:
        assert cost.profile_for(kind) == name
    monkeypatch.setattr(profiles, "_device_kind", lambda: "NVIDIA A100-SXM4-40GB")
    a100 = cost.hardware("auto:bandwidth=1e9")
    assert a100.name.startswith(cost.PROFILES["a100"].name + ", detected") and a100.bandwidth == 1e9
    assert a100.flops == cost.PROFILES["a100"].flops
    monkeypatch.setattr(profiles, "_device_kind", lambda: "cpu")
    fallback = cost.hardware("auto")
    assert fallback.name.endswith("assumed: no profile for cpu") and fallback.assumed
    assert replace(fallback, name="", assumed=False) == replace(cost.PROFILES[cost.FALLBACK_PROFILE], name="")
    assert not a100.assumed


def test_the_default_variant_is_the_model_pick_or_the_fallback_without_a_profile(monkeypatch):
    """No variant named is ``auto``: the model's pick on a profiled machine; on one no
    profile describes, the fallback (full on a ring of up to 8, but uni for a scatter of 8 MiB
    of partial sums or more; unroll2 on longer rings), not the assumed profile's pick."""
    text = sample("sp_mlp").read_text()
    h100 = cost.hardware("h100")
    default = cmatmul_pass.rewrite(text)
    assert default.options.variant == "auto" and len(default.report.rewritten) == 2
    for site in default.report.rewritten:
        assert site.schedule["variant"] == fastest(cost.SiteShape.from_dict(site.cost["site"]), h100)
    monkeypatch.setattr(profiles, "_device_kind", lambda: "cpu")
    unprofiled = cmatmul_pass.rewrite(text, cmatmul_pass.Options(hardware="auto"))
    picked = {site.kind: site.schedule["variant"] for site in unprofiled.report.rewritten}
    assert picked == {"all_gather_dot": "full", "dot_reduce_scatter": "full"}
    assert picked != {site.kind: site.schedule["variant"] for site in default.report.rewritten}
    def shape(kind, ring, step_bytes):
        return cost.SiteShape(kind, ring, 1e9, step_bytes, "f32")

    big = cost.FALLBACK_LOOPED_SCATTER_BYTES // 8  # a block of a scatter whose partial sums are 8 MiB
    for kind in ("all_gather_dot", "dot_reduce_scatter"):  # straight-line code grows with the ring
        assert cost.fallback_variant(shape(kind, 8, 1 << 10)) == "full"
        assert cost.fallback_variant(shape(kind, 16, 1 << 10)) == cost.fallback_variant(shape(kind, 16, big)) == "unroll2"
    # a scatter's straight line holds every round's partial product at once: from 8 MiB, a loop
    assert cost.fallback_variant(shape("dot_reduce_scatter", 8, big)) == "uni"
    assert cost.fallback_variant(shape("dot_reduce_scatter", 8, big - 1)) == "full"
    assert cost.fallback_variant(shape("all_gather_dot", 8, big)) == "full"
    # a variant named (or bidirectional / unroll alone) is what runs
    assert cmatmul_pass.Options(unroll=1).variant == "uni" and cmatmul_pass.Options(bidirectional=True).variant == "bidi"
    uni = cmatmul_pass.rewrite(text, cmatmul_pass.Options(variant="uni"))
    assert {site.schedule["variant"] for site in uni.report.rewritten} == {"uni"}


def test_the_decorator_picks_for_the_device_it_runs_on(monkeypatch):
    import numpy as np

    from test_jit import F, inputs

    x, w = inputs()
    here = cmatmul_pass.jit(F, variant="auto")  # hardware="auto" by default: the CPU has no profile
    here(x, w)
    assert here.report.sites[0].cost["hardware"].endswith("assumed: no profile for cpu")
    assert here.report.sites[0].schedule["variant"] == cost.fallback_variant(  # not the H100's pick
        cost.SiteShape.from_dict(here.report.sites[0].cost["site"]))
    monkeypatch.setattr(profiles, "_device_kind", lambda: "TPU v5 lite")
    g = cmatmul_pass.jit(F, variant="auto")
    np.testing.assert_allclose(np.asarray(g(x, w)), np.asarray(here(x, w)), rtol=1e-5)
    (site,) = g.report.sites
    assert site.cost["hardware"] == cost.PROFILES["tpu-v5e"].name + ", detected"
    assert site.schedule["variant"] == fastest(cost.SiteShape.from_dict(site.cost["site"]), cost.PROFILES["tpu-v5e"])


def test_the_timeline_draws_each_site_as_its_variant(tmp_path, monkeypatch):
    from cmatmul_pass import timeline

    drawn = []
    real = timeline._ring_bars
    monkeypatch.setattr(timeline, "_ring_bars", lambda shape, hw, bidi, unroll: drawn.append(
        cost.variant_name(bidi, unroll)) or real(shape, hw, bidi, unroll))
    override = "h100:overlap.bidi-full=0.95"  # two variants in one module (the test above)
    result = cmatmul_pass.rewrite(sample("sp_mlp").read_text(), cmatmul_pass.Options(variant="auto", hardware=override))
    timeline.plot(result.report, cost.hardware(override), tmp_path / "t.png")
    assert drawn == [s.cost["variant"] for s in result.report.sites] and len(set(drawn)) == 2


def test_the_docs_quote_the_models_megatron_table():
    """docs/performance.md's Megatron table is `cost.megatron_mlp_block` on the `h100` profile."""
    doc = (ROOT / "docs" / "performance.md").read_text()
    header = "| shapes | tokens | all_reduce share | split alone (uni) | split in a stack: uni | unroll2 | bidi-full | chunk (k) |"
    assert header in doc
    section = doc[doc.index(header):]
    rows = [line for line in section.splitlines()[2:] if line.startswith("| Llama-3-")]
    shapes = {"Llama-3-70B-like (hidden 8192, ffn 28672)": (8192, 28672),
              "Llama-3-8B-like (hidden 4096, ffn 14336)": (4096, 14336)}
    hw = cost.PROFILES["h100"]
    expected = []
    for name, (hidden, ffn) in shapes.items():
        for tokens in (1024, 4096, 16384, 32768):
            r = {v: cost.megatron_mlp_block(hw, hidden, ffn, tokens, variant=v) for v in ("uni", "unroll2", "bidi-full")}
            u = r["uni"]
            expected.append(f"| {name} | {tokens} | {u['all_reduce_share']:.2f} | {u['split']:.2f}x | "
                            f"{u['split_stack']:.2f}x | {r['unroll2']['split_stack']:.2f}x | "
                            f"{r['bidi-full']['split_stack']:.2f}x | {u['chunk']:.2f}x ({u['chunks']}) |")
    assert rows == expected


def test_the_psum_default_per_profile_is_what_variants_md_says():
    """docs/variants.md's "A psum's strategy is `auto` too": per site (the default's choice, the
    ring in the model's variant), chunk on the h100 at every shape of the Megatron table, and on
    the h200 and a100; on the a100 a stack's split edges ahead by 1-2 % at 32k tokens; split on
    the tpu-v5e at the 8B-like shapes."""
    doc = " ".join((ROOT / "docs" / "variants.md").read_text().split())
    assert "split edges ahead of chunk by 1–2 % at 32k tokens" in doc and "`tpu-v5e` picks split at the 8B-like" in doc
    assert "No pick below is within 5 % of a tie" in doc

    def picks(profile, hidden, ffn, tokens, n=8):
        hw = cost.PROFILES[profile]
        shape = cost.SiteShape("dot_reduce_scatter", n, 2 * tokens * (ffn // n) * hidden, tokens // n * hidden * 2, "bf16")
        variant = cost.predict(shape, hw).best
        prediction = cost.predict_all_reduce(shape, hw, variant)
        # "No pick below is within 5 % of a tie"
        assert abs(prediction.seconds("split") / prediction.seconds("chunk") - 1) >= 0.05 and not prediction.tied
        return prediction.fastest, cost.megatron_mlp_block(hw, hidden, ffn, tokens, variant=variant)

    shapes = {"70B": (8192, 28672), "8B": (4096, 14336)}
    for tokens in (1024, 2048, 4096, 8192, 16384, 32768):
        assert all(picks("h100", *shape, tokens)[0] == "chunk" for shape in shapes.values())
    for tokens in (1024, 4096, 32768):
        for name, shape in shapes.items():
            assert picks("h200", *shape, tokens)[0] == picks("a100", *shape, tokens)[0] == "chunk"
            assert picks("tpu-v5e", *shape, tokens)[0] == ("split" if name == "8B" else "chunk")
        for shape in shapes.values():
            block = picks("a100", *shape, 32768)[1]
            assert 1.005 <= block["split_stack"] / block["chunk"] <= 1.025


def test_a_megatron_block_chunked_hides_its_all_reduce_behind_the_dots():
    """At a 70B-like shape the chunks beat the all_reduce; a split block alone pays its gather, and
    in a stack it is the sequence-parallel block."""
    hw = cost.PROFILES["h100"]
    block = cost.megatron_mlp_block(hw, 8192, 28672, 8192)
    assert block["chunk"] > 1.05 and block["chunks"] in cost.CHUNK_COUNTS
    sp = cost.mlp_block(hw, 8192, 28672, 8192)
    assert block["split_stack_s"] == pytest.approx(sp["overlapped_s"])
    assert block["split_s"] > block["serial_s"] - block["all_reduce_share"] * block["serial_s"]


def test_split_and_chunk_within_the_tie_go_to_chunk():
    """AllReducePrediction.fastest: split only where it is predicted faster than chunk by more than
    cost.TIE; within it the two tie and chunk (the lighter rewrite) takes the tie."""
    ring = cost.predict(cost.SiteShape("dot_reduce_scatter", 8, 1e12, 1 << 24, "bf16"), cost.PROFILES["h100"])

    def prediction(split_s, chunk_s):
        return cost.AllReducePrediction("h", 2.0, 1.0, split_s, {2: chunk_s}, "uni", ring)

    for split_s, chunk_s, fastest, tied in ((1.0, 1.0, "chunk", True),
                                            (1.0, 1.0 + 0.9 * cost.TIE, "chunk", True),
                                            (1.0, 1.0 + 1.1 * cost.TIE, "split", False),
                                            (1.0 + 0.9 * cost.TIE, 1.0, "chunk", True),
                                            (2.0, 1.0, "chunk", False)):
        p = prediction(split_s, chunk_s)
        assert (p.fastest, p.tied, p.to_dict()["tied"]) == (fastest, tied, tied), (split_s, chunk_s)
    assert cost.AllReducePrediction("h", 2.0, 1.0, 1.0, {}, "uni", ring).fastest == "split"  # no chunks: split
    assert prediction(1.0, 1.0).best == "chunk" and prediction(3.0, 3.0).best is None  # best: fastest if it pays


def test_a_tie_goes_to_split_where_its_gather_is_hidden():
    """AllReducePrediction.pick: a tie goes to split where split's gather is hidden (the next
    matmul's ring), to chunk elsewhere; outside a tie the faster wins either way."""
    ring = cost.predict(cost.SiteShape("dot_reduce_scatter", 8, 1e12, 1 << 24, "bf16"), cost.PROFILES["h100"])

    def prediction(split_s, chunk_s):
        return cost.AllReducePrediction("h", 2.0, 1.0, split_s, {2: chunk_s}, "uni", ring)

    tie, chunk_ahead, split_ahead = prediction(1.0, 1.0), prediction(2.0, 1.0), prediction(1.0, 2.0)
    assert [p.pick(False) for p in (tie, chunk_ahead, split_ahead)] == ["chunk", "chunk", "split"]
    assert [p.pick(True) for p in (tie, chunk_ahead, split_ahead)] == ["split", "chunk", "split"]
    assert all(p.fastest == p.pick(False) for p in (tie, chunk_ahead, split_ahead))
