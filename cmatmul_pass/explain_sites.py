"""``explain``'s lines for the sites that rewrite more than one collective's ring: an attention
ringed with an online softmax, a region rewritten as passes over gathered columns, an all_to_all
pair chunked, a psum split or chunked."""

from __future__ import annotations

from .column_rings import explain_lines


def attention(site) -> None:
    """An attention's lines: V's gather, the blocks, the memory before and after, the prediction."""
    from .cost import readable_seconds

    a = site.attention
    if "passes" in a:
        return print("\n".join(explain_lines(site)))
    m, p = a["memory"], a["prediction"]
    print(f"  attention: V gathered at {a['values']}; {a['blocks']} blocks of {a['block_keys']} keys, online softmax")
    print(f"  memory per device: scores {m['scores_before']} B -> {m['scores_after']} B a block; keys and values "
          f"{m['keys_values_before']} B -> {m['keys_values_after']} B (a block held, the next in flight, per "
          "direction)" + (f"; read a block at a time, held whole: {m['held_whole']} B (gathered segment ids, "
                          "a bias)" if m.get("held_whole") else ""))
    print(f"  predicted on {p['hardware']}: gathers {readable_seconds(p['gathers_s'])} + matmuls "
          f"{readable_seconds(p['compute_s'])} = {readable_seconds(p['serial_s'])}; ring ({p['variant']}) "
          f"{readable_seconds(p['ring_s'])} ({p['speedup']:.2f}x)")


def all_to_all(site) -> None:
    """An all_to_all pair's lines: its combine, the dim chunked, each chunk count's prediction."""
    from .cost import readable_seconds

    a = site.all_to_all
    how = {"exchanged": "the dispatch's concat dim, the combine's split dim",
           "split": "the dispatch's split dim, the combine's concat dim"}.get(a["mode"], "exchanged by neither")
    print(f"  pair: combined by the all_to_all at {a['combine']}; chunked along dim {a['dim']} ({how}; the "
          f"combine's dim {a['combine_dim']})")
    p = a["prediction"]
    if p:
        times = ", ".join(f"{k} chunks {readable_seconds(s)} ({p['serial_s'] / s:.2f}x)"
                          for k, s in p["chunks_s"].items())
        print(f"  predicted on {p['hardware']}: dispatch {readable_seconds(p['dispatch_s'])} + matmuls "
              f"{readable_seconds(p['compute_s'])} + combine {readable_seconds(p['combine_s'])} = "
              f"{readable_seconds(p['serial_s'])}; {times}")


def all_reduce(site) -> None:
    """A dot → all_reduce site: the strategy, the cost model's view of it, where its gathers went."""
    from .cost import TIE, readable_seconds
    from .report import durations

    a = site.all_reduce
    p = a["prediction"]
    if a.get("picked") == "summed value":  # a psum split only for its matmuls' gather ring (psums.split_summed_value)
        print(f"  all_reduce: split along dim {a['dim']} (the summed value is no matmul's: its reduce-scatter stays a "
              "collective)")
        if p:
            print(f"  predicted on {p['hardware']}: the all_reduce {readable_seconds(p['all_reduce_s'])}; split "
                  f"{readable_seconds(p['split_s'])} (its reduce-scatter {readable_seconds(p['scatter_s'])}, the "
                  f"rest what the gathers' rings leave exposed; {p['speedup']['split']:.2f}x)")
        for how in a["gathers"]:
            print(f"  gathered: {how}")
        return
    times = durations(p["serial_s"], p["all_reduce_s"], p["split_s"],
                      *([p["chunk_s"][str(p["chunks"])]] if p.get("chunks") else []))
    chunks = f", {p['chunks']} chunks: {times[3]} ({p['speedup']['chunk']:.2f}x)" if p.get("chunks") else ""
    picked = {"model": " (the cost model's pick)",
              "fallback": " (auto's fallback: no profile describes this machine)"}.get(a.get("picked"), "")
    if a.get("picked") == "model" and p.get("tied"):
        picked = f" (the cost model's pick: split and chunk tie within {TIE:.0%}, and " + (
            "split takes this one: its gather goes on to a matmul, whose ring hides it)" if a.get("tie_to_split")
            else "chunk takes a tie)")
    print(f"  all_reduce: {a['strategy']} along dim {a['dim']}"
          + (f" into {a['chunks']} chunks" if a["strategy"] == "chunk" and site.rewritten else "") + picked)
    print(f"  predicted on {p['hardware']}: dots + all_reduce {times[0]} (the all_reduce "
          f"{times[1]}); split {times[2]} ({p['speedup']['split']:.2f}x){chunks}")
    if site.rewritten and a["strategy"] == "split":
        for where in a["gathers"] or ["nowhere: no reader needs the whole value"]:
            print(f"  gathered: {where}")
