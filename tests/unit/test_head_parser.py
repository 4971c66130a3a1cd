"""One parser for heads, features and labels, and no non-finite score ranked.

Mechanism: every API that takes heads (`FinetuneConfig.target_heads`, `auroc` / `precision_at`,
`planted_path_recovery`) reads them with `countlens.labels.head_keys`, and every one that takes
transcoder features (`feature_cards`) with `countlens.labels.feature_keys`. Both take one pair or a
collection of pairs, nested or not, numpy integers, an (n, 2) integer array and labels (``"L3H2"``,
``"L1F17"``); both refuse non-integers (a float is never rounded to a head or a feature), bools,
negative indices, duplicates and an empty selection: "no restriction" is spelled ``None``, never
``()``. Scores are refused where they are not finite: ±inf in a ranking (naming the cell),
a ranking with no finite value in `top_heads_from`, a NaN effect of a measured object in
`object_misses`. NaN stays what it was where it is documented: no head there, no object there.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import xarray as xr

from countlens.errors import ConfigError, InputError
from countlens.labels import feature_keys, head_keys


def _ranking(values) -> xr.DataArray:
    v = np.asarray(values, dtype=float)
    return xr.DataArray(v, dims=("layer", "head"), coords={"layer": range(v.shape[0]), "head": range(v.shape[1])})


# ----------------------------------------------------------------------------- the parser's table

ACCEPTS = [
    ((0, 0), ((0, 0),)),  # one head alone, not nested
    ([3, 2], ((3, 2),)),
    ("L3H2", ((3, 2),)),
    (" L3H2 ", ((3, 2),)),
    (((0, 1), (2, 3)), ((0, 1), (2, 3))),
    ([[0, 1], "L2H3"], ((0, 1), (2, 3))),  # pairs and labels mixed
    (["L0H1", "L2H3"], ((0, 1), (2, 3))),  # two labels are two heads, not a pair
    ((np.int64(1), np.int32(2)), ((1, 2),)),
    ([(np.int64(1), np.uint8(2))], ((1, 2),)),
    (np.array([1, 2]), ((1, 2),)),
    (np.array([[0, 1], [2, 3]]), ((0, 1), (2, 3))),
    (iter([(0, 1)]), ((0, 1),)),
    ({(1, 1)}, ((1, 1),)),
]

REFUSES = [
    ((), "empty"),
    ([], "empty"),
    (set(), "empty"),
    (np.zeros((0, 2), int), "empty"),
    ((0, 1.7), r"\(0, 1\.7\)"),  # never rounded to head 1
    ((0.0, 1.0), "pairs of integers"),
    ([(0, 1.7)], "pairs of integers"),
    (np.array([[0.0, 1.0]]), "pairs of integers"),
    ((True, 0), "pairs of integers"),
    ((np.bool_(True), 0), "pairs of integers"),
    ((0, -1), "≥ 0"),
    ([(0, 0), "L0H0"], "L0H0 more than once"),
    ([(0, 0), (0, 0)], "L0H0 more than once"),
    ("L3", "'L3'"),
    ("L3E2", "'L3E2'"),  # an expert's label is not a head's
    (b"L3H2", "pairs of integers"),
    (3, "got int 3"),
    ((0, 1, 2), r"\(0, 1, 2\)"),
    ({(0, 0): 1.0}, "got dict"),
    (np.array([[0, 1, 2]]), "shape"),
    (None, "got NoneType"),
    (_ranking([[1.0]]), "got DataArray"),
]


def _id(value) -> str:
    """A case's id, the same in every pytest-xdist worker (an iterator's repr holds its address)."""
    return "an iterator of pairs" if isinstance(value, type(iter([]))) else repr(value)[:30]


@pytest.mark.parametrize(("heads", "expected"), ACCEPTS, ids=[_id(a) for a, _ in ACCEPTS])
def test_head_keys_accepts_every_spelling_of_heads(heads, expected):
    got = head_keys(heads)
    assert got == expected and all(type(x) is int for pair in got for x in pair)


@pytest.mark.parametrize(("heads", "match"), REFUSES, ids=[_id(a) for a, _ in REFUSES])
def test_head_keys_refuses_with_the_input_and_the_fix(heads, match):
    with pytest.raises(InputError, match=match) as err:
        head_keys(heads, "circuit")
    assert "circuit" in str(err.value)
    assert "(layer, head)" in str(err.value) or "≥ 0" in str(err.value) or "once" in str(err.value)


def test_feature_keys_reads_pairs_and_card_labels_and_refuses_floats():
    assert feature_keys("L1F17") == ((1, 17),)
    assert feature_keys([(1, 17), "L3F200", np.array([0, 2])]) == ((1, 17), (3, 200), (0, 2))
    assert feature_keys(np.array([[0, 1]])) == ((0, 1),)
    for bad, match in (((0, 1.7), r"\(0, 1\.7\)"), ([], "empty"), ("L1H17", "'L1H17'"), ([(1, 2), "L1F2"], "once")):
        with pytest.raises(InputError, match=match):
            feature_keys(bad)


# ----------------------------------------------------------------------------- the reported cases


def test_top_heads_from_refuses_a_ranking_with_no_finite_value():
    from countlens.training import top_heads_from

    with pytest.raises(ConfigError, match="no finite"):
        top_heads_from(_ranking([[np.nan, np.nan], [np.nan, np.nan]]), k=2)
    with pytest.raises(ConfigError, match="L1H0"):  # an inf would rank first whatever it means
        top_heads_from(_ranking([[1.0, 2.0], [np.inf, np.nan]]), k=1)
    table = pd.DataFrame({"layer": [0, 1], "head": [1, 0], "importance": [np.nan, np.nan], "class": ["a", "a"]})
    with pytest.raises(ConfigError, match="no finite"):
        top_heads_from(table, k=1)
    assert top_heads_from(_ranking([[1.0, np.nan], [-3.0, 2.0]]), k=2) == ((1, 0), (1, 1))  # NaN: no head there


def test_an_empty_target_heads_is_an_error_and_none_trains_every_head():
    from countlens.settings import FinetuneConfig

    assert FinetuneConfig().target_heads is None
    for empty in ((), [], np.zeros((0, 2), int)):
        with pytest.raises(ConfigError, match="target_heads is empty.*None"):
            FinetuneConfig(target_heads=empty)


def test_target_heads_take_a_bare_pair_numpy_integers_and_labels():
    from countlens.settings import FinetuneConfig

    assert FinetuneConfig(target_heads=(0, 0)).target_heads == ((0, 0),)
    assert FinetuneConfig(target_heads=[(np.int64(0), np.int64(1))]).target_heads == ((0, 1),)
    assert FinetuneConfig(target_heads=np.array([[0, 1], [1, 2]])).target_heads == ((0, 1), (1, 2))
    assert FinetuneConfig(target_heads=("L0H0", "L1H3")).target_heads == ((0, 0), (1, 3))
    assert FinetuneConfig(target_heads="L0H0").target_heads == ((0, 0),)
    with pytest.raises(ConfigError, match="target_heads"):
        FinetuneConfig(target_heads=[(0, 1.5)])


def test_recovery_takes_head_labels_and_a_bare_pair():
    from countlens.circuits.graph.recovery import auroc, precision_at
    from countlens.features.head_paths import planted_path_recovery

    r = _ranking([[4.0, -3.0], [2.0, 1.0]])
    assert auroc(r, {"L0H0"}) == 1.0 and precision_at(r, ["L0H0"]) == 1.0
    assert auroc(r, (0, 0)) == 1.0 and precision_at(r, np.array([[0, 1], [1, 1]])) == 0.5
    assert planted_path_recovery(r, ["L0H0"]) == {"auroc": 1.0, "precision": 1.0, "k": 1}
    with pytest.raises(InputError, match="L0H0 more than once"):
        precision_at(r, [(0, 0), "L0H0"])
    for k in (2.5, True, "2"):  # a share of a fractional top-k has no meaning
        with pytest.raises(InputError, match="k \\(how many top heads\\) must be an integer"):
            precision_at(r, ["L0H0"], k=k)


def test_feature_cards_never_rounds_a_float_to_a_feature(loaded):
    from countlens.datasets.tasks import task_samples
    from countlens.features.cards import feature_cards
    from countlens.features.transcoder import Transcoder, TranscoderSet

    vlm = loaded("toy")
    tcs = TranscoderSet([Transcoder(vlm.arch.d_model, 4, k=1)], layers=[0])
    samples = task_samples("count", 2, seed=0)
    with pytest.raises(InputError, match=r"\(0, 1\.7\)"):
        feature_cards(vlm, tcs, samples, [(0, 1.7)], top=1)
    with pytest.raises(InputError, match="L0F1 more than once"):
        feature_cards(vlm, tcs, samples, [(0, 1), "L0F1"], top=1)


def test_recovery_refuses_an_infinite_score_naming_the_cell():
    from countlens.circuits.graph.recovery import auroc, node_recovery, object_recovery, precision_at

    r = _ranking([[4.0, -3.0], [np.inf, 1.0]])
    with pytest.raises(InputError, match="L1H0"):
        auroc(r, {(0, 0)})
    with pytest.raises(InputError, match="L1H0"):
        precision_at(r, {(0, 0)})
    with pytest.raises(InputError, match="MLP1"):
        node_recovery({"L0H0": 1.0, "MLP1": -np.inf}, {"L0H0"})
    from countlens.toy.regions import top_half_sample

    samples = [top_half_sample(7, 0)]
    scores = np.full((1, len(samples[0].meta["top"])), 1.0)
    scores[0, 1] = np.inf
    with pytest.raises(InputError, match=r"scene 0, object 1"):
        object_recovery(xr.DataArray(scores, dims=("scene", "object")), samples)


def test_object_misses_refuses_a_nan_effect_of_a_measured_object():
    from countlens.analysis import object_misses

    effect = np.array([[1.0, np.nan], [0.5, 2.0]])
    fx = xr.Dataset(
        {
            "effect": (("scene", "object"), effect),
            "exists": (("scene", "object"), np.ones((2, 2), bool)),
            "n_tokens": (("scene", "object"), np.array([[2, 3], [1, 0]])),  # scene 0's object 1 covers 3 tokens
            "placement": (("scene", "object"), np.array([["edge", "centred"], ["edge", "edge"]])),
            "size": (("scene", "object"), np.ones((2, 2))),
            "touches": (("scene", "object"), np.zeros((2, 2), bool)),
            "clean_correct": ("scene", np.array([False, False])),
        }
    )
    with pytest.raises(InputError, match=r"scene 0, object 1"):
        object_misses(fx, n_boot=10)
    fx["effect"] = (("scene", "object"), np.array([[1.0, 0.5], [0.5, np.nan]]))  # NaN where no token: left out
    assert int(object_misses(fx, n_boot=10).sel(group="all").n_objects) == 3


def test_the_interventions_read_heads_with_the_same_parser(loaded):
    """`ablate`, `head_temperature` and the head sites read heads through `checked_heads`, which is the
    one parser plus the model's range: a head given twice or as a float is refused before any forward;
    an empty list is no heads (ablating none), never every head."""
    from countlens.circuits.sites import checked_heads

    arch = loaded("toy").arch
    assert checked_heads(arch, [np.int64(0), np.int64(1)]) == [(0, 1)]
    assert checked_heads(arch, ["L1H0", (0, 2)]) == [(1, 0), (0, 2)]
    assert checked_heads(arch, []) == []
    with pytest.raises(InputError, match="more than once"):
        checked_heads(arch, [(0, 0), "L0H0"])
    with pytest.raises(InputError, match="1.5"):
        checked_heads(arch, [(0, 1.5)])
    with pytest.raises(InputError, match="out of range"):
        checked_heads(arch, [(0, 4)])
