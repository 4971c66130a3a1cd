"""What countlens needs of HF processors: image-only builds, and the tile grid a processor cuts.

`image_only`: video processors need torchvision, which has no working CPU build beside the pinned
torch on these machines; an image-only subclass (same tokens, same image processing, no video or
audio-feature attribute) is all that counting experiments need. The subclass keeps the base class's
`__call__` and chat handling.

`tile_grid`: the grid of tiles a tiling processor (InternVL, Ovis2, Phi-4) cuts an image into, by
that processor's own rule, so that `countlens.layouts` can place every image token.

`processor_class`: a processor class by name, where transformers hides a working one behind a
torchvision requirement (Mistral 3's PixtralProcessor).
"""

from __future__ import annotations

import inspect
from functools import cache

#: Sub-processors an image-only build leaves out: video, and audio features (Gemma 4's). Phi-4's
#: ``audio_processor`` stays: its processor needs it to build (countlens passes the checkpoint's).
DROPPED = ("video_processor", "feature_extractor")


@cache
def image_only(base: type) -> type:
    """``base`` without its video processor (and audio feature extractor); ``base`` unchanged when it
    has neither."""
    params = inspect.signature(base.__init__).parameters
    dropped = tuple(n for n in DROPPED if n in params)
    if not dropped:
        return base

    from transformers import ProcessorMixin

    def __init__(self, image_processor=None, tokenizer=None, **kwargs):
        # By keyword: Gemma 4's processor takes its feature extractor first.
        base.__init__(self, image_processor=image_processor, tokenizer=tokenizer, **dict.fromkeys(dropped), **kwargs)

    # ProcessorMixin reads the sub-processors off the signature below, without the dropped ones. The
    # base passes its None for them on, positionally (dropped there by position) or by keyword (Gemma
    # 4's): `_WithoutDropped`, next after the base in the subclass's method order, leaves those out.
    sig = inspect.signature(base.__init__)
    __init__.__signature__ = sig.replace(parameters=[p for n, p in sig.parameters.items() if n not in dropped])
    body = {"__init__": __init__, "__module__": __name__}
    if base.__name__ in _VIDEO_TEMPLATE_DEFAULTS:
        # Its own apply_chat_template only adds the video processor's frame settings: the mixin's.
        body["apply_chat_template"] = ProcessorMixin.apply_chat_template
    return type(f"ImageOnly{base.__name__}", (base, _without_dropped_class()), body)


def _without_dropped_init(self, *args, **kwargs):
    from transformers import ProcessorMixin

    kwargs = {k: v for k, v in kwargs.items() if not (k in DROPPED and v is None)}
    ProcessorMixin.__init__(self, *args, **kwargs)


@cache
def _without_dropped_class() -> type:
    """`_WithoutDropped`: ProcessorMixin, minus the dropped sub-processors a base passes on as None."""
    from transformers import ProcessorMixin

    return type("_WithoutDropped", (ProcessorMixin,), {"__init__": _without_dropped_init, "__module__": __name__})


#: Processors whose apply_chat_template reads the video processor's settings (and nothing else of its own).
_VIDEO_TEMPLATE_DEFAULTS = frozenset({"SmolVLMProcessor"})


def processor_class(name: str) -> type | None:
    """transformers' processor class ``name``, or None. PixtralProcessor (Mistral 3) is declared as
    needing torchvision only because its module imports one sizing helper from the torchvision image
    processor; without torchvision the class is a placeholder, so here the module is imported with
    that helper taken from the PIL image processor, which defines the same function."""
    import sys

    import transformers

    cls = getattr(transformers, name, None)
    if name != "PixtralProcessor" or not _is_placeholder(cls):
        return None if _is_placeholder(cls) else cls
    import types

    from transformers.models.pixtral import image_processing_pil_pixtral as pil

    module = "transformers.models.pixtral.image_processing_pixtral"
    if module not in sys.modules:  # the torchvision module cannot be imported: stand in its one helper
        stand_in = types.ModuleType(module)
        stand_in.get_resize_output_image_size = pil.get_resize_output_image_size
        sys.modules[module] = stand_in
    from transformers.models.pixtral.processing_pixtral import PixtralProcessor

    return PixtralProcessor


def _is_placeholder(cls) -> bool:
    """A transformers dummy class standing for one whose backend (torchvision) is missing."""
    return cls is not None and type(cls).__name__ == "DummyObject"


def tile_grid(processor, height: int, width: int) -> tuple[int, int] | None:
    """(rows, cols) of the tiles (crops) ``processor`` cuts a ``height`` × ``width`` image into, by its
    image processor's own rule and the settings a call uses; None for a processor countlens does not
    know to tile.

    The settings are the image processor's, overridden by the processor's class defaults (InternVL's
    processor always asks for ``crop_to_patches``, whatever the image processor says). The rules differ
    and are not the aspect ratio alone: InternVL (GotOcr2) takes the grid closest to the image's aspect,
    Ovis2 the fewest tiles covering 90 % of it (transformers 5.24 then cuts it as columns × rows: this
    reads the grid the cut uses), Phi-4 whole crops covering the image, Llama-3.2-Vision the canvas of
    at most ``max_image_tiles`` that scales the image least, Idefics3 / SmolVLM whole tiles of the image
    resized to a fixed longest edge."""
    ip = processor.image_processor
    name = type(ip).__name__
    defaults = dict(getattr(processor, "images_kwargs", None) or {})

    def setting(key: str, fallback=None):
        return defaults.get(key, getattr(ip, key, fallback))

    size = dict(ip.size)
    if name.startswith("GotOcr2ImageProcessor"):
        if not setting("crop_to_patches") or setting("max_patches") <= 1:
            return 1, 1
        from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import get_optimal_tiled_canvas

        cols, rows = get_optimal_tiled_canvas(
            (height, width), (size["height"], size["width"]), setting("min_patches"), setting("max_patches")
        )
        return int(rows), int(cols)
    if name.startswith("Ovis2ImageProcessor"):
        if not setting("crop_to_patches") or setting("max_patches") <= 1:
            return 1, 1
        from transformers.models.ovis2 import image_processing_pil_ovis2 as ovis2

        if setting("use_covering_area_grid", True):
            cols, rows = ovis2.get_min_tile_covering_grid(
                (height, width), target_patch_size=size["height"], max_image_tiles=setting("max_patches")
            )
        else:
            cols, rows = ovis2.get_optimal_tiled_canvas(
                (height, width), (size["height"], size["width"]), setting("min_patches"), setting("max_patches")
            )
        return int(rows), int(cols)
    if name.startswith("MllamaImageProcessor"):
        from transformers.models.mllama.image_processing_pil_mllama import get_optimal_tiled_canvas as canvas

        tile = size["height"]
        canvas_h, canvas_w = canvas(height, width, setting("max_image_tiles"), tile)
        return int(canvas_h) // tile, int(canvas_w) // tile
    if name.startswith(("Idefics3ImageProcessor", "SmolVLMImageProcessor")):
        return _idefics3_grid(ip, height, width, setting("do_image_splitting", True))
    if name.startswith("Llama4ImageProcessor"):
        from countlens.image_processors import llama4_canvas

        tile = size["height"]
        canvas_h, canvas_w = llama4_canvas(
            height, width, tile, setting("max_patches", 16), setting("resize_to_max_canvas", False)
        )
        return canvas_h // tile, canvas_w // tile
    if name.startswith("Phi4MultimodalImageProcessor"):
        from countlens.image_processors import crop_grid

        cols, rows = crop_grid(height, width, size["height"], setting("dynamic_hd"))
        return rows, cols
    return None


def _idefics3_grid(ip, height: int, width: int, split: bool) -> tuple[int, int]:
    """Idefics3 / SmolVLM: the longest edge resized to ``size["longest_edge"]`` (up or down, the other
    edge made even), then each side stretched up to whole tiles of ``max_image_size["longest_edge"]``
    (the short side from the long side's aspect); an image larger than one tile is cut into those
    tiles, else shown once (1 × 1). The steps of ``Idefics3ImageProcessorPil._preprocess``."""
    import math

    from transformers.models.idefics3 import image_processing_pil_idefics3 as idefics3

    tile = dict(ip.max_image_size)["longest_edge"]
    if not split:
        return 1, 1
    height, width = idefics3._resize_output_size_rescale_to_max_len(
        height, width, max_len=dict(ip.size)["longest_edge"]
    )
    height, width = idefics3._resize_output_size_scale_below_upper_bound(height, width, max_len=idefics3.MAX_IMAGE_SIZE)
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


def useful_grid(processor, height: int, width: int) -> tuple[int, int] | None:
    """Phi-4-multimodal: the (rows, cols) of high-resolution tokens that show the image, its crops'
    padding dropped (`countlens.image_processors.useful_tokens`); Llama 4: the (height, width) in
    pixels of the image resized into its tile canvas; None for other processors."""
    ip = processor.image_processor
    if type(ip).__name__.startswith("Llama4ImageProcessor"):
        from countlens.image_processors import llama4_resized

        defaults = dict(getattr(processor, "images_kwargs", None) or {})
        return llama4_resized(
            height,
            width,
            dict(ip.size)["height"],
            defaults.get("max_patches", getattr(ip, "max_patches", 16)),
            defaults.get("resize_to_max_canvas", getattr(ip, "resize_to_max_canvas", False)),
        )
    if not type(ip).__name__.startswith("Phi4MultimodalImageProcessor"):
        return None
    from countlens.image_processors import useful_tokens

    defaults = dict(getattr(processor, "images_kwargs", None) or {})
    crop = dict(ip.size)["height"]
    return useful_tokens(
        height, width, crop, defaults.get("patch_size", ip.patch_size), defaults.get("dynamic_hd", ip.dynamic_hd)
    )
