"""The whole step's answer under ``policy="auto"`` (``step_guard``): the rewritten step is never
predicted slower than the step as written; the places whose rings slow it are declined
(``step``), each saying by how much; ``policy="all"`` keeps every site."""

import jax.numpy as jnp
import pytest

import cmatmul_pass
from cmatmul_pass import ir_utils, step_guard
from tests.conftest import assert_same_numbers
from tools.bench_models import megatron_step

AUTO = cmatmul_pass.Options(policy="auto")
#: a profile on which the GQA sample's two scatters pay alone and slow its step
SLOW = "h100:bandwidth=1e8,bf16=1e9,step=1e-9"


@pytest.fixture(scope="module")
def megatron_8b():
    """Two Megatron blocks (psum after the attention output and the MLP) at Llama-3-8B-like
    shapes, 16k tokens, bf16, value_and_grad: lowered, never run."""
    fn, args = megatron_step(2, hidden=4096, ffn=14336, tokens=16384, dtype=jnp.bfloat16)
    return fn.lower(*args).as_text()


def without_guard(monkeypatch):
    monkeypatch.setattr(step_guard, "losing_places", lambda *a, **k: {})


def predicted(result) -> tuple[float, float]:
    p = result.report.program
    return p["before_s"], p["after_s"]


def test_a_megatron_step_the_sites_would_slow_keeps_their_psums(megatron_8b, monkeypatch):
    """Each psum's own prediction pays; the step's schedule finds some of them beside the
    backward's other dots, so their rings slow it: those places are declined, and the step is
    predicted faster than as written (it was slower with every site the sites' model took)."""
    result = cmatmul_pass.rewrite(megatron_8b, AUTO)
    before, after = predicted(result)
    stepped = [s for s in result.report.sites if s.reason_code == "step"]
    assert stepped and result.report.rewritten and after < before, result.report.summary()
    assert all("this place's rings add" in s.reason and "predicted" in s.reason for s in stepped)
    assert f"{len(stepped)} site(s) left as written by the step's answer" in result.report.program_line()
    with monkeypatch.context() as m:
        without_guard(m)
        unguarded = cmatmul_pass.rewrite(megatron_8b, AUTO)
    assert predicted(unguarded)[1] > before
    assert len(unguarded.report.rewritten) == len(result.report.rewritten) + len(stepped)


def test_policy_all_takes_every_site_whatever_the_step(megatron_8b):
    result = cmatmul_pass.rewrite(megatron_8b, cmatmul_pass.Options(policy="all"))
    assert not [s for s in result.report.sites if s.reason_code == "step"]
    assert len(result.report.rewritten) == len(result.report.sites)


def test_declined_by_the_step_the_module_is_the_input_and_its_numbers():
    """The GQA sample's two dK/dV scatters on a profile where they pay alone but run beside the
    backward's other matmuls: both declined, the module left as it was."""
    path = "hlo_samples/ag_gqa_grad.mlir"
    text = open(path).read()
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(policy="auto", hardware=SLOW), source=path)
    stepped = [s for s in result.report.sites if s.reason_code == "step"]
    assert len(stepped) == 2 and not result.report.rewritten, [s.summary_line() for s in result.report.sites]
    assert result.text == ir_utils.print_module(ir_utils.parse(text))
    assert_same_numbers(text, result)
    before, after = predicted(result)
    assert before == after


def test_past_its_rounds_every_place_stays_as_written(megatron_8b, monkeypatch):
    """With no round to decline the losing places one by one, a step predicted slower keeps
    every collective as written."""
    monkeypatch.setattr(step_guard, "ROUNDS", 0)
    result = cmatmul_pass.rewrite(megatron_8b, AUTO)
    assert not result.report.rewritten
    assert {s.reason_code for s in result.report.sites} <= {"policy", "step", "compile_budget"}
    assert any("every collective stays as written" in s.reason for s in result.report.sites)


def test_a_step_the_rings_speed_up_is_left_to_the_sites(monkeypatch):
    """A sequence-parallel step whose rings the schedule finds faster: no place declined, the
    same sites as with the guard off."""
    from tools.bench_models import transformer_step

    fn, args = transformer_step(2, hidden=4096, ffn=14336, tokens=16384, dtype=jnp.bfloat16)
    text = fn.lower(*args).as_text()
    result = cmatmul_pass.rewrite(text, AUTO)
    assert result.report.rewritten and not [s for s in result.report.sites if s.reason_code == "step"]
    before, after = predicted(result)
    assert after < before
    without_guard(monkeypatch)
    assert len(cmatmul_pass.rewrite(text, AUTO).report.rewritten) == len(result.report.rewritten)


def test_the_answer_tool_prints_both_answers(capsys):
    from tools import step_answer

    assert step_answer.main(["--layers", "1", "--shape", "64", "128", "64"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("each site alone: ") and out[1].startswith("the step's answer: ")


def test_a_merged_two_stage_gather_counts_its_first_stage_gone():
    """A weight gathered over 'data' then 'model', merged into one ring over 8 devices: the
    site names its first stage, which the step's schedule takes out with the second (were it
    left in, the step would look slower and the guard would decline the merge)."""
    from tests.test_two_stage import two_stage

    result = cmatmul_pass.rewrite(two_stage(128, 1024, 2048, jnp.float64), cmatmul_pass.Options(policy="auto"))
    (site,) = result.report.rewritten
    assert site.ring_size == 8 and len(site.absorbs) == 1 and site.absorbs[0] != site.location
    before, after = predicted(result)
    merged = site.cost["overlapped_s"][site.cost["variant"]]  # the dot and both stages' transfer
    assert after < before and after == pytest.approx(merged, rel=0.02)
