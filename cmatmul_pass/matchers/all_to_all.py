"""``all_to_all`` → ops → ``all_to_all``: an expert-parallel MoE block's dispatch, its experts
and its combine (capacity-padded), or Ulysses attention's heads ↔ sequence exchange and back.

Each collective waits for its whole transfer before the ops after it start.  Cut into ``k``
chunks along a dim ``d`` of the dispatch's operand ``x`` that the ops between keep apart, each
chunk's exchange can run while the previous chunk's ops compute (the rewrite,
:mod:`cmatmul_pass.rewrites.all_to_all`).  The identity, for chunks ``J_0 .. J_{k-1}`` of ``d``
and ``R`` the ops between the two collectives::

    a2a₂(R(a2a₁(x))) = concatenate_j a2a₂(R(a2a₁(x[J_j along d])))   along d'

where ``d'`` is the dim ``R`` carries ``d`` to, and either

* (**free**) ``d`` is neither the dispatch's split nor its concat dim, and ``d'`` neither the
  combine's: each exchange acts alike on every index of the dim; or
* (**exchanged**) ``d`` is the dispatch's concat dim (the capacity of a MoE dispatch: each
  device's rows for the local experts, device-major) and ``d'`` the combine's split dim: the
  dispatch of chunk ``j`` brings every device's chunk-``j`` rows, in device order, and the
  combine sends each device back exactly those, so its result is chunk ``j`` of the original's
  along ``d'``; or
* (**split**) ``d`` is the dispatch's split dim (Ulysses' heads, ``n`` blocks of ``m``, one per
  destination) and ``d'`` the combine's concat dim: chunk ``j`` is the ``j``-th ``m/k`` of every
  destination's block (a strided slice of ``x``), which brings each device the ``j``-th ``m/k``
  of its own block (a contiguous chunk between the exchanges), and the combine returns every
  device's ``j``-th ``m/k`` of its block, device-major: the chunks' results interleave into the
  original's along ``d'``.

Side conditions, each checked here (a site failing one is declined, saying which):

1. the two collectives are over the same device groups, in one block, the combine reached from
   the dispatch's result only through ``R`` (``a2a_unpaired`` otherwise);
2. ``R`` (every op reading, directly or not, the dispatch's result before the combine) is
   separable along the dim, or additive over it where nothing reads the sum before the pair's
   end (a weight's gradient: each chunk's product a partial sum, added up after the last):
   :mod:`..analysis.separable` proves it op by op (``a2a_region`` naming the op otherwise);
3. a value of the pair read outside it (a residual a training step saves for its backward) is
   read after the combine: the rewrite reassembles it there from the chunks, in the original's
   order (``a2a_region`` where a reader stands before the combine);
4. an operand of an ``R`` op not computed from the dispatch (a weight, a mask, a residual the
   forward saved) that spans the tracked dim is read per chunk at the chunk's rows (the
   analysis' ``SLICE``): a slice (free), or along the exchanged dim each device's rows of the
   chunk, device-major, as the dispatch lays them out; a broadcast not along the dim is rebuilt
   at the chunk's size;
5. ``d``'s size divides into the chunks (``a2a_no_dim`` where no dim does).

Nothing moves into control flow: the ``k`` pairs stand where the pair stood, every device runs
them in the same order, so no device-variance condition arises.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import ir_utils
from .._jax_private import ir
from ..errors import Decline
from ..analysis.separable import SLICE, NotSeparable, Step, track
from ..ring import Ring
from .common import DeclinedSite, ManualRegion, ModuleInfo, collective_ring

ALL_TO_ALL = "all_to_all_chunk"
FREE, EXCHANGED, SPLIT = "free", "exchanged", "split"
A2A = "stablehlo.all_to_all"
@dataclass(frozen=True, eq=False)
class AllToAllSite:
    dispatch: ir.OpView
    combine: ir.OpView
    steps: tuple[Step, ...]
    #: the tracked dim: of the dispatch's operand (and result), of the combine's operand (and result)
    dim: int
    out_dim: int
    mode: str  # FREE, EXCHANGED (d the dispatch's concat dim) or SPLIT (d its split dim): module docstring
    ring: Ring
    region: ManualRegion
    #: values of the pair read after it (a training step's residuals): reassembled whole from the chunks
    escapes: tuple[ir.Value, ...] = ()

    kind = ALL_TO_ALL

    @property
    def anchor(self) -> ir.OpView:
        return self.dispatch

    @property
    def exchanged(self) -> bool:
        return self.mode == EXCHANGED

    def chunk_counts(self, counts) -> list[int]:
        """Those of ``counts`` the tracked dim divides into (split: each destination's block of
        it), every sliced operand's too (exchanged: each device's rows of it)."""
        size = ir.RankedTensorType(self.dispatch.operation.operands[0].type).shape[self.dim]
        n = self.ring.size
        per = n if self.mode == EXCHANGED else 1
        return [k for k in counts if k > 1 and size % (k * (n if self.mode == SPLIT else 1)) == 0 and all(
            ir.RankedTensorType(s.op.operation.operands[i].type).shape[plan[1]] % (k * per) == 0
            for s in self.steps for i, plan in enumerate(s.sides) if plan and plan[0] == SLICE)]


def _attr(op: ir.OpView, name: str) -> int:
    return ir.IntegerAttr(op.operation.attributes[name]).value


def match_all_to_all(op: ir.OpView, info: ModuleInfo, counts=(2, 4, 8)) -> AllToAllSite | DeclinedSite:
    """``op`` as the dispatch of a pair (module docstring), or why not."""
    ring = None
    try:
        ring, region = collective_ring(op, info)
        return _match(op, ring, region, counts)
    except Decline as d:
        return DeclinedSite(ALL_TO_ALL, op, d.code, d.message, ring)


def combine_of(op: ir.OpView) -> ir.OpView | None:
    """The all_to_all the ops after ``op`` reach first in its block (the pair's combine), if any."""
    try:
        return _region(op)[1]
    except Decline:
        return None


def _region(dispatch: ir.OpView) -> tuple[list[ir.OpView], ir.OpView]:
    """The ops between the exchanges, in block order: those reading the dispatch's result
    (directly or not) up to the all_to_all they reach (their values may leave the pair too:
    a training step's residuals), and that all_to_all."""
    block = dispatch.operation.block
    reached: dict[ir.Operation, ir.OpView] = {}
    combines: dict[ir.Operation, ir.OpView] = {}
    frontier = [dispatch.operation.results[0]]
    while frontier:
        value = frontier.pop()
        for use in value.uses:
            user = use.owner
            user = user.opview if isinstance(user, ir.Operation) else user
            if user.operation.block != block:
                raise Decline("a2a_region", f"{user.operation.name} in a nested region reads a value between the "
                                            "exchanges: the chunks would have to make it whole")
            if user.operation.name == A2A:
                combines[user.operation] = user
                continue
            if user.operation not in reached:
                reached[user.operation] = user
                frontier.extend(user.operation.results)
    if not combines:
        raise Decline("a2a_unpaired", "no all_to_all after it reads the ops it feeds (a lone exchange has no partner "
                                      "to overlap its chunks with)")
    # the first all_to_all reached is the combine; what stands after it only reads the pair's values
    combine = next(o for o in block.operations if o.operation in combines)
    combine = combine.opview if isinstance(combine, ir.Operation) else combine
    ops = [o.opview if isinstance(o, ir.Operation) else o for o in block.operations
           if o.operation in reached and o.operation.is_before_in_block(combine.operation)]
    return ops, combine


def _escapes(dispatch: ir.OpView, ops: list[ir.OpView], combine: ir.OpView) -> tuple[ir.Value, ...]:
    """The values of the pair (the dispatch's result, the ops' results) read by other ops, which
    the rewrite reassembles whole from the chunks (residuals a training step saves); Decline
    where such a reader stands before the combine (the chunks are computed where it stands)."""
    inside = {o.operation for o in ops} | {combine.operation}
    escaping = []
    for value in [dispatch.operation.results[0]] + [r for o in ops for r in o.operation.results]:
        readers = [u.owner.operation if isinstance(u.owner, ir.OpView) else u.owner for u in value.uses]
        outside = [r for r in readers if r not in inside]
        for reader in outside:
            if reader.block != combine.operation.block or reader.is_before_in_block(combine.operation):
                raise Decline("a2a_region", f"a value between the exchanges is also read by {reader.name} before "
                                            "the exchange back: the chunks would have to make it whole there")
        if outside:
            escaping.append(value)
    return tuple(escaping)


def _chunk_of_several(combine: ir.OpView) -> bool:
    """Is ``combine``'s result (through a reshape) concatenated with another all_to_all's (a pair
    already chunked: this pass's output, or chunks written by hand)?"""
    def through_reshape(value: ir.Value) -> list[ir.Value]:
        users = ir_utils.users(value)
        return [value] + [u.operation.results[0] for u in users if u.operation.name == "stablehlo.reshape"]

    def from_exchange(value: ir.Value) -> bool:
        owner = value.owner
        owner = owner.operation if isinstance(owner, ir.OpView) else owner
        if isinstance(owner, ir.Operation) and owner.name == "stablehlo.reshape":
            owner = owner.operands[0].owner
            owner = owner.operation if isinstance(owner, ir.OpView) else owner
        return isinstance(owner, ir.Operation) and owner.name == A2A and owner != combine.operation

    for value in through_reshape(combine.operation.results[0]):
        for user in ir_utils.users(value):
            if user.operation.name == "stablehlo.concatenate" and any(
                    from_exchange(v) for v in user.operation.operands if v != value):
                return True
    return False


def _match(dispatch: ir.OpView, ring: Ring, region: ManualRegion, counts) -> AllToAllSite:
    ops, combine = _region(dispatch)
    if _chunk_of_several(combine):
        raise Decline("chunked", "the pair is one of several chunks whose results are concatenated (a chunked pair's "
                                 "output, or chunks written by hand), each already beside a neighbouring chunk's ops")
    if combine.operation.attributes["replica_groups"] != dispatch.operation.attributes["replica_groups"]:
        raise Decline("a2a_unpaired", "the all_to_all after it exchanges over other device groups")
    escapes = _escapes(dispatch, ops, combine)
    x = ir.RankedTensorType(dispatch.operation.operands[0].type)
    split, concat = _attr(dispatch, "split_dimension"), _attr(dispatch, "concat_dimension")
    c_split, c_concat = _attr(combine, "split_dimension"), _attr(combine, "concat_dimension")
    reasons = []
    # the capacity first, then free dims (largest first), then the split dim (strided chunks)
    for dim in sorted(range(x.rank), key=lambda d: (0 if d == concat else 2 if d == split else 1, -x.shape[d])):
        if not any(x.shape[dim] % (k * (ring.size if dim == split else 1)) == 0 for k in counts if k > 1):
            continue
        try:
            steps, dims = track(dispatch.operation.results[0], dim, ops)
        except NotSeparable as e:
            reasons.append((dim, Decline("dynamic_shape", str(e)) if e.dynamic else Decline("a2a_region", str(e))))
            continue
        out_dim = dims.get(combine.operation.operands[0])
        if out_dim is None:
            reasons.append((dim, Decline("a2a_region", "the all_to_all after it reads a sum over the chunked dim")))
            continue
        mode = EXCHANGED if dim == concat else SPLIT if dim == split else FREE
        wanted = {EXCHANGED: (c_split, "split"), SPLIT: (c_concat, "concat")}.get(mode)
        if wanted is not None and out_dim != wanted[0]:
            reasons.append((dim, Decline("a2a_no_dim", f"dim {dim}, the exchange's {'concat' if mode == EXCHANGED else 'split'} "
                                                       f"dim, reaches the all_to_all after as its dim {out_dim}, not its "
                                                       f"{wanted[1]} dim {wanted[0]}")))
            continue
        if mode == FREE and out_dim in (c_split, c_concat):
            reasons.append((dim, Decline("a2a_no_dim", f"dim {dim} reaches the all_to_all after as its "
                                                       f"{'split' if out_dim == c_split else 'concat'} dim")))
            continue
        site = AllToAllSite(dispatch, combine, tuple(steps), dim, out_dim, mode, ring, region, escapes)
        if site.chunk_counts(counts):
            return site
        reasons.append((dim, Decline("a2a_no_dim", f"dim {dim} does not divide into {', '.join(map(str, counts))} "
                                                   "chunks with every operand sliced along it")))
    if not reasons:
        raise Decline("a2a_no_dim", f"no dim of the exchanged {list(x.shape)} divides into chunks")
    code = next((d.code for _, d in reasons if d.code == "a2a_region"), reasons[0][1].code)
    raise Decline(code, "; ".join(f"along dim {dim}: {d.message}" for dim, d in reasons))


