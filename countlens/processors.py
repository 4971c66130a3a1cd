"""What countlens needs of HF processors: image-only builds, and the tile grid a processor cuts.

`image_only`: video processors need torchvision, which has no working CPU build beside the pinned
torch on these machines; an image-only subclass (same tokens, same image processing, no video
attribute) is all that counting experiments need. The subclass keeps the base class's `__call__`
and chat handling.

`tile_grid`: the grid of tiles a tiling processor (InternVL, Ovis2, Phi-4) cuts an image into, by
that processor's own rule, so that `countlens.layouts` can place every image token.
"""

from __future__ import annotations

import inspect
from functools import cache


@cache
def image_only(base: type) -> type:
    """``base`` without its ``video_processor`` argument; ``base`` unchanged when it has none."""
    params = inspect.signature(base.__init__).parameters
    if "video_processor" not in params:
        return base

    def __init__(self, image_processor=None, tokenizer=None, **kwargs):
        # ProcessorMixin reads the sub-processor names off this signature, so the None passed
        # for video_processor is dropped there rather than type-checked.
        base.__init__(self, image_processor, tokenizer, None, **kwargs)

    # The base's signature minus video_processor: ProcessorMixin saves and reloads the settings it
    # names (e.g. LLaVA-OneVision's num_image_tokens).
    sig = inspect.signature(base.__init__)
    __init__.__signature__ = sig.replace(parameters=[p for n, p in sig.parameters.items() if n != "video_processor"])
    return type(f"ImageOnly{base.__name__}", (base,), {"__init__": __init__, "__module__": __name__})


def tile_grid(image_processor, height: int, width: int) -> tuple[int, int] | None:
    """(rows, cols) of the tiles (crops) ``image_processor`` cuts a ``height`` × ``width`` image into,
    by the processor's own rule and settings; None for a processor countlens does not know to tile.

    The rules differ and are not the aspect ratio alone: InternVL (GotOcr2) takes the grid closest to
    the image's aspect, Ovis2 the fewest tiles covering 90 % of it (transformers 5.24 then cuts it as
    columns × rows: this reads the grid the cut uses), Phi-4 whole crops covering the image,
    Llama-3.2-Vision the canvas of at most ``max_image_tiles`` that scales the image least."""
    ip, name = image_processor, type(image_processor).__name__
    size = dict(ip.size)
    if name.startswith("GotOcr2ImageProcessor"):
        if not ip.crop_to_patches or ip.max_patches <= 1:
            return 1, 1
        from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import get_optimal_tiled_canvas

        cols, rows = get_optimal_tiled_canvas(
            (height, width), (size["height"], size["width"]), ip.min_patches, ip.max_patches
        )
        return rows, cols
    if name.startswith("Ovis2ImageProcessor"):
        if not ip.crop_to_patches or ip.max_patches <= 1:
            return 1, 1
        from transformers.models.ovis2 import image_processing_pil_ovis2 as ovis2

        if getattr(ip, "use_covering_area_grid", True):
            cols, rows = ovis2.get_min_tile_covering_grid(
                (height, width), target_patch_size=size["height"], max_image_tiles=ip.max_patches
            )
        else:
            cols, rows = ovis2.get_optimal_tiled_canvas(
                (height, width), (size["height"], size["width"]), ip.min_patches, ip.max_patches
            )
        return rows, cols
    if name.startswith("MllamaImageProcessor"):
        from transformers.models.mllama.image_processing_pil_mllama import get_optimal_tiled_canvas as canvas

        tile = size["height"]
        canvas_h, canvas_w = canvas(height, width, ip.max_image_tiles, tile)
        return canvas_h // tile, canvas_w // tile
    if name.startswith("Phi4MultimodalImageProcessor"):
        from countlens.image_processors import crop_grid

        cols, rows = crop_grid(height, width, size["height"], ip.dynamic_hd)
        return rows, cols
    return None
