"""Attention drawn on the image (`countlens.analysis.overlays`), the maps it draws from
(`countlens.analysis.attention_maps`) and the discover stage that stores them
(`countlens.pipeline.stages.attention_maps`): a constructed map lights its own cell, under the grid
layout and under tiled ones; the stored rows are the model's own attention; the stage resumes and its
report section renders."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import xarray as xr
from jinja2 import Environment, FileSystemLoader, StrictUndefined
from PIL import Image
from tolerance import assert_close

from countlens import results
from countlens.analysis import overlays
from countlens.analysis.attention_maps import attention_maps
from countlens.circuits.engine.attention import eager_attention
from countlens.datasets.countingtricks import countingtricks
from countlens.errors import InputError
from countlens.model.geometry import Geometry
from countlens.model.layouts import token_cells
from countlens.pipeline.config import DiscoverConfig, resolved_prompt
from countlens.pipeline.inputs import stage_inputs
from countlens.pipeline.rundir import Stages
from countlens.pipeline.stages import REQUIRED, SECTIONS, STAGES, ReportContext, RunContext
from countlens.pipeline.stages import attention_maps as stage

GEOM = Geometry(image_height=192, image_width=192, patch_size=16, merge_size=2)  # a 6 × 6 token grid
CELL = 192 // 6


def _cyan(rgb: np.ndarray) -> np.ndarray:
    """The objects' outlines: green and blue, little red."""
    return (rgb[..., 1] > 150) & (rgb[..., 2] > 150) & (rgb[..., 0] < 100)


def _bright(rgb: np.ndarray) -> np.ndarray:
    """The pixels within 10 % of the brightest (luminance), outlines aside."""
    lum = rgb[..., :3].astype(float) @ np.array([0.299, 0.587, 0.114])
    lum[_cyan(rgb)] = 0
    return lum >= 0.9 * lum.max()


def _inside(mask: np.ndarray, row: int, col: int, cell: int) -> bool:
    ys, xs = np.nonzero(mask)
    return bool(ys.min() >= row * cell and ys.max() < (row + 1) * cell and xs.min() >= col * cell)


# layout, tiles, the attended token, the base cell it lies in, its view
CONSTRUCTED = [
    ("grid", None, 6 * 4 + 1, (4, 1), 0),
    # 2 × 2 tiles of 36 tokens, then the thumbnail: tile 3's first token is (6, 6) of the stitched
    # 12 × 12 grid, whose centre falls in base cell (3, 3).
    ("tiles_thumbnail", (2, 2), 3 * 36, (3, 3), 1),
    # the base grid, then a 12 × 12 high-resolution grid with a newline ending each row: its row 11,
    # column 0 (token 36 + 11 · 13) lies in base cell (5, 0).
    ("anyres", None, 36 + 11 * 13, (5, 0), 1),
]


def _constructed(layout, tiles, hot):
    n = {"grid": 36, "tiles_thumbnail": 36 * 5, "anyres": 36 + 12 * 13}[layout]
    tc = token_cells(layout, GEOM, n, 0, tiles)
    weights = np.full(n, 0.1 / n)
    weights[hot] = 0.5
    return tc, weights


@pytest.mark.parametrize(("layout", "tiles", "hot", "cell", "view"), CONSTRUCTED)
def test_a_constructed_map_lights_the_attended_tokens_cell(layout, tiles, hot, cell, view):
    tc, weights = _constructed(layout, tiles, hot)
    grid = overlays.token_map(weights, tc, GEOM.token_grid)
    assert np.unravel_index(grid.argmax(), grid.shape) == cell
    # Every token with a cell adds in: the map holds all the weight but the newlines'.
    assert np.isclose(grid.sum(), weights[(tc.cells >= 0).all(-1).numpy()].sum())
    own = overlays.token_map(weights, tc, GEOM.token_grid, view=view)
    assert np.unravel_index(own.argmax(), own.shape) == cell
    if layout != "grid":  # the other view holds none of the attended token's weight: it is flat
        other = overlays.token_map(weights, tc, GEOM.token_grid, view=1 - view)
        assert np.allclose(other[other > 0], other.max())
    # Drawn over a black image, the brightest pixels are the attended cell's.
    drawn = overlays.blend(np.zeros((192, 192, 3), np.uint8), grid)
    assert _inside(_bright(drawn), *cell, CELL)


def test_token_map_refuses_what_it_cannot_place():
    tc, weights = _constructed("grid", None, 0)
    with pytest.raises(InputError, match="one weight per image token"):
        overlays.token_map(weights[:-1], tc, GEOM.token_grid)
    with pytest.raises(InputError, match="beyond the 3x3 grid"):
        overlays.token_map(weights, tc, (3, 3))
    with pytest.raises(InputError, match="no token is in view 1"):
        overlays.token_map(weights, tc, GEOM.token_grid, view=1)


def _stored(layout, tiles, hot) -> xr.Dataset:
    """A stored result (the schema of `attention_maps`) of one black image and one head's constructed
    attention."""
    tc, weights = _constructed(layout, tiles, hot)
    n = len(weights)
    objects = np.zeros((1, 192, 192), np.uint8)
    objects[0, 10:30, 10:30] = 1
    return xr.Dataset(
        {
            "attention": (("site", "sample", "token"), weights[None, None].astype(np.float32)),
            "layer_mean": (("layer", "sample", "token"), weights[None, None].astype(np.float32)),
            "cell_row": (("sample", "token"), tc.cells[None, :, 0].numpy()),
            "cell_col": (("sample", "token"), tc.cells[None, :, 1].numpy()),
            "view": (("sample", "token"), tc.views[None].numpy()),
            "n_tokens": ("sample", [n]),
            "grid_rows": ("sample", [6]),
            "grid_cols": ("sample", [6]),
            "image": (("sample", "y", "x", "rgb"), np.zeros((1, 192, 192, 3), np.uint8)),
            "objects": (("sample", "y", "x"), objects),
            "image_height": ("sample", [192]),
            "image_width": ("sample", [192]),
            "correct": ("sample", [True]),
        },
        coords={"site_layer": ("site", [2]), "site_head": ("site", [1]), "layer": [2], "sample": [0]},
    )


@pytest.mark.parametrize(("layout", "tiles", "hot", "cell", "view"), CONSTRUCTED)
def test_a_heads_png_is_the_image_with_the_attended_cell_brightest(layout, tiles, hot, cell, view):
    ds = _stored(layout, tiles, hot)
    for head in (1, None):  # the head, and the layer's mean
        [(caption, png)] = overlays.head_overlays_png(ds, 2, head, scale=2)
        rgb = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))
        assert rgb.shape == (384, 384, 3)
        assert _inside(_bright(rgb), *cell, 2 * CELL)
        assert "right" in caption and ("L2H1" if head == 1 else "L2 mean") in caption
    # The object's outline is drawn around its square (10 … 30 px, × 2), not elsewhere.
    ys, xs = np.nonzero(_cyan(rgb))
    assert len(ys) and ys.min() >= 2 * 8 and ys.max() <= 2 * 32 and xs.max() <= 2 * 32
    with pytest.raises(InputError, match="L0H0 is not stored"):
        overlays.head_overlays_png(ds, 0, 0)


def test_a_heads_panel_shows_its_stored_maps_and_nothing_for_a_head_not_stored():
    """report.html's panels (`head_panels.head_images`) on the stored result: the stored head's
    overlays, and none (not an error) for a head a large model's run did not keep."""
    from countlens.pipeline import head_panels

    ds = _stored(*CONSTRUCTED[0][:3])
    assert head_panels.head_images(ds, 2, 1) == overlays.head_overlays_png(ds, 2, 1)
    assert head_panels.head_images(ds, 0, 0) == [] and head_panels.head_images(None, 2, 1) == []


@pytest.fixture(scope="module")
def vlm(loaded):
    return loaded("toy")


@pytest.mark.numeric
def test_stored_rows_are_the_models_own_attention(vlm):
    samples = countingtricks(["1A", "9B", "4A"], 1, grid=vlm.geometry, prompt="short")
    ds = attention_maps(vlm, samples, batch_size=3)
    assert ds.attrs["heads"] == "all" and ds.sizes["site"] == vlm.arch.n_layers * vlm.arch.n_heads
    one = vlm.prepare_samples([samples[1]])  # alone, no padding: a plain eager forward
    with eager_attention(vlm), torch.no_grad():
        out = vlm.hf(**one.inputs, output_attentions=True)
    for layer, probs in enumerate(out.attentions):
        want = probs[0, :, one.last[0], one.image_pos[0]]  # Float[Tensor, "head n_image"]
        got = ds.attention.isel(sample=1).values[ds.site_layer.values == layer]
        assert_close(got, want, scale=1.0, what=f"layer {layer}'s stored attention")
        assert_close(ds.layer_mean.sel(layer=layer).isel(sample=1).values, want.mean(0), scale=1.0)
    # The image and its objects are the sample's own (192 px: stored at full size).
    assert (ds.image.values[1] == np.asarray(samples[1].image)).all()
    assert (ds.objects.values[1] > 0).sum() == samples[1].scene.masks().any(0).sum()
    # Over the size budget, the ranking's first heads are kept, their rows unchanged.
    small = attention_maps(vlm, samples, batch_size=3, ranking=[(5, 1), (0, 0), (2, 3), (1, 1)], max_values=36 * 9)
    assert list(zip(small.site_layer.values, small.site_head.values)) == [(5, 1), (0, 0), (2, 3)]
    for i, (la, h) in enumerate([(5, 1), (0, 0), (2, 3)]):  # the same forwards, fewer rows kept: bit for bit
        full = ds.attention.values[(ds.site_layer.values == la) & (ds.site_head.values == h)][0]
        assert np.array_equal(small.attention.values[i], full)
    assert np.array_equal(small.layer_mean.values, ds.layer_mean.values) and "top 3" in small.attrs["heads"]


def test_choose_takes_right_then_wrong_answers_spread_over_the_run():
    correct = np.array([True] * 10 + [False] * 3 + [True] * 6)
    picked = stage.choose(correct)
    assert picked.tolist() == [0, 5, 13, 18, 10, 11, 12]  # the 16 right at positions 0, 5, 10, 15
    assert stage.choose(correct, 2).tolist() == [0, 18, 10, 12]
    assert stage.choose(np.ones(3, bool)).tolist() == [0, 1, 2]  # fewer than asked: all of them


@pytest.fixture(scope="module")
def run_dir(vlm, tmp_path_factory):
    """A run directory whose ``cases`` are answered (the organism, one sample per case) and whose head
    patching effects are made up, with the stage computed once and resumed once."""
    out = tmp_path_factory.mktemp("run")
    config = DiscoverConfig(n_per_case=1, n_pairs=1, n_samples=1, batch_size=8)
    prompt = resolved_prompt(vlm, config)
    run = RunContext(vlm, config, prompt, stage_inputs(vlm, config, prompt), out, None, print)
    run.results["cases"] = run.answers(run.inputs["cases"]())
    effect = np.arange(24, dtype=float).reshape(6, 4) / 24
    effect[1, 2] = -2.0  # the most important head by |effect|
    run.results["heads"] = xr.Dataset(
        {"effect": (("layer", "head"), effect)}, coords={"layer": range(6), "head": range(4)}
    )
    stages = Stages(out, {"model": vlm.name, "arch": vlm.arch.name})
    first = stages.run("attention_maps", lambda: stage.ATTENTION_MAPS.compute(run))
    logged = []
    stages.log = logged.append

    def recompute():
        raise AssertionError("a finished stage is recomputed")

    again = stages.run("attention_maps", recompute)
    return out, run, first, again, logged


def test_the_stage_stores_the_chosen_samples_and_resumes(run_dir):
    out, run, first, again, logged = run_dir
    assert "attention_maps" in REQUIRED and stage.ATTENTION_MAPS in STAGES and stage.SECTION in SECTIONS
    assert logged == [f"[attention_maps] done before: {out / 'results' / 'attention_maps.nc'}"]
    xr.testing.assert_identical(again, results.load(out / "results" / "attention_maps.nc"))
    xr.testing.assert_equal(first, again)
    cases = run.results["cases"]
    assert first["index"].values.tolist() == stage.choose(cases.correct.values).tolist()
    assert (first.correct.values == cases.correct.values[first["index"].values]).all()
    assert list(first.case.values) == [str(c) for c in cases.case.values[first["index"].values]]
    samples = run.inputs["cases"]()
    for i, index in enumerate(first["index"].values):
        assert (first.image.values[i] == np.asarray(samples[index].image)).all()


def test_the_report_section_draws_the_key_heads_from_stored_results(run_dir):
    out, run, first, again, _ = run_dir
    table = pd.DataFrame({"layer": np.repeat(range(6), 4), "head": np.tile(range(4), 6)})
    table["importance"] = np.abs(run.results["heads"].effect.values.ravel())
    ctx = ReportContext("toy", "qwen2_vl", out, {}, {"attention_maps": again}, table)
    values = stage.SECTION.values(ctx)
    assert values["heads"] == "L1H2, L5H3, L5H2" and values["layers"] == "0, 2, 3, 5"
    stage.SECTION.draw(ctx)
    figure = Image.open(out / "figures" / "attention_on_image.png")
    n = again.sizes["sample"]
    assert figure.size[1] == pytest.approx(100 * (1.5 * n + 0.4), abs=2)  # one row per sample
    env = Environment(
        loader=FileSystemLoader(Path(stage.__file__).parent.parent / "templates"), undefined=StrictUndefined
    )
    env.filters["fmt"] = format
    text = env.get_template(f"sections/{stage.SECTION.template}").render(number=6, **values)
    assert text.startswith("## 6. Attention on the image") and "figures/attention_on_image.png" in text
    assert "| L1H2 " in text and "| L5 mean " in text
    assert f"{values['n_right']} scenes answered right" in text and values["n_right"] + values["n_wrong"] == n


@pytest.mark.numeric
@pytest.mark.matrix
@pytest.mark.parametrize("name", ["internvl", "llava_next"])
def test_a_tiled_models_tokens_are_stored_with_their_views(loaded, name):
    """A tiny tiled model (InternVL's tiles and thumbnail, LLaVA-NeXT's base image and crops): every
    image token is stored with the cell `VLM.prepare` gives it and its view, and each view's map holds
    that view's share of the head's attention."""
    from tiny_models import TINY_IMAGE_SIZE

    from countlens.circuits.engine.attention import image_keys, last_token_attention
    from countlens.datasets import task_samples

    vlm = loaded(name)
    samples = task_samples("count", 1, seed=3, image_size=TINY_IMAGE_SIZE[name][0])
    ds = attention_maps(vlm, samples)
    batch = vlm.prepare_samples(samples)
    keys, cells = image_keys(batch, 0)
    assert int(ds.n_tokens[0]) == len(keys) and set(np.unique(ds.view.values)) == {0, 1}
    assert (ds.cell_row.values[0] == cells[:, 0].numpy()).all() and (ds.cell_col.values[0] == cells[:, 1].numpy()).all()
    attn = last_token_attention(vlm, batch)[:, 0][..., keys]  # Float[Tensor, "layer head n_image"]
    placed = torch.from_numpy((ds.cell_row.values[0] >= 0) & (ds.cell_col.values[0] >= 0))
    for view in (0, 1):
        on_view = torch.from_numpy(ds.view.values[0] == view) & placed
        grid = overlays.sample_map(ds, 0, 0, 0, view=view)
        assert grid.shape == (int(ds.grid_rows[0]), int(ds.grid_cols[0]))
        assert_close(grid.sum(), attn[0, 0][on_view].sum(), scale=1.0, what=f"view {view}'s share")
