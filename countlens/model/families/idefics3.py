"""Idefics3 and SmolVLM (one spec, two model types): a SigLIP tower pixel-shuffled by ``scale_factor``
and a Llama / SmolLM language model under ``model.text_model``.

Tiles: the image's longest edge resized to ``size["longest_edge"]``, each side stretched up to whole
square tiles of ``max_image_size["longest_edge"]`` (which is also the fixed size of every tile); each
tile's tokens after a row-and-column tag, tiles row-major, then the whole image ("tiles_thumbnail";
the tags and newlines between tiles are other tokens than the image token). SmolVLM's processor's
own ``apply_chat_template`` only adds its video processor's settings, so an image-only build uses
the mixin's.

SmolVLM-Instruct and SmolVLM2-2.2B cut 384 px tiles for a SigLIP of 14 px patches: 27 whole patches
(9 tokens of 3) and 6 px the patch convolution drops (``drops_remainder``; `countlens.model.geometry`).
"""

from __future__ import annotations

import math

from countlens.model.families.spec import ArchSpec, Family

SPECS = (
    ArchSpec(
        "idefics3",
        ("idefics3", "smolvlm"),
        layers="model.text_model.layers",
        final_norm="model.text_model.norm",
        vision_blocks="model.vision_model.encoder.layers",
        vision_tower="model.vision_model",
        projector="model.connector",
        merge="scale_factor",
        layout="tiles_thumbnail",
        drops_remainder=True,
    ),
)


def tile_size(ip, size: dict) -> tuple[int, int] | None:
    """Square tiles of ``max_image_size["longest_edge"]``, where the image is sized by its longest edge."""
    tile = dict(getattr(ip, "max_image_size", None) or {})
    if "longest_edge" in size and "longest_edge" in tile:
        return tile["longest_edge"], tile["longest_edge"]
    return None


def tile_grid(ip, setting, height: int, width: int) -> tuple[int, int]:
    """The longest edge resized to ``size["longest_edge"]`` (up or down, the other edge made even), then
    each side stretched up to whole tiles (the short side from the long side's aspect); an image larger
    than one tile is cut into those tiles, else shown once (1 × 1). The steps of
    ``Idefics3ImageProcessorPil._preprocess``."""
    from transformers.models.idefics3 import image_processing_pil_idefics3 as pil

    tile = dict(ip.max_image_size)["longest_edge"]
    if not setting("do_image_splitting", True):
        return 1, 1
    height, width = pil._resize_output_size_rescale_to_max_len(height, width, max_len=dict(ip.size)["longest_edge"])
    height, width = pil._resize_output_size_scale_below_upper_bound(height, width, max_len=pil.MAX_IMAGE_SIZE)
    aspect = width / height
    if width >= height:  # resize_for_vision_encoder
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    if height <= tile and width <= tile:
        return 1, 1
    return (height - tile) // tile + 1, (width - tile) // tile + 1


FAMILY = Family(
    "idefics3",
    SPECS,
    names=("Idefics3", "SmolVLM"),
    image_processors=("Idefics3ImageProcessor", "SmolVLMImageProcessor"),
    tile_size=tile_size,
    tile_grid=tile_grid,
    mixin_chat_template=("SmolVLMProcessor",),
)
