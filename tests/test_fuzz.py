"""Differential fuzzing, the fixed-seed slice CI runs (``make fuzz`` runs the full campaign).

Random shard_map programs — meshes of 2 to 8 devices in 1-3 dims over permuted devices, collectives
over one or two axes, gathered/scattered dims free, contracting or batch, either operand side,
tiled/untiled, f32/bf16/f16/f64/complex64/int32, several consumers and non-dot readers, chains,
SP MLP blocks, matmuls of two gathered operands, partial-manual regions — each rewritten under
every pass variant: the result must verify, its permutes must form the groups' rings, every site
must be rewritten (but for the declines a kind allows), and it must compute the original's numbers.
Fixed programs pin shapes the oracle must pass, and the targeted kinds' shapes (norms' backwards before a
scatter or psum; a norm of gathered rows whose raw rows are read elsewhere, ``--gather-norm``).
"""

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings

import cmatmul_pass
from tools import fuzz_programs


@settings(max_examples=16, derandomize=True, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(fuzz_programs.specs())
def test_random_programs_under_every_variant(spec):
    tally = fuzz_programs.check(spec)
    assert not tally.crashes, tally.crashes
    assert not tally.mismatches, tally.mismatches
    assert tally.runs == len(fuzz_programs.VARIANTS)


def test_a_chained_training_step_trims_its_first_layers_backward(monkeypatch):
    """SP MLP layers called in a row under ``value_and_grad`` over the weights (``Spec.chained``):
    the layers become calls of one rewritten forward and one rewritten backward, and the first
    layer's backward, which returns no input gradient, a call of a trimmed copy (replay.Trim).
    With ``replay.CHECK`` each group's last region and the trimmed one are rewritten the usual
    way too and must come out as the calls do; every variant computes the original's numbers."""
    from cmatmul_pass import replay

    monkeypatch.setattr(replay, "CHECK", True)
    spec = fuzz_programs.Spec(mesh_shape=(2, 4), devices=(3, 1, 0, 2, 7, 5, 4, 6), axes=("y",), kind="mlp", dim="m",
                              side=0, batch=False, tiled=True, dtype="f32", consumers=1, reader=False,
                              partial_manual=False, sizes=(2, 3, 2, 1), repeat=4, grad=True, chained=True)
    tally = fuzz_programs.check(spec)
    assert not tally.crashes and not tally.mismatches and not tally.differed, (tally.crashes, tally.mismatches)
    assert tally.trimmed > 0 and tally.layer_calls > 0 and tally.layer_checks > 0


def test_the_oracle_catches_a_miscompile(monkeypatch):
    """A ring sent the wrong way is reported as a mismatch, not passed."""
    from cmatmul_pass.rewrites import all_gather_dot

    monkeypatch.setattr(all_gather_dot, "RECEIVE_FROM_NEXT", +1)
    spec = fuzz_programs.Spec(mesh_shape=(4,), devices=(0, 1, 2, 3), axes=("x",), kind="ag", dim="m", side=0,
                              batch=False, tiled=True, dtype="f32", consumers=1, reader=False,
                              partial_manual=False, sizes=(2, 2, 2, 1))
    tally = fuzz_programs.check(spec, variants={"uni": fuzz_programs.VARIANTS["uni"]})
    assert len(tally.mismatches) == 1


def test_a_reordered_f16_sum_is_not_a_mismatch():
    """Found by the campaign of seed 129: two products summed in f16 and scattered over 4
    devices; the ring adds the partial sums in another order than the collective, and the
    results differ by 2.4e-3 (normwise), above f16's own 2e-3.  The check widens a module's
    float tolerance when it sums 16-bit floats across devices (execute.reduction_tolerance)."""
    spec = fuzz_programs.Spec(mesh_shape=(4,), devices=(5, 0, 4, 7), axes=("x",), kind="rs", dim="n", side=1,
                              batch=False, tiled=True, dtype="f16", consumers=2, reader=False,
                              partial_manual=False, sizes=(1, 4, 1, 4), repeat=2)
    tally = fuzz_programs.check(spec, variants={"uni": fuzz_programs.VARIANTS["uni"]})
    assert not tally.crashes and not tally.mismatches and tally.sites_rewritten == 2


def test_weights_prepared_where_used_keep_every_dot_in_the_ring(monkeypatch):
    """Three dots of one gathered value, each weight scaled just before its dot: the ring computes
    all three by moving the scaling up; with the moves forbidden, the oracle says a dot was left out."""
    from cmatmul_pass.matchers import all_gather

    spec = fuzz_programs.Spec(mesh_shape=(2, 4), devices=(3, 1, 0, 2, 7, 5, 4, 6), axes=("y",), kind="ag", dim="m",
                              side=1, batch=False, tiled=True, dtype="bf16", consumers=3, reader=True,
                              partial_manual=False, sizes=(2, 3, 2, 1), repeat=2, prep=True)
    uni = {"uni": fuzz_programs.VARIANTS["uni"]}
    tally = fuzz_programs.check(spec, variants=uni)
    assert not tally.crashes and not tally.mismatches and tally.sites_rewritten == 2
    monkeypatch.setattr(all_gather, "HOIST_LIMIT", 0)
    tally = fuzz_programs.check(spec, variants=uni)
    assert [crash[2] for crash in tally.crashes][0].startswith("AssertionError: a dot left out of its ring")


def test_weights_prepared_in_a_partial_manual_region_move_with_their_constraints():
    """Found by the campaign of seed 134: in a partial-manual region every op's result passes a
    sdy.sharding_constraint, so a weight scaled where it is used is a chain of constraints and
    scalings; the ring took the dot only once the constraints could move up with them."""
    spec = fuzz_programs.Spec(mesh_shape=(4, 2), devices=(3, 0, 4, 6, 5, 2, 1, 7), axes=("x",), kind="ag", dim="m",
                              side=1, batch=False, tiled=True, dtype="f16", consumers=1, reader=True,
                              partial_manual=True, sizes=(4, 3, 3, 3), repeat=1, prep=True, scale=True)
    tally = fuzz_programs.check(spec, variants={"uni": fuzz_programs.VARIANTS["uni"]})
    assert not tally.crashes and not tally.mismatches and tally.sites_rewritten == 1


def test_megatron_blocks_with_row_wise_ops_between_them():
    """Three psum-after-matmul blocks, rows split over a ring of 4: a residual add, an RMS norm, a
    per-device factor (which stops the carried rows: the gather goes before it) and a layer norm
    between them; every site is rewritten in every variant, chunked too, and matches."""
    spec = fuzz_programs.Spec(mesh_shape=(2, 4), devices=(3, 1, 0, 2, 7, 5, 4, 6), axes=("y",), kind="psum", dim="m",
                              side=0, batch=False, tiled=True, dtype="f32", consumers=3, reader=False,
                              partial_manual=False, sizes=(2, 3, 2, 1), between=("residual", "rms", "vary", "ln"))
    tally = fuzz_programs.check(spec)
    assert not tally.crashes and not tally.mismatches, tally.crashes + tally.mismatches
    assert tally.runs == len(fuzz_programs.VARIANTS) and tally.sites_rewritten >= 3 * len(fuzz_programs.VARIANTS)
    assert not tally.declined  # the rows (8) cut into 2, 4 or 8 chunks: chunk declines nothing either


def test_the_oracle_catches_rows_carried_past_a_per_device_factor(monkeypatch):
    """With the variance analysis told that every value is the same on every device, the split
    carries the rows past the per-device factor (device k's rows scaled by k's factor): a mismatch."""
    from cmatmul_pass.analysis import variance

    monkeypatch.setattr(variance.Variance, "identical", lambda self, value, ring: True)
    spec = fuzz_programs.Spec(mesh_shape=(4,), devices=(0, 1, 2, 3), axes=("x",), kind="psum", dim="m", side=0,
                              batch=False, tiled=True, dtype="f32", consumers=2, reader=False, partial_manual=False,
                              sizes=(2, 3, 2, 1), between=("vary",))
    tally = fuzz_programs.check(spec, variants={"uni": fuzz_programs.VARIANTS["uni"]})
    assert len(tally.mismatches) == 1


#: psum programs with an RMS norm's backward between each block's product and its psum (the DAG
#: reading the product twice), as value_and_grad of a pre-norm Megatron block puts it there
NORM_PSUMS = {
    # f32, two blocks on a ring of 4 in a 2-D mesh, called twice (the second call's rings shared):
    # the residual's cotangent added (affine), each gain's gradient returned, row-wise ops between
    "f32-cotangent-gain": fuzz_programs.Spec(
        mesh_shape=(2, 4), devices=(3, 1, 0, 2, 7, 5, 4, 6), axes=("y",), kind="psum", dim="m", side=0, batch=False,
        tiled=True, dtype="f32", consumers=2, reader=False, partial_manual=False, sizes=(2, 3, 2, 1), repeat=2,
        between=("residual", "rms"), norm=True, cotangent=True, gain=True),
    # f16 over two mesh axes at once (a ring of 4 of a 2x2x2 mesh) in a partially manual region
    # (sharding constraints on the path), three blocks, the gain frozen, a per-device factor between
    "f16-two-axes-partial-manual": fuzz_programs.Spec(
        mesh_shape=(2, 2, 2), devices=(6, 2, 7, 0, 4, 1, 5, 3), axes=("z", "x"), kind="psum", dim="m", side=1,
        batch=False, tiled=True, dtype="f16", consumers=3, reader=False, partial_manual=True, sizes=(3, 2, 4, 1),
        between=("vary", "ln"), norm=True, cotangent=True, gain=False),
    # found by the campaign of seed 307 (every split variant crashed with a KeyError in
    # sequence_parallel._build): carried forward, the first block's rows would be gathered twice,
    # in bf16 for the next block's dot and, through the cotangent's convert, in f32 for the second
    # psum's ring: more bytes than that psum moved, so its gather stays after its ring (dropped
    # from the plan) while the second block's is carried to the return; the dropped one's readers
    # were still handed to the build
    "bf16-cotangent-over-budget": fuzz_programs.Spec(
        mesh_shape=(2, 4), devices=(2, 0, 3, 6, 1, 7, 4, 5), axes=("y",), kind="psum", dim="m", side=1, batch=False,
        tiled=False, dtype="bf16", consumers=2, reader=False, partial_manual=False, sizes=(2, 1, 3, 2),
        between=("bias",), norm=True, cotangent=True, gain=False),
}


@pytest.mark.parametrize("name", sorted(NORM_PSUMS))
def test_a_norm_backward_before_the_psum_is_rewritten_and_matches(name):
    """Every block's psum rewritten under every variant (split's rings and chunk's row chunks), each
    result the original's numbers."""
    spec = NORM_PSUMS[name]
    tally = fuzz_programs.check(spec)
    assert not tally.crashes and not tally.mismatches, tally.crashes + tally.mismatches
    assert tally.runs == len(fuzz_programs.VARIANTS)
    # every block's psum of every call, in every variant but the one that skips the check (noassemble)
    assert tally.sites_rewritten >= spec.consumers * spec.repeat * (len(fuzz_programs.VARIANTS) - 1)
    assert set(tally.declined) <= {"multiple_users"}, tally.declined  # noassemble's gathers only


def test_a_norm_backward_before_a_psum_of_rows_that_do_not_divide_stays_a_psum():
    """Rows (9) no ring of 4 divides and a norm over the features (which the split cannot cut
    either): every psum is declined no_dim, unchanged, and the program still matches."""
    spec = replace(NORM_PSUMS["f32-cotangent-gain"], dim="k", repeat=1)
    tally = fuzz_programs.check(spec)
    assert not tally.crashes and not tally.mismatches, tally.crashes + tally.mismatches
    assert tally.sites_rewritten == 0 and set(tally.declined) == {"no_dim"}


def test_the_oracle_catches_a_norm_backward_psum_reading_a_wrong_normed_block(monkeypatch):
    """With each block's (chunk's) rows of the norm's input read doubled, split and chunk each
    report a mismatch: the fixed programs above fail if the psum path miscompiles."""
    from cmatmul_pass.rewrites import dot_all_reduce, dot_reduce_scatter

    original = dot_reduce_scatter.path_block

    def wrong(site, products, parts, block_of_sliced, add):
        return original(site, products, parts, lambda v, d, w: (lambda x: add(x, x))(block_of_sliced(v, d, w)), add)

    monkeypatch.setattr(dot_reduce_scatter, "path_block", wrong)
    monkeypatch.setattr(dot_all_reduce, "path_block", wrong)
    spec = replace(NORM_PSUMS["f32-cotangent-gain"], repeat=1)
    variants = {name: fuzz_programs.VARIANTS[name] for name in ("uni", "chunk")}
    tally = fuzz_programs.check(spec, variants=variants)
    assert not tally.crashes and [m[1] for m in tally.mismatches] == ["uni", "chunk"], tally.crashes


def _ag_norm(**kw):
    """An ag_norm program (tools/fuzz_programs.py, ``fuzz.py --gather-norm``): rows gathered,
    normalised over the hidden dim into their dots, the raw rows read elsewhere too."""
    base = dict(mesh_shape=(4,), devices=(2, 0, 3, 1), axes=("x",), kind="ag_norm", dim="m", side=0, batch=False,
                tiled=True, dtype="f32", consumers=1, reader=False, partial_manual=False, sizes=(2, 3, 2, 1),
                norm_kind="rms", raw="return")
    return fuzz_programs.Spec(**{**base, **kw})


#: gathers whose rows reach their dots through a norm while the raw rows are read elsewhere (the
#: ring applies the norm per block and assembles the raw rows), or whose move past the norm is
#: refused (the ring applies it alone; docs/patterns.md)
GATHER_NORMS = {
    # a data x model mesh (the batch sharded over x, the rows gathered over y), a layer norm with a
    # per-device gain and a bias, gate and up projections, the raw rows added after them; called twice
    "f32-ln-gate-residual-data-model": _ag_norm(
        mesh_shape=(2, 4), devices=(3, 1, 0, 2, 7, 5, 4, 6), axes=("y",), batch=True, data=True, consumers=2,
        sizes=(2, 4, 2, 2), repeat=2, norm_kind="ln", gain_mode="dev", bias=True, raw="residual"),
    # bf16 rows gathered along the batch dim (dim 0 of [b, m, k]) on a ring of 5, normalised in f32
    # with a replicated gain, the raw rows returned
    "bf16-rms-batch-dim-upcast": _ag_norm(
        mesh_shape=(5,), devices=(4, 1, 0, 3, 2), dim="b", batch=True, dtype="bf16", sizes=(3, 4, 2, 2),
        gain_mode="rep", upcast=True),
    # f16 in a partially manual region of a 4x2 mesh (sharding constraints on the path), gate and up
    "f16-rms-gate-partial-manual": _ag_norm(
        mesh_shape=(4, 2), devices=(6, 2, 7, 0, 4, 1, 5, 3), axes=("y",), partial_manual=True, dtype="f16",
        consumers=2, sizes=(3, 4, 3, 1)),
    # nothing but the norm reads the rows, and each device has its own gain, which may not move
    # onto the rows: the move is refused and the ring applies the norm on its own, assembling
    # nothing (so under --no-assemble too)
    "f32-rms-device-gain-alone": _ag_norm(gain_mode="dev", raw="none", consumers=2, sizes=(2, 4, 2, 1)),
}
#: the features gathered and the norm over them (its sums moved as partial sums and an all_reduce),
#: on a ring of 8 with 4 features a device: a layer norm with a replicated gain and a bias into gate
#: and up projections; an RMS norm of bf16 values in f32 over a batch
FEATURE_NORMS = {
    "f32-ln-features-gate": _ag_norm(
        mesh_shape=(8,), devices=(5, 2, 7, 0, 3, 6, 1, 4), dim="k", consumers=2, sizes=(3, 4, 2, 1), norm_kind="ln",
        gain_mode="rep", bias=True, raw="none"),
    "bf16-rms-features-upcast": _ag_norm(
        mesh_shape=(8,), devices=(1, 3, 5, 7, 0, 2, 4, 6), dim="k", batch=True, dtype="bf16", upcast=True,
        sizes=(2, 4, 2, 2), gain_mode="rep", raw="none"),
}


#: the features gathered and normed over while the raw rows are read elsewhere too (returned, added
#: after the dots) or the gain is each device's own: the norm's sums computed from the shards first,
#: the ring applies the rest of the norm per block and assembles the raw rows
FEATURE_NORMS_RINGED = {
    "f32-rms-features-return": _ag_norm(
        mesh_shape=(8,), devices=(5, 2, 7, 0, 3, 6, 1, 4), dim="k", sizes=(3, 4, 2, 1), gain_mode="rep"),
    "f32-ln-features-device-gain-residual": _ag_norm(
        mesh_shape=(8,), devices=(1, 3, 5, 7, 0, 2, 4, 6), dim="k", consumers=2, sizes=(3, 4, 2, 1), norm_kind="ln",
        gain_mode="dev", bias=True, raw="residual"),
    "bf16-rms-features-upcast-return": _ag_norm(
        mesh_shape=(8,), devices=(1, 3, 5, 7, 0, 2, 4, 6), dim="k", batch=True, dtype="bf16", upcast=True,
        sizes=(2, 4, 2, 2), gain_mode="rep"),
}


@pytest.mark.parametrize("name", sorted(FEATURE_NORMS_RINGED))
def test_a_norm_over_the_gathered_features_read_elsewhere_rings_and_matches(name):
    """Rewritten in every variant that assembles (not under --no-assemble: the raw rows are read
    elsewhere), each result the original's numbers."""
    tally = fuzz_programs.check(FEATURE_NORMS_RINGED[name])
    assert not tally.crashes and not tally.mismatches, tally.crashes + tally.mismatches
    assert tally.sites_rewritten == len(fuzz_programs.VARIANTS) - 1


@pytest.mark.parametrize("name", sorted(GATHER_NORMS))
def test_a_norm_of_the_gathered_rows_rings_and_matches(name):
    """Every gather rewritten with every dot through the norm in its ring, under every variant that
    assembles (the oracle asserts it), each result the original's numbers."""
    spec = GATHER_NORMS[name]
    tally = fuzz_programs.check(spec)
    assert not tally.crashes and not tally.mismatches, tally.crashes + tally.mismatches
    assert tally.runs == len(fuzz_programs.VARIANTS)
    assert tally.sites_rewritten >= spec.repeat * (len(fuzz_programs.VARIANTS) - 1)


@pytest.mark.parametrize("name", sorted(FEATURE_NORMS))
def test_a_norm_over_the_gathered_features_moves_and_matches(name):
    """The gather moved past the norm over the features it gathers, in every variant (under
    --no-assemble too: nothing is assembled), each result the original's numbers."""
    spec = FEATURE_NORMS[name]
    assert spec.expect_rewrite()
    tally = fuzz_programs.check(spec)
    assert not tally.crashes and not tally.mismatches, tally.crashes + tally.mismatches
    assert tally.sites_rewritten == len(fuzz_programs.VARIANTS)


@pytest.mark.parametrize("mixing", ["mean_rows", "cumsum"])
def test_a_chain_mixing_the_gathered_rows_stays_declined(mixing):
    """The norm's statistic over the gathered dim, or a cumulative sum over the gathered rows: the
    ring cannot apply them per block; the gather is declined (unchanged) in every variant and the
    program still matches."""
    spec = replace(GATHER_NORMS["f32-ln-gate-residual-data-model"], norm_kind=mixing, repeat=1)
    assert not spec.expect_rewrite()
    tally = fuzz_programs.check(spec)
    assert not tally.crashes and not tally.mismatches, tally.crashes + tally.mismatches
    assert tally.sites_rewritten == 0 and tally.declined, tally.declined


@pytest.mark.parametrize("partial_manual", [False, True])
def test_an_untiled_gather_of_normalised_rows_rings(partial_manual):
    """Found by the first gather-norm run (seed 1, 6 programs: every untiled program declined
    'layout', unchanged, no miscompile): an untiled gather lowers to a gather on a new dim and a reshape merging it into
    the rows (then, in a partially manual region, a sharding constraint); the norm and the other
    reader share the reshape, not the gather, so the DAG ring, which looked for raw rows read
    straight from the gather, was not tried.  The reshape and the constraint count as the raw rows
    now: rewritten under every variant that assembles, and the program matches."""
    spec = _ag_norm(tiled=False, dtype="f16", consumers=2, raw="residual", sizes=(2, 4, 2, 1))
    if partial_manual:
        spec = replace(spec, mesh_shape=(2, 4), devices=(3, 1, 0, 2, 7, 5, 4, 6), axes=("y",), partial_manual=True)
    tally = fuzz_programs.check(spec)
    assert not tally.crashes and not tally.mismatches, tally.crashes + tally.mismatches
    assert tally.sites_rewritten == len(fuzz_programs.VARIANTS) - 1  # all but noassemble
    assert set(tally.declined) == {"layout"}  # noassemble: the raw rows cannot be assembled


#: scatters of a product padded with zero rows along the scattered dim (fuzz.py --pad): the rows
#: of the lhs on a ring of 8, both ends padded; the columns of a bf16 rhs in a partial-manual
#: region of a 3 x 2 mesh (its sharding hints around jnp.pad's call); a complex product (declined);
#: and gathers cropped before their dots
PADDED = {
    "f32-rows-both-ends": fuzz_programs.Spec(
        mesh_shape=(8,), devices=(5, 2, 7, 0, 3, 6, 1, 4), axes=("x",), kind="rs", dim="m", side=0, batch=False,
        tiled=True, dtype="f32", consumers=1, reader=False, partial_manual=False, sizes=(2, 3, 2, 1), pad=(3, 2)),
    "bf16-columns-partial-manual": fuzz_programs.Spec(
        mesh_shape=(3, 2), devices=(5, 6, 0, 1, 3, 2), axes=("y",), kind="rs", dim="n", side=1, batch=True,
        tiled=True, dtype="bf16", consumers=1, reader=False, partial_manual=True, sizes=(3, 1, 2, 2), pad=(0, 3)),
    "c64-rows": fuzz_programs.Spec(
        mesh_shape=(4,), devices=(0, 1, 2, 3), axes=("x",), kind="rs", dim="m", side=0, batch=False,
        tiled=True, dtype="c64", consumers=1, reader=False, partial_manual=False, sizes=(2, 2, 2, 1), pad=(0, 1)),
    # the backward's form: gathered rows cropped before the dots, contracted (two weights) or free
    "f32-crop-contracted": fuzz_programs.Spec(
        mesh_shape=(8,), devices=(1, 3, 5, 7, 0, 2, 4, 6), axes=("x",), kind="ag", dim="k", side=1, batch=True,
        tiled=True, dtype="f32", consumers=2, reader=False, partial_manual=False, sizes=(2, 3, 2, 2), crop=(5, 2)),
    "i32-crop-free-partial-manual": fuzz_programs.Spec(
        mesh_shape=(2, 4), devices=(3, 1, 0, 2, 7, 5, 4, 6), axes=("y",), kind="ag", dim="m", side=0, batch=False,
        tiled=True, dtype="i32", consumers=1, reader=False, partial_manual=True, sizes=(3, 2, 2, 1), crop=(0, 4)),
}


def test_an_unpermuted_psum_splits_along_the_features_and_matches():
    """Two Megatron blocks whose rows (9) do not divide the ring of 4, each product un-permuted into
    another row order (a scatter-add) before its psum: split (or chunked) along the features in
    every variant, each result the original's numbers."""
    spec = fuzz_programs.Spec(mesh_shape=(2, 4), devices=(3, 1, 0, 2, 7, 5, 4, 6), axes=("y",), kind="psum", dim="k",
                              side=0, batch=False, tiled=True, dtype="f32", consumers=2, reader=False,
                              partial_manual=False, sizes=(2, 3, 2, 1), between=("residual",), unpermute=True)
    tally = fuzz_programs.check(spec)
    assert not tally.crashes and not tally.mismatches, tally.crashes + tally.mismatches
    assert tally.sites_rewritten >= 2 * (len(fuzz_programs.VARIANTS) - 1), tally.summary()


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_a_scatter_along_a_prefetchable_weight_gathers_dim_rings_and_matches(dtype):
    """FSDP x TP: the product scattered over the activation axis along the dim its weight is
    gathered on over the other axis, a dot before it: the scatter rings in every variant, the
    weight's gather stays plain (prefetchable), each result the original's numbers."""
    spec = fuzz_programs.Spec(mesh_shape=(2, 4), devices=(3, 1, 0, 2, 7, 5, 4, 6), axes=("y",), kind="fsdp", dim="n",
                              side=0, batch=False, tiled=True, dtype=dtype, consumers=1, reader=False,
                              partial_manual=False, sizes=(2, 3, 2, 1), scatter=True)
    tally = fuzz_programs.check(spec)
    assert not tally.crashes and not tally.mismatches, tally.crashes + tally.mismatches
    assert tally.sites_rewritten == tally.runs == len(fuzz_programs.VARIANTS)
    assert set(tally.declined) == {"prefetchable"}, tally.declined


@pytest.mark.parametrize("name", sorted(PADDED))
def test_a_padded_product_scatters_in_a_ring_and_matches(name):
    """The padding moved onto the dot's operand (the crop past the dots) and the collective ringed in
    every variant (a complex product's padding is not moved: declined in each), each result the
    original's numbers."""
    spec = PADDED[name]
    tally = fuzz_programs.check(spec)
    assert not tally.crashes and not tally.mismatches, tally.crashes + tally.mismatches
    if spec.expect_rewrite():
        assert tally.sites_rewritten == tally.runs == len(fuzz_programs.VARIANTS)
    else:
        assert tally.sites_rewritten == 0 and set(tally.declined) == {"producer_not_dot"}


@settings(max_examples=40, derandomize=True, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(fuzz_programs.specs())
def test_the_default_campaign_draws_no_gather_norm_programs(spec):
    """ag_norm programs are drawn only when named (--gather-norm): a seed's default programs are
    the ones it drew before they existed."""
    assert spec.kind != "ag_norm" and not spec.norm_kind


def test_the_oracle_catches_a_norm_ring_sent_the_wrong_way(monkeypatch):
    """A gather-norm ring receiving from the wrong neighbour (each block normalised and multiplied
    at another block's rows) is reported as a mismatch: the fixed programs above fail if it miscompiles."""
    from cmatmul_pass.rewrites import all_gather_dot

    monkeypatch.setattr(all_gather_dot, "RECEIVE_FROM_NEXT", +1)
    tally = fuzz_programs.check(GATHER_NORMS["f32-ln-gate-residual-data-model"],
                                variants={"uni": fuzz_programs.VARIANTS["uni"]})
    assert len(tally.mismatches) == 1, tally.crashes


def test_a_decline_through_a_dot_does_not_call_it_a_norms_statistic():
    """Under --no-assemble the untiled gather of normalised rows stays declined 'layout'; its
    reason names what the residual add's other operand is computed through, the dot's product,
    not "a statistic of each row, as a norm's" (which the message said of any non-elementwise op)."""
    spec = _ag_norm(tiled=False, dtype="f16", consumers=2, raw="residual", sizes=(2, 4, 2, 1))
    result = cmatmul_pass.rewrite(fuzz_programs.lower(spec), cmatmul_pass.Options(assemble=False))
    (site,) = [s for s in result.report.sites if s.kind == "all_gather_dot"]
    assert not site.rewritten and site.reason_code == "layout"
    assert "through stablehlo.dot_general" in site.reason and "a matmul's product of it" in site.reason
    assert "a statistic of each row" not in site.reason
