"""All_to_all pairs (expert parallelism's dispatch and combine, Ulysses' exchanges): each decided
and chunked (:mod:`.matchers.all_to_all`, :mod:`.rewrites.all_to_all`).

The cost model prices the pair as it stands (dispatch, the ops' matmuls, combine: one after the
other) against ``k`` chunks pipelined on two streams: chunk ``j+1``'s dispatch and chunk
``j-1``'s combine on the collective stream while chunk ``j``'s matmuls compute, each exchange
``1/k`` of the bytes plus one ``step`` of synchronisation, each chunk's matmuls ``1/k`` of the
FLOPs at the profile's rate.  ``k`` is the fastest of 2, 4 and 8 that divide the dim
(``--chunks`` fixes it; on a machine no profile describes, 2, as for psums).  Under ``--policy
auto`` a pair is left as written where its ``k`` does not beat the serial time by the margin
(``policy``; on an undescribed machine, by the fallback profile's numbers).
"""

from __future__ import annotations

from . import cost, ir_utils, step_guard
from ._jax_private import ir
from .matchers import DeclinedSite, ModuleInfo
from .matchers.all_to_all import AllToAllSite, match_all_to_all
from .report import SiteReport, collective_entry, tensor_bytes
from .rewrites.all_to_all import chunk_all_to_all
from .rewrites.schedule import RewriteContext
from .sites import dot_flops, guarded

CHUNK_COUNTS = (2, 4, 8)


def exchange_seconds(nbytes: float, n: int, hw: cost.Hardware) -> float:
    """One all_to_all of ``nbytes`` per device over ``n`` devices: ``(n-1)/n`` of them leave."""
    return nbytes * (n - 1) / n / hw.bandwidth + hw.step


def pipelined(dispatch: float, compute: float, combine: float, k: int, step: float) -> float:
    """The pair in ``k`` chunks on a collective and a compute stream, in the order the rewrite
    issues them (dispatch 0; then per chunk: the next dispatch, the chunk's ops, its combine)."""
    a, b, c = (dispatch - step) / k + step, (combine - step) / k + step, compute / k
    comm = a  # dispatch 0 done
    arrived, computed = [a], 0.0
    for j in range(k):
        if j + 1 < k:
            comm += a
            arrived.append(comm)
        computed = max(computed, arrived[j]) + c
        comm = max(comm, computed) + b
    return comm


def predict(site: AllToAllSite, hw: cost.Hardware, counts) -> dict:
    """The serial time and each chunk count's (seconds), its pick and speed-up."""
    n = site.ring.size
    sent = tensor_bytes(ir_utils.ranked_tensor(site.dispatch.operation.operands[0]))
    back = tensor_bytes(ir_utils.ranked_tensor(site.combine.operation.operands[0]))
    dispatch, combine = exchange_seconds(sent, n, hw), exchange_seconds(back, n, hw)
    compute = sum(dot_flops(s.op) / hw.throughput(str(ir.RankedTensorType(s.op.operation.operands[0].type).element_type))
                  for s in site.steps if s.op.operation.name == "stablehlo.dot_general")
    serial = dispatch + compute + combine
    chunked = {str(k): pipelined(dispatch, compute, combine, k, hw.step) for k in counts}
    best = min(chunked, key=chunked.get) if chunked else None
    return {"serial_s": serial, "compute_s": compute, "dispatch_s": dispatch, "combine_s": combine,
            "chunks_s": chunked, "chunks": int(best) if best else None, "hardware": hw.name,
            "speedup": serial / chunked[best] if best else 1.0}


def decide_all_to_all(op, info: ModuleInfo, ctx: RewriteContext, options, hw: cost.Hardware,
                      source: str) -> SiteReport:
    """``op``'s entry (a pair's dispatch), chunked with its combine where the options and the
    cost model say so."""
    site = match_all_to_all(op, info)
    entry = collective_entry(site.kind, op, site.ring, source)
    if entry.ring_size and entry.bytes_per_step is not None:  # what leaves each device
        entry.bytes_moved = (entry.ring_size - 1) * entry.bytes_per_step // entry.ring_size
    if isinstance(site, DeclinedSite):
        entry.reason, entry.reason_code = site.message, site.code
        return entry
    counts = site.chunk_counts([options.chunks] if options.chunks else CHUNK_COUNTS)
    entry.collective_dim = site.dim
    entry.dim_role = site.mode
    entry.absorbs = [ir_utils.render_location(site.combine.location, source)]
    entry.all_to_all = {"dim": site.dim, "combine": entry.absorbs[0], "combine_dim": site.out_dim,
                        "mode": site.mode, "chunks": None, "prediction": {}}
    if not counts:
        entry.reason_code = "a2a_no_dim"
        entry.reason = f"dim {site.dim} does not divide into {options.chunks} chunks (--chunks)"
        return entry
    prediction = predict(site, hw, counts)
    chunks = 2 if hw.assumed and not options.chunks and 2 in counts else prediction["chunks"]
    entry.all_to_all.update(chunks=chunks, prediction=prediction)
    speedup = prediction["serial_s"] / prediction["chunks_s"][str(chunks)]
    if options.min_bytes and (entry.bytes_moved or 0) < options.min_bytes:
        entry.reason_code, entry.reason = "min_bytes", f"moves {entry.bytes_moved} B per device, under --min-bytes " \
                                                       f"{options.min_bytes}"
        return entry
    if options.policy == "auto" and speedup < 1 + options.margin:
        entry.reason_code = "policy"
        entry.reason = (f"predicted speed-up {speedup:.3f}x ({chunks} chunks) on {hw.name} is under "
                        f"1 + {options.margin:g}")
        return entry
    declined = step_guard.verdict(entry)
    if declined:
        entry.reason_code, entry.reason = declined
        return entry
    applied = guarded(entry, chunk_all_to_all, site, ctx, chunks)
    entry.rewritten = True
    entry.channel_handles = list(applied.channel_handles)
    entry.notes = applied.notes
    entry.schedule = {"variant": f"chunk{chunks}", "directions": 0, "rounds": chunks, "loop_trips": 0,
                      "rounds_per_trip": 0, "peeled_rounds": chunks, "permutes": 0, "streams_annotated": False}
    return entry
