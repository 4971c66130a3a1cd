"""Taps put each image token (and each ViT patch) on the cell of the image it covers."""

from __future__ import annotations

import pytest
import torch
from tiny_models import TINY_IMAGE_SIZE
from tolerance import assert_close

from countlens.circuits.lenses.taps import tap
from countlens.datasets.scene import Obj, Scene
from countlens.datasets.tasks import TaskSample
from countlens.errors import InputError


def _scene_sample(size: int, objs=()) -> TaskSample:
    return TaskSample(Scene(size, size, tuple(objs)), "how many circles are there in the image?", "1", "count")


@pytest.mark.parametrize(
    "name", ["toy", "qwen2_vl", "qwen2_5_vl", "llava", "gemma3", "internvl", "ovis2", "phi4_multimodal", "mllama"]
)
def test_an_object_changes_its_own_cell(name, loaded):
    vlm = loaded(name)
    size = vlm.geometry.image_height if name == "toy" else TINY_IMAGE_SIZE[name][0]
    g = vlm.geometry_for(size, size)
    p, unit = g.patch_size, g.token_size
    # A square filling exactly patch (row 2, col 1) of the ViT grid, i.e. one token cell. InternVL's
    # grid is one tile's; the 2×-larger image is 2×2 tiles and a thumbnail, so scale the square.
    row, col = 2, 1
    k = size / g.image_height
    obj = Obj("square", "red", (col + 0.5) * p * k, (row + 0.5) * p * k, p * k)
    samples = [_scene_sample(size), _scene_sample(size, [obj])]
    proj = tap(vlm, samples, "projector")
    change = (proj[1] - proj[0]).norm(dim=0)
    trow, tcol = int((row + 0.5) * p // unit), int((col + 0.5) * p // unit)
    # The vision tower mixes patches by attention, but the object's own token changes most.
    assert divmod(int(change.argmax()), change.shape[1]) == (trow, tcol)
    if name in ("toy", "qwen2_vl", "qwen2_5_vl", "llava", "internvl", "ovis2"):
        vis = tap(vlm, samples, "vision", 0)
        vchange = (vis[1] - vis[0]).norm(dim=0)
        assert vis.shape[-2:] == g.patch_grid
        assert divmod(int(vchange.argmax()), g.patch_grid[1]) == (row, col)
    if name == "mllama":  # the image never enters the residual stream
        with pytest.raises(InputError, match="cross-attention"):
            tap(vlm, samples, "llm", 0)
        return
    llm = tap(vlm, samples, "llm", 0)
    assert llm.shape == proj.shape


def test_tap_errors(loaded):
    vlm = loaded("toy")
    s = [_scene_sample(192)]
    with pytest.raises(InputError, match="unknown tap"):
        tap(vlm, s, "retina")
    with pytest.raises(InputError, match="needs an index"):
        tap(vlm, s, "llm")
    with pytest.raises(InputError, match="out of range"):
        tap(vlm, s, "vision", 7)
    torch.manual_seed(0)


@pytest.mark.numeric
def test_qwen2_5_vl_vision_tap_is_the_patch_grid_the_merger_reads(loaded):
    # Oracle: put the last block's mapped patches back in merge-block order and run the tower's own
    # merger on them; that must give the image tokens the language model receives, cell for cell.
    vlm = loaded("qwen2_5_vl")
    size = TINY_IMAGE_SIZE["qwen2_5_vl"][0]
    p = vlm.geometry_for(size, size).patch_size
    samples = [
        _scene_sample(size, [Obj("circle", "red", 1.5 * p, 2.5 * p, p)]),
        _scene_sample(size, [Obj("square", "blue", 5.5 * p, 4.5 * p, 2 * p)]),
    ]
    blocks = vlm.hf.get_submodule(vlm.arch.spec.vision_blocks)
    vis = tap(vlm, samples, "vision", len(blocks) - 1)
    proj = tap(vlm, samples, "projector")
    n, d, rows, cols = vis.shape
    m = vlm.arch.merge_size
    merge_order = vis.permute(0, 2, 3, 1).reshape(n, rows // m, m, cols // m, m, d).permute(0, 1, 3, 2, 4, 5)
    merger = vlm.hf.get_submodule(vlm.arch.spec.vision_blocks.rsplit(".", 1)[0]).merger
    with torch.no_grad():
        tokens = merger(merge_order.reshape(-1, d))
    # The merger on both images' patches at once vs inside the model: rounding only.
    assert_close(tokens, proj.permute(0, 2, 3, 1).reshape(-1, proj.shape[1]), what="merger vs projector tap")
