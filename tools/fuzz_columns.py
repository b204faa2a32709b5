"""The columns kind of the differential fuzzer (``fuzz.py --kind columns``): contrastive losses
over negatives all-gathered along the batch, with their gradients, which the pass rewrites as
passes of rings over the gathered blocks (analysis/column_passes.py).

A :class:`ColumnsSpec` draws the ring size, rows per device, embedding size, element type, the
loss (``jax.nn.logsumexp``, the log-sum-exp written out with its max, ``jax.nn.log_softmax``'s
cross-entropy, the same plus an entropy term), a temperature constant or an argument, one
direction or both (CLIP's: the queries gathered too), the gradient inside the shard_map (the
gather's transpose a psum_scatter) or outside it with the loss under ``jax.checkpoint``, and the
near misses: the logits returned (``cols_region``), the positive read through a reverse along
the keys (``cols_region``) and a running sum along them before the statistics (no region: they
are past an op that mixes the columns).
:func:`check` rewrites each program under every variant of the default campaign; under ``uni``
the oracle (:meth:`ColumnsSpec.expected`) asks for one region of passes per direction where the
spec is legal, none otherwise (with ``cols_region`` on a gather where it names one; under remat
the positive's reverse is the forward's, and the backward's region legal); every
result is run against the original on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

from tools.fuzz_oracle import VARIANTS, Tally, check_variants
from tools.samples_common import arg, gather, lower, mesh_1d, smap

AXIS = "batch"
LOSSES = ("lse", "manual", "xent", "entropy")


@dataclass(frozen=True)
class ColumnsSpec:
    ring: int
    rows: int  # per device
    dim: int
    dtype: str  # "f32" | "bf16"
    loss: str  # LOSSES
    learned: bool  # the temperature an argument (exp of it) rather than a constant
    symmetric: bool  # both directions (the queries gathered too)
    inside: bool  # the gradient inside the shard_map (else: outside, the loss under jax.checkpoint)
    near_miss: str  # "" | "returns_logits" | "flip" | "cumsum"

    kind = "columns"

    def expected(self, result) -> list[str]:
        """What the oracle finds wrong with ``result`` (policy all, uni)."""
        sites = [s for s in result.report.sites if s.kind == "column_passes" and s.rewritten]
        notes = " ".join(n for s in result.report.sites for n in s.notes)
        # (a reverse in the forward's positive under remat: the backward's region reverses a row value only)
        declined = self.near_miss and not (self.near_miss == "flip" and not self.inside)
        wanted = 0 if declined else 1 + self.symmetric
        if len(sites) != wanted:
            return [f"{len(sites)} regions of passes, {wanted} expected: "
                    f"{[s.summary_line() for s in result.report.sites]}"]
        if declined and self.near_miss != "cumsum" and "[cols_region]" not in notes:
            return [f"no cols_region for {self.near_miss}: {notes}"]
        if any(s.attention["passes"] > 3 for s in sites):
            return [f"more than three passes: {[s.summary_line() for s in sites]}"]
        return []

    def lower(self) -> str:
        mesh = mesh_1d(self.ring, AXIS)
        rows, dtype = P(AXIS), {"f32": jnp.float32, "bf16": jnp.bfloat16}[self.dtype]

        def direction(x, y, t):  # x's rows against every device's y
            yg = gather(y, AXIS, 0)
            logits = (x @ yg.T).astype(jnp.float32) * (jnp.exp(t) if self.learned else np.float32(1 / 0.07))
            if self.near_miss == "cumsum":
                logits = jnp.cumsum(logits, axis=1)
            labels = jax.lax.axis_index(AXIS) * x.shape[0] + jnp.arange(x.shape[0])
            onehot = labels[:, None] == jnp.arange(yg.shape[0])[None, :]
            # (flip: the positive read through a reverse along the keys, the statistics not)
            turn = (lambda a: jnp.flip(a, axis=1)) if self.near_miss == "flip" else (lambda a: a)
            positive = jnp.sum(jnp.where(turn(onehot), turn(logits), 0.0), axis=1)
            if self.loss == "lse":
                row = jax.nn.logsumexp(logits, axis=1) - positive
            elif self.loss == "manual":
                top = jax.lax.stop_gradient(jnp.max(logits, axis=1, keepdims=True))
                row = jnp.log(jnp.sum(jnp.exp(logits - top), axis=1)) + top[:, 0] - positive
            else:
                logp = jax.nn.log_softmax(logits, axis=1)
                row = -jnp.sum(jnp.where(turn(onehot), turn(logp), 0.0), axis=1)
                if self.loss == "entropy":
                    row = row + 0.1 * jnp.sum(jnp.exp(logp) * logp, axis=1)
            return jnp.mean(row), logits

        def loss_of(q, k, t):
            value, logits = direction(q, k, t)
            if self.symmetric:
                value = (value + direction(k, q, t)[0]) / 2
            return value, logits

        args = [arg(mesh, (self.ring * self.rows, self.dim), rows, dtype)] * 2 + [arg(mesh, (), P())]
        if self.inside:
            def local(q, k, t):
                (value, logits), (dq, dk) = jax.value_and_grad(loss_of, argnums=(0, 1), has_aux=True)(q, k, t)
                out = (value[None], dq, dk)
                return out + (logits,) if self.near_miss == "returns_logits" else out

            outs = 4 if self.near_miss == "returns_logits" else 3
            return lower(smap(local, mesh=mesh, in_specs=(rows, rows, P()), out_specs=(rows,) * outs), *args)
        f = smap(jax.checkpoint(lambda q, k, t: loss_of(q, k, t)[0][None]), mesh=mesh,
                 in_specs=(rows, rows, P()), out_specs=rows)
        return lower(jax.value_and_grad(lambda q, k, t: jnp.sum(f(q, k, t)), argnums=(0, 1)), *args)


@st.composite
def columns_specs(draw) -> ColumnsSpec:
    inside = draw(st.booleans())
    near_miss = draw(st.sampled_from(["", "", "", "", "flip", "cumsum"] + (["returns_logits"] if inside else [])))
    return ColumnsSpec(ring=draw(st.sampled_from([2, 4, 8])), rows=draw(st.sampled_from([4, 8])),
                       dim=draw(st.sampled_from([4, 8])), dtype=draw(st.sampled_from(["f32", "bf16"])),
                       loss=draw(st.sampled_from(LOSSES)), learned=draw(st.booleans()),
                       symmetric=not near_miss and draw(st.booleans()), inside=inside, near_miss=near_miss)


def check(spec: ColumnsSpec, tally: Tally | None = None, variants=VARIANTS) -> Tally:
    """Rewrite ``spec``'s program under every variant; record and assert the oracle's verdicts."""
    return check_variants(spec, spec.lower(), jax.devices("cpu")[: spec.ring], tally or Tally(), variants,
                          lambda name, result: spec.expected(result) if name == "uni" else [])
