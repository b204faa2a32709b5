"""What the sample programs of tools/gen_samples.py share: the :class:`Sample` and
:class:`Variant` records, the helpers the JAX programs are written with (meshes, shard_map,
lowering, the collectives), the intent checks the samples state and the rings' permute pairs.
The programs themselves are in tools/samples_*.py, one module per family."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

from tools.golden import MAIN_ARGS, escape  # noqa: E402


@dataclass
class Variant:
    """The pass run with other options: intent ``checks`` (written with the CHECK prefix) and a golden
    block, both under ``prefix``."""

    prefix: str
    args: list[str]
    checks: list[str]

    def intent_lines(self) -> list[str]:
        return [self.prefix + c[len("CHECK"):] for c in self.checks]


@dataclass
class Sample:
    name: str
    doc: str
    build: Callable[[], str]
    expect: str  # "rewritten N" or "unchanged <code>"
    checks: list[str] = field(default_factory=list)
    variants: list[Variant] = field(default_factory=list)
    #: the jax release series whose lowering the sample records ("0.11": collectives name their groups
    #: by mesh axes); "" for samples any supported jax lowers alike enough
    jax: str = ""
    #: the main block's options (the uni ring; a psum sample's split, SPLIT_ARGS, which it is written for)
    main_args: tuple[str, ...] = MAIN_ARGS

    def lowerable(self) -> bool:
        """Does the installed jax lower this sample the way it records?"""
        return not self.jax or _release(jax.__version__) >= _release(self.jax)


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split(".")[:2])


def smap(body, **kwargs):
    """shard_map without the replication check: the gathered value is device-varying to the
    checker even where the program's outputs are in fact replicated."""
    return jax.shard_map(body, check_vma=False, **kwargs)


def arg(mesh, shape, spec, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def lower(fn, *args) -> str:
    return jax.jit(fn).lower(*args).as_text()


def mesh_1d(n=8, name="model"):
    return jax.make_mesh((n,), (name,))


def mesh_2x4():
    return jax.make_mesh((2, 4), ("data", "model"))


def gather(x, axis_name, axis):
    return jax.lax.all_gather(x, axis_name, axis=axis, tiled=True)


def loop_checks(pairs: str, trip_count: int) -> list[str]:
    """A while of ``trip_count`` trips whose body starts with the ring's permute."""
    return [
        "CHECK: stablehlo.while",
        "CHECK: cond {",
        f"CHECK-NEXT: stablehlo.constant dense<{trip_count}> : tensor<ui32>",
        "CHECK-NEXT: stablehlo.compare LT",
        "CHECK: } do {",
        'CHECK: "stablehlo.collective_permute"',  # after the body's constants (hoisted to its start)
        f"CHECK-SAME: source_target_pairs = dense<{escape(pairs)}>",
    ]


def ring_checks(pairs: str, trip_count: int, partial_dot_type: str = "") -> list[str]:
    """Intent checks of one all_gather→dot ring: no gather left, a loop of n-1 trips, the peeled step."""
    in_loop_dot = ["CHECK: stablehlo.dot_general"]
    if partial_dot_type:
        in_loop_dot.append(f"CHECK-SAME: {partial_dot_type}")
    return [
        "CHECK-NOT: stablehlo.all_gather",
        "CHECK: stablehlo.partition_id",
        *loop_checks(pairs, trip_count),
        *in_loop_dot,
        "CHECK: stablehlo.dynamic_update_slice",
        "CHECK: stablehlo.return",
        "CHECK: stablehlo.dot_general",
        "CHECK: stablehlo.dynamic_update_slice",
        "CHECK-NOT: stablehlo.all_gather",
    ]


def contracting_checks(pairs: str, trip_count: int) -> list[str]:
    """Intent checks of an all_gather ring whose dot contracts the gathered dim: slices of the other
    operand, partial dots summed."""
    return [
        "CHECK-NOT: stablehlo.all_gather",
        *loop_checks(pairs, trip_count),
        "CHECK: stablehlo.dynamic_slice",
        "CHECK-NEXT: stablehlo.dot_general",
        "CHECK-NEXT: stablehlo.add",
        "CHECK: stablehlo.return",
        "CHECK: stablehlo.dynamic_slice",
        "CHECK-NEXT: stablehlo.dot_general",
        "CHECK-NEXT: stablehlo.add",
        "CHECK-NOT: stablehlo.all_gather",
    ]


def rs_checks(pairs: str, trip_count: int, block_type: str = "") -> list[str]:
    """Intent checks of one dot→reduce_scatter ring: the peeled first block, then n-1 trips that each
    receive the partial sum and add this device's block to it."""
    dot = ["CHECK-NEXT: stablehlo.dot_general"] + ([f"CHECK-SAME: {block_type}"] if block_type else [])
    return [
        "CHECK-NOT: stablehlo.reduce_scatter",
        "CHECK: stablehlo.partition_id",
        "CHECK: stablehlo.dynamic_slice {{.*}} -> tensor<1xui32>",
        "CHECK: stablehlo.dynamic_slice {{.*}} -> tensor<{{[0-9]+x[0-9]+}}x",  # the peeled block (not a position table)
        *dot,
        *loop_checks(pairs, trip_count),
        "CHECK: stablehlo.dynamic_slice",
        *dot,
        "CHECK: stablehlo.add",
        "CHECK: stablehlo.return",
        "CHECK-NOT: stablehlo.reduce_scatter",
    ]


def gone(*ops: str) -> list[str]:
    """Checks that none of ``ops`` is left anywhere in the output."""
    return [f"CHECK-NOT: stablehlo.{op}" for op in ops]


# ---------------------------------------------------------------- variant checks
BIDI = ["--bidirectional"]
UNROLL2 = ["--unroll", "2"]
FULL = ["--unroll", "full"]
STREAMS = ["--annotate-streams", "--unroll", "2"]
HLO = ["--emit", "hlo", "--annotate-streams", "--unroll", "2"]
PERMUTE = 'CHECK: "stablehlo.collective_permute"'


def pairs_same(pairs: str) -> str:
    return f"CHECK-SAME: source_target_pairs = dense<{escape(pairs)}>"


def unroll2_checks(collective: str, pairs: str, trips: int, tied: bool = True) -> list[str]:
    """Two rounds per trip: each with its permute and its dot; ``tied``: the dot reads its operands
    through an optimization barrier (the rounds share the other operand)."""
    barrier = ["CHECK: stablehlo.optimization_barrier"] if tied else []
    return [
        f"CHECK-NOT: stablehlo.{collective}",
        *loop_checks(pairs, trips),
        *barrier,
        "CHECK: stablehlo.dot_general",
        PERMUTE,
        pairs_same(pairs),
        *barrier,
        "CHECK: stablehlo.dot_general",
        "CHECK: stablehlo.return",
        f"CHECK-NOT: stablehlo.{collective}",
    ]


def full_checks(collective: str, permutes: int, dots: int) -> list[str]:
    """The whole ring straight-line: no loop, n-1 permutes (per direction), every dot."""
    return [
        "CHECK-NOT: stablehlo.while",
        *[PERMUTE] * permutes,
        *["CHECK: stablehlo.dot_general"] * 1,
        "CHECK-NOT: stablehlo.while",
    ] + ([f"CHECK-NOT: stablehlo.{collective}"] if dots else [])


def bidi_gather_loop_checks(down: str, up: str, trips: int) -> list[str]:
    """Round 0 starts both streams and computes the own shard; each trip receives from both sides."""
    return [
        "CHECK-NOT: stablehlo.all_gather",
        PERMUTE, pairs_same(down),
        'CHECK-NEXT: "stablehlo.collective_permute"', pairs_same(up),
        "CHECK: stablehlo.dot_general",
        *loop_checks(down, trips),
        'CHECK-NEXT: "stablehlo.collective_permute"', pairs_same(up),
        "CHECK: stablehlo.dot_general",
        "CHECK: stablehlo.dot_general",
        "CHECK: stablehlo.return",
        "CHECK-NOT: stablehlo.all_gather",
    ]


def bidi_gather_4_checks(down: str, up: str) -> list[str]:
    """A ring of 4 both ways: round 0 sends both ways, round 1 only down, round 2 none; no loop."""
    return [
        "CHECK-NOT: stablehlo.while",
        PERMUTE, pairs_same(down),
        'CHECK-NEXT: "stablehlo.collective_permute"', pairs_same(up),
        "CHECK: stablehlo.dot_general",
        PERMUTE, pairs_same(down),
        "CHECK: stablehlo.dot_general",
        "CHECK: stablehlo.dot_general",
        "CHECK: stablehlo.dot_general",
        "CHECK-NOT: stablehlo.collective_permute",
        "CHECK-NOT: stablehlo.all_gather",
    ]


def streams_checks(collective: str) -> list[str]:
    """Each round's dot is an outlined call on its own stream (one per slot of the loop trip),
    grouped with the round's permute (the ids themselves are the golden block's to pin)."""
    return [
        f"CHECK-NOT: stablehlo.{collective}",
        "CHECK: } do {",
        PERMUTE,
        'CHECK-SAME: mhlo.frontend_attributes = {_scheduling_group_id = "[[G1:[0-9]+]]"}',
        "CHECK: func.call @cmatmul_dot_0",
        'CHECK-SAME: {_scheduling_group_id = "[[G1]]", _xla_stream_annotation = "1", inlineable = "false"}',
        PERMUTE,
        'CHECK-SAME: mhlo.frontend_attributes = {_scheduling_group_id = "[[G2:[0-9]+]]"}',
        "CHECK: func.call @cmatmul_dot_0",
        'CHECK-SAME: {_scheduling_group_id = "[[G2]]", _xla_stream_annotation = "2", inlineable = "false"}',
        "CHECK: func.func private @cmatmul_dot_0",
        "CHECK-NEXT: stablehlo.dot_general",
    ]


def hlo_checks() -> list[str]:
    """The same in HLO: the loop's two rounds are groups 1 and 2 (group 0 is the round peeled
    before the loop), each a permute and a call on its stream (HLO orders computations its own
    way, hence DAG)."""
    return [
        "CHECK: HloModule",
        'CHECK-DAG: collective-permute({{.*}}frontend_attributes={_scheduling_group_id="1"}',
        'CHECK-DAG: call({{.*}}frontend_attributes={_scheduling_group_id="1",_xla_stream_annotation="1",inlineable="false"}',
        'CHECK-DAG: collective-permute({{.*}}frontend_attributes={_scheduling_group_id="2"}',
        'CHECK-DAG: call({{.*}}frontend_attributes={_scheduling_group_id="2",_xla_stream_annotation="2",inlineable="false"}',
        "CHECK-DAG: while(",
    ]


PAIRS_1D_8_UP = "[[0, 1], [1, 2], [2, 3], [3, 4], [4, 5], [5, 6], [6, 7], [7, 0]]"
PAIRS_2X4_MODEL_UP = "[[0, 1], [1, 2], [2, 3], [3, 0], [4, 5], [5, 6], [6, 7], [7, 4]]"


PAIRS_2X4_MODEL = "[[0, 3], [1, 0], [2, 1], [3, 2], [4, 7], [5, 4], [6, 5], [7, 6]]"
PAIRS_1D_8 = "[[0, 7], [1, 0], [2, 1], [3, 2], [4, 3], [5, 4], [6, 5], [7, 6]]"
PAIRS_2X4_DATA = "[[0, 4], [4, 0], [1, 5], [5, 1], [2, 6], [6, 2], [3, 7], [7, 3]]"
# group [0, 4, 1, 5, 2, 6, 3, 7]: each position sends to the previous one
PAIRS_MODEL_DATA = "[[0, 7], [4, 0], [1, 4], [5, 1], [2, 5], [6, 2], [3, 6], [7, 3]]"


def under_legacy_partitioner(build: Callable[[], str]) -> Callable[[], str]:
    """The same program lowered with Shardy off (the body becomes func.func private @shmap_body)."""

    def lowered() -> str:
        jax.config.update("jax_use_shardy_partitioner", False)
        try:
            return build()
        finally:
            jax.config.update("jax_use_shardy_partitioner", True)

    return lowered



def scatter(y, axis_name, dim, tiled=True):
    return jax.lax.psum_scatter(y, axis_name, scatter_dimension=dim, tiled=tiled)
