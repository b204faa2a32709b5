#!/usr/bin/env python
"""Regenerate tests/bad_inputs/: modules the pass has never seen, each with its expected outcome.

Every file is either unreadable (the CLI must exit 2 with one line naming the file and, where
MLIR gives one, line:col; no traceback; no output file) or readable with nothing the pass may
rewrite (exit 0, the module unchanged, the reasons in the report).  ``MANIFEST.json`` records,
per file, the exit code and the error text or the reason codes.  The broken files are derived from
real samples (truncated, corrupted) or are small modules written here; ``a_directory/`` and a
missing path are covered by the manifest too.

    python tools/gen_bad_inputs.py
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

OUT = ROOT / "tests" / "bad_inputs"

GATHER = """module @m attributes {{mhlo.num_partitions = {parts} : i32, mhlo.num_replicas = {replicas} : i32}} {{
  func.func public @main(%arg0: {xt}, %arg1: tensor<8x4xf32>) -> {yt} {{
    %0 = "stablehlo.all_gather"(%arg0) <{{all_gather_dim = 0 : i64, {channel}replica_groups = dense<{groups}> : tensor<{gshape}xi64>{global_ids}}}> : ({xt}) -> {gt}
    %1 = stablehlo.dot_general %0, %arg1, contracting_dims = [1] x [0] : ({gt}, tensor<8x4xf32>) -> {yt}
    return %1 : {yt}
  }}
}}
"""
CHANNEL = "channel_handle = #stablehlo.channel_handle<handle = 1, type = 1>, "


def gather(**kw) -> str:
    args = dict(parts=4, replicas=1, xt="tensor<2x8xf32>", gt="tensor<8x8xf32>", yt="tensor<8x4xf32>",
                groups="[[0, 1, 2, 3]]", gshape="1x4", channel=CHANNEL, global_ids=", use_global_device_ids")
    args.update(kw)
    return GATHER.format(**args)


SCATTER = """module @m attributes {{mhlo.num_partitions = 4 : i32, mhlo.num_replicas = 1 : i32}} {{
  func.func public @main(%arg0: tensor<{rows}x8xf32>, %arg1: tensor<8x4xf32>) -> tensor<{out}x4xf32> {{
    %0 = stablehlo.dot_general %arg0, %arg1, contracting_dims = [1] x [0] : (tensor<{rows}x8xf32>, tensor<8x4xf32>) -> tensor<{rows}x4xf32>
    %1 = "stablehlo.reduce_scatter"(%0) <{{channel_handle = #stablehlo.channel_handle<handle = 1, type = 1>, replica_groups = dense<[[0, 1, 2, 3]]> : tensor<1x4xi64>, scatter_dimension = 0 : i64, use_global_device_ids}}> ({{
    ^bb0(%a: tensor<f32>, %b: tensor<f32>):
      %s = stablehlo.{op} %a, %b : tensor<f32>
      stablehlo.return %s : tensor<f32>
    }}) : (tensor<{rows}x4xf32>) -> tensor<{out}x4xf32>
    return %1 : tensor<{out}x4xf32>
  }}
}}
"""


ONE_PARTITION = """module @jit_f attributes {mhlo.num_partitions = 1 : i32, mhlo.num_replicas = 1 : i32} {
  func.func public @main(%arg0: tensor<4x4xf32>, %arg1: tensor<4x4xf32>) -> tensor<4x4xf32> {
    %0 = stablehlo.dot_general %arg0, %arg1, contracting_dims = [1] x [0] : (tensor<4x4xf32>, tensor<4x4xf32>) -> tensor<4x4xf32>
    return %0 : tensor<4x4xf32>
  }
}
"""
UNUSED_GATHER = """module @m attributes {mhlo.num_partitions = 4 : i32, mhlo.num_replicas = 1 : i32} {
  func.func public @main(%arg0: tensor<2x8xf32>) -> tensor<2x8xf32> {
    %0 = "stablehlo.all_gather"(%arg0) <{all_gather_dim = 0 : i64, channel_handle = #stablehlo.channel_handle<handle = 1, type = 1>, replica_groups = dense<[[0, 1, 2, 3]]> : tensor<1x4xi64>, use_global_device_ids}> : (tensor<2x8xf32>) -> tensor<8x8xf32>
    return %arg0 : tensor<2x8xf32>
  }
}
"""


def scatter(op="add", rows=8, out=2) -> str:
    return SCATTER.format(op=op, rows=rows, out=out)


def error(text: str, *, line: bool = True) -> dict:
    """Exit 2; stderr's one line contains ``text`` (and ``:line:col`` when ``line``)."""
    return {"exit": 2, "error": text, "line_col": line}


def unchanged(*reasons: str, **commands: dict) -> dict:
    """Exit 0, output identical to the input as the pass prints it, these sites' reason codes;
    ``commands``: what other commands must do with it (:func:`says`)."""
    case = {"exit": 0, "unchanged": True, "reasons": list(reasons)}
    if commands:
        case["commands"] = commands
    return case


def says(exit: int, text: str, *args: str) -> dict:
    """A command run on the file (with ``args``) exits ``exit`` with one line, no traceback,
    containing ``text`` (on stderr for exit 2, on stdout otherwise)."""
    return {"exit": exit, "text": text, "args": list(args)}


#: ``check``/``bench`` on a module where nothing was rewritten: nothing to compare or time
NOTHING_TO_RUN = dict(check=says(0, "nothing to check: no site was rewritten"),
                      bench=says(0, "nothing to time: no site was rewritten", "--runs", "1"))
#: ``explain --plot`` with no candidate site
NO_PLOT = says(2, "--plot: no site to draw", "--plot", "timeline.png")


def build() -> dict[str, tuple[bytes | str, dict]]:
    import cmatmul_pass
    from cmatmul_pass import ir_utils

    sample = (ROOT / "hlo_samples" / "ag_dot_mesh2x4_model.mlir").read_text()
    module = ir_utils.parse(sample)
    bytecode = cmatmul_pass.rewrite(sample).bytecode
    clean = ir_utils.print_module(module)
    lines = clean.splitlines()
    corrupt = bytearray(bytecode)
    for i in range(5, 45):  # the version and the section table right after the magic number
        corrupt[i] ^= 0x5A
    return {
        # ---- not a module at all
        "empty.mlir": (b"", error("empty input", line=False)),
        "whitespace_only.mlir": ("  \n\t\n", error("empty input", line=False)),
        "plain_text.txt": ("hello, world\n", error("custom op 'hello' is unknown")),
        "python_source.mlir": ("def f(x):\n    return x\n", error("custom op 'def' is unknown")),
        "json.mlir": ('{"module": "m"}\n', error("expected operation name")),
        "hlo_text.txt": ("HloModule jit_f, entry_computation_layout={(f32[8]{0})->f32[8]{0}}\n\nENTRY %main {\n}\n",
                         error("this is HLO text (what `compiled.as_text()`")),
        "jaxpr.txt": ("{ lambda ; a:f32[8]. let b:f32[8] = sin a in (b,) }\n", error("this is a jaxpr")),
        "nul_bytes.mlir": (b"module {\n  \x00}\n", error("NUL byte")),
        "latin1_garbage.mlir": (b"module @m {\xff\xfe\xfd}\n", error("neither UTF-8 text nor MLIR bytecode", line=False)),
        "random_binary.bin": (bytes(range(256)) * 4, error("neither UTF-8 text nor MLIR bytecode", line=False)),
        "bytecode_magic_only.mlirbc": (b"ML\xefR", error("invalid MLIR bytecode", line=False)),
        "truncated_bytecode.mlirbc": (bytecode[: len(bytecode) // 2], error("invalid MLIR bytecode", line=False)),
        "corrupt_bytecode.mlirbc": (bytes(corrupt), error("invalid MLIR bytecode", line=False)),
        # ---- broken text
        "truncated_text.mlir": ("\n".join(lines[: len(lines) // 2]) + "\n", error("")),
        "truncated_mid_op.mlir": (clean[: clean.index("stablehlo.dot_general") + 30], error("")),
        "missing_closing_brace.mlir": (clean.rstrip().rstrip("}") + "\n", error("")),
        "undefined_value.mlir": (gather().replace("dot_general %0", "dot_general %9"), error("undefined")),
        "unknown_dialect.mlir": ("module {\n  func.func @main() {\n    foo.bar\n    return\n  }\n}\n", error("")),
        "unknown_stablehlo_op.mlir": (gather().replace("stablehlo.dot_general", "stablehlo.dot_generalised"), error("")),
        "type_mismatch.mlir": (gather(yt="tensor<8x5xf32>"), error("")),
        "empty_module.mlir": ("module {\n}\n", error("module is empty", line=False)),
        "duplicate_replica_ids.mlir": (gather(groups="[[0, 1, 1, 3]]"), error("replica id #1 seen more than once")),
        "unequal_replica_groups.mlir": (
            gather(parts=6, gt="tensor<6x8xf32>", yt="tensor<6x4xf32>", groups="[[0, 1, 2], [3, -1, -1]]", gshape="2x3"),
            error("Invalid replica id -1"),
        ),
        "gather_not_a_multiple.mlir": (gather(gt="tensor<7x8xf32>", yt="tensor<7x4xf32>"), error("multiple of")),
        # ---- readable, nothing the pass may rewrite
        "dynamic_shapes.mlir": (gather(xt="tensor<?x8xf32>", gt="tensor<?x8xf32>", yt="tensor<?x4xf32>"), unchanged("dynamic_shape")),
        "no_num_partitions.mlir": (gather().replace("mhlo.num_partitions = 4 : i32, ", ""),
                                    unchanged("no_num_partitions", **NOTHING_TO_RUN)),
        "one_partition.mlir": (ONE_PARTITION, unchanged(**NOTHING_TO_RUN, explain=NO_PLOT)),
        "two_replicas.mlir": (gather(replicas=2), unchanged("replicas")),
        "cross_replica_groups.mlir": (gather(channel="", global_ids=""), unchanged("cross_replica", **NOTHING_TO_RUN)),
        "ring_of_one.mlir": (gather(gt="tensor<2x8xf32>", yt="tensor<2x4xf32>", groups="[[0], [1], [2], [3]]", gshape="4x1"),
                             unchanged("ring_size_1", **NOTHING_TO_RUN)),
        "groups_miss_partitions.mlir": (gather(parts=8), unchanged("replica_groups")),
        "gather_unused.mlir": (UNUSED_GATHER, unchanged("no_users")),
        "scatter_not_a_multiple.mlir": (scatter(rows=10), unchanged("shape")),
        "scatter_max.mlir": (scatter("maximum"), unchanged("not_sum")),
        "scatter_mul.mlir": (scatter("multiply"), unchanged("not_sum")),
        "scatter_sub.mlir": (scatter("subtract"), unchanged("not_sum")),
        "gather_two_operands.mlir": ((ROOT / "hlo_samples" / "neg_variadic.mlir").read_text(), unchanged("variadic")),
        "already_rewritten.mlir": (cmatmul_pass.rewrite(sample).text, unchanged()),
        "already_rewritten_bidirectional.mlir": (
            cmatmul_pass.rewrite(sample, cmatmul_pass.Options(bidirectional=True, unroll=2, annotate_streams=True)).text,
            unchanged(),
        ),
        "no_collectives.mlir": ("module @m {\n  func.func @main(%a: tensor<2xf32>) -> tensor<2xf32> {\n"
                                "    return %a : tensor<2xf32>\n  }\n}\n", unchanged(explain=NO_PLOT)),
    }


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    manifest = {}
    for name, (content, expected) in build().items():
        path = OUT / name
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        manifest[name] = expected
    (OUT / "a_directory").mkdir(exist_ok=True)
    (OUT / "a_directory" / "README").write_text("This directory is itself a bad input (a directory, not a file).\n")
    manifest["a_directory"] = error("is a directory", line=False)
    manifest["does_not_exist.mlir"] = error("no such file", line=False)
    (OUT / "MANIFEST.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    print(f"wrote {len(manifest)} cases to {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
