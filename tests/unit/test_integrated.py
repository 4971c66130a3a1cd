"""EAP-IG on nodes: one step is attribution patching, and the input nodes' scores add up to the whole
change between the two runs (integrated gradients' completeness), approached as the steps grow."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import TINY_IMAGE_SIZE
from tolerance import assert_effect, logit_scale

from countlens.circuits import attribution_patch
from countlens.circuits.engine.pair_batch import logit_diff, prepare_pairs
from countlens.circuits.graph.faithfulness import faithfulness
from countlens.circuits.graph.integrated import node_attribution, node_scores_of
from countlens.circuits.graph.nodes import graph_nodes
from countlens.datasets.pairs import count_pairs
from countlens.errors import InputError


def _pairs(vlm, n=3, image_size=None):
    if image_size is None:
        return count_pairs(n, kind="shapes", grid=vlm.geometry, prompt="short", counts=range(2, 7), seed=4)
    return count_pairs(n, 3, 5, kind="polygons", image_size=image_size, prompt="short", seed=4)


@pytest.mark.matrix
@pytest.mark.numeric
@pytest.mark.parametrize("name", ["toy", "qwen2_5_vl", "qwen3_5", "llama4"])
def test_one_step_is_attribution_patching(name, loaded):
    """With one step the gradient is the clean run's: EAP-IG's head scores are AtP's (a hybrid with
    linear-attention heads and a MoE whose block returns a tuple included)."""
    vlm = loaded(name)
    pairs = _pairs(vlm) if name == "toy" else _pairs(vlm, n=2, image_size=TINY_IMAGE_SIZE[name][0])
    atp = attribution_patch(vlm, pairs)
    one = node_attribution(vlm, pairs, steps=1)
    assert one.attrs["method"] == "atp"
    np.testing.assert_array_equal(np.isnan(one.effect.values), np.isnan(atp.effect.values))
    # Both are normalised effects: their rounding is the logits' over Σ LD_corrupt − Σ LD_clean, which a
    # random-init model's pairs can make small (EAP-IG's one point is x_corrupt + (x_clean − x_corrupt),
    # the clean input up to rounding).
    pb = prepare_pairs(vlm, pairs)
    with torch.no_grad():
        clean, corrupt = (
            logit_diff(vlm.forward(b).logits[:, -1].float(), pb.clean_id, pb.corrupt_id) for b in (pb.clean, pb.corrupt)
        )
    assert_effect(
        np.nan_to_num(one.effect.values),
        np.nan_to_num(atp.effect.values),
        clean=clean,
        corrupt=corrupt,
        scale=logit_scale(vlm, pb),
        what=f"{name}: EAP-IG(1) vs AtP",
        want_rounded=True,
    )


@pytest.mark.numeric
def test_input_scores_add_up_to_the_whole_change(loaded):
    """Completeness: Σ over the input nodes of (x_corrupt − x_clean) · mean gradient is a Riemann sum of
    ∫ dLD along the path, so the normalised input scores add up to 1 as the steps grow (the text input
    is the same in both runs: it scores 0)."""
    vlm = loaded("toy")
    pairs = _pairs(vlm)
    coarse, fine = (node_attribution(vlm, pairs, steps=s) for s in (2, 16))
    assert float(fine.input_effect.sel(input="text")) == 0.0
    error = abs(float(fine.input_effect.sum()) - 1.0)
    assert error < 0.05
    assert error < abs(float(coarse.input_effect.sum()) - 1.0)


def test_scores_of_every_node_rank_a_circuit(loaded):
    vlm = loaded("toy")
    pairs = _pairs(vlm, n=2)
    scores = node_scores_of(node_attribution(vlm, pairs, steps=2))
    assert set(scores) == {n.label for n in graph_nodes(vlm)}
    ds = faithfulness(vlm, pairs, scores, sizes=(0.0, 0.5, 1.0))
    assert ds.attrs["nodes"] == "input,head,mlp" and list(ds.kept.values) == [0, 16, 32]


def test_steps_must_be_a_count(loaded):
    with pytest.raises(InputError, match="steps"):
        node_attribution(loaded("toy"), _pairs(loaded("toy"), n=1), steps=0)
