"""Image processors countlens provides where transformers has only a torchvision one.

transformers 5.24 ships Phi-4-multimodal's and Llama 4's image processors only as torchvision
backends (Llama 4's: below, beside its class), and
torchvision has no CPU build beside the pinned torch on these machines. `Phi4MultimodalImageProcessorPil`
does that processor's documented steps with PIL, numpy and torch, and returns the same keys, shapes and
dtypes. It has **not** been compared with the torchvision path (which cannot run here); the one step
whose kernel differs is the high-resolution resize (PIL's bilinear, as Microsoft's original processor
did, where transformers calls torchvision's antialiased bilinear: both are PIL-style triangle
filters, measured within one grey level of each other).

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


# ---------------------------------------------------------------------------------------------- Llama 4
#
# Llama 4's image processor, whose transformers version needs torchvision, by its documented steps for
# one H × W image, tile side S (``size``), at most ``max_patches`` tiles:
#
# 1. Canvas: of the (a·S, b·S) canvases with a·b ≤ max_patches, the one whose limiting scale
#    min(aS / H, bS / W) is the smallest ≥ 1 (the largest with ``resize_to_max_canvas``), else the
#    largest < 1; ties to the smaller canvas (`llama4_canvas`).
# 2. Resize keeping the aspect into the canvas, enlarging no side past max(side, S) unless
#    ``resize_to_max_canvas`` (`llama4_resized`); pad right and bottom with 0 (−1 once normalised).
# 3. Rescale, normalise ((x / 255 − 0.5) / 0.5), cut the canvas into tiles row-major; beside several
#    tiles, a global tile: the whole image resized to S × S (stretched).
# transformers normalises in bfloat16 and resizes with torchvision's antialiased bilinear; this uses
# float32 and PIL's bilinear. Not compared with the torchvision path (it cannot run here).


class Llama4ImagesKwargs(ImagesKwargs, total=False):
    """max_patches: the most tiles per image; resize_to_max_canvas: enlarge to the largest canvas."""

    max_patches: int
    resize_to_max_canvas: bool


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
