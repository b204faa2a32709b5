"""8 virtual CPU devices for every test: must be set before jax is imported; and sharing.CHECK on."""

import os
import sys
from pathlib import Path

flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()
# every site mapped into a ring function is checked against matching its copy there (sharing.CHECK)
os.environ.setdefault("CMATMUL_PASS_CHECK_SHARING", "1")
# the suite's programs are far too small for the cost model to predict a ring faster on an H100:
# they test the rings under policy "all"; the default ("auto") is tested with the variable unset
# (test_cli.py, the documents' snippets in test_docs.py)
os.environ.setdefault("CMATMUL_PASS_POLICY", "all")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tools/ helpers (golden blocks, sample metadata)

import pytest  # noqa: E402

from tools.golden import expectation, sample_paths  # noqa: E402

SAMPLES = sample_paths(ROOT)
POSITIVE = [p for p in SAMPLES if expectation(p.read_text())[0] == "rewritten"]
NEGATIVE = [p for p in SAMPLES if expectation(p.read_text())[0] == "unchanged"]


def run_cli(*argv) -> int:
    """``python -m cmatmul_pass ARGV`` in-process; returns the exit code."""
    from cmatmul_pass import cli

    return cli.main([str(a) for a in argv])


def assert_same_numbers(text: str, result) -> None:
    """The rewritten module (``result.module``) computes what the original ``text`` does, as
    ``check`` judges it."""
    from cmatmul_pass import execute, ir_utils

    outcome = execute.check_numerics(ir_utils.parse(text), result.module)
    assert outcome.ok, outcome.format()


def sample(name: str) -> Path:
    return ROOT / "hlo_samples" / f"{name}.mlir"


def module_line(name: str, offset: int) -> int:
    """The line of a sample ``offset`` lines below its ``module`` line: a location that stays put
    when the golden block above the module grows or shrinks."""
    lines = sample(name).read_text().splitlines()
    return 1 + next(i for i, line in enumerate(lines) if line.startswith("module")) + offset


@pytest.fixture
def sample_text():
    return lambda name: sample(name).read_text()


def scaled_bf16_gather(role: str) -> str:
    """bf16 shards gathered, scaled by 3 (not exact in bf16), into a small dot accumulating in
    f32 (XLA CPU computes dots this small as fused elementwise code): gathered on the rows
    (free) or on the contraction (``role``)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((8,), ("m",))
    axis, x_spec, x_shape = (0, P("m", None), (24, 4)) if role == "free" else (1, P(None, "m"), (3, 32))

    def body(x, w):
        g = jax.lax.all_gather(x, "m", axis=axis, tiled=True) * jnp.bfloat16(3)
        return jnp.dot(g, w, preferred_element_type=jnp.float32)

    f = jax.shard_map(body, mesh=mesh, in_specs=(x_spec, P()), out_specs=P(), check_vma=False)
    x = jax.ShapeDtypeStruct(x_shape, jnp.bfloat16, sharding=NamedSharding(mesh, x_spec))
    w = jax.ShapeDtypeStruct((x_shape[1], 2), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
    return jax.jit(f).lower(x, w).as_text()


def context_parallel_attention():
    """Context-parallel attention as a shard_map over 8 devices (keys and values gathered over the
    sequence, each device keeping its queries) and its three [2, 64, 4, 8] arguments:
    (the function, [q, k, v] ShapeDtypeStructs)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((8,), ("sp",))
    spec = P(None, "sp", None, None)

    def attention(q, k, v):
        kg = jax.lax.all_gather(k, "sp", axis=1, tiled=True)
        vg = jax.lax.all_gather(v, "sp", axis=1, tiled=True)
        p = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, kg) / 4.0, -1)
        return jnp.einsum("bhqk,bkhd->bqhd", p, vg)

    f = jax.shard_map(attention, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
    return f, [jax.ShapeDtypeStruct((2, 64, 4, 8), jnp.float32, sharding=NamedSharding(mesh, spec))] * 3


def assert_only_split_gathers_left(result):
    """No reduce_scatter is left, no all_reduce of a dot (the data-parallel psums of the weight
    gradients are split; a psum of a loss or a norm's statistics is no dot's and stays), and
    every all_gather left is one a split left where a whole value is read, never a dot's."""
    from cmatmul_pass import ir_utils

    left = ir_utils.ops_named(result.module, "stablehlo.all_gather", "stablehlo.reduce_scatter")
    assert not left["stablehlo.reduce_scatter"]
    assert all(s.rewritten or s.reason_code == "producer_not_dot"
               for s in result.report.sites if s.kind == "dot_all_reduce")
    split = sum(1 for s in result.report.rewritten if s.kind == "dot_all_reduce")
    assert len(left["stablehlo.all_gather"]) <= split
    assert not any(u.name == "stablehlo.dot_general" for g in left["stablehlo.all_gather"] for u in ir_utils.users(g.result))


def inline_layers(module) -> dict:
    """Inline every call of a replayed layer's function (a copy of its region at the call, at
    the call's location) and erase the functions; returns each copy's body -> its function."""
    from cmatmul_pass import ir_utils, replay
    from cmatmul_pass._jax_private import ir

    functions = {ir.StringAttr(f.attributes["sym_name"]).value: f for f in module.body.operations
                 if f.operation.name == "func.func"
                 and ir.StringAttr(f.attributes["sym_name"]).value.startswith(replay.LAYER_PREFIX)}
    copies = {}
    for call in ir_utils.ops_named(module, "func.call")["func.call"]:
        callee = ir.FlatSymbolRefAttr(call.attributes["callee"]).value
        if callee not in functions:
            continue
        with ir.InsertionPoint(call):
            copy = functions[callee].regions[0].blocks[0].operations[0].operation.clone().operation
        copy.location = call.location
        for index, value in enumerate(call.operands):
            copy.operands[index] = value
        for old, new in zip(call.results, copy.results):
            old.replace_all_uses_with(new)
        call.operation.erase()
        copies[replay._body(copy)] = callee
    for f in functions.values():
        f.operation.erase()
    return copies
