"""Adversarial programs for the collective motions (``tools/fuzz.py --kind adversarial``).

Each class breaks one precondition of one motion — the same on every device of the collective's
group: a slice index, a loop's trip count, a branch predicate, a gain or bias between a gather and
its dot, a buffer slot, the manual axes of a region — and is drawn with its device-invariant
*twin*, the same program with the condition holding, which the pass must still rewrite (so a fix
cannot be "decline everything").  Classes (``CLASSES``):

- ``slice_index``: stacked weights gathered before a scan/fori/while loop, sliced per trip at an
  index that differs per device (``(i + axis_index) % L``) — twin: ``i``, or an index that varies
  only over the other mesh axis (the same on every device of the gather's group);
- ``sink_trips``: the same loop with a trip count that depends on ``axis_index`` — twin uniform;
- ``cond_scan``: the scan inside a ``lax.cond`` whose predicate depends on ``axis_index`` — twin: a
  predicate on a replicated input (or on the other axis);
- ``gain``: a per-device gain (``jax.lax.composite`` whose decomposition reads ``axis_index``) or
  bias (a composite's, or a sharded input's row) between a gather, an optional RMS norm and the
  dot — twin: the same composite with a uniform factor, a replicated bias;
- ``split_gain``: a psum of a matmul, then such a gain, then the next Megatron block (the split's
  carried gather) — twin uniform;
- ``callback``: the gain from ``jax.pure_callback`` (custom_call opacity; compared through
  ``cmatmul_pass.jit`` against ``jax.jit``: the module check cannot run host callbacks);
- ``dus_slot``: a stacked buffer written in a while loop at a per-device slot
  (``dynamic_update_slice``, ``dynamic_update_index_in_dim``, or that inside a nested ``jax.jit``:
  two calls), then ``psum_scatter``ed — twin: slot ``i`` (or the other axis's);
- ``second_carry``: the same loop also returning the stack in a second carried slot (must not
  crash; its twin may be declined);
- ``hoist_trips``: the scatter's loop with a device-dependent trip count — twin uniform;
- ``partial_call``: a partially manual region (manual over one axis of a 2-D mesh) whose site is
  inside a nested ``jax.jit`` function — twin: fully manual;
- ``div_index``, ``rng_index``: the slice index through an integer division of ``axis_index``, or
  drawn by ``jax.random`` from a key folded with it — twins: the other axis's, one key;
- ``nested_loops``: the stacked gather inside an outer loop, sunk into an inner loop whose trip
  count depends on ``axis_index`` — twin uniform.

A twin's condition holds on every device (``vary="none"``) or, where that is what the motion
needs, on every device of the collective's group (``"group"``: a value of the other mesh axis's
index, for slice indices, slots and gains).  A loop's trip count or a branch's predicate must be
uniform on *every* device, not only on the group: the ring's ``collective_permute`` names the
pairs of all groups and every device takes part in it (XLA CPU waits for all 8), so those classes
use ``"group"`` as an adversary.

:func:`draw` makes a :class:`Spec` from a ``random.Random`` (:func:`pairs`: a campaign's specs),
:func:`lower` its StableHLO; :func:`check` rewrites it under each option set, verifies it, checks
the ring property and the motion (:func:`moved`) and compares the numbers with the original's.
:func:`run_campaign` runs the checks in worker processes (``python -m tools.fuzz_adversarial
--worker``) with a time limit: a deadlock (XLA CPU aborts a stuck rendezvous after 20 s here) is
recorded as ``hang``, a dead worker otherwise as ``crash``, and a fresh worker goes on.
``python -m tools.fuzz_adversarial --spec JSON`` reruns one program (a failure prints its JSON).
"""

from __future__ import annotations

import json
import math
import os
import queue
import random
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: class -> (motion kind, whether the twin must show the motion)
CLASSES = {
    "slice_index": ("sink", True), "sink_trips": ("sink", True), "cond_scan": ("sink", True),
    "gain": ("past", True), "split_gain": ("carry", True), "callback": ("rewrite", True),
    "dus_slot": ("hoist", True), "second_carry": ("hoist", False), "hoist_trips": ("hoist", True),
    "partial_call": ("rewrite", True), "div_index": ("sink", True), "rng_index": ("sink", True),
    "nested_loops": ("sink", True),
}
SINK = ("slice_index", "sink_trips", "cond_scan", "div_index", "rng_index", "nested_loops")
HOIST = ("dus_slot", "second_carry", "hoist_trips")
#: classes whose condition is a loop's trip count or a branch's predicate (what runs, not what is read)
CONTROL = ("sink_trips", "cond_scan", "hoist_trips", "nested_loops")
MESHES = [(8,), (2, 4), (4, 2)]
#: the option sets each program is rewritten under (names of tools.fuzz_oracle.VARIANTS, or
#: "default": ``Options()``, "policy-auto": ``Options(policy="auto")``); workers run under
#: ``CMATMUL_PASS_POLICY=all`` unless told otherwise (as the suite does), so "default" rewrites every
#: legal site; ``fuzz.py --kind adversarial --all-variants`` takes every variant and "policy-auto"
OPTION_SETS = ("default", "uni")
#: a deadlocked collective aborts the worker after this long (XLA CPU's rendezvous), not 40 s
XLA_FLAGS = ("--xla_force_host_platform_device_count=8 --xla_cpu_collective_call_warn_stuck_timeout_seconds=5 "
             "--xla_cpu_collective_call_terminate_timeout_seconds=20")
HANG_MARKERS = ("Termination timeout", "may be stuck")


@dataclass(frozen=True)
class Spec:
    cls: str
    twin: bool
    mesh_shape: tuple[int, ...]
    axis: str  # the collectives' mesh axis ("x" or "y")
    dtype: str  # "f32" | "bf16" | "i32"
    layers: int  # L: stacked layers, loop trips, buffer slots
    rows: int  # local rows (per ring member where rows are split)
    width: int  # hidden size per ring member
    #: the variation: sink/hoist loops "scan" | "fori" | "while"; gain "composite" | "bias" |
    #: "composite_bias"; dus_slot "dus" | "index" | "nested"; partial_call "ag" | "rs"
    form: str = ""
    #: the device-dependent expression: "shift" ((i + me) % L), "parity" (me % 2), "half" (me // (n/2));
    #: a twin: "none" (uniform) or "group" (the other mesh axis's index: the same on the group)
    vary: str = "shift"
    norm: bool = False  # gain: an RMS norm of the gathered rows before the gain
    dim: int = 1  # sink: the stacked weight's gathered dim (1 contracting, 2 free); hoist: the scattered dim

    @property
    def names(self) -> tuple[str, ...]:
        return ("x", "y")[: len(self.mesh_shape)]

    @property
    def ring(self) -> int:
        return self.mesh_shape[self.names.index(self.axis)]

    @property
    def other(self) -> str | None:
        return next((a for a in self.names if a != self.axis), None)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "Spec":
        return cls(**{**d, "mesh_shape": tuple(d["mesh_shape"])})


def draw(rng: random.Random, cls: str, twin: bool) -> Spec:
    """A random program of class ``cls`` (its twin when ``twin``): the same ``rng`` state gives the
    same program, the twin differing only in ``vary`` (every draw is made either way)."""
    mesh = rng.choice(MESHES if cls != "partial_call" else MESHES[1:])
    names = ("x", "y")[: len(mesh)]
    axis = rng.choice(names)
    dtypes = ["f32", "f32", "bf16"] + (["i32"] if cls in SINK + HOIST and cls != "rng_index" else [])
    dtype = "f32" if cls == "callback" else rng.choice(dtypes)
    forms = {"gain": ["composite", "bias", "composite_bias"], "split_gain": ["composite", "composite_bias"],
             "dus_slot": ["dus", "index", "nested"], "second_carry": ["dus", "index"], "hoist_trips": ["dus", "index"],
             "partial_call": ["ag", "rs"], "sink_trips": ["fori", "while"], "cond_scan": ["scan", "fori"],
             "nested_loops": [""]}
    form = rng.choice(forms.get(cls, ["scan", "fori", "while"] if cls in SINK else [""]))
    layers, rows, width = rng.randint(2, 4), rng.choice([1, 2, 3]), rng.choice([2, 3, 4])
    norm, dim = rng.random() < 0.6, rng.choice([1, 2])
    vary = "half" if cls == "div_index" else rng.choice(["shift", "parity", "half"])
    group_roll, twin_roll = rng.random(), rng.random()
    if cls in CONTROL and len(mesh) == 2 and group_roll < 0.3:
        # the same on the gather's group but not on the other groups: the ring's permute spans every
        # device of the module (its pairs name all the groups), so its loop or branch must be run
        # alike on all of them, not only on the group (on CPU the permute waits for all 8)
        vary = "group"
    if twin:  # uniform, or (on a 2-D mesh, half the time) uniform on the group only, where that suffices
        group = len(mesh) == 2 and cls not in CONTROL + ("rng_index", "callback", "partial_call")
        vary = "group" if group and twin_roll < 0.5 else "none"
    return Spec(cls=cls, twin=twin, mesh_shape=mesh, axis=axis, dtype=dtype, layers=layers, rows=rows, width=width,
                form=form, vary=vary, norm=norm, dim=dim)


# ---------------------------------------------------------------------------- programs
def _jax():
    import jax
    import jax.numpy as jnp

    return jax, jnp


def _dtype(spec: Spec):
    _, jnp = _jax()
    return {"f32": jnp.float32, "bf16": jnp.bfloat16, "i32": jnp.int32}[spec.dtype]


def _dot(spec: Spec, a, b):
    _, jnp = _jax()
    kwargs = {"preferred_element_type": jnp.float32} if spec.dtype == "bf16" else {}
    return jnp.matmul(a, b, **kwargs)


def _me(spec: Spec):
    """The device's position on the collective's axis."""
    jax, _ = _jax()
    return jax.lax.axis_index(spec.axis)


def _varying(spec: Spec):
    """The spec's device-dependent integer: on the group's own axis (``shift``, ``parity``,
    ``half``), on the other axis (``group``: the same on each group) or 0 (``none``)."""
    jax, _ = _jax()
    if spec.vary == "none":
        return 0
    if spec.vary == "group":
        return jax.lax.axis_index(spec.other)
    me = _me(spec)
    return {"shift": me, "parity": me % 2, "half": me // max(1, spec.ring // 2)}[spec.vary]


def _index(spec: Spec, i):
    """The layer (slot) read (written) in trip ``i``."""
    jax, _ = _jax()
    if spec.cls == "rng_index":
        key = jax.random.key(7)
        if not spec.twin:
            key = jax.random.fold_in(key, _me(spec))
        return jax.random.randint(jax.random.fold_in(key, i), (), 0, spec.layers)
    if spec.cls in ("slice_index", "div_index", "dus_slot", "second_carry"):
        return (i + _varying(spec)) % spec.layers
    return i


def _trips(spec: Spec):
    """The loop's trip count: ``L``, or one fewer on some devices."""
    if spec.cls in ("sink_trips", "hoist_trips", "nested_loops"):
        return spec.layers - (_varying(spec) > 0 if spec.vary != "none" else 0)
    return spec.layers


def _loop(spec: Spec, step, init):
    """``init`` through ``step(i, carry)`` for ``_trips`` trips, as ``spec.form`` writes loops."""
    jax, jnp = _jax()
    trips = _trips(spec)
    if spec.form == "scan":
        return jax.lax.scan(lambda c, i: (step(i, c), None), init, jnp.arange(spec.layers))[0]
    if spec.form == "fori":
        return jax.lax.fori_loop(0, trips, step, init)
    out = jax.lax.while_loop(lambda c: c[0] < trips, lambda c: (c[0] + 1, step(c[0], c[1])), (0, init))
    return out[1]


def _sink_program(spec: Spec):
    """Stacked [L, H, H] weights sharded over the axis on ``spec.dim``, gathered, read one layer a
    trip by a loop (in a cond, inside an outer loop, ...)."""
    jax, jnp = _jax()
    L, n, H = spec.layers, spec.ring, spec.width * spec.ring
    dtype = _dtype(spec)

    def layer(h, w):
        y = _dot(spec, h, w)
        if spec.dtype == "i32":
            return jnp.remainder(y, 13).astype(dtype)
        return jnp.tanh(y / H).astype(dtype)

    def run(h, stack):
        return _loop(spec, lambda i, h: layer(h, jax.lax.dynamic_index_in_dim(stack, _index(spec, i), 0, False)), h)

    def gather(ws):
        return jax.lax.all_gather(ws, spec.axis, axis=spec.dim, tiled=True)

    def body(h, ws, flag):
        if spec.cls == "nested_loops":  # an outer uniform loop holding the gather and the inner loop
            return jax.lax.fori_loop(0, 2, lambda j, h: run(h, gather(ws)), h)
        stack = gather(ws)
        if spec.cls == "cond_scan":
            v = _varying(spec)
            pred = (jnp.abs(flag[0]) < 1e30) if spec.vary == "none" else (v == 0)
            return jax.lax.cond(pred, lambda h: run(h, stack), lambda h: h + h, h)
        return run(h, stack)

    w_parts = [None, None, None]
    w_parts[spec.dim] = spec.axis
    args = [((spec.rows, H), (), dtype), ((L, H, H), tuple(w_parts), dtype), ((1,), (), "f32")]
    return body, args, (spec.names, None)


def _gain(spec: Spec, base, bias_rows):
    """The gain (multiplied) or bias (added) to apply to the rows: per device unless a twin's."""
    jax, jnp = _jax()
    if spec.form == "bias":  # this device's row of an [8, K] input sharded as the spec varies
        return lambda y: y + bias_rows[0].astype(y.dtype)

    def decomposition(b):  # reads the device's index inside the composite, as a per-device gain does
        factor = 1.5 if spec.vary == "none" else 1 + _varying(spec).astype(b.dtype) / 8  # exact in bf16
        return b * factor if spec.form == "composite" else b + factor

    composite = jax.lax.composite(decomposition, name="adversarial.gain")
    if spec.form == "composite":
        return lambda y: y * composite(base).astype(y.dtype)
    return lambda y: y + composite(base).astype(y.dtype)


def _bias_parts(spec: Spec) -> tuple:
    """How the [8, K] bias input is sharded: over the group's axis (each device its own row), the
    other axis (the same on the group) or not at all."""
    return {"none": (), "group": (spec.other, None)}.get(spec.vary, (spec.axis, None))


def _gain_program(spec: Spec):
    """Rows gathered over the axis, an optional RMS norm, the gain, a column-parallel dot."""
    jax, jnp = _jax()
    n, K, N = spec.ring, spec.width * 4, spec.width * spec.ring
    dtype = _dtype(spec)
    callback = spec.cls == "callback"

    def host_gain(base, me):
        import numpy as np

        return (np.asarray(base) * (1.5 if spec.twin else 1 + np.asarray(me) / 8)).astype(np.float32)

    def body(x, base, bias_rows, w):
        g = jax.lax.all_gather(x, spec.axis, axis=0, tiled=True)
        if spec.norm:
            g = g * jax.lax.rsqrt(jnp.mean(g * g, axis=-1, keepdims=True) + 1e-3).astype(g.dtype)
        if callback:
            gain = jax.pure_callback(host_gain, jax.ShapeDtypeStruct((K,), jnp.float32), base, _me(spec))
            g = g * gain.astype(g.dtype)
        else:
            g = _gain(spec, base, bias_rows)(g)
        return _dot(spec, g, w)

    args = [((spec.rows * n, K), (spec.axis, None), dtype), ((K,), (), "f32"), ((8, K), _bias_parts(spec), "f32"),
            ((K, N), (None, spec.axis), dtype)]
    return body, args, (spec.other, spec.axis)


def _split_program(spec: Spec):
    """Two Megatron blocks: ``psum(gelu(x @ w1) @ w2)``, the gain, the next block."""
    jax, jnp = _jax()
    n, K, F = spec.ring, spec.width * 2, spec.width * spec.ring
    dtype = _dtype(spec)

    def block(y, w1, w2):
        h = jax.nn.gelu(_dot(spec, y, w1 * (K ** -0.5))).astype(dtype)
        return jax.lax.psum(_dot(spec, h, w2 * (F ** -0.5)), spec.axis)

    def body(x, base, bias_rows, w1, w2, w3, w4):
        y = _gain(spec, base, bias_rows)(block(x, w1, w2)).astype(dtype)
        return block(y, w3, w4)

    col, row = (None, spec.axis), (spec.axis, None)
    args = [((spec.rows * n, K), (), dtype), ((K,), (), "f32"), ((8, K), _bias_parts(spec), "f32"),
            ((K, F), col, dtype), ((F, K), row, dtype), ((K, F), col, dtype), ((F, K), row, dtype)]
    return body, args, (spec.other, None)


def _hoist_program(spec: Spec):
    """A while loop writing each trip's partial product [M, N] into a zero [L, M, N] buffer at a
    slot, the buffer psum_scattered over the axis along ``spec.dim`` (1: rows, 2: columns)."""
    jax, jnp = _jax()
    n, L = spec.ring, spec.layers
    M, K, N = spec.rows * n, spec.width * n, spec.width * (n if spec.dim == 2 else 1)
    dtype = _dtype(spec)
    out_dtype = jnp.float32 if spec.dtype == "bf16" else dtype
    nested = jax.jit(lambda b, u, s: jax.lax.dynamic_update_index_in_dim(b, u, s, 0))

    def write(buf, u, slot):
        if spec.form == "index":
            return jax.lax.dynamic_update_index_in_dim(buf, u, slot, 0)
        if spec.form == "nested":
            return nested(buf, u, slot)
        return jax.lax.dynamic_update_slice(buf, u, (slot, 0, 0))

    def body(x, w):
        def step(c):
            i, buf = c[0], c[1]
            buf = write(buf, _dot(spec, x[i], w)[None].astype(out_dtype), _index(spec, i))
            return (i + 1, buf, buf) if spec.cls == "second_carry" else (i + 1, buf)

        zeros = jnp.zeros((L, M, N), out_dtype)
        trips = _trips(spec)
        init = (0, zeros, zeros) if spec.cls == "second_carry" else (0, zeros)
        carry = jax.lax.while_loop(lambda c: c[0] < trips, step, init)
        out = jax.lax.psum_scatter(carry[1], spec.axis, scatter_dimension=spec.dim, tiled=True)
        return (out, carry[2]) if spec.cls == "second_carry" else out

    args = [((L, M, K), (None, None, spec.axis), dtype), ((K, N), (spec.axis, None), dtype)]
    out = [spec.other, None, None]
    out[spec.dim] = spec.axis
    if spec.cls == "second_carry":
        return body, args, [tuple(out), (spec.names,)]
    return body, args, tuple(out)


def _partial_call_program(spec: Spec):
    """A site inside a nested ``jax.jit`` function called from the region (manual over the axis
    only, unless a twin): rows gathered into a dot ("ag"), or a product sum-scattered ("rs")."""
    jax, _ = _jax()
    n, K, N = spec.ring, spec.width * 2, spec.width * spec.ring
    dtype = _dtype(spec)

    @jax.jit
    def layer(x, w):
        if spec.form == "ag":
            return _dot(spec, jax.lax.all_gather(x, spec.axis, axis=0, tiled=True), w)
        return jax.lax.psum_scatter(_dot(spec, x, w), spec.axis, scatter_dimension=0, tiled=True)

    if spec.form == "ag":
        args = [((spec.rows * n, K), (spec.axis, None), dtype), ((K, N), (None, spec.axis), dtype)]
        return layer, args, (None, spec.axis)
    args = [((spec.rows * n, K * n), (None, spec.axis), dtype), ((K * n, N), (spec.axis, None), dtype)]
    return layer, args, (spec.axis, None)


def build(spec: Spec):
    """(shard_map body, [(global shape, PartitionSpec parts, dtype)], out_specs parts)."""
    if spec.cls in SINK:
        return _sink_program(spec)
    if spec.cls in ("gain", "callback"):
        return _gain_program(spec)
    if spec.cls == "split_gain":
        return _split_program(spec)
    if spec.cls in HOIST:
        return _hoist_program(spec)
    return _partial_call_program(spec)


def _pspec(parts):
    from jax.sharding import PartitionSpec as P

    return P(*parts)


def function(spec: Spec):
    """(the shard_map'd program, its argument ShapeDtypeStructs)."""
    jax, jnp = _jax()
    from jax.sharding import Mesh, NamedSharding

    import numpy as np

    mesh = Mesh(np.array(jax.devices("cpu")[:8]).reshape(spec.mesh_shape), spec.names)
    body, args, out = build(spec)
    out_specs = tuple(_pspec(o) for o in out) if isinstance(out, list) else _pspec(out)
    kwargs = {"axis_names": {spec.axis}} if spec.cls == "partial_call" and not spec.twin else {}
    f = jax.shard_map(body, mesh=mesh, in_specs=tuple(_pspec(p) for _, p, _ in args), out_specs=out_specs,
                      check_vma=False, **kwargs)
    dtypes = {"f32": jnp.float32, "bf16": jnp.bfloat16, "i32": jnp.int32}
    structs = [jax.ShapeDtypeStruct(shape, dtypes[d] if isinstance(d, str) else d,
                                    sharding=NamedSharding(mesh, _pspec(p))) for shape, p, d in args]
    return f, structs


def lower(spec: Spec) -> str:
    jax, _ = _jax()
    f, structs = function(spec)
    return jax.jit(f).lower(*structs).as_text()


# ---------------------------------------------------------------------------- the oracle (in a worker)
def motion_kind(spec: Spec) -> str:
    """What the twin's site must show: "sink", "hoist", "past" (the gather moved past the row-wise
    ops), "carry" (the split's gather carried into the next ring) or "rewrite" (just rewritten)."""
    kind = CLASSES[spec.cls][0]
    return "rewrite" if kind == "past" and not spec.norm else kind


def moved(kind: str, report, options) -> bool | None:
    """Whether the report shows the motion (None: the options do not ask for it)."""
    notes = [note for site in report.sites for note in site.notes]
    if kind == "sink":
        return any(note.startswith("sunk into") for note in notes)
    if kind == "hoist":
        return any(note.startswith("hoisted into") for note in notes)
    if kind == "past":
        return any(note.startswith("moved to its dot past") for note in notes)
    if kind == "carry":
        if options.all_reduce != "split":
            return None
        return any("into the ring of" in g for site in report.sites for g in site.all_reduce.get("gathers", []))
    return bool(report.rewritten)


def option_sets(names) -> dict:
    from cmatmul_pass import Options

    from tools.fuzz_oracle import VARIANTS

    made = {"default": Options, "policy-auto": lambda: Options(policy="auto")}
    return {name: made[name]() if name in made else VARIANTS[name] for name in names}


def _callback_check(spec: Spec, options):
    """(report, ok, message): the program through ``cmatmul_pass.jit`` against ``jax.jit`` (the
    module check cannot run host callbacks)."""
    import numpy as np

    import cmatmul_pass
    import jax

    f, structs = function(spec)
    rng = np.random.default_rng(0)
    concrete = [jax.device_put(rng.standard_normal(s.shape).astype(s.dtype), s.sharding) for s in structs]
    want = np.asarray(jax.jit(f)(*concrete))
    g = cmatmul_pass.jit(f, variant=options.variant,
                         all_reduce=options.all_reduce, annotate_streams=options.annotate_streams,
                         assemble=options.assemble, hardware=options.hardware)
    got = np.asarray(g(*concrete))
    err = float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-30))
    return g.report, err <= 1e-4, f"normwise rel. error {err:.3g} through cmatmul_pass.jit vs jax.jit (allowed 1e-4)"


def check(spec: Spec, names=OPTION_SETS, emit=lambda event: None) -> dict:
    """Rewrite ``spec``'s program under each option set: {name: {"status", "moved", "message",
    "sites"}}.  ``emit`` hears {"event": "start", "option": name} before each run (what a hang
    is blamed on), and each result."""
    import cmatmul_pass
    from cmatmul_pass import execute, ir_utils

    from tools.fuzz_oracle import ring_property_holds

    kind = motion_kind(spec)
    results = {}
    emit({"event": "start", "option": "original"})
    text = lower(spec) if spec.cls != "callback" else None
    reference = execute.Reference.of(ir_utils.parse(text)) if text is not None else None
    for name, options in option_sets(names).items():
        emit({"event": "start", "option": name})
        entry = {"status": "ok", "moved": None, "message": "", "sites": []}
        try:
            if reference is None:
                report, ok, message = _callback_check(spec, options)
            else:
                result = cmatmul_pass.rewrite(text, options)
                report = result.report
                result.module.operation.verify()
                groups = [frozenset(tuple(sorted(g)) for g in s.replica_groups) for s in report.rewritten]
                assert ring_property_holds(result.module, groups), "a permute is not one cycle per group"
                outcome = reference.check(result.module)
                ok, message = outcome.ok, outcome.format()
            entry["sites"] = [s.summary_line()[:400] for s in report.sites]
            entry["moved"] = moved(kind, report, options)
            if options.policy == "auto" and not entry["moved"]:
                entry["moved"] = None  # the cost model may leave a tiny site, and a motion goes with its ring
            if not ok:
                entry.update(status="mismatch", message=message)
            elif spec.twin and CLASSES[spec.cls][1] and entry["moved"] is False:
                entry.update(status="twin_declined", message=f"the twin's {kind} did not happen")
        except Exception as exc:  # noqa: BLE001 - a pass crash, a module that does not verify or compile
            entry.update(status="crash", message=f"{type(exc).__name__}: {str(exc)[:1500]}")
        results[name] = entry
        emit({"event": "result", "option": name, "entry": entry})
    return results


def _worker() -> int:
    """Serve check requests, one JSON line each on stdin, answering on stdout with '@@' lines."""
    from cmatmul_pass import sharing

    sharing.CHECK = True
    out = sys.stdout
    sys.stdout = sys.stderr  # anything else printed goes to the log, not the protocol

    def emit(event):
        out.write("@@" + json.dumps(event) + "\n")
        out.flush()

    for line in sys.stdin:
        request = json.loads(line)
        spec = Spec.from_json(request["spec"])
        try:
            check(spec, request["options"], emit)
        except Exception as exc:  # noqa: BLE001 - lowering or the original itself failed: a generator bug
            emit({"event": "error", "message": f"{type(exc).__name__}: {str(exc)[:1500]}"})
        emit({"event": "done"})
    return 0


# ---------------------------------------------------------------------------- the runner
class Worker:
    """A ``python -m tools.fuzz_adversarial --worker`` process: checks programs until one hangs
    or kills it, then a fresh one takes over."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.proc = None
        self.count = 0

    def _start(self) -> None:
        self.count += 1
        self.log = self.log_dir / f"worker-{id(self)}-{self.count}.log"
        env = dict(os.environ, XLA_FLAGS=XLA_FLAGS, CMATMUL_PASS_CHECK_SHARING="1", PYTHONUNBUFFERED="1")
        env.setdefault("CMATMUL_PASS_POLICY", "all")
        self.stderr = open(self.log, "w+b")
        self.proc = subprocess.Popen([sys.executable, "-m", "tools.fuzz_adversarial", "--worker"], cwd=ROOT, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, text=True)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, args=(self.proc, self.lines), daemon=True).start()

    @staticmethod
    def _read(proc, lines) -> None:
        for line in proc.stdout:
            if line.startswith("@@"):
                lines.put(json.loads(line[2:]))
        lines.put(None)  # the process ended

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()  # our own child, by its handle
            self.proc.wait()
        self.proc = None

    def _tail(self, start: int) -> str:
        self.stderr.flush()
        self.stderr.seek(start)
        return self.stderr.read().decode(errors="replace")

    def run(self, spec: Spec, names, limit: float) -> tuple[dict, str | None]:
        """({option: entry}, an error of the generator or the original) for ``spec``; a run that
        outlives ``limit`` seconds, or kills its worker, is recorded and the rest go on."""
        results: dict = {}
        error = None
        while error is None and len(results) < len(names):
            if self.proc is None or self.proc.poll() is not None:
                self._start()
            todo = [n for n in names if n not in results]
            start = self.stderr.seek(0, 2)
            self.proc.stdin.write(json.dumps({"spec": spec.to_json(), "options": todo}) + "\n")
            self.proc.stdin.flush()
            current = None
            while True:
                try:
                    event = self.lines.get(timeout=limit)
                except queue.Empty:
                    event = {"event": "timeout"}
                if event is None or event["event"] == "timeout":
                    try:
                        code = self.proc.wait(timeout=10) if event is None else None
                    except subprocess.TimeoutExpired:
                        code = None
                    self.stop()
                    tail = _essence(self._tail(start))
                    hang = event is not None or any(m in tail for m in HANG_MARKERS)
                    status = "hang" if hang else "crash"
                    why = f"no answer in {limit:.0f} s" if event is not None else \
                        f"the worker died (exit {code})"
                    message = f"{why}; its log says:\n{tail}"
                    if current in (None, "original"):
                        error = f"{status} running the original: {message}"
                    else:
                        results[current] = {"status": status, "moved": None, "message": message, "sites": []}
                    break
                if event["event"] == "start":
                    current = event["option"]
                elif event["event"] == "result":
                    results[event["option"]] = event["entry"]
                elif event["event"] == "error":
                    error = event["message"]
                elif event["event"] == "done":
                    break
        return results, error


def _essence(log: str) -> str:
    """A dead worker's log, short: its fatal lines (a rendezvous timeout, a check failure, a
    Python fatal error), else its last lines; stack frames dropped."""
    lines = [line for line in log.splitlines() if line.strip() and not line.lstrip().startswith("@")]
    fatal = [line for line in lines if line.startswith(("F", "Fatal Python", "*** ")) or "Segmentation" in line]
    return "\n".join(dict.fromkeys(line[:400] for line in (fatal[:3] or lines[-6:])))


SEVERITY = ("hang", "crash", "mismatch", "twin_declined", "ok")


@dataclass
class Tally:
    programs: int = 0
    runs: int = 0
    #: per class: counts of "adversarial", "twin", "adv_kept" (not moved under any option set),
    #: "adv_moved", "twin_moved", and each failure status
    by_class: dict = field(default_factory=dict)
    statuses: Counter = field(default_factory=Counter)
    failures: list = field(default_factory=list)  # (spec, option, status, message)
    errors: list = field(default_factory=list)  # (spec, message): the generator's or the original's
    seconds: float = 0.0

    def add(self, spec: Spec, results: dict, error: str | None) -> None:
        self.programs += 1
        row = self.by_class.setdefault(spec.cls, Counter())
        row["twin" if spec.twin else "adversarial"] += 1
        if error is not None:
            self.errors.append((spec, error))
            row["error"] += 1
            return
        self.runs += len(results)
        moves = [e["moved"] for e in results.values() if e["moved"] is not None]
        if spec.twin:
            row["twin_moved"] += bool(moves) and all(moves)
        else:
            row["adv_moved" if any(moves) else "adv_kept"] += 1
        for name, entry in results.items():
            self.statuses[entry["status"]] += 1
            if entry["status"] != "ok":
                row[entry["status"]] += 1
                self.failures.append((spec, name, entry["status"], entry["message"]))

    @property
    def failed(self) -> int:
        return len(self.failures) + len(self.errors)

    def summary(self) -> str:
        lines = [f"adversarial: programs {self.programs}, runs {self.runs} in {self.seconds:.0f} s; "
                 + ", ".join(f"{s} {self.statuses[s]}" for s in SEVERITY) + f", generator/original errors {len(self.errors)}",
                 f"{'class':14} {'adv':>4} {'twin':>4} {'adv kept':>8} {'adv moved':>9} {'twin moved':>10}  failures"]
        for cls in CLASSES:
            row = self.by_class.get(cls)
            if row is None:
                continue
            bad = ", ".join(f"{s} {row[s]}" for s in SEVERITY[:-1] + ("error",) if row[s]) or "none"
            lines.append(f"{cls:14} {row['adversarial']:>4} {row['twin']:>4} {row['adv_kept']:>8} {row['adv_moved']:>9} "
                         f"{row['twin_moved']:>10}  {bad}")
        return "\n".join(lines)

    def report(self) -> str:
        """Every failure with its spec (``--spec`` reruns one)."""
        out = []
        for spec, name, status, message in self.failures:
            out.append(f"--- {status} [{spec.cls}{' twin' if spec.twin else ''}, {name}]: {json.dumps(spec.to_json())}\n{message}")
        for spec, message in self.errors:
            out.append(f"--- error [{spec.cls}]: {json.dumps(spec.to_json())}\n{message}")
        return "\n".join(out)


def pairs(examples: int, seed: int, classes=tuple(CLASSES)) -> list[Spec]:
    """``examples`` programs: each class in turn, an adversarial program then its twin."""
    rng = random.Random(seed)
    specs = []
    for k in range(math.ceil(examples / 2)):
        cls = classes[k % len(classes)]
        state = rng.getstate()
        adversary = draw(rng, cls, False)
        rng.setstate(state)
        specs += [adversary, draw(rng, cls, True)]
    return specs[:examples]


def run_campaign(specs: list[Spec], names=OPTION_SETS, jobs: int = 1, limit: float = 60.0,
                 progress=None) -> Tally:
    """Check every spec in worker processes (``jobs`` at once); a hang or a crash is recorded."""
    import tempfile
    from concurrent.futures import ThreadPoolExecutor

    tally = Tally()
    start = time.perf_counter()
    lock = threading.Lock()
    log_dir = Path(tempfile.mkdtemp(prefix="fuzz-adversarial-"))
    local = threading.local()
    workers = []

    def one(spec: Spec) -> None:
        if not hasattr(local, "worker"):
            local.worker = Worker(log_dir)
            with lock:
                workers.append(local.worker)
        results, error = local.worker.run(spec, list(names), limit)
        with lock:
            tally.add(spec, results, error)
            if progress:
                progress(tally, spec, results, error)

    try:
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            list(pool.map(one, specs))
    finally:
        for worker in workers:
            worker.stop()
    tally.seconds = time.perf_counter() - start
    return tally


def main(argv: list[str] | None = None) -> int:
    """``--worker`` (the campaign's worker loop), or ``--spec JSON``: check one program here."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        os.environ.setdefault("XLA_FLAGS", XLA_FLAGS)
        # PYTHONPATH first (a pass from another tree to compare), then this checkout
        sys.path[:0] = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p] + [str(ROOT)]
        return _worker()
    if argv[:1] == ["--spec"]:
        spec = Spec.from_json(json.loads(argv[1]))
        tally = run_campaign([spec], names=argv[2:] or OPTION_SETS,
                             progress=lambda t, s, results, error: print(json.dumps(results, indent=1), error or ""))
        print(tally.summary())
        print(tally.report())
        return 1 if tally.failed else 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
