"""Random tensor-parallel shard_map programs for differential fuzzing (hypothesis strategies).

A :class:`Spec` describes one program: a mesh (1-D, 2-D or 3-D, possibly over a
permuted subset of the 8 CPU devices, so rings of 2..8 including odd sizes), the mesh
axes its collectives run over (one axis, or two at once), a site kind (all_gather →
dots, dot → reduce_scatter, both around one dot, a sequence-parallel MLP, Megatron blocks
whose psum of a matmul feeds the next block through random row-wise ops), which
dimension is gathered or scattered (free, contracting or batch), which operand side,
tiled or untiled collectives, a dtype, several consumers and a non-dot reader,
fully or partially manual regions, a norm's backward between a dot and its scatter or psum
(the residual's cotangent added, the gain's gradient returned beside it).
:func:`lower` turns it into StableHLO;
:func:`check` rewrites it under every pass variant and checks each result
(verification, the permute-ring property, numerics against the original: tools/fuzz_oracle.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import assume, strategies as st
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tools.fuzz_oracle import VARIANTS, Tally, check_variants

MESHES = [(8,), (2, 4), (4, 2), (2, 2, 2), (3,), (5,), (7,), (2, 3), (3, 2), (6,), (4,), (2,)]
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "i32": jnp.int32, "f16": jnp.float16, "f64": jnp.float64,
          "c64": jnp.complex64}


@dataclass(frozen=True)
class Spec:
    mesh_shape: tuple[int, ...]
    devices: tuple[int, ...]  # device ids in mesh order: a permutation of a subset of the CPU devices
    axes: tuple[str, ...]  # the collectives' mesh axes
    #: "ag" | "rs" | "chain" | "mlp" | "ag2" (both dot operands gathered) | "psum" (Megatron blocks) |
    #: "fsdp" (the activation's rows gathered over axes[0], the weight over another mesh axis along ``dim``) |
    #: "scan" (stacked layer weights gathered before a scan over the layers, along ``dim``) |
    #: "ag_norm" (gathered rows normalised into one or two dots, the raw rows read elsewhere too;
    #: drawn only when named: ``fuzz.py --gather-norm``)
    kind: str
    #: gathered / scattered label: "m" (free, lhs-side), "n" (free, rhs-side), "k" (contracting), "b" (batch);
    #: psum: "m" the rows divide by the ring (split along them), "k" they do not (split along the features)
    dim: str
    side: int  # the collective's operand is the dot's lhs (0) or rhs (1)
    batch: bool
    tiled: bool
    dtype: str
    consumers: int  # ag: dots reading the gathered value; rs: products summed before the scatter
    reader: bool
    partial_manual: bool
    sizes: tuple[int, int, int, int]  # local m, k, n, b
    repeat: int = 1  # the shard_map called this many times (later calls repeat the sites' patterns)
    #: ag: each weight prepared where it is used (scaled just before its dot, as a cast to the
    #: compute type would be): the ring computes every dot only by moving those ops up
    prep: bool = False
    #: ag: a transpose of the whole gathered value taken before the dots' weights are computed
    #: (each by a cumulative sum, which no ring moves up; all before the first dot) and read after
    #: the dots: the ring goes at the first dot and the transpose follows it, reading the value the
    #: ring assembles
    early: bool = False
    #: ag: the gathered value scaled before its dots (a dequantisation's per-tensor scale); rs:
    #: the product scaled before the scatter: an elementwise op the ring applies per block
    scale: bool = False
    #: psum: the row-wise ops applied to each block's summed output before the next block reads
    #: it (POINTWISE), in order; "vary" multiplies by a per-device factor, which stops the move
    between: tuple[str, ...] = ()
    #: scan: the step under jax.checkpoint; the program is value_and_grad of the scan (a training
    #: step: the stack handed to the backward, the stacked gradient scattered after its loop);
    #: fsdp with ``scatter``: value_and_grad of the block (``grad``)
    remat: bool = False
    grad: bool = False
    #: mlp: the block called ``repeat`` times in a row, each call reading the last one's output (the
    #: same weights), and the program ``value_and_grad`` of its loss over the weights only: a training
    #: step of identical layers, whose first layer's backward returns no input gradient (the pass
    #: calls a trimmed copy of the others' rewritten backward there: replay.Trim)
    chained: bool = False
    #: rs: an RMS norm's backward applied to the product before the scatter (per row along the
    #: scattered dim: ``rs*dy - x*rs^3/c * sum(dy*x)`` with sums over the other dims, the product
    #: read twice), and the gain's gradient (the product times the normed rows, summed over the
    #: rows) returned beside it: the ring applies the one per block and adds up the other.
    #: psum: each block's product goes through an RMS norm's backward (over the features, of a
    #: normed input the same on every device) before its psum, as ``value_and_grad`` of a pre-norm
    #: Megatron block puts it there; the split ring applies it per block, chunk per row chunk
    norm: bool = False
    #: rs with ``norm``: the norm over the scattered dim alone (features sharded and gathered before
    #: it: its backward spreads sums over the scattered dim back over it, which the pass takes out
    #: of the scatter), the gain's gradient summed over the other dims
    spread: bool = False
    #: psum with ``norm``: the residual's cotangent (the block's input) added to the norm's
    #: backward before the psum (affine in the product: ``psum(dy + norm_backward(...))``)
    cotangent: bool = False
    #: rs, psum with ``norm``: the gain's gradient (a sum over the rows) returned beside the sum,
    #: each device's own (no collective); False: the gain frozen, only the input gradient
    gain: bool = True
    #: rs: a mesh axis the product is first psum'd over (the contraction sharded over it too), then
    #: sum-scattered over ``axes``: a reduction in two stages, as an FSDP x TP gradient lowers;
    #: the pass moves the scatter before the psum, onto the product ("": one stage)
    first: str = ""
    #: rs: zero rows padded onto the product along the scattered dim before the scatter, (before,
    #: after) the product's own (a sequence that does not divide the devices, padded to a multiple
    #: of them): the pass moves the padding onto the dot's operand and masks the pad rows
    pad: tuple[int, int] = (0, 0)
    #: ag: rows (before, after) cropped from the gathered dim before the dots (the padding's transpose
    #: in a backward): the pass moves the crop past the dots, zeroing the cropped rows of each shard
    #: where a dot contracts them
    crop: tuple[int, int] = (0, 0)
    #: psum (dim "k"): each block's product un-permuted before its psum, its rows scatter-added into
    #: zeros in a fixed order (a MoE block's un-permute into token order): the split and the chunks
    #: go along the features, which the scatter keeps whole
    unpermute: bool = False
    #: fsdp (dim "n"): no activation gather; a dot before (its compute hides the weight's gather),
    #: then the product, summed over the activation axis, psum_scatter'ed over it along the dim the
    #: weight is gathered on over the other axis: the scatter rings, the weight's gather stays plain
    scatter: bool = False
    #: ag_norm: what the gathered rows go through before their dots: "rms" or "ln" (row-wise: a
    #: statistic over the hidden dim only, the ring applies it per block), or a chain that mixes
    #: rows, which the pass must decline or compute right: "mean_rows" (the RMS statistic taken
    #: over the gathered dim), "cumsum" (a cumulative sum over the gathered rows, then an RMS norm)
    norm_kind: str = ""
    #: ag_norm: the norm's gain: "" none, "rep" the same on every device, "dev" each device's own
    #: (a [ring, hidden] input sharded over the ring); ``bias``: a bias added after it (replicated)
    gain_mode: str = ""
    bias: bool = False
    #: ag_norm: the raw gathered rows' other reader: "return" (returned beside the dots' result, as
    #: a backward's residual), "residual" (added to the dots' result, whose width is the hidden's)
    #: or "none" (only the norm reads them: the gather moves past it, or, where that move is
    #: refused — a device's own gain, a norm kept in f32 — the ring applies the norm alone)
    raw: str = ""
    #: ag_norm, 16-bit types: the norm computed in f32 (converts on the way in and back out)
    upcast: bool = False
    #: ag_norm on a 2-D mesh: the batch dim sharded over the other ("data") axis (a data x model mesh)
    data: bool = False

    @property
    def names(self) -> tuple[str, ...]:
        return ("x", "y", "z")[: len(self.mesh_shape)]

    @property
    def ring(self) -> int:
        return math.prod(self.mesh_shape[self.names.index(a)] for a in self.axes)

    def may_decline(self) -> frozenset[str]:
        """Reasons a site of an expected program may still be declined for: with both operands
        gathered, the second gather when the first ring's round 0 is in its loop (`uni`, or
        `unroll2` with an even number of sending rounds), since that loop reads the second
        gathered value and the only dot left reading it waits for the loop ('schedule')."""
        if self.kind == "fsdp" and self.grad:  # its backward also: the weight gradient's scatter where the
            # cotangent's ring keeps its dot (ring_pairs), the weight gradients' psums over mesh axes the block
            # does not shard (of a scatter, or of a product too small to divide)
            return frozenset({"prefetchable", "lost_to_ring", "gathered_operand", "producer_not_dot", "no_dim"})
        if self.kind == "fsdp":  # the weight's gather, where the activation's ring took its dot
            return frozenset({"prefetchable", "lost_to_ring"})
        if self.kind == "scan" and self.grad:  # the input gradient's psum of the whole loop; under
            # remat the backward's layer behind remat's optimization_barrier (sunk, not ringed)
            return frozenset({"producer_not_dot", "user_not_dot", "layout", "multiple_users"})
        if self.chained:  # a weight gradient's psum over mesh axes the block does not shard: of a scatter, or not dividing
            return frozenset({"producer_not_dot", "no_dim"})
        if self.kind == "psum" and self.norm and self.dim == "k":
            # the norm's sums over the features need whole rows, and the rows do not divide: no dim
            return frozenset({"no_dim"})
        return frozenset({"schedule"}) if self.kind == "ag2" else frozenset()

    def may_decline_under(self, options) -> frozenset[str]:
        """:meth:`may_decline`, and under ``--all-reduce chunk`` the rows of a psum that cut into
        no equal chunk count ('chunks')."""
        chunk = self.kind == "psum" and options.all_reduce == "chunk"
        return self.may_decline() | (frozenset({"chunks"}) if chunk else frozenset())

    def expect_rewrite(self) -> bool:
        """Sites the pass must rewrite (anything else may be declined, never miscompiled)."""
        if self.kind == "ag":  # (a complex value's crop is not moved)
            return self.dim in ("m", "k", "b") and not (sum(self.crop) and self.dtype == "c64")
        if self.kind == "rs":  # (a complex product's padding is not moved; spread sums are taken out of a
            # tiled scatter of the product itself, not of a reshape or a first stage's psum)
            return (self.dim in ("m", "n", "b") and not (sum(self.pad) and self.dtype == "c64")
                    and not (self.spread and (self.first or not self.tiled)))
        if self.kind == "ag_norm" and self.dim == "k":  # a norm over the gathered features: moved where
            # nothing else reads them, every device has the same gain, and the sums' all_reduces (a
            # value per row, each byte about twice on the wire) are at most 1/8 of the gathered bytes
            stat, item = (4 if self.upcast else DTYPE_BYTES[self.dtype]), DTYPE_BYTES[self.dtype]
            sums = 2 if self.norm_kind == "ln" else 1
            return (self.norm_kind in ("rms", "ln", "mean_rows") and self.raw == "none" and self.gain_mode != "dev"
                    and 16 * sums * stat <= self.sizes[1] * self.ring * item)
        if self.kind == "ag_norm":  # a row-wise norm: the ring applies it per block
            return self.norm_kind in ("rms", "ln")
        return self.kind in ("chain", "mlp", "ag2", "psum", "fsdp", "scan")


#: row-wise ops between Megatron blocks (a psum's readers the split carries the rows through)
POINTWISE = ("residual", "bias", "rms", "ln", "tanh", "vary")


@st.composite
def specs(draw, kinds: tuple[str, ...] | None = None, norm: bool | None = None, two_stage: bool = False,
          pad: bool = False) -> Spec:
    """A random program; ``kinds``: only those kinds (a targeted campaign, ``fuzz.py --kind``);
    ``norm=True``: a norm's backward wherever the kind and dtype take one (``fuzz.py --norm``);
    ``two_stage``: only scatters of a psum over another mesh axis (``fuzz.py --two-stage``);
    ``pad``: only scatters of a zero-padded product (``fuzz.py --pad``)."""
    if two_stage:
        kinds = ("rs",)
    if pad:
        kinds = ("rs", "ag")
    mesh_shape = draw(st.sampled_from(MESHES))
    size = math.prod(mesh_shape)
    devices = tuple(draw(st.permutations(range(8)))[:size])
    names = ("x", "y", "z")[: len(mesh_shape)]
    if len(names) > 1 and draw(st.booleans()):
        axes = tuple(draw(st.permutations(names))[:2])
    else:
        axes = (draw(st.sampled_from(names)),)
    kind = draw(st.sampled_from(list(kinds) if kinds else
                                ["ag", "ag", "rs", "rs", "chain", "mlp", "ag2", "psum", "psum", "fsdp", "scan", "scan"]))
    if kind == "fsdp" and len(mesh_shape) < 2:
        kind = "ag2"  # a weight's and an activation's gathers over two mesh axes need two
    dtype = draw(st.sampled_from(["f32", "f32", "f32", "bf16", "bf16", "i32", "i32", "f16", "f64", "c64"]))
    if kind in ("mlp", "psum", "scan"):
        dtype = "f32" if dtype in ("i32", "c64") else dtype  # gelu, norms, tanh
    dims = {"ag": ["m", "k", "b"], "rs": ["m", "n", "b"], "chain": ["m", "k"], "mlp": ["m"], "ag2": ["m"],
            "psum": ["m", "m", "k"], "fsdp": ["k", "n"], "scan": ["k", "n"],
            "ag_norm": ["m"]}[kind]  # ag_norm redraws its own (_gather_norm)
    dim = draw(st.sampled_from(dims))
    batch = dim == "b" or draw(st.booleans())
    spec = Spec(
        mesh_shape=mesh_shape,
        devices=devices,
        axes=axes,
        kind=kind,
        dim=dim,
        side=draw(st.integers(0, 1)),
        batch=batch,
        tiled=draw(st.booleans()),
        dtype=dtype,
        # rs: a sum of that many products; psum: that many blocks
        consumers=draw(st.integers(1, 3)) if kind in ("ag", "rs", "psum") else 1,
        reader=kind == "ag" and draw(st.booleans()),
        partial_manual=kind != "fsdp" and len(mesh_shape) > len(axes) and draw(st.booleans()),
        sizes=tuple(draw(st.sampled_from([1, 2, 3, 4])) for _ in range(4)),
        repeat=draw(st.sampled_from([1, 1, 2, 3])),
        prep=kind == "ag" and draw(st.booleans()),
        early=kind == "ag" and draw(st.booleans()),
        scale=kind in ("ag", "rs") and draw(st.booleans()),
        between=tuple(draw(st.lists(st.sampled_from(POINTWISE), max_size=4))) if kind == "psum" else (),
        remat=kind == "scan" and draw(st.booleans()),
        grad=kind == "scan" and draw(st.booleans()),
        norm=kind in ("rs", "psum") and dtype in ("f32", "bf16", "f16", "f64") and (norm or draw(st.booleans())),
    )
    if spec.norm:
        spec = replace(spec, gain=draw(st.booleans()), cotangent=kind == "psum" and draw(st.booleans()),
                       spread=kind == "rs" and draw(st.booleans()))
    if kind == "mlp" and draw(st.booleans()):  # a training step of chained layers (4 or more: a group and a trim)
        spec = replace(spec, chained=True, grad=True, repeat=draw(st.sampled_from([3, 4, 5])))
    others = [a for a in names if a not in axes]
    if two_stage:
        assume(others)
        spec = replace(spec, partial_manual=False)
    if kind == "rs" and others and not spec.partial_manual and (two_stage or draw(st.booleans())):
        spec = replace(spec, first=draw(st.sampled_from(others)))
    if kind == "ag_norm":
        spec = _gather_norm(draw, spec)
    if pad and kind == "rs":  # what a padding moves past: one product, straight into a tiled scatter of a free dim
        spec = replace(spec, dim=draw(st.sampled_from(["m", "n"])), tiled=True, consumers=1, norm=False, scale=False,
                       first="")
    if pad and kind == "ag":  # what a crop moves past: dots reading the gathered rows, nothing else
        spec = replace(spec, dim=draw(st.sampled_from(["m", "k"])), tiled=True, scale=False, early=False,
                       reader=False, prep=False)
    if (kind == "rs" and spec.dim in ("m", "n") and spec.tiled and spec.consumers == 1
            and not (spec.norm or spec.scale or spec.first) and (pad or draw(st.booleans()))):
        total = draw(st.integers(1, spec.ring * _sizes(spec)[spec.dim] - 1))
        before = draw(st.integers(0, total))
        spec = replace(spec, pad=(before, total - before))
    if (kind == "ag" and spec.dim in ("m", "k") and spec.tiled and not (spec.scale or spec.early or spec.reader)
            and (pad or draw(st.booleans()))):
        total = draw(st.integers(1, spec.ring * _sizes(spec)[spec.dim] - 1))
        before = draw(st.integers(0, total))
        spec = replace(spec, crop=(before, total - before))
    if kind == "psum" and spec.dim == "k" and not spec.norm and draw(st.booleans()):
        spec = replace(spec, unpermute=True)
    if kind == "fsdp" and spec.dim == "n" and draw(st.booleans()):
        spec = replace(spec, scatter=True)
        if dtype in ("f32", "bf16", "f16", "f64") and draw(st.booleans()):
            # its training step: the backward's weight-gradient scatter meets the cotangent's gather (ring_pairs)
            spec = replace(spec, grad=True)
    if spec.grad and spec.partial_manual:
        # XLA CPU (jax 0.10.2) aborts compiling the *original* backward of a bf16 scan in a
        # partially manual region ("Invalid binary instruction opcode copy"): not a program to fuzz with
        spec = replace(spec, partial_manual=False)
    return spec


#: bytes per element of each drawn type
DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "f64": 8, "i32": 4, "c64": 8}

#: ag_norm's chains from the gathered rows to the dots: two row-wise norms, two that mix rows
GATHER_NORMS = ("rms", "ln", "rms", "ln", "mean_rows", "cumsum")


def _gather_norm(draw, spec: Spec) -> Spec:
    """``spec`` (drawn as any kind's) made an ag_norm program: a 1-D mesh, or a data x model 2-D
    one gathered over its model axis (``y``); the gathered dim ("m", or "b" of a [b, m, k]
    value; or "k", the features the norm is over), a float type, the norm and what else reads the raw rows.  Only ag_norm programs draw
    here: the other kinds' programs for a seed are the ones they were."""
    mesh_shape = {(2, 2, 2): (2, 4)}.get(spec.mesh_shape, spec.mesh_shape)
    axes = ("y",) if len(mesh_shape) == 2 else ("x",)
    # "k": the features gathered, the norm over them (its sums: partial sums and an all_reduce)
    dim = draw(st.sampled_from(["m", "m", "b", "k"]))
    batch = dim == "b" or draw(st.booleans())
    data = len(mesh_shape) == 2 and batch and dim == "m" and draw(st.booleans())
    dtype = draw(st.sampled_from(["f32", "bf16", "f16"]))
    return replace(
        spec, mesh_shape=mesh_shape, axes=axes, dim=dim, side=0, batch=batch, dtype=dtype,
        consumers=draw(st.integers(1, 2)),  # 2: gate and up projections of the same normalised rows
        reader=False, prep=False, scale=False, data=data,
        partial_manual=len(mesh_shape) == 2 and not data and draw(st.booleans()),
        norm_kind=draw(st.sampled_from(GATHER_NORMS)), gain_mode=draw(st.sampled_from(["", "rep", "dev"])),
        bias=draw(st.booleans()), raw=draw(st.sampled_from(["return", "residual", "none"])),
        upcast=dtype != "f32" and draw(st.booleans()))


# ---------------------------------------------------------------------------- programs
def _spec_at(rank: int, dim: int, axes: tuple[str, ...]) -> P:
    parts: list = [None] * rank
    parts[dim] = axes if len(axes) > 1 else axes[0]
    return P(*parts)


def _einsum(x_labels: str, w_labels: str, side: int, out_free_order: str) -> str:
    a, b = (x_labels, w_labels) if side == 0 else (w_labels, x_labels)
    return f"{a},{b}->{out_free_order}"


def _dot(spec: Spec, a, b, expr):
    kwargs = {"preferred_element_type": jnp.float32} if spec.dtype == "bf16" else {}
    return jnp.einsum(expr, a, b, **kwargs)


def build(spec: Spec):
    """(shard_map body, [(global shape, PartitionSpec)], out_specs) of ``spec``."""
    kinds = {"ag": _gather_program, "rs": _scatter_program, "chain": _chain_program, "ag2": _both_gathered_program,
             "psum": _megatron, "ag_norm": _gather_norm_program, "scan": _scan_program, "fsdp": _fsdp_program}
    return kinds.get(spec.kind, _mlp_program)(spec)


def _sizes(spec: Spec) -> dict[str, int]:
    """The per-device size of each dim label: m, k, n and b (``spec.sizes``)."""
    m, k, nn, b = spec.sizes
    return {"m": m, "k": k, "n": nn, "b": b}


def _gather_program(spec: Spec):
    """ag: ``all_gather(x) @ w`` for each of ``spec.consumers`` weights, x gathered on ``spec.dim``
    (free, contracting or batch), on either side of the dot; a non-dot reader, a weight prepared
    just before its dot or one read before the gather's first dot where the spec says."""
    n = spec.ring
    axes = spec.axes
    bl = "b" if spec.batch else ""
    sizes = _sizes(spec)
    x_labels, w_labels = bl + "mk", bl + "kn"
    out = bl + ("mn" if spec.side == 0 else "nm")
    expr = _einsum(x_labels, w_labels, spec.side, out)
    g = x_labels.index(spec.dim)
    glob = dict(sizes)
    glob[spec.dim] = sizes[spec.dim] * n
    x_shape = [glob[c] for c in x_labels]
    glob[spec.dim] -= sum(spec.crop)  # the rows the dots read
    w_shape = [glob[c] for c in w_labels]
    untiled = not spec.tiled and g == 0

    def body(x, *ws):
        if untiled:
            gathered = jax.lax.all_gather(x, axes, axis=0, tiled=False)
            gathered = gathered.reshape((-1,) + x.shape[1:])
        else:
            gathered = jax.lax.all_gather(x, axes, axis=g, tiled=True)
        if sum(spec.crop):
            gathered = jax.lax.slice_in_dim(gathered, spec.crop[0], gathered.shape[g] - spec.crop[1], axis=g)
        if spec.scale:  # by 3, which rounds in bf16/f16: the check compiles without excess precision
            gathered = gathered * jnp.asarray(3, gathered.dtype)
        early = jnp.swapaxes(gathered, -1, -2) if spec.early else None
        if spec.early:  # every weight through a cumulative sum after it, before the first dot
            ws = [jnp.cumsum(w, axis=-1) for w in ws]

        def prepared(w):  # traced just before its dot
            return w * jnp.asarray(2, w.dtype) if spec.prep else w

        outs = [_dot(spec, gathered, prepared(w), expr) if spec.side == 0 else _dot(spec, prepared(w), gathered, expr)
                for w in ws]
        if spec.reader:
            outs.append(jnp.tanh(gathered) if spec.dtype != "i32" else gathered * 2)
        if spec.early:
            outs.append(early)
        return tuple(outs)

    args = [(x_shape, _spec_at(len(x_shape), g, axes))] + [(w_shape, P())] * spec.consumers
    return body, args, tuple(P() for _ in range(spec.consumers + spec.reader + spec.early))


def _scatter_program(spec: Spec):
    """rs: row-parallel: the contraction k is split over the axes; the product (a sum of
    ``spec.consumers`` products) is sum-scattered on ``spec.dim``, after a norm's backward and a psum
    over ``spec.first`` where the spec says."""
    n = spec.ring
    k = spec.sizes[1]
    axes = spec.axes
    bl = "b" if spec.batch else ""
    sizes = _sizes(spec)
    a_labels, b_labels = bl + "mk", bl + "kn"
    out = bl + ("mn" if spec.side == 0 else "nm")
    expr = _einsum(a_labels, b_labels, spec.side, out)
    contraction = ((spec.first,) if spec.first else ()) + axes  # the k dim's axes
    first_size = spec.mesh_shape[spec.names.index(spec.first)] if spec.first else 1
    glob = dict(sizes, k=k * n * first_size)
    glob[spec.dim] = sizes[spec.dim] * n - sum(spec.pad)  # the product's own rows, padded to sizes * n
    a_shape = [glob[c] for c in a_labels]
    b_shape = [glob[c] for c in b_labels]
    d = out.index(spec.dim)

    def body(*operands):
        if spec.norm:
            *operands, normed = operands
        prod = None
        for a, bb in zip(operands[0::2], operands[1::2]):  # a sum of products, as a backward adds gradients
            term = _dot(spec, a, bb, expr) if spec.side == 0 else _dot(spec, bb, a, expr)
            prod = term if prod is None else prod + term
        if sum(spec.pad):
            prod = jnp.pad(prod, [spec.pad if i == d else (0, 0) for i in range(prod.ndim)])
        if spec.scale:
            prod = prod * jnp.asarray(3, prod.dtype)
        if spec.norm:
            prod, gain = _norm_backward(prod, normed.astype(prod.dtype), d, spec.spread)
        if spec.first:
            prod = jax.lax.psum(prod, spec.first)
        if spec.tiled:
            scattered = jax.lax.psum_scatter(prod, axes, scatter_dimension=d, tiled=True)
        else:
            split = prod.shape[:d] + (n, prod.shape[d] // n) + prod.shape[d + 1 :]
            scattered = jax.lax.psum_scatter(prod.reshape(split), axes, scatter_dimension=d, tiled=False)
        return (scattered, gain[None]) if spec.norm and spec.gain else scattered

    args = [(a_shape, _spec_at(len(a_shape), a_labels.index("k"), contraction)),
            (b_shape, _spec_at(len(b_shape), b_labels.index("k"), contraction))] * spec.consumers
    if spec.norm:  # the normed input: the product's shape, the same on every device
        args.append(([glob[c] for c in out], P()))
    if spec.norm and spec.gain:
        # [devices, the product's dims but the rows (or the rows alone)]: each device's own sum
        gain_rank = 2 if spec.spread else len(out)
        return body, args, (_spec_at(len(out), d, axes), _spec_at(gain_rank, 0, contraction))
    return body, args, _spec_at(len(out), d, axes)


def _chain_program(spec: Spec):
    """chain: gather x on m (free) or k (contracting); the product's n (the weight's free dim) is scattered."""
    n = spec.ring
    nn = spec.sizes[2]
    axes = spec.axes
    sizes = _sizes(spec)
    x_labels, w_labels = "mk", "kn"
    glob = dict(sizes, n=nn * n)
    glob[spec.dim] = sizes[spec.dim] * n
    g = x_labels.index(spec.dim)

    def body(x, w):
        gathered = jax.lax.all_gather(x, axes, axis=g, tiled=True)
        return jax.lax.psum_scatter(_dot(spec, gathered, w, "mk,kn->mn"), axes, scatter_dimension=1, tiled=True)

    args = [([glob[c] for c in x_labels], _spec_at(2, g, axes)), ([glob[c] for c in w_labels], P())]
    return body, args, _spec_at(2, 1, axes)


def _both_gathered_program(spec: Spec):
    """ag2: both operands gathered: x's rows and w's columns (each its own ring; the first ring's
    round-0 dot reads w's gathered value, which the second ring computes)."""
    n = spec.ring
    m, k, nn, _ = spec.sizes
    axes = spec.axes

    def body(x, w):
        gx = jax.lax.all_gather(x, axes, axis=0, tiled=True)
        return _dot(spec, gx, jax.lax.all_gather(w, axes, axis=1, tiled=True), "mk,kn->mn")

    return body, [([m * n, k], _spec_at(2, 0, axes)), ([k, nn * n], _spec_at(2, 1, axes))], P()


def _scan_program(spec: Spec):
    """scan: stacked [L, K, K] weights sharded on their contracting (k) or free (n) dim, gathered before a
    scan over the L layers whose step multiplies layer i (the pass sinks the gather into the loop)."""
    n = spec.ring
    m, k, _, _ = spec.sizes
    axes = spec.axes
    layers, size = spec.sizes[3] + 1, k * n
    w_dim = 1 if spec.dim == "k" else 2

    def body(x, ws):
        stack = jax.lax.all_gather(ws, axes, axis=w_dim, tiled=True)

        def step(h, w):
            # scaled so that tanh stays off saturation: a saturated tanh's backward (1 - tanh²)
            # cancels, and any reordering of the forward's sums then moves the gradient by far
            # more than the original's own error (a false alarm the fuzzer found, seed 0)
            return jnp.tanh(_dot(spec, h, w, "mk,kn->mn") / size).astype(h.dtype), None

        h, _ = jax.lax.scan(jax.checkpoint(step) if spec.remat else step, x, stack)
        return h

    return body, [([m, size], P()), ([layers, size, size], P(*[axes if d == w_dim else None for d in range(3)]))], P()


def _fsdp_program(spec: Spec):
    """fsdp: FSDP x TP: x's rows gathered over the activation axis, w gathered over another mesh axis along its
    contracting (k) or free (n) dim; the two gathers meet at one dot (analysis.slack picks the ring)."""
    m, k, nn, _ = spec.sizes
    act = spec.axes[0]
    weight = next(name for name in spec.names if name != act)
    act_size, size = (spec.mesh_shape[spec.names.index(a)] for a in (act, weight))
    w_dim = 0 if spec.dim == "k" else 1
    contracting = k * size if w_dim == 0 else k
    if spec.scatter:
        return _fsdp_scatter_program(spec, act, weight, act_size, size)

    def body(x, w):
        gx = jax.lax.all_gather(x, act, axis=0, tiled=True)
        gx = jnp.tanh(gx) if spec.dtype in ("f32", "bf16", "f16", "f64") else gx
        return _dot(spec, gx, jax.lax.all_gather(w, weight, axis=w_dim, tiled=True), "mk,kn->mn")

    return body, [([m * act_size, contracting], _spec_at(2, 0, (act,))),
                  ([contracting, nn * (1 if w_dim == 0 else size)], _spec_at(2, w_dim, (weight,)))], P()


def _fsdp_scatter_program(spec: Spec, act: str, weight: str, act_size: int, size: int):
    """fsdp with ``scatter``: ``psum_scatter(tanh(x @ s) @ all_gather(w, weight, axis=1), act, 1)``,
    the contraction split over ``act``; the dot before the gathered weight's hides its gather."""
    m, k, nn, _ = spec.sizes
    width = nn * act_size  # each device's columns of w: the product's scatter along them divides

    def body(x, s, w):
        h = _dot(spec, x, s, "mk,kn->mn")
        h = (jnp.tanh(h) if spec.dtype in ("f32", "bf16", "f16", "f64") else h).astype(x.dtype)
        y = _dot(spec, h, jax.lax.all_gather(w, weight, axis=1, tiled=True), "mk,kn->mn")
        return jax.lax.psum_scatter(y, act, scatter_dimension=1, tiled=True)

    return body, [([m, k * act_size], _spec_at(2, 1, (act,))), ([k, k], P()),
                  ([k * act_size, width * size], P(act, weight))], _spec_at(2, 1, (act,))


def _mlp_program(spec: Spec):
    """mlp: a sequence-parallel MLP block: rows gathered, gelu, rows sum-scattered."""
    n = spec.ring
    m, k, nn, _ = spec.sizes
    axes = spec.axes

    def body(x, w1, w2):
        h = jax.nn.gelu(_dot(spec, jax.lax.all_gather(x, axes, axis=0, tiled=True), w1, "mk,kn->mn"))
        h = h.astype(x.dtype)
        return jax.lax.psum_scatter(_dot(spec, h, w2, "mn,nk->mk"), axes, scatter_dimension=0, tiled=True)

    args = [([m * n, k], _spec_at(2, 0, axes)), ([k, nn * n], _spec_at(2, 1, axes)), ([nn * n, k], _spec_at(2, 0, axes))]
    return body, args, _spec_at(2, 0, axes)


def _norm_backward(dy, x, d: int, spread: bool = False):
    """An RMS norm's backward (of ``x``, normalised over every dim but ``d``; ``spread``: over ``d``
    alone) applied to ``dy``, and the gain's gradient: what ``jax.grad`` puts between an SP layer's
    (a features-sharded layer's) input-gradient dot and its scatter, written on any dims."""
    rest = tuple(i for i in range(dy.ndim) if i != d)
    other = (d,) if spread else rest
    count = math.prod(dy.shape[i] for i in other)
    rs = jax.lax.rsqrt(jnp.mean(x * x, axis=other, keepdims=True) + 1)
    dx = rs * dy - x * rs ** 3 / count * jnp.sum(dy * x, axis=other, keepdims=True)
    return dx, jnp.sum(dy * x * rs, axis=rest if spread else d)


def _gather_norm_program(spec: Spec):
    """Rows gathered over the ring (dim 0 of [m, k] or 0/1 of [b, m, k]), normalised over the
    hidden dim k (``spec.norm_kind``; the negatives mix rows), into one or two dots (gate and up:
    ``silu(n @ wg) * (n @ wu)``); the raw gathered rows returned or added after the dots."""
    n = spec.ring
    m, k, nn, b = spec.sizes
    axes = spec.axes
    names = spec.names
    data = names[0] if spec.data else None  # the batch dim's axis on a data x model mesh
    data_size = spec.mesh_shape[0] if spec.data else 1
    labels = ("b" if spec.batch else "") + "mk"
    g = labels.index(spec.dim)
    glob = {"b": b * data_size, "m": m, "k": k}
    glob[spec.dim] *= n
    x_parts: list = [None] * len(labels)
    x_parts[g] = axes if len(axes) > 1 else axes[0]
    if data:
        x_parts[0] = data
    residual = spec.raw == "residual"
    width = glob["k"] if residual else nn * n  # the dots' output width (column-parallel when returned beside)
    eps = 1e-3

    def norm(h, gain, bias):
        src = h.astype(jnp.float32) if spec.upcast else h
        if spec.norm_kind == "cumsum":  # a cumulative sum over the gathered rows: mixes rows
            src = jnp.cumsum(src, axis=g)
        if spec.norm_kind == "ln":
            src = src - jnp.mean(src, axis=-1, keepdims=True)
        # the statistic over the hidden dim, but over the gathered dim for "mean_rows" (mixes rows)
        over = g if spec.norm_kind == "mean_rows" else -1
        out = src * jax.lax.rsqrt(jnp.mean(src * src, axis=over, keepdims=True) + eps)
        if gain is not None:
            out = out * gain.astype(out.dtype)
        if bias is not None:
            out = out + bias.astype(out.dtype)
        return out.astype(h.dtype)

    def body(x, *rest):
        rest = list(rest)
        gain = rest.pop(0) if spec.gain_mode else None
        if spec.gain_mode == "dev":
            gain = gain[0]  # [1, k]: this device's own gain
        bias = rest.pop(0) if spec.bias else None
        if spec.tiled or g != 0:
            h = jax.lax.all_gather(x, axes, axis=g, tiled=True)
        else:
            h = jax.lax.all_gather(x, axes, axis=0, tiled=False).reshape((-1,) + x.shape[1:])
        normed = norm(h, gain, bias)
        expr = f"{labels},kn->{labels[:-1]}n"
        outs = [_dot(spec, normed, w, expr) for w in rest]
        y = jax.nn.silu(outs[0]) * outs[1] if len(outs) == 2 else outs[0]
        if residual:
            return y + h.astype(y.dtype)
        return y if spec.raw == "none" else (y, h)

    args = [([glob[c] for c in labels], P(*x_parts))]
    features = glob["k"]  # the norm's width (the gathered features, where they are gathered)
    if spec.gain_mode == "rep":
        args.append(([features], P()))
    elif spec.gain_mode == "dev":
        args.append(([n, features], _spec_at(2, 0, axes)))
    if spec.bias:
        args.append(([features], P()))
    w_spec = P() if residual else _spec_at(2, 1, axes)
    args += [([features, width], w_spec)] * spec.consumers
    # the results: the gathered rows on every device of the ring (the batch dim sharded over data)
    rows = [data] + [None] * (len(labels) - 1)
    y_spec = P(*rows) if residual else P(*rows[:-1], axes if len(axes) > 1 else axes[0])
    return body, args, y_spec if residual or spec.raw == "none" else (y_spec, P(*rows))


def _megatron(spec: Spec):
    """``spec.consumers`` Megatron MLP blocks without sequence parallelism: the rows replicated
    over the axes, ``psum(gelu(y @ w1) @ w2)``, then ``spec.between`` on the sum before the next
    block; the last block's output returned."""
    n = spec.ring
    m, k, nn, _ = spec.sizes
    rows = m * n if spec.dim == "m" else m * n + 1  # "k": no row count divides: the features split
    features = k if spec.dim == "m" else k * n
    axes = spec.axes if len(spec.axes) > 1 else spec.axes[0]

    def between(y, x, bias):
        for name in spec.between:
            if name == "residual":
                y = y + x.astype(y.dtype)
            elif name == "bias":
                y = y + bias.astype(y.dtype)
            elif name == "rms":
                y = y * jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + 1e-3)
            elif name == "ln":
                centred = y - jnp.mean(y, axis=-1, keepdims=True)
                y = centred * jax.lax.rsqrt(jnp.mean(centred * centred, axis=-1, keepdims=True) + 1e-3)
            elif name == "tanh":
                y = jnp.tanh(y)
            else:  # "vary": a different factor on every device of the ring
                y = y * (1 + jax.lax.axis_index(axes).astype(y.dtype) / 8)  # exact in every float type
        return y

    def body(x, bias, *weights):
        if spec.norm:
            *weights, normed = weights
        y, gains = x, []
        for w1, w2 in zip(weights[0::2], weights[1::2]):
            # weights scaled by 1/sqrt(fan-in) where used, as models initialise them: activations stay
            # near 1 (unit-normal weights grow them by sqrt(fan-in) a block, and the check's fixed
            # tolerance then sees the rounding of reordered sums grow with them)
            w1, w2 = w1 * (features ** -0.5), w2 * ((nn * n) ** -0.5)
            h = jax.nn.gelu(_dot(spec, y, w1, "mk,kn->mn")).astype(x.dtype)
            prod = _dot(spec, h, w2, "mn,nk->mk")
            if spec.unpermute:  # row i goes to row order[i], added into zeros
                order = jnp.asarray(np.random.default_rng(rows).permutation(rows), jnp.int32)
                prod = jnp.zeros_like(prod).at[order].add(prod)
            if spec.norm:  # an RMS norm's backward over the features (the rows, dim 0, kept)
                prod, gain = _norm_backward(prod, normed.astype(prod.dtype), 0)
                gains.append(gain[None])
                if spec.cotangent:  # the residual's cotangent, the same on every device
                    prod = prod + y.astype(prod.dtype)
            y = between(jax.lax.psum(prod, axes), y, bias).astype(x.dtype)
        return (y, *gains) if spec.norm and spec.gain else y

    args = [([rows, features], P()), ([features], P())]
    args += [([features, nn * n], _spec_at(2, 1, spec.axes)), ([nn * n, features], _spec_at(2, 0, spec.axes))] * \
        spec.consumers
    if spec.norm:  # the norm's input (saved by the forward): the same on every device
        args.append(([rows, features], P()))
    if spec.norm and spec.gain:  # [devices, features]: each device's own sum over the rows, per block
        return body, args, (P(), *[_spec_at(2, 0, spec.axes)] * spec.consumers)
    return body, args, P()


def lower(spec: Spec) -> str:
    devices = [jax.devices("cpu")[i] for i in spec.devices]
    mesh = Mesh(np.array(devices).reshape(spec.mesh_shape), spec.names)
    body, args, out_specs = build(spec)
    kwargs = {"axis_names": set(spec.axes)} if spec.partial_manual else {}
    f = jax.shard_map(body, mesh=mesh, in_specs=tuple(s for _, s in args), out_specs=out_specs, check_vma=False, **kwargs)
    dtype = DTYPES[spec.dtype]
    structs = [jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=NamedSharding(mesh, s)) for shape, s in args]
    if spec.chained:
        single = f

        def f(x, *weights):
            for _ in range(spec.repeat):
                x = single(x, *weights)
            return x
    elif spec.repeat > 1:
        single = f

        def f(*operands):
            return [single(*operands) for _ in range(spec.repeat)]
    if spec.grad:
        forward = f

        def loss(*operands):
            return sum(jnp.sum(jnp.square(out.astype(jnp.float32))) for out in jax.tree.leaves(forward(*operands)))

        # a chain's gradient over the weights only: the first layer's backward returns none for its input
        f = jax.value_and_grad(loss, argnums=tuple(range(1 if spec.chained else 0, len(args))))

    with jax.enable_x64(DTYPES[spec.dtype] == jnp.float64):
        return jax.jit(f).lower(*structs).as_text()


def check(spec: Spec, tally: Tally | None = None, variants=VARIANTS) -> Tally:
    """Rewrite ``spec``'s program under every variant; record and assert the oracle's verdicts."""
    def expected(name: str, result) -> list[str]:
        options = variants[name]
        if not (spec.expect_rewrite() and options.assemble):
            return []
        wrong = []
        allowed = spec.may_decline_under(options)
        unexpected = [s for s in result.report.declined if s.reason_code not in allowed]
        excused = len(result.report.declined) > 0  # only for reasons the kind allows
        if not (len(result.report.rewritten) >= spec.repeat or excused) or unexpected:
            wrong.append(f"not every site rewritten: {[s.summary_line() for s in result.report.sites]}")
        if spec.kind in ("ag", "ag_norm") and not all(len(s.consumers) == spec.consumers
                                                      for s in result.report.rewritten):
            # every dot in the ring (through the norm, or prepared)
            wrong.append(f"a dot left out of its ring: {[s.summary_line() for s in result.report.sites]}")
        return wrong

    def replayed(name: str, result) -> None:
        tally.layer_calls += sum(map(len, result.report.layers.values()))
        tally.layer_checks += len(result.report.layer_checks)
        tally.trimmed += len(result.report.trimmed)
        differed = [c for c in result.report.layer_checks if not c["agreed"]]
        if differed:
            tally.differed.append((spec, name, "a group's last region (or a trimmed one) came out unlike its first: "
                                   + "; ".join(f"{c['first']} vs {c['last']}{' (trimmed)' if c.get('trimmed') else ''}"
                                               for c in differed)))

    tally = tally or Tally()
    devices = [jax.devices("cpu")[i] for i in range(math.prod(spec.mesh_shape))]
    return check_variants(spec, lower(spec), devices, tally, variants, expected, after=replayed)
