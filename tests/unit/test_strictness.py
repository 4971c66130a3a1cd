"""Fresh-data strictness (countlens.toy.strictness) and the top-half organism's scenes (countlens.toy.regions):
the donors are what their kind says, the intervals are the textbook ones, and the scenes keep their rule."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from countlens.datasets.recipe import rebuild
from countlens.errors import InputError
from countlens.toy.regions import IMAGE, MAX_BOTTOM, region_checks, top_half_sample, without
from countlens.toy.resample import DONORS, donor_order
from countlens.toy.strictness import FRESH_CHECKS, fresh_checks, lost_answers, paired_drop, wilson


def test_each_donor_kind_is_drawn_from_its_own_samples_and_follows_its_seed():
    answers = torch.tensor([3, 5, 3, 7, 5, 3, 7, 5])
    partner = torch.tensor([4, 5, 6, 7, 0, 1, 2, 3])
    order, found = donor_order(answers, partner, "partner", torch.Generator().manual_seed(0))
    assert torch.equal(order, partner) and found.all()
    for seed in range(20):
        gen = torch.Generator().manual_seed(seed)
        diff, found_d = donor_order(answers, partner, "different", gen)
        same, found_s = donor_order(answers, partner, "same", gen)
        for i in range(len(answers)):
            assert diff[i] != i and diff[i] != partner[i] and answers[diff[i]] != answers[i]
            if found_s[i]:
                assert same[i] != i and same[i] != partner[i] and answers[same[i]] == answers[i]
            else:  # no other scene of that count in the batch: the sample keeps its own heads
                assert same[i] == i
        assert found_d.all()
    runs = [donor_order(answers, partner, "same", torch.Generator().manual_seed(4))[0] for _ in range(2)]
    assert torch.equal(*runs)
    assert set(DONORS) == {"partner", "different", "same"}
    with pytest.raises(InputError, match="donor kind"):
        donor_order(answers, partner, "random", torch.Generator())


def test_the_intervals_are_wilsons_and_the_paired_normal_one():
    # Wilson's interval by its closed form at z = 1.96: 45 hits in 50.
    lo, hi = wilson(45, 50)
    z, n, p = 1.959964, 50, 0.9
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    assert lo == pytest.approx(centre - half) and hi == pytest.approx(centre + half)
    before = torch.tensor([1, 1, 1, 1, 0, 1, 1, 1], dtype=torch.bool)
    after = torch.tensor([1, 0, 1, 1, 0, 1, 0, 1], dtype=torch.bool)
    d = np.array([0, 1, 0, 0, 0, 0, 1, 0], dtype=float)
    row = paired_drop(before, after)
    se = d.std(ddof=1) / math.sqrt(len(d))
    assert row["drop"] == pytest.approx(0.25)
    assert row["ci95"] == pytest.approx([round(0.25 - 1.959964 * se, 4), round(0.25 + 1.959964 * se, 4)])


def test_lost_answers_count_by_hand():
    # gold, clean, resampled and the donor's count per sample: samples 0–3 are lost (right, then wrong),
    # 4 was wrong before, 5 stays right. Sample 0 moves one toward the donor (5 → 6, donor 8), 1 one away
    # (5 → 4, donor 9), 2 two toward (5 → 3, donor 2), 3 one toward (9 → 8, donor 1).
    gold = torch.tensor([5, 5, 5, 9, 5, 5])
    clean = torch.tensor([5, 5, 5, 9, 4, 5])
    resampled = torch.tensor([6, 4, 3, 8, 6, 5])
    donor = torch.tensor([8, 9, 2, 1, 7, 3])
    assert lost_answers(clean, resampled, gold, donor) == {"lost": 4, "off_by_one": 3, "toward_donor": 3}


def test_the_fresh_bar_fails_on_any_donor_kind_and_on_too_few_samples():
    row = {"accuracy": 0.95, "drop": 0.01, "ci95": [0.0, 0.02]}
    figures = {
        "n_samples": 1024,
        "accuracy": 0.96,
        "circuit_resampled_different": 0.01,
        "chance": 1 / 9,
        "outside": {k: dict(row) for k in DONORS},
    }
    assert all(fresh_checks(figures).values())
    figures["outside"]["different"]["drop"] = FRESH_CHECKS["outside_drop_max"] + 0.001
    assert fresh_checks(figures) == {**dict.fromkeys(fresh_checks(figures), True), "outside_different": False}
    figures["n_samples"] = 256
    assert not fresh_checks(figures)["n_samples"]


def test_top_half_scenes_keep_their_rule_and_rebuild_from_their_recipe():
    counts = set()
    for i in range(27):
        s = top_half_sample(7, i)
        flags = s.meta["top"]
        assert len(flags) == len(s.scene.objects) and sum(flags) == s.meta["count"] == int(s.answer)
        assert 0 <= s.meta["bottom"] <= MAX_BOTTOM
        for o, top in zip(s.scene.objects, flags, strict=True):
            # wholly inside its half: the middle line (a token row boundary) is never crossed
            assert (o.cy + o.radius <= IMAGE / 2) if top else (o.cy - o.radius >= IMAGE / 2)
        counts.add(s.meta["count"])
        assert rebuild(s.recipe) == s
    assert counts == set(range(1, 10))
    s = top_half_sample(7, 8)
    kept = without(s, lambda i, top: top)
    assert kept.meta["bottom"] == 0 and kept.answer == s.answer and len(kept.scene.objects) == int(s.answer)


def test_region_checks_name_each_bar():
    figures = {
        "accuracy": 0.95,
        "bottom_removed": {"drop": -0.03},
        "top_one_removed_follows": 0.9,
        "objects": {"auroc": 0.99},
    }
    assert region_checks(figures) == {
        "accuracy": True,
        "bottom_ignored": False,
        "follows_top": True,
        "object_auroc": True,
    }


def test_node_and_object_recovery_on_hand_worked_scores():
    import xarray as xr

    from countlens.circuits.graph.recovery import node_recovery, object_recovery

    scores = {"L0H2": 0.9, "MLP1": -0.5, "L0H0": 0.5, "L1H1": 0.1, "MLP2": float("nan")}
    # C = {L0H2, MLP1}: of the 2 × 2 (inside, outside) pairs, L0H2 beats both, MLP1 ties L0H0 and beats L1H1;
    # the top 2 are L0H2 and, of the tie at 0.5, the one scored first (MLP1) — then L0H0 if listed first
    assert node_recovery(scores, {"L0H2", "MLP1"}) == {"auroc": 0.875, "precision": 1.0}
    flipped = {"L0H0": 0.5, **scores}
    assert node_recovery(flipped, {"L0H2", "MLP1"}) == {"auroc": 0.875, "precision": 0.5}
    with pytest.raises(InputError, match="MLP3"):
        node_recovery(scores, {"MLP3"})
    samples = [top_half_sample(7, i) for i in range(3)]
    truth = [s.meta["top"] for s in samples]
    width = max(len(t) for t in truth)
    perfect = np.full((3, width), np.nan)
    for k, t in enumerate(truth):
        perfect[k, : len(t)] = [2.0 if x else 0.1 for x in t]
    out = object_recovery(xr.DataArray(perfect, dims=("scene", "object")), samples)
    assert out["auroc"] == 1.0 and out["precision"] == 1.0 and out["counted"] == sum(map(sum, truth))
    with pytest.raises(InputError, match="meta"):
        object_recovery(
            xr.DataArray(perfect, dims=("scene", "object")),
            [s.__class__(s.scene, s.question, s.answer, "count") for s in samples],
        )
