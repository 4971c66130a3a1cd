"""Presets: their values are the papers' numbers, and the counting-circuits bands class the paper's
own heads (on a 28-layer layout) as the paper does, where countlens's defaults cannot."""

from __future__ import annotations

import numpy as np
import pytest
import xarray as xr

from countlens import presets
from countlens.analysis.heads import HeadThresholds, classify_heads
from countlens.discover import DiscoverConfig, check_config
from countlens.errors import InputError


def test_preset_values_are_the_papers():
    cc = presets.discover_config("counting-circuits")
    assert (cc.pair_kind, cc.prompt, cc.jaccard_k, cc.preset) == ("dots", "std", 20, "counting-circuits")
    c4 = presets.discover_config("counting-to-four")
    assert (c4.n_per_case, c4.prompt) == (1000, "std")
    t = presets.thresholds("counting-circuits")
    assert (t.early, t.routing_from, t.routing_to, t.late, t.align_min, t.difficulty_min) == (0.1, 0.6, 0.9, 0.8, 0.5, 0.1)
    assert presets.thresholds("") == HeadThresholds()
    for p in presets.PRESETS.values():  # every value a preset sets says where it comes from
        assert set(p.discover) | set(p.thresholds) <= set(p.sources)


def test_overrides_win_and_bad_names_are_refused():
    small = presets.discover_config("counting-to-four", n_per_case=2)
    assert small.n_per_case == 2 and small.prompt == "std"
    with pytest.raises(InputError, match="unknown preset"):
        presets.get("counting-to-five")
    with pytest.raises(InputError, match="not DiscoverConfig fields"):
        presets.discover_config("counting-circuits", n_pair=3)
    with pytest.raises(InputError, match="unknown preset"):
        check_config(DiscoverConfig(preset="nope"))


def _paper_heads():
    """Measurements of a 28-layer, 28-head model where the paper's example heads look as the paper
    describes them (layers counted from 0); every other head is unremarkable."""
    shape = (28, 28)
    coords = {"layer": np.arange(28), "head": np.arange(28)}
    m = {k: np.zeros(shape) for k in ("vgs", "cter", "image", "importance", "constancy", "alignment", "difficulty")}
    m["constancy"][:] = 0.3
    m["vgs"][1, 5], m["image"][1, 5] = 0.5, 0.6  # visual grounding, layer 1
    m["image"][19, 23], m["cter"][19, 23], m["importance"][19, 23] = 0.5, 0.8, 0.3  # routing L19H23
    m["image"][26, 26], m["cter"][26, 26], m["importance"][26, 26], m["alignment"][26, 26] = 0.05, 0.9, 0.2, 0.9
    m["image"][25, 3], m["cter"][25, 3], m["importance"][25, 3], m["alignment"][25, 3] = 0.05, 0.9, 0.2, 0.1
    m["constancy"][26, 8] = 0.95  # existence: always "1"
    m["difficulty"][23, 19] = 0.3  # "difficult", "impossible"
    da = {k: xr.DataArray(v, dims=("layer", "head"), coords=coords) for k, v in m.items()}
    return da


def _classes(thresholds):
    d = _paper_heads()
    df = classify_heads(d["vgs"], d["cter"], d["image"], d["importance"], d["constancy"], thresholds,
                        alignment=d["alignment"], difficulty=d["difficulty"])
    return {(int(la), int(h)): c for la, h, c in zip(df["layer"], df["head"], df["class"])}


def test_counting_circuits_bands_class_the_papers_heads():
    got = _classes(presets.thresholds("counting-circuits"))
    assert got[(1, 5)] == "visual grounding"
    assert got[(19, 23)] == "cross-modal routing"
    assert got[(26, 26)] == "counting aggregation"
    assert got[(25, 3)] == "other"  # decodes numbers but not the count: not aggregation
    assert got[(26, 8)] == "awareness" and got[(23, 19)] == "awareness"
    assert sum(c != "other" for c in got.values()) == 5


def test_the_defaults_cannot_class_the_papers_routing_or_difficulty_heads():
    got = _classes(HeadThresholds())
    assert got[(19, 23)] != "cross-modal routing"  # depth 0.70 ≥ late = 0.5
    assert got[(23, 19)] == "other"  # difficulty words are not tested
    assert got[(25, 3)] == "counting aggregation"  # alignment is not tested
