"""The report's figures show the run's numbers: read back from the drawn matplotlib Figure (its images'
arrays, texts, legend and title), not from the PNG's look."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import xarray as xr

from countlens.analysis.figures import canvas, counting, curves, grids
from countlens.analysis.metrics import number_avoidance
from countlens.datasets.countingtricks import CASES
from countlens.datasets.paper_generator import REFERENCE_CASES
from countlens.pipeline.stages import cases as cases_stage
from countlens.pipeline.stages.attention import modality_shares
from countlens.pipeline.stages.base import ReportContext
from countlens.pipeline.stages.classes import key_head_tokens


def _grid(n_layers: int, n_heads: int, seed: int = 0) -> xr.DataArray:
    values = np.random.default_rng(seed).normal(size=(n_layers, n_heads))
    return xr.DataArray(values, dims=("layer", "head"), coords={"layer": range(n_layers), "head": range(n_heads)})


def _cases_nc(tmp_path, names, seed: int = 0) -> xr.Dataset:
    """A cases result over ``names`` with uneven per-case accuracies, written to cases.nc and read back."""
    rng = np.random.default_rng(seed)
    case = np.repeat(list(names), 7)
    count = rng.integers(1, 10, size=case.size)
    correct = rng.random(case.size) < rng.random(len(names)).repeat(7)
    ds = xr.Dataset({"correct": ("sample", correct), "case": ("sample", case), "count": ("sample", count)})
    ds.to_netcdf(tmp_path / "cases.nc")
    return xr.load_dataset(tmp_path / "cases.nc")


def _context(tmp_path, results: dict, design: str = "countlens", table=None) -> ReportContext:
    return ReportContext("toy", "qwen2_vl", tmp_path, {"design": design}, results, table)


def _title_inside(fig) -> bool:
    """Measured on the drawn figure, as savefig lays it out (`finish` measures the title alone)."""
    fig.canvas.draw()
    box = fig._suptitle.get_window_extent(fig.canvas.get_renderer())
    return box.x0 >= 0 and box.y0 >= 0 and box.x1 <= fig.bbox.width and box.y1 <= fig.bbox.height


@pytest.mark.parametrize("design, names", [("countlens", list(CASES)), ("paper-code", list(REFERENCE_CASES))])
def test_the_case_grid_shows_each_cases_mean_of_cases_nc(tmp_path, design, names):
    ds = _cases_nc(tmp_path, names)
    means = {n: float(ds.correct.values[ds.case.values == n].mean()) for n in names}
    ctx = _context(tmp_path, {"cases": ds}, design)
    fig = counting.case_grid(cases_stage._by_case(ctx))
    grid, strip = (ax.images[0].get_array() for ax in fig.axes[:2])
    for n, mean in means.items():
        number, letter = int(n[:-1]), n[-1]
        if number <= 4:
            assert grid[number - 1, "ABCD".index(letter)] == pytest.approx(mean), n
    specials = [n for n in names if int(n[:-1]) > 4]
    assert list(strip[0]) == pytest.approx([means[n] for n in specials])
    assert [t.get_text() for t in fig.axes[1].get_xticklabels()] == specials
    shown = {(int(n[:-1]), n[-1]) for n in names if int(n[:-1]) <= 4}
    blank = [(p, v) for p in range(1, 5) for v in "ABCD" if (p, v) not in shown]
    assert all(
        np.ma.is_masked(grid[p - 1, "ABCD".index(v)]) or np.isnan(grid[p - 1, "ABCD".index(v)]) for p, v in blank
    )
    assert bool(blank) == (design == "paper-code")  # the code's design lacks 1C and 1D
    assert _title_inside(fig)


def test_the_cases_section_draws_its_figures(tmp_path):
    ds = _cases_nc(tmp_path, list(CASES))
    ctx = _context(tmp_path, {"cases": ds})
    cases_stage.SECTION.draw(ctx)
    assert {p.name for p in ctx.figures.iterdir()} == {"cases.png", "case_grid.png", "accuracy_by_count.png"}
    avoid = number_avoidance(ds)
    fig = counting.accuracy_by_count(avoid["per_count"], avoid["n"], avoid["r"])
    (line,) = fig.axes[0].get_lines()
    assert list(line.get_ydata()) == [avoid["per_count"][c] for c in sorted(avoid["per_count"])]


def test_the_class_map_has_one_colour_per_class_as_often_as_the_table_has_it():
    rng = np.random.default_rng(3)
    layers, heads = range(7), range(5)
    cells = [(la, h) for la in layers for h in heads][:-2]  # two heads the table lacks stay blank
    classes = rng.choice(list(grids.CLASS_COLOURS), size=len(cells))
    table = pd.DataFrame({"layer": [c[0] for c in cells], "head": [c[1] for c in cells], "class": classes})
    fig = grids.head_classes(table, list(layers), list(heads))
    image = fig.axes[0].images[0]
    rgba = image.to_rgba(image.get_array())
    legend = {h.get_label().rsplit(" (", 1)[0]: h.get_facecolor() for h in fig.legends[0].legend_handles}
    expected = table["class"].value_counts()
    assert set(legend) == set(expected.index)
    colours = {tuple(np.round(c, 4)) for c in legend.values()}
    assert len(colours) == len(legend)  # no two classes share a colour
    for name, colour in legend.items():
        cells_of = np.all(np.isclose(rgba, colour, atol=1e-3), axis=-1).sum()
        assert cells_of == expected[name], name
    assert np.all(np.isclose(rgba[-1, -2:], (1, 1, 1, 1)))  # the blank heads: white, no class


def test_the_class_map_refuses_an_unknown_class():
    table = pd.DataFrame({"layer": [0], "head": [0], "class": ["mystery"]})
    with pytest.raises(Exception, match="mystery.*countlens classify"):
        grids.head_classes(table, [0], [0])


def test_a_small_heatmap_writes_every_value_and_a_large_one_none():
    small = _grid(6, 4)
    fig = grids.heatmap(small, "small")
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert texts == [format(v, ".2f") for v in small.values.ravel()]
    assert len(fig.axes) == 2  # the map and its colour bar
    fig = grids.heatmap(_grid(36, 40), "large", center=True)
    assert len(fig.axes[0].texts) == 0
    ticks = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    assert len(ticks) <= canvas.MAX_TICKS and ticks[:2] == ["0", "4"]
    assert len(fig.axes[0].get_yticklabels()) <= canvas.MAX_TICKS
    edge = grids.ANNOTATE_MAX
    assert len(grids.heatmap(_grid(edge, edge), "edge").axes[0].texts) == edge * edge
    assert len(grids.heatmap(_grid(edge + 1, 2), "past the edge").axes[0].texts) == 0


@pytest.mark.parametrize("shape", [(36, 40), (28, 28), (6, 2), (1, 1)])
def test_a_heatmaps_title_fits_inside_the_figure(shape):
    long = "Attention of the last token on image tokens, averaged over every counting sample of the run"
    fig = grids.heatmap(_grid(*shape), long)
    assert _title_inside(fig)
    assert fig._suptitle.get_text().replace("\n", " ") == long  # wrapped, not cut


def test_cell_numbers_stay_readable_on_a_diverging_map():
    da = _grid(2, 2) * 0 + np.array([[-1.0, 0.0], [0.01, 1.0]])
    fig = grids.heatmap(da, "contrast", center=True)
    colours = [t.get_color() for t in fig.axes[0].texts]
    assert colours == ["white", "black", "black", "white"]  # dark ends, white middle


def test_emergence_is_the_first_layer_from_which_the_answer_stays_rank_1():
    rank = np.array([[0, 0, 0, 0], [3, 0, 1, 0], [2, 1, 0, 0], [0, 0, 0, 5]])  # sample × layer
    ds = xr.Dataset({"rank": (("sample", "layer"), rank)}, coords={"layer": [10, 11, 12, 13], "sample": range(4)})
    assert list(curves.emergence_layer(ds).values) == [10, 13, 12, -1]
    fig = curves.rank_emergence(ds)
    ax = fig.axes[0]
    assert [b.get_height() for b in ax.patches] == [0.25, 0.0, 0.25, 0.25]
    assert list(ax.get_lines()[0].get_ydata()) == [0.5, 0.75, 0.75, 0.75]


def test_modality_shares_split_the_answer_positions_attention_by_outcome():
    mas = np.array([[0.1, 0.3, 0.5], [0.3, 0.5, 0.7]])  # layer × sample
    am = xr.Dataset(
        {m: (("layer", "sample"), mas) for m in ("mas", "vra", "iou", "ars")}
        | {"correct": ("sample", [True, True, False])}
    )
    shares = modality_shares(am)
    assert list(shares.index) == ["correct (n=2)", "wrong (n=1)"]
    assert shares["image"].tolist() == pytest.approx([0.3, 0.6])
    assert shares.sum(axis=1).tolist() == pytest.approx([1.0, 1.0])
    fig = counting.modality_share(shares, "last prompt token")
    assert [round(p.get_width(), 6) for p in fig.axes[0].patches] == [0.3, 0.6, 0.7, 0.4]


def test_key_head_tokens_are_each_classes_top_head_and_its_most_shared_tokens():
    tokens = np.array([[["3", "4"], ["3", "dot"], ["3", "3"]], [["a", "b"], ["a", "b"], ["c", "b"]]])  # head×sample×k
    headlens = xr.Dataset(
        {"token": (("layer", "head", "sample", "k"), tokens[None])},
        coords={"layer": [2], "head": [0, 1]},
        attrs={"top_k": 2},
    )
    table = pd.DataFrame(
        {"layer": [2, 2], "head": [1, 0], "class": ["awareness", "awareness"], "importance": [0.9, 0.1]}
    )
    got = key_head_tokens(table, headlens, shown=2)
    assert got.to_dict("records") == [
        {"head": "L2H1", "class": "awareness", "HeadLens tokens": "`'b'` 1.00, `'a'` 0.67"}
    ]


def test_modality_shares_use_the_code_sets_when_the_run_read_the_generation_step():
    sets = np.random.default_rng(5).random((2, 4, 3))  # layer × set (special, system, image, text) × sample
    am = xr.Dataset(
        {"sets": (("layer", "set", "sample"), sets), "correct": ("sample", [False, True, True])},
        coords={"set": ["special", "system", "image", "text"]},
    )
    shares = modality_shares(am)
    right = sets[:, :, 1:].mean(-1)  # the correct samples' mean sums, then per layer renormalised
    expected = (right / right.sum(1, keepdims=True)).mean(0)
    assert list(shares.columns) == ["special", "system", "image", "text"]
    assert shares.loc["correct (n=2)"].tolist() == pytest.approx(expected.tolist())
    assert shares.loc["wrong (n=1)", "image"] == pytest.approx((sets[:, 2, 0] / sets[:, :, 0].sum(1)).mean())
