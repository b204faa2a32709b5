"""cmatmul_pass.jit: a jax.jit drop-in that rewrites, caches per signature, checks itself, trains a
tensor-parallel model to the same losses as jax.jit; and explain's source locations."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax.sharding import NamedSharding, PartitionSpec as P

import cmatmul_pass
from cmatmul_pass.rewrites import all_gather_dot
from conftest import ROOT, run_cli
from tools import train_tp_mlp

MESH = jax.make_mesh((2, 4), ("data", "model"))


def put(array, spec):
    return jax.device_put(np.asarray(array, dtype=np.float32), NamedSharding(MESH, spec))


def column_parallel(x, w):
    return jax.lax.all_gather(x, "model", axis=0, tiled=True) @ w  # SOURCE-LINE


F = jax.shard_map(column_parallel, mesh=MESH, in_specs=(P("model", None), P(None, "model")),
                  out_specs=P(None, "model"), check_vma=False)


def inputs(rows=64, seed=0):
    rng = np.random.default_rng(seed)
    return put(rng.normal(size=(rows, 32)), P("model", None)), put(rng.normal(size=(32, 64)), P(None, "model"))


def test_decorator_forms_and_results():
    x, w = inputs()

    @cmatmul_pass.jit
    def plain(x, w):
        return F(x, w)

    @cmatmul_pass.jit(bidirectional=True, unroll=2, annotate_streams=True)
    def variant(x, w):
        return F(x, w)

    expected = np.asarray(jax.jit(F)(x, w))
    for fn in (plain, variant):
        np.testing.assert_allclose(np.asarray(fn(x, w)), expected, rtol=1e-5, atol=1e-5)
        assert [s.rewritten for s in fn.report.sites] == [True]
    assert variant.report.sites[0].schedule["directions"] == 2
    assert plain.__name__ == "plain"


def test_second_call_with_the_same_signature_does_no_work():
    """Not even in Python: jax's C++ dispatcher runs the executable ("misses" counts the calls
    it sends to the decorator)."""
    g = cmatmul_pass.jit(F)
    x, w = inputs()
    g(x, w)
    assert dict(g.stats) == {"misses": 1, "lowerings": 1, "rewrites": 1, "compiles": 1}
    for seed in range(1, 4):  # same shapes, shardings and dtypes, other values
        np.testing.assert_array_equal(np.asarray(g(*inputs(seed=seed))), np.asarray(jax.jit(F)(*inputs(seed=seed))))
    assert dict(g.stats) == {"misses": 1, "lowerings": 1, "rewrites": 1, "compiles": 1}
    g(*inputs(rows=128))  # a new signature
    assert dict(g.stats) == {"misses": 2, "lowerings": 2, "rewrites": 2, "compiles": 2}
    g(x, w)  # the first signature again: still the dispatcher's
    assert g.stats["misses"] == 2


def _argument_kinds():
    """Arguments jax.jit specialises on differently: dtypes, shapes, weak types, shardings, NumPy
    arrays and Python scalars (built once: a draw picks among them by index)."""
    sharded = NamedSharding(jax.make_mesh((8,), ("x",)), P("x"))
    first = [jnp.ones(8), jnp.ones(8, jnp.int32), jnp.ones(16), jax.device_put(jnp.ones(8), sharded),
             np.ones(8, np.float32), jnp.ones((2, 8))]
    second = [2.0, 3, jnp.float32(2), jnp.asarray(2.0), np.float32(2), jnp.int32(2)]
    return first, second


@settings(max_examples=12, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5), st.booleans()), min_size=1, max_size=8))
def test_any_sequence_of_calls_is_dispatched_as_jax_jit_would(calls):
    """A random sequence of calls (argument kinds, a static flag): every output is jax.jit's, and
    the same sequence called again runs wholly in jax's C++ dispatcher (no miss, no compile)."""
    first, second = _argument_kinds()
    fun = lambda a, b, double: a * b * (2 if double else 1)  # noqa: E731
    ours, theirs = cmatmul_pass.jit(fun, static_argnames="double"), jax.jit(fun, static_argnames="double")

    def run_all():
        for i, j, double in calls:
            got, want = ours(first[i], second[j], double=double), theirs(first[i], second[j], double=double)
            assert got.dtype == want.dtype and got.shape == want.shape
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

    run_all()
    misses, compiles = ours.stats["misses"], ours.stats["compiles"]
    # each kind is its own signature to jax.jit (the kinds above): one compile per distinct call
    assert compiles == len(set(calls)) <= misses <= len(calls)
    run_all()
    assert (ours.stats["misses"], ours.stats["compiles"]) == (misses, compiles)


def test_a_call_under_another_jax_configuration_is_another_program():
    """jax.jit specialises on its configuration (x64, the default matmul precision): so does
    cmatmul_pass.jit, and each program's outputs are jax.jit's (a Python float is f64 under x64)."""
    fun = lambda x: jnp.asarray(x) * 2  # noqa: E731
    ours, theirs = cmatmul_pass.jit(fun), jax.jit(fun)
    assert ours(1.0).dtype == theirs(1.0).dtype == jnp.float32
    with jax.enable_x64():
        got, want = ours(1.0), theirs(1.0)
        assert got.dtype == want.dtype == jnp.float64 and float(got) == float(want) == 2.0
    assert ours(1.0).dtype == jnp.float32
    assert ours.stats["compiles"] == 2
    a = jnp.ones((4, 4))
    square = cmatmul_pass.jit(lambda a: a @ a)
    square(a)
    with jax.default_matmul_precision("highest"):
        square(a)
    assert square.stats["lowerings"] == 2


def test_clear_cache_and_disable_jit_behave_as_under_jax_jit():
    """``clear_cache()`` forgets the executables (the next call compiles again); under
    ``jax.disable_jit()`` the function runs as Python, nothing lowered or compiled."""
    g = cmatmul_pass.jit(F)
    x, w = inputs()
    expected = np.asarray(jax.jit(F)(x, w))
    g(x, w)
    g.clear_cache()
    np.testing.assert_array_equal(np.asarray(g(x, w)), expected)
    assert (g.stats["misses"], g.stats["compiles"]) == (2, 2)
    g(x, w)
    assert g.stats["misses"] == 2  # the dispatcher has it again
    with jax.disable_jit():
        eager = g(x, w)
    np.testing.assert_allclose(np.asarray(eager), expected, rtol=1e-5, atol=1e-5)
    assert (g.stats["misses"], g.stats["compiles"]) == (2, 2)


def test_calls_under_a_transformation_are_staged_every_time():
    """Tracers never take the dispatcher's fast path: each call under jax.grad goes to the
    decorator and is staged (cmatmul_pass.overlap's rewrite, not the cached executable)."""
    g = cmatmul_pass.jit(F)
    x, w = inputs()
    g(x, w)
    loss = lambda w: jnp.sum(g(x, w) ** 2)  # noqa: E731
    with jax.set_mesh(MESH):
        reference = jax.grad(lambda w: jnp.sum(jax.jit(F)(x, w) ** 2))(w)
        for _ in range(2):
            np.testing.assert_allclose(np.asarray(jax.grad(loss)(w)), np.asarray(reference), rtol=1e-4, atol=1e-4)
    assert g.stats["misses"] == 3 and g.stats["compiles"] == 1
    assert g.overlap.reports and g.overlap.report.rewritten


def test_each_thing_jax_jit_specialises_on_gets_its_own_program():
    """A weak-typed argument, another dtype, another sharding, a NumPy array and a Python
    scalar each compile their own program, as under jax.jit; equal ones reuse it."""
    mesh = jax.make_mesh((8,), ("x",))
    sharded, replicated = NamedSharding(mesh, P("x")), NamedSharding(mesh, P())
    g = cmatmul_pass.jit(lambda a, b: a * b)
    calls = [
        (jax.device_put(jnp.ones(8), sharded), jnp.float32(2)),
        (jax.device_put(jnp.ones(8), sharded), jnp.asarray(2.0, dtype=jnp.float32)),  # same signature
        (jax.device_put(jnp.ones(8), sharded), 2.0),  # a Python float: weak-typed
        (jax.device_put(jnp.ones(8), sharded), jnp.asarray(2.0)),  # weak-typed jax array
        (jax.device_put(jnp.ones(8), replicated), jnp.float32(2)),  # another sharding
        (jax.device_put(jnp.ones(8, jnp.int32), sharded), jnp.int32(2)),  # another dtype
        (np.ones(8, np.float32), np.float32(2)),  # NumPy
    ]
    compiles = []
    for a, b in calls:
        np.testing.assert_array_equal(np.asarray(g(a, b)), np.asarray(jax.jit(lambda a, b: a * b)(a, b)))
        compiles.append(g.stats["compiles"])
    assert compiles == [1, 1, 2, 3, 4, 5, 6]


def test_lower_gives_the_rewritten_text_executable_and_report(tmp_path):
    x, w = inputs()
    lowered = cmatmul_pass.jit(F).lower(x, w)
    text = lowered.as_text()
    assert "stablehlo.all_gather" not in text and "stablehlo.collective_permute" in text
    assert "stablehlo.all_gather" in lowered.original.as_text()
    optimized = lowered.compile().as_text()
    assert optimized.startswith("HloModule") and "collective-permute" in optimized and "all-gather" not in optimized
    # the same report as the CLI's --report-json for the same program (locations aside)
    src = tmp_path / "f.mlir"
    src.write_text(jax.jit(F).lower(x, w).as_text())
    # the decorator's hardware is this machine's by default: `--hardware auto` on the CLI
    assert run_cli("rewrite", src, "-o", tmp_path / "o.mlir", "--report-json", tmp_path / "r.json", "-q",
                   "--hardware", "auto") == 0
    cli_sites = json.loads((tmp_path / "r.json").read_text())["sites"]

    def strip(site):
        site = dict(site, location=None)
        site["consumers"] = [dict(c, location=None) for c in site["consumers"]]
        return site

    assert [strip(s) for s in lowered.report.to_dict()["sites"]] == [strip(s) for s in cli_sites]


def test_jax_cached_lowering_is_never_mutated():
    x, w = inputs()
    cmatmul_pass.jit(F)(x, w)
    assert "stablehlo.all_gather" in jax.jit(F).lower(x, w).as_text()
    assert "all-gather" in jax.jit(F).lower(x, w).compile().as_text()


def test_check_passes_and_catches_a_wrong_rewrite(monkeypatch):
    x, w = inputs()
    checked = cmatmul_pass.jit(F, check=True)
    checked(x, w)
    assert checked.stats["checks"] == 1
    checked(x, w)
    assert checked.stats["checks"] == 1  # only on the first call of a signature
    monkeypatch.setattr(all_gather_dot, "RECEIVE_FROM_NEXT", +1)
    broken = cmatmul_pass.jit(F, check=True)
    with pytest.raises(cmatmul_pass.NumericsMismatch, match=r"all_gather_dot at .*test_jit.py:\d+"):
        broken(x, w)


def test_check_compiles_without_excess_precision():
    """bf16 rows scaled by 3 before a small f32-accumulating dot: compiled as jax.jit does, the
    ring's output is a bf16 rounding (2e-3) away from the original's, which check=True used
    to report as a mismatch.  It compares both compiled without excess precision, and the
    caller still gets the program compiled as jax.jit would."""

    def scaled(x, w):
        g = jax.lax.all_gather(x, "model", axis=0, tiled=True) * jnp.bfloat16(3)
        return jnp.dot(g, w, preferred_element_type=jnp.float32)

    f = jax.shard_map(scaled, mesh=MESH, in_specs=(P("model", None), P()), out_specs=P(), check_vma=False)
    rng = np.random.default_rng(0)
    x = jax.device_put(rng.normal(size=(24, 4)).astype(jnp.bfloat16), NamedSharding(MESH, P("model", None)))
    w = jax.device_put(rng.normal(size=(4, 2)).astype(jnp.bfloat16), NamedSharding(MESH, P()))
    checked = cmatmul_pass.jit(f, check=True)
    out = checked(x, w)
    assert checked.stats["checks"] == 1 and checked.report.rewritten
    np.testing.assert_array_equal(np.asarray(out), np.asarray(checked.lower(x, w).compile()(x, w)))


def test_value_and_grad_pytrees_statics_and_donation():
    def loss(params, batch, scale):
        y = F(batch["x"], params["w"])
        return scale * jnp.mean(y**2), {"max": jnp.max(y)}

    grad_fn = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
    step = cmatmul_pass.jit(grad_fn, static_argnums=2, donate_argnums=1)
    reference = jax.jit(grad_fn, static_argnums=2)
    x, w = inputs()
    (value, aux), grads = reference({"w": w}, {"x": x.copy()}, 2.0)
    batch = {"x": x.copy()}
    (value2, aux2), grads2 = step({"w": w}, batch, 2.0)
    assert batch["x"].is_deleted()  # donated, as jax.jit would
    np.testing.assert_allclose(float(value2), float(value), rtol=1e-5)
    np.testing.assert_allclose(float(aux2["max"]), float(aux["max"]), rtol=1e-5)
    for got, want in zip(jax.tree.leaves(grads2), jax.tree.leaves(grads)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)
    # the forward gather (also assembling its value for the weight gradient), the backward scatter and
    # the weight gradient's data-parallel psum, split; the input gradient's psum sums no dot
    assert sorted((s.kind, s.rewritten) for s in step.report.sites) == [
        ("all_gather_dot", True), ("dot_all_reduce", False), ("dot_all_reduce", True), ("dot_reduce_scatter", True)]
    assert [s.reason_code for s in step.report.declined] == ["producer_not_dot"]
    step({"w": w}, {"x": x.copy()}, 3.0)  # another static value: a new signature
    assert step.stats["compiles"] == 2


def test_static_argnames():
    g = cmatmul_pass.jit(lambda x, w, *, power: F(x, w) ** power, static_argnames="power")
    x, w = inputs()
    np.testing.assert_allclose(np.asarray(g(x, w, power=2)), np.asarray(jax.jit(F)(x, w)) ** 2, rtol=1e-4, atol=1e-5)
    g(x, w, power=2)
    assert g.stats["compiles"] == 1


@pytest.mark.parametrize("variant", [{}, {"bidirectional": True, "unroll": 2}, {"variant": "auto"}],
                         ids=["uni", "bidi-unroll2", "auto"])
def test_training_parity_with_jax_jit(variant):
    """The founding notebook's experiment: 15 AdamW steps of a TP classifier with SP blocks, twice."""
    steps = 15
    base, base_acc, _ = train_tp_mlp.train(jax.jit, steps)
    mine, mine_acc, step = train_tp_mlp.train(lambda f, **kw: cmatmul_pass.jit(f, **variant, **kw), steps)
    np.testing.assert_allclose(mine, base, rtol=1e-5)
    assert base[-1] < 0.5 * base[0]  # it does learn
    assert mine_acc == base_acc
    kinds = sorted(s.kind for s in step.report.sites)
    # 2 blocks x (forward + backward), and each block's two weight gradients psummed over 'data'
    assert kinds == ["all_gather_dot"] * 4 + ["dot_all_reduce"] * 4 + ["dot_reduce_scatter"] * 4
    assert all(s.rewritten for s in step.report.sites)


def test_explain_names_the_users_source_line(tmp_path, capsys):
    x, w = inputs()
    path = tmp_path / "with_locations.mlir"
    path.write_text(jax.jit(F).lower(x, w).as_text(debug_info=True))
    line = next(i for i, l in enumerate(open(__file__).read().splitlines(), 1) if l.rstrip().endswith("# SOURCE-LINE"))
    assert run_cli("explain", path) == 0
    out = capsys.readouterr().out
    assert f"test_jit.py:{line}:" in out and "[all_gather_dot]" in out and "ring: 4 devices" in out
    assert "B per step" in out and "decision: rewritten" in out


def test_the_training_example_runs(capsys):
    assert train_tp_mlp.main(["--steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "12 of 12 candidate site(s) rewritten" in out and "final accuracy" in out


def test_the_example_lives_in_tools():
    assert (ROOT / "tools" / "train_tp_mlp.py").exists()


def test_the_readme_example_runs():
    """The README's decorator example, run as written."""
    import subprocess
    import sys

    readme = (ROOT / "docs" / "decorator.md").read_text()
    section = readme[readme.index("# `cmatmul_pass.jit`"):]
    code = section[section.index("```python\n") + len("```python\n"):section.index("```\n", section.index("```python"))]
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "1 of 1 candidate site(s) rewritten" in proc.stdout and "stablehlo.collective_permute" in proc.stdout


def test_grad_and_out_shardings_pass_through():
    x, w = inputs()
    replicated = NamedSharding(MESH, P())
    g = cmatmul_pass.jit(jax.grad(lambda w, x: jnp.sum(F(x, w) ** 2)), out_shardings=replicated)
    got = g(w, x)
    want = jax.jit(jax.grad(lambda w, x: jnp.sum(F(x, w) ** 2)))(w, x)
    assert got.sharding.is_equivalent_to(replicated, got.ndim)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
    assert g.report.rewritten


# ------------------------------------------------------------------ XLA options for the rings on a GPU
LHS = "xla_gpu_enable_latency_hiding_scheduler"
OVERLAP = "xla_gpu_experimental_parallel_collective_overlap_limit"


def test_ring_compiler_options_follow_the_platform_the_rings_and_the_user():
    from cmatmul_pass.decorator import ring_compiler_options

    x, w = inputs()
    uni = cmatmul_pass.jit(F).lower(x, w).report
    bidi = cmatmul_pass.jit(F, bidirectional=True).lower(x, w).report
    declined = cmatmul_pass.jit(F, bidirectional=True, min_bytes=1 << 40).lower(x, w).report
    assert ring_compiler_options(uni, "gpu") == {LHS: True}
    assert ring_compiler_options(bidi, "gpu") == {LHS: True, OVERLAP: 2}  # a ring going both ways
    assert ring_compiler_options(bidi, "cpu") == {} and ring_compiler_options(bidi, "tpu") == {}
    assert ring_compiler_options(declined, "gpu") == {}  # no ring, nothing to overlap
    # what the user set, in jax.jit's compiler_options or in XLA_FLAGS, stays theirs
    assert ring_compiler_options(bidi, "gpu", {LHS: False}) == {OVERLAP: 2}
    assert ring_compiler_options(bidi, "gpu", None, f"--xla_dump_to=/tmp --{OVERLAP}=4") == {LHS: True}


def test_lowered_compile_adds_the_ring_options_to_the_callers():
    from cmatmul_pass.decorator import Lowered

    class Recorder:
        def compile(self, compiler_options=None, **kwargs):
            return compiler_options, kwargs

    lowered = Lowered(Recorder(), report=None, original=None, compiler_options={LHS: True, OVERLAP: 2})
    assert lowered.compile() == ({LHS: True, OVERLAP: 2}, {})
    assert lowered.compile({OVERLAP: 3, "xla_dump_to": "x"}, device_assignment=None) == (
        {LHS: True, OVERLAP: 3, "xla_dump_to": "x"}, {"device_assignment": None})
    assert Lowered(Recorder(), None, None).compile() == (None, {})


def test_on_a_gpu_backend_the_decorator_compiles_with_the_ring_options(monkeypatch):
    """With jax reporting a GPU backend (here the programs still run on the CPU devices, whose
    compiler ignores xla_gpu_* options): the options reach the compile, the user's win, the
    results are the plain program's, and gpu_options=False turns it off."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.delenv("XLA_FLAGS", raising=False)  # conftest's device count is read already
    x, w = inputs()
    expected = np.asarray(jax.jit(F)(x, w))
    bidi = cmatmul_pass.jit(F, bidirectional=True, compiler_options={LHS: False})
    assert bidi.lower(x, w).compiler_options == {OVERLAP: 2}
    np.testing.assert_allclose(np.asarray(bidi(x, w)), expected, rtol=1e-5, atol=1e-5)
    assert cmatmul_pass.jit(F).lower(x, w).compiler_options == {LHS: True}
    assert cmatmul_pass.jit(F, gpu_options=False).lower(x, w).compiler_options == {}


# ------------------------------------------------------------------ variant="measure"
def test_measure_times_every_variant_and_keeps_the_fastest():
    from cmatmul_pass import cost

    x, w = inputs()
    g = cmatmul_pass.jit(F, variant="measure", measure_runs=2, check=True)
    # atol as the other comparisons of a rewritten F here: XLA (jax 0.12's CPU dot) may sum a ring's
    # smaller blocks in another order, ~1e-6 off (outputs ~5), which rtol alone rejects where an output
    # cancels to near 0; a wrong ring is O(1) off
    np.testing.assert_allclose(np.asarray(g(x, w)), np.asarray(jax.jit(F)(x, w)), rtol=1e-5, atol=1e-5)
    assert set(g.measured) == {*cost.VARIANTS, "original"} and all(t > 0 for t in g.measured.values())
    assert g.picked == cmatmul_pass.decorator.choose(g.measured, g.measurement.noise)
    kept = [] if g.picked == "original" else [g.picked]  # the fastest variant, or the original (no ring)
    assert [s.schedule["variant"] for s in g.report.rewritten] == kept
    assert (g.stats["lowerings"], g.stats["compiles"], g.stats["measurements"], g.stats["checks"]) == (1, 6, 1, 1)
    g(x, w)  # the same signature: the kept executable, nothing measured again
    assert g.stats["measurements"] == 1 and g.stats["compiles"] == 6
    assert [s.schedule["variant"] for s in g.lower(x, w).report.rewritten] == kept  # what a call runs


@pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")
def test_measure_keeps_what_the_clock_says(monkeypatch):
    """The kept executable is the variant with the least measured time (timings faked here),
    and donated inputs are copied for every timed run."""
    from cmatmul_pass import execute

    seen = []

    def fake(programs, runs, warmup=1, prepare=None):
        for name, run in programs.items():
            given = prepare()
            seen.append(given[0][0])
            run(given)
        return {name: (0.5 if name == "bidi-unroll2" else 1.0) for name in programs}

    monkeypatch.setattr(execute, "interleaved_medians", fake)
    x, w = inputs()
    expected = np.asarray(jax.jit(F)(x, w))
    g = cmatmul_pass.jit(F, variant="measure", donate_argnums=(0,))
    np.testing.assert_allclose(np.asarray(g(x, w)), expected, rtol=1e-5, atol=1e-5)
    assert g.picked == "bidi-unroll2" and g.report.rewritten[0].schedule["variant"] == "bidi-unroll2"
    assert len(seen) == 7 and all(arg is not x for arg in seen)  # each timed run had its own copy of x


def test_measure_skips_a_program_without_rings():
    x, w = inputs()
    g = cmatmul_pass.jit(F, variant="measure", min_bytes=1 << 40)
    np.testing.assert_allclose(np.asarray(g(x, w)), np.asarray(jax.jit(F)(x, w)), rtol=1e-5)
    assert g.report.sites[0].reason_code == "min_bytes"
    assert g.stats["compiles"] == 1 and g.stats["measurements"] == 0 and g.measured is None and g.picked is None


def test_measure_times_the_variants_the_policy_keeps_when_it_declines_the_first(monkeypatch):
    """Under policy="auto" a site the model declines for one variant may pass for another:
    measuring goes on past a first variant that rewrote nothing."""
    from cmatmul_pass import execute

    real = execute.interleaved_medians

    def full_wins(programs, runs, warmup=1, prepare=None):  # the real runs, a clock that favours "full"
        times = real(programs, runs, warmup, prepare)
        return {name: 0.0 if name == "full" else t + 1.0 for name, t in times.items()}

    monkeypatch.setattr(execute, "interleaved_medians", full_wins)
    x, w = inputs()
    slow_trips = "h100:f32=1e9,bandwidth=1e8,split_efficiency=1,loop_trip=2e-4"  # uni declined, full/bidi pass
    g = cmatmul_pass.jit(F, variant="measure", measure_runs=1, policy="auto", hardware=slow_trips)
    np.testing.assert_allclose(np.asarray(g(x, w)), np.asarray(jax.jit(F)(x, w)), rtol=1e-5, atol=1e-5)
    assert g.stats["measurements"] == 1 and set(g.measured) == {*cmatmul_pass.cost.VARIANTS, "original"}
    assert g.picked == "full"
    # the kept program is the pick's: rewritten where the model passes that variant, else left
    (site,) = g.report.sites
    assert site.cost["variant"] == g.picked
    assert site.rewritten == (site.cost["speedup"][g.picked] >= 1.02)


def test_measure_keeps_the_original_where_no_ring_wins():
    """Tiny shapes on CPU: a ring's rounds of permutes cost more than the one all_gather they
    replace, so no variant beats the original by more than its own run-to-run spread."""
    rng = np.random.default_rng(0)
    x, w = put(rng.normal(size=(8, 4)), P("model", None)), put(rng.normal(size=(4, 8)), P(None, "model"))
    g = cmatmul_pass.jit(F, variant="measure", measure_runs=5)
    np.testing.assert_allclose(np.asarray(g(x, w)), np.asarray(jax.jit(F)(x, w)), rtol=1e-5)
    m = g.measurement
    assert g.picked == m.picked == "original" and g.stats["kept_original"] == 1
    assert m.times["original"] - min(t for n, t in m.times.items() if n != "original") <= m.noise
    assert not g.report.rewritten and "kept the original" in m.summary()
    assert "stablehlo.all_gather" in g.lower(x, w).as_text()  # what a call runs: jax's own program
    g(x, w)
    assert g.stats["measurements"] == 1


def test_measure_reports_its_pick_the_times_and_the_noise(monkeypatch):
    """The noise is the spread of the original's own timed runs; a variant is kept only when it
    beats the original's median by more than that (timings faked around the real runs)."""
    from cmatmul_pass import decorator, execute

    real = execute.interleaved_medians
    faster = {"bidi": 0.0}

    def clock(programs, runs, warmup=1, prepare=None):
        times = real(programs, runs, warmup, prepare)
        base = times["original"]
        return {name: base if name == "original" else base - faster.get(name, -1.0) for name in times}

    monkeypatch.setattr(execute, "interleaved_medians", clock)
    x, w = inputs()
    g = cmatmul_pass.jit(F, variant="measure", measure_runs=3)
    g(x, w)
    m = g.measurement
    original_runs = m.runs["original"]
    assert len(original_runs) == 3 and m.noise == max(original_runs) - min(original_runs) > 0
    assert g.picked == "original"  # "bidi" only ties the original
    faster["bidi"] = 1.0  # a second faster than the original: more than any spread of runs
    g = cmatmul_pass.jit(F, variant="measure", measure_runs=3)
    g(x, w)
    m = g.measurement
    assert g.picked == m.picked == "bidi" and g.measured == m.times and m.processes == 1
    assert [s.schedule["variant"] for s in g.report.rewritten] == ["bidi"]
    assert m.summary().startswith("picked bidi: 1 s faster than the original") and "original " in m.summary()
    # each candidate's XLA compile time, the picked one's against the original's
    assert set(m.compile_s) == {*cmatmul_pass.cost.VARIANTS, "original"} and all(t > 0 for t in m.compile_s.values())
    ratio = m.compile_s["bidi"] / m.compile_s["original"]
    assert m.summary().endswith(f"bidi {decorator.duration(m.compile_s['bidi'])} ({ratio:.2f}x)")
    assert decorator.choose({"uni": 0.9, "original": 1.0}, noise=0.2) == "original"
    assert decorator.choose({"uni": 0.9, "bidi": 0.7, "original": 1.0}, noise=0.2) == "bidi"


def test_measure_takes_no_fixed_variant():
    with pytest.raises(ValueError, match="measure"):
        cmatmul_pass.jit(F, variant="measure", unroll=2)
    with pytest.raises(ValueError, match="measure_runs"):
        cmatmul_pass.jit(F, variant="measure", measure_runs=0)
