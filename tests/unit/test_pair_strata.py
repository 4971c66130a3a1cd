"""count_pairs draws its pairs stratified over the ordered count pairs, balanced at any n, seeded;
count_table gives the clean × corrupt table of a set of pairs."""

from __future__ import annotations

from collections import Counter
from itertools import permutations

import pytest

from countlens.datasets.pairs import count_pair, count_pairs, count_table, pair_counts
from countlens.errors import InputError, RunDirError

COUNTS = tuple(range(1, 10))
K = len(COUNTS) * (len(COUNTS) - 1)  # 72 ordered pairs of distinct counts


def drawn(pairs) -> list[tuple[int, int]]:
    return [(p.clean.meta["count"], p.corrupt.meta["count"]) for p in pairs]


@pytest.mark.parametrize("n", [16, 128, 131])  # 131: a prime
def test_every_count_pair_gets_floor_or_ceil_of_n_over_k_and_clean_counts_are_even(n):
    got = drawn(count_pairs(n, kind="shapes", image_size=32, seed=3, counts=COUNTS))
    per_pair = Counter(got)
    assert set(per_pair) <= set(permutations(COUNTS, 2))
    assert {per_pair.get(p, 0) for p in permutations(COUNTS, 2)} <= {n // K, -(-n // K)}
    clean, corrupt = Counter(c for c, _ in got), Counter(d for _, d in got)
    assert set(clean) == set(COUNTS) and set(corrupt) == set(COUNTS)  # n ≥ 9: the whole range on both sides
    assert max(clean.values()) - min(clean.values()) <= 1 and max(corrupt.values()) - min(corrupt.values()) <= 1
    table = count_table(count_pairs(n, kind="shapes", image_size=32, seed=3, counts=COUNTS))
    assert table.dims == ("clean", "corrupt") and list(table.clean.values) == list(COUNTS)
    assert int(table.sum()) == n and all(int(table.sel(clean=c, corrupt=d)) == k for (c, d), k in per_pair.items())


def test_a_mix_is_balanced_as_one_set_and_each_kind_keeps_its_own_stream():
    mix = count_pairs(20, kind="dots+polygons", image_size=64, seed=4, counts=(2, 3, 4))
    assert {v for v in Counter(drawn(mix)).values()} <= {3, 4}  # 20 pairs over K = 6
    for i, p in enumerate(mix):
        own = count_pair(4, i // 2, p.kind, p.clean.meta["count"], p.corrupt.meta["count"], image_size=64)
        assert p.kind == ("dots", "polygons")[i % 2] and p.clean.scene == own.clean.scene


def test_same_seed_same_pairs_another_seed_another_draw():
    a = [pair_counts(0, i, counts=COUNTS, order="stratified") for i in range(16)]
    assert drawn(count_pairs(16, image_size=32, seed=0)) == a  # a pure function of its arguments
    assert drawn(count_pairs(16, image_size=32, seed=0)) == a
    assert [pair_counts(1, i, counts=COUNTS, order="stratified") for i in range(16)] != a
    # The old order stays one argument away (the planted organisms train on it).
    assert drawn(count_pairs(3, image_size=32, order="cycle")) == [(1, 2), (1, 3), (1, 4)]


def test_the_stratified_order_is_recorded_and_rebuilds():
    from countlens.datasets import rebuild

    p = count_pairs(5, image_size=32, seed=2)[4]
    assert p.clean.recipe["order"] == "stratified"
    again = rebuild(p.clean.recipe)
    assert drawn([again]) == drawn([p]) and again.corrupt.scene == p.corrupt.scene


def test_bad_order_and_pairs_without_counts_are_refused_by_name():
    with pytest.raises(InputError, match=r"order='shuffled': use one of 'stratified', 'cycle'"):
        count_pairs(2, image_size=32, order="shuffled")
    with pytest.raises(InputError, match=r"pair 1 \(tuple\) carries no counts.*count_pairs draws them"):
        count_table([(1, 2), ("a", 3)])
    assert count_table([(3, 5), (3, 5), (5, 3)]).sel(clean=3, corrupt=5) == 2


# The report: the pairs' count table, and a mark beside a stage whose normaliser is below the noise rule.


def _results(pairs, **noisy_attrs) -> dict:
    import numpy as np
    import xarray as xr

    from countlens.results import provenance

    cases = xr.Dataset(
        {
            v: ("sample", np.array(x))
            for v, x in {"correct": [1.0, 1.0], "gold": ["1", "2"], "count": [1, 2], "pred": ["1", "2"]}.items()
        }
    )
    heads = xr.Dataset({"effect": ("layer", np.zeros(2))}, attrs=provenance("toy", "qwen2_vl", samples=pairs))
    heads.attrs.update(noisy_attrs)
    return {"cases": cases, "heads": heads}


def test_the_report_header_gives_the_pairs_count_table_from_the_results_recipe(tmp_path):
    from countlens.pipeline.report import header_text
    from countlens.pipeline.report_notes import pairs_values, recipe_counts
    from countlens.pipeline.stages import ReportContext
    from countlens.results import recipe_of

    pairs = count_pairs(16, image_size=32, seed=5)
    values = pairs_values(_results(pairs))
    assert (values["n"], values["order"], values["k"], values["low"], values["high"]) == (16, "stratified", 72, 0, 1)
    header = header_text(ReportContext("toy", "qwen2_vl", tmp_path, {}, _results(pairs), None), "short", values)
    assert "**Pairs.** The patching stages read 16 count pairs, drawn stratified over the 72 ordered pairs" in header
    assert values["table"] in header and "clean \\ corrupt" in values["table"]
    damaged = _results(pairs)
    damaged["heads"].attrs["data_recipe"] = "[{not json"
    with pytest.raises(RunDirError, match=r"results/heads.nc records a data_recipe the report cannot read"):
        pairs_values(damaged)
    # A run made before the stratified order (its recipe names no order) is told as it ran: in order.
    old = [{k: v for k, v in entry.items() if k != "order"} for entry in recipe_of(pairs)]
    assert recipe_counts(old) == (
        [(1, 2), (1, 3), (1, 4), (1, 5), (1, 6), (1, 7), (1, 8), (1, 9)] + [(2, 1)] + [(2, c) for c in range(3, 10)],
        {"cycle"},
        0,
    )


def test_a_stage_whose_normaliser_is_below_the_noise_rule_is_marked_beside_its_section(tmp_path):
    from countlens.circuits.engine.pair_batch import NOISE_K
    from countlens.pipeline.report import header_text, noise_mark
    from countlens.pipeline.report_notes import with_mark
    from countlens.pipeline.stages import ReportContext

    pairs = count_pairs(2, image_size=32)
    noisy = _results(pairs, normaliser=-0.021, normaliser_se=0.05, normaliser_noisy=1)
    mark = noise_mark(noisy, ("vap", "heads"))
    assert f"differ by less than their noise: k={NOISE_K:g}" in mark and "= -0.021" in mark and "NOISE_K" in mark
    assert mark.startswith("> **Noisy normaliser (`heads`)")
    assert with_mark("## 3. Heads\n\n![heads](figures/heads.png)", mark).startswith(f"## 3. Heads\n\n{mark}\n")
    assert noise_mark(_results(pairs, normaliser=2.0, normaliser_se=0.05, normaliser_noisy=0), ("heads",)) == ""
    # A noisy stage no section shows is marked in the header.
    lens = {**noisy, "lens": noisy.pop("heads")}
    ctx = ReportContext("toy", "qwen2_vl", tmp_path, {}, lens, None)
    assert "Noisy normaliser (`lens`)" in header_text(ctx, "short", None)


@pytest.mark.noise_rule
def test_discover_runs_its_stages_marking_a_noisy_normaliser_not_refusing_it(loaded, tmp_path, monkeypatch):
    import numpy as np

    from countlens.circuits.engine.pair_batch import normaliser
    from countlens.pipeline import discover
    from countlens.pipeline.config import DiscoverConfig

    noise = np.array([1.0, -1.0, 1.0, -1.0])  # Σ = 0.01 against a standard error of 2: noise
    with pytest.raises(InputError, match="within 2 standard errors"):
        normaliser(0.0, 0.01, noise)  # outside discover the rule refuses it
    seen = []
    monkeypatch.setattr(discover, "check_inputs", lambda *args: None)  # its samples are not what this checks
    monkeypatch.setattr(discover, "_run", lambda *args: seen.append(normaliser(0.0, 0.01, noise)) or tmp_path)
    discover.discover(loaded("toy"), tmp_path / "run", DiscoverConfig(n_pairs=2), log=lambda line: None)
    assert seen == [0.01]
