"""The attention kind of the differential fuzzer (``fuzz.py --kind attention``): context-parallel
attention over all-gathered K and V (tools/samples_attention.py), which the pass turns into one
ring with an online softmax, and whose rematerialised backward it rewrites as passes of rings.

An :class:`AttentionSpec` draws the ring size, batch, sequence per device, query and KV heads
(multi-head, grouped-query, multi-query), head size, a causal mask, segment ids, the einsum form
or ``jax.nn.dot_product_attention``'s XLA form, the element type, the forward or its training
step (with or without ``jax.checkpoint`` around the attention), a dropout of the probabilities
with a device-varying key (the einsum form), and the near misses the matcher
must decline: a square root on the probabilities (``attn_softmax``) and a padding mask read from
the gathered keys (``attn_region``).  :func:`check` rewrites each program under every variant
of the default campaign; under ``uni`` the oracle (:meth:`AttentionSpec.expected`) asks for one
ring attention where the spec is legal (the forward's, where a training step rematerialises it),
none and the right reason on the keys' gather otherwise, and one region of passes for a
rematerialised training step's backward; every result is run against the
original on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from hypothesis import strategies as st

from tools.fuzz_oracle import VARIANTS, Tally, check_variants
from tools.samples_attention import cp_attention, dropout


@dataclass(frozen=True)
class AttentionSpec:
    ring: int
    batch: int
    seq: int  # per device
    heads: int
    kv_heads: int
    head_dim: int
    causal: bool
    segments: bool
    dpa: bool  # jax.nn.dot_product_attention (implementation="xla") instead of the einsums
    dtype: str  # "f32" | "bf16"
    grad: bool
    remat: bool  # (with grad) the attention under jax.checkpoint
    near_miss: str  # "" | "sqrt" (attn_softmax) | "key_padding" (attn_region)
    dropout: bool = False  # (the einsum form) a dropout of the probabilities, each device's own mask

    kind = "attention"

    def declined_as(self) -> set[str]:
        """The reasons the keys' gathers may give (each attention's first failing condition);
        none where one ring attention is expected."""
        reasons = {"sqrt": {"attn_softmax"}, "key_padding": {"attn_region"}}.get(self.near_miss, set())
        if reasons and self.grad:  # (the training step's residuals, or its recompute's)
            reasons.add("attn_residual")
        return reasons or ({"attn_residual"} if self.grad and not self.remat else set())

    def expected(self, result) -> list[str]:
        """What the oracle finds wrong with ``result`` (policy all, uni)."""
        rings = [s for s in result.report.sites if s.kind == "ring_attention" and s.rewritten]
        why = {s.attention["two_rings"] for s in result.report.sites if s.attention.get("two_rings")}
        wanted = self.declined_as()
        if not wanted and len(rings) != 1:
            return [f"{len(rings)} ring attentions, 1 expected: {[s.summary_line() for s in result.report.sites]}"]
        if wanted and (rings or not why or not why <= wanted):
            return [f"{len(rings)} ring attentions and reasons {sorted(why)}, one of {sorted(wanted)} expected"]
        # a rematerialised backward: passes over the K and V blocks
        passes = [s for s in result.report.sites if s.kind == "column_passes" and s.rewritten]
        if len(passes) != (self.grad and self.remat):
            return [f"{len(passes)} column passes sites: {[s.summary_line() for s in result.report.sites]}"]
        return []

    def lower(self) -> str:
        after = jnp.sqrt if self.near_miss == "sqrt" else dropout() if self.dropout else None
        return cp_attention(causal=self.causal, heads=self.heads, kv_heads=self.kv_heads,
                            dtype={"f32": jnp.float32, "bf16": jnp.bfloat16}[self.dtype], segments=self.segments,
                            grad=self.grad, remat=self.remat, n=self.ring, batch=self.batch, seq=self.seq * self.ring,
                            head_dim=self.head_dim, after=after, dpa=self.dpa,
                            key_padding=self.near_miss == "key_padding")


@st.composite
def attention_specs(draw) -> AttentionSpec:
    kv_heads = draw(st.sampled_from([1, 2]))
    grad = draw(st.booleans())
    dpa = draw(st.booleans())
    return AttentionSpec(ring=draw(st.sampled_from([2, 4, 8])), batch=draw(st.sampled_from([1, 2])),
                         seq=draw(st.sampled_from([4, 8])), heads=kv_heads * draw(st.sampled_from([1, 2])),
                         kv_heads=kv_heads, head_dim=draw(st.sampled_from([4, 8])), causal=draw(st.booleans()),
                         segments=draw(st.booleans()), dpa=dpa, dtype=draw(st.sampled_from(["f32", "bf16"])),
                         grad=grad, remat=grad and draw(st.booleans()),
                         near_miss=(near_miss := draw(st.sampled_from(["", "", "", "key_padding"]
                                                                      + ([] if dpa else ["sqrt"])))),
                         dropout=not dpa and near_miss != "sqrt" and draw(st.booleans()))


def check(spec: AttentionSpec, tally: Tally | None = None, variants=VARIANTS) -> Tally:
    """Rewrite ``spec``'s program under every variant; record and assert the oracle's verdicts."""
    return check_variants(spec, spec.lower(), jax.devices("cpu")[: spec.ring], tally or Tally(), variants,
                          lambda name, result: spec.expected(result) if name == "uni" else [])
