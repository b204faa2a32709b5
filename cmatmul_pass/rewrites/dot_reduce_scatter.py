"""dot_general → reduce_scatter(sum), as a windowed ring.

Before (ring of n; the scattered dim of the product is free dim ``e`` of operand
``a``; layout ops may sit between the dot and the reduce_scatter)::

    %d = dot_general(%a, %b)                                        // [.., n*s, ..]
    %r = stablehlo.reduce_scatter(%d) {scatter_dimension = r, sum}  // [.., s, ..]

After (unidirectional, one round per trip)::

    %pos = table[partition_id]
    %acc = block((pos + 1) mod n)               // round 0, peeled: nothing to receive yet
    %acc = while (%i = 0; %i < n-1; %i++) carry (%acc) {
        %recv = collective_permute(%acc)        // position k sends to k-1
        yield %recv + block((pos + i + 2) mod n)
    }
    // block(c) = layout ops of dot_general(dynamic_slice(%a, e, c*s, s), %b): block c of the product
    // (when the scattered dim is a batch dim of the product, %b's paired batch dim is sliced too)

In round ``r`` position ``p`` adds its share of block ``p+r+1`` to the partial sum
that position ``p+1`` started for it, so after ``n-1`` permutes every position holds
the full sum of its own block.  The permute of a round and its dot are independent;
the first round is the one peeled, so no zeros are ever sent.  The partial sum
travels in the reduce_scatter's own element type (the bytes the reduce_scatter would
move).

The ops between the dot and the reduce_scatter (``site.path``) are applied to every block the
ring computes, a chain or a DAG (a norm's backward reading the product twice:
:func:`~cmatmul_pass.layout.apply_dag`), their per-row operands sliced to the block's rows.  A
sum over the scattered rows read beside the scatter (a norm gain's gradient) is carried by the
loop: each block adds its share, and the ops before the scatter that read the sum move after it.
A reduce over other dims read beside the scatter (the gain's gradient where the scattered dim is
the features) is carried the same way, each block put in its place along the ring dim.

Bidirectional: each block is split in two halves along the scattered dim; the first
half's partial sums travel to the previous position as above, the second half's to
the next one (block ``p-r-1`` in round ``r``), and the halves are concatenated at the
end: the same rounds, half the bytes per permute in each direction.  It needs an even
block and layout ops that keep half-blocks whole; otherwise the ring stays
unidirectional and the report says why.
"""

from __future__ import annotations

from .._jax_private import hlo, ir
from ..cost import scatter_signatures
from ..layout import apply_dag, path_sources
from ..matchers import ReduceScatterSite
from .builders import Builder, erase_dead, shard_type
from .schedule import Applied, DotBarriers, RewriteContext, Round, ScheduleStats, emit_rounds, ring_position

#: The partial sum travels to the previous position (position k sends to k-1).
SEND_TO_PREVIOUS = -1


def halves_blocker(site: ReduceScatterSite) -> str | None:
    """Why a bidirectional ring cannot split ``site``'s blocks in halves (None: it can)."""
    n = site.ring.size
    for term in site.terms:
        width = ir.RankedTensorType(term.dot.operation.operands[term.operand_index].type).shape[term.operand_dim] // n
        if width % 2:
            return f"bidirectional: the block of {width} along the scattered dim cannot be halved; kept one direction"
    for step in site.path:
        if not step.valid_for(2 * n):
            return f"bidirectional: {step.name} does not keep half-blocks whole; kept one direction"
    return None


def path_block(site, products, parts: int, block_of_sliced, add) -> tuple[ir.Value, list[ir.Value]]:
    """One block of the value ``site``'s collective sums (a :class:`ReduceScatterSite`, an
    :class:`~cmatmul_pass.matchers.all_reduce.AllReduceSite`: ``terms``, ``adds``, ``path``), built
    at the current insertion point, and the block's shares of the path's sums over the rows
    (:attr:`~cmatmul_pass.layout.LayoutStep.sums_rows`) and its blocks of the reduces it assembles
    (:attr:`~cmatmul_pass.layout.LayoutStep.assembles`), in path order.  ``products``: each term's
    block of its dot, in term order (made as it is read); ``block_of_sliced(operand, dim, width)``:
    that block of a value the path reads at the block's rows (asked once per operand, however many
    steps read it); ``add(a, b)``: an add of two products' blocks (a sum of dots)."""
    # each original value on the path -> its block: the dots', or the root of their sum
    blocks = {}
    total = None
    for term, product in zip(site.terms, products):  # a sum of dots added in the same order
        blocks[term.dot.result] = product
        if site.adds:
            total = product if total is None else add(total, product)
    if site.adds:
        blocks = {site.adds[0].result: total}

    sliced: dict = {}  # one slice per operand read block by block, however many steps read it

    def once(operand: ir.Value, dim: int, width: int) -> ir.Value:
        key = (operand, dim, width)
        if key not in sliced:
            sliced[key] = block_of_sliced(operand, dim, width)
        return sliced[key]

    # a chain or a DAG (a norm's backward reading the product twice): every step reads its
    # operands' blocks
    apply_dag(site.path, blocks, parts, once)
    return blocks[site.anchor.operation.operands[0]], [blocks[step.op.result] for step in site.path
                                                      if step.handed_over]


def rewrite_dot_reduce_scatter(site: ReduceScatterSite, ctx: RewriteContext) -> Applied:
    rs, n = site.reduce_scatter, site.ring.size
    notes = []
    split = ctx.bidirectional
    if split:
        blocker = halves_blocker(site)
        if blocker:
            notes.append(blocker)
            split = False
    parts = 2 * n if split else n
    # direction of each stream's partial sums, and which half of the block it carries
    shifts = [SEND_TO_PREVIOUS, -SEND_TO_PREVIOUS] if split else [SEND_TO_PREVIOUS]
    channels: list[int] = []  # a fresh handle for every permute op emitted

    # more than one round or direction computing in one block: keep their dots apart
    barriers = DotBarriers(ctx.tie_rounds and (split or ctx.unroll != 1), rs.operation.block)
    loop_b = Builder(ir.Location.fused([t.dot.location for t in site.terms] + [rs.location]), ctx.constants)
    comm = loop_b.at(rs.location)

    def block_offset(compute: Builder, block: ir.Value, half: int, width: int) -> ir.Value:
        """Where ``block`` (its ``half``, in a split ring) starts along a dim cut in ``width``-sized parts."""
        offset = compute.scaled(block, width * (parts // n))
        return compute.add(offset, compute.index(width)) if half else offset

    # what every round's piece of a term reads: its builder, the dot's operands, the block's width
    # along the scattered dim, the piece's type (worked out once per term, not per round)
    term_facts = {}
    for term in site.terms:
        operands = list(term.dot.operation.operands)
        width = ir.RankedTensorType(operands[term.operand_index].type).shape[term.operand_dim] // parts
        piece_t = shard_type(ir.RankedTensorType(term.dot.result.type), term.result_dim, parts)
        term_facts[id(term)] = (loop_b.at(term.dot.location), operands, width, piece_t, term.sliced())

    def term_piece(term, block: ir.Value, half: int, stream: int, dots: list) -> ir.Value:
        compute, operands, width, piece_t, sliced = term_facts[id(term)]
        args = list(operands)
        offset = block_offset(compute, block, half, width)
        for index, dim in sliced:  # a batch dim's block is that block of both operands
            args[index] = compute.dynamic_slice(args[index], dim, offset, width)
        if barriers.tied():  # the other operand is every round's: keep XLA from merging the rounds' dots
            args = compute.tied(args)
        product = ctx.annotator.dot(compute, term.dot, piece_t, args[0], args[1], stream)
        dots.append(product.owner)
        return product

    # a gain's gradient: each block's share added up (a sum over the rows), or put in its place
    sums = [step for step in site.path if step.handed_over]

    def piece(block: ir.Value, half: int, stream: int, dots: list) -> tuple[ir.Value, list[ir.Value]]:
        def block_of_sliced(operand: ir.Value, dim: int, width: int) -> ir.Value:
            compute = loop_b.at(rs.location)
            return compute.dynamic_slice(operand, dim, block_offset(compute, block, half, width), width)

        products = (term_piece(term, block, half, stream, dots) for term in site.terms)
        return path_block(site, products, parts, block_of_sliced, loop_b.at(rs.location).add)

    def placed(step, total: ir.Value | None, share: ir.Value, block: ir.Value, half: int) -> ir.Value:
        """An assembled reduce's block put in its place (the first into zeros)."""
        compute = loop_b.at(step.op.location)
        whole = ir.RankedTensorType(step.op.result.type)
        width = whole.shape[step.out_dim] // parts
        into = compute.zeros(whole) if total is None else total
        return compute.dynamic_update_slice(into, share, step.out_dim, block_offset(compute, block, half, width))

    def round_fn(rnd: Round, accs: list[ir.Value]) -> list[ir.Value]:
        new = []
        totals = accs[len(shifts):]  # the sums over the rows, of the blocks computed so far (None: none yet)
        for i, shift in enumerate(shifts):
            dots: list = []
            received = None
            if rnd.signature:  # the partial sum of this round's block arrives while we compute our share
                channels.append(ctx.take_channel())
                received = comm.collective_permute(accs[i], site.ring.shift_pairs(shift), channels[-1])
            # sums travel from position p to p+shift, so position p works on block p - shift*(r+1)
            block = ring_position(loop_b, position, rnd, n, shift=-shift, offset=-shift,
                                  ring=site.ring, region=site.region)
            mine, shares = piece(block, i, 1 + rnd.slot * len(shifts) + i, dots)
            ctx.annotator.group(received.owner if received is not None else None, dots)
            new.append(comm.add(received, mine) if rnd.signature else mine)
            totals = [placed(step, total, share, block, i) if step.assembles else
                      share if total is None else loop_b.at(step.op.location).add(total, share)
                      for step, total, share in zip(sums, totals, shares)]
        return new + totals

    after = rs.operation
    for op in site.moved:  # they read a sum over the rows, which the ring hands over when it is done
        op.operation.move_after(after)
        after = op.operation
    stats = ScheduleStats()
    with ir.InsertionPoint(rs.operation):
        position = loop_b.position_in_ring(site.ring, site.region)
        # round 0 creates the partial sums (it receives nothing), so it is never in the loop
        signatures = scatter_signatures(n)
        final = emit_rounds(loop_b, signatures, [None] * (len(shifts) + len(sums)), round_fn, ctx.unroll, stats)
        final, totals = final[:len(shifts)], final[len(shifts):]
        result = final[0] if len(final) == 1 else hlo.ConcatenateOp(final, site.scatter_dim, loc=rs.location).result

    for step, total in zip(sums, totals):
        step.op.result.replace_all_uses_with(total)
    rs.result.replace_all_uses_with(result)
    rs.operation.erase()
    erase_dead([step.op for step in reversed(site.path)] + path_sources(site.path) + list(site.adds)
               + [t.dot for t in site.terms])
    return Applied(channels, len(shifts), stats, len(shifts) * (n - 1), notes)
