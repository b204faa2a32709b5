"""The MoE kind of the differential fuzzer (``fuzz.py --kind moe``): MoE blocks whose expert
weights are FSDP-sharded and gathered before their grouped matmuls (``jax.lax.ragged_dot``), and
expert-parallel blocks exchanging capacity-padded slots with ``all_to_all`` (:class:`EpSpec`), and
Ulysses attention's exchanges (:class:`UlyssesSpec`).

A :class:`MoeSpec` draws the lowering's form (``chlo.ragged_dot`` lowered for cuda, the
composite ``jax.export`` writes, or jax's CPU lowering, dense masked dots), the ring size, the
experts and top-k (each token's k experts, weighted by the router's softmax), routing skewed so
some experts get no tokens, a shared expert (a dense FFN over every token, its weights gathered
too), the dim each expert weight is sharded and gathered along (its columns, its rows, or the
experts: the group dim, which the pass must decline), the element type, and the forward or its
training step (``value_and_grad`` over the weights: the gradients scattered back).
:func:`check` rewrites it under every variant of the default campaign and checks each result:
verification, the permute rings, every column or row gather (and, in the forward of the GPU
forms, no site along the experts) as expected under policy all with ``uni``, numerics against
the original on CPU (``cpu_copy``).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tools.fuzz_oracle import VARIANTS, Tally, check_variants

#: the dims an expert weight [experts, in, out] is sharded and gathered along
ALONG = {"cols": 2, "rows": 1, "experts": 0}


@dataclass(frozen=True)
class MoeSpec:
    form: str  # "gpu" (chlo.ragged_dot) | "export" (its composite) | "cpu" (dense masked dots)
    ring: int
    experts: int
    top_k: int
    tokens: int  # per device
    hidden: int
    ffn: int
    along: tuple[str, str, str]  # gate, up, down: ALONG's keys
    skew: bool  # the router favours the first experts: the last get no tokens
    shared: bool  # a shared expert: a dense SwiGLU over every token, its weights gathered along their columns
    dtype: str  # "f32" | "bf16"
    grad: bool

    kind = "moe"

    def expected(self, result) -> list[str]:
        """What the oracle finds wrong with ``result`` (the forward of a GPU form, policy all,
        uni): every gather along columns or rows a ring, every one along the experts declined
        ``ragged_dot``, nothing declined for another reason."""
        gathers = [s for s in result.report.sites if s.kind == "all_gather_dot"]
        rings = sum(1 for s in gathers if s.rewritten)
        along_experts = sum(1 for s in gathers if s.reason_code == "ragged_dot")
        wanted = sum(1 for a in self.along if a != "experts") + 3 * self.shared
        other = [s.summary_line() for s in result.report.declined if s.reason_code != "ragged_dot"]
        wrong = [f"{rings} gather rings, {wanted} expected"] if rings != wanted else []
        if along_experts != self.along.count("experts"):
            wrong.append(f"{along_experts} gathers along the experts declined, {self.along.count('experts')} expected")
        if other:
            wrong.append(f"declined for another reason: {other}")
        return wrong + ([str([s.summary_line() for s in result.report.sites])] if wrong else [])


@dataclass(frozen=True)
class EpSpec:
    """An expert-parallel MoE block: top-k routing into capacity slots (one-hot dispatch and
    combine einsums), the slots exchanged over the ring (``all_to_all``), each local expert's
    FFN, exchanged back. ``between``: what stands between the two matmuls: an activation, the
    activation times a per-row mask (a side operand along the exchanged capacity), a mean over
    the capacity (each expert apart: chunked along the experts where they divide), or a mean
    over the experts and the capacity (the near miss, to be declined ``a2a_region``)."""

    ring: int
    experts_per_device: int
    capacity: int
    top_k: int
    tokens: int  # per device
    hidden: int
    ffn: int
    between: str  # "gelu" | "silu_mask" | "mean"
    dtype: str
    grad: bool  # value_and_grad over the tokens and the weights: the backward's pair too

    kind = "moe-ep"

    def expected(self, result) -> list[str]:
        """What the oracle finds wrong with ``result`` (policy all, uni): the forward's pair
        chunked, or declined a2a_region where no dim is kept apart."""
        pairs = [s for s in result.report.sites if s.kind == "all_to_all_chunk"]
        if not pairs:
            return ["no all_to_all pair reported"]
        first = pairs[0]
        # a mean over the capacity leaves the experts apart: chunks of them, where they divide
        legal = self.between != "mean" and (self.between != "capacity_mean" or self.experts_per_device % 2 == 0)
        ok = first.rewritten if legal else (not first.rewritten and first.reason_code == "a2a_region")
        return [] if ok else [f"the forward's pair: {first.summary_line()}"]


@st.composite
def ep_specs(draw) -> EpSpec:
    return EpSpec(
        ring=draw(st.sampled_from([2, 4, 8])),
        experts_per_device=draw(st.sampled_from([1, 2])),
        capacity=draw(st.sampled_from([4, 8, 16])),
        top_k=draw(st.sampled_from([1, 1, 2])),
        tokens=draw(st.sampled_from([8, 16])),
        hidden=draw(st.sampled_from([8, 16])),
        ffn=draw(st.sampled_from([16, 32])),
        between=draw(st.sampled_from(["gelu", "silu_mask", "silu_mask", "capacity_mean", "mean"])),
        dtype=draw(st.sampled_from(["f32", "f32", "bf16"])),
        grad=draw(st.booleans()),
    )


def lower_ep(spec: EpSpec) -> str:
    mesh = Mesh(np.array(jax.devices("cpu")[: spec.ring]), ("expert",))
    dtype = {"f32": jnp.float32, "bf16": jnp.bfloat16}[spec.dtype]
    experts, capacity = spec.experts_per_device * spec.ring, spec.capacity

    def block(x, router, w1, w2, mask):
        _, ids = jax.lax.top_k(x @ router, spec.top_k)
        onehot = jax.nn.one_hot(ids, experts, dtype=x.dtype).sum(1)  # [T, E]: each token's k experts
        slot = ((jnp.cumsum(onehot, 0) - 1) * onehot).astype(jnp.int32)
        disp = onehot[:, :, None] * jax.nn.one_hot(slot, capacity, dtype=x.dtype)  # [T, E, C] (overflow dropped)
        y = jax.lax.all_to_all(jnp.einsum("tec,th->ech", disp, x), "expert", 0, 1, tiled=True)
        h = jnp.einsum("ech,ehf->ecf", y, w1)
        if spec.between == "gelu":
            h = jax.nn.gelu(h)
        elif spec.between == "silu_mask":
            h = jax.nn.silu(h) * mask
        elif spec.between == "capacity_mean":  # mixes the capacity, keeps the experts apart
            h = h - jnp.mean(h, axis=1, keepdims=True)
        else:  # mixes both
            h = h - jnp.mean(h, axis=(0, 1), keepdims=True)
        back = jax.lax.all_to_all(jnp.einsum("ecf,efh->ech", h, w2), "expert", 1, 0, tiled=True)
        return jnp.einsum("tec,ech->th", disp, back)

    specs = (P("expert"), P(), P("expert"), P("expert"), P("expert"))
    fn = jax.shard_map(block, mesh=mesh, in_specs=specs, out_specs=P("expert"), check_vma=False)
    if spec.grad:
        inner = fn

        def fn(x, router, w1, w2, mask):
            return jax.value_and_grad(lambda a, b, c: jnp.mean(inner(a, router, b, c, mask).astype(jnp.float32) ** 2),
                                      argnums=(0, 1, 2))(x, w1, w2)
    shapes = [(spec.tokens * spec.ring, spec.hidden), (spec.hidden, experts), (experts, spec.hidden, spec.ffn),
              (experts, spec.ffn, spec.hidden), (experts, spec.ring * capacity, spec.ffn)]
    structs = [jax.ShapeDtypeStruct(sh, dtype, sharding=NamedSharding(mesh, sp)) for sh, sp in zip(shapes, specs)]
    return jax.jit(fn).lower(*structs).as_text()


@dataclass(frozen=True)
class UlyssesSpec:
    """Ulysses attention: q, k, v stacked, exchanged from sequence-sharded to head-sharded, softmax
    attention per head (causal or not), exchanged back; the pair chunks along the batch, or at
    batch 1 along the heads."""

    ring: int
    batch: int
    seq: int  # per device
    heads_per_device: int
    dim: int
    causal: bool
    dtype: str
    grad: bool  # value_and_grad over the stacked q, k, v

    kind = "ulysses"

    def expected(self, result) -> list[str]:
        """The forward's pair chunked, and a training step's backward pair (attention's VJP per
        head, dq, dk and dv stacked by pads) as well."""
        pairs = [s for s in result.report.sites if s.kind == "all_to_all_chunk"]
        want = 2 if self.grad else 1
        if len(pairs) != want or not all(s.rewritten for s in pairs):
            return [f"{want} pair(s) chunked: {[s.summary_line() for s in result.report.sites]}"]
        return []


@st.composite
def ulysses_specs(draw) -> UlyssesSpec:
    ring = draw(st.sampled_from([2, 4, 8]))
    batch = draw(st.sampled_from([1, 2]))
    return UlyssesSpec(ring=ring, batch=batch, seq=draw(st.sampled_from([4, 8])),
                       heads_per_device=draw(st.sampled_from([2, 4])) if batch == 1 else draw(st.sampled_from([1, 2])),
                       dim=draw(st.sampled_from([4, 8])), causal=draw(st.booleans()),
                       dtype=draw(st.sampled_from(["f32", "f32", "bf16"])), grad=draw(st.booleans()))


def lower_ulysses(spec: UlyssesSpec) -> str:
    mesh = Mesh(np.array(jax.devices("cpu")[: spec.ring]), ("seq",))
    dtype = {"f32": jnp.float32, "bf16": jnp.bfloat16}[spec.dtype]
    total = spec.seq * spec.ring

    def attention(qkv):
        qkv = jax.lax.all_to_all(qkv, "seq", 3, 2, tiled=True)  # [3, B, S, H/n, D]
        q, k, v = qkv[0], qkv[1], qkv[2]
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / np.sqrt(spec.dim)
        if spec.causal:  # an additive bias (jnp.where on the scores lowers to a call the pair does not look into)
            s = s + jnp.where(jnp.arange(total)[:, None] >= jnp.arange(total)[None, :], 0.0, -1e9)
        o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1).astype(dtype), v)
        return jax.lax.all_to_all(o, "seq", 1, 2, tiled=True)  # [B, S/n, H, D]

    spec_in = P(None, None, "seq")
    fn = jax.shard_map(attention, mesh=mesh, in_specs=(spec_in,), out_specs=P(None, "seq"), check_vma=False)
    if spec.grad:
        inner = fn

        def fn(qkv):
            return jax.value_and_grad(lambda a: jnp.mean(inner(a).astype(jnp.float32) ** 2))(qkv)
    shape = (3, spec.batch, total, spec.heads_per_device * spec.ring, spec.dim)
    return jax.jit(fn).lower(jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec_in))).as_text()


@st.composite
def any_moe_specs(draw):
    """Any shape: FSDP'd grouped matmuls (:class:`MoeSpec`), expert parallelism (:class:`EpSpec`),
    Ulysses attention's exchanges (:class:`UlyssesSpec`)."""
    return draw(st.one_of(moe_specs(), ep_specs(), ulysses_specs()))


@st.composite
def moe_specs(draw) -> MoeSpec:
    experts, ring = draw(st.sampled_from([2, 4, 8])), draw(st.sampled_from([2, 4, 8]))
    along = tuple(draw(st.sampled_from(["cols", "cols", "rows", "experts"])) for _ in range(3))
    if "experts" in along:  # the experts sharded over the ring
        experts = max(experts, ring)
    return MoeSpec(
        form=draw(st.sampled_from(["gpu", "export", "cpu"])),
        ring=ring,
        experts=experts,
        top_k=draw(st.sampled_from([1, 1, 2])) if experts > 1 else 1,
        tokens=draw(st.sampled_from([8, 16, 24])),
        hidden=draw(st.sampled_from([8, 16])),
        ffn=draw(st.sampled_from([16, 32])),
        along=along,
        skew=draw(st.booleans()),
        shared=draw(st.booleans()),
        dtype=draw(st.sampled_from(["f32", "f32", "bf16"])),
        grad=draw(st.booleans()),
    )


def _weight_spec(along: str) -> P:
    parts = [None, None, None]
    parts[ALONG[along]] = "data"
    return P(*parts)


def lower(spec: MoeSpec) -> str:
    mesh = Mesh(np.array(jax.devices("cpu")[: spec.ring]), ("data",))
    dtype = {"f32": jnp.float32, "bf16": jnp.bfloat16}[spec.dtype]
    k = spec.top_k

    def gathered(w, along):
        return jax.lax.all_gather(w, "data", axis=ALONG[along], tiled=True)

    def block(x, router, w_gate, w_up, w_down, *shared):
        logits = (x @ router).astype(jnp.float32)
        if spec.skew:  # the last half of the experts never chosen: their groups are empty
            logits = logits + jnp.where(jnp.arange(spec.experts) < max(spec.experts // 2, k), 0.0, -1e4)
        weights, ids = jax.lax.top_k(jax.nn.softmax(logits), k)
        flat = ids.reshape(-1)
        order = jnp.argsort(flat)
        sizes = jnp.bincount(flat, length=spec.experts).astype(jnp.int32)
        xs = x[order // k]
        gate = jax.lax.ragged_dot(xs, gathered(w_gate, spec.along[0]), sizes)
        h = (jax.nn.silu(gate) * jax.lax.ragged_dot(xs, gathered(w_up, spec.along[1]), sizes)).astype(dtype)
        y = jax.lax.ragged_dot(h, gathered(w_down, spec.along[2]), sizes)[jnp.argsort(order)]
        y = jnp.sum(y.reshape(-1, k, spec.hidden) * weights[..., None].astype(y.dtype), axis=1).astype(dtype)
        if shared:
            s_gate, s_up, s_down = shared
            def col(w):
                return jax.lax.all_gather(w, "data", axis=1, tiled=True)
            hs = (jax.nn.silu(x @ col(s_gate)) * (x @ col(s_up))).astype(dtype)
            y = y + hs @ jax.lax.all_gather(s_down, "data", axis=0, tiled=True)
        return y

    e, hd, f = spec.experts, spec.hidden, spec.ffn
    shapes = [(spec.tokens * spec.ring, hd), (hd, e), (e, hd, f), (e, hd, f), (e, f, hd)]
    specs = [P("data"), P(), *(_weight_spec(a) for a in spec.along)]
    if spec.shared:
        shapes += [(hd, f), (hd, f), (f, hd)]
        specs += [P(None, "data"), P(None, "data"), P("data", None)]
    fn = jax.shard_map(block, mesh=mesh, in_specs=tuple(specs), out_specs=P("data"), check_vma=False)
    if spec.grad:
        inner = fn

        def fn(*a):
            return jax.value_and_grad(lambda *w: jnp.mean(inner(a[0], a[1], *w).astype(jnp.float32) ** 2),
                                      argnums=tuple(range(len(a) - 2)))(*a[2:])
    structs = [jax.ShapeDtypeStruct(s, dtype, sharding=NamedSharding(mesh, sp)) for s, sp in zip(shapes, specs)]
    jitted = jax.jit(fn)
    if spec.form == "gpu":
        return jitted.trace(*structs).lower(lowering_platforms=("cuda",)).as_text()
    if spec.form == "export":
        return jax.export.export(jitted, platforms=["cuda"])(*structs).mlir_module()
    return jitted.lower(*structs).as_text()


def check(spec: MoeSpec, tally: Tally | None = None, variants=VARIANTS) -> Tally:
    """Rewrite ``spec``'s program under every variant; record and assert the oracle's verdicts."""
    ep = isinstance(spec, (EpSpec, UlyssesSpec))
    text = lower_ulysses(spec) if isinstance(spec, UlyssesSpec) else lower_ep(spec) if ep else lower(spec)

    def expected(name, result) -> list[str]:
        return spec.expected(result) if name == "uni" and (ep or (spec.form != "cpu" and not spec.grad)) else []

    return check_variants(spec, text, jax.devices("cpu")[: spec.ring], tally or Tally(), variants, expected)
