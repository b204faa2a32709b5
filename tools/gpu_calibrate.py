#!/usr/bin/env python
"""Calibrate the cost model on one accelerator: how much dot throughput the ring's split keeps.

A ring rewrite replaces one dot by ``n`` dots ``n`` times smaller.  On one device, at the
shapes one device of an ``n``-way tensor-parallel MLP block runs, this script times

* **full**: the one dot the original program runs after its all_gather (before its
  reduce_scatter);
* **loop**: the windowed loop's ``n`` per-step dots in a ``fori_loop``, with the permutes
  elided (the next shard is read from local memory instead of received), each step's result
  placed with a dynamic_update_slice (gather) or added to the running partial sum (scatter)
  as the rewrite does;
* **unrolled**: the same ``n`` steps straight-line (the ``--unroll full`` form), each block
  placed or sliced at an offset known only at run time, as the ring's are (:func:`at_run_time`);
* **step dots** (:func:`step_dots`): the gather's dot alone at a shard's rows, two shards',
  half and all of them, to tell the GEMM's own loss at a step's shape from what the steps add;
* **ring_uni**, **ring_unroll2** (each site): the ring loop as the pass emits it, one or two
  rounds per trip, each permute a ``collective_permute`` from the device to itself
  (:func:`ring_programs`, :func:`scatter_ring_programs`), next to what the cost model predicts
  for it with this run's profile and no transfer time (:func:`ring_model`),

each for the forward's gather and scatter sites; the gather's again with the gate and up
projections' dots merged into one (twice the columns: the step the pass runs in an MLP block,
``Options.merge_dots``, a point of the gather's own at twice the FLOPs); and the full dot, loop
and straight-line steps for a gather's contracting role (the backward's weight gradient, :func:`contracting_programs`) and
batch role (:func:`batch_programs`: the free role's step, plus the slice of the other operand)
too: their splits become the roles' own points, reported beside what the gather's points give; it
checks that the decompositions compute what they should, and reports the efficiency
``t_full / t_loop`` (target >= 0.95 at 70B-like shapes).  For the cost model it splits that
loss in two (:func:`summarise`): the straight-line dots' efficiency ``t_full / t_unrolled``
and what one loop trip costs beyond them, ``(t_loop - t_unrolled) / n``; with the full dot's
achieved throughput they make a ``--hardware`` override for the profile::

    python tools/gpu_calibrate.py --model 70b --profile h100      # on the GPU
    python -m cmatmul_pass explain module.mlir --hardware \
        "h100:bf16=6.86e+14,split.gather=15032385536:0.741/60129542144:0.851,split.scatter=...,loop_trip.gather=..."

It also times the gather's full dot in every element type the profiles price (bf16, f16, f32,
f8, f64, i8, i32; :func:`element_rates`) and prints them as an override of the profile's ``flops``.

Runs on any backend (on CPU with ``--dims`` small enough, for the tests); results go to
``--out`` (default ``build/bench/gpu_calibration.json``).  Tests run it, but never assert its timings.
Each run's override holds its own points among the profile's; ``--merge RUN.json ...`` times
nothing and prints several runs' points together (:func:`merge`), as an override and as the
fields of ``cost.PROFILES``::

    python tools/gpu_calibrate.py --merge tools/gpu_measurements/h100_calibrate_70b.json \\
        tools/gpu_measurements/h100_calibrate_8b.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from cmatmul_pass import cost  # noqa: E402
from cmatmul_pass.execute import interleaved_medians  # noqa: E402
from tools.bench import write_results  # noqa: E402

#: (tokens = sequence x batch, hidden, ffn) of the MLP blocks the README's sanity table uses
#: (tokens, hidden, ffn) of an MLP block: Llama-3-70B-, 8B- and 3.2-3B-like (the 3B one: a ring step
#: of 6.4 GFLOP, below the smallest step the profiles have measured), and a tiny one for CPU
MODELS = {"70b": (8192, 8192, 28672), "8b": (8192, 4096, 14336), "3b": (8192, 3072, 8192), "tiny": (256, 128, 512)}
DTYPES = {"bf16": jnp.bfloat16, "f16": jnp.float16, "f32": jnp.float32}
#: relative tolerance of the decompositions against the full dot, per dtype (sums in another order)
TOLERANCE = {"bf16": 2e-2, "f16": 5e-3, "f32": 1e-4}


def at_run_time(offset: int):
    """``offset`` as a value XLA cannot fold: the ring's block offsets depend on the device's
    position, known only at run time, so its straight-line rounds place (gather) or slice
    (scatter) their blocks at dynamic offsets.  With constant offsets XLA turns the scatter's
    slices into free views, which the pass's rings do not get."""
    return jax.lax.optimization_barrier(jnp.int32(offset))


def gather_programs(n: int):
    """The gathered activations [T, H] times a column block of the weight [H, F/n]."""

    def full(x, w):
        return x @ w

    def loop(x, w):
        rows = x.shape[0] // n
        out = jnp.zeros((x.shape[0], w.shape[1]), x.dtype)

        def step(i, out):
            held = jax.lax.dynamic_slice_in_dim(x, i * rows, rows)  # stands in for the received shard
            return jax.lax.dynamic_update_slice_in_dim(out, held @ w, i * rows, 0)

        return jax.lax.fori_loop(0, n, step, out)

    def unrolled(x, w):
        rows = x.shape[0] // n
        out = jnp.zeros((x.shape[0], w.shape[1]), x.dtype)
        for i in range(n):  # the shard itself is the operand (received, not sliced); its block lands at run time
            out = jax.lax.dynamic_update_slice_in_dim(out, x[i * rows:(i + 1) * rows] @ w, at_run_time(i * rows), 0)
        return out

    return full, loop, unrolled, lambda product: product.astype(jnp.float32)


def scatter_programs(n: int):
    """The local product rows [T, F/n] times a row block of the weight [F/n, H]: the original
    runs the whole [T, H] product, then reduce-scatters its rows.  The ring computes one row
    block of the product per step and adds it to the partial sum it received; with the
    permute elided the partial sum is the running one (so the loop returns the sum of the
    row blocks, which the check compares with the full product's)."""

    def full(y, w):
        return y @ w

    def loop(y, w):
        rows = y.shape[0] // n
        acc = jnp.zeros((rows, w.shape[1]), y.dtype)

        def step(i, acc):
            return acc + jax.lax.dynamic_slice_in_dim(y, i * rows, rows) @ w

        return jax.lax.fori_loop(0, n, step, acc)

    def unrolled(y, w):
        rows = y.shape[0] // n
        block = lambda i: jax.lax.dynamic_slice_in_dim(y, at_run_time(i * rows), rows)  # noqa: E731
        acc = block(0) @ w
        for i in range(1, n):
            acc = acc + block(i) @ w
        return acc

    def reference(product):
        return product.reshape(n, -1, product.shape[-1]).astype(jnp.float32).sum(0)

    return full, loop, unrolled, reference


def contracting_programs(n: int):
    """A gather ring's contracting role: the backward's weight gradient of a row-parallel layer,
    ``a^T @ dy`` with ``a`` the local [T, F/n] and ``dy`` [T, H] gathered along the tokens, which
    the dot contracts.  The ring multiplies the row block of ``a`` that pairs with each shard of
    ``dy`` (a dynamic slice of ``a``) into a partial [F/n, H] in f32, adds it to an f32
    accumulator, and converts the sum once at the end (rewrites/all_gather_dot: a bf16/f16
    contraction's partials are summed in f32), so every round reads and writes the whole
    output-sized accumulator, where the full dot writes its output once."""
    dims = (((0,), (0,)), ((), ()))

    def partial(a_block, dy_block):
        return jax.lax.dot_general(a_block, dy_block, dims, preferred_element_type=jnp.float32)

    def full(a, dy):
        return jax.lax.dot_general(a, dy, dims)

    def loop(a, dy):
        rows = a.shape[0] // n
        acc = jnp.zeros((a.shape[1], dy.shape[1]), jnp.float32)

        def step(i, acc):
            block = lambda x: jax.lax.dynamic_slice_in_dim(x, i * rows, rows)  # noqa: E731
            return acc + partial(block(a), block(dy))  # dy's block stands in for the received shard

        return jax.lax.fori_loop(0, n, step, acc).astype(a.dtype)

    def unrolled(a, dy):
        rows = a.shape[0] // n
        acc = None
        for i in range(n):  # the shard itself is the operand; a's paired block is sliced at run time
            product = partial(jax.lax.dynamic_slice_in_dim(a, at_run_time(i * rows), rows), dy[i * rows:(i + 1) * rows])
            acc = product if acc is None else acc + product
        return acc.astype(a.dtype)

    return full, loop, unrolled, lambda product: product.astype(jnp.float32)


def batch_programs(n: int):
    """A gather ring's batch role: ``x`` [B, T, K] gathered along its batch dim B, times ``w``
    [B, K, M], batch dims paired.  Each round multiplies the received shard [B/n, T, K] by the
    block of ``w`` that pairs with it, a dynamic slice [B/n, K, M] taken at the shard's run-time
    offset (rewrites/all_gather_dot: the other operand of a batch role is sliced every round),
    and places the [B/n, T, M] product at the same offset; the free role's rounds slice nothing.
    At B = n and the free role's T/n, K and M (``main``), each round's dot is the gather's free
    step, so the two splits differ by what the slice of ``w`` costs."""
    dims = (((2,), (1,)), ((0,), (0,)))

    def product(x_block, w_block):
        return jax.lax.dot_general(x_block, w_block, dims)

    def full(x, w):
        return product(x, w)

    def loop(x, w):
        rows = x.shape[0] // n
        out = jnp.zeros((x.shape[0], x.shape[1], w.shape[2]), x.dtype)

        def step(i, out):
            block = lambda v: jax.lax.dynamic_slice_in_dim(v, i * rows, rows)  # noqa: E731
            return jax.lax.dynamic_update_slice_in_dim(out, product(block(x), block(w)), i * rows, 0)

        return jax.lax.fori_loop(0, n, step, out)

    def unrolled(x, w):
        rows = x.shape[0] // n
        out = jnp.zeros((x.shape[0], x.shape[1], w.shape[2]), x.dtype)
        for i in range(n):  # the shard itself is the operand; w's paired block is sliced at run time
            at = at_run_time(i * rows)
            paired = jax.lax.dynamic_slice_in_dim(w, at, rows)
            out = jax.lax.dynamic_update_slice_in_dim(out, product(x[i * rows:(i + 1) * rows], paired), at, 0)
        return out

    return full, loop, unrolled, lambda product: product.astype(jnp.float32)


#: the sites measured: (site kind, role of the gathered/scattered dim) -> their programs.  The
#: profiles' split and loop-trip points are per site kind, measured on the free roles (the
#: forward's rings); another role's split becomes points of its own.
SITES = {
    ("all_gather_dot", "free"): gather_programs,
    ("dot_reduce_scatter", "free"): scatter_programs,
    ("all_gather_dot", "contracting"): contracting_programs,
    ("all_gather_dot", "batch"): batch_programs,
}


def _one_device(device):
    """``(wrap, send)``: ``wrap(body)`` runs ``body`` on a ring of one device (a 1-device mesh),
    ``send(value)`` is one permute of ``value`` from the device to itself: a real asynchronous
    transfer (a local one) in the ring's data flow, so XLA makes the copy decisions it makes for
    a ring of several devices (the received value is a fresh buffer the next round reads)."""
    from jax.sharding import Mesh, PartitionSpec as P

    mesh = Mesh(np.array([device]), ("ring",))

    def wrap(body):
        return jax.shard_map(body, mesh=mesh, in_specs=(P(), P()), out_specs=P(), check_vma=False)

    def send(value):
        return jax.lax.ppermute(value, "ring", [(0, 0)])

    return wrap, send


def _tied(args: tuple, tie: bool) -> tuple:
    """A round's dot operands through an optimization barrier, as the pass ties the dots of a
    block of several rounds (``tie_rounds``: XLA must not merge them)."""
    return jax.lax.optimization_barrier(args) if tie else args


def _ahead(n: int, per_trip: int) -> int:
    """Of a ring's ``n - 1`` sending (gather) or receiving (scatter) rounds, those that go before
    the loop: the remainder of ``per_trip`` (cost.loop_run)."""
    return (n - 1) % per_trip


def ring_programs(n: int, device):
    """The gather ring as the pass emits it, on one device (:func:`_one_device`).  ``uni``: one
    round per trip, ``unroll2``: two, each round's operands tied through an optimization barrier
    and the second round's send tied to the first round's dot, as the pass ties them.  The
    shard never changes (it is sent to itself), so every block of the result is
    ``x_shard @ w``; that is what they are checked against.  Returns {name: fn(x_shard, w)} and
    the reference."""
    wrap, send = _one_device(device)

    def place(out, held, w, i, rows, tie):
        """``out`` with block ``i`` set to ``held @ w``, and that product."""
        held, w = _tied((held, w), tie)
        product = held @ w
        return jax.lax.dynamic_update_slice_in_dim(out, product, i * rows, 0), product

    def ring(per_trip: int):
        def body(held, w):
            rows = held.shape[0]
            out = jnp.zeros((rows * n, w.shape[1]), held.dtype)
            first = _ahead(n, per_trip)

            for r in range(first):  # the remainder of the loop's rounds, before it
                held, out = send(held), place(out, held, w, r, rows, per_trip > 1)[0]

            def trip(t, carry):
                held, out = carry
                previous = None
                for j in range(per_trip):
                    # as the pass ties them: a round sends after the previous round's dot
                    sent = held if previous is None else jax.lax.optimization_barrier((held, previous))[0]
                    nxt = send(sent)
                    out, previous = place(out, held, w, first + t * per_trip + j, rows, per_trip > 1)
                    held = nxt
                return held, out

            held, out = jax.lax.fori_loop(0, (n - 1) // per_trip, trip, (held, out))
            return place(out, held, w, n - 1, rows, per_trip > 1)[0]  # the last round sends nothing

        return wrap(body)

    def reference(x_shard, w):
        return jnp.tile(x_shard @ w, (n, 1)).astype(jnp.float32)

    return {"ring_uni": ring(1), "ring_unroll2": ring(2)}, reference


def scatter_ring_programs(n: int, device):
    """The scatter ring as the pass emits it, on one device (:func:`_one_device`): round 0 computes
    block 0 of the product ``y @ w`` (its rows), each later round receives the partial sum (from
    the device itself) and adds its own block to it; the blocks are sliced at run-time offsets.
    ``unroll2`` ties each round's operands as the pass does.  As the partial sum comes back
    unchanged, the result is the sum of the product's ``n`` row blocks.  Returns
    {name: fn(y, w)} and the reference."""
    wrap, send = _one_device(device)

    def ring(per_trip: int):
        tie = per_trip > 1

        def body(y, w):
            rows = y.shape[0] // n

            def mine(block):  # this round's block of the product
                args = _tied((jax.lax.dynamic_slice_in_dim(y, block * rows, rows), w), tie)
                return args[0] @ args[1]

            before = 1 + _ahead(n, per_trip)  # round 0 (it receives nothing) and the remainder
            acc = mine(at_run_time(0))
            for r in range(1, before):
                acc = send(acc) + mine(at_run_time(r))

            def trip(t, acc):
                for j in range(per_trip):
                    acc = send(acc) + mine(before + t * per_trip + j)
                return acc

            return jax.lax.fori_loop(0, (n - 1) // per_trip, trip, acc)

        return wrap(body)

    def reference(y, w):
        return (y.astype(jnp.float32) @ w.astype(jnp.float32)).reshape(n, -1, w.shape[1]).sum(0)

    return {"ring_uni": ring(1), "ring_unroll2": ring(2)}, reference


def _random_inputs(shapes, dtype: str, device, seed: int) -> list:
    """Standard-normal arrays of ``shapes`` in ``dtype``, on ``device``."""
    rng = np.random.default_rng(seed)
    return [jax.device_put(jnp.asarray(rng.standard_normal(s, dtype=np.float32), DTYPES[dtype]), device) for s in shapes]


def _checked_error(what: str, got, expected: np.ndarray, dtype: str) -> float:
    """``got``'s largest difference from ``expected``, relative to ``expected``'s largest
    magnitude; beyond ``dtype``'s :data:`TOLERANCE` the program is wrong: stop, saying ``what``."""
    error = float(np.abs(np.asarray(got.astype(jnp.float32)) - expected).max()) / (float(np.abs(expected).max()) or 1.0)
    if error > TOLERANCE[dtype]:
        raise SystemExit(f"{what} off by {error:.2e} (relative): not timing it")
    return error


#: per site kind: its one-device rings, and the arguments they take from the full dot's
RINGS = {
    "all_gather_dot": (ring_programs, lambda x, w, n: (x[: x.shape[0] // n], w)),
    "dot_reduce_scatter": (scatter_ring_programs, lambda y, w, n: (y, w)),
}


def measure_rings(kind: str, n: int, shapes, dtype: str, runs: int, device, reps: int = 1) -> dict:
    """The site's ring loops (:data:`RINGS`) against its full dot ``[T, K] @ [K, M]``: a gather
    ring multiplies the shard [T/n, K] in every round, a scatter ring a row block of [T, K]."""
    (t, k), (_, m) = shapes
    make, ring_args = RINGS[kind]
    programs, reference = make(n, device)
    x, w = _random_inputs([(t, k), (k, m)], dtype, device, seed=1)
    args = ring_args(x, w, n)
    expected = np.asarray(reference(*args))
    timed = {"full": (jax.jit(lambda x, w: x @ w), (x, w))}
    errors = {}
    for name, fn in programs.items():
        fn = jax.jit(fn)
        errors[name] = _checked_error(f"{kind} {name}:", fn(*args), expected, dtype)
        timed[name] = (fn, args)
    seconds = seconds_per_call(timed, runs, reps)
    result = {"full_s": seconds["full"], "timing": "interleaved"}
    for name in programs:
        result[name] = {"seconds": seconds[name], "efficiency": seconds["full"] / seconds[name],
                        "max_relative_error": errors[name]}
    return result


def ring_model(kind: str, rings: dict, n: int, shapes, dtype: str, override: str) -> dict:
    """What the cost model predicts for the one-device rings of :func:`measure_rings`, per ring:
    the profile ``override`` (this run's points among the profile's), with the throughput of the
    full dot timed beside the rings and no transfer time (a permute to the device itself moves
    nothing over a link); the per-round ``step`` and the loop trips stay.  Returns
    {ring: {"model_s", "measured_over_model"}}."""
    (t, k), (_, m) = shapes
    flops = 2.0 * t * k * m  # the rings' n dots together do the full dot's work
    hw = replace(cost.hardware(override), flops={dtype: flops / rings["full_s"]}, bandwidth=math.inf)
    step_bytes = (t // n) * (k if kind == "all_gather_dot" else m) * jnp.dtype(DTYPES[dtype]).itemsize
    shape = cost.SiteShape(kind, n, flops, step_bytes, dtype)
    out = {}
    for name, unroll in (("ring_uni", 1), ("ring_unroll2", 2)):
        predicted = cost.overlapped_time(shape, hw, False, unroll)
        out[name] = {"model_s": predicted, "measured_over_model": rings[name]["seconds"] / predicted}
    return out


def measure(kind: str, n: int, shapes, dtype: str, runs: int, device, reps: int = 1, role: str = "free") -> dict:
    """The full dot, the loop and the straight-line steps of site ``(kind, role)`` (:data:`SITES`);
    ``shapes``: the full dot's operands, ``[T, K] @ [K, M]`` (a contracting role's ``[T, K]^T @ [T, M]``,
    a batch role's ``[B, T, K] @ [B, K, M]``)."""
    full, loop, unrolled, reference = SITES[kind, role](n)
    args = _random_inputs(shapes, dtype, device, seed=0)
    full_j, loop_j, unrolled_j = jax.jit(full), jax.jit(loop), jax.jit(unrolled)
    expected = np.asarray(reference(full_j(*args)), np.float32)
    errors = {name: _checked_error(f"{kind} ({role}): the {name} decomposition is", fn(*args), expected, dtype)
              for name, fn in (("loop", loop_j), ("unrolled", unrolled_j))}
    seconds = seconds_per_call({"full": (full_j, args), "loop": (loop_j, args), "unrolled": (unrolled_j, args)},
                               runs, reps)
    t_full, t_loop, t_unrolled = seconds["full"], seconds["loop"], seconds["unrolled"]
    # [T, K] @ [K, M], [T, K]^T @ [T, M] or [B, T, K] @ [B, K, M]: twice the first operand's size
    # times the second's last dim
    flops = 2.0 * math.prod(shapes[0]) * shapes[1][-1]
    return {
        "kind": kind, "role": role, "shapes": [list(s) for s in shapes], "flops": flops, "reps": reps,
        "full_s": t_full, "loop_s": t_loop, "unrolled_s": t_unrolled, "timing": "interleaved",
        "efficiency_loop": t_full / t_loop, "efficiency_unrolled": t_full / t_unrolled,
        # what a trip of the loop costs beyond the same dots straight-line (cost.Hardware.loop_trip)
        "loop_trip_s": max(0.0, (t_loop - t_unrolled) / n),
        "full_throughput": flops / t_full, "max_relative_error": errors,
    }


def step_dots(shapes, n: int, dtype: str, runs: int, device, reps: int = 1) -> dict:
    """The gather's dot alone, no loop, no slices: ``[rows, K] @ [K, M]`` for ``rows`` the
    shard's (``T/n``), two shards', half and all of ``T`` (``shapes``: the full dot's
    operands).  If the shard-sized dot alone keeps about what the straight-line steps keep
    (``efficiency_unrolled``), the split loss is the GEMM's at that shape (tiles over the SMs,
    the library's choice of kernel) and no placement of the blocks recovers it; if it keeps
    much more, the loss is in what the steps add around their dots (the slices and updates at
    run-time offsets).  ``efficiency``: each size's throughput over the full dot's."""
    (tokens, k), (_, m) = shapes
    sizes = sorted({tokens // n, 2 * tokens // n, tokens // 2, tokens})
    dot = jax.jit(lambda x, w: x @ w)
    w = _random_inputs([(k, m)], dtype, device, seed=1)[0]
    timed = {size: (dot, (_random_inputs([(size, k)], dtype, device, seed=2)[0], w)) for size in sizes}
    rows = {size: {"seconds": t, "throughput": 2.0 * size * k * m / t}
            for size, t in seconds_per_call(timed, runs, reps).items()}
    for r in rows.values():
        r["efficiency"] = r["throughput"] / rows[tokens]["throughput"]
    return {"shapes": [list(s) for s in shapes], "rows": rows}


#: the element types whose dot throughput the profiles price (cost.Hardware.flops, by the key
#: cost.dtype_family gives): operand type and the dot's preferred element type
RATE_TYPES = {
    "bf16": (jnp.bfloat16, None), "f16": (jnp.float16, None), "f32": (jnp.float32, None),
    "f8": (jnp.float8_e4m3fn, jnp.bfloat16), "f64": (jnp.float64, None),
    "i8": (jnp.int8, jnp.int32), "i32": (jnp.int32, None),
}


#: seconds per call above which :func:`element_rates` times a type's dot alone, over at most
#: SLOW_CALLS calls, rather than ``runs x reps`` of them in turn with the others: XLA may run an
#: integer or f64 dot without a library GEMM, far below the tensor cores' rate, and 200 calls of
#: it at 70B shapes would hold tools/gpu_checks.sh's step past its time limit (losing the run)
SLOW_CALL_S, SLOW_CALLS = 0.05, 3


def element_rates(shapes, runs: int, device, reps: int = 1) -> dict:
    """The gather's full dot ``[T, K] @ [K, M]`` (``shapes``) in each of :data:`RATE_TYPES`, timed
    in turn: the throughput XLA's dot reaches per element type (``rates``: seconds, FLOP/s and
    that over bf16's), for the profile's ``flops`` entries, which until measured are published
    peaks scaled by bf16's achieved fraction (f8, f64).  A type whose one call takes more than
    :data:`SLOW_CALL_S` is timed alone (``"timing": "alone"``: the fastest of up to
    :data:`SLOW_CALLS` calls, fewer where a call takes over a second).  Timings only: nothing is
    checked."""
    (t, k), (_, m) = shapes
    flops = 2.0 * t * k * m
    rng = np.random.default_rng(3)
    x32, w32 = rng.standard_normal((t, k), dtype=np.float32), rng.standard_normal((k, m), dtype=np.float32)
    with jax.enable_x64(True):  # f64 operands stay f64; every other type is explicit
        timed = {}
        for key, (dtype, preferred) in RATE_TYPES.items():
            args = tuple(jax.device_put(jnp.asarray(a, dtype), device) for a in (x32, w32))
            timed[key] = (jax.jit(lambda x, w, p=preferred: jnp.matmul(x, w, preferred_element_type=p)), args)
        alone = {}
        for key, (fn, args) in list(timed.items()):
            jax.block_until_ready(fn(*args))  # compiled and run once
            one = _one_call(fn, args)
            if one > SLOW_CALL_S:
                alone[key] = min([one, *(_one_call(fn, args) for _ in range(SLOW_CALLS - 1 if one < 1 else 0))])
                del timed[key]
        seconds = {**seconds_per_call(timed, runs, reps), **alone}
    rates = {key: {"seconds": seconds[key], "throughput": flops / seconds[key]} for key in RATE_TYPES}
    for key in alone:
        rates[key]["timing"] = "alone"
    for r in rates.values():
        r["over_bf16"] = r["throughput"] / rates["bf16"]["throughput"]
    return {"shapes": [list(s) for s in shapes], "flops": flops, "rates": rates}


def _one_call(fn, args) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def rates_override(profile: str, throughputs: dict[str, float]) -> str:
    """The ``--hardware`` override setting each element type's measured throughput."""
    override = f"{profile}:" + ",".join(f"{key}={rate:.3g}" for key, rate in throughputs.items())
    cost.hardware(override)  # what it prints must be a valid --hardware
    return override


def batched(fn, args, reps: int):
    """One timed sample: ``reps`` calls queued back to back, then one wait.  The device runs
    them without gaps, so the host's dispatch cost (tens of µs a call) stays out of the
    per-call time, as long as a call takes longer on the device than to dispatch."""

    def run():
        out = None
        for _ in range(reps):
            out = fn(*args)
        jax.block_until_ready(out)

    return run


def seconds_per_call(programs: dict, runs: int, reps: int) -> dict:
    """Seconds per call of each program ``{name: (fn, args)}``: the median of ``runs`` samples of
    ``reps`` calls each (:func:`batched`), timed in turn, one sample of each per round
    (``interleaved_medians``): the GPU's clock drifts by several % between blocks of runs, and
    what is measured here are the programs' ratios to each other."""
    timed = {name: batched(fn, args, reps) for name, (fn, args) in programs.items()}
    return {name: t / reps for name, t in interleaved_medians(timed, runs).items()}


#: the format each field's values are printed in
FORMATS = {"split": ".3f", "loop_trip": ".3g"}


def measured_points(sites: list[dict], n: int) -> dict[tuple[str, str, str], dict[float, float]]:
    """The points ``sites`` measured, by ``(prefix, kind, role)`` (``prefix``: ``split`` or
    ``loop_trip``, as the ``--hardware`` override names them), each ``{FLOPs of a ring step's
    dot: value}``: every site's straight-line split (a free role's is its kind's, another
    role's its own), and the free roles' loop trips (a trip is the ring's, whatever its dots).
    Sites of runs before roles were measured name none: free."""
    points: dict[tuple[str, str, str], dict[float, float]] = {}
    for site in sites:
        role, step = site.get("role", "free"), site["flops"] / n
        points.setdefault(("split", site["kind"], role), {})[step] = site["efficiency_unrolled"]
        if role == "free":
            points.setdefault(("loop_trip", site["kind"], role), {})[step] = site["loop_trip_s"]
    return points


def _curve(known: cost.Hardware, prefix: str, kind: str, role: str, measured: dict[float, float]) -> str:
    """The override item ``<prefix>.<kind>[/<role>]=F:V/...``: the ``measured`` points among the
    profile's own points for that kind and role, replacing those at the same FLOPs (a profile's
    one number for every site was never measured per size, and another role's stand-in points
    are the kind's: neither is kept as a point)."""
    field_name = cost.POINT_FIELDS[prefix]
    measured_before = isinstance(getattr(known, field_name), dict) and known.has_role_points(field_name, kind, role)
    curve = dict(known.kind_points(field_name, kind, role)) if measured_before else {}
    curve.update(measured)
    name = cost.SHORT_NAMES[kind] + ("" if role == "free" else f"/{role}")
    return f"{prefix}.{name}=" + "/".join(f"{f:.12g}:{v:{FORMATS[prefix]}}" for f, v in sorted(curve.items()))


def override_for(profile: str, dtype: str, throughput: float, points: dict[tuple[str, str, str], dict]) -> str:
    """The ``--hardware`` override that puts ``points`` (:func:`measured_points`) among
    ``profile``'s and sets ``dtype``'s throughput: splits then loop trips, each kind's free role
    first, then its other roles (:data:`cmatmul_pass.cost.POINT_ROLES`)."""
    known = cost.hardware(profile)
    curves = [_curve(known, prefix, kind, role, points[prefix, kind, role])
              for prefix in FORMATS for kind in cost.KIND_NAMES.values() for role in ("free", *cost.POINT_ROLES)
              if (prefix, kind, role) in points]
    override = f"{profile}:{dtype}={throughput:.3g},{','.join(curves)}"
    cost.hardware(override)  # what it prints must be a valid --hardware
    return override


def summarise(sites: list[dict], profile: str, dtype: str, target: float, n: int) -> dict:
    """The calibration from the sites' timings.

    ``loop_efficiency`` (the target's measure): the full dot's time over the loop's, worst
    site.  The cost model takes the loop apart: what the straight-line ``1/n``-sized dots keep
    of the full dot's throughput divides each ring round's compute, and ``loop_trip``, what a
    trip costs beyond the same dots straight-line, is added per trip; the split from the loop
    would count the trips twice.  Both are measured per site kind at this model's step size
    (``split_points``: per kind, (FLOPs of one step's dot, fraction) for each free site, the
    single and the merged gather; ``loop_trip_points``: (FLOPs, seconds));
    the override puts each point among the profile's own (replacing one measured at the same
    size), so the profile interpolates between this run and the runs it was calibrated with
    (:meth:`cmatmul_pass.cost.Hardware.split`, :meth:`~cmatmul_pass.cost.Hardware.trip`).
    ``split_efficiency`` and ``loop_trip_s``: the worst such site's.  The kinds' points and the
    throughput come from the free roles' sites; another role's straight-line split becomes a
    point of that role's own (``split.gather/contracting=...``, ``split.gather/batch=...``,
    :meth:`cmatmul_pass.cost.Hardware.split`; :func:`override_for`),
    and ``roles`` sets its measurement beside what the kind's points would have given a step of
    its size (``split_from_points``, ``loop_trip_from_points``).  ``loop_efficiency`` is the
    worst of every site."""
    loop_efficiency = min(s["efficiency_loop"] for s in sites)
    profiled = [s for s in sites if s["role"] == "free"]
    others = [s for s in sites if s["role"] != "free"]
    split = min(s["efficiency_unrolled"] for s in profiled)
    throughput = statistics.median(s["full_throughput"] for s in profiled)
    loop_trip = max(s["loop_trip_s"] for s in profiled)
    measured = measured_points(sites, n)
    points, trip_points = ({kind: sorted(values.items()) for (name, kind, role), values in measured.items()
                            if name == prefix and role == "free"} for prefix in ("split", "loop_trip"))
    override = override_for(profile, dtype, throughput, measured)
    hw = cost.hardware(override)
    roles = {f"{s['kind']} {s['role']}": {
        "split": s["efficiency_unrolled"], "split_from_points": hw.split(s["kind"], s["flops"] / n),
        "loop_trip_s": s["loop_trip_s"], "loop_trip_from_points": hw.trip(s["kind"], s["flops"] / n),
    } for s in others}
    return {"loop_efficiency": loop_efficiency, "split_efficiency": split, "split_points": points,
            "loop_trip_s": loop_trip, "loop_trip_points": trip_points, "full_throughput": throughput,
            "target": target, "meets_target": loop_efficiency >= target, "hardware_override": override,
            "roles": roles}


def read_runs(path: str | Path) -> list[dict]:
    """The runs a measurement file holds: one run (the JSON this tool or tools/gpu_topology.py
    writes), or a list of runs (a model's repeated runs kept in one file, in the order they ran)."""
    data = json.loads(Path(path).read_text())
    return data if isinstance(data, list) else [data]


def merge(paths: list[str], profile: str) -> dict:
    """Several calibration runs (their JSONs: :func:`read_runs`) as one profile: every run's points
    (:func:`measured_points`, each at its own ring size) among ``profile``'s, a later model's
    replacing an earlier one's at the same step size, and the median throughput of the runs'
    free sites' full dots.  Repeated runs of one model (the same ``model`` in their JSONs) count
    as one: each point, full dot and element rate the median of theirs (at small steps one run's
    noise is large: docs/gpu.md, section 9).  Returns the ``--hardware`` override and the points
    by field, ready for ``cost.PROFILES`` (``fields``: {field: {point key: ((FLOPs, value), ...)}})."""
    runs = [run for path in paths for run in read_runs(path)]
    dtypes = {run["dtype"] for run in runs}
    if len(dtypes) != 1:
        raise SystemExit(f"the runs measured different dtypes ({', '.join(sorted(dtypes))}): merge one dtype's")
    models: dict[object, list[dict]] = {}  # runs of a model, in the order the models first come
    for index, run in enumerate(runs):
        models.setdefault(run.get("model", index), []).append(run)
    points: dict[tuple[str, str, str], dict[float, float]] = {}
    full_dots: list[float] = []
    timed: dict[str, list[float]] = {}  # each element type's rate, one per model that timed it
    for group in models.values():
        measured = [measured_points(run["sites"], run["ring"]) for run in group]
        for key in dict.fromkeys(k for m in measured for k in m):
            steps = dict.fromkeys(step for m in measured for step in m.get(key, {}))
            points.setdefault(key, {}).update(
                {step: statistics.median(m[key][step] for m in measured if step in m.get(key, {})) for step in steps})
        free = [[s["full_throughput"] for s in run["sites"] if s.get("role", "free") == "free"] for run in group]
        full_dots += [statistics.median(site) for site in zip(*free)]  # each site's median over the runs
        rates: dict[str, list[float]] = {}
        for run in group:  # (runs before element_rates timed none)
            for key, r in run.get("element_rates", {}).get("rates", {}).items():
                rates.setdefault(key, []).append(r["throughput"])
        for key, values in rates.items():
            timed.setdefault(key, []).append(statistics.median(values))
    throughput = statistics.median(full_dots)
    override = override_for(profile, dtypes.pop(), throughput, points)
    hw = cost.hardware(override)
    fields = {}
    for prefix, kind, role in points:
        field_name = cost.POINT_FIELDS[prefix]
        fields.setdefault(field_name, {})[cost.point_key(kind, role)] = hw.kind_points(field_name, kind, role)
    rates = {key: statistics.median(values) for key, values in timed.items()}
    return {"runs": [str(p) for p in paths], "hardware_override": override, "throughput": throughput,
            "fields": fields, "rates": rates, "rates_override": rates_override(profile, rates) if rates else None}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="70b")
    parser.add_argument("--dims", type=int, nargs=3, metavar=("TOKENS", "HIDDEN", "FFN"), help="instead of --model")
    parser.add_argument("--ring", type=int, default=8, help="tensor-parallel degree n")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--runs", type=int, default=20, help="timed samples (the median is reported)")
    parser.add_argument("--reps", type=int, default=10, help="calls queued per timed sample")
    parser.add_argument("--profile", default="h100", help="the cost-model profile the override is for")
    parser.add_argument("--target", type=float, default=0.95, help="efficiency to report against")
    parser.add_argument("--out", default=str(ROOT / "build" / "bench" / "gpu_calibration.json"))
    parser.add_argument("--merge", nargs="+", metavar="RUN.json",
                        help="time nothing: merge these runs' points into the profile's and print them")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.merge:
        merged = merge(args.merge, args.profile)
        print(f"cost model: --hardware \"{merged['hardware_override']}\"")
        print(f"for cost.PROFILES[{args.profile!r}] (throughput {merged['throughput']:.3g} FLOP/s):")
        for field_name, by_key in merged["fields"].items():
            print(f"    {field_name}={{" + ", ".join(f"{key!r}: {points!r}" for key, points in by_key.items()) + "},")
        if merged["rates"]:
            print("    flops={" + ", ".join(f"{key!r}: {rate:.3g}" for key, rate in merged["rates"].items())
                  + f", 'default': {merged['rates']['bf16']:.3g}}},")
            print(f"element types: --hardware \"{merged['rates_override']}\"")
        return 0
    tokens, hidden, ffn = args.dims or MODELS[args.model]
    n = args.ring
    if tokens % n or ffn % n:
        parser.error(f"tokens ({tokens}) and ffn ({ffn}) must divide by the ring size {n}")
    cost.hardware(args.profile)  # an unknown profile fails here, before any timing
    device = jax.devices()[0]
    shapes = {  # per site kind, the full dot [T, K] @ [K, M] one device of the block runs
        "all_gather_dot": [(tokens, hidden), (hidden, ffn // n)],
        "dot_reduce_scatter": [(tokens, ffn // n), (ffn // n, hidden)],
    }
    sites = [measure(kind, n, s, args.dtype, args.runs, device, args.reps) for kind, s in shapes.items()]
    # the gather's step as the pass runs it in this block: the gate and up projections' dots merged
    # into one on the weights concatenated (Options.merge_dots), twice the columns and FLOPs; the
    # cost model's MLP block (cost.mlp_block) prices that step, which the single dot's points
    # only reach by extrapolation (flat above the largest)
    merged = measure("all_gather_dot", n, [(tokens, hidden), (hidden, 2 * (ffn // n))], args.dtype, args.runs, device,
                     args.reps)
    sites.append({**merged, "merged_dots": 2})
    # the backward's weight gradient of the down projection: a [T, F/n]^T @ gathered dy [T, H]
    sites.append(measure("all_gather_dot", n, [(tokens, ffn // n), (tokens, hidden)], args.dtype, args.runs, device,
                         args.reps, role="contracting"))
    # a batch role with the free role's step: the gathered activations' rows as n batches of T/n
    sites.append(measure("all_gather_dot", n, [(n, tokens // n, hidden), (n, hidden, ffn // n)], args.dtype,
                         args.runs, device, args.reps, role="batch"))
    summary = summarise(sites, args.profile, args.dtype, args.target, n)
    device_name = f"{device.platform}: {device.device_kind}"
    head = {"device": device_name, "jax": jax.__version__, "model": None if args.dims else args.model,
            "dims": [tokens, hidden, ffn], "ring": n, "dtype": args.dtype, "runs": args.runs, "reps": args.reps,
            "sites": sites}
    for s in sites:
        label = s["kind"] + (f" ({s['role']})" if s["role"] != "free" else " (dots merged)" if "merged_dots" in s else "")
        print(f"{label:<34} full {1e3 * s['full_s']:.3f} ms ({s['full_throughput'] / 1e12:.3g} TFLOP/s), "
              f"loop {1e3 * s['loop_s']:.3f} ms (efficiency {s['efficiency_loop']:.3f}), "
              f"unrolled {1e3 * s['unrolled_s']:.3f} ms (efficiency {s['efficiency_unrolled']:.3f})")
    # the sites' timings (all a profile takes) written now, so that a run stopped by its time
    # limit (tools/gpu_checks.sh) keeps them; the complete result replaces this file at the end
    write_results(args.out, {**head, **summary, "partial": "the sites only: the run stopped before the rest"})
    isolated = step_dots(shapes["all_gather_dot"], n, args.dtype, args.runs, device, args.reps)
    rates = element_rates(shapes["all_gather_dot"], args.runs, device, args.reps)
    rates["hardware_override"] = rates_override(args.profile, {k: r["throughput"] for k, r in rates["rates"].items()})
    rings = {}
    for kind, s in shapes.items():
        rings[kind] = measure_rings(kind, n, s, args.dtype, args.runs, device, args.reps)
        for name, model in ring_model(kind, rings[kind], n, s, args.dtype, summary["hardware_override"]).items():
            rings[kind][name].update(model)
    result = {
        **head, "gather_rings": rings["all_gather_dot"], "scatter_rings": rings["dot_reduce_scatter"],
        "step_dots": isolated, "element_rates": rates, **summary,
    }
    for kind, measured in rings.items():
        print(f"{cost.SHORT_NAMES[kind]} ring, permutes to the device itself: full {1e3 * measured['full_s']:.3f} ms, "
              + ", ".join(f"{name} {1e3 * r['seconds']:.3f} ms (efficiency {r['efficiency']:.3f}; "
                          f"model {1e3 * r['model_s']:.3f} ms, measured / model {r['measured_over_model']:.2f})"
                          for name, r in measured.items() if isinstance(r, dict)))
    print("the gather's dot alone, by rows (throughput over the full dot's): " + ", ".join(
        f"{size} {r['efficiency']:.3f} ({r['throughput'] / 1e12:.3g} TFLOP/s)" for size, r in isolated["rows"].items()))
    print("the gather's full dot by element type (throughput, over bf16's): " + ", ".join(
        f"{key} {r['throughput'] / 1e12:.3g} TFLOP/s ({r['over_bf16']:.2f})" for key, r in rates["rates"].items())
        + f"; cost model: --hardware \"{rates['hardware_override']}\"")
    for name, r in result["roles"].items():
        print(f"{name}: straight-line {r['split']:.3f} (the kind's points give {r['split_from_points']:.3f}), "
              f"{1e6 * r['loop_trip_s']:.1f} µs per loop trip (points: {1e6 * r['loop_trip_from_points']:.1f} µs)")
    print(f"loop efficiency {result['loop_efficiency']:.3f} ({'meets' if result['meets_target'] else 'below'} the "
          f"{args.target} target), straight-line {result['split_efficiency']:.3f}, "
          f"{1e6 * result['loop_trip_s']:.1f} µs per loop trip on {result['device']}; "
          f"cost model: --hardware \"{result['hardware_override']}\"")
    write_results(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
