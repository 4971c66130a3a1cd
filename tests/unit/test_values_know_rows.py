"""Values know their rows: what the intervention vocabulary writes over a batch's rows is written by
sample, never by row number.

`record`'s values and a `Mask` carry the samples of their rows (`countlens.circuits.sites.positions`:
`with_samples`, `sample_key`, `row_index`), so a `Patch` under `intervene` writes each forward's row
from its own sample's row at any batch size and order, proven here against each sample patched alone by
a plain torch hook; a forward of other samples, or a plain tensor of other rows, is refused. The same
door checks the rest of the vocabulary before any forward: sites against the model (one `check` behind
record, mean_difference, effect and intervene), site and `Objects` constructors, mapping labels that
collide once written as the ``intervention`` coordinate, an `Apply` whose function returns NaN or ±inf,
and the fix named for samples without an object list.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from tolerance import assert_close

from countlens.analysis import score
from countlens.circuits import (
    Apply,
    HeadZ,
    Mask,
    MlpOut,
    Objects,
    Patch,
    Q,
    Residual,
    Zero,
    effect,
    intervene,
    mean_difference,
    record,
)
from countlens.circuits.engine.pair_batch import prepare_pairs
from countlens.circuits.objects.effects import object_effects
from countlens.circuits.sites import Expert, ImageStates, Pattern, group_mask
from countlens.datasets import task_samples
from countlens.datasets.pairs import count_pairs
from countlens.errors import CountlensError, InputError


@pytest.fixture(scope="module")
def toy(loaded):
    return loaded("toy")


@pytest.fixture(scope="module")
def scenes():
    return task_samples("count", 6, seed=7)


@pytest.fixture(scope="module")
def pairs(toy):
    return count_pairs(4, 3, 5, kind="shapes", grid=toy.geometry, prompt="short", seed=11)


def _forwards(vlm):
    calls = []
    return calls, vlm.hf.register_forward_pre_hook(lambda m, a: calls.append(1))


def _patched_alone(vlm, sample) -> float:
    """p_gold of ``sample`` scored alone, its image tokens' embeddings replaced by its own residual
    after layer 2: plain HF forwards and one plain torch hook, no countlens row logic."""
    batch = vlm.prepare_samples([sample], answers=True, single_token=True)
    with torch.no_grad():
        late = vlm.hf(**batch.inputs, output_hidden_states=True).hidden_states[3]  # after layer 2
    pos = batch.image_pos[0]

    def pre(module, args, kwargs):
        x = (args[0] if args else kwargs["hidden_states"]).clone()
        x[0, pos] = late[0, pos].to(x.dtype)
        return ((x, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": x})

    handle = vlm.hf.get_submodule(vlm.arch.layer(0)).register_forward_pre_hook(pre, with_kwargs=True)
    try:
        with torch.no_grad():
            logits = vlm.hf(**batch.inputs, use_cache=False).logits[0, -1].float()
    finally:
        handle.remove()
    return float(logits.softmax(-1)[batch.answer_token[0]])


def test_back_patching_is_aligned_by_sample_at_any_batch_size_and_order(toy, scenes):
    late = record(toy, toy.prepare_samples(scenes), [Residual(2)])[Residual(2)]  # one batch, in order
    order = [4, 1, 5, 0, 3, 2]
    shuffled = [scenes[i] for i in order]
    with intervene(toy, Patch(Residual(-1), positions="image", values=late)):
        got = score(toy, shuffled, batch_size=4)  # chunks of 4 and 2, neither the recorded batch
    expected = np.array([_patched_alone(toy, s) for s in shuffled])
    assert_close(got.p_gold.values, expected, what="back-patched p_gold vs each sample patched alone")
    unpatched = score(toy, shuffled, batch_size=4).p_gold.values
    assert np.abs(unpatched - expected).max() > 0.05  # the patch changes the answers: the check has teeth


def test_values_of_other_samples_or_rows_are_refused_or_named(toy, scenes, pairs):
    late = record(toy, toy.prepare_samples(scenes), [Residual(2)])[Residual(2)]
    others = task_samples("count", 2, seed=8)
    with intervene(toy, Patch(Residual(-1), positions="image", values=late)):
        calls, handle = _forwards(toy)  # a hook after intervene's own: it runs only if intervene lets the forward on
        try:
            with pytest.raises(InputError, match="made from other samples.*into=samples"):
                score(toy, others)
        finally:
            handle.remove()
    assert not calls  # refused before the model ran
    # A plain tensor (no samples) of 6 rows written into forwards of 4 and 2 rows: refused, never modulo.
    with intervene(toy, Patch(Residual(-1), positions="image", values=late.clone())):
        calls, handle = _forwards(toy)
        try:
            with pytest.raises(InputError, match="hold 6 rows, without their samples, and this forward 4"):
                score(toy, scenes, batch_size=4)
        finally:
            handle.remove()
    assert not calls  # refused before the model ran
    # Two rows named for one sample leave no rule for which one its forward takes: refused.
    with pytest.raises(InputError, match="one sample for rows 0 and 1"):
        Patch(Residual(-1), positions="image", values=late[:2].clone(), into=[scenes[0], scenes[0]])
    with pytest.raises(InputError, match="one sample for rows 0 and 1"):
        Mask(torch.zeros(2, late.shape[1], dtype=torch.bool), samples=[scenes[0], scenes[0]])
    # A donor's rows written into other samples say which: into= realigns them by sample too.
    pb = prepare_pairs(toy, pairs)
    donor = record(toy, pb.corrupt, [Residual(1)])[Residual(1)]
    clean = [p.clean for p in pairs]
    with intervene(toy, Patch(Residual(1), positions="last", values=donor, into=clean)):
        straight = toy.forward(pb.clean).logits[:, -1].float()
    flipped = donor.flip(0).contiguous()
    with intervene(toy, Patch(Residual(1), positions="last", values=flipped, into=clean[::-1])):
        assert torch.equal(toy.forward(pb.clean).logits[:, -1].float(), straight)


def test_a_mask_knows_its_rows(toy, pairs):
    pb = prepare_pairs(toy, pairs)
    seq = pb.clean.inputs["input_ids"].shape[1]
    calls, handle = _forwards(toy)
    try:
        with pytest.raises(InputError, match="hold 2 rows, without their samples, and this forward 4"):
            effect(toy, pairs, Patch(Residual(1), positions=Mask(torch.ones(2, seq, dtype=torch.bool))))
    finally:
        handle.remove()
    assert not calls
    # The image tokens as a Mask over the pairs in reverse, its rows' samples given: each pair's own row.
    image = group_mask(pb.clean, "image").flip(0)
    mask = Mask(image, samples=[p.clean for p in pairs][::-1])
    sets = {"group": Patch(Residual(1), positions="image"), "mask": Patch(Residual(1), positions=mask)}
    both = effect(toy, pairs, sets)
    np.testing.assert_array_equal(both.logit_diff.sel(intervention="mask"), both.logit_diff.sel(intervention="group"))


def test_mapping_labels_that_collide_are_refused(toy, pairs):
    calls, handle = _forwards(toy)
    try:
        with pytest.raises(InputError, match="labels 1 and '1' of the mapping are both '1'"):
            effect(toy, pairs, {1: Zero(HeadZ(0, 0)), "1": Zero(HeadZ(0, 1))})
    finally:
        handle.remove()
    assert not calls


def test_apply_returning_nan_or_inf_is_refused_naming_site_and_function(toy, pairs):
    def poison(x):
        return x * float("nan")

    def blow_up(x):
        return x / 0.0

    with pytest.raises(InputError, match=r"Apply at HeadZ\(layer=0, head=1\) \(poison\).*NaN or ±inf"):
        effect(toy, pairs, Apply(HeadZ(0, 1), poison))
    batch = toy.prepare_samples([p.clean for p in pairs])
    with pytest.raises(InputError, match=r"Apply at Residual\(layer=2\) \(blow_up\).*NaN or ±inf"):
        with intervene(toy, Apply(Residual(2), blow_up)):
            toy.forward(batch)


def test_sites_are_checked_against_the_model_at_every_entry(toy, pairs):
    clean, corrupt = [p.clean for p in pairs], [p.corrupt for p in pairs]
    batch = toy.prepare_samples(clean[:2])
    calls, handle = _forwards(toy)
    try:
        for run in (
            lambda: record(toy, batch, [HeadZ(0, 4)]),
            lambda: record(toy, batch, [Pattern(0, 4)]),
            lambda: mean_difference(toy, corrupt, clean, HeadZ(0, 4)),
            lambda: effect(toy, pairs, Zero(HeadZ(0, 4))),
            lambda: intervene(toy, Zero(HeadZ(0, 4))).__enter__(),
        ):
            with pytest.raises(InputError, match="head 4 out of range: layer 0 of .* has heads 0..3"):
                run()
        with pytest.raises(InputError, match="has no image states"):
            effect(toy, pairs, Patch(ImageStates(-1)))
        with pytest.raises(Exception, match="has no experts") as err:
            effect(toy, pairs, Patch(Expert(0, 0)))
        assert isinstance(err.value, CountlensError)  # a LayerError
    finally:
        handle.remove()
    assert not calls


def test_site_and_objects_constructors_take_integers_only():
    for make in (
        lambda: Residual(1.5),
        lambda: Residual(-2),
        lambda: HeadZ(0, True),
        lambda: Q(0, "1"),
        lambda: MlpOut(None),
        lambda: Expert(0, 2.0),
        lambda: Pattern(0.0, 1),
    ):
        with pytest.raises(InputError, match="must be an integer"):
            make()
    for bad in (1.0, True, None, "0"):
        with pytest.raises(InputError, match="Objects takes object indices"):
            Objects(bad)
    assert Residual(np.int64(2)) == Residual(2) and type(Residual(np.int64(2)).layer) is int
    assert HeadZ(np.int32(1), np.int64(3)) == HeadZ(1, 3)
    assert Objects(np.int64(1)).objects == (1,) and Objects([np.int64(0), 2]).objects == (0, 2)


def test_functions_without_positions_name_their_own_fix(toy, scenes):
    bare = dataclasses.replace(scenes[0], scene=dataclasses.replace(scenes[0].scene, objects=()))
    with pytest.raises(InputError, match="has no object list") as err:
        object_effects(toy, [bare])
    assert "generated scenes" in str(err.value) and "Cells or a Mask" not in str(err.value)
    # Where positions are given, other positions are the fix.
    with pytest.raises(InputError, match="use Cells or a Mask"):
        Patch(Residual(1), positions=Objects([0])).check_samples([SimpleNamespace(clean=bare, corrupt=scenes[1])])


def test_resample_draws_each_samples_donor_by_sample_not_by_row(toy, scenes):
    """A Resample's donor is a pure function of the seed and the row's sample: the same scores at any
    batch size and order, and a run in chunks draws from every donor, not only the first chunk's rows."""
    from countlens.circuits import Resample

    donors = task_samples("count", 6, seed=8)
    item = Resample(Residual(-1), donors, seed=2, positions="image")
    with intervene(toy, item):
        whole = score(toy, scenes, batch_size=6)
        chunks = score(toy, scenes[::-1], batch_size=2)
    # One sample's scores in another batch shape: float32 rounding of the log-probabilities apart.
    assert_close(whole.p_gold.values, chunks.p_gold.values[::-1], what="Resample, batch of 6 vs 2 reversed")
    resolved = item.resolved(toy)
    drawn = {int(i) for i in resolved.rows_for(_frame_of(toy, scenes))}
    assert len(drawn) > 2, drawn  # chunks of 2 used to take donors order[0] and order[1] only
    again = Resample(Residual(-1), donors, seed=2, positions="image").resolved(toy)
    assert torch.equal(again.rows_for(_frame_of(toy, scenes)), resolved.rows_for(_frame_of(toy, scenes)))


def _frame_of(vlm, samples):
    from countlens.circuits.sites.positions import Frame

    return Frame.of(vlm.prepare_samples(samples))
