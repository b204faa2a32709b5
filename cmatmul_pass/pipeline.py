"""The pass pipeline: parse, match and rewrite each site, verify, report."""

from __future__ import annotations

import gc
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from . import compile_budget, cost, ir_utils, program_cost, replay, step_guard
from ._jax_private import hlo, ir, make_context, module_to_bytecode, module_to_hlo_text
from .analysis.deadlock import misplaced
from .attempts import MAX_TRIES, MOTION, SITE, Attempts, Bans
from .compile_budget import DEFAULT_BUDGET
from .errors import CmatmulError, InternalError
from .matchers import ModuleInfo
from .report import Report, SiteReport, forget_types
from .rewrites.builders import shared_per_block
from .rewrites.schedule import Annotator, RewriteContext
from .rewrites.sink import inline_scan_bodies
from .column_rings import inline_statistic_calls
from .sharing import RingLibrary
from .phases import SiteWalk
from .sites import forget_dots


@dataclass(frozen=True)
class Options:
    """What the pass does.

    ``debug_info``: print locations in :attr:`RewriteResult.text` (off, like ``Lowered.as_text()``).
    ``assemble``: when an all_gather's value is also read by ops the ring does not
    compute (a non-dot op, a dot needing later values), let the loop assemble the
    gathered value for them; with ``False`` such sites are declined (``multiple_users``).
    ``bidirectional``: use both ring directions (gathers: shards travel both ways,
    half the permute rounds; scatters: each block's halves travel opposite ways).
    ``unroll``: rounds per loop trip, 1 or 2 (remainder peeled), or ``"full"``: no
    loop, the whole ring straight-line.
    ``variant``: a ring variant by name (``cost.VARIANTS``: uni, unroll2, full, bidi,
    bidi-unroll2, bidi-full), which sets ``bidirectional`` and ``unroll`` (naming others
    is an error); or ``"auto"`` (the default when neither ``bidirectional`` nor ``unroll`` is
    given): per site, the variant the cost model predicts fastest on ``hardware`` (sites of one
    shape get the same one), or, where no profile describes the machine (``hardware="auto"`` on
    a CPU, say), ``cost.fallback_variant``: ``full`` on a ring of up to 8 devices (``uni``
    for a scatter of 8 MiB of partial sums or more), ``unroll2`` on longer ones.  ``bidirectional`` / ``unroll`` alone name a variant as well (the other taking one
    direction, one round per trip): ``Options(unroll=1)`` is ``uni``.
    ``annotate_streams``: outline each round's dots onto compute streams
    (``_xla_stream_annotation``) and group each permute with the dots it overlaps
    (``_scheduling_group_id``); XLA GPU honours them, CPU ignores them.
    ``share_rings``: a site repeating an earlier site's pattern calls one shared ring
    function instead of getting its own ring (:mod:`cmatmul_pass.sharing`); off while
    annotating streams.
    ``merge_dots``: a gather's dots that differ only in their other operand, along its one
    free dim (q/k/v, gate and up), become one dot per round on those operands concatenated
    once before the ring (XLA's dot merger would concatenate them in every round).
    ``tie_rounds``: where several rounds or directions compute in one block (unrolled,
    straight-line and bidirectional rings), pass each round's dot operands through an
    ``optimization_barrier`` (all but the first outside a loop: :class:`.rewrites.schedule.DotBarriers`),
    so that XLA does not merge dots of different rounds (which share an operand) into one
    that waits for every round's transfer; and send a gather
    round's shard through a barrier with the previous round's dot, so that its transfer
    starts after that dot (the scheduler otherwise may start it during that dot).
    ``policy``: ``"auto"`` (the default, unless ``$CMATMUL_PASS_POLICY`` names another) rewrites
    only the sites whose predicted speed-up on ``hardware`` (a :mod:`cmatmul_pass.cost` profile,
    e.g. ``"h100"`` or ``"h100:bandwidth=400e9"``, or ``"auto"``: jax's default device's) exceeds
    ``1 + margin``, so the default never makes a program slower by the cost model; ``"all"``
    rewrites every legal site.  ``min_bytes``:
    leave sites moving fewer bytes per device than this (XLA's windowed-einsum
    threshold, in bytes).  Every site's prediction goes into the report either way.
    ``all_reduce``: what becomes of a ``dot → all_reduce(sum)`` (a psum after a matmul):
    ``"split"`` (a reduce-scatter ring, then the gather carried forward to the next matmul's
    ring or to where the whole value is read: :mod:`.rewrites.sequence_parallel`),
    ``"chunk"`` (the rows in ``chunks`` pieces, each piece's all_reduce overlapping the next
    piece's dot), ``"auto"`` (per site, the one the cost model predicts faster on
    ``hardware``; on a tie within ``cost.TIE`` chunk, or split where the value goes on to a
    matmul, whose ring hides split's gather; where no profile describes the machine,
    ``cost.fallback_all_reduce``: two chunks), ``"keep"`` (left as they are).  None (the default): ``"auto"``; under
    ``policy="auto"`` it also leaves a site where neither beats the all_reduce.
    ``chunks``: the chunk count (2 to 8); None: the cost model's pick of 2, 4 or 8.
    ``compile_budget``: under ``policy="auto"``, the rewritten program's size, in the ops XLA
    compiles (:func:`.compile_budget.program_weight`), at most this many times the original's:
    past it a site takes the fastest variant that fits and still pays (a loop form rather than
    a straight-line ring), or stays as written (``compile_budget``); sites are taken in program
    order.  None: no budget.  ``policy="all"`` has none.
    """

    debug_info: bool = False
    assemble: bool = True
    bidirectional: bool | None = None
    unroll: int | str | None = None
    variant: str | None = None
    annotate_streams: bool = False
    share_rings: bool = True
    merge_dots: bool = True
    tie_rounds: bool = True
    policy: str = field(default_factory=lambda: default_policy())
    hardware: str = "h100"
    min_bytes: int = 0
    margin: float = 0.02
    all_reduce: str | None = None
    chunks: int | None = None
    compile_budget: float | None = DEFAULT_BUDGET

    def __post_init__(self) -> None:
        if self.compile_budget is not None and not self.compile_budget >= 1:
            raise ValueError(f"compile_budget must be at least 1 (or None), not {self.compile_budget!r}")
        if self.all_reduce not in (None, "split", "chunk", "auto", "keep"):
            raise ValueError(f"all_reduce must be 'split', 'chunk', 'auto' or 'keep', not {self.all_reduce!r}")
        if self.chunks is not None and not 2 <= self.chunks <= 8:
            raise ValueError(f"chunks must be from 2 to 8, not {self.chunks!r}")
        if self.unroll not in (None, 1, 2, "full"):
            raise ValueError(f"unroll must be 1, 2 or 'full', not {self.unroll!r}")
        if self.variant is None:  # bidirectional / unroll name one; neither: the default, auto
            given = self.bidirectional is not None or self.unroll is not None
            unroll = None if self.unroll == "full" else (self.unroll or 1)
            object.__setattr__(self, "variant", cost.variant_name(bool(self.bidirectional), unroll) if given else "auto")
        if self.variant != "auto" and self.variant not in cost.VARIANTS:
            raise ValueError(f"variant must be one of {', '.join(cost.VARIANTS)} or 'auto', not {self.variant!r}")
        bidirectional, unroll = cost.VARIANTS.get(self.variant, (False, 1))  # auto: one way's, to predict from
        named = bidirectional, "full" if unroll is None else unroll
        if (self.bidirectional not in (None, named[0]) or self.unroll not in (None, named[1])) and not (
                self.variant == "auto" and (self.bidirectional, self.unroll) == (False, 1)):  # auto's own, as replace() passes it
            raise ValueError(f"variant={self.variant!r} decides bidirectional and unroll; "
                             f"it contradicts bidirectional={self.bidirectional}, unroll={self.unroll!r}")
        object.__setattr__(self, "bidirectional", named[0])
        object.__setattr__(self, "unroll", named[1])
        if self.unroll not in (1, 2, "full"):
            raise ValueError(f"unroll must be 1, 2 or 'full', not {self.unroll!r}")
        if self.policy not in ("all", "auto"):
            raise ValueError(f"policy must be 'all' or 'auto', not {self.policy!r}")

    def with_variant(self, name: str) -> "Options":
        """These options with ring variant ``name`` (``bidirectional`` and ``unroll`` follow it)."""
        return replace(self, variant=name, bidirectional=None, unroll=None)

    @property
    def all_reduce_strategy(self) -> str:
        """What becomes of dot → all_reduce sites: split, chunk, auto (the default) or keep."""
        return self.all_reduce or "auto"

    @property
    def rounds_per_trip(self) -> int | None:
        """Rounds per loop trip; None: no loop (the whole ring straight-line)."""
        return None if self.unroll == "full" else int(self.unroll)


#: the environment variable that sets the default policy (unset: ``"auto"``)
POLICY_ENV = "CMATMUL_PASS_POLICY"


def default_policy() -> str:
    """The policy a run gets when it names none: ``$CMATMUL_PASS_POLICY``, else ``"auto"`` (a
    site the cost model predicts slower on the target hardware is left as written)."""
    return os.environ.get(POLICY_ENV) or "auto"


def variant_options(name: str, **extra) -> Options:
    """The Options of a named ring variant (``cost.VARIANTS``: uni, unroll2, full, bidi,
    bidi-unroll2, bidi-full, or ``"auto"``), plus any other option."""
    return Options(variant=name, **extra)


@dataclass
class RewriteResult:
    module: ir.Module
    report: Report
    options: Options = field(default_factory=Options)

    @property
    def text(self) -> str:
        return ir_utils.print_module(self.module, debug_info=self.options.debug_info)

    @property
    def bytecode(self) -> bytes:
        return module_to_bytecode(self.module)

    @property
    def hlo_text(self) -> str:
        """The rewritten module as (pre-optimisation) HLO text: loops, permutes and frontend
        attributes as XLA sees them."""
        return module_to_hlo_text(ir_utils.print_module(self.module))

    @property
    def changed(self) -> bool:
        """Does the module differ from the input?  Exactly when a site was rewritten: a motion
        whose sites all declined is not made, and a module with no site rewritten is the input."""
        return bool(self.report.rewritten)


class ChannelAllocator:
    """Fresh channel handles, above every handle already in the module (``found``: its
    ir_utils.CHANNEL_OPS by name, when the caller has walked it already)."""

    def __init__(self, module: ir.Module, found: dict[str, list[ir.OpView]] | None = None):
        found = found if found is not None else ir_utils.ops_named(module, *ir_utils.CHANNEL_OPS)
        handles = [
            hlo.ChannelHandle(op.operation.attributes["channel_handle"]).handle
            for name in ir_utils.CHANNEL_OPS
            for op in found[name]
            if "channel_handle" in op.operation.attributes
        ]
        self._next = self.first = max(handles, default=0) + 1

    def take(self) -> int:
        handle = self._next
        self._next += 1
        return handle


def rewrite(
    module: str | bytes | ir.Module,
    options: Options | None = None,
    *,
    source: str = "<input>",
    context: ir.Context | None = None,
) -> RewriteResult:
    """Apply the collective-matmul pass.

    ``module`` is StableHLO text, MLIR bytecode / a portable artifact, or a parsed
    ``ir.Module`` (rewritten in place, as MLIR passes do).  Raises
    :class:`~cmatmul_pass.errors.InputError` for unreadable input.
    """
    options = options or Options()
    if isinstance(module, ir.Module):
        snapshot = ir_utils.clone_module(module)  # to give the caller's module back as it was on a bug
        given = module

        def restore() -> None:
            _restore(given, snapshot)

        def again() -> ir.Module:
            restore()
            return given

        return _rewrite(module, options, source, again, restore, lambda: ir_utils.clone_module(snapshot))
    text = module

    def parsed() -> ir.Module:
        return ir_utils.parse(text, source=source, context=context or make_context())

    return _rewrite(parsed(), options, source, parsed, None, parsed)


def rewrite_copy(module: ir.Module, options: Options, source: str) -> RewriteResult:
    """:func:`rewrite` on a copy of ``module``, which stays as it is (``cmatmul_pass.jit`` on
    jax's module): no snapshot is kept, since a failure is retried on a fresh copy."""
    def copy() -> ir.Module:
        return ir_utils.clone_module(module)

    return _rewrite(copy(), options, source, copy, None, copy)


def _rewrite(module: ir.Module, options: Options, source: str, again: Callable[[], ir.Module],
             restore: Callable[[], None] | None, pristine: Callable[[], ir.Module]) -> RewriteResult:
    """The pass on ``module``; on a failure, the pass again on ``again()`` (the input as it
    was), verifying after every site to name the one that broke the module, then
    ``restore()`` (when given: put the caller's module back as it was).  ``pristine()``: a
    fresh module of the input as it was, touching nothing else (the step's prediction, made
    when the report's ``program`` is first read, schedules it)."""
    reading = ir_utils.READING.set(source)  # messages built deep in the matchers name this file
    rendered = ir_utils.RENDERED.set({})  # (and render the same locations again and again)
    bans = Bans()
    declined: dict[str, str] = {}  # places the whole step's prediction declines (step_guard)
    guard = _StepGuard(options, lambda: _program(pristine(), options, source, graph=True))
    try:
        program = _program(module, options, source)  # the input's regions and collectives, for layer names
        for _ in range(MAX_TRIES + 2 * (step_guard.ROUNDS + 2)):  # a guard round may undo motions: a try more
            try:
                with _no_cyclic_gc(), step_guard.declining(declined):
                    result, undone = _run(module, options, source, verify_each=False, bans=bans)
            except Exception as exc:  # noqa: BLE001 - a bug of the pass, never a traceback for the user
                if isinstance(exc, CmatmulError) and not isinstance(exc, InternalError):
                    raise  # the user's input or options (a bad --hardware): said as such
                # The fast path verifies once, at the end.  On a failure, run again from the input,
                # verifying after every site, to name the collective that broke the module; the
                # next try leaves it as written (cmatmul_pass.attempts).
                failure = _internal(exc)
                try:
                    with step_guard.declining(declined):
                        _run(again(), options, source, verify_each=True, bans=bans)
                except Exception as pinpointed:  # noqa: BLE001
                    failure = _internal(pinpointed)
                key = getattr(failure, "key", None)
                if key is None or key in bans.by_key:
                    if restore is not None:
                        restore()
                    raise failure from failure.__cause__
                bans.add(key, SITE, str(failure))
                module = again()
                continue
            if not undone:
                losers = guard.losers(result.report)
                if losers:  # the step predicted slower: again, with the places that slow it as written
                    declined = {**declined, **losers}
                    module = again()
                    continue
                if not result.report.rewritten:  # nothing rewritten: the output is the input, as it was
                    result.module = again()      # (no scan body inlined, nothing moved)
                _predict(program, result.report, guard.scheduled)
                _compile_figure(result, pristine, options)
                return result
            for key, why in undone.items():  # moved, then no ring where it went: not moved next time
                bans.add(key, MOTION, why)
            module = again()
        if restore is not None:
            restore()
        raise InternalError(f"the pass left {len(bans.by_key)} collectives as written and still failed "
                            "(a cmatmul_pass bug)")
    finally:
        ir_utils.READING.reset(reading)
        ir_utils.RENDERED.reset(rendered)
        forget_types()
        forget_dots()


def _run(module: ir.Module, options: Options, source: str, *, verify_each: bool,
         bans: Bans) -> tuple[RewriteResult, dict]:
    """One try of the pass on ``module``: its result, and the motions to leave undone next time
    (:meth:`Attempts.undone`)."""
    # Unknown is only the default for type construction; every op gets an explicit loc.
    with module.context, ir.Location.unknown(), shared_per_block() as constants:
        names = ("func.call", *ir_utils.CHANNEL_OPS, replay.MANUAL, "stablehlo.while")
        # identical layers: all but two are left for replay (cmatmul_pass.replay), and not walked;
        # it needs ring sharing (the layers become calls of one function, as the rings do) and one
        # verification
        replayable = options.share_rings and not options.annotate_streams and not verify_each
        # (a layer trimmed from a twin, replay.Trim, only where psums are not all split: a split carries
        # its gather past the ops after it, which such a layer has fewer of)
        found, layers = replay.walk(module, names, replayable, options.all_reduce_strategy != "split")
        # jax 0.10's scan bodies in functions holding collectives: inline, as later jax lowers them
        if found["stablehlo.while"] and inline_scan_bodies(found):
            found = ir_utils.ops_named(module, *names)
        # jax.nn.log_softmax's function between a gather and its statistics: inline, as XLA does
        if found["stablehlo.reduce_scatter"] and inline_statistic_calls(found):
            found = ir_utils.ops_named(module, *names)
        info = ModuleInfo.of(module, found["func.call"])
        channels = ChannelAllocator(module, found)
        ctx = RewriteContext(
            channels.take,
            Annotator(module, enabled=options.annotate_streams),
            merge_dots=options.merge_dots,
            tie_rounds=options.tie_rounds,
            constants=constants,
        )
        placement = (info, channels.first)  # the collectives the pass makes must run alike on their groups
        verify = (lambda entry: _verify(module, entry, placement)) if verify_each else None
        rings = RingLibrary(module, bool(info.meshes)) if options.share_rings and not options.annotate_streams else None
        if rings is not None and layers is not None:  # a group's twin keeps its rings inline (it becomes the
            rings.inline = layers.inline_rings         # layer function, the one copy), and its probe likewise
        attempts = Attempts(source, bans)
        walk = SiteWalk(module, options, source, info, ctx, verify, attempts, layers, rings)
        walk.rewrite_sites(found)  # (the regions left for replay are not in it)
        report = walk.report
        if layers is not None:
            leftover = layers.finish(report, walk.regions_of, walk.competing, source, walk.lacking, channels.take,
                                     walk.phase_of)
            if leftover:  # regions whose locations do not map, or a group whose probe differed: the usual way
                walk.rewrite_sites(layers.only(leftover, names))
        if report.rewritten:
            ctx.annotator.finish()
            _verify(module, None, placement)
    return RewriteResult(module, report, options), attempts.undone()


def _compile_figure(result: RewriteResult, pristine: Callable[[], ir.Module], options: Options) -> None:
    """The report's ``compile`` (made when first read): the program's size before and after."""
    if not result.report.sites:
        return
    module = result.module

    def figure() -> dict:
        try:
            original, rewritten = compile_budget.program_weight(pristine()), compile_budget.program_weight(module)
        except Exception as exc:  # noqa: BLE001 - a report's extra: never the pass's failure
            return {"unavailable": f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"}
        budget = options.compile_budget if options.policy == "auto" else None
        return {"original_ops": original, "rewritten_ops": rewritten,
                "predicted_ratio": round(compile_budget.compile_ratio(original, rewritten), 3), "budget": budget}

    result.report.compile = figure


class _StepGuard:
    """The whole step's answer under policy auto (:mod:`.step_guard`): the input's schedule,
    made once when first needed, and the places each try's rings slow it at."""

    def __init__(self, options: Options, schedule: Callable[[], "program_cost.Program | str"]):
        self.active = options.policy == "auto"
        self._schedule = schedule
        self._program: "program_cost.Program | str | None" = None
        self.rounds = 0

    def scheduled(self) -> "program_cost.Program | str":
        if self._program is None:
            self._program = self._schedule()
        return self._program

    def losers(self, report: Report) -> dict[str, str]:
        """The places to decline next try (none: this try's answer stands)."""
        if not self.active or not report.rewritten or isinstance(self.scheduled(), str):
            return {}
        self.rounds += 1
        try:
            return step_guard.losing_places(self.scheduled(), report, self.rounds)
        except Exception as exc:  # noqa: BLE001 - the sites' own predictions stand where the step's cannot be made
            self._program = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
            return {}


def _program(module: ir.Module, options: Options, source: str, graph: bool = False) -> "program_cost.Program | str":
    """The input read for the sites' layers (``graph``: and for the step's prediction,
    :mod:`.program_cost`), or why it could not be."""
    try:
        with module.context:
            return program_cost.Program(module, source, cost.hardware(options.hardware), graph=graph)
    except Exception as exc:  # noqa: BLE001 - the prediction is a report's extra: never the pass's failure
        return f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"


def _predict(program: "program_cost.Program | str", report: Report,
             scheduled: Callable[[], "program_cost.Program | str"]) -> None:
    """The report's step prediction (``report.program``, made when first read, on the input
    ``scheduled()`` reads with its dataflow graph) and its sites' layers (``program``: the
    input's regions and collectives); none for a module without a candidate site."""
    if not report.sites:
        return
    if isinstance(program, str):
        report.program = {"unavailable": program}
        return
    try:
        program_cost.annotate(program, report)
    except Exception as exc:  # noqa: BLE001
        report.program = {"unavailable": f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"}
        return

    def prediction() -> dict:  # when the report's program is first read (it schedules the step several times)
        try:
            full = scheduled()
            if isinstance(full, str):
                return {"unavailable": full}
            return program_cost.predict(full, report).to_dict()
        except Exception as exc:  # noqa: BLE001
            return {"unavailable": f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"}

    report.program = prediction


def _internal(exc: Exception) -> InternalError:
    """``exc`` as the InternalError it is (a bug of the pass, whatever its type)."""
    if isinstance(exc, InternalError):
        return exc
    failure = InternalError(f"the pass failed (a cmatmul_pass bug): {type(exc).__name__}: {' '.join(str(exc).split())}")
    failure.__cause__ = exc
    return failure


def _verify(module: ir.Module, entry: SiteReport | None, placement: tuple | None = None) -> None:
    """MLIR's verifier, and (``placement``: the module's info and the first channel handle the
    pass took) the deadlock rule: every collective the pass made runs alike on its group
    (:mod:`.analysis.deadlock`)."""
    what = f"rewriting the {entry.kind} site at {entry.location}" if entry else "the rewrite"
    try:
        module.operation.verify()
    except ir.MLIRError as exc:
        raise InternalError(
            f"{what} produced IR that does not verify (a cmatmul_pass bug): {' '.join(str(exc).split())}"
        ) from exc
    bad = misplaced(module, *placement) if placement else []
    if bad:
        op, why = bad[0]
        raise InternalError(f"{what} put a {op.name} where its group may not run it alike ({why}): it could "
                            "deadlock (a cmatmul_pass bug)")


def _restore(module: ir.Module, snapshot: ir.Module) -> None:
    """Put ``module``'s body back as it was (a copy of ``snapshot``'s, which stays as it is), in place."""
    original = ir_utils.clone_module(snapshot)
    body = module.body
    for op in reversed(list(body.operations)):
        op.operation.erase()
    end = ir.InsertionPoint(body)
    for op in list(original.body.operations):
        op.operation.detach_from_parent()
        end.insert(op.operation)


class _no_cyclic_gc:
    """Pause Python's cyclic garbage collector while the pass builds IR.

    The bindings allocate many short-lived Python objects per op; the collector's
    generation-0 sweeps then cost more than the rewriting (measured: a quarter of the
    pass at 255 sites).  Nothing the pass creates forms reference cycles that must be
    reclaimed before it returns; the previous state is restored afterwards.
    """

    def __enter__(self) -> None:
        self.was_enabled = gc.isenabled()
        gc.disable()

    def __exit__(self, *exc) -> None:
        if self.was_enabled:
            gc.enable()
