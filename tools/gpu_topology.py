#!/usr/bin/env python
"""Compile the pass's output for an 8-GPU topology on one GPU and read, in the schedule XLA's
GPU compiler produces, whether each ring's transfers overlap its dots.

One GPU is enough to *compile* for eight: JAX's CUDA client can mock a multi-node topology
(the config option ``jax_mock_gpu_topology="1x8x1"``: 1 slice, 8 hosts, 1 GPU each; NCCL
is mocked), and
``jax.jit(...).lower(...).compile()`` then runs XLA's whole GPU pipeline (SPMD partitioner,
async collective conversion, the latency-hiding scheduler, stream assignment, autotuning on
the real GPU) for the 8-device program.  Nothing is executed.

For the training step of a sequence-parallel transformer (``tools/bench.transformer_step``:
q/k/v/o projections and a SwiGLU MLP per layer, forward and backward, 8 collective matmuls
per layer) it compiles the original and each pass variant and reports, per program:

* the collectives left in the optimised module (the original's all-gathers and
  reduce-scatters; the rewrites' collective-permutes), and the while loops;
* **overlap**: for every asynchronous ``collective-permute-start`` the instructions the
  scheduler placed before its ``collective-permute-done``, and whether a matmul is among them
  (a permute with none is exposed: nothing hides its transfer);
* with ``--annotate-streams``: the async computations (``async-start`` wrapping the
  outlined dots) by stream, and the ``_scheduling_group_id`` values that survived to the
  optimised module;
* the compile time relative to the original's: the first of ``--repeats`` compiles, each
  from a fresh lowering, also autotunes the GEMM shapes it is the first to meet; the fastest
  of the others is the compile with every in-process cache warm.  And the pass's own time
  on the lowered text against what ``jax.jit`` spends before a first call (lower + cold compile);
* shared against unshared rings (``--no-share-rings``): the optimised modules' opcode counts;
* the copies XLA left in loop bodies (``loop_copies``), and the dynamic slices it runs as
  kernels of their own rather than inside a GEMM (``slice_copies``: the rings' per-round
  operand blocks, which the cost model does not charge), each counted as often as it runs;
* the cuBLAS GEMMs that add their product to an operand (``accumulating_gemms``: whether XLA
  folded a contracting ring's per-round accumulation into its GEMM).

The optimised module (``compiled.as_text()``, parsed back into jaxlib's ``HloModule``) is read
through its ``HloComputation`` / ``HloInstruction`` objects and its ``HloSchedule``; only attributes those objects do not expose
(``backend_config``, ``frontend_attributes``, called computations, custom-call targets) are
read from one instruction's printed form.  Results go to ``--out`` (JSON);
``--dump-hlo DIR`` also writes the optimised HLO of some programs.  On CPU (``--platform
cpu``, the tests) the same code runs on the 8 virtual CPU devices, whose permutes are
synchronous: structure only, no overlap.

    python tools/gpu_topology.py --model 8b --out $OUT/topology.json          # on the GPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tools.gpu_env import GPU_XLA_FLAGS, MOCK_XLA_FLAGS, configure_environment  # noqa: E402,F401

#: (tokens = sequence x batch, hidden, ffn) per layer; tokens are the global rows
MODELS = {"70b": (8192, 8192, 28672), "8b": (8192, 4096, 14336), "tiny": (64, 64, 128)}

#: program name -> (cmatmul_pass.jit options); "original" is jax.jit's own program.  Each names its
#: variant (cost.VARIANTS), so that a program's name says what it compiles whatever the default is
PROGRAMS = {
    "uni": dict(variant="uni"),
    "unroll2": dict(variant="unroll2"),
    "full": dict(variant="full"),
    "bidi": dict(variant="bidi"),
    "bidi-unroll2": dict(variant="bidi-unroll2"),
    "bidi-full": dict(variant="bidi-full"),
    # each site the variant the cost model picks for --profile (the row's "variants" says which)
    "auto": dict(variant="auto"),
    "uni-no-share": dict(variant="uni", share_rings=False),
    "uni-streams": dict(variant="uni", annotate_streams=True),
    "bidi-streams": dict(variant="bidi", annotate_streams=True),
    # without the XLA options cmatmul_pass.jit adds on a GPU (decorator.ring_compiler_options)
    "uni-no-gpu-options": dict(variant="uni", gpu_options=False),
    "bidi-no-gpu-options": dict(variant="bidi", gpu_options=False),
    # without merged dots (each consumer its own dot per round) or without the rounds' barriers
    "uni-no-merge": dict(variant="uni", merge_dots=False),
    "unroll2-no-tie": dict(variant="unroll2", tie_rounds=False),
    "full-no-tie": dict(variant="full", tie_rounds=False),
    "bidi-no-tie": dict(variant="bidi", tie_rounds=False),
    # XLA's dynamic slice fusion: a GEMM reads its operand's block at a run-time offset itself
    # instead of a slice kernel copying it out first (slice_copies says whether it did)
    "uni-dsf": dict(variant="uni", compiler_options={"xla_gpu_enable_dynamic_slice_fusion": True}),
}
#: bidi-full and auto are left out of the default list (tools/gpu_checks.sh names them, with the
#: A/B programs it compiles)
DEFAULT_PROGRAMS = [name for name in PROGRAMS
                    if name not in ("bidi-full", "auto") and not any(x in name for x in ("no-gpu-options", "no-merge", "no-tie", "dsf"))]


# ------------------------------------------------------------------------ reading the module
def opcode_name(instruction) -> str:
    """``HloOpcode.kCollectivePermuteStart`` -> ``collective-permute-start`` (HLO text's name)."""
    name = str(instruction.opcode).rpartition(".")[2].removeprefix("k")
    return "".join("-" + c.lower() if c.isupper() and i else c.lower() for i, c in enumerate(name))


def _attribute_span(printed: str, key: str, start: int = 0) -> tuple[int, int, int] | None:
    """Where ``, key=value`` is in printed HLO from ``start`` on: (its start, the value's start,
    its end); the value runs to the next comma outside brackets, or to the end of the line."""
    begin = printed.find(f", {key}=", start)
    if begin < 0:
        return None
    value = begin + len(key) + 3
    depth = 0
    for end in range(value, len(printed)):
        c = printed[end]
        if c in "{[(":
            depth += 1
        elif c in "}])":
            depth -= 1
        elif (c == "," and depth == 0) or c == "\n" or depth < 0:
            return begin, value, end
    return begin, value, len(printed)


def _attribute(printed: str, key: str) -> str | None:
    """The value after ``key=`` in one instruction's printed form."""
    span = _attribute_span(printed, key)
    return printed[span[1]:span[2]] if span else None


def optimized_module(compiled):
    """``compiled.as_text()`` (what XLA runs) as jaxlib's ``HloModule``.

    Not ``compiled.runtime_executable().hlo_modules()``: through jax 0.11.2's CUDA plugin
    that module lacks the asynchronous collective pairs the text shows.  XLA's parser rejects
    some attributes its own printer writes (0.11.2: ``output_to_operand_aliasing`` on
    ``all-reduce-start``); each one it names is dropped (none matters here) and the text parsed
    again."""
    from cmatmul_pass._jax_private import hlo_module_from_text

    text = compiled.as_text()
    for _ in range(8):
        try:
            return hlo_module_from_text(text)
        except Exception as exc:  # XLA's own error type
            message = str(exc)
            marker = 'unexpected attribute "'
            if marker not in message:
                raise
            key = message.split(marker, 1)[1].split('"', 1)[0]
            kept, position = [], 0
            while (span := _attribute_span(text, key, position)) is not None:
                kept.append(text[position:span[0]])
                position = span[2]
            text = "".join(kept) + text[position:]
    return hlo_module_from_text(text)


def called_computations(printed: str) -> list[str]:
    names = []
    for key in ("calls", "to_apply", "body", "condition", "called_computations"):
        value = _attribute(printed, key)
        if value:
            names += [n.strip().lstrip("%") for n in value.strip("{}").split(",") if n.strip()]
    return names


def backend_config(printed: str) -> dict:
    """An instruction's ``backend_config`` JSON ({} when it has none or it is not JSON)."""
    config = _attribute(printed, "backend_config")
    try:
        parsed = json.loads(config) if config else {}
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def trip_count(printed: str) -> int:
    """A while loop's trip count as XLA annotated it (``known_trip_count``); 0: not annotated."""
    return int(backend_config(printed).get("known_trip_count", {}).get("n", 0))


def queue_id(printed: str) -> str | None:
    return str(backend_config(printed).get("operation_queue_id", "")) or None


def frontend_attribute(printed: str, key: str) -> str | None:
    attrs = _attribute(printed, "frontend_attributes")
    if not attrs:
        return None
    for item in attrs.strip("{}").split(","):
        name, _, value = item.partition("=")
        if name.strip() == key:
            return value.strip().strip('"')
    return None


class ModuleReader:
    """One optimised ``HloModule``: which computations hold matmuls, and the scheduled order."""

    MATMUL_TARGETS = ("gemm", "matmul")  # __cublas$gemm, __cublas$lt$matmul, __triton_gemm, __onednn$matmul

    def __init__(self, module):
        self.module = module
        self.computations = {c.name: c for c in module.computations()}
        self._matmul: dict[str, bool] = {}
        self._scheduled: list | None = None
        self._printed: dict[str, str] = {}

    def printed(self, instruction) -> str:
        """``instruction``'s printed form, printed once per module (HLO instruction names are
        unique in a module): the readers below all parse it."""
        text = self._printed.get(instruction.name)
        if text is None:
            text = self._printed[instruction.name] = instruction.to_string()
        return text

    def is_matmul(self, instruction) -> bool:
        """A dot, a gemm custom call or fusion, or an op calling a computation that holds one."""
        op = opcode_name(instruction)
        if op in ("dot", "convolution"):
            return True
        printed = self.printed(instruction)
        if op in ("custom-call", "fusion") and any(t in printed for t in self.MATMUL_TARGETS):
            return True
        return any(self.holds_matmul(name) for name in called_computations(printed))

    def called_opcodes(self, printed: str) -> list[str]:
        """The opcodes of the computations an instruction (its printed form) calls: a fusion's."""
        return [opcode_name(i) for name in called_computations(printed)
                for i in (self.computations[name].instructions() if name in self.computations else ())]

    def concatenates(self, instruction) -> bool:
        """A concatenate, or a fusion of one (XLA's dot merger concatenates the operands of the
        dots it merges: in a loop body, once per trip)."""
        if opcode_name(instruction) == "concatenate":
            return True
        return opcode_name(instruction) == "fusion" and "concatenate" in self.called_opcodes(self.printed(instruction))

    def runs(self) -> dict[str, int]:
        """How often each computation runs per run of the module: a while loop's body and
        condition as often as the loop's caller times its known trip count (once where XLA did
        not annotate one), any other called computation as often as its caller."""
        callees: dict[str, list[tuple[str, int]]] = {}
        called: set[str] = set()
        for comp in self.computations.values():
            edges = callees[comp.name] = []
            for instruction in comp.instructions():
                printed = self.printed(instruction)
                trips = max(1, trip_count(printed)) if opcode_name(instruction) == "while" else 1
                loop = {(_attribute(printed, key) or "").lstrip("%") for key in ("body", "condition")}
                edges += [(name, trips if name in loop else 1) for name in called_computations(printed)]
                called.update(name for name, _ in edges)
        runs: dict[str, int] = {}

        def visit(name: str, times: int) -> None:
            if name not in callees or runs.get(name, 0) >= times:
                return
            runs[name] = times
            for callee, trips in callees[name]:
                visit(callee, times * trips)

        for name in callees:
            if name not in called:  # the entry computation (and anything nothing calls)
                visit(name, 1)
        return runs

    def holds_matmul(self, name: str) -> bool:
        if name not in self._matmul:
            self._matmul[name] = False  # recursion guard
            comp = self.computations.get(name)
            self._matmul[name] = comp is not None and any(self.is_matmul(i) for i in comp.instructions())
        return self._matmul[name]

    def scheduled(self) -> list[tuple]:
        """(computation, [(instruction, its printed form), ...] in schedule order) for every
        scheduled computation, less the ops ``async-start``s wrap (each is its async pair's op,
        counted there).  Walked once per module: :func:`analyse`, :func:`slice_copies` and
        :func:`accumulating_gemms` all read it."""
        if self._scheduled is None:
            schedule = self.module.schedule()
            wrapped = {i.async_wrapped_root().name for comp in self.computations.values()
                       for i in comp.instructions() if opcode_name(i) == "async-start"}
            self._scheduled = []
            for comp in self.computations.values():
                try:
                    sequence = schedule.sequence(comp)
                except Exception:  # not scheduled (fusion bodies, reducers)
                    continue
                self._scheduled.append((comp, [(i, self.printed(i)) for i in sequence if i.name not in wrapped]))
        return self._scheduled


COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute", "all-to-all")


def async_kind(instruction) -> str:
    """What an asynchronous start runs: ``collective-permute`` for ``collective-permute-start``,
    the wrapped op (``reduce-scatter``, ``call``, ...) for a generic ``async-start``."""
    op = opcode_name(instruction)
    if op == "async-start":
        return opcode_name(instruction.async_wrapped_root())
    return op.removesuffix("-start")


#: bytes per element of the HLO element types a copy may move
ELEMENT_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
                 "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}


def result_bytes(printed: str) -> int:
    """The size of an instruction's (array) result, from its printed form
    ``%name = f32[128,512]{1,0} op(...)``; 0 for a tuple or a type not listed."""
    declared = printed.partition(" = ")[2].split(" ", 1)[0]
    element, _, dims = declared.partition("[")
    if element not in ELEMENT_BYTES:
        return 0
    size = ELEMENT_BYTES[element]
    for dim in dims.partition("]")[0].split(","):
        size *= int(dim) if dim.strip() else 1
    return size


def loop_copies(reader: ModuleReader) -> dict:
    """The copies XLA's copy insertion left in while-loop bodies: each runs once per trip.  A
    ring loop copies the shard it sends when the permute's result must take the loop slot that
    the trip's dot still reads.  ``bytes_per_trip`` sums the loops' bodies (copies of 16 bytes or
    less, the trip counters', are left out of every count); ``bytes_executed`` multiplies each loop's by the
    trip count XLA annotated (``known_trip_count``), where it did."""
    loops = copying = copies = per_trip = executed = concatenates = 0
    for comp in reader.computations.values():
        for instruction in comp.instructions():
            if opcode_name(instruction) != "while":
                continue
            printed = reader.printed(instruction)
            body = reader.computations.get((_attribute(printed, "body") or "").lstrip("%"))
            if body is None:
                continue
            loops += 1
            sizes = [result_bytes(reader.printed(i)) for i in body.instructions() if opcode_name(i) in ("copy", "copy-done")]
            concatenates += sum(1 for i in body.instructions() if reader.concatenates(i))
            sizes = [b for b in sizes if b > 16]
            trips = trip_count(printed)
            copying += bool(sizes)
            copies += len(sizes)
            per_trip += sum(sizes)
            executed += sum(sizes) * trips
    return {"loops": loops, "loops_copying": copying, "copies": copies, "bytes_per_trip": per_trip,
            "bytes_executed": executed, "concatenates": concatenates}


def slice_copies(reader: ModuleReader, runs: dict[str, int]) -> dict:
    """The dynamic slices XLA materialises as kernels of their own: a scheduled ``dynamic-slice``,
    or a fusion holding one and no ``dynamic-update-slice``, that is not a matmul (a GEMM that
    reads its operand at a dynamic offset itself is one).  The ring's per-round blocks of a
    scatter's operand, or of a contracting or batch role's other operand, are such slices, and
    the cost model does not charge them.  ``kernels``: in the schedules; ``executed`` and
    ``bytes_executed``: counted as often as each runs (a loop body's once per trip)."""
    kernels = executed = moved = 0
    for comp, sequence in reader.scheduled():
        for instruction, printed in sequence:
            op = opcode_name(instruction)
            if op == "fusion":
                fused = reader.called_opcodes(printed)
                slices = "dynamic-slice" in fused and "dynamic-update-slice" not in fused
            else:
                slices = op == "dynamic-slice"
            if not slices or reader.is_matmul(instruction):
                continue
            times = runs.get(comp.name, 1)
            kernels += 1
            executed += times
            moved += result_bytes(printed) * times
    return {"kernels": kernels, "executed": executed, "bytes_executed": moved}


def accumulating_gemms(reader: ModuleReader, runs: dict[str, int]) -> dict:
    """The cuBLAS GEMMs that add their product to an operand (``beta`` != 0 in their
    ``gemm_backend_config``: XLA folded an add into the GEMM, as it can a contracting ring's
    per-round ``acc + partial``), against all cuBLAS GEMMs: kernels in the schedules, and
    ``executed`` as often as each runs.  An accumulation left out of the GEMM is an add kernel
    that moves the accumulator once more (docs/gpu.md, "The contracting role")."""
    counts = dict(gemms=0, accumulating=0, gemms_executed=0, accumulating_executed=0)
    for comp, sequence in reader.scheduled():
        times = runs.get(comp.name, 1)
        for instruction, printed in sequence:
            if opcode_name(instruction) != "custom-call" or "__cublas$" not in printed:
                continue
            beta = backend_config(printed).get("gemm_backend_config", {}).get("beta", 0)
            counts["gemms"] += 1
            counts["gemms_executed"] += times
            if float(beta or 0):
                counts["accumulating"] += 1
                counts["accumulating_executed"] += times
    return counts


def analyse(module) -> dict:
    """What the optimised module does with its collectives: see the module docstring.

    Per collective kind: ``async``, the start/done pairs in the schedule; ``sync``, the same
    collectives left synchronous (XLA turns a pair with nothing between start and done back
    into one op); ``overlapped``, those of either form that run while a matmul does: one
    scheduled between start and done, or one on another stream (an async computation, as
    ``--annotate-streams`` makes the ring's dots) started before and finished after;
    ``executed`` and ``overlapped_executed``: the same counted as often as each runs (a
    permute in a loop body once per trip, :meth:`ModuleReader.runs`)."""
    reader = ModuleReader(module)
    runs = reader.runs()
    opcodes: Counter = Counter()
    for comp in reader.computations.values():
        opcodes.update(opcode_name(i) for i in comp.instructions())
    collectives = []  # one entry per collective in a schedule
    async_compute: Counter = Counter()  # async computations (stream-annotated calls), by stream
    groups: set[str] = set()
    for comp, sequence in reader.scheduled():
        open_starts: dict[str, dict] = {}
        in_flight: set[str] = set()  # async computations holding a matmul, started and not done
        for instruction, printed in sequence:
            op = opcode_name(instruction)
            group = frontend_attribute(printed, "_scheduling_group_id")
            if group is not None:
                groups.add(group)
            if op.endswith("-done"):
                for operand in instruction.operands():
                    entry = open_starts.pop(operand.name, None)
                    if entry is not None:
                        entry["overlapped"] |= bool(entry["in_flight"] & in_flight)
                        collectives.append(entry)
                    in_flight.discard(operand.name)
                continue
            matmul = reader.is_matmul(instruction)
            for entry in open_starts.values():
                entry["between"] += 1
                entry["overlapped"] |= matmul
            kind = async_kind(instruction) if op.endswith("-start") else op
            if kind not in COLLECTIVES:
                if op == "async-start":  # the stream an annotated call runs on, else its queue
                    stream = frontend_attribute(printed, "_xla_stream_annotation")
                    async_compute[f"stream {stream}" if stream else f"queue {queue_id(printed) or 0}"] += 1
                    if matmul:
                        in_flight.add(instruction.name)
                continue
            entry = {"kind": kind, "async": op.endswith("-start"), "between": 0, "in_flight": set(in_flight),
                     "overlapped": False, "runs": runs.get(comp.name, 1)}
            if entry["async"]:
                open_starts[instruction.name] = entry
            else:
                entry["overlapped"] = bool(in_flight)
                collectives.append(entry)
        collectives.extend(open_starts.values())  # never done in this computation
    by_kind: dict[str, dict] = {}
    for kind in COLLECTIVES:
        mine = [c for c in collectives if c["kind"] == kind]
        if mine:
            pairs = [c["between"] for c in mine if c["async"]]
            by_kind[kind] = {
                "async": len(pairs), "sync": len(mine) - len(pairs),
                "overlapped": sum(1 for c in mine if c["overlapped"]),
                "median_ops_between": statistics.median(pairs) if pairs else None,
                "executed": sum(c["runs"] for c in mine),
                "overlapped_executed": sum(c["runs"] for c in mine if c["overlapped"]),
            }
    return {
        "collectives": by_kind,
        "while_loops": opcodes.get("while", 0),
        "loop_copies": loop_copies(reader),
        "slice_copies": slice_copies(reader, runs),
        "accumulating_gemms": accumulating_gemms(reader, runs),
        "async_computations": dict(async_compute),
        "scheduling_groups": len(groups),
        "instructions": sum(opcodes.values()),
        "opcodes": dict(sorted(opcodes.items())),
    }


# ------------------------------------------------------------------------------ the programs
def compile_programs(model: str, layers: int, dtype: str, names: list[str], dump_dir: str | None,
                     dump: list[str], repeats: int = 3, profile: str = "h100") -> dict:
    import jax
    import jax.numpy as jnp

    import cmatmul_pass
    from tools.bench import transformer_step

    tokens, hidden, ffn = MODELS[model]
    devices = jax.devices()
    n = len(devices)
    results: dict = {}
    fn, args = transformer_step(layers, hidden=hidden, ffn=ffn, tokens=tokens, mesh_shape=(1, n),
                                dtype=getattr(jnp, dtype))

    def record(name: str, lower) -> None:
        """Compile ``lower()`` ``repeats`` times, each from a fresh lowering (a compiled Lowered
        keeps its executable, and jax caches compilations of the same module).  The first
        compile autotunes the GEMM shapes no earlier program had; later ones find them in the
        process's autotuning cache."""
        seconds, lower_s = [], []
        for _ in range(repeats):
            jax.clear_caches()  # else jax hands back the executable of the same lowered module
            start = time.perf_counter()
            lowered = lower()
            lower_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            compiled = lowered.compile()
            seconds.append(time.perf_counter() - start)
        module = optimized_module(compiled)
        row = {"compile_s": min(seconds[1:] or seconds), "first_compile_s": seconds[0], "lower_s": min(lower_s),
               **analyse(module)}
        report = getattr(lowered, "report", None)
        if report is not None:
            row["sites"] = len(report.sites)
            row["rewritten"] = len(report.rewritten)
            row["shared"] = sum(1 for s in report.rewritten if s.shared_ring)
            # what the pass says each device executes: straight-line rings hold every one
            row["permutes_executed"] = sum(s.schedule["permutes"] for s in report.rewritten)
            row["variants"] = dict(Counter(s.schedule["variant"] for s in report.rewritten))
        results[name] = row
        if dump_dir and name in dump:
            Path(dump_dir).mkdir(parents=True, exist_ok=True)
            (Path(dump_dir) / f"{model}_{name}.hlo.txt").write_text(compiled.as_text())
        print(f"  {name:<14} compile {seconds[0]:6.2f} s then {seconds[-1]:6.2f} s; while {row['while_loops']}; "
              + ", ".join(f"{k} {v['async']} async ({v['overlapped']} overlapped) {v['sync']} sync"
                          for k, v in row["collectives"].items())
              + f"; async computations {row['async_computations']}, groups {row['scheduling_groups']}"
              + f"; loop copies {row['loop_copies']['copies']} ({row['loop_copies']['bytes_per_trip']} B per trip)"
              + f", loop concatenates {row['loop_copies']['concatenates']}"
              + f"; slice kernels {row['slice_copies']['executed']} run"
              + f" ({row['slice_copies']['bytes_executed'] / 2**20:.1f} MiB)"
              + f"; GEMMs adding to an operand {row['accumulating_gemms']['accumulating_executed']}"
              + f" of {row['accumulating_gemms']['gemms_executed']} run"
              + (f"; variants {row['variants']}" if "auto" in name else ""),
              flush=True)

    record("original", lambda: fn.lower(*args))
    text = fn.lower(*args).as_text()
    pass_s = {}
    for name in names:  # the pass alone, on the lowered text (parse, rewrite, verify, print)
        start = time.perf_counter()
        options = {k: v for k, v in program_options(name, profile).items()
                   if k not in ("gpu_options", "compiler_options")}  # the decorator's and jax.jit's
        _ = cmatmul_pass.rewrite(text, cmatmul_pass.Options(**options)).text
        pass_s[name] = time.perf_counter() - start
    step = getattr(fn, "__wrapped__", fn)  # the training step jax.jit wraps
    for name in names:
        try:
            record(name, lambda: cmatmul_pass.jit(step, **program_options(name, profile)).lower(*args))
        except Exception as exc:  # report it and go on with the other programs
            results[name] = {"error": " ".join(str(exc).split())[:800]}
            print(f"  {name:<14} FAILED: {results[name]['error']}", flush=True)
    original = results["original"]
    base = original["compile_s"]
    for name, row in results.items():
        if name in pass_s:  # and its share of what jax.jit spends before the first call (lower + a cold compile)
            row["pass_s"] = pass_s[name]
            row["pass_over_lower_compile"] = pass_s[name] / (original["lower_s"] + original["first_compile_s"])
        if "compile_s" in row:
            row["compile_ratio"] = row["compile_s"] / base
            row["first_compile_ratio"] = row["first_compile_s"] / original["first_compile_s"]
    return results


def program_options(name: str, profile: str) -> dict:
    """``cmatmul_pass.jit``'s options for program ``name``: a model-picked variant picks for ``profile``.
    The training step's data-parallel psums of weight gradients stay all_reduces (``all_reduce="keep"``):
    this tool measures the gather and scatter rings' overlap, which the profile's ``overlap`` prices."""
    options = {"all_reduce": "keep", **PROGRAMS[name]}
    if options.get("variant") == "auto":
        options["hardware"] = profile
    return options


def permute_counts(row: dict) -> tuple[int, int] | None:
    """(overlapped, total) permutes of one program's row: as each device executes them (a loop's
    permute once per trip), or per permute op in results written before ``executed`` was
    counted; None where the program has no permutes."""
    permutes = row.get("collectives", {}).get("collective-permute")
    if not permutes:
        return None
    total = permutes.get("executed", permutes["async"] + permutes["sync"])
    return (permutes.get("overlapped_executed", permutes["overlapped"]), total) if total else None


def overlap_fractions(programs: dict) -> dict[str, float]:
    """Per pass variant among ``programs`` (``cost.VARIANTS`` names; not the A/B programs): the
    fraction of the permutes each device executes that overlap a dot, the cost model's
    ``Hardware.overlap``.  Results written before ``executed`` was counted: per permute op."""
    from cmatmul_pass import cost

    fractions = {}
    for name, row in programs.items():
        counts = permute_counts(row) if name in cost.VARIANTS else None
        if counts:
            fractions[name] = counts[0] / counts[1]
    return fractions


#: the XLA flags of a run whose overlap goes into a profile: the README's, and the mocked
#: topology's (a run with other flags, --no-flags or --xla-flags, is an experiment)
PROFILE_XLA_FLAGS = frozenset(f"{GPU_XLA_FLAGS} {MOCK_XLA_FLAGS}".split())


def pooled_overlap(runs: list[dict]) -> tuple[dict[str, dict], list[str]]:
    """The overlap a profile takes from several runs' JSONs (each this tool's ``--out``): per
    pass variant, the permutes overlapped and executed, summed over the models (the training
    step at 8B and at 70B shapes count alike).  Of runs of the same model (and layers, dtype),
    a later one's count of a variant replaces an earlier one's.  Only runs compiled with
    :data:`PROFILE_XLA_FLAGS` count.  Returns ({variant: {"overlapped", "executed", "fraction",
    "models": {model: [overlapped, executed]}}}, why each skipped run was skipped)."""
    from cmatmul_pass import cost

    latest: dict[tuple, dict[str, tuple[int, int]]] = {}
    skipped = []
    for run in runs:
        if frozenset((run.get("xla_flags") or "").split()) != PROFILE_XLA_FLAGS:
            skipped.append(f"{run.get('source', run.get('model'))}: compiled with XLA_FLAGS={run.get('xla_flags')!r}")
            continue
        model = (run["model"], run.get("layers"), run.get("dtype"))
        for name, row in run["programs"].items():
            counts = permute_counts(row) if name in cost.VARIANTS else None
            if counts:
                latest.setdefault(model, {})[name] = counts
    pooled: dict[str, dict] = {}
    for (model, *_), counts in latest.items():
        for name, (overlapped, executed) in counts.items():
            entry = pooled.setdefault(name, {"overlapped": 0, "executed": 0, "models": {}})
            entry["overlapped"] += overlapped
            entry["executed"] += executed
            entry["models"][model] = [overlapped, executed]
    for entry in pooled.values():
        entry["fraction"] = entry["overlapped"] / entry["executed"]
    return {name: pooled[name] for name in cost.VARIANTS if name in pooled}, skipped


def hardware_override(profile: str, fractions: dict[str, float]) -> str:
    """``--hardware`` for the pass: ``profile`` with the measured overlap per variant."""
    return f"{profile}:" + ",".join(f"overlap.{name}={fraction:.3f}" for name, fraction in fractions.items())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--platform", choices=("gpu", "cpu"), default="gpu")
    parser.add_argument("--devices", type=int, default=8, help="the (mocked) topology's GPU count")
    parser.add_argument("--model", choices=sorted(MODELS), default="8b")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--programs", nargs="*", default=DEFAULT_PROGRAMS, choices=list(PROGRAMS))
    parser.add_argument("--no-flags", action="store_true",
                        help="leave out the README's XLA flags: what XLA and cmatmul_pass.jit do by default")
    parser.add_argument("--dump-hlo", metavar="DIR", help="write the optimised HLO of the --dump programs here")
    parser.add_argument("--dump", nargs="*", default=["original", "uni", "uni-streams"])
    parser.add_argument("--repeats", type=int, default=3,
                        help="compiles per program: the first (cold) and the fastest of the others are reported")
    parser.add_argument("--xla-flags", default="", help="more XLA flags for every compile")
    parser.add_argument("--profile", default="h100", help="the cost-model profile the printed --hardware overrides")
    parser.add_argument("--out", default=str(ROOT / "build" / "bench" / "gpu_topology.json"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_environment(args.platform, args.devices, args.xla_flags, readme_flags=not args.no_flags)

    import jax

    from tools.bench import write_results

    devices = jax.devices()
    if len(devices) != args.devices:
        raise SystemExit(f"expected {args.devices} {args.platform} devices, jax sees {len(devices)}: {devices[:2]}...")
    print(f"{len(devices)} devices ({devices[0].platform}: {devices[0].device_kind}; "
          f"{jax.local_device_count()} local), jax {jax.__version__}, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}",
          flush=True)
    programs = compile_programs(args.model, args.layers, args.dtype, args.programs, args.dump_hlo, args.dump,
                                args.repeats, args.profile)
    result = {
        "device": f"{devices[0].platform}: {devices[0].device_kind}", "devices": len(devices),
        "local_devices": jax.local_device_count(), "mock_topology": jax.config.read("jax_mock_gpu_topology") or None,
        "xla_flags": os.environ.get("XLA_FLAGS"), "jax": jax.__version__, "model": args.model,
        "dims": list(MODELS[args.model]), "layers": args.layers, "dtype": args.dtype, "programs": programs,
        "overlap": overlap_fractions(programs),
    }
    write_results(args.out, result)
    if result["overlap"]:
        print("permutes overlapped with a dot, as executed: "
              + ", ".join(f"{name} {fraction:.3f}" for name, fraction in result["overlap"].items())
              + f'\n-> --hardware "{hardware_override(args.profile, result["overlap"])}"', flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
