#!/usr/bin/env python
"""Differential fuzzing campaign (``make fuzz``): random shard_map programs, every pass variant.

Each program (see tools/fuzz_programs.py) is lowered, rewritten under every variant, verified,
checked for the permute-ring property and run against the original on the CPU devices.  Prints the
counts — programs, variant runs, sites rewritten, sites declined by reason, mismatches, crashes — and
every failing program; exits 1 if any run mismatched or crashed.

    python tools/fuzz.py [--examples 1000] [--seed 0] [--kind psum --norm] [--pad] [--gather-norm] [--check-replay]
    python tools/fuzz.py --kind adversarial [--examples 200] [--jobs 2] [--class slice_index] [--all-variants]

``--kind adversarial`` (or ``--adversarial``) runs tools/fuzz_adversarial.py's programs instead:
each breaks a precondition of a collective motion and comes with its device-invariant twin;
every run executes in a worker process with a time limit, and the summary counts hangs,
crashes, mismatches and twins left unmoved ("twin_declined") per class.

``--check-replay`` (``replay.CHECK``): each group of identical regions is rewritten in its last
region too, which must come out as its first; a program where one does not fails the campaign.
Every campaign checks each site mapped into a ring function against matching its copy there
(``sharing.CHECK``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
# every legal site rewritten, as the suite runs (tests/conftest.py): the programs are tiny, and the
# default policy (auto) would leave them as written
os.environ.setdefault("CMATMUL_PASS_POLICY", "all")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hypothesis import HealthCheck, given, seed, settings  # noqa: E402

from tools import fuzz_adversarial, fuzz_programs  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kind", action="append",
                        help="only programs of this kind (repeatable): ag, rs, psum, ..., ag_norm, adversarial, moe "
                             "(tools/fuzz_moe.py), attention (tools/fuzz_attention.py), columns (tools/fuzz_columns.py)")
    parser.add_argument("--norm", action="store_true", help="a norm's backward wherever the kind takes one (rs, psum)")
    parser.add_argument("--two-stage", action="store_true",
                        help="only scatters of a psum over another mesh axis (a reduction in two stages)")
    parser.add_argument("--pad", action="store_true",
                        help="only scatters of a product padded with zero rows along the scattered dim (rs) and "
                             "gathers cropped before their dots (ag)")
    parser.add_argument("--gather-norm", action="store_true",
                        help="only gathers whose rows are normalised before their dots while the raw rows are read "
                             "elsewhere (kind ag_norm, which the default campaign does not draw)")
    parser.add_argument("--check-replay", action="store_true",
                        help="rewrite each group of identical regions' last region too and fail where it comes out "
                             "unlike the first (replay.CHECK)")
    parser.add_argument("--adversarial", action="store_true",
                        help="the adversarial kind: programs that break each motion's preconditions, and their twins "
                             "(the same as --kind adversarial; tools/fuzz_adversarial.py)")
    parser.add_argument("--class", dest="classes", action="append",
                        help="adversarial: only this class (repeatable): " + ", ".join(fuzz_adversarial.CLASSES))
    parser.add_argument("--jobs", type=int, default=1, help="adversarial: worker processes at once")
    parser.add_argument("--limit", type=float, default=60.0,
                        help="adversarial: seconds a run may go without answering before it counts as a hang")
    parser.add_argument("--all-variants", action="store_true",
                        help="adversarial: rewrite under every variant of the default campaign, not only the "
                             "default options and 'uni' (policy all, psums split)")
    args = parser.parse_args(argv)
    if "attention" in (args.kind or ()):
        status = attention(args)
        args.kind = [k for k in args.kind if k != "attention"]
        if not args.kind:
            return status
    if "columns" in (args.kind or ()):
        status = columns(args)
        args.kind = [k for k in args.kind if k != "columns"]
        if not args.kind:
            return status
    if "moe" in (args.kind or ()):
        status = moe(args)
        args.kind = [k for k in args.kind if k != "moe"]
        if not args.kind:
            return status
    if args.adversarial or "adversarial" in (args.kind or ()):
        status = adversarial(args)
        args.kind = [k for k in args.kind or () if k != "adversarial"]
        if not args.kind:
            return status
    else:
        status = 0
    from cmatmul_pass import sharing

    sharing.CHECK = True
    if args.check_replay:
        from cmatmul_pass import replay

        replay.CHECK = True
    if args.gather_norm:
        args.kind = ["ag_norm"]
    tally = fuzz_programs.Tally()
    _campaign(args, fuzz_programs.specs(tuple(args.kind or ()), args.norm or None, args.two_stage, args.pad),
              fuzz_programs.check, tally, every=50)
    return 1 if status or tally.crashes or tally.mismatches or tally.differed else 0


def _campaign(args, strategy, check, tally, every: int) -> None:
    """``args.examples`` programs drawn from ``strategy`` (seeded), each ``check``ed into
    ``tally``; the summary and every failure printed."""
    start = time.perf_counter()

    @seed(args.seed)
    @settings(max_examples=args.examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(strategy)
    def campaign(spec):
        try:
            check(spec, tally)
        except Exception as exc:  # noqa: BLE001 - lowering itself failed: a generator bug, report it
            tally.crashes.append((spec, "lower", f"{type(exc).__name__}: {exc}"))
        if tally.programs % every == 0:
            print(f"  ... {tally.programs} programs, {time.perf_counter() - start:.0f} s", flush=True)

    campaign()
    print(tally.summary())
    for spec, variant, message in tally.crashes + tally.mismatches + tally.differed:
        print(f"--- {variant}: {spec}\n{message}")


def moe(args) -> int:
    """The MoE campaign (tools/fuzz_moe.py): ``args.examples`` MoE blocks, every variant."""
    from tools import fuzz_moe

    tally = fuzz_programs.Tally()
    _campaign(args, fuzz_moe.any_moe_specs(), fuzz_moe.check, tally, every=20)
    return 1 if tally.crashes or tally.mismatches else 0


def attention(args) -> int:
    """The attention campaign (tools/fuzz_attention.py): ``args.examples`` context-parallel
    attentions, every variant."""
    from tools import fuzz_attention

    tally = fuzz_programs.Tally()
    _campaign(args, fuzz_attention.attention_specs(), fuzz_attention.check, tally, every=20)
    return 1 if tally.crashes or tally.mismatches else 0


def columns(args) -> int:
    """The columns campaign (tools/fuzz_columns.py): ``args.examples`` contrastive losses over
    gathered negatives with their gradients, every variant."""
    from tools import fuzz_columns

    tally = fuzz_programs.Tally()
    _campaign(args, fuzz_columns.columns_specs(), fuzz_columns.check, tally, every=20)
    return 1 if tally.crashes or tally.mismatches else 0


def adversarial(args) -> int:
    """The adversarial campaign: ``args.examples`` programs (adversary, twin, adversary, ...)."""
    names = ("default", "policy-auto", *fuzz_programs.VARIANTS) if args.all_variants else fuzz_adversarial.OPTION_SETS
    specs = fuzz_adversarial.pairs(args.examples, args.seed, tuple(args.classes or fuzz_adversarial.CLASSES))

    def progress(tally, spec, results, error):
        if tally.programs % 20 == 0:
            print(f"  ... {tally.programs} programs", flush=True)

    tally = fuzz_adversarial.run_campaign(specs, names, jobs=args.jobs, limit=args.limit, progress=progress)
    print(tally.summary())
    print(tally.report())
    return 1 if tally.failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
