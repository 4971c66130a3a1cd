"""Llama 4 (Scout, Maverick): no ``model.`` prefix; chunked attention on its RoPE layers, whose q and k
go through one parameter-free L2 norm, and global attention without RoPE (and without the norm) on
every fourth; mixture-of-experts MLPs whose experts run on every token, the routing weight scaling
the input; only <|patch|> tokens (the config's image token) carry the image. transformers 5.24's
model reads ``image_outputs`` off its language model's output, which it does not write.

Image tokens ("padded_tiles"): the image resized into a canvas of tiles and padded, the tiles one
after another (each row-major), then — beside several tiles — the whole image stretched to one tile.
`tile_grid` is the canvas's tiles, `useful_grid` the resized image's size in pixels.

Image processor: transformers ships it only as a torchvision backend; `Llama4ImageProcessorPil`
does its documented steps, for one H × W image, tile side S (``size``), at most ``max_patches`` tiles:

1. Canvas: of the (a·S, b·S) canvases with a·b ≤ max_patches, the one whose limiting scale
   min(aS / H, bS / W) is the smallest ≥ 1 (the largest with ``resize_to_max_canvas``), else the
   largest < 1; ties to the smaller canvas (`llama4_canvas`).
2. Resize keeping the aspect into the canvas, enlarging no side past max(side, S) unless
   ``resize_to_max_canvas`` (`llama4_resized`); pad right and bottom with 0 (−1 once normalised).
3. Rescale, normalise ((x / 255 − 0.5) / 0.5), cut the canvas into tiles row-major; beside several
   tiles, a global tile: the whole image resized to S × S (stretched).
transformers normalises in bfloat16 and resizes with torchvision's antialiased bilinear; this uses
float32 and PIL's bilinear. Not compared with the torchvision path (it cannot run here).

The class is built on first use (`image_processor_class`): transformers' image backends take seconds
to import.
"""

from __future__ import annotations

import math
from functools import cache

from countlens.model.families.spec import ArchSpec, Family, MoESpec

SPECS = (
    ArchSpec(
        "llama4",
        ("llama4",),
        layers="language_model.model.layers",
        final_norm="language_model.model.norm",
        lm_head="language_model.lm_head",
        vision_blocks="vision_model.model.layers",
        vision_tower="vision_model",
        projector="multi_modal_projector",
        q_norm="self_attn.qk_norm",
        q_norm_shared_with_k=True,
        merge="vision_config.pixel_shuffle_ratio",
        merge_is_ratio=True,
        layout="padded_tiles",
        mlp="feed_forward",
        missing_output_fields=(("language_model", "image_outputs"),),
        moe=MoESpec(
            experts="feed_forward.experts",
            router="feed_forward.router",
            n_experts_attr="num_local_experts",
            rule="scaled_inputs",
        ),
    ),
)


def llama4_canvas(height: int, width: int, tile: int, max_patches: int, to_max: bool = False) -> tuple[int, int]:
    """(height, width) in pixels of the tile canvas an image is fitted into (step 1)."""
    by_aspect: dict[float, list[tuple[int, int]]] = {}
    for n in range(max_patches, 0, -1):  # transformers' order, which breaks ties of scale and area
        for a in sorted(f for f in range(1, n + 1) if n % f == 0):
            by_aspect.setdefault(a / (n // a), []).append((a * tile, n // a * tile))
    canvases = [c for group in by_aspect.values() for c in group]
    scales = [min(h / height, w / width) for h, w in canvases]
    up = [s for s in scales if s >= 1]
    chosen = (max(up) if to_max else min(up)) if up else max(scales)
    best = [c for c, s in zip(canvases, scales) if s == chosen]
    return min(best, key=lambda c: c[0] * c[1])


def llama4_resized(height: int, width: int, tile: int, max_patches: int, to_max: bool = False) -> tuple[int, int]:
    """(height, width) of the image resized into its canvas, aspect kept (step 2)."""
    canvas_h, canvas_w = llama4_canvas(height, width, tile, max_patches, to_max)
    if not to_max:  # enlarge no side past max(side, S)
        canvas_h, canvas_w = min(max(height, tile), canvas_h), min(max(width, tile), canvas_w)
    scale_h, scale_w = canvas_h / height, canvas_w / width
    if scale_w < scale_h:
        new_h, new_w = min(math.floor(height * scale_w), canvas_h), canvas_w
    else:
        new_h, new_w = canvas_h, min(math.floor(width * scale_h), canvas_w)
    return max(new_h, 1), max(new_w, 1)


def tile_grid(ip, setting, height: int, width: int) -> tuple[int, int]:
    """(rows, cols) of the canvas's tiles."""
    tile = dict(ip.size)["height"]
    canvas_h, canvas_w = llama4_canvas(
        height, width, tile, setting("max_patches", 16), setting("resize_to_max_canvas", False)
    )
    return canvas_h // tile, canvas_w // tile


def useful_grid(ip, setting, height: int, width: int) -> tuple[int, int]:
    """(height, width) in pixels of the image resized into its tile canvas."""
    return llama4_resized(
        height, width, dict(ip.size)["height"], setting("max_patches", 16), setting("resize_to_max_canvas", False)
    )


@cache
def image_processor_class() -> type:
    """`Llama4ImageProcessorPil`, built once (see the module docstring)."""
    import numpy as np
    import torch
    from PIL import Image
    from transformers.image_processing_backends import PilBackend
    from transformers.image_processing_utils import BatchFeature
    from transformers.image_utils import PILImageResampling, SizeDict
    from transformers.processing_utils import ImagesKwargs

    class Llama4ImagesKwargs(ImagesKwargs, total=False):
        """max_patches: the most tiles per image; resize_to_max_canvas: enlarge to the largest canvas."""

        max_patches: int
        resize_to_max_canvas: bool

    class Llama4ImageProcessorPil(PilBackend):
        """Llama 4's image processor without torchvision (the steps above)."""

        resample = PILImageResampling.BILINEAR
        size = {"height": 336, "width": 336}
        max_patches = 16
        resize_to_max_canvas = False
        image_mean = [0.5, 0.5, 0.5]
        image_std = [0.5, 0.5, 0.5]
        do_rescale = True
        do_normalize = True
        do_convert_rgb = True
        valid_kwargs = Llama4ImagesKwargs
        model_input_names = ["pixel_values"]

        def _preprocess(
            self,
            images: list[np.ndarray],
            size: SizeDict,
            do_rescale: bool,
            rescale_factor: float,
            do_normalize: bool,
            image_mean,
            image_std,
            max_patches: int,
            resize_to_max_canvas: bool,
            return_tensors=None,
            **kwargs,
        ) -> BatchFeature:
            if size.height != size.width:
                raise ValueError(f"Llama 4 tiles are square; got size {size.height}×{size.width}")
            tile = size.height
            mean = torch.tensor(image_mean, dtype=torch.float32).view(3, 1, 1)
            std = torch.tensor(image_std, dtype=torch.float32).view(3, 1, 1)

            def normalised(pixels: np.ndarray) -> torch.Tensor:
                x = torch.from_numpy(np.array(pixels)).permute(2, 0, 1).float()  # a writable copy of PIL's view
                x = x * rescale_factor if do_rescale else x
                return (x - mean) / std if do_normalize else x

            tiles, ratios = [], []
            for image in images:
                image = image.transpose(1, 2, 0)  # channels first, as the PIL backend hands it over
                image = np.clip(np.rint(image), 0, 255).astype(np.uint8) if image.dtype != np.uint8 else image
                height, width = image.shape[:2]
                canvas_h, canvas_w = llama4_canvas(height, width, tile, max_patches, resize_to_max_canvas)
                new_h, new_w = llama4_resized(height, width, tile, max_patches, resize_to_max_canvas)
                canvas = np.zeros((canvas_h, canvas_w, 3), np.uint8)
                pil = Image.fromarray(image)
                canvas[:new_h, :new_w] = np.asarray(pil.resize((new_w, new_h), Image.Resampling.BILINEAR))
                x = normalised(canvas)
                rows, cols = canvas_h // tile, canvas_w // tile
                cut = x.reshape(3, rows, tile, cols, tile).permute(1, 3, 0, 2, 4).reshape(-1, 3, tile, tile)
                if rows * cols > 1:  # the whole image, stretched to one tile
                    whole = np.asarray(pil.resize((tile, tile), Image.Resampling.BILINEAR))
                    cut = torch.cat([cut, normalised(whole)[None]])
                tiles.append(cut)
                ratios.append([rows, cols])
            data = {"pixel_values": torch.cat(tiles), "aspect_ratios": torch.tensor(ratios, dtype=torch.long)}
            return BatchFeature(data=data, tensor_type=return_tensors)

    Llama4ImageProcessorPil.__qualname__ = "Llama4ImageProcessorPil"
    return Llama4ImageProcessorPil


def __getattr__(name: str):
    # The class is importable by name (``from countlens.model.families.llama4 import ...``), built on first use.
    if name == "Llama4ImageProcessorPil":
        return image_processor_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


FAMILY = Family(
    "llama4",
    SPECS,
    names=("Llama4",),
    image_processors=("Llama4ImageProcessor",),
    tile_grid=tile_grid,
    useful_grid=useful_grid,
    pil_image_processors={"Llama4ImageProcessorPil": image_processor_class},
)
