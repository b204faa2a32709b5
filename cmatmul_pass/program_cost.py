"""The whole program's predicted step time, before and after the rewrite.

:meth:`Program.of` reads the module as the pass received it into a schedule graph, in the
order its ops run (a call's callee and a shard_map region's body in place): each dot is a task
on the compute stream (its FLOPs at the profile's rate for its element type), each collective
a task on the collective stream (its bytes at the link bandwidth, plus one round's
synchronisation, as :mod:`cmatmul_pass.cost` prices a site's original collective), every other
op free; a task starts when the values it reads are ready and its stream is free.  A
``stablehlo.while`` is one task holding both streams for its body's schedule times its trip
count (read from the loop's ``i < N`` condition; once where it cannot be read), a
``case``/``if`` for its longest branch's.

:func:`predict` schedules the graph twice.  Before: every site as written.  After: each
rewritten site's collective becomes its ring, holding both streams for the site's predicted
time (its chosen variant's, or its psum strategy's) less its dots' compute, which stays on the
compute stream: a site alone takes its predicted time, and what else could have run beside the
original collective (a gather XLA prefetches behind earlier compute) is counted as the
schedule finds it, not assumed.  The step time is the last task's end.  Each place in the
source whose rewritten sites carry the difference is found by scheduling the program again with
that place's sites left as written.

The report's sites are matched to the module's collectives by their rendered location and
kind, in program order; :func:`annotate` also names the layer of sites a model repeats
(``layer 2 of 4``: the k-th shard_map region at one place, the backward's counted from the
end; or every trip of the loop holding the site).  Not modelled: the time of ops other than
dots and collectives (elementwise, memory-bound work), XLA's fusion and reordering of dots.
"""

from __future__ import annotations

import heapq
import os
from dataclasses import asdict, dataclass, field

from . import ir_utils
from ._jax_private import hlo, ir
from .profiles import Hardware
from .report import Report, SiteReport, tensor_bytes

FREE, DOT, COLLECTIVE, BLOCK = range(4)
#: an instance's "ring" time meaning its collective is gone (merged into another site's ring)
GONE = -1.0
#: the anchor op of each site kind (SiteReport.kind)
ANCHORS = {"all_gather_dot": "stablehlo.all_gather", "dot_reduce_scatter": "stablehlo.reduce_scatter",
           "dot_all_reduce": "stablehlo.all_reduce", "all_to_all_chunk": "stablehlo.all_to_all",
           "ring_attention": "stablehlo.all_gather", "column_passes": "stablehlo.all_gather"}
#: ops whose body the schedule walks in place of the op (their block arguments are its operands)
INLINE = frozenset({"sdy.manual_computation", "sdy.named_computation"})
TERMINATORS = frozenset({"func.return", "stablehlo.return", "sdy.return"})
#: a value depending on more tasks than this waits on one free task joining them (keeps each
#: value's dependencies short)
JOIN_AT = 8
#: places whose share of the difference is measured (those with the largest predicted change)
PLACES_MEASURED = 12
#: places named in the program-level line
PLACES_SHOWN = 3


@dataclass(slots=True)
class _Graph:
    """Tasks in the order they are issued: kind, the tasks each waits for, seconds, the site
    instance it is (-1: none), and for a BLOCK its bodies and trip count."""

    kinds: list[int] = field(default_factory=list)
    deps: list[tuple[int, ...]] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    instance: list[int] = field(default_factory=list)
    blocks: dict[int, tuple[list["_Graph"], int]] = field(default_factory=dict)
    _links: tuple | None = None

    def successors(self) -> tuple[list[list[int]], list[int]]:
        """Each task's dependants, and how many tasks each waits for (made once)."""
        if self._links is None:
            successors: list[list[int]] = [[] for _ in self.kinds]
            for i, deps in enumerate(self.deps):
                for d in deps:
                    successors[d].append(i)
            self._links = successors, [len(deps) for deps in self.deps]
        return self._links

    def add(self, kind: int, deps: tuple[int, ...], seconds: float = 0.0, instance: int = -1) -> int:
        self.kinds.append(kind)
        self.deps.append(deps)
        self.seconds.append(seconds)
        self.instance.append(instance)
        return len(self.kinds) - 1


@dataclass
class _Instance:
    """One run of a candidate collective: its key (rendered location, op name), the op it is
    (an op in a function called twice runs twice), its shard_map region and enclosing loop."""

    key: tuple[str, str]
    op: int
    region: tuple[int, str, bool] | None  # (ordinal, rendered location, in a backward)
    loop: str | None
    trips: int | None
    runs: int  # per step: the trips of every loop it is in


class Program:
    """The module as :func:`predict` schedules it (see the module's docstring)."""

    def __init__(self, module: ir.Module, source: str, hw: Hardware, graph: bool = True):
        """``graph=False``: the regions, loops and collectives only (what :func:`annotate` reads),
        without the dataflow graph :meth:`span` schedules (most of the walk's time)."""
        self.hw = hw
        self._graph = graph
        self.source = source
        self.partitions = ir_utils.int_attr(module.operation, "mhlo.num_partitions") or 1
        self.funcs = {ir_utils.symbol_name(op): op for op in module.body.operations
                      if op.operation.name == "func.func"}
        self.instances: list[_Instance] = []
        self.unknown_trips = 0
        #: each dot in a loop (rendered location) -> how many times it runs per step
        self.dot_trips: dict[str, int] = {}
        self._ops: dict = {}
        self._info = None
        self._module = module
        self._calls: list[str] = []
        self._region: tuple[int, str, bool] | None = None
        #: every top-level shard_map region, in order: (ordinal, rendered location, in a backward)
        self.regions: list[tuple[int, str, bool]] = []
        self._loops: list[tuple[str, int | None]] = []
        self.graph = _Graph()
        main = self.funcs.get("main") or next(iter(self.funcs.values()), None)
        if main is not None:
            self._block(self.graph, main.regions[0].blocks[0], [()] * len(main.regions[0].blocks[0].arguments), {})
        # (ops and values are keyed by address: nothing of the module is kept past the walk)
        self._ops, self.funcs, self._module, self._info = {}, {}, None, None

    # ------------------------------------------------------------------ building
    def _block(self, graph: _Graph, block: ir.Block, args: list[tuple[int, ...]], env: dict) -> list[tuple[int, ...]]:
        """Add ``block``'s ops to ``graph`` (its arguments ready after ``args``); the deps of
        what its terminator returns."""
        for arg, deps in zip(block.arguments, args):
            env[arg] = deps
        returned: list[tuple[int, ...]] = []
        for op in block.operations:
            name = op.operation.name
            if name in TERMINATORS:
                returned = [env.get(v, ()) for v in op.operation.operands]
                continue
            if not self._graph and name not in _STRUCTURE:
                continue
            results = self._op(graph, op.operation, name, env)
            if self._graph:
                for value, deps in zip(op.operation.results, results):
                    env[value] = deps
        return returned

    def _op(self, graph: _Graph, op: ir.Operation, name: str, env: dict) -> list[tuple[int, ...]]:
        """Add ``op``; the deps of each of its results."""
        operands = [env.get(v, ()) for v in op.operands] if self._graph else []
        n = len(op.results)
        if name == "func.call":
            callee = self.funcs.get(ir.FlatSymbolRefAttr(op.attributes["callee"]).value)
            if callee is not None and callee.operation.name == "func.func" and callee.regions[0].blocks \
                    and len(self._calls) < 64 and ir_utils.symbol_name(callee) not in self._calls:
                self._calls.append(ir_utils.symbol_name(callee))
                try:
                    out = self._block(graph, callee.regions[0].blocks[0], operands, env)
                finally:
                    self._calls.pop()
                return out if len(out) == n else [self._join(graph, operands)] * n
        elif name in INLINE and op.regions and op.regions[0].blocks:
            body = op.regions[0].blocks[0]
            region = self._region
            if region is None and name == "sdy.manual_computation":
                self._region = (len(self.regions), ir_utils.render_location(op.location, self.source),
                                "transpose(" in str(op.location))
                self.regions.append(self._region)
            try:
                out = self._block(graph, body, operands + [()] * (len(body.arguments) - len(operands)), env)
            finally:
                self._region = region
            return out if len(out) == n else [self._join(graph, operands)] * n
        elif name == "stablehlo.while":
            trips = _trip_count(op)
            if trips is None:
                self.unknown_trips += 1
            self._loops.append((ir_utils.innermost_location(op.location, self.source), trips))
            try:
                body = self._body_graph(op.regions[1].blocks[0])
            finally:
                self._loops.pop()
            node = graph.add(BLOCK, self._join(graph, operands))
            graph.blocks[node] = ([body], trips or 1)
            return [(node,)] * n
        elif name in ("stablehlo.case", "stablehlo.if"):
            bodies = [self._body_graph(r.blocks[0]) for r in op.regions if r.blocks]
            node = graph.add(BLOCK, self._join(graph, operands))
            graph.blocks[node] = (bodies, 1)
            return [(node,)] * n
        elif name in ("stablehlo.dot_general", "stablehlo.dot") or ir_utils.is_grouped_dot(op):
            node = graph.add(DOT, self._join(graph, operands), _dot_seconds(op, name, self.hw) if self._graph else 0.0)
            if self._loops:
                self.dot_trips[ir_utils.render_location(op.location, self.source)] = self._trips()
            return [(node,)] * n
        elif name in _COLLECTIVES:
            seconds = _COLLECTIVES[name](op, self._group_size(op), self.hw) if self._graph else 0.0
            instance = -1
            if name in _ANCHOR_OPS:
                instance = len(self.instances)
                loop = self._loops[-1] if self._loops else (None, None)
                self.instances.append(_Instance((ir_utils.render_location(op.location, self.source), name),
                                                self._ops.setdefault(op, len(self._ops)), self._region, *loop,
                                                self._trips()))
            node = graph.add(COLLECTIVE, self._join(graph, operands), seconds, instance)
            return [(node,)] * n
        return [self._join(graph, operands)] * n

    def _trips(self) -> int:
        """How many times an op at this point of the walk runs per step: the enclosing loops' trips."""
        product = 1
        for _, trips in self._loops:
            product *= trips or 1
        return product

    def _body_graph(self, block: ir.Block) -> _Graph:
        body = _Graph()
        self._block(body, block, [()] * len(block.arguments), {})
        return body

    @staticmethod
    def _join(graph: _Graph, operands: list[tuple[int, ...]]) -> tuple[int, ...]:
        """The tasks a value computed from ``operands`` by free ops waits for."""
        if len(operands) == 1:
            return operands[0]
        deps = {d for ds in operands for d in ds}
        if len(deps) <= JOIN_AT:
            return tuple(deps)
        return (graph.add(FREE, tuple(deps)),)

    def _group_size(self, op: ir.Operation) -> int:
        attr = op.attributes["replica_groups"] if "replica_groups" in op.attributes else None
        if attr is None:
            if "source_target_pairs" in op.attributes:  # a permute: one transfer per device
                return 2
            return self.partitions
        try:
            groups = ir_utils.dense_ints(attr)
            return int(groups.shape[-1]) if groups.ndim == 2 else self.partitions
        except (ValueError, TypeError):
            pass
        from .matchers.common import ModuleInfo, replica_groups

        try:
            if self._info is None:
                self._info = ModuleInfo.of(self._module, [])
            return int(replica_groups(attr, self._info).shape[-1])
        except Exception:  # noqa: BLE001 - groups the matchers decline: the partition count bounds them
            return self.partitions

    # ------------------------------------------------------------------ scheduling
    def span(self, rings: dict[int, float]) -> float:
        """The step time with each instance in ``rings`` a ring of that many seconds (beyond
        its dots) holding both streams."""
        return _span(self.graph, rings)


def _span(graph: _Graph, rings: dict[int, float]) -> float:
    """The end of ``graph``'s last task, each stream taking, whenever it is free, the task ready
    first among those waiting for it (the order they were issued in on a tie): a dot issued later
    but ready earlier runs while an earlier one waits for its collective, as XLA's
    latency-hiding scheduler orders them.  A BLOCK (a loop, or a site's ring in ``rings``)
    waits for both streams and holds both."""
    kinds, seconds, instance = graph.kinds, graph.seconds, graph.instance
    successors, waiting = graph.successors()
    finish = [0.0] * len(kinds)
    ready = [0.0] * len(kinds)
    queues: tuple[list, list, list] = ([], [], [])  # DOT, COLLECTIVE, BLOCK: (ready, index)
    stack = [i for i, count in enumerate(waiting) if count == 0]  # tasks whose inputs are all ready
    waiting = list(waiting)
    free = [0.0, 0.0]  # when the compute and the collective stream are free
    end = 0.0

    def done(i: int) -> None:
        for j in successors[i]:
            if finish[i] > ready[j]:
                ready[j] = finish[i]
            waiting[j] -= 1
            if waiting[j] == 0:
                stack.append(j)

    while True:
        while stack:  # free tasks finish when ready; the others wait for their stream
            i = stack.pop()
            kind = kinds[i]
            if instance[i] >= 0 and instance[i] in rings:
                kind = FREE if rings[instance[i]] == GONE else BLOCK
            if kind == FREE:
                finish[i] = ready[i]
                done(i)
            else:
                heapq.heappush(queues[kind - 1], (ready[i], i))
        starts = [(max(q[0][0], free[0] if k != 1 else 0.0, free[1] if k != 0 else 0.0), q[0][1], k)
                  for k, q in enumerate(queues) if q]
        if not starts:
            break
        start, i, k = min(starts)
        heapq.heappop(queues[k])
        if instance[i] >= 0 and instance[i] in rings:
            t = rings[instance[i]]
        elif kinds[i] == BLOCK:
            bodies, trips = graph.blocks[i]
            t = trips * max((_span(body, rings) for body in bodies), default=0.0)
        else:
            t = seconds[i]
        finish[i] = start + t
        if k != 1:
            free[0] = finish[i]
        if k != 0:
            free[1] = finish[i]
        end = max(end, finish[i])
        done(i)
    return max(end, max(finish, default=0.0))


# ---------------------------------------------------------------------------- op prices
def _bytes(values) -> int:
    total = 0
    for v in values:
        t = ir_utils.ranked_tensor(v)
        if t is not None and ir_utils.is_static(t):
            total += tensor_bytes(t)
    return total


def _dot_seconds(op: ir.Operation, name: str, hw: Hardware) -> float:
    lhs, result = ir_utils.ranked_tensor(op.operands[0]), ir_utils.ranked_tensor(op.results[0])
    if lhs is None or result is None or not (ir_utils.is_static(lhs) and ir_utils.is_static(result)):
        return 0.0
    if name == "stablehlo.dot":
        contracted = lhs.shape[-1] if lhs.rank else 1
    else:  # a dot_general, or a grouped matmul (each row against one group's matrix)
        contracted = 1
        for d in ir_utils.lhs_contracting_dims(op):
            contracted *= lhs.shape[d]
    flops = 2 * contracted
    for d in result.shape:
        flops *= d
    return flops / ir_utils.result_groups(op) / hw.throughput(str(lhs.element_type))


def _gather(op, n, hw):
    return _bytes(op.operands) * (n - 1) / hw.bandwidth + hw.step if n > 1 else 0.0


def _scatter(op, n, hw):
    return _bytes(op.results) * (n - 1) / hw.bandwidth + hw.step if n > 1 else 0.0


def _all_reduce(op, n, hw):
    return hw.all_reduce_seconds(_bytes(op.operands), n) if n > 1 else 0.0


def _all_to_all(op, n, hw):
    return _bytes(op.operands) * (n - 1) / n / hw.bandwidth + hw.step if n > 1 else 0.0


def _one_transfer(op, n, hw):
    return _bytes(op.operands) / hw.bandwidth + hw.step


_COLLECTIVES = {"stablehlo.all_gather": _gather, "stablehlo.reduce_scatter": _scatter,
                "stablehlo.all_reduce": _all_reduce, "stablehlo.all_to_all": _all_to_all,
                "stablehlo.collective_permute": _one_transfer, "stablehlo.collective_broadcast": _one_transfer}
_ANCHOR_OPS = frozenset(ANCHORS.values())
#: the ops a walk without the dataflow graph visits (Program's ``graph=False``): what holds ops,
#: and the collectives
_STRUCTURE = INLINE | frozenset(_COLLECTIVES) | {"func.call", "stablehlo.while", "stablehlo.case", "stablehlo.if"}


def _trip_count(loop: ir.Operation) -> int | None:
    """A ``stablehlo.while``'s trips where its condition is ``arg < N`` (``N`` a constant, the
    argument's initial value a constant, as jax writes a scan or fori_loop); else None."""
    cond = loop.regions[0].blocks[0]
    ops = list(cond.operations)
    if not ops or not ops[-1].operation.operands:
        return None
    compare = _owner(ops[-1].operation.operands[0])
    if compare is None or compare.name != "stablehlo.compare":
        return None
    if hlo.ComparisonDirectionAttr(compare.attributes["comparison_direction"]).value != "LT":
        return None
    counter, bound = compare.operands
    limit = _constant(bound)
    if limit is None or not isinstance(counter, ir.BlockArgument) or counter.owner != cond:
        return None
    start = _constant(loop.operands[counter.arg_number])
    return max(limit - start, 0) if start is not None else None


def _owner(value: ir.Value) -> ir.Operation | None:
    """The op defining ``value``; None for a block argument."""
    owner = ir_utils.producer(value)
    return owner.operation if owner is not None else None


def _constant(value: ir.Value) -> int | None:
    owner = _owner(value)
    if owner is None or owner.name != "stablehlo.constant":
        return None
    try:
        array = ir_utils.dense_ints(owner.attributes["value"])
    except (ValueError, TypeError):
        return None
    return int(array.reshape(-1)[0]) if array.size == 1 else None


# ---------------------------------------------------------------------------- the prediction
@dataclass
class ProgramPrediction:
    """The step's predicted time before and after the rewrite (seconds, per device), and the
    places carrying the difference: (location, seconds the step gains from its sites; negative:
    loses)."""

    hardware: str
    partitions: int
    before_s: float
    after_s: float
    places: list[tuple[str, float]] = field(default_factory=list)
    #: loops whose trip count could not be read (each counted once)
    unknown_trips: int = 0
    #: rewritten sites not found among the module's collectives (left out of "after")
    unplaced: int = 0

    def to_dict(self) -> dict:
        return {**asdict(self), "places": [list(p) for p in self.places]}


def ring_seconds(site: SiteReport) -> float | None:
    """A rewritten site's time beyond its dots' compute (what its collective becomes)."""
    if not site.rewritten:
        return None
    if site.attention.get("prediction"):
        p = site.attention["prediction"]
        return max(p["ring_s"] - p["compute_s"], 0.0)
    if site.all_to_all:
        p = site.all_to_all["prediction"]
        return max(p["chunks_s"][str(site.all_to_all["chunks"])] - p["compute_s"], 0.0)
    if site.all_reduce:
        p = site.all_reduce.get("prediction") or {}
        if not p:
            return None
        chunks = site.all_reduce.get("chunks") or p.get("chunks")
        total = p["split_s"] if site.all_reduce.get("strategy") == "split" else p["chunk_s"].get(str(chunks))
        if total is None:
            return None
        return max(total - (p["serial_s"] - p["all_reduce_s"]), 0.0)
    if site.cost:
        c = site.cost
        return max(c["overlapped_s"][c["variant"]] - c["compute_s"], 0.0)
    return None


def match(program: Program, report: Report) -> dict[int, list[SiteReport]]:
    """Each instance's sites (see the module's docstring): by key, in order; where one op runs
    several times (a function called from several places) and has one site, every run is it;
    where one instance has several sites (a gather sunk into two loops), it holds them all."""
    sites: dict[tuple[str, str], list[SiteReport]] = {}
    for site in report.sites:
        if site.kind in ANCHORS:
            sites.setdefault((site.location, ANCHORS[site.kind]), []).append(site)
    runs: dict[tuple[str, str], list[int]] = {}
    for i, inst in enumerate(program.instances):
        runs.setdefault(inst.key, []).append(i)
    found: dict[int, list[SiteReport]] = {}
    for key, indices in runs.items():
        mine = sites.get(key, [])
        if len(mine) == 1 and len(indices) > 1 and len({program.instances[i].op for i in indices}) == 1:
            found.update((i, mine) for i in indices)
        elif len(indices) == 1 and len(mine) > 1:
            found[indices[0]] = mine
        else:
            found.update((i, [site]) for i, site in zip(indices, mine))
    return found


def _ring_of(program: Program, inst: int, sites: list[SiteReport]) -> float | None:
    """What instance ``inst``'s collective becomes: its rewritten sites' rings beyond their dots,
    each as many times per run of the collective as its first dot runs (a gather sunk into a
    loop rings in every trip); None where none of them was rewritten."""
    total, any_rewritten = 0.0, False
    runs = program.instances[inst].runs
    for site in sites:
        t = ring_seconds(site)
        if t is None:
            continue
        any_rewritten = True
        dots = site.consumers[0]["location"] if site.consumers else None
        total += t * max(program.dot_trips.get(dots, runs) // runs, 1)
    return total if any_rewritten else None


def _rewritten(program: Program, report: Report) -> tuple[dict, dict[int, float], dict[str, set[int]]]:
    """(each instance's sites, each rewritten instance's ring seconds, the rewritten instances
    of each place in the source)."""
    matched = match(program, report)
    rings = {i: t for i, sites in matched.items() if (t := _ring_of(program, i, sites)) is not None}
    by_place: dict[str, set[int]] = {}
    for i in rings:
        for site in matched[i]:
            if site.rewritten:
                by_place.setdefault(site.location, set()).add(i)
    absorbed = {where: s.location for s in report.rewritten for where in s.absorbs}
    for i, inst in enumerate(program.instances):  # a merged two-stage gather's first stage, ...: gone
        if inst.key[0] in absorbed and i not in rings:
            rings[i] = GONE
            by_place.setdefault(absorbed[inst.key[0]], set()).add(i)
    return matched, rings, by_place


def predict(program: Program, report: Report) -> ProgramPrediction:
    """The step before and after (see the module's docstring)."""
    matched, rings, by_place = _rewritten(program, report)
    placed = {id(site) for i in rings for site in matched.get(i, ())}
    # the gather rings a psum split for them (psums.split_summed_value) counts in its own time
    split_for = {loc for s in report.rewritten if s.all_reduce.get("picked") == "summed value"
                 for loc in s.all_reduce.get("rings", ())}
    unplaced = sum(1 for s in report.rewritten if id(s) not in placed and ring_seconds(s) is not None
                   and not (s.kind == "all_gather_dot" and s.location in split_for))
    before = program.span({})
    after = program.span(rings) if rings else before
    places = []
    if rings and after != before:
        sign = 1.0 if after < before else -1.0

        def alone(location: str) -> float:  # the place's sites' own predicted change, summed
            return sum(_site_change(site) for i in by_place[location] for site in matched.get(i, ()))

        for location in sorted(by_place, key=lambda loc: -sign * alone(loc))[:PLACES_MEASURED]:
            kept = {i: t for i, t in rings.items() if i not in by_place[location]}
            places.append((location, program.span(kept) - after))
        places = sorted((p for p in places if sign * p[1] > 0), key=lambda p: -sign * p[1])[:PLACES_SHOWN]
    return ProgramPrediction(program.hw.name, program.partitions, before, after, places, program.unknown_trips,
                             unplaced)


def step_changes(program: Program, report: Report) -> tuple[float, float, dict[str, float]]:
    """(the step before, after, and for every place with rewritten sites the step's time with
    that place's sites as written less ``after``: negative where the place's rings slow it)."""
    _, rings, by_place = _rewritten(program, report)
    before = program.span({})
    after = program.span(rings) if rings else before
    changes = {location: program.span({i: t for i, t in rings.items() if i not in mine}) - after
               for location, mine in by_place.items()} if after > before else {}
    return before, after, changes


def _site_change(site: SiteReport) -> float:
    """The site's own predicted saving (serial less its chosen time; negative: slower)."""
    if not site.rewritten:
        return 0.0
    if site.all_reduce:
        p = site.all_reduce.get("prediction") or {}
        return p.get("serial_s", 0.0) - p.get("serial_s", 0.0) / max(
            p.get("speedup", {}).get(site.all_reduce.get("strategy"), 1.0), 1e-9)
    c = site.cost
    return c["serial_s"] - c["overlapped_s"][c["variant"]] if c else 0.0


def annotate(program: Program, report: Report) -> None:
    """Name each repeated site's layer (``SiteReport.layer``): where one place's collective runs
    in several shard_map regions located alike (a Python loop over a shard_map'd layer), the
    k-th of the regions at that place (``layer k of N``; a backward's regions, which jax lays out
    last layer first, counted from the end); or the loop it runs in (every trip); sites still
    named alike, which of them (:func:`_occurrences`)."""
    matched = {i: sites[0] for i, sites in match(program, report).items() if len(sites) == 1}
    runs: dict[int, int] = {}
    for site in matched.values():
        runs[id(site)] = runs.get(id(site), 0) + 1
    by_key: dict[tuple[str, str], list[int]] = {}
    for i in matched:
        by_key.setdefault(program.instances[i].key, []).append(i)
    at_place: dict[tuple[str, bool], list[int]] = {}
    for ordinal, location, backward in program.regions:
        at_place.setdefault((location, backward), []).append(ordinal)
    for indices in by_key.values():
        regions = [program.instances[i].region for i in indices]
        if len(indices) < 2 or not all(regions) or len({r[1:] for r in regions}) != 1 \
                or len({r[0] for r in regions}) != len(indices) or any(runs[id(matched[i])] > 1 for i in indices):
            continue
        ordinals = at_place[regions[0][1:]]
        for i, region in zip(indices, regions):
            k = ordinals.index(region[0])
            matched[i].layer = f"layer {len(ordinals) - k if region[2] else k + 1} of {len(ordinals)}"
    for i, site in matched.items():
        inst = program.instances[i]
        if site.layer is None and inst.loop is not None:
            trips = f"each of the {inst.trips} trips" if inst.trips else "each trip"
            site.layer = f"{trips} of the loop at {_beside(inst.loop, site.location)}"
    _occurrences(report, {id(site): i for i, site in matched.items()})


def _occurrences(report: Report, order: dict[int, int]) -> None:
    """Sites still named alike, each one collective of its own (one place reached several times
    in one region: a Python loop over layers inside the shard_map'd function): ``occurrence k of
    N``, in the order they run.  (Sites of one collective, a gather sunk into two loops, stay
    as they are.)"""
    alike: dict[tuple[str, str], list[SiteReport]] = {}
    for site in report.sites:
        alike.setdefault((site.place, site.kind), []).append(site)
    for sites in alike.values():
        if len(sites) < 2 or not all(id(site) in order for site in sites):
            continue
        for k, site in enumerate(sorted(sites, key=lambda site: order[id(site)]), 1):
            site.layer = (f"{site.layer}, " if site.layer else "") + f"occurrence {k} of {len(sites)}"


def _beside(location: str, site: str) -> str:
    """``location`` (``file:line:col``) with its file's folder left out where ``site`` names
    that file first (as a rendered call stack names its later frames)."""
    file = location.rsplit(":", 2)[0]
    return os.path.basename(file) + location[len(file):] if site.startswith(file + ":") else location
