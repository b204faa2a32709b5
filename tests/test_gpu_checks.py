"""tools/gpu_checks.sh and tools/gpu_profile.py, on CPU: the commands docs/gpu.md gives ("Running
them") are checked line by line. The GPU parts go through the script's dry run (each part's steps
end within 9 minutes, name existing tools with options they take, write a few files under OUT);
the profile step, and the lines that rebuild the h100 and h200 profiles from the stored runs
(tools/gpu_measurements), run for real; the page's table of the profiles' points is the profiles'."""

from __future__ import annotations

import json
import os
import re
import shlex
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
#: the most files a part writes under OUT
FILES_BACK = 8
#: what a part may spend: each ends within 9 minutes, so it fits a 10-minute slot
PART_LIMIT_S = 540
#: the GPU parts together (calibrate, topology, extras)
GPU_PARTS_S = 25 * 60
KILL_S = 5  # the script's --kill-after
PARSERS = {"tools/gpu_calibrate.py": gpu_calibrate.build_parser, "tools/gpu_topology.py": gpu_topology.build_parser,
           "tools/gpu_profile.py": gpu_profile.build_parser, "tools/bench.py": bench.build_parser}
#: where the GPU measurements the profiles are built from are kept (docs/gpu.md names each)
MEASUREMENTS = "tools/gpu_measurements"
STORED_SOURCES = [f"{MEASUREMENTS}/{name}.json" for name in (
    "h100_calibrate_70b", "h100_calibrate_8b", "h100_calibrate_3b",  # the 3B file: three runs, in order
    "h100_topology_8b", "h100_topology_70b")]


def procedure() -> tuple[list[str], list[str]]:
    """The two text blocks of docs/gpu.md's "Running them": the commands, and the lines that
    rebuild the profiles from the stored runs."""
    lines = (ROOT / "docs" / "gpu.md").read_text().splitlines()
    first = lines.index("## Running them") + 1
    end = next(i for i in range(first, len(lines)) if lines[i].startswith("## ")) + 1
    found = [body for line, lang, body, _ in blocks(ROOT / "docs" / "gpu.md") if lang == "text" and first < line < end]
    assert len(found) == 2, found
    return [line for line in found[0].splitlines() if line.strip()], [l for l in found[1].splitlines() if l.strip()]


def check_line(profile: str) -> str:
    """The documented line that rebuilds ``profile`` from the stored runs."""
    (line,) = [line for line in procedure()[1] if f"--profile {profile} " in line]
    return line


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


def test_the_documented_parts_fit_their_limits_and_name_only_existing_tools_and_options():
    """Each GPU part the page runs: its steps' limits sum to at most 9 minutes, its tools exist and
    parse the options given (argparse: a misspelt option or program name fails), and it writes at
    most 8 files under OUT, with plain names; the GPU parts together within 25 minutes; between
    them they compile every variant at 8B and 70B and calibrate both. The copy line takes every
    JSON they write, and the profile part reads what they wrote."""
    lines, _ = procedure()
    parts = [m.group(1) for m in (re.fullmatch(r"bash tools/gpu_checks.sh OUT h100 (\w+)", line) for line in lines) if m]
    assert parts == ["calibrate", "topology", "extras"]
    outdir = "/device/out"
    total, compiled, calibrated, written_json = 0, {}, set(), []
    for part in parts:
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
    (copy,) = [line for line in lines if line.startswith("cp ")]
    pattern = copy.split()[1].removeprefix("OUT/")
    assert all(Path(f).match(pattern) for f in written_json) and not Path("gpu_checks_calibrate.log").match(pattern)
    (step,) = dry_run(outdir, "h100", "profile")
    tool, args = tool_call(step[1])
    read = [str(Path(r).relative_to(outdir)) for r in gpu_profile.build_parser().parse_args(args).runs]
    assert set(read) <= set(written_json) and step[0] + KILL_S <= PART_LIMIT_S


def test_the_profile_step_runs_on_the_copied_runs(tmp_path):
    """The page's last command, run over the stored runs as the GPU parts name them (as if just
    copied back): it prints and writes the profile's fields and a valid --hardware override."""
    lines, _ = procedure()
    (line,) = [line for line in lines if line.startswith(f"bash tools/gpu_checks.sh {MEASUREMENTS} ")]
    runs = tmp_path / "gpu"
    runs.mkdir()
    for source in STORED_SOURCES:  # one run a file, as a part writes it (of the 3B file's three runs, the first)
        first = gpu_calibrate.read_runs(ROOT / source)[0]
        (runs / Path(source).name).write_text(json.dumps(first, indent=2) + "\n")
    argv = shlex.split(line.replace(MEASUREMENTS, str(runs), 1))
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHON=sys.executable))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    written = (runs / "h100_profile.txt").read_text()
    assert written in proc.stdout and "for cost.PROFILES['h100']" in written
    (override,) = re.findall(r'^--hardware "(.*)"$', written, re.M)
    assert cost.hardware(override).hidden("full") == pytest.approx(202 / 210, abs=5e-4)


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
    measured, not assumed), its throughput within the runs' noise; without the 70B topology run
    the overlap moves and --check fails."""
    result = rebuilds(check_line("h100"), "h100", STORED_SOURCES)
    h100 = cost.PROFILES["h100"]
    assert result["fields"]["overlap"] == cost.H100_OVERLAP == {
        "full": 202 / 210, "bidi": 298 / 308, "bidi-unroll2": 289 / 308, "bidi-full": 304 / 308}
    assert "assumed" not in result["overlap_counts"]["bidi-full"]
    hw = cost.hardware(result["hardware_override"])
    assert hw.split_efficiency == h100.split_efficiency and hw.loop_trip == h100.loop_trip
    assert hw.throughput("bf16") == pytest.approx(h100.throughput("bf16"), rel=gpu_profile.RATE_TOLERANCE)
    fewer = [p for p in STORED_SOURCES if "topology_70b" not in p]
    proc = subprocess.run([sys.executable, "tools/gpu_profile.py", "--profile", "h100", *fewer, "--check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "moved: overlap[" in proc.stdout, proc.stdout


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


H200_SOURCES = [f"{MEASUREMENTS}/{name}.json" for name in (
    "h200_calibrate_70b", "h200_calibrate_8b", "h200_calibrate_3b", "h200_topology_8b", "h200_topology_70b")]


def calibration_runs(profile: str) -> list[Path]:
    """The calibration runs a profile is built from (docs/gpu.md's --check lines name them)."""
    sources = {"h100": STORED_SOURCES, "h200": H200_SOURCES}[profile]
    return [ROOT / path for path in sources if "_calibrate_" in path]


def runs_by_model(paths: list) -> dict[str, list[dict]]:
    """The calibration runs at ``paths`` (JSONs, each one run or a list of runs) by model, in order:
    a model's repeated runs count as one run of their medians (tools/gpu_calibrate.merge)."""
    by_model: dict[str, list[dict]] = {}
    for path in paths:
        for run in gpu_calibrate.read_runs(path):
            by_model.setdefault(run["model"], []).append(run)
    return by_model


def free_full_dots(by_model: dict[str, list[dict]]) -> list[float]:
    """Each model's free sites' full-dot throughputs, each site's the median over the model's runs."""
    return [statistics.median(site["full_throughput"] for site in sites) for runs in by_model.values()
            for sites in zip(*[[s for s in r["sites"] if s.get("role", "free") == "free"] for r in runs])]


def test_the_stored_runs_rebuild_the_h200_profile():
    """The stored H200 runs (calibrate, topology, extras on one H200) imply exactly the h200
    profile: docs/gpu.md's line exits 0, every split, loop-trip point, element rate and overlap
    unmoved, bidi-full hiding every permute it was compiled with."""
    result = rebuilds(check_line("h200"), "h200", H200_SOURCES)
    h200 = cost.PROFILES["h200"]
    assert result["fields"]["overlap"] == cost.H200_OVERLAP == h200.overlap
    assert result["overlap_counts"]["bidi-full"]["fraction"] == 1.0 == h200.hidden("bidi-full")
    assert "assumed" not in result["overlap_counts"]["bidi-full"]
    # without the 3B run the element rates are medians of two runs, not three: the check says so
    proc = subprocess.run([sys.executable, "tools/gpu_profile.py", "--profile", "h200",
                           *[p for p in H200_SOURCES if "3b" not in p], "--check"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "moved: flops['f8']: 791000000000000.0 -> 8.35e+14" in proc.stdout, proc.stdout


def test_the_pages_quote_the_profiles_and_the_stored_runs():
    """docs/gpu.md's table of split and loop-trip points is cost.PROFILES' (each row a kind and
    role of one profile, each column a step's GFLOP); performance.md's overlap counts are the
    stored topology runs' permutes as executed, pooled, which the h100 profile holds; and the
    slice kernels `uni` runs, which dynamic slice fusion leaves."""
    text = (ROOT / "docs" / "gpu.md").read_text()
    header = next(line for line in text.splitlines() if line.startswith("| | 6.4 |"))
    steps = [float(c) for c in header.split("|")[2:-1]]
    names = {"gather": "all_gather_dot", "scatter": "dot_reduce_scatter", "contracting": "all_gather_dot/contracting",
             "batch": "all_gather_dot/batch"}
    rows = 0
    for profile in ("h100", "h200"):
        hw = cost.PROFILES[profile]
        points = {**{f"{name}, split": hw.split_efficiency[key] for name, key in names.items()},
                  **{f"{name}, loop trip (µs)": hw.loop_trip[names[name]] for name in ("gather", "scatter")}}
        for label, values in points.items():
            at = {round(flops / 1e9, 1): v for flops, v in values}
            assert set(at) <= set(steps), (profile, label)
            cells = [("—" if step not in at else f"{1e6 * at[step]:.1f}" if "trip" in label else f"{at[step]:.3f}")
                     for step in steps]
            assert f"| {profile} {label} | {' | '.join(cells)} |" in text, (profile, label)
            rows += 1
    assert rows == 12
    executed = {name: [0, 0] for name in cost.H100_OVERLAP}
    for path in [p for p in STORED_SOURCES if "topology" in p]:
        programs = json.loads((ROOT / path).read_text())["programs"]
        for name, counts in executed.items():
            permutes = programs[name]["collectives"]["collective-permute"]
            counts[0] += permutes["overlapped_executed"]
            counts[1] += permutes["executed"]
        copies = programs["uni"]["slice_copies"]
        assert programs["uni-dsf"]["slice_copies"] == copies and copies["executed"] == 116
    assert {name: a / b for name, (a, b) in executed.items()} == cost.H100_OVERLAP
    performance = (ROOT / "docs" / "performance.md").read_text()
    assert (f"`full` {executed['full'][0]}/{executed['full'][1]}; `bidi` {executed['bidi'][0]}/{executed['bidi'][1]}; "
            f"`bidi-unroll2` {executed['bidi-unroll2'][0]}/{executed['bidi-unroll2'][1]}; "
            f"`bidi-full` {executed['bidi-full'][0]}/{executed['bidi-full'][1]}") in performance


def test_the_passcost_part_fits_a_call_and_writes_what_comes_back():
    """The optional `passcost` part (docs/gpu.md's table): its steps' limits as the table says and
    within a part's limit, the bench's pass cost for 8 mocked GPUs at make bench's layer
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
