#!/usr/bin/env python
"""Regenerate a hardware profile of the cost model from GPU runs' JSONs; times nothing, runs on CPU.

Takes the JSONs that ``tools/gpu_calibrate.py`` (one-GPU timings: split efficiency, loop-trip cost,
throughput) and ``tools/gpu_topology.py`` (the 8-GPU compile: permutes overlapped by a dot) wrote,
in any mix, and prints what they imply for ``cmatmul_pass.cost.PROFILES[profile]``:

* ``split_efficiency`` and ``loop_trip``: the calibration runs' points among the profile's, a later
  model's replacing an earlier one's at the same step, repeated runs of one model counting as one
  run of their medians (:func:`tools.gpu_calibrate.merge`);
* ``flops``: ``bf16`` (and ``f16``, ``default``: the profiles price them alike) the median of the
  runs' full dots at MLP-block shapes, the other element types each the median of the models that
  timed it (``element_rates``);
* ``overlap``: per variant, the permutes overlapped over those executed, pooled over the models
  (:func:`tools.gpu_topology.pooled_overlap`); a variant no run compiled keeps the profile's
  value, except ``bidi-full``, which takes ``bidi-unroll2``'s (as ``cost.H100_OVERLAP`` did until
  an H100 compiled it);

then the one ``--hardware`` override that sets all of it, and what moved against the profile as
it stands.  ``--check`` exits 1 if anything moved (rates by more than ``RATE_TOLERANCE``)::

    python tools/gpu_profile.py --profile h100 tools/gpu_measurements/h100_calibrate_70b.json \\
        tools/gpu_measurements/h100_calibrate_8b.json tools/gpu_measurements/h100_calibrate_3b.json \\
        tools/gpu_measurements/h100_topology_8b.json tools/gpu_measurements/h100_topology_70b.json --check

(the runs the ``h100`` profile is built from; docs/gpu.md names each).  ``tools/gpu_checks.sh DIR
h100 profile`` runs it over what the script's GPU parts wrote.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cmatmul_pass import cost  # noqa: E402
from tools import gpu_calibrate, gpu_topology  # noqa: E402

#: a variant no topology run compiled, and the measured variant whose overlap it is assumed to
#: have (two directions, rounds tied by barriers, straight-line; where compiled, on an H100 and an
#: H200, it hid more)
ASSUMED = {"bidi-full": "bidi-unroll2"}
#: relative difference of a throughput from the profile's that --check accepts: the profiles
#: round to 3 digits, and the same dot's throughput moves by about 2 % between runs (docs/gpu.md)
RATE_TOLERANCE = 0.02


def load(paths: list[str]) -> tuple[list[str], list[dict]]:
    """The calibration runs' paths and the topology runs (each with its ``source``); a file may
    hold one run or a list of runs of one kind (:func:`tools.gpu_calibrate.read_runs`)."""
    calibrations, topologies = [], []
    for path in paths:
        runs = gpu_calibrate.read_runs(path)
        if all("sites" in run for run in runs):
            calibrations.append(path)
        elif all("programs" in run for run in runs):
            topologies += [{**run, "source": path} for run in runs]
        else:
            raise SystemExit(f"{path}: neither a gpu_calibrate.py nor a gpu_topology.py result")
    return calibrations, topologies


def regenerate(paths: list[str], profile: str) -> dict:
    """The profile's measured fields from the runs ``paths``: ``fields`` (``split_efficiency``,
    ``loop_trip``: {point key: points}; ``flops``: {type: FLOP/s}; ``overlap``: {variant:
    fraction}), ``overlap_counts`` (variant: pooled counts, or where an unmeasured variant's
    value came from), ``hardware_override`` (one ``--hardware`` setting all of it), ``moved``
    (what differs from ``cost.PROFILES[profile]``: lines) and ``skipped`` runs."""
    known = cost.hardware(profile)
    calibrations, topologies = load(paths)
    fields: dict = {}
    items: list[str] = []
    if calibrations:
        merged = gpu_calibrate.merge(calibrations, profile)
        fields.update(merged["fields"])
        items += merged["hardware_override"].partition(":")[2].split(",")
        rates = {k: v for k, v in merged["rates"].items() if k not in ("bf16", "f16", "default")}
        bf16 = merged["throughput"]
        fields["flops"] = {**known.flops, "bf16": bf16, "f16": bf16, "default": bf16, **rates}
        fields["flops_measured"] = ["bf16", "f16", "default", *rates]
        items += [f"{key}={fields['flops'][key]:.3g}" for key in ("f16", "default", *rates)]
    pooled, skipped = gpu_topology.pooled_overlap(topologies)
    counts: dict[str, object] = dict(pooled)
    overlap = {name: entry["fraction"] for name, entry in pooled.items()}
    for name in cost.VARIANTS:
        if name in overlap:
            continue
        if ASSUMED.get(name) in pooled:
            overlap[name] = overlap[ASSUMED[name]]
            counts[name] = {**pooled[ASSUMED[name]], "assumed": ASSUMED[name]}
        elif topologies:
            overlap[name] = known.hidden(name)
            counts[name] = "not compiled: the profile's"
    if topologies:
        fields["overlap"] = {name: overlap[name] for name in cost.VARIANTS if overlap[name] < 1.0}
        items += gpu_topology.hardware_override(profile, overlap).partition(":")[2].split(",")
    override = f"{profile}:" + ",".join(items)
    cost.hardware(override)  # what it prints must be a valid --hardware
    return {"runs": paths, "fields": fields, "overlap_counts": counts, "hardware_override": override,
            "moved": moved(known, fields), "skipped": skipped}


def moved(known: cost.Hardware, fields: dict) -> list[str]:
    """Each regenerated value that differs from ``known``'s: points and overlap exactly (as the
    profile writes them), throughputs by more than RATE_TOLERANCE."""
    lines = []
    for field_name in ("split_efficiency", "loop_trip"):
        for key, points in fields.get(field_name, {}).items():
            stored = getattr(known, field_name)
            before = stored.get(key, ()) if isinstance(stored, dict) else ((1.0, stored),)
            if tuple(points) != tuple(before):
                lines.append(f"{field_name}[{key!r}]: {before!r} -> {points!r}")
    for key in fields.get("flops_measured", ()):
        rate = fields["flops"][key]
        before = known.flops.get(key)
        if before is None or abs(rate / before - 1) > RATE_TOLERANCE:
            lines.append(f"flops[{key!r}]: {before!r} -> {rate:.3g}")
    if "overlap" in fields:
        for name in cost.VARIANTS:
            now = fields["overlap"].get(name, 1.0)
            if now != known.hidden(name):
                lines.append(f"overlap[{name!r}]: {known.hidden(name):.4f} -> {now:.4f}")
    return lines


def render(result: dict, profile: str) -> str:
    """The regenerated fields as ``cost.PROFILES[profile]``'s keyword arguments, the override
    and what moved."""
    fields = result["fields"]
    out = [f"# tools/gpu_profile.py --profile {profile} over {len(result['runs'])} runs:",
           *(f"#   {path}" for path in result["runs"]),
           *(f"#   skipped {why}" for why in result["skipped"]),
           f"# for cost.PROFILES[{profile!r}]:"]
    if "flops" in fields:
        out.append("    flops={" + ", ".join(f"{k!r}: {v:.3g}" for k, v in fields["flops"].items()) + "},")
        out.append(f"#   measured: {', '.join(fields['flops_measured'])}; the others are the profile's")
    for field_name in ("split_efficiency", "loop_trip"):
        if field_name in fields:
            out.append(f"    {field_name}={fields[field_name]!r},")
    if "overlap" in fields:
        counts = result["overlap_counts"]
        out.append("    overlap={" + ", ".join(
            f"{name!r}: {counts[name]['overlapped']} / {counts[name]['executed']}" if isinstance(counts[name], dict)
            else f"{name!r}: {value!r}" for name, value in fields["overlap"].items()) + "},")
        for name, entry in counts.items():
            how = (f"not compiled: assumed {entry['assumed']}'s" if isinstance(entry, dict) and "assumed" in entry
                   else ", ".join(f"{model} {o} of {e}" for model, (o, e) in entry["models"].items())
                   if isinstance(entry, dict) else entry)
            out.append(f"#   overlap {name}: {how}")
    out.append(f'--hardware "{result["hardware_override"]}"')
    out.append(f"against cost.PROFILES[{profile!r}]: "
               + ("unchanged" if not result["moved"] else f"{len(result['moved'])} moved"))
    out += [f"  moved: {line}" for line in result["moved"]]
    return "\n".join(out) + "\n"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", metavar="RUN.json",
                        help="gpu_calibrate.py and gpu_topology.py results; a later model's run replaces an earlier "
                             "one's point at the same step (repeated runs of one model: their medians), a later "
                             "topology run its model's count of the same variant")
    parser.add_argument("--profile", default="h100", help="the cost-model profile to regenerate")
    parser.add_argument("--out", help="also write what is printed to this file")
    parser.add_argument("--check", action="store_true", help="exit 1 if the runs move anything in the profile")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result = regenerate(args.runs, args.profile)
    text = render(result, args.profile)
    print(text, end="")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    return 1 if args.check and result["moved"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
