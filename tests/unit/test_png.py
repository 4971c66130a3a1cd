"""The palette PNG writer: any reader gives back the exact indices and colours, at every bit depth."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from countlens.datasets.png import indexed_png

PALETTE = [(255, 255, 255), (220, 30, 30), (30, 70, 220), (0, 0, 0), (128, 128, 128)] + [
    (i, 255 - i, (7 * i) % 256) for i in range(5, 256)
]


@pytest.mark.parametrize("colours, depth", [(1, 1), (2, 1), (3, 2), (4, 2), (5, 4), (16, 4), (17, 8), (256, 8)])
@pytest.mark.parametrize("width", [1, 7, 9, 30, 384])  # widths that leave a partly filled last byte
def test_decodes_to_the_exact_indices_and_colours(colours, depth, width):
    rng = np.random.default_rng(colours * 1000 + width)
    index = rng.integers(0, colours, size=(5, width), dtype=np.uint8)
    index[0, 0] = colours - 1  # the highest index appears: its bits reach the byte's top
    data = indexed_png(index, PALETTE[:colours])
    image = Image.open(io.BytesIO(data))
    assert image.mode == "P" and image.size == (width, 5)
    assert image.info.get("transparency") is None
    assert np.array_equal(np.asarray(image), index)
    rgb = np.asarray(image.convert("RGB"))
    assert np.array_equal(rgb, np.array(PALETTE[:colours], dtype=np.uint8)[index])
    assert data[24] == depth  # IHDR bit depth
    assert indexed_png(index, PALETTE[:colours]) == data  # same input, same bytes


def test_refuses_what_it_cannot_write():
    with pytest.raises(ValueError, match="outside the 2-colour palette"):
        indexed_png(np.full((2, 2), 2, dtype=np.uint8), PALETTE[:2])
    with pytest.raises(ValueError, match="2-D uint8"):
        indexed_png(np.zeros((2, 2, 3), dtype=np.uint8), PALETTE[:2])
    with pytest.raises(ValueError, match="1 to 256 colours"):
        indexed_png(np.zeros((2, 2), dtype=np.uint8), [])
