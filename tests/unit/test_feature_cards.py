"""Feature cards: each figure of a card against an independent recomputation on the organism (the
transcoder applied by hand to a recorded MLP input, the virtual weight by hand), and the refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tolerance import assert_close, scale_of

from countlens.circuits.sites.positions import Objects
from countlens.datasets.tasks import task_samples
from countlens.errors import InputError
from countlens.features import train_transcoders
from countlens.features.cards import COUNT_WORDS, draw_card, feature_cards

pytestmark = pytest.mark.numeric


@pytest.fixture(scope="module")
def cards_setup(loaded):
    vlm = loaded("toy")
    run = train_transcoders(vlm, layers=[0, 1, 2, 3, 4, 5], width=32, k=4, steps=8, mix={"count": 16}, progress=False)
    samples = task_samples("count", 12, seed=3)
    cards = feature_cards(vlm, run.transcoders, samples, [(0, 3), (2, 7)], top=3, batch_size=6)
    return vlm, run.transcoders, samples, cards


def _mlp_input(vlm, batch, layer):
    seen = {}
    mlp = vlm.hf.model.language_model.layers[layer].mlp
    h = mlp.register_forward_hook(lambda m, a, o: seen.update(x=a[0].detach()))
    try:
        with torch.no_grad():
            vlm.hf(**batch.inputs, use_cache=False)
    finally:
        h.remove()
    return seen["x"]


def test_a_cards_scenes_maps_and_objects_are_the_transcoder_applied_by_hand(cards_setup):
    vlm, tcs, samples, cards = cards_setup
    c = cards.sel(card="L2F7")
    tc = tcs.layer(2)
    with torch.no_grad():
        peaks, summed = [], 1.0
        for s in samples:  # every scene's maximum activation, one scene at a time
            batch = vlm.prepare_samples([s], answers=True)
            x = _mlp_input(vlm, batch, 2)
            a = tc.encode(x)[0, :, 7]
            peaks.append(float(a.max()))
            summed = max(summed, scale_of(x[0].abs() @ tc.W_enc[7].abs()))
        # The cards ran scenes 6 to a forward, padded; these one at a time: two float32 computations of the
        # MLP input, whose rounding reaches the activation through W_enc's sum, Σ_j |W_enc[7, j] x_j|.
        assert_close(sorted(peaks, reverse=True)[:3], c.max_activation.values, scale=summed, what="peaks")
        top = samples[int(c.scene[0])]
        batch = vlm.prepare_samples([top], answers=True)
        a = tc.encode(_mlp_input(vlm, batch, 2))[0, :, 7]
        got = c.activation.values[0][: len(batch.image_pos[0])]
        assert_close(got, a[batch.image_pos[0]], scale=summed, what="the top scene's activation map")
        for i in range(len(top.scene.objects)):
            tokens = Objects(i).tokens(batch, 0, top)
            if len(tokens):
                assert_close(c.object_activation.values[0, i], a[tokens].max(), scale=summed, what=f"object {i}")
            else:
                assert np.isnan(c.object_activation.values[0, i])


def test_the_direct_effect_is_the_decoder_rows_virtual_weight_to_the_count_words(cards_setup):
    vlm, tcs, _, cards = cards_setup
    ids = [vlm.answer_ids(w)[0] for w in COUNT_WORDS]
    lm = vlm.hf.model.language_model
    with torch.no_grad():
        w = tcs.layer(0).W_dec[3] * lm.norm.weight
        v = (vlm.hf.lm_head.weight[ids] @ w).numpy()
        summed = scale_of(vlm.hf.lm_head.weight[ids].abs() @ w.abs())  # the sizes the dot products sum
    assert_close(cards.direct.sel(card="L0F3").values, v - v.mean(), scale=summed, what="direct effect")


def test_ablating_a_feature_with_no_write_changes_nothing(cards_setup):
    vlm, tcs, samples, _ = cards_setup
    with torch.no_grad():
        saved = tcs.layer(1).W_dec[5].clone()
        tcs.layer(1).W_dec[5] = 0.0
        try:
            cards = feature_cards(vlm, tcs, samples[:4], [(1, 5)], top=2)
        finally:
            tcs.layer(1).W_dec[5] = saved
    # A zero decoder row writes an exact zero: the ablated forward is the clean one, bit for bit, and
    # the direct effect a sum of products with zero.
    assert cards.ablated.item() == 0.0 and np.allclose(cards.direct.values, 0.0)


def test_cards_refuse_what_they_cannot_draw(cards_setup, tmp_path):
    vlm, tcs, samples, cards = cards_setup
    for features, top, match in (
        ([(9, 0)], 2, "not in the transcoder set"),
        ([(0, 999)], 2, "not in the transcoder set"),
        ([], 2, "give \\(layer, feature\\) pairs"),
        ([(0, 1)], 99, "top=99"),
        ([0], 2, "pair"),
    ):
        with pytest.raises(InputError, match=match):
            feature_cards(vlm, tcs, samples, features, top=top)
    with pytest.raises(InputError, match="transcoder"):
        feature_cards(vlm, "not a set", samples, [(0, 1)])
    path = draw_card(cards, "L0F3", samples, tmp_path / "card.png")
    assert path.stat().st_size > 1000
    with pytest.raises(InputError, match="no card"):
        draw_card(cards, "L9F9", samples, tmp_path / "x.png")
