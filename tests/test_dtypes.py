"""Element types beyond the samples' f32/bf16/i32: every ring kind in f16, f64, complex, 64-bit
and unsigned integers and the five fp8 types, rewritten, run on 8 CPU devices and compared with the original.

Tolerances are execute.FLOAT_TOLERANCES' (normwise relative): f16 2e-3, f64 1e-12, complex
outputs their parts' (complex<f32> 1e-5, complex<f64> 1e-12), an 8-bit float output its machine
epsilon (f8E4M3FN 0.125: one rounding of the stored result); integer outputs exactly.
"""

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import cmatmul_pass
from cmatmul_pass import execute, ir_utils, report, sites
from cmatmul_pass._jax_private import ir, make_context
from cmatmul_pass.rewrites import all_gather_dot

MESH_SHAPE = (8,)


def three_sites(dtype, preferred=None) -> str:
    """A shard_map with one site of each role: a gather on the rows (free), a gather on the
    features (contracting) and a scatter; lowered with 64-bit types enabled."""
    mesh = jax.make_mesh(MESH_SHAPE, ("m",))

    def body(x, xf, w):
        rows = jnp.matmul(jax.lax.all_gather(x, "m", axis=0, tiled=True), w, preferred_element_type=preferred)
        feats = jnp.matmul(jax.lax.all_gather(xf, "m", axis=1, tiled=True), w, preferred_element_type=preferred)
        scattered = jax.lax.psum_scatter(jnp.matmul(x.T, x, preferred_element_type=preferred), "m",
                                         scatter_dimension=0, tiled=True)
        return rows, feats, scattered

    specs = (P("m", None), P(None, "m"), P(None, None))
    f = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=(P(None, "m"), P(None, "m"), P("m", None)),
                      check_vma=False)
    args = [jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))
            for shape, spec in zip([(64, 32), (16, 32), (32, 8)], specs)]
    with jax.enable_x64(True):
        return jax.jit(f).lower(*args).as_text()


CASES = {
    # name: (input dtype, preferred_element_type, the outputs' element type)
    "f16": (jnp.float16, None, "f16"),
    "f64": (jnp.float64, None, "f64"),
    "complex64": (jnp.complex64, None, "complex<f32>"),
    "complex128": (jnp.complex128, None, "complex<f64>"),
    "i64": (jnp.int64, None, "i64"),
    "ui32": (jnp.uint32, None, "ui32"),
    "i8-to-i32": (jnp.int8, jnp.int32, "i32"),
    "f8e4m3fn-to-bf16": (jnp.float8_e4m3fn, jnp.bfloat16, "bf16"),
    "f8e5m2-to-f32": (jnp.float8_e5m2, jnp.float32, "f32"),
    "f8e4m3fn": (jnp.float8_e4m3fn, None, "f8E4M3FN"),
    "f8e4m3fnuz-to-f32": (jnp.float8_e4m3fnuz, jnp.float32, "f32"),
    "f8e5m2fnuz": (jnp.float8_e5m2fnuz, None, "f8E5M2FNUZ"),
    "f8e4m3b11fnuz-to-bf16": (jnp.float8_e4m3b11fnuz, jnp.bfloat16, "bf16"),
}


def rewrite_and_check(text: str, variant: str):
    result = cmatmul_pass.rewrite(text, cmatmul_pass.Options(variant=variant))
    return result, execute.check_numerics(ir_utils.parse(text), result.module)


@pytest.mark.parametrize("variant", ["uni", "bidi-full"])
@pytest.mark.parametrize("case", CASES)
def test_every_ring_kind_matches_the_original(case, variant):
    dtype, preferred, out = CASES[case]
    text = three_sites(dtype, preferred)
    result, outcome = rewrite_and_check(text, variant)
    assert sorted((s.kind, s.dim_role) for s in result.report.rewritten) == [
        ("all_gather_dot", "contracting"), ("all_gather_dot", "free"), ("dot_reduce_scatter", "free")]
    assert [o.dtype for o in outcome.outputs] == [out] * 3
    # a sum across devices in a 16-bit float widens its float outputs' tolerance (reduction_tolerance)
    widened = execute.reduction_tolerance(ir_utils.parse(text))
    assert widened == (2 * 7 ** 0.5 * float(ml_dtypes.finfo(np.float16 if out == "f16" else ml_dtypes.bfloat16).eps)
                       if out in ("f16", "bf16") else 0.0)
    # float outputs are judged against the original evaluated in f64 (execute.Reference's exact,
    # numerics.judge_float), integer ones exactly
    floats = out in execute.FLOAT_TOLERANCES
    assert all((o.original_error is not None) == floats and (o.tolerance > 0) == floats for o in outcome.outputs)
    assert outcome.ok, outcome.format()


@pytest.mark.parametrize("case", ["complex64", "f64", "f8e4m3fn", "f16"])
def test_a_wrong_ring_direction_is_caught(case, monkeypatch):
    """The comparison sees these types' errors: complex ones in either part, 64-bit ones (the
    inputs are placed as 64-bit arrays), 8-bit ones within their coarse tolerance."""
    monkeypatch.setattr(all_gather_dot, "RECEIVE_FROM_NEXT", +1)
    dtype, preferred, _ = CASES[case]
    _, outcome = rewrite_and_check(three_sites(dtype, preferred), "uni")
    assert not outcome.outputs[0].ok  # the free gather's blocks land at the wrong rows


def test_complex_errors_in_the_imaginary_part_count():
    a = np.array([[1 + 1j, 2 + 0j]], np.complex64)
    b = a + np.array([[0.5j, 0]], np.complex64)
    compared = execute.compare(0, [a], [b])
    assert compared.dtype == "complex<f32>"
    assert compared.max_abs_error == pytest.approx(0.5)
    assert not compared.ok


def test_narrow_float_partial_contractions_are_summed_in_f32():
    """An f8 (as a bf16) contracting dot sums its rounds' partial products in f32 and casts
    once: rounding each round's partial to 8 bits would lose three bits per round."""
    result = cmatmul_pass.rewrite(three_sites(jnp.float8_e4m3fn), cmatmul_pass.Options(variant="uni"))
    loops = ir_utils.ops_named(result.module, "stablehlo.while")["stablehlo.while"]
    carried = {str(ir_utils.ranked_tensor(v).element_type) for loop in loops for v in loop.results}
    assert "f32" in carried  # the contracting ring's accumulator
    assert "f8E4M3FN" in carried  # the shards travel as they are


@pytest.mark.parametrize("element, width", [("complex<f32>", 64), ("complex<f64>", 128), ("f8E5M2", 8),
                                            ("bf16", 16), ("i4", 4), ("i1", 1)])
def test_element_bits(element, width):
    with make_context(), ir.Location.unknown():
        t = ir.RankedTensorType.get([3, 5], ir.Type.parse(element))
        assert report.element_bits(t.element_type) == width
        assert report.tensor_bytes(t) == -(-15 * width // 8)


def test_the_cost_model_prices_a_complex_dot_as_four_real_ones():
    """A complex<f32> site moves twice an f32 site's bytes and computes four times its FLOPs,
    at the f32 throughput."""
    real, cplx = (cmatmul_pass.rewrite(three_sites(t)).report.rewritten for t in (jnp.float32, jnp.complex64))
    for r, c in zip(real, cplx):
        assert (c.kind, c.dim_role) == (r.kind, r.dim_role)
        assert c.bytes_per_step == 2 * r.bytes_per_step
        assert c.cost["site"]["dtype"] == r.cost["site"]["dtype"] == "f32"
        assert c.cost["site"]["flops"] == 4 * r.cost["site"]["flops"]
        assert c.cost["compute_s"] == pytest.approx(4 * r.cost["compute_s"])


def test_docs_numerics_quotes_the_tolerances():
    doc = (Path(__file__).resolve().parent.parent / "docs" / "numerics.md").read_text()
    numerics = " ".join(doc[doc.index("## Tolerances"):].split("\n## ")[0].split())
    def quoted(label: str) -> float:  # "f16 `2e-3`", not "bf16 `1e-2`"
        return float(re.search(rf"(?<!\w){label} `([^`]+)`", numerics).group(1))

    for name in ("f32", "bf16", "f16", "f64"):
        assert quoted(name) == execute.FLOAT_TOLERANCES[name]
    for name in ("E4M3FN", "E5M2"):
        assert quoted(name) == execute.FLOAT_TOLERANCES["f8" + name]


def test_the_cost_model_prices_a_mixed_dot_at_its_wider_operand():
    """A dot of an fp8 and a bf16 operand runs as bf16 (either operand order); two fp8 operands
    at fp8's rate, whatever the result type."""
    text = """
    func.func @main(%a: tensor<4x8xf8E4M3FN>, %b: tensor<8x2xbf16>) -> tensor<4x2xbf16> {
      %0 = stablehlo.dot_general %a, %b, contracting_dims = [1] x [0] : (tensor<4x8xf8E4M3FN>, tensor<8x2xbf16>) -> tensor<4x2xbf16>
      %1 = stablehlo.dot_general %b, %a, contracting_dims = [0] x [1] : (tensor<8x2xbf16>, tensor<4x8xf8E4M3FN>) -> tensor<2x4xbf16>
      %2 = stablehlo.dot_general %a, %a, contracting_dims = [1] x [1] : (tensor<4x8xf8E4M3FN>, tensor<4x8xf8E4M3FN>) -> tensor<4x4xf32>
      return %0 : tensor<4x2xbf16>
    }
    """
    module = ir_utils.parse(text)  # held: its ops live only as long as it does
    dots = ir_utils.ops_named(module, "stablehlo.dot_general")["stablehlo.dot_general"]
    assert [str(sites.priced_element_type(d)) for d in dots] == ["bf16", "bf16", "f8E4M3FN"]


def test_outputs_the_original_leaves_inf_or_nan_are_not_judged():
    """An output the original leaves inf or NaN in some element is outside the program's domain on
    these inputs: not judged, never a mismatch (a correct rewrite summing in another order may
    overflow where the original is huge), only described: the finite elements' difference, and
    how many non-finite ones differ.  An output the original leaves finite must stay finite: an
    infinity or NaN only the rewrite has is a mismatch."""
    inf, nan = np.inf, np.nan
    a = np.array([[1.0, inf, -inf, nan, 2.0]], np.float32)
    same = execute.compare(0, [a], [a + np.array([[1e-6, 0, 0, 0, 0]], np.float32)])
    assert same.ok and same.status == "not checked" and same.nonfinite == 3
    assert same.max_abs_error == pytest.approx(1e-6, rel=0.1) and same.rel_error == pytest.approx(5e-7, rel=0.1)
    assert "the original is inf/NaN in 3 of 5 elements" in same.line()
    for wrong in ([1.0, -inf, -inf, nan, 2.0], [1.0, inf, -inf, 0.0, 2.0], [1.5, inf, -inf, nan, 2.0]):
        off = execute.compare(0, [a], [np.array([wrong], np.float32)])
        assert off.ok and off.status == "not checked", off.line()
    assert "the rewrite differs in 1 of the elements either leaves inf/NaN" in \
        execute.compare(0, [a], [np.array([[1.0, -inf, -inf, nan, 2.0]], np.float32)]).line()
    c = np.array([[complex(inf, 0), 1 + 1j]], np.complex64)
    assert execute.compare(0, [c], [c.copy()]).status == "not checked"
    finite = np.array([[1.0, 2.0, 3.0]], np.float32)
    for wrong in ([1.0, inf, 3.0], [nan, 2.0, 3.0]):
        off = execute.compare(0, [finite], [np.array([wrong], np.float32)])
        assert not off.ok and off.status == "MISMATCH" and off.max_abs_error == inf
