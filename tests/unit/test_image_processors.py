"""countlens's PIL Phi-4-multimodal image processor against fixtures worked out by hand from the
documented steps (`countlens.model.families.phi4_multimodal`); it has not been compared with the torchvision one."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from countlens.model.families.phi4_multimodal import (
    Phi4MultimodalImageProcessorPil,
    crop_grid,
    resized_size,
    useful_tokens,
)
from countlens.model.geometry import Geometry
from countlens.model.layouts import token_cells

CROP, PATCH = 32, 4  # 8 × 8 patches per crop, 4 × 4 tokens after the 2 × 2 pool


@pytest.fixture(scope="module")
def processor():
    return Phi4MultimodalImageProcessorPil(size={"height": CROP, "width": CROP}, patch_size=PATCH, dynamic_hd=36)


@pytest.mark.parametrize(
    ("height", "width", "crop", "dynamic_hd", "grid"),
    [
        (64, 64, 32, 36, (2, 2)),  # (columns, rows): ⌈64/32⌉ each
        (30, 100, 32, 36, (4, 1)),  # ⌈100/32⌉ = 4 columns, one row
        (400, 4000, 448, 36, (9, 1)),
        # ⌈1000/448⌉² = 9 > 4 crops: the closest aspect among grids of ≤ 4 is 1:1, (1, 1) and (2, 2) tie,
        # and the image covers more than half of 2 × 2 crops (10⁶ > 0.5 · 448² · 4): (2, 2).
        (1000, 1000, 448, 4, (2, 2)),
    ],
)
def test_crop_grid(height, width, crop, dynamic_hd, grid):
    assert crop_grid(height, width, crop, dynamic_hd) == grid


def test_resize_keeps_the_aspect_and_fills_one_side():
    # 40 × 64 onto a 64 × 64 canvas: the width fills it (64/64 < 64/40), the height stays 40.
    assert resized_size(40, 64, 64, 64) == (40, 64)
    # 30 × 100 onto 32 × 128: the height fills it (32/30 < 128/100), the width is int(100 · 32/30) = 106.
    assert resized_size(30, 100, 32, 128) == (32, 106)


def test_a_padded_image_by_hand(processor):
    """A black 64 × 40 (w × h) image: 2 × 2 crops of a 64 × 64 canvas, the bottom 24 rows white padding."""
    out = processor(images=[Image.new("RGB", (64, 40))], return_tensors="pt")
    pixels, mask = out["image_pixel_values"][0], out["image_attention_mask"][0]
    assert pixels.shape == (5, 3, CROP, CROP) and mask.shape == (5, 8, 8)
    assert out["image_sizes"].tolist() == [[64, 64]]
    # Crops row-major after the global image: crop (1, 0) holds canvas rows 32-63; rows 32-39 are the
    # image (black: (0/255 − 0.5)/0.5 = −1), rows 40-63 the white padding (+1).
    bottom_left = pixels[3]
    assert torch.equal(bottom_left[:, :8], torch.full((3, 8, CROP), -1.0))
    assert torch.equal(bottom_left[:, 8:], torch.full((3, 24, CROP), 1.0))
    assert torch.equal(pixels[1], torch.full((3, CROP, CROP), -1.0))  # crop (0, 0): all image
    # Padding of ⌊24/4⌋ = 6 patch rows: the bottom crops' patch rows 2-7 are masked, nothing else.
    assert torch.equal(mask[0], torch.ones(8, 8)) and torch.equal(mask[1], torch.ones(8, 8))
    expected = torch.ones(8, 8)
    expected[2:] = 0
    assert torch.equal(mask[3], expected) and torch.equal(mask[4], expected)
    # The global image: the canvas squashed to one crop (bicubic); far from the edge it is the canvas.
    glob = pixels[0]
    assert torch.allclose(glob[:, 2, 2], torch.tensor(-1.0)) and torch.allclose(glob[:, -2, -2], torch.tensor(1.0))
    # Tokens: useful HD rows R = 4 + 1 (the bottom crops' pooled rows 0 only), C = 8 columns, a newline
    # per row, a separator, then 4 rows of 4 global tokens and a newline: 5·9 + 1 + 4·5 = 66.
    assert out["num_img_tokens"].tolist() == [66]
    geom = Geometry(CROP, CROP, PATCH, 2)
    cells = token_cells("hd_global", geom, 66, 0, (2, 2), useful_tokens(40, 64, CROP, PATCH, 36))
    assert useful_tokens(40, 64, CROP, PATCH, 36) == (5, 8)
    hd_rows = cells.cells[:45].view(5, 9, 2)
    assert (hd_rows[:, 8] == -1).all()  # newlines
    assert hd_rows[4, 7].tolist() == [2, 3]  # stitched (4, 7) lies in global cell (4 // 2, 7 // 2)
    assert cells.cells[45].tolist() == [-1, -1]  # the separator


def test_a_batch_pads_to_the_most_crops(processor):
    out = processor(images=[Image.new("RGB", (64, 64)), Image.new("RGB", (32, 32))], return_tensors="pt")
    assert out["image_pixel_values"].shape == (2, 5, 3, CROP, CROP)
    assert torch.equal(out["image_pixel_values"][1, 2:], torch.zeros(3, 3, CROP, CROP))
    assert torch.equal(out["image_attention_mask"][1, 2:], torch.ones(3, 8, 8))
    # One 32-px crop: 4 rows of 4 HD tokens and newlines, the separator, the same for the global image.
    assert out["num_img_tokens"].tolist() == [8 * 9 + 1 + 20, 4 * 5 + 1 + 20]


def test_uint8_arrays_and_pil_images_agree(processor):
    rng = np.random.default_rng(0)
    array = rng.integers(0, 256, (40, 64, 3), dtype=np.uint8)
    a = processor(images=[array], return_tensors="pt")["image_pixel_values"]
    b = processor(images=[Image.fromarray(array)], return_tensors="pt")["image_pixel_values"]
    assert torch.equal(a, b)


def test_a_width_padded_image_by_hand(processor):
    """A 40 × 64 (w × h) image: the height fills the 64 × 64 canvas, the right 24 columns are padding:
    all 8 HD token rows, but only 4 + 1 of the 8 columns (the right crops' pooled column 0)."""
    assert useful_tokens(64, 40, CROP, PATCH, 36) == (8, 5)
    out = processor(images=[Image.new("RGB", (40, 64))], return_tensors="pt")
    assert out["num_img_tokens"].tolist() == [8 * 6 + 1 + 20]
    cells = token_cells("hd_global", Geometry(CROP, CROP, PATCH, 2), 69, 0, (2, 2), (8, 5)).cells
    hd = cells[:48].view(8, 6, 2)
    assert (hd[:, 5] == -1).all() and hd[7, 4].tolist() == [3, 2]


def test_equal_token_counts_of_different_paddings_are_told_apart():
    """551 × 1300 (w × h) at 448 / 14: 3 × 2 crops, 48 rows of 21 useful tokens: 1,329 image tokens, as
    many as an unpadded 2 × 2 image (32 × 32). Reading R and C off the count alone confuses the two."""
    assert crop_grid(1300, 551, 448, 36) == (2, 3) and useful_tokens(1300, 551, 448, 14, 36) == (48, 21)
    assert 48 * 22 + 1 + 16 * 17 == 32 * 33 + 1 + 16 * 17 == 1329
    cells = token_cells("hd_global", Geometry(448, 448, 14, 2), 1329, 0, (3, 2), (48, 21)).cells
    assert int((cells[:, 0] < 0).sum()) == 48 + 1 + 16  # HD newlines, the separator, global newlines
    assert cells[: 48 * 22].view(48, 22, 2)[47, 20].tolist() == [47 * 16 // 48, 20 * 16 // 32]
