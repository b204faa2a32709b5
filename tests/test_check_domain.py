"""``check`` on training steps: inputs in the program's domain, and never a mismatch from outputs
the original itself leaves inf/NaN.

Random normal inputs take an Adam step out of its domain (a second moment drawn negative under a
square root) and a classifier's integer labels past its classes (jax gathers NaN there).  The
check then redraws the arguments a simple rule keeps in the domain (cmatmul_pass.domain), says
which, and checks; where no rule does, it could not check (exit 3) and names ``--inputs`` and
``--print-input-spec``.  On given inputs outside the domain a correct rewrite is never a MISMATCH:
a tensor-parallel Adam step whose second moments cancel its squared gradients is inf/NaN in most
of its new weights, and the rewrite (summing the gradients in another order) differs there."""

import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import cmatmul_pass
from cmatmul_pass import domain, execute, ir_utils, numerics
from conftest import run_cli

MESH = jax.make_mesh((8,), ("model",))
HIDDEN, FFN, TOKENS, CLASSES = 32, 128, 64, 4
B1, B2, LR, EPS = 0.9, 0.999, 1e-2, 1e-8


def _spec(shape, spec, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(MESH, spec))


def sp_mlp(x, w1, w2):
    """A sequence-parallel MLP on this device's rows: gather them, matmul, gelu, matmul, scatter."""
    h = jax.nn.gelu(jax.lax.all_gather(x, "model", axis=0, tiled=True) @ w1)
    return jax.lax.psum_scatter(h @ w2, "model", scatter_dimension=0, tiled=True)


def optax_adam_classifier():
    """An optax.adam step of a sequence-parallel MLP classifier (value_and_grad; integer labels
    into softmax cross-entropy), lowered with its argument names: (module text, step, args)."""
    layer = jax.shard_map(sp_mlp, mesh=MESH, in_specs=(P("model"), P(None, "model"), P("model", None)),
                          out_specs=P("model"))
    opt = optax.adam(1e-2)

    def loss(params, x, labels):
        logits = layer(x, params["w1"], params["w2"]) @ params["head"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    def step(params, opt_state, x, labels):
        value, grads = jax.value_and_grad(loss)(params, x, labels)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    params = {"w1": _spec((HIDDEN, FFN), P(None, "model")), "w2": _spec((FFN, HIDDEN), P("model", None)),
              "head": _spec((HIDDEN, CLASSES), P())}
    opt_state = (optax.ScaleByAdamState(count=_spec((), P(), jnp.int32), mu=params, nu=params), optax.EmptyState())
    args = (params, opt_state, _spec((TOKENS, HIDDEN), P("model")), _spec((TOKENS,), P("model"), jnp.int32))
    return jax.jit(step).lower(*args).as_text(debug_info=True)


def tp_adam_step(params, m, v, count, x, y):
    """A hand-written Adam step of a Megatron MLP (a psum of the row-parallel matmul)."""
    layer = jax.shard_map(lambda x, w1, w2: jax.lax.psum(jax.nn.gelu(x @ w1) @ w2, "model"), mesh=MESH,
                          in_specs=(P(), P(None, "model"), P("model", None)), out_specs=P())
    value, g = jax.value_and_grad(lambda p: jnp.mean((layer(x, p["w1"], p["w2"]) - y) ** 2))(params)
    count = count + 1
    m = jax.tree.map(lambda m, g: B1 * m + (1 - B1) * g, m, g)
    v = jax.tree.map(lambda v, g: B2 * v + (1 - B2) * g * g, v, g)
    t = count.astype(jnp.float32)
    new = jax.tree.map(lambda p, m, v: p - LR * (m / (1 - B1 ** t)) / (jnp.sqrt(v / (1 - B2 ** t)) + EPS), params, m, v)
    return new, m, v, count, value


@pytest.fixture(scope="module")
def tp_adam(tmp_path_factory):
    """The TP Adam step's module, and inputs outside its domain: second moments drawn normal
    (``random.npz``), and second moments that cancel the squared gradients, v = -(1-b2)/b2 g²
    (``cancel.npz``): the new second moment is a rounding error of either sign."""
    rng = np.random.default_rng(0)
    put = lambda a, spec: jax.device_put(np.asarray(a, np.float32), NamedSharding(MESH, spec))  # noqa: E731
    params = {"w1": put(rng.normal(size=(HIDDEN, FFN)) * 0.2, P(None, "model")),
              "w2": put(rng.normal(size=(FFN, HIDDEN)) * 0.2, P("model", None))}
    x, y = put(rng.normal(size=(16, HIDDEN)), P()), put(rng.normal(size=(16, HIDDEN)), P())
    zeros = jax.tree.map(jnp.zeros_like, params)
    grads = jax.jit(lambda p: tp_adam_step(p, zeros, zeros, jnp.int32(0), x, y)[1])(params)  # m = (1-b1) g
    g = jax.tree.map(lambda m: m / (1 - B1), grads)
    cancel = jax.tree.map(lambda g: -(1 - B2) * g * g / B2, g)
    normal = jax.tree.map(lambda p: put(rng.normal(size=p.shape), p.sharding.spec), params)
    count = jax.device_put(jnp.int32(3), NamedSharding(MESH, P()))
    root = tmp_path_factory.mktemp("tp_adam")
    path = root / "tp_adam.mlir"
    path.write_text(jax.jit(tp_adam_step).lower(params, zeros, normal, count, x, y).as_text(debug_info=True))
    for name, v in (("random", normal), ("cancel", cancel)):
        leaves = jax.tree.leaves((params, zeros, v, count, x, y))
        np.savez(root / f"{name}.npz", **{f"arg{i}": np.asarray(a) for i, a in enumerate(leaves)})
    return path, root / "random.npz", root / "cancel.npz"


def test_check_passes_an_optax_adam_training_step_with_no_inputs(tmp_path, capsys):
    """Random inputs make the original NaN (second moments drawn negative, labels past the 4
    classes): the check redraws the second moments non-negative and the labels within the
    classes, says so (and in --report-json), and the rewrite checks OK."""
    path = tmp_path / "adam.mlir"
    path.write_text(optax_adam_classifier())
    report = tmp_path / "report.json"
    assert run_cli("check", path, "--policy", "all", "--report-json", report) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "numerics: OK" in out, out
    assert "inputs: random, redrawn after the original was outside its domain on the first draw" in out
    assert "(opt_state[0].nu['head']), " in out and "non-negative (they flow into stablehlo.sqrt at " in out
    assert "(labels) integers in [0, 4) (the indices of stablehlo.gather at " in out
    assert "not checked" not in out and "could not check" not in captured.err
    numerics_report = json.loads(report.read_text())["numerics"]
    assert numerics_report["complete"] and "nu['w1']" in numerics_report["inputs"]
    assert json.loads(report.read_text())["sites"]  # the rewrite's report is there too


def test_a_tensor_parallel_adam_step_is_checked_on_drawn_inputs_and_never_a_mismatch_outside(tp_adam, capsys):
    """No --inputs: the second moments are redrawn non-negative, OK (0).  Given second moments
    drawn normal, or cancelling the squared gradients (where the rewrite's psum split into a
    reduce-scatter ring sums the gradients in another order and differs from the original in
    the elements the original leaves finite but huge): could not check (3), never MISMATCH (1)."""
    path, normal, cancel = tp_adam
    assert run_cli("check", path, "--policy", "all", "-q") == 0
    assert "(v['w1']), arg5 (v['w2']) non-negative (they flow into stablehlo.sqrt" in capsys.readouterr().out
    for inputs in (normal, cancel):
        for strategy in ("chunk", "split"):
            code = run_cli("check", path, "--policy", "all", "-q", "--inputs", inputs, "--all-reduce", strategy)
            captured = capsys.readouterr()
            assert code == 3, captured.out
            assert "MISMATCH" not in captured.out
            assert "output 0 f32[32, 16]: not checked: the original is inf/NaN in " in captured.out
            assert f"could not check: output(s) 0, 1 of the original are outside the program's domain on the " \
                   f"inputs of {inputs}" in captured.err


def test_print_input_spec_lists_the_arguments_and_their_rules(tp_adam, capsys):
    path, _, _ = tp_adam
    assert run_cli("check", path, "--print-input-spec") == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{path}: 9 argument(s); --inputs takes an .npz of arrays arg0 ... arg8 (np.savez(path, " \
                     "arg0=..., ...)) of these global shapes and types:"
    assert out[1].startswith("  arg0: f32[32, 128]  params['w1']  sharding #sdy.sharding<@mesh, [{}, {\"model\"}]>")
    assert out[5].startswith("  arg4: f32[32, 128]  v['w1']") and "drawn non-negative where random inputs" in out[5]
    assert out[7].startswith("  arg6: i32[]  count") and "drawn" not in out[7]


SQRT = """
module @m attributes {mhlo.num_partitions = 1 : i32} {
  func.func public @main(%arg0: tensor<8xf32>, %arg1: tensor<8xf32>) -> (tensor<8xf32>, tensor<8xf32>) {
    %0 = stablehlo.sqrt %arg0 : tensor<8xf32>
    %1 = stablehlo.multiply %arg1, %arg1 : tensor<8xf32>
    return %0, %1 : tensor<8xf32>, tensor<8xf32>
  }
}
"""


def test_an_output_in_the_domain_still_mismatches_beside_one_outside(tmp_path, capsys):
    """Output 0 outside the domain (sqrt of negatives) is not judged; output 1, wrong in the
    rewritten module, is still a MISMATCH (1)."""
    original, wrong, inputs = tmp_path / "sqrt.mlir", tmp_path / "wrong.mlir", tmp_path / "negative.npz"
    original.write_text(SQRT)
    wrong.write_text(SQRT.replace("stablehlo.multiply %arg1, %arg1", "stablehlo.add %arg1, %arg1"))
    np.savez(inputs, arg0=-np.ones(8, np.float32), arg1=np.full(8, 3.0, np.float32))
    assert run_cli("check", original, "--rewritten", wrong, "--inputs", inputs) == 1
    out = capsys.readouterr().out
    assert "output 0 f32[8]: not checked" in out and "MISMATCH" in out.splitlines()[1]


def test_no_rule_applies_says_so_and_names_inputs(tmp_path, capsys):
    """log(x - 4) of normal inputs is NaN everywhere; the subtraction is no simple rule's: could
    not check (3), naming --inputs and --print-input-spec."""
    path = tmp_path / "log.mlir"
    path.write_text(SQRT.replace("%0 = stablehlo.sqrt %arg0 : tensor<8xf32>",
                                 "%c = stablehlo.constant dense<4.0> : tensor<8xf32>\n"
                                 "    %s = stablehlo.subtract %arg0, %c : tensor<8xf32>\n"
                                 "    %0 = stablehlo.log %s : tensor<8xf32>"))
    assert run_cli("check", path, "--rewritten", path) == 3
    err = capsys.readouterr().err
    assert "on random inputs, and no simple rule applies (non-negative where an argument flows into " in err
    assert f"give inputs in its domain with --inputs FILE.npz (cmatmul_pass check --print-input-spec {path} " \
           "lists the 2 argument(s) it takes)" in err


RULES = """
module @m attributes {mhlo.num_partitions = 1 : i32} {
  func.func public @main(%v: tensor<8xf32>, %g: tensor<8xf32>, %ids: tensor<4xi32>, %table: tensor<50x16xf32>,
                         %start: tensor<i32>, %w: tensor<8xf32>, %d: tensor<8xf32>) -> (tensor<8xf32>, tensor<4x16xf32>, tensor<2xf32>, tensor<8xf32>, tensor<8xf32>) {
    %b = stablehlo.constant dense<0.999> : tensor<8xf32>
    %0 = stablehlo.multiply %b, %v : tensor<8xf32>
    %1 = stablehlo.multiply %g, %g : tensor<8xf32>
    %2 = stablehlo.add %0, %1 : tensor<8xf32>
    %3 = call @root(%2) : (tensor<8xf32>) -> tensor<8xf32>
    %i = stablehlo.reshape %ids : (tensor<4xi32>) -> tensor<4x1xi32>
    %4 = "stablehlo.gather"(%table, %i) <{dimension_numbers = #stablehlo.gather<offset_dims = [1], collapsed_slice_dims = [0], start_index_map = [0], index_vector_dim = 1>, slice_sizes = array<i64: 1, 16>}> : (tensor<50x16xf32>, tensor<4x1xi32>) -> tensor<4x16xf32>
    %5 = stablehlo.dynamic_slice %w, %start, sizes = [2] : (tensor<8xf32>, tensor<i32>) -> tensor<2xf32>
    %6 = stablehlo.abs %w : tensor<8xf32>
    %7 = stablehlo.rsqrt %6 : tensor<8xf32>
    %8 = stablehlo.negate %d : tensor<8xf32>
    %9 = stablehlo.log %8 : tensor<8xf32>
    return %3, %4, %5, %7, %9 : tensor<8xf32>, tensor<4x16xf32>, tensor<2xf32>, tensor<8xf32>, tensor<8xf32>
  }
  func.func private @root(%x: tensor<8xf32>) -> tensor<8xf32> {
    %0 = stablehlo.sqrt %x : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
}
"""


def test_the_rules_follow_the_data_flow_to_the_arguments():
    """v reaches a sqrt through a product with a constant, a sum and a call: non-negative; g only
    as g*g (non-negative anyway), w only through abs, d through a negation: none; the ids index a
    gather of 50 rows, the start a dynamic_slice of 2 of 8 elements."""
    found = domain.rules(ir_utils.parse(RULES))
    assert [(r.argument, r.kind, r.bound) for r in found] == [(0, "non-negative", None), (2, "indices", 50),
                                                               (4, "indices", 7)]
    assert found[0].op.startswith("stablehlo.sqrt at ")
    drawn = domain.draw(execute.random_inputs(ir_utils.parse(RULES)), found)
    assert (drawn[0] >= 0).all() and ((0 <= drawn[2]) & (drawn[2] < 50)).all() and 0 <= drawn[4] < 7
    assert (drawn[1] < 0).any() and drawn[1].dtype == np.float32  # the others as they were drawn


def test_near_overflow():
    """An output within a factor n (the longest sum) of the type's largest value is outside the
    domain where the rewrite overflows there; a finite rewrite of it is judged."""
    huge = np.array([[3e38, 1.0]], np.float32)
    model = numerics.ErrorModel(longest_reduction=4)
    assert numerics.outside_domain(huge, "f32", model) and not numerics.outside_domain(huge / 1e3, "f32", model)
    why = numerics.outside_domain(huge, "f32", model, np.array([[np.inf, 1.0]], np.float32))
    assert why.startswith("the rewrite overflows where the original is within a factor 4 (the longest sum) of f32's")
    assert not numerics.outside_domain(huge, "f32", model, huge)


def test_jit_check_warns_once_and_never_raises_on_an_original_outside_its_domain():
    """cmatmul_pass.jit(check=True) judges a call's own arguments: where the original is NaN on
    them (a sqrt of negatives after the ring), those outputs are not judged (no NumericsMismatch)
    and one warning says so."""
    def layer(x, w):
        return jnp.sqrt(jax.lax.all_gather(x, "model", axis=0, tiled=True) @ w)

    f = jax.shard_map(layer, mesh=MESH, in_specs=(P("model", None), P(None, "model")), out_specs=P(None, "model"))
    x = jax.device_put(np.ones((64, 32), np.float32), NamedSharding(MESH, P("model", None)))
    w = jax.device_put(-np.ones((32, 64), np.float32), NamedSharding(MESH, P(None, "model")))
    g = cmatmul_pass.jit(f, check=True, policy="all")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert np.isnan(np.asarray(g(x, w))).all()
    messages = [str(r.message) for r in record if "could not check" in str(r.message)]
    assert len(messages) == 1 and "output(s) 0 of" in messages[0] and "inf/NaN in 4096 of 4096" in messages[0]
    assert g.report.rewritten and not g.checked.complete and g.checked.ok
