"""tools/gpu_checks.sh and tools/gpu_profile.py, on CPU: the procedure docs/gpu.md gives for the
next lent GPU session ("The next lent session") is checked line by line. Its `run` calls go
through the script's dry run (each part's steps fit a 10-minute call, name existing tools with
options they take, write what can come back); its profile step and the line that rebuilds the
h100 profile from the stored runs (bench/gpu) run for real."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from cmatmul_pass import cost
from conftest import ROOT
from test_docs import blocks
from tools import bench, gpu_calibrate, gpu_profile, gpu_topology

SCRIPT = ROOT / "tools" / "gpu_checks.sh"
#: the device tool: one command's limit, and what comes back from $OUT
CALL_LIMIT_S, FILES_BACK = 600, 8
#: what a part may spend of a call, so that it ends well inside it
PART_LIMIT_S = 540
#: the issue's budget for the GPU parts together (calibrate, topology, extras)
GPU_PARTS_S = 25 * 60
KILL_S = 5  # the script's --kill-after
PARSERS = {"tools/gpu_calibrate.py": gpu_calibrate.build_parser, "tools/gpu_topology.py": gpu_topology.build_parser,
           "tools/gpu_profile.py": gpu_profile.build_parser, "tools/bench.py": bench.build_parser}
STORED_SOURCES = ["bench/gpu/h100_calibrate_70b.json", "bench/gpu/h100_calibrate_8b.json",
                  "bench/gpu/h100_calibrate_3b_20261127.json", "bench/gpu/h100_calibrate_3b_20261127_rerun1.json",
                  "bench/gpu/h100_calibrate_3b_20261127_rerun2.json",
                  "bench/gpu/h100_topology_8b_20261126.json", "bench/gpu/h100_topology_70b_20261127.json"]


def procedure() -> tuple[list[str], list[str]]:
    """The two text blocks of docs/gpu.md's "The next lent session": the session's lines, and the
    command that rebuilds the profile from the stored runs."""
    lines = (ROOT / "docs" / "gpu.md").read_text().splitlines()
    first = lines.index("## The next lent session: one command per part") + 1
    end = next(i for i in range(first, len(lines)) if lines[i].startswith("## ")) + 1
    found = [body for line, lang, body, _ in blocks(ROOT / "docs" / "gpu.md") if lang == "text" and first < line < end]
    assert len(found) == 2, found
    return [line for line in found[0].splitlines() if line.strip()], [l for l in found[1].splitlines() if l.strip()]


def dry_run(outdir: str, profile: str, part: str) -> list[tuple[int, list[str]]]:
    """The part's steps as the script's dry run prints them: (time limit, argv)."""
    proc = subprocess.run(["bash", str(SCRIPT), outdir, profile, part], capture_output=True, text=True,
                          env=dict(os.environ, GPU_CHECKS_DRY_RUN="1"), timeout=60)
    assert proc.returncode == 0, proc.stderr
    steps = []
    for line in proc.stdout.splitlines():
        tag, limit, command = line.split("\t")
        assert tag == "step"
        steps.append((int(limit), shlex.split(command)))
    return steps


def tool_call(argv: list[str]) -> tuple[str, list[str]] | None:
    """(tool, its arguments) of a step that runs one of tools/, past ``env`` and its settings."""
    if argv[0] == "env":
        argv = argv[1:]
        while "=" in argv[0]:
            argv = argv[1:]
    if not Path(argv[0]).name.startswith("python") or argv[1] == "-c":  # python3 there, .venv's here
        return None
    return argv[1], argv[2:]


def outputs(argv: list[str], tool: str, args: list[str], outdir: str) -> list[str]:
    """The files a tool step writes under ``outdir``, relative to it."""
    parsed = PARSERS[tool]().parse_args(args)
    written = [parsed.out] if parsed.out else []
    if tool == "tools/gpu_topology.py" and parsed.dump_hlo:
        names = ["original", *parsed.programs]
        written += [f"{parsed.dump_hlo}/{parsed.model}_{name}.hlo.txt" for name in parsed.dump if name in names]
    return [str(Path(w).relative_to(outdir)) for w in written if w.startswith(outdir + "/")]


def test_the_script_parses_and_refuses_an_unknown_part(tmp_path):
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    proc = subprocess.run(["bash", str(SCRIPT), str(tmp_path), "h100", "calibrat"], capture_output=True, text=True)
    assert proc.returncode == 2 and "unknown part" in proc.stderr


def test_the_sessions_run_calls_fit_a_call_and_name_only_existing_tools_and_options():
    """Each `run` line of the procedure: a part of the script whose steps' limits sum to well under
    a call's 600 s, whose tools exist and parse the options given (argparse: a misspelt option
    or program name fails), and which writes at most 8 files under $OUT, no deeper than the
    device tool brings back, with names it brings back; the GPU parts together within 25 minutes;
    between them they compile every variant at 8B and 70B and calibrate both."""
    lines, _ = procedure()
    calls = [re.fullmatch(r'run\(command="(.*)", timeout_s=(\d+)\)', line) for line in lines]
    calls = [m for m in calls if m]
    assert [m.group(1) for m in calls] == [f"bash tools/gpu_checks.sh $OUT h100 {part}"
                                           for part in ("calibrate", "topology", "extras")]
    outdir = "/device/out"
    total, compiled, calibrated, written_json = 0, {}, set(), []
    for m in calls:
        assert int(m.group(2)) <= CALL_LIMIT_S
        part = m.group(1).split()[-1]
        steps = dry_run(outdir, "h100", part)
        limit = sum(seconds + KILL_S for seconds, _ in steps)
        assert limit <= PART_LIMIT_S, (part, limit)
        total += limit
        files = [f"gpu_checks_{part}.log"]
        for seconds, argv in steps:
            call = tool_call(argv)
            if call is None:
                continue
            tool, args = call
            assert (ROOT / tool).is_file() and tool in PARSERS, tool
            files += outputs(argv, tool, args, outdir)
            parsed = PARSERS[tool]().parse_args(args)
            if tool == "tools/gpu_topology.py" and not parsed.no_flags:
                compiled.setdefault(parsed.model, set()).update(parsed.programs)
            if tool == "tools/gpu_calibrate.py" and "XLA_FLAGS" not in " ".join(argv):
                calibrated.add(parsed.model)
        assert len(files) == len(set(files)) <= FILES_BACK, (part, files)
        for f in files:
            assert f.count("/") <= 2 and re.fullmatch(r"[A-Za-z0-9._/-]+", f), f
        written_json += [f for f in files if f.endswith(".json")]
    assert total <= GPU_PARTS_S
    for model in ("8b", "70b"):
        assert set(cost.VARIANTS) | {"auto"} <= compiled[model], model
    assert {"8b", "70b"} <= calibrated
    # the copy line takes every JSON the parts write, and the profile part reads what they wrote
    (copy,) = [line for line in lines if line.startswith("cp ")]
    pattern = copy.split()[1].removeprefix("FILES_AT/")
    assert all(Path(f).match(pattern) for f in written_json) and not Path("gpu_checks_calibrate.log").match(pattern)
    (step,) = dry_run(outdir, "h100", "profile")
    tool, args = tool_call(step[1])
    read = [str(Path(r).relative_to(outdir)) for r in gpu_profile.build_parser().parse_args(args).runs]
    assert set(read) <= set(written_json) and step[0] + KILL_S <= PART_LIMIT_S


def test_the_profile_step_runs_on_the_copied_runs(tmp_path):
    """The procedure's last line, run here over a copy of bench/gpu (the stored runs as if just
    copied back): it prints and writes the profile's fields and a valid --hardware override."""
    lines, _ = procedure()
    (line,) = [line for line in lines if line.startswith("bash tools/gpu_checks.sh bench/gpu ")]
    runs = tmp_path / "gpu"
    shutil.copytree(ROOT / "bench" / "gpu", runs)
    argv = shlex.split(line.replace("bench/gpu", str(runs), 1))
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHON=sys.executable))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    written = (runs / "h100_profile.txt").read_text()
    assert written in proc.stdout and "for cost.PROFILES['h100']" in written
    (override,) = re.findall(r'^--hardware "(.*)"$', written, re.M)
    hw = cost.hardware(override)
    # these stored h100_topology_{8b,70b}.json are the runs before the sends waited for the
    # previous round's dot: full hid 85 and 82 of 105, which the profile no longer holds
    assert hw.hidden("full") == pytest.approx((85 + 82) / 210, abs=5e-4)
    assert "moved: overlap['full']: 0.9619 -> 0.7952" in written


def rebuilds(line: str, profile: str, sources: list[str]) -> dict:
    """Run the documented ``gpu_profile.py ... --check`` line (it must name ``sources``) and
    expect exit 0 with ``profile`` unchanged; then the same regeneration in process, whose
    split and loop-trip points must be the profile's.  Returns that regeneration."""
    argv = shlex.split(line)
    assert argv[:2] == ["python", "tools/gpu_profile.py"] and argv[-1] == "--check"
    assert [a for a in argv if a.endswith(".json")] == sources
    proc = subprocess.run([sys.executable, *argv[1:]], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"against cost.PROFILES[{profile!r}]: unchanged" in proc.stdout
    result = gpu_profile.regenerate([str(ROOT / p) for p in sources], profile)
    hw = cost.PROFILES[profile]
    assert result["moved"] == []
    assert result["fields"]["split_efficiency"] == hw.split_efficiency
    assert result["fields"]["loop_trip"] == hw.loop_trip
    return result


def test_the_stored_runs_rebuild_the_h100_profile():
    """The documented line (docs/gpu.md) exits 0: the stored runs imply exactly the h100 profile's
    split and loop-trip points and overlap (202 of 210 permutes hidden for full, ..., bidi-full
    measured on the 8B step, no longer assumed), its throughput within the runs' noise.  With
    the oldest 8B topology run in place of the latest, full's overlap moves and --check fails."""
    _, (line,) = procedure()
    result = rebuilds(line, "h100", STORED_SOURCES)
    h100 = cost.PROFILES["h100"]
    assert result["fields"]["overlap"] == cost.H100_OVERLAP == {
        "full": 202 / 210, "bidi": 298 / 308, "bidi-unroll2": 289 / 308, "bidi-full": 304 / 308}
    assert "assumed" not in result["overlap_counts"]["bidi-full"]
    hw = cost.hardware(result["hardware_override"])
    assert hw.split_efficiency == h100.split_efficiency and hw.loop_trip == h100.loop_trip
    assert hw.throughput("bf16") == pytest.approx(h100.throughput("bf16"), rel=gpu_profile.RATE_TOLERANCE)
    older = [p.replace("8b_20261126", "8b") for p in STORED_SOURCES]
    proc = subprocess.run([sys.executable, "tools/gpu_profile.py", "--profile", "h100", *older, "--check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "moved: overlap['full']: 0.9619 -> 0.8857" in proc.stdout, proc.stdout


def test_pooled_overlap_takes_a_models_later_run_and_skips_other_flags():
    """By hand: two runs of 8b (the later one's uni replaces the earlier's), one of 70b, one with
    other XLA flags (skipped); executed counts where given, else per op."""
    def run(model, flags, **programs):
        return {"model": model, "layers": 2, "dtype": "bfloat16", "xla_flags": flags, "source": f"{model}.json",
                "programs": {name: {"collectives": {"collective-permute": counts}} for name, counts in programs.items()}}

    readme = " ".join(sorted(gpu_topology.PROFILE_XLA_FLAGS))
    first = run("8b", readme, uni={"async": 3, "sync": 1, "overlapped": 2},
                bidi={"async": 4, "sync": 0, "overlapped": 4, "executed": 28, "overlapped_executed": 21})
    later = run("8b", readme, uni={"async": 4, "sync": 0, "overlapped": 4})
    big = run("70b", readme, uni={"async": 2, "sync": 2, "overlapped": 1}, original={"async": 9, "sync": 0, "overlapped": 0})
    other = run("70b", "--xla_gpu_shard_autotuning=false", bidi={"async": 1, "sync": 0, "overlapped": 0})
    pooled, skipped = gpu_topology.pooled_overlap([first, later, big, other])
    assert {name: (e["overlapped"], e["executed"]) for name, e in pooled.items()} == {"uni": (5, 8), "bidi": (21, 28)}
    assert pooled["uni"]["models"] == {"8b": [4, 4], "70b": [1, 4]} and pooled["uni"]["fraction"] == 5 / 8
    assert len(skipped) == 1 and skipped[0].startswith("70b.json")


def test_a_slow_element_type_is_timed_alone(monkeypatch):
    """gpu_calibrate.element_rates: a type whose one call takes over SLOW_CALL_S is timed by itself
    over at most SLOW_CALLS calls (an integer dot XLA runs without a GEMM library must not hold a
    70B step past its limit); here every type counts as slow but f32, which is timed in turn."""
    import jax

    calls, types = [], []
    real = gpu_calibrate._one_call

    def one_call(fn, args):  # the third type (f32) fast; each other type 1, 2, 3 ms on its 1st, 2nd, 3rd call
        calls.append(fn)
        types.extend([fn] if fn not in types else [])
        real(fn, args)
        return 0.0 if fn in types[2:3] else 1e-3 * calls.count(fn)

    monkeypatch.setattr(gpu_calibrate, "_one_call", one_call)
    monkeypatch.setattr(gpu_calibrate, "SLOW_CALL_S", 5e-4)
    rates = gpu_calibrate.element_rates([(16, 8), (8, 4)], runs=1, device=jax.devices()[0])["rates"]
    assert list(rates) == list(gpu_calibrate.RATE_TYPES)
    assert [k for k, r in rates.items() if r.get("timing") != "alone"] == ["f32"]
    assert rates["bf16"]["seconds"] == 1e-3  # its first call's, the fastest of its SLOW_CALLS
    assert len(calls) == len(rates) + (gpu_calibrate.SLOW_CALLS - 1) * (len(rates) - 1)


H200_SOURCES = ["bench/gpu/h200_calibrate_70b.json", "bench/gpu/h200_calibrate_8b.json", "bench/gpu/h200_calibrate_3b.json",
                "bench/gpu/h200_topology_8b.json", "bench/gpu/h200_topology_70b.json"]


def calibration_runs(profile: str) -> list[Path]:
    """The calibration runs a profile is built from (docs/gpu.md's --check lines name them)."""
    sources = {"h100": STORED_SOURCES, "h200": H200_SOURCES}[profile]
    return [ROOT / path for path in sources if "_calibrate_" in path]


def runs_by_model(paths: list) -> dict[str, list[dict]]:
    """The calibration runs at ``paths`` (JSONs) by model, in order: a model's repeated runs count
    as one run of their medians (tools/gpu_calibrate.merge)."""
    by_model: dict[str, list[dict]] = {}
    for path in paths:
        run = json.loads(Path(path).read_text())
        by_model.setdefault(run["model"], []).append(run)
    return by_model


def free_full_dots(by_model: dict[str, list[dict]]) -> list[float]:
    """Each model's free sites' full-dot throughputs, each site's the median over the model's runs."""
    return [statistics.median(site["full_throughput"] for site in sites) for runs in by_model.values()
            for sites in zip(*[[s for s in r["sites"] if s.get("role", "free") == "free"] for r in runs])]


def test_the_stored_runs_rebuild_the_h200_profile():
    """The H200 runs of 2026-11-26 (the whole script on a lent H200: calibrate, topology, extras)
    imply exactly the h200 profile: docs/gpu.md's line exits 0, every split, loop-trip point,
    element rate and overlap unmoved, bidi-full hiding every permute it was compiled with."""
    line = next(body.strip() for _, lang, body, _ in blocks(ROOT / "docs" / "gpu.md")
                if lang == "text" and "--profile h200" in body and "--check" in body)
    result = rebuilds(line, "h200", H200_SOURCES)
    h200 = cost.PROFILES["h200"]
    assert result["fields"]["overlap"] == cost.H200_OVERLAP == h200.overlap
    assert result["overlap_counts"]["bidi-full"]["fraction"] == 1.0 == h200.hidden("bidi-full")
    assert "assumed" not in result["overlap_counts"]["bidi-full"]
    # without the 3B run the element rates are medians of two runs, not three: the check says so
    proc = subprocess.run([sys.executable, "tools/gpu_profile.py", "--profile", "h200",
                           *[p for p in H200_SOURCES if "3b" not in p], "--check"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "moved: flops['f8']: 791000000000000.0 -> 8.35e+14" in proc.stdout, proc.stdout


def test_the_h200_rerun_of_2026_11_27_keeps_the_profile():
    """docs/gpu.md section 7: the rerun's profile moves the split points by at most 0.031 and the
    overlap not at all; with it the MLP-block predictions move by at most 0.033 and auto's picks
    are the same but for the 70B scatter at 8192 tokens; its log has the layer-call form compiled
    for 8 GPUs with every permute overlapped.  (If the h200 profile is ever regenerated, this
    test's numbers are the new comparison's to write.)"""
    rerun = [str(ROOT / p.replace(".json", "_20261127.json")) for p in H200_SOURCES]
    result = gpu_profile.regenerate(rerun, "h200")
    h200, fields = cost.PROFILES["h200"], result["fields"]
    assert fields["overlap"] == cost.H200_OVERLAP
    moves = {}
    for key, points in h200.split_efficiency.items():
        new = dict(fields["split_efficiency"][key])
        assert set(new) == {flops for flops, _ in points}, key
        moves.update({(key, flops): abs(new[flops] - value) for flops, value in points})
    assert max(moves.values()) == pytest.approx(0.031) == moves[("all_gather_dot", 12884901888.0)]
    assert round(fields["flops"]["bf16"] / 1e12) == 678 and round(h200.flops["bf16"] / 1e12) == 668
    f8 = [json.loads((Path(p)).read_text())["element_rates"]["rates"]["f8"]["over_bf16"] for p in rerun[:3]]
    assert [round(r, 2) for r in f8] == [1.19, 1.14, 0.88]
    i8_3b = json.loads(Path(rerun[2]).read_text())["element_rates"]["rates"]["i8"]["over_bf16"]
    assert round(i8_3b, 2) == 0.93
    scatter_70b = dict(fields["split_efficiency"]["dot_reduce_scatter"])[60129542144.0]
    assert (dict(h200.split_efficiency["dot_reduce_scatter"])[60129542144.0], scatter_70b) == (0.867, 0.845)
    assert round(max(move for (key, _), move in moves.items() if "/" in key), 3) == 0.026  # the roles'

    old, new = cost.hardware("h200"), cost.hardware(result["hardware_override"])
    largest, changed = 0.0, []
    for hidden, ffn in [(4096, 14336), (8192, 28672), (3072, 8192)]:
        for tokens in (8192, 16384):
            for bidirectional, unroll in cost.VARIANTS.values():
                before, after = (cost.mlp_block(hw, hidden, ffn, tokens, bidirectional=bidirectional, unroll=unroll)
                                 for hw in (old, new))
                largest = max(largest, abs(before["speedup"] - after["speedup"]))
            picks = [cost.mlp_block(hw, hidden, ffn, tokens, variant="auto")["variants"] for hw in (old, new)]
            if picks[0] != picks[1]:
                changed.append((hidden, tokens, *picks))
    assert round(largest, 3) == 0.033
    assert changed == [(8192, 8192, ["bidi-full", "full"], ["bidi-full", "unroll2"])]

    log = (ROOT / "bench" / "gpu" / "h200_gpu_checks_topology_20261127.log").read_text()
    tiny = log.split("--model tiny --layers 4", 1)[1].split("== ", 1)[0]
    assert re.search(r"\n  uni +compile .*while 31;.*collective-permute 31 async \(31 overlapped\) 0 sync", tiny)
    assert re.search(r"\n  auto +compile .*collective-permute 322 async \(322 overlapped\) 0 sync.*'bidi-full': 31", tiny)
    assert re.search(r"\n  original +compile .*all-gather 9 async \(1 overlapped\) 7 sync, reduce-scatter 0 async "
                     r"\(0 overlapped\) 15 sync", tiny)


def test_the_summary_quotes_what_the_gpu_runs_measured():
    """docs/performance-summary.md's GPU statements are the stored runs': the roles' split points
    (the H200 calibrations of 2026-11-26), the slice kernels `uni` runs in the 8-GPU compiles
    (and that dynamic slice fusion leaves them), and the profiles' overlap counted per executed
    permute."""
    summary = (ROOT / "docs" / "performance-summary.md").read_text()
    roles: dict[str, list[float]] = {"contracting": [], "batch": [], "free": []}
    for path in H200_SOURCES[:3]:
        for key, role in json.loads((ROOT / path).read_text())["roles"].items():
            roles[key.split()[1]].append(role["split"])
            roles["free"].append(role["split_from_points"])
    span = {name: f"{min(v):.2f}–{max(v):.2f}" for name, v in roles.items()}
    assert f"on the H200 {span['contracting']} and {span['batch']} against {span['free']}" in summary, span

    mib = {}
    for model, run in (("8b", "h100_topology_8b_20261126"), ("70b", "h100_topology_70b_20261127"),
                       ("8b", "h200_topology_8b_20261127"), ("70b", "h200_topology_70b_20261127")):
        programs = json.loads((ROOT / "bench" / "gpu" / f"{run}.json").read_text())["programs"]
        copies = programs["uni"]["slice_copies"]
        assert programs["uni-dsf"]["slice_copies"] == copies  # the fusion removes none of them
        assert copies["executed"] == 116
        assert mib.setdefault(model, copies["bytes_executed"] / 2**20) == copies["bytes_executed"] / 2**20
    assert f"`uni` runs 116, {mib['8b']:.0f} MiB\n  at 8B and {mib['70b']:.0f} MiB at 70B" in summary

    # the overlap the profiles hold is per executed permute: the 8B and 70B steps' counts, pooled
    executed = {name: [0, 0] for name in cost.H100_OVERLAP}
    for path in [p for p in STORED_SOURCES if "topology" in p]:
        for name, counts in executed.items():
            permutes = json.loads((ROOT / path).read_text())["programs"][name]["collectives"]["collective-permute"]
            counts[0] += permutes["overlapped_executed"]
            counts[1] += permutes["executed"]
    assert {name: a / b for name, (a, b) in executed.items()} == cost.H100_OVERLAP
    assert "counted per executed permute" in summary and "per permute op" not in summary


def test_the_passcost_part_fits_a_call_and_writes_what_comes_back():
    """The optional `passcost` part (docs/gpu.md's table and section 8): its steps' limits as the
    table says and inside a call, the bench's pass cost for 8 mocked GPUs at make bench's layer
    counts, one JSON under $OUT beside the part's log."""
    outdir = "/device/out"
    steps = dry_run(outdir, "h100", "passcost")
    limit = sum(seconds + KILL_S for seconds, _ in steps)
    assert limit <= PART_LIMIT_S
    row = next(line for line in (ROOT / "docs" / "gpu.md").read_text().splitlines() if line.startswith("| `passcost` |"))
    assert row.split(" | ")[1] == f"{limit} s"
    calls = [tool_call(argv) for _, argv in steps if tool_call(argv)]
    assert [tool for tool, _ in calls] == ["tools/bench.py"]
    args = bench.build_parser().parse_args(calls[0][1])
    defaults = bench.build_parser().parse_args([])
    assert args.only_pass_cost and args.platform == "gpu" and args.layers == defaults.layers
    assert str(Path(args.out).relative_to(outdir)) == "h100_pass_cost.json" in row


def test_section_8_quotes_the_stored_pass_cost_run():
    """docs/gpu.md section 8 quotes bench/gpu/h200_pass_cost.json: its table row for row, the
    Megatron step's ends, and how much longer compile and pass took than in make bench's run."""
    run = json.loads((ROOT / "bench" / "gpu" / "h200_pass_cost.json").read_text())
    assert run["devices"] == "8 GPUs mocked on one NVIDIA H200" and run["jax"] == "0.11.2"
    text = (ROOT / "docs" / "gpu.md").read_text()
    section = text[text.index("## 8. The pass's cost compiled for 8 GPUs"):]
    rows = run["pass_cost_sequence_parallel"]["per_layers"]
    for r in rows:
        assert (f"| {r['layers']} | {r['sites']} | {r['lower_s'] + r['compile_s']:.2f} s | "
                f"{100 * r['jit_pass_over_lower_compile']:.2f} % | {100 * r['pass_over_lower_compile']:.2f} % |") in section
    megatron = run["pass_cost_megatron"]["per_layers"]
    assert (f"{100 * megatron[0]['jit_pass_over_lower_compile']:.2f} % at 1 layer to "
            f"{100 * megatron[-1]['jit_pass_over_lower_compile']:.2f} % at 32") in section
    cpu = {r["layers"]: r for r in json.loads((ROOT / "bench" / "results.json").read_text())["pass_cost"]["per_layers"]}
    compile_ratio = [(r["lower_s"] + r["compile_s"]) / (cpu[r["layers"]]["lower_s"] + cpu[r["layers"]]["compile_s"])
                     for r in rows]
    pass_ratio = [r["jit_pass_s"] / cpu[r["layers"]]["jit_pass_s"] for r in rows]
    assert (f"took {min(compile_ratio):.1f}–{max(compile_ratio):.1f}× as long as in `make bench`'s stored CPU run, "
            f"and the pass {min(pass_ratio):.1f}–{max(pass_ratio):.1f}× as long") in " ".join(section.split())
    shares = [row["pass_over_lower_compile"] for path in sorted((ROOT / "bench" / "gpu").glob("h*_topology_*b_2026112*.json"))
              if "no_flags" not in path.name for row in json.loads(path.read_text())["programs"].values()
              if "pass_over_lower_compile" in row]
    assert f"costs {100 * min(shares):.1f}–{100 * max(shares):.1f} % of lower + compile" in " ".join(section.split())
    performance = " ".join((ROOT / "docs" / "performance.md").read_text().split())  # "Where the fixed cost goes"
    assert (f"the pass {100 * rows[0]['jit_pass_over_lower_compile']:.2f} % at 1 layer to "
            f"{100 * rows[-1]['jit_pass_over_lower_compile']:.2f} % at 32 through the decorator") in performance
    assert f"it is {100 * min(shares):.1f}–{100 * max(shares):.1f} %." in performance


def test_section_9_quotes_the_h100_extras_and_the_medians_the_profile_takes():
    """docs/gpu.md section 9: the three H100 runs at 3B shapes (and the H200's two) as its table
    gives them, the spreads it names, the medians the `h100` profile holds at those steps, what
    the first run alone would have done to the 8B scatter's prediction and what the medians do,
    the dynamic-slice-fusion deltas and the no-flags counts."""
    gpu = ROOT / "bench" / "gpu"
    section = " ".join((ROOT / "docs" / "gpu.md").read_text().split("## 9. ", 1)[1].split())
    names = {("all_gather_dot", "free", 6): "gather", ("dot_reduce_scatter", "free", 6): "scatter",
             ("all_gather_dot", "free", 12): "gate and up merged", ("all_gather_dot", "contracting", 6): "contracting",
             ("all_gather_dot", "batch", 6): "batch"}
    keys = {"gather": ("all_gather_dot", "free"), "scatter": ("dot_reduce_scatter", "free"),
            "gate and up merged": ("all_gather_dot", "free"), "contracting": ("all_gather_dot", "contracting"),
            "batch": ("all_gather_dot", "batch")}
    h100_paths = [gpu / f"h100_calibrate_3b_20261127{s}.json" for s in ("", "_rerun1", "_rerun2")]
    assert h100_paths == [p for p in calibration_runs("h100") if "3b" in p.name]

    def splits(paths):
        out: dict[str, list[float]] = {}
        for path in paths:
            run = json.loads(path.read_text())
            for site in run["sites"]:
                key = (site["kind"], site.get("role") or "free", int(site["flops"] / run["ring"] / 1e9))
                out.setdefault(names[key], []).append((site["flops"] / run["ring"], site["efficiency_unrolled"]))
        return out

    ours = splits(h100_paths)
    theirs = splits([gpu / "h200_calibrate_3b.json", gpu / "h200_calibrate_3b_20261127.json"])
    for name in names.values():
        row = f"| {name} | {', '.join(f'{v:.3f}' for _, v in ours[name])} | {', '.join(f'{v:.3f}' for _, v in theirs[name])} |"
        assert row in section, row
    spread = {label: max(max(v for _, v in s) - min(v for _, v in s) for s in runs.values())
              for label, runs in (("ours", ours), ("theirs", theirs))}
    assert f"H200's two runs agree within {spread['theirs']:.3f}, the H100's three disagree by up to {spread['ours']:.2f}" \
        in section
    h100 = cost.PROFILES["h100"]
    medians = {}
    for name, points in ours.items():  # the profile's point at each 3B step is the runs' median
        medians[name] = round(statistics.median(v for _, v in points), 3)
        assert h100.split(*keys[name][:1], points[0][0], keys[name][1]) == medians[name], name
    assert "medians (" + ", ".join(f"{name} {value:.3f}" for name, value in medians.items()) + ")" in section

    scatter = cost.SiteShape("dot_reduce_scatter", 8, 2 * 8192 * (14336 // 8) * 4096, (8192 // 8) * 4096 * 2, "bf16")
    # the profile before: no 3B points, the 70B and 8B dots' median rate
    before = dataclasses.replace(h100, flops={**h100.flops, "bf16": 6.85e14, "default": 6.85e14},
                                 split_efficiency={k: tuple(p for p in v if p[0] > 1.3e10) for k, v in h100.split_efficiency.items()},
                                 loop_trip={k: tuple(p for p in v if p[0] > 1.3e10) for k, v in h100.loop_trip.items()})
    first = gpu_calibrate.merge([str(ROOT / p) for p in STORED_SOURCES[:3]], "h100")
    best = [max(cost.predict(scatter, hw).speedup.values()) for hw in (before, cost.hardware(first["hardware_override"]), h100)]
    assert f"from {best[0]:.2f}× to {best[1]:.2f}× on that noise" in section
    assert f"8B scatter's best per-site prediction is {best[2]:.2f}× (was {best[0]:.2f}×)" in section
    assert f"the 8B dot's {h100.flops['bf16'] / 1e12:.0f} TFLOP/s" in section

    dsf, plain = (json.loads((gpu / f"h100_calibrate_70b{s}.json").read_text())["sites"] for s in ("_dsf_20261127", ""))
    moves = [abs(a["efficiency_unrolled"] - b["efficiency_unrolled"]) for a, b in zip(dsf, plain)]
    assert f"at most {max(moves):.3f}" in section
    programs = json.loads((gpu / "h100_topology_8b_no_flags_20261127.json").read_text())["programs"]
    permutes = {name: programs[name]["collectives"]["collective-permute"] for name in ("bidi", "bidi-no-gpu-options", "uni")}
    assert (permutes["bidi"]["overlapped"], permutes["bidi-no-gpu-options"]["overlapped"],
            permutes["bidi"]["async"] + permutes["bidi"]["sync"], permutes["uni"]["overlapped"]) == (49, 36, 54, 15)


def test_the_profile_part_runs_with_the_repos_venv(tmp_path):
    """The profile part runs here, where python3 may lack jax: without PYTHON it takes the repo's
    .venv (make test's), with PYTHON that one; the GPU parts keep python3 (the GPU machine's)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"}

    def first_argv(part: str, **extra) -> str:
        proc = subprocess.run(["bash", str(SCRIPT), str(tmp_path), "h100", part], capture_output=True, text=True,
                              env=dict(env, GPU_CHECKS_DRY_RUN="1", **extra), timeout=60)
        assert proc.returncode == 0, proc.stderr
        return shlex.split(proc.stdout.splitlines()[-1].split("\t")[2])[0]

    venv = ROOT / ".venv" / "bin" / "python"
    assert first_argv("profile") == (str(venv) if venv.exists() else "python3")
    assert first_argv("profile", PYTHON="python3.11") == "python3.11"
    assert first_argv("calibrate") == "python3"
