"""The command line: exit codes, stdin/stdout, -o, report JSON, bytecode input, check, explain."""

import dataclasses
import io
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import cmatmul_pass
from cmatmul_pass import ir_utils
from cmatmul_pass._jax_private import module_to_bytecode
from cmatmul_pass.rewrites import all_gather_dot
from conftest import ROOT, run_cli, sample, scaled_bf16_gather

POS = sample("ag_dot_mesh2x4_model")
NEG = sample("neg_user_not_dot")


def test_rewrite_to_file_with_report(tmp_path, capsys):
    out, rep = tmp_path / "out.mlir", tmp_path / "report.json"
    assert run_cli("rewrite", POS, "-o", out, "--report-json", rep, "--variant", "uni") == 0
    text = out.read_text()
    assert "stablehlo.while" in text and "all_gather" not in text
    ir_utils.parse(text).operation.verify()
    report = json.loads(rep.read_text())
    (site,) = report["sites"]
    assert site["kind"] == "all_gather_dot" and site["rewritten"] and site["ring_size"] == 4
    assert site["location"].startswith(f"{POS}:")
    err = capsys.readouterr().err
    assert "all_gather_dot: rewritten ring=4" in err and "1 of 1 candidate site(s) rewritten" in err


def test_rewrite_to_stdout_and_quiet(capsys):
    assert run_cli("rewrite", POS, "--quiet") == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("module @") and captured.err == ""


def test_rewrite_reads_stdin(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(POS.read_bytes())))
    assert run_cli("rewrite", "-", "-q") == 0
    assert capsys.readouterr().out == cmatmul_pass.rewrite(POS.read_text()).text


def test_negative_sample_reports_reason(tmp_path, capsys):
    rep = tmp_path / "r.json"
    assert run_cli("rewrite", NEG, "-o", tmp_path / "o.mlir", "--report-json", rep) == 0
    (site,) = json.loads(rep.read_text())["sites"]
    assert not site["rewritten"] and site["reason_code"] == "user_not_dot" and "func.call" in site["reason"]
    assert "left unchanged" in capsys.readouterr().err


def test_output_may_overwrite_the_input(tmp_path):
    path = tmp_path / "m.mlir"
    path.write_text(POS.read_text())
    assert run_cli("rewrite", path, "-o", path, "-q") == 0
    assert "stablehlo.collective_permute" in path.read_text() and "all_gather" not in path.read_text()


@pytest.mark.parametrize(
    "content, message",
    [
        ("", "empty input"),
        ("this is not mlir\n", ":1:1: custom op 'this' is unknown"),
        ("module {\n  func.func @f( }\n", ":2:"),
        (POS.read_text()[: len(POS.read_text()) // 2], ":"),
        (b"ML\xefR\x00garbage", "bytecode"),
    ],
    ids=["empty", "not-mlir", "syntax", "truncated", "corrupt-bytecode"],
)
def test_bad_input_exits_2_without_output(tmp_path, capsys, content, message):
    src = tmp_path / "bad.mlir"
    src.write_bytes(content.encode() if isinstance(content, str) else content)
    out = tmp_path / "out.mlir"
    out.write_text("precious")
    assert run_cli("rewrite", src, "-o", out, "--report-json", tmp_path / "r.json") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"cmatmul_pass: error: {src}")
    assert message.lower() in err.lower()
    assert out.read_text() == "precious" and not (tmp_path / "r.json").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


@pytest.mark.parametrize("path, message", [("/nonexistent/m.mlir", "no such file"), (".", "is a directory")])
def test_unreadable_paths(capsys, path, message):
    assert run_cli("rewrite", path) == 2
    assert message in capsys.readouterr().err


def test_bytecode_input(tmp_path, capsys):
    module = ir_utils.parse(POS.read_text())
    path = tmp_path / "m.mlirbc"
    path.write_bytes(module_to_bytecode(module))
    assert run_cli("rewrite", path, "-q") == 0
    assert capsys.readouterr().out == cmatmul_pass.rewrite(POS.read_text()).text


def test_portable_artifact_from_jax_export(tmp_path, capsys):
    mesh = jax.make_mesh((8,), ("model",))
    body = lambda x, w: jax.lax.all_gather(x, "model", axis=0, tiled=True) @ w  # noqa: E731
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("model", None), P(None, "model")), out_specs=P(None, "model")))
    exp = jax.export.export(f)(
        jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=NamedSharding(mesh, P("model", None))),
        jax.ShapeDtypeStruct((32, 64), jnp.float32, sharding=NamedSharding(mesh, P(None, "model"))),
    )
    path = tmp_path / "exported.bin"
    path.write_bytes(exp.mlir_module_serialized)
    assert run_cli("rewrite", path, "--report-json", tmp_path / "r.json", "-q") == 0
    assert json.loads((tmp_path / "r.json").read_text())["sites"][0]["rewritten"]
    assert "stablehlo.collective_permute" in capsys.readouterr().out


def test_emit_bytecode_round_trips(tmp_path):
    out = tmp_path / "o.mlirbc"
    assert run_cli("rewrite", POS, "-o", out, "--emit-bytecode", "-q") == 0
    assert out.read_bytes().startswith(b"ML\xefR")
    assert ir_utils.print_module(ir_utils.parse(out.read_bytes())) == cmatmul_pass.rewrite(POS.read_text()).text


def test_check_passes(capsys):
    assert run_cli("check", POS) == 0
    out = capsys.readouterr().out
    assert "numerics: OK" in out and "max abs err" in out and "rel err" in out


def test_check_exits_1_on_mismatch(monkeypatch, capsys):
    monkeypatch.setattr(all_gather_dot, "RECEIVE_FROM_NEXT", +1)
    assert run_cli("check", POS, "-q") == 1
    assert "numerics: MISMATCH" in capsys.readouterr().out


def test_check_and_bench_compare_without_excess_precision(tmp_path, capsys):
    """A bf16 scale before an f32-accumulating dot, which XLA keeps unrounded where it fuses it
    (execute.CHECK_COMPILER_OPTIONS): `check` and `bench` compare original and rewrite compiled
    without excess precision, and `bench` still times them as compiled by default."""
    path = tmp_path / "scaled.mlir"
    path.write_text(scaled_bf16_gather("free"))
    assert run_cli("check", path, "-q") == 0
    assert "numerics: OK" in capsys.readouterr().out
    report = tmp_path / "bench.json"
    assert run_cli("bench", path, "--runs", "1", "--variants", "uni,full", "-q", "--report-json", report) == 0
    rows = json.loads(report.read_text())["variants"]
    assert all(row["numerics"]["ok"] and row["seconds"] > 0 for row in rows.values())


def test_explain_shows_decisions(capsys):
    assert run_cli("explain", NEG) == 0
    out = capsys.readouterr().out
    assert "left unchanged" in out and "[user_not_dot]" in out and "ring: 4 devices" in out
    assert run_cli("explain", POS) == 0
    assert "decision: rewritten as a ring (" in capsys.readouterr().out


def test_module_entry_point_end_to_end(tmp_path):
    """`python -m cmatmul_pass` in a fresh process: stdin to stdout, exit codes."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run(
        [sys.executable, "-m", "cmatmul_pass", "rewrite", "-", "-q"],
        input=POS.read_bytes(), capture_output=True, cwd=ROOT, env=env,
    )
    assert proc.returncode == 0, proc.stderr.decode()
    assert b"stablehlo.collective_permute" in proc.stdout
    proc = subprocess.run(
        [sys.executable, "-m", "cmatmul_pass", "check", str(POS)], capture_output=True, cwd=ROOT, env=env
    )
    assert proc.returncode == 0 and b"numerics: OK" in proc.stdout, proc.stderr.decode()[-2000:]
    proc = subprocess.run([sys.executable, "-m", "cmatmul_pass", "rewrite", "-"], input=b"junk", capture_output=True, env=env, cwd=ROOT)
    assert proc.returncode == 2 and b"Traceback" not in proc.stderr


def test_a_rewrite_that_does_not_verify_leaves_its_site_as_written(monkeypatch, tmp_path, capsys):
    """Verification runs after every site: a broken rewrite (partial dot typed as the full result)
    is caught, and its collective is left as written (pass_error) while the rest is rewritten."""
    monkeypatch.setattr(all_gather_dot, "shard_type", lambda t, dim, n: t)
    result = cmatmul_pass.rewrite(POS.read_text())
    (site,) = result.report.sites
    assert site.reason_code == "pass_error" and "does not verify" in site.reason and not result.changed
    out = tmp_path / "o.mlir"
    assert run_cli("rewrite", POS, "-o", out) == 0
    assert "[pass_error]" in capsys.readouterr().err and "collective_permute" not in out.read_text()


def test_check_writes_the_report_with_numerics(tmp_path, capsys):
    rep = tmp_path / "r.json"
    assert run_cli("check", sample("sp_mlp"), "--report-json", rep) == 0
    report = json.loads(rep.read_text())
    assert report["numerics"]["ok"] is True and len(report["numerics"]["outputs"]) == 1
    assert sorted(s["kind"] for s in report["sites"]) == ["all_gather_dot", "dot_reduce_scatter"]
    assert all(s["rewritten"] and s["consumers"] for s in report["sites"])


def test_no_assemble_flag_declines_shared_gathers(tmp_path, capsys):
    rep = tmp_path / "r.json"
    assert run_cli("rewrite", sample("ag_dot_assembled"), "--no-assemble", "-o", tmp_path / "o.mlir", "--report-json", rep) == 0
    (site,) = json.loads(rep.read_text())["sites"]
    assert site["reason_code"] == "multiple_users"
    assert run_cli("explain", sample("ag_dot_assembled")) == 0
    assert "assembles the gathered value for: stablehlo.tanh" in capsys.readouterr().out


def test_bench_times_every_variant_and_names_the_fastest(tmp_path, capsys):
    from cmatmul_pass import cost
    from cmatmul_pass.cli import VARIANT_FLAGS, _options, build_parser
    from cmatmul_pass.pipeline import variant_options

    # the flags bench prints for a variant select exactly that variant in `rewrite`
    assert set(VARIANT_FLAGS) == set(cost.VARIANTS)
    for name, flags in VARIANT_FLAGS.items():
        args = build_parser().parse_args(["rewrite", *flags.split(), "-"])
        # (naming a variant the flags contradict raises)
        assert dataclasses.replace(_options(args), variant=name) == variant_options(name)
    report = tmp_path / "bench.json"
    assert run_cli("bench", POS, "--runs", "2", "--variants", "uni,bidi-full,auto", "--report-json", report) == 0
    out = capsys.readouterr().out
    assert "8 partition(s) on 8 cpu device(s)" in out and "original" in out
    data = json.loads(report.read_text())
    assert list(data["variants"]) == ["uni", "bidi-full", "auto"]
    # auto: each site the variant the model picks for --hardware, printed and recorded
    picked = cmatmul_pass.rewrite(POS.read_text(), variant_options("auto")).report.rewritten[0].cost["variant"]
    assert data["variants"]["auto"]["picked"] == [picked] and data["variants"]["auto"]["flags"] == "--variant auto --hardware h100"
    assert f"auto: the cost model picked, for H100 SXM (NVLink 4): {picked} (1 site(s))" in out
    for row in data["variants"].values():
        assert row["rewritten"] == row["sites"] == 1 and row["numerics"]["ok"]
        assert row["over_original"] == row["seconds"] / data["original_s"]
        assert row["compiler_options"] == {}  # GPU ring options only (decorator.ring_compiler_options)
        assert row["saved_s"] == data["original_s"] - row["seconds"]
        # one compile each, beside the original's
        assert row["compile_s"] > 0 and row["compile_over_original"] == row["compile_s"] / data["original_compile_s"]
        assert f"{row['compile_s']:>12.3f} {row['compile_over_original']:>11.2f}" in out
    # the cost model's saving for the --hardware profile, next to the measured one
    explained = cmatmul_pass.rewrite(POS.read_text(), variant_options("bidi-full")).report.rewritten[0].cost
    assert data["variants"]["bidi-full"]["predicted_saving_s"] == explained["serial_s"] - explained["overlapped_s"]["bidi-full"]
    assert "predicted saving on H100 SXM (NVLink 4) (ms)" in out
    fastest = min(data["variants"], key=lambda v: data["variants"][v]["seconds"])
    assert data["fastest"] == fastest and f"{fastest}, " in out
    assert data["original_is_fastest"] == (data["variants"][fastest]["over_original"] >= 1)


def test_bench_never_times_a_wrong_rewrite(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(all_gather_dot, "RECEIVE_FROM_NEXT", +1)
    report = tmp_path / "bench.json"
    assert run_cli("bench", POS, "--runs", "1", "--variants", "uni,full", "-q", "--report-json", report) == 1
    out = capsys.readouterr().out
    assert "numerics MISMATCH: not timed" in out and "fastest" not in out
    data = json.loads(report.read_text())
    assert list(data["variants"]) == ["uni"] and "seconds" not in data["variants"]["uni"]
    assert data["fastest"] is None


def test_bench_compiles_each_variant_with_its_ring_options(monkeypatch, tmp_path, capsys):
    """The options ring_compiler_options names for a variant reach XLA's compile: a real one is
    reported and printed; one XLA does not know fails that compile (so it was passed)."""
    from cmatmul_pass import decorator

    def ring_options(report, platform, user_options, xla_flags):
        assert platform == "cpu" and report.rewritten
        return {"xla_cpu_enable_fast_math": False} if report.rewritten[0].schedule["directions"] == 2 else {}

    monkeypatch.setattr(decorator, "ring_compiler_options", ring_options)
    report = tmp_path / "bench.json"
    assert run_cli("bench", POS, "--runs", "1", "--variants", "uni,bidi", "--report-json", report) == 0
    assert "bidi: compiled with xla_cpu_enable_fast_math=False" in capsys.readouterr().out
    rows = json.loads(report.read_text())["variants"]
    assert rows["uni"]["compiler_options"] == {} and rows["bidi"]["compiler_options"] == {"xla_cpu_enable_fast_math": False}
    monkeypatch.setattr(decorator, "ring_compiler_options", lambda *a: {"xla_no_such_option": True})
    assert run_cli("bench", POS, "--runs", "1", "--variants", "uni") != 0
    assert "xla_no_such_option" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--variants", "uni,sideways"], "unknown variant(s) sideways"),
    (["--runs", "0"], "--runs must be at least 1"),
    (["--platform", "tpu"], "--platform tpu"),
])
def test_bench_usage_errors_exit_2(argv, message, capsys):
    assert run_cli("bench", POS, *argv) == 2
    assert message in capsys.readouterr().err


def test_bench_variant_lists():
    from cmatmul_pass.cli import VARIANT_NAMES, variant_list

    assert variant_list("all") == VARIANT_NAMES
    assert variant_list("all,auto") == (*VARIANT_NAMES, "auto")
    assert variant_list(" uni , bidi,uni") == ("uni", "bidi")


# ------------------------------------------------------------------ conventions
@pytest.mark.parametrize("argv", [["rewrite", str(POS), "--quie"], ["explain", str(POS), "--hard", "h200"],
                                  ["bench", str(POS), "--run", "1"]])
def test_no_prefix_abbreviations(argv, capsys):
    with pytest.raises(SystemExit) as info:
        run_cli(*argv)
    assert info.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        run_cli("--version")
    assert info.value.code == 0 and capsys.readouterr().out == f"cmatmul_pass {cmatmul_pass.__version__}\n"


def test_input_defaults_to_stdin(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(POS.read_bytes())))
    assert run_cli("rewrite", "-q") == 0
    assert capsys.readouterr().out == cmatmul_pass.rewrite(POS.read_text()).text


def test_errors_read_like_mlir_tools(monkeypatch, capsys):
    """``cmatmul_pass: error: FILE:LINE:COL: message``, stdin named <stdin>."""
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"module {\n  bogus.op\n}\n")))
    assert run_cli("rewrite") == 2
    assert capsys.readouterr().err.startswith("cmatmul_pass: error: <stdin>:2:3: ")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(POS.read_bytes())))
    assert run_cli("rewrite", "--variant", "uni", "--bidirectional") == 2
    assert capsys.readouterr().err.startswith("cmatmul_pass: error: <stdin>: --variant names the ring variant")


def test_the_console_script_is_installed():
    script = os.path.join(os.path.dirname(sys.executable), "cmatmul-pass")
    proc = subprocess.run([script, "--version"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout == f"cmatmul_pass {cmatmul_pass.__version__}\n"


def test_a_hardware_key_typo_is_refused_with_the_valid_keys(capsys):
    """`bandwith=` is refused, not stored as a dtype's throughput."""
    from cmatmul_pass import cost

    assert run_cli("explain", POS, "--hardware", "h100:bandwith=4e9") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown key 'bandwith'" in err and "known: bandwidth, " in err
    assert "f8E4M3FN" in err and "overlap.<variant>" in err
    with pytest.raises(cmatmul_pass.CmatmulError, match="unknown key 'bfloat16'"):
        cost.hardware("h100:bfloat16=1e15")
    # every key the error names is accepted
    for key in (*cost.SCALAR_OVERRIDES, *cost.DTYPE_OVERRIDES):
        cost.hardware(f"h100:{key}=0.5")


# ------------------------------------------------------------------ saying something instead of nothing
def _lowered(fn, *args) -> str:
    return jax.jit(fn).lower(*args).as_text()


def test_a_module_without_shard_map_is_told_about_xlas_flags(tmp_path, capsys):
    from cmatmul_pass.cli import WINDOWED_EINSUM_FLAGS

    mesh = jax.make_mesh((8,), ("x",))
    x = jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=NamedSharding(mesh, P("x", None)))
    w = jax.ShapeDtypeStruct((32, 64), jnp.float32, sharding=NamedSharding(mesh, P(None, None)))
    path = tmp_path / "auto.mlir"
    path.write_text(_lowered(lambda a, b: a @ b, x, w))
    assert run_cli("rewrite", path, "-o", tmp_path / "out.mlir") == 0
    err = capsys.readouterr().err
    assert "0 of 0 candidate site(s)" in err
    (note,) = [line for line in err.splitlines() if line.startswith("cmatmul_pass: note: ")]
    assert "no shard_map (manual) region" in note and WINDOWED_EINSUM_FLAGS in note
    assert run_cli("explain", path) == 0
    assert "note: the module has no shard_map (manual) region" in capsys.readouterr().out
    assert run_cli("rewrite", path, "-o", tmp_path / "out.mlir", "--quiet") == 0
    assert capsys.readouterr().err == ""


def test_a_shard_map_without_candidates_gets_a_census(tmp_path, capsys):
    mesh = jax.make_mesh((8,), ("x",))
    shift = jax.shard_map(lambda a: jax.lax.ppermute(a, "x", [(i, (i + 1) % 8) for i in range(8)]) * 2,
                          mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    x = jax.ShapeDtypeStruct((16, 4), jnp.float32, sharding=NamedSharding(mesh, P("x")))
    path = tmp_path / "shift.mlir"
    path.write_text(_lowered(shift, x))
    assert run_cli("rewrite", path, "-o", tmp_path / "out.mlir") == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if "note:" in line]
    assert notes == ["cmatmul_pass: note: no candidate site: the shard_map regions hold 0 all_reduce, 0 all_gather, "
                     "0 reduce_scatter, 0 all_to_all, 1 collective_permute (the pass rewrites an all_gather feeding a "
                     "matmul, and a matmul's reduce_scatter or all_reduce sum)"]


def test_sites_predicted_slower_are_rewritten_under_policy_all_with_one_warning(tmp_path, capsys):
    """The bundled samples are tiny: the h100 profile predicts their rings slower. Under --policy
    all one warning line says how many and the slowest; none with --quiet, none under --policy
    auto (which leaves them)."""
    ar = sample("ar_megatron_mlp")
    for path in (sample("sp_mlp"), ar):
        assert run_cli("rewrite", path, "-o", tmp_path / "o.mlir", "--policy", "all") == 0
        err = capsys.readouterr().err
        result = cmatmul_pass.rewrite(path.read_text(), cmatmul_pass.Options(policy="all"), source=str(path))
        (warning,) = [line for line in err.splitlines() if line.startswith("cmatmul_pass: warning: ")]
        assert warning.startswith(f"cmatmul_pass: warning: {len(result.report.rewritten)} site(s) rewritten though "
                                  "the cost model predicts them slower on H100")
        assert warning.endswith("see explain") and "(--policy all; the slowest, 0." in warning
    assert run_cli("rewrite", ar, "-o", tmp_path / "o.mlir", "-q", "--policy", "all") == 0
    assert capsys.readouterr().err == ""
    assert run_cli("rewrite", ar, "-o", tmp_path / "o.mlir", "--policy", "auto") == 0
    assert "warning" not in capsys.readouterr().err


def test_the_default_policy_leaves_what_the_cost_model_predicts_slower(tmp_path, capsys, monkeypatch):
    """Unset $CMATMUL_PASS_POLICY (the suite sets it to all): the default is auto, so the tiny
    sample is left as written, each site saying why ([policy]), and no warning."""
    from cmatmul_pass.pipeline import POLICY_ENV

    monkeypatch.delenv(POLICY_ENV, raising=False)
    assert cmatmul_pass.Options().policy == "auto"
    out = tmp_path / "o.mlir"
    assert run_cli("rewrite", sample("sp_mlp"), "-o", out) == 0
    err = capsys.readouterr().err
    assert "0 of 2 candidate site(s) rewritten" in err and "warning" not in err and "[policy]" in err
    assert out.read_text() == ir_utils.print_module(ir_utils.parse(sample("sp_mlp").read_text()))
    monkeypatch.setenv(POLICY_ENV, "all")
    assert cmatmul_pass.Options().policy == "all"
    # sites the model predicts faster get none (compute as long as the transfer, no overheads)
    assert run_cli("rewrite", sample("sp_mlp"), "-o", tmp_path / "o.mlir", "--hardware",
                   "h100:f32=1.1e7,bandwidth=1e6,step=0,loop_trip=0,split_efficiency=1") == 0
    err = capsys.readouterr().err
    assert "2 of 2 candidate site(s) rewritten" in err and "warning" not in err


def test_explain_says_what_would_make_a_declined_site_eligible(capsys):
    from cmatmul_pass import reasons

    assert run_cli("explain", NEG) == 0
    lines = capsys.readouterr().out.splitlines()
    decision = next(i for i, line in enumerate(lines) if "decision: left unchanged" in line)
    assert lines[decision + 1] == f"  to have it rewritten: {reasons.hint('user_not_dot')}"


def test_bench_with_no_rewritten_site_recommends_nothing(tmp_path, capsys):
    from cmatmul_pass.cli import VARIANT_NAMES

    assert run_cli("bench", NEG, "--runs", "1", "--report-json", tmp_path / "r.json") == 0
    captured = capsys.readouterr()
    assert captured.out.strip() == ("cmatmul_pass: nothing to time: no site was rewritten (1 candidate site(s) "
                                    "declined; see explain), so the rewritten module is the original in every "
                                    "variant; nothing to recommend")
    assert "fastest" not in captured.out + captured.err
    report = json.loads((tmp_path / "r.json").read_text())  # written, as every command writes it
    assert report["fastest"] is None and report["nothing_to_run"] == captured.out.strip().removeprefix("cmatmul_pass: ")
    assert {name: row["rewritten"] for name, row in report["variants"].items()} == dict.fromkeys(VARIANT_NAMES, 0)


def test_bench_and_check_say_what_rewrite_says_of_a_module_without_candidates(tmp_path, capsys):
    """The note naming XLA's windowed-einsum flags (no shard_map region) and the census (a
    shard_map with no candidate) come from bench and check as from rewrite and explain."""
    from cmatmul_pass.cli import WINDOWED_EINSUM_FLAGS

    mesh = jax.make_mesh((8,), ("x",))
    x = jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=NamedSharding(mesh, P("x", None)))
    w = jax.ShapeDtypeStruct((32, 64), jnp.float32, sharding=NamedSharding(mesh, P(None, None)))
    auto = tmp_path / "auto.mlir"
    auto.write_text(_lowered(lambda a, b: a @ b, x, w))
    shift = jax.shard_map(lambda a: jax.lax.ppermute(a, "x", [(i, (i + 1) % 8) for i in range(8)]),
                          mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    census = tmp_path / "shift.mlir"
    census.write_text(_lowered(shift, jax.ShapeDtypeStruct((16, 4), jnp.float32, sharding=NamedSharding(mesh, P("x")))))
    for path, said in ((auto, f"no shard_map (manual) region: the pass rewrites only explicit collectives inside "
                              f"jax.shard_map; for a program jax.jit shards by itself, XLA's own windowed einsum "
                              f"does this on GPU: XLA_FLAGS='{WINDOWED_EINSUM_FLAGS}'"),
                       (census, "the shard_map regions hold 0 all_reduce, 0 all_gather, 0 reduce_scatter, "
                                "0 all_to_all, 1 collective_permute")):
        assert run_cli("rewrite", path, "-o", tmp_path / "out.mlir") == 0
        (expected,) = [line for line in capsys.readouterr().err.splitlines() if "note:" in line]
        assert said in expected
        for command in (["bench", "--runs", "1", "--variants", "uni"], ["check"]):
            assert run_cli(command[0], path, *command[1:]) == 0
            captured = capsys.readouterr()
            assert [line for line in captured.err.splitlines() if "note:" in line] == [expected], command
            assert captured.out.startswith(f"cmatmul_pass: nothing to {'time' if command[0] == 'bench' else 'check'}")
            assert run_cli(command[0], path, *command[1:], "--quiet") == 0
            assert capsys.readouterr().err == ""


def test_check_with_nothing_rewritten_writes_its_report(tmp_path, capsys):
    """One partition: nothing to compare, exit 0, one line, and --report-json still written
    (the rewrite's report, no numerics, the line that was printed)."""
    one = ROOT / "tests" / "bad_inputs" / "one_partition.mlir"
    assert run_cli("check", one, "--report-json", tmp_path / "r.json", "-q") == 0
    out = capsys.readouterr().out
    assert out == "cmatmul_pass: nothing to check: no site was rewritten, so the rewritten module is the original\n"
    report = json.loads((tmp_path / "r.json").read_text())
    assert report == {"source": str(one), "num_partitions": 1, "sites": [], "layers": {}, "numerics": None,
                      "nothing_to_run": out.strip().removeprefix("cmatmul_pass: ")}
    assert run_cli("check", NEG, "--report-json", tmp_path / "r.json", "-q") == 0  # every site declined
    report = json.loads((tmp_path / "r.json").read_text())
    assert [s["reason_code"] for s in report["sites"]] == ["user_not_dot"] and report["numerics"] is None
