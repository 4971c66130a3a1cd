"""Attention diagnostics: MAS matches the raw attention rows, object cells follow the coverage rule,
and IoU / ARS / VRA behave on hand-made grids."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from tolerance import assert_close

from countlens.analysis.attention_metrics import (
    aggregate,
    attention_iou,
    attention_metrics,
    attention_reward,
    grid_attention,
    object_cells,
    pixel_attention_iou,
    region_share,
)
from countlens.circuits.engine.attention import last_token_attention
from countlens.datasets.countingtricks import countingtricks
from countlens.datasets.scene import Obj, Scene
from countlens.errors import InputError, LayerError
from countlens.model.geometry import Geometry

GEOM = Geometry.square(192, 16, 2)  # the organism's grid: 6 × 6 token cells of 32 px


@pytest.fixture(scope="module")
def vlm(loaded):
    return loaded("toy")


@pytest.mark.numeric
def test_mas_matches_last_token_attention_and_metrics_are_bounded(vlm):
    samples = countingtricks(["1A", "9A"], 2, grid=vlm.geometry, prompt="short")
    layers = [0, 4]
    ds = attention_metrics(vlm, samples, layers=layers, batch_size=3)
    assert dict(ds.sizes) == {"layer": 2, "head": vlm.arch.n_heads, "sample": 4} and list(ds.layer.values) == layers
    mas = ds.mas.values
    assert ((mas >= 0) & (mas <= 1 + 1e-6)).all()
    batch = vlm.prepare([s.image for s in samples], [s.question for s in samples])
    att = last_token_attention(vlm, batch, layers)  # layer batch head seq
    ref = torch.stack([att[:, b][:, :, batch.image_pos[b]].sum(-1).mean(-1) for b in range(4)], -1)
    assert_close(mas, ref, what="MAS vs summed attention")  # shares of probabilities summing to 1
    assert ((ds.vra.values >= 0) & (ds.vra.values <= 1 + 1e-6)).all()
    assert ((ds.iou.values >= 0) & (ds.iou.values <= 1)).all()
    assert ((ds.ars.values >= -1) & (ds.ars.values <= 1)).all()
    assert ds.correct.dtype == bool and list(ds.case.values) == ["1A", "1A", "9A", "9A"]
    agg = aggregate(ds, by="case")
    assert set(agg.index.get_level_values("outcome")) <= {"all", "correct", "incorrect"}
    assert agg.loc[("1A", "all"), "n"] == 2
    assert_close(agg.loc[("1A", "all"), "mas"], ds.mas.mean("layer")[:2].mean(), what="aggregated MAS")
    assert aggregate(ds, by=None, per_layer=True).index.names == ["outcome", "layer"]
    with pytest.raises(LayerError):
        attention_metrics(vlm, samples[:1], layers=[99])


def test_attention_metrics_needs_scenes(vlm):
    class NoScene:
        question, answer, task, meta, scene = "how many circles are there in the image?", "3", "count", {}, None

    with pytest.raises(InputError, match="no scene"):
        attention_metrics(vlm, [NoScene()])


def test_object_cells_coverage_rule():
    # A 32-px square exactly on token cell (row 1, col 2): x 64..96, y 32..64.
    square = Scene(192, 192, (Obj("square", "red", 80.0, 48.0, 32.0),))
    want = torch.zeros(6, 6, dtype=torch.bool)
    want[1, 2] = True
    assert torch.equal(object_cells(square, GEOM), want)
    assert torch.equal(object_cells(square, GEOM, each_object=False), want)
    # A one-patch circle covers π/16 ≈ 20 % of a 2×2-patch token cell: only the per-object rule marks it.
    dot = Scene(192, 192, (Obj("circle", "red", 80.0, 48.0, 16.0),))
    assert not object_cells(dot, GEOM, each_object=False).any()
    assert torch.equal(object_cells(dot, GEOM), want)
    # A square straddling two cells (16 px in each) covers 50 % of each.
    wide = Scene(192, 192, (Obj("square", "red", 64.0, 48.0, 32.0),))
    assert object_cells(wide, GEOM, each_object=False).nonzero().tolist() == [[1, 1], [1, 2]]
    assert not object_cells(Scene(192, 192), GEOM).any()
    with pytest.raises(InputError, match="coverage"):
        object_cells(square, GEOM, coverage=0)


def test_grid_attention_drops_cellless_tokens_and_adds_shared_cells():
    cells = torch.tensor([[0, 0], [0, 1], [-1, -1], [0, 1]])
    grid = grid_attention(torch.tensor([[0.1, 0.2, 0.3, 0.4]]), cells, (1, 2))
    torch.testing.assert_close(grid, torch.tensor([[[0.1, 0.6]]]))


def _mask(*cells) -> torch.Tensor:
    m = torch.zeros(6, 6, dtype=torch.bool)
    for r, c in cells:
        m[r, c] = True
    return m


def test_iou_is_one_on_the_object_cells_and_partial_otherwise():
    obj = _mask((1, 2), (4, 4))
    exact = obj.float() * 0.3
    assert attention_iou(exact, obj).item() == 1.0
    spread = exact.clone()
    spread[0, 0] = 0.2  # above half the peak: one extra attended cell
    spread[5, 5] = 0.1  # below half the peak: ignored
    assert attention_iou(spread, obj).item() == pytest.approx(2 / 3)
    assert attention_iou(torch.zeros(6, 6), obj).item() == 0.0
    assert math.isnan(attention_iou(torch.zeros(6, 6), _mask()).item())
    batched = attention_iou(torch.stack([exact, spread]), obj)
    torch.testing.assert_close(batched, torch.tensor([1.0, 2 / 3]))


def test_ars_sign_and_vra_on_synthetic_maps():
    obj = _mask((1, 2), (4, 4), (2, 2))
    on = obj.float()
    off = (~obj).float()
    uniform = torch.ones(6, 6)
    assert attention_reward(on, obj).item() == pytest.approx(1.0)
    assert attention_reward(off, obj).item() == pytest.approx(-1.0)
    assert attention_reward(uniform, obj).item() == pytest.approx(0.0, abs=1e-6)
    tilted = uniform + 2 * on
    assert attention_reward(tilted, obj).item() > 0 > attention_reward(uniform + 2 * off, obj).item()
    assert math.isnan(attention_reward(uniform, _mask()).item())
    # A single sink cell is clipped, so it cannot outweigh a broad preference for the objects.
    sink = tilted.clone()
    sink[5, 0] = 100.0
    assert attention_reward(sink, obj).item() > 0 > attention_reward(sink, obj, quantile=1.0).item()
    assert region_share(uniform, obj).item() == pytest.approx(3 / 36)
    assert region_share(on, obj).item() == pytest.approx(1.0)
    assert region_share(on, obj, visual=torch.tensor(6.0)).item() == pytest.approx(0.5)
    with pytest.raises(InputError, match="same Geometry"):
        attention_iou(torch.ones(4, 4), obj)


def _pixel_iou_by_upsampling(grid_map: np.ndarray, scene, threshold: float = 0.5) -> float:
    """The paper's Attn-IoU written out: every pixel takes its cell's value, then IoU of pixel sets."""
    rows, cols = grid_map.shape
    r = np.minimum((np.arange(scene.height) + 0.5) * rows // scene.height, rows - 1).astype(int)
    c = np.minimum((np.arange(scene.width) + 0.5) * cols // scene.width, cols - 1).astype(int)
    pixels = grid_map[r][:, c]
    attended = pixels >= threshold * pixels.max()
    obj = scene.masks().any(0)
    return (attended & obj).sum() / (attended | obj).sum()


def test_pixel_iou_agrees_with_an_upsampled_pixel_mask():
    rng = np.random.default_rng(0)
    scene = Scene(192, 192, (Obj("circle", "red", 40, 50, 30), Obj("square", "blue", 130, 120, 44, 20)))
    maps = rng.random((5, 6, 6)) ** 4
    got = pixel_attention_iou(torch.from_numpy(maps), scene).numpy()
    want = [_pixel_iou_by_upsampling(m, scene) for m in maps]
    np.testing.assert_allclose(got, want, rtol=1e-6)  # float64 maps both ways: 1e-6 is 10⁹ ulps
    # All attention on the one cell holding most of the circle: IoU = its object pixels / (cell ∪ circle).
    only = torch.zeros(6, 6)
    only[1, 1] = 1.0
    assert float(pixel_attention_iou(only, scene)) == pytest.approx(_pixel_iou_by_upsampling(only.numpy(), scene))
    assert math.isnan(float(pixel_attention_iou(torch.zeros(6, 6), Scene(192, 192, ()))))


def test_pixel_iou_with_a_dropped_strip_cuts_cells_over_the_seen_part_only():
    """SigLIP at 384 px: 27 cells of 14 px over the first 378 px; the 6 px strip is in no cell. Checked
    against a per-pixel count (each seen pixel in cell ``pixel // 14``; the strip in neither set)."""
    from countlens.model.geometry import Geometry

    geometry = Geometry.square(384, 14, 1, dropped=True)
    scene = Scene(384, 384, (Obj("square", "red", 366, 100, 30), Obj("circle", "blue", 60, 370, 24)))
    maps = np.random.default_rng(1).random((3, 27, 27)) ** 4
    got = pixel_attention_iou(torch.from_numpy(maps), scene, geometry=geometry).numpy()
    obj = scene.masks().any(0)[:378, :378]
    cell = np.arange(378) // 14
    for m, g in zip(maps, got):
        attended = (m >= 0.5 * m.max())[cell][:, cell]
        assert g == pytest.approx((attended & obj).sum() / (attended | obj).sum(), rel=1e-6)
    # Cut evenly over all 384 px instead (no geometry), the cells are 14.2 px: another figure.
    assert not np.allclose(pixel_attention_iou(torch.from_numpy(maps), scene).numpy(), got)
    with pytest.raises(InputError, match="token grid is"):
        pixel_attention_iou(torch.zeros(6, 6), scene, geometry=geometry)


@pytest.mark.numeric
def test_the_papers_attention_iou_is_per_layer_head(vlm):
    samples = countingtricks(["1A", "5A"], 1, grid=vlm.geometry, prompt="short")
    iou = attention_metrics(vlm, samples, layers=[0, 2], batch_size=2).pixel_iou
    assert iou.dims == ("layer", "head", "sample") and iou.shape == (2, vlm.arch.n_heads, 2)
    batch = vlm.prepare([s.image for s in samples], [s.question for s in samples])
    att = last_token_attention(vlm, batch, [2])[0, 1]  # head seq, sample 1
    grid = grid_attention(att[:, batch.image_pos[1]], batch.image_cell[1], vlm.geometry.token_grid)
    want = [_pixel_iou_by_upsampling(grid[h].numpy(), samples[1].scene) for h in range(vlm.arch.n_heads)]
    # The IoU is a ratio of pixel counts of the cells at or above half the peak: rounding moves it only if
    # it moves a cell across that threshold. A probability rounds relative to itself (≈ 1e-6 of it in
    # float32 after a softmax), and every cell here stands ≥ 1 % of its head's peak away from the threshold
    # (measured: 1–5 %), so both computations pick the same cells and rtol absorbs only the division.
    peak = grid.flatten(1).amax(-1)[:, None, None]
    assert bool(((grid - 0.5 * peak).abs() > 1e-3 * peak).all())
    np.testing.assert_allclose(iou.sel(layer=2, sample=1).values, want, rtol=1e-5)
