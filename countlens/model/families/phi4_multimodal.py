"""Phi-4-multimodal: a decoder under ``model`` (its text settings on the top config), one fused
``qkv_proj`` per layer, a SigLIP tower and projector beside the layers in ``model.embed_tokens_extend``
(with the audio embedder: not the language model), loaded by ``AutoModelForCausalLM``, and a fixed
2 × 2 average pool in the model's code.

Image tokens ("hd_global"): the high-resolution crops stitched into one grid, R useful rows of C tokens
each ended by a newline, one separator, then the global image with a newline per row. `tile_grid` is
the crop grid, `useful_grid` the useful (R, C).

Image processor: transformers 5.24 ships it only as a torchvision backend, which has no CPU build
beside the pinned torch on these machines. `Phi4MultimodalImageProcessorPil` does its documented
steps with PIL, numpy and torch, and returns the same keys, shapes and dtypes. It has **not** been
compared with the torchvision path (which cannot run here); the one step whose kernel differs is the
high-resolution resize (PIL's bilinear, as Microsoft's original processor did, where transformers
calls torchvision's antialiased bilinear: both are PIL-style triangle filters, measured within one
grey level of each other). The class is built on first use (`image_processor_class`): transformers'
image backends take seconds to import.

Steps for one H × W image, crop side S (``size``), patch p, m = S / p patches per crop side, and
g = ⌈m / 2⌉ tokens per crop side after the model's 2 × 2 average pool:

1. Crop grid: (⌈W / S⌉, ⌈H / S⌉) crops, or, where that is more than ``dynamic_hd``, the grid of at
   most ``dynamic_hd`` crops whose aspect is closest to W / H (ties to the larger grid while the image
   covers more than half of it).
2. Resize keeping the aspect until one side fills the canvas (the other truncated to whole pixels),
   then pad right and bottom with white. Patch mask: 1, except the last ⌊pad / p⌋ patch columns (rows)
   where the padding is at least one patch.
3. Normalise: (x / 255 − mean) / std (mean = std = 0.5: [−1, 1], padding +1).
4. Global image: the normalised canvas resized to S × S (bicubic, no antialias).
5. ``image_pixel_values`` [global, crops row-major], padded with zero crops to the batch's most;
   masks likewise (all ones for the global image and padding crops).
6. Image tokens: R rows of C tokens and a newline (the useful part of the stitched crop grid:
   R, C = ⌈useful patch rows / 2⌉, ⌈useful patch columns / 2⌉), one separator, then g rows of g
   tokens and a newline. transformers' processor writes 256 and 16 for g², g (right only at 448 / 14).
"""

from __future__ import annotations

import math
from functools import cache
from typing import TYPE_CHECKING

from countlens.model.families.spec import ArchSpec, Family

if TYPE_CHECKING:
    import torch

SPECS = (
    ArchSpec(
        "phi4_multimodal",
        ("phi4_multimodal",),
        layers="model.layers",
        final_norm="model.norm",
        not_language=("model.embed_tokens_extend",),
        vision_blocks="model.embed_tokens_extend.image_embed.img_processor.encoder.layers",
        vision_tower="model.embed_tokens_extend.image_embed.img_processor",
        # img_projection_up → GELU → img_projection_down, siblings of the tower; the last is named.
        projector="model.embed_tokens_extend.image_embed.img_projection_down",
        q_proj="self_attn.qkv_proj",
        k_proj="self_attn.qkv_proj",
        v_proj="self_attn.qkv_proj",
        fused_qkv=True,
        loader="AutoModelForCausalLM",
        text_config="",
        image_token_attr="vision_config.image_token_id",
        merge=2,  # a fixed 2 × 2 average pool in the model's code
        layout="hd_global",
    ),
)


def crop_grid(height: int, width: int, crop: int, dynamic_hd: int) -> tuple[int, int]:
    """(columns, rows) of crops for an image of ``height`` × ``width`` pixels (step 1)."""
    cols, rows = math.ceil(width / crop), math.ceil(height / crop)
    if cols * rows <= dynamic_hd:
        return cols, rows
    # By crop count; within a count, (i, j) order (the original sorts a set: its order among equal
    # counts is the set's, which matters only for exact ties of the aspect difference).
    grids = sorted({(i, j) for i in range(1, dynamic_hd + 1) for j in range(1, dynamic_hd + 1) if i * j <= dynamic_hd})
    grids.sort(key=lambda g: g[0] * g[1])
    best, best_diff = (1, 1), float("inf")
    for i, j in grids:
        diff = abs(width / height - i / j)
        if diff < best_diff:
            best, best_diff = (i, j), diff
        elif diff == best_diff and width * height > 0.5 * crop * crop * i * j:
            best = (i, j)
    return best


def resized_size(height: int, width: int, canvas_height: int, canvas_width: int) -> tuple[int, int]:
    """(height, width) of the image resized, aspect kept, until one side fills the canvas (step 2)."""
    if canvas_width / width < canvas_height / height:
        return int(height * canvas_width / width), canvas_width
    return canvas_height, int(width * canvas_height / height)


def padding_mask(height: int, width: int, crop: int, patch: int, dynamic_hd: int) -> torch.Tensor:
    """The stitched patch mask of an image's crop canvas: 1, but 0 on the last ⌊pad / p⌋ patch columns
    (rows) where the white padding is at least one patch wide (step 2)."""
    import torch

    cols, rows = crop_grid(height, width, crop, dynamic_hd)
    new_h, new_w = resized_size(height, width, crop * rows, crop * cols)
    mask = torch.ones(rows * (crop // patch), cols * (crop // patch))
    pad_h, pad_w = crop * rows - new_h, crop * cols - new_w
    if pad_w >= patch:
        mask[:, -(pad_w // patch) :] = 0
    if pad_h >= patch:
        mask[-(pad_h // patch) :, :] = 0
    return mask


def useful_tokens(height: int, width: int, crop: int, patch: int, dynamic_hd: int) -> tuple[int, int]:
    """(R, C): the high-resolution token rows and columns that show the image (step 6)."""
    m = crop // patch
    mask = padding_mask(height, width, crop, patch, dynamic_hd)
    rows, cols = mask.shape[0] // m, mask.shape[1] // m
    g = (m + 1) // 2
    # One entry per token of the 2 × 2 pool, taken crop by crop (as the model pools each crop).
    useful = mask.reshape(rows, m, cols, m)[:, 0::2, :, 0::2].reshape(rows * g, cols * g)
    return int(useful[:, 0].sum()), int(useful[0].sum())


def tile_grid(ip, setting, height: int, width: int) -> tuple[int, int]:
    """(rows, cols) of crops."""
    cols, rows = crop_grid(height, width, dict(ip.size)["height"], setting("dynamic_hd"))
    return rows, cols


def useful_grid(ip, setting, height: int, width: int) -> tuple[int, int]:
    """(R, C): the high-resolution token rows and columns that show the image, the crops' padding dropped."""
    crop = dict(ip.size)["height"]
    return useful_tokens(height, width, crop, setting("patch_size"), setting("dynamic_hd"))


@cache
def image_processor_class() -> type:
    """`Phi4MultimodalImageProcessorPil`, built once (see the module docstring)."""
    import numpy as np
    import torch
    import torch.nn.functional as F
    from PIL import Image
    from transformers.image_processing_backends import PilBackend
    from transformers.image_processing_utils import BatchFeature
    from transformers.image_utils import PILImageResampling, SizeDict
    from transformers.processing_utils import ImagesKwargs

    class Phi4ImagesKwargs(ImagesKwargs, total=False):
        """patch_size: the vision tower's patch; dynamic_hd: the most high-resolution crops per image."""

        patch_size: int
        dynamic_hd: int

    class Phi4MultimodalImageProcessorPil(PilBackend):
        """Phi-4-multimodal's image processor without torchvision (see the module docstring)."""

        resample = PILImageResampling.BICUBIC
        size = {"height": 448, "width": 448}
        patch_size = 14
        dynamic_hd = 36
        image_mean = [0.5, 0.5, 0.5]
        image_std = [0.5, 0.5, 0.5]
        do_rescale = True
        do_normalize = True
        do_convert_rgb = True
        valid_kwargs = Phi4ImagesKwargs
        model_input_names = ["image_pixel_values", "image_sizes", "image_attention_mask"]

        def _preprocess(
            self,
            images: list[np.ndarray],
            size: SizeDict,
            do_rescale: bool,
            rescale_factor: float,
            do_normalize: bool,
            image_mean,
            image_std,
            patch_size: int,
            dynamic_hd: int,
            return_tensors=None,
            **kwargs,
        ) -> BatchFeature:
            if size.height != size.width:
                raise ValueError(f"Phi-4-multimodal crops are square; got size {size.height}×{size.width}")
            crop = size.height
            m = crop // patch_size
            mean = torch.tensor(image_mean, dtype=torch.float32).view(3, 1, 1)
            std = torch.tensor(image_std, dtype=torch.float32).view(3, 1, 1)
            pixels, masks, tokens, canvases = [], [], [], []
            for image in images:
                canvas, mask = self._canvas(image, crop, patch_size, dynamic_hd)
                x = torch.from_numpy(canvas).permute(2, 0, 1).float()
                x = x * rescale_factor if do_rescale else x
                x = (x - mean) / std if do_normalize else x
                height, width = x.shape[-2:]
                if (height, width) == (crop, crop):
                    glob = x
                else:
                    glob = F.interpolate(x[None], size=(crop, crop), mode="bicubic", align_corners=False)[0]
                rows, cols = height // crop, width // crop
                crops = x.reshape(3, rows, crop, cols, crop).permute(1, 3, 0, 2, 4).reshape(-1, 3, crop, crop)
                crop_masks = mask.reshape(rows, m, cols, m).permute(0, 2, 1, 3).reshape(-1, m, m)
                pixels.append(torch.cat([glob[None], crops]))
                masks.append(torch.cat([torch.ones(1, m, m), crop_masks]))
                r, c = useful_tokens(*image.shape[1:], crop, patch_size, dynamic_hd)
                g = (m + 1) // 2
                tokens.append(r * (c + 1) + 1 + g * (g + 1))
                canvases.append([height, width])
            most = max(len(p) for p in pixels)
            pixels = [torch.cat([p, p.new_zeros(most - len(p), *p.shape[1:])]) for p in pixels]
            masks = [torch.cat([k, k.new_ones(most - len(k), *k.shape[1:])]) for k in masks]
            data = {
                "image_pixel_values": torch.stack(pixels),
                "image_sizes": torch.tensor(canvases, dtype=torch.long),
                "image_attention_mask": torch.stack(masks),
                "num_img_tokens": tokens,
            }
            return BatchFeature(data=data, tensor_type=return_tensors)

        def _canvas(self, image: np.ndarray, crop: int, patch: int, dynamic_hd: int) -> tuple[np.ndarray, torch.Tensor]:
            """The image (channels first, as the PIL backend hands it over) resized and padded white onto its
            crop canvas (H × W × 3 uint8), and its patch mask."""
            image = image.transpose(1, 2, 0)
            image = np.clip(np.rint(image), 0, 255).astype(np.uint8) if image.dtype != np.uint8 else image
            height, width = image.shape[:2]
            cols, rows = crop_grid(height, width, crop, dynamic_hd)
            new_h, new_w = resized_size(height, width, crop * rows, crop * cols)
            if min(new_h, new_w) < 10:
                raise ValueError(f"image {width}×{height} is too elongated: it would be resized to {new_w}×{new_h}")
            resized = np.asarray(Image.fromarray(image).resize((new_w, new_h), Image.Resampling.BILINEAR))
            canvas = np.full((crop * rows, crop * cols, 3), 255, np.uint8)
            canvas[:new_h, :new_w] = resized
            return canvas, padding_mask(height, width, crop, patch, dynamic_hd)

    Phi4MultimodalImageProcessorPil.__qualname__ = "Phi4MultimodalImageProcessorPil"
    return Phi4MultimodalImageProcessorPil


def __getattr__(name: str):
    # The class is importable by name (``from countlens.model.families.phi4_multimodal import ...``),
    # built on first use.
    if name == "Phi4MultimodalImageProcessorPil":
        return image_processor_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


FAMILY = Family(
    "phi4_multimodal",
    SPECS,
    names=("Phi4",),
    image_processors=("Phi4MultimodalImageProcessor",),
    tile_grid=tile_grid,
    useful_grid=useful_grid,
    pil_image_processors={"Phi4MultimodalImageProcessorPil": image_processor_class},
)
