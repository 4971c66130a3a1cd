"""How each image processor sizes an image: the image its vision tower sees, for any input size.

Fixed-size processors resize (or centre-crop) every image, or every tile, to one size (`fixed_size`).
Dynamic-resolution ones keep the image's aspect and choose a size by a rule of their own, each a
multiple of the patch × merge unit:

- **pixel budget** (Qwen2-VL … Qwen3.5: ``smart_resize``): the size nearest the image's whose area
  lies between ``size["shortest_edge"]`` and ``size["longest_edge"]`` pixels; GLM-4.1V counts the
  budget over the two temporal frames an image is repeated into, so its bounds are twice the area;
- **longest edge** (Pixtral / Mistral 3): shrunk (never enlarged) until its longest side fits
  ``size["longest_edge"]``, then each side rounded *up* to the unit;
- **token budget** (Gemma 4): enlarged or shrunk to the most ``max_soft_tokens`` pooled tokens its
  aspect allows, each side rounded *down* to the unit.

`processed_size` applies the processor's rule with its own settings (the rule's own function from
transformers where it has one); `default_size` is the square image countlens assumes when none is
given; `pin_square` makes a dynamic processor keep square images of one side. The token grid of
the result is `countlens.geometry.Geometry` (side ÷ patch ÷ merge); the arch matrix checks it
against each processor's own token count for several image sizes.
"""

from __future__ import annotations

import math

#: Image side assumed for dynamic-resolution processors when no size is given.
DEFAULT_DYNAMIC_SIDE = 448


def _name(ip) -> str:
    return type(ip).__name__


def _size(ip) -> dict:
    return {k: v for k, v in dict(getattr(ip, "size", None) or {}).items() if v is not None}


def fixed_size(ip) -> tuple[int, int] | None:
    """(height, width) every image (every tile, for tiling processors) is resized to, or None for
    dynamic resolution."""
    size = _size(ip)
    if _rule(ip) is not None:
        return None
    tile = dict(getattr(ip, "max_image_size", None) or {})
    if "longest_edge" in size and "longest_edge" in tile:  # Idefics3 / SmolVLM: square tiles of that side
        return tile["longest_edge"], tile["longest_edge"]
    crop = dict(getattr(ip, "crop_size", None) or {})
    if getattr(ip, "do_center_crop", False) and "height" in crop:
        return crop["height"], crop["width"]
    if "height" in size:
        return size["height"], size["width"]
    if "shortest_edge" in size:
        return size["shortest_edge"], size["shortest_edge"]
    return None


def _rule(ip) -> str | None:
    """The dynamic rule an image processor follows: "budget", "glm_budget", "longest_edge",
    "tokens", or None (a fixed size)."""
    name, size = _name(ip), _size(ip)
    if name.startswith("Glm4vImageProcessor"):
        return "glm_budget"
    if name.startswith("Gemma4ImageProcessor"):
        return "tokens"
    if name.startswith("PixtralImageProcessor"):
        return "longest_edge"
    if "shortest_edge" in size and "longest_edge" in size:  # Qwen: bounds on the pixel count
        return "budget"
    return None


def is_dynamic(ip) -> bool:
    return _rule(ip) is not None


def processed_size(ip, height: int, width: int, unit: int) -> tuple[int, int]:
    """(height, width) of the image the vision tower sees for an input of ``height`` × ``width`` pixels;
    ``unit`` = patch × merge (pixels per image token)."""
    rule, size = _rule(ip), _size(ip)
    if rule is None:
        fixed = fixed_size(ip)
        if fixed is None:
            raise ValueError(f"{_name(ip)}: no fixed size and no dynamic rule countlens knows")
        return fixed
    if rule == "budget":
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        return smart_resize(height, width, unit, size["shortest_edge"], size["longest_edge"])
    if rule == "glm_budget":
        from transformers.models.glm4v.image_processing_pil_glm4v import smart_resize as glm_resize

        frames = int(getattr(ip, "temporal_patch_size", 2))
        return glm_resize(
            frames, height, width, frames, unit, min_pixels=size["shortest_edge"], max_pixels=size["longest_edge"]
        )
    if rule == "longest_edge":
        # PixtralImageProcessor.resize: shrink by the longest side's ratio (floored), never enlarge, then
        # round each side up to whole tokens.
        ratio = max(height / size["longest_edge"], width / size["longest_edge"])
        if ratio > 1:
            height, width = int(math.floor(height / ratio)), int(math.floor(width / ratio))
        return math.ceil(height / unit) * unit, math.ceil(width / unit) * unit
    # Gemma 4: the most max_soft_tokens pooled tokens the aspect allows (the model pools ``unit``-px cells).
    if not getattr(ip, "do_resize", True):
        return height, width
    from transformers.models.gemma4.image_processing_pil_gemma4 import get_aspect_ratio_preserving_size

    kernel = int(ip.pooling_kernel_size)
    return get_aspect_ratio_preserving_size(
        height, width, int(ip.patch_size), int(ip.max_soft_tokens) * kernel**2, kernel
    )


def default_size(ip, unit: int) -> tuple[int, int]:
    """The square image countlens assumes for a processor when none is given: its fixed size, the side
    a pinned pixel budget keeps (`pin_square`), the longest edge, or else `DEFAULT_DYNAMIC_SIDE`
    processed by the processor's rule."""
    rule, size = _rule(ip), _size(ip)
    if rule is None:
        return fixed_size(ip)
    if rule in ("budget", "glm_budget"):
        frames = 2 if rule == "glm_budget" else 1
        lo, hi = size["shortest_edge"], size["longest_edge"]
        if lo == hi:
            side = round((lo / frames) ** 0.5)
            return processed_size(ip, side, side, unit)
    if rule == "longest_edge":
        side = size["longest_edge"]
        return processed_size(ip, side, side, unit)
    return processed_size(ip, DEFAULT_DYNAMIC_SIDE, DEFAULT_DYNAMIC_SIDE, unit)


def pin_square(ip, side: int) -> bool:
    """Set a dynamic processor to keep square images of ``side`` px as they are; False where it
    cannot (a fixed-size processor, or Gemma 4's token budget)."""
    rule = _rule(ip)
    if rule in ("budget", "glm_budget"):
        pixels = side * side * (2 if rule == "glm_budget" else 1)
        ip.size = {"shortest_edge": pixels, "longest_edge": pixels}
        return True
    if rule == "longest_edge":
        ip.size = {"longest_edge": side}
        return True
    return False
