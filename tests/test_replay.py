"""Identical layers: the first rewritten, all of them calls of its rewritten region (and with
``replay.CHECK``, the last rewritten too and checked against the first) (cmatmul_pass.replay).
The result must be the module and report the pass gives without replay, once the calls are
inlined: channel handle numbers aside, and the called layers' ops located as the first layer's."""

from pathlib import Path

import jax
import numpy as np
import pytest

import cmatmul_pass
from cmatmul_pass import cost, execute, ir_utils, replay
from cmatmul_pass.pipeline import variant_options
from cmatmul_pass._jax_private import hlo, ir, make_context, sdy
from cmatmul_pass.sharing import FUNCTION_PREFIX, structure
from conftest import inline_layers
from tools import bench


@pytest.fixture(scope="module")
def lowered():
    """Six layers of each bench model, lowered once: a group of six forward regions or five
    (the first layer's may differ), and as many backward ones."""
    out = {}
    for model in bench.MODELS:
        fn, args = bench.MODELS[model](6)
        out[model] = fn.lower(*args)
    return out


def _replays(monkeypatch) -> list:
    """Record each region replay (True: replayed, False: fell back for that region)."""
    calls = []
    entries_of = replay._Replay.entries

    def spy(self, region):
        entries = entries_of(self, region)
        calls.append(entries is not None)
        return entries

    monkeypatch.setattr(replay._Replay, "entries", spy)
    return calls


def _without_replay(text: str, context, options=None, inline: bool = True):
    """The pass with the same groups but every region rewritten the usual way; ``inline``: each
    region of a group with its rings inline, as the twin's are (which replay, its layer function
    inlined, gives), else only the twin's and the probe's (the others share their rings from the
    second region on)."""
    init, finish = replay.Plan.__init__, replay.Plan.finish

    def no_deferred(self, groups, fingerprint):
        init(self, groups, fingerprint)
        self.deferred = set()
        if inline:
            grouped = {replay._body(r) for g in groups for r in (*g.members, *g.joiners, *(t.region for t in g.trims))}
            self.inline_rings = lambda op: self.top_level(op) in grouped

    replay.Plan.__init__, replay.Plan.finish = no_deferred, lambda self, *args: []
    try:
        return cmatmul_pass.rewrite(text, options, context=context)
    finally:
        replay.Plan.__init__, replay.Plan.finish = init, finish


def _facts(result, copies=None, hidden=None):
    """What must agree: every op (ops, attributes, types, wiring; channel handles aside), every
    op's location (but inside the regions at the indices ``hidden``, among the top-level ones),
    and every report entry but its channel handles.  ``copies`` (from :func:`inline_layers`):
    each copy's ops must be located as the first region calling its function.  The ring
    functions' locations come apart (the fourth fact): their ops are located as the site each was
    built from, the first of its pattern to call it (with replay the twin's; without it a joiner's
    where a group has one).  Returns the facts and the indices of the copies."""
    module = result.module
    regions = replay._top_level_regions(module)
    index = {replay._body(r): i for i, r in enumerate(regions)}
    copies = copies or {}
    hide = {index[body] for body in copies} | set(hidden or ())
    locations, inside, rings = [], {}, []
    for f in module.body.operations:
        if f.operation.name != "func.func":
            continue
        if ir.StringAttr(f.attributes["sym_name"]).value.startswith(FUNCTION_PREFIX):
            f.operation.walk(lambda o: (rings.append(str(o.location)), ir.WalkResult.ADVANCE)[1])
            continue
        for op in f.regions[0].blocks[0].operations:
            at = index.get(replay._body(op)) if op.operation.name == replay.MANUAL else None
            found = []
            op.operation.walk(lambda o: (found.append(str(o.location)), ir.WalkResult.ADVANCE)[1],
                              ir.WalkOrder.PRE_ORDER)
            if at is not None:
                inside[at] = found[1:]
            locations += found[:1] if at in hide else found
    first: dict = {}  # a function -> the interior of the first region calling it
    for body, callee in sorted(copies.items(), key=lambda item: index[item[0]]):
        want = first.setdefault(callee, inside[index[body]])
        assert inside[index[body]] == want  # the function's ops carry the first layer's locations
    entries = [{k: v for k, v in vars(e).items() if k != "channel_handles"} for e in result.report.sites]
    return (structure(module.operation), locations, entries, rings), sorted(hide)


def _unread_inputs_dropped(module) -> None:
    """Each top-level region without the results that return one of its inputs and that no one
    reads (a joiner's call returns the twin's: :func:`replay._joins`)."""
    for region in replay._top_level_regions(module):
        through = {i: a for i, a in replay.pass_through(region).items() if not list(region.results[i].uses)}
        if through:
            core = replay.without_pass_through(region, through)
            for old, new in zip((r for i, r in enumerate(region.results) if i not in through), core.results):
                old.replace_all_uses_with(new)
            region.erase()


def _compare(replayed, plain, context):
    """:func:`_facts` of both, the replayed one's layers inlined; in both, no region returns an
    input no one reads."""
    with context:
        copies = inline_layers(replayed.module)
        for result in (replayed, plain):
            _unread_inputs_dropped(result.module)
        assert copies  # some layers were calls
        got, hidden = _facts(replayed, copies)
        want, _ = _facts(plain, hidden=hidden)
    return got, want


@pytest.mark.parametrize("model", list(bench.MODELS))
@pytest.mark.parametrize("debug_info", [False, True])
@pytest.mark.parametrize("check", [False, True])
@pytest.mark.parametrize("psums", ["default", "split"])
def test_replay_gives_what_the_pass_gives_without_it(lowered, model, debug_info, check, psums, monkeypatch):
    """Under the default (on the h100 profile the steps' psums are chunked: the Megatron step has
    no ring at all) and with every psum split (its rings, and the gathers carried into the next
    block's ring)."""
    text = lowered[model].as_text(debug_info=debug_info)
    options = cmatmul_pass.Options(all_reduce="split") if psums == "split" else None
    context = make_context()  # one context: attributes compare by identity
    calls = _replays(monkeypatch)
    monkeypatch.setattr(replay, "CHECK", check)
    checks = []
    agrees = replay._Replay.agrees
    monkeypatch.setattr(replay._Replay, "agrees", lambda self, *a: checks.append(agrees(self, *a)) or checks[-1])
    replayed = cmatmul_pass.rewrite(text, options, context=context)
    assert calls and all(calls)  # both groups replayed into their other layers
    trimmed = replayed.report.trimmed  # the backward's first layer, which returns no input gradient
    assert len(trimmed) == (psums == "default"), trimmed  # (split psums: none, see replay.Trim)
    # each group's probe agreed, and each trimmed layer (or there was none)
    assert checks == ([True] * (2 + len(trimmed)) if check else [])
    assert [c["agreed"] for c in replayed.report.layer_checks] == checks
    assert [bool(c.get("trimmed")) for c in replayed.report.layer_checks] == [False, False, *[True] * len(trimmed)][:len(checks)]
    assert ("layer_checks" in replayed.report.to_dict()) == check
    assert ("2 group(s) checked against their last layer, 0 differed" in replayed.report.summary()) == check
    plain = _without_replay(text, context, options)
    with context:  # the report names each layer function and the regions that call it, in program order
        calls = [c for c in ir_utils.ops_named(replayed.module, "func.call")["func.call"]
                 if ir.FlatSymbolRefAttr(c.attributes["callee"]).value.startswith(replay.LAYER_PREFIX)]
        named = {}
        for c in calls:
            named.setdefault("@" + ir.FlatSymbolRefAttr(c.attributes["callee"]).value, []).append(
                ir_utils.render_location(c.location, "<input>"))
    trims = {name: [t["called_at"]] for name, t in trimmed.items()}
    assert {**replayed.report.layers, **trims} == named and len(replayed.report.layers) == 2, (replayed.report.layers, named)
    assert all(t["of"] in replayed.report.layers for t in trimmed.values())
    assert f"{len(calls) - len(trims)} identical layers are calls of 2 rewritten one(s)" in replayed.report.summary()
    assert replayed.report.to_dict()["layers"] == replayed.report.layers and not plain.report.layers
    assert replayed.report.to_dict().get("trimmed", {}) == trimmed and not plain.report.trimmed
    got, want = _compare(replayed, plain, context)
    assert got[0] == want[0]
    assert got[1] == want[1]
    assert got[2] == want[2]  # and in the same order
    source = ir_utils.parse(text, context=context)  # (kept: its regions are read below)
    if any(layer.joiners for layer in replay.plan(replay._top_level_regions(source)).groups):
        # the ring functions' ops are located as the twin's sites, not the joiner's: one to one
        pairs = set(zip(got[3], want[3]))
        assert len(got[3]) == len(want[3]) and len({a for a, _ in pairs}) == len(pairs) == len({b for _, b in pairs})
    else:
        assert got[3] == want[3]
    assert len(replayed.report.rewritten) == len(replayed.report.sites)
    # replayed, a group's rings are inline in its layer function; without any group, the regions
    # after the first share them
    saved = replay.MIN_MEMBERS
    replay.MIN_MEMBERS = 10**9
    try:
        alone = cmatmul_pass.rewrite(text, options, context=context)
    finally:
        replay.MIN_MEMBERS = saved
    rings = [s for s in replayed.report.sites if s.schedule]
    assert bool(rings) == (model != "megatron" or psums == "split")  # the Megatron step's chunks: no ring
    shared = sum(1 for s in replayed.report.sites if s.shared_ring)
    assert shared < sum(1 for s in alone.report.sites if s.shared_ring) or not rings
    assert [vars(s)["location"] for s in alone.report.sites] == [vars(s)["location"] for s in replayed.report.sites]


def test_replayed_channel_handles_are_fresh(lowered):
    result = cmatmul_pass.rewrite(lowered["sequence_parallel"].as_text())
    handles = [hlo.ChannelHandle(op.attributes["channel_handle"]).handle
               for name, ops in ir_utils.ops_named(result.module, *ir_utils.CHANNEL_OPS).items()
               for op in ops if "channel_handle" in op.attributes]
    assert len(handles) == len(set(handles))
    for entry in result.report.sites:  # each entry names its own permutes' handles (or its shared ring's)
        assert set(entry.channel_handles) <= set(handles)


def test_the_first_layer_joins_though_it_returns_fewer_of_its_inputs(lowered):
    """JAX's forward regions return some of their inputs as they came in (each device's block,
    stacked, for the backward), the first layer three fewer (its caller holds them).  Their bodies
    are one, so the first layer joins the group: a call of the twin's function, the three results
    it does not have unread."""
    text = lowered["sequence_parallel"].as_text()
    context = make_context()
    with context:
        module = ir_utils.parse(text, context=context)
        regions = replay._top_level_regions(module)
        through = [replay.pass_through(r) for r in regions[:6]]
        assert all(len(t) == len(through[0]) + 3 for t in through[1:])
        layers = replay.plan(regions)
        forward = layers.groups[0]
        assert forward.joiners == [regions[0]] and forward.twin == regions[1] and len(forward.members) == 5
        assert not any(g.joiners for g in layers.groups[1:])  # the backward's last region computes less
        first = ir_utils.render_location(regions[0].location, "<input>")
    result = cmatmul_pass.rewrite(text, context=context)
    called = next(iter(result.report.layers.values()))
    assert len(called) == 6 and called[0] == first
    with context:
        calls = [c for c in ir_utils.ops_named(result.module, "func.call")["func.call"]
                 if ir_utils.render_location(c.location, "<input>") == first]
        assert len(calls) == 1
        unread = [r for r in calls[0].results if not list(r.uses)]
        assert len(unread) == 3 and len(calls[0].results) == len(regions[1].results)


def test_a_region_returning_an_input_sharded_otherwise_does_not_join(lowered):
    """A joiner's returned inputs must be the twin's as they are returned (argument, sharding and
    type): the call hands over the twin's results."""
    context = make_context()
    with context:
        module = ir_utils.parse(lowered["sequence_parallel"].as_text(), context=context)
        regions = replay._top_level_regions(module)
        joiner, twin = regions[0], regions[1]
        fingerprint = replay._Fingerprint(context)
        assert replay._joins(joiner, twin, fingerprint) is not None
        index = next(iter(replay.pass_through(joiner)))
        outs = list(sdy.TensorShardingPerValueAttr(joiner.attributes["out_shardings"]).shardings)
        ins = sdy.TensorShardingPerValueAttr(joiner.attributes["in_shardings"]).shardings
        other = next(o for o in ins if o != outs[index])
        outs[index] = other
        joiner.attributes["out_shardings"] = sdy.TensorShardingPerValueAttr.get(outs)
        assert replay._joins(joiner, twin, fingerprint) is None


@pytest.mark.parametrize("model", list(bench.MODELS))
def test_a_replayed_training_step_computes_what_the_original_does(model, monkeypatch):
    """On the text path and as ``cmatmul_pass.jit`` compiles it (jax's own module, rewritten on a
    clone: the layers as calls of one function, compiled by jax)."""
    fn, args = bench.MODELS[model](5, hidden=32, ffn=64, tokens=32)
    lowered = fn.lower(*args)
    text = lowered.as_text()
    calls = _replays(monkeypatch)
    result = cmatmul_pass.rewrite(text)
    assert calls and all(calls) and result.report.layers
    assert result.report.trimmed  # the first layer's backward: a trimmed copy of the others'
    outcome = execute.check_numerics(ir_utils.parse(text), result.module)
    assert outcome.ok, outcome.format()
    jitted = cmatmul_pass.jit(fn)
    report = jitted.lower(*args).report
    assert report.layers and report.trimmed  # the decorator's path replays and trims too
    concrete = jax.tree_util.tree_map(
        lambda s: jax.device_put(np.random.default_rng(0).normal(size=s.shape).astype(s.dtype), s.sharding), args)
    want, got = fn(*concrete), jitted(*concrete)
    for w, g in zip(jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(got)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-4, atol=2e-5 * float(np.abs(w).max()))


def test_a_probe_unlike_its_twin_leaves_the_group_to_the_usual_way(lowered, monkeypatch):
    text = lowered["sequence_parallel"].as_text()
    context = make_context()
    calls = _replays(monkeypatch)
    monkeypatch.setattr(replay, "CHECK", True)
    monkeypatch.setattr(replay._Replay, "agrees", lambda self, *a: False)
    result = cmatmul_pass.rewrite(text, context=context)
    assert calls == []
    assert [c["agreed"] for c in result.report.layer_checks] == [False, False]
    assert "2 group(s) checked against their last layer, 2 differed" in result.report.summary()
    plain = _without_replay(text, context, inline=False)
    with context:
        (got, _), (want, _) = _facts(result), _facts(plain)
        assert not any(
            ir.StringAttr(f.attributes["sym_name"]).value.startswith(replay.LAYER_PREFIX)
            for f in result.module.body.operations if f.operation.name == "func.func")  # no layer function
    assert got[0] == want[0] and got[1] == want[1]
    assert sorted(map(repr, got[2])) == sorted(map(repr, want[2]))  # the group's other layers came last


def test_a_region_whose_locations_do_not_map_is_rewritten_the_usual_way(lowered, monkeypatch):
    text = lowered["megatron"].as_text()
    context = make_context()
    calls = _replays(monkeypatch)
    read = replay._Replay._text
    seen = []

    def second_fails(self, locations):
        seen.append(None)
        return None if len(seen) == 2 else read(self, locations)  # each a region's (no probe: replay.CHECK)

    monkeypatch.setattr(replay._Replay, "_text", second_fails)
    result = cmatmul_pass.rewrite(text, context=context)
    assert False in calls and True in calls
    plain = _without_replay(text, context)
    got, want = _compare(result, plain, context)
    assert got[0] == want[0] and got[1] == want[1]
    assert sorted(map(repr, got[2])) == sorted(map(repr, want[2]))


def test_modules_with_loops_are_not_replayed(monkeypatch):
    """Sinking and hoisting move collectives across loops and regions: identical regions each
    holding a scan are not replayed, and are walked whole."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((8,), ("x",))

    def layer(h, w):
        return h + jax.lax.psum(h @ w, "x"), None

    def block(h, w):
        return jax.lax.scan(layer, h, w)[0]

    region = jax.shard_map(block, mesh=mesh, in_specs=(P(), P()), out_specs=P(), check_vma=False)

    def f(h, w):
        for _ in range(replay.MIN_MEMBERS + 1):  # a group, were it not for the loops
            h = region(h, w)
        return h

    replicated = NamedSharding(mesh, P())
    text = jax.jit(f).lower(jax.ShapeDtypeStruct((16, 32), jnp.float32, sharding=replicated),
                            jax.ShapeDtypeStruct((4, 32, 32), jnp.float32, sharding=replicated)).as_text()
    module = ir_utils.parse(text)
    with module.context:
        names = (replay.MANUAL, "stablehlo.while")
        regions = replay._top_level_regions(module)
        assert len(regions) == replay.MIN_MEMBERS + 1 and replay.plan(regions) is not None
        found, layers = replay.walk(module, names, replayable=True)
        assert layers is None
        assert len(found["stablehlo.while"]) == len(regions)  # walked whole
        assert found == ir_utils.ops_named(module, *names)


@pytest.mark.parametrize("debug_info", [False, True])
def test_layers_located_alike_are_told_by_their_bytecode(lowered, debug_info):
    """With the tracer's locations a Python loop's layers are located alike, op for op: the plan
    tells so from their bytecode with locations (``Group.located_as_twin``), and their entries
    are then the twin's with no walk of their locations.  Parsed without debug info, each
    layer's ops are located at their own lines: the plan writes each layer without its
    locations only (once it sees the first two apart), and knows none located alike."""
    module = ir_utils.parse(lowered["sequence_parallel"].as_text(debug_info=debug_info))
    with module.context:
        layers = replay.plan(replay._top_level_regions(module))
        assert layers is not None and layers.groups
        for g in layers.groups:
            walked = {replay._body(m) for m in g.members if replay._locations(m) == replay._locations(g.twin)}
            assert g.located_as_twin <= walked  # (the bytes hold block arguments' locations too)
            assert len(g.located_as_twin) == (len(g.members) if debug_info else 0)


def test_a_layer_located_apart_among_layers_located_alike_joins_their_group(lowered, monkeypatch):
    """Where a count's regions write their bytecode with locations two ways, the bodies without
    locations (one per way) tell the groups: a layer located apart from the others (as if its
    bytes differed) is still in their group, but not among those located as the twin."""
    module = ir_utils.parse(lowered["sequence_parallel"].as_text(debug_info=True))
    with module.context:
        regions = replay._top_level_regions(module)
        want = replay.plan(regions)
        members = [[replay._body(m) for m in g.members] for g in want.groups]
        assert all(g.located_as_twin == set(b) for g, b in zip(want.groups, members))
        apart = members[0][2]  # the first group's third region
        located = replay._Fingerprint.located

        def one_apart(self, region):
            written = located(self, region)
            return written + b"apart" if replay._body(region) == apart else written

        monkeypatch.setattr(replay._Fingerprint, "located", one_apart)
        got = replay.plan(regions)
        assert [[replay._body(m) for m in g.members] for g in got.groups] == members
        assert got.groups[0].located_as_twin == set(members[0]) - {apart}
        assert [g.located_as_twin for g in got.groups[1:]] == [set(b) for b in members[1:]]


@pytest.mark.parametrize("model", list(bench.MODELS))
def test_the_walk_leaves_out_only_the_regions_left_for_replay(lowered, model):
    module = ir_utils.parse(lowered[model].as_text())
    names = ("func.call", *ir_utils.CHANNEL_OPS, replay.MANUAL, "stablehlo.while")
    with module.context:
        found, layers = replay.walk(module, names, replayable=True)
        assert layers is not None and layers.deferred
        whole = ir_utils.ops_named(module, *names)
        for name in names:  # the same ops in the same order, less those inside a deferred region
            assert found[name] == [op for op in whole[name] if layers.top_level(op) not in layers.deferred], name
        assert sum(map(len, found.values())) < sum(map(len, whole.values()))


def test_a_region_left_over_is_rewritten_after_the_calls_under_every_variant(monkeypatch):
    """In the FSDP x TP sample two backward regions are one body (a group, were two enough), but
    two of the twin's ops render one location where the copy's render two: the copy is rewritten
    the usual way after replay erased the regions that became calls.  No value the pass caches by
    block or by value from before may reach that rewrite (an erased block's address may be a new
    block's: builders.forget_inside, Variance.forget)."""
    monkeypatch.setattr(replay, "MIN_MEMBERS", 2)
    path = Path(__file__).resolve().parent.parent / "hlo_samples" / "fsdp_tp_grad.mlir"
    text = path.read_text()
    original = ir_utils.parse(text)
    leftover = []
    finish = replay.Plan.finish
    monkeypatch.setattr(replay.Plan, "finish", lambda self, *args: leftover.append(finish(self, *args)) or leftover[-1])
    for name in cost.VARIANTS:
        result = cmatmul_pass.rewrite(text, variant_options(name), source=path.name)
        assert len(leftover.pop()) == 1 and result.report.layers, name
        outcome = execute.check_numerics(original, result.module)
        assert outcome.ok, (name, outcome.format())


def test_a_location_string_is_a_hole_only_where_it_is_whole():
    """A report string naming a location outside the twin whose text starts with one of the
    twin's (``f.py:3:12`` beside ``f.py:3:1``) keeps it: only whole location strings are holes, each
    alternative of the pattern (the longest first) checked against a longer number after it."""
    pattern = replay._location_pattern({"f.py:3:1": [0], "g.py:10:5": [1]})
    entry = cmatmul_pass.report.SiteReport(kind="dot_reduce_scatter", location="f.py:3:1", function="main",
                                           rewritten=True)
    entry.notes = ["reads f.py:3:12 and g.py:10:50, then f.py:3:1 and g.py:10:5"]
    made = replay._template(entry, pattern).make({"f.py:3:1": "h.py:7:2", "g.py:10:5": "h.py:8:4"}.__getitem__)
    assert made.location == "h.py:7:2"
    assert made.notes == ["reads f.py:3:12 and g.py:10:50, then h.py:7:2 and h.py:8:4"]
    assert replay._location_pattern({}) is None


def _layer_functions(module) -> list[str]:
    return [name for f in module.body.operations if f.operation.name == "func.func"
            for name in [ir.StringAttr(f.attributes["sym_name"]).value] if name.startswith(replay.LAYER_PREFIX)]


def test_erasing_an_op_read_twice_by_an_erased_op_touches_it_once():
    """A trim erases the ops only the dropped results need; one such op may read a value twice
    (``multiply %0, %0``) or one op's value may be read by two erased ops.  The op is then met
    twice, and the bindings may hand out two objects for it: the second must be known by the
    address the op had, not read after the first has erased it (it segfaulted)."""
    context = make_context()
    module = ir_utils.parse("""
      func.func @f(%a: tensor<4xf32>) -> (tensor<4xf32>, tensor<4xf32>) {
        %0 = stablehlo.exponential %a : tensor<4xf32>
        %1 = stablehlo.multiply %0, %0 : tensor<4xf32>
        %2 = stablehlo.negate %1 : tensor<4xf32>
        %3 = stablehlo.negate %2 : tensor<4xf32>
        %4 = stablehlo.add %3, %2 : tensor<4xf32>
        %5 = stablehlo.sine %a : tensor<4xf32>
        return %5, %4 : tensor<4xf32>, tensor<4xf32>
      }""", context=context)
    function = module.body.operations[0]
    block = function.regions[0].blocks[0]
    ret = block.operations[len(block.operations) - 1]
    kept, dropped = ret.operands[0], ret.operands[1]
    with context, ir.Location.unknown() as unknown:
        with ir.InsertionPoint(ret):
            ir_utils.function_return([kept], unknown)
        ret.erase()
        function.operation.attributes["function_type"] = ir.TypeAttr.get(
            ir.FunctionType.get([kept.type], [kept.type]))
    erased = []
    gone = replay._erase_unread(function, [dropped], module.body, lambda key, op, read: erased.append(op.name))
    assert sorted(erased) == sorted(["stablehlo.add", "stablehlo.negate", "stablehlo.negate", "stablehlo.multiply",
                                     "stablehlo.exponential"])
    assert len(gone) == 5
    assert module.operation.verify()
    assert [op.operation.name for op in block.operations] == ["stablehlo.sine", "func.return"]


def test_the_first_layers_backward_is_a_trimmed_copy_and_saves_its_sites(monkeypatch):
    """At 4 layers the backward's first layer returns no input gradient: it is the others' region
    without that result and its ops, so it calls a trimmed copy of their rewritten region; its 7
    weight-gradient psums are not matched again (14 matched without it)."""
    from cmatmul_pass import phases
    fn, args = bench.MODELS["sequence_parallel"](4)
    text = fn.lower(*args).as_text()
    matched = []
    match = phases.match_all_reduce
    monkeypatch.setattr(phases, "match_all_reduce", lambda op, info: matched.append(op) or match(op, info))
    trimmed = cmatmul_pass.rewrite(text)
    (name, what), = trimmed.report.trimmed.items()
    assert what["of"] in trimmed.report.layers and name not in trimmed.report.layers
    assert "; 1 more a trimmed copy of one" in trimmed.report.summary()
    assert len(matched) == 7
    with trimmed.module.context:
        assert name[1:] in _layer_functions(trimmed.module)
    matched.clear()
    monkeypatch.setattr(replay, "_trims", lambda *a: None)
    plain = cmatmul_pass.rewrite(text)
    assert len(matched) == 14 and not plain.report.trimmed
    assert [vars(e)["location"] for e in plain.report.sites] == [vars(e)["location"] for e in trimmed.report.sites]


def test_a_region_unlike_the_twin_trimmed_is_not_trimmed(lowered):
    """The backward's first layer with one op changed (a negate of its norm's backward made an
    abs): not the twin trimmed, so rewritten the usual way."""
    text = lowered["sequence_parallel"].as_text()
    regions = text.split("sdy.manual_computation")
    assert "stablehlo.negate" in regions[-1]
    changed = "sdy.manual_computation".join(regions[:-1] + [regions[-1].replace("stablehlo.negate", "stablehlo.abs", 1)])
    assert cmatmul_pass.rewrite(text).report.trimmed
    result = cmatmul_pass.rewrite(changed)
    assert result.report.layers and not result.report.trimmed
    assert execute.check_numerics(ir_utils.parse(changed), result.module).ok


def test_a_trimmed_layer_unlike_its_own_rewrite_is_left_as_rewritten(lowered, monkeypatch):
    """With the check on, the trimmed region is rewritten the usual way too; where that differs
    from the trimmed copy (forced here), it stays as rewritten and the report says it differed."""
    text = lowered["megatron"].as_text()
    context = make_context()
    monkeypatch.setattr(replay, "CHECK", True)
    agrees = replay._Replay.agrees
    monkeypatch.setattr(replay._Replay, "agrees",
                        lambda self, probe, *a: False if probe.name == replay.MANUAL and len(self.group.members) == 1
                        and self.twin.parent.name == "func.func" else agrees(self, probe, *a))
    result = cmatmul_pass.rewrite(text, context=context)
    assert not result.report.trimmed
    assert [(c["agreed"], c.get("trimmed", False)) for c in result.report.layer_checks] == [(True, False), (True, False),
                                                                                          (False, True)]
    assert "1 trimmed layer(s) checked against a rewrite of their own, 1 differed" in result.report.summary()
    with context:
        assert len(_layer_functions(result.module)) == 2  # the groups' functions: the trimmed one erased
    plain = _without_replay(text, context)
    got, want = _compare(result, plain, context)
    assert got[0] == want[0] and got[2] == want[2]


def test_only_pure_ops_are_erased_for_being_unread():
    """What trimming may drop: StableHLO ops (collectives too), calls of functions of such ops; not
    a custom call, nor a call of a function holding one."""
    module = ir_utils.parse("""
      func.func private @effect(%x: tensor<2xf32>) -> tensor<2xf32> {
        %0 = stablehlo.custom_call @host_callback(%x) {has_side_effect = true} : (tensor<2xf32>) -> tensor<2xf32>
        return %0 : tensor<2xf32>
      }
      func.func private @plain(%x: tensor<2xf32>) -> tensor<2xf32> {
        %0 = stablehlo.add %x, %x : tensor<2xf32>
        return %0 : tensor<2xf32>
      }
      func.func @main(%x: tensor<2xf32>) -> tensor<2xf32> {
        %0 = func.call @effect(%x) : (tensor<2xf32>) -> tensor<2xf32>
        %1 = func.call @plain(%x) : (tensor<2xf32>) -> tensor<2xf32>
        %2 = stablehlo.custom_call @host_callback(%x) {has_side_effect = true} : (tensor<2xf32>) -> tensor<2xf32>
        %3 = "stablehlo.all_reduce"(%x) ({
        ^bb0(%a: tensor<f32>, %b: tensor<f32>):
          %s = stablehlo.add %a, %b : tensor<f32>
          stablehlo.return %s : tensor<f32>
        }) {replica_groups = dense<[[0, 1]]> : tensor<1x2xi64>} : (tensor<2xf32>) -> tensor<2xf32>
        return %x : tensor<2xf32>
      }""")
    with module.context:
        main = module.body.operations[2]
        ops = [op.operation for op in main.regions[0].blocks[0].operations]
        assert [replay._pure(op, module.body, {}) for op in ops[:4]] == [False, True, False, True]


_GATHERED = """
module {
  sdy.mesh @mesh = <["x"=2]>
  func.func @main(%a: tensor<4x2xf32>, %w: tensor<2x2xf32>) -> (tensor<4x2xf32>, tensor<2x4xf32>) {
    %0:2 = sdy.manual_computation(%a, %w) in_shardings=[<@mesh, [{"x"}, {}]>, <@mesh, [{}, {}]>]
        out_shardings=[<@mesh, [{}, {}]>, <@mesh, [{}, {}]>] manual_axes={"x"}
        (%x: tensor<2x2xf32>, %v: tensor<2x2xf32>) {
      %g = "stablehlo.all_gather"(%x) {all_gather_dim = 0 : i64, replica_groups = dense<[[0, 1]]> : tensor<1x2xi64>}
          : (tensor<2x2xf32>) -> tensor<4x2xf32>
      %d = stablehlo.dot_general %g, %v, contracting_dims = [1] x [0] : (tensor<4x2xf32>, tensor<2x2xf32>) -> tensor<4x2xf32>
      %r = stablehlo.reshape READ : (tensor<4x2xf32>) -> tensor<4x2xf32>
      %t = stablehlo.transpose %r, dims = [1, 0] : (tensor<4x2xf32>) -> tensor<2x4xf32>
      sdy.return %d, %t : tensor<4x2xf32>, tensor<2x4xf32>
    } : (tensor<4x2xf32>, tensor<2x2xf32>) -> (tensor<4x2xf32>, tensor<2x4xf32>)
    return %0#0, %0#1 : tensor<4x2xf32>, tensor<2x4xf32>
  }
}"""


@pytest.mark.parametrize("read, reads_gather", [("%g", True), ("%d", False)])
def test_a_region_lacking_a_reader_of_a_gathered_value_is_not_trimmed(read, reads_gather):
    """Trimmed of its second result, the region lacks the transpose and the reshape it reads; where
    that reshape reads a gathered value the trimmed region holds, the twin's ring would assemble it
    for them: not trimmed.  Reading the dot's result instead is fine."""
    module = ir_utils.parse(_GATHERED.replace("READ", read))
    with module.context:
        (region,) = replay._top_level_regions(module)
        _, arguments, erased = replay._Fingerprint(module.context).trimmed(region, [0])
        assert erased.reads_a_gather is reads_gather
        assert erased.positions == {3, 4} and arguments == [0, 1]  # (the region 0, gather 1, dot 2)
        assert erased.lacked == {("stablehlo.all_gather", region.regions[0].blocks[0].operations[0].location.attr,
                                  region.regions[0].blocks[0].operations[0].results[0].type): False}


@pytest.mark.parametrize("code, refused", [("multiple_users", True), ("user_not_dot", True),
                                           ("producer_not_dot", False), ("policy", False)])
def test_a_twin_site_declined_for_its_readers_refuses_the_trim(code, refused):
    """A site of the twin declined for what reads it (which the trimmed region may lack) would have
    been rewritten in that region: the trim is refused.  A decline read off the site's own ops and
    what computes them stands in both."""
    from cmatmul_pass.report import SiteReport

    entry = SiteReport(kind="dot_all_reduce", location="f.py:1:1", function="main", rewritten=False)
    entry.reason_code = code
    assert replay._reads_around(entry) is refused
    entry.rewritten, entry.reason_code = True, ""
    assert replay._reads_around(entry) is False
    entry.moved_from = "layout"  # moved to its matmul past the ops before it (which the region may lack)
    assert replay._reads_around(entry) is True
