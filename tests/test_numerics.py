"""Numerics: every positive sample, rewritten and executed on 8 CPU devices, against the original.

Float outputs are judged against the original evaluated in f64 (docs/numerics.md): the rewrite's
normwise error must be within numerics.FACTOR of the original's plus a floor; integers and bools
exactly.  Each output is compared on every device.  The check command: --rewritten, --inputs and
its exit codes.
"""

import json
import re

import jax
import numpy as np
import pytest

import cmatmul_pass
from cmatmul_pass import execute, ir_utils
from cmatmul_pass.rewrites import all_gather_dot
from conftest import POSITIVE, run_cli, sample, scaled_bf16_gather


def check(path, **kwargs):
    text = path.read_text()
    result = cmatmul_pass.rewrite(text, source=str(path))
    assert result.changed
    return result, execute.check_numerics(ir_utils.parse(text), result.module, **kwargs)


@pytest.mark.parametrize("path", POSITIVE, ids=lambda p: p.stem)
def test_rewritten_sample_matches_original(path):
    _, outcome = check(path)
    assert outcome.ok, outcome.format()
    assert outcome.outputs


def test_samples_cover_ring_sizes_2_4_8_and_both_kinds():
    sites = [s for p in POSITIVE for s in cmatmul_pass.rewrite(p.read_text()).report.rewritten]
    assert {2, 4, 8} <= {s.ring_size for s in sites}
    assert {"all_gather_dot", "dot_reduce_scatter"} <= {s.kind for s in sites}
    # (a psum in chunks has no ring, nor a role)
    assert {"free", "contracting"} <= {role for s in sites if s.dim_role for role in s.dim_role.split("+")}


@pytest.mark.parametrize(
    "name",
    ["ag_dot_mesh2x4_model", "ag_dot_permuted_groups", "ag_dot_mesh2x4_data_strided", "rs_dot_rhs", "sp_mlp_grad"],
)
def test_permuted_device_assignment(name):
    devices = jax.devices("cpu")[:8]
    permuted = [devices[i] for i in (3, 7, 0, 5, 2, 6, 1, 4)]
    _, outcome = check(sample(name), devices=permuted)
    assert outcome.ok, outcome.format()


@pytest.mark.parametrize("seed", [1, 2])
def test_other_seeds(seed):
    _, outcome = check(sample("ag_dot_bsh"), seed=seed)
    assert outcome.ok, outcome.format()


@pytest.mark.parametrize("name", ["ag_dot_int32", "rs_dot_int32", "ag_dot_contracting_int32"])
def test_integer_outputs_are_compared_exactly(name):
    _, outcome = check(sample(name))
    assert [o.dtype for o in outcome.outputs] == ["i32"] and outcome.outputs[0].tolerance == 0.0
    assert outcome.ok


def test_bf16_with_f32_accumulation_keeps_f32_output():
    _, outcome = check(sample("ag_dot_bf16_f32acc"))
    assert [o.dtype for o in outcome.outputs] == ["f32"]
    assert outcome.ok, outcome.format()


@pytest.mark.parametrize("name", ["ag_dot_mesh2x4_model", "ag_dot_int32"])
def test_a_wrong_ring_direction_is_caught(name, monkeypatch):
    """The check can fail: shards travelling the wrong way land at the wrong offsets."""
    monkeypatch.setattr(all_gather_dot, "RECEIVE_FROM_NEXT", +1)
    _, outcome = check(sample(name))
    assert not outcome.ok
    assert "MISMATCH" in outcome.format()


@pytest.mark.parametrize(
    "options",
    [cmatmul_pass.Options(bidirectional=True, unroll=2, annotate_streams=True),
     cmatmul_pass.Options(bidirectional=True, unroll="full")],
    ids=["bidi-unroll2-streams", "bidi-full"],
)
@pytest.mark.parametrize("path", POSITIVE, ids=lambda p: p.stem)
def test_every_sample_under_combined_variants(path, options):
    """2-D meshes, partial-manual regions, the legacy partitioner, scans, chains and gradients with
    both directions, unrolling and outlined stream-annotated dots."""
    text = path.read_text()
    result = cmatmul_pass.rewrite(text, options, source=str(path))
    assert result.changed
    outcome = execute.check_numerics(ir_utils.parse(text), result.module)
    assert outcome.ok, outcome.format()


@pytest.mark.parametrize("role", ["free", "contracting"])
@pytest.mark.parametrize("variant", ["uni", "full", "bidi"])
@pytest.mark.parametrize("streams", [False, True], ids=["plain", "streams"])
def test_no_false_alarm_from_excess_precision(role, variant, streams):
    """XLA keeps a bf16 product in f32 where it fuses it into its reader, and the ring fuses
    differently from the original: compiled as jax.jit does, some of these programs differ by
    a bf16 ulp (2e-3 in the f32 outputs) from the original.  The check compiles both without
    excess precision (execute.CHECK_COMPILER_OPTIONS), where every op rounds to its own type,
    and judges the f32 output against the original evaluated in f64: the original's own error
    is the bf16 rounding of the scaled shards (7.6e-4 normwise), and the rewrite's is the same."""
    from cmatmul_pass.pipeline import variant_options

    text = scaled_bf16_gather(role)
    result = cmatmul_pass.rewrite(text, variant_options(variant, annotate_streams=streams))
    assert len(result.report.rewritten) == 1
    outcome = execute.check_numerics(ir_utils.parse(text), result.module)
    assert [o.dtype for o in outcome.outputs] == ["f32"] and outcome.reference == "f64"
    assert outcome.outputs[0].original_error > 5e-4 and outcome.outputs[0].ratio < 1.01
    assert outcome.ok, outcome.format()


def test_the_check_compiles_both_programs_without_excess_precision():
    reference = execute.Reference.of(ir_utils.parse(scaled_bf16_gather("free")))
    assert reference.compiler_options == {"xla_allow_excess_precision": False}
    assert execute.CHECK_COMPILER_OPTIONS == {"xla_allow_excess_precision": False}


# ------------------------------------------------------------------ the check command
SQRT = """
module @m attributes {mhlo.num_partitions = 1 : i32} {
  func.func public @main(%arg0: tensor<8xf32>, %arg1: tensor<8xf32>) -> (tensor<8xf32>, tensor<8xf32>) {
    %0 = stablehlo.sqrt %arg0 : tensor<8xf32>
    %1 = stablehlo.multiply %arg1, %arg1 : tensor<8xf32>
    return %0, %1 : tensor<8xf32>, tensor<8xf32>
  }
}
"""


def test_check_compares_a_given_rewritten_module(tmp_path, monkeypatch, capsys):
    """--rewritten: a rewrite saved earlier is checked against its original (0), a wrong one
    made with the ring sent the wrong way is a mismatch (1)."""
    path = sample("sp_mlp")
    good, bad = tmp_path / "good.mlir", tmp_path / "bad.mlir"
    good.write_text(cmatmul_pass.rewrite(path.read_text()).text)
    monkeypatch.setattr(all_gather_dot, "RECEIVE_FROM_NEXT", +1)
    bad.write_text(cmatmul_pass.rewrite(path.read_text()).text)
    report = tmp_path / "report.json"
    assert run_cli("check", path, "--rewritten", good, "--report-json", report) == 0
    assert "numerics: OK" in capsys.readouterr().out
    numerics = json.loads(report.read_text())["numerics"]
    assert numerics["reference"] == "f64" and numerics["factor"] == 2.0
    assert all({"original_error", "rel_error", "ratio", "tolerance", "status"} <= set(o) for o in numerics["outputs"])
    assert run_cli("check", path, "--rewritten", bad) == 1
    assert "MISMATCH" in capsys.readouterr().out


def test_outputs_the_original_leaves_nan_are_not_agreement(tmp_path, capsys):
    """sqrt of normal random inputs is NaN in half the elements of the original: the check
    redraws the argument that flows into the sqrt non-negative, says so, and checks (0); on
    given inputs outside the domain (--inputs) the output is not checked and the check could
    not check (3), never a mismatch; on inputs in its domain it is checked (0)."""
    module = tmp_path / "sqrt.mlir"
    module.write_text(SQRT)
    assert run_cli("check", module, "--rewritten", module) == 0
    out = capsys.readouterr().out
    assert "numerics: OK" in out and "arg0 non-negative (it flows into stablehlo.sqrt at " in out
    negative = tmp_path / "negative.npz"
    np.savez(negative, arg0=-np.ones(8, np.float32), arg1=np.ones(8, np.float32))
    assert run_cli("check", module, "--rewritten", module, "--inputs", negative) == 3
    captured = capsys.readouterr()
    assert "output 0 f32[8]: not checked: the original is inf/NaN in 8 of 8 elements" in captured.out
    assert "INCOMPLETE" in captured.out
    assert "could not check: output(s) 0 of the original are outside the program's domain" in captured.err
    inputs = tmp_path / "inputs.npz"
    np.savez(inputs, arg0=np.arange(8, dtype=np.float32), arg1=np.ones(8, np.float32))
    assert run_cli("check", module, "--rewritten", module, "--inputs", inputs) == 0
    assert "numerics: OK" in capsys.readouterr().out


@pytest.mark.parametrize("arrays, message", [
    ({"arg0": np.ones(8, np.float32)}, "holds 1 arrays; the module takes 2 arguments"),
    ({"arg0": np.ones(4, np.float32), "arg1": np.ones(8, np.float32)}, "argument 0 is \\[4\\]"),
])
def test_bad_inputs_exit_2_in_one_line(tmp_path, capsys, arrays, message):
    module, inputs = tmp_path / "sqrt.mlir", tmp_path / "inputs.npz"
    module.write_text(SQRT)
    np.savez(inputs, **arrays)
    assert run_cli("check", module, "--rewritten", module, "--inputs", inputs) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert re.search(message, err), err


def test_an_internal_error_of_the_check_exits_3_in_one_line(monkeypatch, capsys):
    def broken(*args, **kwargs):
        raise RuntimeError("something the check did not expect")

    monkeypatch.setattr(execute.numerics, "judge_float", broken)
    assert run_cli("check", sample("sp_mlp"), "-q") == 3
    err = capsys.readouterr().err
    assert err.strip() == "cmatmul_pass: could not check: internal error: RuntimeError: something the check did not expect"


def test_jit_check_takes_typed_keys_and_compares_their_data():
    """jit(check=True) runs the check on the call's arguments as the module takes them: a typed
    PRNG key as its key data (decorator.comparable), returned keys compared exactly."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((8,), ("m",))
    f = jax.shard_map(lambda x, w: jax.lax.all_gather(x, "m", axis=0, tiled=True) @ w, mesh=mesh,
                      in_specs=(P("m", None), P()), out_specs=P(), check_vma=False)

    def fn(key, x, w):
        return f(x + jax.random.normal(key, x.shape), w), key

    checked = cmatmul_pass.jit(fn, check=True)
    x = jax.device_put(np.ones((64, 16), np.float32), NamedSharding(mesh, P("m", None)))
    checked(jax.random.key(1), x, np.ones((16, 8), np.float32))
    assert checked.stats["checks"] == 1 and checked.report.rewritten
    assert checked.checked.ok and [o.dtype for o in checked.checked.outputs] == ["f32", "ui32"]


def test_an_f64_program_is_judged_by_its_own_magnification_of_rounding(monkeypatch):
    """Found by the psum fuzz programs: in f64 the reference is the original itself (its error reads
    0) and a correct rewrite that reorders a sum feeding an RMS norm of one-element rows was 13 ulps
    off, over the floor alone.  The original computed in f32 shows how much the program magnifies
    rounding; scaled to f64 it passes the rewrite, and a scatter ring summing the wrong blocks is still caught."""
    from cmatmul_pass.rewrites import dot_reduce_scatter
    from tools import fuzz_programs

    spec = fuzz_programs.Spec(mesh_shape=(7,), devices=(5, 4, 6, 3, 1, 0, 2), axes=("x",), kind="psum", dim="m",
                              side=1, batch=True, tiled=True, dtype="f64", consumers=2, reader=False,
                              partial_manual=False, sizes=(3, 1, 2, 2), between=("rms", "vary"))
    tally = fuzz_programs.check(spec, variants={"uni": fuzz_programs.VARIANTS["uni"]})
    assert not tally.crashes and not tally.mismatches, tally.mismatches
    position = dot_reduce_scatter.ring_position  # each round's block one position off: the wrong rows summed
    monkeypatch.setattr(dot_reduce_scatter, "ring_position",
                        lambda b, pos, rnd, n, shift=1, offset=0, **where: position(b, pos, rnd, n, shift=shift,
                                                                                  offset=offset + 1, **where))
    tally = fuzz_programs.check(spec, variants={"uni": fuzz_programs.VARIANTS["uni"]})
    assert len(tally.mismatches) == 1, tally.crashes
