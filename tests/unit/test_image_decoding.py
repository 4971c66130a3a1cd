"""Benchmark images decoded as the model's processor sees them (`countlens.datasets.loaders.common.decode_image`):
upright, transparency on white, wide and CMYK modes converted. Each image is made here, in memory or in
``tmp_path``, in the mode a real benchmark file comes in."""

from __future__ import annotations

import io
import warnings
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from countlens.datasets.loaders.common import CountSample, QuestionSample
from countlens.datasets.loaders.voc import DetectionSample

RED, BLUE, WHITE = (255, 0, 0), (0, 0, 255), (255, 255, 255)


def _count_sample(path: Path) -> CountSample:
    return CountSample(path, None, "how many?", 1, None, None, source="test", id=path.stem)


def _pixels(image: Image.Image) -> np.ndarray:
    assert image.mode == "RGB"
    return np.asarray(image)


def _sideways_jpeg(path: Path) -> Path:
    """A 40×20 photo stored sideways, red on its left half and blue on its right, with EXIF orientation 6
    ("rotate 90° clockwise to display"): upright it is 20×40, red on top."""
    stored = Image.new("RGB", (40, 20), BLUE)
    stored.paste(RED, (0, 0, 20, 20))
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation
    stored.save(path, "JPEG", quality=95, exif=exif.tobytes())
    return path


def test_an_exif_rotated_photo_comes_out_upright(tmp_path):
    image = _count_sample(_sideways_jpeg(tmp_path / "phone.jpg")).image
    assert image.size == (20, 40)
    top, bottom = _pixels(image)[5, 10], _pixels(image)[35, 10]
    assert top[0] > 200 and top[2] < 60, top  # red
    assert bottom[2] > 200 and bottom[0] < 60, bottom  # blue


def test_a_transparent_background_comes_out_white_not_black(tmp_path):
    """A diagram on a transparent background (RGBA, its transparent pixels storing black): white
    around its opaque red square, as transformers' convert_to_rgb composites it."""
    diagram = Image.new("RGBA", (32, 32), (0, 0, 0, 0))
    diagram.paste((*RED, 255), (8, 8, 24, 24))
    path = tmp_path / "diagram.png"
    diagram.save(path)
    pixels = _pixels(_count_sample(path).image)
    assert tuple(pixels[0, 0]) == WHITE and tuple(pixels[16, 16]) == RED
    # Half transparent: half way to white.
    diagram.putpixel((0, 0), (0, 0, 0, 128))
    buffer = io.BytesIO()
    diagram.save(buffer, "PNG")
    sample = QuestionSample(None, buffer.getvalue(), "what?", "A", "math", "test", "bytes", choices=("A", "B"))
    assert abs(int(_pixels(sample.image)[0, 0, 0]) - 127) <= 1


def test_a_palette_with_a_transparent_entry_comes_out_white(tmp_path):
    palette = Image.new("P", (16, 16), 0)
    palette.putpalette([0, 0, 0, *RED] + [0] * 762)  # entry 0 black (transparent), entry 1 red
    palette.paste(1, (4, 4, 12, 12))
    path = tmp_path / "palette.png"
    palette.save(path, transparency=0)
    pixels = _pixels(_count_sample(path).image)
    assert tuple(pixels[0, 0]) == WHITE and tuple(pixels[8, 8]) == RED


def test_a_16_bit_greyscale_image_is_scaled_to_8_bits_with_a_warning(tmp_path):
    """A 16-bit PNG: convert("RGB") clips every value above 255 to white; scaled, mid grey stays grey."""
    values = np.array([[0, 32896, 65535]], dtype=np.uint16).repeat(4, axis=0)
    path = tmp_path / "wide.png"
    Image.fromarray(values).save(path)
    with Image.open(path) as im:
        assert im.mode.startswith("I")  # Pillow opens it 16 bits wide
    with pytest.warns(UserWarning, match="reduced to 8 bits"):
        pixels = _pixels(_count_sample(path).image)
    assert pixels[0, :, 0].tolist() == [0, 128, 255]


def test_a_cmyk_image_is_converted_with_a_warning(tmp_path):
    path = tmp_path / "print.jpg"
    Image.new("CMYK", (8, 8), (0, 255, 255, 0)).save(path, "JPEG", quality=95)  # red ink
    with pytest.warns(UserWarning, match="CMYK"):
        pixel = _pixels(_count_sample(path).image)[4, 4]
    assert pixel[0] > 200 and pixel[1] < 60 and pixel[2] < 60, pixel


def test_plain_rgb_and_greyscale_images_are_decoded_without_a_warning(tmp_path):
    rgb, grey = tmp_path / "rgb.png", tmp_path / "grey.png"
    Image.new("RGB", (4, 4), RED).save(rgb)
    Image.new("L", (4, 4), 200).save(grey)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tuple(_pixels(_count_sample(rgb).image)[0, 0]) == RED
        assert tuple(_pixels(_count_sample(grey).image)[0, 0]) == (200, 200, 200)


def test_voc_images_are_decoded_upright_too(tmp_path):
    """The detection loader letterboxes what the shared decoder gives: a sideways photo, upright."""
    sample = DetectionSample(_sideways_jpeg(tmp_path / "voc.jpg"), np.zeros((0, 4)), np.zeros(0, int), "voc", side=40)
    pixels = _pixels(sample.image)  # 20×40 upright, centred on a 40×40 grey canvas
    assert pixels[5, 20][0] > 200 and pixels[35, 20][2] > 200
