"""``python -m cmatmul_pass {rewrite,check,explain,bench}`` (also installed as ``cmatmul-pass``).

The exit codes are ``EXIT_CODES`` (every command's ``--help`` ends with them; docs/cli.md is
written from them and from the parser by ``tools/gen_cli_doc.py``). The input defaults to stdin
when omitted, as ``mlir-opt`` reads it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
from pathlib import Path

from . import __version__
from .errors import CmatmulError, InputError, InternalError
from .output_files import write_output

DEFAULT_CPU_DEVICES = 8
PROG = "cmatmul_pass"
#: ring variants as ``cost.VARIANTS`` names them, and the ``rewrite`` flags that select each
VARIANT_FLAGS = {
    "uni": "",
    "unroll2": "--unroll 2",
    "full": "--unroll full",
    "bidi": "--bidirectional",
    "bidi-unroll2": "--bidirectional --unroll 2",
    "bidi-full": "--bidirectional --unroll full",
}
VARIANT_NAMES = tuple(VARIANT_FLAGS)
#: what to use instead on a program with no shard_map region: XLA's own collective matmul for
#: programs jax.jit partitions itself (GPU only; these flag names are in jaxlib 0.10.2's XLA)
WINDOWED_EINSUM_FLAGS = "--xla_gpu_threshold_for_windowed_einsum_mib=0 --xla_gpu_multi_streamed_windowed_einsum=true"
#: the collectives a module without candidate sites is counted for (``census``)
COLLECTIVES = ("stablehlo.all_reduce", "stablehlo.all_gather", "stablehlo.reduce_scatter", "stablehlo.all_to_all",
               "stablehlo.collective_permute")


#: what each exit status means, for every command
EXIT_CODES = {
    0: "done; also `check` or `bench` on a module where no site was rewritten (said in one line)",
    1: "numerics mismatch (`check`, `bench`: a rewritten program computes something else)",
    2: "bad input or usage: one line on stderr naming the file and its line:col, no traceback, no output "
       "file written; also XLA failing to compile or run a module for `check` or `bench`",
    3: "could not finish: an internal error (a rewrite that does not verify: a bug here, please report it), "
       "or `check` could not check (an input layout it cannot make, an error of the check itself, "
       "outputs the original itself leaves inf/NaN or near overflow on the inputs run: outside the program's "
       "domain)",
}


def exit_codes_epilog() -> str:
    """The exit codes as every ``--help`` ends with them."""
    return "exit codes:\n" + "\n".join(
        textwrap.fill(meaning.replace("`", ""), 78, initial_indent=f"  {code}  ", subsequent_indent="     ")
        for code, meaning in EXIT_CODES.items())


class NothingToRun(Exception):
    """``check`` / ``bench`` on a module where the pass rewrote no site: the rewritten program is
    the original, so there is nothing to compare or time (said in one line, exit 0)."""


def ensure_cpu_devices(count: int = DEFAULT_CPU_DEVICES) -> None:
    """Ask XLA for ``count`` virtual CPU devices unless the user already chose (must precede ``import jax``)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="Collective-matmul rewriting for StableHLO.",
                                     allow_abbrev=False, epilog=exit_codes_epilog(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    def add_command(name: str, **kw) -> argparse.ArgumentParser:  # no prefix abbreviations, anywhere
        return sub.add_parser(name, allow_abbrev=False, epilog=exit_codes_epilog(),
                              formatter_class=argparse.RawDescriptionHelpFormatter, **kw)

    def add_report(p: argparse.ArgumentParser) -> None:
        p.add_argument("--report-json", metavar="PATH", help="write the per-site report as JSON")

    def add_input(p: argparse.ArgumentParser, variant_flags: bool = True) -> None:
        p.add_argument("input", nargs="?", default="-",
                       help="StableHLO text or bytecode; '-' or none: stdin")
        p.add_argument("--quiet", "-q", action="store_true",
                       help="no per-site summary, notes or warnings on stderr")
        if variant_flags:
            p.add_argument("--bidirectional", action="store_true", help="use both ring directions")
            p.add_argument(
                "--unroll",
                choices=["1", "2", "full"],
                help="ring rounds per loop trip (1 or 2; alone, one direction); 'full': no loop, the whole ring "
                     "straight-line (default: --variant auto)",
            )
            p.add_argument(
                "--variant",
                choices=[*VARIANT_NAMES, "auto"],
                help="a ring variant by name, instead of --bidirectional/--unroll; 'auto' (the default): per "
                     "site, the variant the cost model predicts fastest on --hardware (with --hardware auto "
                     "on a machine no profile describes: full on a ring of up to 8 (uni for a scatter of 8 MiB "
                     "of partial sums or more), else unroll2)",
            )
        p.add_argument(
            "--annotate-streams",
            action="store_true",
            help="outline each round's dots onto GPU compute streams and group each permute with them",
        )
        p.add_argument("--policy", default=None, choices=["all", "auto"],
                       help="auto (the default, or $CMATMUL_PASS_POLICY): only where the cost model predicts a "
                            "gain on --hardware; all: every legal site")
        p.add_argument("--hardware", default="h100",
                       help="cost-model profile: h100, h200, a100, tpu-v5e, or auto (this machine's default "
                            "jax device; h100 where no profile describes it), optionally with overrides "
                            "(h100:bandwidth=400e9,bf16=700e12,step=8e-6)")
        p.add_argument("--min-bytes", type=int, default=0, help="leave sites moving fewer bytes per device")
        p.add_argument("--compile-budget", type=_budget, default=None, metavar="R",
                       help="with --policy auto, keep the rewritten program's predicted XLA compile time within R "
                            "times the original's (default 1.4; past it, loop forms or sites left as written); "
                            "none: no budget")
        p.add_argument("--all-reduce", choices=["split", "chunk", "auto", "keep"],
                       help="a psum of a matmul (dot -> all_reduce): split into a reduce-scatter ring whose gather "
                            "moves forward to the next matmul's ring, chunk the rows so each chunk's all_reduce "
                            "overlaps the next chunk's dot, auto (default): the faster of the two by the cost model, "
                            "on a tie within 1%% chunk, or split where the value goes on to a matmul (chunk in two "
                            "where no profile describes the machine), keep: leave them")
        p.add_argument("--chunks", type=int, choices=range(2, 9), metavar="K",
                       help="chunks for --all-reduce chunk, 2 to 8 (default: the cost model's pick of 2, 4, 8)")
        p.add_argument(
            "--no-assemble",
            dest="assemble",
            action="store_false",
            help="decline an all_gather whose value other ops also read, instead of assembling it in the loop",
        )
        p.add_argument(
            "--no-merge-dots",
            dest="merge_dots",
            action="store_false",
            help="compute a gather's dots that share the gathered value separately in each round "
                 "(by default dots differing only in one free dim of their other operand are one dot)",
        )
        p.add_argument(
            "--no-tie-rounds",
            dest="tie_rounds",
            action="store_false",
            help="no optimization barriers between the rounds of unrolled, straight-line and "
                 "bidirectional rings (XLA may then merge their dots, or start a round's transfer "
                 "during the previous round's dot)",
        )
        p.add_argument(
            "--no-share-rings",
            dest="share_rings",
            action="store_false",
            help="give every site its own ring, even where it repeats an earlier site's pattern "
                 "(by default such sites call one shared ring function)",
        )

    p = add_command("rewrite", help="rewrite a module")
    add_input(p)
    p.add_argument("-o", "--output", default="-", help="output path ('-': stdout)")
    add_report(p)
    p.add_argument("--debug-info", action="store_true", help="print locations in the output")
    p.add_argument("--emit-bytecode", action="store_true", help="write MLIR bytecode instead of text")
    p.add_argument(
        "--emit",
        default="stablehlo",
        choices=["stablehlo", "hlo"],
        help="output dialect: StableHLO (default) or pre-optimisation HLO text",
    )

    p = add_command("check", help="rewrite, run original and rewritten on CPU devices, compare outputs "
                                  "(exit 0: as accurate as the original; 1: a mismatch)")
    add_input(p)
    add_report(p)
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    p.add_argument("--rewritten", metavar="FILE",
                   help="compare this module with INPUT instead of rewriting INPUT (a rewrite saved earlier, "
                        "edited by hand or made by another tool)")
    p.add_argument("--inputs", metavar="NPZ",
                   help="run on these arguments (an .npz with arg0, arg1, ... or one array per argument in "
                        "order) instead of random ones")
    p.add_argument("--print-input-spec", action="store_true",
                   help="print the arguments the module takes (what --inputs must hold: name, type, sharding, and "
                        "how a random draw keeps each in the program's domain) and exit")

    p = add_command("explain", help="show every candidate site, the decision and its reason")
    add_input(p)
    p.add_argument("--plot", metavar="PNG", help="draw each site's predicted schedule (Gantt chart) into PNG")

    p = add_command(
        "bench", help="time the original and each ring variant on this machine's devices; name the fastest"
    )
    add_input(p, variant_flags=False)
    add_report(p)
    p.add_argument("--variants", default="all",
                   help=f"comma-separated variants to time ({', '.join(VARIANT_NAMES)}, auto: each site "
                        "the variant the cost model picks for --hardware; all: the six named)")
    p.add_argument("--runs", type=int, default=7, help="timed runs per program (the median is reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs before timing")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    p.add_argument("--platform", default="auto",
                   help="where to run: a jax platform (cpu, gpu, ...) or 'auto': the default backend when it "
                        "has a device per partition, else the CPU devices")
    return parser


def read_input(path: str) -> tuple[bytes, str]:
    if path == "-":
        return sys.stdin.buffer.read(), "<stdin>"
    p = Path(path)
    try:
        return p.read_bytes(), path
    except IsADirectoryError:
        raise InputError(path, "is a directory, not a module file") from None
    except FileNotFoundError:
        raise InputError(path, "no such file") from None
    except OSError as exc:
        raise InputError(path, f"cannot read: {exc.strerror or exc}") from None


def _budget(text: str) -> float | str:
    """``--compile-budget``'s value: a ratio of at least 1, or ``"none"``."""
    if text.lower() == "none":
        return "none"
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number or 'none': {text!r}") from None
    if not value >= 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {text!r}")
    return value


def _options(args, variant: str | None = None):
    from .pipeline import Options, variant_options

    common = dict(
        debug_info=getattr(args, "debug_info", False),
        assemble=args.assemble,
        annotate_streams=args.annotate_streams,
        share_rings=args.share_rings,
        merge_dots=args.merge_dots,
        tie_rounds=args.tie_rounds,
        **({} if args.policy is None else {"policy": args.policy}),
        hardware=args.hardware,
        min_bytes=args.min_bytes,
        **({} if args.compile_budget is None else {"compile_budget": None if args.compile_budget == "none"
                                                    else args.compile_budget}),
        all_reduce=args.all_reduce,
        chunks=args.chunks,
    )
    if variant is None and args.variant is not None:
        if args.bidirectional or args.unroll is not None:
            raise CmatmulError("--variant names the ring variant; it cannot be combined with --bidirectional or --unroll")
        variant = args.variant
    if variant is not None:
        return variant_options(variant, **common)
    # neither --bidirectional nor --unroll: the default, --variant auto
    unroll = None if args.unroll is None else "full" if args.unroll == "full" else int(args.unroll)
    return Options(bidirectional=args.bidirectional or None, unroll=unroll, **common)


def options_from_argv(argv: list[str]):
    """The Options ``cmatmul_pass rewrite <argv>`` runs the pass with."""
    return _options(build_parser().parse_args(["rewrite", *argv, "-"]))


def render_with_args(text: str, argv: list[str], source: str = "<input>") -> str:
    """The output ``cmatmul_pass rewrite <argv> FILE`` prints for ``text`` (used by the goldens)."""
    from .pipeline import rewrite

    args = build_parser().parse_args(["rewrite", *argv, "-"])
    result = rewrite(text, _options(args), source=source)
    return result.hlo_text if args.emit == "hlo" else result.text


def _rewrite(args):
    from .pipeline import rewrite

    data, source = read_input(args.input)
    result = rewrite(data, _options(args), source=source)
    if not args.quiet:
        for site in result.report.sites:
            print(site.summary_line(), file=sys.stderr)
        for line in result.report.summary().splitlines():
            print(f"{PROG}: {line}", file=sys.stderr)
        say_notes(result)
        for line in slower_warnings(result.report):
            print(f"{PROG}: warning: {line}", file=sys.stderr)
    if args.command == "check" and not result.report.rewritten:
        _nothing_to_run(args, f"nothing to check: {_nothing_rewritten(result.report)}",
                        {**result.report.to_dict(), "numerics": None})
    return data, source, result


def _nothing_rewritten(report) -> str:
    declined = f" ({len(report.sites)} candidate site(s) declined; see explain)" if report.sites else ""
    return f"no site was rewritten{declined}, so the rewritten module is the original"


def _nothing_to_run(args, message: str, report: dict) -> None:
    """``check`` / ``bench`` with no site rewritten: write ``--report-json`` as every command
    does (``report`` with ``nothing_to_run``: ``message``), then stop (main says it, exit 0)."""
    if args.report_json:
        write_output(args.report_json, json.dumps({**report, "nothing_to_run": message}, indent=2) + "\n")
    raise NothingToRun(message)


def say_notes(result, file=None, prefix: str = f"{PROG}: ") -> None:
    """Print :func:`module_notes` (stderr by default, as ``rewrite`` and ``bench`` do; ``explain``
    prints them on stdout without the program's name)."""
    for line in module_notes(result):
        print(f"{prefix}note: {line}", file=file or sys.stderr)


def module_notes(result) -> list[str]:
    """What to say about a module with no candidate site at all, instead of nothing: that the
    pass sees only shard_map regions (and what to use for a program jax.jit partitions itself),
    or which collectives it saw.  Read from ``result.module``, which is then the input, unchanged."""
    from . import ir_utils
    from ._jax_private import ir

    if result.report.sites:
        return []
    found = ir_utils.ops_named(result.module.operation, "sdy.manual_computation", "stablehlo.custom_call",
                               *COLLECTIVES)
    legacy_manual = any(ir.StringAttr(op.attributes["call_target_name"]).value == "SPMDFullToShardShape"
                        for op in found["stablehlo.custom_call"])
    if not found["sdy.manual_computation"] and not legacy_manual:
        return ["the module has no shard_map (manual) region: the pass rewrites only explicit collectives inside "
                "jax.shard_map; for a program jax.jit shards by itself, XLA's own windowed einsum does this on GPU: "
                f"XLA_FLAGS='{WINDOWED_EINSUM_FLAGS}'"]
    census = ", ".join(f"{len(found[name])} {name.removeprefix('stablehlo.')}" for name in COLLECTIVES)
    return [f"no candidate site: the shard_map regions hold {census} (the pass rewrites an all_gather feeding a "
            "matmul, and a matmul's reduce_scatter or all_reduce sum)"]


def slower_warnings(report) -> list[str]:
    """One line for the rewritten sites the cost model predicts slower than the original on
    ``--hardware`` (``--policy all`` rewrote them; ``auto`` would have left them): how many, the
    slowest, and where the detail is (``explain``, per site).  Empty when there are none."""
    slower = _slower_sites(report)
    if not slower:
        return []
    worst_speedup, worst, hardware = min(slower)
    return [f"{len(slower)} site(s) rewritten though the cost model predicts them slower on {hardware} "
            f"(--policy all; the slowest, {worst_speedup:.2f}x, at {worst}): see explain"]


def _slower_sites(report) -> list[tuple[float, str, str]]:
    """(predicted speed-up, location, hardware) of each rewritten site predicted slower."""
    lines = []
    for site in report.rewritten:
        if site.all_reduce:
            prediction = site.all_reduce.get("prediction", {})
            speedup = prediction.get("speedup", {}).get(site.all_reduce.get("strategy"))
            hardware = prediction.get("hardware")
        elif site.cost:
            speedup, hardware = site.cost["speedup"][site.cost["variant"]], site.cost["hardware"]
        else:
            continue
        if speedup is not None and speedup < 1:
            lines.append((speedup, site.location, hardware))
    return lines


def cmd_rewrite(args) -> int:
    if args.emit_bytecode and args.emit == "hlo":
        raise CmatmulError("--emit-bytecode writes StableHLO; it cannot be combined with --emit hlo")
    _, _, result = _rewrite(args)
    if args.emit == "hlo":
        out = result.hlo_text
    else:
        out = result.bytecode if args.emit_bytecode else result.text
    if args.report_json:
        write_output(args.report_json, result.report.to_json())
    write_output(args.output, out)
    return 0


def cmd_check(args) -> int:
    """Exit 0: every output agrees (floats as accurate as the original's, docs/numerics.md);
    1: a mismatch; 2: bad input (raised to main); 3: could not check (an input or output the
    check cannot handle, outputs the original leaves inf/NaN, an internal error), one line."""
    from . import ir_utils
    from .execute import CannotCheck, Reference, load_inputs

    if args.print_input_spec:
        return _print_input_spec(args)
    if args.rewritten:
        data, source = read_input(args.input)
        rewritten = ir_utils.parse(read_input(args.rewritten)[0], source=args.rewritten)
        report = {"source": source, "rewritten": args.rewritten}
    else:
        data, source, result = _rewrite(args)
        rewritten, report = result.module, result.report.to_dict()
    original = ir_utils.parse(data, source=source)
    inputs = load_inputs(original, args.inputs) if args.inputs else None
    try:
        outcome = Reference.of(original, seed=args.seed, inputs=inputs, source=source).check(rewritten)
    except CannotCheck as exc:
        print(f"{PROG}: could not check: {source}: {exc}", file=sys.stderr)
        return 3
    except CmatmulError:
        raise
    except Exception as exc:  # noqa: BLE001 - a bug of the check: one line, never a traceback
        print(f"{PROG}: could not check: internal error: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}",
              file=sys.stderr)
        return 3
    print(outcome.format())
    if args.report_json:
        report["numerics"] = outcome.to_dict()
        write_output(args.report_json, json.dumps(report, indent=2) + "\n")
    if not outcome.ok:
        return 1
    if not outcome.complete:
        print(f"{PROG}: could not check: {_outside_domain(args, source, original, outcome)}", file=sys.stderr)
        return 3
    return 0


def _outside_domain(args, source: str, original, outcome) -> str:
    """``check``'s line where outputs of the original are outside the program's domain on the
    inputs run: which, why, what was tried, and what to give instead."""
    from . import domain

    unchecked = outcome.unchecked
    bad = ", ".join(str(o.index) for o in unchecked)
    why = unchecked[0].outside + (f" (and {len(unchecked) - 1} more output(s))" if len(unchecked) > 1 else "")
    if args.inputs:
        return (f"output(s) {bad} of the original are outside the program's domain on the inputs of {args.inputs}: "
                f"{why}; give inputs in its domain")
    if outcome.inputs:
        tried = "also with the arguments drawn by the rules above"
    else:
        tried = ("and no simple rule applies (non-negative where an argument flows into sqrt/rsqrt/log, integer "
                 "indices within the bounds of the gather/dynamic_slice they feed)")
    count = len(domain.entry_arguments(original))
    return (f"output(s) {bad} of the original are outside the program's domain on random inputs, {tried}: {why}; "
            f"give inputs in its domain with --inputs FILE.npz ({PROG} check --print-input-spec {source} lists the "
            f"{count} argument(s) it takes)")


def _print_input_spec(args) -> int:
    """``check --print-input-spec``: the entry function's arguments, one a line."""
    from . import domain, ir_utils

    data, source = read_input(args.input)
    module = ir_utils.parse(data, source=source)
    lines = domain.input_spec(module, source)
    if not lines:
        print(f"{source}: the module takes no arguments")
        return 0
    print(f"{source}: {len(lines)} argument(s); --inputs takes an .npz of arrays arg0 ... arg{len(lines) - 1} "
          "(np.savez(path, arg0=..., ...)) of these global shapes and types:")
    for line in lines:
        print(f"  {line}")
    return 0


def cmd_explain(args) -> int:
    from . import cost, explain_sites, reasons, timeline
    from .report import durations

    args.quiet = True
    _, _, result = _rewrite(args)
    report = result.report
    if args.plot and not any(timeline.drawable(site) for site in report.sites):
        raise CmatmulError(f"--plot: no site to draw: {report.sites_line()} (the cost model sizes candidate sites "
                           "only); run explain without --plot to see why")
    hw = cost.hardware(result.options.hardware)
    print(f"{report.source}: {report.num_partitions} partitions, {report.sites_line()}")
    say_notes(result, sys.stdout, prefix="")
    for site in report.sites:
        print(f"\n{site.place}  [{site.kind}] in @{site.function}")
        if site.ring_size:
            print(f"  ring: {site.ring_size} devices, groups {site.replica_groups}")
        if site.shard_shape is not None:
            print(f"  shard: {site.dtype}{site.shard_shape}, {site.bytes_per_step} B per step, {site.bytes_moved} B moved per device")
        if site.slack:  # another collective competed for its dot (analysis.slack)
            ready = "ready at the start of the step" if site.slack["early"] else "computed in this step"
            print(f"  slack: operand {ready}; {site.slack['hiding_flops']:.3g} FLOP of independent compute before "
                  f"its dot; competes for it with {site.slack['competes_with']}")
        if site.all_reduce:
            explain_sites.all_reduce(site)
        if site.all_to_all:
            explain_sites.all_to_all(site)
        if site.attention.get("prediction"):
            explain_sites.attention(site)
        if site.rewritten and (site.all_reduce.get("strategy") == "chunk" or site.all_to_all
                               or site.attention.get("prediction") or site.all_reduce.get("picked") == "summed value"):
            for note in site.notes:
                print(f"  note: {note}")
        elif site.rewritten:
            print(f"  decision: rewritten as a ring ({site.operand} operand, {site.dim_role} dim {site.collective_dim})")
            sched = site.schedule
            picked = ""
            if result.options.variant == "auto":
                picked = (" (auto's fallback: no profile describes this machine)" if "assumed:" in site.cost.get("hardware", "")
                          else " (the cost model's pick)")
            print(
                f"  schedule: {sched['variant']}{picked}, {sched['directions']} direction(s), {sched['rounds']} rounds "
                f"({sched['loop_trips']} loop trips x {sched['rounds_per_trip']} + {sched['peeled_rounds']} peeled), "
                f"{sched['permutes']} permutes per device{', streams annotated' if sched['streams_annotated'] else ''}"
            )
            if site.shared_ring:
                print(f"  shared: repeats an earlier site's pattern; calls the ring function {site.shared_ring}")
            for note in site.notes:
                print(f"  note: {note}")
            for dot in site.consumers:
                through = f", through {' -> '.join(dot['look_through'])}" if dot["look_through"] else ""
                print(f"  dot: {dot['location']} ({dot['operand']} operand, {dot['dim_role']} dim{through})")
            for reader in site.assembled_for:
                print(f"  assembles the gathered value for: {reader}")
            for why in ("two_rings", "passes_declined"):  # (an attention's two rings, a region's passes)
                if site.attention.get(why) and reasons.hint(site.attention[why]):
                    print(f"  to have it rewritten: {reasons.hint(site.attention[why])}")
        else:
            # a site moved first (sunk into a loop, hoisted, merged), then declined: say so
            moved = site.moved_from is not None
            print(f"  decision: {'moved, then not rewritten' if moved else 'left unchanged'}: {site.reason} "
                  f"[{site.reason_code}]")
            for note in site.notes:
                print(f"  note: {note}")
            if reasons.hint(site.reason_code):
                print(f"  to have it rewritten: {reasons.hint(site.reason_code)}")
        if site.cost:
            c = site.cost
            best = max(c["speedup"], key=c["speedup"].get)

            def exposed(variant: str) -> str:  # the profile expects some of its permutes exposed
                hidden = c.get("overlap", {}).get(variant, 1.0)
                return f", {100 * hidden:.0f} % of permutes hidden" if hidden < 1 else ""

            split = c.get("split_efficiency", {}).get(c["variant"], 1.0)
            count = len(c.get("site", {}).get("dots", ())) or 1
            each = f"{count} dots per round" if count > 1 else "dots"
            kept = f" (the ring's {each} keep {split:.2f} of its throughput)" if split < 1 else ""
            unmeasured = [role for role in dict.fromkeys(c.get("site", {}).get("roles", ()))
                          if not hw.has_role_points("split_efficiency", site.kind, role)]
            if kept and unmeasured:  # the profile has the free roles' points only, which stand in
                kept = kept[:-1] + "".join(f"; a {role} dot's split is the free role's: unmeasured" for role in unmeasured) + ")"
            if c.get("throughput_assumed"):  # the profile has no rate for the dots' element type
                dtype = c.get("site", {}).get("dtype", "?")
                kept += f" (no {dtype} throughput in the profile: priced at its default, {c['throughput'] / 1e12:g} TFLOP/s)"
            compute, transfer, serial, chosen = durations(c["compute_s"], c["transfer_s"], c["serial_s"],
                                                          c["overlapped_s"][c["variant"]])
            print(
                f"  predicted on {c['hardware']}: compute {compute}{kept}, transfer {transfer}, "
                f"serial {serial}; {c['variant']} {chosen} "
                f"({c['speedup'][c['variant']]:.2f}x{exposed(c['variant'])}); "
                f"best: {best} ({c['speedup'][best]:.2f}x{exposed(best)})"
            )
    for line in slower_warnings(report):
        print(f"warning: {line}")
    if args.plot:
        path = timeline.plot(report, hw, args.plot)
        write_note = f"timeline: {path}"
        print(write_note)
    if report.compile_line():
        print(report.compile_line())
    if report.program_line():
        print(report.program_line())
    return 0


def _bench_devices(platform: str, count: int) -> list:
    import jax

    from .execute import cpu_devices

    if platform == "auto":
        devices = jax.devices()
        return devices[:count] if len(devices) >= count else cpu_devices(count)
    try:
        devices = jax.devices(platform)
    except RuntimeError as exc:
        raise CmatmulError(f"--platform {platform}: {' '.join(str(exc).split())[:200]}") from None
    if len(devices) < count:
        raise CmatmulError(f"the module has {count} partitions but {platform} has {len(devices)} device(s)")
    return devices[:count]


def variant_list(spec: str) -> tuple[str, ...]:
    """``bench --variants``: comma-separated names, ``all`` standing for the six named variants."""
    names: list[str] = []
    for item in spec.split(","):
        names += VARIANT_NAMES if item.strip() == "all" else [item.strip()]
    return tuple(dict.fromkeys(names))


def cmd_bench(args) -> int:
    """Time the original and each variant's rewrite on the same inputs, in turn (see
    execute.interleaved_medians).  Every variant's outputs are checked against the original's
    before anything is timed: a mismatch exits 1 and nothing is timed."""
    from . import cost, ir_utils
    from .decorator import ring_compiler_options
    from .execute import Program, Reference, interleaved_medians
    from .pipeline import rewrite

    if args.runs < 1 or args.warmup < 0:
        raise CmatmulError("--runs must be at least 1 and --warmup at least 0")
    names = variant_list(args.variants)
    flags = {**VARIANT_FLAGS, "auto": f"--variant auto --hardware {args.hardware}"}
    unknown = [v for v in names if v not in flags]
    if unknown:
        raise CmatmulError(f"unknown variant(s) {', '.join(unknown)}; known: {', '.join(flags)}")
    data, source = read_input(args.input)
    results = {name: rewrite(data, _options(args, name), source=source) for name in names}
    if not any(result.report.rewritten for result in results.values()):
        first = next(iter(results.values()))
        if not args.quiet:  # no shard_map region, or no candidate in it: what rewrite says
            say_notes(first)
        _nothing_to_run(args, f"nothing to time: {_nothing_rewritten(first.report)} in every variant; "
                              "nothing to recommend",
                        {"source": source, "num_partitions": first.report.num_partitions, "fastest": None,
                         "variants": {name: {"flags": flags[name], "rewritten": 0, "sites": len(r.report.sites)}
                                      for name, r in results.items()}})
    original = ir_utils.parse(data, source=source)
    n = ir_utils.int_attr(original.operation, "mhlo.num_partitions") or 1
    devices = _bench_devices(args.platform, n)
    # the numerics are checked in compiles of their own, without excess precision (as `check`
    # does: execute.CHECK_COMPILER_OPTIONS); what is timed is compiled as jax.jit would
    reference = Reference.of(original, seed=args.seed, devices=devices)
    where = f"{n} partition(s) on {len(devices)} {devices[0].platform} device(s)"
    timed_original = Program(original, reference.inputs, devices)
    rows, programs, mismatch = {}, {"original": timed_original}, None
    original_compile_s = timed_original.compile_s
    for name, result in results.items():  # check every variant before timing any
        # on a GPU, the XLA options the rings need to overlap (as cmatmul_pass.jit passes them)
        xla_options = ring_compiler_options(result.report, devices[0].platform, {},
                                            os.environ.get("XLA_FLAGS", ""))
        numerics = reference.check(result.module)
        program = Program(result.module, reference.inputs, devices, xla_options)
        rows[name] = {"flags": flags[name], "rewritten": len(result.report.rewritten),
                      "sites": len(result.report.sites), "compiler_options": xla_options,
                      # one compile each, like the original's (the ratio: what picking it costs in
                      # jax.jit's first call; XLA CPU's grows with a module's straight-line rounds)
                      "compile_s": program.compile_s,
                      "compile_over_original": program.compile_s / original_compile_s,
                      "numerics": numerics.to_dict(),
                      # what the cost model says the rewritten sites save on --hardware, to hold
                      # against the measured saving (on the hardware the profile describes)
                      "predicted_saving_s": sum(s.cost["serial_s"] - s.cost["overlapped_s"][s.cost["variant"]]
                                                for s in result.report.rewritten if s.cost)}
        if name == "auto":  # what the model picked, per site
            rows[name]["picked"] = [s.cost["variant"] for s in result.report.rewritten if s.cost]
        if not numerics.ok:
            mismatch = name, numerics
            break
        programs[name] = program
    seconds = interleaved_medians(programs, args.runs, args.warmup) if mismatch is None else {}
    base = seconds.get("original")
    print(f"{source}: {where}; median of {args.runs} run(s) after {args.warmup} warm-up(s), "
          "all programs timed in turn")
    for name, row in rows.items():
        if row["compiler_options"]:
            print(f"  {name}: compiled with " + ", ".join(f"{k}={v}" for k, v in row["compiler_options"].items()))
    hardware = cost.hardware(args.hardware).name
    if "picked" in rows.get("auto", {}):
        picked = rows["auto"]["picked"]
        print(f"  auto: the cost model picked, for {hardware}: "
              + ", ".join(f"{name} ({picked.count(name)} site(s))" for name in dict.fromkeys(picked)))
    print(f"  {'variant':<13} {'sites':>7} {'time (ms)':>11} {'/ original':>11} {'saved (ms)':>11} "
          f"{'compile (s)':>12} {'/ original':>11}   predicted saving on {hardware} (ms)")
    if base is not None:
        print(f"  {'original':<13} {'-':>7} {1e3 * base:>11.3f} {1.0:>11.2f} {'':>11} "
              f"{original_compile_s:>12.3f} {1.0:>11.2f}")
    for name, row in rows.items():
        sites = f"{row['rewritten']}/{row['sites']}"
        if mismatch is not None and mismatch[0] == name:
            print(f"  {name:<13} {sites:>7}  numerics MISMATCH: not timed (nor is anything else)")
            print(mismatch[1].format())
            continue
        if name in seconds:
            row["seconds"] = seconds[name]
            row["over_original"] = row["seconds"] / base
            row["saved_s"] = base - row["seconds"]
            print(f"  {name:<13} {sites:>7} {1e3 * row['seconds']:>11.3f} {row['over_original']:>11.2f} "
                  f"{1e3 * row['saved_s']:>11.3f} {row['compile_s']:>12.3f} {row['compile_over_original']:>11.2f}   "
                  f"{1e3 * row['predicted_saving_s']:.3f}")
    timed = {name: row for name, row in rows.items() if "seconds" in row}
    fastest = min(timed, key=lambda name: timed[name]["seconds"]) if len(timed) == len(names) else None
    if fastest is not None:
        ratio = timed[fastest]["over_original"]
        if ratio < 1:
            how = f" {flags[fastest]}" if flags[fastest] else ""
            print(f"fastest: {fastest}, {ratio:.2f}x the original's time: {PROG} rewrite {args.input}{how}")
        else:
            print(f"fastest variant: {fastest}, {ratio:.2f}x the original's time; the original is faster on these devices")
    if args.report_json:
        report = {"source": source, "devices": where, "runs": args.runs, "warmup": args.warmup,
                  "original_s": base, "original_compile_s": original_compile_s, "variants": rows,
                  "fastest": fastest, "timing": "interleaved",
                  "original_is_fastest": fastest is not None and timed[fastest]["over_original"] >= 1}
        write_output(args.report_json, json.dumps(report, indent=2) + "\n")
    return 0 if fastest is not None else 1


COMMANDS = {"rewrite": cmd_rewrite, "check": cmd_check, "explain": cmd_explain, "bench": cmd_bench}


def _xla_errors() -> tuple[type[BaseException], ...]:
    """XLA's compile and run errors, as jax raises them (none before jax is imported)."""
    errors = sys.modules.get("jax.errors")
    return tuple(e for e in (getattr(errors, "JaxRuntimeError", None),) if e is not None)


def main(argv: list[str] | None = None) -> int:
    ensure_cpu_devices()
    args = build_parser().parse_args(argv)
    where = "<stdin>" if args.input == "-" else args.input
    try:
        return COMMANDS[args.command](args)
    except NothingToRun as exc:
        print(f"{PROG}: {exc}")
        return 0
    except InternalError as exc:
        print(f"{PROG}: internal error: {exc}", file=sys.stderr)
        return 3
    except CmatmulError as exc:  # InputError names its file and line:col itself
        prefix = "" if isinstance(exc, InputError) else f"{where}: "
        print(f"{PROG}: error: {prefix}{exc}", file=sys.stderr)
        return 2
    except _xla_errors() as exc:  # XLA refused to compile or run a module (the original, for check): exit 2
        message = " ".join(str(exc).split())[:300]
        print(f"{PROG}: error: {where}: XLA could not compile or run the module: {message}", file=sys.stderr)
        return 2
