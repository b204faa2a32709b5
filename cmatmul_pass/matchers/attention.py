"""Attention over gathered keys and values: ``all_gather(K)``, ``all_gather(V)`` along the
sequence → scores → softmax over the gathered dim → ``P·V``, as one ring with an online softmax
(the rewrite: :mod:`cmatmul_pass.rewrites.ring_attention`).

The program, for scores ``s = f(Q·Kᵀ)`` (``f`` pointwise: a scale, a bias, a mask), reads::

    M = g(max_c(s))            // max over the gathered dim, from the reduce's init c; g: maximum(·, c')
    e = exp(s - M)
    L = Σ e
    O = (h(e / L)) · V         // h: elementwise linear (a convert; a dropout's mask and 1/keep)

With the gathered dim cut into the ring's ``n`` blocks ``s_k`` (block ``k`` of the keys: the
``k``-th device's shard, in group order), the identity the ring rests on is the online softmax:
for any running references ``r_t`` with ``r_n = M``,

    o_t = o_{t-1}·exp(r_{t-1} - r_t) + h(exp(s_t - r_t)) · V_t,    l_t = l_{t-1}·exp(r_{t-1} - r_t) + Σ exp(s_t - r_t)

gives ``o_n = Σ_k h(exp(s_k - M)) · V_k`` and ``l_n = L``, so ``O = o_n / l_n`` (``h`` linear:
``h(e / L) = h(e) / L``).  The ring takes ``r_t = g(m_t)``, ``m_t = max(m_{t-1}, max_c(s_t))``,
``m_0 = c`` (the reduce's init): then ``r_n = g(max_c(s)) = M`` exactly, every ``r_t`` bounds
the scores seen so far (no overflow), and where ``r_t`` is still ``-inf`` (every key so far
masked for the row) the block's exponent is taken against 0 (its terms are 0, as are the
running sums, which the next rescale ``exp(-inf - r) = 0`` keeps).  A row masked everywhere
gives ``0/0`` as the original's ``exp(-inf + inf)`` gives NaN.

Side conditions, each checked here (an attention failing one keeps its two rings, the pass
saying why on the keys' gather):

1. ``K`` and ``V`` are gathered (tiled) by two all_gathers over the same groups, each reaching
   its matmul only through ops separable along the gathered dim (:mod:`..analysis.separable`:
   the head repeat of grouped-query attention, converts, transposes); nothing else reads those
   values (``attn_region``);
2. the gathered dim is a free dim of the scores matmul, ``f`` is separable along it (a side
   operand spanning it, a mask or a bias, is read at the block's columns), and ``s`` is read only
   by the max and the subtraction (``attn_softmax`` otherwise);
3. the softmax is exactly the form above: a max reduce over the gathered dim alone with a
   constant init, ``g`` a chain of ``maximum`` with constants, the max and sum broadcast back
   along the gathered dim only, ``exp`` of the difference, an add reduce from 0, a divide
   (``attn_softmax``);
4. the probabilities reach ``P·V`` through an elementwise linear chain (converts, multiplies and
   divides by side operands read at the block's columns, a select between them and zero: a
   dropout, whose mask, device-varying or not, is computed as in the original and read a block
   at a time), and ``P·V`` contracts exactly the gathered dim against ``V``'s;
5. no value between the gathers and ``P·V``'s result is read elsewhere (a training step's
   residuals: ``attn_residual``; its backward needs the whole probability matrix).

Nothing moves into control flow: the ring stands where ``P·V`` stood and runs ``n`` rounds on
every device of the group.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import ir_utils
from .._jax_private import ir
from ..analysis.separable import NotSeparable, Step, track
from ..errors import Decline
from ..ring import Ring
from .common import DeclinedSite, DotDims, ManualRegion, ModuleInfo, collective_ring, describe_op

RING_ATTENTION = "ring_attention"
AG = "stablehlo.all_gather"
DOT = "stablehlo.dot_general"
NEG_INF = float("-inf")


@dataclass(frozen=True, eq=False)
class AttentionSite:
    keys: ir.OpView  # the all_gather of K
    values: ir.OpView  # the all_gather of V
    dim: int  # the gathered dim (of both gathers)
    ring: Ring
    region: ManualRegion
    key_steps: tuple[Step, ...]  # gathered K → the scores matmul's operand
    value_steps: tuple[Step, ...]  # gathered V → P·V's operand
    scores: ir.OpView  # the scores matmul
    score_dim: int  # the gathered dim in its result
    score_steps: tuple[Step, ...]  # f: the scores → s
    #: transposes of s before the subtraction (jax.nn.dot_product_attention's layout), the
    #: exponentials, sum and probabilities in their layout
    layout: tuple[ir.OpView, ...]
    softmax_dim: int  # the gathered dim in s after them
    #: the transpose taking a statistic of the max's layout to the sum's (None: the same)
    stat_permutation: tuple[int, ...] | None
    row_max: ir.OpView  # reduce max
    max_init: float
    max_steps: tuple[ir.OpView, ...]  # g (maximum with constants)
    max_broadcast: tuple[ir.OpView, ...]  # g(M) → s's shape
    subtract: ir.OpView
    exp: ir.OpView
    row_sum: ir.OpView
    sum_broadcast: tuple[ir.OpView, ...]
    divide: ir.OpView
    prob_steps: tuple[Step, ...]  # h: P → P·V's operand
    pv: ir.OpView  # P·V
    pv_operand: int  # which operand of P·V the probabilities are
    #: every op the ring replaces (the gathers' and P·V's aside), producers first
    ops: tuple[ir.OpView, ...]
    block: int  # keys per block (a shard's length)

    kind = RING_ATTENTION

    @property
    def anchor(self) -> ir.OpView:
        return self.keys



def _opview(op) -> ir.OpView:
    return op.opview if isinstance(op, ir.Operation) else op


#: what a value is to the linearity check: linear in the probabilities, zero everywhere, or free of them
LIN, ZERO, FREE = "linear", "zero", "free"


def _linear(step: Step) -> bool:
    """Is ``step`` (a separable op on the probabilities' path) elementwise linear in them,
    ``h(x)_i = a_i · x_i`` with ``a`` free of them, so that ``h(α·x) = α·h(x)`` for the online
    softmax's per-row rescales ``α``? A convert, a multiply or divide by another value (a
    dropout's mask and ``1/keep``), a select between them and zero (``jnp.where(keep, p, 0)``),
    and a call of a pointwise function built of those (jnp.where's ``@_where``)."""
    op = step.op.operation
    classes = [LIN if plan is None else ZERO if ir_utils.is_zero_splat(v) else FREE
               for v, plan in zip(op.operands, step.sides)]
    if not step.body:
        return linear_class(op.name, classes) == LIN
    block = step.body[0].operation.block
    of = dict(zip(block.arguments, classes))
    for inner in step.body:
        if inner.operation.name == "stablehlo.constant":
            of[inner.result] = ZERO if ir_utils.is_zero_splat(inner.result) else FREE
            continue
        of[inner.operation.results[0]] = linear_class(inner.operation.name,
                                                       [of.get(v, FREE) for v in inner.operation.operands])
    returned = list(block.operations)[-1].operation.operands
    return [of.get(v, FREE) for v in returned] == [LIN]


def linear_class(name: str, operands: list[str]) -> str | None:
    """The class of a pointwise op's result from its operands' (None: not linear in the probabilities)."""
    if LIN not in operands:
        return ZERO if operands and all(c == ZERO for c in operands) and name in (
            "stablehlo.broadcast_in_dim", "stablehlo.convert") else FREE
    if None in operands:
        return None
    if name in ("stablehlo.convert", "stablehlo.negate"):  # (not a broadcast: the rows' rescale is per element)
        return LIN
    if name == "stablehlo.multiply":
        return LIN if operands.count(LIN) == 1 else None
    if name == "stablehlo.divide":
        return LIN if operands == [LIN, FREE] else None  # (by zero: infinities the rescale would turn to NaN)
    if name == "stablehlo.select":  # (predicate, on true, on false)
        return LIN if operands[0] != LIN and set(operands[1:]) <= {LIN, ZERO} else None
    if name in ("stablehlo.add", "stablehlo.subtract"):
        return LIN if set(operands) <= {LIN, ZERO} else None
    return None


def _readers(value: ir.Value) -> list[ir.OpView]:
    return [_opview(u.owner) for u in value.uses]


def _only_reader(value: ir.Value, what: str) -> ir.OpView:
    readers = _readers(value)
    if len(readers) != 1:
        raise Decline("attn_softmax", f"{len(readers)} ops read {what}, not one")
    return readers[0]


def _constant(value: ir.Value) -> float | None:
    """The float a splat constant (or a broadcast of one) holds, else None."""
    splat = ir_utils.splat_attribute(value)
    try:
        return float(ir.FloatAttr(splat).value) if splat is not None else None
    except (TypeError, ValueError):
        return None


def _reduce(op: ir.OpView, body_op: str, dim: int) -> float:
    """The init of ``op``, a single-operand reduce over ``dim`` alone applying ``body_op``; Decline otherwise."""
    if op.operation.name != "stablehlo.reduce" or len(op.operation.operands) != 2 or \
            ir_utils.i64s(op, "dimensions") != [dim]:
        raise Decline("attn_softmax", f"{describe_op(op)} is not a reduce over the gathered dim alone")
    inner = [o.operation.name for o in op.operation.regions[0].blocks[0].operations]
    if inner[:-1] != [body_op]:
        raise Decline("attn_softmax", f"{describe_op(op)} reduces with {inner[:-1]}, not {body_op}")
    init = _constant(op.operation.operands[1])
    if init is None:
        raise Decline("attn_softmax", f"{describe_op(op)} starts from a value that is not a constant")
    return init


def _broadcast_back(value: ir.Value, shape: list[int], dim: int,
                    order: list[int] | None = None) -> tuple[list[ir.OpView], ir.OpView]:
    """The broadcasts and transposes taking a row statistic ``value`` back to ``shape`` along
    ``dim`` alone (its dims landing at ``order``: by default those of ``shape`` but ``dim``, in
    order), and the one op reading the result; Decline otherwise."""
    chain, rank = [], ir.RankedTensorType(value.type).rank
    # which dim of the current value each of the statistic's dims is
    where = list(range(rank))
    current = value
    while ir.RankedTensorType(current.type).shape != shape:
        op = _only_reader(current, "a row statistic")
        name = op.operation.name
        if name == "stablehlo.broadcast_in_dim":
            mapping = ir_utils.i64s(op, "broadcast_dimensions")
            where = [mapping[w] for w in where]
        elif name == "stablehlo.transpose":
            permutation = ir_utils.i64s(op, "permutation")
            where = [permutation.index(w) for w in where]
        else:
            raise Decline("attn_softmax", f"{describe_op(op)} stands between a row statistic and its use")
        chain.append(op)
        current = op.operation.results[0]
    if where != (order if order is not None else [d for d in range(len(shape)) if d != dim]):
        raise Decline("attn_softmax", "a row statistic is broadcast back along other dims than the gathered one")
    return chain, _only_reader(current, "a broadcast row statistic")


def _layout(first: ir.OpView, rank: int, end: ir.OpView) -> tuple[list[ir.OpView], list[int]]:
    """The transposes from ``first`` (the scores' reader besides the max) to ``end`` (each the one
    reader of the value before it) and where each dim of the scores stands after them; Decline
    where another op stands between."""
    chain, where, op = [], list(range(rank)), first
    while op.operation != end.operation:
        if op.operation.name != "stablehlo.transpose":
            raise Decline("attn_softmax", f"{describe_op(op)} stands between the scores and their subtraction")
        permutation = ir_utils.i64s(op, "permutation")
        where = [permutation.index(w) for w in where]
        chain.append(op)
        op = _only_reader(op.result, "the scores on their way to the subtraction")
    return chain, where


def _path(gather: ir.OpView, dim: int, end: ir.OpView) -> list[Step]:
    """The steps from ``gather``'s result to ``end`` (a matmul), every value on the way read only
    on it; Decline naming the first other reader otherwise."""
    block, start = gather.operation.block, gather.operation.results[0]
    on_path, frontier = set(), [v for v in end.operation.operands[:2]]  # the ops between them
    while frontier:
        value = frontier.pop()
        owner = ir_utils.producer(value)
        if value == start or owner is None:
            continue
        owner = owner.operation
        if owner.block == block and owner not in on_path and owner.name not in (DOT, AG):
            on_path.add(owner)
            frontier.extend(owner.operands)
    ops = [o for o in map(_opview, block.operations) if o.operation in on_path and _reads_from(o, start, on_path)]
    on_path = {o.operation for o in ops}  # (not the other operand's: the queries')
    for value in [start] + [r for o in ops for r in o.operation.results]:
        for reader in _readers(value):
            if reader.operation == end.operation or reader.operation in on_path:
                continue
            if not len(reader.operation.results):
                raise Decline("attn_residual", f"{describe_op(reader)} returns a value of the attention's K or V "
                                               "path (a training step's residual for its backward)")
            if reader.operation.name == DOT:
                raise Decline("attn_residual", f"{describe_op(reader)} also reads the gathered value (a training "
                                               "step's backward reads K and V again)")
            raise Decline("attn_region", f"{describe_op(reader)} reads the gathered value besides the attention's "
                                         "matmul")
    try:
        steps, _ = track(start, dim, ops)
    except NotSeparable as e:
        raise Decline("attn_region", str(e))
    return steps


def _reads_from(op: ir.OpView, start: ir.Value, on_path: set) -> bool:
    """Does ``op`` read ``start``, directly or through ops of ``on_path``?"""
    frontier = list(op.operation.operands)
    while frontier:
        value = frontier.pop()
        if value == start:
            return True
        owner = ir_utils.producer(value)
        if owner is not None and owner.operation in on_path:
            frontier.extend(owner.operation.operands)
    return False


def _tracked_chain(start: ir.Value, dim: int, stop) -> tuple[list[Step], ir.Value, int]:
    """The single-reader pointwise (separable) ops from ``start`` until a value read by an op
    ``stop`` accepts (or by several ops); their steps, that value and its tracked dim."""
    steps, value, d = [], start, dim
    while True:
        readers = _readers(value)
        if len(readers) != 1 or stop(readers[0]):
            return steps, value, d
        op = readers[0]
        if op.operation.name == DOT or op.operation.block != ir_utils.producer(start).operation.block:
            return steps, value, d
        try:
            found, dims = track(value, d, [op])
        except NotSeparable as e:
            raise Decline("attn_softmax", str(e))
        steps += found
        if found[0].sums or len(op.operation.results) != 1:
            raise Decline("attn_softmax", f"{describe_op(op)} sums over the gathered dim")
        value, d = op.operation.results[0], found[0].out_dim


def match_attention(op: ir.OpView, info: ModuleInfo) -> AttentionSite | DeclinedSite | None:
    """``op`` (an all_gather) as the keys' gather of an attention (module docstring); None where
    its value does not reach a softmax over the gathered dim (not an attention: its own site)."""
    ring = None
    try:
        ring, region = collective_ring(op, info)
        scores = _scores(op)
        if scores is None:
            return None
        return _match(op, ring, region, *scores)
    except Decline as d:
        return DeclinedSite(RING_ATTENTION, op, d.code, d.message, ring)


def _scores(keys: ir.OpView) -> tuple[ir.OpView, int, int] | None:
    """(the scores matmul, the gathered dim of its result, of its keys operand) when ``keys``'
    value reaches one matmul as a free dim and its result a max over that dim; else None."""
    dim = ir_utils.int_attr(keys, "all_gather_dim")
    if dim is None or ir_utils.ranked_tensor(keys.operation.results[0]) is None:
        return None
    block, frontier, seen, dots = keys.operation.block, [keys.operation.results[0]], set(), []
    while frontier and len(seen) < 64:
        for reader in _readers(frontier.pop()):
            if reader.operation.block != block or reader.operation in seen:
                continue
            seen.add(reader.operation)
            if reader.operation.name == DOT:
                dots.append(reader)
            elif reader.operation.name != AG:
                frontier.extend(reader.operation.results)
    found = [hit for dot in dots if not ir_utils.is_grouped_dot(dot) and (hit := _scores_of(keys, dim, dot, seen))]
    return found[0] if len(found) == 1 else None


def _scores_of(keys: ir.OpView, dim: int, dot: ir.OpView, seen: set) -> tuple[ir.OpView, int, int] | None:
    """(``dot``, the gathered dim of its result, its keys operand) when ``dot`` reads the keys
    along a free dim and its result reaches a max over that dim; else None."""
    block = keys.operation.block
    feeding, frontier = set(), list(dot.operation.operands[:2])  # the ops of ``seen`` the dot reads
    while frontier:
        owner = ir_utils.producer(frontier.pop())
        if owner is not None and owner.operation in seen and owner.operation not in feeding:
            feeding.add(owner.operation)
            frontier.extend(owner.operation.operands)
    ops = [o for o in map(_opview, block.operations) if o.operation in feeding]
    try:
        _, dims = track(keys.operation.results[0], dim, ops)
    except NotSeparable:
        return None
    for side in (0, 1):
        d = dims.get(dot.operation.operands[side])
        if d is None or dims.get(dot.operation.operands[1 - side]) is not None:
            continue
        numbers = DotDims.of(dot)
        if d not in numbers.free(side):
            return None
        out = numbers.free_result_offset(side) + numbers.free(side).index(d)
        return (dot, out, side) if _reaches_row_max(dot.result, out) else None
    return None


def _reaches_row_max(scores: ir.Value, dim: int) -> bool:
    """Do ``scores`` reach a max over ``dim`` through a few ops of their shape (a scale, a mask):
    an attention's softmax, which :func:`_match` then proves or declines."""
    try:  # through the ops the rows go through apart (a scale, a mask, a transposing jnp.where)
        _, value, at = _tracked_chain(scores, dim, lambda r: r.operation.name == "stablehlo.reduce")
        if any(r.operation.name == "stablehlo.reduce" and ir_utils.i64s(r, "dimensions") == [at]
               and _reduce_kind(r) == "stablehlo.maximum" for r in _readers(value)):
            return True
    except Decline:
        pass
    shape = ir.RankedTensorType(scores.type).shape
    frontier, seen = [scores], 0
    while frontier and seen < 16:
        value = frontier.pop()
        for reader in _readers(value):
            seen += 1
            if reader.operation.name == "stablehlo.reduce":
                if ir_utils.i64s(reader, "dimensions") == [dim] and _reduce_kind(reader) == "stablehlo.maximum":
                    return True
                continue
            frontier.extend(r for r in reader.operation.results
                            if (t := ir_utils.ranked_tensor(r)) is not None and t.shape == shape)
    return False


def _reduce_kind(op: ir.OpView) -> str | None:
    inner = [o.operation.name for o in op.operation.regions[0].blocks[0].operations]
    return inner[0] if len(inner) == 2 else None


def _match(keys: ir.OpView, ring: Ring, region: ManualRegion, scores: ir.OpView, score_dim: int,
           key_side: int) -> AttentionSite:
    dim = ir_utils.int_attr(keys, "all_gather_dim")
    key_steps = _path(keys, dim, scores)
    score_steps, s, sd = _tracked_chain(scores.result, score_dim, lambda r: False)
    readers = _readers(s)
    row_max = next((r for r in readers if r.operation.name == "stablehlo.reduce"), None)
    others = [r for r in readers if r.operation != (row_max.operation if row_max else None)]
    if len(readers) != 2 or row_max is None:
        raise Decline("attn_softmax", "the scores are read by other ops than the softmax's max and subtraction")
    subtract = others[0]
    while subtract.operation.name == "stablehlo.transpose":  # (jax.nn.dot_product_attention's softmax)
        subtract = _only_reader(subtract.result, "the transposed scores")
    if subtract.operation.name != "stablehlo.subtract":
        raise Decline("attn_softmax", f"{describe_op(subtract)} reads the scores, not the softmax's subtraction")
    shape = ir.RankedTensorType(s.type).shape
    transposes, where = _layout(others[0], len(shape), subtract)
    shifted = transposes[-1].result if transposes else s
    if subtract.operation.operands[0] != shifted:
        raise Decline("attn_softmax", "the row max is subtracted from the scores, not the scores from it")
    shape2, sd2 = ir.RankedTensorType(shifted.type).shape, where[sd]
    max_init = _reduce(row_max, "stablehlo.maximum", sd)
    # g: maximum with constants (jax.nn.softmax's initial -inf)
    max_steps, stat = [], row_max.result
    while True:
        reader = _only_reader(stat, "the row max")
        if reader.operation.name != "stablehlo.maximum":
            break
        other = [v for v in reader.operation.operands if v != stat]
        if len(other) != 1 or _constant(other[0]) is None:
            raise Decline("attn_softmax", f"{describe_op(reader)} takes the row max's maximum with a non-constant")
        max_steps.append(reader)
        stat = reader.result
    max_broadcast, user = _broadcast_back(stat, shape2, sd2, [where[d] for d in range(len(shape)) if d != sd])
    if user.operation != subtract.operation or subtract.operation.operands[1] != \
            (max_broadcast[-1].result if max_broadcast else stat):
        raise Decline("attn_softmax", "the row max is not subtracted from the scores")
    exp = _only_reader(subtract.result, "the shifted scores")
    if exp.operation.name != "stablehlo.exponential":
        raise Decline("attn_softmax", f"{describe_op(exp)} follows the shifted scores, not an exponential")
    readers = _readers(exp.result)
    row_sum = next((r for r in readers if r.operation.name == "stablehlo.reduce"), None)
    divide = next((r for r in readers if r.operation.name == "stablehlo.divide"), None)
    if len(readers) != 2 or row_sum is None or divide is None or divide.operation.operands[0] != exp.result:
        raise Decline("attn_softmax", "the exponentials are read by other ops than the softmax's sum and divide")
    if _reduce(row_sum, "stablehlo.add", sd2) != 0.0:
        raise Decline("attn_softmax", f"{describe_op(row_sum)} sums from a nonzero init")
    sum_broadcast, user = _broadcast_back(row_sum.result, shape2, sd2)
    if user.operation != divide.operation or divide.operation.operands[1] != \
            (sum_broadcast[-1].result if sum_broadcast else row_sum.result):
        raise Decline("attn_softmax", "the exponentials are not divided by their sum")
    prob_steps, p, pd = _tracked_chain(divide.result, sd2, lambda r: False)
    for step in prob_steps:
        if not _linear(step):
            raise Decline("attn_softmax", f"{describe_op(step.op)} between the probabilities and P·V is not linear")
    pv = _only_reader(p, "the probabilities")
    if pv.operation.name != DOT or ir_utils.is_grouped_dot(pv):
        raise Decline("attn_softmax", f"{describe_op(pv)} reads the probabilities, not a matmul with V")
    side = [v for v in pv.operation.operands[:2]].index(p)
    numbers = DotDims.of(pv)
    if list(numbers.contracting[side]) != [pd]:
        raise Decline("attn_softmax", f"{describe_op(pv)} contracts other dims of the probabilities than the "
                                      "gathered one")
    values, value_steps = _values(pv, 1 - side, numbers.contracting[1 - side][0], keys, ring)
    ops = [*key_steps, *value_steps]
    rank = len(shape)
    inverse = [where.index(j) for j in range(rank)]
    by_max, by_sum = [d for d in range(rank) if d != sd], [inverse[j] for j in range(rank) if j != sd2]
    permutation = tuple(by_max.index(d) for d in by_sum)
    site_ops = [step.op for step in ops] + [scores] + [step.op for step in score_steps] + list(transposes) + [
        row_max, *max_steps, *max_broadcast, subtract, exp, row_sum, *sum_broadcast, divide] + \
        [step.op for step in prob_steps]
    inside = {o.operation for o in site_ops} | {pv.operation}
    for o in site_ops:
        for r in o.operation.results:
            if any(u.operation not in inside for u in _readers(r)):
                raise Decline("attn_residual", f"{describe_op(o)}'s value is also read after the attention (a "
                                               "training step's residual: its backward reads the whole "
                                               "probability matrix)")
    return AttentionSite(keys, values, dim, ring, region, tuple(key_steps), tuple(value_steps), scores, score_dim,
                         tuple(score_steps), tuple(transposes), sd2,
                         None if permutation == tuple(range(rank - 1)) else permutation, row_max, max_init, tuple(max_steps), tuple(max_broadcast), subtract, exp,
                         row_sum, tuple(sum_broadcast), divide, tuple(prob_steps), pv, side, tuple(site_ops),
                         ir.RankedTensorType(keys.operation.operands[0].type).shape[dim])


def _values(pv: ir.OpView, side: int, dim: int, keys: ir.OpView, ring: Ring) -> tuple[ir.OpView, list[Step]]:
    """The all_gather of V reaching ``pv``'s operand ``side`` with its gathered dim at ``dim``, and its steps."""
    block, found, frontier, seen = pv.operation.block, [], [pv.operation.operands[side]], set()
    while frontier:
        owner = ir_utils.producer(frontier.pop())
        if owner is None:
            continue
        if owner.operation in seen or owner.operation.block != block:
            continue
        seen.add(owner.operation)
        if owner.operation.name == AG:
            found.append(owner)
        else:
            frontier.extend(owner.operation.operands)
    if len(found) != 1:
        raise Decline("attn_region", f"P·V's other operand comes from {len(found)} all_gathers, not from V's one")
    values = found[0]
    if values.operation.attributes["replica_groups"] != keys.operation.attributes["replica_groups"] or \
            ir_utils.int_attr(values, "all_gather_dim") is None or len(values.operation.operands) != 1:
        raise Decline("attn_region", f"V's {describe_op(values)} gathers over other groups than K's")
    v_dim = ir_utils.int_attr(values, "all_gather_dim")
    steps = _path(values, v_dim, pv)
    dims = {values.operation.results[0]: v_dim, **{r: s.out_dim for s in steps for r in s.op.operation.results}}
    if dims.get(pv.operation.operands[side]) != dim:
        raise Decline("attn_region", "P·V contracts V along another dim than its gathered one")
    k_block = ir.RankedTensorType(keys.operation.operands[0].type).shape[ir_utils.int_attr(keys, "all_gather_dim")]
    if ir.RankedTensorType(values.operation.operands[0].type).shape[v_dim] != k_block:
        raise Decline("attn_region", "K's and V's shards differ in length")
    return values, steps
