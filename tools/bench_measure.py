"""What tools/bench.py measures: the pass's cost (cold starts against lower + compile, warm, and
its profile), the CPU run time of the rewritten programs over the originals and over rings written
by hand, and a call's dispatch through ``cmatmul_pass.jit`` against ``jax.jit``'s."""

from __future__ import annotations

# first: it sets XLA's CPU device count and the pass's policy before jax and the pass load
from tools.bench_models import (
    JIT_OPTIONS, MODELS, ROOT, SCRATCH, SPLIT_PSUMS, VARIANTS, hand_written_ring, hand_written_scatter, transformer_step,
)

import statistics  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import cmatmul_pass  # noqa: E402
from cmatmul_pass import execute, ir_utils  # noqa: E402
from cmatmul_pass.execute import interleaved_medians, interleaved_samples, paired_ratio, ratio_interval  # noqa: E402
from cmatmul_pass.decorator import rewrite_lowered  # noqa: E402
from cmatmul_pass.pipeline import Options, variant_options  # noqa: E402
from cmatmul_pass._jax_private import compile_module  # noqa: E402
from tools.golden import expectation, sample_paths  # noqa: E402


# ---------------------------------------------------------------------------- 1. pass cost
def compile_seconds(module) -> float:
    devices = jax.devices("cpu")[:8]
    start = time.perf_counter()
    compile_module(module, 8, devices)
    return time.perf_counter() - start


def pass_cost(layers_list: list[int], repeats: int = 3, model: str = "sequence_parallel") -> dict:
    """Per L: lower, compile and pass time of ``model`` (MODELS)."""
    out = {"model": model, "per_layers": [], "repeats": repeats}
    for layers in layers_list:
        samples = []
        for _ in range(repeats):  # each a cold start: fresh functions, jax's caches cleared
            jax.clear_caches()
            fn, args = MODELS[model](layers)
            t0 = time.perf_counter()
            lowered = fn.lower(*args)
            t1 = time.perf_counter()
            lowered.compile()
            t2 = time.perf_counter()
            text = lowered.as_text()
            t3 = time.perf_counter()
            result = cmatmul_pass.rewrite(text)
            t4 = time.perf_counter()
            _ = result.text
            t5 = time.perf_counter()
            ir_utils.parse(text)  # what parsing alone costs (context included), for the split below
            t6 = time.perf_counter()
            rewrite_lowered(lowered, JIT_OPTIONS, "bench")  # the pass as cmatmul_pass.jit runs it: no text
            t7 = time.perf_counter()
            _ = cmatmul_pass.rewrite(text, SPLIT_PSUMS).text  # the text's, every psum split (no tie to chunk)
            t8 = time.perf_counter()
            samples.append((t1 - t0, t2 - t1, t5 - t3, (t6 - t5) + (t5 - t4), t7 - t6, t8 - t7))
        lower_s, compile_s, pass_s, parse_print_s, jit_pass_s, split_psums_s = (
            statistics.median(s[i] for s in samples) for i in range(6))
        shared = [s.shared_ring for s in result.report.rewritten if s.shared_ring]
        row = {
            "layers": layers,
            "sites": len(result.report.sites),
            "rewritten": len(result.report.rewritten),
            "kinds": dict(sorted(Counter(site.kind for site in result.report.rewritten).items())),
            # sites calling a shared ring function, and how many such functions (cmatmul_pass.sharing)
            "shared": len(shared),
            "ring_functions": len(set(shared)),
            "lower_s": lower_s,
            "compile_s": compile_s,
            "pass_s": pass_s,
            # of which parsing the text and printing the result (the rest: matching, rewriting, verifying)
            "parse_print_s": parse_print_s,
        }
        row["pass_over_lower_compile"] = row["pass_s"] / (row["lower_s"] + row["compile_s"])
        row["parse_print_over_lower_compile"] = parse_print_s / (row["lower_s"] + row["compile_s"])
        # the pass as cmatmul_pass.jit runs it (on a clone of jax's module: no text parsed or printed)
        row["jit_pass_s"] = jit_pass_s
        row["jit_pass_over_lower_compile"] = jit_pass_s / (row["lower_s"] + row["compile_s"])
        # the pass on the text with every psum split (where the default's auto chunks a tie: cost.TIE)
        row["pass_split_psums_s"] = split_psums_s
        out["per_layers"].append(row)
        print(f"  L={layers:>2}: {row['sites']} sites ({row['shared']} calling {row['ring_functions']} shared rings), lower {row['lower_s']:.2f} s, compile {row['compile_s']:.2f} s, "
              f"pass {row['pass_s']:.3f} s ({100 * row['pass_over_lower_compile']:.2f} %; parse + print "
              f"{100 * row['parse_print_over_lower_compile']:.2f} %); as cmatmul_pass.jit runs it {row['jit_pass_s']:.3f} s "
              f"({100 * row['jit_pass_over_lower_compile']:.2f} %); on the text with every psum split "
              f"{row['pass_split_psums_s']:.3f} s", flush=True)
    times = {r["layers"]: r["pass_s"] for r in out["per_layers"]}
    if 32 in times and 8 in times:
        out["scaling_32_over_8"] = times[32] / times[8]
    elif 16 in times and 4 in times:
        out["scaling_16_over_4"] = times[16] / times[4]
    return out


# ---------------------------------------------------------------------------- 1b. compile time
#: the models' shape for the compile-time comparison (a 7B-class layer over 16384 tokens, bf16):
#: XLA's compile time hardly depends on the sizes, but the default's choices do, and at the
#: pass-cost models' CPU sizes the cost model predicts no ring paying on a GPU
COMPILE_SHAPE = {"hidden": 4096, "ffn": 16384, "tokens": 16384}
#: the profile the default (policy auto) decides on, as the CLI's default ``--hardware``
COMPILE_HARDWARE = "h100"


def _step_text(model: str, layers: int, hand_written: bool = False) -> str:
    fn, args = MODELS[model](layers, **COMPILE_SHAPE, dtype=jnp.bfloat16,
                             **({"hand_written": True} if hand_written else {}))
    return fn.lower(*args).as_text()


def compile_time(layers_list: list[int], repeats: int = 3) -> dict:
    """Per L and model (at :data:`COMPILE_SHAPE`): XLA's CPU compile time of the original step
    and, over it, of the pass's output with the default options (policy auto on
    :data:`COMPILE_HARDWARE`'s profile; with the sites it rewrote), with every site rewritten
    (policy all) and, for the sequence-parallel step, in each variant and with the rings written
    by hand.  Medians of ``repeats`` rounds, the programs of one L and model interleaved."""
    devices = jax.devices("cpu")[:8]
    out = {"shape": {**COMPILE_SHAPE, "dtype": "bf16"}, "hardware": COMPILE_HARDWARE, "repeats": repeats,
           "by_layers": {}}
    for layers in layers_list:
        row = out["by_layers"][str(layers)] = {}
        for model in MODELS:
            text = _step_text(model, layers)
            default = cmatmul_pass.rewrite(text, Options(policy="auto", hardware=COMPILE_HARDWARE))
            every = cmatmul_pass.rewrite(text, Options(policy="all", hardware=COMPILE_HARDWARE))
            modules = {"original": ir_utils.parse(text), "default": default.module, "every site": every.module}
            if model == "sequence_parallel":
                modules.update((name, cmatmul_pass.rewrite(text, options).module) for name, options in VARIANTS.items())
                modules["hand_written_rings"] = ir_utils.parse(_step_text(model, layers, hand_written=True))
            compile_module(modules["original"], 8, devices)  # XLA's own start, paid once
            medians = interleaved_medians(
                {name: (lambda m=m: compile_module(m, 8, devices)) for name, m in modules.items()}, repeats, warmup=0)
            base = medians.pop("original")
            row[model] = {"original_s": base, "ratios": {name: t / base for name, t in medians.items()},
                          "default_sites": [len(default.report.rewritten), len(default.report.sites)],
                          # the compile budget's prediction (compile_budget.compile_ratio), beside the measured
                          "predicted": {"default": default.report.compile["predicted_ratio"],
                                        "every site": every.report.compile["predicted_ratio"]}}
            print(f"  compile at L={layers}, {model}: original {base:.2f} s; rewritten / original: "
                  + ", ".join(f"{k} {v:.2f}" for k, v in row[model]["ratios"].items())
                  + " (the default rewrote {} of {} sites)".format(*row[model]["default_sites"]), flush=True)
    return out


# ---------------------------------------------------------------------------- 2. CPU run time
def samples_runtime(runs: int, only: list[str] | None = None) -> dict:
    results = {}
    for path in sample_paths(ROOT):
        text = path.read_text()
        if expectation(text)[0] != "rewritten" or "legacy" in path.stem or (only and path.stem not in only):
            continue
        original = ir_utils.parse(text)
        n = ir_utils.int_attr(original.operation, "mhlo.num_partitions")
        devices = jax.devices("cpu")[:n]
        inputs = execute.random_inputs(original, 0)
        programs = {"original": execute.Program(original, inputs, devices)}
        for name, options in VARIANTS.items():
            programs[name] = execute.Program(cmatmul_pass.rewrite(text, options).module, inputs, devices)
        seconds = interleaved_medians(programs, runs)
        results[path.stem] = {name: seconds[name] / seconds["original"] for name in VARIANTS}
        row = results[path.stem]
        print(f"  {path.stem:<32} " + " ".join(f"{k} {v:.2f}" for k, v in row.items()), flush=True)
    return results


def layer_runtime(runs: int, rows: int = 1024, hidden: int = 512, out: int = 1024) -> dict:
    mesh = jax.make_mesh((8,), ("model",))
    specs = dict(in_specs=(P("model", None), P(None, "model")), out_specs=P(None, "model"), check_vma=False)
    plain = jax.shard_map(lambda x, w: jax.lax.all_gather(x, "model", axis=0, tiled=True) @ w, mesh=mesh, **specs)
    ring = jax.shard_map(hand_written_ring(mesh, "model"), mesh=mesh, **specs)
    rng = np.random.default_rng(0)
    x = jax.device_put(rng.normal(size=(rows, hidden)).astype(np.float32), NamedSharding(mesh, P("model", None)))
    w = jax.device_put(rng.normal(size=(hidden, out)).astype(np.float32), NamedSharding(mesh, P(None, "model")))

    def timed(fn):
        return lambda: fn(x, w).block_until_ready()

    programs = {"plain": timed(jax.jit(plain)), "hand_written": timed(jax.jit(ring))}
    for name, options in VARIANTS.items():
        programs[name] = timed(cmatmul_pass.jit(plain, bidirectional=options.bidirectional, unroll=options.unroll))
    seconds = interleaved_medians(programs, runs)
    base, hand = seconds["plain"], seconds["hand_written"]
    result = {"shape": [rows, hidden, out], "plain_s": base, "hand_written_ring_over_plain": hand / base,
              "timing": "interleaved", "variants": {}}
    for name in VARIANTS:
        t = seconds[name]
        result["variants"][name] = {"over_plain": t / base, "over_hand_written": t / hand}
    print(f"  layer {rows}x{hidden}x{out}: hand-written ring / plain {hand / base:.2f}; "
          + ", ".join(f"{k} {v['over_plain']:.2f} (vs ring {v['over_hand_written']:.2f})" for k, v in result["variants"].items()),
          flush=True)
    return result


def megatron_runtime(runs: int, rows: int = 1024, hidden: int = 512, ffn: int = 1024) -> dict:
    """Two pre-norm Megatron MLP blocks (psum after the row-parallel matmul, rows replicated over
    the 8 devices): the original against "split" in each variant (the first psum's rows carried
    through the residual add and the norm into the second block's gather ring, the output gathered
    once) and "chunk" with 2, 4 and 8 chunks, and what cmatmul_pass.jit makes of the blocks on this
    machine ("default", which strategy and variant each psum got: ``default_sites``, and the named
    strategy whose module it is: ``default_is``); rewritten / original, interleaved medians."""
    mesh = jax.make_mesh((8,), ("model",))
    col, row = P(None, "model"), P("model", None)

    def stack(x, w1a, w2a, w1b, w2b):
        def norm(h):
            return h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6)

        h = x + jax.lax.psum(jax.nn.gelu(norm(x) @ w1a) @ w2a, "model")
        return h + jax.lax.psum(jax.nn.gelu(norm(h) @ w1b) @ w2b, "model")

    f = jax.shard_map(stack, mesh=mesh, in_specs=(P(), col, row, col, row), out_specs=P())
    shapes = [(rows, hidden), (hidden, ffn), (ffn, hidden), (hidden, ffn), (ffn, hidden)]
    structs = [jax.ShapeDtypeStruct(s, jnp.float32, sharding=NamedSharding(mesh, sp))
               for s, sp in zip(shapes, (P(), col, row, col, row))]
    text = jax.jit(f).lower(*structs).as_text()
    original = ir_utils.parse(text)
    devices = jax.devices("cpu")[:8]
    inputs = execute.random_inputs(original, 0)
    strategies = {f"split-{name}": variant_options(name, all_reduce="split") for name in ("uni", "unroll2", "full", "bidi")}
    strategies.update({f"chunk-{k}": cmatmul_pass.Options(all_reduce="chunk", chunks=k) for k in (2, 4, 8)})
    programs = {"original": execute.Program(original, inputs, devices)}
    texts = {}  # each strategy's module as text, for default_is below
    for name, options in strategies.items():
        rewritten = cmatmul_pass.rewrite(text, options)
        texts[name] = rewritten.text
        programs[name] = execute.Program(rewritten.module, inputs, devices)
    # what a user gets: cmatmul_pass.jit's module on this machine (each lowering runs the pass)
    default = cmatmul_pass.jit(f)
    default_text = default.lower(*structs).as_text()
    programs["default"] = execute.Program(ir_utils.parse(default_text), inputs, devices)
    seconds = interleaved_medians(programs, runs)
    result = {"shape": {"rows": rows, "hidden": hidden, "ffn": ffn, "blocks": 2}, "original_s": seconds["original"],
              "over_original": {name: seconds[name] / seconds["original"] for name in [*strategies, "default"]},
              "default_is": next((name for name in strategies if default_text == texts[name]), None),
              # each psum site as the default left it: its strategy and ring variant
              "default_sites": sorted({(site.all_reduce["strategy"], (site.schedule or {}).get("variant"))
                                       for site in default.report.sites if site.all_reduce})}
    print(f"  Megatron 2 blocks {rows}x{hidden}x{ffn}: "
          + ", ".join(f"{k} {v:.2f}" for k, v in result["over_original"].items()), flush=True)
    return result


# ---------------------------------------------------------------------------- 2b. against a ring by hand
#: (kind, rows, hidden, out) of the layers ``ring_runtime`` times: the column-parallel layer
#: (all_gather of row-sharded x, then x @ w) and the row-parallel one (x @ w, then psum_scatter)
RING_SHAPES = (("column", 512, 512, 512), ("column", 1024, 512, 1024), ("column", 2048, 1024, 1024),
               ("row", 512, 512, 512), ("row", 1024, 1024, 512), ("row", 2048, 1024, 1024),
               # 16 MiB of partial sums per device: the CPU default's scatter loops (cost.fallback_variant)
               ("row", 4096, 1024, 1024))


def ring_runtime(runs: int, shapes=RING_SHAPES) -> list[dict]:
    """Column- and row-parallel layers on the 8 CPU devices at ``shapes``: the pass's default
    (``cmatmul_pass.jit(f)``, no options) and every named variant, each over a ring written by hand
    with ``ppermute`` (the JAX docs' technique) and over the plain collective; interleaved medians
    of ``runs`` (the target: the default at most 1.0x the hand-written ring at every shape).  Where
    the default's module is a named variant's (``default_is``), that one program is timed once
    (the default's, through ``cmatmul_pass.jit``).  Each shape's default, its own executable
    called as jax's ``Compiled`` (``default_program``: the same executable, without
    cmatmul_pass.jit's dispatch) and the A/A control get a 95 % interval of their per-round
    ratio to the hand-written ring (``execute.ratio_interval``) and a verdict: faster, level
    (the interval holds 1.0) or slower."""
    mesh = jax.make_mesh((8,), ("model",))
    rng = np.random.default_rng(0)
    rows_out = []
    for kind, rows, hidden, out in shapes:
        if kind == "column":
            specs = dict(in_specs=(P("model", None), P(None, "model")), out_specs=P(None, "model"), check_vma=False)
            plain_fn = lambda x, w: jax.lax.all_gather(x, "model", axis=0, tiled=True) @ w  # noqa: E731
            by_hand = hand_written_ring(mesh, "model")
            x_spec, w_spec = P("model", None), P(None, "model")
        else:
            specs = dict(in_specs=(P(None, "model"), P("model", None)), out_specs=P("model", None), check_vma=False)
            plain_fn = lambda x, w: jax.lax.psum_scatter(x @ w, "model", scatter_dimension=0, tiled=True)  # noqa: E731
            by_hand = hand_written_scatter(mesh, "model")
            x_spec, w_spec = P(None, "model"), P("model", None)
        plain = jax.shard_map(plain_fn, mesh=mesh, **specs)
        x = jax.device_put(rng.normal(size=(rows, hidden)).astype(np.float32), NamedSharding(mesh, x_spec))
        w = jax.device_put(rng.normal(size=(hidden, out)).astype(np.float32), NamedSharding(mesh, w_spec))

        def timed(fn):
            return lambda: fn(x, w).block_until_ready()

        plain_jit, hand_jit, default = jax.jit(plain), jax.jit(jax.shard_map(by_hand, mesh=mesh, **specs)), cmatmul_pass.jit(plain)
        expected = np.asarray(plain_jit(x, w))
        for fn in (hand_jit, default):  # the programs compared compute the same thing
            np.testing.assert_allclose(np.asarray(fn(x, w)), expected, rtol=1e-4, atol=1e-3 * np.abs(expected).max())
        # an A/A control: the hand-written ring jitted again, timed as if it were another program; its
        # ratio to the first is this run's noise floor for a program level with the hand-written one
        again = jax.jit(jax.shard_map(by_hand, mesh=mesh, **specs))
        programs = {"plain": timed(plain_jit), "hand_written": timed(hand_jit), "hand_written_again": timed(again)}
        default_text = default.lower(x, w).as_text()  # (each lowering runs the pass)
        programs["default"] = timed(default)
        same = None  # the variant whose module is the default's: the default's program stands for it
        for name in VARIANTS:
            variant = cmatmul_pass.jit(plain, variant=name)
            if same is None and variant.lower(x, w).as_text() == default_text:
                same = name
            else:
                programs[name] = timed(variant)
        # the default's own executable (the one its calls run) as jax's ``Compiled`` calls it:
        # the program apart from cmatmul_pass.jit's dispatch
        (own,) = default._cache.values()
        programs["default_program"] = timed(own.compiled)
        samples = interleaved_samples(programs, runs)
        if same is not None:
            samples[same] = samples["default"]
        seconds = {name: statistics.median(times) for name, times in samples.items()}
        hand = seconds["hand_written"]
        # 95 % intervals of the default's per-round ratio to the hand-written ring and of the A/A
        # control's (rounds resampled): a ratio whose interval holds 1.0 is level with it in this run
        paired = {name: (paired_ratio(samples[name], samples["hand_written"]),
                         ratio_interval(samples[name], samples["hand_written"]))
                  for name in ("default", "default_program", "hand_written_again")}
        picked = sorted({site.schedule["variant"] for site in default.report.rewritten})
        row = {"kind": kind, "shape": [rows, hidden, out], "runs": runs, "hand_written_s": hand,
               "default_variant": picked, "default_is": same, "hand_written_over_plain": hand / seconds["plain"],
               "hand_written_again": seconds["hand_written_again"] / hand,
               "over_hand_written": {name: seconds[name] / hand for name in ["default", *VARIANTS]},
               # the median of the per-round ratios, its interval and what that says
               **{f"{name}_paired": ratio for name, (ratio, _) in paired.items()},
               **{f"{name}_interval": list(ci) for name, (_, ci) in paired.items()},
               **{f"{name}_verdict": _verdict(ci) for name, (_, ci) in paired.items()}}
        rows_out.append(row)
        print(f"  {kind}-parallel {rows}x{hidden}x{out}: over the hand-written ring: default ({'/'.join(picked)}) "
              f"{row['over_hand_written']['default']:.3f} (per round {_paired(row, 'default')}; its program "
              f"alone {_paired(row, 'default_program')}); "
              + ", ".join(f"{k} {v:.3f}" for k, v in row["over_hand_written"].items() if k != "default")
              + f"; the ring / plain {row['hand_written_over_plain']:.2f}; the same ring timed again "
              f"(noise) {row['hand_written_again']:.3f} (per round {_paired(row, 'hand_written_again')})", flush=True)
    return rows_out


#: a call's argument leaves in the dispatch benchmark: one array, a small model's parameters, a large one's
DISPATCH_LEAVES = (1, 64, 1024)
#: calls per timed round of the dispatch benchmark (one call takes microseconds)
DISPATCH_CALLS = 20


def dispatch_runtime(runs: int, leaves=DISPATCH_LEAVES, calls: int = DISPATCH_CALLS) -> list[dict]:
    """What a call of ``cmatmul_pass.jit`` costs against ``jax.jit``'s of the same function, by
    the number of argument leaves: a pytree of ``n`` small arrays, of which the function doubles
    one (so the time is dispatch, not compute).  Beside them, a dispatch done in Python (the
    arguments' signature computed in Python and looked up, then the executable called as jax's
    ``Compiled``), rebuilt from the decorator's pieces: what the C++ dispatcher saves.  Per program,
    microseconds per call: interleaved medians of ``runs`` rounds of ``calls`` calls, and the
    per-round ratio to ``jax.jit`` with its 95 % interval."""
    rows = []
    for n in leaves:
        tree = {f"w{i:04d}": jnp.full((8,), float(i), jnp.float32) for i in range(n)}
        fun = lambda t: t["w0000"] * 2.0  # noqa: E731
        plain, ours = jax.jit(fun), cmatmul_pass.jit(fun)
        np.testing.assert_array_equal(np.asarray(plain(tree)), np.asarray(ours(tree)))
        assert len(ours._cache) == 1  # one signature compiled: python_dispatch below finds it

        def python_dispatch():  # the decorator's call before it went through jax's C++ dispatcher
            key, dynamic_args, dynamic_kwargs = ours._key((tree,), {})
            return ours._cache[key].compiled(*dynamic_args, **dynamic_kwargs)

        np.testing.assert_array_equal(np.asarray(python_dispatch()), np.asarray(plain(tree)))

        def repeated(call):
            def run():
                for _ in range(calls - 1):
                    call()
                call().block_until_ready()
            return run

        programs = {"jax_jit": repeated(lambda: plain(tree)), "cmatmul_pass_jit": repeated(lambda: ours(tree)),
                    "python_dispatch": repeated(python_dispatch)}
        samples = interleaved_samples(programs, runs)
        row = {"leaves": n, "runs": runs, "calls_per_round": calls,
               "us_per_call": {name: 1e6 * statistics.median(times) / calls for name, times in samples.items()},
               "misses": ours.stats["misses"]}
        for name in ("cmatmul_pass_jit", "python_dispatch"):
            row[f"{name}_over_jax_jit"] = paired_ratio(samples[name], samples["jax_jit"])
            row[f"{name}_interval"] = list(ratio_interval(samples[name], samples["jax_jit"]))
        rows.append(row)
        us = row["us_per_call"]
        print(f"  {n:>5} leaves: jax.jit {us['jax_jit']:.1f} us a call, cmatmul_pass.jit {us['cmatmul_pass_jit']:.1f} "
              f"(per round {row['cmatmul_pass_jit_over_jax_jit']:.3f} of jax.jit), the Python dispatch it replaced "
              f"{us['python_dispatch']:.1f} ({row['python_dispatch_over_jax_jit']:.2f})", flush=True)
    return rows


def _paired(row: dict, name: str) -> str:
    low, high = row[f"{name}_interval"]
    return f"{row[f'{name}_paired']:.3f} [{low:.3f}, {high:.3f}]: {row[f'{name}_verdict']}"


def _verdict(interval: tuple[float, float]) -> str:
    """What a 95 % interval of a time ratio over the hand-written ring's says."""
    low, high = interval
    return "faster" if high < 1.0 else "slower" if low > 1.0 else "level"


def profile_pass(layers: int, model: str = "sequence_parallel", out: Path | None = None) -> Path:
    """cProfile of the pass as ``cmatmul_pass.jit`` runs it (a clone of jax's module, nothing
    parsed or printed) on ``model`` at ``layers`` layers, after one warm-up run: where its time
    goes, by cumulative and by own time (the profiler's overhead inflates the Python-heavy
    functions; the totals are :func:`pass_cost`'s). Written as text to ``out``."""
    import cProfile
    import io
    import pstats

    fn, args = MODELS[model](layers)
    lowered = fn.lower(*args)
    rewrite_lowered(lowered, JIT_OPTIONS, "bench")
    profiler = cProfile.Profile()
    profiler.enable()
    rewrite_lowered(lowered, JIT_OPTIONS, "bench")
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text).strip_dirs()
    text.write(f"# the pass on the {model} model at L = {layers}, as cmatmul_pass.jit runs it; jax {jax.__version__}\n")
    stats.sort_stats("cumulative").print_stats(40)
    stats.sort_stats("tottime").print_stats(30)
    out = out or SCRATCH / f"profile_{model}_L{layers}.txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text.getvalue())
    print(f"wrote {out}", flush=True)
    return out


#: what :func:`warm_pass_cost` times apart, each the functions (module, name) the pipeline calls for it
WARM_PHASES = {
    "building rings": [("sites", "rewrite_dot_reduce_scatter"), ("sites", "rewrite_all_gather_dot")],
    "matching": [("phases", "match_all_gather"), ("phases", "match_reduce_scatter"),
                 ("phases", "match_all_reduce")],
    # the walk for the sites with the grouping of identical regions, and the replay of the groups
    "walking and replaying": [("replay", "walk"), ("replay.Plan", "finish")],
}


def warm_pass_cost(layers_list: list[int], runs: int = 15, model: str = "sequence_parallel") -> dict:
    """The pass warm, in one process (medians of ``runs`` after two warm-up runs), at each L: on
    the text (parse, rewrite, print) and as ``cmatmul_pass.jit`` runs it, and the latter's share
    spent in each of :data:`WARM_PHASES` (timed around each call).  Where :func:`pass_cost`'s cold
    figures spend their time, without XLA's compile between runs; what docs/performance.md's
    "Where the fixed cost goes" quotes."""
    from contextlib import ExitStack
    from unittest import mock

    from cmatmul_pass import phases, replay, sites

    owners = {"phases": phases, "sites": sites, "replay": replay, "replay.Plan": replay.Plan}
    spent = dict.fromkeys(WARM_PHASES, 0.0)

    def timed(fn, phase):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[phase] += time.perf_counter() - start
        return run

    rows = []
    for layers in layers_list:
        fn, args = MODELS[model](layers)
        lowered = fn.lower(*args)
        text = lowered.as_text()
        jit_s, text_s, shares = [], [], {phase: [] for phase in WARM_PHASES}
        with ExitStack() as patches:
            for phase, names in WARM_PHASES.items():
                for owner, name in names:
                    target = owners[owner]
                    patches.enter_context(mock.patch.object(target, name, timed(getattr(target, name), phase)))
            for i in range(runs + 2):
                spent.update(dict.fromkeys(spent, 0.0))
                t0 = time.perf_counter()
                rewrite_lowered(lowered, JIT_OPTIONS, "bench")
                t1 = time.perf_counter()
                phases = dict(spent)
                _ = cmatmul_pass.rewrite(text).text
                t2 = time.perf_counter()
                if i >= 2:
                    jit_s.append(t1 - t0)
                    text_s.append(t2 - t1)
                    for phase, seconds in phases.items():
                        shares[phase].append(seconds / (t1 - t0))
        row = {"layers": layers, "jit_pass_s": statistics.median(jit_s), "pass_s": statistics.median(text_s),
               "shares": {phase: statistics.median(v) for phase, v in shares.items()}}
        rows.append(row)
        print(f"  L={layers:>2}: warm, as cmatmul_pass.jit runs it {1e3 * row['jit_pass_s']:.1f} ms ("
              + ", ".join(f"{phase} {100 * v:.0f} %" for phase, v in row["shares"].items())
              + f"), on the text {1e3 * row['pass_s']:.1f} ms", flush=True)
    return {"model": model, "runs": runs, "per_layers": rows}
