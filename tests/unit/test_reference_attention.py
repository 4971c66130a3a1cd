"""The MAS paper's attention diagnostics as its code computes them: each formula against a hand-written
computation on fixed tensors, the notebook's own printed sample, and the sets on a real Qwen vocabulary."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from countlens.analysis.attention_metrics import attention_metrics
from countlens.datasets.countingtricks import countingtricks
from countlens.datasets.tasks import task_samples
from countlens.reference.counting_to_four.attention import (
    SETS,
    ars_as_reference,
    chatml_sets,
    generation_batches,
    modality_shares,
    set_sums,
    vra_as_reference,
)

# The notebook's one printed sample (attn_dist.ipynb, Qwen2.5-VL-7B, 28 layers): per layer the raw
# sums [special, system, image, text] of the last generation step's head-mean attention.
NOTEBOOK_ROWS = [
    [0.07575433, 0.06348357, 0.06520629, 0.20627107],
    [0.09060443, 0.052425165, 0.02568416, 0.19076496],
    [0.058150634, 0.1996291, 0.058569532, 0.20870647],
    [0.032101445, 0.06813979, 0.032480564, 0.20008743],
    [0.017283535, 0.7014346, 0.015699115, 0.049801186],
    [0.045942213, 0.67030686, 0.015497464, 0.08374572],
    [0.024535649, 0.58048195, 0.0097910855, 0.056474738],
    [0.016123684, 0.61916375, 0.010686493, 0.030070733],
    [0.027011571, 0.65510476, 0.021820936, 0.084816076],
    [0.07623222, 0.4322359, 0.052460734, 0.083894774],
    [0.01878294, 0.56453764, 0.034333155, 0.040384382],
    [0.032117687, 0.49179617, 0.055498984, 0.079385385],
    [0.03386885, 0.519567, 0.050209925, 0.061253823],
    [0.037444703, 0.42653894, 0.052625902, 0.092477635],
    [0.059567034, 0.47101375, 0.09822124, 0.105138086],
    [0.0302959, 0.45766234, 0.05888239, 0.058641512],
    [0.05848357, 0.45116532, 0.12069318, 0.073342174],
    [0.041983552, 0.5098778, 0.060618006, 0.06528206],
    [0.01829913, 0.23463465, 0.12454217, 0.060010042],
    [0.021584734, 0.3450668, 0.18591613, 0.09158155],
    [0.029230416, 0.3445745, 0.13799578, 0.06608789],
    [0.021720754, 0.44933754, 0.14498147, 0.04017139],
    [0.08880381, 0.5077505, 0.19509117, 0.028024059],
    [0.05171518, 0.582847, 0.064339615, 0.021894708],
    [0.14977102, 0.5343024, 0.057877786, 0.022552969],
    [0.09450582, 0.44608554, 0.055436067, 0.044400018],
    [0.19493735, 0.45233288, 0.07466909, 0.030424733],
    [0.17545675, 0.36447605, 0.080353186, 0.052863173],
]


def test_four_way_share_reduces_as_the_notebook():
    """The notebook's sample gives its 11.2 % image share; two samples: raw sums averaged first."""
    one = modality_shares(torch.tensor([NOTEBOOK_ROWS]))
    assert list(one) == list(SETS) and abs(one["image"] - 0.11248) < 5e-5 and abs(sum(one.values()) - 1) < 1e-12
    gen = np.random.default_rng(0)
    sums = gen.random((3, 5, 4))
    mean = sums.mean(0)  # the notebook: average over samples, renormalise per layer, mean over layers
    want = (mean / mean.sum(1, keepdims=True)).mean(0)
    got = modality_shares(torch.tensor(sums))
    assert np.allclose([got[k] for k in SETS], want, rtol=0, atol=1e-12)  # float64 shares ≤ 1, two orders of sums
    row = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1]])
    sets = {"special": [0], "system": [], "image": [1, 2], "text": [3]}
    assert torch.allclose(set_sums(row, sets), torch.tensor([[0.1, 0.0, 0.5, 0.4], [0.4, 0.0, 0.5, 0.1]]))


def test_vra_and_ars_as_the_code_clips_and_sums():
    gen = np.random.default_rng(1)
    att = gen.random((6, 40)) ** 4  # a few large values, so the 99th percentile clips
    ground = gen.random(40) < 0.3
    clipped = np.minimum(att, np.percentile(att, 99, axis=1, keepdims=True))  # per layer, over tokens
    vra = clipped[:, ground].sum() / clipped.sum()
    m = att.max(0)
    c = np.minimum(m, np.percentile(m, 99))
    ars = c[ground].sum() - c[~ground].sum()
    t, g = torch.tensor(att), torch.tensor(ground)
    assert abs(vra_as_reference(t, g) - vra) < 1e-12 and abs(ars_as_reference(t, g) - ars) < 1e-12
    assert np.isnan(vra_as_reference(torch.zeros(2, 5), torch.ones(5, dtype=torch.bool)))


def test_sets_on_the_real_qwen_template(loaded):
    """Qwen2.5-VL's ChatML prompt (real vocabulary): specials, the system turn with its role word, the
    user turn's text, the image tokens; the assistant header and padding belong to none."""
    vlm = loaded("qwen2_5_vl")
    samples = task_samples("count", 2, 0, image_size=vlm.geometry.image_height)
    batch = vlm.prepare_samples(samples)
    for b in range(2):
        sets = chatml_sets(vlm, batch, b)
        tokens = vlm.token_strings(batch.inputs["input_ids"][b].tolist())
        assert sets["image"] == batch.image_pos[b].tolist()
        assert all(tokens[i].startswith("<|") and tokens[i].endswith("|>") for i in sets["special"])
        assert tokens[sets["system"][0]] == "system" and tokens[sets["text"][0]] == "user"
        assert "You" in "".join(tokens[i] for i in sets["system"])  # Qwen's default system message
        assert len(sum(sets.values(), [])) == len(set(sum(sets.values(), [])))  # disjoint
        assert int(batch.prompt_last[b]) not in sum(sets.values(), [])  # the assistant header: none


def test_attention_metrics_at_the_last_generation_step(loaded):
    """On the organism: the read position is the one that produces the last generated token; the code's
    diagnostics sit beside countlens's own."""
    vlm = loaded("toy")
    samples = countingtricks(["1A", "5A"], 2, vlm.geometry, seed=3, prompt="short")
    for chunk, batch, generated in generation_batches(vlm, samples, 4, max_new_tokens=5):
        assert [int(batch.last[b] - batch.prompt_last[b]) for b in range(len(chunk))] == [len(g) - 1 for g in generated]
    ds = attention_metrics(vlm, samples, batch_size=4, at="generation", max_new_tokens=5)
    assert ds.attrs["position"] == "last generation step" and ds.sets.dims == ("layer", "set", "sample")
    assert list(ds.set.values) == list(SETS) and float(ds.sets.sel(set="system").sum()) == 0.0  # no system turn
    assert ((ds.vra_code >= 0) & (ds.vra_code <= 1)).all() and "text" in ds
    shares = modality_shares(torch.tensor(ds.sets.transpose("sample", "layer", "set").values))
    assert 0 <= shares["image"] <= 1
    with pytest.raises(Exception, match="at="):
        attention_metrics(vlm, samples, at="answer")
