"""Donors of another layout: a `Patch`'s values recorded on a batch of another token layout (the colour
task's 49-token prompt, the count task's 52; another padding), and a `Resample`'s donors, are written by
position name — ``last``, ``image``, an object's tokens in the donor's own scene — position by position,
under `intervene` and in `effect`, equal to plain torch hooks; a position the donor lacks, or holds
another number of, is refused naming it before any forward; a donor of the same layout is written column
for column as before (`countlens.circuits.engine.donors`)."""

from __future__ import annotations

import pytest
import torch
from tolerance import assert_close

from countlens.circuits import HeadZ, Objects, Patch, Resample, effect, intervene, record
from countlens.circuits.engine.pair_batch import prepare_pairs
from countlens.circuits.sites.positions import Frame
from countlens.datasets import task_samples
from countlens.datasets.pairs import count_pairs
from countlens.errors import InputError

SITE = HeadZ(0, 0)


@pytest.fixture(scope="module")
def toy(loaded):
    return loaded("toy")


@pytest.fixture(scope="module")
def pairs(toy):
    return count_pairs(2, 3, 5, kind="shapes", grid=toy.geometry, prompt="short", seed=11)


@pytest.fixture(scope="module")
def pb(toy, pairs):
    return prepare_pairs(toy, pairs)


@pytest.fixture(scope="module")
def colour(toy):
    """Two colour-task samples (49-token prompts), their batch, their HeadZ(0, 0) values as `record` gives
    them, and layer 0's o_proj input read by a plain torch hook."""
    samples = task_samples("color", 2, seed=3)
    batch = toy.prepare_samples(samples)
    return samples, batch, record(toy, batch, [SITE])[SITE], _plain_z(toy, batch)


def _z_hook(toy, fn):
    """A plain torch pre-hook on layer 0's o_proj: ``fn(z)`` sees (and may edit in place) its input."""

    def pre(module, args):
        z = args[0].clone()
        fn(z)
        return (z, *args[1:])

    return toy.hf.get_submodule(toy.arch.o_proj(0)).register_forward_pre_hook(pre)


def _head0(toy) -> slice:
    return slice(0, toy.arch.head_dim(0))


def _plain_z(toy, batch) -> torch.Tensor:
    got = {}
    handle = _z_hook(toy, lambda z: got.setdefault("z", z.detach().clone()))
    try:
        with torch.no_grad():
            toy.hf(**batch.inputs, use_cache=False)
    finally:
        handle.remove()
    return got["z"]


def _plain_patched(toy, batch, here: list, donor_z: torch.Tensor, there: list) -> torch.Tensor:
    """Last-position logits of ``batch`` with head 0's z at row b's positions ``here[b]`` replaced, in
    order, by ``donor_z``'s row b at ``there[b]``: plain HF forward, one plain torch hook."""
    cols = _head0(toy)

    def write(z):
        for b, (h, t) in enumerate(zip(here, there)):
            z[b, h, cols] = donor_z[b, t, cols].to(z.dtype)

    handle = _z_hook(toy, write)
    try:
        with torch.no_grad():
            return toy.hf(**batch.inputs, use_cache=False).logits[:, -1].float()
    finally:
        handle.remove()


def _positions(toy, batch, positions) -> list:
    return [row.nonzero().flatten() for row in positions.mask(toy, Frame.of(batch)).cpu()]


def test_a_colour_task_donor_is_patched_at_last_and_at_an_objects_tokens_as_plain_torch(toy, pairs, pb, colour):
    samples, cb, values, donor_z = colour
    clean = [p.clean for p in pairs]
    assert cb.inputs["input_ids"].shape[1] != pb.clean.inputs["input_ids"].shape[1]  # 49 against 52 tokens
    lasts = [pb.clean.last[b : b + 1] for b in range(len(pairs))]
    expected = _plain_patched(toy, pb.clean, lasts, donor_z, [cb.last[b : b + 1] for b in range(len(pairs))])
    with intervene(toy, Patch(SITE, positions="last", values=values, into=clean)):
        got = toy.forward(pb.clean).logits[:, -1].float()
    assert_close(got, expected, what="colour-task HeadZ(0, 0) at last under intervene vs plain torch")
    # In effect: each pair's logit difference is the plain-torch run's.
    ds = effect(toy, pairs, Patch(SITE, positions="last", values=values, into=clean))
    rows = torch.arange(len(pairs))
    ld = expected[rows, pb.clean_id] - expected[rows, pb.corrupt_id]
    assert_close(ds.logit_diff.values, ld, scale=float(expected.abs().max()), what="effect's logit_diff")
    assert abs(ds.logit_diff.values - ds.clean_logit_diff.values).max() > 1e-3  # the patch moves it: teeth
    # An object's tokens, each resolved in its own scene (object 0 covers one token in each here).
    objects = Objects([0])
    here, there = _positions(toy, pb.clean, objects), _positions(toy, cb, objects)
    expected = _plain_patched(toy, pb.clean, here, donor_z, there)
    with intervene(toy, Patch(SITE, positions=objects, values=values, into=clean)):
        got = toy.forward(pb.clean).logits[:, -1].float()
    assert_close(got, expected, what="object 0's tokens of colour scenes into count scenes vs plain torch")
    # Another padding at the same width: colour rows left-padded to a count sample's 52 tokens (their image
    # tokens 3 columns to the right of the count scenes') are read by name too, not column for column.
    mixed = toy.prepare_samples([*samples, pairs[0].corrupt])
    assert mixed.inputs["input_ids"].shape[1] == pb.clean.inputs["input_ids"].shape[1]
    assert not torch.equal(mixed.image_pos[0], pb.clean.image_pos[0])
    padded = record(toy, mixed, [SITE])[SITE]
    expected = _plain_patched(toy, pb.clean, pb.clean.image_pos, _plain_z(toy, mixed), mixed.image_pos[:2])
    with intervene(toy, Patch(SITE, positions="image", values=padded, into=[*clean, pairs[0].corrupt])):
        got = toy.forward(pb.clean).logits[:, -1].float()
    assert_close(got, expected, what="image tokens of left-padded colour rows vs plain torch")


def test_a_position_the_donor_lacks_or_holds_another_number_of_is_refused_before_any_forward(toy, pairs, pb, colour):
    samples, cb, values, donor_z = colour
    corrupt, clean = [p.corrupt for p in pairs], [p.clean for p in pairs]
    assert max(len(s.scene.objects) for s in samples) <= 4 < min(len(p.corrupt.scene.objects) for p in pairs)
    seq = pb.clean.inputs["input_ids"].shape[1]
    cases = [
        # Object 4 of the five-object scenes: the colour scenes have no object 4.
        (
            Patch(SITE, positions=Objects([4]), values=values, into=corrupt),
            pb.corrupt,
            "does not exist in the donor.*no object 4",
        ),
        # Every real token: 52 in the count prompt, 49 in the colour prompt.
        (
            Patch(SITE, positions="all", values=values, into=clean),
            pb.clean,
            "'all' holds 52 positions in row 0 .* and 49 in its donor",
        ),
        # A Mask names the edited batch's own columns: no position of another run.
        (
            Patch(SITE, positions=torch.ones(2, seq, dtype=torch.bool), values=values, into=clean),
            pb.clean,
            "names the edited batch's own columns",
        ),
        # A tensor made from record's no longer knows its batch: the widths cannot be paired.
        (
            Patch(SITE, positions="last", values=values.clone(), into=clean),
            pb.clean,
            "do not know the batch they were recorded on",
        ),
    ]
    for patch, batch, message in cases:
        calls = []
        with pytest.raises(InputError, match=message), intervene(toy, patch):
            # A hook after intervene's own: it runs only if intervene lets the forward on.
            handle = toy.hf.register_forward_pre_hook(lambda m, a, calls=calls: calls.append(1))
            try:
                toy.forward(batch)
            finally:
                handle.remove()
        assert not calls, message  # refused before the model ran
    calls = []
    handle = toy.hf.register_forward_pre_hook(lambda m, a: calls.append(1))
    try:
        with pytest.raises(InputError, match="'all' holds 52 positions"):
            effect(toy, pairs, Patch(SITE, positions="all", values=values, into=clean))
    finally:
        handle.remove()
    assert not calls  # effect too refuses before any forward


def test_a_donor_of_the_same_layout_is_written_column_for_column_as_before(toy, pairs, pb):
    clean = [p.clean for p in pairs]
    values = record(toy, pb.corrupt, [SITE])[SITE]  # the pairs' own corrupt side: the same layout
    plain = values.clone()  # no batch known: column for column, the only rule before donors of another layout
    for positions in ("last", "image", Objects([0])):
        with intervene(toy, Patch(SITE, positions=positions, values=values, into=clean)):
            got = toy.forward(pb.clean).logits[:, -1]
        with intervene(toy, Patch(SITE, positions=positions, values=plain, into=clean)):
            assert torch.equal(got, toy.forward(pb.clean).logits[:, -1]), positions


def test_resample_donors_of_another_layout_are_written_by_name(toy, pairs, pb, colour):
    samples, cb, _, donor_z = colour
    item = Resample(SITE, samples, seed=1, positions="last").resolved(toy)  # colour donors, count samples
    lay = item.recorded_on[1][item.rows_for(Frame.of(pb.clean))]  # each row's drawn donor
    here = [pb.clean.last[b : b + 1] for b in range(len(pairs))]
    expected = _plain_patched(toy, pb.clean, here, donor_z[lay], [cb.last[d : d + 1] for d in lay])
    with intervene(toy, item):
        got = toy.forward(pb.clean).logits[:, -1].float()
    assert_close(got, expected, what="Resample of colour-task donors at last vs plain torch")
